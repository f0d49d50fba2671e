"""Restore of a live session mount (CONTRACT 3.2), through real mounts: right after the call
returns the mount is exactly the target (no polling); unchanged paths keep their inode
numbers and changed content gets new ones; a read-only handle opened earlier keeps reading
the old content; a process whose cwd exists in the target keeps a valid cwd; a restore never
waits for open files: a writer keeps its old, detached file (old bytes, writes that reach no
tree and no checkpoint), a cwd the restore removed shows nothing, and GC keeps the old lower
while a detached handle reads it; ``--wait-writers`` waits for writers and refuses with kind
permit_failed, changing nothing; every checkpoint is restorable in any order; git sees a
consistent work tree.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
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


# A process holding files open: one command per line on stdin, one answer per line.
HOLDER = r"""
import errno, hashlib, os, sys
fds = {}
modes = {"r": os.O_RDONLY, "rw": os.O_RDWR}
for line in sys.stdin:
    cmd, path, *arg = line.split()
    try:
        if cmd == "open":
            fds[path] = os.open(path, modes[arg[0]])
            out = "ok"
        elif cmd == "append":
            os.lseek(fds[path], 0, os.SEEK_END)
            os.write(fds[path], bytes.fromhex(arg[0]))
            out = "ok"
        elif cmd == "read":
            out = os.pread(fds[path], 1 << 16, 0).hex()
        elif cmd == "sum":
            data = b"".join(iter(lambda: os.read(fds[path], 1 << 20), b""))
            out = hashlib.sha256(data).hexdigest()
        elif cmd == "stat":
            os.stat(path)
            out = "ok"
        elif cmd == "create":
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            out = "ok"
        elif cmd == "list":
            out = ",".join(sorted(os.listdir(path)))
    except OSError as e:
        out = errno.errorcode[e.errno]
    print(out, flush=True)
"""


class Holder:
    """A separate process (files it opens stay open) whose cwd is ``cwd``."""

    def __init__(self, cwd: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=cwd,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, *words: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(words) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


def wait_for(what: str, cond) -> None:  # type: ignore[no-untyped-def]
    """Poll ``cond`` for what the kernel does on its own time (RELEASE, FORGET) and the
    daemon's next batch commit."""
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, f"still not {what}"
        time.sleep(0.05)


def test_restore_at_once_with_a_writer_and_a_removed_cwd(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "plain.txt").write_bytes(b"version two\n")
    (m / "work").mkdir()
    (m / "work" / "notes.txt").write_bytes(b"notes\n")
    writer = Holder(m)
    cwd = Holder(m / "work")
    try:
        assert writer.ask("open", "plain.txt", "rw") == "ok"  # content the restore changes
        assert writer.ask("open", "dir/a.txt", "rw") == "ok"  # a path it leaves unchanged
        a_ino = os.stat(m / "dir" / "a.txt").st_ino
        assert cwd.ask("stat", "notes.txt") == "ok"
        r = client(m).restore(lower_ref)  # no wait, no permit_failed
        assert str(compute_ref(m)) == lower_ref and r["detached"] >= 3
        assert cli(fuse_store, "cat", r["pre_restore"], "plain.txt").stdout == "version two\n"
        assert cli(fuse_store, "cat", r["pre_restore"], "work/notes.txt").stdout == "notes\n"

        assert writer.ask("read", "plain.txt") == b"version two\n".hex()  # the old bytes
        assert writer.ask("append", "plain.txt", b"more\n".hex()) == "ok"
        assert writer.ask("read", "plain.txt") == b"version two\nmore\n".hex()
        assert writer.ask("append", "dir/a.txt", b"a2\n".hex()) == "ok"
        assert writer.ask("read", "dir/a.txt") == b"a\na2\n".hex()
        assert (m / "plain.txt").read_bytes() == b"hello world\n"  # not in the tree
        assert (m / "dir" / "a.txt").read_bytes() == b"a\n"
        assert os.stat(m / "dir" / "a.txt").st_ino != a_ino

        assert cwd.ask("stat", "notes.txt") == "ENOENT"  # the cwd was removed
        assert cwd.ask("create", "new.txt") == "ENOENT"
        assert cwd.ask("list", ".") == ""
        assert not (m / "work").exists()

        st = client(m).status()
        assert st["dirty_inodes"] == 0 and st["detached_inodes"] >= 3
        assert st["held_lowers"] == [r["pre_restore"]]
        assert client(m).checkpoint()["ref"] == lower_ref  # in no later checkpoint
        text = cli(fuse_store, "status", str(m)).stdout
        assert "dirty:     0 inodes" in text and "detached:" in text
    finally:
        writer.close()
        cwd.close()
    wait_for("released", lambda: client(m).status()["detached_inodes"] == 0)
    assert client(m).status()["held_lowers"] == []
    mounter.remount(d)
    assert str(compute_ref(m)) == lower_ref
    assert (m / "plain.txt").read_bytes() == b"hello world\n"


