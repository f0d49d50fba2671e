"""Faults of the shared servers under a live session mount (real FUSE, real SeaweedFS and
PostgreSQL of this test alone): the S3 server killed during a checkpoint (also mid
multipart upload, whose unfinished upload GC then aborts), PostgreSQL restarted
mid-session.

The mount's store is a local directory configured for the shared store (store/config.py),
so the daemon (a separate ``rewindfs mount`` process) opens S3 and the catalog itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli, read_in, shared_store_on

from store.config import SharedConfig, configure
from store.objects import Store

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


@pytest.fixture
def fuse_store(tmp_path: Path, own_seaweed: object, own_postgres: object) -> Path:
    """This host's local directory of a shared store on servers of this test alone."""
    return shared_store_on(tmp_path, own_seaweed, own_postgres)


def _problems(store: Path) -> list[str]:
    """What ``store.verify`` finds wrong in the store at ``store`` (empty: nothing, so no
    half-uploaded pack is referenced)."""
    from store.verify import verify

    st = Store(store)
    try:
        return [str(p) for p in verify(st)]
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
    ref = json.loads(r.stdout)["ref"]
    assert read_in(fuse_store, ref, "new.txt") == b"written before the outage\n"
    assert read_in(fuse_store, ref, "during.txt") == b"written during the outage\n"
    assert read_in(fuse_store, ref, "big.bin") == big
    assert _problems(fuse_store) == []


def test_postgres_restart_mid_session_reconnects(mounter: fh.Mounter, fuse_store: Path,
                                                 lower_ref: str,
                                                 own_postgres: object) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "a.txt").write_text("one\n")
    first = json.loads(cli(fuse_store, "checkpoint", str(m), "--json").stdout)["ref"]
    own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
    own_postgres.start()  # type: ignore[attr-defined]
    (m / "a.txt").write_text("two\n")
    second = json.loads(cli(fuse_store, "checkpoint", str(m), "--json").stdout)["ref"]
    assert first != second
    assert read_in(fuse_store, second, "a.txt") == b"two\n"
    assert [s["ref"] for s in json.loads(cli(fuse_store, "list", "--json").stdout)][-2:] == \
        [first, second]


def test_ro_mount_on_a_new_host_reads_through_its_empty_cache(fuse_store: Path, lower_ref: str,
                                                              tmp_path: Path) -> None:
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


def test_s3_killed_mid_multipart_upload_of_a_big_pack(mounter: fh.Mounter, fuse_store: Path,
                                                      lower_ref: str,
                                                      own_seaweed: object) -> None:
    import threading
    import time

    from fusefs.control import Client
    from fusefs.session.errors import CheckpointError
    from store.s3 import MULTIPART_THRESHOLD

    cfg = json.loads((fuse_store / "store.json").read_text())
    bucket = cfg["blobs"][5:].split("/")[0]
    d = mounter.rw(lower_ref)
    m = d.mnt
    # 160 MiB of incompressible data: five packs of about 32 MiB, each uploaded in parts.
    big = os.urandom(160 << 20)
    (m / "big.bin").write_bytes(big)
    (m / "note.txt").write_text("small change\n")
    assert 32 << 20 >= MULTIPART_THRESHOLD
    outcome: list[BaseException | dict[str, object]] = []

    def checkpoint() -> None:
        try:
            outcome.append(Client.for_mount(str(m)).checkpoint(timeout_s=300))
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=checkpoint)
    s3 = own_seaweed.client()  # type: ignore[attr-defined]
    t.start()
    try:
        # Kill the server (SIGKILL, no shutdown) as soon as a multipart upload of a pack is
        # under way: its parts are partly sent and it was never completed.
        deadline = time.monotonic() + 120
        uploads: list[dict[str, object]] = []
        while not uploads and t.is_alive() and time.monotonic() < deadline:
            uploads = [u for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", ())
                       if "/packs/" in str(u["Key"])]
        own_seaweed.kill()  # type: ignore[attr-defined]
        t.join(timeout=300)
        assert uploads, "no multipart upload seen before the checkpoint ended"
        (err,) = outcome
        assert isinstance(err, CheckpointError), err
        assert "s3://" in str(err)
        # The mount keeps serving every change, and takes new ones.
        assert (m / "note.txt").read_text() == "small change\n"
        (m / "during.txt").write_text("written while the server was dead\n")
        with open(m / "big.bin", "rb") as f:
            assert f.read() == big
    finally:
        own_seaweed.start()  # type: ignore[attr-defined]
    s3 = own_seaweed.client()  # type: ignore[attr-defined]
    half = {str(u["Key"]).split("/", 1)[1] for u in uploads}
    st = Store(fuse_store)
    try:
        # The half-uploaded pack is not an object, and the catalog references nothing of
        # the failed checkpoint.
        keys = {o["Key"].split("/", 1)[1]
                for o in s3.list_objects_v2(Bucket=bucket).get("Contents", ())}
        assert not half & keys
        indexed = {p[0] for p in st.catalog.packs()}
        assert not half & indexed
        assert indexed <= keys
    finally:
        st.close()
    # The next checkpoint, with the server back, succeeds with every change.
    r = cli(fuse_store, "checkpoint", str(m), "--json")
    ref = json.loads(r.stdout)["ref"]
    assert read_in(fuse_store, ref, "note.txt") == b"small change\n"
    assert read_in(fuse_store, ref, "during.txt") == b"written while the server was dead\n"
    assert read_in(fuse_store, ref, "big.bin") == big
    assert _problems(fuse_store) == []
    # The killed upload was never completed: its parts stay stored until it is aborted.
    # GC aborts it once it is older than the grace period, never before.
    killed = {str(u["UploadId"]) for u in uploads}

    def unfinished() -> set[str]:
        return {str(u["UploadId"]) for u in s3.list_multipart_uploads(Bucket=bucket).get(
            "Uploads", ()) if "/packs/" in str(u["Key"])}

    assert killed <= unfinished()
    report = json.loads(cli(fuse_store, "gc", "--json").stdout)  # grace: an hour
    assert report["uploads_aborted"] == 0 and killed <= unfinished()
    report = json.loads(cli(fuse_store, "gc", "--grace", "0", "--json").stdout)
    assert report["uploads_aborted"] >= len(killed)
    assert not killed & unfinished()
    assert read_in(fuse_store, ref, "big.bin") == big  # what is live stays
    assert (m / "note.txt").read_text() == "small change\n"


