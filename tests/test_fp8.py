"""FP8 linear layers (nanochat/kernels/fp8.py): quantization, the _scaled_mm path against its fp32 emulation (with the
H100's operand layouts and accumulation modes), error against fp32 F.linear, the F.linear fallback, the layouts made
without transposed copies, module conversion, the op as one opaque node under torch.compile, and training against fp32
and bf16. All on the CPU, where torch._scaled_mm runs (slowly: training there uses the emulation), so the real fp8 op
is what gets tested."""

import collections
import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch.aot_autograd import make_boxed_func
from torch.utils._python_dispatch import TorchDispatchMode

from nanochat.kernels import fp8

FP8_DTYPES = (fp8.E4M3, fp8.E5M2)
pytestmark = pytest.mark.usefixtures("single_torch_thread")


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
    """
    Records (first operand's dtype, use_fast_accum) of each torch._scaled_mm call, so a test knows which path ran, and
    fails a call whose operands an H100 would refuse: the CPU kernel takes any layout, cuBLASLt's fp8 GEMM on sm90
    only a row-major first operand and a column-major second one.
    """
    calls = []
    real = torch._scaled_mm

    def counting(a, b, **kwargs):
        assert a.is_contiguous() and b.t().is_contiguous(), (a.stride(), b.stride())
        calls.append((a.dtype, kwargs.get("use_fast_accum", False)))
        return real(a, b, **kwargs)

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
    # bf16 input quantizes the same values the same way (amax taken in bf16, the product rounded once)
    q_bf16, inv_bf16 = fp8.quantize(t.bfloat16(), fp8.E4M3)
    q_f32, inv_f32 = fp8.quantize(t.bfloat16().float(), fp8.E4M3)
    assert torch.equal(q_bf16.float(), q_f32.float()) and inv_bf16 == inv_f32
    # the transposed layout: the same values, row-major, from a row-major or a transposed input alike
    m = t[:4032].view(63, 64)
    q, inv_scale = fp8.quantize(m, fp8.E5M2)
    for source in (m, m.t().contiguous().t()):
        q_t, inv_t = fp8.quantize(source, fp8.E5M2, transposed=True)
        assert q_t.shape == (64, 63) and q_t.is_contiguous() and inv_t == inv_scale
        assert torch.equal(q_t.float(), q.float().t())
    assert fp8.quantize(m.t(), fp8.E4M3)[0].is_contiguous()  # row-major whatever the input's layout
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
    # forward, grad_x, grad_w all ran on the fp8 op: the forward with fast accumulation, the gradients without
    assert scaled_mm_calls == [(fp8.E4M3, True), (fp8.E5M2, False), (fp8.E5M2, False)]
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
    # backward keeps the fp8 tensors, transposed as its products want them, and fp32 scalar scales, not x and W
    x_leaf = x.clone().requires_grad_()
    op_node = fp8.fp8_linear(x_leaf, w.clone().requires_grad_()).grad_fn.next_functions[0][0]  # under the view
    saved = op_node.saved_tensors
    assert [t.dtype for t in saved] == [fp8.E4M3, torch.float32, fp8.E4M3, torch.float32]
    assert saved[0].shape == (64, 64) and saved[2].shape == (64, 48)  # x^T (K, M) and W^T (K, N)
    assert saved[1].dim() == 0 and saved[3].dim() == 0
    # nothing will backpropagate: no transposes are made or kept
    with torch.no_grad():
        y = fp8.fp8_linear(x, w)
    assert rel_err(y, ref[0]) < 0.05


