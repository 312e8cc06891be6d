"""
`python -m scripts.gpu_check --suite`: every number a GPU lease is for, from one prepared command, each measurement in
a process of its own under one deadline, so that one that fails or hangs costs its own row and not the others.

    train   ours and the reference project's (karpathy/nanochat at REFERENCE_COMMIT, from a checkout in .reference/)
            training step at d12 and d24, bf16, compiled: tok/s and MFU against the same peak, the memory, our loader
            timed apart, and a reduced profile of each
    fp8     our --fp8 and torchao's float8 training against bf16 at d24: tok/s, and the loss after the same steps
    decode  ms a decode step: Engine at batch 1, BatchEngine at 1, 16 and 64 rows, eager and captured (CUDA graphs;
            with whether the captured step wrote the eager tokens), on a random-init d12
    run     a d12 base_train of 200 steps on the built-in corpus (a smaller global batch): its val bpb must fall
    serve   `bench serve` against chat_web on the run's checkpoint: one at a time, 64 rows eager and captured, at 1, 16
            and 64 clients
    stages  every stage of the speedrun for a few steps, as the gpu preset runs them (tok_train, base_train, base_loss,
            base_eval, mid_train, chat_sft, chat_rl, chat_eval on the built-in corpus and its offline tasks: every
            CUDA path speedrun.sh takes), then chat_web answering one request
    budget  `NANOCHAT_TIME_BUDGET=6m bash speedrun.sh` as a user starts it (the built-in corpus, offline): its plan, its
            wall time against the budget (the target: within 10 %), the stages' seconds, any out-of-memory
    budget_24gb  the same with every stage capped to a 24 GB card (NANOCHAT_GPU_MEMORY=24GB), standing in for the
            consumer GPUs people train on

train and fp8 run together (bench/suite_training.py): their configurations compile side by side first, as many as the
GPU's memory holds, and are then timed one at a time, each starting warm; the other sections follow in that order
until the deadline (--suite-minutes); `--only` picks some. Every compiled configuration keeps a portable compile cache
in --compile-cache-dir (bench/compile_cache.py), which a lease carries to the next one as one archive, so that it is
compiled once and not every lease. With --out-dir (a lease's $OUT) the results (.md and .json), the log, the compile
caches (compile_cache.tar.gz) and the profiles with every child's log (profiles.tar.gz) go there: five files, each
under the 16 MiB a lease returns. Without CUDA the same sections run scaled down (tiny depths, a few steps), which is
what CI runs. The rows go to stdout in BENCHMARKS.md's table format, the device named in every row, with one JSON line.
"""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import torch

from bench import compile_cache
from bench import gpu_check as check
from bench import suite_training as training

REFERENCE_URL = "https://github.com/karpathy/nanochat"
REFERENCE_COMMIT = "92d63d4e8bb4df75c3b71618f31ddde2378b2bcd"  # 2026-07-03, the newest this project has read
REFERENCE_DIR = os.path.join(check.REPO_ROOT, ".reference")  # ignored by git: the reference's code is never committed
SECTIONS = ("train", "fp8", "decode", "run", "serve", "stages", "budget", "budget_24gb")  # the order they run in
CACHE_ARCHIVE, PROFILES_ARCHIVE = "compile_cache.tar.gz", "profiles.tar.gz"
# what a lease's output folder returns: 8 files at most, each under 16 MiB, 2 folders deep
OUT_MAX_FILES, OUT_MAX_BYTES, OUT_MAX_DEPTH = 8, 16 * 2**20, 2
ARCHIVE_LIMIT = 15 * 2**20  # an archive's most, under OUT_MAX_BYTES with room to spare


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
    seconds: dict  # the most each section may take (train and fp8, run together, the two added)
    costs: dict  # suite_training's measured costs of the compiled configurations
    memory_budget_gib: float  # the warm-ups side by side at most, by those costs
    start_s: float  # a training process's start (python, torch, the model built): an estimate
    profile_s: float  # a profile's reduction and its trace's export after the timed steps: an estimate
    end_reserve_s: float  # kept free at the end for the results and the archives
    budget: str  # the budgeted speedrun's NANOCHAT_TIME_BUDGET; "" for this machine's least (a CPU's)


