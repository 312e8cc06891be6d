"""Tests for the GPT model (nanochat/gpt.py) as a CPU runs it (nanochat/kernels/cpu.py swapped in), the CPU's
Functions against the plain math, and the KV cache it decodes with (nanochat/engine.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from nanochat.engine import RowKVCache
from nanochat.gpt import GPT, GPTConfig
from nanochat.kernels.cpu import use_cpu_kernels


pytestmark = pytest.mark.usefixtures("single_torch_thread")


def tiny_config(**overrides):
    fields = dict(sequence_len=32, vocab_size=97, n_layer=2, n_head=4, n_kv_head=4, n_embd=32)
    fields.update(overrides)
    return GPTConfig(**fields)


def build(config, seed=0, randomize=True):
    """Meta-device build + init, then (by default) random weights everywhere, so that the
    zero-initialised output projections (and the recipe components' identity starts) don't hide anything. With the
    CPU's kernels swapped in, as every script runs a model on a CPU, unless NANOCHAT_CPU_OPS=0 (the GPU's path)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    if randomize:
        with torch.no_grad():
            tables = {id(model.transformer.wte.weight)} | {id(p) for n, p in model.named_parameters() if n.startswith("value_embeds.")}
            for p in model.parameters():  # recipe components' scalars (1-D) away from their identity values too
                p.normal_(0.0, 1.0 if id(p) in tables else 0.5 if p.ndim == 1 else p.shape[1] ** -0.5)
    model.eval()
    return use_cpu_kernels(model, "cpu")


