"""The background mount daemon must not import the product from the caller's working directory.

A user who keeps the store at ``./store`` (or whose project has ``fusefs/`` or ``store/``
folders) runs ``rewindfs mount`` from that directory; the daemon it starts must still load the
installed packages, not the directories of the same name in the working directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fusehelpers as fh

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="starts the real background daemon")


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # ``-P``: the CLI itself as the installed entry point would run, whatever the cwd holds.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-P", "-m", "rewindfs", *args], cwd=cwd, text=True,
                          capture_output=True, timeout=120, env=env)


@pytest.mark.parametrize("shadow", ["store/backend", "fusefs/session"])
def test_background_mount_ignores_same_named_dirs_in_cwd(tmp_path: Path, shadow: str,
                                                          lower_ref: str, fuse_store: Path
                                                          ) -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    work = tmp_path / "project"
    (work / shadow).mkdir(parents=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    pid = None
    try:
        r = _cli(work, "--store", str(fuse_store), "mount", lower_ref, str(mnt),
                 "--state", str(tmp_path / "state"), "--json")
        assert r.returncode == 0, r.stderr + (tmp_path / "state" / "daemon.log").read_text()
        pid = json.loads(r.stdout)["pid"]
        (mnt / "new.txt").write_text("x")
        assert (mnt / "new.txt").read_text() == "x"
        u = _cli(work, "--store", str(fuse_store), "umount", str(mnt))
        assert u.returncode == 0, u.stderr
        pid = None
    finally:
        if fh.is_fuse_mounted(mnt):
            fh.fusermount(mnt, lazy=True)
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_kill9_mid_appends_keeps_fsynced_and_dead_mount_is_named(
        mounter: fh.Mounter, lower_ref: str, fuse_store: Path) -> None:
    """A writer appends and fsyncs every 20 records while the daemon is killed with -9: the
    next ``rewindfs mount`` names the dead mount (not "not a directory"), ``rewindfs umount``
    clears it, and the remount holds every fsynced record, uncorrupted."""
    d = mounter.rw(lower_ref)
    assert d.proc is not None and d.state is not None
    log = d.mnt / "appends.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    synced = 0
    try:
        for n in range(1, 2001):
            os.write(fd, f"{n - 1:08d}\n".encode())
            if n % 20 == 0:
                os.fsync(fd)
                synced = n
            if n == 1234:
                os.killpg(d.proc.pid, signal.SIGKILL)
                d.proc.wait()
                break
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    assert fh.is_fuse_mounted(d.mnt)  # the kernel keeps the dead mount
    r = _cli(d.mnt.parent, "--store", str(fuse_store), "mount", str(d.mnt), "--state",
             str(d.state))
    assert r.returncode == 9
    assert "dead mount" in r.stderr and "not a directory" not in r.stderr, r.stderr
    u = _cli(d.mnt.parent, "--store", str(fuse_store), "umount", str(d.mnt))
    assert u.returncode == 0, u.stderr
    assert not fh.is_fuse_mounted(d.mnt)
    mounter.kill9(d)  # reaps and forgets the killed daemon
    mounter.restart(d)
    lines = log.read_text().splitlines()
    assert len(lines) >= synced == 1220
    assert lines == [f"{i:08d}" for i in range(len(lines))]


def test_a_dead_mount_whose_root_the_kernel_still_stats_is_named(
        mounter: fh.Mounter, lower_ref: str, fuse_store: Path) -> None:
    """After kill -9 of a daemon, the kernel may still answer a stat of the mount's root
    from the attributes it cached, so the mount point looks like a directory: ``rewindfs
    mount`` there used to say "something is already mounted there" (as for a live mount),
    not that a dead mount is left and what to run."""
    d = mounter.rw(lower_ref)
    assert d.proc is not None and d.state is not None
    with open(d.mnt / "touched", "wb") as f:  # fsynced: kept across the kill
        f.write(b"x")
        f.flush()
        os.fsync(f.fileno())
    os.stat(d.mnt)
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    assert fh.is_fuse_mounted(d.mnt) and os.path.isdir(d.mnt)  # the case: a cached root
    r = _cli(d.mnt.parent, "--store", str(fuse_store), "mount", str(d.mnt), "--state",
             str(d.state))
    assert r.returncode == 9
    assert "dead mount" in r.stderr and "rewindfs umount" in r.stderr, r.stderr
    u = _cli(d.mnt.parent, "--store", str(fuse_store), "umount", str(d.mnt))
    assert u.returncode == 0, u.stderr
    mounter.kill9(d)  # reaps and forgets the killed daemon
    mounter.restart(d)
    assert (d.mnt / "touched").read_bytes() == b"x"
