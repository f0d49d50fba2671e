"""Restore: repoint a live overlay at another snapshot (CONTRACT 3.2), data side.

Owns what a restore changes in the overlay and the upper layer, and the list of kernel
cache entries to invalidate; the ordering around it (pause, the optional wait for writers,
the pre-restore checkpoint, journal, release, invalidation worker) is ``control.Live``'s.

A restore treats what it replaces as Linux treats a file unlinked while open: it never
waits for open files. Every inode the kernel still holds on a path the restore removes or
replaces is *detached* (``Overlay.detach``): handles keep reading its old bytes, its later
writes stay in its own upper row and reach neither the restored tree nor any checkpoint,
and a removed directory shows nothing (relative lookups from a cwd inside it give ENOENT).
A file open for writing is detached even where its path does not change, and the path gets
a new inode number (the kernel keys page cache and attributes by inode, so the writer and
the restored file cannot share one). Detached files that still read chunks of the old
lower hold its Ref (``Overlay.held``), which the upper records for GC.

It starts from a *clean* overlay: every change is in the lower (the pre-restore
checkpoint, or for ``discard`` an unlisted freeze), so the old and the new tree are two
snapshots and ``store.diff.diff_trees`` lists exactly what differs, skipping equal subtrees:
every step below costs the difference, not the tree.

1. ``verify``: the diff reads every tree that differs (raising if one is missing or
   corrupt) and every chunk of a new or changed file must be indexed.
2. ``plan_swap`` (event-loop thread): for each changed path, the inode numbers before and
   after. A path whose content (or kind, or hard-link group) changes gets a new number, its
   old inode is detached (no name reaches it; open handles keep reading the old content);
   so is a file open for writing (``writers``), whatever happens to its path;
   a path whose metadata only changes keeps its number and gets new attributes; a directory
   present in both trees keeps its number, so a process whose cwd it is keeps a valid cwd.
   Pins make the new numbers stable (see ``inodes.py``).
3. ``checkpoint.reset_upper`` commits the new base and pins in one transaction; then
   ``apply_swap`` switches the overlay in memory, atomically for requests.
4. The kernel entries and inodes to invalidate are returned (``Invalidation``): the names
   that appeared, vanished or changed inode, and the inodes whose attributes changed, only
   those the kernel may know.

A *path restore* (``paths``) is a restore to a tree made for it: the clean current tree
with each path's entry replaced by the source Ref's (or removed where the source has none),
``path_target``. It rewrites only the trees on the way down to each path (O(depth)), so the
diff, the plan and the invalidation that follow cost what differs under the paths, never a
walk of the whole tree; everything else keeps its tree ids, so the swap leaves it alone
(same inode numbers, nothing invalidated).

Crash windows: before the reset commit the upper still records the old base (with the
pre-restore checkpoint already made, the same content); after it, the target.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from store.diff import Change, diff_trees
from store.errors import IntegrityError, ObjectNotFoundError, RefNotFoundError
from store.objects import Store
from store.ref import ObjectId, Ref
from store.tree import NAME_MAX, Entry, Kind

from .checkpoint import Graft, Kept, Rebase, _set_pin, graft_apply, kept_rows, number, switch_lower
from .inodes import ROOT_INO, Node, content_digest, derive_ino, origin_key
from .overlay import Overlay
from .session.errors import RestoreError


@dataclass
class Invalidation:
    """Kernel caches to drop after a swap: ``entries`` (directory inode, name),
    ``deleted`` (directory inode, name, the detached inode it named: the kernel also drops
    that inode's link count and marks a directory dead, as rmdir(2) does, so nothing new is
    looked up or cached inside it and the inode is forgotten once its last user is gone;
    a parent before its children, so they are dropped in reverse), ``inodes`` (numbers
    whose attributes changed) and ``listings`` (directories whose entries changed: their
    attributes and the kernel's cached listing)."""

    entries: list[tuple[int, bytes]] = field(default_factory=list)
    inodes: list[int] = field(default_factory=list)
    deleted: list[tuple[int, bytes, int]] = field(default_factory=list)
    listings: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.entries) + len(self.inodes) + len(self.deleted) + len(self.listings)


@dataclass
class SwapPlan:
    """What ``apply_swap`` does; ``rebase`` holds the upper's new base, rows and pins."""

    target: Ref
    rebase: Rebase
    detach: list[int] = field(default_factory=list)
    meta: list[tuple[int, Entry]] = field(default_factory=list)
    dirs: list[tuple[int, ObjectId]] = field(default_factory=list)
    invalidation: Invalidation = field(default_factory=Invalidation)
    origins: dict[int, bytes] = field(default_factory=dict)  # kept inodes' new identity
    changes: int = 0
    old: str = ""  # Ref text of the lower being replaced (what detached files read)


