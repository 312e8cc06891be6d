"""
Shared plumbing for every nanochat script: where artifacts live, which device and
dtype to use, distributed init/teardown under torchrun, seeding, printing, and the
peak-FLOPs numbers that MFU is measured against.
"""

import functools
import math
import os
import sys
import time

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# Printing and errors


def get_dist_info():
    """(is_ddp, rank, local_rank, world_size), read from torchrun's env vars."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


def print0(*args, **kwargs):
    """print only on global rank 0, flushed so progress shows up under torchrun and pipes."""
    if get_dist_info()[1] == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


class UserError(Exception):
    """A problem the user can fix (bad flag, missing file): scripts print its message on one line and exit 1."""


def die(message):
    """Exit with a one-line error that says what to do; used by scripts for bad input."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(1)


def run_main(main):
    """Run a script's main(), turning UserError into a one-line message and exit code 1."""
    try:
        main()
    except UserError as e:
        die(str(e))


# -----------------------------------------------------------------------------
# Files


def get_base_dir():
    """Root of every artifact: $NANOCHAT_BASE_DIR, else ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    os.makedirs(base, exist_ok=True)
    return base


def ensure_writable(directory, what):
    """
    Prove, before any compute depends on it, that `directory` can be written: a probe file in it, or (when it does
    not exist yet) in its nearest existing parent, so that checking never leaves an empty directory behind.
    """
    import tempfile

    probe_dir = os.path.abspath(directory)
    while not os.path.isdir(probe_dir) and os.path.dirname(probe_dir) != probe_dir:
        if os.path.exists(probe_dir):  # a file where a directory should be
            raise UserError(f"cannot write {what} to {directory}: {probe_dir} is a file, not a directory")
        probe_dir = os.path.dirname(probe_dir)
    try:
        fd, probe = tempfile.mkstemp(dir=probe_dir, prefix=".write_probe")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise UserError(f"cannot write {what} to {directory} ({e.strerror or e}); make it writable, free some space, "
                        "or point NANOCHAT_BASE_DIR at another directory") from None
    return directory


def atomic_write_bytes(path, data):
    """Write to a temp file next to path then rename, so readers never see half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path, text):
    atomic_write_bytes(path, text.encode("utf-8"))


# -----------------------------------------------------------------------------
# Devices, dtypes, seeding


def autodetect_device_type():
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def resolve_device_type(device_type=""):
    """'' means autodetect; otherwise validate the user's choice before any compute."""
    if not device_type:
        return autodetect_device_type()
    if device_type not in ("cuda", "mps", "cpu"):
        raise UserError(f"--device-type must be cuda, mps or cpu (got {device_type!r})")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device-type=cuda but torch sees no CUDA device; drop the flag to run on what is here")
    if device_type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError("--device-type=mps but MPS is not available on this machine")
    return device_type


def has_fast_bf16(device):
    """bf16 matmuls are only fast on CUDA SM80+ (A100, H100, ...); on CPU they are far slower than fp32."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
               "float32": torch.float32, "fp32": torch.float32}


def dtype_from_env(variable, allowed=DTYPE_NAMES):
    """The dtype an environment variable names (None when it is unset); a name outside `allowed` is a UserError."""
    name = os.environ.get(variable)
    if not name:
        return None
    if name not in allowed:
        raise UserError(f"{variable} must be one of {sorted(allowed)} (got {name!r})")
    return DTYPE_NAMES[name]


@functools.cache  # read once: Muon asks on every step
def cpu_flags():
    """The x86 feature flags of this machine's CPU (from /proc/cpuinfo; empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def orthogonalization_dtype(device):
    """
    The dtype of Muon's Newton-Schulz matmuls: bf16 where the hardware multiplies bf16 natively (CUDA SM80+; x86
    CPUs with AVX512-BF16 or AMX, where a batch of 256x256 bf16 matmuls runs 2.5x the fp32 rate on a 2-vCPU EPYC),
    fp32 elsewhere (an AVX2-only CPU emulates bf16 and runs it many times slower than fp32). The iteration only
    needs singular values near 1, which bf16 gives. NANOCHAT_MUON_DTYPE=float32|bfloat16 overrides.
    """
    override = dtype_from_env("NANOCHAT_MUON_DTYPE", ("bfloat16", "bf16", "float32", "fp32"))
    if override:
        return override
    device = torch.device(device)
    if device.type == "cpu":
        return torch.bfloat16 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32
    return torch.bfloat16 if has_fast_bf16(device) else torch.float32


