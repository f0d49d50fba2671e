"""Import a real directory into the store as a snapshot (CONTRACT 1.4).

Owns the directory walk that turns a tree on disk into chunks and trees, the files cache
that lets an unchanged file be skipped without reading it, the use of the dirs cache
(dircache.py) that lets an unchanged directory be taken without opening its entries, and
``compute_ref``, the same walk with nothing written. It must never follow a symlink inside
the tree, never open a device (block and character devices are recorded by kind and
``st_rdev`` alone), and never return a Ref for a tree that changed while it was read.

How the walk stays safe and bounded:

- Every directory is opened relative to its parent's fd with ``O_NOFOLLOW | O_DIRECTORY``
  and every file with ``O_NOFOLLOW | O_NONBLOCK``; an fstat after opening must show the
  same inode as the listing, and a file is fstat'ed again after reading: any difference
  (size, mtime, ctime, inode) is ``SnapshotError(root, cause)``. So is a directory whose
  mtime or ctime moved while its entries were read, an unreadable entry, a
  tree that holds the store or lies inside it, and a store that cannot be written (a full
  disk): nothing written is then referenced.
- Memory: one open directory (fd and listing) per level of depth (so a tree deeper than
  the process's fd limit fails closed with "Too many open files"), one chunk of content at a
  time (plus at most ``_INFLIGHT`` chunks queued for compression), the entries of the
  directories on the path to a hard-linked file (below), and the dirs cache rows under the
  root when there are at most ``_PREFETCH_ROWS`` of them (else they are read per directory).
- Hard links: a non-directory of any kind (file, symlink, fifo, socket, device) with
  ``st_nlink > 1`` seen at two or more places in the tree is a hard-link group whose id is ``blake3(b"\\0".join(sorted member paths))``, the paths
  root-relative and ``/``-joined. Whether a file has a partner in the tree is known only at
  the end of the walk, so a directory holding such a file (and its ancestors) is encoded
  after the walk; every other directory is encoded as soon as its last entry is done. A
  file whose other links are all outside the tree is not a group.
- The root directory's own metadata is not part of the Ref (a Ref is the root tree's id).

Files cache (table ``files_cache``, keyed by the absolute path as bytes): a row records the
size, mtime, ctime and inode a file had when it was read and the chunk ids read. A later
snapshot uses the row instead of reading the file only when all four match, both mtime and
ctime are older than the row's ``trusted_before_ns``, and every chunk is still in the index
(or pending in this snapshot's writer). The rows of one directory's files, and which of
their chunks are indexed, are read with one query each when the directory's first file is
met. A trusted file is still opened (for its fstat and its xattrs) but not read.
``trusted_before_ns`` is the recording snapshot's start on the kernel's coarse clock (the one
file timestamps come from), rounded down to a whole second so that file systems with 1 s
timestamps are covered too: a file written in the same timestamp tick as it was read can
therefore never be trusted later, and a same-size rewrite within that tick is always seen.

Write order (CONTRACT 1.3): chunks and trees go through one ``Writer``; ``commit`` makes the
packs durable and indexes them; the snapshot is listed after that, inside the writer's
``with`` block (which holds the GC lock shared). Cache rows may be written earlier: they are
only trusted once what they name (chunks; a tree for the dirs cache) is found in the index.

Dirs cache: see dircache.py for the rules. In the walk, a directory whose row's stat digest
matches becomes a candidate: only its subdirectories are walked; if they give the row's
children digest, its tree id is the row's and its other entries are never opened; if not,
they are walked after all. A candidate without subdirectories is finished on the spot,
without a ``_Dir``. Rows are recorded for directories just encoded, under the same-tick rule.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import blake3
import zstandard

from . import chunker, dircache
from .catalog import write_transaction
from .errors import BackendError, SnapshotError
from .objects import Store, Writer
from .pack import Codec, ObjKind, encode_chunk
from .ref import DIGEST_SIZE, ObjectId, Ref, object_id
from .tree import V1_REPEATS_MAX, ChunkList, Entry, Kind, encode_tree

Progress = Callable[[int, int], None]
"""``progress(files_done, bytes_done)``: files and logical content bytes done so far."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CLOCK_REALTIME_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)
_GROUP_THRESHOLD = 64 << 10  # objects below this are grouped by PackBuilder, compressed there
_INFLIGHT = 4  # large chunks queued for compression at most
_CACHE_BATCH = 2048  # files cache rows per transaction
_PREFETCH_ROWS = 65536  # dirs cache rows read in one query at most (about 30 MB)
_XATTR_UNSUPPORTED = {errno.ENOTSUP, errno.EOPNOTSUPP}


@dataclass(slots=True)
class SnapshotResult:
    """What one snapshot did. Sizes in bytes."""

    ref: Ref
    files: int = 0  # regular files in the tree (each hard link counted)
    dirs: int = 0  # directories below the root
    bytes: int = 0  # logical content bytes of the files
    files_read: int = 0  # files whose content was read (not taken from the files cache)
    dirs_cached: int = 0  # directories taken whole from the dirs cache (entries not opened)
    bytes_read: int = 0  # content bytes read from disk
    packs_written: int = 0
    stored_bytes: int = 0  # pack bytes written


