"""
What `python -m scripts.gpu_check` measures on a node before the speedrun, and how it judges the result: the
machine (torch, CUDA, driver, NCCL, each GPU, disk), the speed of a base_train run read off its report curve, the
largest device batch that fits a model of the speedrun's depth (one compiled bf16 training step, probed), NCCL
all-reduce bandwidth, engine decode speed, and the verdict with what to change; and how a smoke runs, as a real
base_train process in a base dir of its own. The script wires these together.
"""

import os
import shutil
import statistics
import subprocess
import time

import torch

from nanochat.common import autocast_for, child_pythonpath, compile_model, cpu_name, json_loads
from nanochat.recipe import REFERENCE_BATCH

# The speedrun's base model (speedrun.sh, gpu preset): depth 24, 2^19 tokens per step of 2048-token rows, 10 tokens per
# parameter, vocabulary 32768, device batch 16 unless NANOCHAT_DEVICE_BATCH says otherwise.
SPEEDRUN = {"depth": 24, "seq_len": 2048, "total_batch": REFERENCE_BATCH, "tokens_per_param": 10, "vocab_size": 32768,
            "device_batch": 16, "shards": 150}
SHARD_GIB = 0.1  # an assumption: a climbmix shard of ~60M tokens as zstd parquet (fineweb-edu's are ~0.1 GiB)
# 1 GPU and 2 GPUs on the same global batch: val bpb within 0.1 % at step 0 (the same evaluation tokens) and within 3 %
# after the smoke. Each rank reads its own row groups, so the runs train on other batches in another order, which alone
# moved a 30-step d2 run by 0.97 % on a CPU; a broken all-reduce moves it by far more.
AGREEMENT_AT_START, AGREEMENT = 0.001, 0.03
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD_PYTHONPATH = child_pythonpath(REPO_ROOT)


# -----------------------------------------------------------------------------
# The machine


def environment(base_dir):
    """Versions, devices and free disk, as a plain dict."""
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "cpu": cpu_name(), "cpu_count": os.cpu_count(), "disk_free_gib": shutil.disk_usage(base_dir).free / 2**30,
           "base_dir": base_dir, "driver": None, "nccl": None, "gpus": []}
    try:
        import psutil

        env["ram_gib"] = psutil.virtual_memory().total / 2**30
    except ImportError:
        env["ram_gib"] = None
    if env["cuda_available"]:
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
        env["driver"] = nvidia_driver_version()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            major, minor = props.major, props.minor
            env["gpus"].append({"index": i, "name": props.name, "memory_gib": props.total_memory / 2**30,
                                "capability": f"{major}.{minor}", "bf16": major >= 8, "fp8": (major, minor) >= (8, 9)})
    return env


def nvidia_driver_version():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment_rows(env):
    rows = [["torch", env["torch"]], ["CUDA (torch build)", env["cuda"] or "none"],
            ["NVIDIA driver", env["driver"] or "-"], ["NCCL", env["nccl"] or "-"],
            ["CPU", f"{env['cpu']}, {env['cpu_count']} cores" + (f", {env['ram_gib']:.0f} GiB RAM" if env["ram_gib"] else "")],
            ["free disk", f"{env['disk_free_gib']:.0f} GiB under {env['base_dir']}"]]
    for gpu in env["gpus"]:
        rows.append([f"GPU {gpu['index']}", f"{gpu['name']}, {gpu['memory_gib']:.1f} GiB, compute capability "
                     f"{gpu['capability']}, bf16 {'yes' if gpu['bf16'] else 'NO'}, fp8 {'yes' if gpu['fp8'] else 'no'}"])
    return rows


def speedrun_disk_gib(num_params, matrix_params):
    """
    Disk the gpu preset needs, estimated: its shards, plus the checkpoints its four training stages keep (two each):
    fp32 weights, Muon's momentum for the matrices and AdamW's two moments for the rest.
    """
    checkpoint = 4 * (num_params + matrix_params + 2 * (num_params - matrix_params)) / 2**30
    return SPEEDRUN["shards"] * SHARD_GIB + 4 * 2 * checkpoint


# -----------------------------------------------------------------------------
# Training speed and memory