def verify(store: Store, current: Ref, target: Ref) -> list[Change]:
    """The changes from ``current`` to ``target``, after checking that everything of the
    target that differs is in the store. Raises RestoreError(swap_failed) otherwise."""
    store.root_tree(target)  # RefNotFoundError (exit 4): nothing to restore to
    try:
        changes = diff_trees(store, current.tree_id, target.tree_id)
    except (ObjectNotFoundError, IntegrityError) as e:
        raise RestoreError(RestoreError.SWAP_FAILED, str(target),
                           f"the target is not complete in the store: {e}") from None
    for c in changes:
        new = c.new
        if new is not None and new.kind is Kind.FILE:
            for cid in new.chunks.distinct():
                if not store.has(cid):
                    raise RestoreError(RestoreError.SWAP_FAILED, str(target),
                                       f"chunk {cid.hex()} of {c.path!r} is not in the store")
    return changes


def content_changed(a: Entry, b: Entry) -> bool:
    """True if an inode cannot carry over from ``a`` to ``b``: kind or content differ
    (directories: never; their entries are their own paths)."""
    if a.kind is not b.kind:
        return True
    if a.kind is Kind.DIR:
        return False
    return content_digest(a) != content_digest(b)


def _split(path: bytes) -> tuple[bytes, bytes]:
    head, _, name = path.rpartition(b"/")
    return head, name


def _ancestors(path: bytes) -> list[bytes]:
    """``b""`` and every proper prefix directory of ``path``, shallowest first."""
    out = [b""]
    parts = path.split(b"/")[:-1]
    for i in range(1, len(parts) + 1):
        out.append(b"/".join(parts[:i]))
    return out


class _Trees:
    """Directory lookups by path in one snapshot (memoized)."""

    def __init__(self, store: Store, root: ObjectId) -> None:
        self.store = store
        self.ids: dict[bytes, ObjectId] = {b"": root}

    def entry(self, path: bytes) -> Entry | None:
        head, name = _split(path)
        tid = self.tree_id(head)
        return None if tid is None else self.store.get_tree(tid).get(name)

    def tree_id(self, path: bytes) -> ObjectId | None:
        tid = self.ids.get(path)
        if tid is None and path:
            e = self.entry(path)
            if e is None or e.kind is not Kind.DIR or e.tree_id is None:
                return None
            tid = self.ids[path] = e.tree_id
        return tid


def writers(ov: Overlay, seen: Iterable[int] = ()) -> set[int]:
    """Numbers of the linked files open for writing (they are detached by a restore): those
    with a writable handle, and the inode numbers in ``seen`` (no-open mode: the files
    ``fusefs.writers.scan`` found open for writing, since open(2) then never reaches the
    daemon). This is the one part of detaching that needs to know writers, to tell a
    writer of an unchanged path (detached) from a reader (which keeps its inode); paths
    that change, removed directories and held lowers follow inodes and lookup counts."""
    out = {h.node.ino for h in ov.handles.values()
           if h.writable and h.node.nlink > 0 and h.node.kind is Kind.FILE}
    for ino in seen:
        n = ov.nodes.get(ino)
        if n is not None and n.nlink > 0 and n.kind is Kind.FILE:
            out.add(ino)
    return out


def _paths(ov: Overlay, n: Node, old: _Trees) -> list[bytes]:
    """The paths of clean node ``n`` in the lower, found through the origins of its
    ancestors in memory (the kernel holds every ancestor of what it holds); a hard-link
    group, or an ancestor not in memory, costs a walk of the lower's trees."""
    o = n.origin
    if o is None:
        return []
    if o[:1] == b"p":
        parts = [o[42:]]
        d = int.from_bytes(o[1:9], "little")
        while d != ROOT_INO:
            dn = ov.nodes.get(d)
            if dn is None or dn.origin is None or dn.origin[:1] != b"p":
                break
            parts.append(dn.origin[42:])
            d = int.from_bytes(dn.origin[1:9], "little")
        else:
            return [b"/".join(reversed(parts))]
    out = []
    todo: list[tuple[bytes, int, ObjectId]] = [(b"", ROOT_INO, ov.lower.root_tree)]
    while todo:
        path, dino, tid = todo.pop()
        for e in old.store.get_tree(tid).entries:
            p = path + b"/" + e.name if path else e.name
            if e.kind is Kind.DIR and e.tree_id is not None:
                todo.append((p, number(ov, dino, e.name, e)[0], e.tree_id))
            elif origin_key(dino, e.name, e) == o:
                out.append(p)
    return out


