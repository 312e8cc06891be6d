"""
Pretrain a base GPT. One dial, --depth, sets the model size and every other hyperparameter.

Examples:
  python -m scripts.base_train --depth=4 --max-seq-len=256 --device-batch-size=8 --total-batch-size=2048
  torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --depth=20 --run=d20
  python -m scripts.base_train --time-budget=20m     # the depth and tokens that do best in 20 minutes here
  NANOCHAT_GPU_MEMORY=24GiB python -m scripts.base_train --depth=20   # a device batch (and checkpointing) for 24 GiB
Resume after a crash or a stop with the same command plus --resume (or --resume-from-step=N); a larger
--num-iterations on resume continues training (the lr schedule is recomputed for the new length). A time-budgeted
run's plan is saved with its checkpoints, and a resume follows it. On a GPU (or with NANOCHAT_GPU_MEMORY /
--gpu-memory) a device batch left unset is the largest the memory model predicts to fit, with activation checkpointing
where one row does not fit without. Both are the planning add-on's (nanochat/planning/pretraining.py): one call
before the model is built, which returns the flags it chose.

main() is the run, and its loop the training: each step's micro-batches, their forward and backward passes and the
optimizers (loop.train_step), the log line. What it calls to get there (the flags, the pieces of the run) follows it.
"""

import argparse
import time

from nanochat.checkpoint_manager import (checkpoint_dir, claim_checkpoint_dir, load_meta, refuse_later_checkpoints,
                                         refuse_to_overwrite, resolve_step)
from nanochat.common import (UserError, autocast_for, compile_backend, compile_choice, compile_model, compute_cleanup,
                             compute_init, get_compute_dtype, keep_freed_memory_in_process, print0, resolve_device_type,
                             run_main, seed_everything)
from nanochat.core_eval import evaluate_core, resolve_eval_bundle
from nanochat.dataloader import DataLoader
from nanochat.gpt import build_model
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.loop import FittingBatches, RunSettings, StartPoint, TrainingLoop, lm_loss, resume_from, train_step
from nanochat.optim import compile_muon_updates, lr_multiplier, muon_momentum
from nanochat.planning.pretraining import add_planning_flags, check_planning_flags, plan_base_train
from nanochat.planning.time_budget import duration_label
from nanochat.presets import fill_from_preset, preset_help
from nanochat.recipe import (DEFAULT_COMPONENTS, build_optimizers, canonical_components, config_dict, depth_recipe,
                             greedy_samples, model_config_for_depth, split_components)
from nanochat.report import TrainingReport, get_report
from nanochat.stage import add_optimization_flags, check_flag, refuse_changed_flags, validate_training_flags
from nanochat.tokenizer import get_tokenizer

SAMPLE_PROMPTS = ["The capital of", "The main language of", "12 + 35 =", "The word river is spelled", "The opposite of hot is",
                  "If 5*x + 3 = 13, then x is"]

# Flags a resumed run must keep: they fix the batches, the optimizer shards or the model, so changing them breaks exactness.
RESUME_FIXED_FLAGS = ["depth", "aspect_ratio", "head_dim", "num_kv_heads", "max_seq_len", "device_batch_size",
                      "total_batch_size", "data_source", "seed", "components", "fp8"]


