"""The code sandbox's OS layer against real attacks: the escapes past the Python guards that the audit of Hardening IV
found, each run through the sandbox as model-written code and checked for its effect outside (docs/sandbox.md)."""

import ctypes
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile

import psutil
import pytest

from nanochat.execution import execute_code, execute_tests, isolation_mode
from nanochat.isolation import PROCESS_LIMIT, TMPFS_BYTES
from tasks.humaneval import HumanEval

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every test runs a few sandboxed interpreters; a hung one must not hang the suite.
pytestmark = [pytest.mark.quick, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True, scope="module")
def needs_namespaces():
    # Where the OS gives less (macOS, a container without user namespaces) these escapes are expected to work; CI's
    # machine must give it all, so there a missing layer fails the tests instead of skipping them.
    if isolation_mode() != "namespaces" and not os.environ.get("CI"):
        pytest.skip(f"the sandbox runs in {isolation_mode()!r} mode on this machine, not 'namespaces'")


# -----------------------------------------------------------------------------
# The mode for a caller who is not root


def test_namespaces_mode_runs_for_a_user_who_is_not_root():
    # Such a user maps itself into a user namespace of its own; the uid to map is the one from before unshare(), since
    # inside the namespace every uid reads 65534 until the map is written (so the user is not nobody, 65534, here).
    if os.geteuid() != 0:
        pytest.skip("needs root, to run as another user")
    as_user = dict(user=4242, group=4242, extra_groups=[], capture_output=True, text=True, timeout=60)
    can_unshare = ("import ctypes, sys\nsys.path.insert(0, sys.argv[1])\nimport nanochat.execution\n"
                   "sys.exit(ctypes.CDLL(None).unshare(0x10000000))  # CLONE_NEWUSER\n")

    def usable(python):
        try:
            return subprocess.run([python, "-I", "-c", can_unshare, REPO_ROOT], **as_user).returncode == 0
        except OSError:  # the user may not run it
            return False
    pythons = [python for python in (sys.executable, "/usr/bin/python3") if usable(python)]
    if not pythons:
        pytest.skip("no Python and repository that others may read, or no user namespaces for users but root")
    caller = ("import sys\nsys.path.insert(0, sys.argv[1])\nfrom nanochat.execution import execute_code\n"
              "print(execute_code('import os\\nprint(os.getuid(), 6 * 7)').stdout, end='')\n")
    run = subprocess.run([pythons[0], "-I", "-c", caller, REPO_ROOT], env={"NANOCHAT_SANDBOX": "namespaces"},
                         **as_user)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "4242 42\n"


# -----------------------------------------------------------------------------
# Forging the verdict


CONVERSATION = {"prompt": 'def total(numbers):\n    """Sum of the numbers."""\n',
                "test": "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
                "entry_point": "total"}
