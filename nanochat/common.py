"""
Shared plumbing for every nanochat script: where artifacts live, which device and dtype to use, distributed
init/teardown under torchrun, seeding, printing, and the peak-FLOPs numbers that MFU is measured against.
"""

import argparse
import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import re
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


def run_main(main):
    """Run a script's main(): a UserError or running out of memory becomes a one-line message and exit code 1. Under
    torchrun the failing rank tells the others (RankFailureWatch); a rank failing only because a peer died says so."""
    try:
        main()
    except UserError as e:
        fail(str(e))
    except Exception as e:
        if is_out_of_memory(e):
            fail(out_of_memory_message(e))
        earlier = _failure_watch.failure() if _failure_watch else None
        if earlier:  # e.g. gloo's "connection closed by peer": a consequence, not the cause
            print(_failure_watch.stop_line(earlier), file=sys.stderr, flush=True)
            sys.exit(1)
        if _failure_watch:
            _failure_watch.publish(f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    # Free main()'s reference cycles now, while the interpreter is whole: left to its shutdown, a torchrun rank on
    # gloo aborts now and then ("terminate called without an active exception", ~1 run in 4 on a loaded CPU).
    gc.collect()


def fail(message):
    """Exit with a one-line error, first telling the other ranks of a distributed run that this one failed, and why."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if _failure_watch:
        _failure_watch.publish(message)
    sys.exit(1)


class RenamedFlag(argparse.Action):
    """A flag's old spelling, kept for one release: it sets what the new one sets, with a one-line notice. Added as
    parser.add_argument(OLD, dest=..., action=RenamedFlag, new=NEW, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    beside NEW (hidden, so that --help shows one spelling)."""

    def __init__(self, option_strings, dest, new, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"note: {option_string} is now {self.new} (the old spelling goes in the next release)", file=sys.stderr,
              flush=True)
        setattr(namespace, self.dest, values)


# -----------------------------------------------------------------------------
# Out of memory

_memory_advice = None  # what a training stage says to try when it runs out of memory (set_memory_advice)


def set_memory_advice(where, advice):
    """Register, for the rest of the run, where it is (stage, depth, batch) and what to try if memory runs out."""
    global _memory_advice
    _memory_advice = (where, advice)


def is_out_of_memory(error):
    """CUDA's OutOfMemoryError, or a CPU allocation the kernel refused (a plain RuntimeError from torch)."""
    return isinstance(error, torch.OutOfMemoryError) or (isinstance(error, RuntimeError)
                                                         and "can't allocate memory" in str(error))


def out_of_memory_message(error):
    """One line: which memory ran out, where in the run, and what to try (the advice a training stage registered)."""
    if not isinstance(error, torch.OutOfMemoryError):
        memory = "out of memory (the CPU's RAM)"
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        memory = f"CUDA out of memory on {torch.cuda.get_device_name(device)} " \
                 f"({torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB)"
    else:
        memory = "out of memory"
    if _memory_advice is None:
        return f"{memory}: {str(error).splitlines()[0][:200]}"
    where, advice = _memory_advice
    return f"{memory} in {where}: {advice}"


# -----------------------------------------------------------------------------
# Files


def get_base_dir():
    """Root of every artifact: $NANOCHAT_BASE_DIR, else ~/.cache/nanochat."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    os.makedirs(base, exist_ok=True)
    return base


def ensure_writable(directory, what, fix="point NANOCHAT_BASE_DIR at another directory"):
    """Prove, before any compute depends on it, that `directory` can be written: a probe file in it, or in its nearest
    existing parent when it does not exist yet (so checking never leaves an empty directory behind)."""
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
                        f"or {fix}") from None
    return directory


def sha256_of(path):
    with open(path, "rb") as f:
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


JSON_TOO_DEEP = "JSON nested too deep to read"


def json_loads(text):
    """json.loads for every JSON the project reads: JSON nested deeper than the parser's stack (200,000 brackets) is a
    JSONDecodeError like any other malformed JSON, where json.loads raises RecursionError, which `except ValueError`
    misses. Its message is JSON_TOO_DEEP alone: where the parser gave up says nothing."""
    try:
        return json.loads(text)
    except RecursionError:
        error = json.JSONDecodeError(JSON_TOO_DEEP, "", 0)
        error.args = (JSON_TOO_DEEP,)
        raise error from None


def json_load_file(path):
    """The JSON value in a UTF-8 file: OSError when it cannot be read, ValueError when it is not JSON (json_loads)."""
    with open(path, encoding="utf-8") as f:
        return json_loads(f.read())


def read_json_object(path):
    """A JSON object from a file, or None when it is missing or unreadable (or not an object)."""
    try:
        obj = json_load_file(path)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


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
    """cuda, then mps, then cpu: karpathy/nanochat's name, which its users' scripts call."""
    return resolve_device_type("")


def resolve_device_type(device_type=""):
    """'' means autodetect (cuda, then mps, then cpu); otherwise validate the user's choice before any compute."""
    has_mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    if not device_type:
        return "cuda" if torch.cuda.is_available() else "mps" if has_mps else "cpu"
    if device_type not in ("cuda", "mps", "cpu"):
        raise UserError(f"--device-type must be cuda, mps or cpu (got {device_type!r})")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device-type=cuda but torch sees no CUDA device; drop the flag to run on what is here")
    if device_type == "mps" and not has_mps:
        raise UserError("--device-type=mps but MPS is not available on this machine")
    return device_type


def has_fast_bf16(device):
    """Whether the device multiplies bf16 natively: CUDA SM80+, or an x86 CPU with AVX512-BF16 or AMX. Elsewhere (older
    GPUs, AVX2-only CPUs, MPS) bf16 is emulated or unsupported and slower than fp32."""
    device = torch.device(device)
    if device.type == "cpu":
        return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
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


def _cpuinfo(field, default):
    """The value of the first `field` line of /proc/cpuinfo, or `default` where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), default)
    except OSError:
        return default


@functools.cache  # read once: Muon and the compute dtype ask on every step
def cpu_flags():
    """The x86 feature flags of this machine's CPU (from /proc/cpuinfo; empty where there is none)."""
    return frozenset(_cpuinfo("flags", "").split())


def orthogonalization_dtype(device):
    """The dtype of Muon's Newton-Schulz matmuls: bf16 where has_fast_bf16, else fp32 (the iteration only needs singular
    values near 1, which bf16 gives). NANOCHAT_MUON_DTYPE=float32|bfloat16 overrides."""
    return (dtype_from_env("NANOCHAT_MUON_DTYPE", ("bfloat16", "bf16", "float32", "fp32"))
            or (torch.bfloat16 if has_fast_bf16(device) else torch.float32))


_notes_printed = set()


def note_once(message):
    """A one-line note (a fallback the user should know about), printed once per process on rank 0."""
    if message not in _notes_printed:
        _notes_printed.add(message)
        print0(f"note: {message}")


def cpu_name():
    """'AMD EPYC', 'Intel(R) Xeon(R) CPU @ 2.20GHz': how the budget's plans and the benchmarks name this CPU."""
    return _cpuinfo("model name", "unknown")


def describe_gpu(device):
    """'NVIDIA H100 80GB HBM3 (compute capability 9.0)': how notes and errors name a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def get_compute_dtype(device):
    """Dtype for activations and the KV cache: bf16 where has_fast_bf16, else fp32. NANOCHAT_DTYPE overrides, except
    that bf16 asked of an older GPU (no bf16 tensor cores, and torch.compile cannot emit bf16 kernels for it) falls back
    to fp32 with a note instead of failing deep inside compile."""
    device = torch.device(device)
    requested = dtype_from_env("NANOCHAT_DTYPE", DTYPE_NAMES)
    if requested is None:
        return torch.bfloat16 if has_fast_bf16(device) else torch.float32
    if requested == torch.bfloat16 and device.type == "cuda" and not has_fast_bf16(device):
        note_once(f"NANOCHAT_DTYPE={os.environ['NANOCHAT_DTYPE']} but {describe_gpu(device)} has no bf16 tensor cores "
                  "(they start at 8.0, the A100); running in float32")
        return torch.float32
    return requested


def bound_onednn_caches(capacity=32):
    """Bound the kernel caches of oneDNN (torch's CPU bf16 matmuls): ~0.7 MiB per shape met, in two caches of 1024
    entries, so a server's memory grew with every new batch size and prompt length. A generating process calls this
    before its first matmul (the caches read the variables once); a variable the user set wins."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def kv_cache_dtype(device):
    """What a KV cache stores: the compute dtype, except fp32 on a CPU, whose attention is several times slower in bf16
    for one new query per row (every decode step); bf16 keys and values are stored exactly in fp32, and
    gpt.CausalSelfAttention casts the queries to the cache's dtype."""
    device = torch.device(device)
    return torch.float32 if device.type == "cpu" else get_compute_dtype(device)


def compile_choice(flag, device):
    """Whether to torch.compile the training model: flag "1" / "0", or "auto" (on for CUDA). A GPU older than compute
    capability 7.0 (Triton's minimum) or a CPU without a C++ compiler ($CXX, else g++) runs eager, with a note."""
    device = torch.device(device)
    if flag == "0" or (flag == "auto" and device.type != "cuda"):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 7:
        note_once(f"--compile: {describe_gpu(device)} is older than torch.compile supports (7.0); running eager")
        return False
    if device.type == "cpu":
        import shutil

        compiler = os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")
        if not shutil.which(compiler):
            note_once(f"--compile: no C++ compiler {compiler!r} on PATH, which torch.compile needs on a CPU; running eager "
                      "(install one, or set CXX)")
            return False
    return True


COMPILE_BACKENDS = ("inductor", "aot_eager")


def compile_backend():
    """torch.compile's backend: inductor, or (NANOCHAT_COMPILE_BACKEND=aot_eager, as the test suite uses) the same
    graphs on eager kernels, without the code generation that costs minutes with an empty compile cache."""
    backend = os.environ.get("NANOCHAT_COMPILE_BACKEND", "inductor")
    if backend not in COMPILE_BACKENDS:
        raise UserError(f"NANOCHAT_COMPILE_BACKEND must be one of {', '.join(COMPILE_BACKENDS)} (got {backend!r})")
    return backend


def compile_model(model):
    """The model as training runs it when compiled: static shapes, compile_backend()'s backend."""
    return torch.compile(model, dynamic=False, backend=compile_backend())


def inference_threads(device, threads, num_workers=1):
    """torch's intra-op threads for a generating process (chat_web's workers, chat_cli): the flag, else
    $OMP_NUM_THREADS, else the cores shared among the workers, on a CPU one fewer (a small model's decode step barely
    gains from a second thread, while the server's event loop or the terminal need a core)."""
    if threads:
        return threads
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    cores = os.cpu_count() or 2
    if device.type == "cpu":  # the workers share the cores, one left for the server (4 workers on 16: 3 each, not 15)
        return max(1, (cores - 1) // num_workers)
    return max(1, cores // num_workers)


def autocast_for(device, **options):
    """The autocast context for this device's compute dtype: bf16 autocast on CUDA SM80+, a no-op in fp32. options:
    torch.autocast's own (cache_enabled)."""
    device = torch.device(device)
    dtype = get_compute_dtype(device)
    return torch.autocast(device_type=device.type, dtype=dtype, **options) if dtype != torch.float32 else \
        contextlib.nullcontext()


def seed_everything(seed):
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


# -----------------------------------------------------------------------------
# Distributed


def compute_init(device_type=""):
    """Set up device, precision knobs and (under torchrun) the process group: (is_ddp, rank, local_rank, world_size,
    device)."""
    device_type = resolve_device_type(device_type)
    is_ddp, rank, local_rank, world_size = get_dist_info()
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        use_cuda_device(device)
        cap_gpu_memory(device)
    else:
        device = torch.device(device_type)
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ and world_size > 1:
        # Several ranks on one CPU must share its cores instead of each spawning one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    if is_ddp and not dist.is_initialized():
        dist.init_process_group(**(dict(backend="nccl", device_id=device) if device_type == "cuda" else
                                   dict(backend="gloo")))
        dist.barrier()
        start_failure_watch(rank)
    return is_ddp, rank, local_rank, world_size, device


def cap_gpu_memory(device):
    """With NANOCHAT_GPU_MEMORY (a run planned for a smaller card), cap this process's share of the GPU to it, so
    that every stage keeps to the card planned for and not base_train alone (which also plans its batch for it)."""
    if not os.environ.get("NANOCHAT_GPU_MEMORY"):
        return
    given, total = parse_memory(os.environ["NANOCHAT_GPU_MEMORY"]), torch.cuda.get_device_properties(device).total_memory
    if given < total:
        torch.cuda.set_per_process_memory_fraction(given / total, device)


def use_cuda_device(device):
    """Make `device` this process's current GPU (where CUDA ops go by default), with TF32 matmuls allowed."""
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def _glibc(function):
    """A glibc function, or None off Linux/glibc (the two callers below are no-ops there)."""
    import ctypes

    try:
        return getattr(ctypes.CDLL("libc.so.6"), function)
    except (OSError, AttributeError):
        return None


def return_freed_memory():
    """Hand the memory glibc malloc holds free back to the kernel (malloc_trim)."""
    if malloc_trim := _glibc("malloc_trim"):
        malloc_trim(0)


def keep_freed_memory_in_process():
    """Make glibc malloc reuse freed memory instead of returning it to the kernel, where every training step would
    page-fault (and zero-fill) its activations anew. Peak RSS does not grow: each step needs that memory again."""
    if mallopt := _glibc("mallopt"):
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        mallopt(M_MMAP_THRESHOLD, 1 << 30)
        mallopt(M_TRIM_THRESHOLD, 1 << 30)


def compute_cleanup():
    if _failure_watch:
        _failure_watch.stop()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class RankFailureWatch:
    """One failing rank must not leave the others hanging (NCCL notices a dead peer only at its collective timeout, and
    torchrun's SIGTERM reads as "save and stop"). A failing rank writes its message into torchrun's key-value store
    (MASTER_ADDR:MASTER_PORT, which outlives the workers); every rank polls that key once a second from a daemon thread
    and, when it appears, prints the message and exits at once. The first failure written wins."""

    def __init__(self, rank, host, port):
        import datetime
        import threading

        self.rank = rank
        # the agent's restart count keeps a failure of an earlier attempt from stopping a restarted one
        self.key = f"nanochat/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="rank-failure-watch", daemon=True).start()

    def _watch(self):
        while not self.stopped.wait(1.0):
            try:
                message = self.failure()
            except Exception:  # the store is gone (its host stopped): nothing left to watch
                return
            if message and not self.stopped.is_set():
                print(self.stop_line(message), file=sys.stderr, flush=True)
                os._exit(1)

    def stop_line(self, failure):
        return f"error: {failure}; stopping rank {self.rank} too"

    def failure(self):
        """The failure some rank published, or None."""
        return self.store.get(self.key).decode() if self.store.check([self.key]) else None

    def publish(self, message):
        """Tell every rank that this one failed (unless another rank's failure came first), and stop watching."""
        self.stopped.set()
        with contextlib.suppress(Exception):  # the store may be gone: then the launcher stops the others
            self.store.compare_set(self.key, "", f"rank {self.rank} failed: {message}")

    def stop(self):
        self.stopped.set()


_failure_watch = None


def start_failure_watch(rank):
    """Watch for other ranks' failures (RankFailureWatch); a no-op without the store address torchrun provides."""
    global _failure_watch
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port and _failure_watch is None:
        _failure_watch = RankFailureWatch(rank, host, int(port))


def dist_rank_world():
    """(rank, world_size) of the running process group; (0, 1) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_mean(value, device):
    """The mean over all ranks of a Python number or a one-element tensor (the value itself without a process group),
    as a Python number. A tensor is read once, after the reduction: reading it waits for the device's queued work."""
    if dist_rank_world()[1] > 1:
        if torch.is_tensor(value):
            t = value.detach().reshape(1).to(torch.float64)
        else:
            t = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return t.item() / dist.get_world_size()
    return value.item() if torch.is_tensor(value) else value


def child_pythonpath(repo_root):
    """PYTHONPATH for a child process: this repo first, then what the user's adds (packages installed with --target,
    as a GPU machine without network gets its wheels)."""
    return os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)


def all_reduce_max(values, device):
    """Each of a list of Python numbers maxed over all ranks (the numbers themselves without a process group): what
    every rank must agree on before deciding alike (a plan's timings, an out-of-memory flag)."""
    if dist_rank_world()[1] > 1:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()
    return [float(v) for v in values]


# -----------------------------------------------------------------------------
# Peak FLOPs for MFU

# Dense 16-bit tensor-core peaks (no sparsity), from the vendors' data sheets: bf16's, which fp16 shares on every card
# here (the V100 and T4, without bf16, have fp16's alone); the first key the device's name contains wins, so longer
# names come before their prefixes.
_GPU_PEAK_BF16 = [("H200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12),
                  ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("A10G", 125e12),
                  ("A10", 125e12), ("L40S", 362e12), ("L4", 121e12), ("RTX 4090", 165e12), ("RTX 3090", 71e12),
                  ("V100", 125e12), ("T4", 65e12)]

_peak_cache = {}


def measure_matmul_flops(device, dtype=torch.float32, n=2048, seconds=0.25, rounds=2):
    """FLOP/s of back-to-back n x n matmuls on this device, best of `rounds` windows of ~`seconds` each: the practical
    peak for devices without a data-sheet entry (CPU, MPS, fp32), which base_train and scripts.bench both use. fp16
    on a CPU multiplies by b^T, as a linear layer does: without AVX512-FP16 that layout runs ~9 GFLOP/s where b's
    runs ~1.3 (a 2-vCPU EPYC), and n is 512 there, where a 2048^3 product would take seconds."""
    device = torch.device(device)
    emulated = device.type == "cpu" and dtype == torch.float16
    n = min(n, 512) if emulated else n
    g = torch.Generator().manual_seed(0)  # its own generator: measuring never moves the training's random stream
    a = torch.randn(n, n, generator=g).to(device, dtype)
    b = torch.randn(n, n, generator=g).to(device, dtype)
    b = b.mT if emulated else b
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


def describe_peak_flops(device, dtype, seconds=0.25, rounds=2):
    """(peak FLOP/s, how it was obtained): the data sheet for bf16 or fp16 on known GPUs, else the matmul probe (not
    cached)."""
    device = torch.device(device)
    name = str(dtype).replace("torch.", "")
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        peak = next((flops for key, flops in _GPU_PEAK_BF16 if key in torch.cuda.get_device_name(device)), None)
        if peak:
            return peak, f"data sheet {name}"
    return measure_matmul_flops(device, dtype, seconds=seconds, rounds=rounds), f"measured {name} matmul"


def get_peak_flops(device, dtype=None):
    """Peak FLOP/s to measure MFU against: the data-sheet 16-bit number on known GPUs, else a measured matmul
    (cached)."""
    device = torch.device(device)
    dtype = dtype or get_compute_dtype(device)
    key = (str(device), dtype)
    if key not in _peak_cache:
        _peak_cache[key] = describe_peak_flops(device, dtype)[0]
    return _peak_cache[key]


def peak_memory_mib(device):
    """Peak memory of this process: CUDA allocations on a GPU, peak RSS elsewhere."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # Windows: psutil has the peak working set there
        import psutil

        info = psutil.Process().memory_info()
        return getattr(info, "peak_wset", info.rss) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


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


MIB, GIB = 2**20, 2**30


def parse_memory(text, name="NANOCHAT_GPU_MEMORY"):
    """'24GiB', '24G', '80 GB', '512MiB', '1.5TiB' or plain bytes -> bytes > 0. Binary units (GiB, MiB, and G, M
    alone, as nvidia-smi means them); GB and MB are decimal (10^9, 10^6)."""
    units = {"": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": MIB, "mib": MIB, "mb": 10**6, "g": GIB, "gib": GIB,
             "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", str(text).strip().lower())
    if not match or match.group(2) not in units:
        raise UserError(f"{name}={text} is not an amount of memory: give one such as 24GiB, 80GB or 12G")
    value = float(match.group(1)) * units[match.group(2)]
    if not math.isfinite(value) or value < MIB:
        raise UserError(f"{name}={text} is less than a MiB: give the card's memory, such as 24GiB")
    return int(value)


def format_bytes(n, up=False):
    """'15.4 GiB', '312 MiB'; up=True rounds up (a least amount stated is then enough)."""
    rounding = math.ceil if up else round
    return f"{rounding(n / GIB * 10) / 10:,.1f} GiB" if n >= GIB else f"{rounding(n / MIB):,.0f} MiB"
