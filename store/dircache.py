"""The dirs cache: lets a snapshot take an unchanged directory's tree id without opening,
reading or encoding its entries (table ``dirs_cache``, documented in schema.py).

A row, keyed by the directory's absolute path, records what the directory looked like when
a snapshot encoded it: its own (st_ino, mtime, ctime), its entry names with their types, a
digest over every non-directory entry's lstat (mode, inode, link count, owner, size, mtime,
ctime) and every subdirectory's name, a digest over its subdirectory entries as encoded
(name, mode, owner, mtime, xattrs, child tree id), and the tree id it was encoded to.

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
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from typing import NamedTuple

import blake3

from .tree import Entry, Kind

HINT_DIR, HINT_FILE, HINT_OTHER = 1, 2, 3
"""Entry types as a listing gives them: directory, regular file, anything else."""

_OWN = struct.Struct("<Qqq")  # st_ino, mtime_ns, ctime_ns of the directory itself
_ENT = struct.Struct("<HIQQIIqqq")  # name length, st_mode, ino, nlink, uid, gid, size, m, c
_DIR_MARK = struct.Struct("<HI")  # name length, S_IFDIR: a subdirectory
_SUBDIR = struct.Struct("<HIIIqI")  # name length, mode, uid, gid, mtime_ns, xattr count
_XATTR = struct.Struct("<HI")  # xattr name length, value length
_BATCH = 500  # keys per lookup query


class Row(NamedTuple):
    """One dirs cache row as a snapshot reads it (see the module docstring)."""

    own: bytes
    names: bytes
    stat_digest: bytes
    children_digest: bytes
    tree_id: bytes


def own_sig(st: os.stat_result) -> bytes:
    """The directory's own (st_ino, mtime, ctime), packed."""
    return _OWN.pack(st.st_ino, st.st_mtime_ns, st.st_ctime_ns)


def encode_names(names: Iterable[tuple[bytes, int]]) -> bytes:
    """(name, hint) pairs as one blob, in name order: each is the hint byte then the name,
    joined by NUL (names never hold NUL or ``/``)."""
    return b"\0".join(bytes((hint,)) + name for name, hint in sorted(names))


def decode_names(blob: bytes) -> list[tuple[bytes, int]]:
    """The inverse of ``encode_names``."""
    if not blob:
        return []
    return [(n[1:], n[0]) for n in blob.split(b"\0")]


def stat_digest(items: Iterable[tuple[bytes, os.stat_result | None]]) -> bytes:
    """The digest over (name, lstat) of a directory's entries, None standing for a
    subdirectory; order does not matter (names are unique)."""
    parts = []
    for name, st in sorted(items, key=_first):
        if st is None:
            parts.append(_DIR_MARK.pack(len(name), stat.S_IFDIR))
        else:
            parts.append(_ENT.pack(len(name), st.st_mode, st.st_ino, st.st_nlink, st.st_uid,
                                   st.st_gid, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        parts.append(name)
    return blake3.blake3(b"".join(parts)).digest()


def lstat_row(fd: int, row: Row) -> tuple[list[tuple[bytes, int]],
                                          dict[bytes, os.stat_result], bytes] | None:
    """For the directory open at ``fd`` whose names are ``row``'s: lstat every
    non-directory; return (names, lstats by name, stat digest), the same as ``stat_digest``
    gives, or None if an entry is gone or has become a directory (list it instead)."""
    names = decode_names(row.names)  # in name order, as stat_digest sorts them
    lstats = {}
    parts = []
    pack_ent, pack_dir, s_ifdir = _ENT.pack, _DIR_MARK.pack, stat.S_IFDIR
    try:
        for name, hint in names:
            if hint == HINT_DIR:
                parts.append(pack_dir(len(name), s_ifdir))
            else:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    return None
                lstats[name] = st
                parts.append(pack_ent(len(name), st.st_mode, st.st_ino, st.st_nlink, st.st_uid,
                                      st.st_gid, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
            parts.append(name)
    except OSError:
        return None
    return names, lstats, blake3.blake3(b"".join(parts)).digest()


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


def load(conn: sqlite3.Connection, keys: list[bytes]) -> dict[bytes, Row]:
    """The rows of ``keys`` whose tree is indexed, by key."""
    out: dict[bytes, Row] = {}
    for i in range(0, len(keys), _BATCH):
        batch = keys[i:i + _BATCH]
        q = ("SELECT d.path, d.own, d.names, d.stat_digest, d.children_digest, d.tree_id "
             "FROM dirs_cache d JOIN objects o ON o.id = d.tree_id "
             "WHERE d.path IN (" + ",".join("?" * len(batch)) + ")")
        for path, *rest in conn.execute(q, batch):
            out[path] = Row(*rest)
    return out


def load_under(conn: sqlite3.Connection, prefix: bytes, cap: int) -> dict[bytes, Row] | None:
    """Every row whose key starts with ``prefix`` and whose tree is indexed, by key, in
    one query; None if there are more than ``cap`` rows (then ask per directory)."""
    end = prefix[:-1] + bytes((prefix[-1] + 1,)) if prefix and prefix[-1] < 255 else None
    q = ("SELECT d.path, d.own, d.names, d.stat_digest, d.children_digest, d.tree_id "
         "FROM dirs_cache d JOIN objects o ON o.id = d.tree_id "
         "WHERE d.path >= ?" + (" AND d.path < ?" if end is not None else "") + " LIMIT ?")
    args: list[object] = [prefix]
    if end is not None:
        args.append(end)
    args.append(cap + 1)
    rows = conn.execute(q, args).fetchall()
    if len(rows) > cap:
        return None
    return {path: Row(*rest) for path, *rest in rows if path.startswith(prefix)}


def write(conn: sqlite3.Connection, rows: list[tuple[bytes, Row, int]]) -> None:
    """Insert or replace (key, row, trusted_before_ns) rows, inside the caller's
    transaction."""
    conn.executemany(
        "INSERT OR REPLACE INTO dirs_cache(path, own, names, stat_digest, children_digest, "
        "tree_id, trusted_before_ns) VALUES (?, ?, ?, ?, ?, ?, ?)",
        [(key, *row, horizon) for key, row, horizon in rows])


def prune(conn: sqlite3.Connection, live: AbstractSet[bytes]) -> int:
    """Delete the rows whose tree id is not in ``live``, inside the caller's transaction
    (GC, once it knows what it keeps); return how many."""
    stale = [(path,) for path, tid in conn.execute("SELECT path, tree_id FROM dirs_cache")
             if tid not in live]
    conn.executemany("DELETE FROM dirs_cache WHERE path=?", stale)
    return len(stale)
