"""The FUSE test harness's own failure paths (PYFUSE3.md trap 13), on a FUSE filesystem that
is not ours (fuse-overlayfs), so that they are proven independently of rewindfs: a daemon
that dies before mounting, one that never mounts, a mount kept busy at teardown, a killed
daemon, and the session safety net.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fusehelpers as fh
import pytest

pytestmark = pytest.mark.skipif(
    fh.SELFTEST or shutil.which("fuse-overlayfs") is None or not os.path.exists("/dev/fuse"),
    reason="needs /dev/fuse and fuse-overlayfs")


def overlay_daemon(tmp: Path) -> fh.Daemon:
    for sub in ("lower", "upper", "work", "mnt"):
        (tmp / sub).mkdir()
    (tmp / "lower" / "f").write_bytes(b"lower file\n")
    cmd = ["fuse-overlayfs", "-f", "-o",
           f"lowerdir={tmp / 'lower'},upperdir={tmp / 'upper'},workdir={tmp / 'work'}",
           str(tmp / "mnt")]
    return fh.Daemon(store=tmp, mnt=tmp / "mnt", log=tmp / "daemon.log", command=cmd)


def test_start_and_clean_stop(tmp_path: Path) -> None:
    d = fh.start(overlay_daemon(tmp_path))
    assert fh.is_fuse_mounted(d.mnt)
    assert str(d.mnt) in fh.LIVE
    assert (d.mnt / "f").read_bytes() == b"lower file\n"
    assert fh.stop(d) == 0
    assert not fh.is_fuse_mounted(d.mnt) and d.proc is None and str(d.mnt) not in fh.LIVE


def test_daemon_that_exits_before_mounting_reports_its_log(tmp_path: Path) -> None:
    d = overlay_daemon(tmp_path)
    d.command = ["sh", "-c", "echo 'cannot mount: reason XYZ' >&2; exit 7"]
    with pytest.raises(fh.MountError, match="(?s)exited with 7.*reason XYZ"):
        fh.start(d)
    assert d.proc is None and str(d.mnt) not in fh.LIVE


def test_daemon_that_never_mounts_is_killed(tmp_path: Path) -> None:
    d = overlay_daemon(tmp_path)
    d.command = ["sh", "-c", "sleep 600 & sleep 600"]
    with pytest.raises(fh.MountError, match="not mounted after"):
        fh.start(d, timeout=1)
    assert d.proc is None and str(d.mnt) not in fh.LIVE
    assert d.returncodes == [-9]


def test_busy_mount_is_detached_lazily_and_daemon_reaped(tmp_path: Path) -> None:
    d = fh.start(overlay_daemon(tmp_path))
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; f = open(sys.argv[1]); print('open', "
                               "flush=True); time.sleep(600)", str(d.mnt / "f")],
                              stdout=subprocess.PIPE, text=True, cwd=d.mnt)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        proc = d.proc
        assert proc is not None
        t0 = time.monotonic()
        with pytest.raises(fh.MountError, match="busy"):
            fh.stop(d, busy_grace=0.5)
        assert time.monotonic() - t0 < 30
        assert not fh.is_fuse_mounted(d.mnt)
        assert proc.poll() is not None  # reaped
        assert d.proc is None and str(d.mnt) not in fh.LIVE
    finally:
        holder.kill()
        holder.wait()


def test_kill_leaves_no_mount(tmp_path: Path) -> None:
    d = fh.start(overlay_daemon(tmp_path))
    proc = d.proc
    assert proc is not None
    fh.kill(d)
    assert proc.returncode == -9
    assert not fh.is_fuse_mounted(d.mnt)
    assert d.proc is None and str(d.mnt) not in fh.LIVE


def test_mounter_teardown_reports_a_daemon_that_fails(tmp_path: Path) -> None:
    m = fh.Mounter(tmp_path / "base", tmp_path)
    m.base.mkdir()
    d = overlay_daemon(tmp_path)
    m.daemons.append(d)
    fh.start(d)
    (d.log).write_text("Traceback (most recent call last):\n  boom\n")
    with pytest.raises(fh.MountError, match="logged a traceback"):
        m.teardown(failed=False)
    assert not fh.is_fuse_mounted(d.mnt) and d.proc is None


def test_safety_net_unmounts_and_kills_leftovers(tmp_path: Path) -> None:
    d = fh.start(overlay_daemon(tmp_path))
    proc = d.proc
    assert proc is not None
    assert fh.kill_all_live() == [str(d.mnt)]
    assert proc.poll() is not None
    assert not fh.is_fuse_mounted(d.mnt)
    # a mount nobody tracks (as a crashed test run leaves) under a test directory
    (tmp_path / "untracked").mkdir()
    d2 = fh.start(overlay_daemon(tmp_path / "untracked"))
    proc2 = d2.proc
    fh.LIVE.pop(str(d2.mnt))
    assert fh.unmount_leftovers([str(tmp_path)]) == [str(d2.mnt)]
    assert not fh.is_fuse_mounted(d2.mnt)
    assert proc2 is not None and proc2.wait(timeout=30) == 0
