"""kill -9 of the mount daemon at each named step of a checkpoint and of a restore (CONTRACT
3, crash safety): after a remount the mount is either the old or the new state, never a
mix, nothing fsynced is lost, and the upper's recorded base tells which state it is.

The daemon stops itself at a step named by ``$REWINDFS_CRASH_AT`` (``fusefs.checkpoint.
POINTS``), a test hook that sends it SIGKILL.
"""

from __future__ import annotations

import os
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import client, recorded_base

from fusefs.checkpoint import CRASH_ENV, POINTS
from store.browse import resolve
from store.errors import SnapshotNotFoundError
from store.objects import Store
from store.ref import Ref
from store.snapshot import compute_ref

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


def start_crashing(mounter: fh.Mounter, ref: str, point: str,
                   monkeypatch: pytest.MonkeyPatch) -> fh.Daemon:
    monkeypatch.setenv(CRASH_ENV, point)
    try:
        return mounter.rw(ref)
    finally:
        monkeypatch.delenv(CRASH_ENV)


def make_changes(m: Path) -> None:
    """Changes of several kinds, then one fsync, which makes all of them durable."""
    (m / "dir" / "a.txt").write_bytes(b"changed a\n")
    (m / "new").mkdir()
    (m / "new" / "f").write_bytes(fh.pattern(200_000, seed=5))
    os.unlink(m / "plain.txt")
    os.rename(m / "dir" / "sub", m / "moved")
    with open(m / "synced.txt", "wb") as f:
        f.write(b"fsynced\n")
        f.flush()
        os.fsync(f.fileno())


def listed(store: Path) -> set[str]:
    st = Store(store)
    try:
        return {str(s.ref) for s in st.list_snapshots()}
    finally:
        st.close()


@pytest.mark.parametrize("point", [p for p in POINTS if p.startswith("checkpoint.")])
def test_kill9_during_checkpoint(point: str, mounter: fh.Mounter, fuse_store: Path,
                                 lower_ref: str, monkeypatch: pytest.MonkeyPatch) -> None:
    d = start_crashing(mounter, lower_ref, point, monkeypatch)
    m = d.mnt
    make_changes(m)
    state = str(compute_ref(m))  # what the checkpoint freezes
    with pytest.raises(OSError):
        client(m).checkpoint()
    mounter.kill9(d)
    mounter.restart(d)
    assert str(compute_ref(m)) == state  # the same tree, whichever side it is on
    assert (m / "synced.txt").read_bytes() == b"fsynced\n"
    base = recorded_base(d.state)  # type: ignore[arg-type]
    assert base == (state if point == "checkpoint.reset" else lower_ref)
    if point != "checkpoint.committed":
        assert state in listed(fuse_store)
    assert client(m).checkpoint()["ref"] == state  # and it checkpoints normally again


@pytest.mark.parametrize("point,discard", [
    (p, False) for p in POINTS if p.startswith("restore.")] + [
    ("restore.verified", True), ("restore.swapped", True)])
def test_kill9_during_restore(point: str, discard: bool, mounter: fh.Mounter,
                              fuse_store: Path, lower_ref: str,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    d = start_crashing(mounter, lower_ref, point, monkeypatch)
    m = d.mnt
    make_changes(m)
    old = str(compute_ref(m))
    with pytest.raises(OSError):
        client(m).restore(lower_ref, discard=discard)
    mounter.kill9(d)
    mounter.restart(d)
    now = str(compute_ref(m))
    base = recorded_base(d.state)  # type: ignore[arg-type]
    if point in ("restore.swapped", "restore.appended"):
        assert now == lower_ref and base == lower_ref
    else:
        assert now == old  # nothing changed: the old state, fsynced data included
        assert (m / "synced.txt").read_bytes() == b"fsynced\n"
        if point == "restore.paused" or discard:
            assert base == lower_ref
        else:
            assert base == old  # the pre-restore checkpoint is the base now
    r = client(m).restore(old if now == lower_ref and not discard else lower_ref)
    assert str(compute_ref(m)) == r["ref"]


def excluding_state(mounter: fh.Mounter, ref: str, patterns: tuple[str, ...]) -> Path:
    """A new state directory over ``ref`` whose upper records ``patterns`` as the session's
    exclude patterns (as a session records its spec's)."""
    from fusefs.upper import Upper

    state = mounter.base / f"xstate{len(patterns)}"
    st = Store(mounter.store)
    try:
        up = Upper.open(str(state), store_root=st.root, chunk_size=st.chunk_size,
                        ref=Ref.parse(ref))
        up.set_exclude(patterns)
        up.close()
    finally:
        st.close()
    return state


@pytest.mark.parametrize("point", [p for p in POINTS if p.startswith("checkpoint.")])
def test_kill9_during_checkpoint_keeps_excluded_paths(
        point: str, mounter: fh.Mounter, fuse_store: Path, lower_ref: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With exclude patterns the reset keeps the excluded entries in the upper in the same
    transaction: killed at any step, the mount comes back whole, excluded files included,
    on the old base or on the new one (which holds none of them)."""
    state = excluding_state(mounter, lower_ref, ("node_modules/",))
    monkeypatch.setenv(CRASH_ENV, point)
    try:
        d = mounter.rw(lower_ref, state=state)
    finally:
        monkeypatch.delenv(CRASH_ENV)
    m = d.mnt
    make_changes(m)
    (m / "dir" / "node_modules" / "pkg").mkdir(parents=True)
    (m / "dir" / "node_modules" / "pkg" / "index.js").write_bytes(b"kept\n")
    with open(m / "node_modules.sync", "wb") as f:  # not excluded: a file, not a directory
        f.write(b"x")
        f.flush()
        os.fsync(f.fileno())
    whole = str(compute_ref(m))
    with pytest.raises(OSError):
        client(m).checkpoint()
    mounter.kill9(d)
    mounter.restart(d)
    assert str(compute_ref(m)) == whole  # everything, excluded paths included
    assert (m / "dir" / "node_modules" / "pkg" / "index.js").read_bytes() == b"kept\n"
    ref = client(m).checkpoint()["ref"]
    st = Store(fuse_store)
    try:
        with pytest.raises(SnapshotNotFoundError):
            resolve(st, ref, "dir/node_modules")
        assert resolve(st, ref, "node_modules.sync") is not None
        base = recorded_base(d.state)  # type: ignore[arg-type]
        assert base == ref
    finally:
        st.close()
    assert (m / "dir" / "node_modules" / "pkg" / "index.js").read_bytes() == b"kept\n"
