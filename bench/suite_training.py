"""
gpu_check --suite's train and fp8 sections: ours and the reference project's compiled training step at d12 and d24,
and our fp8 and torchao's float8 training against bf16 at d24, measured so that a lease's minutes go to measuring
rather than to compiles waited on one after another (~57-184 s each on an H200). Two phases under one deadline:

  1. the warm-ups, side by side: a process per configuration builds it, compiles, runs the warm-up steps, saves its
     portable compile cache (bench/compile_cache.py) and exits; as many at once as this card's memory holds by the
     measured peaks below, the most wanted first; one that runs out of memory beside others runs again alone. Nothing
     in them is timed.
  2. the timed runs, one at a time, each a fresh process that starts warm (inductor's local cache, which the warm-ups
     filled, and the portable file), times its steps, measures its loader apart, and writes a reduced profile of two
     steps and a step's peak memory (bench/profiling.py).

Every process has a deadline derived from the measured compile and step times below, and the timed runs' time is kept
free: when the warm-ups run long, the least wanted configuration (torchao, then our fp8) is dropped, so a slow
compile costs its own row and the command still ends with every row written.
"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from bench import gpu_check as check
from nanochat.common import child_pythonpath


@dataclass(frozen=True)
class Cost:
    """What one configuration costs, measured: its training step's peak memory (GiB), its first step with every
    compile cache empty (s), and a timed step (s)."""

    gib: float
    cold_s: float
    step_s: float


# One H200 at device batch 16 x 2048, torch 2.11, the code of 2fc4048 (dev/LOG.md "the GPU step at the reference's",
# 2026-11-28; dev/gpu_results/2026-11-28_193525_*): each warm-up's max_memory_allocated, its compiled first step with
# inductor's cache empty (compiled beside others, as the suite runs them), the timed runs' median steps. torchao's
# compile did not finish in 149 s on the H200 of 2026-11-27 and has not run since: its figures are that bound, bf16's
# memory (it keeps bf16 weights and casts each matmul's operands) and bf16's step.
GPU_COSTS = {("ours", 12, ""): Cost(15.4, 46, 0.068), ("reference", 12, ""): Cost(14.8, 64, 0.067),
             ("ours", 24, ""): Cost(57.2, 76, 0.370), ("reference", 24, ""): Cost(54.9, 113, 0.365),
             ("ours", 24, "ours"): Cost(54.3, 89, 0.404), ("ours", 24, "torchao"): Cost(57.2, 150, 0.39)}
# The warm-ups side by side may hold this share of the card by their measured peaks: the rest is for what a peak
# measured as max_memory_allocated leaves out (each process's CUDA context, ~0.5 GiB; the caching allocator's blocks
# beyond what is allocated, ~5-10 % in a training loop), the share the planner leaves a single run for the same things
# (nanochat/planning/memory_model.py MEMORY_SHARE). An 80 GB H100 (79.6 GiB) then holds one d24 with nothing beside it
# but a d12 where it fits (ours d24 and a d12 would be 72.0-72.6 of 71.7), a 141 GB H200 (140.4 GiB) the two bf16 d24s
# together (112.1 of 126.4), or a d24 with both d12s.
SIDE_BY_SIDE_SHARE = 0.9
# The 2-vCPU AMD EPYC at d2, device batch 4 x 64, inductor, with other work on the machine (2026-11-28): peak RSS,
# the first steps with inductor's cache empty (the reference compiles its optimizer too; our fp8's was measured beside
# the reference's compile), the median steps.
CPU_COSTS = {("ours", 2, ""): Cost(1.0, 51, 0.05), ("reference", 2, ""): Cost(1.0, 109, 0.09),
             ("ours", 2, "ours"): Cost(1.0, 70, 0.085)}
# A timed run starts with inductor's local cache warm (what is left is dynamo tracing the model again and loading the
# kernels): on the H200 at 2fc4048 its first step took 12-18 % of the cold one (ours d24 11.0 s / 76 s, the
# reference's 13.4 / 113, ours d12 6.2 / 46, the reference's 8.1 / 64, our fp8 16.3 / 89); each timed run is given
# twice what it is expected to take.
WARM_FRACTION = 0.15
# compiles side by side share the host's cores: a warm-up is given up to twice its compile measured alone
CONTENTION = 2.0
BREAKDOWN_STEPS = 2  # the steps taken apart into phases after the timed ones, as bench train's --breakdown-steps
PROFILE_STEPS = 1 + 2 + 1  # the profiler's start-up step, the two profiled, the one under the memory snapshot
POLL_S = 0.5


@dataclass(frozen=True)
class Config:
    """One compiled training configuration: its name names its files (cache, profile, logs)."""

    name: str
    section: str  # "train" or "fp8": which section's rows it makes
    project: str  # "ours" or "reference"
    depth: int
    fp8: str = ""  # "", "ours" or "torchao"


def configs_for(only, scale):
    """The configurations `only`'s sections time, the most wanted first (the order they are dropped in is the
    reverse): our bf16 and the reference's at each depth, the largest first (d24 is the speedrun's model), then our
    fp8, then torchao's."""
    configs = []
    if "train" in only:
        for depth in sorted(scale.train_depths, reverse=True):
            configs += [Config(f"ours_d{depth}", "train", "ours", depth), Config(f"reference_d{depth}", "train",
                                                                               "reference", depth)]
    if "fp8" in only:
        depth = scale.fp8_depth
        if not any(c.name == f"ours_d{depth}" for c in configs):  # fp8 is compared with our bf16 at its depth
            configs.append(Config(f"ours_d{depth}", "fp8", "ours", depth))
        configs += [Config(f"ours_fp8_d{depth}", "fp8", "ours", depth, "ours"),
                    Config(f"torchao_fp8_d{depth}", "fp8", "ours", depth, "torchao")]
    return configs


