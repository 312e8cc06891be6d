"""
Score a checkpoint on the CORE metric (DCLM's in-context-learning suite), print one line per
task and the final number, save the per-task results as CSV and log them to the report.

python -m scripts.base_eval --model-tag d12
python -m scripts.base_eval --max-per-task 100          # a quick look on a subset of each task
python -m scripts.base_eval --eval-bundle=builtin        # offline: tasks about the built-in corpus's world
torchrun --standalone --nproc_per_node=8 -m scripts.base_eval -- --model-tag d12
"""

import argparse
import csv
import io
import os
import re
import time

from nanochat.checkpoint_manager import find_latest_tag, load_model
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.common import (UserError, atomic_write_text, autocast_for, compute_cleanup, compute_init, ensure_writable,
                             get_base_dir, print0, run_main)
from nanochat.core_eval import evaluate_core, resolve_eval_bundle
from nanochat.report import get_report
from nanochat.presets import fill_from_preset, preset_help


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Evaluate a checkpoint on the CORE metric")
    parser.add_argument("--source", type=str, default="base", choices=["base", "mid", "sft", "rl"],
                        help="which stage's checkpoints to load")
    parser.add_argument("--model-tag", type=str, default=None, help="checkpoint tag (default: the stage's default)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--max-per-task", type=int, default=None, help="examples per task, -1 = all (a smaller number is a "
                        f"quick, noisier look) {preset_help('base_eval', 'max_per_task')}")
    parser.add_argument("--eval-bundle", type=str, default="dclm",
                        help="dclm (the published CORE bundle, downloaded once) | builtin (tasks about the built-in "
                             "corpus's world, written by `python -m nanochat.corpus`) | a folder holding core.yaml")
    parser.add_argument("--device-type", type=str, default="", help="cuda|mps|cpu (default: autodetect)")
    args = fill_from_preset(parser.parse_args(argv), "base_eval")
    if args.max_per_task == 0 or args.max_per_task < -1:
        raise UserError(f"--max-per-task must be -1 (all) or a positive number (got {args.max_per_task})")
    return args


def bundle_suffix(eval_bundle):
    """'' for the published bundle, so its file names stay as they were; else '_builtin' or '_<folder name>'."""
    if eval_bundle == "dclm":
        return ""
    name = "builtin" if eval_bundle == "builtin" else os.path.basename(os.path.normpath(eval_bundle))
    return "_" + (re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "bundle")


def results_csv(core):
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["Task", "Accuracy", "Centered"])
    for label, accuracy in core["results"].items():
        writer.writerow([label, f"{accuracy:.6f}", f"{core['centered_results'][label]:.6f}"])
    writer.writerow(["CORE", "", f"{core['core_metric']:.6f}"])
    return out.getvalue()


def results_markdown(core):
    lines = ["| Task | Accuracy | Centered |", "|---|---:|---:|"]
    for label, accuracy in core["results"].items():
        lines.append(f"| {label} | {accuracy:.4f} | {core['centered_results'][label]:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    out_dir = ensure_writable(os.path.join(get_base_dir(), "base_eval"), "CORE results")
    get_report()  # proves the report directory is writable before any compute
    is_ddp, rank, local_rank, world_size, device = compute_init(args.device_type)
    try:
        bundle_dir = resolve_eval_bundle(args.eval_bundle)  # before the model: a missing bundle fails fast
        model_tag = args.model_tag or find_latest_tag(args.source)
        model, tokenizer, meta = load_model(args.source, device, phase="eval", model_tag=model_tag, step=args.step)
        use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
        step = meta.get("step", args.step)
        autocast = autocast_for(device)  # the precision of training: bf16 where it is fast, plain fp32 elsewhere
        print0(f"CORE evaluation of {args.source} checkpoint {model_tag} step {step} on {world_size} rank(s), "
               f"eval bundle {args.eval_bundle} ({bundle_dir})" + (f" | {args.preset}" if args.preset else ""))

        t0 = time.time()
        with autocast:
            core = evaluate_core(model, tokenizer, device, max_per_task=args.max_per_task, bundle_dir=bundle_dir)
        seconds = time.time() - t0
        print0(f"CORE metric: {core['core_metric']:.4f} ({seconds:.0f}s)")

        if rank == 0:
            name = f"{model_tag}_{step}{bundle_suffix(args.eval_bundle)}.csv"
            name = name if args.source == "base" else f"{args.source}_{name}"
            os.makedirs(out_dir, exist_ok=True)
            csv_path = os.path.join(out_dir, name)
            atomic_write_text(csv_path, results_csv(core))
            print0(f"Results written to {csv_path}")
            # Only a base checkpoint feeds the report's BASE column; other stages get a section of their own.
            section = "Base model evaluation" if args.source == "base" else f"CORE evaluation {args.source}"
            get_report().log(section=section, data=[
                {"Source": args.source, "Model tag": model_tag, "Step": step,
                 "Max per task": args.max_per_task, "Seconds": round(seconds, 1)},
                {"eval bundle": args.eval_bundle, "CORE metric": core["core_metric"]},
                # A table, not a dict: per-task labels such as arc_easy must not land in the summary's chat-eval rows.
                results_markdown(core),
            ])
    finally:
        compute_cleanup()


if __name__ == "__main__":
    run_main(main)
