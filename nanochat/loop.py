"""
The training step and what every stage does around it, written once: train_step (one optimizer step: forward and
backward of each micro-batch, then both optimizers; in fp16 on a dynamic loss scale), and TrainingLoop (resume,
periodic / final / on-signal saves, eval cadence, the progress line with tok/s, MFU and ETA, peak memory, wandb), and
base_train's FittingBatches (a device batch that runs out of memory in the first steps is halved, the global batch
kept). A stage script reads:

    start = resume_from(ckpt_dir, step, model, optimizers, ...)      # when --resume, else StartPoint()
    loader = DataLoader(..., resume_state=start.loader_state)
    loop = TrainingLoop(RunSettings(name, ckpt_dir, num_iterations, ...), model, optimizers, loader, start, device,
                        autocast, callbacks=[TrainingReport(name)])
    for step in loop.steps():           # a checkpoint is written here when due, before any eval of that step
        if loop.due(args.eval_every):
            loop.evaluate("val_bpb", evaluate_val_bpb)
        if step == loop.num_iterations:
            break
        t0 = time.perf_counter()
        lrm = lr_multiplier(step, loop.num_iterations, ...)
        loss = train_step(model, optimizers, next(loader), lrm, muon_momentum(step), autocast)
        loop.end_step(loss, t0, lrm=lrm)  # progress line and logs; after a stop signal steps() saves and ends
    loop.finish("Base model training", [...])

Add-ons attach to a run as callbacks (the report's curves and section, a time budget's calibration): objects with any
of on_start(loop); on_step_end(loop), called after the step whose number the callback holds in its attribute
call_at_step (None: none; so that a callback acting at a few steps runs none of its code at the others);
on_checkpoint(loop, records) (a checkpoint is about to be written: the steps' and evaluations' records since the last
one, which a resume from it will not repeat); and on_finish(loop, section, data, records) (the stage's lines for the
report card, and the last records). Called in the order given.
"""

import json
import math
import os
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanochat.checkpoint_manager import check_compatible, load_checkpoint, load_meta, save_checkpoint
from nanochat.common import (UserError, all_reduce_max, all_reduce_mean, dist_rank_world, format_bytes, format_duration,
                             get_peak_flops, is_out_of_memory, peak_memory_mib, print0, set_memory_advice)
from nanochat.loss_eval import describe_eval
from nanochat.optim import step_optimizers


@dataclass
class StartPoint:
    step: int = 0
    loader_state: dict | None = None  # this rank's dataloader state, for an exact continuation
    loop_state: dict = field(default_factory=dict)
    meta: dict | None = None  # the checkpoint's meta when resuming


def resume_from(ckpt_dir, step, model, optimizers, model_config, tokenizer_hash, device):
    """Load a checkpoint into the model and optimizers (every rank its own optimizer shard) and say where to go on."""
    rank, world_size = dist_rank_world()
    meta = load_meta(ckpt_dir, step)  # checked before any file is read: a rank with no shard of its own must say why
    check_compatible(meta, model_config, tokenizer_hash, ckpt_dir)
    if meta.get("world_size", 1) != world_size:
        raise UserError(f"checkpoint {ckpt_dir} step {step} was written by {meta.get('world_size')} ranks; resume with the "
                        f"same number of ranks (got {world_size}) so the sharded optimizer state and data order line up")
    model_state, optim_states, meta = load_checkpoint(ckpt_dir, step, device, rank=rank)
    model.load_state_dict(model_state, strict=True)
    for opt, state in zip(optimizers, optim_states):
        opt.load_state_dict(state)
    return StartPoint(step=step, loader_state=meta["dataloader_states"][rank], loop_state=meta.get("loop_state", {}),
                      meta=meta)


class StopSignal:
    """
    SIGTERM / SIGINT: save at the next step boundary and exit 0. Launchers often deliver one stop twice (a process-group
    SIGTERM plus the copy `uv run` or torchrun forwards), so repeats are ignored; only a second Ctrl-C while the save
    is being written aborts at once (KeyboardInterrupt).
    """

    def __init__(self):
        self.requested = False
        self.saving = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested and self.saving and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.requested:
            print0(f"received {signal.Signals(signum).name}: stopping at the end of this step, after a checkpoint")
        self.requested = True

    def should_stop(self, device):
        """All ranks must agree, or one would wait forever in the next collective."""
        return all_reduce_max([1.0 if self.requested else 0.0], device)[0] > 0


