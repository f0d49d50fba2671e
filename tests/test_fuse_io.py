"""The I/O half of a session mount's POSIX surface (CONTRACT 2.2): open/create flags, read,
write, sparse files, fsync, readdir cookies, statfs, access, user xattrs, unlink while open,
and metadata kept across copy-up.

All tests share one read-write mount; each gets its own untouched copy of the standard lower
tree (``lower`` fixture, see ``fusehelpers.build_lower``).
"""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import fusehelpers as fh
import pytest
from fusehelpers import BIG_SIZE, MTIME_NS, errno_of, pattern

# -- open, create, read, write --------------------------------------------------------------------

def test_o_excl(lower: Path) -> None:
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY
    assert errno_of(os.open, lower / "plain.txt", flags) == errno.EEXIST
    assert errno_of(os.open, lower / "sym", flags) == errno.EEXIST
    fd = os.open(lower / "lock", flags, 0o600)
    os.close(fd)
    assert errno_of(os.open, lower / "lock", flags) == errno.EEXIST
    assert stat.S_IMODE(os.stat(lower / "lock").st_mode) == 0o600


def test_create_mode_honours_umask(lower: Path) -> None:
    old = os.umask(0o027)
    try:
        fd = os.open(lower / "um", os.O_CREAT | os.O_WRONLY, 0o777)
        os.close(fd)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(lower / "um").st_mode) == 0o750


def test_o_trunc_on_lower_file_keeps_mode(lower: Path) -> None:
    fd = os.open(lower / "exec.sh", os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    st = os.stat(lower / "exec.sh")
    assert st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0o755
    assert (lower / "exec.sh").read_bytes() == b""


def test_o_append_to_lower_file(lower: Path) -> None:
    with open(lower / "plain.txt", "ab") as f:
        f.write(b"more\n")
    assert (lower / "plain.txt").read_bytes() == b"hello world\nmore\n"
    fd = os.open(lower / "plain.txt", os.O_WRONLY | os.O_APPEND)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, b"end\n")
    finally:
        os.close(fd)
    assert (lower / "plain.txt").read_bytes() == b"hello world\nmore\nend\n"


APPENDER = (
    "import os, sys\n"
    "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)\n"
    "for i in range(int(sys.argv[3])):\n"
    "    os.write(fd, f'{sys.argv[2]}-{i:06d}'.ljust(31).encode() + b'\\n')\n"
    "os.close(fd)\n"
)


def test_o_append_from_several_processes(lower: Path) -> None:
    p = lower / "plain.txt"
    n, procs = 400, 4
    running = [subprocess.Popen([sys.executable, "-c", APPENDER, str(p), f"p{k}", str(n)])
               for k in range(procs)]
    assert [r.wait(timeout=300) for r in running] == [0] * procs
    data = p.read_bytes()
    assert data.startswith(b"hello world\n")
    body = data[len(b"hello world\n"):]
    assert len(body) == n * procs * 32
    records = [body[i:i + 32] for i in range(0, len(body), 32)]
    for k in range(procs):
        mine = [r for r in records if r.startswith(b"p%d-" % k)]
        assert mine == [f"p{k}-{i:06d}".ljust(31).encode() + b"\n" for i in range(n)]


def test_write_one_byte_into_big_lower_file(lower: Path) -> None:
    p = lower / "big.bin"
    want = bytearray(pattern(BIG_SIZE))
    with open(p, "r+b") as f:
        f.seek(1_500_000)
        f.write(b"\xff")
    want[1_500_000] = 0xFF
    assert p.read_bytes() == bytes(want)
    with open(p, "r+b") as f:
        f.seek(BIG_SIZE - 3)
        f.write(b"tail-extends")
    want[BIG_SIZE - 3:] = b"tail-extends"
    assert p.read_bytes() == bytes(want)
    assert os.stat(p).st_size == len(want)


def test_sparse_file_holes_read_as_zeros(lower: Path) -> None:
    p = lower / "sparse"
    with open(p, "wb") as f:
        f.seek(10 << 20)
        f.write(b"end")
        f.seek(5)
        f.write(b"start")
    data = p.read_bytes()
    assert len(data) == (10 << 20) + 3
    assert data[:5] == bytes(5) and data[5:10] == b"start"
    assert data[10:10 << 20] == bytes((10 << 20) - 10)
    assert data[-3:] == b"end"
    with open(p, "rb") as f:
        f.seek(7 << 20)
        assert f.read(4096) == bytes(4096)


