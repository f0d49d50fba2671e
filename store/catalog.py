"""The catalog: the store's metadata, behind one interface with two implementations.

What the catalog holds (the tables of store/schema.py that describe the store, not this
host's caches): the object index (``objects``, ``packs``), the snapshot list, the session
journals, named refs, registered state directories, the session registry and leases.

- ``SQLiteCatalog``: today's embedded index (``<store>/index.sqlite``), the default. Its
  SQL is the store's original SQL, on the store's per-thread connection, so the embedded
  store pays one method call per operation and nothing more.
- ``PostgresCatalog`` (store/pgcatalog.py): the same tables in a PostgreSQL database shared
  by many hosts (``--catalog postgresql://...``).

Both pass one conformance suite (tests/test_catalog.py). Rows cross the interface as
tuples: a snapshot row is ``(ref, time_ns, origin, label, key)``, a journal row is
``(session, seq, time_ns, epoch, event, ref, trigger, consistency, key)``, a pack row
``(key, size, objects)``; object locations are ``pack.Location``.

Fencing (CONTRACT 4.2 across hosts): ``add_journal(row, fence=name)`` inserts the row only
if the lease ``name`` is still at the row's epoch, in the same transaction, and raises
``FencedError`` otherwise; a holder that was taken over can never append after its
successor. Session registry writes are fenced the same way: ``put_session(...,
fence=name, epoch=e)`` writes the row only while lease ``name`` is at epoch ``e``. A lease
that was never taken fences nothing. Leases: a name is acquired free (epoch 1), taken over when expired or its
holder is provably dead (epoch + 1), re-acquired by its holder (same epoch); every change
runs in one transaction that locks the row, so of two hosts racing exactly one wins.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import (
    CatalogError,
    FencedError,
    IntegrityError,
    LeaseBusyError,
    LeaseLostError,
    StoreFullError,
)
from .pack import Codec, Location, ObjKind, make_location
from .ref import ObjectId

SnapshotRow = tuple[str, int, str, "str | None", str]
LabelRow = tuple[str, str, int, str]
"""(ref, label, time_ns, key): a label a listed Ref was given (every one is kept)."""
JournalRow = tuple[str, int, int, int, str, str, "str | None", "str | None", str]
PackRow = tuple[str, int, int]
_OBJ_KINDS = {int(k): k for k in ObjKind}

_SQLITE_FULL = 13  # sqlite3 result codes (https://sqlite.org/rescode.html)
_SQLITE_IOERR = 10


def sqlite_full(e: BaseException, path: str) -> bool:
    """True if ``e`` is SQLite failing for want of space for the database at ``path``:
    SQLITE_FULL, or an I/O error (growing the WAL or its shared-memory file) while that
    file system has no space left."""
    if not isinstance(e, sqlite3.Error):
        return False
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    if code == _SQLITE_FULL or "database or disk is full" in str(e):
        return True
    if code == _SQLITE_IOERR or "disk I/O error" in str(e):
        try:
            st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < (1 << 20)
    return False


@contextmanager
def write_transaction(c: sqlite3.Connection, path: str) -> Iterator[sqlite3.Connection]:
    """One write transaction on ``c`` (autocommit mode: BEGIN IMMEDIATE ... COMMIT), the
    database at ``path``. On any error it is rolled back, but only if it is still open
    (SQLite ends a transaction itself on some errors, a full disk among them: a second
    ROLLBACK would raise "no transaction is active" and hide the cause), and the original
    error is raised; a full disk becomes ``StoreFullError`` (ENOSPC)."""
    c.execute("BEGIN IMMEDIATE")
    try:
        yield c
        c.execute("COMMIT")
    except BaseException as e:
        if c.in_transaction:
            try:
                c.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # the cause below is what the caller must see
        if sqlite_full(e, path):
            raise StoreFullError(f"the index {path}", e) from e
        raise
_CODECS = {int(c): c for c in Codec}


_PUT_LABEL = ("INSERT INTO snapshot_labels(ref, label, time_ns, key) VALUES (?, ?, ?, ?) "
              "ON CONFLICT(ref, label) DO UPDATE SET time_ns=excluded.time_ns, "
              "key=excluded.key")


@dataclass
class Dump:
    """Every row of the object index and the history tables, read in one transaction:
    ``objects`` rows are ``(id, kind, pack, rec_offset, rec_length, codec, inner_offset,
    raw_length)``; ``journal`` is ordered by session and seq."""

    objects: list[tuple[Any, ...]]
    packs: list[PackRow]
    snapshots: list[SnapshotRow]
    journal: list[JournalRow]
    named: list[tuple[str, str]]


@dataclass
class Summary:
    """Counts for ``stats``: ``kinds`` maps an object kind to (count, plaintext bytes)."""

    kinds: dict[int, tuple[int, int]]
    packs: int
    stored_bytes: int
    sessions: int
    journal_events: int


@dataclass(frozen=True, slots=True)
class Lease:
    """A held lease: ``expires_ns`` is wall-clock ns by which the holder must renew."""

    name: str
    holder: str
    epoch: int
    expires_ns: int


def location(row: Any) -> Location:
    """A Location from an ``objects`` row ``(id, kind, pack, rec_offset, rec_length, codec,
    inner_offset, raw_length)``; IntegrityError for an unknown kind or codec."""
    oid = bytes(row[0])
    kind, codec = _OBJ_KINDS.get(row[1]), _CODECS.get(row[5])
    if kind is None or codec is None:
        raise IntegrityError(oid.hex(), "index row has an unknown kind or codec")
    return make_location(ObjectId(oid), kind, str(row[2]), int(row[3]), int(row[4]), codec,
                         int(row[6]), int(row[7]))


def object_row(r: Location) -> tuple[Any, ...]:
    """The ``objects`` row ``(id, kind, pack, rec_offset, rec_length, codec, inner_offset,
    raw_length)`` of ``r``: the inverse of ``location``."""
    return (bytes(r.oid), int(r.kind), r.pack, r.rec_offset, r.rec_length, int(r.codec),
            r.inner_offset, r.raw_length)


def decide_acquire(row: tuple[str, int, int] | None, holder: str, now: int,
                   holder_is_dead: Callable[[str], bool], name: str) -> int:
    """The epoch ``holder`` gets for ``name`` given its current row ``(holder, epoch,
    expires_ns)`` (None: never held); LeaseBusyError if it is held by another live holder.
    One rule for both catalogs."""
    if row is None:
        return 1
    cur, epoch, expires = row
    if cur == holder and expires > now:
        return int(epoch)
    if expires <= now or not cur or holder_is_dead(cur):
        return int(epoch) + 1
    raise LeaseBusyError(name, cur, int(epoch), int(expires))


class Catalog(Protocol):
    """The catalog interface (see the module docstring). Every method is one transaction."""

    #: True if other hosts share this catalog (then local paths in it are per host).
    shared: bool

    # objects and packs
    def has(self, oid: bytes) -> bool: ...
    def locate(self, oid: bytes) -> Location | None: ...
    def locate_many(self, ids: list[bytes]) -> dict[bytes, Location]: ...
    def add_objects(self, rows: list[Location], packs: list[PackRow],
                    pin: str | None = None) -> None: ...
    def packs(self) -> list[PackRow]: ...

    # snapshot list
    def snapshot(self, ref: str) -> SnapshotRow | None: ...
    def before_listing(self, ref: str, tree_id: bytes) -> tuple[int | None,
                                                                SnapshotRow | None]: ...
    def put_snapshot(self, row: SnapshotRow) -> None: ...
    def delete_snapshot(self, ref: str) -> bool: ...
    def snapshots(self) -> list[SnapshotRow]: ...
    def snapshot_labels(self) -> list[LabelRow]: ...

    # journals
    def last_seq(self, session: str) -> int: ...
    def add_journal(self, row: JournalRow, fence: str | None = None) -> bool: ...
    def journal(self, session: str) -> list[JournalRow]: ...
    def journal_refs(self) -> list[str]: ...

    # named refs
    def set_named_ref(self, name: str, ref: str) -> None: ...
    def named_ref(self, name: str) -> str | None: ...
    def delete_named_ref(self, name: str) -> bool: ...
    def named_refs(self) -> list[tuple[str, str]]: ...

    # registered state directories (per host: GC on that host reads them)
    def add_state_dir(self, path: str, host: str) -> None: ...
    def remove_state_dir(self, path: str, host: str) -> None: ...
    def state_dirs(self, host: str | None = None) -> list[tuple[str, str]]: ...

    # session registry: id -> (host, record JSON)
    def put_session(self, session: str, host: str, record: str,
                    fence: str | None = None, epoch: int = 0) -> None: ...
    def session(self, session: str) -> tuple[str, str] | None: ...
    def sessions(self) -> list[tuple[str, str, str]]: ...
    def delete_session(self, session: str) -> bool: ...

    # leases; ``now_ns`` None is the catalog's own clock (``clock_ns``): on a shared
    # catalog the server's, so that hosts whose clocks disagree agree on every expiry
    def clock_ns(self) -> int: ...
    def lease_acquire(self, name: str, holder: str, ttl_ns: int, now_ns: int | None,
                      holder_is_dead: Callable[[str], bool]) -> Lease: ...
    def lease_renew(self, lease: Lease, ttl_ns: int, now_ns: int | None) -> Lease: ...
    def lease_release(self, lease: Lease) -> None: ...
    def lease(self, name: str) -> tuple[str, int, int] | None: ...

    # whole-catalog work: verify, stats, catch-up with the backend history, rebuild-index
    def dump(self) -> Dump: ...
    def summary(self) -> Summary: ...
    def apply_history(self, puts: list[SnapshotRow], forgets: list[tuple[str, str]],
                      journal: list[JournalRow], labels: Sequence[LabelRow] = ()) -> int: ...
    def replace_all(self, packs: list[tuple[str, int, list[Location]]],
                    snapshots: list[SnapshotRow], journal: list[JournalRow],
                    labels: list[LabelRow] | None = None) -> int: ...

    # settings shared by the store's hosts (schema_version, unverified_rebuild, ...)
    def config_value(self, key: str) -> str | None: ...
    def set_config(self, key: str, value: str | None) -> None: ...

    def close(self) -> None: ...


def catalog_state(catalog: Catalog) -> str | None:
    """What a live mount's ``status`` says of its catalog: None for one of this host alone
    (SQLite), else ``"ok"`` when the shared server answers one round trip now, or
    ``"unreachable: <the CatalogError's message>"`` (within the catalog's timeout: at once
    for a refused connection, up to its ``timeout_s`` for a server that does not
    answer)."""
    if not catalog.shared:
        return None
    try:
        catalog.clock_ns()
    except CatalogError as e:
        return f"unreachable: {e}"
    return "ok"


class SQLiteCatalog:
    """The embedded catalog: the tables of store/schema.py in ``<store>/index.sqlite``,
    read and written on ``conn()`` (the store's per-thread connection). Hosts: one, so
    state directories and sessions are all this host's (``host`` is recorded anyway)."""

    shared = False

    def __init__(self, conn: Callable[[], sqlite3.Connection], path: str = "") -> None:
        self._conn = conn
        self._path = path  # the database file, for error messages and the full-disk check

    def _tx(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return write_transaction(self._conn(), self._path)

    # -- objects ---------------------------------------------------------------------

    def has(self, oid: bytes) -> bool:
        return self._conn().execute("SELECT 1 FROM objects WHERE id=?",
                                    (oid,)).fetchone() is not None

    def locate(self, oid: bytes) -> Location | None:
        row = self._conn().execute(
            "SELECT id, kind, pack, rec_offset, rec_length, codec, inner_offset, raw_length "
            "FROM objects WHERE id=?", (oid,)).fetchone()
        return None if row is None else location(row)

    def locate_many(self, ids: list[bytes]) -> dict[bytes, Location]:
        out: dict[bytes, Location] = {}
        c = self._conn()
        for i in range(0, len(ids), 500):
            batch = ids[i:i + 500]
            for row in c.execute(
                    "SELECT id, kind, pack, rec_offset, rec_length, codec, inner_offset, "
                    "raw_length FROM objects WHERE id IN (" + ",".join("?" * len(batch)) + ")",
                    batch):
                out[row[0]] = location(row)
        return out

    def add_objects(self, rows: list[Location], packs: list[PackRow],
                    pin: str | None = None) -> None:
        # ``pin``: a writer pin of a shared catalog (store/sharedgc.py); one host has none.
        assert pin is None, "writer pins exist in shared catalogs only"
        with self._tx() as c:
            c.executemany(
                "INSERT OR IGNORE INTO objects(id, kind, pack, rec_offset, rec_length, codec, "
                "inner_offset, raw_length) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [object_row(r) for r in rows])
            c.executemany("INSERT OR IGNORE INTO packs(key, size, objects) VALUES (?, ?, ?)",
                          packs)

    def packs(self) -> list[PackRow]:
        return [tuple(r) for r in self._conn().execute(
            "SELECT key, size, objects FROM packs ORDER BY key")]

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self, ref: str) -> SnapshotRow | None:
        row = self._conn().execute("SELECT ref, time_ns, origin, label, key FROM snapshots "
                                   "WHERE ref=?", (ref,)).fetchone()
        return None if row is None else tuple(row)

    def before_listing(self, ref: str, tree_id: bytes) -> tuple[int | None,
                                                                SnapshotRow | None]:
        """What listing ``ref`` (root tree ``tree_id``) must know first, in one call: the
        kind of object ``tree_id`` (None: not indexed) and ``ref``'s row, if listed."""
        c = self._conn()
        kind = c.execute("SELECT kind FROM objects WHERE id=?", (tree_id,)).fetchone()
        return None if kind is None else int(kind[0]), self.snapshot(ref)

    def put_snapshot(self, row: SnapshotRow) -> None:
        with self._tx() as c:
            c.execute("INSERT OR REPLACE INTO snapshots(ref, time_ns, origin, label, key) "
                      "VALUES (?, ?, ?, ?, ?)", row)
            if row[3] is not None:
                c.execute(_PUT_LABEL, (row[0], row[3], row[1], row[4]))

    def delete_snapshot(self, ref: str) -> bool:
        with self._tx() as c:
            c.execute("DELETE FROM snapshot_labels WHERE ref=?", (ref,))
            return c.execute("DELETE FROM snapshots WHERE ref=?", (ref,)).rowcount > 0

    def snapshot_labels(self) -> list[LabelRow]:
        return [tuple(r) for r in self._conn().execute(
            "SELECT ref, label, time_ns, key FROM snapshot_labels ORDER BY time_ns, ref")]

    def snapshots(self) -> list[SnapshotRow]:
        return [tuple(r) for r in self._conn().execute(
            "SELECT ref, time_ns, origin, label, key FROM snapshots ORDER BY time_ns, ref")]

    # -- journals --------------------------------------------------------------------

    def last_seq(self, session: str) -> int:
        row = self._conn().execute("SELECT MAX(seq) FROM journal WHERE session=?",
                                   (session,)).fetchone()
        return int(row[0] or 0)

    def add_journal(self, row: JournalRow, fence: str | None = None) -> bool:
        """Insert ``row`` unless its (session, seq) exists; True if inserted. With ``fence``,
        refuse (FencedError) unless that lease is at the row's epoch, atomically."""
        sql = ("INSERT OR IGNORE INTO journal(session, seq, time_ns, epoch, event, ref, "
               "trigger_, consistency, key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
        if fence is None:
            with self._tx() as c:
                return c.execute(sql, row).rowcount > 0
        with self._tx() as c:
            _check_fence(c, fence, row[3])
            n = c.execute(sql, row).rowcount
        return n > 0

    def journal(self, session: str) -> list[JournalRow]:
        return [tuple(r) for r in self._conn().execute(
            "SELECT session, seq, time_ns, epoch, event, ref, trigger_, consistency, key "
            "FROM journal WHERE session=? ORDER BY seq", (session,))]

    def journal_refs(self) -> list[str]:
        """Every Ref text some journal names, each once."""
        return [r[0] for r in self._conn().execute("SELECT DISTINCT ref FROM journal")]

    # -- named refs ------------------------------------------------------------------

    def set_named_ref(self, name: str, ref: str) -> None:
        self._conn().execute("INSERT OR REPLACE INTO named_refs(name, ref) VALUES (?, ?)",
                             (name, ref))

    def named_ref(self, name: str) -> str | None:
        row = self._conn().execute("SELECT ref FROM named_refs WHERE name=?",
                                   (name,)).fetchone()
        return None if row is None else str(row[0])

    def delete_named_ref(self, name: str) -> bool:
        return self._conn().execute("DELETE FROM named_refs WHERE name=?",
                                    (name,)).rowcount > 0

    def named_refs(self) -> list[tuple[str, str]]:
        return [tuple(r) for r in self._conn().execute(
            "SELECT name, ref FROM named_refs ORDER BY name")]

    # -- state directories -------------------------------------------------------------

    def add_state_dir(self, path: str, host: str) -> None:
        self._conn().execute("INSERT OR IGNORE INTO state_dirs(path) VALUES (?)", (path,))

    def remove_state_dir(self, path: str, host: str) -> None:
        self._conn().execute("DELETE FROM state_dirs WHERE path=?", (path,))

    def state_dirs(self, host: str | None = None) -> list[tuple[str, str]]:
        # One host: every directory is this host's, whatever ``host`` asks.
        return [(r[0], host or "") for r in self._conn().execute(
            "SELECT path FROM state_dirs ORDER BY path")]

    # -- sessions --------------------------------------------------------------------

    def put_session(self, session: str, host: str, record: str,
                    fence: str | None = None, epoch: int = 0) -> None:
        sql = "INSERT OR REPLACE INTO sessions(id, host, record) VALUES (?, ?, ?)"
        if fence is None:
            self._conn().execute(sql, (session, host, record))
            return
        with self._tx() as c:
            _check_fence(c, fence, epoch)
            c.execute(sql, (session, host, record))

    def session(self, session: str) -> tuple[str, str] | None:
        row = self._conn().execute("SELECT host, record FROM sessions WHERE id=?",
                                   (session,)).fetchone()
        return None if row is None else (row[0], row[1])

    def sessions(self) -> list[tuple[str, str, str]]:
        return [tuple(r) for r in self._conn().execute(
            "SELECT id, host, record FROM sessions ORDER BY id")]

    def delete_session(self, session: str) -> bool:
        return self._conn().execute("DELETE FROM sessions WHERE id=?",
                                    (session,)).rowcount > 0

    # -- leases ----------------------------------------------------------------------

    def clock_ns(self) -> int:
        """This host's wall clock (ns since the epoch): an embedded catalog has one host."""
        import time

        return time.time_ns()

    def lease_acquire(self, name: str, holder: str, ttl_ns: int, now_ns: int | None,
                      holder_is_dead: Callable[[str], bool]) -> Lease:
        if now_ns is None:
            now_ns = self.clock_ns()
        with self._tx() as c:
            row = c.execute("SELECT holder, epoch, expires_ns FROM leases WHERE name=?",
                            (name,)).fetchone()
            epoch = decide_acquire(row, holder, now_ns, holder_is_dead, name)
            lease = Lease(name, holder, epoch, now_ns + ttl_ns)
            c.execute("INSERT OR REPLACE INTO leases(name, holder, epoch, expires_ns) "
                      "VALUES (?, ?, ?, ?)", (name, holder, epoch, lease.expires_ns))
        return lease

    def lease_renew(self, lease: Lease, ttl_ns: int, now_ns: int | None) -> Lease:
        if now_ns is None:
            now_ns = self.clock_ns()
        with self._tx() as c:
            row = c.execute("SELECT holder, epoch FROM leases WHERE name=?",
                            (lease.name,)).fetchone()
            if row is None or row[0] != lease.holder or row[1] != lease.epoch:
                raise LeaseLostError(lease.name, lease.holder, lease.epoch)
            new = Lease(lease.name, lease.holder, lease.epoch, now_ns + ttl_ns)
            c.execute("UPDATE leases SET expires_ns=? WHERE name=?", (new.expires_ns, lease.name))
        return new

    def lease_release(self, lease: Lease) -> None:
        self._conn().execute(
            "UPDATE leases SET holder='', expires_ns=0 WHERE name=? AND holder=? AND epoch=?",
            (lease.name, lease.holder, lease.epoch))

    def lease(self, name: str) -> tuple[str, int, int] | None:
        row = self._conn().execute("SELECT holder, epoch, expires_ns FROM leases WHERE name=?",
                                   (name,)).fetchone()
        return None if row is None else (row[0], row[1], row[2])

    # -- whole catalog ---------------------------------------------------------------

    def dump(self) -> Dump:
        c = self._conn()
        c.execute("BEGIN")
        try:
            return Dump(
                objects=c.execute("SELECT id, kind, pack, rec_offset, rec_length, codec, "
                                  "inner_offset, raw_length FROM objects").fetchall(),
                packs=c.execute("SELECT key, size, objects FROM packs").fetchall(),
                snapshots=c.execute("SELECT ref, time_ns, origin, label, key "
                                    "FROM snapshots").fetchall(),
                journal=c.execute("SELECT session, seq, time_ns, epoch, event, ref, trigger_, "
                                  "consistency, key FROM journal "
                                  "ORDER BY session, seq").fetchall(),
                named=c.execute("SELECT name, ref FROM named_refs").fetchall())
        finally:
            c.execute("COMMIT")

    def summary(self) -> Summary:
        c = self._conn()
        kinds = {k: (n, b or 0) for k, n, b in c.execute(
            "SELECT kind, COUNT(*), SUM(raw_length) FROM objects GROUP BY kind")}
        npacks, stored = c.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM packs"
                                   ).fetchone()
        sessions, events = c.execute("SELECT COUNT(DISTINCT session), COUNT(*) FROM journal"
                                     ).fetchone()
        return Summary(kinds, npacks, stored, sessions, events)

    def apply_history(self, puts: list[SnapshotRow], forgets: list[tuple[str, str]],
                      journal: list[JournalRow], labels: Sequence[LabelRow] = ()) -> int:
        """Apply history records the catalog lacks, in one transaction: a listing is
        written only over an older row (by history key), a forget ``(ref, key)`` drops only
        a row older than it (and the Ref's labels older than it), a journal row only where
        none is, a label row only over an older one. Returns rows changed."""
        changed = 0
        with self._tx() as c:
            for lr in [(r[0], r[3], r[1], r[4]) for r in puts if r[3] is not None] + list(labels):
                changed += c.execute(_PUT_LABEL + " WHERE snapshot_labels.key < excluded.key",
                                     lr).rowcount
            for ref, key in forgets:
                c.execute("DELETE FROM snapshot_labels WHERE ref=? AND key < ?", (ref, key))
            for row in puts:
                changed += c.execute(
                    "INSERT INTO snapshots(ref, time_ns, origin, label, key) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT(ref) DO UPDATE SET "
                    "time_ns=excluded.time_ns, origin=excluded.origin, label=excluded.label, "
                    "key=excluded.key WHERE coalesce(snapshots.key, '') < excluded.key",
                    row).rowcount
            for ref, key in forgets:
                changed += c.execute("DELETE FROM snapshots WHERE ref=? AND "
                                     "coalesce(key, '') < ?", (ref, key)).rowcount
            for jr in journal:
                changed += c.execute(
                    "INSERT OR IGNORE INTO journal(session, seq, time_ns, epoch, event, ref, "
                    "trigger_, consistency, key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    jr).rowcount
        return changed

    def replace_all(self, packs: list[tuple[str, int, list[Location]]],
                    snapshots: list[SnapshotRow], journal: list[JournalRow],
                    labels: list[LabelRow] | None = None) -> int:
        """Replace the object index and history tables (``rebuild-index``), and drop this
        host's files and dirs caches, in one transaction; return objects indexed.
        ``labels`` None: the labels of the ``snapshots`` rows alone."""
        n = 0
        if labels is None:
            labels = [(r[0], r[3], r[1], r[4]) for r in snapshots if r[3] is not None]
        with self._tx() as c:
            c.execute("DELETE FROM snapshot_labels")
            c.executemany(_PUT_LABEL, labels)
            for table in ("objects", "packs", "snapshots", "journal", "files_cache",
                          "dirs_cache"):
                c.execute(f"DELETE FROM {table}")
            for key, size, rows in packs:
                c.execute("INSERT INTO packs(key, size, objects) VALUES (?, ?, ?)",
                          (key, size, len(rows)))
                n += c.executemany(
                    "INSERT OR IGNORE INTO objects(id, kind, pack, rec_offset, rec_length, "
                    "codec, inner_offset, raw_length) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [object_row(r) for r in rows]).rowcount
            c.executemany("INSERT INTO snapshots(ref, time_ns, origin, label, key) "
                          "VALUES (?, ?, ?, ?, ?)", snapshots)
            c.executemany("INSERT OR IGNORE INTO journal(session, seq, time_ns, epoch, event, "
                          "ref, trigger_, consistency, key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                          journal)
        return n

    # -- config ----------------------------------------------------------------------

    def config_value(self, key: str) -> str | None:
        row = self._conn().execute("SELECT value FROM config WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_config(self, key: str, value: str | None) -> None:
        if value is None:
            self._conn().execute("DELETE FROM config WHERE key=?", (key,))
        else:
            self._conn().execute("INSERT OR REPLACE INTO config(key, value) VALUES (?, ?)",
                                 (key, value))

    def close(self) -> None:
        return None


def _check_fence(c: sqlite3.Connection, name: str, epoch: int) -> None:
    """Inside a write transaction on ``c``: raise FencedError unless lease ``name`` is at
    ``epoch`` (a lease never taken fences nothing)."""
    lease = c.execute("SELECT epoch FROM leases WHERE name=?", (name,)).fetchone()
    if lease is not None and lease[0] != epoch:
        raise FencedError(name, epoch, lease[0])


def ids_of(oids: Iterable[bytes]) -> list[bytes]:
    """``oids`` without repeats, in first-seen order (one query batch per 500)."""
    return list(dict.fromkeys(oids))