class StepTimer:
    """Wall time per step, excluding the first few (compile / warmup) from the ETA."""

    def __init__(self, skip=3):
        self.skip, self.count, self.total = skip, 0, 0.0

    def add(self, seconds):
        self.count += 1
        if self.count > self.skip:
            self.total += seconds

    def mean(self):
        """Seconds per step after the first few; NaN before any."""
        measured = self.count - self.skip
        return self.total / measured if measured > 0 else float("nan")


def smaller_batch_advice(device_batch_size, total_batch_size):
    """What to try when a micro-batch does not fit: the largest device batch that divides this one, so the global
    batch still splits exactly into micro-steps."""
    smaller = smaller_device_batch(device_batch_size, device_batch_size)
    if smaller is None:
        return "--device-batch-size is 1 already; try a shorter --max-seq-len, a smaller --depth, or more GPUs"
    return (f"try --device-batch-size={smaller}; gradient accumulation keeps the global batch (--total-batch-size="
            f"{total_batch_size}) with {device_batch_size // smaller}x the micro-steps per optimizer step")


def gather_loader_states(state):
    """Every rank's dataloader state, so rank r can resume exactly where it was."""
    state = json.loads(json.dumps(state))  # plain JSON types, as they will be stored
    if dist_rank_world()[1] > 1:
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, state)
        return states
    return [state]


# -----------------------------------------------------------------------------
# One optimizer step


def train_step(model, optimizers, micro_batches, loss_fn, lrm, momentum, autocast, grad_clip=0.0, divisor=None,
               fitting=None):
    """
    One optimizer step, every stage's: forward and backward of loss_fn(model, batch) / divisor for each micro-batch,
    then Muon and AdamW at the scheduled lr and momentum (optim.step_optimizers, which averages the gradients across
    ranks). The default divisor, the number of micro-batches, makes the objective the mean of their mean losses; a
    stage that weighs tokens differently passes a loss sum and its own divisor (SFT: the step's supervised tokens per
    rank). fitting: base_train's FittingBatches, which gave these micro-batches: in its first steps a pass that runs
    out of memory on any rank is taken again from the same data at a smaller device batch, every rank agreeing before
    any weight moves. Under float16 autocast the backward passes run on the loss times a dynamic scale, and a step
    whose gradients hold an inf or NaN on any rank moves no weight (loss_scaler, step_scaled). Returns the objective
    averaged over ranks.
    """
    per_micro_batch = divisor is None
    device = next(model.parameters()).device
    scaler = loss_scaler(optimizers, autocast)
    while True:
        # summed on the device and read once, after the optimizers' work is queued: a read after each backward would
        # make the host wait for the device, which would then wait for the host to launch the optimizers' kernels
        total, ran_out = torch.zeros((), dtype=torch.float32, device=device), False
        divisor = len(micro_batches) if per_micro_batch else divisor
        try:
            if fitting is not None:
                fitting.rehearse_out_of_memory()
            for batch in micro_batches:
                with autocast:
                    loss = loss_fn(model, batch)
                (loss / divisor if scaler is None else scaler.scale(loss / divisor)).backward()
                total += loss.detach()
        except Exception as error:
            if fitting is None or not fitting.recovers_from(error):
                raise
            ran_out, loss = True, None  # the failed pass's graph is let go before a smaller batch is tried
        if fitting is None or fitting.every_rank_fitted(ran_out):
            break
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        micro_batches = fitting.shrink()  # the same rows at half the device batch, twice the micro-steps
    if scaler is None:
        step_optimizers(optimizers, lrm, momentum, grad_clip)
    else:
        step_scaled(scaler, optimizers, lrm, momentum, grad_clip, device)
    return all_reduce_mean(total / divisor, device)  # the step's one read of the device


# float16's gradients: its smallest number is 6e-8 (bf16's and fp32's 1e-38), so a backward in fp16 runs on the loss
# times a scale that lifts them out of underflow, lowered whenever they overflow instead (torch.amp.GradScaler)
LOSS_SCALE_START = 2.0 ** 16  # GradScaler's own; it halves at each overflow and doubles after 2,000 steps without one


