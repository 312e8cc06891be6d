"""
The speedrun to one time budget, planned as a whole (`NANOCHAT_TIME_BUDGET=5m bash speedrun.sh`): before any stage
runs, a probe of this machine prices every stage from what it cost on the preset's reference machine, and the plan
decides what runs, which evaluations fit and how the training time is shared; each stage then asks for its flags as it
starts (`python -m scripts.speedrun_plan flags STAGE`: cmd_flags), sharing a late or early start with the stages after
it. For users, and where the costs come from: docs/time_budget.md "The whole speedrun to a budget".
"""
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

# A stage's flags are asked for in a process of its own: that path imports no torch (1-2 s a start on a CPU)

PLAN_FILE = "speedrun_plan.json"  # in the base dir
TIMES_FILE = "speedrun_times.txt"  # beside it: speedrun.sh's seconds for each stage that ran
EVAL_SHARE = 0.1  # at the preset's time or more, the evaluations besides the final one take at most this much of it
MARGIN = 0.03  # of the budget, kept back when planning for what the estimates miss (a stage's start-up that runs long)
BASE_MARGIN = 0.01  # what base_train leaves when it starts: by then the time before it is measured, not estimated
SFT_SHARE = 0.4  # of the training time chat_sft (and chat_rl) may take, between its floor and its need
PROBE_NOISE = 1.25  # the least budget is stated this much above the probe's (a VM's speed drifts over minutes)

# What each stage costs on the machine the cpu preset was measured on (dev/LOG.md): seconds, and for the training
# stages seconds a step and the start-up, evaluations and saves around the steps; probe_seconds is what the probe below
# measured there for a step of the preset's base model: a machine whose probe takes twice as long pays twice as much.
REFERENCE = {
    "cpu": {
        "probe_seconds": 0.183,
        "fixed": {"data": 2.0, "tok_train": 2.5, "report": 2.5},
        "evals": {"tok_eval": 2.0, "base_loss": 3.5, "base_eval": 7.0, "chat_eval base": 3.5, "chat_eval mid": 7.0,
                  "chat_eval sft": 6.5, "chat_eval rl": 7.0},
        # name: (seconds a step, start-up and the rest, fewest steps, the steps it needs): below the fewest the chat
        # model stops answering held-out questions; past the need more steps stop paying (dev/LOG.md)
        "train": {"base_train": (0.155, 9.0, 220, None), "mid_train": (0.35, 4.0, 20, 30),
                  "chat_sft": (0.17, 4.0, 80, 175), "chat_rl": (2.0, 8.0, 10, 30)},
        # the preset's own steps, for its time here
        "preset_steps": {"base_train": 700, "mid_train": 60, "chat_sft": 300, "chat_rl": 30},
        "preset_extra": 12.0,  # the preset's periodic evaluations, samples and checkpoints in base_train
    },
    # One GPU's costs, measured on one H200 with the built-in corpus (`gpu_check --suite --only stages`, 2fc4048, dev/LOG.md
    # 2026-12-02): each stage's process with its start-up (base_train's cold compile among it); a step's cost is the gpu
    # preset's d24 step of 2^19 tokens (16 x 0.37 s), shared among the GPUs. base_train's floor is a minute of those
    # steps: a budget's base_train chooses its own depth, and at the small depths a short budget picks that is hundreds
    # of steps. Not measured yet, so guessed: chat_rl's step at the preset's 16 x 16 samples of 256 tokens (scaled from
    # 10 s measured at 8 x 8 of 64), the floors and needs of the chat stages, and the preset's own data and tasks
    # (HUB_DATA, HUB_EVALS: 150 climbmix shards, a 2B-character tokenizer, CORE and the hub's chat tasks)
    "gpu": {
        "fixed": {"data": 7.0, "tok_train": 11.0, "report": 5.0},
        "evals": {"tok_eval": 10.0, "base_loss": 12.0, "base_eval": 30.0, "chat_eval base": 45.0, "chat_eval mid": 45.0,
                  "chat_eval sft": 45.0, "chat_eval rl": 45.0},
        "train": {"base_train": (5.9, 70.0, 10, None), "mid_train": (5.9, 20.0, 50, 800),
                  "chat_sft": (0.9, 20.0, 50, 600), "chat_rl": (160.0, 15.0, 10, 200)},
        "preset_steps": {"base_train": 14000, "mid_train": 800, "chat_sft": 600, "chat_rl": 200},
        "preset_extra": 600.0,
    },
}
HUB_DATA = {"data": 60.0, "tok_train": 90.0}
HUB_EVALS = {"tok_eval": 20.0, "base_loss": 60.0, "base_eval": 300.0, "chat_eval base": 60.0, "chat_eval mid": 300.0,
             "chat_eval sft": 300.0, "chat_eval rl": 300.0}
