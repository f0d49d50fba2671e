"""Where running mount daemons are recorded, and how the system's mount table is read.

A daemon writes one small JSON record per mount point into the runtime directory
(``runtime_dir("mounts")``: ``$XDG_RUNTIME_DIR/rewindfs/mounts`` where that is a directory
of this user, else ``/tmp/rewindfs-<uid>/mounts``; every level 0700) once
it serves, and removes it when it exits; ``rewindfs umount`` reads it to wait for the daemon
to finish persisting, then reads the exit record a failed daemon leaves (``EXIT_SUFFIX``).
Light on imports: the CLI uses it without loading FUSE.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import stat
from typing import Any

from .errors import RuntimeDirError

MAX_RUNTIME_DIR_BYTES = 76
"""Longest runtime directory path: a socket ``<session id>.sock`` (29 bytes) below it must
fit the 107 bytes of a Unix socket path (unix(7), ``sun_path``)."""


def runtime_base() -> str:
    """Where the runtime directory is: ``$XDG_RUNTIME_DIR/rewindfs`` when XDG_RUNTIME_DIR
    names a directory of this user, else ``$TMPDIR/rewindfs-<uid>`` (TMPDIR default
    ``/tmp``). See ``xdg_passed_over``."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and xdg_passed_over() is None:
        return os.path.join(base, "rewindfs")
    tmp = os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(tmp, f"rewindfs-{os.getuid()}")


def xdg_passed_over() -> str | None:
    """Why ``$XDG_RUNTIME_DIR`` is not used (None: it is, or it is not set): it does not
    exist, is not a directory, or belongs to another user. The XDG base directory spec
    wants it owned by the user, and a replacement used otherwise; ``su`` without ``-``
    keeps the caller's (``/run/user/0``), which this user can neither read nor write
    in."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base:
        return None
    try:
        st = os.stat(base)
    except OSError as e:
        return f"XDG_RUNTIME_DIR={base}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"XDG_RUNTIME_DIR={base} is not a directory"
    if st.st_uid != os.getuid():
        return (f"XDG_RUNTIME_DIR={base} belongs to uid {st.st_uid}, not to this user (uid "
                f"{os.getuid()})")
    return None


def _private_level(path: str) -> None:
    """Make ``path`` a directory of this user with mode 0700: create it so, tighten one
    of ours with group or other bits, refuse anything else (never following a symlink,
    since the fallback lives in the shared /tmp)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise RuntimeDirError(path, f"cannot create it ({e.strerror}); set XDG_RUNTIME_DIR "
                                    "to a private directory of yours") from e
    st = os.lstat(path)
    uid = os.getuid()
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise RuntimeDirError(path, f"is {kind}; remove it, or set XDG_RUNTIME_DIR to a "
                                    "private directory of yours")
    if st.st_uid != uid:
        raise RuntimeDirError(path, f"belongs to uid {st.st_uid}, not to this user (uid "
                                    f"{uid}); have its owner or root remove it, or set "
                                    "XDG_RUNTIME_DIR to a private directory of yours")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)  # ours: an older release or a umask left it open


def runtime_dir(*sub: str) -> str:
    """The per-user runtime directory of rewindfs (``runtime_base()``), or the level
    ``sub`` under it, every level made private (0700, this user's; see
    ``_private_level``). The one owner of these directories: control sockets sit at the
    top, mount records and read-only mounts' logs in ``mounts``.

    Raises RuntimeDirError (exit 9) when a level is not a directory of this user."""
    d = runtime_base()
    if len(os.fsencode(d)) > MAX_RUNTIME_DIR_BYTES:
        raise RuntimeDirError(d, "is too long for the control sockets in it (Unix socket "
                                 "paths are limited to 107 bytes); set XDG_RUNTIME_DIR to a "
                                 "shorter private directory")
    _private_level(d)
    for name in sub:
        d = os.path.join(d, name)
        _private_level(d)
    return d


def record_path(mountpoint: str, suffix: str = ".json") -> str:
    key = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:24]
    return os.path.join(runtime_dir("mounts"), key + suffix)


EXIT_SUFFIX = ".exit"
"""A daemon that ends with a failure (for example a persist that failed at unmount) leaves
``{"pid", "started", "code", "error"}`` under this suffix, for ``rewindfs umount`` to
report after the daemon is gone."""


def write_record(mountpoint: str, data: dict[str, Any], suffix: str = ".json") -> str:
    path = record_path(mountpoint, suffix)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, sort_keys=True)
    os.replace(tmp, path)
    return path


def read_record(mountpoint: str, suffix: str = ".json") -> dict[str, Any] | None:
    """The record of ``mountpoint`` (``suffix``: the kind of record), or None (none,
    unreadable, or no private runtime directory to read it from)."""
    try:
        with open(record_path(mountpoint, suffix)) as f:
            data = json.load(f)
    except (OSError, ValueError, RuntimeDirError):
        return None
    return data if isinstance(data, dict) else None


