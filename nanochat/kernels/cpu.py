"""
Hand-written autograd Functions for running the GPT on a CPU: gpt.py's math in fewer passes over memory, which bounds
a CPU step's elementwise work (measurements: dev/LOG.md), and the swap that attaches them to a built model
(`use_cpu_kernels(model, device)`, at the end). The swap makes gpt.py's modules their Cpu* subclasses below, which
decide where the Functions run: CPU fp32 tensors outside autocast (`is_cpu_fp32`), the chunked loss and the
block-causal attention also under CPU autocast, for training only (`cpu_training`); elsewhere gpt.py's plain math.
NANOCHAT_CPU_OPS=0 leaves the model unswapped, so the GPU's plain path runs on a CPU too. tests/test_gpt.py checks each
Function against the plain math, tests/test_recipe_components.py the swapped model against the plain one.
"""

import os

import torch
import torch.nn as nn

from nanochat import gpt
from nanochat.common import UserError


def _rotate(x, cos, sin, out):
    """out = x rotated by the angles whose cos/sin are given (pass -sin for the inverse rotation)."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    out1, out2 = out[..., :d], out[..., d:]
    torch.mul(x1, cos, out=out1).addcmul_(x2, sin)  # x1 cos + x2 sin
    torch.mul(x2, cos, out=out2).addcmul_(x1, sin, value=-1.0)  # x2 cos - x1 sin
    return out


class _RMSNorm(torch.autograd.Function):
    """y = x * r with r = (mean(x^2) + eps)^-1/2 per row;  dx = r * g - x * r^3 * mean(g * x)."""

    @staticmethod
    def forward(ctx, x, eps):
        inv_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.size(-1)).add_(eps).rsqrt_()
        ctx.save_for_backward(x, inv_rms)
        return x * inv_rms

    @staticmethod
    def backward(ctx, grad):
        x, inv_rms = ctx.saved_tensors
        mean_gx = torch.linalg.vecdot(grad, x, dim=-1).unsqueeze(-1).div_(x.size(-1))
        grad_x = grad * inv_rms
        return grad_x.addcmul_(x, inv_rms.pow(3).mul_(mean_gx), value=-1.0), None


class _RotaryNorm(torch.autograd.Function):
    """y = R(x) * r: rotation R by position, then RMSNorm; a rotation keeps lengths, so r = (mean(x^2) + eps)^-1/2 comes
    from x. The output is written into a (B, H, T, D) buffer, saving attention a transposing copy. With m = mean(g * y):
    dx = R^T(r * (g - y * m)) = r * R^T(g) - x * r^2 * m, R^T the rotation by -theta."""

    @staticmethod
    def forward(ctx, x, cos, sin, eps):
        B, T, H, D = x.shape
        inv_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(D).add_(eps).rsqrt_()
        y = _rotate(x, cos, sin, out=x.new_empty(B, H, T, D).transpose(1, 2)).mul_(inv_rms)
        ctx.save_for_backward(x, cos, sin, inv_rms, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, cos, sin, inv_rms, y = ctx.saved_tensors
        mean_gy = torch.linalg.vecdot(grad, y, dim=-1).unsqueeze(-1).div_(x.size(-1))
        grad_x = _rotate(grad, cos, -sin, out=torch.empty_like(x)).mul_(inv_rms)
        return grad_x.addcmul_(x, inv_rms.square().mul_(mean_gy), value=-1.0), None, None, None


class _ReluSquaredMLP(torch.autograd.Function):
    """The whole MLP, out = relu(x W1^T)^2 W2^T, so that its two elementwise passes over the (N, 4C) hidden activation
    run in place (a fresh tensor per pass lands on cold memory): relu overwrites the matmul output, and in backward the
    2 of d(r^2) = 2 r dr rides in the matmul (alpha) and the relu mask comes from multiplying by r. Saves r and r^2."""

    @staticmethod
    def forward(ctx, x, w_fc, w_proj):
        x2d = x.reshape(-1, x.size(-1))
        r = torch.mm(x2d, w_fc.t()).relu_()
        hidden = r * r
        ctx.save_for_backward(x2d, w_fc, w_proj, r, hidden)
        return torch.mm(hidden, w_proj.t()).view(*x.shape[:-1], w_proj.size(0))

    @staticmethod
    def backward(ctx, grad):
        x2d, w_fc, w_proj, r, hidden = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.size(-1))
        grad_w_proj = torch.mm(grad2d.t(), hidden)
        grad_r = torch.addmm(r, grad2d, w_proj, beta=0, alpha=2.0).mul_(r)  # beta=0: r only lends its shape
        grad_w_fc = torch.mm(grad_r.t(), x2d)
        grad_x = torch.mm(grad_r, w_fc).view(grad.shape[:-1] + (w_fc.size(1),))
        return grad_x, grad_w_fc, grad_w_proj


ATTENTION_BLOCK = 128  # query rows per block in the CPU training attention below


class _BlockCausalAttention(torch.autograd.Function):
    """
    Causal softmax(q k^T / sqrt(D)) v for CPU training, by blocks of ATTENTION_BLOCK queries: block i attends to keys
    [0, end_i) only (the lower triangle plus the diagonal blocks), each product one large bmm; with a sliding window
    (query t sees keys (t - window, t]) the blocks left of the band are skipped too. The probabilities are kept for
    backward. Needs n_kv_head == n_head. In bf16 the products run in bf16 (rounded: CPU matmuls have no fp32 output for
    bf16 inputs) and the softmax, its probabilities and the score gradients in fp32.

        dV += P^T dO     dP = dO V^T     dS = P * (dP - rowsum(dO * O))     dQ = dS K / sqrt(D)     dK += dS^T Q / sqrt(D)
    """

    @staticmethod
    def forward(ctx, q, k, v, window):
        B, H, T, D = q.shape
        scale = D ** -0.5
        q3, k3, v3 = (t.reshape(B * H, T, D) for t in (q, k, v))
        out = torch.empty_like(q3)
        low = q.dtype  # the products' dtype; .float() / .to(low) below are no-ops in fp32
        future = torch.ones(ATTENTION_BLOCK, ATTENTION_BLOCK, dtype=torch.bool, device=q.device).triu_(1)
        probs = []
        for start in range(0, T, ATTENTION_BLOCK):
            end = min(start + ATTENTION_BLOCK, T)
            first = max(0, start - window + 1)  # the lowest key any query of this block sees
            scores = torch.bmm(q3[:, start:end], k3[:, first:end].mT).float().mul_(scale)
            if window >= end:  # no query here reaches past its window: only the diagonal block has future keys
                scores[:, :, start - first:].masked_fill_(future[:end - start, :end - start], float("-inf"))
            else:  # ATTENTION_BLOCK x (ATTENTION_BLOCK + window) at most
                query_pos = torch.arange(start, end, device=q.device)[:, None]
                key_pos = torch.arange(first, end, device=q.device)[None, :]
                scores.masked_fill_((key_pos > query_pos) | (key_pos <= query_pos - window), float("-inf"))
            p = torch.softmax(scores, dim=-1)
            torch.bmm(p.to(low), v3[:, first:end], out=out[:, start:end])
            probs.append(p)
        ctx.window = window
        ctx.save_for_backward(q3, k3, v3, out, *probs)
        return out.view(B, H, T, D)

    @staticmethod
    def backward(ctx, grad):
        q3, k3, v3, out, *probs = ctx.saved_tensors
        B, H, T, D = grad.shape
        scale = D ** -0.5
        grad3 = grad.reshape(B * H, T, D)
        grad_q = torch.empty_like(q3)
        low = grad3.dtype
        row_dot = torch.linalg.vecdot(grad3.float(), out.float()).unsqueeze(-1)  # rowsum(dP * P) = rowsum(dO * O)
        # Last block first: without a window it reaches every key, so it creates grad_k / grad_v whole; the earlier
        # blocks add into a prefix. (baddbmm_ into a prefix slice would fall back to one small matmul per batch entry.)
        grad_k = grad_v = None
        for i in reversed(range(len(probs))):
            start = i * ATTENTION_BLOCK
            end = min(start + ATTENTION_BLOCK, T)
            first = max(0, start - ctx.window + 1)
            p, grad_out = probs[i], grad3[:, start:end]
            grad_scores = torch.bmm(grad_out, v3[:, first:end].mT).float().sub_(row_dot[:, start:end]).mul_(p).to(low)
            p = p.to(low)
            torch.bmm(grad_scores, k3[:, first:end], out=grad_q[:, start:end]).mul_(scale)
            if grad_k is None and first == 0:
                grad_v = torch.bmm(p.mT, grad_out)
                grad_k = torch.bmm(grad_scores.mT, q3[:, start:end]).mul_(scale)
                continue
            if grad_k is None:
                grad_k, grad_v = torch.zeros_like(k3), torch.zeros_like(v3)
            grad_v[:, first:end] += torch.bmm(p.mT, grad_out)
            grad_k[:, first:end].add_(torch.bmm(grad_scores.mT, q3[:, start:end]), alpha=scale)
        return grad_q.view(B, H, T, D), grad_k.view(B, H, T, D), grad_v.view(B, H, T, D), None


class _GatedAdd(torch.autograd.Function):
    """out = v + scale * sigmoid(logits) * ve for (B, T, H, D) v, ve and (B, T, H) logits, in one pass where autograd
    takes two; d(ve) = grad * gate, d(logits) = rowsum(grad * ve) * gate (1 - gate / scale), d(v) = grad."""

    @staticmethod
    def forward(ctx, v, ve, logits, scale):
        gate = torch.sigmoid(logits).mul_(scale)
        ctx.scale = scale
        ctx.save_for_backward(ve, gate)
        return torch.addcmul(v, gate.unsqueeze(-1), ve)

    @staticmethod
    def backward(ctx, grad):
        ve, gate = ctx.saved_tensors
        grad_logits = torch.linalg.vecdot(grad, ve, dim=-1).mul_(gate).mul_(1 - gate / ctx.scale)
        return grad, grad * gate.unsqueeze(-1), grad_logits, None


class _ResidualMix(torch.autograd.Function):
    """out = a * x + b * x0 with 0-dim a, b, in two passes where autograd takes three; da = <grad, x>, db = <grad, x0>
    as dot products, without autograd's two (N, C) temporaries."""

    @staticmethod
    def forward(ctx, x, x0, a, b):
        ctx.save_for_backward(x, x0, a, b)
        return torch.mul(x, a).addcmul_(x0, b)

    @staticmethod
    def backward(ctx, grad):
        x, x0, a, b = ctx.saved_tensors
        flat = grad.reshape(-1)
        grad_a = torch.dot(flat, x.reshape(-1)).view_as(a)
        grad_b = torch.dot(flat, x0.reshape(-1)).view_as(b)
        return grad * a, grad * b, grad_a, grad_b


