"""
Run model-written Python (HumanEval completions, later maybe tools) in sandboxed child processes. execute_code runs a
program, whose `success` is its own report (code that sets out to can fake it); execute_tests scores code against tests
with a verdict the code cannot forge: the tests run in a process of their own and reach the candidate's function over
a pipe, in plain data only. Each child is confined by the operating system (_confine) and, below that, by Python
guards (_install_guards). docs/sandbox.md says what each isolation mode guarantees, what it does not, and what it costs.
"""

import builtins
import contextlib
import ctypes
import faulthandler
import io
import json
import math
import numbers
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
from dataclasses import dataclass

try:
    import pwd
    import resource
except ImportError:  # not POSIX: no isolation mode runs, so the probe refuses the sandbox
    pwd = resource = None

OUTPUT_LIMIT_BYTES = 1 << 20  # per stream: a print loop must not eat the parent's memory
FILE_SIZE_LIMIT_BYTES = 64 << 20  # per file the code writes: a write loop must not fill the disk
MESSAGE_LIMIT_BYTES = 16 << 20  # per answer of the candidate process to the tests process
ERROR_LIMIT_CHARS = 2000
ISOLATION_MODES = ("namespaces", "user", "guards")  # strongest first
TMPFS_BYTES = 64 << 20  # everything the code writes, all files together, in "namespaces" mode
PROCESS_LIMIT = 64  # processes and threads of the sandbox's user (RLIMIT_NPROC counts them per user)
CODE_FILENAME, SETUP_FILENAME, TESTS_FILENAME = "solution.py", "setup.py", "tests.py"
# A module nothing imported yet: the confined child must still read the interpreter's files (uid nobody may not).
PROBE_CODE = ("try:\n    import colorsys\nexcept ImportError:\n"
              "    raise ImportError(\"the sandbox's user cannot read this Python's standard library\") from None\n")


@dataclass
class ExecutionResult:
    success: bool  # execute_tests: the tests ran to their end; execute_code: the code did (by its own report)
    stdout: str
    stderr: str
    error: str | None = None  # "ZeroDivisionError: division by zero"
    timeout: bool = False
    memory_exceeded: bool = False


def execute_code(
    code: str, timeout: float = 5.0, maximum_memory_bytes: int | None = 256 * 1024 * 1024
) -> ExecutionResult:
    """Run `code` in a sandboxed child process; `maximum_memory_bytes=None` means no memory limit. Success means the
    code ran to its end without an exception (SystemExit included), as the child reports it: no verdict to score by."""
    return _execute_program(code, isolation_mode(), timeout, maximum_memory_bytes)


def execute_tests(
    code: str, tests: str, entry_point: str, setup: str = "", timeout: float = 5.0,
    maximum_memory_bytes: int | None = 256 * 1024 * 1024,
) -> ExecutionResult:
    """Score `code` against `tests` with a verdict the code cannot forge: `setup` (the task's trusted code, e.g. a
    prompt's helpers) then `tests` run in a process of their own, where `entry_point` calls the function of that name in
    the candidate's process. Success means the tests ran to their end. stdout and stderr are the candidate's, then the
    tests'; the timeout covers both processes. Neither process can reach the other except in "guards" mode."""
    mode = isolation_mode()
    deadline = time.monotonic() + timeout
    requests_read, requests_write = os.pipe()  # tests -> candidate: the calls
    replies_read, replies_write = os.pipe()  # candidate -> tests: their results
    children = []
    try:
        children.append(_SandboxChild("candidate", mode, {CODE_FILENAME: code}, timeout, maximum_memory_bytes,
                                      requests_fd=requests_read, replies_fd=replies_write))
        children.append(_SandboxChild("tests", mode, {SETUP_FILENAME: setup, TESTS_FILENAME: tests}, timeout,
                                      maximum_memory_bytes, requests_fd=requests_write, replies_fd=replies_read,
                                      entry_point=entry_point))
    finally:
        for fd in (requests_read, requests_write, replies_read, replies_write):
            os.close(fd)  # each child holds its own ends, so a pipe ends when the child at its other end does
        if len(children) < 2:
            for child in children:
                child.end()
    candidate, tester = children
    finished = tester.wait(deadline) and candidate.wait(deadline)
    tests_out, tests_err, tests_status = tester.end()
    code_out, code_err, code_status = candidate.end()
    stdout, stderr = code_out + tests_out, code_err + tests_err
    if not finished:
        return ExecutionResult(False, stdout, stderr, f"TimeoutError: execution exceeded {timeout} s", timeout=True)
    memory_exceeded = any(status and status["memory_exceeded"] for status in (code_status, tests_status))
    if tests_status and tests_status["error"] is None:
        return ExecutionResult(True, stdout, stderr, memory_exceeded=memory_exceeded)
    # A failure. Which message: the candidate's own (its code did not run) before what the tests saw of it.
    if code_status and code_status["error"] is not None:
        error = code_status["error"]
    elif tests_status:
        error = tests_status["error"]
    else:
        error = tester.ended_early()
    return ExecutionResult(False, stdout, stderr, error, memory_exceeded=memory_exceeded)


