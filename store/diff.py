"""Differences between two snapshots (CONTRACT 1.8), found by walking both trees.

Owns the tree-against-tree walk. Two directory entries with the same child tree id are
never opened, so the cost grows with the difference, not with the tree. Reads only.

What is reported, one ``Change`` per path:

- ``added`` / ``removed``: the path exists on one side only. For a directory the
  directory itself and (a documented choice, so that a caller invalidating caches or
  listing files needs nothing else) every path below it, each as its own change.
- ``type_changed``: the kind differs (file -> symlink, dir -> file, ...); when a directory
  is involved its descendants follow as removed (old side) or added (new side).
- ``modified``: same kind, different entry: content, size, mode, owner, mtime, xattrs,
  symlink target or hard-link group. A directory is ``modified`` only when its own
  metadata differs (its mtime usually does when entries were added or removed); changes
  below it are reported on their own paths.

Changes are in path order component by component (a directory comes right before its
descendants), which is also bytewise order of each path's component list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .objects import Store
from .ref import ObjectId, Ref
from .tree import Entry, Kind

Status = Literal["added", "removed", "modified", "type_changed"]


@dataclass(frozen=True, slots=True)
class Change:
    """One changed path: root-relative, ``/``-joined raw bytes; ``old`` is None for an
    addition and ``new`` is None for a removal."""

    path: bytes
    status: Status
    old: Entry | None
    new: Entry | None


def _same_meta(a: Entry, b: Entry) -> bool:
    """Equal entries apart from a directory's child tree id."""
    return (a.mode, a.uid, a.gid, a.mtime_ns, a.xattrs, a.link_group) == (
        b.mode, b.uid, b.gid, b.mtime_ns, b.xattrs, b.link_group)


def _join(prefix: bytes, name: bytes) -> bytes:
    return prefix + b"/" + name if prefix else name


def _subtree(store: Store, tree_id: ObjectId, prefix: bytes, status: Status,
             out: list[Change]) -> None:
    """Append every path below ``prefix`` (tree ``tree_id``) as ``status``."""
    stack = [(prefix, iter(store.get_tree(tree_id).entries))]
    while stack:
        pre, it = stack[-1]
        e = next(it, None)
        if e is None:
            stack.pop()
            continue
        path = _join(pre, e.name)
        if status == "added":
            out.append(Change(path, status, None, e))
        else:
            out.append(Change(path, status, e, None))
        if e.kind is Kind.DIR and e.tree_id is not None:
            stack.append((path, iter(store.get_tree(e.tree_id).entries)))


def diff_trees(store: Store, tree_a: ObjectId, tree_b: ObjectId,
               prefix: bytes = b"") -> list[Change]:
    """The changes from tree ``tree_a`` to tree ``tree_b``, paths under ``prefix``.

    Raises ObjectNotFoundError or IntegrityError if a tree that differs cannot be read.
    """
    out: list[Change] = []
    if tree_a == tree_b:
        return out
    _walk(store, tree_a, tree_b, prefix, out)
    return out


def _walk(store: Store, tree_a: ObjectId, tree_b: ObjectId, prefix: bytes,
          out: list[Change]) -> None:
    # An explicit stack of merge positions keeps deep trees off the Python stack.
    stack = [(prefix, store.get_tree(tree_a).entries, store.get_tree(tree_b).entries, 0, 0)]
    while stack:
        pre, ea, eb, i, j = stack.pop()
        while i < len(ea) or j < len(eb):
            a = ea[i] if i < len(ea) else None
            b = eb[j] if j < len(eb) else None
            if b is None or (a is not None and a.name < b.name):
                assert a is not None
                i += 1
                path = _join(pre, a.name)
                out.append(Change(path, "removed", a, None))
                if a.kind is Kind.DIR and a.tree_id is not None:
                    _subtree(store, a.tree_id, path, "removed", out)
                continue
            if a is None or b.name < a.name:
                j += 1
                path = _join(pre, b.name)
                out.append(Change(path, "added", None, b))
                if b.kind is Kind.DIR and b.tree_id is not None:
                    _subtree(store, b.tree_id, path, "added", out)
                continue
            i += 1
            j += 1
            path = _join(pre, a.name)
            if a.kind is not b.kind:
                out.append(Change(path, "type_changed", a, b))
                if a.kind is Kind.DIR and a.tree_id is not None:
                    _subtree(store, a.tree_id, path, "removed", out)
                if b.kind is Kind.DIR and b.tree_id is not None:
                    _subtree(store, b.tree_id, path, "added", out)
                continue
            if a.kind is Kind.DIR:
                if not _same_meta(a, b):
                    out.append(Change(path, "modified", a, b))
                if a.tree_id != b.tree_id and a.tree_id is not None and b.tree_id is not None:
                    # Finish this directory after the child: push the rest, then the child.
                    stack.append((pre, ea, eb, i, j))
                    stack.append((path, store.get_tree(a.tree_id).entries,
                                  store.get_tree(b.tree_id).entries, 0, 0))
                    break
                continue
            if a != b:
                out.append(Change(path, "modified", a, b))


def diff(store: Store, ref_a: Ref | str, ref_b: Ref | str) -> list[Change]:
    """The changes from snapshot ``ref_a`` to snapshot ``ref_b`` (see the module docstring).

    Raises InvalidRefError for a bad Ref text, ObjectNotFoundError if a needed tree is not
    in the store, IntegrityError if one does not verify.
    """
    a = Ref.parse(ref_a)
    b = Ref.parse(ref_b)
    return diff_trees(store, a.tree_id, b.tree_id)
