"""
The optimizers, both sharded across ranks: Muon for the 2-D weight matrices of the transformer blocks, AdamW for the
rest (embeddings, the lm_head, vectors and scalars); then the lr / momentum schedules and one update of both.
Each rank computes the mean loss over its equal share of the global batch and gradients are averaged across ranks, so
a step equals the single-process step on the whole batch; with one rank (or none) each is its plain self. A parameter
may carry `lr_mul` / `wd_mul` attributes (default 1.0) scaling its lr / decay. Weight decay is decoupled
(p <- p * (1 - lr * weight_decay), as torch.optim.AdamW), so it already follows the lr schedule.
"""

import functools
import math
import types
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from nanochat.common import UserError, compile_backend, dist_rank_world, orthogonalization_dtype

# -----------------------------------------------------------------------------
# Muon

# Quintic iteration X <- a*X + b*(X X^T) X + c*(X X^T)^2 X: a large slope at 0 grows small singular values fast, and
# after ~5 steps every one sits in roughly [0.7, 1.2] rather than exactly at 1, which is all the optimizer needs.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NORMUON_BETA2 = 0.95


@functools.cache
def polar_express_coefficients(steps, lower=1e-3, safety=1.01):
    """
    One odd quintic a x + b x^3 + c x^5 per step, chosen greedily (Polar Express, Amsel et al. 2025): step k takes the
    minimax one over where the singular values are now ([lower, 1] at first, then [1 - e_k, 1 + e_k]), each interval's
    top widened by `safety` for rounding. From [1e-3, 1] five steps end in about [0.89, 1.11] (NS_COEFFS: [0.47, 1.20]).
    """
    lo, hi, coefficients = lower, 1.0, []
    for _ in range(steps):
        (a, b, c), error = _minimax_odd_quintic(lo, hi * safety)
        coefficients.append((a, b, c))
        lo, hi = 1 - error, 1 + error
    return tuple(coefficients)


def _minimax_odd_quintic(lo, hi, rounds=50):
    """(a, b, c) minimising max |1 - (a x + b x^3 + c x^5)| over [lo, hi], and that error, by Remez exchange: solve for
    the quintic whose error alternates with equal size on 4 points, move them to the error's extremes, repeat."""
    grid = np.linspace(lo, hi, 4001)
    points = np.linspace(lo, hi, 4)
    signs = np.array([1.0, -1.0, 1.0, -1.0])
    for _ in range(rounds):
        a, b, c, _ = np.linalg.solve(np.stack([points, points ** 3, points ** 5, signs], axis=1), np.ones(4))
        error = 1 - (a * grid + b * grid ** 3 + c * grid ** 5)
        turns = np.flatnonzero((error[1:-1] - error[:-2]) * (error[2:] - error[1:-1]) <= 0) + 1
        extremes = grid[np.concatenate(([0], turns, [len(grid) - 1]))]
        if len(extremes) != 4 or np.allclose(extremes, points, rtol=0, atol=1e-12):
            break
        points = extremes
    return (float(a), float(b), float(c)), float(np.abs(error).max())


def newton_schulz_coefficients(steps, polar_express=False):
    """The (a, b, c) of each of `steps` Newton-Schulz steps: NS_COEFFS every time, or polar_express's own per step."""
    return polar_express_coefficients(steps) if polar_express else (NS_COEFFS,) * steps