def test_write_and_read_at_unaligned_offsets(lower: Path) -> None:
    p = lower / "unaligned"
    want = bytearray()
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        for i in range(50):
            off = (i * 99_991) % (3 << 20)
            chunk = pattern(4097 + i * 131, seed=i)
            os.pwrite(fd, chunk, off)
            if len(want) < off + len(chunk):
                want += bytes(off + len(chunk) - len(want))
            want[off:off + len(chunk)] = chunk
        assert os.pread(fd, len(want) + 10, 0) == bytes(want)
    finally:
        os.close(fd)
    assert p.read_bytes() == bytes(want)


def test_read_past_eof_is_empty(lower: Path) -> None:
    fd = os.open(lower / "plain.txt", os.O_RDONLY)
    try:
        assert os.pread(fd, 100, 12) == b""
        assert os.pread(fd, 100, 1 << 30) == b""
        assert os.pread(fd, 100, 6) == b"world\n"
    finally:
        os.close(fd)


def test_open_directory_for_writing_is_eisdir(lower: Path) -> None:
    assert errno_of(os.open, lower / "dir", os.O_WRONLY) == errno.EISDIR


def test_o_nofollow_and_o_directory(lower: Path) -> None:
    assert errno_of(os.open, lower / "sym", os.O_RDONLY | os.O_NOFOLLOW) == errno.ELOOP
    assert errno_of(os.open, lower / "plain.txt", os.O_RDONLY | os.O_DIRECTORY) == errno.ENOTDIR


def test_mmap_shared_write(lower: Path) -> None:
    import mmap
    p = lower / "plain.txt"
    with open(p, "r+b") as f:
        m = mmap.mmap(f.fileno(), 0)
        m[0:5] = b"HELLO"
        m.flush()
        m.close()
    assert p.read_bytes() == b"HELLO world\n"


# -- flush, release, fsync, fsyncdir -----------------------------------------------------------

