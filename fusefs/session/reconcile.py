"""Exact reconcile of a fixed root to a materialized target, with rollback copies.

A fixed root (exclusive or shared placement) is never renamed or wiped: restoring it, and
writing a FUSE session's final tree back into the directory it was mounted over, make it
equal to a target directory ``staging`` (the snapshot materialized beside the root) by
moving entries, so that afterwards the root snapshots to the target's Ref. Departure from
the reference system: the reconcile is exact, so symlinks, fifos, empty directories, modes,
mtimes and user xattrs are reconciled too, not only regular files.

Plan (computed before anything changes, written durably to the log):

0. ``chmod``: directories that must be writable for a move get ``u+w`` (old mode kept).
1. ``backup``: every root entry absent from the target or different from it is renamed into
   the rollback directory ``rollback`` (a whole subtree at once), parents before children.
2. ``install``: every target entry now missing from the root is renamed from ``staging``
   into the root (a whole subtree at once).
3. ``fixmode``: installed directories that were made writable get their mode back.
4. ``dirmeta``: every directory left in place (and every installed one) gets the target's
   mode, xattrs and mtime, deepest first.

Every rename and open is relative to a directory fd opened with ``O_NOFOLLOW``, walked from
``/``: a symlink in the root's path raises ``symlink_root`` / ``symlink_component``, one
that appears inside the root during the reconcile ``symlink_component``; a name that is not
one plain component ``path_escape``.

Crash safety: ``rollback_plan`` undoes the applied steps in reverse order, each step checked
against what is on disk, so it can run any number of times; the caller keeps the log phase
(``planned`` -> ``committed``) and decides between rollback and roll-forward.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .errors import RestoreError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_XATTR_UNSUPPORTED = {errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass(frozen=True)
class Meta:
    """What the reconcile compares of one entry (``kind``: dir, file, symlink, fifo, socket,
    other; ``mode``: permission bits)."""

    kind: str
    mode: int
    size: int
    mtime_ns: int
    nlink: int
    target: str
    xattrs: tuple[tuple[str, bytes], ...]


def _kind(m: int) -> str:
    if stat.S_ISDIR(m):
        return "dir"
    if stat.S_ISREG(m):
        return "file"
    if stat.S_ISLNK(m):
        return "symlink"
    if stat.S_ISFIFO(m):
        return "fifo"
    if stat.S_ISSOCK(m):
        return "socket"
    return "other"


def _xattrs(fd: int) -> tuple[tuple[str, bytes], ...]:
    try:
        names = sorted(n for n in os.listxattr(fd) if n.startswith("user."))
        return tuple((n, os.getxattr(fd, n)) for n in names)
    except OSError as e:
        if e.errno in _XATTR_UNSUPPORTED:
            return ()
        raise


def split(rel: str) -> list[str]:
    """The components of a root-relative path; raises RestoreError path_escape unless each
    is one plain name."""
    parts = rel.split("/")
    if any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise RestoreError(RestoreError.PATH_ESCAPE, cause=f"{rel!r} is not a relative path")
    return parts


def open_root(path: str) -> int:
    """Open directory ``path`` (absolute) walking from ``/`` with O_NOFOLLOW.

    Raises RestoreError symlink_root if ``path`` itself is a symlink, symlink_component if
    a component above it is, swap_failed for any other failure."""
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", _DIR)
    try:
        for i, p in enumerate(parts):
            try:
                st = os.stat(p, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    kind = (RestoreError.SYMLINK_ROOT if i == len(parts) - 1
                            else RestoreError.SYMLINK_COMPONENT)
                    raise RestoreError(kind, cause=f"{'/' + '/'.join(parts[:i + 1])} "
                                                   "is a symlink")
                nfd = os.open(p, _DIR, dir_fd=fd)
            except OSError as e:
                kind = (RestoreError.SYMLINK_COMPONENT if e.errno == errno.ELOOP
                        else RestoreError.SWAP_FAILED)
                raise RestoreError(kind, cause=e) from e
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_dir(base_fd: int, rel: str) -> int:
    """Open directory ``rel`` below ``base_fd`` without following any symlink ("" -> a
    duplicate of ``base_fd``). Raises RestoreError symlink_component on a symlink."""
    fd = os.dup(base_fd)
    if not rel:
        return fd
    try:
        for p in split(rel):
            try:
                nfd = os.open(p, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise RestoreError(RestoreError.SYMLINK_COMPONENT,
                                       cause=f"{rel}: a component is not a directory") from e
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def dir_fd(base_fd: int, rel: str) -> Iterator[int]:
    fd = open_dir(base_fd, rel)
    try:
        yield fd
    finally:
        os.close(fd)


def scan(base_fd: int) -> dict[str, Meta]:
    """Every entry below ``base_fd`` by root-relative path (``/``-joined, names decoded with
    surrogateescape), symlinks not followed."""
    out: dict[str, Meta] = {}

    def walk(fd: int, prefix: str) -> None:
        for name in sorted(os.listdir(fd)):
            rel = prefix + name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            kind = _kind(st.st_mode)
            target = os.readlink(name, dir_fd=fd) if kind == "symlink" else ""
            xa: tuple[tuple[str, bytes], ...] = ()
            if kind in ("dir", "file"):
                flags = _DIR if kind == "dir" else os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                cfd = os.open(name, flags | os.O_NONBLOCK, dir_fd=fd)
                try:
                    xa = _xattrs(cfd)
                    if kind == "dir":
                        out[rel] = Meta(kind, stat.S_IMODE(st.st_mode), 0, st.st_mtime_ns,
                                        st.st_nlink, target, xa)
                        walk(cfd, rel + "/")
                        continue
                finally:
                    os.close(cfd)
            out[rel] = Meta(kind, stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns,
                            st.st_nlink, target, xa)

    walk(base_fd, "")
    return out


def _same_content(a_fd: int, b_fd: int, rel: str) -> bool:
    parent, _, name = rel.rpartition("/")
    with dir_fd(a_fd, parent) as pa, dir_fd(b_fd, parent) as pb:
        fa = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pa)
        try:
            fb = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pb)
            try:
                while True:
                    x = os.read(fa, 1 << 20)
                    y = os.read(fb, 1 << 20)
                    if x != y:
                        return False
                    if not x:
                        return True
            finally:
                os.close(fb)
        finally:
            os.close(fa)


def _equal(cur: Meta, want: Meta, rel: str, root_fd: int, staging_fd: int) -> bool:
    """True if the root's entry can stay as it is (directories: same kind only)."""
    if cur.kind != want.kind:
        return False
    if cur.kind == "dir":
        return True
    if cur.mode != want.mode or cur.mtime_ns != want.mtime_ns:
        return False
    if cur.kind == "symlink":
        return cur.target == want.target
    if cur.kind == "file":
        return (cur.size == want.size and cur.nlink == 1 and want.nlink == 1
                and cur.xattrs == want.xattrs and _same_content(root_fd, staging_fd, rel))
    return cur.kind in ("fifo", "socket")


