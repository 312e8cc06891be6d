"""
scripts.import_model: checkpoints of karpathy/nanochat's public eras and transformers NanoChat directories become
checkpoints of ours with the same logits and greedy tokens.

The source checkpoints are written here the way that project writes them (its state-dict names and dtypes, its
meta_XXXXXX.json, a rustbpe tokenizer pickled as a tiktoken Encoding, a base dir laid out as tokenizer/ and
<stage>_checkpoints/<tag>/), with every parameter random, so identity-initialised scalars and gates matter. The
logits they must give come from `source_logits`, that project's forward pass of each era written out here from its
math, not from our model. transformers' NanoChat is its own reference: the real class, saved with save_pretrained.
"""

import json
import os
import pickle
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import rustbpe
import tiktoken
import torch
import torch.nn.functional as F

from nanochat.common import UserError
from nanochat.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.usefixtures("single_torch_thread")

# The source project's forward by era: rope base, rotary tables rounded to bf16, q/k scale, softcap, the value
# embeddings' gate range, its short window (positions back from the query, besides itself), and backout's layer.
SOURCE_ERAS = {
    "2025-10": dict(theta=10000, bf16_tables=True, qk=1.0, softcap=15, gate_range=None, short=None, backout=None),
    "2026-01": dict(theta=10000, bf16_tables=True, qk=1.0, softcap=15, gate_range=2, short=lambda L: L // 2, backout=None),
    "2026-03-04": dict(theta=10000, bf16_tables=False, qk=1.0, softcap=20, gate_range=2, short=lambda L: L // 2, backout=None),
    "2026-03-09": dict(theta=100000, bf16_tables=False, qk=1.15, softcap=15, gate_range=3,
                       short=lambda L: -(-L // 3 // 128) * 128, backout=None),
    "2026-03-14": dict(theta=100000, bf16_tables=False, qk=1.2, softcap=15, gate_range=3,
                       short=lambda L: -(-L // 4 // 128) * 128, backout=lambda n: n // 2),
}
TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs! "
        "How vexingly quick daft zebras jump; 12 + 34 = 46. ") * 40


# -----------------------------------------------------------------------------
# The source project's files


def source_encoding():
    """A tokenizer made the way karpathy/nanochat makes one: rustbpe merges, specials after them, a tiktoken Encoding."""
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter([TEXT]), 300 - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
    ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
    specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
    return tiktoken.Encoding(name="rustbpe", pat_str=SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def source_state(era, vocab_size, n_layer=4, n_head=4, n_kv_head=2, n_embd=64, padded=True, seed=0):
    """A state dict under the source's names and dtypes for that era, every tensor random (none at its init)."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-vocab_size // 64) * 64 if padded else vocab_size
    head_dim, kv_dim = n_embd // n_head, n_kv_head * (n_embd // n_head)

    def rand(*shape, std=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    s = n_embd ** -0.5
    state = {"transformer.wte.weight": rand(rows, n_embd, dtype=torch.bfloat16),  # trained on a GPU: wte in bf16
             "lm_head.weight": rand(rows, n_embd, std=0.3)}
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        state.update({p + "attn.c_q.weight": rand(n_head * head_dim, n_embd, std=s), p + "attn.c_k.weight": rand(kv_dim, n_embd, std=s),
                      p + "attn.c_v.weight": rand(kv_dim, n_embd, std=s), p + "attn.c_proj.weight": rand(n_embd, n_embd, std=s),
                      p + "mlp.c_fc.weight": rand(4 * n_embd, n_embd, std=s), p + "mlp.c_proj.weight": rand(n_embd, 4 * n_embd, std=s / 2)})
    if era != "2025-10":
        state["resid_lambdas"] = 1 + rand(n_layer, std=0.2)
        state["x0_lambdas"] = rand(n_layer, std=0.2)
        channels = 32 if SOURCE_ERAS[era]["gate_range"] == 2 else 12
        for i in range(n_layer):
            if i % 2 == (n_layer - 1) % 2:  # alternating, the last layer included
                state[f"value_embeds.{i}.weight"] = rand(rows, kv_dim, std=s, dtype=torch.bfloat16)
                state[f"transformer.h.{i}.attn.ve_gate.weight"] = rand(n_kv_head, channels)
    if era == "2026-03-14":
        state.update({"smear_gate.weight": rand(1, 24), "smear_lambda": rand(1, std=0.5) + 0.5,
                      "backout_lambda": rand(1, std=0.1) + 0.2})
    return state


def write_base_dir(root, era, stage_dir="chatsft_checkpoints", tag="d4", step=20, sequence_len=512, padded=True,
                   compiled_names=False, seed=0):
    """A karpathy/nanochat base dir: tokenizer/tokenizer.pkl + token_bytes.pt, and one checkpoint of a d4."""
    enc = source_encoding()
    os.makedirs(os.path.join(root, "tokenizer"), exist_ok=True)
    with open(os.path.join(root, "tokenizer", "tokenizer.pkl"), "wb") as f:
        pickle.dump(enc, f)
    torch.save(torch.ones(enc.n_vocab, dtype=torch.int32), os.path.join(root, "tokenizer", "token_bytes.pt"))
    model_config = dict(sequence_len=sequence_len, vocab_size=enc.n_vocab, n_layer=4, n_head=4, n_kv_head=2, n_embd=64)
    if era != "2025-10":
        model_config["window_pattern"] = "SSSL"
    state = source_state(era, enc.n_vocab, padded=padded, seed=seed)
    folder = os.path.join(root, stage_dir, tag)
    os.makedirs(folder, exist_ok=True)
    saved = {("_orig_mod." + k if compiled_names else k): v for k, v in state.items()}
    torch.save(saved, os.path.join(folder, f"model_{step:06d}.pt"))
    with open(os.path.join(folder, f"meta_{step:06d}.json"), "w") as f:
        json.dump({"step": step, "val_bpb": 1.234, "model_config": model_config,
                   "user_config": {"depth": 4, "run": "dummy"}, "device_batch_size": 32, "max_seq_len": sequence_len}, f)
    return folder, state, model_config, enc


def source_logits(state, model_config, era, idx):
    """karpathy/nanochat's forward of that era for (B, T) ids, in fp32 on the CPU (its SDPA path), written from its
    gpt.py: norm after the embedding, smear, per-layer lambdas, value embeddings gated by the attention input's first
    channels, rotary (bf16 tables before March 2026) then QK-norm then the q/k scale, windows of `left` positions
    back plus itself, ReLU^2, backout of a middle layer's output, the final norm, padding rows sliced off, softcap."""
    e = SOURCE_ERAS[era]
    sd = {k.removeprefix("_orig_mod."): v.float() for k, v in state.items()}
    n_layer, n_head, n_kv, C, L = (model_config[k] for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "sequence_len"))
    B, T = idx.shape
    D = C // n_head
    inv_freq = 1.0 / (e["theta"] ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if e["bf16_tables"]:
        cos, sin = cos.bfloat16(), sin.bfloat16()
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]

    def norm(x):
        return F.rms_norm(x, (x.size(-1),))

    def rotary(x):
        d = x.shape[3] // 2
        x1, x2 = x[..., :d], x[..., d:]
        return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], 3)

    x = norm(F.embedding(idx, sd["transformer.wte.weight"]))
    if "smear_gate.weight" in sd:
        gate = sd["smear_lambda"] * torch.sigmoid(x[:, 1:, :24] @ sd["smear_gate.weight"].t())
        x = torch.cat([x[:, :1], x[:, 1:] + gate * x[:, :-1]], dim=1)
    x0, x_backout = x, None
    pattern = model_config.get("window_pattern", "L")
    for i in range(n_layer):
        p = f"transformer.h.{i}."
        if "resid_lambdas" in sd:
            x = sd["resid_lambdas"][i] * x + sd["x0_lambdas"][i] * x0
        h = norm(x)
        q = (h @ sd[p + "attn.c_q.weight"].t()).view(B, T, n_head, D)
        k = (h @ sd[p + "attn.c_k.weight"].t()).view(B, T, n_kv, D)
        v = (h @ sd[p + "attn.c_v.weight"].t()).view(B, T, n_kv, D)
        if f"value_embeds.{i}" + ".weight" in sd:
            gate_w = sd[p + "attn.ve_gate.weight"]
            gate = e["gate_range"] * torch.sigmoid(h[..., :gate_w.shape[1]] @ gate_w.t())
            v = v + gate.unsqueeze(-1) * F.embedding(idx, sd[f"value_embeds.{i}.weight"]).view(B, T, n_kv, D)
        q, k = norm(rotary(q)) * e["qk"], norm(rotary(k)) * e["qk"]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        left = L if pattern[i % len(pattern)] == "L" or i == n_layer - 1 else e["short"](L)
        row, col = torch.arange(T)[:, None], torch.arange(T)[None, :]
        mask = (col <= row) & ((row - col) <= left)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_kv != n_head)
        x = x + y.transpose(1, 2).reshape(B, T, C) @ sd[p + "attn.c_proj.weight"].t()
        x = x + F.relu(norm(x) @ sd[p + "mlp.c_fc.weight"].t()).square() @ sd[p + "mlp.c_proj.weight"].t()
        if e["backout"] is not None and i == e["backout"](n_layer):
            x_backout = x
    if x_backout is not None:
        x = x - sd["backout_lambda"] * x_backout
    logits = (norm(x) @ sd["lm_head.weight"].t())[..., :model_config["vocab_size"]].float()
    return e["softcap"] * torch.tanh(logits / e["softcap"])


def source_greedy(state, model_config, era, prompt, steps, stop_ids):
    """Greedy tokens by recomputing the whole sequence each step, up to and including a stop token (as our Engine)."""
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(source_logits(state, model_config, era, torch.tensor([ids]))[0, -1].argmax()))
        if ids[-1] in stop_ids:
            break
    return ids[len(prompt):]


# -----------------------------------------------------------------------------
# Helpers on our side


@pytest.fixture
def target(tmp_path, monkeypatch):
    """A fresh NANOCHAT_BASE_DIR to import into."""
    base = str(tmp_path / "ours")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", base)
    return base


def our_model(stage, tag):
    from nanochat.checkpoint_manager import load_model

    model, tokenizer, meta = load_model(stage, "cpu", model_tag=tag)
    return model, tokenizer, meta


def our_greedy(model, tokenizer, prompt, steps):
    from nanochat.engine import Engine

    return [column[0] for column, _ in Engine(model, tokenizer).generate(prompt, max_tokens=steps, temperature=0.0)]


def long_ids(vocab_size, T=300, seed=1):
    return torch.randint(0, vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------
# Every era of karpathy/nanochat


@pytest.mark.quick
@pytest.mark.parametrize("era, padded, compiled_names", [
    ("2025-10", False, False),   # the October release: vocab as trained
    ("2025-10", True, True),     # December: vocab padded to 64; a compiled model's saved names
    ("2026-01", True, False),    # window_pattern, lambdas, value embeddings with a 0..2 gate
    ("2026-03-09", True, False),  # theta 100k, q/k x1.15, a 0..3 gate on 12 channels, windows of a third
    ("2026-03-14", True, False),  # smear, backout, q/k x1.2, quarter windows
])
def test_each_era_imports_with_the_sources_logits_and_greedy_tokens(tmp_path, target, era, padded, compiled_names):
    from nanochat.interop.model_import import import_model

    folder, state, model_config, enc = write_base_dir(str(tmp_path / "theirs"), era, padded=padded,
                                                      compiled_names=compiled_names)
    ckpt_dir = import_model(folder, "sft")
    model, tokenizer, meta = our_model("sft", "d4")
    assert meta["imported_from"]["era"] == era and meta["imported_from"]["format"] == "karpathy/nanochat"
    assert set(meta["imported_from"]["sha256"]) == {"model_000020.pt", "meta_000020.json", "tokenizer.pkl"}
    assert meta["step"] == 20 and os.path.basename(ckpt_dir) == "d4"
    assert tokenizer.encode("The quick brown fox") == enc.encode("The quick brown fox")
    idx = long_ids(enc.n_vocab)  # 300 positions: past every era's short window at context 512
    with torch.no_grad():
        ours = model(idx)
    theirs = source_logits(state, model_config, era, idx)
    assert ours.shape == theirs.shape == (2, 300, enc.n_vocab)
    assert (ours - theirs).abs().max().item() <= 1e-4
    prompt = [tokenizer.get_bos_token_id()] + tokenizer.encode("How vexingly quick")
    stops = {tokenizer.get_bos_token_id(), tokenizer.encode_special("<|assistant_end|>")}
    assert our_greedy(model, tokenizer, prompt, 12) == source_greedy(state, model_config, era, prompt, 12, stops)


@pytest.mark.quick
def test_an_era_the_files_cannot_tell_is_named_with_era(tmp_path, target):
    """2-8 March 2026 wrote the same files as January with softcap 20: --era says so, and the logits follow."""
    from nanochat.interop.model_import import import_model

    folder, state, model_config, enc = write_base_dir(str(tmp_path / "theirs"), "2026-01", sequence_len=64)
    import_model(folder, "base", era="2026-03-04")
    model, _, meta = our_model("base", "d4")
    assert meta["imported_from"]["era"] == "2026-03-04" and model.config.logit_softcap == 20.0
    idx = long_ids(enc.n_vocab, T=64)
    with torch.no_grad():
        ours = model(idx)
    assert (ours - source_logits(state, model_config, "2026-03-04", idx)).abs().max() <= 1e-4
    assert (ours - source_logits(state, model_config, "2026-01", idx)).abs().max() > 1e-2  # what the files alone would give
    with pytest.raises(UserError, match="smear/backout parameters, which the 2026-01 model"):
        folder2, *_ = write_base_dir(str(tmp_path / "later"), "2026-03-14", tag="d4b")
        import_model(folder2, "base", era="2026-01")


# -----------------------------------------------------------------------------
# transformers' NanoChat, and our own export, as sources


def hf_tokenizer_file(enc, path):
    from nanochat.interop.hf_export import build_hf_tokenizer
    from nanochat.tokenizer import RustBPETokenizer

    ours = RustBPETokenizer._from_parts(enc._mergeable_ranks, enc._pat_str, SPECIAL_TOKENS)
    build_hf_tokenizer(ours).save(path)


@pytest.mark.quick
def test_a_transformers_nanochat_directory_imports_with_its_logits(tmp_path, target):
    import transformers
    from nanochat.interop.model_import import import_model

    enc = source_encoding()
    torch.manual_seed(0)
    config = transformers.NanoChatConfig(
        vocab_size=enc.n_vocab + 20, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, final_logit_softcapping=12.0,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=False, pad_token_id=None)
    hf_model = transformers.NanoChatForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(std=0.2)
    out = str(tmp_path / "hf")
    hf_model.save_pretrained(out)
    hf_tokenizer_file(enc, os.path.join(out, "tokenizer.json"))
    import_model(out, "base", model_tag="hf")
    model, tokenizer, meta = our_model("base", "hf")
    assert meta["imported_from"]["format"] == "transformers NanoChat" and model.config.vocab_size == enc.n_vocab
    idx = long_ids(enc.n_vocab, T=100)
    with torch.no_grad():
        theirs = hf_model(idx).logits[..., :enc.n_vocab]  # its 20 rows past the tokenizer are padding no id reaches
        ours = model(idx)
    assert (ours - theirs).abs().max().item() <= 1e-4
    prompt = [tokenizer.get_bos_token_id()] + tokenizer.encode("quick daft")
    with torch.no_grad():
        reference = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                      eos_token_id=None).tolist()[0][len(prompt):]
    assert our_greedy(model, tokenizer, prompt, 10) == reference


@pytest.mark.quick
def test_our_export_round_trips_plain_and_with_every_variant(tmp_path, target):
    """An imported later-era model (components and exact-math variants: our modeling code) and a plain model
    (transformers' NanoChat) go out through export_hf and back in through import_model with the same logits."""
    from nanochat.interop.hf_export import export_checkpoint
    from nanochat.interop.model_import import import_model

    folder, state, model_config, enc = write_base_dir(str(tmp_path / "theirs"), "2026-03-14")
    import_model(folder, "sft")
    export_checkpoint("sft", str(tmp_path / "export"), model_tag="d4")
    assert json.load(open(tmp_path / "export" / "config.json"))["model_type"] == "nanochat_recipe"
    import_model(str(tmp_path / "export"), "rl", model_tag="back")
    before, _, _ = our_model("sft", "d4")
    after, _, meta = our_model("rl", "back")
    assert after.config == before.config and meta["imported_from"]["format"] == "nanochat export (recipe)"
    idx = long_ids(enc.n_vocab)
    with torch.no_grad():
        assert (after(idx) - source_logits(state, model_config, "2026-03-14", idx)).abs().max() <= 1e-4

    # the October era: its bf16-rounded rotary tables have no field in NanoChat's config, so it needs our code too
    folder, state, model_config, _ = write_base_dir(str(tmp_path / "october"), "2025-10", tag="oct", padded=False)
    import_model(folder, "base")  # the same tokenizer as the base dir's: kept
    export_checkpoint("base", str(tmp_path / "export_oct"), model_tag="oct")
    assert json.load(open(tmp_path / "export_oct" / "config.json"))["model_type"] == "nanochat_recipe"
    import_model(str(tmp_path / "export_oct"), "mid", model_tag="oct")
    with torch.no_grad():
        assert (our_model("mid", "oct")[0](idx) - source_logits(state, model_config, "2025-10", idx)).abs().max() <= 1e-4

    # a plain model of ours goes out as transformers' own NanoChat and comes back the same
    from nanochat.checkpoint_manager import checkpoint_dir, save_checkpoint
    from nanochat.recipe import config_dict
    from tests.conftest import random_tiny_gpt

    plain = random_tiny_gpt(enc.n_vocab, 512, seed=3)
    save_checkpoint(checkpoint_dir("base", "plain"), 5, plain, [],
                    {"model_config": config_dict(plain.config), "user_config": {}})
    export_checkpoint("base", str(tmp_path / "export_plain"), model_tag="plain")
    assert json.load(open(tmp_path / "export_plain" / "config.json"))["model_type"] == "nanochat"
    import_model(str(tmp_path / "export_plain"), "mid", model_tag="plain")
    back = our_model("mid", "plain")[0]
    assert back.config == plain.config
    with torch.no_grad():
        assert (back(idx) - plain(idx)).abs().max() <= 1e-4


# -----------------------------------------------------------------------------
# The hub path


class ModelHub:
    """A local stand-in for the hub's file API: one model repo, its tree listing and /resolve/ downloads."""

    def __init__(self, repo, files):
        import hashlib

        self.files, self.requests = files, []
        listing = [{"type": "file", "path": name, "size": len(data),
                    **({"lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data)}} if name.endswith(".pt") else {})}
                   for name, data in files.items()]
        self.tree = json.dumps(listing).encode()
        self.repo = repo
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                hub.requests.append(self.path)
                if self.path == f"/api/models/{hub.repo}/tree/main?recursive=true":
                    body = hub.tree
                elif self.path.startswith(f"/{hub.repo}/resolve/main/") and self.path.split("/resolve/main/")[1] in hub.files:
                    body = hub.files[self.path.split("/resolve/main/")[1]]
                else:
                    return self.send_error(404)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.quick
def test_a_hub_repo_imports_through_the_file_api_and_a_second_import_is_a_no_op(tmp_path, target, monkeypatch, capsys):
    from nanochat.interop.model_import import import_model

    folder, state, model_config, enc = write_base_dir(str(tmp_path / "theirs"), "2026-03-14", step=650)
    root = os.path.dirname(os.path.dirname(folder))
    files = {name: open(os.path.join(folder, name), "rb").read() for name in os.listdir(folder)}
    files["tokenizer.pkl"] = open(os.path.join(root, "tokenizer", "tokenizer.pkl"), "rb").read()
    files["README.md"] = b"a flat hub repo, as karpathy/nanochat-d32 is laid out"
    hub = ModelHub("someone/nanochat-d4", files)
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    try:
        import_model("someone/nanochat-d4", "sft")
        downloads = [r for r in hub.requests if "/resolve/" in r]
        assert sorted(r.rsplit("/", 1)[1] for r in downloads) == ["meta_000650.json", "model_000650.pt", "tokenizer.pkl"]
    finally:
        hub.close()
    model, _, meta = our_model("sft", "nanochat-d4")
    assert meta["imported_from"]["source"] == "someone/nanochat-d4@main" and meta["step"] == 650
    idx = long_ids(enc.n_vocab)
    with torch.no_grad():
        assert (model(idx) - source_logits(state, model_config, "2026-03-14", idx)).abs().max() <= 1e-4
    capsys.readouterr()
    import_model("someone/nanochat-d4", "sft")  # the hub is gone: the cache answers, and nothing changes
    assert "already imported" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# Bad input: one line naming the file and what to do, nothing written


class RunsACommand:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.quick
def test_a_malicious_tokenizer_pickle_runs_nothing_and_is_refused_in_one_line(tmp_path):
    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2025-10")
    marker = tmp_path / "pwned"
    with open(tmp_path / "theirs" / "tokenizer" / "tokenizer.pkl", "wb") as f:
        pickle.dump(RunsACommand(f"touch {marker}"), f)
    env = dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path / "ours"))
    p = subprocess.run([sys.executable, "-m", "scripts.import_model", folder, "--as", "base"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and not marker.exists()
    lines = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "refusing tokenizer" in lines[0] and "system" in lines[0], lines
    assert not os.path.exists(tmp_path / "ours" / "tokenizer") and not os.path.exists(tmp_path / "ours" / "base_checkpoints")


def corrupt(folder, case, tmp_path):
    """Damage a source checkpoint one way; returns the extra import arguments it needs."""
    model_file, meta_file = os.path.join(folder, "model_000020.pt"), os.path.join(folder, "meta_000020.json")
    if case == "truncated":
        data = open(model_file, "rb").read()
        open(model_file, "wb").write(data[:len(data) // 2])
    elif case == "no meta":
        os.remove(meta_file)
    elif case in ("unknown key", "missing key"):
        state = torch.load(model_file, weights_only=True)
        if case == "unknown key":
            state["transformer.h.0.attn.engram.weight"] = torch.zeros(2, 2)
        else:
            del state["transformer.h.1.mlp.c_fc.weight"]
        torch.save(state, model_file)
    elif case == "vocab":
        meta = json.load(open(meta_file))
        meta["model_config"]["vocab_size"] += 1
        json.dump(meta, open(meta_file, "w"))
    elif case == "not a pickle":
        with open(os.path.join(folder, "..", "..", "tokenizer", "tokenizer.pkl"), "wb") as f:
            f.write(b"not a pickle at all")
    return {}


@pytest.mark.quick
@pytest.mark.parametrize("case, message", [
    ("truncated", r"cannot read .*model_000020.pt .*truncated, corrupt"),
    ("no meta", r"meta_000020.json is missing"),
    ("unknown key", r"unknown parameters: transformer.h.0.attn.engram.weight"),
    ("missing key", r"missing parameters: transformer.h.1.mlp.c_fc.weight"),
    ("vocab", r"says vocab_size \d+ but tokenizer .*tokenizer.pkl has \d+ tokens"),
    ("not a pickle", r"refusing tokenizer .*tokenizer.pkl"),
])
def test_bad_input_is_refused_naming_the_file_and_nothing_is_written(tmp_path, target, case, message):
    from nanochat.interop.model_import import import_model

    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2026-01", sequence_len=64)
    corrupt(folder, case, tmp_path)
    with pytest.raises(UserError, match=message):
        import_model(folder, "base")
    assert not os.path.exists(target)  # not even the base dir was made


@pytest.mark.quick
def test_an_existing_checkpoint_or_other_tokenizer_is_never_overwritten(tmp_path, target):
    from nanochat.interop.model_import import import_model

    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2025-10", sequence_len=64)
    import_model(folder, "base")
    weights = os.path.join(target, "base_checkpoints", "d4", "step_000020", "model.safetensors")
    before = os.path.getmtime(weights)
    other, *_ = write_base_dir(str(tmp_path / "other"), "2025-10", sequence_len=64, seed=5)  # same files but weights
    with pytest.raises(UserError, match="already holds checkpoints .* another --model-tag"):
        import_model(other, "base")
    assert os.path.getmtime(weights) == before
    from nanochat.tokenizer import RustBPETokenizer

    different = RustBPETokenizer.train_from_iterator(iter(["a different text, a different tokenizer"] * 50), 280)
    different.save(os.path.join(target, "tokenizer"))
    with pytest.raises(UserError, match="already has a different tokenizer"):
        import_model(other, "base", model_tag="second")
    assert not os.path.exists(os.path.join(target, "base_checkpoints", "second"))


# -----------------------------------------------------------------------------
# Downstream: an imported model is an ordinary checkpoint


@pytest.mark.slow  # 22 s: an import, SFT, a kill and a resume
def test_sft_from_an_imported_model_on_custom_conversations_resumes_exactly(tmp_path):
    """chat_sft fine-tunes an imported later-era model on a user's CustomJSON file; killed after its step-2 save and
    resumed, it ends with the weights of an uninterrupted run."""
    from tests.test_chat_stages import env_for, run, start_and_kill_after_save, weights

    conversations = tmp_path / "mine.jsonl"
    with open(conversations, "w") as f:
        for i in range(12):
            f.write(json.dumps([{"role": "user", "content": f"Who are you, friend {i}?"},
                                {"role": "assistant", "content": "I am a quick brown fox, imported."}]) + "\n")
    bases = []
    for name in ("straight", "killed"):
        base = str(tmp_path / name)
        folder, *_ = write_base_dir(str(tmp_path / f"theirs_{name}"), "2026-03-14", stage_dir="base_checkpoints",
                                    sequence_len=128)
        subprocess.run([sys.executable, "-m", "scripts.import_model", folder, "--as", "base", "--model-tag", "tiny"],
                       cwd=REPO, env=env_for(base), check=True, capture_output=True, timeout=120)
        bases.append(base)
    straight, killed = bases
    args = ["-i", "base", "--identity-file", str(conversations), "--mixture=builtin", "--device-batch-size=2",
            "--total-batch-size=4", "--eval-steps=1", "--num-iterations=4", "--save-every=2"]
    run(straight, "chat_sft", args)
    start_and_kill_after_save(killed, "chat_sft", args, 2)
    run(killed, "chat_sft", args + ["--resume"])
    a, b = weights(straight, "chat_sft", 4), weights(killed, "chat_sft", 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from safetensors.torch import load_file

    imported = load_file(os.path.join(straight, "base_checkpoints", "tiny", "step_000020", "model.safetensors"))
    assert any(not torch.equal(a[k], imported[k]) for k in a)  # it trained
    p = run(straight, "chat_cli", ["-i", "sft", "-p", "Who are you?", "--max-tokens=6"])
    assert p.stdout.strip()
    p = run(straight, "chat_eval", ["-i", "sft", "-a", "Arithmetic|WorldQA", "-x", "2", "--max-new-tokens=4"])
    assert "Arithmetic" in p.stdout and "WorldQA" in p.stdout


@pytest.mark.quick
def test_imported_checkpoint_cannot_be_resumed_by_base_train_and_says_why(tmp_path, target):
    from nanochat.checkpoint_manager import checkpoint_dir, load_checkpoint
    from nanochat.interop.model_import import import_model

    folder, *_ = write_base_dir(str(tmp_path / "theirs"), "2025-10", stage_dir="base_checkpoints", sequence_len=64)
    import_model(folder, "base")
    with pytest.raises(UserError, match="was imported .* no optimizer state"):
        load_checkpoint(checkpoint_dir("base", "d4"), 20, "cpu", load_optimizer=True)
