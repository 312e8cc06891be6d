"""
FP8 matmuls for training: `Fp8Linear`, a drop-in for a bias-free nn.Linear, and `convert_to_fp8`, the swap that puts it
in a built model (the blocks' linears and lm_head, where their sizes are multiples of 16). All three matmuls of a
layer take fp8 operands, each tensor scaled from its current amax (scale = FP8_MAX / amax, fp32): activations and
weights in e4m3 forward, the incoming gradient in e5m2 backward (gradients need the wider range). As in
modded-nanogpt, the forward accumulates fast (use_fast_accum), the two backward products precisely; outputs and
grad_x in the activation dtype, grad_W in the weight's.

How it meets torch.compile: the quantisation is plain aten ops inside an autograd.Function that Dynamo leaves whole
(allow_in_graph) and AOT autograd traces through, so amax, scale, cast and `torch._scaled_mm` sit in the model's one
static-shape graph, where inductor can fuse each amax and cast with the kernel that made the tensor (the norm, relu²,
the gradient's producer) instead of meeting an opaque op. Per linear, forward: one cast of x (q, k and v share
theirs: `Fp8Attention`); backward: one cast of grad_y (and, where the partitioner prefers it to keeping x's fp8
data, x's cast again from its saved scale); each transpose an H100's fp8 GEMM needs is taken from the 1-byte data.
Weights are not cast in the graph at all: each Fp8Linear keeps its weight's e4m3 copy in both layouts and its scale
(buffers, out of the state dict), made again after every step of an optimizer holding the weight, after
load_state_dict, and by an eager forward that sees the weight changed: once per optimizer step however many
micro-batches read it (Fp8Linear; `refresh_fp8_weights` after any other write, before a compiled model runs).
tests/test_fp8.py's census counts all of this in the graphs a compiled tiny GPT hands its backend.

`torch._scaled_mm` runs on CUDA from sm89; elsewhere the matmul is emulated in fp32 (the same quantised values, equal
up to fp32 rounding: for checking numerics; the CPU's _scaled_mm is a slow reference kernel, used only with
native=True). Shapes with a token count, in_features or out_features not a multiple of 16, or other dtypes, run plain
F.linear on every device, as does a device that cannot hold fp8. Call `fp8_available(device)` before torch.compile:
it caches.
"""

import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from nanochat import gpt
from nanochat.common import compile_backend
from nanochat.kernels.cpu import CpuCausalSelfAttention

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
AMAX_FLOOR = 1e-12  # an all-zero tensor (a zero-initialised projection) still gets a finite scale, not inf and NaN
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)

# Device types where the weights' casts (once a step: refresh_fp8_weights) run torch.compile'd, a graph per weight shape:
# a benchmark may empty it, a test add "cpu".
FUSED_DEVICE_TYPES = {"cuda"}
_DEVICE_MODE = {}  # ("native" | "emulated" | None) per device, filled by _device_mode


def fp8_amax(t):
    """max |t| in t's own dtype (abs and max only pick values: exact, and no fp32 copy of t). Over the last dimension
    first, then over those maxima: the first level is a per-row reduction, which inductor fuses into the kernel that
    made t (a norm, relu², a gradient's producer), leaving a pass over one value per row."""
    return t.abs().amax(dim=-1).amax() if t.dim() > 1 else t.abs().amax()


def fp8_scale(t, dtype):
    """FP8_MAX / amax(|t|) in fp32, a 0-dim tensor."""
    return FP8_MAX[dtype] / fp8_amax(t).float().clamp(min=AMAX_FLOOR)


def cast_to_fp8(t, scale, dtype):
    """t * scale (in fp32, so rounded once), saturated and cast to the fp8 dtype, row-major whatever t's layout."""
    fp8_max = FP8_MAX[dtype]
    # amax * scale often lands one fp32 ulp above FP8_MAX, and the cast is not promised to saturate
    # (e5m2 overflows to inf), hence the clamp
    return (t.float() * scale).clamp(-fp8_max, fp8_max).to(dtype, memory_format=torch.contiguous_format)


def quantize(t, dtype, transposed=False):
    """Tensorwise dynamic scaling of t to the fp8 dtype. Returns (q, inv_scale): t ~= q.float() * inv_scale; with
    transposed=True q holds a 2-D t's t^T, row-major, taken from the fp8 data."""
    scale = fp8_scale(t, dtype)
    q = cast_to_fp8(t, scale, dtype)
    return (q.t().contiguous() if transposed else q), scale.reciprocal()


def dequantize(q, inv_scale, dtype=torch.float32):
    return (q.float() * inv_scale).to(dtype)


