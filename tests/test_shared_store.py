"""Shared mode end to end: packs on SeaweedFS, the catalog on PostgreSQL, two "hosts".

A host is a store configuration of its own (local directory, cache, host id) and its own
processes; both talk to the same real servers (tests/servers.py). Through the CLI: the
configuration rules, a snapshot taken on host A read and materialized digest-equal on host
B, nothing uploaded twice, and a session lease taken over on B fencing A's late append.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from store.config import SharedConfig, StoreConfigError, configure
from store.errors import FencedError, LeaseLostError
from store.ref import Ref

REPO = Path(__file__).resolve().parent.parent


def _cli(args: list[str], env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "rewindfs", *args], cwd=REPO, text=True,
                       capture_output=True, env={**os.environ, **(env or {})}, timeout=300)
    if check and r.returncode != 0:
        raise AssertionError(f"rewindfs {' '.join(args)} exited {r.returncode}:\n{r.stderr}")
    return r


class Host:
    """One host's view of the shared store: its options for every command."""

    def __init__(self, name: str, tmp: Path, url: str, endpoint: str, dsn: str) -> None:
        self.name = name
        self.local = tmp / f"{name}-local"
        self.opts = ["--store", url, "--s3-endpoint", endpoint, "--catalog", dsn,
                     "--local", str(self.local), "--host-id", name]
        self.env = {"XDG_CACHE_HOME": str(tmp / f"{name}-cache")}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _cli([*self.opts, *args], self.env, check)

    def json(self, *args: str) -> object:
        return json.loads(self.run(*args, "--json").stdout)


def two_hosts(s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path,
              cls: type[Host] = Host) -> tuple[Host, Host]:
    """Hosts A and B (``cls``) of one shared store on the test's servers."""
    url = f"s3://{s3_bucket}/team/store"
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    return cls("hostA", tmp_path, url, ep, pg_dsn), cls("hostB", tmp_path, url, ep, pg_dsn)