def cost(config, scale):
    """The measured cost of `config` at this scale; a configuration not measured yet is given the costliest."""
    costs = scale.costs
    return costs.get((config.project, config.depth, config.fp8)) or max(costs.values(), key=lambda c: (c.cold_s, c.gib))


def memory_budget_gib(total_bytes):
    """The GiB the warm-ups side by side may hold by their measured peaks on a card of `total_bytes`."""
    return SIDE_BY_SIDE_SHARE * total_bytes / 2**30


def warmup_seconds(config, scale):
    """A warm-up's deadline: the process's start, its compile with other compiles beside it, its warm-up steps."""
    c = cost(config, scale)
    return scale.start_s + CONTENTION * c.cold_s + scale.warmup * c.step_s


def always_profiled(config):
    """The train section's configurations are profiled after their timed steps; fp8's only where the time left holds
    the profile too (the first lease's plan is a few seconds short of it with every compile cold)."""
    return config.section == "train"


def timed_seconds(config, scale, profiled=None):
    """A timed run's expected length: the process's start, its warm compile, every step it takes, and where it is
    profiled (by default: always_profiled), the profile's reduction and its trace's export."""
    profiled = always_profiled(config) if profiled is None else profiled
    c = cost(config, scale)
    steps = scale.warmup + scale.timed_steps + BREAKDOWN_STEPS + (PROFILE_STEPS if profiled else 0)
    return scale.start_s + WARM_FRACTION * c.cold_s + steps * c.step_s + (scale.profile_s if profiled else 0)


# -----------------------------------------------------------------------------
# Child processes


class Child:
    """A child process with a deadline, its stdout and stderr in files (several run at once, and a pipe nobody reads
    would stall one), killed with everything it started."""

    def __init__(self, name, command, env, log_dir, seconds):
        self.name, self.seconds = name, seconds
        self.out_path, self.log_path = (os.path.join(log_dir, f"{name}.{ext}") for ext in ("out", "log"))
        os.makedirs(log_dir, exist_ok=True)
        with open(self.out_path, "w") as out, open(self.log_path, "w") as err:
            self.process = subprocess.Popen(command, cwd=check.REPO_ROOT, stdout=out, stderr=err, text=True,
                                            env={**os.environ, "PYTHONPATH": check.CHILD_PYTHONPATH, **env},
                                            start_new_session=True)
        self.started = time.time()
        self.deadline = self.started + seconds

    def poll(self):
        """None while it runs, else its result: the last JSON line it printed, or {"error": why not}."""
        code = self.process.poll()
        return None if code is None else self.result(code)

    def wait(self):
        """Its result once it ends, or {"error": ...} once its deadline has passed and it is killed."""
        try:
            self.process.wait(timeout=max(1.0, self.deadline - time.time()))
        except subprocess.TimeoutExpired:
            return self.kill(f"did not finish in {self.seconds:.0f} s")
        return self.result(self.process.returncode)

    def kill(self, why):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended on its own meanwhile
            pass
        self.process.wait()
        return {"error": why}

    def result(self, code):
        with open(self.out_path) as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
        if code != 0 or not lines:
            with open(self.log_path) as f:
                tail = [line for line in f.read().splitlines() if line.strip()][-1:] or [f"exit code {code}"]
            return {"error": tail[0][:300]}
        return json.loads(lines[-1])