class Fp8Writes(TorchDispatchMode):
    """Records every op that writes fp8 data: a cast from a wider dtype, or a copy of fp8 data (a layout change), and
    whether it wrote a transposed layout."""

    def __init__(self):
        super().__init__()
        self.writes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        if name == "copy_" and args[0].dtype in FP8_DTYPES:
            kind = "fp8 copy" if args[1].dtype in FP8_DTYPES else "cast"
            self.writes[kind, "transposed" if not args[0].is_contiguous() else "row-major"] += 1
        elif name in ("clone", "_to_copy") and isinstance(out, torch.Tensor) and out.dtype in FP8_DTYPES:
            kind = "fp8 copy" if args[0].dtype in FP8_DTYPES else "cast"
            self.writes[kind, "row-major" if out.is_contiguous() else "strided"] += 1
        return out


@pytest.mark.quick
def test_transposed_layouts_are_written_by_the_casts_not_copied(monkeypatch):
    # Each of x, W and grad_y is needed in both layouts (the H100's fp8 GEMM sums along its operands' contiguous dim),
    # so three transposed fp8 tensors are unavoidable; each must come straight from the cast, none from a copy of
    # fp8 data (which the first version made three times per layer: W, grad_y and x, all in backward).
    record = Fp8Writes()
    real_run_body = fp8._run_body

    def run_body_recorded(*args):  # inside the custom ops, which a dispatch mode outside them sees as one op each
        with record:
            return real_run_body(*args)

    monkeypatch.setattr(fp8, "_run_body", run_body_recorded)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 64).bfloat16().requires_grad_()
    w = (torch.randn(48, 64) * 0.1).requires_grad_()
    with record, torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8.fp8_linear(x, w, native=False)
    with record:
        y.float().sum().backward()
    assert record.writes == {("cast", "row-major"): 3, ("cast", "transposed"): 3}  # x, W, grad_y in both layouts
    assert y.dtype == x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32  # activation / weight dtypes
    record.writes.clear()
    with record, torch.no_grad():
        fp8.fp8_linear(x, w, native=False)
    assert record.writes == {("cast", "row-major"): 2}  # nothing will backpropagate: no transposes made


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
    from nanochat.recipe import build_optimizers
    from nanochat.loop import train_step

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


class GraphsKept:
    """A torch.compile backend that keeps Dynamo's graph and AOT autograd's forward and backward graphs, and runs them
    on eager kernels as aot_eager does."""

    def __init__(self):
        self.graphs = {"dynamo": [], "forward": [], "backward": []}
        self.aot = aot_autograd(fw_compiler=self.keeper("forward"), bw_compiler=self.keeper("backward"))

    def keeper(self, kind):
        def compiler(gm, example_inputs):
            self.graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    def __call__(self, gm, example_inputs):
        self.graphs["dynamo"].append(gm)
        return self.aot(gm, example_inputs)

    def targets(self, kind):
        return collections.Counter(str(node.target) for gm in self.graphs[kind] for node in gm.graph.nodes
                                   if node.op == "call_function")


def tiny_gpt(seed=0, vocab_size=97, sequence_len=16):
    from nanochat.gpt import GPTConfig, build_model

    torch.manual_seed(seed)
    config = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)
    return build_model(config, "cpu")


@pytest.mark.quick
@pytest.mark.parametrize("native", [False, True])
def test_custom_ops_pass_torch_opcheck(native):
    # The shape functions torch.compile traces with must give the real outputs' shapes, dtypes and strides, for every
    # flag; opcheck runs each op on real and on fake tensors and compares. (Its AOT test sums every output, which fp8
    # tensors cannot do, and its schema test compares inputs with arithmetic fp8 lacks: the backward skips it.)
    torch.manual_seed(0)
    x = torch.randn(32, 64).bfloat16().requires_grad_()
    w = (torch.randn(48, 64) * 0.1).requires_grad_()
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for keep_for_backward in (True, False):
        torch.library.opcheck(fp8.fp8_linear_op, (x, w, torch.bfloat16, native, keep_for_backward), test_utils=checks)
    y, *saved = fp8.fp8_linear_op(x, w, torch.bfloat16, native, True)
    assert y.requires_grad and not any(t.requires_grad for t in saved)  # only y is differentiable
    grad_y = torch.randn(32, 48).bfloat16()
    for need_grad_x, need_grad_w in ((True, True), (True, False), (False, True)):
        args = (grad_y, *saved, torch.bfloat16, torch.float32, native, need_grad_x, need_grad_w)
        torch.library.opcheck(fp8.fp8_linear_backward_op, args, test_utils=checks[1:])


