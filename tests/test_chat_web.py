"""
Tests for scripts/chat_web.py, run for real: uvicorn in a subprocess serving a tiny random checkpoint on
127.0.0.1, talked to with httpx, with the `openai` Python package against /v1, and through the UI in headless
Chromium. The model never ends a reply by itself (see build_chat_checkpoint), so replies run to max_tokens and
a long reply takes seconds: enough to measure what a disconnect or a busy queue does.
"""

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest

from bench.serve import ChatWeb
from tests.test_chat_cli import REPO_ROOT, build_chat_checkpoint

CONTEXT = 2048  # room for a reply long enough to take seconds
LONG_REPLY = 2000  # tokens
DEFAULT_MAX_TOKENS = 16  # the servers' --max-tokens
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
HELLO = [{"role": "user", "content": "Hello! What is the capital of the river country?"}]


class Server(ChatWeb):
    """python -m scripts.chat_web on a free port, on the CPU with one thread, answering /health."""

    def __init__(self, base_dir, *flags, preexec_fn=None):
        try:
            super().__init__(base_dir, ["--device-type", "cpu", "--max-tokens", str(DEFAULT_MAX_TOKENS), *flags],
                             threads=1, timeout=60, preexec_fn=preexec_fn)
        except RuntimeError as e:
            pytest.fail(str(e))
        wait_until(lambda: httpx.get(f"{self.url}/health").status_code == 200, 30, "/health answering")