def plan_swap(ov: Overlay, changes: list[Change], target: Ref, rb: Rebase,
              uppers: list[Node] | None = None,
              writing: set[int] | None = None) -> SwapPlan:
    """Plan the swap of clean overlay ``ov`` to ``target`` (event-loop thread). Changes
    only ``ov.pins``/``pinned``/``next_ino`` (new numbers must be reserved before commit).

    ``uppers``: the nodes that had an upper row before the overlay was cleaned, if known
    (saves a pass over every node). ``writing``: numbers of files open for writing (see
    ``writers``), detached whatever the target holds at their paths. Two passes: first every
    path present on both sides (an inode kept, maybe under a new identity when only its
    hard-link group changed) and every removal, then the paths that need a number (added,
    content changed, or held by a writer), so an added name of a hard-link group joins the
    inode its other names keep."""
    store = ov.lower.store
    old = _Trees(store, ov.lower.root_tree)
    new = _Trees(store, target.tree_id)
    writing = writing or set()
    sp = SwapPlan(target, rb, changes=len(changes), old=str(ov.lower.ref))
    dir_ino: dict[bytes, int] = {b"": ROOT_INO}
    covered: set[bytes] = set()
    refresh: set[bytes] = set()
    inv = sp.invalidation
    origins: dict[int, bytes | None] = {}  # planned origin of nodes kept or detached
    owner: dict[bytes, int] = {}  # new origin -> the number it resolves to
    numbered: list[tuple[int, bytes, Entry, int | None]] = []  # for the second pass
    gone: list[tuple[int, bytes, int]] = []  # (directory, name, the number it named)

    def ino_of_dir(path: bytes) -> int:
        got = dir_ino.get(path)
        if got is None:
            head, name = _split(path)
            e = old.entry(path)
            assert e is not None and e.kind is Kind.DIR, path
            got = dir_ino[path] = number(ov, ino_of_dir(head), name, e)[0]
        return got

    def detach(no: int) -> None:
        if no not in sp.detach and origins.get(no) is None:
            sp.detach.append(no)
            origins[no] = None

    for c in changes:
        anc = _ancestors(c.path)
        if any(a in covered for a in anc[1:]):
            continue  # below an added, removed or replaced directory
        refresh.update(anc)
        head, name = _split(c.path)
        parent = ino_of_dir(head)
        a, b = c.old, c.new
        if (writing and a is not None and b is not None and a.kind is not Kind.DIR
                and not content_changed(a, b)
                and (w := number(ov, parent, name, a, origins)[0]) in writing):
            detach(w)  # a writer's file: the target's gets a new number
            numbered.append((parent, name, b, w))
            gone.append((parent, name, w))
            continue
        if a is not None and b is not None and not content_changed(a, b):
            no = number(ov, parent, name, a, origins)[0]
            oa, ob = origin_key(parent, name, a), origin_key(parent, name, b)
            if a.kind is Kind.DIR:
                dir_ino[c.path] = no
            if oa == ob:
                sp.meta.append((no, b))
                inv.inodes.append(no)
                continue
            # Same content, new hard-link group: the inode stays under its new identity,
            # unless that identity is already another inode's (groups merged) or the
            # inode already took another identity (a group split).
            if ob not in owner and not origins.get(no):
                owner[ob] = no
                origins[no] = ob
                sp.meta.append((no, b))
                inv.inodes.append(no)
                # Pin unless a fresh lookup of ``ob`` (once the kernel forgot the inode)
                # gives ``no`` anyway; a pin of ``no`` for the old identity would not
                # let it, and goes with the new pin.
                if ob in ov.pins:
                    keeps = ov.pins[ob][0] == no
                else:
                    keeps = derive_ino(ob) == no and ov.pinned.get(no, ob) == ob
                if not keeps:
                    _set_pin(ov, rb, ob, no, ov.nodes[no].ctime_ns if no in ov.nodes
                             else b.mtime_ns)
                continue
            if ob in owner and not origins.get(no):
                detach(no)
            numbered.append((parent, name, b, None))
            gone.append((parent, name, no))
            continue
        old_no = None
        if a is not None:
            old_no = number(ov, parent, name, a, origins)[0]
            detach(old_no)
            if a.kind is Kind.DIR:
                covered.add(c.path)
        if b is not None:
            if b.kind is Kind.DIR:
                covered.add(c.path)
            numbered.append((parent, name, b, old_no))
        if old_no is None:
            inv.entries.append((parent, name))
        else:
            gone.append((parent, name, old_no))

    changed = {c.path for c in changes}
    for w in sorted(writing):
        if w in sp.detach or (wn := ov.nodes.get(w)) is None:
            continue
        for path in _paths(ov, wn, old):
            if path in changed or any(a in covered for a in _ancestors(path)[1:]):
                continue  # planned above, or below a directory that goes
            b = new.entry(path)
            if b is None:
                continue
            head, name = _split(path)
            numbered.append((ino_of_dir(head), name, b, w))
            gone.append((dir_ino[head], name, w))
        detach(w)

    for parent, name, b, old_no in numbered:
        o = origin_key(parent, name, b)
        if o in owner:
            continue  # another name of the same inode already has its number
        for stale in _unlinked(ov, o):
            detach(stale)  # an unlinked inode the kernel still holds must not come back
        new_no, ctime = number(ov, parent, name, b, origins)
        if new_no == old_no or (new_no in ov.nodes and origins.get(new_no, b"") is None):
            new_no = ov.next_ino  # the path's content changed: never the old number
            ov.next_ino += 1
            ctime = b.mtime_ns
        owner[o] = new_no
        # Pin the number unless a fresh lookup would give it anyway, so it stays the
        # same once detached inodes that shifted it are gone.
        pin = ov.pins.get(o)
        natural = pin[0] if pin is not None else derive_ino(o)
        if natural != new_no:
            _set_pin(ov, rb, o, new_no, ctime)

    for path in sorted(refresh):
        tid = new.tree_id(path)
        if tid is None or path in covered or any(a in covered for a in _ancestors(path)[1:]):
            continue
        no = ino_of_dir(path)
        sp.dirs.append((no, tid))
        inv.listings.append(no)
    detached = set(sp.detach)
    for parent, name, no in gone:
        if no in detached:
            inv.deleted.append((parent, name, no))
        else:
            inv.entries.append((parent, name))
    sp.origins = {i: o for i, o in origins.items() if o is not None}
    rb.ref = target
    kept_rows(ov, rb, target.tree_id, uppers)
    if sp.detach:  # what is detached may read the old lower: pinned with the swap
        rb.held = sorted(set(rb.held) | {sp.old})
    return sp


