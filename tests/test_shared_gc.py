"""GC of a shared store across hosts (store/sharedgc.py), against real SeaweedFS + PostgreSQL.

Host A's writer runs in a process of its own (its host id, local directory and cache) and is
held in the middle of its upload; host B's ``rewindfs gc`` must never delete what that
writer uploads or reuses: it waits for the writer's pin (or refuses, deleting nothing), and
a writer paused past its pin's expiry has its commit refused rather than indexing packs a GC
may have deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from session_support import child, read_line, reap
from test_shared_store import REPO, Host, _tree, two_hosts

# Host A's writer: a snapshot of SRC that stops after its first pack upload until a line
# comes on stdin (the pause hook wraps the real S3 backend's put; nothing is faked).
WRITER = """
    import os, sys
    from store.objects import Store
    from store.snapshot import run_snapshot

    st = Store(os.environ["LOCAL"])
    put = st.backend.put
    held = []

    def paused_put(key, data):
        put(key, data)
        if key.startswith("packs/") and not held:
            held.append(key)
            print("uploaded", key, flush=True)
            sys.stdin.readline()

    st.backend.put = paused_put
    try:
        print("ref", run_snapshot(st, os.environ["SRC"]).ref, flush=True)
    except Exception as e:
        print("error", type(e).__name__, e, flush=True)
        sys.exit(3)
