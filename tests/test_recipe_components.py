"""The optional recipe components (gpt.COMPONENTS, Muon's normuon / cautious_wd): identity at init, the CPU fast
path's gradients, the KV cache and the engine, the optimizer math, checkpoints and resume."""

import contextlib
import json
import os

import pytest
import torch

from nanochat.common import UserError
from nanochat.engine import Engine, RowKVCache
from nanochat.gpt import COMPONENTS, GPTConfig
from nanochat.optim import NORMUON_BETA2, Muon, _normuon_row_scales

from test_gpt import build  # noqa: E402 (random weights everywhere, the components' scalars included)

pytestmark = pytest.mark.usefixtures("single_torch_thread")
ALL_ON = {name: True for name in COMPONENTS}


def tiny_config(**overrides):
    fields = dict(sequence_len=32, vocab_size=97, n_layer=3, n_head=4, n_kv_head=2, n_embd=64)
    fields.update(overrides)
    return GPTConfig(**fields)


def make_cache(model, batch_size, seq_len):
    c = model.config
    return RowKVCache(batch_size, c.n_kv_head, seq_len, c.n_embd // c.n_head, c.n_layer, c.n_embd, "cpu", torch.float32)


@pytest.mark.quick
@pytest.mark.parametrize("name", COMPONENTS)
@torch.no_grad()
def test_each_component_starts_as_the_identity(name):
    # Switched on and freshly initialised, a component computes what the plain model computes with the same weights
    # (a value embedding starts small but not zero: zeroed here, its gate is exactly 1), so an ablation starts from
    # the same function and only training can tell them apart.
    plain = build(tiny_config(), randomize=False)
    model = build(tiny_config(**{name: True}), randomize=False)
    model.load_state_dict(plain.state_dict(), strict=False)
    if name == "value_embeds":
        for embedding in model.value_embeds.values():
            embedding.weight.zero_()
        assert sorted(model.value_embeds) == ["0"]  # the lower half of the layers (at least the first)
    for block in plain.transformer.h:  # make the blocks do something, identically in both models
        block.attn.c_proj.weight.normal_(std=0.1)
        block.mlp.c_proj.weight.normal_(std=0.1)
    model.load_state_dict(plain.state_dict(), strict=False)
    idx = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(idx), plain(idx), atol=1e-6, rtol=1e-6)
    if name == "sliding_window":  # no parameters; the same while a sequence fits in the window (16), not beyond it
        assert model.num_params() == plain.num_params()
        longer = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(model(longer)[:, :16], plain(longer)[:, :16], atol=1e-6, rtol=1e-6)
        assert (model(longer)[:, 16:] - plain(longer)[:, 16:]).abs().max() > 1e-3
    else:
        assert model.num_params() > plain.num_params()


def plain_gated_add(v, ve, logits, scale):
    return v + (scale * torch.sigmoid(logits)).unsqueeze(-1) * ve


def plain_residual_mix(x, x0, a, b):
    return a * x + b * x0


def plain_smear(x, logits, lam):
    previous = torch.cat((torch.zeros_like(x[:, :1]), x[:, :-1]), dim=1)
    return x + lam * torch.sigmoid(logits) * previous


