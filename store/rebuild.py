"""Rebuild the index from the backend alone, and catch the index up with the history objects.

The backend is the source of truth (CONTRACT 1.1, 1.2); the index is its cache. Two entry
points:

- ``rebuild_index(store)`` recreates ``objects`` and ``packs`` from the pack trailers, the
  snapshot list by replaying ``snapshots/*.json`` records (add, forget) in key order (keys
  start with the zero-padded time in ns, so key order is time order), each listed Ref with
  every label its adds since its last forget gave it, and the journal from
  ``journal/<session>/<seq>.json``. The files and dirs caches are dropped (only caches);
  ``named_refs``, ``state_dirs`` and ``leases`` describe this machine and are kept. It sets
  ``unverified_rebuild`` in ``config``: GC refuses to run until ``verify`` passes cleanly,
  since a rebuilt index cannot prove it is complete (a lost pack would go unnoticed).
  Packs whose trailer is corrupt and records that do not parse are skipped and reported.
- ``catch_up(store)`` applies history records that are durable in the backend but missing
  from the index (a crash between writing a record and committing its row). It only ever
  adds what the backend says and never drops a row the backend does not contradict, so it
  is safe next to concurrent writers. GC and verify call it first.

Both take no FUSE and write no pack. ``rebuild_index`` holds ``gc.lock`` exclusively and, on
a shared store, the ``gc`` lease with no writer pinned on any host (store/sharedgc.py), so
no writer is mid-flight while the tables are replaced.
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import blake3

from .backend import BlobBackend
from .catalog import JournalRow
from .errors import BackendError, IntegrityError
from .objects import CONFIG_KEY, Store
from .pack import Location, parse_trailer
from .ref import Ref

PACK_KEY = re.compile(r"packs/([0-9a-f]{64})\.pack")
SNAPSHOT_KEY = re.compile(r"snapshots/[A-Za-z0-9._-]+\.json")
JOURNAL_KEY = re.compile(r"journal/(.+)/([0-9]+)\.json")
UNVERIFIED = "unverified_rebuild"


@dataclass(frozen=True, slots=True)
class SnapshotRecord:
    """The listing of one Ref after replaying the snapshot-list records."""

    ref: str
    time_ns: int
    origin: str
    label: str | None
    key: str


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One journal event object, as stored in the backend (fields as in the journal table)."""

    session: str
    seq: int
    time_ns: int
    epoch: int
    event: str
    ref: str
    trigger: str | None
    consistency: str | None
    key: str

    def row(self) -> JournalRow:
        return (self.session, self.seq, self.time_ns, self.epoch, self.event, self.ref,
                self.trigger, self.consistency, self.key)


@dataclass
class History:
    """What the backend's history objects say.

    ``snapshots``: the replayed list, Ref text -> record; ``labels``: Ref text -> label ->
    (time_ns, key) of the last add giving it since the Ref's last forget; ``adds``: every
    add record by its key; ``last_op``: Ref text -> (key of the last record naming it, its op); ``journal``:
    every journal event object; ``bad``: (key, reason) of records that could not be parsed.
    """

    snapshots: dict[str, SnapshotRecord] = field(default_factory=dict)
    adds: dict[str, SnapshotRecord] = field(default_factory=dict)
    labels: dict[str, dict[str, tuple[int, str]]] = field(default_factory=dict)
    last_op: dict[str, tuple[str, str]] = field(default_factory=dict)
    journal: list[JournalRecord] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)


def _record(backend: BlobBackend, key: str) -> dict[str, object]:
    rec = json.loads(backend.get(key))
    if not isinstance(rec, dict):
        raise ValueError("record is not a JSON object")
    return rec


