"""The dirs cache: lets a snapshot take an unchanged directory's tree id without opening,
reading or encoding its entries (table ``dirs_cache``, documented in schema.py).

A row, keyed by the directory's absolute path, records what the directory looked like when
a snapshot encoded it: its own (st_ino, mtime, ctime), the names of its subdirectories and
of its other entries, a digest over those names and every non-directory entry's lstat
(mode, inode, link count, owner, size, mtime, ctime), a digest over its subdirectory
entries as encoded (name, mode, owner, mtime, xattrs, child tree id), and the tree id it
was encoded to.

How a snapshot uses a row (store/snapshot.py):

- If the directory's own (st_ino, mtime, ctime) equal the row's, the names are the row's
  (creating, removing or renaming an entry changes the directory's mtime and ctime, and
  ctime cannot be set from user space), so the directory is not listed; otherwise it is.
- Each non-directory entry is lstat'ed; if the stat digest equals the row's, the row is a
  candidate: only the subdirectories are walked (each may be a hit of its own). When they
  give the row's children digest, the row's tree id is the directory's, and its files,
  symlinks and special files are never opened. Otherwise they are read as usual (through
  the files cache) and the directory is encoded again.
- Content and xattr changes show: a write changes mtime and ctime, ``touch -d`` still
  changes ctime, a change of any xattr, mode or owner changes ctime; a rename within the
  directory changes its mtime and ctime and the entry names.
- Same-tick rule (CONTRACT 1.4): a row is written only if every mtime and ctime it depends
  on (the directory's own and its non-directory entries') is older than the recording
  snapshot's trust horizon, so a change in the same timestamp tick as the read always
  shows as a newer timestamp.
- Hard links: a directory holding a hard-linked file anywhere below it is never recorded
  (its tree depends on where the file's other names are); a file that gains a second name
  changes its link count and ctime, so an existing row stops matching.
- Completeness: a row is trusted only while its tree id is indexed. An indexed
  tree is complete (a writer indexes a tree in the same transaction as every new object
  below it) except after GC, which keeps unreachable objects of packs it does not rewrite:
  so GC deletes every row whose tree it does not keep live (``prune``).

Everything here is a hint: a wrong or missing row costs time, never a wrong Ref, as long as
the rules above hold. ``rebuild-index`` drops the table.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import struct
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import blake3

from .tree import Entry, Kind

_OWN = struct.Struct("<Qqq")  # st_ino, mtime_ns, ctime_ns of the directory itself
_ENT = struct.Struct("<HIQQIIqqq")  # name length, st_mode, ino, nlink, uid, gid, size, m, c
_SUBDIR = struct.Struct("<HIIIqI")  # name length, mode, uid, gid, mtime_ns, xattr count
_XATTR = struct.Struct("<HI")  # xattr name length, value length
_BATCH = 500  # keys per lookup query
Present = Callable[[list[bytes]], Iterable[bytes]]
"""``present(ids)``: which of the object ``ids`` are indexed (a shared catalog's lookup)."""


class Row(NamedTuple):
    """One dirs cache row as a snapshot reads it (see the module docstring): ``subdirs``
    and ``others`` are the names of the subdirectories and of the other entries, each
    sorted and joined by NUL (names never hold NUL or ``/``)."""

    own: bytes
    subdirs: bytes
    others: bytes
    stat_digest: bytes
    children_digest: bytes
    tree_id: bytes


def own_sig(st: os.stat_result) -> bytes:
    """The directory's own (st_ino, mtime, ctime), packed."""
    return _OWN.pack(st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def join_names(names: Iterable[bytes]) -> bytes:
    """Names sorted and joined by NUL, as a row holds them."""
    return b"\0".join(sorted(names))


def split_names(blob: bytes) -> list[bytes]:
    """The inverse of ``join_names``."""
    return blob.split(b"\0") if blob else []


def stat_digest(subdirs: Iterable[bytes],
                others: Iterable[tuple[bytes, os.stat_result]]) -> bytes:
    """The digest over a directory's subdirectory names and the (name, lstat) of each of
    its other entries; the order given does not matter."""
    parts = [join_names(subdirs), b"/"]
    for name, st in sorted(others, key=_first):
        parts.append(_ENT.pack(len(name), st.st_mode, st.st_ino, st.st_nlink, st.st_uid,
                               st.st_gid, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        parts.append(name)
    return blake3.blake3(b"".join(parts)).digest()


class Lstats(NamedTuple):
    """What ``lstat_row`` found: the lstat of each non-directory by name, their stat
    digest (as ``stat_digest`` computes it), and the regular files' count and bytes."""

    by_name: dict[bytes, os.stat_result]
    digest: bytes
    files: int
    bytes: int


def lstat_row(fd: int, row: Row) -> Lstats | None:
    """lstat the non-directories that ``row`` names in the directory open at ``fd``;
    None if one is gone or has become a directory (the directory must be listed)."""
    by_name = {}
    parts = [row.subdirs, b"/"]
    files = nbytes = 0
    pack, lstat, s_isdir, s_isreg = _ENT.pack, os.stat, stat.S_ISDIR, stat.S_ISREG
    try:
        for name in split_names(row.others):  # sorted, as stat_digest sorts them
            st = lstat(name, dir_fd=fd, follow_symlinks=False)
            mode = st.st_mode
            if s_isdir(mode):
                return None
            by_name[name] = st
            parts.append(pack(len(name), mode, st.st_ino, st.st_nlink, st.st_uid, st.st_gid,
                              st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            parts.append(name)
            if s_isreg(mode):
                files += 1
                nbytes += st.st_size
    except OSError:
        return None
    return Lstats(by_name, blake3.blake3(b"".join(parts)).digest(), files, nbytes)


def children_digest(entries: list[Entry]) -> bytes:
    """The digest over the subdirectory entries among ``entries`` (all with tree ids)."""
    if not entries:
        return NO_CHILDREN
    parts = []
    for e in sorted((e for e in entries if e.kind is Kind.DIR), key=_name):
        assert e.tree_id is not None
        parts.append(_SUBDIR.pack(len(e.name), e.mode, e.uid, e.gid, e.mtime_ns,
                                  len(e.xattrs)))
        parts.append(e.name)
        parts.append(e.tree_id)
        for k, v in e.xattrs:
            parts.append(_XATTR.pack(len(k), len(v)))
            parts.append(k)
            parts.append(v)
    return blake3.blake3(b"".join(parts)).digest()


NO_CHILDREN = blake3.blake3(b"").digest()
"""The children digest of a directory without subdirectories."""


def _first(item: tuple[bytes, object]) -> bytes:
    return item[0]


def _name(e: Entry) -> bytes:
    return e.name


def _indexed_only(rows: dict[bytes, Row], present: Present) -> dict[bytes, Row]:
    known = set(present(list({r.tree_id for r in rows.values()})))
    return {k: r for k, r in rows.items() if r.tree_id in known}


def load(conn: sqlite3.Connection, keys: list[bytes],
         present: Present | None = None) -> dict[bytes, Row]:
    """The rows of ``keys`` whose tree is indexed, by key. ``present(ids)`` says which tree
    ids are indexed when the object index is not in ``conn`` (a shared catalog): the rows
    are then read without the join and filtered by one call."""
    out: dict[bytes, Row] = {}
    if present is not None:
        for i in range(0, len(keys), _BATCH):
            batch = keys[i:i + _BATCH]
            q = ("SELECT path, own, subdirs, others, stat_digest, children_digest, tree_id "
                 "FROM dirs_cache WHERE path IN (" + ",".join("?" * len(batch)) + ")")
            for path, *rest in conn.execute(q, batch):
                out[path] = Row(*rest)
        return _indexed_only(out, present)
    for i in range(0, len(keys), _BATCH):
        batch = keys[i:i + _BATCH]
        q = ("SELECT d.path, d.own, d.subdirs, d.others, d.stat_digest, d.children_digest, "
             "d.tree_id "
             "FROM dirs_cache d JOIN objects o ON o.id = d.tree_id "
             "WHERE d.path IN (" + ",".join("?" * len(batch)) + ")")
        for path, *rest in conn.execute(q, batch):
            out[path] = Row(*rest)
    return out


def load_under(conn: sqlite3.Connection, prefix: bytes, cap: int,
               present: Present | None = None) -> dict[bytes, Row] | None:
    """Every row whose key starts with ``prefix`` and whose tree is indexed, by key, in
    one query; None if there are more than ``cap`` rows (then ask per directory).
    ``present`` as for ``load``."""
    end = prefix[:-1] + bytes((prefix[-1] + 1,)) if prefix and prefix[-1] < 255 else None
    join = "" if present is not None else "JOIN objects o ON o.id = d.tree_id "
    q = ("SELECT d.path, d.own, d.subdirs, d.others, d.stat_digest, d.children_digest, "
         "d.tree_id "
         "FROM dirs_cache d " + join +
         "WHERE d.path >= ?" + (" AND d.path < ?" if end is not None else "") + " LIMIT ?")
    args: list[object] = [prefix]
    if end is not None:
        args.append(end)
    args.append(cap + 1)
    rows = conn.execute(q, args).fetchall()
    if len(rows) > cap:
        return None
    out = {path: Row(*rest) for path, *rest in rows if path.startswith(prefix)}
    return out if present is None else _indexed_only(out, present)


def write(conn: sqlite3.Connection, rows: list[tuple[bytes, Row, int]]) -> None:
    """Insert or replace (key, row, trusted_before_ns) rows, inside the caller's
    transaction."""
    conn.executemany(
        "INSERT OR REPLACE INTO dirs_cache(path, own, subdirs, others, stat_digest, "
        "children_digest, tree_id, trusted_before_ns) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        [(key, *row, horizon) for key, row, horizon in rows])


def prune(conn: sqlite3.Connection, live: AbstractSet[bytes]) -> int:
    """Delete the rows whose tree id is not in ``live``, inside the caller's transaction
    (GC, once it knows what it keeps); return how many."""
    stale = [(path,) for path, tid in conn.execute("SELECT path, tree_id FROM dirs_cache")
             if tid not in live]
    conn.executemany("DELETE FROM dirs_cache WHERE path=?", stale)
    return len(stale)
