"""
FP8 matmuls for training: `Fp8Linear`, a drop-in for the blocks' bias-free nn.Linear. All three matmuls of a layer take
fp8 operands, each scaled per tensor from its current amax (scale = FP8_MAX / amax, fp32): x and W in e4m3 forward,
grad_y in e5m2 backward (gradients need the wider range). As in modded-nanogpt, the forward accumulates fast
(use_fast_accum) and the two backward products precisely; outputs and grad_x in the activation dtype, grad_W in the
weight's. An H100's fp8 GEMM takes a row-major first and a column-major second operand, so each of x, W and grad_y is
needed in both layouts: the quantising cast writes each transpose itself, never copying fp8 data, and the forward saves
only the transposed ones. Forward and backward are torch.library custom ops, one opaque node each for torch.compile
(Dynamo never traces the quantisation), whose bodies run torch.compile'd on CUDA so the casts fuse.
`torch._scaled_mm` runs on CUDA from sm89; elsewhere the matmul is emulated in fp32 (equal up to fp32 rounding: for
checking numerics; the CPU's _scaled_mm is a slow reference kernel, used only with native=True, and ignores layouts).
Shapes with a token count, in_features or out_features not a multiple of 16, or other dtypes, run plain F.linear on
every device, as does a device that cannot hold fp8. Call `fp8_available(device)` before torch.compile: it caches.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.common import compile_backend

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
AMAX_FLOOR = 1e-12  # an all-zero tensor (a zero-initialised projection) still gets a finite scale, not inf and NaN
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)

# Device types whose op bodies run torch.compile'd: a benchmark may empty it, a test add "cpu".
FUSED_DEVICE_TYPES = {"cuda"}
_DEVICE_MODE = {}  # ("native" | "emulated" | None) per device, filled by _device_mode


def fp8_scale(t, dtype):
    """FP8_MAX / amax(|t|) in fp32, a 0-dim tensor. amax is taken in t's own dtype: abs and max only pick values, so it
    is exact there and no fp32 copy of t is made for it."""
    amax = t.abs().amax().float().clamp(min=AMAX_FLOOR)
    return FP8_MAX[dtype] / amax


def cast_to_fp8(t, scale, dtype, transposed=False):
    """t * scale (in fp32, so rounded once), saturated and cast to the fp8 dtype, row-major: of t, or with
    transposed=True of a 2-D t's t^T, written in that layout by the cast itself (no transposed copy of fp8 data)."""
    fp8_max = FP8_MAX[dtype]
    # amax * scale often lands one fp32 ulp above FP8_MAX, and the cast is not promised to saturate
    # (e5m2 overflows to inf), hence the clamp
    scaled = (t.float() * scale).clamp(-fp8_max, fp8_max)
    q = torch.empty(t.t().shape if transposed else t.shape, dtype=dtype, device=t.device)
    (q.t() if transposed else q).copy_(scaled)  # not scaled.to(dtype): that keeps a transposed or expanded t's layout
    return q


def quantize(t, dtype, transposed=False):
    """Tensorwise dynamic scaling of t to the fp8 dtype. Returns (q, inv_scale): t ~= q.float() * inv_scale
    (q row-major, of t^T with transposed=True)."""
    scale = fp8_scale(t, dtype)
    return cast_to_fp8(t, scale, dtype, transposed), scale.reciprocal()


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


def _forward_body(x, weight, out_dtype, native, keep_for_backward):
    """y = x @ W^T for 2-D x (M, K) and W (N, K). Returns (y, x^T, x_inv, W^T, w_inv): the fp8 transposes backward needs
    (empty when nothing will backpropagate). Autocast off: it would recast the emulated fp32 matmul to bf16, and CPU
    _scaled_mm's inner matmuls too."""
    with torch.autocast(x.device.type, enabled=False):
        x_scale, w_scale = fp8_scale(x, E4M3), fp8_scale(weight, E4M3)
        x_inv, w_inv = x_scale.reciprocal(), w_scale.reciprocal()
        x_q, w_q = cast_to_fp8(x, x_scale, E4M3), cast_to_fp8(weight, w_scale, E4M3)
        y = _mm_abt(x_q, x_inv, w_q, w_inv, out_dtype, native, fast_accum=True)
        if keep_for_backward:
            x_t = cast_to_fp8(x, x_scale, E4M3, transposed=True)
            w_t = cast_to_fp8(weight, w_scale, E4M3, transposed=True)
        else:
            x_t, w_t = x.new_empty(0, dtype=E4M3), weight.new_empty(0, dtype=E4M3)
    return y, x_t, x_inv, w_t, w_inv


