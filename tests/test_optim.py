"""Tests for nanochat.optim (AdamW and Muon): AdamW math, orthogonalisation, resume, and a real 2-rank run."""

import copy
import importlib.util
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from nanochat import optim  # noqa: E402
from nanochat.optim import DistAdamW, build_adamw  # noqa: E402
from nanochat import common  # noqa: E402
from nanochat.common import UserError  # noqa: E402
from nanochat.optim import DistMuon, Muon, build_muon, orthogonalize  # noqa: E402

WORKER_PATH = os.path.join(REPO, "tests", "dist_optim_worker.py")


def load_worker():
    spec = importlib.util.spec_from_file_location("dist_optim_worker", WORKER_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -----------------------------------------------------------------------------
# AdamW


@pytest.mark.quick
@pytest.mark.parametrize("fused", [True, False])
def test_adamw_matches_torch_adamw(fused, monkeypatch):
    monkeypatch.setattr(optim, "FUSED", fused)  # torch's one-pass kernel, and the separate passes beside it
    torch.manual_seed(0)
    shapes = [(7, 5), (12,), ()]
    ours = [nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    hyper = [dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1),
             dict(lr=0.003, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0)]
    opt = build_adamw([dict(params=ours[:2], initial_lr=0.01, **hyper[0]), dict(params=ours[2:], **hyper[1])])
    ref_opt = torch.optim.AdamW([dict(params=ref[:2], **hyper[0]), dict(params=ref[2:], **hyper[1])], foreach=False)
    assert isinstance(opt, DistAdamW)
    for step in range(6):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        if step == 3:  # the training loop rescales lr mid-run; both must follow
            opt.param_groups[0]["lr"] = ref_opt.param_groups[0]["lr"] = 0.005
        opt.step()
        ref_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert opt.param_groups[0]["initial_lr"] == 0.01  # extra keys ride along untouched


@pytest.mark.quick
def test_adamw_honours_lr_mul_and_wd_mul():
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4, 3))
    b = nn.Parameter(a.detach().clone())
    b.lr_mul, b.wd_mul = 2.0, 0.5
    ref = nn.Parameter(a.detach().clone())
    opt = DistAdamW([dict(params=[a, b], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.2)])
    # b, with lr x2 and weight decay x0.5, steps like a plain AdamW with lr 0.02 and weight decay 0.1.
    ref_opt = torch.optim.AdamW([ref], lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        g = torch.randn(4, 3)
        a.grad, b.grad, ref.grad = g.clone(), g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(b, ref, rtol=1e-6, atol=1e-6)
    assert (a - b).abs().max() > 1e-3


# -----------------------------------------------------------------------------
# Muon


@pytest.mark.quick
@pytest.mark.parametrize("shape", [(64, 64), (96, 32), (32, 96)])
def test_orthogonalize_pushes_singular_values_to_one(shape):
    torch.manual_seed(0)
    G = torch.randn(shape) * 3.0
    X = orthogonalize(G, steps=5)
    assert X.shape == G.shape and X.dtype == G.dtype
    s = torch.linalg.svdvals(X)
    # The quintic iteration trades exactness for speed: singular values land in ~[0.7, 1.2].
    # A random square matrix has a few near-zero singular values that 5 steps cannot lift,
    # so require the bulk, not all of them, to be near 1.
    assert s.max() < 1.25
    assert (s > 0.6).float().mean() >= 0.9
    # And X points along the exact polar factor U V^T.
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    cosine = (X * polar).sum() / (X.norm() * polar.norm())
    assert cosine > 0.95


@pytest.mark.quick
@pytest.mark.parametrize("shape", [(48, 48), (80, 20), (20, 80)])
def test_orthogonalize_well_conditioned_input_all_singular_values_near_one(shape):
    torch.manual_seed(1)
    rows, cols = shape
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k))
    V, _ = torch.linalg.qr(torch.randn(cols, k))
    s_in = torch.logspace(-1, 1, k)  # condition number 100
    G = U @ torch.diag(s_in) @ V.T
    s = torch.linalg.svdvals(orthogonalize(G, steps=5))
    assert s.min() > 0.6 and s.max() < 1.25, s


