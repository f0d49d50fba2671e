"""Garbage collection of a shared store: the cross-host writer pin protocol (issue 13.4).

On the embedded store, writers and GC share one host and ``gc.lock`` (store/gc.py): GC holds
it exclusively, every ``Writer`` shared. Hosts of a shared store have no common lock file,
so the same exclusion is made of catalog rows (store/pgcatalog.py, schema version 2):

- **GC lease**: the lease ``gc`` in ``leases`` (store/lease.py rules: an epoch, an expiry,
  one holder). Exactly one GC runs at a time across hosts; a GC that died is taken over
  once its lease expires.
- **Writer pins**: ``writer_pins(holder, host, started_ns, expires_ns)``. A ``Writer``
  (store/objects.py) on a shared catalog pins itself *before its first dedup check*, in a
  transaction that reads the ``gc`` lease row ``FOR SHARE``: while a GC holds that lease
  unexpired the writer does not pin, it waits (polling) until the GC is done; a GC's
  acquisition locks the same row ``FOR UPDATE``, so a pin and a GC start are serialized.
  A thread renews the pin every third of its ttl (``PIN_TTL_S``); ``Writer.close`` (after
  the snapshot is listed or the journal appended, inside the writer's block) deletes it
  (in a thread of its own, off the writer's path: the deletion only lets a GC go on).
- **Fenced commit**: ``Writer.commit`` indexes its packs with ``add_objects(..., pin=)``,
  which refuses (``WriterPinLostError``) in the same transaction if the pin row is gone.
- **GC run** (``gc_shared``): take the ``gc`` lease; wait (at most ``wait_s``) until no
  unexpired pin is left, then delete the expired ones (their writers are fenced from then
  on); refuse (``GCError``, nothing deleted) if live pins remain. Catch up the history,
  mark from the snapshot list, every journal, the named refs, this host's state
  directories and mounts (``extra_live``) **and every tree of a pack indexed less than
  ``grace_s`` ago** (``packs.indexed_ns``). Dead packs are those with no live object and
  indexed before the grace period; in one transaction that re-checks the ``gc`` lease
  (holder and epoch, ``FOR UPDATE``) their index rows go and the catalog's
  ``gc_generation`` increases; then the blobs are deleted (the lease checked and renewed
  before each), then crash leftovers (``packs/`` keys with no index row: no live writer
  can be uploading one, since none is pinned and none may pin), then, on S3, the
  unfinished multipart uploads of packs begun more than ``grace_s`` ago (a writer or
  server killed mid-upload leaves its parts stored, invisible, until they are aborted;
  for the same reason none of them belongs to a live writer, and the grace period keeps
  even a fenced writer's young upload). Sparse packs are not repacked on a shared store.
- **Dirs caches of other hosts** (store/dircache.py trusts an indexed tree to be
  complete): a writer that pins compares the catalog's ``gc_generation`` with the one its
  host last saw and drops its dirs cache when it changed, so no host reuses a tree whose
  children a GC deleted. Files caches check chunk ids against the catalog already. The
  host's ``located`` copy of catalog rows is pruned then too, of rows naming a pack the
  catalog no longer has (and by GC on its own host), so it does not grow with every pack
  ever read.

Crash windows, each safe:

- A writer dies pinned: its pin expires after at most ``PIN_TTL_S``; until then GC waits
  (or refuses after ``wait_s``), except a GC on the writer's own host, which proves it
  dead (``store.lease.holder_is_dead``: same host id, pid gone) and drops its pin at once.
  Its uploaded, unindexed packs are leftovers the next GC deletes.
- A writer paused past its pin's expiry (a partitioned host): GC may run and delete
  what it had reused or uploaded; its commit is then refused (fenced), so nothing
  references the missing objects; the checkpoint or snapshot fails with
  ``WriterPinLostError`` and can be retried.
- A writer that committed, then paused past its pin's expiry before listing: its new
  trees are in packs indexed within the grace period, which GC treats as live roots, so
  neither they nor the older objects they reuse are deleted (unless the pause outlasts
  ``grace_s``; then the listing names a Ref whose objects may be gone, found by
  ``verify``).
- GC dies holding its lease: writers wait until the lease expires (``GC_LEASE_TTL_S``);
  index rows it deleted without deleting their blobs leave leftovers the next GC deletes.
- GC paused past its lease's expiry between its last lease check and a blob delete: a
  writer may have started meanwhile and uploaded a pack with exactly the same bytes (the
  same key) as a dead one, which the late delete would remove. The window is one delete
  call; the lease is checked and renewed before each.

- **Mounts of other hosts**: GC reads only this host's state directories and mount
  records. A mount daemon of a shared store (``rewindfs mount``) therefore also pins, in
  the catalog, what its own host's GC would keep for it (``MountPins``): a read-only
  mount its Ref, a read-write one (``--state DIR``) what its state directory pins (its
  base, the older lowers detached files still read, the kept tree of excluded files:
  ``fusefs.session.fusetree.pinned_refs``), as named refs ``mount/<host>:<pid>:<nonce>``
  and ``.../1``, ... while it serves; it drops them at unmount. The first pins and a
  restore's target are added only while no GC runs (the ``gc`` lease row read FOR
  SHARE, as a writer pin), and the daemon then checks its base is still indexed: a GC
  that started earlier may have deleted it, one that starts later sees the pin. After
  each checkpoint and restore the pins are replaced by what the state directory pins
  then (a checkpoint's new base is listed already, so that replacement need not wait).
  A GC drops such pins of its own host whose process is gone
  (``store.lease.holder_is_dead``), so a killed daemon's pins keep garbage only until the
  next GC on its host. Session uppers need no pin: their bases and held lowers are
  journaled.

Not covered: a plain read-write mount's state directory while no daemon serves it (after
``umount``) is pinned on no host, as on the embedded store (its state directory is not
registered). The new trees a restore writes before its swap (a discard's freeze, a path
restore's target) are pinned once the swap is recorded; until then only the grace period
keeps them (they are in young packs), as it keeps every writer's trees.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .errors import (
    BlobNotFoundError,
    GCBusyError,
    GCError,
    LeaseBusyError,
    LeaseLostError,
    StoreError,
    WritersBusyError,
)
from .ref import ObjectId, Ref

if TYPE_CHECKING:
    from .gc import GCReport

log = logging.getLogger("rewindfs.store")

GC_LEASE = "gc"
GC_LEASE_TTL_S = 60.0
PIN_TTL_S = float(os.environ.get("REWINDFS_WRITER_PIN_TTL", "60"))
"""Writer pin time to live in seconds (renewed every third); the environment variable is
for tests that crash a writer."""
PIN_POLL_S = 0.2
GRACE_S = 3600.0
"""Packs indexed less than this long ago (s) are never deleted and their trees are roots."""
WAIT_S = 120.0
"""How long GC waits for pinned writers (s) before it refuses."""
GENERATION = "gc_generation"


class WriterPin:
    """A writer's pin in a shared catalog (see the module docstring): ``holder`` is
    ``host:pid:nonce``; renewed by a thread until ``release``. ``lost`` is set when a
    renewal found the pin gone (a GC fenced it: the commit will be refused)."""

    def __init__(self, store: Any, ttl_s: float = PIN_TTL_S) -> None:
        import secrets

        from .hostid import host_id
        from .lease import holder_name

        self.store = store
        self.ttl_s = ttl_s
        self.holder = holder_name(os.getpid(), secrets.token_hex(4))
        cat = store.catalog
        waited = 0.0
        while (generation := cat.pin_writer(self.holder, host_id(), int(ttl_s * 1e9),
                                            None)) is None:  # None: the server's clock
            if waited == 0.0:
                log.info("a GC runs on this shared store: the writer waits for it")
            time.sleep(PIN_POLL_S)
            waited += PIN_POLL_S
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="writer-pin", daemon=True)
        self._thread.start()
        _sync_generation(store, generation)

    def _renew(self) -> None:
        from .errors import WriterPinLostError

        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.store.catalog.renew_writer_pin(self.holder, int(self.ttl_s * 1e9),
                                                    None)
            except WriterPinLostError:
                self.lost = True
                return
            except StoreError as e:  # the catalog is away: retry at the next tick
                log.warning("renewing writer pin %s failed: %s", self.holder, e)

    def release(self) -> None:
        """Stop renewing and delete the pin, off the caller's path: in a thread of its own,
        which the interpreter waits for at exit (not a daemon thread), so a writer's
        caller does not wait for that round trip; a GC polling for pins sees it go a
        moment later. A pin whose deletion never ran (the process was killed) expires."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        threading.Thread(target=self._unpin, name="writer-unpin", daemon=False).start()

    def _unpin(self) -> None:
        try:
            self.store.catalog.unpin_writer(self.holder)
        except StoreError as e:  # it expires by itself
            log.warning("releasing writer pin %s failed: %s", self.holder, e)