RIGHT = "def total(numbers):\n    return sum(numbers)\n"
FORGERIES = {
    # A success report on every fd (the status pipe among them), then an exit before the tests can fail.
    "status pipe": """
import os
for fd in range(3, 256):
    try:
        os.write(fd, b'{"error": null, "memory_exceeded": false}')
    except OSError:
        pass
os._exit(0)
""",
    # A harness in the code's process reports through json.dumps, which the code can replace.
    "harness's report rewritten": """
import json
json.dumps = lambda *args, **kwargs: '{"error": null, "memory_exceeded": false}'
def total(numbers):
    return -1
""",
    "always-equal object": """
class Anything:
    def __eq__(self, other):
        return True
def total(numbers):
    return Anything()
""",
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_humaneval_verdict_cannot_be_forged(forgery):
    scorer = HumanEval.__new__(HumanEval)  # scoring needs no rows
    assert scorer.evaluate(CONVERSATION, f"```python\n{RIGHT}```")
    assert not scorer.evaluate(CONVERSATION, f"```python\n{FORGERIES[forgery]}```")


# Tests whose loops end quietly on StopIteration: map() and filter() stop, and zip() and next(..., default) with them.
QUIET_LOOPS = """
for got, want in zip(map(total, [[1, 2, 3], [4]]), [6, 4]):
    assert got == want
assert not list(filter(lambda numbers: total(numbers) != sum(numbers), [[1, 2, 3]]))
assert next(map(total, [[5]]), 5) == 5
"""
# ... and `async for` on StopAsyncIteration. The coroutine runs by hand: asyncio needs a socketpair, which the guards
# refuse.
QUIET_ASYNC_LOOP = """
class Totals:
    def __init__(self, lists):
        self.lists = iter(lists)
    def __aiter__(self):
        return self
    async def __anext__(self):
        numbers = next(self.lists, None)
        if numbers is None:
            raise StopAsyncIteration
        return numbers, total(numbers)
async def check():
    async for numbers, got in Totals([[1, 2, 3], [4]]):
        assert got == sum(numbers)
try:
    check().send(None)
except StopIteration:  # how a coroutine that awaits nothing returns
    pass
"""
LOOP_ENDERS = {
    "raises StopIteration": ("def total(numbers):\n    raise StopIteration('no total')\n", QUIET_LOOPS),
    "its own class named StopIteration": ("class StopIteration(Exception):\n    pass\n"
                                          "def total(numbers):\n    raise StopIteration('no total')\n", QUIET_LOOPS),
    "a result whose __iter__ raises StopIteration": ("class Total(list):\n    def __iter__(self):\n"
                                                     "        raise StopIteration('no total')\n"
                                                     "def total(numbers):\n    return Total()\n", QUIET_LOOPS),
    "raises StopAsyncIteration": ("def total(numbers):\n    raise StopAsyncIteration('no total')\n", QUIET_ASYNC_LOOP),
}


@pytest.mark.parametrize("attack", LOOP_ENDERS)
def test_candidates_exception_cannot_end_the_tests_loop(attack):
    code, tests = LOOP_ENDERS[attack]
    assert execute_tests(RIGHT, tests, "total").success  # the tests pass a right answer
    result = execute_tests(code, tests, "total")
    assert not result.success, result
    # It fails with the candidate's exception, as a RuntimeError (as PEP 479 reports a StopIteration that leaves a
    # generator).
    raised = "StopAsyncIteration" if "StopAsyncIteration" in attack else "StopIteration"
    assert result.error == f"RuntimeError: {raised}: no total", result.error


# -----------------------------------------------------------------------------
# The caller: killed, its environment read, its memory rewritten


CALLER = """
import ctypes, json, os, sys
from nanochat.execution import execute_code
marker = bytearray(b"untouched")
address = ctypes.addressof((ctypes.c_char * len(marker)).from_buffer(marker))
code = sys.argv[1].replace("CALLER_PID", str(os.getpid())).replace("MARKER_ADDRESS", str(address))
result = execute_code(code, timeout=10.0)
print(json.dumps({"marker": marker.decode(), "stdout": result.stdout, "error": result.error}))
"""
ATTACKS_ON_THE_CALLER = {
    "kill it": """
import sys
del sys.modules['posix']
import posix
posix.kill(posix.getppid(), 9)
posix.kill(CALLER_PID, 9)
""",
    "read its environment": """
import os
for pid in (os.getppid(), CALLER_PID):
    try:
        print(open(f'/proc/{pid}/environ').read())
    except OSError as error:
        print(error)
""",
    "rewrite its memory": """
import _io
memory = _io.FileIO('/proc/CALLER_PID/mem', 'r+')
memory.seek(MARKER_ADDRESS)
memory.write(b'rewritten')
""",
}


@pytest.mark.parametrize("attack", ATTACKS_ON_THE_CALLER)
def test_code_cannot_reach_its_caller(attack):
    # The caller is a process of its own, so that what the code does to it does not happen to pytest.
    env = {**os.environ, "NANOCHAT_SECRET": "hunter2", "PYTHONPATH": REPO_ROOT}
    caller = subprocess.run([sys.executable, "-c", CALLER, ATTACKS_ON_THE_CALLER[attack]], env=env,
                            capture_output=True, text=True, timeout=60)
    assert caller.returncode == 0, caller.stderr
    outcome = json.loads(caller.stdout.splitlines()[-1])
    assert outcome["marker"] == "untouched"
    assert "hunter2" not in outcome["stdout"]


# -----------------------------------------------------------------------------
# Programs run, files written and deleted, sockets opened


@pytest.fixture
def outside(tmp_path):
    """A file outside the sandbox, and a world-writable directory beside it, as root's would be."""
    (tmp_path / "keep.txt").write_text("precious")
    shared = tempfile.mkdtemp(prefix="nanochat_shared_")
    os.chmod(shared, 0o1777)
    try:
        yield {"file": str(tmp_path / "keep.txt"), "dir": str(tmp_path), "shared": shared}
        assert (tmp_path / "keep.txt").read_text() == "precious"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
        assert os.listdir(shared) == []
    finally:
        shutil.rmtree(shared)


ESCAPES = {
    "Popen's base class": "import subprocess\nsubprocess.Popen.__bases__[0](['/bin/rm', '-f', FILE]).wait()",
    "re-imported posix.fork/execv": """
import sys
del sys.modules['posix']
import posix
pid = posix.fork()
if pid == 0:
    posix.execv('/bin/rm', ['rm', '-f', FILE])
posix.waitpid(pid, 0)
""",
    "ctypes popped from sys.modules": """
import sys
sys.modules.pop('ctypes')
sys.modules.pop('_ctypes')
import ctypes
ctypes.CDLL(None).unlink(FILE.encode())
""",
    "io.FileIO": "import io\nio.FileIO(FILE, 'w').write(b'clobbered')",
    "_io.open": "import _io\n_io.open(FILE, 'w').write('clobbered')",
    "open's closure": """
real_open = [cell.cell_contents for cell in open.__closure__ if getattr(cell.cell_contents, '__name__', '') == 'open']
real_open[0](FILE, 'w').write('clobbered')
""",
    "os.remove's closure": """
import os
real_remove = [cell.cell_contents for cell in os.remove.__closure__
               if getattr(cell.cell_contents, '__name__', '') == 'remove']
real_remove[0](FILE)
""",
    "sqlite3": "import sqlite3\nsqlite3.connect(DIR + '/new.db').execute('create table t (x)')",
    "a world-writable directory": "import io\nio.FileIO(SHARED + '/dropped', 'w').write(b'x')",
}


@pytest.mark.parametrize("escape", ESCAPES)
def test_escape_past_the_guards_changes_nothing_outside(escape, outside):
    code = ESCAPES[escape].replace("FILE", repr(outside["file"])).replace("SHARED", repr(outside["shared"]))
    result = execute_code(code.replace("DIR", repr(outside["dir"])), timeout=10.0)
    assert not result.timeout, result
    # The `outside` fixture checks on teardown that the file is intact and nothing new appeared.


@pytest.fixture
def listeners():
    """A TCP server on the loopback and a Unix socket anyone may connect to, as a D-Bus or agent socket would be."""
    tcp = socket.create_server(("127.0.0.1", 0))
    directory = tempfile.mkdtemp(prefix="nanochat_socket_")
    os.chmod(directory, 0o755)
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(os.path.join(directory, "agent.sock"))
    os.chmod(os.path.join(directory, "agent.sock"), 0o777)
    for server in (tcp, unix):
        server.listen()
        server.setblocking(False)
    try:
        yield {"port": tcp.getsockname()[1], "path": os.path.join(directory, "agent.sock")}
        for server in (tcp, unix):
            with pytest.raises(BlockingIOError):  # nobody connected
                server.accept()
    finally:
        tcp.close()
        unix.close()
        shutil.rmtree(directory)


SOCKETS = {
    "_socket.socket": "import _socket\n_socket.socket(_socket.AF_INET).connect(('127.0.0.1', PORT))",
    "importlib.reload(socket)": "import importlib, socket\nimportlib.reload(socket)\n"
                                "socket.create_connection(('127.0.0.1', PORT))",
    "a Unix socket on disk": "import _socket\n_socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM).connect(PATH)",
}


@pytest.mark.parametrize("attack", SOCKETS)
def test_code_opens_no_socket(attack, listeners):
    code = SOCKETS[attack].replace("PORT", str(listeners["port"])).replace("PATH", repr(listeners["path"]))
    result = execute_code(code + "\nprint('connected')", timeout=10.0)
    assert not result.success and "connected" not in result.stdout
    # The `listeners` fixture checks on teardown that no connection reached either server.


# -----------------------------------------------------------------------------
# Channels the read-only mount leaves open: special files and the kernel's keyrings


@pytest.fixture
def fifo():
    """A FIFO on the host that anyone may write to, with a reader outside the sandbox waiting on it."""
    # Only Landlock refuses the write (a read-only mount does not); CI's kernel has it.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(444, None, 0, 1) < 2 and not os.environ.get("CI"):  # landlock_create_ruleset(): the ABI version
        pytest.skip("the kernel has no Landlock (ABI 2 or later)")
    directory = tempfile.mkdtemp(prefix="nanochat_fifo_")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "pipe")
    os.mkfifo(path)
    os.chmod(path, 0o666)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # first, so that a writer's open() neither blocks nor fails
    try:
        yield path
        try:
            received = os.read(reader, 1 << 10)
        except BlockingIOError:  # a writer still holds it open, having written nothing
            received = b""
        assert received == b""
    finally:
        os.close(reader)
        shutil.rmtree(directory)


