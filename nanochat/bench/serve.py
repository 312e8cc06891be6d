"""
`bench serve`: chat_web under load. It starts `python -m scripts.chat_web` on a checkpoint (or on a fresh tiny model
of the CPU preset's shape), then drives it over loopback with the real `openai` async client at each concurrency:
that many clients at once, each streaming greedy replies of --max-tokens tokens, until --requests have been asked
(or --seconds have passed). Per level: aggregate completion tok/s, first-token and total latency (p50, p99), errors;
and the server's memory at rest (PSS of the server and its worker processes) before and after. Every --max-batch given is a server of its own: `--max-batch 1 64` sets
one-at-a-time decoding beside continuous batching.
"""

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from nanochat.bench.common import emit_json, log, machine_info, print_table
from nanochat.workers import IDLE_TRIM_SECONDS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPICS = ["the river country", "the capital of Zorland", "what 12 * 3 is", "who you are", "a long story about a fox",
          "the lazy dog", "numbers like 1024", "spelling the word strawberry"]


def fresh_checkpoint(base_dir):
    """A random d4 of the CPU preset's shape, saved as an sft checkpoint with the built-in workspace's tokenizer."""
    import torch

    from nanochat.checkpoint_manager import checkpoint_dir, save_checkpoint
    from nanochat.corpus import ensure_builtin_workspace
    from nanochat.tokenizer import RustBPETokenizer
    from nanochat.training import config_dict, depth_recipe, split_components
    from nanochat.gpt import build_model

    workspace = ensure_builtin_workspace(os.path.join(tempfile.gettempdir(), "nanochat_bench"), 4096, log=log)
    tokenizer = RustBPETokenizer.from_directory(os.path.join(workspace["base_dir"], "tokenizer"))
    tokenizer.save(os.path.join(base_dir, "tokenizer"))
    recipe = depth_recipe(4, tokenizer.get_vocab_size(), 256, 2048, components=split_components(
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
        env = dict(os.environ, NANOCHAT_BASE_DIR=base_dir, PYTHONPATH=REPO_ROOT)
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


def cmd_serve(args):
    work = tempfile.mkdtemp(prefix="nanochat_bench_serve_")
    base_dir = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    source, tag = args.source, args.model_tag
    if args.fresh:
        base_dir = work
        source, tag = fresh_checkpoint(work)
    log(f"bench serve | {source}/{tag or 'latest'} in {base_dir} | concurrency {args.concurrency} | max-batch "
        f"{args.max_batch} | {args.max_tokens} tokens per reply")
    rows, runs = [], []
    for max_batch in args.max_batch:
        flags = ["-i", source, "--max-tokens", str(args.max_tokens), "--max-batch", str(max_batch), "--queue-timeout",
                 "600"] + (["-g", tag] if tag else [])
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
    emit_json({"bench": "serve", "machine": machine_info(), "source": source, "tag": tag, "max_tokens": args.max_tokens,
               "runs": runs})
