"""
Mid-training: teach a base model the conversation format, multiple choice and tool use, by training on
conversations packed into rows like pretraining text (loss on every token). Saves to mid_checkpoints/.

  python -m scripts.mid_train                                   # from the latest base checkpoint
  torchrun --standalone --nproc_per_node=8 -m scripts.mid_train -- --mixture=hub --run=mid
The built-in mixture (offline, the CPU preset) is conversations about the built-in world; the hub one is
SmolTalk, MMLU auxiliary_train, GSM8K, identity and spelling (downloaded on first use).
"""

import argparse
import time

from nanochat.chat_data import PackedConversations
from nanochat.common import autocast_for, compute_cleanup, compute_init, run_main, seed_everything
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.loop import train_step
from nanochat.loss_eval import evaluate_loss
from nanochat.optim import lr_multiplier, muon_momentum
from nanochat.planning.time_budget import add_time_budget_flag, check_time_budget_flag, plan_chat_stage
from nanochat.report import TrainingReport
from nanochat.stage import (add_stage_flags, context_length, data_files, input_config, micro_steps, mixture_kind,
                            output_dir, stage_loop, stage_steps, start_stage, validate_stage_flags)
from nanochat.tokenizer import get_tokenizer
from tasks import get_task
from tasks.customjson import OwnData


def mixtures(kind, identity_file=None, data=(), val_data=()):
    """Mid-training's (train mixture, validation mixture, OwnData): `kind` builtin or hub, which the files of --data
    (data: [(path, weight)]) join, or none, those files alone; validation on --val-data's paths where given. Identity
    conversations (--identity-file's, else the built-in ones) enter twice."""
    own = OwnData(data, val_data, identity_file)
    identity = own.identity([get_task("Identity", "sft")] if kind != "none" else [])
    if kind == "builtin":
        train = [get_task("WorldQA", "sft"), *identity, *identity, get_task("Arithmetic", "train"),
                 get_task("SpellingBee", "train"), get_task("SimpleSpelling", "train")]
        val = [get_task("WorldQA", "sft", step=50), get_task("Arithmetic", "test", stop=200),
               get_task("SpellingBee", "test", stop=100)]
    elif kind == "hub":
        train = [get_task("SmolTalk", "train"), get_task("MMLU-aux"), get_task("GSM8K", "train"), *identity, *identity,
                 get_task("SpellingBee", "train"), get_task("SimpleSpelling", "train")]
        val = [get_task("SmolTalk", "test", stop=2000), get_task("MMLU", "test", step=20), get_task("GSM8K", "test", stop=200)]
    else:
        train, val = [*identity, *identity], []
    return own.mixtures(train, val, train_seed=1, val_seed=2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Mid-train a base model on packed conversations.")
    add_stage_flags(p, "mid_train", source="base", batch_unit="tokens")
    add_time_budget_flag(p)
    args = p.parse_args(argv)
    check_time_budget_flag(args)
    validate_stage_flags(args, "mid_train")
    return args


def main(argv=None):
    args = parse_args(argv)
    kind = mixture_kind(args.mixture)
    # fails now, not after loading, if data is missing or a line of the user's is bad
    train_mix, val_mix, own = mixtures(kind, args.identity_file, data_files(args.data), args.val_data)
    tag, ckpt_dir = output_dir("mid", args)
    _, rank, _, world_size, device = compute_init(args.device_type)
    T = context_length(input_config(args, tag, ckpt_dir), args.max_seq_len)  # checked before the model loads
    own.check_rows(get_tokenizer(), T + 1, f"with --max-seq-len={T}")
    grad_accum = micro_steps(args.total_batch_size, args.device_batch_size * T, world_size, "tokens")
    seed_everything(args.seed)
    model, tokenizer, optimizers, lrs, start = start_stage(args, tag, ckpt_dir, device)
    use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
    autocast = autocast_for(device)
    loader = PackedConversations(train_mix, tokenizer, args.device_batch_size, T, grad_accum, rank, world_size, device,
                                 resume_state=start.loader_state)
    clock = plan_chat_stage(args, start, model, device, world_size, args.total_batch_size,  # sets the steps, if given
                          args.eval_steps * args.device_batch_size * T * world_size, "val_loss")
    num_iterations = args.num_iterations
    if num_iterations == -1:  # one epoch: the mixture's tokens over the tokens of a step (packing pads a little)
        tokens = sum(len(loader.stream.render(i)[0]) for i in range(train_mix.num_examples()))
        num_iterations = max(1, -(-tokens // args.total_batch_size))

    def val_loss():  # per token of held-out packed conversations
        batches = PackedConversations(val_mix, tokenizer, args.device_batch_size, T, 1, rank, world_size, device,
                                      single_pass=True)
        return evaluate_loss(model, batches, args.eval_steps)

    loop = stage_loop("mid_train", args, ckpt_dir, model, tokenizer, optimizers, lrs, loader, num_iterations, start, device,
                      tokens_per_step=args.total_batch_size, callbacks=[TrainingReport(), clock],
                      meta=clock.checkpoint_meta())
    loop.announce(f"mid_train | {tag} from {args.source} | mixture {kind}: {train_mix.num_examples():,} conversations "
                  f"({train_mix.name}) | rows of {T} tokens, {args.device_batch_size}x{world_size}x{grad_accum} per step | "
                  f"steps {num_iterations}" + (f" | your data: {own.describe()}" if own.notes else ""))

    for step in stage_steps(loop, args.eval_every, "val_loss", val_loss):  # evaluates at both ends too
        t0 = time.perf_counter()
        lrm = lr_multiplier(step, loop.num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        loss = train_step(model, optimizers, next(loader), lambda m, xy: m(*xy), lrm, muon_momentum(step), autocast)
        loop.end_step(loss, t0, lrm=lrm)

    clock.finish(loop)
    loop.finish("Midtraining", [{"Mixture": kind, "Your data": own.describe() or "-",
                                 "Conversations in the mixture": train_mix.num_examples(),
                                 "Epochs seen": loader.stream.epoch, "Padding fraction": loader.padding_fraction(),
                                 "DDP world size": world_size, **lrs, **clock.report()}])
    compute_cleanup()


if __name__ == "__main__":
    run_main(main)
