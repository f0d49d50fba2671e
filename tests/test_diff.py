"""diff(ref_a, ref_b) (CONTRACT 1.8): what changed between two snapshots, found by walking
both trees and skipping equal subtrees by id."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from store.diff import Change, diff, diff_trees
from store.errors import InvalidRefError
from store.objects import Store
from store.ref import ObjectId
from store.snapshot import snapshot
from store.tree import Kind, Tree


class CountingStore(Store):
    """A real store that counts which trees a caller asks for."""

    def __init__(self, *a, **k) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **k)
        self.asked: list[ObjectId] = []

    def get_tree(self, tree_id: ObjectId) -> Tree:
        self.asked.append(tree_id)
        return super().get_tree(tree_id)


def summary(changes: list[Change]) -> list[tuple[str, str]]:
    return [(os.fsdecode(c.path), c.status) for c in changes]


def keep_dir_times(root: Path, fn) -> None:  # type: ignore[no-untyped-def]
    """Run ``fn`` and put every directory's mtime back, so only deliberate changes show."""
    times = {}
    for dirpath, _, _ in os.walk(root):
        times[dirpath] = os.lstat(dirpath).st_mtime_ns
    fn()
    for dirpath, t in times.items():
        if os.path.isdir(dirpath) and not os.path.islink(dirpath):
            os.utime(dirpath, ns=(t, t))


def test_every_kind_of_change(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("mod.txt", "chmod.txt", "gone.txt", "same.txt", "t1", "t3", "linked"):
        (src / name).write_bytes(name.encode() + b"\n")
    (src / "gone-dir" / "y").mkdir(parents=True)
    (src / "gone-dir" / "x").write_bytes(b"x")
    (src / "gone-dir" / "y" / "z").write_bytes(b"z")
    (src / "t2").mkdir()
    (src / "t2" / "c").write_bytes(b"c")
    (src / "perm-dir").mkdir()
    (src / "perm-dir" / "inner").write_bytes(b"unchanged")
    os.symlink("old-target", src / "link")
    a = snapshot(store, src)

    def change() -> None:
        (src / "mod.txt").write_bytes(b"changed content\n")
        os.chmod(src / "chmod.txt", 0o600)
        os.unlink(src / "gone.txt")
        shutil.rmtree(src / "gone-dir")
        os.unlink(src / "t1")
        (src / "t1").mkdir()
        (src / "t1" / "k").write_bytes(b"k")
        shutil.rmtree(src / "t2")
        os.symlink("somewhere", src / "t2")
        os.unlink(src / "t3")
        os.symlink("t3-target", src / "t3")
        os.chmod(src / "perm-dir", 0o700)
        os.unlink(src / "link")
        os.symlink("new-target", src / "link")
        os.link(src / "linked", src / "linked2")
        (src / "new.txt").write_bytes(b"new\n")
        (src / "new-dir" / "b").mkdir(parents=True)
        (src / "new-dir" / "a").write_bytes(b"a")
        (src / "new-dir" / "b" / "c").write_bytes(b"c")

    keep_dir_times(src, change)
    b = snapshot(store, src)
    changes = diff(store, a, b)
    assert summary(changes) == [
        ("chmod.txt", "modified"),
        ("gone-dir", "removed"),
        ("gone-dir/x", "removed"),
        ("gone-dir/y", "removed"),
        ("gone-dir/y/z", "removed"),
        ("gone.txt", "removed"),
        ("link", "modified"),
        ("linked", "modified"),  # it joined a hard-link group
        ("linked2", "added"),
        ("mod.txt", "modified"),
        ("new-dir", "added"),
        ("new-dir/a", "added"),
        ("new-dir/b", "added"),
        ("new-dir/b/c", "added"),
        ("new.txt", "added"),
        ("perm-dir", "modified"),
        ("t1", "type_changed"),
        ("t1/k", "added"),
        ("t2", "type_changed"),
        ("t2/c", "removed"),
        ("t3", "type_changed"),
    ]
    by_path = {c.path: c for c in changes}
    t2 = by_path[b"t2"]
    assert t2.old is not None and t2.new is not None
    assert (t2.old.kind, t2.new.kind) == (Kind.DIR, Kind.SYMLINK)
    assert by_path[b"gone.txt"].new is None and by_path[b"new.txt"].old is None
    # The reverse diff mirrors it.
    back = {(p, s) for p, s in summary(diff(store, b, a))}
    flip = {"added": "removed", "removed": "added"}
    assert back == {(p, flip.get(s, s)) for p, s in summary(changes)}


def test_equal_refs_and_nested_changes(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"1")
    a = snapshot(store, src)
    assert diff(store, a, a) == [] and diff(store, str(a), str(a)) == []
    keep_dir_times(src, lambda: (src / "a" / "f").write_bytes(b"2"))
    b = snapshot(store, src)
    assert summary(diff(store, a, b)) == [("a/f", "modified")]
    # An entry added to a directory changes the directory's mtime: both are reported.
    (src / "a" / "g").write_bytes(b"g")
    c = snapshot(store, src)
    assert summary(diff(store, b, c)) == [("a", "modified"), ("a/g", "added")]
    with pytest.raises(InvalidRefError):
        diff(store, "not a ref", a)


def test_order_is_by_component(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    a = snapshot(store, src)
    (src / "a").mkdir()
    (src / "a" / "x").write_bytes(b"")
    (src / "a-b").write_bytes(b"")
    (src / "a.c").write_bytes(b"")
    b = snapshot(store, src)
    assert [c.path for c in diff(store, a, b)] == [b"a", b"a/x", b"a-b", b"a.c"]


def test_equal_subtrees_are_not_opened(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "store")
    src = tmp_path / "src"
    for i in range(40):
        d = src / "keep" / f"d{i:02d}"
        d.mkdir(parents=True)
        (d / "f").write_bytes(f"{i}".encode())
    (src / "top.txt").write_bytes(b"1")
    a = snapshot(store, src)
    keep_dir_times(src, lambda: (src / "top.txt").write_bytes(b"2"))
    b = snapshot(store, src)
    keep_dir_times(src, lambda: (src / "keep" / "d07" / "f").write_bytes(b"changed"))
    c = snapshot(store, src)

    store.asked.clear()
    assert summary(diff(store, a, b)) == [("top.txt", "modified")]
    assert store.asked == [a.tree_id, b.tree_id]  # `keep` has one id on both sides

    store.asked.clear()
    assert summary(diff(store, b, c)) == [("keep/d07/f", "modified")]
    assert len(store.asked) == 6  # root, keep and keep/d07 on each side, nothing else


def test_diff_trees_with_a_prefix(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    a = snapshot(store, src)
    (src / "n").write_bytes(b"")
    b = snapshot(store, src)
    assert [c.path for c in diff_trees(store, a.tree_id, b.tree_id, b"mnt/x")] == [b"mnt/x/n"]
    assert diff_trees(store, a.tree_id, a.tree_id) == []
