"""
What scripts/base_train.py sets up around its loop: the checks of its flags, the depth dial's recipe from them, the
components a resume keeps, a time budget's plan (nanochat.time_budget) made or read back from the checkpoint, and
the run's one-line config. The script keeps the loop itself.
"""

import time

from nanochat.checkpoint_manager import load_meta, resolve_step
from nanochat.common import UserError, compile_backend, get_compute_dtype, print0
from nanochat.stage import check_flag, validate_training_flags
from nanochat.time_budget import (COMPILE_SECONDS, MIN_BUDGET_SECONDS, BudgetClock, RunShape, describe_plan,
                                  duration_label, law_for, make_plan, parse_duration, plan_dict, plan_from_dict,
                                  stage_start_time)
from nanochat.training import (DEFAULT_COMPONENTS, canonical_components, depth_recipe, model_config_for_depth,
                               split_components)

# Flags a resumed run must keep: they fix the batches, the optimizer shards or the model, so changing them breaks exactness.
RESUME_FIXED_FLAGS = ["depth", "aspect_ratio", "head_dim", "num_kv_heads", "max_seq_len", "device_batch_size",
                      "total_batch_size", "data_source", "seed", "components", "fp8"]
# What a time budget's plan decides, unless given: a resume takes them from the checkpoint's flags.
PLANNED_FLAGS = ["depth", "aspect_ratio", "head_dim", "device_batch_size", "eval_every", "sample_every",
                 "core_metric_every", "time_budget", "scaling_law"]


def check_budget_flags(args):
    """--time-budget: a duration, and no other budget flag beside it; what it leaves to the plan stays None."""
    args.time_budget = parse_duration(args.time_budget)
    if args.time_budget < MIN_BUDGET_SECONDS:
        raise UserError(f"--time-budget={duration_label(args.time_budget)} is too short: start-up, the probe, an "
                        f"evaluation and one step need at least {MIN_BUDGET_SECONDS}s")
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


def validate_args(args):
    """Every flag checked before any compute: one line naming the flag, its value and what is allowed."""
    validate_training_flags(args)
    for flag in ("depth", "aspect_ratio", "head_dim", "core_metric_max_per_task", "eval_tokens"):  # None: from the plan
        check_flag(getattr(args, flag) is None or getattr(args, flag) >= 1, flag, getattr(args, flag), "must be >= 1")
    check_flag(args.max_seq_len >= 16, "max_seq_len", args.max_seq_len, "must be >= 16 (shorter rows crop nearly every document)")
    check_flag(args.num_kv_heads >= 0, "num_kv_heads", args.num_kv_heads, "must be >= 1, or 0 for as many as query heads")
    check_flag(args.num_iterations is None or args.num_iterations == -1 or args.num_iterations >= 1, "num_iterations",
               args.num_iterations, "must be >= 1, or -1 to use --target-flops / --target-param-data-ratio")
    check_flag(args.grad_clip >= 0, "grad_clip", args.grad_clip, "must be >= 0 (0 = off)")
    for flag in ("core_metric_every", "sample_every"):
        value = getattr(args, flag)
        check_flag(value == -1 or value >= 1, flag, value, "must be >= 1, or -1 for never")
    check_flag(args.resume_from_step == -1 or args.resume_from_step >= 0, "resume_from_step", args.resume_from_step,
               "must be >= 0")
    if args.compile != "0":
        compile_backend()  # a bad NANOCHAT_COMPILE_BACKEND is refused here, not at the first step
    if args.components is not None:  # one spelling ('' = plain), for the resume check; an unknown name fails here
        args.components = canonical_components(args.components)


def check_shape(args, vocab_size):
    """The model's shape (head dim, heads and kv heads) checked from the flags before anything is claimed, where they
    fix it: a time budget that chooses the depth checks each depth it tries."""
    if None not in (args.depth, args.aspect_ratio, args.head_dim):
        model_config_for_depth(args.depth, vocab_size, args.max_seq_len, args.aspect_ratio, args.head_dim,
                               args.num_kv_heads or None, split_components(args.components)[0])


