"""The upper layer: a session's writable layer, kept in its state directory.

Layout of a state directory ``<state>`` (mode 0700)::

    <state>/lock               flock'ed exclusively by the daemon serving the upper
    <state>/upper.sqlite       the tables below (WAL)
    <state>/data/<xx>/<ino>    content of changed files, at the file's own offsets (sparse)
    <state>/daemon.log         the mount daemon's log
    <state>/reserve            preallocated space, released to let a commit through on a
                               full disk (see "A full disk" below)
    <state>/spill              preallocated: a head fixing the slot size, then two slots for
                               batches the database could not take

The overlay keeps the whole upper in memory while mounted; this file is its write-behind
copy, written in batches (``write``): at a timer, at ``fsync``/``fsyncdir`` (durably, with
every earlier change) and at unmount. Nothing reads it while mounted.

How the overlay's concepts map to rows: an *inode* changed or created in the mount has an
``inodes`` row; a *dentry* added in an upper directory is a ``dentries`` row; a *whiteout*
is a ``dentries`` row with ino 0, hiding the lower entry of that name; an *opaque
directory* is a directory row whose ``lower_tree`` is NULL, so nothing of lower shows
through it. A lower directory moved by rename keeps its ``lower_tree`` and its children keep
resolving lazily through it: moving it writes three rows however large it is. Copy-up is
per chunk: bit ``i`` of ``present`` says chunk ``i`` lives in the data file; chunks below
``lower_len`` without their bit still read from lower.

A full disk (ENOSPC under the state directory): ``write`` first commits as usual; when SQLite
answers SQLITE_FULL it releases the reserve (``RESERVE_BYTES``, at most 1/32 of the file
system) and tries once more. If that fails too, the batch and every earlier one not yet in
the database are written, checksummed and synced, in place into the spill's other slot (no
allocation: the spill is preallocated when the state directory is first opened), and then
count as written: the data files they free are unlinked, which is how ``rm`` frees space on
a full disk without the database. Every later successful commit applies the spilled
batches first and records their sequence number (``spill_applied``) in the same
transaction; ``open`` replays a spill newer than that before anything else. While the
reserve is short or batches wait in the spill, ``has_room`` is false and the overlay
answers every change but a removal with ENOSPC, so what waits in memory stays small. Only
when even the spill cannot take the batches does ``write`` raise ``OSError(ENOSPC)``; the
caller keeps them and retries. The mount makes sure that never happens to changes it
acknowledged: before a change would leave more unwritten than the spill takes
(``spill_room``, bounded by the ``*_BYTES`` sizes below), it commits first, and answers
the change ENOSPC if it still does not fit (``Operations.admit``).

Invariants, each checked by ``check`` under the stable name in brackets:

- [meta] meta holds format, base (a Ref), chunk_size, next_ino and next_cookie
  (and ``spill_applied``, the sequence number of the last spill applied, once one was).
- [root] a row for inode 1 is a directory, its own parent, showing the base's root tree.
- [ino-range] an allocated inode number (below 2^62) is below next_ino.
- [kind-fields] a row carries the fields of its kind only: directories no chunks or data,
  files no tree or target, symlinks a target as long as their size; ``lower_chunks`` (runs,
  format 2) holds exactly ``ceil(lower_len / chunk_size)`` ids and ``lower_len <= size``;
  only block and character devices carry an ``rdev``.
- [dentry-parent] every dentry sits in a directory that has a row.
- [dentry-target] every non-whiteout dentry names an inode that has a row.
- [whiteout-lower] a whiteout sits in a directory with a lower tree, and (checked when the
  store is at hand) names an entry of that tree.
- [dir-one-name] a directory is named by at most one dentry, and its ``parent`` is the
  directory holding that dentry.
- [dir-reachable] following ``parent`` from a linked directory reaches the root, no cycle.
- [closure] the directory holding a linked inode with a row has a row too: a directory's
  ``parent``, the directory named in a non-directory's lower identity (copy-up gives every
  ancestor a row, so a checkpoint visits only directories with rows).
- [nlink-file] a non-directory's nlink is its ``lower_links`` plus the dentries naming it.
- [nlink-dir] a linked directory's nlink is 2 plus its subdirectories (upper dentries,
  plus unshadowed lower ones when the store is at hand).
- [cookie] readdir cookies of dentries are distinct and below next_cookie.
- [xattr-owner] every xattr belongs to an inode row and is in the ``user.`` namespace.
- [inline] inline content belongs to a file without lower content or data file, and is
  no longer than the file's size nor ``INLINE_MAX``.
- [data-owner] every data file belongs to a regular-file row.
- [data-size] no data file is longer than its file's size.
- [present-range] ``present`` marks only chunks below ``ceil(lower_len / chunk_size)``.
- [origin-unique] no two rows, and no two pins, share a lower identity or an inode number.

Crash windows (``kill -9`` of the daemon or power loss; ``fsync`` means fsync/fsyncdir):

| window                                        | after remount                          |
| --------------------------------------------- | -------------------------------------- |
| between two batch commits                     | state of the last commit; data written |
|                                               | since is in the data files but rows    |
|                                               | (size, presence) are older: the file   |
|                                               | reads as of the last commit's size     |
| inline content changed since the last commit | the content of the last commit (it    |
|                                               | lives in memory until then)            |
| a file spilled from inline to a data file     | the inline content of the last commit; |
|                                               | the data file is removed at open       |
| data written, copy-up bit not yet committed   | chunk reads from lower again (the data |
|                                               | file's bytes there are ignored)        |
| data file longer than the committed size      | cut to the size at open (recovery)     |
| inode freed in memory, delete not committed   | data files are unlinked only after the |
|                                               | commit that deletes their row, so the  |
|                                               | old file is intact                     |
| nlink 0 rows (unlinked while open)            | deleted at open with their data files  |
| data files without a row (created, no commit) | deleted at open                        |
| after fsync returned                          | everything up to it: data file synced  |
|                                               | first, then one synchronous commit     |
| batches in the spill, not in the database     | replayed at open (before recovery);    |
|                                               | data files freed by them are unlinked  |
|                                               | only after the spill was synced        |
| spill applied, ``spill_applied`` committed    | the spill is older than the database:  |
|                                               | ignored                                |
| power loss after a batch commit of copy-up    | a committed ``present`` bit may meet   |
| bits whose data was never fsynced             | a chunk that reads zeros (kill -9 of   |
|                                               | the daemon alone cannot cause this)    |
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import marshal
import os
import re
import shutil
import sqlite3
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import blake3

from store.dirs import DirectoryError, make_private_dir
from store.errors import InvalidRefError
from store.ref import DIGEST_SIZE, Ref
from store.tree import ChunkList, decode_runs, encode_runs

from .errors import (
    BaseMismatchError,
    NoBaseError,
    StateDirError,
    StateFullError,
    StateLockedError,
    UpperFormatError,
)
from .inodes import DERIVED_BIT, ROOT_INO

log = logging.getLogger("rewindfs.upper")

FORMAT = "2"  # 2: lower_chunks holds runs (1: every id, concatenated; migrated at open)
DB_NAME = "upper.sqlite"
DATA_DIR = "data"
LOG_NAME = "daemon.log"
LOCK_NAME = "lock"
RESERVE_NAME = "reserve"
SPILL_NAME = "spill"
RESERVE_BYTES = 8 << 20  # at most; and at most 1/32 of the state directory's file system
SPILL_SLOT_BYTES = 2 << 20  # per slot (two slots); at most 1/64 of the file system each
REGROW_EVERY_S = 0.5  # a failed regrowth of the reserve is tried again after this
SPILL_START = 4096  # the spill file's head (magic, slot bytes); the two slots follow
_SPILL_FILE_MAGIC = b"RWSPILLF"
_SPILL_FILE = struct.Struct("<8sQ")
_SPILL_MAGIC = b"RWSPILL1"
_SPILL_HEAD = struct.Struct("<8sQQ32s")  # per record: magic, sequence, payload bytes, blake3

# table -> (column -> comment): the documentation of the schema.
TABLES: dict[str, dict[str, str]] = {
    "meta": {
        "key": "format, base (Ref text of the lower), store (store root), chunk_size, "
               "next_ino (next allocated inode number), next_cookie (next readdir cookie), "
               "held_lowers (space-separated Refs of older lowers that detached inodes, "
               "unlinked or removed by a restore while open, still read: GC keeps them; "
               "cleared at open, since no handle outlives the daemon), spill_applied "
               "(sequence number of the last spill applied), quota_bytes and quota_inodes "
               "(the session's caps on upper content bytes and inode rows; absent or 0: "
               "none), exclude (JSON list of the session's exclude patterns, gitignore "
               "syntax: paths kept in the upper across checkpoints, in no Ref), "
               "kept_tree (the Ref of a tree listing the lower content that rows of "
               "excluded files kept across checkpoints still read, one entry per inode: "
               "GC keeps it; empty when there is none), exclude_clean (a Ref a "
               "checkpoint made under the exclude patterns that follow it, JSON: it holds "
               "no path they match, so a remount on it need not look).",
        "value": "text value.",
    },
    "inodes": {
        "ino": "inode number (primary key): 1 root, < 2^62 allocated, >= 2^62 derived.",
        "kind": "store.tree.Kind: 1 dir, 2 file, 3 symlink, 4 fifo, 5 socket, 6 block "
                "device, 7 character device.",
        "mode": "permission bits (07777).",
        "uid": "owner uid.",
        "gid": "owner gid.",
        "nlink": "exact link count; 0 while unlinked but still open or looked up.",
        "lower_links": "non-directories: names of this inode still visible from lower.",
        "size": "bytes (files), target length (symlinks), 0 otherwise.",
        "atime_ns": "access time, ns.",
        "mtime_ns": "modification time, ns.",
        "ctime_ns": "status change time, ns; kept across remounts for git's index.",
        "parent": "directories: the parent directory's inode (root: 1); else 0.",
        "lower_tree": "directories: 32-byte id of the tree whose entries show through; "
                      "NULL for an opaque or new directory.",
        "lower_chunks": "files: the chunk ids of the lower content as runs "
                        "(store.tree.encode_runs: per run a varint count and a 32-byte id), "
                        "so a sparse file's holes are one run; format 1 held every id.",
        "lower_len": "files: bytes [0, lower_len) may come from lower_chunks.",
        "present": "files: bitmap, bit i set = chunk i is in the data file; NULL if none.",
        "target": "symlinks: the target bytes.",
        "origin": "lower identity (see inodes.origin_key) of an inode copied up from lower; "
                  "NULL for inodes created in the mount and for the root.",
        "inline": "files: the whole content of a small file kept here instead of a data "
                  "file (bytes beyond it up to size read as zeros); NULL otherwise.",
        "rdev": "block and character devices: the device number (st_rdev); NULL or 0 "
                "otherwise.",
    },
    "dentries": {
        "parent": "directory inode holding the name.",
        "name": "the name (bytes).",
        "ino": "inode named; 0 = whiteout (hides the lower entry of that name).",
        "cookie": "readdir cookie, increasing in order of creation; 0 for whiteouts.",
    },
    "xattrs": {
        "ino": "inode.",
        "name": "attribute name (bytes, user.*).",
        "value": "attribute value (bytes).",
    },
    "pins": {
        "origin": "lower identity (primary key) whose inode number is fixed here.",
        "ino": "the inode number it gets.",
        "ctime_ns": "the ctime it shows while unchanged.",
    },
}

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inodes (
  ino INTEGER PRIMARY KEY, kind INTEGER NOT NULL, mode INTEGER NOT NULL,
  uid INTEGER NOT NULL, gid INTEGER NOT NULL, nlink INTEGER NOT NULL,
  lower_links INTEGER NOT NULL, size INTEGER NOT NULL, atime_ns INTEGER NOT NULL,
  mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, parent INTEGER NOT NULL,
  lower_tree BLOB, lower_chunks BLOB, lower_len INTEGER NOT NULL, present BLOB,
  target BLOB, origin BLOB, inline BLOB, rdev INTEGER);
CREATE TABLE IF NOT EXISTS dentries (
  parent INTEGER NOT NULL, name BLOB NOT NULL, ino INTEGER NOT NULL,
  cookie INTEGER NOT NULL, PRIMARY KEY (parent, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS xattrs (
  ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL,
  PRIMARY KEY (ino, name)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS pins (
  origin BLOB PRIMARY KEY, ino INTEGER NOT NULL, ctime_ns INTEGER NOT NULL) WITHOUT ROWID;
"""

