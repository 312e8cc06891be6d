"""
The data sources' command line: download a hub source's shards, import your own text as a source, list the sources on
disk. Run as `python -m nanochat.dataset` (karpathy/nanochat's command), which runs this script:

  python -m nanochat.dataset -n 8 --data-source climbmix          # the first 8 train shards and the val shard
  python -m nanochat.dataset import mybooks ~/books/ --max-doc-chars=8000
  python -m nanochat.dataset list

The logic lives in nanochat/dataset.py (shards, sources, the download) and nanochat/data/text_import.py (an import);
this script parses flags, checks them and prints what was done.
"""

import argparse
import os
import sys

from nanochat.common import RenamedFlag, UserError, ensure_writable, get_base_dir, run_main
from nanochat.dataset import (SHARD_RE, SOURCES, data_dir_path, download_shards, get_source, is_plain_name,
                              shard_filename, source_names_on_disk)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["import"]:
        return import_main(argv[1:])
    if argv[:1] == ["list"]:
        return list_main(argv[1:])
    return download_main(argv)


def import_main(argv):
    from nanochat.data import text_import as ti

    parser = argparse.ArgumentParser(prog="python -m nanochat.dataset import",
                                     description="Build a data source NAME from your own text (files, folders, globs "
                                                 "or a Hugging Face dataset); docs/data.md.")
    parser.add_argument("name", help="the source's name: then --data-source NAME or NANOCHAT_DATA_SOURCE=NAME")
    parser.add_argument("inputs", nargs="*", help=".txt/.md, .jsonl/.json, .parquet files (optionally .gz/.zst), "
                                                  "folders (searched recursively) or quoted globs")
    parser.add_argument("--split-on", default="file", choices=["file", "blank-lines"],
                        help=".txt/.md: one document per file (default) or one per blank-line-separated block")
    parser.add_argument("--field", default="text", help="JSON(L): the field holding the text; dotted paths allowed "
                                                        "(default text)")
    parser.add_argument("--column", default="text", help="parquet (and --hf-repo): the text column (default text)")
    parser.add_argument("--val-docs", type=int, default=None, help="documents in the val shard (chosen by hash)")
    parser.add_argument("--val-frac", type=float, default=None,
                        help=f"fraction of the documents in the val shard, by hash (default {ti.DEFAULT_VAL_FRAC:g})")
    parser.add_argument("--max-doc-chars", type=int, default=None,
                        help="cut longer documents into pieces of at most this many characters, at paragraph, line, "
                             "sentence or word boundaries (about 4 x the tokens of a row fits one row)")
    parser.add_argument("--max-seq-len", type=int, default=2048,
                        help="the context length the summary's crop estimate is for (default 2048)")
    parser.add_argument("--hf-repo", default=None, help="import a Hugging Face dataset (owner/name) through the "
                                                        "hub's parquet API ($HF_ENDPOINT honoured)")
    parser.add_argument("--config", default="default", help="--hf-repo: the dataset config (default 'default')")
    parser.add_argument("--split", default="train", help="--hf-repo: the split (default train)")
    parser.add_argument("--follow-links", action="store_true",
                        help="in folders and globs, also read links to folders and to files outside the input (each "
                             "folder once); without it they are skipped, and the summary says so")
    args = parser.parse_args(argv)
    options = ti.ImportOptions(split_on=args.split_on, field=args.field, column=args.column, val_docs=args.val_docs,
                               val_frac=args.val_frac, max_doc_chars=args.max_doc_chars, max_seq_len=args.max_seq_len)
    if args.hf_repo and args.inputs:
        raise UserError("pass input files or --hf-repo, not both")
    if not args.hf_repo and not args.inputs:
        raise UserError("nothing to import: pass files, folders or globs, or --hf-repo owner/name")
    if not is_plain_name(args.name) or args.name in SOURCES:
        ti.build_source(args.name, [], options, reserved=list(SOURCES))  # refuses the name, before reading any input
    if args.hf_repo:
        ti.check_hub_dataset(args.hf_repo, args.config, args.split)
    ensure_writable(os.path.join(get_base_dir(), "base_data"), f"the {args.name} source")
    inputs = [ti.hub_input(args.hf_repo, args.config, args.split)] if args.hf_repo else \
        ti.local_inputs(args.inputs, follow_links=args.follow_links)
    print(f"import {args.name}: {sum(len(i.files) for i in inputs)} file(s) from {len(inputs)} input(s), "
          f"val {'%d docs' % args.val_docs if args.val_docs else 'fraction %g' % (args.val_frac or ti.DEFAULT_VAL_FRAC)}, "
          f"max doc chars {args.max_doc_chars or 'none'}", flush=True)
    command = "python -m nanochat.dataset import " + " ".join(
        [args.name] + (args.inputs or [f"--hf-repo {args.hf_repo} --config {args.config} --split {args.split}"]))
    manifest = ti.build_source(args.name, inputs, options, command=command, reserved=list(SOURCES))
    if not manifest["unchanged"]:
        ti.print_summary(manifest, os.path.join(get_base_dir(), "base_data", args.name))


