"""Durability and identity of a session mount (CONTRACT 2.3, 2.5, 2.6) and the mount
commands' life cycle: ``kill -9`` after fsync, clean unmount, signals, remount rules.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import fusehelpers as fh
import pytest
from fusehelpers import BIG_SIZE, MTIME_NS, pattern

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


def do_changes(m: Path) -> None:
    """One of every kind of change, on lower and upper inodes."""
    os.mkdir(m / "newdir")
    (m / "newdir" / "f").write_bytes(b"new file\n")
    os.chmod(m / "plain.txt", 0o600)
    os.chown(m / "ro.txt", *fh.OTHER_OWNER)
    os.utime(m / "exec.sh", ns=(5, 1_700_000_000_000_000_123))
    os.rename(m / "dir", m / "moved")
    os.unlink(m / "link1")
    os.setxattr(m / "moved" / "a.txt", "user.k", b"v")
    os.symlink("moved/a.txt", m / "newlink")
    os.link(m / "plain.txt", m / "newdir" / "hard")
    os.rmdir(m / "empty")
    with open(m / "big.bin", "r+b") as f:
        f.seek(2_000_000)
        f.write(b"XYZ")
    os.truncate(m / "moved" / "sub" / "b.txt", 1)
    os.mkfifo(m / "newfifo")


def assert_changes(m: Path) -> None:
    assert (m / "newdir" / "f").read_bytes() == b"new file\n"
    assert stat.S_IMODE(os.stat(m / "plain.txt").st_mode) == 0o600
    st = os.stat(m / "ro.txt")
    assert (st.st_uid, st.st_gid) == fh.OTHER_OWNER
    assert os.stat(m / "exec.sh").st_mtime_ns == 1_700_000_000_000_000_123
    assert not os.path.lexists(m / "dir")
    assert (m / "moved" / "sub" / "deeper" / "c.txt").read_bytes() == b"c\n"
    assert not os.path.lexists(m / "link1")
    assert os.stat(m / "link2").st_nlink == 1
    assert os.getxattr(m / "moved" / "a.txt", "user.k") == b"v"
    assert os.readlink(m / "newlink") == "moved/a.txt"
    assert os.stat(m / "newdir" / "hard").st_ino == os.stat(m / "plain.txt").st_ino
    assert os.stat(m / "plain.txt").st_nlink == 2
    assert not os.path.lexists(m / "empty")
    want = bytearray(pattern(BIG_SIZE))
    want[2_000_000:2_000_003] = b"XYZ"
    assert (m / "big.bin").read_bytes() == bytes(want)
    assert (m / "moved" / "sub" / "b.txt").read_bytes() == b"b"
    assert stat.S_ISFIFO(os.lstat(m / "newfifo").st_mode)


def identity(m: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, ctime, mtime) of every path: what must not change across a remount."""
    out = {}
    for rel in fh.walk_tree(m):
        s = os.lstat(m / rel)
        out[rel] = (s.st_ino, s.st_ctime_ns, s.st_mtime_ns)
    return out