# memory_budget_gib is the card's own at run time (scale_here(): suite_training.SIDE_BY_SIDE_SHARE of its memory);
# the H200's (143,771 MiB) is written here.
GPU = Scale(train_depths=(12, 24), seq_len=2048, device_batch=16, timed_steps=8, warmup=3, fp8_depth=24, run_depth=12,
            run_steps=200, decode_depth=12, decode_rows=(1, 16, 64), serve_clients=(1, 16, 64), serve_tokens=64,
            vocab=32768, seconds={"train": 450, "decode": 90, "fp8": 540, "run": 150, "serve": 180, "stages": 420,
                                  "budget": 420, "budget_24gb": 420},
            costs=training.GPU_COSTS, memory_budget_gib=training.memory_budget_gib(143771 * 2**20), start_s=10, profile_s=10, end_reserve_s=15, budget="6m")
# two compiles at once on a CPU at most: the 1 GiB each is what keeps it to two on a small machine's cores
CPU = Scale(train_depths=(2,), seq_len=64, device_batch=4, timed_steps=2, warmup=1, fp8_depth=2, run_depth=2,
            run_steps=30, decode_depth=2, decode_rows=(1, 4), serve_clients=(1, 4), serve_tokens=8, vocab=4096,
            seconds={"train": 240, "fp8": 120, "run": 120, "decode": 60, "serve": 120, "stages": 600, "budget": 540,
                     "budget_24gb": 540},
            costs=training.CPU_COSTS, memory_budget_gib=2.5, start_s=15, profile_s=10, end_reserve_s=20, budget="")


def scale_here():
    """What the suite runs on this machine: the CPU's scale-down, or the GPU's sizes with the warm-ups' memory budget
    taken from this card's memory (an 80 GB H100 must not be planned as the 141 GB H200 the costs were measured on)."""
    if not torch.cuda.is_available():
        return CPU
    total = torch.cuda.get_device_properties(0).total_memory
    return dataclasses.replace(GPU, memory_budget_gib=training.memory_budget_gib(total))


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


def run_json(name, command, timeout, logs, env=None):
    """A child that ends with one JSON line: its dict, or {"error": a line} when it fails, hangs or says nothing. A child
    that outlives `timeout` is killed with everything it started (a chat_web and its GPU workers among them); its
    stdout and stderr are kept in `logs` as NAME.out and NAME.log."""
    return training.Child(name, command, env or {}, logs, timeout).wait()


def cached(cache_dir, name, module):
    """`python -m module` under a portable compile cache of its own (bench/compile_cache.py): the command's start."""
    return [sys.executable, "-m", "bench.compile_cache", os.path.join(cache_dir, f"{name}.bin"), "-m", module]