def _execute_program(code, mode, timeout, maximum_memory_bytes):
    deadline = time.monotonic() + timeout
    program = _SandboxChild("program", mode, {CODE_FILENAME: code}, timeout, maximum_memory_bytes)
    finished = program.wait(deadline)
    stdout, stderr, status = program.end()
    if not finished:
        return ExecutionResult(False, stdout, stderr, f"TimeoutError: execution exceeded {timeout} s", timeout=True)
    if status is None:  # no report (or a garbled one): the code did not reach its end
        return ExecutionResult(False, stdout, stderr, program.ended_early())
    return ExecutionResult(status["error"] is None, stdout, stderr, status["error"],
                           memory_exceeded=status["memory_exceeded"])


# -----------------------------------------------------------------------------
# Which isolation: probed once per process


_isolation_lock = threading.Lock()
_isolation_mode = None


def isolation_mode():
    """The OS isolation (ISOLATION_MODES) every sandbox child of this process gets: the strongest whose probe runs here,
    or the one $NANOCHAT_SANDBOX names (an error if it cannot run here)."""
    global _isolation_mode
    with _isolation_lock:
        if _isolation_mode is None:
            _isolation_mode = _probe_isolation()
        return _isolation_mode


def _probe_isolation():
    wanted = os.environ.get("NANOCHAT_SANDBOX")
    if wanted and wanted not in ISOLATION_MODES:
        raise ValueError(f"NANOCHAT_SANDBOX={wanted!r}: not one of {', '.join(ISOLATION_MODES)}")
    refusals = []
    for mode in [wanted] if wanted else _isolation_modes_to_try():
        result = _execute_program(PROBE_CODE, mode, timeout=30.0, maximum_memory_bytes=None)
        if result.success:
            break
        reason = (result.stderr.strip().splitlines() or [result.error])[-1]
        refusals.append(f"{mode}: {reason}")
    else:
        raise RuntimeError(f"the code sandbox cannot run on this machine ({'; '.join(refusals) or sys.platform})")
    missing = {"user": "no namespaces: the code runs as nobody, can write where anyone may and leave processes "
                       "behind; network off on Linux",
               "guards": "no OS isolation: the code runs as this user, with only Python-level guards that code "
                         "which sets out to can get past, and a verdict it can forge"}
    if mode in missing:  # once per process: the first run pays for the probe
        refused = f" ({'; '.join(refusals)})" if refusals else ""
        print(f"nanochat sandbox: {mode} mode{refused}: {missing[mode]} (docs/sandbox.md)", file=sys.stderr)
    return mode


# -----------------------------------------------------------------------------
# The parent's side of one child