def test_code_writes_into_no_fifo_outside(fifo):
    code = """
import sys
del sys.modules['posix']
import posix
fd = posix.open(PATH, posix.O_WRONLY | posix.O_NONBLOCK)
posix.write(fd, posix.uname().nodename.encode())
"""
    result = execute_code(code.replace("PATH", repr(fifo)), timeout=10.0)
    assert not result.success, result
    # The `fifo` fixture checks on teardown that the reader outside received nothing.


def test_code_opens_only_the_devices_python_needs():
    # /dev/ptmx makes a terminal on the host's devpts, which processes outside can open; the rest of the host's /dev
    # is no better. What stays: the few that the standard library opens.
    code = """
import sys
del sys.modules['posix']
import posix
opened = []
for name, flags in [('ptmx', posix.O_RDWR), ('kmsg', posix.O_RDONLY), ('tty', posix.O_RDWR), ('null', posix.O_RDWR),
                    ('zero', posix.O_RDONLY), ('urandom', posix.O_RDONLY)]:
    try:
        posix.close(posix.open('/dev/' + name, flags | posix.O_NOCTTY))
        opened.append(name)
    except OSError:
        pass
print(' '.join(opened))
"""
    result = execute_code(code, timeout=10.0)
    assert result.stdout == "null zero urandom\n", result