"""


@pytest.fixture
def hosts(s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> tuple[Host, Host]:
    return two_hosts(s3_env, s3_bucket, pg_dsn, tmp_path)


def _writer(host: Host, src: Path, **env: str) -> subprocess.Popen[str]:
    """WRITER on ``host`` snapshotting ``src`` (``env`` added to its environment), returned
    once it has uploaded its first pack and waits; reaped if it fails before that."""
    w = child(WRITER, env={"LOCAL": str(host.local), "SRC": str(src),
                           "REWINDFS_HOST_ID": host.name, **host.env, **env})
    try:
        line = read_line(w)
        assert line.startswith("uploaded packs/"), line
    except BaseException:
        reap(w)
        raise
    return w


def _go_on(w: subprocess.Popen[str]) -> str:
    """Let a waiting WRITER go on; its last line (``ref REF`` or ``error TYPE ...``)."""
    assert w.stdin is not None
    w.stdin.write("go\n")
    w.stdin.flush()
    return read_line(w)


def _packs(host: Host) -> int:
    return int(host.json("stats")["packs"])  # type: ignore[index]


def test_gc_on_b_keeps_what_a_writer_on_a_uploads_and_reuses(hosts: tuple[Host, Host],
                                                           tmp_path: Path) -> None:
    a, b = hosts
    src = _tree(tmp_path)
    old = a.json("snapshot", str(src))["ref"]  # type: ignore[index]
    a.run("forget", old)  # garbage now, but its chunks are what the next snapshot reuses
    gone_src = tmp_path / "gone"
    gone_src.mkdir()
    (gone_src / "unique.bin").write_bytes(os.urandom(1 << 20))
    gone = a.json("snapshot", str(gone_src))["ref"]  # type: ignore[index]
    a.run("forget", gone)
    again = tmp_path / "again"  # the same files at another path, plus one new file
    shutil.copytree(src, again, symlinks=True)
    (again / "new.bin").write_bytes(os.urandom(1 << 20))

    w = _writer(a, again)
    try:
        packs = _packs(b)
        r = b.run("gc", "--grace", "0", "--wait", "1", check=False)
        assert r.returncode == 8 and "hostA" in r.stderr and "nothing deleted" in r.stderr
        assert _packs(b) == packs
        # A GC started while the writer is pinned waits for it, then collects.
        g = subprocess.Popen([*_cli_args(b), "gc", "--grace", "0", "--wait", "120",
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, **b.env}, cwd=REPO)
        try:
            line = _go_on(w)
            assert line.startswith("ref "), line
            new = line.split()[1]
            out, err = g.communicate(timeout=300)
        finally:
            if g.poll() is None:
                g.kill()
                g.wait()
        assert g.returncode == 0, err
        report = json.loads(out)
        assert report["packs_deleted"] >= 1 and report["bytes_freed"] > 0
    finally:
        reap(w)
    # What A wrote and reused is whole; what nothing reached is gone.
    assert b.json("verify")["ok"] is True  # type: ignore[index]
    dest = tmp_path / "dest"
    b.run("materialize", new, str(dest))
    for rel in ("README", "pkg/big.bin", "new.bin"):
        assert (dest / rel).read_bytes() == (again / rel).read_bytes()
    r = b.run("cat", gone, "unique.bin", check=False)
    assert r.returncode == 4


def _cli_args(host: Host) -> list[str]:
    import sys

    return [sys.executable, "-m", "rewindfs", *host.opts]


def test_a_writer_paused_past_its_pin_is_fenced_and_a_crashed_one_is_waited_for(
        hosts: tuple[Host, Host], tmp_path: Path) -> None:
    a, b = hosts
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(1 << 20))
    a.run("list")  # both local directories configured
    b.run("list")
    # A paused host (SIGSTOP: its pin is not renewed) past its pin's 2 s ttl: B's GC waits
    # for the pin to expire, drops it and deletes the unindexed upload; A's late commit
    # is then refused, so nothing indexes the deleted pack.
    w = _writer(a, src, REWINDFS_WRITER_PIN_TTL="2")
    try:
        os.kill(w.pid, signal.SIGSTOP)
        report = b.json("gc", "--grace", "0", "--wait", "60")
        assert report["leftover_packs"] == 1  # type: ignore[index]
        os.kill(w.pid, signal.SIGCONT)
        assert _go_on(w).startswith("error WriterPinLostError"), "late commit indexed"
        assert w.wait(60) == 3
    finally:
        if w.poll() is None:
            os.kill(w.pid, signal.SIGCONT)
        reap(w)
    assert b.json("verify")["ok"] is True  # type: ignore[index]
    assert b.json("stats")["packs"] == 0  # type: ignore[index]
    # A writer killed mid-upload: GC waits for its pin to expire, then deletes its upload.
    w = _writer(a, src, REWINDFS_WRITER_PIN_TTL="2")
    try:
        w.kill()
        w.wait()
    finally:
        reap(w)
    report = b.json("gc", "--grace", "0", "--wait", "60")
    assert report["leftover_packs"] == 1  # type: ignore[index]
    # Afterwards a writer works as usual.
    ref = a.json("snapshot", str(src))["ref"]  # type: ignore[index]
    b.run("materialize", ref, str(tmp_path / "dest"))
    assert (tmp_path / "dest" / "data.bin").read_bytes() == (src / "data.bin").read_bytes()
    assert b.json("verify")["ok"] is True  # type: ignore[index]


def test_the_pin_of_a_killed_writer_of_this_host_is_dropped_at_once(
        hosts: tuple[Host, Host], tmp_path: Path) -> None:
    """A writer killed mid-upload leaves its pin for its 60 s ttl. A GC on the writer's own
    host proves its holder dead (same host id, pid gone: the rule leases follow), so it
    drops the pin at once (``--wait 0`` succeeds) and reports it; another host's GC cannot
    tell a dead process there from a live one and waits for the expiry."""
    a, b = hosts
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(1 << 20))
    a.run("list")
    b.run("list")
    w = _writer(a, src)  # the default pin ttl: 60 s
    pid = w.pid
    w.kill()
    reap(w)  # its pid is gone
    r = b.run("gc", "--grace", "0", "--wait", "0", check=False)
    assert r.returncode == 8, r.stderr
    assert f"1 writer is still uploading to this store: hostA pid {pid}" in r.stderr, r.stderr
    report = a.json("gc", "--grace", "0", "--wait", "0")
    assert isinstance(report, dict)
    (dropped,) = report["dead_writer_pins"]
    assert dropped.startswith(f"hostA:{pid}:"), report
    assert report["leftover_packs"] == 1, report  # its upload, deleted
    report = b.json("gc", "--grace", "0", "--wait", "0")  # nothing is pinned any more
    assert report["dead_writer_pins"] == [], report  # type: ignore[index]
    assert b.json("verify")["ok"] is True  # type: ignore[index]


def test_the_catalog_serializes_pins_with_the_gc_lease(pg_dsn: str) -> None:
    import time

    from store.errors import WriterPinLostError
    from store.pgcatalog import PostgresCatalog

    c = PostgresCatalog(pg_dsn)
    try:
        now = time.time_ns()
        assert c.pin_writer("hostA:1:a", "hostA", 10**10, now)
        gc = c.lease_acquire("gc", "hostB:2:b", 10**10, now, lambda h: False)
        assert not c.pin_writer("hostA:1:c", "hostA", 10**10, now)  # a GC runs: wait
        assert [p[0] for p in c.writer_pins()] == ["hostA:1:a"]  # the earlier pin stays
        c.add_objects([], [("packs/" + "0" * 64 + ".pack", 10, 0)], pin="hostA:1:a")
        c.drop_writer_pins(["hostA:1:a"])
        with pytest.raises(WriterPinLostError):  # fenced: nothing is indexed
            c.add_objects([], [("packs/" + "1" * 64 + ".pack", 10, 0)], pin="hostA:1:a")
        with pytest.raises(WriterPinLostError):
            c.renew_writer_pin("hostA:1:a", 10**10, now)
        assert [p[0] for p in c.packs()] == ["packs/" + "0" * 64 + ".pack"]
        c.lease_release(gc)
        assert c.pin_writer("hostA:1:c", "hostA", 10**10, now)
    finally:
        c.close()


def test_a_version_1_catalog_is_migrated_keeping_its_packs(pg_dsn: str) -> None:
    import psycopg

    from store.pgcatalog import MIGRATIONS, SCHEMA_VERSION, PostgresCatalog

    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a catalog of the last release
        conn.execute("CREATE TABLE catalog_meta (key text PRIMARY KEY, value text NOT NULL)")
        conn.execute(MIGRATIONS[0])
        conn.execute("INSERT INTO catalog_meta VALUES ('schema_version', '1')")
        conn.execute("INSERT INTO packs VALUES ('packs/old.pack', 5, 1)")
        conn.execute("INSERT INTO snapshots VALUES ('v1:blake3:ab', 7, 'checkpoint', 'old', "
                     "'snapshots/1-add.json'), ('v1:blake3:cd', 8, 'snapshot', NULL, "
                     "'snapshots/2-add.json')")
    c = PostgresCatalog(pg_dsn)
    try:
        assert SCHEMA_VERSION == 4 and c.schema_version() == 4
        assert c.packs() == [("packs/old.pack", 5, 1)]
        # every listed Ref's label is kept as one of the labels it was given
        assert c.snapshot_labels() == [("v1:blake3:ab", "old", 7, "snapshots/1-add.json")]
        assert c.gc_view()[1] == {"packs/old.pack": (5, 0)}  # indexed before the grace
    finally:
        c.close()


def test_a_read_only_mount_on_a_pins_its_ref_against_gc_on_b(hosts: tuple[Host, Host],
                                                             tmp_path: Path) -> None:
    from fusefs.session.fallback import fuse_available

    if not fuse_available():
        pytest.skip("needs /dev/fuse")
    a, b = hosts
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(1 << 20))
    ref = a.json("snapshot", str(src))["ref"]  # type: ignore[index]
    a.run("forget", ref)  # garbage, but host A serves it
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    a.run("mount", "--ro", ref, str(mnt))
    try:
        assert b.json("gc", "--grace", "0")["packs_deleted"] == 0  # type: ignore[index]
        assert (mnt / "data.bin").read_bytes() == (src / "data.bin").read_bytes()
    finally:
        a.run("umount", str(mnt), check=False)
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
    # A killed daemon's pin: only its own host can tell the process is gone, so B's GC
    # keeps the Ref and A's next GC drops the pin and collects it.
    from fusefs.mounts import read_record

    a.run("mount", "--ro", ref, str(mnt))
    try:
        rec = read_record(str(mnt))
        assert rec is not None
        os.kill(int(rec["pid"]), signal.SIGKILL)
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
    assert b.json("gc", "--grace", "0")["packs_deleted"] == 0  # type: ignore[index]
    assert a.json("gc", "--grace", "0")["packs_deleted"] == 1  # type: ignore[index]
    assert b.run("cat", ref, "data.bin", check=False).returncode == 4


def test_a_read_write_mount_on_a_pins_what_its_state_holds_against_gc_on_b(
        hosts: tuple[Host, Host], tmp_path: Path) -> None:
    from fusefs.session.fallback import fuse_available

    if not fuse_available():
        pytest.skip("needs /dev/fuse")
    a, b = hosts
    src = tmp_path / "src"
    src.mkdir()
    text = os.urandom(1 << 18).hex() + "\n"
    (src / "data.txt").write_text(text)
    ref = a.json("snapshot", str(src))["ref"]  # type: ignore[index]
    a.run("forget", ref)  # listed nowhere, in no journal: only the mount on A holds it
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    a.run("mount", ref, str(mnt), "--state", str(tmp_path / "state"))
    try:
        assert b.json("gc", "--grace", "0")["packs_deleted"] == 0  # type: ignore[index]
        assert b.run("cat", ref, "data.txt").stdout == text
        # A checkpoint moves the pins to the new base, which is kept though forgotten too.
        (mnt / "new.txt").write_text("after the mount\n")
        new = a.json("checkpoint", str(mnt))["ref"]  # type: ignore[index]
        a.run("forget", new)
        b.json("gc", "--grace", "0")
        assert b.run("cat", new, "new.txt").stdout == "after the mount\n"
        assert b.run("cat", new, "data.txt").stdout == text
        assert (mnt / "data.txt").read_text() == text
    finally:
        a.run("umount", str(mnt), check=False)
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)
    # Unmounted, nothing pins it any more (as on the embedded store): B's GC collects it.
    assert b.json("gc", "--grace", "0")["packs_deleted"] >= 1  # type: ignore[index]
    assert b.run("cat", new, "new.txt", check=False).returncode == 4


def test_a_gc_makes_every_host_drop_its_dirs_cache(hosts: tuple[Host, Host], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlite3

    a, b = hosts
    src = _tree(tmp_path)
    # The dirs cache records only directories older than the snapshot's horizon, the
    # whole second it starts in (store.snapshot.trust_horizon_ns): a tree made in that
    # same second gets no row. Wait into the next second (plus the coarse clock's tick).
    time.sleep(1.02 - time.time() % 1)
    a.run("snapshot", str(src))
    gone = tmp_path / "gone"
    gone.mkdir()
    (gone / "f").write_bytes(os.urandom(1 << 16))
    a.run("forget", a.json("snapshot", str(gone))["ref"])  # type: ignore[arg-type, index]

    def rows() -> int:
        c = sqlite3.connect(a.local / "index.sqlite")
        try:
            return int(c.execute("SELECT COUNT(*) FROM dirs_cache").fetchone()[0])
        finally:
            c.close()

    assert rows() > 0
    assert b.json("gc", "--grace", "0")["packs_deleted"] == 1  # type: ignore[index]
    assert rows() > 0  # B cannot reach A's cache: A's next writer drops it
    from store.objects import Store

    monkeypatch.setenv("XDG_CACHE_HOME", a.env["XDG_CACHE_HOME"])
    monkeypatch.setenv("REWINDFS_HOST_ID", a.name)
    st = Store(a.local)
    try:
        with st.writer():
            assert rows() == 0
    finally:
        st.close()
    again = a.json("snapshot", str(src))  # recorded again, the same Ref
    assert rows() > 0 and again["packs_written"] == 0  # type: ignore[index]


def test_rebuild_index_waits_for_the_writers_of_every_host(hosts: tuple[Host, Host],
                                                           tmp_path: Path) -> None:
    """``rebuild-index`` on host B replaces the shared catalog's tables: like GC it holds
    the ``gc`` lease and refuses while host A's writer is pinned mid-upload (its packs
    would be left out of the rebuilt index, or its commit lost), and works once it is
    done."""
    a, b = hosts
    src = _tree(tmp_path)
    a.run("list")
    w = _writer(a, src)
    try:
        r = b.run("rebuild-index", "--wait", "1", check=False)
        assert r.returncode == 8, r.stderr
        # One line naming the command, the writer's host and pid and what to do (it was
        # 'gc wait writer_pins: 1 writer(s) still upload ...; nothing deleted').
        assert r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith("rewindfs: rebuild-index refused: 1 writer is still "
                                   f"uploading to this store: hostA pid {w.pid} (pin "
                                   "expires in "), r.stderr
        assert "nothing changed" in r.stderr and "run rebuild-index again" in r.stderr
        assert "--wait SECONDS (waited 1 s)" in r.stderr, r.stderr
        assert "gc" not in r.stderr.replace("rebuild-index", ""), r.stderr
        doc = json.loads(b.run("rebuild-index", "--wait", "0", "--json",
                               check=False).stdout)
        assert doc["type"] == "WritersBusyError" and doc["exit_code"] == 8, doc
        assert doc["command"] == "rebuild-index" and doc["count"] == 1, doc
        assert [w_[:2] for w_ in doc["writers"]] == [["hostA", w.pid]], doc
        r = b.run("gc", "--wait", "0", check=False)  # gc says the same of itself
        assert r.returncode == 8 and r.stderr.startswith(
            "rewindfs: gc refused: 1 writer is still uploading to this store: hostA pid "
            f"{w.pid} "), r.stderr
        assert "nothing deleted" in r.stderr and "run gc again" in r.stderr, r.stderr
        line = _go_on(w)
        assert line.startswith("ref "), line
        ref = line.split()[1]
        assert w.wait(60) == 0  # its pin released on the way out
    finally:
        reap(w)
    report = b.json("rebuild-index", "--wait", "1")
    assert report["packs"] >= 1  # type: ignore[index]
    assert b.json("verify")["ok"] is True  # type: ignore[index]
    b.run("materialize", ref, str(tmp_path / "dest"))
    assert (tmp_path / "dest" / "README").read_bytes() == (src / "README").read_bytes()


# A host's side of a lease: acquire NAME for HOLDER (60 s), print the outcome, this host's
# clock against the catalog server's, and how long the lease runs by the server's clock.
LEASE = """
    import os, time
    import psycopg
    from store.errors import LeaseBusyError
    from store.lease import Leaser
    from store.objects import Store

    st = Store(os.environ["LOCAL"])

    def server_s():  # what the server's clock says, asked by this test, not the product
        with psycopg.connect(st.catalog.dsn) as c:
            return float(c.execute("SELECT extract(epoch from clock_timestamp())"
                                   ).fetchone()[0])

    print("skew", round(time.time() - server_s()), flush=True)
    try:
        lease = Leaser(st).acquire(os.environ["NAME"], os.environ["HOLDER"], 60)
    except LeaseBusyError as e:
        print("busy", e.holder, flush=True)
    else:
        print("took", round(lease.expires_ns / 1e9 - server_s()), flush=True)