def list_main(argv):
    argparse.ArgumentParser(prog="python -m nanochat.dataset list",
                            description="Show every data source on disk: its shards, size and val shard.").parse_args(argv)
    root = os.path.join(get_base_dir(), "base_data")
    names = source_names_on_disk()
    if not names:
        print(f"no data sources in {root}; build the built-in one with `python -m nanochat.corpus`, download one with "
              f"`python -m nanochat.dataset -n 8 --data-source climbmix`, or import your own with "
              f"`python -m nanochat.dataset import NAME FILES...`")
        return
    print(f"data sources in {root}:")
    print(f"  {'name':<16} {'kind':<10} {'train shards':>12} {'size':>10}  val shard")
    for name in names:
        src = get_source(name)
        directory = os.path.join(root, name)
        shards = [n for n in os.listdir(directory) if SHARD_RE.match(n)]
        size = sum(os.path.getsize(os.path.join(directory, n)) for n in shards)
        val = shard_filename(src.val_index)
        kind = "hub" if src.hf_repo else ("imported" if name not in SOURCES else "built")
        train = sum(1 for n in shards if n != val)
        print(f"  {name:<16} {kind:<10} {train:>12} {size / 1e6:>8.1f}MB  {val if val in shards else 'missing'}")


def download_main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m nanochat.dataset",
                                     description="Download pretraining shards (first N train shards + the val shard).")
    parser.add_argument("-n", "--num-files", type=int, default=-1, help="train shards to fetch (-1 = all)")
    parser.add_argument("-w", "--num-workers", type=int, default=8, help="parallel downloads")
    parser.add_argument("--data-source", default=None,
                        help=f"one of {', '.join(SOURCES)} (default: $NANOCHAT_DATA_SOURCE or builtin)")
    parser.add_argument("--source", dest="data_source", action=RenamedFlag, new="--data-source",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser.add_argument("--max-attempts", type=int, default=5, help="tries per shard before giving up")
    args = parser.parse_args(argv)

    src = get_source(args.data_source)
    if src.hf_repo is None:
        raise UserError(f"source {src.name!r} has no URL to download from; build it with `{src.build_command}`")
    num_train = src.num_shards - 1  # every shard except the val shard
    if args.num_files < -1 or args.num_files > num_train:
        raise UserError(f"-n must be between 0 and {num_train} for {src.name}, or -1 for all (got {args.num_files})")
    if args.num_workers < 1:
        raise UserError(f"-w must be at least 1 (got {args.num_workers})")
    if args.max_attempts < 1:
        raise UserError(f"--max-attempts must be at least 1 (got {args.max_attempts})")
    n = num_train if args.num_files == -1 else args.num_files
    train_indices = [i for i in range(src.num_shards) if i != src.val_index][:n]
    data_dir = ensure_writable(data_dir_path(src.name), "downloaded shards")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    print(f"{src.name}: {n} train shards + val shard {src.val_index} from {endpoint}/datasets/{src.hf_repo} "
          f"-> {data_dir} ({args.num_workers} workers, {args.max_attempts} attempts each)", flush=True)

    try:
        summary = download_shards(src.name, train_indices + [src.val_index], args.num_workers,
                                  data_dir=data_dir, max_attempts=args.max_attempts)
    except KeyboardInterrupt:
        print("\ninterrupted: finished shards are kept; re-run the same command to resume", flush=True)
        sys.exit(130)
    print(f"done: {summary.downloaded} downloaded, {summary.skipped} already present, {len(summary.failed)} failed, "
          f"{summary.bytes / 1e6:.1f} MB in {summary.seconds:.1f} s", flush=True)
    if summary.failed:
        for index in sorted(summary.failed):
            print(f"  shard {index}: {summary.failed[index]}", flush=True)
        raise UserError(f"{len(summary.failed)} shard(s) failed; re-run the same command to retry them "
                        f"(finished shards are kept)")


if __name__ == "__main__":
    run_main(main)
