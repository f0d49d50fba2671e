"""Trees: immutable directory objects and their canonical byte encoding.

A tree lists the entries of one directory, sorted bytewise by name. Its id is the blake3
digest of the encoding below; equal directories therefore have equal ids wherever and
whenever they are taken, and a Ref is the id of a root tree.

Canonical encoding (all integers are unsigned LEB128 varints unless noted). Two versions
share one layout and differ only in a file's ``content``::

    tree    := MAGIC count entry*            MAGIC = b"RWT1" (version 1) or b"RWT2"
                                             (version 2); count = number of entries
    entry   := name kind mode uid gid mtime size content xattrs link
    name    := len bytes                     1..255 bytes, no b"/" or NUL, not "." or ".."
    kind    := u8                            1 dir, 2 file, 3 symlink, 4 fifo, 5 socket,
                                             6 block device, 7 character device
    mode    := varint                        permission bits only (mode & 0o7777)
    mtime   := zigzag varint                 nanoseconds since the epoch, may be negative
    size    := varint                        file: bytes; symlink: target length; else 0
    content := dir:     32-byte tree id
               file:    version 1: varint n, then n 32-byte chunk ids, in file order; a
                        hole is a chunk id like any other (the id of a run of zeros)
                        version 2: varint r, then r runs (varint k >= 1, 32-byte id): the
                        id repeated k times; two adjacent runs never hold the same id
               symlink: len bytes            the target, verbatim
               block, char: varint rdev  the device number (``st_rdev``), verbatim
               fifo, socket: nothing
    xattrs  := varint n, then n (len name, len value) pairs sorted by name; names are user.*
    link    := u8 0                          not hard-linked
             | u8 1, 32-byte group id        a member of a hard-link group (any kind but a
                                             dir: files, symlinks, fifos, sockets, devices)

Which version: a tree is written in version 1 unless one of its files repeats chunk ids
more than ``V1_REPEATS_MAX`` times (the number of chunk slots beyond the first of each run
of equal ids, e.g. the holes of a large sparse file): then in version 2, whose size follows
the runs, not the slots. Both are a pure function of the entries, so equal trees give equal
ids; and every tree version 1 can hold is written exactly as before version 2 existed, so
its id (and a Ref naming it) is unchanged. A version 1 tree over the bound (written before
version 2 existed) still decodes and verifies; the same entries are now written in version
2, under another id.

Entries must be strictly increasing by name; the decoder rejects anything that would not
re-encode to the same bytes in its version, a version 2 tree that version 1 could hold
(``IntegrityError``), and names that could escape a directory (``ArchiveEntryError``). The hard-link group id is derived from the group's members (the
blake3 of their sorted root-relative paths), never from a counter, so unchanged subtrees
keep their ids.
"""

from __future__ import annotations

import stat
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import repeat
from typing import overload

from .errors import ArchiveEntryError, IntegrityError
from .maker import maker
from .ref import DIGEST_SIZE, ObjectId, object_id

MAGIC = b"RWT1"
MAGIC_V2 = b"RWT2"
V1_REPEATS_MAX = 1 << 16
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