def section_run(scale, deadline, out, paths):
    depth, steps = scale.run_depth, scale.run_steps
    total = 2 * scale.device_batch * scale.seq_len
    command = [*cached(paths["cache"], f"run_d{depth}", "scripts.base_train"), f"--depth={depth}",
               f"--max-seq-len={scale.seq_len}",
               f"--device-batch-size={scale.device_batch}", f"--total-batch-size={total}",
               f"--num-iterations={steps}", f"--eval-every={steps // 2}", f"--eval-tokens={8 * total}",
               "--core-metric-every=-1", "--sample-every=-1", "--model-tag=suite"]
    result = out["run"] = check.run_smoke("suite_run", command, paths["workspace"], paths["root"],
                                          timeout=left(deadline))
    if os.path.isfile(os.path.join(result["base_dir"], "output.log")):
        shutil.copy(os.path.join(result["base_dir"], "output.log"), os.path.join(paths["logs"], "run.log"))
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
    from nanochat.kernels.decode_graphs import use_decode
    from nanochat.common import compute_init
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.tokenizer import RustBPETokenizer
    from nanochat.recipe import DEFAULT_COMPONENTS, depth_recipe, split_components

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
    use_cpu_kernels(model, device).prepare_for_inference()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = {"engine_batch1_tok_per_s": check.decode_speed(model, tokenizer, 1), "vocab": vocab}
    prompt_tokens, new_tokens = min(128, seq_len // 4), min(64, seq_len // 4)
    generator = torch.Generator().manual_seed(0)
    prompts = [[tokenizer.get_bos_token_id()] + torch.randint(0, vocab - 9, (prompt_tokens - 1,), generator=generator)
               .tolist() for _ in range(max(rows_list))]
    for decode in ("eager", "captured"):
        engine = BatchEngine(model, tokenizer, max_batch=max(rows_list))
        captured = use_decode(engine, decode)  # None for eager: the engine's own step
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
            results["captured_off"] = captured.why_eager
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
    # why captured and eager differ where they do: logits compared while the tokens agree (bench/decode_check.py)
    from bench.decode_check import decode_controls

    rows, fewer = max(rows_list), (sorted(rows_list)[-2] if len(rows_list) > 1 else 1)
    results["controls"] = {"rows": rows, "pairs": decode_controls(model, tokenizer, prompts, new_tokens, rows, fewer)}
    print(json.dumps(results))


def section_decode(scale, deadline, out, paths):
    rows_arg = ",".join(map(str, scale.decode_rows))
    result = out["decode"] = run_json("decode", [sys.executable, "-m", "scripts.gpu_check", "--worker=decode",
                                                 f"--decode-depth={scale.decode_depth}", f"--decode-rows={rows_arg}",
                                                 f"--seq-len={2048 if torch.cuda.is_available() else 256}"],
                                      left(deadline), paths["logs"],
                                      env={"NANOCHAT_BASE_DIR": paths["workspace"]["base_dir"]})
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
    from bench.decode_check import describe

    controls = result.get("controls") or {"pairs": {}}
    for name, pair in controls["pairs"].items():
        rows.append((f"{label}: {controls['rows']} rows, control {name.replace('_vs_', ' vs ').replace('_', ' ')}",
                     describe(name, pair)))
    return rows


def section_serve(scale, deadline, out, paths):
    """bench serve against chat_web: one at a time, then 64 rows eager, then 64 rows captured."""
    run = out.get("run") or {}
    source = ["-i", "base", "-g", "suite"] if run.get("base_dir") and not run.get("error") else ["--fresh"]
    most = max(scale.serve_clients)
    rows, single = [], None
    for max_batch, decode in ((1, "eager"), (most, "eager"), (most, "captured")):
        result = out[f"serve_{max_batch}_{decode}"] = run_json(
            f"serve_{max_batch}_{decode}",
            [sys.executable, "-m", "scripts.bench", "serve", *source, "--max-batch", str(max_batch), "--decode", decode,
             "--concurrency", *[str(c) for c in scale.serve_clients], "--requests", str(most), "--max-tokens",
             str(scale.serve_tokens), "--seconds", "60"],
            left(deadline), paths["logs"],
            env={"NANOCHAT_BASE_DIR": run.get("base_dir") or paths["workspace"]["base_dir"]})
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


def section_stages(scale, deadline, out, paths):
    """Every stage of the speedrun for a few steps (so each CUDA path speedrun.sh takes runs once), in a base dir of
    its own on the built-in corpus, each script under a portable compile cache of its own, then chat_web answering a
    request with the RL model."""
    base = os.path.join(paths["root"], "runs", "suite_stages")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, NANOCHAT_DATA_SOURCE="builtin", PYTHONPATH=check.CHILD_PYTHONPATH)
    rows, times = [], {}
    for module, flags in stage_commands(torch.cuda.is_available()):
        script = module.split(".")[-1]
        start = cached(paths["cache"], f"stages_{script}", module) if module.startswith("scripts.") else \
            [sys.executable, "-m", module]
        log_path = os.path.join(paths["logs"], f"stages_{script}.log")
        t0 = time.time()
        try:
            p = subprocess.run([*start, *flags], cwd=check.REPO_ROOT, env=env, capture_output=True, text=True,
                               timeout=max(1, left(deadline)))
            error = None if p.returncode == 0 else \
                ([line for line in p.stderr.splitlines() if line.strip()][-1:] or [f"exit code {p.returncode}"])[0][:300]
            with open(log_path, "w") as f:
                f.write(p.stdout + p.stderr)
        except subprocess.TimeoutExpired:
            error = "did not finish in the suite's time"
        times[script] = time.time() - t0
        if error:
            rows.append((f"stage {script} ({' '.join(flags)})", f"failed: {error} (log: {log_path})"))
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


