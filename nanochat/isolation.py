"""
The sandbox's operating-system layer: what confines each sandbox child (nanochat/execution.py starts them) before it
runs model-written code, in the isolation mode the probe chose: namespaces, a read-only root with a tmpfs and a /dev of
its own, another user, seccomp, Landlock and resource limits. docs/sandbox.md says what each mode guarantees.
"""

import ctypes
import os
import platform
import signal
import sys

try:
    import pwd
    import resource
except ImportError:  # not POSIX: modes_to_try() offers none
    pwd = resource = None

ISOLATION_MODES = ("namespaces", "user", "guards")  # strongest first
FILE_SIZE_LIMIT_BYTES = 64 << 20  # per file the code writes: a write loop must not fill the disk
TMPFS_BYTES = 64 << 20  # everything the code writes, all files together, in "namespaces" mode
PROCESS_LIMIT = 64  # processes and threads of the sandbox's user (RLIMIT_NPROC counts them per user)


# Python guards cannot stop code that sets out to escape them (gc and frames, io.FileIO, a re-imported posix or ctypes
# all reach the real system calls), so the kernel confines the child too, in the strongest mode this machine allows
# (docs/sandbox.md has what each mode gives). In "namespaces" mode confine() forks: the code runs in the child (PID 1
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
# The seccomp filter's view of the machine: the audit architecture, the number of clone(), and the calls it refuses:
# socket(), fork() and vfork() (aarch64 has neither), add_key(), request_key() and keyctl().
SECCOMP_ARCHITECTURES = {"x86_64": (0xC000003E, 56, (41, 57, 58, 248, 249, 250)),
                         "aarch64": (0xC00000B7, 220, (198, 217, 218, 219))}
SYS_IO_URING_SETUP, SYS_CLONE3 = 425, 435  # the same on both
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers
CLONE_THREAD = 0x00010000
EPERM, ENOSYS = 1, 38
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446  # on every architecture
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
# Landlock's rights to change the filesystem (write or truncate a file; make or remove one; rename or link across
# directories) by the ABI version that brought them; reading and running files stay unrestricted.
LANDLOCK_WRITE_FILE, LANDLOCK_TRUNCATE = 1 << 1, 1 << 14
LANDLOCK_CHANGES = {1: 0x1FF2, 2: 1 << 13, 3: LANDLOCK_TRUNCATE}  # 1: WRITE_FILE, REMOVE_* and MAKE_*; 2: REFER
# The devices the code finds in its /dev ("namespaces" mode) and may write to (where Landlock runs): what the standard
# library opens (os.devnull, os.urandom's fallback) and their kin. Not /dev/ptmx: a terminal made there is the host's.
SANDBOX_DEVICES = ("null", "zero", "full", "random", "urandom")


def modes_to_try():
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


