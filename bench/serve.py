"""
`bench serve`: chat_web under load. It starts `python -m scripts.chat_web` on a checkpoint (or on a fresh tiny model
of the CPU preset's shape), then drives it over loopback with the real `openai` async client at each concurrency:
that many clients at once, each streaming greedy replies of --max-tokens tokens, until --requests have been asked
(or --seconds have passed). Per level: aggregate completion tok/s, first-token and total latency (p50, p99), errors;
and the server's memory at rest (PSS of the server and its worker processes) before and after. Every --max-batch given is a server of its own: `--max-batch 1 64` sets
one-at-a-time decoding beside continuous batching. `--hostile` instead runs one client's attacks on the server (docs/serving.md
"Under hostile load"), each beside a neighbour streaming from its own address: /health's worst latency, and the
neighbour's tokens/s beside the attack against alone.
"""

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from bench.common import emit_json, log, machine_info, print_table
from nanochat.common import child_pythonpath
from nanochat.serving.workers import IDLE_TRIM_SECONDS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The throughput modes drive the server from one address, standing for as many users as there are connections: no
# share of the server for one client (--client-share), or 64 clients would be served as one holding a quarter of it
ONE_CLIENT_STANDS_FOR_MANY = ["--client-share", "1"]
TOPICS = ["the river country", "the capital of Zorland", "what 12 * 3 is", "who you are", "a long story about a fox",
          "the lazy dog", "numbers like 1024", "spelling the word strawberry"]


def fresh_checkpoint(base_dir, context=256, depth=4):
    """A random model of the CPU preset's shape (a d4; `depth` layers, its context `context` tokens), saved as an sft
    checkpoint with the built-in workspace's tokenizer."""
    import torch

    from nanochat.checkpoint_manager import checkpoint_dir, save_checkpoint
    from bench.common import ensure_builtin_workspace
    from nanochat.gpt import build_model
    from nanochat.tokenizer import RustBPETokenizer
    from nanochat.recipe import config_dict, depth_recipe, split_components

    workspace = ensure_builtin_workspace(os.path.join(tempfile.gettempdir(), "nanochat_bench"), 4096, log=log)
    tokenizer = RustBPETokenizer.from_directory(os.path.join(workspace["base_dir"], "tokenizer"))
    tokenizer.save(os.path.join(base_dir, "tokenizer"))
    recipe = depth_recipe(depth, tokenizer.get_vocab_size(), context, 2048, components=split_components(
        "value_embeds,residual_scalars,smear")[0])
    torch.manual_seed(0)
    model = build_model(recipe.model_config, "cpu")
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.normal_(std=0.05)
            block.mlp.c_proj.weight.normal_(std=0.05)
    os.environ["NANOCHAT_BASE_DIR"] = base_dir
    save_checkpoint(checkpoint_dir("sft", "fresh"), 1, model, [], {"model_config": config_dict(model.config),
                                                                   "user_config": {}, "tokenizer_hash": tokenizer.fingerprint()})
    return "sft", "fresh"


