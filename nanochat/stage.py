"""
What the chat stages (mid_train, chat_sft, chat_rl) share outside their loop: their flags and the validation before
any compute (base_train's too), and a stage's start: its input checkpoint, optimizers, lrs, output dir, resuming.
"""

import math
import os

from nanochat.checkpoint_manager import (checkpoint_dir, claim_checkpoint_dir, find_latest_tag, load_meta,
                                         load_model_from_dir, refuse_to_overwrite, resolve_step)
from nanochat.common import UserError, autocast_for
from nanochat.loop import RunSettings, StartPoint, TrainingLoop, resume_from
from nanochat.presets import PRESETS, fill_from_preset, preset_help
from nanochat.recipe import REFERENCE_BATCH, SCALAR_LR, build_optimizers, config_dict, dial_lrs, optimizer_components_of

# -----------------------------------------------------------------------------
# Flags


def add_stage_flags(parser, stage, source, batch_unit, conversation_data=True):
    """
    The flags of a chat stage. stage: its name in presets.PRESETS (None defaults: the device's preset fills them after
    parsing); source: the stage it starts from by default; batch_unit: what a batch counts; conversation_data: it
    trains on a mixture of conversations (mid, SFT), with a row length and validation.
    """
    p = parser

    def preset_default(flag, default):  # (default, help suffix): None means "the preset's"
        return (None, f" {preset_help(stage, flag)}") if flag in PRESETS[stage]["cpu"] else (default, "")

    p.add_argument("--run", default="dummy", help="wandb run name ('dummy' = no wandb)")
    p.add_argument("--device-type", default="", help="cuda|mps|cpu (default: autodetect)")
    p.add_argument("-i", "--source", default=source, choices=["base", "mid", "sft", "rl"], help="checkpoint to start from")
    p.add_argument("-g", "--model-tag", default=None, help="tag of the input checkpoint, also the output's (default: latest)")
    p.add_argument("--out-tag", default=None, help="tag of this stage's checkpoints, when not the input's: lets a stage train "
                   "from a checkpoint of its own stage (e.g. chat_sft -i sft on an imported model)")
    p.add_argument("-s", "--step", type=int, default=None, help="step of the input checkpoint (default: latest)")
    p.add_argument("--seed", type=int, default=42)
    for flag, default, text in (("num_iterations", -1, "optimizer steps (-1 = one epoch of the data)"),
                                ("device_batch_size", 4, f"{batch_unit} per micro-batch"),
                                ("total_batch_size", 32, f"{batch_unit} per optimizer step"),
                                ("init_lr_frac", 1.0, "the depth dial's lrs are scaled by this")):
        default, suffix = preset_default(flag, default)
        p.add_argument(f"--{flag.replace('_', '-')}", type=float if flag == "init_lr_frac" else int, default=default,
                       help=text + suffix)
    add_optimization_flags(p, weight_decay=0.0, warmdown_ratio=0.5)
    default, suffix = preset_default("eval_every", -1)
    p.add_argument("--eval-every", type=int, default=default, help="-1 = only at the start and the end" + suffix)
    p.add_argument("--save-every", type=int, default=-1, help="-1 = only at the end (and on a stop signal)")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--resume", action="store_true", help="continue this stage's latest checkpoint")
    if conversation_data:
        p.add_argument("--max-seq-len", type=int, default=-1, help="tokens per row (-1 = the model's context)")
        p.add_argument("--mixture", default="", choices=["", "builtin", "hub", "none"],
                       help="builtin (offline) or hub data, or none: your --data alone (default: builtin when "
                       "$NANOCHAT_DATA_SOURCE is builtin or unset)")
        p.add_argument("--data", action="append", default=[], metavar="FILE[:WEIGHT]",
                       help="your conversations (JSONL: a JSON list of {role, content} messages a line), WEIGHT times "
                       "per epoch (default 1; 2.5 = each twice and a fixed half of them once more; 0.5 = a fixed half); "
                       f"repeatable. Without --val-data a file of {HELD_OUT_MIN} or more lends 1 in {HELD_OUT_EVERY} "
                       "(rounded up, chosen by content hash) to val_loss")
        p.add_argument("--val-data", action="append", default=[], metavar="FILE",
                       help="validation conversations (JSONL; repeatable): given, every --data conversation is trained on")
        p.add_argument("--identity-file", default=None, help="a JSONL file of identity conversations in place of the "
                       "built-in ones (the mixture's identity slot: once per epoch in SFT, twice in mid), none held out")
        default, suffix = preset_default("eval_steps", 8)
        p.add_argument("--eval-steps", type=int, default=default, help="validation batches per evaluation (at most one "
                       "pass of the validation conversations)" + suffix)


