"""
The one way nanochat fetches a file over HTTP: pretraining shards, the CORE eval bundle and the
chat-task parquet files all come through `download_file`.

Each attempt streams into a temp file of its own next to the destination, checks it (the size the
server promised, the sha256 the server or the caller vouches for, an optional size cap and a
caller's `validate` check) and only then renames it into place, so the destination path never
holds a partial or unverified file. Network errors, 5xx answers and failed checks are retried with
exponential backoff and jitter; a 4xx answer is final. After the last attempt a DownloadError
names the URL and the last problem.
"""

import hashlib
import os
import random
import re
import threading

import requests

from nanochat.common import UserError

HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
HTTP_TIMEOUT = (10, 60)  # seconds to connect, and to wait for the next bytes before calling the attempt failed


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
    size = response.headers.get("Content-Length")
    linked_size = next((r.headers["X-Linked-Size"] for r in chain if "X-Linked-Size" in r.headers), None)
    size = int(size) if size is not None else None
    if linked_size is not None:
        if size is not None and int(linked_size) != size:
            raise AttemptFailed(f"Content-Length {size} disagrees with X-Linked-Size {linked_size}")
        size = int(linked_size)
    return size, sha


def _fetch_once(url, tmp_path, timeout, expected_sha256, max_bytes, on_bytes, stop):
    """Stream url into tmp_path and check it. Raises AttemptFailed (retry) or DownloadError (give up)."""
    # identity encoding: Content-Length and the hash must describe exactly the bytes we store
    try:
        response = requests.get(url, stream=True, timeout=timeout, headers={"Accept-Encoding": "identity"})
    except requests.RequestException as e:
        raise AttemptFailed(f"request failed ({type(e).__name__}: {e})") from e
    with response:
        status = response.status_code
        if status >= 400:
            message = f"HTTP {status} {response.reason}"
            if 400 <= status < 500 and status not in (408, 425, 429):
                raise DownloadError(f"cannot download {url}: {message} (not retrying a client error)")
            raise AttemptFailed(message)
        size, server_sha = _promised_by_server(response)
        if max_bytes is not None and size is not None and size > max_bytes:
            raise DownloadError(f"cannot download {url}: the server announces {size:,} bytes, more than the "
                                f"{max_bytes:,} this file may have")
        hasher = hashlib.sha256()
        received = 0
        try:
            with open(tmp_path, "wb") as f:
                for chunk in response.iter_content(chunk_size=1 << 16):
                    if stop.is_set():
                        raise KeyboardInterrupt
                    received += len(chunk)
                    if max_bytes is not None and received > max_bytes:
                        raise DownloadError(f"cannot download {url}: more than the {max_bytes:,} bytes this file may have")
                    f.write(chunk)
                    hasher.update(chunk)
                    on_bytes(len(chunk))
                f.flush()
                os.fsync(f.fileno())
        except requests.RequestException as e:  # urllib3 wraps socket errors and short reads into these
            expected = f" (expected {size} bytes)" if size is not None else ""
            raise AttemptFailed(f"connection broken mid-file{expected}: {type(e).__name__}: {e}") from e
    if size is not None and received != size:
        raise AttemptFailed(f"size mismatch: got {received} bytes, server said {size}")
    digest = hasher.hexdigest()
    if server_sha is not None and digest != server_sha:
        raise AttemptFailed(f"sha256 mismatch: got {digest}, server said {server_sha}")
    if expected_sha256 is not None and digest != expected_sha256.lower():
        raise AttemptFailed(f"sha256 mismatch: got {digest}, expected {expected_sha256}")


def download_file(url, path, max_attempts=5, backoff=2.0, timeout=HTTP_TIMEOUT, expected_sha256=None, max_bytes=None,
                  validate=None, on_bytes=None, stop=None):
    """
    Fetch url to path (verified, atomically renamed into place) and return path. `validate(tmp_path)` may
    raise AttemptFailed to reject what arrived; `on_bytes(n)` reports progress; setting the `stop` event
    abandons the download with KeyboardInterrupt. The temp file is unique to this call, so two processes
    fetching the same file never write into each other's bytes (the last complete one wins the rename).
    """
    on_bytes = on_bytes or (lambda n: None)
    stop = stop or threading.Event()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp_path = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    problem = None
    for attempt in range(1, max_attempts + 1):
        try:
            _fetch_once(url, tmp_path, timeout, expected_sha256, max_bytes, on_bytes, stop)
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
            if stop.wait(min(delay, 120.0)):
                raise KeyboardInterrupt
    raise DownloadError(f"failed to download {url} after {max_attempts} attempts: {problem}")
