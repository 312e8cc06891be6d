"""
chat_web as a hostile client or a web page would try it (issue 49): a flood of idle sockets under the common limit of
1,024 open files, slow headers, a full queue, a client that leaves while queued, a stop in the middle of replies, a
text/plain POST and a rebinding Host; and the settings that must be refused or right at start.
"""

import json
import resource
import signal
import socket
import threading
import time

import httpx
import pytest

from nanochat.bench.serve import ChatWeb
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


def test_settings_a_server_must_refuse_or_get_right(monkeypatch):
    import os

    import torch

    from nanochat.batch_engine import BatchEngine, Sampling
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
