"""
`bench.memory_model`: the memory model of a training step (nanochat/planning/memory_model.py) against what the step
really holds, and the plans it makes for cards of several sizes.

    python -m bench.memory_model predict                  # the CPU: predicted against measured, d2-d8, one row a shape
    python -m bench.memory_model predict --shapes d4:256:8:ckpt d6:512:8:fp8    # DEPTH:SEQ_LEN:BATCH[:ckpt][:fp8]
    python -m bench.memory_model cards                    # plans for 12-80 GiB cards at 1 h and 4 h (docs/time_budget.md)
    python -m bench.memory_model predict --device cuda --compile 1 --vocab-size 32768 \
        --shapes d12:2048:16 d24:2048:16 d24:2048:16:fp8       # a GPU: against torch.cuda.max_memory_allocated

predict: each shape's step runs for real in a fresh process of its own, as base_train runs it on this CPU (its compute
dtype, its fused CPU Functions unless --cpu-ops=0, eager unless --compile=1), and its peak is measured as bench memory
measures it: torch.profiler's allocation events, every tensor alive from the model's construction on, at the highest
point of the second of two steps (bench/memory.py). That is the allocator's peak, not the process's: the process's
peak RSS (Python, torch's libraries, oneDNN's kernel caches) is printed beside it. The prediction is made here, on
fake tensors, before the child runs. With --device=cuda the child trains on this machine's GPU and the measured peak
is torch.cuda.max_memory_allocated over the second step (CUDA's reserved memory beside it), against the prediction
base_train's plan makes for that GPU.

cards: for each card size and budget, the plan a budgeted base_train on one GPU would make with
NANOCHAT_GPU_MEMORY set to that size, at an assumed speed (--peak-tflops, --mfu: by default an H100's 989 TFLOP/s
bf16 peak at the 45 % MFU the H200 measured for the compiled step, a third more for a checkpointed step's second
forward): the depth, device batch, checkpointing, predicted peak and the predicted val bpb of the `gpu-reference` law.
A real run measures its own speed (the probe); only the memory here is this project's prediction.
"""

import argparse
import json
import os
import resource
import subprocess
import sys

import torch

MIB, GIB = 2**20, 2**30
DEFAULT_SHAPES = ["d2:256:8", "d4:256:8", "d4:256:8:ckpt", "d4:256:8:fp8", "d6:512:8", "d6:512:8:ckpt", "d8:256:8",
                  "d8:512:4:ckpt"]


def parse_shape(text):
    """'d6:512:8:ckpt:fp8' -> (depth, seq_len, device batch, checkpointing, fp8)."""
    parts = text.split(":")
    try:
        depth, seq_len, batch = int(parts[0].lstrip("d")), int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        from nanochat.common import UserError

        raise UserError(f"--shapes: {text!r} is not DEPTH:SEQ_LEN:BATCH[:ckpt][:fp8], e.g. d4:256:8:ckpt") from None
    return depth, seq_len, batch, "ckpt" in parts[3:], "fp8" in parts[3:]


# -----------------------------------------------------------------------------
# The child: one shape's real step, measured


