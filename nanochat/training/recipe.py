"""
The math every training stage shares: the depth dial (model shape, learning rates, weight decay and
token budget from one number), the lr / momentum schedules, the optimizers, gradient-accumulation
arithmetic and one optimizer step. The plumbing around the step (resume, checkpoints, evals,
progress, logs) is nanochat.training.loop; a stage script holds only its recipe.

A smaller card does not stop a run (FittingBatches, at the end): when a micro-batch does not fit in the first steps
of base_train, the device batch is halved and the step taken again with twice the gradient accumulation, so the
global batch, and with it the run, stay the same (the same rows in the same optimizer steps: the losses are those of
a run started at the smaller device batch). Only when one row does not fit does the run stop, with one line naming
the depth and the memory. Every rank agrees before the optimizer update, so a rank that ran out never leaves the
others waiting in a collective, and the data stream is rewound to where the step began.
NANOCHAT_SIMULATE_OOM_ROWS=N makes the device "run out of memory" on any micro-batch of more than N rows (0: on every
one): a rehearsal of a smaller card (the tests' stand-in for one, on the CPU).
"""

import math
import os
from dataclasses import asdict, dataclass

import torch

from nanochat.common import UserError, all_reduce_max, all_reduce_mean, is_out_of_memory, print0
from nanochat.gpt import COMPONENTS, GPT, VARIANT_DEFAULTS, GPTConfig

REFERENCE_BATCH = 2**19  # tokens per step of the GPU recipe, where the base lrs below were tuned
BASE_LRS = {"embedding_lr": 0.2, "unembedding_lr": 0.004, "matrix_lr": 0.02}  # at REFERENCE_BATCH
BASE_WEIGHT_DECAY, BASE_DEPTH = 0.2, 12  # Muon weight decay at depth 12 and REFERENCE_BATCH
# Short runs want hotter lrs: the base lrs from LONG_RUN_STEPS optimizer steps up, SHORT_RUN_LR_SCALE times them
# at SHORT_RUN_STEPS and below (see short_run_lr_scale)
LONG_RUN_STEPS, SHORT_RUN_STEPS, SHORT_RUN_LR_SCALE = 700, 100, 2.0
SCALAR_LR = 0.005  # AdamW lr of the optional components' scalars and gates (gpt.COMPONENTS), at any batch


# -----------------------------------------------------------------------------
# The depth dial


@dataclass
class Recipe:
    """Everything the depth dial decides for a run."""
    model_config: GPTConfig
    embedding_lr: float
    unembedding_lr: float
    matrix_lr: float
    weight_decay: float
    num_iterations: int
    budget: str  # which flag set num_iterations
    num_params: int
    scaling_params: int  # parameters that cost FLOPs (all but the embedding lookup)
    flops_per_token: int

    def lrs(self):
        return {"embedding_lr": self.embedding_lr, "unembedding_lr": self.unembedding_lr,
                "matrix_lr": self.matrix_lr, "weight_decay": self.weight_decay}