def _unlinked(ov: Overlay, o: bytes) -> list[int]:
    """Numbers of inodes in memory with identity ``o`` but no name left (unlinked, still
    looked up or open), which a lookup of ``o`` would otherwise find again."""
    out = []
    pin = ov.pins.get(o)
    cands = [pin[0]] if pin is not None else []
    salt = 0
    while True:
        ino = derive_ino(o, salt)
        if ino not in ov.nodes:
            break
        cands.append(ino)
        salt += 1
    for ino in cands:
        n = ov.nodes.get(ino)
        if n is not None and n.origin == o and n.nlink == 0 and n.ino != ROOT_INO:
            out.append(ino)
    return out


def _detach(ov: Overlay, n: Node, children: dict[int, list[Node]],
            inv: Invalidation) -> None:
    """No name reaches ``n`` (and, for a directory, its subtree) any more; open handles keep
    what they read. Dropped from memory once the kernel forgets it. The names inside a
    detached directory that the kernel may hold go to ``inv``: a process whose cwd it is
    then looks them up again, and finds nothing."""
    stack = [n]
    while stack:
        x = stack.pop()
        if x.ino == ROOT_INO:
            continue
        if x.kind is Kind.DIR:
            # Only what the directory's own entries name: a node's ``parent`` may be a
            # directory it was first found in, not where it is now (moved, hard-linked).
            for c in children.get(x.ino, ()):
                o = c.origin
                if o is not None and o[:1] == b"p" and int.from_bytes(o[1:9], "little") == x.ino:
                    stack.append(c)
                    if c.nlookup > 0 and x.nlookup > 0:
                        inv.deleted.append((x.ino, o[42:], c.ino))
        ov.detach(x)


def apply_swap(ov: Overlay, sp: SwapPlan) -> None:
    """Switch clean ``ov`` to the planned target in memory (event-loop thread, atomic, after
    ``reset_upper`` committed)."""
    readers = ov.readers_of_lower()  # detached earlier, reading the old lower
    switch_lower(ov, sp.target)
    nodes = ov.nodes
    children: dict[int, list[Node]] = defaultdict(list)
    if any((d := nodes.get(i)) is not None and d.kind is Kind.DIR for i in sp.detach):
        for n in nodes.values():  # only when a directory goes: its subtree goes too
            if n.ino != ROOT_INO:
                children[n.parent].append(n)
    for ino in sp.detach:
        gone = nodes.get(ino)
        if gone is not None:
            _detach(ov, gone, children, sp.invalidation)
    ov.hold(readers + ov.readers_of_lower(), sp.old)
    for ino, e in sp.meta:
        m = nodes.get(ino)
        if m is not None:
            m.mode, m.uid, m.gid, m.mtime_ns = e.mode, e.uid, e.gid, e.mtime_ns
            m.xattrs = dict(e.xattrs)
            if ino in sp.origins:
                m.origin = sp.origins[ino]
                if m.origin[:1] == b"p":  # the directory holding it now (closure walk)
                    m.parent = int.from_bytes(m.origin[1:9], "little")
            if m.kind is not Kind.DIR:
                m.nlink = m.lower_links = (ov.lower.link_count(e.link_group)
                                           if e.link_group is not None else 1)
    for ino, tid in sp.dirs:
        d = nodes.get(ino)
        if d is not None and d.kind is Kind.DIR:
            d.lower_tree = tid
            d.nlink = 2 + ov.lower.subdirs(tid)
            if d.upper:
                d.entries = {}
    root = nodes[ROOT_INO]
    root.lower_tree = sp.target.tree_id
    root.nlink = 2 + ov.lower.subdirs(sp.target.tree_id)
    ov.by_origin = {o: i for o, i in ov.by_origin.items()
                    if (u := nodes.get(i)) is not None and u.upper and u.nlink > 0}
    if sp.rebase.graft is not None:  # the excluded entries kept (``graft_swap``)
        graft_apply(ov, sp.rebase.graft)
        discount_shadowed(ov, sp.rebase.graft)
        ov.recount()
    ov.recharge()  # rows still marked may have changed under their marks
    for h in ov.dirs.values():
        h.refresh()
    for ls in ov.inode_dirs.values():
        ls.refresh()


