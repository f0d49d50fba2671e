"""A local, bounded cache of pack ranges in front of a remote blob backend.

``CachedBackend(inner, directory, max_bytes)`` is itself a BlobBackend. What it caches:
``get_range`` of pack keys (``packs/...``), which is how the store reads an object's record,
so a cold read of a big file fetches its records range by range (one chunk each) instead
of whole packs, and every later read of them is local. Packs are immutable and named by
their digest, so a cached range never goes stale. Everything else (history objects, whole
pack reads by verify/GC/rebuild, puts, lists) goes straight to ``inner``; a put seeds
nothing by itself, but a writer of a small pack seeds its records (``seed``, below).

On disk: ``<directory>/<pack key>/<offset>-<length>`` holding the blake3 digest of the
range (32 bytes) and then the range. A read checks the digest; a file that does not match
(torn by a crash, damaged on disk) is deleted and the range fetched again, so the cache
never hands out bytes other than those fetched. The store verifies every object against
its id (or a frame against its tag) anyway; when that fails on a range it got from here it
reads the range once more with ``refetch_range``, which drops the cached copy and asks
``inner``, so a range cached while the object on the server was damaged is not served
after the object is repaired (only bytes that fail again are an integrity error).

Read-ahead: a reader that walks a pack sequentially (each range starting where one of its
last few ranges ended: a big file's records lie back to back) is detected per pack after
``READAHEAD_AFTER`` such ranges (ranges near the run that do not continue it, such as a
few frames read inside a record, neither count nor break it; a range far away does); from then on the pack is fetched in ``SEGMENT``-byte
aligned segments, up to ``READAHEAD_DEPTH`` segments past the one being read, by
``READAHEAD_WORKERS`` threads in parallel (one large ranged GET costs about what a small
one does on S3, so this is what lets a cold read stream). A range is then cut out of the
segments in memory and handed to the reader at once; it is written to the cache directory
by a writer thread behind the reader (``drain()`` waits for those writes). Random ranges never start a stream, so they fetch
exactly what they ask for. Segments are held in memory only while their stream is one of
the ``READAHEAD_STREAMS`` most recent ones and not behind its reader, so the read-ahead
holds at most about ``READAHEAD_STREAMS * (READAHEAD_DEPTH + 3) * SEGMENT`` bytes. A failed
segment fetch is forgotten and the range fetched directly, so the reader sees the inner
backend's own error.

Bounded and LRU: the entries' sizes are summed at open and on every insert; when the sum
passes ``max_bytes`` the directory is scanned again (other processes share it) and the
least recently used files (by mtime, refreshed on a hit at most once a minute) are deleted
until the sum is under 90 % of the bound. The cache survives restarts: it is rebuilt from
the directory at open.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import blake3

from .backend import BlobBackend, check_key

_DIGEST = 32
_TOUCH_EVERY_NS = 60_000_000_000

SEGMENT = 8 << 20  # bytes per read-ahead GET (aligned in the pack)
SEED_MAX = 4 << 20  # packs put up to this size have their records cached (``seed``)
READAHEAD_AFTER = 2  # back-to-back ranges of a pack before its read-ahead starts
READAHEAD_DEPTH = 2  # segments fetched past the one being read
READAHEAD_WORKERS = 3
READAHEAD_STREAMS = 4  # packs read ahead at once (least recent ones dropped)
_RECENT = 8  # range ends remembered per pack, to see a sequential run in parallel reads


class _Stream:
    """Read-ahead state of one pack: recent range ends, the run length of back-to-back
    ranges and the segments fetched or in flight, by segment index."""

    __slots__ = ("ends", "run", "segments", "size")

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.run = 0
        self.segments: dict[int, Future[bytes]] = {}
        self.size: int | None = None  # the pack's length, once a segment came back short


class CachedBackend:
    """``inner`` with a range cache in ``directory`` of at most about ``max_bytes`` bytes
    and a read-ahead for sequential readers (see the module docstring). Counters ``hits``,
    ``misses``, ``damaged``, ``refetched``, ``prefetched`` (read-ahead segments) and ``fetched_bytes``
    (bytes of packs read from ``inner``) say what the cache did (for stats and tests)."""

    def __init__(self, inner: BlobBackend, directory: str | os.PathLike[str],
                 max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"cache size must be positive, got {max_bytes}")
        self.inner = inner
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_bytes = int(max_bytes)
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._used = self._scan_total()
        self._touched: dict[str, int] = {}
        self.hits = 0
        self.misses = 0
        self.damaged = 0
        self.refetched = 0  # ranges read again from ``inner`` (``refetch_range``)
        self.prefetched = 0  # read-ahead segments fetched
        self.fetched_bytes = 0  # bytes of packs read from ``inner``
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._writes: set[Future[None]] = set()

    # -- cache files -----------------------------------------------------------------

    def _path(self, key: str, offset: int, length: int) -> str:
        return os.path.join(self.directory, *check_key(key).split("/"), f"{offset}-{length}")

    def _entries(self) -> list[tuple[int, int, str]]:
        """(mtime_ns, size, path) of every cache file."""
        out = []
        for dirpath, _dirs, files in os.walk(self.directory):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime_ns, st.st_size, path))
        return out

    def _scan_total(self) -> int:
        return sum(size for _, size, _ in self._entries())

    def cached_bytes(self) -> int:
        """Bytes the cache directory holds now (all processes' entries)."""
        return self._scan_total()

    def _lookup(self, path: str) -> bytes | None:
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except FileNotFoundError:
            return None
        except OSError:
            return None
        data = blob[_DIGEST:]
        if len(blob) < _DIGEST or blake3.blake3(data).digest() != blob[:_DIGEST]:
            with self._lock:
                self.damaged += 1
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        now = time.time_ns()
        if now - self._touched.get(path, 0) > _TOUCH_EVERY_NS:
            self._touched[path] = now
            try:
                os.utime(path)
            except OSError:
                pass
        return data

    def _insert(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(blake3.blake3(data).digest())
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            # A full or read-only cache disk costs speed, never a read.
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        with self._lock:
            self._used += len(data) + _DIGEST
            over = self._used > self.max_bytes
        if over:
            self._evict()

    def _evict(self) -> None:
        entries = sorted(e for e in self._entries() if ".tmp." not in e[2])
        total = sum(size for _, size, _ in entries)
        goal = self.max_bytes * 9 // 10
        for _mtime, size, path in entries:
            if total <= goal:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            self._touched.pop(path, None)
        with self._lock:
            self._used = total

    # -- read-ahead ------------------------------------------------------------------

    def _note(self, key: str, offset: int, length: int, missed: bool) -> list[Future[bytes]] | None:
        """Record a range of ``key``; on a miss in a sequential run, start the segments
        ahead of it and return the futures of the segments covering it (None otherwise).
        Called with ``self._lock`` held."""
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = _Stream()
            while len(self._streams) > READAHEAD_STREAMS:
                self._streams.popitem(last=False)
        else:
            self._streams.move_to_end(key)
        end = offset + length
        first, last = offset // SEGMENT, (end - 1) // SEGMENT
        if offset in st.ends:
            st.run += 1
        elif first not in st.segments and all(abs(offset - e) > SEGMENT for e in st.ends):
            # Only a range far from the run ends it: parallel readers come a little out of
            # order, and a reader of part of a record (a chunk's frames) reads inside it.
            st.run = 0
        st.ends.append(end)
        del st.ends[:-_RECENT]
        for i in [i for i in st.segments if i < first - 1]:
            del st.segments[i]  # behind the reader (one kept for a late parallel range)
        if not missed or (st.run < READAHEAD_AFTER and first not in st.segments):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READAHEAD_WORKERS, thread_name_prefix="readahead")
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="cache-writer")
        for i in range(first, last + READAHEAD_DEPTH + 1):
            if i not in st.segments and (i == first or st.size is None
                                         or i * SEGMENT < st.size):
                st.segments[i] = self._pool.submit(self._segment, key, i)
                self.prefetched += 1
        return [st.segments[i] for i in range(first, last + 1)]

    def _segment(self, key: str, i: int) -> bytes:
        data = self.inner.get_range(key, i * SEGMENT, SEGMENT)
        with self._lock:
            self.fetched_bytes += len(data)
            st = self._streams.get(key)
            if st is not None and len(data) < SEGMENT:
                st.size = i * SEGMENT + len(data)
        return data

    def _cut(self, key: str, offset: int, length: int,
             segments: list[Future[bytes]]) -> bytes | None:
        """The range cut out of its segments, or None if a segment fetch failed (it is
        forgotten, so a later read fetches again)."""
        parts = []
        for f in segments:
            try:
                parts.append(f.result())
            except Exception:
                with self._lock:
                    st = self._streams.get(key)
                    if st is not None:
                        for i, g in list(st.segments.items()):
                            if g is f:
                                del st.segments[i]
                return None
        start = offset - offset // SEGMENT * SEGMENT
        return b"".join(parts)[start:start + length] if len(parts) > 1 \
            else parts[0][start:start + length]

    # -- protocol --------------------------------------------------------------------

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if not key.startswith("packs/") or length <= 0:
            return self.inner.get_range(key, offset, length)
        path = self._path(key, offset, length)
        data = self._lookup(path)
        with self._lock:
            segments = self._note(key, offset, length, data is None)
            if data is not None:
                self.hits += 1
                return data
            self.misses += 1
        if segments is not None:
            data = self._cut(key, offset, length, segments)
            if data is not None:
                if len(data) == length:  # cached behind the reader, off its path
                    with self._lock:
                        assert self._writer is not None
                        w = self._writer.submit(self._insert, path, data)
                        self._writes.add(w)
                    w.add_done_callback(self._written)
                return data
        return self._fetch(key, offset, length, path)

    def _fetch(self, key: str, offset: int, length: int, path: str) -> bytes:
        """``length`` bytes at ``offset`` of ``key`` read from ``inner``, counted in
        ``fetched_bytes`` and cached at ``path`` when whole (fewer at the end of the blob
        are handed out uncached). Raises what ``inner.get_range`` raises."""
        data = self.inner.get_range(key, offset, length)
        with self._lock:
            self.fetched_bytes += len(data)
        if len(data) == length:
            self._insert(path, data)
        return data

    def refetch_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``key`` (fewer at the end of the blob) read
        from ``inner`` itself, replacing what the cache holds for that range. For a reader
        whose own check (an object's hash, a frame's tag) failed on bytes ``get_range``
        gave: the file digest only proves a cached range is what was fetched, so a range
        fetched while the object on the server was damaged would be handed out again after
        it was repaired. The cached file and any read-ahead segment covering the range are
        dropped first (and writes behind the reader finished, so none lands after this
        one); the fresh bytes are cached if they are whole. Counted in ``refetched``.
        Raises what ``inner.get_range`` raises (the cache then holds nothing for the
        range)."""
        if not key.startswith("packs/") or length <= 0:
            return self.inner.get_range(key, offset, length)
        with self._lock:
            self.refetched += 1
            st = self._streams.get(key)
            if st is not None:
                for i in range(offset // SEGMENT, (offset + length - 1) // SEGMENT + 1):
                    st.segments.pop(i, None)
        self.drain()
        path = self._path(key, offset, length)
        try:
            os.unlink(path)
        except OSError:
            pass
        return self._fetch(key, offset, length, path)

    def _written(self, w: Future[None]) -> None:
        with self._lock:
            self._writes.discard(w)

    def drain(self) -> None:
        """Wait until every range read ahead so far is in the cache directory."""
        while True:
            with self._lock:
                pending = list(self._writes)
            if not pending:
                return
            for w in pending:
                w.result()

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def seed(self, key: str, data: bytes, ranges: list[tuple[int, int]]) -> None:
        """Cache ``ranges`` (offset, length) of pack ``key`` whose bytes ``data`` were just
        put, if the pack is at most ``SEED_MAX`` bytes: the next checkpoint of a live mount
        reads back what the last one wrote (the chunk a file's append lands in), and the
        range then need not come from the server again. Bigger packs (a first snapshot's)
        seed nothing, so a bulk write does not fill the cache with what is rarely read."""
        if not key.startswith("packs/") or len(data) > SEED_MAX:
            return
        for offset, length in sorted(set(ranges)):
            if length > 0 and offset + length <= len(data):
                self._insert(self._path(key, offset, length), data[offset:offset + length])

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def abort_stale_uploads(self, prefix: str, older_than_s: float) -> list[str]:
        """The inner backend's ``abort_stale_uploads`` (store/s3.py); [] if it has none."""
        inner = getattr(self.inner, "abort_stale_uploads", None)
        return [] if inner is None else list(inner(prefix, older_than_s))

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        with self._lock:
            self._streams.pop(key, None)
        if key.startswith("packs/"):
            import shutil

            shutil.rmtree(os.path.join(self.directory, *check_key(key).split("/")),
                          ignore_errors=True)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def sync(self) -> None:
        self.inner.sync()