def add_optimization_flags(parser, weight_decay, warmdown_ratio):
    """Per-group lrs (-1: from the depth dial), Muon weight decay and the lr schedule's shape: every training script's."""
    p = parser
    for group in ("embedding", "unembedding", "matrix"):
        p.add_argument(f"--{group}-lr", type=float, default=-1.0, help="-1 = from the depth dial")
    p.add_argument("--weight-decay", type=float, default=weight_decay, help="Muon weight decay (-1 = from the depth dial)")
    p.add_argument("--warmup-ratio", type=float, default=0.0, help="fraction of steps warming the lr up linearly")
    p.add_argument("--warmdown-ratio", type=float, default=warmdown_ratio, help="fraction of steps decaying it linearly")
    p.add_argument("--final-lr-frac", type=float, default=0.0, help="lr multiplier at the last step")


# Without --val-data, a --data file of at least HELD_OUT_MIN conversations lends 1 in HELD_OUT_EVERY of them (rounded
# up) to val_loss: 5 % is the usual share, and a smaller file would give up much of its training for a val_loss of one
# or two conversations. tasks/customjson.py makes the split; the numbers are here, with the flag that states them.
HELD_OUT_EVERY = 20
HELD_OUT_MIN = 10
MAX_DATA_WEIGHT = 1000


def data_files(specs):
    """
    [(path, weight)] of --data FILE[:WEIGHT] flags; UserError for a weight that is not a number in (0, 1000]. A spec
    that names an existing file is that file at weight 1, so a path with a colon in it needs no weight to be read.
    Above 1000 an epoch is better made longer with --num-iterations than with copies (each one a mixture entry).
    """
    files = []
    for spec in specs:
        path, colon, weight = spec.rpartition(":")
        if os.path.exists(spec) or not colon:
            path, weight = spec, "1"
        if not path:
            raise UserError(f"--data {spec} names no file: give --data FILE or --data FILE:WEIGHT")
        try:
            value = float(weight)
        except ValueError:
            raise UserError(f"--data {spec}: no file is named that, and {weight!r} after the last ':' is not a weight "
                            f"(a number > 0 and <= {MAX_DATA_WEIGHT}: how many times the file's conversations enter each "
                            "epoch)") from None
        if not (0 < value <= MAX_DATA_WEIGHT):  # nan fails this too
            raise UserError(f"--data {spec}: the weight {weight} is not valid: must be > 0 and <= {MAX_DATA_WEIGHT} "
                            "(how many times the file's conversations enter each epoch; leave the file out for none)")
        files.append((path, value))
    return files


def mixture_kind(choice=""):
    """builtin (offline, the built-in world) or hub data: what the user chose, else what the pretraining source implies."""
    return choice or ("builtin" if os.environ.get("NANOCHAT_DATA_SOURCE", "builtin") == "builtin" else "hub")


def context_length(model_config, max_seq_len):
    """Tokens per row: the model's context (model_config: the input's, input_config) unless --max-seq-len asks for
    fewer."""
    context = model_config["sequence_len"]
    T = context if max_seq_len == -1 else max_seq_len
    check_flag(T <= context, "max_seq_len", T, f"must not exceed the model's context ({context})")
    return T


def check_flag(ok, flag, value, allowed):
    if not ok:
        raise UserError(f"--{flag.replace('_', '-')}={value} is not valid: {allowed}")


def validate_lrs_and_schedule(args, lr_flags):
    """The lrs (> 0, or -1 for the default: the depth dial's, or the fixed scalar lr), Muon's weight decay and the
    schedule's shape (bench quality's too)."""
    for flag in lr_flags:
        value = getattr(args, flag)
        check_flag(value == -1 or value > 0, flag, value, "must be > 0, or -1 for its default")
    check_flag(args.weight_decay == -1 or args.weight_decay >= 0, "weight_decay", args.weight_decay,
               "must be >= 0, or -1 for the dial")
    for flag in ("warmup_ratio", "warmdown_ratio", "final_lr_frac"):
        check_flag(0 <= getattr(args, flag) <= 1, flag, getattr(args, flag), "must be between 0 and 1")
    check_flag(args.warmup_ratio + args.warmdown_ratio <= 1, "warmup_ratio", args.warmup_ratio,
               f"warmup + warmdown ({args.warmup_ratio} + {args.warmdown_ratio}) must not exceed 1")


