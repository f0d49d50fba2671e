"""Session behaviour a harness relies on (CONTRACT 4), run against every session backend.

Each test works on real directories and a real store: checkpoint and restore give back
exactly a snapshot (``compute_ref`` of the root equals the target), the journal records what
happened in order, seed/fork/adoption follow their rules, shutdown makes no checkpoint and
frees the root, faults and permits refuse what they must and change nothing.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from session_support import BACKENDS, MODES, pack_count, populate, ref_of, workspace

from fusefs.session import (
    CheckpointError,
    PlacementDriftError,
    RestoreError,
    SeedError,
    SessionClosedError,
    SessionFaultedError,
    SnapshotPolicy,
    Workspace,
    WorkspaceNotConfiguredError,
    WorkspaceRootBusyError,
    define,
)
from fusefs.session.journal import STEP
from store.errors import ObjectNotFoundError
from store.lease import Leaser
from store.ref import Ref


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def events(s) -> list[tuple[str, str | None, Ref]]:  # type: ignore[no-untyped-def]
    return [(e.event[len("Workspace"):], e.trigger, e.ref) for e in s.log()]


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_restore_journal_order(tmp_path: Path, backend: str, mode: str) -> None:
    ws = workspace(tmp_path, mode, backend)
    with ws.new_session() as s:
        assert s.root is not None
        seed = s.log()[0].ref
        populate(s.root, 0)
        a = s.checkpoint()
        assert ref_of(s.root) == a
        populate(s.root, 1)
        (Path(s.root) / "README").unlink()
        b = s.checkpoint()
        assert a != b and ref_of(s.root) == b
        pre = s.restore(a)
        assert pre == b
        assert ref_of(s.root) == a
        assert (Path(s.root) / "README").read_text() == "readme\n"
        assert not (Path(s.root) / "new1").exists()
        assert oct(os.lstat(Path(s.root) / "ro").st_mode & 0o7777) == "0o555"
        assert os.readlink(Path(s.root) / "link") == "src/main.py"
        consistency = "fuzzy" if mode == "shared" else "quiescent"
        assert [(e.consistency, e.epoch) for e in s.log() if e.trigger] == \
            [(consistency, s.epoch)] * 4
        assert events(s) == [("Checkpointed", "seed", seed), ("Checkpointed", "manual", a),
                             ("Checkpointed", "manual", b), ("Checkpointed", "pre_restore", b),
                             ("Restored", None, a)]
        assert [e.seq for e in s.log()] == [1, 2, 3, 4, 5]
        assert s.restore_pointer() == a
        # Every checkpoint stays restorable, in any order.
        s.restore(b, discard=True)
        assert ref_of(s.root) == b
        s.restore(seed, discard=True)
        assert ref_of(s.root) == seed
        assert events(s)[-2:] == [("Restored", None, b), ("Restored", None, seed)]
    base = Path(s.root).parent
    assert not [n for n in os.listdir(base) if n.startswith(".")], "scratch left behind"


@pytest.mark.parametrize("mode", MODES)
def test_unchanged_checkpoint_returns_same_ref(tmp_path: Path, backend: str,
                                               mode: str) -> None:
    ws = workspace(tmp_path, mode, backend)
    with ws.new_session() as s:
        assert s.root is not None
        populate(s.root)
        a = s.checkpoint()
        packs = pack_count(ws.store)
        assert s.checkpoint() == a
        assert pack_count(ws.store) == packs


@pytest.mark.parametrize("mode", MODES)
def test_restore_of_a_missing_ref_changes_nothing(tmp_path: Path, backend: str,
                                                  mode: str) -> None:
    ws = workspace(tmp_path, mode, backend)
    with ws.new_session() as s:
        assert s.root is not None
        populate(s.root)
        before = ref_of(s.root)
        n = len(s.log())
        with pytest.raises(ObjectNotFoundError):
            s.restore(Ref.parse("v1:blake3:" + "ab" * 32), discard=True)
        assert ref_of(s.root) == before and len(s.log()) == n


def test_unconfigured_workspace_touches_nothing(tmp_path: Path) -> None:
    ws = Workspace(define())
    s = ws.new_session()
    assert s.root is None
    with pytest.raises(WorkspaceNotConfiguredError) as ei:
        s.checkpoint()
    assert ei.value.op == "checkpoint"
    with pytest.raises(WorkspaceNotConfiguredError):
        s.restore("v1:blake3:" + "0" * 64)
    s.turn_done()
    s.shutdown()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_makes_no_checkpoint_and_frees_the_root(tmp_path: Path, backend: str,
                                                         mode: str) -> None:
    ws = workspace(tmp_path, mode, backend)
    s = ws.new_session()
    assert s.root is not None
    populate(s.root)
    n = len(s.log())
    live = ref_of(s.root)
    s.shutdown()
    s.shutdown()  # idempotent
    assert len(s.log()) == n
    if backend == "fuse" and mode == "per-session":
        # A per-session root is only a mount point: unmounted, its tree stays in the upper.
        assert list(Path(s.root).iterdir()) == []
    else:
        assert (Path(s.root) / "README").exists(), "the live tree stays in place"
        assert ref_of(s.root) == live
    with pytest.raises(SessionClosedError):
        s._h("checkpoint").checkpoint("manual", None)
    with pytest.raises(RestoreError) as ei:
        s.restore(s.log()[0].ref)
    assert ei.value.kind == "closing"
    # Both leases are released: the session and (exclusive) the root can be taken at once.
    leaser = Leaser(ws.store)
    assert leaser.current(f"session/{s.id}") is None
    if mode == "exclusive":
        with ws.new_session() as s2:
            assert s2.root == s.root
    with ws.resume_session(s.id) as again:
        assert again.epoch == 2
        assert ref_of(again.root or "") == live


# -- seed, fork, adoption (CONTRACT 4.4, 4.1) ---------------------------------------------


@pytest.mark.parametrize("mode", ["per-session", "exclusive"])
def test_seed_from_directory_and_ref(tmp_path: Path, backend: str, mode: str) -> None:
    src = tmp_path / "src"
    populate(src, 2)
    ws = workspace(tmp_path, mode, backend)
    with ws.new_session(seed=str(src)) as s:
        assert s.root is not None
        want = ref_of(src)
        assert ref_of(s.root) == want
        assert events(s) == [("Checkpointed", "seed", want)]
    if mode == "exclusive":
        # The root is not empty now: a seed would overwrite it; it is adopted instead.
        with pytest.raises(SeedError):
            ws.new_session(seed=want)
        with ws.new_session() as adopted:
            assert events(adopted) == [("Checkpointed", "seed", want)]
        return
    with ws.new_session(seed=want) as s2:
        assert s2.root is not None and ref_of(s2.root) == want
        assert events(s2) == [("Checkpointed", "seed", want)]


def test_seed_refused_for_shared_placement(tmp_path: Path, backend: str) -> None:
    src = tmp_path / "src"
    populate(src)
    ws = workspace(tmp_path, "shared", backend)
    with pytest.raises(SeedError):
        ws.new_session(seed=str(src))
    assert ws.sessions() == []


@pytest.mark.parametrize("mode", MODES)
def test_seed_that_is_not_in_the_store_registers_nothing(tmp_path: Path, backend: str,
                                                          mode: str) -> None:
    ws = workspace(tmp_path, mode, backend)
    with pytest.raises((ObjectNotFoundError, SeedError)):
        ws.new_session(seed="v1:blake3:" + "cd" * 32)
    with pytest.raises(SeedError):
        ws.new_session(seed=str(tmp_path / "no-such-dir"))
    assert ws.sessions() == []


@pytest.mark.parametrize("mode", ["exclusive", "shared"])
def test_adoption_and_write_back_of_a_non_empty_fixed_root(tmp_path: Path, backend: str,
                                                           mode: str) -> None:
    root = tmp_path / "project"
    populate(root, 0)
    adopted = ref_of(root)
    ws = workspace(tmp_path, mode, backend, root=root)
    s = ws.new_session()
    assert s.root == str(root)
    assert events(s) == [("Checkpointed", "seed", adopted)]
    populate(root, 1)
    (root / "src" / "main.py").unlink()
    a = s.checkpoint()
    (root / "after-checkpoint").write_text("kept\n")
    final = ref_of(root)
    s.shutdown()
    # The directory holds the final tree exactly, checkpointed or not.
    assert ref_of(root) == final != a
    assert (root / "after-checkpoint").read_text() == "kept\n"
    # Restoring the adopted state later gives the original directory back exactly.
    with ws.resume_session(s.id) as s2:
        s2.restore(adopted)
        assert ref_of(root) == adopted


def test_fork_from_session_and_from_ref_copies_no_content(tmp_path: Path, backend: str) -> None:
    ws = workspace(tmp_path, "per-session", backend)
    src = ws.new_session()
    assert src.root is not None
    populate(src.root, 1)
    packs = None
    child = ws.fork_session(src.id)
    forked = events(src)[-1]
    assert forked[:2] == ("Checkpointed", "fork")
    assert child.root is not None and ref_of(child.root) == forked[2]
    assert events(child) == [("Checkpointed", "seed", forked[2])]
    assert child.record.parent == src.id
    packs = pack_count(ws.store)
    grandchild = ws.fork_session(str(forked[2]))
    assert grandchild.root is not None and ref_of(grandchild.root) == forked[2]
    assert grandchild.record.parent == str(forked[2])
    assert pack_count(ws.store) == packs, "a fork stores no content"
    # Forks are independent.
    (Path(child.root) / "README").write_text("changed in the child\n")
    assert (Path(src.root) / "README").read_text() != "changed in the child\n"
    for s in (grandchild, child, src):
        s.shutdown()
    # Fork of a closed session resumes it for the fork checkpoint.
    again = ws.fork_session(src.id)
    assert events(src)[-1][:2] == ("Checkpointed", "fork")
    again.shutdown()


def test_fork_refused_for_shared_placement(tmp_path: Path, backend: str) -> None:
    ws = workspace(tmp_path, "shared", backend)
    with ws.new_session() as s:
        with pytest.raises(SeedError):
            ws.fork_session(s.id)


# -- placement drift, permits, symlinked roots, faults ----------------------------------------


def test_resume_under_another_placement_is_drift(tmp_path: Path, backend: str) -> None:
    ws = workspace(tmp_path, "per-session", backend)
    s = ws.new_session()
    s.shutdown()
    other = workspace(tmp_path, "per-session", backend, root=tmp_path / "elsewhere",
                      store=ws.store)
    with pytest.raises(PlacementDriftError) as ei:
        other.resume_session(s.id)
    assert ei.value.recorded == f"per-session:{tmp_path / 'ws'}"
    assert ei.value.current == f"per-session:{tmp_path / 'elsewhere'}"


@pytest.mark.parametrize("mode", MODES)
def test_restore_waits_for_writers_then_fails_with_nothing_changed(tmp_path: Path,
                                                                   backend: str,
                                                                   mode: str) -> None:
    ws = workspace(tmp_path, mode, backend)
    with ws.new_session() as s:
        assert s.root is not None
        seed = s.log()[0].ref
        populate(s.root)
        before = ref_of(s.root)
        n = len(s.log())
        with s.write_permit():
            with pytest.raises(RestoreError) as ei:
                s.restore(seed, timeout_s=0.2)
            assert ei.value.kind == "permit_failed"
            with pytest.raises(CheckpointError):
                s.checkpoint(timeout_s=0.2)
        assert ref_of(s.root) == before and len(s.log()) == n
        # A writer that finishes in time lets the restore through.
        done = threading.Event()

        def writer() -> None:
            with s.write_permit():
                done.set()
                time.sleep(0.3)
                (Path(s.root or "") / "late").write_text("x")

        t = threading.Thread(target=writer)
        t.start()
        done.wait()
        pre = s.restore(seed)
        t.join()
        assert pre is not None and pre != before, "the writer's change was checkpointed"
        assert ref_of(s.root) == seed


@pytest.mark.parametrize("mode", MODES)
def test_cancelled_restore_is_context_done(tmp_path: Path, backend: str, mode: str) -> None:
    ws = workspace(tmp_path, mode, backend)
    with ws.new_session() as s:
        cancel = threading.Event()
        cancel.set()
        with pytest.raises(RestoreError) as ei:
            s.restore(s.log()[0].ref, cancel=cancel)
        assert ei.value.kind == "context_done"
        assert len(s.log()) == 1


@pytest.mark.parametrize("mode", MODES)
def test_symlinked_root_and_component_are_refused(tmp_path: Path, mode: str) -> None:
    real = tmp_path / "real"
    real.mkdir()
    ws = workspace(tmp_path, mode, "fallback", root=real / "ws")
    s = ws.new_session()
    assert s.root is not None
    seed = s.log()[0].ref
    populate(s.root)
    moved = tmp_path / "moved"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.rename(s.root, moved)
    os.symlink(elsewhere, s.root)
    with pytest.raises(RestoreError) as ei:
        s.restore(seed, discard=True)
    assert ei.value.kind == "symlink_root"
    assert list(elsewhere.iterdir()) == []
    os.unlink(s.root)
    os.rename(moved, s.root)
    os.rename(real, tmp_path / "real2")
    os.symlink(tmp_path / "real2", real)
    with pytest.raises(RestoreError) as ei:
        s.restore(seed, discard=True)
    assert ei.value.kind == "symlink_component"
    assert (tmp_path / "real2" / Path(s.root).relative_to(real) / "README").exists()
    s.shutdown()


def test_lost_lease_faults_the_session_terminally(tmp_path: Path, backend: str) -> None:
    ws = workspace(tmp_path, "exclusive", backend, ttl=0.6)
    s = ws.new_session()
    far = Leaser(ws.store, clock=lambda: time.time_ns() + 3_600 * 10**9)
    assert ws.config.placement is not None and ws.config.placement.lease_name is not None
    stolen = far.acquire(ws.config.placement.lease_name, "thief", 60)
    deadline = time.monotonic() + 30
    while s.fault is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.fault is not None and "lost" in s.fault
    with pytest.raises(SessionFaultedError) as ei:
        s.checkpoint()
    assert ei.value.terminal
    with pytest.raises(RestoreError) as ri:
        s.restore(s.log()[0].ref)
    assert ri.value.kind == "faulted"
    s.shutdown()
    assert stolen.epoch == 2


def test_exclusive_root_is_busy_while_held(tmp_path: Path, backend: str) -> None:
    ws = workspace(tmp_path, "exclusive", backend)
    with ws.new_session() as s:
        with pytest.raises(WorkspaceRootBusyError) as ei:
            ws.new_session()
        assert ei.value.root == s.root and ei.value.holder_epoch == 1
    assert ws.sessions()[0].id == s.id and len(ws.sessions()) == 1


# -- snapshot policy run by the session (CONTRACT 4.3) ----------------------------------------


def test_turn_and_step_triggers(tmp_path: Path, backend: str) -> None:
    ws = workspace(tmp_path, "per-session", backend,
                   policy=SnapshotPolicy("on_step_done", "required"))
    with ws.new_session() as s:
        assert s.root is not None
        (Path(s.root) / "f").write_text("1")
        s.turn_done()  # not this policy's trigger
        assert [e.trigger for e in s.log() if e.event != STEP] == ["seed"]
        s.step_done()
        assert [e.trigger for e in s.log() if e.event != STEP] == ["seed", "step_done"]
        assert s.log()[-1].ref == ref_of(s.root)
        # Each call also journals a step (the step log) where the backend keeps one.
        steps = [e.seq for e in s.log() if e.event == STEP]
        assert steps == ([2, 3] if backend == "fuse" else [])
    ws2 = workspace(tmp_path / "b", "per-session", backend,
                    policy=SnapshotPolicy("on_turn_done", "best_effort"))
    with ws2.new_session() as s2:
        assert s2.root is not None
        (Path(s2.root) / "f").write_text("2")
        s2.turn_done()
        deadline = time.monotonic() + 30
        while [e.trigger for e in s2.log() if e.event != STEP] != ["seed", "turn_done"]:
            assert time.monotonic() < deadline, s2.log()
            time.sleep(0.02)
        assert s2.log()[-1].ref == ref_of(s2.root)


def test_idle_trigger_fires_after_a_quiet_period(tmp_path: Path, backend: str) -> None:
    ws = workspace(tmp_path, "per-session", backend,
                   policy=SnapshotPolicy(idle_s=0.2))
    with ws.new_session() as s:
        assert s.root is not None
        with s.write_permit():
            (Path(s.root) / "f").write_text("idle")
        deadline = time.monotonic() + 30
        while [e.trigger for e in s.log() if e.event != STEP] != ["seed", "idle"]:
            assert time.monotonic() < deadline, s.log()
            time.sleep(0.02)
        assert s.log()[-1].ref == ref_of(s.root)


def _unsnapshottable(root: Path) -> Path:
    """Put an entry into ``root`` that makes its snapshot fail closed: an unreadable
    directory. Root reads every entry, and every kind of entry is recorded (device nodes
    too), so as root there is none to put."""
    if os.geteuid() == 0:
        pytest.skip("as root every entry can be snapshotted")
    locked = root / "locked"
    locked.mkdir()
    locked.chmod(0)
    return locked


def test_required_failure_latches_until_a_manual_checkpoint(tmp_path: Path,
                                                            backend: str) -> None:
    ws = workspace(tmp_path, "per-session", backend,
                   policy=SnapshotPolicy("on_turn_done", "required"))
    with ws.new_session() as s:
        assert s.root is not None
        seed = s.log()[0].ref
        bad = _unsnapshottable(Path(s.root))
        with pytest.raises(CheckpointError):
            s.turn_done()
        assert s.fault is not None
        with pytest.raises(SessionFaultedError) as ei:
            s.turn_done()
        assert not ei.value.terminal
        with pytest.raises(RestoreError) as ri:
            s.restore(seed)
        assert ri.value.kind == "faulted"
        with pytest.raises(CheckpointError):
            s.checkpoint()  # a failed manual checkpoint does not clear it
        assert s.fault is not None
        if bad.is_dir():
            bad.chmod(0o755)
            bad.rmdir()
        else:
            bad.unlink()
        s.checkpoint()
        assert s.fault is None
        s.turn_done()
        assert [e.trigger for e in s.log() if e.event != STEP] == ["seed", "manual", "turn_done"]
