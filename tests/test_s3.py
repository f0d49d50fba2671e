"""The S3 backend and the local range cache against a real SeaweedFS on loopback.

The shared contract is proved by tests/test_backend.py (which runs on S3 too); these are the
S3-only behaviours: multipart uploads of big packs, typed errors when the server is gone or
the keys are wrong (never leaking the secret), a store on S3 reading through the cache
after the server stopped, corrupted objects in S3 detected, and the cache's bound, restart
survival and damage handling.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from store.blobcache import CachedBackend
from store.errors import BackendError, IntegrityError
from store.s3 import MULTIPART_THRESHOLD, S3Backend, parse_s3_url


def _s3(srv: object, bucket: str, prefix: str = "", **kw: object) -> S3Backend:
    return S3Backend(bucket, prefix, endpoint_url=srv.endpoint, **kw)  # type: ignore[attr-defined,arg-type]


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://b/team/x/") == ("b", "team/x")
    assert parse_s3_url("s3://b") == ("b", "")
    for bad in ("http://b/x", "s3:///x", "s3://b/../x"):
        with pytest.raises(ValueError):
            parse_s3_url(bad)


def test_big_pack_is_uploaded_in_parts(s3_env: object, s3_bucket: str) -> None:
    b = _s3(s3_env, s3_bucket, "p")
    data = os.urandom(MULTIPART_THRESHOLD + 3 * 1024 * 1024 + 17)
    b.put("packs/big.pack", data)
    b.put("packs/big.pack", data)  # identical re-put: a no-op
    assert b.get("packs/big.pack") == data
    assert b.get_range("packs/big.pack", MULTIPART_THRESHOLD - 5, 10) == \
        data[MULTIPART_THRESHOLD - 5:MULTIPART_THRESHOLD + 5]
    head = s3_env.client().head_object(Bucket=s3_bucket, Key="p/packs/big.pack")  # type: ignore[attr-defined]
    assert "-" in head["ETag"], "a multipart upload's ETag ends in -<parts>"


def test_wrong_secret_is_typed_error_without_the_secret(s3_env: object, s3_bucket: str,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    secret = "not-the-secret-0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    b = _s3(s3_env, s3_bucket, max_attempts=1)
    with pytest.raises(BackendError) as ei:
        b.put("k", b"v")
    assert secret not in str(ei.value) and s3_bucket in str(ei.value)
    with pytest.raises(BackendError):
        b.check()


def test_server_gone_is_typed_error(own_seaweed: object) -> None:
    bucket = own_seaweed.new_bucket()  # type: ignore[attr-defined]
    b = _s3(own_seaweed, bucket, max_attempts=2, connect_timeout=2, read_timeout=60)
    b.put("k", b"v")
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    with pytest.raises(BackendError):
        b.get("k")
    with pytest.raises(BackendError):
        b.put("k2", b"v")
    own_seaweed.start()  # type: ignore[attr-defined]
    assert b.get("k") == b"v"
    b.put("k2", b"v")


def _store(root: Path, backend: object) -> object:
    from store.objects import Store

    return Store(root, backend=backend)  # type: ignore[arg-type]


def test_store_on_s3_reads_from_cache_when_server_is_gone(own_seaweed: object,
                                                          tmp_path: Path) -> None:
    from store.snapshot import run_snapshot

    src = tmp_path / "src"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(3 << 20))
    (src / "small.txt").write_text("hello\n")
    bucket = own_seaweed.new_bucket()  # type: ignore[attr-defined]
    remote = _s3(own_seaweed, bucket, "s", max_attempts=1, connect_timeout=1)
    cache = CachedBackend(remote, tmp_path / "cache", 64 << 20)
    st = _store(tmp_path / "local", cache)
    ref = run_snapshot(st, str(src)).ref  # type: ignore[arg-type]

    def read_all(s: object) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        for e in s.root_tree(ref).entries:  # type: ignore[attr-defined]
            out[e.name] = b"".join(s.iter_file(e))  # type: ignore[attr-defined]
        return out

    # A second host: its own cache and index, the same bucket. The first read is remote.
    cache2 = CachedBackend(remote, tmp_path / "cache2", 64 << 20)
    st2 = _store(tmp_path / "local2", cache2)
    want = {b"big": (src / "big").read_bytes(), b"small.txt": b"hello\n"}
    assert read_all(st2) == want
    assert cache2.misses > 0 and cache2.hits == 0
    # A restart of that host: a new cache object on the same directory, a new store with
    # empty memory caches; then the server goes away and every read is answered locally.
    again = CachedBackend(remote, tmp_path / "cache2", 64 << 20)
    st3 = _store(tmp_path / "local2", again)
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    assert read_all(st3) == want
    assert again.misses == 0 and again.hits > 0


def test_a_writer_seeds_the_cache_with_the_records_of_a_small_pack(s3_env: object,
                                                                  s3_bucket: str,
                                                                  tmp_path: Path) -> None:
    from store.blobcache import SEED_MAX
    from store.snapshot import run_snapshot

    remote = _s3(s3_env, s3_bucket, "seed")
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("what a checkpoint writes\n" * 50)
    (src / "b.bin").write_bytes(os.urandom(300_000))
    cache = CachedBackend(remote, tmp_path / "c", 64 << 20)
    ref = run_snapshot(_store(tmp_path / "local", cache), str(src)).ref  # type: ignore[arg-type]
    # A store with empty memory caches reads every record back from the cache directory.
    again = CachedBackend(remote, tmp_path / "c", 64 << 20)
    st = _store(tmp_path / "local", again)
    for e in st.root_tree(ref).entries:  # type: ignore[attr-defined]
        assert b"".join(st.iter_file(e)) == (src / e.name.decode()).read_bytes()  # type: ignore[attr-defined]
    assert again.misses == 0 and again.hits > 0
    # A pack bigger than SEED_MAX (a first snapshot's) seeds nothing.
    big = tmp_path / "big"
    big.mkdir()
    (big / "c.bin").write_bytes(os.urandom(SEED_MAX + (1 << 20)))
    before = cache.cached_bytes()
    run_snapshot(_store(tmp_path / "local", cache), str(big))  # type: ignore[arg-type]
    assert cache.cached_bytes() == before


def test_corrupted_pack_in_s3_is_integrity_error(s3_env: object, s3_bucket: str,
                                                 tmp_path: Path) -> None:
    from store.snapshot import run_snapshot

    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(200_000))
    remote = _s3(s3_env, s3_bucket)
    st = _store(tmp_path / "local", remote)
    ref = run_snapshot(st, str(src)).ref  # type: ignore[arg-type]
    entry = next(e for e in st.root_tree(ref).entries if e.name == b"f")  # type: ignore[attr-defined]
    loc = st.locate(entry.chunks[0])  # type: ignore[attr-defined]
    client = s3_env.client()  # type: ignore[attr-defined]
    body = bytearray(remote.get(loc.pack))
    body[loc.rec_offset + loc.rec_length // 2] ^= 0xFF
    client.put_object(Bucket=s3_bucket, Key=loc.pack, Body=bytes(body))
    fresh = _store(tmp_path / "local", remote)
    with pytest.raises(IntegrityError):
        b"".join(fresh.iter_file(entry))  # type: ignore[attr-defined]


def test_cache_is_bounded_and_evicts_least_recently_used(s3_env: object, s3_bucket: str,
                                                          tmp_path: Path) -> None:
    remote = _s3(s3_env, s3_bucket)
    remote.put("packs/a.pack", os.urandom(400_000))
    c = CachedBackend(remote, tmp_path / "c", 1_000_000)
    for i in range(10):
        c.get_range("packs/a.pack", i * 40_000, 40_000)
    c.drain()  # (a sequential run is read ahead: its ranges are cached behind the reader)
    c.get_range("packs/a.pack", 0, 40_000)  # recently used: hit
    assert c.hits == 1
    for i in range(10, 40):
        c.get_range("packs/a.pack", i * 10_000 % 390_000, 150_000)
        c.drain()
        assert c.cached_bytes() <= 1_000_000
    assert c.cached_bytes() > 500_000


def test_damaged_cache_file_is_refetched(s3_env: object, s3_bucket: str,
                                         tmp_path: Path) -> None:
    remote = _s3(s3_env, s3_bucket)
    data = os.urandom(100_000)
    remote.put("packs/d.pack", data)
    c = CachedBackend(remote, tmp_path / "c", 10 << 20)
    assert c.get_range("packs/d.pack", 1000, 5000) == data[1000:6000]
    (f,) = [p for p in (tmp_path / "c").rglob("*") if p.is_file()]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    assert c.get_range("packs/d.pack", 1000, 5000) == data[1000:6000]
    assert c.damaged == 1 and c.misses == 2
    assert c.get_range("packs/d.pack", 1000, 5000) == data[1000:6000]
    assert c.hits == 1


# -- read-ahead (store/blobcache.py) --------------------------------------------------------

_MIB = 1 << 20


def test_sequential_reader_is_read_ahead_in_segments(s3_env: object, s3_bucket: str,
                                                     tmp_path: Path) -> None:
    from store.blobcache import READAHEAD_DEPTH, SEGMENT

    remote = _s3(s3_env, s3_bucket)
    data = os.urandom(40 * _MIB + 12345)
    remote.put("packs/seq.pack", data)
    c = CachedBackend(remote, tmp_path / "c", 1 << 30)
    ranges = [(off, min(_MIB, len(data) - off)) for off in range(0, len(data), _MIB)]
    for off, n in ranges:  # as the store asks: the exact length of each record
        assert c.get_range("packs/seq.pack", off, n) == data[off:off + n]
    # Fetched in few large GETs, the segments past the pack's end never asked for, and
    # hardly more bytes than the pack holds.
    assert 0 < c.prefetched <= len(data) // SEGMENT + READAHEAD_DEPTH + 1
    assert len(data) <= c.fetched_bytes <= len(data) + 4 * _MIB
    c.drain()
    # Every range read ahead was also cached: a restarted host reads them all locally.
    again = CachedBackend(remote, tmp_path / "c", 1 << 30)
    for off, n in ranges:
        assert again.get_range("packs/seq.pack", off, n) == data[off:off + n]
    assert again.misses == 0 and again.fetched_bytes == 0 and again.prefetched == 0


def test_random_reader_fetches_only_what_it_asks(s3_env: object, s3_bucket: str,
                                                 tmp_path: Path) -> None:
    import random

    remote = _s3(s3_env, s3_bucket)
    data = os.urandom(32 * _MIB)
    remote.put("packs/rnd.pack", data)
    c = CachedBackend(remote, tmp_path / "c", 1 << 30)
    rng = random.Random(13)
    for _ in range(200):
        off = rng.randrange(0, len(data) - 4096) // 4096 * 4096
        assert c.get_range("packs/rnd.pack", off, 4096) == data[off:off + 4096]
    assert c.prefetched == 0
    assert c.fetched_bytes == 4096 * c.misses  # (an offset drawn twice is a hit)


def test_parallel_readers_out_of_order_get_their_bytes(s3_env: object, s3_bucket: str,
                                                       tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    remote = _s3(s3_env, s3_bucket)
    data = os.urandom(48 * _MIB)
    remote.put("packs/par.pack", data)
    c = CachedBackend(remote, tmp_path / "c", 1 << 30)
    # Ranges of uneven sizes back to back, read by four threads (as a mount's prefetching
    # worker threads do): a run of them must still be seen and read ahead.
    offs = [0]
    while offs[-1] < len(data):
        offs.append(min(len(data), offs[-1] + (300_000 if len(offs) % 3 else _MIB + 7)))
    ranges = list(zip(offs, offs[1:], strict=False))
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda r: c.get_range("packs/par.pack", r[0], r[1] - r[0]), ranges))
    assert got == [data[a:b] for a, b in ranges]
    assert c.prefetched > 0


def test_server_gone_during_read_ahead_is_typed_error_never_wrong_bytes(
        own_seaweed: object, tmp_path: Path) -> None:
    bucket = own_seaweed.new_bucket()  # type: ignore[attr-defined]
    # One attempt, so a server that is gone fails at once (connection refused); the
    # read timeout stays long, so a loaded machine's slow answer is not taken for it.
    remote = _s3(own_seaweed, bucket, max_attempts=1, connect_timeout=2, read_timeout=60)
    data = os.urandom(64 * _MIB)
    _s3(own_seaweed, bucket).put("packs/gone.pack", data)
    c = CachedBackend(remote, tmp_path / "c", 1 << 30)
    for off in range(0, 4 * _MIB, _MIB):
        assert c.get_range("packs/gone.pack", off, _MIB) == data[off:off + _MIB]
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    failed = 0
    for off in range(4 * _MIB, len(data), _MIB):
        try:
            got = c.get_range("packs/gone.pack", off, _MIB)
        except BackendError:
            failed += 1
        else:
            assert got == data[off:off + _MIB]  # read ahead before the server went
    assert failed > 0
    own_seaweed.start()  # type: ignore[attr-defined]
    for off in range(4 * _MIB, len(data), _MIB):
        assert c.get_range("packs/gone.pack", off, _MIB) == data[off:off + _MIB]


def test_frames_read_inside_records_keep_the_read_ahead(s3_env: object, s3_bucket: str,
                                                        tmp_path: Path) -> None:
    from store.blobcache import READAHEAD_DEPTH, SEGMENT

    remote = _s3(s3_env, s3_bucket)
    data = os.urandom(40 * _MIB)
    remote.put("packs/fr.pack", data)
    c = CachedBackend(remote, tmp_path / "c", 1 << 30)
    # A mount reading a big file: a few 64 KiB frames of a record on the request thread,
    # the whole record (and the next ones) in worker threads.
    for off in range(0, len(data), _MIB):
        inner = off + 3 * 65536
        assert c.get_range("packs/fr.pack", inner, 65536) == data[inner:inner + 65536]
        assert c.get_range("packs/fr.pack", off, _MIB) == data[off:off + _MIB]
    assert 0 < c.prefetched <= len(data) // SEGMENT + READAHEAD_DEPTH + 1
    assert c.fetched_bytes <= len(data) + 6 * _MIB


def test_a_read_that_timed_out_holds_off_reads_of_that_key(own_seaweed: object) -> None:
    """SeaweedFS stopped with SIGSTOP (it accepts connections and never answers): a read of
    a key times out after its attempts; further reads of that key fail at once, sending no
    request, also after the server is back, until the hold-off ends; another key is still
    asked. Requests are counted at botocore's ``before-send`` event: what goes on the wire."""
    import signal
    import time

    bucket = own_seaweed.new_bucket()  # type: ignore[attr-defined]
    sent: list[str] = []

    def backend(hold_off_s: float) -> S3Backend:
        b = _s3(own_seaweed, bucket, "p", max_attempts=2, connect_timeout=0.5,
                read_timeout=0.5, hold_off_s=hold_off_s)
        b._client.meta.events.register(
            "before-send.s3", lambda request, **_: sent.append(request.url))
        return b

    b, quick = backend(3600.0), backend(0.2)
    for key in ("packs/a.pack", "packs/b.pack"):
        b.put(key, key.encode() * 100)
    group = own_seaweed.proc.pid  # type: ignore[attr-defined]
    os.killpg(group, signal.SIGSTOP)
    try:
        sent.clear()
        with pytest.raises(BackendError, match="gave up after 2 attempts"):
            b.get_range("packs/a.pack", 0, 10)
        assert len(sent) == 2  # the first and its retry
        for read in (lambda: b.get_range("packs/a.pack", 100, 10),
                     lambda: b.get("packs/a.pack")):
            with pytest.raises(BackendError) as raised:
                read()
            msg = str(raised.value)
            assert "not asked again for" in msg and "REWINDFS_S3_HOLD_OFF" in msg, msg
            assert "s3://" in msg and "packs/a.pack" in msg and "\n" not in msg, msg
        assert len(sent) == 2  # held off: no request
        with pytest.raises(BackendError, match="gave up after"):
            b.get_range("packs/b.pack", 0, 10)  # another key is asked
        assert len(sent) == 4
        with pytest.raises(BackendError, match="gave up after"):
            quick.get_range("packs/a.pack", 0, 10)
        assert len(sent) == 6
    finally:
        os.killpg(group, signal.SIGCONT)
    with pytest.raises(BackendError, match="not asked again"):
        b.get_range("packs/a.pack", 0, 10)  # still held off, though the server is back
    assert len(sent) == 6
    time.sleep(0.3)  # past quick's hold-off: it asks again, and the server answers
    assert quick.get_range("packs/a.pack", 0, 10) == b"packs/a.pack"[:10]
    assert quick.get("packs/a.pack") == b"packs/a.pack" * 100
    assert len(sent) == 8
