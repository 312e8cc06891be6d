"""FP8 linear layers (nanochat/model/fp8.py): quantization, the _scaled_mm path against its fp32 emulation, error
against fp32 F.linear, the F.linear fallback, module conversion, and a short training run. All on the CPU,
where torch._scaled_mm runs (slowly: training there uses the emulation), so the real fp8 op is what gets tested."""

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.model import fp8



def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def linear_fwd_bwd(fn, x, w, r, autocast=False, backward_in_autocast=False):
    """Run y = fn(x, w) and backprop the loss sum(y * r); returns y and both gradients."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        y = fn(x, w)
        if backward_in_autocast:
            (y.float() * r).sum().backward()
    if not backward_in_autocast:
        (y.float() * r).sum().backward()
    return y.detach(), x.grad, w.grad


@pytest.fixture
def scaled_mm_calls(monkeypatch):
    """Counts calls to torch._scaled_mm, so a test knows which path ran."""
    calls = []
    real = torch._scaled_mm

    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    return calls


@pytest.mark.quick
def test_quantize_round_trip():
    torch.manual_seed(0)
    t = torch.randn(4096) * 3.0
    for dtype, mantissa_bits, min_normal in ((fp8.E4M3, 3, 2.0 ** -6), (fp8.E5M2, 2, 2.0 ** -14)):
        q, inv_scale = fp8.quantize(t, dtype)
        assert q.dtype == dtype and inv_scale.dtype == torch.float32 and inv_scale.dim() == 0
        assert q.float().abs().max().item() == fp8.FP8_MAX[dtype]  # amax maps onto the top of the range
        back = fp8.dequantize(q, inv_scale)
        normal = (t / inv_scale).abs() >= min_normal  # subnormals have less relative precision
        assert normal.float().mean() > 0.99
        err = ((back - t).abs() / t.abs())[normal].max().item()
        assert err <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)  # round to nearest: half a mantissa step
        assert err > 2.0 ** -(mantissa_bits + 3)  # and it did round: not a lossless cast
    # bf16 input quantizes the same values the same way
    q_bf16, inv_bf16 = fp8.quantize(t.bfloat16(), fp8.E4M3)
    q_f32, inv_f32 = fp8.quantize(t.bfloat16().float(), fp8.E4M3)
    assert torch.equal(q_bf16.float(), q_f32.float()) and inv_bf16 == inv_f32
    # an all-zero tensor (zero-initialised projections) stays zero, no NaN/inf from 0 * inf
    for dtype in (fp8.E4M3, fp8.E5M2):
        q, inv_scale = fp8.quantize(torch.zeros(16, 16), dtype)
        assert torch.isfinite(inv_scale) and torch.equal(fp8.dequantize(q, inv_scale), torch.zeros(16, 16))


@pytest.mark.quick
@pytest.mark.parametrize("case", ["fp32", "autocast_fp32_x", "autocast_bf16_x", "autocast_backward_inside"])
def test_scaled_mm_matches_emulation(case, scaled_mm_calls):
    torch.manual_seed(0)
    autocast, inside = case != "fp32", case == "autocast_backward_inside"
    x_dtype = torch.bfloat16 if case == "autocast_bf16_x" else torch.float32
    x = torch.randn(2, 24, 64).to(x_dtype)  # 48 tokens, in 64, out 32: all multiples of 16
    w = torch.randn(32, 64) * 0.1
    r = torch.randn(2, 24, 32)
    native = linear_fwd_bwd(lambda a, b: fp8.fp8_linear(a, b, native=True), x, w, r, autocast, inside)
    assert scaled_mm_calls == [fp8.E4M3, fp8.E5M2, fp8.E5M2]  # forward, grad_x, grad_w all ran on the fp8 op
    emulated = linear_fwd_bwd(lambda a, b: fp8.fp8_linear(a, b, native=False), x, w, r, autocast, inside)
    assert len(scaled_mm_calls) == 3  # the emulation does not call it
    y_dtype = torch.bfloat16 if autocast else torch.float32
    for got, want, dtype in zip(native, emulated, (y_dtype, x_dtype, torch.float32)):
        assert got.dtype == want.dtype == dtype
        # fp32: only accumulation order differs; bf16: that may flip the last rounding (one ulp = 2^-7 relative)
        tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
        assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()
        if dtype == torch.bfloat16:  # such flips are rare; a matmul that autocast ran in bf16 flips many
            assert (got != want).float().mean().item() < 0.01
    if inside:
        # autocast during backward must not change the gradients. CPU _scaled_mm itself computes in bf16
        # when autocast is on, so the comparison above, where both paths would degrade alike, cannot see it.
        outside = linear_fwd_bwd(lambda a, b: fp8.fp8_linear(a, b, native=True), x, w, r, autocast)
        for got, want in zip(native[1:], outside[1:]):
            assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.quick
def test_fp8_close_to_fp32_linear():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)
    w = torch.randn(48, 64) * 0.1
    r = torch.randn(4, 16, 48)
    ref = linear_fwd_bwd(F.linear, x, w, r)
    got = linear_fwd_bwd(fp8.fp8_linear, x, w, r)
    errs = [rel_err(g, want) for g, want in zip(got, ref)]
    assert errs[0] < 0.05  # e4m3 x e4m3
    assert errs[1] < 0.1 and errs[2] < 0.1  # e5m2 gradient has one mantissa bit less
    assert all(e > 1e-3 for e in errs)  # not bit-identical: fp8 really ran in all three matmuls
    # backward keeps the fp8 tensors and fp32 scalar scales, not the fp32 x and W
    x_leaf = x.clone().requires_grad_()
    saved = fp8.fp8_linear(x_leaf, w.clone().requires_grad_()).grad_fn.saved_tensors
    assert [t.dtype for t in saved] == [fp8.E4M3, torch.float32, fp8.E4M3, torch.float32]
    assert saved[1].dim() == 0 and saved[3].dim() == 0


@pytest.mark.quick
@pytest.mark.parametrize("x_shape, out_features", [((4, 8, 24), 32), ((4, 8, 32), 20), ((5, 2, 32), 32), ((2, 3, 16), 16)])
@pytest.mark.parametrize("autocast", [False, True])
def test_fallback_to_linear(x_shape, out_features, autocast, scaled_mm_calls):
    torch.manual_seed(0)
    x = torch.randn(*x_shape)
    w = torch.randn(out_features, x_shape[-1])
    r = torch.randn(*x_shape[:-1], out_features)
    got = linear_fwd_bwd(fp8.fp8_linear, x, w, r, autocast)
    want = linear_fwd_bwd(F.linear, x, w, r, autocast)
    assert scaled_mm_calls == []
    for g, v in zip(got, want):
        assert g.dtype == v.dtype and torch.equal(g, v)


@pytest.mark.quick
def test_convert_to_fp8():
    torch.manual_seed(0)
    shared = nn.Linear(32, 32, bias=False)
    model = nn.Sequential(
        nn.Linear(16, 32, bias=False),
        nn.ReLU(),
        nn.ModuleDict({"plain": nn.Linear(32, 32, bias=False), "biased": nn.Linear(32, 32), "shared": shared}),
        shared,
    )
    keys = list(model.state_dict().keys())
    weights = [model[0].weight, model[2]["plain"].weight, shared.weight]
    biased = model[2]["biased"]
    assert fp8.convert_to_fp8(model) == 3
    assert isinstance(model[0], fp8.Fp8Linear) and isinstance(model[2]["plain"], fp8.Fp8Linear)
    assert model[2]["shared"] is model[3] and isinstance(model[3], fp8.Fp8Linear)  # still one module
    assert model[2]["biased"] is biased and type(biased) is nn.Linear  # bias: left alone
    assert model[0].weight is weights[0] and model[2]["plain"].weight is weights[1] and model[3].weight is weights[2]
    assert list(model.state_dict().keys()) == keys
    assert fp8.convert_to_fp8(model) == 0  # nothing left to convert
    # a lone Fp8Linear behaves like the Linear it replaced, up to fp8 error
    x = torch.randn(32, 16)
    assert rel_err(model[0](x), F.linear(x, model[0].weight)) < 0.05
    with pytest.raises(AssertionError):
        fp8.Fp8Linear(16, 16, bias=True)


@pytest.mark.quick
def test_training_matches_fp32():
    def train(use_fp8):
        torch.manual_seed(0)
        teacher = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Tanh(), nn.Linear(64, 16, bias=False))
        X = torch.randn(256, 32)
        with torch.no_grad():
            Y = teacher(X)
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 16, bias=False))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # built before the conversion
        if use_fp8:
            assert fp8.convert_to_fp8(model) == 2
        start = None
        for step in range(50):
            idx = torch.arange(step * 64, step * 64 + 64) % 256
            loss = F.mse_loss(model(X[idx]), Y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            start = loss.item() if start is None else start
        with torch.no_grad():  # judged in fp32, so only the training differs
            final = F.mse_loss(F.linear(F.relu(F.linear(X, model[0].weight)), model[2].weight), Y).item()
        return start, final

    start32, final32 = train(False)
    start8, final8 = train(True)
    assert final8 < 0.1 * start8
    assert abs(final8 - final32) < 0.15 * final32


@pytest.mark.quick
def test_gpt_blocks_train_with_fp8_matmuls(monkeypatch):
    # base_train --fp8 converts the blocks' linears; every one of them (the MLP too, which the CPU fast path would
    # otherwise run from its weights) must then go through fp8, and the model must learn about as well as in fp32.
    from nanochat.gpt import GPTConfig, build_model
    from nanochat.training.recipe import build_optimizers, train_step

    products = []
    real = fp8._mm_abt
    monkeypatch.setattr(fp8, "_mm_abt", lambda *a, **k: products.append(a[0].dtype) or real(*a, **k))
    batch = torch.randint(0, 97, (4, 17), generator=torch.Generator().manual_seed(3))

    def train(use_fp8):
        torch.manual_seed(0)
        model = build_model(GPTConfig(sequence_len=16, vocab_size=97, n_layer=2, n_head=4, n_kv_head=4, n_embd=64), "cpu")
        if use_fp8:
            assert fp8.convert_to_fp8(model.transformer.h) == 12  # q, k, v, proj, fc, mlp proj per layer
        optimizers = build_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0)
        return [train_step(model, optimizers, [(batch[:, :-1], batch[:, 1:])], lambda m, xy: m(*xy), 1.0, 0.9,
                           torch.autocast("cpu", enabled=False)) for _ in range(20)]

    plain = train(False)
    assert products == []
    fp8_losses = train(True)
    assert products.count(fp8.E4M3) == 20 * 12 and products.count(fp8.E5M2) == 20 * 12 * 2  # forward, two backward
    assert fp8_losses[-1] < 0.5 * fp8_losses[0]
    assert abs(fp8_losses[-1] - plain[-1]) < 0.1 * plain[-1] and fp8_losses != plain
