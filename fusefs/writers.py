"""Files open for writing on a mount, found without file handles: a scan of /proc.

In no-open mode (README: "No-open mode") open(2) never reaches the daemon, so it cannot
count writable handles. ``scan`` finds the same facts from the kernel's side, as lsof(8)
does, reading only /proc (nothing on the mount itself is touched, so the serving thread may
call it without waiting on itself; PYFUSE3.md trap 10):

1. the mounts of the mount's device (``major:minor``, as ``mountinfo`` gives it) are read
   from the ``mountinfo`` of each distinct mount namespace met (``/proc/<pid>/ns/mnt``):
   their ids (unique across namespaces) and, in this process's namespace, their mount
   points. A process whose namespace holds none of them is skipped whole;
2. every ``/proc/<pid>/fd/<n>`` link is read: only one naming a path (not a pipe, socket
   or anonymous inode), and in this namespace a path below one of the device's mount
   points, is looked at further, so most descriptors cost one call;
3. its lstat gives the descriptor's access mode (the link's mode has ``S_IWUSR`` when it
   was opened for writing; ``tid_fd_update_inode`` in fs/proc/fd.c), and a writable one
   has its ``/proc/<pid>/fdinfo/<n>`` read for ``mnt_id`` and ``ino`` (the inode number;
   Linux 5.14 or later). So a descriptor opened through a bind mount, or inside a
   sandbox's own mount namespace (the Bash sandbox), is found too.

Processes the scan may not inspect (other users' when the daemon is not root: EACCES) are
counted in ``Scan.unseen``, never an error; a process or descriptor that goes away during
the scan (ESRCH, ENOENT) is skipped. Pids are those of this process's pid namespace (a
sandboxed command shows under its host pid). Not seen: this process itself (``skip``), a
file written only through a shared writable mapping after its descriptor was closed, a
descriptor passed from another mount namespace into this one, one held only by a thread
with a descriptor table of its own (``unshare(CLONE_FILES)``; ``task/<tid>/fd`` is not
read) or only queued in a unix socket, and a descriptor opened after the scan read its
process.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field

_REFUSED = (errno.EACCES, errno.EPERM)


@dataclass
class Scan:
    """What one scan found: ``inodes`` maps the inode number of each file of the device
    open for writing to the pids holding it so; ``processes`` counts the processes whose
    descriptors were read, ``unseen`` those /proc refused to show."""

    inodes: dict[int, set[int]] = field(default_factory=dict)
    processes: int = 0
    unseen: int = 0


def _fdinfo(path: str) -> tuple[int, int] | None:
    """(mount id, inode number) from a ``fdinfo`` file, None without them."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
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


def _unescape(field: str) -> str:
    """A mountinfo path field: octal escapes (space, tab, newline, backslash) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _mounts(pid: str, device: str) -> tuple[set[int], list[str]]:
    """Ids and mount points of the mounts of ``device`` in the mount namespace of ``pid``
    (mount points as that namespace shows them)."""
    ids: set[int] = set()
    points: list[str] = []
    with open(f"/proc/{pid}/mountinfo") as f:
        for line in f:
            parts = line.split(" ", 5)
            if len(parts) > 4 and parts[2] == device:
                ids.add(int(parts[0]))
                points.append(_unescape(parts[4]))
    return ids, points


def scan(device: str, *, skip: tuple[int, ...] | None = None) -> Scan:
    """Files of the file system ``device`` (``major:minor``, decimal) open for writing by
    the processes this one may inspect, except ``skip`` (default: this process); see the
    module docstring. Never raises for a process that is gone or refused; OSError only if
    /proc itself cannot be read."""
    out = Scan()
    skipped = {str(p) for p in (skip if skip is not None else (os.getpid(),))}
    own_ns = os.readlink("/proc/self/ns/mnt")
    own_ids, points = _mounts("self", device)
    prefixes = tuple(p.rstrip("/") + "/" for p in points)
    namespaces: dict[str, set[int]] = {own_ns: own_ids}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in skipped:
            continue
        base = f"/proc/{pid}"
        try:
            ns = os.readlink(f"{base}/ns/mnt")
            ids = namespaces.get(ns)
            if ids is None:
                ids = namespaces[ns] = _mounts(pid, device)[0]
            if not ids:
                out.processes += 1
                continue  # nothing of this device in its namespace
            fds = os.scandir(f"{base}/fd")
        except OSError as e:
            out.unseen += e.errno in _REFUSED
            continue
        out.processes += 1
        here = ns == own_ns
        with fds:
            for fd in fds:
                try:
                    # The path first (one call): in this namespace it rules out almost
                    # every descriptor; elsewhere only pipes, sockets and the like.
                    target = os.readlink(fd.path)
                    if not (target.startswith(prefixes) or target in points) if here \
                            else not target.startswith("/"):
                        continue
                    if not fd.stat(follow_symlinks=False).st_mode & stat.S_IWUSR:
                        continue
                    got = _fdinfo(f"{base}/fdinfo/{fd.name}")
                except (OSError, ValueError):
                    continue  # closed meanwhile, or a line the kernel did not give
                if got is not None and got[0] in ids:
                    out.inodes.setdefault(got[1], set()).add(int(pid))
    return out
