"""
gpu_check --suite (bench/gpu_suite.py) scaled down on a CPU, as CI runs it: every section gives its rows: ours
against the reference (here: no checkout, and the row says how to get one), fp8 (ours emulated against bf16; torchao
skipped with its reason), a base_train whose val bpb falls, eager and captured decoding (the captured step run
eagerly, the same tokens), chat_web one at a time and batched, every stage for a few steps and chat_web answering on
their model; the results, the log and the two archives go to --out-dir, five files a lease can return, and a JSON
line. Bad --only / --suite-minutes are refused before any work. Its pieces one by one: a profile reduced to its phases
and top ops, a memory snapshot to what holds its peak, the archives' limits, the out-dir's check, and the warm-ups
scheduled side by side under the memory budget with the timed runs' time kept free: the budget the card's own (an 80
GB H100 against a 141 GB H200), and a warm-up that ran out of memory beside others run again alone.
"""

import contextlib
import gzip
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from types import SimpleNamespace

import pytest
import torch

from bench import compile_cache, gpu_suite, profiling
from bench import suite_training as training

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def suite(base, args, timeout=900, threads="1"):
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS=threads)
    return subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--suite", *args], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_bad_sections_and_deadlines_are_refused_before_any_work(tmp_path):
    p = suite(tmp_path, ["--only", "train,graphs"])
    assert p.returncode != 0 and "--only takes train,fp8,decode,run,serve,stages,budget,budget_24gb (got graphs)" in p.stderr
    p = suite(tmp_path, ["--suite-minutes", "0"])
    assert p.returncode != 0 and "--suite-minutes must be > 0" in p.stderr
    (tmp_path / "a_file").write_text("")
    p = suite(tmp_path, ["--results-dir", str(tmp_path / "a_file" / "results")])
    assert p.returncode != 0 and "cannot write the suite's results" in p.stderr
    os.remove(tmp_path / "a_file")
    assert os.listdir(tmp_path) == []


@pytest.mark.quick
def test_reference_checkout_is_found_or_explained(tmp_path):
    missing, how = gpu_suite.reference_checkout(str(tmp_path / "none"))
    assert missing is None and f"git clone {gpu_suite.REFERENCE_URL}" in how and gpu_suite.REFERENCE_COMMIT[:12] in how
    (tmp_path / "ref" / "nanochat").mkdir(parents=True)
    (tmp_path / "ref" / "nanochat" / "gpt.py").write_text("")
    (tmp_path / "ref" / "COMMIT").write_text(gpu_suite.REFERENCE_COMMIT + "\n")
    assert gpu_suite.reference_checkout(str(tmp_path / "ref")) == (str(tmp_path / "ref"), gpu_suite.REFERENCE_COMMIT)


