"""Sessions that move between two hosts of one shared store (issue 13.4), end to end.

Two "hosts" are two store configurations (local directory, cache, host id, workspace base)
with processes of their own, against the same real SeaweedFS and PostgreSQL servers
(tests/servers.py). Sessions are FUSE mounts (their session processes are the mount
daemons). A session stopped with ``--checkpoint`` on host A resumes and forks on host B
with the same tree; one whose upper still holds changes (stopped without it, or crashed) is
refused on B with an error naming A; ``mount --ro`` of A's Ref works on B.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from session_support import ref_of, stop_hosts
from test_shared_store import Host, two_hosts

from fusefs.session.control import control_path, request
from fusefs.session.fallback import fuse_available

pytestmark = pytest.mark.skipif(not fuse_available(), reason="needs /dev/fuse")


class SessionHost(Host):
    """A host whose sessions live under its own workspace base; ``cleanup`` stops every
    session process it started and unmounts what a killed one left."""

    def __init__(self, name: str, tmp: Path, url: str, endpoint: str, dsn: str) -> None:
        super().__init__(name, tmp, url, endpoint, dsn)
        self.base = tmp / f"{name}-ws"
        self.killed: list[str] = []
        self.dsn = dsn
        # A runtime directory of its own (control sockets, mount records), as on another
        # machine: two hosts running one session must not share its socket path.
        self.runtime = tempfile.mkdtemp(prefix=f"rt-{name}-")
        self.env["XDG_RUNTIME_DIR"] = self.runtime

    def session(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("session", *args, check=check)

    def started(self, *args: str) -> dict[str, str]:
        out = json.loads(self.session(*args, "--base", str(self.base), "--json").stdout)
        assert isinstance(out, dict)
        return out

    def refused(self, *args: str) -> dict[str, object]:
        r = self.session(*args, "--base", str(self.base), "--json", check=False)
        assert r.returncode != 0, r.stdout
        out = json.loads(r.stdout)
        assert isinstance(out, dict)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        return out

    def pid(self, session_id: str) -> int:
        path = control_path(str(self.local / "sessions" / session_id))
        assert path is not None
        return int(request(path, {"op": "status"}, 30)["pid"])

    def cleanup(self) -> None:
        stop_hosts(self.local / "sessions",
                   lambda sid: self.session("shutdown", sid, "--force", check=False))
        for root in self.killed:
            subprocess.run(["fusermount3", "-uz", root], capture_output=True)
        shutil.rmtree(self.runtime, ignore_errors=True)

    def row(self, session_id: str) -> tuple[str, dict[str, object]]:
        """The session's row in the catalog's registry: (host, record)."""
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True) as conn:
            got = conn.execute("SELECT host, record FROM sessions WHERE id=%s",
                               (session_id,)).fetchone()
        assert got is not None
        return got[0], json.loads(got[1])


@pytest.fixture
def hosts(s3_env: object, s3_bucket: str, pg_dsn: str,
          tmp_path: Path) -> Iterator[tuple[SessionHost, SessionHost]]:
    a, b = two_hosts(s3_env, s3_bucket, pg_dsn, tmp_path, SessionHost)
    assert isinstance(a, SessionHost) and isinstance(b, SessionHost)
    try:
        yield a, b
    finally:
        a.cleanup()
        b.cleanup()


def project(tmp: Path, data_bytes: int = 2 << 20) -> Path:
    """A seed directory ``tmp``/project: a README and ``data_bytes`` random bytes in
    pkg/data.bin."""
    src = tmp / "project"
    (src / "pkg").mkdir(parents=True)
    (src / "README").write_text("a project\n")
    (src / "pkg" / "data.bin").write_bytes(os.urandom(data_bytes))
    return src


def test_a_session_checkpointed_at_shutdown_moves_to_b_and_back(
        hosts: tuple[SessionHost, SessionHost], tmp_path: Path) -> None:
    a, b = hosts
    s = a.started("new", "--seed", str(project(tmp_path)))
    sid, root_a = s["id"], Path(s["root"])
    (root_a / "README").write_text("changed on A\n")
    (root_a / "pkg" / "new.py").write_text("print('A')\n")
    (root_a / "pkg" / "data.bin").unlink()
    want = ref_of(root_a)
    out = json.loads(a.session("shutdown", sid, "--checkpoint", "--json").stdout)
    assert out["ref"] == str(want)

    listed = json.loads(b.session("list", "--json").stdout)
    assert [(r["id"], r["state"], r.get("host")) for r in listed] == [(sid, "stopped", "hostA")]
    moved = b.started("resume", sid)
    root_b = Path(moved["root"])
    listed = json.loads(a.session("list", "--json").stdout)  # A's stale record is not shown
    assert [(r["id"], r["state"], r.get("host")) for r in listed] == [(sid, "running", "hostB")]
    assert moved["id"] == sid and root_b == b.base / sid
    assert ref_of(root_b) == want  # the same tree, digest-equal
    assert (root_b / "README").read_text() == "changed on A\n"
    log = [(e["trigger"], e["ref"]) for e in json.loads(b.run("log", sid, "--json").stdout)]
    assert log[-1] == ("shutdown", str(want))
    # A fork on A of the session running on B is refused, naming B's process.
    r = a.refused("fork", sid)
    assert r["type"] == "SessionBusyError" and "hostB" in str(r["error"])
    (root_b / "README").write_text("changed on B\n")
    back = json.loads(b.session("shutdown", sid, "--checkpoint", "--json").stdout)["ref"]

    # Back on A: its stale local state (the upper of before the move) is dropped, and the
    # session serves what B checkpointed.
    again = a.started("resume", sid)
    assert ref_of(again["root"]) == ref_of(root_a) and str(ref_of(root_a)) == back
    assert (root_a / "README").read_text() == "changed on B\n"
    a.session("shutdown", sid, "--checkpoint")

    f = b.started("fork", sid)  # of the session A stopped clean: its last checkpoint
    assert f["id"] != sid and str(ref_of(f["root"])) == back
    b.session("shutdown", f["id"])


def test_changes_left_in_an_upper_keep_the_session_on_its_host(
        hosts: tuple[SessionHost, SessionHost], tmp_path: Path) -> None:
    a, b = hosts
    seed = json.loads(a.run("snapshot", str(project(tmp_path)), "--json").stdout)["ref"]
    s = a.started("new", "--seed", seed)
    sid, root_a = s["id"], Path(s["root"])
    (root_a / "README").write_text("not checkpointed\n")
    a.session("shutdown", sid)  # the default: no checkpoint, the change stays in A's upper

    for op in ("resume", "fork"):
        r = b.refused(op, sid)
        assert r["type"] == "SessionChangesElsewhereError" and r["reason"] == "dirty"
        assert r["host"] == "hostA" and r["exit_code"] == 10
        assert "hostA" in str(r["error"]) and "--checkpoint" in str(r["error"])
    assert not (b.base / sid).exists()
    # A resumes it with its change; a checkpointed shutdown there lets it move.
    a.started("resume", sid)
    assert (root_a / "README").read_text() == "not checkpointed\n"
    a.session("shutdown", sid, "--checkpoint")
    assert b.started("resume", sid)["id"] == sid
    assert (b.base / sid / "README").read_text() == "not checkpointed\n"
    b.session("shutdown", sid, "--checkpoint")
    # Removed on B: A's stale local state of it is neither listed nor opened again.
    b.session("rm", sid)
    assert json.loads(a.session("list", "--json").stdout) == []
    r = a.session("resume", sid, "--base", str(a.base), check=False)
    assert r.returncode == 4 and f"no session '{sid}'" in r.stderr, r.stderr
    assert json.loads(b.session("list", "--json").stdout) == []


def test_a_crashed_session_is_refused_elsewhere_until_its_changes_are_given_up(
        hosts: tuple[SessionHost, SessionHost], tmp_path: Path) -> None:
    a, b = hosts
    ttl = 20.0  # renewed every ttl/3: held for at least 2/3 ttl after the kill, at most ttl
    s = a.started("new", "--seed", str(project(tmp_path)), "--lease-ttl", str(ttl))
    sid, root_a = s["id"], Path(s["root"])
    (root_a / "README").write_text("checkpointed on A\n")
    last = json.loads(a.run("checkpoint", str(root_a), "--json").stdout)["ref"]
    (root_a / "README").write_text("lost with the crash of A\n")
    a.killed.append(str(root_a))
    os.kill(a.pid(sid), signal.SIGKILL)
    killed = time.monotonic()
    # Its lease is still held: B cannot tell A died, and says whose lease it is.
    r = b.refused("resume", sid)
    assert r["type"] == "SessionBusyError" and "hostA" in str(r["error"])
    time.sleep(max(0.0, killed + ttl + 0.5 - time.monotonic()))
    r = b.refused("resume", sid)
    assert r["type"] == "SessionChangesElsewhereError" and r["reason"] == "crashed"
    assert "--discard-upper" in str(r["error"])
    assert r["head"] == last and last[:20] in str(r["error"])  # not its start Ref
    moved = b.started("resume", sid, "--discard-upper")
    assert str(ref_of(moved["root"])) == last  # the last checkpoint, without A's change
    b.session("shutdown", sid, "--checkpoint")


def test_a_read_only_mount_of_a_ref_of_a_serves_on_b(hosts: tuple[SessionHost, SessionHost],
                                                     tmp_path: Path) -> None:
    a, b = hosts
    src = project(tmp_path)
    ref = json.loads(a.run("snapshot", str(src), "--json").stdout)["ref"]
    mnt = tmp_path / "ro-on-b"
    mnt.mkdir()
    b.run("mount", "--ro", ref, str(mnt))
    try:
        assert str(ref_of(mnt)) == ref
        assert (mnt / "pkg" / "data.bin").read_bytes() == (src / "pkg" / "data.bin").read_bytes()
        with pytest.raises(OSError):
            (mnt / "README").write_text("no\n")
    finally:
        b.run("umount", str(mnt), check=False)
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


def test_a_session_without_fuse_moves_only_after_a_shutdown_checkpoint(
        hosts: tuple[SessionHost, SessionHost], tmp_path: Path) -> None:
    a, b = hosts
    s = a.started("new", "--no-fuse", "--seed", str(project(tmp_path)))
    sid, root_a = s["id"], Path(s["root"])
    (root_a / "README").write_text("in a plain directory\n")
    a.session("shutdown", sid)
    # A plain directory keeps no dirty set: without a shutdown checkpoint, B cannot know.
    r = b.refused("resume", sid, "--no-fuse")
    assert r["type"] == "SessionChangesElsewhereError" and r["reason"] == "unknown"
    a.started("resume", sid)
    want = ref_of(root_a)
    a.session("shutdown", sid, "--checkpoint")
    moved = b.started("resume", sid, "--no-fuse")
    assert ref_of(moved["root"]) == want
    b.session("shutdown", sid)


def test_a_catalog_outage_across_a_lease_renewal_leaves_the_session_its_lease(
        s3_env: object, s3_bucket: str, own_postgres: object, tmp_path: Path) -> None:
    """PostgreSQL down while the session's renewer ticks (a third of the lease's time to
    live), back before the lease's time to live is over: the session keeps its lease, so a
    checkpoint a whole time to live later is journaled and status shows no fault. The
    renewer's check of whether the lease was still held raised during the outage, which
    ended the renewer: the lease then expired and every later checkpoint failed with 'the
    session lease is not held' while status said nothing was wrong."""
    a, b = two_hosts(s3_env, s3_bucket, own_postgres.new_database(),  # type: ignore[attr-defined]
                     tmp_path, SessionHost)
    assert isinstance(a, SessionHost) and isinstance(b, SessionHost)
    try:
        ttl = 30.0  # renewed every 10 s; the first failing checkpoint waits up to 10 s
        s = a.started("new", "--seed", str(project(tmp_path)), "--lease-ttl", str(ttl))
        sid, root = s["id"], Path(s["root"])
        own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
        try:
            (root / "README").write_text("during the outage\n")
            assert a.run("checkpoint", str(root), check=False).returncode != 0
            time.sleep(ttl / 3 + 0.7)  # at least one renewal while the catalog is down
        finally:
            own_postgres.start()  # type: ignore[attr-defined]
        time.sleep(ttl + 1)  # a lease no longer renewed has expired by now
        (root / "README").write_text("after the outage\n")
        ref = json.loads(a.run("checkpoint", str(root), "--json").stdout)["ref"]
        log = json.loads(a.run("log", sid, "--json").stdout)
        assert log[-1]["ref"] == ref and log[-1]["event"] == "WorkspaceCheckpointed"
        status = json.loads(a.run("status", str(root), "--json").stdout)
        assert not status.get("fault"), status
        a.session("shutdown", sid)
    finally:
        a.cleanup()
        b.cleanup()