def main(argv=None):
    args = parse_args(argv)
    ckpt_dir = checkpoint_dir("base", model_tag(args))
    meta = resume_meta(args, ckpt_dir)
    args.components = resolve_components(args, meta, ckpt_dir)
    device_type = resolve_device_type(args.device_type)
    tokenizer = get_tokenizer()
    _, rank, _, world_size, device = compute_init(device_type)
    keep_freed_memory_in_process()
    autocast = autocast_for(device)
    check_shape(args, tokenizer.get_vocab_size())  # heads and head dim, where the flags fix them
    claim_checkpoint_dir(ckpt_dir)  # one run per model tag; also proves the directory is writable
    get_report()  # proves the report directory is writable, before any training
    resume_step = meta["step"] if meta is not None else refuse_to_overwrite(ckpt_dir)  # None: a new run
    if meta is not None:
        refuse_later_checkpoints(ckpt_dir, resume_step)
    # the planning add-on: a time budget's depth and steps, the card's device batch and checkpointing (flags in, out)
    plan = plan_base_train(args, meta, ckpt_dir, tokenizer.get_vocab_size(), device, world_size, autocast)
    vars(args).update(plan.flags)
    if args.dry_run:
        return compute_cleanup()
    user_config = vars(args).copy()
    recipe = recipe_from_flags(args, tokenizer.get_vocab_size())
    recipe.steps_from = "--time-budget" if plan.clock.plan else recipe.steps_from
    # fail now, not hours in, if the CORE bundle cannot be had (rank 0 downloads it, the others wait)
    core_bundle_dir = resolve_eval_bundle(args.eval_bundle, all_ranks=True) if args.core_metric_every > 0 else None
    seed_everything(args.seed)

    model = build_model(recipe.model_config, device)
    use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
    model.checkpoint_activations = args.checkpoint_activations == "1"
    if args.fp8:  # before compile, and before the optimizers (the same Parameters either way)
        use_fp8(model, device)
    model_config, lrs = config_dict(recipe.model_config), recipe.lrs()
    use_compile = compile_choice(args.compile, device)
    train_model = compile_model(model) if use_compile else model
    optimizers = build_optimizers(model, **lrs, optimizer_components=split_components(args.components)[1])
    if use_compile:  # Muon's update too: one compiled graph per shape group (nanochat.optim.compile_muon_updates)
        compile_muon_updates(optimizers)
    start, num_iterations, lrs = start_point(args, ckpt_dir, resume_step, model, optimizers, model_config, lrs,
                                             recipe.num_iterations, tokenizer, device)
    # the device batch halves in the first steps if a step does not fit (loop.FittingBatches); a resume keeps what fit
    device_batch = min(args.device_batch_size, (start.meta or {}).get("device_batch_size", args.device_batch_size))
    checkpoint_meta = {"lrs": lrs, "device_batch_size": device_batch, "max_seq_len": args.max_seq_len,
                       "optimizer_components": split_components(args.components)[1], **plan.checkpoint_meta()}
    batches = FittingBatches(lambda b, state: DataLoader(tokenizer, b, args.max_seq_len, split="train", device=device,
                                                         rank=rank, world_size=world_size, source=args.data_source,
                                                         resume_state=state),
                             device_batch, args.total_batch_size, args.max_seq_len, world_size, args.depth, device,
                             resume_state=start.loader_state, predicted_peak=plan.predicted_peak,
                             checkpoint_meta=checkpoint_meta)
    val_bpb = val_bpb_evaluator(model, tokenizer, args, batches, device, rank, world_size)

    settings = RunSettings("base_train", ckpt_dir, num_iterations, user_config, model_config, tokenizer.fingerprint(),
                           args.total_batch_size, recipe.flops_per_token, args.save_every, args.keep_last, args.run,
                           meta=checkpoint_meta)
    loop = TrainingLoop(settings, model, optimizers, batches, start, device, autocast,
                        callbacks=[TrainingReport(), plan.clock])  # the report's curve; the budget's calibrations
    loop.announce(describe_run(args, recipe, device, world_size, batches, use_compile, num_iterations))

    for step in loop.steps():  # a checkpoint is written at the top of a step that is due one
        if loop.due(args.eval_every):
            loop.evaluate("val_bpb", val_bpb)
        if loop.due(args.core_metric_every, at_zero=False):
            loop.evaluate("core_metric", lambda: evaluate_core(model, tokenizer, device, args.core_metric_max_per_task,
                                                               bundle_dir=core_bundle_dir)["core_metric"])
        if rank == 0 and loop.due(args.sample_every, at_zero=False):
            print_samples(model, tokenizer, autocast)
        if step == loop.num_iterations:
            break
        # one optimizer step: this rank's micro-batches, forward and backward of each, then Muon and AdamW (in the
        # first steps taken again at half the device batch if some rank runs out of memory: FittingBatches)
        t0 = time.perf_counter()
        lrm = lr_multiplier(step, loop.num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        loss = train_step(train_model, optimizers, batches.next_step(), lm_loss, lrm, muon_momentum(step), autocast,
                          args.grad_clip, fitting=batches)
        loop.end_step(loss, t0, lrm=lrm)  # the progress line and logs

    batches.close()
    plan.finish(loop, batches.device_batch_size)
    loop.finish("Base model training", report_data(args, recipe, loop, lrs, batches, plan.clock, world_size))
    compute_cleanup()


# -----------------------------------------------------------------------------
# The flags


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Pretrain a base GPT; --depth sets everything else.")
    p.add_argument("--run", default="dummy", help="wandb run name ('dummy' = no wandb)")
    p.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    p.add_argument("--model-tag", default="", help="checkpoint tag (default: d<depth>, or budget-<time> with --time-budget)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data-source", default=None, help="data source (default: $NANOCHAT_DATA_SOURCE or builtin)")
    # model
    p.add_argument("--depth", type=int, default=None,
                   help=f"number of layers; sets width, heads, lrs, weight decay, steps {preset_help('base_train', 'depth')}")
    p.add_argument("--aspect-ratio", type=int, default=None, help="n_embd = aspect_ratio * depth, rounded to the head dim "
                   "(default 64; with --time-budget, the scaling law's)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128; with --time-budget, the scaling law's")
    p.add_argument("--num-kv-heads", type=int, default=0, help="GQA key/value heads (0 = as many as query heads)")
    p.add_argument("--max-seq-len", type=int, default=None, help=preset_help("base_train", "max_seq_len"))
    p.add_argument("--components", default=None, help="comma-separated optional components of the model (value_embeds, "
                   "residual_scalars, smear, backout, sliding_window) and of Muon (normuon, cautious_wd, polar_express, muoneq, muon_plus), or 'none' for the "
                   f"plain recipe (default: {DEFAULT_COMPONENTS}; a resume keeps the checkpoint's); docs/pretraining.md 'Recipe components'")
    p.add_argument("--fp8", type=int, default=0, choices=[0, 1], help="1: the blocks' and lm_head's matmuls in fp8 with per-tensor scales "
                   "(torch._scaled_mm on H100/Ada GPUs; emulated in fp32 elsewhere, CPU included: for the numerics, not for "
                   "speed); docs/pretraining.md 'FP8 matmuls'")
    # how long: the first of num-iterations > 0, target-flops > 0, target-param-data-ratio > 0; or --time-budget
    p.add_argument("--num-iterations", type=int, default=None, help="optimizer steps (-1 = from the flags below; "
                   "default: from them on a GPU or when one is given, else 700 on a CPU)")
    p.add_argument("--target-flops", type=float, default=-1.0)
    p.add_argument("--target-param-data-ratio", type=float, default=None, help="training tokens per parameter (default 20)")
    # batch
    p.add_argument("--device-batch-size", type=int, default=None, help=preset_help("base_train", "device_batch_size"))
    p.add_argument("--total-batch-size", type=int, default=None,
                   help=f"tokens per optimizer step {preset_help('base_train', 'total_batch_size')}")
    # optimization
    add_optimization_flags(p, weight_decay=-1.0, warmdown_ratio=0.4)
    p.add_argument("--lr-batch-exponent", type=float, default=0.0, help="lrs scale as (total_batch/2^19)^this")
    p.add_argument("--short-run-lrs", type=int, default=1, choices=[0, 1],
                   help="1: a run under 700 steps trains at up to 2x the dial's lrs (docs/pretraining.md); 0: the dial's lrs at any length")
    p.add_argument("--grad-clip", type=float, default=0.0, help="max grad norm (0 = off)")
    # evaluation and checkpoints
    p.add_argument("--eval-every", type=int, default=None,
                   help=f"val bpb every N steps, -1 = never {preset_help('base_train', 'eval_every')}")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help=f"at most, one pass of the val split {preset_help('base_train', 'eval_tokens')}")
    p.add_argument("--core-metric-every", type=int, default=None,
                   help=f"-1 = never {preset_help('base_train', 'core_metric_every')}")
    p.add_argument("--core-metric-max-per-task", type=int, default=500)
    p.add_argument("--eval-bundle", default="dclm", help="CORE bundle: dclm (downloaded), builtin (offline), or a path")
    p.add_argument("--sample-every", type=int, default=None, help=f"-1 = never {preset_help('base_train', 'sample_every')}")
    p.add_argument("--save-every", type=int, default=-1, help="-1 = only at the end (and on a stop signal)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep (the newest is never deleted)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of --model-tag")
    p.add_argument("--resume-from-step", type=int, default=-1)
    p.add_argument("--compile", default="auto", choices=["auto", "0", "1"], help="torch.compile (auto: on for CUDA)")
    add_planning_flags(p)  # --time-budget, --scaling-law, --gpu-memory, --checkpoint-activations, --dry-run
    args = p.parse_args(argv)
    check_planning_flags(args)
    if args.time_budget is None and args.num_iterations is None and (
            args.resume or args.resume_from_step >= 0 or args.target_flops > 0 or args.target_param_data_ratio is not None):
        args.num_iterations = -1  # a resume finishes its own run; --target-flops or a tokens-per-parameter ratio sets the steps
    if args.target_param_data_ratio is None:
        args.target_param_data_ratio = 20.0
    fill_from_preset(args, "base_train", leave=("depth", "num_iterations", "eval_every") if args.time_budget else ())
    if not args.time_budget:  # with one, the scaling law's shape (the planning add-on's)
        args.aspect_ratio = 64 if args.aspect_ratio is None else args.aspect_ratio
        args.head_dim = 128 if args.head_dim is None else args.head_dim
    validate_args(args)
    return args


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
    """The depth dial's whole run, with every lr, decay and length flag the user gave winning over it."""
    return depth_recipe(args.depth, vocab_size, args.max_seq_len, args.total_batch_size, args.aspect_ratio, args.head_dim,
                        args.num_kv_heads or None, args.lr_batch_exponent, embedding_lr=max(args.embedding_lr, 0),
                        unembedding_lr=max(args.unembedding_lr, 0), matrix_lr=max(args.matrix_lr, 0),
                        weight_decay=None if args.weight_decay < 0 else args.weight_decay,
                        num_iterations=max(args.num_iterations, 0), target_flops=max(args.target_flops, 0),
                        target_param_data_ratio=max(args.target_param_data_ratio or 0, 0),
                        short_run_lrs=bool(args.short_run_lrs), components=split_components(args.components)[0])