def wait_until(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except (httpx.HTTPError, OSError, KeyError):  # KeyError: an answer without the field yet (a 503 to retry)
            pass
        time.sleep(0.05)
    pytest.fail(f"timed out after {seconds} s waiting for {what}")


@pytest.fixture(scope="module")
def web_base_dir(tiny_base_dir, tmp_path_factory):
    base_dir = tmp_path_factory.mktemp("chat_web") / "base"
    build_chat_checkpoint(tiny_base_dir, base_dir, CONTEXT)
    return str(base_dir)


@pytest.fixture(scope="module")
def tokenizer(web_base_dir):
    from nanochat.tokenizer import RustBPETokenizer

    return RustBPETokenizer.from_directory(os.path.join(web_base_dir, "tokenizer"))


@pytest.fixture(scope="module")
def server(web_base_dir):
    """One worker (so a long request really blocks the next), a queue timeout long enough for 8 clients."""
    s = Server(web_base_dir, "--workers", "1", "--queue-timeout", "60")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def sse_events(response):
    """The JSON payloads of a streamed response ([DONE] as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def ascii_window(text, width=3):
    """A stretch of plain letters and spaces in text (a stop string that is sure to be found as written)."""
    for start in range(2, len(text) - width):
        window = text[start:start + width]
        if all(c.isascii() and (c.isalnum() or c == " ") for c in window):
            return window
    return None


# -----------------------------------------------------------------------------
# Pages, health, stats, models


def test_ui_health_stats_and_models(server, client):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert 'id="input"' in page.text and 'id="regenerate"' in page.text
    assert 'src="http' not in page.text and 'href="http' not in page.text  # self-contained: nothing from a CDN
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["workers"] == 1
    assert health["model"]["id"] == "nanochat-sft-tiny" and health["model"]["context"] == CONTEXT
    models = client.models.list().data
    assert [m.id for m in models] == ["nanochat-sft-tiny"]
    assert client.models.retrieve("nanochat-sft-tiny").owned_by == "nanochat"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["workers"] == {"total": 1, "busy": 0, "free": 1} and stats["queue_depth"] == 0
    assert {"requests_served", "tokens_generated", "tokens_per_second"} <= set(stats)
    assert "127.0.0.1" in server.url  # binds to localhost unless told otherwise


# -----------------------------------------------------------------------------
# nanochat's own streaming endpoint


@pytest.mark.quick
def test_nanochat_endpoint_streams_tokens_then_done(server, tokenizer):
    body = {"messages": HELLO, "temperature": 0.8, "top_k": 20, "max_tokens": 10}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    tokens = [e["token"] for e in events if "token" in e]  # a few steps' tokens may come as one event
    done = events[-1]
    assert tokens and "".join(tokens)
    assert done["done"] is True and done["finish_reason"] == "length"
    assert done["usage"]["prompt_tokens"] == len(tokenizer.render_for_completion({"messages": HELLO}))
    assert done["usage"]["completion_tokens"] == 10

    # a conversation longer than the context loses its oldest turns, and the stream says so first
    turns = []
    for i in range(30):
        turns += [{"role": "user", "content": f"question {i}: " + "tell me about the river " * 40},
                  {"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]}]
    body = {"messages": turns + [{"role": "user", "content": "and the last one?"}], "max_tokens": 4}
    with httpx.stream("POST", f"{server.url}/chat/completions", json=body, timeout=30) as response:
        events = sse_events(response)
    assert "dropped the" in events[0]["note"] and events[-1]["done"]
    assert events[-1]["usage"]["prompt_tokens"] <= CONTEXT - 4


# -----------------------------------------------------------------------------
# The OpenAI API with the openai package as the client


@pytest.mark.quick
def test_openai_client_non_stream_and_stream(client, tokenizer):
    conversation = [{"role": "system", "content": "You are terse."}] + HELLO
    reply = client.chat.completions.create(model="nanochat", messages=conversation, max_tokens=8, temperature=1.0,
                                           seed=3)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.model == "nanochat-sft-tiny"
    choice = reply.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"  # max_tokens reached
    prompt_tokens = len(tokenizer.render_for_completion({"messages": conversation}))
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, 8, prompt_tokens + 8)

    chunks = list(client.chat.completions.create(model="nanochat", messages=conversation, max_tokens=8, temperature=1.0,
                                                 seed=3, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content  # same seed, same text, streamed or not
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].usage.prompt_tokens == prompt_tokens

    reply = client.chat.completions.create(model="nanochat", messages=HELLO, max_completion_tokens=5)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"


@pytest.mark.quick
def test_openai_api_takes_a_conversation_whole_or_refuses_it(server, client, tokenizer):
    """An API client keeps its own context: nothing it sent is dropped behind its back (the UI's endpoint trims and
    says so, above). Too long for the context: a 400 with OpenAI's code; so is a max_tokens that cannot fit beside the
    prompt (as vLLM answers), while one that just fits runs to the context."""
    turns = []
    for i in range(30):
        turns += [{"role": "user", "content": f"question {i}: " + "tell me about the river " * 40},
                  {"role": "assistant", "content": f"answer {i}"}]
    too_long = turns + [{"role": "user", "content": "and the last one?"}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="nanochat", messages=too_long, max_tokens=4)
    assert error.value.code == "context_length_exceeded" and f"context is {CONTEXT} tokens" in str(error.value)

    fits = turns[-8:] + [{"role": "user", "content": "and the last one?"}]
    prompt_tokens = len(tokenizer.render_for_completion({"messages": fits}))
    assert CONTEXT // 2 < prompt_tokens < CONTEXT - 64  # more than half the context: the UI would have trimmed it
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="nanochat", messages=fits, max_tokens=CONTEXT - prompt_tokens + 1)
    assert error.value.code == "context_length_exceeded" and error.value.param == "max_tokens"
    reply = client.chat.completions.create(model="nanochat", messages=fits, max_tokens=CONTEXT - prompt_tokens,
                                           temperature=0.0)
    assert reply.usage.prompt_tokens == prompt_tokens  # every message went in
    assert reply.usage.completion_tokens == CONTEXT - prompt_tokens and reply.choices[0].finish_reason == "length"


@pytest.mark.quick
def test_openai_api_takes_what_openai_clients_send(server):
    """Fields the way OpenAI's API takes them: "stream": null is no stream, "developer" is the system role."""
    url = f"{server.url}/v1/chat/completions"
    plain = httpx.post(url, json={"messages": HELLO, "max_tokens": 3, "stream": None}, timeout=30)
    assert plain.status_code == 200 and plain.json()["object"] == "chat.completion"
    developer = [{"role": "developer", "content": "You are terse."}] + HELLO
    as_developer = httpx.post(url, json={"messages": developer, "max_tokens": 3, "seed": 1}, timeout=30).json()
    as_system = httpx.post(url, json={"messages": [{"role": "system", "content": "You are terse."}] + HELLO,
                                      "max_tokens": 3, "seed": 1}, timeout=30).json()
    assert as_developer["usage"] == as_system["usage"]
    assert as_developer["choices"][0]["message"] == as_system["choices"][0]["message"]
    # top_p 0 keeps the most likely token only: greedy, whatever the temperature
    greedy = httpx.post(url, json={"messages": HELLO, "max_tokens": 8, "temperature": 0}, timeout=30).json()
    nucleus_0 = httpx.post(url, json={"messages": HELLO, "max_tokens": 8, "temperature": 1.5, "top_p": 0, "seed": 3},
                           timeout=30).json()
    assert nucleus_0["choices"][0]["message"] == greedy["choices"][0]["message"]
    # an unknown route or method answers in the API's error shape
    missing = httpx.get(f"{server.url}/v1/embeddings", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    wrong_method = httpx.get(url, timeout=30)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


@pytest.mark.quick
def test_openai_n_samples_and_seed_reproducibility(client):
    def ask(seed, n=1):
        return client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=12, temperature=1.0,
                                              seed=seed, n=n)

    pair = ask(seed=11, n=2)
    assert [c.index for c in pair.choices] == [0, 1] and pair.usage.completion_tokens == 24
    assert pair.choices[0].message.content != pair.choices[1].message.content  # each sample draws its own tokens
    first, again, other = ask(seed=5), ask(seed=5), ask(seed=6)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content


@pytest.mark.quick
def test_openai_stop_strings_cut_the_text(client):
    def ask(**kwargs):
        return client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=40, temperature=1.0,
                                              **kwargs)

    seed, full, stop = None, None, None
    for seed in range(20):  # a seed whose reply has a plain-letters stretch past its start
        full = ask(seed=seed).choices[0].message.content
        stop = ascii_window(full)
        if stop:
            break
    assert stop, "no reply had three plain letters in a row"
    cut = ask(seed=seed, stop=["<never>", stop])
    assert cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens < 40
    chunks = list(client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=40, temperature=1.0,
                                                 seed=seed, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full[:full.index(stop)]


@pytest.mark.quick
def test_eight_concurrent_clients_are_all_answered(server, client):
    served_before = httpx.get(f"{server.url}/stats").json()["requests_served"]

    def ask(i):
        return client.chat.completions.create(model="nanochat", messages=[{"role": "user", "content": f"client {i}"}],
                                              max_tokens=6, stream=(i % 2 == 0))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, range(8)))
    for i, result in enumerate(results):
        if i % 2 == 0:
            chunks = list(result)
            assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        else:
            assert result.choices[0].message.content and result.usage.completion_tokens == 6
    stats = httpx.get(f"{server.url}/stats").json()
    assert stats["requests_served"] - served_before == 8 and stats["workers"]["free"] == 1


