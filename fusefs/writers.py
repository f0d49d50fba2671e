"""Files open for writing on a mount, found without file handles: a scan of /proc.

In no-open mode (README: "No-open mode") open(2) never reaches the daemon, so it cannot
count writable handles. ``scan`` finds the same facts from the kernel's side, as lsof(8)
does. It sends no request to the file system it looks for (nothing on it is opened, read
or looked up; the one call that reaches a file of it, statx in step 3, is answered from the
kernel's inode), so any thread may call it, also while the serving loop waits for it
(PYFUSE3.md trap 10):

1. every process's descriptor table is read (``/proc/<pid>/fd``), whatever its mount
   namespace, since a descriptor passed over a unix socket keeps the mount it was opened
   through. A thread with a table of its own (``unshare(CLONE_FILES)``) has it read too
   (``/proc/<pid>/task/<tid>/fd``): a process with more than one thread has each thread's
   table compared with its leader's by kcmp(2) ``KCMP_FILES``, one system call per
   thread, and only the tables that differ (and differ from each other) are read; where
   kcmp is refused (ENOSYS, or EPERM under a seccomp filter) or its number is not known
   here (32-bit processes, other architectures) every thread's table is read;
2. a link naming a path (not a pipe, socket or anonymous inode) has its lstat looked at:
   its mode has ``S_IWUSR`` when the descriptor was opened for writing
   (``tid_fd_update_inode`` in fs/proc/fd.c); a writable one has its
   ``/proc/<pid>/fdinfo/<n>`` read for ``mnt_id`` and ``ino`` (the inode number; Linux
   5.14 or later);
3. the mount id is matched against the ``mountinfo`` of each distinct mount namespace met
   (``/proc/<pid>/ns/mnt``; mount ids are unique across namespaces): a mount of the device
   (``major:minor``) counts, any other mount listed there does not. A mount that no
   ``mountinfo`` read lists (one of a namespace since gone, whose descriptor was passed on,
   of a namespace no process shows, outside a chrooted process's root, or the kernel's
   own, as memfd's) is told by the device of the file itself: statx(2) of the
   ``/proc/<pid>/fd/<n>`` link with ``AT_STATX_DONT_SYNC`` and an empty mask. Following
   that link jumps to the open file's path with no lookup (``nd_jump_link``; FUSE has no
   ``d_weak_revalidate``), and FUSE answers such a statx from the kernel's inode without
   a request (``fuse_update_get_attr`` in fs/fuse/dir.c); the inode number it gives must
   be the one ``fdinfo`` gave. Without statx in the C library (glibc before 2.28) such a
   descriptor is not seen.

Processes the scan may not inspect (other users' when the daemon is not root; as root,
those holding capabilities this process lacks when it lacks CAP_SYS_PTRACE, as in a
container: EACCES, EPERM) are counted in ``Scan.unseen``, never an error, except those that
can hold no descriptor and no mapping (``_holds_nothing``): a kernel thread, a zombie
without live threads, a process gone by the time it was refused. A process, thread or
descriptor that goes away during the scan (ESRCH, ENOENT) is skipped. Pids are those of this process's pid namespace
(a sandboxed command shows under its host pid). Not seen: this process itself (``skip``),
a file written only through a shared writable mapping after its descriptor was closed, a
descriptor held only in a unix socket's queue (sent with SCM_RIGHTS and not yet received:
/proc shows no such reference), one held by the kernel alone (an io_uring's registered
files, a loop device's backing file), and a descriptor opened after the scan read its table.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import os
import platform
import stat
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

_REFUSED = (errno.EACCES, errno.EPERM)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
# kcmp(2) has no libc wrapper: its number on the 64-bit architectures (asm/unistd.h);
# elsewhere it is not called, and every thread's table is read.
_SYS_KCMP = {"x86_64": 312, "aarch64": 272, "riscv64": 272, "loongarch64": 272,
             "ppc64le": 354, "ppc64": 354, "s390x": 343,
             }.get(platform.machine()) if sys.maxsize > 2**32 else None
_KCMP_FILES = 2
_AT_FDCWD = -100
_AT_STATX_DONT_SYNC = 0x4000
_STATX_SIZE = 256  # struct statx: stx_ino at byte 32, stx_dev_major/minor at 136 and 140
_statx = getattr(_libc, "statx", None)  # glibc 2.28 or later
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                       ctypes.c_void_p]


@dataclass
class Scan:
    """What one scan found: ``inodes`` maps the inode number of each file of the device
    open for writing to the pids holding it so; ``processes`` counts the processes whose
    descriptors were read, ``unseen`` those /proc refused to show; ``tables`` the
    descriptor tables read (one per process, plus one per thread with a table of its own,
    or per thread where kcmp is refused)."""

    inodes: dict[int, set[int]] = field(default_factory=dict)
    processes: int = 0
    unseen: int = 0
    tables: int = 0


_PF_KTHREAD = 0x00200000  # the flags field of /proc/<pid>/stat (include/linux/sched.h)


def _holds_nothing(pid: int) -> bool:
    """Whether process ``pid``, which refused to be inspected, can hold no descriptor and
    no mapping: it is gone, a kernel thread, or a zombie (or dead) with no thread left.
    Read from ``/proc/<pid>/stat`` (state, flags) and ``/proc/<pid>/task``, which any
    process may read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        if int(fields[6]) & _PF_KTHREAD:
            return True
        return fields[0] in (b"Z", b"X") and os.stat(f"/proc/{pid}/task").st_nlink <= 3
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False


