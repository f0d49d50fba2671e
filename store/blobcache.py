"""A local, bounded cache of pack ranges in front of a remote blob backend.

``CachedBackend(inner, directory, max_bytes)`` is itself a BlobBackend. What it caches:
``get_range`` of pack keys (``packs/...``), which is how the store reads an object's record,
so a cold read of a big file fetches its records range by range (one chunk each) instead
of whole packs, and every later read of them is local. Packs are immutable and named by
their digest, so a cached range never goes stale. Everything else (history objects, whole
pack reads by verify/GC/rebuild, puts, lists) goes straight to ``inner``; a put of a pack
seeds nothing (the writer reads its own objects rarely).

On disk: ``<directory>/<pack key>/<offset>-<length>`` holding the blake3 digest of the
range (32 bytes) and then the range. A read checks the digest; a file that does not match
(torn by a crash, damaged on disk) is deleted and the range fetched again, so the cache
never hands out wrong bytes (and the store verifies every object against its id anyway).

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

import blake3

from .backend import BlobBackend, check_key

_DIGEST = 32
_TOUCH_EVERY_NS = 60_000_000_000


class CachedBackend:
    """``inner`` with a range cache in ``directory`` of at most about ``max_bytes`` bytes
    (see the module docstring). Counters ``hits``, ``misses`` and ``damaged`` say what the
    cache did (for stats and tests)."""

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

    # -- protocol --------------------------------------------------------------------

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if not key.startswith("packs/") or length <= 0:
            return self.inner.get_range(key, offset, length)
        path = self._path(key, offset, length)
        data = self._lookup(path)
        if data is not None:
            with self._lock:
                self.hits += 1
            return data
        data = self.inner.get_range(key, offset, length)
        with self._lock:
            self.misses += 1
        if len(data) == length:
            self._insert(path, data)
        return data

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
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