class ChunkList(Sequence[ObjectId]):
    """The chunk ids of a file in file order (slot ``i`` holds bytes ``[i * chunk_size,
    (i + 1) * chunk_size)``), kept as runs of one id repeated, so that the holes of a sparse
    file cost one run, not one slot each. Immutable; equal lists have equal runs.

    Indexing is O(log runs); ``runs``, ``spans``, ``distinct`` and ``between`` are
    O(runs); iterating yields every slot (O(slots)): code that must stay cheap on sparse
    files uses the runs.
    """

    __slots__ = ("_ids", "_ends")

    _ids: tuple[ObjectId, ...]
    _ends: tuple[int, ...]  # _ends[j]: slots covered by runs 0..j

    def __init__(self, ids: Iterable[bytes] = ()) -> None:
        rids: list[ObjectId] = []
        ends: list[int] = []
        n = 0
        last = None
        for c in ids:
            n += 1
            if c == last:
                ends[-1] = n
            else:
                rids.append(ObjectId(bytes(c)))
                ends.append(n)
                last = c
        self._ids = tuple(rids)
        self._ends = tuple(ends)

    @classmethod
    def from_runs(cls, runs: Iterable[tuple[bytes, int]]) -> ChunkList:
        """The list of ``runs``, ``(id, k)``: the id repeated ``k >= 0`` times."""
        rids: list[ObjectId] = []
        ends: list[int] = []
        n = 0
        for cid, k in runs:
            if k < 0:
                raise ValueError("a run repeats an id a negative number of times")
            if not k:
                continue
            n += k
            if rids and rids[-1] == cid:
                ends[-1] = n
            else:
                rids.append(ObjectId(bytes(cid)))
                ends.append(n)
        out = cls.__new__(cls)
        out._ids = tuple(rids)
        out._ends = tuple(ends)
        return out

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, i: int) -> ObjectId: ...

    @overload
    def __getitem__(self, i: slice) -> ChunkList: ...

    def __getitem__(self, i: int | slice) -> ObjectId | ChunkList:
        n = len(self)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                return ChunkList(list(self)[i])
            return ChunkList.from_runs(self.between(start, stop))
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("chunk index out of range")
        return self._ids[bisect_right(self._ends, i)]

    def __iter__(self) -> Iterator[ObjectId]:
        for cid, k in self.runs():
            yield from repeat(cid, k)

    def __contains__(self, cid: object) -> bool:
        return cid in self._ids

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkList):
            return self._ends == other._ends and self._ids == other._ids
        if isinstance(other, (tuple, list)):
            return self == ChunkList(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self._ids, self._ends))

    def __repr__(self) -> str:
        return f"ChunkList({len(self)} slots in {len(self._ids)} runs)"

    @property
    def run_count(self) -> int:
        return len(self._ids)

    @property
    def repeats(self) -> int:
        """Slots beyond the first of each run: what version 1 spends and version 2 saves."""
        return len(self) - len(self._ids)

    def slot_bytes(self) -> bytes:
        """Every slot's id in file order, concatenated (32 bytes a slot); a list without
        repeated ids (most of them) is joined without walking its runs."""
        ends = self._ends
        if not ends:
            return b""
        if ends[-1] == len(ends):
            return b"".join(self._ids)
        return b"".join(c * k if k > 1 else c for c, k in self.runs())

    def runs(self) -> Iterator[tuple[ObjectId, int]]:
        """Yield ``(id, k)`` per run, in file order."""
        prev = 0
        for cid, end in zip(self._ids, self._ends, strict=True):
            yield cid, end - prev
            prev = end

    def spans(self) -> list[tuple[int, int, ObjectId]]:
        """``(first slot, k, id)`` per run, in file order."""
        ids, ends = self._ids, self._ends
        if len(ids) == 1:
            return [(0, ends[0], ids[0])]
        out = []
        prev = 0
        for cid, end in zip(ids, ends, strict=True):
            out.append((prev, end - prev, cid))
            prev = end
        return out

    def between(self, start: int, stop: int) -> Iterator[tuple[ObjectId, int]]:
        """Yield ``(id, k)`` runs covering slots ``[start, stop)`` (clipped to the list)."""
        stop = min(stop, len(self))
        if start >= stop:
            return
        j = bisect_right(self._ends, start)
        pos = start
        while pos < stop:
            end = min(self._ends[j], stop)
            yield self._ids[j], end - pos
            pos = end
            j += 1

    def distinct(self) -> set[ObjectId]:
        """The ids in the list, each once."""
        return set(self._ids)


EMPTY_CHUNKS = ChunkList()


def encode_runs(chunks: ChunkList) -> bytes:
    """The runs of ``chunks`` as bytes: per run a varint k, then the 32-byte id (the
    version 2 file content without its run count; b"" for an empty list)."""
    out = bytearray()
    for cid, k in chunks.runs():
        _put_varint(out, k)
        out += cid
    return bytes(out)


def decode_runs(data: bytes) -> ChunkList:
    """The inverse of ``encode_runs``; raises ValueError on malformed bytes."""
    buf = bytes(data)
    runs = []
    pos = 0
    try:
        while pos < len(buf):
            k, pos = _varint(buf, pos)
            cid, pos = _take(buf, pos, DIGEST_SIZE)
            if not k:
                raise _Malformed(pos, "empty run")
            runs.append((cid, k))
    except _Malformed as e:
        raise ValueError(f"malformed chunk runs at byte {e.pos}: {e.why}") from None
    return ChunkList.from_runs(runs)


