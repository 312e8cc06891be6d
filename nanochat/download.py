"""
The one way nanochat fetches a file over HTTP (shards, the CORE eval bundle, hub files): `download_file`. Each
attempt streams into a temp file of its own, is checked (announced size, sha256, size cap, the caller's `validate`)
and only then renamed into place; network errors, 5xx answers and failed checks are retried with backoff, a 4xx is
final. Whatever the server does, a download is bounded in size, in time (stall, drip, DEADLINE, from the request's
start: its headers too) and in where it goes (http(s) only; plain http never to another host); temp files a killed run
left are removed by the next download of the same file.
"""

import hashlib
import os
import random
import re
import shutil
import socket
import threading
import time
from urllib.parse import urljoin, urlsplit

import requests
import urllib3

from nanochat.common import UserError

HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
HTTP_TIMEOUT = (10, 30)  # seconds to connect, and to wait for the next bytes before calling the attempt stalled
MIN_RATE = 10_000  # bytes a second, averaged over RATE_WINDOW seconds: a slower attempt is a drip, not a download
RATE_WINDOW = 60.0
DEADLINE = 24 * 3600.0  # seconds for one file, every attempt and backoff included: a trickle just above MIN_RATE ends
DEFAULT_MAX_BYTES = 16 << 30  # a body whose size nobody announced stops here (the largest file we fetch is far smaller)
STALE_TEMP_SECONDS = 600  # a live attempt writes far more often than this (the stall timeout and MIN_RATE see to it)
READ_SIZE = 1 << 16


class DownloadError(UserError):
    """A file could not be fetched and verified after every attempt."""


class AttemptFailed(Exception):
    """One attempt went wrong in a way worth retrying (validate callbacks raise it too)."""


def sha256_from_etag(value):
    """The hub sends an LFS file's sha256 as its (X-Linked-)ETag; anything else (md5, git sha1) is not usable."""
    if not value:
        return None
    value = value.strip().removeprefix("W/").strip('"')
    return value.lower() if HEX64.match(value) else None


def _promised_by_server(response):
    """(size, sha256) the server vouches for, looking at the final response and any redirects before it."""
    chain = [response] + list(reversed(response.history))
    etags = (sha256_from_etag(r.headers.get(key)) for r in chain for key in ("X-Linked-Etag", "ETag"))
    sha = next((s for s in etags if s), None)
    size = _byte_count(response.headers.get("Content-Length"), "Content-Length")
    linked_size = _byte_count(next((r.headers["X-Linked-Size"] for r in chain if "X-Linked-Size" in r.headers), None),
                              "X-Linked-Size")
    if linked_size is not None:
        if size is not None and linked_size != size:
            raise AttemptFailed(f"Content-Length {size} disagrees with X-Linked-Size {linked_size}")
        size = linked_size
    return size, sha


def _byte_count(value, header):
    if value is None:
        return None
    if not value.strip().isdigit():
        raise AttemptFailed(f"the server's {header} {value[:40]!r} is not a number of bytes")
    return int(value)


class _Clock:
    """The limits in time of one download_file call: its overall deadline, and the rate of the current attempt."""

    def __init__(self, url, deadline, min_rate, rate_window):
        self.url, self.deadline, self.min_rate, self.rate_window = url, deadline, min_rate, rate_window
        self.t0 = time.monotonic()

    def remaining(self):
        left = self.deadline - (time.monotonic() - self.t0)
        if left <= 0:
            raise DownloadError(f"cannot download {self.url}: not finished within the {self.deadline:g} s deadline "
                                "for one file")
        return left

    def start_attempt(self):
        self.window_start, self.window_bytes = time.monotonic(), 0

    def received(self, n):
        """Count n more bytes; fail the attempt when the last rate_window seconds brought fewer than min_rate a second."""
        self.window_bytes += n
        elapsed = time.monotonic() - self.window_start
        if elapsed >= self.rate_window:
            if self.window_bytes < self.min_rate * elapsed:
                raise AttemptFailed(f"too slow: {self.window_bytes:,} bytes in {elapsed:.1f} s, under the minimum "
                                    f"rate of {self.min_rate:,} bytes/s")
            self.start_attempt()


