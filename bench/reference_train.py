"""
The reference project's (karpathy/nanochat) training step, timed the way `bench train` times ours: its GPT built as
its base_train builds it, torch.compile'd, its MuonAdamW, `loss = model(x, y)`, backward, step, on random tokens.

This file imports the *reference's* `nanochat` package, not ours (both are named nanochat), so it is run as a file
with a checkout of the reference first on PYTHONPATH, never imported:

    PYTHONPATH=.reference python bench/reference_train.py --depth 12 --seq-len 2048 --device-batch-size 16

(gpu_check --suite does this; the checkout comes from `git clone https://github.com/karpathy/nanochat .reference`
at the commit gpu_suite.REFERENCE_COMMIT pins, and is never committed.) Without its Flash Attention 3 kernels, which
it downloads from the Hugging Face hub, the reference runs PyTorch SDPA; SDPA has no sliding windows, so the window
pattern defaults to "L" (full context everywhere), as the reference's own warning advises. One JSON line on stdout.

Timed as ours: a few device batches made before the timed steps and cycled; --compile-cache FILE, --warmup-only and
--profile STEM as `bench train` has them, through our bench/compile_cache.py and bench/profiling.py loaded by file.
"""

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time

import torch


def import_reference():
    """Import the reference's nanochat package (its checkout first on PYTHONPATH), never ours; exit if ours came."""
    # Python put this file's folder (our bench/) first on sys.path, where the reference's `import kernels`
    # (its Flash Attention 3 loader) would find our bench's kernels.py: the reference sees only its own checkout
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: its FA3 download fails at once, SDPA instead
    import nanochat.gpt as reference_gpt  # the reference's, by PYTHONPATH

    if os.path.dirname(os.path.dirname(os.path.abspath(reference_gpt.__file__))) == os.path.dirname(here):
        sys.exit("error: this imported our own nanochat, not the reference's: put its checkout first on PYTHONPATH")


def our_bench_module(name):
    """Our bench/<name>.py, loaded by its file: neither our bench package nor our nanochat may be imported here (the
    modules it loads this way use only torch and the standard library)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"our_bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_reference(depth, seq_len, vocab_size, window_pattern, device):
    """The reference's GPT (initialised on `device`) and its MuonAdamW, built as its base_train builds them. Call
    import_reference() first. bench/memory.py builds the same pair to measure its step's memory."""
    from nanochat.gpt import GPT, GPTConfig

    torch.manual_seed(42)
    head_dim = 128 if depth * 64 >= 128 else depth * 64
    model_dim = -(-depth * 64 // head_dim) * head_dim
    config = GPTConfig(sequence_len=seq_len, vocab_size=vocab_size, n_layer=depth, n_head=model_dim // head_dim,
                       n_kv_head=model_dim // head_dim, n_embd=model_dim, window_pattern=window_pattern)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
    return model, model.setup_optimizer()


def main():
    p = argparse.ArgumentParser(description="time the reference project's base_train step")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--device-batch-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--window-pattern", default="L")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--compile-cache", default="", metavar="FILE",
                   help="a portable compile cache: loaded before the first compile if FILE exists, saved after the warm-up")
    p.add_argument("--warmup-only", action="store_true", help="stop after the warm-up steps (and the cache's save)")
    p.add_argument("--profile", default="", metavar="STEM",
                   help="after the timed steps: a profile of two steps and a step's peak memory, reduced, to STEM.txt/.json")
    args = p.parse_args()

    import_reference()
    compile_cache, profiling = our_bench_module("compile_cache"), our_bench_module("profiling")
    cache = compile_cache.load(args.compile_cache)  # before anything compiles
    from nanochat.common import COMPUTE_DTYPE
    from nanochat.flash_attention import USE_FA3

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # as the reference's compute_init
    model, optimizer = build_reference(args.depth, args.seq_len, args.vocab_size, args.window_pattern, device)
    flops_per_token = model.estimate_flops()
    params = sum(p.numel() for p in model.parameters())
    train_model = torch.compile(model, dynamic=False) if args.compile else model

    generator = torch.Generator(device=device).manual_seed(0)
    shape = (args.device_batch_size, args.seq_len)
    inputs = [torch.randint(0, args.vocab_size, shape, device=device, generator=generator) for _ in range(4)]
    batches = [(x, torch.roll(x, -1, dims=1)) for x in inputs]  # made before any step, as bench train makes ours

    def step(i):
        x, y = batches[i % len(batches)]
        loss = train_model(x, y)
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        value = loss.item()  # a sync, as the reference's step ends with one
        if device.type == "cuda":
            torch.cuda.synchronize()
        return value

    sync = profiling.synchronizer(device)
    phased_indices = itertools.count(args.warmup + args.steps)  # the batches after the timed steps'

    def phased_step():
        """One step taken apart into the phases a profile labels, each ended by a sync, as `bench train` takes ours
        apart: seconds spent in each."""
        i = next(phased_indices)
        times, t0 = {}, time.perf_counter()
        with profiling.phase("data", sync):
            x, y = batches[i % len(batches)]
        times["data"], t0 = time.perf_counter() - t0, time.perf_counter()
        with profiling.phase("forward", sync):
            loss = train_model(x, y)
        times["forward"], t0 = time.perf_counter() - t0, time.perf_counter()
        with profiling.phase("backward", sync):
            loss.backward()
        times["backward"], t0 = time.perf_counter() - t0, time.perf_counter()
        with profiling.phase("optimizer", sync):
            optimizer.step()
            model.zero_grad(set_to_none=True)
        times["optimizer"] = time.perf_counter() - t0
        return times

    t0 = time.perf_counter()
    first_loss = step(0)
    first_step_s = time.perf_counter() - t0
    after_first = compile_cache.compile_counts()
    for i in range(1, args.warmup):
        step(i)
    warmup_s = time.perf_counter() - t0
    cache["compile_cache_saved_bytes"] = compile_cache.save(args.compile_cache)
    warmed = {"project": "reference", "depth": args.depth, "seq_len": args.seq_len,
              "device_batch_size": args.device_batch_size, **cache, "first_step_s": first_step_s,
              "warmup_s": warmup_s, "warmup_steps": args.warmup}
    if args.warmup_only:
        peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
        print(json.dumps({**warmed, "compile_counts": compile_cache.after_first_step(after_first),
                          "peak_mem_gib": peak_mem_gib}))
        return
    times, loss = [], first_loss
    for i in range(args.steps):
        t = time.perf_counter()
        loss = step(args.warmup + i)
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    breakdown = [phased_step() for _ in range(2)]
    # the timed steps' own peak, before a profile's steps run
    peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    counts = compile_cache.after_first_step(after_first)
    if args.profile:
        profiling.record(args.profile, os.path.basename(args.profile), phased_step, device, counts)
    tokens = args.device_batch_size * args.seq_len
    print(json.dumps({
        **warmed, "compile_counts": counts, "profile": args.profile or None,
        "window_pattern": args.window_pattern, "attention": "fa3" if USE_FA3 else "sdpa", "dtype": str(COMPUTE_DTYPE),
        "params": params, "flops_per_token": flops_per_token, "ms_per_step": step_s * 1000, "tok_per_s": tokens / step_s,
        "first_loss": first_loss, "final_loss": loss,
        "breakdown_ms": {k: statistics.median(b[k] for b in breakdown) * 1000 for k in breakdown[0]},
        "peak_mem_gib": peak_mem_gib,
    }))


if __name__ == "__main__":
    main()
