"""Write a snapshot out as a real directory (CONTRACT 1.5), hardened against hostile trees.

Owns extraction into a missing or empty destination, the compare of a non-empty one, and
the wipe of a half-written one. It must never write outside the destination, never write
bytes that did not verify against their chunk id, and never leave a partial tree behind.

The three destination cases:

- missing, or an empty directory: extract. On any failure everything written is wiped (a
  destination this call created is removed, an existing one is emptied and its mtime put
  back) and the error is raised: ``IntegrityError`` (a chunk or tree does not verify or is
  missing), ``ArchiveEntryError`` (a hostile entry), ``ArchiveLimitError`` (a cap tripped)
  surface as themselves; an OS error (disk full, permission, a concurrent change in the
  destination) becomes ``MaterializeError(ref, dest, cause)``, and so does any failure
  whose wipe failed too (its message says so: the destination needs removing by hand).
- a non-empty directory: its Ref is computed (``snapshot.compute_ref``); equal to what an
  extraction by this process writes -> success with ``already_equal`` and no write;
  different or unreadable -> ``DestNotEmptyError`` and nothing touched. Not as root, what
  this user owns but may not read (a mode-0000 file or directory, as an extraction of such
  an entry leaves it) is read from a user namespace of its own, where it may (nothing is
  changed for that); where none can be made, the error says so and what to do.
- anything else, a symlink included: ``NotDirError``.

What is not written: sockets (a socket is made by the program that listens on it) and,
unless running as root, block and character devices (``mknod`` of a device needs
CAP_MKNOD); both are skipped and counted in the result. Nor are setuid and setgid bits,
nor, unless running as root, owners: a non-root extraction leaves every entry owned by its
own uid and gid (new files' default), whoever owns it in the snapshot. The compare of a
non-empty destination ignores exactly what is not written: it holds "the same tree" when it
equals the snapshot without those entries, without those bits and (not as root) with
owners left out on both sides.

A materialize killed outright (``kill -9``, power loss) cannot wipe: ``dest`` keeps what was
written so far (directories still 0700, the last file possibly short). That partial tree is
never taken for the snapshot: a new materialize into it computes its Ref, finds it differs
and raises ``DestNotEmptyError`` without touching it. Remove ``dest`` and run it again.
Nothing is ever written outside ``dest``, killed or not.

Hardening:

- The destination path is walked from ``/`` one component at a time with ``O_NOFOLLOW``:
  a symlink anywhere in it is refused (``MaterializeError``; pass a canonical path). Below
  it every create and open is relative to a directory fd, with ``O_EXCL``/``O_NOFOLLOW``,
  so nothing is ever written through a symlink, whoever put it there.
- Names are checked when a tree is decoded (one component, 1..255 bytes, no NUL, not ``.``
  or ``..``; duplicates are non-canonical), paths are capped at 4096 bytes, symlink targets
  must be 1..4095 bytes without NUL, xattr names must be ``user.*``, and a hard-link group
  may hold only non-directories whose entries agree.
- Caps: ``max_entries`` counts every entry processed (sockets and hard links included),
  ``max_bytes`` the content bytes actually written (holes are not written); a dir entry
  that repeats a subtree id is expanded again and counted again, so a tree cannot multiply
  its size by sharing subtrees. Exceeding one raises ``ArchiveLimitError(limit, cap,
  observed)`` before the entry or chunk is written.
- setuid and setgid bits are dropped; uid/gid are applied only when running as root.

Order: directories are created 0700 and get their mode, xattrs and mtime when their last
entry is written (post-order, so deepest first, and read-only directories round-trip); a
file gets its metadata right after its content; symlink mtimes are set without following.
Sparse files: an all-zero chunk is skipped with a seek, and the file is truncated to its
size at the end, so holes stay holes.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import chunker
from .errors import (
    ArchiveEntryError,
    ArchiveLimitError,
    DestNotEmptyError,
    IntegrityError,
    MaterializeError,
    NotDirError,
    ObjectNotFoundError,
    SnapshotError,
)
from .objects import Store
from .pack import Location
from .ref import ObjectId, Ref, object_id
from .snapshot import compute_ref_fd
from .tree import PATH_MAX, Entry, Kind, decode_tree, encode_tree

DEFAULT_MAX_ENTRIES = 1_048_576
DEFAULT_MAX_BYTES = 8 << 30

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FIFO_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DROP_BITS = stat.S_ISUID | stat.S_ISGID

Progress = Callable[[int, int], None]
"""``progress(entries_done, bytes_done)``: entries and content bytes written so far."""


@dataclass(frozen=True, slots=True)
class MaterializeResult:
    """What ``materialize`` did: entries created, content bytes written, sockets skipped,
    whether the destination already held the tree (then nothing was written), and device
    nodes skipped (not running as root)."""

    entries: int
    bytes: int
    sockets_skipped: int
    already_equal: bool
    devices_skipped: int = 0


# -- the destination -------------------------------------------------------------------


def _is_symlink(dir_fd: int, name: bytes) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_parent(dest: str, ref: Ref) -> tuple[int, bytes]:
    """Open the parent of ``dest`` walking from ``/`` without following any symlink;
    return (fd, final component)."""
    path = os.path.abspath(dest)
    parts = [p for p in os.fsencode(path).split(b"/") if p]
    if not parts:
        raise NotDirError(dest)  # "/" is never an empty destination
    fd = os.open("/", _DIR_FLAGS)
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                shown = os.fsdecode(b"/" + b"/".join(parts[:i + 1]))
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(fd, part):
                    cause = f"{shown} is a symbolic link; give a path without symlinks"
                    raise MaterializeError(str(ref), dest, cause) from None
                raise MaterializeError(str(ref), dest, f"{shown}: {e.strerror}") from None
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


# -- extraction ------------------------------------------------------------------------


_MAX_OPEN_DIRS = 64
"""Directory fds held open along the current path at most (extraction and wipe alike): a
deeper tree reopens the ancestors it returns to, so depth never runs out of fds."""


@dataclass(slots=True, eq=False)
class _Level:
    """One directory on the current path: its fd (-1 while parked), its name in its parent
    and its (st_dev, st_ino), which a reopened fd must show again."""

    fd: int
    name: bytes | str
    ident: tuple[int, int]


def _park(levels: list[_Level]) -> None:
    """Close the fds of the shallowest levels (never the first, nor the last) until at
    most ``_MAX_OPEN_DIRS`` are open."""
    open_ = [i for i in range(1, len(levels) - 1) if levels[i].fd >= 0]
    for i in open_[:max(0, len(open_) + 1 - _MAX_OPEN_DIRS)]:
        os.close(levels[i].fd)
        levels[i].fd = -1


def _reopen(levels: list[_Level], i: int) -> int:
    """Open ``levels[i]`` and the parked levels above it again, from the nearest open
    ancestor, one component at a time without following symlinks; each must be the same
    directory as before (else OSError: the tree was changed under us)."""
    j = i
    while levels[j].fd < 0:
        j -= 1
    fd = levels[j].fd
    for k in range(j + 1, i + 1):
        lv = levels[k]
        fd = os.open(lv.name, _DIR_FLAGS, dir_fd=fd)
        lv.fd = fd
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != lv.ident:
            raise OSError(errno.ESTALE, "directory replaced while it was being written",
                          os.fsdecode(lv.name))
        # Keep only the deepest ones open: they are the ones returned to next.
        old = k - _MAX_OPEN_DIRS + 1
        if old > j and old > 0 and levels[old].fd >= 0:
            os.close(levels[old].fd)
            levels[old].fd = -1
    return fd


def _close_levels(levels: list[_Level], keep: int) -> None:
    for lv in levels:
        if lv.fd >= 0 and lv.fd != keep:
            os.close(lv.fd)
        lv.fd = -1


@dataclass(slots=True, eq=False)
class _Open(_Level):
    """A directory being filled: its fd and the entry whose metadata it gets at the end."""

    rel: bytes = b""
    entries: tuple[Entry, ...] = ()
    pos: int = 0
    meta: Entry | None = None  # None for the destination itself


@dataclass(slots=True)
class _Extractor:
    store: Store
    ref: Ref
    max_entries: int
    max_bytes: int
    progress: Progress | None
    dest_fd: int = -1
    as_root: bool = field(default_factory=lambda: os.geteuid() == 0)
    entries: int = 0
    written: int = 0
    sockets: int = 0
    devices: int = 0
    # hard-link group id -> (root-relative path, (dev, ino), the first member's entry)
    links: dict[bytes, tuple[bytes, tuple[int, int], Entry]] = field(default_factory=dict)
    # where the chunks and child trees of the directories being filled are stored, found
    # with one query per directory; each is dropped when used (a repeat is located again)
    locs: dict[bytes, Location] = field(default_factory=dict)

    def tree(self, tree_id: ObjectId, rel: bytes) -> tuple[Entry, ...]:
        try:
            entries = self.store.get_tree(tree_id, self.locs.pop(tree_id, None)).entries
        except ObjectNotFoundError:
            where = os.fsdecode(rel) or "."
            raise IntegrityError(str(self.ref), f"tree {tree_id.hex()} of {where!r} is "
                                 "missing from the store") from None
        want: list[ObjectId] = []
        zero = chunker.zero_chunk_id(self.store.chunk_size)
        for e in entries:
            if e.kind is Kind.FILE:
                want.extend(c for c in e.chunks.distinct() if c != zero)
            elif e.kind is Kind.DIR and e.tree_id is not None:
                want.append(e.tree_id)
        if want:
            self.locs.update(self.store.locate_many(want))
        return entries

    def run(self, dest_fd: int) -> None:
        st = os.fstat(dest_fd)
        stack = [_Open(dest_fd, b"", (st.st_dev, st.st_ino), b"",
                       self.tree(self.ref.tree_id, b""))]
        levels: list[_Level] = stack  # type: ignore[assignment]
        try:
            while stack:
                d = stack[-1]
                if d.fd < 0:
                    _reopen(levels, len(stack) - 1)
                if d.pos < len(d.entries):
                    e = d.entries[d.pos]
                    d.pos += 1
                    child = self.entry(d, e)
                    if child is not None:
                        stack.append(child)
                        _park(levels)
                    continue
                stack.pop()
                if d.meta is not None:
                    try:
                        self.apply_meta(d.fd, d.meta, d.rel)
                    finally:
                        os.close(d.fd)
                        d.fd = -1
        finally:
            _close_levels(levels, dest_fd)

    def count(self) -> None:
        self.entries += 1
        if self.entries > self.max_entries:
            raise ArchiveLimitError("entries", self.max_entries, self.entries)

    def entry(self, d: _Open, e: Entry) -> _Open | None:
        rel = d.rel + b"/" + e.name if d.rel else e.name
        if len(rel) > PATH_MAX:
            raise ArchiveEntryError(os.fsdecode(rel[:64]) + "...",
                                    f"path is {len(rel)} bytes, over {PATH_MAX}")
        self.count()
        if e.xattrs and e.kind not in (Kind.FILE, Kind.DIR):
            raise ArchiveEntryError(os.fsdecode(rel), "only files and directories carry "
                                    "user xattrs")
        for k, _ in e.xattrs:
            if not k.startswith(b"user.") or len(k) <= 5 or b"\0" in k or len(k) > 255:
                raise ArchiveEntryError(os.fsdecode(rel), f"xattr name {k!r} is not user.*")
        if e.link_group is not None and e.kind is Kind.DIR:
            raise ArchiveEntryError(os.fsdecode(rel), "a directory cannot be hard-linked")
        if (e.link_group is not None and e.link_group in self.links
                and e.kind is not Kind.DIR):
            self.link(d, e, rel)
            if self.progress is not None:
                self.progress(self.entries, self.written)
            return None
        if e.kind is Kind.DIR:
            assert e.tree_id is not None
            entries = self.tree(e.tree_id, rel)
            os.mkdir(e.name, 0o700, dir_fd=d.fd)
            fd = os.open(e.name, _DIR_FLAGS, dir_fd=d.fd)
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            return _Open(fd, e.name, (st.st_dev, st.st_ino), rel, entries, meta=e)
        if e.kind is Kind.FILE:
            self.file(d, e, rel)
        elif e.kind is Kind.SYMLINK:
            if not e.target or b"\0" in e.target or len(e.target) >= PATH_MAX:
                raise ArchiveEntryError(os.fsdecode(rel), "symlink target is empty, too long "
                                        "or holds NUL")
            os.symlink(e.target, e.name, dir_fd=d.fd)
            if self.as_root:
                os.chown(e.name, e.uid, e.gid, dir_fd=d.fd, follow_symlinks=False)
            os.utime(e.name, ns=(time.time_ns(), e.mtime_ns), dir_fd=d.fd,
                     follow_symlinks=False)
            self.first_link(d, e, rel)
        elif e.kind is Kind.FIFO:
            os.mkfifo(e.name, 0o600, dir_fd=d.fd)
            fd = os.open(e.name, _FIFO_FLAGS, dir_fd=d.fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISFIFO(st.st_mode):
                    raise OSError(errno.EEXIST, "replaced while being created", rel)
                self.apply_meta(fd, e, rel)
                if e.link_group is not None:
                    self.links[e.link_group] = (rel, (st.st_dev, st.st_ino), e)
            finally:
                os.close(fd)
        elif e.kind is Kind.SOCKET:
            self.sockets += 1
        elif e.kind.is_device:
            if self.as_root:
                self.device(d, e, rel)
                self.first_link(d, e, rel)
            else:
                self.devices += 1
        if self.progress is not None:
            self.progress(self.entries, self.written)
        return None

    def file(self, d: _Open, e: Entry, rel: bytes) -> None:
        cs = self.store.chunk_size
        fd = os.open(e.name, _NEW_FILE_FLAGS, 0o600, dir_fd=d.fd)
        try:
            off = 0
            pos = 0  # the file offset
            # Per run of one id (the holes of a sparse file are one run): read it once.
            for first, k, cid in e.chunks.spans():
                want = chunker.chunk_length(first, e.size, cs)
                if want == cs and cid == chunker.zero_chunk_id(cs):
                    off += want * k
                    continue
                try:
                    data = self.store.read_object(cid, self.locs.pop(cid, None))
                except ObjectNotFoundError:
                    raise IntegrityError(str(self.ref), f"chunk {cid.hex()} of "
                                         f"{os.fsdecode(rel)!r} is missing") from None
                if off + len(data) * k > e.size:
                    raise IntegrityError(str(self.ref), f"{os.fsdecode(rel)!r} has more "
                                         f"content than its size {e.size}")
                if chunker.is_zero(data):
                    off += len(data) * k
                    continue
                for _ in range(k):
                    if self.written + len(data) > self.max_bytes:
                        raise ArchiveLimitError("bytes", self.max_bytes,
                                                self.written + len(data))
                    if pos != off:
                        os.lseek(fd, off, os.SEEK_SET)
                    view = memoryview(data)
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                    off += len(data)
                    pos = off
                    self.written += len(data)
            if off != e.size:
                raise IntegrityError(str(self.ref), f"{os.fsdecode(rel)!r} has {off} bytes of "
                                     f"content, its entry says {e.size}")
            if pos != off:
                os.ftruncate(fd, off)
            self.apply_meta(fd, e, rel)
            if e.link_group is not None:
                st = os.fstat(fd)
                self.links[e.link_group] = (rel, (st.st_dev, st.st_ino), e)
        finally:
            os.close(fd)

    def device(self, d: _Open, e: Entry, rel: bytes) -> None:
        """mknod(2) a block or character device (as root); never opened, so its metadata
        goes by name, checked to be the node just made."""
        os.mknod(e.name, e.kind.s_ifmt | 0o600, e.rdev, dir_fd=d.fd)
        st = os.stat(e.name, dir_fd=d.fd, follow_symlinks=False)
        if stat.S_IFMT(st.st_mode) != e.kind.s_ifmt or st.st_rdev != e.rdev:
            raise OSError(errno.EEXIST, "replaced while being created", rel)
        os.chown(e.name, e.uid, e.gid, dir_fd=d.fd, follow_symlinks=False)
        os.chmod(e.name, e.mode & ~_DROP_BITS & 0o7777, dir_fd=d.fd)
        os.utime(e.name, ns=(time.time_ns(), e.mtime_ns), dir_fd=d.fd,
                 follow_symlinks=False)

    def first_link(self, d: _Open, e: Entry, rel: bytes) -> None:
        """Record the node just made by name for entry ``e`` as its hard-link group's
        first member (a no-op outside a group); checked to be of ``e``'s kind."""
        if e.link_group is None:
            return
        st = os.stat(e.name, dir_fd=d.fd, follow_symlinks=False)
        if stat.S_IFMT(st.st_mode) != e.kind.s_ifmt:
            raise OSError(errno.EEXIST, "replaced while being created", rel)
        self.links[e.link_group] = (rel, (st.st_dev, st.st_ino), e)

    def link(self, d: _Open, e: Entry, rel: bytes) -> None:
        """A further name of a hard-link group whose first member was written (a group
        of sockets, or of devices when not root, was skipped whole: never linked)."""
        assert e.link_group is not None
        first_rel, ident, first = self.links[e.link_group]
        if (e.kind, e.mode, e.uid, e.gid, e.mtime_ns, e.size, e.chunks, e.xattrs, e.target,
                e.rdev) != (first.kind, first.mode, first.uid, first.gid, first.mtime_ns,
                            first.size, first.chunks, first.xattrs, first.target, first.rdev):
            raise ArchiveEntryError(os.fsdecode(rel), "hard-link group members differ from "
                                    f"{os.fsdecode(first_rel)!r}")
        os.link(first_rel, e.name, src_dir_fd=self.dest_fd, dst_dir_fd=d.fd,
                follow_symlinks=False)
        st = os.stat(e.name, dir_fd=d.fd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != ident:
            raise OSError(errno.EEXIST, "hard-link source was replaced while linking", rel)

    def apply_meta(self, fd: int, e: Entry, rel: bytes) -> None:
        """Owner (as root), xattrs, mode without setuid/setgid, then mtime, on an open fd."""
        if self.as_root:
            os.fchown(fd, e.uid, e.gid)
        for k, v in e.xattrs:
            os.setxattr(fd, k, v)
        os.fchmod(fd, e.mode & ~_DROP_BITS & 0o7777)
        os.utime(fd, ns=(time.time_ns(), e.mtime_ns))


# -- the wipe --------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Emptying(_Level):
    """A directory being emptied by the wipe, with the names still to remove."""

    names: list[str] = field(default_factory=list)


def _wipe_into(fd: int) -> None:
    """Remove everything inside the directory open at ``fd`` without following symlinks;
    directories are made writable first so read-only ones can be emptied. At most
    ``_MAX_OPEN_DIRS`` fds are held, however deep the tree."""
    st = os.fstat(fd)
    stack = [_Emptying(fd, "", (st.st_dev, st.st_ino), os.listdir(fd))]
    levels: list[_Level] = stack  # type: ignore[assignment]
    try:
        while stack:
            top = stack[-1]
            if top.fd < 0:
                _reopen(levels, len(stack) - 1)
            if not top.names:
                stack.pop()
                if stack:
                    os.close(top.fd)
                    top.fd = -1
                    parent = stack[-1]
                    if parent.fd < 0:
                        _reopen(levels, len(stack) - 1)
                    os.rmdir(parent.names.pop(), dir_fd=parent.fd)
                continue
            name = top.names[-1]
            try:
                cst = os.stat(name, dir_fd=top.fd, follow_symlinks=False)
            except FileNotFoundError:
                top.names.pop()
                continue
            if stat.S_ISDIR(cst.st_mode):
                cfd = os.open(name, _DIR_FLAGS, dir_fd=top.fd)
                try:
                    os.fchmod(cfd, 0o700)
                    cst = os.fstat(cfd)
                    stack.append(_Emptying(cfd, name, (cst.st_dev, cst.st_ino),
                                           os.listdir(cfd)))
                except BaseException:
                    os.close(cfd)
                    raise
                _park(levels)
                continue
            os.unlink(name, dir_fd=top.fd)
            top.names.pop()
    finally:
        _close_levels(levels, fd)


def _wipe(parent_fd: int, name: bytes, dest_fd: int, created: bool,
          dest_st: os.stat_result) -> OSError | None:
    """Undo an extraction; return the error that stopped the wipe, if any."""
    try:
        _wipe_into(dest_fd)
        if created:
            os.rmdir(name, dir_fd=parent_fd)
        else:
            os.utime(dest_fd, ns=(dest_st.st_atime_ns, dest_st.st_mtime_ns))
    except OSError as e:
        return e
    return None


# -- public API ------------------------------------------------------------------------


def materialize(store: Store, ref: Ref | str, dest: str | os.PathLike[str], *,
                max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES,
                progress: Progress | None = None) -> MaterializeResult:
    """Write snapshot ``ref`` out at ``dest`` (see the module docstring for the three cases,
    the errors and the hardening). ``max_bytes`` is in bytes of content written.

    Raises ObjectNotFoundError (before touching anything) if ``ref``'s root tree is not in
    the store; NotDirError, DestNotEmptyError, MaterializeError, IntegrityError,
    ArchiveEntryError, ArchiveLimitError as described above.
    """
    ref = Ref.parse(ref)
    shown = os.fspath(dest)
    if not isinstance(shown, str):
        shown = os.fsdecode(shown)
    store.root_tree(ref)  # RefNotFoundError / IntegrityError before any write
    sroot, target = os.path.realpath(store.root), os.path.abspath(shown)
    if target == sroot or target.startswith(sroot.rstrip("/") + "/"):
        raise MaterializeError(str(ref), shown, "the destination is inside the store")
    parent_fd, name = _open_parent(shown, ref)
    try:
        return _materialize_at(store, ref, shown, parent_fd, name, max_entries, max_bytes,
                               progress)
    finally:
        os.close(parent_fd)


def _materialize_at(store: Store, ref: Ref, shown: str, parent_fd: int, name: bytes,
                    max_entries: int, max_bytes: int,
                    progress: Progress | None) -> MaterializeResult:
    created = False
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        try:
            os.mkdir(name, 0o777, dir_fd=parent_fd)
        except OSError as e:
            raise MaterializeError(str(ref), shown, e.strerror or str(e)) from None
        created = True
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except OSError as e:
        raise MaterializeError(str(ref), shown, e.strerror or str(e)) from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotDirError(shown)
    try:
        dest_fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotDirError(shown) from None
        raise MaterializeError(str(ref), shown, e.strerror or str(e)) from None
    try:
        dest_st = os.fstat(dest_fd)
        if (dest_st.st_dev, dest_st.st_ino) != (st.st_dev, st.st_ino):
            raise MaterializeError(str(ref), shown, "destination replaced while opening it")
        if os.listdir(dest_fd):
            if created:
                raise MaterializeError(str(ref), shown, "destination filled by someone else")
            return _compare(store, ref, shown, dest_fd)
        x = _Extractor(store, ref, max_entries, max_bytes, progress, dest_fd)
        try:
            x.run(dest_fd)
        except BaseException as exc:
            stuck = _wipe(parent_fd, name, dest_fd, created, dest_st)
            if stuck is not None:
                raise MaterializeError(str(ref), shown, f"{exc}; and the destination could "
                                       f"not be wiped, remove it by hand: {stuck}") from exc
            if isinstance(exc, OSError):
                raise MaterializeError(str(ref), shown, exc) from exc
            raise
        return MaterializeResult(x.entries, x.written, x.sockets, already_equal=False,
                                 devices_skipped=x.devices)
    finally:
        os.close(dest_fd)


def _compare(store: Store, ref: Ref, shown: str, dest_fd: int) -> MaterializeResult:
    """``already_equal`` if the directory open at ``dest_fd`` holds what an extraction of
    ``ref`` by this process writes (see ``_as_written``), else DestNotEmptyError. Not as
    root, an entry this user owns but may not read (mode 0000, as an extraction leaves a
    file or directory recorded so) is read through ``_compute_as_owner``."""
    trees: dict[ObjectId, bytes] = {}
    try:
        got = compute_ref_fd(dest_fd, shown, store.chunk_size, trees)
    except SnapshotError as e:
        cause = e.cause
        again = None
        if e.err == errno.EACCES and os.geteuid() != 0:
            found = _compute_as_owner(dest_fd, shown, store.chunk_size)
            if isinstance(found, str):
                cause = found
            elif found is None:
                cause += ("; this user may not read it, and no user namespace of its own "
                          "(where it could) can be made here: run as root, or give it "
                          "read permission")
            else:
                again = found
        if again is None:
            raise DestNotEmptyError(shown, str(ref), f"an unreadable tree ({cause})") from None
        got, trees = again
    if got != ref:
        as_root = os.geteuid() == 0
        skip = {Kind.SOCKET} if as_root else {Kind.SOCKET, Kind.BLOCK, Kind.CHAR}
        want = _as_written(lambda t: store.get_tree(t).entries, ref.tree_id, skip, as_root)
        have = _as_written(lambda t: decode_tree(trees[t], t.hex()).entries, got.tree_id,
                           set(), as_root)
        if want != have:
            raise DestNotEmptyError(shown, str(ref), str(got))
    return MaterializeResult(0, 0, 0, already_equal=True)


_CLONE_NEWUSER = 0x10000000


def _compute_as_owner(dest_fd: int, shown: str, chunk_size: int
                      ) -> tuple[Ref, dict[ObjectId, bytes]] | str | None:
    """``compute_ref_fd`` of the directory open at ``dest_fd`` (with its trees), computed
    in a child process that entered a user namespace of its own mapping only this user, as
    its root: there it may read and list what this user owns whatever the modes
    (CAP_DAC_OVERRIDE over inodes whose owner the namespace maps; user_namespaces(7)), and
    nothing else; nothing is written or changed. A string: why the tree is still
    unreadable there (an entry of another user); None where no such namespace can be made
    (unprivileged user namespaces switched off, or refused by a seccomp filter)."""
    import ctypes
    import pickle

    uid, gid = os.getuid(), os.getgid()
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # pragma: no cover - the child
        code = 3  # no namespace
        try:
            os.close(r)
            if ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER) != 0:
                os._exit(code)
            for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                               ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            code = 1  # failed in it
            trees: dict[ObjectId, bytes] = {}
            try:
                out: object = (str(compute_ref_fd(dest_fd, shown, chunk_size, trees)), trees)
            except SnapshotError as e:
                out = e.cause
            data = pickle.dumps(out)
            while data:
                data = data[os.write(w, data):]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    try:
        while chunk := os.read(r, 1 << 20):
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 3:
        return None
    if code != 0:
        return f"the compare in a user namespace failed (exit {code})"
    got = pickle.loads(b"".join(chunks))
    if isinstance(got, str):
        return got
    return Ref.parse(got[0]), got[1]