def _key(rel: str) -> list[str]:
    return rel.split("/")


def _under(rel: str, tops: set[str]) -> bool:
    parts = rel.split("/")
    return any("/".join(parts[:i]) in tops for i in range(1, len(parts)))


def plan(root_fd: int, staging_fd: int) -> list[list[object]]:
    """The steps that turn the root into the staging tree (see the module docstring), as
    JSON-able lists ``[op, side, rel, ...]``. Empty if they are already equal."""
    cur = scan(root_fd)
    want = scan(staging_fd)
    backups: list[str] = []
    gone: set[str] = set()
    for rel in sorted(cur, key=_key):
        if _under(rel, gone):
            continue
        if rel not in want or not _equal(cur[rel], want[rel], rel, root_fd, staging_fd):
            backups.append(rel)
            gone.add(rel)
    installs: list[str] = []
    placed: set[str] = set()
    for rel in sorted(want, key=_key):
        if _under(rel, placed):
            continue
        if rel not in cur or rel in gone or _under(rel, gone):
            installs.append(rel)
            placed.add(rel)
    kept_dirs = [r for r in cur if cur[r].kind == "dir" and r not in gone
                 and not _under(r, gone)]
    # Directories that must be writable: parents of every move, and moved directories.
    need_w: dict[tuple[str, str], int] = {}

    def writable(side: str, rel: str, mode: int) -> None:
        if not mode & 0o200:
            need_w[(side, rel)] = mode

    root_modes = {r: m.mode for r, m in cur.items() if m.kind == "dir"}
    stage_modes = {r: m.mode for r, m in want.items() if m.kind == "dir"}
    for rel in backups:
        parent = rel.rpartition("/")[0]
        if parent:
            writable("R", parent, root_modes[parent])
        if cur[rel].kind == "dir":
            writable("R", rel, cur[rel].mode)
    for rel in installs:
        parent = rel.rpartition("/")[0]
        if parent:
            writable("R", parent, root_modes.get(parent, stage_modes.get(parent, 0o700)))
            writable("S", parent, stage_modes[parent])
        if want[rel].kind == "dir":
            writable("S", rel, want[rel].mode)
    steps: list[list[object]] = []
    for (side, rel), mode in sorted(need_w.items(), key=lambda kv: (kv[0][0], _key(kv[0][1]))):
        steps.append(["chmod", side, rel, mode])
    steps += [["backup", "R", rel] for rel in backups]
    steps += [["install", "S", rel] for rel in installs]
    for rel in installs:
        if ("S", rel) in need_w:
            steps.append(["fixmode", "R", rel, want[rel].mode])
    moved_parents = {r.rpartition("/")[0] for r in backups + installs}
    for rel in sorted(kept_dirs + [r for r in installs if want[r].kind == "dir"],
                      key=_key, reverse=True):
        w = want[rel]
        c = cur.get(rel)
        if (rel in moved_parents or ("R", rel) in need_w or c is None or c.mode != w.mode
                or c.mtime_ns != w.mtime_ns or c.xattrs != w.xattrs):
            old = [c.mode, c.mtime_ns] if c is not None and rel not in placed else [None, None]
            steps.append(["dirmeta", "R", rel, w.mode, w.mtime_ns,
                          [[n, v.hex()] for n, v in w.xattrs], *old])
    return steps