class _SandboxChild:
    """One sandboxed child process, started: this file run as a script (`python -I nanochat/execution.py CONFIG`) in a
    fresh temporary directory and a session of its own, with a minimal environment, stdin from /dev/null, and its
    outcome reported on a private pipe so that nothing it prints can pass for it."""

    def __init__(self, role, mode, files, timeout, maximum_memory_bytes, **settings):
        self.mode = mode
        self.directory = tempfile.mkdtemp(prefix="nanochat_exec_")
        for name, text in files.items():
            # The code travels in a file, never pasted into Python source, so it runs exactly as written.
            with open(os.path.join(self.directory, name), "w", encoding="utf-8", errors="surrogatepass",
                      newline="") as f:
                f.write(text)
        status_read, status_write = os.pipe()
        config = dict(role=role, mode=mode, status_fd=status_write, maximum_memory_bytes=maximum_memory_bytes or 0,
                      cpu_seconds=math.ceil(timeout) + 1, **settings)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": self.directory,
               "TMPDIR": self.directory}
        command = [sys.executable, "-I", "-u", "-X", "utf8", os.path.abspath(__file__), json.dumps(config)]
        passed_fds = [status_write] + [settings[key] for key in ("requests_fd", "replies_fd") if key in settings]
        try:
            self.process = subprocess.Popen(command, cwd=self.directory, env=env, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=passed_fds,
                                            start_new_session=True)
        except BaseException:
            os.close(status_read)
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        finally:
            os.close(status_write)  # the child holds the only write end, so the status pipe ends when it does
        self.readers = []
        for stream, limit in [(self.process.stdout, OUTPUT_LIMIT_BYTES), (self.process.stderr, OUTPUT_LIMIT_BYTES),
                              (open(status_read, "rb", buffering=0), 64 << 10)]:
            chunks = []
            thread = threading.Thread(target=_read_capped, args=(stream, limit, chunks), daemon=True)
            thread.start()
            self.readers.append((stream, thread, chunks))

    def wait(self, deadline):
        """Whether the child ended before the deadline."""
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            return True
        except subprocess.TimeoutExpired:
            return False

    def end(self):
        """Kill whatever is left of the run (on success too: nothing the code started may outlive it), remove its
        directory, and return its stdout, stderr and status report (None if it made none that parses)."""
        if self.mode == "namespaces":
            # The supervisor outside the namespace kills its PID 1, and with it every process in it, then exits.
            self.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=10.0)
        with contextlib.suppress(OSError):  # the group is already gone
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        stdout, stderr, status = [_finish_reader(*reader) for reader in self.readers]
        shutil.rmtree(self.directory, ignore_errors=True)
        return stdout.decode("utf-8", errors="replace"), stderr.decode("utf-8", errors="replace"), _parse_status(status)

    def ended_early(self):
        returncode = self.process.returncode
        reason = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        return f"the process {reason} before the code finished"


