"""The step change log's daemon side (issue 14.1): which paths changed since the last step.

A *step* is one unit of agent work (a tool call, or whatever the caller marks with
``step_done``). At each step the daemon compares the live tree's changes against the lower
(the upper's dirty set) with the changes it saw at the previous step, path by path, and
reports the paths whose state differs, each with its status relative to the previous step:
``added``, ``removed``, ``modified`` or ``type_changed`` (the vocabulary of
``store.diff``). A step holds what was applied between the previous step and itself,
whoever wrote it: a write made outside any tool call (a dev server, a build) is in the
first step closed after it; nothing is dropped.

Fingerprints. A path's state is its *fingerprint*: (status against the lower, kind, size,
mtime_ns, ctime_ns) for files, symlinks and special files, and (status, kind, mode, uid,
gid) for directories (a directory's times change whenever an entry does; the entries are
reported on their own paths). ctime moves on every change of content or metadata, so two
equal fingerprints mean an unchanged path.

Cost. ``fingerprints`` walks only the directories the upper marks dirty (the same set a
checkpoint's plan walks, ``checkpoint._dirty_dirs``) and, in each, only its upper dentries
and its copied-up children: O(nodes in memory) for the one pass selecting the upper
nodes, then O(changes); no lower tree is listed and no content is read. Two shapes fall
back to the full preview diff that ``rewindfs diff`` uses (O(dirty bytes)): hard-link
groups and a dirty directory whose parent chain is not in memory.

Granularity. A created directory is reported with every path created below it; a removed
or renamed directory is reported by its names (the old name ``removed``, the new one
``added``), not by each path below it.

Resets. A checkpoint or restore rebases the upper, which changes what "against the lower"
means. ``StepTracker.pending`` computes the delta since the last step just before; once the
reset succeeded, ``StepTracker.reset`` keeps it (``carry``) and the next step reports it
merged with what follows, so no change is lost across a checkpoint. A restore's own
changes are the restore's (journaled as ``WorkspaceRestored``), not a step's: after it the
baseline is the restored tree.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from store.tree import Kind

from .inodes import ROOT_INO

if TYPE_CHECKING:
    from .inodes import Node
    from .overlay import Overlay

# A fingerprint: (status against the lower, kind name, then three kind-dependent ints).
Fingerprint = tuple[str, str, int, int, int]
STATUSES = ("added", "removed", "modified", "type_changed")

# origin keys of lower names: b"p" + parent inode (8) + kind (1) + content digest (32) + name
_NAME_AT = 1 + 8 + 1 + 32


def _fp(status: str, n: Node) -> Fingerprint:
    if n.kind is Kind.DIR:
        return (status, "dir", n.mode, n.uid, n.gid)
    return (status, n.kind.name.lower(), n.size, n.mtime_ns, n.ctime_ns)


def fingerprints(ov: Overlay, index: Index | None = None) -> dict[str, Fingerprint] | None:
    """Every path whose state differs from the lower, with its fingerprint; None when the
    fast walk cannot tell (see the module docstring), and the caller uses ``preview_fps``.
    With ``index``, also records where each node it passes is named (for the incremental
    steps of ``StepTracker``). Event-loop thread (no request may change the overlay
    meanwhile)."""
    from .checkpoint import _dirty_dirs

    nodes = ov.nodes
    uppers = [n for n in nodes.values() if n.upper]
    dirty, groups = _dirty_dirs(ov, uppers)
    if dirty is None or groups:
        return None
    out: dict[str, Fingerprint] = {}
    if not dirty:
        return out
    by_parent: dict[int, list[tuple[bytes, Node]]] = {}
    for n in uppers:
        o = n.origin
        if n.nlink == 0 or n.ino == ROOT_INO or o is None or o[:1] != b"p":
            continue
        if n.kind is not Kind.DIR and n.lower_links <= 0:
            continue
        by_parent.setdefault(int.from_bytes(o[1:9], "little"), []).append((o[_NAME_AT:], n))
    stack: list[tuple[int, bytes]] = [(ROOT_INO, b"")]
    while stack:
        ino, path = stack.pop()
        d = nodes.get(ino)
        if d is None or d.kind is not Kind.DIR:
            return None
        seen: set[bytes] = set()
        kids: list[tuple[bytes, Node]] = []
        for name, (cino, _cookie) in (d.entries or {}).items():
            seen.add(name)
            if cino == 0:  # a whiteout
                le = ov._lower_entry(d, name)
                if le is not None and not ov.excluded(path + name, le.kind is Kind.DIR):
                    out[os.fsdecode(path + name)] = ("removed", le.kind.name.lower(), 0, 0, 0)
                continue
            c = nodes.get(cino)
            if c is None:
                return None
            kids.append((name, c))
        kids.extend(kv for kv in by_parent.get(ino, ()) if kv[0] not in seen)
        for name, c in kids:
            if ov.exclude is not None and ov.excluded(path + name, c.kind is Kind.DIR):
                continue  # excluded paths are in no step (nor in any Ref)
            le = ov._lower_entry(d, name)
            status: str | None = None
            if le is None:
                status = "added"
            elif le.kind is not c.kind:
                status = "type_changed"
            elif c.kind is Kind.DIR:
                if (c.mode, c.uid, c.gid) != (le.mode, le.uid, le.gid):
                    status = "modified"
            elif c.upper:
                status = "modified"
            full = path + name
            if status is not None:
                out[os.fsdecode(full)] = _fp(status, c)
            if index is not None:
                index.name(c, ino, name, full)
            if c.kind is Kind.DIR and c.ino in dirty:
                stack.append((c.ino, full + b"/"))
    return out


class _Full(Exception):
    """An incremental step met a shape it does not follow (a directory moved or removed,
    a hard link, a node not in memory): walk the whole dirty set instead."""


class Index:
    """Where nodes are named, learnt from walks and steps: ``names`` (inode -> (directory
    inode, name) pairs that named it) and ``dirs`` (directory inode -> its path prefix,
    ``b""`` for the root, else ``b"a/b/"``)."""

    def __init__(self) -> None:
        self.names: dict[int, set[tuple[int, bytes]]] = {}
        self.dirs: dict[int, bytes] = {ROOT_INO: b""}

    def name(self, c: Node, parent: int, name: bytes, full: bytes) -> None:
        self.names.setdefault(c.ino, set()).add((parent, name))
        if c.kind is Kind.DIR:
            self.dirs[c.ino] = full + b"/"

    def prefix(self, ov: Overlay, ino: int) -> bytes:
        """The path prefix of directory ``ino``: known, or found from its lower name when
        it was never moved. Raises _Full otherwise."""
        p = self.dirs.get(ino)
        if p is not None:
            return p
        n = ov.nodes.get(ino)
        o = n.origin if n is not None else None
        if n is None or n.kind is not Kind.DIR or o is None or o[:1] != b"p":
            raise _Full
        parent = int.from_bytes(o[1:9], "little")
        name = o[_NAME_AT:]
        d = ov.nodes.get(parent)
        if n.parent != parent or d is None:
            raise _Full
        got = (d.entries or {}).get(name)
        if got is not None and got[0] != ino:
            raise _Full
        p = self.prefix(ov, parent) + name + b"/"
        self.dirs[ino] = p
        return p


def fingerprint_of(ov: Overlay, parent: int, name: bytes) -> tuple[Fingerprint | None, Node | None]:
    """(fingerprint of the name ``name`` in directory ``parent``, or None when it is as in
    the lower; the node it names, if any). The rules of ``fingerprints`` for one name.
    Raises _Full for a shape the incremental step does not follow."""
    from .inodes import origin_key

    nodes = ov.nodes
    d = nodes.get(parent)
    if d is None or d.kind is not Kind.DIR:
        raise _Full
    le = ov._lower_entry(d, name)
    got = (d.entries or {}).get(name)
    if got is not None and got[0] == 0:  # a whiteout
        if le is None:
            return None, None
        if le.kind is Kind.DIR:
            raise _Full  # a directory removed or moved away: its paths below change too
        return ("removed", le.kind.name.lower(), 0, 0, 0), None
    if got is not None:
        c = nodes.get(got[0])
        if c is None:
            raise _Full
    else:
        if le is None:
            return None, None
        ino = ov.by_origin.get(origin_key(parent, name, le))
        c = nodes.get(ino) if ino is not None else None
        if c is None or not c.upper or (c.kind is not Kind.DIR and c.lower_links <= 0):
            return None, c
    if c.kind is not Kind.DIR and (c.nlink > 1 or (c.origin or b"")[:1] == b"g"):
        raise _Full  # hard links: the group walk of checkpoint.plan knows them
    if le is None:
        return _fp("added", c), c
    if le.kind is not c.kind:
        if Kind.DIR in (le.kind, c.kind):
            raise _Full  # the paths below it change too
        return _fp("type_changed", c), c
    if c.kind is Kind.DIR:
        if (c.mode, c.uid, c.gid) != (le.mode, le.uid, le.gid):
            return _fp("modified", c), c
        return None, c
    return (_fp("modified", c) if c.upper else None), c


def preview_fps(ov: Overlay) -> dict[str, Fingerprint]:
    """The fallback of ``fingerprints``: the checkpoint preview's diff against the lower
    (``rewindfs diff``'s machinery, O(dirty bytes)), each path's node looked up."""
    from store.diff import diff_trees

    from . import checkpoint as ck

    base = ov.lower.ref
    ref, mw = ck.preview(ov)
    out: dict[str, Fingerprint] = {}
    for c in diff_trees(mw, base.tree_id, ref.tree_id):  # type: ignore[arg-type]
        p = os.fsdecode(c.path)
        if c.new is None:
            assert c.old is not None
            out[p] = ("removed", c.old.kind.name.lower(), 0, 0, 0)
            continue
        try:
            n = ov.resolve(c.path)
        except OSError:
            continue
        if n.kind is Kind.DIR and c.status == "modified":
            continue  # only its entries changed, or only its times (reported below it)
        out[p] = _fp(c.status, n)
    return out


def _exists(fp: Fingerprint | None, before: bool) -> bool:
    """Did the path exist at the fingerprinted moment? ``None`` means "as in the lower",
    which the other side's status tells."""
    if fp is None:
        return before
    return fp[0] != "removed"


def relative(a: Fingerprint | None, b: Fingerprint | None) -> str:
    """The status of a path going from state ``a`` to state ``b`` (None: as in the lower;
    the two differ)."""
    if a is None:
        assert b is not None
        return b[0]  # from the lower's state: the status against the lower
    if b is None:
        return {"added": "removed", "removed": "added"}.get(a[0], a[0])
    was, now = a[0] != "removed", b[0] != "removed"
    if not was:
        return "added"
    if not now:
        return "removed"
    return "type_changed" if a[1] != b[1] else "modified"


def compose(first: str, then: str) -> str | None:
    """The status of two successive changes of one path (None: no net change, a path made
    and removed again)."""
    before = first != "added"
    after = then != "removed"
    if not before and not after:
        return None
    if not before:
        return "added"
    if not after:
        return "removed"
    if "type_changed" in (first, then):
        return "type_changed"
    return "modified"


def delta(prev: dict[str, Fingerprint], cur: dict[str, Fingerprint],
          keys: set[str] | None = None) -> dict[str, str]:
    """path -> status for every path whose fingerprint changed from ``prev`` to ``cur``
    (only among ``keys`` when given: the only paths that may differ)."""
    out: dict[str, str] = {}
    if keys is not None:
        for p in keys:
            old, fp = prev.get(p), cur.get(p)
            if old != fp:
                out[p] = relative(old, fp)
        return out
    for p, fp in cur.items():
        old = prev.get(p)
        if old != fp:
            out[p] = relative(old, fp)
    for p, old in prev.items():
        if p not in cur:
            out[p] = relative(old, None)
    return out


def merge(carry: dict[str, str], d: dict[str, str]) -> dict[str, str]:
    """``carry`` followed by ``d`` (both path -> status)."""
    out = dict(carry)
    for p, s in d.items():
        first = out.get(p)
        if first is None:
            out[p] = s
            continue
        both = compose(first, s)
        if both is None:
            del out[p]
        else:
            out[p] = both
    return out


class StepTracker:
    """The per-daemon state of the step log: fingerprints at the previous step (``prev``),
    and the changes carried over a reset (``carry``). Event-loop thread only.

    The first step after a start, a resume or a reset walks the dirty set
    (``fingerprints``) and learns where each node is named (``Index``); later steps look
    only at what changed since (``Overlay.step_inos``/``step_dents``, marked with each
    change, whether or not a batch was committed since), so a step costs O(changes since
    the previous step), however long ago the commit loop last took a batch. A shape the
    incremental step does not follow (a directory moved or removed, a file replaced by a
    directory or back, hard links) makes that step walk the dirty set again."""

    def __init__(self, ov: Overlay) -> None:
        self.ov = ov
        self.prev: dict[str, Fingerprint] = {}
        self.carry: dict[str, str] = {}
        self._index: Index | None = None
        self.walks = 0  # steps that walked the whole dirty set (for tests and benchmarks)
        self.looked = 0  # paths the last incremental step looked at (for tests)

    def _touched(self) -> tuple[set[int], set[tuple[int, bytes]]]:
        ov = self.ov  # read before ``_begin`` starts new sets
        return ov.step_inos or set(), ov.step_dents

    def _walk(self) -> dict[str, Fingerprint]:
        index = Index()
        self.walks += 1
        fps = fingerprints(self.ov, index)
        if fps is None:
            self._index = None
            return preview_fps(self.ov)
        self._index = index
        return fps

    def _incremental(self, index: Index) -> tuple[dict[str, Fingerprint], set[str]]:
        """``prev`` updated with what was touched since, and the paths looked at. Raises
        _Full."""
        ov = self.ov
        nodes = ov.nodes
        inos, dents = self._touched()
        targets = set(dents)
        for ino in inos:
            if ino == ROOT_INO:
                continue
            targets |= index.names.get(ino, set())
            n = nodes.get(ino)
            o = n.origin if n is not None else None
            if n is not None and o is not None and o[:1] == b"p":
                targets.add((int.from_bytes(o[1:9], "little"), o[_NAME_AT:]))
            # else: made since (its dentry is touched too) or detached (in no tree)
        cur = dict(self.prev)
        keys: set[str] = set()
        todo = list(targets)
        while todo:
            later = []
            for parent, name in todo:
                try:
                    full = index.prefix(ov, parent) + name
                except _Full:
                    later.append((parent, name))  # maybe a directory made in this step
                    continue
                key = os.fsdecode(full)
                keys.add(key)
                fp, c = fingerprint_of(ov, parent, name)
                old = self.prev.get(key)
                if ov.exclude is not None and ov.excluded(
                        full, c.kind is Kind.DIR if c is not None else
                        (old is not None and old[1] == "dir")):
                    keys.discard(key)  # excluded paths are in no step
                    if c is not None:
                        index.name(c, parent, name, full)
                    continue
                if old is not None and old[1] == "dir" and (fp is None or fp[1] != "dir"):
                    raise _Full
                if c is not None:
                    index.name(c, parent, name, full)
                if fp is None:
                    cur.pop(key, None)
                else:
                    cur[key] = fp
            if len(later) == len(todo):
                raise _Full
            todo = later
        self.looked = len(keys)
        return cur, keys

    def current(self) -> tuple[dict[str, Fingerprint], set[str] | None]:
        """Every path whose state differs from the lower, with its fingerprint; and the
        paths that may differ from ``prev`` (None: any)."""
        if self._index is not None:
            try:
                return self._incremental(self._index)
            except _Full:
                pass
        return self._walk(), None

    def _begin(self) -> None:
        """Start collecting what changes from now (a step's baseline)."""
        ov = self.ov
        ov.step_inos = set()
        ov.step_dents = set()

    def pending(self) -> dict[str, str]:
        """The changes since the previous step (carry included), not yet recorded."""
        return merge(self.carry, delta(self.prev, *self.current()))

    def reset(self, pending: dict[str, str]) -> None:
        """The upper was rebased (checkpoint or restore): keep ``pending`` for the next
        step and start again from the new lower."""
        self.carry = pending
        self.prev = {}
        self._index = None
        self.ov.step_inos = None  # the next step walks the (new) dirty set

    def resume(self, prev: dict[str, Fingerprint], carry: dict[str, str]) -> None:
        """Continue from persisted state (a restarted daemon)."""
        self.prev = dict(prev)
        self.carry = dict(carry)
        self._index = None

    def give_back(self, changes: list[dict[str, Any]]) -> None:
        """``changes`` of a closed step were not recorded: the next step reports them."""
        self.carry = merge({c["path"]: c["status"] for c in changes}, self.carry)

    def step(self) -> dict[str, Any]:
        """Close a step: ``{"changes": [{"path", "status", "kind"}...] (path order),
        "fingerprints": {path: fingerprint list or None (as in the lower)} of the changed
        paths}``, and start the next from now."""
        cur, keys = self.current()
        self._begin()
        d = delta(self.prev, cur, keys)
        changes = merge(self.carry, d)
        fps: dict[str, list[Any] | None] = {}
        for p in set(d) | set(changes):
            fp = cur.get(p)
            fps[p] = list(fp) if fp is not None else None
        out = []
        for p in sorted(changes):
            fp = cur.get(p) or self.prev.get(p)
            kind = fp[1] if fp is not None else None
            out.append({"path": p, "status": changes[p], "kind": kind})
        self.prev = cur
        self.carry = {}
        return {"changes": out, "fingerprints": fps}