def least_budget(env):
    """This machine's least budget in seconds, as the speedrun states it when a budget of one second is refused."""
    p = subprocess.run(["bash", "speedrun.sh"], cwd=check.REPO_ROOT, env={**env, "NANOCHAT_TIME_BUDGET": "1s"},
                       capture_output=True, text=True, timeout=300)
    found = re.search(r"give at least (?:(\d+)h )?(?:(\d+)m )?(\d+)s", p.stderr)
    if not found:
        raise RuntimeError(f"the speedrun stated no least budget: {p.stderr.strip()[-300:]}")
    hours, minutes, seconds = (int(g or 0) for g in found.groups())
    return 3600 * hours + 60 * minutes + seconds


def section_budget(scale, deadline, out, paths, memory=""):
    """The whole speedrun to a time budget as a user starts it, in a fresh base dir on the built-in corpus, offline,
    in this Python's environment (NANOCHAT_PYTHON: a lease's machine has no uv): its plan, its wall time against the
    budget, the stages' seconds and whether any ran out of memory; with `memory`, every stage capped to it."""
    from nanochat.planning.pipeline_plan import ORDER
    from nanochat.planning.time_budget import parse_duration

    name = "budget" + (f"_{memory.lower()}" if memory else "")
    base = os.path.join(paths["root"], "runs", f"suite_{name}")
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    env = {"NANOCHAT_BASE_DIR": base, "NANOCHAT_DATA_SOURCE": "builtin", "NANOCHAT_PYTHON": sys.executable,
           "NANOCHAT_GPU_MEMORY": memory}  # "" is unset for speedrun.sh and every stage
    seconds = parse_duration(scale.budget) if scale.budget else least_budget({**os.environ, **env})
    given = scale.budget or f"{seconds} s (this machine's least)"
    label = f"budgeted speedrun ({given}, built-in corpus, {f'every stage capped to {memory}' if memory else 'whole card'})"
    if left(deadline) < 1.1 * seconds + 10:
        return [(label, f"skipped: {left(deadline):.0f} s left, the budget and its 10 % need {1.1 * seconds:.0f}")]
    child = training.Child(name, ["bash", "speedrun.sh"], {**env, "NANOCHAT_TIME_BUDGET": f"{seconds}s"},
                           paths["logs"], left(deadline))
    try:
        code = child.process.wait(timeout=max(1.0, left(deadline)))
    except subprocess.TimeoutExpired:
        child.kill("past the suite's deadline")
        code = None
    wall = time.time() - child.started
    with open(child.out_path) as f, open(child.log_path) as g:
        printed = f.read() + g.read()
    stage_times = {}
    with contextlib.suppress(OSError), open(os.path.join(base, "speedrun_times.txt")) as f:
        for line in f:
            stage, _, took = line.strip().rpartition(" ")
            stage_times[stage] = int(took)
    plan = [line[len("plan | "):] for line in printed.splitlines() if line.startswith("plan | ")]
    memory_errors = [line for line in printed.splitlines() if "out of memory" in line.lower()]
    out[name] = {"budget_s": seconds, "wall_s": wall, "exit_code": code, "stage_seconds": stage_times, "plan": plan,
                 "out_of_memory": memory_errors[:5]}
    if code != 0:
        tail = [line for line in printed.splitlines() if line.strip()][-1:] or ["no output"]
        why = "killed past the suite's deadline" if code is None else f"exit code {code}"
        return [(label, f"failed: {why} after {wall:.0f} s: {tail[0][:300]} (log: {child.out_path})")]
    apart = wall / seconds - 1
    ran = ", ".join(f"{stage} {took} s" for stage, took in stage_times.items())
    base_plan = next((line for line in plan if re.match(r"d\d+: ", line)), "no base_train plan printed")
    return [(f"{label}: wall time", f"{wall:.0f} s of {seconds} s ({apart * 100:+.1f} %, "
                                    f"{'within' if abs(apart) <= 0.10 else 'OUTSIDE'} 10 %); {ran}"),
            (f"{label}: the plan", "; ".join(" ".join(line.split()) for line in plan if " skipped" not in line and
                                             any(line.startswith(f"{stage} ") for stage in ORDER))),
            (f"{label}: base_train's plan", base_plan.split(" | ends by")[0]),
            (f"{label}: out of memory", f"{len(memory_errors)} times" + (f" (first: {memory_errors[0][:200]})"
                                                                           if memory_errors else ""))]


