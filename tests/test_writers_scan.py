"""The /proc scan of no-open mode (``fusefs/writers.py``) on real processes and a real file
system (the one holding ``tmp_path``; the scan looks only at /proc and at mount ids, so no
FUSE mount is needed): a thread with a descriptor table of its own, kcmp keeping the cost
of threads that share one table to one read, and descriptors whose mount no namespace
lists any more, told by their device; ``mapped``, the files mapped shared and writable.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from fusefs import writers


def device(path: Path) -> str:
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


THREADS = r"""
import ctypes, os, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
opened, stop = threading.Event(), threading.Event()
def own_table():
    assert libc.unshare(0x400) == 0  # CLONE_FILES
    os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT, 0o644)
    opened.set(); stop.wait()
for _ in range(int(sys.argv[2])):
    threading.Thread(target=stop.wait, daemon=True).start()
threading.Thread(target=own_table, daemon=True).start()
opened.wait()
print("ready", flush=True); sys.stdin.readline()
"""


@pytest.fixture
def threads(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A process of 41 threads, 40 sharing its descriptor table and one with a table of its
    own, in which alone ``tmp_path/f`` is open for writing."""
    f = tmp_path / "f"
    p = subprocess.Popen([sys.executable, "-c", THREADS, str(f), "40"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        yield p, f
    finally:
        p.kill()
        p.wait(30)


def test_a_thread_with_a_table_of_its_own_is_seen(
        threads: tuple[subprocess.Popen[str], Path], tmp_path: Path) -> None:
    p, f = threads
    assert os.listdir(f"/proc/{p.pid}/fd") and f.name not in {
        os.path.basename(os.readlink(f"/proc/{p.pid}/fd/{n}"))
        for n in os.listdir(f"/proc/{p.pid}/fd")}  # not in the leader's table
    seen = writers.scan(device(tmp_path))
    assert seen.inodes.get(os.stat(f).st_ino) == {p.pid}


def test_threads_sharing_a_table_cost_one_read_where_kcmp_answers(
        threads: tuple[subprocess.Popen[str], Path]) -> None:
    p, _ = threads
    base = f"/proc/{p.pid}"
    kcmp = writers._Kcmp()
    tables = list(writers._tables(base, p.pid, kcmp))
    if not kcmp.on:
        pytest.skip("kcmp(2) is refused here: every thread's table is read")
    assert len(tables) == 2 and tables[0] == base  # the leader's, the thread's own
    off = writers._Kcmp()
    off.on = False  # as where kcmp is refused: every table, the writer among them
    every = list(writers._tables(base, p.pid, off))
    assert len(every) == 42 and set(tables) <= set(every)


OPENER = r"""
import os, socket, subprocess, sys
s = socket.socket(fileno=int(sys.argv[1]))
subprocess.run(["mount", "-t", "tmpfs", "none", sys.argv[4]], check=True)
with open(os.path.join(sys.argv[4], "t"), "w"):
    pass
socket.send_fds(s, [b"x"], [os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT, 0o644),
                            os.open(sys.argv[3], os.O_RDONLY),
                            os.open(os.path.join(sys.argv[4], "t"), os.O_WRONLY)])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="unshare -m and mount need root")
def test_a_descriptor_of_a_gone_namespace_is_told_by_its_device(tmp_path: Path) -> None:
    # Descriptors opened in a mount namespace since gone, so no mountinfo lists their
    # mounts: a writable one on the device, a read-only one on it, a writable one on a
    # tmpfs that existed only there.
    w, r, t = tmp_path / "w", tmp_path / "r", tmp_path / "tmpfs"
    r.write_bytes(b"")
    t.mkdir()
    mine, theirs = socket.socketpair()
    with mine, theirs:
        subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        OPENER, str(theirs.fileno()), str(w), str(r), str(t)],
                       pass_fds=[theirs.fileno()], check=True, timeout=60)
        _, fds, _, _ = socket.recv_fds(mine, 1, 3)
    try:
        with open("/proc/self/mountinfo") as f:
            ids = {int(line.split()[0]) for line in f}
        mnt = [int(line.split()[1]) for fd in fds
               for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines()
               if line.startswith("mnt_id:")]
        assert len(mnt) == 3 and not ids & set(mnt)
        wino, rino = os.stat(w).st_ino, os.stat(r).st_ino
        tst = os.fstat(fds[2])
        seen = writers.scan(device(tmp_path), skip=())
        assert seen.inodes.get(wino, set()) >= {os.getpid()}
        assert os.getpid() not in seen.inodes.get(rino, set())  # read-only
        gone = writers.scan(f"{os.major(tst.st_dev)}:{os.minor(tst.st_dev)}", skip=())
        assert gone.inodes == {tst.st_ino: {os.getpid()}}
        assert writers.scan(device(tmp_path)).inodes.get(wino, set()) == set()  # skip
    finally:
        for fd in fds:
            os.close(fd)


MAPS = r"""
import mmap, os, sys
maps = []
for path, shared, prot in ((sys.argv[1], True, mmap.PROT_READ | mmap.PROT_WRITE),
                           (sys.argv[2], False, mmap.PROT_READ | mmap.PROT_WRITE),
                           (sys.argv[3], True, mmap.PROT_READ)):
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8192)
    maps.append(mmap.mmap(fd, 8192, mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE, prot))
    os.close(fd)
print("ready", flush=True); sys.stdin.readline()
"""


def test_mapped_finds_files_mapped_shared_and_writable_only(tmp_path: Path) -> None:
    paths = [tmp_path / n for n in ("shared rw-s ", "private", "shared-ro")]
    p = subprocess.Popen([sys.executable, "-c", MAPS, *map(str, paths)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        inodes, _ = writers.mapped(device(tmp_path))
        assert os.stat(paths[0]).st_ino in inodes
        assert not {os.stat(q).st_ino for q in paths[1:]} & inodes
        assert os.stat(paths[0]).st_ino not in writers.mapped(device(tmp_path),
                                                              skip=(p.pid,))[0]
    finally:
        p.kill()
        p.wait(30)


ZOMBIE_SCAN = r"""
import os, sys
from fusefs import writers
zombie = sys.argv[1]
skip = tuple(int(n) for n in os.listdir("/proc") if n.isdigit() and n != zombie)
print(writers.scan("0:0", skip=skip).unseen, writers.mapped("0:0", skip=skip)[1])
"""


SYSTEM_PYTHON = "/usr/bin/python3"  # one user 1001 may run (the venv's may be under /root)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs another user's zombie (run as root) and a system python")
def test_a_zombie_that_refuses_inspection_is_not_counted_unseen() -> None:
    """A process this one may not inspect counts as unseen only if it can hold a
    descriptor or a mapping: another user's zombie (no thread left) refuses, and holds
    nothing. Scanned as user 1001, the only process looked at being root's zombie."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        while not open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z":
            os.sched_yield()
        repo = Path(__file__).resolve().parent.parent
        r = subprocess.run([SYSTEM_PYTHON, "-c", ZOMBIE_SCAN, str(pid)], user=1001,
                           group=1001, extra_groups=[], capture_output=True, text=True,
                           cwd="/", env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"},
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["0", "0"], r.stdout
    finally:
        os.waitpid(pid, 0)