ROW_COLUMNS = ("ino", "kind", "mode", "uid", "gid", "nlink", "lower_links", "size",
               "atime_ns", "mtime_ns", "ctime_ns", "parent", "lower_tree", "lower_chunks",
               "lower_len", "present", "target", "origin", "inline", "rdev")
_INSERT_INODE = (f"INSERT OR REPLACE INTO inodes({', '.join(ROW_COLUMNS)}) "
                 f"VALUES ({', '.join('?' * len(ROW_COLUMNS))})")

InodeRow = tuple  # the ROW_COLUMNS, in order
INLINE_MAX = 16 << 10  # files up to this size made in the mount live in their row


def make_state_dir(state_dir: str) -> None:
    """Make the state directory ``state_dir`` (absolute) and its missing parents, mode 0700.
    Raises StateDirError (exit 9) naming what is in the way (a file, a parent that cannot be
    made, a name too long) and a fix."""
    try:
        make_private_dir(state_dir, "state directory")
    except DirectoryError as e:
        raise StateDirError(state_dir, e.cause) from None


def bitmap(bits: set[int]) -> bytes | None:
    """Encode a set of chunk indexes as a little-endian bitmap (None when empty)."""
    if not bits:
        return None
    out = bytearray(max(bits) // 8 + 1)
    for i in bits:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def unbitmap(b: bytes | None) -> set[int]:
    """Decode ``bitmap``; the scan for set bytes runs in C, so a long bitmap with few bits
    (a chunk copied up at the end of a large sparse file) costs its bits."""
    if not b:
        return set()
    return {m.start() * 8 + j for m in _SET_BYTE.finditer(b) for j in range(8)
            if b[m.start()] >> j & 1}


_SET_BYTE = re.compile(rb"[^\x00]")


@dataclass
class Batch:
    """Changes to write in one transaction, collected from the overlay's memory."""

    inodes: list[InodeRow] = field(default_factory=list)
    deleted: list[int] = field(default_factory=list)
    dentries: list[tuple[int, bytes, int, int]] = field(default_factory=list)
    dentries_gone: list[tuple[int, bytes]] = field(default_factory=list)
    xattrs: dict[int, list[tuple[bytes, bytes]]] = field(default_factory=dict)
    pins: list[tuple[bytes, int, int]] = field(default_factory=list)
    pins_gone: list[bytes] = field(default_factory=list)
    meta: dict[str, str] = field(default_factory=dict)
    unlink_after: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.inodes or self.deleted or self.dentries or self.dentries_gone
                    or self.xattrs or self.pins or self.pins_gone or self.unlink_after)


