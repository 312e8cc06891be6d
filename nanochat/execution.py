"""
Run model-written Python (HumanEval-style completions, later maybe tools) in a separate process with
a wall-clock timeout, a memory limit and the destructive parts of the standard library switched off.

A best-effort guard against the honest mistakes of a small model (infinite loops, huge allocations,
deleting files, shelling out), NOT a security boundary: code that sets out to escape can (through gc
and frame objects, io.FileIO, /proc, ...). Run an adversary's code in a container or VM instead.

The code goes into a fresh temporary directory (removed afterwards) and this file runs as a script in
it (`python -I -u nanochat/execution.py ...`), in its own process group, with a minimal environment and
stdin from /dev/null. The child sets its rlimits, replaces the dangerous functions with ones that raise
PermissionError, execs the code in a fresh __main__ and reports the outcome on a private pipe, so that
nothing the code prints can pass for it. Switched off in the child:
- processes: os.system/popen/fork/forkpty/exec*/spawn*/posix_spawn*/kill/killpg/pidfd_open,
  subprocess.Popen (so run/call/check_output too), _posixsubprocess.fork_exec (multiprocessing)
- filesystem changes outside the temporary directory (os and posix remove/unlink/rmdir/rename/replace/
  truncate/chmod/chown/mkdir/link/symlink/chdir/..., shutil.rmtree/move, open() and os.open for
  writing); inside it the code may manage its own files. Paths go through realpath, fd and dir_fd
  arguments through /proc (Linux; elsewhere they are refused).
- sockets (socket.socket, create_connection, create_server), os.putenv/unsetenv, resource.setrlimit/
  prlimit (no lifting its own limits), faulthandler, and importing ctypes
POSIX only (Linux, macOS). Where `resource` or one of its limits is missing (macOS refuses RLIMIT_AS),
that limit is skipped.
"""

import builtins
import faulthandler
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from dataclasses import dataclass

try:
    import resource
except ImportError:
    resource = None

OUTPUT_LIMIT_BYTES = 1 << 20  # per stream: a print loop must not eat the parent's memory
FILE_SIZE_LIMIT_BYTES = 64 << 20  # per file the code writes: a write loop must not fill the disk
ERROR_LIMIT_CHARS = 2000
CODE_FILENAME = "solution.py"


@dataclass
class ExecutionResult:
    success: bool  # the code ran to its end without an exception (SystemExit included) or a timeout
    stdout: str
    stderr: str
    error: str | None = None  # "ZeroDivisionError: division by zero"
    timeout: bool = False
    memory_exceeded: bool = False


def execute_code(
    code: str, timeout: float = 5.0, maximum_memory_bytes: int | None = 256 * 1024 * 1024
) -> ExecutionResult:
    """Run `code` in a sandboxed child process; `maximum_memory_bytes=None` means no memory limit."""
    sandbox = tempfile.mkdtemp(prefix="nanochat_exec_")
    try:
        # The code travels in a file, never pasted into Python source, so it runs exactly as written.
        with open(os.path.join(sandbox, CODE_FILENAME), "w", encoding="utf-8", errors="surrogatepass", newline="") as f:
            f.write(code)
        status_read, status_write = os.pipe()
        status_pipe = open(status_read, "rb", buffering=0)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": sandbox, "TMPDIR": sandbox}
        command = [sys.executable, "-I", "-u", "-X", "utf8", os.path.abspath(__file__),
                   CODE_FILENAME, str(status_write), str(maximum_memory_bytes or 0)]
        try:
            process = subprocess.Popen(command, cwd=sandbox, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, pass_fds=(status_write,), start_new_session=True)
        finally:
            os.close(status_write)  # the child holds the only write end, so the status pipe ends when it does
        streams = [(process.stdout, OUTPUT_LIMIT_BYTES), (process.stderr, OUTPUT_LIMIT_BYTES), (status_pipe, 64 << 10)]
        readers = [_start_reader(stream, limit) for stream, limit in streams]
        try:
            process.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_process_group(process)  # on success too: nothing the code started may outlive it
            process.wait()
        stdout, stderr, status = [_finish_reader(*reader) for reader in readers]
    finally:
        shutil.rmtree(sandbox, ignore_errors=True)

    stdout, stderr = stdout.decode("utf-8", errors="replace"), stderr.decode("utf-8", errors="replace")
    if timed_out:
        return ExecutionResult(False, stdout, stderr, f"TimeoutError: execution exceeded {timeout} s", timeout=True)
    try:
        status = json.loads(status)
        error, memory_exceeded = status["error"], status["memory_exceeded"]
    except (ValueError, TypeError, KeyError):  # no report (or a garbled one): the code did not reach its end
        returncode = process.returncode
        reason = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        return ExecutionResult(False, stdout, stderr, f"the process {reason} before the code finished")
    return ExecutionResult(error is None, stdout, stderr, error, memory_exceeded=bool(memory_exceeded))