# -----------------------------------------------------------------------------
# Pieces of the run


def start_point(args, ckpt_dir, resume_step, model, optimizers, model_config, lrs, num_iterations, tokenizer, device):
    """(where the run starts, its number of steps, its lrs): a new run's, or the checkpoint's it resumes, loaded into the
    model and the optimizers. A resume finishes its checkpoint's run unless --num-iterations asks for another length (the
    lr schedule is then recomputed for it); the lrs stay the checkpoint's either way."""
    if resume_step is None:
        return StartPoint(), num_iterations, lrs
    start = resume_from(ckpt_dir, resume_step, model, optimizers, model_config, tokenizer.fingerprint(), device)
    refuse_changed_flags(start.meta, args, RESUME_FIXED_FLAGS, ckpt_dir)
    if args.num_iterations == -1:  # no length given: finish the run the checkpoint belongs to
        num_iterations = start.meta["num_iterations"]
    elif num_iterations != start.meta["num_iterations"]:
        print0(f"resume: --num-iterations {start.meta['num_iterations']} -> {num_iterations}; lr schedule recomputed, "
               "lrs kept from the checkpoint")
    return start, num_iterations, start.meta.get("lrs", lrs)


def print_samples(model, tokenizer, autocast):
    """Greedy continuations of SAMPLE_PROMPTS, for a look at what the model has learned so far."""
    model.eval()
    with autocast:
        for text in greedy_samples(model, tokenizer, SAMPLE_PROMPTS):
            print0(f"  sample: {text!r}")
    model.train()


