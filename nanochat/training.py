"""
What every training script shares: the depth dial, lr / momentum / weight-decay schedules,
optimizer construction, gradient-accumulation arithmetic, wandb, stop signals and ETA text.
Scripts keep only their recipe and their loop.
"""

import math
import signal

import torch
import torch.distributed as dist

from nanochat.common import UserError

REFERENCE_BATCH = 2**19  # tokens per step of the GPU recipe that the base lrs were tuned at


# -----------------------------------------------------------------------------
# The depth dial


def model_config_for_depth(depth, vocab_size, sequence_len, aspect_ratio=64, head_dim=128, n_kv_head=None):
    """n_layer = depth, n_embd = aspect_ratio * depth rounded up to a multiple of head_dim, n_head = n_embd / head_dim."""
    if depth < 1:
        raise UserError(f"--depth must be >= 1 (got {depth})")
    n_embd = ((aspect_ratio * depth + head_dim - 1) // head_dim) * head_dim
    n_head = n_embd // head_dim
    n_kv_head = n_kv_head or n_head
    if n_head % n_kv_head != 0:
        raise UserError(f"--num-kv-heads={n_kv_head} must divide the number of heads ({n_head})")
    return dict(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd)


def batch_lr_scale(total_batch_size, exponent=0.0):
    """
    How the base learning rates (tuned at 2^19 tokens per step) change with the batch size: lr *= (batch/2^19)^exponent.
    The common square-root rule (exponent 0.5) leaves small-batch runs badly undertrained. Measured on the CPU preset
    (d4, 200 steps of 2,048 tokens, built-in corpus; README "The depth dial at small batch"): val_bpb 1.22 with
    exponent 0.5, 0.73 with 0.25, 0.54 with 0, so the default keeps the base lrs at every batch size (exponent 0);
    every rule agrees at 2^19, so the GPU recipe is unchanged.
    """
    return (total_batch_size / REFERENCE_BATCH) ** exponent


def default_weight_decay(depth, total_batch_size=REFERENCE_BATCH, base=0.2, base_depth=12):
    """
    Weight decay on Muon matrices: 0.2 at depth 12 and 2^19 tokens per step, proportional to 1/depth^2, and shrunk
    with the square root of the batch (decay is applied per step, and small batches take many more steps per token).
    On the CPU preset the unscaled 1/depth^2 value (1.8 at d4) cost 0.05-0.07 val_bpb against 0 or 0.2.
    """
    return base * (base_depth / depth) ** 2 * (total_batch_size / REFERENCE_BATCH) ** 0.5


def grad_accum_steps(total_batch_size, device_batch_size, seq_len, world_size):
    """Micro-steps per optimizer step; refuses (before any compute) a split that is not exact."""
    tokens_per_micro = device_batch_size * seq_len * world_size
    if total_batch_size <= 0 or device_batch_size <= 0:
        raise UserError(f"--total-batch-size and --device-batch-size must be positive (got {total_batch_size}, {device_batch_size})")
    if total_batch_size % tokens_per_micro != 0:
        raise UserError(
            f"--total-batch-size={total_batch_size} is not a multiple of device_batch_size*seq_len*world_size = "
            f"{device_batch_size}*{seq_len}*{world_size} = {tokens_per_micro}; pick a total batch that is a multiple of it")
    return total_batch_size // tokens_per_micro


# -----------------------------------------------------------------------------
# Schedules


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.4, final_lr_frac=0.0):
    """Linear warmup, constant, then linear warmdown to final_lr_frac over the last warmdown_ratio of steps."""
    warmup = round(warmup_ratio * num_iterations)
    warmdown = round(warmdown_ratio * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step <= num_iterations - warmdown:
        return 1.0
    progress = (num_iterations - step) / max(1, warmdown)
    return progress * 1.0 + (1 - progress) * final_lr_frac


def muon_momentum(step, start=0.85, end=0.95, warmup_steps=300):
    frac = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - frac) * start + frac * end