class _Smear(torch.autograd.Function):
    """out_t = x_t + lam * sigmoid(logits_t) * x_(t-1) for (B, T, C) x, (B, T, 1) logits, a one-element lam, x_0
    unchanged: a copy and one pass over T - 1 rows, no shifted copy of x."""

    @staticmethod
    def forward(ctx, x, logits, lam):
        gate = torch.sigmoid(logits)  # (B, T, 1)
        coef = gate[:, 1:] * lam
        out = x.clone()
        out[:, 1:].addcmul_(x[:, :-1], coef)
        ctx.save_for_backward(x, gate, coef, lam)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, gate, coef, lam = ctx.saved_tensors
        grad_x = grad.clone()
        grad_x[:, :-1].addcmul_(grad[:, 1:], coef)
        grad_coef = torch.linalg.vecdot(grad[:, 1:], x[:, :-1], dim=-1).unsqueeze(-1)  # (B, T - 1, 1)
        gate_rest = gate[:, 1:]
        grad_lam = torch.dot(grad_coef.reshape(-1), gate_rest.reshape(-1)).view_as(lam)
        grad_logits = torch.zeros_like(gate)
        grad_logits[:, 1:] = grad_coef * lam * gate_rest * (1 - gate_rest)
        return grad_x, grad_logits, grad_lam


