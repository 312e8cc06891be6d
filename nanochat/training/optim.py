"""
The optimizers, both sharded across ranks: Muon for the 2-D weight matrices of the transformer blocks, AdamW for
everything Muon does not take (embeddings, the lm_head, vectors and scalars).

Gradient convention for both: each rank computes the mean loss over its own equal share of the global batch, and
gradients are averaged across ranks, which equals the gradient of the mean loss over the whole global batch. With no
process group (or one rank) each is its plain single-process self.

Muon. Each step keeps a momentum buffer per matrix, takes a Nesterov look-ahead, replaces the resulting direction by
its nearest semi-orthogonal matrix (all singular values pushed to ~1, computed with a quintic Newton-Schulz
iteration) and moves the weights along it. The step is scaled by sqrt(max(1, rows/cols)) so tall and wide matrices
move by a comparable amount per element, and weight decay is decoupled (p <- p * (1 - lr * weight_decay), the same
convention as torch.optim.AdamW, so decay already follows the lr schedule). `Muon` is the single-process version.
`DistMuon` splits every group of same-shape matrices across ranks: gradients are reduce-scattered (averaged), each
rank updates only the matrices it owns and keeps momentum only for those, then the updated matrices are
all-gathered.

Muon's param groups: {"params": [...], "lr", "weight_decay", optional "momentum", "nesterov", "ns_steps",
"initial_lr", "normuon", "cautious_wd", "polar_express"}; the loop may rewrite "lr" and "momentum" every step. Three
options from the reference project's later recipe, off unless a group sets them:

    normuon      each row (output unit) of the orthogonalised update is divided by the root of a running
                 mean of its squares (beta NORMUON_BETA2), then the whole update is rescaled to its old norm,
                 so every unit moves by a similar amount
    cautious_wd  weight decay only where the update already pushes the weight toward zero (sign(u) == sign(p))
    polar_express  each Newton-Schulz step uses its own quintic, the minimax one for where the singular values
                 are at that step (polar_express_coefficients), instead of one fixed quintic for all five
A parameter may carry attributes `lr_mul` / `wd_mul` (default 1.0) that scale its lr / decay.

AdamW. `DistAdamW` is AdamW with decoupled weight decay and bias correction (the same math as
torch.optim.AdamW), sharded across ranks ZeRO-style: each gradient is reduce-scattered
(averaged) along dim 0, every rank updates only its slice of the parameter and keeps the
moment estimates only for that slice, then the slices are all-gathered back into the full
parameter. Tensors whose dim 0 does not split evenly across ranks (scalars, odd sizes) are
all-reduced instead and updated whole on every rank. With no process group (or one rank) it
is plain AdamW.

Param groups: {"params": [...], "lr", "betas", "eps", "weight_decay", optional "initial_lr"}.
A parameter may carry attributes `lr_mul` / `wd_mul` (default 1.0) that scale its lr / decay.
State per parameter: {"step": int, "exp_avg": tensor, "exp_avg_sq": tensor}, where the tensors
are this rank's slice; a checkpoint holds one optimizer file per rank.

At the end, what a training step does with both: the schedules (lr_multiplier, muon_momentum) set on their groups, and
one update of every optimizer (step_optimizers).
"""

import functools
import math

import numpy as np
import torch
import torch.distributed as dist

from nanochat.common import UserError, dist_rank_world, orthogonalization_dtype

# -----------------------------------------------------------------------------
# Muon

# Quintic iteration X <- a*X + b*(X X^T) X + c*(X X^T)^2 X. These coefficients trade exact
# convergence for speed: the slope at 0 is large (a), so small singular values grow fast, and
# after ~5 steps every singular value sits in roughly [0.7, 1.2] rather than exactly at 1,
# which is all the optimizer needs.
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NORMUON_BETA2 = 0.95


@functools.cache
def polar_express_coefficients(steps, lower=1e-3, safety=1.01):
    """
    One odd quintic p_k(x) = a x + b x^3 + c x^5 per step, chosen greedily (the Polar Express idea, Amsel et al. 2025):
    the singular values start in [lower, 1] after the Frobenius normalisation; step k takes the p_k that is closest to
    1 in the worst case over where they are now (minimax, by Remez exchange), which puts them in [1 - e_k, 1 + e_k]
    for the next step. Each interval's top is widened by `safety` so rounding just above it stays in the fitted range.
    From [1e-3, 1] five steps end in about [0.89, 1.11]; the fixed quintic of NS_COEFFS ends in about [0.47, 1.20].
    """
    lo, hi, coefficients = lower, 1.0, []
    for _ in range(steps):
        (a, b, c), error = _minimax_odd_quintic(lo, hi * safety)
        coefficients.append((a, b, c))
        lo, hi = 1 - error, 1 + error
    return tuple(coefficients)


