"""The overlay model, driven directly (no mount): POSIX behaviour over a lower snapshot and
an upper state directory, persistence across remounts, and the upper's invariant check.

Every test that opens a read-write overlay closes it at teardown and runs
``fusefs.upper.check`` on its state directory, which must report nothing.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
from ckpt_support import overlay_env

from fusefs.errors import BaseMismatchError, NoBaseError, StateLockedError
from fusefs.inodes import DERIVED_BIT, ROOT_INO, Node
from fusefs.lower import Lower
from fusefs.overlay import RENAME_EXCHANGE, RENAME_NOREPLACE, Overlay
from fusefs.upper import INLINE_MAX, Upper, check, payload_bytes
from store.objects import Store
from store.ref import Ref
from store.snapshot import snapshot
from store.tree import Entry, Kind

CS = 64 << 10  # store chunk size used here: small, so chunk-level copy-up is visible
UID, GID = 1234, 5678


def build_src(root: Path) -> None:
    """The lower tree every test starts from."""
    (root / "dir/sub").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "hello.txt").write_bytes(b"hello world\n")
    (root / "dir/a.txt").write_bytes(b"A" * 100)
    (root / "dir/sub/deep.txt").write_bytes(b"deep\n")
    big = bytes(range(256)) * (5 * CS // 256) + b"tail"  # 5 chunks and 4 bytes
    (root / "big.bin").write_bytes(big)
    (root / "exec.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "exec.sh", 0o755)
    (root / "ro.txt").write_bytes(b"read only\n")
    os.chmod(root / "ro.txt", 0o444)
    os.symlink("hello.txt", root / "link")
    os.link(root / "hello.txt", root / "dir/hard.txt")
    os.setxattr(root / "hello.txt", "user.color", b"blue")
    os.utime(root / "exec.sh", ns=(1_500_000_000_123_456_789, 1_500_000_000_123_456_789))
    os.mkfifo(root / "fifo")


BIG = bytes(range(256)) * (5 * CS // 256) + b"tail"


class Env:
    """A store, a Ref and a state directory; ``mount()`` opens an overlay on them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        src = tmp / "src"
        src.mkdir()
        build_src(src)
        self.src = src
        self.store = Store(tmp / "store", chunk_size=CS)
        self.ref = snapshot(self.store, src)
        self.state = str(tmp / "state")
        self.ov: Overlay | None = None

    def mount(self, ref: Ref | None = None, *, use_ref: bool = True) -> Overlay:
        up = Upper.open(self.state, store_root=self.store.root, chunk_size=CS,
                        ref=(ref or self.ref) if use_ref else None)
        self.ov = Overlay(Lower(self.store, up.base), up, uid=0, gid=0)
        return self.ov

    def remount(self) -> Overlay:
        assert self.ov is not None
        self.ov.close()
        return self.mount()

    def crash(self) -> Overlay:
        """Drop the overlay as kill -9 would: nothing more is written, then reopen."""
        assert self.ov is not None and self.ov.upper is not None
        for n in self.ov.nodes.values():
            if n.fd is not None:
                os.close(n.fd)
        self.ov.upper.close()
        return self.mount()

    def rows(self, table: str) -> int:
        c = sqlite3.connect(os.path.join(self.state, "upper.sqlite"))
        try:
            return int(c.execute(f"SELECT count(*) FROM {table}").fetchone()[0])
        finally:
            c.close()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    yield from overlay_env(Env(tmp_path))


@pytest.fixture
def ov(env: Env) -> Overlay:
    return env.mount()


# -- helpers -------------------------------------------------------------------------------

def node(ov: Overlay, path: str) -> Node:
    """The node at ``path``, looked up component by component as the kernel would (the
    lookups are never forgotten here, like a kernel that caches everything)."""
    n = ov.getattr(ROOT_INO)
    for part in path.split("/"):
        if part:
            found = ov.lookup(n.ino, part.encode())
            if found is None:
                raise FileNotFoundError(errno.ENOENT, "no such entry", path)
            n = found
    return n


def ino(ov: Overlay, path: str) -> int:
    return node(ov, path).ino


def split(path: str) -> tuple[str, bytes]:
    head, _, tail = path.rpartition("/")
    return head, tail.encode()


def write(ov: Overlay, path: str, data: bytes, *, flags: int = os.O_WRONLY | os.O_TRUNC,
          off: int = 0) -> int:
    head, name = split(path)
    try:
        n = node(ov, path)
        fh = ov.open(n.ino, flags)
    except FileNotFoundError:
        fh, n = ov.create(ino(ov, head), name, 0o644, flags | os.O_CREAT, UID, GID)
    ov.write(fh, off, data)
    ov.release(fh)
    return n.ino


def read(ov: Overlay, path: str, off: int = 0, size: int = 1 << 30) -> bytes:
    fh = ov.open(ino(ov, path), os.O_RDONLY)
    try:
        return ov.read(fh, off, size)
    finally:
        ov.release(fh)


