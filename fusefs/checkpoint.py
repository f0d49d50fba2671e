"""Checkpoint: freeze a live overlay's upper layer into the store and make it the new lower.

Owns the three steps of CONTRACT 3.1 that touch data (the daemon's ``control`` module does
the ordering, pausing and timing around them):

1. ``plan`` (event-loop thread, atomic): walk the overlay from the root into the directories
   that may have changed and nothing else, and copy what must be frozen into plain values: the
   entries of each directory to encode, and for each changed file where its chunks come from.
   Cost grows with the changed inodes and directories, not with the tree.
2. ``build`` (worker thread): hash and store the changed chunks (reusing every lower chunk
   that is still whole), then encode the planned directories bottom-up; every directory not
   planned keeps its tree id, so unchanged subtrees are reused by id. ``Writer.commit`` makes
   it durable with one barrier.
3. ``rebase`` (event-loop thread, atomic) and ``reset_upper`` (worker): the frozen tree
   becomes the lower; every frozen inode keeps its number and ctime through a pin (see
   ``inodes.py``); the upper is emptied in one transaction that also records the new base.

Which directories are walked: every directory with an upper row, and the directories on the
path from the root to every inode with a row (followed through ``Node.parent`` in memory; if a
link of that chain is not in memory the walk visits every directory, which is correct but
costs the whole tree). Hard-link groups: a group's id is the hash of its members' paths
(``store.snapshot.link_group_id``), so a change to one member (a new link, an unlink, a rename,
new content) or the move of a directory holding members changes the id seen by every member.
When that can have happened the walk also enters every subtree holding group members (known
per tree id, computed once and cached) and recomputes every group from the paths found.

Crash windows (``kill -9`` of the daemon; the upper's recorded base tells the state):

| window                                    | after remount                                    |
| ----------------------------------------- | ------------------------------------------------ |
| before the store commit                   | old base + old upper: nothing lost; packs left   |
|                                           | unreferenced (GC removes them)                   |
| store committed, snapshot not yet listed  | old base + old upper (same content as the Ref)   |
| listed, upper not yet reset               | old base + old upper (same content as the Ref)   |
| upper reset committed                     | new base, empty upper; leftover data files are   |
|                                           | removed by ``Upper.recover`` at open             |

A test hook stops the daemon at a named point: ``REWINDFS_CRASH_AT=<point>`` makes
``crash_point(point)`` send SIGKILL to its own process (points are listed in ``POINTS``).
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from store import chunker
from store.objects import Store, Writer
from store.pack import Location
from store.ref import ObjectId, Ref
from store.snapshot import link_group_id
from store.tree import ChunkList, Entry, Kind, Tree, tree_version

from .inodes import ROOT_INO, Node, derive_ino, origin_key
from .overlay import Overlay, held_bytes, row_of
from .upper import ROW_COLUMNS, Upper, _apply

CRASH_ENV = "REWINDFS_CRASH_AT"
POINTS = (
    "checkpoint.committed",   # packs durable and indexed, snapshot not listed
    "checkpoint.listed",      # snapshot listed, upper not reset
    "checkpoint.reset",       # upper reset committed, data files not yet removed
    "restore.paused",         # admission paused, nothing done yet
    "restore.checkpointed",   # pre_restore checkpoint done
    "restore.verified",       # target verified, nothing swapped
    "restore.swapped",        # upper reset to the target committed, journal not appended
    "restore.appended",       # journal appended, kernel caches not yet invalidated
)


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``$REWINDFS_CRASH_AT`` names ``name`` (test hook)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


# -- the plan ------------------------------------------------------------------------------

@dataclass(slots=True)
class FileJob:
    """Where the chunks of one changed file come from (a copy of the node's fields).

    Chunk ``i`` covers bytes ``[i*cs, min((i+1)*cs, size))``: from lower chunk ``i`` for the
    part below ``lower_len`` unless ``i`` is in ``present``, else from the data file (zeros
    where the data file is short or absent)."""

    size: int
    lower_chunks: ChunkList
    lower_len: int
    present: frozenset[int]
    data_path: str | None
    inline: bytes | None = None  # a small file's whole content (``Node.inline``)


@dataclass(slots=True, eq=False)
class DirPlan:
    """One directory to encode: its entries, some still waiting for a child's tree id
    (``subdirs``: entry index -> the child's DirPlan) or for chunks (``files``)."""

    entries: list[Entry]
    ino: int
    subdirs: dict[int, DirPlan] = field(default_factory=dict)
    files: dict[int, FileJob] = field(default_factory=dict)
    tree_id: ObjectId | None = None
    path: bytes = b""


@dataclass(slots=True)
class Kept:
    """An entry the session's exclude patterns match, found in a planned directory: left
    out of the tree and kept in the upper (with everything below it). ``path`` is its
    workspace path, ``parent`` the directory node holding it under ``name``, ``node`` its
    node (made in memory for a lower entry)."""

    path: bytes
    parent: Node
    name: bytes
    node: Node


@dataclass(slots=True)
class Placement:
    """An inode whose entry the checkpoint writes: ``node`` (None for a lower group member
    not in memory; then ``ino``/``ctime_ns`` are its current number and ctime), the
    directory inode ``parent`` and ``name`` holding it, and where its entry is planned."""

    node: Node | None
    ino: int
    ctime_ns: int
    parent: int
    name: bytes
    dirplan: DirPlan
    index: int

    @property
    def entry(self) -> Entry:
        return self.dirplan.entries[self.index]


@dataclass
class Plan:
    """What ``build`` encodes and ``rebase`` applies. ``dirs`` is in post-order (a child
    before its parent; the root last). ``unchanged``: nothing to write, the lower's Ref is
    the checkpoint."""

    base: Ref
    dirs: list[DirPlan] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)
    upper_inos: set[int] = field(default_factory=set)
    uppers: list[Node] = field(default_factory=list)  # nodes with an upper row when planned
    unchanged: bool = False
    full_walk: bool = False
    groups: bool = False
    kept: list[Kept] = field(default_factory=list)  # excluded entries of planned dirs
    # The lower content excluded files kept in the upper still read (one entry per file,
    # named by its inode number): ``build`` stores it as a tree the upper records
    # (``kept_tree``), so GC keeps those chunks once no Ref in the list holds them.
    kept_pins: list[Entry] = field(default_factory=list)
    kept_tree: ObjectId | None = None
    # upper files with names both frozen and kept (hard links across the boundary):
    # node -> (the node, where its first frozen name is planned (DirPlan, entry index,
    # name), the number of its frozen names, the directory holding that name)
    cross: dict[int, tuple[Node, tuple[DirPlan, int, bytes], int, int]] = field(
        default_factory=dict)
    cross_names: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)

    @property
    def root(self) -> DirPlan:
        return self.dirs[-1]


# Tree id -> True if the subtree holds a member of a hard-link group. A pure function of the
# id, so one cache serves every overlay and every snapshot of the process.
_BEARING: dict[bytes, bool] = {}


def bearing(store: Store, tree_id: bytes) -> bool:
    """True if the subtree ``tree_id`` holds a hard-linked file (cached per tree id)."""
    known = _BEARING.get(tree_id)
    if known is not None:
        return known
    # Iterative post-order so deep trees stay off the Python stack.
    stack: list[tuple[bytes, bool]] = [(tree_id, False)]
    while stack:
        tid, expanded = stack.pop()
        if tid in _BEARING:
            continue
        tree = store.get_tree(ObjectId(tid))
        subs = [e.tree_id for e in tree.entries if e.kind is Kind.DIR and e.tree_id is not None]
        if not expanded:
            if any(e.link_group is not None for e in tree.entries):
                _BEARING[tid] = True
                continue
            stack.append((tid, True))
            stack.extend((s, False) for s in subs if s not in _BEARING)
            continue
        _BEARING[tid] = any(_BEARING.get(s, False) for s in subs)
    return _BEARING[tree_id]


