"""
AdamW for everything Muon does not take: embeddings, the lm_head, vectors and scalars.

`DistAdamW` is AdamW with decoupled weight decay and bias correction (the same math as
torch.optim.AdamW), sharded across ranks ZeRO-style: each gradient is reduce-scattered
(averaged) along dim 0, every rank updates only its slice of the parameter and keeps the
moment estimates only for that slice, then the slices are all-gathered back into the full
parameter. Tensors whose dim 0 does not split evenly across ranks (scalars, odd sizes) are
all-reduced instead and updated whole on every rank. With no process group (or one rank) it
is plain AdamW.

Gradient convention: each rank computes the mean loss over its own equal share of the global
batch and gradients are averaged across ranks, which equals the gradient of the mean loss over
the whole global batch.

Param groups: {"params": [...], "lr", "betas", "eps", "weight_decay", optional "initial_lr"}.
A parameter may carry attributes `lr_mul` / `wd_mul` (default 1.0) that scale its lr / decay.
State per parameter: {"step": int, "exp_avg": tensor, "exp_avg_sq": tensor}, where the tensors
are this rank's slice; a checkpoint holds one optimizer file per rank.
"""

import torch
import torch.distributed as dist

from nanochat.common import UserError, dist_rank_world


FUSED = hasattr(torch, "_fused_adamw_")  # a module flag, so a test can run the unfused math beside it


def _is_sharded(p, world):
    return world > 1 and p.ndim >= 1 and p.shape[0] % world == 0


def _adamw_update(p, grad, state, group, lr_mul, wd_mul):
    """One AdamW step on p (a full parameter or this rank's slice of one), in place."""
    if "step" not in state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    state["step"] += 1
    step = state["step"]
    beta1, beta2 = group["betas"]
    lr = group["lr"] * lr_mul
    wd = group["weight_decay"] * wd_mul
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    if FUSED and p.device.type in ("cpu", "cuda") and grad.dtype == p.dtype:
        # torch's fused kernel: the same math as below in one pass over memory instead of seven (on a CPU the
        # separate passes cost ~1.5 ms per million parameters, the d4 value embeddings' tables are two million).
        # It reads the step from a tensor and leaves it alone; the state keeps the int.
        torch._fused_adamw_([p], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step), device=p.device)],
                            lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=group["eps"], amsgrad=False,
                            maximize=False)
        return
    if wd != 0:
        p.mul_(1 - lr * wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    # Bias correction: early in training the moment estimates are biased towards their zero init.
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(group["eps"])
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


class DistAdamW(torch.optim.Optimizer):
    """AdamW whose state and update are sharded along dim 0 across ranks; plain AdamW on one rank."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self):
        rank, world = dist_rank_world()

        # 1) Start every gradient's reduction at once so communication overlaps the updates below.
        jobs = []
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                if world == 1:
                    jobs.append((group, p, grad, None))
                elif _is_sharded(p, world):
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
            if work is not None:
                work.wait()
            lr_mul, wd_mul = getattr(p, "lr_mul", 1.0), getattr(p, "wd_mul", 1.0)
            if _is_sharded(p, world):
                rows = p.shape[0] // world
                full = p.data if p.is_contiguous() else p.data.contiguous()
                my_slice = full[rank * rows:(rank + 1) * rows]
                _adamw_update(my_slice, grad, self.state[p], group, lr_mul, wd_mul)
                gathers.append((p, full, dist.all_gather_into_tensor(full, my_slice, async_op=True)))
            else:
                _adamw_update(p.data, grad, self.state[p], group, lr_mul, wd_mul)

        # 3) Wait for the gathers; the parameter is now identical on every rank.
        for p, full, work in gathers:
            work.wait()
            if full.data_ptr() != p.data_ptr():
                p.data.copy_(full)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
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