class _Watchdog:
    """Cuts an attempt's connections when its answer has not begun in time. A socket's read timeout restarts with
    every byte, so without it a server trickling its headers a byte every few seconds holds a request forever."""

    def __init__(self, seconds):
        self.lock, self.connections, self.fired, self.answered = threading.Lock(), [], False, False
        self.timer = threading.Timer(seconds, self.fire)
        self.timer.daemon = True
        self.timer.start()

    def watch(self, connection):
        """A connection just connected: cut at once if the time is up already (it was connecting then)."""
        with self.lock:
            self.connections.append(connection)
            if self.fired:
                self.cut(connection)

    def fire(self):
        with self.lock:
            if self.answered:
                return
            self.fired = True
            for connection in self.connections:
                self.cut(connection)

    @staticmethod
    def cut(connection):
        try:  # socket's own shutdown, under TLS too: the blocked read sees the end of the stream
            socket.socket.shutdown(connection.sock, socket.SHUT_RDWR)
        except (OSError, TypeError):  # closed already
            pass

    def stop(self):
        """The headers are in (or the request failed): from here the body's own checks bound the attempt. True when
        the watchdog had fired first, so that what the request returned is cut short."""
        with self.lock:
            self.answered = True
        self.timer.cancel()
        return self.fired


def _watch_pools(manager, watch):
    """Make every connection of a urllib3 pool manager report itself to `watch` once connected."""
    def watched(connection_cls):
        def connect(self):
            connection_cls.connect(self)
            watch(self)

        return type(connection_cls.__name__, (connection_cls,), {"connect": connect})

    manager.pool_classes_by_scheme = {
        scheme: type(pool.__name__, (pool,), {"ConnectionCls": watched(pool.ConnectionCls)})
        for scheme, pool in manager.pool_classes_by_scheme.items()}


class _WatchedAdapter(requests.adapters.HTTPAdapter):
    def __init__(self, watch):
        self.watch = watch  # before HTTPAdapter's __init__, which makes the pool manager
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        _watch_pools(self.poolmanager, self.watch)

    def proxy_manager_for(self, proxy, **kwargs):
        fresh = proxy not in self.proxy_manager
        manager = super().proxy_manager_for(proxy, **kwargs)
        if fresh and hasattr(manager, "pool_classes_by_scheme"):
            _watch_pools(manager, self.watch)
        return manager


def redirect_problem(source, target):
    """Why a download may not follow a redirect from `source` to `target`, or None. Plain http only within the plain
    http server it came from: elsewhere (a downgrade from https, another host) anyone on the way may answer, and a file
    no sha256 vouches for would be kept as it came. Other schemes are requests' to refuse (InvalidSchema)."""
    before, after = urlsplit(source), urlsplit(target)
    if after.scheme.lower() != "http" or (before.scheme.lower() == "http" and before.netloc.lower() == after.netloc.lower()):
        return None
    return "plain http on another server" if before.scheme.lower() == "http" else "plain http from https"


class _Session(requests.Session):
    """requests' session with our bounds on redirects: where they lead (redirect_problem), and their bodies, which are
    never read (requests would read one whole into memory, and it may not end)."""

    def __init__(self, watch):
        super().__init__()
        adapter = _WatchedAdapter(watch)
        self.mount("http://", adapter)
        self.mount("https://", adapter)

    def get_redirect_target(self, response):
        target = super().get_redirect_target(response)
        if target:
            target_url = urljoin(response.url, target)
            problem = redirect_problem(response.url, target_url)
            if problem:
                raise DownloadError(f"cannot download {response.url}: it redirects to {target_url[:200]}, {problem}; a "
                                    "download follows a redirect to https, or within its own plain http server (not "
                                    "retrying)")
            response.raw.close()
            response._content, response._content_consumed = b"", True
        return target


