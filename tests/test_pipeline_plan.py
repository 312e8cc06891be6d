"""
The speedrun to one time budget (nanochat/planning/pipeline_plan.py, NANOCHAT_TIME_BUDGET): the plan printed before any stage
with every stage's seconds or steps and the evaluations kept and skipped; a budget below this machine's minimum
refused in one line before any work; no stage planned below its floor at any budget or machine speed; a resumed
speedrun follows the plan it made; and (slow) a real pipeline at this machine's minimum ending within 10 % of its
budget, killed in its last training stage and continued with the same flags.
"""

import json
import os
import re
import signal
import subprocess
import time

import pytest

from nanochat.common import UserError
from nanochat.planning import pipeline_plan as pp
from scripts.speedrun_plan import main as speedrun_plan
from test_speedrun import commands, dry_run

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_plan_is_printed_for_a_small_budget_with_every_stage_and_what_is_skipped(tmp_path):
    p = dry_run(tmp_path, "cpu", 0, NANOCHAT_TIME_BUDGET="2m30s")
    assert p.returncode == 0, p.stderr
    plan = [line for line in p.stdout.splitlines() if line.startswith("plan | ")]
    assert re.search(r"speedrun in 2m 30s .* least budget here \d+m \d+s, the cpu preset about \d+m \d+s", plan[0])
    described = {line.split()[2]: line for line in plan[1:]}
    assert set(described) >= {"data", "tok_train", "tok_eval", "base_train", "base_loss", "base_eval", "mid_train",
                              "chat_sft", "chat_eval", "report"}
    assert re.search(r"base_train +~[\d,]+ steps in \d+ s", described["base_train"])
    _, _, fewest, need = pp.REFERENCE["cpu"]["train"]["chat_sft"]
    planned_sft = int(re.search(r"chat_sft +~(\d+) steps", described["chat_sft"]).group(1))
    assert fewest < planned_sft <= need  # the steps it needs (or its share of a short budget), before base_train's
    assert "skipped: below the cpu preset's time" in described["base_eval"] and "skipped" in described["mid_train"]
    flags = {m.split(".")[-1]: f for m, _, f in commands(p.stdout)}
    assert any(f.startswith("--time-budget=") for f in flags["base_train"]) and "--depth=4" in flags["base_train"]
    sft_seconds = int(next(f for f in flags["chat_sft"] if f.startswith("--time-budget=")).split("=")[1][:-1])
    floor_seconds = pp.train_seconds(pp.REFERENCE["cpu"], "chat_sft", pp.REFERENCE["cpu"]["train"]["chat_sft"][2], 1.0)
    assert sft_seconds >= floor_seconds - 1 and "-i base" in " ".join(flags["chat_sft"])  # a dry run: the reference's
    assert "mid_train" not in flags and "base_eval" not in flags  # skipped, and said so
    assert all("-g budget-2m30s" in line or "--model-tag=budget-2m30s" in line for line in p.stdout.splitlines()
               if " -m scripts.base_" in line or " -m scripts.chat_" in line)
    assert "speedrun: base_eval skipped" in p.stderr and "speedrun: mid_train skipped" in p.stderr
    # at the preset's time or more: mid_train runs, and evaluations up to their share
    p = dry_run(tmp_path, "cpu", 0, NANOCHAT_TIME_BUDGET="10m")
    assert p.returncode == 0, p.stderr
    ran = [m.split(".")[-1] for m, _, _ in commands(p.stdout)]
    assert "mid_train" in ran and "base_eval" in ran and ran.count("chat_eval") >= 2


def test_a_budget_below_this_machines_minimum_is_refused_in_one_line_before_any_work(tmp_path):
    base = tmp_path / "base"
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_PRESET="cpu", NANOCHAT_NGPU="0",
               NANOCHAT_TIME_BUDGET="40s")
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    errors = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and re.fullmatch(
        r"error: NANOCHAT_TIME_BUDGET=40s is too short for a chat model that answers on this machine: give at least "
        r"(\d+h )?\d+m \d+s \(base_train 220 steps, chat_sft 80, the final evaluation\); the cpu preset takes about "
        r"(\d+h )?\d+m \d+s here", errors[0]), errors  # a loaded machine measures itself slower: hours
    assert "== " not in p.stdout and not (base / "base_data").exists() and not (base / "speedrun_config.txt").exists()


