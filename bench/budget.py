"""
`bench budget`: base_train --time-budget as a user runs it. For each budget, a real `python -m scripts.base_train
--time-budget=B` in a fresh copy of a base dir (the built-in corpus and the CPU preset's 4,096-token tokenizer unless
--base-dir names another): the plan it printed, the process's wall time against the budget, and the val bpb the
scaling law predicted against the one the run measured at its end. One at a time; take the numbers on a quiet machine.
"""

import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from bench.common import OtherLoad, emit_json, log, machine_info, print_table

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_budget(base_dir, budget, flags, work_dir):
    """One budgeted base_train in its own copy of base_dir (shared tokenizer and data, its own checkpoints and
    report); returns the row of the results."""
    run_dir = os.path.join(work_dir, f"budget-{budget}")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    for entry in ("tokenizer", "base_data", "eval_bundle_builtin"):
        if os.path.exists(os.path.join(base_dir, entry)):
            os.symlink(os.path.join(base_dir, entry), os.path.join(run_dir, entry))
    command = [sys.executable, "-m", "scripts.base_train", f"--time-budget={budget}", *flags]
    log(f"$ NANOCHAT_BASE_DIR={run_dir} {' '.join(command)}")
    started, busy, ours = time.time(), OtherLoad._busy_seconds(), cpu_seconds()
    p = subprocess.run(command, cwd=REPO_ROOT, env=dict(os.environ, NANOCHAT_BASE_DIR=run_dir), capture_output=True,
                       text=True)
    wall = time.time() - started
    # cores' worth of CPU that processes other than this one and the run used meanwhile (near 0: a quiet machine)
    other_load = max(0.0, (OtherLoad._busy_seconds() - busy) - (cpu_seconds() - ours)) / wall
    with open(os.path.join(run_dir, "output.log"), "w") as f:
        f.write(p.stdout + p.stderr)
    if p.returncode != 0:
        raise RuntimeError(f"base_train --time-budget={budget} failed:\n{p.stderr[-2000:]}")
    out = p.stdout
    plan = re.search(r"plan \| d(\d+): ([\d,]+) params \(([\d,]+) scaling\), ([\d,]+) steps x ([\d,]+) tokens .*"
                     r"device batch (\d+) x (\d+) accum \| predicted val bpb ([\d.]+)", out)
    calibrated = re.search(r"plan \| step \d+: .* -> ([\d,]+) steps", out)
    final = re.search(r"done: (\d+)/\d+ steps .*val_bpb ([\d.]+)", out)
    seconds = budget_seconds(budget)
    number = lambda text: int(text.replace(",", ""))  # noqa: E731
    return {"budget": budget, "budget_s": seconds, "wall_s": round(wall, 1), "error_pct": round(100 * (wall / seconds - 1), 1),
            "depth": int(plan.group(1)), "params": number(plan.group(2)), "scaling_params": number(plan.group(3)),
            "planned_steps": number(plan.group(4)), "steps": number(calibrated.group(1)) if calibrated else number(plan.group(4)),
            "tokens": int(final.group(1)) * number(plan.group(5)), "device_batch": int(plan.group(6)),
            "predicted_bpb": float(plan.group(8)), "val_bpb": float(final.group(2)),
            "probe": re.search(r"plan \| probe (.*)", out).group(1), "other_load": round(other_load, 2),
            "log": os.path.join(run_dir, "output.log")}


def cpu_seconds():
    """CPU time of this process and its finished children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def budget_seconds(text):
    from nanochat.planning.time_budget import parse_duration

    return parse_duration(text)


def cmd_budget(args):
    from bench.common import ensure_builtin_workspace

    work_dir = args.work_dir or os.path.join(tempfile.gettempdir(), "nanochat_bench_budget")
    os.makedirs(work_dir, exist_ok=True)
    base_dir = args.base_dir or ensure_builtin_workspace(os.path.join(work_dir, "builtin"), 4096, log=log)["base_dir"]
    flags = ["--device-type=cpu"] if args.device_type == "cpu" else []
    flags += [f"--data-source={args.data_source}"] if args.data_source else []
    rows = [run_budget(base_dir, budget, flags, work_dir) for budget in args.budgets]
    print_table(f"base_train --time-budget ({args.data_source or 'builtin'}; wall time of the whole process)",
                ["budget", "wall", "error %", "depth", "params (scaling)", "steps (planned)", "tokens", "predicted bpb",
                 "val bpb", "other load"],
                [[r["budget"], f"{r['wall_s']:.0f} s", f"{r['error_pct']:+.1f}", r["depth"],
                  f"{r['params']:,} ({r['scaling_params']:,})", f"{r['steps']:,} ({r['planned_steps']:,})",
                  f"{r['tokens'] / 1e6:.1f}M", f"{r['predicted_bpb']:.4f}", f"{r['val_bpb']:.4f}", r["other_load"]]
                 for r in rows])
    for r in rows:
        print(f"  {r['budget']}: probe {r['probe']}")
    emit_json({"bench": "budget", "machine": machine_info(), "runs": rows})