def orthogonalize(G, steps=5, dtype=None, polar_express=False, coefficients=None):
    """The orthogonal polar factor U V^T of G (..., rows, cols) by Newton-Schulz (NS_COEFFS, or polar_express's per-step
    quintics; or `coefficients` as newton_schulz_coefficients gives them), in common.orthogonalization_dtype; returned
    in G's dtype."""
    if coefficients is None:
        coefficients = newton_schulz_coefficients(steps, polar_express)
    if G.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix (got shape {tuple(G.shape)})")
    if dtype is None:
        dtype = orthogonalization_dtype(G.device)
    X = G.to(dtype)
    # Work on the wide orientation so the Gram matrix X X^T is the small one.
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    # the Frobenius norm bounds the spectral norm: every singular value <= 1, where the iteration converges
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    batch_shape, (rows, cols) = X.shape[:-2], X.shape[-2:]
    X = X.reshape(-1, rows, cols)  # one batch dimension, as bmm wants
    # the Gram form does fewer FLOPs when cols > 1.5 rows, but its rounding builds up in A: fine in fp32, not in bf16
    if dtype == torch.float32 and 2 * cols > 3 * rows:
        X = _newton_schulz_gram(X, coefficients)
    else:
        X = _newton_schulz(X, coefficients)
    X = X.reshape(*batch_shape, rows, cols)
    if tall:
        X = X.mT
    return X.to(G.dtype)


def _newton_schulz(X, coefficients):
    """X <- P(A) X with P(A) = a I + b A + c A^2 and A = X X^T, for a batch of wide matrices (n, rows, cols), one
    (a, b, c) per step. Per step 4 rows^2 cols + 2 rows^3 FLOPs; baddbmm folds the scalings and sums into the matmuls."""
    for a, b, c in coefficients:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    return X


def _newton_schulz_gram(X0, coefficients):
    """
    The same iteration on rows x rows matrices only: X_k = M_k X0, and with P_k = a I + b A_k + c A_k^2,
    M_{k+1} = P_k M_k and A_{k+1} = P_k A_k P_k, so the wide X0 is touched only for A_0 = X0 X0^T and the final M X0:
    4 rows^2 cols + 34 rows^3 FLOPs for 5 steps, against 20 rows^2 cols + 10 rows^3 (44 % fewer at 1:4).
    """
    A = torch.bmm(X0, X0.mT)
    M = None
    for k, (a, b, c) in enumerate(coefficients):
        P = torch.baddbmm(A, A, A, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        M = P if M is None else torch.bmm(P, M)
        if k + 1 < len(coefficients):
            A = torch.bmm(torch.bmm(P, A), P)
    return torch.bmm(M, X0)


def _grad(p):
    return p.grad if p.grad is not None else torch.zeros_like(p)


class MuonOptions(NamedTuple):
    """What a group's update does besides its lr, momentum and weight decay (constants of a compiled update's graph)."""
    nesterov: bool
    coefficients: tuple  # the Newton-Schulz steps' (a, b, c), newton_schulz_coefficients
    dtype: torch.dtype  # the orthogonalisation's, common.orthogonalization_dtype
    muoneq: bool
    muon_plus: bool
    cautious_wd: bool
    multipliers: tuple  # each matrix's (lr_mul, wd_mul)


def _update_matrices(params, grads, state, group, compiled=False):
    """
    Muon's update of same-shape matrices in place (one batched orthogonalisation): momentum, a Nesterov look-ahead,
    the nearest semi-orthogonal direction, scaled by sqrt(max(1, rows/cols)) so every shape moves comparably per
    element. `grads`: a list or a stacked tensor; `state`: the optimizer's. A group's options (off by default):
    normuon (_normuon_row_scales), cautious_wd (decay only where sign(u) == sign(p)), polar_express, muoneq (every row
    of the direction at one norm before orthogonalising, MuonEq) and muon_plus (the orthogonalised update at the
    Frobenius norm of an exactly semi-orthogonal matrix, sqrt(min(rows, cols)), Muon+). compiled: the arithmetic as
    one compiled graph per shape group (compile_muon_updates), lr, momentum and decay passed in as 0-d tensors.
    """
    normuon = bool(group.get("normuon"))
    for p in params:  # each matrix's state, made at its first step
        if "momentum_buffer" not in state[p]:
            state[p]["momentum_buffer"] = torch.zeros_like(p)
        if normuon and "row_second_moment" not in state[p]:
            state[p]["row_second_moment"] = torch.zeros(p.size(-2), 1, device=p.device, dtype=torch.float32)
    options = MuonOptions(nesterov=bool(group["nesterov"]),
                          coefficients=newton_schulz_coefficients(group["ns_steps"], bool(group.get("polar_express"))),
                          dtype=orthogonalization_dtype(params[0].device), muoneq=bool(group.get("muoneq")),
                          muon_plus=bool(group.get("muon_plus")), cautious_wd=bool(group.get("cautious_wd")),
                          multipliers=tuple((getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0)) for p in params))
    buffers = [state[p]["momentum_buffer"] for p in params]
    moments = [state[p]["row_second_moment"] for p in params] if normuon else None
    hyperparameters = group["lr"], group["momentum"], group["weight_decay"]
    if compiled:  # 0-d CPU tensors: a new lr or momentum every step is a new input to the same graph, not a new graph
        hyperparameters = [torch.tensor(float(value), dtype=torch.float32) for value in hyperparameters]
        group_key = (tuple(params[0].shape), len(params), isinstance(grads, torch.Tensor), options)
        update = _compiled_muon_arithmetic(compile_backend(), group_key)
        update(params, grads, buffers, moments, *hyperparameters, options)
    else:
        _muon_arithmetic(params, grads, buffers, moments, *hyperparameters, options)


