"""The step log's tracker (fusefs/steps.py) on an overlay driven without a mount, and its
journal events in the store (either catalog; rebuilt from the backend alone).

Incremental steps (from what the upper's batches touched) must report exactly what a walk
of the whole dirty set reports, whatever the agent did in between: random sequences of
creates, writes, truncates, chmods, unlinks, symlinks, mkdirs, rmdirs and renames of files
and directories, with batches committed at random points (as the daemon's commit loop
does) or not at all before the step.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from fusefs.inodes import ROOT_INO
from fusefs.lower import Lower
from fusefs.overlay import Overlay
from fusefs.steps import StepTracker, delta, fingerprints, preview_fps
from fusefs.upper import Upper
from store.objects import Store
from store.snapshot import snapshot
from store.tree import Kind


def _lower(root: Path) -> None:
    for d in range(4):
        (root / f"d{d}" / "sub").mkdir(parents=True)
        for f in range(5):
            (root / f"d{d}" / f"f{f}.txt").write_text(f"{d} {f}\n")
        (root / f"d{d}" / "sub" / "deep.txt").write_text("deep\n")
    (root / "top.txt").write_text("top\n")
    os.symlink("top.txt", root / "link")


@pytest.fixture
def ov(tmp_path: Path) -> Overlay:
    src = tmp_path / "src"
    src.mkdir()
    _lower(src)
    store = Store(tmp_path / "store")
    ref = snapshot(store, src)
    up = Upper.open(str(tmp_path / "state"), store_root=store.root,
                    chunk_size=store.chunk_size, ref=ref)
    o = Overlay(Lower(store, ref), up, uid=0, gid=0)
    yield o
    o.close()
    store.close()


def _dirs(ov: Overlay) -> list[bytes]:
    out, stack = [], [b""]
    while stack:
        p = stack.pop()
        out.append(p)
        n = ov.resolve(p) if p else ov.nodes[ROOT_INO]
        fh = ov.opendir(n.ino)
        try:
            for name, c, _cookie in ov.readdir(fh, 0):
                if name not in (b".", b"..") and c.kind is Kind.DIR:
                    stack.append(p + b"/" + name if p else name)
        finally:
            ov.releasedir(fh)
    return out


def _entries(ov: Overlay, d: bytes) -> list[tuple[bytes, Kind]]:
    n = ov.resolve(d) if d else ov.nodes[ROOT_INO]
    fh = ov.opendir(n.ino)
    try:
        return [(name, c.kind) for name, c, _ in ov.readdir(fh, 0)
                if name not in (b".", b"..")]
    finally:
        ov.releasedir(fh)


def _ino(ov: Overlay, d: bytes) -> int:
    return ov.resolve(d).ino if d else ROOT_INO


def _join(d: bytes, name: bytes) -> bytes:
    return d + b"/" + name if d else name


def _random_op(ov: Overlay, rnd: random.Random, k: int) -> None:
    dirs = _dirs(ov)
    d = rnd.choice(dirs)
    ents = _entries(ov, d)
    files = [n for n, kind in ents if kind is Kind.FILE]
    op = rnd.choice(["create", "write", "write", "truncate", "chmod", "unlink", "symlink",
                     "mkdir", "rmdir", "rename", "rename_dir"])
    try:
        if op == "create":
            fh, _n = ov.create(_ino(ov, d), b"new%d" % k, 0o644, os.O_RDWR, 0, 0)
            ov.write(fh, 0, b"made %d\n" % k)
            ov.release(fh)
        elif op in ("write", "truncate", "chmod", "unlink") and files:
            name = rnd.choice(files)
            n = ov.resolve(_join(d, name))
            if op == "write":
                fh = ov.open(n.ino, os.O_RDWR)
                ov.write(fh, rnd.randrange(8), b"w%d" % k)
                ov.release(fh)
            elif op == "truncate":
                ov.setattr(n.ino, size=rnd.randrange(3))
            elif op == "chmod":
                ov.setattr(n.ino, mode=rnd.choice([0o600, 0o644, 0o755]))
            else:
                ov.unlink(_ino(ov, d), name)
        elif op == "symlink":
            ov.symlink(_ino(ov, d), b"sl%d" % k, b"target", 0, 0)
        elif op == "mkdir":
            ov.mkdir(_ino(ov, d), b"nd%d" % k, 0o755, 0, 0)
        elif op == "rmdir":
            subs = [n for n, kind in ents if kind is Kind.DIR]
            if subs:
                ov.rmdir(_ino(ov, d), rnd.choice(subs))  # ENOTEMPTY unless empty
        elif op == "rename" and files:
            to = rnd.choice(dirs)
            ov.rename(_ino(ov, d), rnd.choice(files), _ino(ov, to), b"mv%d" % k)
        elif op == "rename_dir":
            subs = [n for n, kind in ents if kind is Kind.DIR]
            if subs:
                ov.rename(_ino(ov, d), rnd.choice(subs), _ino(ov, d), b"rd%d" % k)
    except OSError as e:
        assert e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.EINVAL, errno.ENOENT), e


@pytest.mark.parametrize("seed", range(12))
def test_incremental_steps_report_what_a_full_walk_reports(ov: Overlay, seed: int) -> None:
    rnd = random.Random(seed)
    tracker = StepTracker(ov)
    reference: dict[str, object] = {}
    for step in range(25):
        for k in range(rnd.randrange(6)):
            _random_op(ov, rnd, step * 100 + k)
            if rnd.random() < 0.5:
                ov.commit()  # the commit loop took a batch
        full = fingerprints(ov)
        assert full is not None  # no hard links here: the fast walk answers
        want = delta(reference, full)  # type: ignore[arg-type]
        got = {c["path"]: c["status"] for c in tracker.step()["changes"]}
        assert got == want, f"step {step}"
        assert tracker.prev == full
        reference = dict(full)
    assert tracker.walks < 25  # most steps were incremental



def _rewrite(ov: Overlay, path: bytes, data: bytes) -> None:
    fh = ov.open(ov.resolve(path).ino, os.O_RDWR)
    ov.write(fh, 0, data)
    ov.release(fh)


def test_a_step_looks_only_at_what_changed_since_the_previous_step(ov: Overlay) -> None:
    # The commit loop takes a batch once a second: steps in between must not look again
    # at every change since the last batch (a step's cost grew with the time since it).
    tracker = StepTracker(ov)
    files = [b"d%d/f%d.txt" % (d, f) for d in range(4) for f in range(5)]
    for p in files:
        _rewrite(ov, p, b"changed")
    assert len(tracker.step()["changes"]) == len(files)  # no batch committed yet
    assert tracker.walks == 1
    for k in range(3):  # one more change per step, still no batch
        _rewrite(ov, files[k], b"again %d" % k)
        got = tracker.step()["changes"]
        assert got == [{"path": os.fsdecode(files[k]), "status": "modified", "kind": "file"}]
        assert tracker.looked == 1
    _rewrite(ov, files[0], b"and again")  # an inode already in the uncommitted batch
    ov.setxattr(ov.resolve(files[1]).ino, b"user.k", b"v", 0)
    got = {c["path"] for c in tracker.step()["changes"]}
    assert got == {os.fsdecode(files[0]), os.fsdecode(files[1])}
    assert tracker.looked == 2
    ov.commit()
    assert tracker.step()["changes"] == []
    assert tracker.looked == 0
    assert tracker.walks == 1
    assert tracker.prev == fingerprints(ov)

def test_the_fast_walk_agrees_with_the_diff_of_a_checkpoint_preview(ov: Overlay) -> None:
    rnd = random.Random(7)
    for k in range(40):
        _random_op(ov, rnd, k)
    fast = fingerprints(ov)
    assert fast is not None
    slow = preview_fps(ov)
    # The preview lists every path below a removed or renamed directory too, and a path
    # below a renamed directory as added; the fast walk names the directory itself, and a
    # path below it by its change against the directory's own lower content (the
    # documented granularity).
    moved = [q for q, v in fast.items() if v[1] == "dir" and v[0] == "added"
             or v[0] == "removed"]

    def below(p: str) -> bool:
        return any(p.startswith(q + "/") for q in moved)

    assert {p: v[0] for p, v in slow.items() if not below(p)} == \
        {p: v[0] for p, v in fast.items() if not below(p)}
    assert {p for p in fast if below(p)} <= set(slow)


@pytest.mark.parametrize("catalog", ["sqlite", "postgresql"])
def test_steps_are_journal_rows_of_either_catalog_and_rebuild_from_the_backend(
        tmp_path: Path, catalog: str, request: pytest.FixtureRequest) -> None:
    from fusefs.session.journal import STEP, Journal
    from store.rebuild import rebuild_index
    from store.verify import verify

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("a\n")
    if catalog == "postgresql":
        from store.pgcatalog import PostgresCatalog

        dsn = str(request.getfixturevalue("pg_dsn"))
        store = Store(tmp_path / "store", catalog=PostgresCatalog(dsn))
    else:
        store = Store(tmp_path / "store")
    ref = snapshot(store, src)
    j = Journal(store, "s1")
    changes = [{"path": "a", "status": "modified", "kind": "file"}]
    assert j.step(ref, "EditFile a", changes, {"a": ["modified", "file", 2, 1, 1]}, 0) == (1, 1)
    assert j.step(ref, None, [], {}, 0) == (2, 2)
    j.restored(ref, 0)
    want = [(1, "EditFile a", changes), (2, None, [])]
    assert [(s["step"], s["label"], s["changes"]) for s in j.steps()] == want
    assert j.restore_pointer() == ref and [e.event for e in j.events()][:2] == [STEP, STEP]
    assert j.step_record(2)["seq"] == 2
    assert j.resume_point() == ({}, {})  # a restore came after the steps
    if catalog == "sqlite":
        store.close()
        for suffix in ("", "-wal", "-shm"):  # the index is lost: only the backend is left
            if os.path.exists(store.index_path + suffix):
                os.unlink(store.index_path + suffix)
        store = Store(tmp_path / "store")
        rebuild_index(store)
        assert [(s["step"], s["label"], s["changes"])
                for s in Journal(store, "s1").steps()] == want
        assert verify(store) == []
    store.close()


def test_step_numbers_stay_consecutive_when_another_appender_adds_events(
        tmp_path: Path) -> None:
    """The journal numbers steps from what it appended itself while nobody else appended,
    and from the journal when someone did (another Journal of the session: a checkpoint
    of the mount, a restarted process)."""
    from fusefs.session.journal import Journal

    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("a\n")
    store = Store(tmp_path / "store")
    ref = snapshot(store, src)
    mine, other = Journal(store, "s1"), Journal(store, "s1")
    assert mine.step(ref, None, [], {}, 0) == (1, 1)
    assert mine.step(ref, None, [], {}, 0) == (2, 2)
    assert other.step(ref, "elsewhere", [], {}, 0) == (3, 3)
    other.checkpointed(ref, "manual", "quiescent", 0)
    assert mine.step(ref, None, [], {}, 0) == (5, 4)
    mine.checkpointed(ref, "manual", "quiescent", 0)
    assert mine.step(ref, None, [], {}, 0) == (7, 5)
    assert other.step(ref, None, [], {}, 0) == (8, 6)
    assert [s["step"] for s in Journal(store, "s1").steps()] == [1, 2, 3, 4, 5, 6]
    store.close()