def _sync_generation(store: Any, now: str) -> None:
    """Drop this host's dirs cache if a GC ran since it last looked (module docstring),
    and its ``located`` rows of packs that GC deleted (``Store.prune_located``): ``now``
    is the catalog's ``gc_generation``, read with the pin."""
    c = store.conn
    row = c.execute("SELECT value FROM config WHERE key=?", (GENERATION,)).fetchone()
    if row is not None and row[0] == now:
        return
    c.execute("BEGIN IMMEDIATE")
    try:
        c.execute("DELETE FROM dirs_cache")
        c.execute("INSERT OR REPLACE INTO config(key, value) VALUES (?, ?)", (GENERATION, now))
        c.execute("COMMIT")
    except BaseException:
        c.execute("ROLLBACK")
        raise
    store.prune_located(k for k, _size, _n in store.catalog.packs())


def gc_shared(store: Any, *, extra_live: Iterable[Ref] = (),
              state_dirs_reader: Callable[[str], list[Ref]] | None = None,
              grace_s: float = GRACE_S, wait_s: float = WAIT_S) -> GCReport:
    """Collect garbage in a shared store (see the module docstring); returns a
    ``gc.GCReport``. Raises GCError (nothing deleted) when another GC runs, pinned writers
    stay past ``wait_s`` seconds, or a step fails (re-running is safe)."""
    from .gc import GCReport, backend_leftovers, mark, ready_for_gc, require_indexed
    from .hostid import host_id
    from .rebuild import PACK_KEY

    cat = store.catalog
    rep = GCReport()
    with exclusive(store, wait_s) as hold:
        rep.dead_writer_pins = list(hold.dead_pins)
        ready_for_gc(store)
        _drop_dead_mount_pins(store)
        objects, packs = cat.gc_view()
        young_before = cat.clock_ns() - int(grace_s * 1e9)  # the server's clock
        young = {k for k, (_, t) in packs.items() if t > young_before}
        roots = _live_roots(store, extra_live, state_dirs_reader)
        roots.update(ObjectId(oid) for oid, kind, pack in objects
                     if pack in young and kind == 2)
        live = mark(store, roots)
        used: dict[str, bool] = {k: False for k in packs}
        found = 0
        for oid, _kind, pack in objects:
            if oid in live:
                found += 1
                used[pack] = True
        require_indexed(store, live, found)
        dead = sorted(k for k, u in used.items() if not u and k not in young)
        leftovers = backend_leftovers(store, packs, rep.unknown_keys)
        try:
            rep.objects_deleted = cat.gc_drop(dead, hold.lease)
        except LeaseLostError:
            raise GCError("lease", GC_LEASE, "the gc lease was lost before anything was "
                                             "deleted; re-run it") from None
        # This host's copy of the catalog's rows loses those of every deleted pack (also
        # of earlier GCs); other hosts prune theirs when they see the new generation.
        rep.located_pruned = store.prune_located(k for k, _size, _n in cat.packs())
        # This host's data page counts (st_blocks) of chunks no longer indexed, as the
        # embedded GC does (also of chunks earlier GCs of any host deleted).
        gone = set(dead)
        rep.chunk_pages_pruned = store.prune_chunk_pages(
            {bytes(oid) for oid, _kind, pack in objects if pack not in gone})
        for key in dead + leftovers:
            if not PACK_KEY.fullmatch(key):
                rep.unknown_keys.append(key)
                continue
            hold.renew()  # lost: stop deleting
            try:
                store.backend.delete(key)
            except BlobNotFoundError:
                continue
            except StoreError as e:
                raise GCError("delete", key, str(e), because=e) from e
            rep.bytes_freed += packs[key][0] if key in packs else 0
        rep.packs_deleted = len(dead) + len(leftovers)
        rep.leftover_packs = len(leftovers)
        abort = getattr(store.backend, "abort_stale_uploads", None)  # S3: killed uploads
        if abort is not None:
            hold.renew()
            try:
                rep.uploads_aborted = len(abort("packs/", grace_s))
            except StoreError as e:
                raise GCError("abort", "packs/", str(e), because=e) from e
        log.info("gc on host %s: %d packs deleted (%d leftovers), %d objects, %d stale "
                 "uploads aborted", host_id(), rep.packs_deleted, rep.leftover_packs,
                 rep.objects_deleted, rep.uploads_aborted)
        return rep