def holds_excluded(ov: Overlay, tree_id: bytes, path: bytes) -> bool:
    """True if the lower subtree ``tree_id`` at workspace path ``path`` holds a path the
    overlay's exclude patterns match (``Overlay.excluded``). Cached per (tree id, path) in
    ``ov.excluded_trees``; the first question about a tree costs a walk of it (a session's
    first checkpoint walks its seed once), later ones a lookup."""
    if ov.exclude is None:
        return False
    cache = ov.excluded_trees
    key = (bytes(tree_id), path)
    got = cache.get(key)
    if got is not None:
        return got
    subs_of: dict[tuple[bytes, bytes], list[tuple[bytes, bytes]]] = {}
    stack: list[tuple[bytes, bytes]] = [key]
    while stack:
        k = stack[-1]
        if k in cache:
            stack.pop()
            continue
        subs = subs_of.get(k)
        if subs is None:
            tid, p = k
            subs = []
            hit = False
            for e in ov.lower.tree(ObjectId(tid)).entries:
                cp = p + b"/" + e.name if p else e.name
                is_dir = e.kind is Kind.DIR
                if ov.excluded(cp, is_dir):
                    hit = True
                    break
                if is_dir and e.tree_id is not None:
                    subs.append((bytes(e.tree_id), cp))
            if hit:
                cache[k] = True
                stack.pop()
                continue
            subs_of[k] = subs
            todo = [s for s in subs if s not in cache]
            if todo:
                stack.extend(todo)
                continue
        stack.pop()
        cache[k] = any(cache[s] for s in subs)
    return cache[key]


def entry_of(n: Node, name: bytes) -> Entry:
    """The entry of node ``n`` named ``name``. Complete for symlinks, fifos and sockets; a
    file's chunks and a directory's tree id are filled in by ``build``."""
    xattrs = tuple(sorted(n.xattrs.items()))
    if n.kind is Kind.SYMLINK:
        return Entry(name, n.kind, n.mode, n.uid, n.gid, n.mtime_ns, len(n.target),
                     target=n.target, xattrs=xattrs)
    if n.kind is Kind.FILE:
        return Entry(name, n.kind, n.mode, n.uid, n.gid, n.mtime_ns, n.size, xattrs=xattrs)
    if n.kind is Kind.DIR:
        return Entry(name, n.kind, n.mode, n.uid, n.gid, n.mtime_ns,
                     tree_id=ObjectId(bytes(32)), xattrs=xattrs)
    return Entry(name, n.kind, n.mode, n.uid, n.gid, n.mtime_ns, xattrs=xattrs,
                 rdev=n.rdev if n.kind.is_device else 0)


def _dirty_dirs(ov: Overlay, uppers: list[Node]) -> tuple[set[int] | None, bool]:
    """(inodes of the directories to walk, None meaning all; whether hard-link groups may
    have changed). ``uppers``: the nodes with an upper row."""
    nodes = ov.nodes
    dirty: set[int] = set()
    broken = False
    groups = False
    store = ov.lower.store
    # Inodes named by an upper dentry (created, linked or moved), which only matter for
    # upper directories whose lower tree holds hard-link members: gathered only then.
    named: set[int] = set()
    if any(n.kind is Kind.DIR and n.nlink > 0 and n.lower_tree is not None
           and bearing(store, n.lower_tree) for n in uppers):
        for n in uppers:
            if n.kind is Kind.DIR and n.nlink > 0 and n.entries:
                named.update(ino for ino, _c in n.entries.values() if ino)

    def mark(ino: int) -> None:
        nonlocal broken
        while ino not in dirty:
            dirty.add(ino)
            if ino == ROOT_INO:
                return
            d = nodes.get(ino)
            if d is None or d.kind is not Kind.DIR:
                broken = True
                return
            ino = d.parent

    for n in uppers:
        if n.nlink == 0:
            continue
        if n.kind is Kind.DIR:
            if n.ino == ROOT_INO and not n.entries:
                continue  # only the root's own attributes, which no snapshot records
            mark(n.ino)
            if (n.ino in named and n.lower_tree is not None
                    and bearing(store, n.lower_tree)):
                groups = True  # a moved directory holding hard-link members
            continue
        o = n.origin
        if o is not None and o[:1] == b"g":
            groups = True  # its lower names are found by the group walk
        elif n.nlink > 1:  # any kind but a directory (a fifo, symlink or device too)
            groups = True
        if o is not None and o[:1] == b"p" and n.lower_links > 0:
            mark(int.from_bytes(o[1:9], "little"))
    return (None if broken else dirty), groups


_KEEP = object()


def number(ov: Overlay, parent: int, name: bytes, e: Entry,
           origins: dict[int, bytes | None] | None = None) -> tuple[int, int]:
    """(inode number, ctime) that lower entry ``e`` named ``name`` in directory ``parent``
    has or would get on lookup, without making a node (the rule of ``inodes.py``).
    ``origins`` overrides the origin of nodes in memory (a restore being planned)."""
    o = origin_key(parent, name, e)
    nodes = ov.nodes

    def origin_of(n: Node) -> bytes | None:
        if origins is None:
            return n.origin
        got = origins.get(n.ino, _KEEP)
        return n.origin if got is _KEEP else got  # type: ignore[return-value]

    known = ov.by_origin.get(o)
    if known is not None:
        return known, nodes[known].ctime_ns
    pin = ov.pins.get(o)
    if pin is not None:
        other = nodes.get(pin[0])
        if other is None or origin_of(other) == o:
            return pin
    salt = 0
    while True:
        ino = derive_ino(o, salt)
        other = nodes.get(ino)
        if other is not None:
            if origin_of(other) == o:
                return ino, other.ctime_ns
        elif ov.pinned.get(ino, o) == o:
            return ino, e.mtime_ns
        salt += 1


