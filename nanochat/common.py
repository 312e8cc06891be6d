"""
Shared plumbing for every nanochat script: where artifacts live, which device and
dtype to use, distributed init/teardown under torchrun, seeding, logging, and the
peak-FLOPs numbers that MFU is measured against.
"""

import logging
import os
import sys
import time

import torch
import torch.distributed as dist

# -----------------------------------------------------------------------------
# Logging and printing


class _ColorFormatter(logging.Formatter):
    COLORS = {"DEBUG": "\033[36m", "INFO": "\033[32m", "WARNING": "\033[33m", "ERROR": "\033[31m", "CRITICAL": "\033[35m"}

    def format(self, record):
        text = super().format(record)
        color = self.COLORS.get(record.levelname)
        if color and sys.stderr.isatty():
            text = f"{color}{text}\033[0m"
        return text


def setup_logging(level=logging.INFO):
    handler = logging.StreamHandler()
    handler.setFormatter(_ColorFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)


logger = logging.getLogger("nanochat")


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


def get_compute_dtype(device):
    """Dtype for activations and the KV cache: bf16 on CUDA SM80+, fp32 elsewhere; NANOCHAT_DTYPE overrides."""
    override = os.environ.get("NANOCHAT_DTYPE")
    if override:
        table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                 "float32": torch.float32, "fp32": torch.float32}
        if override not in table:
            raise UserError(f"NANOCHAT_DTYPE must be one of {sorted(table)} (got {override!r})")
        return table[override]
    return torch.bfloat16 if has_fast_bf16(device) else torch.float32


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


def compute_cleanup():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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

_measured_peak_cache = {}


def measure_matmul_flops(device, dtype=torch.float32, n=1024, seconds=0.5):
    """Time a large square matmul on this device: the practical peak for devices without a table entry (CPU)."""
    key = (str(device), dtype, n)
    if key in _measured_peak_cache:
        return _measured_peak_cache[key]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    iters, t0 = 0, time.perf_counter()
    while True:
        a @ b
        iters += 1
        if iters % 4 == 0:
            sync()
            if time.perf_counter() - t0 > seconds:
                break
    flops = 2 * n**3 * iters / (time.perf_counter() - t0)
    _measured_peak_cache[key] = flops
    return flops


def get_peak_flops(device, dtype=None):
    """Peak FLOP/s to measure MFU against: the data-sheet bf16 number on known GPUs, else a measured matmul."""
    device = torch.device(device)
    dtype = dtype or get_compute_dtype(device)
    if device.type == "cuda" and dtype == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK_BF16:
            if key in name:
                return flops
    return measure_matmul_flops(device, dtype)