def trust_horizon_ns() -> int:
    """The ``trusted_before_ns`` of a snapshot starting now (see the module docstring)."""
    now = time.clock_gettime_ns(_CLOCK_REALTIME_COARSE)
    return now - now % 1_000_000_000


def link_group_id(paths: list[bytes]) -> bytes:
    """The id of a hard-link group: blake3 of its sorted root-relative member paths,
    joined by NUL (which no path contains)."""
    return blake3.blake3(b"\0".join(sorted(paths))).digest()


# -- sinks: where chunks and trees go --------------------------------------------------


class _HashSink:
    """Computes ids only; writes nothing to the store (``compute_ref``). ``trees``, when
    given, receives every encoded tree by id."""

    def __init__(self, trees: dict[ObjectId, bytes] | None = None) -> None:
        self._trees = trees

    def chunk(self, data: bytes) -> ObjectId:
        return object_id(data)

    def zero(self, length: int) -> ObjectId:
        return chunker.zero_chunk_id(length)

    def tree(self, entries: list[Entry]) -> ObjectId:
        data = encode_tree(entries)
        oid = object_id(data)
        if self._trees is not None:
            self._trees[oid] = data
        return oid

    def have(self, ids: list[ObjectId]) -> bool:
        return False

    def finish(self) -> None:
        return None

    def abort(self) -> None:
        return None


class _StoreSink:
    """Puts chunks and trees into a Writer; large new chunks are compressed by a pool of
    worker threads (zstd releases the GIL) while the walk reads on."""

    def __init__(self, writer: Writer, level: int, workers: int) -> None:
        self.w = writer
        self._level = level
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(workers, "rewindfs-compress") if workers else None
        self._queue: deque[tuple[ObjectId, bytes, Future[tuple[Codec, bytes]]]] = deque()
        self._inflight: set[bytes] = set()

    def _encode(self, oid: ObjectId, data: bytes) -> tuple[Codec, bytes]:
        c = getattr(self._local, "cctx", None)
        if c is None:
            c = self._local.cctx = zstandard.ZstdCompressor(level=self._level)
        return encode_chunk(oid, data, c)

    def chunk(self, data: bytes) -> ObjectId:
        oid = object_id(data)
        if oid in self._inflight:
            return oid
        if self._pool is None or len(data) < _GROUP_THRESHOLD:
            self.w.put(oid, ObjKind.CHUNK, data)  # looked up with others (Writer)
            return oid
        if self.w.known(oid):  # asked first: compressing a stored chunk would be wasted
            return oid
        self._inflight.add(oid)
        self._queue.append((oid, data, self._pool.submit(self._encode, oid, data)))
        while len(self._queue) > _INFLIGHT:
            self._drain_one()
        return oid

    def zero(self, length: int) -> ObjectId:
        oid = chunker.zero_chunk_id(length)
        if oid not in self._inflight and not self.w.known(oid):
            self.w.put(oid, ObjKind.CHUNK, chunker.zeros(length), unknown=True)
        return oid

    def _drain_one(self) -> None:
        oid, data, fut = self._queue.popleft()
        self.w.put(oid, ObjKind.CHUNK, data, encoded=fut.result(), unknown=True)
        self._inflight.discard(oid)

    def tree(self, entries: list[Entry]) -> ObjectId:
        return self.w.put_tree(entries)

    def have(self, ids: list[ObjectId]) -> bool:
        return all(i in self._inflight or self.w.known(i) for i in ids)

    def finish(self) -> None:
        while self._queue:
            self._drain_one()
        if self._pool is not None:
            self._pool.shutdown()

    def abort(self) -> None:
        self._queue.clear()
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


# -- the walk ------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Dir:
    """A directory being walked, or one whose encoding waits for hard-link groups."""

    fd: int
    rel: bytes  # root-relative path, b"" for the root
    st: os.stat_result
    xattrs: tuple[tuple[bytes, bytes], ...]
    names: list[tuple[bytes, int]]  # (name, type hint) of the entries to walk
    pos: int = 0
    entries: list[Entry] = field(default_factory=list)
    # (index in entries, _Dir whose tree id is pending, or (dev, ino) of a linked file)
    late: list[tuple[int, object]] = field(default_factory=list)
    tree_id: ObjectId | None = None
    # files cache rows of this directory's files by name, and which of their chunks the
    # index holds; loaded with one query each when the first file is met
    cache: dict[bytes, tuple[int, int, int, int, bytes, int]] | None = None
    present: set[bytes] = field(default_factory=set)
    # -- dirs cache (dircache.py), only when recording into a store --
    row: dircache.Row | None = None  # this directory's row, its tree indexed
    lstats: dict[bytes, os.stat_result] | None = None  # lstat of each non-directory entry
    # the row's stat digest matched: ``names`` holds only the subdirectories, the other
    # entries wait in ``deferred`` until the subdirectories confirm the row or not
    hit: bool = False
    deferred: list[tuple[bytes, int]] = field(default_factory=list)
    child_rows: dict[bytes, dircache.Row] | None = None  # rows of the subdirectories
    used: list[tuple[bytes, os.stat_result]] = field(default_factory=list)  # stat encoded


