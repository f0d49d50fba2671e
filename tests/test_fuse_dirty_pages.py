"""What a process wrote and never flushed (CONTRACT 3.1, 3.2), through real mounts: files
it keeps open without fsync, large and small files it keeps mapped shared with their pages
dirty, a rewrite of a lower file: all of it is in a checkpoint taken right after, and in
the pre-restore checkpoint of a restore made right after, digest for digest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import blake3
import fusehelpers as fh
import pytest
from ckpt_support import client

from fusefs.session.fallback import fuse_available
from store.snapshot import compute_ref

pytestmark = pytest.mark.skipif(fh.SELFTEST or not fuse_available(),
                                reason="needs real mounts")

SMALL = 300  # small files a writer leaves open, unflushed
MAPPED = 20  # small files it writes through shared mappings only
# A few pages: the kernel writes a FUSE mount's dirty pages back early once they pass a
# small share of its dirty limit (BDI_CAP_STRICTLIMIT), but pages below it stay dirty for
# the 30 s of dirty_expire_centisecs: only a syncfs brings them in time.
MAPPED_SIZE = 3 * 4096 + 100
LARGE = 9 * (1 << 20) + 4321  # written by write(2) in 64 KiB pieces, and through a mapping

# Writes into directory argv[1] and keeps it all open (no fsync, no close, the mapping not
# synced) until its stdin closes: small files s/NNN, a large file by write(2), a large file
# through a shared mapping, small files m/NN through shared mappings, and a rewrite of the
# lower file plain.txt. Prints "ready".
WRITER = r"""
import mmap, os, sys
sys.path.insert(0, sys.argv[2])
import fusehelpers as fh
root, n, large = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
mapped, mapped_size = int(sys.argv[5]), int(sys.argv[6])
os.mkdir(os.path.join(root, "s"))
os.mkdir(os.path.join(root, "m"))
fds = []
for i in range(n):
    fd = os.open(os.path.join(root, "s", f"{i:03d}"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, f"small file {i}\n".encode() * (i % 7 + 1))
    fds.append(fd)
fd = os.open(os.path.join(root, "by-write.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
data = fh.pattern(large, seed=5)
for off in range(0, large, 65536):
    os.write(fd, data[off:off + 65536])
fds.append(fd)
fd = os.open(os.path.join(root, "by-mmap.bin"), os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, large)
m = mmap.mmap(fd, large)
m[:] = fh.pattern(large, seed=6)
fds.append(fd)
maps = [m]
for i in range(mapped):
    fd = os.open(os.path.join(root, "m", f"{i:02d}"), os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(fd, mapped_size)
    maps.append(mmap.mmap(fd, mapped_size))
    maps[-1][:] = fh.pattern(mapped_size, seed=20 + i)
    fds.append(fd)
fd = os.open(os.path.join(root, "plain.txt"), os.O_WRONLY)
os.write(fd, b"HELLO")
fds.append(fd)
print("ready", flush=True)
sys.stdin.read()
"""


def want() -> dict[str, str]:
    """What the writer wrote: path -> blake3 hex digest."""
    out = {f"s/{i:03d}": f"small file {i}\n".encode() * (i % 7 + 1) for i in range(SMALL)}
    out["by-write.bin"] = fh.pattern(LARGE, seed=5)
    out["by-mmap.bin"] = fh.pattern(LARGE, seed=6)
    out["plain.txt"] = b"HELLO world\n"
    for i in range(MAPPED):
        out[f"m/{i:02d}"] = fh.pattern(MAPPED_SIZE, seed=20 + i)
    return {p: blake3.blake3(b).hexdigest() for p, b in out.items()}


def digests(root: Path, names: list[str]) -> dict[str, str]:
    return {n: blake3.blake3((root / n).read_bytes()).hexdigest() for n in names}


class Writer:
    """The WRITER script against mount ``m``; on entry its data is written."""

    def __init__(self, m: Path) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", WRITER, str(m),
                                   str(Path(__file__).parent), str(SMALL), str(LARGE),
                                   str(MAPPED), str(MAPPED_SIZE)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __enter__(self) -> Writer:
        assert self.p.stdout is not None
        assert self.p.stdout.readline() == "ready\n"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        assert self.p.wait(timeout=60) == 0


def test_a_checkpoint_takes_what_writers_have_not_flushed(mounter: fh.Mounter,
                                                          lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    with Writer(m):
        ref = client(m).checkpoint()["ref"]
        assert ref == str(compute_ref(m))
        ro = mounter.ro(ref)
        assert digests(ro.mnt, sorted(want())) == want()
        assert client(m).checkpoint()["ref"] == ref  # nothing more came in meanwhile
    assert client(m).checkpoint()["ref"] == ref


def test_a_restore_right_after_unflushed_writes_keeps_them_in_its_pre_restore_checkpoint(
        mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    m = d.mnt
    with Writer(m):
        r = client(m).restore(lower_ref)
        assert str(compute_ref(m)) == lower_ref
        assert (m / "plain.txt").read_bytes() == b"hello world\n"
    ro = mounter.ro(r["pre_restore"])
    assert digests(ro.mnt, sorted(want())) == want()
    assert str(compute_ref(m)) == lower_ref  # the writer's last pages went to its own files
    mounter.remount(d)
    assert str(compute_ref(m)) == lower_ref