def child_main(argv=None):
    from bench.memory import measure_second_step, random_batch
    from nanochat.common import autocast_for, compile_model, keep_freed_memory_in_process
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.kernels.fp8 import convert_to_fp8
    from nanochat.optim import compile_muon_updates
    from nanochat.recipe import build_optimizers, depth_recipe, split_components
    from nanochat.optim import muon_momentum
    from nanochat.loop import train_step

    p = argparse.ArgumentParser(description="bench.memory_model's child: one shape's step, measured")
    for flag in ("depth", "seq-len", "device-batch-size", "vocab-size", "aspect-ratio", "head-dim", "checkpoint",
                 "fp8", "compile"):
        p.add_argument(f"--{flag}", type=int, required=True)
    p.add_argument("--components", default="")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.device == "cuda":
        from nanochat.common import use_cuda_device

        use_cuda_device(device)  # the current GPU, TF32 matmuls allowed: as base_train's compute_init

    def build():
        keep_freed_memory_in_process()  # as base_train does
        torch.manual_seed(42)
        model_components, optimizer_components = split_components(args.components)
        recipe = depth_recipe(args.depth, args.vocab_size, args.seq_len, args.device_batch_size * args.seq_len,
                              args.aspect_ratio, args.head_dim, num_iterations=1, components=model_components)
        model = use_cpu_kernels(build_model(recipe.model_config, device), device)
        if args.fp8:
            convert_to_fp8(model)
        model.checkpoint_activations = bool(args.checkpoint)
        train_model = compile_model(model) if args.compile else model
        optimizers = build_optimizers(model, **recipe.lrs(), optimizer_components=optimizer_components)
        if args.compile:  # as base_train: Muon's update compiled with the model
            compile_muon_updates(optimizers)
        autocast = autocast_for(device)
        x, y = (t.to(device) for t in random_batch(args))

        def step():
            train_step(train_model, optimizers, [(x, y)], lambda m, xy: m(*xy), 1.0, muon_momentum(0), autocast)

        return model, optimizers, step

    if args.device == "cuda":  # what the plan predicts there: torch.cuda.max_memory_allocated of the second step
        model, optimizers, step = build()
        step()  # the first: the optimizer state made, and (compiled) the graphs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize()
        print(json.dumps({"peak_bytes": torch.cuda.max_memory_allocated(device), "at_peak": {},
                          "peak_rss_bytes": torch.cuda.max_memory_reserved(device)}), flush=True)
        return
    result = measure_second_step(build)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({k: v for k, v in result.items() if k in ("peak_bytes", "at_peak", "peak_rss_bytes")}), flush=True)


def measure(shape, args):
    """Run one shape's child; its result, or {"failed": why}."""
    from bench.gpu_check import REPO_ROOT
    from nanochat.common import child_pythonpath

    depth, seq_len, batch, checkpoint, fp8 = shape
    command = [sys.executable, "-m", "bench.memory_model", "child", f"--depth={depth}", f"--seq-len={seq_len}",
               f"--device-batch-size={batch}", f"--vocab-size={args.vocab_size}", f"--aspect-ratio={args.aspect_ratio}",
               f"--head-dim={args.head_dim}", f"--checkpoint={int(checkpoint)}", f"--fp8={int(fp8)}",
               f"--compile={args.compile}", f"--components={args.components}", f"--device={args.device}"]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO_ROOT), "NANOCHAT_CPU_OPS": str(args.cpu_ops)}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a GPU here stays out of the CPU's measurement
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"failed": f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}"}
    return json.loads(lines[-1])