def make_cache(model, batch_size, seq_len, dtype=torch.float32):
    """The batching engine's cache (the model's one cache protocol); its rows(...) is what a forward pass takes."""
    c = model.config
    return RowKVCache(batch_size, c.n_kv_head, seq_len, c.n_embd // c.n_head, c.n_layer, c.n_embd, "cpu", dtype)


def reference_forward(model, idx):
    """
    The architecture written out by hand, the way transformers' NanoChat model computes it:
    RMSNorm x*rsqrt(mean(x^2)+1e-6), rotary as x*cos + rotate_half(x)*sin with
    rotate_half(x) = cat(x2, -x1) and cos/sin over cat(freqs, freqs), rotary before QK-norm,
    kv heads repeated explicitly, attention as softmax(QK^T/sqrt(d) + causal mask) V,
    relu(x)^2 MLP, softcap 15.
    """
    c = model.config
    B, T = idx.shape
    D = c.n_embd // c.n_head

    def rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rotate_half(x):
        return torch.cat((x[..., D // 2:], -x[..., :D // 2]), dim=-1)

    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.arange(T).float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)

    x = rms(model.transformer.wte.weight[idx].float())  # a bf16 table where the compute dtype is bf16
    for block in model.transformer.h:
        a = rms(x)
        q = (a @ block.attn.c_q.weight.T).view(B, T, c.n_head, D).transpose(1, 2)
        k = (a @ block.attn.c_k.weight.T).view(B, T, c.n_kv_head, D).transpose(1, 2)
        v = (a @ block.attn.c_v.weight.T).view(B, T, c.n_kv_head, D).transpose(1, 2)
        q, k = rms(q * cos + rotate_half(q) * sin), rms(k * cos + rotate_half(k) * sin)
        k = k.repeat_interleave(c.n_head // c.n_kv_head, dim=1)
        v = v.repeat_interleave(c.n_head // c.n_kv_head, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        scores = scores.masked_fill(future, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        x = x + y.transpose(1, 2).reshape(B, T, c.n_embd) @ block.attn.c_proj.weight.T
        m = rms(x)
        x = x + torch.relu(m @ block.mlp.c_fc.weight.T).pow(2) @ block.mlp.c_proj.weight.T
    logits = rms(x) @ model.lm_head.weight.T
    return 15.0 * torch.tanh(logits / 15.0)


@pytest.mark.quick
@torch.no_grad()
def test_causal_future_tokens_never_change_earlier_logits():
    model = build(tiny_config())
    idx = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 97
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=0, rtol=0)
    assert (a[:, 12:] - b[:, 12:]).abs().amax() > 1e-3  # and the change does reach later positions


@pytest.mark.quick
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
@torch.no_grad()
def test_forward_matches_hand_written_reference(n_kv_head):
    model = build(tiny_config(n_kv_head=n_kv_head))
    idx = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(2))
    logits = model(idx)
    assert logits.dtype == torch.float32 and logits.shape == (3, 17, 97)
    torch.testing.assert_close(logits, reference_forward(model, idx), atol=2e-5, rtol=1e-5)


@pytest.mark.quick
@pytest.mark.parametrize("n_kv_head", [4, 2])
@torch.no_grad()
def test_kv_cache_token_by_token_matches_full_forward(n_kv_head):
    model = build(tiny_config(n_kv_head=n_kv_head))
    idx = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(3))
    full = model(idx)
    cache = make_cache(model, batch_size=2, seq_len=20)
    steps = [model(idx[:, t:t + 1], kv_cache=cache.rows([0, 1])) for t in range(15)]
    assert cache.lengths == [15, 15]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.quick
@torch.no_grad()
def test_kv_cache_chunked_prefill_then_decode_matches_full_forward():
    model = build(tiny_config(n_kv_head=2))
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    full = model(idx)
    cache = make_cache(model, batch_size=2, seq_len=16)
    # a first chunk onto an empty cache, then chunks of several tokens onto a non-empty cache, then decoding
    pieces = [model(idx[:, a:b], kv_cache=cache.rows([0, 1])) for a, b in ((0, 5), (5, 9), (9, 12))]
    pieces += [model(idx[:, t:t + 1], kv_cache=cache.rows([0, 1])) for t in range(12, 16)]
    assert cache.lengths == [16, 16]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.quick
@torch.no_grad()
def test_kv_cache_prefill_from_one_row_to_many_samples():
    model = build(tiny_config(n_kv_head=2))
    prompt = torch.randint(0, 97, (1, 7), generator=torch.Generator().manual_seed(5))
    many = make_cache(model, batch_size=3, seq_len=12)
    model(prompt, kv_cache=many.rows([0]))
    for row in (1, 2):  # the other samples take a copy of the prompt's row
        many.copy_row(0, row)
    assert many.lengths == [7, 7, 7]
    next_tokens = torch.tensor([[3], [50], [96]])
    decoded = model(next_tokens, kv_cache=many.rows([0, 1, 2]))
    expected = model(torch.cat([prompt.expand(3, -1), next_tokens], dim=1))[:, -1:]
    torch.testing.assert_close(decoded, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.quick
@torch.no_grad()
def test_runs_under_bf16_autocast_with_fp32_logits():
    # CPU autocast stands in for the CUDA bf16 path: dtypes must line up, including a bf16 KV cache.
    model = build(tiny_config(n_kv_head=2))
    idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(8))
    reference = model(idx)
    cache = make_cache(model, batch_size=2, seq_len=12, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = model(idx)
        pieces = [model(idx[:, :7], kv_cache=cache.rows([0, 1])), model(idx[:, 7:10], kv_cache=cache.rows([0, 1]))]
        pieces += [model(idx[:, t:t + 1], kv_cache=cache.rows([0, 1])) for t in (10, 11)]
    assert full.dtype == torch.float32
    torch.testing.assert_close(full, reference, atol=0.1, rtol=0.05)
    torch.testing.assert_close(torch.cat(pieces, dim=1), reference, atol=0.1, rtol=0.05)


@pytest.mark.quick
@torch.no_grad()
def test_kv_cache_bookkeeping_and_errors():
    model = build(tiny_config(n_kv_head=2))
    cache = make_cache(model, batch_size=2, seq_len=5)
    assert cache.k_cache.shape == cache.v_cache.shape == (2, 2, 5, 2, 8)  # (layers, rows, seq, kv heads, head dim)
    model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache.rows([1]))
    assert cache.lengths == [0, 4]  # only the row fed moved
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache.rows([1]))  # 4 + 2 > 5: refused, not silently wrong
    model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache.rows([0]))  # the other row still has all its room
    cache.reset(1)
    assert cache.lengths == [5, 0]


