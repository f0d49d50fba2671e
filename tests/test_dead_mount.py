"""A mount whose daemon was killed (kill -9) stays in the kernel's mount table, dead: every
access fails with ENOTCONN. ``rewindfs status`` (and checkpoint, restore, diff) on it, or on
a path inside it, exits 9 saying that the daemon is gone and how to recover, and the
commands it names do recover it: for a plain mount ``rewindfs umount`` then ``rewindfs
mount MNT --state DIR``, for a session ``rewindfs session resume ID``. Each case runs those
commands as printed and checks the mount serves again with what was fsynced."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusefs.mounts import alive, read_record
from tests import fusehelpers as fh

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="kills real daemons")

REPO = Path(__file__).resolve().parents[1]


def rewindfs(store: Path, *args: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(store), *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, **(env or {})})


def commands(fix: str) -> list[list[str]]:
    """The ``rewindfs`` commands a fix text names (in backquotes), as argument lists
    without the program name."""
    return [shlex.split(c)[1:] for c in re.findall(r"`([^`]+)`", fix)
            if c.startswith("rewindfs ")]


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def wait_gone(pid: int, started: int | None) -> None:
    """Until ``pid`` (not our child) has exited; bounded, so a hang fails the test."""
    deadline = time.monotonic() + 60
    while alive(pid, started):
        assert time.monotonic() < deadline, f"pid {pid} outlived SIGKILL"
        time.sleep(0.01)


def test_status_of_a_killed_plain_mount_says_how_to_recover(
        mounter: fh.Mounter, lower_ref: str, fuse_store: Path) -> None:
    d = mounter.rw(lower_ref)
    assert d.proc is not None and d.state is not None
    (d.mnt / "sub").mkdir()
    write_synced(d.mnt / "sub" / "kept", b"fsynced\n")
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    assert fh.is_fuse_mounted(d.mnt)
    assert fh.errno_of(os.listdir, d.mnt) == 107  # ENOTCONN: the dead mount of the case
    again = None
    try:
        for where in (d.mnt, d.mnt / "sub"):
            r = rewindfs(fuse_store, "status", str(where))
            assert r.returncode == 9, r.stderr
            assert "daemon" in r.stderr and "is gone and the mount is dead" in r.stderr
            assert "ENOTCONN" in r.stderr
            assert f"rewindfs umount {d.mnt}" in r.stderr, r.stderr
            assert f"fusermount3 -u {d.mnt}" in r.stderr, r.stderr
            assert f"rewindfs mount {d.mnt} --state {d.state}" in r.stderr, r.stderr
        j = rewindfs(fuse_store, "checkpoint", str(d.mnt), "--json")
        assert j.returncode == 9
        doc = json.loads(j.stdout)
        assert doc["kind"] == "NotLiveError" and doc["where"] == str(d.mnt)
        steps = commands(doc["fix"])
        assert [s[0] for s in steps] == ["umount", "mount"], doc["fix"]
        # Without the daemon's record (another runtime directory): still named dead, with
        # the unmount, which needs no record.
        other = d.mnt.parent / "other-runtime"
        other.mkdir(mode=0o700)
        o = rewindfs(fuse_store, "diff", str(d.mnt), env={"XDG_RUNTIME_DIR": str(other)})
        assert o.returncode == 9 and "the mount is dead" in o.stderr, o.stderr
        assert f"fusermount3 -u {d.mnt}" in o.stderr, o.stderr
        # The commands as printed recover the mount, with what was fsynced.
        for step in steps:
            p = rewindfs(fuse_store, *step)
            assert p.returncode == 0, (step, p.stderr)
        again = read_record(str(d.mnt))
        assert again is not None and (d.mnt / "sub" / "kept").read_bytes() == b"fsynced\n"
        s = rewindfs(fuse_store, "status", str(d.mnt), "--json")
        assert s.returncode == 0 and json.loads(s.stdout)["pid"] == again["pid"], s.stderr
        u = rewindfs(fuse_store, "umount", str(d.mnt))
        assert u.returncode == 0, u.stderr
        again = None
    finally:
        if again is not None:
            os.kill(again["pid"], signal.SIGKILL)
        fh.unmount_leftovers([str(d.mnt)])
        mounter.kill9(d)  # reaps and forgets the killed daemon


@pytest.fixture
def session_store(tmp_path: Path) -> Iterator[Path]:
    """A store whose FUSE sessions are ended at teardown (shut down, else killed)."""
    store = tmp_path / "store"
    yield store
    for rec in (store / "sessions").glob("*/session.json"):
        sid = rec.parent.name
        st = rewindfs(store, "status", str(tmp_path / "ws" / sid), "--json")
        if st.returncode == 0:
            pid = json.loads(st.stdout)["pid"]
            if rewindfs(store, "session", "shutdown", sid, "--force").returncode != 0:
                os.kill(pid, signal.SIGKILL)
    fh.unmount_leftovers([str(tmp_path)])


def test_status_of_a_killed_session_says_resume(tmp_path: Path, session_store: Path) -> None:
    if not os.path.exists("/dev/fuse"):
        pytest.skip("needs /dev/fuse")
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "a").write_text("seeded\n")
    n = rewindfs(session_store, "session", "new", "--seed", str(seed), "--base",
                 str(tmp_path / "ws"), "--json")
    assert n.returncode == 0, n.stderr
    sid, root = json.loads(n.stdout)["id"], Path(json.loads(n.stdout)["root"])
    write_synced(root / "b", b"fsynced\n")
    rec = read_record(str(root))
    assert rec is not None and fh.fstype(root) == "fuse.rewindfs"
    os.kill(rec["pid"], signal.SIGKILL)
    wait_gone(rec["pid"], rec.get("started"))
    r = rewindfs(session_store, "status", str(root), "--json")
    assert r.returncode == 9, r.stderr
    doc = json.loads(r.stdout)
    assert "is gone and the mount is dead" in doc["error"], doc
    assert commands(doc["fix"]) == [["session", "resume", sid]], doc["fix"]
    p = rewindfs(session_store, "session", "resume", sid)
    assert p.returncode == 0, p.stderr
    s = rewindfs(session_store, "status", str(root), "--json")
    assert s.returncode == 0, s.stderr
    assert (root / "a").read_text() == "seeded\n" and (root / "b").read_bytes() == b"fsynced\n"
    assert rewindfs(session_store, "session", "shutdown", sid).returncode == 0
