"""
Scoring a chat model on tasks: categorical ones by the logits of the answer letters, generative ones by a sampled
reply the task judges (many decoded together on a BatchEngine). Under torchrun each rank takes every world_size-th
problem and the counts are summed. ChatCORE: the mean over tasks of the accuracy centred on its random baseline.
"""

import time

import torch
import torch.distributed as dist

from nanochat.engine import BatchEngine, Sampling, kv_memory_bytes, kv_row_bytes
from nanochat.common import dist_rank_world, print0


@torch.no_grad()
def categorical_accuracy(model, tokenizer, task, indices, batch_size=8):
    """Pick, for each problem, the answer letter with the highest logit after the prompt; (correct, total) here."""
    device = model.get_device()
    bos = tokenizer.get_bos_token_id()
    correct = 0
    for start in range(0, len(indices), batch_size):
        conversations = [task.get_example(i) for i in indices[start:start + batch_size]]
        prompts = [tokenizer.render_for_completion(c)[-model.config.sequence_len:] for c in conversations]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([list(p) + [bos] * (width - len(p)) for p in prompts], dtype=torch.long, device=device)
        logits = model(ids)
        for row, (conversation, prompt) in enumerate(zip(conversations, prompts)):
            letters = conversation["letters"]
            letter_ids = [tokenizer.encode(letter) for letter in letters]
            assert all(len(t) == 1 for t in letter_ids), f"answer letters {letters} must be single tokens"
            scores = logits[row, len(prompt) - 1, [t[0] for t in letter_ids]]
            correct += bool(task.evaluate(conversation, letters[int(scores.argmax())]))
    return correct, len(indices)


def completion_prompt(tokenizer, conversation):
    """The tokens a reply continues: a chat conversation rendered for the assistant's turn, or a base-model problem's
    `text_prompt` as plain text after <|bos|>."""
    if "text_prompt" in conversation:
        return tokenizer.encode(conversation["text_prompt"], prepend=tokenizer.get_bos_token_id())
    return tokenizer.render_for_completion(conversation)


def sample_task_replies(model, tokenizer, conversations, max_tokens, temperature=0.0, top_k=None, seeds=None,
                        max_batch=32):
    """The model's reply to each conversation as text (tool calls included), or None where the prompt leaves no room;
    up to max_batch decoded together, each with its own seed."""
    device = model.get_device()  # fewer rows than max_batch where their KV cache would not fit, as chat_web's
    max_batch = max(1, min(max_batch, kv_memory_bytes(device) // kv_row_bytes(model.config, device)))
    engine = BatchEngine(model, tokenizer, max_batch=max_batch)
    seeds = list(range(len(conversations))) if seeds is None else seeds
    replies, asked, tokens = [None] * len(conversations), [], {}  # asked keeps each sequence, so its id stays its own
    for i, (conversation, seed) in enumerate(zip(conversations, seeds)):
        prompt = completion_prompt(tokenizer, conversation)
        room = model.config.sequence_len - len(prompt)
        if room >= 1:
            seq = engine.add(prompt, Sampling(temperature=temperature, top_k=top_k, max_tokens=min(max_tokens, room),
                                              seed=seed))
            asked.append((i, seq))
            tokens[id(seq)] = []
    while engine.busy():
        for seq, token, _ in engine.step():
            if token not in engine.ids.terminals:  # the reply ends before its terminal token, as generate_batch's
                tokens[id(seq)].append(token)
    for i, seq in asked:
        replies[i] = tokenizer.decode(tokens[id(seq)])
    return replies


def generative_accuracy(model, tokenizer, task, indices, max_tokens=256, temperature=0.0, top_k=None):
    """Sample a reply per problem and let the task judge it; (correct, total, replies calling the calculator) here."""
    conversations = [task.get_example(i) for i in indices]
    replies = sample_task_replies(model, tokenizer, conversations, max_tokens, temperature, top_k, seeds=indices)
    correct = sum(reply is not None and bool(task.evaluate(c, reply)) for c, reply in zip(conversations, replies))
    tool_calls = sum(reply is not None and "<|python_start|>" in reply for reply in replies)
    return correct, len(indices), tool_calls


def evaluate_chat_task(model, tokenizer, task, max_problems=None, batch_size=8, max_tokens=256, temperature=0.0,
                       top_k=None, with_tool_rate=False):
    """(accuracy, problems scored) on the first max_problems problems (all if None); with_tool_rate adds the share of
    replies that called the calculator (None for categorical tasks)."""
    rank, world_size = dist_rank_world()
    n = task.num_examples() if max_problems is None else min(max_problems, task.num_examples())
    indices = list(range(rank, n, world_size))
    if task.eval_type == "categorical":
        counts = [*categorical_accuracy(model, tokenizer, task, indices, batch_size), -1]
    else:
        counts = list(generative_accuracy(model, tokenizer, task, indices, max_tokens, temperature, top_k))
    counts = torch.tensor(counts, dtype=torch.long, device=model.get_device())
    if world_size > 1:
        dist.all_reduce(counts)
    correct, total, tool_calls = counts.tolist()
    result = (correct / max(1, total), total)
    if with_tool_rate:
        result += (tool_calls / max(1, total) if tool_calls >= 0 else None,)
    return result


def chatcore(accuracies, baselines):
    """Mean over tasks of the accuracy centred on its random baseline: 0 is chance, 1 is perfect."""
    centered = [(accuracies[name] - baselines[name]) / (1.0 - baselines[name]) for name in accuracies]
    return sum(centered) / len(centered)


def evaluate_chat_tasks(model, tokenizer, tasks, max_problems=None, **kwargs):
    """{name: accuracy}, {name: baseline} and {name: calculator share} (generative tasks), a line printed per task."""
    accuracies, baselines, tool_rates = {}, {}, {}
    for name, task in tasks.items():
        t0 = time.time()
        accuracy, total, tool_rate = evaluate_chat_task(model, tokenizer, task, max_problems, with_tool_rate=True,
                                                        **kwargs)
        accuracies[name], baselines[name] = accuracy, task.baseline
        tools = ""
        if tool_rate is not None:
            tool_rates[name] = tool_rate
            tools = f" | calculator in {100 * tool_rate:5.1f}% of replies"
        print0(f"{name:<16} accuracy {100 * accuracy:6.2f}% of {total:5d} | baseline {100 * task.baseline:5.1f}% | "
               f"{task.eval_type}{tools} | {time.time() - t0:.1f}s")
    return accuracies, baselines, tool_rates
