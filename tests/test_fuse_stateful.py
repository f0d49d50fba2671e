"""Stateful property test: a session mount behaves like tmpfs under random operation sequences.

Hypothesis applies the same random program of create, write, truncate, rename (plain,
RENAME_NOREPLACE, RENAME_EXCHANGE), link, symlink, unlink (also with handles open), mkdir,
rmdir, chmod, user xattrs, fsync, remount and ``kill -9`` after fsyncdir to a directory of a read-write mount (which
starts as a copy of the template that lives in the lower snapshot) and to a copy of the same
template on tmpfs. After every step it compares the outcome (success or errno), the whole
trees (kind, permission bits, owner, size, content, link target, user xattrs, st_nlink, which
names share an inode) and what every open handle reads. A remount must also keep every
inode number.

At least ``REWINDFS_FUSE_STEPS`` (default 300) steps run per test run; the seed is printed
and can be replayed with ``REWINDFS_FUSE_SEED=<seed>``. Shrinking is off unless
``REWINDFS_FUSE_SHRINK=1`` (each shrink step replays a program on a real mount).
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fusehelpers as fh
import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

MIN_STEPS = int(os.environ.get("REWINDFS_FUSE_STEPS", "300"))
STEPS_PER_EXAMPLE = 60
LOWER_CASES = 24
NAMES = ["a", "b", "dir", "sub"]
PATHS = [a for a in NAMES] + [f"{a}/{b}" for a in NAMES for b in NAMES] + [
    f"dir/{b}/{c}" for b in NAMES for c in NAMES]
XATTRS = ["user.a", "user.b"]
OFFSETS = [0, 1, 4095, 4096, 65535, 65536, 1 << 20, (1 << 20) + 7, 3 << 20]
MAX_HANDLES = 6


def build_template(root: Path) -> None:
    """The starting tree of every program: files, a hard link, a symlink, nested dirs."""
    root.mkdir(parents=True)
    (root / "a").write_bytes(b"alpha\n")
    (root / "b").write_bytes(fh.pattern(70_000, seed=1))
    os.chmod(root / "b", 0o755)
    os.setxattr(root / "b", "user.a", b"lower xattr")
    (root / "dir" / "sub").mkdir(parents=True)
    (root / "dir" / "a").write_bytes(b"in dir\n")
    os.link(root / "a", root / "dir" / "b")
    (root / "dir" / "sub" / "a").write_bytes(fh.pattern((2 << 20) + 333, seed=2))
    os.symlink("a", root / "sub")


# -- the two worlds -----------------------------------------------------------------------------

def outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno or 0, e.errno))


def snapshot_tree(root: str) -> dict[str, Any]:
    """Everything the comparison looks at, keyed by root-relative path."""
    out: dict[str, Any] = {}
    by_ino: dict[int, list[str]] = {}
    for rel in fh.walk_tree(root):
        p = os.path.join(root, rel)
        s = os.lstat(p)
        rec: dict[str, Any] = {"mode": stat.S_IFMT(s.st_mode), "perm": stat.S_IMODE(s.st_mode),
                               "uid": s.st_uid, "gid": s.st_gid, "nlink": s.st_nlink}
        if stat.S_ISREG(s.st_mode):
            with open(p, "rb") as f:
                data = f.read()
            rec["size"] = s.st_size
            rec["len"] = len(data)
            rec["sha"] = hashlib.sha256(data).hexdigest()[:16]
            by_ino.setdefault(s.st_ino, []).append(rel)
        elif stat.S_ISLNK(s.st_mode):
            rec["target"] = os.readlink(p)
            rec["size"] = s.st_size
        if not stat.S_ISLNK(s.st_mode):
            rec["xattrs"] = {n: os.getxattr(p, n) for n in sorted(os.listxattr(p))}
        out[rel] = rec
    out["<hard link groups>"] = sorted(sorted(v) for v in by_ino.values() if len(v) > 1)
    return out


def inode_map(root: str) -> dict[str, int]:
    return {rel: os.lstat(os.path.join(root, rel)).st_ino for rel in fh.walk_tree(root)}


class Ctx:
    """What the machine needs from the test: the mount, the reference root, case dirs."""

    mounter: fh.Mounter
    daemon: fh.Daemon
    ref_root: Path
    template: Path
    next_case = 0
    steps = 0
    remounts = 0
    ok = 0


CTX = Ctx()


class OverlayVsTmpfs(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        n = CTX.next_case
        CTX.next_case += 1
        self.ref = str(CTX.ref_root / f"c{n:03d}")
        subprocess.run(["cp", "-a", str(CTX.template), self.ref], check=True)
        if n < LOWER_CASES:
            self.mnt = str(CTX.daemon.mnt / "cases" / f"c{n:03d}")
        else:  # more programs than lower copies (shrinking): start from an upper copy
            self.mnt = str(CTX.daemon.mnt / "extra" / f"c{n:03d}")
            os.makedirs(os.path.dirname(self.mnt), exist_ok=True)
            subprocess.run(["cp", "-a", str(CTX.template), self.mnt], check=True)
        self.handles: list[tuple[int, int, str]] = []

    def teardown(self) -> None:
        self._close_all()

    def _close_all(self) -> None:
        for fa, fb, _ in self.handles:
            os.close(fa)
            os.close(fb)
        self.handles = []

    def both(self, fn: Any, *paths_then_args: Any, npaths: int = 1) -> None:
        """Apply ``fn`` to the two worlds; paths are the first ``npaths`` arguments."""
        paths, rest = paths_then_args[:npaths], paths_then_args[npaths:]
        ra = outcome(fn, *[os.path.join(self.mnt, p) for p in paths], *rest)
        rb = outcome(fn, *[os.path.join(self.ref, p) for p in paths], *rest)
        CTX.steps += 1
        CTX.ok += ra[0] == "ok"
        assert ra == rb, f"{fn.__name__}{(paths, rest)}: mount {ra} != tmpfs {rb}"

    # -- rules -----------------------------------------------------------------------------

    @rule(path=st.sampled_from(PATHS), data=st.binary(max_size=3000),
          excl=st.booleans(), trunc=st.booleans(), mode=st.sampled_from([0o644, 0o600, 0o755]))
    def create(self, path: str, data: bytes, excl: bool, trunc: bool, mode: int) -> None:
        flags = os.O_CREAT | os.O_WRONLY | (os.O_EXCL if excl else 0) | (
            os.O_TRUNC if trunc else 0)

        def op(p: str) -> int:
            fd = os.open(p, flags, mode)
            try:
                return os.write(fd, data)
            finally:
                os.close(fd)
        op.__name__ = "create"
        self.both(op, path)

    @rule(path=st.sampled_from(PATHS), off=st.sampled_from(OFFSETS),
          data=st.binary(min_size=1, max_size=5000), append=st.booleans())
    def write(self, path: str, off: int, data: bytes, append: bool) -> None:
        def op(p: str) -> int:
            fd = os.open(p, os.O_WRONLY | (os.O_APPEND if append else 0))
            try:
                if append:
                    return os.write(fd, data)
                return os.pwrite(fd, data, off)
            finally:
                os.close(fd)
        op.__name__ = "write"
        self.both(op, path)

    @rule(path=st.sampled_from(PATHS), size=st.sampled_from([0, 3, 4096, 70_001, 1 << 20,
                                                            (2 << 20) + 5]))
    def truncate(self, path: str, size: int) -> None:
        self.both(os.truncate, path, size)

    @rule(src=st.sampled_from(PATHS), dst=st.sampled_from(PATHS),
          flags=st.sampled_from([0, 0, fh.RENAME_NOREPLACE, fh.RENAME_EXCHANGE]))
    def rename(self, src: str, dst: str, flags: int) -> None:
        if flags:
            self.both(fh.renameat2, src, dst, flags, npaths=2)
        else:
            self.both(os.rename, src, dst, npaths=2)

    @rule(src=st.sampled_from(PATHS), dst=st.sampled_from(PATHS))
    def link(self, src: str, dst: str) -> None:
        self.both(os.link, src, dst, npaths=2)

    @rule(dest=st.sampled_from(["a", "dir/../a", "dir", "nowhere", "b/a"]),  # stay inside
          path=st.sampled_from(PATHS))
    def symlink(self, dest: str, path: str) -> None:
        self.both(lambda p: os.symlink(dest, p), path)

    @rule(path=st.sampled_from(PATHS))
    def unlink(self, path: str) -> None:
        self.both(os.unlink, path)

    @rule(path=st.sampled_from(PATHS), mode=st.sampled_from([0o755, 0o700]))
    def mkdir(self, path: str, mode: int) -> None:
        self.both(os.mkdir, path, mode)

    @rule(path=st.sampled_from(PATHS))
    def rmdir(self, path: str) -> None:
        self.both(os.rmdir, path)

    @rule(path=st.sampled_from(PATHS), mode=st.sampled_from([0o644, 0o600, 0o755, 0o4755,
                                                            0o1777, 0o444]))
    def chmod(self, path: str, mode: int) -> None:
        self.both(os.chmod, path, mode)

    @rule(path=st.sampled_from(PATHS), name=st.sampled_from(XATTRS),
          value=st.binary(max_size=200), flags=st.sampled_from([0, os.XATTR_CREATE,
                                                                os.XATTR_REPLACE]))
    def setxattr(self, path: str, name: str, value: bytes, flags: int) -> None:
        self.both(os.setxattr, path, name, value, flags)

    @rule(path=st.sampled_from(PATHS), name=st.sampled_from(XATTRS))
    def removexattr(self, path: str, name: str) -> None:
        self.both(os.removexattr, path, name)

    @rule(path=st.sampled_from(PATHS))
    def fsync_path(self, path: str) -> None:
        def op(p: str) -> None:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        op.__name__ = "fsync"
        self.both(op, path)

    @precondition(lambda self: len(self.handles) < MAX_HANDLES)
    @rule(path=st.sampled_from(PATHS))
    def open_handle(self, path: str) -> None:
        ra = outcome(os.open, os.path.join(self.mnt, path), os.O_RDWR)
        rb = outcome(os.open, os.path.join(self.ref, path), os.O_RDWR)
        if ra[0] == "ok" and rb[0] == "ok":
            self.handles.append((ra[1], rb[1], path))
        else:
            for r in (ra, rb):
                if r[0] == "ok":
                    os.close(r[1])
        CTX.steps += 1
        assert ra[0] == rb[0] and (ra[0] == "ok" or ra == rb), f"open({path}): {ra} != {rb}"

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data(), off=st.sampled_from(OFFSETS), buf=st.binary(min_size=1, max_size=3000))
    def handle_write(self, data: st.DataObject, off: int, buf: bytes) -> None:
        fa, fb, _ = data.draw(st.sampled_from(self.handles))
        CTX.steps += 1
        assert outcome(os.pwrite, fa, buf, off) == outcome(os.pwrite, fb, buf, off)

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data(), size=st.sampled_from([0, 10, 5000, 1 << 20]))
    def handle_truncate(self, data: st.DataObject, size: int) -> None:
        fa, fb, _ = data.draw(st.sampled_from(self.handles))
        CTX.steps += 1
        assert outcome(os.ftruncate, fa, size) == outcome(os.ftruncate, fb, size)

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def handle_fsync(self, data: st.DataObject) -> None:
        fa, fb, _ = data.draw(st.sampled_from(self.handles))
        CTX.steps += 1
        assert outcome(os.fsync, fa) == outcome(os.fsync, fb)

    @precondition(lambda self: bool(self.handles))
    @rule(data=st.data())
    def close_handle(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.handles) - 1))
        fa, fb, _ = self.handles.pop(i)
        CTX.steps += 1
        os.close(fa)
        os.close(fb)

    @rule(dice=st.integers(0, 7))
    def remount(self, dice: int) -> None:
        if dice:  # remounts cost a second each: about one in 8 draws of this rule
            return
        self._close_all()
        before = inode_map(self.mnt)
        d = CTX.daemon
        CTX.mounter.unmount(d)
        if d.state is not None:  # a clean unmount leaves a sound upper
            assert fh.upper_problems(d.state, d.store) == []
        CTX.mounter.restart(d)
        CTX.remounts += 1
        CTX.steps += 1
        assert inode_map(self.mnt) == before, "inode numbers changed across a remount"

    @rule(dice=st.integers(0, 7))
    def fsyncdir_then_kill9(self, dice: int) -> None:
        """fsyncdir makes every earlier change durable (CONTRACT 2.5): after ``kill -9`` and
        a remount the tree is exactly what it was."""
        if dice:
            return
        self._close_all()
        before = inode_map(self.mnt)
        fd = os.open(self.mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        d = CTX.daemon
        CTX.mounter.kill9(d)
        CTX.mounter.restart(d)
        CTX.remounts += 1
        CTX.steps += 1
        assert inode_map(self.mnt) == before, "inode numbers changed across kill -9"

    # -- checks after every step -------------------------------------------------------------

    @invariant()
    def trees_equal(self) -> None:
        a, b = snapshot_tree(self.mnt), snapshot_tree(self.ref)
        if a != b:
            diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
                    if a.get(k) != b.get(k)}
            raise AssertionError(f"trees differ (mount, tmpfs): {diff}")

    @invariant()
    def handles_read_alike(self) -> None:
        for fa, fb, path in self.handles:
            sa, sb = os.fstat(fa), os.fstat(fb)
            assert (sa.st_size, sa.st_nlink) == (sb.st_size, sb.st_nlink), path
            assert os.pread(fa, sa.st_size + 10, 0) == os.pread(fb, sb.st_size + 10, 0), path


# -- the test -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tmpfs_root() -> Iterator[Path]:
    """A private tmpfs (a plain temporary directory if tmpfs cannot be mounted here)."""
    d = Path(tempfile.mkdtemp(prefix="rewindfs-test-tmpfs-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "tmpfs",
                              str(d)], capture_output=True).returncode == 0
    if not mounted:
        print("tmpfs not mountable; comparing with a plain directory", file=sys.stderr)
    try:
        yield d
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(d)], check=False)
        subprocess.run(["rm", "-rf", str(d)], check=False)


def test_overlay_matches_tmpfs(mounter: fh.Mounter, fuse_store: Path, tmp_path: Path,
                               tmpfs_root: Path) -> None:
    template = tmpfs_root / "template"
    build_template(template)
    src = tmp_path / "lower-src"
    (src / "cases").mkdir(parents=True)
    for i in range(LOWER_CASES):
        subprocess.run(["cp", "-a", str(template), str(src / "cases" / f"c{i:03d}")],
                       check=True)
    CTX.mounter, CTX.template, CTX.ref_root = mounter, template, tmpfs_root / "runs"
    CTX.ref_root.mkdir()
    CTX.daemon = mounter.rw(fh.snapshot(fuse_store, src))
    CTX.next_case = CTX.steps = CTX.remounts = CTX.ok = 0

    first = int(os.environ.get("REWINDFS_FUSE_SEED") or random.randrange(1 << 32))
    phases = [Phase.explicit, Phase.generate]
    if os.environ.get("REWINDFS_FUSE_SHRINK") == "1":
        phases.append(Phase.shrink)
    cfg = settings(max_examples=max(1, MIN_STEPS // STEPS_PER_EXAMPLE),
                   stateful_step_count=STEPS_PER_EXAMPLE, deadline=None, database=None,
                   phases=phases, suppress_health_check=list(HealthCheck))
    run_seed = first
    while CTX.steps < MIN_STEPS:
        print(f"stateful FUSE test: seed {run_seed} (replay: REWINDFS_FUSE_SEED={run_seed})",
              file=sys.stderr)
        machine = seed(run_seed)(type("Seeded", (OverlayVsTmpfs,), {}))
        try:
            run_state_machine_as_test(machine, settings=cfg)
        except BaseException as e:
            e.add_note(f"seed {run_seed}: replay with REWINDFS_FUSE_SEED={run_seed}")
            raise
        run_seed += 1
    print(f"stateful FUSE test: {CTX.steps} steps, {CTX.next_case} programs, "
          f"{CTX.remounts} remounts, {CTX.ok} path operations succeeded", file=sys.stderr)
    assert CTX.steps >= MIN_STEPS
