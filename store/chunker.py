"""Fixed-size chunking of file content, and the zero chunk that stands for a hole.

A file of ``size`` bytes is cut into ``ceil(size / chunk_size)`` chunks; every chunk but the
last holds exactly ``chunk_size`` bytes (the store's chunk size). A chunk is addressed by the
blake3 of its plaintext, so a run of zeros, read from a hole of a sparse file or from real
zero bytes, always has the same id and is stored once. This module only does arithmetic and
hashing; it never reads files or touches the store.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

from .ref import ObjectId, object_id


def chunk_count(size: int, chunk_size: int) -> int:
    """Number of chunks of a file of ``size`` bytes (0 for an empty file)."""
    return -(-size // chunk_size)


def chunk_spans(size: int, chunk_size: int) -> Iterator[tuple[int, int]]:
    """Yield ``(offset, length)`` in bytes of each chunk of a file of ``size`` bytes."""
    for off in range(0, size, chunk_size):
        yield off, min(chunk_size, size - off)


def chunk_length(index: int, size: int, chunk_size: int) -> int:
    """Length in bytes of chunk ``index`` of a file of ``size`` bytes (0 past the end)."""
    return max(0, min(chunk_size, size - index * chunk_size))


@lru_cache(maxsize=4)
def zeros(length: int) -> bytes:
    """``length`` zero bytes (cached: used to compare chunks against a hole)."""
    return bytes(length)


@lru_cache(maxsize=64)
def zero_chunk_id(length: int) -> ObjectId:
    """The id of a chunk of ``length`` zero bytes."""
    return object_id(zeros(length))


def is_zero(data: bytes | bytearray) -> bool:
    """True if ``data`` is all zero bytes (a chunk that can be written as a hole)."""
    n = len(data)
    if not n:
        return True
    if data[0] or data[-1] or data[n >> 1]:
        return False
    return data == zeros(n)


PAGE_SIZE = 4096
"""The page ``data_pages`` counts in (what tmpfs allocates)."""


def data_pages(data: bytes | bytearray) -> int:
    """Number of ``PAGE_SIZE`` pages of ``data`` (from its start; the last one may be
    short) that hold a non-zero byte: the pages a file system with holes (tmpfs, ext4)
    allocates for it when only its non-zero pages are written. O(len(data)).

    Data without a zero byte (most text) is answered by one ``memchr``; otherwise a page
    whose first, middle or last byte is non-zero is held without comparing the rest."""
    n = len(data)
    pages = -(-n // PAGE_SIZE)
    if b"\0" not in data:
        return pages
    held = 0
    for off in range(0, n, PAGE_SIZE):
        end = min(off + PAGE_SIZE, n)
        if data[off] or data[end - 1] or data[(off + end) >> 1] or not is_zero(data[off:end]):
            held += 1
    return held