class _Planner:
    """One walk of ``plan`` (see there)."""

    def __init__(self, ov: Overlay, dirty: set[int] | None, groups: bool) -> None:
        self.ov = ov
        self.store = ov.lower.store
        self.dirty = dirty
        self.groups = groups
        self.plan = Plan(ov.lower.ref, full_walk=dirty is None, groups=groups)
        self.created: list[Node] = []
        # hard-link identity (upper inode number, or lower origin) -> its names:
        # (path, dirplan, entry index, parent inode, name)
        self.members: dict[object, list[tuple[bytes, DirPlan, int, int, bytes]]] = {}
        # identity -> (node in memory or None, inode number, ctime)
        self.member_node: dict[object, tuple[Node | None, int, int]] = {}

    def _want(self, ino: int, e: Entry, path: bytes) -> bool:
        """Should the walk enter the unchanged lower directory ``e`` (inode ``ino``) at
        ``path``? Also when it holds an excluded path, which the tree must lose."""
        if self.dirty is None or ino in self.dirty:
            return True
        if self.groups and e.tree_id is not None and bearing(self.store, e.tree_id):
            return True
        return (self.ov.exclude is not None and e.tree_id is not None
                and holds_excluded(self.ov, e.tree_id, path))

    def _dir_node(self, d: Node, name: bytes, e: Entry) -> Node:
        before = len(self.ov.nodes)
        c = self.ov._lower_node(d, name, e)
        if len(self.ov.nodes) != before:
            self.created.append(c)
        return c

    def _member(self, ident: object, node: tuple[Node | None, int, int], path: bytes,
                dp: DirPlan, idx: int, parent: int, name: bytes) -> None:
        self.members.setdefault(ident, []).append((path, dp, idx, parent, name))
        self.member_node.setdefault(ident, node)

    def _open(self, d: Node, path: bytes) -> tuple[DirPlan, list[tuple[int, Node, bytes]]]:
        """Plan directory ``d`` at ``path``; return its DirPlan and the children to walk."""
        ov = self.ov
        dp = DirPlan([], d.ino, path=path)
        walk: list[tuple[int, Node, bytes]] = []
        excl = ov.exclude is not None
        ents = d.entries or {}
        listing: list[tuple[bytes, Node | None, Entry | None]] = []
        if d.lower_tree is not None:
            listing += [(e.name, None, e) for e in ov.lower.tree(d.lower_tree).entries
                        if e.name not in ents]
        listing += [(name, ov.nodes[ino], None) for name, (ino, _c) in ents.items() if ino]
        for name, n, e in listing:
            cpath = path + b"/" + name if path else name
            idx = len(dp.entries)
            if excl and ov.excluded(cpath, (n.kind if n is not None else e.kind)  # type: ignore[union-attr]
                                    is Kind.DIR):
                if n is None:
                    assert e is not None
                    n = ov._lower_node(d, name, e)  # the graft makes it an upper node
                self.plan.kept.append(Kept(cpath, d, name, n))
                continue
            if n is None:
                assert e is not None
                o = origin_key(d.ino, name, e)
                up = ov.by_origin.get(o)
                if up is not None and ov.nodes[up].upper:
                    n = ov.nodes[up]
                else:
                    dp.entries.append(e)
                    if e.kind is Kind.DIR:
                        ino, _ct = number(ov, d.ino, name, e)
                        if self._want(ino, e, cpath):
                            walk.append((idx, self._dir_node(d, name, e), cpath))
                    elif self.groups and e.link_group is not None:
                        ino, ct = number(ov, d.ino, name, e)
                        self._member(o, (ov.nodes.get(ino), ino, ct), cpath, dp, idx, d.ino,
                                     name)
                    continue
            dp.entries.append(entry_of(n, name))
            self.plan.placements.append(Placement(n, n.ino, n.ctime_ns, d.ino, name, dp, idx))
            if n.kind is Kind.DIR:
                walk.append((idx, n, cpath))
                continue
            if n.kind is Kind.FILE:
                upper = ov.upper
                data = upper.data_path(n.ino) if (n.has_data and upper is not None) else None
                dp.files[idx] = FileJob(n.size, n.lower_chunks, n.lower_len,
                                        frozenset(n.present), data,
                                        bytes(n.inline) if n.inline is not None else None)
            if self.groups and n.nlink > 1:  # every kind but a directory can be hard-linked
                self._member(n.ino, (n, n.ino, n.ctime_ns), cpath, dp, idx, d.ino, name)
        return dp, walk

    def run(self) -> Plan:
        p = self.plan
        root = self.ov.nodes[ROOT_INO]
        dp, walk = self._open(root, b"")
        # Iterative post-order: (DirPlan, children to walk, next position).
        stack: list[tuple[DirPlan, list[tuple[int, Node, bytes]], int]] = [(dp, walk, 0)]
        while stack:
            dp, walk, pos = stack[-1]
            if pos < len(walk):
                stack[-1] = (dp, walk, pos + 1)
                idx, c, cpath = walk[pos]
                cdp, cwalk = self._open(c, cpath)
                dp.subdirs[idx] = cdp
                if not c.upper:  # a non-upper directory whose tree changes below it
                    p.placements.append(Placement(c, c.ino, c.ctime_ns, dp.ino,
                                                  dp.entries[idx].name, dp, idx))
                stack.append((cdp, cwalk, 0))
                continue
            stack.pop()
            p.dirs.append(dp)
        if self.groups:
            self._assign_groups()
        chain: set[int] = set()
        for k in p.kept:  # the directories holding kept entries stay: the graft needs them
            d: Node | None = k.parent
            while d is not None and d.ino not in chain and d.ino != ROOT_INO:
                chain.add(d.ino)
                d = self.ov.nodes.get(d.parent)
        for c in self.created:
            if c.ino not in chain:
                self.ov.release_unused(c)
        return p

    def _assign_groups(self) -> None:
        """Give every hard-linked file the id of its group in the new tree, and place the
        lower members whose identity changes with it (they keep their numbers by a pin)."""
        for ident, names in self.members.items():
            gid = link_group_id([n[0] for n in names]) if len(names) > 1 else None
            node, ino, ctime = self.member_node[ident]
            for _path, dp, idx, parent, name in names:
                old = dp.entries[idx]
                dp.entries[idx] = replace(old, link_group=gid)
                if isinstance(ident, bytes) and old.link_group != gid:
                    self.plan.placements.append(
                        Placement(node, ino, ctime, parent, name, dp, idx))
            o = node.origin if node is not None else None
            frozen_names = {(n[3], n[4]) for n in names}
            if (isinstance(ident, int) and node is not None and node.upper
                    and node.nlink > len(names)
                    and (node.lower_links == 0 or (  # its lower names are frozen too
                        o is not None and o[:1] == b"p" and node.lower_links == 1
                        and (int.from_bytes(o[1:9], "little"), o[42:]) in frozen_names)
                        or (o is not None and o[:1] == b"g"
                            and node.lower_links <= len(names)))):
                # Its other names are below excluded paths: it stays in the upper too.
                _p, dp, idx, parent, name = names[0]
                self.plan.cross[node.ino] = (node, (dp, idx, name), len(names), parent)
                self.plan.cross_names[node.ino] = [(n[3], n[4]) for n in names]


def plan(ov: Overlay) -> Plan:
    """Walk ``ov`` and plan the checkpoint (see the module docstring). Must run where no
    request changes the overlay meanwhile (its event-loop thread, mutations paused)."""
    uppers = [n for n in ov.nodes.values() if n.upper]  # the one pass over every node
    dirty, groups = _dirty_dirs(ov, uppers)
    if dirty is not None and not dirty and not groups and not holds_excluded(
            ov, ov.lower.root_tree, b""):
        return Plan(ov.lower.ref, unchanged=True, uppers=uppers)
    p = _Planner(ov, dirty, groups).run()
    p.uppers = uppers
    p.upper_inos = {n.ino for n in uppers}
    if ov.exclude is not None or ov.kept_tree is not None:
        # the kept files reading lower content: the kept entries, and the linked upper
        # nodes the tree does not place (below kept entries); only those are sorted
        placed = {pl.ino for pl in p.placements}
        kept = {k.node.ino: k.node for k in p.kept
                if k.node.kind is Kind.FILE and k.node.lower_len > 0}
        kept.update((n.ino, n) for n in uppers if n.kind is Kind.FILE and n.lower_len > 0
                    and n.nlink > 0 and n.ino not in placed and n.ino != ROOT_INO)
        p.kept_pins = [Entry(str(ino).encode(), Kind.FILE, 0o600, 0, 0, 0, n.lower_len,
                             chunks=n.lower_chunks)
                       for ino, n in sorted(kept.items())]
    return p


