"""
nanochat.download against servers that misbehave: an endless body, a drip, a trickle past the deadline, a
redirect to file://, and the temp file a killed run left. Every bound is made tiny here (parameters, or the module's
defaults patched), so each test takes about a second; no test asserts a timing.
"""

import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nanochat import download
from nanochat.download import DownloadError, download_file

pytestmark = [pytest.mark.quick, pytest.mark.timeout(120)]


class ScriptedServer:
    """A local server answering GET {path} with routes[path](handler); it counts the requests per path."""

    def __init__(self, routes):
        self.routes, self.requests = routes, {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests[self.path] = server.requests.get(self.path, 0) + 1
                try:
                    server.routes[self.path](self)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up first, as it should
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    servers = []

    def start(routes):
        servers.append(ScriptedServer(routes))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def headers(req, length=None):
    req.send_response(200)
    if length is not None:
        req.send_header("Content-Length", str(length))
    req.end_headers()


def endless(req):
    """No Content-Length, body until the connection closes: 64 KiB blocks, up to 8 MiB (a bound for the test)."""
    headers(req)
    for _ in range(128):
        req.wfile.write(b"x" * 65536)


def drip(req):
    """A 1,000-byte file, one byte every 20 ms: the read timeout never fires."""
    headers(req, 1000)
    for _ in range(1000):
        req.wfile.write(b"x")
        req.wfile.flush()
        time.sleep(0.02)


def trickle(req):
    """2 KiB every 20 ms (~100 KB/s, well above any minimum rate) of a 10 MB file: it would take 100 s."""
    headers(req, 10_000_000)
    for _ in range(5000):
        req.wfile.write(b"x" * 2000)
        req.wfile.flush()
        time.sleep(0.02)


def stall(req):
    """A 50 MB file of which 1 KB comes, then nothing (for up to 10 s, a bound for the test)."""
    headers(req, 50_000_000)
    req.wfile.write(b"x" * 1000)
    req.wfile.flush()
    time.sleep(10)


def redirect_to_file(req):
    req.send_response(302)
    req.send_header("Location", "file:///etc/passwd")
    req.send_header("Content-Length", "0")
    req.end_headers()


def leftovers(directory):
    return sorted(os.listdir(directory))


def test_a_body_of_no_announced_size_stops_at_the_default_cap(serve, tmp_path, monkeypatch):
    """A server that never ends its body (no Content-Length) is cut off at DEFAULT_MAX_BYTES, once, not retried."""
    monkeypatch.setattr(download, "DEFAULT_MAX_BYTES", 1 << 20, raising=False)
    server = serve({"/endless": endless})
    with pytest.raises(DownloadError, match=r"more than the 1,048,576 bytes this file may have"):
        download_file(server.url + "/endless", str(tmp_path / "f.bin"), backoff=0.01)
    assert server.requests["/endless"] == 1 and leftovers(tmp_path) == []


def test_a_dripping_server_is_given_up_at_the_minimum_rate(serve, tmp_path, monkeypatch):
    """The module's MIN_RATE and RATE_WINDOW, made tiny: what every caller gets without passing a thing."""
    monkeypatch.setattr(download, "MIN_RATE", 500, raising=False)
    monkeypatch.setattr(download, "RATE_WINDOW", 0.3, raising=False)
    server = serve({"/drip": drip})
    with pytest.raises(DownloadError, match=r"after 2 attempts: too slow: .* under the minimum rate of 500 bytes/s"):
        download_file(server.url + "/drip", str(tmp_path / "f.bin"), max_attempts=2, backoff=0.01)
    assert server.requests["/drip"] == 2 and leftovers(tmp_path) == []
    # a parameter says the same for one call
    with pytest.raises(DownloadError, match=r"after 1 attempts: too slow: .* under the minimum rate of 200 bytes/s"):
        download_file(server.url + "/drip", str(tmp_path / "f.bin"), max_attempts=1, min_rate=200, rate_window=0.2)


def test_a_download_ends_at_its_deadline_and_is_not_retried(serve, tmp_path):
    server = serve({"/trickle": trickle})
    with pytest.raises(DownloadError, match=r"not finished within the 1 s deadline"):
        download_file(server.url + "/trickle", str(tmp_path / "f.bin"), backoff=0.01, deadline=1.0)
    assert server.requests["/trickle"] == 1 and leftovers(tmp_path) == []


def test_a_stalled_download_says_so_and_leaves_no_temp_file(serve, tmp_path):
    server = serve({"/stall": stall})
    with pytest.raises(DownloadError, match=r"after 2 attempts: stalled: no bytes for 0.3 s after 1,000"):
        download_file(server.url + "/stall", str(tmp_path / "f.bin"), max_attempts=2, backoff=0.01, timeout=(5, 0.3))
    assert server.requests["/stall"] == 2 and leftovers(tmp_path) == []


def test_a_redirect_to_file_is_refused_at_once(serve, tmp_path):
    server = serve({"/redirect": redirect_to_file})
    with pytest.raises(DownloadError, match=r"InvalidSchema.*file:///etc/passwd.*not retrying"):
        download_file(server.url + "/redirect", str(tmp_path / "f.bin"), backoff=0.01)
    assert server.requests["/redirect"] == 1 and leftovers(tmp_path) == []
    with pytest.raises(DownloadError, match=r"only http:// and https:// URLs"):
        download_file("file:///etc/passwd", str(tmp_path / "f.bin"))


def test_the_temp_file_of_a_killed_download_is_removed_by_the_next(serve, tmp_path):
    """A run killed mid-file (say, stalled on a 10 GB Content-Length) leaves path.tmpPID.TID; the next download of
    that file removes it once its process is gone and it has sat untouched. A live one, here ours, is kept."""
    body = b"the whole file"
    server = serve({"/file": lambda req: (headers(req, len(body)), req.wfile.write(body))})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"f.bin.tmp{int(dead.stdout)}.140000000000"
    stale.write_bytes(b"x" * 1000)
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    live = tmp_path / f"f.bin.tmp{os.getpid()}.1"  # another thread of this process, still downloading
    live.write_bytes(b"x")
    os.utime(live, (an_hour_ago, an_hour_ago))
    download_file(server.url + "/file", str(tmp_path / "f.bin"))
    assert (tmp_path / "f.bin").read_bytes() == body
    assert leftovers(tmp_path) == ["f.bin", live.name]