# Which evaluations a budget keeps first (the final one always): the base model's val bpb, its fact recall, CORE, the
# mid-trained model, the tokenizer's compression
OPTIONAL_EVALS = ["base_loss", "chat_eval base", "base_eval", "chat_eval mid", "tok_eval"]
ORDER = ["data", "tok_train", "tok_eval", "base_train", "base_loss", "base_eval", "chat_eval base", "mid_train",
         "chat_eval mid", "chat_sft", "chat_eval sft", "chat_rl", "chat_eval rl", "report"]


@dataclass
class Stage:
    name: str
    kind: str  # fixed | train | eval | final
    seconds: float  # planned
    steps: int = 0  # a training stage's planned steps
    run: bool = True
    why: str = ""  # why an evaluation does not run


@dataclass
class SpeedrunPlan:
    """The whole speedrun's plan: every stage's seconds, steps and whether it runs (saved as PLAN_FILE). Each training
    stage then plans its own run to the seconds it is given (time_budget.RunPlan)."""
    budget_seconds: float
    started_at: float
    preset: str
    machine: str
    speed: float  # this machine's probe over the reference's: 2.0 = twice as slow
    minimum_seconds: float
    preset_seconds: float
    stages: list = field(default_factory=list)
    decided: dict = field(default_factory=dict)  # stage -> the flags it was given as it started
    resumed: int = 0
    dry_run: bool = False  # made for DRY_RUN=1: printed, never measured, never in a report
    # The stages besides training took this times their planned seconds (measure_host_factor): the probe prices a
    # training step, and fp32 on a CPU with bf16 doubles it, not the tokenizer's or chat_eval's seconds
    host_factor: float = 1.0
    source: str = "builtin"  # the pretraining text's kind (speedrun.sh's SOURCE_KIND): what the data stages cost
    gpus: int = 1  # the gpu preset's: a step's cost is shared among them

    @property
    def deadline(self):
        return self.started_at + self.budget_seconds

    def stage(self, name):
        return next(s for s in self.stages if s.name == name)


# -----------------------------------------------------------------------------
# Measuring this machine


def probe_step_seconds(earlier=None):
    """Seconds per optimizer step of the cpu preset's base model here (base_train's probe: random tokens, its batch
    geometry, bf16 autocast where the CPU has it), and a name for the machine; no slower than `earlier`, a probe made
    before in this plan. Written where base_train's own probe looks first, so base_train does not measure it again."""
    import torch

    from nanochat.common import autocast_for, cpu_name
    from nanochat.recipe import DEFAULT_COMPONENTS, split_components
    from nanochat.planning.time_budget import RunShape, machine_signature, time_steps, write_measurements

    model_components, optimizer_components = split_components(DEFAULT_COMPONENTS)
    shape = RunShape(4096, 256, 2048, 1, 64, 128, None, model_components, optimizer_components, False, 8, 32768, None,
                     False, 0.0)
    device = torch.device("cpu")
    seconds = min([time_steps(4, 8, shape, device, autocast_for(device), 1.0) for _ in range(2)] +
                  ([earlier] if earlier else []))  # a VM's noise only ever slows a step
    write_measurements(machine_signature(shape, device), {4: (8, seconds)})
    return seconds, f"{cpu_name()}, {torch.get_num_threads()} threads"


