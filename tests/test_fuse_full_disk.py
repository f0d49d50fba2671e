"""A full disk under a session mount's state directory loses no acknowledged change.

The state directory lives on a real 64 MiB tmpfs (mounted here, so the tests need root) and
the mount is a real FUSE mount started and stopped with the CLI (``rewindfs mount`` in the
background, ``rewindfs umount``), as a user runs it. The rule under test: a change the
kernel acknowledged is either in the next successful commit or its failure reached the
writer (ENOSPC at write, create or fsync); ``rm`` frees space while the disk is full; the
mount recovers in place once there is space; a persist that fails at unmount makes
``rewindfs umount`` exit non-zero and the next mount still has every acknowledged change.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest

from fusefs.inodes import ROOT_INO
from fusefs.lower import Lower
from fusefs.overlay import Overlay
from fusefs.upper import INLINE_MAX, RESERVE_NAME, Upper, check
from store.objects import Store
from store.snapshot import snapshot

DISK_MIB = 64
MIB = 1 << 20


def cli(store: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=fh.REPO)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, block: int = MIB) -> tuple[int, int]:
    """Write ``path`` until the disk refuses; returns (bytes acknowledged, errno seen)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    total = 0
    err = 0
    try:
        for size in (block, 4096, 1):  # then smaller pieces, to take the last bytes too
            buf = b"f" * size
            while True:
                try:
                    total += os.write(fd, buf)
                except OSError as e:
                    err = e.errno or 0
                    break
    finally:
        os.close(fd)
    return total, err