def _device_mode(device):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device in _DEVICE_MODE:
        return _DEVICE_MODE[device]
    mode = None
    try:
        a = torch.ones(16, 16, device=device).to(E4M3)
        mode = "emulated"
        one = torch.ones((), device=device)
        if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
            mode = "native"
    except Exception:  # any failure of the probe just means the lesser mode
        pass
    _DEVICE_MODE[device] = mode
    return mode


def fp8_available(device):
    """Whether the native fp8 matmul (torch._scaled_mm) runs on this device; False means emulated or unsupported."""
    return _device_mode(device) == "native"


def _mm_abt(a, a_inv, b, b_inv, out_dtype, native, fast_accum):
    """a @ b^T for row-major fp8 a (M, K) and b (N, K): b.t() is column-major, as an H100's _scaled_mm wants it."""
    if native:
        return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return (dequantize(a, a_inv) @ dequantize(b, b_inv).t()).to(out_dtype)


@torch._dynamo.allow_in_graph
class _Fp8Matmuls(torch.autograd.Function):
    """
    y_i = x @ W_i^T for one 2-D x (M, K) and n weights W_i (N_i, K), every product with fp8 operands. x is quantised
    once for all n; each W_i comes as (W_i, its e4m3 copy (N_i, K), that copy's transpose (K, N_i), its inverse
    scale), the copy made outside (Fp8Linear's buffers, or fp8_linear per call), so W_i itself is only what its
    gradient is for. Saves x's fp8 data and each weight's transposed copy; backward quantises each grad_y_i once and
    takes both transposes it needs (x^T, grad_y_i^T) from fp8 data. grad_x sums the n products in x's dtype, the last
    first, as autograd sums the gradients of n separate linears of one input: sharing x's quantisation changes no bit.
    Autocast is off inside: it would run the emulated fp32 matmul in bf16, and CPU _scaled_mm's inner matmuls too.

    Dynamo does not trace into it (allow_in_graph: one node, no per-layer tracing of a forward and a backward); AOT
    autograd does, so its aten ops join the model's graphs.
    """

    @staticmethod
    def forward(ctx, x, out_dtype, native, *weights):
        groups = [weights[i:i + 4] for i in range(0, len(weights), 4)]
        with torch.autocast(x.device.type, enabled=False):
            x_scale = fp8_scale(x, E4M3)
            x_q, x_inv = cast_to_fp8(x, x_scale, E4M3), x_scale.reciprocal()
            ys = tuple(_mm_abt(x_q, x_inv, w_q, w_inv, out_dtype, native, fast_accum=True)
                       for _, w_q, _, w_inv in groups)
        ctx.save_for_backward(x_q, x_inv, *[t for _, _, w_t, w_inv in groups for t in (w_t, w_inv)])
        ctx.x_dtype, ctx.w_dtypes, ctx.native = x.dtype, [w.dtype for w, *_ in groups], native
        return ys

    @staticmethod
    def backward(ctx, *grads_y):
        x_q, x_inv, *saved = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        need_w = [ctx.needs_input_grad[3 + 4 * i] for i in range(len(grads_y))]
        parts, grad_ws = [], []
        with torch.autocast(x_q.device.type, enabled=False):
            x_t = x_q.t().contiguous() if any(need_w) else None  # (K, M): grad_W's second operand, column-major
            for i, grad_y in enumerate(grads_y):
                w_t, w_inv = saved[2 * i], saved[2 * i + 1]
                grad_w = None
                if grad_y is not None and (need_x or need_w[i]):
                    g_scale = fp8_scale(grad_y, E5M2)
                    g_q, g_inv = cast_to_fp8(grad_y, g_scale, E5M2), g_scale.reciprocal()
                    if need_x:  # (M, N) @ (K, N)^T
                        parts.append(_mm_abt(g_q, g_inv, w_t, w_inv, ctx.x_dtype, ctx.native, fast_accum=False))
                    if need_w[i]:  # (N, M) @ (K, M)^T
                        grad_w = _mm_abt(g_q.t().contiguous(), g_inv, x_t, x_inv, ctx.w_dtypes[i], ctx.native,
                                         fast_accum=False)
                grad_ws += [grad_w, None, None, None]
        grad_x = None
        for part in reversed(parts):
            grad_x = part if grad_x is None else grad_x + part
        return grad_x, None, None, *grad_ws


def _out_dtype(x):
    """The dtype F.linear's output would have: autocast's where it is on, else x's."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def _eligible(x, weights, out_dtype):
    """Whether _scaled_mm can take these operands: every size a multiple of 16, float dtypes, a device that holds fp8."""
    in_features = x.shape[-1]
    tokens = x.numel() // in_features if in_features else 0
    return (_device_mode(x.device) is not None
            and tokens % 16 == 0 and tokens > 0 and in_features % 16 == 0
            and all(w.shape[0] % 16 == 0 and w.dtype in _HIGH_PRECISION for w in weights)
            and x.dtype in _HIGH_PRECISION and out_dtype in _HIGH_PRECISION)


def _apply(x, weight_groups, native):
    """_Fp8Matmuls on x flattened to 2-D; the outputs in x's leading shape."""
    flat = [t for group in weight_groups for t in group]
    ys = _Fp8Matmuls.apply(x.reshape(-1, x.shape[-1]), _out_dtype(x), native, *flat)
    return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)