def _encode_batches(batches: list[Batch], state_dir: str) -> bytes:
    """The spill's payload: ``batches`` as plain values (marshal format 4); the data files
    to unlink relative to ``state_dir``, so a copied state directory stays self-contained."""
    return marshal.dumps([
        (b.inodes, b.deleted, b.dentries, b.dentries_gone, list(b.xattrs.items()), b.pins,
         b.pins_gone, list(b.meta.items()),
         [os.path.relpath(p, state_dir) for p in b.unlink_after]) for b in batches], 4)


def payload_bytes(batches: list[Batch], state_dir: str) -> int:
    """Bytes ``batches`` take in the spill's payload (a record's head apart)."""
    return len(_encode_batches(batches, state_dir))


# Upper bounds, in bytes, of what a batch's items take in the spill's payload
# (``_encode_batches``, marshal format 4), so that the overlay can bound a batch before it
# exists (``Overlay.pending_bytes``): a scalar (an int below 2^64, None, a short string's
# head) takes at most 15, a bytes value 5 plus its length, a tuple or list head 5.
BATCH_BYTES = 512  # a batch's own tuple, lists and meta (held_lowers apart: its length)
ROW_BYTES = 5 + 20 * 15  # an inodes row, plus the lengths of its bytes values
NAME_BYTES = 5 + 4 * 15  # a dentry (or a removed one), plus the name's length
XATTR_BYTES = 5 + 2 * 15  # an inode's xattrs list, plus per attribute ITEM_BYTES
ITEM_BYTES = 5 + 2 * 5  # one (name, value) pair or a path to unlink, plus its lengths


def _decode_batches(payload: bytes, state_dir: str) -> list[Batch]:
    out = []
    for (inodes, deleted, dentries, gone, xattrs, pins, pins_gone, meta,
         unlink_after) in marshal.loads(payload):
        paths = [os.path.join(state_dir, p) for p in unlink_after
                 if p.startswith(DATA_DIR + "/") and ".." not in p.split("/")]
        out.append(Batch(inodes=inodes, deleted=deleted, dentries=dentries,
                         dentries_gone=gone, xattrs=dict(xattrs), pins=pins,
                         pins_gone=pins_gone, meta=dict(meta), unlink_after=paths))
    return out


def _is_full(e: sqlite3.Error) -> bool:
    """True if SQLite failed for want of space (SQLITE_FULL, extended codes included)."""
    code = getattr(e, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_FULL


def _no_space(path: str, what: str) -> OSError:
    return OSError(errno.ENOSPC, f"No space left on device (ENOSPC): {what}", path)


def _apply(c: sqlite3.Connection, b: Batch) -> None:
    """The statements of one batch, inside the caller's transaction."""
    if b.deleted:
        dl = [(i,) for i in b.deleted]
        c.executemany("DELETE FROM inodes WHERE ino=?", dl)
        c.executemany("DELETE FROM xattrs WHERE ino=?", dl)
        c.executemany("DELETE FROM dentries WHERE parent=?", dl)
    if b.inodes:
        c.executemany(_INSERT_INODE, b.inodes)
    if b.dentries_gone:
        c.executemany("DELETE FROM dentries WHERE parent=? AND name=?", b.dentries_gone)
    if b.dentries:
        c.executemany("INSERT OR REPLACE INTO dentries(parent, name, ino, cookie) "
                      "VALUES (?, ?, ?, ?)", b.dentries)
    for ino, pairs in b.xattrs.items():
        c.execute("DELETE FROM xattrs WHERE ino=?", (ino,))
        c.executemany("INSERT INTO xattrs(ino, name, value) VALUES (?, ?, ?)",
                      [(ino, k, v) for k, v in pairs])
    if b.pins_gone:
        c.executemany("DELETE FROM pins WHERE origin=?", [(o,) for o in b.pins_gone])
    if b.pins:
        c.executemany("INSERT OR REPLACE INTO pins(origin, ino, ctime_ns) VALUES (?, ?, ?)",
                      b.pins)
    if b.meta:
        c.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                      list(b.meta.items()))