def _parse_status(raw):
    # The report comes from a child that may run hostile code: only a well-formed one counts. RecursionError: JSON
    # nested too deep (common.json_loads says so, but this module imports nothing of nanochat: the child runs it too).
    try:
        status = json.loads(raw)
        error, memory_exceeded = status["error"], status["memory_exceeded"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
    if not (error is None or isinstance(error, str)) or not isinstance(memory_exceeded, bool):
        return None
    return {"error": error if error is None else error[:ERROR_LIMIT_CHARS], "memory_exceeded": memory_exceeded}


def _read_capped(stream, limit, chunks):
    # Keep reading past the limit and drop the rest, so the child never blocks on a full pipe.
    kept = 0
    with contextlib.suppress(OSError):
        while chunk := os.read(stream.fileno(), 1 << 16):
            if kept < limit:
                chunks.append(chunk[: limit - kept])
                kept += len(chunks[-1])


def _finish_reader(stream, thread, chunks):
    thread.join(timeout=1.0)  # only something that escaped the run could keep the pipe open
    if not thread.is_alive():  # else leave it open: a closed fd number could be reused under the reader
        stream.close()
    return b"".join(chunks)


# -----------------------------------------------------------------------------
# The child side: runs as `python -I nanochat/execution.py CONFIG`


def _child_main(config):
    # Read the inputs before the OS layer covers the directory with an empty tmpfs.
    files = {}
    for name in (CODE_FILENAME, SETUP_FILENAME, TESTS_FILENAME):
        if os.path.exists(name):
            with open(name, encoding="utf-8", errors="surrogatepass", newline="") as f:
                files[name] = f.read()
            os.remove(name)  # the code starts in an empty directory
    sys.argv = sys.argv[:1]
    # In "namespaces" mode, only the confined child of a fork returns from _confine.
    _confine(config["mode"], os.getcwd(), config["maximum_memory_bytes"], config["cpu_seconds"])
    _install_guards(os.path.realpath(os.getcwd()))
    # A fresh module, so the code sees none of this file's names, and `import __main__` and pickle find its own.
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    role, namespace = config["role"], main_module.__dict__
    if role == "tests":
        error = _run(files[SETUP_FILENAME], "<setup>", namespace)
        if error is None:
            namespace[config["entry_point"]] = _CandidateFunction(config["entry_point"], config["requests_fd"],
                                                                  config["replies_fd"])
            error = _run(files[TESTS_FILENAME], "<tests>", namespace)
    else:  # "program" or "candidate": the model's code
        error = _run(files[CODE_FILENAME], "<sandbox>", namespace)
    _report(config["status_fd"], error)
    if role == "candidate" and error is None:
        _serve_calls(namespace, config["requests_fd"], config["replies_fd"])


def _run(code, filename, namespace):
    """Run `code` in `namespace`; the exception that ended it, or None if it ran to its end."""
    try:
        exec(compile(code, filename, "exec"), namespace)
        return None
    except BaseException as exc:  # SystemExit too: success means the code ran to its end
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # without this file's frame
        return exc


def _report(status_fd, exc):
    error = None
    if exc is not None:
        message = str(exc)
        error = (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:ERROR_LIMIT_CHARS]
    os.write(status_fd, json.dumps({"error": error, "memory_exceeded": isinstance(exc, MemoryError)}).encode())
    os.close(status_fd)


# -----------------------------------------------------------------------------
# Calls from the tests process to the candidate's: length-prefixed JSON on two pipes


class _CandidateFunction:
    """In the tests process, the candidate's function: each call goes to the candidate process and comes back as plain
    data, or as the exception it raised (a built-in exception type by name, else RuntimeError). A class, not a closure:
    a function would hand the tests' namespace its __globals__, this module's, pipes and all."""

    def __init__(self, name, requests_fd, replies_fd):
        self.name, self.requests_fd, self.replies_fd = name, requests_fd, replies_fd
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        _send(self.requests_fd, json.dumps({"function": self.name, "args": _to_message(list(args)),
                                            "kwargs": _to_message(kwargs)}))
        reply = _receive(self.replies_fd)
        if reply is None:
            raise RuntimeError(f"the candidate's process ended before {self.name}() returned")
        if "raised" in reply:
            name, message = (str(part) for part in reply["raised"])
            exception = RuntimeError(f"{name}: {message}")
            exception_type = getattr(builtins, name, None)
            if isinstance(exception_type, type) and issubclass(exception_type, Exception):
                with contextlib.suppress(TypeError):  # a type whose constructor wants more (UnicodeDecodeError)
                    exception = exception_type(message)
            raise exception
        return _from_message(reply["value"])


def _serve_calls(namespace, requests_fd, replies_fd):
    """In the candidate process: answer the tests' calls until they close their end."""
    while (request := _receive(requests_fd)) is not None:
        try:
            if request["function"] not in namespace:
                raise NameError(f"name {request['function']!r} is not defined")
            value = namespace[request["function"]](*_from_message(request["args"]), **_from_message(request["kwargs"]))
            reply = json.dumps({"value": _to_message(value)})
        except BaseException as exc:
            reply = json.dumps({"raised": [type(exc).__name__, str(exc)[:ERROR_LIMIT_CHARS]]})
        _send(replies_fd, reply)


def _to_message(value):
    """Plain data as JSON can carry it: lists as arrays, other containers tagged ({"tuple": [...]}). Subclasses of the
    plain types leave as their base type (json writes an int subclass as an int), so no method travels with a value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_to_message(item) for item in value]
    if isinstance(value, tuple):
        return {"tuple": [_to_message(item) for item in value]}
    if isinstance(value, (set, frozenset)):
        return {"frozenset" if isinstance(value, frozenset) else "set": [_to_message(item) for item in value]}
    if isinstance(value, dict):
        return {"dict": [[_to_message(key), _to_message(item)] for key, item in value.items()]}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, numbers.Integral):  # numpy's integers
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"a {type(value).__name__} cannot pass between the candidate's code and the tests")


def _from_message(value):
    """The inverse of _to_message, in the tests process: it only builds built-in containers of JSON's values, so the
    candidate's answer can make the tests fail but can run no code there."""
    if isinstance(value, list):
        return [_from_message(item) for item in value]
    if not isinstance(value, dict):
        return value  # None, bool, int, float, str: what json.loads makes
    (tag, content), = value.items()
    if tag == "tuple":
        return tuple(_from_message(item) for item in content)
    if tag in ("set", "frozenset"):
        return (set if tag == "set" else frozenset)(_from_message(item) for item in content)
    if tag == "dict":
        return {_from_message(key): _from_message(item) for key, item in content}
    if tag == "bytes":
        return bytes.fromhex(content)
    if tag == "complex":
        return complex(float(content[0]), float(content[1]))
    raise ValueError(f"unknown value tag {tag!r}")


def _send(fd, text):
    data = text.encode()
    data = len(data).to_bytes(4, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _receive(fd):
    """The next message on `fd`, or None when the other side has closed it."""
    header = _read_exactly(fd, 4)
    if header is None:
        return None
    size = int.from_bytes(header, "big")
    if size > MESSAGE_LIMIT_BYTES:
        raise ValueError(f"a message of {size} bytes from the other process (at most {MESSAGE_LIMIT_BYTES})")
    body = _read_exactly(fd, size)
    return None if body is None else json.loads(body)


def _read_exactly(fd, size):
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# -----------------------------------------------------------------------------
# The operating system's layer: the first
#
# Python guards cannot stop code that sets out to escape them (gc and frames, io.FileIO, a re-imported posix or ctypes
# all reach the real system calls), so the kernel confines the child too, in the strongest mode this machine allows
# (docs/sandbox.md has what each mode gives). In "namespaces" mode _confine() forks: the code runs in the child (PID 1
# of the new PID namespace, so that every process it starts dies with it) and the process that forked stays outside
# as its supervisor: it waits, kills the namespace when the parent sends SIGTERM (at the end of a run, on a timeout,
# or when the parent dies), and exits with the child's status. System calls go through ctypes: Python 3.11 has no
# os.unshare, and no version has mount, mount_setattr, capset or seccomp.

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1  # 442 on every architecture
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 1, 22, 38, 2
# The seccomp filter's view of the machine: the audit architecture and the number of socket() on it.
SECCOMP_ARCHITECTURES = {"x86_64": (0xC000003E, 41), "aarch64": (0xC00000B7, 198)}
SYS_IO_URING_SETUP = 425  # the same on both
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers


def _isolation_modes_to_try():
    """The modes this platform and user might allow, strongest first; the probe keeps the first that runs."""
    if resource is None:
        return []
    if sys.platform == "linux":
        return list(ISOLATION_MODES) if os.geteuid() == 0 else ["namespaces", "guards"]
    return ["user", "guards"] if os.geteuid() == 0 else ["guards"]


def _sandbox_user():
    """The uid and gid the code runs as when the caller is root: nobody's."""
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _confine(mode, sandbox, maximum_memory_bytes, cpu_seconds):
    """Confine this process, the sandbox child, before it runs any model-written code; `sandbox` is its working
    directory. In "namespaces" mode only the forked child returns (see the section's opening comment). Every mode
    limits memory, CPU time (a backstop to the parent's wall-clock timeout), each file's size and core dumps."""
    if mode == "namespaces":
        _enter_namespaces(sandbox)
    elif mode == "user":
        uid, gid = _sandbox_user()
        os.chown(sandbox, uid, gid)
        _become(uid, gid)
    if mode in ("namespaces", "user") and sys.platform == "linux":
        # No setuid program can give privileges back; and seccomp requires this of an unprivileged process.
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _forbid_sockets()
    limits = [("RLIMIT_FSIZE", FILE_SIZE_LIMIT_BYTES), ("RLIMIT_CORE", 0), ("RLIMIT_CPU", cpu_seconds)]
    if maximum_memory_bytes:
        limits += [("RLIMIT_AS", maximum_memory_bytes), ("RLIMIT_DATA", maximum_memory_bytes)]
    if mode != "guards":  # in "guards" mode the caller's own processes would count against it
        limits.append(("RLIMIT_NPROC", PROCESS_LIMIT))
    for name, limit in limits:
        try:
            resource.setrlimit(getattr(resource, name), (limit, limit))
        except (AttributeError, ValueError, OSError):  # not every platform has or allows every limit (macOS: RLIMIT_AS)
            if name == "RLIMIT_NPROC":
                raise  # the process count is part of what the mode promises


# -----------------------------------------------------------------------------
# "namespaces" mode


def _enter_namespaces(sandbox):
    root, parent = os.geteuid() == 0, os.getppid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(_libc().unshare(flags | (0 if root else CLONE_NEWUSER)), "unshare")
    if not root:  # inside the user namespace this user is itself; nothing else is mapped
        uid, gid = os.getuid(), os.getgid()
        for name, text in [("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")]:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # if the parent dies, the supervisor ends the run
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    # Block SIGTERM across the fork, so that the supervisor's handler never runs without the child's pid to kill.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    child = os.fork()
    if child:
        _supervise(child)  # never returns
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a supervisor killed outright takes the namespace with it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # PID 1 from here (as for any PID 1, a signal it sends itself without a handler is ignored). A session of its
    # own: the supervisor's process group must be out of reach of kill(0).
    os.setsid()
    _mount_private_root(sandbox, root)
    os.chdir(sandbox)  # into the tmpfs that now covers it
    if root:
        _become(*_sandbox_user())
    _drop_capabilities()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # again: the change of user cleared it


def _supervise(child):
    def kill_namespace(signum, frame):
        os.kill(child, signal.SIGKILL)  # the child is not reaped yet, so its pid cannot name another process

    signal.signal(signal.SIGTERM, kill_namespace)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # Returns once PID 1 and, the kernel sees to it, every other process of its namespace are gone.
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status):  # die the same way, so that the parent reports the signal
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # as the child's SIGSEGV or SIGABRT, without a core dump
        if os.WTERMSIG(status) != signal.SIGKILL:  # the one signal whose handler cannot be set
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status))


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


