"""Trees: immutable directory objects and their canonical byte encoding.

A tree lists the entries of one directory, sorted bytewise by name. Its id is the blake3
digest of the encoding below; equal directories therefore have equal ids wherever and
whenever they are taken, and a Ref is the id of a root tree.

Canonical encoding (all integers are unsigned LEB128 varints unless noted)::

    tree    := MAGIC count entry*            MAGIC = b"RWT1", count = number of entries
    entry   := name kind mode uid gid mtime size content xattrs link
    name    := len bytes                     1..255 bytes, no b"/" or NUL, not "." or ".."
    kind    := u8                            1 dir, 2 file, 3 symlink, 4 fifo, 5 socket,
                                             6 block device, 7 character device
    mode    := varint                        permission bits only (mode & 0o7777)
    mtime   := zigzag varint                 nanoseconds since the epoch, may be negative
    size    := varint                        file: bytes; symlink: target length; else 0
    content := dir:     32-byte tree id
               file:    varint n, then n 32-byte chunk ids, in file order; a hole is a chunk
                        id like any other (the id of a run of zeros)
               symlink: len bytes            the target, verbatim
               block, char: varint rdev  the device number (``st_rdev``), verbatim
               fifo, socket: nothing
    xattrs  := varint n, then n (len name, len value) pairs sorted by name; names are user.*
    link    := u8 0                          not hard-linked
             | u8 1, 32-byte group id        a member of a hard-link group

Entries must be strictly increasing by name; the decoder rejects anything that would not
re-encode to the same bytes (``IntegrityError``), and names that could escape a directory
(``ArchiveEntryError``). The hard-link group id is derived from the group's members (the
blake3 of their sorted root-relative paths), never from a counter, so unchanged subtrees
keep their ids.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum

from .errors import ArchiveEntryError, IntegrityError
from .ref import DIGEST_SIZE, ObjectId, object_id

MAGIC = b"RWT1"
NAME_MAX = 255
PATH_MAX = 4096


class Kind(IntEnum):
    DIR = 1
    FILE = 2
    SYMLINK = 3
    FIFO = 4
    SOCKET = 5
    BLOCK = 6
    CHAR = 7

    @property
    def is_device(self) -> bool:
        return self in (Kind.BLOCK, Kind.CHAR)

    @property
    def s_ifmt(self) -> int:
        return _S_IFMT[self]


_S_IFMT = {
    Kind.DIR: stat.S_IFDIR,
    Kind.FILE: stat.S_IFREG,
    Kind.SYMLINK: stat.S_IFLNK,
    Kind.FIFO: stat.S_IFIFO,
    Kind.SOCKET: stat.S_IFSOCK,
    Kind.BLOCK: stat.S_IFBLK,
    Kind.CHAR: stat.S_IFCHR,
}


@dataclass(frozen=True, slots=True)
class Entry:
    """One name in a tree.

    ``chunks`` holds the chunk ids of a file; ``tree_id`` the child tree of a dir;
    ``target`` the bytes of a symlink. ``xattrs`` is a tuple of (name, value) pairs sorted
    by name. ``link_group`` is the 32-byte group id of a hard-linked file, else None.
    ``rdev`` is the device number of a block or character device (0 for other kinds).
    """

    name: bytes
    kind: Kind
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int = 0
    chunks: tuple[ObjectId, ...] = ()
    tree_id: ObjectId | None = None
    target: bytes = b""
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    link_group: bytes | None = None
    rdev: int = 0

    @property
    def st_mode(self) -> int:
        return self.kind.s_ifmt | self.mode


@dataclass(frozen=True, slots=True)
class Tree:
    """A decoded tree: entries sorted by name, plus a name -> index map for lookups."""

    entries: tuple[Entry, ...]
    _by_name: dict[bytes, int] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self._by_name:
            self._by_name.update((e.name, i) for i, e in enumerate(self.entries))

    def get(self, name: bytes) -> Entry | None:
        i = self._by_name.get(name)
        return None if i is None else self.entries[i]

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def check_name(name: bytes, where: str = "") -> None:
    """Raise ArchiveEntryError unless ``name`` is one safe path component."""
    shown = where or repr(name)
    if not isinstance(name, bytes):
        raise ArchiveEntryError(shown, "name is not bytes")
    if not name:
        raise ArchiveEntryError(shown, "empty name")
    if len(name) > NAME_MAX:
        raise ArchiveEntryError(shown, f"name is {len(name)} bytes, over {NAME_MAX}")
    if b"/" in name:
        raise ArchiveEntryError(shown, "name contains '/'")
    if b"\0" in name:
        raise ArchiveEntryError(shown, "name contains NUL")
    if name in (b".", b".."):
        raise ArchiveEntryError(shown, f"name is {name.decode()!r}")


def _put_varint(out: bytearray, n: int) -> None:
    if n < 0:
        raise ValueError("varint must be non-negative")
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return


def _zigzag(n: int) -> int:
    return (n << 1) if n >= 0 else ((-n) << 1) - 1


def _unzigzag(n: int) -> int:
    return (n >> 1) if not n & 1 else -((n + 1) >> 1)


def _put_bytes(out: bytearray, b: bytes) -> None:
    _put_varint(out, len(b))
    out += b


def encode_tree(entries: list[Entry] | tuple[Entry, ...]) -> bytes:
    """Return the canonical encoding of ``entries`` (sorted here; duplicate names raise)."""
    ordered = sorted(entries, key=lambda e: e.name)
    out = bytearray(MAGIC)
    _put_varint(out, len(ordered))
    prev: bytes | None = None
    for e in ordered:
        check_name(e.name)
        if prev is not None and e.name == prev:
            raise ArchiveEntryError(repr(e.name), "duplicate name")
        prev = e.name
        _put_bytes(out, e.name)
        out.append(int(e.kind))
        _put_varint(out, e.mode & 0o7777)
        _put_varint(out, e.uid)
        _put_varint(out, e.gid)
        _put_varint(out, _zigzag(e.mtime_ns))
        if e.kind is Kind.DIR:
            if e.tree_id is None or len(e.tree_id) != DIGEST_SIZE:
                raise ValueError("dir entry needs a tree id")
            _put_varint(out, 0)
            out += e.tree_id
        elif e.kind is Kind.FILE:
            _put_varint(out, e.size)
            _put_varint(out, len(e.chunks))
            for c in e.chunks:
                out += c
        elif e.kind is Kind.SYMLINK:
            _put_varint(out, len(e.target))
            _put_bytes(out, e.target)
        elif e.kind.is_device:
            _put_varint(out, 0)
            _put_varint(out, e.rdev)
        else:
            _put_varint(out, 0)
        xattrs = sorted(e.xattrs)
        _put_varint(out, len(xattrs))
        for k, v in xattrs:
            _put_bytes(out, k)
            _put_bytes(out, v)
        if e.link_group is None:
            out.append(0)
        else:
            out.append(1)
            out += e.link_group
    return bytes(out)


class _Malformed(Exception):
    """Raised inside the decoder; becomes IntegrityError with the tree's id."""

    def __init__(self, pos: int, why: str) -> None:
        self.pos = pos
        self.why = why


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``pos``; one and two bytes are the
    fast paths (names, modes, owners, small sizes)."""
    end = len(buf)
    if pos + 1 < end:
        b = buf[pos]
        if b < 0x80:
            return b, pos + 1
        c = buf[pos + 1]
        if 0 < c < 0x80:
            return (b & 0x7F) | (c << 7), pos + 2
    n = shift = 0
    while True:
        if pos >= end:
            raise _Malformed(pos, "truncated varint")
        b = buf[pos]
        pos += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0 and shift:
                raise _Malformed(pos, "non-canonical varint")
            return n, pos
        shift += 7
        if shift > 70:
            raise _Malformed(pos, "varint too long")


def _take(buf: bytes, pos: int, n: int) -> tuple[bytes, int]:
    """(``n`` bytes at ``pos``, position after them)."""
    end = pos + n
    if end > len(buf):
        raise _Malformed(pos, "truncated")
    return buf[pos:end], end


_KINDS = {int(k): k for k in Kind}


def decode_tree(data: bytes, tree_id: str = "tree") -> Tree:
    """Decode a canonical tree encoding.

    Raises IntegrityError for malformed or non-canonical bytes and ArchiveEntryError for a
    hostile name (``/``, NUL, ``.``, ``..``, empty, over 255 bytes).
    """
    try:
        return Tree(tuple(_decode_entries(bytes(data))))
    except _Malformed as e:
        raise IntegrityError(tree_id, f"malformed tree at byte {e.pos}: {e.why}") from None


def _decode_entries(buf: bytes) -> list[Entry]:
    if buf[:len(MAGIC)] != MAGIC:
        raise _Malformed(0, "bad magic" if len(buf) >= len(MAGIC) else "truncated")
    count, pos = _varint(buf, len(MAGIC))
    size_limit = len(buf)
    if count > size_limit:
        raise _Malformed(pos, "entry count larger than the object")
    entries: list[Entry] = []
    prev = b""
    kinds = _KINDS
    for _ in range(count):
        n, pos = _varint(buf, pos)
        name, pos = _take(buf, pos, n)
        check_name(name)
        if name <= prev:
            raise _Malformed(pos, "names not strictly increasing")
        prev = name
        if pos >= size_limit:
            raise _Malformed(pos, "truncated")
        kind = kinds.get(buf[pos])
        pos += 1
        if kind is None:
            raise _Malformed(pos, "unknown kind")
        mode, pos = _varint(buf, pos)
        if mode & ~0o7777:
            raise _Malformed(pos, "mode has bits outside 07777")
        uid, pos = _varint(buf, pos)
        gid, pos = _varint(buf, pos)
        zz, pos = _varint(buf, pos)
        mtime_ns = _unzigzag(zz)
        size, pos = _varint(buf, pos)
        chunks: tuple[ObjectId, ...] = ()
        tree_id_: ObjectId | None = None
        target = b""
        rdev = 0
        if kind is Kind.DIR:
            if size:
                raise _Malformed(pos, "dir with a size")
            raw, pos = _take(buf, pos, DIGEST_SIZE)
            tree_id_ = ObjectId(raw)
        elif kind is Kind.FILE:
            n, pos = _varint(buf, pos)
            if n * DIGEST_SIZE > size_limit:
                raise _Malformed(pos, "chunk count larger than the object")
            raw, pos = _take(buf, pos, n * DIGEST_SIZE)
            if n == 1:
                chunks = (ObjectId(raw),)
            elif n:
                chunks = tuple(ObjectId(raw[i:i + DIGEST_SIZE])
                               for i in range(0, len(raw), DIGEST_SIZE))
        elif kind is Kind.SYMLINK:
            n, pos = _varint(buf, pos)
            target, pos = _take(buf, pos, n)
            if len(target) != size:
                raise _Malformed(pos, "symlink size differs from its target length")
        elif size:
            raise _Malformed(pos, "special file with a size")
        elif kind is Kind.BLOCK or kind is Kind.CHAR:
            rdev, pos = _varint(buf, pos)
        nx, pos = _varint(buf, pos)
        xattrs: tuple[tuple[bytes, bytes], ...] = ()
        if nx:
            found = []
            prevx: bytes | None = None
            for _ in range(nx):
                n, pos = _varint(buf, pos)
                k, pos = _take(buf, pos, n)
                n, pos = _varint(buf, pos)
                v, pos = _take(buf, pos, n)
                if prevx is not None and k <= prevx:
                    raise _Malformed(pos, "xattrs not strictly increasing")
                prevx = k
                found.append((k, v))
            xattrs = tuple(found)
        if pos >= size_limit:
            raise _Malformed(pos, "truncated")
        flag = buf[pos]
        pos += 1
        group: bytes | None = None
        if flag == 1:
            group, pos = _take(buf, pos, DIGEST_SIZE)
        elif flag != 0:
            raise _Malformed(pos, "bad link flag")
        entries.append(Entry(name, kind, mode, uid, gid, mtime_ns, size, chunks, tree_id_,
                             target, xattrs, group, rdev))
    if pos != size_limit:
        raise _Malformed(pos, "trailing bytes")
    return entries


EMPTY_TREE = encode_tree([])
EMPTY_TREE_ID = object_id(EMPTY_TREE)
