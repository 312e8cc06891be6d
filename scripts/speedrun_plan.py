"""
The speedrun's plan, as speedrun.sh asks for it: the budget read, the whole run planned before any stage, and each
stage's flags as it starts (docs/time_budget.md "The whole speedrun to a budget").

  python -m scripts.speedrun_plan budget 5m                                # "SECONDS LABEL", or one line and exit 1
  python -m scripts.speedrun_plan plan 5m --preset cpu --started-at EPOCH  # measure, decide, print, save
  python -m scripts.speedrun_plan flags chat_sft                           # a stage's flags, as it starts

The logic lives in nanochat/planning/pipeline_plan.py (the plan) and time_budget.py (durations); this script only
parses flags. `flags` runs as each stage starts, so its path imports no torch (1-2 s a start on a CPU).
"""

import argparse
import os
import sys
import time

from nanochat.planning.pipeline_plan import ORDER, PLAN_FILE, REFERENCE, cmd_flags, cmd_plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="the speedrun to a time budget, planned as a whole")
    sub = p.add_subparsers(dest="command", required=True)
    budget = sub.add_parser("budget", help="NANOCHAT_TIME_BUDGET read: 'SECONDS LABEL', or one line and exit 1")
    budget.add_argument("budget")
    plan = sub.add_parser("plan", help="measure this machine, decide every stage, print and save the plan")
    plan.add_argument("budget")
    plan.add_argument("--preset", default="cpu", choices=sorted(REFERENCE))
    plan.add_argument("--started-at", type=float, default=time.time(), help="when the speedrun began (epoch seconds)")
    plan.add_argument("--rl", default="0", choices=["0", "1", "auto"],
                      help="1: chat_rl must fit; auto: where its floor fits (the gpu preset's default)")
    plan.add_argument("--data-source", default="builtin", choices=["builtin", "brown", "hub", "imported"],
                      help="the pretraining text's kind: what the data stages and evaluations cost")
    plan.add_argument("--gpus", type=int, default=1, help="the gpu preset's GPUs: a step's cost is shared among them")
    plan.add_argument("--base-chat-eval", type=int, default=1, help="0: the source has no built-in world to recall")
    plan.add_argument("--dry-run", action="store_true", help="the reference machine's costs, nothing measured or saved")
    plan.add_argument("--fresh", action="store_true", help="a new plan even where one was saved")
    plan.add_argument("--plan-file", default=None, help=f"default: $NANOCHAT_BASE_DIR/{PLAN_FILE}")
    flags = sub.add_parser("flags", help="a stage's flags as it starts ('skip:...' for an evaluation that does not run)")
    flags.add_argument("stage", choices=ORDER)
    flags.add_argument("--plan-file", default=None, help=f"default: $NANOCHAT_BASE_DIR/{PLAN_FILE}")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.command == "budget":
        from nanochat.planning.time_budget import duration_label, parse_duration

        total = parse_duration(args.budget, flag="NANOCHAT_TIME_BUDGET")
        print(round(total), duration_label(total))
        return
    if args.plan_file is None:
        from nanochat.common import get_base_dir

        args.plan_file = os.path.join(get_base_dir(), PLAN_FILE)
    (cmd_plan if args.command == "plan" else cmd_flags)(args)


if __name__ == "__main__":
    if sys.argv[1:2] == ["flags"]:
        main()
    else:
        from nanochat.common import run_main

        run_main(main)