def _backward_body(grad_y, x_t, x_inv, w_t, w_inv, x_dtype, w_dtype, native, need_grad_x, need_grad_w):
    """grad_x = grad_y @ W (M, K) and grad_W = grad_y^T @ x (N, K) from grad_y (M, N) and the saved x^T (K, M) and
    W^T (K, N); an empty tensor for a gradient not needed. Autocast off, as in _forward_body."""
    with torch.autocast(grad_y.device.type, enabled=False):
        g_scale = fp8_scale(grad_y, E5M2)
        g_inv = g_scale.reciprocal()
        grad_x, grad_w = grad_y.new_empty(0, dtype=x_dtype), grad_y.new_empty(0, dtype=w_dtype)
        if need_grad_x:
            g_q = cast_to_fp8(grad_y, g_scale, E5M2)  # (M, N) @ (K, N)^T
            grad_x = _mm_abt(g_q, g_inv, w_t, w_inv, x_dtype, native, fast_accum=False)
        if need_grad_w:
            g_t = cast_to_fp8(grad_y, g_scale, E5M2, transposed=True)  # (N, M) @ (K, M)^T
            grad_w = _mm_abt(g_t, g_inv, x_t, x_inv, w_dtype, native, fast_accum=False)
    return grad_x, grad_w


_COMPILED_BODIES = {}


def _run_body(body, device, *args):
    """body(*args), torch.compile'd where the device type is in FUSED_DEVICE_TYPES, one graph for every layer's shapes
    (far from Dynamo's 8 recompiles): dynamic=True without duck sizing (equal sizes on the first call, like a square
    layer's K and N, would become one symbol), the weight as a plain tensor (a Parameter's shape is static), and one
    calling context (eager autograd calls with ADInplaceOrView and autocast on, a compiled graph without; the guards
    would see the difference)."""
    if device.type not in FUSED_DEVICE_TYPES:
        return body(*args)
    if body not in _COMPILED_BODIES:
        _COMPILED_BODIES[body] = torch.compile(body, fullgraph=True, dynamic=True, backend=compile_backend())
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]  # below autograd here: an alias
    with (torch.fx.experimental._config.patch(use_duck_shape=False), torch._C._AutoDispatchBelowADInplaceOrView(),
          torch.autocast(device.type, enabled=False)):
        return _COMPILED_BODIES[body](*args)


Tensor = torch.Tensor