@pytest.mark.quick
@pytest.mark.parametrize("name", ["fused_gated_add", "fused_residual_mix", "fused_smear"])
def test_each_fused_component_function_equals_the_plain_math(name):
    # cpu_ops' Functions for the components: output and every input's gradient against the torch expressions
    # gpt.py runs elsewhere, in fp32, with inputs away from the identity (gates far from 0, scalars not 1 / 0).
    from nanochat.kernels import cpu as cpu_ops

    g = torch.Generator().manual_seed(3)
    B, T, H, D = 2, 9, 3, 8
    inputs = {
        "fused_gated_add": ((B, T, H, D), (B, T, H, D), (B, T, H)),
        "fused_residual_mix": ((B, T, H * D), (B, T, H * D), (), ()),
        "fused_smear": ((B, T, H * D), (B, T, 1), (1,)),
    }[name]
    args = [(2 * torch.randn(shape, generator=g)).requires_grad_() for shape in inputs]
    extra = (1.7,) if name == "fused_gated_add" else ()  # the gate's scale
    fused = getattr(cpu_ops, name)(*args, *extra)
    plain = globals()[f"plain_{name.removeprefix('fused_')}"](*args, *extra)
    torch.testing.assert_close(fused, plain, atol=1e-6, rtol=1e-6)
    grad_out = torch.randn(fused.shape, generator=g)
    for got, want in zip(torch.autograd.grad(fused, args, grad_out), torch.autograd.grad(plain, args, grad_out)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def plain_then_swapped(model, idx, targets, autocast=contextlib.nullcontext):
    """{False: (loss, {name: grad}) of gpt.py's plain model, True: the same after swap_in_cpu_kernels (the same
    Parameters)}."""
    from nanochat.kernels.cpu import swap_in_cpu_kernels

    results = {}
    for swapped in (False, True):
        if swapped:
            swap_in_cpu_kernels(model)
        model.zero_grad(set_to_none=True)
        with autocast():
            loss = model(idx, targets)
        loss.backward()
        results[swapped] = (loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()})
    return results