_HINT_DIR, _HINT_FILE, _HINT_OTHER = 1, 2, 3


def _hint(mode: int) -> int:
    if stat.S_ISDIR(mode):
        return _HINT_DIR
    return _HINT_FILE if stat.S_ISREG(mode) else _HINT_OTHER


class _Walker:
    def __init__(self, root_fd: int, root_shown: str, sink: _HashSink | _StoreSink, *,
                 chunk_size: int, store: Store | None = None, cache_prefix: bytes | None = None,
                 horizon_ns: int = 0, progress: Progress | None = None) -> None:
        self.root_fd = root_fd
        self.shown = root_shown
        self.sink = sink
        self.cs = chunk_size
        self.store = store
        self.cache_prefix = cache_prefix
        self.horizon = horizon_ns
        self.progress = progress
        self.store_id: tuple[int, int] | None = None
        if store is not None:
            s = os.stat(store.root)
            self.store_id = (s.st_dev, s.st_ino)
        # (dev, ino) -> [root-relative paths] of files with st_nlink > 1
        self.links: dict[tuple[int, int], list[bytes]] = {}
        # (dev, ino) -> (size, mtime_ns, ctime_ns, chunks, xattrs) of such files, read once
        self.link_content: dict[tuple[int, int], tuple[int, int, int, ChunkList,
                                                       tuple[tuple[bytes, bytes], ...]]] = {}
        self.cache_rows: list[tuple[bytes, int, int, int, int, bytes, int]] = []
        self.dir_rows: list[tuple[bytes, dircache.Row, int]] = []
        self.use_dirs_cache = store is not None and cache_prefix is not None
        # On a shared catalog the object index is not in the local SQLite file that holds
        # the files and dirs caches: presence is asked of the catalog, one query per batch.
        self._present: dircache.Present | None = None
        if store is not None and store.catalog.shared:
            catalog = store.catalog
            self._present = lambda ids: catalog.locate_many(list(ids)).keys()
        # every dirs cache row under the root, read in one query when there are few enough
        self.all_rows: dict[bytes, dircache.Row] | None = None
        self.result = SnapshotResult(Ref(ObjectId(bytes(DIGEST_SIZE))))

    def fail(self, rel: bytes, why: str, err: int | None = None) -> SnapshotError:
        return SnapshotError(self.shown, f"{os.fsdecode(rel) or '.'}: {why}", err=err)

    def oserror(self, rel: bytes, e: OSError) -> SnapshotError:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            return self.fail(rel, "changed while read (entry vanished or was replaced)")
        return self.fail(rel, e.strerror or str(e), e.errno)

    # -- listing and metadata ------------------------------------------------------

    def _list(self, fd: int, rel: bytes, with_lstats: bool
              ) -> tuple[list[tuple[bytes, int]], dict[bytes, os.stat_result] | None]:
        """The directory's (name, type hint) pairs and, ``with_lstats`` (a dirs cache row to
        check), the lstat of every entry that is not a directory."""
        out = []
        lstats: dict[bytes, os.stat_result] | None = {} if with_lstats else None
        try:
            with os.scandir(fd) as it:
                for de in it:
                    name = os.fsencode(de.name)
                    if de.is_dir(follow_symlinks=False):
                        hint = _HINT_DIR
                    elif lstats is not None:
                        st = de.stat(follow_symlinks=False)
                        hint = _hint(st.st_mode)
                        if hint != _HINT_DIR:
                            lstats[name] = st
                    elif de.is_file(follow_symlinks=False):
                        hint = _HINT_FILE
                    else:
                        hint = _HINT_OTHER
                    out.append((name, hint))
        except OSError as e:
            raise self.oserror(rel, e) from None
        return out, lstats

    def _xattrs(self, fd: int, rel: bytes) -> tuple[tuple[bytes, bytes], ...]:
        try:
            names = os.listxattr(fd)
        except OSError as e:
            if e.errno in _XATTR_UNSUPPORTED:
                return ()
            raise self.oserror(rel, e) from None
        out = []
        for n in names:
            if not n.startswith("user."):
                continue
            try:
                out.append((os.fsencode(n), os.getxattr(fd, n)))
            except OSError as e:
                if e.errno == errno.ENODATA:
                    raise self.fail(rel, "changed while read (xattr vanished)") from None
                raise self.oserror(rel, e) from None
        out.sort()
        return tuple(out)

    def _open_dir(self, parent: _Dir, name: bytes, rel: bytes) -> _Dir | None:
        """Open the subdirectory ``name`` of ``parent`` for walking; or, if it is a dirs
        cache hit without subdirectories, add its entry to ``parent`` and return None."""
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent.fd)
        except OSError as e:
            raise self.oserror(rel, e) from None
        try:
            st = os.fstat(fd)
            if self.store_id == (st.st_dev, st.st_ino):
                raise self.fail(rel, "is the store itself; keep the store outside the tree")
            xattrs = self._xattrs(fd, rel)
            row = self._child_row(parent, name, rel) if self.use_dirs_cache else None
            got = leaf = None
            if row is not None and row.own == dircache.own_sig(st):
                got = dircache.lstat_row(fd, row)
                if got is not None and got.digest == row.stat_digest and not row.subdirs:
                    leaf = row
            if leaf is None or got is None:
                return self._listed(fd, rel, st, xattrs, row, got)
            after = os.fstat(fd)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        # A leaf directory whose row holds: its entries are never opened.
        if (after.st_mtime_ns, after.st_ctime_ns) != (st.st_mtime_ns, st.st_ctime_ns):
            raise self.fail(rel, "changed while read (entries added or removed)")
        r = self.result
        r.dirs += 1
        r.dirs_cached += 1
        self._count_cached(got.files, got.bytes)
        parent.entries.append(Entry(name, Kind.DIR, stat.S_IMODE(st.st_mode), st.st_uid,
                                    st.st_gid, st.st_mtime_ns, tree_id=ObjectId(leaf.tree_id),
                                    xattrs=xattrs))
        return None

    def _count_cached(self, files: int, nbytes: int) -> None:
        """Count the regular files of a directory taken from the dirs cache."""
        r = self.result
        r.files += files
        r.bytes += nbytes
        if files and self.progress is not None:
            self.progress(r.files, r.bytes)

    def _listed(self, fd: int, rel: bytes, st: os.stat_result,
                xattrs: tuple[tuple[bytes, bytes], ...], row: dircache.Row | None,
                got: dircache.Lstats | None = None) -> _Dir:
        """A _Dir for the directory open at ``fd``: its names from the dirs cache row when
        the directory's own stat allows it (``got``: what ``dircache.lstat_row`` gave, if
        already asked), else from a listing; checked against the row."""
        if row is not None and row.own == dircache.own_sig(st):
            if got is None:
                got = dircache.lstat_row(fd, row)
            if got is not None:
                lstats = got.by_name
                names = [(n, _HINT_DIR) for n in dircache.split_names(row.subdirs)]
                names.extend((n, _hint(lstats[n].st_mode)) for n in lstats)
                return self._check_row(_Dir(fd, rel, st, xattrs, names, row=row,
                                            lstats=lstats), got.digest)
        names, listed = self._list(fd, rel, row is not None)
        d = _Dir(fd, rel, st, xattrs, names, row=row, lstats=listed)
        if row is None or listed is None:
            return d
        digest = dircache.stat_digest((n for n, h in names if h == _HINT_DIR), listed.items())
        return self._check_row(d, digest)

    # -- dirs cache (see dircache.py) -------------------------------------------------

    def _dir_key(self, rel: bytes) -> bytes:
        assert self.cache_prefix is not None
        return self.cache_prefix + rel

    def _child_row(self, parent: _Dir, name: bytes, rel: bytes) -> dircache.Row | None:
        """The row of ``parent``'s subdirectory ``name`` (at ``rel``): from the rows read
        at the start, or else the rows of all of ``parent``'s subdirectories are read with
        one query when the first one is opened."""
        if self.all_rows is not None:
            assert self.cache_prefix is not None
            return self.all_rows.get(self.cache_prefix + rel)
        if parent.child_rows is None:
            assert self.store is not None
            base = self._dir_key(parent.rel + b"/" if parent.rel else b"")
            rows = dircache.load(self.store.conn, [base + n for n, hint in parent.names
                                                   if hint == _HINT_DIR], self._present)
            parent.child_rows = {k[len(base):]: v for k, v in rows.items()}
        return parent.child_rows.get(name)

    @staticmethod
    def _check_row(d: _Dir, digest: bytes) -> _Dir:
        """Make ``d`` a candidate hit if ``digest``, the stat digest of its entries, is its
        row's: then only its subdirectories are walked until ``_confirm``."""
        assert d.row is not None
        if digest == d.row.stat_digest:
            names = d.names
            d.hit = True
            d.deferred = [nh for nh in names if nh[1] != _HINT_DIR]
            d.names = [nh for nh in names if nh[1] == _HINT_DIR]
        return d

    def _confirm(self, d: _Dir) -> bool:
        """With every subdirectory of a candidate hit walked: True (and ``d.tree_id`` set)
        if they give the row's children digest; else the deferred entries are walked."""
        assert d.row is not None and d.lstats is not None
        d.hit = False
        if d.late or dircache.children_digest(d.entries) != d.row.children_digest:
            d.names, d.pos, d.deferred = d.deferred, 0, []
            return False
        d.tree_id = ObjectId(d.row.tree_id)
        self.result.dirs_cached += 1
        files = nbytes = 0
        for name, _ in d.deferred:
            st = d.lstats[name]
            if stat.S_ISREG(st.st_mode):
                files += 1
                nbytes += st.st_size
        self._count_cached(files, nbytes)
        d.deferred = []
        return True

    def _record(self, d: _Dir) -> None:
        """Queue a dirs cache row for ``d``, just encoded, unless a timestamp it depends on
        is not older than this snapshot's horizon (the same-tick rule)."""
        assert d.tree_id is not None
        subdirs = [e for e in d.entries if e.kind is Kind.DIR]
        if len(subdirs) + len(d.used) != len(d.entries):
            return
        newest = max(d.st.st_mtime_ns, d.st.st_ctime_ns)
        for _, st in d.used:
            newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
        if newest >= self.horizon:
            return
        names = [e.name for e in subdirs]
        row = dircache.Row(dircache.own_sig(d.st), dircache.join_names(names),
                           dircache.join_names(n for n, _ in d.used),
                           dircache.stat_digest(names, d.used),
                           dircache.children_digest(subdirs), d.tree_id)
        self.dir_rows.append((self._dir_key(d.rel), row, self.horizon))
        if len(self.dir_rows) >= _CACHE_BATCH:
            self.flush_cache()

    # -- the walk --------------------------------------------------------------------

    def walk(self) -> ObjectId:
        """Walk the tree under ``root_fd``; return the root tree id."""
        try:
            st = os.fstat(self.root_fd)
        except OSError as e:
            raise self.oserror(b"", e) from None
        if self.store_id == (st.st_dev, st.st_ino):
            raise self.fail(b"", "is the store itself")
        row = None
        if self.use_dirs_cache:
            assert self.store is not None
            key = self._dir_key(b"")
            self.all_rows = dircache.load_under(self.store.conn, key, _PREFETCH_ROWS,
                                                self._present)
            if self.all_rows is not None:
                row = self.all_rows.get(key)
            else:
                row = dircache.load(self.store.conn, [key], self._present).get(key)
        root = self._listed(self.root_fd, b"", st, (), row)
        stack = [root]
        try:
            while stack:
                d = stack[-1]
                if d.pos < len(d.names):
                    name, hint = d.names[d.pos]
                    d.pos += 1
                    child = self._entry(d, name, hint)
                    if child is not None:
                        stack.append(child)
                    continue
                if d.hit and not self._confirm(d):
                    continue
                stack.pop()
                self._finish_dir(d, stack[-1] if stack else None)
        finally:
            for d in stack:
                if d.fd >= 0 and d.fd != self.root_fd:
                    os.close(d.fd)
        if root.tree_id is None:
            self._finish_late(root)
        assert root.tree_id is not None
        return root.tree_id

    def _entry(self, d: _Dir, name: bytes, hint: int) -> _Dir | None:
        rel = d.rel + b"/" + name if d.rel else name
        if hint == _HINT_DIR:
            return self._open_dir(d, name, rel)
        if hint == _HINT_FILE:
            self._file(d, name, rel)
            return None
        try:
            st = os.stat(name, dir_fd=d.fd, follow_symlinks=False)
        except OSError as e:
            raise self.oserror(rel, e) from None
        m = st.st_mode
        if stat.S_ISDIR(m):
            return self._open_dir(d, name, rel)
        if stat.S_ISREG(m):
            self._file(d, name, rel)
        elif stat.S_ISLNK(m):
            try:
                target = os.readlink(name, dir_fd=d.fd)
                st2 = os.stat(name, dir_fd=d.fd, follow_symlinks=False)
            except OSError as e:
                raise self.oserror(rel, e) from None
            if _sig(st) != _sig(st2) or len(target) != st.st_size:
                raise self.fail(rel, "changed while read")
            self._add(d, Entry(name, Kind.SYMLINK, stat.S_IMODE(m), st.st_uid, st.st_gid,
                               st.st_mtime_ns, len(target), target=target), rel, st)
        elif stat.S_ISFIFO(m) or stat.S_ISSOCK(m):
            kind = Kind.FIFO if stat.S_ISFIFO(m) else Kind.SOCKET
            self._add(d, Entry(name, kind, stat.S_IMODE(m), st.st_uid, st.st_gid,
                               st.st_mtime_ns), rel, st)
        elif stat.S_ISCHR(m) or stat.S_ISBLK(m):
            kind = Kind.CHAR if stat.S_ISCHR(m) else Kind.BLOCK
            self._add(d, Entry(name, kind, stat.S_IMODE(m), st.st_uid, st.st_gid,
                               st.st_mtime_ns, rdev=st.st_rdev), rel, st)
        else:
            raise self.fail(rel, f"has an unsupported file type {stat.S_IFMT(m):o}")
        return None

    def _add(self, d: _Dir, ent: Entry, rel: bytes, st: os.stat_result) -> None:
        """Append the non-directory entry ``ent`` (at ``rel``, lstat ``st``) to ``d``; a
        name of an inode with more than one link, of any kind, joins its hard-link group
        (its id is filled in by ``_finish_late`` once every name is known)."""
        if st.st_nlink > 1:
            key = (st.st_dev, st.st_ino)
            self.links.setdefault(key, []).append(rel)
            d.late.append((len(d.entries), key))
        d.entries.append(ent)
        d.used.append((ent.name, st))

    def _finish_dir(self, d: _Dir, parent: _Dir | None) -> None:
        try:
            st = os.fstat(d.fd)
        except OSError as e:
            raise self.oserror(d.rel, e) from None
        finally:
            if d.fd != self.root_fd:
                os.close(d.fd)
            d.fd = -1
        if (st.st_mtime_ns, st.st_ctime_ns) != (d.st.st_mtime_ns, d.st.st_ctime_ns):
            raise self.fail(d.rel, "changed while read (entries added or removed)")
        d.names = []
        d.lstats = None
        d.row = None
        d.child_rows = None
        if d.tree_id is None and not d.late:
            d.tree_id = self.sink.tree(d.entries)
            if self.use_dirs_cache:
                self._record(d)
        if d.tree_id is not None:
            d.entries = []
            d.used = []
        if parent is None:
            return
        self.result.dirs += 1
        st = d.st
        ent = Entry(d.rel.rsplit(b"/", 1)[-1], Kind.DIR, stat.S_IMODE(st.st_mode), st.st_uid,
                    st.st_gid, st.st_mtime_ns, tree_id=d.tree_id or chunker.zero_chunk_id(0),
                    xattrs=d.xattrs)
        if d.tree_id is None:
            parent.late.append((len(parent.entries), d))
        parent.entries.append(ent)

    def _finish_late(self, root: _Dir) -> None:
        """Encode the directories that waited for hard-link groups, deepest first."""
        groups = {k: link_group_id(v) for k, v in self.links.items() if len(v) > 1}
        todo: list[tuple[_Dir, bool]] = [(root, False)]
        while todo:
            d, expanded = todo.pop()
            if not expanded:
                todo.append((d, True))
                todo.extend((c, False) for _, c in d.late if isinstance(c, _Dir))
                continue
            for i, item in d.late:
                if isinstance(item, _Dir):
                    d.entries[i] = replace(d.entries[i], tree_id=item.tree_id)
                else:
                    gid = groups.get(item)  # type: ignore[call-overload]
                    if gid is not None:
                        d.entries[i] = replace(d.entries[i], link_group=gid)
            d.tree_id = self.sink.tree(d.entries)
            d.entries = []
            d.late = []

    # -- files -----------------------------------------------------------------------

    def _file(self, d: _Dir, name: bytes, rel: bytes) -> None:
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=d.fd)
        except OSError as e:
            raise self.oserror(rel, e) from None
        try:
            try:
                st = os.fstat(fd)
            except OSError as e:
                raise self.oserror(rel, e) from None
            if not stat.S_ISREG(st.st_mode):
                raise self.fail(rel, "changed while read (no longer a regular file)")
            key = (st.st_dev, st.st_ino)
            known = self.link_content.get(key) if st.st_nlink > 1 else None
            if known is not None:
                if known[:3] != (st.st_size, st.st_mtime_ns, st.st_ctime_ns):
                    raise self.fail(rel, "changed while read (a hard-linked file changed "
                                    "between two of its names)")
                chunks, xattrs = known[3], known[4]
            else:
                xattrs = self._xattrs(fd, rel)
                chunks = self._content(d, name, fd, st, rel)
                if st.st_nlink > 1:
                    self.link_content[key] = (st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                              chunks, xattrs)
        finally:
            os.close(fd)
        self._add(d, Entry(name, Kind.FILE, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid,
                           st.st_mtime_ns, st.st_size, chunks, xattrs=xattrs), rel, st)
        r = self.result
        r.files += 1
        r.bytes += st.st_size
        if self.progress is not None:
            self.progress(r.files, r.bytes)

    def _load_cache(self, d: _Dir) -> None:
        """Read the files cache rows of ``d``'s files and which of their chunks are indexed
        (one range query; files of several chunks need one more query per 500 ids)."""
        d.cache = {}
        if self.store is None or self.cache_prefix is None:
            return
        base = self.cache_prefix + d.rel + b"/" if d.rel else self.cache_prefix
        conn = self.store.conn
        # The join answers presence for the usual one-chunk file; longer ones are asked next.
        rows = conn.execute(
            "SELECT f.path, f.size, f.mtime_ns, f.ctime_ns, f.inode, f.chunks, "
            "f.trusted_before_ns, o.id IS NOT NULL FROM files_cache f "
            "LEFT JOIN objects o ON o.id = f.chunks "
            "WHERE f.path > ? AND f.path < ? AND instr(substr(f.path, ?), x'2f') = 0",
            (base, base[:-1] + b"0", len(base) + 1)).fetchall()
        want: set[bytes] = set()
        shared = self._present is not None  # the object index is not in ``conn``
        for path, size, mtime, ctime, ino, blob, horizon, single in rows:
            if mtime < horizon and ctime < horizon:
                d.cache[path[len(base):]] = (size, mtime, ctime, ino, blob, horizon)
                if single:
                    d.present.add(blob)
                elif len(blob) > DIGEST_SIZE or shared:
                    want.update(blob[i:i + DIGEST_SIZE]
                                for i in range(0, len(blob), DIGEST_SIZE))
        ids = list(want)
        if self._present is not None:
            d.present.update(self._present(ids))
            return
        for i in range(0, len(ids), 500):
            batch = ids[i:i + 500]
            q = "SELECT id FROM objects WHERE id IN (" + ",".join("?" * len(batch)) + ")"
            d.present.update(r[0] for r in conn.execute(q, batch))

    def _cached(self, d: _Dir, name: bytes, st: os.stat_result) -> ChunkList | None:
        if d.cache is None:
            self._load_cache(d)
            assert d.cache is not None
        row = d.cache.get(name)
        if row is None:
            return None
        size, mtime, ctime, ino, blob, horizon = row
        if (size, mtime, ctime, ino) != (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino):
            return None
        if len(blob) != DIGEST_SIZE * chunker.chunk_count(size, self.cs):
            return None
        ids = [ObjectId(blob[i:i + DIGEST_SIZE]) for i in range(0, len(blob), DIGEST_SIZE)]
        if not all(c in d.present for c in ids) and not self.sink.have(ids):
            return None
        return ChunkList(ids)

    def _content(self, d: _Dir, name: bytes, fd: int, st: os.stat_result,
                 rel: bytes) -> ChunkList:
        cached = self._cached(d, name, st)
        if cached is not None:
            return cached
        size = st.st_size
        cs = self.cs
        if st.st_blocks * 512 >= size:  # no holes: every chunk read (most files, one chunk)
            chunks = ChunkList([self._chunk(fd, off, min(cs, size - off), rel)
                                for off in range(0, size, cs)])
        else:
            chunks = self._sparse_content(fd, size, rel)
        try:
            after = os.fstat(fd)
        except OSError as e:
            raise self.oserror(rel, e) from None
        if _sig(after) != _sig(st):
            raise self.fail(rel, "changed while read")
        self.result.files_read += 1
        self.result.bytes_read += size
        if self.cache_prefix is not None and chunks.repeats <= V1_REPEATS_MAX:
            # (a file of more repeats is scanned again, by its data extents)
            self.cache_rows.append((self.cache_prefix + rel, size, st.st_mtime_ns,
                                    st.st_ctime_ns, st.st_ino, chunks.slot_bytes(),
                                    self.horizon))
            if len(self.cache_rows) >= _CACHE_BATCH:
                self.flush_cache()
        return chunks

    def _chunk(self, fd: int, off: int, length: int, rel: bytes) -> ObjectId:
        """The id of the ``length`` bytes at ``off`` of file ``fd`` (at ``rel``), put into the
        sink. Raises SnapshotError if they cannot be read or the file shrank."""
        try:
            data = os.pread(fd, length, off)
        except OSError as e:
            raise self.oserror(rel, e) from None
        if len(data) != length:
            raise self.fail(rel, "changed while read (file shrank)")
        return self.sink.chunk(data)

    def _sparse_content(self, fd: int, size: int, rel: bytes) -> ChunkList:
        """The chunk list of a file with holes: whole chunks inside a hole (``SEEK_DATA``)
        are one run of the zero chunk, neither read nor hashed; the rest as ``_chunk``."""
        cs = self.cs
        slots = chunker.chunk_count(size, cs)
        tail = size - (slots - 1) * cs  # length of the last chunk
        runs: list[tuple[bytes, int]] = []
        i = 0
        while i < slots:
            off = i * cs
            try:
                next_data = os.lseek(fd, off, os.SEEK_DATA)
            except OSError as e:
                if e.errno != errno.ENXIO:
                    raise self.oserror(rel, e) from None
                next_data = size  # only a hole remains
            j = slots if next_data >= size else next_data // cs
            if j > i:
                full = j - 1 if j == slots and tail != cs else j
                if full > i:
                    runs.append((self.sink.zero(cs), full - i))
                if full < j:
                    runs.append((self.sink.zero(tail), 1))
                i = j
                continue
            runs.append((self._chunk(fd, off, cs if i < slots - 1 else tail, rel), 1))
            i += 1
        return ChunkList.from_runs(runs)

    def flush_cache(self) -> None:
        """Write the queued files cache and dirs cache rows in one transaction. Either may
        be written before the snapshot commits: both are trusted only once what they name
        is indexed."""
        if not (self.cache_rows or self.dir_rows) or self.store is None:
            return
        with write_transaction(self.store.conn, self.store.index_path) as c:
            c.executemany(
                "INSERT OR REPLACE INTO files_cache(path, size, mtime_ns, ctime_ns, inode, "
                "chunks, trusted_before_ns) VALUES (?, ?, ?, ?, ?, ?, ?)", self.cache_rows)
            dircache.write(c, self.dir_rows)
        self.cache_rows = []
        self.dir_rows = []