def get_compute_dtype(device):
    """Dtype for activations and the KV cache: bf16 on CUDA SM80+, fp32 elsewhere; NANOCHAT_DTYPE overrides."""
    return dtype_from_env("NANOCHAT_DTYPE", DTYPE_NAMES) or (torch.bfloat16 if has_fast_bf16(device) else torch.float32)


def autocast_for(device):
    """The autocast context for this device's compute dtype: bf16 autocast on CUDA SM80+, a no-op in fp32."""
    from contextlib import nullcontext

    device = torch.device(device)
    dtype = get_compute_dtype(device)
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype != torch.float32 else nullcontext()


def seed_everything(seed):
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# -----------------------------------------------------------------------------
# Distributed


def compute_init(device_type=""):
    """
    Set up device, precision knobs and (under torchrun) the process group.
    Returns (is_ddp, rank, local_rank, world_size, device).
    """
    device_type = resolve_device_type(device_type)
    is_ddp, rank, local_rank, world_size = get_dist_info()
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device(device_type)
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ and world_size > 1:
        # Several ranks on one CPU must share its cores instead of each spawning one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    if is_ddp and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            dist.init_process_group(backend=backend, device_id=device)
        else:
            dist.init_process_group(backend=backend)
        dist.barrier()
    return is_ddp, rank, local_rank, world_size, device


def keep_freed_memory_in_process():
    """
    Make glibc malloc reuse freed memory instead of returning it to the kernel. By default a tensor of more
    than a few MB is its own mmap, unmapped when freed, and the top of the heap is trimmed, so every training
    step page-faults (and zero-fills) its activations anew: 15-75 k faults per CPU step at d4-d6, 5-10 % of
    the step on a 2-core VM. Peak RSS does not grow, since each step needs that memory again. Linux/glibc only;
    a no-op elsewhere.
    """
    import ctypes

    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    mallopt(M_MMAP_THRESHOLD, 1 << 30)
    mallopt(M_TRIM_THRESHOLD, 1 << 30)


def compute_cleanup():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def dist_rank_world():
    """(rank, world_size) of the running process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_mean(value, device):
    """The mean of a Python number over all ranks (the number itself without a process group)."""
    if dist_rank_world()[1] > 1:
        t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()
    return value


# -----------------------------------------------------------------------------
# Peak FLOPs for MFU

# Dense bf16 tensor-core peaks (no sparsity), from the vendors' data sheets.
_GPU_PEAK_BF16 = [
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("T4", 65e12),
]

_peak_cache = {}


def measure_matmul_flops(device, dtype=torch.float32, n=2048, seconds=0.25, rounds=2):
    """
    FLOP/s of back-to-back n x n matmuls on this device, best of `rounds` windows of ~`seconds` each:
    the practical peak for devices without a data-sheet entry (CPU, MPS, fp32). base_train and
    scripts.bench both measure MFU against this one probe.
    """
    device = torch.device(device)
    g = torch.Generator().manual_seed(0)  # its own generator: measuring never moves the training's random stream
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b, out=out)
    sync()
    best = 0.0
    for _ in range(rounds):
        iters, t0 = 0, time.perf_counter()
        while True:
            torch.matmul(a, b, out=out)
            iters += 1
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        best = max(best, 2 * n**3 * iters / elapsed)
    return best


def datasheet_peak_flops(device, dtype):
    """The vendor's dense bf16 peak for a known CUDA GPU running bf16, else None."""
    device = torch.device(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK_BF16:
            if key in name:
                return flops
    return None


def get_peak_flops(device, dtype=None):
    """Peak FLOP/s to measure MFU against: the data-sheet bf16 number on known GPUs, else a measured matmul (cached)."""
    device = torch.device(device)
    dtype = dtype or get_compute_dtype(device)
    key = (str(device), dtype)
    if key not in _peak_cache:
        _peak_cache[key] = datasheet_peak_flops(device, dtype) or measure_matmul_flops(device, dtype)
    return _peak_cache[key]


# -----------------------------------------------------------------------------
# Text


def format_duration(seconds):
    """'42s', '3m 05s', '1h 02m 03s'; '?' for an unknown (NaN/inf) duration."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"
