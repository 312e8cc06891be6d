"""
`bench kernels`: the two recipe options whose speed comes from a GPU kernel, each against what it replaces, with the
numerics checked in the same run:

- fp8 linear (nanochat/kernels/fp8.py): forward + both gradients of one (M, K) x (N, K) layer under bf16 autocast, the native
  path (torch._scaled_mm) against the fp32 emulation and against an fp32 matmul; then one linear's fwd+bwd as base_train
  runs it (bf16 activations, fp32 weight, bf16 autocast), timed four ways: bf16 F.linear eager and compiled, an
  Fp8Linear eager (every quantisation step its own kernel) and compiled (the quantisation in the compiled graph: what a
  compiled model runs), with the compiled ones' first-call seconds. The Fp8Linear's weight copies are made once, as
  once a step in training: the timings are of the micro-batches' work.
- sliding-window attention (gpt.flex_band_attention, compiled): output and q/k/v gradients against SDPA with the
  boolean band mask; then fwd+bwd time against that masked SDPA and against full causal SDPA (flash attention).

Made for CUDA (an fp8 GPU for the native rows). On a CPU it runs small shapes and reports errors only where they
mean something: the emulated fp8 path against fp32 (the CPU's _scaled_mm is a reference kernel, minutes per call at
these sizes), FlexAttention's forward (it has no CPU backward); its linear timings are of the fp32 emulation at a
small shape, which says nothing about a GPU (the table says so), and no attention timings.
"""

import time
import warnings

import torch
import torch.nn.functional as F

from nanochat import gpt
from nanochat.common import compile_backend
from nanochat.kernels import fp8
from bench.common import emit_json, log, machine_info, print_table


def relative_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def seconds_per_call(fn, device, repeats):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def fp8_rows(device, M, K, N):
    native = fp8.fp8_available(device)
    x0, w0 = torch.randn(M, K, device=device), torch.randn(N, K, device=device) * 0.02
    grad_y = torch.randn(M, N, device=device)
    reference = (x0 @ w0.t(), grad_y @ w0, grad_y.t() @ x0)  # y, grad_x, grad_w in fp32

    def run(use_native):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast(device.type, torch.bfloat16):
            y = fp8.fp8_linear(x, w, native=use_native)
        y.backward(grad_y.to(y.dtype))
        return y, x.grad, w.grad

    emulated = run(False)
    rows, result = [], {"fp8_native": native}
    for name, emul, ref in zip(("y", "grad_x", "grad_w"), emulated, reference):
        result[f"fp8_emulated_vs_fp32_{name}"] = relative_error(emul, ref)
    if native:
        for name, nat, emul, ref in zip(("y", "grad_x", "grad_w"), run(True), emulated, reference):
            result[f"fp8_native_vs_emulated_{name}"] = relative_error(nat, emul)
            result[f"fp8_native_vs_fp32_{name}"] = relative_error(nat, ref)
    for name in ("y", "grad_x", "grad_w"):
        rows.append([f"fp8 {name} ({M}x{K} @ {K}x{N})", f"{result[f'fp8_emulated_vs_fp32_{name}']:.2e}",
                     f"{result[f'fp8_native_vs_fp32_{name}']:.2e}" if native else "-",
                     f"{result[f'fp8_native_vs_emulated_{name}']:.2e}" if native else "-"])
    return rows, result


LINEAR_VARIANTS = ("bf16_eager", "bf16_compiled", "fp8_eager", "fp8_compiled")


def linear_speed(device, M, K, N, repeats):
    """
    Seconds per fwd+bwd of one linear as base_train runs it (x (M, K) bf16 activations, W (N, K) fp32, bf16 autocast),
    for each of LINEAR_VARIANTS, and the compiled variants' first call (tracing and code generation included).
    """
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(N, K, device=device) * 0.02)
    grad_y = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    holder = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=device))
    holder[0].weight = w
    fp8.convert_to_fp8(holder)  # its weight's fp8 copies made now, once
    fp8_linear = lambda x, w: holder(x)  # noqa: E731 (w is holder's weight)
    linears = {"bf16_eager": F.linear, "bf16_compiled": torch.compile(F.linear, backend=compile_backend()),
               "fp8_eager": fp8_linear, "fp8_compiled": torch.compile(fp8_linear, backend=compile_backend())}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {}
    for name in LINEAR_VARIANTS:
        def fwd_bwd(linear=linears[name]):
            with torch.autocast(device.type, torch.bfloat16):
                y = linear(x, w)
            y.backward(grad_y)
            x.grad = w.grad = None

        if name.endswith("compiled"):
            t0 = time.perf_counter()
            fwd_bwd()
            sync()
            result[f"linear_{name}_first_call_s"] = time.perf_counter() - t0
        result[f"linear_{name}_ms"] = 1e3 * seconds_per_call(fwd_bwd, device, repeats)
        result[f"linear_{name}_tflops"] = 3 * 2 * M * K * N / (result[f"linear_{name}_ms"] / 1e3) / 1e12
    return result


