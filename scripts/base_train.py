"""
Pretrain a base GPT. One dial, --depth, sets the model size and every other hyperparameter.

Examples:
  python -m scripts.base_train --depth=4 --max-seq-len=256 --device-batch-size=8 --total-batch-size=2048
  torchrun --standalone --nproc_per_node=8 -m scripts.base_train -- --depth=20 --run=d20
  python -m scripts.base_train --time-budget=20m     # the depth and tokens that do best in 20 minutes here
Resume after a crash or a stop with the same command plus --resume (or --resume-from-step=N); a larger
--num-iterations on resume continues training (the lr schedule is recomputed for the new length). A time-budgeted
run's plan (nanochat.time_budget) is saved with its checkpoints, and a resume follows it.
"""

import argparse
import time

from nanochat.checkpoint_manager import checkpoint_dir, claim_checkpoint_dir, refuse_later_checkpoints, refuse_to_overwrite
from nanochat.common import (UserError, autocast_for, compile_choice, compile_model, compute_cleanup, compute_init,
                             keep_freed_memory_in_process, print0, resolve_device_type, run_main, seed_everything)
from nanochat.dataloader import DataLoader
from nanochat.gpt import build_model
from nanochat.loop import RunSettings, StartPoint, TrainingLoop, resume_from
from nanochat.core_eval import evaluate_core, resolve_eval_bundle
from nanochat.memory_fallback import FittingBatches
from nanochat.presets import fill_from_preset, preset_help
from nanochat.pretrain import (RESUME_FIXED_FLAGS, check_budget_flags, check_shape, describe_run, model_tag, plan_budget, plan_meta,
                               recipe_from_flags, resolve_components, resume_meta, use_fp8, val_bpb_evaluator, validate_args)
from nanochat.report import get_report
from nanochat.stage import add_optimization_flags, refuse_changed_flags
from nanochat.tokenizer import get_tokenizer
from nanochat.training import (DEFAULT_COMPONENTS, build_optimizers, config_dict, grad_accum_steps, greedy_samples,
                               lr_multiplier, muon_momentum, split_components, train_step)

