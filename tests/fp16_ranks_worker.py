"""
Worker for tests/test_fp16.py, launched with `torchrun --nproc_per_node=2` on CPU (gloo) and NANOCHAT_DTYPE=float16:
one train_step where rank 1's loss overflows in the backward and rank 0's does not, then one ordinary step. Rank 0
writes what every rank saw: whether the skipped step left its parameters and optimizer state bitwise unchanged, the
scale after each step, whether the ranks' parameters agree, and whether the second step trained.

Usage: python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fp16_ranks_worker.py OUT.pt
"""

import gc
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from nanochat.common import autocast_for  # noqa: E402
from nanochat.loop import lm_loss, loss_scaler, train_step  # noqa: E402
from test_fp16 import assert_same, batch, overflowing, snapshot, tiny_run  # noqa: E402


def main():
    out_path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model, optimizers = tiny_run()  # the same weights on both ranks
    autocast = autocast_for("cpu")
    scaler = loss_scaler(optimizers, autocast)
    train_step(model, optimizers, [batch(10 + rank)], lm_loss, 1.0, 0.9, autocast)  # state to keep
    before = snapshot(model, optimizers)
    train_step(model, optimizers, [batch(20 + rank)], overflowing if rank == 1 else lm_loss, 1.0, 0.9, autocast)
    try:
        assert_same(before, snapshot(model, optimizers))
        unchanged = True
    except AssertionError:
        unchanged = False
    scales = [scaler.get_scale()]
    train_step(model, optimizers, [batch(30 + rank)], lm_loss, 1.0, 0.9, autocast)
    scales.append(scaler.get_scale())
    trained = not torch.equal(model.lm_head.weight, before[0]["lm_head.weight"])

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(everyone, flat)
    reports = [None, None]
    dist.all_gather_object(reports, (unchanged, scales, trained))
    if rank == 0:
        torch.save({"unchanged_after_skip": [r[0] for r in reports], "scales": [r[1] for r in reports],
                    "trained": all(r[2] for r in reports), "ranks_agree": torch.equal(everyone[0], everyone[1])},
                   out_path + ".tmp")
        os.replace(out_path + ".tmp", out_path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    gc.collect()  # as common.run_main does: without it a gloo rank aborts at shutdown now and then on a loaded CPU