def served_refs(store_root: str) -> list[str]:
    """Ref texts that the live mount daemons of this user serve from the store at
    ``store_root``, for GC (CONTRACT 1.6): a read-only mount's Ref, and for a read-write
    mount what its state directory pins (base, and older lowers its detached inodes still
    read: ``fusefs.session.fusetree.pinned_refs``). Records of dead daemons are skipped.
    Raises store.errors.GCError if a live mount's state cannot be read (GC fails closed)."""
    from store.errors import GCError

    from .session.fusetree import pinned_refs

    want = os.path.realpath(store_root)
    d = os.path.join(runtime_dir(), "mounts")
    out: list[str] = []
    if not os.path.isdir(d):  # no mount was ever started with this runtime dir
        return out
    for name in sorted(os.listdir(d)):
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(d, name)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(rec, dict) or not rec.get("store") or not isinstance(
                rec.get("pid"), int) or os.path.realpath(str(rec["store"])) != want:
            continue
        if not alive(rec["pid"], rec.get("started")):
            continue
        if rec.get("state"):
            try:
                out.extend(str(r) for r in pinned_refs(str(rec["state"])))
            except Exception as err:
                raise GCError("live", str(rec["state"]), f"cannot read the state of the live "
                              f"mount at {rec.get('mountpoint')}: {err}") from err
        elif rec.get("ref"):
            out.append(str(rec["ref"]))
    return out


def claim_mountpoint(mountpoint: str) -> int:
    """Make this process the one daemon that mounts at ``mountpoint``: flock (exclusive,
    not waiting) its lock file in the runtime directory, held through the returned
    descriptor until ``release_claim``, then check that nothing is mounted there. Two
    ``rewindfs mount`` started together both passed the CLI's check and stacked two mounts
    at one path (the second hid the first; its record and control socket were replaced).

    The lock file exists only while claimed: ``release_claim`` unlinks it while still
    holding the lock, so a claimant that opened it just before may lock an unlinked file;
    after locking, the claimant checks that the file it locked is still the one at the
    path (same device and inode) and otherwise starts again on the new one.

    Raises MountError (another daemon of this user holds the path, or a mount is there)
    and RuntimeDirError."""
    from .errors import MountError

    path = record_path(mountpoint, ".lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise MountError(mountpoint, "another rewindfs daemon is mounting or "
                                             "serving there") from None
            if not _is_at(fd, path):
                os.close(fd)  # released (unlinked) between our open and our lock
                continue
            if is_mounted(mountpoint):
                try:
                    _unlink_held(fd, path)
                except OSError:
                    pass
                raise MountError(mountpoint, "something is already mounted there")
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        return fd


def _is_at(fd: int, path: str) -> bool:
    """True if the file open at ``fd`` is the one named ``path`` now."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _unlink_held(fd: int, path: str) -> None:
    """Unlink the lock file ``path`` whose lock this process holds through ``fd`` (only if
    the path still names that file)."""
    if _is_at(fd, path):
        os.unlink(path)


def release_claim(mountpoint: str, fd: int) -> None:
    """End the claim ``claim_mountpoint`` returned: unlink the lock file while the lock
    is still held (so no other claimant can be holding it meanwhile), then close ``fd``.
    Never raises for a lock file already gone or a runtime directory that went away."""
    try:
        _unlink_held(fd, record_path(mountpoint, ".lock"))
    except (OSError, RuntimeDirError):
        pass
    finally:
        os.close(fd)


def take_exit_record(mountpoint: str) -> dict[str, Any] | None:
    """Read and remove the exit record of ``mountpoint`` (None if there is none)."""
    rec = read_record(mountpoint, EXIT_SUFFIX)
    try:
        os.unlink(record_path(mountpoint, EXIT_SUFFIX))
    except (FileNotFoundError, RuntimeDirError):
        pass
    return rec


def remove_record(mountpoint: str, pid: int) -> None:
    """Remove the record of ``mountpoint`` if it is ``pid``'s."""
    rec = read_record(mountpoint)
    if rec is not None and rec.get("pid") == pid:
        try:
            os.unlink(record_path(mountpoint))
        except FileNotFoundError:
            pass


