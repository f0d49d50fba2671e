"""Confinement and process-tree control for commands the tools start (Bash, ripgrep).

Bash commands are hostile code run as the server's user, often root (CONTRACT 7). Each runs
under bubblewrap in a new user namespace whose only mapped ids are the server's own (the
owner of the session mount, so the FUSE mount, which admits only its owner, still serves
it), with every capability dropped, ``no_new_privs``, new pid, ipc, uts, network and mount
namespaces, and a seccomp filter built with libseccomp (:func:`seccomp_program`) that
refuses mount, umount2, pivot_root, ptrace, bpf, keyctl, kexec_load, init_module,
finit_module, perf_event_open and nested user namespaces among others. A user namespace
made by root with uid 0 mapped to 0 still holds no capability over the host's
namespaces, so the command is root only towards files that it sees and that root owns.

What the command sees (:func:`confined_shell`): the session root read-write at its own
path; /usr, /bin, /lib* and /etc read-only (without shadow, gshadow, sudoers or ssh host
keys); a private /tmp; its own /proc with /proc/sys and the kernel's trigger files
read-only or masked; a minimal /dev. Nothing else. Its environment is an allowlist
(:func:`sandbox_env`). Resource limits: processes (a pids cgroup where this process may
make one, since the sandbox's uid is the server's; else RLIMIT_NPROC, counted in the
sandbox's own user namespace), address space and file size (RLIMIT_AS, RLIMIT_FSIZE).
Networking is off (an empty network namespace with only its own loopback); with
``SandboxPolicy.network`` slirp4netns gives the namespace outbound access in user mode,
with the host's loopback unreachable unless ``SandboxPolicy.host_loopback``; it needs
``/dev/net/tun`` open to this user (:func:`network_unavailable_reason`, else
NetworkUnavailable before anything starts).

The session's path policy (tools.policyview) covers paths inside the root with mounts
made in the sandbox's mount namespace once bwrap has built it and before the command runs
(:func:`cover_sandbox`, by the helper :class:`_CoverMaker`), or, where the kernel does not
allow that, with bwrap's own binds.

Where such a sandbox cannot be built, :func:`unavailable_reason` names the cause and the
Bash tool refuses unless the operator chose ``--unsafe-no-sandbox``; then commands run
under a small subreaper helper that kills the whole process tree when they end.
``REWINDFS_NO_SANDBOX=1`` makes the sandbox unavailable (for tests and for machines where
bubblewrap misbehaves).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import functools
import glob
import json
import marshal
import os
import queue
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_PROBE_TIMEOUT_S = 10
_SYNC_TIMEOUT_S = 10         # bwrap telling its child's pid; slirp4netns getting ready
_CGROUP_RMDIR_S = 5.0        # how long a finished run's pids cgroup may take to empty
_GIB = 1 << 30
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_HOME = "/tmp"
SLIRP_DNS = "10.0.2.3"       # slirp4netns's built-in DNS forwarder
SLIRP_HOST = "10.0.2.2"      # slirp4netns's address for the host (its loopback, if allowed)


class SandboxUnavailable(Exception):
    """No sandbox can be built here and the operator did not allow running unconfined;
    ``reason`` names the cause (e.g. bubblewrap missing, user namespaces disabled)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NetworkUnavailable(Exception):
    """The policy allows networking, but slirp4netns cannot give the sandbox a network
    here; ``reason`` names the cause (slirp4netns missing, /dev/net/tun not open to this
    user)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class SandboxPolicy:
    """How Bash commands are confined (set by the operator: ``rewindfs mcp`` options).

    ``network``: outbound access through slirp4netns (default: no network at all).
    ``host_loopback``: with ``network``, the host's loopback services are reachable at
    10.0.2.2 (default: unreachable). ``env``: names of the server's environment variables
    passed on to commands besides the allowlist. ``unsafe_no_sandbox``: where no sandbox
    can be built, run commands unconfined instead of refusing. ``max_processes``: processes
    and threads of one command at once; ``max_memory_bytes``: address space of each of its
    processes (RLIMIT_AS); ``max_file_bytes``: largest file it may write (RLIMIT_FSIZE);
    ``max_tmp_bytes``: size of each of its memory-backed file systems, /tmp and /dev/shm
    (tmpfs pages are no process's address space, so RLIMIT_AS does not bound them; an
    unsized tmpfs may take half of the host's memory).
    """

    network: bool = False
    host_loopback: bool = False
    env: tuple[str, ...] = ()
    unsafe_no_sandbox: bool = False
    max_processes: int = 1024
    max_memory_bytes: int = 16 * _GIB
    max_file_bytes: int = 64 * _GIB
    max_tmp_bytes: int = 4 * _GIB


# -- environment ---------------------------------------------------------------------------

_ENV_ALLOWED = ("PATH", "LANG", "LANGUAGE", "TERM")


def sandbox_env(policy: SandboxPolicy, source: Mapping[str, str] | None = None,
                confined: bool = True) -> dict[str, str]:
    """The environment of a command: PATH, LANG, LANGUAGE, LC_* and TERM from ``source``
    (default: this process's environment), the variables the operator named in
    ``policy.env``, HOME and TMPDIR pointing at the sandbox's private /tmp (the server's
    HOME when unconfined), and ``PYTHONDONTWRITEBYTECODE=1``: a same-size edit within one
    second would otherwise leave a ``__pycache__`` entry that Python takes as current
    (pyc records the source's mtime in whole seconds and its size), and the next run
    would execute the old code. Nothing else of the server's environment passes."""
    src = os.environ if source is None else source
    env = {k: v for k, v in src.items() if k in _ENV_ALLOWED or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    for name in policy.env:
        if name in src:
            env[name] = src[name]
    if confined:
        env["HOME"] = SANDBOX_HOME
        env["TMPDIR"] = "/tmp"
    elif "HOME" in src:
        env["HOME"] = src["HOME"]
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


# -- seccomp -------------------------------------------------------------------------------

# Refused with EPERM: mounting and namespaces' roots, tracing and reading other processes'
# memory, kernel modules and kexec, BPF, keyrings, perf, swap, reboot, accounting, quotas,
# the kernel log, port I/O, userfaultfd and file handles.
_REFUSED = (
    "mount", "umount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "setns",
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",
    "bpf", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "create_module", "perf_event_open",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "quotactl_fd", "syslog",
    "iopl", "ioperm", "userfaultfd", "open_by_handle_at", "lookup_dcookie",
    "fanotify_init", "nfsservctl", "uselib", "_sysctl", "vm86", "vm86old",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
)
# Calls giving a file a mode, and the argument holding it: a mode with the set-user-ID or
# set-group-ID bit fails with EPERM. The sandbox's uid is the server's (root, often) and a
# plain --root workspace is a host directory without nosuid, so such a file would be a
# set-user-ID-root program left on the host for any local user to run. (io_uring, whose
# openat a filter cannot see, is refused above; openat2's mode is in a struct: ENOSYS.)
_MODE_ARG = (("chmod", 1), ("fchmod", 1), ("fchmodat", 2), ("fchmodat2", 2),
             ("open", 2), ("openat", 3), ("creat", 1), ("mknod", 1), ("mknodat", 2))
_SET_ID_BITS = (stat.S_ISUID, stat.S_ISGID)
_CLONE_NEWUSER = 0x10000000
_TIOCSTI = 0x5412            # push characters into a terminal's input
_TIOCLINUX = 0x541C


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The sandbox's seccomp filter as a BPF program (what ``bwrap --seccomp FD`` reads),
    built with libseccomp (through pyseccomp): the calls in ``_REFUSED`` fail with EPERM,
    as do clone and unshare asking for a new user namespace, the TIOCSTI/TIOCLINUX
    ioctls, and a mode with the set-user-ID or set-group-ID bit given to a file
    (``_MODE_ARG``); clone3 and openat2, whose flags and mode a filter cannot read, fail
    with ENOSYS so that the C library falls back to clone (openat2 it never uses). Calls of any other architecture (32-bit x86 on x86-64)
    kill the process; x32 calls get the same rules. Raises ImportError or OSError when
    libseccomp cannot build it."""
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    with contextlib.suppress(Exception):     # only on x86-64; the x32 ABI gets our rules
        if sc.system_arch() == sc.Arch.X86_64:
            f.add_arch(sc.Arch.X32)
    eperm = sc.ERRNO(errno.EPERM)
    for name in _REFUSED:
        try:
            f.add_rule(eperm, name)
        except (OSError, ValueError, RuntimeError):
            pass                             # not a call of this architecture
    newuser = sc.Arg(0, sc.MASKED_EQ, _CLONE_NEWUSER, _CLONE_NEWUSER)
    f.add_rule(eperm, "unshare", newuser)
    f.add_rule(eperm, "clone", newuser)
    for name, arg in _MODE_ARG:
        for bit in _SET_ID_BITS:
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                f.add_rule(eperm, name, sc.Arg(arg, sc.MASKED_EQ, bit, bit))
    for name in ("clone3", "openat2"):
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            f.add_rule(sc.ERRNO(errno.ENOSYS), name)
    for req in (_TIOCSTI, _TIOCLINUX):
        f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, req))
    fd = os.memfd_create("rewindfs-seccomp")
    with os.fdopen(fd, "w+b") as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def _data_fd(data: bytes, name: str) -> int:
    """A file descriptor positioned at the start of ``data`` (a memfd), to pass to bwrap."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# -- covers made in the sandbox: the path policy's mounts -----------------------------------

# Mounting a path policy's covers through bwrap costs one read of /proc/self/mountinfo per
# bind (bwrap looks the new mount up to set its flags), so n covers cost O(n^2) lines of
# mountinfo; covers made before bwrap starts (in a namespace of its own, carried in by its
# bind of the root) still sit in the mount table each of bwrap's other binds reads. Instead
# they are made once bwrap has built the sandbox and before the command runs (the sandbox's
# first program waits for a byte: the gate of :func:`confined_shell`), in the sandbox's own
# mount namespace, by a child of a small helper process (:class:`_CoverMaker`) that enters
# it, with the kernel's mount API: a few calls per cover, no table read, and bubblewrap
# starts without a preexec_fn (the fast spawn path). The sandbox's user namespace is owned
# by this process's user, so the helper holds every capability there; the command holds
# none (bwrap drops the bounding set, no_new_privs) and seccomp refuses every mount call, so
# it can neither unmount a cover nor make it writable, even as uid 0 of its namespace.
_CLONE_NEWNS = 0x00020000
# System call numbers: one numbering on every architecture.
_NR_OPEN_TREE, _NR_MOVE_MOUNT, _NR_FSOPEN, _NR_FSCONFIG, _NR_FSMOUNT = 428, 429, 430, 431, 432
_NR_OPENAT2, _NR_MOUNT_SETATTR = 437, 442
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_EMPTY = 0x04 | 0x40           # MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH
_FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 1, 6
_MOUNT_RDONLY, _MOUNT_NOSUID, _MOUNT_NODEV, _MOUNT_NOEXEC = 0x1, 0x2, 0x4, 0x8
_RESOLVE_BENEATH_NO_LINKS = 0x02 | 0x04 | 0x08   # NO_MAGICLINKS | NO_SYMLINKS | BENEATH


@dataclasses.dataclass(frozen=True)
class Cover:
    """One path of the session's path policy covered inside the sandbox: ``rel`` (bytes,
    relative to the workspace root), ``hide`` (an empty mode-0000 read-only object over
    it: a tmpfs over a directory, the empty file over anything else) or not (protect: the
    object bound read-only over itself), ``is_dir``, and the identity (``dev``, ``ino``)
    the scan saw; a cover is made on that very object or the command does not start."""

    rel: bytes
    hide: bool
    is_dir: bool
    dev: int
    ino: int


@dataclasses.dataclass(frozen=True)
class CoverSet:
    """What :func:`start_shell` covers in the sandbox: the ``covers``, the root's identity
    (``root_dev``, ``root_ino``) as the scan saw it, and ``empty``: the path of an empty
    mode-0000 file of this process (bound into the sandbox at ``SANDBOX_EMPTY``, its clones
    cover hidden non-directories)."""

    covers: tuple[Cover, ...]
    root_dev: int
    root_ino: int
    empty: str


class _MountApi:
    """The kernel calls the cover maker makes, through ctypes: ``sys(nr, a1, ..., a5)`` is
    syscall(2) with six longs (a negative result sets errno), ``setns(fd, kind)``; the
    constant buffers (mount_attr, open_how, strings) are built once and kept here."""

    def __init__(self) -> None:
        import ctypes

        self.c = ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        self.setns = libc.setns
        long = ctypes.c_long
        self.sys = ctypes.CFUNCTYPE(long, long, long, long, long, long, long,
                                    use_errno=True)(("syscall", libc))

        class MountAttr(ctypes.Structure):
            _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                        ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

        class OpenHow(ctypes.Structure):
            _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                        ("resolve", ctypes.c_uint64)]

        self._keep: list[Any] = []
        self.hidden_attr = self._struct(MountAttr(_MOUNT_RDONLY | _MOUNT_NOSUID
                                                  | _MOUNT_NODEV | _MOUNT_NOEXEC, 0, 0, 0))
        self.protect_attr = self._struct(MountAttr(_MOUNT_RDONLY | _MOUNT_NOSUID
                                                   | _MOUNT_NODEV, 0, 0, 0))
        self.how = self._struct(OpenHow(os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, 0,
                                        _RESOLVE_BENEATH_NO_LINKS))
        self.empty_path = self.string(b"")
        self.tmpfs, self.mode, self.zero = (self.string(s) for s in (b"tmpfs", b"mode", b"0"))

    def _struct(self, obj: Any) -> tuple[int, int]:
        self._keep.append(obj)
        return self.c.addressof(obj), self.c.sizeof(obj)

    def string(self, data: bytes, keep: list[Any] | None = None) -> int:
        """The address of a NUL-terminated copy of ``data``, kept alive in ``keep`` (by
        default: as long as this object)."""
        buf = self.c.create_string_buffer(data)
        (self._keep if keep is None else keep).append(buf)
        return self.c.addressof(buf)

    def fail(self, name: str) -> OSError:
        e = self.c.get_errno()
        return OSError(e, f"{name}: {os.strerror(e)}")


@functools.lru_cache(maxsize=1)
def _mount_api() -> _MountApi:
    return _MountApi()


def _clone(api: _MountApi, fd: int, recursive: bool = False) -> int:
    """A detached clone of the mount at ``fd`` (open_tree OPEN_TREE_CLONE)."""
    m = api.sys(_NR_OPEN_TREE, fd, api.empty_path, _OPEN_TREE_CLONE | os.O_CLOEXEC
                | _AT_EMPTY_PATH | (_AT_RECURSIVE if recursive else 0), 0, 0)
    if m < 0:
        raise api.fail("open_tree")
    return m


def _set_attr(api: _MountApi, m: int, attr: tuple[int, int]) -> None:
    """``attr`` (address, size of a mount_attr) on the detached mount ``m`` and below it;
    ``m`` is closed if that fails."""
    if api.sys(_NR_MOUNT_SETATTR, m, api.empty_path, _AT_EMPTY_PATH | _AT_RECURSIVE,
               *attr) < 0:
        err = api.fail("mount_setattr")
        os.close(m)
        raise err


def _hidden_source(api: _MountApi, empty: int, detached: bool = True) -> tuple[int, bool]:
    """What hidden files are covered with: (a detached read-only clone of the empty file,
    True) where the kernel clones a detached mount (Linux 6.15) and ``detached``, so that
    each cover is one clone of it; else (``empty``, False): each cover clones the empty
    file's own mount and sets its attributes."""
    if not detached:
        return empty, False
    m = _clone(api, empty)
    _set_attr(api, m, api.hidden_attr)
    probe = api.sys(_NR_OPEN_TREE, m, api.empty_path, _OPEN_TREE_CLONE | os.O_CLOEXEC
                    | _AT_EMPTY_PATH, 0, 0)
    if probe < 0:
        os.close(m)
        return empty, False
    os.close(probe)
    return m, True


def _make_cover(api: _MountApi, top: int, hidden: tuple[int, bool], rel: int, hide: bool,
                is_dir: bool, dev: int, ino: int) -> None:
    """Mount one cover (a ``Cover``'s fields; its path at address ``rel``) over its object,
    found below ``top`` without following any link and checked to be the object the scan
    saw (OSError ESTALE otherwise). ``hidden``: from :func:`_hidden_source`."""
    sys_, e = api.sys, api.empty_path
    dst = sys_(_NR_OPENAT2, top, rel, *api.how, 0)
    if dst < 0:
        raise api.fail("openat2")
    try:
        st = os.fstat(dst)
        if st.st_ino != ino or st.st_dev != dev or stat.S_ISLNK(st.st_mode) \
                or stat.S_ISDIR(st.st_mode) != is_dir:
            raise OSError(errno.ESTALE, "a covered path changed while the command started")
        if hide and is_dir:
            fs = sys_(_NR_FSOPEN, api.tmpfs, 1, 0, 0, 0)   # FSOPEN_CLOEXEC
            if fs < 0:
                raise api.fail("fsopen")
            try:
                if sys_(_NR_FSCONFIG, fs, _FSCONFIG_SET_STRING, api.mode, api.zero, 0) < 0 \
                        or sys_(_NR_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, 0, 0, 0) < 0:
                    raise api.fail("fsconfig")
                m = sys_(_NR_FSMOUNT, fs, 1, _MOUNT_RDONLY | _MOUNT_NOSUID | _MOUNT_NODEV
                         | _MOUNT_NOEXEC, 0, 0)   # FSMOUNT_CLOEXEC
                if m < 0:
                    raise api.fail("fsmount")
            finally:
                os.close(fs)
        elif hide:
            m = _clone(api, hidden[0])
            if not hidden[1]:
                _set_attr(api, m, api.hidden_attr)
        else:
            # A directory's clone takes the mounts below it along; nothing is below a file,
            # and a recursive clone of one still walks every mount of the file system's
            # mount (each cover made so far: O(n^2) for n covers).
            m = _clone(api, dst, recursive=is_dir)
            _set_attr(api, m, api.protect_attr)
        try:
            if sys_(_NR_MOVE_MOUNT, m, e, dst, e, _MOVE_MOUNT_EMPTY) < 0:
                raise api.fail("move_mount")
        finally:
            os.close(m)
    finally:
        os.close(dst)


# In the sandbox: /dev/.rewindfs-hidden, the empty mode-0000 file hidden files are covered
# with (bound read-only from :func:`empty_file`; the helper finds it there, inside the
# sandbox's namespace, and clones it).
SANDBOX_EMPTY = "/dev/.rewindfs-hidden"
# Test hook: False makes every hidden file's cover clone the empty file's own mount (what
# kernels before 6.15 do) instead of one detached clone of it.
_CLONE_DETACHED = True
_NS_USER, _NS_MOUNT = 0x10000000, 0x00020000      # CLONE_NEWUSER, CLONE_NEWNS for setns


@functools.cache
def empty_file() -> str:
    """An empty mode-0000 file of this process (in a private 0700 directory, removed at
    exit): what hidden non-directories are covered with."""
    import tempfile

    d = tempfile.mkdtemp(prefix="rewindfs-hidden-")
    path = os.path.join(d, "empty")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
    os.chmod(path, 0)
    atexit.register(shutil.rmtree, d, True)
    return path


def cover_sandbox(api: _MountApi, user_fd: int, mnt_fd: int, root: bytes, root_id: tuple[int, int],
                  covers: Sequence[tuple[bytes, bool, bool, int, int]], detached: bool) -> None:
    """In this (single-threaded, forked) process: enter the sandbox's user namespace
    ``user_fd`` and mount namespace ``mnt_fd``, then make every cover (``Cover`` fields as a
    tuple) in turn with :func:`_make_cover`; each path is resolved beneath the workspace
    root (``root``, which must still be the object ``root_id`` = (st_dev, st_ino)) through
    the covers made before it, so one below a protected directory lands in the read-only
    view of it. Raises OSError (ESTALE: a path is another object than the scan saw); the
    caller then runs nothing."""
    for fd, kind in ((user_fd, _NS_USER), (mnt_fd, _NS_MOUNT)):
        if api.setns(fd, kind) != 0:
            raise api.fail("setns")
    top = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(top)
    if (st.st_dev, st.st_ino) != root_id:
        raise OSError(errno.ESTALE, "the workspace root changed")
    empty = os.open(SANDBOX_EMPTY, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    est = os.fstat(empty)
    if not stat.S_ISREG(est.st_mode) or est.st_size:
        raise OSError(errno.ESTALE, f"{SANDBOX_EMPTY} is not an empty file")
    hidden = _hidden_source(api, empty, detached)
    paths = api.c.create_string_buffer(b"\0".join(c[0] for c in covers) + b"\0")
    at = api.c.addressof(paths)
    for rel, hide, is_dir, dev, ino in covers:
        _make_cover(api, top, hidden, at, hide, is_dir, dev, ino)
        at += len(rel) + 1


# The helper, run as ``python -S -I -c COVER_MAKER FD``. Its first message on the unix
# socket FD is this module's source as the server read it when it imported it (the helper
# imports nothing from disk: the workspace may hold this very checkout, which a command may
# have changed since). It keeps one forked child waiting (so no fork lies between a
# request and its covers): the child reads one request (a length-prefixed marshal of the
# cover_sandbox arguments but the first three, which are the API and the two descriptors
# sent with it), calls cover_sandbox, answers (0, "") or (errno, message) and exits; then
# the next child is forked. The helper ends when the socket closes (its server ended) or a
# child dies without answering (the server then sees the socket close).
COVER_MAKER = r"""
import marshal, os, socket, struct, sys, types
sock = socket.socket(fileno=int(sys.argv[1]))
def read(n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            os._exit(1)
        data += chunk
    return data
source = read(struct.unpack("=I", read(4))[0])
sandbox = types.ModuleType("rewindfs_cover_maker")
sys.modules[sandbox.__name__] = sandbox
exec(compile(source, "tools/sandbox.py", "exec"), sandbox.__dict__)
api = sandbox._mount_api()
def serve():
    try:
        head, fds, _, _ = socket.recv_fds(sock, 4, 2)
    except OSError:
        os._exit(1)
    if len(head) < 4 or len(fds) != 2:
        os._exit(1)
    body = read(struct.unpack("=I", head)[0])
    try:
        sandbox.cover_sandbox(api, fds[0], fds[1], *marshal.loads(body))
        out = (0, "")
    except OSError as e:
        out = (e.errno or 5, str(e))
    except BaseException as e:
        out = (5, repr(e))
    data = marshal.dumps(out)
    sock.sendall(struct.pack("=I", len(data)) + data)
    os._exit(0)
while True:
    pid = os.fork()
    if pid == 0:
        serve()
    if os.waitpid(pid, 0)[1] != 0:
        break
"""
_OWN_SOURCE = b""
if "__file__" in globals():                 # not in the helper itself
    with open(__file__, "rb") as _f:
        _OWN_SOURCE = _f.read()


class _CoverMaker:
    """The helper process making covers in sandboxes (``COVER_MAKER``), started on first
    use and kept (and started again if it ended): forking this (large, threaded) server
    per call is slow, a fresh interpreter per call slower still. One request at a time
    (the caller holds ``_maker_lock``)."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-I", "-c", COVER_MAKER, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, start_new_session=True)
            mine.sendall(struct.pack("=I", len(_OWN_SOURCE)) + _OWN_SOURCE)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self.sock = mine
        self.broken = False

    def cover(self, user_fd: int, mnt_fd: int, root: str, cs: CoverSet) -> None:
        """Make ``cs`` in the sandbox whose namespaces are ``user_fd`` and ``mnt_fd``;
        OSError when it cannot (the helper's errno and message)."""
        body = marshal.dumps((os.fsencode(root), (cs.root_dev, cs.root_ino),
                              [(c.rel, c.hide, c.is_dir, c.dev, c.ino) for c in cs.covers],
                              _CLONE_DETACHED))
        try:
            socket.send_fds(self.sock, [struct.pack("=I", len(body)) + body],
                            [user_fd, mnt_fd])
            (size,) = struct.unpack("=I", self._read(4))
            code, text = marshal.loads(self._read(size))
        except (OSError, ValueError, EOFError) as e:
            self.broken = True
            raise OSError(errno.EIO, f"the sandbox's cover maker failed: {e}") from e
        if code:
            raise OSError(code, text)

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise EOFError("it ended")
            data += chunk
        return data

    def alive(self) -> bool:
        return not self.broken and self.proc.poll() is None

    def stop(self) -> None:
        """Close the socket (the helper then ends) and reap it; killed if it lingers."""
        self.sock.close()
        try:
            self.proc.wait(0 if self.broken else 5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_maker_lock = threading.Lock()
_maker: list[_CoverMaker] = []


def _make_covers(pid: int, root: str, cs: CoverSet) -> None:
    """The covers ``cs`` made in the mount namespace of the sandbox whose first process is
    ``pid`` (by the helper, :class:`_CoverMaker`). Raises OSError when one cannot be made."""
    mnt_fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        user_fd = fcntl.ioctl(mnt_fd, NS_GET_USERNS)
        try:
            with _maker_lock:
                if not _maker or not _maker[0].alive():
                    if _maker:
                        _maker.pop().stop()
                    _maker.append(_CoverMaker())
                maker = _maker[0]
                try:
                    maker.cover(user_fd, mnt_fd, root, cs)
                finally:
                    if maker.broken:
                        _maker.clear()
                        maker.stop()
        finally:
            os.close(user_fd)
    finally:
        os.close(mnt_fd)


@atexit.register
def _stop_maker() -> None:
    with _maker_lock:
        while _maker:
            _maker.pop().stop()


def _forget_maker() -> None:
    # A forked child must not talk to its parent's helper.
    for m in _maker:
        with contextlib.suppress(OSError):
            m.sock.close()
    _maker.clear()


os.register_at_fork(after_in_child=_forget_maker)


def covers_in_sandbox() -> bool:
    """Whether the path policy's covers are made in the sandbox here (:func:`cover_sandbox`)
    rather than by bwrap arguments: where :func:`in_sandbox_covers_work`, unless
    ``REWINDFS_BWRAP_COVERS=1`` asks for bwrap's own binds (for tests of that path)."""
    if os.environ.get("REWINDFS_BWRAP_COVERS") == "1" or unavailable_reason() is not None:
        return False
    bw = shutil.which("bwrap")
    return bw is not None and in_sandbox_covers_work(bw)


@functools.lru_cache(maxsize=4)
def in_sandbox_covers_work(bw: str) -> bool:
    """Whether covers can be made in the sandbox here (:func:`cover_sandbox`): the mount API
    (Linux 5.12) and entering a sandbox's namespaces. Probed once per bwrap path with a
    real cover of each kind in a scratch directory."""
    import tempfile

    del bw                                   # start_shell finds the same one
    with tempfile.TemporaryDirectory(prefix="rewindfs-cover-probe-") as d:
        for name in ("dir", "file"):
            p = os.path.join(d, name)
            os.mkdir(p) if name == "dir" else open(p, "w").close()
        ids = {n: os.lstat(os.path.join(d, n)) for n in ("dir", "file")}
        st = os.stat(d)
        cs = CoverSet((Cover(b"dir", True, True, ids["dir"].st_dev, ids["dir"].st_ino),
                       Cover(b"file", False, False, ids["file"].st_dev, ids["file"].st_ino)),
                      st.st_dev, st.st_ino, empty_file())
        try:
            run = start_shell(SandboxPolicy(), d, d, [],
                              f'! ls {d}/dir/ 2>/dev/null && ! (: > {d}/file) 2>/dev/null',
                              covers=cs, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        except (OSError, SandboxUnavailable):
            return False
        try:
            code = run.proc.wait(_PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait()
            code = -1
        finally:
            run.close()
    return code == 0


# -- availability --------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """None when Bash commands can be sandboxed here; else why not (one sentence)."""
    if os.environ.get("REWINDFS_NO_SANDBOX") == "1":
        return "the sandbox is disabled by REWINDFS_NO_SANDBOX=1"
    bw = shutil.which("bwrap")
    if bw is None:
        return "bubblewrap (bwrap) is not installed"
    if shutil.which("prlimit") is None:
        return "prlimit (util-linux) is not installed"
    return _probe_sandbox(bw)


TUN = "/dev/net/tun"
NS_GET_USERNS = 0xB701   # ioctl on a namespace: a descriptor of the user namespace owning it


def network_unavailable_reason() -> str | None:
    """None when slirp4netns can give a sandbox of this user a network here; else why not
    (one sentence). slirp4netns makes its tap device through /dev/net/tun as this user:
    the device must open read-write for it (Debian's mode is 0666; some containers keep
    it 0600 to root)."""
    if shutil.which("slirp4netns") is None:
        return "slirp4netns is not installed"
    try:
        os.close(os.open(TUN, os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        return f"{TUN} does not exist (the tun module is not loaded)"
    except OSError as e:
        try:
            st = os.stat(TUN)
            mode = f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"
        except OSError:
            mode = "its mode unknown"
        return (f"this user (uid {os.getuid()}) cannot open {TUN} ({os.strerror(e.errno or 0)}; "
                f"{mode}), which slirp4netns needs")
    return None


@functools.lru_cache(maxsize=4)
def _probe_sandbox(bw: str) -> str | None:
    try:
        program = seccomp_program()
    except (ImportError, OSError, RuntimeError) as e:
        return f"the seccomp filter cannot be built (libseccomp through pyseccomp): {e}"
    fd = _data_fd(program, "rewindfs-seccomp")
    argv = [bw, *_namespaces(), *_system_view(), "--dev", "/dev", "--proc", "/proc",
            "--seccomp", str(fd), "--", "true"]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, timeout=_PROBE_TIMEOUT_S, pass_fds=(fd,))
    except (OSError, subprocess.SubprocessError) as e:
        return f"bubblewrap cannot start here: {e}"
    finally:
        os.close(fd)
    if r.returncode != 0:
        why = r.stderr.decode("utf-8", "replace").strip() or f"exit status {r.returncode}"
        return ("bubblewrap cannot create the sandbox's user, pid and network namespaces "
                f"here (are user namespaces disabled?): {why}")
    return None


def bwrap() -> str | None:
    """Path of a usable ``bwrap`` for the read-only helper (ripgrep), or None (missing,
    disabled, or failing here)."""
    if os.environ.get("REWINDFS_NO_SANDBOX") == "1":
        return None
    path = shutil.which("bwrap")
    if path is None:
        return None
    return path if _probe(path) else None


@functools.lru_cache(maxsize=4)
def _probe(path: str) -> bool:
    """Whether bubblewrap can bind-mount a read-only view here (what the reader needs)."""
    argv = [path, *_system_view(), "--die-with-parent", "--", "true"]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


# -- the view ------------------------------------------------------------------------------

# Host secrets under /etc a command must not read (root owns them, and the sandbox's uid
# is root's when the server runs as root).
_ETC_SECRETS = ("shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d",
                "security/opasswd", "ssh/ssh_host_*_key")
# /proc entries that reach the whole kernel and that the kernel guards by root's uid only
# (which the sandbox may hold), not by a capability: kept read-only (sysctls, the SysRq
# trigger, ACPI wakeup) or masked (they list the host's timers with their processes, every
# task's scheduling, and key quotas). bwrap itself keeps /proc/irq and /proc/bus read-only.
_PROC_READ_ONLY = ("sys", "sysrq-trigger", "acpi")
_PROC_MASKED = ("timer_list", "sched_debug", "keys", "key-users")


def _namespaces() -> list[str]:
    return ["--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-net", "--unshare-cgroup-try", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--die-with-parent", "--new-session"]


def _mask(path: str) -> list[str]:
    """bwrap arguments hiding ``path`` (an empty tmpfs over a directory, /dev/null over
    anything else); nothing when it does not exist or is a symbolic link."""
    try:
        st = os.lstat(path)
    except OSError:
        return []
    if stat.S_ISLNK(st.st_mode):
        return []
    if stat.S_ISDIR(st.st_mode):
        return ["--tmpfs", path]
    return ["--ro-bind", "/dev/null", path]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def _etc_view() -> list[str]:
    argv = ["--ro-bind", "/etc", "/etc"]
    for pattern in _ETC_SECRETS:
        for p in sorted(glob.glob(os.path.join("/etc", pattern))):
            argv += _mask(p)
    return argv


def _proc_view() -> list[str]:
    argv = ["--proc", "/proc"]
    for name in _PROC_READ_ONLY:
        if os.path.exists(f"/proc/{name}"):
            argv += ["--ro-bind", f"/proc/{name}", f"/proc/{name}"]
    for name in _PROC_MASKED:
        argv += _mask(f"/proc/{name}")
    return argv


def confined_shell(bwrap_path: str, root: str, cwd: str, hidden: Sequence[str],
                   command: str, policy: SandboxPolicy = SandboxPolicy(),
                   seccomp_fd: int | None = None, info_fd: int | None = None,
                   block_fd: int | None = None, gate_fds: tuple[int, int] | None = None,
                   resolv_fd: int | None = None, view: Sequence[str] = (),
                   hidden_source: str | None = None) -> list[str]:
    """argv running ``bash -c command`` in the sandbox described in the module docstring.

    ``root``, ``cwd`` and ``hidden`` are canonical absolute paths; ``hidden`` paths inside
    the view (under the root) are masked. ``seccomp_fd``: a descriptor of
    :func:`seccomp_program` (passed to the child). ``info_fd``: bwrap writes its child's pid
    there as JSON; ``block_fd``: bwrap waits for a byte there before it sets up the view
    and runs anything (to move the child into a cgroup first). ``gate_fds``: (ready write
    end, go read end): once the sandbox is set up, a byte is written to the first, and the
    command runs after a byte arrived on the second (meanwhile the path policy's covers are
    made and its network is configured: bwrap's own loopback setup and slirp4netns's must
    not overlap); nothing runs when the second closes first. ``resolv_fd``: contents
    for /etc/resolv.conf. ``view``: further bwrap arguments applied after the root and its
    masks (the session's path policy, see tools.policyview). ``hidden_source``: a file
    bound read-only at ``SANDBOX_EMPTY`` (the source of hidden files' covers)."""
    argv = [bwrap_path, *_namespaces(), *_system_view(), *_etc_view()]
    if resolv_fd is not None and os.path.isfile("/etc/resolv.conf") \
            and not os.path.islink("/etc/resolv.conf"):
        argv += ["--ro-bind-data", str(resolv_fd), "/etc/resolv.conf"]
    # /dev's own tmpfs is read-only and /dev/shm and /tmp are sized: each would otherwise
    # hold up to half of the host's memory, which no limit of a process counts.
    tmp_size = str(policy.max_tmp_bytes)
    argv += ["--dev", "/dev"]
    if hidden_source is not None:
        argv += ["--ro-bind", hidden_source, SANDBOX_EMPTY]
    argv += ["--size", tmp_size, "--tmpfs", "/dev/shm",
             "--remount-ro", "/dev", *_proc_view(), "--size", tmp_size, "--tmpfs", "/tmp",
             "--bind", root, root]
    for h in hidden:
        if _under(h, root) and h != root:
            argv += _mask(h)
    argv += view
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    if block_fd is not None:
        argv += ["--block-fd", str(block_fd)]
    # A gated command starts in the root and changes to ``cwd`` only once the gate opens:
    # covers made meanwhile sit on dentries, and a process already inside a covered
    # directory (bwrap's init keeps the directory it starts in; /proc/1/cwd) would work
    # beneath the cover.
    argv += ["--chdir", cwd if gate_fds is None else root, "--", "prlimit",
             f"--nproc={policy.max_processes}",
             f"--as={policy.max_memory_bytes}", f"--fsize={policy.max_file_bytes}",
             "--", "bash", "-c"]
    if gate_fds is None:
        return argv + [command]
    return argv + [_GATE, "bash", str(gate_fds[0]), str(gate_fds[1]), command, cwd]


# Runs in the sandbox before a gated command: says it is set up, waits until its covers are
# made and its network is configured, closes both descriptors, changes to the command's
# directory (resolved now, through the covers) and runs the command.
_GATE = ('printf 1 >&"$1" && eval "exec $1>&-" && read -r -n 1 _ <&"$2" '
         '&& eval "exec $2<&-" && cd -P -- "$4" && exec bash -c "$3"')


def _system_view() -> list[str]:
    """bwrap arguments giving a sandbox the system's programs and libraries and nothing
    else: /usr read-only, and /bin, /lib, /lib64, /sbin as on the host."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    return argv


def confined_reader(bwrap_path: str, root: str, cwd: str, argv: Sequence[str]) -> list[str]:
    """argv running a read-only program (ripgrep) that sees only ``root`` (read-only) and
    the system's programs and libraries, so no symbolic link, even one swapped in while it
    runs, can lead it to a file outside the workspace."""
    # No PID namespace or new session: the reader never forks, its caller starts it in a
    # new session without a terminal, and --die-with-parent ends it with bubblewrap. Each
    # of those options costs milliseconds per search.
    return [bwrap_path, *_system_view(), "--ro-bind", root, root, "--die-with-parent",
            "--chdir", cwd, "--", *argv]


# -- process limits: a pids cgroup -----------------------------------------------------------


@functools.lru_cache(maxsize=1)
def pids_cgroup_parent() -> str | None:
    """A cgroup directory of the pids controller (v1, or v2 with pids delegated to the
    children of this process's cgroup) under which this process may make child cgroups
    (one per concurrent command), or None. RLIMIT_NPROC counts processes per uid, and the sandbox's uid is
    the server's: as root the kernel does not enforce it at all, so the cgroup is what
    bounds a fork bomb there."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    candidates = []
    for m in mounts:
        sep = m.index("-")
        fstype, opts, mroot, point = m[sep + 1], m[sep + 3], m[3], m[4]
        if fstype == "cgroup" and "pids" in opts.split(","):
            path = next((p for _, ctl, p in own if "pids" in ctl.split(",")), None)
        elif fstype == "cgroup2":
            path = next((p for hid, ctl, p in own if hid == "0" and ctl == ""), None)
        else:
            continue
        if path is None or not _under(path, mroot):
            continue
        d = os.path.join(point, os.path.relpath(path, mroot))
        if fstype == "cgroup2":
            try:
                with open(os.path.join(d, "cgroup.subtree_control")) as f:
                    if "pids" not in f.read().split():
                        continue
            except OSError:
                continue
        candidates.append(os.path.normpath(d))
    for d in candidates:
        probe = os.path.join(d, f"rewindfs-probe-{uuid.uuid4().hex}")
        try:
            os.mkdir(probe)
            os.rmdir(probe)
        except OSError:
            continue
        return d
    return None


def _cgroup_name() -> str:
    return f"rewindfs-bash-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _sweep(parent: str) -> None:
    """Remove the empty cgroups of servers that are gone (killed before they could)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if not name.startswith("rewindfs-bash-") or len(parts) != 4 or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue                          # its server is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(parent, name))


def _kill_members(path: str, keep: int | None = None, bound_s: float = _CGROUP_RMDIR_S
                  ) -> bool:
    """SIGKILL every task of cgroup ``path`` but ``keep``, again until none is left; False
    if some were still listed after ``bound_s`` seconds (0: one pass, no wait)."""
    listing = os.path.join(path, "tasks" if keep is not None else "cgroup.procs")
    deadline = time.monotonic() + bound_s
    while True:
        try:
            with open(listing) as f:
                left = [int(x) for x in f.read().split() if int(x) != keep]
        except OSError:
            return True
        if not left:
            return True
        for p in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


class _PidsCgroup:
    """One command's pids cgroup (where a process's threads cannot be in different cgroups,
    as in cgroup v2): made with ``pids.max`` set, joined by the sandbox's first process
    before it runs anything (a migration costs about one RCU grace period), emptied and
    removed by :meth:`remove`."""

    def __init__(self, parent: str, max_pids: int) -> None:
        self.path = os.path.join(parent, _cgroup_name())
        os.mkdir(self.path)
        try:
            with open(os.path.join(self.path, "pids.max"), "w") as f:
                f.write(str(max_pids))
        except OSError:
            os.rmdir(self.path)
            raise

    def join(self, pid: int) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(pid))

    def remove(self) -> None:
        _kill_members(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


class _Spawner:
    """A thread of this process that sits alone in a pids cgroup (v1 hierarchies, where
    threads may be in different cgroups) and starts commands: what it starts is born in
    that cgroup, so a command costs no cgroup migration. One command at a time uses it
    (see :func:`_acquire`); ``pids.max`` counts the thread itself too."""

    def __init__(self, parent: str) -> None:
        self.parent = parent
        self.path = os.path.join(parent, _cgroup_name())
        os.mkdir(self.path)
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ready = threading.Event()
        self._error: OSError | None = None
        self.tid = 0
        self._thread = threading.Thread(target=self._loop, name="rewindfs-sandbox-spawner",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            raise self._error

    def _loop(self) -> None:
        self.tid = threading.get_native_id()
        try:
            with open(os.path.join(self.path, "tasks"), "w") as f:
                f.write(str(self.tid))
        except OSError as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        while True:
            job = self._jobs.get()
            if job is None:                   # leave the cgroup, so that it can go
                with contextlib.suppress(OSError):
                    with open(os.path.join(self.parent, "tasks"), "w") as f:
                        f.write(str(self.tid))
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:  # handed to the caller
                box.append((False, e))
            done.set()

    def call(self, fn: Any) -> Any:
        """``fn()`` run on the spawner's thread; its result, or its exception raised."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, box, done))
        done.wait()
        ok, value = box[0]
        if ok:
            return value
        raise value

    def limit(self, max_pids: int) -> None:
        with open(os.path.join(self.path, "pids.max"), "w") as f:
            f.write(str(max_pids + 1))

    def sweep(self) -> None:
        """Kill anything of the last command still listed in the cgroup (its processes die
        with the sandbox's pid namespace; the listing may lag behind), without waiting."""
        _kill_members(self.path, keep=self.tid, bound_s=0)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(5)
        # The last command's tasks may still be listed (the listing lags the sandbox's
        # pid namespace teardown): wait, bounded, for them to go, as remove() does, so a
        # server that exits leaves no cgroup behind. By thread id, keeping the spawner's
        # own: a process listing would name this very process while that thread lingers.
        _kill_members(self.path, keep=self.tid)
        with contextlib.suppress(OSError):
            os.rmdir(self.path)


_spawn_lock = threading.Lock()
_idle: list[_Spawner] = []
_spawners: list[_Spawner] = []


def _acquire(parent: str) -> _Spawner:
    with _spawn_lock:
        if _idle:
            return _idle.pop()
        if not _spawners:
            _sweep(parent)
    s = _Spawner(parent)
    with _spawn_lock:
        _spawners.append(s)
    return s


def _release(s: _Spawner) -> None:
    s.sweep()
    with _spawn_lock:
        _idle.append(s)


@atexit.register
def _stop_spawners() -> None:
    with _spawn_lock:
        todo = list(_spawners)
        _spawners.clear()
        _idle.clear()
    for s in todo:
        s.stop()


def _forget_spawners() -> None:
    # A forked child has none of the parent's threads.
    _spawners.clear()
    _idle.clear()


os.register_at_fork(after_in_child=_forget_spawners)


def _threads_may_differ(parent: str) -> bool:
    """cgroup v1 (a ``tasks`` file): threads of one process may be in different cgroups."""
    return os.path.exists(os.path.join(parent, "tasks"))


# -- starting a command ------------------------------------------------------------------------


class ShellRun:
    """A started Bash command. ``proc``: the Popen of bwrap (or of the subreaper helper);
    ``confined``: whether it runs in the sandbox. Call :meth:`close` once it has ended (or
    was killed): it stops the user-mode network and removes the pids cgroup."""

    def __init__(self, proc: subprocess.Popen[bytes], confined: bool) -> None:
        self.proc = proc
        self.confined = confined
        self._cleanups: list[Any] = []
        # The caller's registration of the sandbox with the session's guard
        # (tools.binding.SandboxRegistration), ended by :meth:`stopped` or :meth:`close`.
        self.guard: Any = None
        self._stopped: str | None = None

    def stopped(self) -> str | None:
        """Once the command has ended: the covered path whose removal or replacement
        outside the sandbox made the session stop it (the guard's answer), else None."""
        guard, self.guard = self.guard, None
        if guard is not None:
            try:
                self._stopped = guard.end()
            except OSError:
                guard.close()
        return self._stopped

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stopped()
        while self._cleanups:
            with contextlib.suppress(Exception):
                self._cleanups.pop()()


def _read_child_pid(fd: int) -> int:
    """The sandbox's first process, from bwrap's ``--info-fd`` JSON."""
    data = b""
    deadline = time.monotonic() + _SYNC_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise OSError(errno.ETIMEDOUT, "bubblewrap did not report its child")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise OSError(errno.EIO, "bubblewrap ended before it started the command")
        data += chunk
        try:
            return int(json.loads(data)["child-pid"])
        except ValueError:
            continue


def _wait_byte(fd: int, what: str) -> None:
    """Wait (bounded) for one byte on ``fd``; OSError saying ``what`` otherwise."""
    if not select.select([fd], [], [], _SYNC_TIMEOUT_S)[0] or not os.read(fd, 1):
        raise OSError(errno.EIO, what)


def _start_network(pid: int, policy: SandboxPolicy) -> subprocess.Popen[bytes]:
    """slirp4netns giving the network namespace of ``pid`` a tap device with outbound
    access in user mode; returns once it is configured."""
    slirp = shutil.which("slirp4netns")
    if slirp is None:
        raise NetworkUnavailable("slirp4netns is not installed")
    # slirp4netns joins the user namespace that owns the sandbox's network namespace. That
    # is not always the command's own: bubblewrap run by a user other than root makes the
    # namespaces in one user namespace and then the command's, nested in it, where that
    # network namespace cannot be entered (setns: EPERM).
    net_fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        userns_fd = fcntl.ioctl(net_fd, NS_GET_USERNS)
    finally:
        os.close(net_fd)
    ready_r, ready_w = os.pipe()
    argv = [slirp, "--configure", "--mtu=65520", f"--ready-fd={ready_w}",
            f"--userns-path=/proc/self/fd/{userns_fd}"]
    if not policy.host_loopback:
        argv.append("--disable-host-loopback")
    argv += [str(pid), "tap0"]
    try:
        net = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, pass_fds=(ready_w, userns_fd),
                               start_new_session=True)
    finally:
        os.close(ready_w)
        os.close(userns_fd)
    try:
        ok = select.select([ready_r], [], [], _SYNC_TIMEOUT_S)[0] and os.read(ready_r, 1)
    finally:
        os.close(ready_r)
    if not ok:
        net.kill()
        _, err = net.communicate()
        raise OSError(errno.EIO, "slirp4netns failed: "
                      + (err.decode("utf-8", "replace").strip() or "no answer"))
    assert net.stderr is not None
    net.stderr.close()
    return net


def _stop_network(net: subprocess.Popen[bytes]) -> None:
    net.terminate()
    try:
        net.wait(2)
    except subprocess.TimeoutExpired:
        net.kill()
        net.wait()


def start_shell(policy: SandboxPolicy, root: str, cwd: str, hidden: Sequence[str],
                command: str, pass_fds: Sequence[int] = (), view: Sequence[str] = (),
                covers: CoverSet | Callable[[], CoverSet | None] | None = None,
                on_start: Callable[[int], object] | None = None,
                **popen_kw: Any) -> ShellRun:
    """Start ``bash -c command`` in the sandbox (module docstring) with working directory
    ``cwd``; ``pass_fds``: the caller's descriptors the command inherits (the caller keeps
    and closes them); ``popen_kw`` go to subprocess.Popen (stdio, start_new_session). Where
    no sandbox can be built, runs it unconfined under the subreaper helper if
    ``policy.unsafe_no_sandbox``, else raises SandboxUnavailable naming the cause. Raises
    OSError when the command cannot be started. ``view``: further bwrap arguments
    (:func:`confined_shell`; descriptors they name go in ``pass_fds``). ``covers``: the
    path policy's covers, made in the sandbox once bwrap has built it and before the
    command runs (:func:`cover_sandbox`; only where :func:`covers_in_sandbox`), or a
    function returning them, called once bwrap is started (so that the caller's scan runs
    while bwrap builds the sandbox); a cover that cannot be made (its object changed since
    the scan) is an OSError and nothing runs. ``on_start(pid)``: called with the pid of the
    sandbox's first process (its pid namespace's init) once bwrap reported it (after
    ``covers()``), before the covers are made and before the command runs (it waits for
    it); when it raises, the sandbox is killed and the error raised (not called when
    unconfined)."""
    reason = unavailable_reason()
    if reason is not None:
        if not policy.unsafe_no_sandbox:
            raise SandboxUnavailable(reason)
        proc = subprocess.Popen(reaped_shell(command), cwd=cwd,
                                env=sandbox_env(policy, confined=False),
                                pass_fds=tuple(pass_fds), **popen_kw)
        return ShellRun(proc, confined=False)
    if policy.network:
        why = network_unavailable_reason()
        if why is not None:
            raise NetworkUnavailable(why)
    bw = shutil.which("bwrap")
    assert bw is not None
    cg_parent = pids_cgroup_parent()
    spawner: _Spawner | None = None
    cgroup: _PidsCgroup | None = None
    if cg_parent is not None and _threads_may_differ(cg_parent):
        with contextlib.suppress(OSError):    # else the command's first process is moved
            spawner = _acquire(cg_parent)
            cg_parent = None
    child_fds: list[int] = []
    own: dict[str, int] = {}

    def pipe(name: str) -> int:
        """A pipe whose read end we keep as ``name``; returns the write end for the child
        (names ending in _w: the other way round)."""
        r, w = os.pipe()
        mine, theirs = (w, r) if name.endswith("_w") else (r, w)
        own[name] = mine
        child_fds.append(theirs)
        return theirs

    # The command waits at the gate while covers are made and its network is configured;
    # without one, bwrap waits (block fd) until the cgroup is joined and on_start ran.
    gated = policy.network or covers is not None
    try:
        if spawner is not None:
            # bwrap and the sandbox's init besides the command's own processes
            spawner.limit(policy.max_processes + 2)
        seccomp_fd = _data_fd(seccomp_program(), "rewindfs-seccomp")
        child_fds.append(seccomp_fd)
        waits = cg_parent is not None or (on_start is not None and not gated)
        info_fd = pipe("info") if waits or gated else None
        block_fd = pipe("block_w") if waits else None
        gate_fds = (pipe("ready"), pipe("go_w")) if gated else None
        resolv_fd = None
        if policy.network:
            resolv_fd = _data_fd(f"nameserver {SLIRP_DNS}\n".encode(), "rewindfs-resolv")
            child_fds.append(resolv_fd)
        if cg_parent is not None:
            cgroup = _PidsCgroup(cg_parent, policy.max_processes)
        source = None
        if covers is not None:
            source = covers.empty if isinstance(covers, CoverSet) else empty_file()
        argv = confined_shell(bw, root, cwd, hidden, command, policy, seccomp_fd, info_fd,
                              block_fd, gate_fds, resolv_fd, view, source)
        env = sandbox_env(policy)

        def popen() -> subprocess.Popen[bytes]:
            return subprocess.Popen(argv, cwd=root, env=env,
                                    pass_fds=tuple(child_fds) + tuple(pass_fds), **popen_kw)

        proc = spawner.call(popen) if spawner is not None else popen()
    except BaseException:
        if cgroup is not None:
            cgroup.remove()
        if spawner is not None:
            _release(spawner)
        for fd in own.values():
            os.close(fd)
        raise
    finally:
        for fd in child_fds:
            os.close(fd)
    run = ShellRun(proc, confined=True)
    if cgroup is not None:
        run._cleanups.append(cgroup.remove)
    if spawner is not None:
        sp = spawner
        run._cleanups.append(lambda: _release(sp))
    if not own:
        return run
    try:
        pid = _read_child_pid(own["info"])
        if cgroup is not None:
            cgroup.join(pid)
        if on_start is not None and not gated:
            on_start(pid)
        if waits:
            os.write(own["block_w"], b"1")
        if gated:
            cs = covers() if callable(covers) else covers
            if on_start is not None:
                on_start(pid)
            _wait_byte(own["ready"], "the sandbox did not start")
            if cs is not None and cs.covers:
                try:
                    _make_covers(pid, root, cs)
                except OSError as e:
                    raise OSError(e.errno or errno.ESTALE, "the session's path policy could "
                                  "not be applied in the sandbox (a covered path changed "
                                  f"while the command started: {e.strerror or e}); nothing "
                                  "ran") from e
            if policy.network:
                net = _start_network(pid, policy)
                run._cleanups.append(lambda: _stop_network(net))
            os.write(own["go_w"], b"1")
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.kill()
        proc.wait()
        said = b""
        if proc.stdout is not None:
            with contextlib.suppress(OSError):
                os.set_blocking(proc.stdout.fileno(), False)
                said = proc.stdout.read(4096) or b""
        run.close()
        if isinstance(e, OSError) and said:
            raise OSError(e.errno, f"{e.strerror or e}: "
                          + said.decode("utf-8", "replace").strip()) from e
        raise
    finally:
        for fd in own.values():
            os.close(fd)
    return run


# The subreaper helper, run as ``python -S -I -c REAPER argv...``. It becomes a child
# subreaper (orphans of its descendants are re-parented to it), asks for SIGTERM when its
# parent dies, runs argv, and when argv exits or SIGTERM arrives kills every descendant,
# repeating until none is left (a killed process's children come back to it as orphans).
REAPER = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)
libc.prctl(1, signal.SIGTERM, 0, 0, 0)
me = os.getpid()
def kids():
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[1]) == me:
            out.append(int(name))
    return out
def kill_all():
    while True:
        pids = kids()
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in pids:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
def stop(signum, frame):
    kill_all()
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execvp(sys.argv[1], sys.argv[1:])
while True:
    try:
        _, status = os.waitpid(child, 0)
        break
    except ChildProcessError:
        status = 0
        break
kill_all()
sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


def reaped_shell(command: str) -> list[str]:
    """argv running ``bash -c command`` under the subreaper helper (no confinement)."""
    return [sys.executable, "-S", "-I", "-c", REAPER, "bash", "-c", command]