# -----------------------------------------------------------------------------
# Bad requests


BAD_REQUESTS = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"messages": []}), "messages"),
    (json.dumps({}), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}] * 501}), "at most 500"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 8001}]}), "messages[0].content"),
    (json.dumps({"messages": [{"role": "user", "content": "x" * 7000}] * 5}), "characters"),
    (json.dumps({"messages": [{"role": "hacker", "content": "x"}]}), "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "x"}]}),
     "messages[1].role"),
    (json.dumps({"messages": HELLO, "temperature": 2.5}), "temperature"),
    (json.dumps({"messages": HELLO, "temperature": -1}), "temperature"),
    (json.dumps({"messages": HELLO, "top_k": 0}), "top_k"),
    (json.dumps({"messages": HELLO, "top_k": 201}), "top_k"),
    (json.dumps({"messages": HELLO, "top_p": -0.1}), "top_p"),
    (json.dumps({"messages": HELLO, "max_tokens": 0}), "max_tokens"),
    (json.dumps({"messages": HELLO, "max_tokens": 4097}), "max_tokens"),
    (json.dumps({"messages": HELLO, "n": 9}), "n:"),
    (json.dumps({"messages": HELLO, "stop": [str(i) for i in range(17)]}), "stop"),
    (json.dumps({"messages": HELLO, "model": "gpt-4"}), "not served here"),
    (json.dumps({"messages": HELLO, "model": {"id": "nanochat"}}), "model: must be a string"),
    (json.dumps({"messages": [{**HELLO[0], "name": "ann"}]}), "messages[0].name"),
    (json.dumps({"messages": HELLO, "stream": "yes"}), "stream"),
]


@pytest.mark.quick
@pytest.mark.parametrize("path", ["/chat/completions", "/v1/chat/completions"])
def test_bad_requests_get_4xx_with_a_reason(server, path):
    for raw, reason in BAD_REQUESTS:
        response = httpx.post(f"{server.url}{path}", content=raw, headers={"Content-Type": "application/json"},
                              timeout=30)
        assert 400 <= response.status_code < 500, (raw[:80], response.status_code)
        message = response.json()["error"]["message"]
        assert reason in message, (raw[:80], message)
    too_big = httpx.post(f"{server.url}{path}", content=b" " * 1_100_000, timeout=30,
                         headers={"Content-Type": "application/json"})
    assert too_big.status_code == 413 and "larger than" in too_big.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/stats").json()["workers"]["free"] == 1  # no worker was taken by a bad request