def dirty_nodes(ov: Overlay) -> list[Node]:
    """The linked upper nodes (the root aside) whose changes the next checkpoint takes:
    every one without exclude patterns; with them, none at or below an excluded path and
    no directory whose row only holds excluded entries (unchanged since the last
    checkpoint otherwise). Event-loop thread; with exclude patterns it costs a ``plan``."""
    uppers = [n for n in ov.nodes.values() if n.upper and n.ino != ROOT_INO and n.nlink > 0]
    if ov.exclude is None:
        return uppers
    p = plan(ov)
    if p.unchanged:
        return uppers
    kept_in: dict[int, set[bytes]] = {}
    for k in p.kept:
        kept_in.setdefault(k.parent.ino, set()).add(k.name)
    placed = {pl.ino for pl in p.placements}
    out = []
    for n in uppers:
        if n.ino not in placed:
            continue  # reached only through an excluded entry
        if n.kind is Kind.DIR and set(n.entries or ()) <= kept_in.get(n.ino, set()) and \
                all(v[0] for v in (n.entries or {}).values()):
            o = n.origin
            holder = ov.nodes.get(int.from_bytes(o[1:9], "little")) if o else None
            le = ov._lower_entry(holder, o[42:]) if holder is not None and o else None
            if le is not None and le.kind is Kind.DIR and (
                    le.mode, le.uid, le.gid, le.mtime_ns, le.xattrs) == (
                    n.mode, n.uid, n.gid, n.mtime_ns, tuple(sorted(n.xattrs.items()))):
                continue  # kept only to hold excluded entries
        out.append(n)
    return out


# -- build (worker thread) ------------------------------------------------------------------

def _pread(fd: int | None, off: int, size: int) -> bytes:
    if fd is None or size <= 0:
        return bytes(max(size, 0))
    data = os.pread(fd, size, off)
    return data + bytes(size - len(data)) if len(data) < size else data


class Sink(Protocol):
    """Where ``build`` puts chunks and trees: a ``store.objects.Writer`` or a
    ``MemoryWriter``."""

    def put_chunk(self, data: bytes) -> ObjectId: ...

    def put_tree(self, entries: list[Entry] | tuple[Entry, ...]) -> ObjectId: ...


def _next_data(fd: int, off: int) -> int | None:
    """Offset of the first data at or after ``off`` in ``fd`` (SEEK_DATA), None if only a
    hole remains; without SEEK_DATA support, ``off`` (everything counts as data)."""
    try:
        return os.lseek(fd, off, os.SEEK_DATA)
    except OSError as e:
        return None if e.errno == errno.ENXIO else off


def _hole_at(fd: int, off: int, size: int) -> int:
    """Offset of the first hole at or after ``off`` (SEEK_HOLE; ``size`` if none)."""
    try:
        return min(os.lseek(fd, off, os.SEEK_HOLE), size)
    except OSError:
        return size