@torch.library.custom_op("nanochat::fp8_linear", mutates_args=())
def fp8_linear_op(x: Tensor, weight: Tensor, out_dtype: torch.dtype, native: bool,
                  keep_for_backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The forward of fp8_linear as one op: see _forward_body."""
    return _run_body(_forward_body, x.device, x, weight, out_dtype, native, keep_for_backward)


@fp8_linear_op.register_fake
def _(x, weight, out_dtype, native, keep_for_backward):
    (M, K), N = x.shape, weight.shape[0]
    x_t_shape, w_t_shape = ((K, M), (K, N)) if keep_for_backward else ((0,), (0,))
    return (x.new_empty((M, N), dtype=out_dtype),
            x.new_empty(x_t_shape, dtype=E4M3), x.new_empty((), dtype=torch.float32),
            x.new_empty(w_t_shape, dtype=E4M3), x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("nanochat::fp8_linear_backward", mutates_args=())
def fp8_linear_backward_op(grad_y: Tensor, x_t: Tensor, x_inv: Tensor, w_t: Tensor, w_inv: Tensor,
                           x_dtype: torch.dtype, w_dtype: torch.dtype, native: bool,
                           need_grad_x: bool, need_grad_w: bool) -> tuple[Tensor, Tensor]:
    """The backward of fp8_linear as one op: see _backward_body."""
    return _run_body(_backward_body, grad_y.device, grad_y, x_t, x_inv, w_t, w_inv, x_dtype, w_dtype, native,
                     need_grad_x, need_grad_w)


@fp8_linear_backward_op.register_fake
def _(grad_y, x_t, x_inv, w_t, w_inv, x_dtype, w_dtype, native, need_grad_x, need_grad_w):
    (M, N), K = grad_y.shape, w_t.shape[0]
    return (grad_y.new_empty((M, K) if need_grad_x else (0,), dtype=x_dtype),
            grad_y.new_empty((N, K) if need_grad_w else (0,), dtype=w_dtype))


def _setup_context(ctx, inputs, output):
    x, weight, _, native, _ = inputs
    _, x_t, x_inv, w_t, w_inv = output
    ctx.save_for_backward(x_t, x_inv, w_t, w_inv)
    ctx.x_dtype, ctx.w_dtype, ctx.native = x.dtype, weight.dtype, native
    ctx.mark_non_differentiable(x_t, x_inv, w_t, w_inv)
    ctx.set_materialize_grads(False)  # no zero-filled gradients made up for the four outputs above


def _backward(ctx, grad_y, *unused_grads):
    need_grad_x, need_grad_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if grad_y is None or not (need_grad_x or need_grad_w):
        return None, None, None, None, None
    grad_x, grad_w = fp8_linear_backward_op(grad_y, *ctx.saved_tensors, ctx.x_dtype, ctx.w_dtype, ctx.native,
                                            need_grad_x, need_grad_w)
    return grad_x if need_grad_x else None, grad_w if need_grad_w else None, None, None, None


fp8_linear_op.register_autograd(_backward, setup_context=_setup_context)


def fp8_linear(x, weight, native=None):
    """F.linear(x, weight) (no bias) with fp8 matmuls in forward and backward; the output dtype follows autocast as
    F.linear's does. native: None = the device's choice, True / False force _scaled_mm / the emulation (tests compare
    the two on a CPU). Shapes or dtypes _scaled_mm cannot take run plain F.linear."""
    device_type = x.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    in_features, out_features = x.shape[-1], weight.shape[0]
    tokens = x.numel() // in_features if in_features else 0
    mode = _device_mode(x.device)
    eligible = (
        mode is not None
        and tokens % 16 == 0 and tokens > 0
        and in_features % 16 == 0 and out_features % 16 == 0
        and x.dtype in _HIGH_PRECISION and weight.dtype in _HIGH_PRECISION and out_dtype in _HIGH_PRECISION
    )
    if not eligible:
        return F.linear(x, weight)
    native = mode == "native" if native is None else native
    keep_for_backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    y = fp8_linear_op(x.reshape(-1, in_features), weight, out_dtype, native, keep_for_backward)[0]
    return y.view(*x.shape[:-1], out_features)


class Fp8Linear(nn.Linear):
    """A bias-free nn.Linear whose forward runs fp8_linear; same parameters and state_dict as nn.Linear."""

    def __init__(self, in_features, out_features, bias=False, device=None, dtype=None):
        assert not bias, "Fp8Linear has no bias"
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x):
        return fp8_linear(x, self.weight)


def convert_to_fp8(module):
    """Replace every bias-free nn.Linear (exactly that type) below `module` (not itself) by an Fp8Linear holding the
    same weight Parameter, so param groups and state_dict keys do not change. Returns how many were converted."""
    # id(old) -> (old, new): a Linear under two names becomes one Fp8Linear; old kept alive so its id is not reused
    converted = {}

    def visit(parent):
        # _modules, not named_children(): that skips a module's second name under the same parent
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) in converted:
                setattr(parent, name, converted[id(child)][1])
            elif type(child) is nn.Linear and child.bias is None:
                # built on meta so no second weight is allocated; the real one is then put in its place
                new = Fp8Linear(child.in_features, child.out_features, device="meta")
                new.weight = child.weight
                new.train(child.training)
                converted[id(child)] = (child, new)
                setattr(parent, name, new)
                if child.weight.device.type != "meta":
                    _device_mode(child.weight.device)  # probe now, outside any torch.compile trace
            else:
                visit(child)

    visit(module)
    return len(converted)