def attention_rows(device, B, H, H_kv, T, D, window, repeats):
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    q = torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=cuda)
    k = torch.randn(B, H_kv, T, D, device=device, dtype=dtype, requires_grad=cuda)
    v = torch.randn(B, H_kv, T, D, device=device, dtype=dtype, requires_grad=cuda)
    grad_out = torch.randn(B, H, T, D, device=device, dtype=dtype)
    mask = gpt.band_mask(T, T, window, device)
    masked_sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=H_kv != H)  # noqa: E731
    causal_sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H_kv != H)  # noqa: E731
    t0 = time.perf_counter()
    # compiled where the model runs it; on a CPU eager FlexAttention is the forward the tests check
    band = torch.compile(gpt.flex_band_attention) if cuda else gpt.flex_band_attention
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")  # the CPU's, known
    flex = lambda: band(q, k, v, window)  # noqa: E731

    def outputs(fn):
        if not cuda:
            with torch.no_grad():
                return [fn()]
        for t in (q, k, v):
            t.grad = None
        y = fn()
        y.backward(grad_out)
        return [y] + [t.grad for t in (q, k, v)]

    reference, flexed = outputs(masked_sdpa), outputs(flex)
    result = {"flex_first_call_s": time.perf_counter() - t0}
    rows = []
    for name, f, r in zip(("out", "dq", "dk", "dv"), flexed, reference):
        result[f"flex_vs_masked_sdpa_{name}"] = relative_error(f, r)
        rows.append([f"flex band {name} (T {T}, window {window})", "-", f"{result[f'flex_vs_masked_sdpa_{name}']:.2e}", "-"])
    if cuda:
        for name, fn in (("flex_band", flex), ("masked_sdpa", masked_sdpa), ("causal_sdpa", causal_sdpa)):
            result[f"{name}_fwd_bwd_ms"] = 1e3 * seconds_per_call(lambda fn=fn: fn().backward(grad_out), device, repeats)
    return rows, result


def cmd_kernels(args):
    device = torch.device(args.device_type or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    M, K, N = (4096, 2048, 1536) if cuda else (256, 256, 128)
    timed = (args.square,) * 3 if cuda else (M, K, N)  # a CPU times the emulation, at the small shape
    B, H, H_kv, T, D = (4, 12, 4, args.seq_len or 2048, 128) if cuda else (1, 4, 2, args.seq_len or 256, 32)
    window = T // 2  # what sliding_window gives the short layers
    log(f"bench kernels | {device} | fp8 linear {M}x{K} @ {K}x{N}, timed {'x'.join(map(str, timed))} | attention "
        f"B{B} H{H}/{H_kv} T{T} D{D} window {window}")
    fp8_table, fp8_result = fp8_rows(device, M, K, N)
    attention_table, attention_result = attention_rows(device, B, H, H_kv, T, D, window, args.repeats)
    linear_result = linear_speed(device, *timed, args.repeats)
    result = {**fp8_result, **attention_result, **linear_result, "linear_shape": list(timed)}
    print_table("kernels: relative error (Frobenius norm of the difference over the reference's)",
                ["check", "emulated vs fp32", "native/flex vs reference", "native vs emulated"], fp8_table + attention_table)
    fp8_kind = "torch._scaled_mm" if fp8_result["fp8_native"] else "its fp32 emulation: says nothing of fp8 on a GPU"
    linear_rows = [[name.replace("_", " "), f"{result[f'linear_{name}_ms']:.3f}", f"{result[f'linear_{name}_tflops']:.3g}",
                    f"{result[f'linear_{name}_first_call_s']:.1f}" if f"linear_{name}_first_call_s" in result else "-"]
                   for name in LINEAR_VARIANTS]
    print_table(f"kernels: one linear's fwd+bwd on {device.type}, {'x'.join(map(str, timed))} (x bf16, W fp32, bf16 "
                f"autocast; fp8 = {fp8_kind}; compiled with {compile_backend()})",
                ["linear", "ms", "TFLOP/s", "first call s"], linear_rows)
    if cuda:
        speed = [["attention fwd+bwd, ms", f"{result['flex_band_fwd_bwd_ms']:.3f}", f"{result['masked_sdpa_fwd_bwd_ms']:.3f}",
                  f"{result['causal_sdpa_fwd_bwd_ms']:.3f}"]]
        print_table("kernels: attention speed (shape as above)", ["what", "flex band", "masked SDPA", "full causal SDPA"],
                    speed)
    machine = {**machine_info(), "gpu": torch.cuda.get_device_name(device) if cuda else None}
    emit_json({"bench": "kernels", "machine": machine, **result})
