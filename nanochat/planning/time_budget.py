"""
Training to a wall-clock budget: `base_train --time-budget=4h` probes a few depths on this machine (each fitted to the
card's memory by the memory model first), picks the depth and tokens a scaling law predicts to give the lowest val bpb
in that time (base_train's call: pretraining.py), and calibrates the step count twice before the lr warmdown so that
the process ends on time (BudgetClock, a training-loop callback); the chat stages plan their steps only
(plan_chat_stage). How, for users: docs/time_budget.md; the whole speedrun: pipeline_plan.
"""

import functools
import json
import math
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from nanochat.common import (UserError, json_load_file, all_reduce_max, atomic_write_text, cpu_name, dist_rank_world,
                             dtype_from_env, format_duration, get_base_dir, get_compute_dtype, get_peak_flops,
                             is_out_of_memory, print0, read_json_object)
from nanochat.loop import any_rank_out_of_memory, simulate_out_of_memory, smaller_device_batch

MIN_BUDGET_SECONDS = 30  # start-up, the probe, one evaluation, a few steps and the final save need about this much
PROBE_SECONDS, PROBE_FRACTION = 60.0, 0.1  # the probe takes at most min(60 s, a tenth of the budget)
PLANNED_EVALS = 5  # val bpb at 0, 1/4, 1/2, 3/4 and the end, unless --eval-every says otherwise
CALIBRATE_FRACTION, MIN_CALIBRATE_STEP = 0.1, 10  # the step count is set again a tenth of the way in (10 steps at
SECOND_CALIBRATION = 0.5  # least), and again half of the way in or just before the warmdown, whichever comes first
COMPILE_SECONDS = {"cuda": 60.0, "cpu": 30.0}  # a guess at torch.compile's first steps, until calibration measures them
GUESS_MFU = {"cuda": 0.35, "cpu": 0.45}  # the fraction of peak FLOP/s where the probe starts looking
START_SECONDS = 2.0  # after the plan, before the first step: the model, the data stream, the peak-FLOPs probe
END_SECONDS = {"cuda": 2.0, "cpu": 1.0}  # after the last step and its save: the report, wandb, the exit
SAVE_BYTES_PER_SECOND = 1e9  # a checkpoint's weights and optimizer state onto local disk
MAX_DEPTH = 64


# -----------------------------------------------------------------------------
# Durations


def parse_duration(text, flag="--time-budget"):
    """'90s', '20m', '4h', '1h30m', '2.5h' or plain seconds ('600') -> seconds > 0; anything else is refused."""
    raw = str(text).strip().lower().replace(" ", "")
    parts = re.findall(r"(\d+(?:\.\d*)?|\.\d+)([smhd])", raw)
    if re.fullmatch(r"\d+(?:\.\d*)?|\.\d+", raw):
        seconds = float(raw)
    elif parts and "".join(number + unit for number, unit in parts) == raw:
        seconds = sum(float(number) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit] for number, unit in parts)
    else:
        raise UserError(f"{flag}={text} is not a duration: give a time such as 90s, 20m, 4h or 1h30m")
    if not math.isfinite(seconds) or seconds <= 0:
        raise UserError(f"{flag}={text} must be a positive time, such as 90s, 20m, 4h or 1h30m")
    return seconds


