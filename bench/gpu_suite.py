"""
`python -m scripts.gpu_check --suite`: every number a GPU lease is for, from one prepared command, each section in a
process of its own under one deadline, so that a section that fails or hangs costs its own row and not the others.

    train   ours and the reference project's (karpathy/nanochat at REFERENCE_COMMIT, from a checkout in .reference/)
            training step at d12 and d24, bf16, compiled: tok/s and MFU against the same peak
    decode  ms a decode step: Engine at batch 1, BatchEngine at 1, 16 and 64 rows, eager and captured (CUDA graphs;
            with whether the captured step wrote the eager tokens), on a random-init d12
    fp8     our --fp8 and torchao's float8 training against bf16 at d24: tok/s, and the loss after the same steps
    run     a d12 base_train of 200 steps on the built-in corpus (a smaller global batch): its val bpb must fall
    serve   `bench serve` against chat_web on the run's checkpoint: one at a time, 64 rows eager and captured, at 1, 16
            and 64 clients
    stages  every stage of the speedrun for a few steps, as the gpu preset runs them (tok_train, base_train, base_loss,
            base_eval, mid_train, chat_sft, chat_rl, chat_eval on the built-in corpus and its offline tasks: every
            CUDA path speedrun.sh takes), then chat_web answering one request

Sections run in that order until the deadline (--suite-minutes); `--only` picks some. On one GPU the compiles dominate
(on an H200 a compiled d24's first step takes ~92 s), so the six take four 9-minute commands: `--only train,decode`,
`--only fp8`, `--only run,serve`, `--only stages`. Without CUDA the same sections run scaled down (tiny
depths, a few steps), which is what CI runs. The rows go to stdout in BENCHMARKS.md's table format, the device named in
every row, with one JSON line, also written to a dated file under --results-dir (dev/gpu_results/).
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import torch

from bench import gpu_check as check
from nanochat.common import child_pythonpath

REFERENCE_URL = "https://github.com/karpathy/nanochat"
REFERENCE_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"  # 2026-07-03, the newest this project has read
REFERENCE_DIR = os.path.join(check.REPO_ROOT, ".reference")  # ignored by git: the reference's code is never committed
SECTIONS = ("train", "decode", "fp8", "run", "serve", "stages")  # the order they run in: the most wanted first


@dataclass
class Scale:
    """What the suite runs: the GPU's sizes, or the CPU's scale-down of the same sections."""

    train_depths: tuple
    seq_len: int
    device_batch: int
    timed_steps: int
    warmup: int
    fp8_depth: int
    run_depth: int
    run_steps: int
    decode_depth: int
    decode_rows: tuple
    serve_clients: tuple
    serve_tokens: int
    vocab: int
    seconds: dict  # the most each section may take


GPU = Scale(train_depths=(12, 24), seq_len=2048, device_batch=16, timed_steps=8, warmup=3, fp8_depth=24, run_depth=12,
            run_steps=200, decode_depth=12, decode_rows=(1, 16, 64), serve_clients=(1, 16, 64), serve_tokens=64,
            vocab=32768, seconds={"train": 450, "decode": 60, "fp8": 540, "run": 150, "serve": 180, "stages": 420})
CPU = Scale(train_depths=(2,), seq_len=64, device_batch=4, timed_steps=2, warmup=1, fp8_depth=2, run_depth=2,
            run_steps=30, decode_depth=2, decode_rows=(1, 4), serve_clients=(1, 4), serve_tokens=8, vocab=4096,
            seconds={"train": 240, "fp8": 120, "run": 120, "decode": 60, "serve": 120, "stages": 600})


def reference_checkout(path):
    """(path, commit) of the reference's checkout, or (None, how to get one)."""
    if not os.path.isfile(os.path.join(path, "nanochat", "gpt.py")):
        return None, (f"no reference checkout in {path}: git clone {REFERENCE_URL} {path} && git -C {path} checkout "
                      f"{REFERENCE_COMMIT[:12]}")
    commit_file = os.path.join(path, "COMMIT")
    if os.path.isfile(commit_file):
        with open(commit_file) as f:
            return path, f.read().strip()
    p = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True)
    return path, p.stdout.strip() or "unknown commit"


