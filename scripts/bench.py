"""
Benchmarks for the numbers in BENCHMARKS.md: the training step, the dataloader, the tokenizer.

    python -m scripts.bench train          # CPU: d4/T=256/B=8 and d6/T=512/B=8, eager and compiled
    python -m scripts.bench train --depth=20 --seq-len=2048 --device-batch-size=32 --compile=1   # a GPU
    python -m scripts.bench dataloader     # packing speed, cropped fraction, time a step waits for data
    python -m scripts.bench tokenizer      # tok_train chars/s, encode MB/s on 1 and all threads
    python -m scripts.bench engine         # inference: prefill, decode at batch 1 and 16, naive recompute loop
    python -m scripts.bench quality --source=brown --lr-mults 0.25 0.5 1 2   # val bpb of short runs, real text

Each subcommand prints a table and then, as the last line of stdout, one line of JSON
({"bench": ..., ...}) for scripts to read. Nothing here asserts a speed.

`train` times the real base_train step: DataLoader -> training.train_step with the Muon + AdamW
optimizers from training.build_optimizers (grad_accum = 1). MFU is model FLOPs (estimate_flops)
per second over a peak: on a GPU in bf16 the data-sheet number (common.get_peak_flops), elsewhere
an fp32 matmul measured in this same process before and after the run (the higher kept). Where
the peak is measured, a short probe of it also follows every timed step, and "MFU interleaved"
divides by the median probe: on a shared VM both speeds swing by 20-30 % from minute to minute,
and this ratio swings far less. Every (config, compile) run goes in a fresh process of its own,
so its peak RSS is its own.

Data: the current base dir ($NANOCHAT_BASE_DIR or ~/.cache/nanochat) is used when it holds a
tokenizer no bigger than --vocab-size and training shards; otherwise a built-in corpus and a
4096-token tokenizer are built once in <tmp>/nanochat_bench and reused.
"""

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext

import torch

from nanochat.common import (UserError, autocast_for, compute_init, cpu_flags, datasheet_peak_flops, get_base_dir,
                             get_compute_dtype, keep_freed_memory_in_process, measure_matmul_flops,
                             orthogonalization_dtype, resolve_device_type, run_main)
from nanochat.corpus import ensure_builtin_workspace, holds_training_data

BENCH_TOKENIZER_VOCAB = 4096  # the CPU preset's vocabulary
CPU_CONFIGS = [(4, 256, 8), (6, 512, 8)]  # (depth, seq_len, device_batch_size)
GPU_CONFIGS = [(12, 2048, 32), (20, 2048, 32)]


# -----------------------------------------------------------------------------
# Output


def print_table(title, headers, rows):
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def emit_json(result):
    print(json.dumps(result), flush=True)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class OtherLoad:
    """
    How many cores' worth of CPU time *other* processes used while this one ran a timed section:
    (all busy CPU time in /proc/stat - this process's CPU time) / wall time. Near 0 means the
    numbers were taken on a quiet machine; anything above ~0.05 makes them suspect.
    """

    def __enter__(self):
        self.busy0, self.own0, self.wall0 = self._busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.wall0
        other = (self._busy_seconds() - self.busy0) - (time.process_time() - self.own0)
        self.cores = max(0.0, other / wall) if self.busy0 is not None else float("nan")

    @staticmethod
    def _busy_seconds():
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:9]]
        except OSError:
            return None
        idle = values[3] + values[4]  # idle + iowait
        return (sum(values) - idle) / os.sysconf("SC_CLK_TCK")


def machine_info():
    info = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["cpu_flags"] = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    info["muon_dtype"] = str(orthogonalization_dtype("cuda" if torch.cuda.is_available() else "cpu")).replace("torch.", "")
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# -----------------------------------------------------------------------------
# Data and tokenizer


def ensure_data(max_vocab):
    """Point NANOCHAT_BASE_DIR at a base dir with data and a tokenizer (building one in <tmp> if needed)."""
    current = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    if holds_training_data(current, max_vocab):
        os.environ["NANOCHAT_BASE_DIR"] = current
        return current
    bench_dir = os.path.join(tempfile.gettempdir(), "nanochat_bench")
    ensure_builtin_workspace(bench_dir, BENCH_TOKENIZER_VOCAB, log=log)
    os.environ["NANOCHAT_BASE_DIR"] = bench_dir
    os.environ["NANOCHAT_DATA_SOURCE"] = "builtin"
    return bench_dir


# -----------------------------------------------------------------------------
# Peak FLOP/s


def peak_flops_for(device, dtype, seconds, rounds=3):
    """(peak FLOP/s, how it was obtained): the device table for bf16 GPUs, else base_train's matmul probe, run longer."""
    peak = datasheet_peak_flops(device, dtype)
    if peak:
        return peak, "data sheet bf16"
    return measure_matmul_flops(device, dtype, seconds=seconds, rounds=rounds), f"measured {str(dtype).replace('torch.', '')} matmul"


# -----------------------------------------------------------------------------
# Training step


