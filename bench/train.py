"""
`bench train`: the real base_train step timed (ms/step, tok/s, MFU against a peak measured in the same process, or the data sheet's on a GPU), one fresh process per configuration; or, with --alternate, recipes' steps in turn in one process, for what a recipe costs against another.

A timed step cycles a few device batches made before it from the real loader, as bench/reference_train.py times the
reference's step, and the loader's own cost is measured apart (ms a batch). --compile-cache FILE loads a portable
compile cache before the first compile and saves one after the warm-up steps; --warmup-only stops there (gpu_suite's
warm-up processes); --profile STEM writes a reduced profile of two steps and a step's peak memory (bench/profiling.py).
"""

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench import compile_cache, profiling
from bench.common import OtherLoad, bench_vocab_size, emit_json, ensure_data, log, machine_info, print_table
from nanochat.common import (UserError, autocast_for, compile_model, compute_init, describe_peak_flops,
                             get_compute_dtype, keep_freed_memory_in_process, measure_matmul_flops, peak_memory_mib,
                             resolve_device_type)
from nanochat.recipe import DEFAULT_COMPONENTS, canonical_components

CPU_CONFIGS = [(4, 256, 8), (6, 512, 8)]  # (depth, seq_len, device_batch_size)
GPU_CONFIGS = [(12, 2048, 32), (20, 2048, 32)]
PREMADE_BATCHES = 4  # the device batches a timed step cycles through: as many as bench/reference_train.py makes