def _group_names(store: Store, e: Entry, out: Counter[bytes]) -> None:
    """Count into ``out`` the hard-link group members at or below entry ``e``."""
    todo = [e]
    while todo:
        x = todo.pop()
        if x.kind is Kind.DIR:
            if x.tree_id is not None:
                todo.extend(store.get_tree(x.tree_id).entries)
        elif x.link_group is not None:
            out[x.link_group] += 1


def discount_shadowed(ov: Overlay, g: Graft) -> None:
    """After a restore kept excluded entries over names of the target's hard-link groups
    (``Graft.shadowed``): the group's file, seen under its other names, counts only those
    in ``st_nlink`` (as if the shadowed names had been unlinked), in memory and in its
    upper row (written at the next commit; until then a crash shows the target's count).
    Walks the target's tree once, only when a kept entry shadows a group member.
    Event-loop thread, after the swap."""
    if not g.shadowed:
        return
    store = ov.lower.store
    left = dict(g.shadowed)
    todo: list[tuple[bytes, ObjectId]] = [(b"", ov.lower.root_tree)]
    while todo and left:
        path, tid = todo.pop()
        for e in store.get_tree(tid).entries:
            cp = path + b"/" + e.name if path else e.name
            if cp in g.shadow_roots:
                continue
            if e.kind is Kind.DIR:
                if e.tree_id is not None:
                    todo.append((cp, e.tree_id))
                continue
            if e.link_group is None or e.link_group not in left:
                continue
            n = ov.resolve(cp)
            visible = ov.lower.link_count(e.link_group) - left.pop(e.link_group)
            n.nlink = n.lower_links = max(1, visible)
            ov._copy_up(n)


def known_to_kernel(ov: Overlay, inv: Invalidation) -> Invalidation:
    """The part of ``inv`` the kernel can hold: names in directories it has looked up,
    inodes it has looked up (the rest would only answer ENOENT)."""
    nodes = ov.nodes

    def known(ino: int) -> bool:
        n = nodes.get(ino)
        return ino == ROOT_INO or (n is not None and n.nlookup > 0)

    return Invalidation([(p, nm) for p, nm in inv.entries if known(p)],
                        [i for i in inv.inodes if known(i)],
                        [(p, nm, i) for p, nm, i in inv.deleted if known(p)],
                        [i for i in inv.listings if known(i)])


# -- excluded paths --------------------------------------------------------------------------

def keep_target(store: Store, current: Ref, target: Ref, kept: list[Kept]) -> Ref:
    """The tree a restore to ``target`` swaps to when it keeps the ``kept`` (excluded)
    entries: ``target`` itself, unless a directory holding one of them is missing there;
    then ``target`` with those directories added, each with its metadata from ``current``
    (the tree the entry is kept in now) and only what ``target`` holds below it; where
    ``target`` holds a non-directory there, the directory replaces it (a restore leaves
    excluded paths as they are). Writes only the rewritten trees (worker thread)."""
    new = _Trees(store, target.tree_id)
    cur = _Trees(store, current.tree_id)
    missing: list[bytes] = []
    for k in kept:
        for a in _ancestors(k.path)[1:]:
            e = new.entry(a)
            if e is None or e.kind is not Kind.DIR:
                missing.append(a)
    if not missing:
        return target
    with store.writer() as w:
        def rebuild(tid: ObjectId | None, path: bytes) -> ObjectId:
            ents = {e.name: e for e in store.get_tree(tid).entries} if tid else {}
            below = {m.split(b"/")[len(path.split(b"/")) if path else 0] for m in missing
                     if (m.startswith(path + b"/") if path else True) and m != path}
            for name in below:
                cp = path + b"/" + name if path else name
                e = ents.get(name)
                if e is not None and e.kind is not Kind.DIR:
                    e = None  # the kept path's directory wins over the target's file
                holder = e if e is not None else cur.entry(cp)
                if holder is None or holder.kind is not Kind.DIR:
                    continue
                ents[name] = dataclasses.replace(
                    holder, tree_id=rebuild(e.tree_id if e is not None else None, cp),
                    link_group=None)
            return w.put_tree(list(ents.values()))

        root = rebuild(target.tree_id, b"")
        w.commit()
    return Ref(root)


def split_cross(ov: Overlay, freeze: Rebase | None) -> list[tuple[int, bytes]]:
    """Before a restore swaps a clean overlay: a file hard-linked across the boundary
    (frozen under some names, kept under others, ``checkpoint.Graft.cross``) stays the kept
    names' file, as it is; its frozen names leave it and become what the target holds
    there (the link is split, since the target's file at those paths may differ). Returns
    the (directory inode, name) pairs that no longer name it (for the kernel's caches);
    the node's row is rewritten by ``graft_swap``. Event-loop thread."""
    g = freeze.graft if freeze is not None else None
    if g is None or not g.cross:
        return []
    out: list[tuple[int, bytes]] = []
    for ino, names in g.cross_names.items():
        n = ov.nodes.get(ino)
        if n is None or n.nlink == 0:
            continue
        if n.origin is not None and ov.by_origin.get(n.origin) == ino:
            del ov.by_origin[n.origin]
        n.origin = None
        n.nlink = max(1, n.nlink - n.lower_links)
        n.lower_links = 0
        ov._changed(ino)  # written even if the swap then fails: a valid split
        out.extend(names)
    return out