def _as_written(entries_of: Callable[[ObjectId], tuple[Entry, ...]], root: ObjectId,
                skip: set[Kind], owners: bool) -> ObjectId:
    """The id the tree ``root`` (its trees read with ``entries_of``) has once reduced to
    what an extraction writes: without entries of the kinds in ``skip``, without setuid
    and setgid bits, and (``owners`` False: not running as root, so every entry is owned
    by the extracting user) with every uid and gid 0. Computed, nothing written; a
    subtree the reduction leaves alone keeps its id, so only changed directories are
    encoded again."""
    done: dict[ObjectId, ObjectId] = {}
    stack: list[tuple[ObjectId, bool]] = [(root, False)]
    while stack:
        tid, expanded = stack.pop()
        if tid in done:
            continue
        entries = entries_of(tid)
        subs = [e.tree_id for e in entries if e.kind is Kind.DIR and e.tree_id is not None]
        if not expanded:
            stack.append((tid, True))
            stack.extend((c, False) for c in subs if c not in done)
            continue
        kept = []
        for e in entries:
            if e.kind in skip:
                continue
            r = e
            if e.kind is Kind.DIR and e.tree_id is not None and done[e.tree_id] != e.tree_id:
                r = replace(r, tree_id=done[e.tree_id])
            if e.mode & _DROP_BITS:
                r = replace(r, mode=e.mode & ~_DROP_BITS)
            if not owners and (e.uid or e.gid):
                r = replace(r, uid=0, gid=0)
            kept.append(r)
        if len(kept) == len(entries) and all(a is b for a, b in zip(kept, entries, strict=True)):
            done[tid] = tid
        else:
            done[tid] = object_id(encode_tree(kept))
    return done[root]
