"""
Worker for tests/test_optim.py, launched with `torchrun --nproc_per_node=2` on CPU (gloo).

Trains a tiny embedding + Linear model for a few steps with DistMuon + DistAdamW, each rank
on its half of every global batch, and writes rank 0's final parameters to the output file.
It also checks resume on every rank: optimizer state saved after RESUME_AT steps and loaded
into fresh optimizers continues exactly like the uninterrupted run. The model, the batches and
the training step are defined here and imported by the test for its single-process reference.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_optim_worker.py OUT.pt
"""

import copy
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nanochat.optim import DistAdamW, DistMuon  # noqa: E402

VOCAB, DIM, HIDDEN = 24, 16, 48
GLOBAL_BATCH, SEQ = 8, 6
NUM_STEPS, RESUME_AT = 3, 2


class TinyNet(nn.Module):
    """Embedding -> three square Linears (a Muon group of 3, which does not split evenly over 2 ranks)
    -> a tall and a wide Linear -> a biased head; plus a scalar gain that cannot be sharded."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM, bias=False) for _ in range(3)])
        self.up = nn.Linear(DIM, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.head = nn.Linear(DIM, VOCAB)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        x = x + self.down(F.relu(self.up(x)))
        return self.head(x) * self.gain


def build_model():
    torch.manual_seed(1234)
    return TinyNet()


def param_groups(model):
    """(adamw_groups, muon_groups) in the shape GPT.setup_optimizers() hands them over."""
    matrices = [*(b.weight for b in model.blocks), model.up.weight, model.down.weight]
    by_shape = {}
    for p in matrices:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    muon_groups = [dict(params=ps, lr=0.05, weight_decay=0.1, initial_lr=0.05) for ps in by_shape.values()]
    # The large eps makes AdamW's step depend on the gradient's scale (not just its sign), so a
    # sum where an average belongs would show up in the comparison.
    adamw_groups = [
        dict(params=[model.embed.weight], lr=0.02, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.0, initial_lr=0.02),
        dict(params=[model.head.weight, model.head.bias, model.gain], lr=0.01, betas=(0.9, 0.99), eps=1e-3,
             weight_decay=0.05, initial_lr=0.01),
    ]
    return adamw_groups, muon_groups


def build_optimizers(model):
    adamw_groups, muon_groups = param_groups(model)
    return DistAdamW(adamw_groups), DistMuon(muon_groups, momentum=0.9)


def global_batch(step):
    """The step-th global batch: (inputs, targets), each (GLOBAL_BATCH, SEQ)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(model, optimizers, step, rank=0, world=1):
    """One step on this rank's share of the global batch: mean loss over the share (gradients are
    then averaged across ranks by the optimizers)."""
    x, y = global_batch(step)
    share = GLOBAL_BATCH // world
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return loss.item()


def main():
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    model = build_model()
    optimizers = build_optimizers(model)
    for step in range(RESUME_AT):
        train_step(model, optimizers, step, rank, world)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opts = [copy.deepcopy(opt.state_dict()) for opt in optimizers]
    for step in range(RESUME_AT, NUM_STEPS):
        train_step(model, optimizers, step, rank, world)

    # Resume: fresh model and optimizers from the snapshot, same remaining steps.
    resumed = build_model()
    resumed.load_state_dict(saved_model)
    resumed_opts = build_optimizers(resumed)
    for opt, state in zip(resumed_opts, saved_opts):
        opt.load_state_dict(state)
    for step in range(RESUME_AT, NUM_STEPS):
        train_step(resumed, resumed_opts, step, rank, world)
    resume_diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), resumed.parameters()))

    # Each rank must hold Muon momentum only for the matrices it owns.
    muon = optimizers[1]
    muon_states = sum(1 for g in muon.param_groups for p in g["params"] if muon.state.get(p))
    muon_owned = sum(len(muon.owned_indices(g)) for g in muon.param_groups)
    # ... and every rank must end with bitwise identical parameters.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(everyone, flat)
    ranks_agree = all(torch.equal(everyone[0], t) for t in everyone)

    report = torch.tensor([resume_diff, float(muon_states != muon_owned), float(not ranks_agree)])
    reports = [torch.empty_like(report) for _ in range(world)]
    dist.all_gather(reports, report)
    if rank == 0:
        torch.save({
            "params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "resume_diff": max(r[0].item() for r in reports),
            "state_not_sharded": any(r[1].item() for r in reports),
            "ranks_disagree": any(r[2].item() for r in reports),
            "muon_states_rank0": muon_states,
            "world": world,
        }, out_path + ".tmp")
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # as common.run_main does: without it a gloo rank aborts at shutdown now and then on a loaded CPU
    gc.collect()
