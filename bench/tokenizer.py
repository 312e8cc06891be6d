"""
`bench tokenizer`: tok_train's characters per second, encoding MB/s on one thread and on all.
"""

import os
import time

from bench.common import BENCH_TOKENIZER_VOCAB, emit_json, ensure_data, machine_info, print_table


def cmd_tokenizer(args):
    from nanochat.dataset import parquets_iter_batched
    from nanochat.tokenizer import RustBPETokenizer

    ensure_data(max(args.vocab_size, BENCH_TOKENIZER_VOCAB))
    texts, chars = [], 0
    for batch in parquets_iter_batched("train"):
        for text in batch:
            texts.append(text)
            chars += len(text)
            if chars >= args.max_chars:
                break
        if chars >= args.max_chars:
            break
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)

    t0 = time.perf_counter()
    tokenizer = RustBPETokenizer.train_from_iterator(iter(texts), args.vocab_size)
    train_s = time.perf_counter() - t0

    encode = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ids = tokenizer.encode(texts, num_threads=threads)
            best = min(best, time.perf_counter() - t0)
        encode[threads] = {"mb_per_s": num_bytes / best / 1e6, "tokens": sum(len(r) for r in ids)}

    print_table("tokenizer: training (rustbpe) on the corpus text",
                ["chars", "vocab", "seconds", "chars/s"],
                [[f"{chars:,}", tokenizer.get_vocab_size(), f"{train_s:.2f}", f"{chars / train_s:,.0f}"]])
    print_table("tokenizer: encode (tiktoken, batch of documents, best of repeats)",
                ["threads", "MB", "tokens", "MB/s"],
                [[t, f"{num_bytes / 1e6:.2f}", f"{e['tokens']:,}", f"{e['mb_per_s']:.2f}"] for t, e in encode.items()])
    emit_json({"bench": "tokenizer", "machine": machine_info(), "train_chars": chars, "vocab_size": tokenizer.get_vocab_size(),
               "train_s": train_s, "train_chars_per_s": chars / train_s, "encode_bytes": num_bytes,
               "encode_mb_per_s": {str(t): e["mb_per_s"] for t, e in encode.items()}})