def section_budget_24gb(scale, deadline, out, paths):
    return section_budget(scale, deadline, out, paths, memory="24GB")


def left(deadline):
    return deadline - time.time()


def run_suite(only, deadline, paths, log, progress=lambda rows, results, after, archives: None):
    """The sections in `only`, in SECTIONS' order (train and fp8 together), until `deadline`: (rows [(check, result)],
    results). progress(rows, results, after, archives) is called with the rows so far whenever one is finished (after
    each section, and in train and fp8 after the warm-ups and each timed run), `archives` when the compile caches or
    the profiles changed, so that a suite cut short has written every row it finished."""
    scale = scale_here()
    rows, out = [], {"scale": {k: v for k, v in scale.__dict__.items() if k != "costs"}}
    together = [name for name in ("train", "fp8") if name in only]
    if together:
        from bench.train import torchao_unavailable

        end = min(deadline, time.time() + sum(scale.seconds[name] for name in together))
        log(f"suite: {','.join(together)} (at most {left(end):.0f} s)")
        torchao_reason = torchao_unavailable(torch.device("cuda" if torch.cuda.is_available() else "cpu")) \
            if "fp8" in together else None
        t0 = time.time()
        try:
            new, results = training.run(together, scale, end, paths, log, paths["reference_commit"], torchao_reason,
                                        lambda new, results, after, archives: progress(
                                            rows + new, {**out, **results}, after, archives))
            out.update(results)
        except Exception as e:  # one section's surprise is its row: the others' numbers still come out
            new = [(f"section {','.join(together)}", f"failed: {type(e).__name__}: {e}")]
        for check_name, result in new:
            log(f"  {check_name}: {result}")
        rows += new
        out.setdefault("seconds", {})[",".join(together)] = time.time() - t0
        progress(rows, out, ",".join(together), True)
    for name in SECTIONS:
        if name not in only or name in together:
            continue
        if left(deadline) < 10:
            rows.append((f"section {name}", "skipped: the suite's time was spent"))
            continue
        log(f"suite: {name} (at most {min(scale.seconds[name], left(deadline)):.0f} s)")
        section_deadline = min(deadline, time.time() + scale.seconds[name])
        t0 = time.time()
        try:
            new = globals()[f"section_{name}"](scale, section_deadline, out, paths)
        except Exception as e:  # one section's surprise is its row: the others' numbers still come out
            new = [(f"section {name}", f"failed: {type(e).__name__}: {e}")]
        for check_name, result in new:
            log(f"  {check_name}: {result}")
        rows += new
        out.setdefault("seconds", {})[name] = time.time() - t0
        progress(rows, out, name, True)
    return rows, out


