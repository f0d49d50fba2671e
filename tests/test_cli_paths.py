"""A path the user gives that cannot serve (a store or state directory that is a file or
cannot be made, a mount point that is missing or has a name too long, a mount still in use
at ``umount``, a session base where no root can be made) is one line naming the cause and
a fix, with the README's exit code (1 for the store, 9 for a mount, 10 for a session), through the console script in subprocesses; nothing is mounted
and nothing is left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fusehelpers as fh
import pytest
from fusehelpers import run_cli as run

from fusefs.session.fallback import fuse_available


def one_line(p: subprocess.CompletedProcess[str], code: int) -> str:
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("rewindfs: "), p.stderr
    assert "Errno" not in p.stderr, p.stderr
    return p.stderr


def test_store_path_that_is_a_file_or_cannot_be_made(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x\n")
    err = one_line(run(f, "list"), 1)
    assert f"store {f}: it is a file, not a directory" in err
    err = one_line(run(f / "sub", "list"), 1)
    assert f"its parent {f} is a file" in err
    err = one_line(run("/proc/nope/x", "list"), 1)
    assert "/proc/nope cannot be created in /proc" in err and "you can write" in err
    assert f.read_text() == "x\n"


@pytest.mark.parametrize("backend", ["--no-fuse"] + (["fuse"] if fuse_available() else []))
def test_a_session_root_that_cannot_be_made(tmp_path: Path, backend: str) -> None:
    """``session new`` with a base where no root can be made (below /proc, below a file)
    is one line naming the root, the path in the way and a fix, exit 10 (it was the raw
    ``[Errno 2] No such file or directory: '/proc/nope'``, exit 1); no session is left."""
    store = tmp_path / "store"
    new = ["session", "new", "--json", *([backend] if backend == "--no-fuse" else [])]
    err = one_line(run(store, *new, "--base", "/proc/nope"), 10)
    assert "rewindfs: workspace root /proc/nope/" in err, err
    assert "/proc/nope cannot be created in /proc (No such file or directory); choose a " \
           "path under a directory you can write" in err, err
    f = tmp_path / "file"
    f.write_text("x\n")
    err = one_line(run(store, *new, "--base", str(f / "sub" / "deeper")), 10)
    assert f"{f} is not a directory" in err, err
    assert json.loads(run(store, "session", "list", "--json").stdout) == []
    assert f.read_text() == "x\n"


def test_state_and_mount_point_paths(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("a\n")
    store = tmp_path / "store"
    ref = json.loads(run(store, "snapshot", str(src), "--json").stdout)["ref"]
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    f = tmp_path / "file"
    f.write_text("x\n")
    # The CLI makes the state directory (for its daemon.log); with --log the daemon does.
    for extra in ([], ["--log", str(tmp_path / "d.log")]):
        err = one_line(run(store, "mount", ref, str(mnt), "--state", str(f), *extra), 9)
        assert f"state directory {f}: it is a file, not a directory" in err
        err = one_line(run(store, "mount", ref, str(mnt), "--state", "/proc/nope/x", *extra), 9)
        assert "state directory /proc/nope/x: /proc/nope cannot be created" in err
    assert not os.path.ismount(mnt)

    state = tmp_path / "state"
    err = one_line(run(store, "mount", ref, str(tmp_path / "nomnt"), "--state", str(state)), 9)
    assert "mount point does not exist (mkdir it)" in err
    long = tmp_path / ("n" * 300)
    err = one_line(run(store, "mount", ref, str(long), "--state", str(state)), 9)
    assert "mount point name too long" in err
    err = one_line(run(store, "mount", ref, str(f), "--state", str(state)), 9)
    assert "mount point is not a directory" in err
    assert not state.exists()


@pytest.mark.skipif(fh.SELFTEST, reason="needs a real mount")
def test_busy_umount_names_the_processes_and_the_lazy_form(mounter: fh.Mounter,
                                                           lower_ref: str,
                                                           fuse_store: Path) -> None:
    d = mounter.rw(lower_ref)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                              cwd=d.mnt, stdin=subprocess.PIPE)
    try:
        err = one_line(run(fuse_store, "umount", str(d.mnt)), 9)
        assert "busy" in err and f"in use by 1 process(es): {holder.pid} " in err, err
        assert f"`rewindfs umount --lazy {d.mnt}`" in err
        assert fh.is_fuse_mounted(d.mnt)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=60)
    p = run(fuse_store, "umount", str(d.mnt))
    assert p.returncode == 0, p.stderr
    assert not fh.is_fuse_mounted(d.mnt)