def _minimax_odd_quintic(lo, hi, rounds=50):
    """(a, b, c) minimising max |1 - (a x + b x^3 + c x^5)| over [lo, hi], and that error. Remez exchange: the error of
    the best such quintic alternates in sign at 4 points (the two ends and two interior extremes); solve for the
    quintic that alternates with equal size on the current 4 points, move them to the error's extremes, repeat."""
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


def orthogonalize(G, steps=5, dtype=None, polar_express=False):
    """
    Approximate the orthogonal polar factor U V^T of G (shape (..., rows, cols)) by Newton-Schulz, with the fixed
    quintic NS_COEFFS at every step or (polar_express) the per-step ones of polar_express_coefficients.
    Runs in bf16 where the hardware multiplies bf16 natively and in fp32 elsewhere
    (common.orthogonalization_dtype). Returns a tensor of G's dtype.
    """
    coefficients = polar_express_coefficients(steps) if polar_express else (NS_COEFFS,) * steps
    if G.ndim < 2:
        raise ValueError(f"orthogonalize needs a matrix (got shape {tuple(G.shape)})")
    if dtype is None:
        dtype = orthogonalization_dtype(G.device)
    X = G.to(dtype)
    # Work on the wide orientation so the Gram matrix X X^T is the small one.
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    # The Frobenius norm bounds the spectral norm from above, so after this every singular
    # value is <= 1, inside the region where the iteration converges.
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    batch_shape, (rows, cols) = X.shape[:-2], X.shape[-2:]
    X = X.reshape(-1, rows, cols)  # one batch dimension, as bmm wants
    # Same iteration either way; the Gram form does fewer FLOPs when cols > 1.5 rows, but it lets
    # rounding errors build up in A, which is fine in fp32 and not trusted in bf16.
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
    The same iteration carried out on rows x rows matrices only. Every X_k equals M_k X0 for a
    rows x rows M_k, and with P_k = a I + b A_k + c A_k^2:

        X_{k+1} = P_k X_k    =>   M_{k+1} = P_k M_k,    A_{k+1} = X_{k+1} X_{k+1}^T = P_k A_k P_k

    so the wide X0 (rows x cols) is touched only twice, for A_0 = X0 X0^T and for the final M X0:
    4 rows^2 cols + 34 rows^3 FLOPs for 5 steps, against 20 rows^2 cols + 10 rows^3 (44 % fewer
    for the MLP's 1:4 matrices).
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


def _update_matrices(params, grads, state, group):
    """
    Muon update for a list of same-shape matrices, in place. `grads` is a list (or a stacked
    tensor) of their gradients; `state` is the optimizer's per-parameter state dict.
    The orthogonalisation of the whole list runs as one batched call.
    """
    momentum = group["momentum"]
    grads = list(grads)
    for p in params:
        if "momentum_buffer" not in state[p]:
            state[p]["momentum_buffer"] = torch.zeros_like(p)
    buffers = [state[p]["momentum_buffer"] for p in params]
    torch._foreach_lerp_(buffers, grads, 1 - momentum)
    # Nesterov: step from where the momentum is about to take us, not from where it is.
    directions = torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
    updates = orthogonalize(torch.stack(directions), steps=group["ns_steps"], polar_express=group.get("polar_express", False))
    row_scales = _normuon_row_scales(updates, params, state) if group.get("normuon") else [None] * len(params)
    rows, cols = params[0].shape[-2:]
    shape_scale = max(1.0, rows / cols) ** 0.5
    multipliers = {(getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0)) for p in params}
    if len(multipliers) == 1 and not group.get("cautious_wd"):
        # the whole list in a few launches, not two per matrix: on a GPU each launch costs the host ~5-10 us, and
        # the host has a hundred matrices' worth to queue at d24 (the same arithmetic as the loop below)
        (lr_mul, wd_mul), = multipliers
        lr, wd = group["lr"] * lr_mul, group["weight_decay"] * wd_mul
        if wd != 0:
            torch._foreach_mul_(params, 1 - lr * wd)
        if row_scales[0] is not None:  # NorMuon's factors, on the stacked updates in one pass (a foreach op cannot
            updates.mul_(row_scales)  # broadcast them: per matrix it was one launch each, 144 at d24)
        torch._foreach_add_(params, list(updates.to(params[0].dtype).unbind(0)), alpha=-lr * shape_scale)
        return
    for p, u, row_scale in zip(params, updates, row_scales):
        lr = group["lr"] * getattr(p, "lr_mul", 1.0)
        wd = group["weight_decay"] * getattr(p, "wd_mul", 1.0)
        if wd != 0 and group.get("cautious_wd"):
            if row_scale is not None:
                u, row_scale = u * row_scale, None
            p.sub_(p * (u * p > 0), alpha=lr * wd)
        elif wd != 0:
            p.mul_(1 - lr * wd)
        if row_scale is None:
            p.add_(u.to(p.dtype), alpha=-lr * shape_scale)
        else:  # NorMuon's factors ride along in the update's one pass
            p.addcmul_(u, row_scale, value=-lr * shape_scale)