def loss_scaler(optimizers, autocast):
    """The GradScaler of a run whose forward passes run under float16 autocast, else None (bf16 has fp32's range).
    One per run, kept on its first optimizer: train_step, TrainingLoop's checkpoints and a resume all find it there."""
    if getattr(autocast, "fast_dtype", None) != torch.float16:
        return None
    holder = optimizers[0]
    if not hasattr(holder, "loss_scaler"):
        device = holder.param_groups[0]["params"][0].device
        holder.loss_scaler = torch.amp.GradScaler(device.type, init_scale=LOSS_SCALE_START)
    return holder.loss_scaler


def step_scaled(scaler, optimizers, lrm, momentum, grad_clip, device):
    """step_optimizers on gradients of a scaled loss: unscaled first (so that clipping and the optimizers see the
    true ones), then the update skipped on every rank if any rank's hold an inf or NaN (the optimizers average them
    across ranks, so one rank's inf would reach all), and the scale updated: lowered after a skip, on every rank
    alike. Reading the verdict is one more wait for the device per step, in fp16 only."""
    for opt in optimizers:
        scaler.unscale_(opt)
    # each optimizer's inf/NaN flags (one per device), as unscale_ left them for GradScaler.update() to read (its private
    # record: tests/test_fp16.py's two ranks fail if torch moves it), set to every rank's verdict: the scales move alike
    flags = [flag for opt in optimizers for flag in scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()]
    found = torch.stack([flag.to(device) for flag in flags]).amax()
    if dist_rank_world()[1] > 1:
        dist.all_reduce(found, op=dist.ReduceOp.MAX)
    for flag in flags:
        flag.copy_(found)
    skipped = bool(found.item())
    if skipped:  # parameters and optimizer state stay as they were; only the scale moves
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
    else:
        step_optimizers(optimizers, lrm, momentum, grad_clip)
    scaler.update()
    if skipped:
        print0(f"float16: an inf or NaN gradient; this step's update skipped, loss scale now {scaler.get_scale():g}")


def lm_loss(model, batch):
    """The language-modelling loss of an (inputs, targets) micro-batch: the mean over its targets."""
    inputs, targets = batch
    return model(inputs, targets)


# -----------------------------------------------------------------------------
# The loop


@dataclass
class RunSettings:
    """What a stage fixes for its whole run: what every checkpoint records, and how often checkpoints are written."""
    name: str  # the report curve and the progress line
    ckpt_dir: str
    num_iterations: int
    user_config: dict  # the stage's flags, as recorded in every checkpoint
    model_config: dict
    tokenizer_hash: str
    tokens_per_step: int | None  # None: each step reports its own count to end_step (SFT, RL)
    flops_per_token: float | None = None  # None: no MFU
    save_every: int = -1
    keep_last: int = 2
    run: str = "dummy"  # the wandb run ("dummy": none)
    meta: dict = field(default_factory=dict)  # what else goes in each checkpoint's meta.json (lrs, batch geometry)


