"""
The built-in corpus (`python -m nanochat.corpus [--seed 42] [--size-mb 6] [--out DIR]`): pretraining shards about the
synthetic world of nanochat.corpus, generated from a seed with no network (same seed, byte-identical files).
The val shard (shard_00000) holds fresh documents about the same world, none identical to a train document. Beside
the shards go a CORE eval bundle about that world, so `scripts.base_eval --eval-bundle=builtin` needs no network,
and corpus.json with the seed, so the chat stages know which world to ask about.
"""

import json
import os
import random
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.common import UserError, atomic_write_text, ensure_writable, json_load_file, print0
from nanochat.core_eval import BUILTIN_BUNDLE_NAME, builtin_eval_bundle_dir
from nanochat.corpus.core_bundle import write_eval_bundle
from nanochat.corpus.documents import generate_world_documents
from nanochat.corpus.drills import arithmetic_document, spelling_document
from nanochat.corpus.world import build_world
from nanochat.dataset import SHARD_RE, get_data_dir, get_source, shard_filename

CORPUS_VERSION = 1  # bump when the generator changes what a seed produces
MIXTURE = {"world": 0.84, "arithmetic": 0.08, "spelling": 0.08}  # fractions of the text bytes


def generate_pretraining_documents(world, rng, target_bytes, full_pass=True, mentions=None):
    """World, arithmetic and spelling documents in MIXTURE proportions (by bytes), shuffled together."""
    docs = generate_world_documents(world, rng, MIXTURE["world"] * target_bytes, full_pass, mentions)
    for name, make in (("arithmetic", arithmetic_document), ("spelling", spelling_document)):
        size = 0
        while size < MIXTURE[name] * target_bytes:
            doc = make(rng, world)
            docs.append(doc)
            size += len(doc.encode("utf-8"))
    rng.shuffle(docs)
    return docs


def write_shard(path, docs, rows_per_group):
    table = pa.table({"text": pa.array(docs, type=pa.string())})
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(table, tmp, row_group_size=rows_per_group, compression="zstd")
    os.replace(tmp, path)


def write_corpus(out_dir=None, seed=42, size_mb=6.0, shard_mb=2.0, val_fraction=0.05, verbose=True):
    """Build the corpus for a seed into out_dir (default: the builtin source's data dir) and its CORE bundle into the
    default bundle dir for the default out_dir, else out_dir/eval_bundle_builtin, so a corpus built elsewhere never
    replaces the default corpus's bundle. Returns a summary dict."""
    if not size_mb > 0:
        raise UserError(f"--size-mb must be positive (got {size_mb})")
    if not shard_mb > 0:
        raise UserError(f"--shard-mb must be positive (got {shard_mb})")
    log = print0 if verbose else (lambda *a, **k: None)
    default_dir = get_data_dir("builtin")
    out_dir = out_dir or default_dir
    same_dir = os.path.abspath(out_dir) == os.path.abspath(default_dir)
    eval_bundle_dir = builtin_eval_bundle_dir() if same_dir else os.path.join(out_dir, BUILTIN_BUNDLE_NAME)
    ensure_writable(out_dir, "the built-in corpus (--out)")
    os.makedirs(out_dir, exist_ok=True)
    log(f"corpus: seed={seed} size_mb={size_mb} shard_mb={shard_mb} out={out_dir}")
    t0 = time.time()

    world = build_world(seed)
    total_bytes = size_mb * 1e6
    mentions = Counter()
    train = generate_pretraining_documents(world, random.Random(f"nanochat-train-{seed}"),
                                           (1 - val_fraction) * total_bytes, mentions=mentions)
    seen = set(train)
    val = [d for d in generate_pretraining_documents(world, random.Random(f"nanochat-val-{seed}"),
                                                      max(val_fraction * total_bytes, 20_000), full_pass=False)
           if d not in seen]  # held-out documents: never a verbatim copy of a train document
    counts = [mentions[f] for f in world.facts]
    log(f"generated {len(train):,} train + {len(val):,} val documents in {time.time() - t0:.1f}s; "
        f"facts told {min(counts)}..{max(counts)} times (mean {sum(counts) / len(counts):.1f})")

    # Row groups of a few hundred documents, but always enough of them for ranks to share out.
    rows_per_group = max(8, min(256, len(train) // 32))
    groups = [train[i:i + rows_per_group] for i in range(0, len(train), rows_per_group)]
    train_bytes = sum(len(d.encode("utf-8")) for d in train)
    num_train_shards = max(1, min(len(groups), round(train_bytes / (shard_mb * 1e6))))
    val_index = get_source("builtin").val_index
    shards = [(val_index, val)]
    train_indices = [i for i in range(num_train_shards + 1) if i != val_index]
    for k, index in enumerate(train_indices):
        lo, hi = len(groups) * k // num_train_shards, len(groups) * (k + 1) // num_train_shards
        shards.append((index, [d for g in groups[lo:hi] for d in g]))

    disk_bytes = 0
    for index, docs in shards:
        path = os.path.join(out_dir, shard_filename(index))
        write_shard(path, docs, rows_per_group)
        disk_bytes += os.path.getsize(path)
        log(f"wrote {shard_filename(index)}: {len(docs):,} docs, {pq.ParquetFile(path).num_row_groups} row groups"
            f"{' (val)' if index == val_index else ''}")
    # Shards left over from an earlier, bigger build would silently join the train split.
    for name in sorted(os.listdir(out_dir)):
        m = SHARD_RE.match(name)
        if m and int(m.group(1)) not in dict(shards):
            os.remove(os.path.join(out_dir, name))
            log(f"removed stale {name}")

    eval_tasks = write_eval_bundle(eval_bundle_dir, world, seed, version=CORPUS_VERSION)
    log(f"wrote CORE eval bundle: {len(eval_tasks)} tasks, {sum(len(t['examples']) for t in eval_tasks):,} examples "
        f"-> {eval_bundle_dir}")

    text_bytes = train_bytes + sum(len(d.encode("utf-8")) for d in val)
    summary = {
        "version": CORPUS_VERSION, "seed": seed, "size_mb": size_mb, "train_docs": len(train), "val_docs": len(val),
        "text_mb": round(text_bytes / 1e6, 3), "disk_mb": round(disk_bytes / 1e6, 3), "shards": len(shards),
        "rows_per_group": rows_per_group, "mentions_min": min(counts), "mentions_mean": round(sum(counts) / len(counts), 1),
        "eval_bundle_dir": os.path.abspath(eval_bundle_dir), "seconds": round(time.time() - t0, 2),
    }
    atomic_write_text(os.path.join(out_dir, "corpus.json"), json.dumps(summary, indent=2) + "\n")
    log(f"done: {len(train) + len(val):,} docs, {summary['text_mb']} MB of text ({summary['disk_mb']} MB on disk), "
        f"{len(shards)} shards, {summary['seconds']}s")
    return summary


def read_corpus_info(out_dir=None):
    """The summary written by write_corpus (its seed tells chat stages which world to ask about), or None."""
    path = os.path.join(out_dir or get_data_dir("builtin"), "corpus.json")
    if not os.path.exists(path):
        return None
    return json_load_file(path)

