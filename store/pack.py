"""Pack files: many compressed objects in one immutable blob, with a trailer index.

Layout of ``packs/<blake3 of the whole pack, hex>.pack``::

    b"RWP2" (b"RWP1")
    record*                 each record holds the plaintext of one object, or of a group of
                            small objects stored back to back (grouping lets zstd see many
                            small files at once): one zstd frame or raw bytes (codec 0, 1),
                            a framed chunk (codec 2) or a chunk in raw blocks (codec 3)
    index                   count x 54-byte rows, one per object:
                              id (32) | kind (u8) | record offset (u64) | record length (u32)
                              | codec (u8) | offset inside the record's plaintext (u32)
                              | plaintext length (u32)            all big-endian
    footer (48 bytes)       index offset (u64) | count (u32) | blake3(index)[:32] | b"RWPX"

Codec 0 is raw, 1 is zstd. The index row is exactly what the SQLite index stores per object,
so ``rebuild-index`` needs only the trailers. An object's bytes are verified against its id
on every read (``IntegrityError`` otherwise); the trailer is verified against its digest.

Codecs 2 and 3 appear in packs ``RWP2`` only (``RWP1`` packs hold codecs 0 and 1; code that
predates codec 2 refuses such rows as unknown instead of misreading them).

Codec 2, a framed chunk: a chunk of more than ``FRAME_SIZE`` plaintext bytes cut into frames
of ``FRAME_SIZE`` bytes (the last one shorter), each compressed on its own, so that a read of 4 KiB decompresses and verifies
one 64 KiB frame instead of the whole chunk::

    frame size (u32) | count (u32)             count = ceil(plaintext length / frame size)
    count x 37 bytes: stored length (u32) | codec (u8: 0 raw, 1 zstd) | tag (32)
    count frames, back to back

Codec 3, a chunk in raw blocks: a chunk above ``FRAME_SIZE`` bytes none of whose frames
zstd shrinks is stored uncompressed in blocks of ``BLOCK_SIZE`` (4 KiB, the last one
shorter), each after its tag, so that a 4 KiB read of incompressible data fetches and
hashes 4 KiB plus 32 bytes, in one range, with no table to look up first::

    per block: tag (32) | block plaintext

The tag of frame (block) ``i`` is the keyed blake3 (key: the chunk id) of ``offset (u64 BE)
|| its plaintext``, ``offset = i * frame (block) size``, so it verifies on its own, only at
its own place of its own chunk: a damaged frame, table or index row is an ``IntegrityError``,
never other bytes. The chunk id stays the blake3 of the whole plaintext (Refs and dedup do
not change), and reading a whole framed chunk still checks it against that id; ``verify``
also checks every tag, which is what ties a table to its chunk id (blake3's own tree
cannot be opened at frame boundaries through the binding's API).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import blake3
import zstandard

from .errors import IntegrityError
from .maker import maker
from .ref import ObjectId

PACK_MAGIC = b"RWP2"
FOOTER_MAGIC = b"RWPX"
_ROW = struct.Struct(">32sBQIBII")
_FOOTER = struct.Struct(">QI32s4s")
ROW_SIZE = _ROW.size
FOOTER_SIZE = _FOOTER.size
FRAME_SIZE = 64 << 10
BLOCK_SIZE = 4 << 10
TAG_SIZE = 32
_TABLE_HEAD = struct.Struct(">II")
_FRAME_ROW = struct.Struct(">IB32s")
_OFFSET = struct.Struct(">Q")


class ObjKind(IntEnum):
    CHUNK = 1
    TREE = 2


class Codec(IntEnum):
    RAW = 0
    ZSTD = 1
    FRAMED = 2
    BLOCKS = 3


def unit_size(codec: Codec) -> int | None:
    """Plaintext bytes per separately readable unit of a record of ``codec`` (a frame of
    codec 2, a block of codec 3); None for a record read whole."""
    return FRAME_SIZE if codec is Codec.FRAMED else BLOCK_SIZE if codec is Codec.BLOCKS \
        else None


@dataclass(frozen=True, slots=True)
class Location:
    """Where an object lives: its pack key, record and place inside the record's plaintext."""

    oid: ObjectId
    kind: ObjKind
    pack: str
    rec_offset: int
    rec_length: int
    codec: Codec
    inner_offset: int
    raw_length: int


