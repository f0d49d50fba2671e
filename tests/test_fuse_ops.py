"""The namespace half of a session mount's POSIX surface (CONTRACT 2.2): lookup, getattr,
setattr, mknod, mkdir, symlink, unlink, rmdir, rename (all flags) and link.

All tests share one read-write mount; each gets its own untouched copy of the standard lower
tree (``lower`` fixture, see ``fusehelpers.build_lower``) so copy-up paths are exercised on
files that really come from the snapshot.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import fusehelpers as fh
import pytest
from conftest import SELFTEST
from fusehelpers import BIG_SIZE, MTIME_NS, errno_of, pattern, renameat2

# -- lookup, getattr, readlink, read, readdir of lower content --------------------------------


def test_lower_tree_is_served_exactly(lower: Path, mod_lower_ref: str) -> None:
    names = sorted(os.listdir(lower))
    assert names == sorted(["exec.sh", "ro.txt", "plain.txt", "big.bin", "link1", "link2",
                            "sym", "fifo", "empty", "dir"])
    st = os.stat(lower / "exec.sh")
    assert stat.S_IMODE(st.st_mode) == 0o755 and stat.S_ISREG(st.st_mode)
    assert st.st_mtime_ns == MTIME_NS
    assert stat.S_IMODE(os.stat(lower / "ro.txt").st_mode) == 0o444
    assert (lower / "plain.txt").read_bytes() == b"hello world\n"
    assert os.stat(lower / "plain.txt").st_mtime_ns == MTIME_NS
    assert (lower / "big.bin").read_bytes() == pattern(BIG_SIZE)
    assert os.stat(lower / "big.bin").st_size == BIG_SIZE
    assert os.readlink(lower / "sym") == "plain.txt"
    assert stat.S_ISLNK(os.lstat(lower / "sym").st_mode)
    assert stat.S_ISFIFO(os.lstat(lower / "fifo").st_mode)
    assert os.listdir(lower / "empty") == []
    assert (lower / "dir" / "sub" / "deeper" / "c.txt").read_bytes() == b"c\n"
    assert os.getxattr(lower / "exec.sh", "user.note") == b"exec"


def test_hard_links_in_lower_share_inode_and_nlink(lower: Path) -> None:
    a, b = os.stat(lower / "link1"), os.stat(lower / "link2")
    assert a.st_ino == b.st_ino
    assert a.st_nlink == b.st_nlink == 2


def test_inode_numbers_distinct_and_stable(lower: Path) -> None:
    paths = [lower / p for p in fh.walk_tree(lower)]
    inos = {os.lstat(p).st_ino for p in paths if p.name != "link2"}
    assert len(inos) == len(paths) - 1
    again = {os.lstat(p).st_ino for p in paths if p.name != "link2"}
    assert inos == again


def test_directory_nlink_counts_subdirectories(lower: Path) -> None:
    assert os.stat(lower / "dir").st_nlink == 3  # ., .. and sub
    assert os.stat(lower / "empty").st_nlink == 2
    os.mkdir(lower / "dir" / "new")
    assert os.stat(lower / "dir").st_nlink == 4
    os.rmdir(lower / "dir" / "new")
    assert os.stat(lower / "dir").st_nlink == 3


def test_lookup_of_missing_name_is_enoent_and_creating_it_is_seen(lower: Path) -> None:
    p = lower / "dir" / "later.txt"
    assert not p.exists()  # a cached negative lookup must not hide what follows
    p.write_bytes(b"x")
    assert p.read_bytes() == b"x"
    assert "later.txt" in os.listdir(lower / "dir")


# -- setattr ---------------------------------------------------------------------------------

def test_chmod_of_lower_file_keeps_content(lower: Path) -> None:
    os.chmod(lower / "big.bin", 0o600)
    st = os.stat(lower / "big.bin")
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_size == BIG_SIZE and st.st_mtime_ns == MTIME_NS
    assert (lower / "big.bin").read_bytes() == pattern(BIG_SIZE)
    os.chmod(lower / "dir", 0o700)
    assert stat.S_IMODE(os.stat(lower / "dir").st_mode) == 0o700
    assert (lower / "dir" / "a.txt").read_bytes() == b"a\n"


@pytest.mark.skipif(not fh.AS_ROOT, reason="giving a file to another owner needs root")
def test_chown_of_lower_file(lower: Path) -> None:
    os.chown(lower / "plain.txt", 1234, 5678)
    st = os.stat(lower / "plain.txt")
    assert (st.st_uid, st.st_gid) == (1234, 5678)
    assert (lower / "plain.txt").read_bytes() == b"hello world\n"
    os.chown(lower / "sym", 4321, 8765, follow_symlinks=False)
    st = os.lstat(lower / "sym")
    assert (st.st_uid, st.st_gid) == (4321, 8765)
    assert os.stat(lower / "plain.txt").st_uid == 1234


def test_chmod_changes_ctime_not_mtime(lower: Path) -> None:
    before = os.stat(lower / "plain.txt")
    os.chmod(lower / "plain.txt", 0o640)
    after = os.stat(lower / "plain.txt")
    assert after.st_mtime_ns == before.st_mtime_ns
    assert after.st_ctime_ns >= before.st_ctime_ns


@pytest.mark.parametrize("name", ["plain.txt", "new.txt", "dir", "sym"])
def test_utimens_has_ns_precision(lower: Path, name: str) -> None:
    p = lower / name
    if name == "new.txt":
        p.write_bytes(b"n")
    atime, mtime = 1_234_567_890_987_654_321, 1_111_111_111_222_333_444
    follow = name != "sym"
    os.utime(p, ns=(atime, mtime), follow_symlinks=follow)
    st = os.stat(p, follow_symlinks=follow)
    assert st.st_mtime_ns == mtime
    assert st.st_atime_ns == atime


def test_utime_now(lower: Path) -> None:
    """utime(path, None) sets both times to the current time (UTIME_NOW)."""
    t0 = time.time_ns()
    os.utime(lower / "plain.txt")
    st = os.stat(lower / "plain.txt")
    # the kernel's clock is coarse (one jiffy); allow for that, never the snapshot's mtime
    assert st.st_mtime_ns >= t0 - 50_000_000 and st.st_atime_ns >= t0 - 50_000_000
    assert st.st_mtime_ns <= time.time_ns()


def test_truncate_down_then_up_over_lower_data_reads_zeros(lower: Path) -> None:
    p = lower / "big.bin"
    want = bytearray(pattern(BIG_SIZE))
    os.truncate(p, 1_500_000)
    del want[1_500_000:]
    assert p.read_bytes() == bytes(want)
    os.truncate(p, 5 << 20)
    want += bytes((5 << 20) - len(want))
    assert os.stat(p).st_size == 5 << 20
    assert p.read_bytes() == bytes(want)
    os.truncate(p, 100)
    os.truncate(p, 2 << 20)
    assert p.read_bytes() == bytes(want[:100]) + bytes((2 << 20) - 100)


def test_truncate_through_open_handle(lower: Path) -> None:
    with open(lower / "plain.txt", "r+b") as f:
        f.truncate(5)
        f.seek(0)
        assert f.read() == b"hello"
        f.truncate(8)
        f.seek(0)
        assert f.read() == b"hello\0\0\0"
    assert (lower / "plain.txt").read_bytes() == b"hello\0\0\0"


def test_truncate_to_zero_then_rewrite_lower_file(lower: Path) -> None:
    p = lower / "dir" / "a.txt"
    os.truncate(p, 0)
    assert p.read_bytes() == b""
    p.write_bytes(b"new content")
    assert p.read_bytes() == b"new content"


# -- mknod, mkdir, symlink ---------------------------------------------------------------------

def test_mkfifo_works_as_a_fifo(lower: Path) -> None:
    p = lower / "newfifo"
    os.mkfifo(p, 0o640)
    st = os.lstat(p)
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    r = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    w = os.open(p, os.O_WRONLY)
    try:
        os.write(w, b"through the pipe")
        assert os.read(r, 100) == b"through the pipe"
    finally:
        os.close(w)
        os.close(r)


def test_lower_fifo_is_a_fifo(lower: Path) -> None:
    r = os.open(lower / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    w = os.open(lower / "fifo", os.O_WRONLY)
    try:
        os.write(w, b"x")
        assert os.read(r, 10) == b"x"
    finally:
        os.close(w)
        os.close(r)


def test_unix_socket_bind_and_connect(lower: Path) -> None:
    p = lower / "sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(os.fspath(p))
        srv.listen(1)
        assert stat.S_ISSOCK(os.lstat(p).st_mode)
        cli.connect(os.fspath(p))
        conn, _ = srv.accept()
        cli.sendall(b"ping")
        assert conn.recv(10) == b"ping"
        conn.close()
    finally:
        cli.close()
        srv.close()
    os.unlink(p)
    assert not os.path.lexists(p)


@pytest.mark.parametrize("kind", [stat.S_IFCHR, stat.S_IFBLK])
def test_device_nodes_are_kept_as_metadata(lower: Path, kind: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod of a device needs root")
    p = lower / f"dev{kind}"
    os.mknod(p, kind | 0o640, os.makedev(1, 3))
    st = os.lstat(p)
    assert stat.S_IFMT(st.st_mode) == kind and stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_rdev == os.makedev(1, 3) and st.st_size == 0
    if not SELFTEST:  # the mount is nodev: the device cannot be opened through it
        assert errno_of(os.open, p, os.O_RDONLY) == errno.EACCES
    os.unlink(p)
    assert not os.path.lexists(p)


def test_mknod_regular_file(lower: Path) -> None:
    os.mknod(lower / "viamknod", stat.S_IFREG | 0o604)
    st = os.stat(lower / "viamknod")
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o604 and st.st_size == 0


def test_mkdir_modes_and_errors(lower: Path) -> None:
    os.mkdir(lower / "d1", 0o750)
    assert stat.S_IMODE(os.stat(lower / "d1").st_mode) == 0o750
    assert errno_of(os.mkdir, lower / "d1") == errno.EEXIST
    assert errno_of(os.mkdir, lower / "dir") == errno.EEXIST
    assert errno_of(os.mkdir, lower / "plain.txt") == errno.EEXIST
    assert errno_of(os.mkdir, lower / "nope" / "x") == errno.ENOENT
    assert errno_of(os.mkdir, lower / "plain.txt" / "x") == errno.ENOTDIR


def test_symlink_create_and_read(lower: Path) -> None:
    os.symlink("dir/sub/b.txt", lower / "s2")
    assert os.readlink(lower / "s2") == "dir/sub/b.txt"
    assert (lower / "s2").read_bytes() == b"b\n"
    target = "x" * 1000 + "/" + "y" * 2000
    os.symlink(target, lower / "long")
    assert os.readlink(lower / "long") == target
    assert os.lstat(lower / "long").st_size == len(target)
    assert errno_of(os.symlink, "t", lower / "plain.txt") == errno.EEXIST
    os.symlink("nowhere", lower / "dangling")
    assert not (lower / "dangling").exists() and os.path.lexists(lower / "dangling")


# -- unlink and rmdir, whiteouts, opaque directories -------------------------------------------

def test_unlink_lower_file_then_recreate(lower: Path) -> None:
    os.unlink(lower / "plain.txt")
    assert not os.path.lexists(lower / "plain.txt")
    assert "plain.txt" not in os.listdir(lower)
    assert errno_of(os.unlink, lower / "plain.txt") == errno.ENOENT
    (lower / "plain.txt").write_bytes(b"second life")
    assert (lower / "plain.txt").read_bytes() == b"second life"
    assert os.listdir(lower).count("plain.txt") == 1


def test_unlink_errors(lower: Path) -> None:
    assert errno_of(os.unlink, lower / "dir") in (errno.EISDIR, errno.EPERM)
    assert errno_of(os.rmdir, lower / "plain.txt") == errno.ENOTDIR
    assert errno_of(os.rmdir, lower / "dir") == errno.ENOTEMPTY


def test_rmdir_of_emptied_lower_dir_and_mkdir_gives_empty_opaque_dir(lower: Path) -> None:
    os.unlink(lower / "dir" / "sub" / "deeper" / "c.txt")
    os.rmdir(lower / "dir" / "sub" / "deeper")
    os.unlink(lower / "dir" / "sub" / "b.txt")
    os.rmdir(lower / "dir" / "sub")
    assert os.listdir(lower / "dir") == ["a.txt"]
    os.mkdir(lower / "dir" / "sub")
    assert os.listdir(lower / "dir" / "sub") == []
    assert not (lower / "dir" / "sub" / "b.txt").exists()
    (lower / "dir" / "sub" / "b.txt").write_bytes(b"fresh")
    assert os.listdir(lower / "dir" / "sub") == ["b.txt"]


def test_rm_rf_of_lower_tree_then_recreate_by_copy(lower: Path) -> None:
    subprocess.run(["rm", "-rf", str(lower / "dir")], check=True)
    assert not os.path.lexists(lower / "dir")
    os.mkdir(lower / "dir")
    assert os.listdir(lower / "dir") == []


def test_unlink_of_one_hard_link_name(lower: Path) -> None:
    os.unlink(lower / "link1")
    st = os.stat(lower / "link2")
    assert st.st_nlink == 1
    assert (lower / "link2").read_bytes() == b"linked\n"


# -- rename ------------------------------------------------------------------------------------

def test_rename_lower_file_over_lower_file(lower: Path) -> None:
    ino = os.stat(lower / "plain.txt").st_ino
    os.rename(lower / "plain.txt", lower / "dir" / "a.txt")
    assert not os.path.lexists(lower / "plain.txt")
    assert (lower / "dir" / "a.txt").read_bytes() == b"hello world\n"
    assert os.stat(lower / "dir" / "a.txt").st_ino == ino
    assert sorted(os.listdir(lower / "dir")) == ["a.txt", "sub"]


def test_rename_upper_file_over_lower_file_and_back(lower: Path) -> None:
    (lower / "n.txt").write_bytes(b"new")
    os.rename(lower / "n.txt", lower / "plain.txt")
    assert (lower / "plain.txt").read_bytes() == b"new"
    os.rename(lower / "plain.txt", lower / "n.txt")
    assert not os.path.lexists(lower / "plain.txt")
    assert (lower / "n.txt").read_bytes() == b"new"


def test_rename_lower_dir_no_exdev(lower: Path) -> None:
    os.rename(lower / "dir", lower / "moved")
    assert not os.path.lexists(lower / "dir")
    assert (lower / "moved" / "sub" / "deeper" / "c.txt").read_bytes() == b"c\n"
    assert sorted(os.listdir(lower / "moved")) == ["a.txt", "sub"]
    os.rename(lower / "moved" / "sub", lower / "empty" / "sub")
    assert (lower / "empty" / "sub" / "b.txt").read_bytes() == b"b\n"
    assert os.stat(lower / "empty").st_nlink == 3
    assert os.stat(lower / "moved").st_nlink == 2
    # a new directory at the old name does not show the old content
    os.mkdir(lower / "dir")
    assert os.listdir(lower / "dir") == []


def test_rename_dir_over_empty_dir_and_errors(lower: Path) -> None:
    assert errno_of(os.rename, lower / "empty", lower / "dir") == errno.ENOTEMPTY
    assert errno_of(os.rename, lower / "dir", lower / "plain.txt") == errno.ENOTDIR
    assert errno_of(os.rename, lower / "plain.txt", lower / "dir") == errno.EISDIR
    assert errno_of(os.rename, lower / "dir", lower / "dir" / "sub" / "x") == errno.EINVAL
    assert errno_of(os.rename, lower / "missing", lower / "x") == errno.ENOENT
    os.rename(lower / "dir", lower / "empty")
    assert sorted(os.listdir(lower / "empty")) == ["a.txt", "sub"]
    assert not os.path.lexists(lower / "dir")


def test_rename_to_same_name_and_to_other_link_of_same_inode(lower: Path) -> None:
    os.rename(lower / "plain.txt", lower / "plain.txt")
    assert (lower / "plain.txt").read_bytes() == b"hello world\n"
    os.rename(lower / "link1", lower / "link2")  # same inode: POSIX says do nothing
    assert os.path.lexists(lower / "link1") and os.path.lexists(lower / "link2")


def test_rename_noreplace(lower: Path) -> None:
    flags = fh.RENAME_NOREPLACE
    assert errno_of(renameat2, lower / "plain.txt", lower / "ro.txt", flags) == errno.EEXIST
    assert (lower / "ro.txt").read_bytes() == b"read only\n"
    renameat2(lower / "plain.txt", lower / "fresh.txt", flags)
    assert (lower / "fresh.txt").read_bytes() == b"hello world\n"
    assert not os.path.lexists(lower / "plain.txt")


def test_rename_exchange_files_and_dirs(lower: Path) -> None:
    flags = fh.RENAME_EXCHANGE
    ino_p, ino_r = os.stat(lower / "plain.txt").st_ino, os.stat(lower / "ro.txt").st_ino
    renameat2(lower / "plain.txt", lower / "ro.txt", flags)
    assert (lower / "plain.txt").read_bytes() == b"read only\n"
    assert (lower / "ro.txt").read_bytes() == b"hello world\n"
    assert os.stat(lower / "plain.txt").st_ino == ino_r
    assert os.stat(lower / "ro.txt").st_ino == ino_p
    # a lower directory with an upper file
    (lower / "up.txt").write_bytes(b"up")
    renameat2(lower / "dir", lower / "up.txt", flags)
    assert (lower / "dir").read_bytes() == b"up"
    assert (lower / "up.txt" / "sub" / "b.txt").read_bytes() == b"b\n"
    assert errno_of(renameat2, lower / "dir", lower / "missing", flags) == errno.ENOENT


# -- link ----------------------------------------------------------------------------------------

def test_hard_link_to_lower_file(lower: Path) -> None:
    os.link(lower / "plain.txt", lower / "dir" / "hl")
    a, b = os.stat(lower / "plain.txt"), os.stat(lower / "dir" / "hl")
    assert a.st_ino == b.st_ino and a.st_nlink == b.st_nlink == 2
    with open(lower / "dir" / "hl", "r+b") as f:
        f.write(b"HELLO")
    assert (lower / "plain.txt").read_bytes() == b"HELLO world\n"
    os.link(lower / "link1", lower / "link3")
    assert os.stat(lower / "link2").st_nlink == 3
    os.unlink(lower / "plain.txt")
    assert os.stat(lower / "dir" / "hl").st_nlink == 1
    assert (lower / "dir" / "hl").read_bytes() == b"HELLO world\n"


def test_link_errors(lower: Path) -> None:
    assert errno_of(os.link, lower / "plain.txt", lower / "ro.txt") == errno.EEXIST
    assert errno_of(os.link, lower / "dir", lower / "dirlink") == errno.EPERM
    assert errno_of(os.link, lower / "missing", lower / "x") == errno.ENOENT


@pytest.mark.skipif(not fh.AS_ROOT, reason="a root writer's case (CAP_FSETID)")
@pytest.mark.parametrize("name", ["plain.txt", "new"])
def test_root_keeps_setuid_bits_on_write_and_truncate(lower: Path, name: str) -> None:
    """Only a writer without CAP_FSETID loses S_ISUID/S_ISGID (the kernel clears them for
    it; tests/test_fuse_perms.py covers that side)."""
    p = lower / name
    if name == "new":
        p.write_bytes(b"abcdef")
    os.chmod(p, 0o6755)
    os.truncate(p, 3)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o6755
    with open(p, "r+b") as f:
        f.write(b"x")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o6755
