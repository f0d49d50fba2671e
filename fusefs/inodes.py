"""Inodes of the overlay: the in-memory ``Node`` and how inode numbers are chosen.

Inode numbers (CONTRACT 2.3) come from three places, in this order:

1. An inode with a row in the upper layer keeps the number stored there (``Node.upper``).
2. A pin (upper table ``pins``) maps a lower identity to a number chosen earlier; a
   checkpoint pins every upper inode it freezes, so its number and ctime survive the swap.
3. Otherwise the number is *derived* from the entry's identity (``origin_key``): bit 62 set,
   the low 62 bits from the blake3 of the identity. Nothing is stored, yet the same lower
   entry gets the same number on every mount, also if it was never looked up before.

Numbers allocated for inodes created in the mount (``allocated``) are below bit 62, so they
never meet a derived one. The root is always 1.

A lower identity is ``(parent inode, name, kind, content digest)``, or, for a member of a
hard-link group, ``(group id, content digest)`` so every name of the group is one inode.
Since a child's identity names its parent's *number* rather than its path, renaming a
directory moves its whole lower subtree with it and changes no child's number. A restore
that changes a file's content changes its digest, hence its number; an unchanged path
keeps it (CONTRACT 2.3). Two identities deriving the same 62 bits (about 2^-62 per pair)
are told apart in memory and the later one is salted.
"""

from __future__ import annotations

import stat

import blake3

from store.ref import ObjectId
from store.tree import EMPTY_CHUNKS, V1_REPEATS_MAX, ChunkList, Entry, Kind, encode_runs

ROOT_INO = 1
DERIVED_BIT = 1 << 62
_LOW62 = DERIVED_BIT - 1
_ZERO = bytes(32)


def content_digest(e: Entry) -> bytes:
    """32 bytes that change whenever the entry's content (not its metadata) changes."""
    if e.kind is Kind.FILE:
        cl = e.chunks
        if not e.size and not cl:  # the empty file: its digest, computed once below
            return _EMPTY_FILE
        if cl.repeats <= V1_REPEATS_MAX:  # every slot's id, as before chunk runs existed
            ids = cl.slot_bytes()
        else:  # cost follows the runs, not the slots
            ids = b"runs" + encode_runs(cl)
        return blake3.blake3(e.size.to_bytes(8, "little") + ids).digest()
    if e.kind is Kind.SYMLINK:
        return blake3.blake3(e.target).digest()
    return _ZERO


_EMPTY_FILE = blake3.blake3(bytes(8) + EMPTY_CHUNKS.slot_bytes()).digest()


def origin_key(parent: int, name: bytes, e: Entry) -> bytes:
    """The lower identity of entry ``e`` named ``name`` in directory inode ``parent``."""
    if e.link_group is not None and e.kind is not Kind.DIR:
        return b"g" + e.link_group + content_digest(e)
    return (b"p" + parent.to_bytes(8, "little") + bytes((int(e.kind),)) + content_digest(e)
            + name)


def derive_ino(origin: bytes, salt: int = 0) -> int:
    """The derived inode number of a lower identity (bit 62 set, never 0 or 1)."""
    h = blake3.blake3(origin + (salt.to_bytes(4, "little") if salt else b"")).digest(8)
    return DERIVED_BIT | (int.from_bytes(h, "little") & _LOW62)


def allocated(ino: int) -> bool:
    """True if ``ino`` was allocated by the upper layer's counter (not derived, not root)."""
    return 1 < ino < DERIVED_BIT


_new = object.__new__