class Run:
    """Everything one base_train step needs, built exactly as base_train builds it."""

    def __init__(self, depth, seq_len, batch, vocab_size, device, use_compile):
        from nanochat.dataloader import DataLoader
        from nanochat.gpt import build_model
        from nanochat.tokenizer import get_tokenizer
        from nanochat.training import build_optimizers, depth_recipe

        tokenizer = get_tokenizer()
        if tokenizer.get_vocab_size() > vocab_size:
            raise UserError(f"--vocab-size={vocab_size} is smaller than the tokenizer's {tokenizer.get_vocab_size()} tokens")
        keep_freed_memory_in_process()  # as base_train does
        torch.manual_seed(42)
        self.device = device
        self.tokens_per_step = batch * seq_len
        # base_train's recipe for this batch (grad_accum = 1, so the total batch is B * T)
        recipe = depth_recipe(depth, vocab_size, seq_len, self.tokens_per_step, num_iterations=1)
        self.config = recipe.model_config
        self.model = build_model(self.config, device)
        self.flops_per_token = recipe.flops_per_token
        self.dtype = get_compute_dtype(device)
        self.autocast = autocast_for(device)
        self.train_model = torch.compile(self.model, dynamic=False) if use_compile else self.model
        self.optimizers = build_optimizers(self.model, **recipe.lrs())
        self.loader = DataLoader(tokenizer, batch, seq_len, split="train", device=device)
        self.step = 0

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def train_step(self):
        """One real optimizer step (what base_train runs), timed to completion."""
        from nanochat.training import muon_momentum, train_step

        t0 = time.perf_counter()
        loss = train_step(self.train_model, self.optimizers, [next(self.loader)], lambda m, xy: m(*xy), 1.0,
                          muon_momentum(self.step), self.autocast)
        self.sync()
        self.step += 1
        return time.perf_counter() - t0, loss

    def instrumented_step(self):
        """The same step taken apart, with a sync between phases: seconds spent in each."""
        from nanochat.training import apply_schedules, muon_momentum

        times = {}
        t0 = time.perf_counter()
        x, y = next(self.loader)
        self.sync()
        t1 = time.perf_counter()
        with self.autocast:
            loss = self.train_model(x, y)
        loss.item()
        t2 = time.perf_counter()
        loss.backward()
        self.sync()
        t3 = time.perf_counter()
        apply_schedules(self.optimizers, 1.0, momentum=muon_momentum(self.step))
        for opt in self.optimizers:
            opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.sync()
        t4 = time.perf_counter()
        self.step += 1
        times.update(data=t1 - t0, forward=t2 - t1, backward=t3 - t2, optimizer=t4 - t3)
        return times

    def close(self):
        self.loader.close()


