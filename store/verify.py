"""Verify: check every invariant of the store and report each broken one by its stable name.

The invariants and their names are listed in ``schema.py``'s docstring; ``INVARIANTS``
below is the same list, and each check here reports under one of those names. ``verify``
re-reads every indexed pack, re-hashes every indexed object (``full=True``; ``full=False``
re-hashes trees only), walks every tree reachable from the snapshot list, the journals and
the named refs, and compares the history rows with the backend's history objects.

Before checking, the index is caught up with history records that are durable in the
backend but lack their row (``rebuild.catch_up``; what a crash between the two leaves):
that is the index lagging, not a broken invariant. Otherwise verify changes nothing, except
that a clean full run clears ``unverified_rebuild`` so GC may run again. Packs that no index
row names are crash leftovers for GC, not problems. Verify never raises for a broken
store; it returns the problems found (empty when healthy). ``files_cache`` and
``dirs_cache`` rows are hints that the snapshot code re-checks against the index before
trusting them, so a row naming an object that is gone is not a problem (GC prunes them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3

from .errors import StoreError
from .objects import Store
from .pack import Codec, Location, ObjKind, decode_record
from .rebuild import UNVERIFIED, History, catch_up, parse_pack, read_history
from .ref import ObjectId, Ref, object_id
from .tree import Kind, decode_tree, encode_tree

INVARIANTS = (
    "object-hash", "object-location", "pack-trailer", "pack-indexed", "tree-decodes",
    "tree-complete", "file-size", "snapshot-root", "journal-ref", "named-ref",
    "history-object", "journal-seq",
)

Progress = Callable[[int, int], None]
"""``progress(done, total)``: pack bytes checked so far and in all."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One broken invariant: its stable name, the key it concerns (object id hex, pack
    key, Ref, history key or path) and a human-readable detail."""

    invariant: str
    key: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.key}: {self.detail}"


class _Report:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def add(self, invariant: str, key: str, detail: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.problems.append(Problem(invariant, key, detail))


_ObjRow = tuple[bytes, int, int, int, int, int, int]  # id kind off len codec inner rawlen


@dataclass
class _Index:
    """The index as one read transaction saw it: consistent with the write order (objects
    are committed before anything lists them)."""

    kinds: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # id -> (kind, length)
    by_pack: dict[str, list[_ObjRow]] = field(default_factory=lambda: defaultdict(list))
    packs: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (size, count)
    snapshots: list[tuple[str, int, str, str | None, str]] = field(default_factory=list)
    journal: list[tuple[str, int, int, int, str, str, str | None, str | None, str]] = field(
        default_factory=list)
    named: list[tuple[str, str]] = field(default_factory=list)


def _load(store: Store) -> _Index:
    idx = _Index()
    d = store.catalog.dump()  # one read transaction
    for oid, kind, pack, off, ln, codec, inner, raw in d.objects:
        idx.kinds[oid] = (kind, raw)
        idx.by_pack[pack].append((oid, kind, off, ln, codec, inner, raw))
    idx.packs = {k: (size, n) for k, size, n in d.packs}
    idx.snapshots, idx.journal, idx.named = d.snapshots, d.journal, d.named
    return idx


def verify(store: Store, *, full: bool = True, progress: Progress | None = None) -> list[Problem]:
    """Check ``store`` and return its problems, in check order (empty when healthy).

    Holds ``gc.lock`` shared, so GC cannot delete packs under it while snapshots may still
    run; what they add after the index was read is simply not checked this time.
    """
    rep = _Report()
    fd = store.lock(exclusive=False)
    assert fd is not None
    try:
        before = read_history(store.backend)
        catch_up(store, before)
        idx = _load(store)
        after = read_history(store.backend)  # every row read above has its record by now
        _check_packs(store, rep, idx, full, progress)
        _check_reachable(store, rep, idx)
        _check_history(rep, idx, before, after)
    finally:
        store.unlock(fd)
    if full and not rep.problems:
        store.set_config(UNVERIFIED, None)
    return rep.problems


def _check_packs(store: Store, rep: _Report, idx: _Index, full: bool,
                 progress: Progress | None) -> None:
    packs, by_pack, kinds = idx.packs, idx.by_pack, idx.kinds
    total = sum(size for size, _ in packs.values())
    done = 0
    for key in sorted(set(packs) | set(by_pack)):
        rows = by_pack.get(key, [])
        if key not in packs:
            for r in rows:
                rep.add("object-location", r[0].hex(), f"names pack {key}, which is not indexed")
        try:
            data = store.backend.get(key)
        except StoreError as e:
            for r in rows:
                rep.add("object-location", r[0].hex(), f"pack {key} cannot be read: {e}")
            if not rows:
                rep.add("pack-trailer", key, f"indexed pack cannot be read: {e}")
            continue
        trailer: dict[bytes, Location] | None = None
        if key in packs:
            trailer = _check_trailer(rep, key, data, packs[key], kinds)
        for r in rows:
            oid, kind, off, ln, codec, inner, raw = r
            if trailer is not None:
                t = trailer.get(oid)
                if t is None or (int(t.kind), t.rec_offset, t.rec_length, int(t.codec),
                                 t.inner_offset, t.raw_length) != (kind, off, ln, codec,
                                                                   inner, raw):
                    rep.add("object-location", oid.hex(),
                            f"pack {key}'s trailer does not list it at this location")
            if off < 4 or off + ln > len(data):
                rep.add("object-location", oid.hex(), f"record lies outside pack {key}")
                continue
        _check_hashes(rep, key, data, rows, full)
        done += packs.get(key, (len(data), 0))[0]
        if progress is not None:
            progress(done, total)


def _check_trailer(rep: _Report, key: str, data: bytes, row: tuple[int, int],
                   kinds: dict[bytes, tuple[int, int]]) -> dict[bytes, Location] | None:
    digest = key.removeprefix("packs/").removesuffix(".pack")
    if blake3.blake3(data).hexdigest() != digest:
        rep.add("pack-trailer", key, "pack bytes do not hash to its key")
    try:
        locs = parse_pack(key, data)
    except StoreError as e:
        rep.add("pack-trailer", key, f"trailer does not decode: {e}")
        return None
    if (len(data), len(locs)) != row:
        rep.add("pack-trailer", key, f"size {len(data)} and {len(locs)} objects, but the index "
                                     f"says {row[0]} and {row[1]}")
    for loc in locs:
        if loc.oid not in kinds:
            rep.add("pack-indexed", loc.oid.hex(), f"listed in {key}'s trailer but not indexed")
    return {loc.oid: loc for loc in locs}


def _check_hashes(rep: _Report, key: str, data: bytes, rows: list[_ObjRow], full: bool) -> None:
    plain_of: dict[tuple[int, int], bytes | StoreError] = {}
    for oid, kind, off, ln, codec, inner, raw in rows:
        if not full and kind != ObjKind.TREE:
            continue
        if off < 4 or off + ln > len(data):
            continue  # reported as object-location
        rec = plain_of.get((off, ln))
        if rec is None:
            try:
                rec = decode_record(key, Codec(codec), data[off:off + ln], 1 << 27,
                                    ObjectId(oid))
            except (StoreError, ValueError) as e:
                rec = StoreError(str(e))
            plain_of[(off, ln)] = rec
        if isinstance(rec, StoreError):
            rep.add("object-hash", oid.hex(), f"record in {key} does not decode: {rec}")
            continue
        got = rec[inner:inner + raw]
        if len(got) != raw or object_id(got) != oid:
            rep.add("object-hash", oid.hex(), f"stored bytes in {key} do not hash to the id")


def _roots(rep: _Report, idx: _Index) -> list[ObjectId]:
    kinds = idx.kinds
    roots: list[ObjectId] = []
    sources = [("snapshot-root", [(r[0], r[0]) for r in idx.snapshots]),
               ("journal-ref", [(r[5], r[8]) for r in idx.journal]),
               ("named-ref", [(r[1], r[0]) for r in idx.named])]
    for invariant, pairs in sources:
        for text, where in pairs:
            try:
                ref = Ref.parse(text)
            except StoreError as e:
                rep.add(invariant, str(where), f"not a Ref: {e}")
                continue
            k = kinds.get(ref.tree_id)
            if k is None or k[0] != ObjKind.TREE:
                what = "is not indexed" if k is None else "names a chunk, not a tree"
                rep.add(invariant, str(where), f"root tree of {ref} {what}")
                continue
            roots.append(ref.tree_id)
    return roots


def _check_reachable(store: Store, rep: _Report, idx: _Index) -> None:
    kinds = idx.kinds
    seen: set[bytes] = set()
    stack = _roots(rep, idx)
    while stack:
        tid = stack.pop()
        if tid in seen:
            continue
        seen.add(tid)
        try:
            data = store.read_object(tid)
        except StoreError:
            continue  # reported as object-hash or object-location
        try:
            tree = decode_tree(data, tid.hex())
            if encode_tree(tree.entries, tree.version) != data:
                raise ValueError("does not re-encode to the same bytes")
        except (StoreError, ValueError) as e:
            rep.add("tree-decodes", tid.hex(), str(e))
            continue
        for ent in tree.entries:
            where = f"{tid.hex()}/{ent.name!r}"
            if ent.kind is Kind.DIR and ent.tree_id is not None:
                k = kinds.get(ent.tree_id)
                if k is None or k[0] != ObjKind.TREE:
                    rep.add("tree-complete", where,
                            f"child tree {ent.tree_id.hex()} "
                            + ("is not indexed" if k is None else "is indexed as a chunk"))
                else:
                    stack.append(ent.tree_id)
            elif ent.kind is Kind.FILE:
                total = 0
                complete = True
                for cid, reps in ent.chunks.runs():
                    k = kinds.get(cid)
                    if k is None or k[0] != ObjKind.CHUNK:
                        complete = False
                        rep.add("tree-complete", where, f"chunk {cid.hex()} "
                                + ("is not indexed" if k is None else "is indexed as a tree"))
                    else:
                        total += k[1] * reps
                if complete and total != ent.size:
                    rep.add("file-size", where,
                            f"size {ent.size} but its chunks hold {total} bytes")


def _check_history(rep: _Report, idx: _Index, before: History, after: History) -> None:
    """``before`` was read (and caught up) before the index was read, ``after`` after it:
    a row must have its record in ``after``; a record in ``before`` must have its row unless
    a newer record came in between."""
    for key, why in after.bad:
        rep.add("history-object", key, f"history object does not parse: {why}")
    listed = set()
    for ref, time_ns, origin, label, key in idx.snapshots:
        listed.add(ref)
        rec = after.adds.get(key)
        last = before.last_op.get(ref)
        if rec is None:
            rep.add("history-object", ref, f"index row names record {key}, which is missing")
        elif (rec.ref, rec.time_ns, rec.origin, rec.label) != (ref, time_ns, origin, label):
            rep.add("history-object", ref, f"index row differs from its record {key}")
        elif last is not None and last[1] == "forget" and last[0] > key:
            rep.add("history-object", ref, f"listed in the index but forgotten by {last[0]}")
    for ref in before.snapshots.keys() - listed:
        if after.last_op.get(ref) == before.last_op.get(ref):
            rep.add("history-object", ref,
                    "listed by the backend's records but not in the index")
    records = {(j.session, j.seq): j for j in after.journal}
    rows = set()
    seqs: dict[str, list[int]] = defaultdict(list)
    for row in idx.journal:
        rows.add((row[0], row[1]))
        seqs[row[0]].append(row[1])
        j = records.get((row[0], row[1]))
        if j is None:
            rep.add("history-object", f"journal/{row[0]}/{row[1]}",
                    "journal row has no backend object")
        elif j.row() != tuple(row):
            rep.add("history-object", j.key, "journal row differs from its backend object")
    for j in before.journal:
        if (j.session, j.seq) not in rows:
            rep.add("history-object", j.key, "journal object has no index row")
    for session, ss in seqs.items():
        if ss != list(range(1, len(ss) + 1)):
            rep.add("journal-seq", session, f"seqs are not 1..{len(ss)} without gaps")