@pytest.mark.quick
def test_orthogonalize_bf16_and_batched():
    torch.manual_seed(0)
    G = torch.randn(3, 16, 24)
    X = orthogonalize(G, steps=5, dtype=torch.bfloat16)
    assert X.dtype == torch.float32 and X.shape == G.shape
    for i in range(3):
        s = torch.linalg.svdvals(X[i])
        assert s.min() > 0.5 and s.max() < 1.3
        torch.testing.assert_close(X[i], orthogonalize(G[i], steps=5, dtype=torch.bfloat16), rtol=0, atol=0.05)


@pytest.mark.quick
def test_orthogonalization_and_compute_dtype_follow_the_hardware_and_the_override(monkeypatch):
    monkeypatch.delenv("NANOCHAT_MUON_DTYPE", raising=False)
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    monkeypatch.setattr(common, "cpu_flags", lambda: {"avx2", "fma"})
    assert common.orthogonalization_dtype("cpu") == torch.float32  # bf16 would be emulated: many times slower
    assert common.get_compute_dtype("cpu") == torch.float32 and common.autocast_for("cpu").__class__.__name__ == "nullcontext"
    for native in ("avx512_bf16", "amx_bf16"):
        monkeypatch.setattr(common, "cpu_flags", lambda: {"avx2", native})
        assert common.orthogonalization_dtype("cpu") == torch.bfloat16
        assert common.get_compute_dtype("cpu") == torch.bfloat16  # training and inference in bf16 autocast
        with common.autocast_for("cpu"):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    monkeypatch.setenv("NANOCHAT_DTYPE", "float32")
    assert common.get_compute_dtype("cpu") == torch.float32
    monkeypatch.setenv("NANOCHAT_MUON_DTYPE", "float32")
    assert common.orthogonalization_dtype("cpu") == torch.float32
    monkeypatch.setenv("NANOCHAT_MUON_DTYPE", "half")
    with pytest.raises(UserError, match="NANOCHAT_MUON_DTYPE"):
        common.orthogonalization_dtype("cpu")
    with pytest.raises(UserError, match="NANOCHAT_MUON_DTYPE"):  # when the optimizer is built, before any step
        build_muon([dict(params=[nn.Parameter(torch.zeros(4, 4))], lr=0.02)])


def _tiny_classifier():
    torch.manual_seed(0)
    X = torch.randn(256, 20)
    teacher = torch.randn(20, 4)
    y = (X @ teacher).argmax(dim=1)
    model = nn.Sequential(nn.Linear(20, 64, bias=False), nn.ReLU(), nn.Linear(64, 4, bias=False))
    return model, X, y


@pytest.mark.quick
@pytest.mark.parametrize("muon_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("optimizer_cls", [Muon, DistMuon])
def test_muon_reduces_classification_loss(optimizer_cls, muon_dtype, monkeypatch):
    monkeypatch.setenv("NANOCHAT_MUON_DTYPE", muon_dtype)
    model, X, y = _tiny_classifier()
    groups = [dict(params=[model[0].weight]), dict(params=[model[2].weight])]
    opt = optimizer_cls(groups, lr=0.02, momentum=0.9)
    with torch.no_grad():
        initial = F.cross_entropy(model(X), y).item()
    for _ in range(40):
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        final = F.cross_entropy(model(X), y).item()
    assert final < 0.5 * initial, (initial, final)


@pytest.mark.quick
def test_muon_single_and_distributed_agree_and_honour_group_momentum():
    params_a = [nn.Parameter(torch.randn(8, 12)) for _ in range(3)] + [nn.Parameter(torch.randn(12, 8))]
    params_b = [nn.Parameter(p.detach().clone()) for p in params_a]
    # lr_mul 0 freezes a matrix entirely: decay is lr * weight_decay, so it stops too.
    params_a[1].lr_mul = params_b[1].lr_mul = 0.0
    frozen_start = params_a[1].detach().clone()
    moving_start = params_a[0].detach().clone()
    single = Muon([dict(params=params_a, lr=0.03, weight_decay=0.1)])
    distributed = build_muon([dict(params=params_b[:3], lr=0.03, weight_decay=0.1),
                              dict(params=params_b[3:], lr=0.03, weight_decay=0.1)], momentum=0.95)
    torch.manual_seed(2)
    for step in range(3):
        for group in (*single.param_groups, *distributed.param_groups):
            group["momentum"] = 0.85 + 0.05 * step  # momentum warmup, as the training loop does
        for p, q in zip(params_a, params_b):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
        single.step()
        distributed.step()
    for p, q in zip(params_a, params_b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert torch.equal(params_a[1], frozen_start) and torch.equal(params_b[1], frozen_start)
    assert (params_a[0] - moving_start).abs().max() > 1e-2
    assert single.state[params_a[1]]["momentum_buffer"].abs().sum() > 0


@pytest.mark.quick
def test_muon_rejects_mixed_shapes_and_vectors():
    with pytest.raises(ValueError, match="one shape"):
        DistMuon([dict(params=[nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 8))])])
    with pytest.raises(ValueError, match="2-D"):
        Muon([nn.Parameter(torch.randn(4))])


