"""Permissions on a session mount, checked as an unprivileged user (uid/gid 65534, or uid
1001 with a supplementary group against a native directory doing the same operations).

The kernel enforces permissions from the attributes the daemon returns
(``default_permissions``, CONTRACT 2.1); root passes most checks, so every check here runs in
a child process that has dropped to an unprivileged uid on a mount made with
``--allow-other``. Without ``--allow-other`` that user cannot enter the mount at all
(CONTRACT 7).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from conftest import SELFTEST, SHARED_TMP_PREFIX

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to uid 65534 needs root")

NOBODY = 65534
OTHER = 1000
PY = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"

# Runs as the user a test chose: applies each (name, op, args) and prints
# {name: "ok"|errno name|value}.
RUNNER = r"""
import errno, json, os, subprocess, sys
os.umask(0o022)
results = {}
for name, op, args in json.loads(sys.argv[1]):
    try:
        if op == "read":
            with open(args[0], "rb") as f:
                v = f.read().decode()
        elif op == "write":
            with open(args[0], "r+b") as f:
                f.write(args[1].encode())
            v = "ok"
        elif op == "create":
            fd = os.open(args[0], os.O_CREAT | os.O_EXCL | os.O_WRONLY, args[1])
            os.close(fd)
            s = os.stat(args[0])
            v = [s.st_uid, s.st_gid, s.st_mode & 0o7777]
        elif op == "mkdir":
            os.mkdir(args[0], args[1])
            s = os.stat(args[0])
            v = [s.st_uid, s.st_gid, s.st_mode & 0o7777]
        elif op == "stat":
            s = os.stat(args[0])
            v = [s.st_uid, s.st_gid, s.st_mode & 0o7777]
        elif op == "utime_now":
            os.utime(args[0])
            v = "ok"
        elif op == "utime_explicit":
            os.utime(args[0], ns=(1, 1))
            v = "ok"
        elif op == "listdir":
            v = sorted(os.listdir(args[0]))
        elif op == "setxattr":
            os.setxattr(args[0], args[1], args[2].encode())
            v = "ok"
        elif op == "access_w":
            v = os.access(args[0], os.W_OK)
        elif op == "access":
            v = os.access(args[0], args[1])
        elif op == "open":  # open(2) with these flags, nothing read or written
            os.close(os.open(args[0], args[1]))
            v = "ok"
        elif op == "exec":
            v = subprocess.run([args[0]], capture_output=True).returncode
        elif op == "hold_read":  # open for reading, then chmod 000, then read
            fd = os.open(args[0], os.O_RDONLY)
            try:
                os.chmod(args[0], 0)
                v = os.read(fd, 100).decode()
            finally:
                os.close(fd)
        elif op == "create_write":  # create with mode args[1], then write through that fd
            fd = os.open(args[0], os.O_CREAT | os.O_EXCL | os.O_WRONLY, args[1])
            try:
                os.write(fd, b"written")
            finally:
                os.close(fd)
            s = os.stat(args[0])
            v = [s.st_uid, s.st_gid, s.st_mode & 0o7777, s.st_size]
        else:
            r = getattr(os, op)(*args)
            v = "ok" if r is None else r
        results[name] = v
    except OSError as e:
        results[name] = errno.errorcode[e.errno]
