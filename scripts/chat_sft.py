"""
Supervised fine-tuning: teach the model to answer, by training only on what the assistant writes (its
text, its tool calls, <|assistant_end|>), one conversation per row. Saves to chatsft_checkpoints/.

  python -m scripts.chat_sft                      # from the latest mid checkpoint
  python -m scripts.chat_sft -i base              # straight from a base model
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_sft -- --mixture=hub --run=sft
The loss of a step is the mean over every supervised token of the step, on every rank: gradient
accumulation and the number of ranks do not change the update, and a micro-batch with nothing to learn
adds zero (never NaN).
"""

import argparse
import time

import torch

from nanochat.chat_data import ConversationBatches
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
    """(train mixture, validation mixture, the user's files: OwnData) of a kind: builtin, hub, or none (the user's files
    alone). data: [(path, weight)] of --data, val_data: --val-data's paths; identity conversations come from a JSONL
    file if given."""
    own = OwnData(data, val_data, identity_file)
    identity = own.identity([get_task("Identity", "sft")] if kind != "none" else [])
    if kind == "builtin":
        train = [get_task("WorldQA", "sft"), *identity, get_task("Arithmetic", "train"), get_task("SpellingBee", "train"),
                 get_task("SimpleSpelling", "train")]
        val = [get_task("WorldQA", "sft", step=50), get_task("Arithmetic", "test", stop=100)]
    elif kind == "hub":
        train = [get_task("ARC-Easy", "train"), get_task("ARC-Challenge", "train"), get_task("GSM8K", "train"),
                 get_task("SmolTalk", "train", stop=10_000), *identity, get_task("SpellingBee", "train", stop=300),
                 get_task("SimpleSpelling", "train", stop=300)]
        val = [get_task("SmolTalk", "test", stop=1000)]
    else:
        train, val = identity, []
    return own.mixtures(train, val, train_seed=3, val_seed=4)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Supervised fine-tuning on conversations (loss on the assistant's tokens).")
    add_stage_flags(p, "chat_sft", source="mid", batch_unit="conversations")
    add_time_budget_flag(p)
    args = p.parse_args(argv)
    check_time_budget_flag(args)
    validate_stage_flags(args, "chat_sft")
    return args


def supervised_tokens(micro_batches, device, world_size):
    """Targets to learn in this step across every micro-batch and rank (at least 1, so an empty step divides safely)."""
    count = torch.tensor(sum(int((y != -1).sum()) for _, y in micro_batches), device=device)
    if world_size > 1:
        torch.distributed.all_reduce(count)
    return max(int(count.item()), 1)


def main(argv=None):
    args = parse_args(argv)
    kind = mixture_kind(args.mixture)
    # fails now, not after loading, if data is missing or a line of the user's is bad
    train_mix, val_mix, own = mixtures(kind, args.identity_file, data_files(args.data), args.val_data)
    tag, ckpt_dir = output_dir("sft", args)
    _, rank, _, world_size, device = compute_init(args.device_type)
    grad_accum = micro_steps(args.total_batch_size, args.device_batch_size, world_size, "conversations")
    T = context_length(input_config(args, tag, ckpt_dir), args.max_seq_len)  # checked before the model loads
    own.check_rows(get_tokenizer(), T + 1, f"with --max-seq-len={T}")
    seed_everything(args.seed)
    model, tokenizer, optimizers, lrs, start = start_stage(args, tag, ckpt_dir, device)
    use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
    sample = range(min(64, train_mix.num_examples()))  # the mean conversation's tokens, for a time budget's guess
    mean_tokens = sum(min(T, len(tokenizer.render_conversation(train_mix[i])[0])) for i in sample) / len(sample)
    clock = plan_chat_stage(args, start, model, device, world_size, args.total_batch_size * mean_tokens,  # sets the steps
                          args.eval_steps * args.device_batch_size * world_size * mean_tokens, "val_loss")
    num_iterations = args.num_iterations if args.num_iterations > 0 else max(1, train_mix.num_examples() // args.total_batch_size)
    autocast = autocast_for(device)
    loader = ConversationBatches(train_mix, tokenizer, args.device_batch_size, T, grad_accum, rank, world_size, device,
                                 resume_state=start.loader_state)

    def val_loss():  # per supervised token of held-out conversations
        batches = ConversationBatches(val_mix, tokenizer, args.device_batch_size, T, 1, rank, world_size, device,
                                      single_pass=True)
        return evaluate_loss(model, batches, args.eval_steps)

    loop = stage_loop("chat_sft", args, ckpt_dir, model, tokenizer, optimizers, lrs, loader, num_iterations, start, device,
                      callbacks=[TrainingReport(), clock],
                      meta=clock.checkpoint_meta())
    loop.announce(f"chat_sft | {tag} from {args.source} | mixture {kind}: {train_mix.num_examples():,} conversations "
                  f"({train_mix.name}) | {args.device_batch_size}x{world_size}x{grad_accum} conversations per step, up "
                  f"to {T} tokens each | steps {num_iterations}" + (f" | your data: {own.describe()}" if own.notes else ""))

    for step in stage_steps(loop, args.eval_every, "val_loss", val_loss):  # evaluates at both ends too
        t0 = time.perf_counter()
        lrm = lr_multiplier(step, loop.num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        micro_batches = next(loader)
        # Each micro-batch contributes its summed loss; dividing by the step's supervised tokens per rank makes the
        # ranks' averaged gradient that of the mean over every supervised token of the step.
        divisor = supervised_tokens(micro_batches, device, world_size) / world_size
        loss = train_step(model, optimizers, micro_batches, lambda m, xy: m(*xy, loss_reduction="sum"), lrm,
                          muon_momentum(step), autocast, divisor=divisor)
        loop.end_step(loss, t0, lrm=lrm, tokens=sum(x.numel() for x, _ in micro_batches) * world_size)

    clock.finish(loop)
    loop.finish("Chat SFT", [{"Mixture": kind, "Your data": own.describe() or "-",
                              "Conversations in the mixture": train_mix.num_examples(),
                              "Epochs seen": loader.stream.epoch, "DDP world size": world_size, **lrs, **clock.report()}])
    compute_cleanup()


if __name__ == "__main__":
    run_main(main)