class TrainingLoop:
    """Bookkeeping for one stage's run of `settings.num_iterations` optimizer steps. `loader`: anything with
    state_dict(), saved with every checkpoint; `start`: StartPoint() or resume_from()'s."""

    def __init__(self, settings, model, optimizers, loader, start, device, autocast, callbacks=()):
        self.settings = s = settings
        self.num_iterations, self.meta = s.num_iterations, s.meta
        self.model, self.optimizers, self.loader = model, optimizers, loader
        self.device, self.autocast = device, autocast
        if start.step > s.num_iterations:  # its lr schedule would run past its end, into negative lrs
            raise UserError(f"this run's {s.num_iterations} steps (--num-iterations) end before step {start.step}, where "
                            f"{s.ckpt_dir} resumes; give --num-iterations of at least {start.step}")
        self.start_step = self.step = start.step
        self.total_train_time = start.loop_state.get("total_train_time", 0.0)
        self.last = dict(start.loop_state.get("last", {}))  # eval name -> latest value
        self.eval_seconds = {}  # eval name -> seconds its latest run took in this process
        self.save_seconds = None  # seconds the latest checkpoint took to write in this process
        self.best = dict(start.loop_state.get("best", {}))  # eval name -> lowest value
        self.scaler = loss_scaler(optimizers, autocast)  # float16's loss scale, saved with every checkpoint
        if self.scaler and start.loop_state.get("loss_scale"):  # (one saved in another dtype means nothing here)
            self.scaler.load_state_dict(start.loop_state["loss_scale"])
        self.peak_flops = get_peak_flops(device) * dist_rank_world()[1] if s.flops_per_token else None
        self.stopper = StopSignal()
        self.timer = StepTimer()
        self.callbacks = list(callbacks)
        self.records = []  # each step's and evaluation's numbers since the last checkpoint, for the callbacks
        self.wandb = None  # on rank 0 when --run names a wandb run (WANDB_MODE=offline works without network)
        if s.run != "dummy" and dist_rank_world()[0] == 0:
            import wandb

            self.wandb = wandb.init(project="nanochat", name=s.run, config=s.user_config)
        batch = s.user_config["device_batch_size"]
        set_memory_advice(f"{s.name} (depth {model.config.n_layer}, --device-batch-size={batch})",
                          smaller_batch_advice(batch, s.user_config["total_batch_size"]))
        self.call("on_start")

    def announce(self, summary):
        """Print the run's one-line config: the stage's summary, its lrs, where it resumes, and the flags the device's
        preset filled (presets.fill_from_preset)."""
        lrs = " ".join(f"{k} {v:.4g}" for k, v in self.meta.get("lrs", {}).items())
        resume = f" | resuming at step {self.start_step}" if self.start_step else ""
        preset = self.settings.user_config.get("preset")
        print0(f"{summary}{' | ' + lrs if lrs else ''}{resume}{' | ' + preset if preset else ''}")

    # -- the iteration -------------------------------------------------------------------

    def steps(self):
        """
        Yield start..num_iterations. Before yielding a step due a checkpoint (every save_every, and the last) it saves,
        so a failing eval never loses the model. After a step that a stop signal arrived during, it saves and ends.
        """
        every = self.settings.save_every
        while True:
            due = self.step == self.num_iterations or (every > 0 and self.step % every == 0)
            if self.step > self.start_step and due:
                self.save()
            yielded = self.step
            yield self.step
            if self.step == yielded:  # the body took no step: it was the last one
                return
            if self.stopper.should_stop(self.device):
                print0(f"stop requested: saving step {self.step} and exiting; continue later with --resume")
                self.save()
                return

    def due(self, every, at_zero=True, at_ends=False):
        """
        Whether a job of this period runs at the current step: every `every` steps and at the last. Never at the step a
        run resumed from (it ran before that checkpoint), except the last (saved before its final evaluations, which a
        resume redoes). at_zero=False skips step 0; every <= 0: never, or with at_ends only at the first and last step.
        """
        if self.step == self.start_step and 0 < self.start_step < self.num_iterations:
            return False
        if self.step == 0 and not at_zero:
            return False
        if every is None or every <= 0:
            return at_ends and self.step in (0, self.num_iterations)
        return self.step == self.num_iterations or self.step % every == 0

    def evaluate(self, name, fn, fmt="{:.4f}"):
        """Run fn() in eval mode under autocast, time it, print and log it, remember the last and best. fn returns a
        number, or (number, tokens, ran_out) from loss_eval, whose reach is printed too."""
        t0 = time.time()
        self.model.eval()
        with self.autocast:
            result = fn()
        self.model.train()
        value, reach = (result[0], f" | {describe_eval(*result[1:])}") if isinstance(result, tuple) else (result, "")
        self.eval_seconds[name] = time.time() - t0
        self.last[name] = value
        self.best[name] = min(value, self.best.get(name, math.inf))
        print0(f"step {self.step:05d} | {name} {fmt.format(value)}{reach} | ({time.time() - t0:.1f}s)")
        if self.wandb:
            self.wandb.log({"step": self.step, name: value})
        self.records.append({"step": self.step, name: value})
        return value

    def end_step(self, loss, t0, lrm=None, tokens=None, **extra):
        """After an optimizer step that began at perf_counter() t0: check the loss, time, print, log. tokens: positions
        the step's forward passes processed on every rank, for stages whose steps differ (default: tokens_per_step)."""
        if not math.isfinite(loss):
            raise UserError(f"loss is {loss} at step {self.step}; stopping without saving. The last good checkpoint is in "
                            f"{self.settings.ckpt_dir}; lower the learning rates or check the data, then --resume")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.step += 1
        self.timer.add(dt)
        self.total_train_time += dt
        record = {"step": self.step, "train_loss": loss}
        parts = [f"step {self.step:05d}/{self.num_iterations:05d} ({100 * self.step / self.num_iterations:5.1f}%)",
                 f"loss {loss:.6f}"]
        if lrm is not None:
            record["lrm"] = lrm
            parts.append(f"lrm {lrm:.3f}")
        for key, value in extra.items():
            record[key] = value
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        parts.append(f"{dt * 1000:.0f} ms")
        tokens = tokens or self.settings.tokens_per_step
        if tokens:
            record["tok_per_sec"] = tokens / dt
            parts.append(f"{record['tok_per_sec']:,.0f} tok/s")
        if tokens and self.peak_flops:
            record["mfu"] = 100 * self.settings.flops_per_token * tokens / dt / self.peak_flops
            parts.append(f"MFU {record['mfu']:.1f}%")
        parts.append(f"ETA {format_duration(self.timer.mean() * (self.num_iterations - self.step))}")
        print0(" | ".join(parts))
        if self.wandb:
            self.wandb.log({"step": self.step, **{"train/" + k.removeprefix("train_"): v for k, v in record.items() if k != "step"}})
        self.records.append(record)
        for callback in self.callbacks:
            if getattr(callback, "call_at_step", None) == self.step:
                callback.on_step_end(self)

    # -- checkpoints ---------------------------------------------------------------------

    def save(self):
        s = self.settings
        if not all(torch.isfinite(p).all() for p in self.model.parameters()):
            raise UserError(f"weights are not finite at step {self.step}; not saving over the last good checkpoint in "
                            f"{s.ckpt_dir}. Lower the learning rates, then --resume")
        meta = {"model_config": s.model_config, "user_config": s.user_config, "num_iterations": self.num_iterations,
                "finished": self.step >= self.num_iterations,
                "tokenizer_hash": s.tokenizer_hash, "dataloader_states": gather_loader_states(self.loader.state_dict()),
                "loop_state": {"total_train_time": self.total_train_time, "last": self.last, "best": self.best,
                               **({"loss_scale": self.scaler.state_dict()} if self.scaler else {})},
                **self.meta}
        self.call("on_checkpoint", self.records)  # first: the records up to a checkpoint are kept before it exists
        self.records = []
        self.stopper.saving = True
        t0 = time.time()
        try:
            save_checkpoint(s.ckpt_dir, self.step, self.model, self.optimizers, meta, keep_last=s.keep_last)
        finally:
            self.stopper.saving = False
        self.save_seconds = time.time() - t0

    def call(self, hook, *args):
        """Each callback's `hook`, where it has one."""
        for callback in self.callbacks:
            if hasattr(callback, hook):
                getattr(callback, hook)(self, *args)

    # -- the end -------------------------------------------------------------------------

    def finish(self, section, data):
        """The stage's lines for the report card (its own data, then the loop's numbers), to the callbacks, and a
        one-line summary."""
        summary = {"Steps completed": self.step, "Stopped early": self.step < self.num_iterations,
                   "Total training time": format_duration(self.total_train_time),
                   "Peak memory (MiB)": peak_memory_mib(self.device)}
        for name, value in self.last.items():
            summary[f"Final {name}"] = value
            summary[f"Minimum {name}"] = self.best[name]
        self.call("on_finish", section, [self.settings.user_config, *data, summary], self.records)
        self.records = []
        evals = " | ".join(f"{name} {value:.4f}" for name, value in self.last.items())
        print0(f"done: {self.step}/{self.num_iterations} steps in {format_duration(self.total_train_time)}"
               + (f" | {evals}" if evals else "") + f" | checkpoint {self.settings.ckpt_dir}")
        if self.wandb:
            self.wandb.finish()


