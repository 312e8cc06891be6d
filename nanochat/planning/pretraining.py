"""
base_train's plan, the planning add-on's one call before a base model is built: its flags (--time-budget,
--scaling-law, --gpu-memory, --checkpoint-activations, --dry-run) and the flags it chooses from them — the depth and
steps a time budget's probe and scaling law pick (time_budget.py), the device batch and activation checkpointing the
memory model fits into the card (memory_model.py). A resumed run takes them from its checkpoint's plan. What it
returns goes on with the run: its BudgetClock is a training-loop callback (the calibrations), and finish() says how
the run kept to its time and its memory.
"""

import argparse
import os
import time
from dataclasses import dataclass

import torch.distributed as dist

from nanochat.common import (UserError, all_reduce_max, compile_choice, dist_rank_world, get_compute_dtype,
                             parse_memory, peak_memory_mib, print0)
from nanochat.planning import memory_model, time_budget
from nanochat.recipe import grad_accum_steps, split_components

# What a time budget's plan decides, unless given: a resume takes them from the checkpoint's flags.
PLANNED_FLAGS = ["depth", "aspect_ratio", "head_dim", "device_batch_size", "eval_every", "sample_every",
                 "core_metric_every", "time_budget", "scaling_law"]


def add_planning_flags(parser):
    p = parser
    p.add_argument("--time-budget", default=None, help="wall time for the whole stage (90s, 20m, 4h): measures this "
                   "machine and picks the depth (unless --depth) and the tokens the scaling law predicts do best in it; "
                   "docs/time_budget.md")
    p.add_argument("--scaling-law", default="auto", help="--time-budget's law: auto, a shipped one (gpu-reference, "
                   "cpu-builtin, cpu-brown) or a miniseries' scaling_law.json")
    p.add_argument("--gpu-memory", default=None, help="the memory a step must fit in, e.g. 24GiB or 80GB (default: "
                   "$NANOCHAT_GPU_MEMORY, else a GPU's free memory): plans the device batch for it and caps a bigger "
                   "card to it; on a CPU planned for, not enforced")
    p.add_argument("--checkpoint-activations", default="auto", choices=["auto", "0", "1"],
                   help="1: each block's activations are recomputed in its backward instead of kept (torch.utils."
                   "checkpoint: less memory, a third more compute); auto: off, unless the memory to fit in (a GPU's, "
                   "--gpu-memory) cannot hold one row without it")
    p.add_argument("--dry-run", action="store_true", help="with --time-budget: measure, print the plan, train nothing")


def check_planning_flags(args):
    """The planning flags, checked before any work: the memory to plan for (a device batch given is kept, an unset one
    is the memory's), and a time budget's flags (the depth unless given, the steps and the eval cadence come from the
    plan and stay None)."""
    source = "--gpu-memory" if args.gpu_memory is not None else "NANOCHAT_GPU_MEMORY"
    memory_text = args.gpu_memory if args.gpu_memory is not None else os.environ.get("NANOCHAT_GPU_MEMORY") or None
    args.gpu_memory = None if memory_text is None else parse_memory(memory_text, source)
    args.gpu_memory_label = f"{source}={memory_text}"
    args.device_batch_given = args.device_batch_size is not None
    if args.time_budget is None:
        if args.dry_run:
            raise UserError("--dry-run shows a --time-budget's plan: give --time-budget")
        return
    args.time_budget = time_budget.parse_duration(args.time_budget)
    if args.time_budget < time_budget.MIN_BUDGET_SECONDS:
        raise UserError(f"--time-budget={time_budget.duration_label(args.time_budget)} is too short: start-up, the "
                        f"probe, an evaluation and one step need at least {time_budget.MIN_BUDGET_SECONDS}s")
    given = [flag for flag, value in (("--num-iterations", args.num_iterations), ("--target-flops",
             args.target_flops if args.target_flops > 0 else None), ("--target-param-data-ratio",
             args.target_param_data_ratio)) if value is not None]
    if given:
        raise UserError(f"--time-budget sets the number of steps itself: drop {', '.join(given)}")
    if args.core_metric_every not in (None, -1):
        raise UserError("--time-budget does not plan for CORE evaluations during training (their cost is not measured "
                        "before the run): drop --core-metric-every, and run scripts.base_eval after")
    args.core_metric_every = -1
    if args.sample_every is None:
        args.sample_every = -1  # scripts.base_loss prints samples after the run