KEY_SYSCALLS = {"x86_64": (248, 249, 250), "aarch64": (217, 218, 219)}  # add_key, request_key, keyctl
KEYRING_CODE = """
import sys
sys.modules.pop('ctypes')
sys.modules.pop('_ctypes')
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
ADD_KEY, REQUEST_KEY, KEYCTL = KEY_SYSCALLS
"""


@pytest.mark.skipif(platform.machine() not in KEY_SYSCALLS, reason="system call numbers known for x86_64 and aarch64")
def test_runs_share_no_keyring():
    # One run leaves a key in its user's keyring (uid nobody's, when the caller is root: the same in every run and
    # kept by the kernel after the run ends); a later run looks it up and reads it.
    tag = str(random.randrange(10**9))
    store = KEYRING_CODE + "libc.syscall(ADD_KEY, b'user', b'nanochat-TAG', b'secret-TAG', len(b'secret-TAG'), -4)\n"
    fetch = KEYRING_CODE + """
key = libc.syscall(REQUEST_KEY, b'user', b'nanochat-TAG', None, 0)
buffer = ctypes.create_string_buffer(64)
libc.syscall(KEYCTL, 11, key, buffer, 64)  # KEYCTL_READ
print(buffer.value)
"""
    for code in (store, fetch):
        result = execute_code(code.replace("KEY_SYSCALLS", repr(KEY_SYSCALLS[platform.machine()]))
                              .replace("TAG", tag), timeout=10.0)
        assert result.success, result
    assert f"secret-{tag}" not in result.stdout