@pytest.mark.quick
def test_a_profile_of_two_steps_reduces_to_its_phases_and_top_ops(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = profiling.synchronizer(torch.device("cpu"))

    def step():
        with profiling.phase("data", sync):
            x = torch.randn(64, 32)
        with profiling.phase("forward", sync):
            loss = model(x).square().mean()
        with profiling.phase("backward", sync):
            loss.backward()
        with profiling.phase("optimizer", sync):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    report = profiling.record(str(tmp_path / "tiny"), "tiny", step, torch.device("cpu"), {"graph_breaks": 0})
    assert list(report["phases"]) == list(profiling.PHASES) and report["steps"] == 2
    assert all(p["wall_ms"] > 0 for p in report["phases"].values())
    for name in ("forward", "backward", "optimizer"):  # every op is taken by the phase it ran in
        assert 0 < report["phases"][name]["busy_ms"] <= report["phases"][name]["wall_ms"] * 1.01, name
    kernels = {k["name"]: k for k in report["kernels"]}
    assert kernels["aten::addmm"]["count"] == 2  # the two linears' forward, a step
    assert 0 < sum(k["share"] for k in report["kernels"]) <= 1.01
    text = (tmp_path / "tiny.txt").read_text()
    for name in profiling.PHASES:
        assert re.search(rf"^{name} +[\d.]+ +[\d.]+ +[\d.]+%$", text, re.M), name
    assert re.search(r"^ +[\d.]+ +2\.0 +[\d.]+%  aten::addmm$", text, re.M)
    assert "peak memory: skipped: no CUDA memory snapshot on a cpu" in text and "compile: graph breaks 0" in text
    assert json.loads((tmp_path / "tiny.json").read_text())["kernels"] == report["kernels"]
    with gzip.open(tmp_path / "tiny.trace.json.gz") as f:  # the chrome trace, small enough to keep
        assert any(e.get("name") == "forward" for e in json.load(f)["traceEvents"])
    assert report["trace"].startswith("tiny.trace.json.gz (")


@pytest.mark.quick
def test_on_a_gpu_each_kernel_belongs_to_the_phase_it_starts_in():
    from torch.autograd import DeviceType

    def event(name, start, end, device=DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               self_cpu_time_total=end - start, is_user_annotation=False)

    ranges = [event(name, start, end, DeviceType.CPU) for name, start, end in
              (("data", 0, 10), ("forward", 10, 110), ("backward", 110, 310), ("optimizer", 310, 400))]
    kernels = [event("gemm", 20, 60), event("gemm", 120, 200), event("gemm", 210, 250), event("adam", 320, 380)]
    mirrored = [event("forward", 15, 100), event("ProfilerStep#1", 0, 400)]  # the ranges on the device's timeline
    launches = [event("cudaLaunchKernel", 20, 25, DeviceType.CPU)]  # CPU work: not counted on a GPU
    reduced = profiling.reduce_profile(ranges + kernels + mirrored + launches, steps=1, cuda=True)
    assert reduced["time_kind"] == "GPU kernel time" and reduced["step_ms"] == pytest.approx(0.4)
    busy = {name: phase["busy_ms"] for name, phase in reduced["phases"].items()}
    assert busy == pytest.approx({"data": 0.0, "forward": 0.04, "backward": 0.12, "optimizer": 0.06})
    assert [(k["name"], k["count"]) for k in reduced["kernels"]] == [("gemm", 3), ("adam", 1)]
    assert reduced["kernels"][0]["share"] == pytest.approx(0.4) and reduced["busy_ms"] == pytest.approx(0.22)


@pytest.mark.quick
def test_a_memory_snapshot_reduces_to_what_holds_the_peak():
    def alloc(addr, size, frames):
        return {"action": "alloc", "addr": addr, "size": size, "frames": frames}

    def free(addr, size):
        return {"action": "free_completed", "addr": addr, "size": size}

    ours = [{"filename": "/py/site-packages/torch/nn/functional.py", "line": 9, "name": "linear"},
            {"filename": "/work/main/nanochat/gpt.py", "line": 120, "name": "forward"}]
    compiled = [{"filename": "/tmp/torchinductor_root/ab/cabc123.py", "line": 77, "name": "call"}]
    trace = [alloc(1, 100, ours), alloc(2, 50, compiled), alloc(3, 30, compiled),  # the peak: 1000 + 180
             free(2, 50), alloc(4, 10, ours), free(99, 20), free(1, 100), free(3, 30), free(4, 10)]
    reduced = profiling.reduce_snapshot({"device_traces": [trace]}, allocated_before=1000)
    assert reduced["peak_bytes"] == 1180 and reduced["trace_entries"] == 9
    assert reduced["held_by"] == [
        {"bytes": 1000, "blocks": 1, "allocated_at": "allocated before the step (weights, optimizer state, ...)"},
        {"bytes": 100, "blocks": 1, "allocated_at": "nanochat/gpt.py:120 forward"},
        {"bytes": 80, "blocks": 2, "allocated_at": "compiled graph cabc123.py (call)"}]
    top1 = profiling.reduce_snapshot({"device_traces": [trace]}, allocated_before=1000, top=1)
    assert top1["others"] == {"bytes": 180, "blocks": 3}


@pytest.mark.quick
def test_archives_keep_under_their_limit_and_unpack_only_plain_names(tmp_path):
    (tmp_path / "caches").mkdir()
    sizes = {"ours_d12.bin": 1000, "reference_d12.bin": 1000, "ours_d24.bin": 300_000}
    for name, size in sizes.items():
        (tmp_path / "caches" / name).write_bytes(os.urandom(size))  # random: gzip cannot shrink it
    paths = [str(tmp_path / "caches" / name) for name in sizes]
    packed, left_out = compile_cache.pack(paths, str(tmp_path / "a.tar.gz"), limit_bytes=100_000)
    assert packed == ["ours_d12.bin", "reference_d12.bin"] and left_out == ["ours_d24.bin"]
    assert os.path.getsize(tmp_path / "a.tar.gz") < 100_000
    assert sorted(compile_cache.unpack(str(tmp_path / "a.tar.gz"), str(tmp_path / "next"))) == sorted(packed)
    assert (tmp_path / "next" / "ours_d12.bin").read_bytes() == (tmp_path / "caches" / "ours_d12.bin").read_bytes()
    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:  # a member that names a path outside the folder
        info = tarfile.TarInfo("../../outside.bin")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    assert compile_cache.unpack(str(tmp_path / "evil.tar.gz"), str(tmp_path / "next")) == ["outside.bin"]
    assert (tmp_path / "next" / "outside.bin").read_bytes() == b"abc" and not (tmp_path / "outside.bin").exists()
    # a file saved here after the archive was made is newer than what the archive carries: it stays,
    os.utime(tmp_path / "a.tar.gz", (time.time() - 60, time.time() - 60))
    (tmp_path / "next" / "ours_d12.bin").write_bytes(b"newer")
    os.remove(tmp_path / "next" / "reference_d12.bin")  # and one that is not here is unpacked
    assert compile_cache.unpack(str(tmp_path / "a.tar.gz"), str(tmp_path / "next")) == ["reference_d12.bin"]
    assert (tmp_path / "next" / "ours_d12.bin").read_bytes() == b"newer"


@pytest.mark.quick
def test_the_out_dir_is_checked_against_what_a_lease_returns(tmp_path):
    for name in ("a.md", "a.json", "suite.log", "compile_cache.tar.gz", "profiles.tar.gz"):
        (tmp_path / name).write_text("x")
    assert gpu_suite.out_dir_problems(str(tmp_path)) == []
    with open(tmp_path / "profiles.tar.gz", "wb") as f:
        f.truncate(16 * 2**20)
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    for i in range(4):
        (tmp_path / "a" / "b" / "c" / f"deep{i}").write_text("x")
    problems = gpu_suite.out_dir_problems(str(tmp_path))
    assert any("profiles.tar.gz is 16.0 MiB, at least 16" in p for p in problems)
    assert any("deep0 is 3 folders deep, more than 2" in p for p in problems)
    assert problems[-1] == "9 files, more than 8"


class FakeChild:
    """A warm-up that ends well after `seconds_to_run` (or never, for None), in place of a process."""

    def __init__(self, config, seconds, seconds_to_run, events):
        self.config, self.seconds, self.events = config, seconds, events
        self.started = time.time()
        self.deadline = self.started + seconds
        self.ends = None if seconds_to_run is None else self.started + seconds_to_run

    outcome = None  # a function of the child giving its result when it ends; None: it ends well

    def poll(self):
        if self.ends is None or time.time() < self.ends:
            return None
        self.events.append(("ended", self.config.name))
        return (self.outcome and self.outcome(self)) or {"first_step_s": 0.1, "compile_cache": "cold"}

    def kill(self, why):
        self.events.append(("killed", self.config.name))
        self.ends = self.started  # over
        return {"error": why}

    def holds_memory(self):
        return self.ends is None or time.time() < self.ends


@pytest.mark.quick
def test_warm_ups_run_side_by_side_within_the_memory_budget_and_keep_the_timed_runs_time(monkeypatch):
    monkeypatch.setattr(training, "POLL_S", 0.005)
    costs = {("ours", 12, ""): training.Cost(18, 0.06, 0.0), ("reference", 12, ""): training.Cost(15, 0.07, 0.0),
             ("ours", 24, ""): training.Cost(69, 0.09, 0.0), ("reference", 24, ""): training.Cost(55, 0.09, 0.0),
             ("ours", 24, "ours"): training.Cost(55, 0.18, 0.0), ("ours", 24, "torchao"): training.Cost(69, 0.15, 0.0)}
    scale = SimpleNamespace(costs=costs, memory_budget_gib=112, start_s=0.0, profile_s=0.0, warmup=1, timed_steps=1,
                            train_depths=(12, 24), fp8_depth=24)
    configs = training.configs_for(["train", "fp8"], scale)
    assert [c.name for c in configs] == ["ours_d24", "reference_d24", "ours_d12", "reference_d12", "ours_fp8_d24",
                                         "torchao_fp8_d24"]
    durations = {c.name: costs[(c.project, c.depth, c.fp8)].cold_s for c in configs}
    durations["ours_fp8_d24"] = None  # a compile that never ends
    events, running = [], []

    def start(config, stage, seconds):
        running[:] = [c for c in running if c.holds_memory()]
        child = FakeChild(config, seconds, durations[config.name], events)
        running.append(child)
        in_use = sum(costs[(c.config.project, c.config.depth, c.config.fp8)].gib for c in running)
        assert in_use <= 112, [c.config.name for c in running]  # never more than the budget at once
        events.append(("started", config.name))
        return child

    results = training.warm_up(configs, scale, time.time() + 60, start, lambda message: None)
    started = [name for what, name in events if what == "started"]
    # the most wanted first, then whatever fits beside it; torchao once every other one has started
    assert started[:3] == ["ours_d24", "ours_d12", "reference_d12"] and started[-1] == "torchao_fp8_d24"
    assert set(started) == {c.name for c in configs}
    assert results["ours_fp8_d24"]["error"] == "its compile did not finish in 0 s (alone, measured: 0 s)"
    assert ("killed", "ours_fp8_d24") in events  # at its deadline, twice its compile measured alone
    assert all("first_step_s" in results[c.name] for c in configs if c.name != "ours_fp8_d24")

    # too little time left for every timed run: the least wanted are dropped, torchao before it starts, our fp8 while
    # it compiles, and the others warm up
    events.clear()
    scale.profile_s = 1.0
    costs[("ours", 24, "ours")] = training.Cost(55, 1.0, 0.0)
    end = time.time() + sum(training.timed_seconds(c, scale) for c in configs[:5]) + 0.3
    results = training.warm_up(configs, scale, end, start, lambda message: None)
    for name in ("torchao_fp8_d24", "ours_fp8_d24"):
        assert results[name]["skipped"].startswith("dropped: the timed runs of the configurations before it"), name
    assert ("killed", "ours_fp8_d24") in events and ("started", "torchao_fp8_d24") not in events
    assert all("first_step_s" in results[c.name] for c in configs[:4])


H100_MIB, H200_MIB = 81559, 143771  # the cards the leases had: nvidia-smi's total memory


def card_plan(total_mib, durations, outcome=None):
    """The train and fp8 warm-ups as the suite schedules them on a card of `total_mib`, each a fake child that takes
    durations[name] s and ends with outcome(child) (child.beside: every warm-up that ran beside it): (the starts as
    (name, [the others running then]), the most GiB in use at once by the measured peaks, the results, the budget)."""
    scale = SimpleNamespace(costs=training.GPU_COSTS, memory_budget_gib=training.memory_budget_gib(total_mib * 2**20),
                            start_s=0.0, profile_s=0.0, warmup=1, timed_steps=1, train_depths=(12, 24), fp8_depth=24)
    configs = training.configs_for(["train", "fp8"], scale)
    running, starts, events, most = [], [], [], [0.0]
    gib = lambda child: training.cost(child.config, scale).gib  # noqa: E731

    def start(config, stage, seconds):
        running[:] = [c for c in running if c.holds_memory()]
        child = FakeChild(config, seconds, durations[config.name], events)
        child.outcome, child.beside = outcome, [c.config.name for c in running]  # every one beside it while it runs
        for other in running:
            other.beside.append(config.name)
        running.append(child)
        starts.append((config.name, list(child.beside)))
        most[0] = max(most[0], sum(gib(c) for c in running))
        return child

    results = training.warm_up(configs, scale, time.time() + 3600, start, lambda message: None)
    return starts, most[0], results, scale.memory_budget_gib


@pytest.mark.quick
def test_the_warm_ups_fit_the_card_they_are_on(monkeypatch):
    """The memory budget is the card's: an 80 GB H100 never holds more warm-ups at once than its budget by the measured
    peaks (with a warm compile cache every warm-up takes seconds, and ours d24 and both d12s used to start together on
    it, 87 GiB), while a 141 GB H200 still runs them side by side."""
    monkeypatch.setattr(training, "POLL_S", 0.002)
    d24s = {"ours_d24", "reference_d24", "ours_fp8_d24", "torchao_fp8_d24"}
    cold = {f"{p}_d{d}": training.GPU_COSTS[(p, d, "")].cold_s / 2000 for p in ("ours", "reference") for d in (12, 24)}
    cold.update(ours_fp8_d24=0.045, torchao_fp8_d24=0.075)  # the measured compiles, 2,000 times faster
    warm = dict.fromkeys(cold, 0.01)  # a warm compile cache: every warm-up is over in seconds
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for total_mib, budget in ((H100_MIB, 71.7), (H200_MIB, 126.4)):  # the suite's scale, on a card of this size
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total_mib << 20))
        assert gpu_suite.scale_here().memory_budget_gib == pytest.approx(budget, abs=0.05)
    monkeypatch.undo()
    monkeypatch.setattr(training, "POLL_S", 0.002)
    for durations in (cold, warm):
        starts, most, results, budget = card_plan(H100_MIB, durations)
        assert most <= budget < H100_MIB / 1024, (starts, most)
        assert starts[0] == ("ours_d24", [])  # the most wanted first, alone: no d12 fits beside it
        assert not [name for name, beside in starts if name in d24s and d24s & set(beside)], starts  # one d24 at a time
        assert {name for name, _ in starts} == set(cold) and all("first_step_s" in r for r in results.values())
        assert any(len(beside) == 1 for _, beside in starts)  # the d12s still overlap
    starts, most, results, budget = card_plan(H200_MIB, cold)
    assert most <= budget and starts[:2] == [("ours_d24", []), ("reference_d24", ["ours_d24"])], starts
    # the d12s start as ours d24 ends, beside the reference's d24, and our fp8 once that one is done
    assert dict(starts)["ours_d12"] == ["reference_d24"] and "reference_d24" not in dict(starts)["ours_fp8_d24"]
    assert max(len(beside) for _, beside in starts) >= 2  # three warm-ups at once, as the H200 ran them
    assert all("first_step_s" in r for r in results.values())