class GCHold:
    """The ``gc`` lease held by ``exclusive``: ``lease`` is its current state;
    ``dead_pins`` the holders of the writer pins it dropped at once because their holder
    was provably dead (``store.lease.holder_is_dead``)."""

    def __init__(self, leaser: Any, lease: Any) -> None:
        self.leaser = leaser
        self.lease = lease
        self.dead_pins: list[str] = []
        self._renewed = time.monotonic()

    def renew(self) -> None:
        """Renew the lease; GCError if it was lost (the caller must stop)."""
        self.lease = _renew(self.leaser, self.lease)
        self._renewed = time.monotonic()

    def keep(self) -> None:
        """``renew`` once a third of the lease's ttl has passed since the last renewal."""
        if time.monotonic() - self._renewed >= GC_LEASE_TTL_S / 3:
            self.renew()


@contextmanager
def exclusive(store: Any, wait_s: float = WAIT_S, command: str = "gc") -> Iterator[GCHold]:
    """Hold the ``gc`` lease of shared store ``store`` with no writer pinned (module
    docstring: no writer pins and no mount adds a pin while it is held): what GC and
    ``rebuild-index`` (``command``, named in the refusal) need of every host. Waits up to
    ``wait_s`` seconds for pinned writers (their expired pins are dropped, which fences
    them). Raises GCBusyError (a GCError, nothing done) when another holder has the
    lease, WritersBusyError when writers stay pinned; released on exit."""
    import secrets

    from .lease import Leaser, holder_name

    leaser = Leaser(store)
    holder = holder_name(os.getpid(), secrets.token_hex(4))
    try:
        lease = leaser.acquire(GC_LEASE, holder, GC_LEASE_TTL_S)
    except LeaseBusyError as e:
        left = (None if e.expires_ns is None
                else (e.expires_ns - store.catalog.clock_ns()) / 1e9)
        raise GCBusyError(command, e.holder.split(":")[0], _pid(e.holder), left,
                          GC_LEASE_TTL_S) from None
    hold = GCHold(leaser, lease)
    try:
        hold.lease = _wait_for_writers(store, leaser, lease, wait_s, command,
                                       hold.dead_pins)
        yield hold
    finally:
        leaser.release(hold.lease)