def clear_dead(mountpoint: str, rec: dict[str, Any]) -> None:
    """Remove what the dead daemon of record ``rec`` left in the runtime directory for
    ``mountpoint`` (killed, it could not): its record (only if still ``rec``'s pid), its
    lock file (through a claim of our own, so a daemon starting there meanwhile keeps its
    own) and its control socket (only while the state directory's upper lock shows that
    no daemon serves it). Call it once the daemon is gone and nothing is mounted there;
    never raises for what is already gone or held by someone else."""
    from .errors import MountError

    pid = rec.get("pid")
    if isinstance(pid, int):
        try:
            remove_record(mountpoint, pid)
        except (OSError, RuntimeDirError):
            pass
    try:
        fd = claim_mountpoint(mountpoint)
    except (MountError, OSError, RuntimeDirError):
        return  # someone else claims it now: theirs to keep
    try:
        state = rec.get("state")
        if isinstance(state, str) and state:
            from .control import socket_path_for
            from .upper import LOCK_NAME

            try:
                lock = os.open(os.path.join(state, LOCK_NAME), os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                return
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(socket_path_for(state))
            except OSError:
                pass  # served by a daemon again, or no socket left
            finally:
                os.close(lock)
    finally:
        release_claim(mountpoint, fd)


def start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of process ``pid``, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    return int(raw.rpartition(")")[2].split()[19])


def alive(pid: int, started: int | None) -> bool:
    """True if process ``pid`` runs and (when known) started at ``started``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return False
    if fields[0] in ("Z", "X"):  # exited, not yet reaped by its parent
        return False
    return started is None or int(fields[19]) == started


def _unescape(s: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) of /proc/self/mountinfo."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _mounts_at(mountpoint: str) -> list[tuple[int, str]]:
    """(mount id, fstype) of every mount exactly at ``mountpoint``, oldest first."""
    want = os.path.abspath(mountpoint)
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts = left.split()
            if len(parts) > 4 and _unescape(parts[4]) == want:
                out.append((int(parts[0]), right.split()[0] if right else ""))
    return out


def own_mounts(fs: str = "fuse.rewindfs") -> list[str]:
    """The mount points of every ``fs`` mount this user made (FUSE's ``user_id`` is our
    uid), in /proc/self/mountinfo order."""
    want = f"user_id={os.getuid()}"
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts, sup = left.split(), right.split()
            if (len(parts) > 4 and len(sup) > 2 and sup[0] == fs
                    and want in sup[2].split(",")):
                out.append(_unescape(parts[4]))
    return out


def fstype(mountpoint: str) -> str | None:
    """The file system type mounted exactly at ``mountpoint`` (the last mount), or None."""
    found = _mounts_at(mountpoint)
    return found[-1][1] if found else None


def mount_id(mountpoint: str) -> int | None:
    """The id of the top mount at ``mountpoint`` (see proc(5), mountinfo), or None."""
    found = _mounts_at(mountpoint)
    return found[-1][0] if found else None


def mount_device(mountpoint: str) -> str | None:
    """The ``major:minor`` device of the top mount at ``mountpoint`` (its backing device
    info lives in ``/sys/class/bdi/<major:minor>``), or None if nothing is mounted there."""
    want = os.path.abspath(mountpoint)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.partition(" - ")[0].split()
            if len(parts) > 4 and _unescape(parts[4]) == want:
                found = parts[2]
    return found


def still_mounted(mountpoint: str, mid: int) -> bool:
    """True if the mount with id ``mid`` is still at ``mountpoint``."""
    return any(m == mid for m, _ in _mounts_at(mountpoint))


def is_mounted(mountpoint: str) -> bool:
    return bool(_mounts_at(mountpoint))


def dead(mountpoint: str) -> bool:
    """True if the file system mounted at ``mountpoint`` no longer answers (ENOTCONN: its
    FUSE daemon is gone). A stat cannot tell: the kernel may answer it from the attributes
    it cached for the root while the daemon lived; statfs always asks the daemon."""
    try:
        os.statvfs(mountpoint)
    except OSError as e:
        return e.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    return False


def recorded_mount(path: str) -> tuple[str, dict[str, Any]] | None:
    """The mount point at or above ``path`` (absolute or relative) whose daemon left a
    record, nearest first, and that record; None when no mount there has one. A record
    outlives a killed daemon (``alive`` tells)."""
    probe = os.path.abspath(path)
    while True:
        rec = read_record(probe)
        if rec is not None:
            return probe, rec
        if probe == os.path.dirname(probe):
            return None
        probe = os.path.dirname(probe)


def processes_using(path: str, *, exclude: tuple[int, ...] = ()) -> list[tuple[int, str]]:
    """(pid, command line) of every process, other than this one and ``exclude``, whose
    cwd, root, an open file or a mapped file is ``path`` or below it, read from
    /proc/<pid>/{cwd,root,fd,map_files} as fuser(1) ``-m`` does (processes of other users
    are seen as far as /proc lets us). Sorted by pid."""
    want = os.path.abspath(path).rstrip("/") or "/"
    prefix = want if want == "/" else want + "/"

    def inside(link: str) -> bool:
        try:
            target = os.readlink(link)
        except OSError:
            return False
        return target == want or target.startswith(prefix)

    skip = {os.getpid(), *exclude}
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        base = f"/proc/{name}"
        links = [f"{base}/cwd", f"{base}/root"]
        for sub in ("fd", "map_files"):
            try:
                links += [f"{base}/{sub}/{e}" for e in os.listdir(f"{base}/{sub}")]
            except OSError:
                pass
        if not any(inside(link) for link in links):
            continue
        try:
            with open(f"{base}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            # one line per process (an argument may hold a line break or escapes)
            cmd = "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in cmd)
        except OSError:
            continue  # gone meanwhile
        out.append((int(name), cmd or f"[{name}]"))
    return sorted(out)