class TrainingChild(Child):
    """A warm-up or a timed run: its result is its one run (bench train prints {"bench", "machine", "runs": [run]},
    reference_train.py the run itself)."""

    def result(self, code):
        result = super().result(code)
        return result["runs"][0] if "runs" in result else result


def command_for(config, stage, scale, paths):
    """(command, env) of a warm-up ("warmup"), a timed run ("timed") or a timed run then profiled ("profiled") of
    `config`. paths: cache, profiles, workspace (ours: its data and tokenizer), reference (the reference's checkout)."""
    cache = os.path.join(paths["cache"], f"{config.name}.bin")
    shape = [f"--depth={config.depth}", f"--seq-len={scale.seq_len}", f"--device-batch-size={scale.device_batch}",
             f"--vocab-size={scale.vocab}", f"--steps={scale.timed_steps}", f"--warmup={scale.warmup}",
             f"--compile-cache={cache}"]
    if config.project == "ours":
        command = [sys.executable, "-m", "scripts.bench", "train", *shape, "--compile=1", "--components=default",
                   f"--breakdown-steps={BREAKDOWN_STEPS}", "--probe-seconds=0", "--peak-seconds=0.25",
                   f"--fp8={config.fp8}"]
        # the suite's workspace, built before any of them starts: processes side by side must not each build one
        workspace = paths["workspace"]
        env = {"NANOCHAT_BASE_DIR": workspace["base_dir"], "NANOCHAT_DATA_SOURCE": workspace["source"]}
    else:
        command = [sys.executable, os.path.join(check.REPO_ROOT, "bench", "reference_train.py"), *shape]
        # the reference's package first, and whatever the user's PYTHONPATH adds (wheels installed with --target)
        env = {"PYTHONPATH": child_pythonpath(paths["reference"])}
    if stage == "warmup":
        command.append("--warmup-only")
        # grown segments instead of cached blocks of fixed sizes: processes side by side leave less memory unused
        # (the allocator's setting does not enter the compiled code, so the timed runs still hit the cache)
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    elif stage == "profiled":
        command.append(f"--profile={os.path.join(paths['profiles'], config.name)}")
    return command, env


# -----------------------------------------------------------------------------
# The two phases


def still_in(result):
    """Whether a configuration goes on to its timed run after this warm-up result (None: still warming up): a warm-up
    that ended well. One that ran out of memory beside others is warmed up again alone before it counts (warm_up)."""
    return result is None or not ("error" in result or "skipped" in result)


def out_of_memory(result):
    return "out of memory" in (result or {}).get("error", "").lower()


def warm_up(configs, scale, end, start, log):
    """Phase 1: a warm-up per configuration, as many side by side as scale.memory_budget_gib holds by their measured
    peaks, in the order of `configs` (the most wanted first; one that does not fit yet lets the next ones start, but
    torchao's, best effort, only starts once all others have). The compiles that cannot overlap then run one after the
    other with the most wanted first, and a late end costs the least wanted. A warm-up that runs out of memory while
    another one holds the card too says nothing of its own needs: it is warmed up again once the card is empty, alone,
    before anything else starts (its compile is in inductor's cache by then), so that its timed run starts warm and
    its row is not lost. Keeps the time the timed runs need before `end` free, dropping the least wanted
    configuration when it would not be. start(config, stage, seconds) -> a running Child. Returns {name: the warm-up's
    result}."""
    results = {}
    pending = list(configs)
    running = {}
    shared = set()  # the configurations whose warm-up had another beside it at some moment
    alone = set()  # the configurations to warm up again alone: they ran out of memory while shared

    while pending or running:
        now = time.time()
        for config, child in list(running.items()):
            result = child.poll()
            if result is None and now > child.deadline:
                result = child.kill(f"its compile did not finish in {child.seconds:.0f} s (alone, measured: "
                                    f"{cost(config, scale).cold_s:.0f} s)")
            if result is None:
                continue
            del running[config]
            if out_of_memory(result) and config in shared and config not in alone:
                alone.add(config)
                pending.insert(sum(1 for c in configs[:configs.index(config)] if c in pending), config)
                log(f"  warm-up {config.name}: ran out of memory beside others ({result['error'][:120]}): again "
                    f"alone, once the card is empty")
                continue
            results[config.name] = result
            log(f"  warm-up {config.name}: " + (f"failed: {result['error']}" if "error" in result else
                f"first step {result['first_step_s']:.1f} s ({result['compile_cache']}), "
                f"{time.time() - child.started:.0f} s in all"))
        keep = [c for c in configs if still_in(results.get(c.name))]
        while keep and now + sum(timed_seconds(c, scale) for c in keep) > end:
            victim = keep.pop()
            why = f"dropped: the timed runs of the configurations before it need the {end - now:.0f} s left"
            if victim in running:
                running.pop(victim).kill(why)
            if victim in pending:
                pending.remove(victim)
            results[victim.name] = {"skipped": why}
            log(f"  warm-up {victim.name}: {why}")
        in_use = sum(cost(c, scale).gib for c in running)
        again = [c for c in pending if c in alone]
        if again or any(c in alone for c in running):
            # a warm-up that needs the card to itself: nothing starts beside it, nor while the card empties for it
            if again and not running:
                config = again[0]
                seconds = min(warmup_seconds(config, scale), end - time.time())
                running[config] = start(config, "warmup", seconds)
                pending.remove(config)
                log(f"  warm-up {config.name} started again, alone (at most {seconds:.0f} s)")
            time.sleep(POLL_S)
            continue
        for config in list(pending):
            best_effort_waits = config.fp8 == "torchao" and any(c.fp8 != "torchao" for c in pending)
            fits = in_use + cost(config, scale).gib <= scale.memory_budget_gib or not running
            if fits and not best_effort_waits:
                seconds = min(warmup_seconds(config, scale), end - time.time())
                if running:
                    shared.update([config, *running])
                running[config] = start(config, "warmup", seconds)
                pending.remove(config)
                in_use += cost(config, scale).gib
                log(f"  warm-up {config.name} started ({in_use:.1f} of {scale.memory_budget_gib:.1f} GiB by the "
                    f"measured peaks; at most {seconds:.0f} s)")
        if pending or running:
            time.sleep(POLL_S)
    return results