@pytest.mark.parametrize("bf16", [False, True])
def test_compiled_model_sees_each_fp8_linear_as_one_node(bf16):
    # The fp8 linear is one opaque op: Dynamo does not trace its quantisation (which made a d24's first compiled step
    # take minutes), the model compiles to one graph with no break, and the forward and backward graphs hold one
    # node per linear and none of the quantisation's ops. Before, each linear was an autograd.Function whose
    # forward and backward Dynamo traced: 12 higher-order nodes, and amax/clamp/casts of every linear in the graphs.
    model = tiny_gpt()
    assert fp8.convert_to_fp8(model.transformer.h) == 12
    with torch.no_grad():
        for block in model.transformer.h:  # init zeroes the output projections: give their gradients something to do
            block.attn.c_proj.weight.normal_(std=0.05)
            block.mlp.c_proj.weight.normal_(std=0.05)
    idx = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(1))

    def loss_and_grads(run):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = run(idx, idx)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(model)
    backend = GraphsKept()
    counters.clear()
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model, backend=backend, dynamic=False))
    assert dict(counters["graph_break"]) == {} and len(backend.graphs["dynamo"]) == 1
    assert backend.targets("dynamo")["nanochat.fp8_linear.default"] == 12
    forward, backward = backend.targets("forward"), backend.targets("backward")
    assert forward["nanochat.fp8_linear.default"] == 12 and backward["nanochat.fp8_linear_backward.default"] == 12
    assert not [t for t in (*forward, *backward) if "amax" in t or "scaled_mm" in t]  # all of fp8 is inside the ops
    assert torch.allclose(compiled_loss, eager_loss, rtol=1e-3)
    for compiled, eager in zip(compiled_grads, eager_grads):
        if bf16:
            # bf16 rounds a little differently compiled, and fp8 re-rounds what it is given (grad_y in e5m2: ~6 %
            # rms): measured 14 % apart at worst (1.3 % without fp8), the same direction
            assert F.cosine_similarity(compiled.flatten(), eager.flatten(), dim=0) > 0.98
        else:
            assert rel_err(compiled, eager) < 1e-5  # fp32: the same arithmetic


@pytest.mark.parametrize("native", [False, True])
def test_compiled_op_body_matches_eager(native, monkeypatch):
    # On a GPU the op's body runs torch.compile'd (fullgraph, so a graph break would raise): trace it here the same
    # way (the suite's backend, aot_eager: no inductor code generation) and compare with the eager body.
    torch.manual_seed(0)
    x = torch.randn(2, 24, 64).bfloat16()
    w = torch.randn(32, 64) * 0.1
    r = torch.randn(2, 24, 32)
    eager = linear_fwd_bwd(lambda a, b: fp8.fp8_linear(a, b, native=native), x, w, r, autocast=True)
    monkeypatch.setattr(fp8, "FUSED_DEVICE_TYPES", {"cpu"})
    monkeypatch.setattr(fp8, "_COMPILED_BODIES", {})
    fused = linear_fwd_bwd(lambda a, b: fp8.fp8_linear(a, b, native=native), x, w, r, autocast=True)
    assert set(fp8._COMPILED_BODIES) == {fp8._forward_body, fp8._backward_body}  # both ran compiled
    for got, want in zip(fused, eager):
        assert got.dtype == want.dtype
        assert (got.float() - want.float()).abs().max().item() <= 2.0 ** -7 * want.float().abs().max().item()