def _mount_private_root(sandbox, root):
    libc = _libc()
    # Every mount read-only, and private, so that nothing mounted below reaches the caller's view of the system.
    attributes = _MountAttr(attr_set=MOUNT_ATTR_RDONLY, propagation=MS_PRIVATE)
    _check(libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), b"/", ctypes.c_uint(AT_RECURSIVE),
                        ctypes.byref(attributes), ctypes.c_size_t(ctypes.sizeof(attributes))), "mount_setattr")
    if root:
        _expose_interpreter(*_sandbox_user())
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's processes only
    owner = ",uid={},gid={}".format(*_sandbox_user()) if root else ""
    _mount("tmpfs", sandbox, "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMPFS_BYTES},mode=0700{owner}")


def _expose_interpreter(uid, gid):
    """Nobody may be unable to reach this interpreter's modules (a Python under /root, mode 0700, is common), and the
    code imports them after the change of user. Cover each directory that stops nobody with a read-only tmpfs holding
    bind mounts of just the sys.path entries below it, so nothing else of it shows."""
    entries = sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)})
    os.setgroups([])
    os.setegid(gid)
    os.seteuid(uid)  # access() with effective_ids asks as nobody; the saved uid 0 takes it back below
    try:
        blocked = [path for path in entries if not os.access(path, os.R_OK | os.X_OK, effective_ids=True)]
        barriers = {path: next((a for a in _ancestors(path) if not os.access(a, os.X_OK, effective_ids=True)), path)
                    for path in blocked}
    finally:
        os.seteuid(0)
        os.setegid(0)
    for barrier in sorted(set(barriers.values())):
        below = [path for path in blocked if barriers[path] == barrier]
        # O_PATH handles first: once the tmpfs covers the barrier, the entries are reachable only through them.
        handles = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in below]
        _mount("tmpfs", barrier, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for path, handle in zip(below, handles):
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{handle}", path, None, MS_BIND | MS_REC)
            os.close(handle)
        _mount(None, barrier, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _ancestors(path):
    parts = path.split(os.sep)
    return [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts) + 1)]