def names(ov: Overlay, path: str) -> list[bytes]:
    dh = ov.opendir(ino(ov, path))
    try:
        return sorted(n for n, _node, _c in ov.readdir(dh, 0) if n not in (b".", b".."))
    finally:
        ov.releasedir(dh)


def errno_of(fn, *args, **kw) -> int:  # type: ignore[no-untyped-def]
    try:
        fn(*args, **kw)
    except OSError as e:
        return e.errno or -1
    return 0


# -- reading the lower -----------------------------------------------------------------------

def test_lower_tree_reads_as_snapshotted(env: Env, ov: Overlay) -> None:
    assert names(ov, "") == sorted(p.encode() for p in os.listdir(env.src))
    assert read(ov, "hello.txt") == b"hello world\n"
    assert read(ov, "big.bin") == BIG
    assert read(ov, "big.bin", CS - 3, 10) == BIG[CS - 3:CS + 7]
    assert ov.readlink(ino(ov, "link")) == b"hello.txt"
    ex = node(ov, "exec.sh")
    assert stat.S_IMODE(ex.st_mode) == 0o755 and ex.mtime_ns == 1_500_000_000_123_456_789
    assert node(ov, "fifo").st_mode & stat.S_IFMT(0o170000) == stat.S_IFIFO
    assert ov.getxattr(ino(ov, "hello.txt"), b"user.color") == b"blue"
    # hard links of the snapshot are one inode with two names
    assert ino(ov, "hello.txt") == ino(ov, "dir/hard.txt")
    assert node(ov, "hello.txt").nlink == 2
    # directory link counts: 2 + subdirectories
    assert node(ov, "").nlink == 2 + 2
    assert node(ov, "dir").nlink == 3
    assert node(ov, "dir/sub").nlink == 2


def test_read_only_overlay_refuses_every_change(env: Env) -> None:
    ov = Overlay(Lower(env.store, env.ref))
    root = ROOT_INO
    h = ino(ov, "hello.txt")
    calls = [
        lambda: ov.mkdir(root, b"x", 0o755, 0, 0),
        lambda: ov.create(root, b"x", 0o644, os.O_WRONLY | os.O_CREAT, 0, 0),
        lambda: ov.unlink(root, b"hello.txt"),
        lambda: ov.rmdir(root, b"empty"),
        lambda: ov.rename(root, b"hello.txt", root, b"y"),
        lambda: ov.link(h, root, b"y"),
        lambda: ov.symlink(root, b"y", b"t", 0, 0),
        lambda: ov.mknod(root, b"y", stat.S_IFIFO | 0o644, 0, 0, 0),
        lambda: ov.setattr(h, mode=0o600),
        lambda: ov.setxattr(h, b"user.x", b"1"),
        lambda: ov.removexattr(h, b"user.color"),
        lambda: ov.open(h, os.O_RDWR),
    ]
    for call in calls:
        assert errno_of(call) == errno.EROFS
    assert read(ov, "hello.txt") == b"hello world\n"


def test_inode_numbers_and_ctimes_survive_remount(env: Env, ov: Overlay) -> None:
    paths = ("hello.txt", "dir", "dir/sub/deep.txt", "big.bin")
    numbers = {p: node(ov, p).ino for p in paths}
    write(ov, "dir/new.txt", b"new")
    ov.setattr(ino(ov, "big.bin"), mode=0o600)
    ov.rename(ino(ov, "dir"), b"a.txt", ROOT_INO, b"moved.txt")
    paths += ("dir/new.txt", "moved.txt")
    seen = {p: (node(ov, p).ino, node(ov, p).ctime_ns) for p in paths}
    assert all(seen[p][0] == i for p, i in numbers.items())
    ov2 = env.remount()
    assert {p: (node(ov2, p).ino, node(ov2, p).ctime_ns) for p in paths} == seen
    before = {p: (i, 0) for p, i in numbers.items()}
    # a read-only overlay of the same Ref numbers unchanged lower paths the same way
    ro = Overlay(Lower(env.store, env.ref))
    assert ino(ro, "dir/sub/deep.txt") == before["dir/sub/deep.txt"][0]
    assert ino(ro, "dir/sub/deep.txt") & DERIVED_BIT


# -- files -------------------------------------------------------------------------------------

def test_create_write_read_and_persist(env: Env, ov: Overlay) -> None:
    i = write(ov, "dir/new.txt", b"hello")
    n = ov.getattr(i)
    assert (n.uid, n.gid, n.size, n.nlink) == (UID, GID, 5, 1)
    assert read(ov, "dir/new.txt") == b"hello"
    assert b"new.txt" in names(ov, "dir")
    ov = env.remount()
    assert read(ov, "dir/new.txt") == b"hello"


