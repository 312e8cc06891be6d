"""
Run model-written Python (HumanEval completions, later maybe tools) in sandboxed child processes, and score it against
tests with a verdict the code cannot forge. docs/sandbox.md says what is guaranteed, what is not, and what it costs.

Two layers confine each child. The operating system's (nanochat/isolation.py): where the kernel allows, the code runs
as another user in its own mount, PID and network namespaces, on a read-only filesystem with a private tmpfs, without
sockets, with a process limit; the whole namespace dies with the run. Where it allows only part of that, or none of
it (macOS, a container without user namespaces, not root), a line on stderr says so once, at the first run. Below it,
the Python guards of today as a second layer: the child replaces the destructive parts of the standard library
(processes, file changes outside its directory, sockets, ctypes, lifting its limits) with functions that raise
PermissionError, which stops the honest mistakes of a small model but not code that sets out to get past them.

Each child is this file run as a script (`python -I -u nanochat/execution.py CONFIG`) in a fresh temporary directory,
in a session of its own, with a minimal environment, stdin from /dev/null, a wall-clock timeout, a memory limit, and
its outcome reported on a private pipe, so that nothing it prints can pass for it.

The verdict. Whatever the child process can read or write, the code in it can too: its memory, its pipes, the
interpreter's frames. A check that runs in the same process as the code can be skipped from inside it (sys.settrace
can jump over an assert; a thread or hook the code leaves behind can run after the last assert and report for it), and
the status pipe can be written to directly. So no proof of "the tests passed" can come from the code's process, nonce
or not. execute_tests() therefore runs the two in different sandboxed processes:
- the candidate process runs the model's code, then serves calls to its functions: it reads a call (the function's
  name and plain-data arguments) from a pipe and writes the plain-data result or the exception's type and message;
- the tests process runs the task's own code (the prompt's helpers, then the test code) with the entry point bound to
  a stub that sends each call down that pipe and decodes the answer as JSON into plain values (lists, tuples, dicts,
  sets, strings, numbers, bytes, None), so that no object, method or code of the candidate's ever reaches it;
- only the tests process holds its status pipe, and it reports success only after the test code ran to its end.
The candidate process cannot reach the tests process (in "namespaces" mode each has PID, mount and network namespaces
of its own; in "user" mode both are uid nobody, made non-dumpable by the change of user, so neither can ptrace the
other or write its memory), so all it can do is answer the calls, answer them wrongly, or not answer (a failure).
In "guards" mode both run as the caller and can reach each other: there the verdict is not safe either. The price:
two interpreters per problem, and values must be plain data (an object that compares equal to anything, a common
reward hack, is refused on the way out, or reduced to its plain value if it subclasses one).
execute_code() runs one program in one process: its `success` is the program's own report, which code that sets out
to can fake; use it to run code, not to score it.
"""

import builtins
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

try:
    from nanochat import isolation
except ImportError:  # the sandbox child: `python -I` puts neither the repository nor PYTHONPATH on sys.path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from nanochat import isolation
    del sys.path[0]

OUTPUT_LIMIT_BYTES = 1 << 20  # per stream: a print loop must not eat the parent's memory
FILE_SIZE_LIMIT_BYTES = 64 << 20  # per file the code writes: a write loop must not fill the disk
MESSAGE_LIMIT_BYTES = 16 << 20  # per answer of the candidate process to the tests process
ERROR_LIMIT_CHARS = 2000
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
    """Score `code` against `tests` with a verdict the code cannot forge (the module docstring says how): `setup` (the
    task's trusted code, e.g. a prompt's helper functions) then `tests` run in a process of their own, where the name
    `entry_point` calls the function of that name in the candidate's process. Success means the tests ran to their end.
    stdout and stderr are the candidate's, then the tests'; the timeout covers both processes."""
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
    """The OS isolation (isolation.MODES) every sandbox child of this process gets: the strongest whose probe runs here,
    or the one $NANOCHAT_SANDBOX names (an error if it cannot run here)."""
    global _isolation_mode
    with _isolation_lock:
        if _isolation_mode is None:
            _isolation_mode = _probe_isolation()
        return _isolation_mode


def _probe_isolation():
    wanted = os.environ.get("NANOCHAT_SANDBOX")
    if wanted and wanted not in isolation.MODES:
        raise ValueError(f"NANOCHAT_SANDBOX={wanted!r}: not one of {', '.join(isolation.MODES)}")
    refusals = []
    for mode in [wanted] if wanted else isolation.modes_to_try():
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
    """One sandboxed child process, started: its temporary directory, process and output readers."""

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
        streams = [(self.process.stdout, OUTPUT_LIMIT_BYTES), (self.process.stderr, OUTPUT_LIMIT_BYTES),
                   (open(status_read, "rb", buffering=0), 64 << 10)]
        self.readers = [_start_reader(stream, limit) for stream, limit in streams]

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
            try:
                self.process.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:  # the group is already gone
            pass
        self.process.wait()
        stdout, stderr, status = [_finish_reader(*reader) for reader in self.readers]
        shutil.rmtree(self.directory, ignore_errors=True)
        return stdout.decode("utf-8", errors="replace"), stderr.decode("utf-8", errors="replace"), _parse_status(status)

    def ended_early(self):
        returncode = self.process.returncode
        reason = f"was killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        return f"the process {reason} before the code finished"