def timed_runs(configs, warmups, scale, end, start, log, done=lambda results: None):
    """Phase 2: each configuration still in, one at a time, in order; each may take up to twice its expected
    length as long as the ones after it keep theirs, and is profiled where always_profiled() says or where the time
    left holds that too; done(results so far) after each. Returns {name: result}."""
    results = {}
    todo = [c for c in configs if c.name in warmups and still_in(warmups[c.name])]
    for i, config in enumerate(todo):
        available = end - time.time() - sum(timed_seconds(c, scale) for c in todo[i + 1:])
        profiled = always_profiled(config) or available >= timed_seconds(config, scale, profiled=True)
        need = timed_seconds(config, scale, profiled)
        seconds = min(2 * need, available)
        if seconds < need / 2:
            results[config.name] = {"skipped": f"{seconds:.0f} s left to it, and its timed run takes ~{need:.0f} s"}
            log(f"  {config.name}: {results[config.name]['skipped']}")
            continue
        log(f"  timed run {config.name}{', then profiled' if profiled else ', not profiled: too little time'} (at most "
            f"{seconds:.0f} s)")
        t0 = time.time()
        results[config.name] = result = start(config, "profiled" if profiled else "timed", seconds).wait()
        log(f"  {config.name}: " + (f"failed: {result['error']}" if "error" in result else
            f"{result['ms_per_step']:.1f} ms a step, first step {result['first_step_s']:.1f} s "
            f"({result['compile_cache']}), {time.time() - t0:.0f} s in all"))
        done(results)
    return results


def run(only, scale, end, paths, log, reference_commit, torchao_reason,
        progress=lambda rows, results, after, archives: None):
    """The train and fp8 sections of `only`, done by `end`: (rows [(check, result)], results). paths: cache, profiles,
    logs, workspace, reference (None without a checkout; reference_commit then says how to get one).
    progress(rows, results, after, archives) gets the rows as they stand after the warm-ups (the compile caches are
    saved then: archives=True) and after each timed run, a configuration not timed yet saying so."""
    configs = configs_for(only, scale)
    final, runnable = {}, []
    for config in configs:
        if config.project == "reference" and not paths["reference"]:
            final[config.name] = {"skipped": reference_commit}
        elif config.fp8 == "torchao" and torchao_reason:
            final[config.name] = {"skipped": torchao_reason}
        else:
            runnable.append(config)

    def start(config, stage, seconds):
        command, env = command_for(config, stage, scale, paths)
        return TrainingChild(f"{'warmup' if stage == 'warmup' else 'timed'}_{config.name}", command, env, paths["logs"],
                             seconds)

    reference_short = reference_commit[:7] if paths["reference"] else ""

    def outcome(warmups, timed, unfinished):
        """(rows, results) with each runnable configuration's timed result, its warm-up's failure, or `unfinished`."""
        for config in runnable:
            warmup = warmups.get(config.name, {})
            final[config.name] = timed.get(config.name) or (
                {k: f"warm-up: {v}" for k, v in warmup.items() if k in ("error", "skipped")} if not still_in(warmup)
                else {"skipped": unfinished})
        return rows_for(only, scale, final, warmups, reference_short), {**final, "warmups": warmups}

    log(f"  {len(runnable)} configurations: warm-ups side by side, then the timed runs one at a time, done in "
        f"{end - time.time():.0f} s")
    warmups = warm_up(runnable, scale, end, start, log)
    not_yet = "not timed: the suite stopped before its timed run"  # what a row says if nothing writes it again
    progress(*outcome(warmups, {}, not_yet), "the warm-ups of train/fp8", True)
    timed = timed_runs(runnable, warmups, scale, end, start, log,
                       lambda timed: progress(*outcome(warmups, timed, not_yet), f"the timed run of {len(timed)} of "
                                              f"train/fp8's configurations", False))
    return outcome(warmups, timed, "no time left for its timed run")


