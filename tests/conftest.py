"""Shared fixtures: a tiny built-in corpus and tokenizer, built once per test session; a local stand-in hub."""

import contextlib
import io
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# The suite starts many Python subprocesses (scripts, torchrun ranks); with bytecode caching off, each one
# re-compiles torch's modules and starts twice as slowly.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# Subprocesses (scripts, torchrun workers) import nanochat from the repository root, like `python -m scripts.X` does.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
# Compiled runs trace with dynamo and run AOT autograd on eager kernels: what the tests check of them (no graph break
# or recompile, bf16, exact resume, 2 ranks) needs no inductor code generation, which costs minutes on a machine whose
# compile cache is empty. test_gpu_path's inductor smoke compiles for real; set the variable to choose otherwise.
os.environ.setdefault("NANOCHAT_COMPILE_BACKEND", "aot_eager")
# The same arithmetic on every machine: without this a CPU with AVX512-BF16 or AMX trains in bf16 autocast and one
# without it in fp32, and the exact comparisons (resume, ranks, KV cache, imports) would test different code on each.
# The bf16 path runs where a test asks for it (test_gpu_path: bf16 against fp32, resume and 2 ranks in bf16).
os.environ.setdefault("NANOCHAT_DTYPE", "float32")


def random_tiny_gpt(vocab_size, sequence_len, seed=0, n_layer=2, n_embd=64):
    """A real GPT with every matrix random: init alone zeroes the output projections and nearly zeroes lm_head, which
    makes every prediction about uniform and hides what a test wants to see. Tests import it from here."""
    import torch

    from nanochat.gpt import GPTConfig, build_model

    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=n_layer, n_head=2, n_kv_head=2,
                       n_embd=n_embd)
    model = build_model(config, "cpu")
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.normal_(std=0.1)
            block.mlp.c_proj.weight.normal_(std=0.1)
        model.lm_head.weight.normal_(std=0.3)
    return model.eval()


@contextlib.contextmanager
def rss_growth():
    """Measures how far this process's resident memory rose while the block ran: {"bytes": ...} once it ends, raising
    or not. The kernel's high-water mark (VmHWM) is reset through /proc/self/clear_refs after the heap's free memory is
    handed back, so that memory freed earlier is neither reused unseen nor counted. Linux only; skipped elsewhere."""
    import gc

    from nanochat.common import return_freed_memory

    def status(field):
        with open("/proc/self/status") as f:
            return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) << 10

    gc.collect()
    return_freed_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak memory (/proc/self/clear_refs)")
    grew = {}
    before = status("VmRSS")
    try:
        yield grew
    finally:
        grew["bytes"] = status("VmHWM") - before


@pytest.fixture
def single_torch_thread():
    """One torch thread for tests of tiny models: a second OpenMP thread only adds sync overhead, and on a busy
    shared CPU spinning threads can make a 1 s test take 30 s."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_base_dir(tmp_path_factory):
    """A NANOCHAT_BASE_DIR holding a small built-in corpus and a 1024-token tokenizer. Treat it as read-only."""
    base = str(tmp_path_factory.mktemp("nanochat_base"))
    old = os.environ.get("NANOCHAT_BASE_DIR")
    os.environ["NANOCHAT_BASE_DIR"] = base
    try:
        from nanochat.corpus.build import write_corpus
        from nanochat.dataset import get_data_dir, parquets_iter_batched
        from nanochat.tokenizer import RustBPETokenizer

        write_corpus(get_data_dir("builtin"), seed=7, size_mb=0.6, verbose=False)
        texts = (t for batch in parquets_iter_batched("train", source="builtin") for t in batch)
        RustBPETokenizer.train_from_iterator(texts, 1024).save(os.path.join(base, "tokenizer"))
    finally:
        if old is None:
            os.environ.pop("NANOCHAT_BASE_DIR", None)
        else:
            os.environ["NANOCHAT_BASE_DIR"] = old
    return base


@pytest.fixture
def tiny_env(tiny_base_dir, monkeypatch):
    """Point this test (and the subprocesses it starts) at the tiny base dir, built-in data source."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", tiny_base_dir)
    monkeypatch.setenv("NANOCHAT_DATA_SOURCE", "builtin")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    return tiny_base_dir


# -----------------------------------------------------------------------------
# A local hub: /api/datasets/{repo}/parquet/{config}/{split} lists /files/... URLs on the same server


class ParquetHub:
    def __init__(self):
        self.splits = {}  # (repo, config, split) -> list of parquet bytes
        self.requests = []
        hub_ = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub_.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def add(self, repo, config, split, *tables):
        files = []
        for rows in tables:
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows), buf)
            files.append(buf.getvalue())
        self.splits[(repo, config, split)] = files

    def handle(self, req):
        self.requests.append(req.path)
        match = re.fullmatch(r"/api/datasets/(.+)/parquet/([^/]+)/([^/]+)", req.path)
        if match and match.groups() in self.splits:
            files = self.splits[match.groups()]
            repo, config, split = match.groups()
            urls = [f"{self.endpoint}/files/{repo}/{config}/{split}/{i}.parquet" for i in range(len(files))]
            return self.send(req, json.dumps(urls).encode(), "application/json")
        match = re.fullmatch(r"/files/(.+)/([^/]+)/([^/]+)/(\d+)\.parquet", req.path)
        if match and match.groups()[:3] in self.splits and int(match.group(4)) < len(self.splits[match.groups()[:3]]):
            return self.send(req, self.splits[match.groups()[:3]][int(match.group(4))], "application/octet-stream")
        req.send_error(404)

    def send(self, req, body, content_type):
        req.send_response(200)
        req.send_header("Content-Type", content_type)
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        req.wfile.write(body)

    def close(self):
        self.server.shutdown()
        self.server.server_close()