def report_data(args, recipe, loop, lrs, batches, clock, world_size):
    """The run's lines in the report card's base training section, before the loop's own."""
    return [{"Number of parameters": recipe.num_params, "FLOPs per token": f"{recipe.flops_per_token:e}",
             "Calculated number of iterations": loop.num_iterations,
             "Number of training tokens": loop.num_iterations * args.total_batch_size, "DDP world size": world_size,
             **lrs},
            {"CORE metric": loop.last.get("core_metric"), "Dataloader crop fraction": batches.crop_fraction(),
             **clock.report()}]


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
    """--fp8: the blocks' linears and lm_head run their matmuls with fp8 operands (nanochat/kernels/fp8.py), said in
    one line."""
    from nanochat.kernels.fp8 import convert_to_fp8, fp8_available

    converted = convert_to_fp8(model)
    print0(f"fp8: {converted} linears (the blocks' and lm_head) run their matmuls with fp8 operands where the shapes "
           f"allow ({'torch._scaled_mm' if fp8_available(device) else 'emulated in fp32: for checking numerics, not speed'})")


def describe_run(args, recipe, device, world_size, batches, use_compile, num_iterations):
    """The run's one-line config (batches: the FittingBatches, whose device batch a resume may have found smaller)."""
    c, tokens = recipe.model_config, num_iterations * args.total_batch_size
    dtype = str(get_compute_dtype(device)).replace("torch.", "")
    backend = compile_backend()
    compiled = f" compiled{'' if backend == 'inductor' else f' ({backend})'}" if use_compile else ""
    compiled += " activation checkpointing" if args.checkpoint_activations == "1" else ""
    return (f"base_train | {model_tag(args)} | params {recipe.num_params:,} | layers {c.n_layer} "
            f"width {c.n_embd} heads {c.n_head}/{c.n_kv_head} + {args.components or 'none (plain recipe)'} | "
            f"T {args.max_seq_len} | device {device.type} x{world_size} {dtype}{compiled} | "
            f"batch {args.total_batch_size:,} tok = {batches.device_batch_size}x{args.max_seq_len}x{world_size}x{batches.grad_accum} "
            f"accum | steps {num_iterations} ({recipe.steps_from}) = {tokens / 1e6:.1f}M tokens, "
            f"{tokens / recipe.scaling_params:.1f} tok/param")


if __name__ == "__main__":
    run_main(main)