def _fetch_once(url, tmp_path, timeout, expected_sha256, max_bytes, on_bytes, stop, clock):
    """Stream url into tmp_path and check it. Raises AttemptFailed (retry) or DownloadError (give up)."""
    connect_timeout, read_timeout = timeout if isinstance(timeout, tuple) else (timeout, timeout)
    # A read may not outlast the deadline: the socket's timeout is the smaller of the two.
    read_timeout = min(read_timeout, clock.remaining())
    # The rate's window opens with the request, and the answer must have begun (its headers in) within that window or
    # by the deadline, whichever comes first: the watchdog cuts the connection then.
    clock.start_attempt()
    deadline_first = clock.remaining() <= clock.rate_window
    watchdog = _Watchdog(min(clock.rate_window, clock.remaining()))
    session = _Session(watchdog.watch)
    error = None
    try:
        # identity encoding: Content-Length and the hash must describe exactly the bytes we store
        response = session.get(url, stream=True, timeout=(connect_timeout, read_timeout),
                               headers={"Accept-Encoding": "identity"})
    except requests.RequestException as e:
        error = e
    except BaseException:  # a redirect refused (DownloadError), an interrupt
        watchdog.stop()
        session.close()
        raise
    if watchdog.stop() or error is not None:
        session.close()
    if watchdog.fired:  # the answer had not begun in time: whatever the request returned was cut short
        if deadline_first:
            raise DownloadError(f"cannot download {url}: not finished within the {clock.deadline:g} s deadline for one "
                                "file (its answer had not begun)")
        raise AttemptFailed(f"too slow: the answer had not begun (its headers incomplete) {clock.rate_window:g} s after "
                            f"the request, under the minimum rate of {clock.min_rate:,} bytes/s")
    if isinstance(error, (requests.exceptions.InvalidSchema, requests.exceptions.InvalidURL,
                          requests.exceptions.MissingSchema, requests.exceptions.TooManyRedirects)):
        # a redirect to file://, or in circles: asking again gets the same answer
        raise DownloadError(f"cannot download {url}: {type(error).__name__}: {error} (not retrying)") from None
    if error is not None:
        raise AttemptFailed(f"request failed ({type(error).__name__}: {error})") from error
    with session, response:
        status = response.status_code
        if status >= 400:
            message = f"HTTP {status} {response.reason}"
            if 400 <= status < 500 and status not in (408, 425, 429):
                raise DownloadError(f"cannot download {url}: {message} (not retrying a client error)")
            raise AttemptFailed(message)
        size, server_sha = _promised_by_server(response)
        if size is not None and size > max_bytes:
            raise DownloadError(f"cannot download {url}: the server announces {size:,} bytes, more than the "
                                f"{max_bytes:,} this file may have")
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(tmp_path))).free
        if size is not None and size > free:
            raise DownloadError(f"cannot download {url}: it is {size:,} bytes and {os.path.dirname(tmp_path)} has "
                                f"{free:,} bytes free; free some space and run again")
        limit = size if size is not None else max_bytes  # the body may never outgrow what was announced
        hasher = hashlib.sha256()
        received = 0
        try:
            with open(tmp_path, "wb") as f:
                while True:
                    # read1: whatever has arrived, up to READ_SIZE, so a drip comes back here to be timed
                    chunk = response.raw.read1(READ_SIZE, decode_content=True)
                    if not chunk:
                        break
                    if stop.is_set():
                        raise KeyboardInterrupt
                    received += len(chunk)
                    if received > limit:
                        raise DownloadError(f"cannot download {url}: more than the {limit:,} bytes this file may have")
                    f.write(chunk)
                    hasher.update(chunk)
                    on_bytes(len(chunk))
                    clock.received(len(chunk))
                    clock.remaining()
                f.flush()
                os.fsync(f.fileno())
        except urllib3.exceptions.ReadTimeoutError:
            raise AttemptFailed(f"stalled: no bytes for {read_timeout:g} s after {received:,}") from None
        except (requests.RequestException, urllib3.exceptions.HTTPError) as e:  # socket errors, short reads
            expected = f" (expected {size} bytes)" if size is not None else ""
            raise AttemptFailed(f"connection broken mid-file{expected}: {type(e).__name__}: {e}") from e
        except OSError as e:  # a full disk, a read-only folder: another attempt would fail alike
            raise DownloadError(f"cannot download {url}: cannot write {tmp_path} ({e.strerror or e}); free some "
                                "space or make the folder writable, and run again") from None
    if size is not None and received != size:
        raise AttemptFailed(f"size mismatch: got {received} bytes, server said {size}")
    digest = hasher.hexdigest()
    if server_sha is not None and digest != server_sha:
        raise AttemptFailed(f"sha256 mismatch: got {digest}, server said {server_sha}")
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise AttemptFailed(f"sha256 mismatch: got {digest}, expected {expected_sha256}")