class ChatWeb:
    """`python -m scripts.chat_web --port 0 FLAGS...` in a subprocess, its output drained on a thread (so the pipe never
    fills); url once it serves. The tests start their servers with it too."""

    def __init__(self, base_dir, flags, threads=0, timeout=300, preexec_fn=None):
        env = dict(os.environ, NANOCHAT_BASE_DIR=base_dir, PYTHONPATH=child_pythonpath(REPO_ROOT))
        if threads:
            env["OMP_NUM_THREADS"] = str(threads)
        command = [sys.executable, "-m", "scripts.chat_web", "--port", "0", *flags]
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, preexec_fn=preexec_fn)
        self.url, self.lines, started = None, [], threading.Event()

        def drain():
            for line in self.process.stdout:
                self.lines.append(line)
                if line.startswith("serving at "):
                    self.url = line.split()[2].rstrip("/")
                    started.set()
            started.set()

        threading.Thread(target=drain, daemon=True).start()
        if not started.wait(timeout) or self.url is None:
            self.stop()
            raise RuntimeError("chat_web did not start:\n" + "".join(self.lines[-30:]))

    def processes(self):
        """The server and its worker processes."""
        server = psutil.Process(self.process.pid)
        return [server] + server.children(recursive=True)

    def memory(self):
        """The server's memory at rest, its workers' included: the sum of their PSS (each shared page counted once,
        split between the processes that share it; a forked worker shares the server's copy of the weights), RSS where
        the system has no PSS. Read once the workers have been idle long enough to hand back what a busy spell freed
        (serve.IDLE_TRIM_SECONDS)."""
        time.sleep(IDLE_TRIM_SECONDS + 0.5)
        total = 0
        for process in self.processes():
            info = process.memory_full_info()
            total += getattr(info, "pss", info.rss)
        return total

    def cpu_seconds(self):
        return sum(t.user + t.system for t in (p.cpu_times() for p in self.processes()))

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def drive(url, concurrency, requests, seconds, max_tokens):
    """`requests` streaming greedy requests, `concurrency` at a time; per request (first-token s, total s, tokens)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    semaphore, results, errors = asyncio.Semaphore(concurrency), [], []
    deadline = time.perf_counter() + seconds

    async def one(i):
        async with semaphore:
            if time.perf_counter() > deadline:
                return
            topic = TOPICS[i % len(TOPICS)]
            messages = [{"role": "user", "content": f"Tell me about {topic}. " * (1 + i % 4)}]
            started, first, tokens = time.perf_counter(), None, 0
            try:
                stream = await client.chat.completions.create(
                    model="nanochat", messages=messages, max_tokens=max_tokens, temperature=0.0, stream=True,
                    stream_options={"include_usage": True})
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter()
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
            except Exception as e:  # noqa: BLE001 -- counted and shown, the others go on
                errors.append(f"{type(e).__name__}: {e}"[:200])
                return
            end = time.perf_counter()
            results.append(((first or end) - started, end - started, tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(requests)))
    wall = time.perf_counter() - t0
    await client.close()
    return results, errors, wall


def lm_eval_items(count):
    """Multiple-choice items of a few dozen tokens each, four one-word choices: a log-likelihood task's shape."""
    words = ["north", "south", "east", "west"]
    return [{"query": f"{TOPICS[i % len(TOPICS)].capitalize()} is a subject of item {i}. " * 3 + "The answer is",
             "choices": words, "gold": i % 4} for i in range(count)]