def _wait_for_writers(store: Any, leaser: Any, lease: Any, wait_s: float,
                      command: str, dead_pins: list[str]) -> Any:
    """Holding the GC lease (so no writer pins meanwhile): wait until every pin has
    expired or been released, then delete the expired ones. A pin whose holder is
    provably dead (``store.lease.holder_is_dead``: a process of this host, same host id,
    that is gone; the rule a lease's takeover follows) is deleted at once, as if expired,
    and its holder appended to ``dead_pins``. Returns the renewed lease.
    WritersBusyError naming the writers' hosts and pids if some are still pinned after
    ``wait_s``."""
    from .lease import holder_is_dead

    deadline = time.monotonic() + wait_s
    while True:
        now = store.catalog.clock_ns()  # the server's, as the pins' expiries
        pins = store.catalog.writer_pins()
        dead = [p[0] for p in pins if p[3] > now and holder_is_dead(p[0])]
        if dead:
            store.catalog.drop_writer_pins(dead)  # fenced from now on, as if expired
            dead_pins.extend(dead)
            log.info("dropped the writer pins of dead processes of this host: %s",
                     ", ".join(dead))
            pins = [p for p in pins if p[0] not in dead]
        live = [p for p in pins if p[3] > now]
        if not live:
            store.catalog.drop_writer_pins([p[0] for p in pins])
            return lease
        if time.monotonic() >= deadline:
            raise WritersBusyError(command, [(host, _pid(holder), (expires - now) / 1e9)
                                             for holder, host, _, expires in live[:5]],
                                   len(live), wait_s)
        time.sleep(PIN_POLL_S)
        lease = _renew(leaser, lease)


def _pid(holder: str) -> int | None:
    """The pid of a holder id ``host:pid:nonce`` (store.lease.holder_name), else None."""
    parts = holder.split(":")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


MOUNT_PIN = "mount/"


