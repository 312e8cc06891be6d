"""
chat_web as a hostile client or a web page would try it (issue 49): a flood of idle sockets under the common limit of
1,024 open files, slow headers, a full queue, a client that leaves while queued, a stop in the middle of replies, a
text/plain POST and a rebinding Host; and the settings that must be refused or right at start.
"""

import json
import random
import resource
import signal
import socket
import threading
import time

import httpx
import pytest

from bench.serve import ChatWeb
from test_chat_web import HELLO, LONG_REPLY, Server, sse_events, wait_until, web_base_dir  # noqa: F401 (a fixture)


def test_a_flood_of_idle_sockets_does_not_lock_out_a_keyed_client(web_base_dir):  # noqa: F811
    def small_file_limit():  # the common default, which the server cannot raise
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    server = Server(web_base_dir, "--api-key", "sekrit", "--header-timeout", "2", preexec_fn=small_file_limit)
    sockets = []
    try:
        host, port = server.url.removeprefix("http://").split(":")
        for _ in range(1500):  # connect and say nothing
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex((host, int(port)))
            sockets.append(s)
        time.sleep(0.5)
        keyed = {"Authorization": "Bearer sekrit"}
        started = time.monotonic()
        reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, headers=keyed,
                           timeout=30)
        assert reply.status_code == 200 and time.monotonic() - started < 10, reply.text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        # a connection that sends its headers a little at a time and never ends them is closed after the timeout
        slow = socket.create_connection((host, int(port)))
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow.settimeout(10)
        started = time.monotonic()
        assert slow.recv(100) == b"" and time.monotonic() - started < 5  # closed by the server
        slow.close()
        # so is one whose headers are whole but whose body never comes (it never counts as a request being served)
        body = socket.create_connection((host, int(port)))
        body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer sekrit\r\nContent-Length: 1000\r\n\r\n{")
        body.settimeout(10)
        started = time.monotonic()
        assert body.recv(100) == b"" and time.monotonic() - started < 5
        body.close()
        assert "Too many open files" not in "".join(server.lines)
    finally:
        for s in sockets:
            s.close()
        server.stop()


def send_request(host, port, path, body, key=None, receive_buffer=None):
    """A raw keep-alive POST on a socket of its own, which nobody reads (receive_buffer: its SO_RCVBUF)."""
    s = socket.socket()
    if receive_buffer:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    s.connect((host, int(port)))
    raw = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
              f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return s


def test_clients_that_never_read_their_streams_cannot_lock_out_others(web_base_dir):  # noqa: F811
    """Streams to sockets that never read (a 1 KB receive buffer) fill every connection slot: a keyed request and
    /health are still answered (the reply that has waited longest on its client makes room), and every stalled reply
    is closed after --write-timeout, its generation cancelled and its row freed. (A reply stalls once the kernel's
    send buffer, up to 4 MB on Linux, and asyncio's 64 KB are full: these are 8 replies of ~1.3 KB a token.)"""
    server = Server(web_base_dir, "--api-key", "sekrit", "--max-connections", "5", "--write-timeout", "2")
    streams = []
    try:
        host, port = server.url.removeprefix("http://").split(":")
        keyed = {"Authorization": "Bearer sekrit"}
        stats = lambda: httpx.get(f"{server.url}/stats", headers=keyed, timeout=10).json()  # noqa: E731
        body = {"messages": HELLO, "max_tokens": LONG_REPLY, "logprobs": True, "top_logprobs": 20, "n": 8, "stream": True}
        streams = [send_request(host, port, "/v1/chat/completions", body, "sekrit", receive_buffer=1024)
                   for _ in range(5)]
        wait_until(lambda: stats()["connections"]["stalled"] >= 4, 20, "the streams to stall on their clients")
        started = time.monotonic()
        for _ in range(3):  # every slot is taken, by replies nobody reads: a new client still gets in, each time
            reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4},
                               headers=keyed, timeout=10)
            assert reply.status_code == 200, reply.text
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert time.monotonic() - started < 5
        wait_until(lambda: stats()["connections"]["closed_stalled"] >= 5 and stats()["batch"]["active"] == 0, 20,
                   "the stalled replies to be closed and their rows freed")
        assert stats()["requests_cancelled"] >= 1  # generations cut off, not run to max_tokens
        assert "closed a connection whose client read nothing of its reply for 2 s" in "".join(server.lines)
    finally:
        for s in streams:
            s.close()
        server.stop()


