"""Pack files: many compressed objects in one immutable blob, with a trailer index.

Layout of ``packs/<blake3 of the whole pack, hex>.pack``::

    b"RWP1"
    record*                 each record is one compressed frame (or raw bytes) holding the
                            plaintext of one object, or of a group of small objects stored
                            back to back (grouping lets zstd see many small files at once)
    index                   count x 54-byte rows, one per object:
                              id (32) | kind (u8) | record offset (u64) | record length (u32)
                              | codec (u8) | offset inside the record's plaintext (u32)
                              | plaintext length (u32)            all big-endian
    footer (48 bytes)       index offset (u64) | count (u32) | blake3(index)[:32] | b"RWPX"

Codec 0 is raw, 1 is zstd. The index row is exactly what the SQLite index stores per object,
so ``rebuild-index`` needs only the trailers. An object's bytes are verified against its id
on every read (``IntegrityError`` otherwise); the trailer is verified against its digest.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import blake3
import zstandard

from .errors import IntegrityError
from .ref import ObjectId

PACK_MAGIC = b"RWP1"
FOOTER_MAGIC = b"RWPX"
_ROW = struct.Struct(">32sBQIBII")
_FOOTER = struct.Struct(">QI32s4s")
ROW_SIZE = _ROW.size
FOOTER_SIZE = _FOOTER.size


class ObjKind(IntEnum):
    CHUNK = 1
    TREE = 2


class Codec(IntEnum):
    RAW = 0
    ZSTD = 1


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


def decode_record(loc_pack: str, codec: Codec, data: bytes, raw_hint: int) -> bytes:
    """Return the plaintext of one record. Raises IntegrityError if it does not decompress."""
    if codec is Codec.RAW:
        return data
    try:
        return zstandard.ZstdDecompressor().decompress(data, max_output_size=max(raw_hint, 1))
    except zstandard.ZstdError as e:
        raise IntegrityError(loc_pack, f"record does not decompress: {e}") from None


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
            compressed: bytes | None = None) -> None:
        """Add one object's plaintext. ``compressed`` may carry a zstd frame made elsewhere."""
        if len(data) < self._group_threshold and compressed is None:
            self._group.append((oid, kind, data))
            self._group_len += len(data)
            if self._group_len >= self._group_size:
                self._flush_group()
            return
        if compressed is None:
            compressed = self._cctx.compress(data)
        self._add_record([(oid, kind, len(data))], data, compressed)

    def _flush_group(self) -> None:
        if not self._group:
            return
        plain = b"".join(d for _, _, d in self._group)
        members = [(oid, kind, len(d)) for oid, kind, d in self._group]
        self._group = []
        self._group_len = 0
        self._add_record(members, plain, self._cctx.compress(plain))

    def _add_record(self, members: list[tuple[ObjectId, ObjKind, int]], plain: bytes,
                    compressed: bytes) -> None:
        if len(compressed) < len(plain):
            codec, body = Codec.ZSTD, compressed
        else:
            codec, body = Codec.RAW, plain
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
        rows = [Location(oid, kind, key, off, ln, codec, inner, n)
                for oid, kind, off, ln, codec, inner, n in self._rows]
        self._buf = bytearray(PACK_MAGIC)
        self._rows = []
        self._emit(key, data, rows)

    def flush(self) -> None:
        """Finish the open group and pack (if any) and emit it."""
        self._flush_group()
        self._finish_pack()