def lm_eval_throughput(url, concurrency, items, work):
    """lm-evaluation-harness's local-completions on a log-likelihood task of `items` against the server, `concurrency`
    requests at once: (requests, prompt tokens scored, seconds)."""
    import json

    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = os.path.join(work, "lm_eval_tasks")
    os.makedirs(tasks, exist_ok=True)
    data = os.path.join(tasks, "items.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(item) + "\n" for item in items)
    with open(os.path.join(tasks, "bench_mc.yaml"), "w") as f:
        f.write(f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
                "output_type: multiple_choice\ndoc_to_text: '{{query}}'\ndoc_to_choice: '{{choices}}'\n"
                "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    args = f"base_url={url}/v1/completions,tokenizer_backend=remote,model=nanochat,num_concurrent={concurrency}"
    started = time.perf_counter()
    out = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["bench_mc"],
                                  task_manager=TaskManager(include_path=tasks), log_samples=True)
    seconds = time.perf_counter() - started
    requests = sum(len(s["arguments"]) for s in out["samples"]["bench_mc"])
    return requests, seconds


def scoring_against_generation(url, prompt_tokens, repeats=5):
    """Milliseconds of a completion that scores a prompt (echo, logprobs, max_tokens 0: one forward pass), of the one
    that also draws the next token from it (max_tokens 1, what lm-eval sends), and of a 1- and 16-token continuation
    through the engine (prefill, then decode), on the same prompt of `prompt_tokens` token ids."""
    import httpx

    prompt = list(range(300, 300 + prompt_tokens))
    bodies = {"score (max_tokens 0)": {"max_tokens": 0, "echo": True, "logprobs": 1},
              "score + 1 token": {"max_tokens": 1, "echo": True, "logprobs": 1},
              "generate 1 token": {"max_tokens": 1}, "generate 16 tokens": {"max_tokens": 16}}
    times = {}
    with httpx.Client(timeout=600) as http:
        for name, body in bodies.items():
            runs = []
            for _ in range(repeats + 1):  # the first warms up
                started = time.perf_counter()
                r = http.post(f"{url}/v1/completions", json={"prompt": prompt, "temperature": 0, **body})
                r.raise_for_status()
                runs.append(time.perf_counter() - started)
            times[name] = 1000 * statistics.median(runs[1:])
    return times


def cmd_lm_eval(args, base_dir, source, tag, work):
    flags = ["-i", source, "--max-tokens", str(args.max_tokens), "--queue-timeout", "600"] + ONE_CLIENT_STANDS_FOR_MANY + \
        (["-g", tag] if tag else [])
    server = ChatWeb(base_dir, flags, args.threads)
    try:
        import httpx

        items = lm_eval_items(args.lm_eval_items)
        # each request scores its context and one choice, after the server's <|bos|>
        tokens = len(httpx.post(f"{server.url}/tokenize", json={"prompt": items[0]["query"] + " north"}).json()["tokens"])
        rows, runs = [], []
        for concurrency in args.concurrency:
            requests, seconds = lm_eval_throughput(server.url, concurrency, items, work)
            runs.append({"concurrency": concurrency, "requests": requests, "seconds": seconds,
                         "requests_per_s": requests / seconds, "tokens_per_request": tokens,
                         "tokens_per_s": requests * tokens / seconds})
            rows.append([concurrency, requests, f"{seconds:.1f}", f"{requests / seconds:.1f}",
                         f"{requests * tokens / seconds:,.0f}"])
        costs = {length: scoring_against_generation(server.url, length) for length in (64, 192)}
    finally:
        server.stop()
    print_table(f"lm-evaluation-harness local-completions, a log-likelihood task of {len(items)} items x 4 choices "
                f"({tokens} tokens a request)", ["concurrency", "requests", "seconds", "requests/s", "tokens/s"], rows)
    print_table("one /v1/completions request, ms (median of 5)", ["prompt tokens", *costs[64]],
                [[length, *(f"{v:.1f}" for v in c.values())] for length, c in costs.items()])
    emit_json({"bench": "serve-lm-eval", "machine": machine_info(), "source": source, "tag": tag, "runs": runs,
               "request_ms": costs})


def cmd_scoring(args, base_dir, source, tag):
    """
    The largest scoring request a client may send (64 prompts filling the context, echo, logprobs 5, max_tokens 0)
    beside one client streaming a chat reply: the request's time and reply size, the server's memory (the sum of its
    processes' RSS, sampled every 50 ms) before, at its peak and after, /health's latency, and the stream's first token
    and the largest gap between its tokens while the scoring runs; then the same request from a client that leaves
    after half a second: how long until its worker stops scoring it.
    """
    import httpx

    flags = ["-i", source, "--queue-timeout", "600"] + (["-g", tag] if tag else [])
    server = ChatWeb(base_dir, flags, args.threads)
    try:
        url = server.url
        context = httpx.get(f"{url}/v1/models").json()["data"][0]["context_length"]
        rng = random.Random(0)
        big = {"prompt": [[rng.randrange(256) for _ in range(context - 2)] for _ in range(64)], "max_tokens": 0,
               "echo": True, "logprobs": 5}
        log(f"bench serve --scoring | {source}/{tag or 'latest'} | 64 x {context - 2} ids, logprobs 5")
        memory = lambda: sum(p.memory_info().rss for p in server.processes())  # noqa: E731
        before, peak, health, gaps, result = server.memory(), 0, [], [], {}

        def score():
            started = time.monotonic()
            response = httpx.post(f"{url}/v1/completions", json=big, timeout=3600)
            result.update(seconds=time.monotonic() - started, status=response.status_code, bytes=len(response.content))

        scoring = threading.Thread(target=score)
        scoring.start()
        while httpx.get(f"{url}/stats").json()["scoring"]["requests"] == 0 and scoring.is_alive():
            time.sleep(0.01)
        asked = last = time.monotonic()
        first = None
        with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=600,
                          json={"messages": [{"role": "user", "content": "Tell me about the river."}],
                                "max_tokens": 200, "stream": True, "temperature": 0}) as stream:
            for line in stream.iter_lines():
                chunk = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
                if scoring.is_alive() and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    now = time.monotonic()
                    if first is None:
                        first = now - asked
                    else:
                        gaps.append(now - last)
                    last = now
                peak = max(peak, memory())
        while scoring.is_alive():
            started = time.monotonic()
            httpx.get(f"{url}/health", timeout=60)
            health.append(time.monotonic() - started)
            peak = max(peak, memory())
            time.sleep(0.05)
        after = server.memory()
        try:  # a client that gives up: its slices not yet run never run
            httpx.post(f"{url}/v1/completions", json=big, timeout=0.5)
        except httpx.TimeoutException:
            pass
        gave_up = time.monotonic()
        while httpx.get(f"{url}/stats").json()["scoring"]["requests"]:
            time.sleep(0.01)
        withdrawn = time.monotonic() - gave_up
    finally:
        server.stop()
    run = {"context": context, "prompts": 64, "status": result["status"], "seconds": result["seconds"],
           "reply_mib": result["bytes"] / 2**20, "memory_before_mib": before / 2**20, "memory_peak_mib": peak / 2**20,
           "memory_after_mib": after / 2**20, "health_max_s": max(health, default=0.0),
           "stream_first_token_s": first, "stream_max_gap_s": max(gaps, default=None),
           "stream_p50_gap_s": statistics.median(gaps) if gaps else None, "stream_chunks_beside": len(gaps) + 1,
           "withdrawn_after_s": withdrawn}
    print_table("the largest scoring request beside a stream", list(run), [[
        f"{v:.2f}" if isinstance(v, float) else v for v in run.values()]])
    emit_json({"bench": "serve-scoring", "machine": machine_info(), "source": source, "tag": tag, "run": run})