def bench_train_one(args, depth, seq_len, batch, use_compile):
    """Time one (config, compile) run in this process; returns its result dict."""
    _, _, _, _, device = compute_init(args.device_type)  # as base_train: picks the device, tf32 on CUDA
    vocab_size = args.vocab_size or (32768 if device.type == "cuda" else BENCH_TOKENIZER_VOCAB)
    ensure_data(vocab_size)
    run = Run(depth, seq_len, batch, vocab_size, device, use_compile)
    # The peak is measured before and after the timed steps and the higher value kept: on a shared VM the
    # speed of the same matmul drifts by 10-20 % over seconds, and the higher value gives the lower, honest MFU.
    with OtherLoad() as peak_other:
        peak_before, peak_source = peak_flops_for(device, run.dtype, args.peak_seconds)

    t0 = time.perf_counter()
    first_step, _ = run.train_step()  # includes compilation when compiling
    for _ in range(args.warmup - 1):
        run.train_step()
    warmup_s = time.perf_counter() - t0
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
    run.close()
    peak_after, _ = peak_flops_for(device, run.dtype, args.peak_seconds)
    peak = max(peak_before, peak_after)

    step_s = statistics.median(step_times)
    tok_per_s = run.tokens_per_step / step_s
    model_flops = run.flops_per_token * tok_per_s
    peak_interleaved = statistics.median(probes) if probes else None
    breakdown = {k: statistics.median(p[k] for p in parts) * 1000 for k in parts[0]} if parts else {}
    if device.type == "cuda":
        peak_mem_mib = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak_mem_mib = peak_rss_mib()
    return {
        "depth": depth, "seq_len": seq_len, "device_batch_size": batch, "vocab_size": vocab_size,
        "compile": bool(use_compile), "device": device.type, "dtype": str(run.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(), "params": run.model.num_params(), "flops_per_token": run.flops_per_token,
        "steps": args.steps, "ms_per_step": step_s * 1000, "ms_per_step_min": min(step_times) * 1000,
        "ms_per_step_max": max(step_times) * 1000, "first_step_s": first_step, "warmup_s": warmup_s,
        "tok_per_s": tok_per_s, "model_flops_per_s": model_flops, "peak_flops": peak, "peak_flops_before": peak_before,
        "peak_flops_after": peak_after, "peak_source": peak_source,
        "mfu": model_flops / peak, "peak_flops_interleaved": peak_interleaved,
        "mfu_interleaved": model_flops / peak_interleaved if probes else None, "peak_mem_mib": peak_mem_mib,
        "peak_mem_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS",
        "breakdown_ms": breakdown, "final_loss": losses[-1] if losses else None, "other_load_cores": other.cores,
        "peak_other_load_cores": peak_other.cores,
    }


def train_table(runs):
    rows = []
    for r in runs:
        b = r["breakdown_ms"]
        total = sum(b.values()) or 1.0
        rows.append([
            f"d{r['depth']}", r["seq_len"], r["device_batch_size"], "yes" if r["compile"] else "no",
            f"{r['ms_per_step']:.1f}", f"{r['tok_per_s']:,.0f}", f"{r['model_flops_per_s'] / 1e9:.1f}",
            f"{r['peak_flops'] / 1e9:.1f}", f"{100 * r['mfu']:.1f}%",
            f"{100 * r['mfu_interleaved']:.1f}%" if r.get("mfu_interleaved") else "-", f"{r['peak_mem_mib']:.0f}",
            f"{r['first_step_s']:.1f}", f"{r['other_load_cores']:.2f}",
            " / ".join(f"{b.get(k, 0):.0f}" for k in ("data", "forward", "backward", "optimizer"))
            + f" ({100 * b.get('data', 0) / total:.1f}% data)",
        ])
    print_table("train: median of the timed steps (real base_train step, grad_accum=1)",
                ["model", "T", "B", "compile", "ms/step", "tok/s", "GFLOP/s", "peak GFLOP/s", "MFU", "MFU interleaved", "peak MiB",
                 "1st step s", "other load", "data/fwd/bwd/opt ms"], rows)


def compile_modes(value):
    return {"0": [False], "1": [True], "both": [False, True]}[value]


def cmd_train(args):
    if args.probe_seconds < 0 or args.peak_seconds <= 0:
        raise UserError(f"--peak-seconds must be > 0 and --probe-seconds >= 0 (got {args.peak_seconds}, {args.probe_seconds})")
    if args.threads:
        torch.set_num_threads(args.threads)
    device_type = resolve_device_type(args.device_type)
    if args.depth or args.seq_len or args.device_batch_size:
        default = CPU_CONFIGS[0] if device_type != "cuda" else GPU_CONFIGS[0]
        configs = [(args.depth or default[0], args.seq_len or default[1], args.device_batch_size or default[2])]
    else:
        configs = GPU_CONFIGS if device_type == "cuda" else CPU_CONFIGS
    jobs = [(d, t, b, c) for d, t, b in configs for c in compile_modes(args.compile)]

    if len(jobs) == 1:
        runs = [bench_train_one(args, *jobs[0])]
    else:
        # One fresh process per run: its peak memory is its own, and one run's caches do not help the next.
        ensure_data(args.vocab_size or (32768 if device_type == "cuda" else BENCH_TOKENIZER_VOCAB))
        runs = []
        for d, t, b, c in jobs:
            log(f"bench train: d{d} T={t} B={b} compile={int(c)} ...")
            cmd = [sys.executable, "-m", "scripts.bench", "train", f"--depth={d}", f"--seq-len={t}",
                   f"--device-batch-size={b}", f"--compile={int(c)}", f"--steps={args.steps}", f"--warmup={args.warmup}",
                   f"--breakdown-steps={args.breakdown_steps}", f"--peak-seconds={args.peak_seconds}",
                   f"--probe-seconds={args.probe_seconds}",
                   f"--vocab-size={args.vocab_size}", f"--threads={args.threads}"]
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
# Dataloader


def cmd_dataloader(args):
    from nanochat.dataloader import DataLoader
    from nanochat.tokenizer import get_tokenizer

    ensure_data(args.vocab_size or BENCH_TOKENIZER_VOCAB)
    tokenizer = get_tokenizer()

    # 1) Packing throughput with everything (reading, tokenizing, packing) held to one core (where the OS lets us pin).
    pin = hasattr(os, "sched_setaffinity")
    if pin:
        affinity = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(affinity)})
    try:
        T, B = 1024, 8
        loader = DataLoader(tokenizer, B, T, split="train", tokenizer_threads=1)
        t0, tokens = time.perf_counter(), 0
        while tokens < args.tokens:
            next(loader)
            tokens += B * T
        one_core_tok_s = tokens / (time.perf_counter() - t0)
        loader.close()
    finally:
        if pin:
            os.sched_setaffinity(0, affinity)

    # 2) Cropped fraction at several row lengths, over the same number of tokens each.
    crops = {}
    for T in (256, 1024, 2048):
        B = max(1, 16384 // T)
        loader = DataLoader(tokenizer, B, T, split="train")
        tokens, epoch_ended = 0, False
        while tokens < args.tokens:
            next(loader)
            tokens += B * T
            if loader.epoch > 0:
                epoch_ended = True
                break
        crops[T] = {"crop_fraction": loader.crop_fraction(), "tokens": tokens, "full_epoch": epoch_ended}
        loader.close()

    # 3) How long a real training step waits for its batch.
    _, _, _, _, device = compute_init(args.device_type)
    depth, seq_len, batch = args.depth, args.seq_len, args.device_batch_size
    vocab_size = args.vocab_size or (32768 if device.type == "cuda" else BENCH_TOKENIZER_VOCAB)
    run = Run(depth, seq_len, batch, vocab_size, device, use_compile=False)
    for _ in range(args.warmup):
        run.train_step()
    parts = [run.instrumented_step() for _ in range(args.steps)]
    run.close()
    wait_ms = statistics.mean(p["data"] for p in parts) * 1000
    step_ms = statistics.mean(sum(p.values()) for p in parts) * 1000

    print_table("dataloader: packing throughput (read + tokenize + pack, one core)",
                ["T", "B", "tokens", "packed tok/s"], [[1024, 8, f"{tokens:,}", f"{one_core_tok_s:,.0f}"]])
    print_table("dataloader: tokens cropped by BOS-aligned best-fit packing",
                ["T", "tokens", "cropped"], [[T, f"{c['tokens']:,}", f"{100 * c['crop_fraction']:.2f}%"] for T, c in crops.items()])
    print_table("dataloader: data wait inside a training step",
                ["model", "T", "B", "steps", "wait ms", "step ms", "wait share"],
                [[f"d{depth}", seq_len, batch, args.steps, f"{wait_ms:.2f}", f"{step_ms:.1f}", f"{100 * wait_ms / step_ms:.2f}%"]])
    emit_json({"bench": "dataloader", "machine": machine_info(), "one_core_tok_per_s": one_core_tok_s,
               "crop": {str(T): c for T, c in crops.items()},
               "wait": {"depth": depth, "seq_len": seq_len, "device_batch_size": batch, "steps": args.steps,
                        "wait_ms": wait_ms, "step_ms": step_ms, "wait_share": wait_ms / step_ms}})


# -----------------------------------------------------------------------------
# Tokenizer


def cmd_tokenizer(args):
    from nanochat.dataset import parquets_iter_batched
    from nanochat.tokenizer import RustBPETokenizer

    ensure_data(max(args.vocab_size, BENCH_TOKENIZER_VOCAB))
    texts, chars = [], 0
    for batch in parquets_iter_batched("train"):
        for text in batch:
            texts.append(text)
            chars += len(text)
            if chars >= args.max_chars:
                break
        if chars >= args.max_chars:
            break
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)

    t0 = time.perf_counter()
    tokenizer = RustBPETokenizer.train_from_iterator(iter(texts), args.vocab_size)
    train_s = time.perf_counter() - t0

    encode = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ids = tokenizer.encode(texts, num_threads=threads)
            best = min(best, time.perf_counter() - t0)
        encode[threads] = {"mb_per_s": num_bytes / best / 1e6, "tokens": sum(len(r) for r in ids)}

    print_table("tokenizer: training (rustbpe) on the corpus text",
                ["chars", "vocab", "seconds", "chars/s"],
                [[f"{chars:,}", tokenizer.get_vocab_size(), f"{train_s:.2f}", f"{chars / train_s:,.0f}"]])
    print_table("tokenizer: encode (tiktoken, batch of documents, best of repeats)",
                ["threads", "MB", "tokens", "MB/s"],
                [[t, f"{num_bytes / 1e6:.2f}", f"{e['tokens']:,}", f"{e['mb_per_s']:.2f}"] for t, e in encode.items()])
    emit_json({"bench": "tokenizer", "machine": machine_info(), "train_chars": chars, "vocab_size": tokenizer.get_vocab_size(),
               "train_s": train_s, "train_chars_per_s": chars / train_s, "encode_bytes": num_bytes,
               "encode_mb_per_s": {str(t): e["mb_per_s"] for t, e in encode.items()}})