def model_tag(args):
    """The run's checkpoint tag: --model-tag, else d<depth>, or for a time budget budget-<duration> (its depth is
    not known until the plan, and a resume must find it again)."""
    if args.model_tag:
        return args.model_tag
    return f"budget-{duration_label(args.time_budget)}" if args.time_budget else f"d{args.depth}"


def resuming(args):
    return args.resume or args.resume_from_step >= 0


def resume_meta(args, ckpt_dir):
    """The meta.json a resume starts from, or None for a new run."""
    if not resuming(args):
        return None
    return load_meta(ckpt_dir, resolve_step(ckpt_dir, args.resume_from_step if args.resume_from_step >= 0 else None))


def resolve_components(args, meta, ckpt_dir):
    """--components unless given: a resume keeps its checkpoint's (a checkpoint from before components existed is the
    plain recipe), a new run gets DEFAULT_COMPONENTS. Given on a resume, it must be the checkpoint's."""
    if meta is None:
        return args.components if args.components is not None else DEFAULT_COMPONENTS
    saved = meta["user_config"].get("components", "")
    if args.components is not None and args.components != saved:
        raise UserError(f"cannot resume {ckpt_dir} exactly with changed --components {saved or 'none'} -> "
                        f"{args.components or 'none'}; drop --components to keep the checkpoint's, or start a new run "
                        "under another --model-tag")
    return saved


def recipe_from_flags(args, vocab_size):
    """The depth dial's whole run, with every lr, decay and budget flag the user gave winning over it."""
    return depth_recipe(args.depth, vocab_size, args.max_seq_len, args.total_batch_size, args.aspect_ratio, args.head_dim,
                        args.num_kv_heads or None, args.lr_batch_exponent, embedding_lr=max(args.embedding_lr, 0),
                        unembedding_lr=max(args.unembedding_lr, 0), matrix_lr=max(args.matrix_lr, 0),
                        weight_decay=None if args.weight_decay < 0 else args.weight_decay,
                        num_iterations=max(args.num_iterations, 0), target_flops=max(args.target_flops, 0),
                        target_param_data_ratio=max(args.target_param_data_ratio or 0, 0),
                        short_run_lrs=bool(args.short_run_lrs), components=split_components(args.components)[0])


def plan_budget(args, meta, ckpt_dir, vocab_size, device, world_size, autocast):
    """
    A time-budgeted run's plan, its flags filled from it, and the BudgetClock that keeps it on time: read back from the
    checkpoint on a resume (it follows the plan as saved, and does not calibrate again), else made here (the probe, a
    few seconds to a minute). Returns a clock whose due() is always False for a run without a budget.
    """
    saved = (meta or {}).get("time_plan")
    if meta is not None and args.time_budget and not saved:
        raise UserError(f"{ckpt_dir} was not trained to a time budget: drop --time-budget to resume it")
    if saved:
        for flag in PLANNED_FLAGS:
            setattr(args, flag, meta["user_config"].get(flag, getattr(args, flag)))
        args.num_iterations = -1  # the checkpoint's run, as planned
        plan = plan_from_dict(saved)
        print0(f"plan | resuming a run planned for {duration_label(plan.budget_seconds)}: d{plan.depth}, "
               f"{meta['num_iterations']:,} steps{'' if plan.calibrated else ' (as planned before its calibration)'}; "
               f"the plan is followed as saved, the time not counted again")
        return BudgetClock(plan, active=False, warmdown_ratio=args.warmdown_ratio)
    if not args.time_budget:
        return BudgetClock(None, active=False, warmdown_ratio=args.warmdown_ratio)
    started_at = stage_start_time()
    law = law_for(args.scaling_law, device.type, args.data_source)
    args.aspect_ratio = law.aspect_ratio if args.aspect_ratio is None else args.aspect_ratio
    args.head_dim = law.head_dim if args.head_dim is None else args.head_dim
    model_components, optimizer_components = split_components(args.components)
    compiling = args.compile == "1" or (args.compile == "auto" and device.type == "cuda")
    shape = RunShape(vocab_size, args.max_seq_len, args.total_batch_size, world_size, args.aspect_ratio, args.head_dim,
                     args.num_kv_heads or None, model_components, optimizer_components, bool(args.fp8),
                     args.device_batch_size, args.eval_tokens, args.eval_every, args.sample_every > 0,
                     COMPILE_SECONDS.get(device.type, 30.0) if compiling else 0.0, args.save_every)
    t0 = time.time()
    plan = make_plan(law, shape, args.time_budget, started_at, device, autocast, depth=args.depth,
                     warmdown_ratio=args.warmdown_ratio)
    same_plan_everywhere(plan)
    dtype = str(get_compute_dtype(device)).replace("torch.", "")
    print0(describe_plan(plan, law, time.time() - t0, f"{device.type} x{world_size} {dtype}"))
    args.depth, args.device_batch_size, args.num_iterations = plan.depth, plan.device_batch_size, plan.num_iterations
    args.eval_every = plan.eval_every
    return BudgetClock(plan, active=True, warmdown_ratio=args.warmdown_ratio)