def _outage_hosts(s3_env: object, s3_bucket: str, own_postgres: object,
                  tmp_path: Path) -> tuple[SessionHost, SessionHost]:
    a, b = two_hosts(s3_env, s3_bucket, own_postgres.new_database(),  # type: ignore[attr-defined]
                     tmp_path, SessionHost)
    assert isinstance(a, SessionHost) and isinstance(b, SessionHost)
    return a, b


def test_a_catalog_outage_longer_than_the_lease_ttl_renews_the_lease_on_reconnect(
        s3_env: object, s3_bucket: str, own_postgres: object, tmp_path: Path) -> None:
    """PostgreSQL down for more than the lease's time to live, nobody taking the session
    over: once it is back the lease, expired but still this holder's at its epoch, is
    renewed, and the next checkpoint journals the change made before the outage (it used
    to fault the session terminally: 'lease session/ID expired' for good)."""
    a, b = _outage_hosts(s3_env, s3_bucket, own_postgres, tmp_path)
    try:
        ttl = 2.0
        s = a.started("new", "--seed", str(project(tmp_path)), "--lease-ttl", str(ttl))
        sid, root = s["id"], Path(s["root"])
        (root / "README").write_text("before the outage\n")
        epoch = json.loads(a.run("status", str(root), "--json").stdout)["epoch"]
        own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
        try:
            time.sleep(2 * ttl + 1)  # renewals fail for more than a whole time to live
        finally:
            own_postgres.start()  # type: ignore[attr-defined]
        ref = json.loads(a.run("checkpoint", str(root), "--json").stdout)["ref"]
        got = a.run("cat", ref, "README").stdout
        assert got == "before the outage\n"
        log = json.loads(a.run("log", sid, "--json").stdout)
        assert log[-1]["ref"] == ref and log[-1]["event"] == "WorkspaceCheckpointed"
        assert log[-1]["epoch"] == epoch
        status = json.loads(a.run("status", str(root), "--json").stdout)
        assert not status.get("fault"), status
        a.started("resume", sid)  # a healthy running session: its root
        a.session("shutdown", sid, "--checkpoint")
    finally:
        a.cleanup()
        b.cleanup()


