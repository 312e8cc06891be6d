"""
nanochat.download against servers that misbehave: an endless body, a drip, a trickle past the deadline, a
redirect to file://, and the temp file a killed run left. Every bound is made tiny here (parameters, or the module's
defaults patched), so each test takes about a second; no test asserts a timing.
"""

import json
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


# -----------------------------------------------------------------------------
# Hardening VI, 5 and 7: the answer's headers, the documented cap, where a redirect may lead, what an error echoes


def trickle_headers(req):
    """A status line, then a header a byte every 50 ms: every read sees a byte long before its timeout (for up to
    20 s, a bound for the test; then the headers end, with a 5-byte body). The bytes it got out are counted in
    req.server.trickled."""
    req.wfile.write(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(400):
        req.wfile.write(b"x")
        req.wfile.flush()
        req.server.trickled = getattr(req.server, "trickled", 0) + 1
        time.sleep(0.05)
    req.wfile.write(b"\r\nContent-Length: 5\r\n\r\nhello")


def test_headers_trickled_a_byte_at_a_time_meet_the_minimum_rate(serve, tmp_path):
    """The rate's window opens with the request, not the body: headers still arriving when it closes fail the
    attempt, as a body that slow would. Before, each byte restarted the read timeout and the rate was never looked at."""
    server = serve({"/slow": trickle_headers})
    with pytest.raises(DownloadError, match=r"after 2 attempts: too slow: the answer had not begun \(its headers "
                                            r"incomplete\) 0.5 s after the request"):
        download_file(server.url + "/slow", str(tmp_path / "f.bin"), max_attempts=2, backoff=0.01, rate_window=0.5)
    assert server.requests["/slow"] == 2 and leftovers(tmp_path) == []


def test_headers_trickled_a_byte_at_a_time_end_at_the_deadline(serve, tmp_path):
    """One deadline from the request's start: a trickle of headers ends there, not retried."""
    server = serve({"/slow": trickle_headers})
    with pytest.raises(DownloadError, match=r"not finished within the 1 s deadline for one file \(its answer had not "
                                            r"begun\)"):
        download_file(server.url + "/slow", str(tmp_path / "f.bin"), backoff=0.01, deadline=1.0)
    assert server.requests["/slow"] == 1 and leftovers(tmp_path) == []
    time.sleep(0.2)  # the server's next byte meets the closed connection
    assert server.server.trickled < 100  # cut off at the deadline, not when the server chose to finish (400)


def test_a_hub_model_file_of_no_listed_size_stops_at_the_documented_cap(serve, tmp_path, monkeypatch):
    """Listed without a size and sent without Content-Length, a model file was capped at 256 GiB in code, where
    docs/data.md says 16 GiB: it is download_file's cap now (made 1 MiB here)."""
    from nanochat.common import UserError
    from nanochat.data.hub import fetch_model_files

    monkeypatch.setattr(download, "DEFAULT_MAX_BYTES", 1 << 20, raising=False)
    listing = json.dumps([{"type": "file", "path": "model_000001.pt"}]).encode()
    server = serve({"/api/models/o/n/tree/main?recursive=true": lambda req: (headers(req, len(listing)),
                                                                             req.wfile.write(listing)),
                    "/o/n/resolve/main/model_000001.pt": endless})
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(UserError, match=r"model_000001.pt: more than the 1,048,576 bytes this file may have"):
        fetch_model_files("o/n", "main", lambda listing: ["model_000001.pt"])
    assert server.requests["/o/n/resolve/main/model_000001.pt"] == 1


def test_a_redirect_to_plain_http_elsewhere_is_refused_at_once(serve, tmp_path):
    """A hub's redirect to its CDN is https; one to plain http on another host (here: the same server by another
    name) is refused, not followed, and not retried. Within the same plain http server it is followed."""
    body = b"the whole file"
    server = serve({"/file": lambda req: (headers(req, len(body)), req.wfile.write(body))})
    elsewhere = server.url.replace("127.0.0.1", "localhost") + "/file"

    def redirect(location):
        def answer(req):
            req.send_response(302)
            req.send_header("Location", location)
            req.send_header("Content-Length", "0")
            req.end_headers()
        return answer

    server.routes.update({"/away": redirect(elsewhere), "/here": redirect("/file")})
    with pytest.raises(DownloadError, match=rf"it redirects to {elsewhere}, plain http on another server; .*not "
                                            r"retrying"):
        download_file(server.url + "/away", str(tmp_path / "f.bin"), backoff=0.01)
    assert server.requests["/away"] == 1 and "/file" not in server.requests and leftovers(tmp_path) == []
    download_file(server.url + "/here", str(tmp_path / "f.bin"))
    assert (tmp_path / "f.bin").read_bytes() == body
    from nanochat.download import redirect_problem  # a downgrade from https, which a local test server cannot offer

    assert redirect_problem("https://hub.example/x", "http://hub.example/x") == "plain http from https"
    assert redirect_problem("https://hub.example/x", "https://cdn.example/y") is None


def test_a_redirects_body_is_never_read(serve, tmp_path):
    """requests read a redirect's body whole into memory before following it; one that does not end (64 MiB here, a
    bound for the test) is now left unread: the connection is closed after its headers."""
    body, sent = b"the whole file", []

    def redirect_with_a_body(req):
        req.send_response(302)
        req.send_header("Location", "/file")
        req.end_headers()
        block = b"x" * 65536
        for _ in range(1024):
            req.wfile.write(block)
            sent.append(len(block))

    server = serve({"/redirect": redirect_with_a_body, "/file": lambda req: (headers(req, len(body)),
                                                                              req.wfile.write(body))})
    download_file(server.url + "/redirect", str(tmp_path / "f.bin"))
    assert (tmp_path / "f.bin").read_bytes() == body
    time.sleep(0.2)  # the server's writes end at the closed connection
    assert sum(sent) < 32 << 20, sum(sent)


def test_a_json_answer_that_is_not_json_is_described_not_echoed(serve, tmp_path):
    """A failed listing quoted 200 characters of the server's answer into the error (a terminal's escape sequences,
    whatever it liked); it says what the answer was now."""
    from nanochat.data.hub import fetch_json

    answer = b"<html>\x1b]0;owned\x07 secret-session-token-4242 </html>"
    server = serve({"/api": lambda req: (headers(req, len(answer)), req.wfile.write(answer))})
    with pytest.raises(DownloadError, match=r"expected JSON, got 50 characters that are not \(Expecting value") as e:
        fetch_json(server.url + "/api")
    assert "secret" not in str(e.value) and "owned" not in str(e.value) and "html" not in str(e.value)