def validate_training_flags(args):
    """The checks every training script shares: lrs, schedule shape, cadences, batch sizes, checkpoint rotation."""
    for flag, value in vars(args).items():  # nan passes every comparison below, and inf breaks the step counts
        if isinstance(value, float):
            check_flag(math.isfinite(value), flag, value, "must be a finite number")
    for flag in ("device_batch_size", "total_batch_size", "keep_last"):
        check_flag(getattr(args, flag) >= 1, flag, getattr(args, flag), "must be >= 1")
    validate_lrs_and_schedule(args, ("embedding_lr", "unembedding_lr", "matrix_lr"))
    for flag in ("eval_every", "save_every"):
        value = getattr(args, flag)  # None: a time budget's plan sets it
        check_flag(value is None or value == -1 or value >= 1, flag, value, "must be >= 1, or -1 for never")


def validate_stage_flags(args, stage):
    """Fill what was not given from the device's preset, then check every flag."""
    # a time budget (the planning add-on's --time-budget, checked by the script) plans the number of steps
    fill_from_preset(args, stage, leave=("num_iterations",) if getattr(args, "time_budget", None) else ())
    validate_training_flags(args)
    check_flag(args.num_iterations is None or args.num_iterations == -1 or args.num_iterations >= 1, "num_iterations",
               args.num_iterations, "must be >= 1, or -1 for one epoch")
    check_flag(args.init_lr_frac > 0, "init_lr_frac", args.init_lr_frac, "must be > 0")
    check_flag(args.step is None or args.step >= 0, "step", args.step, "must be >= 0")
    if hasattr(args, "max_seq_len"):
        check_flag(args.max_seq_len == -1 or args.max_seq_len >= 16, "max_seq_len", args.max_seq_len, "must be >= 16, or -1")
        check_flag(args.eval_steps >= 1, "eval_steps", args.eval_steps, "must be >= 1")
        data_files(args.data)
        check_flag(args.mixture != "none" or args.data, "mixture", args.mixture,
                   "none trains on your files alone: give one or more --data FILE[:WEIGHT]")


def refuse_changed_flags(meta, args, fixed_flags, ckpt_dir, new_run="another --model-tag"):
    """Refuse a resume whose flags would change the batches, the samples or the model; say so before any compute."""
    saved = meta.get("user_config", {})
    changed = [f"--{k.replace('_', '-')} {saved[k]} -> {getattr(args, k)}" for k in fixed_flags
               if k in saved and hasattr(args, k) and saved[k] != getattr(args, k)]
    if changed:
        raise UserError(f"cannot resume {ckpt_dir} exactly with changed {', '.join(changed)}; use the checkpoint's values "
                        f"or start a new run under {new_run}")


def micro_steps(total, per_micro, world_size, unit):
    """Micro-batches per rank per optimizer step; refuses (before any compute) a split that is not exact."""
    if total % (per_micro * world_size):
        raise UserError(f"--total-batch-size={total} {unit} is not a multiple of --device-batch-size x world size = "
                        f"{per_micro} x {world_size}")
    return total // (per_micro * world_size)


# -----------------------------------------------------------------------------
# Starting a stage

# Flags a resumed chat stage must keep (those a stage lacks are ignored): they fix the input model, the data order,
# the batches and the sampled replies, so changing them breaks an exact continuation. --num-iterations may grow.
STAGE_FIXED_FLAGS = ["source", "seed", "device_batch_size", "total_batch_size", "max_seq_len", "mixture", "identity_file",
                     "data", "val_data", "task", "num_samples", "max_new_tokens", "temperature", "top_k"]