@pytest.fixture
def hosts(s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> tuple[Host, Host]:
    return two_hosts(s3_env, s3_bucket, pg_dsn, tmp_path)


def _configure_host(local: Path, s3_env: object, store: str, dsn: str, cache: Path) -> None:
    """``local`` made a host of the shared store ``store`` (an s3:// URL on the test's
    SeaweedFS) with the catalog ``dsn`` and its own cache directory ``cache``."""
    configure(str(local), SharedConfig(store, dsn, s3_env.endpoint,  # type: ignore[attr-defined]
                                       str(cache)))


def _tree(tmp: Path) -> Path:
    src = tmp / "src"
    (src / "pkg" / "sub").mkdir(parents=True)
    (src / "README").write_text("shared mode\n")
    (src / "pkg" / "big.bin").write_bytes(os.urandom(3 << 20))
    (src / "pkg" / "sub" / "x.py").write_text("print('x')\n" * 100)
    os.symlink("../README", src / "pkg" / "link")
    os.chmod(src / "pkg" / "sub" / "x.py", 0o755)
    return src


def test_a_catalog_without_a_remote_store_is_refused(tmp_path: Path, pg_dsn: str) -> None:
    r = _cli(["--store", str(tmp_path / "st"), "--catalog", pg_dsn, "list"], check=False)
    assert r.returncode == 2 and "remote store" in r.stderr
    assert not (tmp_path / "st").exists()


def test_a_remote_store_without_a_catalog_is_refused(tmp_path: Path, s3_bucket: str) -> None:
    r = _cli(["--store", f"s3://{s3_bucket}/x", "--local", str(tmp_path / "l"), "list"],
             check=False)
    assert r.returncode == 2 and "catalog" in r.stderr
    assert not (tmp_path / "l").exists()


def test_a_catalog_that_refuses_is_one_line_naming_its_reason(s3_env: object, s3_bucket: str,
                                                              postgres: object,
                                                              tmp_path: Path) -> None:
    """No such database: exit 12 (the catalog's) at once with the server's reason on one
    line (it was the pool's multi-line warnings for 10 s, then 'pool initialization
    incomplete'), and the local directory is not bound to that store: the same --local
    with the right catalog then works. A bucket that does not exist is exit 11."""
    bad = postgres.dsn("no_such_db")  # type: ignore[attr-defined]
    local = tmp_path / "l"
    opts = ["--store", f"s3://{s3_bucket}/x", "--s3-endpoint",
            s3_env.endpoint, "--local", str(local)]  # type: ignore[attr-defined]
    r = _cli([*opts, "--catalog", bad, "list"], check=False)
    assert r.returncode == 12, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("rewindfs: "), r.stderr
    assert 'database "no_such_db" does not exist' in r.stderr, r.stderr
    assert not (local / "store.json").exists()
    good = postgres.new_database()  # type: ignore[attr-defined]
    _cli([*opts, "--catalog", good, "list"])
    r = _cli(["--store", f"s3://{s3_bucket}-missing/x", "--s3-endpoint",
              s3_env.endpoint, "--catalog", good,  # type: ignore[attr-defined]
              "--local", str(tmp_path / "m"), "list"], check=False)
    assert r.returncode == 11 and "s3://" in r.stderr, r.stderr
    assert not (tmp_path / "m" / "store.json").exists()


def test_a_catalog_that_never_answers_fails_on_its_connect_timeout(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that takes the connection and never says a word (a socket listening on
    loopback that nothing accepts from): a first binding's probe, a command and ``doctor``
    on a bound directory, and the catalog itself, each fail with exit 12 naming the connect
    timeout and what set it: 3 s by default, else REWINDFS_CATALOG_CONNECT_TIMEOUT, else
    PGCONNECT_TIMEOUT (they waited 5 s, 10 s, and the pool's timeout however long). A
    setting that is not a whole number of seconds from 2 is exit 2 naming it."""
    from store.errors import CatalogError
    from store.pgcatalog import PostgresCatalog

    for var in ("REWINDFS_CATALOG_CONNECT_TIMEOUT", "PGCONNECT_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        dsn = f"postgresql://postgres@127.0.0.1:{silent.getsockname()[1]}/db"
        local = tmp_path / "l"
        opts = ["--store", f"s3://{s3_bucket}/x", "--s3-endpoint",
                s3_env.endpoint, "--local", str(local)]  # type: ignore[attr-defined]

        def timed_out(r: subprocess.CompletedProcess[str], seconds: int, setting: str) -> None:
            assert r.returncode == 12, r.stderr
            assert r.stderr.count("\n") == 1, r.stderr
            assert (f"cannot reach the catalog at {dsn}: no answer within {seconds} s (the "
                    f"connect timeout, from {setting}; REWINDFS_CATALOG_CONNECT_TIMEOUT sets "
                    "it)") in r.stderr, r.stderr

        timed_out(_cli([*opts, "--catalog", dsn, "list"], check=False), 3, "the default")
        timed_out(_cli([*opts, "--catalog", dsn, "list"], {"PGCONNECT_TIMEOUT": "2"},
                       check=False), 2, "PGCONNECT_TIMEOUT")
        timed_out(_cli([*opts, "--catalog", dsn, "list"],
                       {"REWINDFS_CATALOG_CONNECT_TIMEOUT": "2", "PGCONNECT_TIMEOUT": "9"},
                       check=False), 2, "REWINDFS_CATALOG_CONNECT_TIMEOUT")
        assert not (local / "store.json").exists()
        r = _cli([*opts, "--catalog", dsn, "list"],
                 {"REWINDFS_CATALOG_CONNECT_TIMEOUT": "soon"}, check=False)
        assert r.returncode == 2, r.stderr
        assert "REWINDFS_CATALOG_CONNECT_TIMEOUT='soon': not a whole number" in r.stderr

        _cli([*opts, "--catalog", pg_dsn, "list"])            # bound, then its server hangs
        cfg = json.loads((local / "store.json").read_text())
        (local / "store.json").write_text(json.dumps({**cfg, "catalog": dsn}))
        timed_out(_cli(["--store", str(local), "list"], check=False), 3, "the default")
        r = _cli(["--store", str(local), "doctor", "--json"], check=False)
        check = {c["name"]: c for c in json.loads(r.stdout)["checks"]}["shared_catalog"]
        assert check["status"] == "fail" and "no answer within 3 s" in check["detail"], check
        with pytest.raises(CatalogError, match="no answer within 3 s"):
            PostgresCatalog(dsn, timeout_s=3600)
        with pytest.raises(CatalogError, match="within 2 s .the connect timeout, from the "
                                               "URL's connect_timeout"):
            PostgresCatalog(f"{dsn}?connect_timeout=2")


def test_a_local_dir_belongs_to_one_store(tmp_path: Path) -> None:
    a = SharedConfig("s3://b/one", "postgresql://h/db")
    configure(str(tmp_path / "l"), a)
    configure(str(tmp_path / "l"), a)  # the same store again: fine
    assert oct(os.stat(tmp_path / "l" / "store.json").st_mode & 0o777) == "0o600"
    with pytest.raises(StoreConfigError):
        configure(str(tmp_path / "l"), SharedConfig("s3://b/two", "postgresql://h/db"))
    from store.objects import Store

    Store(tmp_path / "embedded")
    (tmp_path / "embedded" / "backend" / "packs").mkdir(exist_ok=True)
    with pytest.raises(StoreConfigError):
        configure(str(tmp_path / "embedded"), a)


def test_a_local_dir_bound_to_another_prefix_names_both(hosts: tuple[Host, Host]) -> None:
    """The same --local with another bucket/prefix: exit 2 naming what differs (the prefix
    in store.json and the one given) and what to do, not another catalog or endpoint."""
    a, _ = hosts
    a.run("list")
    old = a.opts[a.opts.index("--store") + 1]
    new = old.replace("/team/store", "/team/other")
    opts = [new if o == old else o for o in a.opts]
    r = _cli([*opts, "list"], a.env, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert f"its S3 bucket/prefix is {old} (store.json), not {new} (given)" in r.stderr
    assert "use another --local directory" in r.stderr and f"--store {old}" in r.stderr
    assert "its catalog" not in r.stderr and "its S3 endpoint" not in r.stderr, r.stderr
    assert json.loads((a.local / "store.json").read_text())["blobs"] == old


def test_snapshot_on_host_a_is_read_and_materialized_on_host_b(hosts: tuple[Host, Host],
                                                               tmp_path: Path) -> None:
    a, b = hosts
    src = _tree(tmp_path)
    snap = a.json("snapshot", str(src))
    ref = snap["ref"]  # type: ignore[index]
    assert snap["packs_written"] >= 1  # type: ignore[index]
    listed = b.json("list")
    assert [s["ref"] for s in listed] == [ref]  # type: ignore[union-attr]
    assert b.run("cat", ref, "README").stdout == "shared mode\n"
    dest = tmp_path / "on-b"
    b.run("materialize", ref, str(dest))
    for rel in ("README", "pkg/big.bin", "pkg/sub/x.py"):
        assert (dest / rel).read_bytes() == (src / rel).read_bytes()
    assert os.readlink(dest / "pkg" / "link") == "../README"
    # Digest-equal: host B snapshotting what it materialized gets the same Ref, and the
    # same tree snapshotted on B uploads nothing (every chunk is already in the store).
    again = b.json("snapshot", str(src))
    assert again["ref"] == ref and again["packs_written"] == 0  # type: ignore[index]
    # Host B's local directory holds no packs: they are all in the bucket.
    assert not (b.local / "backend" / "packs").exists()
    assert not list(b.local.rglob("*.pack"))


def test_session_lease_taken_over_on_b_fences_a(hosts: tuple[Host, Host], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from store.lease import Leaser, holder_name
    from store.objects import Store
    from store.snapshot import run_snapshot

    a, b = hosts
    src = _tree(tmp_path)
    ref = a.json("snapshot", str(src))["ref"]  # type: ignore[index]
    a.run("list")  # both local dirs configured
    b.run("list")
    monkeypatch.setenv("XDG_CACHE_HOME", a.env["XDG_CACHE_HOME"])
    st_a = Store(a.local)
    monkeypatch.setenv("XDG_CACHE_HOME", b.env["XDG_CACHE_HOME"])
    st_b = Store(b.local)
    monkeypatch.setenv("REWINDFS_HOST_ID", "hostA")
    lease_a = Leaser(st_a).acquire("session/s1", holder_name(os.getpid(), "a"), 0.5)
    st_a.append_journal("s1", "WorkspaceCheckpointed", ref, epoch=lease_a.epoch,
                        trigger="manual", consistency="quiescent", fence="session/s1")
    # Host A pauses past its ttl; host B takes the session over (same pid means nothing on
    # another host: B waits for the expiry, which has passed).
    import time

    time.sleep(0.6)
    monkeypatch.setenv("REWINDFS_HOST_ID", "hostB")
    lease_b = Leaser(st_b).acquire("session/s1", holder_name(os.getpid(), "b"), 60)
    assert lease_b.epoch == lease_a.epoch + 1
    ref2 = run_snapshot(st_b, str(src), origin="checkpoint").ref
    st_b.append_journal("s1", "WorkspaceCheckpointed", ref2, epoch=lease_b.epoch,
                        trigger="manual", consistency="quiescent", fence="session/s1")
    with pytest.raises(FencedError):
        st_a.append_journal("s1", "WorkspaceCheckpointed", ref, epoch=lease_a.epoch,
                            trigger="manual", consistency="quiescent", fence="session/s1")
    events = st_a.journal("s1")
    assert [e.epoch for e in events] == [lease_a.epoch, lease_b.epoch]
    # The session registry is fenced the same way: B registers the session as its own, and
    # A's late registry write (its shutdown's "stopped") is refused in the same transaction.
    from fusefs.session import moves

    row = {"dirty": None, "mode": None, "parent": None, "created_ns": 1, "spec": {}}
    moves.publish(st_b, "s1", moves.RUNNING, head=Ref.parse(ref2), epoch=lease_b.epoch,
                  **row)  # type: ignore[arg-type]
    monkeypatch.setenv("REWINDFS_HOST_ID", "hostA")
    with pytest.raises(FencedError):
        moves.publish(st_a, "s1", moves.STOPPED, head=Ref.parse(ref), epoch=lease_a.epoch,
                      **row)  # type: ignore[arg-type]
    e = moves.entry(st_a, "s1")
    assert e is not None and (e.host, e.state, e.head) == ("hostB", moves.RUNNING, str(ref2))
    with pytest.raises(LeaseLostError):  # nor can A renew
        Leaser(st_a).renew(lease_a, 60)


def test_stats_verify_and_rebuild_index_on_the_shared_store(hosts: tuple[Host, Host],
                                                           tmp_path: Path) -> None:
    a, b = hosts
    src = _tree(tmp_path)
    ref = a.json("snapshot", str(src))["ref"]  # type: ignore[index]
    stats = b.json("stats")
    assert stats["snapshots"] == 1 and stats["packs"] >= 1  # type: ignore[index]
    assert stats["logical_bytes"] == (3 << 20) + len("shared mode\n") + 1100  # type: ignore[index]
    assert b.json("verify")["ok"] is True  # type: ignore[index]
    # Rebuild the shared catalog from the bucket alone: the same list, and verify passes.
    rebuilt = b.json("rebuild-index")
    assert rebuilt["snapshots"] == 1 and rebuilt["packs"] == stats["packs"]  # type: ignore[index]
    assert [s["ref"] for s in a.json("list")] == [ref]  # type: ignore[union-attr]
    r = a.run("gc", check=False)  # a rebuilt catalog: refused until verified, as locally
    assert r.returncode == 8 and "verify first" in r.stderr
    assert a.json("verify")["ok"] is True  # type: ignore[index]
    assert a.json("gc")["packs_deleted"] == 0  # type: ignore[index]  # all listed
    assert a.run("cat", ref, "README").stdout == "shared mode\n"


def test_unchanged_resnapshot_on_a_shared_store_reads_nothing(s3_env: object, s3_bucket: str,
                                                             pg_dsn: str,
                                                             tmp_path: Path) -> None:
    from store.objects import Store
    from store.snapshot import run_snapshot

    local = tmp_path / "host"
    _configure_host(local, s3_env, f"s3://{s3_bucket}/p", pg_dsn,
                    tmp_path / "cache")
    src = _tree(tmp_path)
    # Cache rows are trusted only for files older than the whole second a snapshot starts
    # in (store/snapshot.py): start the first snapshot in the next second.
    import time

    now = time.time()
    time.sleep(1.02 - (now - int(now)))
    st = Store(local)
    first = run_snapshot(st, str(src))
    assert first.files_read > 0
    again = run_snapshot(st, str(src))
    # The per-host files and dirs caches are trusted against the shared catalog.
    assert again.ref == first.ref and again.files_read == 0 and again.bytes_read == 0
    (src / "pkg" / "sub" / "x.py").write_text("changed\n")
    third = run_snapshot(st, str(src))
    assert third.ref != first.ref and third.files_read == 1


def test_first_snapshot_looks_objects_up_in_batches(s3_env: object, s3_bucket: str,
                                                    pg_dsn: str, tmp_path: Path) -> None:
    from store.objects import Store
    from store.snapshot import run_snapshot

    local = tmp_path / "host"
    _configure_host(local, s3_env, f"s3://{s3_bucket}/p", pg_dsn,
                    tmp_path / "cache")
    src = tmp_path / "many"
    for d in range(20):
        (src / f"d{d}").mkdir(parents=True)
        for f in range(30):
            (src / f"d{d}" / f"f{f}.txt").write_text(f"file {d}/{f}\n")
    (src / "big.bin").write_bytes(os.urandom(3 << 20))
    st = Store(local)
    before = st.catalog.transactions  # type: ignore[attr-defined]
    first = run_snapshot(st, str(src))
    # 600 small files, 3 chunks and 21 trees, each new: one catalog round trip apiece
    # before; now a few batched look-ups plus the snapshot's own bookkeeping.
    assert st.catalog.transactions - before < 30  # type: ignore[attr-defined]
    # A second host with an empty cache reads every file back.
    other = tmp_path / "other"
    _configure_host(other, s3_env, f"s3://{s3_bucket}/p", pg_dsn,
                    tmp_path / "cache2")
    st2 = Store(other)
    tree = st2.root_tree(first.ref)
    assert [e.name for e in tree.entries][:2] == [b"big.bin", b"d0"]
    big = next(e for e in tree.entries if e.name == b"big.bin")
    assert b"".join(st2.iter_file(big)) == (src / "big.bin").read_bytes()
    from store.browse import cat

    assert b"".join(cat(st2, first.ref, "d7/f29.txt")) == b"file 7/29\n"
    # Half of the objects already stored (host 2 adds a directory to the same tree): only
    # the new ones are written.
    for f in range(30):
        (src / "d20").mkdir(exist_ok=True)
        (src / "d20" / f"g{f}.txt").write_text(f"new {f}\n" * 50)
    second = run_snapshot(st2, str(src))
    assert second.packs_written == 1 and second.stored_bytes < 1 << 20
    assert b"".join(cat(st, second.ref, "d20/g3.txt")) == b"new 3\n" * 50
    from store.verify import verify

    assert verify(st2) == []


@pytest.mark.skipif(not os.access("/dev/fuse", os.R_OK | os.W_OK), reason="needs /dev/fuse")
def test_a_mount_of_a_shared_store_named_by_the_environment(s3_env: object, s3_bucket: str,
                                                           pg_dsn: str,
                                                           tmp_path: Path) -> None:
    """The shared options given as ``REWINDFS_*`` variables (as README's Shared mode
    allows): ``mount --ro`` starts its daemon with ``--store`` the local directory, which
    must not inherit the variables (a catalog without an s3:// store: the daemon exited 2
    before mounting)."""
    env = {"REWINDFS_STORE": f"s3://{s3_bucket}/env", "REWINDFS_CATALOG": pg_dsn,
           "REWINDFS_S3_ENDPOINT": s3_env.endpoint,  # type: ignore[attr-defined]
           "REWINDFS_LOCAL": str(tmp_path / "local"),
           "XDG_CACHE_HOME": str(tmp_path / "cache")}
    ref = _cli(["snapshot", str(_tree(tmp_path))], env).stdout.strip()
    mnt = tmp_path / "ro"
    mnt.mkdir()
    try:
        _cli(["mount", "--ro", ref, str(mnt)], env)
        assert (mnt / "README").read_text() == "shared mode\n"
        _cli(["umount", str(mnt)], env)
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


def test_a_checkpoint_of_ten_appends_makes_a_few_round_trips(s3_env: object, s3_bucket: str,
                                                             pg_dsn: str,
                                                             tmp_path: Path) -> None:
    from fusefs.checkpoint import checkpoint_overlay
    from fusefs.lower import Lower
    from fusefs.overlay import Overlay
    from fusefs.upper import Upper
    from store.browse import cat
    from store.objects import Store
    from store.snapshot import snapshot

    local = tmp_path / "host"
    _configure_host(local, s3_env, f"s3://{s3_bucket}/ck", pg_dsn,
                    tmp_path / "cache")
    src = tmp_path / "src"
    for d in range(5):
        (src / f"d{d}").mkdir(parents=True)
        for f in range(4):
            (src / f"d{d}" / f"f{f}.py").write_text(f"# file {d}/{f}\n" * 40)
    st = Store(local)
    up = Upper.open(str(tmp_path / "state"), store_root=st.root, chunk_size=st.chunk_size,
                    ref=snapshot(st, src))
    ov = Overlay(Lower(st, up.base), up, uid=os.getuid(), gid=os.getgid())
    try:
        for i in range(2):  # the second appends to what the first checkpoint wrote
            for d in range(5):
                for f in range(2):
                    n = ov.resolve(f"d{d}/f{f}.py")
                    fh = ov.open(n.ino, os.O_WRONLY)
                    ov.write(fh, n.size, b"# change %d\n" % i)
                    ov.release(fh)
            before = st.catalog.transactions  # type: ignore[attr-defined]
            misses = st.backend.misses  # type: ignore[attr-defined]
            res = checkpoint_overlay(ov)
            # Pin, one look-up of the lower chunks the appends land in, one dedup look-up,
            # the index commit, the listing's check and row, the unpin: not one per file.
            assert st.catalog.transactions - before <= 8, i  # type: ignore[attr-defined]
            if i:  # what the first checkpoint wrote is read back from the cache
                assert st.backend.misses == misses  # type: ignore[attr-defined]
            assert b"".join(cat(st, res.ref, "d4/f1.py")) == \
                (src / "d4" / "f1.py").read_bytes() + b"".join(
                    b"# change %d\n" % j for j in range(i + 1))
    finally:
        ov.close()
        st.close()


def test_doctor_checks_the_shared_stores_bucket_and_catalog(s3_env: object, s3_bucket: str,
                                                            postgres: object,
                                                            tmp_path: Path) -> None:
    """doctor said 'ready' for a shared store whose bucket refused this host's keys or
    whose catalog did not exist; now each is a failed check (exit 1), and it only looks."""
    good = tmp_path / "good"
    dsn = postgres.new_database()  # type: ignore[attr-defined]
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    configure(str(good), SharedConfig(f"s3://{s3_bucket}/d", dsn, ep, str(tmp_path / "c")))

    def doctor(local: Path, env: dict[str, str] | None = None) -> tuple[int, dict[str, str]]:
        r = _cli(["--store", str(local), "doctor", "--json"], env, check=False)
        doc = json.loads(r.stdout)
        return r.returncode, {c["name"]: c["status"] for c in doc["checks"]
                              if c["name"].startswith("shared_")}

    assert doctor(good)[1] == {"shared_blobs": "ok", "shared_catalog": "ok"}
    code, got = doctor(good, {"AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert code == 1 and got == {"shared_blobs": "fail", "shared_catalog": "ok"}
    bad = tmp_path / "bad"
    configure(str(bad), SharedConfig(f"s3://{s3_bucket}/d",
                                     postgres.dsn("no_such_db"), ep,  # type: ignore[attr-defined]
                                     str(tmp_path / "c")))
    code, got = doctor(bad)
    assert code == 1 and got == {"shared_blobs": "ok", "shared_catalog": "fail"}
    # Only looked: the new database's catalog was not created by doctor.
    import psycopg

    with psycopg.connect(dsn) as c:
        assert c.execute("SELECT to_regclass('catalog_meta')").fetchone() == (None,)


def _cat(host: Host, ref: str, path: str) -> subprocess.CompletedProcess[bytes]:
    """``rewindfs cat REF PATH`` on ``host``, a process of its own, output as bytes."""
    return subprocess.run([sys.executable, "-m", "rewindfs", *host.opts, "cat", ref, path],
                          cwd=REPO, capture_output=True, env={**os.environ, **host.env},
                          timeout=300)


def _cache_files(host: Host) -> list[Path]:
    """The range files in ``host``'s range cache (``$XDG_CACHE_HOME/rewindfs``)."""
    root = Path(host.env["XDG_CACHE_HOME"]) / "rewindfs"
    return sorted(p for p in root.rglob("*") if p.is_file() and p.parent.name.endswith(".pack"))


def test_a_repaired_pack_is_read_again_past_the_range_cache(hosts: tuple[Host, Host],
                                                            tmp_path: Path, s3_env: object,
                                                            s3_bucket: str) -> None:
    """Two bytes of the pack holding big.bin flipped on S3: cat on host B fails with exit
    5 (never wrong bytes), and its range cache now holds the damaged range. With the
    pack put back, verify is clean and cat in a new process gives the exact bytes with
    exit 0 (the range that failed the object's hash is read once more from S3). Then the
    cache files themselves damaged (one with its digest left stale, one rewritten with a
    matching digest, which only the object's hash can catch): cat is exact again and the
    cache is repaired from S3."""
    import blake3

    a, b = hosts
    src = _tree(tmp_path)
    want = (src / "pkg" / "big.bin").read_bytes()
    ref = a.json("snapshot", str(src))["ref"]  # type: ignore[index]
    s3 = s3_env.client()  # type: ignore[attr-defined]
    packs = s3.list_objects_v2(Bucket=s3_bucket, Prefix="team/store/packs/")["Contents"]
    key = max(packs, key=lambda o: o["Size"])["Key"]  # big.bin's 3 MiB of random bytes
    good = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    for i in (len(bad) // 2, len(bad) // 2 + 1):
        bad[i] ^= 0xFF
    s3.put_object(Bucket=s3_bucket, Key=key, Body=bytes(bad))

    r = _cat(b, ref, "pkg/big.bin")
    assert r.returncode == 5, (r.returncode, r.stderr)
    assert r.stdout != want and b"rewindfs: " in r.stderr, r.stderr
    assert _cache_files(b), "host B cached nothing of the damaged pack"

    s3.put_object(Bucket=s3_bucket, Key=key, Body=good)
    assert b.run("verify").returncode == 0
    for _ in range(2):  # the second from the cache the first repaired
        r = _cat(b, ref, "pkg/big.bin")
        assert r.returncode == 0, r.stderr
        assert r.stdout == want

    files = [f for f in _cache_files(b) if f.stat().st_size > 1 << 16]
    assert len(files) >= 2, files
    stale, rehashed = files[0], files[1]
    blob = bytearray(stale.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    stale.write_bytes(bytes(blob))
    blob = blob[32:]
    body = bytearray(rehashed.read_bytes()[32:])
    body[len(body) // 2 + 100] ^= 0xFF  # in a block's bytes, not its tag
    rehashed.write_bytes(blake3.blake3(bytes(body)).digest() + bytes(body))
    r = _cat(b, ref, "pkg/big.bin")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want
    for f, was in ((stale, blob), (rehashed, body)):
        data = f.read_bytes()
        assert blake3.blake3(data[32:]).digest() == data[:32], f
        assert data[32:] != bytes(was), f
    assert s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == good