def duration_label(seconds):
    """A budget as a short name for a model tag: 5400 -> '1h30m', 90 -> '1m30s', 300 -> '5m'."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if v) or "0s"


def stage_start_time():
    """When this stage began (epoch seconds): the process's start, or under torchrun its launcher's, so that a budget
    counts the interpreter's and the launcher's start-up too."""
    import psutil

    process = psutil.Process()
    if "TORCHELASTIC_RUN_ID" in os.environ and process.parent() is not None:
        return process.parent().create_time()
    return process.create_time()


def clock(seconds):
    """An epoch time as the wall clock shows it."""
    return time.strftime("%H:%M:%S", time.localtime(seconds))


# -----------------------------------------------------------------------------
# Scaling laws


@dataclass(frozen=True)
class ScalingLaw:
    """val bpb = E + A / N^alpha + B / D^beta (N scaling parameters, D training tokens), measured on a family of models
    of one shape: a plan keeps to that shape unless the flags say otherwise."""
    name: str
    about: str
    E: float
    A: float
    alpha: float
    B: float
    beta: float
    aspect_ratio: int = 64
    head_dim: int = 128

    def predict(self, scaling_params, tokens):
        if tokens <= 0:
            return math.inf
        return self.E + self.A * scaling_params ** -self.alpha + self.B * tokens ** -self.beta


# The GPU law: the reference project's compute-optimal runs, alpha = beta and B = A * 10.5^alpha (N and D scale alike
# there); the CPU laws: our miniseries' fits (BENCHMARKS.md "Scaling laws for --time-budget"; dev/LOG.md)
LAWS = {
    "gpu-reference": ScalingLaw(
        "gpu-reference", "the reference project's compute-optimal runs (its data, tokenizer and recipe), ~10.5 tok/param",
        E=0.5229, A=21.232, alpha=0.255, B=21.232 * 10.5 ** 0.255, beta=0.255, aspect_ratio=64, head_dim=128),
    "cpu-builtin": ScalingLaw("cpu-builtin", "16 CPU miniseries runs on the built-in corpus, d2-d8, 2.5e12-8e13 FLOPs",
                              E=0.2056, A=3775.88, alpha=0.836, B=9573.91, beta=0.836, aspect_ratio=32, head_dim=32),
    "cpu-brown": ScalingLaw("cpu-brown", "12 CPU miniseries runs on the Brown corpus, d2-d6, 2.5e12-2.5e13 FLOPs",
                            E=1.6362, A=141.40, alpha=0.533, B=298.26, beta=0.533, aspect_ratio=32, head_dim=32),
}


def law_for(spec, device_type, data_source):
    """The law a plan uses: --scaling-law's name or file, or for 'auto' the one fitted closest to this run: the GPU
    law on CUDA; on other devices the built-in corpus's fit for the built-in corpus, else Brown's (real text)."""
    if spec in (None, "", "auto"):
        spec = "gpu-reference" if device_type == "cuda" else \
            ("cpu-builtin" if (data_source or "builtin") == "builtin" else "cpu-brown")
    if spec in LAWS:
        return LAWS[spec]
    path = os.path.expanduser(spec)
    if not os.path.isfile(path):
        raise UserError(f"--scaling-law={spec} is neither a law the project ships ({', '.join(LAWS)}) nor a file; "
                        f"give a miniseries' scaling_law.json (docs/time_budget.md)")
    try:
        fields = json_load_file(path)
        fields = fields.get("loss_surface", fields)  # a miniseries' fits.json holds it under this key
        return ScalingLaw(name=fields.get("name", os.path.basename(path)), about=fields.get("about", path),
                          **{k: float(fields[k]) for k in ("E", "A", "alpha", "B", "beta")},
                          aspect_ratio=int(fields.get("aspect_ratio", 64)), head_dim=int(fields.get("head_dim", 128)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"--scaling-law={spec}: not a readable law ({type(e).__name__}: {e}); it needs E, A, alpha, B "
                        f"and beta, as scripts.miniseries writes them to scaling_law.json") from None


# -----------------------------------------------------------------------------
# The plan


@dataclass
class RunPlan:
    """What one budgeted run decided before its first step: base_train's depth, device batch and steps, or a chat
    stage's steps. Saved in every checkpoint's meta.json as 'time_plan'."""
    budget_seconds: float
    started_at: float  # epoch seconds the stage began: the budget ends at started_at + budget_seconds
    law: str
    depth: int
    aspect_ratio: int
    head_dim: int
    device_batch_size: int
    grad_accum: int
    total_batch_size: int
    num_iterations: int
    params: int
    scaling_params: int
    step_seconds: float  # the probe's estimate, then the calibration's measurement
    eval_seconds: float  # one evaluation, estimated, then measured
    end_seconds: float  # after the last step: the final save, samples, the report, the exit
    eval_every: int
    save_every: int
    save_seconds: float
    predicted_bpb: float | None
    calibrate_at: int | None  # the next step the step count is set again at (None: no more, or too short a run)
    calibrated: bool = False  # at least once
    probe: list = field(default_factory=list)  # what the probe measured: [{depth, device_batch_size, step_seconds}]
    checkpoint_activations: bool = False
    memory_limit: int | None = None  # bytes the step was fitted into (None: no memory to fit)
    predicted_peak: int | None = None  # the memory model's peak of the planned step, bytes

    @property
    def deadline(self):
        return self.started_at + self.budget_seconds


@dataclass
class RunShape:
    """What the probe and the plan need of base_train's flags."""
    vocab_size: int
    seq_len: int
    total_batch_size: int
    world_size: int
    aspect_ratio: int
    head_dim: int
    num_kv_heads: int | None
    model_components: list
    optimizer_components: list
    fp8: bool
    max_device_batch: int  # the probe starts here and halves on running out of memory
    eval_tokens: int
    eval_every: int | None  # None: PLANNED_EVALS evaluations
    sample_at_end: bool
    compile_seconds: float  # the guess for torch.compile's first steps (0 when not compiling)
    save_every: int = -1  # periodic checkpoints (--save-every): their time counts too
    memory_limit: int | None = None  # bytes a step must fit in (a GPU's, or NANOCHAT_GPU_MEMORY); None: not planned
    checkpoint_activations: bool | None = False  # None: the plan's choice, only where one row does not fit without
    device_type: str = "cpu"  # what the memory model predicts the step of
    compiled: bool = False
    memory_label: str = ""  # the memory limit in words, for the plan's line