def run_json(command, timeout, env=None, cwd=check.REPO_ROOT):
    """A child that ends with one JSON line: its dict, or {"error": a line} when it fails, hangs or says nothing. A child
    that outlives `timeout` is killed with everything it started (a chat_web and its GPU workers among them)."""
    env = {**os.environ, "PYTHONPATH": check.CHILD_PYTHONPATH, **(env or {})}
    p = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=max(1, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return {"error": f"did not finish in {timeout:.0f} s"}
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = [line for line in stderr.splitlines() if line.strip()][-1:] or [f"exit code {p.returncode}"]
        return {"error": tail[0][:300]}
    return json.loads(lines[-1])


def bench_train(scale, depth, timeout, fp8=""):
    """Our base_train step (`bench train`), compiled, the default recipe."""
    command = [sys.executable, "-m", "scripts.bench", "train", f"--depth={depth}", f"--seq-len={scale.seq_len}",
               f"--device-batch-size={scale.device_batch}", "--compile=1", "--components=default",
               f"--steps={scale.timed_steps}", f"--warmup={scale.warmup}", "--breakdown-steps=2", "--probe-seconds=0",
               "--peak-seconds=0.25", f"--vocab-size={scale.vocab}", f"--fp8={fp8}"]
    result = run_json(command, timeout)
    return result if "error" in result else result["runs"][0]


def reference_train(scale, depth, timeout, reference):
    command = [sys.executable, os.path.join(check.REPO_ROOT, "bench", "reference_train.py"),
               f"--depth={depth}", f"--seq-len={scale.seq_len}", f"--device-batch-size={scale.device_batch}",
               f"--vocab-size={scale.vocab}", f"--steps={scale.timed_steps}", f"--warmup={scale.warmup}"]
    # the reference's package first, and whatever the user's PYTHONPATH adds (wheels installed with --target), not ours
    return run_json(command, timeout, env={"PYTHONPATH": child_pythonpath(reference)})


def speed(result, peak=None):
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    if "error" in result:
        return f"failed: {result['error']}"
    peak = peak or result.get("peak_flops")
    mfu = f", MFU {100 * result['tok_per_s'] * result['flops_per_token'] / peak:.1f} %" if peak else ""
    parts = result.get("breakdown_ms") or {}  # ours: a step taken apart (synced between phases), where the time goes
    split = f" ({' / '.join(f'{k} {v:.0f}' for k, v in parts.items())} ms)" if parts else ""
    return f"{result['tok_per_s']:,.0f} tok/s{mfu}{split}"


def section_train(scale, deadline, out, reference, root, workspace):
    rows = []
    path, commit = reference_checkout(reference)
    for depth in scale.train_depths:
        ours = out[f"train_d{depth}"] = bench_train(scale, depth, min(scale.seconds["train"] / 2, left(deadline)))
        theirs = out[f"reference_d{depth}"] = reference_train(scale, depth, left(deadline), path) if path else \
            {"skipped": commit}
        label = f"d{depth} {ours.get('dtype', '')} training, compiled, device batch {scale.device_batch} x {scale.seq_len}"
        rows.append((f"{label}, ours (default recipe)", speed(ours)))
        ratio = ""
        if "tok_per_s" in ours and "tok_per_s" in theirs:
            ratio = f"; ours / reference {ours['tok_per_s'] / theirs['tok_per_s']:.2f}x"
        rows.append((f"{label}, reference {commit[:7] if path else ''} ({theirs.get('attention', '-')}, full windows, "
                     f"{theirs.get('dtype', '-').replace('torch.', '')})",
                     speed(theirs, ours.get("peak_flops")) + ratio))
    return rows


def section_fp8(scale, deadline, out, reference, root, workspace):
    from bench.train import torchao_unavailable

    depth = scale.fp8_depth
    bf16 = out.get(f"train_d{depth}") or bench_train(scale, depth, left(deadline) / 3)
    rows = []
    for backend in ("ours", "torchao"):
        reason = torchao_unavailable(torch.device("cuda" if torch.cuda.is_available() else "cpu")) \
            if backend == "torchao" else None
        result = out[f"fp8_{backend}_d{depth}"] = {"skipped": reason} if reason else \
            bench_train(scale, depth, min(scale.seconds["fp8"] / 2, left(deadline)) if backend == "ours" else
                        left(deadline), fp8=backend)  # torchao, last, takes what is left: its compile ran past 149 s
        line = speed(result)
        if "tok_per_s" in result and "tok_per_s" in bf16:
            line += (f"; {result['tok_per_s'] / bf16['tok_per_s']:.2f}x bf16's {bf16['tok_per_s']:,.0f}, loss after "
                     f"{scale.warmup + scale.timed_steps} steps {result['final_loss']:.6f} vs "
                     f"{bf16['final_loss']:.6f} ({result['final_loss'] / bf16['final_loss'] - 1:+.4%}), "
                     f"{result['fp8_linears']} linears in fp8")
        rows.append((f"d{depth} fp8 training ({backend}), device batch {scale.device_batch} x {scale.seq_len}", line))
    return rows


def section_run(scale, deadline, out, reference, root, workspace):
    depth, steps = scale.run_depth, scale.run_steps
    total = 2 * scale.device_batch * scale.seq_len
    command = [sys.executable, "-m", "scripts.base_train", f"--depth={depth}", f"--max-seq-len={scale.seq_len}",
               f"--device-batch-size={scale.device_batch}", f"--total-batch-size={total}",
               f"--num-iterations={steps}", f"--eval-every={steps // 2}", f"--eval-tokens={8 * total}",
               "--core-metric-every=-1", "--sample-every=-1", "--model-tag=suite"]
    result = out["run"] = check.run_smoke("suite_run", command, workspace, root, timeout=left(deadline))
    if result.get("error"):
        return [(f"d{depth} base_train, {steps} steps", f"failed: {result['error']}")]
    bpb = result["val_bpb"]
    falls = bpb[max(bpb)] < bpb[min(bpb)]
    curve = ", ".join(f"{bpb[s]:.3f} at {s}" for s in sorted(bpb))
    speed_line = f"{result['tok_per_sec']:,.0f} tok/s" + (f", MFU {result['mfu']:.1f} %" if result.get("mfu") else "")
    return [(f"d{depth} base_train, {steps} steps of {total:,} tokens, built-in corpus",
             f"val bpb {curve} ({'falls' if falls else 'DOES NOT FALL'}); {speed_line} ({result['seconds']:.0f} s)")]


def decode_worker(depth, seq_len, rows_list, base_dir):
    """gpu_check --worker=decode: a random-init model of this depth (the default recipe), greedy decoding of random
    128-token prompts: Engine at batch 1, and BatchEngine at each row count, eager and captured; ms a step (median of
    the steps where every row decodes), tok/s, and whether the captured step wrote the eager step's tokens."""
    from nanochat.engine import BatchEngine, Sampling
    from nanochat.common import compute_init
    from nanochat.gpt import build_model
    from nanochat.tokenizer import RustBPETokenizer
    from nanochat.training.recipe import DEFAULT_COMPONENTS, depth_recipe, split_components

    _, _, _, _, device = compute_init()
    tokenizer = RustBPETokenizer.from_directory(os.path.join(base_dir, "tokenizer"))
    vocab = tokenizer.get_vocab_size()
    recipe = depth_recipe(depth, vocab, seq_len, seq_len, components=split_components(DEFAULT_COMPONENTS)[0])
    torch.manual_seed(0)
    model = build_model(recipe.model_config, device).eval()
    with torch.no_grad():  # initialised to zero, every block's output would be nothing: the token would depend on the
        for block in model.transformer.h:  # last one alone, and a captured step's wrong keys could not show
            block.attn.c_proj.weight.normal_(std=0.05)
            block.mlp.c_proj.weight.normal_(std=0.05)
    model.prepare_for_inference()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = {"engine_batch1_tok_per_s": check.decode_speed(model, tokenizer, 1), "vocab": vocab}
    prompt_tokens, new_tokens = min(128, seq_len // 4), min(64, seq_len // 4)
    generator = torch.Generator().manual_seed(0)
    prompts = [[tokenizer.get_bos_token_id()] + torch.randint(0, vocab - 9, (prompt_tokens - 1,), generator=generator)
               .tolist() for _ in range(max(rows_list))]
    for decode in ("eager", "captured"):
        engine = BatchEngine(model, tokenizer, max_batch=max(rows_list), decode=decode)
        for rows in rows_list:
            for max_tokens in (4, new_tokens):  # a short warm-up round first (on a GPU: the captures)
                seqs = [engine.add(prompt, Sampling(temperature=0.0, max_tokens=max_tokens)) for prompt in prompts[:rows]]
                tokens, times = {id(seq): [] for seq in seqs}, []
                while engine.busy():
                    t0 = time.perf_counter()
                    emitted = engine.step()
                    sync()
                    if len(emitted) == rows and not any(seq.finished for seq, _, _ in emitted):
                        times.append(time.perf_counter() - t0)  # a pure decode step: every row running
                    for seq, token, _ in emitted:
                        tokens[id(seq)].append(token)
            step_s = statistics.median(times[1:] or times)
            results[f"{decode}_{rows}"] = {"ms_per_step": step_s * 1000, "tok_per_s": rows / step_s,
                                           "tokens": [tokens[id(seq)] for seq in seqs]}
        if decode == "captured":
            results["captured_off"] = engine.captured.why_eager
    def agreement(first, second):
        prefixes = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                    for a, b in zip(first, second) if a != b]
        return f"{len(first) - len(prefixes)}/{len(first)} rows" + \
            (f" (the others up to token {min(prefixes)} at least)" if prefixes else "")

    # bf16 rounds the two steps' attention differently, and a near-tie can go the other way: the control is eager
    # against itself at another row count (other kernels, same prompts), which no capture is involved in
    for smaller, rows in zip(rows_list, rows_list[1:]):
        results[f"eager_{rows}"]["same_as_fewer_rows"] = \
            f"{agreement(results[f'eager_{smaller}']['tokens'], results[f'eager_{rows}']['tokens'][:smaller])} of {smaller}"
    for rows in rows_list:
        results[f"captured_{rows}"]["same_tokens"] = agreement(results[f"eager_{rows}"]["tokens"],
                                                               results[f"captured_{rows}"].pop("tokens"))
    for rows in rows_list:
        results[f"eager_{rows}"].pop("tokens")
    print(json.dumps(results))


def section_decode(scale, deadline, out, reference, root, workspace):
    rows_arg = ",".join(map(str, scale.decode_rows))
    result = out["decode"] = run_json([sys.executable, "-m", "scripts.gpu_check", "--worker=decode",
                                       f"--decode-depth={scale.decode_depth}", f"--decode-rows={rows_arg}",
                                       f"--seq-len={2048 if torch.cuda.is_available() else 256}"],
                                      left(deadline), env={"NANOCHAT_BASE_DIR": workspace["base_dir"]})
    label = f"d{scale.decode_depth} decode, random init, vocab {result.get('vocab', 0):,}, greedy"
    if "error" in result:
        return [(label, f"failed: {result['error']}")]
    speed1 = result["engine_batch1_tok_per_s"]
    rows = [(f"{label}: Engine, batch 1, eager", f"{1000 / speed1:.2f} ms a step ({speed1:,.0f} tok/s)")]
    for decode in ("eager", "captured"):
        for n in scale.decode_rows:
            r = result[f"{decode}_{n}"]
            line = f"{r['ms_per_step']:.2f} ms a step ({r['tok_per_s']:,.0f} tok/s)"
            if "same_as_fewer_rows" in r:
                line += f", the tokens eager decoding wrote with fewer rows in {r['same_as_fewer_rows']}"
            if decode == "captured":
                line += f", the eager tokens in {r['same_tokens']}" + \
                    (f" (ran eagerly: {result['captured_off']})" if result["captured_off"] else "")
            rows.append((f"{label}: BatchEngine, {n} rows, {decode}", line))
    return rows


def section_serve(scale, deadline, out, reference, root, workspace):
    """bench serve against chat_web: one at a time, then 64 rows eager, then 64 rows captured."""
    run = out.get("run") or {}
    source = ["-i", "base", "-g", "suite"] if run.get("base_dir") and not run.get("error") else ["--fresh"]
    most = max(scale.serve_clients)
    rows, single = [], None
    for max_batch, decode in ((1, "eager"), (most, "eager"), (most, "captured")):
        result = out[f"serve_{max_batch}_{decode}"] = run_json(
            [sys.executable, "-m", "scripts.bench", "serve", *source, "--max-batch", str(max_batch), "--decode", decode,
             "--concurrency", *[str(c) for c in scale.serve_clients], "--requests", str(most), "--max-tokens",
             str(scale.serve_tokens), "--seconds", "60"],
            left(deadline), env={"NANOCHAT_BASE_DIR": run.get("base_dir") or workspace["base_dir"]})
        label = f"chat_web ({'one at a time' if max_batch == 1 else f'{max_batch} rows, {decode}'})"
        if "error" in result:
            rows.append((label, f"failed: {result['error']}"))
            continue
        for r in result["runs"]:
            line = f"{r['tok_per_s']:,.0f} tok/s, first token p50 {r['first_token_p50_s'] or 0:.2f} s, {r['errors']} errors"
            if max_batch == 1 and r["concurrency"] == most:
                single = r["tok_per_s"]
            elif max_batch > 1 and r["concurrency"] == most and single:
                line += f"; {r['tok_per_s'] / single:.1f}x one at a time"
            rows.append((f"{label}, {r['concurrency']} clients, {scale.serve_tokens}-token replies, {' '.join(source)}",
                         line))
    return rows


def stage_commands(cuda):
    """The speedrun's stages, each for a few steps, as the gpu preset runs them (compiled bf16 base_train at T 2048,
    its device batches) on the built-in corpus and its offline chat tasks; without CUDA, scaled down to d2."""
    if cuda:
        base = ["--depth=12", "--max-seq-len=2048", "--device-batch-size=16", "--total-batch-size=65536"]
        chat = {"mid_train": ["--device-batch-size=16", "--total-batch-size=65536"], "chat_sft": ["--device-batch-size=4"],
                "chat_rl": ["--num-samples=8", "--total-batch-size=8", "--device-batch-size=8", "--max-new-tokens=64",
                            "--eval-problems=16"]}
        tok, loss, evaluate = ["--vocab-size=32768", "--max-chars=20000000"], ["--device-batch-size=16"], ["-x", "32"]
    else:
        base = ["--depth=2", "--aspect-ratio=32", "--head-dim=32", "--max-seq-len=128", "--device-batch-size=2",
                "--total-batch-size=512"]
        chat = {"mid_train": ["--device-batch-size=2", "--total-batch-size=512", "--eval-steps=1"],
                "chat_sft": ["--device-batch-size=2", "--total-batch-size=4", "--eval-steps=1"],
                "chat_rl": ["--num-samples=2", "--total-batch-size=2", "--device-batch-size=2", "--max-new-tokens=12",
                            "--eval-problems=2"]}
        tok, loss, evaluate = ["--vocab-size=512", "--max-chars=2000000"], ["--device-batch-size=2"], ["-x", "2"]
    return [
        ("nanochat.corpus", []),
        ("scripts.tok_train", tok),
        ("scripts.base_train", base + ["--num-iterations=20", "--eval-every=10", "--save-every=10", "--core-metric-every=-1",
                               "--sample-every=-1", "--model-tag=stages"]),
        ("scripts.base_loss", loss + ["--model-tag=stages", "--split-tokens=65536"]),
        ("scripts.base_eval", ["--eval-bundle=builtin", "--max-per-task=8", "--model-tag=stages"]),
        ("scripts.mid_train", chat["mid_train"] + ["-g", "stages", "--num-iterations=6", "--save-every=3"]),
        ("scripts.chat_sft", chat["chat_sft"] + ["-g", "stages", "--num-iterations=6", "--save-every=3"]),
        ("scripts.chat_rl", chat["chat_rl"] + ["-g", "stages", "--num-iterations=2", "--save-every=1"]),
        ("scripts.chat_eval", ["-i", "rl", "-g", "stages", "--max-new-tokens=16"] + evaluate),
    ]


def section_stages(scale, deadline, out, reference, root, workspace):
    """Every stage of the speedrun for a few steps (so each CUDA path speedrun.sh takes runs once), in a base dir of
    its own on the built-in corpus, then chat_web answering a request with the RL model."""
    base = os.path.join(root, "runs", "suite_stages")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, NANOCHAT_DATA_SOURCE="builtin", PYTHONPATH=check.CHILD_PYTHONPATH)
    rows, times = [], {}
    for module, flags in stage_commands(torch.cuda.is_available()):
        script = module.split(".")[-1]
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, "-m", module, *flags], cwd=check.REPO_ROOT, env=env,
                               capture_output=True, text=True, timeout=max(1, left(deadline)))
            error = None if p.returncode == 0 else \
                ([line for line in p.stderr.splitlines() if line.strip()][-1:] or [f"exit code {p.returncode}"])[0][:300]
            with open(os.path.join(base, f"{script}.log"), "w") as f:
                f.write(p.stdout + p.stderr)
        except subprocess.TimeoutExpired:
            error = "did not finish in the suite's time"
        times[script] = time.time() - t0
        if error:
            rows.append((f"stage {script} ({' '.join(flags)})", f"failed: {error} (log: {base}/{script}.log)"))
            break
    out["stages"] = times
    ran = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in times.items())
    rows.insert(0, ("every stage for a few steps, built-in corpus (the corpus, tok_train ... chat_eval)", ran))
    if rows[-1][1].startswith("failed"):
        return rows
    from bench.serve import ChatWeb

    label = "chat_web on the stages' RL model, one request"
    try:
        server = ChatWeb(base, ["-i", "rl", "-g", "stages", "--max-tokens", "16"])
    except RuntimeError as e:
        return rows + [(label, f"failed: {str(e).splitlines()[0]}")]
    try:
        body = json.dumps({"model": "nanochat", "messages": [{"role": "user", "content": "Hello!"}],
                           "max_tokens": 16}).encode()
        request = urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            reply = json.loads(response.read())["choices"][0]["message"]["content"]
        rows.append((label, f"200, a reply of {len(reply)} characters"))
    except Exception as e:  # a row, not a crash: the other sections' numbers still come out
        rows.append((label, f"failed: {type(e).__name__}: {e}"))
    finally:
        server.stop()
    return rows