def test_copy_up_is_per_chunk(env: Env, ov: Overlay) -> None:
    write(ov, "big.bin", b"X", flags=os.O_WRONLY, off=2 * CS + 10)
    n = node(ov, "big.bin")
    assert n.present == {2}
    want = bytearray(BIG)
    want[2 * CS + 10] = ord("X")
    assert read(ov, "big.bin") == bytes(want)
    assert env.ov is not None and env.ov.upper is not None
    path = env.ov.upper.data_path(n.ino)
    assert os.stat(path).st_blocks * 512 <= 2 * CS  # one chunk stored, not the file
    ov = env.remount()
    assert read(ov, "big.bin") == bytes(want)


def test_metadata_changes_of_lower_file_copy_no_data(env: Env, ov: Overlay) -> None:
    i = ino(ov, "big.bin")
    ov.setattr(i, mode=0o600, uid=7, gid=8, atime_ns=11, mtime_ns=22)
    ov.setxattr(i, b"user.k", b"v")
    n = ov.getattr(i)
    assert (n.mode, n.uid, n.gid, n.atime_ns, n.mtime_ns) == (0o600, 7, 8, 11, 22)
    assert not n.has_data and not n.present
    ov = env.remount()
    n = node(ov, "big.bin")
    assert (n.mode, n.uid, n.gid, n.atime_ns, n.mtime_ns) == (0o600, 7, 8, 11, 22)
    assert not n.has_data
    assert read(ov, "big.bin") == BIG


def test_first_write_keeps_mode_xattrs(env: Env, ov: Overlay) -> None:
    write(ov, "exec.sh", b"#!/bin/sh\necho bye\n")
    n = node(ov, "exec.sh")
    assert n.mode == 0o755
    write(ov, "hello.txt", b"HELLO", flags=os.O_WRONLY)
    assert ov.getxattr(ino(ov, "hello.txt"), b"user.color") == b"blue"
    assert read(ov, "dir/hard.txt") == b"HELLO world\n"  # the other name sees it too


def test_truncate_down_and_up_over_lower_data(env: Env, ov: Overlay) -> None:
    i = ino(ov, "big.bin")
    ov.setattr(i, size=CS + 5)
    assert read(ov, "big.bin") == BIG[:CS + 5]
    ov.setattr(i, size=3 * CS)
    assert read(ov, "big.bin") == BIG[:CS + 5] + bytes(3 * CS - CS - 5)
    write(ov, "big.bin", b"Z", flags=os.O_WRONLY, off=CS + 1)
    want = BIG[:CS + 1] + b"Z" + BIG[CS + 2:CS + 5] + bytes(2 * CS - 5)
    assert read(ov, "big.bin") == want
    ov = env.remount()
    assert read(ov, "big.bin") == want