def step_spec(depth, shape, checkpoint_activations=False):
    """The memory model's spec of base_train's step at this depth on shape's device, in its compute dtype (for a GPU
    not here, the one NANOCHAT_DTYPE names, float16 for a T4, else bf16); an eager step on a CPU runs its fused
    Functions where they are on."""
    from nanochat.kernels.cpu import cpu_kernels_enabled
    from nanochat.planning.memory_model import StepSpec

    device_type = shape.device_type
    here = device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available())
    dtype = get_compute_dtype(torch.device(device_type)) if here else dtype_from_env("NANOCHAT_DTYPE") or torch.bfloat16
    dtype = str(dtype).split(".")[-1]
    return StepSpec(depth, shape.seq_len, shape.vocab_size, shape.aspect_ratio, shape.head_dim, shape.num_kv_heads,
                    tuple(shape.model_components), tuple(shape.optimizer_components), dtype, bool(shape.fp8),
                    bool(checkpoint_activations), bool(shape.compiled), device_type=device_type,
                    cpu_ops=device_type == "cpu" and not shape.compiled and cpu_kernels_enabled())


def plan_memory(depth, shape):
    """This depth's device batch and checkpointing within shape.memory_limit (memory_model.fit_step, up to
    shape.max_device_batch); None if one row does not fit."""
    from nanochat.planning.memory_model import fit_step

    rows_per_step = shape.total_batch_size // (shape.seq_len * shape.world_size)
    return fit_step(step_spec(depth, shape), shape.memory_limit, rows_per_step, largest=shape.max_device_batch,
                    checkpoint=shape.checkpoint_activations)


def refuse_impossible_memory(shape, depth=None):
    """Before any work: a memory limit in which not even one row of `depth` fits (of d1, the smallest model, when the
    plan chooses the depth) is refused in one line naming the least memory that would do."""
    from nanochat.planning.memory_model import MEMORY_SHARE, format_bytes, least_memory

    least = least_memory(step_spec(depth or 1, shape), shape.checkpoint_activations)
    if least > shape.memory_limit:
        model = f"--depth={depth}" if depth else "d1, the smallest model,"
        checkpointing = "" if shape.checkpoint_activations is False else " with activation checkpointing"
        raise UserError(f"{shape.memory_label or format_bytes(shape.memory_limit)} is too little for {model} at one row "
                        f"of {shape.seq_len:,} tokens{checkpointing}: give at least {format_bytes(least, up=True)} (its "
                        f"predicted peak is kept within {MEMORY_SHARE * 100:.0f} % of the memory)"
                        + (", or a smaller --depth" if depth else ""))


def meta_recipe(depth, shape):
    """The depth dial's model at this depth, on the meta device: its sizes and FLOPs, nothing allocated."""
    return _meta_recipe(depth, shape.vocab_size, shape.seq_len, shape.total_batch_size, shape.aspect_ratio,
                        shape.head_dim, shape.num_kv_heads, tuple(shape.model_components))


@functools.lru_cache(maxsize=None)
def _meta_recipe(depth, vocab_size, seq_len, total_batch_size, aspect_ratio, head_dim, num_kv_heads, components):
    from nanochat.recipe import depth_recipe

    return depth_recipe(depth, vocab_size, seq_len, total_batch_size, aspect_ratio, head_dim, num_kv_heads,
                        num_iterations=1, components=components)


def evals_between(first, last, every):
    """How many evaluations a run makes at steps first < s <= last: every `every` steps and at the last (only at the
    last when every <= 0: an estimate may count one a run without evaluations does not make)."""
    if last <= first:
        return 0
    if every <= 0:
        return 1
    return last // every - first // every + (0 if last % every == 0 else 1)


def planned_eval_every(num_iterations, given):
    return given if given else max(1, math.ceil(num_iterations / (PLANNED_EVALS - 1)))


def steps_that_fit(seconds, step_seconds, eval_seconds, eval_every, first=0, save_every=-1, save_seconds=0.0):
    """The largest step count N > first whose steps after `first`, evaluations and periodic checkpoints fit in
    `seconds` (first when none)."""
    def cost(n):
        saves = n // save_every - first // save_every if save_every > 0 else 0
        return (n - first) * step_seconds + evals_between(first, n, planned_eval_every(n, eval_every)) * eval_seconds \
            + saves * save_seconds

    n = first + max(0, int(seconds / step_seconds))
    while n > first and cost(n) > seconds:
        n = first + int((n - first) * 0.99)
    return n


@dataclass
class Candidate:
    depth: int
    device_batch_size: int
    step_seconds: float
    num_iterations: int = 0
    predicted_bpb: float = math.inf
    eval_seconds: float = 0.0
    save_seconds: float = 0.0
    end_seconds: float = 0.0
    reused: bool = False  # measured by an earlier probe on this machine (PROBE_FILE), not now
    checkpoint_activations: bool = False
    predicted_peak: int | None = None  # the memory model's, at this device batch