def left(deadline):
    return deadline - time.time()


def run_suite(only, minutes, reference, root, workspace, log):
    """The sections in `only`, in SECTIONS' order, until `minutes` have passed: (rows [(check, result)], results)."""
    scale = GPU if torch.cuda.is_available() else CPU
    deadline = time.time() + 60 * minutes
    rows, out = [], {"scale": scale.__dict__}
    for name in SECTIONS:
        if name not in only:
            continue
        if left(deadline) < 10:
            rows.append((f"section {name}", f"skipped: the suite's {minutes:g} minutes were spent"))
            continue
        log(f"suite: {name} (at most {min(scale.seconds[name], left(deadline)):.0f} s)")
        section_deadline = min(deadline, time.time() + scale.seconds[name])
        t0 = time.time()
        try:
            new = globals()[f"section_{name}"](scale, section_deadline, out, reference, root, workspace)
        except Exception as e:  # one section's surprise is its row: the others' numbers still come out
            new = [(f"section {name}", f"failed: {type(e).__name__}: {e}")]
        for check_name, result in new:
            log(f"  {check_name}: {result}")
        rows += new
        out.setdefault("seconds", {})[name] = time.time() - t0
    return rows, out


def main(args, log):
    """gpu_check --suite: the workspace, the sections, the table and its dated file, one JSON line."""
    import datetime

    from nanochat.common import ensure_writable, get_base_dir
    from bench.common import ensure_builtin_workspace

    only = [name for name in args.only.split(",") if name] if args.only else list(SECTIONS)
    unknown = [name for name in only if name not in SECTIONS]
    if unknown or args.suite_minutes <= 0:
        from nanochat.common import UserError

        raise UserError(f"--only takes {','.join(SECTIONS)} (got {','.join(unknown)}) and --suite-minutes must be > 0"
                        if unknown else f"--suite-minutes must be > 0 (got {args.suite_minutes})")
    # before any section: a lease's rows must not be lost at the end to a folder that cannot be written
    ensure_writable(args.results_dir, "the suite's results", fix="give --results-dir a folder you can write")
    root = os.path.join(get_base_dir(), "gpu_check")
    cuda = torch.cuda.is_available()
    log(f"gpu_check --suite | sections {','.join(only)} | {args.suite_minutes:g} minutes | "
        f"{'GPU' if cuda else 'CPU scale-down'} | reference: {reference_checkout(args.reference)[1]}")
    workspace = ensure_builtin_workspace(os.path.join(root, "workspace"), 32768 if cuda else 4096, log=log)
    env = check.environment(get_base_dir())
    t0 = time.time()
    rows, results = run_suite(only, args.suite_minutes, args.reference, root, workspace, log)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=check.REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown commit"
    machine, date = check.machine_label(env), datetime.date.today().isoformat()
    command = f"`python -m scripts.gpu_check --suite` at {commit}"
    table = "| date | machine | check | result | command |\n|---|---|---|---|---|\n" + "\n".join(
        f"| {date} | {machine} | {name} | {result} | {command} |" for name, result in rows)
    summary = json.dumps({"gpu_suite": {"machine": machine, "commit": commit, "rows": rows, "results": results}},
                         default=str)
    print("\n" + table)
    # the results go to a dated file of their own (dev/gpu_results/ by default), never onto BENCHMARKS.md's page
    os.makedirs(args.results_dir, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M%S")
    path = os.path.join(args.results_dir, f"{stamp}_{slug(machine)}.md")
    with open(path, "w") as f:
        f.write(f"# gpu_check --suite, {date}: {machine}\n\nsections {','.join(only)}, commit {commit}\n\n{table}\n\n"
                f"```json\n{summary}\n```\n")
    failed = [name for name, result in rows if result.startswith("failed")]
    log(f"suite: {len(rows)} rows, {len(failed)} failed, {time.time() - t0:.0f} s; written to {path}")
    print(summary)
    return not failed


def slug(text):
    """'1x NVIDIA H200 (139.8 GiB), torch 2.11' -> '1x-NVIDIA-H200-139.8-GiB-torch-2.11': a file name's part."""
    return "-".join("".join(c if c.isalnum() or c == "." else " " for c in text).split())[:60]
