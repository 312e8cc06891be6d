"""
Bits per byte, the validation loss that compares models of different vocabularies (a mean loss per token depends on
how many bytes a token covers): summed nats over the UTF-8 bytes the targets stand for, special tokens (0 bytes) left
out of both sums, in bits.
"""

import itertools
import math

import torch
import torch.distributed as dist

from nanochat.common import dist_rank_world


@torch.no_grad()
def evaluate_loss(model, batches, steps):
    """
    Mean cross-entropy per valid target (targets of -1 ignored) over at most `steps` next() calls of batches, each
    giving a list of (x, y) micro-batches; fewer when the stream ends (a single pass over a held-out set). Summed
    across ranks, so every rank returns the same (loss, targets evaluated, whether the stream ran out first).
    """
    device = model.get_device()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, counted targets
    taken = 0
    for micro_batches in itertools.islice(batches, max(0, steps)):
        taken += 1
        for x, y in micro_batches:
            total += torch.stack([model(x, y, loss_reduction="sum").double(), (y != -1).sum().double()])
    if dist_rank_world()[1] > 1:
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item(), int(total[1].item()), taken < steps


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes):
    """
    (bpb, targets evaluated, whether the stream ran out) over at most `steps` (x, y) batches, the same on every rank;
    model(x, y, loss_reduction="none") gives per-token losses, token_bytes[id] the bytes of id, targets of -1 ignored.
    """
    device = token_bytes.device
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    totals = torch.zeros(2, dtype=torch.int64, device=device)  # bytes, targets
    taken = 0
    for x, y in itertools.islice(batches, max(0, steps)):
        taken += 1
        loss = model(x, y, loss_reduction="none").reshape(-1).double()
        y = y.reshape(-1)
        valid = y >= 0
        nbytes = torch.where(valid, token_bytes[y.clamp(min=0)], torch.zeros_like(y))
        counted = nbytes > 0
        total_nats += (loss * counted).sum().to(device)
        totals += torch.stack([nbytes.sum(), valid.sum()]).to(device)
    if dist_rank_world()[1] > 1:
        dist.all_reduce(total_nats)
        dist.all_reduce(totals)
    total_bytes, targets = (int(v) for v in totals.tolist())
    bpb = float("inf") if total_bytes == 0 else total_nats.item() / (math.log(2) * total_bytes)
    return bpb, targets, taken < steps


def describe_eval(tokens, ran_out, split="val"):
    """How much an evaluation read: the tokens, and whether that was the whole split (asked for more)."""
    return f"{tokens:,} tokens" + (f", the whole {split} split once (asked for more)" if ran_out else "")
