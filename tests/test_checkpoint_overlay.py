"""Checkpoint of an overlay driven directly (no mount): the frozen tree is exactly what the
overlay showed, nothing visible changes across the checkpoint (content, attributes, inode
numbers, open handles), an unchanged overlay gives the same Ref and writes nothing, and the
Ref equals the one a plain directory with the same content gets (hard-link groups included).
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_support import overlay_env, overlay_listing, tree_listing

from fusefs.checkpoint import checkpoint_overlay
from fusefs.inodes import ROOT_INO
from fusefs.lower import Lower
from fusefs.overlay import Overlay
from fusefs.upper import Upper
from store.materialize import materialize
from store.objects import Store
from store.ref import Ref
from store.snapshot import compute_ref, snapshot

CS = 64 << 10
UID, GID = os.getuid(), os.getgid()


def build_src(root: Path) -> None:
    (root / "dir/sub/deeper").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "hello.txt").write_bytes(b"hello world\n")
    (root / "dir/a.txt").write_bytes(b"A" * 100)
    (root / "dir/sub/deep.txt").write_bytes(b"deep\n")
    (root / "dir/sub/deeper/c.txt").write_bytes(b"c\n")
    (root / "big.bin").write_bytes(bytes(range(256)) * (5 * CS // 256) + b"tail")
    os.symlink("hello.txt", root / "link")
    os.link(root / "hello.txt", root / "dir/hard.txt")
    (root / "grp").mkdir()
    (root / "grp/x").write_bytes(b"group member\n")
    os.link(root / "grp/x", root / "grp/y")
    os.setxattr(root / "hello.txt", "user.color", b"blue")
    os.mkfifo(root / "fifo")
    for i in range(30):
        (root / f"many/d{i % 5}").mkdir(parents=True, exist_ok=True)
        (root / f"many/d{i % 5}/f{i}").write_bytes(b"x" * i)


class Env:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        src = tmp / "src"
        src.mkdir()
        build_src(src)
        self.store = Store(tmp / "store", chunk_size=CS)
        self.ref = snapshot(self.store, src)
        self.state = str(tmp / "state")
        self.ov: Overlay | None = None
        self.now = 1_700_000_000_000_000_000

    def mount(self) -> Overlay:
        up = Upper.open(self.state, store_root=self.store.root, chunk_size=CS, ref=None
                        if os.path.exists(os.path.join(self.state, "upper.sqlite")) else self.ref)
        self.ov = Overlay(Lower(self.store, up.base), up, uid=UID, gid=GID, clock=self.clock)
        return self.ov

    def clock(self) -> int:
        """A deterministic clock (ns), so a seeded run repeats exactly."""
        self.now += 1_000_001
        return self.now

    def remount(self) -> Overlay:
        assert self.ov is not None
        self.ov.close()
        return self.mount()


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    yield from overlay_env(Env(tmp_path))


def ino(ov: Overlay, path: str) -> int:
    return ov.resolve(path).ino


def write(ov: Overlay, path: str, data: bytes, off: int = 0, trunc: bool = True) -> int:
    head, _, name = path.rpartition("/")
    flags = os.O_WRONLY | (os.O_TRUNC if trunc else 0)
    try:
        n = ov.resolve(path)
        fh = ov.open(n.ino, flags)
    except FileNotFoundError:
        fh, n = ov.create(ino(ov, head), name.encode(), 0o644, flags | os.O_CREAT, UID, GID)
    ov.write(fh, off, data)
    ov.release(fh)
    return n.ino


def hold(ov: Overlay, path: str) -> int:
    """Look ``path`` up component by component, as the kernel does before an open (the
    kernel then holds a lookup of every ancestor); returns its inode number."""
    cur = ROOT_INO
    for part in path.split("/"):
        n = ov.lookup(cur, part.encode())
        assert n is not None, path
        cur = n.ino
    return cur


def read(ov: Overlay, path: str) -> bytes:
    fh = ov.open(ino(ov, path), os.O_RDONLY)
    try:
        return ov.read(fh, 0, 1 << 30)
    finally:
        ov.release(fh)


def assert_same_ref_as_plain_dir(env: Env, ref: Ref) -> None:
    """Materialize ``ref`` and snapshot the copy: the copy's Ref must be ``ref``."""
    dest = env.tmp / f"copy-{ref.tree_id.hex()[:8]}"
    if not dest.exists():
        materialize(env.store, ref, dest)
    assert compute_ref(dest, chunk_size=CS) == ref


def checkpoint_and_check(env: Env, ov: Overlay) -> Ref:
    """Checkpoint; assert the tree is what the overlay showed and nothing visible moved."""
    before = overlay_listing(ov, with_ino=True)
    res = checkpoint_overlay(ov)
    assert tree_listing(env.store, res.ref) == {p: v[0] for p, v in before.items()}  # type: ignore[index]
    after = overlay_listing(ov, with_ino=True)
    assert after == before
    assert ov.lower.ref == res.ref
    assert ov.upper is not None and ov.upper.base == res.ref
    return res.ref