@pytest.mark.quick
def test_a_warm_up_out_of_memory_beside_others_is_warmed_up_again_alone(monkeypatch):
    """A warm-up that ran out of memory while others held the card is not lost: it runs again once the card is
    empty, with nothing started beside it, and goes on to its timed run; one that runs out of memory alone is a
    failure of its own (its timed run would fail the same way)."""
    monkeypatch.setattr(training, "POLL_S", 0.002)
    durations = dict.fromkeys(["ours_d24", "reference_d24", "ours_d12", "reference_d12", "ours_fp8_d24",
                               "torchao_fp8_d24"], 0.02)
    oom = {"error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    # on the H200 ours d12 runs out of memory whenever another warm-up runs beside it; torchao's even alone
    outcome = lambda child: oom if child.config.name == "torchao_fp8_d24" or (  # noqa: E731
        child.config.name == "ours_d12" and child.beside) else None
    starts, most, results, budget = card_plan(H200_MIB, durations, outcome)
    again = [i for i, (name, _) in enumerate(starts) if name == "ours_d12"]
    assert len(again) == 2 and starts[again[1]][1] == []  # run again with the card empty
    # and nothing started while it ran again: the ones after it started only once it had ended
    assert all("ours_d12" not in beside for _, beside in starts[again[1] + 1:]), starts
    assert "first_step_s" in results["ours_d12"] and training.still_in(results["ours_d12"])
    assert [(name, beside) for name, beside in starts if name == "torchao_fp8_d24"] == [("torchao_fp8_d24", [])]
    assert "out of memory" in results["torchao_fp8_d24"]["error"] and not training.still_in(results["torchao_fp8_d24"])
    assert {name for name, _ in starts} == set(durations) and most <= budget


@pytest.mark.quick
def test_train_and_fp8_hand_on_their_rows_after_the_warm_ups_and_each_timed_run(monkeypatch, tmp_path):
    """A suite cut during the timed runs still has the rows of those that ended, and the compile caches the warm-ups
    saved: train and fp8 report their rows after the warm-ups (with the archives) and after each timed run, the
    configurations not timed yet saying so."""
    class Instant:  # a warm-up or a timed run, done at once
        def __init__(self, name, command, env, log_dir, seconds):
            self.name, self.seconds, self.started, self.deadline = name, seconds, time.time(), time.time() + seconds

        def poll(self):
            return self.wait()

        def wait(self):
            return {"first_step_s": 0.1, "compile_cache": "cold", "tok_per_s": 1000.0, "ms_per_step": 5.0,
                    "flops_per_token": 1e6, "peak_flops": 1e12, "final_loss": 3.0}

    monkeypatch.setattr(training, "TrainingChild", Instant)
    monkeypatch.setattr(training, "POLL_S", 0.001)
    scale = SimpleNamespace(costs={("ours", 2, ""): training.Cost(1, 1, 0.01)}, memory_budget_gib=1, start_s=0.0,
                            profile_s=0.0, warmup=1, timed_steps=1, train_depths=(2,), fp8_depth=2, seq_len=64,
                            device_batch=4, vocab=512)
    paths = {name: str(tmp_path / name) for name in ("cache", "profiles", "logs")}
    paths.update(workspace={"base_dir": str(tmp_path), "source": "builtin"}, reference=None)
    reports = []
    rows, _ = training.run(["train"], scale, time.time() + 60, paths, lambda message: None, "no checkout", None,
                           lambda rows, results, after, archives: reports.append((dict(rows), after, archives)))
    ours = next(name for name in dict(rows) if name.endswith("ours (default recipe)"))
    assert [(after, archives) for _, after, archives in reports] == [
        ("the warm-ups of train/fp8", True), ("the timed run of 1 of train/fp8's configurations", False)]
    assert reports[0][0][ours] == "skipped: not timed: the suite stopped before its timed run"
    assert reports[1][0][ours].startswith("1,000 tok/s") and dict(rows)[ours] == reports[1][0][ours]


def test_a_suite_cut_short_has_written_every_row_it_finished(tmp_path):
    """The scale-down killed while its second section runs (as a lease's end cuts a command): the first section's rows
    are in --out-dir already, the .md and .json saying they are partial, with the log and the archives, and nothing
    half-written."""
    import signal

    import psutil

    out = tmp_path / "out"
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path / "base"), NANOCHAT_DATA_SOURCE="builtin", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "scripts.gpu_check", "--suite", "--only", "decode,run",
                          "--suite-minutes", "5", "--out-dir", str(out), "--compile-cache-dir", str(tmp_path / "cc")],
                         env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    log = out / "suite.log"
    try:
        t0 = time.time()
        while not (log.exists() and "suite: run" in log.read_text()):  # the decode section is over
            assert p.poll() is None and time.time() - t0 < 240, "the suite ended before its run section began"
            time.sleep(0.05)
    finally:
        children = psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
        os.killpg(p.pid, signal.SIGKILL)
        for child in children:  # base_train runs in the suite's group, but a section's child may not
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        p.wait()
    assert p.returncode == -signal.SIGKILL
    written = sorted(path.name for path in out.iterdir())
    assert written[2:] == ["compile_cache.tar.gz", "profiles.tar.gz", "suite.log"], written
    assert gpu_suite.out_dir_problems(str(out)) == []
    result = json.loads((out / written[0]).read_text())["gpu_suite"]
    assert re.fullmatch(r"partial: written at \d+ s, after decode; the suite went on", result["status"])
    rows = dict(result["rows"])
    assert len(rows) >= 5 and all(name.startswith("d2 decode") for name in rows) and "decode" in result["results"]
    md = (out / written[1]).read_text()
    assert result["status"] in md and all(f"| {name} | {row} |" in md for name, row in rows.items())
    with tarfile.open(out / "profiles.tar.gz") as tar:
        assert "decode.log" in tar.getnames()


