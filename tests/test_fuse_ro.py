"""Read-only mounts of a Ref (CONTRACT 2.1, 3.3): exact content, EROFS on every change, and
several mounts of one Ref side by side with a read-write session over it.
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
from fusehelpers import errno_of

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


def metadata(root: Path) -> dict[str, tuple[object, ...]]:
    """What a snapshot records, per path: kind, mode, owner, size, mtime, content, xattrs,
    link target, st_nlink; plus which paths share an inode."""
    out: dict[str, tuple[object, ...]] = {}
    groups: dict[int, list[str]] = {}
    for rel in fh.walk_tree(root):
        p = root / rel
        s = os.lstat(p)
        content: object = None
        if stat.S_ISREG(s.st_mode):
            content = p.read_bytes()
            groups.setdefault(s.st_ino, []).append(rel)
        elif stat.S_ISLNK(s.st_mode):
            content = os.readlink(p)
        xattrs = None if stat.S_ISLNK(s.st_mode) else {
            n: os.getxattr(p, n) for n in sorted(os.listxattr(p))}
        size = None if stat.S_ISDIR(s.st_mode) else s.st_size
        out[rel] = (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid,
                    size, s.st_mtime_ns, content, xattrs, s.st_nlink)
    out["<links>"] = tuple(sorted(tuple(v) for v in groups.values() if len(v) > 1))
    return out


def test_ro_mount_serves_the_snapshot_exactly(mounter: fh.Mounter, fuse_store: Path,
                                              tmp_path: Path) -> None:
    src = tmp_path / "src"
    fh.build_lower(src)
    os.chown(src / "plain.txt", *fh.OTHER_OWNER)
    (src / "dir" / "deep" / "er" / "est").mkdir(parents=True)
    (src / "dir" / "deep" / "er" / "est" / "z").write_bytes(b"")
    (src / "na\u00efve name with spaces").write_bytes(b"utf-8 name")
    (src / "weird\nname").write_bytes(b"newline in name")
    ref = fh.snapshot(fuse_store, src)
    d = mounter.ro(ref)
    assert metadata(d.mnt) == metadata(src)


def test_ro_mount_refuses_every_change_with_erofs(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.ro(lower_ref)
    m = d.mnt

    def open_(p: Path, flags: int) -> None:
        os.close(os.open(p, flags, 0o644))

    changes = {
        "create": (open_, m / "new", os.O_CREAT | os.O_WRONLY),
        "open_wronly": (open_, m / "plain.txt", os.O_WRONLY),
        "open_rdwr": (open_, m / "plain.txt", os.O_RDWR),
        "open_trunc": (open_, m / "plain.txt", os.O_WRONLY | os.O_TRUNC),
        "open_append": (open_, m / "plain.txt", os.O_WRONLY | os.O_APPEND),
        "truncate": (os.truncate, m / "plain.txt", 0),
        "mkdir": (os.mkdir, m / "newdir"),
        "rmdir": (os.rmdir, m / "empty"),
        "unlink": (os.unlink, m / "plain.txt"),
        "rename": (os.rename, m / "plain.txt", m / "renamed"),
        "rename_noreplace": (fh.renameat2, m / "plain.txt", m / "x", fh.RENAME_NOREPLACE),
        "rename_exchange": (fh.renameat2, m / "plain.txt", m / "ro.txt", fh.RENAME_EXCHANGE),
        "link": (os.link, m / "plain.txt", m / "hl"),
        "symlink": (os.symlink, "plain.txt", m / "sl"),
        "mkfifo": (os.mkfifo, m / "ff"),
        "mknod": (os.mknod, m / "nod", stat.S_IFREG | 0o644),
        "chmod": (os.chmod, m / "plain.txt", 0o600),
        "chown": (os.chown, m / "plain.txt", 1, 1),
        "utime": (os.utime, m / "plain.txt", None),
        "utime_ns": (os.utime, m / "plain.txt"),
        "setxattr": (os.setxattr, m / "plain.txt", "user.x", b"1"),
        "removexattr": (os.removexattr, m / "exec.sh", "user.note"),
        "chmod_root": (os.chmod, m, 0o700),
    }
    got = {}
    for name, (fn, *args) in changes.items():
        if name == "utime_ns":
            got[name] = errno_of(os.utime, m / "plain.txt", ns=(1, 1))
        else:
            got[name] = errno_of(fn, *args)
    assert got == {name: errno.EROFS for name in changes}
    assert sorted(os.listdir(m)) == sorted(["exec.sh", "ro.txt", "plain.txt", "big.bin",
                                            "link1", "link2", "sym", "fifo", "empty", "dir"])
    assert (m / "plain.txt").read_bytes() == b"hello world\n"
    assert os.getxattr(m / "exec.sh", "user.note") == b"exec"
    assert os.statvfs(m).f_flag & os.ST_RDONLY
    # reading never fails and opening read-only works for every kind
    for rel in fh.walk_tree(m):
        p = m / rel
        if p.is_file() and not p.is_symlink():
            p.read_bytes()


def test_two_ro_mounts_and_a_rw_mount_of_one_ref(mounter: fh.Mounter, lower_ref: str) -> None:
    ro1 = mounter.ro(lower_ref)
    ro2 = mounter.ro(lower_ref)
    rw = mounter.rw(lower_ref)
    ref_view = metadata(ro1.mnt)
    assert metadata(ro2.mnt) == ref_view
    (rw.mnt / "plain.txt").write_bytes(b"changed in the session\n")
    os.unlink(rw.mnt / "ro.txt")
    os.rename(rw.mnt / "dir", rw.mnt / "moved")
    (rw.mnt / "new").write_bytes(b"new")
    for ro in (ro1, ro2):
        assert metadata(ro.mnt) == ref_view
        assert (ro.mnt / "plain.txt").read_bytes() == b"hello world\n"
    assert (rw.mnt / "plain.txt").read_bytes() == b"changed in the session\n"
    # reads through one mount while the others are busy in other processes
    code = ("import sys, pathlib\n"
            "for _ in range(20):\n"
            "    assert pathlib.Path(sys.argv[1]).read_bytes()[:5] == b'\\x00\\x07\\x0e\\x15\\x1c'\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(m / "big.bin")])
             for m in (ro1.mnt, ro2.mnt, rw.mnt)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0, 0]
    mounter.unmount(ro1)
    assert metadata(ro2.mnt) == ref_view
    assert (rw.mnt / "new").read_bytes() == b"new"


def test_ro_mount_of_invalid_or_unknown_ref_fails_cleanly(fuse_store: Path, lower_ref: str,
                                                         tmp_path: Path) -> None:
    mnt = tmp_path / "m"
    mnt.mkdir()
    cli = [sys.executable, "-m", "rewindfs", "--store", str(fuse_store), "mount", "--ro"]
    r = subprocess.run([*cli, "v1:blake3:nothex", str(mnt), "--foreground"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    unknown = "v1:blake3:" + "ab" * 32
    r = subprocess.run([*cli, unknown, str(mnt), "--foreground"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert not fh.is_fuse_mounted(mnt)