def _fdinfo(name: str, dir_fd: int) -> tuple[int, int] | None:
    """(mount id, inode number) from the ``fdinfo`` file ``name`` of the directory open as
    ``dir_fd``, None without them."""
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        text = os.read(fd, 4096)
    finally:
        os.close(fd)
    mnt = text.find(b"\nmnt_id:")
    ino = text.find(b"\nino:")
    if mnt < 0 or ino < 0:
        return None
    return (int(text[mnt + 8:text.index(b"\n", mnt + 1)]),
            int(text[ino + 5:text.index(b"\n", ino + 1)]))


def _file_id(link: str) -> tuple[str, int] | None:
    """(``major:minor``, inode number) of the file a ``/proc/<pid>/fd/<n>`` link names, by
    statx(2) with ``AT_STATX_DONT_SYNC`` and no field asked for: the kernel answers from
    its inode (FUSE sends no request); None if the link is gone or statx is missing."""
    if _statx is None:
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if _statx(_AT_FDCWD, os.fsencode(link), _AT_STATX_DONT_SYNC, 0, buf) != 0:
        return None
    ino, = struct.unpack_from("=Q", buf, 32)
    major, minor = struct.unpack_from("=II", buf, 136)
    return f"{major}:{minor}", ino


class _Kcmp:
    """kcmp(2) ``KCMP_FILES`` for one scan: off for the rest of it once refused."""

    def __init__(self) -> None:
        self.on = _SYS_KCMP is not None

    def same_table(self, a: int, b: int) -> bool | None:
        """Whether tasks ``a`` and ``b`` share one descriptor table; None where kcmp cannot
        tell (refused: the caller reads both); raises ProcessLookupError if one is gone."""
        if not self.on or _SYS_KCMP is None:
            return None
        r = _libc.syscall(ctypes.c_long(_SYS_KCMP), ctypes.c_long(a), ctypes.c_long(b),
                          ctypes.c_long(_KCMP_FILES), ctypes.c_long(0), ctypes.c_long(0))
        if r >= 0:
            return r == 0
        e = ctypes.get_errno()
        if e == errno.ESRCH:
            raise ProcessLookupError(e, os.strerror(e))
        self.on = False  # ENOSYS, EPERM (seccomp), EACCES: the same for every task
        return None


def _tables(base: str, pid: int, kcmp: _Kcmp) -> Iterator[str]:
    """The ``/proc`` directories whose ``fd`` and ``fdinfo`` hold the descriptor tables of
    process ``pid`` (``base``): its own, then each of its threads' that differs from it
    and from every one given before (every thread's where kcmp is refused)."""
    yield base
    try:
        if os.stat(f"{base}/task").st_nlink <= 3:  # 2 + the number of threads
            return
        tids = [int(t) for t in os.listdir(f"{base}/task") if int(t) != pid]
    except OSError:
        return
    given = [pid]
    for tid in tids:
        if not kcmp.on:
            yield f"{base}/task/{tid}"
            continue
        for t in list(given):
            try:
                if kcmp.same_table(t, tid):
                    break
            except ProcessLookupError:  # tid or t is gone (a zombie leader is not)
                if not os.path.exists(f"{base}/task/{tid}"):
                    break
                given.remove(t)
        else:
            given.append(tid)
            yield f"{base}/task/{tid}"


