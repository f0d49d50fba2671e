"""The ``exclude`` path policy on an overlay driven directly (no mount; CONTRACT amendment
"0, 3.1 policies"): excluded paths stay in the upper across checkpoints and are in no Ref,
a restore leaves them as they are and takes them from the target only where the live tree
has none, the upper stays sound (``upper.check``) and a remount finds them again.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from ckpt_support import overlay_listing, tree_listing

from fusefs.checkpoint import checkpoint_overlay, preview
from fusefs.inodes import ROOT_INO
from fusefs.lower import Lower
from fusefs.overlay import Overlay
from fusefs.restore import restore_overlay
from fusefs.upper import Upper, check
from store.diff import diff_trees
from store.objects import Store
from store.ref import Ref
from store.snapshot import snapshot
from store.tree import Kind

CS = 64 << 10
UID, GID = os.getuid(), os.getgid()
EXCLUDE = ("node_modules/", "__pycache__/", "*.pyc", "/build/")


class Env:
    def __init__(self, tmp: Path, seed_extra: bool = False) -> None:
        src = tmp / "src"
        (src / "pkg/lib").mkdir(parents=True)
        (src / "README").write_bytes(b"readme\n")
        (src / "pkg/main.py").write_bytes(b"print(1)\n")
        (src / "pkg/lib/util.py").write_bytes(b"x = 1\n")
        if seed_extra:  # a seed that already holds derived data
            (src / "node_modules/left-pad").mkdir(parents=True)
            (src / "node_modules/left-pad/index.js").write_bytes(b"module.exports = 1\n")
            (src / "pkg/lib/__pycache__").mkdir()
            (src / "pkg/lib/__pycache__/util.cpython-311.pyc").write_bytes(b"\x00pyc")
            (src / "pkg/old.pyc").write_bytes(b"\x00old")
        self.store = Store(tmp / "store", chunk_size=CS)
        self.seed = snapshot(self.store, src)
        self.state = str(tmp / "state")
        self.ov: Overlay | None = None
        self.now = 1_700_000_000_000_000_000

    def clock(self) -> int:
        self.now += 1_000_001
        return self.now

    def mount(self, exclude: tuple[str, ...] | None = EXCLUDE) -> Overlay:
        new = not os.path.exists(os.path.join(self.state, "upper.sqlite"))
        up = Upper.open(self.state, store_root=self.store.root, chunk_size=CS,
                        ref=self.seed if new else None)
        up.set_exclude(exclude)
        self.ov = Overlay(Lower(self.store, up.base), up, uid=UID, gid=GID, clock=self.clock)
        return self.ov

    def remount(self) -> Overlay:
        assert self.ov is not None
        self.ov.close()
        return self.mount(None)

    def sound(self) -> None:
        assert self.ov is not None
        self.ov.commit(durable=True)
        used = (self.ov.used_bytes, self.ov.used_inodes)  # quotas count kept paths right
        self.ov.recount()
        assert (self.ov.used_bytes, self.ov.used_inodes) == used
        probs = check(self.state, self.store)
        assert probs == [], [str(p) for p in probs]


@pytest.fixture()
def env(tmp_path: Path) -> Env:
    e = Env(tmp_path)
    e.mount()
    return e


def mkdirs(ov: Overlay, path: str) -> int:
    ino = ROOT_INO
    for part in path.encode().split(b"/"):
        n = ov.lookup(ino, part)
        if n is None:
            n = ov.mkdir(ino, part, 0o755, UID, GID)
        ino = n.ino
    return ino


def write(ov: Overlay, path: str, data: bytes) -> int:
    head, _, name = path.rpartition("/")
    d = mkdirs(ov, head) if head else ROOT_INO
    n = ov.lookup(d, name.encode())
    if n is None:
        fh, n = ov.create(d, name.encode(), 0o644, os.O_WRONLY, UID, GID)
    else:
        fh = ov.open(n.ino, os.O_WRONLY | os.O_TRUNC)
    ov.write(fh, 0, data)
    ov.release(fh)
    return n.ino


def read(ov: Overlay, path: str) -> bytes:
    n = ov.resolve(path)
    fh = ov.open(n.ino, os.O_RDONLY)
    try:
        return ov.read(fh, 0, n.size + 1)
    finally:
        ov.release(fh)


def tree_paths(store: Store, ref: Ref) -> set[str]:
    return {os.fsdecode(p) for p in tree_listing(store, ref)}


def npm_install(ov: Overlay, where: str = "") -> None:
    pre = where + "/" if where else ""
    write(ov, pre + "node_modules/left-pad/index.js", b"module.exports = 2\n")
    write(ov, pre + "node_modules/left-pad/package.json", b"{}\n")
    write(ov, pre + "node_modules/.bin/x", b"#!/bin/sh\n")


def test_excluded_paths_stay_in_the_upper_and_out_of_the_ref(env: Env) -> None:
    ov = env.ov
    assert ov is not None
    npm_install(ov)
    npm_install(ov, "pkg")  # under a directory of the lower
    write(ov, "pkg/main.py", b"print(2)\n")  # and a change next to it that is frozen
    write(ov, "pkg/lib/__pycache__/util.cpython-311.pyc", b"\x00pyc")
    write(ov, "pkg/lib/stale.pyc", b"\x00stale")
    write(ov, "build/out.o", b"obj")
    write(ov, "pkg/build/keep.txt", b"not anchored at the root: frozen")
    before = overlay_listing(ov, with_ino=True)
    ref = checkpoint_overlay(ov).ref
    paths = tree_paths(env.store, ref)
    assert "pkg/main.py" in paths and "pkg/build/keep.txt" in paths
    assert not [p for p in paths if "node_modules" in p or "__pycache__" in p
                or p.endswith(".pyc") or p.startswith("build")]
    # nothing visible changed: content, attributes and inode numbers
    assert overlay_listing(ov, with_ino=True) == before
    env.sound()
    assert read(ov, "node_modules/left-pad/index.js") == b"module.exports = 2\n"
    # an unchanged overlay gives the same Ref again, and so does a remount
    assert checkpoint_overlay(ov).ref == ref
    ov = env.remount()
    # the base a checkpoint made is known to hold no excluded path: not walked again
    assert ov.excluded_trees.get((bytes(ov.lower.root_tree), b"")) is False
    assert overlay_listing(ov, with_ino=True) == before
    assert checkpoint_overlay(ov).ref == ref
    env.sound()
    # the frozen change is in the tree, the excluded ones in no diff
    assert preview(ov)[0] == ref


def test_changes_below_excluded_paths_after_a_checkpoint(env: Env) -> None:
    ov = env.ov
    assert ov is not None
    npm_install(ov, "pkg")
    ref = checkpoint_overlay(ov).ref
    write(ov, "pkg/node_modules/left-pad/index.js", b"module.exports = 3\n")
    write(ov, "pkg/node_modules/new/a.js", b"a\n")
    ov.unlink(ov.resolve("pkg/node_modules/.bin").ino, b"x")
    assert preview(ov)[0] == ref  # nothing the tree holds changed
    assert checkpoint_overlay(ov).ref == ref
    write(ov, "pkg/lib/util.py", b"x = 2\n")
    ref2 = checkpoint_overlay(ov).ref
    assert ref2 != ref
    changes = [os.fsdecode(c.path) for c in diff_trees(env.store, ref.tree_id, ref2.tree_id)]
    assert changes == ["pkg/lib/util.py"] or set(changes) <= {"pkg", "pkg/lib",
                                                                "pkg/lib/util.py"}
    env.sound()
    ov = env.remount()
    assert read(ov, "pkg/node_modules/new/a.js") == b"a\n"
    assert read(ov, "pkg/node_modules/left-pad/index.js") == b"module.exports = 3\n"
    with pytest.raises(OSError) as ei:
        ov.resolve("pkg/node_modules/.bin/x")
    assert ei.value.errno == errno.ENOENT


def test_a_seed_holding_excluded_paths_loses_them_from_the_next_ref(tmp_path: Path) -> None:
    env = Env(tmp_path, seed_extra=True)
    ov = env.mount()
    assert (bytes(ov.lower.root_tree), b"") not in ov.excluded_trees  # must be looked at
    before = overlay_listing(ov, with_ino=True)
    res = checkpoint_overlay(ov)
    assert not res.unchanged
    paths = tree_paths(env.store, res.ref)
    assert "node_modules" not in paths and "pkg/old.pyc" not in paths
    assert "pkg/lib/__pycache__" not in paths and "pkg/lib/util.py" in paths
    assert overlay_listing(ov, with_ino=True) == before  # still there, same inodes
    env.sound()
    assert checkpoint_overlay(ov).ref == res.ref
    ov = env.remount()
    assert overlay_listing(ov, with_ino=True) == before
    assert read(ov, "pkg/old.pyc") == b"\x00old"
    write(ov, "node_modules/left-pad/index.js", b"changed\n")
    assert checkpoint_overlay(ov).ref == res.ref
    env.sound()


def test_a_whiteout_of_an_excluded_lower_path(tmp_path: Path) -> None:
    env = Env(tmp_path, seed_extra=True)
    ov = env.mount()
    ov.unlink(ov.resolve("pkg").ino, b"old.pyc")
    ref = checkpoint_overlay(ov).ref
    assert "pkg/old.pyc" not in tree_paths(env.store, ref)
    env.sound()
    with pytest.raises(OSError):
        ov.resolve("pkg/old.pyc")
    ov = env.remount()
    with pytest.raises(OSError):
        ov.resolve("pkg/old.pyc")


def test_renames_into_and_out_of_excluded_paths(env: Env) -> None:
    ov = env.ov
    assert ov is not None
    npm_install(ov)
    ref0 = checkpoint_overlay(ov).ref
    nm = ov.resolve("node_modules").ino
    pkg = ov.resolve("pkg").ino
    # a lower file moves into an excluded directory, an excluded file moves out
    ov.rename(pkg, b"main.py", nm, b"main.py")
    ov.rename(ov.resolve("node_modules/left-pad").ino, b"package.json", pkg, b"package.json")
    ref = checkpoint_overlay(ov).ref
    paths = tree_paths(env.store, ref)
    assert "pkg/main.py" not in paths and "pkg/package.json" in paths
    assert ref != ref0
    env.sound()
    # the same name made again in pkg is its own file, not the one in node_modules
    write(ov, "pkg/main.py", b"new\n")
    checkpoint_overlay(ov)
    env.sound()
    ov = env.remount()
    assert read(ov, "node_modules/main.py") == b"print(1)\n"
    assert read(ov, "pkg/main.py") == b"new\n"
    assert ov.resolve("node_modules/main.py").ino != ov.resolve("pkg/main.py").ino
    # a whole lower directory moved into an excluded one
    ov.rename(pkg, b"lib", nm, b"lib")
    ref2 = checkpoint_overlay(ov).ref
    assert "pkg/lib" not in tree_paths(env.store, ref2)
    mkdirs(ov, "pkg/lib")
    write(ov, "pkg/lib/util.py", b"x = 1\n")
    checkpoint_overlay(ov)
    env.sound()
    assert ov.resolve("pkg/lib/util.py").ino != ov.resolve("node_modules/lib/util.py").ino


def test_hard_links_across_the_boundary_fail_with_exdev(env: Env) -> None:
    """A hard-linked file keeps all its names on one side of the exclude patterns: link(2)
    or rename(2) that would give it a name on the other side fails with EXDEV (as across
    file systems), whether the file is in the lower, frozen by a checkpoint, copied up
    from an excluded directory or made in the session; on one side, links work."""
    ov = env.ov
    assert ov is not None
    npm_install(ov)
    pkg, nm = ov.resolve("pkg").ino, ov.resolve("node_modules").ino
    src = ov.resolve("pkg/main.py")  # a lower file
    with pytest.raises(OSError) as e:
        ov.link(src.ino, nm, b"main.py")
    assert e.value.errno == errno.EXDEV
    kept = ov.resolve("node_modules/left-pad/index.js")
    with pytest.raises(OSError) as e:
        ov.link(kept.ino, pkg, b"index.js")
    assert e.value.errno == errno.EXDEV
    write(ov, "pkg/new.py", b"made here\n")
    made = ov.resolve("pkg/new.py")
    with pytest.raises(OSError) as e:
        ov.link(made.ino, nm, b"new.py")
    assert e.value.errno == errno.EXDEV
    # same side: one inode, also across checkpoints and remounts
    ov.forget(ov.link(src.ino, pkg, b"alias.py").ino, 1)
    ov.forget(ov.link(kept.ino, nm, b"alias.js").ino, 1)
    ref = checkpoint_overlay(ov).ref
    listing = tree_listing(env.store, ref)
    assert listing[b"pkg/main.py"].nlink == 2 and b"node_modules/alias.js" not in listing
    env.sound()
    # a frozen link group: neither a name of it nor a directory holding one may cross
    with pytest.raises(OSError) as e:
        ov.rename(pkg, b"alias.py", nm, b"alias.py")
    assert e.value.errno == errno.EXDEV
    with pytest.raises(OSError) as e:
        ov.rename(ov.resolve("").ino, b"pkg", nm, b"pkg")
    assert e.value.errno == errno.EXDEV
    with pytest.raises(OSError) as e:
        ov.rename(nm, b"alias.js", pkg, b"alias.js")
    assert e.value.errno == errno.EXDEV
    ov = env.remount()
    a, b = ov.resolve("pkg/main.py"), ov.resolve("pkg/alias.py")
    assert a.ino == b.ino and a.nlink == 2
    a, b = ov.resolve("node_modules/alias.js"), ov.resolve("node_modules/left-pad/index.js")
    assert a.ino == b.ino and a.nlink == 2
    with pytest.raises(OSError) as e:
        ov.link(a.ino, ov.resolve("pkg").ino, b"x.js")
    assert e.value.errno == errno.EXDEV
    # a file with one name moves across freely
    ov.rename(ov.resolve("pkg").ino, b"new.py", ov.resolve("node_modules").ino, b"new.py")
    checkpoint_overlay(ov)
    env.sound()


def test_restore_keeps_excluded_paths_and_fills_in_missing_ones(tmp_path: Path) -> None:
    env = Env(tmp_path, seed_extra=True)
    ov = env.mount()
    seed = env.seed  # holds node_modules/left-pad, pkg/old.pyc, pkg/lib/__pycache__
    npm_install(ov, "pkg")
    write(ov, "node_modules/left-pad/index.js", b"live\n")
    ov.unlink(ov.resolve("pkg").ino, b"old.pyc")
    write(ov, "pkg/main.py", b"print(2)\n")
    ref = checkpoint_overlay(ov).ref
    nm_ino = ov.resolve("pkg/node_modules/left-pad/index.js").ino
    restore_overlay(ov, seed)
    env.sound()
    assert read(ov, "pkg/main.py") == b"print(1)\n"  # the tree is the seed's
    assert read(ov, "node_modules/left-pad/index.js") == b"live\n"  # live one kept
    assert ov.resolve("pkg/node_modules/left-pad/index.js").ino == nm_ino  # as it was
    assert read(ov, "pkg/old.pyc") == b"\x00old"  # the live tree had none: the seed's
    # the next checkpoint still leaves every excluded path out
    ref2 = checkpoint_overlay(ov).ref
    assert not [p for p in tree_paths(env.store, ref2) if "node_modules" in p
                or p.endswith(".pyc") or "__pycache__" in p]
    env.sound()
    restore_overlay(ov, ref)
    assert read(ov, "pkg/main.py") == b"print(2)\n"
    assert read(ov, "pkg/node_modules/left-pad/index.js") == b"module.exports = 2\n"
    ov = env.remount()
    assert read(ov, "pkg/old.pyc") == b"\x00old"
    env.sound()


def test_restore_to_a_tree_without_the_excluded_paths_parent(env: Env) -> None:
    ov = env.ov
    assert ov is not None
    mkdirs(ov, "app")
    write(ov, "app/index.js", b"1\n")
    npm_install(ov, "app")
    checkpoint_overlay(ov)
    restore_overlay(ov, env.seed)  # the seed has no app/
    env.sound()
    assert read(ov, "app/node_modules/left-pad/index.js") == b"module.exports = 2\n"
    with pytest.raises(OSError):
        ov.resolve("app/index.js")
    assert ov.resolve("app").kind is Kind.DIR
    ov = env.remount()
    assert read(ov, "app/node_modules/.bin/x") == b"#!/bin/sh\n"


def test_without_patterns_nothing_is_kept(env: Env) -> None:
    ov = env.ov
    assert ov is not None
    ov.close()
    ov = env.mount(())  # the patterns removed: node_modules is ordinary data again
    npm_install(ov)
    ref = checkpoint_overlay(ov).ref
    assert "node_modules/left-pad/index.js" in tree_paths(env.store, ref)


def test_gc_keeps_what_kept_excluded_files_read(tmp_path: Path) -> None:
    """An excluded file of the seed is kept in the upper reading the seed's chunks; once no
    listed Ref holds them (the seed forgotten), GC still keeps them for the upper."""
    from fusefs.session.fusetree import pinned_refs, register_state_dir
    from store.gc import gc

    env = Env(tmp_path, seed_extra=True)
    ov = env.mount()
    big = os.urandom(3 * CS + 5)  # several chunks of its own, in the seed alone
    write(ov, "pkg/lib/util.py", b"x = 3\n")
    checkpoint_overlay(ov)
    ov.close()
    # a seed whose excluded file is large, then the seed forgotten
    src = tmp_path / "src2"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg/big.pyc").write_bytes(big)
    seed2 = snapshot(env.store, src)
    env.state = str(tmp_path / "state2")
    env.seed = seed2
    ov = env.mount()
    ref = checkpoint_overlay(ov).ref
    assert "pkg/big.pyc" not in tree_paths(env.store, ref)
    ov.commit(durable=True)
    register_state_dir(env.store, env.state)
    assert env.store.forget(seed2)
    gc(env.store, state_dirs_reader=pinned_refs)
    assert read(ov, "pkg/big.pyc") == big
    ov = env.remount()
    assert read(ov, "pkg/big.pyc") == big
    env.sound()


def _is_excluded(path: bytes, listing: dict[bytes, object]) -> bool:
    """Whether ``path`` is at or below an excluded path of ``listing`` (EXCLUDE above)."""
    parts = path.split(b"/")
    for i in range(1, len(parts) + 1):
        head = b"/".join(parts[:i])
        it = listing.get(head)
        kind = getattr(it, "kind", None)
        name = parts[i - 1]
        if name == b"node_modules" and kind == "dir" or name == b"__pycache__" and \
                kind == "dir" or name.endswith(b".pyc") or \
                (i == 1 and name == b"build" and kind == "dir"):
            return True
    return False


def _split(listing: dict[bytes, object]) -> tuple[dict[bytes, object], dict[bytes, object]]:
    """(the paths a checkpoint freezes, the excluded ones) of a listing."""
    frozen = {p: v for p, v in listing.items() if not _is_excluded(p, listing)}
    return frozen, {p: v for p, v in listing.items() if p not in frozen}


def _no_times(listing: dict[bytes, object]) -> dict[bytes, object]:
    """Without mtimes, and without link counts (a directory counts its excluded
    subdirectories, a file its names below excluded paths, which no tree holds)."""
    import dataclasses

    from ckpt_support import strip

    return {p: dataclasses.replace(v, nlink=0)
            for p, v in strip(listing, owners=True).items()}


@pytest.mark.parametrize("seed", range(12))
def test_random_changes_checkpoints_and_restores(tmp_path: Path, seed: int) -> None:
    """Random changes across the boundary, checkpoints, restores and remounts: each Ref is
    the live tree without its excluded paths; a restore makes the rest the target's and
    keeps every excluded path of the live tree as it was (the target's where it had none);
    the upper stays sound throughout."""
    import random

    rng = random.Random(seed)
    env = Env(tmp_path, seed_extra=seed % 2 == 1)
    ov = env.mount()
    names = [b"a", b"b", b"node_modules", b"__pycache__", b"x.pyc", b"build"]
    refs = [env.seed]

    def rand_path(depth: int = 3) -> str:
        parts = [rng.choice([b"pkg", b"node_modules", b"build", b"d"])]
        for _ in range(rng.randrange(depth)):
            parts.append(rng.choice(names))
        return os.fsdecode(b"/".join(parts))

    def dirs() -> list[str]:
        return [os.fsdecode(p) for p, v in overlay_listing(ov).items()
                if getattr(v, "kind", "") == "dir"]

    for step in range(100):
        op = rng.random()
        try:
            if op < 0.35:
                write(ov, rand_path() + f"/f{rng.randrange(4)}", b"v%d" % step)
            elif op < 0.45:
                mkdirs(ov, rand_path())
            elif op < 0.6:
                ds = dirs()
                if ds:
                    src = ov.resolve(rng.choice(ds))
                    kids = [n for n, _nd, _c in _kids(ov, src.ino)]
                    if kids:
                        dst = ov.resolve(rng.choice(ds + [""]))
                        ov.rename(src.ino, rng.choice(kids), dst.ino, rng.choice(names))
            elif op < 0.7:
                ds = dirs()
                if ds:
                    d = ov.resolve(rng.choice(ds))
                    kids = [(n, nd) for n, nd, _c in _kids(ov, d.ino)]
                    if kids:
                        name, nd = rng.choice(kids)
                        (ov.rmdir if nd.kind is Kind.DIR else ov.unlink)(d.ino, name)
            elif op < 0.75:  # any file, any side (across the boundary: EXDEV)
                files = [os.fsdecode(p) for p, v in overlay_listing(ov).items()
                         if getattr(v, "kind", "") == "file"]
                ds = dirs()
                if files and ds:
                    f = ov.resolve(rng.choice(files))
                    ov.forget(ov.link(f.ino, ov.resolve(rng.choice(ds + [""])).ino,
                                      rng.choice(names)).ino, 1)
            elif op < 0.85:
                live = overlay_listing(ov)
                ref = checkpoint_overlay(ov).ref
                frozen, _kept = _split(live)
                assert _no_times(tree_listing(env.store, ref)) == _no_times(frozen)
                assert overlay_listing(ov) == live
                refs.append(ref)
            elif op < 0.95:
                target = rng.choice(refs)
                before = overlay_listing(ov)
                restore_overlay(ov, target)
                after = overlay_listing(ov)
                _f_before, kept_before = _split(before)
                frozen_after, kept_after = _split(after)
                want = _split(tree_listing(env.store, target))[0]
                for p in want:  # the target's tree, but what kept paths shadow
                    if not _is_excluded(p, after):
                        assert frozen_after.get(p) is not None, p
                for p, v in kept_before.items():  # kept paths as they were, where the
                    if p in after and _is_excluded(p, after):  # target left room
                        assert _no_times({p: after[p]}) == _no_times({p: v}), p
            else:
                ov = env.remount()
        except OSError:
            pass
        if step % 10 == 9:
            env.sound()
    env.sound()
    live = overlay_listing(ov, with_ino=True)
    ov = env.remount()
    assert overlay_listing(ov, with_ino=True) == live


def _kids(ov: Overlay, ino: int) -> list[tuple[bytes, object, int]]:
    fh = ov.opendir(ino)
    try:
        return [(n, nd, c) for n, nd, c in ov.readdir(fh, 0) if n not in (b".", b"..")]
    finally:
        ov.releasedir(fh)


def test_excluded_paths_are_no_changes_that_keep_a_session_from_moving(env: Env) -> None:
    """A stopped session whose upper holds only excluded paths has nothing a checkpoint
    would take: it may move to another host (which starts without them)."""
    from fusefs.session.fusetree import upper_holds_changes

    ov = env.ov
    assert ov is not None
    npm_install(ov, "pkg")
    ref = checkpoint_overlay(ov).ref
    write(ov, "pkg/node_modules/left-pad/index.js", b"rebuilt\n")
    ov.close()
    assert not upper_holds_changes(env.store, env.state, ref)
    ov = env.mount(None)
    write(ov, "pkg/main.py", b"print(3)\n")
    ov.close()
    assert upper_holds_changes(env.store, env.state, ref)


def test_restore_counts_no_group_name_a_kept_directory_shadows(tmp_path: Path) -> None:
    """A target whose hard-link groups have names below node_modules, restored where the
    live tree keeps its own node_modules: those names do not show, and the group's file
    counts only the names that do (st_nlink), after a remount and a checkpoint too, and
    again after a second restore to the same target."""
    env = Env(tmp_path)
    src = tmp_path / "older"  # a tree imported before the policy, node_modules and all
    (src / "pkg").mkdir(parents=True)
    (src / "node_modules").mkdir()
    (src / "pkg/a.txt").write_bytes(b"shared\n")
    os.link(src / "pkg/a.txt", src / "node_modules/x.txt")
    (src / "pkg/b.txt").write_bytes(b"b\n")
    os.link(src / "pkg/b.txt", src / "pkg/c.txt")
    os.link(src / "pkg/b.txt", src / "node_modules/b.txt")
    target = snapshot(env.store, src)
    ov = env.mount()
    npm_install(ov)  # the live tree keeps a node_modules of its own
    checkpoint_overlay(ov)

    def counts(ov: Overlay) -> tuple[int, int, int]:
        a, b, c = (ov.resolve(p) for p in ("pkg/a.txt", "pkg/b.txt", "pkg/c.txt"))
        assert b.ino == c.ino != a.ino
        assert not (ov.resolve("node_modules").entries or {}).keys() & {b"x.txt", b"b.txt"}
        return a.nlink, b.nlink, c.nlink

    restore_overlay(ov, target)
    assert counts(ov) == (1, 2, 2)
    assert read(ov, "node_modules/left-pad/index.js") == b"module.exports = 2\n"
    env.sound()
    ov = env.remount()
    assert counts(ov) == (1, 2, 2)
    ref = checkpoint_overlay(ov).ref
    listing = tree_listing(env.store, ref)
    assert (listing[b"pkg/a.txt"].nlink, listing[b"pkg/b.txt"].nlink) == (1, 2)
    assert counts(ov) == (1, 2, 2)
    env.sound()
    restore_overlay(ov, target)
    assert counts(ov) == (1, 2, 2)
    env.sound()
    ov = env.remount()
    assert counts(ov) == (1, 2, 2)