# -----------------------------------------------------------------------------
# Deciding


class BudgetTooShort(Exception):
    """The budget cannot hold the stages' floors: its text is the one line for the user, `minimum` the least budget."""

    def __init__(self, message, minimum):
        super().__init__(message)
        self.minimum = minimum


def costs(preset, source="builtin", gpus=1):
    """The reference's costs for one speedrun: on the gpu preset a step's cost shared among the GPUs, and a source
    other than the built-in corpus priced with the hub's tasks (and the hub's download and tokenizer)."""
    reference = REFERENCE[preset]
    if preset != "gpu":
        return reference
    return dict(reference, fixed={**reference["fixed"], **(HUB_DATA if source == "hub" else {})},
                evals={**reference["evals"], **(HUB_EVALS if source != "builtin" else {})},
                train={name: (step / gpus, *rest) for name, (step, *rest) in reference["train"].items()})


def train_seconds(reference, name, steps, speed):
    step, fixed, _, _ = reference["train"][name]
    return speed * (fixed + step * steps)


def steps_in(reference, name, seconds, speed):
    step, fixed, _, _ = reference["train"][name]
    return max(0, int((seconds / speed - fixed) / step))


def plan_speedrun(budget_seconds, started_at, now, preset, speed, machine, rl=False, base_chat_eval=True,
                  source="builtin", gpus=1):
    """The plan for a budget that started at `started_at` (the speedrun's start), made at `now`, on a machine `speed`
    times as slow as the reference; BudgetTooShort when the budget cannot hold the stages' floors. rl="auto" (the gpu
    preset's default): chat_rl only where it pays (plan_rl_where_it_pays)."""
    from nanochat.common import format_duration
    from nanochat.planning.time_budget import duration_label

    if rl == "auto":
        return plan_rl_where_it_pays(budget_seconds, started_at, now, preset, speed, machine, base_chat_eval, source,
                                     gpus)
    reference = costs(preset, source, gpus)
    train_ref, preset_steps = reference["train"], reference["preset_steps"]
    final = "chat_eval rl" if rl else "chat_eval sft"
    fixed = {name: speed * s for name, s in reference["fixed"].items()}
    fixed[final] = speed * reference["evals"][final]
    spent = now - started_at  # uv, the preset's checks and the probe: measured, not priced
    available = budget_seconds - spent - sum(fixed.values()) - MARGIN * budget_seconds
    needed = ["base_train", "chat_sft"] + (["chat_rl"] if rl else [])
    least = sum(train_seconds(reference, n, train_ref[n][2], speed) for n in needed)
    minimum = math.ceil(PROBE_NOISE * (spent + sum(fixed.values()) + least) / (1 - MARGIN) / 10) * 10
    all_evals = [e for e in OPTIONAL_EVALS + (["chat_eval sft"] if rl else []) if base_chat_eval or e != "chat_eval base"]
    preset_time = spent + sum(fixed.values()) + speed * (
        sum(reference["evals"][e] for e in all_evals) + reference["preset_extra"] +
        sum(train_seconds(reference, n, preset_steps[n], 1.0) for n in needed + ["mid_train"]))
    if available < least:
        raise BudgetTooShort(f"NANOCHAT_TIME_BUDGET={duration_label(budget_seconds)} is too short for a chat model "
                             f"that answers on this machine: give at least {format_duration(minimum)} "
                             f"(base_train {train_ref['base_train'][2]} steps, chat_sft {train_ref['chat_sft'][2]}"
                             f"{', chat_rl ' + str(train_ref['chat_rl'][2]) if rl else ''}, the final evaluation); "
                             f"the {preset} preset takes about {format_duration(preset_time)} here", minimum)
    stages = {name: Stage(name, "fixed", seconds) for name, seconds in fixed.items()}
    stages[final].kind = "final"
    # chat_sft (and chat_rl) get the steps they need first, a share of the training time between their floor and need
    steps = {}
    for name in needed[1:]:
        _, _, fewest, wanted = train_ref[name]
        steps[name] = min(wanted, max(fewest, steps_in(reference, name, SFT_SHARE * available, speed)))
    # the evaluations besides the final one: none below the preset's time here (every second then goes to the chat
    # model), else in priority order while they fit their share (the mid-trained model's last, if mid_train runs)
    eval_time = 0.0

    def consider(name):
        nonlocal eval_time
        seconds = speed * reference["evals"][name]
        keep = budget_seconds >= preset_time and eval_time + seconds <= EVAL_SHARE * budget_seconds
        why = f"skipped: below the {preset} preset's time here every second goes to the chat model" \
            if budget_seconds < preset_time else f"skipped: the evaluations besides the final one may take " \
                                                 f"{EVAL_SHARE:.0%} of the budget"
        stages[name] = Stage(name, "eval", seconds if keep else 0.0, run=keep, why="" if keep else why)
        eval_time += seconds if keep else 0.0

    for name in all_evals:
        if name != "chat_eval mid":
            consider(name)
    # mid_train pays only where base_train keeps its preset's steps beside it (below, its seconds buy more base steps)
    rest = available - eval_time - sum(train_seconds(reference, n, k, speed) for n, k in steps.items())
    base_preset = train_seconds(reference, "base_train", preset_steps["base_train"], speed)
    mid_seconds = train_seconds(reference, "mid_train", train_ref["mid_train"][3], speed)
    if rest - mid_seconds >= base_preset:
        steps["mid_train"] = train_ref["mid_train"][3]
        # and chat_sft its preset's steps too, where base_train still keeps its own (the preset's arithmetic)
        more = train_seconds(reference, "chat_sft", preset_steps["chat_sft"], speed) - \
            train_seconds(reference, "chat_sft", steps["chat_sft"], speed)
        if rest - mid_seconds - more >= base_preset:
            rest -= more
            steps["chat_sft"] = preset_steps["chat_sft"]
        if rest - mid_seconds - speed * reference["evals"]["chat_eval mid"] >= base_preset:
            consider("chat_eval mid")
        else:
            stages["chat_eval mid"] = Stage("chat_eval mid", "eval", 0.0, run=False,
                                            why="skipped: its time keeps base_train at its preset's steps")
    else:
        stages["mid_train"] = Stage("mid_train", "train", 0.0, run=False,
                                    why=f"skipped: with base_train below its preset's {preset_steps['base_train']} "
                                        "steps, its time buys more as base_train's steps")
        stages["chat_eval mid"] = Stage("chat_eval mid", "eval", 0.0, run=False, why="skipped: no mid_train")
    # base_train the rest; below its floor the other stages give back steps, down to theirs
    while True:
        rest = available - eval_time - sum(train_seconds(reference, n, k, speed) for n, k in steps.items())
        if steps_in(reference, "base_train", rest, speed) >= train_ref["base_train"][2]:
            break
        shrinkable = [n for n, k in steps.items() if k > train_ref[n][2]]
        assert shrinkable, "the minimum was checked above"
        for name in shrinkable:
            steps[name] = max(train_ref[name][2], int(steps[name] * 0.9))
    steps["base_train"] = steps_in(reference, "base_train", rest, speed)
    for name, k in steps.items():
        seconds = rest if name == "base_train" else train_seconds(reference, name, k, speed)
        stages[name] = Stage(name, "train", seconds, steps=k)
    return SpeedrunPlan(budget_seconds, started_at, preset, machine, speed, minimum, preset_time,
                        [stages[name] for name in ORDER if name in stages], source=source, gpus=gpus)