def _parse_status(raw):
    # The report comes from a child that may run hostile code: only a well-formed one counts.
    try:
        status = json.loads(raw)
        error, memory_exceeded = status["error"], status["memory_exceeded"]
    except (ValueError, TypeError, KeyError):
        return None
    if not (error is None or isinstance(error, str)) or not isinstance(memory_exceeded, bool):
        return None
    return {"error": error if error is None else error[:ERROR_LIMIT_CHARS], "memory_exceeded": memory_exceeded}


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
    isolation.enter(config["mode"], os.getcwd(), config["maximum_memory_bytes"], config["cpu_seconds"],
                    FILE_SIZE_LIMIT_BYTES)  # in "namespaces" mode, only the confined child of a fork returns
    _install_guards(os.path.realpath(os.getcwd()))
    status_fd, role = config["status_fd"], config["role"]
    if role == "program":
        _report(status_fd, _run(files[CODE_FILENAME], "<sandbox>", _fresh_main()))
    elif role == "candidate":
        namespace = _fresh_main()
        error = _run(files[CODE_FILENAME], "<sandbox>", namespace)
        _report(status_fd, error)
        if error is None:
            _serve_calls(namespace, config["requests_fd"], config["replies_fd"])
    elif role == "tests":
        namespace = _fresh_main()
        error = _run(files[SETUP_FILENAME], "<setup>", namespace)
        if error is None:
            namespace[config["entry_point"]] = _CandidateFunction(config["entry_point"], config["requests_fd"],
                                                                  config["replies_fd"])
            error = _run(files[TESTS_FILENAME], "<tests>", namespace)
        _report(status_fd, error)


def _fresh_main():
    # A fresh module, so the code sees none of this file's names, and `import __main__` and pickle find its own.
    main_module = types.ModuleType("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    return main_module.__dict__


def _run(code, filename, namespace):
    """Run `code` in `namespace`; the exception that ended it, or None if it ran to its end."""
    try:
        exec(compile(code, filename, "exec"), namespace)
        return None
    except BaseException as exc:  # SystemExit too: success means the code ran to its end
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)  # without this file's frame
        return exc


def _report(status_fd, exc):
    error = None if exc is None else _describe(exc)
    os.write(status_fd, json.dumps({"error": error, "memory_exceeded": isinstance(exc, MemoryError)}).encode())
    os.close(status_fd)


def _describe(exc):
    message = str(exc)
    return (f"{type(exc).__name__}: {message}" if message else type(exc).__name__)[:ERROR_LIMIT_CHARS]


# -----------------------------------------------------------------------------
# Calls from the tests process to the candidate's: length-prefixed JSON on two pipes


class _CandidateFunction:
    """In the tests process, the candidate's function: each call goes to the candidate process and comes back as plain
    data, or as the exception it raised (a built-in exception type by name, else RuntimeError)."""

    def __init__(self, name, requests_fd, replies_fd):
        self.name, self.requests_fd, self.replies_fd = name, requests_fd, replies_fd
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        _send(self.requests_fd, {"function": self.name, "args": _to_message(list(args)), "kwargs": _to_message(kwargs)})
        reply = _receive(self.replies_fd)
        if reply is None:
            raise RuntimeError(f"the candidate's process ended before {self.name}() returned")
        if "raised" in reply:
            name, message = (str(part) for part in reply["raised"])
            exception = RuntimeError(f"{name}: {message}")
            exception_type = getattr(builtins, name, None)
            if isinstance(exception_type, type) and issubclass(exception_type, Exception):
                try:
                    exception = exception_type(message)
                except TypeError:  # a type whose constructor wants more (UnicodeDecodeError)
                    pass
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
        _send_encoded(replies_fd, reply)


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


def _send(fd, message):
    _send_encoded(fd, json.dumps(message))


def _send_encoded(fd, text):
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
    if isolation.resource is not None:
        refuse(isolation.resource, "setrlimit", "prlimit")
    refuse(faulthandler, "enable", "dump_traceback_later", "register")
    # ctypes can call any C function (libc's unlink, kill, ...) past every guard above.
    sys.modules["ctypes"] = sys.modules["_ctypes"] = None


def _refused(function_name):
    def refused(*args, **kwargs):
        raise PermissionError(f"{function_name} is disabled in the nanochat sandbox")
    return refused


if __name__ == "__main__":
    _child_main(json.loads(sys.argv[1]))