@dataclass
class PretrainingPlan:
    """What plan_base_train chose (flags: set them on the run's args) and what keeps the run to it."""
    flags: dict
    clock: time_budget.BudgetClock  # a callback of the training loop: the calibrations of a budgeted run
    predicted_peak: object  # device batch -> the memory model's peak of this run's step in bytes; None: no memory planned

    def checkpoint_meta(self):
        """What a budgeted run adds to every checkpoint's meta.json."""
        return self.clock.checkpoint_meta()

    def finish(self, loop, device_batch):
        """After the last step: the time against the budget, and on a GPU the predicted peak against the measured."""
        self.clock.finish(loop)
        if self.predicted_peak is None or loop.device.type != "cuda":
            return
        peak, predicted = peak_memory_mib(loop.device) * 2**20, self.predicted_peak(device_batch)
        print0(f"memory | the run's peak: {memory_model.format_bytes(peak)} allocated (torch.cuda.max_memory_allocated), "
               f"predicted {memory_model.format_bytes(predicted)} at device batch {device_batch} ({predicted / peak - 1:+.1%})")


def plan_base_train(args, meta, ckpt_dir, vocab_size, device, world_size, autocast):
    """
    The flags base_train's plan chooses, before the model is built, from its flags (left unchanged: the choice is in
    the returned PretrainingPlan's flags). With --time-budget: the probe and the law's depth, device batch, steps,
    checkpointing and eval cadence (a resume: its checkpoint's plan). With a memory to fit in (a GPU, --gpu-memory):
    the device batch left unset and checkpointing, fitted by the memory model. Every rank plans alike.
    """
    planned = argparse.Namespace(**vars(args))
    memory = run_memory(planned, device, world_size)
    clock = plan_budget(planned, meta, ckpt_dir, vocab_size, device, world_size, autocast, memory)
    if clock.plan is None:
        fit_without_budget(planned, meta, vocab_size, device, world_size, memory)
    predicted_peak = peak_predictor(planned, run_shape(planned, vocab_size, device, world_size, memory))
    flags = {name: value for name, value in vars(planned).items() if getattr(args, name) != value}
    return PretrainingPlan(flags, clock, predicted_peak)


# -----------------------------------------------------------------------------
# The time budget


def plan_budget(args, meta, ckpt_dir, vocab_size, device, world_size, autocast, memory=(None, "")):
    """
    A time-budgeted run's plan, its flags filled from it, and the BudgetClock that keeps it on time: read back from the
    checkpoint on a resume (it follows the plan as saved, and does not calibrate again), else made here (the probe, a
    few seconds to a minute). Returns a clock whose call_at_step is None for a run without a budget.
    """
    saved = (meta or {}).get("time_plan")
    if saved:
        args.checkpoint_activations = meta["user_config"].get("checkpoint_activations", "0")
    if meta is not None and args.time_budget and not saved:
        raise UserError(f"{ckpt_dir} was not trained to a time budget: drop --time-budget to resume it")
    if saved:
        for flag in PLANNED_FLAGS:
            setattr(args, flag, meta["user_config"].get(flag, getattr(args, flag)))
        args.num_iterations = -1  # the checkpoint's run, as planned
        plan = time_budget.plan_from_dict(saved)
        print0(f"plan | resuming a run planned for {time_budget.duration_label(plan.budget_seconds)}: d{plan.depth}, "
               f"{meta['num_iterations']:,} steps{'' if plan.calibrated else ' (as planned before its calibration)'}; "
               f"the plan is followed as saved, the time not counted again")
        return time_budget.BudgetClock(plan, active=False, warmdown_ratio=args.warmdown_ratio)
    if not args.time_budget:
        return time_budget.BudgetClock(None, active=False, warmdown_ratio=args.warmdown_ratio)
    started_at = time_budget.stage_start_time()
    law = time_budget.law_for(args.scaling_law, device.type, args.data_source)
    args.aspect_ratio = law.aspect_ratio if args.aspect_ratio is None else args.aspect_ratio
    args.head_dim = law.head_dim if args.head_dim is None else args.head_dim
    shape = run_shape(args, vocab_size, device, world_size, memory)
    shape.compile_seconds = time_budget.COMPILE_SECONDS.get(device.type, 30.0) if shape.compiled else 0.0
    t0 = time.time()
    plan = time_budget.plan_pretraining(law, shape, args.time_budget, started_at, device, autocast, depth=args.depth,
                                        warmdown_ratio=args.warmdown_ratio)
    same_plan_everywhere(plan)
    dtype = str(get_compute_dtype(device)).replace("torch.", "")
    print0(time_budget.describe_plan(plan, law, time.time() - t0, f"{device.type} x{world_size} {dtype}"))
    if plan.memory_limit:
        print0(time_budget.memory_line(plan, memory[1]))
    args.depth, args.device_batch_size, args.num_iterations = plan.depth, plan.device_batch_size, plan.num_iterations
    args.checkpoint_activations = "1" if plan.checkpoint_activations else "0"
    args.eval_every = plan.eval_every
    return time_budget.BudgetClock(plan, active=True, warmdown_ratio=args.warmdown_ratio)