def test_wait_writers_waits_then_refuses(mounter: fh.Mounter, fuse_store: Path,
                                         lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "new.txt").write_bytes(b"pending\n")
    before = str(compute_ref(m))
    mtime = os.lstat(m / "new.txt").st_mtime_ns
    f = open(m / "new.txt", "ab")
    try:
        t0 = time.monotonic()
        with pytest.raises(RestoreError) as ei:
            client(m).restore(lower_ref, wait_writers=0.3)
        assert ei.value.kind == "permit_failed" and time.monotonic() - t0 >= 0.3
        r = cli(fuse_store, "restore", str(m), lower_ref, "--wait-writers", "0.2",
                check=False)
        assert r.returncode == 10 and r.stderr.count("failed (permit_failed)") == 1, r.stderr
        r = cli(fuse_store, "session", "restore", "x", lower_ref, "--wait-writers", "-1",
                check=False)
        assert r.returncode == 2 and "--wait-writers" in r.stderr
        f.write(b"still works\n")  # writes go on once the restore gave up
        f.flush()
    finally:
        f.close()
    assert (m / "new.txt").read_bytes() == b"pending\nstill works\n"
    assert recorded_base(d.state) == lower_ref  # type: ignore[arg-type]
    (m / "new.txt").write_bytes(b"pending\n")
    os.utime(m / "new.txt", ns=(mtime, mtime))
    assert str(compute_ref(m)) == before

    # A writer that closes within the wait lets the restore through, its last write kept.
    f = open(m / "new.txt", "ab")
    f.write(b"last\n")
    f.flush()
    closer = threading.Timer(0.3, f.close)
    closer.start()
    try:
        r2 = client(m).restore(lower_ref, wait_writers=60)
    finally:
        closer.join()
    assert f.closed and str(compute_ref(m)) == lower_ref
    assert cli(fuse_store, "cat", r2["pre_restore"], "new.txt").stdout == "pending\nlast\n"

    # --timeout bounds only the wait for write permits: an open writer does not stop it.
    with open(m / "plain.txt", "ab"):
        out = json.loads(cli(fuse_store, "restore", str(m), r2["pre_restore"], "--timeout",
                              "0.2", "--json").stdout)
    assert out["detached"] == 1 and str(compute_ref(m)) == r2["pre_restore"]


@pytest.mark.parametrize("mode", [pytest.param([], id="default"),
                                  pytest.param(["--open-handles"], id="open-handles")])
