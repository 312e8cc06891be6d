"""
The GPT model: a decoder-only transformer that trains fast on one dial (depth) and runs
everywhere scaled_dot_product_attention does (CUDA, MPS, CPU).

    tokens -> wte -> RMSNorm -> n_layer x Block -> RMSNorm -> lm_head -> softcap -> fp32 logits
    Block:  x + attn(norm(x)),  then  x + mlp(norm(x))       (pre-norm, no biases anywhere)
    attn:   rotary on split halves -> QK-norm -> grouped-query attention (n_kv_head <= n_head)
    mlp:    4x expansion with relu(x)**2

Every norm is parameter-free, so the only parameters are the embedding, the lm_head and the
2-D matrices inside the blocks. The math is written to equal, for the same weights, the
NanoChat model built into Hugging Face transformers (NanoChatForCausalLM), and the state-dict
names follow the original nanochat checkpoint layout that its converter understands:

    transformer.wte.weight               -> model.embed_tokens.weight
    transformer.h.{i}.attn.c_q/c_k/c_v   -> model.layers.{i}.self_attn.q_proj/k_proj/v_proj
    transformer.h.{i}.attn.c_proj        -> model.layers.{i}.self_attn.o_proj
    transformer.h.{i}.mlp.c_fc/c_proj    -> model.layers.{i}.mlp.fc1/fc2
    lm_head.weight                       -> lm_head.weight

An exporter must write rms_norm_eps=NORM_EPS, rope_theta=ROPE_THETA,
final_logit_softcapping=LOGIT_SOFTCAP, intermediate_size=4*n_embd, hidden_act="relu2",
tie_word_embeddings=False and attention_bias=False.

The model is built on the meta device and then materialised and initialised explicitly:

    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.common import get_compute_dtype

NORM_EPS = 1e-6  # transformers' NanoChatConfig.rms_norm_eps default; explicit so both sides agree
ROPE_THETA = 10000.0
LOGIT_SOFTCAP = 15.0
ROTARY_LENGTH_FACTOR = 10  # rotary tables cover 10x sequence_len so generation can run past the training length


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Raise ValueError for shapes the model cannot be built with, before anything is allocated."""
        for name in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer (got {value!r})")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head != 0:
            raise ValueError(f"GPTConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        head_dim = self.n_embd // self.n_head
        if head_dim % 2 != 0:
            raise ValueError(f"GPTConfig: head_dim = n_embd/n_head = {head_dim} must be even for rotary embeddings")


# -----------------------------------------------------------------------------
# The elementwise pieces of a block. On the CPU in fp32 each runs as an autograd.Function with a
# hand-written backward: autograd's generic chains (rms_norm is a composite of pow, mean, rsqrt, mul;
# square() goes through PowBackward; slicing for rotary scatters into zero-filled buffers) pass over
# memory 2-4x more often, and on a CPU those passes cost as much as a good part of the matmuls
# (measured fwd+bwd at d4 shapes: rms_norm 3.9 -> 1.3 ms, rotary 3.6 -> 2.0 ms, relu^2 16.5 -> 7.2 ms
# as its own Function, less again fused into the MLP below).
# The math is the same, up to float rounding. Elsewhere (CUDA, bf16 autocast) the plain torch
# expressions run, and torch.compile fuses them.


def _cpu_fp32(x):
    return x.device.type == "cpu" and x.dtype == torch.float32


def _cpu_fp32_training(*tensors):
    """CPU fp32 tensors on their way to a backward pass: where the training-only Functions below apply."""
    return (all(_cpu_fp32(t) for t in tensors) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
            and not torch.is_autocast_enabled("cpu"))


def norm(x):
    """Parameter-free RMSNorm over the last dimension: x / sqrt(mean(x^2) + NORM_EPS)."""
    if _cpu_fp32(x):
        return _RMSNorm.apply(x)
    return F.rms_norm(x, (x.size(-1),), eps=NORM_EPS)


def rotary_norm(x, cos, sin):
    """
    Rotary embedding, then RMSNorm (the QK-norm), of (B, T, H, D) queries or keys. The first and second
    halves of D form the pairs (not interleaved), and the sign convention is the one transformers'
    NanoChat uses: first half gets +x2*sin, second half gets -x1*sin. On the CPU in fp32 the result is a
    (B, T, H, D) view of a contiguous (B, H, T, D) tensor, the layout attention wants.
    """
    if _cpu_fp32(x):
        return _RotaryNorm.apply(x, cos, sin)
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return norm(torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1))


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
    def forward(ctx, x):
        mean_square = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(x.size(-1))
        inv_rms = mean_square.add_(NORM_EPS).rsqrt_()
        ctx.save_for_backward(x, inv_rms)
        return x * inv_rms

    @staticmethod
    def backward(ctx, grad):
        x, inv_rms = ctx.saved_tensors
        mean_gx = torch.linalg.vecdot(grad, x, dim=-1).unsqueeze(-1).div_(x.size(-1))
        grad_x = grad * inv_rms
        return grad_x.addcmul_(x, inv_rms.pow(3).mul_(mean_gx), value=-1.0)