# -----------------------------------------------------------------------------
# base_train's batches: a device batch that does not fit, halved with the global batch kept

GUARDED_STEPS = 3  # the first optimizer steps of a process allocate everything it will need (activations, states)
# NANOCHAT_SIMULATE_OOM_ROWS=N or N@S: more than N rows do not fit, from the S-th step of the process (default 0) on;
# a rehearsal of a smaller card (the tests' stand-in for one, on the CPU)
_simulated = os.environ.get("NANOCHAT_SIMULATE_OOM_ROWS", "")
SIMULATED_LIMIT = int(_simulated.split("@")[0]) if _simulated else None
SIMULATED_FROM_STEP = int(_simulated.split("@")[1]) if "@" in _simulated else 0


def simulate_out_of_memory(rows, step=0):
    """Raise CUDA's out-of-memory error for a micro-batch of more rows than NANOCHAT_SIMULATE_OOM_ROWS allows."""
    if SIMULATED_LIMIT is not None and rows > SIMULATED_LIMIT and step >= SIMULATED_FROM_STEP:
        raise torch.OutOfMemoryError(f"simulated: {rows} rows > NANOCHAT_SIMULATE_OOM_ROWS={_simulated}")


def any_rank_out_of_memory(failed, device):
    """True on every rank when any rank ran out of memory (every rank must call it, at the same point)."""
    return all_reduce_max([1.0 if failed else 0.0], device)[0] > 0


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
    base_train's batches, one optimizer step's micro-batches at a time (next_step), from make_loader(device_batch_size,
    resume_state). When some rank runs out of memory in the first steps, every rank learns it before the optimizers
    move (every_rank_fitted, called by train_step), and shrink() halves the device batch and rewinds the stream to
    where the step began: the same rows in the same optimizer steps, with twice the micro-steps. Only a row that does
    not fit stops the run. checkpoint_meta: the dict the checkpoints' meta.json is made from (RunSettings.meta), where
    the device batch a resume starts at is kept.
    """

    def __init__(self, make_loader, device_batch_size, total_batch_size, seq_len, world_size, depth, device,
                 resume_state=None, predicted_peak=None, checkpoint_meta=None):
        self.make_loader, self.depth, self.seq_len, self.device = make_loader, depth, seq_len, device
        self.checkpoint_meta = {} if checkpoint_meta is None else checkpoint_meta
        self.predicted_peak = predicted_peak  # device batch -> the memory model's peak in bytes, or None
        self.rows_per_step = total_batch_size // (seq_len * world_size)
        self.device_batch_size = device_batch_size
        self.loader = make_loader(device_batch_size, resume_state)
        self.steps_taken = 0
        self.step_start = None  # in a guarded step, the stream's state where it began: a retry starts there again
        if device.type == "cuda":  # the training's own peak from here on (not the time budget's probe's), for the
            torch.cuda.reset_peak_memory_stats(device)  # prediction to be checked against

    @property
    def grad_accum(self):
        return self.rows_per_step // self.device_batch_size

    @property
    def guarded(self):
        return self.steps_taken < GUARDED_STEPS

    def state_dict(self):
        return self.loader.state_dict()

    def crop_fraction(self):
        return self.loader.crop_fraction()

    def close(self):
        self.loader.close()

    def next_step(self):
        """This rank's micro-batches for one optimizer step: grad_accum (inputs, targets) pairs."""
        self.step_start = self.loader.state_dict() if self.guarded else None
        return [next(self.loader) for _ in range(self.grad_accum)]

    def rehearse_out_of_memory(self):
        """In the first steps, where NANOCHAT_SIMULATE_OOM_ROWS says this device batch does not fit, the out-of-memory
        error its passes would raise (train_step calls it as they begin): a smaller card, rehearsed anywhere."""
        if self.guarded:
            simulate_out_of_memory(self.device_batch_size, self.steps_taken)

    def recovers_from(self, error):
        """Whether a step that raised `error` on this rank is taken again at a smaller device batch: running out of
        memory in the first steps. Any other error, or one later in the run, stops the run."""
        return self.guarded and is_out_of_memory(error)

    def every_rank_fitted(self, ran_out):
        """After a step's backward passes (ran_out: whether this rank ran out of memory in them), before the optimizers
        move: whether every rank's passes fitted. Every rank calls it in the first steps, where it is one all-reduce."""
        if self.guarded and any_rank_out_of_memory(ran_out, self.device):
            return False
        self.steps_taken += 1
        return True

    def shrink(self):
        """Go on at the next smaller device batch, from the data stream's state at the start of the failed step: that
        step's micro-batches again, smaller and more of them."""
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
        self.loader = self.make_loader(smaller, self.step_start)
        self.device_batch_size = smaller
        self.checkpoint_meta["device_batch_size"] = smaller  # the one a resume starts at
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        return self.next_step()

    def against_prediction(self):
        """How far off the memory model was: its peak for this device batch, beside what the device held when it ran
        out (on CUDA: the most allocated at once, which the failed step's peak exceeds)."""
        if self.predicted_peak is None:
            return ""
        predicted = self.predicted_peak(self.device_batch_size)
        if self.device.type != "cuda" or SIMULATED_LIMIT is not None:
            return f" (the memory model predicted a peak of {format_bytes(predicted)})"
        held = torch.cuda.max_memory_allocated(self.device)
        return (f" (the memory model predicted a peak of {format_bytes(predicted)}; {format_bytes(held)} were "
                f"allocated when it ran out, {held / predicted - 1:+.0%} against the prediction, and the step needed more)")
