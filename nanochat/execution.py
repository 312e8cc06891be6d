"""
Run model-written Python (HumanEval completions, later maybe tools) in sandboxed child processes. execute_code runs a
program, whose `success` is its own report (code that sets out to can fake it); execute_tests scores code against tests
with a verdict the code cannot forge: the tests run in a process of their own and reach the candidate's function over
a pipe, in plain data only. Each child is confined by the operating system (nanochat/isolation.py) and, below that,
by Python guards (_install_guards). docs/sandbox.md says what each isolation mode guarantees, what it does not, and
what it costs.
"""

import builtins
import contextlib
import faulthandler
import io
import json
import math
import numbers
import os
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

from nanochat.isolation import ISOLATION_MODES, confine, modes_to_try

try:
    import resource
except ImportError:  # not POSIX: no isolation mode runs, so the probe refuses the sandbox
    resource = None

OUTPUT_LIMIT_BYTES = 1 << 20  # per stream: a print loop must not eat the parent's memory
MESSAGE_LIMIT_BYTES = 16 << 20  # per answer of the candidate process to the tests process
ERROR_LIMIT_CHARS = 2000
CODE_FILENAME, SETUP_FILENAME, TESTS_FILENAME = "solution.py", "setup.py", "tests.py"
# A module nothing imported yet: the confined child must still read the interpreter's files (uid nobody may not).
PROBE_CODE = ("try:\n    import colorsys\nexcept ImportError:\n"
              "    raise ImportError(\"the sandbox's user cannot read this Python's standard library\") from None\n")
# What a child runs: _child_main, from this repository, which -I (no environment, no user site-packages, neither the
# script's nor the current directory) leaves off sys.path; off it again before the code runs.
CHILD_PROGRAM = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom nanochat.execution import _child_main\n"
                 "del sys.path[0]\n_child_main(json.loads(sys.argv[2]))\n")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    for mode in [wanted] if wanted else modes_to_try():
        result = _execute_program(PROBE_CODE, mode, timeout=30.0, maximum_memory_bytes=None)
        if result.success:
            break
        reason = (result.stderr.strip().splitlines() or [result.error])[-1]
        refusals.append(f"{mode}: {reason}")
    else:
        raise RuntimeError(f"the code sandbox cannot run on this machine ({'; '.join(refusals) or sys.platform})")
    missing = {"user": "no namespaces: the code runs as nobody and sees every process and the host's /dev; on Linux "
                       "no sockets, keyrings or processes of its own",
               "guards": "no OS isolation: the code runs as this user, with only Python-level guards that code "
                         "which sets out to can get past, and a verdict it can forge"}
    if mode in missing:  # once per process: the first run pays for the probe
        refused = f" ({'; '.join(refusals)})" if refusals else ""
        print(f"nanochat sandbox: {mode} mode{refused}: {missing[mode]} (docs/sandbox.md)", file=sys.stderr)
    return mode


# -----------------------------------------------------------------------------
# The parent's side of one child


class _SandboxChild:
    """One sandboxed child process, started: CHILD_PROGRAM (`python -I -c CHILD_PROGRAM REPO_ROOT CONFIG`) in a
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
        command = [sys.executable, "-I", "-u", "-X", "utf8", "-c", CHILD_PROGRAM, REPO_ROOT, json.dumps(config)]
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
# The child side: CHILD_PROGRAM runs _child_main


def _child_main(config):
    # Read the inputs before the OS layer covers the directory with an empty tmpfs.
    files = {}
    for name in (CODE_FILENAME, SETUP_FILENAME, TESTS_FILENAME):
        if os.path.exists(name):
            with open(name, encoding="utf-8", errors="surrogatepass", newline="") as f:
                files[name] = f.read()
            os.remove(name)  # the code starts in an empty directory
    sys.argv = sys.argv[:1]
    # In "namespaces" mode, only the confined child of a fork returns from confine().
    confine(config["mode"], os.getcwd(), config["maximum_memory_bytes"], config["cpu_seconds"])
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
    data, or as the exception it raised (see _candidates_exception). A class, not a closure: a function would hand the
    tests' namespace its __globals__, this module's, pipes and all."""

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
            raise _candidates_exception(*(str(part) for part in reply["raised"]))
        return _from_message(reply["value"])


def _candidates_exception(name, message):
    """The exception the candidate's function raised, as the tests see it: a built-in exception type by name, so that
    the tests can catch what they expect (the name is the candidate's to choose, its class never travels), else
    RuntimeError. StopIteration and StopAsyncIteration arrive as RuntimeError too, as PEP 479 turns a StopIteration that
    leaves a generator into one: raised inside map(), filter(), zip(), next(..., default) or `async for`, they would end
    the tests' loop quietly, every assert in it skipped, and a function that only raises would pass. The other
    exceptions that end things quietly (GeneratorExit, KeyboardInterrupt, SystemExit) are not Exceptions."""
    exception_type = getattr(builtins, name, None)
    if (isinstance(exception_type, type) and issubclass(exception_type, Exception)
            and not issubclass(exception_type, (StopIteration, StopAsyncIteration))):
        with contextlib.suppress(TypeError):  # a type whose constructor wants more (UnicodeDecodeError)
            return exception_type(message)
    return RuntimeError(f"{name}: {message}")


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

