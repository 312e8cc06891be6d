"""
Build the built-in corpus: pretraining shards about a synthetic world, and a CORE eval bundle about it, offline.

  python -m nanochat.corpus                      # base_data/builtin and eval_bundle_builtin in the base dir
  python -m nanochat.corpus --seed 43 --size-mb 12 --out /tmp/corpus

The logic lives in nanochat/corpus/build.py; this only parses flags.
"""

import argparse

from nanochat.common import run_main
from nanochat.corpus.build import write_corpus


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nanochat.corpus",
                                     description="Build the offline built-in pretraining corpus (a synthetic world).")
    parser.add_argument("--seed", type=int, default=42, help="world and document seed (same seed -> identical files)")
    parser.add_argument("--size-mb", type=float, default=6.0, help="target text size in MB, train + val")
    parser.add_argument("--shard-mb", type=float, default=2.0, help="target text size of one train shard in MB")
    parser.add_argument("--out", type=str, default=None,
                        help="output directory (default: <base_dir>/base_data/builtin; the CORE eval bundle then goes "
                             "to <base_dir>/eval_bundle_builtin, else to OUT/eval_bundle_builtin)")
    args = parser.parse_args(argv)
    write_corpus(args.out, seed=args.seed, size_mb=args.size_mb, shard_mb=args.shard_mb)


if __name__ == "__main__":
    run_main(main)