def _normuon_row_scales(updates, params, state):
    """
    NorMuon for (n, rows, cols) updates, as an (n, rows, 1) factor to multiply them by: every row divided by the root
    of its running mean square, each matrix then rescaled to its norm before (the running means live in the optimizer
    state, one (rows, 1) per matrix). Both norms come from the rows' sums of squares, so the normalised update is
    never built: one pass over the updates, where building it took six.
    """
    for p in params:
        if "row_second_moment" not in state[p]:
            state[p]["row_second_moment"] = torch.zeros(p.size(-2), 1, device=p.device, dtype=torch.float32)
    row_sums = torch.linalg.vector_norm(updates, dim=-1, keepdim=True, dtype=torch.float32).square_()
    moments = torch.stack([state[p]["row_second_moment"] for p in params])
    moments.lerp_(row_sums / updates.size(-1), 1 - NORMUON_BETA2)
    for p, m in zip(params, moments):
        state[p]["row_second_moment"].copy_(m)
    factors = 1.0 / (moments.sqrt() + 1e-10)
    norms = row_sums.sum(dim=(-2, -1), keepdim=True).sqrt()
    normalized_norms = (row_sums * factors.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return factors * (norms / (normalized_norms + 1e-10))


def _check_matrices(param_groups, name):
    for group in param_groups:
        for p in group["params"]:
            if p.ndim != 2:
                raise ValueError(f"{name} only takes 2-D matrices (got a parameter of shape {tuple(p.shape)}); "
                                 "give vectors, scalars and embeddings to AdamW")


class Muon(torch.optim.Optimizer):
    """Single-process Muon. Matrices of any shapes may share a group; same-shape ones are batched."""

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        _check_matrices(self.param_groups, "Muon")

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            by_shape = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_shape.setdefault(p.shape, []).append(p)
            for params in by_shape.values():
                _update_matrices(params, [p.grad for p in params], self.state, group)


class DistMuon(torch.optim.Optimizer):
    """
    Muon with work and state sharded across ranks. Every group must hold matrices of one shape.
    A group of n matrices is padded to a multiple of the world size W; rank r owns the
    contiguous block of ceil(n / W) matrices starting at r * ceil(n / W) and keeps momentum
    (and saves state) only for those. A parameter whose grad is None counts as a zero gradient,
    so every rank always takes part in every collective.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, weight_decay=0.0):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        _check_matrices(self.param_groups, "DistMuon")
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
                params = group["params"]
                if params:
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                    _update_matrices(params, grads, self.state, group)
            return

        # 1) Start every group's reduce-scatter at once, so later groups communicate while
        #    earlier ones compute.
        jobs = []
        for group in self.param_groups:
            params = group["params"]
            if not params:
                continue
            per_rank = math.ceil(len(params) / world)
            padding = per_rank * world - len(params)
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            stacked = torch.stack(grads + [torch.zeros_like(params[0])] * padding)
            my_grads = torch.empty_like(stacked[:per_rank])
            work = dist.reduce_scatter_tensor(my_grads, stacked, op=dist.ReduceOp.AVG, async_op=True)
            jobs.append((group, per_rank, stacked, my_grads, work))

        # 2) As each group's gradients arrive: update the matrices this rank owns, then start
        #    gathering everyone's updated matrices (into the stacked-gradient buffer, now free).
        gathers = []
        for group, per_rank, stacked, my_grads, work in jobs:
            work.wait()
            params = group["params"]
            owned = list(self.owned_indices(group, rank, world))
            if owned:
                _update_matrices([params[i] for i in owned], my_grads[: len(owned)], self.state, group)
            mine = my_grads  # reuse this buffer too: it now carries this rank's updated matrices
            for k in range(per_rank):
                if k < len(owned):
                    mine[k].copy_(params[owned[k]])
                else:
                    mine[k].zero_()
            gathers.append((params, stacked, dist.all_gather_into_tensor(stacked, mine, async_op=True)))

        # 3) Write the gathered matrices back (bitwise identical on every rank).
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


# -----------------------------------------------------------------------------
# AdamW

FUSED = hasattr(torch, "_fused_adamw_")  # a module flag, so a test can run the unfused math beside it


def _is_sharded(p, world):
    return world > 1 and p.ndim >= 1 and p.shape[0] % world == 0


def _adamw_updates(params, grads, states, device_steps, group, lr_mul, wd_mul):
    """
    One AdamW step on each of `params` (full parameters or this rank's slices of them, one dtype on one device), in
    place. `states` are their optimizer states; `device_steps` their step counts as 0-D fp32 tensors on the device,
    which torch's fused kernel reads (the states keep the same counts as ints, for checkpoints and for the math below).
    Nothing here reads the device from the host, so the host can queue the whole optimizer step without waiting.
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
        # torch's fused kernel: the math below in one pass over memory instead of seven, for every parameter of the
        # list in one launch (on a CPU the separate passes cost ~1.5 ms per million parameters). In fp32 whatever the
        # parameters' dtype (the bf16 embedding tables). It reads the step counts and leaves them alone.
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], device_steps, lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=wd, eps=group["eps"], amsgrad=False, maximize=False)
        return
    for p, grad, exp_avg, exp_avg_sq, state in zip(params, grads, exp_avgs, exp_avg_sqs, states):
        if wd != 0:
            p.mul_(1 - lr * wd)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        # Bias correction: early in training the moment estimates are biased towards their zero init.
        bias_correction1 = 1 - beta1 ** state["step"]
        bias_correction2 = 1 - beta2 ** state["step"]
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(group["eps"])
        p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class DistAdamW(torch.optim.Optimizer):
    """AdamW whose state and update are sharded along dim 0 across ranks; plain AdamW on one rank."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.device_steps = {}  # parameter -> its step count on its device (_adamw_updates); rebuilt, never saved

    def device_step(self, p, like):
        """p's step count as a 0-D fp32 tensor on `like`'s device. Made by a fill with the count as the kernel's
        argument, not a copy from the host: nothing waits for the device even on the first step after a resume."""
        if p not in self.device_steps:
            self.device_steps[p] = torch.full((), float(self.state[p].get("step", 0)), dtype=torch.float32,
                                              device=like.device)
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
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                    _adamw_updates(params, grads, [self.state[p] for p in params],
                                   [self.device_step(p, p) for p in params], group, lr_mul, wd_mul)
            return

        # 1) Start every gradient's reduction at once so communication overlaps the updates below.
        jobs = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if _is_sharded(p, world):
                    rows = p.shape[0] // world
                    my_grad = torch.empty_like(grad[:rows])
                    work = dist.reduce_scatter_tensor(my_grad, grad.contiguous(), op=dist.ReduceOp.AVG, async_op=True)
                    jobs.append((group, p, my_grad, work))
                else:
                    full_grad = grad.clone()  # reduce a copy: p.grad stays what backward wrote
                    work = dist.all_reduce(full_grad, op=dist.ReduceOp.AVG, async_op=True)
                    jobs.append((group, p, full_grad, work))

        # 2) Update this rank's slice as its gradient arrives, then start gathering the slices.
        gathers = []
        for group, p, grad, work in jobs:
            work.wait()
            lr_mul, wd_mul = getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0)
            if _is_sharded(p, world):
                rows = p.shape[0] // world
                full = p.data if p.is_contiguous() else p.data.contiguous()
                my_slice = full[rank * rows:(rank + 1) * rows]
                _adamw_updates([my_slice], [grad], [self.state[p]], [self.device_step(p, p)], group, lr_mul, wd_mul)
                gathers.append((p, full, dist.all_gather_into_tensor(full, my_slice, async_op=True)))
            else:
                _adamw_updates([p.data], [grad], [self.state[p]], [self.device_step(p, p)], group, lr_mul, wd_mul)

        # 3) Wait for the gathers; the parameter is now identical on every rank.
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
    return progress * 1.0 + (1 - progress) * final_lr_frac


def muon_momentum(step, start=0.85, end=0.95, warmup_steps=300):
    frac = min(step / warmup_steps, 1.0) if warmup_steps > 0 else 1.0
    return (1 - frac) * start + frac * end


def apply_schedules(optimizers, lrm, momentum=None):
    """
    Scale every group's lr from its initial_lr and set Muon's momentum. Weight decay is not scheduled here:
    the optimizers apply it as p *= 1 - lr * weight_decay with the scheduled lr, so decay already follows the
    lr schedule once (scaling weight_decay by the multiplier too would make it follow the square of it).
    """
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