def _sig(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, stat.S_IFMT(st.st_mode))


def _open_root(path: str | os.PathLike[str]) -> tuple[int, str]:
    """Open the directory to import (symlinks in its own path are resolved; none below)."""
    shown = os.fspath(path)
    real = os.path.realpath(shown)
    try:
        fd = os.open(real, _DIR_FLAGS)
    except FileNotFoundError:
        raise SnapshotError(shown, "no such directory") from None
    except NotADirectoryError:
        raise SnapshotError(shown, "not a directory") from None
    except OSError as e:
        raise SnapshotError(shown, e.strerror or str(e)) from None
    return fd, real


# -- public API ------------------------------------------------------------------------


def run_snapshot(store: Store, path: str | os.PathLike[str], *, label: str | None = None,
                 origin: str = "snapshot", progress: Progress | None = None,
                 workers: int = 2) -> SnapshotResult:
    """Import the directory ``path`` into ``store``, list it, and say what it did.

    ``workers`` threads compress large new chunks (0: compress inline). Returns only when the
    packs are durable, the index is committed and the snapshot is listed with ``origin`` and
    ``label``. Raises SnapshotError(root, cause) when the tree cannot be read exactly as it
    is (see the module docstring), and also when the store cannot be written (a full disk:
    the cause says so); nothing it wrote is then referenced, and GC removes it.
    """
    horizon = trust_horizon_ns()
    fd, real = _open_root(path)
    try:
        sroot = os.path.realpath(store.root)
        if _within(sroot, real):
            raise SnapshotError(os.fspath(path), "the tree holds the store; keep the store "
                                                 "outside the tree")
        if _within(real, sroot):
            raise SnapshotError(os.fspath(path), "the tree is inside the store")
        return _run(store, path, fd, real, horizon, label, origin, progress, workers)
    except (BackendError, sqlite3.Error) as e:
        raise SnapshotError(os.fspath(path), f"cannot write to the store: {e}",
                            because=e) from e
    finally:
        os.close(fd)


