"""
`bench import`: how long `scripts.import_model` takes, and how much memory, on a karpathy/nanochat checkpoint of a
given depth written here with random weights in that project's later format (value embeddings on alternating
layers, lambdas, smear, backout; wte and value embeddings in bf16 as a GPU run saves them; a tiktoken Encoding
pickled beside it). The import runs as its own process, twice into fresh base dirs, and the peak RSS is that
process's (torch.load maps the file, so the source's pages count when read).
"""

import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import tiktoken
import torch

from bench.common import emit_json, log, machine_info, print_table
from nanochat.common import child_pythonpath
from nanochat.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synthetic_encoding(vocab_size):
    """A tiktoken Encoding of vocab_size ids: the 256 bytes, then two-byte tokens as 'merges' (valid for tiktoken:
    every multi-byte token is the merge of two tokens ranked before it), then the nine specials."""
    ranks = {bytes([b]): b for b in range(256)}
    for i in range(vocab_size - len(SPECIAL_TOKENS) - 256):
        ranks[bytes([i // 256, i % 256])] = len(ranks)
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="rustbpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def write_source(folder, depth, vocab_size, sequence_len):
    """model_000001.pt, meta_000001.json and tokenizer.pkl of a d{depth} in the later format; returns (params, bytes)."""
    n_embd, n_head = depth * 64, depth * 64 // 128
    kv_dim = n_embd
    state = {"transformer.wte.weight": torch.randn(vocab_size, n_embd).bfloat16(),
             "lm_head.weight": torch.randn(vocab_size, n_embd) * 0.01,
             "resid_lambdas": torch.ones(depth), "x0_lambdas": torch.zeros(depth),
             "smear_gate.weight": torch.zeros(1, 24), "smear_lambda": torch.zeros(1), "backout_lambda": torch.full((1,), 0.2)}
    for i in range(depth):
        p = f"transformer.h.{i}."
        for name, shape in (("attn.c_q", (n_embd, n_embd)), ("attn.c_k", (kv_dim, n_embd)), ("attn.c_v", (kv_dim, n_embd)),
                            ("attn.c_proj", (n_embd, n_embd)), ("mlp.c_fc", (4 * n_embd, n_embd)),
                            ("mlp.c_proj", (n_embd, 4 * n_embd))):
            state[p + name + ".weight"] = torch.randn(*shape) * n_embd ** -0.5
        if i % 2 == (depth - 1) % 2:
            state[f"value_embeds.{i}.weight"] = (torch.randn(vocab_size, kv_dim) * n_embd ** -0.5).bfloat16()
            state[p + "attn.ve_gate.weight"] = torch.zeros(n_head, 12)
    os.makedirs(folder, exist_ok=True)
    torch.save(state, os.path.join(folder, "model_000001.pt"))
    config = dict(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head, n_kv_head=n_head,
                  n_embd=n_embd, window_pattern="SSSL")
    with open(os.path.join(folder, "meta_000001.json"), "w") as f:
        json.dump({"step": 1, "model_config": config, "user_config": {}}, f)
    with open(os.path.join(folder, "tokenizer.pkl"), "wb") as f:
        pickle.dump(synthetic_encoding(vocab_size), f)
    return sum(t.numel() for t in state.values()), os.path.getsize(os.path.join(folder, "model_000001.pt"))


def cmd_import(args):
    work = tempfile.mkdtemp(prefix="nanochat_bench_import_", dir=args.work_dir or None)
    try:
        folder = os.path.join(work, "source")
        t0 = time.perf_counter()
        params, size = write_source(folder, args.depth, args.vocab_size, args.seq_len)
        log(f"bench import | d{args.depth}, vocab {args.vocab_size:,}: {params:,} parameters, model_000001.pt "
            f"{size / 2**30:.2f} GiB written in {time.perf_counter() - t0:.0f}s | {args.repeats} import(s) in {work}")
        runs = []
        for i in range(args.repeats):
            base = os.path.join(work, f"base{i}")
            env = dict(os.environ, NANOCHAT_BASE_DIR=base, PYTHONPATH=child_pythonpath(REPO_ROOT))
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "scripts.import_model", folder, "--as", "base"], cwd=REPO_ROOT, env=env,
                               capture_output=True, text=True)
            seconds = time.perf_counter() - t0
            if p.returncode != 0:
                raise RuntimeError(f"import failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
            # the largest RSS of any child so far: each import is the biggest child when it runs, in order
            peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
            written = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(base) for n in names)
            runs.append({"seconds": seconds, "peak_rss_bytes": peak, "written_bytes": written})
            shutil.rmtree(base)
        best = min(runs, key=lambda r: r["seconds"])
        print_table(f"import of a d{args.depth} karpathy/nanochat checkpoint (later format, vocab {args.vocab_size:,})",
                    ["parameters", "source .pt", "import s (each run)", "peak RSS", "written"],
                    [[f"{params:,}", f"{size / 2**30:.2f} GiB", ", ".join(f"{r['seconds']:.1f}" for r in runs),
                      f"{max(r['peak_rss_bytes'] for r in runs) / 2**30:.2f} GiB", f"{best['written_bytes'] / 2**30:.2f} GiB"]])
        emit_json({"bench": "import", "machine": machine_info(), "depth": args.depth, "vocab_size": args.vocab_size,
                   "params": params, "source_bytes": size, "runs": runs})
    finally:
        shutil.rmtree(work, ignore_errors=True)