@pytest.mark.quick
def test_the_offline_wheels_carry_every_package_the_server_and_its_client_import():
    """The GPU machine has torch but none of chat_web's stack: every distribution that importing the server, the
    tokenizer and bench serve's client loads must be among dev/offline_wheels.py's wheels (a hand-kept list missed
    fastapi 0.165's opentelemetry-api and the openai client, and a lease lost its chat_web rows)."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "dev"))
    try:
        import offline_wheels
    finally:
        sys.path.pop(0)
    carried = {line.split("==")[0].lower() for line in offline_wheels.requirements()}
    # the closure as the installed packages' own metadata states it (not uv.lock, which requirements() reads)
    from importlib import metadata
    from packaging.requirements import Requirement

    normalize = lambda name: re.sub(r"[-_.]+", "-", name).lower()
    needed, todo = set(), ["fastapi", "uvicorn", "openai", "rustbpe"]
    while todo:
        name = normalize(todo.pop())
        if name not in needed:
            needed.add(name)
            for line in metadata.requires(name) or []:
                requirement = Requirement(line)
                if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                    todo.append(requirement.name)
    assert "opentelemetry-api" in needed  # what fastapi 0.165 imports at start-up, as on the H100
    assert needed - carried == set()


def suite_imports():
    """{third-party top-level module: [(file, whether imported inside a function)]} over the code a lease runs:
    bench/ whole, scripts.gpu_check and scripts.bench, every module speedrun.sh names (the budget sections run it) and
    the stages section runs, and every module of the project those import, followed (lazy imports included)."""
    import ast

    project = ("bench", "nanochat", "scripts", "tasks")
    local = {name[:-3] for name in os.listdir(os.path.join(REPO_ROOT, "bench"))}  # reference_train, loaded by its file
    with open(os.path.join(REPO_ROOT, "speedrun.sh")) as f:
        todo = re.findall(r"\b((?:scripts|nanochat)\.\w+)", f.read())
    todo += ["scripts.gpu_check", "scripts.bench", *(f"bench.{name}" for name in local)]
    todo += [module for module, _ in gpu_suite.stage_commands(False)]

    def source(module):
        base = os.path.join(REPO_ROOT, *module.split("."))
        return next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(p)), None)

    seen, found = set(), {}
    while todo:
        module = todo.pop()
        path = source(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        if "." in module:
            todo.append(module.rsplit(".", 1)[0])  # a package's __init__ runs first

        def visit(node, in_function):
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                names = []
                if isinstance(child, ast.Import):
                    names = [alias.name for alias in child.names]
                elif isinstance(child, ast.ImportFrom) and child.level == 0:  # `from a import b`: b may be a module
                    names = [child.module] + [f"{child.module}.{alias.name}" for alias in child.names]
                todo.extend(name for name in names if name.split(".")[0] in project)
                for top in {name.split(".")[0] for name in names} - set(project) - sys.stdlib_module_names - local:
                    found.setdefault(top, []).append((os.path.relpath(path, REPO_ROOT), in_function))
                visit(child, inner)

        with open(path) as f:
            visit(ast.parse(f.read()), False)
    return found


def test_every_package_the_suite_imports_travels_or_is_on_the_gpu_image():  # ~2.5 s: it parses ~90 modules
    """What a lease runs imports nothing that is neither among the wheels it carries nor in the GPU image (a missing
    one costs a section's rows: opentelemetry-api and openai on the H100 of 2026-11-28); what is left out on purpose
    (lm-eval, wandb) is imported only inside the functions of the modes that need it."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "dev"))
    try:
        import offline_wheels
    finally:
        sys.path.pop(0)
    from importlib import metadata

    normalize = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731
    carried = {normalize(line.split("==")[0]) for line in offline_wheels.requirements()}
    distributions = metadata.packages_distributions()
    imports = suite_imports()
    assert {"torch", "fastapi", "openai", "httpx", "rustbpe"} <= set(imports)  # the walk reaches the server and clients
    by_distribution = {normalize(dist): module for module in imports for dist in distributions.get(module, [module])}
    missing = set(by_distribution) - carried - set(offline_wheels.IMAGE_HOLDS) - set(offline_wheels.NOT_ON_A_LEASE)
    assert missing == set(), {by_distribution[d]: imports[by_distribution[d]][:3] for d in missing}
    for dist in offline_wheels.NOT_ON_A_LEASE:
        assert all(lazily for _, lazily in imports.get(by_distribution.get(dist, dist), [])), imports[by_distribution[dist]]


@pytest.mark.slow  # ~4 minutes: compiled training runs, a 30-step base_train, four chat_web servers, every stage
def test_the_suite_scaled_down_gives_every_sections_rows(tmp_path):
    out = tmp_path / "out"
    p = suite(tmp_path / "base", ["--only", "train,fp8,decode,run,serve,stages", "--suite-minutes", "14",
                                  "--reference", str(tmp_path / "no_reference"),
                                  "--out-dir", str(out), "--compile-cache-dir", str(tmp_path / "caches")])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])["gpu_suite"]
    rows = dict(result["rows"])
    ours = [r for name, r in rows.items()
            if re.match(r"d2 (bfloat16|float32) training", name) and name.endswith("ours (default recipe)")]
    assert len(ours) == 1 and re.fullmatch(r"[\d,]+ tok/s, MFU [\d.]+ % \(data \d+ / forward \d+ / backward \d+ / "
                                           r"optimizer \d+ ms\); first step: warm-up \d+ s \((cold|warm)\), timed run "
                                           r"[\d.]+ s \((cold|warm)\)", ours[0]), ours
    loader = [r for name, r in rows.items() if name.endswith("ours: its data loader, timed apart from the step")]
    assert len(loader) == 1 and re.fullmatch(r"[\d.]+ ms a batch \(the step \d+ ms\)", loader[0]), loader
    reference = [r for name, r in rows.items() if "reference" in name]
    assert reference and reference[0].startswith("skipped: no reference checkout") and "git clone" in reference[0]
    fp8 = {name.split("(")[1].split(")")[0]: r for name, r in rows.items() if "fp8 training" in name}
    assert re.search(r"x bf16's [\d,]+, loss after 3 steps [\d.]+ vs [\d.]+ \([+-][\d.]+%\), [1-9]\d* linears in fp8",
                     fp8["ours"])
    assert fp8["torchao"].startswith("skipped: torchao's float8 training needs a CUDA GPU")
    run = [r for name, r in rows.items() if "base_train, 30 steps" in name]
    assert len(run) == 1 and "(falls)" in run[0], run
    decode = {name: r for name, r in rows.items() if "BatchEngine" in name}
    assert len(decode) == 4 and all("ms a step" in r for r in decode.values())
    captured = [r for name, r in decode.items() if name.endswith("captured")]
    assert all(re.search(r"the eager tokens in (\d+)/\1 rows \(ran eagerly: CUDA graphs need a GPU", r) for r in captured)
    # the control for a captured step's disagreement: eager decoding against itself at fewer rows (one CPU: the same)
    assert decode[next(name for name in decode if name.endswith("4 rows, eager"))].endswith(
        "the tokens eager decoding wrote with fewer rows in 1/1 rows of 1")
    serve = {name: r for name, r in rows.items() if name.startswith("chat_web (")}
    assert len(serve) == 6 and all(r.endswith("0 errors") or "0 errors;" in r for r in serve.values()), serve
    assert any("x one at a time" in r for r in serve.values())
    stages = [r for name, r in rows.items() if name.startswith("every stage")]
    assert len(stages) == 1 and all(f"{stage} " in stages[0] for stage in ("corpus", "tok_train", "base_train", "base_loss",
                                                                         "base_eval", "mid_train", "chat_sft", "chat_rl",
                                                                         "chat_eval")), stages
    assert rows["chat_web on the stages' RL model, one request"].startswith("200, a reply of")
    # the out-dir: what a lease returns, five files
    written = sorted(path.name for path in out.iterdir())
    assert len(written) == 5 and written[2:] == ["compile_cache.tar.gz", "profiles.tar.gz", "suite.log"], written
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d{6}_.+\.json", written[0]) and written[1] == written[0][:-4] + "md"
    assert gpu_suite.out_dir_problems(str(out)) == []
    table = [line for line in (out / written[1]).read_text().splitlines() if re.search(r"\| \d{4}-\d\d-\d\d \|$", line)]
    assert len(table) == len(rows) and all("no CUDA" in line for line in table)
    assert json.loads((out / written[0]).read_text())["gpu_suite"]["rows"] == result["rows"]
    assert result["status"] == "complete" and "; complete" in (out / written[1]).read_text()
    log = (out / "suite.log").read_text()
    assert "warm-up ours_d2 started" in log and "timed run ours_d2" in log and "packed into profiles.tar.gz" in log
    with tarfile.open(out / "profiles.tar.gz") as tar:
        names = tar.getnames()
        profile = tar.extractfile("ours_d2.txt").read().decode()
    assert {"ours_d2.txt", "ours_d2.json", "ours_fp8_d2.txt", "warmup_ours_d2.log", "timed_ours_d2.out", "decode.log",
            "run.log", "stages_chat_rl.log"} <= set(names), names
    assert all(re.search(rf"^{phase} ", profile, re.M) for phase in profiling.PHASES) and "recompiles 0" in profile
    assert not [r for r in rows.values() if r.startswith("failed")]
    assert {r for r in rows.values() if r.startswith("skipped")} == {reference[0], fp8["torchao"]}