def outside_kept(changes: list[Change], kept: list[Kept]) -> list[Change]:
    """``changes`` without those at or below a kept entry (the live one stays there)."""
    if not kept:
        return changes
    paths = {k.path for k in kept}
    return [c for c in changes
            if c.path not in paths and not any(a in paths for a in _ancestors(c.path))]


def graft_swap(ov: Overlay, sp: SwapPlan, kept: list[Kept], prev: Rebase | None) -> None:
    """Add to ``sp.rebase`` what keeps the ``kept`` entries over the target (as
    ``checkpoint.graft_rows`` does over a checkpoint's tree): the directories holding them
    keep their numbers and show the target's trees and metadata, with the kept entries as
    their only upper dentries; the rows below kept entries stay. ``prev``: the rebase of
    the freeze that cleaned the overlay (its kept rows). A kept entry whose directory the
    target does not hold as a directory is given up (``keep_target`` made every other one
    exist). Event-loop thread; before the reset commits."""
    from .checkpoint import _below_kept, _set_col, rows_now, still_named
    from .overlay import row_of

    rb = sp.rebase
    rb.graft = None
    if not kept:
        return
    rb.full_rows, rb.dentries, rb.keep, rb.keep_dentries = [], [], set(), set()
    store = ov.lower.store
    new = _Trees(store, sp.target.tree_id)
    nodes = ov.nodes
    g = Graft()
    dents: dict[int, dict[bytes, tuple[int, int]]] = {}
    where: dict[int, bytes] = {ROOT_INO: b""}
    held: list[Kept] = []
    for k in kept:
        chain: list[Node] = []
        d: Node | None = k.parent
        while d is not None and d.ino != ROOT_INO:
            chain.append(d)
            d = nodes.get(d.parent)
        prefixes = _ancestors(k.path)[1:]
        if d is None or len(prefixes) != len(chain) or any(
                new.tree_id(a) is None for a in prefixes):
            # keep_target made every directory holding a kept entry exist
            raise RestoreError(RestoreError.SWAP_FAILED, str(sp.target),
                               f"no directory to keep {os.fsdecode(k.path)!r} in")
        for a, dn in zip(prefixes, reversed(chain), strict=True):
            where[dn.ino] = a
        held.append(k)
        under = new.entry(k.path)  # the target's entry the kept one shows over
        if under is not None:
            names: Counter[bytes] = Counter()
            _group_names(store, under, names)
            for grp, c in names.items():
                g.shadowed[grp] = g.shadowed.get(grp, 0) + c
            g.shadow_roots.add(k.path)
        have = (k.parent.entries or {}).get(k.name)
        cookie = have[1] if have is not None and have[0] == k.node.ino else ov._cookie()
        dents.setdefault(k.parent.ino, {})[k.name] = (k.node.ino, cookie)
    if not held:
        return
    for ino, path in where.items():
        d = nodes[ino]
        tid = new.tree_id(path)
        assert tid is not None
        mine = dents.get(ino, {})
        tree = store.get_tree(tid)
        shadowed = sum(1 for name in mine
                       if (e := tree.get(name)) is not None and e.kind is Kind.DIR)
        nlink = 2 + ov.lower.subdirs(tid) - shadowed + sum(
            1 for c, _ck in mine.values() if nodes[c].kind is Kind.DIR)
        row = _set_col(row_of(d), lower_tree=tid, nlink=nlink)
        origin = None
        if ino != ROOT_INO:
            e = new.entry(path)
            assert e is not None
            head, name = _split(path)
            origin = origin_key(nodes[ino].parent, name, e)
            row = _set_col(row, origin=origin, mode=e.mode, uid=e.uid, gid=e.gid,
                           mtime_ns=e.mtime_ns)
            if e.xattrs:
                rb.xattrs[ino] = list(e.xattrs)
            g.attrs[ino] = e
        elif d.xattrs:
            rb.xattrs[ino] = sorted(d.xattrs.items())
        g.dirs[ino] = (tid, origin, nlink, mine)
        rb.full_rows = [r for r in rb.full_rows if r[0] != ino]
        rb.full_rows.append(row)
        rb.dentries.extend((ino, name, c, ck) for name, (c, ck) in mine.items())
    rb.rows = [r for r in rb.rows if r[0] not in where]
    roots = {k.node.ino: k.node for k in held}
    uppers = [n for n in nodes.values() if n.upper]
    rb.keep = _below_kept(ov, held, uppers, set(where)) - set(sp.detach)
    holders = rb.keep | set(roots)
    for ino, n in roots.items():
        g.kept[ino] = n.lower_links if n.kind is Kind.DIR else 0
        if n.kind is not Kind.DIR and n.origin is not None and n.origin[:1] == b"p" and \
                still_named(ov, n, holders):  # a hard link with a name below a kept entry
            g.kept[ino] = n.lower_links
            g.named.add(ino)
        rb.full_rows.append(row_of(n))
        if n.xattrs:
            rb.xattrs[ino] = sorted(n.xattrs.items())
    if prev is not None and prev.graft is not None:
        stale = (prev.graft.cleared | set(prev.graft.cross)) & rb.keep
        for ino in stale:  # (a discard's freeze, or a link split: not yet written)
            rb.full_rows.append(row_of(nodes[ino]))
    rb.keep_dentries = (rb.keep | set(roots)) - set(where)
    rb.drop = rows_now(ov, (prev.was_upper if prev is not None else ()) or ()) \
        - rb.keep - set(roots)
    rb.next_cookie = ov.next_cookie
    rb.graft = g


