"""The object store: chunks and trees in packs on a blob backend, located by the SQLite index.

Layout of a local store directory ``<root>`` (mode 0700)::

    <root>/backend/config.json          chunk size and compression level (immutable)
    <root>/backend/packs/<hex>.pack     chunks and trees (see pack.py)
    <root>/backend/snapshots/<t>-<n>.json   append-only snapshot-list records (add, forget)
    <root>/backend/journal/<session>/<seq>.json   append-only journal events
    <root>/index.sqlite                 the index (schema.py), a rebuildable cache
    <root>/gc.lock                      flock: writers hold it shared, GC exclusive

Write order (CONTRACT 1.3), kept by ``Writer``: chunks and trees go into packs; the packs are
put and made durable with one barrier; then the index rows are committed; only then may the
caller list the snapshot or append a journal event. Readers go the other way (history ->
index -> pack), so a crash at any point leaves at most unreferenced packs, which GC removes.
A writer holds ``gc.lock`` shared from its first dedup check until it has listed what it
wrote, so a concurrent GC can never delete an object that the writer decided to reuse.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from . import chunker, schema
from .backend import BlobBackend, LocalDirBackend, check_key
from .catalog import (
    Catalog,
    SQLiteCatalog,
    location,
    object_row,
    sqlite_full,
    write_transaction,
)
from .dirs import make_private_dir
from .errors import (
    BlobNotFoundError,
    FencedError,
    IntegrityError,
    ObjectNotFoundError,
    RefNotFoundError,
    StoreError,
    StoreFullError,
)
from .pack import (
    BLOCK_SIZE,
    TAG_SIZE,
    Codec,
    FrameTable,
    Location,
    ObjKind,
    PackBuilder,
    blocks_length,
    decode_frame,
    decode_record,
    split_blocks,
    table_length,
    unit_size,
)
from .ref import ObjectId, Ref, object_id
from .tree import Entry, Tree, decode_tree, encode_tree

DEFAULT_CHUNK_SIZE = 1 << 20
DEFAULT_LEVEL = 3
CONFIG_KEY = "config.json"


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """One row of the snapshot list."""

    ref: Ref
    time_ns: int
    origin: str
    label: str | None


@dataclass(frozen=True, slots=True)
class JournalEvent:
    """One journal event of a session (CONTRACT 4.5)."""

    session: str
    seq: int
    time_ns: int
    epoch: int
    event: str
    ref: Ref
    trigger: str | None
    consistency: str | None


_EVENT_FIELDS = frozenset({"time_ns", "epoch", "event", "ref"})


class _Held:
    """A thread's index connection (``Store.conn``): when the thread ends (its
    ``threading.local`` entry is dropped), the connection goes back to the store's pool of
    idle ones, unless a transaction was left open on it (then it is closed). Connections
    are opened with ``check_same_thread=False`` so the next thread may use one; only one
    thread holds a connection at a time."""

    __slots__ = ("conn", "idle", "closed")

    def __init__(self, conn: sqlite3.Connection, idle: list[sqlite3.Connection]) -> None:
        self.conn = conn
        self.idle = idle
        self.closed = False

    def __del__(self) -> None:
        if self.closed:
            return
        self.closed = True
        c = self.conn
        try:
            if c.in_transaction:
                c.close()
            else:
                self.idle.append(c)
        except sqlite3.Error:
            pass


class Store:
    """A content-addressed store of chunks and trees, with snapshot list and journals.

    ``Store(root)`` opens (creating if needed) a local store; pass ``backend=`` to keep the
    blobs elsewhere (the index and lock stay under ``root``) and ``catalog=`` to keep the
    metadata in a shared catalog (store/catalog.py; ``root`` then keeps only this host's
    caches: the files and dirs caches). A ``root`` holding ``store.json`` opens the shared
    store it names (store/config.py). ``chunk_size`` (bytes, power of
    two from 64 KiB to 8 MiB) and ``level`` (zstd level) are fixed when the store is created;
    later opens read them from the backend. Safe to use from several threads; each thread
    gets its own SQLite connection. A missing index next to a backend holding packs is
    rebuilt at open (``rebuild-index``: GC then waits for a clean ``verify``); a damaged one
    is a StoreError saying so.
    """

    def __init__(self, root: str | os.PathLike[str], *, backend: BlobBackend | None = None,
                 catalog: Catalog | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, level: int = DEFAULT_LEVEL) -> None:
        self.root = os.path.abspath(os.fspath(root))
        make_private_dir(self.root, "store")
        if backend is None and catalog is None:
            from . import config

            shared = config.read(self.root)
            if shared is not None:  # this host's local directory of a shared store
                backend, catalog = config.open_parts(self.root, shared)
        self.backend: BlobBackend = backend or LocalDirBackend(os.path.join(self.root, "backend"))
        self.index_path = os.path.join(self.root, "index.sqlite")
        self.catalog: Catalog = catalog if catalog is not None else SQLiteCatalog(
            lambda: self.conn, self.index_path)
        self._local = threading.local()
        self._idle: list[sqlite3.Connection] = []  # connections of finished threads
        self._cache_lock = threading.Lock()
        self._trees: OrderedDict[bytes, Tree] = OrderedDict()
        self._records: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._tables: OrderedDict[tuple[str, int], FrameTable] = OrderedDict()
        # Creation is serialized: two processes opening a new store at once must agree on
        # its config and must not race on creating the schema.
        init_fd = os.open(os.path.join(self.root, "init.lock"),
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(init_fd, fcntl.LOCK_EX)
            fresh_index = not os.path.exists(self.index_path)
            raw, copied = self._backend_config(chunk_size, level)
            cfg = json.loads(raw)
            self.chunk_size: int = int(cfg["chunk_size"])
            self.level: int = int(cfg["level"])
            try:
                schema.create(self.conn)
            except sqlite3.DatabaseError as e:
                self.close()
                if sqlite_full(e, self.index_path):  # not damaged: no room to open it
                    raise StoreFullError(f"the index {self.index_path}", e) from None
                raise StoreError(f"the index {self.index_path} is damaged ({e}); move it away "
                                 "and open the store again to rebuild it from the backend") from None
            if self.catalog.shared and not copied:
                try:
                    self.conn.execute("INSERT OR REPLACE INTO config(key, value) VALUES "
                                      "('backend_config', ?)", (raw,))
                except sqlite3.Error:
                    pass  # only a copy: the next open reads the backend again
            if fresh_index and not self.catalog.shared and self.backend.list("packs/"):
                # The index is only a cache: one lost next to a backend that holds packs is
                # rebuilt, never started empty (GC would take every pack for a leftover).
                from .rebuild import rebuild_index  # rebuild.py imports this module

                rebuild_index(self)
        finally:
            os.close(init_fd)

    def _backend_config(self, chunk_size: int, level: int) -> tuple[str, bool]:
        """The store's ``config.json`` as text (its chunk size and level), written with
        ``chunk_size`` and ``level`` if the backend has none, and whether it came from this
        host's copy. A shared store keeps that copy in this host's index (``config`` row
        ``backend_config``, written at the first open): the object never changes once
        written, and with the copy, opening the store makes no S3 request, so what needs
        only the catalog or the range cache works while the S3 server is down. Raises
        StoreError for a chunk size out of range, BackendError if the backend fails."""
        if self.catalog.shared:
            try:
                row = self.conn.execute("SELECT value FROM config WHERE key = "
                                        "'backend_config'").fetchone()
            except sqlite3.DatabaseError:  # no index yet, or a damaged one (said below)
                row = None
            if row is not None:
                return str(row[0]), True
        try:
            raw = self.backend.get(CONFIG_KEY)
        except BlobNotFoundError:
            if chunk_size & (chunk_size - 1) or not (64 << 10) <= chunk_size <= (8 << 20):
                raise StoreError(f"chunk size {chunk_size} is not a power of two "
                                 "from 64 KiB to 8 MiB") from None
            raw = json.dumps({"format": 1, "chunk_size": chunk_size, "level": level},
                             sort_keys=True).encode()
            self.backend.put(CONFIG_KEY, raw)
            self.backend.sync()
        return raw.decode(), False

    # -- index connection -------------------------------------------------------------

    @property
    def conn(self) -> sqlite3.Connection:
        """This thread's connection to the index: one a finished thread gave back (the
        store's pool), else a new one. Opening a connection costs about a millisecond, and
        servers answer each request on a new thread."""
        held = getattr(self._local, "held", None)
        if held is None:
            try:
                c = self._idle.pop()
            except IndexError:
                c = sqlite3.connect(self.index_path, timeout=60, isolation_level=None,
                                    check_same_thread=False)
                c.execute("PRAGMA busy_timeout=60000")
                c.execute("PRAGMA synchronous=NORMAL")
            held = self._local.held = _Held(c, self._idle)
        return held.conn

    def close(self) -> None:
        """Close this thread's connection and the idle ones of the pool."""
        held = getattr(self._local, "held", None)
        if held is not None:
            self._local.held = None
            held.closed = True
            held.conn.close()
        while self._idle:
            try:
                self._idle.pop().close()
            except IndexError:
                break

    def config_value(self, key: str) -> str | None:
        """A setting of the store (in the catalog: shared by its hosts)."""
        return self.catalog.config_value(key)

    def set_config(self, key: str, value: str | None) -> None:
        self.catalog.set_config(key, value)

    # -- reading ---------------------------------------------------------------------

    def _rows_in(self, sql: str, ids: list[bytes]) -> list[Any]:
        """The rows of this host's index that ``sql`` (ending ``WHERE id IN``) selects for
        ``ids``, one query per 500 ids."""
        out: list[Any] = []
        c = self.conn
        for i in range(0, len(ids), 500):
            batch = ids[i:i + 500]
            out.extend(c.execute(sql + " (" + ",".join("?" * len(batch)) + ")",
                                 batch).fetchall())
        return out

    def chunk_pages(self, ids: list[bytes]) -> dict[bytes, int]:
        """The data pages (``chunker.data_pages``) this host recorded for each chunk of
        ``ids`` that it wrote or put again (``chunk_pages``, a cache); ids without a row
        are left out (one query per 500 ids)."""
        return dict(self._rows_in("SELECT id, pages FROM chunk_pages WHERE id IN", ids))

    def prune_chunk_pages(self, kept: set[bytes]) -> int:
        """Delete this host's ``chunk_pages`` rows of chunks whose id is not in ``kept``
        (the ids the catalog still indexes after a GC) and return how many went. Only a
        cache: a local index that cannot be written (full disk, locked) keeps its rows,
        which stay harmless (a chunk stored again has the same pages)."""
        gone = [r[0] for r in self.conn.execute("SELECT id FROM chunk_pages")
                if bytes(r[0]) not in kept]
        return self._delete_local("chunk_pages", "id", gone)

    def has(self, oid: ObjectId) -> bool:
        return self.catalog.has(oid)

    def locate(self, oid: ObjectId, *, fresh: bool = False) -> Location:
        """Return where ``oid`` is stored. Raises ObjectNotFoundError, and on a shared
        catalog its CatalogError. On a shared catalog this host's copy of the catalog's rows
        (``located``, see store/schema.py) answers first, and a row the catalog gives is
        copied into it; ``fresh`` asks the catalog itself (the copy led to a missing
        pack)."""
        shared = self.catalog.shared
        if shared and not fresh:
            got = self._located([bytes(oid)])
            if got:
                return got[oid]
        loc = self.catalog.locate(oid)
        if loc is None:
            raise ObjectNotFoundError(oid.hex())
        if shared:
            self._remember([loc])
        return loc

    def locate_many(self, oids: Iterable[ObjectId]) -> dict[bytes, Location]:
        """Where each of ``oids`` is stored, by id, in one query per 500 ids; ids that are
        not indexed are left out. Raises IntegrityError for a row of unknown kind or codec.
        On a shared catalog only the ids this host has no ``located`` row for are asked
        (as ``locate``)."""
        ids: list[bytes] = list(dict.fromkeys(oids))
        if not self.catalog.shared:
            return self.catalog.locate_many(ids)
        out = self._located(ids)
        missing = [i for i in ids if i not in out]
        if missing:
            found = self.catalog.locate_many(missing)
            self._remember(found.values())
            out.update(found)
        return out

    def _located(self, ids: list[bytes]) -> dict[bytes, Location]:
        rows = self._rows_in("SELECT id, kind, pack, rec_offset, rec_length, codec, "
                             "inner_offset, raw_length FROM located WHERE id IN", ids)
        return {bytes(r[0]): location(r) for r in rows}

    def _remember(self, locs: Iterable[Location]) -> None:
        """Copy catalog rows into ``located``. Only a cache: a local index that cannot take
        them (full disk, locked) leaves the read to the catalog next time."""
        rows = [object_row(loc) for loc in locs]
        if not rows:
            return
        try:
            with write_transaction(self.conn, self.index_path) as c:
                c.executemany("INSERT OR REPLACE INTO located(id, kind, pack, rec_offset, "
                              "rec_length, codec, inner_offset, raw_length) "
                              "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        except (StoreError, sqlite3.Error):
            pass

    def prune_located(self, packs: Iterable[str]) -> int:
        """Delete this host's ``located`` rows that name a pack not in ``packs`` (the
        catalog's pack keys: the others were deleted by a GC) and return how many went.
        When any go, ``located_trees`` is emptied too: it vouches for every object below a
        tree, which may no longer hold (the next walk of a snapshot asks the catalog only
        for what has no row). A no-op on an embedded catalog. Only a cache: a local index
        that cannot be written (full disk, locked) keeps its rows, which stay harmless (a
        read through a deleted pack's row asks the catalog again)."""
        if not self.catalog.shared:
            return 0
        keep = set(packs)
        gone = [r[0] for r in self.conn.execute("SELECT DISTINCT pack FROM located")
                if r[0] not in keep]
        return self._delete_local("located", "pack", gone, then="DELETE FROM located_trees")

    def _delete_local(self, table: str, column: str, values: list[Any],
                      then: str | None = None) -> int:
        """Delete the rows of this host's index ``table`` whose ``column`` is in ``values``
        (500 per statement), then run ``then`` if given, in one transaction; the number of
        rows deleted. 0 when there is nothing to delete or the index cannot be written
        (full disk, locked): these tables are caches, and rows kept are harmless."""
        if not values:
            return 0
        n = 0
        try:
            with write_transaction(self.conn, self.index_path) as c:
                for i in range(0, len(values), 500):
                    batch = values[i:i + 500]
                    n += c.execute(f"DELETE FROM {table} WHERE {column} IN (" + ",".join(
                        "?" * len(batch)) + ")", batch).rowcount
                if then is not None:
                    c.execute(then)
        except (StoreError, sqlite3.Error):
            return 0
        return n

    def locate_tree(self, tree_id: ObjectId) -> None:
        """On a shared catalog, copy into this host's ``located`` the catalog rows of every
        object reachable from tree ``tree_id`` (one catalog query per 500 objects without a
        copy, one read per tree not walked before; trees in ``located_trees`` are not
        walked again), so that reading that snapshot needs no catalog. A no-op on an
        embedded catalog. Raises CatalogError, ObjectNotFoundError, IntegrityError."""
        if not self.catalog.shared:
            return
        seen: set[bytes] = set()
        walked: list[bytes] = []
        level: list[bytes] = [tree_id]
        while level:
            level = [t for t in dict.fromkeys(level) if t not in seen]
            seen.update(level)
            done = {bytes(r[0]) for r in self._rows_in(
                "SELECT id FROM located_trees WHERE id IN", level)}
            level = [t for t in level if t not in done]
            locs = self.locate_many(ObjectId(t) for t in level)
            below: list[bytes] = []
            chunks: list[ObjectId] = []
            for t in level:
                for e in self.get_tree(ObjectId(t), locs.get(t)).entries:
                    if e.tree_id is not None:
                        below.append(e.tree_id)
                    chunks.extend(cid for cid, _ in e.chunks.runs())
            self.locate_many(chunks)
            walked.extend(level)
            level = below
        try:
            with write_transaction(self.conn, self.index_path) as c:
                c.executemany("INSERT OR IGNORE INTO located_trees(id) VALUES (?)",
                              [(t,) for t in walked])
        except (StoreError, sqlite3.Error):
            pass

    def _refetchable(self) -> bool:
        """Whether the backend keeps a local copy of ranges (store/blobcache.py) that a
        read can go past: bytes that fail a check are then read once more."""
        return hasattr(self.backend, "refetch_range")

    def _record(self, loc: Location, fresh: bool = False) -> bytes:
        """The decoded record ``loc`` lies in (``fresh``: read again past the backend's
        range cache and this store's memory). Raises IntegrityError."""
        key = (loc.pack, loc.rec_offset)
        with self._cache_lock:
            plain = self._records.pop(key, None) if fresh else self._records.get(key)
            if plain is not None and not fresh:
                self._records.move_to_end(key)
                return plain
        data = self._fetch(loc, 0, loc.rec_length, fresh)
        plain = decode_record(loc.pack, loc.codec, data, loc.inner_offset + loc.raw_length
                              if loc.codec is Codec.RAW else 1 << 26)
        if loc.inner_offset or loc.raw_length != len(plain):
            # A group of small objects: keep it, its neighbours are likely read next.
            with self._cache_lock:
                self._records[key] = plain
                while len(self._records) > 64:
                    self._records.popitem(last=False)
        return plain

    def _verified(self, oid: ObjectId, loc: Location, fresh: bool = False) -> bytes:
        """The plaintext of ``oid`` at ``loc``, checked against its id (``fresh`` as for
        ``_record``). Raises IntegrityError."""
        plain = self._record(loc, fresh)
        data = plain[loc.inner_offset:loc.inner_offset + loc.raw_length]
        if len(data) != loc.raw_length or object_id(data) != oid:
            with self._cache_lock:
                self._records.pop((loc.pack, loc.rec_offset), None)
            raise IntegrityError(oid.hex(), "stored bytes do not hash to the object id")
        return data

    def read_object(self, oid: ObjectId, loc: Location | None = None) -> bytes:
        """Return the plaintext of ``oid``, verified against its id; ``loc``, if given, is
        where ``locate``/``locate_many`` found it.

        Bytes that fail (missing, not decompressing or not hashing to ``oid``) are looked
        up once more, in case GC repacked the object meanwhile; if it is where it was and
        the backend has a range cache, its record is read once more from the server (the
        cached copy dropped), so a copy cached while the pack was damaged on the server
        is not served after it was repaired.

        Raises ObjectNotFoundError if it is not indexed and IntegrityError if the bytes
        read that last time are missing, do not decompress or do not hash to ``oid``.
        """
        if loc is None or loc.oid != oid:
            loc = self.locate(oid)
        try:
            return self._verified(oid, loc)
        except IntegrityError:
            again = self.locate(oid, fresh=True)
            if again == loc and not self._refetchable():
                raise
            return self._verified(oid, again, fresh=again == loc)

    def _fetch(self, loc: Location, offset: int, length: int, fresh: bool = False) -> bytes:
        """``length`` bytes at ``offset`` inside ``loc``'s record (``fresh``: read from the
        server, past the backend's range cache, whose copy is replaced). Raises
        IntegrityError if the pack is missing or shorter."""
        try:
            if fresh and self._refetchable():
                data = self.backend.refetch_range(  # type: ignore[attr-defined]
                    loc.pack, loc.rec_offset + offset, length)
            else:
                data = self.backend.get_range(loc.pack, loc.rec_offset + offset, length)
        except BlobNotFoundError:
            raise IntegrityError(loc.oid.hex(), f"pack {loc.pack} is missing") from None
        if len(data) != length:
            raise IntegrityError(loc.oid.hex(), f"pack {loc.pack} is truncated")
        return data

    def _frame_table(self, loc: Location, fresh: bool = False) -> FrameTable:
        key = (loc.pack, loc.rec_offset)
        with self._cache_lock:
            t = self._tables.pop(key, None) if fresh else self._tables.get(key)
            if t is not None and not fresh:
                self._tables.move_to_end(key)
                return t
        head = self._fetch(loc, 0, min(table_length(loc.raw_length), loc.rec_length), fresh)
        t = FrameTable.parse(loc.oid.hex(), head, loc.rec_length, loc.raw_length)
        with self._cache_lock:
            self._tables[key] = t
            while len(self._tables) > 16384:
                self._tables.popitem(last=False)
        return t

    def _frames(self, loc: Location, first: int, last: int,
                fresh: bool = False) -> list[bytes]:
        what = loc.oid.hex()
        if loc.codec is Codec.BLOCKS:
            if loc.rec_length != blocks_length(loc.raw_length):
                raise IntegrityError(what, "record length does not match its blocks")
            if not 0 <= first <= last < -(-loc.raw_length // BLOCK_SIZE):
                raise ValueError(f"blocks {first}..{last} of a chunk of {loc.raw_length} bytes")
            step = TAG_SIZE + BLOCK_SIZE
            start = first * step
            data = self._fetch(loc, start, min(loc.rec_length, (last + 1) * step) - start,
                               fresh)
            return [bytes(b) for b in split_blocks(what, data, first, loc.oid)]
        t = self._frame_table(loc, fresh)
        if not 0 <= first <= last < len(t.offsets):
            raise ValueError(f"frames {first}..{last} of a chunk of {len(t.offsets)} frames")
        start = t.offsets[first]
        data = self._fetch(loc, start, t.offsets[last] + t.lengths[last] - start, fresh)
        return [decode_frame(what, t, i, data[t.offsets[i] - start:
                                              t.offsets[i] - start + t.lengths[i]], loc.oid)
                for i in range(first, last + 1)]

    def read_frames(self, oid: ObjectId, first: int, last: int,
                    loc: Location | None = None) -> list[bytes] | None:
        """The plaintexts of units ``first..last`` (inclusive) of chunk ``oid`` (frames of
        a framed chunk, blocks of one in raw blocks: ``pack.unit_size``), each verified
        against its tag (pack.py), fetched in one range read; None if the chunk is read
        whole (``read_object``). Unit ``i`` holds bytes ``[i * u, (i + 1) * u)`` of the
        chunk, ``u`` its unit size. ``loc`` as for ``read_object``.

        Units that fail their check are read as ``read_object`` reads bytes that fail
        (looked up again; else, with a range cache, read once more from the server).
        Raises ObjectNotFoundError if ``oid`` is not indexed, IntegrityError if the table or
        a unit read that last time is damaged or missing, ValueError for units the chunk does not have."""
        if loc is None or loc.oid != oid:
            loc = self.locate(oid)
        if unit_size(loc.codec) is None:
            return None
        try:
            return self._frames(loc, first, last)
        except IntegrityError:
            again = self.locate(oid, fresh=True)  # repacked by GC meanwhile?
            if again == loc:
                with self._cache_lock:
                    self._tables.pop((loc.pack, loc.rec_offset), None)
                if not self._refetchable():
                    raise
                # Cached bytes: once more from the server (table and units).
                return self._frames(loc, first, last, fresh=True)
            if unit_size(again.codec) != unit_size(loc.codec):
                return None
            return self._frames(again, first, last)

    def get_tree(self, tree_id: ObjectId, loc: Location | None = None) -> Tree:
        """Return the decoded tree ``tree_id`` (verified; cached, trees are immutable);
        ``loc`` as for ``read_object``."""
        with self._cache_lock:
            t = self._trees.get(tree_id)
            if t is not None:
                self._trees.move_to_end(tree_id)
                return t
        t = decode_tree(self.read_object(tree_id, loc), tree_id.hex())
        with self._cache_lock:
            self._trees[tree_id] = t
            while len(self._trees) > 8192:
                self._trees.popitem(last=False)
        return t

    def root_tree(self, ref: Ref | str) -> Tree:
        """The root tree of ``ref``. Raises InvalidRefError, RefNotFoundError (the root tree
        is not in the store; an ObjectNotFoundError), IntegrityError."""
        r = Ref.parse(ref)
        try:
            return self.get_tree(r.tree_id)
        except RefNotFoundError:
            raise
        except ObjectNotFoundError:
            raise RefNotFoundError(str(r)) from None

    def iter_file(self, entry: Entry) -> Iterator[bytes]:
        """Yield a file entry's content chunk by chunk, each verified (a run of one id
        is read once)."""
        for cid, k in entry.chunks.runs():
            data = self.read_object(cid)
            for _ in range(k):
                yield data

    # -- writing ---------------------------------------------------------------------

    def writer(self) -> Writer:
        """Open a write batch (see ``Writer``); use it as a context manager."""
        return Writer(self)

    # -- locks -----------------------------------------------------------------------

    def lock(self, exclusive: bool, blocking: bool = True) -> int | None:
        """Take ``gc.lock`` shared (writers) or exclusive (GC); return the fd, or None if
        ``blocking`` is False and the lock is held elsewhere."""
        fd = os.open(os.path.join(self.root, "gc.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
        flags = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if not blocking:
            flags |= fcntl.LOCK_NB
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def unlock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)

    # -- snapshot list (CONTRACT 1.6) --------------------------------------------------

    def _history_put(self, key: str, record: dict[str, object], durable: bool = True) -> None:
        self.backend.put(check_key(key), json.dumps(record, sort_keys=True).encode())
        if durable:
            self.backend.sync()

    def add_snapshot(self, ref: Ref | str, origin: str, label: str | None = None) -> None:
        """List ``ref`` (durably, then in the index). Re-listing updates the time and
        origin; it keeps the label unless a new one is given (``label=None`` keeps it), and
        a new one is added to the labels the Ref keeps (``snapshot_labels``).

        Raises InvalidRefError for anything but a Ref, ObjectNotFoundError if its root tree
        is not indexed and IntegrityError if it names a chunk: nothing is written then.
        """
        ref = Ref.parse(ref)
        kind, row = self.catalog.before_listing(str(ref), ref.tree_id)
        if kind is None:
            raise ObjectNotFoundError(ref.tree_id.hex())
        if kind != ObjKind.TREE:
            raise IntegrityError(str(ref), "names a chunk, not a tree")
        if label is None:
            label = None if row is None else row[3]
        now = time.time_ns()
        key = f"snapshots/{now:020d}-{os.getpid()}-add.json"
        self._history_put(key, {"op": "add", "ref": str(ref), "time_ns": now,
                                "origin": origin, "label": label})
        self.catalog.put_snapshot((str(ref), now, origin, label, key))

    def forget(self, ref: Ref | str) -> bool:
        """Drop ``ref`` from the snapshot list; return False if it was not listed.
        Raises InvalidRefError for anything but a Ref."""
        ref = Ref.parse(ref)
        if self.catalog.snapshot(str(ref)) is None:
            return False
        now = time.time_ns()
        key = f"snapshots/{now:020d}-{os.getpid()}-forget.json"
        self._history_put(key, {"op": "forget", "ref": str(ref), "time_ns": now})
        self.catalog.delete_snapshot(str(ref))
        return True

    def list_snapshots(self) -> list[SnapshotInfo]:
        return [SnapshotInfo(Ref.parse(r[0]), r[1], r[2], r[3])
                for r in self.catalog.snapshots()]

    def snapshot_labels(self) -> list[tuple[Ref, str, int]]:
        """Every label each listed Ref was given since it was listed, as (Ref, label,
        time_ns of the last time it was given), oldest first; a Ref's row in
        ``list_snapshots`` shows the newest one."""
        return [(Ref.parse(r[0]), r[1], r[2]) for r in self.catalog.snapshot_labels()]

    # -- journal (CONTRACT 1.1, 4.5) ----------------------------------------------------

    def append_journal(self, session: str, event: str, ref: Ref | str, *, epoch: int = 0,
                       trigger: str | None = None, consistency: str | None = None,
                       fence: str | None = None,
                       data: dict[str, Any] | None = None, durable: bool = True) -> int:
        """Append one event to ``session``'s journal, durably; return its seq (1, 2, ...).
        ``data``: further JSON fields kept in the event's backend object only (read back
        with ``journal_record``; e.g. a step's paths), never overriding the indexed ones.
        ``durable=False`` leaves the backend object to the next barrier (``backend.sync()``,
        which every durable write runs): it survives a crash of any process at once, and
        a power loss or kernel crash only after that barrier (group commit; the caller
        runs one soon, see fusefs/session/journal.py). An object a power loss left
        damaged at the next seq, without its index row, is such an event, lost: it is
        replaced.

        With ``fence`` (a lease name, e.g. ``session/<id>``), the append is refused with
        FencedError unless that lease is still at ``epoch``: checked before the backend
        object is written and again, atomically, with the index row (store/catalog.py).
        Raises InvalidRefError for anything but a Ref (nothing is written then)."""
        ref = Ref.parse(ref)
        check_key(f"journal/{session}")
        if fence is not None:
            cur = self.catalog.lease(fence)
            if cur is not None and cur[1] != epoch:
                raise FencedError(fence, epoch, cur[1])
        seq = self.catalog.last_seq(session) + 1
        key = f"journal/{session}/{seq:012d}.json"
        while self.backend.exists(key):
            # A crash after the durable record and before its index row: the event happened,
            # so index it and append after it.
            try:
                rec = json.loads(self.backend.get(key))
                if not isinstance(rec, dict) or not _EVENT_FIELDS <= rec.keys():
                    raise ValueError("not a journal event")
            except ValueError:
                # Only a record appended without its barrier can be damaged (a power loss
                # before it): that event is lost; its seq is taken again.
                self.backend.delete(key)
                self.backend.sync()
                break
            self.catalog.add_journal((session, seq, rec["time_ns"], rec["epoch"], rec["event"],
                                      rec["ref"], rec.get("trigger"), rec.get("consistency"),
                                      key))
            seq += 1
            key = f"journal/{session}/{seq:012d}.json"
        now = time.time_ns()
        self._history_put(key, {**(data or {}), "session": session, "seq": seq,
                                "time_ns": now, "epoch": epoch, "event": event,
                                "ref": str(ref), "trigger": trigger,
                                "consistency": consistency}, durable)
        # Ignored if present: verify/gc may have applied the durable record already
        # (rebuild.catch_up).
        self.catalog.add_journal((session, seq, now, epoch, event, str(ref), trigger,
                                  consistency, key), fence=fence)
        return seq

    def journal_record(self, session: str, seq: int) -> dict[str, Any]:
        """The durable backend object of event ``seq`` of ``session`` (its indexed fields
        plus the ``data`` it was appended with). Raises BlobNotFoundError when the session
        has no such event in the backend."""
        check_key(f"journal/{session}")
        rec: dict[str, Any] = json.loads(self.backend.get(f"journal/{session}/{seq:012d}.json"))
        return rec

    def journal_refs(self) -> list[Ref]:
        """Every Ref that some session's journal names (each once)."""
        return [Ref.parse(r) for r in self.catalog.journal_refs()]

    def journal(self, session: str) -> list[JournalEvent]:
        """The session's events, oldest first."""
        return [JournalEvent(r[0], r[1], r[2], r[3], r[4], Ref.parse(r[5]), r[6], r[7])
                for r in self.catalog.journal(session)]


class Writer:
    """One write batch: objects go into packs, then ``commit`` makes them durable and indexed.

    Holds ``gc.lock`` shared from creation until the context exits, so list the snapshot
    (or append the journal) inside the ``with`` block, after ``commit``. Objects already in
    the store or in this batch are not written again. Not thread-safe.

    The objects put are not looked up one by one (a network round trip each on a shared
    catalog; on the embedded one about 5 us and two fcntl lock calls each, 9,000 of them
    in a first snapshot of 6,800 files): they wait, up to ``CHECK_BATCH`` objects or
    ``CHECK_BYTES`` bytes, and are looked up together in one query; those already stored
    are dropped, the others packed.
    ``known`` asks the embedded catalog at once, for a caller that would otherwise do
    costly work (compress a large chunk) for an object already stored.
    """

    CHECK_BATCH = 1024
    CHECK_BYTES = 32 << 20

    def __init__(self, store: Store) -> None:
        self.store = store
        self._lock_fd = store.lock(exclusive=False)
        # On a shared catalog, the cross-host form of that lock: a writer pin, taken
        # before the first dedup check (store/sharedgc.py).
        self._pin: Any = None
        if store.catalog.shared:
            from .sharedgc import WriterPin

            try:
                self._pin = WriterPin(store)
            except BaseException:
                self.close()
                raise
        self._pending: set[bytes] = set()
        self._shared = store.catalog.shared
        self._unchecked: list[tuple[ObjectId, ObjKind, bytes, tuple[Codec, bytes] | None]] = []
        self._unchecked_bytes = 0
        self._rows: list[Location] = []
        self._packs: list[tuple[str, int, int]] = []
        self._builder = PackBuilder(self._emit, level=store.level)
        self._pages: dict[bytes, int] = {}  # chunk id -> data pages, for chunk_pages
        self.packs_written = 0
        self.bytes_written = 0

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._pin is not None:
            self._pin.release()
            self._pin = None
        if self._lock_fd is not None:
            Store.unlock(self._lock_fd)
            self._lock_fd = None

    def _emit(self, key: str, data: bytes, rows: list[Location]) -> None:
        self.store.backend.put(key, data)
        seed = getattr(self.store.backend, "seed", None)  # a cache in front of a remote one
        if seed is not None:
            seed(key, data, [(r.rec_offset, r.rec_length) for r in rows])
        self._rows.extend(rows)
        self._packs.append((key, len(data), len(rows)))
        self.packs_written += 1
        self.bytes_written += len(data)

    def known(self, oid: ObjectId) -> bool:
        """True if ``oid`` is pending in this batch or (embedded catalog) already stored (one
        query); on a shared catalog the store is asked later, for many objects at once (see
        above)."""
        return oid in self._pending or (not self._shared and self.store.has(oid))

    def put(self, oid: ObjectId, kind: ObjKind, data: bytes,
            encoded: tuple[Codec, bytes] | None = None, *, unknown: bool = False) -> bool:
        """Store ``data`` under ``oid`` (its id, computed by the caller) unless it is
        pending in this batch or stored; ``encoded``: its record made beforehand
        (``pack.encode_chunk``). Returns False if it was pending, True if it waits for its
        batched look-up (see above) or is written. ``unknown``: the caller has just found
        ``known(oid)`` False, so an embedded catalog is not asked again (an object another
        writer stored meanwhile is then stored twice, as when two writers race, and
        indexed once). A chunk's data pages (``chunker.data_pages``) are recorded in this
        host's ``chunk_pages`` at ``commit``, stored or not."""
        if kind is ObjKind.CHUNK and oid not in self._pages:
            self._pages[oid] = chunker.data_pages(data)
        if oid in self._pending:
            return False
        self._pending.add(oid)
        if unknown and not self._shared:
            self._builder.add(oid, kind, data, encoded)
            return True
        self._unchecked.append((oid, kind, data, encoded))
        self._unchecked_bytes += len(data)
        if len(self._unchecked) >= self.CHECK_BATCH or self._unchecked_bytes >= self.CHECK_BYTES:
            self._check()
        return True

    def _check(self) -> None:
        """Look the waiting objects up in one catalog query; pack those not stored yet."""
        batch, self._unchecked, self._unchecked_bytes = self._unchecked, [], 0
        if not batch:
            return
        stored = self.store.catalog.locate_many([oid for oid, _, _, _ in batch])
        for oid, kind, data, encoded in batch:
            if oid not in stored:
                self._builder.add(oid, kind, data, encoded)

    def put_chunk(self, data: bytes) -> ObjectId:
        oid = object_id(data)
        self.put(oid, ObjKind.CHUNK, data)
        return oid

    def put_tree(self, entries: list[Entry] | tuple[Entry, ...]) -> ObjectId:
        enc = encode_tree(entries)
        oid = object_id(enc)
        self.put(oid, ObjKind.TREE, enc)
        return oid

    def commit(self) -> None:
        """Flush packs, one durable barrier, then commit their index rows in one transaction."""
        self._check()
        self._builder.flush()
        if self._rows:
            self.store.backend.sync()
            if self._pin is not None:  # refused in the same transaction if a GC fenced it
                self.store.catalog.add_objects(self._rows, self._packs, pin=self._pin.holder)
            else:
                self.store.catalog.add_objects(self._rows, self._packs)
            self._rows = []
            self._packs = []
            self._pending.clear()
        if self._pages:
            with write_transaction(self.store.conn, self.store.index_path) as c:
                c.executemany("INSERT OR IGNORE INTO chunk_pages(id, pages) VALUES (?, ?)",
                              self._pages.items())
            self._pages = {}
