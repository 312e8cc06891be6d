"""
--time-budget (nanochat/planning/time_budget.py) and the out-of-memory fallback (nanochat/loop.py), for real: a
budgeted base_train that prints its plan, ends on time and resumes exactly; 1 and 2 ranks making the same plan; a
device batch that does not fit halved without changing the run; bad budgets refused before any compute; the laws.
"""

import json
import os
import re
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch

from test_base_train import assert_same_weights, env_for, final_weights, fresh_base, train_cmd, train_losses

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TINY's geometry without its depth and tag: the plan chooses the depth
GEOMETRY = ["--aspect-ratio=32", "--head-dim=32", "--max-seq-len=64", "--device-batch-size=2", "--total-batch-size=256",
            "--eval-tokens=1024"]


def base_train(base, args, nproc=1, env_extra=None, timeout=300):
    return subprocess.run(train_cmd(nproc) + list(args), env={**env_for(base), **(env_extra or {})}, capture_output=True,
                          text=True, timeout=timeout)


def plan_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("plan | ")]


@pytest.mark.slow  # 30 s on a 2-core EPYC: the default run must fit 10 minutes on every 2-core CPU
def test_a_budgeted_run_prints_its_plan_ends_on_time_and_resumes_exactly(tiny_base_dir, tmp_path):
    base = fresh_base(tiny_base_dir, tmp_path, "budget")
    budget = 30
    t0 = time.time()
    p = base_train(base, GEOMETRY + [f"--time-budget={budget}s", "--save-every=100", "--keep-last=100"])
    wall = time.time() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = plan_lines(p.stdout)
    # the plan, before the first step: the law, the probe, the depth, params, tokens, steps, batch split, prediction, end
    assert lines[0].startswith("plan | budget 30s from ") and "law cpu-builtin" in lines[0], lines
    assert re.search(r"probe [\d.]+ s, .*d\d+ [\d,]+ ms/step -> [\d.]+", lines[1]), lines
    chosen = re.search(r"plan \| d(\d+): ([\d,]+) params \(([\d,]+) scaling\), ([\d,]+) steps x 256 tokens = .* tok/param\), "
                       r"device batch 2 x 2 accum \| predicted val bpb ([\d.]+) \| ends by \d\d:\d\d:\d\d", lines[2])
    assert chosen, lines
    first_step = p.stdout.index("step 00001/")
    assert all(p.stdout.index(line) < first_step for line in lines[:3])
    # set again twice, a tenth and half of the way in, before the warmdown; the run ends within 10 % of the budget
    calibrations = re.findall(r"plan \| step (\d+): .* -> ([\d,]+) steps", p.stdout)
    planned = int(chosen.group(4).replace(",", ""))
    steps = int(calibrations[-1][1].replace(",", ""))
    assert len(calibrations) == 2 and all(int(at) < 0.6 * steps for at, _ in calibrations), calibrations
    assert f"done: {steps}/{steps} steps" in p.stdout
    assert 0.9 * budget - 2 <= wall <= 1.1 * budget + 4, f"{wall:.1f} s\n" + "\n".join(lines)  # a str: shown whole
    # the last step's lr is the warmdown's end: the checkpoint says the run finished as planned, and records the plan
    ckpt = os.path.join(base, "base_checkpoints", "budget-30s")
    with open(os.path.join(ckpt, f"step_{steps:06d}", "meta.json")) as f:
        meta = json.load(f)
    plan = meta["time_plan"]
    assert meta["finished"] and meta["num_iterations"] == steps == plan["num_iterations"] and plan["calibrated"]
    assert plan["depth"] == int(chosen.group(1)) and meta["model_config"]["n_layer"] == plan["depth"]
    assert (plan["device_batch_size"], plan["grad_accum"], plan["budget_seconds"]) == (2, 2, budget)
    assert planned > 0 and plan["predicted_bpb"] == pytest.approx(float(chosen.group(5)), abs=1e-4)

    # resumed from a checkpoint after the calibration (copied under another tag), it follows the saved plan exactly
    resume_at = 100 * ((steps - 1) // 100)  # the last save before the end
    assert resume_at > int(calibrations[-1][0])  # after the last calibration: the plan as it ended
    copy = os.path.join(base, "base_checkpoints", "copy")
    os.makedirs(copy)
    shutil.copytree(os.path.join(ckpt, f"step_{resume_at:06d}"), os.path.join(copy, f"step_{resume_at:06d}"))
    p = base_train(base, GEOMETRY + [f"--time-budget={budget}s", "--save-every=100", "--model-tag=copy", "--resume"])
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"resuming a run planned for 30s: d{plan['depth']}, {steps:,} steps" in p.stdout
    assert "probe" not in p.stdout and f"done: {steps}/{steps} steps" in p.stdout
    assert_same_weights(final_weights(base, steps, tag="budget-30s"), final_weights(base, steps, tag="copy"))


@pytest.mark.quick
def test_every_rank_guesses_its_first_depth_from_one_agreed_peak(monkeypatch):
    """A CPU's peak FLOP/s is measured by each rank apart; the first depth is guessed from the fastest rank's figure
    (all_reduce_max), not each rank's own, so every rank walks the same depths through the same collectives."""
    import nanochat.planning.time_budget as tb

    shape = tb.RunShape(1024, 64, 256, 2, 32, 32, None, [], [], False, 2, 1024, None, False, 0.0)
    guesses = {}
    for rank_peak in (1e9, 1e12):  # two ranks that measured their matmuls a thousand times apart
        monkeypatch.setattr(tb, "get_peak_flops", lambda device: rank_peak)
        monkeypatch.setattr(tb, "all_reduce_max", lambda values, device: [max(v, 1e12) for v in values])
        guesses[rank_peak] = tb.guess_depth(tb.LAWS["cpu-builtin"], shape, torch.device("cpu"), 600)
    assert guesses[1e9] == guesses[1e12]
    monkeypatch.setattr(tb, "all_reduce_max", lambda values, device: values)  # each its own: they would part
    monkeypatch.setattr(tb, "get_peak_flops", lambda device: 1e9)
    assert tb.guess_depth(tb.LAWS["cpu-builtin"], shape, torch.device("cpu"), 600) != guesses[1e12]


@pytest.mark.slow  # 8 s: two runs, one under torchrun
def test_one_rank_and_two_ranks_make_the_same_plan(tiny_base_dir, tmp_path):
    """Given the same measured speed (the base dir's record of earlier probes), 1 rank and 2 ranks choose the same
    depth, device batch and tokens; within the 2-rank job every rank holds the same plan (checked by the run)."""
    from nanochat.planning.time_budget import LAWS, PROBE_FILE, RunShape, machine_signature

    base = fresh_base(tiny_base_dir, tmp_path, "ranks")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the signature names the threads; each process of the runs below has one
    record = {}
    for world in (1, 2):
        shape = RunShape(1024, 64, 256, world, 32, 32, None, ["value_embeds", "residual_scalars", "smear"], ["normuon"],
                         False, 2, 1024, None, False, 0.0)
        record[machine_signature(shape, torch.device("cpu"))] = {
            str(d): {"device_batch_size": 2, "step_seconds": 0.002 * d * d} for d in range(1, 9)}
    torch.set_num_threads(threads)
    with open(os.path.join(base, PROBE_FILE), "w") as f:
        json.dump(record, f)
    plans = []
    for nproc in (1, 2):
        p = base_train(base, GEOMETRY + ["--time-budget=1h", "--dry-run", "--scaling-law=cpu-builtin"], nproc=nproc)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert "(earlier)" in p.stdout and "step 0000" not in p.stdout  # measured before; nothing trained
        plans.append(re.search(r"plan \| d(\d+): .*, ([\d,]+) steps x 256 tokens .* device batch (\d+) x (\d+) accum",
                               p.stdout))
    (d1, n1, b1, a1), (d2, n2, b2, a2) = [m.groups() for m in plans]
    assert (d1, b1) == (d2, b2) and (int(a1), int(a2)) == (2, 1)  # the same rows per step, split over the ranks
    assert abs(int(n1.replace(",", "")) / int(n2.replace(",", "")) - 1) < 0.01  # torchrun starts a few seconds later
    assert int(d1) > 1 and LAWS["cpu-builtin"].aspect_ratio == 32


@pytest.mark.slow  # 18 s: four short runs
def test_a_device_batch_that_does_not_fit_is_halved_and_the_run_is_the_same(tiny_base_dir, tmp_path):
    tiny = GEOMETRY[:3] + ["--depth=2", "--eval-tokens=1024", "--eval-every=-1", "--sample-every=-1",
                           "--core-metric-every=-1"]
    small = fresh_base(tiny_base_dir, tmp_path, "small")
    p = base_train(small, tiny + ["--num-iterations=4", "--device-batch-size=1", "--total-batch-size=256"])
    assert p.returncode == 0, p.stderr[-2000:]
    shrunk = fresh_base(tiny_base_dir, tmp_path, "shrunk")  # the first step fits at 4 rows, the second not at all
    p = base_train(shrunk, tiny + ["--num-iterations=4", "--device-batch-size=4", "--total-batch-size=256",
                                   "--save-every=2"], env_extra={"NANOCHAT_SIMULATE_OOM_ROWS": "1@1"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.count("out of memory at --device-batch-size=") == 2  # 4 -> 2 -> 1
    assert "going on at 1 with 4 micro-steps per optimizer step" in p.stdout and "batch 256 tok" in p.stdout
    losses, expected = train_losses(shrunk), train_losses(small)  # the same rows in the same steps: the same run
    assert losses[1] == pytest.approx(expected[1], rel=1e-5)  # 4 rows at once: the same sum in another order
    assert [losses[s] for s in (2, 3, 4)] == pytest.approx([expected[s] for s in (2, 3, 4)], rel=1e-3)  # and its rounding
    with open(os.path.join(shrunk, "base_checkpoints", "d2", "step_000004", "meta.json")) as f:
        meta = json.load(f)
    assert meta["device_batch_size"] == 1 and meta["user_config"]["total_batch_size"] == 256
    # a resume with the same command keeps the device batch that fit, and trains on without shrinking again
    p = base_train(shrunk, tiny + ["--num-iterations=6", "--device-batch-size=4", "--total-batch-size=256", "--resume"],
                   env_extra={"NANOCHAT_SIMULATE_OOM_ROWS": "1"})
    assert p.returncode == 0 and "out of memory" not in p.stdout and "= 1x64x1x4 accum" in p.stdout, p.stderr[-2000:]
    # not even one row fits: one line naming the depth and the memory, nothing saved
    none = fresh_base(tiny_base_dir, tmp_path, "none")
    p = base_train(none, tiny + ["--num-iterations=4", "--device-batch-size=2", "--total-batch-size=256"],
                   env_extra={"NANOCHAT_SIMULATE_OOM_ROWS": "0"})
    assert p.returncode == 1 and p.stderr.strip().splitlines()[-1].startswith(
        "error: d2 does not fit in a simulated device (NANOCHAT_SIMULATE_OOM_ROWS=0) even at --device-batch-size=1")
    assert "Traceback" not in p.stderr and not os.path.exists(os.path.join(none, "base_checkpoints", "d2", "step_000001"))


def test_bad_budgets_are_refused_in_one_line_before_any_compute(tiny_base_dir, tmp_path, monkeypatch):
    from nanochat.common import UserError
    from nanochat.planning.time_budget import PROBE_FILE, duration_label, law_for, parse_duration
    from scripts import base_train as script
    from scripts import mid_train

    assert [parse_duration(t) for t in ("90s", "20m", "4h", "1h30m", "2.5h", "600")] == [90, 1200, 14400, 5400, 9000, 600]
    assert [duration_label(s) for s in (90, 300, 5400)] == ["1m30s", "5m", "1h30m"]
    for text, words in (("0", "positive"), ("-5m", "not a duration"), ("abc", "not a duration"), ("5x", "not a duration"),
                        ("10s", "too short"), ("inf", "not a duration")):
        with pytest.raises(UserError, match=words):
            script.parse_args(GEOMETRY + [f"--time-budget={text}"])
    for extra, words in ((["--num-iterations=5"], "drop --num-iterations"), (["--target-flops=1e12"], "drop --target-flops"),
                         (["--core-metric-every=10"], "CORE"), ([], None)):
        if words:
            with pytest.raises(UserError, match=words):
                script.parse_args(GEOMETRY + ["--time-budget=5m"] + extra)
    with pytest.raises(UserError, match="give --time-budget"):
        script.parse_args(GEOMETRY + ["--dry-run"])
    with pytest.raises(UserError, match="drop --num-iterations"):
        mid_train.parse_args(["--device-type=cpu", "--time-budget=5m", "--num-iterations=3"])
    with pytest.raises(UserError, match="not a duration"):
        mid_train.parse_args(["--device-type=cpu", "--time-budget=soon"])
    # a law that is neither shipped nor a readable file
    with pytest.raises(UserError, match="neither a law the project ships"):
        law_for("no-such-law", "cpu", "builtin")
    bad = tmp_path / "law.json"
    bad.write_text('{"E": 1}')
    with pytest.raises(UserError, match="needs E, A, alpha, B and beta"):
        law_for(str(bad), "cpu", "builtin")
    # as a subprocess: the one line, and no step
    base = fresh_base(tiny_base_dir, tmp_path, "bad")
    p = base_train(base, GEOMETRY + ["--time-budget=-5m"])
    assert p.returncode == 1 and p.stderr.strip() == \
        "error: --time-budget=-5m is not a duration: give a time such as 90s, 20m, 4h or 1h30m", p.stderr
    assert "plan |" not in p.stdout and not os.path.exists(os.path.join(base, PROBE_FILE))
    # the speedrun checks NANOCHAT_TIME_BUDGET before any stage
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, DRY_RUN="1", NANOCHAT_TIME_BUDGET="abc", NANOCHAT_BASE_DIR=str(tmp_path / "s")))
    assert p.returncode == 1 and "NANOCHAT_TIME_BUDGET=abc is not a duration" in p.stderr and "-m scripts" not in p.stdout


@pytest.mark.quick
def test_the_plan_grows_with_the_budget_and_the_loss_surface_fit_recovers_a_law(tiny_base_dir, monkeypatch, tmp_path):
    """In process, from measured step times on disk: a longer budget trains a deeper model on more tokens; and the
    miniseries' surface fit gets back the law that made its points."""
    from nanochat.planning import time_budget as tb
    from bench.miniseries import fit_loss_surface

    base = fresh_base(tiny_base_dir, tmp_path, "grow")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    device = torch.device("cpu")
    shape = tb.RunShape(1024, 64, 256, 1, 32, 32, None, [], [], False, 2, 1024, None, False, 0.0)
    measured = {d: (2, 0.0005 * d * d) for d in range(1, 41)}
    tb.write_measurements(tb.machine_signature(shape, device), measured)
    law = tb.LAWS["cpu-builtin"]
    plans = [tb.plan_pretraining(law, shape, budget, time.time(), device, torch.autocast("cpu", enabled=False))
             for budget in (60, 600, 6000)]
    assert [p.depth for p in plans] == sorted(p.depth for p in plans) and plans[0].depth < plans[-1].depth
    assert plans[0].num_iterations < plans[1].num_iterations < plans[2].num_iterations
    assert plans[0].predicted_bpb > plans[1].predicted_bpb > plans[2].predicted_bpb
    assert all(p.calibrate_at < 0.6 * p.num_iterations for p in plans)
    # the surface: points from a known law, a little noise
    rng = np.random.default_rng(0)
    truth = dict(E=0.3, A=120.0, alpha=0.5, B=400.0, beta=0.5)
    points = [(n, d, truth["E"] + truth["A"] * n ** -0.5 + truth["B"] * d ** -0.5 + rng.normal(0, 1e-4))
              for n in np.geomspace(3e5, 3e6, 4) for d in np.geomspace(1e5, 1e7, 4)]
    fit = fit_loss_surface(points)
    assert fit["alpha"] == pytest.approx(0.5, abs=0.02) and fit["E"] == pytest.approx(0.3, abs=0.02)
    law_file = tmp_path / "scaling_law.json"
    law_file.write_text(json.dumps({"name": "mine", **fit, "aspect_ratio": 32, "head_dim": 32}))
    mine = tb.law_for(str(law_file), "cpu", "builtin")
    assert mine.name == "mine" and mine.predict(1e6, 1e6) == pytest.approx(0.3 + 0.12 + 0.4, abs=0.01)


@pytest.mark.slow  # 2 x 2-rank runs: ~25 s
def test_two_ranks_halve_their_device_batch_together(tiny_base_dir, tmp_path):
    """Under torchrun the ranks agree on running out of memory before any collective and go on together at the smaller
    device batch, with the losses of a 2-rank run started there."""
    tiny = GEOMETRY[:3] + ["--depth=2", "--eval-tokens=1024", "--eval-every=-1", "--sample-every=-1",
                           "--core-metric-every=-1", "--num-iterations=3", "--total-batch-size=512"]
    small = fresh_base(tiny_base_dir, tmp_path, "small2")
    assert base_train(small, tiny + ["--device-batch-size=2"], nproc=2).returncode == 0
    shrunk = fresh_base(tiny_base_dir, tmp_path, "shrunk2")
    p = base_train(shrunk, tiny + ["--device-batch-size=4"], nproc=2, env_extra={"NANOCHAT_SIMULATE_OOM_ROWS": "2"})
    assert p.returncode == 0 and "going on at 2 with 2 micro-steps" in p.stdout, p.stderr[-2000:]
    assert train_losses(shrunk) == pytest.approx(train_losses(small), rel=1e-5)


@pytest.mark.quick
def test_a_chat_stage_s_guessed_steps_are_set_again_after_its_first_timed_steps():
    """A chat stage plans its steps from a guess (FLOPs at 35 % MFU) that can be hundreds of times too fast (the gpu
    preset's SFT on 32 short conversations a step runs at ~0.1 % MFU): its step count is set again at step 10, from
    the steps timed so far, so the stage ends inside its budget instead of a tenth of the guessed steps later."""
    from types import SimpleNamespace

    from nanochat.planning import time_budget as tb
    from nanochat.loop import StepTimer

    device = torch.device("cpu")
    started = time.time()
    plan = tb.plan_stage_steps(120, started, 0.001, 0.0, -1, 0.5, 4, 32, 4, 1, device)
    assert plan.num_iterations > 50_000 and plan.calibrate_at == tb.MIN_CALIBRATE_STEP
    clock = tb.BudgetClock(plan, active=True, warmdown_ratio=0.5)
    timer = StepTimer()
    for _ in range(clock.call_at_step):
        timer.add(0.5)  # each step really takes 500x the guess
    loop = SimpleNamespace(step=clock.call_at_step, timer=timer, device=device, eval_seconds={}, save_seconds=None,
                           meta={}, num_iterations=plan.num_iterations)
    clock.calibrate(loop)
    left = plan.deadline - time.time() - plan.end_seconds
    assert 10 < loop.num_iterations and (loop.num_iterations - 10) * 0.5 <= left + 0.5
    assert clock.call_at_step is not None and clock.call_at_step < loop.num_iterations  # and once more before the warmdown