print(json.dumps(results))
"""


def as_user(ops: list[tuple[str, str, list[object]]], uid: int, gid: int,
            groups: list[int]) -> dict[str, object]:
    """Run ``ops`` in a child process with ``uid``, ``gid`` and supplementary ``groups``
    (uid 0 keeps root's capabilities) and umask 022: ``{name: "ok" | errno name | value}``."""

    def drop() -> None:
        os.setgroups(groups)
        os.setgid(gid)
        os.setuid(uid)

    r = subprocess.run([PY, "-c", RUNNER, json.dumps(ops)], capture_output=True, text=True,
                       preexec_fn=drop, cwd="/", timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def as_nobody(ops: list[tuple[str, str, list[object]]]) -> dict[str, object]:
    """Run ``ops`` with uid and gid 65534 and no supplementary groups."""
    return as_user(ops, NOBODY, NOBODY, [])


def mk(p: Path, mode: int, uid: int, gid: int, data: bytes | None = None) -> None:
    """A directory at ``p`` (a file holding ``data`` if given) owned by ``uid:gid`` with
    permission bits ``mode`` (set after the chown, so setgid and setuid bits stay)."""
    if data is None:
        p.mkdir()
    else:
        p.write_bytes(data)
    os.chown(p, uid, gid)
    os.chmod(p, mode)


def build_perm_lower(root: Path) -> None:
    """Lower tree for the permission tests; see the assertions for what each entry is for."""
    root.mkdir()
    mk(root / "own", 0o755, NOBODY, NOBODY)
    mk(root / "own" / "ro.txt", 0o444, NOBODY, NOBODY, b"mine, read-only\n")
    mk(root / "own" / "other.txt", 0o644, OTHER, OTHER, b"someone else's\n")
    mk(root / "rootdir", 0o755, 0, 0)
    mk(root / "rootdir" / "ro.txt", 0o444, NOBODY, NOBODY, b"mine in a root dir\n")
    mk(root / "sticky", 0o1777, 0, 0)
    mk(root / "sticky" / "others.txt", 0o666, OTHER, OTHER, b"sticky\n")
    mk(root / "sticky" / "mine.txt", 0o644, NOBODY, NOBODY, b"mine in sticky\n")
    mk(root / "secret", 0o700, 0, 0)
    mk(root / "secret" / "f", 0o644, 0, 0, b"secret\n")
    mk(root / "rootfile.txt", 0o644, 0, 0, b"root's\n")
    mk(root / "setgid", 0o2777, 0, 1234)
    mk(root / "groupw", 0o775, 0, NOBODY)
    mk(root / "exec_only", 0o711, 0, 0)
    mk(root / "exec_only" / "known.txt", 0o644, 0, 0, b"reachable by name\n")


@pytest.fixture
def shared_base() -> Iterator[Path]:
    """A directory uid 65534 can traverse (pytest's own base directory is 0700)."""
    d = Path(tempfile.mkdtemp(prefix=SHARED_TMP_PREFIX + "perm-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        fh.unmount_leftovers([str(d)])
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def perm_mount(mounter: fh.Mounter, fuse_store: Path, tmp_path: Path,
               shared_base: Path) -> fh.Daemon:
    src = tmp_path / "perm-src"
    build_perm_lower(src)
    ref = fh.snapshot(fuse_store, src)
    d = mounter.rw(ref, mnt=shared_base / "mnt", allow_other=True)
    os.chmod(d.mnt, 0o755)
    return d


def test_owner_can_chmod_rename_and_delete_read_only_lower_file(perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    r = as_nobody([
        ("write_ro", "write", [f"{m}/own/ro.txt", "x"]),
        ("chmod", "chmod", [f"{m}/own/ro.txt", 0o644]),
        ("write_after", "write", [f"{m}/own/ro.txt", "M"]),
        ("read", "read", [f"{m}/own/ro.txt"]),
        ("rename", "rename", [f"{m}/own/ro.txt", f"{m}/own/renamed.txt"]),
        ("unlink", "unlink", [f"{m}/own/renamed.txt"]),
        ("unlink_others_in_own_dir", "unlink", [f"{m}/own/other.txt"]),
        ("listdir", "listdir", [f"{m}/own"]),
    ])
    assert r == {"write_ro": "EACCES", "chmod": "ok", "write_after": "ok",
                 "read": "Mine, read-only\n", "rename": "ok", "unlink": "ok",
                 "unlink_others_in_own_dir": "ok", "listdir": []}


def test_directory_permissions_refuse_rename_and_delete(perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    r = as_nobody([
        ("chmod_own_file_in_root_dir", "chmod", [f"{m}/rootdir/ro.txt", 0o600]),
        ("rename_in_root_dir", "rename", [f"{m}/rootdir/ro.txt", f"{m}/rootdir/x"]),
        ("rename_out_of_root_dir", "rename", [f"{m}/rootdir/ro.txt", f"{m}/own/x"]),
        ("unlink_in_root_dir", "unlink", [f"{m}/rootdir/ro.txt"]),
        ("create_in_root_dir", "create", [f"{m}/rootdir/new", 0o644]),
        ("mkdir_in_root_dir", "mkdir", [f"{m}/rootdir/newdir", 0o755]),
        ("rmdir_root_dir", "rmdir", [f"{m}/secret"]),
        ("stat", "stat", [f"{m}/rootdir/ro.txt"]),
    ])
    assert r == {"chmod_own_file_in_root_dir": "ok", "rename_in_root_dir": "EACCES",
                 "rename_out_of_root_dir": "EACCES", "unlink_in_root_dir": "EACCES",
                 "create_in_root_dir": "EACCES", "mkdir_in_root_dir": "EACCES",
                 "rmdir_root_dir": "EACCES", "stat": [NOBODY, NOBODY, 0o600]}
    assert sorted(os.listdir(m / "rootdir")) == ["ro.txt"]


def test_sticky_directory(perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    r = as_nobody([
        ("unlink_others", "unlink", [f"{m}/sticky/others.txt"]),
        ("rename_others", "rename", [f"{m}/sticky/others.txt", f"{m}/sticky/x"]),
        ("write_others", "write", [f"{m}/sticky/others.txt", "w"]),
        ("unlink_mine", "unlink", [f"{m}/sticky/mine.txt"]),
        ("create", "create", [f"{m}/sticky/new", 0o600]),
    ])
    assert r == {"unlink_others": "EPERM", "rename_others": "EPERM", "write_others": "ok",
                 "unlink_mine": "ok", "create": [NOBODY, NOBODY, 0o600]}
    assert (m / "sticky" / "others.txt").read_bytes() == b"wticky\n"


def test_unreadable_and_search_only_directories(perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    r = as_nobody([
        ("list_secret", "listdir", [f"{m}/secret"]),
        ("stat_in_secret", "stat", [f"{m}/secret/f"]),
        ("read_in_secret", "read", [f"{m}/secret/f"]),
        ("list_exec_only", "listdir", [f"{m}/exec_only"]),
        ("read_by_name", "read", [f"{m}/exec_only/known.txt"]),
    ])
    assert r == {"list_secret": "EACCES", "stat_in_secret": "EACCES",
                 "read_in_secret": "EACCES", "list_exec_only": "EACCES",
                 "read_by_name": "reachable by name\n"}


def test_files_of_others(perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    r = as_nobody([
        ("read", "read", [f"{m}/rootfile.txt"]),
        ("write", "write", [f"{m}/rootfile.txt", "x"]),
        ("truncate", "truncate", [f"{m}/rootfile.txt", 0]),
        ("chmod", "chmod", [f"{m}/rootfile.txt", 0o666]),
        ("chown", "chown", [f"{m}/rootfile.txt", NOBODY, NOBODY]),
        ("utime_explicit", "utime_explicit", [f"{m}/rootfile.txt"]),
        ("utime_now", "utime_now", [f"{m}/rootfile.txt"]),
        ("setxattr", "setxattr", [f"{m}/rootfile.txt", "user.x", "1"]),
        ("access_w", "access_w", [f"{m}/rootfile.txt"]),
        ("link", "link", [f"{m}/rootfile.txt", f"{m}/own/hl"]),
    ])
    assert r["read"] == "root's\n"
    assert {k: v for k, v in r.items() if k not in ("read", "link")} == {
        "write": "EACCES", "truncate": "EACCES", "chmod": "EPERM", "chown": "EPERM",
        "utime_explicit": "EPERM", "utime_now": "EACCES", "setxattr": "EACCES",
        "access_w": False}
    # protected_hardlinks (a sysctl) decides whether linking another's file is allowed
    assert r["link"] in ("ok", "EPERM")
    st = os.stat(m / "rootfile.txt")
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o644)
    assert (m / "rootfile.txt").read_bytes() == b"root's\n"


def test_new_inodes_belong_to_the_caller(perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    r = as_nobody([
        ("create", "create", [f"{m}/groupw/f", 0o640]),
        ("mkdir", "mkdir", [f"{m}/groupw/d", 0o750]),
        ("symlink", "symlink", ["f", f"{m}/groupw/s"]),
        ("mkfifo", "mkfifo", [f"{m}/groupw/p"]),
        ("setgid_create", "create", [f"{m}/setgid/f", 0o644]),
        ("setgid_mkdir", "mkdir", [f"{m}/setgid/d", 0o755]),
    ])
    assert r["create"] == [NOBODY, NOBODY, 0o640]
    assert r["mkdir"] == [NOBODY, NOBODY, 0o750]
    for name in ("s", "p"):
        st = os.lstat(m / "groupw" / name)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), name
    assert r["setgid_create"] == [NOBODY, 1234, 0o644]  # group inherited from the directory
    assert r["setgid_mkdir"] == [NOBODY, 1234, 0o2755]  # and the setgid bit on directories


def test_unprivileged_write_and_truncate_clear_setuid_bits(perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    for name in ("w", "t"):
        p = m / "own" / f"suid-{name}"
        p.write_bytes(b"setuid file")
        os.chown(p, NOBODY, NOBODY)
        os.chmod(p, 0o6775)
    r = as_nobody([
        ("write", "write", [f"{m}/own/suid-w", "x"]),
        ("after_write", "stat", [f"{m}/own/suid-w"]),
        ("truncate", "truncate", [f"{m}/own/suid-t", 2]),
        ("after_truncate", "stat", [f"{m}/own/suid-t"]),
    ])
    assert r == {"write": "ok", "after_write": [NOBODY, NOBODY, 0o775], "truncate": "ok",
                 "after_truncate": [NOBODY, NOBODY, 0o775]}


@pytest.mark.skipif(SELFTEST, reason="needs a mount")
def test_permissions_survive_remount(mounter: fh.Mounter, perm_mount: fh.Daemon) -> None:
    m = perm_mount.mnt
    assert as_nobody([("c", "create", [f"{m}/own/new", 0o600])]) == {
        "c": [NOBODY, NOBODY, 0o600]}
    mounter.remount(perm_mount)
    r = as_nobody([("stat", "stat", [f"{m}/own/new"]),
                   ("write", "write", [f"{m}/own/new", "ok"]),
                   ("write_root", "write", [f"{m}/rootfile.txt", "x"])])
    assert r == {"stat": [NOBODY, NOBODY, 0o600], "write": "ok", "write_root": "EACCES"}


@pytest.mark.skipif(SELFTEST, reason="needs a mount")
def test_without_allow_other_other_users_cannot_enter(mounter: fh.Mounter, fuse_store: Path,
                                                      tmp_path: Path, shared_base: Path) -> None:
    src = tmp_path / "perm-src"
    build_perm_lower(src)
    d = mounter.rw(fh.snapshot(fuse_store, src), mnt=shared_base / "private")
    os.chmod(d.mnt, 0o755)
    r = as_nobody([("stat", "stat", [f"{d.mnt}/rootfile.txt"]),
                   ("list", "listdir", [f"{d.mnt}"])])
    assert r == {"stat": "EACCES", "list": "EACCES"}
    assert (d.mnt / "rootfile.txt").read_bytes() == b"root's\n"


# -- the same operations on a native directory -------------------------------------------------

USER = 1001  # an unprivileged user (``newbie``) ...
EXTRA = 2345  # ... with this supplementary group
ALIEN = 4321  # a group USER is not in
SCRIPT = b"#!/bin/sh\nexit 0\n"


def build_compare_tree(root: Path) -> None:
    """The tree both sides of ``test_permissions_equal_a_native_directory`` start from."""
    root.mkdir()
    for rel, mode, uid, gid, data in [
        ("pub", 0o755, 0, 0, None),
        ("pub/grp.txt", 0o640, 0, EXTRA, b"group readable\n"),
        ("pub/grpw.txt", 0o620, 0, EXTRA, b"group writable\n"),
        ("pub/other.txt", 0o600, 0, 0, b"root only\n"),
        ("pub/zero.txt", 0o000, 0, 0, b"mode 000\n"),
        ("pub/noexec.sh", 0o644, 0, 0, SCRIPT),
        ("pub/grpexec.sh", 0o750, 0, EXTRA, SCRIPT),
        ("pub/ownerexec.sh", 0o700, 0, 0, SCRIPT),
        ("pub/userexec.sh", 0o100, USER, USER, SCRIPT),
        ("pub/nox", 0o666, 0, 0, None),
        ("pub/nox/f", 0o644, 0, 0, b"behind a directory without x\n"),
        ("pub/none", 0o000, 0, 0, None),
        ("pub/none/f", 0o644, 0, 0, b"behind a directory of mode 000\n"),
        ("grpdir", 0o770, 0, EXTRA, None),
        ("sgid", 0o2775, 0, EXTRA, None),
        ("sticky", 0o1777, 0, 0, None),
        ("sticky/others", 0o666, OTHER, OTHER, b"others'\n"),
        ("sticky/mine", 0o644, USER, USER, b"mine\n"),
        ("home", 0o755, USER, USER, None),
        ("home/mine.txt", 0o644, USER, USER, b"mine\n"),
        ("home/ro.txt", 0o444, USER, USER, b"read-only\n"),
        ("home/held.txt", 0o644, USER, USER, b"held open\n"),
        ("home/alien.txt", 0o644, USER, ALIEN, b"group I am not in\n"),
        ("home/sub", 0o755, USER, USER, None),
        ("home/sub/file", 0o644, USER, USER, b"in sub\n"),
    ]:
        mk(root / rel, mode, uid, gid, data)


def user_ops(r: str) -> list[tuple[str, str, list[object]]]:
    """What USER (groups USER and EXTRA) does in the compare tree at ``r``, in order."""
    return [
        ("read_grp", "read", [f"{r}/pub/grp.txt"]),
        ("read_grpw", "read", [f"{r}/pub/grpw.txt"]),
        ("write_grpw", "write", [f"{r}/pub/grpw.txt", "G"]),
        ("open_trunc_grpw", "open", [f"{r}/pub/grpw.txt", os.O_WRONLY | os.O_TRUNC]),
        ("truncate_grpw", "truncate", [f"{r}/pub/grpw.txt", 3]),
        ("open_other", "open", [f"{r}/pub/other.txt", os.O_RDONLY]),
        ("open_trunc_other", "open", [f"{r}/pub/other.txt", os.O_WRONLY | os.O_TRUNC]),
        ("truncate_other", "truncate", [f"{r}/pub/other.txt", 0]),
        ("access_r_other", "access", [f"{r}/pub/other.txt", os.R_OK]),
        ("access_w_grpw", "access", [f"{r}/pub/grpw.txt", os.W_OK]),
        ("access_x_noexec", "access", [f"{r}/pub/noexec.sh", os.X_OK]),
        ("exec_noexec", "exec", [f"{r}/pub/noexec.sh"]),
        ("exec_grpexec", "exec", [f"{r}/pub/grpexec.sh"]),
        ("exec_ownerexec", "exec", [f"{r}/pub/ownerexec.sh"]),
        ("exec_userexec", "exec", [f"{r}/pub/userexec.sh"]),
        ("list_nox", "listdir", [f"{r}/pub/nox"]),
        ("stat_in_nox", "stat", [f"{r}/pub/nox/f"]),
        ("chdir_nox", "chdir", [f"{r}/pub/nox"]),
        ("list_none", "listdir", [f"{r}/pub/none"]),
        ("read_in_none", "read", [f"{r}/pub/none/f"]),
        ("create_grpdir", "create", [f"{r}/grpdir/new", 0o640]),
        ("mkdir_sgid", "mkdir", [f"{r}/sgid/d", 0o755]),
        ("create_sgid", "create", [f"{r}/sgid/f", 0o644]),
        ("mkdir_pub", "mkdir", [f"{r}/pub/d", 0o755]),
        ("unlink_pub", "unlink", [f"{r}/pub/grpw.txt"]),
        ("rename_out_of_pub", "rename", [f"{r}/pub/grp.txt", f"{r}/home/x"]),
        ("rename_to_grpdir", "rename", [f"{r}/home/mine.txt", f"{r}/grpdir/moved"]),
        ("unlink_sticky_others", "unlink", [f"{r}/sticky/others"]),
        ("rename_sticky_others", "rename", [f"{r}/sticky/others", f"{r}/sticky/x"]),
        ("write_sticky_others", "write", [f"{r}/sticky/others", "W"]),
        ("unlink_sticky_mine", "unlink", [f"{r}/sticky/mine"]),
        ("write_ro", "write", [f"{r}/home/ro.txt", "x"]),
        ("open_w_ro", "open", [f"{r}/home/ro.txt", os.O_WRONLY]),
        ("access_w_ro", "access", [f"{r}/home/ro.txt", os.W_OK]),
        ("create_0444_and_write", "create_write", [f"{r}/home/obj", 0o444]),
        ("hold_read", "hold_read", [f"{r}/home/held.txt"]),
        ("read_after_chmod_000", "read", [f"{r}/home/held.txt"]),
        ("chmod_held_back", "chmod", [f"{r}/home/held.txt", 0o644]),
        ("chown_to_extra", "chown", [f"{r}/home/sub/file", -1, EXTRA]),
        ("chown_to_alien", "chown", [f"{r}/home/sub/file", -1, ALIEN]),
        ("chown_to_root", "chown", [f"{r}/home/sub/file", 0, -1]),
        ("after_chown", "stat", [f"{r}/home/sub/file"]),
        ("chmod_setgid_alien", "chmod", [f"{r}/home/alien.txt", 0o2755]),
        ("after_setgid_alien", "stat", [f"{r}/home/alien.txt"]),
        ("chmod_other", "chmod", [f"{r}/pub/other.txt", 0o666]),
        ("utime_explicit_grpw", "utime_explicit", [f"{r}/pub/grpw.txt"]),
        ("utime_now_grpw", "utime_now", [f"{r}/pub/grpw.txt"]),
        ("utime_now_grp", "utime_now", [f"{r}/pub/grp.txt"]),
        ("rmdir_nonempty", "rmdir", [f"{r}/home/sub"]),
        ("link_other", "link", [f"{r}/pub/other.txt", f"{r}/home/hl"]),
        ("symlink", "symlink", ["sub/file", f"{r}/home/ln"]),
        ("setxattr_own", "setxattr", [f"{r}/home/sub/file", "user.x", "1"]),
        ("setxattr_readonly", "setxattr", [f"{r}/pub/grp.txt", "user.x", "1"]),
    ]


def root_ops(r: str) -> list[tuple[str, str, list[object]]]:
    """What root (all capabilities) does in the compare tree at ``r`` after ``user_ops``."""
    return [
        ("read_zero", "read", [f"{r}/pub/zero.txt"]),
        ("write_zero", "write", [f"{r}/pub/zero.txt", "W"]),
        ("access_rw_zero", "access", [f"{r}/pub/zero.txt", os.R_OK | os.W_OK]),
        ("access_x_noexec", "access", [f"{r}/pub/noexec.sh", os.X_OK]),
        ("exec_noexec", "exec", [f"{r}/pub/noexec.sh"]),
        ("exec_userexec", "exec", [f"{r}/pub/userexec.sh"]),
        ("list_none", "listdir", [f"{r}/pub/none"]),
        ("mkdir_in_none", "mkdir", [f"{r}/pub/none/d", 0o755]),
        ("create_sgid", "create", [f"{r}/sgid/r", 0o644]),
        ("unlink_sticky_others", "unlink", [f"{r}/sticky/others"]),
        ("chown_other", "chown", [f"{r}/pub/other.txt", USER, ALIEN]),
        ("after_chown", "stat", [f"{r}/pub/other.txt"]),
        ("utime_explicit_users", "utime_explicit", [f"{r}/home/ro.txt"]),
        ("write_users_ro", "write", [f"{r}/home/ro.txt", "R"]),
    ]


def test_permissions_equal_a_native_directory(mounter: fh.Mounter, fuse_store: Path,
                                              tmp_path: Path, shared_base: Path) -> None:
    """A table of operations as an unprivileged user with a supplementary group, then as
    root, gives on the mount exactly what it gives on a native directory holding the same
    tree: every refusal, its errno, and the owner, group and mode of what they create."""
    src = tmp_path / "compare-src"
    build_compare_tree(src)
    d = mounter.rw(fh.snapshot(fuse_store, src), mnt=shared_base / "mnt", allow_other=True)
    os.chmod(d.mnt, 0o755)
    native = shared_base / "native"
    build_compare_tree(native)
    results: dict[str, tuple[dict[str, object], dict[str, object]]] = {}
    for side, root in (("mount", str(d.mnt)), ("native", str(native))):
        results[side] = (as_user(user_ops(root), USER, USER, [USER, EXTRA]),
                         as_user(root_ops(root), 0, 0, []))
    for who, mine, theirs in zip(("user", "root"), results["mount"], results["native"],
                                 strict=True):
        differ = {k: (mine.get(k), theirs[k]) for k in theirs if mine.get(k) != theirs[k]}
        assert not differ, f"as {who}, (mount, native) differ: {differ}"
    user, by_root = results["native"]
    # the native side itself refused and allowed what the cases are about
    assert (user["open_other"], user["unlink_sticky_others"], user["chown_to_alien"],
            user["write_ro"], user["exec_noexec"]) == ("EACCES", "EPERM", "EPERM", "EACCES",
                                                       "EACCES")
    assert (user["read_grp"], user["hold_read"], user["create_0444_and_write"]) == (
        "group readable\n", "held open\n", [USER, USER, 0o444, 7])
    assert (by_root["read_zero"], by_root["exec_noexec"]) == ("mode 000\n", "EACCES")
    for rel in ("home/obj", "home/held.txt", "grpdir/moved", "sgid/d", "pub/other.txt"):
        a, b = os.lstat(d.mnt / rel), os.lstat(native / rel)
        assert (a.st_uid, a.st_gid, a.st_mode) == (b.st_uid, b.st_gid, b.st_mode), rel
        if stat.S_ISREG(b.st_mode):
            assert (d.mnt / rel).read_bytes() == (native / rel).read_bytes(), rel