def test_fused_bodies_compile_once_per_flag_combination(monkeypatch):
    # On a GPU each op's body runs torch.compile'd; each new graph is a compile (seconds), and past 8 per function
    # Dynamo gives up and runs it eagerly. Layers of three shapes, token counts of training and eval, eager and
    # compiled models must all share one graph per flag combination: the forward with and without the transposes
    # kept for backward, and the backward.
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(fp8, "FUSED_DEVICE_TYPES", {"cpu"})
    monkeypatch.setattr(fp8, "_COMPILED_BODIES", {})
    monkeypatch.setattr(fp8, "compile_backend", lambda: counting_backend)
    model = tiny_gpt()  # square (64 x 64), wide (64 -> 256) and narrow (256 -> 64) linears
    assert fp8.convert_to_fp8(model.transformer.h) == 12
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    for run in (model, compiled):
        for rows in (4, 2):
            idx = torch.randint(0, 97, (rows, 16), generator=torch.Generator().manual_seed(rows))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                run(idx, idx).backward()
                with torch.no_grad():
                    run(idx, idx)
    assert len(graphs) == 3


def markov_batches(vocab_size, batches, rows, length, seed):
    """Token rows from a fixed random Markov chain whose every token has a few likely successors: data a tiny model can
    learn (loss falls toward the chain's entropy, ~2 nats here) but never memorise, so losses compare meaningfully."""
    g = torch.Generator().manual_seed(seed)
    successor_probs = (torch.randn(vocab_size, vocab_size, generator=g) * 3.0).softmax(-1)
    out = []
    for _ in range(batches):
        token = torch.randint(0, vocab_size, (rows,), generator=g)
        tokens = [token]
        for _ in range(length):
            token = torch.multinomial(successor_probs[token], 1, generator=g).squeeze(1)
            tokens.append(token)
        out.append(torch.stack(tokens, 1))
    return out


@pytest.mark.quick
def test_gpt_training_loss_within_1_percent_of_bf16(monkeypatch):
    # What --fp8=1 must keep: after the same steps on the same data, the loss of a GPT whose block linears run fp8
    # (emulated here) is within 1 % of the bf16 run's. Measured: within 0.35 % on the last step, 0.07 % held out,
    # over 3 seeds at 30 and 60 steps; a broken scale or dtype moves it by far more.
    from nanochat.recipe import build_optimizers
    from nanochat.loop import train_step

    products = []
    real = fp8._mm_abt
    monkeypatch.setattr(fp8, "_mm_abt", lambda *a, **k: products.append(a[0].dtype) or real(*a, **k))
    steps = 40
    batches = markov_batches(96, steps + 2, rows=8, length=32, seed=1234)

    def train(use_fp8):
        model = tiny_gpt(vocab_size=96, sequence_len=32)
        if use_fp8:
            assert fp8.convert_to_fp8(model.transformer.h) == 12
        optimizers = build_optimizers(model, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0)
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
        losses = [train_step(model, optimizers, [(b[:, :-1], b[:, 1:])], lambda m, xy: m(*xy), 1.0, 0.9, bf16)
                  for b in batches[:steps]]
        with torch.no_grad(), bf16:
            held_out = sum(model(b[:, :-1], b[:, 1:]).item() for b in batches[steps:]) / len(batches[steps:])
        return losses, held_out

    bf16_losses, bf16_held_out = train(False)
    fp8_losses, fp8_held_out = train(True)
    assert products.count(fp8.E4M3) == steps * 12 + 2 * 12  # every linear's forward in fp8, the held-out passes too
    assert fp8_losses[-1] < 0.6 * fp8_losses[0]  # it learned
    assert fp8_losses != bf16_losses  # fp8 really changed the numbers
    assert abs(fp8_losses[-1] - bf16_losses[-1]) < 0.01 * bf16_losses[-1]
    assert abs(fp8_held_out - bf16_held_out) < 0.01 * bf16_held_out