@pytest.mark.quick
def test_openai_client_sees_the_reason(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="nanochat", messages=HELLO, temperature=5)
    assert "temperature" in str(error.value) and "from 0 to 2" in str(error.value)


# -----------------------------------------------------------------------------
# Disconnects and the queue


@pytest.mark.quick
def test_a_client_that_disconnects_frees_its_worker(server, client):
    started = time.monotonic()
    full = client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=LONG_REPLY)
    full_seconds = time.monotonic() - started
    assert full.usage.completion_tokens == LONG_REPLY

    body = {"model": "nanochat", "messages": HELLO, "max_tokens": LONG_REPLY, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 2
    # the connection is closed: the next request must not wait for the abandoned 2000-token reply
    started = time.monotonic()
    short = client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=4)
    short_seconds = time.monotonic() - started
    assert short.usage.completion_tokens == 4
    assert short_seconds < 0.3 * full_seconds, (short_seconds, full_seconds)

    # the same for a client that gives up on a reply it wanted in one piece
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False}, timeout=0.2 * full_seconds)
    started = time.monotonic()
    short = client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=4)
    short_seconds = time.monotonic() - started
    assert short_seconds < 0.3 * full_seconds, (short_seconds, full_seconds)
    wait_until(lambda: httpx.get(f"{server.url}/stats").json()["requests_cancelled"] >= 2, 10, "the cancels counted")


@pytest.mark.quick
def test_samples_go_to_a_worker_with_rows_for_all_of_them():
    """Workers' rows may differ (each GPU's free memory sizes its KV cache): n goes to one that can hold it."""
    import asyncio

    from nanochat.serving.chat import RequestError
    from nanochat.serving.protocol import read_sampling
    from nanochat.serving.workers import WorkerPool

    class FakeWorker:
        alive = True

        def __init__(self, rows, load):
            self.rows, self._load, self.got = rows, load, []

        def load(self):
            return self._load

        def submit(self, generation):
            self.got.append(generation)
            generation.admitted.set()

    async def route(pool, n):
        return await pool.submit([1, 2, 3], read_sampling({"n": n}, 0.6, 50, 8))

    small, big = FakeWorker(rows=1, load=0), FakeWorker(rows=4, load=5)
    pool = WorkerPool([small, big], queue_timeout=5, client_share=1.0)  # one client, whose requests never end
    assert asyncio.run(route(pool, 1)).worker is small  # the least loaded, as before
    assert asyncio.run(route(pool, 2)).worker is big  # the least loaded of those with 2 rows
    with pytest.raises(RequestError, match="at most 4 replies"):
        asyncio.run(route(pool, 5))


def test_a_one_row_server_times_out_its_queue_refuses_n_2_and_stops_on_ctrl_c(web_base_dir):
    busy = Server(web_base_dir, "--workers", "1", "--max-batch", "1", "--queue-timeout", "0.5")  # one row in all
    try:
        body, short = {"messages": HELLO, "max_tokens": LONG_REPLY}, {"messages": HELLO, "max_tokens": 4}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{busy.url}/chat/completions", json=body) as occupying:
                lines = occupying.iter_lines()  # kept: a dropped iterator would close the connection
                next(lines)  # the single worker is now writing a long reply
                started = time.monotonic()
                response = httpx.post(f"{busy.url}/v1/chat/completions", json=short, timeout=30)
                waited = time.monotonic() - started
            assert response.status_code == 503 and "--queue-timeout" in response.json()["error"]["message"]
            assert 0.4 < waited < 5
        # the occupying client left: the worker is free again
        stats = {}
        wait_until(lambda: stats.update(httpx.get(f"{busy.url}/stats").json()) or stats["workers"]["free"] == 1, 10,
                   "the worker to be free")
        # the occupying client's reply counts as cancelled; the rejected request does not count twice
        assert stats["requests_rejected"] == 1 and stats["requests_cancelled"] == 1
        assert httpx.post(f"{busy.url}/v1/chat/completions", json=short, timeout=30).status_code == 200
        # two replies of one prompt decode side by side: more than its rows is the client's error, said at once
        two = httpx.post(f"{busy.url}/v1/chat/completions", json=dict(short, n=2), timeout=30)
        assert two.status_code == 400 and two.json()["error"]["param"] == "n" and "--max-batch" in two.text
        # one Ctrl-C on an idle server: a clean stop, no traceback
        busy.process.send_signal(signal.SIGINT)
        assert busy.process.wait(timeout=15) == 0
        wait_until(lambda: "server stopped" in "".join(busy.lines), 5, "its last line")
        assert "Traceback" not in "".join(busy.lines), "".join(busy.lines)[-2000:]
    finally:
        busy.stop()


