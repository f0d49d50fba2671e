"""The overlay: one POSIX namespace over a lower snapshot and an upper layer.

A plain class, callable without a mount: the FUSE adapter (``operations.py``) translates
requests into these methods and tests drive them directly. Inodes are addressed by number
and names are bytes, as in FUSE. Every POSIX failure is an ``OSError`` with its errno;
anything else is a bug. Without an upper layer the overlay is read-only (EROFS).

What it owns: lookup and lookup counts, the upper's in-memory state (the upper file is its
write-behind copy, see ``upper.py``), copy-up (metadata first, data per chunk), the content
of small new files (inline, in memory and in their row, so creating one makes no file on
disk), whiteouts, stable readdir cookies, open handles, and the batches written to the
upper.

*Detached* inodes: an inode no name reaches any more (``nlink`` 0: unlinked, or removed by a
restore) that the kernel still holds, by a lookup count or an open handle, stays in memory
and keeps working, as Linux keeps a file unlinked while open: reads give its old bytes,
writes land in its own upper row and data file, which no checkpoint includes. ``unlinked``
lists them. A detached file whose content still comes partly from an older lower records that
lower's Ref in ``held`` until the kernel forgets the inode; the upper persists the set as
``held_lowers`` so GC keeps those chunks (CONTRACT 1.6). Both follow the inode and its lookup
count, not only file handles.

*Quotas* (``quota_bytes``, ``quota_inodes``, recorded in the upper's meta): caps on what the
upper holds, counted in memory (``used_bytes``, ``used_inodes``) as each request changes it,
O(1) per request: the content bytes of upper files (``held_bytes``: inline content, lower
chunks copied into the data file, and everything past the lower content, holes included)
and the upper's inode rows (the root's aside), detached inodes included while open (an
inode without names or open handles stops counting at once, before the kernel forgets it). A write or truncate
that would grow the upper past the byte cap fails with EDQUOT, or is cut short at it (as
write(2) is at a file size limit); a create (file, directory, symlink, node) at the inode
cap fails with EDQUOT. Copy-ups of metadata count but are never refused. A checkpoint empties
the upper, so the counts drop to what it keeps (``recount``).

What it must never do: touch the mount point, block on anything but local files, or write
the store. Methods are not thread safe: call them from one thread (the trio thread).

Semantics follow POSIX and Linux (the references for each operation are the Linux man
pages of the same name); permission checks are the kernel's (``default_permissions``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence

from store import chunker
from store.ref import DIGEST_SIZE, ObjectId, Ref
from store.tree import NAME_MAX, ChunkList, Entry, Kind, decode_runs, encode_runs

from .inodes import ROOT_INO, Node, derive_ino, origin_key
from .lower import LOCATE_AHEAD, Lower
from .upper import (
    BATCH_BYTES,
    INLINE_MAX,
    ITEM_BYTES,
    NAME_BYTES,
    ROW_BYTES,
    XATTR_BYTES,
    Batch,
    Loaded,
    Upper,
    bitmap,
    iter_data_files,
    unbitmap,
)

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
XATTR_CREATE = 1
XATTR_REPLACE = 2
XATTR_NAME_MAX = 255
XATTR_SIZE_MAX = 65536

# Readdir cookies: 1 and 2 are "." and "..", 3 + i the i-th lower entry, UPPER_BASE + c the
# upper dentry with cookie c. Lower trees are immutable and upper cookies only grow, so a
# cookie names the same entry for the whole life of a directory (PYFUSE3.md trap 4).
UPPER_BASE = 1 << 40
# A listing without opendir (no-open mode) hands out cookies that also name the listing
# state they belong to (``DirListings``): its generation, in the bits from GEN_SHIFT up.
GEN_SHIFT = 48
GEN_KEEP = 8  # listing states kept per directory (the newest ones)
# A listing of lower entries asks the store for the data pages (``Overlay.blocks``) of the
# next this many entries' chunks at once: one query per 500 chunks, not one per file.
PAGES_AHEAD = 1024
INLINE_BUDGET = 256 << 20  # inline content kept in memory at most; beyond, data files
# What one change adds to ``pending_bytes`` besides the rows ``change_bytes`` counts: a few
# rows of its own (a new inode, one it frees), two names, a data file to unlink.
CHANGE_BYTES = 4096
MAX_FILE_SIZE = 1 << 40  # 1 TiB: larger sizes get EFBIG (a checkpoint lists every chunk)

_KIND_OF_FMT = {stat.S_IFREG: Kind.FILE, stat.S_IFIFO: Kind.FIFO, stat.S_IFSOCK: Kind.SOCKET,
                stat.S_IFBLK: Kind.BLOCK, stat.S_IFCHR: Kind.CHAR}


def xattr_bytes(n: Node) -> int:
    """Bytes of ``n``'s extended attributes: names plus values."""
    return sum(len(k) + len(v) for k, v in n.xattrs.items()) if n.xattrs else 0


def held_bytes(n: Node, cs: int) -> int:
    """Bytes the upper holds for ``n`` (``cs``: chunk size): its extended attributes
    (names and values), and for a file its inline content, or the lower chunks copied
    into its data file (the last one at its real length) plus everything past its lower
    content; 0 for lower nodes."""
    if not n.upper:
        return 0
    b = xattr_bytes(n)
    if n.kind is not Kind.FILE:
        return b
    if n.inline is not None:
        return b + len(n.inline)
    if not n.has_data:
        return b
    b += n.size - n.lower_len if n.size > n.lower_len else 0
    if n.present:
        b += len(n.present) * cs
        last = (n.lower_len - 1) // cs
        if last in n.present:
            b -= (last + 1) * cs - n.lower_len
    return b


def _err(code: int, what: object = None) -> OSError:
    if what is None:
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), str(what))


class Handle:
    """An open file: ``node``, the open flags, and where its last read ended."""

    __slots__ = ("node", "flags", "writable", "seq_end", "seq_near")

    def __init__(self, node: Node, flags: int) -> None:
        self.node = node
        self.flags = flags
        self.writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        self.seq_end = 0  # where the last read ended (the adapter's readahead hint)
        self.seq_near = False  # whether that read began near the one before it


class DirHandle:
    """An open directory; ``cookies`` and ``names`` list its upper entries and
    ``lower_tree`` is its lower tree, as they were when a listing last started over (a
    checkpoint since then moved the upper entries into a new lower: the listing goes on
    in the cookies it started with). ``ahead`` holds nodes made for lower entries the
    listing has not reached yet (``Overlay.list_ahead``): by index in the lower tree, each
    with the entry it was made for."""

    __slots__ = ("node", "cookies", "names", "lower_tree", "ahead")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.cookies: list[int] = []
        self.names: list[bytes] = []
        self.lower_tree: ObjectId | None = None
        self.ahead: dict[int, tuple[Entry, Node]] = {}
        self.refresh()

    def refresh(self) -> None:
        self.ahead = {}
        ents = self.node.entries or {}
        pairs = [(c, name) for name, (ino, c) in ents.items() if ino]
        self.cookies = [c for c, _ in pairs]
        self.names = [name for _, name in pairs]
        self.lower_tree = self.node.lower_tree


class DirListings:
    """The listing states of a directory listed without opendir (no-open mode: the kernel
    sends READDIR with handle 0, so listings cannot keep a ``DirHandle`` each).

    A ``DirHandle`` per *generation*: a listing from the start takes the newest one,
    refreshed, or a new generation once the directory's lower tree changed (a checkpoint
    moved its upper entries into a new lower); cookies carry their generation
    (``GEN_SHIFT``), so a listing part way through goes on in the state it started with,
    whatever listings of the directory began since. The ``GEN_KEEP`` newest are kept."""

    __slots__ = ("node", "gens", "newest")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.newest = 0
        self.gens: dict[int, DirHandle] = {0: DirHandle(node)}

    def at(self, start: int) -> tuple[int, DirHandle]:
        """The generation and listing state a READDIR from cookie ``start`` continues."""
        if start == 0:
            h = self.gens[self.newest]
            if h.lower_tree == self.node.lower_tree:
                h.refresh()
                return self.newest, h
            self.newest += 1
            self.gens[self.newest] = DirHandle(self.node)
            self.gens.pop(self.newest - GEN_KEEP, None)
            return self.newest, self.gens[self.newest]
        gen = start >> GEN_SHIFT
        if gen not in self.gens:  # older than every state kept: go on in the oldest one
            gen = min(self.gens)
        return gen, self.gens[gen]

    def refresh(self) -> None:
        """After a restore: every state sees the directory as it is now (as open handles)."""
        for h in self.gens.values():
            h.refresh()