"""


def _lease_on(host: Host, name: str, holder: str, skew: str | None = None) -> list[str]:
    env = {"LOCAL": str(host.local), "NAME": name, "HOLDER": holder,
           "REWINDFS_HOST_ID": host.name, **host.env}
    if skew is not None:  # this host's wall clock off by SKEW (libfaketime), not the server's
        import glob

        lib = glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
        assert lib, "libfaketime is missing: run scripts/setup.sh (Debian package faketime)"
        env.update(LD_PRELOAD=lib[0], FAKETIME=skew, FAKETIME_DONT_FAKE_MONOTONIC="1")
    p = child(LEASE, env=env)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return out.split("\n")[:2]


def test_leases_run_on_the_catalog_servers_clock_whatever_a_hosts_clock_says(
        hosts: tuple[Host, Host]) -> None:
    """Host B's wall clock is 10 minutes ahead (libfaketime in its process; the catalog
    server's clock is untouched; S3 refuses requests signed more than 15 minutes off):
    B can neither take A's unexpired 60 s lease (it looks expired by B's clock) nor get
    a lease that outlives its ttl by the server's clock."""
    a, b = hosts
    a.run("list")
    b.run("list")
    assert _lease_on(a, "session/s1", "hostA:1:a") == ["skew 0", "took 60"]
    skew, took = _lease_on(b, "session/s1", "hostB:1:b", skew="+10m")
    assert skew == "skew 600"  # the skew is real, as the server sees it
    assert took == "busy hostA:1:a"
    skew, took = _lease_on(b, "session/s2", "hostB:1:b", skew="+10m")
    assert took == "took 60"  # by the server's clock (10 minutes more by B's own)
    assert _lease_on(a, "session/s2", "hostA:1:a")[1] == "busy hostB:1:b"