def test_a_dead_worker_fails_its_requests_and_a_dead_server_takes_its_workers_along(web_base_dir):
    """Each worker is a process: one killed mid-reply ends its stream with the reason while the other worker goes on
    answering; a server killed outright (no shutdown code runs) leaves no worker behind."""
    two = Server(web_base_dir, "--workers", "2", "--queue-timeout", "60")
    try:
        server = psutil.Process(two.process.pid)
        first, second = sorted(server.children(), key=lambda p: p.create_time())  # workers 0 and 1
        body = {"messages": HELLO, "max_tokens": LONG_REPLY}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{two.url}/chat/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")  # both idle: worker 0, the first of the least loaded, writes it
            first.kill()
            rest = "\n".join(lines)  # ends instead of hanging
        assert "worker 0 exited" in rest and '"error"' in rest
        short = httpx.post(f"{two.url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, timeout=30)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
        server.kill()
        _, alive = psutil.wait_procs([second], timeout=10)
        assert not alive, "the worker outlived its server"
    finally:
        two.stop()


def test_a_second_ctrl_c_during_a_reply_stops_the_server_and_its_worker_at_once(web_base_dir):
    """The first Ctrl-C waits for the reply in flight; a second one skips the server's shutdown, and the worker
    (which ignores signals: the server stops it) must still not keep the server from exiting."""
    one = Server(web_base_dir, "--workers", "1")
    try:
        server = psutil.Process(one.process.pid)
        (worker,) = server.children()
        body = {"messages": HELLO, "max_tokens": LONG_REPLY}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{one.url}/chat/completions", json=body) as reply:
            lines = reply.iter_lines()  # kept: a dropped iterator would close the connection
            assert next(lines).startswith("data: ")
            one.process.send_signal(signal.SIGINT)
            time.sleep(0.5)
            one.process.send_signal(signal.SIGINT)
            _, alive = psutil.wait_procs([server, worker], timeout=10)
        assert not alive, "the server or its worker is still running"
    finally:
        one.stop()


def test_a_spawned_worker_loads_its_own_replica_and_answers(web_base_dir, tokenizer, monkeypatch):
    """The GPU's way of starting a worker (spawned, loading the checkpoint itself), run on the CPU, as a laptop's
    server starts one (macOS, Windows), with --int8: it reports the model, its int8 weights and its rows, writes a
    greedy reply of the asked length through the pipe, and stops when told."""
    from nanochat.engine import Sampling
    from nanochat.serving.chat import Add, Admitted, Ended, Finish, Stop
    from nanochat.serving.workers import load_workers, stop_processes

    monkeypatch.setenv("NANOCHAT_BASE_DIR", web_base_dir)
    workers, _, info = load_workers("sft", None, None, "cpu", 1, 3, threads=1, start_method="spawn", int8=True)
    (worker,) = workers
    try:
        assert worker.rows == 3 and info["context"] == CONTEXT and info["params"] > 0 and info["weights"] == "int8"
        prompt = tokenizer.render_for_completion({"messages": HELLO})
        worker.conn.send(Add(7, prompt, [Sampling(temperature=0.0, max_tokens=5)], True))
        events = []
        while not any(isinstance(e, Ended) for e in events):
            assert worker.conn.poll(30), "the worker stopped answering"
            message = worker.conn.recv()
            occupancy = message.occupancy
            events += [e for key, batch in message.ready if key == 7 for e in batch]
        assert isinstance(events[0], Admitted) and occupancy.rows == 3
        finish = next(e for e in events if isinstance(e, Finish))
        assert finish.completion_tokens == 5 and events[-1].tokens == 5
        worker.conn.send(Stop())
        worker.process.join(10)
        assert worker.process.exitcode == 0
    finally:
        stop_processes([worker.process], seconds=1)


def test_an_int8_worker_answers_from_int8_weights(web_base_dir, tokenizer, monkeypatch):
    """--int8: the server's model quantized before it forks its worker (a spawned worker quantizes its own: the test
    above); /health names the weights int8, and the worker writes a greedy reply of the asked length."""
    from nanochat.engine import Sampling
    from nanochat.serving.chat import Add, Ended, Finish, Stop
    from nanochat.serving.workers import load_workers, stop_processes

    monkeypatch.setenv("NANOCHAT_BASE_DIR", web_base_dir)
    workers, _, info = load_workers("sft", None, None, "cpu", 1, 1, threads=1, int8=True)
    (worker,) = workers
    try:
        assert info["weights"] == "int8"
        worker.conn.send(Add(1, tokenizer.render_for_completion({"messages": HELLO}),
                             [Sampling(temperature=0.0, max_tokens=5)], True))
        events = []
        while not any(isinstance(e, Ended) for e in events):
            assert worker.conn.poll(30), "the worker stopped answering"
            events += [e for key, batch in worker.conn.recv().ready if key == 1 for e in batch]
        assert next(e for e in events if isinstance(e, Finish)).completion_tokens == 5
        worker.conn.send(Stop())
        worker.process.join(10)
    finally:
        stop_processes([worker.process], seconds=1)


# -----------------------------------------------------------------------------
# Continuous batching: many requests in one batch


@pytest.mark.quick
def test_concurrent_greedy_replies_equal_the_same_requests_alone(server, client):
    """Conversations of different lengths (one with a calculator call in its history), asked one at a time and then
    all at once: the same greedy replies, and the batch really held several of them at once."""
    conversations = [[{"role": "user", "content": "hi"}],
                     HELLO,
                     [{"role": "user", "content": "What is 12*3? " * 6},
                      {"role": "assistant", "content": [{"type": "text", "text": "Let me see. "},
                                                        {"type": "python", "text": "12*3"},
                                                        {"type": "python_output", "text": "36"},
                                                        {"type": "text", "text": "It is 36."}]},
                      {"role": "user", "content": "and 7*8?"}],
                     [{"role": "user", "content": "tell me about the river country " * 12}]]

    def ask(messages, max_tokens):
        reply = client.chat.completions.create(model="nanochat", messages=messages, max_tokens=max_tokens, temperature=0.0)
        return reply.choices[0].message.content, reply.usage.completion_tokens

    lengths = [40, 24, 32, 16]
    one_at_a_time = [ask(m, n) for m, n in zip(conversations, lengths)]
    def shared_steps():
        return httpx.get(f"{server.url}/stats").json()["batch"]["shared_steps"]

    before = shared_steps()
    with concurrent.futures.ThreadPoolExecutor(len(conversations)) as pool:
        together = list(pool.map(ask, conversations, lengths))
    assert together == one_at_a_time and [n for _, n in together] == lengths
    assert shared_steps() > before  # some decode steps carried several of them at once, not one after another


@pytest.mark.quick
def test_a_client_that_leaves_mid_stream_frees_its_row_and_the_others_go_on(server, client):
    body = {"model": "nanochat", "messages": HELLO, "max_tokens": LONG_REPLY, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=LONG_REPLY))
        wait_until(lambda: httpx.get(f"{server.url}/stats").json()["batch"]["active"] == 1, 30, "the other request")
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{server.url}/v1/chat/completions",
                                                            json=body) as response:
            lines = response.iter_lines()
            assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 2
            assert httpx.get(f"{server.url}/stats").json()["batch"]["active"] == 2
        # the stream's connection is closed: its row goes at the server's next step, long before 2000 tokens
        left = time.monotonic()
        wait_until(lambda: httpx.get(f"{server.url}/stats").json()["batch"]["active"] <= 1, 5, "its row to be freed")
        assert time.monotonic() - left < 2
        reply = other.result(timeout=60)
    assert reply.usage.completion_tokens == LONG_REPLY and reply.choices[0].finish_reason == "length"