def _start_reader(stream, limit):
    chunks = []
    thread = threading.Thread(target=_read_capped, args=(stream, limit, chunks), daemon=True)
    thread.start()
    return stream, thread, chunks


def _read_capped(stream, limit, chunks):
    # Keep reading past the limit and drop the rest, so the child never blocks on a full pipe.
    kept = 0
    try:
        while chunk := os.read(stream.fileno(), 1 << 16):
            if kept < limit:
                chunks.append(chunk[: limit - kept])
                kept += len(chunks[-1])
    except OSError:
        pass


def _finish_reader(stream, thread, chunks):
    thread.join(timeout=1.0)  # only something that escaped the process group could keep the pipe open
    if not thread.is_alive():  # else leave it open: a closed fd number could be reused under the reader
        stream.close()
    return b"".join(chunks)


def _kill_process_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:  # the group is already gone
        pass


# -----------------------------------------------------------------------------
# The child side: runs as `python -I nanochat/execution.py CODE_FILENAME STATUS_FD MAXIMUM_MEMORY_BYTES`


def _run_sandboxed(code_filename, status_fd, maximum_memory_bytes):
    with open(code_filename, encoding="utf-8", errors="surrogatepass", newline="") as f:
        code = f.read()
    os.remove(code_filename)  # the code starts in an empty directory
    sys.argv = sys.argv[:1]
    _set_limits(maximum_memory_bytes)
    _install_guards(os.path.realpath(os.getcwd()))
    # A fresh module, so the code sees none of this file's names, and `import __main__` and pickle find its own.
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    error, memory_exceeded = None, False
    try:
        exec(compile(code, "<sandbox>", "exec"), main_module.__dict__)
    except BaseException as exc:  # SystemExit too: success means the code ran to its end
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # without this file's frame
        message = str(exc)
        error = (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:ERROR_LIMIT_CHARS]
        memory_exceeded = isinstance(exc, MemoryError)
    os.write(status_fd, json.dumps({"error": error, "memory_exceeded": memory_exceeded}).encode())
    os.close(status_fd)


def _set_limits(maximum_memory_bytes):
    if resource is None:
        return
    limits = [("RLIMIT_FSIZE", FILE_SIZE_LIMIT_BYTES), ("RLIMIT_CORE", 0)]
    if maximum_memory_bytes:
        limits += [("RLIMIT_AS", maximum_memory_bytes), ("RLIMIT_DATA", maximum_memory_bytes)]
    for name, limit in limits:
        try:
            resource.setrlimit(getattr(resource, name), (limit, limit))
        except (AttributeError, ValueError, OSError):  # not every platform has or allows every limit
            pass