def reference_muon(p0, grads, lrs, momenta, weight_decay, nesterov=True):
    """
    Muon for one matrix, written from the math in float64 (nothing from nanochat.optim): returns the weights and
    the momentum buffer after every step.
        buf <- buf + (1 - m) (g - buf)                  momentum as an exponential average
        d   <- g + m (buf - g)                          Nesterov look-ahead (or buf without it)
        X   <- d / ||d||_F, on the wide orientation (tall matrices transposed)
        X   <- a X + (b A + c A^2) X,  A = X X^T        5 times, (a, b, c) = (3.4445, -4.7750, 2.0315)
        p   <- p (1 - lr wd) - lr sqrt(max(1, rows/cols)) X      (X transposed back for a tall matrix)
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    rows, cols = p0.shape
    p, buf = p0.double().clone(), torch.zeros(rows, cols, dtype=torch.float64)
    trajectory = []
    for g, lr, m in zip(grads, lrs, momenta):
        g = g.double()
        buf = buf + (1 - m) * (g - buf)
        d = g + m * (buf - g) if nesterov else buf
        X = d.T if rows > cols else d
        X = X / (torch.sqrt((X * X).sum()) + 1e-7)
        for _ in range(5):
            A = X @ X.T
            X = a * X + (b * A + c * (A @ A)) @ X
        update = X.T if rows > cols else X
        p = p * (1 - lr * weight_decay) - lr * math.sqrt(max(1.0, rows / cols)) * update
        trajectory.append((p.clone(), buf.clone()))
    return trajectory


@pytest.mark.quick
@pytest.mark.parametrize("optimizer_cls", [Muon, DistMuon])
def test_muon_matches_float64_reference(optimizer_cls, single_torch_thread, monkeypatch):
    """Muon and (single-process) DistMuon follow the plain float64 Muon above, step by step, for wide, tall and
    square matrices, two of each shape (so the batched orthogonalisation is exercised), under a changing lr and
    momentum and with weight decay. In fp32: a CPU with native bf16 would otherwise orthogonalise in bf16."""
    monkeypatch.setenv("NANOCHAT_MUON_DTYPE", "float32")
    torch.manual_seed(0)
    shapes = [(16, 48), (48, 16), (24, 24), (20, 28)]  # 16x48 and 48x16 take optim.py's Gram-form iteration
    steps, weight_decay = 5, 0.1
    lrs = [0.02 * (1 - 0.1 * k) for k in range(steps)]
    momenta = [0.85 + 0.02 * k for k in range(steps)]
    params = [nn.Parameter(0.3 * torch.randn(shape)) for shape in shapes for _ in range(2)]
    starts = [p.detach().clone() for p in params]
    grads = [[torch.randn(p.shape) for _ in range(steps)] for p in params]
    references = [reference_muon(start, g, lrs, momenta, weight_decay) for start, g in zip(starts, grads)]
    if optimizer_cls is Muon:
        groups = [dict(params=params)]  # one group of mixed shapes: Muon batches same-shape matrices itself
    else:
        groups = [dict(params=params[i:i + 2]) for i in range(0, len(params), 2)]  # DistMuon: one shape per group
    opt = optimizer_cls(groups, lr=lrs[0], momentum=momenta[0], weight_decay=weight_decay)

    # Tolerance: the float64 reference is exact to ~1e-13; ours runs in float32. Storing p costs 2^-24 |p| per step, and
    # the orthogonalised update (entries <= ~1) carries float32 rounding that the iteration can amplify by at most
    # a^5 ~ 500 (the slope at 0, along the smallest singular directions), times lr * shape scale per step.
    max_scale = math.sqrt(3.0)
    tol = steps * 2**-24 * 1.5 + sum(lrs) * max_scale * 500 * 2**-24  # ~6e-6; observed differences are ~1e-7
    for k in range(steps):
        for group in opt.param_groups:
            group["lr"], group["momentum"] = lrs[k], momenta[k]
        for p, g in zip(params, grads):
            p.grad = g[k].clone()
        opt.step()
        for i, p in enumerate(params):
            ref_p, ref_buf = references[i][k]
            assert (p.detach().double() - ref_p).abs().max().item() < tol, (p.shape, k)
            # the buffer is a plain average of N(0, 1) gradients (|buf| < 5): float32 rounding of 2^-24 * 5 per step
            assert (opt.state[p]["momentum_buffer"].double() - ref_buf).abs().max().item() < 1e-6, (p.shape, k)
    # the tolerance is sharp: the same steps without the Nesterov look-ahead land far outside it
    for p, start, g in zip(params, starts, grads):
        plain, _ = reference_muon(start, g, lrs, momenta, weight_decay, nesterov=False)[-1]
        assert (p.detach().double() - plain).abs().max().item() > 100 * tol, p.shape


# -----------------------------------------------------------------------------
# State dict round trip and the real 2-rank run


def _reference_run(worker, steps, resume_at=None):
    """Single-process run of the worker's model on the full global batch; optionally through a
    state_dict save/load (of model and optimizers) after resume_at steps."""
    model = worker.build_model()
    optimizers = worker.build_optimizers(model)
    for step in range(steps):
        if step == resume_at:
            saved_model = copy.deepcopy(model.state_dict())
            saved_opts = [copy.deepcopy(opt.state_dict()) for opt in optimizers]
            model = worker.build_model()
            model.load_state_dict(saved_model)
            optimizers = worker.build_optimizers(model)
            for opt, state in zip(optimizers, saved_opts):
                opt.load_state_dict(state)
        worker.train_step(model, optimizers, step)
    return model


@pytest.mark.quick
def test_state_dict_round_trip_single_process():
    worker = load_worker()
    straight = _reference_run(worker, steps=4)
    resumed = _reference_run(worker, steps=4, resume_at=2)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.timeout(240)
def test_two_rank_gloo_step_equals_single_process(tmp_path):
    worker = load_worker()
    out = tmp_path / "final_params.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone runs a local rendezvous on localhost:0, i.e. a free port chosen by the OS.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           WORKER_PATH, str(out)]
    # A session of its own, so a hung run can be killed along with both ranks.
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        # The single-process reference on the full batch, computed while the two ranks start up:
        # plain Muon and torch's own AdamW.
        model = worker.build_model()
        adamw_groups, muon_groups = worker.param_groups(model)
        torch_groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in adamw_groups]
        optimizers = [torch.optim.AdamW(torch_groups, foreach=False), Muon(muon_groups, momentum=0.9)]
        start = {name: p.detach().clone() for name, p in model.named_parameters()}
        for step in range(worker.NUM_STEPS):
            worker.train_step(model, optimizers, step)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-5000:]
    result = torch.load(out, weights_only=True)
    assert result["world"] == 2
    assert not result["ranks_disagree"]
    assert not result["state_not_sharded"]
    assert result["muon_states_rank0"] == 4  # 2 of the 3 square matrices + the lone tall + the lone wide
    assert result["resume_diff"] == 0.0
    for name, p in model.named_parameters():
        dist_p = result["params"][name]
        assert (dist_p - p.detach()).abs().max().item() < 1e-5, name
        assert (p.detach() - start[name]).abs().max().item() > 1e-3, name  # it really trained


@pytest.mark.quick
def test_loading_state_from_another_world_size_is_a_clear_error():
    p = nn.Parameter(torch.randn(6, 4))
    p.grad = torch.randn(6, 4)
    opt = DistAdamW([p], lr=0.01)
    opt.step()
    state = opt.state_dict()
    # What rank 0 of a 2-rank run would have saved: a slice of 3 rows.
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"][:3].clone()
    state["state"][0]["exp_avg_sq"] = state["state"][0]["exp_avg_sq"][:3].clone()
    with pytest.raises(UserError, match="different number of ranks"):
        DistAdamW([p], lr=0.01).load_state_dict(state)


@pytest.mark.quick
def test_polar_express_coefficients_are_minimax_and_end_closer_to_one():
    # Each step's quintic is the best worst case over where the singular values are: its error equioscillates,
    # and no small change of its coefficients lowers the worst case.
    from nanochat.optim import NS_COEFFS, _minimax_odd_quintic, polar_express_coefficients

    (a, b, c), error = _minimax_odd_quintic(0.1, 1.0)
    x = np.linspace(0.1, 1.0, 20001)
    worst = lambda a, b, c: np.abs(1 - (a * x + b * x ** 3 + c * x ** 5)).max()  # noqa: E731
    assert worst(a, b, c) == pytest.approx(error, rel=1e-4)
    rng = np.random.default_rng(0)
    for _ in range(50):
        da, db, dc = rng.normal(scale=1e-3, size=3)
        assert worst(a + da, b + db, c + dc) >= error * (1 - 1e-6)
    # composed over five steps from [1e-3, 1]: far tighter than the fixed quintic
    x = np.linspace(1e-3, 1.0, 20001)
    ours, fixed = x.copy(), x.copy()
    for (a, b, c) in polar_express_coefficients(5):
        ours = a * ours + b * ours ** 3 + c * ours ** 5
    for _ in range(5):
        fixed = NS_COEFFS[0] * fixed + NS_COEFFS[1] * fixed ** 3 + NS_COEFFS[2] * fixed ** 5
    assert 0.85 < ours.min() and ours.max() < 1.15
    assert fixed.min() < 0.5


@pytest.mark.quick
@pytest.mark.parametrize("shape, dtype", [((48, 48), torch.float32), ((32, 128), torch.float32),
                                          ((128, 32), torch.float32), ((32, 128), torch.bfloat16)])
def test_orthogonalize_with_polar_express_on_an_ill_conditioned_matrix(shape, dtype):
    # singular values over 2.7 decades: the fixed quintic leaves the small ones well short of 1, Polar Express does not
    # (fp32 wide matrices take the Gram form of the iteration, the others the plain one)
    torch.manual_seed(2)
    rows, cols = shape
    k = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(rows, k))
    V, _ = torch.linalg.qr(torch.randn(cols, k))
    G = U @ torch.diag(torch.logspace(-2.7, 0, k)) @ V.T  # after the Frobenius normalisation the smallest is ~1e-3
    fixed = torch.linalg.svdvals(orthogonalize(G, steps=5, dtype=dtype))
    ours = torch.linalg.svdvals(orthogonalize(G, steps=5, dtype=dtype, polar_express=True))
    assert ours.max() < 1.15 and ours.min() > 0.84, ours
    assert fixed.min() < 0.56 and fixed.max() > 1.19


# -----------------------------------------------------------------------------
# Muon's update compiled (compile_muon_updates), and each matrix's multipliers


def muon_pair(shapes, per_shape=2, **options):
    """Two DistMuons (one group per shape, NorMuon's row moments on, as the default recipe) over equal copies of the
    same matrices, and those copies."""
    torch.manual_seed(0)
    starts = [0.3 * torch.randn(shape) for shape in shapes for _ in range(per_shape)]
    runs = []
    for _ in range(2):
        params = [nn.Parameter(s.clone()) for s in starts]
        groups = [dict(params=params[i:i + per_shape], normuon=True, **options) for i in range(0, len(params), per_shape)]
        runs.append((params, build_muon(groups)))
    return runs


def muon_steps(runs, steps):
    """`steps` steps of each run on the same gradients, the lr and momentum changing every step as the loop's
    schedules change them."""
    grads = torch.Generator().manual_seed(1)
    for k in range(steps):
        gs = [torch.randn(p.shape, generator=grads) for p in runs[0][0]]
        for params, opt in runs:
            for group in opt.param_groups:
                group["lr"], group["momentum"], group["weight_decay"] = 0.02 * (1 - 0.1 * k), 0.85 + 0.02 * k, 0.1
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()


class KeptGraphs:
    """A torch.compile backend that keeps Dynamo's graphs and AOT autograd's (functional aten) ones, and runs them on
    eager kernels as aot_eager does."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.aot_autograd import make_boxed_func

        self.dynamo, self.aten = [], []

        def keep(gm, example_inputs):
            self.aten.append(gm)
            return make_boxed_func(gm.forward)
        self.aot = aot_autograd(fw_compiler=keep)

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)
        return self.aot(gm, example_inputs)