def test_unchanged_overlay_gives_same_ref_and_writes_nothing(env: Env) -> None:
    ov = env.mount()
    read(ov, "big.bin")
    res = checkpoint_overlay(ov)
    assert res.ref == env.ref and res.unchanged and res.packs_written == 0
    # chmod and chmod back: rows exist, but the tree is the same: same Ref, no pack
    h = ino(ov, "dir/a.txt")
    mode = ov.resolve("dir/a.txt").mode
    mtime = ov.resolve("dir/a.txt").mtime_ns
    ov.setattr(h, mode=0o600)
    ov.setattr(h, mode=mode, mtime_ns=mtime)
    res = checkpoint_overlay(ov)
    assert res.ref == env.ref and res.packs_written == 0


def test_changes_of_every_kind_are_frozen_exactly(env: Env) -> None:
    ov = env.mount()
    write(ov, "dir/sub/deep.txt", b"changed deep\n")
    write(ov, "new.txt", b"brand new\n")
    write(ov, "big.bin", b"XY", off=CS + 5, trunc=False)  # one chunk copied up
    ov.mkdir(ROOT_INO, b"newdir", 0o750, UID, GID)
    write(ov, "newdir/inner", b"inner\n")
    ov.unlink(ino(ov, "dir"), b"a.txt")
    ov.rename(ROOT_INO, b"many", ino(ov, "dir/sub"), b"moved")
    ov.symlink(ROOT_INO, b"sym2", b"dir/sub", UID, GID)
    ov.setattr(ino(ov, "link"), mtime_ns=123)
    ov.setxattr(ino(ov, "dir/sub/deeper/c.txt"), b"user.k", b"v")
    ov.rmdir(ROOT_INO, b"empty")
    ref = checkpoint_and_check(env, ov)
    assert_same_ref_as_plain_dir(env, ref)
    assert read(ov, "big.bin")[CS + 5:CS + 7] == b"XY"
    # the upper is empty again: only a root row may remain
    assert ov.upper is not None
    assert env.ov is ov
    ov = env.remount()
    assert ov.lower.ref == ref
    assert overlay_listing(ov) == tree_listing(env.store, ref)


def test_cost_follows_the_change_not_the_tree(env: Env) -> None:
    ov = env.mount()
    write(ov, "many/d3/f8", b"changed")
    res = checkpoint_overlay(ov)
    # root, many, many/d3: three directories encoded, every other subtree reused by id
    assert res.dirs_encoded == 3 and not res.full_walk
    # after a remount the in-memory parent chain of an upper inode is gone
    ov = env.remount()
    write(ov, "many/d2/f7", b"changed again")
    ov = env.remount()
    res = checkpoint_overlay(ov)
    assert tree_listing(env.store, res.ref)[b"many/d2/f7"].size == len(b"changed again")


def test_inode_numbers_ctimes_and_open_handles_survive(env: Env) -> None:
    ov = env.mount()
    n = ov.nodes[hold(ov, "dir/sub/deep.txt")]
    fh = ov.open(n.ino, os.O_RDWR)
    ov.write(fh, 0, b"DEEP")
    ctime = n.ctime_ns
    before = {p: ino(ov, p) for p in ("dir", "dir/sub", "dir/sub/deep.txt", "hello.txt")}
    new = write(ov, "dir/sub/new.txt", b"n")
    ref = checkpoint_and_check(env, ov)
    # the open handle keeps working, and writes after the checkpoint are not in it
    assert ov.read(fh, 0, 100) == b"DEEP\n"
    ov.write(fh, 0, b"late")
    ov.release(fh)
    assert read(ov, "dir/sub/deep.txt") == b"late\n"
    assert tree_listing(env.store, ref)[b"dir/sub/deep.txt"].size == 5
    ov = env.remount()
    assert {p: ino(ov, p) for p in before} == before
    assert ino(ov, "dir/sub/new.txt") == new
    assert ov.resolve("dir/sub/deep.txt").ctime_ns >= ctime


def test_hard_link_groups_follow_their_members(env: Env) -> None:
    ov = env.mount()
    # a new link to a lower file, an unlink of a group member, a moved directory of members
    ov.link(ino(ov, "dir/sub/deep.txt"), ROOT_INO, b"deep-link")
    ov.unlink(ino(ov, "dir"), b"hard.txt")
    ov.rename(ROOT_INO, b"grp", ino(ov, "dir"), b"grp2")
    ref = checkpoint_and_check(env, ov)
    assert_same_ref_as_plain_dir(env, ref)
    assert ino(ov, "deep-link") == ino(ov, "dir/sub/deep.txt")
    assert ino(ov, "dir/grp2/x") == ino(ov, "dir/grp2/y")
    ov = env.remount()
    assert ino(ov, "deep-link") == ino(ov, "dir/sub/deep.txt")
    assert ov.resolve("hello.txt").nlink == 1
    assert ov.resolve("dir/grp2/y").nlink == 2


