"""
The GPT model: token embedding -> RMSNorm -> n_layer pre-norm blocks (attention with rotary on split halves, QK-norm
and grouped-query heads; a 4x relu^2 MLP) -> RMSNorm -> untied lm_head -> softcap -> fp32 logits. Norms have no
parameters and linears no biases. For the same weights it equals transformers' NanoChatForCausalLM, with the original
nanochat state-dict names. Built on the meta device, then materialised and initialised (`build_model`). The recipe
components (GPTConfig) are off by default and start at or near the identity. Inference: `forward(idx, kv_cache=rows)`
with rows of the engine's cache (each row at its own length).

This file is the plain torch math, what a GPU runs. Faster implementations are swapped in after the model is built,
never chosen here: fp8 linears (nanochat/kernels/fp8.py), and on a CPU hand-written kernels for the same math
(nanochat/kernels/cpu.py, `use_cpu_kernels`), which override the norms and the methods that compute the elementwise
pieces ("The blocks" below).
"""

import math
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from nanochat.common import bound_onednn_caches, get_compute_dtype

NORM_EPS = 1e-6  # transformers' NanoChatConfig.rms_norm_eps default; explicit so both sides agree
ROPE_THETA = 10000.0
LOGIT_SOFTCAP = 15.0
ROTARY_LENGTH_FACTOR = 10  # rotary tables cover 10x sequence_len so generation can run past the training length
GATE_CHANNELS = 32  # the leading residual channels a component's gate reads (cheap, and enough to decide)
# The optional components, in GPTConfig; False everywhere is the model transformers' NanoChat describes.
COMPONENTS = ("value_embeds", "residual_scalars", "smear", "backout", "sliding_window")
VALUE_EMBED_LAYERS = ("lower_half", "alternating")  # GPTConfig.value_embed_layers, besides an explicit "0,2,5" list
# Exact-math options (GPTConfig): other projects' variants of this model, set by scripts.import_model; at their
# defaults (this model) a checkpoint's meta leaves them out.
VARIANT_DEFAULTS = {"rope_theta": ROPE_THETA, "rotary_bf16": False, "norm_eps": NORM_EPS, "qk_scale": 1.0,
                    "logit_softcap": LOGIT_SOFTCAP, "ve_gate_channels": GATE_CHANNELS, "ve_gate_scale": 2.0,
                    "smear_gate_channels": GATE_CHANNELS, "backout_layer": None, "attention_windows": None}
# GPTConfig fields a checkpoint's model_config may leave out (a missing one reads as the plain model's / the old default)
OPTIONAL_FIELDS = COMPONENTS + ("value_embed_layers",) + tuple(VARIANT_DEFAULTS)
# The largest shapes a GPTConfig takes: a meta.json or imported config is a file anyone may write, and GPT(config)
# trusts its shapes. Several times the largest public models of this kind; the context's bound is the tightest, as the
# rotary tables are built for ROTARY_LENGTH_FACTOR times it (dev/LOG.md).
SHAPE_LIMITS = {"sequence_len": 2**18, "vocab_size": 2**20, "n_layer": 1024, "n_head": 2**16, "n_kv_head": 2**16,
                "n_embd": 2**16, "ve_gate_channels": 2**16, "smear_gate_channels": 2**16}
# The rotary tables grow with context x head_dim, not with the weights: a 315 KiB model of one head and a 2^18 context
# built 2 GiB of them. They may take this much in fp32, or as much as the weights do when that is more.
ROTARY_BYTES_FLOOR = 1 << 28


