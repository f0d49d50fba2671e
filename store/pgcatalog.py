"""The shared catalog on PostgreSQL (psycopg 3 with a psycopg-pool connection pool).

The same tables as the embedded index (store/schema.py documents every column), in one
database shared by every host of a store, plus a ``host`` column where a row belongs to
one host (``state_dirs``) and the session registry (``sessions``). The interface and its
rules are in store/catalog.py; both implementations pass tests/test_catalog.py.

Schema: created and migrated by the product. ``catalog_meta.schema_version`` counts the
entries of ``MIGRATIONS`` applied; opening a catalog applies the missing ones in order,
in one transaction under an advisory lock (two hosts opening a new catalog at once do
not race), and refuses (``CatalogError``) a catalog of a newer version than this program.

Version 2 adds the cross-host GC protocol (store/sharedgc.py): ``writer_pins(holder,
host, started_ns, expires_ns)``, one row per pinned writer, and ``packs.indexed_ns``, when
a pack was indexed (0 for packs of version 1 and rebuilt ones), which the GC grace period
reads; the GC lease is the ``leases`` row ``gc``, and ``config.gc_generation`` counts GC
runs that deleted index rows.

Version 4 binds the catalog to the store it indexes: ``catalog_meta.store`` is the
bucket and prefix of the first store that opened it, and a catalog opened by another store
is refused (``bind_store``).

Connections: a pool of ``max_size`` connections, each checked before it is handed out, so
after a PostgreSQL restart the next operation reconnects (the operation that was running
when the server went away fails with ``CatalogError``). Opening connects once directly,
so a server that refuses (down, no such database) is a ``CatalogError`` with the server's
own reason at once, and one that refuses the login (a wrong or missing password, no such
role) a ``CatalogAuthError``; every direct connection waits ``connect_timeout(dsn)`` (3 s
by default) for the server, whatever the pool's timeout. An operation the pool gives no
connection within ``PROBE_AFTER_S`` (0.5 s) asks the server with one direct connection, so
the first operation of an outage fails within about that, not the pool's timeout (10 s).
While the server is unreachable, each operation asks it with one direct connection and
fails at once with its reason; the
first that gets through puts a fresh pool in place (the old pool's own reconnection
attempts back off up to minutes), so the next operation after an outage of any length
succeeds. Every method is one transaction.
Leases and fenced journal appends lock their ``leases`` row (``SELECT ... FOR UPDATE``), so
two hosts racing for one lease are serialized and exactly one wins.
"""

from __future__ import annotations

import atexit
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .catalog import (
    Dump,
    JournalRow,
    LabelRow,
    Lease,
    PackRow,
    SnapshotRow,
    Summary,
    decide_acquire,
    location,
    object_row,
)
from .errors import (
    CatalogAuthError,
    CatalogError,
    FencedError,
    LeaseLostError,
    StoreError,
    WriterPinLostError,
    redact,
)
from .pack import Location

# Advisory lock key of schema migrations (any constant unique to this product).
_MIGRATION_LOCK = 0x72657769

MIGRATIONS: list[str] = [
    # 1: the catalog tables.
    """
    CREATE TABLE objects (id bytea PRIMARY KEY, kind smallint NOT NULL, pack text NOT NULL,
        rec_offset bigint NOT NULL, rec_length bigint NOT NULL, codec smallint NOT NULL,
        inner_offset bigint NOT NULL, raw_length bigint NOT NULL);
    CREATE INDEX objects_pack ON objects (pack);
    CREATE TABLE packs (key text PRIMARY KEY, size bigint NOT NULL, objects bigint NOT NULL);
    CREATE TABLE snapshots (ref text PRIMARY KEY, time_ns bigint NOT NULL,
        origin text NOT NULL, label text, key text NOT NULL);
    CREATE TABLE journal (session text NOT NULL, seq bigint NOT NULL,
        time_ns bigint NOT NULL, epoch bigint NOT NULL, event text NOT NULL,
        ref text NOT NULL, trigger_ text, consistency text, key text NOT NULL,
        PRIMARY KEY (session, seq));
    CREATE TABLE named_refs (name text PRIMARY KEY, ref text NOT NULL);
    CREATE TABLE state_dirs (host text NOT NULL, path text NOT NULL,
        PRIMARY KEY (host, path));
    CREATE TABLE sessions (id text PRIMARY KEY, host text NOT NULL, record text NOT NULL);
    CREATE TABLE leases (name text PRIMARY KEY, holder text NOT NULL, epoch bigint NOT NULL,
        expires_ns bigint NOT NULL);
    CREATE TABLE config (key text PRIMARY KEY, value text NOT NULL);
    """,
    # 2: the cross-host GC protocol (store/sharedgc.py): writer pins, pack index times.
    """
    CREATE TABLE writer_pins (holder text PRIMARY KEY, host text NOT NULL,
        started_ns bigint NOT NULL, expires_ns bigint NOT NULL);
    ALTER TABLE packs ADD COLUMN indexed_ns bigint NOT NULL DEFAULT 0;
    """,
    # 3: every label a listed Ref was given (the snapshot list row keeps the newest).
    """
    CREATE TABLE snapshot_labels (ref text NOT NULL, label text NOT NULL,
        time_ns bigint NOT NULL, key text NOT NULL, PRIMARY KEY (ref, label));
    INSERT INTO snapshot_labels(ref, label, time_ns, key)
        SELECT ref, label, time_ns, key FROM snapshots WHERE label IS NOT NULL;
    """,
    # 4: the catalog is bound to the store it indexes: catalog_meta 'store' (its bucket and
    # prefix, ``config.canonical_blobs``) is written by the first store that opens it
    # (``bind_store``); a program of version 3 or older, which never checks it, refuses a
    # catalog of version 4.
    "SELECT 1",
]
SCHEMA_VERSION = len(MIGRATIONS)

