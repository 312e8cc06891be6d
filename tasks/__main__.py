"""
List every chat task from what is on this machine (no network): examples per split, eval type,
chance baseline and one example; or fetch a hub task's files.

    python -m tasks
    python -m tasks --download GSM8K      (or --download all)
"""

import argparse

import pyarrow.parquet as pq

from nanochat.common import UserError, run_main
from nanochat.data.hub import fetch_parquet_files, local_parquet_files, local_row_count, table_row
from tasks import BUILTIN_TASKS, HUB_TASKS, TASKS, arc, canonical_name, gsm8k, humaneval, mmlu, smoltalk
from tasks.base import conversation_text

# name -> (repo, config, eval type, baseline as shown, row -> conversation)
HUB_SOURCES = {
    "ARC-Easy": (arc.REPO, "ARC-Easy", "categorical", "1/choices", arc.conversation_from_row),
    "ARC-Challenge": (arc.REPO, "ARC-Challenge", "categorical", "1/choices", arc.conversation_from_row),
    "MMLU": (mmlu.REPO, "all", "categorical", "0.250", mmlu.conversation_from_row),
    "MMLU-aux": (mmlu.REPO, "auxiliary_train", "categorical", "0.250", mmlu.conversation_from_row),
    "GSM8K": (gsm8k.REPO, "main", "generative", "0.000", gsm8k.conversation_from_row),
    "HumanEval": (humaneval.REPO, "openai_humaneval", "generative", "0.000", humaneval.conversation_from_row),
    "SmolTalk": (smoltalk.REPO, "default", "generative", "-", smoltalk.conversation_from_row),
}
EXAMPLE_CHARS = 400


def hub_row(name):
    """(table row, example text) for a hub task, from local files only."""
    repo, config, eval_type, baseline, to_conversation = HUB_SOURCES[name]
    counts, example = [], None
    for split in TASKS[name][2]:
        rows = local_row_count(repo, config, split)
        counts.append(f"{split} {rows:,}" if rows is not None else f"{split} -")
        if rows and example is None:
            first = pq.ParquetFile(local_parquet_files(repo, config, split)[0]).read_row_group(0).slice(0, 1)
            example = conversation_text(to_conversation(table_row(first, 0)))
    if example is None:
        counts = [f"not downloaded (python -m tasks --download {name} to fetch)"]
    return [name, ", ".join(counts), eval_type, baseline], example


def builtin_row(name):
    cls, fixed, splits = TASKS[name]
    tasks = [cls(split=split, **fixed) for split in splits]
    counts = ", ".join(f"{split} {len(task):,}" for split, task in zip(splits, tasks))
    evaluated = tasks[-1]  # the held-out split is the one chat_eval scores
    return [name, counts, evaluated.eval_type, f"{evaluated.baseline:.3f}"], conversation_text(tasks[0][0])


def print_table(rows):
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        if k == 0:
            print("  ".join("-" * width for width in widths))


def main(argv=None):
    parser = argparse.ArgumentParser(description="List the chat tasks, or download a hub task's parquet files.")
    parser.add_argument("--download", metavar="NAME", help=f"fetch a hub task ({', '.join(HUB_TASKS)}) or 'all'")
    args = parser.parse_args(argv)

    if args.download:
        names = HUB_TASKS if args.download.lower() == "all" else [canonical_name(args.download)]
        for name in names:
            if name not in HUB_SOURCES:
                raise UserError(f"{name} is not downloaded from the hub; hub tasks: {', '.join(HUB_TASKS)}")
            repo, config = HUB_SOURCES[name][:2]
            for split in TASKS[name][2]:
                paths = fetch_parquet_files(name, repo, config, split)
                print(f"{name} {split}: {len(paths)} file(s) in {paths[0].rsplit('/', 1)[0]}")
        return

    rows, examples = [["task", "examples per split", "eval type", "baseline"]], []
    for name in TASKS:
        if name in HUB_SOURCES:
            row, example = hub_row(name)
        elif name in BUILTIN_TASKS:
            row, example = builtin_row(name)
        else:  # CustomJSON
            row, example = [name, "your JSONL file (--data FILE, chat_eval -a file:PATH)", "generative", "0.000"], None
        rows.append(row)
        if example:
            examples.append((name, example))
    print_table(rows)
    for name, example in examples:
        shown = example if len(example) <= EXAMPLE_CHARS else example[:EXAMPLE_CHARS] + " ..."
        print(f"\n== {name} ==\n{shown}")


if __name__ == "__main__":
    run_main(main)