def test_a_maximal_scoring_request_blocks_no_one_and_ends_when_its_client_leaves(web_base_dir):  # noqa: F811
    """64 prompts of 2,046 ids scored with 5 alternatives a token (a ~20 MB reply), on a 2,048-token model: /health
    answers within a second throughout, a stream decoding beside it keeps its pace (it is scored in slices between
    decode steps), and the same request from a client that gives up is withdrawn from the worker."""
    server = Server(web_base_dir, "--workers", "1", "--queue-timeout", "60")
    try:
        url = server.url
        rng = random.Random(0)
        big = {"prompt": [[rng.randrange(256) for _ in range(2046)] for _ in range(64)], "max_tokens": 0, "echo": True,
               "logprobs": 5}
        result, health, gaps = {}, [], []

        def score():
            started = time.monotonic()
            result["response"] = httpx.post(f"{url}/v1/completions", json=big, timeout=300)
            result["seconds"] = time.monotonic() - started

        scoring = threading.Thread(target=score)
        scoring.start()
        wait_until(lambda: httpx.get(f"{url}/stats").json()["scoring"]["requests"] == 1, 30, "the scoring to start")
        last, beside = time.monotonic(), 0
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": HELLO, "max_tokens": 200, "stream": True}) as stream:
            for line in stream.iter_lines():
                chunk = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):  # tokens, not the role
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
                if scoring.is_alive():
                    beside += 1
                    started = time.monotonic()
                    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
                    health.append(time.monotonic() - started)
        assert beside >= 10, "the stream should have run while the scoring did"
        while scoring.is_alive():
            started = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
            health.append(time.monotonic() - started)
            time.sleep(0.05)
        scoring.join()
        response = result["response"]
        assert response.status_code == 200, response.text[:300]
        choices = response.json()["choices"]
        assert len(choices) == 64 and all(len(c["logprobs"]["top_logprobs"]) == 2046 for c in choices)
        assert max(health) < 1.0, (max(health), len(health))
        assert gaps[0] < 1.0 and max(gaps) < 1.0, (gaps[0], max(gaps), result["seconds"])
        print(f"scoring {result['seconds']:.1f} s; /health at most {max(health) * 1000:.0f} ms over {len(health)}; "
              f"the stream's first token {gaps[0] * 1000:.0f} ms, its tokens at most {max(gaps) * 1000:.0f} ms apart")
        # the same request, from a client that gives up after half a second: its slices not yet run never run
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/v1/completions", json=big, timeout=0.5)
        wait_until(lambda: httpx.get(f"{url}/stats").json()["scoring"]["requests"] == 0, 0.8 * result["seconds"],
                   "the scoring to be withdrawn")
    finally:
        server.stop()


def test_a_full_queue_a_client_that_leaves_it_and_a_stop_in_the_middle_of_replies(web_base_dir):  # noqa: F811
    server = Server(web_base_dir, "--workers", "1", "--max-batch", "1", "--max-queue", "1", "--queue-timeout", "60")
    try:
        url, long = server.url, {"messages": HELLO, "max_tokens": LONG_REPLY, "stream": True}
        # a web page's requests: text/plain (which a page may send anywhere) and a rebound host name are refused
        page = httpx.post(f"{url}/v1/chat/completions", content=json.dumps({"messages": HELLO}),
                          headers={"Content-Type": "text/plain"}, timeout=30)
        assert page.status_code == 415 and "application/json" in page.json()["error"]["message"]
        rebound = httpx.get(f"{url}/v1/models", headers={"Host": "attacker.example:8000"}, timeout=30)
        assert rebound.status_code == 421 and "attacker.example" in rebound.json()["error"]["message"]
        with httpx.Client(timeout=60) as first, httpx.Client(timeout=60) as second:
            with first.stream("POST", f"{url}/v1/chat/completions", json=long) as occupying:
                lines = occupying.iter_lines()
                next(lines)  # the one row is busy now
                # a client that waits for a row and leaves is withdrawn, never admitted
                try:
                    second.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, timeout=0.3)
                except httpx.TimeoutException:
                    pass
                wait_until(lambda: httpx.get(f"{url}/stats").json()["requests_withdrawn"] == 1, 10, "the withdrawal")
                # one waiting request fills the queue (--max-queue 1): the next is refused at once
                queued = {}
                waiting = threading.Thread(target=lambda: queued.update(response=second.post(
                    f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4})))
                waiting.start()
                wait_until(lambda: httpx.get(f"{url}/stats").json()["queue_depth"] == 1, 10, "a waiting request")
                full = httpx.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, timeout=30)
                assert full.status_code == 503 and full.headers["Retry-After"] == "1"
                assert "--max-queue" in full.json()["error"]["message"]
                # SIGTERM: the stream ends with an error event and [DONE]; the waiting request gets a 503
                server.process.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line.startswith("data: ")]
                assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][len("data: "):])
                waiting.join(30)
                response = queued["response"]
                assert response.status_code == 503 and "stopping" in response.json()["error"]["message"]
        assert server.process.wait(timeout=20) == 0
        output = "".join(server.lines)
        assert output.count("stopping: ") == 1 and "Traceback" not in output, output[-3000:]
    finally:
        server.stop()


