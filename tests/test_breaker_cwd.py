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