class Run:
    """Everything one base_train step needs, built exactly as base_train builds it."""

    def __init__(self, depth, seq_len, batch, vocab_size, device, use_compile, components, fp8=""):
        from nanochat.dataloader import DataLoader
        from nanochat.gpt import build_model
        from nanochat.kernels.cpu import use_cpu_kernels
        from nanochat.tokenizer import get_tokenizer
        from nanochat.optim import compile_muon_updates
        from nanochat.recipe import build_optimizers, depth_recipe, split_components

        tokenizer = get_tokenizer()
        if tokenizer.get_vocab_size() > vocab_size:
            raise UserError(f"--vocab-size={vocab_size} is smaller than the tokenizer's {tokenizer.get_vocab_size()} tokens")
        keep_freed_memory_in_process()  # as base_train does
        torch.manual_seed(42)
        self.device = device
        self.tokens_per_step = batch * seq_len
        # base_train's recipe for this batch (grad_accum = 1, so the total batch is B * T)
        model_components, optimizer_components = split_components(components)
        recipe = depth_recipe(depth, vocab_size, seq_len, self.tokens_per_step, num_iterations=1,
                              components=model_components)
        self.config = recipe.model_config
        self.model = use_cpu_kernels(build_model(self.config, device), device)  # as base_train
        self.fp8_linears = 0
        if fp8:  # base_train's --fp8 (ours), or torchao's float8 training: the blocks' linears and lm_head, before compile
            from nanochat.kernels.fp8 import convert_to_fp8

            if fp8 == "torchao" and torchao_unavailable(device):
                raise UserError(torchao_unavailable(device))
            # counted in the result: an fp8 row whose loss equals bf16's to 4 decimals (H100, 2026-11-28) must
            # show whether any linear was converted at all
            self.fp8_linears = (convert_with_torchao if fp8 == "torchao" else convert_to_fp8)(self.model)
        self.flops_per_token = recipe.flops_per_token
        self.dtype = get_compute_dtype(device)
        self.autocast = autocast_for(device)
        self.train_model = compile_model(self.model) if use_compile else self.model
        self.optimizers = build_optimizers(self.model, **recipe.lrs(), optimizer_components=optimizer_components)
        if use_compile:  # as base_train: Muon's update compiled with the model
            compile_muon_updates(self.optimizers)
        self.loader = DataLoader(tokenizer, batch, seq_len, split="train", device=device)
        # real tokens, read before any step: the timed step is the model's and the optimizer's work alone, as the
        # reference's is timed; what the loader costs is measured apart (loader_ms_per_batch)
        self.batches = [next(self.loader) for _ in range(PREMADE_BATCHES)]
        self.sync = profiling.synchronizer(device)
        self.step = 0

    def next_batch(self):
        return self.batches[self.step % len(self.batches)]

    def train_step(self):
        """One real optimizer step (what base_train runs), timed to completion."""
        from nanochat.optim import muon_momentum
        from nanochat.loop import train_step

        t0 = time.perf_counter()
        loss = train_step(self.train_model, self.optimizers, [self.next_batch()], lambda m, xy: m(*xy), 1.0,
                          muon_momentum(self.step), self.autocast)
        self.sync()
        self.step += 1
        return time.perf_counter() - t0, loss

    def instrumented_step(self, from_loader=False):
        """The same step taken apart into the phases a profile labels, each ended by a sync: seconds spent in each. Its
        data is a batch made before (as the timed step's), or with from_loader the loader's next, as base_train reads
        it (bench dataloader's wait for data)."""
        from nanochat.optim import apply_schedules, muon_momentum

        times, t0 = {}, time.perf_counter()
        with profiling.phase("data", self.sync):
            x, y = next(self.loader) if from_loader else self.next_batch()
        times["data"], t0 = time.perf_counter() - t0, time.perf_counter()
        with profiling.phase("forward", self.sync):
            with self.autocast:
                loss = self.train_model(x, y)
        times["forward"], t0 = time.perf_counter() - t0, time.perf_counter()
        with profiling.phase("backward", self.sync):
            loss.backward()
        times["backward"], t0 = time.perf_counter() - t0, time.perf_counter()
        with profiling.phase("optimizer", self.sync):
            apply_schedules(self.optimizers, 1.0, momentum=muon_momentum(self.step))
            for opt in self.optimizers:
                opt.step()
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        times["optimizer"] = time.perf_counter() - t0
        self.step += 1
        return times

    def loader_ms_per_batch(self, batches=8):
        """The loader's own cost: ms a batch pulled back to back once its prefetched batches are taken, i.e. how fast it
        makes them (a step shorter than this would wait for data in base_train)."""
        for _ in range(2 * batches):  # more than its prefetch queue holds (4 batches, as base_train builds it)
            next(self.loader)
        self.sync()
        t0 = time.perf_counter()
        for _ in range(batches):
            next(self.loader)
        self.sync()
        return (time.perf_counter() - t0) / batches * 1000

    def close(self):
        self.loader.close()