def shape_problem(name, value):
    """Why `value` cannot be GPTConfig's shape field `name` (a positive integer up to SHAPE_LIMITS), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"GPTConfig.{name} must be a positive integer (got {value!r:.60})"
    if value > SHAPE_LIMITS[name]:
        return f"GPTConfig.{name} must be at most {SHAPE_LIMITS[name]:,} (got {value!r:.60}), past any model this code builds"
    return None


def is_positive_number(value):
    """A finite number above 0 (not a bool, not NaN or inf, not an int beyond a float's range)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:
        return False


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    # components of the reference project's later recipe; off = the plain model above
    value_embeds: bool = False  # v += 2 sigmoid(W x[:32]) * ve[token] on some layers, a gate per kv head
    residual_scalars: bool = False  # before block i: x = resid_lambdas[i] * x + x0_lambdas[i] * x0, x0 the embedding
    smear: bool = False  # e_t += smear_lambda * sigmoid(w . e_t[:32]) * e_(t-1)
    backout: bool = False  # before the final norm: x -= backout_lambda * (the residual after layer n_layer // 2)
    sliding_window: bool = False  # most layers see only the last sequence_len // 2 positions (attention_window)
    # Where value embeddings sit: "lower_half" (layers below n_layer // 2, at least layer 0), or "alternating" (the last
    # layer and every second one below it: checkpoints from before this field). On the last layer the final attention
    # can copy a context token straight to the output (dev/LOG.md, "Where the value embeddings sit").
    value_embed_layers: str = "lower_half"
    # Exact-math variants (VARIANT_DEFAULTS; docs/import.md), for imported checkpoints:
    rope_theta: float = ROPE_THETA
    rotary_bf16: bool = False  # rotary tables rounded to bf16 whatever the compute dtype (nanochat before March 2026)
    norm_eps: float | None = NORM_EPS  # None: torch's default, the machine epsilon of the activations' dtype
    qk_scale: float = 1.0  # q and k are multiplied by this after the QK-norm
    logit_softcap: float | None = LOGIT_SOFTCAP  # None: no cap
    ve_gate_channels: int = GATE_CHANNELS  # value embeddings' gate: ve_gate_scale * sigmoid(W x[:ve_gate_channels])
    ve_gate_scale: float = 2.0
    smear_gate_channels: int = GATE_CHANNELS
    backout_layer: int | None = None  # the block whose output backout subtracts; None: block n_layer // 2 - 1
    # per layer, how many positions (itself included) a query sees, 0 = all; None: sliding_window's rule
    attention_windows: list | None = None

    def __post_init__(self):
        self.validate()

    def validate(self):
        """Raise ValueError for shapes the model cannot be built with, before anything is allocated."""
        for name in SHAPE_LIMITS:  # first: every later check and GPT(config) may loop over them or multiply them
            problem = shape_problem(name, getattr(self, name))
            if problem:
                raise ValueError(problem)
        for name in COMPONENTS + ("rotary_bf16",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be true or false (got {getattr(self, name)!r})")
        if self.value_embed_layers not in VALUE_EMBED_LAYERS and explicit_layers(self.value_embed_layers, self.n_layer) is None:
            raise ValueError(f"GPTConfig.value_embed_layers must be one of {', '.join(VALUE_EMBED_LAYERS)} or a comma "
                             f"list of layer indices below n_layer (got {self.value_embed_layers!r})")
        for name in ("rope_theta", "qk_scale", "ve_gate_scale", "norm_eps", "logit_softcap"):
            value = getattr(self, name)
            if not is_positive_number(value) and not (value is None and name in ("norm_eps", "logit_softcap")):
                raise ValueError(f"GPTConfig.{name} must be a positive number (got {value!r:.60})")
        if self.backout_layer is not None and (isinstance(self.backout_layer, bool) or not isinstance(self.backout_layer, int)
                                               or not 0 <= self.backout_layer < self.n_layer):
            raise ValueError(f"GPTConfig.backout_layer must be a layer index below n_layer or null (got {self.backout_layer!r})")
        windows = self.attention_windows
        if windows is not None and (not isinstance(windows, (list, tuple)) or len(windows) != self.n_layer or not all(
                isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in windows)):
            raise ValueError(f"GPTConfig.attention_windows must list n_layer={self.n_layer} whole numbers >= 0 (0 = all "
                             f"positions) or be null (got {windows!r})")
        if windows is not None:
            self.attention_windows = list(windows)
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head != 0:
            raise ValueError(f"GPTConfig: n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        head_dim = self.n_embd // self.n_head
        if head_dim % 2 != 0:
            raise ValueError(f"GPTConfig: head_dim = n_embd/n_head = {head_dim} must be even for rotary embeddings")
        rotary_bytes = 2 * 4 * ROTARY_LENGTH_FACTOR * self.sequence_len * (head_dim // 2)  # cos and sin, fp32
        weight_bytes = 4 * self.plain_params()
        if rotary_bytes > max(ROTARY_BYTES_FLOOR, weight_bytes):
            raise ValueError(f"GPTConfig: sequence_len {self.sequence_len} x head_dim {head_dim} needs rotary tables of "
                             f"{rotary_bytes / 2**20:,.0f} MiB ({ROTARY_LENGTH_FACTOR}x the context), more than the "
                             f"{weight_bytes / 2**20:,.1f} MiB of weights or {ROTARY_BYTES_FLOOR >> 20} MiB: shorten the "
                             "context, or use more heads")

    def plain_params(self):
        """The parameters of the plain model of this shape (the components only add to them): embedding, head, and
        per layer q, k, v and the output projection, and the MLP's 4x expansion."""
        kv_width = self.n_kv_head * (self.n_embd // self.n_head)
        return 2 * self.vocab_size * self.n_embd + self.n_layer * (10 * self.n_embd ** 2 + 2 * self.n_embd * kv_width)


# -----------------------------------------------------------------------------
# The blocks. Each norm is an RMSNorm module, and the attention, the MLP and GPT compute their other elementwise pieces
# (rotary + QK-norm, the gated value embedding, the attention itself, the smear, the residual mix, the loss) in methods
# of their own: a faster implementation of the same math is swapped in by overriding them (nanochat/kernels/cpu.py).


class RMSNorm(nn.Module):
    """Parameter-free RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps); eps None is torch's default, the
    machine epsilon of x's dtype (GPTConfig.norm_eps). The result keeps x's dtype. It holds no state, so the state
    dict is the same with it or without it."""

    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        # CUDA's autocast runs rms_norm in fp32: a bf16 residual stream would come out of every norm as fp32, and its
        # backward would save that fp32 copy
        autocast = torch.is_autocast_enabled(x.device.type)
        with torch.autocast(x.device.type, enabled=False) if autocast else nullcontext():
            return F.rms_norm(x, (x.size(-1),), eps=self.eps)


def residual_mix(x, x0, resid_lambda, x0_lambda):
    """The residual_scalars component before a block: the stream rescaled, plus a share of the normed embedding x0."""
    return resid_lambda * x + x0_lambda * x0


def explicit_layers(text, n_layer):
    """The layer indices of a value_embed_layers like "1,3,5" (sorted, distinct, each below n_layer), else None."""
    if not isinstance(text, str) or text in VALUE_EMBED_LAYERS:
        return None
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        return None
    return layers if layers == sorted(set(layers)) and all(0 <= i < n_layer for i in layers) else None


def has_value_embed(config, layer_idx):
    """Whether this layer has a value embedding: per config.value_embed_layers (GPTConfig)."""
    if not config.value_embeds:
        return False
    if config.value_embed_layers == "alternating":
        return (config.n_layer - 1 - layer_idx) % 2 == 0
    if config.value_embed_layers == "lower_half":
        return layer_idx < max(1, config.n_layer // 2)
    return layer_idx in explicit_layers(config.value_embed_layers, config.n_layer)


def config_from_dict(fields):
    """GPTConfig from a checkpoint's model_config. Value embeddings saved before value_embed_layers existed sat on
    alternating layers; a new model names its placement."""
    fields = dict(fields)
    if fields.get("value_embeds") and "value_embed_layers" not in fields:
        fields["value_embed_layers"] = "alternating"
    return GPTConfig(**fields)


def attention_window(config, layer_idx):
    """How many positions (itself included) a query of this layer sees, or None for all. With sliding_window the last
    layer and every fourth below it see all, the others the last sequence_len // 2."""
    if config.attention_windows is not None:
        return config.attention_windows[layer_idx] or None
    if not config.sliding_window or (config.n_layer - 1 - layer_idx) % 4 == 0:
        return None
    return max(1, config.sequence_len // 2)


def band_mask(n_queries, n_keys, window, device):
    """Boolean (n_queries, n_keys) mask, True = may attend, for the last n_queries positions of n_keys: causal, and
    within `window` when not None. None when no window cuts and nothing is cached or there is one query."""
    prefix = n_keys - n_queries
    if (window is None or window >= n_keys) and (prefix == 0 or n_queries == 1):
        return None
    query_positions = torch.arange(prefix, n_keys, device=device)[:, None]
    return causal_mask(torch.arange(n_keys, device=device), query_positions, window)


def causal_mask(key_positions, query_positions, window):
    """Which keys each query may see: those up to itself, and within the window if there is one (broadcast)."""
    allowed = key_positions <= query_positions
    return allowed if window is None else allowed & (key_positions > query_positions - window)


# Attention kernels for inference on CUDA: all but cuDNN's, which plans per sequence length (tens of ms each), and
# inference meets a new length at every token (dev/LOG.md). Training keeps cuDNN (one length, planned once).
SHAPE_FREE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(q):
    """The SDPA kernels for this call: outside cuDNN when it would meet ever-new lengths (eager CUDA inference)."""
    if q.is_cuda and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return sdpa_kernel(SHAPE_FREE_ATTENTION)
    return nullcontext()


def flex_band_attention(q, k, v, window):
    """Causal attention of (B, H, T, D) q and (B, H_kv, T, D) k, v within `window`, by FlexAttention, skipping blocks
    outside the band. For the compiled path only (eager FlexAttention materialises the scores); the block mask is built
    inside the graph every step, leaving dynamo no Python-side cache to guard on."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def in_band(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    T = q.size(2)
    block_mask = create_block_mask(in_band, None, None, T, T, device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=k.size(1) != q.size(1))


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
        self.window = attention_window(config, layer_idx)
        if has_value_embed(config, layer_idx):
            self.ve_gate = nn.Linear(min(config.ve_gate_channels, config.n_embd), self.n_kv_head, bias=False)
        self.qk_norm = RMSNorm(config.norm_eps)
        self.qk_scale, self.ve_gate_scale = config.qk_scale, config.ve_gate_scale
        self.rotary_bf16 = config.rotary_bf16
        # c_q, c_k, c_v (and ve_gate) stacked by GPT.prepare_for_inference; a buffer so .to() carries it, never saved
        self.register_buffer("inference_weight", None, persistent=False)

    def forward(self, x, cos, sin, kv_cache, value_embed=None):
        B, T, C = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        if self.inference_weight is not None and not torch.is_grad_enabled():
            # one matmul for q, k, v and the gate (GPT.prepare_for_inference), one rotary + QK-norm for q and k side by
            # side. Only without grad: a backward through it would never reach c_q, c_k, c_v.
            out = F.linear(x, self.inference_weight)
            qk = out[..., :(H + H_kv) * D].view(B, T, H + H_kv, D)
            v = out[..., (H + H_kv) * D:(H + 2 * H_kv) * D].view(B, T, H_kv, D)
            logits = out[..., (H + 2 * H_kv) * D:]
            cos, sin = cos.to(qk.dtype), sin.to(qk.dtype)  # no-op unless autocast changed the activation dtype
            q, k = self.rotary_norm(qk, cos, sin).split((H, H_kv), dim=2)
        else:
            q, k, v = self.project_qkv(x)
            q, k, v = q.view(B, T, H, D), k.view(B, T, H_kv, D), v.view(B, T, H_kv, D)
            logits = self.ve_gate(x[..., :self.ve_gate.in_features]) if value_embed is not None else None
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # no-op unless autocast changed the activation dtype
            q, k = self.rotary_norm(q, cos, sin), self.rotary_norm(k, cos, sin)
        if value_embed is not None:
            v = self.add_value_embed(v, value_embed.view(B, T, H_kv, D), logits)
        if self.qk_scale != 1.0:
            q, k = q * self.qk_scale, k * self.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D) for SDPA
        y = self.attend(q, k, v, kv_cache).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)

    def project_qkv(self, x):
        """c_q(x), c_k(x), c_v(x), (B, T, width) each: a method of its own so that a swap can run the three projections
        of one input together (nanochat/kernels/fp8.py quantises x once for them)."""
        return self.c_q(x), self.c_k(x), self.c_v(x)

    def rotary_norm(self, x, cos, sin):
        """Rotary embedding (split halves, transformers' NanoChat's signs), then the QK-norm, of (B, T, H, D) q or k
        (or both side by side)."""
        d = x.size(-1) // 2
        x1, x2 = x[..., :d], x[..., d:]
        return self.qk_norm(torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1))

    def add_value_embed(self, v, value_embed, logits):
        """v plus the (B, T, H_kv, D) value embedding, gated per kv head by ve_gate_scale * sigmoid(logits): in (0, 2),
        1 at init (zero gate weights)."""
        return v + (self.ve_gate_scale * torch.sigmoid(logits)).unsqueeze(-1) * value_embed

    def attend(self, q, k, v, kv_cache):
        """Causal attention of (B, H, T, D) q over (B, H_kv, T, D) k and v within the layer's window, with a kv_cache
        over each row's cached prefix too (the cache takes the new k and v). Returns (B, H, T, D)."""
        T = q.size(2)
        row_mask = None
        if kv_cache is not None:  # independent sequences (engine.RowKVCache): each row its length and mask
            k, v, row_mask = kv_cache.update(self.layer_idx, k, v, self.window)
        # a CPU's fp32 cache under bf16 autocast (common.kv_cache_dtype): attend in fp32, autocast kept off SDPA, which
        # it would otherwise cast back to bf16
        attend_in_fp32 = k.dtype == torch.float32 and q.dtype != k.dtype
        if attend_in_fp32:
            q = q.to(k.dtype)
        # New query i sits at position (keys - T) + i: it sees the cached prefix and the new keys up to itself, within
        # the window. (is_causal would align the mask top-left, wrong when there are fewer queries than keys.)
        mask = row_mask if row_mask is not None else band_mask(T, k.size(2), self.window, q.device)
        if mask is not None and kv_cache is None and q.is_cuda and torch.compiler.is_compiling():
            return flex_band_attention(q, k, v, self.window)
        # enable_gqa: transformers' repeat_kv grouping without materialising repeated k/v (faster on CPU too)
        with torch.autocast(q.device.type, enabled=False) if attend_in_fp32 else nullcontext(), attention_backends(q):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                  enable_gqa=self.n_kv_head != self.n_head)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        # h * h, not h.square(): square is pow, which CUDA's autocast runs in fp32, and the backward would keep that fp32
        # copy of the 4x-wide hidden layer. A bf16 product rounded once is the same number either way.
        h = F.relu(self.c_fc(x))
        return self.c_proj(h * h)


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.norm = RMSNorm(config.norm_eps)

    def forward(self, x, cos, sin, kv_cache, value_embed=None):
        x = x + self.attn(self.norm(x), cos, sin, kv_cache, value_embed)
        return x + self.mlp(self.norm(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        config.validate()
        self.config = config
        # _weight skips nn.Embedding's random init (init_weights sets it): on meta, normal_() imports torch._dynamo
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.vocab_size, config.n_embd, _weight=torch.empty(config.vocab_size, config.n_embd)),
            "h": nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
        })
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        kv_dim = config.n_kv_head * (config.n_embd // config.n_head)
        if config.value_embeds:  # keyed by layer index; lookups like wte, so they cost no FLOPs
            self.value_embeds = nn.ModuleDict({
                str(i): nn.Embedding(config.vocab_size, kv_dim, _weight=torch.empty(config.vocab_size, kv_dim))
                for i in range(config.n_layer) if has_value_embed(config, i)})
        if config.residual_scalars:
            self.resid_lambdas = nn.Parameter(torch.empty(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.empty(config.n_layer))
        if config.smear:
            self.smear_gate = nn.Linear(min(config.smear_gate_channels, config.n_embd), 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.empty(1))
        if config.backout:
            self.backout_lambda = nn.Parameter(torch.empty(1))
        self.norm = RMSNorm(config.norm_eps)  # of the embedding and before lm_head
        # base_train --checkpoint-activations: a training choice, so not in the config or a checkpoint. Each block keeps
        # only its input and reruns its forward in the backward: one block's activations alive, a third more compute.
        self.checkpoint_activations = False
        # Rotary tables are derived, not learned: non-persistent, filled by init_rotary().
        head_dim = config.n_embd // config.n_head
        rotary_len = ROTARY_LENGTH_FACTOR * config.sequence_len
        self.register_buffer("cos", torch.empty(1, rotary_len, 1, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(1, rotary_len, 1, head_dim // 2), persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """Fill every parameter and the rotary tables (after to_empty). wte ~ N(0, 1) (normed right away), lm_head
        ~ N(0, 0.001) (near-uniform predictions), c_q/c_k/c_v/c_fc and value embeddings uniform with std n_embd^-0.5;
        both c_proj zero, so every block starts as the identity, and the components at (or next to) the identity."""
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        bound = math.sqrt(3.0) * self.config.n_embd ** -0.5
        for block in self.transformer.h:
            for linear in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(linear.weight, -bound, bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if hasattr(block.attn, "ve_gate"):
                nn.init.zeros_(block.attn.ve_gate.weight)
        c = self.config
        for embedding in self.embedding_tables()[1:]:  # the value embeddings
            nn.init.uniform_(embedding.weight, -bound, bound)
        if c.residual_scalars:
            nn.init.ones_(self.resid_lambdas)
            nn.init.zeros_(self.x0_lambdas)
        if c.smear:
            nn.init.zeros_(self.smear_gate.weight)
            nn.init.zeros_(self.smear_lambda)
        if c.backout:
            nn.init.zeros_(self.backout_lambda)
        self.store_embeddings_in_compute_dtype()
        self.init_rotary()

    def embedding_tables(self):
        """wte and the value embeddings: tables read by lookup."""
        return [self.transformer.wte] + (list(self.value_embeds.values()) if self.config.value_embeds else [])

    def store_embeddings_in_compute_dtype(self):
        """Keep the embedding tables in the compute dtype where it is bf16, as the reference does: autocast never casts
        a lookup, and in fp32 they cost 16 bytes a parameter against 8 (dev/LOG.md). AdamW's math stays fp32. Under
        fp16 they stay fp32, as every other parameter: AdamW's moments (kept in the table's dtype) and its eps would
        underflow fp16's range, and a loss scale's gradients are unscaled in the parameters' dtype."""
        dtype = get_compute_dtype(self.get_device())
        if dtype != torch.bfloat16:
            return
        for table in self.embedding_tables():
            table.weight.data = table.weight.data.to(dtype)

    @torch.no_grad()
    def init_rotary(self):
        """(Re)compute the rotary cos/sin tables on the model's device, stored in the compute dtype."""
        device = self.get_device()
        head_dim = self.config.n_embd // self.config.n_head
        # Same arithmetic as transformers: inv_freq = theta^-(2i/d), angles = position * inv_freq in fp32.
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                                                     / head_dim))
        angles = torch.outer(torch.arange(self.cos.size(1), device=device, dtype=torch.float32), inv_freq)
        dtype = get_compute_dtype(device)
        cos, sin = angles.cos(), angles.sin()
        if self.config.rotary_bf16:  # the values another project's tables had (an imported checkpoint's exact math)
            cos, sin = cos.bfloat16(), sin.bfloat16()
        self.cos = cos.to(dtype)[None, :, None, :]
        self.sin = sin.to(dtype)[None, :, None, :]

    def get_device(self):
        return self.transformer.wte.weight.device

    @torch.no_grad()
    def prepare_for_inference(self):
        """For a model that will only generate, on a CPU (a no-op elsewhere). Not for training or saving: on a bf16 CPU
        the fp32 weights are gone. Each attention's c_q, c_k, c_v (and gate, zero-padded to n_embd inputs) become
        views into one stacked matrix, one matmul where a batch-1 decode step pays a fixed cost per op. Under bf16
        autocast every linear's weight is stored in bf16 once (the values autocast would make on every call) and
        oneDNN's per-shape kernel caches are bounded (dev/LOG.md). Norms and scalars stay fp32."""
        device = self.get_device()
        if device.type != "cpu":
            return self
        if get_compute_dtype(device) == torch.bfloat16:
            bound_onednn_caches()  # the bf16 matmuls' kernels, one per shape: a server meets many
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.data = module.weight.data.to(torch.bfloat16)
        for block in self.transformer.h:
            attn = block.attn
            linears = [attn.c_q, attn.c_k, attn.c_v] + ([attn.ve_gate] if hasattr(attn, "ve_gate") else [])
            # the gate reads the first ve_gate.in_features channels: zero weights for the rest give the same logits
            attn.inference_weight = torch.cat([F.pad(linear.weight, (0, self.config.n_embd - linear.in_features))
                                               for linear in linears])
            # the separate weights become views into the stacked one, so the model holds each value once
            start = 0
            for linear in linears:
                linear.weight.data = attn.inference_weight[start:start + linear.out_features, :linear.in_features]
                start += linear.out_features
        return self

    def num_params(self):
        return sum(p.numel() for p in self.parameters())

    def embedding_params(self):
        """Parameters read by lookup: they cost no FLOPs, so scaling laws leave them out."""
        return sum(t.weight.numel() for t in self.embedding_tables())

    def estimate_flops(self):
        """Training FLOPs per token: 6 per non-embedding parameter (2 forward, 4 backward; a component's scalars
        overcount slightly), plus QK^T and AV, 12 * n_head * head_dim * T per layer over the full T (not the causal
        half), a sliding-window layer's window instead of T."""
        c = self.config
        head_dim = c.n_embd // c.n_head
        matmul_params = self.num_params() - self.embedding_params()
        keys_seen = sum(min(attention_window(c, i) or c.sequence_len, c.sequence_len) for i in range(c.n_layer))
        return 6 * matmul_params + 12 * c.n_head * head_dim * keys_seen

    def setup_optimizers(self, unembedding_lr, embedding_lr, matrix_lr, weight_decay=0.0, adam_betas=(0.8, 0.95),
                         scalar_lr=0.005):
        """(adamw_groups, muon_groups) at the depth dial's lrs (this module may not import the optimizers). AdamW:
        lm_head, and the embedding tables at embedding_lr, both scaled by (n_embd/768)^-0.5, and the components'
        scalars and gates at scalar_lr; Muon: the 2-D block matrices, a group per shape. Each records initial_lr."""
        adamw_scale = (self.config.n_embd / 768) ** -0.5
        c = self.config
        embeddings = [table.weight for table in self.embedding_tables()]
        gates = [block.attn.ve_gate.weight for block in self.transformer.h if hasattr(block.attn, "ve_gate")]
        scalars = gates + ([self.resid_lambdas, self.x0_lambdas] if c.residual_scalars else []) \
            + ([self.smear_gate.weight, self.smear_lambda] if c.smear else []) + ([self.backout_lambda] if c.backout else [])
        adamw_groups = [
            {"params": [self.lm_head.weight], "lr": unembedding_lr * adamw_scale},
            {"params": embeddings, "lr": embedding_lr * adamw_scale},
        ] + ([{"params": scalars, "lr": scalar_lr}] if scalars else [])
        for group in adamw_groups:
            group.update(betas=adam_betas, eps=1e-10, weight_decay=0.0)
        by_shape = {}  # insertion order = model definition order, so groups are deterministic
        gate_ids = {id(p) for p in gates}
        for p in self.transformer.h.parameters():
            if id(p) in gate_ids:
                continue
            assert p.ndim == 2, "Muon only handles matrices; every block parameter should be 2-D"
            by_shape.setdefault(tuple(p.shape), []).append(p)
        muon_groups = [{"params": params, "lr": matrix_lr, "weight_decay": weight_decay} for params in by_shape.values()]
        for group in adamw_groups + muon_groups:
            group["initial_lr"] = group["lr"]
        grouped = [id(p) for group in adamw_groups + muon_groups for p in group["params"]]
        assert len(grouped) == len(set(grouped)) == len(list(self.parameters())), "each parameter must be in exactly one group"
        return adamw_groups, muon_groups

    def _softcap_logits(self, x):
        logits = self.lm_head(x).float()
        cap = self.config.logit_softcap
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def _smear(self, x, kv_cache):
        """e_t += smear_lambda * sigmoid(w . e_t[:32]) * e_(t-1). The first position of a sequence has no previous
        token; at decode the previous token is the last one the cache saw, whose embedding the cache keeps."""
        channels = self.smear_gate.in_features
        lam = self.smear_lambda.to(x.dtype)  # (1,)-shaped: it would promote a bf16 x to fp32
        if kv_cache is None:
            # slices of x, not a shifted copy: that would be one more (B, T, C) tensor kept for the backward
            gate = torch.sigmoid(self.smear_gate(x[:, 1:, :channels]))
            return torch.cat((x[:, :1], x[:, 1:] + lam * gate * x[:, :-1]), dim=1)
        previous = kv_cache.swap_last_embedding(x).to(x.dtype)  # zeros for a row with nothing cached
        previous = torch.cat((previous, x[:, :-1]), dim=1)
        gate = torch.sigmoid(self.smear_gate(x[..., :channels]))
        return x + lam * gate * previous

    def _mix_residual(self, x, x0, i):
        """The residual_scalars component before block i (residual_mix)."""
        if torch.compiler.is_compiling():
            # Recomputed in the backward, not kept: compiled, the partitioner saved every layer's mix beside the
            # two tensors it is made from, one (B, T, C) a layer (dev/LOG.md); the recompute is one pass.
            return checkpoint(residual_mix, x, x0, self.resid_lambdas[i], self.x0_lambdas[i], use_reentrant=False)
        return residual_mix(x, x0, self.resid_lambdas[i], self.x0_lambdas[i])

    def _token_losses(self, rows, targets):
        """(N,) cross-entropy of each of rows (N, C) through lm_head and the softcap against targets (N,); 0 where a
        target is -1."""
        return F.cross_entropy(self._softcap_logits(rows), targets, ignore_index=-1, reduction="none")

    def _loss_sum(self, rows, targets):
        """The cross-entropy of rows (N, C) against targets (N,), summed over the targets that are not -1."""
        return self._token_losses(rows, targets).sum()

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", logits_at=None):
        """idx (B, T) token ids. Without targets: fp32 logits (B, T, vocab_size), or with logits_at, a (B,) tensor of
        positions, (B, 1, vocab_size) (a prefill needs one position's). With targets (B, T): cross-entropy ignoring -1,
        reduced by "mean" (over valid targets; 0 if none), "sum", or "none" ((B, T), 0 where ignored).
        With a kv_cache, each row continues from its own length, attends to its cache, and the cache advances by T."""
        B, T = idx.shape
        end = T if kv_cache is None else kv_cache.max_position(T)
        if end > self.cos.size(1):
            raise ValueError(f"position {end} is beyond the rotary table ({self.cos.size(1)} positions)")
        if kv_cache is None:
            cos, sin = self.cos[:, :T], self.sin[:, :T]
        else:
            positions = kv_cache.positions(T)  # (B, T): each row continues from its own length
            cos, sin = self.cos[0, positions], self.sin[0, positions]  # (B, T, 1, head_dim / 2)
        c = self.config
        x = self.transformer.wte(idx)
        # the residual stream runs in autocast's dtype where it is on, else the matmuls' weights': a lookup keeps its
        # table's dtype (autocast leaves lookups alone), so the embedding is cast to it
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else self.lm_head.weight.dtype
        dtype = dtype if dtype.is_floating_point else torch.float32  # int8 weights (kernels/int8.py) take fp32 input
        x = self.norm(x.to(dtype))
        if c.smear:
            x = self._smear(x, kv_cache)
        x0, x_mid = x, None
        for i, block in enumerate(self.transformer.h):
            if c.residual_scalars:
                x = self._mix_residual(x, x0, i)
            value_embed = self.value_embeds[str(i)](idx).to(x.dtype) if has_value_embed(c, i) else None
            if self.checkpoint_activations and kv_cache is None and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, None, value_embed, use_reentrant=False)
            else:
                x = block(x, cos, sin, kv_cache, value_embed)
            if c.backout and i == (c.n_layer // 2 - 1 if c.backout_layer is None else c.backout_layer):
                x_mid = x
        if c.backout:
            # the lambda as x's dtype: a (1,)-shaped fp32 parameter times a bf16 tensor would promote it to fp32
            x = x - self.backout_lambda.to(x.dtype) * (x_mid if x_mid is not None else x0)  # one layer: the input
        x = self.norm(x)
        if kv_cache is not None:
            kv_cache.advance(T)
        if logits_at is not None:
            if targets is not None:
                raise ValueError("logits_at is for inference: it cannot be combined with targets")
            if T == 1:  # a decode step: its one position, whatever logits_at says (no gather: a few us of a sub-ms step)
                return self._softcap_logits(x)
            return self._softcap_logits(x[torch.arange(B, device=x.device), logits_at][:, None])
        if targets is None:
            return self._softcap_logits(x)
        if loss_reduction not in ("mean", "sum", "none"):
            raise ValueError(f"loss_reduction must be 'mean', 'sum' or 'none' (got {loss_reduction!r})")
        flat_targets = targets.reshape(-1)
        rows = x.view(B * T, -1)
        if loss_reduction == "none":
            return self._token_losses(rows, flat_targets).view(B, T)
        total = self._loss_sum(rows, flat_targets)
        if loss_reduction == "sum":
            return total
        # Divide by the valid count ourselves so a batch with no valid target gives 0, not NaN.
        return total / (flat_targets != -1).sum().clamp(min=1)


def build_model(config, device):
    """A freshly initialised GPT on `device` from a GPTConfig or its dict (built on meta, then materialised)."""
    if not isinstance(config, GPTConfig):
        config = config_from_dict(config)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()  # also builds the non-persistent rotary buffers
    return model