@pytest.mark.quick
def test_each_row_leaves_at_its_own_max_tokens(server, client):
    def ask(max_tokens):
        return client.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=max_tokens, temperature=0.7,
                                              stream=True, stream_options={"include_usage": True})

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = list(pool.map(ask, [3, 40, 200]))
        usages = list(pool.map(lambda chunks: [c for c in chunks][-1].usage.completion_tokens, streams))
    assert usages == [3, 40, 200]


# -----------------------------------------------------------------------------
# An API key


def test_an_api_key_guards_every_route_but_the_page_and_health(web_base_dir):
    keyed = Server(web_base_dir, "--api-key", "s3cret-key")
    try:
        assert httpx.get(f"{keyed.url}/health").json()["auth_required"] is True
        assert httpx.get(f"{keyed.url}/").status_code == 200  # the page asks for the key itself
        for headers, reason in (({}, "missing"), ({"Authorization": "Bearer wrong"}, "wrong"),
                                ({"Authorization": "s3cret-key"}, "wrong")):
            for method, path in (("GET", "/v1/models"), ("GET", "/stats"), ("POST", "/chat/completions"),
                                 ("POST", "/v1/chat/completions")):
                r = httpx.request(method, f"{keyed.url}{path}", headers=headers, json={"messages": HELLO}, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
                assert r.json()["error"]["message"].startswith(reason) and r.headers["www-authenticate"] == "Bearer"
        good = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="s3cret-key", max_retries=0, timeout=60)
        assert good.chat.completions.create(model="nanochat", messages=HELLO, max_tokens=3).usage.completion_tokens == 3
        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="nope", max_retries=0).models.list()
    finally:
        keyed.stop()