@pytest.mark.quick
def test_compiled_muon_update_is_one_graph_per_shape_group_and_follows_eager(monkeypatch):
    # The optimizer's census before a GPU lease. Eager, the update of a d24 launched a few hundred small kernels a step
    # (the H200 profile: 173 stacking copies, 144 per-matrix NorMuon launches, casts around Newton-Schulz) where the
    # reference's compiled update fuses them. Compiled: one graph per shape group, built once (a new lr or momentum
    # every step is an input, not a recompile: lr, momentum and decay are its three 0-d inputs), the orthogonalisation's
    # matmuls inside it (no graph break), and the same steps as eager.
    monkeypatch.setenv("NANOCHAT_MUON_DTYPE", "float32")
    backend = KeptGraphs()
    monkeypatch.setattr(optim, "compile_backend", lambda: backend)
    optim._compiled_muon_arithmetic.cache_clear()
    torch._dynamo.reset()
    try:
        shapes = [(16, 48), (48, 16), (24, 24)]  # 16x48 takes the Gram form of the iteration, the others the plain one
        (eager_params, eager), (compiled_params, compiled) = muon_pair(shapes)
        assert optim.compile_muon_updates([compiled]) == [compiled] and compiled.compiled and not eager.compiled
        muon_steps([(eager_params, eager), (compiled_params, compiled)], steps=4)
        assert len(backend.dynamo) == len(shapes), f"{len(backend.dynamo)} graphs for {len(shapes)} shape groups"
        for gm in backend.aten:
            inputs = [node.meta["val"] for node in gm.graph.nodes if node.op == "placeholder"]
            scalars = [t for t in inputs if t.dim() == 0]
            assert len(scalars) == 3 and all(t.dtype == torch.float32 for t in scalars)  # lr, momentum, weight decay
            matmuls = sum(str(node.target) in ("aten.bmm.default", "aten.baddbmm.default")
                          for node in gm.graph.nodes if node.op == "call_function")
            assert matmuls >= 2 * 5, matmuls  # five Newton-Schulz steps, each two matmuls at least
        for p, q in zip(eager_params, compiled_params):
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
            for name in ("momentum_buffer", "row_second_moment"):
                torch.testing.assert_close(compiled.state[q][name], eager.state[p][name], rtol=1e-5, atol=1e-7)
        assert max((p - s).abs().max().item() for p, s in zip(eager_params, muon_pair(shapes)[0][0])) > 1e-2  # moved
    finally:
        optim._compiled_muon_arithmetic.cache_clear()
        torch._dynamo.reset()


