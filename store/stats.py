"""Store statistics: how much the snapshots hold against how much the backend stores.

Read-only; takes no lock (figures are a consistent-enough view of one moment's index).
"""

from __future__ import annotations

from dataclasses import dataclass

from .objects import Store
from .pack import ObjKind
from .ref import ObjectId, Ref
from .tree import Kind


@dataclass(frozen=True, slots=True)
class Stats:
    """Figures for one store; all sizes in bytes.

    ``logical_bytes``: sum of file sizes over the listed snapshots, each snapshot counted
    on its own (what materializing every one of them would write); ``files``: file entries
    counted the same way. ``unique_bytes``: plaintext bytes of the distinct indexed chunks;
    ``tree_bytes``: plaintext bytes of the indexed trees. ``stored_bytes``: total size of the
    indexed packs. ``dedup_ratio`` = logical / unique; ``compression_ratio`` = (unique +
    tree) / stored. A ratio with a zero denominator is reported as 1.0.
    """

    snapshots: int
    files: int
    logical_bytes: int
    unique_bytes: int
    tree_bytes: int
    stored_bytes: int
    packs: int
    chunks: int
    trees: int
    sessions: int
    journal_events: int
    dedup_ratio: float
    compression_ratio: float


def _ratio(a: int, b: int) -> float:
    return a / b if b else 1.0


def stats(store: Store) -> Stats:
    """Compute Stats for ``store``. Raises the store's read errors (ObjectNotFoundError,
    IntegrityError) if a listed snapshot's tree cannot be read."""
    memo: dict[ObjectId, tuple[int, int]] = {}

    def size_of(tid: ObjectId) -> tuple[int, int]:
        # Iterative post-order walk with a memo per tree id: shared subtrees cost once.
        stack: list[tuple[ObjectId, bool]] = [(tid, False)]
        while stack:
            t, expanded = stack.pop()
            if t in memo:
                continue
            tree = store.get_tree(t)
            children = [e.tree_id for e in tree.entries
                        if e.kind is Kind.DIR and e.tree_id is not None]
            if not expanded and any(ch not in memo for ch in children):
                stack.append((t, True))
                stack.extend((ch, False) for ch in children if ch not in memo)
                continue
            nbytes = nfiles = 0
            for e in tree.entries:
                if e.kind is Kind.FILE:
                    nbytes += e.size
                    nfiles += 1
            for ch in children:
                nbytes += memo[ch][0]
                nfiles += memo[ch][1]
            memo[t] = (nbytes, nfiles)
        return memo[tid]

    logical = files = 0
    refs = [r[0] for r in store.catalog.snapshots()]
    for text in refs:
        b, f = size_of(Ref.parse(text).tree_id)
        logical += b
        files += f
    s = store.catalog.summary()
    nchunks, unique = s.kinds.get(int(ObjKind.CHUNK), (0, 0))
    ntrees, tree_bytes = s.kinds.get(int(ObjKind.TREE), (0, 0))
    npacks, stored, sessions, events = s.packs, s.stored_bytes, s.sessions, s.journal_events
    return Stats(snapshots=len(refs), files=files, logical_bytes=logical,
                 unique_bytes=unique, tree_bytes=tree_bytes, stored_bytes=stored,
                 packs=npacks, chunks=nchunks, trees=ntrees, sessions=sessions,
                 journal_events=events, dedup_ratio=_ratio(logical, unique),
                 compression_ratio=_ratio(unique + tree_bytes, stored))
