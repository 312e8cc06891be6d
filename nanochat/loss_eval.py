"""
Bits per byte: the tokenizer-independent validation loss.

Mean loss per token depends on how many bytes a token covers, so it cannot compare models
with different vocabularies. Instead sum the loss in nats over all target tokens, divide by
the number of UTF-8 bytes those tokens stand for (special tokens count 0 bytes and are left
out of both sums), and convert nats to bits.
"""

import math

import torch
import torch.distributed as dist

from nanochat.common import dist_rank_world


@torch.no_grad()
def evaluate_loss(model, batches, steps):
    """Mean cross-entropy per valid target (targets of -1 ignored) over `steps` next() calls of batches, each giving
    a list of (x, y) micro-batches; summed across ranks, so every rank returns the same number."""
    device = model.get_device()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, counted targets
    for _ in range(steps):
        for x, y in next(batches):
            total += torch.stack([model(x, y, loss_reduction="sum").double(), (y != -1).sum().double()])
    if dist_rank_world()[1] > 1:
        dist.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).item()


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes):
    """
    model(x, y, loss_reduction="none") -> per-token loss; batches yields (x, y); token_bytes[id] = bytes of id.
    Targets of -1 are ignored. Sums are all-reduced so every rank returns the same number.
    """
    device = token_bytes.device
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.int64, device=device)
    batch_iter = iter(batches)
    for _ in range(steps):
        x, y = next(batch_iter)
        loss = model(x, y, loss_reduction="none").reshape(-1).double()
        y = y.reshape(-1)
        valid = y >= 0
        nbytes = torch.where(valid, token_bytes[y.clamp(min=0)], torch.zeros_like(y))
        counted = nbytes > 0
        total_nats += (loss * counted).sum().to(device)
        total_bytes += nbytes.sum().to(device)
    if dist_rank_world()[1] > 1:
        dist.all_reduce(total_nats)
        dist.all_reduce(total_bytes)
    if total_bytes.item() == 0:
        return float("inf")
    return total_nats.item() / (math.log(2) * total_bytes.item())