def _write_all(fd: int, data: bytes, off: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:] if done else data, off + done)


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@dataclass
class Loaded:
    """The whole upper, as read at open."""

    meta: dict[str, str]
    inodes: list[sqlite3.Row]
    dentries: list[tuple[int, bytes, int, int]]  # ordered by parent, cookie
    xattrs: list[tuple[int, bytes, bytes]]
    pins: list[tuple[bytes, int, int]]


def _connect(path: str, *, readonly: bool = False) -> sqlite3.Connection:
    if readonly:
        c = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None,
                            check_same_thread=False)
    else:
        c = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    c.execute("PRAGMA busy_timeout=10000")
    return c


class Upper:
    """An open, locked state directory. Use ``Upper.open``.

    ``write`` may run in a worker thread, one call at a time; nothing else touches the
    connection while the overlay runs. ``has_room`` may be called from another thread.
    """

    def __init__(self, state_dir: str, conn: sqlite3.Connection, lock_fd: int,
                 base: Ref, chunk_size: int) -> None:
        self.state_dir = state_dir
        self.conn = conn
        self._lock_fd: int | None = lock_fd
        self.base = base
        self.chunk_size = chunk_size
        self.data_dir = os.path.join(state_dir, DATA_DIR)
        self._subdirs: set[str] = set()
        # A full disk (see the module docstring): the reserve, the spill and its batches.
        self._space = threading.Lock()
        self._reserve_fd: int | None = None
        self._spill_fd: int | None = None
        self.reserve_bytes = 0
        self.spill_slot = 0  # bytes per spill slot (0: no spill)
        self.reserve_full = False
        self._regrow_at = 0.0  # monotonic time of the next regrowth attempt
        self.spilled: list[Batch] = []  # in the spill, not yet in the database
        self.spilled_bytes = 0  # their payload in the spill
        self.spill_seq = 0  # sequence number of the newest spill record
        self._spill_new = False  # made by this open: its directory entry is not synced yet
        self.failing = False  # the last write could not be stored anywhere
        self.created = False  # this open made the upper (the state directory had none)

    @classmethod
    def open(cls, state_dir: str, *, store_root: str, chunk_size: int,
             ref: Ref | None) -> Upper:
        """Open (creating if needed) and lock ``state_dir``, then recover it (see the crash
        table). ``ref`` None means: use the recorded base.

        Raises StateDirError, StateLockedError, NoBaseError, BaseMismatchError, UpperFormatError.
        """
        state_dir = os.path.abspath(state_dir)
        make_state_dir(state_dir)
        lock_fd = os.open(os.path.join(state_dir, LOCK_NAME),
                          os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise StateLockedError(state_dir) from None
        try:
            conn = _connect(os.path.join(state_dir, DB_NAME))
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_DDL)
            cols = {r[1] for r in conn.execute("PRAGMA table_info(inodes)")}
            if "inline" not in cols:  # an upper made before inline content existed
                conn.execute("ALTER TABLE inodes ADD COLUMN inline BLOB")
            if "rdev" not in cols:  # an upper made before device nodes existed
                conn.execute("ALTER TABLE inodes ADD COLUMN rdev INTEGER")
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            if meta.get("format") == "1":
                _migrate_from_1(conn)
                meta["format"] = FORMAT
            if meta.get("format", FORMAT) != FORMAT:
                raise UpperFormatError(state_dir, f"unknown upper format {meta['format']!r}")
            if "base" in meta:
                try:
                    base = Ref.parse(meta["base"])
                except InvalidRefError:
                    raise UpperFormatError(state_dir, "recorded base is not a Ref") from None
                if ref is not None and ref != base:
                    raise BaseMismatchError(state_dir, str(base), str(ref))
                if int(meta.get("chunk_size", chunk_size)) != chunk_size:
                    raise UpperFormatError(state_dir, f"made for chunk size "
                                           f"{meta['chunk_size']}, the store has {chunk_size}")
            else:
                if ref is None:
                    raise NoBaseError(state_dir)
                base = ref
                conn.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", [
                    ("format", FORMAT), ("base", str(ref)), ("store", store_root),
                    ("chunk_size", str(chunk_size)), ("next_ino", "2"),
                    ("next_cookie", "1")])
            os.makedirs(os.path.join(state_dir, DATA_DIR), mode=0o700, exist_ok=True)
        except sqlite3.Error as e:
            os.close(lock_fd)
            if _is_full(e):
                raise StateFullError(state_dir, "cannot write its database") from e
            raise
        except BaseException:
            os.close(lock_fd)
            raise
        up = cls(state_dir, conn, lock_fd, base, chunk_size)
        up.created = "base" not in meta
        try:
            up._open_space(int(meta.get("spill_applied", "0")))
            up.recover()
        except OSError as e:
            up.close()
            if e.errno == errno.ENOSPC:
                raise StateFullError(state_dir, str(e)) from e
            raise
        except BaseException:
            up.close()
            raise
        return up

    # -- space: the reserve and the spill ---------------------------------------------------

    def _open_space(self, applied: int) -> None:
        """Open (creating or growing them while space allows) the reserve and the spill;
        replay a spill newer than ``applied``. Raises OSError(ENOSPC) if the spill's
        batches cannot be applied (nothing is lost: they stay in the spill)."""
        st = os.statvfs(self.state_dir)
        fs_bytes = st.f_blocks * st.f_frsize
        self.reserve_bytes = min(RESERVE_BYTES, fs_bytes // 32)
        self._reserve_fd = os.open(os.path.join(self.state_dir, RESERVE_NAME),
                                   os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._spill_fd = fd = os.open(os.path.join(self.state_dir, SPILL_NAME),
                                      os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        magic, have = _SPILL_FILE.unpack(os.pread(fd, _SPILL_FILE.size, 0).ljust(
            _SPILL_FILE.size, b"\0"))
        if magic == _SPILL_FILE_MAGIC:
            self.spill_slot = have  # fixed when the file was made: records stay where they are
        else:
            # A new spill (or one whose making was cut short, so never written to): zeros,
            # written rather than fallocated so that later writes in place never allocate,
            # and the head that fixes the slot size. Nothing is synced here (opening stays
            # cheap): the first record's sync makes the head durable with it (``_spill``).
            want = min(SPILL_SLOT_BYTES, fs_bytes // 64)
            try:
                os.ftruncate(fd, 0)
                _write_all(fd, bytes(SPILL_START + 2 * want), 0)
                _write_all(fd, _SPILL_FILE.pack(_SPILL_FILE_MAGIC, want), 0)
                self.spill_slot = want
                self._spill_new = True
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                os.ftruncate(fd, 0)
                log.warning("%s: no space for a spill (%d bytes): on a full disk, changes "
                            "the database cannot take wait in memory", self.state_dir,
                            SPILL_START + 2 * want)
        self.spill_seq = applied
        pending = self._read_spill()
        if pending is not None and pending[0] > applied:
            seq, batches = pending
            self.spill_seq = seq
            self.spilled = batches
            self.spilled_bytes = payload_bytes(batches, self.state_dir)
            log.info("%s: applying %d batch(es) from the spill (sequence %d)",
                     self.state_dir, len(batches), seq)
            for b in batches:  # the spill is durable: what it frees may go first
                _unlink_all(b.unlink_after)
            self.write(Batch(), durable=True)
            if self.spilled:
                raise _no_space(self.state_dir, f"{len(batches)} batch(es) of changes wait "
                                "in the spill; free space on its file system")
        elif pending is not None:
            self.spill_seq = max(applied, pending[0])
        self.regrow_reserve(force=True)

    def _read_spill(self) -> tuple[int, list[Batch]] | None:
        """The newest valid spill record: (sequence number, batches), or None."""
        assert self._spill_fd is not None
        best: tuple[int, list[Batch]] | None = None
        for i in range(2):
            at = SPILL_START + i * self.spill_slot
            head = os.pread(self._spill_fd, _SPILL_HEAD.size, at)
            if len(head) < _SPILL_HEAD.size:
                continue
            magic, seq, n, digest = _SPILL_HEAD.unpack(head)
            if magic != _SPILL_MAGIC or n > self.spill_slot - _SPILL_HEAD.size:
                continue
            payload = os.pread(self._spill_fd, n, at + _SPILL_HEAD.size)
            if len(payload) != n or blake3.blake3(payload).digest() != digest:
                continue  # torn by a crash while written: the other slot is the valid one
            if best is None or seq > best[0]:
                best = (seq, _decode_batches(payload, self.state_dir))
        return best

    def _spill(self, batches: list[Batch]) -> None:
        """Write ``batches`` durably into the spill slot not holding the newest record.
        Raises OSError(ENOSPC) if they do not fit."""
        payload = _encode_batches(batches, self.state_dir)
        seq = self.spill_seq + 1
        if self._spill_fd is None or _SPILL_HEAD.size + len(payload) > self.spill_slot:
            raise _no_space(self.state_dir, f"{len(batches)} batch(es) of changes "
                            f"({len(payload)} bytes) fit neither in the database nor in "
                            f"the spill ({self.spill_slot} bytes)")
        rec = _SPILL_HEAD.pack(_SPILL_MAGIC, seq, len(payload),
                               blake3.blake3(payload).digest()) + payload
        _write_all(self._spill_fd, rec, SPILL_START + (seq % 2) * self.spill_slot)
        os.fdatasync(self._spill_fd)  # the record, and the head of a new spill with it
        if self._spill_new:  # and the spill's directory entry, once
            dfd = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self._spill_new = False
        self.spill_seq = seq
        self.spilled_bytes = len(payload)

    def _release_reserve(self) -> bool:
        """Free the reserve's space (True if it held any)."""
        with self._space:
            if self._reserve_fd is None or os.fstat(self._reserve_fd).st_blocks == 0:
                return False
            os.ftruncate(self._reserve_fd, 0)
            self.reserve_full = False
            self._regrow_at = 0.0
        log.warning("%s: disk full (ENOSPC): reserve of %d bytes released to commit",
                    self.state_dir, self.reserve_bytes)
        return True

    def regrow_reserve(self, force: bool = False) -> bool:
        """Allocate the reserve again if it is short; True once it is whole. A failed
        attempt is repeated at most every ``REGROW_EVERY_S`` unless ``force``."""
        with self._space:
            if self.reserve_full or self._reserve_fd is None:
                return self.reserve_full
            now = time.monotonic()
            if not force and now < self._regrow_at:
                return False
            try:
                os.posix_fallocate(self._reserve_fd, 0, self.reserve_bytes)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._regrow_at = now + REGROW_EVERY_S
                    return False
                # A file system that cannot preallocate at all: serve without a reserve.
                log.warning("%s: no reserve (cannot preallocate: %s)", self.state_dir, e)
                self.reserve_bytes = 0
            self.reserve_full = True
        log.info("%s: reserve of %d bytes in place", self.state_dir, self.reserve_bytes)
        return True

    def has_room(self) -> bool:
        """False while the disk is short: the reserve is not whole (and cannot be regrown
        now), batches wait in the spill, or the last write failed. The overlay then refuses
        changes that add anything (ENOSPC)."""
        if self.spilled or self.failing:
            return False
        return self.reserve_full or self.regrow_reserve()

    def spill_room(self) -> int:
        """Bytes of batches' payload (``_encode_batches``), beyond the batches in the spill,
        that the spill is sure to take: a slot less its record head and what the spill
        holds; 0 without a spill. The overlay commits before it holds more unwritten
        (``Operations.admit``), so that a full disk never finds more than this to keep."""
        if not self.spill_slot:
            return 0
        return max(0, self.spill_slot - _SPILL_HEAD.size - self.spilled_bytes)

    def transact(self, body: Callable[[sqlite3.Connection], None],
                 durable: bool = False) -> None:
        """Run ``body`` in one transaction (synchronous when ``durable``) that also records
        the spilled batches as applied (``body`` must apply them or supersede them). On
        SQLITE_FULL the reserve is released and the transaction tried once more. Raises
        OSError(ENOSPC) if there is still no space; nothing is then changed."""
        cause: sqlite3.Error | None = None
        for attempt in range(2):
            try:
                self._transaction(body, durable)
                self.spilled = []
                self.spilled_bytes = 0
                return
            except sqlite3.Error as e:
                if not _is_full(e):
                    raise
                cause = e
                if attempt or not self._release_reserve():
                    break
        raise _no_space(os.path.join(self.state_dir, DB_NAME),
                        "the upper's database cannot grow") from cause

    def _transaction(self, body: Callable[[sqlite3.Connection], None],
                     durable: bool) -> None:
        c = self.conn
        if durable:
            c.execute("PRAGMA synchronous=FULL")
        try:
            c.execute("BEGIN IMMEDIATE")
            try:
                body(c)
                if self.spilled:
                    c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)",
                              ("spill_applied", str(self.spill_seq)))
                c.execute("COMMIT")
            except BaseException:
                # SQLite rolls back by itself after some errors (SQLITE_FULL among them): a
                # second ROLLBACK would only hide the real error.
                if c.in_transaction:
                    c.execute("ROLLBACK")
                raise
        finally:
            if durable:
                c.execute("PRAGMA synchronous=NORMAL")


    # -- paths ---------------------------------------------------------------------------

    def data_path(self, ino: int) -> str:
        return os.path.join(self.data_dir, f"{ino & 0xFF:02x}", str(ino))

    def data_path_create(self, ino: int) -> str:
        sub = os.path.join(self.data_dir, f"{ino & 0xFF:02x}")
        if sub not in self._subdirs:
            os.makedirs(sub, mode=0o700, exist_ok=True)
            self._subdirs.add(sub)
        return os.path.join(sub, str(ino))

    # -- open / load ----------------------------------------------------------------------

    def recover(self) -> dict[str, int]:
        """Finish what a crash interrupted: drop unlinked inodes and orphan dentries,
        remove data files without a row and cut data files to their file's size."""
        c = self.conn
        gone: list[int] = []
        orphans = 0

        def body(c: sqlite3.Connection) -> None:
            nonlocal gone, orphans
            c.execute("DELETE FROM meta WHERE key='held_lowers'")
            gone = [r[0] for r in c.execute("SELECT ino FROM inodes WHERE nlink = 0")]
            c.executemany("DELETE FROM inodes WHERE ino=?", [(i,) for i in gone])
            c.executemany("DELETE FROM xattrs WHERE ino=?", [(i,) for i in gone])
            orphans = c.execute("DELETE FROM dentries WHERE parent NOT IN "
                                "(SELECT ino FROM inodes WHERE kind=1)").rowcount

        self.transact(body)
        sizes = dict(c.execute("SELECT ino, size FROM inodes WHERE kind=2 "
                               "AND inline IS NULL").fetchall())
        removed = cut = 0
        for ino, path in iter_data_files(self.data_dir):
            if ino not in sizes:
                os.unlink(path)
                removed += 1
            elif os.stat(path).st_size > sizes[ino]:
                os.truncate(path, sizes[ino])
                cut += 1
        return {"inodes": len(gone), "dentries": orphans, "data_removed": removed,
                "data_cut": cut}

    def set_quota(self, nbytes: int | None, inodes: int | None) -> None:
        """Record the session's caps (CONTRACT: issue 14 point 4) in ``meta``, durably:
        ``quota_bytes`` (content bytes of the upper) and ``quota_inodes`` (its inode rows);
        None keeps what is recorded, 0 removes a cap. The overlay reads them when it loads.
        Raises ValueError for a negative cap, OSError(ENOSPC) on a full disk."""
        rows = [(k, str(v)) for k, v in (("quota_bytes", nbytes), ("quota_inodes", inodes))
                if v is not None]
        for k, v in rows:
            if int(v) < 0:
                raise ValueError(f"{k} must not be negative, not {v}")
        pending = list(self.spilled)  # the transaction records the spill as applied

        def body(c: sqlite3.Connection) -> None:
            for x in pending:
                _apply(c, x)
            c.executemany("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", rows)

        if rows:
            self.transact(body, durable=True)

    def set_exclude(self, patterns: tuple[str, ...] | list[str] | None) -> None:
        """Record the session's ``exclude`` patterns (``store.pathpolicy``, gitignore
        syntax) in ``meta``, durably; None keeps what is recorded, an empty list removes
        them. The overlay reads them when it loads (``Overlay.exclude``). Raises
        OSError(ENOSPC) on a full disk."""
        if patterns is None:
            return
        import json

        value = json.dumps(list(patterns))
        have = self.conn.execute("SELECT value FROM meta WHERE key='exclude'").fetchone()
        if (have[0] if have else "[]") == value:
            return
        pending = list(self.spilled)

        def body(c: sqlite3.Connection) -> None:
            for x in pending:
                _apply(c, x)
            c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('exclude', ?)",
                      (value,))

        self.transact(body, durable=True)

    def load(self) -> Loaded:
        c = self.conn
        c.row_factory = sqlite3.Row
        try:
            inodes = c.execute("SELECT * FROM inodes").fetchall()
        finally:
            c.row_factory = None
        return Loaded(
            meta=dict(c.execute("SELECT key, value FROM meta").fetchall()),
            inodes=inodes,
            dentries=c.execute("SELECT parent, name, ino, cookie FROM dentries "
                               "ORDER BY parent, cookie").fetchall(),
            xattrs=c.execute("SELECT ino, name, value FROM xattrs").fetchall(),
            pins=c.execute("SELECT origin, ino, ctime_ns FROM pins").fetchall())

    # -- write ---------------------------------------------------------------------------

    def write(self, b: Batch, durable: bool = False) -> None:
        """Apply the spilled batches and ``b`` in one transaction (synchronous when
        ``durable``), then unlink the data files they freed and regrow the reserve. Data
        files must be synced by the caller before a durable write that depends on them.

        On a full disk (see the module docstring) the batches go to the spill instead and
        the call returns: they are durable. Raises OSError(ENOSPC) when even the spill
        cannot take them; then nothing is written and the caller keeps ``b`` to retry."""
        pending = self.spilled + [b]

        def body(c: sqlite3.Connection) -> None:
            for x in pending:
                _apply(c, x)

        try:
            self.transact(body, durable)
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
            try:
                self._spill(pending)
            except OSError as e2:
                self.failing = True
                log.error("%s: %s", self.state_dir, e2)
                raise e2 from e
            self.failing = False
            if not self.spilled:
                log.error("%s: %s; changes are kept in the spill until it has room",
                          self.state_dir, e)
            self.spilled = pending
            _unlink_all(b.unlink_after)
            return
        if self.failing or len(pending) > 1:
            log.info("%s: changes committed again (%d batch(es) from the spill)",
                     self.state_dir, len(pending) - 1)
        self.failing = False
        for x in pending:
            _unlink_all(x.unlink_after)
        if not self.reserve_full:
            self.regrow_reserve()

    def close(self) -> None:
        """Close the database and release the lock (idempotent)."""
        self._close(discard=False)

    def discard(self) -> None:
        """Close and delete this upper: its database, data files, reserve and spill, while
        the lock is still held (the empty lock file stays, so that no other opener can
        lock a file that is then removed). For an upper that this process made (``created``)
        for a mount that never served: nothing in it was ever seen by anyone."""
        self._close(discard=True)

    def _close(self, discard: bool) -> None:
        if self._lock_fd is None:
            return
        self.conn.close()
        for fd in (self._reserve_fd, self._spill_fd):
            if fd is not None:
                os.close(fd)
        self._reserve_fd = self._spill_fd = None
        try:
            if discard:
                for name in (DB_NAME, DB_NAME + "-wal", DB_NAME + "-shm",
                             DB_NAME + "-journal", RESERVE_NAME, SPILL_NAME):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.state_dir, name))
                shutil.rmtree(self.data_dir, ignore_errors=True)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None