def test_a_writer_in_the_bash_sandbox_is_seen_and_detached(
        mounter: fh.Mounter, lower_ref: str, mode: list[str]) -> None:
    # The writer runs in the Bash sandbox (its own pid, mount and user namespaces), at a
    # path the restore leaves unchanged: --wait-writers sees it, and a restore detaches
    # it (in no-open mode, the default, the daemon finds it by a scan of /proc).
    from tools import sandbox

    why = sandbox.unavailable_reason()
    if why is not None:
        pytest.skip(why)
    bwrap = sandbox.bwrap()
    assert bwrap is not None
    m = mounter.rw(lower_ref, extra=mode).mnt
    (m / "log.txt").write_bytes(b"one\n")
    good = client(m).checkpoint()["ref"]
    root = os.path.realpath(m)
    argv = sandbox.confined_shell(bwrap, root, root, [], "exec 3>>log.txt && echo ready && "
                                  "read -r _ && echo two >&3 && echo done")
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdin is not None and p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "ready"
        st = client(m).status()
        assert st["open_writers"] == 1
        if st["no_open"]:
            assert st["writers_found_by"] == "proc_scan" and len(st["writer_pids"]) == 1
        (m / "other.txt").write_bytes(b"restored away\n")
        with pytest.raises(RestoreError) as ei:
            client(m).restore(good, wait_writers=0.3)
        assert ei.value.kind == "permit_failed" and (m / "other.txt").exists()
        r = client(m).restore(good)
        assert r["detached"] >= 1 and not (m / "other.txt").exists()
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        assert (m / "log.txt").read_bytes() == b"one\n"  # the write went to the detached file
        assert client(m).checkpoint()["ref"] == good
    finally:
        p.kill()
        p.wait(30)


def test_gc_keeps_the_lower_a_detached_handle_reads(mounter: fh.Mounter, fuse_store: Path,
                                                    lower_ref: str, tmp_path: Path) -> None:
    from fusefs.session.fusetree import pinned_refs
    from store.objects import Store
    from store.ref import Ref

    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_bytes(b"x\n")
    target = fh.snapshot(fuse_store, other)
    st = Store(fuse_store)
    try:
        big = st.get_tree(Ref.parse(lower_ref).tree_id).get(b"big.bin")
    finally:
        st.close()
    assert big is not None
    d = mounter.rw(lower_ref)
    m = d.mnt
    reader = Holder(m)
    try:
        assert reader.ask("open", "big.bin", "r") == "ok"
        client(m).restore(target, discard=True)  # lists nothing: the old lower is lower_ref
        assert not (m / "big.bin").exists()
        cli(fuse_store, "forget", lower_ref)
        cli(fuse_store, "gc")
        want = hashlib.sha256(fh.pattern(fh.BIG_SIZE)).hexdigest()
        assert reader.ask("sum", "big.bin") == want  # every chunk still there
        assert Ref.parse(lower_ref) in pinned_refs(str(d.state))
    finally:
        reader.close()
    wait_for("unpinned", lambda: Ref.parse(lower_ref) not in pinned_refs(str(d.state)))
    rep = json.loads(cli(fuse_store, "gc", "--json").stdout)
    assert rep["objects_deleted"] > 0
    st = Store(fuse_store)
    try:
        assert not any(st.has(c) for c in big.chunks)  # freed after the last handle
    finally:
        st.close()


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


def test_a_failed_restore_is_logged_by_the_daemon(mounter: fh.Mounter, lower_ref: str) -> None:
    """A restore that fails writes ``restore failed: <type>: <message>`` to the daemon log,
    as a failed checkpoint writes ``checkpoint failed: ...``; the tree is unchanged."""
    d = mounter.rw(lower_ref)
    missing = "v1:blake3:" + "0" * 64
    with pytest.raises(RefNotFoundError):
        client(d.mnt).restore(missing)
    assert d.state is not None
    log = (d.state / "daemon.log").read_text(errors="replace")
    lines = [ln for ln in log.splitlines() if "restore failed: " in ln]
    assert len(lines) == 1, log
    assert "restore failed: RefNotFoundError: " in lines[0] and missing in lines[0], lines
    assert str(compute_ref(d.mnt)) == lower_ref
