"""
The report card's command line: start it (reset) at the beginning of a run, assemble report.md (generate) at the end.
`python -m nanochat.report` (karpathy/nanochat's command):

  python -m nanochat.report reset
  python -m nanochat.report generate --hourly-price 24

The logic lives in nanochat/report/__init__.py; this only parses flags.
"""

import argparse
import math
import os

from nanochat.common import UserError, run_main
from nanochat.report import REPORT_NAME, Report, get_report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nanochat.report",
                                     description="Start (reset) or assemble (generate) the training report.")
    parser.add_argument("command", choices=["reset", "generate"])
    parser.add_argument("--hourly-price", type=float, default=None,
                        help="USD per hour for this node, for the cost estimate (default: guessed from the GPUs)")
    args = parser.parse_args(argv)
    if args.hourly_price is not None and not (args.hourly_price >= 0 and math.isfinite(args.hourly_price)):
        raise UserError(f"--hourly-price must be a non-negative number of USD per hour (got {args.hourly_price})")
    report = get_report()
    if args.command == "reset":
        report.reset()
        if isinstance(report, Report):
            print(f"report reset: {report.report_dir}")
    else:
        path = report.generate(hourly_price_usd=args.hourly_price)
        if path:
            print(f"report written: {path} (copy: {os.path.join(os.getcwd(), REPORT_NAME)})")


if __name__ == "__main__":
    run_main(main)