# -----------------------------------------------------------------------------
# bench serve --hostile: one client's attacks (Hardening V), each beside a neighbour

HOSTILE_ATTACKS = ("tokenize", "chat", "streams", "rows", "stops", "scoring", "sigterm")
ATTACKERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")  # loopback addresses: each is a client of its own
NEIGHBOUR = "127.0.0.9"
MEGABYTE_PROMPT = "".join(chr(0x4E00 + i * 7919 % 20000) for i in range(330_000))  # 990 KB of JSON, ~990,000 ids
ASK = [{"role": "user", "content": "Tell me about the river country."}]
NEIGHBOUR_TOKENS = 300  # a neighbour's reply, as the issue measured it


class Prober:
    """A thread doing `probe()` over and over until the `with` block ends (or, given `seconds`, at least that long)."""

    def __init__(self, seconds=0.0):
        self.seconds, self.done = seconds, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        started = time.monotonic()
        while not self.done.is_set() or time.monotonic() - started < self.seconds:
            self.probe()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


class HealthProbe(Prober):
    """/health asked every 50 ms; `worst` is its slowest answer (a reset counts with the time it took)."""

    def __init__(self, url):
        super().__init__()
        self.url, self.times = url, []

    def probe(self):
        import httpx

        started = time.monotonic()
        try:
            httpx.get(f"{self.url}/health", timeout=60)
        except httpx.HTTPError:
            pass
        self.times.append(time.monotonic() - started)
        time.sleep(0.05)

    @property
    def worst(self):
        return max(self.times, default=0.0)