class Node:
    """One inode as the overlay serves it; attributes in the units of ``struct stat``.

    ``kind`` is a ``store.tree.Kind``; ``mode`` holds the permission bits (07777) only.
    Times are ns since the epoch. Directories: ``lower_tree`` is the tree whose entries show
    through (None: opaque, nothing from lower), ``entries`` maps a name to ``(ino, cookie)``
    (ino 0 is a whiteout; None while the directory has no upper row), ``parent`` is the
    parent directory's number. Files: bytes ``[0, lower_len)`` come from ``lower_chunks``
    except chunks in ``present``, which live in the data file, as does everything beyond.
    A small file made in the mount keeps its content in ``inline`` instead (only while
    ``upper``; the rest up to ``size`` reads as zeros); it has then no lower content and no
    data file. ``lower_links`` counts the names of a non-directory still visible from lower.
    ``nlookup`` is the kernel's lookup count, ``nopen`` the open handles.
    """

    __slots__ = ("ino", "kind", "mode", "uid", "gid", "size", "atime_ns", "mtime_ns",
                 "ctime_ns", "nlink", "rdev", "target", "lower_chunks", "lower_len",
                 "present", "lower_tree", "entries", "parent", "lower_links", "xattrs",
                 "origin", "upper", "nlookup", "nopen", "fd", "has_data", "inline",
                 "data_blocks", "data_blocks_key")

    def __init__(self, ino: int, kind: Kind, mode: int, uid: int, gid: int,
                 time_ns: int) -> None:
        self.ino = ino
        self.kind = kind
        self.mode = mode & 0o7777
        self.uid = uid
        self.gid = gid
        self.size = 0
        self.atime_ns = self.mtime_ns = self.ctime_ns = time_ns
        self.nlink = 2 if kind is Kind.DIR else 1
        self.rdev = 0
        self.target = b""
        self.lower_chunks: ChunkList = EMPTY_CHUNKS
        self.lower_len = 0
        self.present: set[int] = set()
        self.lower_tree: ObjectId | None = None
        self.entries: dict[bytes, tuple[int, int]] | None = None
        self.parent = 0
        self.lower_links = 0
        self.xattrs: dict[bytes, bytes] = {}
        self.origin: bytes | None = None
        self.upper = False
        self.nlookup = 0
        self.nopen = 0
        self.fd: int | None = None
        self.has_data = False
        # st_blocks of the data file as last stat'ed (or of the inline content as last
        # counted), and the state it was taken in (``Overlay.blocks``); None: again.
        self.data_blocks = 0
        self.data_blocks_key: tuple[int, ...] | None = None
        self.inline: bytearray | None = None

    @classmethod
    def from_entry(cls, ino: int, e: Entry, origin: bytes | None, parent: int,
                   nlink: int, ctime_ns: int | None = None) -> Node:
        """A node serving lower entry ``e`` unchanged (no upper row). Every slot is set
        once, here, rather than by ``__init__`` and again: a listing of a huge lower
        directory makes one per entry."""
        n = _new(cls)
        kind = n.kind = e.kind
        n.ino = ino
        n.mode = e.mode
        n.uid = e.uid
        n.gid = e.gid
        n.atime_ns = n.mtime_ns = t = e.mtime_ns
        n.ctime_ns = t if ctime_ns is None else ctime_ns
        n.nlink = nlink
        n.parent = parent
        n.origin = origin
        n.xattrs = dict(e.xattrs) if e.xattrs else {}
        n.size = n.lower_len = n.lower_links = n.rdev = 0
        n.target = b""
        n.lower_chunks = EMPTY_CHUNKS
        n.lower_tree = None
        if kind is Kind.DIR:
            n.lower_tree = e.tree_id
        else:
            n.lower_links = nlink
            if kind is Kind.FILE:
                n.size = n.lower_len = e.size
                n.lower_chunks = e.chunks
            elif kind is Kind.SYMLINK:
                n.size = len(e.target)
                n.target = e.target
            elif kind.is_device:
                n.rdev = e.rdev
        n.present = set()
        n.entries = None
        n.upper = n.has_data = False
        n.nlookup = n.nopen = n.data_blocks = 0
        n.fd = n.data_blocks_key = n.inline = None
        return n

    @property
    def is_dir(self) -> bool:
        return self.kind is Kind.DIR

    @property
    def st_mode(self) -> int:
        return self.kind.s_ifmt | self.mode

    def __repr__(self) -> str:
        return (f"Node(ino={self.ino}, {stat.filemode(self.st_mode)}, nlink={self.nlink}, "
                f"size={self.size}, upper={self.upper})")