def plan_rl_where_it_pays(budget_seconds, started_at, now, preset, speed, machine, base_chat_eval, source, gpus):
    """The plan with chat_rl where its floor is within its share of the training time, else without it: chat_rl and
    its evaluation then stand in the plan as skipped, with the reason."""
    from nanochat.common import format_duration

    args = (budget_seconds, started_at, now, preset, speed, machine)
    kwargs = dict(base_chat_eval=base_chat_eval, source=source, gpus=gpus)
    reference = costs(preset, source, gpus)
    floor = train_seconds(reference, "chat_rl", reference["train"]["chat_rl"][2], speed)
    try:
        plan = plan_speedrun(*args, rl=True, **kwargs)
        training = sum(s.seconds for s in plan.stages if s.kind == "train" and s.run)
        if floor <= SFT_SHARE * training:
            return plan
        why = f"its floor ({format_duration(floor)} here) is more than {SFT_SHARE:.0%} of the training time"
    except BudgetTooShort as short:
        why = f"its floor does not fit beside the other stages' (the budget would need " \
              f"{format_duration(short.minimum)} with it)"
    plan = plan_speedrun(*args, rl=False, **kwargs)
    plan.stages += [Stage("chat_rl", "train", 0.0, run=False, why="skipped: " + why),
                    Stage("chat_eval rl", "eval", 0.0, run=False, why="skipped: no chat_rl")]
    plan.stages.sort(key=lambda s: ORDER.index(s.name))
    return plan