def _opt_str(v: object) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"expected a string or null, got {v!r}")
    return v


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def read_history(backend: BlobBackend) -> History:
    """Read and replay every snapshot-list record and every journal object in the backend."""
    h = History()
    for key in backend.list("snapshots/"):
        try:
            if not SNAPSHOT_KEY.fullmatch(key):
                raise ValueError("not a snapshot-list record key")
            rec = _record(backend, key)
            ref = str(Ref.parse(rec.get("ref")))
            op = rec.get("op")
            if op == "add":
                origin = rec.get("origin")
                if not isinstance(origin, str):
                    raise ValueError("add record without an origin")
                s = h.snapshots[ref] = h.adds[key] = SnapshotRecord(
                    ref, _int(rec.get("time_ns")), origin, _opt_str(rec.get("label")), key)
                if s.label is not None:
                    h.labels.setdefault(ref, {})[s.label] = (s.time_ns, key)
            elif op == "forget":
                h.snapshots.pop(ref, None)
                h.labels.pop(ref, None)
            else:
                raise ValueError(f"unknown op {op!r}")
            h.last_op[ref] = (key, op)
        except (ValueError, BackendError, IntegrityError) as e:
            h.bad.append((key, str(e)))
    for key in backend.list("journal/"):
        try:
            m = JOURNAL_KEY.fullmatch(key)
            if m is None:
                raise ValueError("not a journal event key")
            rec = _record(backend, key)
            jr = JournalRecord(
                session=str(rec.get("session")), seq=_int(rec.get("seq")),
                time_ns=_int(rec.get("time_ns")), epoch=_int(rec.get("epoch")),
                event=str(rec.get("event")), ref=str(Ref.parse(rec.get("ref"))),
                trigger=_opt_str(rec.get("trigger")),
                consistency=_opt_str(rec.get("consistency")), key=key)
            if (jr.session, jr.seq) != (m.group(1), int(m.group(2))):
                raise ValueError("record's session and seq differ from its key")
            h.journal.append(jr)
        except (ValueError, BackendError, IntegrityError) as e:
            h.bad.append((key, str(e)))
    return h


def catch_up(store: Store, history: History | None = None) -> int:
    """Apply durable history records that the index lacks; return how many rows changed.

    A listing whose last record is newer than the index row (or that has no row) is
    written; a Ref whose last record is a forget newer than its row is dropped; a journal
    event without a row gets one. Rows are never removed for lack of a record.
    """
    h = history if history is not None else read_history(store.backend)
    rows = {r[0]: r[4] for r in store.catalog.snapshots()}
    puts = []
    forgets = []
    for ref, (key, op) in h.last_op.items():
        have = rows.get(ref)
        if have is not None and (have or "") >= key:
            continue
        if op == "add":
            s = h.snapshots[ref]
            puts.append((ref, s.time_ns, s.origin, s.label, s.key))
        elif have is not None:
            forgets.append((ref, key))
    journal = [jr.row() for jr in h.journal]
    if not (puts or forgets or journal):
        return 0
    labels = [lr for r in puts for lr in label_rows(h, r[0])]
    # The catalog re-checks each row against what is there now, in one transaction (a
    # newer listing written meanwhile by another writer is never replaced by an older one).
    return store.catalog.apply_history(puts, forgets, journal, labels)


def label_rows(h: History, ref: str) -> list[tuple[str, str, int, str]]:
    """The label rows (ref, label, time_ns, key) the history gives ``ref``."""
    return [(ref, label, t, key) for label, (t, key) in h.labels.get(ref, {}).items()]


@dataclass
class RebuildReport:
    """What ``rebuild_index`` found: counts of what it indexed and what it skipped."""

    packs: int = 0
    objects: int = 0
    snapshots: int = 0
    journal_events: int = 0
    skipped_packs: list[tuple[str, str]] = field(default_factory=list)
    damaged_packs: list[tuple[str, str]] = field(default_factory=list)
    skipped_records: list[tuple[str, str]] = field(default_factory=list)
    unknown_keys: list[str] = field(default_factory=list)


def is_known_key(key: str) -> bool:
    """True for every key the store itself writes (config, packs, history records)."""
    return (key == CONFIG_KEY or PACK_KEY.fullmatch(key) is not None
            or SNAPSHOT_KEY.fullmatch(key) is not None or JOURNAL_KEY.fullmatch(key) is not None)


def read_pack(backend: BlobBackend, key: str) -> tuple[bytes, list[Location]]:
    """Return a pack's bytes and its trailer rows (``parse_pack``); BlobNotFoundError if it
    is gone."""
    data = backend.get(key)
    return data, parse_pack(key, data)


def parse_pack(key: str, data: bytes) -> list[Location]:
    """Return the trailer rows of the pack ``data``. Raises IntegrityError if the trailer is
    corrupt or a row points outside the pack's records."""
    rows = parse_trailer(key, data, lambda off, n: data[off:off + n])
    for loc in rows:
        if loc.rec_offset < 4 or loc.rec_offset + loc.rec_length > len(data):
            raise IntegrityError(key, f"trailer row for {loc.oid.hex()} points outside the pack")
    return rows