@pytest.mark.quick
def test_cpu_fast_path_gradients_with_every_component(monkeypatch):
    # The components run as cpu_ops' Functions in the CPU fast path; loss and every gradient must equal the plain
    # path's (what a GPU runs), and every component parameter must learn.
    monkeypatch.setenv("NANOCHAT_CPU_OPS", "0")  # built plain; plain_then_swapped swaps the kernels in
    model = build(tiny_config(**ALL_ON))
    model.train()
    idx = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(8))
    targets = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(9))
    grads = plain_then_swapped(model, idx, targets)
    torch.testing.assert_close(grads[True][0], grads[False][0], atol=1e-5, rtol=1e-5)
    for name, grad in grads[True][1].items():
        torch.testing.assert_close(grad, grads[False][1][name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        assert grad.abs().max() > 0, name
    component_params = {n for n in grads[True][1] if "lambda" in n or "gate" in n or n.startswith("value_embeds")}
    assert len(component_params) == 1 + 1 + 2 + 2 + 1  # a value embedding + its gate, resid/x0, smear gate/lambda, backout


CPU_FUNCTIONS = ("fused_rms_norm", "fused_rotary_norm", "fused_relu_squared_mlp", "block_causal_attention",
                 "fused_gated_add", "fused_residual_mix", "fused_smear", "softcap_cross_entropy_sum")
TRAINING_ONLY = ("block_causal_attention", "softcap_cross_entropy_sum")  # the two that also run under CPU autocast


@pytest.mark.quick
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpu_kernel_swap_gives_the_plain_model_s_loss_and_gradients(monkeypatch, dtype):
    """use_cpu_kernels' swap against gpt.py's plain model, every component on and n_kv_head == n_head: in fp32 every
    Function runs, under CPU bf16 autocast the training-only two. The loss and every parameter's gradient within the
    kernel tests' tolerances: fp32's float rounding (test_gpt), bf16 as the block attention's (test_gpu_path: the
    Functions round the scores and d(logits) to bf16 elsewhere than autograd does). 7-row loss chunks and 5-query
    attention blocks: several of each, the last one short, windows that cut."""
    from nanochat.kernels import cpu as cpu_ops

    monkeypatch.setenv("NANOCHAT_DTYPE", dtype)  # bf16: the embedding and rotary tables too, as on such a CPU
    monkeypatch.setenv("NANOCHAT_CPU_OPS", "0")  # built plain; plain_then_swapped swaps the kernels in
    monkeypatch.setattr(cpu_ops, "LOSS_CHUNK_ROWS", 7)
    monkeypatch.setattr(cpu_ops, "ATTENTION_BLOCK", 5)
    calls = {name: 0 for name in CPU_FUNCTIONS}
    for name in CPU_FUNCTIONS:
        function = getattr(cpu_ops, name)
        monkeypatch.setattr(cpu_ops, name, lambda *a, _f=function, _n=name, **k: calls.update({_n: calls[_n] + 1})
                            or _f(*a, **k))
    model = build(tiny_config(n_kv_head=4, **ALL_ON))
    model.train()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits into the softcap's curved region
    idx = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(8))
    targets = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(9))
    targets[0, :9] = -1  # a whole chunk of ignored rows
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == "bfloat16" else contextlib.nullcontext
    results = plain_then_swapped(model, idx, targets, autocast)
    ran = {name for name, count in calls.items() if count}
    assert ran == (set(TRAINING_ONLY) if dtype == "bfloat16" else set(CPU_FUNCTIONS)), calls
    (loss, grads), (plain_loss, plain_grads) = results[True], results[False]
    if dtype == "float32":
        torch.testing.assert_close(loss, plain_loss, atol=1e-5, rtol=1e-5)
    else:
        assert abs(loss - plain_loss) / plain_loss < 0.01, (loss, plain_loss)
    for name, grad in grads.items():
        assert grad.abs().max() > 0, name
        if dtype == "float32":
            torch.testing.assert_close(grad, plain_grads[name], atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        else:
            cos = torch.nn.functional.cosine_similarity(grad.flatten().float(), plain_grads[name].flatten().float(),
                                                        dim=0)
            assert cos > 0.99, (name, float(cos))


@pytest.mark.quick
@pytest.mark.parametrize("window", [64, 200, None])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_cpu_block_attention_with_a_window_equals_masked_sdpa_and_flex(window):
    # cpu_ops' block attention skips the blocks left of the band (T=300 spans three 128-query blocks); its output and
    # gradients must equal SDPA with the boolean band mask (the eager and decode path), and FlexAttention (the compiled
    # CUDA path; forward only, it has no CPU backward) must give the same output.
    from nanochat.gpt import band_mask, flex_band_attention
    from nanochat.kernels import cpu as cpu_ops

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 300, 16, generator=generator, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(2, 3, 300, 16, generator=generator)
    ours = cpu_ops.block_causal_attention(q, k, v, window=window)
    mask = band_mask(300, 300, window, "cpu")
    assert (mask is None) == (window is None)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    torch.testing.assert_close(ours, reference, atol=2e-6, rtol=1e-5)
    for g, g_ref in zip(torch.autograd.grad(ours, (q, k, v), grad_out), torch.autograd.grad(reference, (q, k, v), grad_out)):
        torch.testing.assert_close(g, g_ref, atol=2e-5, rtol=1e-4)
    if window is not None:
        q, k, v = q.detach(), k[:, :1].detach(), v[:, :1].detach()  # one kv head for three query heads (GQA)
        flex = flex_band_attention(q, k, v, window)
        gqa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        torch.testing.assert_close(flex, gqa, atol=2e-6, rtol=1e-5)


@pytest.mark.quick
def test_flex_band_attention_compiles_into_one_graph():
    # On CUDA the compiled model runs flex_band_attention; the block mask is built inside the graph, so dynamo must
    # trace all of it without a break (a break per layer would split the compiled model into pieces).
    from nanochat.gpt import flex_band_attention

    q, kv = torch.randn(1, 2, 256, 16), torch.randn(1, 1, 256, 16)
    explained = torch._dynamo.explain(flex_band_attention)(q, kv, kv, 64)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.quick
@torch.no_grad()
def test_kv_cache_with_every_component_matches_the_full_forward():
    # Smear needs the previous token's embedding at decode, which the cache keeps (and prefill copies to every sample);
    # the 16 tokens run past the short layers' 8-position window, so decoding must cut the cached keys too.
    model = build(tiny_config(sequence_len=16, **ALL_ON))
    idx = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(4))
    full = model(idx)
    cache = make_cache(model, 2, 16)
    pieces = [model(idx[:, :5], kv_cache=cache.rows([0, 1])), model(idx[:, 5:9], kv_cache=cache.rows([0, 1]))]
    pieces += [model(idx[:, t:t + 1], kv_cache=cache.rows([0, 1])) for t in range(9, 16)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)

    prompt = idx[:1, :7]
    many = make_cache(model, 3, 12)
    model(prompt, kv_cache=many.rows([0]))
    for row in (1, 2):
        many.copy_row(0, row)
    next_tokens = torch.tensor([[3], [50], [96]])
    expected = model(torch.cat([prompt.expand(3, -1), next_tokens], dim=1))[:, -1:]
    torch.testing.assert_close(model(next_tokens, kv_cache=many.rows([0, 1, 2])), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.quick
def test_engine_greedy_equals_naive_recompute_with_every_component():
    from nanochat.tokenizer import RustBPETokenizer

    texts = [f"The quick brown fox {i} jumps over the lazy dog {i * 7}." for i in range(200)]
    tokenizer = RustBPETokenizer.train_from_iterator(iter(texts), 300)
    model = build(tiny_config(vocab_size=tokenizer.get_vocab_size(), sequence_len=16, **ALL_ON))  # 8-token windows
    prompt = tokenizer.encode("The quick brown", prepend=tokenizer.get_bos_token_id())
    terminals = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
    ids, naive = list(prompt), []
    with torch.no_grad():
        while len(naive) < 12:
            next_id = int(model(torch.tensor([ids]))[0, -1].argmax())
            ids.append(next_id)
            naive.append(next_id)
            if next_id in terminals:
                break
    columns = [column for column, _ in Engine(model, tokenizer).generate(prompt, num_samples=2, max_tokens=12, temperature=0)]
    assert columns == [[t, t] for t in naive]


@pytest.mark.quick
def test_flops_and_scaling_params_leave_out_every_lookup():
    model = build(tiny_config(**ALL_ON), randomize=False)
    plain = build(tiny_config(), randomize=False)
    c = model.config
    kv_dim = c.n_kv_head * c.n_embd // c.n_head
    assert model.embedding_params() == c.vocab_size * (c.n_embd + kv_dim)  # one value embedding, on layer 0
    gates_and_scalars = 32 * c.n_kv_head + 2 * c.n_layer + 32 + 1 + 1
    assert model.num_params() - plain.num_params() == c.vocab_size * kv_dim + gates_and_scalars
    # two of the three layers see 16 of the 32 positions: their attention matmuls count 16 keys, not 32
    attention_saved = 2 * 12 * c.n_head * (c.n_embd // c.n_head) * (32 - 16)
    assert model.estimate_flops() - plain.estimate_flops() == 6 * gates_and_scalars - attention_saved


# -----------------------------------------------------------------------------
# Muon's options


@pytest.mark.quick
def test_normuon_evens_out_the_rows_and_keeps_the_norm():
    torch.manual_seed(0)
    updates = torch.randn(2, 6, 10) * torch.linspace(0.1, 3.0, 6).view(1, 6, 1)  # rows of very different sizes
    moments = [torch.zeros(6, 1) for _ in range(2)]  # each matrix's running mean square of its rows
    out = updates * _normuon_row_scales(updates, moments)
    # the definition, spelled out: rows over the root of their running mean square, then the matrix at its old norm
    normalized = updates / ((1 - NORMUON_BETA2) * updates.square().mean(dim=-1, keepdim=True)).sqrt()
    torch.testing.assert_close(out, normalized * updates.norm(dim=(-2, -1), keepdim=True)
                               / normalized.norm(dim=(-2, -1), keepdim=True))
    row_rms = out.square().mean(dim=-1).sqrt()
    assert (row_rms.max(dim=1).values / row_rms.min(dim=1).values).max() < 1.01  # first step: every row alike
    torch.testing.assert_close(out.norm(dim=(-2, -1)), updates.norm(dim=(-2, -1)))
    torch.testing.assert_close(moments[1], (1 - NORMUON_BETA2) * updates[1].square().mean(dim=-1, keepdim=True))


@pytest.mark.quick
def test_cautious_weight_decay_only_shrinks_weights_the_update_pushes_toward_zero():
    weight = torch.nn.Parameter(torch.tensor([[1.0, -1.0, 1.0, -1.0]]))
    weight.grad = torch.tensor([[1.0, -1.0, -1.0, 1.0]])  # the first two point toward zero, the last two away
    plain, cautious = weight.detach().clone(), None
    for option in (False, True):
        p = torch.nn.Parameter(plain.clone())
        p.grad = weight.grad.clone()
        opt = Muon([{"params": [p], "lr": 0.1, "weight_decay": 0.5, "cautious_wd": option}], momentum=0.0, nesterov=False)
        opt.step()
        if option:
            cautious = p.detach()
        else:
            decayed = p.detach()
    step = decayed - cautious  # decay shrinks |w| by lr*wd*|w| = 0.05 where it applies
    torch.testing.assert_close(step, torch.tensor([[0.0, 0.0, -0.05, 0.05]]), atol=1e-6, rtol=0)


def one_muon_step(grad, **options):
    """The weight after one Muon step from zero with this gradient (no momentum, no decay): minus the update."""
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    Muon([{"params": [p], "lr": 1.0, "weight_decay": 0.0, **options}], momentum=0.0, nesterov=False).step()
    return p.detach()


@pytest.mark.quick
def test_muoneq_makes_the_update_blind_to_the_size_of_each_row():
    torch.manual_seed(0)
    grad = torch.randn(6, 10)
    rows_resized = grad * torch.tensor([0.01, 0.1, 1.0, 3.0, 10.0, 100.0]).view(6, 1)
    torch.testing.assert_close(one_muon_step(rows_resized, muoneq=True), one_muon_step(grad, muoneq=True))
    # without it the big rows take the update over
    assert (one_muon_step(rows_resized) - one_muon_step(grad)).abs().max() > 0.1
    tall = torch.randn(10, 6)  # the rows are the weight's (its outputs), whichever side orthogonalize works on
    torch.testing.assert_close(one_muon_step(tall * torch.linspace(0.1, 10, 10).view(10, 1), muoneq=True),
                               one_muon_step(tall, muoneq=True))


@pytest.mark.quick
@pytest.mark.parametrize("shape", [(6, 10), (10, 6), (8, 8)])
def test_muon_plus_puts_the_update_at_the_norm_of_a_semi_orthogonal_matrix(shape):
    torch.manual_seed(0)
    u, _, vh = torch.linalg.svd(torch.randn(shape), full_matrices=False)
    grad = u @ torch.diag(torch.logspace(0, -3, min(shape))) @ vh  # singular values from 1 down to 0.001
    rows, cols = shape
    exact = min(shape) ** 0.5 * max(1.0, rows / cols) ** 0.5  # sqrt(min(rows, cols)), times Muon's shape scale
    assert one_muon_step(grad, muon_plus=True).norm().item() == pytest.approx(exact, rel=1e-5)
    # five Newton-Schulz steps leave the singular values only roughly at 1 (NS_COEFFS): the norm 10-18 % off here
    assert abs(one_muon_step(grad).norm().item() / exact - 1) > 0.05


@pytest.mark.quick
def test_loss_goes_down_with_every_component_on():
    from nanochat.recipe import OPTIMIZER_COMPONENTS, build_optimizers
    from nanochat.loop import train_step

    model = build(tiny_config(**ALL_ON), randomize=False)
    model.train()
    optimizers = build_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.1,
                                  optimizer_components=OPTIMIZER_COMPONENTS)
    scalars = [g for g in optimizers[0].param_groups if any(p.ndim == 1 for p in g["params"])]
    assert len(scalars) == 1 and scalars[0]["lr"] == 0.005  # the components' own group, at the scalar lr
    assert all(g[name] for g in optimizers[1].param_groups for name in OPTIMIZER_COMPONENTS)
    batch = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(3))
    losses = [train_step(model, optimizers, [(batch[:, :-1], batch[:, 1:])], lambda m, xy: m(*xy), 1.0, 0.9,
                         torch.autocast("cpu", enabled=False)) for _ in range(25)]
    assert losses[-1] < 0.5 * losses[0]
    assert model.x0_lambdas.abs().max() > 0 and model.backout_lambda.abs().max() > 0  # the scalars moved
    moments = [s["row_second_moment"] for s in optimizers[1].state.values()]
    assert moments and all(m.min() > 0 for m in moments)