def bench_train_one(args, depth, seq_len, batch, use_compile, components):
    """Time one (config, compile) run in this process; returns its result dict (with --warmup-only, what the warm-up
    took, and nothing timed)."""
    _, _, _, _, device = compute_init(args.device_type)  # as base_train: picks the device, tf32 on CUDA
    vocab_size = bench_vocab_size(args.vocab_size, device.type)
    ensure_data(vocab_size)
    cache = compile_cache.load(args.compile_cache)  # before anything compiles
    run = Run(depth, seq_len, batch, vocab_size, device, use_compile, components, fp8=args.fp8)
    config = {"depth": depth, "seq_len": seq_len, "device_batch_size": batch, "vocab_size": vocab_size,
              "components": components or "none", "fp8": args.fp8 or None, "fp8_linears": run.fp8_linears,
              "compile": bool(use_compile), "device": device.type, "dtype": str(run.dtype).replace("torch.", ""),
              "threads": torch.get_num_threads(), "params": run.model.num_params(), "flops_per_token": run.flops_per_token}
    # The peak is measured before and after the timed steps and the higher value kept: on a shared VM the
    # speed of the same matmul drifts by 10-20 % over seconds, and the higher value gives the lower, honest MFU.
    with OtherLoad() as peak_other:
        peak_before, peak_source = describe_peak_flops(device, run.dtype, seconds=args.peak_seconds, rounds=3)

    t0 = time.perf_counter()
    first_step, _ = run.train_step()  # includes compilation when compiling
    after_first = compile_cache.compile_counts()
    for _ in range(args.warmup - 1):
        run.train_step()
    warmup_s = time.perf_counter() - t0
    cache["compile_cache_saved_bytes"] = compile_cache.save(args.compile_cache)
    warmed = {**config, **cache, "first_step_s": first_step, "warmup_s": warmup_s, "warmup_steps": args.warmup}
    if args.warmup_only:
        run.close()
        return {**warmed, "compile_counts": compile_cache.after_first_step(after_first),
                "peak_mem_mib": peak_memory_mib(device)}
    # Where the peak is measured, a short probe of it also follows every timed step, and the interleaved MFU
    # divides by the median probe: a step and its neighbouring probes see the same share of a shared host, so
    # this ratio holds still while both absolute speeds swing (a probe costs the next step its warm caches).
    interleave = args.probe_seconds > 0 and peak_source.startswith("measured")
    step_times, losses, probes = [], [], []
    with OtherLoad() as other:
        for _ in range(args.steps):
            dt, loss = run.train_step()
            step_times.append(dt)
            losses.append(loss)
            if interleave:
                probes.append(measure_matmul_flops(device, run.dtype, seconds=args.probe_seconds, rounds=1))
    parts = [run.instrumented_step() for _ in range(args.breakdown_steps)]
    peak_mem_mib = peak_memory_mib(device)  # the timed steps' own peak, before a profile's steps run
    loader_ms = run.loader_ms_per_batch()
    run.close()
    counts = compile_cache.after_first_step(after_first)
    if args.profile:
        profiling.record(args.profile, os.path.basename(args.profile), run.instrumented_step, device, counts)
    peak_after, _ = describe_peak_flops(device, run.dtype, seconds=args.peak_seconds, rounds=3)
    peak = max(peak_before, peak_after)

    step_s = statistics.median(step_times)
    tok_per_s = run.tokens_per_step / step_s
    model_flops = run.flops_per_token * tok_per_s
    peak_interleaved = statistics.median(probes) if probes else None
    breakdown = {k: statistics.median(p[k] for p in parts) * 1000 for k in parts[0]} if parts else {}
    return {
        **warmed, "steps": args.steps, "ms_per_step": step_s * 1000, "ms_per_step_min": min(step_times) * 1000,
        "ms_per_step_max": max(step_times) * 1000,
        "tok_per_s": tok_per_s, "model_flops_per_s": model_flops, "peak_flops": peak, "peak_flops_before": peak_before,
        "peak_flops_after": peak_after, "peak_source": peak_source,
        "mfu": model_flops / peak, "peak_flops_interleaved": peak_interleaved,
        "mfu_interleaved": model_flops / peak_interleaved if probes else None, "peak_mem_mib": peak_mem_mib,
        "peak_mem_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS",
        "breakdown_ms": breakdown, "loader_ms_per_batch": loader_ms, "final_loss": losses[-1] if losses else None,
        "other_load_cores": other.cores, "peak_other_load_cores": peak_other.cores, "compile_counts": counts,
        "profile": args.profile or None,
    }