def quantize_weight(weight):
    """(W's e4m3 copy (N, K), its transpose (K, N), the inverse scale), outside autograd."""
    with torch.autocast(weight.device.type, enabled=False):
        scale = fp8_scale(weight.detach(), E4M3)
        w_q = cast_to_fp8(weight.detach(), scale, E4M3)
        return w_q, w_q.t().contiguous(), scale.reciprocal()


def fp8_linear(x, weight, native=None):
    """F.linear(x, weight) (no bias) with fp8 matmuls in forward and backward, the weight quantised on this call; the
    output dtype follows autocast as F.linear's does. native: None = the device's choice, True / False force
    _scaled_mm / the emulation (tests compare the two on a CPU). Shapes or dtypes _scaled_mm cannot take run plain
    F.linear."""
    if not _eligible(x, (weight,), _out_dtype(x)):
        return F.linear(x, weight)
    native = fp8_available(x.device) if native is None else native
    return _apply(x, [(weight, *quantize_weight(weight))], native)[0]


# every Fp8Linear alive, for the optimizers' step hook (a weak set: a dropped model's linears leave it)
_LIVE = weakref.WeakSet()
_HOOKED = []  # the optimizer hook's handle, registered by the first Fp8Linear made


def fp8_linears(x, linears):
    """Each Fp8Linear of `linears` applied to the same x, x quantised once for all of them. Where fp8 cannot run (the
    shapes, the device), plain F.linear with each weight."""
    weights = [linear.weight for linear in linears]
    if not _eligible(x, weights, _out_dtype(x)):
        return tuple(F.linear(x, w) for w in weights)
    if not torch.compiler.is_compiling():  # a compiled graph cannot check, and relies on the hooks (refresh)
        for linear in linears:
            linear.refresh()
    groups = [(lin.weight, lin.weight_fp8, lin.weight_fp8_t, lin.weight_inv) for lin in linears]
    return _apply(x, groups, fp8_available(x.device))


class Fp8Linear(nn.Linear):
    """
    A bias-free nn.Linear whose forward runs its matmuls in fp8; the same parameters and state_dict as nn.Linear. Its
    weight's e4m3 copy in both layouts and inverse scale live in non-persistent buffers (2 bytes a parameter), valid
    while the weight is unchanged: they are recast after every step of a torch.optim optimizer holding the weight (a
    global step hook, installed once), after load_state_dict, and by an eager forward when the weight's version
    counter or storage says it changed (`refresh`). A compiled forward only reads the buffers, so anything else that
    writes the weight (by hand, under no_grad) must be followed by refresh_fp8_weights before a compiled model runs.
    """

    def __init__(self, in_features, out_features, bias=False, device=None, dtype=None):
        assert not bias, "Fp8Linear has no bias"
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self._make_buffers(self.weight.device)
        _LIVE.add(self)
        if not _HOOKED:
            _HOOKED.append(register_optimizer_step_post_hook(_after_optimizer_step))
        self.refresh()  # a new one may go straight into torch.compile, whose forward reads the copies unchecked

    def _make_buffers(self, device):
        n, k = self.out_features, self.in_features
        self.register_buffer("weight_fp8", torch.zeros(n, k, dtype=E4M3, device=device), persistent=False)
        self.register_buffer("weight_fp8_t", torch.zeros(k, n, dtype=E4M3, device=device), persistent=False)
        self.register_buffer("weight_inv", torch.ones((), device=device), persistent=False)
        self.cast_of = None  # the weight_key() the buffers were cast from; None: never cast

    def weight_key(self):
        """What identifies the weight's current values without reading them: in-place writes bump its version
        counter, a `.data =` swap (a move, a dtype change) replaces its storage."""
        w = self.weight
        return w._version, w.untyped_storage()._cdata, w.dtype

    def refresh(self):
        """Recast the buffers if the weight's key says it changed since they were cast. Returns whether it did. Not
        every write shows there (a fused optimizer kernel's, a write through .data): hence the optimizer hook."""
        stale = self.cast_of != self.weight_key() and self.weight.device.type != "meta"
        if stale:
            _cast_weights([self])
        return stale

    def forward(self, x):
        return fp8_linears(x, (self,))[0]

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.weight.device.type != "meta":
            _cast_weights([self])  # a compiled model's next forward reads the buffers without checking