class Overlay:
    """lower (+ upper): see the module docstring.

    ``uid``/``gid`` own the root directory while it is unchanged (the snapshot does not
    record the root's own attributes); ``clock`` returns ns since the epoch.
    """

    def __init__(self, lower: Lower, upper: Upper | None = None, *,
                 uid: int | None = None, gid: int | None = None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self.lower = lower
        self.upper = upper
        self.readonly = upper is None
        self.cs = lower.chunk_size
        self.clock = clock
        self.nodes: dict[int, Node] = {}
        self.by_origin: dict[bytes, int] = {}
        self.pins: dict[bytes, tuple[int, int]] = {}
        self.pinned: dict[int, bytes] = {}
        self.handles: dict[int, Handle] = {}
        self.dirs: dict[int, DirHandle] = {}
        # No-open mode (the kernel sends handle 0): I/O by inode through handles keyed
        # -ino, which count as neither open nor writable (``inode_fh``); listings by
        # directory inode (``readdir_inode``).
        self.inode_handles: dict[int, Handle] = {}
        self.inode_dirs: dict[int, DirListings] = {}
        self._next_fh = 1
        self.next_ino = 2
        self.next_cookie = 1
        self._dirty_ino: set[int] = set()
        self._dirty_dent: set[tuple[int, bytes]] = set()
        self._dirty_xattr: set[int] = set()
        self._dirty_data: set[int] = set()
        # What changed since the last step, kept only once a step log (fusefs/steps.py)
        # started them: inodes (rows or xattrs) and (directory inode, name) dentries,
        # recorded with the batch's own marks (``_changed``...), so a step looks at the
        # changes since the previous step, not at everything since the last batch.
        self.step_inos: set[int] | None = None
        self.step_dents: set[tuple[int, bytes]] = set()
        self._unlink_after: list[str] = []
        # An upper bound of the spill payload of the next batch (``collect``): charged as
        # changes mark rows, names and xattrs (``_changed``...) and as inline content grows.
        self.pending_bytes = BATCH_BYTES
        self.inline_bytes = 0  # total inline content in memory
        self.quota_bytes: int | None = None  # caps on the upper (see the module doc)
        self.quota_inodes: int | None = None
        self.used_bytes = 0
        self.used_inodes = 0
        self.unlinked: set[int] = set()  # detached inodes in memory (see the module doc)
        self.held: dict[int, str] = {}  # detached file -> Ref text of the lower it reads
        self._held_changed = False
        # The session's exclude patterns (``excluded``; recorded in the upper's meta) and
        # what the checkpoint learnt about lower trees: (tree id, path) -> holds a path
        # they match (``checkpoint.holds_excluded``).
        self.exclude_patterns: tuple[str, ...] = ()
        self.exclude: Callable[[str], bool] | None = None
        self.excluded_trees: dict[tuple[bytes, bytes], bool] = {}
        self.kept_tree: Ref | None = None  # pins what kept excluded files read (GC)
        if upper is not None:
            self._load(upper.load())
        if ROOT_INO not in self.nodes:
            root = Node(ROOT_INO, Kind.DIR, 0o755, os.getuid() if uid is None else uid,
                        os.getgid() if gid is None else gid, 0)
            root.lower_tree = lower.root_tree
            root.parent = ROOT_INO
            root.nlink = 2 + lower.subdirs(lower.root_tree)
            self.nodes[ROOT_INO] = root
        self.recount()

    # -- loading ---------------------------------------------------------------------------

    def _load(self, s: Loaded) -> None:
        self.next_ino = int(s.meta.get("next_ino", "2"))
        self.next_cookie = int(s.meta.get("next_cookie", "1"))
        self.quota_bytes = int(s.meta.get("quota_bytes") or 0) or None
        self.quota_inodes = int(s.meta.get("quota_inodes") or 0) or None
        if s.meta.get("exclude"):
            import json

            from store.pathpolicy import PathPolicy

            self.exclude_patterns = tuple(json.loads(s.meta["exclude"]))
            self.exclude = PathPolicy(exclude=self.exclude_patterns,
                                      source="the upper's exclude patterns").matcher("exclude")
            base = s.meta.get("base")
            if base and s.meta.get("exclude_clean") == self.exclude_mark(Ref.parse(base)):
                # the base was made by a checkpoint under these patterns: nothing to find
                self.excluded_trees[(bytes(Ref.parse(base).tree_id), b"")] = False
        if s.meta.get("kept_tree"):
            self.kept_tree = Ref.parse(s.meta["kept_tree"])
        for r in s.inodes:
            n = Node(r["ino"], Kind(r["kind"]), r["mode"], r["uid"], r["gid"], 0)
            n.atime_ns, n.mtime_ns, n.ctime_ns = r["atime_ns"], r["mtime_ns"], r["ctime_ns"]
            n.nlink = r["nlink"]
            n.lower_links = r["lower_links"]
            n.size = r["size"]
            n.parent = r["parent"]
            n.lower_tree = r["lower_tree"]
            n.lower_chunks = decode_runs(r["lower_chunks"] or b"")
            n.lower_len = r["lower_len"]
            n.present = unbitmap(r["present"])
            n.target = r["target"] or b""
            n.rdev = r["rdev"] or 0
            n.origin = r["origin"]
            if r["inline"] is not None:
                n.inline = bytearray(r["inline"])
                self.inline_bytes += len(n.inline)
            n.upper = True
            if n.kind is Kind.DIR:
                n.entries = {}
            self.nodes[n.ino] = n
            if n.origin is not None:
                self.by_origin[n.origin] = n.ino
        for parent, name, ino, cookie in s.dentries:
            d = self.nodes.get(parent)
            if d is not None and d.entries is not None:
                d.entries[name] = (ino, cookie)
        for ino, name, value in s.xattrs:
            xn = self.nodes.get(ino)
            if xn is not None:
                xn.xattrs[name] = value
        for origin, ino, ctime in s.pins:
            self.pins[origin] = (ino, ctime)
            self.pinned[ino] = origin
        assert self.upper is not None
        for ino, _path in iter_data_files(self.upper.data_dir):
            dn = self.nodes.get(ino)
            if dn is not None:
                dn.has_data = True

    def exclude_mark(self, ref: Ref) -> str:
        """The upper's ``exclude_clean`` value saying that ``ref`` holds no path the
        current patterns match (a checkpoint made it)."""
        import json

        return f"{ref} {json.dumps(list(self.exclude_patterns))}"

    def excluded(self, path: bytes, is_dir: bool) -> bool:
        """True if workspace path ``path`` (``/``-separated bytes, no leading slash; a
        directory when ``is_dir``) matches the session's exclude patterns: derived data
        that checkpoints leave in the upper and out of every Ref (CONTRACT amendment
        "0, 3.1 policies"). A path below a matching directory matches too."""
        m = self.exclude
        if m is None or not path:
            return False
        text = os.fsdecode(path)
        return m(text + "/" if is_dir else text)

    # -- the exclude boundary --------------------------------------------------------------
    # A hard-linked file keeps all its names on one side of the exclude patterns: link(2) or
    # rename(2) that would give it names on both sides fails with EXDEV, as across file
    # systems (programs fall back to copying). One inode cannot be both frozen into a Ref
    # and kept out of it once a tree holds one of its names.

    def _dir_path(self, d: Node) -> bytes | None:
        """Workspace path of directory ``d`` (b"" for the root), through the parents in
        memory; None where a name is not found (then the caller refuses)."""
        parts: list[bytes] = []
        seen = 0
        while d.ino != ROOT_INO:
            p = self.nodes.get(d.parent)
            if p is None or seen > 4096:
                return None
            name = next((k for k, v in (p.entries or {}).items() if v[0] == d.ino), None)
            o = d.origin
            if name is None and o is not None and o[:1] == b"p" and \
                    int.from_bytes(o[1:9], "little") == p.ino and \
                    (p.entries or {}).get(o[42:], (d.ino,))[0] == d.ino:
                name = o[42:]
            if name is None:
                return None
            parts.append(name)
            d = p
            seen += 1
        return b"/".join(reversed(parts))

    def _side(self, d: Node, name: bytes, is_dir: bool) -> bool | None:
        """Whether ``name`` in ``d`` is excluded (None: its path is not known)."""
        dp = self._dir_path(d)
        if dp is None:
            return None
        return self.excluded(dp + b"/" + name if dp else name, is_dir)

    def _file_side(self, n: Node) -> bool | None:
        """Whether the names of non-directory ``n`` are excluded (they all share a side,
        see above): one upper dentry of it, else its lower name; None if none is found."""
        for d in self.nodes.values():
            if d.kind is Kind.DIR and d.entries and d.nlink > 0:
                for k, v in d.entries.items():
                    if v[0] == n.ino:
                        return self._side(d, k, False)
        o = n.origin
        if n.lower_links > 0 and o is not None and o[:1] == b"p":
            holder = self.nodes.get(int.from_bytes(o[1:9], "little"))
            if holder is not None:
                return self._side(holder, o[42:], False)
        return None

    def _check_boundary(self, s: Node, d1: Node, n1: bytes, d2: Node, n2: bytes) -> None:
        """EXDEV if moving ``s`` from ``n1`` in ``d1`` to ``n2`` in ``d2`` moves a
        hard-linked file (``s`` or one below it) across the exclude boundary."""
        if self.exclude is None:
            return
        if s.kind is not Kind.DIR:
            if s.nlink > 1:
                a, b = self._side(d1, n1, False), self._side(d2, n2, False)
                if a is None or a != b:
                    raise _err(errno.EXDEV, "hard-linked file across the exclude boundary")
            return
        p1, p2 = self._dir_path(d1), self._dir_path(d2)
        if p1 is None or p2 is None:
            raise _err(errno.EXDEV, "directory path not known")
        old = p1 + b"/" + n1 if p1 else n1
        new = p2 + b"/" + n2 if p2 else n2
        created: list[Node] = []
        try:
            todo: list[tuple[Node, bytes]] = [(s, b"")]
            while todo:
                dn, rel = todo.pop()
                ents = dn.entries or {}
                linked: list[bytes] = []
                for k, v in ents.items():
                    c = self.nodes.get(v[0]) if v[0] else None
                    if c is None:
                        continue
                    if c.kind is Kind.DIR:
                        todo.append((c, rel + b"/" + k))
                    elif c.nlink > 1:
                        linked.append(k)
                tree = dn.lower_tree
                for e in self.lower.tree(tree).entries if tree is not None else ():
                    if e.name in ents:
                        continue
                    if e.kind is Kind.DIR:
                        known = e.name in ents or self.by_origin.get(
                            origin_key(dn.ino, e.name, e)) is not None
                        cn = self._lower_node(dn, e.name, e)
                        if not known:
                            created.append(cn)
                        todo.append((cn, rel + b"/" + e.name))
                    elif e.link_group is not None:
                        linked.append(e.name)
                for k in linked:
                    r = rel + b"/" + k
                    if self.excluded(old + r, False) != self.excluded(new + r, False):
                        raise _err(errno.EXDEV,
                                   "hard-linked file across the exclude boundary")
        finally:
            for c in reversed(created):
                self.release_unused(c)

    # -- resolution ------------------------------------------------------------------------

    def _node(self, ino: int) -> Node:
        n = self.nodes.get(ino)
        if n is None:
            raise _err(errno.ENOENT, f"inode {ino}")
        return n

    def _dir(self, ino: int) -> Node:
        d = self._node(ino)
        if d.kind is not Kind.DIR:
            raise _err(errno.ENOTDIR, f"inode {ino}")
        return d

    def _lower_entry(self, d: Node, name: bytes) -> Entry | None:
        t = d.lower_tree
        return None if t is None else self.lower.tree(t).get(name)

    def _exists(self, d: Node, name: bytes) -> bool:
        ents = d.entries
        if ents is not None:
            v = ents.get(name)
            if v is not None:
                return v[0] != 0
        return self._lower_entry(d, name) is not None

    def _child(self, d: Node, name: bytes) -> Node | None:
        """The node ``name`` in directory ``d`` names, without counting a lookup."""
        ents = d.entries
        if ents is not None:
            v = ents.get(name)
            if v is not None:
                return None if v[0] == 0 else self.nodes[v[0]]
        e = self._lower_entry(d, name)
        return None if e is None else self._lower_node(d, name, e)

    def _lower_node(self, d: Node, name: bytes, e: Entry) -> Node:
        """The node of lower entry ``e`` in ``d``: its upper row, else pinned, else derived."""
        origin = origin_key(d.ino, name, e)
        known = self.by_origin.get(origin)
        if known is not None:
            return self.nodes[known]
        ctime: int | None = None
        ino = 0
        pin = self.pins.get(origin)
        if pin is not None:
            other = self.nodes.get(pin[0])
            if other is None:
                ino, ctime = pin
            elif other.origin == origin:
                return other
            else:
                pin = None  # the pinned number is taken: fall back to a derived one
        if pin is None:
            salt = 0
            while True:
                ino = derive_ino(origin, salt)
                other = self.nodes.get(ino)
                if other is not None:
                    if other.origin == origin:
                        return other
                elif self.pinned.get(ino, origin) == origin:
                    break
                salt += 1
        if e.kind is Kind.DIR:
            assert e.tree_id is not None
            nlink = 2 + self.lower.subdirs(e.tree_id)
        elif e.link_group is not None:
            nlink = self.lower.link_count(e.link_group)
        else:
            nlink = 1
        n = Node.from_entry(ino, e, origin, d.ino, nlink, ctime)
        self.nodes[ino] = n
        return n

    def resolve(self, path: bytes | str) -> Node:
        """The node at ``path`` (relative to the root, ``/``-separated), without counting
        lookups; symlinks are not followed. Raises ENOENT/ENOTDIR."""
        if isinstance(path, str):
            path = os.fsencode(path)
        n = self.nodes[ROOT_INO]
        for part in path.split(b"/"):
            if not part or part == b".":
                continue
            if part == b"..":
                n = self._node(n.parent)
                continue
            d = self._dir(n.ino)
            c = self._child(d, part)
            if c is None:
                raise _err(errno.ENOENT, path)
            n = c
        return n

    # -- lookup counts ---------------------------------------------------------------------

    def lookup(self, parent: int, name: bytes) -> Node | None:
        """The node ``name`` names in ``parent`` with its lookup count raised, or None."""
        d = self._dir(parent)
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG, name)
        if name == b".":
            n: Node | None = d
        elif name == b"..":
            n = self._node(d.parent)
        else:
            n = self._child(d, name)
        if n is not None:
            n.nlookup += 1
        return n

    def remember(self, n: Node) -> None:
        """Count one lookup of ``n`` (a readdirplus entry the kernel accepted)."""
        n.nlookup += 1

    def release_unused(self, n: Node) -> None:
        """Drop ``n`` from memory if nothing refers to it (an entry readdir made but the
        kernel did not take)."""
        self._maybe_forget(n)

    def forget(self, ino: int, count: int) -> None:
        """Lower ``ino``'s lookup count by ``count``; free or drop it when unused."""
        n = self.nodes.get(ino)
        if n is None:
            return
        n.nlookup = max(0, n.nlookup - count)
        self._maybe_forget(n)

    def _maybe_forget(self, n: Node) -> None:
        if n.nlookup > 0 or n.nopen > 0 or n.ino == ROOT_INO:
            return
        if self.nodes.get(n.ino) is not n:
            return
        self.inode_handles.pop(-n.ino, None)
        self.inode_dirs.pop(n.ino, None)
        if not n.upper:
            del self.nodes[n.ino]
            self._drop_inline(n)
            self._undetach(n.ino)
            return
        if n.nlink > 0:
            return
        # Unlinked and unused: free it. Its row goes in the next commit; its data file
        # only after that commit (see the crash table in upper.py).
        del self.nodes[n.ino]
        self._drop_inline(n)
        self._undetach(n.ino)
        if n.origin is not None and self.by_origin.get(n.origin) == n.ino:
            del self.by_origin[n.origin]
        self._close_fd(n)
        self._changed(n.ino)
        self._dirty_xattr.discard(n.ino)
        self._dirty_data.discard(n.ino)
        if n.has_data and self.upper is not None:
            path = self.upper.data_path(n.ino)
            self._unlink_after.append(path)
            self.pending_bytes += ITEM_BYTES + len(path)

    # -- detached inodes -------------------------------------------------------------------

    def _undetach(self, ino: int) -> None:
        """``ino`` left memory: it no longer holds a lower."""
        self.unlinked.discard(ino)
        if self.held.pop(ino, None) is not None:
            self._held_changed = True

    def detach(self, n: Node) -> None:
        """No name reaches ``n`` any more (a restore removed or replaced its path)."""
        if n.nlink > 0:
            n.nlink = 0
            self._unreachable(n)
        n.origin = None
        n.nlink = 0
        n.lower_links = 0
        if n.kind is Kind.DIR:
            # Nothing of either tree shows through a removed directory: a process whose cwd
            # it is finds nothing there (ENOENT), as in a directory removed under it.
            n.lower_tree = None
            n.entries = {}
        self.unlinked.add(n.ino)
        self._maybe_forget(n)

    def readers_of_lower(self) -> list[Node]:
        """Detached files that read chunks of the current lower and hold no older one: they
        must hold it before the lower changes (checkpoint, restore)."""
        out = []
        for ino in self.unlinked:
            n = self.nodes.get(ino)
            if (n is not None and ino not in self.held and n.kind is Kind.FILE
                    and n.lower_len > 0 and len(n.present) < len(n.lower_chunks)):
                out.append(n)
        return out

    def hold(self, nodes: list[Node], ref: str) -> None:
        """Record that ``nodes`` (detached files) read chunks of the lower ``ref``."""
        for n in nodes:
            if self.nodes.get(n.ino) is n:
                self.held[n.ino] = ref
                self._held_changed = True
                self.pending_bytes += len(ref) + 1

    def held_lowers(self) -> list[str]:
        """Ref texts of the older lowers detached files still read, sorted."""
        return sorted(set(self.held.values()))

    # -- quotas ----------------------------------------------------------------------------

    def recount(self, nodes: Iterator[Node] | list[Node] | None = None) -> None:
        """Count ``used_bytes`` and ``used_inodes`` again from ``nodes`` (every node if None):
        after loading, and after a checkpoint or restore changed which nodes have upper rows
        (only nodes that had one before can still have one, so those suffice)."""
        cs = self.cs
        nb = ni = 0
        seen: set[int] = set()
        for n in (self.nodes.values() if nodes is None else nodes):
            if n.ino == ROOT_INO and n.ino not in seen:
                seen.add(n.ino)
                nb += held_bytes(n, cs)  # its xattrs; the root's row is no inode of the cap
                continue
            if not n.upper or n.ino in seen or \
                    self.nodes.get(n.ino) is not n or (n.nlink == 0 and n.nopen == 0):
                continue  # (an unreachable inode no longer counts, see ``_unreachable``)
            seen.add(n.ino)
            ni += 1
            nb += held_bytes(n, cs)
        self.used_bytes, self.used_inodes = nb, ni

    def quota(self) -> dict[str, int | None]:
        """Use against the caps: ``bytes_used``, ``bytes_cap``, ``inodes_used``,
        ``inodes_cap`` (a cap None: none)."""
        return {"bytes_used": self.used_bytes, "bytes_cap": self.quota_bytes,
                "inodes_used": self.used_inodes, "inodes_cap": self.quota_inodes}

    def _room(self, n: Node, end: int) -> int:
        """How many of the bytes up to ``end`` past what ``n`` holds fit under the byte cap
        (the whole growth if there is no cap); EDQUOT when none does."""
        grow = end - max(n.size, n.lower_len)
        cap = self.quota_bytes
        if cap is None or grow <= 0:
            return grow
        room = cap - self.used_bytes
        if room <= 0:
            raise _err(errno.EDQUOT, "the session's byte quota is used up")
        return min(grow, room)

    # -- changes: helpers ----------------------------------------------------------------

    def _mut(self) -> None:
        if self.upper is None:
            raise _err(errno.EROFS)

    def _grow(self) -> None:
        """``_mut`` for a change that adds to the upper: refused with ENOSPC while the
        state directory's disk is short (``Upper.has_room``), so that on a full disk only
        removals (unlink, rmdir, truncate down) are acknowledged and what waits in memory
        for the disk stays small."""
        if self.upper is None:
            raise _err(errno.EROFS)
        if not self.upper.has_room():
            raise _err(errno.ENOSPC, "the state directory's disk is full")

    def _copy_up(self, n: Node) -> None:
        """Give ``n`` an upper row (metadata only; data is copied per chunk on write), and
        its ancestor directories too, up to the first that has one (``[closure]``): a
        checkpoint then only descends into directories with a row."""
        if not n.upper:
            self._mut()
            self._row(n)
            # A detached inode is in no directory: no ancestor to give a row ([closure]
            # holds for linked inodes only).
            p = self.nodes.get(n.parent) if n.nlink > 0 else None
            while p is not None and not p.upper:
                self._row(p)
                self._changed(p.ino)
                p = self.nodes.get(p.parent)
        self._changed(n.ino)

    def _row(self, n: Node) -> None:
        if not n.upper:
            if n.ino != ROOT_INO:
                self.used_inodes += 1
            self.used_bytes += xattr_bytes(n)  # copied up with the row
        n.upper = True
        if n.kind is Kind.DIR and n.entries is None:
            n.entries = {}
        if n.kind is Kind.FILE:
            self._drop_inline(n)  # content from lower (inline left by a rebase is stale)
            if not n.lower_len and not n.has_data:
                self._go_inline(n)
        if n.origin is not None:
            self.by_origin[n.origin] = n.ino
        if n.xattrs:
            self._changed_xattrs(n.ino)

    @staticmethod
    def _check_length(name: bytes) -> None:
        """ENAMETOOLONG for a component over NAME_MAX bytes (before any ENOENT)."""
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG, name)

    @staticmethod
    def _check_name(name: bytes) -> None:
        if len(name) > NAME_MAX:
            raise _err(errno.ENAMETOOLONG, name)
        if not name or b"/" in name or b"\0" in name or name in (b".", b".."):
            raise _err(errno.EINVAL, name)

    def _cookie(self) -> int:
        c = self.next_cookie
        self.next_cookie = c + 1
        return c

    def _changed(self, ino: int) -> None:
        """Inode ``ino`` changed (or went): its row goes in the next batch and the open
        step looks at it."""
        if ino not in self._dirty_ino:
            self._dirty_ino.add(ino)
            n = self.nodes.get(ino)
            self.pending_bytes += ROW_BYTES if n is None else row_bytes(n, self.cs)
        if self.step_inos is not None:
            self.step_inos.add(ino)

    def _changed_name(self, parent: int, name: bytes) -> None:
        """The dentry ``name`` of directory ``parent`` changed (``_changed``)."""
        if (parent, name) not in self._dirty_dent:
            self._dirty_dent.add((parent, name))
            self.pending_bytes += NAME_BYTES + len(name)
        if self.step_inos is not None:
            self.step_dents.add((parent, name))

    def _changed_xattrs(self, ino: int) -> None:
        """The extended attributes of inode ``ino`` changed (``_changed``): charged whole
        at every change, as they may have grown since the last one."""
        self._dirty_xattr.add(ino)
        n = self.nodes.get(ino)
        if n is not None:
            self.pending_bytes += XATTR_BYTES + xattr_bytes(n) + ITEM_BYTES * len(n.xattrs)
        if self.step_inos is not None:
            self.step_inos.add(ino)

    def _touch(self, n: Node, now: int) -> None:
        n.mtime_ns = n.ctime_ns = now
        self._changed(n.ino)

    def _set_name(self, d: Node, name: bytes, n: Node, now: int) -> None:
        """Make ``name`` in ``d`` an upper dentry for ``n`` (a fresh cookie)."""
        self._copy_up(d)
        ents = d.entries
        assert ents is not None
        ents.pop(name, None)
        ents[name] = (n.ino, self._cookie())
        self._changed_name(d.ino, name)
        self._touch(d, now)

    def _clear_name(self, d: Node, name: bytes, now: int) -> bool:
        """Remove the visible ``name`` from ``d``; return True if it came from lower."""
        self._copy_up(d)
        ents = d.entries
        assert ents is not None
        v = ents.pop(name, None)
        if self._lower_entry(d, name) is not None:
            ents[name] = (0, 0)
        self._changed_name(d.ino, name)
        self._touch(d, now)
        return v is None

    def _lose_name(self, n: Node, from_lower: bool, now: int) -> None:
        """``n`` lost one name (unlink, rmdir, replaced by rename)."""
        if n.kind is Kind.DIR:
            n.nlink = 0
        else:
            n.nlink -= 1
            if from_lower:
                n.lower_links -= 1
        n.ctime_ns = now
        if n.upper or n.nlink > 0:
            self._copy_up(n)
        if n.nlink == 0:
            self.unlinked.add(n.ino)
            self._unreachable(n)
        self._maybe_forget(n)

    def _unreachable(self, n: Node) -> None:
        """``n`` lost its last name: once no handle is open on it, nothing can reach its
        content again, so it stops counting against the quotas at once (its row and data
        file go when the kernel forgets it)."""
        if n.nopen == 0 and n.upper and n.ino != ROOT_INO:
            self.used_bytes -= held_bytes(n, self.cs)
            self.used_inodes -= 1

    def _new(self, d: Node, kind: Kind, mode: int, uid: int, gid: int, now: int) -> Node:
        ino = self.next_ino
        self.next_ino = ino + 1
        if d.mode & stat.S_ISGID:
            gid = d.gid
            if kind is Kind.DIR:
                mode |= stat.S_ISGID
        n = Node(ino, kind, mode, uid, gid, now)
        n.upper = True
        self.used_inodes += 1
        if kind is Kind.DIR:
            n.entries = {}
            n.parent = d.ino
        elif kind is Kind.FILE:
            self._go_inline(n)
        self.nodes[ino] = n
        self._changed(ino)
        return n

    def _make(self, parent: int, name: bytes, kind: Kind, mode: int, uid: int, gid: int,
              target: bytes = b"") -> Node:
        self._grow()
        if self.quota_inodes is not None and self.used_inodes >= self.quota_inodes:
            raise _err(errno.EDQUOT, "the session's inode quota is used up")
        d = self._dir(parent)
        self._check_name(name)
        if d.nlink == 0:
            raise _err(errno.ENOENT, "directory was removed")
        if self._exists(d, name):
            raise _err(errno.EEXIST, name)
        now = self.clock()
        n = self._new(d, kind, mode, uid, gid, now)
        if kind is Kind.SYMLINK:
            n.target = target
            n.size = len(target)
            self.pending_bytes += len(target)  # its row was charged without it
        self._set_name(d, name, n, now)
        if kind is Kind.DIR:
            d.nlink += 1
        n.nlookup += 1
        return n

    # -- namespace operations ----------------------------------------------------------

    def getattr(self, ino: int) -> Node:
        return self._node(ino)

    def blocks(self, n: Node) -> int:
        """``st_blocks`` of ``n``: the 512-byte units of data it holds, as a file system
        with holes counts them (tmpfs, ext4), not its logical size, in whole 4 KiB pages
        as tmpfs allocates them. Lower content counts the pages of its chunks that hold a
        non-zero byte (recorded per chunk when it was written, ``Lower.data_pages``; a
        chunk written elsewhere counts all its pages, a hole none), upper content what
        its data file allocates on the state directory's file system, inline content its
        data pages too. So a file shows the same count before and after a checkpoint, in a
        read-write and a read-only mount alike (except pages of zeros it wrote, which
        count as holes once checkpointed)."""
        if n.kind is not Kind.FILE:
            return 0
        page_blocks = chunker.PAGE_SIZE // 512
        if n.inline is not None and n.upper:
            # Counted again only after the content changed (``_write_inline`` and a
            # truncate say so; another buffer or length is another key): every reply
            # carries st_blocks, and scanning the content cost each of them O(size).
            buf = n.inline
            counted = (-1, id(buf), len(buf))
            if n.data_blocks_key != counted:
                n.data_blocks = chunker.data_pages(buf) * page_blocks
                n.data_blocks_key = counted
            return n.data_blocks
        blocks = 0
        if n.lower_len:
            known = self.lower.data_pages(cid for cid, _k in n.lower_chunks.runs())
            blocks = page_blocks * lower_pages(n.lower_chunks, n.lower_len, n.present,
                                               self.cs, known)
        if n.has_data and self.upper is not None:
            # Every reply carries st_blocks: the data file is stat'ed again only after a
            # change to it here (``_data_changed``) or to the node's size, times or lower
            # part, or once its descriptor closed (a file system may trim preallocation).
            key = (n.size, n.mtime_ns, n.ctime_ns, n.lower_len, len(n.present),
                   n.fd is None)
            if n.data_blocks_key != key:
                try:
                    st = (os.fstat(n.fd) if n.fd is not None
                          else os.stat(self.upper.data_path(n.ino)))
                except FileNotFoundError:
                    return blocks
                n.data_blocks, n.data_blocks_key = st.st_blocks, key
            blocks += n.data_blocks
        return blocks

    @staticmethod
    def _data_changed(n: Node) -> None:
        """The data file or the inline content of ``n`` was written or truncated:
        ``blocks`` counts it again."""
        n.data_blocks_key = None

    def readlink(self, ino: int) -> bytes:
        n = self._node(ino)
        if n.kind is not Kind.SYMLINK:
            raise _err(errno.EINVAL)
        return n.target

    def mknod(self, parent: int, name: bytes, mode: int, rdev: int, uid: int,
              gid: int) -> Node:
        """Create a fifo, socket, (``S_IFREG``) empty file, or block or character device.
        A device is metadata only (kind and ``rdev``), as on tmpfs; the mount is ``nodev``,
        so opening it through the mount fails (EACCES from the kernel). Whether the caller
        may make a device (CAP_MKNOD) is the kernel's check, before the request comes."""
        kind = _KIND_OF_FMT.get(stat.S_IFMT(mode))
        if kind is None:
            raise _err(errno.EINVAL)
        n = self._make(parent, name, kind, mode, uid, gid)
        if kind.is_device:
            n.rdev = rdev
        return n

    def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> Node:
        return self._make(parent, name, Kind.DIR, mode, uid, gid)

    def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        if len(target) > 4095:
            raise _err(errno.ENAMETOOLONG, "symlink target")
        return self._make(parent, name, Kind.SYMLINK, 0o777, uid, gid, target)

    def unlink(self, parent: int, name: bytes) -> None:
        self._mut()
        d = self._dir(parent)
        self._check_length(name)
        n = self._child(d, name)
        if n is None:
            raise _err(errno.ENOENT, name)
        if n.kind is Kind.DIR:
            raise _err(errno.EISDIR, name)
        now = self.clock()
        from_lower = self._clear_name(d, name, now)
        self._lose_name(n, from_lower, now)

    def _is_empty(self, d: Node) -> bool:
        ents = d.entries or {}
        whiteouts = 0
        for ino, _c in ents.values():
            if ino:
                return False
            whiteouts += 1
        t = d.lower_tree
        return t is None or len(self.lower.tree(t)) <= whiteouts

    def rmdir(self, parent: int, name: bytes) -> None:
        self._mut()
        d = self._dir(parent)
        if name == b".":
            raise _err(errno.EINVAL, name)
        self._check_length(name)
        n = self._child(d, name)
        if n is None:
            raise _err(errno.ENOENT, name)
        if n.kind is not Kind.DIR:
            raise _err(errno.ENOTDIR, name)
        if n.ino == ROOT_INO:
            raise _err(errno.EBUSY, name)
        if not self._is_empty(n):
            raise _err(errno.ENOTEMPTY, name)
        now = self.clock()
        self._clear_name(d, name, now)
        d.nlink -= 1
        self._lose_name(n, False, now)

    def _is_ancestor(self, a: Node, d: Node) -> bool:
        """True if directory ``a`` is ``d`` or one of its ancestors."""
        n: Node | None = d
        seen = 0
        while n is not None and seen < 1 << 16:
            if n is a:
                return True
            if n.ino == ROOT_INO:
                return False
            n = self.nodes.get(n.parent)
            seen += 1
        return False

    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes,
               flags: int = 0) -> None:
        """rename(2)/renameat2(2) with RENAME_NOREPLACE and RENAME_EXCHANGE. O(1) rows, also
        for a lower directory with any number of descendants."""
        self._grow()
        d1 = self._dir(parent_old)
        d2 = self._dir(parent_new)
        self._check_length(name_old)
        self._check_name(name_new)
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE) or (
                flags & RENAME_NOREPLACE and flags & RENAME_EXCHANGE):
            raise _err(errno.EINVAL)
        s = self._child(d1, name_old)
        if s is None:
            raise _err(errno.ENOENT, name_old)
        t = self._child(d2, name_new)
        if flags & RENAME_EXCHANGE:
            if t is None:
                raise _err(errno.ENOENT, name_new)
            if s is not t:
                self._check_boundary(s, d1, name_old, d2, name_new)
                self._check_boundary(t, d2, name_new, d1, name_old)
            self._exchange(d1, name_old, s, d2, name_new, t)
            return
        if t is not None and flags & RENAME_NOREPLACE:
            raise _err(errno.EEXIST, name_new)
        if d2.nlink == 0:
            raise _err(errno.ENOENT, "directory was removed")
        if s is t:
            return
        if s.kind is Kind.DIR:
            if self._is_ancestor(s, d2):
                raise _err(errno.EINVAL, "directory moved into itself")
            if t is not None:
                if t.kind is not Kind.DIR:
                    raise _err(errno.ENOTDIR, name_new)
                if not self._is_empty(t):
                    raise _err(errno.ENOTEMPTY, name_new)
        elif t is not None and t.kind is Kind.DIR:
            raise _err(errno.EISDIR, name_new)
        self._check_boundary(s, d1, name_old, d2, name_new)
        now = self.clock()
        self._copy_up(s)
        from_lower = self._clear_name(d1, name_old, now)
        if from_lower and s.kind is not Kind.DIR:
            s.lower_links -= 1
        if t is not None:
            t_lower = name_new not in (d2.entries or {})
            self._set_name(d2, name_new, s, now)
            if t.kind is Kind.DIR:
                d2.nlink -= 1
            self._lose_name(t, t_lower, now)
        else:
            self._set_name(d2, name_new, s, now)
        if s.kind is Kind.DIR:
            d1.nlink -= 1
            d2.nlink += 1
            s.parent = d2.ino
        s.ctime_ns = now

    def _exchange(self, d1: Node, n1: bytes, s: Node, d2: Node, n2: bytes, t: Node) -> None:
        if s is t:
            return
        if s.kind is Kind.DIR and self._is_ancestor(s, d2):
            raise _err(errno.EINVAL, "directory moved into itself")
        if t.kind is Kind.DIR and self._is_ancestor(t, d1):
            raise _err(errno.EINVAL, "directory moved into itself")
        now = self.clock()
        self._copy_up(s)
        self._copy_up(t)
        s_lower = n1 not in (d1.entries or {})
        t_lower = n2 not in (d2.entries or {})
        self._set_name(d1, n1, t, now)
        self._set_name(d2, n2, s, now)
        for n, was_lower in ((s, s_lower), (t, t_lower)):
            if was_lower and n.kind is not Kind.DIR:
                n.lower_links -= 1
            n.ctime_ns = now
        if d1 is not d2:
            if s.kind is Kind.DIR:
                d1.nlink -= 1
                d2.nlink += 1
                s.parent = d2.ino
            if t.kind is Kind.DIR:
                d2.nlink -= 1
                d1.nlink += 1
                t.parent = d1.ino

    def link(self, ino: int, parent: int, name: bytes) -> Node:
        """A new name ``name`` in ``parent`` for ``ino`` (also a lower file)."""
        self._grow()
        n = self._node(ino)
        d = self._dir(parent)
        self._check_name(name)
        if n.kind is Kind.DIR:
            raise _err(errno.EPERM, "hard link to a directory")
        if d.nlink == 0:
            raise _err(errno.ENOENT, "directory was removed")
        if n.nlink == 0:
            raise _err(errno.ENOENT, "inode was removed")
        if self._exists(d, name):
            raise _err(errno.EEXIST, name)
        if self.exclude is not None:
            side = self._side(d, name, False)
            if side is None or side != self._file_side(n):
                raise _err(errno.EXDEV, "hard link across the exclude boundary")
        now = self.clock()
        self._copy_up(n)
        self._set_name(d, name, n, now)
        n.nlink += 1
        n.ctime_ns = now
        n.nlookup += 1
        return n

    # -- attributes ----------------------------------------------------------------------

    def setattr(self, ino: int, *, mode: int | None = None, uid: int | None = None,
                gid: int | None = None, size: int | None = None,
                atime_ns: int | None = None, mtime_ns: int | None = None,
                ctime_ns: int | None = None, kill_suidgid: bool = False) -> Node:
        """chmod/chown/truncate/utimens; copies no data of a lower file (truncate down only
        shortens its lower range). ``kill_suidgid``: then clear S_ISUID, and S_ISGID if
        group-executable, as the truncate or chown of a writer without CAP_FSETID does
        (the kernel's verdict, FUSE_HANDLE_KILLPRIV_V2). Without that flag the kernel
        clears them itself, by sending the new mode here."""
        self._mut()
        n = self._node(ino)
        if not (size is not None and size <= n.size and mode is None and uid is None
                and gid is None):
            self._grow()  # a truncate down is a removal: it goes through on a full disk
        now = self.clock()
        if size is not None:
            if n.kind is Kind.DIR:
                raise _err(errno.EISDIR)
            if n.kind is not Kind.FILE:
                raise _err(errno.EINVAL)
            if size < 0:
                raise _err(errno.EINVAL)
            if size > MAX_FILE_SIZE:
                raise _err(errno.EFBIG)
        self._copy_up(n)
        if size is not None:
            if size > n.size and self._room(n, size) < size - max(n.size, n.lower_len):
                raise _err(errno.EDQUOT, "the session's byte quota")
            before = held_bytes(n, self.cs)
            try:
                self._truncate(n, size)
            finally:
                self.used_bytes += held_bytes(n, self.cs) - before
            n.mtime_ns = now
        if uid is not None or gid is not None:
            if uid is not None:
                n.uid = uid
            if gid is not None:
                n.gid = gid
        if mode is not None:
            n.mode = mode & 0o7777
        if atime_ns is not None:
            n.atime_ns = atime_ns
        if mtime_ns is not None:
            n.mtime_ns = mtime_ns
        if kill_suidgid:
            self._kill_suidgid(n)
        n.ctime_ns = now if ctime_ns is None else ctime_ns
        return n

    @staticmethod
    def _kill_suidgid(n: Node) -> None:
        """Clear S_ISUID, and S_ISGID if group-executable, of a non-directory (the caller
        gave it an upper row)."""
        if n.kind is Kind.DIR:
            return
        if n.mode & stat.S_ISGID and n.mode & stat.S_IXGRP:
            n.mode &= ~stat.S_ISGID
        n.mode &= ~stat.S_ISUID

    def _drop_inline(self, n: Node) -> None:
        if n.inline is not None:
            self.inline_bytes -= len(n.inline)
            n.inline = None

    def _go_inline(self, n: Node) -> None:
        """Keep the content of ``n`` (a file without lower content or data file) in its row,
        while the budget allows."""
        if self.inline_bytes < INLINE_BUDGET and n.size <= INLINE_MAX:
            n.inline = bytearray()

    def _truncate(self, n: Node, size: int) -> None:
        if n.inline is not None:
            if size < len(n.inline):
                self.inline_bytes -= len(n.inline) - size
                del n.inline[size:]
                self._data_changed(n)
            n.size = size
            return
        if size < n.size:
            if size < n.lower_len:
                n.lower_len = size
                keep = -(-size // self.cs)
                n.lower_chunks = n.lower_chunks[:keep]
                n.present = {i for i in n.present if i < keep}
            if n.has_data:
                fd = self._fd(n)
                assert fd is not None
                self._data_changed(n)
                if os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                self._close_idle_fd(n)
        n.size = size
        self._dirty_data.add(n.ino)
        if size == 0 and not n.has_data:
            self._go_inline(n)

    # -- xattrs --------------------------------------------------------------------------

    def xattr(self, ino: int, name: bytes) -> bytes | None:
        """The value of extended attribute ``name`` of ``ino``, or None if it has none
        (ENOENT for an unknown inode)."""
        return self._node(ino).xattrs.get(name)

    def getxattr(self, ino: int, name: bytes) -> bytes:
        v = self.xattr(ino, name)
        if v is None:
            raise _err(errno.ENODATA, name)
        return v

    def listxattr(self, ino: int) -> list[bytes]:
        return sorted(self._node(ino).xattrs)

    def setxattr(self, ino: int, name: bytes, value: bytes, flags: int = 0) -> None:
        """Only ``user.`` attributes are kept (others: ENOTSUP)."""
        self._grow()
        n = self._node(ino)
        if not name.startswith(b"user.") or len(name) <= 5:
            raise _err(errno.ENOTSUP, name)
        if len(name) > XATTR_NAME_MAX:
            raise _err(errno.ERANGE, name)
        if len(value) > XATTR_SIZE_MAX:
            raise _err(errno.E2BIG, name)
        if flags & XATTR_CREATE and name in n.xattrs:
            raise _err(errno.EEXIST, name)
        if flags & XATTR_REPLACE and name not in n.xattrs:
            raise _err(errno.ENODATA, name)
        self._copy_up(n)
        old = n.xattrs.get(name)
        grow = len(value) - (len(old) if old is not None else -len(name))
        if self.quota_bytes is not None and grow > 0 and \
                self.used_bytes + grow > self.quota_bytes:
            raise _err(errno.EDQUOT, "the session's byte quota")
        n.xattrs[name] = bytes(value)
        self.used_bytes += grow
        n.ctime_ns = self.clock()
        self._changed_xattrs(n.ino)

    def removexattr(self, ino: int, name: bytes) -> None:
        self._mut()
        n = self._node(ino)
        if name not in n.xattrs:
            raise _err(errno.ENODATA, name)
        self._copy_up(n)
        self.used_bytes -= len(name) + len(n.xattrs.pop(name))
        n.ctime_ns = self.clock()
        self._changed_xattrs(n.ino)

    # -- files ---------------------------------------------------------------------------

    def _fd(self, n: Node, create: bool = False) -> int | None:
        """The data file's descriptor (kept open while the node has handles)."""
        if n.fd is not None:
            return n.fd
        if not n.has_data and not create:
            return None
        assert self.upper is not None
        path = (self.upper.data_path_create(n.ino) if create
                else self.upper.data_path(n.ino))
        n.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        n.has_data = True
        return n.fd

    def _close_idle_fd(self, n: Node) -> None:
        if n.nopen == 0:
            self._close_fd(n)

    @staticmethod
    def _close_fd(n: Node) -> None:
        if n.fd is not None:
            os.close(n.fd)
            n.fd = None

    def create(self, parent: int, name: bytes, mode: int, flags: int, uid: int,
               gid: int) -> tuple[int, Node]:
        """open(2) with O_CREAT: a new file, or (without O_EXCL) the existing one."""
        d = self._dir(parent)
        n = self._child(d, name)
        if n is not None:
            if flags & os.O_EXCL:
                raise _err(errno.EEXIST, name)
            if n.kind is Kind.DIR:
                raise _err(errno.EISDIR, name)
            fh = self.open(n.ino, flags)
            n.nlookup += 1
            return fh, n
        n = self._make(parent, name, Kind.FILE, mode, uid, gid)
        return self._open(n, flags), n

    def open(self, ino: int, flags: int) -> int:
        """Open ``ino``; returns a file handle. O_TRUNC truncates (FUSE passes it here)."""
        n = self._node(ino)
        h_writable = flags & os.O_ACCMODE in (os.O_WRONLY, os.O_RDWR)
        if h_writable:
            self._mut()
            if n.kind is Kind.DIR:
                raise _err(errno.EISDIR)
        if flags & os.O_TRUNC and h_writable and n.kind is Kind.FILE:
            self.setattr(ino, size=0)
        return self._open(n, flags)

    def _open(self, n: Node, flags: int) -> int:
        fh = self._next_fh
        self._next_fh = fh + 1
        self.handles[fh] = Handle(n, flags)
        n.nopen += 1
        return fh

    def handle(self, fh: int) -> Handle:
        h = self.handles.get(fh) if fh > 0 else self.inode_handles.get(fh)
        if h is None:
            raise _err(errno.EBADF)
        return h

    def inode_fh(self, ino: int) -> int:
        """A handle number for I/O on ``ino`` without an open (no-open mode: the kernel
        checked the open's access mode, and the kernel's lookup of ``ino`` keeps the node
        in memory while a file is open). Negative; it is neither released nor counted
        among ``handles``. Raises ENOENT if ``ino`` is not in memory."""
        h = self.inode_handles.get(-ino)
        n = self._node(ino)
        if h is None or h.node is not n:
            self.inode_handles[-ino] = Handle(n, os.O_RDWR)
        return -ino

    def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is None:
            return
        n = h.node
        n.nopen -= 1
        if n.nopen == 0:
            self._close_fd(n)
            if n.nlink == 0:
                self._unreachable(n)
        self._maybe_forget(n)

    def lower_chunks_needed(self, fh: int, off: int, size: int) -> list[ObjectId]:
        """Lower chunks a read or write of ``[off, off+size)`` will need that are neither
        cached nor cheap: the adapter loads them in a worker thread first."""
        h = self.handles.get(fh) if fh > 0 else self.inode_handles.get(fh)
        if h is None or size <= 0:
            return []
        n = h.node
        end = min(off + size, max(n.lower_len, 0))
        if off >= end:
            return []
        out = []
        first = off // self.cs
        if first < len(n.lower_chunks) and not self.lower.located(n.lower_chunks[first]):
            # (slicing a chunk list costs O(LOCATE_AHEAD): only when it will be used)
            self.lower.locate_ahead(n.lower_chunks[first:first + LOCATE_AHEAD])
        for i in range(first, (end - 1) // self.cs + 1):
            if i not in n.present and i < len(n.lower_chunks):
                cid = n.lower_chunks[i]
                if self.lower.cached(cid) is None and not self.lower.is_small(cid):
                    out.append(cid)
        return out

    def read(self, fh: int, off: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``off``; short only at end of file; holes are zeros."""
        n = self.handle(fh).node
        if n.kind is not Kind.FILE:
            raise _err(errno.EINVAL)
        end = min(off + size, n.size)
        if off >= end:
            return b""
        if n.inline is not None and n.upper:
            data = bytes(n.inline[off:end])
            return data if len(data) == end - off else data + bytes(end - off - len(data))
        cs = self.cs
        if n.lower_len <= off or (not n.lower_chunks):
            return self._pread(n, off, end - off)
        parts = []
        pos = off
        while pos < end:
            i = pos // cs
            cend = min(end, (i + 1) * cs)
            if pos < n.lower_len and i not in n.present:
                lend = min(cend, n.lower_len)
                base = i * cs
                parts.append(self.lower.read(n.lower_chunks[i], pos - base, lend - base))
                if lend < cend:
                    parts.append(self._pread(n, lend, cend - lend))
            else:
                parts.append(self._pread(n, pos, cend - pos))
            pos = cend
        return b"".join(parts)

    def _pread(self, n: Node, off: int, size: int) -> bytes:
        fd = self._fd(n)
        if fd is None:
            return bytes(size)
        data = os.pread(fd, size, off)
        self._close_idle_fd(n)
        if len(data) < size:
            data += bytes(size - len(data))
        return data

    def write(self, fh: int, off: int, data: bytes, kill_suidgid: bool = False) -> int:
        """Write ``data`` at ``off`` (at the end with O_APPEND); returns the bytes written:
        all of them, except that a write straddling ``MAX_FILE_SIZE`` is cut short there,
        and one starting at or beyond it fails with EFBIG (as write(2) does at a file size
        limit), or fewer when the state directory's disk filled up (ENOSPC if none). The
        first write into a lower chunk copies that chunk up. ``kill_suidgid`` as for
        ``setattr`` (the writer lacks CAP_FSETID)."""
        h = self.handle(fh)
        if not h.writable:
            raise _err(errno.EBADF)
        self._grow()
        n = h.node
        if h.flags & os.O_APPEND:
            off = n.size
        if data and off >= MAX_FILE_SIZE:
            raise _err(errno.EFBIG)
        if off + len(data) > MAX_FILE_SIZE:
            data = data[:MAX_FILE_SIZE - off]
        end = off + len(data)
        if self.quota_bytes is not None and data:
            grow = end - max(n.size, n.lower_len)
            if grow > 0:
                fits = self._room(n, end)
                if fits < grow:  # cut short at the cap, as at a file size limit
                    data = data[:len(data) - (grow - fits)]
                    end = off + len(data)
            elif self.used_bytes >= self.quota_bytes and self._copies_up(n, off, end):
                raise _err(errno.EDQUOT, "the session's byte quota is used up")
        self._copy_up(n)
        if kill_suidgid:
            self._kill_suidgid(n)
        before = held_bytes(n, self.cs)
        try:
            return self._write(n, off, data, end)
        finally:
            self.used_bytes += held_bytes(n, self.cs) - before

    def _copies_up(self, n: Node, off: int, end: int) -> bool:
        """True if writing ``[off, end)`` copies a lower chunk of ``n`` into the upper."""
        top = min(end, n.lower_len)
        cs = self.cs
        return any(i not in n.present for i in range(off // cs, (top - 1) // cs + 1)) \
            if off < top else False

    def _write(self, n: Node, off: int, data: bytes, end: int) -> int:
        if n.inline is not None:
            if end <= INLINE_MAX:
                self._write_inline(n, off, data)
                return len(data)
            self._spill(n)
        fd = self._fd(n, create=True)
        assert fd is not None
        self._data_changed(n)
        cs = self.cs
        whole: list[int] = []  # lower chunks the write covers entirely: no copy needed
        if data and off < n.lower_len:
            for i in range(off // cs, (min(end, n.lower_len) - 1) // cs + 1):
                if i in n.present:
                    continue
                lo = i * cs
                hi = min((i + 1) * cs, n.lower_len)
                if off > lo or end < hi:
                    chunk = self.lower.chunk(n.lower_chunks[i])
                    _pwrite_all(fd, chunk[:hi - lo], lo)
                    n.present.add(i)
                else:
                    whole.append(i)
        done = 0
        error: OSError | None = None
        try:
            while done < len(data):  # a short pwrite means the disk is full: try the rest
                done += os.pwrite(fd, data[done:] if done else data, off + done)
        except OSError as e:
            error = e
        # A short write (POSIX allows one) acknowledges what reached the data file; the
        # writer gets the error when it retries the rest. A lower chunk is marked copied
        # up only once it is whole in the data file.
        for i in whole:
            lo = i * cs
            hi = min((i + 1) * cs, n.lower_len)
            if off + done >= hi:
                n.present.add(i)
            elif off + done > lo:
                try:
                    chunk = self.lower.chunk(n.lower_chunks[i])
                    _pwrite_all(fd, chunk[off + done - lo:hi - lo], off + done)
                    n.present.add(i)
                except OSError as e:
                    error = error or e
                    done = lo - off  # acknowledge up to the chunk only
                break
        if done == 0 and data:
            self._close_idle_fd(n)
            assert error is not None
            raise error
        end = off + done
        if end > n.size:
            n.size = end
        n.mtime_ns = n.ctime_ns = self.clock()
        self._close_idle_fd(n)
        self._dirty_data.add(n.ino)
        return done

    def _write_inline(self, n: Node, off: int, data: bytes) -> None:
        buf = n.inline
        assert buf is not None
        before = len(buf)
        if off > before:
            buf.extend(bytes(off - before))
        buf[off:off + len(data)] = data
        self.inline_bytes += len(buf) - before
        self.pending_bytes += max(0, len(buf) - before)  # the row was charged as it was
        self._data_changed(n)
        end = off + len(data)
        if end > n.size:
            n.size = end
        n.mtime_ns = n.ctime_ns = self.clock()

    def _spill(self, n: Node) -> None:
        """Move inline content to a data file (the file grew beyond ``INLINE_MAX``)."""
        buf = n.inline
        assert buf is not None
        had_data = n.has_data
        fd = self._fd(n, create=True)
        assert fd is not None
        self._data_changed(n)
        try:
            # Only a file left from before is cut: ext4 flushes a file truncated to 0 at
            # its next close (auto_da_alloc), even one that was empty already.
            if had_data or os.fstat(fd).st_size:
                os.ftruncate(fd, 0)
            if buf:
                _pwrite_all(fd, buf, 0)
        except OSError:
            if not had_data and self.upper is not None:  # keep it inline, as before
                self._close_fd(n)
                n.has_data = False
                try:
                    os.unlink(self.upper.data_path(n.ino))
                except FileNotFoundError:
                    pass
            raise
        self.inline_bytes -= len(buf)
        n.inline = None
        self._dirty_data.add(n.ino)

    def sync_fd(self, fh: int) -> int | None:
        """A new descriptor of ``fh``'s data file for fsync (the caller closes it), or None
        if the file has no data file."""
        n = self.handle(fh).node
        self._dirty_data.discard(n.ino)
        if not n.has_data or self.upper is None:
            return None
        return os.open(self.upper.data_path(n.ino), os.O_RDONLY | os.O_CLOEXEC)

    def take_unsynced(self) -> list[str]:
        """Paths of data files written since they were last synced (clears the list)."""
        if self.upper is None:
            return []
        out = [self.upper.data_path(i) for i in self._dirty_data
               if (n := self.nodes.get(i)) is not None and n.has_data]
        self._dirty_data.clear()
        return out

    # -- directories ---------------------------------------------------------------------

    def opendir(self, ino: int) -> int:
        d = self._dir(ino)
        fh = self._next_fh
        self._next_fh = fh + 1
        self.dirs[fh] = DirHandle(d)
        d.nopen += 1
        return fh

    def releasedir(self, fh: int) -> None:
        h = self.dirs.pop(fh, None)
        if h is not None:
            h.node.nopen -= 1
            self._maybe_forget(h.node)

    def readdir(self, fh: int, start: int) -> Iterator[tuple[bytes, Node, int]]:
        """Yield (name, node, cookie) from after cookie ``start`` (0: from the beginning).
        Entries that exist throughout a listing come exactly once. The caller counts a
        lookup (``remember``) for each entry it hands to the kernel, except "." and ".."."""
        h = self.dirs.get(fh)
        if h is None:
            raise _err(errno.EBADF)
        if start == 0:
            h.refresh()
        return self._list(h, start)

    def readdir_inode(self, ino: int, start: int) -> Iterator[tuple[bytes, Node, int]]:
        """``readdir`` of directory ``ino`` without a handle (no-open mode): the listing
        state is the directory's (``DirListings``) and every cookie carries its generation,
        so two listings of one directory never disturb each other. Raises ENOENT or
        ENOTDIR for an inode that is not a directory in memory."""
        d = self._dir(ino)
        ls = self.inode_dirs.get(ino)
        if ls is None or ls.node is not d:
            ls = self.inode_dirs[ino] = DirListings(d)
        gen, h = ls.at(start)
        tag = gen << GEN_SHIFT
        for name, n, cookie in self._list(h, start & ((1 << GEN_SHIFT) - 1)):
            yield name, n, tag | cookie

    def _list(self, h: DirHandle, start: int) -> Iterator[tuple[bytes, Node, int]]:
        d = h.node
        if d.nlink == 0:
            return
        if start < 1:
            yield b".", d, 1
        if start < 2:
            yield b"..", self.nodes.get(d.parent, d), 2
        # A checkpoint since the listing started moved the upper entries into a new lower
        # tree: go on through the trees and names the listing started with, each name as
        # it is now (so entries that exist throughout still come exactly once).
        folded = h.lower_tree != d.lower_tree
        if start < UPPER_BASE and h.lower_tree is not None:
            entries = self.lower.tree(h.lower_tree).entries
            listed_above = set(h.names) if folded else set()
            ahead = h.ahead
            pages_to = 0
            for i in range(max(0, start - 2), len(entries)):
                if i >= pages_to:
                    pages_to = i + PAGES_AHEAD
                    self._pages_ahead(entries[i:pages_to])
                e = entries[i]
                if folded:
                    if e.name in listed_above:
                        continue
                    now = self._child(d, e.name)
                    if now is not None:
                        yield e.name, now, i + 3
                    continue
                ents = d.entries
                if ents is not None and e.name in ents:
                    continue
                pre = ahead.pop(i, None) if ahead else None
                # made ahead for this very entry, and still the node in memory
                if pre is not None and pre[0] is e and self.nodes.get(pre[1].ino) is pre[1]:
                    yield e.name, pre[1], i + 3
                else:
                    yield e.name, self._lower_node(d, e.name, e), i + 3
        ents = d.entries
        if ents is None and not folded:
            return
        k = bisect_right(h.cookies, start - UPPER_BASE) if start >= UPPER_BASE else 0
        for j in range(k, len(h.cookies)):
            c = h.cookies[j]
            name = h.names[j]
            v = ents.get(name) if ents is not None else None
            if v is not None and v[1] == c and v[0] != 0:
                yield name, self.nodes[v[0]], UPPER_BASE + c
            elif folded and v is None:
                now = self._child(d, name)  # now in the new lower
                if now is not None:
                    yield name, now, UPPER_BASE + c

    def list_ahead(self, fh: int, ino: int, start: int, count: int) -> None:
        """Make now the nodes of the ``count`` lower entries a listing of directory ``ino``
        (by handle ``fh``, or by inode when ``fh`` is 0) reaches next from cookie
        ``start``, while the kernel takes in the part it was given; the READDIR from
        ``start`` then only hands them out. Nothing happens for a listing that is not in
        its lower entries any more or that a checkpoint changed underneath (``_list`` makes
        those as it goes); never raises for a listing that is gone."""
        if fh:
            h: DirHandle | None = self.dirs.get(fh)
        else:
            ls = self.inode_dirs.get(ino)
            h = None if ls is None else ls.gens.get(start >> GEN_SHIFT)
            start &= (1 << GEN_SHIFT) - 1
        if h is None or h.lower_tree is None or start >= UPPER_BASE:
            return
        d = h.node
        if d.nlink == 0 or h.lower_tree != d.lower_tree or self.nodes.get(d.ino) is not d:
            return
        entries = self.lower.tree(h.lower_tree).entries
        first = max(0, start - 2)
        todo = entries[first:first + count]
        if len(h.ahead) > 4 * count:  # left by listings that went elsewhere
            h.ahead = {}
        self._pages_ahead(todo)
        ents = d.entries
        ahead = h.ahead
        for i, e in enumerate(todo, first):
            if i not in ahead and (ents is None or e.name not in ents):
                ahead[i] = (e, self._lower_node(d, e.name, e))

    def _pages_ahead(self, entries: Sequence[Entry]) -> None:
        """Have the data pages of the chunks of ``entries``' files known (cached by
        ``Lower.data_pages``) before their attributes are given one by one."""
        self.lower.data_pages(cid for e in entries if e.kind is Kind.FILE and e.size
                              for cid, _k in e.chunks.runs())

    def statfs(self) -> dict[str, int]:
        """statvfs(3) figures: the state directory's file system, or none for read-only."""
        out = {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 0, "f_bfree": 0,
               "f_bavail": 0, "f_files": len(self.nodes), "f_ffree": 0, "f_favail": 0,
               "f_namemax": NAME_MAX}
        if self.upper is not None:
            st = os.statvfs(self.upper.state_dir)
            out.update(f_blocks=st.f_blocks * st.f_frsize // 4096,
                       f_bfree=st.f_bfree * st.f_frsize // 4096,
                       f_bavail=st.f_bavail * st.f_frsize // 4096,
                       f_files=st.f_files + len(self.nodes), f_ffree=st.f_ffree,
                       f_favail=st.f_favail)
        return out

    def access(self, ino: int, mode: int, uid: int, gids: set[int]) -> bool:
        """access(2) against the node's mode (the kernel does this itself under
        ``default_permissions``; kept for callers without it)."""
        n = self._node(ino)
        if mode & os.W_OK and self.readonly:
            return False
        if uid == 0:
            return not mode & os.X_OK or n.kind is Kind.DIR or bool(n.mode & 0o111)
        if uid == n.uid:
            bits = n.mode >> 6
        elif n.gid in gids:
            bits = n.mode >> 3
        else:
            bits = n.mode
        want = (4 if mode & os.R_OK else 0) | (2 if mode & os.W_OK else 0) | (
            1 if mode & os.X_OK else 0)
        return bits & want == want

    # -- persistence ---------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return bool(self._dirty_ino or self._dirty_dent or self._dirty_xattr
                    or self._unlink_after or self._held_changed)

    def change_bytes(self, ino: int, name: bytes | None = None) -> int:
        """An upper bound of what one change to inode ``ino`` (with ``name``: to the entry
        ``name`` of directory ``ino``) adds to ``pending_bytes``, besides inline content it
        writes and extended attributes it sets: ``CHANGE_BYTES`` and the rows of the
        inode (the one ``name`` names, and the directory) and of the directories above it
        up to the first with a row (copy-up marks them). O(depth of that copy-up)."""
        nodes = self.nodes
        b = CHANGE_BYTES
        n = nodes.get(ino)
        if n is not None and name is not None and n.kind is Kind.DIR:
            try:
                c = self._child(n, name)
            except (OSError, KeyError):
                c = None
            if c is not None:
                b += row_bytes(c, self.cs) + xattr_bytes(c) + ITEM_BYTES * len(c.xattrs)
        while n is not None:
            b += row_bytes(n, self.cs) + xattr_bytes(n) + ITEM_BYTES * len(n.xattrs)
            if n.upper or n.nlink == 0 or n.ino == ROOT_INO:
                break
            n = nodes.get(n.parent)
        return b

    def recharge(self) -> None:
        """Count ``pending_bytes`` again from what is marked (after a checkpoint kept some
        marks on rows it changed). O(marks)."""
        nodes = self.nodes
        b = BATCH_BYTES + len(" ".join(self.held_lowers()))
        for ino in self._dirty_ino:
            n = nodes.get(ino)
            b += ROW_BYTES if n is None else row_bytes(n, self.cs)
        b += sum(NAME_BYTES + len(name) for _, name in self._dirty_dent)
        for ino in self._dirty_xattr:
            if (n := nodes.get(ino)) is not None:
                b += XATTR_BYTES + xattr_bytes(n) + ITEM_BYTES * len(n.xattrs)
        self.pending_bytes = b + sum(ITEM_BYTES + len(p) for p in self._unlink_after)

    def collect(self) -> Batch:
        """Take the changes since the last batch, as rows (cheap; on the request thread)."""
        b = Batch()
        nodes = self.nodes
        for ino in self._dirty_ino:
            n = nodes.get(ino)
            if n is not None and n.upper:
                b.inodes.append(row_of(n))
            else:
                b.deleted.append(ino)
        for parent, name in self._dirty_dent:
            d = nodes.get(parent)
            v = d.entries.get(name) if d is not None and d.entries is not None else None
            if v is None:
                b.dentries_gone.append((parent, name))
            else:
                b.dentries.append((parent, name, v[0], v[1]))
        for ino in self._dirty_xattr:
            n = nodes.get(ino)
            if n is not None and n.upper:
                b.xattrs[ino] = sorted(n.xattrs.items())
        b.meta = {"next_ino": str(self.next_ino), "next_cookie": str(self.next_cookie),
                  "held_lowers": " ".join(self.held_lowers())}
        self.pending_bytes = BATCH_BYTES + len(b.meta["held_lowers"])  # the next batch's
        self._held_changed = False
        b.unlink_after = self._unlink_after
        self._unlink_after = []
        self._dirty_ino = set()
        self._dirty_dent = set()
        self._dirty_xattr = set()
        return b

    def commit(self, durable: bool = False) -> None:
        """Write the changes since the last batch (synchronously; the daemon instead runs
        ``collect`` here and ``Upper.write`` in a worker). ``durable`` first syncs every
        data file written since its last sync."""
        if self.upper is None:
            return
        if durable:
            sync_paths(self.take_unsynced(), self.upper.data_dir)
        self.upper.write(self.collect(), durable)

    def close(self) -> None:
        """Persist everything durably and close the upper (clean unmount)."""
        for fh in list(self.handles):
            self.release(fh)
        for fh in list(self.dirs):
            self.releasedir(fh)
        for n in list(self.nodes.values()):
            n.nlookup = 0
            self._maybe_forget(n)
        if self.upper is not None:
            try:
                self.commit(durable=True)
            finally:
                self.upper.close()


def row_bytes(n: Node, cs: int) -> int:
    """An upper bound of the spill payload of ``n``'s row (``row_of``) from now until its
    inline content grows (the overlay charges that growth) or its symlink target is set:
    the chunks it may still copy up are counted in its ``present`` bitmap already. O(1).
    ``cs``: the chunk size."""
    b = ROW_BYTES + len(n.target) + len(n.origin or b"") + len(n.lower_tree or b"")
    if n.inline is not None:
        b += len(n.inline)
    if n.lower_len:
        b += n.lower_chunks.run_count * (10 + DIGEST_SIZE) + -(-n.lower_len // cs) // 8 + 1
    return b


def row_of(n: Node) -> tuple[object, ...]:
    """The upper ``inodes`` row of ``n`` as it is in memory (``upper.ROW_COLUMNS``)."""
    return (n.ino, int(n.kind), n.mode, n.uid, n.gid, n.nlink, n.lower_links, n.size,
            n.atime_ns, n.mtime_ns, n.ctime_ns, n.parent if n.kind is Kind.DIR else 0,
            n.lower_tree if n.kind is Kind.DIR else None,
            encode_runs(n.lower_chunks) or None, n.lower_len, bitmap(n.present),
            n.target or None, n.origin,
            bytes(n.inline) if n.inline is not None else None, n.rdev or None)


def _pwrite_all(fd: int, data: bytes | bytearray, off: int) -> None:
    """pwrite(2) all of ``data`` at ``off`` (a short write continues; OSError when the
    rest cannot be written, e.g. ENOSPC)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:] if done else data, off + done)


def lower_pages(chunks: ChunkList, lower_len: int, present: set[int], cs: int,
                known: Mapping[bytes, int]) -> int:
    """4 KiB pages (``chunker.PAGE_SIZE``) of ``[0, lower_len)`` that hold data in lower
    chunks not copied up (not in ``present``): per chunk, its data pages as recorded in
    ``known`` (``Lower.data_pages``), else every page of it; a hole (a zero chunk) none.
    O(runs + present)."""
    slots = -(-lower_len // cs)
    full = chunker.zero_chunk_id(cs)
    last = slots - 1
    tail = lower_len - last * cs  # length of the last slot

    def pages(cid: bytes, ln: int) -> int:
        if cid == full or cid == chunker.zero_chunk_id(ln):
            return 0
        n = -(-ln // chunker.PAGE_SIZE)
        got = known.get(cid)
        return n if got is None else min(got, n)

    total = 0
    for first, k, cid in chunks.spans():
        if first >= slots:
            break
        k = min(k, slots - first)
        if cid == full:
            continue
        if first + k - 1 == last:
            total += (k - 1) * pages(cid, cs) + pages(cid, tail)
        else:
            total += k * pages(cid, cs)
    for i in present:
        if i < slots:
            total -= pages(chunks[i], tail if i == last else cs)
    return total


_SYNCFS_ABOVE = 8  # more unsynced files than this: one syncfs(2) beats one fsync each


def sync_path(path: str) -> None:
    """fdatasync the file at ``path`` (gone already: nothing to do)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def sync_paths(paths: list[str], any_dir: str) -> None:
    """Make the files at ``paths`` durable: each with fdatasync, or, when there are many,
    with one syncfs(2) of the file system holding ``any_dir``."""
    if len(paths) <= _SYNCFS_ABOVE:
        for p in paths:
            sync_path(p)
        return
    syncfs(any_dir)


def syncfs(path: str) -> None:
    """syncfs(2) of the file system holding directory ``path``, with the GIL released (a
    ctypes call), so that other threads run meanwhile. On a FUSE mount served by this
    process they must: with writes the kernel answers from its cache (the writeback cache,
    measured) syncfs waits for SETATTR and WRITE replies of the serving thread, and
    ``pyfuse3.syncfs``, which keeps the GIL, then deadlocks the daemon. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