def test_unlinked_open_file_survives_a_checkpoint(env: Env) -> None:
    ov = env.mount()
    fh, n = ov.create(ROOT_INO, b"tmp", 0o600, os.O_RDWR | os.O_CREAT, UID, GID)
    ov.write(fh, 0, b"scratch")
    ov.unlink(ROOT_INO, b"tmp")
    ref = checkpoint_and_check(env, ov)
    assert b"tmp" not in tree_listing(env.store, ref)
    ov.write(fh, 7, b"!")
    assert ov.read(fh, 0, 100) == b"scratch!"
    ov.release(fh)
    ov.forget(n.ino, n.nlookup)


@pytest.mark.parametrize("exclude", [None, ("node_modules/",)])
def test_unlinked_open_inline_file_and_device_keep_their_rows(env: Env,
                                                              exclude: tuple[str] | None) -> None:
    """A small (inline) file unlinked while open, and an unlinked device node still looked
    up, keep their content and device number across a checkpoint and a restore: in what
    the mount serves and in the upper's committed rows (with and without exclude)."""
    import sqlite3
    import stat

    from fusefs.restore import restore_overlay

    ov = env.mount()
    if exclude is not None:
        assert ov.upper is not None
        ov.upper.set_exclude(exclude)
        ov = env.remount()
    base = ov.lower.ref
    dev = ov.mknod(ROOT_INO, b"null", stat.S_IFCHR | 0o600, os.makedev(1, 3), UID, GID)
    fh, f = ov.create(ROOT_INO, b"tmp", 0o600, os.O_RDWR | os.O_CREAT, UID, GID)
    ov.write(fh, 0, b"scratch")
    ov.commit(durable=True)
    ov.unlink(ROOT_INO, b"null")
    ov.unlink(ROOT_INO, b"tmp")
    ov.commit(durable=True)

    def rows() -> list[tuple[object, ...]]:
        c = sqlite3.connect(os.path.join(env.state, "upper.sqlite"))
        try:
            return c.execute("SELECT ino, inline, rdev FROM inodes WHERE ino IN (?, ?) "
                             "ORDER BY ino", (dev.ino, f.ino)).fetchall()
        finally:
            c.close()

    want = sorted([(dev.ino, None, os.makedev(1, 3)), (f.ino, b"scratch", None)])
    checkpoint_overlay(ov)
    assert rows() == want
    restore_overlay(ov, base)
    ov.commit(durable=True)
    assert rows() == want
    assert ov.read(fh, 0, 100) == b"scratch"
    assert ov.getattr(dev.ino).rdev == os.makedev(1, 3)
    ov.release(fh)
    ov.forget(f.ino, f.nlookup)
    ov.forget(dev.ino, dev.nlookup)


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("CKPT_SEEDS", "1,2,3").split(",")])
def test_random_changes_and_checkpoints(env: Env, seed: int) -> None:
    print(f"seed={seed}")
    rng = random.Random(seed)
    ov = env.mount()
    refs = []
    for step in range(60):
        listing = overlay_listing(ov)
        files = [p.decode() for p, it in listing.items() if it.kind == "file"]  # type: ignore[attr-defined]
        dirs = [""] + [p.decode() for p, it in listing.items() if it.kind == "dir"]  # type: ignore[attr-defined]
        op = rng.choice(["write", "write", "create", "mkdir", "unlink", "rename", "link",
                         "chmod", "ckpt", "remount"])
        try:
            if op == "write" and files:
                write(ov, rng.choice(files), rng.randbytes(rng.choice([1, 100, CS + 7])),
                      off=rng.choice([0, 3, CS]), trunc=rng.random() < 0.3)
            elif op == "create":
                d = rng.choice(dirs)
                write(ov, f"{d}/n{step}".lstrip("/"), b"new %d" % step)
            elif op == "mkdir":
                ov.mkdir(ino(ov, rng.choice(dirs)), b"m%d" % step, 0o755, UID, GID)
            elif op == "unlink" and files:
                p = rng.choice(files)
                head, _, name = p.rpartition("/")
                ov.unlink(ino(ov, head), name.encode())
            elif op == "rename":
                src = rng.choice(files + dirs[1:]) if files or dirs[1:] else None
                if src:
                    head, _, name = src.rpartition("/")
                    dst = rng.choice(dirs)
                    ov.rename(ino(ov, head), name.encode(), ino(ov, dst), b"r%d" % step)
            elif op == "link" and files:
                ov.link(ino(ov, rng.choice(files)), ino(ov, rng.choice(dirs)), b"l%d" % step)
            elif op == "chmod" and files:
                ov.setattr(ino(ov, rng.choice(files)), mode=rng.choice([0o600, 0o755]))
            elif op == "ckpt":
                refs.append(checkpoint_and_check(env, ov))
            elif op == "remount":
                ov = env.remount()
        except OSError:
            pass  # an invalid random operation (e.g. a directory moved into itself)
    refs.append(checkpoint_and_check(env, ov))
    for r in set(refs):
        assert_same_ref_as_plain_dir(env, r)
    assert stat.S_ISDIR(ov.resolve("").st_mode)