class _RotaryNorm(torch.autograd.Function):
    """
    y = R(x) * r: rotation R by position, then RMSNorm. A rotation keeps every pair's length, so
    r = (mean(x^2) + eps)^-1/2 comes from x itself, and the output is written straight into a
    (B, H, T, D) buffer, which saves attention a transposing copy. With m = mean(g * y) per row,

        dx = R^T(r * (g - y * m)) = r * R^T(g) - x * r^2 * m          (R^T: the rotation by -theta)
    """

    @staticmethod
    def forward(ctx, x, cos, sin):
        B, T, H, D = x.shape
        inv_rms = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(D).add_(NORM_EPS).rsqrt_()
        y = _rotate(x, cos, sin, out=x.new_empty(B, H, T, D).transpose(1, 2)).mul_(inv_rms)
        ctx.save_for_backward(x, cos, sin, inv_rms, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, cos, sin, inv_rms, y = ctx.saved_tensors
        mean_gy = torch.linalg.vecdot(grad, y, dim=-1).unsqueeze(-1).div_(x.size(-1))
        grad_x = _rotate(grad, cos, -sin, out=torch.empty_like(x)).mul_(inv_rms)
        return grad_x.addcmul_(x, inv_rms.square().mul_(mean_gy), value=-1.0), None, None


class _ReluSquaredMLP(torch.autograd.Function):
    """
    The whole MLP, out = relu(x W1^T)^2 W2^T, so that its two elementwise passes over the (N, 4C)
    hidden activation run in place: relu overwrites the matmul output, and in backward the 2 of
    d(r^2) = 2 r dr rides in the matmul (alpha) and the relu mask comes from multiplying by r.
    Allocating a fresh (N, 4C) tensor per pass cost 4-5x more than the in-place pass (cold memory).
    Saves r and r^2, the same two tensors autograd would keep.
    """

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
    Causal softmax(q k^T / sqrt(D)) v for CPU training in fp32, by blocks of ATTENTION_BLOCK queries:
    block i attends to keys [0, end_i) only, so the score matrices cover the lower triangle plus the
    diagonal blocks (5/8 of the full T x T at T=512, 3/4 at T=256), and every product is one large bmm.
    The probabilities are kept for backward. Measured fwd+bwd against torch's CPU flash attention
    (B=8, D=128): 19.1 vs 21.9 ms at T=256, H=2; 79 vs 105 ms at T=512, H=3. Needs n_kv_head == n_head.

        dV += P^T dO     dP = dO V^T     dS = P * (dP - rowsum(dO * O))     dQ = dS K / sqrt(D)     dK += dS^T Q / sqrt(D)
    """

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        scale = D ** -0.5
        q3, k3, v3 = (t.reshape(B * H, T, D) for t in (q, k, v))
        out = torch.empty_like(q3)
        future = torch.ones(ATTENTION_BLOCK, ATTENTION_BLOCK, dtype=torch.bool, device=q.device).triu_(1)
        probs = []
        for start in range(0, T, ATTENTION_BLOCK):
            end = min(start + ATTENTION_BLOCK, T)
            scores = torch.bmm(q3[:, start:end], k3[:, :end].mT).mul_(scale)
            scores[:, :, start:end].masked_fill_(future[:end - start, :end - start], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            torch.bmm(p, v3[:, :end], out=out[:, start:end])
            probs.append(p)
        ctx.save_for_backward(q3, k3, v3, out, *probs)
        return out.view(B, H, T, D)

    @staticmethod
    def backward(ctx, grad):
        q3, k3, v3, out, *probs = ctx.saved_tensors
        B, H, T, D = grad.shape
        scale = D ** -0.5
        grad3 = grad.reshape(B * H, T, D)
        grad_q = torch.empty_like(q3)
        row_dot = torch.linalg.vecdot(grad3, out).unsqueeze(-1)  # rowsum(dP * P) = rowsum(dO * O)
        # Last block first: it reaches every key, so it creates grad_k / grad_v whole; the earlier blocks add
        # into a prefix. (baddbmm_ into a prefix slice would fall back to one small matmul per batch entry.)
        for i in reversed(range(len(probs))):
            start = i * ATTENTION_BLOCK
            end = min(start + ATTENTION_BLOCK, T)
            p, grad_out = probs[i], grad3[:, start:end]
            grad_scores = torch.bmm(grad_out, v3[:, :end].mT).sub_(row_dot[:, start:end]).mul_(p)
            torch.bmm(grad_scores, k3[:, :end], out=grad_q[:, start:end]).mul_(scale)
            if end == T:
                grad_v = torch.bmm(p.mT, grad_out)
                grad_k = torch.bmm(grad_scores.mT, q3[:, start:end]).mul_(scale)
            else:
                grad_v[:, :end] += torch.bmm(p.mT, grad_out)
                grad_k[:, :end].add_(torch.bmm(grad_scores.mT, q3[:, start:end]), alpha=scale)
        return grad_q.view(B, H, T, D), grad_k.view(B, H, T, D), grad_v.view(B, H, T, D)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.n_kv_head = config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        # Separate q/k/v (not one fused matrix) so each maps 1:1 onto transformers' q_proj/k_proj/v_proj.
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, cos, sin, kv_cache):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # no-op unless autocast changed the activation dtype
        q, k = rotary_norm(q, cos, sin), rotary_norm(k, cos, sin)  # rotary first, then QK-norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D) for SDPA

        mask, is_causal = None, True
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # all keys/values so far, (B, H_kv, T_cache, D)
            k, v = k.to(q.dtype), v.to(q.dtype)
            prefix = k.size(2) - T
            if prefix > 0:
                is_causal = False
                if T > 1:
                    # New query i sits at position prefix+i: it sees the whole prefix and new keys up to itself.
                    # (is_causal would align the mask top-left, which is wrong when there are fewer queries than keys.)
                    key_pos = torch.arange(k.size(2), device=q.device)
                    query_pos = torch.arange(prefix, prefix + T, device=q.device)
                    mask = key_pos[None, :] <= query_pos[:, None]
        if kv_cache is None and self.n_kv_head == self.n_head and _cpu_fp32_training(q, k, v):
            y = _BlockCausalAttention.apply(q, k, v)
        else:
            # enable_gqa lets query head h read kv head h // (n_head/n_kv_head), the same grouping as
            # transformers' repeat_kv, without materialising repeated k/v (measured faster on CPU too).
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                               enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        if _cpu_fp32(x):
            return _ReluSquaredMLP.apply(x, self.c_fc.weight, self.c_proj.weight)
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_cache):
        x = x + self.attn(norm(x), cos, sin, kv_cache)
        x = x + self.mlp(norm(x))
        return x


LOSS_CHUNK_ROWS = 512  # rows of logits per chunk in the chunked loss: (512, V) fp32, a few MB


def use_chunked_loss(x, weight):
    """
    The chunked loss serves CPU training in fp32, where the (B*T, V) logits path is memory-bound.
    Anywhere else (CUDA, autocast, no gradient wanted) the plain path runs: on a GPU torch.compile
    already fuses the elementwise ops, and inference needs the logits themselves.
    """
    return _cpu_fp32_training(x, weight)


class ChunkedSoftcapCrossEntropy(torch.autograd.Function):
    """
    Summed cross-entropy of softcapped logits, ignoring targets of -1:

        sum_i  CE(s * tanh(x_i @ W^T / s), t_i)        x (N, C), W (V, C), t (N,), s = LOGIT_SOFTCAP

    the same math as lm_head -> softcap -> F.cross_entropy, but the (N, V) logits never exist all
    at once: LOSS_CHUNK_ROWS rows at a time, the chunk's logits are computed, softcapped and turned
    into the loss and into d(loss)/d(logits) while they are still in cache, and that gradient goes
    straight into d/dx (the chunk's rows) and d/dW (accumulated). So the gradients are computed in
    the forward pass, with the same matmuls autograd would run; backward only scales them by the
    incoming gradient, a scalar since the output is a sum.

    The softcap goes through a sigmoid, tanh(u) = 2 sigmoid(2u) - 1, because torch's CPU tanh is
    3-4x slower than its sigmoid (4.8 vs 1.3 ms on a 512 x 4096 chunk). With q = sigmoid(2 l / s)
    the softcapped logit is c = s (2q - 1), and since a softmax ignores a constant shift, every
    quantity can use c' = 2 s q = c + s instead:

        loss_i = log(sum_v exp(c'_iv)) - c'_i,t_i      dL/dc = softmax(c') - onehot(t)      dc/dl = 4 q (1 - q)

    0 < c' < 2s = 30, so exp(c') cannot overflow and the softmax needs no max-subtraction. The
    scalings 2/s and 4 ride along in the matmuls (addmm's alpha), and each chunk reuses the same
    two buffers, so no pass over the chunk lands on freshly allocated (cold) memory.
    """

    @staticmethod
    def forward(ctx, x, weight, targets):
        s = LOGIT_SOFTCAP
        n_rows, vocab = x.size(0), weight.size(0)
        chunk = min(LOSS_CHUNK_ROWS, n_rows)
        total = x.new_zeros(())
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros_like(weight)
        q_buffer, probs_buffer = x.new_empty(chunk, vocab), x.new_empty(chunk, vocab)
        for start in range(0, n_rows, chunk):
            rows = slice(start, start + chunk)
            xc, tc = x[rows], targets[rows]
            q, probs = q_buffer[:xc.size(0)], probs_buffer[:xc.size(0)]
            valid = tc != -1
            safe_targets = tc.clamp(min=0).unsqueeze(1)
            torch.addmm(q, xc, weight.t(), beta=0, alpha=2 / s, out=q).sigmoid_()  # beta=0: q's old values are ignored
            torch.mul(q, 2 * s, out=probs).exp_()
            sum_exp = probs.sum(dim=1, keepdim=True)
            picked = q.gather(1, safe_targets).mul_(2 * s)
            total += torch.where(valid, (sum_exp.log() - picked).squeeze(1), 0.0).sum()
            # d(loss)/d(logits), built in place in `probs`: softmax - onehot, zero on ignored rows, times q (1 - q);
            # the remaining factor 4 is the alpha of the two matmuls below.
            grad = probs.div_(sum_exp)
            grad.scatter_add_(1, safe_targets, -valid.to(grad.dtype).unsqueeze(1))
            if not valid.all():
                grad.mul_(valid.unsqueeze(1))
            grad.mul_(q).addcmul_(grad, q, value=-1.0)
            torch.addmm(grad_x[rows], grad, weight, beta=0, alpha=4.0, out=grad_x[rows])
            grad_weight.addmm_(grad.t(), xc, alpha=4.0)
        ctx.save_for_backward(grad_x, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_x, grad_weight = ctx.saved_tensors
        return grad_x * grad_total, grad_weight * grad_total, None


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        # Passing _weight skips nn.Embedding's own random init: init_weights() sets it anyway, and a
        # normal_() on the meta device makes torch import torch._dynamo, seconds of startup for nothing.
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd, _weight=torch.empty(config.vocab_size, config.n_embd)),
            "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Rotary tables are derived, not learned: non-persistent, filled by init_rotary().
        head_dim = config.n_embd // config.n_head
        rotary_len = ROTARY_LENGTH_FACTOR * config.sequence_len
        self.register_buffer("cos", torch.empty(1, rotary_len, 1, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(1, rotary_len, 1, head_dim // 2), persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """
        Fill every parameter and the rotary tables (call after to_empty). The init:
          wte         normal, std 1 (it is RMS-normalised right away, so only direction matters)
          lm_head     normal, std 0.001 (start near uniform predictions)
          c_q, c_k, c_v, c_fc   uniform with std n_embd^-0.5 (bound sqrt(3) * n_embd^-0.5)
          attn.c_proj, mlp.c_proj   zero, so every block starts as the identity on the residual stream
        """
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        bound = math.sqrt(3.0) * self.config.n_embd ** -0.5
        for block in self.transformer.h:
            for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(linear.weight, -bound, bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
        self.init_rotary()

    @torch.no_grad()
    def init_rotary(self):
        """(Re)compute the rotary cos/sin tables on the model's device, stored in the compute dtype."""
        device = self.get_device()
        head_dim = self.config.n_embd // self.config.n_head
        rotary_len = self.cos.size(1)
        # Same arithmetic as transformers: inv_freq = theta^-(2i/d), angles = position * inv_freq in fp32.
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
        positions = torch.arange(rotary_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
        dtype = get_compute_dtype(device)
        self.cos = angles.cos().to(dtype)[None, :, None, :]
        self.sin = angles.sin().to(dtype)[None, :, None, :]

    def get_device(self):
        return self.transformer.wte.weight.device

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def estimate_flops(self):
        """
        Training FLOPs per token (forward + backward):

            6 * (num_params - wte params)  +  12 * n_layer * n_head * head_dim * sequence_len

        A matmul weight costs 2 FLOPs per token forward and 4 backward, hence 6 per parameter;
        the embedding is a lookup, not a matmul, so it is left out (lm_head is a matmul and counts).
        Attention adds two matmuls per layer that have no parameters, QK^T and AV, each
        2 * n_head * head_dim * T FLOPs per token forward (counted over the full T, not the
        causal half), times 3 for forward + backward: 12 * n_head * head_dim * T per layer.
        """
        c = self.config
        head_dim = c.n_embd // c.n_head
        matmul_params = self.num_params() - self.transformer.wte.weight.numel()
        return 6 * matmul_params + 12 * c.n_layer * c.n_head * head_dim * c.sequence_len

    def setup_optimizers(self, unembedding_lr=0.004, embedding_lr=0.2, matrix_lr=0.02, weight_decay=0.0,
                         adam_betas=(0.8, 0.95)):
        """
        Parameter groups for the two optimizers (this module may not import them):
        returns (adamw_groups, muon_groups). AdamW gets lm_head and wte, each with its own lr scaled
        by (n_embd/768)^-0.5; Muon gets the 2-D block matrices, one group per distinct shape.
        Every group also records initial_lr so lr schedules can scale from it.
        """
        adamw_scale = (self.config.n_embd / 768) ** -0.5
        adamw_groups = [
            {"params": [self.lm_head.weight], "lr": unembedding_lr * adamw_scale},
            {"params": [self.transformer.wte.weight], "lr": embedding_lr * adamw_scale},
        ]
        for group in adamw_groups:
            group.update(betas=adam_betas, eps=1e-10, weight_decay=0.0)
        by_shape = {}  # insertion order = model definition order, so groups are deterministic
        for p in self.transformer.h.parameters():
            assert p.ndim == 2, "Muon only handles matrices; every block parameter should be 2-D"
            by_shape.setdefault(tuple(p.shape), []).append(p)
        muon_groups = [{"params": params, "lr": matrix_lr, "weight_decay": weight_decay} for params in by_shape.values()]
        for group in adamw_groups + muon_groups:
            group["initial_lr"] = group["lr"]
        grouped = [id(p) for group in adamw_groups + muon_groups for p in group["params"]]
        assert len(grouped) == len(set(grouped)) == len(list(self.parameters())), "each parameter must be in exactly one group"
        assert set(grouped) == {id(p) for p in self.parameters()}
        return adamw_groups, muon_groups

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean"):
        """
        idx (B, T) token ids. Without targets: fp32 logits (B, T, vocab_size). With targets (B, T):
        cross-entropy ignoring -1, reduced by "mean" (over valid targets; 0 if there are none),
        "sum", or "none" (a (B, T) tensor, 0 where ignored).
        With a kv_cache, positions start at kv_cache.get_pos(), the new tokens attend to everything
        cached plus causally among themselves, and the cache advances by T.
        """
        B, T = idx.shape
        start = kv_cache.get_pos() if kv_cache is not None else 0
        if start + T > self.cos.size(1):
            raise ValueError(f"position {start + T} is beyond the rotary table ({self.cos.size(1)} positions)")
        cos, sin = self.cos[:, start:start + T], self.sin[:, start:start + T]

        x = norm(self.transformer.wte(idx))
        for block in self.transformer.h:
            x = block(x, cos, sin, kv_cache)
        x = norm(x)
        if kv_cache is not None:
            kv_cache.advance(T)
        if targets is not None and loss_reduction not in ("mean", "sum", "none"):
            raise ValueError(f"loss_reduction must be 'mean', 'sum' or 'none' (got {loss_reduction!r})")
        flat_targets = targets.reshape(-1) if targets is not None else None

        if targets is not None and loss_reduction != "none" and use_chunked_loss(x, self.lm_head.weight):
            total = ChunkedSoftcapCrossEntropy.apply(x.view(B * T, -1), self.lm_head.weight, flat_targets)
        else:
            logits = self.lm_head(x).float()
            logits = LOGIT_SOFTCAP * torch.tanh(logits / LOGIT_SOFTCAP)
            if targets is None:
                return logits
            losses = F.cross_entropy(logits.view(-1, logits.size(-1)), flat_targets, ignore_index=-1, reduction="none")
            if loss_reduction == "none":
                return losses.view(B, T)
            total = losses.sum()
        if loss_reduction == "sum":
            return total
        # Divide by the valid count ourselves so a batch with no valid target gives 0, not NaN.
        return total / (flat_targets != -1).sum().clamp(min=1)