def output_dir(stage, args):
    """(input tag, the stage's checkpoint dir): under --out-tag, else under the input's tag, claimed for this run (one
    run per tag; proven writable). --resume with neither tag goes on with this stage's latest run."""
    if args.resume:  # a run of this stage goes on: its input is not read again
        out_tag = args.out_tag or args.model_tag or find_latest_tag(stage)
        tag = args.model_tag or out_tag
    else:
        tag = args.model_tag or find_latest_tag(args.source)
        out_tag = args.out_tag or tag
    ckpt_dir = checkpoint_dir(stage, out_tag)
    if not args.resume and ckpt_dir == checkpoint_dir(args.source, tag):
        raise UserError(f"-i {args.source} -g {tag} would write this run's checkpoints into {ckpt_dir}, the directory it "
                        f"starts from; give them their own with --out-tag (e.g. --out-tag={tag}-tuned)")
    claim_checkpoint_dir(ckpt_dir)
    if not args.resume:
        refuse_to_overwrite(ckpt_dir, other_dir="give this run another --out-tag")
    return tag, ckpt_dir


def stage_loop(name, args, ckpt_dir, model, tokenizer, optimizers, lrs, loader, num_iterations, start, device,
               tokens_per_step=None, callbacks=(), meta=None):
    """The TrainingLoop of a chat stage, from its flags and model. tokens_per_step: fixed (mid), or None when each step
    reports its own count to end_step (SFT, RL); callbacks: the loop's (the report, a time budget's clock); meta: what
    else goes in each checkpoint's meta.json (a time budget's plan)."""
    settings = RunSettings(name, ckpt_dir, num_iterations, vars(args).copy(), config_dict(model.config),
                           tokenizer.fingerprint(), tokens_per_step, model.estimate_flops(), args.save_every,
                           args.keep_last, args.run,
                           meta={"lrs": lrs, "optimizer_components": optimizer_components_of(optimizers), **(meta or {})})
    return TrainingLoop(settings, model, optimizers, loader, start, device, autocast_for(device), callbacks)


def stage_steps(loop, eval_every, eval_name, evaluate):
    """A chat stage's steps: loop.steps() with its one evaluation (every eval_every steps, and at the first and last),
    ending after the last step's evaluation instead of yielding a step past the last one."""
    for step in loop.steps():
        if loop.due(eval_every, at_ends=True):
            loop.evaluate(eval_name, evaluate)
        if step == loop.num_iterations:
            return
        yield step


def starting_checkpoint(args, tag, ckpt_dir):
    """(dir, step, what to do if it is empty) of the checkpoint a stage's model comes from: its own latest one on
    --resume (the input's weights would be replaced anyway, and it may be gone), else the input's."""
    if args.resume:
        return ckpt_dir, None, "drop --resume to start this stage, or check -g / --out-tag"
    return checkpoint_dir(args.source, tag), args.step, "train that stage first, or check -i / -g"


def input_config(args, tag, ckpt_dir):
    """The model config of the checkpoint start_stage loads, from its meta.json alone: the checks that need the
    model's context run before its weights load (seconds for a small model, minutes for a large one)."""
    source_dir, step, fix = starting_checkpoint(args, tag, ckpt_dir)
    return load_meta(source_dir, resolve_step(source_dir, step, fix=fix))["model_config"]


def start_stage(args, tag, ckpt_dir, device):
    """(model, tokenizer, optimizers, lrs, start): the model from the input checkpoint (or this stage's latest with
    --resume), its optimizers at the dial's lrs times --init-lr-frac with the input's Muon options, where it starts."""
    source_dir, step, fix = starting_checkpoint(args, tag, ckpt_dir)
    model, tokenizer, meta = load_model_from_dir(source_dir, device, phase="train", step=step, fix=fix)
    dial = dial_lrs(model.config.n_layer, REFERENCE_BATCH)  # the lrs the base model trained with at the reference batch
    lrs = {name: (getattr(args, name) if getattr(args, name) > 0 else dial[name] * args.init_lr_frac)
           for name in ("embedding_lr", "unembedding_lr", "matrix_lr")}
    lrs["weight_decay"] = dial["weight_decay"] if args.weight_decay < 0 else args.weight_decay
    optimizers = build_optimizers(model, **lrs, scalar_lr=SCALAR_LR * args.init_lr_frac,
                                  optimizer_components=meta.get("optimizer_components", []))
    start = StartPoint()
    if args.resume:
        start = resume_from(ckpt_dir, resolve_step(ckpt_dir), model, optimizers, config_dict(model.config),
                            tokenizer.fingerprint(), device)
        refuse_changed_flags(start.meta, args, STAGE_FIXED_FLAGS, ckpt_dir, new_run="another --out-tag")
    return model, tokenizer, optimizers, lrs, start