def write_new(path: Path, data: bytes) -> int:
    """Create ``path`` holding ``data``; 0 if open, write and close all succeeded (the
    kernel acknowledged it), else the errno the writer saw."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as e:
        return e.errno or -1
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
    except OSError as e:
        os.close(fd)
        return e.errno or -1
    os.close(fd)
    return 0


class Mount:
    """A background ``rewindfs mount`` of ``ref`` at ``mnt`` with its state in ``state``."""

    def __init__(self, store: Path, ref: str, mnt: Path, state: Path) -> None:
        self.store, self.ref, self.mnt, self.state = store, ref, mnt, state
        self.pids: list[int] = []

    def mount(self, with_ref: bool = True) -> None:
        self.mnt.mkdir(exist_ok=True)
        args = ["mount", *([self.ref] if with_ref else []), str(self.mnt), "--state",
                str(self.state), "--json"]
        r = cli(self.store, *args)
        assert r.returncode == 0, r.stderr + self.log()
        self.pids.append(json.loads(r.stdout)["pid"])

    def umount(self) -> subprocess.CompletedProcess[str]:
        return cli(self.store, "umount", str(self.mnt))

    def status(self) -> dict[str, object]:
        r = cli(self.store, "status", str(self.mnt), "--json")
        assert r.returncode == 0, r.stderr
        return dict(json.loads(r.stdout))

    def log(self) -> str:
        try:
            return "\n--- daemon.log ---\n" + (self.state / "daemon.log").read_text(
                errors="replace")[-6000:]
        except OSError:
            return ""

    def teardown(self) -> None:
        if fh.is_fuse_mounted(self.mnt):
            fh.fusermount(self.mnt, lazy=True)
        for pid in self.pids:
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.05)
            if os.path.exists(f"/proc/{pid}"):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _tmpfs(d: Path, mib: int) -> Iterator[Path]:
    """Mount a real tmpfs of ``mib`` MiB at ``d`` (made here); unmount it afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700",
                        "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of DISK_MIB MiB at ``tmp_path/disk``, unmounted at teardown."""
    yield from _tmpfs(tmp_path / "disk", DISK_MIB)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 32 MiB tmpfs at ``tmp_path/small``, for a store; needs FUSE too."""
    if not os.path.exists("/dev/fuse") or shutil.which(fh.FUSERMOUNT) is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    yield from _tmpfs(tmp_path / "small", 32)


@pytest.fixture
def disk(tmpfs: Path) -> Path:
    """``tmpfs``, for tests that also mount rewindfs."""
    if not os.path.exists("/dev/fuse") or shutil.which(fh.FUSERMOUNT) is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    return tmpfs


@pytest.fixture
def mount(disk: Path, fuse_store: Path, lower_ref: str, tmp_path: Path) -> Iterator[Mount]:
    m = Mount(fuse_store, lower_ref, tmp_path / "mnt", disk / "state")
    try:
        yield m
    finally:
        m.teardown()


def wait_for(cond, what: str, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def refused_mkdirs(d: Path, timeout: float = 10.0) -> list[str]:
    """mkdir ``new-dir-N`` in ``d`` until one is refused with ENOSPC (the mount has seen
    its full disk); returns the names that were acknowledged before that."""
    made: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        name = f"new-dir-{len(made)}"
        e = fh.errno_of(os.mkdir, d / name)
        if e == errno.ENOSPC:
            return made
        assert e == 0, os.strerror(e)
        made.append(name)
        time.sleep(0.2)
    raise AssertionError(f"mkdir still acknowledged on a full disk: {made}")


def test_rm_frees_space_on_a_full_disk_and_the_mount_recovers_in_place(
        mount: Mount, disk: Path) -> None:
    m = mount
    m.mount()
    mnt = m.mnt
    (mnt / "kept").mkdir()
    (mnt / "kept" / "a.txt").write_bytes(b"acknowledged before the disk filled\n")
    os.chmod(mnt / "kept" / "a.txt", 0o600)
    big = fh.pattern(3 * MIB, seed=3)
    (mnt / "kept" / "b.bin").write_bytes(big)
    os.rename(mnt / "plain.txt", mnt / "kept" / "renamed.txt")

    filled, err = fill(mnt / "fill")
    assert err == errno.ENOSPC, os.strerror(err)
    assert filled > 16 * MIB
    assert free_bytes(disk) < 4 * MIB
    # Exactly the acknowledged bytes are there (the last write may have been short).
    assert os.stat(mnt / "fill").st_size == filled
    with open(mnt / "fill", "rb") as f:
        f.seek(filled - 8192)
        assert f.read() == b"f" * 8192

    # Every change made while full is either refused (ENOSPC) or acknowledged and kept.
    small = write_new(mnt / "while-full.txt", b"small\n")
    assert small in (0, errno.ENOSPC), os.strerror(small)

    os.unlink(mnt / "fill")
    wait_for(lambda: free_bytes(disk) > 32 * MIB, "rm to free the space of the filler")

    # The mount works again in place: new data, fsync, a new directory, a checkpoint.
    after = fh.pattern(4 * MIB, seed=5)
    wait_for(lambda: write_new(mnt / "after.bin", after) == 0, "writes to work again")
    fd = os.open(mnt / "after.bin", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    (mnt / "after-dir").mkdir()
    r = cli(m.store, "checkpoint", str(mnt))
    assert r.returncode == 0, r.stderr + m.log()
    (mnt / "after-checkpoint.txt").write_bytes(b"on top of the checkpoint\n")

    r = m.umount()
    assert r.returncode == 0, r.stderr + m.log()
    m.mount(with_ref=False)
    try:
        assert (mnt / "kept" / "a.txt").read_bytes() == b"acknowledged before the disk filled\n"
        assert os.stat(mnt / "kept" / "a.txt").st_mode & 0o777 == 0o600
        assert (mnt / "kept" / "b.bin").read_bytes() == big
        assert (mnt / "kept" / "renamed.txt").read_bytes() == b"hello world\n"
        assert not (mnt / "plain.txt").exists()
        assert not (mnt / "fill").exists()
        assert (mnt / "while-full.txt").exists() == (small == 0)
        assert (mnt / "after.bin").read_bytes() == after
        assert (mnt / "after-dir").is_dir()
        assert (mnt / "after-checkpoint.txt").read_bytes() == b"on top of the checkpoint\n"
    finally:
        r = m.umount()
    assert r.returncode == 0, r.stderr + m.log()
    assert fh.upper_problems(m.state, m.store) == []


def test_a_persist_failing_at_unmount_exits_non_zero_and_the_next_mount_loses_nothing(
        mount: Mount, disk: Path) -> None:
    m = mount
    m.mount()
    mnt = m.mnt
    for i in range(20):
        (mnt / f"doomed-{i}.txt").write_bytes(f"file {i}\n".encode())
    (mnt / "keep.txt").write_bytes(b"keep me\n")
    (mnt / "gone-dir").mkdir()
    big = fh.pattern(2 * MIB, seed=7)
    (mnt / "big.bin").write_bytes(big)
    r = m.umount()
    assert r.returncode == 0, r.stderr + m.log()
    m.mount(with_ref=False)

    # Another program on the disk takes every free byte, the space of the mount's reserve
    # included (as it could once a full disk made the mount release it).
    os.truncate(m.state / RESERVE_NAME, 0)
    _, err = fill(disk / "filler")
    assert err == errno.ENOSPC

    # Removals are acknowledged on a full disk; the database cannot take them.
    for i in range(10):
        os.unlink(mnt / f"doomed-{i}.txt")
    os.rmdir(mnt / "gone-dir")
    # Whatever would add to the upper is refused with ENOSPC once the mount has seen the
    # full disk (its next commit); what it acknowledged before must be kept all the same.
    made = refused_mkdirs(mnt)
    assert m.status()["disk_full"] is True
    assert write_new(mnt / "new.txt", b"new\n") == errno.ENOSPC
    assert fh.errno_of(os.chmod, mnt / "keep.txt", 0o600) == errno.ENOSPC

    r = cli(m.store, "checkpoint", str(mnt))
    assert r.returncode != 0
    assert "ENOSPC" in r.stderr, r.stderr

    r = m.umount()
    assert r.returncode != 0, "umount exited 0 although persisting failed" + m.log()
    assert "ENOSPC" in r.stderr, r.stderr
    assert not fh.is_fuse_mounted(mnt)
    assert fh.upper_problems(m.state, m.store) == []  # the state dir is whole

    # Still full: the next mount refuses to start (naming the cause) and leaves nothing.
    r = cli(m.store, "mount", str(mnt), "--state", str(m.state))
    assert r.returncode != 0 and "ENOSPC" in r.stderr, r.stderr
    assert not fh.is_fuse_mounted(mnt)

    os.unlink(disk / "filler")
    m.mount(with_ref=False)
    try:
        for i in range(20):
            assert (mnt / f"doomed-{i}.txt").exists() == (i >= 10), i
        assert not (mnt / "gone-dir").exists()
        assert (mnt / "keep.txt").read_bytes() == b"keep me\n"
        assert os.stat(mnt / "keep.txt").st_mode & 0o777 == 0o644
        assert (mnt / "big.bin").read_bytes() == big
        for name in made:
            assert (mnt / name).is_dir(), name
        assert not (mnt / f"new-dir-{len(made)}").exists()
        assert not (mnt / "new.txt").exists()
        (mnt / "new.txt").write_bytes(b"room again\n")
        assert m.status().get("disk_full") is False
    finally:
        r = m.umount()
    assert r.returncode == 0, r.stderr + m.log()
    assert fh.upper_problems(m.state, m.store) == []
    # The log survived the full disk: what the daemon said while it was full is there.
    log = (m.state / "daemon.log").read_text(errors="replace")
    assert "changes are kept in the spill" in log and "ENOSPC" in log, log[-3000:]
    assert "persisting the upper at unmount failed" in log, log[-3000:]


def test_removals_spilled_on_a_full_disk_survive_a_crash_and_free_space_at_once(
        tmpfs: Path, tmp_path: Path) -> None:
    """The overlay without a mount: the database cannot grow, so the removals go to the
    spill, their data files are freed at once, and after a crash (nothing more written)
    the next open replays them."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "lower.txt").write_bytes(b"from the lower\n")
    store = Store(tmp_path / "store")
    ref = snapshot(store, src)
    state = str(tmpfs / "state")

    def open_overlay() -> Overlay:
        up = Upper.open(state, store_root=store.root, chunk_size=store.chunk_size, ref=ref)
        return Overlay(Lower(store, up.base), up, uid=0, gid=0)

    ov = open_overlay()
    body = {f"f{i}": fh.pattern(INLINE_MAX + 4 * MIB, seed=i) for i in range(5)}
    for name, data in body.items():
        fd, n = ov.create(ROOT_INO, name.encode(), 0o644, os.O_WRONLY, 0, 0)
        assert ov.write(fd, 0, data) == len(data)
        ov.release(fd)
        ov.forget(n.ino, 1)
    ov.commit(durable=True)

    os.truncate(Path(state) / RESERVE_NAME, 0)
    _, err = fill(tmpfs / "filler")
    assert err == errno.ENOSPC
    for name in ("f0", "f1", "f2"):
        ov.unlink(ROOT_INO, name.encode())
    ov.commit()  # no exception: the removals are durable in the spill
    assert ov.upper is not None and ov.upper.spilled
    assert free_bytes(tmpfs) >= 3 * 4 * MIB  # their data files are gone already
    assert fh.errno_of(ov.mkdir, ROOT_INO, b"more", 0o755, 0, 0) == errno.ENOSPC

    for n in ov.nodes.values():  # kill -9: nothing more is written
        if n.fd is not None:
            os.close(n.fd)
    ov.upper.close()
    os.unlink(tmpfs / "filler")

    ov = open_overlay()
    try:
        for name, data in body.items():
            n = ov.lookup(ROOT_INO, name.encode())
            if name in ("f0", "f1", "f2"):
                assert n is None, name
                continue
            assert n is not None, name
            fd = ov.open(n.ino, os.O_RDONLY)
            assert ov.read(fd, 0, len(data) + 1) == data
            ov.release(fd)
        assert ov.upper is not None and not ov.upper.spilled
    finally:
        ov.close()
    assert check(state, store) == []
    store.close()


