"""A stateful random test of checkpoint and restore on a real mount against a model kept in
plain directories: at least 500 random steps of file changes (hard links included), open
read-only and writable handles, checkpoints, restores (also with ``discard``) and remounts.
Right after each restore returns the mount must show exactly the model's copy of the target
(content, kinds, modes, owners, xattrs, link counts), and every read-only handle must read
what the model's handle on the same old file reads (then it is closed: the model's copy
has new inodes everywhere, while the mount keeps the inodes of unchanged paths). A writable
handle stays open across a restore and keeps matching the model's: both write to a file no
name reaches any more, which no later checkpoint holds.

The seed is printed; ``REWINDFS_SEED`` and ``REWINDFS_STEPS`` repeat or lengthen a run.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import Item, client, dir_listing

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")

SEED = int(os.environ.get("REWINDFS_SEED", "20261129"))
STEPS = int(os.environ.get("REWINDFS_STEPS", "520"))


def listing(root: Path) -> dict[bytes, Item]:
    return dir_listing(root, mtimes=False)


class World:
    """The mount and the model side by side; every operation is applied to both and must
    succeed on both or fail on both with the same errno."""

    def __init__(self, mounter: fh.Mounter, d: fh.Daemon, model: Path, saved: Path,
                 rng: random.Random) -> None:
        self.mounter = mounter
        self.d = d
        self.model = model
        self.saved = saved
        self.rng = rng
        self.copies: dict[str, Path] = {}
        self.ro: list[tuple[int, int]] = []  # (fd in mount, fd in model)
        self.rw: list[tuple[int, int]] = []
        self.stats: dict[str, int] = {}

    @property
    def mnt(self) -> Path:
        return self.d.mnt

    def both(self, fn, *args) -> int:  # type: ignore[no-untyped-def]
        """Apply ``fn(root, *args)`` to mount and model; return the errno (0: success)."""
        out = []
        for root in (self.mnt, self.model):
            try:
                fn(root, *args)
                out.append(0)
            except OSError as e:
                out.append(e.errno or -1)
        assert out[0] == out[1], f"{fn.__name__}{args}: mount errno {out[0]}, model {out[1]}"
        return out[0]

    def paths(self, kind: str) -> list[str]:
        out = []
        for p, it in listing(self.model).items():
            if it.kind == kind:
                out.append(os.fsdecode(p))
        return sorted(out)

    def check(self, why: str) -> None:
        assert listing(self.mnt) == listing(self.model), why
        for a, b in self.ro + self.rw:
            assert os.pread(a, 1 << 20, 0) == os.pread(b, 1 << 20, 0), why

    def copy_model(self, ref: str) -> None:
        if ref not in self.copies:
            dst = self.saved / f"c{len(self.copies)}"
            subprocess.run(["cp", "-a", str(self.model), str(dst)], check=True)
            self.copies[ref] = dst

    def close_all(self, which: list[tuple[int, int]]) -> None:
        for a, b in which:
            os.close(a)
            os.close(b)
        which.clear()


# -- operations on one root (mount or model) ---------------------------------------------------

def op_write(root: Path, rel: str, data: bytes, how: str) -> None:
    flags = os.O_WRONLY | (os.O_TRUNC if how == "trunc" else 0) | (
        os.O_APPEND if how == "append" else 0)
    fd = os.open(root / rel, flags)
    try:
        if how == "offset":
            os.pwrite(fd, data, 3)
        else:
            os.write(fd, data)
    finally:
        os.close(fd)


def op_create(root: Path, rel: str, data: bytes) -> None:
    fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def op_mkdir(root: Path, rel: str) -> None:
    os.mkdir(root / rel, 0o755)


def op_unlink(root: Path, rel: str) -> None:
    os.unlink(root / rel)


def op_rmdir(root: Path, rel: str) -> None:
    os.rmdir(root / rel)


def op_rename(root: Path, src: str, dst: str) -> None:
    os.rename(root / src, root / dst)


def op_link(root: Path, src: str, dst: str) -> None:
    os.link(root / src, root / dst)


def op_symlink(root: Path, target: str, rel: str) -> None:
    os.symlink(target, root / rel)


def op_chmod(root: Path, rel: str, mode: int) -> None:
    os.chmod(root / rel, mode)


def op_truncate(root: Path, rel: str, size: int) -> None:
    os.truncate(root / rel, size)


def op_xattr(root: Path, rel: str, value: bytes) -> None:
    os.setxattr(root / rel, "user.t", value)


def test_random_steps_against_a_model(mounter: fh.Mounter, fuse_store: Path,
                                      tmp_path: Path, lower_ref: str) -> None:
    print(f"seed={SEED} steps={STEPS} (REWINDFS_SEED / REWINDFS_STEPS to repeat)")
    rng = random.Random(SEED)
    src = tmp_path / "lower-src"  # what lower_ref was made from (see conftest)
    model = tmp_path / "model"
    subprocess.run(["cp", "-a", str(src), str(model)], check=True)
    saved = tmp_path / "saved"
    saved.mkdir()
    d = mounter.rw(lower_ref)
    w = World(mounter, d, model, saved, rng)
    w.copy_model(lower_ref)
    w.check("initial")
    restores = 0
    try:
        for step in range(STEPS):
            files = w.paths("file")
            dirs = [""] + w.paths("dir")
            here = rng.choice(dirs)
            new = f"{here}/n{step}".lstrip("/")
            op = rng.choices(
                ["write", "create", "mkdir", "unlink", "rmdir", "rename", "link", "symlink",
                 "chmod", "truncate", "xattr", "open_ro", "open_rw", "write_fd", "close",
                 "checkpoint", "restore", "remount"],
                [14, 8, 4, 5, 2, 6, 5, 2, 3, 2, 2, 4, 2, 3, 3, 7, 9, 1])[0]
            w.stats[op] = w.stats.get(op, 0) + 1
            data = rng.randbytes(rng.choice([0, 1, 17, 4096, 70_000]))
            if op == "write" and files:
                w.both(op_write, rng.choice(files), data, rng.choice(["trunc", "append",
                                                                      "offset"]))
            elif op == "create":
                w.both(op_create, new, data)
            elif op == "mkdir":
                w.both(op_mkdir, new)
            elif op == "unlink" and files:
                w.both(op_unlink, rng.choice(files))
            elif op == "rmdir" and len(dirs) > 1:
                w.both(op_rmdir, rng.choice(dirs[1:]))
            elif op == "rename" and len(files + dirs) > 1:
                w.both(op_rename, rng.choice(files + dirs[1:]), new)
            elif op == "link" and files:
                w.both(op_link, rng.choice(files), new)
            elif op == "symlink":
                w.both(op_symlink, rng.choice(files + ["nowhere"]), new)
            elif op == "chmod" and files:
                w.both(op_chmod, rng.choice(files), rng.choice([0o600, 0o644, 0o755]))
            elif op == "truncate" and files:
                w.both(op_truncate, rng.choice(files), rng.choice([0, 5, 100_000]))
            elif op == "xattr" and files:
                w.both(op_xattr, rng.choice(files), data[:64] or b"x")
            elif op == "open_ro" and files and len(w.ro) < 4:
                p = rng.choice(files)
                w.ro.append((os.open(w.mnt / p, os.O_RDONLY), os.open(model / p, os.O_RDONLY)))
            elif op == "open_rw" and files and not w.rw:
                p = rng.choice(files)
                w.rw.append((os.open(w.mnt / p, os.O_RDWR), os.open(model / p, os.O_RDWR)))
            elif op == "write_fd" and w.rw:
                a, b = w.rw[0]
                off = rng.choice([0, 10, 5000])
                assert os.pwrite(a, data, off) == os.pwrite(b, data, off)
            elif op == "close":
                w.close_all(w.rw if w.rw and rng.random() < 0.5 else w.ro)
            elif op == "checkpoint":
                r = client(w.mnt).checkpoint()
                w.copy_model(r["ref"])
            elif op == "restore":
                target = rng.choice(list(w.copies))
                discard = rng.random() < 0.3
                # An open writer does not stop it: its file is detached in the mount, as
                # the model's writer keeps its file once the model is replaced below.
                before = None if discard else "pending"
                if before is not None:
                    snap = saved / "pending"
                    subprocess.run(["cp", "-a", str(model), str(snap)], check=True)
                r = client(w.mnt).restore(target, discard=discard)
                restores += 1
                if r["pre_restore"] is not None and r["pre_restore"] not in w.copies:
                    w.copies[r["pre_restore"]] = saved / f"c{len(w.copies)}"
                    os.rename(saved / "pending", w.copies[r["pre_restore"]])
                elif before is not None:
                    shutil.rmtree(saved / "pending")
                shutil.rmtree(model)
                subprocess.run(["cp", "-a", str(w.copies[target]), str(model)], check=True)
                w.check(f"step {step}: right after restoring {target}")
                # From here on the model differs by design for read-only handles: a path
                # the restore left unchanged keeps its inode in the mount (and an old
                # handle sees later writes through the path), while the model's copy has
                # new inodes. A writer's file is detached in both: it stays open.
                w.close_all(w.ro)
                continue
            elif op == "remount":
                w.close_all(w.ro)
                w.close_all(w.rw)
                mounter.remount(d)
                w.check(f"step {step}: after a remount")
                continue
            if step % 25 == 0:
                w.check(f"step {step}")
        w.close_all(w.ro)
        w.close_all(w.rw)
        w.check("end")
    finally:
        for a, b in w.ro + w.rw:
            os.close(a)
            os.close(b)
    print(f"ops: {w.stats}, restores: {restores}, snapshots: {len(w.copies)}")
    if STEPS >= 500:
        assert restores >= 10  # a run that restores too rarely tests too little