def test_a_bad_max_batch_is_refused_before_the_model_loads(web_base_dir):
    env = dict(os.environ, NANOCHAT_BASE_DIR=web_base_dir)
    for flags, reason in ((["--max-batch", "0"], "--max-batch"), (["--kv-memory-gib", "-1"], "--kv-memory-gib"),
                          (["--api-key", " "], "--api-key")):
        p = subprocess.run([sys.executable, "-m", "scripts.chat_web", "--port", "0", *flags], capture_output=True,
                           text=True, cwd=REPO_ROOT, env=env, timeout=60)
        lines = (p.stdout + p.stderr).strip().splitlines()
        assert p.returncode == 1 and len(lines) == 1 and reason in lines[0] and "loading" not in p.stdout, lines


# -----------------------------------------------------------------------------
# The UI in a real browser


@pytest.fixture
def browser(tmp_path):
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        reason = f"the browser test needs {CHROMIUM} and {CHROMEDRIVER} (Debian packages chromium, chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()
    shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


def test_ui_in_a_browser_streams_regenerates_and_edits(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 30)

    # read through JavaScript in one go: the page redraws its bubbles while it streams, so element handles go stale
    def texts(selector):
        script = "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent)"
        return browser.execute_script(script, selector)

    def replies():
        return texts(".message.assistant .bubble")

    def state():
        return browser.execute_script("return document.body.dataset.state")

    def idle_with_one_reply(_):
        current = replies()
        return state() == "idle" and len(current) == 1 and current[0].strip() != ""

    browser.get(server.url + "/")
    wait.until(lambda d: "nanochat-sft-tiny" in d.find_element(By.ID, "model-name").text)  # /health was fetched
    box = browser.find_element(By.ID, "input")
    box.send_keys("Hello there")
    box.send_keys(Keys.SHIFT, Keys.ENTER)  # Shift+Enter is a new line, not a send
    box.send_keys("second line")
    assert browser.find_elements(By.CSS_SELECTOR, ".message.user") == []
    box.send_keys(Keys.ENTER)
    wait.until(idle_with_one_reply)
    assert texts(".message.user .bubble") == ["Hello there\nsecond line"]
    assert str(DEFAULT_MAX_TOKENS) + " tokens" in browser.find_element(By.ID, "status").text

    # regenerate the last reply: still one user message and one (new) reply
    browser.execute_script("document.querySelector('.message.assistant .bubble').textContent = ''")
    browser.find_element(By.ID, "regenerate").click()
    wait.until(idle_with_one_reply)
    assert len(texts(".message.user")) == 1

    # edit the user message: everything after it is written again
    browser.find_element(By.CSS_SELECTOR, ".message.user .edit").click()
    editor = browser.find_element(By.CSS_SELECTOR, ".editor textarea")
    editor.clear()
    editor.send_keys("Edited question")
    browser.find_element(By.CSS_SELECTOR, ".save-edit").click()
    wait.until(idle_with_one_reply)
    assert texts(".message.user .bubble") == ["Edited question"]

    # temperature and top-k reach the server: an out-of-range top-k comes back as the server's reason
    browser.execute_script("document.getElementById('top-k').value = '500'")
    browser.find_element(By.ID, "regenerate").click()
    wait.until(lambda d: "top_k" in d.find_element(By.ID, "status").text)

    # a long reply grows while it streams, and the stop button ends it and frees the worker
    browser.execute_script("document.getElementById('top-k').value = '50'")
    browser.find_element(By.ID, "new-chat").click()
    assert texts(".message") == []
    browser.execute_script(f"document.getElementById('max-tokens').value = '{LONG_REPLY}'")
    box.send_keys("Tell me a long story", Keys.ENTER)
    wait.until(lambda d: replies() and len(replies()[0]) > 0)
    assert state() == "generating"
    # clicked from the page's script: a 2000-token reply takes about a second here, and a stop button that the
    # browser is still laying out could miss a WebDriver click
    browser.execute_script("document.getElementById('stop').click()")
    wait.until(lambda d: state() == "idle")
    assert browser.find_element(By.ID, "status").text == "stopped" and replies()[0]
    wait_until(lambda: httpx.get(f"{server.url}/stats").json()["workers"]["free"] == 1, 5, "the worker to be freed")


