"""One conformance suite for every blob backend (see store/backend.py for the contract)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from store.backend import BlobBackend, LocalDirBackend, MemoryBackend
from store.errors import BlobConflictError, BlobNotFoundError, InvalidKeyError


@pytest.fixture(params=["memory", "localdir", "s3", "s3-prefix", "s3-cached"])
def backend(request: pytest.FixtureRequest, tmp_path: str) -> Iterator[BlobBackend]:
    if request.param == "memory":
        yield MemoryBackend()
    elif request.param == "localdir":
        yield LocalDirBackend(os.path.join(tmp_path, "blobs"))
    else:
        from store.blobcache import CachedBackend
        from store.s3 import S3Backend

        srv = request.getfixturevalue("s3_env")
        bucket = request.getfixturevalue("s3_bucket")
        prefix = "team/store-1" if request.param == "s3-prefix" else ""
        s3 = S3Backend(bucket, prefix, endpoint_url=srv.endpoint)
        if request.param == "s3-cached":
            yield CachedBackend(s3, os.path.join(tmp_path, "cache"), 1 << 20)
        else:
            yield s3


def test_put_get_roundtrip(backend: BlobBackend) -> None:
    backend.put("packs/a.pack", b"hello")
    backend.put("config.json", b"{}")
    assert backend.get("packs/a.pack") == b"hello"
    assert backend.get("config.json") == b"{}"
    assert backend.exists("packs/a.pack")
    assert not backend.exists("packs/b.pack")


def test_empty_blob(backend: BlobBackend) -> None:
    backend.put("empty", b"")
    assert backend.get("empty") == b""


def test_get_range(backend: BlobBackend) -> None:
    backend.put("k", b"0123456789")
    assert backend.get_range("k", 2, 3) == b"234"
    assert backend.get_range("k", 8, 10) == b"89"
    backend.put("packs/p.pack", b"0123456789")
    assert backend.get_range("packs/p.pack", 2, 3) == b"234"
    assert backend.get_range("packs/p.pack", 2, 3) == b"234"  # a cached range, if cached
    assert backend.get_range("packs/p.pack", 8, 10) == b"89"


def test_identical_reput_is_noop(backend: BlobBackend) -> None:
    backend.put("journal/s/1.json", b"x")
    backend.put("journal/s/1.json", b"x")
    assert backend.get("journal/s/1.json") == b"x"
    assert backend.list() == ["journal/s/1.json"]


def test_conflicting_reput_is_error_and_keeps_old(backend: BlobBackend) -> None:
    backend.put("k", b"old")
    with pytest.raises(BlobConflictError) as ei:
        backend.put("k", b"new")
    assert ei.value.key == "k"
    assert backend.get("k") == b"old"


def test_missing_key_is_typed_error(backend: BlobBackend) -> None:
    with pytest.raises(BlobNotFoundError) as ei:
        backend.get("nope")
    assert ei.value.key == "nope"
    with pytest.raises(BlobNotFoundError):
        backend.get_range("nope", 0, 1)
    with pytest.raises(BlobNotFoundError):
        backend.delete("nope")


def test_delete(backend: BlobBackend) -> None:
    backend.put("a/b", b"1")
    backend.delete("a/b")
    assert not backend.exists("a/b")
    assert backend.list() == []
    with pytest.raises(BlobNotFoundError):
        backend.get("a/b")
    backend.put("a/b", b"2")  # a deleted key can be written again with other bytes
    assert backend.get("a/b") == b"2"


def test_list_sorted_with_prefix(backend: BlobBackend) -> None:
    for k in ["packs/b.pack", "packs/a.pack", "snapshots/1.json", "journal/s/2.json",
              "journal/s/1.json", "config.json"]:
        backend.put(k, k.encode())
    assert backend.list() == sorted(["packs/b.pack", "packs/a.pack", "snapshots/1.json",
                                     "journal/s/2.json", "journal/s/1.json", "config.json"])
    assert backend.list("packs/") == ["packs/a.pack", "packs/b.pack"]
    assert backend.list("journal/s/") == ["journal/s/1.json", "journal/s/2.json"]
    assert backend.list("nothing/") == []


def test_sync_keeps_content(backend: BlobBackend) -> None:
    backend.put("k", b"v")
    backend.sync()
    backend.sync()
    assert backend.get("k") == b"v"


@pytest.mark.parametrize("key", ["", "..", ".", "../x", "a/../b", "a/./b", "/abs", "a//b",
                                 "a/", "sp ace", "nul\0", "back\\slash", "x" * 201,
                                 "ü"])
def test_invalid_keys_rejected(backend: BlobBackend, key: str) -> None:
    with pytest.raises(InvalidKeyError):
        backend.put(key, b"x")
    with pytest.raises(InvalidKeyError):
        backend.get(key)
    with pytest.raises(InvalidKeyError):
        backend.delete(key)
    assert backend.list() == []


def test_localdir_never_writes_outside_root(tmp_path: str) -> None:
    root = os.path.join(tmp_path, "blobs")
    b = LocalDirBackend(root)
    with pytest.raises(InvalidKeyError):
        b.put("../escape", b"x")
    assert not os.path.exists(os.path.join(tmp_path, "escape"))
    b.put("packs/p.pack", b"data")
    assert os.listdir(tmp_path) == ["blobs"]
    assert open(os.path.join(root, "packs", "p.pack"), "rb").read() == b"data"
    assert os.stat(root).st_mode & 0o777 == 0o700


def test_localdir_persists_across_instances(tmp_path: str) -> None:
    root = os.path.join(tmp_path, "blobs")
    LocalDirBackend(root).put("journal/s/1.json", b"e")
    again = LocalDirBackend(root)
    assert again.list() == ["journal/s/1.json"]
    assert again.get("journal/s/1.json") == b"e"


def test_local_backend_sweeps_only_stale_temp_files(tmp_path):
    import os
    import time

    from store.backend import LocalDirBackend

    b = LocalDirBackend(tmp_path / "b")
    b.put("packs/x", b"1")
    old = tmp_path / "b" / "packs" / "x.tmp.1.2"
    fresh = tmp_path / "b" / "packs" / "y.tmp.1.2"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    past = time.time() - 7200
    os.utime(old, (past, past))
    assert b.remove_stale_temps() == 1
    assert not old.exists() and fresh.exists()
    assert b.get("packs/x") == b"1"
