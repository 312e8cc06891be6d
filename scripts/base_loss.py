"""
Evaluate a base checkpoint's bits per byte on the train and val splits, and show a few greedy samples.

  python -m scripts.base_loss [--model-tag d4] [--step N] [--split-tokens 65536]
  torchrun --standalone --nproc_per_node=8 -m scripts.base_loss
"""

import argparse
import time

from nanochat.checkpoint_manager import load_model
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.common import UserError, autocast_for, compute_cleanup, compute_init, print0, run_main
from nanochat.dataloader import eval_batches
from nanochat.loss_eval import describe_eval, evaluate_bpb
from nanochat.report import get_report
from nanochat.tokenizer import get_token_bytes
from nanochat.presets import fill_from_preset, preset_help
from nanochat.recipe import greedy_samples

PROMPTS = ["The capital of", "The river", "12 + 7 =", "The word apple is spelled", "Once upon a time"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train/val bits per byte and samples of a base checkpoint.")
    p.add_argument("--model-tag", default=None)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--device-type", default="")
    p.add_argument("--device-batch-size", type=int, default=None, help=preset_help("base_loss", "device_batch_size"))
    p.add_argument("--split-tokens", type=int, default=None, help="tokens evaluated per split, at most one pass "
                   f"(as base_train's --eval-tokens) {preset_help('base_loss', 'split_tokens')}")
    p.add_argument("--data-source", default=None)
    args = fill_from_preset(p.parse_args(argv), "base_loss")
    if args.device_batch_size < 1 or args.split_tokens < 1:
        raise UserError(f"--device-batch-size and --split-tokens must be >= 1 (got {args.device_batch_size}, "
                        f"{args.split_tokens})")
    return args


def main(argv=None):
    args = parse_args(argv)
    get_report()  # proves the report directory is writable before any compute

    _, rank, _, world_size, device = compute_init(args.device_type)
    model, tokenizer, meta = load_model("base", device, phase="eval", model_tag=args.model_tag, step=args.step)
    use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
    T = model.config.sequence_len
    autocast = autocast_for(device)
    token_bytes = get_token_bytes(device=device)
    steps = max(1, args.split_tokens // (args.device_batch_size * T * world_size))
    print0(f"base_loss | step {meta['step']} | up to {steps} batches of {args.device_batch_size}x{T}x{world_size} tokens "
           "per split (one pass at most)" + (f" | {args.preset}" if args.preset else ""))

    results = {}
    for split in ("train", "val"):
        t0 = time.time()
        loader, batches = eval_batches(tokenizer, args.device_batch_size, T, split, device, rank, world_size,
                                       source=args.data_source)
        with autocast:
            results[f"{split} bpb"], tokens, ran_out = evaluate_bpb(model, batches, steps, token_bytes)
        loader.close()
        print0(f"{split} bpb: {results[f'{split} bpb']:.4f} over {describe_eval(tokens, ran_out, split)} "
               f"({time.time() - t0:.1f}s)")
    samples = []
    if rank == 0:
        with autocast:
            samples = greedy_samples(model, tokenizer, PROMPTS, max_tokens=24)
        for s in samples:
            print0(f"  sample: {s!r}")
    get_report().log(section="Base model loss", data=[{"step": meta["step"], **results}, {"samples": samples}])
    compute_cleanup()


if __name__ == "__main__":
    run_main(main)
