"""
`bench dataloader`: packing speed, the cropped fraction, and how long a step waits for data.
"""

import os
import statistics
import time

from bench.common import BENCH_TOKENIZER_VOCAB, bench_vocab_size, emit_json, ensure_data, machine_info, print_table
from bench.train import Run
from nanochat.common import compute_init
from nanochat.recipe import DEFAULT_COMPONENTS


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
    vocab_size = bench_vocab_size(args.vocab_size, device.type)
    run = Run(depth, seq_len, batch, vocab_size, device, use_compile=False, components=DEFAULT_COMPONENTS)
    for _ in range(args.warmup):
        run.train_step()
    parts = [run.instrumented_step(from_loader=True) for _ in range(args.steps)]
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