# -----------------------------------------------------------------------------
# Shared by "namespaces" and "user"


def _become(uid, gid):
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)  # from root to another uid: the kernel drops every capability


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities():
    # A new user namespace gives its creator every capability inside it; the code keeps none (as root's nobody it has
    # none already). Version 3 headers take two data structs, for capabilities 0-31 and 32-63.
    _check(_libc().capset(ctypes.byref(_CapHeader(0x20080522, 0)), ctypes.byref((_CapData * 2)())), "capset")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _forbid_sockets():
    """A seccomp filter: socket() and io_uring_setup() (which can open sockets) fail with EPERM, since a Unix socket
    on disk (a D-Bus or ssh-agent socket) is reachable from any network namespace; a system call of another ABI (i386's
    int 0x80, x32) kills the process, since there the same numbers mean other calls. Written for x86_64 and aarch64."""
    if sys.platform != "linux" or platform.machine() not in SECCOMP_ARCHITECTURES:
        return
    architecture, sys_socket = SECCOMP_ARCHITECTURES[platform.machine()]
    load_word, jump_if_equal, jump_if_at_least, return_ = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ...
    allow, fail_eperm, kill = 0x7FFF0000, 0x00050000 | 1, 0x80000000  # SECCOMP_RET_ALLOW, _ERRNO | EPERM, _KILL_PROCESS
    program = [
        (load_word, 0, 0, 4),  # seccomp_data.arch
        (jump_if_equal, 0, 6, architecture),  # another ABI: to `kill`
        (load_word, 0, 0, 0),  # seccomp_data.nr
        (jump_if_at_least, 3, 0, X32_SYSCALL_BIT),  # to `fail_eperm`
        (jump_if_equal, 2, 0, sys_socket),
        (jump_if_equal, 1, 0, SYS_IO_URING_SETUP),
        (return_, 0, 0, allow),
        (return_, 0, 0, fail_eperm),
        (return_, 0, 0, kill),
    ]
    filters = (_SockFilter * len(program))(*[_SockFilter(*instruction) for instruction in program])
    filter_program = _SockFprog(len(program), filters)
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(filter_program))


# -----------------------------------------------------------------------------
# libc


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _prctl(option, argument, pointer=0):
    _check(_libc().prctl(ctypes.c_int(option), ctypes.c_ulong(argument), ctypes.c_void_p(pointer), ctypes.c_ulong(0),
                         ctypes.c_ulong(0)), f"prctl({option})")


def _mount(source, target, filesystem, flags, options=None):
    encode = lambda text: None if text is None else os.fsencode(text)  # noqa: E731
    _check(_libc().mount(encode(source), encode(target), encode(filesystem), ctypes.c_ulong(flags), encode(options)),
           f"mount {target}")


# -----------------------------------------------------------------------------
# The Python guards: the second layer


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
    _child_main(json.loads(sys.argv[1]))