def apply_schedules(optimizers, lrm, momentum=None, weight_decay=None):
    """Scale every group's lr from its initial_lr; weight decay follows the lr schedule."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if "momentum" in group and momentum is not None:
                group["momentum"] = momentum
            if "initial_weight_decay" in group and weight_decay is not None:
                group["weight_decay"] = group["initial_weight_decay"] * lrm


def build_optimizers(model, unembedding_lr, embedding_lr, matrix_lr, weight_decay, adam_betas=(0.8, 0.95)):
    """Muon for the blocks' matrices, AdamW for embedding and lm_head; sharded across ranks when distributed."""
    from nanochat.adamw import build_adamw
    from nanochat.muon import build_muon

    adamw_groups, muon_groups = model.setup_optimizers(
        unembedding_lr=unembedding_lr, embedding_lr=embedding_lr, matrix_lr=matrix_lr,
        weight_decay=weight_decay, adam_betas=adam_betas)
    for group in muon_groups:
        group["initial_weight_decay"] = group["weight_decay"]
    return [build_adamw(adamw_groups), build_muon(muon_groups)]


def train_step(train_model, loader, optimizers, grad_accum, autocast, lrm, momentum, grad_clip=0.0):
    """
    One optimizer step: grad_accum micro-batches forward+backward, then the scheduled optimizer update.
    Each micro-batch's mean loss is divided by grad_accum so the gradients sum to the mean over the step's
    tokens; the sharded optimizers then average across ranks. Returns the step's mean loss over all ranks.
    """
    loss_sum = 0.0
    for _ in range(grad_accum):
        x, y = next(loader)
        with autocast:
            loss = train_model(x, y)
        (loss / grad_accum).backward()
        loss_sum += loss.detach().item()
    device = x.device
    if grad_clip > 0:
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    apply_schedules(optimizers, lrm, momentum=momentum, weight_decay=True)
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return all_reduce_mean(loss_sum / grad_accum, device)


def keep_freed_memory_in_process():
    """
    Make glibc malloc reuse freed memory instead of returning it to the kernel. By default a tensor of more
    than a few MB is its own mmap, unmapped when freed, and the top of the heap is trimmed, so every training
    step page-faults (and zero-fills) its activations anew: 15-75 k faults per CPU step at d4-d6, 5-10 % of
    the step on a 2-core VM. Peak RSS does not grow, since each step needs that memory again. Linux/glibc only;
    a no-op elsewhere.
    """
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 1 << 30)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


# -----------------------------------------------------------------------------
# Stopping cleanly


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop checks it at a step boundary, saves, and exits."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested:  # a second signal means "now"
            raise KeyboardInterrupt
        self.requested = True

    def should_stop(self, device):
        """All ranks must agree, or one would wait forever in the next collective."""
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return flag.item() > 0
        return self.requested


def all_reduce_mean(value, device):
    if dist.is_available() and dist.is_initialized():
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()
    return value


# -----------------------------------------------------------------------------
# Logging helpers


class DummyWandb:
    def log(self, *args, **kwargs):
        pass

    def finish(self):
        pass


def init_wandb(run, config, rank, project="nanochat"):
    """Log to wandb when --run names a run (WANDB_MODE=offline works without network); rank 0 only."""
    if run == "dummy" or rank != 0:
        return DummyWandb()
    import wandb

    return wandb.init(project=project, name=run, config=config)


def format_duration(seconds):
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class StepTimer:
    """Wall time per step, excluding the first few (compile / warmup) from the ETA."""

    def __init__(self, skip=3):
        self.skip, self.count, self.total = skip, 0, 0.0

    def add(self, seconds):
        self.count += 1
        if self.count > self.skip:
            self.total += seconds

    def eta(self, steps_left):
        measured = self.count - self.skip
        return self.total / measured * steps_left if measured > 0 else float("nan")


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts, max_tokens=16):
    """Greedy continuations of short prompts, for a quick look at what the model has learned."""
    out = []
    device = model.get_device()
    bos = tokenizer.get_bos_token_id()
    for prompt in prompts:
        ids = tokenizer.encode(prompt, prepend=bos)
        for _ in range(max_tokens):
            x = torch.tensor([ids[-model.config.sequence_len:]], device=device)
            next_id = int(model(x)[0, -1].argmax())
            if next_id == bos:
                break
            ids.append(next_id)
        out.append(tokenizer.decode(ids[1:]))
    return out