class MountPins:
    """What a mount daemon serves, pinned for the GCs of every host of a shared store while
    it serves (module docstring): the named refs ``mount/<host>:<pid>:<nonce>`` (the first
    Ref) and ``.../1``, ``.../2``, ... (the others). ``add`` waits while a GC runs (its
    Refs may be garbage that GC is about to delete: once added, check they are still
    indexed); ``replace`` does not (use it only when every Ref it adds is live by other
    means, e.g. a checkpoint's listed Ref). Thread-safe. ``pin_mount`` makes one."""

    def __init__(self, store: Any, refs: Iterable[Ref]) -> None:
        import secrets

        from .lease import holder_name

        self.store = store
        self.name = MOUNT_PIN + holder_name(os.getpid(), secrets.token_hex(4))
        self.refs: list[str] = []
        self._lock = threading.Lock()
        self.add(refs)

    def add(self, refs: Iterable[Ref]) -> None:
        """Pin ``refs`` too, once no GC runs (polling, as a writer pin)."""
        with self._lock:
            want = list(dict.fromkeys([*self.refs, *(str(r) for r in refs)]))
            waited = False
            while not self.store.catalog.set_mount_pins(self.name, want, None,
                                                        True):
                if not waited:
                    log.info("a GC runs on this shared store: the mount waits for it")
                    waited = True
                time.sleep(PIN_POLL_S)
            self.refs = want

    def replace(self, refs: Iterable[Ref]) -> None:
        """Pin exactly ``refs`` (see the class docstring: at once, even while a GC runs)."""
        with self._lock:
            want = list(dict.fromkeys(str(r) for r in refs))
            if want != self.refs:
                self.store.catalog.set_mount_pins(self.name, want, None, False)
                self.refs = want

    def release(self) -> None:
        """Drop every pin (a failure is logged: the next GC on this host drops them)."""
        try:
            self.replace([])
        except StoreError as e:
            log.warning("dropping the mount pins %s failed: %s", self.name, e)


def pin_mount(store: Any, refs: Iterable[Ref]) -> MountPins | None:
    """Pin ``refs`` for the GCs of every host while this process serves them (None on an
    embedded store, whose GC reads this host's mount records)."""
    if not store.catalog.shared:
        return None
    return MountPins(store, refs)


def unpin_mount(pins: MountPins | None) -> None:
    """Drop a ``pin_mount`` pin, if any."""
    if pins is not None:
        pins.release()


def _drop_dead_mount_pins(store: Any) -> None:
    """Drop the mount pins of this host's processes that are gone."""
    from .lease import holder_is_dead

    for name, _ref in store.catalog.named_refs():
        if name.startswith(MOUNT_PIN) and holder_is_dead(
                name[len(MOUNT_PIN):].split("/")[0]):
            store.catalog.delete_named_ref(name)


def _renew(leaser: Any, lease: Any) -> Any:
    """The GC lease renewed; GCError if it was lost (expired and taken over)."""
    try:
        return leaser.renew(lease, GC_LEASE_TTL_S)
    except LeaseLostError:
        raise GCError("lease", GC_LEASE, "the gc lease was lost (this gc was paused past "
                                         "its ttl); it stopped, re-run it") from None


def _live_roots(store: Any, extra_live: Iterable[Ref],
                state_dirs_reader: Callable[[str], list[Ref]] | None) -> set[ObjectId]:
    """The root tree ids of a shared store: listed, journaled, named, this host's state
    directories and ``extra_live``. GCError for an unreadable ref or state directory."""
    from .hostid import host_id

    cat = store.catalog
    refs: set[str] = {r[0] for r in cat.snapshots()}
    refs.update(cat.journal_refs())
    refs.update(r for _, r in cat.named_refs())
    roots: set[ObjectId] = set()
    for text in refs:
        try:
            roots.add(Ref.parse(text).tree_id)
        except StoreError as e:
            raise GCError("live", text, f"unparseable ref in the catalog: {e}") from None
    for path, _host in cat.state_dirs(host_id()):
        if state_dirs_reader is None:
            raise GCError("live", path, "a state directory is registered but no reader for "
                                        "state directories was given")
        try:
            roots.update(Ref.parse(r).tree_id for r in state_dirs_reader(path))
        except Exception as e:
            raise GCError("live", path, f"cannot read state directory: {e}", because=e) from e
    for r in extra_live:
        roots.add(Ref.parse(r).tree_id)
    return roots
