"""POSIX behaviour a session mount shares with tmpfs (issue 10 point 4), on real mounts and
real directories: block and character devices kept as metadata through checkpoint,
read-only mounts, ``snapshot DIR`` and ``materialize``; ENAMETOOLONG for a component over
255 bytes on the calls that look a name up; ``st_blocks`` counts data, not holes; a write
straddling the 1 TiB file size limit is short.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli
from conftest import SHARED_TMP_PREFIX
from treegen import as_nobody

from fusefs.overlay import MAX_FILE_SIZE
from store import chunker

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a device needs root")
DEVS = {"tty0": (stat.S_IFCHR, os.makedev(4, 0), 0o620),
        "loop7": (stat.S_IFBLK, os.makedev(7, 7), 0o660)}


def make_devices(d: Path) -> None:
    for name, (kind, rdev, mode) in DEVS.items():
        os.mknod(d / name, kind | mode, rdev)
        os.chmod(d / name, mode)


def assert_devices(d: Path) -> None:
    for name, (kind, rdev, mode) in DEVS.items():
        st = os.lstat(d / name)
        assert stat.S_IFMT(st.st_mode) == kind, name
        assert stat.S_IMODE(st.st_mode) == mode, name
        assert st.st_rdev == rdev, name


@needs_root
def test_devices_round_trip_checkpoint_ro_mount_and_materialize(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, tmp_path: Path) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "dev").mkdir()
    make_devices(d.mnt / "dev")
    assert_devices(d.mnt / "dev")
    ref = cli(fuse_store, "checkpoint", str(d.mnt)).stdout.strip()
    assert_devices(d.mnt / "dev")  # now served from the new lower
    mounter.unmount(d)
    d2 = mounter.rw(None, state=d.state, mnt=d.mnt)  # the upper is empty: lower only
    assert_devices(d2.mnt / "dev")
    ro = mounter.ro(ref)
    assert_devices(ro.mnt / "dev")
    assert fh.errno_of(os.open, ro.mnt / "dev" / "tty0", os.O_RDONLY) == errno.EACCES

    dest = tmp_path / "out"
    out = json.loads(cli(fuse_store, "materialize", ref, str(dest), "--json").stdout)
    assert out["devices_skipped"] == 0 and not out["already_equal"]
    assert_devices(dest / "dev")
    # What materialize wrote snapshots back to the same Ref.
    assert cli(fuse_store, "snapshot", str(dest)).stdout.strip() == ref
    again = json.loads(cli(fuse_store, "materialize", ref, str(dest), "--json").stdout)
    assert again["already_equal"]


@needs_root
def test_materialize_as_non_root_skips_devices_and_reports_them(tmp_path: Path) -> None:
    from store.materialize import materialize
    from store.objects import Store
    from store.snapshot import snapshot

    # pytest's base directory is 0700: work where uid 65534 can go.
    tmp_path = Path(tempfile.mkdtemp(prefix=SHARED_TMP_PREFIX + "posix-"))
    try:
        _materialize_as_nobody(tmp_path, Store, snapshot, materialize)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _materialize_as_nobody(tmp_path: Path, Store, snapshot, materialize) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "src"
    (src / "dev").mkdir(parents=True)
    (src / "dev" / "readme").write_text("devices beside me\n")
    make_devices(src / "dev")
    for p in [src, *src.rglob("*")]:  # nobody's tree, so a non-root copy can equal it
        os.lchown(p, 65534, 65534)
    store_dir = tmp_path / "store"
    st = Store(store_dir)
    try:
        ref = snapshot(st, src)
    finally:
        st.close()
    work = tmp_path / "work"
    work.mkdir()
    for p in [work, *store_dir.rglob("*"), store_dir]:  # the child runs as nobody
        os.lchown(p, 65534, 65534)
    os.chmod(tmp_path, 0o755)

    def child() -> int:
        s = Store(store_dir)
        try:
            first = materialize(s, ref, work / "out")
            second = materialize(s, ref, work / "out")  # the same tree, devices aside
        finally:
            s.close()
        if first.devices_skipped != 2 or first.already_equal:
            return 3
        return 0 if second.already_equal else 4

    assert as_nobody(child) == 0
    assert sorted(os.listdir(work / "out" / "dev")) == ["readme"]


def test_snapshot_dir_accepts_devices(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    from store.browse import ls
    from store.objects import Store
    from store.snapshot import snapshot

    src = tmp_path / "src"
    src.mkdir()
    make_devices(src)
    st = Store(tmp_path / "store")
    try:
        ref = snapshot(st, src)
        got = {e.name: (e.kind.name, e.rdev, e.mode) for e in ls(st, ref, "")}
    finally:
        st.close()
    assert got == {b"loop7": ("BLOCK", os.makedev(7, 7), 0o660),
                   b"tty0": ("CHAR", os.makedev(4, 0), 0o620)}
    out = json.loads(cli(tmp_path / "store", "ls", str(ref), "--json").stdout)
    assert {d["name"]: (d["kind"], d["rdev"]) for d in out} == {
        "loop7": ("block", os.makedev(7, 7)), "tty0": ("char", os.makedev(4, 0))}
    text = cli(tmp_path / "store", "ls", str(ref)).stdout
    assert text.startswith("brw-rw----") and "7, 7" in text and "crw--w----" in text


# -- names over 255 bytes ------------------------------------------------------------------

@pytest.mark.parametrize("call", ["stat", "lstat", "open", "unlink", "chmod", "rmdir",
                                  "rename_from", "rename_to", "mkdir", "create"])
def test_a_name_over_255_bytes_is_enametoolong(lower: Path, call: str) -> None:
    long = lower / ("n" * 256)
    ok = lower / "short"
    ok.write_bytes(b"x")
    calls = {
        "stat": lambda: os.stat(long),
        "lstat": lambda: os.lstat(long),
        "open": lambda: os.open(long, os.O_RDONLY),
        "unlink": lambda: os.unlink(long),
        "chmod": lambda: os.chmod(long, 0o600),
        "rmdir": lambda: os.rmdir(long),
        "rename_from": lambda: os.rename(long, lower / "other"),
        "rename_to": lambda: os.rename(ok, long),
        "mkdir": lambda: os.mkdir(long),
        "create": lambda: os.open(long, os.O_WRONLY | os.O_CREAT, 0o600),
    }
    assert fh.errno_of(calls[call]) == errno.ENAMETOOLONG
    # 255 bytes is still a name.
    edge = lower / ("n" * 255)
    edge.write_bytes(b"y")
    assert os.stat(edge).st_size == 1
    os.unlink(edge)


# -- st_blocks -----------------------------------------------------------------------------

def test_st_blocks_of_a_sparse_file_counts_data_not_holes(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    p = d.mnt / "sparse"
    with open(p, "wb") as f:
        f.truncate(1 << 40)
    assert os.stat(p).st_blocks == 0  # all hole, as on tmpfs
    with open(p, "r+b") as f:
        f.seek(1 << 30)
        f.write(b"d" * 4096)
    st = os.stat(p)
    assert st.st_size == 1 << 40
    # tmpfs shows 8 (one page): here the data file's allocation, a few pages at most.
    assert 8 <= st.st_blocks <= 64, st.st_blocks
    dense = d.mnt / "dense"
    dense.write_bytes(b"z" * 100_000)
    (d.mnt / "one").write_bytes(b"1")
    gappy = d.mnt / "gappy"  # data, a page-sized hole, data: in one chunk
    with open(gappy, "wb") as f:
        f.write(b"a" * 4096)
        f.seek(8192)
        f.write(b"b" * 100)
    # As tmpfs counts them: whole 4 KiB pages (8 blocks) that hold data, holes not.
    want = {"sparse": 8, "dense": 25 * 8, "one": 8, "gappy": 16}
    got = {n: os.stat(d.mnt / n).st_blocks for n in want}
    # Data files' allocation on the state disk (a file system may allocate ahead).
    assert 8 <= got.pop("sparse") <= 64 and 200 <= got.pop("dense") <= 256
    assert got == {"one": 8, "gappy": 16}  # inline content: its data pages
    ref = cli(fuse_store, "checkpoint", str(d.mnt)).stdout.strip()
    # Served from the new lower: the chunk holding the 4 KiB (1 MiB in this store) counts
    # its data pages, not the whole chunk; nothing jumps at the checkpoint.
    assert {n: os.stat(d.mnt / n).st_blocks for n in want} == want
    mounter.unmount(d)
    d = mounter.rw(None, state=d.state, mnt=d.mnt)  # attributes computed from the lower
    assert {n: os.stat(d.mnt / n).st_blocks for n in want} == want
    ro = mounter.ro(ref)
    assert {n: os.stat(ro.mnt / n).st_blocks for n in want} == want
    # A copy-up of the sparse file's data chunk, then a checkpoint: the same count again.
    with open(p, "r+b") as f:
        f.seek((1 << 30) + 4096)
        f.write(b"e" * 4096)
    cli(fuse_store, "checkpoint", str(d.mnt))
    assert os.stat(p).st_blocks == 16
    with open(ro.mnt / "sparse", "rb") as f:
        assert os.fstat(f.fileno()).st_size == 1 << 40
        f.seek((1 << 30) - 1)
        assert f.read(4098) == b"\0" + b"d" * 4096 + b"\0"
        f.seek((1 << 40) - 3)
        assert f.read(10) == bytes(3)


def test_data_pages_counts_the_pages_holding_a_non_zero_byte() -> None:
    # What a chunk's st_blocks is computed from (chunk_pages): 4 KiB pages from the start,
    # the last one short, counted when any byte of them is not zero, wherever that byte is.
    page = chunker.PAGE_SIZE
    for pos in (0, 1, page // 2 - 1, page // 2, page // 2 + 1, page - 2, page - 1):
        data = bytearray(3 * page + 10)
        data[page + pos] = 7
        assert chunker.data_pages(bytes(data)) == 1, pos
        assert chunker.data_pages(data) == 1, pos
    assert chunker.data_pages(b"") == 0
    assert chunker.data_pages(bytes(2 * page + 10)) == 0
    assert chunker.data_pages(bytes(2 * page + 9) + b"x") == 1  # the short last page
    assert chunker.data_pages(b"x" + bytes(2 * page + 9)) == 1
    assert chunker.data_pages(b"text without a zero byte" * 1000) == 6
    assert chunker.data_pages(b"a\0" * (3 * page)) == 6  # zero bytes inside data pages
    assert chunker.data_pages(b"y" * page + bytes(page) + b"\0z" + bytes(page)) == 2


# -- the 1 TiB limit -----------------------------------------------------------------------

def test_a_write_straddling_the_size_limit_is_short(lower: Path) -> None:
    p = lower / "big"
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert os.pwrite(fd, b"abcdefghij", MAX_FILE_SIZE - 4) == 4
        assert os.fstat(fd).st_size == MAX_FILE_SIZE
        assert os.pread(fd, 10, MAX_FILE_SIZE - 4) == b"abcd"
        assert fh.errno_of(os.pwrite, fd, b"x", MAX_FILE_SIZE) == errno.EFBIG
    finally:
        os.close(fd)
    os.unlink(p)


# -- hard links of every non-directory kind --------------------------------------------------

def make_linked_specials(root: Path) -> list[tuple[str, str, int]]:
    """A fifo, a symlink and (as root) a character device, each with a second name in
    another directory; returns ``(first, second, S_IFMT)`` per pair."""
    (root / "a").mkdir()
    (root / "b").mkdir()
    pairs = [("a/fifo", "b/fifo2", stat.S_IFIFO), ("a/sym", "b/sym2", stat.S_IFLNK)]
    os.mkfifo(root / "a/fifo", 0o640)
    os.symlink("../target", root / "a/sym")
    if os.geteuid() == 0:
        os.mknod(root / "a/tty", stat.S_IFCHR | 0o620, os.makedev(4, 1))
        pairs.append(("a/tty", "b/tty2", stat.S_IFCHR))
    for first, second, _fmt in pairs:
        os.link(root / first, root / second, follow_symlinks=False)
    return pairs


def assert_linked(root: Path, pairs: list[tuple[str, str, int]]) -> None:
    for first, second, fmt in pairs:
        a, b = os.lstat(root / first), os.lstat(root / second)
        assert stat.S_IFMT(a.st_mode) == fmt, first
        assert (a.st_nlink, b.st_nlink) == (2, 2), (first, a.st_nlink, b.st_nlink)
        assert a.st_ino == b.st_ino, (first, second)
    assert os.readlink(root / "b/sym2") == "../target"


def test_hard_links_of_fifos_symlinks_and_devices_survive_checkpoint_and_materialize(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, tmp_path: Path) -> None:
    d = mounter.rw(lower_ref)
    pairs = make_linked_specials(d.mnt)
    assert_linked(d.mnt, pairs)
    ref = cli(fuse_store, "checkpoint", str(d.mnt)).stdout.strip()
    assert_linked(d.mnt, pairs)  # served from the new lower
    # One link more on the frozen group: the group id is computed again from its names.
    os.link(d.mnt / "a/fifo", d.mnt / "fifo3")
    assert os.lstat(d.mnt / "b/fifo2").st_nlink == 3
    os.unlink(d.mnt / "fifo3")
    assert cli(fuse_store, "checkpoint", str(d.mnt)).stdout.strip() == ref
    mounter.unmount(d)
    d2 = mounter.rw(None, state=d.state, mnt=d.mnt)
    assert_linked(d2.mnt, pairs)
    assert_linked(mounter.ro(ref).mnt, pairs)
    # Names removed, then a restore of the Ref: the groups come back whole.
    os.unlink(d2.mnt / "b/sym2")
    os.unlink(d2.mnt / "a/fifo")
    assert os.lstat(d2.mnt / "a/sym").st_nlink == 1
    cli(fuse_store, "restore", str(d2.mnt), ref)
    assert_linked(d2.mnt, pairs)
    dest = tmp_path / "out"
    cli(fuse_store, "materialize", ref, str(dest))
    assert_linked(dest, pairs)
    assert cli(fuse_store, "snapshot", str(dest)).stdout.strip() == ref
    out = json.loads(cli(fuse_store, "materialize", ref, str(dest), "--json").stdout)
    assert out["already_equal"]


def test_snapshot_dir_keeps_hard_links_of_every_kind(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    pairs = make_linked_specials(src)
    store = tmp_path / "store"
    ref = cli(store, "snapshot", str(src)).stdout.strip()
    dest = tmp_path / "out"
    cli(store, "materialize", ref, str(dest))
    assert_linked(dest, pairs)
    assert cli(store, "snapshot", str(dest)).stdout.strip() == ref