def main(args, log):
    """gpu_check --suite: the carried compile caches unpacked, the workspace, the sections, the table and its dated
    files, the archives, one JSON line."""
    import datetime

    from nanochat.common import UserError, ensure_writable, get_base_dir
    from bench.common import ensure_builtin_workspace

    t_start = time.time()
    only = [name for name in args.only.split(",") if name] if args.only else list(SECTIONS)
    unknown = [name for name in only if name not in SECTIONS]
    if unknown or args.suite_minutes <= 0:
        raise UserError(f"--only takes {','.join(SECTIONS)} (got {','.join(unknown)}) and --suite-minutes must be > 0"
                        if unknown else f"--suite-minutes must be > 0 (got {args.suite_minutes})")
    root = os.path.join(get_base_dir(), "gpu_check")
    results_dir = args.out_dir or args.results_dir
    cache_dir = args.compile_cache_dir or os.path.join(root, "compile_cache")
    # before any section: a lease's rows must not be lost at the end to a folder that cannot be written
    ensure_writable(results_dir, "the suite's results", fix="give --out-dir (or --results-dir) a folder you can write")
    ensure_writable(cache_dir, "the compile caches", fix="give --compile-cache-dir a folder you can write")
    work = os.path.join(root, "suite")  # this run's profiles and children's logs
    shutil.rmtree(work, ignore_errors=True)
    paths = {"root": root, "cache": cache_dir, "profiles": os.path.join(work, "profiles"),
             "logs": os.path.join(work, "logs")}
    for folder in (results_dir, cache_dir, paths["profiles"], paths["logs"]):
        os.makedirs(folder, exist_ok=True)
    log = teed(log, os.path.join(args.out_dir or work, "suite.log"), t_start)

    cuda = torch.cuda.is_available()
    paths["reference"], paths["reference_commit"] = reference_checkout(args.reference)
    log(f"gpu_check --suite | sections {','.join(only)} | {args.suite_minutes:g} minutes | "
        f"{'GPU' if cuda else 'CPU scale-down'} | reference: {paths['reference_commit']}")
    carried = os.path.join(cache_dir, CACHE_ARCHIVE)
    if os.path.isfile(carried):
        names = compile_cache.unpack(carried, cache_dir)
        log(f"compile caches: {len(names)} carried in ({', '.join(names)}), unpacked into {cache_dir}")
    else:
        log(f"compile caches: none carried in ({carried} absent): every compile starts cold")
    paths["workspace"] = ensure_builtin_workspace(os.path.join(root, "workspace"), 32768 if cuda else 4096, log=log)
    env = check.environment(get_base_dir())
    scale = scale_here()
    # a lease's copy of the tree came with the .git of the session's start (2026-11-28: rows said ce26dd8 of a tree
    # at 2fc4048), so the sender names its commit
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=check.REPO_ROOT,
                                           capture_output=True, text=True).stdout.strip() or "unknown commit"
    machine = check.machine_label(env)
    # the results go to dated files of their own (dev/gpu_results/ by default), never onto BENCHMARKS.md's page; named
    # now, since they are written as the rows come (a lease cut short still returns every row it finished)
    stamp = f"{datetime.datetime.now().strftime('%Y-%m-%d_%H%M%S')}_{slug(machine)}"
    path = os.path.join(results_dir, f"{stamp}.md")

    def write(rows, results, status):
        date = datetime.date.today().isoformat()
        table = "| check | result | machine | command | commit | date |\n|---|---|---|---|---|---|\n" + "\n".join(
            f"| {name} | {result} | {machine} | `python -m scripts.gpu_check --suite` | {commit} | {date} |"
            for name, result in rows)
        summary = json.dumps({"gpu_suite": {"machine": machine, "commit": commit, "status": status, "rows": rows,
                                            "results": results}}, default=str)
        write_file(path, f"# gpu_check --suite, {date}: {machine}\n\nsections {','.join(only)}, commit {commit}; "
                         f"{status}\n\n{table}\n\n```json\n{summary}\n```\n")
        write_file(os.path.join(results_dir, f"{stamp}.json"), summary + "\n")
        return table, summary

    archived = []  # whether the archives in --out-dir were packed since the last section ended

    def progress(rows, results, after, archives):
        write(rows, results, f"partial: written at {time.time() - t_start:.0f} s, after {after}; the suite went on")
        if archives and args.out_dir:
            archive(only, scale, paths, args.out_dir, log)
            archived[:] = [True]

    rows, results = run_suite(only, t_start + 60 * args.suite_minutes - scale.end_reserve_s, paths, log, progress)
    table, summary = write(rows, results, "complete")
    print("\n" + table)
    failed = [name for name, result in rows if result.startswith("failed")]
    log(f"suite: {len(rows)} rows, {len(failed)} failed, {time.time() - t_start:.0f} s; written to {path}")
    if not archived:  # every section ends by packing them into --out-dir; without one they go to the cache folder
        archive(only, scale, paths, args.out_dir, log)
    print(summary)
    return not failed