def _process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def remove_stale_temp_files(path):
    """Remove the temp files a killed download of `path` left (path.tmpPID.TID): its process is gone and the file
    has not been written for STALE_TEMP_SECONDS. A live attempt, in this process or another, keeps its file."""
    directory, base = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(base) + r"\.tmp(\d+)\.\d+")
    for name in os.listdir(directory):
        match = pattern.fullmatch(name) if name.startswith(base) else None  # a folder of 6,543 shards, listed per shard
        if not match or int(match.group(1)) == os.getpid() or _process_alive(int(match.group(1))):
            continue
        temp = os.path.join(directory, name)
        try:
            if time.time() - os.path.getmtime(temp) > STALE_TEMP_SECONDS:
                os.remove(temp)
        except FileNotFoundError:  # another process cleaned it first
            pass


def download_file(url, path, max_attempts=5, backoff=2.0, timeout=HTTP_TIMEOUT, expected_sha256=None, max_bytes=None,
                  validate=None, on_bytes=None, stop=None, min_rate=None, rate_window=None, deadline=None):
    """Fetch url to path (verified, atomically renamed into place) and return path. `validate(tmp_path)` may raise
    AttemptFailed to reject what arrived; `on_bytes(n)` reports progress; setting `stop` abandons the download with
    KeyboardInterrupt. The temp file is this call's own, so two processes fetching one file never mix their bytes."""
    if urlsplit(url).scheme not in ("http", "https"):
        raise DownloadError(f"cannot download {url}: only http:// and https:// URLs are fetched")
    on_bytes = on_bytes or (lambda n: None)
    stop = stop or threading.Event()
    max_bytes = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
    clock = _Clock(url, DEADLINE if deadline is None else deadline, MIN_RATE if min_rate is None else min_rate,
                   RATE_WINDOW if rate_window is None else rate_window)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    remove_stale_temp_files(path)
    tmp_path = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    problem = None
    for attempt in range(1, max_attempts + 1):
        try:
            _fetch_once(url, tmp_path, timeout, expected_sha256, max_bytes, on_bytes, stop, clock)
            if validate is not None:
                validate(tmp_path)
            os.replace(tmp_path, path)
            return path
        except AttemptFailed as e:
            problem = str(e)
        finally:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
        if attempt < max_attempts:
            # jitter keeps parallel workers from retrying in lockstep against a rate limit
            delay = backoff * 2 ** (attempt - 1) * (1 + 0.25 * random.random())
            if stop.wait(min(delay, 120.0, clock.remaining())):
                raise KeyboardInterrupt
    raise DownloadError(f"failed to download {url} after {max_attempts} attempts: {problem}")