@pytest.mark.slow  # ~11 minutes: the whole speedrun twice, each to this machine's least budget (~5 minutes here)
def test_the_budget_sections_run_the_budgeted_speedrun_and_time_it(tmp_path):
    """The sections a GPU runs as `NANOCHAT_TIME_BUDGET=6m bash speedrun.sh`, on the whole card and capped to 24 GB: on
    a CPU each runs the cpu preset to this machine's least budget, through NANOCHAT_PYTHON as on a lease's machine
    (which has no uv), and says its wall time against the budget, its plan, base_train's plan and any out-of-memory."""
    # room for a machine whose least budget is up to ~1.6x this one's: a section short of time is skipped, not run
    p = suite(tmp_path / "base", ["--only", "budget,budget_24gb", "--suite-minutes", "20", "--out-dir",
                                  str(tmp_path / "out")], timeout=1320, threads=str(os.cpu_count() or 1))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])["gpu_suite"]
    rows = dict(result["rows"])
    for name, capped in (("budget", "whole card"), ("budget_24gb", "every stage capped to 24GB")):
        label = next((n for n in rows if n.endswith(f"{capped}): wall time")), None)
        assert label, (name, rows)  # a section skipped or failed says why in its row
        label = label[:-len(": wall time")]
        run = result["results"][name]
        assert run["exit_code"] == 0 and abs(run["wall_s"] / run["budget_s"] - 1) <= 0.10, run
        assert re.fullmatch(rf"\d+ s of {run['budget_s']} s \([+-][\d.]+ %, within 10 %\); data: built-in corpus \d+ s, "
                            r"tokenizer: train \d+ s, base_train \d+ s, chat_sft \d+ s, chat_eval sft \d+ s, report \d+ s",
                            rows[f"{label}: wall time"]), rows[f"{label}: wall time"]
        assert re.match(r"data \d+ s; tok_train \d+ s; base_train ~[\d,]+ steps in \d+ s", rows[f"{label}: the plan"])
        assert re.match(r"d4: [\d,]+ params", rows[f"{label}: base_train's plan"])
        assert rows[f"{label}: out of memory"] == "0 times"
    # the capped run planned for the card it was given
    assert any("NANOCHAT_GPU_MEMORY=24GB" in line for line in result["results"]["budget_24gb"]["plan"])
    assert not any("NANOCHAT_GPU_MEMORY" in line for line in result["results"]["budget"]["plan"])