def _within(path: str, top: str) -> bool:
    """True if ``path`` is ``top`` or below it, by whole components (both canonical)."""
    return path == top or path.startswith(top.rstrip("/") + "/")


def _run(store: Store, path: str | os.PathLike[str], fd: int, real: str, horizon: int,
         label: str | None, origin: str, progress: Progress | None,
         workers: int) -> SnapshotResult:
    with store.writer() as w:
        sink = _StoreSink(w, store.level, workers)
        walker = _Walker(fd, os.fspath(path), sink, chunk_size=store.chunk_size,
                         store=store, cache_prefix=os.fsencode(real.rstrip("/")) + b"/",
                         horizon_ns=horizon, progress=progress)
        try:
            tree_id = walker.walk()
            sink.finish()
        except BaseException:
            sink.abort()
            raise
        w.commit()
        ref = Ref(tree_id)
        store.add_snapshot(ref, origin, label)
        walker.flush_cache()
        r = walker.result
        r.ref = ref
        r.packs_written = w.packs_written
        r.stored_bytes = w.bytes_written
        return r


def snapshot(store: Store, path: str | os.PathLike[str], *, label: str | None = None,
             origin: str = "snapshot", progress: Progress | None = None) -> Ref:
    """Import the directory ``path`` and return its Ref (see ``run_snapshot``)."""
    return run_snapshot(store, path, label=label, origin=origin, progress=progress).ref


def compute_ref_fd(fd: int, shown: str, chunk_size: int,
                   trees: dict[ObjectId, bytes] | None = None) -> Ref:
    """The Ref of the directory open at ``fd``, computed without writing anything; every
    encoded tree goes into ``trees`` when given (id -> encoding)."""
    walker = _Walker(fd, shown, _HashSink(trees), chunk_size=chunk_size)
    return Ref(walker.walk())


def compute_ref(path: str | os.PathLike[str], *, chunk_size: int = 1 << 20,
                trees: dict[ObjectId, bytes] | None = None) -> Ref:
    """The Ref that ``snapshot`` would give ``path`` in a store of ``chunk_size``, without
    writing anything to the store; every encoded tree goes into ``trees`` when given (so a
    caller can diff a live directory against a snapshot). Raises SnapshotError as
    ``snapshot`` does."""
    fd, _ = _open_root(path)
    try:
        return compute_ref_fd(fd, os.fspath(path), chunk_size, trees)
    finally:
        os.close(fd)
