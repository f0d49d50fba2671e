"""Blob backends: where packs and the append-only history objects live.

A backend is a flat namespace of immutable blobs under keys such as
``packs/<hex>.pack``. Contract shared by every backend (and proved by one conformance suite,
``tests/test_backend.py``):

- ``put(key, data)``: stores ``data``; putting identical bytes again is a no-op, different
  bytes raise ``BlobConflictError``. A put is visible at once, durable after ``sync()``.
- ``get(key)``: the bytes, or ``BlobNotFoundError``.
- ``delete(key)``: removes it; a missing key raises ``BlobNotFoundError``.
- ``list(prefix)``: sorted keys that start with ``prefix``.
- ``sync()``: one durable barrier for every put since the last one.

Keys are ``/``-joined segments of ``[A-Za-z0-9._-]``, never ``.`` or ``..``
(``InvalidKeyError``), so no key can name a path outside a local backend's directory.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from typing import Protocol

from .errors import (
    BackendError,
    BlobConflictError,
    BlobNotFoundError,
    InvalidKeyError,
    StoreFullError,
)

_SEGMENT = re.compile(r"[A-Za-z0-9._-]{1,200}")


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid backend key, else raise InvalidKeyError."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(str(key))
    for seg in key.split("/"):
        if seg in (".", "..") or not _SEGMENT.fullmatch(seg):
            raise InvalidKeyError(key)
    return key


class BlobBackend(Protocol):
    """The blob-backend protocol (see the module docstring for the contract)."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes: ...

    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str = "") -> list[str]: ...

    def exists(self, key: str) -> bool: ...

    def sync(self) -> None: ...


class MemoryBackend:
    """An in-memory backend for tests; thread-safe, never durable beyond the process."""

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        data = bytes(data)
        with self._lock:
            old = self._blobs.get(key)
            if old is not None:
                if old != data:
                    raise BlobConflictError(key)
                return
            self._blobs[key] = data

    def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._blobs[key]
            except KeyError:
                raise BlobNotFoundError(key) from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.get(key)[offset:offset + length]

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            if self._blobs.pop(key, None) is None:
                raise BlobNotFoundError(key)

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(k for k in self._blobs if k.startswith(prefix))

    def exists(self, key: str) -> bool:
        check_key(key)
        with self._lock:
            return key in self._blobs

    def sync(self) -> None:
        return None


class LocalDirBackend:
    """Blobs as files under a directory (mode 0700), the default backend.

    A put writes a temporary file and renames it into place, so a reader never sees half a
    blob; ``sync()`` fsyncs every file and directory touched since the previous barrier.
    An OS error (a full disk, EIO, a read-only file system) is ``BackendError`` naming the
    key and the cause; a put that fails removes its temporary file, so a full disk is not
    kept full by the attempt.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._pending_files: set[str] = set()
        self._pending_dirs: set[str] = set()
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}

    def _path(self, key: str) -> str:
        """The file of ``key`` (InvalidKeyError for a key that is not valid). Pack paths
        are remembered (at most 4096): a read of a few KiB asks for one per read."""
        path = self._paths.get(key)
        if path is None:
            path = os.path.join(self.root, *check_key(key).split("/"))
            if key.startswith("packs/"):
                if len(self._paths) >= 4096:
                    self._paths.clear()
                self._paths[key] = path
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                old = f.read()
        except FileNotFoundError:
            old = None
        except OSError as e:
            raise _error("put", key, e) from e
        if old is not None:
            if old != data:
                raise BlobConflictError(key)
            return
        parent = os.path.dirname(path)
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            if not os.path.isdir(parent):
                os.makedirs(parent, mode=0o700, exist_ok=True)
                with self._lock:
                    self._pending_dirs.add(os.path.dirname(parent))
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise _error("put", key, e) from e
        with self._lock:
            self._pending_files.add(path)
            self._pending_dirs.add(parent)

    def get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise BlobNotFoundError(key) from None
        except OSError as e:
            raise _error("get", key, e) from e

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise BlobNotFoundError(key) from None
        except OSError as e:
            raise _error("get", key, e) from e
        try:
            return os.pread(fd, length, offset)
        except OSError as e:
            raise _error("get", key, e) from e
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            raise BlobNotFoundError(key) from None
        except OSError as e:
            raise _error("delete", key, e) from e
        with self._lock:
            self._pending_files.discard(path)
            self._pending_dirs.add(os.path.dirname(path))

    def list(self, prefix: str = "") -> list[str]:
        out: list[str] = []
        for dirpath, _dirnames, filenames in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                if ".tmp." in name:
                    continue
                key = base + name
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def sync(self) -> None:
        with self._lock:
            files, dirs = self._pending_files, self._pending_dirs
            self._pending_files, self._pending_dirs = set(), set()
        try:
            for path in files:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            for path in dirs:
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
                except FileNotFoundError:
                    continue
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as e:
            # Nothing is known durable: the next barrier must try every file again.
            with self._lock:
                self._pending_files |= files
                self._pending_dirs |= dirs
            raise BackendError(f"cannot make blobs durable: {e.strerror or e}") from e

    def remove_stale_temps(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files of puts interrupted by a crash; return how many.

        Only files older than ``older_than_s`` go, so a put in flight is never disturbed.
        """
        import time

        cutoff = time.time() - older_than_s
        removed = 0
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if ".tmp." not in name:
                    continue
                path = os.path.join(dirpath, name)
                try:
                    if os.lstat(path).st_mtime < cutoff:
                        os.unlink(path)
                        removed += 1
                except FileNotFoundError:
                    pass
        return removed


def _error(op: str, key: str, e: OSError) -> BackendError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFullError(repr(key), e.strerror or e)
    return BackendError(f"cannot {op} {key!r}: {e.strerror or e}")