def _muon_arithmetic(params, grads, buffers, moments, lr, momentum, weight_decay, options):
    """_update_matrices' arithmetic on a shape group, in place on params, buffers and moments (NorMuon's, or None).
    lr, momentum, weight_decay: floats (eager: torch's foreach ops take them as they are) or 0-d tensors (compiled:
    plain ops, which inductor fuses)."""
    grads = list(grads)
    _lerp_(buffers, grads, 1 - momentum)
    # Nesterov: step from where the momentum is about to take us, not from where it is.
    directions = _lerp(grads, buffers, momentum) if options.nesterov else buffers
    stacked = torch.stack(directions)
    if options.muoneq:  # rows of one size: the spectrum entering the iteration is better conditioned (the
        # orthogonalisation divides by the Frobenius norm, so the common size rows are set to does not matter)
        stacked = stacked / torch.linalg.vector_norm(stacked, dim=-1, keepdim=True).clamp_min(1e-6)
    updates = orthogonalize(stacked, dtype=options.dtype, coefficients=options.coefficients)
    if options.muon_plus:  # the iteration stops short of the polar factor: put the norm where the factor's is
        updates = updates * (min(updates.shape[-2:]) ** 0.5
                             / torch.linalg.vector_norm(updates, dim=(-2, -1), keepdim=True).clamp_min(1e-6))
    row_scales = _normuon_row_scales(updates, moments) if moments is not None else [None] * len(params)
    rows, cols = params[0].shape[-2:]
    shape_scale = max(1.0, rows / cols) ** 0.5
    if len(set(options.multipliers)) == 1 and not options.cautious_wd:
        # the whole list in a few launches, not two per matrix: on a GPU each launch costs the host ~5-10 us, and
        # the host has a hundred matrices' worth to queue at d24 (the same arithmetic as the loop below)
        lr_mul, wd_mul = options.multipliers[0]
        p_lr, p_wd = lr * lr_mul, weight_decay * wd_mul
        if not _is_zero(p_wd):
            torch._foreach_mul_(params, 1 - p_lr * p_wd)  # takes a float or a 0-d tensor alike
        if moments is not None:  # NorMuon's factors, on the stacked updates in one pass (a foreach op cannot
            updates = updates * row_scales  # broadcast them: per matrix it was one launch each, 144 at d24)
        _add_scaled_(params, list(updates.to(params[0].dtype).unbind(0)), -p_lr * shape_scale)
        return
    for p, u, row_scale, (lr_mul, wd_mul) in zip(params, updates, row_scales, options.multipliers):
        p_lr, p_wd = lr * lr_mul, weight_decay * wd_mul
        if options.cautious_wd and not _is_zero(p_wd):
            if row_scale is not None:
                u, row_scale = u * row_scale, None
            _add_scaled_([p], [p * (u * p > 0)], -p_lr * p_wd)
        elif not _is_zero(p_wd):
            p.mul_(1 - p_lr * p_wd)
        if row_scale is None:
            _add_scaled_([p], [u.to(p.dtype)], -p_lr * shape_scale)
        else:  # NorMuon's factors ride along in the update's one pass
            _addcmul_(p, u, row_scale, -p_lr * shape_scale)


