"""Garbage collection: delete packs and index rows that nothing live reaches (CONTRACT 1.6).

Live roots: every listed snapshot, every ref of every journal, every named ref, the base
Refs of every registered state directory (read through ``state_dirs_reader``, supplied by
the session layer, because ``store`` knows nothing of FUSE or upper layers), and
``extra_live`` (for example lowers a daemon still serves to open handles). Marking walks
the trees from those roots, skipping tree ids already seen.

Safety against a concurrent snapshot: every writer (``Store.writer()``) holds ``gc.lock``
shared from its first dedup check until it has listed what it wrote, and GC holds it
exclusively for its whole run. So while GC runs no writer is mid-flight: every object a
writer decided to reuse is already reachable from something listed, and every pack in the
backend without an index row is a leftover of a crash (writers put packs before they
index them), never a pack a live writer is about to index. A writer that starts after GC
sees the shrunken index and writes again what it needs. (So never call ``gc`` from a
thread whose process holds an open Writer: the exclusive lock would wait for it forever.)
``verify`` holds the lock shared, so GC never deletes a pack under it.

Fails closed (``GCError(op, key, cause)``, nothing deleted) when: the index was rebuilt and
not yet verified (``unverified_rebuild``); a registered state directory cannot be read; a
live tree cannot be read or decoded; or a live object has no index row (the index is then
not complete, and its pack would look like a leftover). Only ``packs/<64 hex>.pack`` keys
are ever deleted; other unknown keys are reported and left.

Order of a run, each step safe if the process dies after it: catch up the index with the
backend history (``rebuild.catch_up``); mark; write repacked copies of the live objects of
sparse packs and make them durable; in one index transaction point those objects at their
new packs, drop the rows of dead packs and repacked packs, drop ``files_cache`` rows
naming chunks that are no longer indexed and ``dirs_cache`` rows naming a tree that is not
live (an unreachable tree may stay indexed in a pack that is kept while objects below it
go, and the dirs cache trusts an indexed tree to be complete: store/dircache.py); then delete the packs from the backend (a crash
before that leaves unindexed packs, which the next run deletes). Re-running is a no-op.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from . import dircache
from .catalog import write_transaction
from .errors import BlobNotFoundError, GCError, StoreError
from .objects import Store
from .pack import Location, ObjKind, PackBuilder
from .rebuild import PACK_KEY, UNVERIFIED, catch_up, is_known_key
from .ref import DIGEST_SIZE, ObjectId, Ref
from .tree import Kind

StateDirsReader = Callable[[str], list[Ref]]
"""``reader(path) -> [Ref, ...]``: the base (and any other) Refs a state directory pins."""

REPACK_BELOW = 0.5
"""A pack whose live records fill less than this share of it is repacked."""


@dataclass
class GCReport:
    """What one GC run did. ``bytes_freed``: bytes of deleted indexed packs minus bytes of
    repacked copies written (leftover packs are not counted: their size is not indexed)."""

    packs_deleted: int = 0
    packs_repacked: int = 0
    objects_deleted: int = 0
    bytes_freed: int = 0
    packs_written: int = 0
    leftover_packs: int = 0
    files_cache_pruned: int = 0
    dirs_cache_pruned: int = 0
    uploads_aborted: int = 0  # unfinished multipart uploads aborted (S3, store/sharedgc.py)
    chunk_pages_pruned: int = 0  # this host's chunk_pages rows of chunks no longer stored
    located_pruned: int = 0  # this host's located rows of deleted packs (store/sharedgc.py)
    # writer pins of this host's dead processes dropped before their expiry (sharedgc.py)
    dead_writer_pins: list[str] = field(default_factory=list)
    unknown_keys: list[str] = field(default_factory=list)


def live_roots(store: Store, extra_live: Iterable[Ref] = (),
               state_dirs_reader: StateDirsReader | None = None) -> set[ObjectId]:
    """The root tree ids GC must keep. Raises GCError if a state directory cannot be read."""
    refs: set[str] = set()
    c = store.conn
    refs.update(r[0] for r in c.execute("SELECT ref FROM snapshots"))
    refs.update(r[0] for r in c.execute("SELECT DISTINCT ref FROM journal"))
    refs.update(r[0] for r in c.execute("SELECT ref FROM named_refs"))
    roots: set[ObjectId] = set()
    for text in refs:
        try:
            roots.add(Ref.parse(text).tree_id)
        except StoreError as e:
            raise GCError("live", text, f"unparseable ref in the index: {e}") from None
    for (path,) in c.execute("SELECT path FROM state_dirs").fetchall():
        if state_dirs_reader is None:
            raise GCError("live", path, "a state directory is registered but no reader for "
                                        "state directories was given")
        try:
            pinned = state_dirs_reader(path)
            roots.update(Ref.parse(r).tree_id for r in pinned)
        except Exception as e:
            raise GCError("live", path, f"cannot read state directory: {e}", because=e) from e
    for r in extra_live:
        roots.add(Ref.parse(r).tree_id)
    return roots


def mark(store: Store, roots: Iterable[ObjectId]) -> set[ObjectId]:
    """Every object id reachable from ``roots`` (trees and chunks). Raises GCError if a
    reachable tree cannot be read or decoded."""
    live: set[ObjectId] = set()
    stack = list(roots)
    for tid in stack:  # a root naming a chunk is refused, not taken as a chunk below
        try:
            kind = store.locate(tid).kind
        except StoreError as err:
            raise GCError("mark", tid.hex(), f"cannot find a live root tree ({err})",
                          because=err) from err
        if kind is not ObjKind.TREE:
            raise GCError("mark", tid.hex(), "a live root names a chunk, not a tree")
    while stack:
        tid = stack.pop()
        if tid in live:
            continue
        try:
            if store.locate(tid).kind is not ObjKind.TREE:
                raise GCError("mark", tid.hex(), "a live tree id names a chunk")
            tree = store.get_tree(tid)
        except GCError:
            raise
        except StoreError as err:
            raise GCError("mark", tid.hex(), f"cannot read a live tree ({err}); run verify, "
                                             "then rebuild-index if objects are missing",
                          because=err) from err
        live.add(tid)
        for ent in tree.entries:
            if ent.kind is Kind.DIR and ent.tree_id is not None:
                if ent.tree_id not in live:
                    stack.append(ent.tree_id)
            elif ent.kind is Kind.FILE:
                live.update(ent.chunks.distinct())
    return live


@dataclass
class _PackUse:
    size: int = 0
    live: list[tuple[int, int, ObjectId, ObjKind]] = field(default_factory=list)
    live_records: set[tuple[int, int]] = field(default_factory=set)
    all_records: set[tuple[int, int]] = field(default_factory=set)

    def live_share(self) -> float:
        """Live record bytes over indexed record bytes (trailer and footer not counted)."""
        total = sum(n for _, n in self.all_records)
        return sum(n for _, n in self.live_records) / total if total else 1.0


def gc(store: Store, *, extra_live: Iterable[Ref] = (),
       state_dirs_reader: StateDirsReader | None = None,
       repack_below: float = REPACK_BELOW, grace_s: float | None = None,
       wait_s: float | None = None) -> GCReport:
    """Collect garbage in ``store`` (see the module docstring). Returns a GCReport; raises
    GCError(op, key, cause) when it refuses or a step fails (re-running is safe). On a
    shared catalog, a writer of another host does not hold this host's gc.lock: GC runs
    the writer pin protocol of store/sharedgc.py instead (``grace_s``, ``wait_s``: see
    there; no repacking)."""
    if store.catalog.shared:
        from . import sharedgc

        return sharedgc.gc_shared(
            store, extra_live=extra_live, state_dirs_reader=state_dirs_reader,
            grace_s=sharedgc.GRACE_S if grace_s is None else grace_s,
            wait_s=sharedgc.WAIT_S if wait_s is None else wait_s)
    fd = store.lock(exclusive=True)
    assert fd is not None
    try:
        report = _gc_locked(store, list(extra_live), state_dirs_reader, repack_below)
        sweep = getattr(store.backend, "remove_stale_temps", None)
        if sweep is not None:
            sweep()
        return report
    finally:
        store.unlock(fd)


def ready_for_gc(store: Any) -> None:
    """The first step of a GC (local or shared), under its lock: raises GCError ``check``
    if the index was rebuilt and not verified since, ``catch-up`` if the backend's
    history cannot be caught up (``rebuild.catch_up``); nothing is deleted either way."""
    if store.config_value(UNVERIFIED):
        raise GCError("check", "index", "the index was rebuilt and has not been verified; "
                                        "run verify first")
    try:
        catch_up(store)
    except StoreError as e:
        raise GCError("catch-up", "history", str(e), because=e) from e


def _gc_locked(store: Store, extra_live: list[Ref], state_dirs_reader: StateDirsReader | None,
               repack_below: float) -> GCReport:
    rep = GCReport()
    ready_for_gc(store)
    live = mark(store, live_roots(store, extra_live, state_dirs_reader))

    c = store.conn
    use: dict[str, _PackUse] = defaultdict(_PackUse)
    for key, size in c.execute("SELECT key, size FROM packs"):
        use[key].size = size
    found = 0
    for oid, kind, pack, off, length, inner in c.execute(
            "SELECT id, kind, pack, rec_offset, rec_length, inner_offset FROM objects"):
        u = use[pack]
        u.all_records.add((off, length))
        if oid in live:
            found += 1
            u.live.append((off, inner, ObjectId(oid), ObjKind(kind)))
            u.live_records.add((off, length))
    require_indexed(store, live, found)

    dead_packs = [k for k, u in use.items() if not u.live]
    sparse = [k for k, u in use.items() if u.live and u.live_share() < repack_below]

    leftovers = backend_leftovers(store, use, rep.unknown_keys)

    moved, new_packs = _repack(store, sparse, use, rep)

    with write_transaction(c, store.index_path):
        c.executemany("UPDATE objects SET pack=?, rec_offset=?, rec_length=?, codec=?, "
                      "inner_offset=? WHERE id=?",
                      [(loc.pack, loc.rec_offset, loc.rec_length, int(loc.codec),
                        loc.inner_offset, loc.oid) for loc in moved])
        c.executemany("INSERT OR IGNORE INTO packs(key, size, objects) VALUES (?, ?, ?)",
                      new_packs)
        for key in dead_packs + sparse:
            rep.objects_deleted += c.execute("DELETE FROM objects WHERE pack=?",
                                             (key,)).rowcount
            c.execute("DELETE FROM packs WHERE key=?", (key,))
        rep.files_cache_pruned = _prune_files_cache(store)
        rep.dirs_cache_pruned = dircache.prune(c, live)
        # Data page counts (a per-chunk cache for st_blocks) of chunks no longer stored.
        rep.chunk_pages_pruned = c.execute(
            "DELETE FROM chunk_pages WHERE id NOT IN (SELECT id FROM objects)").rowcount

    for key in dead_packs + sparse + leftovers:
        if not PACK_KEY.fullmatch(key):
            rep.unknown_keys.append(key)  # an index row named it; not a key GC may delete
            continue
        try:
            store.backend.delete(key)
        except BlobNotFoundError:
            continue
        except StoreError as e:
            raise GCError("delete", key, str(e), because=e) from e
        rep.bytes_freed += use[key].size if key in use else 0
    rep.packs_deleted = len(dead_packs) + len(leftovers)
    rep.packs_repacked = len(sparse)
    rep.leftover_packs = len(leftovers)
    try:
        store.backend.sync()
    except StoreError as e:
        raise GCError("sync", "packs/", str(e), because=e) from e
    return rep


def _repack(store: Store, sparse: list[str], use: dict[str, _PackUse],
            rep: GCReport) -> tuple[list[Location], list[tuple[str, int, int]]]:
    """Copy the live objects of ``sparse`` packs into new packs, durably; return their new
    locations and (key, size, count) of the new packs (neither indexed yet)."""
    moved: list[Location] = []
    written: list[tuple[str, int, int]] = []

    def emit(key: str, data: bytes, rows: list[Location]) -> None:
        store.backend.put(key, data)
        written.append((key, len(data), len(rows)))
        moved.extend(rows)
        rep.packs_written += 1
        rep.bytes_freed -= len(data)

    builder = PackBuilder(emit, level=store.level)
    key = "packs/"
    try:
        for key in sparse:
            for _, _, oid, kind in sorted(use[key].live):
                builder.add(oid, kind, store.read_object(oid))
        builder.flush()
        store.backend.sync()
    except StoreError as e:
        for k, _, _ in written:  # unindexed; deleting them now saves the next run the work
            try:
                store.backend.delete(k)
            except StoreError:
                pass
        raise GCError("repack", key, str(e), because=e) from e
    return moved, written


def _prune_files_cache(store: Store) -> int:
    """Delete files_cache rows naming a chunk that is no longer indexed; return how many."""
    c = store.conn
    stale = []
    for path, chunks in c.execute("SELECT path, chunks FROM files_cache").fetchall():
        ids = [chunks[i:i + DIGEST_SIZE] for i in range(0, len(chunks or b""), DIGEST_SIZE)]
        if any(c.execute("SELECT 1 FROM objects WHERE id=?", (i,)).fetchone() is None
               for i in ids):
            stale.append((path,))
    c.executemany("DELETE FROM files_cache WHERE path=?", stale)
    return len(stale)


def require_indexed(store: Any, live: Any, found: int) -> None:
    """Raise GCError("mark") unless all ``found`` of the ``live`` objects are indexed."""
    if found != len(live):
        missing = next(o for o in live if not store.has(o))
        raise GCError("mark", missing.hex(), "a live object is not indexed; the index is "
                                             "incomplete (run rebuild-index, then verify)")


def backend_leftovers(store: Any, packs: Any, unknown: list[str]) -> list[str]:
    """The pack keys in the backend that ``packs`` (the indexed pack keys) does not hold;
    keys of no known kind are appended to ``unknown``. GCError("list") if listing fails."""
    try:
        backend_keys = store.backend.list("")
    except StoreError as e:
        raise GCError("list", "packs/", str(e), because=e) from e
    leftovers = []
    for key in backend_keys:
        if PACK_KEY.fullmatch(key):
            if key not in packs:
                leftovers.append(key)
        elif not is_known_key(key):
            unknown.append(key)
    return leftovers
