"""
Reinforcement learning on problems with a checkable answer (GSM8K, or the built-in arithmetic offline):
for each problem sample several replies with the Engine (tools on), reward each by the task's verdict,
and take a policy-gradient step that makes better-than-average replies more likely. Saves to
chatrl_checkpoints/.

  python -m scripts.chat_rl                          # from the latest sft checkpoint
  torchrun --standalone --nproc_per_node=8 -m scripts.chat_rl -- --task=GSM8K --run=rl
The advantage of a reply is its reward minus the mean reward of its problem's group; the gradient flows
only through tokens the model sampled (never the prompt or a tool's forced output). Samples are seeded by
(seed, problem): a resumed run draws exactly the replies an uninterrupted one would have.
"""

import argparse
import time

import torch

from nanochat.chat_data import ProblemSchedule
from nanochat.chat_eval import evaluate_chat_task
from nanochat.common import all_reduce_mean, autocast_for, compute_cleanup, compute_init, run_main, seed_everything
from nanochat.engine import Engine
from nanochat.kernels.cpu import use_cpu_kernels
from nanochat.loop import train_step
from nanochat.optim import lr_multiplier, muon_momentum
from nanochat.planning.time_budget import add_time_budget_flag, check_time_budget_flag, plan_chat_stage
from nanochat.presets import preset_help
from nanochat.report import TrainingReport
from nanochat.stage import (add_stage_flags, check_flag, mixture_kind, output_dir, stage_loop, stage_steps, start_stage,
                            validate_stage_flags)
from tasks import TaskMixture, get_task


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Policy-gradient RL on problems with checkable answers.")
    add_stage_flags(p, "chat_rl", source="sft", batch_unit="problems", conversation_data=False)
    add_time_budget_flag(p)
    p.add_argument("--task", default="", help="GSM8K, Arithmetic, SpellingBee, or several joined by | (default: Arithmetic "
                                              "when $NANOCHAT_DATA_SOURCE is builtin or unset, else GSM8K)")
    p.add_argument("--num-samples", type=int, default=None,
                   help=f"replies sampled per problem {preset_help('chat_rl', 'num_samples')}")
    p.add_argument("--max-new-tokens", type=int, default=None, help=preset_help("chat_rl", "max_new_tokens"))
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--eval-problems", type=int, default=None,
                   help=f"test problems for the periodic pass@1 {preset_help('chat_rl', 'eval_problems')}")
    args = p.parse_args(argv)
    check_time_budget_flag(args)
    validate_stage_flags(args, "chat_rl")
    for flag in ("num_samples", "max_new_tokens", "top_k", "eval_problems"):
        check_flag(getattr(args, flag) >= 1, flag, getattr(args, flag), "must be >= 1")
    check_flag(0 < args.temperature <= 2, "temperature", args.temperature, "must be in (0, 2]: RL needs sampling")
    return args


def sample_group(engine, tokenizer, task, index, args, seed):
    """num_samples replies to problem `index`: rows of token ids (prompt, reply, its terminal token) with the
    sampled-or-not mask of each token, and the rewards and reply lengths."""
    conversation = task.get_example(index)
    prompt = tokenizer.render_for_completion(conversation)
    terminals = (tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id())
    rows = [list(prompt) for _ in range(args.num_samples)]
    masks = [[0] * len(prompt) for _ in range(args.num_samples)]
    done = [False] * args.num_samples
    for column, column_masks in engine.generate(prompt, args.num_samples, args.max_new_tokens, args.temperature,
                                                args.top_k, seed=seed):
        for i, (token, mask) in enumerate(zip(column, column_masks)):
            if not done[i]:
                rows[i].append(token)
                masks[i].append(mask)
                done[i] = token in terminals
    replies = [tokenizer.decode(row[len(prompt):]) for row in rows]
    rewards = [task.reward(conversation, reply) for reply in replies]
    return rows, masks, rewards, [len(row) - len(prompt) for row in rows]


def policy_batches(rows, masks, advantages, per_micro, bos):
    """Micro-batches (x, y, advantage per row): y is -1 everywhere except tokens the model sampled."""
    batches = []
    for start in range(0, len(rows), per_micro):
        chunk = range(start, min(start + per_micro, len(rows)))
        width = max(len(rows[i]) for i in chunk)
        ids = torch.full((len(chunk), width), bos, dtype=torch.long)
        y = torch.full((len(chunk), width - 1), -1, dtype=torch.long)
        for b, i in enumerate(chunk):
            row = torch.tensor(rows[i])
            ids[b, :len(row)] = row
            sampled = torch.tensor(masks[i][1:], dtype=torch.bool)
            y[b, :len(row) - 1] = torch.where(sampled, row[1:], -1)
        batches.append((ids[:, :-1], y, torch.tensor([advantages[i] for i in chunk])))
    return batches


def pg_loss(model, batch):
    """Sum over sampled tokens of advantage x cross-entropy: its gradient raises log p of above-average replies."""
    x, y, advantage = batch
    per_token = model(x, y, loss_reduction="none")  # 0 where y is -1
    return (per_token * advantage.to(per_token.dtype).unsqueeze(1)).sum()