def run_smoke(name, command, workspace, root, timeout=None):
    """Run a base_train smoke in a fresh base dir of its own (the workspace's data and tokenizer linked in)."""
    base = os.path.join(root, "runs", name)
    shutil.rmtree(base, ignore_errors=True)
    os.makedirs(base)
    for entry in ("tokenizer", "base_data"):
        os.symlink(os.path.join(workspace["base_dir"], entry), os.path.join(base, entry))
    env = dict(os.environ, NANOCHAT_BASE_DIR=base, NANOCHAT_DATA_SOURCE=workspace["source"], PYTHONPATH=CHILD_PYTHONPATH)
    t0 = time.time()
    try:
        p = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s", "base_dir": base}
    with open(os.path.join(base, "output.log"), "w") as f:  # the whole run's output, for when a smoke fails
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")] or p.stderr.strip().splitlines()[-1:]
        error = errors[0].removeprefix("error: ")[:300] if errors else f"exit code {p.returncode}"
        return {"error": f"{error} (whole output: {base}/output.log)", "base_dir": base}
    return {**curve_summary(base), "seconds": time.time() - t0, "base_dir": base}


def curve_summary(base_dir, skip=3):
    """Median tok/s and MFU of a finished base_train run (its first `skip` steps, compile and warmup, left out), and its
    val bpb by step, from the run's report curve."""
    with open(os.path.join(base_dir, "report", "curves", "base_train.jsonl")) as f:
        records = [json_loads(line) for line in f if line.strip()]
    steps = [r for r in records if "tok_per_sec" in r][skip:]
    return {"tok_per_sec": statistics.median(r["tok_per_sec"] for r in steps) if steps else None,
            "mfu": statistics.median(r["mfu"] for r in steps) if steps and "mfu" in steps[0] else None,
            "val_bpb": {r["step"]: r["val_bpb"] for r in records if "val_bpb" in r}}


def probe_device_batch(depth, seq_len, vocab_size, device_batch_size, device, steps=3):
    """
    Whether base_train's step fits at this device batch: the model of this depth, compiled, in the compute dtype, with
    Muon + AdamW, on random tokens, `steps` whole optimizer steps. Returns {fits, peak_gib, step_s}.
    """
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.optim import compile_muon_updates
    from nanochat.recipe import DEFAULT_COMPONENTS, build_optimizers, depth_recipe, split_components
    from nanochat.loop import train_step

    model_components, optimizer_components = split_components(DEFAULT_COMPONENTS)  # base_train's model and optimizer
    recipe = depth_recipe(depth, vocab_size, seq_len, device_batch_size * seq_len, num_iterations=1,
                          components=model_components)
    try:
        model = use_cpu_kernels(build_model(recipe.model_config, device), device)
        train_model = compile_model(model)
        optimizers = compile_muon_updates(build_optimizers(model, **recipe.lrs(), optimizer_components=optimizer_components))
        batch = torch.randint(0, vocab_size, (device_batch_size, seq_len + 1), device=device)
        micro_batches = [(batch[:, :-1], batch[:, 1:])]
        autocast = autocast_for(device)
        for step in range(steps):
            t0 = time.perf_counter()
            train_step(train_model, optimizers, micro_batches, lambda m, xy: m(*xy), 1.0, 0.95, autocast)
            step_s = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        return {"fits": False, "peak_gib": None, "step_s": None}
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"fits": True, "peak_gib": peak, "step_s": step_s}