def planned_seconds(plan, stage):
    """A stage's seconds as the plan now expects them: the other stages' costs as measured so far (host_factor)."""
    if not stage.run:
        return 0.0
    return stage.seconds if stage.kind == "train" else stage.seconds * plan.host_factor


def measure_host_factor(plan, measured):
    """As base_train starts: how the stages before it that ran (the data, the tokenizer; `measured`, name -> seconds
    from speedrun.sh's times file) compare with their planned seconds, kept within [0.5, 2]."""
    at = next(i for i, s in enumerate(plan.stages) if s.name == "base_train")
    ran = [s for s in plan.stages[:at] if s.run and s.name in measured]
    planned, took = sum(s.seconds for s in ran), sum(measured[s.name] for s in ran)
    if plan.dry_run or planned <= 0:
        return
    plan.host_factor = min(2.0, max(0.5, took / planned))
    print(f"plan | the data and the tokenizer took {took:.0f} s of the {planned:.0f} s planned: the evaluations and the "
          f"report after base_train planned at {plan.host_factor:.2f}x", file=sys.stderr)


def read_stage_times(path):
    """speedrun.sh's times file ("NAME SECONDS" a line, for the stages that ran) as {plan stage name: seconds}."""
    names = {"tokenizer: train": "tok_train", "tokenizer: eval": "tok_eval"}
    times = {}
    try:
        with open(path) as f:
            for line in f:
                label, _, seconds = line.strip().rpartition(" ")
                name = "data" if label.startswith("data") else names.get(label, label)
                if seconds.isdigit():
                    times[name] = times.get(name, 0) + int(seconds)
    except OSError:
        pass  # no stage has run in this base dir yet
    return times


