"""
Run scripts.base_train (under torchrun) with a failure injected on rank 1 only, from outside the library:

    torchrun --nproc-per-node=2 tests/rank_fault.py <fault>@<step>[+linger] [base_train flags...]

fault: checkpoint (rank 1 cannot write its optimizer shard of that step's checkpoint: a full disk) or raise (rank 1
raises a RuntimeError in that step's optimizer update). With +linger, rank 1 then takes 5 s to end its process, as a rank whose
teardown hangs (NCCL's can) would: while it lives, its peers get no error from the process group.
"""

import atexit
import errno
import os
import sys
import time

from nanochat import checkpoint_manager, loop
from nanochat.common import run_main
from scripts import base_train

fault, step = sys.argv[1].removesuffix("+linger").split("@")
step = int(step)
rank1 = os.environ.get("RANK") == "1"
real_save_file, real_step_optimizers = checkpoint_manager.save_file, loop.step_optimizers
steps_taken = 0


def save_file(tensors, path, *args, **kwargs):
    if rank1 and fault == "checkpoint" and os.path.basename(path) == "optim_rank1.safetensors" \
            and os.path.basename(os.path.dirname(path)) == f".tmp_step_{step:06d}":
        raise OSError(errno.ENOSPC, "No space left on device")
    real_save_file(tensors, path, *args, **kwargs)


def step_optimizers(*args, **kwargs):
    global steps_taken
    steps_taken += 1
    if rank1 and fault == "raise" and steps_taken == step:
        raise RuntimeError(f"injected failure in step {step}")
    return real_step_optimizers(*args, **kwargs)


def linger():
    time.sleep(5)
    print("rank 1 process ends", file=sys.stderr, flush=True)


if rank1 and sys.argv[1].endswith("+linger"):
    atexit.register(linger)
checkpoint_manager.save_file = save_file
loop.step_optimizers = step_optimizers  # what train_step calls for every stage's update
run_main(lambda: base_train.main(sys.argv[2:]))
