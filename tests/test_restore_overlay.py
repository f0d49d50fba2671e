"""Restore of an overlay driven directly (no mount): afterwards it shows exactly the target;
unchanged paths keep their inode numbers, changed content gets new ones, directories keep
theirs; read-only handles keep the old content; every checkpoint stays restorable in any
order; files open for writing are detached, never waited for; an incomplete target changes
nothing.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from ckpt_support import overlay_env, overlay_listing, tree_listing
from test_checkpoint_overlay import CS, GID, UID, Env, hold, ino, read, write

from fusefs.checkpoint import checkpoint_overlay
from fusefs.inodes import ROOT_INO
from fusefs.restore import restore_overlay
from fusefs.session.fusetree import pinned_refs
from store.errors import RefNotFoundError
from store.ref import ObjectId, Ref


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    yield from overlay_env(Env(tmp_path))


def test_restore_undoes_every_change_and_can_be_undone(env: Env) -> None:
    ov = env.mount()
    base = overlay_listing(ov)
    write(ov, "dir/sub/deep.txt", b"changed\n")
    write(ov, "new.txt", b"new\n")
    ov.unlink(ROOT_INO, b"hello.txt")
    ov.rename(ROOT_INO, b"many", ino(ov, "dir"), b"moved")
    ov.mkdir(ROOT_INO, b"nd", 0o700, UID, GID)
    changed = overlay_listing(ov)
    res = restore_overlay(ov, env.ref)
    assert overlay_listing(ov) == base == tree_listing(env.store, env.ref)
    assert res.pre is not None and tree_listing(env.store, res.pre) == changed
    assert res.pre in [s.ref for s in env.store.list_snapshots()]
    res2 = restore_overlay(ov, res.pre)
    assert overlay_listing(ov) == changed
    ov = env.remount()
    assert ov.lower.ref == res.pre and overlay_listing(ov) == changed
    assert res2.pre == env.ref  # the base, unchanged since: its own Ref again


def test_a_hard_link_keeps_its_number_after_restore_once_forgotten(env: Env) -> None:
    """``grp/x`` loses its other name, the restore brings it back: the inode keeps its
    number, also for a lookup after the kernel forgot it (the kernel drops unused inodes
    whenever it likes, more often under load) and after a remount."""
    ov = env.mount()
    grp = ov.lookup(ROOT_INO, b"grp")
    assert grp is not None
    x = ov.lookup(grp.ino, b"x")
    assert x is not None
    number = x.ino
    ov.unlink(grp.ino, b"y")
    restore_overlay(ov, env.ref)
    assert ino(ov, "grp/x") == number == ino(ov, "grp/y")
    ov.forget(number, 1)
    assert number not in ov.nodes
    assert ino(ov, "grp/x") == number == ino(ov, "grp/y")
    ov = env.remount()
    assert ino(ov, "grp/x") == number == ino(ov, "grp/y")


def test_inode_numbers_across_restore(env: Env) -> None:
    ov = env.mount()
    keep = {p: ino(ov, p) for p in ("dir", "dir/sub", "dir/a.txt", "big.bin", "many/d1/f1")}
    old_deep = ino(ov, "dir/sub/deep.txt")
    write(ov, "dir/sub/deep.txt", b"v2\n")
    ov.setattr(ino(ov, "dir/a.txt"), mode=0o600)
    ov.mkdir(ino(ov, "dir"), b"made", 0o755, UID, GID)
    made = ino(ov, "dir/made")
    ov.forget(made, 1)  # the kernel forgets it (mkdir counted one lookup)
    c1 = checkpoint_overlay(ov).ref
    assert ino(ov, "dir/sub/deep.txt") == old_deep  # a checkpoint keeps numbers
    v2 = old_deep
    restore_overlay(ov, env.ref)
    assert {p: ino(ov, p) for p in keep} == keep  # metadata-only and unchanged: same
    assert ino(ov, "dir/sub/deep.txt") != v2  # content changed by the restore: new number
    assert ov.resolve("dir/a.txt").mode != 0o600
    restore_overlay(ov, c1)
    assert ino(ov, "dir/made") == made  # a directory keeps its number
    assert read(ov, "dir/sub/deep.txt") == b"v2\n"
    assert ov.resolve("dir/a.txt").mode == 0o600
    ov = env.remount()
    assert ino(ov, "dir/made") == made and ino(ov, "dir") == keep["dir"]


def test_read_only_handle_keeps_old_content(env: Env) -> None:
    ov = env.mount()
    write(ov, "dir/sub/deep.txt", b"version two\n")
    fh = ov.open(hold(ov, "dir/sub/deep.txt"), os.O_RDONLY)
    gone = ov.open(hold(ov, "dir/a.txt"), os.O_RDONLY)
    ov.unlink(ino(ov, "dir"), b"a.txt")
    restore_overlay(ov, env.ref, discard=True)
    assert ov.read(fh, 0, 100) == b"version two\n"
    assert read(ov, "dir/sub/deep.txt") == b"deep\n"
    assert ov.read(gone, 0, 200) == b"A" * 100
    ov.release(fh)
    ov.release(gone)
    assert overlay_listing(ov) == tree_listing(env.store, env.ref)


def test_discard_lists_nothing_and_cwd_directory_survives(env: Env) -> None:
    ov = env.mount()
    n_before = len(env.store.list_snapshots())
    ov.mkdir(ino(ov, "dir"), b"mine", 0o755, UID, GID)
    d = ov.lookup(ino(ov, "dir"), b"sub")  # a process's cwd: the kernel holds it
    assert d is not None
    write(ov, "dir/sub/x", b"x")
    res = restore_overlay(ov, env.ref, discard=True)
    assert res.pre is None and len(env.store.list_snapshots()) == n_before
    assert overlay_listing(ov) == tree_listing(env.store, env.ref)
    assert ino(ov, "dir/sub") == d.ino and ov.nodes[d.ino].nlink > 0
    ov.forget(d.ino, 1)


def test_open_writers_are_detached_not_waited_for(env: Env) -> None:
    ov = env.mount()
    orig = overlay_listing(ov)
    write(ov, "new.txt", b"pending\n")
    fresh = ov.open(hold(ov, "new.txt"), os.O_RDWR)  # a file the restore removes
    a_old = hold(ov, "dir/a.txt")
    same = ov.open(a_old, os.O_RDWR)  # a file whose path the restore leaves unchanged
    hard_old = hold(ov, "hello.txt")
    linked = ov.open(hard_old, os.O_WRONLY)  # a hard-linked file (two names)
    ov.mkdir(ROOT_INO, b"made", 0o755, UID, GID)
    made = hold(ov, "made")  # a process's cwd, in a directory the restore removes
    write(ov, "made/f", b"f\n")
    res = restore_overlay(ov, env.ref)  # at once, no permit_failed
    assert overlay_listing(ov) == orig == tree_listing(env.store, env.ref)
    assert res.pre is not None

    ov.write(fresh, 8, b"later\n")  # detached handles keep working ...
    assert ov.read(fresh, 0, 100) == b"pending\nlater\n"
    ov.write(same, 0, b"ZZ")
    assert ov.read(same, 0, 4) == b"ZZAA"  # ... on their own copy
    ov.write(linked, 0, b"J")
    assert ino(ov, "dir/a.txt") != a_old and read(ov, "dir/a.txt") == b"A" * 100
    assert ino(ov, "hello.txt") == ino(ov, "dir/hard.txt") != hard_old
    assert read(ov, "hello.txt") == b"hello world\n"
    assert ov.lookup(made, b"f") is None  # nothing shows in the removed directory
    with pytest.raises(FileNotFoundError):
        ov.create(made, b"g", 0o644, os.O_CREAT | os.O_WRONLY, UID, GID)
    assert not ov.nodes[made].upper
    assert ov.held_lowers() == [str(res.pre)]  # the old lower, read by the detached files
    assert res.pre in pinned_refs(env.state)  # recorded with the swap, for GC

    assert checkpoint_overlay(ov).ref == env.ref  # the detached writes are in no checkpoint
    assert overlay_listing(ov) == orig
    numbers = {p: ino(ov, p) for p in ("dir/a.txt", "hello.txt")}
    for fh_ in (fresh, same, linked):
        ov.release(fh_)
    assert ov.held_lowers() == [str(res.pre)]  # the kernel still holds lookups
    for n in sorted(ov.unlinked):  # the kernel forgets them
        ov.forget(n, ov.nodes[n].nlookup)
    assert ov.unlinked == set() and ov.held_lowers() == []
    ov.commit()
    assert pinned_refs(env.state) == [env.ref]
    assert {p: ino(ov, p) for p in numbers} == numbers  # new numbers stay (pinned)
    ov = env.remount()
    assert overlay_listing(ov) == orig and {p: ino(ov, p) for p in numbers} == numbers


def test_missing_target_changes_nothing(env: Env) -> None:
    ov = env.mount()
    write(ov, "new.txt", b"pending\n")
    before = overlay_listing(ov)
    missing = Ref(ObjectId(bytes(32)))
    with pytest.raises(RefNotFoundError):
        restore_overlay(ov, missing)
    assert overlay_listing(ov) == before


@pytest.mark.parametrize("seed", [int(s) for s in os.environ.get("RESTORE_SEEDS", "1,2").split(",")])
def test_random_changes_checkpoints_and_restores(env: Env, seed: int) -> None:
    print(f"seed={seed}")
    rng = random.Random(seed)
    ov = env.mount()
    known: dict[Ref, dict[bytes, object]] = {env.ref: overlay_listing(ov)}
    ro: list[tuple[int, bytes]] = []  # read-only handles and the content they must read
    for step in range(int(os.environ.get("RESTORE_STEPS", "80"))):
        listing = overlay_listing(ov)
        files = [p.decode() for p, it in listing.items() if it.kind == "file"]  # type: ignore[attr-defined]
        dirs = [""] + [p.decode() for p, it in listing.items() if it.kind == "dir"]  # type: ignore[attr-defined]
        op = rng.choice(["write", "write", "create", "mkdir", "unlink", "rename", "link",
                         "ckpt", "restore", "restore", "discard", "remount", "open"])
        try:
            if op == "write" and files:
                write(ov, rng.choice(files), rng.randbytes(rng.choice([1, 50, CS + 3])),
                      off=rng.choice([0, 5]), trunc=rng.random() < 0.5)
            elif op == "create":
                write(ov, f"{rng.choice(dirs)}/n{step}".lstrip("/"), b"n%d" % step)
            elif op == "mkdir":
                ov.mkdir(ino(ov, rng.choice(dirs)), b"m%d" % step, 0o755, UID, GID)
            elif op == "unlink" and files:
                head, _, name = rng.choice(files).rpartition("/")
                ov.unlink(ino(ov, head), name.encode())
            elif op == "rename" and len(dirs) > 1:
                head, _, name = rng.choice(files + dirs[1:]).rpartition("/")
                ov.rename(ino(ov, head), name.encode(), ino(ov, rng.choice(dirs)), b"r%d" % step)
            elif op == "link" and files:
                ov.link(ino(ov, rng.choice(files)), ino(ov, rng.choice(dirs)), b"l%d" % step)
            elif op == "open" and files:
                p = rng.choice(files)
                fh = ov.open(hold(ov, p), os.O_RDONLY)
                ro.append((fh, read(ov, p)))
            elif op == "ckpt":
                ref = checkpoint_overlay(ov).ref
                known[ref] = overlay_listing(ov)
            elif op in ("restore", "discard"):
                target = rng.choice(list(known))
                ro = [(fh, ov.read(fh, 0, 1 << 30)) for fh, _ in ro]
                res = restore_overlay(ov, target, discard=op == "discard")
                if res.pre is not None:
                    known[res.pre] = listing
                assert overlay_listing(ov) == known[target], f"step {step}"
                for fh, content in ro:
                    assert ov.read(fh, 0, 1 << 30) == content, f"step {step}"
            elif op == "remount":
                ro.clear()
                ov = env.remount()
        except OSError:
            pass
        if len(ro) > 3:
            fh, _ = ro.pop(0)
            ov.release(fh)
    for fh, _ in ro:
        ov.release(fh)