def test_fsync_and_fsyncdir(lower: Path) -> None:
    fd = os.open(lower / "f", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"data")
        os.fsync(fd)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    dfd = os.open(lower / "dir", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    assert (lower / "f").read_bytes() == b"data"


def test_dup_and_close_twice_flush(lower: Path) -> None:
    fd = os.open(lower / "dupd", os.O_CREAT | os.O_WRONLY, 0o644)
    fd2 = os.dup(fd)
    os.write(fd, b"one")
    os.close(fd)  # a flush with the file still open
    os.write(fd2, b"two")
    os.close(fd2)
    assert (lower / "dupd").read_bytes() == b"onetwo"


# -- readdir ------------------------------------------------------------------------------------

def test_readdir_dot_entries_and_types(lower: Path) -> None:
    kinds = {e.name: (e.is_dir(follow_symlinks=False), e.is_symlink()) for e in os.scandir(lower)}
    assert kinds["dir"] == (True, False)
    assert kinds["sym"] == (False, True)
    assert kinds["plain.txt"] == (False, False)
    ino = {e.name: e.inode() for e in os.scandir(lower)}
    assert ino["plain.txt"] == os.lstat(lower / "plain.txt").st_ino
    out = subprocess.run(["ls", "-a", str(lower / "empty")], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [".", ".."]


def test_readdir_while_unlinking_sees_every_entry_once(lower: Path) -> None:
    d = lower / "many"
    d.mkdir()
    names = {f"f{i:05d}" for i in range(1000)}
    for n in names:
        (d / n).write_bytes(b"")
    seen = []
    with os.scandir(d) as it:
        for e in it:
            seen.append(e.name)
            os.unlink(e.path)
            if len(seen) % 7 == 0:
                (d / f"new{len(seen)}").write_bytes(b"")  # added during the listing
    assert len(seen) == len(set(seen)), "an entry was returned twice"
    missing = names - set(seen)
    assert not missing, f"{len(missing)} entries that existed throughout were skipped"


def test_rm_rf_big_mixed_dir_in_one_pass(lower: Path) -> None:
    d = lower / "dir"
    for i in range(700):
        (d / f"u{i:05d}").write_bytes(b"x")
    for i in range(30):
        (d / "sub" / f"s{i}").mkdir()
        (d / "sub" / f"s{i}" / "f").write_bytes(b"y")
    r = subprocess.run(["rm", "-rf", str(d)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert not os.path.lexists(d)


def test_readdir_offsets_resume_after_seek(lower: Path) -> None:
    """telldir/seekdir-style resumption: a listing done in small batches through one
    directory handle still sees each entry once, also with entries removed between batches."""
    d = lower / "batch"
    d.mkdir()
    for i in range(300):
        (d / f"e{i:04d}").write_bytes(b"")
    code = (
        "import ctypes, os, sys\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.opendir.restype = ctypes.c_void_p\n"
        "libc.readdir.restype = ctypes.c_void_p\n"
        "libc.readdir.argtypes = [ctypes.c_void_p]\n"
        "libc.telldir.restype = ctypes.c_long\n"
        "libc.telldir.argtypes = [ctypes.c_void_p]\n"
        "libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]\n"
        "libc.closedir.argtypes = [ctypes.c_void_p]\n"
        "d = sys.argv[1]\n"
        "seen = []\n"
        "pos = 0\n"
        "while True:\n"
        "    dp = libc.opendir(d.encode())\n"
        "    libc.seekdir(dp, pos)\n"
        "    got = 0\n"
        "    while got < 17:\n"
        "        ent = libc.readdir(dp)\n"
        "        if not ent:\n"
        "            break\n"
        "        name = ctypes.string_at(ent + 19).decode()\n"
        "        pos = libc.telldir(dp)\n"
        "        if name not in ('.', '..'):\n"
        "            seen.append(name)\n"
        "            os.unlink(os.path.join(d, name))\n"
        "        got += 1\n"
        "    libc.closedir(dp)\n"
        "    if got == 0:\n"
        "        break\n"
        "print(len(seen), len(set(seen)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True,
                       check=True)
    assert r.stdout.split() == ["300", "300"]
    assert os.listdir(d) == []


# -- statfs, access, xattrs ------------------------------------------------------------------

def test_statfs(lower: Path) -> None:
    st = os.statvfs(lower)
    assert st.f_bsize > 0 and st.f_namemax >= 255
    assert st.f_blocks >= st.f_bfree


def test_access(lower: Path) -> None:
    assert os.access(lower / "exec.sh", os.X_OK)
    assert not os.access(lower / "plain.txt", os.X_OK)
    assert os.access(lower / "ro.txt", os.R_OK)
    assert os.access(lower / "dir", os.W_OK | os.X_OK)
    assert not os.access(lower / "missing", os.F_OK)


def test_user_xattrs_on_lower_and_upper_files(lower: Path) -> None:
    p = lower / "exec.sh"
    assert os.listxattr(p) == ["user.note"]
    os.setxattr(p, "user.more", b"\x00binary\xff" * 100)
    assert sorted(os.listxattr(p)) == ["user.more", "user.note"]
    assert os.getxattr(p, "user.more") == b"\x00binary\xff" * 100
    os.setxattr(p, "user.note", b"changed")
    assert os.getxattr(p, "user.note") == b"changed"
    os.removexattr(p, "user.note")
    assert os.listxattr(p) == ["user.more"]
    assert errno_of(os.getxattr, p, "user.note") == errno.ENODATA
    assert errno_of(os.removexattr, p, "user.note") == errno.ENODATA
    assert errno_of(os.setxattr, p, "user.more", b"x", os.XATTR_CREATE) == errno.EEXIST
    assert errno_of(os.setxattr, p, "user.none", b"x", os.XATTR_REPLACE) == errno.ENODATA
    os.setxattr(p, "user.empty", b"")
    assert os.getxattr(p, "user.empty") == b""
    assert (lower / "exec.sh").read_bytes() == b"#!/bin/sh\necho hi\n"
    d = lower / "dir"
    os.setxattr(d, "user.dirattr", b"on a dir")
    assert os.getxattr(d, "user.dirattr") == b"on a dir"
    (lower / "n").write_bytes(b"")
    os.setxattr(lower / "n", "user.a", b"1")
    assert os.listxattr(lower / "n") == ["user.a"]


def test_xattr_size_query(lower: Path) -> None:
    """getxattr/listxattr with a zero-size buffer report the size (tools ask that way)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.getxattr.restype = ctypes.c_ssize_t
    libc.getxattr.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                              ctypes.c_size_t]
    libc.listxattr.restype = ctypes.c_ssize_t
    libc.listxattr.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    p = os.fsencode(lower / "exec.sh")
    assert libc.getxattr(p, b"user.note", None, 0) == 4
    assert libc.listxattr(p, None, 0) == len(b"user.note\0")
    small = ctypes.create_string_buffer(2)
    assert libc.getxattr(p, b"user.note", small, 2) == -1
    assert ctypes.get_errno() == errno.ERANGE


# -- unlink while open -------------------------------------------------------------------------

@pytest.mark.parametrize("origin", ["lower", "upper"])
def test_unlinked_open_file_stays_usable_and_dir_can_go(lower: Path, origin: str) -> None:
    d = lower / "dir" / "sub" / "deeper"
    p = d / "c.txt"
    if origin == "upper":
        os.unlink(p)
        p.write_bytes(b"c\n")
    fd = os.open(p, os.O_RDWR)
    try:
        os.unlink(p)
        assert not os.path.lexists(p)
        assert os.fstat(fd).st_nlink == 0
        assert os.pread(fd, 10, 0) == b"c\n"
        os.pwrite(fd, b"still writable", 2)
        assert os.pread(fd, 100, 0) == b"c\nstill writable"
        os.ftruncate(fd, 4)
        assert os.pread(fd, 100, 0) == b"c\nst"
        assert os.fstat(fd).st_size == 4
        os.rmdir(d)
        assert not os.path.lexists(d)
        os.fchmod(fd, 0o600)
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        os.fsync(fd)
    finally:
        os.close(fd)
    assert "deeper" not in os.listdir(lower / "dir" / "sub")


def test_rename_over_open_file_keeps_old_content_in_handle(lower: Path) -> None:
    fd = os.open(lower / "plain.txt", os.O_RDONLY)
    try:
        (lower / "tmp").write_bytes(b"replacement")
        os.rename(lower / "tmp", lower / "plain.txt")
        assert os.pread(fd, 100, 0) == b"hello world\n"
        assert (lower / "plain.txt").read_bytes() == b"replacement"
    finally:
        os.close(fd)


# -- copy-up keeps metadata ----------------------------------------------------------------------

def test_first_write_to_lower_file_keeps_mode_xattrs_and_owner(lower: Path) -> None:
    p = lower / "exec.sh"
    os.chown(p, *fh.OTHER_OWNER)
    before = os.stat(p)
    with open(p, "r+b") as f:
        f.seek(0, 2)
        f.write(b"echo more\n")
    after = os.stat(p)
    assert stat.S_IMODE(after.st_mode) == 0o755
    assert (after.st_uid, after.st_gid) == fh.OTHER_OWNER
    assert os.getxattr(p, "user.note") == b"exec"
    assert after.st_ino == before.st_ino
    assert after.st_mtime_ns >= before.st_mtime_ns and after.st_mtime_ns != MTIME_NS
    r = subprocess.run([str(p)], capture_output=True, text=True, check=True)
    assert r.stdout == "hi\nmore\n"


def test_open_for_write_without_writing_keeps_times(lower: Path) -> None:
    p = lower / "plain.txt"
    before = os.stat(p)
    fd = os.open(p, os.O_RDWR)
    os.close(fd)
    os.setxattr(p, "user.x", b"1")
    after = os.stat(p)
    assert after.st_mtime_ns == before.st_mtime_ns == MTIME_NS
    assert after.st_ino == before.st_ino
    assert p.read_bytes() == b"hello world\n"


def test_write_updates_mtime_and_ctime(lower: Path) -> None:
    p = lower / "dir" / "a.txt"
    before = os.stat(p)
    with open(p, "ab") as f:
        f.write(b"x")
    after = os.stat(p)
    assert after.st_mtime_ns > before.st_mtime_ns
    assert after.st_ctime_ns >= after.st_mtime_ns - 10**9


def test_create_updates_parent_mtime(lower: Path) -> None:
    os.utime(lower / "dir", ns=(1, 1))
    (lower / "dir" / "newchild").write_bytes(b"")
    assert os.stat(lower / "dir").st_mtime_ns > 1
    os.utime(lower / "dir", ns=(1, 1))
    os.unlink(lower / "dir" / "a.txt")
    assert os.stat(lower / "dir").st_mtime_ns > 1


def test_operations_pyfuse3_lacks_fall_back(lower: Path) -> None:
    """fallocate, copy_file_range and SEEK_DATA/SEEK_HOLE have no pyfuse3 handler; the
    kernel and libc fall back (CONTRACT 2.2): the calls work, holes are reported as data."""
    fd = os.open(lower / "fa", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.posix_fallocate(fd, 0, 100_000)
        assert os.fstat(fd).st_size == 100_000
        assert os.pread(fd, 100_000, 0) == bytes(100_000)
        data = os.lseek(fd, 10, os.SEEK_DATA)
        hole = os.lseek(fd, 10, os.SEEK_HOLE)
        assert data in (10,) or data >= 100_000  # a hole may be reported, never wrong data
        assert 10 <= hole <= 100_000
    finally:
        os.close(fd)
    src = os.open(lower / "big.bin", os.O_RDONLY)
    dst = os.open(lower / "copy", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        copied = 0
        while n := os.copy_file_range(src, dst, 1 << 20):
            copied += n
    finally:
        os.close(src)
        os.close(dst)
    assert copied == BIG_SIZE
    assert (lower / "copy").read_bytes() == pattern(BIG_SIZE)