class _Mounts:
    """The mount ids of ``device`` and of every other mount, from the ``mountinfo`` of
    each mount namespace met."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.ours: set[int] = set()
        self.known: set[int] = set()
        self.namespaces: set[str] = set()

    def meet(self, base: str) -> None:
        """Read the ``mountinfo`` of the namespace of process ``base``, once per namespace."""
        ns = os.readlink(f"{base}/ns/mnt")
        if ns in self.namespaces:
            return
        with open(f"{base}/mountinfo") as f:
            for line in f:
                parts = line.split(" ", 3)
                if len(parts) > 3:
                    mid = int(parts[0])
                    self.known.add(mid)
                    if parts[2] == self.device:
                        self.ours.add(mid)
        self.namespaces.add(ns)

    def holds(self, link: str, mnt: int, ino: int) -> bool:
        """Whether the descriptor ``link`` (``/proc/<pid>/fd/<n>``), whose ``fdinfo`` gave
        mount ``mnt`` and inode ``ino``, is of the device."""
        if mnt in self.ours:
            return True
        if mnt in self.known:
            return False
        return _file_id(link) == (self.device, ino)


def _read_table(table: str, pid: int, mounts: _Mounts, out: Scan) -> None:
    """Add to ``out`` the descriptors of the table of ``table`` (``/proc/<pid>`` or
    ``/proc/<pid>/task/<tid>``) open for writing on the device. Raises OSError if its
    ``fd`` or ``fdinfo`` directory cannot be opened."""
    fds = os.open(f"{table}/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        infos = os.open(f"{table}/fdinfo", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in os.listdir(fds):
                try:
                    # The path first (one call) rules out pipes, sockets and the like, the
                    # access mode (one more) readers; fdinfo takes three.
                    if not os.readlink(name, dir_fd=fds).startswith("/"):
                        continue
                    if not os.stat(name, dir_fd=fds, follow_symlinks=False).st_mode \
                            & stat.S_IWUSR:
                        continue
                    got = _fdinfo(name, infos)
                except (OSError, ValueError):
                    continue  # closed meanwhile, or a line the kernel did not give
                if got is not None and mounts.holds(f"{table}/fd/{name}", *got):
                    out.inodes.setdefault(got[1], set()).add(pid)
        finally:
            os.close(infos)
    finally:
        os.close(fds)
    out.tables += 1


def scan(device: str, *, skip: tuple[int, ...] | None = None) -> Scan:
    """Files of the file system ``device`` (``major:minor``, decimal) open for writing by
    the processes this one may inspect, except ``skip`` (default: this process); see the
    module docstring. Never raises for a process that is gone or refused; OSError only if
    /proc itself cannot be read."""
    out = Scan()
    skipped = {str(p) for p in (skip if skip is not None else (os.getpid(),))}
    mounts = _Mounts(device)
    mounts.meet("/proc/self")
    kcmp = _Kcmp()
    for name in os.listdir("/proc"):
        if not name.isdigit() or name in skipped:
            continue
        base = f"/proc/{name}"
        pid = int(name)
        try:
            mounts.meet(base)
            _read_table(base, pid, mounts, out)
        except OSError as e:
            out.unseen += e.errno in _REFUSED and not _holds_nothing(pid)
            continue
        out.processes += 1
        for table in itertools.islice(_tables(base, pid, kcmp), 1, None):
            try:
                _read_table(table, pid, mounts, out)
            except OSError:
                continue  # a thread gone meanwhile
    return out


def mapped(device: str, *, skip: tuple[int, ...] | None = None) -> tuple[set[int], int]:
    """Files of the file system ``device`` (``major:minor``, decimal) that the processes
    this one may inspect, except ``skip`` (default: this process), hold mapped shared and
    writable: their pages can be dirtied with no request to the file system, and may be
    still in the kernel's page cache. Returns (their inode numbers, the number of processes
    /proc refused to show). Read from ``/proc/<pid>/maps`` (permissions ``rw?s``, then the
    device in hex and the inode number), which takes no descriptor and sends no request to
    the file system. OSError only if /proc itself cannot be read."""
    major, minor = (int(x) for x in device.split(":"))
    skipped = {str(p) for p in (skip if skip is not None else (os.getpid(),))}
    inodes: set[int] = set()
    unseen = 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name in skipped:
            continue
        try:
            with open(f"/proc/{name}/maps", "rb") as f:
                data = f.read()
        except OSError as e:
            unseen += e.errno in _REFUSED and not _holds_nothing(int(name))
            continue
        for line in _shared_writable(data):
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or parts[1] not in (b"rw-s", b"rwxs"):
                continue  # the text was in a path name
            dev_major, _, dev_minor = parts[3].partition(b":")
            try:
                if (int(dev_major, 16), int(dev_minor, 16)) == (major, minor):
                    inodes.add(int(parts[4]))
            except ValueError:
                continue
    return inodes, unseen


def _shared_writable(maps: bytes) -> Iterator[bytes]:
    """The lines of a ``/proc/<pid>/maps`` text whose permissions are ``rw-s`` or ``rwxs``,
    found by searching for them (most processes map nothing so: nothing to split)."""
    for perms in (b" rw-s ", b" rwxs "):
        pos = maps.find(perms)
        while pos >= 0:
            start = maps.rfind(b"\n", 0, pos) + 1
            end = maps.find(b"\n", pos)
            if end < 0:
                end = len(maps)
            yield maps[start:end]
            pos = maps.find(perms, end)