# -----------------------------------------------------------------------------
# Engine (inference)


def engine_model(args, device):
    """(model, tokenizer, description): a checkpoint with --source, else a random-init model from the depth dial."""
    if args.source:
        from nanochat.checkpoint_manager import load_model

        model, tokenizer, meta = load_model(args.source, device, model_tag=args.model_tag or None, step=args.step)
        return model, tokenizer, f"{args.source}/{meta['model_tag']}"
    from nanochat.gpt import build_model
    from nanochat.tokenizer import get_tokenizer
    from nanochat.training import depth_recipe

    ensure_data(BENCH_TOKENIZER_VOCAB)
    tokenizer = get_tokenizer()
    if tokenizer.get_vocab_size() > BENCH_TOKENIZER_VOCAB:
        raise UserError(f"the tokenizer in $NANOCHAT_BASE_DIR has more than {BENCH_TOKENIZER_VOCAB} tokens")
    recipe = depth_recipe(args.depth, BENCH_TOKENIZER_VOCAB, args.seq_len, 2048, num_iterations=1)
    torch.manual_seed(42)
    return build_model(recipe.model_config, device), tokenizer, f"d{args.depth} random init"


def time_engine_run(engine, prompt, num_samples, max_tokens, temperature, sync):
    """Seconds from the call to each yielded step of engine.generate, and the tokens of row 0."""
    stamps, row0 = [], []
    t0 = time.perf_counter()
    for column, _ in engine.generate(prompt, num_samples=num_samples, max_tokens=max_tokens, temperature=temperature):
        sync()
        stamps.append(time.perf_counter() - t0)
        row0.append(column[0])
    return stamps, row0


