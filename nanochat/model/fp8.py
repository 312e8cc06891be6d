"""
FP8 matmuls for training: a drop-in `Fp8Linear` for the bias-free nn.Linear layers of the blocks.

All three matmuls of a linear layer run with fp8 operands, each tensor scaled per tensor from its
own current absolute maximum ("tensorwise" dynamic scaling):

    forward    y      = x      @ W^T       x, W  in float8_e4m3fn (more mantissa, enough range)
    backward   grad_x = grad_y @ W         grad_y in float8_e5m2 (gradients need the wider range)
               grad_W = grad_y^T @ x

    quantize:  scale = FP8_MAX[dtype] / max(amax(|t|), AMAX_FLOOR)        (fp32)
               q     = clamp(t * scale, -FP8_MAX, FP8_MAX) -> fp8,  kept with inv_scale = 1 / scale

Only the fp8 tensors and their inverse scales are saved for backward, so activations kept for
backward take one byte per element.

Where it runs: `torch._scaled_mm` is the native op, used on CUDA from compute capability 8.9 (Ada,
Hopper). Everywhere else (CPU, MPS, older CUDA) the same quantization is done and the matmul is
emulated: both operands are dequantized to fp32 and multiplied in fp32, which gives the numbers
_scaled_mm gives up to fp32 rounding (where the scales are applied, accumulation order). That is
for checking the numerics of fp8 training, not for speed. The CPU does run _scaled_mm in this torch,
but as a reference kernel (measured 64 s for a 2048 x 256 x 1024 product that fp32 does in 16 ms),
so it is used there only when asked for (native=True: the tests compare it with the emulation).
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

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}  # 448.0, 57344.0
# Floor on amax so an all-zero tensor (zero-initialised projections) gets a finite scale:
# FP8_MAX / float32 tiny would overflow to inf and turn 0 * scale into NaN.
AMAX_FLOOR = 1e-12
_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)

# ("native" | "emulated" | None) per device, filled by _device_mode.
_DEVICE_MODE = {}


def quantize(t, dtype):
    """Tensorwise dynamic scaling of t to the fp8 dtype. Returns (q, inv_scale): t ~= q.float() * inv_scale."""
    fp8_max = FP8_MAX[dtype]
    t = t.float()
    amax = t.abs().amax().clamp(min=AMAX_FLOOR)
    scale = fp8_max / amax
    # amax * scale often lands one fp32 ulp above FP8_MAX, and the cast is not promised to saturate
    # (e5m2 overflows to inf), hence the clamp. contiguous because _scaled_mm wants row-major
    # operands and t * scale keeps the layout of a transposed or expanded (stride-0) t.
    q = (t * scale).clamp(-fp8_max, fp8_max).to(dtype).contiguous()
    return q, scale.reciprocal()


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


def _mm_abt(a, a_inv, b, b_inv, out_dtype, native):
    """
    a @ b^T for row-major fp8 a (M, K) and b (N, K). b.t() is then column-major, the layout
    _scaled_mm wants for its second operand on CUDA, so no copy is needed for it here.
    """
    if native:
        return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
    return (dequantize(a, a_inv) @ dequantize(b, b_inv).t()).to(out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """
    y = x @ W^T with all three matmuls in fp8. Autocast is handled explicitly rather than with
    torch.amp.custom_fwd/custom_bwd: those need one device_type fixed when the class is defined, while
    this runs on CUDA, CPU and MPS. The output dtype is chosen by the caller (fp8_linear) from the
    autocast state, and autocast is switched off inside forward and backward (backward runs under
    autocast when backward() is called inside an autocast block): autocast would recast the emulated
    fp32 matmul to bf16, and CPU _scaled_mm, whose kernel calls matmuls that autocast still sees,
    then also accumulates at bf16 precision even with out_dtype=float32.
    """

    @staticmethod
    def forward(ctx, x, weight, out_dtype, native):
        with torch.autocast(x.device.type, enabled=False):
            x_q, x_inv = quantize(x.reshape(-1, x.shape[-1]), E4M3)
            w_q, w_inv = quantize(weight, E4M3)
            y = _mm_abt(x_q, x_inv, w_q, w_inv, out_dtype, native)
        ctx.save_for_backward(x_q, x_inv, w_q, w_inv)
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype, ctx.native = x.shape, x.dtype, weight.dtype, native
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_q, x_inv, w_q, w_inv = ctx.saved_tensors
        grad_x = grad_w = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g_q, g_inv = quantize(grad_y.reshape(-1, grad_y.shape[-1]), E5M2)  # (M, N)
            if ctx.needs_input_grad[0]:
                # grad_y (M, N) @ W (N, K): W^T is the (K, N) row-major "b"
                grad_x = _mm_abt(g_q, g_inv, w_q.t().contiguous(), w_inv, ctx.x_dtype, ctx.native)
                grad_x = grad_x.view(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                # grad_y^T (N, M) @ x (M, K): x^T is the (K, M) row-major "b"
                grad_w = _mm_abt(g_q.t().contiguous(), g_inv, x_q.t().contiguous(), x_inv, ctx.w_dtype, ctx.native)
        return grad_x, grad_w, None, None


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
    return _Fp8Matmul.apply(x, weight, out_dtype, mode == "native" if native is None else native)


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
