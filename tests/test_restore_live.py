"""Restore of a live session mount (CONTRACT 3.2), through real mounts: right after the call
returns the mount is exactly the target (no polling); unchanged paths keep their inode
numbers and changed content gets new ones; a read-only handle opened earlier keeps reading
the old content; a process whose cwd exists in the target keeps a valid cwd; a writer holding
a file open makes the restore fail with kind permit_failed after the timeout, changing
nothing; every checkpoint is restorable in any order; git sees a consistent work tree.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli, client, recorded_base
from test_checkpoint_live import git

from fusefs.session.errors import RestoreError
from store.errors import RefNotFoundError
from store.snapshot import compute_ref

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


def change_everything(m: Path) -> None:
    """Changes of every kind, by shell and Python."""
    subprocess.run(["sh", "-c", "rm dir/a.txt && mv dir/sub moved && echo v2 > plain.txt && "
                    "mkdir -p new/deep && echo n > new/deep/f && ln -sf big.bin sym && "
                    "chmod 600 exec.sh && rm link2"], cwd=m, check=True)
    (m / "ro.txt").chmod(0o644)
    (m / "ro.txt").write_bytes(b"writable now\n")
    os.setxattr(m / "exec.sh", "user.note", b"changed")


def test_restore_shows_the_target_at_once(mounter: fh.Mounter, fuse_store: Path,
                                          lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    os.listdir(m / "dir" / "sub")  # the kernel caches names, attributes and pages
    (m / "plain.txt").read_bytes()
    before = {p: os.lstat(m / p).st_ino for p in ("dir", "empty", "big.bin", "link1")}
    plain_ino = os.lstat(m / "plain.txt").st_ino
    change_everything(m)
    changed = str(compute_ref(m))
    assert not (m / "dir" / "a.txt").exists()  # negative entry cached now

    r = client(m).restore(lower_ref)
    # immediately, no polling: deleted files back, new files gone, moves undone
    assert str(compute_ref(m)) == lower_ref
    assert (m / "dir" / "a.txt").read_bytes() == b"a\n"
    assert (m / "dir" / "sub" / "b.txt").read_bytes() == b"b\n"
    assert not (m / "moved").exists() and not (m / "new").exists()
    assert (m / "plain.txt").read_bytes() == b"hello world\n"
    assert os.readlink(m / "sym") == "plain.txt"
    assert os.lstat(m / "link1").st_nlink == 2 and (m / "link2").exists()
    assert os.getxattr(m / "exec.sh", "user.note") == b"exec"
    assert {p: os.lstat(m / p).st_ino for p in before} == before
    assert os.lstat(m / "plain.txt").st_ino != plain_ino  # its content changed back
    assert r["pre_restore"] == changed and recorded_base(d.state) == lower_ref  # type: ignore[arg-type]

    # the restore can be undone: the pre-restore checkpoint is listed
    client(m).restore(r["pre_restore"])
    assert str(compute_ref(m)) == changed
    mounter.remount(d)
    assert str(compute_ref(m)) == changed


def test_readers_and_cwd_keep_working(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "plain.txt").write_bytes(b"version two\n")
    fd = os.open(m / "plain.txt", os.O_RDONLY)
    gone = os.open(m / "dir" / "a.txt", os.O_RDONLY)
    os.unlink(m / "dir" / "a.txt")
    shell = subprocess.Popen(["sh", "-c", "while read x; do ls; pwd; echo end; done"],
                             cwd=m / "dir" / "sub", stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert shell.stdin is not None and shell.stdout is not None
        client(m).restore(lower_ref, discard=True)
        assert os.pread(fd, 100, 0) == b"version two\n"  # the old content
        assert os.pread(gone, 100, 0) == b"a\n"
        assert (m / "plain.txt").read_bytes() == b"hello world\n"  # the new content
        shell.stdin.write("go\n")
        shell.stdin.flush()
        lines = []
        while (line := shell.stdout.readline()) != "end\n":
            lines.append(line.strip())
        assert lines[:2] == ["b.txt", "deeper"] and lines[-1].endswith("/dir/sub")
    finally:
        os.close(fd)
        os.close(gone)
        if shell.stdin is not None:
            shell.stdin.close()
        shell.wait(30)


def test_writer_open_fails_with_permit_failed_and_changes_nothing(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "new.txt").write_bytes(b"pending\n")
    before = str(compute_ref(m))
    mtime = os.lstat(m / "new.txt").st_mtime_ns
    f = open(m / "new.txt", "ab")
    try:
        t0 = time.monotonic()
        with pytest.raises(RestoreError) as ei:
            client(m).restore(lower_ref, timeout=0.3)
        assert ei.value.kind == "permit_failed" and time.monotonic() - t0 >= 0.3
        r = cli(fuse_store, "restore", str(m), lower_ref, "--timeout", "0.2", check=False)
        assert r.returncode == 10 and "permit_failed" in r.stderr
        f.write(b"still works\n")  # writes go on once the restore gave up
        f.flush()
    finally:
        f.close()
    assert (m / "new.txt").read_bytes() == b"pending\nstill works\n"
    assert recorded_base(d.state) == lower_ref  # type: ignore[arg-type]
    assert str(compute_ref(m)) != before  # only the writer's own change
    (m / "new.txt").write_bytes(b"pending\n")
    os.utime(m / "new.txt", ns=(mtime, mtime))
    assert str(compute_ref(m)) == before


def test_every_checkpoint_restorable_in_any_order(mounter: fh.Mounter, fuse_store: Path,
                                                 lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    refs = [lower_ref]
    for i in range(3):
        (m / f"f{i}").write_bytes(b"x" * i)
        (m / "plain.txt").write_bytes(b"v%d\n" % i)
        if i == 1:
            shutil.rmtree(m / "dir")
        if i == 2:
            (m / "empty" / "now").mkdir()
        refs.append(client(m).checkpoint()["ref"])
    for target in [refs[1], refs[3], refs[0], refs[2], refs[1], refs[3]]:
        r = json.loads(cli(fuse_store, "restore", str(m), target, "--json").stdout)
        assert r["ref"] == target and r["elapsed_ms"] > 0
        assert str(compute_ref(m)) == target
    missing = "v1:blake3:" + "0" * 64
    with pytest.raises(RefNotFoundError):
        client(m).restore(missing)
    assert str(compute_ref(m)) == refs[3]


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_work_tree_across_restores(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    repo = m / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    for i in range(20):
        (repo / f"m{i}.py").write_text(f"print({i})\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    assert git(repo, "status", "--porcelain") == ""
    clean = client(m).checkpoint()["ref"]
    (repo / "m3.py").write_text("print('changed')\n")
    (repo / "extra.py").write_text("x = 1\n")
    os.unlink(repo / "m7.py")
    dirty = client(m).checkpoint()["ref"]
    client(m).restore(clean)
    assert git(repo, "status", "--porcelain") == ""
    client(m).restore(dirty)
    assert sorted(git(repo, "status", "--porcelain").splitlines()) == [
        " D m7.py", " M m3.py", "?? extra.py"]
    client(m).restore(clean)
    assert git(repo, "status", "--porcelain") == "" and git(repo, "diff") == ""
    out = subprocess.run([sys.executable, "-c", "import m3"], cwd=repo, capture_output=True,
                         text=True)
    assert out.stdout == "3\n"