def same_plan_everywhere(plan):
    """Every rank must train the same plan (it decides from timings all ranks agreed on); a rank that did not would
    wait forever in a collective the others never reach, so a difference is a bug, refused here."""
    import torch.distributed as dist

    from nanochat.common import dist_rank_world

    if dist_rank_world()[1] > 1:
        plans = [None] * dist_rank_world()[1]
        mine = {k: v for k, v in plan_dict(plan).items() if k != "started_at"}
        dist.all_gather_object(plans, mine)
        if any(p != plans[0] for p in plans):
            raise RuntimeError(f"the ranks made different plans: {plans}")


def plan_meta(clock):
    """What a budgeted run adds to every checkpoint's meta.json."""
    return {"time_plan": plan_dict(clock.plan)} if clock.plan else {}


def val_bpb_evaluator(model, tokenizer, args, batches, device, rank, world_size):
    """The run's val bpb evaluation: at most --eval-tokens of the val split (one pass at most), at the device batch the
    training batches run at, returning (bpb, tokens, ran out of the split)."""
    from nanochat.dataloader import eval_batches
    from nanochat.loss_eval import evaluate_bpb
    from nanochat.tokenizer import get_token_bytes

    token_bytes = get_token_bytes(device=device)

    def val_bpb():
        steps = max(1, args.eval_tokens // (batches.device_batch_size * args.max_seq_len * world_size))
        loader, val = eval_batches(tokenizer, batches.device_batch_size, args.max_seq_len, "val", device, rank,
                                   world_size, source=args.data_source)
        result = evaluate_bpb(model, val, steps, token_bytes)
        loader.close()
        return result

    return val_bpb


def use_fp8(model, device):
    """--fp8: the blocks' linears run their matmuls with fp8 operands (nanochat/fp8.py), said in one line."""
    from nanochat.fp8 import convert_to_fp8, fp8_available

    converted = convert_to_fp8(model.transformer.h)
    print0(f"fp8: {converted} block linears run their matmuls with fp8 operands where the shapes allow ("
           f"{'torch._scaled_mm' if fp8_available(device) else 'emulated in fp32: for checking numerics, not speed'})")


def describe_run(args, recipe, device, world_size, batches, use_compile, num_iterations):
    """The run's one-line config (batches: the FittingBatches, whose device batch a resume may have found smaller)."""
    c, tokens = recipe.model_config, num_iterations * args.total_batch_size
    dtype = str(get_compute_dtype(device)).replace("torch.", "")
    backend = compile_backend()
    compiled = f" compiled{'' if backend == 'inductor' else f' ({backend})'}" if use_compile else ""
    return (f"base_train | {model_tag(args)} | params {recipe.num_params:,} | layers {c.n_layer} "
            f"width {c.n_embd} heads {c.n_head}/{c.n_kv_head} + {args.components or 'none (plain recipe)'} | "
            f"T {args.max_seq_len} | device {device.type} x{world_size} {dtype}{compiled} | "
            f"batch {args.total_batch_size:,} tok = {batches.device_batch_size}x{args.max_seq_len}x{world_size}x{batches.grad_accum} "
            f"accum | steps {num_iterations} ({recipe.budget}) = {tokens / 1e6:.1f}M tokens, "
            f"{tokens / recipe.scaling_params:.1f} tok/param")