def write_file(path, text):
    """`text` into `path` through a file renamed over it: a suite killed while writing leaves the last whole one."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def teed(log, path, t_start):
    """`log`, each line also appended to the file `path` with the seconds since t_start."""
    def both(message):
        log(message)
        with open(path, "a") as f:
            f.write(f"[{time.time() - t_start:5.0f}s] {message}\n")
    return both


def archive(only, scale, paths, out_dir, log):
    """The compile caches into one archive (in out_dir, else in the cache folder, where a later run unpacks it), and
    with out_dir the profiles and every child's log into another: each under ARCHIVE_LIMIT, the most wanted first."""
    wanted = [c.name for c in training.configs_for(only, scale)]
    names = sorted((name for name in os.listdir(paths["cache"]) if name.endswith(".bin")),
                   key=lambda name: (wanted.index(name[:-4]) if name[:-4] in wanted else len(wanted), name))
    caches = [os.path.join(paths["cache"], name) for name in names]
    packed, left_out = compile_cache.pack(caches, os.path.join(out_dir or paths["cache"], CACHE_ARCHIVE), ARCHIVE_LIMIT)
    log(f"compile caches: {len(packed)} packed into {CACHE_ARCHIVE}" +
        (f", left out for its size: {', '.join(left_out)}" if left_out else ""))
    if not out_dir:
        log(f"profiles and logs: in {os.path.dirname(paths['profiles'])}")
        return
    files = [os.path.join(folder, name) for folder in (paths["profiles"], paths["logs"]) for name in os.listdir(folder)]
    files.sort(key=lambda p: (p.endswith(".trace.json.gz"), os.path.dirname(p) == paths["logs"], p))  # text first
    packed, left_out = compile_cache.pack(files, os.path.join(out_dir, PROFILES_ARCHIVE), ARCHIVE_LIMIT)
    log(f"profiles and logs: {len(packed)} files packed into {PROFILES_ARCHIVE}" +
        (f", left out for its size: {', '.join(left_out)}" if left_out else ""))
    for problem in out_dir_problems(out_dir):
        log(f"--out-dir: {problem}")


def out_dir_problems(folder):
    """What a lease's output folder would not return whole: more than OUT_MAX_FILES files, a file of OUT_MAX_BYTES or
    more, a file deeper than OUT_MAX_DEPTH folders. Returns the problems, one sentence each."""
    problems, files = [], []
    for dirpath, _, names in os.walk(folder):
        depth = len(os.path.relpath(dirpath, folder).split(os.sep)) if dirpath != folder else 0
        for name in names:
            path = os.path.join(dirpath, name)
            files.append(path)
            if os.path.getsize(path) >= OUT_MAX_BYTES:
                problems.append(f"{path} is {os.path.getsize(path) / 2**20:.1f} MiB, at least "
                                f"{OUT_MAX_BYTES / 2**20:.0f}")
            if depth > OUT_MAX_DEPTH:
                problems.append(f"{path} is {depth} folders deep, more than {OUT_MAX_DEPTH}")
    if len(files) > OUT_MAX_FILES:
        problems.append(f"{len(files)} files, more than {OUT_MAX_FILES}")
    return problems


def slug(text):
    """'1x NVIDIA H200 (139.8 GiB), torch 2.11' -> '1x-NVIDIA-H200-139.8-GiB-torch-2.11': a file name's part."""
    return "-".join("".join(c if c.isalnum() or c == "." else " " for c in text).split())[:60]