# -- path restore ----------------------------------------------------------------------------

PATH_MAX = 4096  # bytes of a path, as Linux's PATH_MAX


def normalize_paths(paths: list[str] | list[bytes] | tuple[str | bytes, ...]) -> list[bytes]:
    """The paths of a path restore as ``/``-separated bytes relative to the mount root:
    empty and ``.`` components and a trailing ``/`` dropped, duplicates and paths under
    another one given dropped, sorted. Raises RestoreError(path_escape) for no path, an
    absolute path, a ``..`` component, a NUL byte, the root itself (that is a whole
    restore), a component over NAME_MAX (255) bytes or a path over PATH_MAX (4096)."""
    if not paths:
        raise RestoreError(RestoreError.PATH_ESCAPE, "", "no path given")
    out: set[bytes] = set()
    for raw in paths:
        p = os.fsencode(raw) if isinstance(raw, str) else bytes(raw)
        shown = os.fsdecode(p)
        if p.startswith(b"/"):
            raise RestoreError(RestoreError.PATH_ESCAPE, "",
                               f"{shown!r} is absolute: give it relative to the mount root")
        if b"\0" in p:
            raise RestoreError(RestoreError.PATH_ESCAPE, "", f"{shown!r} holds a NUL byte")
        if len(p) > PATH_MAX:
            raise RestoreError(RestoreError.PATH_ESCAPE, "",
                               f"path of {len(p)} bytes, over {PATH_MAX}")
        parts = [c for c in p.split(b"/") if c and c != b"."]
        if b".." in parts:
            raise RestoreError(RestoreError.PATH_ESCAPE, "", f"{shown!r} has a '..' component")
        if not parts:
            raise RestoreError(RestoreError.PATH_ESCAPE, "",
                               f"{shown!r} is the root: restore without a path instead")
        for c in parts:
            if len(c) > NAME_MAX:
                raise RestoreError(RestoreError.PATH_ESCAPE, "",
                                   f"a component of {shown!r} is over {NAME_MAX} bytes")
        out.add(b"/".join(parts))
    kept: list[bytes] = []
    for p in sorted(out):  # a parent sorts before its children
        if not any(p.startswith(k + b"/") for k in kept):
            kept.append(p)
    return kept


def check_paths(ov: Overlay, source: Ref, paths: list[bytes]) -> None:
    """Refuse a path restore before anything changes: RestoreError(path_not_found) for a
    path that is in neither the live tree nor ``source``, or that ``source`` has under a
    name the live tree holds as something else than a directory (restoring it would
    replace what lies outside the path). ``paths`` as ``normalize_paths`` gives them; costs
    O(depth) lookups per path (event-loop thread: it reads the overlay)."""
    src = _Trees(ov.lower.store, source.tree_id)
    for p in paths:
        live_kind = _live_kind(ov, p)
        in_source = src.entry(p) is not None
        if not in_source and live_kind is None:
            raise RestoreError(RestoreError.PATH_NOT_FOUND, str(source),
                               f"{os.fsdecode(p)!r} is in neither the live tree nor {source}")
        if in_source:
            for a in _ancestors(p)[1:]:
                k = _live_kind(ov, a)
                if k is not None and k is not Kind.DIR:
                    raise RestoreError(
                        RestoreError.PATH_NOT_FOUND, str(source),
                        f"{os.fsdecode(a)!r} is a {k.name.lower()} in the live tree, "
                        f"so {os.fsdecode(p)!r} cannot be restored under it")


def _live_kind(ov: Overlay, path: bytes) -> Kind | None:
    try:
        return ov.resolve(path).kind
    except OSError:  # ENOENT, or ENOTDIR under something that is not a directory
        return None