def test_the_catalog_reconnects_at_once_after_a_long_outage(own_postgres: object) -> None:
    """PostgreSQL down for many operations: each fails with CatalogError naming the
    server's reason (on one line), and the first operation after it returns succeeds. The
    pool's own reconnection attempts back off (1, 2, 4, 8, 16 s apart): it alone answered
    'couldn't get a connection' for up to minutes after the server was back."""
    from store.errors import CatalogError
    from store.pgcatalog import PostgresCatalog

    cat = PostgresCatalog(own_postgres.new_database(), timeout_s=1.0)  # type: ignore[attr-defined]
    try:
        cat.set_config("k", "before the outage")
        own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
        try:
            for _ in range(20):
                with pytest.raises(CatalogError) as raised:
                    cat.config_value("k")
                msg = str(raised.value)
                assert "\n" not in msg and "Connection refused" in msg, msg
        finally:
            own_postgres.start()  # type: ignore[attr-defined]
        assert cat.config_value("k") == "before the outage"
        cat.set_config("k", "after")
        assert cat.config_value("k") == "after"
    finally:
        cat.close()


def test_a_mounted_snapshot_reads_without_the_catalog(fuse_store: Path, lower_ref: str,
                                                      tmp_path: Path,
                                                      own_postgres: object) -> None:
    """A read-only mount on a host that had read nothing of the snapshot: with PostgreSQL
    stopped, every directory and file of it still reads (their locations were copied to the
    host when it mounted), while a command that needs the catalog fails naming it."""
    cfg = json.loads((fuse_store / "store.json").read_text())
    host_b = tmp_path / "host-b"
    configure(str(host_b), SharedConfig(cfg["blobs"], cfg["catalog"], cfg["s3_endpoint"],
                                        str(tmp_path / "cache-b")))
    mnt = tmp_path / "ro-b"
    mnt.mkdir()
    cli(host_b, "mount", "--ro", lower_ref, str(mnt))
    try:
        src = tmp_path / "lower-src"
        own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
        try:
            for p in src.rglob("*"):
                q = mnt / p.relative_to(src)
                if p.is_dir() and not p.is_symlink():
                    assert sorted(os.listdir(q)) == sorted(os.listdir(p)), p
                elif p.is_file() and not p.is_symlink():
                    assert q.read_bytes() == p.read_bytes(), p
            r = cli(host_b, "list", check=False)
            assert r.returncode != 0
            assert "catalog" in r.stderr and "postgresql://" in r.stderr, r.stderr
        finally:
            own_postgres.start()  # type: ignore[attr-defined]
    finally:
        cli(host_b, "umount", str(mnt))


