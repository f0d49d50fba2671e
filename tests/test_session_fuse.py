"""FUSE session backend: what only a mounted session does (CONTRACT 4.0, 4.1, 4.4, 4.6).

The behaviour shared with the fallback runs in test_session_behaviour.py. Here: the session
process is the mount daemon; kill -9 of it and a resume that mounts the restore pointer with
the preserved upper; a crash between the upper's commit and the journal append (the upper's
recorded base wins and is journaled as a restore); a crash in the middle of the write-back of
a fixed root; one daemon for every session of a shared root, the last to leave unmounting;
forks that copy nothing; idle checkpoints caused by writes through the mount; GC keeping
what a state directory pins and failing closed when one cannot be read; the CLI.

Every session process is found through the state directories at teardown and killed, and
whatever is still mounted under the test directory is unmounted lazily.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from session_support import REPO, populate, ref_of, retry, workspace

from fusefs.session import (
    RestoreError,
    Session,
    SessionBusyError,
    SessionClosedError,
    SessionError,
    SnapshotPolicy,
    Workspace,
    WorkspaceRootBusyError,
)
from fusefs.session.control import control_path, request
from fusefs.session.fallback import fuse_available
from fusefs.session.fusetree import pinned_refs, upper_dir
from fusefs.session.journal import STEP
from store.objects import Store
from store.ref import Ref

pytestmark = pytest.mark.skipif(not fuse_available(), reason="needs /dev/fuse and fusermount3")

TTL = 1.0  # lease ttl of sessions that get killed, so that a resume can take over soon


def _pids(tmp: Path) -> set[int]:
    """The session processes serving sessions whose state lives under ``tmp``."""
    out = set()
    for ctl in tmp.rglob("control"):
        path = control_path(str(ctl.parent))
        if path is None:
            continue
        try:
            out.add(int(request(path, {"op": "status"}, 10)["pid"]))
        except (OSError, ValueError, KeyError):
            pass
    for att in tmp.rglob("attach"):
        try:
            out.add(int(json.loads(att.read_text())["pid"]))
        except (OSError, ValueError, KeyError):
            pass
    return out


@pytest.fixture(autouse=True)
def _no_leftovers(tmp_path: Path) -> Iterator[None]:
    yield
    for pid in _pids(tmp_path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    fh.unmount_leftovers([str(tmp_path)])


def _pid(s: Session) -> int:
    """The pid of the session process serving ``s``."""
    return int(getattr(s._handle, "pid"))  # noqa: B009 - a RemoteSession's


def _kill(s: Session) -> None:
    """kill -9 the session's process and wait until it is gone."""
    pid = _pid(s)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while os.path.exists(f"/proc/{pid}") and _state(pid) not in ("Z", "X"):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "X"


def _resume(ws: Workspace, sid: str) -> Session:
    """Resume ``sid`` once the killed holder's leases have expired."""
    s: Session = retry(lambda: ws.resume_session(sid),
                       (SessionBusyError, WorkspaceRootBusyError))  # type: ignore[arg-type]
    return s


def events(s: Session) -> list[tuple[str, str | None, Ref]]:
    return [(e.event[len("Workspace"):], e.trigger, e.ref) for e in s.log()]


# -- restart (CONTRACT 4.6) -------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["per-session", "exclusive"])
def test_kill_9_then_resume_mounts_the_restore_pointer_with_the_upper(tmp_path: Path,
                                                                       mode: str) -> None:
    ws = workspace(tmp_path, mode, "fuse", ttl=TTL)
    s = ws.new_session()
    assert s.root is not None
    root = Path(s.root)
    seed = s.log()[0].ref
    populate(root, 0)
    a = s.checkpoint()
    populate(root, 1)
    (root / "uncheckpointed").write_text("keep me\n")
    b = s.checkpoint()
    pre = s.restore(a)
    assert pre == b and ref_of(root) == a
    (root / "after-restore").write_text("not checkpointed\n")
    fd = os.open(root / "after-restore", os.O_RDONLY)  # durable once fsynced
    os.fsync(fd)
    os.close(fd)
    _kill(s)
    again = _resume(ws, s.id)
    try:
        assert again.root == str(root)
        assert (root / "after-restore").read_text() == "not checkpointed\n"
        assert not (root / "uncheckpointed").exists()
        assert (root / "README").read_text() == "readme\n"
        assert events(again) == [("Checkpointed", "seed", seed), ("Checkpointed", "manual", a),
                                 ("Checkpointed", "manual", b),
                                 ("Checkpointed", "pre_restore", b), ("Restored", None, a)]
        assert again.epoch == 2
        # The resumed session works: checkpoint the kept change, undo the restore.
        c = again.checkpoint()
        assert c not in (a, b) and ref_of(root) == c
        again.restore(b)
        assert (root / "uncheckpointed").read_text() == "keep me\n"
    finally:
        again.shutdown()