def speed(result, peak=None):
    """A timed result as a row's text: tok/s, MFU against `peak` (or its own), where the time goes, the memory."""
    if "skipped" in result:
        return f"skipped: {result['skipped']}"
    if "error" in result:
        return f"failed: {result['error']}"
    peak = peak or result.get("peak_flops")
    mfu = f", MFU {100 * result['tok_per_s'] * result['flops_per_token'] / peak:.1f} %" if peak else ""
    parts = result.get("breakdown_ms") or {}  # a step taken apart (synced between phases), where the time goes
    split = f" ({' / '.join(f'{k} {v:.0f}' for k, v in parts.items())} ms)" if parts else ""
    gib = result.get("peak_mem_gib") or (result["peak_mem_mib"] / 1024 if result.get("device") == "cuda" else None)
    return f"{result['tok_per_s']:,.0f} tok/s{mfu}{split}" + (f", {gib:.1f} GiB" if gib else "")


def compile_note(warmup, timed):
    """How the compiles went, for a row: the warm-up's first step and the timed run's, each cold or warm (whether a
    portable compile cache was loaded first)."""
    if "first_step_s" not in timed:
        return ""
    first = f"warm-up {warmup['first_step_s']:.0f} s ({warmup['compile_cache']}), " if "first_step_s" in warmup else ""
    return f"; first step: {first}timed run {timed['first_step_s']:.1f} s ({timed['compile_cache']})"


def rows_for(only, scale, final, warmups, reference_short):
    rows, shape = [], f"device batch {scale.device_batch} x {scale.seq_len}"
    if "train" in only:
        for depth in scale.train_depths:
            ours, theirs = final[f"ours_d{depth}"], final[f"reference_d{depth}"]
            label = f"d{depth} {ours.get('dtype', '')} training, compiled, {shape}"
            rows.append((f"{label}, ours (default recipe)",
                         speed(ours) + compile_note(warmups.get(f"ours_d{depth}", {}), ours)))
            if "loader_ms_per_batch" in ours:
                rows.append((f"{label}, ours: its data loader, timed apart from the step",
                             f"{ours['loader_ms_per_batch']:.1f} ms a batch (the step {ours['ms_per_step']:.0f} ms)"))
            ratio = ""
            if "tok_per_s" in ours and "tok_per_s" in theirs:
                ratio = f"; ours / reference {ours['tok_per_s'] / theirs['tok_per_s']:.2f}x"
            rows.append((f"{label}, reference {reference_short} "
                         f"({theirs.get('attention', '-')}, full windows, {theirs.get('dtype', '-').replace('torch.', '')})",
                         speed(theirs, ours.get("peak_flops")) + ratio +
                         compile_note(warmups.get(f"reference_d{depth}", {}), theirs)))
    if "fp8" in only:
        depth = scale.fp8_depth
        bf16 = final[f"ours_d{depth}"]
        for backend in ("ours", "torchao"):
            name = f"{backend}_fp8_d{depth}"
            result = final[name]
            line = speed(result)
            if "tok_per_s" in result and "tok_per_s" in bf16:
                line += (f"; {result['tok_per_s'] / bf16['tok_per_s']:.2f}x bf16's {bf16['tok_per_s']:,.0f}, loss after "
                         f"{scale.warmup + scale.timed_steps} steps {result['final_loss']:.6f} vs "
                         f"{bf16['final_loss']:.6f} ({result['final_loss'] / bf16['final_loss'] - 1:+.4%}), "
                         f"{result['fp8_linears']} linears in fp8")
            rows.append((f"d{depth} fp8 training ({backend}), {shape}", line + compile_note(warmups.get(name, {}), result)))
    return rows