def test_a_hung_s3_server_fails_a_read_within_the_configured_bounds(
        fuse_store: Path, lower_ref: str, tmp_path: Path, own_seaweed: object) -> None:
    """SeaweedFS stopped with SIGSTOP (it accepts connections and never answers): a read
    on a host with an empty cache fails with the backend's error, after the attempts and
    timeouts set in the environment, which it names."""
    import signal

    cfg = json.loads((fuse_store / "store.json").read_text())
    host_b = tmp_path / "host-b"
    configure(str(host_b), SharedConfig(cfg["blobs"], cfg["catalog"], cfg["s3_endpoint"],
                                        str(tmp_path / "cache-b")))
    env = dict(os.environ, REWINDFS_S3_ATTEMPTS="2", REWINDFS_S3_READ_TIMEOUT="0.5",
               REWINDFS_S3_CONNECT_TIMEOUT="0.5")
    group = own_seaweed.proc.pid  # type: ignore[attr-defined]
    os.killpg(group, signal.SIGSTOP)
    try:
        r = cli(host_b, "cat", lower_ref, "dir/sub/b.txt", check=False, env=env)
    finally:
        os.killpg(group, signal.SIGCONT)
    assert r.returncode != 0
    assert "s3://" in r.stderr, r.stderr
    assert "gave up after 2 attempts, each 0.5 s to connect and 0.5 s of silence" in r.stderr, \
        r.stderr
    bad = dict(env, REWINDFS_S3_ATTEMPTS="0")
    r = cli(host_b, "cat", lower_ref, "dir/sub/b.txt", check=False, env=bad)
    assert r.returncode == 2 and "REWINDFS_S3_ATTEMPTS" in r.stderr, r.stderr


def _host_b(fuse_store: Path, tmp_path: Path) -> Path:
    """A second host of ``fuse_store``'s shared store: its own local directory and cache."""
    cfg = json.loads((fuse_store / "store.json").read_text())
    host_b = tmp_path / "host-b"
    configure(str(host_b), SharedConfig(cfg["blobs"], cfg["catalog"], cfg["s3_endpoint"],
                                        str(tmp_path / "cache-b")))
    return host_b


