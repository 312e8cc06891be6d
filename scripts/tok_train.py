"""
Train the BPE tokenizer on the pretraining corpus and save it to <base_dir>/tokenizer/.

    python -m scripts.tok_train                                  # defaults: 2e9 chars, vocab 32768
    python -m scripts.tok_train --max-chars=2e7 --vocab-size=4096   # a small corpus / CPU run

Documents come from the train split of the chosen source, each cut to --doc-cap
characters (so a few giant documents cannot dominate the pair counts), until
--max-chars characters have been read.
"""

import argparse
import time

from nanochat.common import RenamedFlag, UserError, ensure_writable, print0, run_main
from nanochat.dataset import get_default_source, parquets_iter_batched
from nanochat.report import get_report
from nanochat.tokenizer import (SPECIAL_TOKENS, TOKEN_BYTES_FILE, RustBPETokenizer, get_tokenizer_dir,
                                previous_tokenizers_dir, set_aside_tokenizer)

PROGRESS_EVERY_S = 10.0


def count_arg(text):
    """An int flag that also accepts 2e9 / 2_000_000_000 style values."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    return int(value)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Train the nanochat BPE tokenizer.")
    parser.add_argument(
        "--max-chars",
        type=count_arg,
        default=2_000_000_000,
        help="stop after this many characters of text (default 2e9)",
    )
    parser.add_argument(
        "--doc-cap",
        type=count_arg,
        default=10_000,
        help="use at most this many characters of each document (default 10000)",
    )
    parser.add_argument(
        "--vocab-size",
        type=count_arg,
        default=32768,
        help="vocabulary size including the special tokens (default 32768)",
    )
    parser.add_argument(
        "--data-source",
        default=None,
        help="data source: builtin, brown, fineweb-edu, climbmix or one you imported "
        "(default: $NANOCHAT_DATA_SOURCE or builtin)",
    )
    parser.add_argument("--source", dest="data_source", action=RenamedFlag, new="--data-source",
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


class ReadStats:
    def __init__(self):
        self.chars = 0
        self.docs = 0
        self.t0 = time.time()
        self.last_print = self.t0


def capped_documents(max_chars, doc_cap, source, stats):
    """Yield train documents cut to doc_cap characters until max_chars have been yielded."""
    for batch in parquets_iter_batched("train", source=source):
        for doc in batch:
            doc = doc[:doc_cap]
            stats.chars += len(doc)
            stats.docs += 1
            yield doc
            now = time.time()
            if now - stats.last_print >= PROGRESS_EVERY_S:
                stats.last_print = now
                rate = stats.chars / (now - stats.t0)
                share = 100 * stats.chars / max_chars
                print0(f"read {stats.chars:,} chars ({share:.1f}% of --max-chars), {stats.docs:,} docs, "
                       f"{rate:,.0f} chars/s")
            if stats.chars >= max_chars:
                return


def main(argv=None):
    args = parse_args(argv)
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if args.vocab_size < min_vocab:
        raise UserError(
            f"--vocab-size must be at least {min_vocab} (256 bytes + {len(SPECIAL_TOKENS)} special tokens), "
            f"got {args.vocab_size}"
        )
    if args.max_chars <= 0:
        raise UserError(f"--max-chars must be positive, got {args.max_chars}")
    if args.doc_cap <= 0:
        raise UserError(f"--doc-cap must be positive, got {args.doc_cap}")
    source = args.data_source or get_default_source()
    ensure_writable(get_tokenizer_dir(), "the tokenizer")  # before minutes of training, not after
    ensure_writable(previous_tokenizers_dir(), "a copy of the tokenizer this one replaces")
    get_report()
    print0(f"tok_train: source={source} max_chars={args.max_chars:,} doc_cap={args.doc_cap:,} "
           f"vocab_size={args.vocab_size:,}")

    stats = ReadStats()
    documents = capped_documents(args.max_chars, args.doc_cap, source, stats)
    tokenizer = RustBPETokenizer.train_from_iterator(documents, args.vocab_size)
    train_time = time.time() - stats.t0
    if stats.chars == 0:
        raise UserError(f"the train split of source {source!r} holds no text: rebuild or re-download its shards")
    rate = stats.chars / train_time
    print0(f"trained on {stats.chars:,} chars from {stats.docs:,} docs in {train_time:.1f}s ({rate:,.0f} chars/s)")
    vocab_size = tokenizer.get_vocab_size()
    if vocab_size < args.vocab_size:
        print0(f"warning: the corpus ran out of pairs to merge: vocab size is {vocab_size:,}, not {args.vocab_size:,}")

    tokenizer_dir = get_tokenizer_dir()
    aside = set_aside_tokenizer(tokenizer_dir, tokenizer.fingerprint())
    if aside:
        print0(f"note: the tokenizer this one replaces is kept in {aside}: checkpoints trained with it need its files back "
               f"in {tokenizer_dir}")
    tokenizer.save(tokenizer_dir)
    print0(f"saved tokenizer (vocab {vocab_size:,}, fingerprint {tokenizer.fingerprint()[:12]}) to {tokenizer_dir}")

    # Sanity: the saved tokenizer loads back and round-trips awkward text, special-looking strings included.
    reloaded = RustBPETokenizer.from_directory(tokenizer_dir)
    sample = "Hello world! 12345 + 678 = 13023\n\tcafé, 東京, 🙂 and a literal <|bos|> in plain text."
    ids = reloaded.encode(sample)
    if reloaded.decode(ids) != sample or reloaded.get_bos_token_id() in ids or ids != tokenizer.encode(sample):
        raise RuntimeError("tokenizer sanity check failed: the saved tokenizer does not round-trip text")
    print0(f"sanity round trip ok: {len(sample.encode('utf-8'))} bytes -> {len(ids)} tokens")

    token_bytes = tokenizer.token_byte_lengths()
    ordinary = token_bytes[token_bytes > 0]
    print0(f"{TOKEN_BYTES_FILE}: bytes per ordinary token min {ordinary.min()} max {ordinary.max()} "
           f"mean {ordinary.mean():.2f}; the {len(SPECIAL_TOKENS)} specials count 0")
    print0(f"done in {time.time() - stats.t0:.1f}s")
    get_report().log(section="Tokenizer training", data=[
        vars(args),
        {"source": source, "chars read": stats.chars, "documents read": stats.docs, "train time (s)": train_time,
         "chars per second": rate, "vocab size": vocab_size, "mean bytes per ordinary token": float(ordinary.mean())},
    ])


if __name__ == "__main__":
    run_main(main)