def allreduce_bandwidth(device, iters=20):
    """All-reduce bus bandwidth in GB/s over the running process group (what nccl-tests calls busbw), on 256 MiB of bf16
    per GPU (16 MiB over gloo on CPUs, which move ~1 GB/s)."""
    import torch.distributed as dist

    world, mib = dist.get_world_size(), 256 if device.type == "cuda" else 16
    x = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        dist.all_reduce(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    seconds = (time.perf_counter() - t0) / iters
    return x.numel() * x.element_size() / seconds * 2 * (world - 1) / world / 1e9


def rank_agreement(one, two, last_step):
    """Val bpb by step of a 1-rank and a multi-rank run of the same global batch, judged against AGREEMENT."""
    start, end = abs(one[0] - two[0]) / one[0], abs(one[last_step] - two[last_step]) / one[last_step]
    return {"one": one[last_step], "two": two[last_step], "start_difference": start, "relative_difference": end,
            "agrees": start < AGREEMENT_AT_START and end < AGREEMENT}


# -----------------------------------------------------------------------------
# Inference speed


def decode_speed(model, tokenizer, batch):
    """Engine decode tok/s (all rows) after the first step, sampling at temperature 1 from a random prompt of a quarter
    of the context (at most 64 tokens), for up to half the context (at most 128)."""
    from nanochat.engine import Engine

    device = model.get_device()
    prompt_tokens, new_tokens = min(64, model.config.sequence_len // 4), min(128, model.config.sequence_len // 2)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ordinary = tokenizer.get_vocab_size() - 9  # the nine specials are the last ids
    rng = torch.Generator().manual_seed(0)
    prompt = [tokenizer.get_bos_token_id()] + torch.randint(0, ordinary, (prompt_tokens - 1,), generator=rng).tolist()
    engine = Engine(model, tokenizer)
    for _ in engine.generate(prompt, num_samples=batch, max_tokens=4):  # warm up kernels and the allocator
        pass
    steps, t_first = 0, None
    for _ in engine.generate(prompt, num_samples=batch, max_tokens=new_tokens, temperature=1.0):
        sync()
        steps += 1
        if steps == 1:
            t_first = time.perf_counter()
    return batch * (steps - 1) / (time.perf_counter() - t_first) if steps > 1 else None


# -----------------------------------------------------------------------------
# The verdict


def verdict(results):
    """(ready, what to change): the checks that failed or would make the speedrun fail or crawl, each with its fix."""
    env, changes = results["environment"], []
    for name, smoke in results["smokes"].items():
        if smoke.get("error"):
            changes.append(f"{name} failed ({smoke['error']}); fix that before the speedrun")
    agreement = results.get("multi_rank")
    if agreement and not agreement["agrees"]:
        changes.append(f"{results['nproc']} ranks and 1 rank disagree (val bpb {agreement['start_difference']:.2%} apart at "
                       f"step 0, {agreement['relative_difference']:.1%} at the end; at most {AGREEMENT_AT_START:.1%} and "
                       f"{AGREEMENT:.0%} expected): check the process group (NCCL_DEBUG=INFO on GPUs) before a multi-rank run")
    if not env["cuda_available"]:
        return not changes, changes
    if not all(gpu["bf16"] for gpu in env["gpus"]):
        changes.append("a GPU without bf16 (compute capability < 8.0) trains in fp32, many times slower: use A100/H100-class GPUs")
    n = len(env["gpus"])
    if SPEEDRUN["total_batch"] % (SPEEDRUN["seq_len"] * n):
        changes.append(f"the gpu preset splits its 2^19-token batch over 1, 2, 4, 8 or 16 GPUs, not {n}: set "
                       "CUDA_VISIBLE_DEVICES to such a number")
    probe = results.get("batch_probe")
    if probe and not probe["speedrun_fits"]:
        fits = probe["largest_fitting"]
        changes.append(f"device batch {probe['speedrun_batch']} does not fit at depth {SPEEDRUN['depth']}: run "
                       f"NANOCHAT_DEVICE_BATCH={fits} bash speedrun.sh" if fits else
                       f"not even device batch 1 fits at depth {SPEEDRUN['depth']}: this GPU has too little memory")
    if results.get("disk_needed_gib") and env["disk_free_gib"] < results["disk_needed_gib"]:
        changes.append(f"{env['disk_free_gib']:.0f} GiB free under {env['base_dir']}, the speedrun needs about "
                       f"{results['disk_needed_gib']:.0f} GiB: free some, or point NANOCHAT_BASE_DIR elsewhere")
    return not changes, changes


def machine_label(env):
    """The machine as a BENCHMARKS.md row names it: GPUs (or the CPU), torch, CUDA."""
    if env["gpus"]:
        return f"{len(env['gpus'])}x {env['gpus'][0]['name']}, torch {env['torch']}, CUDA {env['cuda']}"
    return f"{env['cpu']} ({env['cpu_count']} cores), torch {env['torch']}, no CUDA"


def markdown_rows(results, date, commit):
    """Rows in BENCHMARKS.md's GPU table format: check | result | machine | command | commit | date."""
    machine = machine_label(results["environment"])
    command = "`python -m scripts.gpu_check`"
    rows = []
    for name, smoke in results["smokes"].items():
        if smoke.get("error"):
            result = f"failed: {smoke['error']}"
        else:
            result = f"{smoke['tok_per_sec']:,.0f} tok/s" + (f", MFU {smoke['mfu']:.1f} %" if smoke.get("mfu") else "")
        rows.append([name, result])
    probe = results.get("batch_probe")
    if probe:
        rows.append([f"largest device batch at d{SPEEDRUN['depth']}, T {SPEEDRUN['seq_len']}", probe["summary"]])
    if results.get("allreduce_busbw_gbs"):
        rows.append([f"all-reduce bus bandwidth, {results['nproc']} ranks", f"{results['allreduce_busbw_gbs']:.1f} GB/s"])
    if results.get("multi_rank"):
        t = results["multi_rank"]
        rows.append([f"{results['nproc']} ranks vs 1, val bpb", f"{t['start_difference']:.3%} apart at step 0, "
                     f"{t['relative_difference']:.2%} at the end ({'agree' if t['agrees'] else 'DISAGREE'})"])
    for batch, speed in results.get("decode", {}).items():
        rows.append([f"engine decode, batch {batch}", f"{speed:,.0f} tok/s" if speed else "-"])
    return [f"| {check} | {result} | {machine} | {command} | {commit} | {date} |" for check, result in rows]