def test_gc_and_rebuild_index_refuse_a_running_gc_in_one_plain_line(
        hosts: tuple[Host, Host]) -> None:
    """While host A holds the ``gc`` lease (a gc or rebuild-index of its own), ``gc`` and
    ``rebuild-index`` on B refuse with exit 8 in one line naming A's host and pid and what
    to do (it was 'gc check gc: another gc or rebuild-index runs (hostA:4242:a)')."""
    a, b = hosts
    a.run("list")
    assert _lease_on(a, "gc", "hostA:4242:a")[1] == "took 60"
    for command, nothing in (("gc", "nothing deleted"), ("rebuild-index", "nothing changed")):
        r = b.run(command, "--wait", "0", check=False)
        assert r.returncode == 8, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert r.stderr.startswith(
            f"rewindfs: {command} refused: another gc or rebuild-index is running on this "
            "store: hostA pid 4242 (its lease runs out in "), r.stderr
        assert f"{nothing}. Let it finish and run {command} again" in r.stderr, r.stderr
        assert "hostA:4242:a" not in r.stderr and " check " not in r.stderr, r.stderr
        doc = json.loads(b.run(command, "--wait", "0", "--json", check=False).stdout)
        assert doc["type"] == "GCBusyError" and doc["exit_code"] == 8, doc
        assert (doc["command"], doc["host"], doc["pid"]) == (command, "hostA", 4242), doc
        assert 0 < doc["expires_in_s"] <= 60, doc