def path_target(store: Store, base: Ref, source: Ref, paths: list[bytes]) -> Ref:
    """The tree of a path restore: ``base`` with the entry at each of ``paths`` taken from
    ``source`` (removed where ``source`` has none there). Directories on the way down keep
    their own metadata; one missing in ``base`` is made from ``source``'s (with only the
    restored entries in it). Writes only the rewritten trees (O(depth) per path) and
    commits them; returns their root's Ref. ``paths`` as ``normalize_paths`` gives them and
    ``check_paths`` accepted (worker thread: it reads and writes the store)."""
    with store.writer() as w:
        def rebuild(cur: ObjectId | None, src: ObjectId | None,
                    rel: list[list[bytes]]) -> ObjectId:
            ents = {e.name: e for e in store.get_tree(cur).entries} if cur else {}
            stree = store.get_tree(src) if src else None
            below: dict[bytes, list[list[bytes]]] = defaultdict(list)
            for parts in rel:
                below[parts[0]].append(parts[1:])
            for name, rests in below.items():
                se = stree.get(name) if stree is not None else None
                if any(not r for r in rests):  # the path itself
                    if se is None:
                        ents.pop(name, None)
                    else:
                        ents[name] = se
                    continue
                ce = ents.get(name)
                cdir = ce.tree_id if ce is not None and ce.kind is Kind.DIR else None
                sdir = se.tree_id if se is not None and se.kind is Kind.DIR else None
                if cdir is None:
                    if sdir is None or ce is not None:
                        continue  # nothing to restore under it (check_paths refused the rest)
                    holder = se
                else:
                    holder = ce
                assert holder is not None
                ents[name] = dataclasses.replace(holder, tree_id=rebuild(cdir, sdir, rests))
            return w.put_tree(list(ents.values()))

        root = rebuild(base.tree_id, source.tree_id, [p.split(b"/") for p in paths])
        w.commit()
    return Ref(root)


# -- the whole restore, for callers without an event loop ------------------------------------

@dataclass
class Result:
    """What one restore did: the pre-restore checkpoint (None with ``discard``), how many
    paths differed and what was invalidated."""

    target: Ref
    pre: Ref | None
    changes: int
    invalidation: Invalidation


@dataclass
class Cleaned:
    """What ``clean`` left: the checkpoint Ref (None with ``discard``), the rebase whose
    pins the swap must also record, the nodes that had an upper row, the excluded entries
    kept in the upper and the rebase of the freeze that kept them."""

    pre: Ref | None
    rebase: Rebase
    uppers: list[Node]
    kept: list[Kept]
    freeze: Rebase | None


def clean(ov: Overlay, *, discard: bool, label: str | None = None) -> Cleaned:
    """Make every change of ``ov`` part of its lower, but what the exclude patterns keep in
    the upper: a listed ``pre_restore`` checkpoint, or with ``discard`` an unlisted freeze
    applied in memory only (the upper keeps the old base until the swap commits)."""
    from .checkpoint import apply, build, checkpoint_overlay, plan, prepare

    if not discard:
        res = checkpoint_overlay(ov, origin="pre_restore", label=label)
        return Cleaned(res.ref, Rebase(res.ref), res.uppers, res.kept, res.rebase)
    store = ov.lower.store
    with store.writer() as w:
        p = plan(ov)
        ref = build(p, store, w)
        w.commit()
    rb = prepare(ov, p, ref)
    apply(ov, p, rb)
    return Cleaned(None, rb, p.uppers, p.kept, rb)


def swap_kept(ov: Overlay, target: Ref, cleaned: Cleaned) -> tuple[Ref, list[Change]]:
    """The tree a restore of clean ``ov`` to ``target`` swaps to (``keep_target``) and the
    changes the swap makes (outside the kept entries). Worker thread."""
    store = ov.lower.store
    target = keep_target(store, ov.lower.ref, target, cleaned.kept)
    return target, outside_kept(verify(store, ov.lower.ref, target), cleaned.kept)


def restore_overlay(ov: Overlay, target: Ref, *, discard: bool = False) -> Result:
    """Restore ``ov`` to ``target`` synchronously (no mount, no kernel caches): tests and
    tools that drive the overlay directly. Open handles never block it: what they hold is
    detached (see the module docstring). Raises RestoreError(swap_failed) if the target is
    incomplete, changing nothing."""
    from .checkpoint import drop_data, reset_upper

    assert ov.upper is not None
    store = ov.lower.store
    try:
        store.root_tree(target)  # fail before any change if the root is missing
    except RefNotFoundError:
        raise
    except (ObjectNotFoundError, IntegrityError) as e:
        raise RestoreError(RestoreError.SWAP_FAILED, str(target), str(e)) from None
    cl = clean(ov, discard=discard)
    split = split_cross(ov, cl.freeze)
    target, changes = swap_kept(ov, target, cl)
    sp = plan_swap(ov, changes, target, cl.rebase, cl.uppers, writers(ov))
    graft_swap(ov, sp, cl.kept, cl.freeze)
    sp.invalidation.entries.extend(split)
    reset_upper(ov.upper, sp.rebase)
    apply_swap(ov, sp)
    drop_data(cl.rebase.drop_data)
    return Result(target, cl.pre, len(changes), sp.invalidation)