@pytest.mark.quick
def test_estimate_flops_and_num_params_match_hand_count():
    config = tiny_config(sequence_len=24, vocab_size=50, n_layer=3, n_head=4, n_kv_head=2, n_embd=16)
    with torch.device("meta"):
        model = GPT(config)
    C, V, L, H, T = 16, 50, 3, 4, 24
    D = C // H
    kv_dim = 2 * D
    per_layer = C * C + 2 * C * kv_dim + C * C + 2 * 4 * C * C  # q, k+v, attn proj, mlp in+out
    assert model.num_params() == 2 * V * C + L * per_layer
    expected = 6 * (V * C + L * per_layer) + 12 * L * H * D * T
    assert model.estimate_flops() == expected


@pytest.mark.quick
def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    config = tiny_config(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=1, n_embd=32)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    x = torch.randint(0, 64, (4, 16))
    y = torch.randint(0, 64, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    first = None
    for _ in range(150):
        loss = model(x, y)
        first = first if first is not None else loss.item()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    assert first > 3.5  # ~ln(64) at init
    assert model(x, y).item() < 0.05


@pytest.mark.quick
@pytest.mark.parametrize("eval_chunk_rows", [7, 512])  # a CPU evaluation's loss in chunks of 7 rows (the last one short), or in one
@torch.no_grad()
def test_ignore_index_targets_are_excluded_from_loss(monkeypatch, eval_chunk_rows):
    monkeypatch.setattr("nanochat.kernels.cpu.LOSS_CHUNK_ROWS", eval_chunk_rows)
    model = build(tiny_config())
    idx = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    targets = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(7))
    targets[0, :4] = -1
    targets[1, 7:] = -1
    valid = targets != -1
    logprobs = F.log_softmax(model(idx), dim=-1)
    nll = -logprobs[valid, targets[valid]]
    torch.testing.assert_close(model(idx, targets, loss_reduction="sum"), nll.sum())
    torch.testing.assert_close(model(idx, targets), nll.sum() / valid.sum())
    per_token = model(idx, targets, loss_reduction="none")
    assert per_token.shape == (2, 10) and torch.all(per_token[~valid] == 0)
    torch.testing.assert_close(per_token[valid], nll)
    # a batch with nothing to learn gives 0, not NaN
    assert model(idx, torch.full_like(targets, -1)).item() == 0.0
    with pytest.raises(ValueError):
        model(idx, targets, loss_reduction="avg")


@pytest.mark.quick
@pytest.mark.parametrize("chunk_rows, n_kv_head", [(7, 4), (512, 4), (7, 2)])
def test_cpu_fast_paths_give_the_reference_loss_and_gradients(monkeypatch, chunk_rows, n_kv_head):
    # On the CPU in fp32 training runs hand-written autograd Functions (chunked softcap cross-entropy,
    # RMSNorm, rotary, the relu^2 MLP, block-causal attention); their gradients must be those of the
    # plain math, autograd'ed. 7-row chunks / 5-query blocks: several of each, the last one short.
    import nanochat.kernels.cpu as cpu_ops

    monkeypatch.setattr(cpu_ops, "LOSS_CHUNK_ROWS", chunk_rows)
    monkeypatch.setattr(cpu_ops, "ATTENTION_BLOCK", 5 if chunk_rows == 7 else 128)
    model = build(tiny_config(n_kv_head=n_kv_head))
    model.train()
    idx = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(8))
    targets = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(9))
    targets[0, :9] = -1  # a whole chunk of ignored rows when chunk_rows == 7
    targets[2, 5] = -1
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # push logits into the softcap's curved region
    loss = model(idx, targets)
    loss.backward()
    fast = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = reference_forward(model, idx)
    assert logits.abs().max() > 10.0
    reference = F.cross_entropy(logits.view(-1, 97), targets.view(-1), ignore_index=-1)
    reference.backward()
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fast[name], p.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        assert p.grad.abs().max() > 0


@pytest.mark.quick
@pytest.mark.parametrize("fields", [
    dict(n_embd=30, n_head=4),                 # n_head does not divide n_embd
    dict(n_head=4, n_kv_head=3),               # n_kv_head does not divide n_head
    dict(n_head=2, n_kv_head=4),               # more kv heads than heads
    dict(n_embd=12, n_head=4, n_kv_head=4),    # head_dim 3 is odd
    dict(n_layer=0),
    dict(vocab_size=-5),
])
def test_invalid_configs_raise_value_error_before_allocating(fields):
    # Sizes so large that allocating anything would be impossible: the error must come first.
    huge = dict(sequence_len=10**9, vocab_size=10**12, n_layer=10**4)
    huge.update(fields)
    with pytest.raises(ValueError):
        GPTConfig(**huge)
    config = tiny_config()
    for name, value in fields.items():
        setattr(config, name, value)  # a config edited after construction is still checked by GPT
    with pytest.raises(ValueError):
        GPT(config)