def run_shape(args, vocab_size, device, world_size, memory):
    """What the time budget's plan and the memory model need of the flags. With a memory to fit in and no
    --device-batch-size, the device batch may be as large as each rank's rows per step."""
    model_components, optimizer_components = split_components(args.components)
    rows_per_step = args.total_batch_size // (args.max_seq_len * world_size)
    largest = args.device_batch_size if args.device_batch_given or memory[0] is None else rows_per_step
    checkpoint = {"auto": None if memory[0] else False, "0": False, "1": True}[args.checkpoint_activations]
    return time_budget.RunShape(vocab_size, args.max_seq_len, args.total_batch_size, world_size, args.aspect_ratio,
                                args.head_dim, args.num_kv_heads or None, model_components, optimizer_components,
                                bool(args.fp8), largest, args.eval_tokens, args.eval_every, args.sample_every > 0, 0.0,
                                args.save_every, memory_limit=memory[0], checkpoint_activations=checkpoint,
                                device_type=device.type, compiled=compile_choice(args.compile, device),
                                memory_label=memory[1])


def same_plan_everywhere(plan):
    """Every rank must train the same plan (it decides from timings all ranks agreed on); a rank that did not would
    wait forever in a collective the others never reach, so a difference is a bug, refused here."""
    if dist_rank_world()[1] > 1:
        plans = [None] * dist_rank_world()[1]
        mine = {k: v for k, v in time_budget.plan_dict(plan).items() if k != "started_at"}
        dist.all_gather_object(plans, mine)
        if any(p != plans[0] for p in plans):
            raise RuntimeError(f"the ranks made different plans: {plans}")


# -----------------------------------------------------------------------------
# The card's memory


def run_memory(args, device, world_size):
    """(bytes, words) of the memory a step must fit in (memory_model.device_memory_limit), the least of every rank's;
    (None, "") on a CPU without --gpu-memory / NANOCHAT_GPU_MEMORY. Also checks the exact split of the global batch:
    a device batch left to the memory plan will divide the rows each rank takes per step."""
    limit, label = memory_model.device_memory_limit(device, args.gpu_memory, args.gpu_memory_label)
    planned_batch = limit is not None and not args.device_batch_given
    grad_accum_steps(args.total_batch_size, 1 if planned_batch else args.device_batch_size, args.max_seq_len, world_size)
    if limit is None:
        return None, ""
    if device.type != "cuda":
        print0(f"memory | {label}: planned for on the {device.type}, not enforced there")
    least = -all_reduce_max([-float(limit)], device)[0]  # every rank plans alike: for the rank with the least
    return int(least), label


def fit_without_budget(args, meta, vocab_size, device, world_size, memory):
    """
    A run without a time budget, with a memory to fit in (a GPU, or --gpu-memory): the device batch left unset becomes
    the largest the memory model predicts to fit, with activation checkpointing where one row does not fit without
    (--checkpoint-activations=auto); a device batch given is kept, with a line when it is predicted not to fit. The
    predicted peak is printed beside the memory. A resume keeps its checkpoint's device batch and checkpointing.
    """
    if meta is not None:
        saved = meta["user_config"]
        args.checkpoint_activations = saved.get("checkpoint_activations", "0") if args.checkpoint_activations == "auto" \
            else args.checkpoint_activations
        if not args.device_batch_given:
            args.device_batch_size = saved.get("device_batch_size", args.device_batch_size)
    if memory[0] is None:
        args.checkpoint_activations = "1" if args.checkpoint_activations == "1" else "0"
        return
    shape = run_shape(args, vocab_size, device, world_size, memory)
    if meta is None:
        time_budget.refuse_impossible_memory(shape, args.depth)
    if meta is None and not args.device_batch_given:
        rows_per_step = args.total_batch_size // (args.max_seq_len * world_size)
        fit = memory_model.fit_step(time_budget.step_spec(args.depth, shape), memory[0], rows_per_step,
                                    largest=shape.max_device_batch, checkpoint=shape.checkpoint_activations)
        args.device_batch_size = fit.device_batch
        args.checkpoint_activations = "1" if fit.checkpoint_activations else "0"
    else:
        args.checkpoint_activations = "1" if args.checkpoint_activations == "1" else "0"
    spec = time_budget.step_spec(args.depth, shape, args.checkpoint_activations == "1")
    step = memory_model.predict(spec, args.device_batch_size)
    print0(memory_model.describe_fit(step, args.checkpoint_activations == "1", memory[0], memory[1]))
    if not memory_model.fits(step, memory[0]):
        print0(f"memory | --device-batch-size={args.device_batch_size} is predicted to need more than the "
               f"{memory_model.MEMORY_SHARE * 100:.0f} % of {memory_model.format_bytes(memory[0])} planned for: an "
               f"out-of-memory in the first steps halves it")


def peak_predictor(args, shape):
    """device batch -> the memory model's peak of this run's step, for FittingBatches to say how far off it was when
    memory runs out anyway; None where no memory was planned for."""
    if shape.memory_limit is None:
        return None
    spec = time_budget.step_spec(args.depth, shape, args.checkpoint_activations == "1")
    return lambda device_batch: memory_model.predict(spec, device_batch).peak