@functools.cache
def _compiled_muon_arithmetic(backend, group_key):
    """_muon_arithmetic compiled for one shape group (static shapes; its casts, stacking and copies fused), on a copy
    of its code object: Dynamo keeps its graphs per code object, so the groups are not recompiles of one another
    (which TORCH_LOGS=recompiles would report, and its recompile limit, 8, would count and then refuse)."""
    arithmetic = types.FunctionType(_muon_arithmetic.__code__.replace(), _muon_arithmetic.__globals__,
                                    _muon_arithmetic.__name__)
    return torch.compile(arithmetic, dynamic=False, fullgraph=True, backend=backend)


# Eager, the hyperparameters are floats and the update runs torch's foreach ops with them as scalars; compiled, they
# are 0-d tensors, which those ops' scalar arguments do not take: the helpers below run either.


def _is_zero(value):
    """Whether a hyperparameter is known to be 0 here: a float that is; never a 0-d tensor (its value is data)."""
    return not isinstance(value, torch.Tensor) and value == 0


def _lerp_(tensors, ends, weight):
    """tensors[i].lerp_(ends[i], weight) for each: one foreach op for a float weight, per tensor for a 0-d tensor."""
    if isinstance(weight, torch.Tensor):
        for t, end in zip(tensors, ends):
            t.lerp_(end, weight)
    else:
        torch._foreach_lerp_(tensors, ends, weight)


def _lerp(starts, ends, weight):
    """[starts[i].lerp(ends[i], weight)], as _lerp_ without changing starts."""
    if isinstance(weight, torch.Tensor):
        return [start.lerp(end, weight) for start, end in zip(starts, ends)]
    return torch._foreach_lerp(starts, ends, weight)


def _add_scaled_(tensors, others, factor):
    """tensors[i] += factor * others[i]: a float rides as the ops' alpha (one rounding, as eager always did), a 0-d
    tensor multiplies first."""
    if isinstance(factor, torch.Tensor):
        torch._foreach_add_(tensors, torch._foreach_mul(others, factor))
    else:
        torch._foreach_add_(tensors, others, alpha=factor)


def _addcmul_(tensor, a, b, factor):
    """tensor += factor * a * b (one op for a float factor, as Tensor.addcmul_)."""
    if isinstance(factor, torch.Tensor):
        tensor.add_(a * b * factor)
    else:
        tensor.addcmul_(a, b, value=factor)


