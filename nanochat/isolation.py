"""
The operating system's layer of the code sandbox; nanochat/execution.py holds the parent's side and the Python guards.

Python-level guards cannot stop code that sets out to escape them (gc and frames, io.FileIO, a re-imported posix or
ctypes all reach the real system calls), so the sandbox child is also confined by the kernel, in the strongest of three
modes this machine allows (execution.py probes them once per process, strongest first):

"namespaces" (Linux, as root, or as any user where unprivileged user namespaces are on):
- another user: uid nobody when the caller is root; otherwise the caller's own uid in a new user namespace with every
  capability dropped (there is no other uid to switch to without privileges);
- new mount, PID, network, IPC and UTS namespaces: the whole filesystem read-only; the temporary directory a private
  tmpfs of TMPFS_BYTES, the one place it can write; /proc showing only its own processes (not the caller's environ or
  memory); no network but a loopback that is down. It runs as PID 1 of its namespace, so when it ends or is killed the
  kernel kills every process it started, those that left its session included (and, as for any PID 1, a signal it
  sends itself without a handler for it is ignored). It starts in a session of its own;
- no sockets: a seccomp filter fails socket() (and io_uring, which can open them) with EPERM, since a Unix socket on
  disk (a D-Bus or ssh-agent socket) is reachable from any network namespace; no_new_privs, so a setuid program
  cannot give the privileges back; at most PROCESS_LIMIT processes of its user (RLIMIT_NPROC).
"user" (root where namespaces are refused, e.g. a container without CAP_SYS_ADMIN; macOS as root): uid nobody,
  no_new_privs, the socket filter (Linux), RLIMIT_NPROC. It cannot signal or read the caller or write root's files,
  but it can write where anyone may (/tmp), and a child that leaves its process session outlives the run.
"guards": the OS adds nothing but the limits below; the Python guards are all there is.

Every mode limits memory (RLIMIT_AS/RLIMIT_DATA), CPU time (RLIMIT_CPU, a backstop to the parent's wall-clock timeout),
the size of each file written (RLIMIT_FSIZE) and core dumps (RLIMIT_CORE).

In "namespaces" mode enter() forks: the code runs in the child (PID 1 of the new PID namespace) and the process that
forked stays outside it as its supervisor: it waits, kills the namespace when the parent sends SIGTERM (at the end of
a run, on a timeout, or when the parent dies), and exits with the child's status. System calls go through ctypes:
Python 3.11 has no os.unshare, and no version has mount, mount_setattr, capset or seccomp.
"""

import ctypes
import os
import platform
import signal
import sys

try:
    import pwd
    import resource
except ImportError:  # not POSIX: execution.py refuses to run at all
    pwd = resource = None

MODES = ("namespaces", "user", "guards")  # strongest first
TMPFS_BYTES = 64 << 20  # everything the code writes, all files together, in "namespaces" mode
PROCESS_LIMIT = 64  # processes and threads of the sandbox's user (RLIMIT_NPROC counts them per user)

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


def modes_to_try():
    """The modes this platform and user might allow, strongest first; execution.py keeps the first whose probe runs."""
    if resource is None:
        return []
    if sys.platform == "linux":
        return list(MODES) if os.geteuid() == 0 else ["namespaces", "guards"]
    return ["user", "guards"] if os.geteuid() == 0 else ["guards"]


def sandbox_user():
    """The uid and gid the code runs as when the caller is root: nobody's."""
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def enter(mode, sandbox, maximum_memory_bytes, cpu_seconds, file_size_bytes):
    """Confine this process, the sandbox child, before it runs any model-written code; `sandbox` is its working
    directory. In "namespaces" mode only the forked child returns (see the module docstring)."""
    if mode == "namespaces":
        _enter_namespaces(sandbox)
    elif mode == "user":
        uid, gid = sandbox_user()
        os.chown(sandbox, uid, gid)
        _become(uid, gid)
    if mode in ("namespaces", "user") and sys.platform == "linux":
        _prctl(PR_SET_NO_NEW_PRIVS, 1)  # before the filter: seccomp requires it of an unprivileged process
        _forbid_sockets()
    limits = [("RLIMIT_FSIZE", file_size_bytes), ("RLIMIT_CORE", 0), ("RLIMIT_CPU", cpu_seconds)]
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
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)  # if execution.py's process dies, the supervisor ends the run
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)
    # Block SIGTERM across the fork, so that the supervisor's handler never runs without the child's pid to kill.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    child = os.fork()
    if child:
        _supervise(child)  # never returns
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a supervisor killed outright takes the namespace with it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    # PID 1 from here. A session of its own: the supervisor's process group must be out of reach of kill(0).
    os.setsid()
    _mount_private_root(sandbox, root)
    os.chdir(sandbox)  # into the tmpfs that now covers it
    if root:
        _become(*sandbox_user())
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
        _expose_interpreter(*sandbox_user())
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)  # this PID namespace's processes only
    owner = ",uid={},gid={}".format(*sandbox_user()) if root else ""
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
    """A seccomp filter: socket() and io_uring_setup() fail with EPERM; a system call of another ABI (i386's int 0x80,
    x32) kills the process, since there the same numbers mean other calls. Only x86_64 and aarch64 are written here."""
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