def forecast(candidate, law, shape, deadline, now, device):
    """Fill in the candidate's steps and predicted val bpb, for a run whose first step comes after `now`, and from its
    step time the seconds of an evaluation (a forward pass, a third of a step's work per token, over each rank's share
    of --eval-tokens), of a checkpoint (the weights and optimizer state, ~3x the weights) and of the run's end (the
    final checkpoint, the samples, the exit)."""
    recipe = meta_recipe(candidate.depth, shape)
    micro_batch_tokens = candidate.device_batch_size * shape.seq_len * shape.world_size
    micro_seconds = candidate.step_seconds / (shape.total_batch_size // micro_batch_tokens)
    candidate.eval_seconds = 0.5 + max(1, shape.eval_tokens // micro_batch_tokens) * micro_seconds / 3
    candidate.save_seconds = 0.3 + 12 * recipe.num_params / shape.world_size / SAVE_BYTES_PER_SECOND
    sample_seconds = (3.0 if device.type == "cuda" else 1.0) if shape.sample_at_end else 0.0
    candidate.end_seconds = candidate.save_seconds + sample_seconds + END_SECONDS.get(device.type, 2.0)
    seconds = deadline - now - START_SECONDS - shape.compile_seconds - candidate.end_seconds - candidate.eval_seconds
    candidate.num_iterations = steps_that_fit(seconds, candidate.step_seconds, candidate.eval_seconds, shape.eval_every,
                                              save_every=shape.save_every, save_seconds=candidate.save_seconds)
    candidate.predicted_bpb = law.predict(recipe.scaling_params, candidate.num_iterations * shape.total_batch_size)
    return candidate


# -----------------------------------------------------------------------------
# The probe


class ProbeOutOfMemory(Exception):
    """Some rank ran out of memory in a probe step; every rank raises it at the same point."""


def time_steps(depth, device_batch, shape, device, autocast, seconds, checkpoint_activations=False):
    """Seconds per optimizer step of base_train at this depth and device batch on random tokens: after a warm-up, as
    many as fit in about `seconds` (2 to 6, one count for every rank), a micro-batch and the update timed apart. Running
    out of memory anywhere raises ProbeOutOfMemory on every rank before any optimizer's collective (none waits)."""
    from nanochat.gpt import build_model
    from nanochat.kernels.cpu import use_cpu_kernels
    from nanochat.kernels.fp8 import convert_to_fp8
    from nanochat.recipe import build_optimizers

    def agreed(work):  # a rank that runs out of memory in work() makes every rank raise ProbeOutOfMemory
        failed, result = False, None
        try:
            result = work()
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            failed = True
        if any_rank_out_of_memory(failed, device):
            raise ProbeOutOfMemory()
        return result

    def build():
        recipe = meta_recipe(depth, shape)
        model = use_cpu_kernels(build_model(recipe.model_config, device), device)
        if shape.fp8:
            convert_to_fp8(model)
        model.checkpoint_activations = checkpoint_activations
        return model, build_optimizers(model, **recipe.lrs(), optimizer_components=shape.optimizer_components)

    def forward_backward():
        simulate_out_of_memory(device_batch)
        with autocast:
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        sync()

    model, optimizers = agreed(build)
    x = torch.randint(0, shape.vocab_size, (device_batch, shape.seq_len + 1), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    micro, update, steps, started = [], [], 3, time.perf_counter()
    while len(micro) < steps:
        t0 = time.perf_counter()
        agreed(forward_backward)
        t1 = time.perf_counter()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        micro.append(t1 - t0)
        update.append(time.perf_counter() - t1)
        if len(micro) == 1:  # the warm-up step says how many more fit, the same count on every rank
            first = all_reduce_max([time.perf_counter() - started], device)[0]
            steps = 1 + max(2, min(5, int(seconds / max(first, 1e-6))))
    accum = shape.total_batch_size // (device_batch * shape.seq_len * shape.world_size)
    return accum * statistics.median(micro[1:]) + statistics.median(update[1:])  # the first step warms up


def probe_depth(depth, shape, device, autocast, seconds, device_batch=None, checkpoint_activations=False):
    """(device batch, seconds per step) of base_train at this depth, at the largest device batch that fits (from
    device_batch, default shape.max_device_batch, halving on running out of memory), agreed by every rank; (None, None)
    when one row does not fit."""
    device_batch = device_batch or shape.max_device_batch
    rows_per_step = shape.total_batch_size // (shape.seq_len * shape.world_size)
    while True:
        try:
            step_seconds = time_steps(depth, device_batch, shape, device, autocast, seconds, checkpoint_activations)
            return device_batch, all_reduce_max([step_seconds], device)[0]
        except ProbeOutOfMemory:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        device_batch = smaller_device_batch(device_batch, rows_per_step)
        if device_batch is None:
            return None, None


PROBE_FILE = "time_budget_probe.json"  # in the base dir: what earlier probes measured on this machine


def machine_signature(shape, device):
    """Everything a step time depends on besides the depth: a measurement is reused only under the same signature."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()}, {torch.get_num_threads()} threads"
    return " | ".join(str(v) for v in (
        where, f"torch {torch.__version__}", get_compute_dtype(device), f"x{shape.world_size}", f"T {shape.seq_len}",
        f"batch {shape.total_batch_size}", f"up to {shape.max_device_batch} rows", f"aspect {shape.aspect_ratio}",
        f"head {shape.head_dim}", f"kv {shape.num_kv_heads}", ",".join(shape.model_components + shape.optimizer_components),
        f"fp8 {shape.fp8}")) + (f" | memory {shape.memory_limit} checkpointing {shape.checkpoint_activations}"
                                if shape.memory_limit else "")


def read_measurements(signature):
    """{depth: (device batch, seconds per step)} an earlier probe measured under this signature: read by rank 0 and
    sent to every rank, so that all of them probe the same depths."""
    found = {}
    rank, world_size = dist_rank_world()
    if rank == 0:
        record = read_json_object(os.path.join(get_base_dir(), PROBE_FILE)) or {}  # none yet, or unreadable: measure
        try:
            found = {int(d): (int(m["device_batch_size"]), float(m["step_seconds"]))
                     for d, m in record.get(signature, {}).items()}
        except (ValueError, KeyError, TypeError, AttributeError):
            found = {}  # unreadable: measure again
    if world_size > 1:
        box = [found]
        torch.distributed.broadcast_object_list(box, src=0)
        found = box[0]
    return found


def write_measurements(signature, measurements):
    """Add this probe's {depth: (device batch, seconds per step)} to the base dir's record (rank 0)."""
    if dist_rank_world()[0] != 0 or not measurements:
        return
    path = os.path.join(get_base_dir(), PROBE_FILE)
    record = read_json_object(path) or {}
    entry = record.setdefault(signature, {})
    for depth, (device_batch, step_seconds) in measurements.items():
        entry[str(depth)] = {"device_batch_size": device_batch, "step_seconds": step_seconds,
                             "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")


def guess_depth(law, shape, device, budget_seconds):
    """Where the probe starts: the depth the law prefers if this device trains at GUESS_MFU of its peak FLOP/s."""
    # the fastest rank's peak (a CPU's is measured by each rank apart): every rank must start its walk at the same depth
    # and make the same collectives (dev/LOG.md)
    peak = all_reduce_max([get_peak_flops(device)], device)[0]
    flops_per_second = GUESS_MFU.get(device.type, 0.4) * peak * shape.world_size
    best = None
    for depth in range(1, MAX_DEPTH + 1):
        recipe = meta_recipe(depth, shape)
        tokens = 0.8 * budget_seconds * flops_per_second / recipe.flops_per_token
        bpb = law.predict(recipe.scaling_params, tokens)
        if best is None or bpb < best[0]:
            best = (bpb, depth)
        elif depth > best[1] + 2:  # past the optimum: the prediction only rises from here
            break
    return best[1]


def plan_pretraining(law, shape, budget_seconds, started_at, device, autocast, depth=None, warmdown_ratio=0.4):
    """base_train's plan: probe and choose the depth and the tokens; every rank returns the same plan. `depth`: only
    the tokens are planned."""
    now = lambda: all_reduce_max([time.time()], device)[0]  # noqa: E731 -- every rank decides on the same clock
    started_at = -all_reduce_max([-started_at], device)[0]  # the earliest rank's start
    deadline = started_at + budget_seconds
    allowance = min(PROBE_SECONDS, PROBE_FRACTION * budget_seconds)
    probe_end = now() + allowance  # set again after the first depth, which also pays the process's first-step costs
    signature = machine_signature(shape, device)
    earlier, measured, fresh = read_measurements(signature), {}, {}

    def measure(d):
        fit = plan_memory(d, shape) if shape.memory_limit else None  # before anything runs: does it fit at all?
        if shape.memory_limit and fit is None:
            measured[d] = None
            return None
        checkpointed = fit.checkpoint_activations if fit else bool(shape.checkpoint_activations)
        if d in earlier:
            device_batch, step_seconds = earlier[d]
        else:
            share = max(0.2, min(allowance, probe_end - now()) / 4)  # each depth's timed steps: a share of the time left
            device_batch, step_seconds = probe_depth(d, shape, device, autocast, share,
                                                     fit.device_batch if fit else None, checkpointed)
            if device_batch is not None:
                fresh[d] = (device_batch, step_seconds)
        if device_batch is not None and fit is not None:
            # the run's device batch is the memory model's (compiled, as the run trains); the probe's eager steps may
            # have needed a smaller one, and a step's time hardly depends on it at the same global batch
            device_batch = fit.device_batch
        measured[d] = None if device_batch is None else forecast(
            Candidate(d, device_batch, step_seconds, reused=d in earlier, checkpoint_activations=checkpointed,
                      predicted_peak=fit.memory.peak if fit else None), law, shape, deadline, now(), device)
        return measured[d]

    if shape.memory_limit:
        refuse_impossible_memory(shape, depth)

    if depth is not None:
        measure(depth)
    else:
        start = guess_depth(law, shape, device, budget_seconds)
        best = measure(start)
        while best is None and start > 1:  # the law's favourite does not fit this device's memory: smaller ones
            start -= 1
            best = measure(start)
        probe_end = now() + allowance
        for direction in (1, -1):  # outward from the guess while the prediction improves
            d = start + direction
            while best is not None and 1 <= d <= MAX_DEPTH and now() < probe_end:
                candidate = measure(d)
                if candidate is None or candidate.predicted_bpb >= best.predicted_bpb:
                    break
                best, d = candidate, d + direction
    write_measurements(signature, fresh)
    at = now()
    fitting = [forecast(c, law, shape, deadline, at, device) for c in measured.values() if c is not None]
    if not fitting:
        raise UserError(f"d{min(measured)} does not fit in this device's memory even at --device-batch-size=1 (rows of "
                        f"{shape.seq_len} tokens): give a shorter --max-seq-len, or a smaller --depth")
    chosen = min(fitting, key=lambda c: (c.predicted_bpb, c.depth))
    if chosen.num_iterations < 1:
        raise UserError(f"--time-budget={duration_label(budget_seconds)} leaves no time for a training step after "
                        f"start-up and the probe ({format_duration(at - started_at)}) and one evaluation; give at least "
                        f"{duration_label(math.ceil((at - started_at) * 2 + 10 * chosen.step_seconds + 30))}")
    recipe = meta_recipe(chosen.depth, shape)
    n = chosen.num_iterations
    calibrate_at = max(MIN_CALIBRATE_STEP, round(CALIBRATE_FRACTION * n))
    return RunPlan(budget_seconds=budget_seconds, started_at=started_at, law=law.name, depth=chosen.depth,
                aspect_ratio=shape.aspect_ratio, head_dim=shape.head_dim, device_batch_size=chosen.device_batch_size,
                grad_accum=shape.total_batch_size // (chosen.device_batch_size * shape.seq_len * shape.world_size),
                total_batch_size=shape.total_batch_size, num_iterations=n, params=recipe.num_params,
                scaling_params=recipe.scaling_params, step_seconds=chosen.step_seconds,
                eval_seconds=chosen.eval_seconds, end_seconds=chosen.end_seconds,
                eval_every=planned_eval_every(n, shape.eval_every), save_every=shape.save_every,
                save_seconds=chosen.save_seconds, predicted_bpb=chosen.predicted_bpb,
                calibrate_at=calibrate_at if calibrate_at < (1 - warmdown_ratio) * n else None,
                probe=[{"depth": c.depth, "device_batch_size": c.device_batch_size, "step_seconds": c.step_seconds,
                        "predicted_bpb": c.predicted_bpb, "reused": c.reused} for c in sorted(fitting, key=lambda c: c.depth)],
                checkpoint_activations=chosen.checkpoint_activations, memory_limit=shape.memory_limit,
                predicted_peak=chosen.predicted_peak)


def plan_stage_steps(budget_seconds, started_at, step_seconds, eval_seconds, eval_every, warmdown_ratio, depth,
                     total_batch_size, device_batch_size, grad_accum, device, save_every=-1):
    """A chat stage's plan: only the steps that fit in the budget at a guessed step time (the chat stages' lrs do not
    depend on the step count: a rough guess only moves the calibration). Every rank plans from the same clock."""
    started_at = -all_reduce_max([-started_at], device)[0]
    now = all_reduce_max([time.time()], device)[0]
    end_seconds = END_SECONDS.get(device.type, 2.0) + 1.0  # + the final save of a small model, until one is measured
    seconds = started_at + budget_seconds - now - START_SECONDS - end_seconds - eval_seconds
    n = max(1, steps_that_fit(seconds, step_seconds, eval_seconds, eval_every, save_every=save_every, save_seconds=1.0))
    # set again at the first steps that can be timed, not a tenth of the way: the guess can be far off (the gpu
    # preset's chat_sft, 32 short conversations a step: guessed 11 ms, measured ~0.28 s on a 2-core CPU and 0.5-1 s
    # at d12 on an H200, where a tenth of the guessed steps ran past the whole budget)
    calibrate_at = MIN_CALIBRATE_STEP
    return RunPlan(budget_seconds=budget_seconds, started_at=started_at, law="", depth=depth, aspect_ratio=0, head_dim=0,
                device_batch_size=device_batch_size, grad_accum=grad_accum, total_batch_size=total_batch_size,
                num_iterations=n, params=0, scaling_params=0, step_seconds=step_seconds, eval_seconds=eval_seconds,
                end_seconds=end_seconds, eval_every=eval_every, save_every=save_every, save_seconds=1.0, predicted_bpb=None,
                calibrate_at=calibrate_at if calibrate_at < (1 - warmdown_ratio) * n else None)


def describe_plan(plan, law, probe_seconds, device_label):
    """The plan, before the first step: what was measured, what was chosen, what the law predicts, when it ends."""
    tokens = plan.num_iterations * plan.total_batch_size
    probe = " | ".join(f"d{p['depth']} {p['step_seconds'] * 1000:,.0f} ms/step{' (earlier)' if p.get('reused') else ''}"
                       f" -> {p['predicted_bpb']:.4f}" for p in plan.probe)
    return "\n".join([
        f"plan | budget {format_duration(plan.budget_seconds)} from {clock(plan.started_at)} on {device_label} | law "
        f"{law.name}: val bpb = {law.E:.4g} + {law.A:.4g}/N^{law.alpha:.3g} + {law.B:.4g}/D^{law.beta:.3g} ({law.about})",
        f"plan | probe {probe_seconds:.1f} s, seconds per step of {plan.total_batch_size:,} tokens -> predicted val bpb: "
        f"{probe}",
        f"plan | d{plan.depth}: {plan.params:,} params ({plan.scaling_params:,} scaling), {plan.num_iterations:,} steps x "
        f"{plan.total_batch_size:,} tokens = {tokens / 1e6:,.1f}M tokens ({tokens / plan.scaling_params:.1f} tok/param), "
        f"device batch {plan.device_batch_size} x {plan.grad_accum} accum | predicted val bpb {plan.predicted_bpb:.4f} | "
        f"ends by {clock(plan.deadline)}" + (f" (steps set again at step {plan.calibrate_at})" if plan.calibrate_at else ""),
    ])


def memory_line(plan, label=""):
    """The plan's memory: the predicted peak beside the memory it had to fit in."""
    from nanochat.planning.memory_model import MEMORY_SHARE, format_bytes

    return (f"plan | memory: d{plan.depth} at device batch {plan.device_batch_size}, activation checkpointing "
            f"{'on' if plan.checkpoint_activations else 'off'}: predicted peak {format_bytes(plan.predicted_peak)} of "
            f"{label or format_bytes(plan.memory_limit)} (planned within {MEMORY_SHARE * 100:.0f} %)")


# -----------------------------------------------------------------------------
# Keeping to it


class BudgetClock:
    """Keeps a budgeted run on time: twice before the lr warmdown (a tenth and half of the way in) the run's own seconds
    per step (since the last calibration: a machine that slows down mid-run is caught) and per evaluation replace the
    estimates and set the step count for the rest of the budget. Only the process that made the plan calibrates (a
    resumed run follows its checkpoint's plan); with no plan it does nothing."""

    def __init__(self, plan, active, warmdown_ratio, eval_name="val_bpb"):
        self.plan, self.active, self.warmdown_ratio, self.eval_name = plan, active, warmdown_ratio, eval_name
        self.timed = (0.0, 0)  # the loop timer's (total seconds, steps) at the last calibration
        # the step the training loop calls on_step_end (calibrate) after, None: never; a plain number, which the loop
        # reads, so that a step that does not calibrate runs none of this module's code
        self.call_at_step = plan.calibrate_at if active else None

    def on_step_end(self, loop):
        """The training loop's callback after step call_at_step."""
        self.calibrate(loop)

    def checkpoint_meta(self):
        """What a budgeted run adds to every checkpoint's meta.json: its plan, which a resume follows."""
        return {"time_plan": plan_dict(self.plan)} if self.plan else {}

    def calibrate(self, loop):
        """Set loop.num_iterations for the rest of the budget from what the loop measured (agreed by every rank), and
        the plan the checkpoints record; plan the second calibration after the first."""
        plan, step, timer = self.plan, loop.step, loop.timer
        total, count = timer.total - self.timed[0], timer.count - max(timer.skip, self.timed[1])
        step_seconds, eval_seconds, save_seconds, now = all_reduce_max(
            [total / count if count > 0 else math.nan, loop.eval_seconds.get(self.eval_name, plan.eval_seconds),
             plan.save_seconds if loop.save_seconds is None else loop.save_seconds, time.time()], loop.device)
        if not math.isfinite(step_seconds):
            step_seconds = plan.step_seconds
        # a measured checkpoint replaces the estimate, for the saves to come and the final one (dev/LOG.md)
        plan.end_seconds, plan.save_seconds = plan.end_seconds - plan.save_seconds + save_seconds, save_seconds
        n = steps_that_fit(plan.deadline - now - plan.end_seconds, step_seconds, eval_seconds, plan.eval_every, first=step,
                           save_every=plan.save_every, save_seconds=plan.save_seconds)
        n = max(n, step + 1, math.ceil(step / (1 - self.warmdown_ratio)))  # the warmdown must not have begun
        end = now + (n - step) * step_seconds + evals_between(step, n, plan.eval_every) * eval_seconds + plan.end_seconds
        print0(f"plan | step {step}: {step_seconds * 1000:,.1f} ms a step (estimated {plan.step_seconds * 1000:,.1f}), "
               f"{eval_seconds:.1f} s an evaluation (estimated {plan.eval_seconds:.1f}): {plan.num_iterations:,} -> "
               f"{n:,} steps, ending by {clock(end)}")
        second = round(min(SECOND_CALIBRATION, 0.9 * (1 - self.warmdown_ratio)) * n)  # before the warmdown
        plan.calibrate_at = second if not plan.calibrated and step < second < (1 - self.warmdown_ratio) * n else None
        self.call_at_step = plan.calibrate_at
        plan.num_iterations, plan.step_seconds, plan.eval_seconds, plan.calibrated = n, step_seconds, eval_seconds, True
        self.timed = (timer.total, timer.count)
        loop.num_iterations = n
        loop.meta["time_plan"] = plan_dict(plan)

    def finish(self, loop):
        """One line after the last step: the time taken against the budget, the val bpb against the prediction."""
        if not self.active:
            return
        used, bpb = time.time() - self.plan.started_at, loop.last.get("val_bpb")
        print0(f"plan | trained by {clock(time.time())}, {format_duration(used)} into the "
               f"{format_duration(self.plan.budget_seconds)} budget ({100 * (used / self.plan.budget_seconds - 1):+.1f} %)"
               + (f" | val bpb {bpb:.4f}, predicted {self.plan.predicted_bpb:.4f}"
                  if bpb is not None and self.plan.predicted_bpb is not None else ""))

    def report(self):
        """The report card's lines for a budgeted run."""
        if self.plan is None:
            return {}
        if self.plan.predicted_bpb is None:  # a chat stage: the steps only
            return {"Time budget": format_duration(self.plan.budget_seconds)}
        return {"Time budget": format_duration(self.plan.budget_seconds), "Planned depth": self.plan.depth,
                "Scaling law": self.plan.law, "Predicted val bpb": round(self.plan.predicted_bpb, 4)}


plan_dict = asdict  # a RunPlan as the checkpoints' 'time_plan'


def plan_from_dict(fields):
    return RunPlan(**{k: v for k, v in fields.items() if k in RunPlan.__dataclass_fields__})


# -----------------------------------------------------------------------------
# A chat stage's steps


def add_time_budget_flag(parser):
    """A chat stage's --time-budget (base_train's is pretraining.add_planning_flags')."""
    parser.add_argument("--time-budget", default=None, help="wall time for the whole stage (90s, 20m, 4h): the steps "
                        "that fit in it, instead of --num-iterations (docs/time_budget.md)")


def check_time_budget_flag(args):
    """A chat stage's --time-budget as seconds, before any work; it sets the number of steps itself."""
    if args.time_budget is None:
        return
    args.time_budget = parse_duration(args.time_budget)
    if args.num_iterations is not None:
        raise UserError("--time-budget sets the number of steps itself: drop --num-iterations")


def plan_chat_stage(args, start, model, device, world_size, step_tokens, eval_tokens, eval_name):
    """
    A chat stage's --time-budget as a BudgetClock (call_at_step None without one); sets args.num_iterations. A resume
    follows its checkpoint's plan; a new run plans the steps that fit from a guess at seconds per step (step_tokens on
    all ranks, forward and backward, at GUESS_MFU of peak; eval_tokens forward only), set again from measured steps.
    """
    saved = (start.meta or {}).get("time_plan")
    if saved:
        args.num_iterations = start.meta["num_iterations"]
        print0(f"plan | resuming a run planned for {duration_label(saved['budget_seconds'])}: {args.num_iterations:,} "
               "steps, as saved")
        return BudgetClock(plan_from_dict(saved), active=False, warmdown_ratio=args.warmdown_ratio, eval_name=eval_name)
    if not args.time_budget:
        return BudgetClock(None, active=False, warmdown_ratio=args.warmdown_ratio)
    if start.meta is not None:
        raise UserError("this checkpoint was not trained to a time budget: drop --time-budget to resume it")
    flops_per_second = GUESS_MFU.get(device.type, 0.4) * get_peak_flops(device) * world_size
    step_seconds = model.estimate_flops() * step_tokens / flops_per_second
    eval_seconds = 0.5 + model.estimate_flops() / 3 * eval_tokens / flops_per_second
    plan = plan_stage_steps(args.time_budget, stage_start_time(), step_seconds, eval_seconds, args.eval_every,
                            args.warmdown_ratio, model.config.n_layer, args.total_batch_size, args.device_batch_size, 1,
                            device, args.save_every)
    args.num_iterations = plan.num_iterations
    print0(f"plan | budget {duration_label(plan.budget_seconds)}, ending by {clock(plan.deadline)}: {plan.num_iterations:,} "
           f"steps at a guessed {step_seconds * 1000:,.0f} ms each" +
           (f", set again from measured steps at step {plan.calibrate_at}" if plan.calibrate_at else ""))
    return BudgetClock(plan, active=True, warmdown_ratio=args.warmdown_ratio, eval_name=eval_name)