def test_ui_with_an_api_key_asks_for_it_once_per_session(web_base_dir, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    keyed = Server(web_base_dir, "--api-key", "s3cret-key")
    try:
        wait = WebDriverWait(browser, 30)
        status = lambda: browser.find_element(By.ID, "status").text  # noqa: E731
        replies = lambda: browser.execute_script(  # noqa: E731
            "return Array.from(document.querySelectorAll('.message.assistant .bubble')).map(e => e.textContent)")
        browser.get(keyed.url + "/")
        wait.until(lambda d: d.find_element(By.ID, "key-bar").is_displayed())  # /health says a key is needed
        browser.find_element(By.ID, "input").send_keys("Hello there", Keys.ENTER)
        wait.until(lambda d: "needs its API key" in status())
        key_box = browser.find_element(By.ID, "api-key")
        key_box.send_keys("wrong", Keys.ENTER)  # saved, and the reply is tried again: refused
        wait.until(lambda d: "the key was refused" in status() and d.find_element(By.ID, "key-bar").is_displayed())
        key_box.send_keys("s3cret-key", Keys.ENTER)
        wait.until(lambda d: replies() and replies()[0].strip() and "tokens" in status())
        assert not browser.find_element(By.ID, "key-bar").is_displayed()
        browser.refresh()  # the same tab: the key is remembered for the session
        wait.until(lambda d: d.execute_script("return document.readyState") == "complete")
        browser.find_element(By.ID, "input").send_keys("Again", Keys.ENTER)
        wait.until(lambda d: replies() and replies()[0].strip() and "tokens" in status())
        assert not browser.find_element(By.ID, "key-bar").is_displayed()
    finally:
        keyed.stop()


# -----------------------------------------------------------------------------
# Response shapes: what clients parse, recorded from the server and compared on every run

SHAPES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "chat_web_shapes.json")


def shape(value):
    """The structure of a JSON value: keys and value types, not the values themselves."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__


def response_shapes(url):
    hello = {"messages": HELLO, "max_tokens": 4, "temperature": 0.0}
    whole = httpx.post(f"{url}/v1/chat/completions", json=hello, timeout=60)
    streamed = httpx.post(f"{url}/v1/chat/completions", json={**hello, "stream": True, "n": 2,
                                                              "stream_options": {"include_usage": True}}, timeout=60)
    chunks = [e for e in sse_events(streamed) if e != "[DONE]"]
    ui = sse_events(httpx.post(f"{url}/chat/completions", json=hello, timeout=60))
    bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": "nope"}, timeout=60)
    missing = httpx.get(f"{url}/v1/models/gpt-4", timeout=60)
    return {
        "health": shape(httpx.get(f"{url}/health").json()),
        "stats": shape(httpx.get(f"{url}/stats").json()),
        "models": shape(httpx.get(f"{url}/v1/models").json()),
        "completion": [whole.status_code, whole.headers["content-type"], shape(whole.json())],
        "chunk_first": shape(chunks[0]),
        "chunk_content": shape(next(c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content"))),
        "chunk_finish": shape(next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])),
        "chunk_usage": shape(chunks[-1]),
        "stream_end": sse_events(streamed)[-1],
        "ui_events": sorted({json.dumps(shape(e)) for e in ui}),
        "bad_request": [bad.status_code, shape(bad.json())],
        "unknown_model": [missing.status_code, shape(missing.json())],
    }


@pytest.mark.quick
def test_response_shapes_match_the_recorded_ones(server):
    shapes = response_shapes(server.url)
    if os.environ.get("NANOCHAT_RECORD_SHAPES") == "1":  # to record after a deliberate change of the API
        with open(SHAPES_PATH, "w", encoding="utf-8") as f:
            json.dump(shapes, f, indent=1, sort_keys=True)
    with open(SHAPES_PATH, encoding="utf-8") as f:
        assert shapes == json.load(f)