class Sides:
    """Open fds of the three directories a reconcile works on: the root (R), the staging
    target (S) and the rollback directory (B)."""

    def __init__(self, root_fd: int, staging_fd: int, rollback_fd: int) -> None:
        self.fd = {"R": root_fd, "S": staging_fd, "B": rollback_fd}


def _exists(base: int, rel: str) -> bool:
    parent, _, name = rel.rpartition("/")
    try:
        with dir_fd(base, parent) as pfd:
            os.stat(name, dir_fd=pfd, follow_symlinks=False)
        return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except RestoreError:
        return False


def _chmod(base: int, rel: str, mode: int) -> None:
    with dir_fd(base, rel) as fd:
        os.fchmod(fd, mode)


def _move(src: int, dst: int, rel: str, make_parents: bool = False) -> None:
    parent, _, name = rel.rpartition("/")
    if make_parents and parent:
        pfd = dst
        for p in split(parent):
            try:
                os.mkdir(p, 0o700, dir_fd=pfd)
            except FileExistsError:
                pass
            nfd = os.open(p, _DIR, dir_fd=pfd)
            if pfd != dst:
                os.close(pfd)
            pfd = nfd
        if pfd != dst:
            os.close(pfd)
    with dir_fd(src, parent) as sp, dir_fd(dst, parent) as dp:
        try:
            os.stat(name, dir_fd=dp, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            raise FileExistsError(errno.EEXIST, "target appeared during the reconcile", rel)
        os.rename(name, name, src_dir_fd=sp, dst_dir_fd=dp)


def _set_dirmeta(base: int, rel: str, mode: int, mtime_ns: int,
                 xattrs: list[list[str]] | None) -> None:
    with dir_fd(base, rel) as fd:
        if xattrs is not None:
            want = {n: bytes.fromhex(v) for n, v in xattrs}
            try:
                have = set(n for n in os.listxattr(fd) if n.startswith("user."))
                for n in have - set(want):
                    os.removexattr(fd, n)
                for n, v in want.items():
                    os.setxattr(fd, n, v)
            except OSError as e:
                if e.errno not in _XATTR_UNSUPPORTED or want:
                    raise
        os.fchmod(fd, mode)
        os.utime(fd, ns=(mtime_ns, mtime_ns))


def apply(sides: Sides, steps: list[list[object]],
          hook: Callable[[int], None] | None = None) -> None:
    """Apply ``steps`` in order; ``hook(i)`` runs before step ``i`` (crash-test points)."""
    fd = sides.fd
    for i, step in enumerate(steps):
        if hook is not None:
            hook(i)
        op, side, rel = str(step[0]), str(step[1]), str(step[2])
        if op == "chmod":
            _chmod(fd[side], rel, int(step[3]) | 0o700)  # type: ignore[call-overload]
        elif op == "backup":
            _move(fd["R"], fd["B"], rel, make_parents=True)
        elif op == "install":
            _move(fd["S"], fd["R"], rel)
        elif op == "fixmode":
            _chmod(fd["R"], rel, int(step[3]))  # type: ignore[call-overload]
        elif op == "dirmeta":
            _set_dirmeta(fd["R"], rel, int(step[3]), int(step[4]),  # type: ignore[call-overload]
                         step[5])  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown reconcile step {op!r}")


def rollback_plan(sides: Sides, steps: list[list[object]]) -> None:
    """Undo ``steps`` (any prefix of them applied) in reverse order, then put back the old
    modes and mtimes of every directory touched. Idempotent."""
    fd = sides.fd
    for step in reversed(steps):
        op, side, rel = str(step[0]), str(step[1]), str(step[2])
        if op in ("dirmeta", "fixmode"):
            if _exists(fd["R"], rel):
                with dir_fd(fd["R"], rel) as dfd:
                    os.fchmod(dfd, stat.S_IMODE(os.fstat(dfd).st_mode) | 0o700)
        elif op == "install":
            if _exists(fd["R"], rel) and not _exists(fd["S"], rel):
                _move(fd["R"], fd["S"], rel)
        elif op == "backup":
            if _exists(fd["B"], rel) and not _exists(fd["R"], rel):
                _move(fd["B"], fd["R"], rel)
    for step in steps:
        op, side, rel = str(step[0]), str(step[1]), str(step[2])
        if op == "chmod" and _exists(fd[side], rel):
            _chmod(fd[side], rel, int(step[3]))  # type: ignore[call-overload]
    for step in steps:  # deepest first, as planned
        if step[0] == "dirmeta" and step[6] is not None and _exists(fd["R"], str(step[2])):
            _set_dirmeta(fd["R"], str(step[2]), int(step[6]),  # type: ignore[call-overload]
                         int(step[7]), None)  # type: ignore[call-overload]