def cmd_predict(args):
    from bench.common import emit_json, log, machine_info, print_table
    from bench.gpu_check import REPO_ROOT
    from nanochat.common import get_compute_dtype
    from nanochat.planning.memory_model import StepSpec, format_bytes, predict, step_profile
    from nanochat.recipe import DEFAULT_COMPONENTS, canonical_components, split_components

    components = canonical_components(DEFAULT_COMPONENTS if args.components == "default" else args.components)
    args.components = components
    model_components, optimizer_components = split_components(components)
    dtype = str(get_compute_dtype(torch.device(args.device))).split(".")[-1]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    print(f"bench.memory_model predict | {dtype} on the {args.device}, {'compiled' if args.compile else 'eager'}, "
          f"NANOCHAT_CPU_OPS={args.cpu_ops}, vocab {args.vocab_size}, aspect {args.aspect_ratio}, head {args.head_dim}, "
          f"components {components or 'none'} | measured: the allocator's peak of the second step ("
          f"{'torch.cuda.max_memory_allocated' if args.device == 'cuda' else 'torch.profiler allocation events'}) | "
          f"at {commit}", flush=True)
    rows, results = [], []
    for text in args.shapes:
        depth, seq_len, batch, checkpoint, fp8 = shape = parse_shape(text)
        spec = StepSpec(depth, seq_len, args.vocab_size, args.aspect_ratio, args.head_dim, None, tuple(model_components),
                        tuple(optimizer_components), dtype, fp8, checkpoint, bool(args.compile),
                        cpu_ops=args.device == "cpu" and bool(args.cpu_ops) and not args.compile,
                        device_type=args.device)
        predicted = predict(spec, batch)
        traced = step_profile(spec).traced_seconds
        log(f"bench.memory_model: {text} predicted {format_bytes(predicted.peak)} ({traced:.1f} s); measuring ...")
        measured = measure(shape, args)
        if "failed" in measured:
            rows.append([text, format_mib(predicted.peak), "failed", "-", "-", "-", "-"])
            results.append({"shape": text, "predicted": predicted.peak, "failed": measured["failed"]})
            continue
        error = predicted.peak / measured["peak_bytes"] - 1
        rows.append([text, format_mib(predicted.peak), format_mib(measured["peak_bytes"]), f"{100 * error:+.1f} %",
                     predicted.phase, f"{traced:.1f}", format_mib(measured["peak_rss_bytes"])])
        results.append({"shape": text, "predicted": predicted.peak, "measured": measured["peak_bytes"],
                        "error": round(error, 4), "phase": predicted.phase, "traced_s": round(traced, 2),
                        "measured_at_peak": measured["at_peak"], "peak_rss": measured["peak_rss_bytes"]})
    print_table("one training step's peak, MiB: the memory model's prediction against the measured (the allocator's "
                "peak of the step)", ["shape (depth:T:batch)", "predicted", "measured", "error", "predicted peak in",
                                      "traced s", "CUDA reserved" if args.device == "cuda" else "process peak RSS"], rows)
    for result in results:
        if "failed" in result:
            print(f"{result['shape']}: failed: {result['failed']}")
    emit_json({"bench": "memory_model", "device": args.device, "dtype": dtype, "compile": bool(args.compile),
               "cpu_ops": args.cpu_ops,
               "vocab_size": args.vocab_size, "aspect_ratio": args.aspect_ratio, "head_dim": args.head_dim,
               "components": components or "none", "commit": commit, "rows": results, "machine": machine_info()})


def format_mib(n):
    return f"{n / MIB:,.1f}"


# -----------------------------------------------------------------------------
# Cards: the plans of a budgeted base_train on one GPU, for several memory sizes


CHECKPOINT_COST = 4 / 3  # a checkpointed step runs every block's forward twice: forward 1/3 of a step, once more


def plan_for_card(memory, budget_seconds, shape_for, flops_per_second):
    """The depth, device batch and checkpointing a one-GPU budgeted plan picks with `memory` bytes, at the assumed speed:
    every depth that fits, its steps in the budget, the law's val bpb, the best kept (time_budget.plan_memory and the
    law, as base_train's plan uses them; the probe's measured speed replaced by the assumed one)."""
    from nanochat.planning.time_budget import LAWS, START_SECONDS, meta_recipe, plan_memory

    law = LAWS["gpu-reference"]
    shape = shape_for(memory)
    best = None
    for depth in range(6, 33):
        fit = plan_memory(depth, shape)
        if fit is None:
            continue
        recipe = meta_recipe(depth, shape)
        step_seconds = recipe.flops_per_token * shape.total_batch_size / flops_per_second
        step_seconds *= CHECKPOINT_COST if fit.checkpoint_activations else 1.0
        seconds = budget_seconds - START_SECONDS - shape.compile_seconds
        steps = int(seconds / step_seconds)
        bpb = law.predict(recipe.scaling_params, steps * shape.total_batch_size)
        if best is None or bpb < best["bpb"]:
            best = {"depth": depth, "device_batch": fit.device_batch, "checkpoint": fit.checkpoint_activations,
                    "peak": fit.memory.peak, "phase": fit.memory.phase, "steps": steps, "bpb": bpb,
                    "seconds": steps * step_seconds}
    return best