def bench_train_alternating(args, depth, seq_len, batch, use_compile, recipes):
    """
    The recipes' steps taken in turn in one process (A B, then B A, ...): each pair of steps sees the same state of a
    shared machine, whose speed drifts by 2-5 % between separate runs, more than a component costs. Returns one
    result per recipe: its median step, and its tok/s against the first recipe's as the median of the pairs' ratios.
    """
    _, _, _, _, device = compute_init(args.device_type)
    vocab_size = bench_vocab_size(args.vocab_size, device.type)
    ensure_data(vocab_size)
    runs = [Run(depth, seq_len, batch, vocab_size, device, use_compile, recipe) for recipe in recipes]
    for _ in range(args.warmup):
        for run in runs:
            run.train_step()
    times = [[] for _ in runs]
    with OtherLoad() as other:
        for i in range(args.steps):
            order = range(len(runs)) if i % 2 == 0 else reversed(range(len(runs)))
            for k in order:
                times[k].append(runs[k].train_step()[0])
    for run in runs:
        run.close()
    results = []
    for recipe, run, step_times in zip(recipes, runs, times):
        step_s = statistics.median(step_times)
        results.append({
            "depth": depth, "seq_len": seq_len, "device_batch_size": batch, "vocab_size": vocab_size,
            "components": recipe or "none", "compile": bool(use_compile), "device": device.type,
            "dtype": str(run.dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "steps": args.steps,
            "ms_per_step": step_s * 1000, "tok_per_s": run.tokens_per_step / step_s,
            "tok_per_s_vs_first": statistics.median(a / b for a, b in zip(times[0], step_times)),
            "other_load_cores": other.cores})
    return results


def alternating_table(results):
    rows = [[f"d{r['depth']}", r["seq_len"], r["device_batch_size"], r["components"], "yes" if r["compile"] else "no",
             r["dtype"], f"{r['ms_per_step']:.1f}", f"{r['tok_per_s']:,.0f}", f"{100 * (r['tok_per_s_vs_first'] - 1):+.1f}%",
             f"{r['other_load_cores']:.2f}"] for r in results]
    print_table("train, recipes alternated step by step in one process (median step; tok/s against the first recipe: "
                "the median of the pairs' ratios)",
                ["model", "T", "B", "components", "compile", "dtype", "ms/step", "tok/s", "vs first", "other load"], rows)


def train_table(runs):
    rows = []
    for r in runs:
        b = r["breakdown_ms"]
        total = sum(b.values()) or 1.0
        rows.append([
            f"d{r['depth']}", r["seq_len"], r["device_batch_size"], r.get("components", "none"),
            "yes" if r["compile"] else "no",
            f"{r['ms_per_step']:.1f}", f"{r['tok_per_s']:,.0f}", f"{r['model_flops_per_s'] / 1e9:.1f}",
            f"{r['peak_flops'] / 1e9:.1f}", f"{100 * r['mfu']:.1f}%",
            f"{100 * r['mfu_interleaved']:.1f}%" if r.get("mfu_interleaved") else "-", f"{r['peak_mem_mib']:.0f}",
            f"{r['first_step_s']:.1f} ({r['compile_cache']})", f"{r['other_load_cores']:.2f}",
            " / ".join(f"{b.get(k, 0):.0f}" for k in ("data", "forward", "backward", "optimizer"))
            + f" ({100 * b.get('data', 0) / total:.1f}% data)", f"{r['loader_ms_per_batch']:.1f}",
        ])
    print_table("train: median of the timed steps (real base_train step, grad_accum=1, pre-made batches; the loader "
                "timed apart)",
                ["model", "T", "B", "components", "compile", "ms/step", "tok/s", "GFLOP/s", "peak GFLOP/s", "MFU", "MFU interleaved", "peak MiB",
                 "1st step s (cache)", "other load", "data/fwd/bwd/opt ms", "loader ms/batch"], rows)


def compile_modes(value):
    return {"0": [False], "1": [True], "both": [False, True]}[value]


def cmd_train(args):
    if args.probe_seconds < 0 or args.peak_seconds <= 0:
        raise UserError(f"--peak-seconds must be > 0 and --probe-seconds >= 0 (got {args.peak_seconds}, {args.probe_seconds})")
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1 (got {args.steps}): the timings are medians over the timed steps")
    if args.threads:
        torch.set_num_threads(args.threads)
    device_type = resolve_device_type(args.device_type)
    if args.depth or args.seq_len or args.device_batch_size:
        default = CPU_CONFIGS[0] if device_type != "cuda" else GPU_CONFIGS[0]
        configs = [(args.depth or default[0], args.seq_len or default[1], args.device_batch_size or default[2])]
    else:
        configs = GPU_CONFIGS if device_type == "cuda" else CPU_CONFIGS
    components = [canonical_components(DEFAULT_COMPONENTS if spec == "default" else spec) for spec in args.components]
    if args.alternate:
        if len(components) < 2:
            raise UserError("--alternate compares recipes: give --components at least two (e.g. none default)")
        results = [r for d, t, b in configs for c in compile_modes(args.compile)
                   for r in bench_train_alternating(args, d, t, b, c, components)]
        alternating_table(results)
        emit_json({"bench": "train", "mode": "alternate", "machine": machine_info(), "runs": results})
        return
    jobs = [(d, t, b, c, comp) for d, t, b in configs for c in compile_modes(args.compile) for comp in components]
    if len(jobs) > 1 and (args.compile_cache or args.warmup_only or args.profile):
        raise UserError("--compile-cache, --warmup-only and --profile are for one configuration: give --depth (or "
                        "--seq-len, --device-batch-size), one --compile and one --components")
    if len(jobs) == 1 and args.warmup_only:
        emit_json({"bench": "train", "mode": "warmup", "machine": machine_info(),
                   "runs": [bench_train_one(args, *jobs[0])]})
        return
    if len(jobs) == 1:
        runs = [bench_train_one(args, *jobs[0])]
    else:
        # One fresh process per run: its peak memory is its own, and one run's caches do not help the next.
        ensure_data(bench_vocab_size(args.vocab_size, device_type))
        runs = []
        for d, t, b, c, comp in jobs:
            log(f"bench train: d{d} T={t} B={b} compile={int(c)} components={comp or 'none'} ...")
            cmd = [sys.executable, "-m", "scripts.bench", "train", f"--depth={d}", f"--seq-len={t}",
                   f"--device-batch-size={b}", f"--compile={int(c)}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                   f"--breakdown-steps={args.breakdown_steps}", f"--peak-seconds={args.peak_seconds}",
                   f"--probe-seconds={args.probe_seconds}", f"--fp8={args.fp8}",
                   f"--vocab-size={args.vocab_size}", f"--threads={args.threads}", f"--components={comp or 'none'}"]
            if args.device_type:
                cmd.append(f"--device-type={args.device_type}")
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                raise UserError(f"bench run d{d} T={t} B={b} compile={int(c)} failed (exit {proc.returncode}); "
                                f"rerun it alone: {' '.join(cmd[1:])}")
            runs.extend(json.loads(proc.stdout.strip().splitlines()[-1])["runs"])
    train_table(runs)
    emit_json({"bench": "train", "machine": machine_info(), "runs": runs})


# -----------------------------------------------------------------------------
# torchao's float8 training (what torchtitan uses), where it can run: compared with ours by gpu_check --suite


def torchao_unavailable(device):
    """Why torchao's float8 training cannot run here (a sentence), or None where it can: it needs torchao installed
    and a CUDA GPU of compute capability 8.9+ (its matmul is torch._scaled_mm, a reference kernel on the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"torchao's float8 training needs a CUDA GPU of compute capability 8.9+ (this is {device.type})"
    if torch.cuda.get_device_capability(device) < (8, 9):
        return f"torchao's float8 training needs compute capability 8.9+ (this GPU has {torch.cuda.get_device_capability(device)})"
    try:
        import torchao.float8  # noqa: F401
    except Exception as e:  # not installed, or built for another torch
        return f"torchao is not importable ({type(e).__name__}: {e}); `uv pip install torchao` or carry its wheel"
    return None


def convert_with_torchao(module):
    """The bias-free linears below `module` whose dims fit fp8's multiple-of-16 rule, swapped for torchao's
    Float8Linear with its tensorwise recipe (dynamic per-tensor scales, as ours). Returns how many were converted."""
    import torch.nn as nn
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(mod, fqn):
        return type(mod) is nn.Linear and mod.bias is None and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    count = sum(1 for m in module.modules() if eligible(m, ""))
    convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name("tensorwise"), module_filter_fn=eligible)
    return count