def _normuon_row_scales(updates, moments):
    """
    NorMuon for (n, rows, cols) updates, as an (n, rows, 1) factor: every row divided by the root of its running mean
    square (beta NORMUON_BETA2; `moments`, each matrix's (rows, 1) fp32, updated in place), each matrix then rescaled
    to its norm before. Both norms come from the rows' sums of squares, so the normalised update is never built (one
    pass over the updates instead of six).
    """
    row_sums = torch.linalg.vector_norm(updates, dim=-1, keepdim=True, dtype=torch.float32).square_()
    stacked = torch.stack(moments)
    stacked.lerp_(row_sums / updates.size(-1), 1 - NORMUON_BETA2)
    for m, new in zip(moments, stacked):
        m.copy_(new)
    factors = 1.0 / (stacked.sqrt() + 1e-10)
    norms = row_sums.sum(dim=(-2, -1), keepdim=True).sqrt()
    normalized_norms = (row_sums * factors.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return factors * (norms / (normalized_norms + 1e-10))


class Muon(torch.optim.Optimizer):
    """
    Single-process Muon: matrices of any shapes may share a group (same-shape ones are batched). Param groups:
    "params", "lr", "weight_decay", optional "momentum", "nesterov", "ns_steps", "initial_lr", "normuon",
    "cautious_wd", "polar_express", "muoneq", "muon_plus"; the loop may rewrite "lr" and "momentum" every step.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.compiled = False  # compile_muon_updates: each shape group's update as one compiled graph
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"{type(self).__name__} only takes 2-D matrices (got a parameter of shape "
                                     f"{tuple(p.shape)}); give vectors, scalars and embeddings to AdamW")

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            for params in by_shape.values():
                _update_matrices(params, [p.grad for p in params], self.state, group, self.compiled)


class DistMuon(Muon):
    """
    Muon with work and state sharded across ranks; every group holds matrices of one shape. A group of n matrices is
    padded to a multiple of the world size W: gradients are reduce-scattered (averaged), rank r updates (and keeps
    state for) the ceil(n / W) matrices from r * ceil(n / W), then the matrices are all-gathered. A grad of None
    counts as zero, so every rank takes part in every collective.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        super().__init__(params, lr, momentum, nesterov, ns_steps, weight_decay)
        first = next((p for group in self.param_groups for p in group["params"]), None)
        if first is not None:
            orthogonalization_dtype(first.device)  # a bad NANOCHAT_MUON_DTYPE fails here, not at the first step
        for group in self.param_groups:
            shapes = sorted({tuple(p.shape) for p in group["params"]})
            if len(shapes) > 1:
                raise ValueError(f"DistMuon needs one shape per param group (got {shapes}); split the group by shape")

    def owned_indices(self, group, rank=None, world=None):
        """Indices into group["params"] that this rank updates."""
        if rank is None:
            rank, world = dist_rank_world()
        per_rank = math.ceil(len(group["params"]) / world)
        return range(rank * per_rank, min((rank + 1) * per_rank, len(group["params"])))

    @torch.no_grad()
    def step(self):
        rank, world = dist_rank_world()
        if world == 1:
            for group in self.param_groups:
                if group["params"]:
                    _update_matrices(group["params"], [_grad(p) for p in group["params"]], self.state, group,
                                     self.compiled)
            return

        # 1) every group's reduce-scatter at once, so later groups communicate while earlier ones compute
        jobs = []
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            per_rank = math.ceil(len(params) / world)
            padding = per_rank * world - len(params)
            stacked = torch.stack([_grad(p) for p in params] + [torch.zeros_like(params[0])] * padding)
            my_grads = torch.empty_like(stacked[:per_rank])
            work = dist.reduce_scatter_tensor(my_grads, stacked, op=dist.ReduceOp.AVG, async_op=True)
            jobs.append((group, stacked, my_grads, work))

        # 2) as each group's gradients arrive, update this rank's matrices and gather them (into the stacked grads)
        gathers = []
        for group, stacked, my_grads, work in jobs:
            work.wait()
            params = group["params"]
            owned = list(self.owned_indices(group, rank, world))
            if owned:
                _update_matrices([params[i] for i in owned], my_grads[: len(owned)], self.state, group, self.compiled)
            for k, i in enumerate(owned):  # my_grads now carries this rank's updated matrices
                my_grads[k].copy_(params[i])
            my_grads[len(owned):].zero_()
            gathers.append((params, stacked, dist.all_gather_into_tensor(stacked, my_grads, async_op=True)))

        # 3) write the gathered matrices back (bitwise identical on every rank)
        for params, gathered, work in gathers:
            work.wait()
            torch._foreach_copy_(list(params), list(gathered[: len(params)].unbind(0)))

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        rank, world = dist_rank_world()
        for group in self.param_groups:
            owned = set(self.owned_indices(group, rank, world))
            for i, p in enumerate(group["params"]):
                if i not in owned and self.state.get(p):
                    raise UserError(f"Muon optimizer state holds matrices that rank {rank} of {world} does not own: "
                                    "it was saved with a different number of ranks; resume with the same world size")


def build_muon(muon_groups, momentum=0.95, ns_steps=5):
    """Muon for the model's matrix groups (one group per shape); correct with or without torchrun."""
    return DistMuon(muon_groups, momentum=momentum, ns_steps=ns_steps)


def compile_muon_updates(optimizers):
    """Run every Muon's update compiled, one graph per shape group (common.compile_backend's backend), as a compiled
    model's training does: eager, a GPU spends the update launching a few hundred small kernels (stacking copies,
    per-matrix NorMuon factors, the casts around Newton-Schulz) that the compiler fuses. Returns the optimizers."""
    for opt in optimizers:
        if isinstance(opt, Muon):
            opt.compiled = True
    return optimizers


# -----------------------------------------------------------------------------
# AdamW

FUSED = hasattr(torch, "_fused_adamw_")  # a module flag, so a test can run the unfused math beside it


def _is_sharded(p, world):
    return world > 1 and p.ndim >= 1 and p.shape[0] % world == 0


def _adamw_updates(params, grads, states, device_steps, group, lr_mul, wd_mul):
    """
    One AdamW step on each of `params` (whole parameters or this rank's slices, one dtype on one device), in place.
    `device_steps`: their step counts as 0-D fp32 tensors on the device for torch's fused kernel (the states keep them
    as ints, for checkpoints and the math below). Nothing reads the device from the host, so nothing waits.
    """
    for p, state in zip(params, states):
        if "step" not in state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
    beta1, beta2 = group["betas"]
    lr = group["lr"] * lr_mul
    wd = group["weight_decay"] * wd_mul
    exp_avgs, exp_avg_sqs = [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states]
    torch._foreach_add_(device_steps, 1.0)  # in step with the ints, whichever path runs below
    if FUSED and params[0].device.type in ("cpu", "cuda") and all(g.dtype == p.dtype for p, g in zip(params, grads)):
        # the math below in one pass over memory instead of seven, one launch for the list (on a CPU the separate
        # passes cost ~1.5 ms per million parameters); in fp32 whatever the parameters' dtype
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], device_steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=wd, eps=group["eps"], amsgrad=False, maximize=False)
        return
    for p, grad, exp_avg, exp_avg_sq, state in zip(params, grads, exp_avgs, exp_avg_sqs, states):
        if wd != 0:
            p.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** state["step"]
        bias_correction2 = 1 - beta2 ** state["step"]
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(group["eps"])
        p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class DistAdamW(torch.optim.Optimizer):
    """
    torch.optim.AdamW's math, sharded ZeRO-style along dim 0: each gradient is reduce-scattered (averaged), every rank
    updates and keeps moments for its slice only, then the slices are all-gathered; tensors whose dim 0 does not split
    evenly are all-reduced and updated whole. Param groups: "params", "lr", "betas", "eps", "weight_decay", optional
    "initial_lr". State per parameter: {"step", "exp_avg", "exp_avg_sq"} (this rank's slice; one file per rank).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.device_steps = {}  # parameter -> its step count on its device (_adamw_updates); rebuilt, never saved

    def device_step(self, p):
        """p's step count as a 0-D fp32 tensor on its device, made by a fill (not a copy from the host): nothing waits
        for the device even on the first step after a resume."""
        if p not in self.device_steps:
            self.device_steps[p] = torch.full((), float(self.state[p].get("step", 0)), dtype=torch.float32,
                                              device=p.device)
        return self.device_steps[p]

    @torch.no_grad()
    def step(self):
        rank, world = dist_rank_world()
        if world == 1:
            # every parameter of a group that shares a dtype and multipliers in one fused launch
            for group in self.param_groups:
                batches = {}
                for p in group["params"]:
                    key = (p.dtype, p.device, getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0))
                    batches.setdefault(key, []).append(p)
                for (_, _, lr_mul, wd_mul), params in batches.items():
                    _adamw_updates(params, [_grad(p) for p in params], [self.state[p] for p in params],
                                   [self.device_step(p) for p in params], group, lr_mul, wd_mul)
            return

        # 1) every gradient's reduction at once, so communication overlaps the updates below
        jobs = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = _grad(p)
                if _is_sharded(p, world):
                    reduced = torch.empty_like(grad[:p.shape[0] // world])
                    work = dist.reduce_scatter_tensor(reduced, grad.contiguous(), op=dist.ReduceOp.AVG, async_op=True)
                else:
                    reduced = grad.clone()  # reduce a copy: p.grad stays what backward wrote
                    work = dist.all_reduce(reduced, op=dist.ReduceOp.AVG, async_op=True)
                jobs.append((group, p, reduced, work))

        # 2) update this rank's slice as its gradient arrives, then gather the slices
        gathers = []
        for group, p, grad, work in jobs:
            work.wait()
            lr_mul, wd_mul = getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0)
            if _is_sharded(p, world):
                rows = p.shape[0] // world
                full = p.data if p.is_contiguous() else p.data.contiguous()
                my_slice = full[rank * rows:(rank + 1) * rows]
                _adamw_updates([my_slice], [grad], [self.state[p]], [self.device_step(p)], group, lr_mul, wd_mul)
                gathers.append((p, full, dist.all_gather_into_tensor(full, my_slice, async_op=True)))
            else:
                _adamw_updates([p.data], [grad], [self.state[p]], [self.device_step(p)], group, lr_mul, wd_mul)

        for p, full, work in gathers:
            work.wait()
            if full.data_ptr() != p.data_ptr():
                p.data.copy_(full)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.device_steps = {}  # the loaded counts replace them
        rank, world = dist_rank_world()
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                expected = (p.shape[0] // world, *p.shape[1:]) if _is_sharded(p, world) else tuple(p.shape)
                if tuple(st["exp_avg"].shape) != expected:
                    raise UserError(f"AdamW optimizer state on rank {rank} has a slice of shape "
                                    f"{tuple(st['exp_avg'].shape)} where {expected} was expected: it was saved with a "
                                    "different number of ranks; resume with the same world size")


def build_adamw(adamw_groups):
    """AdamW for the model's embedding / lm_head / scalar groups; correct with or without torchrun."""
    return DistAdamW(adamw_groups)