# -----------------------------------------------------------------------------
# Checkpoints and base_train


@pytest.mark.quick
@pytest.mark.parametrize("n_layer, lower_half, alternating", [(1, ["0"], ["0"]), (4, ["0", "1"], ["1", "3"]),
                                                               (6, ["0", "1", "2"], ["1", "3", "5"])])
def test_value_embeddings_sit_on_the_lower_half_and_old_checkpoints_keep_theirs(n_layer, lower_half, alternating):
    # New models put them below the middle, off the last layer; a checkpoint saved before value_embed_layers existed
    # had them on the last layer and every second one below, and must load onto those layers.
    from nanochat.gpt import build_model
    from nanochat.recipe import config_dict

    saved = config_dict(tiny_config(n_layer=n_layer, value_embeds=True))
    assert saved["value_embed_layers"] == "lower_half"
    assert sorted(build_model(saved, "meta").value_embeds) == lower_half
    legacy = {k: v for k, v in saved.items() if k != "value_embed_layers"}
    assert sorted(build_model(legacy, "meta").value_embeds) == alternating
    assert "value_embed_layers" not in config_dict(tiny_config(n_layer=n_layer, smear=True))  # plain meta unchanged


@pytest.mark.quick
def test_components_in_meta_round_trip_and_plain_meta_stays_as_before():
    from nanochat.checkpoint_manager import validate_meta
    from nanochat.recipe import config_dict

    plain = config_dict(tiny_config())
    assert set(plain) == {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"}  # as before components
    with_smear = config_dict(tiny_config(smear=True, backout=True))
    assert with_smear == {**plain, "smear": True, "backout": True}
    assert GPTConfig(**with_smear) == tiny_config(smear=True, backout=True)
    meta = {"step": 3, "model_config": with_smear, "files": {"model.safetensors": "0" * 64}}
    assert validate_meta(meta) is None
    assert "smear must be true or false" in validate_meta({**meta, "model_config": {**plain, "smear": 1}})
    assert "qk_scale must be a positive number" in validate_meta({**meta, "model_config": {**plain, "qk_scale": "big"}})
    assert "may name components" in validate_meta({**meta, "model_config": {**plain, "sliding": True}})
    assert "value_embed_layers must be" in validate_meta({**meta, "model_config": {**plain, "value_embed_layers": "top"}})


@pytest.mark.slow  # 16 s; validate_meta's refusals are tested in the default run
def test_base_train_saves_components_and_refuses_to_resume_with_other_ones(tiny_base_dir, tmp_path):
    import shutil
    import subprocess
    import sys

    base = str(tmp_path / "base")
    shutil.copytree(tiny_base_dir, base)
    env = {**os.environ, "NANOCHAT_BASE_DIR": base, "NANOCHAT_DATA_SOURCE": "builtin", "OMP_NUM_THREADS": "1"}
    common = ["--depth=2", "--aspect-ratio=16", "--head-dim=16", "--max-seq-len=32", "--device-batch-size=2",
              "--total-batch-size=64", "--num-iterations=3", "--eval-every=-1", "--core-metric-every=-1",
              "--sample-every=-1", "--model-tag=tiny"]

    def train(*extra):
        return subprocess.run([sys.executable, "-m", "scripts.base_train", *common, *extra], env=env,
                              capture_output=True, text=True, timeout=300)

    first = train()  # the default recipe: DEFAULT_COMPONENTS
    assert first.returncode == 0, first.stderr[-2000:]
    assert "+ value_embeds,residual_scalars,smear,normuon" in first.stdout  # the config line names them, canonical order
    step_dir = os.path.join(base, "base_checkpoints", "tiny", "step_000003")
    with open(os.path.join(step_dir, "meta.json")) as f:
        meta = json.load(f)
    assert all(meta["model_config"][name] is True for name in ("value_embeds", "residual_scalars", "smear"))
    assert "backout" not in meta["model_config"]

    from nanochat.checkpoint_manager import load_model

    os.environ["NANOCHAT_BASE_DIR"], saved_env = base, os.environ.get("NANOCHAT_BASE_DIR")
    try:
        model, _, _ = load_model("base", "cpu", model_tag="tiny")
    finally:
        os.environ.pop("NANOCHAT_BASE_DIR") if saved_env is None else os.environ.update(NANOCHAT_BASE_DIR=saved_env)
    assert model.config.smear and model.config.value_embeds and not model.config.backout

    refused = train("--components=smear,value_embeds", "--resume", "--num-iterations=5")
    assert refused.returncode != 0 and "--components value_embeds,residual_scalars,smear,normuon -> value_embeds,smear" \
        in refused.stderr, refused.stderr[-1500:]
    from scripts import base_train

    with pytest.raises(UserError, match="warp_drive"):  # before any compute
        base_train.parse_args(common + ["--components=smear,warp_drive"])
    resumed = train("--components=normuon,smear,value_embeds,residual_scalars", "--resume", "--num-iterations=5")
    assert resumed.returncode == 0, resumed.stderr[-2000:]  # the same set, in any order
    assert meta["optimizer_components"] == ["normuon"]
    # a chat stage takes the model's components with the model and Muon's options from the checkpoint's meta
    mid = subprocess.run([sys.executable, "-m", "scripts.mid_train", "-g", "tiny", "--device-batch-size=2",
                          "--total-batch-size=512", "--eval-steps=1", "--num-iterations=2"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert mid.returncode == 0, mid.stderr[-2000:]
    mid_dir = os.path.join(base, "mid_checkpoints", "tiny")
    with open(os.path.join(mid_dir, sorted(os.listdir(mid_dir))[-1], "meta.json")) as f:
        mid_meta = json.load(f)
    assert mid_meta["optimizer_components"] == ["normuon"] and mid_meta["model_config"]["smear"] is True


@pytest.mark.slow  # 11 s: checkpoints from before the components, a compatibility path
def test_old_recipe_checkpoints_resume_as_the_plain_recipe(tiny_base_dir, tmp_path):
    # A checkpoint from before --components existed has no "components" in its flags: a resume without the flag keeps
    # the plain recipe (not today's default), and one that names any component, Muon's included, is refused.
    import shutil
    import subprocess
    import sys

    base = str(tmp_path / "base")
    shutil.copytree(tiny_base_dir, base)
    env = {**os.environ, "NANOCHAT_BASE_DIR": base, "NANOCHAT_DATA_SOURCE": "builtin", "OMP_NUM_THREADS": "1"}
    common = ["--depth=2", "--aspect-ratio=16", "--head-dim=16", "--max-seq-len=32", "--device-batch-size=2",
              "--total-batch-size=64", "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1", "--model-tag=old"]

    def train(*extra):
        return subprocess.run([sys.executable, "-m", "scripts.base_train", *common, *extra], env=env,
                              capture_output=True, text=True, timeout=300)

    first = train("--components=none", "--num-iterations=2")
    assert first.returncode == 0 and "+ none (plain recipe)" in first.stdout, first.stderr[-2000:]
    meta_path = os.path.join(base, "base_checkpoints", "old", "step_000002", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    assert set(meta["model_config"]) == {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"}
    assert meta["optimizer_components"] == []
    del meta["user_config"]["components"]  # as written before the flag existed
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    refused = train("--components=normuon", "--resume", "--num-iterations=3")
    assert refused.returncode != 0 and "--components none -> normuon" in refused.stderr, refused.stderr[-1500:]
    resumed = train("--resume", "--num-iterations=3")
    assert resumed.returncode == 0 and "+ none (plain recipe)" in resumed.stdout, resumed.stderr[-2000:]
    with open(os.path.join(base, "base_checkpoints", "old", "step_000003", "meta.json")) as f:
        after = json.load(f)
    assert after["model_config"] == meta["model_config"] and after["optimizer_components"] == []
