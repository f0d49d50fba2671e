"""Faults of the shared servers under a live session mount (real FUSE, real SeaweedFS and
PostgreSQL of this test alone): the S3 server killed during a checkpoint, PostgreSQL
restarted mid-session.

The mount's store is a local directory configured for the shared store (store/config.py),
so the daemon (a separate ``rewindfs mount`` process) opens S3 and the catalog itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli

from store.config import SharedConfig, configure
from store.objects import Store
from store.ref import Ref

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


@pytest.fixture
def fuse_store(tmp_path: Path, own_seaweed: object, own_postgres: object) -> Path:
    """This host's local directory of a shared store on servers of this test alone."""
    local = tmp_path / "local"
    bucket = own_seaweed.new_bucket()  # type: ignore[attr-defined]
    configure(str(local), SharedConfig(
        blobs=f"s3://{bucket}/s", catalog=own_postgres.new_database(),  # type: ignore[attr-defined]
        s3_endpoint=own_seaweed.endpoint, cache=str(tmp_path / "cache")))  # type: ignore[attr-defined]
    return local


def _read(store: Path, ref: str, path: str) -> bytes:
    from store.browse import cat

    st = Store(store)
    try:
        return b"".join(cat(st, Ref.parse(ref), path))
    finally:
        st.close()


def test_s3_gone_during_checkpoint_keeps_every_change(mounter: fh.Mounter, fuse_store: Path,
                                                       lower_ref: str,
                                                       own_seaweed: object) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "new.txt").write_bytes(b"written before the outage\n")
    (m / "big.bin").write_bytes(os.urandom(5 << 20))
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        r = cli(fuse_store, "checkpoint", str(m), check=False)
        assert r.returncode != 0
        assert "s3://" in r.stderr or "backend" in r.stderr.lower(), r.stderr
        # The mount keeps serving, with every change, and takes new ones.
        assert (m / "new.txt").read_bytes() == b"written before the outage\n"
        (m / "during.txt").write_text("written during the outage\n")
        assert (m / "during.txt").read_text() == "written during the outage\n"
    finally:
        own_seaweed.start()  # type: ignore[attr-defined]
    big = (m / "big.bin").read_bytes()
    r = cli(fuse_store, "checkpoint", str(m), "--json")
    import json

    ref = json.loads(r.stdout)["ref"]
    assert _read(fuse_store, ref, "new.txt") == b"written before the outage\n"
    assert _read(fuse_store, ref, "during.txt") == b"written during the outage\n"
    assert _read(fuse_store, ref, "big.bin") == big
    st = Store(fuse_store)
    try:
        from store.verify import verify

        assert verify(st) == []  # nothing half-uploaded is referenced
    finally:
        st.close()


def test_postgres_restart_mid_session_reconnects(mounter: fh.Mounter, fuse_store: Path,
                                                 lower_ref: str,
                                                 own_postgres: object) -> None:
    import json

    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "a.txt").write_text("one\n")
    first = json.loads(cli(fuse_store, "checkpoint", str(m), "--json").stdout)["ref"]
    own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
    own_postgres.start()  # type: ignore[attr-defined]
    (m / "a.txt").write_text("two\n")
    second = json.loads(cli(fuse_store, "checkpoint", str(m), "--json").stdout)["ref"]
    assert first != second
    assert _read(fuse_store, second, "a.txt") == b"two\n"
    assert [s["ref"] for s in json.loads(cli(fuse_store, "list", "--json").stdout)][-2:] == \
        [first, second]


def test_ro_mount_on_a_new_host_reads_through_its_empty_cache(fuse_store: Path, lower_ref: str,
                                                              tmp_path: Path) -> None:
    import json

    cfg = json.loads((fuse_store / "store.json").read_text())
    host_b = tmp_path / "host-b"  # only store.json: no index, no cache yet
    configure(str(host_b), SharedConfig(cfg["blobs"], cfg["catalog"], cfg["s3_endpoint"],
                                        str(tmp_path / "cache-b")))
    mnt = tmp_path / "ro-b"
    mnt.mkdir()
    cli(host_b, "mount", "--ro", lower_ref, str(mnt))
    try:
        src = tmp_path / "lower-src"  # what lower_ref was snapshotted from
        files = [p for p in src.rglob("*") if p.is_file() and not p.is_symlink()]
        assert files
        for p in files:
            assert (mnt / p.relative_to(src)).read_bytes() == p.read_bytes()
        assert any((tmp_path / "cache-b").rglob("*-*"))  # ranges were cached locally
    finally:
        cli(host_b, "umount", str(mnt))