def cmd_cards(args):
    from bench.common import emit_json, print_table
    from nanochat.planning.memory_model import format_bytes, parse_memory
    from nanochat.recipe import DEFAULT_COMPONENTS, REFERENCE_BATCH, split_components
    from nanochat.planning.time_budget import COMPILE_SECONDS, RunShape, parse_duration

    model_components, optimizer_components = split_components(DEFAULT_COMPONENTS)

    def shape_for(memory):
        return RunShape(32768, 2048, REFERENCE_BATCH, 1, 64, 128, None, model_components, optimizer_components, False,
                        REFERENCE_BATCH // 2048, 0, None, False, COMPILE_SECONDS["cuda"], memory_limit=memory,
                        device_type="cuda", compiled=True)

    rows, results = [], []
    for card in args.cards:
        memory = parse_memory(card, "--cards")
        for budget in args.budgets:
            plan = plan_for_card(memory, parse_duration(budget), shape_for, args.mfu * args.peak_tflops * 1e12)
            if plan is None:
                rows.append([card, budget, "nothing fits", "", "", "", "", ""])
                continue
            rows.append([card, budget, f"d{plan['depth']}", str(plan["device_batch"]), "yes" if plan["checkpoint"] else "no",
                         f"{format_bytes(plan['peak'])} ({plan['phase']})", f"{plan['steps']:,} steps, "
                         f"{plan['seconds'] / 60:,.0f} min", f"{plan['bpb']:.4f}"])
            results.append({"card": card, "budget": budget, **plan})
    print_table(f"a budgeted base_train's plan with NANOCHAT_GPU_MEMORY=<card> (default recipe, T 2048, 2^19-token "
                f"steps, compiled bf16; speed assumed: {args.mfu:.0%} MFU of {args.peak_tflops:,.0f} TFLOP/s, "
                f"a checkpointed step x{CHECKPOINT_COST:.2f})",
                ["card", "budget", "depth", "device batch", "checkpointing", "predicted peak", "training",
                 "predicted val bpb"], rows)
    emit_json({"bench": "memory_model cards", "rows": results})


def main(argv=None):
    p = argparse.ArgumentParser(description="the memory model of a training step: predicted against measured, and the "
                                            "plans it makes for cards of several sizes")
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("predict", help="the CPU: predicted against the measured peak of the same step, a row a shape")
    pr.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="DEPTH:SEQ_LEN:BATCH[:ckpt][:fp8]")
    pr.add_argument("--vocab-size", type=int, default=4096)
    pr.add_argument("--aspect-ratio", type=int, default=64)
    pr.add_argument("--head-dim", type=int, default=128)
    pr.add_argument("--components", default="default", help="'default' (base_train's), 'none' or a list")
    pr.add_argument("--cpu-ops", type=int, default=1, choices=[0, 1], help="0: the plain torch path a GPU takes")
    pr.add_argument("--compile", type=int, default=0, choices=[0, 1], help="1: torch.compile'd (inductor)")
    pr.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: the step measured on this machine's "
                    "GPU (torch.cuda.max_memory_allocated), predicted as base_train plans it there")
    cards = sub.add_parser("cards", help="the plans for cards of several sizes at several budgets")
    cards.add_argument("--cards", nargs="+", default=["12GiB", "16GiB", "24GiB", "40GiB", "80GiB"])
    cards.add_argument("--budgets", nargs="+", default=["1h", "4h"])
    cards.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense bf16 peak (an H100's: 989)")
    cards.add_argument("--mfu", type=float, default=0.45, help="the fraction of it a compiled step reaches (the H200's "
                       "measured d24 step: 0.47)")
    args, rest = p.parse_known_args(argv)
    if args.command == "predict" and not rest:
        return cmd_predict(args)
    if args.command == "cards" and not rest:
        return cmd_cards(args)
    p.error(f"unrecognized arguments: {' '.join(rest)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child_main(sys.argv[2:])
    else:
        from nanochat.common import run_main

        run_main(main)