def confine(mode, sandbox, maximum_memory_bytes, cpu_seconds):
    """Confine this process, the sandbox child, before it runs any model-written code; `sandbox` is its working
    directory. In "namespaces" mode only the forked child returns (see the comment above the constants). Every mode
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
        _restrict_writes(sandbox)
        _filter_system_calls()
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
    uid, gid = os.getuid(), os.getgid()  # before unshare: until the map below, a new user namespace shows 65534
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    _check(_libc().unshare(flags | (0 if root else CLONE_NEWUSER)), "unshare")
    if not root:  # inside the user namespace this user is itself; nothing else is mapped
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
    _mount_minimal_dev()
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


def _mount_minimal_dev():
    """A /dev of SANDBOX_DEVICES only, bound from the host's, on a read-only tmpfs: device files ignore the read-only
    mount, and the host's /dev holds ones that reach outside (/dev/ptmx makes a terminal on the host's devpts, which
    its processes can open). Bind mounts, not mknod, which a user namespace may not do."""
    handles = {name: os.open(f"/dev/{name}", os.O_PATH) for name in SANDBOX_DEVICES if os.path.exists(f"/dev/{name}")}
    _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")
    for name, handle in handles.items():
        open(f"/dev/{name}", "x").close()
        _mount(f"/proc/self/fd/{handle}", f"/dev/{name}", None, MS_BIND)
        os.close(handle)
    for name, target in [("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")]:
        os.symlink(target, f"/dev/{name}")
    _mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)


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


def _filter_system_calls():
    """A seccomp filter. It refuses (EPERM): socket() and io_uring_setup() (which can open sockets), since a Unix socket
    on disk (a D-Bus or ssh-agent socket) is reachable from any network namespace; the keyring calls, since the kernel
    keeps a user's keyring after the run ends (root's sandbox user, nobody, is the same in every run), so that a key one
    run adds a later one reads; and every new process (fork(), vfork(), clone() but for a thread; clone3(), whose flags
    a filter cannot read, fails with ENOSYS, so that the C library makes its threads with clone()). One process and its
    threads share one address space, so RLIMIT_AS bounds all the memory the code maps, where each of 64 processes could
    map that much. A system call of another ABI (i386's int 0x80, x32) kills the process, since there the same numbers
    mean other calls. Written for x86_64 and aarch64."""
    if sys.platform != "linux" or platform.machine() not in SECCOMP_ARCHITECTURES:
        return
    architecture, sys_clone, refused = SECCOMP_ARCHITECTURES[platform.machine()]
    load_word, jump_if_equal, jump_if_at_least, jump_if_set, return_ = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, ...
    allow, kill = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW, SECCOMP_RET_KILL_PROCESS
    fail = lambda errno: 0x00050000 | errno  # noqa: E731  (SECCOMP_RET_ERRNO)
    # (code, jump if true, jump if false, k); jumps name a label below them, None goes on to the next instruction.
    program = [
        (load_word, None, None, 4),  # seccomp_data.arch
        (jump_if_equal, None, "kill", architecture),
        (load_word, None, None, 0),  # seccomp_data.nr
        (jump_if_at_least, "refuse", None, X32_SYSCALL_BIT),
        *[(jump_if_equal, "refuse", None, number) for number in (*refused, SYS_IO_URING_SETUP)],
        (jump_if_equal, "no such call", None, SYS_CLONE3),
        (jump_if_equal, None, "allow", sys_clone),
        (load_word, None, None, 16),  # the low half of seccomp_data.args[0] (little-endian, both): clone()'s flags
        (jump_if_set, "allow", "refuse", CLONE_THREAD),
        "allow", (return_, None, None, allow),
        "refuse", (return_, None, None, fail(EPERM)),
        "no such call", (return_, None, None, fail(ENOSYS)),
        "kill", (return_, None, None, kill),
    ]
    labels, instructions = {}, []
    for item in program:
        if isinstance(item, str):
            labels[item] = len(instructions)
        else:
            instructions.append(item)
    offset = lambda at, label: 0 if label is None else labels[label] - at - 1  # noqa: E731
    filters = (_SockFilter * len(instructions))(*[_SockFilter(code, offset(at, true), offset(at, false), k)
                                                  for at, (code, true, false, k) in enumerate(instructions)])
    filter_program = _SockFprog(len(instructions), filters)
    _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(filter_program))


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _restrict_writes(sandbox):
    """Where the kernel has Landlock (Linux 5.19 and later, with ABI 2; see the constants above): the code may change
    files only below `sandbox`, and write only to SANDBOX_DEVICES elsewhere. The read-only mount ("namespaces" mode)
    leaves special files writable, a FIFO anyone may write to among them, which a reader outside would get; in "user"
    mode, where nothing is mounted read-only, it keeps the code out of the directories anyone may write to. Without
    Landlock, or with ABI 1 (which refuses every rename across directories), it does nothing."""
    libc = _libc()
    version = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                           ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if version < 2:
        return
    handled = sum(rights for abi, rights in LANDLOCK_CHANGES.items() if abi <= version)
    ruleset = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(ctypes.c_uint64(handled)),
                           ctypes.c_size_t(8), ctypes.c_uint32(0))  # the struct's first field: handled_access_fs
    if ruleset < 0:
        _check(ruleset, "landlock_create_ruleset")
    try:
        rules = [(sandbox, handled)] + [(f"/dev/{name}", handled & (LANDLOCK_WRITE_FILE | LANDLOCK_TRUNCATE))
                                        for name in SANDBOX_DEVICES if os.path.exists(f"/dev/{name}")]
        for path, rights in rules:
            handle = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(allowed_access=rights, parent_fd=handle)
                _check(libc.syscall(ctypes.c_long(SYS_LANDLOCK_ADD_RULE), ctypes.c_int(ruleset),
                                    ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(rule), ctypes.c_uint32(0)),
                       f"landlock_add_rule {path}")
            finally:
                os.close(handle)
        _check(libc.syscall(ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)),
               "landlock_restrict_self")
    finally:
        os.close(ruleset)


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
