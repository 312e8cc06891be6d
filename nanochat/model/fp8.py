"""
FP8 matmuls for training: a drop-in `Fp8Linear` for the bias-free nn.Linear layers of the blocks.

All three matmuls of a linear layer run with fp8 operands, each tensor scaled per tensor from its
own current absolute maximum ("tensorwise" dynamic scaling):

    forward    y      = x      @ W^T       x, W  in float8_e4m3fn (more mantissa, enough range)
    backward   grad_x = grad_y @ W         grad_y in float8_e5m2 (gradients need the wider range)
               grad_W = grad_y^T @ x

    quantize:  scale = FP8_MAX[dtype] / max(amax(|t|), AMAX_FLOOR)        (fp32)
               q     = clamp(t * scale, -FP8_MAX, FP8_MAX) -> fp8,  kept with inv_scale = 1 / scale

Layouts. An H100/H200's fp8 GEMM (cuBLASLt, what torch._scaled_mm calls on sm90) multiplies only a
row-major first operand by a column-major second one: both operands must be contiguous along the
dimension the product sums over. Each of x, W and grad_y is summed over along one dimension in one
product and along the other in another, so each is needed in both layouts: three transposed fp8
tensors per layer are unavoidable. They are written by the quantising cast itself (it writes its fp8
output in whichever layout is asked for), never copied from an fp8 tensor afterwards: the forward
writes x^T and W^T next to x and W, and saves only the transposed ones for backward (activations
kept for backward still take one byte per element); the backward writes grad_y in both layouts.

One opaque op for torch.compile. The forward and the backward are torch.library custom ops
(nanochat::fp8_linear, nanochat::fp8_linear_backward) with shape functions and an autograd formula,
so a compiled model sees one node per linear in its forward graph and one in its backward graph, and
Dynamo never traces the quantisation (the autograd.Function it replaced was traced, forward and
backward, once per layer: the likely cause of the 184 s first compiled step measured at d24). Inside the op, on CUDA, the body (amax, scale, casts, _scaled_mm) runs torch.compile'd on
its own, as modded-nanogpt's does: inductor fuses the quantisations into a few kernels that read the
bf16 inputs and write fp8, the fp32 product t * scale staying in registers (on the CPU, inductor makes
the whole forward quantisation one kernel before _scaled_mm). Run eagerly (the CPU by default, or with
FUSED_DEVICE_TYPES emptied) the same math takes a kernel per op and an fp32 temporary.

Accumulation follows modded-nanogpt's fp8 matmul (the speedrun record holder): the forward runs with
use_fast_accum=True (Hopper's faster, less precise fp8 accumulation), both backward products with
use_fast_accum=False, where the gradients' precision matters more. Outputs and grad_x come in the
activation dtype (bf16 under autocast), grad_W in the weight's dtype.

Where it runs: `torch._scaled_mm` is the native op, used on CUDA from compute capability 8.9 (Ada,
Hopper). Everywhere else (CPU, MPS, older CUDA) the same quantization is done and the matmul is
emulated: both operands are dequantized to fp32 and multiplied in fp32, which gives the numbers
_scaled_mm gives up to fp32 rounding (where the scales are applied, accumulation order). That is
for checking the numerics of fp8 training, not for speed. The CPU does run _scaled_mm in this torch,
but as a reference kernel (measured 64 s for a 2048 x 256 x 1024 product that fp32 does in 16 ms),
so it is used there only when asked for (native=True: the tests compare it with the emulation). It
also accepts operands in any layout, so the tests check the H100's layout rule themselves.
A device that cannot even hold fp8 tensors falls back to a plain F.linear.

Calls that _scaled_mm cannot take on CUDA fall back to a plain F.linear, on every device alike so a
CPU test sees what an H100 does: any of the token count (leading dims of x flattened), in_features
or out_features not a multiple of 16 (each of the three is the inner dim of one of the three
matmuls), or x/W dtypes other than fp32/bf16/fp16. Tiny test models and small gate layers take
that path.

Call `fp8_available(device)` once before torch.compile: it probes the device and caches the
answer, so the compiled forward only reads a dict.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.common import compile_backend

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
# Floor on amax so an all-zero tensor (zero-initialised projections) gets a finite scale:
# FP8_MAX / float32 tiny would overflow to inf and turn 0 * scale into NaN.
AMAX_FLOOR = 1e-12
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)

# Device types whose op bodies run torch.compile'd (see the module docstring). A set, so a benchmark can empty it to
# time the unfused body and a test can add "cpu" to run the compiled body on the CPU.
FUSED_DEVICE_TYPES = {"cuda"}

# ("native" | "emulated" | None) per device, filled by _device_mode.
_DEVICE_MODE = {}


def fp8_scale(t, dtype):
    """FP8_MAX / amax(|t|) in fp32, a 0-dim tensor. amax is taken in t's own dtype: abs and max only pick values, so it
    is exact there and no fp32 copy of t is made for it."""
    amax = t.abs().amax().float().clamp(min=AMAX_FLOOR)
    return FP8_MAX[dtype] / amax


def cast_to_fp8(t, scale, dtype, transposed=False):
    """
    t * scale, saturated and rounded to the fp8 dtype. The result is row-major (contiguous): of t, or with
    transposed=True of a 2-D t's t^T, written in that layout by the cast itself (a copy_ into a tensor laid out for
    it), so no transposed copy of fp8 data is ever made. The product is taken in fp32 so it is rounded once, to fp8.
    """
    fp8_max = FP8_MAX[dtype]
    # amax * scale often lands one fp32 ulp above FP8_MAX, and the cast is not promised to saturate
    # (e5m2 overflows to inf), hence the clamp
    scaled = (t.float() * scale).clamp(-fp8_max, fp8_max)
    if transposed:
        q = torch.empty(t.t().shape, dtype=dtype, device=t.device)
        q.t().copy_(scaled)
    else:
        q = torch.empty(t.shape, dtype=dtype, device=t.device)
        q.copy_(scaled)  # not scaled.to(dtype): that keeps the layout of a transposed or expanded t
    return q


def quantize(t, dtype, transposed=False):
    """Tensorwise dynamic scaling of t to the fp8 dtype. Returns (q, inv_scale): t ~= q.float() * inv_scale
    (q row-major, of t^T with transposed=True)."""
    scale = fp8_scale(t, dtype)
    return cast_to_fp8(t, scale, dtype, transposed), scale.reciprocal()


def dequantize(q, inv_scale, dtype=torch.float32):
    return (q.float() * inv_scale).to(dtype)


def _device_key(device):
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _device_mode(device):
    device = _device_key(device)
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
    """
    a @ b^T for row-major fp8 a (M, K) and b (N, K): b.t() is then column-major, the layout _scaled_mm wants for its
    second operand on an H100, so every product here is set up as this one and needs no copy.
    """
    if native:
        return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum)
    return (dequantize(a, a_inv) @ dequantize(b, b_inv).t()).to(out_dtype)


def _forward_body(x, weight, out_dtype, native, keep_for_backward):
    """
    y = x @ W^T for 2-D x (M, K) and W (N, K). Returns (y, x^T, x_inv, W^T, w_inv): the fp8 transposes that backward
    needs, written while x and W are being quantised anyway (empty when nothing will backpropagate).
    Autocast is switched off: it would recast the emulated fp32 matmul to bf16, and CPU _scaled_mm, whose kernel calls
    matmuls that autocast still sees, then also accumulates at bf16 precision even with out_dtype=float32.
    """
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
    """
    body(*args), torch.compile'd where the device type is in FUSED_DEVICE_TYPES. One graph is meant to serve every
    layer's shapes (and eval's token counts), so that a model compiles each body once per combination of its flags
    rather than once per shape, far from Dynamo's limit of 8 recompiles per function: dynamic=True, without duck
    sizing (which would make sizes that happen to be equal on the first call, like a square layer's K and N, one
    symbol, and recompile when they differ), the weight as a plain tensor (Dynamo keeps a Parameter's shape static),
    and one context to call it in: an eager model's autograd calls the op with the ADInplaceOrView dispatch key active
    and autocast on, a compiled model's graph without either, and Dynamo's guards, which see both, would compile again.
    (The bodies switch autocast off themselves; grad mode is off below autograd either way.)
    """
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
    """
    F.linear(x, weight) (no bias) with fp8 matmuls in forward and backward. native: None = the device's
    choice (_scaled_mm on an fp8 GPU, else the emulation); True / False force _scaled_mm / the
    emulation, which is how the tests compare the two paths on a CPU.
    The output dtype follows autocast like F.linear does: the autocast dtype when autocast is on
    for x's device, else x.dtype. Shapes or dtypes _scaled_mm cannot take run plain F.linear.
    """
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
    """
    Replace every bias-free nn.Linear (exactly that type) below `module` by an Fp8Linear holding the
    same weight Parameter object, so param groups built before or after, and state_dict keys, do not
    change. `module` itself is not replaced (it has no parent here). Returns how many were converted.
    """
    # id(old) -> (old, new): a Linear registered under two names becomes one Fp8Linear; old is kept
    # alive in the value so its id cannot be reused by a module created during the walk
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