# A Location with its fields set directly (store/maker.py): the writer makes one per object
# it packs, the catalog one per index row it reads.
make_location = maker(Location)


def pack_key(digest_hex: str) -> str:
    return f"packs/{digest_hex}.pack"


def parse_trailer(pack: str, tail: bytes, fetch: Callable[[int, int], bytes]) -> list[Location]:
    """Decode a pack's trailer index.

    ``tail`` holds at least the last FOOTER_SIZE bytes; ``fetch(offset, length)`` reads more
    of the pack. Raises IntegrityError if the footer or index is malformed.
    """
    if len(tail) < FOOTER_SIZE:
        raise IntegrityError(pack, "pack shorter than its footer")
    idx_off, count, digest, magic = _FOOTER.unpack(tail[-FOOTER_SIZE:])
    if magic != FOOTER_MAGIC:
        raise IntegrityError(pack, "bad pack footer magic")
    raw = fetch(idx_off, count * ROW_SIZE)
    if len(raw) != count * ROW_SIZE or blake3.blake3(raw).digest() != digest:
        raise IntegrityError(pack, "pack trailer index does not match its digest")
    out = []
    for i in range(count):
        oid, kind, off, length, codec, inner, rawlen = _ROW.unpack_from(raw, i * ROW_SIZE)
        try:
            out.append(Location(ObjectId(oid), ObjKind(kind), pack, off, length, Codec(codec),
                                inner, rawlen))
        except ValueError:
            raise IntegrityError(pack, f"bad kind or codec in trailer row {i}") from None
    return out


_DCTX = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor (an instance serves one call at a time; making one
    costs about 14 us, its decompression of a 64 KiB frame 2 us)."""
    d: zstandard.ZstdDecompressor | None = getattr(_DCTX, "d", None)
    if d is None:
        d = _DCTX.d = zstandard.ZstdDecompressor()
    return d


def decode_record(loc_pack: str, codec: Codec, data: bytes, raw_hint: int,
                  oid: ObjectId | None = None) -> bytes:
    """Return the plaintext of one record. Raises IntegrityError if it does not decompress.

    A framed chunk (codec 2) is decoded whole, frame by frame; with ``oid`` (its chunk id)
    every frame's tag is checked too. The caller checks the plaintext against its id."""
    if codec is Codec.BLOCKS:
        return b"".join(split_blocks(loc_pack, data, 0, oid))
    if codec is Codec.FRAMED:
        table = FrameTable.parse(loc_pack, data, len(data))
        parts = [decode_frame(loc_pack, table, i, data[o:o + n], oid)
                 for i, (o, n) in enumerate(table.spans())]
        return b"".join(parts)
    if codec is Codec.RAW:
        return data
    try:
        return _decompressor().decompress(data, max_output_size=max(raw_hint, 1))
    except zstandard.ZstdError as e:
        raise IntegrityError(loc_pack, f"record does not decompress: {e}") from None


def frame_tag(oid: ObjectId, offset: int, plain: bytes | memoryview) -> bytes:
    """The tag (32 bytes) of the frame or block of chunk ``oid`` at byte ``offset`` of its
    plaintext, holding ``plain``: keyed blake3 (key ``oid``) of the offset (8 bytes, big
    endian) followed by ``plain``.

    Hashed in one call over the joined bytes: fed as two updates (the 8 bytes, then
    ``plain``), the same tag took 5.2 us for a 4 KiB block instead of 2.4 us (a 64 KiB
    frame 15 us instead of 8.8 us), far more than the copy of ``plain`` costs."""
    return blake3.blake3(_OFFSET.pack(offset) + plain, key=oid).digest()