@pytest.mark.quick
@pytest.mark.parametrize("speed", [0.5, 1.0, 3.0])
def test_no_stage_is_planned_below_its_floor_and_the_plan_fits_the_budget(speed):
    reference = pp.REFERENCE["cpu"]
    floor = {name: entry[2] for name, entry in reference["train"].items()}
    started = 1_000.0
    least = None
    for budget in range(30, 3_600, 7):
        try:
            plan = pp.plan_speedrun(budget, started, started + 5, "cpu", speed, "test")
        except pp.BudgetTooShort as e:
            assert least is None, f"{budget} s refused after {least} s was accepted: {e}"
            continue
        least = least or budget
        # the least budget stated: what the plan needs, with room for the next probe's noise (PROBE_NOISE)
        assert least - 7 <= plan.minimum_seconds <= pp.PROBE_NOISE * least + 10, (plan.minimum_seconds, least)
        trains = [s for s in plan.stages if s.kind == "train" and s.run]
        assert {s.name for s in trains} >= {"base_train", "chat_sft"}
        assert all(s.steps >= floor[s.name] for s in trains), [(s.name, s.steps) for s in trains]
        sft, mid, base = plan.stage("chat_sft"), plan.stage("mid_train"), plan.stage("base_train")
        mid_in_base_steps = pp.train_seconds(reference, "mid_train", reference["train"]["mid_train"][3], 1.0) / \
            reference["train"]["base_train"][0]
        if mid.run:  # mid_train only beside the preset's base steps; skipped, its time would not have left them
            assert base.steps >= reference["preset_steps"]["base_train"]
        else:
            assert base.steps < reference["preset_steps"]["base_train"] + mid_in_base_steps + 1
        assert sft.steps <= (reference["preset_steps"]["chat_sft"] if mid.run else reference["train"]["chat_sft"][3])
        assert 5 + sum(s.seconds for s in plan.stages if s.run) <= budget * (1 - pp.MARGIN) + 1e-6
        kept = [s for s in plan.stages if s.kind == "eval" and s.run]
        assert not kept or budget >= plan.preset_seconds
    assert least is not None


@pytest.mark.quick
def test_a_resumed_speedrun_follows_the_plan_it_made(tmp_path, monkeypatch):
    path = str(tmp_path / "plan.json")
    started = time.time()
    plan = pp.plan_speedrun(600, started, started + 5, "cpu", 1.0, "test")
    pp.save(plan, path)
    assert plan.stage("mid_train").run and plan.stage("base_eval").run
    # the first run: the stages up to chat_sft are given their flags as they start (chat_sft late), then it is killed
    given = {}
    for name in ("data", "tok_train", "base_train", "base_eval", "mid_train", "chat_sft"):
        given[name] = pp.stage_flags(plan, name, started + {"base_train": 12, "chat_sft": 585}.get(name, 6))
        pp.save(plan, path)
    assert given["base_train"][0].startswith("--time-budget=")
    late = int(given["chat_sft"][0].removeprefix("--time-budget=").removesuffix("s"))
    floor = pp.train_seconds(pp.REFERENCE["cpu"], "chat_sft", pp.REFERENCE["cpu"]["train"]["chat_sft"][2], 1.0)
    assert floor - 1 <= late < plan.stage("chat_sft").seconds  # late: less time, not below its floor's
    # the second run, much later: the same plan, the same flags for what was decided, the planned ones for the rest
    monkeypatch.setattr(time, "time", lambda: started + 3_600)
    speedrun_plan(["plan", "10m", "--preset", "cpu", "--plan-file", path])
    resumed = pp.load(path)
    assert resumed.resumed == 1 and [s.name for s in resumed.stages] == [s.name for s in plan.stages]
    assert all(pp.stage_flags(resumed, name, time.time()) == flags for name, flags in given.items())
    assert pp.stage_flags(resumed, "chat_eval mid", time.time()) == []  # not late: the time lost is not counted


@pytest.mark.quick
def test_a_chat_stage_takes_the_time_left_early_and_gives_it_back_late():
    """chat_sft's seconds (its --time-budget) scale with the time left against the time the plan gave it and the stages
    after it: more when base_train ended early, less when late (down to its floor's seconds), the planned ones on time."""
    started = 1_000.0
    plan = pp.plan_speedrun(160, started, started + 5, "cpu", 1.0, "test")
    sft = plan.stage("chat_sft")
    after = sum(s.seconds for s in plan.stages[plan.stages.index(sft):] if s.run)
    on_time = plan.deadline - pp.MARGIN * plan.budget_seconds * (1 - plan.stages.index(sft) / len(plan.stages)) - after

    def seconds(start):
        plan.decided.pop("chat_sft", None)
        return int(pp.stage_flags(plan, "chat_sft", start)[0].removeprefix("--time-budget=").removesuffix("s"))

    floor = pp.train_seconds(pp.REFERENCE["cpu"], "chat_sft", pp.REFERENCE["cpu"]["train"]["chat_sft"][2], 1.0)
    assert seconds(on_time) == round(sft.seconds)
    assert sft.seconds + 5 < seconds(on_time - 10) <= sft.seconds + 10  # early: its share of the time gained
    assert floor < seconds(on_time + 10) < sft.seconds - 5  # late: its share of the loss
    assert seconds(on_time + 1_000) == round(floor)  # never below its floor's