# -----------------------------------------------------------------------------
# Processes left behind, too many processes, too much memory, the disk filled


def test_no_process_outlives_the_run():
    # A grandchild in a session of its own escapes a kill of the process group; a unique argument finds it after. The
    # kernel refuses the fork itself (seccomp: the run is one process, so that its memory limit is the run's); the PID
    # namespace, which ends every process in it with the run, is the layer below.
    tag = f"{random.randrange(10**6, 10**7)}.5"
    code = """
import sys, time
del sys.modules['posix']
import posix
if posix.fork() == 0:
    posix.setsid()
    posix.execv('/bin/sleep', ['sleep', TAG])
time.sleep(0.5)
print('forked')
"""
    result = execute_code(code.replace("TAG", repr(tag)), timeout=10.0)
    assert result.error == "PermissionError: [Errno 1] Operation not permitted", result  # the kernel's, not the guards'
    survivors = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", tag]]
    for survivor in survivors:
        survivor.kill()
    assert survivors == []


def test_process_count_is_limited():
    # Processes, which the kernel refuses outright, and threads, which RLIMIT_NPROC counts (and RLIMIT_AS: each stack
    # takes address space).
    code = """
import sys, threading, time
del sys.modules['posix']
import posix
forks = threads = 0
for _ in range(200):
    try:
        pid = posix.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        posix._exit(0)
    forks += 1
for _ in range(200):
    try:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    except RuntimeError:
        break
    threads += 1
print(forks, threads)
"""
    result = execute_code(code, timeout=20.0)
    assert result.success, result
    forks, threads = map(int, result.stdout.split())
    assert forks == 0 and threads < PROCESS_LIMIT


def test_memory_limit_covers_every_process_of_the_run():
    # Each process under the limit, together far over it: six children and the run itself each write 100 MiB and hold
    # it until the run ends; each reports whether it could, and the run adds up what was held at once.
    code = """
import sys, time
del sys.modules['posix']
import posix
reports, report = posix.pipe()
def hold():
    try:
        return b'x' * (100 << 20)  # written, so resident
    except MemoryError:
        return b''
children = 0
while children < 6:
    try:
        pid = posix.fork()
    except OSError:  # refused: the run alone holds memory
        pid = None
    if pid is None:
        break
    if pid == 0:
        block = hold()
        posix.write(report, b'1' if block else b'0')
        time.sleep(30)
        posix._exit(0)
    children += 1
block = hold()
held = bool(block) + sum(int(posix.read(reports, 1)) for _ in range(children))
print(held * 100)
"""
    result = execute_code(code, timeout=20.0)
    assert result.stdout.strip(), result
    assert int(result.stdout) <= 256  # MiB: the limit execute_code sets by default


def test_disk_writes_are_capped_in_total():
    # Three files, each under RLIMIT_FSIZE, together more than the sandbox's tmpfs holds.
    code = """
written = 0
for name in 'abc':
    with open(name, 'wb', buffering=0) as f:
        for _ in range(32):
            try:
                written += f.write(bytes(1 << 20))
            except OSError:
                break
print(written >> 20)
"""
    result = execute_code(code, timeout=20.0, maximum_memory_bytes=None)
    assert result.stdout.strip(), result
    assert int(result.stdout) <= TMPFS_BYTES >> 20