def blocks_length(raw_length: int) -> int:
    """Record length of a codec 3 chunk of ``raw_length`` plaintext bytes."""
    return raw_length + -(-raw_length // BLOCK_SIZE) * TAG_SIZE


def split_blocks(what: str, data: bytes, first: int, oid: ObjectId | None
                 ) -> list[memoryview]:
    """The block plaintexts in ``data`` (views into it): bytes of a codec 3 record starting
    at block ``first``, each checked against its tag when ``oid`` (the chunk id) is given.
    Raises IntegrityError for a damaged block or a short one before the end."""
    view = memoryview(data)
    step = TAG_SIZE + BLOCK_SIZE
    out = [view[pos + TAG_SIZE:pos + step] for pos in range(0, len(data), step)]
    if out and not len(out[-1]):
        raise IntegrityError(what, f"block {first + len(out) - 1} is truncated")
    if oid is not None:
        for k, plain in enumerate(out):
            pos = k * step
            if frame_tag(oid, (first + k) * BLOCK_SIZE, plain) != view[pos:pos + TAG_SIZE]:
                raise IntegrityError(what, f"block {first + k} does not match its tag")
    return out


def frame_count(raw_length: int) -> int:
    """Number of frames of a framed chunk of ``raw_length`` plaintext bytes."""
    return -(-raw_length // FRAME_SIZE)


def table_length(raw_length: int) -> int:
    """Bytes of the frame table at the start of a framed chunk's record."""
    return _TABLE_HEAD.size + frame_count(raw_length) * _FRAME_ROW.size


@dataclass(frozen=True, slots=True)
class FrameTable:
    """The decoded frame table of one framed chunk: per frame, where it starts in the
    record (bytes), its stored length, codec and tag."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    codecs: tuple[Codec, ...]
    tags: tuple[bytes, ...]

    @staticmethod
    def parse(what: str, head: bytes, rec_length: int, raw_length: int | None = None
              ) -> FrameTable:
        """Decode the table at the start of ``head`` (the record, or at least its table) of
        a record of ``rec_length`` bytes. ``raw_length``, if known (the index row), must
        match the frame count. Raises IntegrityError for a malformed table."""
        if len(head) < _TABLE_HEAD.size:
            raise IntegrityError(what, "framed chunk shorter than its frame table")
        size, count = _TABLE_HEAD.unpack_from(head)
        tlen = _TABLE_HEAD.size + count * _FRAME_ROW.size
        if (size != FRAME_SIZE or not count or len(head) < tlen
                or (raw_length is not None and count != frame_count(raw_length))):
            raise IntegrityError(what, "malformed frame table")
        offsets, lengths, codecs, tags = [], [], [], []
        pos = tlen
        for i in range(count):
            n, codec, tag = _FRAME_ROW.unpack_from(head, _TABLE_HEAD.size + i * _FRAME_ROW.size)
            if codec not in (Codec.RAW, Codec.ZSTD) or not n:
                raise IntegrityError(what, f"malformed frame table (frame {i})")
            offsets.append(pos)
            lengths.append(n)
            codecs.append(Codec(codec))
            tags.append(tag)
            pos += n
        if pos != rec_length:
            raise IntegrityError(what, "frame table does not match the record's length")
        return FrameTable(tuple(offsets), tuple(lengths), tuple(codecs), tuple(tags))

    def spans(self) -> list[tuple[int, int]]:
        """``(offset in the record, stored length)`` of every frame."""
        return list(zip(self.offsets, self.lengths, strict=True))


def decode_frame(what: str, table: FrameTable, index: int, stored: bytes,
                 oid: ObjectId | None) -> bytes:
    """The plaintext of frame ``index`` from its ``stored`` bytes; checked against its tag
    when ``oid`` (the chunk id) is given. Raises IntegrityError."""
    if table.codecs[index] is Codec.RAW:
        plain = stored
    else:
        try:
            plain = _decompressor().decompress(stored, max_output_size=FRAME_SIZE)
        except zstandard.ZstdError as e:
            raise IntegrityError(what, f"frame {index} does not decompress: {e}") from None
    if len(plain) > FRAME_SIZE or (oid is not None
                                   and frame_tag(oid, index * FRAME_SIZE,
                                                 plain) != table.tags[index]):
        raise IntegrityError(what, f"frame {index} does not match its tag")
    return plain


def encode_plain(data: bytes, cctx: zstandard.ZstdCompressor) -> tuple[Codec, bytes]:
    """A record of one zstd frame, or raw bytes when zstd does not shrink ``data``."""
    z = cctx.compress(data)
    return (Codec.ZSTD, z) if len(z) < len(data) else (Codec.RAW, data)


def encode_chunk(oid: ObjectId, data: bytes, cctx: zstandard.ZstdCompressor
                 ) -> tuple[Codec, bytes]:
    """The record of chunk ``oid``: above ``FRAME_SIZE`` bytes framed (codec 2), or in raw
    blocks (codec 3) when zstd shrinks none of its frames; else as ``encode_plain``."""
    if len(data) <= FRAME_SIZE:
        return encode_plain(data, cctx)
    view = memoryview(data)
    rows, bodies = [], []
    shrunk = False
    for off in range(0, len(data), FRAME_SIZE):
        plain = view[off:off + FRAME_SIZE]
        z = cctx.compress(plain)
        codec, body = (Codec.ZSTD, z) if len(z) < len(plain) else (Codec.RAW, bytes(plain))
        shrunk = shrunk or codec is Codec.ZSTD
        rows.append(_FRAME_ROW.pack(len(body), codec, frame_tag(oid, off, plain)))
        bodies.append(body)
    if not shrunk:
        parts: list[bytes | memoryview] = []
        for off in range(0, len(data), BLOCK_SIZE):
            plain = view[off:off + BLOCK_SIZE]
            parts += [frame_tag(oid, off, plain), plain]
        return Codec.BLOCKS, b"".join(parts)
    return Codec.FRAMED, b"".join([_TABLE_HEAD.pack(FRAME_SIZE, len(rows)), *rows, *bodies])


class PackBuilder:
    """Accumulates objects into records and records into packs of about ``target`` bytes.

    Objects below ``group_threshold`` bytes are grouped into one record of up to
    ``group_size`` plaintext bytes; larger ones get a record each. ``emit(key, data, rows)``
    is called for every finished pack; the caller puts it and indexes ``rows`` after its
    durable barrier. Not thread-safe; compression may be done by the caller beforehand.
    """

    def __init__(self, emit: Callable[[str, bytes, list[Location]], None], level: int = 3,
                 target: int = 32 << 20, group_threshold: int = 64 << 10,
                 group_size: int = 512 << 10) -> None:
        self._emit = emit
        self._level = level
        self._cctx = zstandard.ZstdCompressor(level=level)
        self._target = target
        self._group_threshold = group_threshold
        self._group_size = group_size
        self._buf = bytearray(PACK_MAGIC)
        self._rows: list[tuple[ObjectId, ObjKind, int, int, Codec, int, int]] = []
        self._group: list[tuple[ObjectId, ObjKind, bytes]] = []
        self._group_len = 0

    def add(self, oid: ObjectId, kind: ObjKind, data: bytes,
            encoded: tuple[Codec, bytes] | None = None) -> None:
        """Add one object's plaintext. ``encoded`` may carry its record made elsewhere
        (``encode_chunk``, e.g. in a worker thread)."""
        if len(data) < self._group_threshold and encoded is None:
            self._group.append((oid, kind, data))
            self._group_len += len(data)
            if self._group_len >= self._group_size:
                self._flush_group()
            return
        if encoded is None:
            encoded = (encode_chunk(oid, data, self._cctx) if kind is ObjKind.CHUNK
                       else encode_plain(data, self._cctx))
        self._add_record([(oid, kind, len(data))], *encoded)

    def _flush_group(self) -> None:
        if not self._group:
            return
        plain = b"".join(d for _, _, d in self._group)
        members = [(oid, kind, len(d)) for oid, kind, d in self._group]
        self._group = []
        self._group_len = 0
        self._add_record(members, *encode_plain(plain, self._cctx))

    def _add_record(self, members: list[tuple[ObjectId, ObjKind, int]], codec: Codec,
                    body: bytes) -> None:
        off = len(self._buf)
        self._buf += body
        inner = 0
        for oid, kind, n in members:
            self._rows.append((oid, kind, off, len(body), codec, inner, n))
            inner += n
        if len(self._buf) >= self._target:
            self._finish_pack()

    def _finish_pack(self) -> None:
        if not self._rows:
            return
        idx = b"".join(_ROW.pack(*r) for r in self._rows)
        idx_off = len(self._buf)
        self._buf += idx
        self._buf += _FOOTER.pack(idx_off, len(self._rows), blake3.blake3(idx).digest(),
                                  FOOTER_MAGIC)
        data = bytes(self._buf)
        key = pack_key(blake3.blake3(data).hexdigest())
        rows = [make_location(oid, kind, key, off, ln, codec, inner, n)
                for oid, kind, off, ln, codec, inner, n in self._rows]
        self._buf = bytearray(PACK_MAGIC)
        self._rows = []
        self._emit(key, data, rows)

    def flush(self) -> None:
        """Finish the open group and pack (if any) and emit it."""
        self._flush_group()
        self._finish_pack()