class Neighbour(Prober):
    """Another client, from an address of its own, streaming replies of NEIGHBOUR_TOKENS tokens one after another:
    per reply the seconds to its first token, its tokens per second after that, and the gaps between its chunks (the
    worker sends a few steps' tokens at a time, every 15 ms)."""

    def __init__(self, url, seconds=0.0):
        super().__init__(seconds)
        self.url, self.replies, self.refused = url, [], 0

    def probe(self):
        import httpx

        body = {"messages": ASK, "max_tokens": NEIGHBOUR_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
        asked, arrivals, tokens = time.monotonic(), [], 0
        with httpx.Client(transport=httpx.HTTPTransport(local_address=NEIGHBOUR), timeout=600) as client:
            with client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as stream:
                if stream.status_code != 200:  # a 503: the server had no room for it
                    self.refused += 1
                    time.sleep(0.2)
                    return
                for line in stream.iter_lines():
                    event = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    if event.get("choices") and event["choices"][0]["delta"].get("content"):
                        arrivals.append(time.monotonic())
        if len(arrivals) > 1:
            self.replies.append({"first_token_s": arrivals[0] - asked,
                                 "tok_s": (tokens - 1) / (arrivals[-1] - arrivals[0]),
                                 "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])]})

    def summary(self):
        """Over its replies: the median tokens/s, the worst first token, the median and largest gap; and how many of
        its requests were refused."""
        gaps = [gap for reply in self.replies for gap in reply["gaps"]] or [0.0]
        return {"replies": len(self.replies), "refused": self.refused,
                "tok_s": statistics.median([r["tok_s"] for r in self.replies] or [0.0]),
                "first_token_max_s": max((r["first_token_s"] for r in self.replies), default=None),
                "gap_p50_s": statistics.median(gaps), "gap_max_s": max(gaps)}


def never_read(url, path, body, address=ATTACKERS[0]):
    """A POST on a socket of its own from `address`, whose reply nobody reads."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.bind((address, 0))
    sock.connect((host, int(port)))
    raw = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return sock


def in_threads(count, work, seconds):
    """`count` threads from the attacker's address, each calling work(httpx client) over and over for `seconds`;
    returns what the calls returned."""
    import httpx

    deadline, results = time.monotonic() + seconds, []

    def run():
        with httpx.Client(transport=httpx.HTTPTransport(local_address=ATTACKERS[0]), timeout=600) as client:
            while time.monotonic() < deadline:
                results.append(work(client))

    threads = [threading.Thread(target=run) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def attack_tokenize(url):
    """Four connections looping /tokenize of a 990 KB prompt for 10 s: each reply holds ~990,000 ids."""
    body = json.dumps({"prompt": MEGABYTE_PROMPT}, ensure_ascii=False).encode()
    statuses = in_threads(4, lambda client: client.post(f"{url}/tokenize", content=body, headers={
        "Content-Type": "application/json"}).status_code, 10)
    return f"{statuses.count(200)} replies of ~990,000 ids"


def attack_chat(url):
    """One whole chat reply with n 8, 2,000 tokens and 20 alternatives a token (~20 MiB), written once all 8 are done
    (logit_bias keeps the tokens that end a turn out, so each runs to max_tokens)."""
    import httpx

    enders = httpx.post(f"{url}/tokenize", json={"prompt": "<|assistant_end|><|bos|><|user_start|>",
                                                 "add_special_tokens": False}).json()["tokens"]
    started = time.monotonic()
    with httpx.Client(transport=httpx.HTTPTransport(local_address=ATTACKERS[0]), timeout=1200) as client:
        response = client.post(f"{url}/v1/chat/completions", json={
            "messages": ASK, "n": 8, "max_tokens": 2000, "logprobs": True, "top_logprobs": 20,
            "logit_bias": {str(token): -100 for token in enders}})
    return f"{response.status_code}, {len(response.content) / 2**20:.1f} MiB in {time.monotonic() - started:.0f} s"


def attack_streams(url):
    """560 streams (max_tokens 2,000) whose replies nobody reads: each under the kernel's send buffer, so asyncio never
    pauses writing them. What they hold after 2 s, then 8 s of it."""
    import httpx

    streams = [never_read(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2000, "stream": True})
               for _ in range(560)]
    time.sleep(2)
    stats = httpx.get(f"{url}/stats", timeout=60).json()
    clients = stats.get("clients", {"most_rows": stats["batch"]["active"], "held_back": stats["queue_depth"]})
    time.sleep(8)
    for stream in streams:
        stream.close()
    return f"{clients['most_rows']} rows, {clients['held_back']} waiting, {stats['requests_rejected']} refused (503)"


def attack_rows(url, stops=()):
    """Two streams of n 8 writing "aaaa..." (logit_bias), nobody reading them, for 8 s; with `stops`, 16 stop strings
    of 99 a's and a letter, which the text keeps almost matching (every one held back at every token)."""
    import httpx

    a = httpx.post(f"{url}/tokenize", json={"prompt": "a", "add_special_tokens": False}).json()["tokens"][0]
    body = {"messages": ASK, "n": 8, "max_tokens": 2000, "temperature": 0, "logit_bias": {str(a): 100},
            "stream": True, **({"stop": list(stops)} if stops else {})}
    streams = [never_read(url, "/v1/chat/completions", body) for _ in range(2)]
    time.sleep(1)
    stats = httpx.get(f"{url}/stats", timeout=60).json()
    rows = stats["clients"]["most_rows"] if "clients" in stats else stats["batch"]["active"]
    time.sleep(7)
    for stream in streams:
        stream.close()
    return f"{rows} rows of 'a'" + (", 16 stop strings of 100 characters" if stops else "")


def attack_stops(url):
    return attack_rows(url, ["a" * 99 + letter for letter in "BCDEFGHIJKLMNOPQ"])


def attack_scoring(url):
    """Eight maximal scoring requests at once (64 prompts of 2,046 ids, echo, logprobs 5), two from each of four
    addresses (a client's share is two), until the last reply is in."""
    import httpx

    rng, results = random.Random(0), []
    prompts = [[rng.randrange(256) for _ in range(2046)] for _ in range(64)]

    def score(address):
        started = time.monotonic()
        with httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=3600) as client:
            response = client.post(f"{url}/v1/completions", json={"prompt": prompts, "max_tokens": 0, "echo": True,
                                                                    "logprobs": 5})
        results.append((response.status_code, time.monotonic() - started))

    threads = [threading.Thread(target=score, args=(address,)) for address in ATTACKERS for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return f"{[status for status, _ in results].count(200)} of 8 answered, the last after {max(s for _, s in results):.0f} s"


def attack_sigterm(server):
    """SIGTERM with eight 990 KB /tokenize requests in flight: seconds until the server has exited."""
    import httpx

    body = json.dumps({"prompt": MEGABYTE_PROMPT}, ensure_ascii=False).encode()
    threads = [threading.Thread(target=lambda: httpx.post(f"{server.url}/tokenize", content=body, timeout=120, headers={
        "Content-Type": "application/json"}), daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(120)
    return time.monotonic() - started


def cmd_hostile(args, base_dir, source, tag):
    """
    One client's attacks on chat_web (docs/serving.md "Under hostile load"), each beside a neighbour streaming
    300-token replies one after another from an address of its own, while /health is asked every 50 ms: the
    neighbour's pace alone (8 s before each attack) and beside it, /health's worst answer; then SIGTERM's exit with
    eight /tokenize in flight. The attackers are threads of this process: on a small machine their own work takes
    cores from the server too.
    """
    attacks = {"tokenize": attack_tokenize, "chat": attack_chat, "streams": attack_streams, "rows": attack_rows,
               "stops": attack_stops, "scoring": attack_scoring}
    chosen = args.hostile or list(HOSTILE_ATTACKS)
    flags = ["-i", source, "--queue-timeout", "30"] + (["-g", tag] if tag else []) + \
        (["--client-share", str(args.client_share)] if args.client_share else [])
    log(f"bench serve --hostile | {source}/{tag or 'latest'} | {', '.join(chosen)} | client share "
        f"{args.client_share or 'the default'} | load {os.getloadavg()[0]:.2f}")
    server = ChatWeb(base_dir, flags, args.threads)
    runs = []
    try:
        with Neighbour(server.url):  # warm-up
            pass
        for name in [a for a in chosen if a in attacks]:
            with Neighbour(server.url, seconds=8) as alone:
                pass
            with HealthProbe(server.url) as health, Neighbour(server.url) as beside:
                attacker_got = attacks[name](server.url)
            alone, beside = alone.summary(), beside.summary()
            runs.append({"attack": name, "attacker_got": attacker_got, "health_max_s": health.worst,
                         "alone_tok_s": alone["tok_s"], **beside, "ratio": beside["tok_s"] / alone["tok_s"],
                         "load": os.getloadavg()[0]})
            log(f"  {name}: {attacker_got}; /health at most {health.worst:.2f} s; the neighbour {beside['tok_s']:.0f} "
                f"tok/s beside ({beside['replies']} replies, {beside['refused']} refused), {alone['tok_s']:.0f} alone")
        exit_s = attack_sigterm(server) if "sigterm" in chosen else None
    finally:
        server.stop()
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    print_table(f"one client's attacks on chat_web ({source}/{tag or 'latest'}), each beside a neighbour's "
                f"{NEIGHBOUR_TOKENS}-token streams", ["attack", "the attacker got", "/health max s",
                                                       "neighbour tok/s alone", "beside", "ratio", "replies / refused",
                                                       "first token max s", "gap p50 s", "gap max s", "load"],
                [[r["attack"], r["attacker_got"], fmt(r["health_max_s"]), f"{r['alone_tok_s']:.0f}", f"{r['tok_s']:.0f}",
                  fmt(r["ratio"]), f"{r['replies']} / {r['refused']}", fmt(r["first_token_max_s"]), fmt(r["gap_p50_s"]),
                  fmt(r["gap_max_s"]), fmt(r["load"])] for r in runs])
    if exit_s is not None:
        print(f"SIGTERM with eight 990 KB /tokenize requests in flight: exited after {exit_s:.1f} s")
    emit_json({"bench": "serve-hostile", "machine": machine_info(), "source": source, "tag": tag, "runs": runs,
               "sigterm_exit_s": exit_s})


def cmd_serve(args):
    work = tempfile.mkdtemp(prefix="nanochat_bench_serve_")
    base_dir = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    source, tag = args.source, args.model_tag
    if args.fresh:
        base_dir = work
        hostile = args.hostile is not None
        source, tag = fresh_checkpoint(work, 2048 if args.scoring or hostile else 256, depth=2 if hostile else 4)
    if args.lm_eval:
        return cmd_lm_eval(args, base_dir, source, tag, work)
    if args.scoring:
        return cmd_scoring(args, base_dir, source, tag)
    if args.hostile is not None:
        return cmd_hostile(args, base_dir, source, tag)
    log(f"bench serve | {source}/{tag or 'latest'} in {base_dir} | concurrency {args.concurrency} | max-batch "
        f"{args.max_batch} | {args.max_tokens} tokens per reply")
    rows, runs = [], []
    for max_batch in args.max_batch:
        flags = ["-i", source, "--max-tokens", str(args.max_tokens), "--max-batch", str(max_batch), "--queue-timeout",
                 "600", "--decode", args.decode] + ONE_CLIENT_STANDS_FOR_MANY + (["-g", tag] if tag else [])
        server = ChatWeb(base_dir, flags, args.threads)
        try:
            asyncio.run(drive(server.url, 1, 2, 60, 4))  # warm-up: first allocations, code paths
            memory_before = server.memory()
            for concurrency in args.concurrency:
                requests = max(args.requests, concurrency)
                server_cpu, client_cpu = server.cpu_seconds(), time.process_time()
                results, errors, wall = asyncio.run(drive(server.url, concurrency, requests, args.seconds,
                                                          args.max_tokens))
                server_cpu, client_cpu = server.cpu_seconds() - server_cpu, time.process_time() - client_cpu
                first = [r[0] for r in results]
                total = [r[1] for r in results]
                tokens = sum(r[2] for r in results)
                run = {"max_batch": max_batch, "concurrency": concurrency, "requests": len(results) + len(errors),
                       "completed": len(results), "errors": len(errors), "error_examples": errors[:3],
                       "tok_per_s": tokens / wall, "wall_s": wall,
                       "first_token_p50_s": percentile(first, 50), "first_token_p99_s": percentile(first, 99),
                       "latency_p50_s": percentile(total, 50), "latency_p99_s": percentile(total, 99),
                       "mean_tokens": statistics.mean(r[2] for r in results) if results else 0,
                       # cores' worth of CPU each side used: on a small machine the clients compete with the server
                       "server_cores": server_cpu / wall, "client_cores": client_cpu / wall}
                runs.append(run)
                log(f"  max-batch {max_batch}, concurrency {concurrency}: {run['tok_per_s']:.0f} tok/s, first token p50 "
                    f"{run['first_token_p50_s'] or 0:.2f}s, {len(errors)} errors")
            memory_after = server.memory()
            for run in runs:
                if run["max_batch"] == max_batch:
                    run.update(memory_before_mib=memory_before / 2**20, memory_after_mib=memory_after / 2**20)
        finally:
            server.stop()
    for r in runs:
        fmt = lambda v: f"{v:.2f}" if v is not None else "-"  # noqa: E731
        rows.append([r["max_batch"], r["concurrency"], f"{r['completed']}/{r['requests']}", r["errors"],
                     f"{r['tok_per_s']:.0f}", fmt(r["first_token_p50_s"]), fmt(r["first_token_p99_s"]),
                     fmt(r["latency_p50_s"]), fmt(r["latency_p99_s"]), f"{r['mean_tokens']:.0f}",
                     f"{r['server_cores']:.2f} / {r['client_cores']:.2f}",
                     f"{r['memory_before_mib']:.0f} -> {r['memory_after_mib']:.0f}"])
    print_table(f"serve: {source}/{tag or 'latest'}, greedy streamed replies of up to {args.max_tokens} tokens",
                ["max batch", "concurrency", "done", "errors", "tok/s", "first p50 s", "first p99 s", "total p50 s",
                 "total p99 s", "tokens/reply", "cores server/clients", "server memory MiB"], rows)
    emit_json({"bench": "serve", "machine": machine_info(), "source": source, "tag": tag, "decode": args.decode,
               "max_tokens": args.max_tokens,
               "runs": runs})