def main(argv=None):
    args = parse_args(argv)
    task_name = args.task or ("Arithmetic" if mixture_kind() == "builtin" else "GSM8K")
    names = task_name.split("|")  # several tasks: their problems mixed, each judged by its own task
    train_task = TaskMixture([get_task(n, "train") for n in names], seed=5) if len(names) > 1 else get_task(names[0], "train")
    test_task = TaskMixture([get_task(n, "test") for n in names], seed=6) if len(names) > 1 else get_task(names[0], "test")
    tag, ckpt_dir = output_dir("rl", args)
    _, rank, _, world_size, device = compute_init(args.device_type)
    check_flag(args.total_batch_size % world_size == 0, "total_batch_size", args.total_batch_size,
               f"must be a multiple of the {world_size} ranks")
    samples_per_rank = args.total_batch_size // world_size * args.num_samples
    check_flag(samples_per_rank % args.device_batch_size == 0, "device_batch_size", args.device_batch_size,
               f"must divide the {samples_per_rank} replies a rank samples per step (--total-batch-size="
               f"{args.total_batch_size} problems x --num-samples={args.num_samples} over {world_size} rank(s))")
    seed_everything(args.seed)
    model, tokenizer, optimizers, lrs, start = start_stage(args, tag, ckpt_dir, device)
    use_cpu_kernels(model, device)  # on a CPU, unless NANOCHAT_CPU_OPS=0
    # decoding a token costs a forward pass of one position at a fraction of the hardware's speed: a guess of 10x its FLOPs
    replies = args.total_batch_size * args.num_samples * args.max_new_tokens
    clock = plan_chat_stage(args, start, model, device, world_size, 10 * replies, 10 * args.eval_problems * args.max_new_tokens,
                          "pass@1")  # sets the steps, if given
    num_iterations = args.num_iterations if args.num_iterations > 0 else max(1, train_task.num_examples() // args.total_batch_size)
    autocast = autocast_for(device)
    schedule = ProblemSchedule(train_task, args.total_batch_size, rank, world_size)
    engine = Engine(model, tokenizer)
    bos = tokenizer.get_bos_token_id()

    def pass_at_1():
        accuracy, _ = evaluate_chat_task(model, tokenizer, test_task, args.eval_problems,
                                         max_tokens=args.max_new_tokens)
        return accuracy

    loop = stage_loop("chat_rl", args, ckpt_dir, model, tokenizer, optimizers, lrs, schedule, num_iterations, start, device,
                      callbacks=[TrainingReport(), clock],
                      meta=clock.checkpoint_meta())
    loop.announce(f"chat_rl | {tag} from {args.source} | task {task_name}: {train_task.num_examples():,} problems | "
                  f"{args.total_batch_size} problems x {args.num_samples} samples per step on {world_size} rank(s) | "
                  f"steps {num_iterations} | temperature {args.temperature} top-k {args.top_k}")

    for step in stage_steps(loop, args.eval_every, "pass@1", pass_at_1):  # evaluates at both ends too
        t0 = time.perf_counter()
        # -- sample: every problem of this rank, num_samples replies each --
        model.eval()
        rows, masks, advantages, rewards, lengths, solved = [], [], [], [], [], 0
        for index in schedule.problems(step):
            group_rows, group_masks, group_rewards, group_lengths = sample_group(
                engine, tokenizer, train_task, index, args, seed=args.seed * 1_000_003 + index)
            mean = sum(group_rewards) / len(group_rewards)
            rows += group_rows
            masks += group_masks
            advantages += [r - mean for r in group_rewards]
            rewards += group_rewards
            lengths += group_lengths
            solved += any(r > 0 for r in group_rewards)
        model.train()
        # -- one policy-gradient step, normalised by every sampled token of the step on every rank --
        micro_batches = policy_batches(rows, masks, advantages, args.device_batch_size, bos)
        sampled = torch.tensor(sum(int((y != -1).sum()) for _, y, _ in micro_batches), device=device)
        if world_size > 1:
            torch.distributed.all_reduce(sampled)
        lrm = lr_multiplier(step, loop.num_iterations, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        loss = train_step(model, optimizers, [(x.to(device), y.to(device), a.to(device)) for x, y, a in micro_batches],
                          pg_loss, lrm, muon_momentum(step), autocast, divisor=max(int(sampled.item()), 1) / world_size)
        loop.end_step(loss, t0, lrm=lrm, tokens=sum(x.numel() for x, _, _ in micro_batches) * world_size, reward=all_reduce_mean(sum(rewards) / len(rewards), device),
                      **{f"pass@{args.num_samples}": all_reduce_mean(solved / len(schedule.problems(step)), device),
                         "length": all_reduce_mean(sum(lengths) / len(lengths), device)})

    clock.finish(loop)
    loop.finish("Chat RL", [{"Task": task_name, "Problems per step": args.total_batch_size,
                             "Samples per problem": args.num_samples, "DDP world size": world_size, **lrs,
                             **clock.report()}])
    compute_cleanup()


if __name__ == "__main__":
    run_main(main)