class _Runs:
    """Builds a file's ``ChunkList`` run by run; holes get the zero chunk of their length,
    put into the sink once per length."""

    def __init__(self, w: Sink, size: int, cs: int) -> None:
        self.w = w
        self.size = size
        self.cs = cs
        self.slots = -(-size // cs)
        self.runs: list[tuple[bytes, int]] = []
        self._zero: dict[int, ObjectId] = {}

    def add(self, cid: bytes, k: int = 1) -> None:
        if k > 0:
            self.runs.append((cid, k))

    def length(self, i: int) -> int:
        return min(self.cs, self.size - i * self.cs)

    def holes(self, a: int, b: int) -> None:
        """Slots ``[a, b)`` are holes."""
        b = min(b, self.slots)
        if a >= b:
            return
        last = self.slots - 1
        full_end = b if b - 1 < last or self.length(last) == self.cs else b - 1
        self.add(self.zero(self.cs), full_end - a)
        if full_end < b:
            self.add(self.zero(self.length(last)))

    def zero(self, ln: int) -> ObjectId:
        z = self._zero.get(ln)
        if z is None:
            z = self._zero[ln] = self.w.put_chunk(chunker.zeros(ln))
        return z


def _lower_slots(job: FileJob, cs: int) -> tuple[int, int, int]:
    """``(lower_len, lower_slots, whole)`` of a changed file: the length of its lower part
    still in the file, the slots that part touches and those it fills wholly (the slots
    between, at most one, are read from the lower and merged: ``lower_slot``)."""
    lower_len = min(job.lower_len, job.size)
    slots = -(-job.size // cs)
    lower_slots = min(-(-lower_len // cs), len(job.lower_chunks), slots)
    return lower_len, lower_slots, min(lower_len // cs, lower_slots)


def lower_reads(p: Plan, cs: int) -> list[bytes]:
    """The lower chunk ids ``file_chunks`` will look at for the files of ``p`` (the slot
    where a file's lower content ends inside), to be located in one query beforehand."""
    out: list[bytes] = []
    for dp in p.dirs:
        for job in dp.files.values():
            if job.inline is not None:
                continue
            _, lower_slots, whole = _lower_slots(job, cs)
            out.extend(job.lower_chunks[i] for i in range(whole, lower_slots)
                       if i not in job.present)
    return out


def file_chunks(job: FileJob, store: Store, w: Sink,
                locs: dict[bytes, Location] | None = None) -> ChunkList:
    """The chunk ids of a changed file; chunks that differ from lower are read, hashed and
    put into ``w``. A lower chunk still whole is reused without being read, and the holes
    of the data file are found with SEEK_DATA/SEEK_HOLE, never read: the cost follows the
    lower list's runs, the chunks copied up and the data written, not the file's size.
    ``locs``: where lower chunks are stored, as far as known (``lower_reads``)."""
    cs = store.chunk_size
    locs = locs or {}
    out = _Runs(w, job.size, cs)
    if job.inline is not None:
        for i in range(min(out.slots, -(-len(job.inline) // cs))):
            lo = i * cs
            ln = out.length(i)
            data = job.inline[lo:lo + ln]
            out.add(w.put_chunk(data + bytes(ln - len(data))))
        out.holes(len(out.runs), out.slots)
        return ChunkList.from_runs(out.runs)
    fd = None
    if job.data_path is not None:
        try:
            fd = os.open(job.data_path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None
    try:
        lower = job.lower_chunks
        lower_len, lower_slots, whole = _lower_slots(job, cs)

        def upper_slot(i: int) -> None:
            lo = i * cs
            ln = out.length(i)
            if fd is None or (nxt := _next_data(fd, lo)) is None or nxt >= lo + ln:
                out.holes(i, i + 1)
            else:
                out.add(w.put_chunk(_pread(fd, lo, ln)))

        def lower_slot(i: int) -> None:
            """Slot ``i`` not copied up, whose lower part ends inside it (or is short)."""
            lo = i * cs
            hi = lo + out.length(i)
            cid = lower[i]
            loc = locs.get(cid) or store.locate(cid)
            if hi <= lower_len and loc.raw_length == hi - lo:
                out.add(cid)
                return
            lend = min(hi, lower_len)
            data = store.read_object(cid, loc)[:lend - lo]
            if len(data) < lend - lo:
                data += bytes(lend - lo - len(data))
            if lend < hi:
                data += _pread(fd, lend, hi - lend)
            out.add(w.put_chunk(data))

        # 1. Whole lower slots: lower runs, except the chunks copied up.
        pos = 0
        for i in sorted(p for p in job.present if p < whole):
            for cid, k in lower.between(pos, i):
                out.add(cid, k)
            upper_slot(i)
            pos = i + 1
        for cid, k in lower.between(pos, whole):
            out.add(cid, k)
        for i in range(whole, lower_slots):
            # 2. The slot where the lower content ends inside (at most one).
            if i in job.present:
                upper_slot(i)
            else:
                lower_slot(i)
        # 3. Beyond the lower content: the data file, extent by extent.
        i = max(lower_slots, whole)
        while i < out.slots:
            nxt = None if fd is None else _next_data(fd, i * cs)
            if nxt is None or nxt >= job.size:
                out.holes(i, out.slots)
                break
            j = nxt // cs
            out.holes(i, j)
            end = -(-_hole_at(fd, nxt, job.size) // cs) if fd is not None else out.slots
            for k in range(j, min(max(end, j + 1), out.slots)):
                out.add(w.put_chunk(_pread(fd, k * cs, out.length(k))))
            i = max(end, j + 1)
        return ChunkList.from_runs(out.runs)
    finally:
        if fd is not None:
            os.close(fd)


def _remember_tree(store: Store, tree_id: ObjectId, entries: list[Entry]) -> None:
    """Put a tree just encoded into the store's decoded-tree cache: the next checkpoint
    and the overlay read exactly these directories again (saves decoding them)."""
    cache = getattr(store, "_trees", None)
    lock = getattr(store, "_cache_lock", None)
    if cache is None or lock is None:
        return
    tree = Tree(tuple(sorted(entries, key=lambda e: e.name)), tree_version(entries))
    with lock:
        if tree_id not in cache:
            cache[tree_id] = tree


def build(p: Plan, store: Store, w: Sink) -> Ref:
    """Store the planned chunks and trees through ``w`` (not committed) and return the Ref.
    Safe in a worker thread: reads only the plan, the data files and the store."""
    if p.unchanged:
        return p.base
    if p.kept_pins:
        p.kept_tree = w.put_tree(p.kept_pins)
    reads = lower_reads(p, store.chunk_size)
    locs = store.locate_many(ObjectId(c) for c in reads) if len(reads) > 1 else {}
    for dp in p.dirs:
        ents = dp.entries
        for idx, job in dp.files.items():
            ents[idx] = replace(ents[idx], chunks=file_chunks(job, store, w, locs))
        for idx, child in dp.subdirs.items():
            assert child.tree_id is not None
            ents[idx] = replace(ents[idx], tree_id=child.tree_id)
        dp.tree_id = w.put_tree(ents)
        _remember_tree(store, dp.tree_id, ents)
    assert p.root.tree_id is not None
    return Ref(p.root.tree_id)


def freeze(ov: Overlay, store: Store, w: Writer) -> tuple[Plan, Ref]:
    """``plan`` and ``build`` in one call (for callers without an event loop)."""
    p = plan(ov)
    return p, build(p, store, w)


# -- rebase: the frozen tree becomes the lower ------------------------------------------------

@dataclass
class Rebase:
    """The new lower and what the upper keeps: rows of orphans (unlinked, still open) and of
    the root (whose own attributes are in no snapshot), their xattrs, and the pin changes."""

    ref: Ref
    rows: list[tuple[object, ...]] = field(default_factory=list)
    xattrs: dict[int, list[tuple[bytes, bytes]]] = field(default_factory=dict)
    pins: dict[bytes, tuple[int, int]] = field(default_factory=dict)  # origin -> (ino, ctime)
    pins_gone: list[bytes] = field(default_factory=list)
    drop_data: list[str] = field(default_factory=list)  # data files to remove after commit
    next_ino: int = 2
    next_cookie: int = 1
    held: list[str] = field(default_factory=list)  # lowers detached files read (Ref texts)
    # What the upper keeps for excluded paths (``graft``): rows left as they are in the
    # database (below kept entries), full rows written (``upper.ROW_COLUMNS``: the kept
    # entries and the directories holding them), and the dentries of those directories.
    keep: set[int] = field(default_factory=set)
    keep_dentries: set[int] = field(default_factory=set)  # directories whose dentries stay
    # with kept entries, the rows the reset deletes (every other row stays): O(changes)
    drop: set[int] = field(default_factory=set)
    was_upper: set[int] = field(default_factory=set)  # inodes with a row before the plan
    full_rows: list[tuple[object, ...]] = field(default_factory=list)
    dentries: list[tuple[int, bytes, int, int]] = field(default_factory=list)
    graft: Graft | None = None
    kept_tree: str | None = None  # the ``kept_tree`` meta to record (None: leave it)
    # ``exclude_clean`` meta to record: this Ref holds no path the patterns match, so a
    # remount need not walk it again (``Overlay.excluded_trees``)
    exclude_clean: str | None = None
    clean_ref: Ref | None = None  # the Ref it is about (a restore's rebase is another)


@dataclass
class Graft:
    """The in-memory side of keeping excluded entries (``graft_rows`` computes it with the
    rows; ``graft_apply`` applies it after the commit). ``dirs``: directory inode -> (its
    new lower tree, its new lower identity or None for the root, its nlink, its upper
    dentries: only the kept entries); ``kept``: kept node -> its new ``lower_links``;
    ``cleared``: kept nodes whose lower identity no longer names anything; ``named``:
    kept entries that keep their lower identity (a hard link whose other name shows
    through a directory below another kept entry)."""

    dirs: dict[int, tuple[ObjectId | None, bytes | None, int,
                          dict[bytes, tuple[int, int]]]] = field(default_factory=dict)
    kept: dict[int, int] = field(default_factory=dict)
    cross: dict[int, bytes] = field(default_factory=dict)
    # their frozen names: (directory inode, name) each
    cross_names: dict[int, list[tuple[int, bytes]]] = field(default_factory=dict)
    cleared: set[int] = field(default_factory=set)
    nlink: dict[int, int] = field(default_factory=dict)  # kept lower files' new nlink
    attrs: dict[int, Entry] = field(default_factory=dict)  # directories' new metadata
    named: set[int] = field(default_factory=set)
    # a restore's: hard-link group -> its names in the target at or below kept entries
    # (the live entry shows there instead), and the paths of those kept entries
    shadowed: dict[bytes, int] = field(default_factory=dict)
    shadow_roots: set[bytes] = field(default_factory=set)


def _set_col(row: tuple[object, ...], **cols: object) -> tuple[object, ...]:
    out = list(row)
    for k, v in cols.items():
        out[ROW_COLUMNS.index(k)] = v
    return tuple(out)


def _below_kept(ov: Overlay, kept: list[Kept], uppers: Iterable[Node],
                frozen: set[int]) -> set[int]:
    """Inodes with an upper row below the kept entries: linked, not frozen by the plan (so
    reached only through a kept entry), not the root and not a kept entry itself."""
    roots = {k.node.ino for k in kept}
    return {n.ino for n in uppers
            if n.nlink > 0 and n.ino != ROOT_INO and n.ino not in frozen
            and n.ino not in roots and ov.nodes.get(n.ino) is n}


def graft_rows(ov: Overlay, rb: Rebase, kept: list[Kept], tree_of: dict[int, ObjectId],
               origin_of: dict[int, bytes], uppers: Iterable[Node], frozen: set[int],
               cross: dict[int, tuple[Node, tuple[DirPlan, int, bytes], int, int]]
               | None = None) -> None:
    """Fill ``rb`` with what keeps the ``kept`` entries in the upper over the new lower
    (CONTRACT amendment "0, 3.1 policies"): every directory on the way from the root to a
    kept entry keeps (or gets) a row showing its new lower tree (``tree_of``: directory
    inode -> tree id; ``origin_of``: its new lower identity), whose upper dentries are the
    kept entries alone; each kept entry gets a row of its own with no lower identity; the
    rows below kept entries stay as they are (``rb.keep``). ``frozen``: inodes whose upper
    rows go (their content is in the new lower). ``cross``: files with names on both
    sides (``Plan.cross``). Changes only ``ov.next_cookie`` (cookies of kept entries that
    had none)."""
    cross = cross or {}
    if not kept and not cross:
        return
    nodes = ov.nodes
    g = Graft()
    chain: dict[int, Node] = {}

    def up(d: Node) -> None:
        while d.ino not in chain:
            chain[d.ino] = d
            if d.ino == ROOT_INO:
                return
            d = nodes[d.parent]

    dents: dict[int, dict[bytes, tuple[int, int]]] = {}
    for k in kept:
        up(k.parent)
        have = (k.parent.entries or {}).get(k.name)
        cookie = have[1] if have is not None and have[0] == k.node.ino else ov._cookie()
        dents.setdefault(k.parent.ino, {})[k.name] = (k.node.ino, cookie)
    for _n, _o, _m, holder in cross.values():
        up(nodes[holder])
    for ino, d in chain.items():
        tid = tree_of[ino]
        mine = dents.get(ino, {})
        nlink = 2 + ov.lower.subdirs(tid) + sum(
            1 for c, _ck in mine.values() if nodes[c].kind is Kind.DIR)
        origin = None if ino == ROOT_INO else origin_of[ino]
        g.dirs[ino] = (tid, origin, nlink, mine)
        rb.full_rows.append(_set_col(row_of(d), lower_tree=tid, origin=origin, nlink=nlink,
                                     parent=d.parent))
        if d.xattrs:
            rb.xattrs[ino] = sorted(d.xattrs.items())
        rb.dentries.extend((ino, name, c, ck) for name, (c, ck) in mine.items())
    roots: dict[int, Node] = {k.node.ino: k.node for k in kept}
    for ino, (n, (dp, idx, name), m, holder) in cross.items():
        co = origin_key(holder, name, dp.entries[idx])  # built: its chunks are known
        g.cross[ino] = co
        g.kept[ino] = m
        rb.full_rows.append(_set_col(row_of(n), origin=co, lower_links=m))
        if n.xattrs:
            rb.xattrs[ino] = sorted(n.xattrs.items())
    names = Counter(k.node.ino for k in kept)
    rb.keep = _below_kept(ov, kept, uppers, frozen | set(chain) | set(cross))
    holders = set(rb.keep) | set(roots)
    for ino, n in roots.items():
        if ino in cross:
            continue
        if n.upper and n.origin is not None and n.origin[:1] == b"p" and \
                n.kind is not Kind.DIR and still_named(ov, n, holders):
            g.kept[ino] = n.lower_links
            g.named.add(ino)
            rb.full_rows.append(row_of(n))
            if n.xattrs:
                rb.xattrs[ino] = sorted(n.xattrs.items())
            continue
        g.kept[ino] = 0
        if not n.upper and n.kind is not Kind.DIR:
            g.nlink[ino] = names[ino]  # a lower file: its kept names are its names
        rb.full_rows.append(_set_col(row_of(n), origin=None, lower_links=0,
                                     nlink=g.nlink.get(ino, n.nlink)))
        if n.xattrs:
            rb.xattrs[ino] = sorted(n.xattrs.items())
    # A node below a kept entry keeps its lower identity only while that still names it.
    for ino in rb.keep:
        n = nodes[ino]
        if n.origin is None or ino in cross:
            continue
        if not still_named(ov, n, holders):
            g.cleared.add(ino)
            rb.full_rows.append(_set_col(row_of(n), origin=None,
                                         lower_links=0 if n.kind is not Kind.DIR
                                         else n.lower_links))
    rb.keep -= g.cleared
    rb.keep_dentries = (rb.keep | g.cleared | set(roots)) - set(chain)
    rb.drop = (rows_now(ov) | frozen | set(chain)) - rb.keep - g.cleared - set(roots)
    rb.graft = g


def still_named(ov: Overlay, n: Node, holders: set[int]) -> bool:
    """True if upper node ``n`` keeps its lower identity across a graft: a directory, or
    a file with a lower name (``lower_links``), whose origin's holder is in ``holders``
    (kept, below a kept entry) and shows that name from its lower tree (not moved away
    nor shadowed). A link group's identity (``g``) is not checked: it holds."""
    o = n.origin
    if o is None or not (n.kind is Kind.DIR or n.lower_links > 0):
        return False
    if o[:1] != b"p":
        return True
    h = ov.nodes.get(int.from_bytes(o[1:9], "little"))
    name = o[42:]
    return (h is not None and h.ino in holders and h.lower_tree is not None
            and (h.entries or {}).get(name) is None
            and ov.lower.tree(h.lower_tree).get(name) is not None)


def rows_now(ov: Overlay, also: Iterable[int] = ()) -> set[int]:
    """Inodes that may have a row in the upper's database: the nodes with an upper row in
    memory, those whose row deletion is not written yet, and ``also``."""
    return ({n.ino for n in ov.nodes.values() if n.upper}
            | {i for i in ov._dirty_ino if i not in ov.nodes} | set(also))


def graft_apply(ov: Overlay, g: Graft) -> None:
    """Make memory what ``graft_rows`` committed (event-loop thread, after the commit)."""
    nodes = ov.nodes
    cs = ov.cs
    for ino, (tid, origin, nlink, mine) in g.dirs.items():
        d = nodes[ino]
        before = held_bytes(d, cs)
        if not d.upper and ino != ROOT_INO:
            ov.used_inodes += 1  # a row again (its own, holding kept entries)
        d.upper = True
        d.lower_tree = tid
        d.nlink = nlink
        d.entries = dict(mine)
        e = g.attrs.get(ino)
        if e is not None:
            d.mode, d.uid, d.gid, d.mtime_ns = e.mode, e.uid, e.gid, e.mtime_ns
            d.xattrs = dict(e.xattrs)
        ov.used_bytes += held_bytes(d, cs) - before  # the row's xattrs
        if ino != ROOT_INO:
            d.origin = origin
            if origin is not None:
                ov.by_origin[origin] = ino
    for ino, links in g.kept.items():
        n = nodes[ino]
        if ino in g.cross:
            n.origin = g.cross[ino]
            ov.by_origin[n.origin] = ino
        elif ino not in g.named:
            if n.origin is not None and ov.by_origin.get(n.origin) == ino:
                del ov.by_origin[n.origin]
            n.origin = None
            if ino in g.nlink:
                n.nlink = g.nlink[ino]
        n.lower_links = links
        if not n.upper:
            ov.used_inodes += 1
            n.upper = True
            ov.used_bytes += held_bytes(n, cs)
            if n.kind is Kind.DIR and n.entries is None:
                n.entries = {}
    for ino in g.cleared:
        n = nodes[ino]
        if n.origin is not None and ov.by_origin.get(n.origin) == ino:
            del ov.by_origin[n.origin]
        n.origin = None
        if n.kind is not Kind.DIR:
            n.lower_links = 0


def kept_rows(ov: Overlay, rb: Rebase, root_tree: bytes,
              uppers: Iterable[Node] | None = None) -> None:
    """Fill ``rb`` with the rows the upper keeps: orphans (origin cleared) and the root.
    ``uppers`` (the nodes with an upper row, if known) saves a pass over every node."""
    rb.rows = []
    grafted = {r[0] for r in rb.full_rows}  # kept for excluded paths: their xattrs stay
    rb.xattrs = {i: v for i, v in rb.xattrs.items() if i in grafted}
    for n in (ov.nodes.values() if uppers is None else uppers):
        if n.upper and n.nlink == 0 and ov.nodes.get(n.ino) is n:
            rb.rows.append(_set_col(row_of(n), origin=None, lower_tree=None))
            if n.xattrs:
                rb.xattrs[n.ino] = sorted(n.xattrs.items())
    root = ov.nodes[ROOT_INO]
    if root.upper:
        rb.rows.append(_set_col(row_of(root), lower_tree=root_tree,
                                nlink=2 + ov.lower.subdirs(ObjectId(root_tree))))
        if root.xattrs:
            rb.xattrs[ROOT_INO] = sorted(root.xattrs.items())
    rb.next_ino = ov.next_ino
    rb.next_cookie = ov.next_cookie
    held = set(ov.held_lowers())
    if ov.readers_of_lower():  # detached files reading the lower being replaced
        held.add(str(ov.lower.ref))
    rb.held = sorted(held)


def _set_pin(ov: Overlay, rb: Rebase, origin: bytes, ino: int, ctime: int) -> None:
    """Pin ``origin`` to (``ino``, ``ctime``) in memory and in ``rb``; a number has one pin,
    so an older pin of ``ino`` (or of ``origin``) goes."""
    old = ov.pinned.get(ino)
    if old is not None and old != origin:
        del ov.pins[old]
        rb.pins.pop(old, None)
        rb.pins_gone.append(old)
    prev = ov.pins.get(origin)
    if prev is not None and prev[0] != ino and ov.pinned.get(prev[0]) == origin:
        del ov.pinned[prev[0]]
    ov.pins[origin] = (ino, ctime)
    ov.pinned[ino] = origin
    rb.pins[origin] = (ino, ctime)


def prepare(ov: Overlay, p: Plan, ref: Ref) -> Rebase:
    """The upper's side of rebasing onto ``ref`` (the built plan): pins that keep every
    placed inode's number and ctime, and the rows kept. Changes ``ov.pins``/``pinned``
    only (harmless before the swap: a pin names an origin of the new tree)."""
    rb = Rebase(ref)
    if p.unchanged:
        return rb
    rb.was_upper = p.upper_inos
    seen: set[int] = set()
    for pl in p.placements:
        if pl.ino == ROOT_INO or pl.ino in seen:
            continue
        seen.add(pl.ino)
        o = origin_key(pl.parent, pl.name, pl.entry)
        n = pl.node
        if n is not None and not n.upper and n.origin == o:
            continue  # a directory whose tree changed below it: its number is its own
        if ov.pins.get(o) != (pl.ino, pl.ctime_ns) or ov.pinned.get(pl.ino) != o:
            _set_pin(ov, rb, o, pl.ino, pl.ctime_ns)
    assert p.root.tree_id is not None
    kept_rows(ov, rb, p.root.tree_id, p.uppers)
    if ov.exclude is not None or ov.kept_tree is not None:
        rb.kept_tree = str(Ref(p.kept_tree)) if p.kept_tree is not None else ""
    if ov.exclude is not None:
        rb.exclude_clean = ov.exclude_mark(ref)
        rb.clean_ref = ref
    if p.kept or p.cross:
        tree_of: dict[int, ObjectId] = {}
        for dp in p.dirs:
            assert dp.tree_id is not None
            tree_of[dp.ino] = dp.tree_id
        origin_of = {pl.ino: origin_key(pl.parent, pl.name, pl.entry) for pl in p.placements
                     if pl.entry.kind is Kind.DIR}
        frozen = {pl.ino for pl in p.placements}
        graft_rows(ov, rb, p.kept, tree_of, origin_of, p.uppers, frozen, p.cross)
        if rb.graft is not None:
            rb.graft.cross_names = p.cross_names
        rb.next_cookie = ov.next_cookie
        if any(r[0] == ROOT_INO for r in rb.full_rows):
            rb.rows = [r for r in rb.rows if r[0] != ROOT_INO]
    if ov.upper is not None:
        stay = rb.keep | {r[0] for r in rb.full_rows if r[ROW_COLUMNS.index("kind")] == 2}
        rb.drop_data = [ov.upper.data_path(i) for i in p.upper_inos
                        if ((n := ov.nodes.get(i)) is None or n.nlink > 0) and i not in stay]
    return rb


def reset_upper(upper: Upper, rb: Rebase) -> None:
    """In one durable transaction: record ``rb.ref`` as the base, drop every row but the
    kept ones, apply the pin changes (batches waiting in the upper's spill are superseded).
    Worker thread; the caller holds the upper's write lock. Raises OSError(ENOSPC) when the
    upper's disk has no space even after releasing its reserve; nothing is changed then."""

    pending = list(upper.spilled) if rb.keep_dentries else []

    def body(c: sqlite3.Connection) -> None:
        keep = [r[0] for r in rb.rows] + [r[0] for r in rb.full_rows]
        if rb.keep_dentries:
            # Rows below kept (excluded) entries stay: bring them up to date with what
            # waits in the spill, then drop every other row.
            for x in pending:
                _apply(c, x)
            gone = [(i,) for i in rb.drop]
            c.executemany("DELETE FROM dentries WHERE parent=?", gone)
            c.executemany("DELETE FROM inodes WHERE ino=?", gone)
            c.executemany("DELETE FROM xattrs WHERE ino=?", gone)
        else:
            c.execute("DELETE FROM dentries")
            c.execute("DELETE FROM inodes")
            c.execute("DELETE FROM xattrs")
        if rb.rows:
            cols = ", ".join(ROW_COLUMNS)
            marks = ", ".join("?" * len(ROW_COLUMNS))
            c.executemany(f"INSERT INTO inodes({cols}) VALUES ({marks})", rb.rows)
        if rb.full_rows:
            cols = ", ".join(ROW_COLUMNS)
            marks = ", ".join("?" * len(ROW_COLUMNS))
            c.executemany(f"INSERT OR REPLACE INTO inodes({cols}) VALUES ({marks})",
                          rb.full_rows)
        if rb.dentries:
            c.executemany("INSERT OR REPLACE INTO dentries(parent, name, ino, cookie) "
                          "VALUES (?, ?, ?, ?)", rb.dentries)
        for ino, pairs in rb.xattrs.items():
            if ino in keep:
                c.executemany("INSERT INTO xattrs(ino, name, value) VALUES (?, ?, ?)",
                              [(ino, k, v) for k, v in pairs])
        if rb.pins_gone:
            c.executemany("DELETE FROM pins WHERE origin=?", [(o,) for o in rb.pins_gone])
        if rb.pins:
            c.executemany("INSERT OR REPLACE INTO pins(origin, ino, ctime_ns) "
                          "VALUES (?, ?, ?)",
                          [(o, i, t) for o, (i, t) in rb.pins.items()])
        c.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", [
            ("base", str(rb.ref)), ("next_ino", str(rb.next_ino)),
            ("next_cookie", str(rb.next_cookie)), ("held_lowers", " ".join(rb.held))])
        if rb.kept_tree is not None:
            c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('kept_tree', ?)",
                      (rb.kept_tree,))
        if rb.exclude_clean is not None and rb.ref == rb.clean_ref:
            c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('exclude_clean', ?)",
                      (rb.exclude_clean,))

    upper.transact(body, durable=True)
    upper.failing = False
    upper.base = rb.ref


def drop_data(paths: Iterable[str]) -> None:
    """Remove data files the upper no longer names (after ``reset_upper`` committed)."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def switch_lower(ov: Overlay, ref: Ref) -> None:
    """Point the overlay's lower at ``ref`` keeping its chunk and tree caches."""
    lower = ov.lower
    lower.ref = ref
    lower._groups = None  # link counts are per snapshot


def apply(ov: Overlay, p: Plan, rb: Rebase) -> None:
    """Rebase ``ov`` in memory onto the built plan (event-loop thread, atomic, after
    ``reset_upper`` committed): frozen inodes become lower inodes with the same numbers,
    attributes and open handles; the upper keeps only orphans and the root's row."""
    if p.unchanged:
        return
    ov.hold(ov.readers_of_lower(), str(ov.lower.ref))
    switch_lower(ov, rb.ref)
    done: set[int] = set(rb.graft.cross) if rb.graft is not None else set()
    if rb.graft is not None:  # the quota counts, less what the frozen rows held
        cs = ov.cs
        for pl in p.placements:
            n = pl.node
            if (n is not None and n.upper and n.ino not in done and n.ino != ROOT_INO
                    and ov.nodes.get(n.ino) is n and n.nlink > 0):
                done.add(n.ino)
                ov.used_inodes -= 1
                ov.used_bytes -= held_bytes(n, cs)
        done = set(rb.graft.cross)
    for pl in p.placements:
        n = pl.node
        if n is None or n.ino in done or ov.nodes.get(n.ino) is not n:
            continue
        done.add(n.ino)
        e = pl.entry
        if n.ino != ROOT_INO:
            n.origin = origin_key(pl.parent, pl.name, e)
            n.parent = pl.parent  # where its (first) name is now, for the closure walk
        if n.kind is Kind.DIR:
            n.lower_tree = e.tree_id
            n.entries = {} if n.ino == ROOT_INO and n.upper else None
            if n.ino != ROOT_INO:
                n.upper = False
            continue
        if n.kind is Kind.FILE:
            n.lower_chunks = e.chunks
            n.lower_len = e.size
            n.present = set()
            if n.fd is not None:
                os.close(n.fd)
                n.fd = None
            n.has_data = False
            ov._drop_inline(n)  # keeps the overlay's inline budget right
        n.lower_links = n.nlink
        n.upper = False
    root = ov.nodes[ROOT_INO]
    assert p.root.tree_id is not None
    root.lower_tree = p.root.tree_id
    if root.upper:
        root.entries = {}
    _forget_origins(ov, p.uppers)
    if rb.kept_tree is not None:
        ov.kept_tree = Ref.parse(rb.kept_tree) if rb.kept_tree else None
    if rb.graft is not None:
        graft_apply(ov, rb.graft)
    if ov.exclude is not None:
        for dp in p.dirs:  # what the walk made: no excluded path left in these trees
            if dp.tree_id is not None:
                ov.excluded_trees[(bytes(dp.tree_id), dp.path)] = False
    kept = {r[0] for r in rb.rows} | {r[0] for r in rb.full_rows}
    below = rb.keep
    ov._dirty_ino = {i for i in ov._dirty_ino if i not in ov.nodes or i in kept or i in below}
    ov._dirty_dent = {pn for pn in ov._dirty_dent if pn[0] in rb.keep_dentries}
    ov._dirty_xattr = {i for i in ov._dirty_xattr if i in kept or i in below}
    ov._dirty_data = {i for i in ov._dirty_data if i in kept or i in below}
    ov.recharge()
    # what the upper still holds counts against the quotas
    if rb.graft is None:
        ov.recount(p.uppers)
    # Open directory handles keep the trees and names their listing started with
    # (``DirHandle``): a listing in progress goes on in its own cookies.


def _forget_origins(ov: Overlay, candidates: Iterable[Node]) -> None:
    """Rebuild ``by_origin`` from the upper nodes left among ``candidates`` (every node
    that had an upper row), and clear the origin of every inode no name reaches any more
    (orphans, and unlinked lower files still open), so no lookup of the new lower resolves
    to it."""
    ov.by_origin = {}
    for n in list(candidates) + [h.node for h in ov.handles.values()]:
        if n.nlink == 0 and n.ino != ROOT_INO:
            n.origin = None
        elif n.upper and n.origin is not None:
            ov.by_origin[n.origin] = n.ino


# -- the whole checkpoint, for callers without an event loop ----------------------------------

@dataclass
class Result:
    """What one checkpoint did."""

    ref: Ref
    unchanged: bool
    packs_written: int = 0
    bytes_written: int = 0
    dirs_encoded: int = 0
    full_walk: bool = False
    uppers: list[Node] = field(default_factory=list, repr=False)  # had a row before
    kept: list[Kept] = field(default_factory=list, repr=False)  # excluded entries kept
    rebase: Rebase | None = field(default=None, repr=False)


def checkpoint_overlay(ov: Overlay, *, origin: str = "checkpoint", label: str | None = None,
                       list_it: bool = True) -> Result:
    """Checkpoint ``ov`` synchronously (no mount: tests and tools that drive the overlay
    directly). Same steps and order as the daemon's checkpoint without the pause."""
    assert ov.upper is not None
    store = ov.lower.store
    with store.writer() as w:
        p, ref = freeze(ov, store, w)
        w.commit()
        if list_it:
            store.add_snapshot(ref, origin, label)
        res = Result(ref, p.unchanged, w.packs_written, w.bytes_written, len(p.dirs),
                     p.full_walk, p.uppers, p.kept)
    if p.unchanged:
        return res
    rb = prepare(ov, p, ref)
    reset_upper(ov.upper, rb)
    apply(ov, p, rb)
    drop_data(rb.drop_data)
    res.rebase = rb
    return res


__all__ = ["CRASH_ENV", "POINTS", "Plan", "Rebase", "Result", "apply", "bearing", "build",
           "checkpoint_overlay", "crash_point", "drop_data", "freeze", "number", "plan",
           "prepare", "reset_upper", "switch_lower"]


# -- preview: the changes since the base, without writing anything ----------------------------

class MemoryWriter:
    """A ``Writer`` stand-in that keeps chunks and trees in memory (for ``preview``); also
    answers ``get_tree`` and ``read_object`` for what it holds, falling back to ``store``."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.trees: dict[bytes, bytes] = {}
        self.chunks: dict[bytes, bytes] = {}

    def put_chunk(self, data: bytes) -> ObjectId:
        from store.ref import object_id

        oid = object_id(data)
        self.chunks[oid] = data
        return oid

    def put_tree(self, entries: list[Entry] | tuple[Entry, ...]) -> ObjectId:
        from store.ref import object_id
        from store.tree import encode_tree

        enc = encode_tree(entries)
        oid = object_id(enc)
        self.trees[oid] = enc
        return oid

    def get_tree(self, tree_id: ObjectId) -> Tree:
        enc = self.trees.get(tree_id)
        if enc is None:
            return self.store.get_tree(tree_id)
        from store.tree import decode_tree

        return decode_tree(enc, tree_id.hex())

    def read_object(self, oid: ObjectId) -> bytes:
        data = self.chunks.get(oid)
        return self.store.read_object(oid) if data is None else data


def preview(ov: Overlay) -> tuple[Ref, MemoryWriter]:
    """The Ref a checkpoint would give now, and the new trees and chunks it would write, kept
    in memory; nothing is written and the overlay is unchanged. Event-loop thread."""
    store = ov.lower.store
    mw = MemoryWriter(store)
    p = plan(ov)
    return build(p, store, mw), mw