@dataclass(frozen=True, slots=True)
class Entry:
    """One name in a tree.

    ``chunks`` holds the chunk ids of a file (a ``ChunkList``; any sequence of ids given is
    made one); ``tree_id`` the child tree of a dir;
    ``target`` the bytes of a symlink. ``xattrs`` is a tuple of (name, value) pairs sorted
    by name. ``link_group`` is the 32-byte group id of a hard-linked non-directory, else None.
    ``rdev`` is the device number of a block or character device (0 for other kinds).
    """

    name: bytes
    kind: Kind
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int = 0
    chunks: ChunkList = EMPTY_CHUNKS
    tree_id: ObjectId | None = None
    target: bytes = b""
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    link_group: bytes | None = None
    rdev: int = 0

    def __post_init__(self) -> None:
        if type(self.chunks) is not ChunkList:
            object.__setattr__(self, "chunks", ChunkList(self.chunks))

    @property
    def st_mode(self) -> int:
        return self.kind.s_ifmt | self.mode


@dataclass(frozen=True, slots=True)
class Tree:
    """A decoded tree: entries sorted by name, plus a name -> index map for lookups;
    ``version`` is the encoding it was decoded from."""

    entries: tuple[Entry, ...]
    version: int = field(default=1, compare=False)
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


def tree_version(entries: Iterable[Entry]) -> int:
    """The version ``entries`` are written in: 2 if a file repeats chunk ids more than
    ``V1_REPEATS_MAX`` times, else 1 (see the module docstring)."""
    for e in entries:
        if e.kind is Kind.FILE:
            cl = e.chunks
            if cl._ends and cl._ends[-1] - len(cl._ids) > V1_REPEATS_MAX:
                return 2
    return 1


def encode_tree(entries: list[Entry] | tuple[Entry, ...], version: int | None = None) -> bytes:
    """Return the canonical encoding of ``entries`` (sorted here; duplicate names raise),
    in ``version`` (1 or 2; None: ``tree_version(entries)``, the canonical one)."""
    ordered = sorted(entries, key=lambda e: e.name)
    if version is None:
        version = tree_version(ordered)
    if version not in (1, 2):
        raise ValueError(f"unknown tree version {version}")
    out = bytearray(MAGIC if version == 1 else MAGIC_V2)
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
            cl = e.chunks
            ids = cl._ids
            if version == 1:
                n = len(cl)
                _put_varint(out, n)
                if n == len(ids):  # no repeats (the usual file): every id once
                    out += b"".join(ids)
                else:
                    for c, reps in cl.runs():
                        out += c * reps
            else:
                _put_varint(out, e.chunks.run_count)
                for c, reps in e.chunks.runs():
                    _put_varint(out, reps)
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


# Entry's fields set directly (store/maker.py), for the decoder: a huge directory decodes
# an Entry per name. The decoder passes a ChunkList always, so ``__post_init__``'s
# conversion has nothing to do.
_make_entry = maker(Entry)


def decode_tree(data: bytes, tree_id: str = "tree") -> Tree:
    """Decode a canonical tree encoding.

    Raises IntegrityError for malformed or non-canonical bytes and ArchiveEntryError for a
    hostile name (``/``, NUL, ``.``, ``..``, empty, over 255 bytes).
    """
    try:
        buf = bytes(data)
        entries, by_name = _decode_entries(buf)
        version = 2 if buf[:len(MAGIC_V2)] == MAGIC_V2 else 1
        if version == 2 and tree_version(entries) == 1:
            raise _Malformed(0, "version 2 tree that version 1 holds (non-canonical)")
        return Tree(tuple(entries), version, by_name)
    except _Malformed as e:
        raise IntegrityError(tree_id, f"malformed tree at byte {e.pos}: {e.why}") from None


_ONE: dict[bytes, ChunkList] = {}  # one-chunk lists by id, shared (they are immutable)


def _one(cid: bytes) -> ChunkList:
    cl = _ONE.get(cid)
    if cl is None:
        if len(_ONE) > 1 << 16:
            _ONE.clear()
        # from_runs's result for ((cid, 1),), without its loop (a file's list is most
        # often one id the tree holds once)
        cl = ChunkList.__new__(ChunkList)
        cl._ids = (ObjectId(bytes(cid)),)
        cl._ends = (1,)
        _ONE[cl._ids[0]] = cl
    return cl


