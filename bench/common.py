"""
What every benchmark shares: the table and the JSON line it prints, progress on stderr, how busy the rest of the machine was (OtherLoad), a description of the machine, and a base dir with data and a tokenizer to measure in.
"""

import contextlib
import json
import os
import sys
import tempfile
import time

import torch

from nanochat.common import UserError, cpu_flags, orthogonalization_dtype, print0
from nanochat.corpus.build import write_corpus

BENCH_TOKENIZER_VOCAB = 4096  # the CPU preset's vocabulary


def bench_vocab_size(vocab_size, device_type):
    """--vocab-size if given, else the preset's: the GPU one's 32768, the CPU one's 4096."""
    return vocab_size or (32768 if device_type == "cuda" else BENCH_TOKENIZER_VOCAB)


def print_table(title, headers, rows):
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for k, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if k == 0:
            print("  ".join("-" * w for w in widths))


def emit_json(result):
    print(json.dumps(result), flush=True)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


class OtherLoad:
    """
    How many cores' worth of CPU time *other* processes used while this one ran a timed section:
    (all busy CPU time in /proc/stat - this process's CPU time) / wall time. Near 0 means the
    numbers were taken on a quiet machine; anything above ~0.05 makes them suspect.
    """

    def __enter__(self):
        self.busy0, self.own0, self.wall0 = self._busy_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.wall0
        other = (self._busy_seconds() - self.busy0) - (time.process_time() - self.own0)
        self.cores = max(0.0, other / wall) if self.busy0 is not None else float("nan")

    @staticmethod
    def _busy_seconds():
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:9]]
        except OSError:
            return None
        idle = values[3] + values[4]  # idle + iowait
        return (sum(values) - idle) / os.sysconf("SC_CLK_TCK")


def machine_info():
    info = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info["cpu_flags"] = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    info["muon_dtype"] = str(orthogonalization_dtype("cuda" if torch.cuda.is_available() else "cpu")).replace("torch.", "")
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def ensure_data(max_vocab):
    """Point NANOCHAT_BASE_DIR at a base dir with data and a tokenizer (building one in <tmp> if needed)."""
    current = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    if holds_training_data(current, max_vocab):
        os.environ["NANOCHAT_BASE_DIR"] = current
        return current
    bench_dir = os.path.join(tempfile.gettempdir(), "nanochat_bench")
    ensure_builtin_workspace(bench_dir, BENCH_TOKENIZER_VOCAB, log=log)
    os.environ["NANOCHAT_BASE_DIR"] = bench_dir
    os.environ["NANOCHAT_DATA_SOURCE"] = "builtin"
    return bench_dir


# -----------------------------------------------------------------------------
# A base dir to measure in


@contextlib.contextmanager
def base_dir_set_to(base_dir, source=None):
    """NANOCHAT_BASE_DIR (and NANOCHAT_DATA_SOURCE, if given) pointed elsewhere for the duration of the block."""
    names = {"NANOCHAT_BASE_DIR": base_dir, **({"NANOCHAT_DATA_SOURCE": source} if source else {})}
    old = {name: os.environ.get(name) for name in names}
    os.environ.update(names)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value


def holds_training_data(base_dir, max_vocab=None):
    """True if base_dir holds a tokenizer (of at most max_vocab tokens) and train + val shards of the default source."""
    from nanochat.dataset import list_parquet_files
    from nanochat.tokenizer import get_tokenizer

    if not os.path.isdir(os.path.join(base_dir, "tokenizer")):
        return False
    with base_dir_set_to(base_dir):
        try:
            list_parquet_files("train")
            list_parquet_files("val")
            return max_vocab is None or get_tokenizer().get_vocab_size() <= max_vocab
        except UserError:
            return False


def ensure_builtin_workspace(directory, vocab_size=4096, log=print0):
    """
    A base dir for benchmarks and checks: `directory` with the built-in corpus (seed 42, 6 MB) and a tokenizer of up to
    vocab_size tokens trained on it (the corpus has room for ~6,000), built on the first call and reused after.
    Returns {"base_dir", "source"}.
    """
    from nanochat.dataset import get_data_dir, parquets_iter_batched
    from nanochat.tokenizer import RustBPETokenizer

    with base_dir_set_to(directory, "builtin"):
        if not holds_training_data(directory):
            log(f"building the built-in corpus and a tokenizer of up to {vocab_size:,} tokens in {directory}")
            write_corpus(get_data_dir("builtin"), seed=42, size_mb=6.0, verbose=False)
            texts = (t for batch in parquets_iter_batched("train", source="builtin") for t in batch)
            RustBPETokenizer.train_from_iterator(texts, vocab_size).save(os.path.join(directory, "tokenizer"))
    return {"base_dir": directory, "source": "builtin"}