def _install_guards(sandbox):
    def refuse(module, *names):
        for name in filter(lambda name: hasattr(module, name), names):
            setattr(module, name, _refused(f"{module.__name__}.{name}"))

    def refuse_instances(module, name):
        # A subclass rather than a function, so `class X(socket.socket)` in the stdlib (ssl) still imports.
        setattr(module, name, type(name, (getattr(module, name),), {"__init__": _refused(f"{module.__name__}.{name}")}))

    def check_inside(function_name, path, dir_fd=None):
        if isinstance(path, int):
            path = f"/proc/self/fd/{path}"
        elif dir_fd is not None:
            path = os.path.join(f"/proc/self/fd/{dir_fd}", os.fsdecode(path))
        real = os.path.realpath(os.fsdecode(path))
        if real != sandbox and not real.startswith(sandbox + os.sep):
            raise PermissionError(f"{function_name} outside the sandbox directory is disabled: {path!r}")

    def confine(module, name, path_count):
        original, function_name = getattr(module, name), f"{module.__name__}.{name}"

        def confined(*args, **kwargs):
            if kwargs.get("src_dir_fd") is not None or kwargs.get("dst_dir_fd") is not None:
                raise PermissionError(f"{function_name} with src_dir_fd/dst_dir_fd is disabled in the nanochat sandbox")
            for path in list(args[:path_count]) + [kwargs[key] for key in ("path", "src", "dst") if key in kwargs]:
                check_inside(function_name, path, kwargs.get("dir_fd"))
            return original(*args, **kwargs)
        setattr(module, name, confined)

    def confine_os_open(module, original):
        def open_confined(path, flags, *args, **kwargs):
            if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND):
                check_inside(f"{module.__name__}.open for writing", path, kwargs.get("dir_fd"))
            return original(path, flags, *args, **kwargs)
        module.open = open_confined

    original_open = builtins.open

    def open_confined(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            check_inside("open for writing", file)
        return original_open(file, mode, *args, **kwargs)
    builtins.open = io.open = open_confined

    # posix too: os re-exports its functions, and importlib.reload(os) would pick up the originals.
    path_counts = {"remove": 1, "unlink": 1, "rmdir": 1, "truncate": 1, "ftruncate": 1, "chmod": 1, "fchmod": 1,
                   "lchmod": 1, "chown": 1, "fchown": 1, "lchown": 1, "chflags": 1, "lchflags": 1, "mkdir": 1,
                   "mkfifo": 1, "mknod": 1, "utime": 1, "setxattr": 1, "removexattr": 1, "chdir": 1, "fchdir": 1,
                   "chroot": 1, "rename": 2, "renames": 2, "replace": 2, "link": 2, "symlink": 2}
    for module in [os] + ([sys.modules["posix"]] if "posix" in sys.modules else []):
        for name in filter(lambda name: hasattr(module, name), path_counts):
            confine(module, name, path_counts[name])
        confine_os_open(module, module.open)
        refuse(module, "system", "popen", "fork", "forkpty", "kill", "killpg", "pidfd_open", "putenv", "unsetenv",
               *[name for name in dir(module) if name.startswith(("exec", "spawn", "posix_spawn"))])
    confine(shutil, "rmtree", 1)
    confine(shutil, "move", 2)
    refuse_instances(subprocess, "Popen")
    if "_posixsubprocess" in sys.modules:
        refuse(sys.modules["_posixsubprocess"], "fork_exec")  # multiprocessing spawns through it
    refuse_instances(socket, "socket")
    refuse(socket, "create_connection", "create_server")
    if resource is not None:
        refuse(resource, "setrlimit", "prlimit")
    refuse(faulthandler, "enable", "dump_traceback_later", "register")
    # ctypes can call any C function (libc's unlink, kill, ...) past every guard above.
    sys.modules["ctypes"] = sys.modules["_ctypes"] = None


def _refused(function_name):
    def refused(*args, **kwargs):
        raise PermissionError(f"{function_name} is disabled in the nanochat sandbox")
    return refused


if __name__ == "__main__":
    _run_sandboxed(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