def test_small_files_live_inline_and_spill_when_they_grow(env: Env, ov: Overlay) -> None:
    assert env.ov is not None and env.ov.upper is not None
    up = env.ov.upper
    i = write(ov, "small", b"tiny")
    n = ov.getattr(i)
    assert n.inline == b"tiny" and not n.has_data
    write(ov, "small", b"X", flags=os.O_WRONLY, off=10)  # a hole inside inline content
    assert read(ov, "small") == b"tiny" + bytes(6) + b"X"
    ov.setattr(i, size=100)
    assert read(ov, "small") == b"tiny" + bytes(6) + b"X" + bytes(89)
    big = bytes(range(256)) * (INLINE_MAX // 128)
    write(ov, "small", big, flags=os.O_WRONLY, off=50)
    assert n.inline is None and os.path.exists(up.data_path(i))
    want = (b"tiny" + bytes(6) + b"X" + bytes(39) + big)
    assert read(ov, "small") == want
    write(ov, "lowertrunc", b"")  # a lower file truncated to 0 becomes inline too
    write(ov, "hello.txt", b"rewritten")
    assert ov.getattr(ino(ov, "hello.txt")).inline == b"rewritten"
    ov.commit()
    ov = env.crash()
    assert read(ov, "small") == want
    assert read(ov, "hello.txt") == b"rewritten" and read(ov, "dir/hard.txt") == b"rewritten"


def test_sparse_file_holes_read_zeros(env: Env, ov: Overlay) -> None:
    write(ov, "sparse", b"end", off=10 * CS + 7)
    assert node(ov, "sparse").size == 10 * CS + 10
    assert read(ov, "sparse") == bytes(10 * CS + 7) + b"end"
    ov = env.remount()
    assert read(ov, "sparse", 5 * CS, 4) == bytes(4)


def test_open_flags_excl_trunc_append(env: Env, ov: Overlay) -> None:
    root = ROOT_INO
    assert errno_of(ov.create, root, b"hello.txt", 0o644,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0, 0) == errno.EEXIST
    fh, _n = ov.create(root, b"hello.txt", 0o644, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0, 0)
    ov.release(fh)
    assert read(ov, "hello.txt") == b""
    a = ov.open(ino(ov, "dir/a.txt"), os.O_WRONLY | os.O_APPEND)
    b = ov.open(ino(ov, "dir/a.txt"), os.O_WRONLY | os.O_APPEND)
    ov.write(a, 0, b"1")
    ov.write(b, 0, b"2")
    ov.release(a)
    ov.release(b)
    assert read(ov, "dir/a.txt") == b"A" * 100 + b"12"


def test_unlink_while_open_then_free(env: Env, ov: Overlay) -> None:
    i = write(ov, "dir/tmp", b"data")
    ov.lookup(ino(ov, "dir"), b"tmp")  # the kernel knows it
    fh = ov.open(i, os.O_RDWR)
    ov.unlink(ino(ov, "dir"), b"tmp")
    assert ov.getattr(i).nlink == 0
    ov.write(fh, 4, b"more")
    assert ov.read(fh, 0, 100) == b"datamore"
    ov.commit()
    ov.release(fh)
    assert i in ov.nodes  # still looked up (by create and by lookup)
    ov.forget(i, 1)
    assert i in ov.nodes
    ov.forget(i, 1)
    assert i not in ov.nodes
    ov.commit()
    assert env.ov is not None and env.ov.upper is not None
    assert not os.path.exists(env.ov.upper.data_path(i))
    # the emptied directory can go
    ov.unlink(ino(ov, "dir"), b"a.txt")
    ov.unlink(ino(ov, "dir"), b"hard.txt")
    ov.unlink(ino(ov, "dir/sub"), b"deep.txt")
    ov.rmdir(ino(ov, "dir"), b"sub")
    ov.rmdir(ROOT_INO, b"dir")
    assert b"dir" not in names(ov, "")


def test_unlinked_lower_file_stays_readable_through_handle(env: Env, ov: Overlay) -> None:
    i = ino(ov, "big.bin")
    ov.lookup(ROOT_INO, b"big.bin")
    fh = ov.open(i, os.O_RDONLY)
    ov.unlink(ROOT_INO, b"big.bin")
    assert ov.read(fh, 0, 1 << 30) == BIG
    ov.release(fh)
    ov.forget(i, 1)
    assert errno_of(node, ov, "big.bin") == errno.ENOENT


# -- names -------------------------------------------------------------------------------------

def test_rename_over_noreplace_exchange(env: Env, ov: Overlay) -> None:
    root = ROOT_INO
    h = ino(ov, "hello.txt")
    ov.rename(root, b"exec.sh", root, b"hello.txt")
    assert read(ov, "hello.txt").startswith(b"#!/bin/sh")
    assert ov.getattr(h).nlink == 1 and read(ov, "dir/hard.txt") == b"hello world\n"
    assert errno_of(ov.rename, root, b"ro.txt", root, b"hello.txt",
                    RENAME_NOREPLACE) == errno.EEXIST
    ov.rename(root, b"ro.txt", root, b"hello.txt", RENAME_EXCHANGE)
    assert read(ov, "hello.txt") == b"read only\n"
    assert read(ov, "ro.txt").startswith(b"#!/bin/sh")
    assert errno_of(ov.rename, root, b"ro.txt", root, b"nothere",
                    RENAME_EXCHANGE) == errno.ENOENT
    ov.rename(root, b"dir", root, b"empty", RENAME_EXCHANGE)
    assert names(ov, "empty") == [b"a.txt", b"hard.txt", b"sub"]
    assert names(ov, "dir") == []
    assert errno_of(ov.rename, root, b"empty", root, b"hello.txt") == errno.ENOTDIR
    assert errno_of(ov.rename, root, b"hello.txt", root, b"dir") == errno.EISDIR
    assert errno_of(ov.rename, root, b"dir", root, b"empty") == errno.ENOTEMPTY
    assert errno_of(ov.rename, root, b"empty", ino(ov, "empty/sub"), b"x") == errno.EINVAL
    ov.rename(root, b"empty", root, b"dir")  # over an empty directory
    assert names(ov, "dir") == [b"a.txt", b"hard.txt", b"sub"]
    ov = env.remount()
    assert names(ov, "dir") == [b"a.txt", b"hard.txt", b"sub"]
    assert read(ov, "hello.txt") == b"read only\n"


def test_rename_of_big_lower_directory_writes_constant_rows(tmp_path: Path) -> None:
    st = Store(tmp_path / "store", chunk_size=CS)
    with st.writer() as w:  # 200 directories of 100 files each, written as trees directly
        files = [Entry(f"f{j}".encode(), Kind.FILE, 0o644, 0, 0, 0)
                 for j in range(100)]
        leaf = w.put_tree(files)
        big = w.put_tree([Entry(f"d{i:03d}".encode(), Kind.DIR, 0o755, 0, 0, 0,
                                tree_id=leaf) for i in range(200)])
        ref = Ref(w.put_tree([Entry(b"big", Kind.DIR, 0o755, 0, 0, 0, tree_id=big)]))
        w.commit()
    state = str(tmp_path / "state")
    ov = Overlay(Lower(st, ref), Upper.open(state, store_root=st.root, chunk_size=CS, ref=ref))
    before = ino(ov, "big/d150/f7")
    ov.mkdir(ROOT_INO, b"to", 0o755, 0, 0)
    ov.rename(ROOT_INO, b"big", ino(ov, "to"), b"moved")
    ov.close()
    c = sqlite3.connect(os.path.join(state, "upper.sqlite"))
    counts = {t: c.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
              for t in ("inodes", "dentries")}
    c.close()
    # root, "to" and the moved dir; dentries: "to", "moved" and the whiteout of "big"
    assert counts == {"inodes": 3, "dentries": 3}
    ov = Overlay(Lower(st, ref), Upper.open(state, store_root=st.root, chunk_size=CS, ref=ref))
    assert len(names(ov, "to/moved")) == 200
    assert ino(ov, "to/moved/d150/f7") == before
    assert errno_of(node, ov, "big") == errno.ENOENT
    ov.close()
    assert check(state, st) == []


def test_hard_link_to_lower_file(env: Env, ov: Overlay) -> None:
    i = ino(ov, "ro.txt")
    ov.link(i, ino(ov, "dir"), b"second")
    assert ov.getattr(i).nlink == 2 and ino(ov, "dir/second") == i
    ov = env.remount()
    assert ino(ov, "dir/second") == i and ov.getattr(i).nlink == 2
    ov.unlink(ROOT_INO, b"ro.txt")
    assert ov.getattr(i).nlink == 1
    assert read(ov, "dir/second") == b"read only\n"
    assert errno_of(ov.link, ino(ov, "dir"), ROOT_INO, b"d") == errno.EPERM
    assert errno_of(ov.link, i, ROOT_INO, b"hello.txt") == errno.EEXIST


def test_special_files(env: Env, ov: Overlay) -> None:
    root = ROOT_INO
    f = ov.mknod(root, b"p", stat.S_IFIFO | 0o640, 0, UID, GID)
    s = ov.mknod(root, b"s", stat.S_IFSOCK | 0o600, 0, UID, GID)
    assert stat.S_ISFIFO(f.st_mode) and stat.S_ISSOCK(s.st_mode)
    c = ov.mknod(root, b"c", stat.S_IFCHR | 0o600, 0x0103, UID, GID)
    b = ov.mknod(root, b"b", stat.S_IFBLK | 0o640, 0x0801, UID, GID)
    assert stat.S_ISCHR(c.st_mode) and c.rdev == 0x0103
    assert stat.S_ISBLK(b.st_mode) and b.rdev == 0x0801
    ln = ov.symlink(root, b"sl", b"../somewhere", UID, GID)
    assert ov.readlink(ln.ino) == b"../somewhere" and ln.size == 12
    ov = env.remount()
    assert stat.S_ISFIFO(node(ov, "p").st_mode)
    assert ov.readlink(ino(ov, "sl")) == b"../somewhere"
    assert stat.S_ISCHR(node(ov, "c").st_mode) and node(ov, "c").rdev == 0x0103
    assert stat.S_ISBLK(node(ov, "b").st_mode) and node(ov, "b").rdev == 0x0801


def test_whiteouts_and_opaque_directories(env: Env, ov: Overlay) -> None:
    d = ino(ov, "dir")
    assert errno_of(ov.rmdir, ROOT_INO, b"dir") == errno.ENOTEMPTY
    for name in (b"a.txt", b"hard.txt"):
        ov.unlink(d, name)
    ov.unlink(ino(ov, "dir/sub"), b"deep.txt")
    ov.rmdir(d, b"sub")
    assert names(ov, "dir") == []
    ov.rmdir(ROOT_INO, b"dir")
    ov.mkdir(ROOT_INO, b"dir", 0o700, UID, GID)
    assert names(ov, "dir") == []  # opaque: nothing of the lower dir shows through
    assert errno_of(node, ov, "dir/a.txt") == errno.ENOENT
    assert node(ov, "").nlink == 4
    ov.unlink(ROOT_INO, b"hello.txt")
    write(ov, "hello.txt", b"new one")
    ov = env.remount()
    assert names(ov, "dir") == [] and read(ov, "hello.txt") == b"new one"
    assert node(ov, "hello.txt").nlink == 1


def test_readdir_cookies_stable_while_deleting(env: Env, ov: Overlay) -> None:
    d = ino(ov, "dir")
    for k in range(50):
        write(ov, f"dir/n{k:02d}", b"")
    expected = set(names(ov, "dir"))
    dh = ov.opendir(d)
    seen: list[bytes] = []
    cookie = 0
    while True:
        batch = []
        for name, _node, c in ov.readdir(dh, cookie):
            batch.append((name, c))
            if len(batch) == 7:
                break
        if not batch:
            break
        for name, _c in batch:
            if name not in (b".", b".."):
                seen.append(name)
                node = ov.lookup(d, name)
                assert node is not None
                if node.is_dir:
                    for sub in names(ov, f"dir/{name.decode()}"):
                        ov.unlink(node.ino, sub)
                    ov.rmdir(d, name)
                else:
                    ov.unlink(d, name)
            if name == b"n10":
                write(ov, "dir/late", b"")  # an entry added during the listing
        cookie = batch[-1][1]
    ov.releasedir(dh)
    assert sorted(n for n in seen if n != b"late") == sorted(expected)
    assert len(seen) == len(set(seen))
    assert names(ov, "dir") in ([], [b"late"])


def test_directory_link_counts(env: Env, ov: Overlay) -> None:
    root = ROOT_INO
    ov.mkdir(ino(ov, "dir"), b"x", 0o755, 0, 0)
    assert node(ov, "dir").nlink == 4
    ov.rename(ino(ov, "dir"), b"sub", root, b"sub2")
    assert node(ov, "dir").nlink == 3 and node(ov, "").nlink == 5
    ov.rmdir(ino(ov, "dir"), b"x")
    assert node(ov, "dir").nlink == 2
    ov = env.remount()
    assert node(ov, "dir").nlink == 2 and node(ov, "").nlink == 5


def test_xattrs(env: Env, ov: Overlay) -> None:
    i = ino(ov, "hello.txt")
    ov.setxattr(i, b"user.size", b"L")
    assert ov.listxattr(i) == [b"user.color", b"user.size"]
    ov.removexattr(i, b"user.color")
    assert errno_of(ov.getxattr, i, b"user.color") == errno.ENODATA
    assert errno_of(ov.removexattr, i, b"user.nope") == errno.ENODATA
    assert errno_of(ov.setxattr, i, b"trusted.x", b"1") == errno.ENOTSUP
    assert errno_of(ov.setxattr, i, b"user.size", b"1", 1) == errno.EEXIST
    assert errno_of(ov.setxattr, i, b"user.new", b"1", 2) == errno.ENODATA
    n = write(ov, "f", b"")
    ov.setxattr(n, b"user.a", b"\x00\xff")
    ov = env.remount()
    assert ov.listxattr(ino(ov, "hello.txt")) == [b"user.size"]
    assert ov.getxattr(ino(ov, "f"), b"user.a") == b"\x00\xff"


def test_new_inodes_take_caller_and_setgid_group(env: Env, ov: Overlay) -> None:
    d = ov.mkdir(ROOT_INO, b"g", 0o2775, 10, 20)
    f = ov.mknod(d.ino, b"f", stat.S_IFREG | 0o644, 0, 30, 40)
    sd = ov.mkdir(d.ino, b"sd", 0o755, 30, 40)
    assert (f.uid, f.gid) == (30, 20)
    assert (sd.uid, sd.gid) == (30, 20) and sd.mode & stat.S_ISGID


def test_setuid_bits_are_left_to_the_kernel(env: Env, ov: Overlay) -> None:
    # The kernel clears S_ISUID/S_ISGID for writers without CAP_FSETID by sending a mode
    # change itself; the model keeps what it is told (a root writer keeps them).
    i = write(ov, "suid", b"x")
    ov.setattr(i, mode=0o6755)
    ov.setattr(i, uid=99)
    write(ov, "suid", b"y", flags=os.O_WRONLY)
    ov.setattr(i, size=0)
    assert ov.getattr(i).mode == 0o6755
    ov.setattr(i, uid=5, mode=0o755)  # what the kernel sends for an unprivileged chown
    assert ov.getattr(i).mode == 0o755


def test_names_too_long_and_existing(env: Env, ov: Overlay) -> None:
    assert errno_of(ov.mkdir, ROOT_INO, b"x" * 256, 0o755, 0, 0) == errno.ENAMETOOLONG
    assert errno_of(ov.mkdir, ROOT_INO, b"dir", 0o755, 0, 0) == errno.EEXIST
    assert errno_of(ov.unlink, ROOT_INO, b"dir") == errno.EISDIR
    assert errno_of(ov.rmdir, ROOT_INO, b"hello.txt") == errno.ENOTDIR
    assert errno_of(ov.unlink, ROOT_INO, b"nope") == errno.ENOENT


def test_lookup_counts_and_forget(env: Env, ov: Overlay) -> None:
    n = ov.lookup(ROOT_INO, b"hello.txt")
    assert n is not None and n.nlookup == 1
    assert ov.lookup(ROOT_INO, b"nope") is None
    ov.forget(n.ino, 1)
    assert n.ino not in ov.nodes  # an unchanged lower inode is dropped, then re-derived
    assert ov.lookup(ROOT_INO, b"hello.txt").ino == n.ino  # type: ignore[union-attr]


# -- the state directory --------------------------------------------------------------------

def test_recorded_base_lock_and_mismatch(env: Env, ov: Overlay) -> None:
    with pytest.raises(StateLockedError):
        Upper.open(env.state, store_root=env.store.root, chunk_size=CS, ref=env.ref)
    write(ov, "x", b"1")
    ov.close()
    other = env.tmp / "other"
    other.mkdir()
    (other / "f").write_bytes(b"other")
    other_ref = snapshot(env.store, other)
    with pytest.raises(BaseMismatchError) as ei:
        Upper.open(env.state, store_root=env.store.root, chunk_size=CS, ref=other_ref)
    assert ei.value.recorded == str(env.ref) and ei.value.requested == str(other_ref)
    ov = env.mount(use_ref=False)
    assert read(ov, "x") == b"1"
    ov.close()
    with pytest.raises(NoBaseError):
        Upper.open(str(env.tmp / "fresh"), store_root=env.store.root, chunk_size=CS, ref=None)


def test_crash_keeps_what_was_committed(env: Env, ov: Overlay) -> None:
    write(ov, "kept", b"synced")
    ov.mkdir(ROOT_INO, b"kept-dir", 0o755, 0, 0)
    ov.commit(durable=True)
    write(ov, "lost", b"not synced")
    ov.unlink(ROOT_INO, b"kept")  # not committed: the file must come back intact
    ov.lookup(ROOT_INO, b"hello.txt")
    ov = env.crash()
    assert read(ov, "kept") == b"synced"
    assert b"kept-dir" in names(ov, "")
    assert errno_of(node, ov, "lost") == errno.ENOENT
    assert check(env.state, env.store) == []


def test_crash_with_unlinked_open_file_is_recovered(env: Env, ov: Overlay) -> None:
    i = write(ov, "t", b"data")
    fh = ov.open(i, os.O_RDWR)
    ov.unlink(ROOT_INO, b"t")
    ov.commit(durable=True)
    assert env.rows("inodes") >= 2  # the unlinked inode's row waits for its release
    ov.release(fh)
    ov = env.crash()
    assert i not in ov.nodes
    assert env.ov is not None and env.ov.upper is not None
    assert not os.path.exists(env.ov.upper.data_path(i))


# -- the check names each broken invariant -----------------------------------------------

BREAKERS = {
    "meta": "DELETE FROM meta WHERE key='next_cookie'",
    "root": "UPDATE inodes SET kind=2, lower_tree=NULL WHERE ino=1",
    "ino-range": "UPDATE meta SET value='2' WHERE key='next_ino'",
    "kind-fields": "UPDATE inodes SET target=x'41' WHERE kind=1",
    "dentry-parent": "INSERT INTO dentries VALUES (999, x'7a', 0, 0)",
    "dentry-target": "UPDATE dentries SET ino=77777 WHERE ino != 0",
    "whiteout-lower": "INSERT INTO dentries VALUES (1, x'6e6f6e65', 0, 0)",
    "dir-one-name": "INSERT INTO dentries SELECT 1, x'7a7a', ino, 999 FROM inodes "
                    "WHERE kind=1 AND ino != 1 LIMIT 1",
    "dir-reachable": "UPDATE inodes SET parent=ino WHERE kind=1 AND ino != 1",
    "nlink-file": "UPDATE inodes SET nlink=nlink+1 WHERE kind=2",
    "nlink-dir": "UPDATE inodes SET nlink=nlink+1 WHERE kind=1",
    "cookie": "UPDATE dentries SET cookie=1 WHERE ino != 0",
    "xattr-owner": "INSERT INTO xattrs VALUES (424242, x'757365722e61', x'00')",
    "present-range": "UPDATE inodes SET present=x'ff' WHERE kind=2",
    "origin-unique": "INSERT INTO pins VALUES (x'01', 5, 0), (x'02', 5, 0)",
    "closure": "DELETE FROM inodes WHERE ino=1",
    "inline": "UPDATE inodes SET inline=x'00' WHERE lower_len > 0",
}


@pytest.mark.parametrize("name", sorted(BREAKERS) + ["data-owner", "data-size"])
def test_check_names_each_broken_invariant(env: Env, ov: Overlay, name: str) -> None:
    d = ov.mkdir(ROOT_INO, b"newdir", 0o755, 0, 0)
    ov.mkdir(d.ino, b"inner", 0o755, 0, 0)
    f = write(ov, "newdir/f", b"c" * (INLINE_MAX + 1))  # big enough for a data file
    write(ov, "newdir/small", b"inline")
    ov.setattr(ino(ov, "big.bin"), mode=0o600)  # a row with lower content
    ov.unlink(ROOT_INO, b"hello.txt")  # a whiteout
    ov.close()
    assert check(env.state, env.store) == []
    if name in BREAKERS:
        c = sqlite3.connect(os.path.join(env.state, "upper.sqlite"))
        c.execute(BREAKERS[name])
        c.commit()
        c.close()
    elif name == "data-owner":
        os.makedirs(os.path.join(env.state, "data", "07"), exist_ok=True)
        Path(env.state, "data", "07", "7").write_bytes(b"stray")
    else:
        Path(env.state, "data", f"{f & 0xFF:02x}", str(f)).write_bytes(b"x" * (INLINE_MAX + 9))
    found = {p.name for p in check(env.state, env.store)}
    assert name in found, found
    os.rename(env.state, env.state + ".broken")  # keep the fixture's final check quiet


def test_st_blocks_of_a_small_file_follow_an_overwrite_and_a_truncate(env: Env,
                                                                      ov: Overlay) -> None:
    """A small file made in the mount keeps its content in memory (inline); its st_blocks
    counts the pages that hold a non-zero byte and is kept between replies, so an
    overwrite that changes neither size nor times (same clock tick) and a truncate must
    both show in it."""
    ov.clock = lambda: 1_700_000_000_000_000_000
    i = write(ov, "small", bytes(3 * 4096))  # three pages of zeros
    n = ov.getattr(i)
    assert n.inline is not None
    assert ov.blocks(n) == 0
    write(ov, "small", b"x", flags=os.O_WRONLY, off=4096)
    assert n.size == 3 * 4096 and n.inline is not None
    assert ov.blocks(n) == 4096 // 512
    write(ov, "small", b"y", flags=os.O_WRONLY, off=2 * 4096)
    assert ov.blocks(n) == 2 * 4096 // 512
    ov.setattr(i, size=4096 + 1)
    assert ov.blocks(n) == 4096 // 512
    ov.setattr(i, size=4096)
    assert ov.blocks(n) == 0
    assert ov.blocks(env.remount().getattr(i)) == 0


def test_st_blocks_follow_a_write_that_changes_no_size_or_time(env: Env, ov: Overlay) -> None:
    """st_blocks shows a write into a hole of a data file even when the file's size and
    times stay the same (same clock tick): the overlay keeps the data file's count between
    replies and must stat it again after every write."""
    ov.clock = lambda: 1_700_000_000_000_000_000
    off = max(4 * INLINE_MAX, 1 << 20)
    i = write(ov, "holey", b"end", off=off)  # far beyond the inline limit: a data file
    n = ov.getattr(i)
    before = ov.blocks(n)
    assert ov.blocks(n) == before
    write(ov, "holey", b"x" * (1 << 16), flags=os.O_WRONLY, off=0)
    assert n.size == off + 3
    assert ov.blocks(n) >= before + (1 << 16) // 512


# -- the write-behind batch's size bound ----------------------------------------------------

def test_the_pending_bound_covers_the_spill_payload_of_every_kind_of_change(
        env: Env, ov: Overlay) -> None:
    """``pending_bytes`` bounds the spill payload of the batch ``collect`` takes, and
    ``change_bytes`` (plus the inline bytes and xattrs a change writes) bounds what each
    change adds to it: the mount commits on them before a full disk could leave more
    unwritten than its spill takes."""
    assert ov.upper is not None
    state = env.state
    ov.commit()

    def step(more: int, change: Callable[..., object], *args: object) -> None:
        before = ov.pending_bytes
        change(*args)
        grew = ov.pending_bytes - before
        assert grew <= more, (change.__name__, grew, more)

    root = ROOT_INO
    for i in range(3):  # check the bound on batches made of different changes
        d = node(ov, "dir/sub")
        step(ov.change_bytes(d.ino, b"x"), ov.mkdir, d.ino, b"n%d" % i, 0o755, 0, 0)
        fd, n = ov.create(root, b"f%d" % i, 0o644, os.O_RDWR, 0, 0)
        data = os.urandom(3000 + 5000 * i)
        step(ov.change_bytes(n.ino) + len(data), ov.write, fd, 0, data)
        step(ov.change_bytes(n.ino) + 10, ov.write, fd, 1000, data[:10])
        ov.release(fd)
        big = node(ov, "big.bin")
        step(ov.change_bytes(big.ino), partial(ov.setattr, mode=0o600), big.ino)
        h = node(ov, "hello.txt")
        step(ov.change_bytes(h.ino) + 7 + 300, ov.setxattr, h.ino, b"user.k%d" % i,
             b"v" * 300)
        step(ov.change_bytes(root, b"l") + 2000, ov.symlink, root, b"l%d" % i, b"t" * 2000,
             0, 0)
        step(ov.change_bytes(h.ino) + ov.change_bytes(root, b"h"), ov.link, h.ino, root,
             b"h%d" % i)
        step(ov.change_bytes(root, b"f%d" % i) + ov.change_bytes(d.ino, b"g%d" % i),
             ov.rename, root, b"f%d" % i, d.ino, b"g%d" % i, 0)
        step(ov.change_bytes(d.ino, b"g%d" % i), ov.unlink, d.ino, b"g%d" % i)
        bound = ov.pending_bytes
        assert payload_bytes([ov.collect()], state) <= bound
        ov.commit()

    # Small files (what an untar makes): the bound stays close to the payload, so the
    # mount commits about once per spill slot of them, not more often.
    for i in range(500):
        fd, _ = ov.create(root, b"s%d" % i, 0o644, os.O_WRONLY, 0, 0)
        ov.write(fd, 0, os.urandom(3000))
        ov.release(fd)
    bound = ov.pending_bytes
    payload = payload_bytes([ov.collect()], state)
    assert payload <= bound <= payload * 5 // 4, (payload, bound)
    ov.commit()
