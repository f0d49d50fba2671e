"""Several processes at once on one session mount. The daemon interleaves their requests
(handlers wait for worker threads while copying up chunks, syncing, committing); the
outcome must be the same as running the same work one process at a time on tmpfs.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from fusehelpers import BIG_SIZE, pattern
from test_fuse_stateful import build_template, snapshot_tree

WORKERS = 4
OPS_PER_WORKER = 250

# Runs a list of operations in one directory; prints the outcome of each (ok or errno name).
PROGRAM = r"""
import errno, json, os, sys
root, ops = sys.argv[1], json.loads(sys.argv[2])
out = []
def body(seed, n):
    return bytes((seed * 31 + i * 7) & 0xFF for i in range(n))
for op, a in ops:
    p = lambda x: os.path.join(root, x)
    try:
        if op == "write":
            fd = os.open(p(a[0]), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, body(a[3], a[2]), a[1])
                if a[3] % 5 == 0:
                    os.fsync(fd)
            finally:
                os.close(fd)
        elif op == "truncate":
            os.truncate(p(a[0]), a[1])
        elif op == "rename":
            os.rename(p(a[0]), p(a[1]))
        elif op == "unlink":
            os.unlink(p(a[0]))
        elif op == "mkdir":
            os.mkdir(p(a[0]))
        elif op == "rmdir":
            os.rmdir(p(a[0]))
        elif op == "link":
            os.link(p(a[0]), p(a[1]))
        elif op == "symlink":
            os.symlink(a[1], p(a[0]))
        elif op == "chmod":
            os.chmod(p(a[0]), a[1])
        elif op == "setxattr":
            os.setxattr(p(a[0]), "user.c", body(a[1], 20))
        elif op == "read":
            with open(p(a[0]), "rb") as f:
                f.read()
        out.append("ok")
    except OSError as e:
        out.append(errno.errorcode[e.errno])
print(json.dumps(out))
"""

PATHS = ["a", "b", "dir/a", "dir/b", "dir/sub/a", "dir/sub/b", "sub", "dir/dir", "n1", "n2"]


def make_program(rnd: random.Random) -> list[tuple[str, list[object]]]:
    ops: list[tuple[str, list[object]]] = []
    for _ in range(OPS_PER_WORKER):
        kind = rnd.choice(["write", "write", "write", "truncate", "rename", "unlink", "mkdir",
                           "rmdir", "link", "symlink", "chmod", "setxattr", "read", "read"])
        a, b = rnd.choice(PATHS), rnd.choice(PATHS)
        if kind == "write":
            args: list[object] = [a, rnd.choice([0, 100, 4096, 70_000, 1 << 20, 2 << 20]),
                                  rnd.choice([1, 500, 5000, 70_000]), rnd.randrange(1000)]
        elif kind == "truncate":
            args = [a, rnd.choice([0, 10, 5000, 1 << 20])]
        elif kind in ("rename", "link"):
            args = [a, b]
        elif kind == "symlink":
            args = [a, rnd.choice(["a", "dir/../a", "nowhere"])]  # never outside its directory
        elif kind == "chmod":
            args = [a, rnd.choice([0o644, 0o600, 0o755])]
        elif kind == "setxattr":
            args = [a, rnd.randrange(1000)]
        else:
            args = [a]
        ops.append((kind, args))
    return ops


@pytest.fixture
def tmpfs_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rewindfs-test-conc-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(d)],
                             capture_output=True).returncode == 0
    try:
        yield d
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(d)], check=False)
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_parallel_programs_match_tmpfs(mounter: fh.Mounter, fuse_store: Path, tmp_path: Path,
                                       tmpfs_dir: Path) -> None:
    template = tmp_path / "template"
    build_template(template)
    src = tmp_path / "src"
    src.mkdir()
    for k in range(WORKERS):
        subprocess.run(["cp", "-a", str(template), str(src / f"w{k}")], check=True)
        subprocess.run(["cp", "-a", str(template), str(tmpfs_dir / f"w{k}")], check=True)
    d = mounter.rw(fh.snapshot(fuse_store, src))
    seed = int(os.environ.get("REWINDFS_FUSE_SEED") or random.randrange(1 << 32))
    print(f"concurrency test: seed {seed} (replay: REWINDFS_FUSE_SEED={seed})", file=sys.stderr)
    rnd = random.Random(seed)
    programs = [json.dumps(make_program(rnd)) for _ in range(WORKERS)]

    def run(root: Path, prog: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", PROGRAM, str(root), prog],
                                stdout=subprocess.PIPE, text=True)

    on_mount = [run(d.mnt / f"w{k}", programs[k]) for k in range(WORKERS)]
    outs_mount = [json.loads(p.communicate(timeout=600)[0]) for p in on_mount]
    outs_tmpfs = [json.loads(run(tmpfs_dir / f"w{k}", programs[k]).communicate(timeout=600)[0])
                  for k in range(WORKERS)]
    for k in range(WORKERS):
        assert outs_mount[k] == outs_tmpfs[k], f"worker {k}, seed {seed}"
        assert snapshot_tree(str(d.mnt / f"w{k}")) == snapshot_tree(str(tmpfs_dir / f"w{k}")), \
            f"worker {k}, seed {seed}"
    mounter.remount(d)
    for k in range(WORKERS):
        assert snapshot_tree(str(d.mnt / f"w{k}")) == snapshot_tree(str(tmpfs_dir / f"w{k}")), \
            f"after remount: worker {k}, seed {seed}"


# Writes one byte every 4 KiB of its own MiB of the file, reading back as it goes.
WRITER = r"""
import os, sys
path, k = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDWR)
base = k << 20
for off in range(0, 1 << 20, 4096):
    os.pwrite(fd, bytes([k + 1]), base + off + k)
    if os.pread(fd, 1, base + off + k) != bytes([k + 1]):
        sys.exit(f"writer {k}: lost its own write at {base + off + k}")
os.close(fd)
"""

READER = r"""
import sys
for _ in range(int(sys.argv[2])):
    with open(sys.argv[1], "rb") as f:
        if len(f.read()) != int(sys.argv[3]):
            sys.exit("wrong length")
"""


def test_parallel_copy_up_of_one_lower_file(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    big = d.mnt / "big.bin"
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(big), str(k)])
             for k in range(3)]
    procs.append(subprocess.Popen([sys.executable, "-c", READER, str(big), "5", str(BIG_SIZE)]))
    assert [p.wait(timeout=600) for p in procs] == [0, 0, 0, 0]
    want = bytearray(pattern(BIG_SIZE))
    for k in range(3):
        for off in range(0, 1 << 20, 4096):
            want[(k << 20) + off + k] = k + 1
    assert big.read_bytes() == bytes(want)
    mounter.remount(d)
    assert big.read_bytes() == bytes(want)