def test_a_takeover_during_a_catalog_outage_still_faults_the_old_holder(
        s3_env: object, s3_bucket: str, own_postgres: object, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Host A's session process paused across a PostgreSQL outage longer than its lease's
    ttl; once the catalog is back, another holder takes the expired lease (epoch + 1)
    before A renews: A's renewal is refused, the session is terminally faulted,
    checkpoints fail, and ``session resume`` refuses (exit 10) saying to shut it down
    first instead of printing the root of a session that serves nothing."""
    from store.lease import Leaser
    from store.objects import Store

    a, b = _outage_hosts(s3_env, s3_bucket, own_postgres, tmp_path)
    try:
        ttl = 2.0
        s = a.started("new", "--seed", str(project(tmp_path)), "--lease-ttl", str(ttl))
        sid, root = s["id"], Path(s["root"])
        (root / "README").write_text("before the outage\n")
        b.run("list")  # B's local directory configured
        pid = a.pid(sid)
        os.kill(pid, signal.SIGSTOP)
        try:
            own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
            try:
                time.sleep(ttl + 1)
            finally:
                own_postgres.start()  # type: ignore[attr-defined]
            monkeypatch.setenv("XDG_CACHE_HOME", b.env["XDG_CACHE_HOME"])
            monkeypatch.setenv("REWINDFS_HOST_ID", "hostB")
            st_b = Store(b.local)
            try:
                stolen = Leaser(st_b).acquire(f"session/{sid}", "hostB:1:thief", 600)
            finally:
                st_b.close()
        finally:
            os.kill(pid, signal.SIGCONT)
        r = a.run("checkpoint", str(root), check=False)
        assert r.returncode == 10, r.stderr
        assert "terminally faulted" in r.stderr and "lost" in r.stderr, r.stderr
        r = a.session("resume", sid, check=False)
        assert r.returncode == 10, (r.stdout, r.stderr)
        assert "terminally faulted" in r.stderr and f"session shutdown {sid}" in r.stderr
        assert s["root"] not in r.stdout
        a.session("shutdown", sid)
        assert stolen.epoch >= 2
    finally:
        a.cleanup()
        b.cleanup()


def _taken_over(a: SessionHost, b: SessionHost, tmp_path: Path, ttl: float) -> tuple[str, Path]:
    """A session started on B with a change left in B's upper; B's process paused until its
    lease expired, A resuming it meanwhile with ``--discard-upper``; B's process continued.
    Returns (session id, A's root)."""
    s = b.started("new", "--seed", str(project(tmp_path)), "--lease-ttl", str(ttl))
    sid, root_b = s["id"], Path(s["root"])
    (root_b / "README").write_text("on B, never checkpointed\n")
    (root_b / "only-on-b").write_text("B's\n")
    pid = b.pid(sid)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(ttl + 1.5)  # renewed every ttl/3: expired by now
        moved = a.started("resume", sid, "--discard-upper")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert moved["id"] == sid
    return sid, Path(moved["root"])


def test_a_taken_over_holder_does_not_register_its_shutdown(
        hosts: tuple[SessionHost, SessionHost], tmp_path: Path) -> None:
    """Host B's session process paused past its lease's ttl, host A taking the session over
    (epoch 2): B's checkpoint is refused, and B's shutdown, which still stops B's process,
    leaves the registry row A's (running at A's epoch). It used to write B's row (stopped,
    dirty, epoch 0, B's old head) over A's, unfenced: every host then listed the session as
    stopped on B while A served it."""
    a, b = hosts
    sid, root_a = _taken_over(a, b, tmp_path, 4.0)
    epoch = json.loads(a.run("status", str(root_a), "--json").stdout)["epoch"]
    assert epoch >= 2 and a.row(sid)[0] == "hostA"
    r = b.session("checkpoint", sid, check=False)
    assert r.returncode == 10 and "lost" in r.stderr, r.stderr
    b.session("shutdown", sid)  # B's process stops; the session stays A's
    host, rec = a.row(sid)
    assert (host, rec["state"], rec["epoch"]) == ("hostA", "running", epoch)
    for h, where in ((a, None), (b, "hostA")):  # a host's own sessions name no host
        listed = json.loads(h.session("list", "--json").stdout)
        assert [(x["id"], x["state"], x.get("host")) for x in listed] == [
            (sid, "running", where)]
    log = (b.local / "sessions" / sid / "daemon.log").read_text()
    assert "not registered as stopped" in log, log
    # A still serves it, and stops it as its own.
    (root_a / "README").write_text("on A\n")
    a.run("checkpoint", str(root_a))
    a.session("shutdown", sid, "--checkpoint")
    host, rec = a.row(sid)
    assert (host, rec["state"], rec["dirty"], rec["epoch"]) == ("hostA", "stopped", False,
                                                                 epoch)


def test_a_checkpoint_of_the_later_holder_is_what_the_session_serves_back_on_the_old_host(
        hosts: tuple[SessionHost, SessionHost], tmp_path: Path) -> None:
    """After the takeover above, A checkpoints and is killed: B, whose stale state (the
    seed and its own discarded upper) is still on its disk, refuses to resume the session
    naming A (crashed there); given up, it serves A's last checkpoint, not B's old tree.
    B used to resume its stale upper and journal a restore to its old head, losing A's
    checkpoint from the served tree."""
    a, b = hosts
    ttl = 4.0
    sid, root_a = _taken_over(a, b, tmp_path, ttl)
    b.session("shutdown", sid)
    (root_a / "README").write_text("checkpointed on A\n")
    (root_a / "new-on-a").write_text("A's\n")
    last = json.loads(a.run("checkpoint", str(root_a), "--json").stdout)["ref"]
    a.killed.append(str(root_a))
    os.kill(a.pid(sid), signal.SIGKILL)
    time.sleep(ttl + 1.5)
    r = b.refused("resume", sid)
    assert r["type"] == "SessionChangesElsewhereError" and r["reason"] == "crashed"
    assert r["host"] == "hostA" and r["head"] == last, r
    moved = b.started("resume", sid, "--discard-upper")
    root_b = Path(moved["root"])
    assert str(ref_of(root_b)) == last
    assert (root_b / "README").read_text() == "checkpointed on A\n"
    assert not (root_b / "only-on-b").exists() and (root_b / "new-on-a").exists()
    events = json.loads(b.run("log", sid, "--json").stdout)
    assert events[-1]["ref"] == last and events[-1]["event"] == "WorkspaceCheckpointed"
    b.session("shutdown", sid, "--checkpoint")


def test_a_registry_row_older_than_the_journal_does_not_reopen_the_stale_upper(
        hosts: tuple[SessionHost, SessionHost], tmp_path: Path) -> None:
    """B's row (stopped with changes in its upper, at epoch 1) left in the catalog although
    A took the session over since (epoch 2), checkpointed and was killed: the row is not
    current (the journal has events of a later lease epoch), so B's resume does not reopen
    its own upper, which A gave up: refused as superseded, naming A (whose lease was never
    released); with --discard-upper B serves A's checkpoint. B used to resume its stale
    upper and journal a restore to the head under it, dropping A's checkpoint."""
    import psycopg

    a, b = hosts
    ttl = 4.0
    s = b.started("new", "--seed", str(project(tmp_path)), "--lease-ttl", str(ttl))
    sid, root_b = s["id"], Path(s["root"])
    (root_b / "only-on-b").write_text("B's, never checkpointed\n")
    b.session("shutdown", sid)
    host, stale = b.row(sid)
    assert (host, stale["state"], stale["dirty"], stale["epoch"]) == ("hostB", "stopped",
                                                                      True, 1)
    moved = a.started("resume", sid, "--discard-upper", "--lease-ttl", str(ttl))
    root_a = Path(moved["root"])
    (root_a / "new-on-a").write_text("A's\n")
    last = json.loads(a.run("checkpoint", str(root_a), "--json").stdout)["ref"]
    a.killed.append(str(root_a))
    os.kill(a.pid(sid), signal.SIGKILL)
    with psycopg.connect(b.dsn, autocommit=True) as conn:  # A's registration lost
        conn.execute("UPDATE sessions SET host=%s, record=%s WHERE id=%s",
                     ("hostB", json.dumps(stale, sort_keys=True), sid))
    time.sleep(ttl + 1.5)
    r = b.refused("resume", sid)
    assert r["type"] == "SessionChangesElsewhereError" and r["reason"] == "superseded", r
    assert r["host"] == "hostA" and r["head"] == last, r
    assert not (root_b / "only-on-b").exists()  # not mounted again
    moved = b.started("resume", sid, "--discard-upper")
    assert str(ref_of(moved["root"])) == last
    assert not (root_b / "only-on-b").exists() and (root_b / "new-on-a").exists()
    events = json.loads(b.run("log", sid, "--json").stdout)
    assert events[-1]["ref"] == last and events[-1]["event"] == "WorkspaceCheckpointed"
    b.session("shutdown", sid, "--checkpoint")


def test_a_resume_that_fails_on_a_hung_s3_server_leaves_the_session_where_it_was(
        own_seaweed: object, pg_dsn: str, tmp_path: Path) -> None:
    """SeaweedFS stopped with SIGSTOP while host C, whose cache is empty, resumes a session
    B stopped with a checkpoint: the resume fails with the backend's error (exit 11) before
    its mount serves, and leaves the session's registry row as it was, so that once the
    server answers again the session resumes on B (or C) with the checkpointed tree."""
    url = f"s3://{own_seaweed.new_bucket()}/team/store"  # type: ignore[attr-defined]
    ep = own_seaweed.endpoint  # type: ignore[attr-defined]
    b = SessionHost("hostB", tmp_path, url, ep, pg_dsn)
    c = SessionHost("hostC", tmp_path, url, ep, pg_dsn)
    c.env.update(REWINDFS_S3_ATTEMPTS="2", REWINDFS_S3_READ_TIMEOUT="0.5",
                 REWINDFS_S3_CONNECT_TIMEOUT="0.5")
    try:
        s = b.started("new", "--seed", str(project(tmp_path)))
        sid, root = s["id"], Path(s["root"])
        (root / "README").write_text("changed on B\n")
        want = ref_of(root)
        b.session("shutdown", sid, "--checkpoint")
        before = b.row(sid)
        assert before[0] == "hostB" and before[1]["state"] == "stopped"
        # C has opened the store before (its local directory made), none of this tree.
        assert [e["host"] for e in json.loads(c.session("list", "--json").stdout)] == \
            ["hostB"]

        group = own_seaweed.proc.pid  # type: ignore[attr-defined]
        os.killpg(group, signal.SIGSTOP)
        try:
            r = c.session("resume", sid, "--base", str(c.base), "--json", check=False)
        finally:
            os.killpg(group, signal.SIGCONT)
        assert r.returncode == 11, (r.returncode, r.stdout, r.stderr)
        assert "BackendError" in r.stdout, r.stdout
        assert b.row(sid) == before  # C never served it: nothing of it moved there

        listed = json.loads(b.session("list", "--json").stdout)
        assert [(e["id"], e["state"]) for e in listed] == [(sid, "stopped")]
        again = b.started("resume", sid)
        assert ref_of(again["root"]) == want
        assert (Path(again["root"]) / "README").read_text() == "changed on B\n"
        b.session("shutdown", sid, "--checkpoint")
        moved = c.started("resume", sid)  # and C, the server answering again, takes it
        assert ref_of(moved["root"]) == want
        c.session("shutdown", sid)
    finally:
        c.cleanup()
        b.cleanup()