@pytest.mark.quick
@pytest.mark.parametrize("compiled", [False, True])
def test_a_matrix_s_lr_and_decay_multipliers_move_it_alone(compiled, monkeypatch):
    # One step from the same start and gradients with and without multipliers on two of three same-shape matrices
    # (a group with multipliers takes the update's per-matrix path, one without them the batched one): lr_mul 0.5
    # halves that matrix's whole move (decay is lr * weight_decay), wd_mul 0 leaves its neighbour the update alone,
    # and the third moves as it did.
    monkeypatch.setenv("NANOCHAT_MUON_DTYPE", "float32")
    (plain, plain_opt), (marked, marked_opt) = muon_pair([(8, 12)], per_shape=3)
    marked[1].lr_mul, marked[2].wd_mul = 0.5, 0.0
    if compiled:
        optim.compile_muon_updates([plain_opt, marked_opt])
    try:
        starts = [p.detach().clone() for p in plain]
        muon_steps([(plain, plain_opt), (marked, marked_opt)], steps=1)
        moves = [p.detach() - s for p, s in zip(plain, starts)]
        lr, wd = 0.02, 0.1
        torch.testing.assert_close(marked[0] - starts[0], moves[0])
        torch.testing.assert_close(marked[1] - starts[1], 0.5 * moves[1])
        torch.testing.assert_close(marked[2] - starts[2], moves[2] + lr * wd * starts[2])
    finally:
        optim._compiled_muon_arithmetic.cache_clear()