def model_config_for_depth(depth, vocab_size, sequence_len, aspect_ratio=64, head_dim=128, n_kv_head=None, components=()):
    """
    n_layer = depth, n_embd = aspect_ratio * depth rounded up to a multiple of head_dim, n_head = n_embd / head_dim;
    `components` names the optional model components (gpt.COMPONENTS) to switch on.
    """
    unknown = sorted(set(components) - set(COMPONENTS))
    if unknown:
        raise UserError(f"unknown model component(s) {', '.join(unknown)}; known: {', '.join(COMPONENTS)}")
    for flag, value in (("--depth", depth), ("--aspect-ratio", aspect_ratio), ("--head-dim", head_dim),
                        ("--max-seq-len", sequence_len)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1 (got {value})")
    if head_dim % 2:
        raise UserError(f"--head-dim must be even for rotary embeddings (got {head_dim})")
    n_embd = ((aspect_ratio * depth + head_dim - 1) // head_dim) * head_dim
    n_head = n_embd // head_dim
    n_kv_head = n_kv_head or n_head
    if n_kv_head < 1 or n_head % n_kv_head != 0:
        raise UserError(f"--num-kv-heads={n_kv_head} must be >= 1 and divide the number of heads ({n_head})")
    return GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_kv_head,
                     n_embd=n_embd, **{name: True for name in components})


def batch_lr_scale(total_batch_size, exponent=0.0):
    """
    How the base learning rates (tuned at 2^19 tokens per step) change with the batch size: lr *= (batch/2^19)^exponent.
    The common square-root rule (exponent 0.5) leaves small-batch runs badly undertrained. Measured on the CPU preset
    (d4, 200 steps of 2,048 tokens, built-in corpus; docs/pretraining.md "The depth dial at small batch"): val_bpb 1.22 with
    exponent 0.5, 0.73 with 0.25, 0.54 with 0, so the default keeps the base lrs at every batch size (exponent 0);
    every rule agrees at 2^19, so the GPU recipe is unchanged.
    """
    return (total_batch_size / REFERENCE_BATCH) ** exponent


def default_weight_decay(depth, total_batch_size=REFERENCE_BATCH):
    """
    Weight decay on Muon matrices: 0.2 at depth 12 and 2^19 tokens per step, proportional to 1/depth^2, and shrunk
    with the square root of the batch (decay is applied per step, and small batches take many more steps per token).
    On the CPU preset the unscaled 1/depth^2 value (1.8 at d4) cost 0.05-0.07 val_bpb against 0 or 0.2.
    """
    return BASE_WEIGHT_DECAY * (BASE_DEPTH / depth) ** 2 * (total_batch_size / REFERENCE_BATCH) ** 0.5


def short_run_lr_scale(num_iterations):
    """
    How much hotter than the base lrs a run of this many optimizer steps trains: 1 from 700 steps up, 2 at 100 steps
    and below, log-linear in the step count between (1.56 at 200 steps). The best lr depends on the horizon: measured
    with `bench quality` (docs/pretraining.md "The depth dial at small batch"), 1x the base lrs is 11 % worse than 2x in a 100-step
    d6 run (built-in corpus) and 2x is 2 % worse than 1x in a 700-step d4 run of Brown; 4x is worse again at 100 steps,
    and 1.56x beats both 1x and 2x at 200 steps. Every recipe of 700 steps or more, the GPU speedrun's and the CPU
    preset's base_train included, keeps the base lrs.
    """
    if num_iterations >= LONG_RUN_STEPS:
        return 1.0
    if num_iterations <= SHORT_RUN_STEPS:
        return SHORT_RUN_LR_SCALE
    progress = math.log(LONG_RUN_STEPS / num_iterations) / math.log(LONG_RUN_STEPS / SHORT_RUN_STEPS)
    return SHORT_RUN_LR_SCALE ** progress


def dial_lr_scale(total_batch_size, lr_batch_exponent=0.0, num_iterations=None):
    """What the dial multiplies the base lrs by: the batch rule, times the short-run raise when num_iterations is given."""
    scale = batch_lr_scale(total_batch_size, lr_batch_exponent)
    if num_iterations is not None:
        scale *= short_run_lr_scale(num_iterations)
    return scale


def dial_lrs(depth, total_batch_size, lr_batch_exponent=0.0, num_iterations=None):
    """
    The three learning rates and Muon's weight decay the dial gives a model of this depth at this batch size,
    raised for a short run when num_iterations is given (the chat stages, which set theirs by --init-lr-frac, do not).
    """
    scale = dial_lr_scale(total_batch_size, lr_batch_exponent, num_iterations)
    return {**{name: lr * scale for name, lr in BASE_LRS.items()},
            "weight_decay": default_weight_decay(depth, total_batch_size)}


def depth_recipe(depth, vocab_size, sequence_len, total_batch_size, aspect_ratio=64, head_dim=128, n_kv_head=None,
                 lr_batch_exponent=0.0, embedding_lr=None, unembedding_lr=None, matrix_lr=None, weight_decay=None,
                 num_iterations=None, target_flops=None, target_param_data_ratio=20.0, short_run_lrs=True, components=()):
    """
    The whole run from (depth, batch): model shape, the three learning rates (base lrs scaled to this batch and,
    with short_run_lrs, raised for a run under 700 steps), Muon weight decay and the number of steps. Any lr / decay
    given explicitly wins over the dial; the token budget is the first of num_iterations, target_flops,
    target_param_data_ratio (tokens per parameter) given. `components`: optional model components to switch on.
    """
    config = model_config_for_depth(depth, vocab_size, sequence_len, aspect_ratio, head_dim, n_kv_head, components)
    with torch.device("meta"):  # shapes only: counts parameters and FLOPs without allocating anything
        model = GPT(config)
    num_params = model.num_params()
    scaling_params = num_params - model.embedding_params()  # an embedding lookup costs no FLOPs
    flops_per_token = model.estimate_flops()
    if num_iterations:
        budget = "--num-iterations"
    elif target_flops:
        num_iterations, budget = round(target_flops / (flops_per_token * total_batch_size)), "--target-flops"
    elif target_param_data_ratio:
        num_iterations = round(target_param_data_ratio * scaling_params / total_batch_size)
        budget = "--target-param-data-ratio"
    else:
        raise UserError("give a token budget: --num-iterations, --target-flops or --target-param-data-ratio > 0")
    num_iterations = max(1, num_iterations)
    dial = dial_lrs(depth, total_batch_size, lr_batch_exponent, num_iterations if short_run_lrs else None)
    return Recipe(
        model_config=config,
        embedding_lr=embedding_lr or dial["embedding_lr"],
        unembedding_lr=unembedding_lr or dial["unembedding_lr"],
        matrix_lr=matrix_lr or dial["matrix_lr"],
        weight_decay=dial["weight_decay"] if weight_decay is None else weight_decay,
        num_iterations=num_iterations, budget=budget,
        num_params=num_params, scaling_params=scaling_params, flops_per_token=flops_per_token,
    )


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


def apply_schedules(optimizers, lrm, momentum=None):
    """
    Scale every group's lr from its initial_lr and set Muon's momentum. Weight decay is not scheduled here:
    the optimizers apply it as p *= 1 - lr * weight_decay with the scheduled lr, so decay already follows the
    lr schedule once (scaling weight_decay by the multiplier too would make it follow the square of it).
    """
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if "momentum" in group and momentum is not None:
                group["momentum"] = momentum


# -----------------------------------------------------------------------------
# Optimizers and one step


OPTIMIZER_COMPONENTS = ("normuon", "cautious_wd", "polar_express")  # Muon options (nanochat.training.optim), off = the plain Muon
# What a new base model gets unless --components says otherwise: the components that lowered real-text val bpb at equal
# FLOPs beyond seed noise at d4 and d6 (BENCHMARKS "Recipe components, one at a time"). 'none' asks for the plain recipe.
DEFAULT_COMPONENTS = "value_embeds,residual_scalars,smear,normuon"


def split_components(text):
    """'a,b,c' -> (model components, optimizer components), each in its canonical order; 'none' (or '') is the plain
    recipe; an unknown name is refused."""
    names = [name.strip() for name in text.split(",") if name.strip() and name.strip() != "none"]
    unknown = sorted(set(names) - set(COMPONENTS) - set(OPTIMIZER_COMPONENTS))
    if unknown:
        raise UserError(f"--components: unknown component(s) {', '.join(unknown)}; known: "
                        f"{', '.join(COMPONENTS + OPTIMIZER_COMPONENTS)}")
    return [n for n in COMPONENTS if n in names], [n for n in OPTIMIZER_COMPONENTS if n in names]


def canonical_components(text):
    """One spelling of a components list, canonical order, '' for the plain recipe ('smear,value_embeds' and
    'value_embeds,smear' are the same recipe); an unknown name is refused."""
    return ",".join(sum(split_components(text), []))


def build_optimizers(model, unembedding_lr, embedding_lr, matrix_lr, weight_decay, adam_betas=(0.8, 0.95),
                     scalar_lr=SCALAR_LR, optimizer_components=()):
    """
    Muon for the blocks' matrices, AdamW for the embeddings, lm_head and the components' scalars; sharded across
    ranks when distributed. `optimizer_components` names Muon options (OPTIMIZER_COMPONENTS) to switch on.
    """
    from nanochat.training.optim import build_adamw, build_muon

    unknown = sorted(set(optimizer_components) - set(OPTIMIZER_COMPONENTS))
    if unknown:
        raise UserError(f"unknown optimizer component(s) {', '.join(unknown)}; known: {', '.join(OPTIMIZER_COMPONENTS)}")
    adamw_groups, muon_groups = model.setup_optimizers(
        unembedding_lr=unembedding_lr, embedding_lr=embedding_lr, matrix_lr=matrix_lr,
        weight_decay=weight_decay, adam_betas=adam_betas, scalar_lr=scalar_lr)
    for group in muon_groups:
        group.update({name: True for name in optimizer_components})
    return [build_adamw(adamw_groups), build_muon(muon_groups)]


def optimizer_components_of(optimizers):
    """The Muon options (OPTIMIZER_COMPONENTS) these optimizers run with, for checkpoint meta."""
    return [name for name in OPTIMIZER_COMPONENTS
            if any(group.get(name) for opt in optimizers for group in opt.param_groups)]


def train_step(model, optimizers, micro_batches, loss_fn, lrm, momentum, autocast, grad_clip=0.0, divisor=None,
               oom_guard=None):
    """
    One optimizer step: forward + backward of loss_fn(model, batch) / divisor for each micro-batch, then the
    scheduled optimizer update. The default divisor, the number of micro-batches, makes the step's objective
    the mean of their mean losses (base training); a stage that weighs tokens differently passes a loss sum
    and its own divisor (SFT: supervised tokens of the whole step, per rank). The gradients summed here are
    this rank's; the sharded optimizers average them across ranks. Returns the objective averaged over ranks.
    oom_guard(failed) -> whether any rank ran out of memory in its passes (StepGuard below): if so,
    the gradients are dropped and DeviceBatchTooLarge raised on every rank before any weight moves.
    """
    divisor = len(micro_batches) if divisor is None else divisor
    device = next(model.parameters()).device
    # The losses are summed on the device and read once, after the optimizer's work is queued: reading one after its
    # backward would make the host wait for the device there, with nothing queued behind it, and the device would then
    # wait for the host to launch the optimizer's kernels one by one.
    total, out_of_memory = torch.zeros((), dtype=torch.float32, device=device), False
    try:
        for batch in micro_batches:
            if oom_guard is not None:
                oom_guard.simulate(batch[0].size(0))  # NANOCHAT_SIMULATE_OOM_ROWS's rehearsal of a smaller device
            with autocast:
                loss = loss_fn(model, batch)
            (loss / divisor).backward()
            total += loss.detach().float()
    except Exception as e:
        if oom_guard is None or not is_out_of_memory(e):
            raise
        out_of_memory = True
    if oom_guard is not None and oom_guard(out_of_memory):
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        raise DeviceBatchTooLarge()
    if grad_clip > 0:
        params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    apply_schedules(optimizers, lrm, momentum=momentum)
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return all_reduce_mean(total / divisor, device)  # the step's one read of the device


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


def config_dict(config):
    """A GPTConfig as the plain dict stored in checkpoint meta. Components that are off are left out, so a checkpoint
    of the plain model has the same meta as before components existed (and a missing one reads as off); so is the
    value embeddings' placement when there are none, and an exact-math variant at its default (gpt.VARIANT_DEFAULTS)."""
    return {name: value for name, value in asdict(config).items() if not (name in COMPONENTS and value is False)
            and not (name == "value_embed_layers" and not config.value_embeds)
            and not (name in VARIANT_DEFAULTS and value == VARIANT_DEFAULTS[name])}


# -----------------------------------------------------------------------------
# A device batch that does not fit: halved, the global batch kept

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
                 resume_state=None, predicted_peak=None):
        self.make_loader, self.depth, self.seq_len, self.device = make_loader, depth, seq_len, device
        self.predicted_peak = predicted_peak  # device batch -> the memory model's peak in bytes, or None
        self.rows_per_step = total_batch_size // (seq_len * world_size)
        self.device_batch_size = device_batch_size
        self.shrunk_from = None  # the device batch the run asked for, once it has had to shrink
        self.loader = make_loader(device_batch_size, resume_state)
        self.steps_taken = 0
        if device.type == "cuda":  # the training's own peak from here on (not the time budget's probe's), for the
            torch.cuda.reset_peak_memory_stats(device)  # prediction to be checked against

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
        print0(f"out of memory at --device-batch-size={self.device_batch_size} on {memory}{self.against_prediction()}: "
               f"going on at {smaller} with {self.rows_per_step // smaller} micro-steps per optimizer step; the global "
               f"batch, and so the run, are unchanged")
        self.loader.close()
        self.loader = self.make_loader(smaller, state)
        self.shrunk_from = self.shrunk_from or self.device_batch_size
        self.device_batch_size = smaller
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def against_prediction(self):
        """How far off the memory model was: its peak for this device batch, beside what the device held when it ran
        out (on CUDA: the most allocated at once, which the failed step's peak exceeds)."""
        if self.predicted_peak is None:
            return ""
        from nanochat.training.memory_model import format_bytes

        predicted = self.predicted_peak(self.device_batch_size)
        if self.device.type != "cuda" or SIMULATED_LIMIT is not None:
            return f" (the memory model predicted a peak of {format_bytes(predicted)})"
        held = torch.cuda.max_memory_allocated(self.device)
        return (f" (the memory model predicted a peak of {format_bytes(predicted)}; {format_bytes(held)} were "
                f"allocated when it ran out, {held / predicted - 1:+.0%} against the prediction, and the step needed more)")
