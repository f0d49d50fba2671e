"""Look inside a snapshot without materializing it: ``resolve``, ``ls``, ``cat``.

Paths inside a snapshot are raw bytes (a ``str`` is encoded with the file-system encoding),
``/``-separated and relative to the snapshot root; empty components and ``.`` are ignored,
leading and trailing slashes too. Symlinks inside the snapshot are never followed, so a
path through a symlink does not exist here. Reads only; every object read is verified.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from . import chunker
from .errors import IntegrityError, SnapshotNotFoundError, StoreError
from .objects import Store
from .ref import Ref
from .tree import Entry, Kind

PathLike = bytes | str


def _components(path: PathLike) -> list[bytes]:
    raw = os.fsencode(path)
    return [c for c in raw.split(b"/") if c and c != b"."]


def resolve(store: Store, ref: Ref | str, path: PathLike = b"") -> Entry | None:
    """The entry at ``path`` in snapshot ``ref``, or None for the root itself.

    Raises SnapshotNotFoundError(ref, path) if a component is missing, is ``..``, or is
    reached through a non-directory (symlinks are not followed); ObjectNotFoundError if
    the snapshot is not in the store.
    """
    ref = Ref.parse(ref)
    parts = _components(path)
    tree = store.root_tree(ref)
    entry: Entry | None = None
    for part in parts:
        if entry is not None:
            if entry.kind is not Kind.DIR or entry.tree_id is None:
                raise SnapshotNotFoundError(str(ref), os.fsdecode(path))
            tree = store.get_tree(entry.tree_id)
        entry = tree.get(part) if part != b".." else None
        if entry is None:
            raise SnapshotNotFoundError(str(ref), os.fsdecode(path))
    return entry


def ls(store: Store, ref: Ref | str, path: PathLike = b"") -> list[Entry]:
    """The entries of the directory at ``path`` sorted by name, or ``[entry]`` when the
    path names something else (like ``ls`` of a file). Errors as ``resolve``."""
    ref = Ref.parse(ref)
    entry = resolve(store, ref, path)
    if entry is None:
        return list(store.get_tree(ref.tree_id).entries)
    if entry.kind is Kind.DIR and entry.tree_id is not None:
        return list(store.get_tree(entry.tree_id).entries)
    return [entry]


def cat(store: Store, ref: Ref | str, path: PathLike) -> Iterator[bytes]:
    """Yield the content of the file at ``path``, one verified chunk at a time.

    Raises as ``resolve``; StoreError if the path is not a regular file (a directory, a
    symlink, ...); IntegrityError if the content does not add up to the entry's size.
    """
    ref = Ref.parse(ref)
    entry = resolve(store, ref, path)
    if entry is None or entry.kind is not Kind.FILE:
        what = "the snapshot root" if entry is None else f"a {entry.kind.name.lower()}"
        raise StoreError(f"{os.fsdecode(path)!r} in {ref} is {what}, not a file")
    return _content(store, ref, entry, path)


def _content(store: Store, ref: Ref, entry: Entry, path: PathLike) -> Iterator[bytes]:
    total = 0
    cs = store.chunk_size
    for first, k, cid in entry.chunks.spans():
        want = chunker.chunk_length(first, entry.size, cs)
        # A run (the holes of a sparse file) is read once and yielded k times.
        data = chunker.zeros(cs) if want == cs and cid == chunker.zero_chunk_id(cs) else \
            store.read_object(cid)
        for _ in range(k):
            total += len(data)
            yield data
    if total != entry.size:
        raise IntegrityError(str(ref), f"{os.fsdecode(path)!r} has {total} bytes of content, "
                             f"its entry says {entry.size}")