def _decode_entries(buf: bytes) -> tuple[list[Entry], dict[bytes, int]]:
    """The entries of a tree encoding and the index of each name (Tree's ``_by_name``)."""
    magic = buf[:len(MAGIC)]
    if magic != MAGIC and magic != MAGIC_V2:
        raise _Malformed(0, "bad magic" if len(buf) >= len(MAGIC) else "truncated")
    v2 = magic == MAGIC_V2
    ones = _ONE
    count, pos = _varint(buf, len(MAGIC))
    size_limit = len(buf)
    if count > size_limit:
        raise _Malformed(pos, "entry count larger than the object")
    entries: list[Entry] = []
    by_name: dict[bytes, int] = {}
    make = _make_entry
    prev = b""
    kinds = _KINDS
    # A one-byte varint (name lengths, most owners, sizes and counts) is read in line: a
    # call per field is most of the cost of decoding a huge directory.
    for _ in range(count):
        n = buf[pos] if pos < size_limit else 0x80
        if n < 0x80:
            pos += 1
        else:
            n, pos = _varint(buf, pos)
        end = pos + n
        if end > size_limit:
            raise _Malformed(pos, "truncated")
        name = buf[pos:end]
        pos = end
        # check_name's rules in line (a call per entry is a good part of a huge
        # directory's decoding); only a name failing them takes the call for its error
        if not 0 < n <= NAME_MAX or b"/" in name or b"\0" in name or name == b"." \
                or name == b"..":
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
        uid = buf[pos] if pos < size_limit else 0x80
        if uid < 0x80:
            pos += 1
        else:
            uid, pos = _varint(buf, pos)
        gid = buf[pos] if pos < size_limit else 0x80
        if gid < 0x80:
            pos += 1
        else:
            gid, pos = _varint(buf, pos)
        # the mtime is most of a tree's long varints: read in line
        zz = shift = 0
        while True:
            if pos >= size_limit:
                raise _Malformed(pos, "truncated varint")
            b = buf[pos]
            pos += 1
            zz |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
            if shift > 70:
                raise _Malformed(pos, "varint too long")
        if b == 0 and shift:
            raise _Malformed(pos, "non-canonical varint")
        mtime_ns = (zz >> 1) if not zz & 1 else -((zz + 1) >> 1)
        size = buf[pos] if pos < size_limit else 0x80
        if size < 0x80:
            pos += 1
        else:
            size, pos = _varint(buf, pos)
        chunks = EMPTY_CHUNKS
        tree_id_: ObjectId | None = None
        target = b""
        rdev = 0
        if kind is Kind.DIR:
            if size:
                raise _Malformed(pos, "dir with a size")
            raw, pos = _take(buf, pos, DIGEST_SIZE)
            tree_id_ = ObjectId(raw)
        elif kind is Kind.FILE and v2:
            n, pos = _varint(buf, pos)
            if n * DIGEST_SIZE > size_limit:
                raise _Malformed(pos, "run count larger than the object")
            runs = []
            prev_id = b""
            for _ in range(n):
                reps, pos = _varint(buf, pos)
                cid, pos = _take(buf, pos, DIGEST_SIZE)
                if not reps:
                    raise _Malformed(pos, "empty run")
                if cid == prev_id:
                    raise _Malformed(pos, "two adjacent runs of one id")
                prev_id = cid
                runs.append((cid, reps))
            if runs:
                chunks = _one(runs[0][0]) if n == 1 and runs[0][1] == 1 else \
                    ChunkList.from_runs(runs)
        elif kind is Kind.FILE:
            n, pos = _varint(buf, pos)
            if n * DIGEST_SIZE > size_limit:
                raise _Malformed(pos, "chunk count larger than the object")
            raw, pos = _take(buf, pos, n * DIGEST_SIZE)
            if n == 1:
                chunks = ones.get(raw) or _one(raw)
            elif n:
                chunks = ChunkList(raw[i:i + DIGEST_SIZE]
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
        nx = buf[pos] if pos < size_limit else 0x80
        if nx < 0x80:
            pos += 1
        else:
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
        by_name[name] = len(entries)
        entries.append(make(name, kind, mode, uid, gid, mtime_ns, size, chunks, tree_id_,
                            target, xattrs, group, rdev))
    if pos != size_limit:
        raise _Malformed(pos, "trailing bytes")
    return entries, by_name


EMPTY_TREE = encode_tree([])
EMPTY_TREE_ID = object_id(EMPTY_TREE)