def _cast_weight_into(weight, copy, transpose, inverse):
    """The weight's e4m3 copy, its transpose and inverse scale, written into the given buffers."""
    w_q, w_t, w_inv = quantize_weight(weight)
    copy.copy_(w_q)
    transpose.copy_(w_t)
    inverse.copy_(w_inv)


_COMPILED_CAST = {}  # the torch.compile'd _cast_weight_into, made on first use


def _cast_weights(linears):
    """Recast these Fp8Linears' buffers. On FUSED_DEVICE_TYPES each weight's cast is a compiled graph (a fused amax and
    one kernel writing both layouts, not ~10 eager kernels), one graph per weight shape: static shapes, and as many
    graphs as a GPT has shapes of matrices (at most 5, within Dynamo's 8 recompiles) however the weights come. Called
    with grad and autocast off whoever calls (an optimizer's hook, an eager forward in eval or under autocast): Dynamo
    guards on both, and each state would compile its own graphs."""
    for linear in linears:
        device_type = linear.weight.device.type
        cast = _cast_weight_into
        if device_type in FUSED_DEVICE_TYPES:
            if "cast" not in _COMPILED_CAST:
                _COMPILED_CAST["cast"] = torch.compile(_cast_weight_into, fullgraph=True, dynamic=False,
                                                       backend=compile_backend())
            cast = _COMPILED_CAST["cast"]
        with torch.no_grad(), torch.autocast(device_type, enabled=False):
            cast(linear.weight, linear.weight_fp8, linear.weight_fp8_t, linear.weight_inv)
        linear.cast_of = linear.weight_key()


def fp8_modules(module):
    """The Fp8Linears at or below `module`, each once."""
    return [m for m in module.modules() if isinstance(m, Fp8Linear)]


def refresh_fp8_weights(module):
    """Recast the fp8 weight copies of every Fp8Linear at or below `module`, after a write to the weights that no
    optimizer step or load_state_dict made, before a compiled model runs. Returns how many."""
    linears = [linear for linear in fp8_modules(module) if linear.weight.device.type != "meta"]
    _cast_weights(linears)
    return len(linears)


def _after_optimizer_step(optimizer, args, kwargs):
    """torch.optim's global step post-hook: the weights this optimizer holds get their fp8 copies again, once a step
    (the micro-batches of the next step all read them), whether or not their version counters moved: a fused kernel's
    writes (torch._fused_adamw_) and writes through .data leave them as they were."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    linears = [linear for linear in list(_LIVE) if id(linear.weight) in held and linear.weight.device.type != "meta"]
    if linears:
        _cast_weights(linears)


class Fp8Attention:
    """Mixed into the attention's class by convert_to_fp8: q, k and v project one input, which is quantised once for
    the three (the compiler would not merge three quantisations hidden in three calls of a Function)."""

    def project_qkv(self, x):
        linears = (self.c_q, self.c_k, self.c_v)
        if all(type(linear) is Fp8Linear for linear in linears):
            return fp8_linears(x, linears)
        return super().project_qkv(x)


class Fp8CausalSelfAttention(Fp8Attention, gpt.CausalSelfAttention):
    pass


class Fp8CpuCausalSelfAttention(Fp8Attention, CpuCausalSelfAttention):
    pass


FP8_VERSIONS = {gpt.CausalSelfAttention: Fp8CausalSelfAttention, CpuCausalSelfAttention: Fp8CpuCausalSelfAttention}


def convert_to_fp8(module):
    """Replace every bias-free nn.Linear (exactly that type) below `module` (not itself) whose sizes are multiples of 16
    by an Fp8Linear holding the same weight Parameter, so param groups and state_dict keys do not change; the
    attentions below it (gpt's, or the CPU kernels' version) become their Fp8Attention versions. Returns how many
    linears were converted. Pass the GPT to convert lm_head too, model.transformer.h for the blocks alone."""
    # id(old) -> (old, new): a Linear under two names becomes one Fp8Linear; old kept alive so its id is not reused
    converted = {}

    def visit(parent):
        # _modules, not named_children(): that skips a module's second name under the same parent
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) in converted:
                setattr(parent, name, converted[id(child)][1])
            elif type(child) is nn.Linear and child.bias is None and child.in_features % 16 == 0 \
                    and child.out_features % 16 == 0:
                # built on meta so no second weight is allocated; the real one is then put in its place
                new = Fp8Linear(child.in_features, child.out_features, device="meta")
                new.weight = child.weight
                new._make_buffers(child.weight.device)
                new.train(child.training)
                converted[id(child)] = (child, new)
                setattr(parent, name, new)
                if child.weight.device.type != "meta":
                    _device_mode(child.weight.device)  # probe now, outside any torch.compile trace
                    new.refresh()
            else:
                if type(child) in FP8_VERSIONS:
                    child.__class__ = FP8_VERSIONS[type(child)]
                visit(child)

    visit(module)
    return len(converted)