def test_a_keyless_server_on_any_address_answers_only_to_its_own_names(web_base_dir):  # noqa: F811
    """Without a key, --host 0.0.0.0 checks Host too (a page that rebinds evil.com to this machine sends
    'Host: evil.com'), and says at start which names it answers to; --allowed-hosts adds one. A body cut off midway is
    one line in the log, not a traceback; the UI's page may not be framed by another site."""
    from nanochat.serving.serve import allowed_host_names, host_name

    server = Server(web_base_dir, "--host", "0.0.0.0", "--allowed-hosts", "chat.example")
    try:
        url, port = server.url, server.url.rsplit(":", 1)[1]
        hosts = {name: httpx.get(f"{url}/v1/models", headers={"Host": f"{name}:{port}"}, timeout=10).status_code
                 for name in ("evil.com", "chat.example", "127.0.0.1", "localhost", socket.gethostname())}
        assert hosts == {"evil.com": 421, "chat.example": 200, "127.0.0.1": 200, "localhost": 200,
                         socket.gethostname(): 200}, hosts
        assert "answering requests whose Host is" in "".join(server.lines) and "chat.example" in "".join(server.lines)
        page = httpx.get(f"{url}/", timeout=10)
        assert page.headers["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in page.headers[
            "Content-Security-Policy"]
        cut = socket.create_connection(("127.0.0.1", int(port)))
        cut.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(0.3)
        cut.close()
        wait_until(lambda: "in the middle of its request's body" in "".join(server.lines), 10, "the cut-off body's line")
        assert "Traceback" not in "".join(server.lines) and "ClientDisconnect" not in "".join(server.lines)
    finally:
        server.stop()
    # another loopback address is checked too (it turned the check off); a key on 0.0.0.0 is the guard instead
    assert "127.0.0.2" in allowed_host_names("127.0.0.2") and "evil.com" not in allowed_host_names("127.0.0.2")
    assert [host_name(h) for h in ("[::1]:8000", "Example.org:80", "localhost")] == ["::1", "example.org", "localhost"]


@pytest.mark.quick
def test_settings_a_server_must_refuse_or_get_right(monkeypatch):
    import os

    import torch

    from nanochat.engine import BatchEngine, Sampling
    from nanochat.common import UserError, inference_threads
    from scripts import chat_web

    with pytest.raises(UserError, match="--api-key: must be printable ASCII"):
        chat_web.parse_args(["--api-key", "clé-secrète"])
    # CPU workers share the cores: 4 workers on 16 cores take 3 threads each (one core left to the server), not 15
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [inference_threads(torch.device("cpu"), 0, n) for n in (1, 2, 4)] == [15, 7, 3]

    # cancelling waiting sequences costs the same however long the queue is (it was a rebuild of the queue each time)
    class Model:
        config = type("C", (), {"sequence_len": 64, "n_kv_head": 1, "n_embd": 8, "n_head": 1, "n_layer": 1})()

        def get_device(self):
            return torch.device("cpu")

        def forward(self, ids, kv_cache=None, logits_at=None):  # never called: nothing is stepped
            raise AssertionError("no forward pass expected")

    class Tokenizer:
        def encode_special(self, text):
            return 0

        def get_bos_token_id(self):
            return 0

    def cancel_seconds(waiting):
        engine = BatchEngine(Model(), Tokenizer(), max_batch=1)
        seqs = [engine.add([1, 2], Sampling()) for _ in range(waiting)]
        started = time.perf_counter()
        for seq in seqs[:1000]:
            engine.cancel(seq)
        return time.perf_counter() - started

    assert cancel_seconds(20_000) < 5 * cancel_seconds(1000) + 0.05


def test_a_client_that_connects_as_soon_as_serving_is_printed_is_answered(web_base_dir):  # noqa: F811
    """Once "serving at" is out, a connection is queued, not refused, while the server starts up (a script that starts
    chat_web and sends its first request at once got ECONNREFUSED)."""
    server = ChatWeb(web_base_dir, ["--device-type", "cpu", "--max-tokens", "4"], threads=1, timeout=60)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # at once, no retry: queued, not refused
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    finally:
        server.stop()