_PUT_LABEL = ("INSERT INTO snapshot_labels(ref, label, time_ns, key) VALUES (%s, %s, %s, %s) "
              "ON CONFLICT (ref, label) DO UPDATE SET time_ns=excluded.time_ns, "
              "key=excluded.key")

_INSERT_OBJECT = ("INSERT INTO objects(id, kind, pack, rec_offset, rec_length, codec, "
                  "inner_offset, raw_length) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) "
                  "ON CONFLICT (id) DO NOTHING")
"""One object index row; an id already indexed (another writer's copy) is kept."""


PROBE_AFTER_S = 0.5
"""How long an operation waits for a pooled connection (s) before it asks the server
directly whether it is still there (``PostgresCatalog._getconn``)."""

_NOW = "(extract(epoch from now()) * 1000000000)::bigint"
"""The server's clock in ns since the epoch, as SQL: leases, pins and ``packs.indexed_ns``
are stamped and compared with it, never with a host's clock."""


class PostgresCatalog:
    """The catalog in the PostgreSQL database at ``dsn`` (a ``postgresql://`` URL or a
    libpq connection string). Raises CatalogError if its server does not answer a direct
    connection within ``connect_timeout(dsn)`` seconds, refuses it, or its schema is newer
    than this program's; StoreConfigError for a connect timeout setting that is not one.
    ``timeout_s``: how long an operation waits for a connection of the pool. ``store``:
    the bucket and prefix of the store opening it (``config.canonical_blobs``), checked
    against the one the catalog records, and recorded by a first open (``bind_store``;
    ``holds(pack_key)`` tells whether that store holds a pack, for a catalog of an earlier
    version that records none); None checks nothing (a catalog opened on its own)."""

    shared = True

    def __init__(self, dsn: str, *, max_size: int = 8, timeout_s: float = 10.0,
                 store: str | None = None,
                 holds: Callable[[str], bool] | None = None) -> None:
        import psycopg

        self._psycopg = psycopg
        self.dsn = dsn
        self.transactions = 0  # transactions begun: round trips to the server (stats, tests)
        self._count_lock = threading.Lock()
        self._max_size = max_size
        self._timeout_s = timeout_s
        self._connect_s = connect_timeout(dsn)
        self._pool_lock = threading.Lock()
        self._down = False  # the last direct attempt found the server unreachable
        # One direct connection first: a server that refuses (gone, no such database or
        # role, bad password) is reported at once with its own reason, and the schema is
        # migrated on it while the pool opens its connections.
        first = self._connect()
        try:
            self._migrate(first, store, holds)
        except psycopg.Error as e:
            raise CatalogError(f"catalog {redact(dsn)}: {_one_line(e)}") from None
        finally:
            first.close()
        self._pool: Any = self._new_pool()

    def __repr__(self) -> str:
        return f"PostgresCatalog({redact(self.dsn)})"

    def _connect(self) -> Any:
        """A new connection outside the pool; CatalogError naming the server's reason if
        there is none within the timeout (and ``_down`` set until one succeeds)."""
        try:
            conn = self._psycopg.connect(self.dsn, autocommit=True,
                                         connect_timeout=self._connect_s[0])
        except (self._psycopg.Error, OSError) as e:
            self._down = True
            raise _connect_error(self.dsn, e, self._connect_s) from None
        self._down = False
        return conn

    def _new_pool(self) -> Any:
        from psycopg_pool import ConnectionPool

        pool = ConnectionPool(
            self.dsn, min_size=1, max_size=self._max_size, open=False,
            timeout=self._timeout_s, check=ConnectionPool.check_connection,
            kwargs={"connect_timeout": max(1, int(self._timeout_s)), "autocommit": True},
            name="rewindfs-catalog")
        pool.open(wait=False)
        # Closed at exit on the main thread at the latest: a pool left to its __del__ may be
        # collected on one of its own worker threads, which cannot join itself
        # ("cannot join current thread" printed on stderr by the interpreter).
        atexit.register(pool.close)
        return pool

    def _getconn(self) -> tuple[Any, Any]:
        """``(pool, connection)``: a connection of the pool, to give back to that pool.

        When the pool has none to give within ``PROBE_AFTER_S`` (a server that went away
        since the last operation: the pool would retry until its timeout), or the last
        attempt found the server unreachable, one direct connection asks the server at
        once: still gone is CatalogError with its reason (so the first operation of an
        outage fails within about a connection attempt, and each later one at once, not
        after the pool's timeout); there, the pool is waited for the rest of its timeout
        (it is busy), and if it still has none, or the server was down before, a fresh
        pool takes the old one's place, whose own reconnection attempts back off
        exponentially (psycopg_pool: 1, 2, 4, ... s, up to its 5 min reconnect timeout),
        so the next operation after the server returns succeeds."""
        from psycopg_pool import PoolClosed, PoolTimeout

        pool = self._pool
        if pool is not None and not self._down:
            first = min(self._timeout_s, PROBE_AFTER_S)
            try:
                return pool, pool.getconn(timeout=first)
            except PoolClosed:  # another thread replaced it meanwhile
                pass
            except PoolTimeout:
                self._probe(pool)
                try:
                    return pool, pool.getconn(timeout=max(0.0, self._timeout_s - first))
                except (PoolTimeout, PoolClosed):
                    pass
        self._probe(pool)
        return self._replace_pool(pool, self._new_pool)

    def _probe(self, pool: Any) -> None:
        """Ask the server with one direct connection; if it is unreachable, retire
        ``pool`` (its own attempts stop; the first success makes a new one) and raise
        CatalogError with the reason."""
        try:
            self._connect().close()
        except CatalogError:
            self._replace_pool(pool, None)
            raise

    def _replace_pool(self, old: Any, make: Callable[[], Any] | None) -> Any:
        """Put ``make()`` (None: no pool) in place of pool ``old`` unless another thread
        replaced it already; returns ``(pool, connection)`` with ``make``."""
        with self._pool_lock:
            if self._pool is old:
                self._pool = None if make is None else make()
                if old is not None:  # closed aside: its workers stop within its timeout
                    threading.Thread(target=_close_pool, args=(old,),
                                     name="rewindfs-catalog-close", daemon=True).start()
            pool = self._pool
        if make is None:
            return None
        if pool is None:  # another thread found the server down meanwhile
            return self._getconn()
        return pool, pool.getconn()

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """A connection inside one transaction; database failures become CatalogError
        (the store's own typed errors pass through)."""
        psycopg = self._psycopg
        with self._count_lock:
            self.transactions += 1
        try:
            pool, conn = self._getconn()
            try:
                with conn.transaction():
                    yield conn
            finally:
                pool.putconn(conn)
        except StoreError:
            raise
        except (psycopg.Error, OSError) as e:
            raise CatalogError(f"catalog {redact(self.dsn)}: {type(e).__name__}: "
                               f"{_one_line(e)}") from None
        except Exception as e:
            if type(e).__module__.startswith("psycopg_pool"):
                raise CatalogError(f"catalog {redact(self.dsn)}: {redact(str(e))}") from None
            raise

    def _migrate(self, conn: Any, store: str | None,
                 holds: Callable[[str], bool] | None) -> None:
        with conn.transaction():
            c = conn
            c.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            c.execute("CREATE TABLE IF NOT EXISTS catalog_meta "
                      "(key text PRIMARY KEY, value text NOT NULL)")
            row = c.execute("SELECT value FROM catalog_meta WHERE key='schema_version'"
                            ).fetchone()
            have = _schema_version(self.dsn, row[0]) if row else 0
            if have > SCHEMA_VERSION:
                raise CatalogError(f"the catalog at {redact(self.dsn)} has schema version "
                                   f"{have}; this program knows up to {SCHEMA_VERSION}")
            for sql in MIGRATIONS[have:]:
                c.execute(sql)
            c.execute("INSERT INTO catalog_meta(key, value) VALUES ('schema_version', %s) "
                      "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                      (str(SCHEMA_VERSION),))
            if store is not None:
                bind_store(c, self.dsn, store, holds, record=True)

    def schema_version(self) -> int:
        with self._tx() as c:
            row = c.execute("SELECT value FROM catalog_meta WHERE key='schema_version'"
                            ).fetchone()
        return _schema_version(self.dsn, row[0])

    # -- objects ---------------------------------------------------------------------

    def has(self, oid: bytes) -> bool:
        with self._tx() as c:
            return c.execute("SELECT 1 FROM objects WHERE id=%s", (oid,)).fetchone() is not None

    def locate(self, oid: bytes) -> Location | None:
        with self._tx() as c:
            row = c.execute("SELECT id, kind, pack, rec_offset, rec_length, codec, "
                            "inner_offset, raw_length FROM objects WHERE id=%s",
                            (oid,)).fetchone()
        return None if row is None else location(row)

    def locate_many(self, ids: list[bytes]) -> dict[bytes, Location]:
        out: dict[bytes, Location] = {}
        if not ids:
            return out
        with self._tx() as c:
            for row in c.execute("SELECT id, kind, pack, rec_offset, rec_length, codec, "
                                 "inner_offset, raw_length FROM objects WHERE id = ANY(%s)",
                                 (list(ids),)):
                loc = location(row)
                out[bytes(loc.oid)] = loc
        return out

    def add_objects(self, rows: list[Location], packs: list[PackRow],
                    pin: str | None = None) -> None:
        """Index ``rows`` and ``packs`` (stamped with the time, ``indexed_ns``). With
        ``pin``, refuse (WriterPinLostError) unless that writer pin still exists, in the
        same transaction (store/sharedgc.py)."""
        with self._tx() as c, c.cursor() as cur:
            if pin is not None and cur.execute(
                    "SELECT 1 FROM writer_pins WHERE holder=%s FOR UPDATE",
                    (pin,)).fetchone() is None:
                raise WriterPinLostError(pin)
            cur.executemany(_INSERT_OBJECT, [object_row(r) for r in rows])
            cur.executemany("INSERT INTO packs(key, size, objects, indexed_ns) "
                            f"VALUES (%s, %s, %s, {_NOW}) ON CONFLICT (key) DO NOTHING",
                            packs)

    # -- the cross-host GC protocol (store/sharedgc.py) --------------------------------

    def pin_writer(self, holder: str, host: str, ttl_ns: int,
                   now_ns: int | None = None) -> str | None:
        """Pin writer ``holder`` unless a GC holds its lease unexpired (then None); returns
        the catalog's ``gc_generation`` (``"0"`` before any GC), read in the same
        transaction. The ``gc`` lease row is read FOR SHARE, so a pin and a GC start are
        serialized."""
        from .sharedgc import GENERATION

        with self._tx() as c:
            runs, now_ns = _gc_runs(c, now_ns)
            if runs:
                return None
            c.execute("INSERT INTO writer_pins(holder, host, started_ns, expires_ns) "
                      "VALUES (%s, %s, %s, %s) ON CONFLICT (holder) DO UPDATE SET "
                      "expires_ns=excluded.expires_ns", (holder, host, now_ns, now_ns + ttl_ns))
            row = c.execute("SELECT value FROM config WHERE key=%s", (GENERATION,)).fetchone()
        return "0" if row is None else str(row[0])

    def set_mount_pins(self, name: str, refs: list[str], now_ns: int | None,
                       after_gc: bool) -> bool:
        """Make the named refs ``name`` (the first of ``refs``) and ``name/1``, ``name/2``,
        ... (the others) exactly ``refs`` (none: drop them all), in one transaction. With
        ``after_gc``, refuse (False, nothing changed) while a GC holds its lease unexpired,
        serialized with its start as ``pin_writer`` is: a GC that started before never
        misses a Ref this adds while it runs."""
        with self._tx() as c:
            if after_gc and _gc_runs(c, now_ns)[0]:
                return False
            c.execute("DELETE FROM named_refs WHERE name=%s OR starts_with(name, %s)",
                      (name, name + "/"))
            if refs:
                with c.cursor() as cur:
                    cur.executemany("INSERT INTO named_refs(name, ref) VALUES (%s, %s)",
                                    [(name if i == 0 else f"{name}/{i}", r)
                                     for i, r in enumerate(refs)])
        return True

    def renew_writer_pin(self, holder: str, ttl_ns: int, now_ns: int | None = None) -> None:
        """Extend pin ``holder`` to ``now_ns`` (None: the server's clock) + ``ttl_ns``;
        WriterPinLostError if a GC removed it."""
        with self._tx() as c:
            n = c.execute(f"UPDATE writer_pins SET expires_ns=COALESCE(%s, {_NOW}) + %s "
                          "WHERE holder=%s", (now_ns, ttl_ns, holder)).rowcount
        if not n:
            raise WriterPinLostError(holder)

    def unpin_writer(self, holder: str) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM writer_pins WHERE holder=%s", (holder,))

    def writer_pins(self) -> list[tuple[str, str, int, int]]:
        """Every pin: ``(holder, host, started_ns, expires_ns)``."""
        with self._tx() as c:
            return [(r[0], r[1], int(r[2]), int(r[3])) for r in c.execute(
                "SELECT holder, host, started_ns, expires_ns FROM writer_pins ORDER BY holder")]

    def drop_writer_pins(self, holders: list[str]) -> None:
        if holders:
            with self._tx() as c:
                c.execute("DELETE FROM writer_pins WHERE holder = ANY(%s)", (holders,))

    def gc_view(self) -> tuple[list[tuple[bytes, int, str]], dict[str, tuple[int, int]]]:
        """In one snapshot of the catalog: every object ``(id, kind, pack)`` and every pack
        ``key -> (size, indexed_ns)``."""
        with self._tx() as c:
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            objects = [(bytes(r[0]), int(r[1]), str(r[2])) for r in c.execute(
                "SELECT id, kind, pack FROM objects")]
            packs = {r[0]: (int(r[1]), int(r[2])) for r in c.execute(
                "SELECT key, size, indexed_ns FROM packs")}
        return objects, packs

    def gc_drop(self, keys: list[str], lease: Lease) -> int:
        """Drop the index rows of packs ``keys`` and bump ``gc_generation``, in one
        transaction that first checks GC ``lease`` is still held at its epoch
        (LeaseLostError otherwise). Returns the object rows deleted."""
        from .sharedgc import GENERATION

        with self._tx() as c:
            row = c.execute("SELECT holder, epoch FROM leases WHERE name=%s FOR UPDATE",
                            (lease.name,)).fetchone()
            if row is None or row[0] != lease.holder or int(row[1]) != lease.epoch:
                raise LeaseLostError(lease.name, lease.holder, lease.epoch)
            n = int(c.execute("DELETE FROM objects WHERE pack = ANY(%s)", (keys,)).rowcount)
            c.execute("DELETE FROM packs WHERE key = ANY(%s)", (keys,))
            c.execute("INSERT INTO config(key, value) VALUES (%s, '1') ON CONFLICT (key) "
                      "DO UPDATE SET value = (config.value::bigint + 1)::text", (GENERATION,))
        return n

    def packs(self) -> list[PackRow]:
        with self._tx() as c:
            return [(r[0], int(r[1]), int(r[2])) for r in c.execute(
                "SELECT key, size, objects FROM packs ORDER BY key")]

    # -- snapshots -------------------------------------------------------------------

    def snapshot(self, ref: str) -> SnapshotRow | None:
        with self._tx() as c:
            row = c.execute("SELECT ref, time_ns, origin, label, key FROM snapshots "
                            "WHERE ref=%s", (ref,)).fetchone()
        return None if row is None else (row[0], int(row[1]), row[2], row[3], row[4])

    def before_listing(self, ref: str, tree_id: bytes) -> tuple[int | None,
                                                                SnapshotRow | None]:
        with self._tx() as c:
            row = c.execute("SELECT (SELECT kind FROM objects WHERE id=%s), s.ref, s.time_ns, "
                            "s.origin, s.label, s.key FROM (SELECT 1) AS one "
                            "LEFT JOIN snapshots s ON s.ref=%s", (tree_id, ref)).fetchone()
        kind = None if row[0] is None else int(row[0])
        return kind, None if row[1] is None else (row[1], int(row[2]), row[3], row[4], row[5])

    def put_snapshot(self, row: SnapshotRow) -> None:
        with self._tx() as c:
            c.execute("INSERT INTO snapshots(ref, time_ns, origin, label, key) "
                      "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (ref) DO UPDATE SET "
                      "time_ns=excluded.time_ns, origin=excluded.origin, "
                      "label=excluded.label, key=excluded.key", row)
            if row[3] is not None:
                c.execute(_PUT_LABEL, (row[0], row[3], row[1], row[4]))

    def delete_snapshot(self, ref: str) -> bool:
        with self._tx() as c:
            c.execute("DELETE FROM snapshot_labels WHERE ref=%s", (ref,))
            return int(c.execute("DELETE FROM snapshots WHERE ref=%s", (ref,)).rowcount) > 0

    def snapshot_labels(self) -> list[LabelRow]:
        with self._tx() as c:
            return [(r[0], r[1], int(r[2]), r[3]) for r in c.execute(
                "SELECT ref, label, time_ns, key FROM snapshot_labels ORDER BY time_ns, ref")]

    def snapshots(self) -> list[SnapshotRow]:
        with self._tx() as c:
            return [(r[0], int(r[1]), r[2], r[3], r[4]) for r in c.execute(
                "SELECT ref, time_ns, origin, label, key FROM snapshots "
                "ORDER BY time_ns, ref")]

    # -- journals --------------------------------------------------------------------

    def last_seq(self, session: str) -> int:
        with self._tx() as c:
            row = c.execute("SELECT MAX(seq) FROM journal WHERE session=%s",
                            (session,)).fetchone()
        return int(row[0] or 0)

    def add_journal(self, row: JournalRow, fence: str | None = None) -> bool:
        with self._tx() as c:
            if fence is not None:
                _check_fence(c, fence, row[3])
            n = c.execute("INSERT INTO journal(session, seq, time_ns, epoch, event, ref, "
                          "trigger_, consistency, key) VALUES (%s, %s, %s, %s, %s, %s, %s, "
                          "%s, %s) ON CONFLICT (session, seq) DO NOTHING", row).rowcount
        return int(n) > 0

    def journal(self, session: str) -> list[JournalRow]:
        with self._tx() as c:
            return [(r[0], int(r[1]), int(r[2]), int(r[3]), r[4], r[5], r[6], r[7], r[8])
                    for r in c.execute(
                        "SELECT session, seq, time_ns, epoch, event, ref, trigger_, "
                        "consistency, key FROM journal WHERE session=%s ORDER BY seq",
                        (session,))]

    def journal_refs(self) -> list[str]:
        with self._tx() as c:
            return [r[0] for r in c.execute("SELECT DISTINCT ref FROM journal")]

    # -- named refs ------------------------------------------------------------------

    def set_named_ref(self, name: str, ref: str) -> None:
        with self._tx() as c:
            c.execute("INSERT INTO named_refs(name, ref) VALUES (%s, %s) "
                      "ON CONFLICT (name) DO UPDATE SET ref=excluded.ref", (name, ref))

    def named_ref(self, name: str) -> str | None:
        with self._tx() as c:
            row = c.execute("SELECT ref FROM named_refs WHERE name=%s", (name,)).fetchone()
        return None if row is None else str(row[0])

    def delete_named_ref(self, name: str) -> bool:
        with self._tx() as c:
            return int(c.execute("DELETE FROM named_refs WHERE name=%s",
                                 (name,)).rowcount) > 0

    def named_refs(self) -> list[tuple[str, str]]:
        with self._tx() as c:
            return [(r[0], r[1]) for r in c.execute(
                "SELECT name, ref FROM named_refs ORDER BY name")]

    # -- state directories -------------------------------------------------------------

    def add_state_dir(self, path: str, host: str) -> None:
        with self._tx() as c:
            c.execute("INSERT INTO state_dirs(host, path) VALUES (%s, %s) "
                      "ON CONFLICT DO NOTHING", (host, path))

    def remove_state_dir(self, path: str, host: str) -> None:
        with self._tx() as c:
            c.execute("DELETE FROM state_dirs WHERE host=%s AND path=%s", (host, path))

    def state_dirs(self, host: str | None = None) -> list[tuple[str, str]]:
        with self._tx() as c:
            if host is None:
                rows = c.execute("SELECT path, host FROM state_dirs ORDER BY host, path")
            else:
                rows = c.execute("SELECT path, host FROM state_dirs WHERE host=%s "
                                 "ORDER BY path", (host,))
            return [(r[0], r[1]) for r in rows]

    # -- sessions --------------------------------------------------------------------

    def put_session(self, session: str, host: str, record: str,
                    fence: str | None = None, epoch: int = 0) -> None:
        with self._tx() as c:
            if fence is not None:
                _check_fence(c, fence, epoch)
            c.execute("INSERT INTO sessions(id, host, record) VALUES (%s, %s, %s) "
                      "ON CONFLICT (id) DO UPDATE SET host=excluded.host, "
                      "record=excluded.record", (session, host, record))

    def session(self, session: str) -> tuple[str, str] | None:
        with self._tx() as c:
            row = c.execute("SELECT host, record FROM sessions WHERE id=%s",
                            (session,)).fetchone()
        return None if row is None else (row[0], row[1])

    def sessions(self) -> list[tuple[str, str, str]]:
        with self._tx() as c:
            return [(r[0], r[1], r[2]) for r in c.execute(
                "SELECT id, host, record FROM sessions ORDER BY id")]

    def delete_session(self, session: str) -> bool:
        with self._tx() as c:
            return int(c.execute("DELETE FROM sessions WHERE id=%s",
                                 (session,)).rowcount) > 0

    # -- leases ----------------------------------------------------------------------

    def clock_ns(self) -> int:
        """The server's clock (ns since the epoch, ``now()``): the one clock of every lease,
        pin and grace period of this catalog, whatever the hosts' clocks say."""
        with self._tx() as c:
            return int(c.execute(f"SELECT {_NOW}").fetchone()[0])

    def lease_acquire(self, name: str, holder: str, ttl_ns: int, now_ns: int | None,
                      holder_is_dead: Callable[[str], bool]) -> Lease:
        with self._tx() as c:
            c.execute("INSERT INTO leases(name, holder, epoch, expires_ns) "
                      "VALUES (%s, '', 0, 0) ON CONFLICT (name) DO NOTHING", (name,))
            h, e, x, server = c.execute(f"SELECT holder, epoch, expires_ns, {_NOW} FROM "
                                        "leases WHERE name=%s FOR UPDATE", (name,)).fetchone()
            now_ns = int(server) if now_ns is None else now_ns
            row = None if (h, e, x) == ("", 0, 0) else (h, int(e), int(x))
            epoch = decide_acquire(row, holder, now_ns, holder_is_dead, name)
            lease = Lease(name, holder, epoch, now_ns + ttl_ns)
            c.execute("UPDATE leases SET holder=%s, epoch=%s, expires_ns=%s WHERE name=%s",
                      (holder, epoch, lease.expires_ns, name))
        return lease

    def lease_renew(self, lease: Lease, ttl_ns: int, now_ns: int | None) -> Lease:
        with self._tx() as c:
            row = c.execute(f"SELECT holder, epoch, {_NOW} FROM leases WHERE name=%s "
                            "FOR UPDATE", (lease.name,)).fetchone()
            if row is None or row[0] != lease.holder or int(row[1]) != lease.epoch:
                raise LeaseLostError(lease.name, lease.holder, lease.epoch)
            now_ns = int(row[2]) if now_ns is None else now_ns
            new = Lease(lease.name, lease.holder, lease.epoch, now_ns + ttl_ns)
            c.execute("UPDATE leases SET expires_ns=%s WHERE name=%s",
                      (new.expires_ns, lease.name))
        return new

    def lease_release(self, lease: Lease) -> None:
        with self._tx() as c:
            c.execute("UPDATE leases SET holder='', expires_ns=0 WHERE name=%s AND holder=%s "
                      "AND epoch=%s", (lease.name, lease.holder, lease.epoch))

    def lease(self, name: str) -> tuple[str, int, int] | None:
        with self._tx() as c:
            row = c.execute("SELECT holder, epoch, expires_ns FROM leases WHERE name=%s",
                            (name,)).fetchone()
        return None if row is None else (row[0], int(row[1]), int(row[2]))

    # -- whole catalog ---------------------------------------------------------------

    def dump(self) -> Dump:
        with self._tx() as c:
            c.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            return Dump(
                objects=[(bytes(r[0]), *r[1:]) for r in c.execute(
                    "SELECT id, kind, pack, rec_offset, rec_length, codec, inner_offset, "
                    "raw_length FROM objects")],
                packs=[(r[0], int(r[1]), int(r[2])) for r in c.execute(
                    "SELECT key, size, objects FROM packs")],
                snapshots=[(r[0], int(r[1]), r[2], r[3], r[4]) for r in c.execute(
                    "SELECT ref, time_ns, origin, label, key FROM snapshots")],
                journal=[(r[0], int(r[1]), int(r[2]), int(r[3]), r[4], r[5], r[6], r[7], r[8])
                         for r in c.execute(
                             "SELECT session, seq, time_ns, epoch, event, ref, trigger_, "
                             "consistency, key FROM journal ORDER BY session, seq")],
                named=[(r[0], r[1]) for r in c.execute("SELECT name, ref FROM named_refs")])

    def summary(self) -> Summary:
        with self._tx() as c:
            kinds = {int(k): (int(n), int(b or 0)) for k, n, b in c.execute(
                "SELECT kind, COUNT(*), SUM(raw_length) FROM objects GROUP BY kind")}
            npacks, stored = c.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM packs"
                                       ).fetchone()
            sessions, events = c.execute("SELECT COUNT(DISTINCT session), COUNT(*) "
                                         "FROM journal").fetchone()
        return Summary(kinds, int(npacks), int(stored), int(sessions), int(events))

    def apply_history(self, puts: list[SnapshotRow], forgets: list[tuple[str, str]],
                      journal: list[JournalRow], labels: Sequence[LabelRow] = ()) -> int:
        changed = 0
        with self._tx() as c:
            for lr in [(r[0], r[3], r[1], r[4]) for r in puts if r[3] is not None] + list(labels):
                changed += int(c.execute(
                    _PUT_LABEL + " WHERE snapshot_labels.key < excluded.key", lr).rowcount)
            for ref, key in forgets:
                c.execute("DELETE FROM snapshot_labels WHERE ref=%s AND key < %s", (ref, key))
            for row in puts:
                changed += int(c.execute(
                    "INSERT INTO snapshots(ref, time_ns, origin, label, key) "
                    "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (ref) DO UPDATE SET "
                    "time_ns=excluded.time_ns, origin=excluded.origin, label=excluded.label, "
                    "key=excluded.key WHERE snapshots.key < excluded.key", row).rowcount)
            for ref, key in forgets:
                changed += int(c.execute("DELETE FROM snapshots WHERE ref=%s AND key < %s",
                                         (ref, key)).rowcount)
            for jr in journal:
                changed += int(c.execute(
                    "INSERT INTO journal(session, seq, time_ns, epoch, event, ref, trigger_, "
                    "consistency, key) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT (session, seq) DO NOTHING", jr).rowcount)
        return changed

    def replace_all(self, packs: list[tuple[str, int, list[Location]]],
                    snapshots: list[SnapshotRow], journal: list[JournalRow],
                    labels: list[LabelRow] | None = None) -> int:
        n = 0
        if labels is None:
            labels = [(r[0], r[3], r[1], r[4]) for r in snapshots if r[3] is not None]
        with self._tx() as c, c.cursor() as cur:
            cur.execute("DELETE FROM snapshot_labels")
            if labels:
                cur.executemany(_PUT_LABEL, labels)
            for table in ("objects", "packs", "snapshots", "journal"):
                cur.execute(f"DELETE FROM {table}")
            for key, size, rows in packs:
                cur.execute("INSERT INTO packs(key, size, objects) VALUES (%s, %s, %s)",
                            (key, size, len(rows)))
                before = cur.execute("SELECT COUNT(*) FROM objects").fetchone()[0]
                cur.executemany(_INSERT_OBJECT, [object_row(r) for r in rows])
                n += int(cur.execute("SELECT COUNT(*) FROM objects").fetchone()[0]) - int(before)
            cur.executemany("INSERT INTO snapshots(ref, time_ns, origin, label, key) "
                            "VALUES (%s, %s, %s, %s, %s)", snapshots)
            cur.executemany("INSERT INTO journal(session, seq, time_ns, epoch, event, ref, "
                            "trigger_, consistency, key) VALUES (%s, %s, %s, %s, %s, %s, %s, "
                            "%s, %s) ON CONFLICT (session, seq) DO NOTHING", journal)
        return n

    # -- config ----------------------------------------------------------------------

    def config_value(self, key: str) -> str | None:
        with self._tx() as c:
            row = c.execute("SELECT value FROM config WHERE key=%s", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_config(self, key: str, value: str | None) -> None:
        with self._tx() as c:
            if value is None:
                c.execute("DELETE FROM config WHERE key=%s", (key,))
            else:
                c.execute("INSERT INTO config(key, value) VALUES (%s, %s) ON CONFLICT (key) "
                          "DO UPDATE SET value=excluded.value", (key, value))

    def close(self) -> None:
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            _close_pool(pool)


def _close_pool(pool: Any) -> None:
    """Close a pool of ``_new_pool`` and drop its exit hook."""
    pool.close()
    atexit.unregister(pool.close)


def probe(dsn: str, store: str | None = None,
          holds: Callable[[str], bool] | None = None) -> int | None:
    """The schema version of the catalog at ``dsn`` (None: not created yet), read over one
    connection (``connect_timeout(dsn)``) without creating or migrating anything; with
    ``store``, StoreConfigError if the catalog belongs to another store (``bind_store``,
    nothing recorded). Raises CatalogError naming the server's reason if it cannot be
    reached or read."""
    import psycopg

    timeout = connect_timeout(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=timeout[0]) as conn:
            made = conn.execute("SELECT to_regclass('catalog_meta')").fetchone()
            if made is None or made[0] is None:
                return None
            row = conn.execute("SELECT value FROM catalog_meta WHERE key='schema_version'"
                               ).fetchone()
            if store is not None:
                bind_store(conn, dsn, store, holds, record=False)
    except (psycopg.Error, OSError) as e:
        raise _connect_error(dsn, e, timeout) from None
    return None if row is None else _schema_version(dsn, row[0])


def _schema_version(dsn: str, text: str) -> int:
    """The schema version ``catalog_meta`` holds as ``text``; CatalogError naming it (at
    most 40 characters, escaped) if it is not a whole number from 0."""
    if not re.fullmatch(r"[0-9]{1,9}", text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise CatalogError(f"the catalog at {redact(dsn)} has schema version {shown!r}, "
                           f"not a number (catalog_meta.schema_version; this program knows "
                           f"up to {SCHEMA_VERSION}): it was not written by rewindfs")
    return int(text)


STORE_KEY = "store"
"""The ``catalog_meta`` key recording the store a catalog indexes (schema version 4)."""

_SAMPLE_PACKS = 3
"""How many of its newest packs a catalog recording no store is checked for in the store
that opens it."""


def bind_store(c: Any, dsn: str, store: str, holds: Callable[[str], bool] | None, *,
               record: bool) -> None:
    """Check that the catalog on connection ``c`` indexes ``store`` (``s3://BUCKET[/PREFIX]``,
    canonical), and with ``record`` write it as the catalog's store if it records none.

    A catalog records the store that first opened it (``catalog_meta`` ``STORE_KEY``). One
    recording another store is StoreConfigError (exit 2) naming both: its packs and
    history are elsewhere, and a snapshot through it would dedup against packs this store
    does not hold, a rebuild-index replace its rows with this store's. A catalog of an
    earlier version records none: it adopts ``store`` if it indexes no pack, or if
    ``store`` holds one of its newest packs (``holds``); if it holds none of them the
    catalog is refused as another store's; if ``holds`` fails (BackendError: the bucket
    does not answer) nothing is recorded and the next open checks again."""
    from .config import StoreConfigError
    from .errors import BackendError

    row = c.execute("SELECT value FROM catalog_meta WHERE key=%s", (STORE_KEY,)).fetchone()
    if row is not None:
        if row[0] != store:
            raise StoreConfigError(
                f"the catalog {redact(dsn)} indexes the store {row[0]}, not {store} (given); "
                f"use --store {row[0]} with this catalog, or another catalog for {store}")
        return
    if holds is not None:
        sample = [k for (k,) in c.execute("SELECT key FROM packs ORDER BY indexed_ns DESC, "
                                          "key LIMIT %s", (_SAMPLE_PACKS,))]
        if sample:
            try:
                held = any(holds(k) for k in sample)
            except BackendError:
                return
            if not held:
                raise StoreConfigError(
                    f"the catalog {redact(dsn)} indexes packs that the store {store} does "
                    f"not hold (e.g. {sample[0]}): it belongs to another store; give that "
                    "store's --store, or another catalog for this one")
    elif c.execute("SELECT 1 FROM packs LIMIT 1").fetchone() is not None:
        return  # cannot tell whether it is this store's: recorded by a later open
    if record:
        c.execute("INSERT INTO catalog_meta(key, value) VALUES (%s, %s) "
                  "ON CONFLICT (key) DO NOTHING", (STORE_KEY, store))


CONNECT_TIMEOUT_ENV = "REWINDFS_CATALOG_CONNECT_TIMEOUT"
DEFAULT_CONNECT_TIMEOUT_S = 3


def connect_timeout(dsn: str) -> tuple[int, str]:
    """``(seconds, setting)``: how long one direct connection to the catalog at ``dsn``
    waits for its server (the probe, a catalog's first connection and each one asking a
    server its pool cannot reach), and what set it: the URL's ``connect_timeout``, else
    ``REWINDFS_CATALOG_CONNECT_TIMEOUT``, else libpq's ``PGCONNECT_TIMEOUT``, else the
    default (``DEFAULT_CONNECT_TIMEOUT_S``). Raises StoreConfigError (exit 2) naming a
    setting that is not a whole number of seconds from 2 (libpq waits 2 s at least)."""
    import os

    from psycopg import Error
    from psycopg.conninfo import conninfo_to_dict

    from .config import StoreConfigError

    try:
        in_url = conninfo_to_dict(dsn).get("connect_timeout")
    except Error:  # not a connection string: the connection says so
        in_url = None
    for setting, text in (("the URL's connect_timeout", in_url),
                          (CONNECT_TIMEOUT_ENV, os.environ.get(CONNECT_TIMEOUT_ENV)),
                          ("PGCONNECT_TIMEOUT", os.environ.get("PGCONNECT_TIMEOUT"))):
        if text is None or text == "":
            continue
        try:
            seconds = int(str(text))
        except ValueError:
            seconds = 0
        if seconds < 2:
            raise StoreConfigError(f"{setting}={str(text)!r}: not a whole number of seconds "
                                   "from 2")
        return seconds, setting
    return DEFAULT_CONNECT_TIMEOUT_S, "the default"


# The server's words for a refused login (SQLSTATE 28000 and 28P01, which libpq does not
# pass on for a failed connection): every authentication method's failure, a client no
# pg_hba.conf line admits, a role that does not exist.
_LOGIN_REFUSED = re.compile(r'authentication failed for user|no pg_hba\.conf entry|'
                            r'role ".*" does not exist')


def _connect_error(dsn: str, e: BaseException, timeout: tuple[int, str]) -> CatalogError:
    """The error of a failed connection to the catalog at ``dsn`` with ``timeout``
    (``connect_timeout``): CatalogAuthError when its server refused the login (the
    server's reason, or that it asked for a password and none was given), else
    CatalogError "cannot reach" with the reason, for no answer in time the timeout and
    what set it."""
    from psycopg.errors import ConnectionTimeout

    if isinstance(e, ConnectionTimeout):
        seconds, setting = timeout
        return CatalogError(f"cannot reach the catalog at {redact(dsn)}: no answer within "
                            f"{seconds} s (the connect timeout, from {setting}; "
                            f"{CONNECT_TIMEOUT_ENV} sets it)")
    text = _one_line(e)
    said = text.rpartition("FATAL:")[2].strip() if "FATAL:" in text else ""
    pgconn = getattr(e, "pgconn", None)
    try:
        asked = pgconn is not None and bool(pgconn.needs_password)
    except Exception:  # a connection object in a state that cannot say
        asked = False
    if asked:
        return CatalogAuthError(redact(dsn), "it asks for a password and none was given")
    if said and _LOGIN_REFUSED.search(said):
        return CatalogAuthError(redact(dsn), said)
    return CatalogError(f"cannot reach the catalog at {redact(dsn)}: {text}")


def _one_line(e: BaseException) -> str:
    """A server's message (often several lines, with a tab-indented hint) as one line,
    without any secret it quotes (``redact``)."""
    return redact(" ".join(str(e).split()))


def _gc_runs(c: Any, now_ns: int | None) -> tuple[bool, int]:
    """Inside a transaction on ``c``: whether a GC holds the ``gc`` lease unexpired at
    ``now_ns`` (None: the server's clock), and that time. The row is read FOR SHARE, so
    this transaction and a GC's acquisition (FOR UPDATE) are serialized
    (store/sharedgc.py)."""
    from .sharedgc import GC_LEASE

    c.execute("INSERT INTO leases(name, holder, epoch, expires_ns) "
              "VALUES (%s, '', 0, 0) ON CONFLICT (name) DO NOTHING", (GC_LEASE,))
    h, x, server = c.execute(f"SELECT holder, expires_ns, {_NOW} FROM leases WHERE name=%s "
                             "FOR SHARE", (GC_LEASE,)).fetchone()
    now = int(server) if now_ns is None else now_ns
    return bool(h) and int(x) > now, now


def _check_fence(c: Any, name: str, epoch: int) -> None:
    """Inside a write transaction on ``c``: lock lease ``name``'s row and raise FencedError
    unless it is at ``epoch`` (a lease never taken fences nothing: store/catalog.py)."""
    lease = c.execute("SELECT epoch FROM leases WHERE name=%s FOR UPDATE", (name,)).fetchone()
    if lease is not None and int(lease[0]) != epoch:
        raise FencedError(name, epoch, int(lease[0]))