@pytest.mark.quick
def test_base_train_gets_what_the_other_stages_will_not_take_as_measured_before_it(tmp_path):
    """The probe prices training steps; the data, the tokenizer, the evaluations and the report do not follow it (fp32
    on a bf16 CPU doubles the probe only). How long the stages before base_train took, against their planned seconds,
    rescales the evaluations and the report after it, and base_train's budget gets (or gives) the difference."""
    started = 1_000.0

    def base_budget(took, tmp_path):
        plan = pp.plan_speedrun(400, started, started + 5, "cpu", 2.0, "test")
        at = [s.name for s in plan.stages].index("base_train")
        later = sum(s.seconds for s in plan.stages[at + 1:] if s.run and s.kind != "train")
        # speedrun.sh's times file, whole seconds: the data and the tokenizer took `took` times their plan
        times = tmp_path / f"times-{took}.txt"
        times.write_text(f"data: built-in corpus {round(took * plan.stage('data').seconds)}\n"
                         f"tokenizer: train {round(took * plan.stage('tok_train').seconds)}\n")
        flags = pp.stage_flags(plan, "base_train", started + 30, pp.read_stage_times(times))
        return plan.host_factor, float(flags[0].removeprefix("--time-budget=").removesuffix("s")), later

    on_plan, fast, slow = base_budget(1.0, tmp_path), base_budget(0.5, tmp_path), base_budget(3.0, tmp_path)
    assert on_plan[0] == pytest.approx(1.0, abs=0.1) and fast[0] == pytest.approx(0.5, abs=0.1) and slow[0] == 2.0
    later = on_plan[2]
    # at the same start, base_train gets what the later stages will not take (or gives what they will take more)
    assert fast[1] - on_plan[1] == pytest.approx((on_plan[0] - fast[0]) * later, abs=1)
    assert on_plan[1] - slow[1] == pytest.approx((slow[0] - on_plan[0]) * later, abs=1)
    assert pp.read_stage_times(tmp_path / "none.txt") == {}  # no stage has run yet: nothing measured, factor 1


@pytest.mark.quick
def test_a_budget_at_the_minimum_is_not_refused_for_one_slow_probe(tmp_path, monkeypatch):
    """The minimum a speedrun named is what the next one accepts: a VM's speed drifts over minutes, so near the
    minimum a refusal waits for a second probe, and the faster of the two decides."""
    reference_probe = pp.REFERENCE["cpu"]["probe_seconds"]
    started = time.time()
    try:
        pp.plan_speedrun(1, started, started, "cpu", 1.0, "test")
    except pp.BudgetTooShort as e:
        minimum = e.minimum  # what a machine as fast as the reference is told
    probes = []

    def plan(budget, *speeds):
        probes.clear()
        queue = list(speeds)

        def probe(earlier=None):
            probes.append(earlier)
            return min([queue.pop(0) * reference_probe] + ([earlier] if earlier else [])), "test"

        monkeypatch.setattr(pp, "probe_step_seconds", probe)
        path = tmp_path / f"plan-{budget}-{'-'.join(map(str, speeds))}.json"
        speedrun_plan(["plan", f"{budget}s", "--preset", "cpu", "--started-at", str(started), "--plan-file", str(path)])
        return pp.load(str(path))

    slow = pp.PROBE_NOISE + 0.3  # beyond the room the stated minimum leaves
    assert plan(minimum, 1.0).speed == pytest.approx(1.0) and probes == [None]  # the stated minimum holds
    assert plan(minimum, 1.2, 1.0).speed == pytest.approx(1.2) and probes == [None]  # within its room: one probe
    assert plan(minimum, slow, 1.0).speed == pytest.approx(1.0)  # one slow probe: measured again, the faster kept
    assert probes == [None, pytest.approx(slow * reference_probe)]
    with pytest.raises(UserError, match=r"too short .* give at least"):  # slow twice: the machine is slower now
        plan(minimum, slow, slow - 0.05)
    with pytest.raises(UserError, match=r"too short"):  # far below the minimum: refused on the first probe
        plan(minimum // 3, 1.0, 1.0)
    assert probes == [None]


def measured_minimum(env):
    """This machine's least budget, as the speedrun states it (a budget of one second is refused with it)."""
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, env={**env, "NANOCHAT_TIME_BUDGET": "1s"},
                       capture_output=True, text=True, timeout=300)
    found = re.search(r"give at least (?:(\d+)m )?(\d+)s", p.stderr)
    assert p.returncode == 1 and found, p.stderr
    return 60 * int(found.group(1) or 0) + int(found.group(2))