def describe(plan):
    """The plan as the speedrun prints it before the first stage."""
    from nanochat.common import format_duration
    from nanochat.planning.time_budget import clock

    lines = [f"plan | speedrun in {format_duration(plan.budget_seconds)} from {clock(plan.started_at)}, ending by "
             f"{clock(plan.deadline)} | {plan.machine}: a step of the {plan.preset} preset's base model takes "
             f"{plan.speed:.2f}x the reference's | least budget here {format_duration(plan.minimum_seconds)}, the "
             f"{plan.preset} preset about {format_duration(plan.preset_seconds)}"]
    for s in plan.stages:
        if not s.run:
            what = s.why
        elif s.name == "base_train" and plan.preset == "gpu":  # its law chooses the depth: the steps are its own
            what = f"{s.seconds:.0f} s (its own plan sets the depth and the steps)"
        elif s.kind == "train":
            what = f"~{s.steps:,} steps in {s.seconds:.0f} s" + (" (its own plan sets the steps)" if
                                                                   s.name == "base_train" else "")
        else:
            what = f"{s.seconds:.0f} s"
        lines.append(f"plan | {s.name:<14} {what}")
    if memory := os.environ.get("NANOCHAT_GPU_MEMORY"):
        lines.append(f"plan | memory         NANOCHAT_GPU_MEMORY={memory}: base_train fits its depth, device batch and "
                     f"activation checkpointing to it (its plan gives the predicted peak), the process capped to it on "
                     f"a bigger GPU")
    return "\n".join(lines)


def report_section(plan):
    """The report card's section: the budget, what each stage was given, what was skipped and why."""
    from nanochat.common import format_duration

    rows = [{"Time budget": format_duration(plan.budget_seconds), "Machine": plan.machine,
             "Speed against the reference": f"{plan.speed:.2f}x", "Least budget here": format_duration(plan.minimum_seconds),
             "The preset here": format_duration(plan.preset_seconds)}]
    for s in plan.stages:
        given = plan.decided.get(s.name)
        status = ("skipped: " + given[0][len("skip:"):] if given and given[0].startswith("skip:") else
                  f"ran with {' '.join(given)}" if given else
                  ("planned" if s.run else s.why))
        planned = f"{s.steps} steps, {s.seconds:.0f} s" if s.kind == "train" else f"{s.seconds:.0f} s"
        rows.append(f"- {s.name}: planned {planned}; {status}")
    return rows


# -----------------------------------------------------------------------------
# Keeping to it, stage by stage


def stage_flags(plan, name, now, measured=None):
    """The flags a stage gets as it starts: its planned seconds scaled by the time left against the time planned for it
    and those after it (a late start shares the loss, an early one the gain), never below its minimum; "skip:..." for
    a stage that does not run. A stage given flags before (a resumed speedrun) gets the same ones."""
    if name in plan.decided:
        return plan.decided[name]
    reference = costs(plan.preset, plan.source, plan.gpus)
    stage = plan.stage(name)
    at = plan.stages.index(stage)
    if name == "base_train":
        measure_host_factor(plan, measured or {})
    planned = sum(planned_seconds(plan, s) for s in plan.stages[at:])
    left = plan.deadline - now - MARGIN * plan.budget_seconds * (1 - at / len(plan.stages))
    factor = 1.0 if plan.dry_run or planned <= 0 else max(0.0, left / planned)  # a dry run spends no time
    if not stage.run:
        flags = ["skip:" + (stage.why or "")]
    elif stage.kind == "eval":
        flags = ["skip: the run was late (%.0f s behind its plan)" % ((1 - factor) * planned)] if factor < 0.95 else []
    elif stage.kind == "train":
        # base_train all that the stages after it do not need, early or late; the others their planned seconds scaled
        # with the time left. Their own --time-budget then measures their steps, so a step that costs more or less
        # than the probe priced it (fp32 SFT ran 10 % faster) neither ends the run early nor late
        if name == "base_train":
            after = sum(planned_seconds(plan, s) for s in plan.stages[at + 1:])
            seconds = stage.seconds if plan.dry_run else plan.deadline - now - after - BASE_MARGIN * plan.budget_seconds
        else:
            seconds = stage.seconds * factor
        floor = train_seconds(reference, name, reference["train"][name][2], plan.speed)
        flags = [f"--time-budget={max(seconds, floor):.0f}s"]
    else:
        flags = []
    if name == "chat_sft" and not plan.stage("mid_train").run:
        flags += ["-i", "base"]  # from the base model: mid_train did not run
    plan.decided[name] = flags
    return flags


