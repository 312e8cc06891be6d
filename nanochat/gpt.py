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
names follow the original nanochat checkpoint layout (model/hf_export.py maps one onto the other).

The model is built on the meta device and then materialised and initialised explicitly, which is
what `build_model(config, device)` at the bottom of this file does:

    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()

Components of the reference project's later recipe are options of GPTConfig, all off by default (off is the
model above, which is what transformers' NanoChat describes); each starts as the identity, or nearly so:

    value_embeds       on the lower half of the layers a per-token embedding is added to attention's values,
                       v += 2 sigmoid(W x[:32]) * ve[token], one gate per kv head (value_embed_layers below)
    residual_scalars   before block i: x <- resid_lambdas[i] * x + x0_lambdas[i] * x0, x0 the normed embedding
    smear              each position's embedding gets a gated share of the previous token's:
                       e_t += smear_lambda * sigmoid(w . e_t[:32]) * e_(t-1)
    backout            before the final norm: x <- x - backout_lambda * (the residual after layer n_layer // 2)
    sliding_window     every layer but the last and every fourth one below it attends only to the last
                       sequence_len // 2 positions (itself included): less attention work at long context. Compiled
                       (torch.compile, a GPU's training path) it runs as FlexAttention with a block mask that skips
                       the blocks outside the band; on the CPU training path cpu_ops' block attention skips them;
                       anywhere else (eager, decoding with the KV cache) it is SDPA with a boolean band mask.

Inference goes through `forward(idx, kv_cache=rows)` with rows of the batching engine's cache
(engine.RowView, or StaticDecodeView for a captured decode step): independent sequences at their own lengths.
The cache gives each row's positions, writes the rows' new keys and values and returns what each row attends to
with its mask, keeps the last token's embedding for smear, and advances by the tokens consumed. `logits_at` asks for
one position's logits per row, as a prefill needs.
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
from nanochat.model import cpu_ops

NORM_EPS = 1e-6  # transformers' NanoChatConfig.rms_norm_eps default; explicit so both sides agree
ROPE_THETA = 10000.0
LOGIT_SOFTCAP = 15.0
ROTARY_LENGTH_FACTOR = 10  # rotary tables cover 10x sequence_len so generation can run past the training length
GATE_CHANNELS = 32  # the leading residual channels a component's gate reads (cheap, and enough to decide)
# The optional components, in GPTConfig; False everywhere is the model transformers' NanoChat describes.
COMPONENTS = ("value_embeds", "residual_scalars", "smear", "backout", "sliding_window")
VALUE_EMBED_LAYERS = ("lower_half", "alternating")  # GPTConfig.value_embed_layers, besides an explicit "0,2,5" list
# Exact-math options (GPTConfig, below): other projects' variants of this model, which scripts.import_model sets to
# reproduce a checkpoint's logits. Their defaults are this model, and a checkpoint's meta leaves a default out.
VARIANT_DEFAULTS = {"rope_theta": ROPE_THETA, "rotary_bf16": False, "norm_eps": NORM_EPS, "qk_scale": 1.0,
                    "logit_softcap": LOGIT_SOFTCAP, "ve_gate_channels": GATE_CHANNELS, "ve_gate_scale": 2.0,
                    "smear_gate_channels": GATE_CHANNELS, "backout_layer": None, "attention_windows": None}
# GPTConfig fields a checkpoint's model_config may leave out (a missing one reads as the plain model's / the old default)
OPTIONAL_FIELDS = COMPONENTS + ("value_embed_layers",) + tuple(VARIANT_DEFAULTS)
# The largest shapes a GPTConfig takes. A checkpoint's meta.json or an imported config is a file anyone may write, and
# GPT(config) trusts its shapes: n_layer 10^6 spent minutes building blocks before any check, n_embd 2^40 overflowed in
# torch. The bounds are generous: several times the largest public models of this kind (Llama 3.1 405B: 126 layers,
# width 16,384, 128 heads, a 128K context; Gemma 3: 262,144 tokens), far past nanochat's (d32: 32 layers, width 2,048,
# a 2,048-token context). The context's is the tightest, because the rotary tables are built up front for
# ROTARY_LENGTH_FACTOR times it, whatever the weights: at 2^18 positions and head_dim 128, 1.3 GB. The worst case
# within every bound builds on the meta device in about half a second.
SHAPE_LIMITS = {"sequence_len": 2**18, "vocab_size": 2**20, "n_layer": 1024, "n_head": 2**16, "n_kv_head": 2**16,
                "n_embd": 2**16, "ve_gate_channels": 2**16, "smear_gate_channels": 2**16}


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
    # components of the reference project's later recipe (module docstring); off = the model above
    value_embeds: bool = False
    residual_scalars: bool = False
    smear: bool = False
    backout: bool = False
    sliding_window: bool = False
    # Where value embeddings sit: "lower_half" (layers below n_layer // 2, at least layer 0), or "alternating" (the
    # last layer and every second one below it), where checkpoints saved before this field existed have them. On the
    # last layer a value embedding lets the final attention copy a context token straight to the output: at seed 43
    # the CPU speedrun's base model then echoed the subject for "X borders ..." (dev/LOG.md, "Where the
    # value embeddings sit").
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
        for name in COMPONENTS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be true or false (got {getattr(self, name)!r})")
        if self.value_embed_layers not in VALUE_EMBED_LAYERS and explicit_layers(self.value_embed_layers, self.n_layer) is None:
            raise ValueError(f"GPTConfig.value_embed_layers must be one of {', '.join(VALUE_EMBED_LAYERS)} or a comma "
                             f"list of layer indices below n_layer (got {self.value_embed_layers!r})")
        for name in ("rope_theta", "qk_scale", "ve_gate_scale") + (("norm_eps",) if self.norm_eps is not None else ()) \
                + (("logit_softcap",) if self.logit_softcap is not None else ()):
            value = getattr(self, name)
            if not is_positive_number(value):
                raise ValueError(f"GPTConfig.{name} must be a positive number (got {value!r:.60})")
        if not isinstance(self.rotary_bf16, bool):
            raise ValueError(f"GPTConfig.rotary_bf16 must be true or false (got {self.rotary_bf16!r})")
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


# -----------------------------------------------------------------------------
# The blocks. On a CPU in fp32 the elementwise pieces run as the hand-written autograd Functions of
# cpu_ops (same math, fewer passes over memory); elsewhere (CUDA, any autocast, NANOCHAT_CPU_OPS=0)
# the plain torch expressions below run.


def norm(x, eps=NORM_EPS):
    """Parameter-free RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps); eps None is torch's default, the
    machine epsilon of x's dtype (GPTConfig.norm_eps). The result keeps x's dtype (the kernel sums in fp32)."""
    if cpu_ops.is_cpu_fp32(x):
        return cpu_ops.rms_norm(x, torch.finfo(x.dtype).eps if eps is None else eps)
    # CUDA's autocast lists rms_norm among the ops it runs in fp32: a bf16 residual stream would come out of every norm
    # as fp32, and its backward would save that fp32 copy (CPU autocast leaves rms_norm alone, so only a GPU showed it)
    with outside_autocast(x):
        return F.rms_norm(x, (x.size(-1),), eps=eps)


def residual_mix(x, x0, resid_lambda, x0_lambda):
    """The residual_scalars component before a block: the stream rescaled, plus a share of the normed embedding x0."""
    return resid_lambda * x + x0_lambda * x0


def outside_autocast(x):
    """A context in which ops on x run in x's own dtype: autocast off where it is on for x's device, else nothing."""
    return torch.autocast(x.device.type, enabled=False) if torch.is_autocast_enabled(x.device.type) else nullcontext()


def activation_dtype(x, weights_dtype):
    """The dtype the residual stream runs in: autocast's where it is on for x's device (bf16 on a GPU), else the
    matmuls' weights'. An embedding lookup returns its table's dtype, which autocast leaves alone (and a table stored
    in bf16 meets fp32 weights when autocast is off); cast to this, every activation from the embedding on has the
    dtype of the matmuls' outputs."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else weights_dtype


def rotary_norm(x, cos, sin, eps=NORM_EPS, exact_rotation=True):
    """
    Rotary embedding, then RMSNorm (the QK-norm), of (B, T, H, D) queries or keys. The first and second
    halves of D form the pairs (not interleaved), and the sign convention is the one transformers'
    NanoChat uses: first half gets +x2*sin, second half gets -x1*sin. cpu_ops' fused version takes the norm before
    rotating, which only a length-preserving rotation allows: not bf16-rounded tables (exact_rotation=False).
    """
    if cpu_ops.is_cpu_fp32(x) and exact_rotation:
        return cpu_ops.rotary_norm(x, cos, sin, torch.finfo(x.dtype).eps if eps is None else eps)
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return norm(torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1), eps)

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
    """
    How many positions (itself included) a query of this layer sees, or None for all of them. With sliding_window
    the last layer and every fourth one below it keep full attention (the short layers' reach adds up through
    them) and the others see the last sequence_len // 2 positions.
    """
    if config.attention_windows is not None:
        return config.attention_windows[layer_idx] or None
    if not config.sliding_window or (config.n_layer - 1 - layer_idx) % 4 == 0:
        return None
    return max(1, config.sequence_len // 2)


def band_mask(n_queries, n_keys, window, device):
    """
    Boolean (n_queries, n_keys) mask, True = may attend, for the last n_queries positions of n_keys: causal, and
    within `window` positions when window is not None. None when no window cuts and either nothing is cached
    (is_causal gives it) or there is one query (it sees every key): the common cases need no mask.
    """
    prefix = n_keys - n_queries
    if (window is None or window >= n_keys) and (prefix == 0 or n_queries == 1):
        return None
    key_pos = torch.arange(n_keys, device=device)
    query_pos = torch.arange(prefix, n_keys, device=device)[:, None]
    allowed = key_pos <= query_pos
    if window is not None:
        allowed = allowed & (key_pos > query_pos - window)
    return allowed


# Attention kernels for inference on CUDA: all but cuDNN's. cuDNN builds an execution plan per sequence length (tens of
# ms each: measured on an H100, torch 2.11, a d12 decode step 50-70 ms against 7.7 ms at a length it had seen), and
# inference meets a new length at every decoded token and every prompt. Training keeps cuDNN (one length, planned once).
SHAPE_FREE_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(q):
    """The SDPA kernels for this call: outside cuDNN when it would meet ever-new lengths (eager CUDA inference)."""
    if q.is_cuda and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return sdpa_kernel(SHAPE_FREE_ATTENTION)
    return nullcontext()


def flex_band_attention(q, k, v, window):
    """
    Causal attention of (B, H, T, D) q and (B, H_kv, T, D) k, v within `window` positions, by FlexAttention: blocks
    entirely outside the band are skipped, which is where sliding windows save time. Meant for the compiled CUDA
    path: the block mask is built inside the graph every step (a cheap pass over T x T, no Python-side cache for
    dynamo to guard on), and eager FlexAttention would materialise the full score matrix.
    """
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
        self.eps, self.qk_scale, self.ve_gate_scale = config.norm_eps, config.qk_scale, config.ve_gate_scale
        self.rotary_bf16 = config.rotary_bf16
        # c_q, c_k, c_v (and ve_gate) stacked by GPT.prepare_for_inference; a buffer so .to() carries it, never saved
        self.register_buffer("inference_weight", None, persistent=False)

    def forward(self, x, cos, sin, kv_cache, value_embed=None):
        B, T, C = x.shape
        H, H_kv, D = self.n_head, self.n_kv_head, self.head_dim
        exact = not self.rotary_bf16
        if self.inference_weight is not None and not torch.is_grad_enabled():
            # one matmul for q, k, v and the gate (GPT.prepare_for_inference), and one rotary + QK-norm for q and
            # k side by side: at batch 1 a decode step is a few dozen tiny ops, each paying a fixed cost. Only without
            # grad: a backward through it would never reach c_q, c_k, c_v.
            out = F.linear(x, self.inference_weight)
            qk = out[..., :(H + H_kv) * D].view(B, T, H + H_kv, D)
            v = out[..., (H + H_kv) * D:(H + 2 * H_kv) * D].view(B, T, H_kv, D)
            logits = out[..., (H + 2 * H_kv) * D:]
            cos, sin = cos.to(qk.dtype), sin.to(qk.dtype)  # no-op unless autocast changed the activation dtype
            q, k = rotary_norm(qk, cos, sin, self.eps, exact).split((H, H_kv), dim=2)
        else:
            q = self.c_q(x).view(B, T, H, D)
            k = self.c_k(x).view(B, T, H_kv, D)
            v = self.c_v(x).view(B, T, H_kv, D)
            logits = self.ve_gate(x[..., :self.ve_gate.in_features]) if value_embed is not None else None
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # no-op unless autocast changed the activation dtype
            q, k = rotary_norm(q, cos, sin, self.eps, exact), rotary_norm(k, cos, sin, self.eps, exact)  # rotary, QK-norm
        if value_embed is not None:  # gate in (0, 2), 1 at init (zero gate weights)
            value_embed = value_embed.view(B, T, H_kv, D)
            if cpu_ops.is_cpu_fp32(v):
                v = cpu_ops.gated_add(v, value_embed, logits, self.ve_gate_scale)
            else:
                v = v + (self.ve_gate_scale * torch.sigmoid(logits)).unsqueeze(-1) * value_embed
        if self.qk_scale != 1.0:
            q, k = q * self.qk_scale, k * self.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D) for SDPA

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
        if kv_cache is None and self.n_kv_head == self.n_head and cpu_ops.cpu_training_attention(q, k, v):
            y = cpu_ops.block_causal_attention(q, k, v, window=self.window)
        else:
            mask = row_mask if row_mask is not None else band_mask(T, k.size(2), self.window, q.device)
            if mask is not None and kv_cache is None and q.is_cuda and torch.compiler.is_compiling():
                y = flex_band_attention(q, k, v, self.window)
            else:
                # enable_gqa lets query head h read kv head h // (n_head/n_kv_head), the same grouping as
                # transformers' repeat_kv, without materialising repeated k/v (measured faster on CPU too).
                with torch.autocast(q.device.type, enabled=False) if attend_in_fp32 else nullcontext(), attention_backends(q):
                    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                                       enable_gqa=self.n_kv_head != self.n_head)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        if cpu_ops.is_cpu_fp32(x) and type(self.c_fc) is nn.Linear:  # a swapped-in linear (fp8) runs its own forward
            return cpu_ops.relu_squared_mlp(x, self.c_fc.weight, self.c_proj.weight)
        # h * h, not h.square(): square is pow, which CUDA's autocast runs in fp32, and the backward would keep that fp32
        # copy of the 4x-wide hidden layer. A bf16 product rounded once is the same number either way.
        h = F.relu(self.c_fc(x))
        return self.c_proj(h * h)


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.eps = config.norm_eps

    def forward(self, x, cos, sin, kv_cache, value_embed=None):
        x = x + self.attn(norm(x, self.eps), cos, sin, kv_cache, value_embed)
        x = x + self.mlp(norm(x, self.eps))
        return x


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
        # Activation checkpointing (base_train --checkpoint-activations): a training choice, not part of the model,
        # so not in the config or a checkpoint. Each block keeps only its input for the backward and runs its forward
        # again there: one block's activations alive at a time instead of every block's, for a third more compute.
        self.checkpoint_activations = False
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
        and, for the optional components, a start at (or next to) the identity:
          value_embeds  uniform like c_v, their gates zero (gate 1)     resid_lambdas 1, x0_lambdas 0
          smear_gate zero, smear_lambda 0                               backout_lambda 0
        """
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
        if c.value_embeds:
            for embedding in self.value_embeds.values():
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

    def store_embeddings_in_compute_dtype(self):
        """
        Keep wte and the value-embedding tables in the compute dtype where it is bf16 (a GPU, a CPU with AVX512-BF16),
        as the reference project does. They are looked up, not multiplied, so autocast never casts them, and in fp32
        they cost 16 bytes a parameter (weights, gradients, AdamW's two moments) against 8: at d24 the 13 tables hold
        654 M parameters, ~5 GB more than bf16. AdamW still does its arithmetic in fp32 (torch's fused kernel).
        """
        dtype = get_compute_dtype(self.get_device())
        if dtype == torch.float32:
            return
        tables = [self.transformer.wte] + (list(self.value_embeds.values()) if self.config.value_embeds else [])
        for table in tables:
            table.weight.data = table.weight.data.to(dtype)

    @torch.no_grad()
    def init_rotary(self):
        """(Re)compute the rotary cos/sin tables on the model's device, stored in the compute dtype."""
        device = self.get_device()
        head_dim = self.config.n_embd // self.config.n_head
        rotary_len = self.cos.size(1)
        # Same arithmetic as transformers: inv_freq = theta^-(2i/d), angles = position * inv_freq in fp32.
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                                                     / head_dim))
        positions = torch.arange(rotary_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)
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
        """
        For a model that will only generate, on a CPU (a no-op elsewhere, where it is not measured). Not for training
        or saving: on a bf16 CPU the fp32 weights are gone (a forward with grad enabled takes the separate weights, so
        gradients stay right, but in bf16).
          - Each attention's c_q, c_k, c_v (and value-embedding gate, zero-padded to n_embd inputs) stacked into one
            matrix, so q, k, v and the gate come from one matmul: a batch-1 decode step of a small model is a few
            dozen tiny ops, each paying a fixed cost (3-4 matmuls -> 1 per layer took a d4 step from ~1.13 to ~0.93 ms).
            The separate weights become views into it, so each value is still held once.
          - On a CPU that computes in bf16 autocast, every linear's weight stored in bf16 once. Autocast otherwise
            casts each fp32 weight on every call, so a batch-1 decode step read the weights three times (fp32 in,
            bf16 out, bf16 in) and ran slower than fp32, and a server's memory grew with the copies. The stored
            values are the ones autocast would make, so the outputs stay those of the fp32 weights under autocast.
            It also bounds oneDNN's per-shape kernel caches (common.bound_onednn_caches), which a generating process
            fills with a new shape per batch size and prompt length.
        Norms and scalars stay fp32 (the embedding tables are already in the compute dtype: init_weights).
        """
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
        """Parameters read by lookup (wte, value embeddings): they cost no FLOPs, so scaling laws leave them out."""
        tables = [self.transformer.wte] + (list(self.value_embeds.values()) if self.config.value_embeds else [])
        return sum(t.weight.numel() for t in tables)

    def estimate_flops(self):
        """
        Training FLOPs per token (forward + backward):

            6 * (num_params - embedding params)  +  12 * n_layer * n_head * head_dim * sequence_len

        A matmul weight costs 2 FLOPs per token forward and 4 backward, hence 6 per parameter;
        the embeddings (wte, value embeddings) are lookups, not matmuls, so they are left out (lm_head is a
        matmul and counts; a component's scalars count 6 each, a slight overcount of their elementwise work).
        Attention adds two matmuls per layer that have no parameters, QK^T and AV, each
        2 * n_head * head_dim * T FLOPs per token forward (counted over the full T, not the
        causal half), times 3 for forward + backward: 12 * n_head * head_dim * T per layer, where a
        sliding-window layer counts its window instead of T.
        """
        c = self.config
        head_dim = c.n_embd // c.n_head
        matmul_params = self.num_params() - self.embedding_params()
        keys_seen = sum(min(attention_window(c, i) or c.sequence_len, c.sequence_len) for i in range(c.n_layer))
        return 6 * matmul_params + 12 * c.n_head * head_dim * keys_seen

    def setup_optimizers(self, unembedding_lr, embedding_lr, matrix_lr, weight_decay=0.0, adam_betas=(0.8, 0.95),
                         scalar_lr=0.005):
        """
        Parameter groups for the two optimizers (this module may not import them), at the lrs the depth dial
        chose (training.depth_recipe): returns (adamw_groups, muon_groups). AdamW gets lm_head and wte (and the
        value embeddings with wte's lr), each with its own lr scaled by (n_embd/768)^-0.5, and the components'
        scalars and gates at scalar_lr; Muon gets the 2-D block matrices, one group per distinct shape.
        Every group also records initial_lr so lr schedules can scale from it.
        """
        adamw_scale = (self.config.n_embd / 768) ** -0.5
        c = self.config
        embeddings = [self.transformer.wte.weight] + ([e.weight for e in self.value_embeds.values()] if c.value_embeds else [])
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
        assert set(grouped) == {id(p) for p in self.parameters()}
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
        if kv_cache is None and cpu_ops.is_cpu_fp32(x):
            return cpu_ops.smear(x, self.smear_gate(x[..., :channels]), self.smear_lambda)
        if kv_cache is None:
            # the first position unchanged and the others read their predecessor through slices of x: a shifted copy
            # of x (zeros first) would be one more (B, T, C) tensor kept for the backward
            gate = torch.sigmoid(self.smear_gate(x[:, 1:, :channels]))
            return torch.cat((x[:, :1], x[:, 1:] + lam * gate * x[:, :-1]), dim=1)
        previous = kv_cache.swap_last_embedding(x).to(x.dtype)  # zeros for a row with nothing cached
        previous = torch.cat((previous, x[:, :-1]), dim=1)
        gate = torch.sigmoid(self.smear_gate(x[..., :channels]))
        return x + lam * gate * previous

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", logits_at=None):
        """
        idx (B, T) token ids. Without targets: fp32 logits (B, T, vocab_size), or with logits_at, a (B,) tensor of
        positions, only those: (B, 1, vocab_size) (a prefill needs the last position's, and the head over every
        position of a prompt would cost a quarter of a small model's prefill). With targets (B, T):
        cross-entropy ignoring -1, reduced by "mean" (over valid targets; 0 if there are none),
        "sum", or "none" (a (B, T) tensor, 0 where ignored).
        With a kv_cache, each row's new tokens continue from its own length, attend to what the row has cached plus
        causally among themselves, and the cache advances by T.
        """
        B, T = idx.shape
        if kv_cache is not None:
            positions = kv_cache.positions(T)  # (B, T): each row continues from its own length
            if kv_cache.max_position(T) > self.cos.size(1):
                raise ValueError(f"position {kv_cache.max_position(T)} is beyond the rotary table ({self.cos.size(1)} "
                                 "positions)")
            cos, sin = self.cos[0, positions], self.sin[0, positions]  # (B, T, 1, head_dim / 2)
        else:
            if T > self.cos.size(1):
                raise ValueError(f"position {T} is beyond the rotary table ({self.cos.size(1)} positions)")
            cos, sin = self.cos[:, :T], self.sin[:, :T]

        c = self.config
        x = self.transformer.wte(idx)
        x = norm(x.to(activation_dtype(x, self.lm_head.weight.dtype)), c.norm_eps)
        if c.smear:
            x = self._smear(x, kv_cache)
        x0, x_mid = x, None
        for i, block in enumerate(self.transformer.h):
            if c.residual_scalars and cpu_ops.is_cpu_fp32(x):
                x = cpu_ops.residual_mix(x, x0, self.resid_lambdas[i], self.x0_lambdas[i])
            elif c.residual_scalars and torch.compiler.is_compiling():
                # Recomputed in the backward rather than kept: compiled, the partitioner saved every layer's mix for
                # its norm's backward beside the two tensors it is made from (both kept anyway), one (B, T, C) a
                # layer: 2.2 GiB of the d24 step's 57 on an H200. The recompute is one fused elementwise pass.
                x = checkpoint(residual_mix, x, x0, self.resid_lambdas[i], self.x0_lambdas[i], use_reentrant=False)
            elif c.residual_scalars:
                x = residual_mix(x, x0, self.resid_lambdas[i], self.x0_lambdas[i])
            value_embed = self.value_embeds[str(i)](idx).to(x.dtype) if has_value_embed(c, i) else None
            if self.checkpoint_activations and kv_cache is None and torch.is_grad_enabled():
                # the block's activations are recomputed in the backward from its input, not kept from the forward
                x = checkpoint(block, x, cos, sin, None, value_embed, use_reentrant=False)
            else:
                x = block(x, cos, sin, kv_cache, value_embed)
            if c.backout and i == (c.n_layer // 2 - 1 if c.backout_layer is None else c.backout_layer):
                x_mid = x
        if c.backout:
            # the lambda as x's dtype: a (1,)-shaped fp32 parameter times a bf16 tensor would promote it to fp32
            x = x - self.backout_lambda.to(x.dtype) * (x_mid if x_mid is not None else x0)  # one layer: the input
        x = norm(x, c.norm_eps)
        if kv_cache is not None:
            kv_cache.advance(T)
        if logits_at is not None:
            if targets is not None:
                raise ValueError("logits_at is for inference: it cannot be combined with targets")
            if T == 1:  # a decode step: its one position, whatever logits_at says (no gather: a few us of a sub-ms step)
                return self._softcap_logits(x)
            return self._softcap_logits(x[torch.arange(B, device=x.device), logits_at][:, None])
        if targets is not None and loss_reduction not in ("mean", "sum", "none"):
            raise ValueError(f"loss_reduction must be 'mean', 'sum' or 'none' (got {loss_reduction!r})")
        flat_targets = targets.reshape(-1) if targets is not None else None

        # CPU training (fp32, or bf16 autocast): the loss in chunks, never holding the full (B*T, V) logits (memory-bound
        # on a CPU).
        # Anywhere else the plain path runs: on a GPU torch.compile fuses it, and inference needs the logits.
        if targets is not None and loss_reduction != "none" and c.logit_softcap is not None \
                and cpu_ops.cpu_training_loss(x, self.lm_head.weight):
            total = cpu_ops.softcap_cross_entropy_sum(x.view(B * T, -1), self.lm_head.weight, flat_targets, c.logit_softcap)
        else:
            if targets is None:
                return self._softcap_logits(x)
            rows = x.view(B * T, -1)
            # A CPU evaluation takes the same math in the chunked loss's row chunks: the full (B*T, V) logits and
            # their temporaries cost ~200 MB of peak RSS at the CPU preset, as much as training itself.
            chunk = cpu_ops.LOSS_CHUNK_ROWS if x.device.type == "cpu" and not torch.is_grad_enabled() else max(1, B * T)
            losses = torch.cat([F.cross_entropy(self._softcap_logits(rows[i:i + chunk]), flat_targets[i:i + chunk],
                                                ignore_index=-1, reduction="none") for i in range(0, B * T, chunk)])
            if loss_reduction == "none":
                return losses.view(B, T)
            total = losses.sum()
        if loss_reduction == "sum":
            return total
        # Divide by the valid count ourselves so a batch with no valid target gives 0, not NaN.
        return total / (flat_targets != -1).sum().clamp(min=1)


def build_model(config, device):
    """A freshly initialised GPT on `device` from a GPTConfig or its dict (built on meta, then materialised)."""
    if not isinstance(config, GPTConfig):
        config = config_from_dict(config)
    cpu_ops.enabled()  # a bad NANOCHAT_CPU_OPS is refused here, before any compute, not inside the first forward
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.init_weights()  # also builds the non-persistent rotary buffers
    return model
