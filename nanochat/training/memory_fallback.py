"""
A smaller card does not stop a run: when a micro-batch does not fit in the first steps of base_train, the device
batch is halved and the step taken again with twice the gradient accumulation, so the global batch, and with it the
run, stay the same (the same rows in the same optimizer steps: the losses are those of a run started at the smaller
device batch). Only when one row does not fit does the run stop, with one line naming the depth and the memory.

Every rank agrees before the optimizer update, so a rank that ran out never leaves the others waiting in a
collective, and the data stream is rewound to where the step began. NANOCHAT_SIMULATE_OOM_ROWS=N makes the device
"run out of memory" on any micro-batch of more than N rows (0: on every one): a rehearsal of a smaller card (the tests' stand-in for
one, on the CPU).
"""

import os

import torch

from nanochat.common import UserError, all_reduce_max, print0

GUARDED_STEPS = 3  # the first optimizer steps of a process allocate everything it will need (activations, states)
# NANOCHAT_SIMULATE_OOM_ROWS=N or N@S: more than N rows do not fit, from the S-th step of the process (default 0) on
_simulated = os.environ.get("NANOCHAT_SIMULATE_OOM_ROWS", "")
SIMULATED_LIMIT = int(_simulated.split("@")[0]) if _simulated else None
SIMULATED_FROM_STEP = int(_simulated.split("@")[1]) if "@" in _simulated else 0


class DeviceBatchTooLarge(Exception):
    """Some rank ran out of memory in this step's forward/backward passes; every rank raises it, nothing was updated."""


def simulate_out_of_memory(rows, step=0):
    """Raise CUDA's out-of-memory error for a micro-batch of more rows than NANOCHAT_SIMULATE_OOM_ROWS allows."""
    if SIMULATED_LIMIT is not None and rows > SIMULATED_LIMIT and step >= SIMULATED_FROM_STEP:
        raise torch.OutOfMemoryError(f"simulated: {rows} rows > NANOCHAT_SIMULATE_OOM_ROWS={_simulated}")


def any_rank_out_of_memory(failed, device):
    """True on every rank when any rank ran out of memory (every rank must call it, at the same point)."""
    return all_reduce_max([1.0 if failed else 0.0], device)[0] > 0


class StepGuard:
    """What training.train_step gets as oom_guard in a guarded step: called after the backward passes with whether
    this rank ran out of memory, it says whether any rank did; simulate(rows) is the rehearsal's stand-in."""

    def __init__(self, step, device):
        self.step, self.device = step, device

    def simulate(self, rows):
        simulate_out_of_memory(rows, self.step)

    def __call__(self, failed):
        return any_rank_out_of_memory(failed, self.device)


def smaller_device_batch(device_batch_size, rows_per_step):
    """The device batch to try next: the largest at or below half of this one that divides the rows each rank takes
    per optimizer step (so gradient accumulation stays exact); None when this one is 1."""
    return next((b for b in range(device_batch_size // 2, 0, -1) if rows_per_step % b == 0), None)


def device_memory(device):
    """The memory a device batch must fit in, in words."""
    if SIMULATED_LIMIT is not None:
        return f"a simulated device (NANOCHAT_SIMULATE_OOM_ROWS={_simulated})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.1f} GiB)"
    return f"the {device.type}'s memory"


class FittingBatches:
    """
    base_train's training batches, with the device batch halved on an out-of-memory error in the first steps.
    make_loader(device_batch_size, resume_state) builds the data stream; step(update) fetches one optimizer step's
    micro-batches and returns update(micro_batches, guard), where update passes guard to training.train_step as
    oom_guard (it reports whether any rank ran out, after the backward passes and before the optimizers move).
    """

    def __init__(self, make_loader, device_batch_size, total_batch_size, seq_len, world_size, depth, device,
                 resume_state=None):
        self.make_loader, self.depth, self.seq_len, self.device = make_loader, depth, seq_len, device
        self.rows_per_step = total_batch_size // (seq_len * world_size)
        self.device_batch_size = device_batch_size
        self.shrunk_from = None  # the device batch the run asked for, once it has had to shrink
        self.loader = make_loader(device_batch_size, resume_state)
        self.steps_taken = 0

    @property
    def grad_accum(self):
        return self.rows_per_step // self.device_batch_size

    def state_dict(self):
        return self.loader.state_dict()

    def crop_fraction(self):
        return self.loader.crop_fraction()

    def close(self):
        self.loader.close()

    def step(self, update):
        while True:
            guarded = self.steps_taken < GUARDED_STEPS
            state = self.loader.state_dict() if guarded else None
            micro_batches = [next(self.loader) for _ in range(self.grad_accum)]
            try:
                result = update(micro_batches, StepGuard(self.steps_taken, self.device) if guarded else None)
            except DeviceBatchTooLarge:
                del micro_batches
                self.shrink(state)
                continue
            self.steps_taken += 1
            return result

    def shrink(self, state):
        """Go on at the next smaller device batch, from the data stream's state at the start of the failed step."""
        smaller = smaller_device_batch(self.device_batch_size, self.rows_per_step)
        memory = device_memory(self.device)
        if smaller is None:
            raise UserError(f"d{self.depth} does not fit in {memory} even at --device-batch-size=1 (rows of "
                            f"{self.seq_len} tokens): train a smaller --depth or a shorter --max-seq-len, or use a "
                            f"device with more memory")
        print0(f"out of memory at --device-batch-size={self.device_batch_size} on {memory}: going on at {smaller} "
               f"with {self.rows_per_step // smaller} micro-steps per optimizer step; the global batch, and so the run, "
               f"are unchanged")
        self.loader.close()
        self.loader = self.make_loader(smaller, state)
        self.shrunk_from = self.shrunk_from or self.device_batch_size
        self.device_batch_size = smaller
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