def rebuild_index(store: Store, *, wait_s: float | None = None,
                  force: bool = False) -> RebuildReport:
    """Recreate the index from the backend (see the module docstring). Holds gc.lock and,
    on a shared store, the ``gc`` lease with no writer pinned, as GC does
    (``sharedgc.exclusive``: it waits up to ``wait_s`` seconds, default ``sharedgc.WAIT_S``,
    for writers of every host); GCBusyError if another GC or rebuild runs, WritersBusyError
    (a GCError, exit 8) if writers stay. Unless ``force``, RebuildShrinkError (exit 8,
    nothing changed) if the backend lacks listed snapshots, journal events or packs the
    index holds (``_refuse_shrink``)."""
    from . import sharedgc

    rep = RebuildReport()
    with contextlib.ExitStack() as held:
        hold = held.enter_context(sharedgc.exclusive(
            store, sharedgc.WAIT_S if wait_s is None else wait_s, "rebuild-index")
        ) if store.catalog.shared else None
        fd = store.lock(exclusive=True)
        assert fd is not None
        held.callback(store.unlock, fd)
        _rebuild(store, rep, hold, force)
    return rep


def _refuse_shrink(store: Store, h: History, packs: set[str]) -> None:
    """Raise RebuildShrinkError if replacing the index with the backend's history ``h`` and
    the listed packs ``packs`` (keys) would drop listed snapshots, journal events or packs
    that it indexes: a history record is written before its row and a pack before its
    rows, so a row without its record or pack means a listing that is not the store's
    whole (an emptied, damaged or wrong bucket or prefix, a lost pack). A listed pack
    that cannot be read is not one: the rebuild reports it (``skipped_packs``)."""
    from .errors import RebuildShrinkError

    gone = sorted({r[0] for r in store.catalog.snapshots()} - set(h.snapshots))
    events = store.catalog.summary().journal_events
    lost_events = max(0, events - len({(jr.session, jr.seq) for jr in h.journal}))
    lost_packs = sorted({key for key, _, _ in store.catalog.packs()} - packs)
    if gone or lost_events or lost_packs:
        raise RebuildShrinkError(len(gone), lost_events, gone[:3] + lost_packs[:3],
                                 len(lost_packs))


def _rebuild(store: Store, rep: RebuildReport, hold: Any, force: bool = False) -> None:
    """``rebuild_index``'s work into ``rep``; ``hold`` (a ``sharedgc.GCHold`` or None) is
    kept renewed while the packs are read."""
    packs: list[tuple[str, int, list[Location]]] = []
    listed: set[str] = set()
    for key in store.backend.list(""):
        if hold is not None:
            hold.keep()
        m = PACK_KEY.fullmatch(key)
        if m is None:
            if not is_known_key(key):
                rep.unknown_keys.append(key)
            continue
        listed.add(key)
        try:
            data, rows = read_pack(store.backend, key)
        except (IntegrityError, BackendError) as e:
            rep.skipped_packs.append((key, str(e)))
            continue
        if blake3.blake3(data).hexdigest() != m.group(1):
            rep.damaged_packs.append((key, "pack bytes do not hash to its key"))
        packs.append((key, len(data), rows))
    h = read_history(store.backend)
    rep.skipped_records = list(h.bad)
    if not force:
        _refuse_shrink(store, h, listed)
    if hold is not None:  # lost (this host paused past its ttl): stop before any change
        hold.renew()
    # GC refuses until verify passes: set before the tables change, so a crash in
    # between leaves the flag up (a spurious flag costs one verify, a missing one a
    # GC over a partial index).
    store.set_config(UNVERIFIED, "1")
    rep.objects = store.catalog.replace_all(
        packs, [(s.ref, s.time_ns, s.origin, s.label, s.key) for s in h.snapshots.values()],
        [jr.row() for jr in h.journal],
        [lr for ref in h.snapshots for lr in label_rows(h, ref)])
    if store.catalog.shared:  # this host's caches are in its local index
        c = store.conn
        for table in ("files_cache", "dirs_cache", "located", "located_trees"):
            c.execute(f"DELETE FROM {table}")
    rep.packs = len(packs)
    rep.snapshots = len(h.snapshots)
    rep.journal_events = len({(jr.session, jr.seq) for jr in h.journal})