@pytest.mark.quick
@torch.no_grad()
def test_softcap_bounds_logits():
    model = build(tiny_config())
    model.lm_head.weight.mul_(1000.0)
    logits = model(torch.randint(0, 97, (2, 8)))
    assert logits.abs().max() <= 15.0
    assert logits.abs().max() > 14.9  # the cap is actually reached, not a tiny lm_head


@pytest.mark.quick
def test_meta_construction_and_init_are_deterministic_under_seed():
    config = tiny_config(n_kv_head=2)
    with torch.device("meta"):
        on_meta = GPT(config)
    assert all(t.is_meta for t in list(on_meta.parameters()) + list(on_meta.buffers()))
    a, b, c = build(config, seed=11, randomize=False), build(config, seed=11, randomize=False), build(config, seed=12, randomize=False)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
        if pa.abs().sum() > 0:  # zero-initialised projections are equal for every seed
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.cos, b.cos) and torch.equal(a.sin, b.sin)
    assert "cos" not in a.state_dict()  # rotary tables are derived, never saved
    assert a.cos.shape[1] == 10 * config.sequence_len and torch.isfinite(a.cos).all()
    # init values: output projections start at zero, everything else is non-trivial
    assert torch.all(a.transformer.h[0].attn.c_proj.weight == 0) and torch.all(a.transformer.h[0].mlp.c_proj.weight == 0)
    assert a.get_device() == torch.device("cpu")


@pytest.mark.quick
def test_setup_optimizers_param_groups():
    config = tiny_config(n_embd=48, n_head=4, n_kv_head=2)
    model = build(config, randomize=False)
    adamw_groups, muon_groups = model.setup_optimizers(unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02,
                                                       weight_decay=0.1, adam_betas=(0.8, 0.95))
    scale = (48 / 768) ** -0.5
    assert adamw_groups[0]["params"] == [model.lm_head.weight]
    assert adamw_groups[1]["params"] == [model.transformer.wte.weight]
    assert adamw_groups[0]["lr"] == pytest.approx(0.004 * scale) and adamw_groups[1]["lr"] == pytest.approx(0.2 * scale)
    for g in adamw_groups:
        assert g["betas"] == (0.8, 0.95) and g["eps"] == 1e-10 and g["weight_decay"] == 0.0
    shapes = [{tuple(p.shape) for p in g["params"]} for g in muon_groups]
    assert all(len(s) == 1 for s in shapes) and len({next(iter(s)) for s in shapes}) == len(muon_groups)
    for g in muon_groups:
        assert g["lr"] == 0.02 and g["weight_decay"] == 0.1 and all(p.ndim == 2 for p in g["params"])
    for g in adamw_groups + muon_groups:
        assert g["initial_lr"] == g["lr"]
    grouped = [p for g in adamw_groups + muon_groups for p in g["params"]]
    assert len(grouped) == len(list(model.parameters()))
    assert {id(p) for p in grouped} == {id(p) for p in model.parameters()}
    # deterministic: a second call lists the same parameters in the same order
    again = model.setup_optimizers(0.004, 0.2, 0.02)[1]
    assert [[id(p) for p in g["params"]] for g in again] == [[id(p) for p in g["params"]] for g in muon_groups]


@pytest.mark.quick
def test_logits_at_gives_just_those_positions_logits():
    """forward(logits_at=positions): what the full logits hold at one position per row (the prefill's last)."""
    model = build(tiny_config(), seed=3)
    idx = torch.randint(0, model.config.vocab_size, (2, 9))
    with torch.no_grad():
        full = model(idx)
        some = model(idx, logits_at=torch.tensor([3, 8]))
    assert some.shape == (2, 1, model.config.vocab_size)
    assert torch.allclose(some[:, 0], full[torch.arange(2), torch.tensor([3, 8])], atol=1e-6)
    with pytest.raises(ValueError, match="cannot be combined with targets"):
        model(idx, targets=idx, logits_at=torch.tensor([0, 0]))