def _migrate_from_1(conn: sqlite3.Connection) -> None:
    """Rewrite a format 1 upper's chunk lists as runs (one transaction)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        rows = conn.execute("SELECT ino, lower_chunks FROM inodes "
                            "WHERE lower_chunks IS NOT NULL").fetchall()
        conn.executemany("UPDATE inodes SET lower_chunks=? WHERE ino=?", [
            (encode_runs(ChunkList(b[i:i + DIGEST_SIZE] for i in range(0, len(b), DIGEST_SIZE)))
             or None, ino) for ino, b in rows])
        conn.execute("UPDATE meta SET value=? WHERE key='format'", (FORMAT,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def iter_data_files(data_dir: str) -> Iterator[tuple[int, str]]:
    """Yield (ino, path) of every data file under ``data_dir``; odd names yield ino -1."""
    try:
        subs = sorted(os.listdir(data_dir))
    except FileNotFoundError:
        return
    for sub in subs:
        d = os.path.join(data_dir, sub)
        if not os.path.isdir(d):
            yield -1, d
            continue
        for name in sorted(os.listdir(d)):
            try:
                ino = int(name)
            except ValueError:
                ino = -1
            if str(ino) != name or f"{ino & 0xFF:02x}" != sub:
                ino = -1
            yield ino, os.path.join(d, name)


# -- check -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Problem:
    """One broken invariant: ``name`` is its stable name (see the module docstring)."""

    name: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.name}] {self.detail}"


def check(state_dir: str, store: object | None = None) -> list[Problem]:
    """Check every documented invariant of the upper in ``state_dir``; return the broken
    ones (empty when sound). ``store`` (a ``store.objects.Store``) enables the checks that
    need the lower trees. Reads only; safe while the daemon is down or between commits.
    """
    out: list[Problem] = []

    def bad(name: str, detail: str) -> None:
        out.append(Problem(name, detail))

    path = os.path.join(state_dir, DB_NAME)
    if not os.path.exists(path):
        return [Problem("meta", f"{path} does not exist")]
    c = _connect(path, readonly=True)
    try:
        meta = dict(c.execute("SELECT key, value FROM meta").fetchall())
        c.row_factory = sqlite3.Row
        rows = {r["ino"]: r for r in c.execute("SELECT * FROM inodes")}
        c.row_factory = None
        dents = c.execute("SELECT parent, name, ino, cookie FROM dentries").fetchall()
        xattrs = c.execute("SELECT ino, name FROM xattrs").fetchall()
        pins = c.execute("SELECT origin, ino FROM pins").fetchall()
    finally:
        c.close()

    # [meta]
    base: Ref | None = None
    cs = 1 << 20
    next_ino = next_cookie = 1 << 63
    for key in ("format", "base", "chunk_size", "next_ino", "next_cookie"):
        if key not in meta:
            bad("meta", f"meta has no {key!r}")
    try:
        if "base" in meta:
            base = Ref.parse(meta["base"])
        cs = int(meta.get("chunk_size", cs))
        next_ino = int(meta.get("next_ino", next_ino))
        next_cookie = int(meta.get("next_cookie", next_cookie))
        if meta.get("format", FORMAT) != FORMAT:
            bad("meta", f"unknown format {meta['format']!r}")
    except (InvalidRefError, ValueError) as e:
        bad("meta", f"unreadable meta: {e}")

    # [root]
    root = rows.get(ROOT_INO)
    if root is not None:
        if root["kind"] != 1 or root["parent"] != ROOT_INO:
            bad("root", "inode 1 is not a directory that is its own parent")
        elif base is not None and root["lower_tree"] not in (None, base.tree_id):
            bad("root", "inode 1 shows another tree than the base's root")

    # [ino-range], [kind-fields], [present-range]
    for ino, r in rows.items():
        if ino <= 0 or (ino < DERIVED_BIT and ino != ROOT_INO and ino >= next_ino):
            bad("ino-range", f"inode {ino} is not below next_ino {next_ino}")
        kind = r["kind"]
        chunks = r["lower_chunks"] or b""
        try:
            nids = len(decode_runs(chunks))
        except ValueError:
            nids = -1
        why = None
        if kind not in (1, 2, 3, 4, 5, 6, 7):
            why = f"unknown kind {kind}"
        elif r["mode"] & ~0o7777:
            why = "mode has bits outside 07777"
        elif kind == 1 and (chunks or r["lower_len"] or r["present"] or r["target"]):
            why = "directory with file or symlink fields"
        elif kind != 1 and r["lower_tree"] is not None:
            why = "non-directory with a lower tree"
        elif kind != 2 and (chunks or r["lower_len"] or r["present"]):
            why = "non-file with content fields"
        elif kind == 3 and len(r["target"] or b"") != r["size"]:
            why = "symlink size differs from its target length"
        elif kind != 3 and r["target"]:
            why = "non-symlink with a target"
        elif nids != -(-r["lower_len"] // cs):
            why = "lower_chunks does not cover exactly lower_len bytes"
        elif r["lower_len"] > r["size"] or r["lower_len"] < 0:
            why = "lower_len outside [0, size]"
        elif kind != 2 and r["inline"] is not None:
            why = "non-file with inline content"
        elif kind not in (6, 7) and "rdev" in r.keys() and r["rdev"]:
            why = "non-device with a device number"
        if why:
            bad("kind-fields", f"inode {ino}: {why}")
        if kind == 2 and r["inline"] is not None and (
                r["lower_len"] or chunks or r["present"] or len(r["inline"]) > r["size"]
                or len(r["inline"]) > INLINE_MAX):
            bad("inline", f"inode {ino}: inline content with lower content or too long")
        if kind == 2:
            limit = -(-r["lower_len"] // cs)
            if any(i >= limit for i in unbitmap(r["present"])):
                bad("present-range", f"inode {ino} marks chunks beyond its lower content")

    # [dentry-parent], [dentry-target], [whiteout-lower], [cookie]
    names_of: dict[int, list[tuple[int, bytes]]] = {}
    cookies: dict[int, tuple[int, bytes]] = {}
    for parent, name, ino, cookie in dents:
        pr = rows.get(parent)
        if pr is None or pr["kind"] != 1:
            bad("dentry-parent", f"dentry {name!r} sits in {parent}, not a directory row")
            continue
        if ino == 0:
            if pr["lower_tree"] is None:
                bad("whiteout-lower", f"whiteout {name!r} in opaque directory {parent}")
            elif store is not None and store.get_tree(pr["lower_tree"]).get(name) is None:  # type: ignore[attr-defined]
                bad("whiteout-lower", f"whiteout {name!r} in {parent} hides nothing")
            continue
        if ino not in rows:
            bad("dentry-target", f"dentry {name!r} in {parent} names missing inode {ino}")
            continue
        names_of.setdefault(ino, []).append((parent, name))
        if cookie <= 0 or cookie >= next_cookie or cookie in cookies:
            bad("cookie", f"dentry {name!r} in {parent} has cookie {cookie}")
        cookies[cookie] = (parent, name)

    # [dir-one-name], [dir-reachable], [nlink-file], [nlink-dir]
    subdirs: dict[int, int] = {}
    for ino, r in rows.items():
        names = names_of.get(ino, [])
        if r["kind"] == 1:
            if len(names) > 1:
                bad("dir-one-name", f"directory {ino} has {len(names)} names")
            elif names and names[0][0] != r["parent"]:
                bad("dir-one-name", f"directory {ino} is named in {names[0][0]} "
                                    f"but its parent is {r['parent']}")
            for p, _ in names:
                subdirs[p] = subdirs.get(p, 0) + 1
        elif r["nlink"] != r["lower_links"] + len(names):
            bad("nlink-file", f"inode {ino} has nlink {r['nlink']}, but {r['lower_links']} "
                              f"lower names and {len(names)} dentries")
    for ino, r in rows.items():
        if r["kind"] != 1 or r["nlink"] == 0 or ino == ROOT_INO:
            continue
        seen = {ino}
        p = r["parent"]
        while p != ROOT_INO:
            if p in seen:
                bad("dir-reachable", f"directory {ino}: parent cycle through {p}")
                break
            seen.add(p)
            pr = rows.get(p)
            if pr is None:
                break  # a directory unchanged since the base: reachable through lower
            if pr["kind"] != 1 or pr["nlink"] == 0:
                bad("dir-reachable", f"directory {ino}: ancestor {p} is not a linked dir")
                break
            p = pr["parent"]
    for ino, r in rows.items():
        if r["kind"] != 1 or r["nlink"] == 0:
            continue
        want = 2 + subdirs.get(ino, 0)
        if store is not None and r["lower_tree"] is not None:
            shadowed = {n for p, n, _i, _c in dents if p == ino}
            tree = store.get_tree(r["lower_tree"])  # type: ignore[attr-defined]
            want += sum(1 for e in tree.entries if e.kind == 1 and e.name not in shadowed)
            if r["nlink"] != want:
                bad("nlink-dir", f"directory {ino} has nlink {r['nlink']}, want {want}")
        elif r["lower_tree"] is None and r["nlink"] != want:
            bad("nlink-dir", f"directory {ino} has nlink {r['nlink']}, want {want}")
        elif r["nlink"] < want:
            bad("nlink-dir", f"directory {ino} has nlink {r['nlink']}, want >= {want}")

    # [closure]
    for ino, r in rows.items():
        if r["nlink"] == 0 or ino == ROOT_INO:
            continue
        o = r["origin"]
        if r["kind"] == 1:
            holder = r["parent"]
        elif o is not None and o[:1] == b"p":
            holder = int.from_bytes(o[1:9], "little")
        else:
            continue
        if holder not in rows:
            bad("closure", f"inode {ino} has a row but its directory {holder} has none")

    # [xattr-owner]
    for ino, name in xattrs:
        if ino not in rows:
            bad("xattr-owner", f"xattr {name!r} of inode {ino}, which has no row")
        elif not bytes(name).startswith(b"user."):
            bad("xattr-owner", f"xattr {name!r} of inode {ino} is not user.*")

    # [data-owner], [data-size]
    for ino, dpath in iter_data_files(os.path.join(state_dir, DATA_DIR)):
        r = rows.get(ino)
        if r is None or r["kind"] != 2:
            bad("data-owner", f"data file {dpath} belongs to no file row")
        elif r["inline"] is not None:
            bad("inline", f"inode {ino} has inline content and a data file")
        elif os.stat(dpath).st_size > r["size"]:
            bad("data-size", f"data file of inode {ino} is longer than size {r['size']}")

    # [origin-unique]
    origins: dict[bytes, int] = {}
    for ino, r in rows.items():
        o = r["origin"]
        if o is not None:
            if o in origins:
                bad("origin-unique", f"inodes {origins[o]} and {ino} share a lower identity")
            origins[o] = ino
    pin_inos: dict[int, bytes] = {}
    for origin, ino in pins:
        if ino in pin_inos:
            bad("origin-unique", f"two pins give inode {ino}")
        pin_inos[ino] = origin
    return out


def describe(problems: list[Problem]) -> str:
    return "\n".join(str(p) for p in problems)