# -----------------------------------------------------------------------------
# Schedules and one update of both optimizers


def lr_multiplier(step, num_iterations, warmup_ratio=0.0, warmdown_ratio=0.4, final_lr_frac=0.0):
    """Linear warmup, constant, then linear warmdown to final_lr_frac over the last warmdown_ratio of steps."""
    warmup = round(warmup_ratio * num_iterations)
    warmdown = round(warmdown_ratio * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step <= num_iterations - warmdown:
        return 1.0
    progress = (num_iterations - step) / max(1, warmdown)
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step, start=0.85, end=0.95, warmup_steps=300):
    frac = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - frac) * start + frac * end


def apply_schedules(optimizers, lrm, momentum=None):
    """Every group's lr from its initial_lr, and Muon's momentum. Not weight decay: the optimizers multiply it by the
    scheduled lr already (scaling it here too would make it follow the square of the schedule)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if "momentum" in group and momentum is not None:
                group["momentum"] = momentum


def step_optimizers(optimizers, lrm, momentum, grad_clip=0.0):
    """One update of every optimizer at the scheduled lr and Muon momentum, the gradients clipped to grad_clip's norm
    first (0: not clipped), then the gradients dropped for the next step's backward passes."""
    if grad_clip > 0:
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    apply_schedules(optimizers, lrm, momentum=momentum)
    for opt in optimizers:
        opt.step()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