# -----------------------------------------------------------------------------
# Saving, and the speedrun's two calls


def save(plan, path):
    """Written whole or not at all: a speedrun killed mid-write resumes from the plan as it was."""
    fd, temporary = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".plan-")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(plan), f, indent=1)
    os.replace(temporary, path)


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # common.json_loads would import torch on the flags path
        sys.exit(f"error: no speedrun plan to follow in {path} ({e}); run speedrun.sh with NANOCHAT_TIME_BUDGET again")
    fields["stages"] = [Stage(**s) for s in fields["stages"]]
    return SpeedrunPlan(**fields)


def cmd_plan(args):
    from nanochat.common import UserError, format_duration
    from nanochat.planning.time_budget import clock, duration_label, parse_duration

    budget = parse_duration(args.budget, flag="NANOCHAT_TIME_BUDGET")
    if os.environ.get("NANOCHAT_GPU_MEMORY"):  # a bad value is refused now, not when base_train starts
        from nanochat.common import parse_memory

        parse_memory(os.environ["NANOCHAT_GPU_MEMORY"])
    path = args.plan_file
    if os.path.exists(path) and not args.fresh and not args.dry_run:  # a resumed speedrun follows the plan it made
        plan = load(path)
        if plan.budget_seconds == budget and plan.preset == args.preset:
            undone = [s for s in plan.stages if s.name not in plan.decided and s.run]
            interrupted = [s for s in plan.stages if s.name in plan.decided][-1:]
            plan.started_at = time.time() - plan.budget_seconds + sum(s.seconds for s in undone + interrupted)
            plan.resumed += 1
            save(plan, path)
            print(f"plan | resumed: the plan made before, with the time already spent not counted again; ending by "
                  f"{clock(plan.deadline)}")
            print(describe(plan))
            return
    if args.dry_run:
        speed, machine = 1.0, "(dry run: the reference machine's costs)"
    elif args.preset == "gpu":
        speed, machine = 1.0, (f"{args.gpus} GPU(s), priced from one H200's stages with the built-in corpus" +
                               ("" if args.data_source == "builtin" else ", this source's data and tasks guessed"))
    else:
        probe, machine = probe_step_seconds()
        speed = probe / REFERENCE[args.preset]["probe_seconds"]

    for attempt in (1, 2):
        try:
            plan = plan_speedrun(budget, args.started_at, time.time(), args.preset, speed, machine,
                                 rl=args.rl if args.rl == "auto" else bool(int(args.rl)),
                                 base_chat_eval=args.base_chat_eval, source=args.data_source, gpus=args.gpus)
            break
        except BudgetTooShort as short:
            # near the minimum a refusal waits for a second probe, the faster deciding (a VM's speed drifts)
            if attempt == 2 or args.dry_run or args.preset == "gpu" or budget < short.minimum / 2:
                raise UserError(str(short)) from None
            print(f"plan | {duration_label(budget)} is short of {format_duration(short.minimum)} at {speed:.2f}x "
                  f"the reference's: measuring this machine once more")
            probe, machine = probe_step_seconds(earlier=probe)
            speed = probe / REFERENCE[args.preset]["probe_seconds"]
    plan.dry_run = args.dry_run
    print(describe(plan))
    save(plan, path)


def cmd_flags(args):
    plan = load(args.plan_file)
    times = os.path.join(os.path.dirname(os.path.abspath(args.plan_file)), TIMES_FILE)
    flags = stage_flags(plan, args.stage, time.time(), read_stage_times(times))
    save(plan, args.plan_file)
    if args.stage == "report" and not plan.dry_run:  # the report card says what each stage was given
        from nanochat.report import get_report

        get_report().log("Speedrun plan", report_section(plan))
    if flags and flags[0].startswith("skip:"):
        print(f"speedrun: {args.stage} {flags[0][len('skip:'):].strip() or 'skipped'}", file=sys.stderr)
    print(" ".join(flags))