def decode_step_ms(model, cached_len, batch, steps, device, sync):
    """ms per one-token forward with `cached_len` positions already in the cache (filled with noise, not a prompt)."""
    from nanochat.engine import KVCache

    c = model.config
    with torch.inference_mode(), autocast_for(device):
        cache = KVCache(batch, c.n_kv_head, cached_len + steps + 2, c.n_embd // c.n_head, c.n_layer, device,
                        get_compute_dtype(device))
        cache.k_cache.normal_()
        cache.v_cache.normal_()
        cache.advance(cached_len)
        ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        model.forward(ids, kv_cache=cache)
        model.forward(ids, kv_cache=cache)
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            model.forward(ids, kv_cache=cache)
        sync()
    return (time.perf_counter() - t0) / steps * 1000


def cmd_engine(args):
    from nanochat.engine import Engine, KVCache

    if args.threads:
        torch.set_num_threads(args.threads)
    _, _, _, _, device = compute_init(args.device_type)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, tokenizer, description = engine_model(args, device)
    c = model.config
    if args.prompt_tokens + args.new_tokens > c.sequence_len:
        raise UserError(f"--prompt-tokens + --new-tokens = {args.prompt_tokens + args.new_tokens} exceeds the model's "
                        f"context of {c.sequence_len}")
    engine = Engine(model, tokenizer)
    # A random prompt of ordinary (non-special) tokens; the nine specials are the last ids of the vocabulary.
    rng = torch.Generator().manual_seed(0)
    ordinary = tokenizer.get_vocab_size() - 9
    prompt = [tokenizer.get_bos_token_id()] + torch.randint(0, ordinary, (args.prompt_tokens - 1,), generator=rng).tolist()
    time_engine_run(engine, prompt, 2, 8, 1.0, sync)  # warm up allocator and kernels

    with OtherLoad() as other:
        prefill_s = []
        for _ in range(args.repeats):
            with torch.inference_mode(), autocast_for(device):
                cache = KVCache(1, c.n_kv_head, len(prompt), c.n_embd // c.n_head, c.n_layer, device, get_compute_dtype(device))
                ids = torch.tensor([prompt], device=device)
                sync()
                t0 = time.perf_counter()
                model.forward(ids, kv_cache=cache)
                sync()
                prefill_s.append(time.perf_counter() - t0)

        decode = {}
        for batch in (1, args.batch):
            runs = [time_engine_run(engine, prompt, batch, args.new_tokens, args.temperature, sync)[0]
                    for _ in range(args.repeats)]
            per_run = []
            for stamps in runs:
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                per_run.append({"steps": len(stamps), "first_token_ms": stamps[0] * 1000,
                                "tok_per_s": batch * len(gaps) / sum(gaps), "step_ms_first32": 1000 * statistics.mean(gaps[:32]),
                                "step_ms_last32": 1000 * statistics.mean(gaps[-32:])})
            decode[batch] = {key: statistics.median(r[key] for r in per_run) for key in per_run[0]}

        # Greedy at batch 1, engine against recomputing the whole sequence for every new token.
        engine_greedy_s, engine_tokens = [], None
        for _ in range(args.repeats):
            stamps, engine_tokens = time_engine_run(engine, prompt, 1, args.new_tokens, 0.0, sync)
            engine_greedy_s.append(stamps[-1])
        naive_tokens = []
        ids = torch.tensor([prompt], device=device)
        t0 = time.perf_counter()
        with torch.inference_mode(), autocast_for(device):
            for _ in range(args.new_tokens):
                next_id = model.forward(ids)[:, -1].argmax(dim=-1, keepdim=True)
                naive_tokens.append(int(next_id))
                ids = torch.cat([ids, next_id], dim=1)
        naive_s = time.perf_counter() - t0

        by_length = {L: {batch: decode_step_ms(model, L, batch, args.length_steps, device, sync) for batch in (1, args.batch)}
                     for L in args.cached_lengths}

    engine_s = statistics.median(engine_greedy_s)
    # The engine stops at <|assistant_end|> or <|bos|>; the naive loop never does, so compare time per new token.
    speedup = (naive_s / len(naive_tokens)) / (engine_s / len(engine_tokens))
    same_tokens = engine_tokens == naive_tokens[:len(engine_tokens)]
    prefill_tok_s = len(prompt) / statistics.median(prefill_s)
    batch_gain = decode[args.batch]["tok_per_s"] / decode[1]["tok_per_s"]

    print_table(f"engine: {description} {c.n_layer}L/{c.n_embd}d, vocab {c.vocab_size}, context {c.sequence_len}, "
                f"{device.type}, {torch.get_num_threads()} threads, median of {args.repeats}",
                ["measure", "value"], [
                    ["prefill, batch 1", f"{len(prompt)} tokens, {prefill_tok_s:,.0f} tok/s"],
                    ["first-token latency, batch 1", f"{decode[1]['first_token_ms']:.1f} ms"],
                    [f"first-token latency, batch {args.batch}", f"{decode[args.batch]['first_token_ms']:.1f} ms"],
                    ["decode, batch 1", f"{decode[1]['tok_per_s']:,.0f} tok/s ({decode[1]['steps']:.0f} steps, T={args.temperature})"],
                    [f"decode, batch {args.batch}",
                     f"{decode[args.batch]['tok_per_s']:,.0f} tok/s ({decode[args.batch]['steps']:.0f} steps) = {batch_gain:.1f}x batch 1"],
                    ["greedy, engine (prefill + decode)", f"{len(engine_tokens)} tokens in {engine_s:.2f} s"],
                    ["greedy, naive full recompute", f"{len(naive_tokens)} tokens in {naive_s:.2f} s"],
                    ["engine speedup per new token", f"{speedup:.1f}x (same tokens: {'yes' if same_tokens else 'NO'})"],
                    ["other load", f"{other.cores:.2f} cores"],
                ])
    print_table("engine: one decode step (ms) by positions already cached (cache filled with noise)",
                ["cached", "batch 1", f"batch {args.batch}"],
                [[L, f"{v[1]:.2f}", f"{v[args.batch]:.2f}"] for L, v in by_length.items()])
    emit_json({"bench": "engine", "machine": machine_info(), "model": description, "model_config": vars(c),
               "device": device.type, "dtype": str(get_compute_dtype(device)).replace("torch.", ""),
               "threads": torch.get_num_threads(), "repeats": args.repeats, "prompt_tokens": len(prompt),
               "new_tokens": args.new_tokens, "temperature": args.temperature, "prefill_tok_per_s": prefill_tok_s,
               "decode": {str(b): d for b, d in decode.items()}, "batch_gain": batch_gain,
               "greedy_engine_s": engine_s, "greedy_engine_tokens": len(engine_tokens), "naive_s": naive_s,
               "naive_tokens": len(naive_tokens), "speedup_vs_naive": speedup, "same_tokens": same_tokens,
               "step_ms_by_cached_length": {str(L): {str(b): ms for b, ms in v.items()} for L, v in by_length.items()},
               "other_load_cores": other.cores})


# -----------------------------------------------------------------------------
# Quality: val bpb after a short run of the CPU preset's geometry, on the built-in or real text


def quality_data(source, vocab_size):
    """Point NANOCHAT_BASE_DIR at <tmp>/nanochat_bench_quality/<source>, with the source's shards and a tokenizer
    trained on them (built once, then reused)."""
    from nanochat.dataset import get_data_dir, parquets_iter_batched
    from nanochat.tokenizer import RustBPETokenizer

    from nanochat.dataset import get_source

    src = get_source(source)  # a built-in source, or one imported into the current base dir
    os.environ["NANOCHAT_DATA_SOURCE"] = source
    current = os.environ.get("NANOCHAT_BASE_DIR")
    if current and holds_training_data(current, vocab_size):  # a base dir that already holds this source and a tokenizer
        return current
    from nanochat.brown import LAYOUT  # one directory per Brown layout: a changed layout never reuses old shards
    name = f"brown-{LAYOUT}" if source == "brown" else source
    imported_dir = None
    if source not in ("builtin", "brown"):  # your own data: its shards, linked, with a tokenizer of the bench's size
        imported_dir = os.path.join(get_base_dir(), "base_data", src.name)
        with open(os.path.join(imported_dir, "import.json"), encoding="utf-8") as f:
            created = json.load(f)["created"]
        name = f"{source}-{hashlib.sha256(f'{imported_dir} {created}'.encode()).hexdigest()[:10]}"
    base = os.path.join(tempfile.gettempdir(), "nanochat_bench_quality", name)
    os.environ["NANOCHAT_BASE_DIR"] = base
    if holds_training_data(base, vocab_size):
        return base
    log(f"building the {source} source and a {vocab_size}-token tokenizer in {base}")
    if source == "builtin":
        from nanochat.corpus import write_corpus

        write_corpus(get_data_dir("builtin"), seed=42, size_mb=6.0, verbose=False)
    elif source == "brown":
        from nanochat.brown import write_brown

        write_brown()
    else:
        os.makedirs(os.path.join(base, "base_data"), exist_ok=True)
        link = os.path.join(base, "base_data", source)
        if not os.path.islink(link):
            os.symlink(imported_dir, link)
    texts = (t for batch in parquets_iter_batched("train", source=source) for t in batch)
    RustBPETokenizer.train_from_iterator(texts, vocab_size).save(os.path.join(base, "tokenizer"))
    return base


def quality_run(args, seed, lr_mult):
    """Train from scratch with base_train's recipe (all three lrs times lr_mult); val bpb at each --eval-at step."""
    from nanochat.dataloader import DataLoader, eval_batches
    from nanochat.gpt import build_model
    from nanochat.loss_eval import evaluate_bpb
    from nanochat.tokenizer import get_token_bytes, get_tokenizer
    from nanochat.training import (build_optimizers, depth_recipe, grad_accum_steps, lr_multiplier, muon_momentum,
                                   train_step)

    tokenizer = get_tokenizer()
    recipe = depth_recipe(args.depth, tokenizer.get_vocab_size(), args.seq_len, args.total_batch_size,
                          num_iterations=args.steps, lr_batch_exponent=args.lr_batch_exponent,
                          weight_decay=None if args.weight_decay < 0 else args.weight_decay,
                          short_run_lrs=bool(args.short_run_lrs))
    lrs = recipe.lrs()
    for group in args.lr_groups:
        lrs[f"{group}_lr"] *= lr_mult
    device = torch.device("cpu")
    torch.manual_seed(seed)
    model = build_model(recipe.model_config, device)
    optimizers = build_optimizers(model, **lrs, adam_betas=tuple(args.adam_betas))
    accum = grad_accum_steps(args.total_batch_size, args.device_batch_size, args.seq_len, 1)
    loader = DataLoader(tokenizer, args.device_batch_size, args.seq_len, split="train", device=device)
    token_bytes = get_token_bytes()
    eval_steps = max(1, args.eval_tokens // (args.device_batch_size * args.seq_len))
    bpb, t0 = {}, time.perf_counter()
    for step in range(args.steps + 1):
        if step in args.eval_at:
            val_loader, batches = eval_batches(tokenizer, args.device_batch_size, args.seq_len, "val", device, 0, 1)
            model.eval()
            bpb[step] = evaluate_bpb(model, batches, eval_steps, token_bytes)
            model.train()
            val_loader.close()
        if step == args.steps:
            break
        lrm = lr_multiplier(step, args.steps, args.warmup_ratio, args.warmdown_ratio)
        train_step(model, optimizers, [next(loader) for _ in range(accum)], lambda m, xy: m(*xy), lrm,
                   muon_momentum(step), nullcontext())
    loader.close()
    return {"seed": seed, "lr_mult": lr_mult, "lrs": lrs, "val_bpb": bpb, "seconds": time.perf_counter() - t0}


def cmd_quality(args):
    from nanochat.training import dial_lr_scale

    if not all(0 <= beta < 1 for beta in args.adam_betas):
        raise UserError(f"--adam-betas must both be in [0, 1) (got {args.adam_betas[0]:g} {args.adam_betas[1]:g})")
    if min(args.total_batch_size, args.device_batch_size, args.seq_len, args.steps, args.depth) < 1:
        raise UserError("--total-batch-size, --device-batch-size, --seq-len, --steps and --depth must be >= 1")
    # what x1 means in base lrs: the dial's scale for a run this long, as base_train would train it
    base_lr_scale = dial_lr_scale(args.total_batch_size, args.lr_batch_exponent, args.steps if args.short_run_lrs else None)
    args.eval_at = sorted(set(args.eval_at) | {args.steps})
    quality_data(args.source, args.vocab_size)
    runs = []
    for lr_mult in args.lr_mults:
        for seed in args.seeds:
            log(f"bench quality: {args.source} d{args.depth} T={args.seq_len} batch {args.total_batch_size} "
                f"lr x{lr_mult:g} seed {seed} ...")
            runs.append(quality_run(args, seed, lr_mult))
    rows = [[f"{r['lr_mult']:g}", r["seed"]] + [f"{r['val_bpb'][s]:.4f}" for s in args.eval_at] + [f"{r['seconds']:.0f}"]
            for r in runs]
    print_table(f"quality: val bpb on {args.source}, d{args.depth} T={args.seq_len} {args.total_batch_size} tokens/step, "
                f"{args.steps} steps, lr x scales {'+'.join(args.lr_groups)} (x1 = base lrs x{base_lr_scale:.4g}), "
                f"wd {'dial' if args.weight_decay < 0 else args.weight_decay}, warmup {args.warmup_ratio} "
                f"warmdown {args.warmdown_ratio}, adam betas {args.adam_betas[0]:g}/{args.adam_betas[1]:g}",
                ["lr x", "seed"] + [f"step {s}" for s in args.eval_at] + ["s"], rows)
    final = {}
    for r in runs:
        final.setdefault(r["lr_mult"], []).append(r["val_bpb"][args.steps])
    means = {m: sum(v) / len(v) for m, v in final.items()}
    best = min(means, key=means.get)
    print("\nmean final val bpb per lr multiplier: " + ", ".join(f"x{m:g} {v:.4f}" for m, v in means.items())
          + f" | best x{best:g}" + (f"; the default (x1) is {100 * (means[1.0] / means[best] - 1):+.2f} % from it"
                                      if 1.0 in means else ""))
    emit_json({"bench": "quality", "machine": machine_info(), "source": args.source, "depth": args.depth,
               "seq_len": args.seq_len, "total_batch_size": args.total_batch_size, "steps": args.steps,
               "weight_decay": args.weight_decay, "warmup_ratio": args.warmup_ratio, "warmdown_ratio": args.warmdown_ratio,
               "adam_betas": args.adam_betas, "lr_batch_exponent": args.lr_batch_exponent, "short_run_lrs": args.short_run_lrs,
               "base_lr_scale": base_lr_scale, "lr_groups": args.lr_groups, "runs": runs, "mean_final": means, "best_lr_mult": best})


# -----------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Benchmarks: training step / MFU, dataloader, tokenizer.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="time the real base_train step")
    t.add_argument("--depth", type=int, default=0, help="model depth (default: the two standard configs)")
    t.add_argument("--seq-len", type=int, default=0)
    t.add_argument("--device-batch-size", type=int, default=0)
    t.add_argument("--compile", default="both", choices=["0", "1", "both"], help="torch.compile the model")
    t.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    t.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    t.add_argument("--breakdown-steps", type=int, default=5, help="extra instrumented steps for the phase breakdown")
    t.add_argument("--peak-seconds", type=float, default=1.0, help="length of each of the 3 peak-matmul timings")
    t.add_argument("--probe-seconds", type=float, default=0.2,
                   help="peak-matmul probe after every timed step, for the interleaved MFU (0: none)")
    t.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")

    d = sub.add_parser("dataloader", help="packing throughput, cropped fraction, data wait")
    d.add_argument("--tokens", type=int, default=1_000_000, help="tokens per throughput / crop measurement")
    d.add_argument("--depth", type=int, default=4, help="model for the data-wait measurement")
    d.add_argument("--seq-len", type=int, default=256)
    d.add_argument("--device-batch-size", type=int, default=8)
    d.add_argument("--steps", type=int, default=20, help="instrumented training steps for the data wait")
    d.add_argument("--warmup", type=int, default=3)

    k = sub.add_parser("tokenizer", help="tok_train and encode speed")
    k.add_argument("--max-chars", type=int, default=10_000_000, help="text to train and encode on")
    k.add_argument("--repeats", type=int, default=3)

    for s in (t, d, k):
        s.add_argument("--vocab-size", type=int, default=0 if s is not k else BENCH_TOKENIZER_VOCAB,
                       help="model / tokenizer vocabulary (default 4096 on CPU, 32768 on CUDA)")
    for s in (t, d):
        s.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")

    e = sub.add_parser("engine", help="inference: prefill, decode at batch 1 and N, against a naive recompute loop")
    e.add_argument("--depth", type=int, default=4, help="depth of the random-init model (without --source)")
    e.add_argument("--seq-len", type=int, default=512, help="context of the random-init model")
    e.add_argument("--source", default="", help="time a checkpoint instead: base|mid|sft|rl")
    e.add_argument("--model-tag", default="", help="checkpoint tag (default: the latest)")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: the last)")
    e.add_argument("--prompt-tokens", type=int, default=128)
    e.add_argument("--new-tokens", type=int, default=256)
    e.add_argument("--batch", type=int, default=16, help="samples decoded together, compared with batch 1")
    e.add_argument("--temperature", type=float, default=1.0, help="for the decode rows (the naive comparison is greedy)")
    e.add_argument("--repeats", type=int, default=3)
    e.add_argument("--cached-lengths", type=int, nargs="+", default=[128, 512, 2048],
                   help="cache fill levels for the decode-step-by-length table")
    e.add_argument("--length-steps", type=int, default=30, help="decode steps timed per cache fill level")
    e.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch's default)")
    e.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    q = sub.add_parser("quality", help="val bpb after a short run of the CPU preset's geometry, on built-in or real text")
    q.add_argument("--source", default="builtin",
                   help="builtin, brown, or a source you imported (python -m nanochat.dataset import NAME ...)")
    q.add_argument("--depth", type=int, default=4)
    q.add_argument("--seq-len", type=int, default=256)
    q.add_argument("--total-batch-size", type=int, default=2048, help="tokens per step")
    q.add_argument("--device-batch-size", type=int, default=8)
    q.add_argument("--steps", type=int, default=200)
    q.add_argument("--eval-at", type=int, nargs="+", default=[50, 100, 150], help="steps to measure val bpb at (and the last)")
    q.add_argument("--eval-tokens", type=int, default=65536)
    q.add_argument("--lr-mults", type=float, nargs="+", default=[1.0], help="multipliers of base_train's lrs")
    q.add_argument("--lr-groups", nargs="+", default=["embedding", "unembedding", "matrix"],
                   choices=["embedding", "unembedding", "matrix"], help="which lrs the multipliers scale (default: all three)")
    q.add_argument("--lr-batch-exponent", type=float, default=0.0)
    q.add_argument("--short-run-lrs", type=int, default=1, choices=[0, 1],
                   help="as base_train's (1: up to 2x the dial's lrs under 700 steps; 0: --lr-mults count in base lrs)")
    q.add_argument("--weight-decay", type=float, default=-1.0, help="Muon weight decay (-1 = the dial's)")
    q.add_argument("--warmup-ratio", type=float, default=0.0)
    q.add_argument("--warmdown-ratio", type=float, default=0.4)
    q.add_argument("--adam-betas", type=float, nargs=2, default=[0.8, 0.95], help="AdamW's beta1 beta2 (embedding, lm_head)")
    q.add_argument("--seeds", type=int, nargs="+", default=[42, 43])
    q.add_argument("--vocab-size", type=int, default=BENCH_TOKENIZER_VOCAB)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    commands = {"train": cmd_train, "dataloader": cmd_dataloader, "tokenizer": cmd_tokenizer, "engine": cmd_engine,
                "quality": cmd_quality}
    commands[args.command](args)


if __name__ == "__main__":
    run_main(main)