LOSS_CHUNK_ROWS = 512  # rows of logits per chunk in the chunked loss: (512, V) fp32, a few MB


class _ChunkedSoftcapCrossEntropy(torch.autograd.Function):
    """
    sum_i CE(s * tanh(x_i @ W^T / s), t_i) over x (N, C), W (V, C), t (N,) with -1 ignored, s = softcap: lm_head ->
    softcap -> F.cross_entropy without the (N, V) logits ever existing at once. LOSS_CHUNK_ROWS rows at a time, the
    loss and d(loss)/d(logits) are made while the chunk is in cache and go straight into d/dx and d/dW, in the forward;
    backward only scales them by the incoming scalar.

    The softcap goes through a sigmoid, tanh(u) = 2 sigmoid(2u) - 1 (torch's CPU tanh is 3-4x slower). With
    q = sigmoid(2 l / s), c = s (2q - 1), and as a softmax ignores a shift every quantity uses c' = 2 s q = c + s:

        loss_i = log(sum_v exp(c'_iv)) - c'_i,t_i      dL/dc = softmax(c') - onehot(t)      dc/dl = 4 q (1 - q)

    0 < c' < 2s, so exp(c') cannot overflow and needs no max-subtraction. 2/s and 4 ride in the matmuls' alpha, and
    each chunk reuses two buffers, so no pass lands on cold memory.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, softcap, matmul_dtype):
        with torch.autocast("cpu", enabled=False):  # every cast below is explicit
            s = softcap
            n_rows, vocab = x.size(0), weight.size(0)
            chunk = min(LOSS_CHUNK_ROWS, n_rows)
            total = x.new_zeros((), dtype=torch.float32)
            grad_x = torch.empty_like(x)
            grad_weight = torch.zeros_like(weight)
            # the softcap, softmax and loss in fp32 whatever x's dtype (a bf16 residual stream under autocast)
            q_buffer = x.new_empty(chunk, vocab, dtype=torch.float32)
            probs_buffer = x.new_empty(chunk, vocab, dtype=torch.float32)
            # Under autocast the three matmuls take bf16 operands, as lm_head and its backward would: the logits are
            # rounded to bf16 before the softcap, d(logits) before it meets the weights; the rest stays fp32.
            low = (x.dtype, weight.dtype, matmul_dtype) != (torch.float32,) * 3
            weight_mm = weight.to(matmul_dtype) if low else weight
            for start in range(0, n_rows, chunk):
                rows = slice(start, start + chunk)
                xc, tc = x[rows], targets[rows]
                q, probs = q_buffer[:xc.size(0)], probs_buffer[:xc.size(0)]
                valid = tc != -1
                safe_targets = tc.clamp(min=0).unsqueeze(1)
                if low:
                    xc = xc.to(matmul_dtype)
                    q.copy_(torch.mm(xc, weight_mm.t())).mul_(2 / s).sigmoid_()
                else:
                    torch.addmm(q, xc, weight.t(), beta=0, alpha=2 / s, out=q).sigmoid_()  # beta=0: old q unused
                torch.mul(q, 2 * s, out=probs).exp_()
                sum_exp = probs.sum(dim=1, keepdim=True)
                picked = q.gather(1, safe_targets).mul_(2 * s)
                total += torch.where(valid, (sum_exp.log() - picked).squeeze(1), 0.0).sum()
                # d(loss)/d(logits), in place in `probs`: softmax - onehot, zero on ignored rows, times q (1 - q); the
                # remaining factor 4 is the alpha of the two matmuls below
                grad = probs.div_(sum_exp)
                grad.scatter_add_(1, safe_targets, -valid.to(grad.dtype).unsqueeze(1))
                if not valid.all():
                    grad.mul_(valid.unsqueeze(1))
                grad.mul_(q).addcmul_(grad, q, value=-1.0)
                if low:
                    grad_mm = grad.to(matmul_dtype)
                    torch.mul(torch.mm(grad_mm, weight_mm), 4.0, out=grad_x[rows])
                    grad_weight.add_(torch.mm(grad_mm.t(), xc), alpha=4.0)
                else:
                    torch.addmm(grad_x[rows], grad, weight, beta=0, alpha=4.0, out=grad_x[rows])
                    grad_weight.addmm_(grad.t(), xc, alpha=4.0)
            ctx.save_for_backward(grad_x, grad_weight)
            return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_weight = ctx.saved_tensors
        return grad_x * grad_total, grad_weight * grad_total, None, None, None


# -----------------------------------------------------------------------------
# Entry points (the Functions above give the math); fused_X computes gpt.py's operation X
fused_rms_norm = _RMSNorm.apply
fused_relu_squared_mlp = _ReluSquaredMLP.apply
fused_gated_add = _GatedAdd.apply
fused_smear = _Smear.apply


def fused_rotary_norm(x, cos, sin, eps):
    """(B, T, H, D) -> the rotated and RMS-normalised tensor, as a (B, T, H, D) view of a contiguous (B, H, T, D) one."""
    return _RotaryNorm.apply(x, cos, sin, eps)


def fused_residual_mix(x, x0, a, b):
    """a * x + b * x0 for same-shape x, x0 and 0-dim a, b."""
    return _ResidualMix.apply(x, x0, a, b)


def block_causal_attention(q, k, v, window=None):
    """Causal attention of (B, H, T, D) q, k, v with n_kv_head == n_head, each query seeing the last `window` positions
    (itself included; None = all before it); returns (B, H, T, D). Under CPU autocast q, k, v are taken in its dtype,
    as SDPA would take them."""
    window = q.size(2) if window is None else window
    if not torch.is_autocast_enabled("cpu"):
        return _BlockCausalAttention.apply(q, k, v, window)
    low = torch.get_autocast_dtype("cpu")
    with torch.autocast("cpu", enabled=False):
        return _BlockCausalAttention.apply(q.to(low), k.to(low), v.to(low), window)


def softcap_cross_entropy_sum(x, weight, targets, softcap):
    """The chunked softcap loss of rows x (N, C), targets (N,) with -1 ignored; the matmuls in the CPU autocast dtype
    when autocast is on."""
    matmul_dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    return _ChunkedSoftcapCrossEntropy.apply(x, weight, targets, softcap, matmul_dtype)


# -----------------------------------------------------------------------------
# The swap: gpt.py's model with the Functions above where they apply


def cpu_kernels_enabled():
    """NANOCHAT_CPU_OPS: 1 (default) lets use_cpu_kernels swap the kernels in on a CPU, 0 leaves the plain torch path
    (a GPU's) everywhere; any other value is refused."""
    value = os.environ.get("NANOCHAT_CPU_OPS", "1")
    if value not in ("0", "1"):
        raise UserError(f"NANOCHAT_CPU_OPS must be 0 (the plain torch path, as on a GPU) or 1 (got {value!r})")
    return value == "1"


def is_cpu_fp32(x):
    """A CPU fp32 tensor outside autocast: where the elementwise Functions run."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")


def cpu_training(activations, weights=()):
    """Where the training-only Functions apply (block attention, chunked loss): CPU tensors on their way to a backward,
    activations in fp32, or under CPU autocast in fp32 or its dtype (the matmuls then run in it, softmax and loss in
    fp32), weights in fp32. Not a compiled autocast model: that is the GPU's path, fused by the compiler."""
    autocast = torch.is_autocast_enabled("cpu")
    dtypes = (torch.float32, torch.get_autocast_dtype("cpu")) if autocast else (torch.float32,)
    fits = all(t.device.type == "cpu" and t.dtype in dtypes for t in activations) \
        and all(w.device.type == "cpu" and w.dtype == torch.float32 for w in weights)
    return fits and torch.is_grad_enabled() and not (autocast and torch.compiler.is_compiling()) \
        and any(t.requires_grad for t in (*activations, *weights))


def eps_of(x, eps):
    """The norm's eps as a number: GPTConfig.norm_eps None is the machine epsilon of x's dtype, as in F.rms_norm."""
    return torch.finfo(x.dtype).eps if eps is None else eps


class CpuRMSNorm(gpt.RMSNorm):
    def forward(self, x):
        if is_cpu_fp32(x):
            return fused_rms_norm(x, eps_of(x, self.eps))
        return super().forward(x)


class CpuCausalSelfAttention(gpt.CausalSelfAttention):
    def rotary_norm(self, x, cos, sin):
        # the fused version norms before rotating, which needs an exact rotation: not bf16-rounded tables
        if is_cpu_fp32(x) and not self.rotary_bf16:
            return fused_rotary_norm(x, cos, sin, eps_of(x, self.qk_norm.eps))
        return super().rotary_norm(x, cos, sin)

    def add_value_embed(self, v, value_embed, logits):
        if is_cpu_fp32(v):
            return fused_gated_add(v, value_embed, logits, self.ve_gate_scale)
        return super().add_value_embed(v, value_embed, logits)

    def attend(self, q, k, v, kv_cache):
        if kv_cache is None and self.n_kv_head == self.n_head and cpu_training((q, k, v)):
            return block_causal_attention(q, k, v, window=self.window)
        return super().attend(q, k, v, kv_cache)


class CpuMLP(gpt.MLP):
    def forward(self, x):
        if is_cpu_fp32(x) and type(self.c_fc) is nn.Linear:  # a swapped-in linear (fp8) runs its own forward
            return fused_relu_squared_mlp(x, self.c_fc.weight, self.c_proj.weight)
        return super().forward(x)


class CpuGPT(gpt.GPT):
    def _smear(self, x, kv_cache):
        if kv_cache is None and is_cpu_fp32(x):
            return fused_smear(x, self.smear_gate(x[..., :self.smear_gate.in_features]), self.smear_lambda)
        return super()._smear(x, kv_cache)

    def _mix_residual(self, x, x0, i):
        if is_cpu_fp32(x):
            return fused_residual_mix(x, x0, self.resid_lambdas[i], self.x0_lambdas[i])
        return super()._mix_residual(x, x0, i)

    def _loss_sum(self, rows, targets):
        # training: the loss in chunks, never the full (N, V) logits; a swapped-in lm_head (fp8) runs its own forward
        if self.config.logit_softcap is not None and type(self.lm_head) is nn.Linear \
                and cpu_training((rows,), (self.lm_head.weight,)):
            return softcap_cross_entropy_sum(rows, self.lm_head.weight, targets, self.config.logit_softcap)
        return super()._loss_sum(rows, targets)

    def _token_losses(self, rows, targets):
        # an evaluation in row chunks too: the full logits cost ~200 MB of peak RSS at the CPU preset
        plain = super()._token_losses
        if rows.device.type != "cpu" or torch.is_grad_enabled():
            return plain(rows, targets)
        return torch.cat([plain(rows[i:i + LOSS_CHUNK_ROWS], targets[i:i + LOSS_CHUNK_ROWS])
                          for i in range(0, rows.size(0), LOSS_CHUNK_ROWS)])


CPU_VERSIONS = {gpt.RMSNorm: CpuRMSNorm, gpt.CausalSelfAttention: CpuCausalSelfAttention, gpt.MLP: CpuMLP,
                gpt.GPT: CpuGPT}


def swap_in_cpu_kernels(model):
    """Make each of gpt.py's modules below `model` (itself included) its Cpu* version above, in place: a subclass whose
    overrides run the Functions where they apply and the plain math elsewhere (any device, any dtype), so the swapped
    model is right anywhere. The same objects with the same Parameters and state-dict keys: before or after the
    optimizers are built, before torch.compile. Returns the model."""
    for module in model.modules():
        if type(module) in CPU_VERSIONS:
            module.__class__ = CPU_VERSIONS[type(module)]
    return model


def use_cpu_kernels(model, device):
    """swap_in_cpu_kernels on a CPU unless NANOCHAT_CPU_OPS=0 (a bad value is refused on any device, before any
    compute): the one line after a model is built or loaded. Returns the model."""
    if cpu_kernels_enabled() and torch.device(device).type == "cpu":
        swap_in_cpu_kernels(model)
    return model