@pytest.mark.parametrize("point", ["restore.swapped", "checkpoint.reset"])
def test_crash_between_upper_commit_and_journal_is_journaled_as_a_restore(
        tmp_path: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = workspace(tmp_path, "per-session", "fuse", ttl=TTL)
    s = ws.new_session()
    assert s.root is not None
    root = Path(s.root)
    populate(root, 0)
    a = s.checkpoint()
    populate(root, 1)
    b = s.checkpoint()
    n = len(s.log())
    sid = s.id
    monkeypatch.setenv("REWINDFS_CRASH_AT", point)
    s.shutdown()
    s = ws.resume_session(sid)  # this process runs with the crash point set
    monkeypatch.delenv("REWINDFS_CRASH_AT")
    pid = _pid(s)
    if point == "restore.swapped":
        (root / "change").write_text("x")
        with pytest.raises(SessionClosedError):  # the daemon dies after the swap, unjournaled
            s.restore(a)
        want = a
    else:
        (root / "change").write_text("x")
        with pytest.raises(SessionClosedError):  # the daemon dies after the reset
            s.checkpoint()
        want = None
    deadline = time.monotonic() + 60
    while _state(pid) not in ("Z", "X"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    log = s.log()
    if point == "restore.swapped":  # the pre_restore checkpoint was journaled, not the swap
        assert len(log) == n + 1 and log[-1].trigger == "pre_restore"
    else:
        assert len(log) == n and log[-1].ref == b
    again = _resume(ws, sid)
    try:
        got = ref_of(root)
        if want is not None:
            assert got == want, "the upper's recorded base is the mounted tree"
        else:
            assert got != b and (root / "change").read_text() == "x"
        last = again.log()[-1]
        assert (last.event, last.ref, last.epoch) == ("WorkspaceRestored", got, again.epoch)
        assert again.restore_pointer() == got
    finally:
        again.shutdown()


def test_crash_during_write_back_is_rolled_back_and_written_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "project"
    populate(root, 0)
    adopted = ref_of(root)
    ws = workspace(tmp_path, "exclusive", "fuse", root=root, ttl=TTL)
    monkeypatch.setenv("REWINDFS_CRASH_AT", "reconcile:step:mid")
    s = ws.new_session()
    monkeypatch.delenv("REWINDFS_CRASH_AT")
    populate(root, 1)
    (root / "src" / "main.py").unlink()
    final = ref_of(root)
    assert final != adopted
    with pytest.raises(SessionError):
        s.shutdown()  # the write-back dies in its middle
    again = _resume(ws, s.id)
    try:
        assert ref_of(root) == final, "the upper is mounted again over the directory"
        assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    finally:
        again.shutdown()
    assert not fh.is_fuse_mounted(root)
    assert ref_of(root) == final, "written back exactly at the clean shutdown"
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_sigterm_shuts_down_in_order_and_writes_back(tmp_path: Path) -> None:
    root = tmp_path / "project"
    populate(root, 0)
    ws = workspace(tmp_path, "exclusive", "fuse", root=root)
    s = ws.new_session()
    (root / "work").write_text("unsaved\n")
    final = ref_of(root)
    n = len(s.log())
    pid = _pid(s)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while _state(pid) not in ("Z", "X"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not fh.is_fuse_mounted(root) and ref_of(root) == final
    assert len(s.log()) == n, "no synthetic checkpoint at shutdown"
    with ws.new_session() as other:  # both leases were released: the root is free at once
        assert other.log()[0].ref == final


# -- shared placement (CONTRACT 4.1) ---------------------------------------------------------

def test_shared_root_one_daemon_later_sessions_attach_last_to_leave_unmounts(
        tmp_path: Path) -> None:
    root = tmp_path / "shared"
    populate(root, 0)
    adopted = ref_of(root)
    ws = workspace(tmp_path, "shared", "fuse", root=root)
    s1 = ws.new_session()
    other = workspace(tmp_path, "shared", "fuse", root=root, store=ws.store,
                      policy=SnapshotPolicy("on_turn_done"))
    s2 = other.new_session()  # another caller: attaches to the running daemon
    try:
        assert _pid(s1) == _pid(s2)
        assert [e.trigger for e in s1.log() if e.event != STEP] == ["seed"] and s1.log()[0].ref == adopted
        assert [e.trigger for e in s2.log() if e.event != STEP] == ["seed"] and s2.log()[0].ref == adopted
        s2.turn_done()  # s2 runs under its own policy, s1 under manual
        deadline = time.monotonic() + 30
        while [e.trigger for e in s2.log() if e.event != STEP] != ["seed", "turn_done"]:
            assert time.monotonic() < deadline, s2.log()
            time.sleep(0.02)
        s1.turn_done()
        assert [e.trigger for e in s1.log() if e.event != STEP] == ["seed"]
        (root / "from-s2").write_text("2\n")
        a = s1.checkpoint()
        assert ref_of(root) == a and (root / "from-s2").exists()
        assert s1.log()[-1].consistency == "fuzzy"
        s1.shutdown()
        assert fh.is_fuse_mounted(root), "another session still uses the mount"
        (root / "after-s1").write_text("later\n")
        s3 = ws.new_session()  # a later session attaches to the same daemon
        assert _pid(s3) == _pid(s2)
        s2.restore(adopted)
        assert ref_of(root) == adopted
        assert [e.event for e in s3.log()] == ["WorkspaceCheckpointed"], \
            "a restore is journaled by the session that made it"
        (root / "last").write_text("x\n")
        final = ref_of(root)
        s3.shutdown()
        assert fh.is_fuse_mounted(root)
    finally:
        s2.shutdown()
    assert not fh.is_fuse_mounted(root), "the last to leave unmounts"
    assert ref_of(root) == final, "and writes the tree back exactly"
    # With every session gone the directory is authoritative again: edits made to it while
    # nothing is mounted are adopted by the next session, not overwritten.
    (root / "edited-meanwhile").write_text("mine\n")
    want = ref_of(root)
    with ws.resume_session(s1.id) as again:
        assert fh.is_fuse_mounted(root) and ref_of(root) == want
        assert again.log()[-1].ref == want
    assert ref_of(root) == want


def test_exclusive_root_written_back_and_edits_meanwhile_adopted(tmp_path: Path) -> None:
    root = tmp_path / "project"
    populate(root, 0)
    ws = workspace(tmp_path, "exclusive", "fuse", root=root)
    with ws.new_session() as s:
        (root / "work").write_text("done\n")
        final = ref_of(root)
    assert not fh.is_fuse_mounted(root) and ref_of(root) == final
    state = upper_dir(ws.config, s.record)
    assert pinned_refs(state) == [], "written back: the upper is cleared"
    (root / "work").write_text("edited by hand\n")
    want = ref_of(root)
    with ws.resume_session(s.id) as again:
        assert (root / "work").read_text() == "edited by hand\n"
        assert (again.log()[-1].event, again.log()[-1].ref) == ("WorkspaceRestored", want)


# -- fork (CONTRACT 4.4) -----------------------------------------------------------------------

def test_fork_starts_an_empty_upper_over_the_source_checkpoint(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "per-session", "fuse")
    with ws.new_session() as src:
        assert src.root is not None
        populate(src.root, 1)
        (Path(src.root) / "big").write_bytes(os.urandom(3 << 20))
        packs = ws.store.conn.execute("SELECT COUNT(*) FROM packs").fetchone()[0]
        with ws.fork_session(src.id) as child:
            forked = src.log()[-1]
            assert (forked.event, forked.trigger) == ("WorkspaceCheckpointed", "fork")
            assert child.root is not None and ref_of(child.root) == forked.ref
            d = Path(upper_dir(ws.config, child.record))
            assert [p for p in (d / "data").rglob("*") if p.is_file()] == []
            assert pinned_refs(str(d)) == [forked.ref]
            # The fork checkpoint stored the source's changes once; the fork itself nothing.
            after = ws.store.conn.execute("SELECT COUNT(*) FROM packs").fetchone()[0]
            with ws.fork_session(forked.ref) as grandchild:
                assert grandchild.root is not None
                assert (Path(grandchild.root) / "big").read_bytes() == \
                    (Path(src.root) / "big").read_bytes()
            assert ws.store.conn.execute("SELECT COUNT(*) FROM packs").fetchone()[0] == after
            assert after >= packs


def test_restore_with_a_file_open_for_writing(tmp_path: Path) -> None:
    """CONTRACT 3.2 amended: a session's restore proceeds at once while a file is open for
    writing (it is detached); ``wait_writers_s`` waits and then refuses, changing nothing."""
    ws = workspace(tmp_path, "per-session", "fuse")
    with ws.new_session() as s:
        assert s.root is not None
        root = Path(s.root)
        (root / "log.txt").write_text("one\n")
        good = s.checkpoint()
        (root / "log.txt").write_text("two\n")
        with open(root / "log.txt", "a") as f:  # a log writer that never closes
            n = len(s.log())
            with pytest.raises(RestoreError) as ei:
                s.restore(good, wait_writers_s=0.2)
            assert ei.value.kind == "permit_failed" and len(s.log()) == n
            pre = s.restore(good)  # at once
            assert (root / "log.txt").read_text() == "one\n"
            f.write("three\n")
            f.flush()
            assert (root / "log.txt").read_text() == "one\n"  # the writer is detached
            assert s.checkpoint() == good
        assert pre is not None and [e.event for e in s.log()[-3:]] == [
            "WorkspaceCheckpointed", "WorkspaceRestored", "WorkspaceCheckpointed"]
        assert [e.trigger for e in s.log()[-3:]][::2] == ["pre_restore", "manual"]
        assert ref_of(s.root) == good


# -- policy through the mount (CONTRACT 4.3) -------------------------------------------------

def test_idle_checkpoint_after_writes_through_the_mount(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "per-session", "fuse", policy=SnapshotPolicy(idle_s=0.3))
    with ws.new_session() as s:
        assert s.root is not None
        (Path(s.root) / "f").write_text("written without a permit")
        deadline = time.monotonic() + 30
        while [e.trigger for e in s.log() if e.event != STEP] != ["seed", "idle"]:
            assert time.monotonic() < deadline, s.log()
            time.sleep(0.02)
        assert s.log()[-1].ref == ref_of(s.root)


# -- GC (CONTRACT 1.6) ---------------------------------------------------------------------------

def _rewindfs(*args: str, store: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(store), *args],
                          capture_output=True, text=True, cwd=str(REPO), timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_gc_keeps_what_a_killed_session_upper_pins_and_fails_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ws = workspace(tmp_path, "per-session", "fuse", ttl=TTL)
    monkeypatch.setenv("REWINDFS_CRASH_AT", "checkpoint.reset")
    s = ws.new_session()
    monkeypatch.delenv("REWINDFS_CRASH_AT")
    assert s.root is not None
    (Path(s.root) / "work").write_bytes(os.urandom(1 << 16))
    with pytest.raises(SessionClosedError):
        s.checkpoint()  # the daemon dies once the upper sits on the new tree, unjournaled
    d = upper_dir(ws.config, s.record)
    pinned = pinned_refs(d)
    base = pinned[0]
    assert base not in [e.ref for e in s.log()]
    # Unlisted as well: only the state directory keeps the tree now.
    ws.store.forget(base)
    assert ws.store.conn.execute("SELECT path FROM state_dirs").fetchall() == [(d,)]
    r = _rewindfs("gc", store=tmp_path / "store")
    assert r.returncode == 0, r.stderr
    Store(tmp_path / "store").get_tree(base.tree_id)  # still there
    # An upper that cannot be read: GC refuses to run and deletes nothing.
    files = [Path(d) / f"upper.sqlite{x}" for x in ("", "-wal", "-shm")]
    good = {f: f.read_bytes() for f in files if f.exists()}
    for f in files:
        f.unlink(missing_ok=True)
    files[0].write_bytes(b"not a database" * 100)
    r = _rewindfs("gc", store=tmp_path / "store")
    assert r.returncode != 0 and "state directory" in r.stderr, r.stderr
    Store(tmp_path / "store").get_tree(base.tree_id)
    for f, data in good.items():
        f.write_bytes(data)
    again = _resume(ws, s.id)
    try:
        assert again.root is not None and ref_of(again.root) == base
        assert (again.log()[-1].event, again.log()[-1].ref) == ("WorkspaceRestored", base)
    finally:
        again.shutdown()


# -- CLI ------------------------------------------------------------------------------------------

def test_cli_session_new_is_a_mount_and_shutdown_unmounts(tmp_path: Path) -> None:
    store = tmp_path / "store"
    base = tmp_path / "ws"

    def cli(*args: str) -> dict[str, object]:
        r = _rewindfs(*args, "--json", store=store)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert isinstance(out, dict)
        return out

    s = cli("session", "new", "--base", str(base))
    root = Path(str(s["root"]))
    assert fh.is_fuse_mounted(root)
    (root / "f").write_text("through the mount\n")
    ref = cli("session", "checkpoint", str(s["id"]))["ref"]
    assert Ref.parse(str(ref)) == ref_of(root)
    # The live-mount commands reach the same session through its mount point.
    (root / "g").write_text("more\n")
    changes = cli("diff", str(root))["changes"]
    assert isinstance(changes, list) and [c["path"] for c in changes] == ["g"]
    st = cli("status", str(root))
    assert st["dirty_inodes"] == 1 and st["ref"] == ref
    ck = cli("checkpoint", str(root))
    assert ck["unchanged"] is False and Ref.parse(str(ck["ref"])) == ref_of(root)
    log = json.loads(_rewindfs("log", str(s["id"]), "--json", store=store).stdout)
    assert [e["trigger"] for e in log] == ["seed", "manual", "manual"]
    listed = json.loads(_rewindfs("session", "list", "--json", store=store).stdout)
    assert [(r["id"], r["state"]) for r in listed] == [(s["id"], "running")]
    cli("session", "shutdown", str(s["id"]))
    assert not fh.is_fuse_mounted(root)
    r = cli("session", "resume", str(s["id"]))
    assert fh.is_fuse_mounted(root) and (root / "f").read_text() == "through the mount\n"
    cli("session", "shutdown", str(r["id"]))
    assert not fh.is_fuse_mounted(root)


@pytest.mark.parametrize("placement", ["exclusive", "shared"])
def test_cli_processes_racing_for_one_fixed_root(tmp_path: Path, placement: str) -> None:
    """Exclusive: exactly one wins, the other exits with WorkspaceRootBusyError naming the
    root. Shared: both get sessions of one mount, served by one daemon."""
    store = tmp_path / "store"
    root = tmp_path / "root"
    populate(root, 0)
    adopted = ref_of(root)
    argv = [sys.executable, "-m", "rewindfs", "--store", str(store), "session", "new",
            "--placement", placement, "--root", str(root), "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=str(REPO), env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    ids = [json.loads(o)["id"] for (o, _), c in zip(outs, codes, strict=True) if c == 0]
    try:
        if placement == "exclusive":
            assert sorted(codes) == [0, 10], outs
            err = next(e for (_, e), c in zip(outs, codes, strict=True) if c != 0)
            assert "WorkspaceRootBusyError" in err or "is held by another session" in err
            assert str(root) in err
        else:
            assert codes == [0, 0], outs
            pids = set()
            for sid in ids:
                path = control_path(str(store / "sessions" / sid))
                assert path is not None
                pids.add(int(request(path, {"op": "status"}, 30)["pid"]))
            assert len(pids) == 1, "one daemon serves the shared root"
        assert fh.is_fuse_mounted(root)
    finally:
        for sid in ids:
            r = _rewindfs("session", "shutdown", sid, store=store)
            assert r.returncode == 0, r.stderr
    assert not fh.is_fuse_mounted(root)
    assert ref_of(root) == adopted, "written back as it was"