def test_session_shutdown_after_a_failed_persist_fails_and_resume_loses_nothing(
        tmp_path: Path) -> None:
    """The same rule through a session (its host process persists at shutdown): the state
    base (``<store>/sessions``) is a real tmpfs that another program fills."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    if not os.path.exists("/dev/fuse") or shutil.which(fh.FUSERMOUNT) is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    from fusefs.session.control import control_path, request

    src = tmp_path / "src"
    src.mkdir()
    (src / "seed.txt").write_bytes(b"seed\n")
    store = tmp_path / "store"
    ref = fh.snapshot(store, src)
    base = store / "sessions"
    base.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m,mode=0700", "tmpfs",
                        str(base)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip()}")
    pids: list[int] = []
    root: Path | None = None

    def start(*args: str) -> dict[str, str]:
        r = cli(store, "session", *args, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        path = control_path(str(base / out["id"]))
        assert path is not None
        pids.append(int(request(path, {"op": "status"}, 30)["pid"]))
        return dict(out)

    try:
        s = start("new", "--seed", ref, "--base", str(tmp_path / "ws"))
        root = Path(s["root"])
        for i in range(10):
            (root / f"doomed-{i}.txt").write_bytes(f"file {i}\n".encode())
        (root / "keep.txt").write_bytes(b"keep me\n")
        time.sleep(1.5)  # committed by the session's write-behind
        reserves = list((base / s["id"]).rglob(RESERVE_NAME))
        assert len(reserves) == 1
        os.truncate(reserves[0], 0)
        _, err = fill(base / "filler")
        assert err == errno.ENOSPC
        for i in range(5):
            os.unlink(root / f"doomed-{i}.txt")
        made = refused_mkdirs(root)

        r = cli(store, "session", "shutdown", s["id"])
        assert r.returncode != 0, "session shutdown exited 0 although persisting failed"
        assert "ENOSPC" in r.stderr, r.stderr
        assert not fh.is_fuse_mounted(root)

        os.unlink(base / "filler")
        start("resume", s["id"])
        for i in range(10):
            assert (root / f"doomed-{i}.txt").exists() == (i >= 5), i
        assert (root / "keep.txt").read_bytes() == b"keep me\n"
        for name in made:  # acknowledged before the session saw the full disk
            assert (root / name).is_dir(), name
        (root / "after.txt").write_bytes(b"room again\n")
        r = cli(store, "session", "shutdown", s["id"])
        assert r.returncode == 0, r.stderr
        start("resume", s["id"])
        assert (root / "after.txt").read_bytes() == b"room again\n"
        assert all((root / name).is_dir() for name in made)
        r = cli(store, "session", "shutdown", s["id"])
        assert r.returncode == 0, r.stderr
    finally:
        if root is not None and fh.is_fuse_mounted(root):
            fh.fusermount(root, lazy=True)
        for pid in pids:
            deadline = time.monotonic() + 30
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.05)
            if os.path.exists(f"/proc/{pid}"):
                os.kill(pid, signal.SIGKILL)
        subprocess.run(["umount", "-l", str(base)], capture_output=True)


def test_a_checkpoint_into_a_full_store_fails_naming_enospc_and_succeeds_once_freed(
        disk: Path, tmp_path: Path) -> None:
    """The store (not the state directory) on the full disk: the checkpoint fails exit 10
    with one cause (the CLI said "checkpoint (manual) failed: checkpoint (manual) failed:
    ..."), the mount keeps every change, and the next checkpoint succeeds once space is
    freed."""
    store = disk / "store"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("lower\n")
    ref = fh.snapshot(store, src)
    m = Mount(store, ref, tmp_path / "mnt", tmp_path / "state")
    try:
        m.mount()
        filler = disk / "filler"
        fill(filler)
        data = os.urandom(4 * MIB)  # incompressible: its pack cannot fit
        (m.mnt / "big").write_bytes(data)
        r = cli(store, "checkpoint", str(m.mnt))
        assert r.returncode == 10, r.stderr + m.log()
        line = r.stderr.strip()
        assert "\n" not in line and line.count("checkpoint (manual) failed") == 1, line
        assert "No space left" in line or "ENOSPC" in line, line
        filler.unlink()
        r = cli(store, "checkpoint", str(m.mnt))
        assert r.returncode == 0, r.stderr + m.log()
        assert " big" in cli(store, "ls", r.stdout.strip()).stdout
        assert (m.mnt / "big").read_bytes() == data
        assert m.umount().returncode == 0
    finally:
        m.teardown()


def fill_leaving(path: Path, disk: Path, leave: int) -> None:
    """Write ``path`` until at most ``leave`` bytes (plus a page) stay free on ``disk``."""
    with open(path, "wb") as f:
        while free_bytes(disk) > leave + MIB:
            f.write(bytes(MIB))
            f.flush()
        while free_bytes(disk) > leave + 4096:
            try:
                f.write(bytes(4096))
                f.flush()
            except OSError:
                break


def test_a_store_filling_up_at_any_point_of_a_checkpoint_fails_typed_and_loses_nothing(
        small_disk: Path, tmp_path: Path) -> None:
    """The store alone on a 32 MiB tmpfs, filled to leave from nothing up to a few
    hundred KiB before each checkpoint: the pack write, the index commit and the snapshot
    listing each get to meet the full disk. Every checkpoint either succeeds or fails
    with one line naming ENOSPC (not a second ROLLBACK's "no transaction is active"); the
    live mount keeps serving and keeps every change; ``rewindfs verify`` is clean (while
    the disk is full it may instead refuse, naming ENOSPC, to bring the index up to date);
    once space is freed the next checkpoint holds everything and verify is clean."""
    store = small_disk / "store"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("lower\n")
    ref = fh.snapshot(store, src)
    m = Mount(store, ref, tmp_path / "mnt", tmp_path / "state")
    written: dict[str, bytes] = {}
    failed: list[str] = []
    try:
        m.mount()
        for i, leave in enumerate(range(0, 120 << 10, 12 << 10)):
            for name, data in ((f"r{i}", os.urandom(30_000)), (f"s{i}", b"small %d\n" % i)):
                (m.mnt / name).write_bytes(data)
                written[name] = data
            fill_leaving(small_disk / "filler", small_disk, leave)
            r = cli(store, "checkpoint", str(m.mnt))
            line = r.stderr.strip()
            assert r.returncode in (0, 10), line + m.log()
            if r.returncode:
                failed.append(line)
                assert "\n" not in line and "ENOSPC" in line, line
                assert "no transaction" not in line, line
            # verify first brings the index up to date with the backend (a listing durable
            # in the backend whose index row did not fit): on the full disk that may
            # itself fail, then typed, naming ENOSPC; once there is room it is clean.
            v = cli(store, "verify")
            assert v.returncode == 0 or ("ENOSPC" in v.stderr and "damaged" not in v.stderr), \
                v.stdout + v.stderr
            (m.mnt / f"w{i}").write_bytes(b"written while the store is full\n")
            written[f"w{i}"] = b"written while the store is full\n"
            for name, data in written.items():
                assert (m.mnt / name).read_bytes() == data, name
            os.unlink(small_disk / "filler")
            r = cli(store, "checkpoint", str(m.mnt))  # room again: it holds everything
            assert r.returncode == 0, r.stderr + m.log()
            listed = cli(store, "ls", r.stdout.strip()).stdout
            assert all(f" {name}" in listed for name in written), listed
            v = cli(store, "verify")
            assert v.returncode == 0, v.stdout + v.stderr
        assert any("packs/" in f for f in failed), failed  # the pack did not fit
        assert any("index" in f for f in failed), failed  # it did, its index rows did not
        assert cli(store, "verify").returncode == 0
        assert m.umount().returncode == 0
        # No process holds the index open now: a command on the full store disk gets a
        # typed ENOSPC error (never "the index is damaged, move it away").
        fill_leaving(small_disk / "filler", small_disk, 0)
        v = cli(store, "verify")
        assert v.returncode == 0 or ("ENOSPC" in v.stderr and "damaged" not in v.stderr), \
            v.stderr
        os.unlink(small_disk / "filler")
        m.mount(with_ref=False)
        for name, data in written.items():
            assert (m.mnt / name).read_bytes() == data, name
        assert m.umount().returncode == 0
    finally:
        m.teardown()


@pytest.mark.parametrize("dirty", [True, False], ids=["with-changes", "clean"])
def test_a_restore_on_a_full_state_disk_fails_cleanly_and_works_once_freed(
        mount: Mount, disk: Path, dirty: bool) -> None:
    """The state directory's disk full, its reserve taken by another program: a restore
    either succeeds or fails with one line naming ENOSPC (a typed RestoreError, exit 10;
    with changes it is the pre-restore checkpoint that cannot record its reset, on a
    clean tree the swap itself), and then the mount shows and keeps exactly what it had;
    once space is freed the same restore succeeds, and a remount shows the target."""
    m = mount
    m.mount()
    mnt = m.mnt
    (mnt / "d").mkdir()
    (mnt / "d" / "one").write_bytes(b"one\n")
    r = cli(m.store, "checkpoint", str(mnt))
    assert r.returncode == 0, r.stderr + m.log()
    target = m.ref if not dirty else r.stdout.strip()
    big = fh.pattern(3 * MIB, seed=11)
    if dirty:
        (mnt / "two").write_bytes(b"two\n")
        (mnt / "big").write_bytes(big)
        os.unlink(mnt / "plain.txt")
    before = sorted(fh.walk_tree(mnt))
    os.truncate(m.state / RESERVE_NAME, 0)
    _, err = fill(disk / "filler")
    assert err == errno.ENOSPC

    r = cli(m.store, "restore", str(mnt), target)
    if r.returncode:
        line = r.stderr.strip()
        assert r.returncode == 10, line + m.log()
        assert "\n" not in line and "ENOSPC" in line, line
        assert sorted(fh.walk_tree(mnt)) == before
        if dirty:
            assert (mnt / "big").read_bytes() == big
        os.unlink(disk / "filler")
        r = cli(m.store, "restore", str(mnt), target)
        assert r.returncode == 0, r.stderr + m.log()
    else:
        os.unlink(disk / "filler")
    assert not (mnt / "two").exists() and not (mnt / "big").exists()
    assert (mnt / "plain.txt").read_bytes() == b"hello world\n"
    assert (mnt / "d" / "one").exists() == dirty
    assert m.umount().returncode == 0
    m.mount(with_ref=False)
    assert (mnt / "plain.txt").read_bytes() == b"hello world\n"
    assert (mnt / "d" / "one").exists() == dirty
    if dirty:  # what the restore replaced is the pre-restore snapshot: nothing lost
        pre = json.loads(cli(m.store, "list", "--json").stdout)
        refs = [s["ref"] for s in pre if s.get("origin") == "pre_restore"]
        assert refs, pre
        listed = cli(m.store, "ls", refs[-1]).stdout
        assert " big" in listed and " two" in listed, listed
    assert m.umount().returncode == 0
    assert fh.upper_problems(m.state, m.store) == []


TINY_MIB = 20  # reserve 640 KiB (1/32) and spill slots of 320 KiB (1/64): many small files
SMALL_FILE = 3000  # inline content (below INLINE_MAX): it waits in the write-behind batch


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real TINY_MIB MiB tmpfs at ``tmp_path/tiny`` for a state directory; needs FUSE."""
    if not os.path.exists("/dev/fuse") or shutil.which(fh.FUSERMOUNT) is None:
        pytest.skip("needs /dev/fuse and fusermount3")
    yield from _tmpfs(tmp_path / "tiny", TINY_MIB)


def small_files_until_full(mnt: Path, prefix: str, limit: int = 20000) -> dict[str, bytes]:
    """Create files of SMALL_FILE random bytes in ``mnt`` until one is refused; assert it
    was refused with ENOSPC; return the acknowledged ones (create, write, close all
    succeeded), name -> content."""
    acked: dict[str, bytes] = {}
    for i in range(limit):
        data = os.urandom(SMALL_FILE)
        err = write_new(mnt / f"{prefix}{i}", data)
        if err:
            assert err == errno.ENOSPC, os.strerror(err)
            return acked
        acked[f"{prefix}{i}"] = data
    raise AssertionError(f"{limit} files of {SMALL_FILE} bytes acknowledged on a "
                         f"{TINY_MIB} MiB disk")


def assert_kept_after_growing(m: Mount, disk: Path, acked: dict[str, bytes]) -> None:
    """Unmount (the changes kept, if only in the spill), grow the disk, mount again: every
    acknowledged file is there with its bytes."""
    r = m.umount()
    assert "lost" not in r.stderr, r.stderr + m.log()
    assert not fh.is_fuse_mounted(m.mnt)
    subprocess.run(["mount", "-o", f"remount,size={4 * TINY_MIB}m", str(disk)], check=True)
    m.mount(with_ref=False)
    have = {p.name for p in m.mnt.iterdir()}
    missing = sorted(set(acked) - have)
    assert not missing, f"{len(missing)} of {len(acked)} acknowledged files lost"
    wrong = [name for name, data in acked.items() if (m.mnt / name).read_bytes() != data]
    assert not wrong, f"{len(wrong)} of {len(acked)} acknowledged files changed"
    r = m.umount()
    assert r.returncode == 0, r.stderr + m.log()
    assert fh.upper_problems(m.state, m.store) == []


def test_small_files_acknowledged_until_the_state_disk_fills_are_all_kept(
        tiny_disk: Path, fuse_store: Path, lower_ref: str, tmp_path: Path) -> None:
    """Small files live in the write-behind batch, not in data files: the mount commits
    before more of them wait than its spill could take, so the disk filling up refuses
    the next file (ENOSPC) and never drops files it acknowledged."""
    m = Mount(fuse_store, lower_ref, tmp_path / "mnt", tiny_disk / "state")
    try:
        m.mount()
        acked = small_files_until_full(m.mnt, "s")
        assert len(acked) * SMALL_FILE > TINY_MIB * MIB // 4, len(acked)  # the disk filled
        assert_kept_after_growing(m, tiny_disk, acked)
    finally:
        m.teardown()


def test_small_files_in_space_a_truncate_freed_on_a_full_disk_are_all_kept(
        tiny_disk: Path, fuse_store: Path, lower_ref: str, tmp_path: Path) -> None:
    """A file fills the disk, a truncate frees part of it; the small files made in that
    space are refused once it is used up, and every one acknowledged is kept."""
    m = Mount(fuse_store, lower_ref, tmp_path / "mnt", tiny_disk / "state")
    try:
        m.mount()
        total, err = fill(m.mnt / "big")
        assert err == errno.ENOSPC and total > TINY_MIB * MIB // 2, (total, err)
        os.truncate(m.mnt / "big", total - 2 * MIB - MIB // 4)
        acked = small_files_until_full(m.mnt, "t")
        assert acked
        assert_kept_after_growing(m, tiny_disk, acked)
        m.mount(with_ref=False)
        assert os.stat(m.mnt / "big").st_size == total - 2 * MIB - MIB // 4
        r = m.umount()
        assert r.returncode == 0, r.stderr + m.log()
    finally:
        m.teardown()