SAMPLE_PROMPTS = ["The capital of", "The main language of", "12 + 35 =", "The word river is spelled", "The opposite of hot is",
                  "If 5*x + 3 = 13, then x is"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Pretrain a base GPT; --depth sets everything else.")
    p.add_argument("--run", default="dummy", help="wandb run name ('dummy' = no wandb)")
    p.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    p.add_argument("--model-tag", default="", help="checkpoint tag (default: d<depth>, or budget-<time> with --time-budget)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--data-source", default=None, help="data source (default: $NANOCHAT_DATA_SOURCE or builtin)")
    # model
    p.add_argument("--depth", type=int, default=None,
                   help=f"number of layers; sets width, heads, lrs, weight decay, budget {preset_help('base_train', 'depth')}")
    p.add_argument("--aspect-ratio", type=int, default=None, help="n_embd = aspect_ratio * depth, rounded to the head dim "
                   "(default 64; with --time-budget, the scaling law's)")
    p.add_argument("--head-dim", type=int, default=None, help="default 128; with --time-budget, the scaling law's")
    p.add_argument("--num-kv-heads", type=int, default=0, help="GQA key/value heads (0 = as many as query heads)")
    p.add_argument("--max-seq-len", type=int, default=None, help=preset_help("base_train", "max_seq_len"))
    p.add_argument("--components", default=None, help="comma-separated optional components of the model (value_embeds, "
                   "residual_scalars, smear, backout, sliding_window) and of Muon (normuon, cautious_wd, polar_express), or 'none' for the "
                   f"plain recipe (default: {DEFAULT_COMPONENTS}; a resume keeps the checkpoint's); docs/pretraining.md 'Recipe components'")
    p.add_argument("--fp8", type=int, default=0, choices=[0, 1], help="1: the blocks' matmuls in fp8 with per-tensor scales "
                   "(torch._scaled_mm on H100/Ada GPUs; emulated in fp32 elsewhere, CPU included: for the numerics, not for "
                   "speed); docs/pretraining.md 'FP8 matmuls'")
    # budget: --time-budget, or the first of num-iterations > 0, target-flops > 0, target-param-data-ratio > 0
    p.add_argument("--time-budget", default=None, help="wall time for the whole stage (90s, 20m, 4h): measures this "
                   "machine and picks the depth (unless --depth) and the tokens the scaling law predicts do best in it; "
                   "docs/time_budget.md")
    p.add_argument("--scaling-law", default="auto", help="--time-budget's law: auto, a shipped one (gpu-reference, "
                   "cpu-builtin, cpu-brown) or a miniseries' scaling_law.json")
    p.add_argument("--num-iterations", type=int, default=None, help="optimizer steps (-1 = from the budget flags below; "
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
    p.add_argument("--dry-run", action="store_true", help="with --time-budget: measure, print the plan, train nothing")
    args = p.parse_args(argv)
    if args.time_budget is not None:
        check_budget_flags(args)  # the depth (unless given), the steps and the eval cadence come from the plan
    elif args.dry_run:
        raise UserError("--dry-run shows a --time-budget's plan: give --time-budget")
    elif args.num_iterations is None and (args.resume or args.resume_from_step >= 0 or args.target_flops > 0
                                          or args.target_param_data_ratio is not None):
        args.num_iterations = -1  # a resume finishes its own run; a budget given is the budget
    if args.target_param_data_ratio is None:
        args.target_param_data_ratio = 20.0
    fill_from_preset(args, "base_train", leave=("depth", "num_iterations", "eval_every") if args.time_budget else ())
    if not args.time_budget:  # with one, the scaling law's shape (pretrain.plan_budget)
        args.aspect_ratio = 64 if args.aspect_ratio is None else args.aspect_ratio
        args.head_dim = 128 if args.head_dim is None else args.head_dim
    validate_args(args)
    return args


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
    grad_accum_steps(args.total_batch_size, args.device_batch_size, args.max_seq_len, world_size)  # an exact split
    check_shape(args, tokenizer.get_vocab_size())  # heads and head dim, where the flags fix them
    claim_checkpoint_dir(ckpt_dir)  # one run per model tag; also proves the directory is writable
    get_report()  # proves the report directory is writable, before any training
    resume_step = meta["step"] if meta is not None else refuse_to_overwrite(ckpt_dir)  # None: a new run
    if meta is not None:
        refuse_later_checkpoints(ckpt_dir, resume_step)
    budget = plan_budget(args, meta, ckpt_dir, tokenizer.get_vocab_size(), device, world_size, autocast)
    if args.dry_run:
        return compute_cleanup()
    user_config = vars(args).copy()
    recipe = recipe_from_flags(args, tokenizer.get_vocab_size())
    recipe.budget = "--time-budget" if budget.plan else recipe.budget
    # fail now, not hours in, if the CORE bundle cannot be had (rank 0 downloads it, the others wait)
    core_bundle_dir = resolve_eval_bundle(args.eval_bundle, all_ranks=True) if args.core_metric_every > 0 else None
    seed_everything(args.seed)

    model = build_model(recipe.model_config, device)
    if args.fp8:  # before compile, and before the optimizers (the same Parameters either way)
        use_fp8(model, device)
    model_config, lrs = config_dict(recipe.model_config), recipe.lrs()
    use_compile = compile_choice(args.compile, device)
    train_model = compile_model(model) if use_compile else model
    optimizers = build_optimizers(model, **lrs, optimizer_components=split_components(args.components)[1])
    start, num_iterations = StartPoint(), recipe.num_iterations
    if resume_step is not None:
        start = resume_from(ckpt_dir, resume_step, model, optimizers, model_config, tokenizer.fingerprint(), device)
        refuse_changed_flags(start.meta, args, RESUME_FIXED_FLAGS, ckpt_dir)
        if args.num_iterations == -1:  # no explicit budget: finish the run the checkpoint belongs to
            num_iterations = start.meta["num_iterations"]
        elif num_iterations != start.meta["num_iterations"]:
            print0(f"resume: --num-iterations {start.meta['num_iterations']} -> {num_iterations}; lr schedule recomputed, "
                   "lrs kept from the checkpoint")
        lrs = start.meta.get("lrs", lrs)  # the optimizers resumed with the checkpoint's lrs, whatever the new length
    # the device batch may shrink in the first steps if it does not fit (memory_fallback); a resume keeps what it found
    device_batch = min(args.device_batch_size, (start.meta or {}).get("device_batch_size", args.device_batch_size))
    batches = FittingBatches(lambda b, state: DataLoader(tokenizer, b, args.max_seq_len, split="train", device=device,
                                                         rank=rank, world_size=world_size, source=args.data_source,
                                                         resume_state=state),
                             device_batch, args.total_batch_size, args.max_seq_len, world_size, args.depth, device,
                             resume_state=start.loader_state)
    val_bpb = val_bpb_evaluator(model, tokenizer, args, batches, device, rank, world_size)

    settings = RunSettings("base_train", ckpt_dir, num_iterations, user_config, model_config, tokenizer.fingerprint(),
                           args.total_batch_size, recipe.flops_per_token, args.save_every, args.keep_last, args.run,
                           meta={"lrs": lrs, "device_batch_size": device_batch, "max_seq_len": args.max_seq_len,
                                 "optimizer_components": split_components(args.components)[1], **plan_meta(budget)})
    loop = TrainingLoop(settings, model, optimizers, batches, start, device, autocast)
    loop.announce(describe_run(args, recipe, device, world_size, batches, use_compile, num_iterations))

    for step in loop.steps():
        if loop.due(args.eval_every):
            loop.evaluate("val_bpb", val_bpb)
        if loop.due(args.core_metric_every, at_zero=False):
            loop.evaluate("core_metric", lambda: evaluate_core(model, tokenizer, device, args.core_metric_max_per_task,
                                                               bundle_dir=core_bundle_dir)["core_metric"])
        if rank == 0 and loop.due(args.sample_every, at_zero=False):
            model.eval()
            with autocast:
                for text in greedy_samples(model, tokenizer, SAMPLE_PROMPTS):
                    print0(f"  sample: {text!r}")
            model.train()
        if step == loop.num_iterations:
            break
        # -- one optimizer step on the mean loss of grad_accum micro-batches --
        t0 = time.perf_counter()
        lrm = lr_multiplier(step, loop.num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        loss = batches.step(lambda micro_batches, oom_guard: train_step(
            train_model, optimizers, micro_batches, lambda m, xy: m(*xy), lrm, muon_momentum(step), autocast,
            args.grad_clip, oom_guard=oom_guard))
        loop.end_step(loss, t0, lrm=lrm)
        loop.meta["device_batch_size"] = batches.device_batch_size
        if budget.due(loop.step):  # once, a tenth of the way in: the steps that fit in the rest of the time budget
            budget.calibrate(loop)

    batches.close()
    budget.finish(loop)
    loop.finish("Base model training", [
        {"Number of parameters": recipe.num_params, "FLOPs per token": f"{recipe.flops_per_token:e}",
         "Calculated number of iterations": loop.num_iterations,
         "Number of training tokens": loop.num_iterations * args.total_batch_size, "DDP world size": world_size, **lrs},
        {"CORE metric": loop.last.get("core_metric"), "Dataloader crop fraction": batches.crop_fraction(),
         **budget.report()},
    ])
    compute_cleanup()


if __name__ == "__main__":
    run_main(main)