def test_read_only_commands_need_s3_only_for_what_is_not_cached(
        fuse_store: Path, tmp_path: Path, own_seaweed: object) -> None:
    """S3 stopped: list and session list need only the catalog, ls and cat of what the host
    read before come from its range cache; cat of a file whose chunks were never read
    fails with exit 11 in one line naming the S3 object (opening the store probed the
    bucket first, so every command failed with exit 11)."""
    src = tmp_path / "src"
    (src / "dir").mkdir(parents=True)
    (src / "dir" / "read.bin").write_bytes(os.urandom(300 << 10))
    (src / "unread.bin").write_bytes(os.urandom(300 << 10))
    ref = json.loads(cli(fuse_store, "snapshot", str(src), "--json").stdout)["ref"]
    host_b = _host_b(fuse_store, tmp_path)
    assert _cat_bytes(host_b, ref, "dir/read.bin", dict(os.environ)) == \
        (src / "dir" / "read.bin").read_bytes()  # host B reads it once: now in its cache
    listing = json.loads(cli(host_b, "list", "--json").stdout)
    env = dict(os.environ, REWINDFS_S3_ATTEMPTS="1", REWINDFS_S3_CONNECT_TIMEOUT="1")
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        assert json.loads(cli(host_b, "list", "--json", env=env).stdout) == listing
        assert json.loads(cli(host_b, "session", "list", "--json", env=env).stdout) == []
        assert _cat_bytes(host_b, ref, "dir/read.bin", env) == \
            (src / "dir" / "read.bin").read_bytes()
        names = [e["name"] for e in json.loads(cli(host_b, "ls", ref, "dir", "--json",
                                                   env=env).stdout)]
        assert names == ["read.bin"]
        r = cli(host_b, "cat", ref, "unread.bin", check=False, env=env)
        assert r.returncode == 11, (r.returncode, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("rewindfs: "), r.stderr
        assert "s3://" in r.stderr and "packs/" in r.stderr, r.stderr
    finally:
        own_seaweed.start()  # type: ignore[attr-defined]
    assert _cat_bytes(host_b, ref, "unread.bin", env) == (src / "unread.bin").read_bytes()


def _cat_bytes(store: Path, ref: str, path: str, env: dict[str, str]) -> bytes:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(store), "cat", ref,
                        path], capture_output=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_a_read_through_a_mount_on_a_hung_s3_server_asks_it_once(
        fuse_store: Path, tmp_path: Path, own_seaweed: object) -> None:
    """SeaweedFS stopped with SIGSTOP under a read-only mount of a host with an empty
    cache: the first read of a file fails with EIO after one request's attempts; the
    kernel's retry of it as a plain read and a later read of the file fail with EIO
    without a request (each was a request of its own, 81 s to EIO with the default
    bounds). The daemon's log says so: one request timed out, every other failure was
    held off."""
    import errno
    import json
    import signal

    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(300 << 10))
    ref = json.loads(cli(fuse_store, "snapshot", str(src), "--json").stdout)["ref"]
    host_b = _host_b(fuse_store, tmp_path)
    env = dict(os.environ, REWINDFS_S3_ATTEMPTS="2", REWINDFS_S3_READ_TIMEOUT="0.5",
               REWINDFS_S3_CONNECT_TIMEOUT="0.5", REWINDFS_S3_HOLD_OFF="3600")
    mnt = tmp_path / "ro-b"
    mnt.mkdir()
    log = tmp_path / "daemon-b.log"
    cli(host_b, "mount", "--ro", ref, str(mnt), "--log", str(log), env=env)
    try:
        group = own_seaweed.proc.pid  # type: ignore[attr-defined]
        os.killpg(group, signal.SIGSTOP)
        try:
            for _ in range(2):
                with pytest.raises(OSError) as raised:
                    (mnt / "data.bin").read_bytes()
                assert raised.value.errno == errno.EIO
        finally:
            os.killpg(group, signal.SIGCONT)
    finally:
        cli(host_b, "umount", str(mnt))
    failed = [x for x in log.read_text().splitlines() if "read failed: BackendError" in x]
    held = [x for x in failed if "not asked again for" in x]  # they name the timeout too
    asked = [x for x in failed if "gave up after 2 attempts" in x and x not in held]
    assert len(asked) == 1 and len(held) == len(failed) - 1 >= 1, failed


def test_a_mount_reads_a_repaired_pack_past_its_range_cache(fuse_store: Path, tmp_path: Path,
                                                            own_seaweed: object) -> None:
    """Two bytes of the pack holding a 3 MiB file flipped on S3: a read-only mount on host
    B fails the read with EIO (never wrong bytes) and its range cache keeps the damaged
    ranges; with the pack put back, a new mount's 4 KiB reads all over the file (the
    frames and blocks path) and a whole read give the exact bytes."""
    import errno

    src = tmp_path / "src"
    src.mkdir()
    want = os.urandom(3 << 20)
    (src / "big.bin").write_bytes(want)
    ref = json.loads(cli(fuse_store, "snapshot", str(src), "--json").stdout)["ref"]
    bucket, _, prefix = json.loads((fuse_store / "store.json").read_text())["blobs"][5:] \
        .partition("/")
    s3 = own_seaweed.client()  # type: ignore[attr-defined]
    packs = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/packs/")["Contents"]
    key = max(packs, key=lambda o: o["Size"])["Key"]
    good = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    for i in (len(bad) // 2 + 100, len(bad) // 2 + 101):
        bad[i] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    host_b = _host_b(fuse_store, tmp_path)
    mnt = tmp_path / "ro-b"
    mnt.mkdir()
    cli(host_b, "mount", "--ro", ref, str(mnt))
    try:
        with pytest.raises(OSError) as e:
            (mnt / "big.bin").read_bytes()
        assert e.value.errno == errno.EIO
    finally:
        cli(host_b, "umount", str(mnt))
    assert any((tmp_path / "cache-b").rglob("*-*"))

    s3.put_object(Bucket=bucket, Key=key, Body=good)
    cli(host_b, "mount", "--ro", ref, str(mnt))
    try:
        fd = os.open(mnt / "big.bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for off in range(len(want) - 4096, -1, -4096):  # backwards: no read-ahead run
                assert os.pread(fd, 4096, off) == want[off:off + 4096], off
        finally:
            os.close(fd)
        assert (mnt / "big.bin").read_bytes() == want
    finally:
        cli(host_b, "umount", str(mnt))