@pytest.mark.slow  # ~4 minutes on a 2-core CPU: the whole pipeline at this machine's minimum, twice (a kill between)
def test_a_pipeline_at_the_minimum_ends_on_time_and_a_kill_continues_with_the_same_flags(tmp_path):
    base = tmp_path / "base"
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(base), NANOCHAT_PRESET="cpu", NANOCHAT_NGPU="0")
    budget = measured_minimum(env)
    env["NANOCHAT_TIME_BUDGET"] = f"{budget}s"
    started = time.time()
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.time() - started
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert abs(wall / budget - 1) <= 0.10, (wall, budget)
    plan = pp.load(str(base / pp.PLAN_FILE))
    assert all(s.steps >= pp.REFERENCE["cpu"]["train"][s.name][2] for s in plan.stages if s.kind == "train" and s.run)
    report = (base / "report" / "report.md").read_text()
    assert "Speedrun plan" in report and "skipped" in report and "WorldQA" in report
    # again from scratch, killed as chat_sft starts, then continued: every stage keeps the flags it was given
    again = tmp_path / "again"
    env["NANOCHAT_BASE_DIR"] = str(again)
    process = subprocess.Popen(["bash", "speedrun.sh"], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    printed = []
    for line in process.stdout:
        printed.append(line)
        if line.startswith("== chat_sft =="):
            time.sleep(2)
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait()
    assert (again / pp.PLAN_FILE).exists(), "".join(printed)[-3000:]  # refused: the minimum stated did not hold
    decided = json.loads((again / pp.PLAN_FILE).read_text())["decided"]
    assert "chat_sft" in decided and "chat_eval sft" not in decided
    p = subprocess.run(["bash", "speedrun.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "plan | resumed" in p.stdout and "base_train: done already" in p.stdout
    after = json.loads((again / pp.PLAN_FILE).read_text())["decided"]
    assert {k: after[k] for k in decided} == decided and "chat_eval sft" in after


@pytest.mark.quick
def test_one_gpu_with_the_builtin_corpus_plans_six_minutes_and_chat_rl_only_where_it_pays(tmp_path):
    """The gpu preset is priced from one H200's stages with the built-in corpus and a step shared among the GPUs: six
    minutes on one GPU is planned, not refused (it was: "give at least 22m 20s"), with its stages inside the budget;
    chat_rl, on by default there, is planned only where its floor is within its share of the training time, else
    skipped with the reason; the hub's data and tasks cost more, and more GPUs make the steps cheaper."""
    started = time.time()
    plan = pp.plan_speedrun(360, started, started + 8, "gpu", 1.0, "test", rl="auto", source="builtin", gpus=1)
    running = {s.name: s for s in plan.stages if s.run}
    assert {"data", "tok_train", "base_train", "chat_sft", "chat_eval sft", "report"} <= set(running)
    assert 8 + sum(s.seconds for s in running.values()) <= 360 * (1 - pp.MARGIN) + 1
    rl = plan.stage("chat_rl")
    assert not rl.run and rl.why.startswith("skipped: its floor") and not plan.stage("chat_eval rl").run
    assert [s.name for s in plan.stages] == [name for name in pp.ORDER if name in {s.name for s in plan.stages}]
    flags = pp.stage_flags(plan, "chat_rl", started + 300)
    assert flags[0].startswith("skip:")
    # a long budget on eight GPUs has room for chat_rl; asked for explicitly, a budget too short for it is refused
    long = pp.plan_speedrun(3 * 3600, started, started + 8, "gpu", 1.0, "test", rl="auto", source="builtin", gpus=8)
    assert long.stage("chat_rl").run and long.stage("chat_eval rl").run and long.stage("chat_rl").steps >= 10
    with pytest.raises(pp.BudgetTooShort):
        pp.plan_speedrun(360, started, started + 8, "gpu", 1.0, "test", rl=True, source="builtin", gpus=1)
    # the preset's own data (a download, a 2B-character tokenizer) and the hub's tasks do not fit in six minutes
    with pytest.raises(pp.BudgetTooShort):
        pp.plan_speedrun(360, started, started + 8, "gpu", 1.0, "test", rl="auto", source="hub", gpus=1)
    one, eight = (pp.costs("gpu", "builtin", n)["train"]["base_train"][0] for n in (1, 8))
    assert eight == pytest.approx(one / 8) and pp.costs("gpu", "hub")["fixed"]["data"] > pp.costs("gpu")["fixed"]["data"]
    # the plan file keeps the source and the GPUs, so each stage's flags are priced as the plan was
    path = str(tmp_path / "plan.json")
    pp.save(plan, path)
    assert (pp.load(path).source, pp.load(path).gpus) == ("builtin", 1)