def test_clean_unmount_keeps_everything(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    do_changes(d.mnt)
    before = identity(d.mnt)
    mounter.remount(d)
    assert_changes(d.mnt)
    assert identity(d.mnt) == before
    assert fh.upper_problems(d.state, d.store) == []  # type: ignore[arg-type]


def test_kill9_after_fsync_keeps_everything_fsynced(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    do_changes(d.mnt)
    fd = os.open(d.mnt / "newdir" / "synced", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"fsynced data\n")
    os.fsync(fd)
    os.close(fd)
    before = identity(d.mnt)
    mounter.kill9(d)
    assert not fh.is_fuse_mounted(d.mnt)
    assert d.state is not None
    assert fh.upper_problems(d.state, d.store) == []
    mounter.restart(d)
    assert (d.mnt / "newdir" / "synced").read_bytes() == b"fsynced data\n"
    assert_changes(d.mnt)
    assert identity(d.mnt) == before


def test_kill9_after_fsyncdir_keeps_names(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "dir" / "n1").write_bytes(b"one")
    os.rename(d.mnt / "plain.txt", d.mnt / "dir" / "renamed.txt")
    os.unlink(d.mnt / "dir" / "a.txt")
    dfd = os.open(d.mnt / "dir", os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)
    mounter.kill9(d)
    mounter.restart(d)
    assert sorted(os.listdir(d.mnt / "dir")) == ["n1", "renamed.txt", "sub"]
    assert (d.mnt / "dir" / "n1").read_bytes() == b"one"
    assert (d.mnt / "dir" / "renamed.txt").read_bytes() == b"hello world\n"
    assert not os.path.lexists(d.mnt / "plain.txt")


def test_kill9_with_unlinked_open_file_then_remount(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    code = (
        "import os, sys, time\n"
        "p = sys.argv[1]\n"
        "fd = os.open(p, os.O_RDWR)\n"
        "os.unlink(p)\n"
        "os.pwrite(fd, b'written after unlink' * 1000, 0)\n"
        "os.fsync(fd)\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(d.mnt / "big.bin")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        mounter.kill9(d)
    finally:
        holder.kill()
        holder.wait()
    assert d.state is not None
    assert fh.upper_problems(d.state, d.store) == []
    mounter.restart(d)
    assert not os.path.lexists(d.mnt / "big.bin")
    assert "big.bin" not in os.listdir(d.mnt)


def test_kill9_during_writes_leaves_a_sound_upper(mounter: fh.Mounter, lower_ref: str) -> None:
    """Whenever the daemon dies, the upper it leaves passes its check and mounts again."""
    d = mounter.rw(lower_ref)
    code = (
        "import os, sys\n"
        "m = sys.argv[1]\n"
        "i = 0\n"
        "while True:\n"
        "    d = os.path.join(m, 'w', str(i % 7))\n"
        "    os.makedirs(d, exist_ok=True)\n"
        "    p = os.path.join(d, f'f{i}')\n"
        "    with open(p, 'wb') as f:\n"
        "        f.write(os.urandom(i % 5000))\n"
        "    if i % 3 == 0:\n"
        "        os.rename(p, p + '.r')\n"
        "    if i % 5 == 0 and i:\n"
        "        q = os.path.join(m, 'w', str((i - 1) % 7), f'f{i - 1}')\n"
        "        os.unlink(q + '.r' if (i - 1) % 3 == 0 else q)\n"
        "    if i % 11 == 0:\n"
        "        with open(os.path.join(m, 'big.bin'), 'r+b') as f:\n"
        "            f.seek(i * 4099 % 3000000)\n"
        "            f.write(b'x' * 100)\n"
        "    if i == 200:\n"
        "        print('busy', flush=True)\n"
        "    i += 1\n"
    )
    for round_ in range(3):
        writer = subprocess.Popen([sys.executable, "-c", code, str(d.mnt)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert writer.stdout is not None and writer.stdout.readline() == "busy\n"
            time.sleep(0.05 * round_)
            mounter.kill9(d)
        finally:
            writer.kill()
            writer.wait()
        # What a crash leaves (data files of uncommitted inodes, ...) is repaired when the
        # upper is opened again; from then on it must be sound.
        mounter.restart(d)
        for rel in fh.walk_tree(d.mnt):  # everything it shows can be read
            p = d.mnt / rel
            if p.is_file() and not p.is_symlink():
                p.read_bytes()
        mounter.unmount(d)
        assert d.state is not None
        assert fh.upper_problems(d.state, d.store) == [], f"round {round_}"
        mounter.restart(d)


def test_inode_numbers_and_ctimes_stable_across_remounts(mounter: fh.Mounter,
                                                         lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    first = identity(d.mnt)  # lower inodes never looked up before
    (d.mnt / "new").write_bytes(b"n")
    os.chmod(d.mnt / "plain.txt", 0o640)
    before = identity(d.mnt)
    for k in first:
        if k not in ("plain.txt",):
            assert before[k] == first[k], k
    assert before["plain.txt"][0] == first["plain.txt"][0]
    mounter.remount(d)
    assert identity(d.mnt) == before
    mounter.kill9(d)
    mounter.restart(d)
    assert identity(d.mnt) == before


def test_state_dir_records_its_base(mounter: fh.Mounter, lower_ref: str, fuse_store: Path,
                                    tmp_path: Path) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "kept").write_bytes(b"kept")
    mounter.unmount(d)
    assert d.state is not None
    assert stat.S_IMODE(os.stat(d.state).st_mode) == 0o700
    other_src = tmp_path / "other"
    other_src.mkdir()
    (other_src / "x").write_bytes(b"other tree")
    other = fh.snapshot(fuse_store, other_src)
    r = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(fuse_store), "mount",
                        other, str(d.mnt), "--state", str(d.state), "--foreground"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert "Traceback" not in r.stderr and lower_ref in r.stderr
    assert not fh.is_fuse_mounted(d.mnt)
    fh.start(d, with_ref=False)  # no Ref: the recorded base
    assert (d.mnt / "kept").read_bytes() == b"kept"
    fh.stop(d)
    fh.start(d, with_ref=True)  # the same Ref as recorded is fine
    assert (d.mnt / "kept").read_bytes() == b"kept"
    assert (d.state / "daemon.log").is_file()


def test_second_daemon_on_a_state_dir_is_refused(mounter: fh.Mounter, lower_ref: str,
                                                 tmp_path: Path) -> None:
    d = mounter.rw(lower_ref)
    other = tmp_path / "second-mnt"
    other.mkdir()
    r = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(d.store), "mount",
                        str(other), "--state", str(d.state), "--foreground"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert "Traceback" not in r.stderr and "in use" in r.stderr
    assert not fh.is_fuse_mounted(other)
    (d.mnt / "still-works").write_bytes(b"ok")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("busy", [False, True])
def test_signals_unmount_cleanly(mounter: fh.Mounter, lower_ref: str, sig: int,
                                 busy: bool) -> None:
    """Also while a process still has a file open in the mount (it is then detached)."""
    d = mounter.rw(lower_ref)
    (d.mnt / "before-signal").write_bytes(b"x" * 10000)
    holder = None
    if busy:
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); "
                                   "print('open', flush=True); time.sleep(600)",
                                   str(d.mnt / "plain.txt")], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
    try:
        os.kill(d.pid, sig)
        assert fh.wait_exit(d, 60) == 0, d.log_tail()
        assert not fh.is_fuse_mounted(d.mnt)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    fh.start(d, with_ref=False)
    assert (d.mnt / "before-signal").read_bytes() == b"x" * 10000


def test_daemonized_mount_and_rewindfs_umount(fuse_store: Path, lower_ref: str,
                                              tmp_path: Path) -> None:
    mnt, state = tmp_path / "bg-mnt", tmp_path / "bg-state"
    mnt.mkdir()
    cli = [sys.executable, "-m", "rewindfs", "--store", str(fuse_store)]
    try:
        r = subprocess.run([*cli, "mount", lower_ref, str(mnt), "--state", str(state)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert fh.is_fuse_mounted(mnt)  # mounted by the time the command returns
        (mnt / "bg").write_bytes(b"daemonized")
        r = subprocess.run([*cli, "umount", str(mnt)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert not fh.is_fuse_mounted(mnt)
        # the daemon has let go of the state directory: it can be mounted again at once
        d = fh.Daemon(store=fuse_store, mnt=mnt, state=state, log=tmp_path / "again.log")
        fh.start(d)
        try:
            assert (mnt / "bg").read_bytes() == b"daemonized"
        finally:
            assert fh.stop(d) == 0
    finally:
        if fh.is_fuse_mounted(mnt):
            fh.fusermount(mnt, lazy=True)


def test_ro_lower_content_after_remount_is_exact(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    mounter.remount(d)
    assert os.stat(d.mnt / "plain.txt").st_mtime_ns == MTIME_NS
    assert (d.mnt / "big.bin").read_bytes() == pattern(BIG_SIZE)


def test_state_dir_inside_the_mount_point_is_refused(fuse_store: Path, lower_ref: str,
                                                     tmp_path: Path) -> None:
    mnt = tmp_path / "m"
    mnt.mkdir()
    r = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(fuse_store), "mount",
                        lower_ref, str(mnt), "--state", str(mnt / "state"), "--foreground"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and r.stderr.strip()
    assert not fh.is_fuse_mounted(mnt)
    assert not (mnt / "state").exists()
