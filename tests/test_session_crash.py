"""Crashes of the session process (CONTRACT 4.6, 4.7): kill -9 in the middle of a staged swap
or a reconcile, and kill -9 of a session with un-checkpointed work.

A child process opens a session, checkpoints A and B, and restores A with
``REWINDFS_CRASH_AT`` naming the point where it kills itself. The parent waits for the
leases to expire, resumes the session and checks the one invariant that matters: the live
tree is exactly the journal's restore pointer (the old state before the commit point, the
restored one after it), with no scratch directory left and a working session.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from session_support import child, read_line, reap, ref_of, retry, workspace

from fusefs.session import SessionBusyError, WorkspaceRootBusyError
from store.ref import Ref

TTL = "1.0"

CHILD = """
    import os, sys
    from pathlib import Path
    sys.path.insert(0, "tests")
    from session_support import workspace, populate
    tmp, mode, point = Path(os.environ["T_TMP"]), os.environ["T_MODE"], os.environ["T_POINT"]
    ws = workspace(tmp, mode, "fallback", ttl=float(os.environ["T_TTL"]))
    s = ws.new_session()
    populate(s.root, 0)
    a = s.checkpoint()
    populate(s.root, 1)
    (Path(s.root) / "README").unlink()
    b = s.checkpoint()
    print(s.id, a, b, flush=True)
    if point == "none":
        (Path(s.root) / "uncheckpointed").write_text("keep me\\n")
        s.restore(a)
        (Path(s.root) / "after-restore").write_text("keep me too\\n")
        print("ready", flush=True)
        sys.stdin.read()
    os.environ["REWINDFS_CRASH_AT"] = point
    s.restore(a)
    print("survived", flush=True)
"""

BEFORE_COMMIT = ["swap:staged", "swap:backup"]
AFTER_COMMIT = ["swap:committed", "swap:journaled"]
RC_BEFORE = ["reconcile:planned", "reconcile:step:0", "reconcile:step:2",
             "reconcile:step:mid", "reconcile:step:last"]
RC_AFTER = ["reconcile:committed", "reconcile:journaled"]


def crash(tmp: Path, mode: str, point: str) -> tuple[str, Ref, Ref]:
    p = child(CHILD, env={"T_TMP": str(tmp), "T_MODE": mode, "T_POINT": point,
                          "T_TTL": TTL})
    try:
        sid, a, b = read_line(p).split()
        assert p.wait(timeout=120) == -signal.SIGKILL, p.stderr.read() if p.stderr else ""
    finally:
        reap(p)
    return sid, Ref.parse(a), Ref.parse(b)


def resume(tmp: Path, mode: str, sid: str):  # type: ignore[no-untyped-def]
    ws = workspace(tmp, mode, "fallback")  # the child's short ttl is what expires
    return ws, retry(lambda: ws.resume_session(sid), (SessionBusyError, WorkspaceRootBusyError))


def logs_left(state_base: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(state_base) for f in files
            if f in ("swap.json", "reconcile.json")]


def scratch(root: str) -> list[str]:
    return [n for n in os.listdir(os.path.dirname(root)) if n.startswith(".")]


@pytest.mark.parametrize("point,mode", [(p, "per-session") for p in BEFORE_COMMIT + AFTER_COMMIT]
                         + [(p, "exclusive") for p in RC_BEFORE + RC_AFTER])
def test_crash_during_restore_is_recovered_at_start_up(tmp_path: Path, point: str,
                                                       mode: str) -> None:
    sid, a, b = crash(tmp_path, mode, point)
    ws, s = resume(tmp_path, mode, sid)
    with s:
        assert s.root is not None
        committed = point in AFTER_COMMIT + RC_AFTER
        want = a if committed else b
        assert ref_of(s.root) == want
        log = s.log()
        assert log[-1].ref == want, "the restore pointer is the live tree"
        if committed:
            assert log[-1].event == "WorkspaceRestored"
            # Journaled by the crashed process, or by the recovery under the new epoch.
            assert log[-1].epoch == (1 if point.endswith("journaled") else 2)
        else:
            assert (log[-1].event, log[-1].trigger) == ("WorkspaceCheckpointed", "pre_restore")
        assert [e.event for e in log].count("WorkspaceRestored") == (1 if committed else 0)
        assert scratch(s.root) == []
        assert logs_left(ws.config.state_base) == []
        # The session works again.
        other = b if committed else a
        s.restore(other)
        assert ref_of(s.root) == other
        assert scratch(s.root) == []


@pytest.mark.parametrize("mode", ["per-session", "exclusive"])
def test_killed_session_resumes_with_its_uncheckpointed_work(tmp_path: Path, mode: str) -> None:
    p = child(CHILD, env={"T_TMP": str(tmp_path), "T_MODE": mode, "T_POINT": "none",
                          "T_TTL": TTL})
    try:
        sid, a_text, b_text = read_line(p).split()
        assert read_line(p) == "ready"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        reap(p)
    a, b = Ref.parse(a_text), Ref.parse(b_text)
    ws, s = resume(tmp_path, mode, sid)
    with s:
        assert s.root is not None
        root = Path(s.root)
        assert (root / "after-restore").read_text() == "keep me too\n"
        assert not (root / "uncheckpointed").exists()  # it was in the pre_restore checkpoint
        assert (root / "README").read_text() == "readme\n"  # A's content
        log = s.log()
        seed = log[0].ref
        assert [(e.event[9:], e.trigger, e.ref) for e in log] == [
            ("Checkpointed", "seed", seed), ("Checkpointed", "manual", a),
            ("Checkpointed", "manual", b), ("Checkpointed", "pre_restore", log[3].ref),
            ("Restored", None, a)]
        assert log[3].ref != b, "the pre_restore checkpoint holds the un-checkpointed file"
        assert s.epoch == 2
        # Undo the restore: the un-checkpointed file of before comes back.
        s.restore(log[3].ref)
        assert (root / "uncheckpointed").read_text() == "keep me\n"


def test_interrupted_reconcile_of_a_shared_root_is_undone_by_the_next_session(
        tmp_path: Path) -> None:
    sid, a, b = crash(tmp_path, "shared", "reconcile:step:mid")
    ws = workspace(tmp_path, "shared", "fallback")
    with ws.new_session() as s:  # another session of the same shared root
        assert s.root is not None
        assert ref_of(s.root) == b, "rolled back to the state before the restore"
        assert s.log()[0].ref == b, "and adopted as that"
        assert scratch(s.root) == [] and logs_left(ws.config.state_base) == []
    crashed = ws.log(sid)
    assert (crashed[-1].trigger, crashed[-1].ref) == ("pre_restore", b)
