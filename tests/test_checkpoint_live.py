"""Checkpoint of a live session mount (CONTRACT 3.1, 3.3, 3.4), through real mounts: changes
made by shell commands, Python, git and a long-running process holding a file open are all
captured; the Ref is exactly the Ref of what the mount shows; an unchanged mount gives the
same Ref and writes no pack; inode numbers and ctimes survive; any checkpoint can be mounted
read-only while the session is live; the CLI prints the Ref and ``--json`` with the
daemon's ``elapsed_ms``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli, client, pack_count, read_in, recorded_base

from store.ref import Ref
from store.snapshot import compute_ref

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")

WRITER = r"""
import sys
f = open(sys.argv[1], "ab", buffering=0)
for line in sys.stdin:
    f.write(line.encode())
    print("ok", flush=True)
"""


def git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t", GIT_CONFIG_NOSYSTEM="1", HOME=str(cwd))
    r = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_checkpoint_captures_shell_python_git_and_an_open_writer(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    w = subprocess.Popen([sys.executable, "-c", WRITER, str(m / "log.txt")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert w.stdin is not None and w.stdout is not None
        w.stdin.write("one\n")
        w.stdin.flush()
        assert w.stdout.readline() == "ok\n"
        subprocess.run(["sh", "-c", "echo shell > shell.txt && mkdir sh && mv dir/a.txt sh/ "
                        "&& rm plain.txt && ln exec.sh hard && ln -s sh/a.txt sl"],
                       cwd=m, check=True)
        (m / "py.bin").write_bytes(fh.pattern(3 * (1 << 20) + 5, seed=3))
        os.chmod(m / "ro.txt", 0o640)
        os.setxattr(m / "dir" / "sub" / "b.txt", "user.k", b"v")
        with open(m / "big.bin", "r+b") as f:  # one chunk of a lower file changes
            f.seek((1 << 20) + 7)
            f.write(b"XYZ")
        (m / "repo").mkdir()
        git(m / "repo", "init", "-q")
        (m / "repo" / "f.txt").write_text("tracked\n")
        git(m / "repo", "add", "f.txt")
        git(m / "repo", "commit", "-qm", "first")

        c = client(m)
        r1 = c.checkpoint()
        assert r1["elapsed_ms"] > 0 and not r1["unchanged"]
        assert r1["ref"] == str(compute_ref(m))  # exactly what the mount shows
        assert recorded_base(d.state) == r1["ref"]  # type: ignore[arg-type]

        # the writer keeps working; its later write is not in the checkpoint
        w.stdin.write("two\n")
        w.stdin.flush()
        assert w.stdout.readline() == "ok\n"
        assert (m / "log.txt").read_bytes() == b"one\ntwo\n"
        assert read_in(fuse_store, r1["ref"], "log.txt") == b"one\n"
        assert read_in(fuse_store, r1["ref"], "big.bin")[(1 << 20) + 7:(1 << 20) + 10] == b"XYZ"
        r2 = c.checkpoint()
        assert read_in(fuse_store, r2["ref"], "log.txt") == b"one\ntwo\n"
        assert git(m / "repo", "status", "--porcelain") == ""
        assert "first" in git(m / "repo", "log", "--oneline")

        # history: the first checkpoint mounted read-only while the session is live
        ro = mounter.ro(r1["ref"])
        assert str(compute_ref(ro.mnt)) == r1["ref"]
        assert (ro.mnt / "log.txt").read_bytes() == b"one\n"
        assert (ro.mnt / "sh" / "a.txt").read_bytes() == b"a\n"
    finally:
        if w.stdin is not None:
            w.stdin.close()
        w.wait(30)
    r3 = c.checkpoint()  # git status may have refreshed its index since r2
    mounter.remount(d)
    assert str(compute_ref(m)) == c.checkpoint()["ref"] == r3["ref"]


def test_unchanged_mount_gives_same_ref_and_writes_no_pack(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    packs = pack_count(fuse_store)
    r = client(d.mnt).checkpoint()
    assert r["ref"] == lower_ref and r["unchanged"] and r["packs"] == 0
    assert (d.mnt / "big.bin").read_bytes() == fh.pattern(fh.BIG_SIZE)  # reads change nothing
    assert client(d.mnt).checkpoint()["ref"] == lower_ref
    (d.mnt / "new").write_bytes(b"n")
    r2 = client(d.mnt).checkpoint()
    assert r2["ref"] != lower_ref
    packs = pack_count(fuse_store)
    r3 = client(d.mnt).checkpoint()
    assert r3["ref"] == r2["ref"] and r3["unchanged"] and pack_count(fuse_store) == packs


def test_inode_numbers_and_ctimes_survive_checkpoint_and_remount(
        mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "dir" / "sub" / "b.txt").write_bytes(b"changed\n")
    (m / "new.txt").write_bytes(b"new\n")
    os.chmod(m / "plain.txt", 0o600)
    paths = ["dir", "dir/sub", "dir/sub/b.txt", "new.txt", "plain.txt", "link1", "link2",
             "exec.sh"]

    def ids() -> dict[str, tuple[int, int, int]]:
        return {p: (s.st_ino, s.st_ctime_ns, s.st_nlink)
                for p in paths for s in [os.lstat(m / p)]}

    before = ids()
    client(m).checkpoint()
    assert ids() == before
    mounter.remount(d)
    assert ids() == before


def test_cli_checkpoint_status_diff_and_json(mounter: fh.Mounter, fuse_store: Path,
                                             lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "plain.txt").write_bytes(b"hello there\n")
    (m / "added.txt").write_bytes(b"added\n")
    st = json.loads(cli(fuse_store, "status", str(m), "--json").stdout)
    assert st["ref"] == lower_ref and st["dirty_inodes"] >= 2 and st["open_handles"] == 0
    out = cli(fuse_store, "diff", str(m)).stdout
    assert "M\tplain.txt" in out and "A\tadded.txt" in out
    text = cli(fuse_store, "diff", str(m), "--unified").stdout
    assert "-hello world\n+hello there\n" in text and "+added\n" in text
    r = json.loads(cli(fuse_store, "checkpoint", str(m), "--label", "first", "--json").stdout)
    assert set(r) >= {"ref", "elapsed_ms"} and r["elapsed_ms"] > 0
    Ref.parse(r["ref"])
    assert cli(fuse_store, "diff", str(m)).stdout.strip() == ""
    listed = json.loads(cli(fuse_store, "list", "--json").stdout)
    assert any(s["ref"] == r["ref"] and s["label"] == "first" for s in
               (listed if isinstance(listed, list) else listed.get("snapshots", [])))
    plain = cli(fuse_store, "checkpoint", str(m)).stdout.strip()
    assert plain == r["ref"]
    text = cli(fuse_store, "diff", "-u", lower_ref, r["ref"]).stdout
    assert "+hello there\n" in text
    bad = cli(fuse_store, "checkpoint", str(m.parent), check=False)
    assert bad.returncode == 9 and "Traceback" not in bad.stderr


def test_checkpoint_waits_for_write_permits(mounter: fh.Mounter, lower_ref: str) -> None:
    """A tool holding the whole-workspace write permit (Bash) makes a checkpoint wait; a
    checkpoint that cannot get it in time fails with CheckpointError and changes nothing."""
    import threading

    from fusefs.session.control import hold_write_permit
    from fusefs.session.errors import CheckpointError

    d = mounter.rw(lower_ref)
    c = client(d.mnt)
    release = threading.Event()
    held = threading.Event()

    def tool() -> None:
        with hold_write_permit(c.socket_path, timeout_s=30):
            held.set()
            (d.mnt / "by-tool").write_bytes(b"tool output\n")  # writes are not paused
            release.wait(30)

    t = threading.Thread(target=tool)
    t.start()
    try:
        assert held.wait(30)
        with pytest.raises(CheckpointError):
            c.checkpoint(timeout_s=0.3)
        assert c.status()["dirty_inodes"] >= 1 and recorded_base(d.state) == lower_ref  # type: ignore[arg-type]
    finally:
        release.set()
        t.join(30)
    r = c.checkpoint()
    assert read_in(d.store, r["ref"], "by-tool") == b"tool output\n"


def test_status_counts_fuse_requests_by_operation(mounter: fh.Mounter, lower_ref: str) -> None:
    m = mounter.rw(lower_ref).mnt
    before = client(m).status()["requests"]
    for i in range(5):
        (m / f"counted{i}.txt").write_bytes(b"x")
    st = client(m).status()
    after = st["requests"]
    if st["no_open"]:  # the first CREATE answers ENOSYS: the kernel makes files by MKNOD
        assert after.get("mknod", 0) - before.get("mknod", 0) == 5
        assert after.get("create", 0) - before.get("create", 0) <= 1
    else:
        assert after.get("create", 0) - before.get("create", 0) == 5
    assert after.get("write", 0) - before.get("write", 0) == 5


def _history_records(store: Path) -> int:
    return len(os.listdir(store / "backend" / "snapshots"))


def test_every_label_of_an_unchanged_mount_is_kept(mounter: fh.Mounter, fuse_store: Path,
                                                   lower_ref: str) -> None:
    """Labelled checkpoints of an unchanged mount give the same Ref and each label is kept
    with it (``list`` shows them, ``@label`` finds each), also for two checkpoints started
    at once; an unchanged checkpoint without a new label writes nothing."""
    m = mounter.rw(lower_ref).mnt
    (m / "plain.txt").write_bytes(b"one\n")
    refs = [cli(fuse_store, "checkpoint", str(m), "--label", label).stdout.strip()
            for label in ("P1", "P2")]
    assert refs[0] == refs[1] != lower_ref
    records = _history_records(fuse_store)
    assert cli(fuse_store, "checkpoint", str(m)).stdout.strip() == refs[0]
    assert cli(fuse_store, "checkpoint", str(m), "--label", "P2").stdout.strip() == refs[0]
    assert _history_records(fuse_store) == records  # nothing new: nothing written
    for label in ("P1", "P2"):
        (m / "plain.txt").write_bytes(b"broken\n")
        r = cli(fuse_store, "restore", str(m), f"@{label}", "--json", check=False)
        assert r.returncode == 0, (label, r.stderr)
        assert json.loads(r.stdout)["ref"] == refs[0]
        assert (m / "plain.txt").read_bytes() == b"one\n"
    listed = {s["ref"]: s for s in json.loads(cli(fuse_store, "list", "--json").stdout)}
    assert listed[refs[0]]["labels"] == ["P2", "P1"] and listed[refs[0]]["label"] == "P2"
    assert any(line.endswith(f"{refs[0]}  P2, P1")
               for line in cli(fuse_store, "list").stdout.splitlines())

    (m / "plain.txt").write_bytes(b"two\n")
    env = {**os.environ, "REWINDFS_STORE": str(fuse_store)}
    both = [subprocess.Popen([sys.executable, "-m", "rewindfs", "checkpoint", str(m),
                              "--label", label], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
            for label in ("c1", "c2")]
    outs = [p.communicate(timeout=120) for p in both]
    assert [p.returncode for p in both] == [0, 0], outs
    assert outs[0][0] == outs[1][0]
    for label in ("c1", "c2"):
        r = cli(fuse_store, "cat", f"@{label}", "plain.txt", check=False)
        assert r.returncode == 0 and r.stdout == "two\n", (label, r.stderr)
