"""The store's SQLite index: every table and column, with its meaning and invariants.

The index is a cache of the backend, never the only copy of anything: ``rebuild-index``
recreates ``objects``, ``packs``, ``snapshots``, ``snapshot_labels``, ``journal`` and
``config`` from the packs' trailers and the append-only history objects. It runs in WAL mode. Tables are created with
sqlite-utils here and nowhere else (``dirs_cache`` with plain SQL, below); hot paths use
plain prepared SQL.

On a shared store (store/config.py) the catalog tables (``objects``, ``packs``,
``snapshots``, ``snapshot_labels``, ``journal``, ``named_refs``, ``state_dirs`` with a
``host`` column,
``sessions``, ``leases``, ``config``) live in the PostgreSQL catalog instead
(store/pgcatalog.py, its own versioned migrations), read and written only through
store/catalog.py; this host's file keeps ``files_cache``, ``dirs_cache`` and ``chunk_pages``, trusted against
the catalog's object index, and ``located``/``located_trees``, its cache of the catalog's
``objects`` rows (what a mounted snapshot reads while the catalog is unreachable). The PostgreSQL catalog also has ``writer_pins`` and
``packs.indexed_ns``, the cross-host GC protocol's rows (store/sharedgc.py: what they mean,
and the protocol's crash windows), and the session registry's records are written by the
session processes (fusefs/session/moves.py).

Invariants, each checked by ``verify`` (store/verify.py, which keeps the same list in
``INVARIANTS``) under the stable name given in brackets:

- [object-hash] every indexed object's record decodes and the object's plaintext hashes to
  its id, with its recorded plaintext length.
- [object-location] every ``objects`` row names a pack that has a ``packs`` row and exists
  in the backend; its record lies inside that pack, whose trailer lists the same location.
- [pack-trailer] every indexed pack's key is the blake3 of its bytes; its trailer decodes
  and matches its digest; its size and object count equal its ``packs`` row.
- [pack-indexed] every object in an indexed pack's trailer has an ``objects`` row (in that
  pack or another). Packs without a ``packs`` row are crash leftovers that GC deletes.
- [tree-decodes] every reachable tree decodes and re-encodes to the same bytes.
- [tree-complete] every child tree and chunk referenced by a reachable tree is indexed, as
  a tree or a chunk respectively.
- [file-size] a reachable file entry's size equals the sum of its chunks' plaintext lengths.
- [snapshot-root] every listed snapshot's root is an indexed tree.
- [journal-ref] every ref named by a journal event is an indexed tree.
- [named-ref] every named ref is an indexed tree.
- [history-object] every ``snapshots`` and ``journal`` row equals its backend history
  object, every journal object has its row, and the snapshot list equals the replay of the
  ``snapshots/`` records in key order. (Records durable in the backend whose row a crash
  kept from being written are applied first, by ``rebuild.catch_up``: the index lagging is
  not a broken invariant.)
- [journal-seq] each session's journal seqs are 1, 2, ..., n without gaps.

Reachable means reachable from the snapshot list, the journals and the named refs.
"""

from __future__ import annotations

import sqlite3

SCHEMA_VERSION = 8

# table -> (column -> comment). The comments are the documentation of the schema.
TABLES: dict[str, dict[str, str]] = {
    "objects": {
        "id": "32-byte blake3 id of the object's plaintext (primary key).",
        "kind": "1 chunk (file content), 2 tree (canonical tree encoding).",
        "pack": "backend key of the pack holding it; the pack exists (object-location).",
        "rec_offset": "byte offset of the record holding the object inside the pack.",
        "rec_length": "stored (compressed or raw) length of that record in bytes.",
        "codec": "0 raw, 1 zstd: how the record is stored.",
        "inner_offset": "offset of the object's plaintext inside the record's plaintext.",
        "raw_length": "plaintext length of the object in bytes.",
    },
    "packs": {
        "key": "backend key packs/<blake3 hex>.pack (primary key); hex is the pack digest.",
        "size": "pack length in bytes.",
        "objects": "number of rows in the pack's trailer index.",
    },
    "snapshots": {
        "ref": "Ref text of a listed snapshot (primary key); live for GC until forgotten.",
        "time_ns": "when it was listed, ns since the epoch.",
        "origin": "what produced it: snapshot, checkpoint, seed, import, ...",
        "label": "optional user label; NULL when none.",
        "key": "backend key of the history object that listed it.",
    },
    "snapshot_labels": {
        "ref": "Ref text of a listed snapshot; (ref, label) is the primary key.",
        "label": "a label the Ref was given since it was last listed (every one is kept).",
        "time_ns": "when the Ref was last given that label, ns since the epoch.",
        "key": "backend key of the history object that gave it.",
    },
    "journal": {
        "session": "session id the event belongs to.",
        "seq": "1, 2, 3, ... per session without gaps; (session, seq) is the primary key.",
        "time_ns": "when the event was appended, ns since the epoch.",
        "epoch": "session lease epoch of the appender.",
        "event": "WorkspaceCheckpointed or WorkspaceRestored.",
        "ref": "the Ref the event names; indexed (journal-ref).",
        "trigger_": "checkpoint trigger (manual, idle, seed, ...); NULL for restores.",
        "consistency": "quiescent or fuzzy; NULL for restores.",
        "key": "backend key journal/<session>/<seq>.json of the event's object.",
    },
    "named_refs": {
        "name": "a name pinning a Ref for GC (primary key), e.g. a session's restore pointer.",
        "ref": "the pinned Ref text.",
    },
    "state_dirs": {
        "path": "absolute path of a registered session state directory (primary key); GC "
                "keeps its upper's base Ref and fails closed if it cannot be read.",
    },
    "files_cache": {
        "path": "absolute path (bytes) of a file seen by a snapshot (primary key).",
        "size": "st_size when read.",
        "mtime_ns": "st_mtime_ns when read.",
        "ctime_ns": "st_ctime_ns when read.",
        "inode": "st_ino when read.",
        "chunks": "concatenated 32-byte chunk ids of the content read.",
        "trusted_before_ns": "start time of the snapshot that recorded the row: the row is "
                             "trusted only if mtime_ns and ctime_ns are older than this.",
    },
    "dirs_cache": {
        "path": "absolute path (bytes) of a directory seen by a snapshot (primary key); a "
                "snapshot's root is keyed with a trailing '/'. Meaning and rules of the "
                "whole table: store/dircache.py.",
        "own": "the directory's own (st_ino, mtime_ns, ctime_ns) when encoded; while they "
               "are unchanged, its entry names are those in subdirs and others.",
        "subdirs": "names of its subdirectories, sorted, joined by NUL.",
        "others": "names of its other entries (files, symlinks, fifos, sockets), sorted, "
                  "joined by NUL.",
        "stat_digest": "blake3 over subdirs and each other entry's name and lstat (mode, "
                       "inode, link count, owner, size, mtime, ctime) as encoded.",
        "children_digest": "blake3 over its subdirectory entries (name, mode, owner, mtime, "
                           "xattrs, child tree id): the subdirectories, walked again, must "
                           "give the same for the row to hold.",
        "tree_id": "the tree it was encoded to; trusted only while indexed as a tree. GC "
                   "deletes rows whose tree it does not keep, so a trusted tree is complete.",
        "trusted_before_ns": "trust horizon of the recording snapshot (as in files_cache); "
                             "the row exists only if every mtime and ctime it depends on is "
                             "older, and never for a directory with a hard-linked file below.",
    },
    "chunk_pages": {
        "id": "32-byte id of a chunk written (or put again) through this host (primary "
              "key). Only a cache: a chunk without a row counts all its pages; GC deletes "
              "the rows of chunks no longer indexed (on a shared store a GC on this host, "
              "also of chunks other hosts' GCs deleted).",
        "pages": "4 KiB pages of the chunk's plaintext that hold a non-zero byte "
                 "(store.chunker.data_pages): what st_blocks counts of it, as a file "
                 "system with holes counts allocated pages.",
    },
    "located": {
        "id": "32-byte id of an object (primary key), shared stores only: a copy of the "
              "catalog's ``objects`` row, taken at the host's first look-up or when a mount "
              "walked a snapshot (``Store.locate_tree``). Packs are immutable and named by "
              "digest and every read is verified, so a row is at worst stale (its pack "
              "deleted by a GC): the read then asks the catalog again and replaces it. "
              "Rows naming a pack the catalog no longer has are deleted by a GC on this "
              "host and when a writer of this host sees a new gc_generation "
              "(``Store.prune_located``), which then also empties ``located_trees``.",
        "kind": "as in objects.",
        "pack": "as in objects.",
        "rec_offset": "as in objects.",
        "rec_length": "as in objects.",
        "codec": "as in objects.",
        "inner_offset": "as in objects.",
        "raw_length": "as in objects.",
    },
    "located_trees": {
        "id": "32-byte id of a tree every object below which (itself included) has a "
              "``located`` row: a later walk does not descend into it (primary key).",
    },
    "config": {
        "key": "setting name (primary key): schema_version, unverified_rebuild, ...; on "
               "a shared store's host file also backend_config, a copy of the backend's "
               "config.json (which never changes), so opening the store asks no S3 server.",
        "value": "setting value as text.",
    },
    "sessions": {
        "id": "session id (primary key): the session registry of the catalog "
              "(store/catalog.py).",
        "host": "host id of the host whose state directory holds the session's upper.",
        "record": "the session record as JSON (fusefs/session/registry.py).",
    },
    "leases": {
        "name": "lease name (primary key), e.g. session/<id> or workspace-roots/<sha256>.",
        "holder": "opaque holder id (host:pid:nonce).",
        "epoch": "increases by one at every acquisition of this name.",
        "expires_ns": "the holder must renew before this time or the lease can be taken.",
    },
}


def create(conn: sqlite3.Connection) -> None:
    """Create every table that is missing (idempotent) and switch the file to WAL.

    A file already at SCHEMA_VERSION is left alone without importing sqlite-utils, which
    keeps short CLI commands fast.
    """
    try:
        row = conn.execute("SELECT value FROM config WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError:
        row = None
    if row is not None and row[0] == str(SCHEMA_VERSION):
        return
    import sqlite_utils

    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    db = sqlite_utils.Database(conn)
    db.table("objects").create(
        {"id": bytes, "kind": int, "pack": str, "rec_offset": int, "rec_length": int,
         "codec": int, "inner_offset": int, "raw_length": int},
        pk="id", not_null={"kind", "pack", "rec_offset", "rec_length", "codec",
                           "inner_offset", "raw_length"}, if_not_exists=True)
    db.table("packs").create({"key": str, "size": int, "objects": int}, pk="key", if_not_exists=True)
    db.table("snapshots").create({"ref": str, "time_ns": int, "origin": str, "label": str,
                            "key": str}, pk="ref", if_not_exists=True)
    if not db.table("snapshot_labels").exists():
        db.table("snapshot_labels").create({"ref": str, "label": str, "time_ns": int,
                                            "key": str}, pk=("ref", "label"))
        conn.execute("INSERT INTO snapshot_labels(ref, label, time_ns, key) SELECT ref, "
                     "label, time_ns, key FROM snapshots WHERE label IS NOT NULL")
    db.table("journal").create({"session": str, "seq": int, "time_ns": int, "epoch": int,
                          "event": str, "ref": str, "trigger_": str, "consistency": str,
                          "key": str}, pk=("session", "seq"), if_not_exists=True)
    db.table("named_refs").create({"name": str, "ref": str}, pk="name", if_not_exists=True)
    db.table("state_dirs").create({"path": str}, pk="path", if_not_exists=True)
    db.table("files_cache").create({"path": bytes, "size": int, "mtime_ns": int, "ctime_ns": int,
                              "inode": int, "chunks": bytes, "trusted_before_ns": int},
                             pk="path", if_not_exists=True)
    # Only a cache: recreated at every schema upgrade. WITHOUT ROWID (which sqlite-utils
    # cannot create) keeps rows in key order, so a snapshot reads its rows in one range scan.
    conn.execute("DROP TABLE IF EXISTS dirs_cache")
    conn.execute("CREATE TABLE dirs_cache (path BLOB PRIMARY KEY NOT NULL, own BLOB, "
                 "subdirs BLOB, others BLOB, stat_digest BLOB, children_digest BLOB, "
                 "tree_id BLOB, trusted_before_ns INTEGER) WITHOUT ROWID")
    conn.execute("CREATE TABLE IF NOT EXISTS chunk_pages (id BLOB PRIMARY KEY NOT NULL, "
                 "pages INTEGER NOT NULL) WITHOUT ROWID")
    conn.execute("CREATE TABLE IF NOT EXISTS located (id BLOB PRIMARY KEY NOT NULL, "
                 "kind INTEGER NOT NULL, pack TEXT NOT NULL, rec_offset INTEGER NOT NULL, "
                 "rec_length INTEGER NOT NULL, codec INTEGER NOT NULL, "
                 "inner_offset INTEGER NOT NULL, raw_length INTEGER NOT NULL) WITHOUT ROWID")
    conn.execute("CREATE TABLE IF NOT EXISTS located_trees (id BLOB PRIMARY KEY NOT NULL) "
                 "WITHOUT ROWID")
    db.table("config").create({"key": str, "value": str}, pk="key", if_not_exists=True)
    db.table("leases").create({"name": str, "holder": str, "epoch": int, "expires_ns": int},
                        pk="name", if_not_exists=True)
    db.table("sessions").create({"id": str, "host": str, "record": str}, pk="id",
                                if_not_exists=True)
    db.table("objects").create_index(["pack"], if_not_exists=True)
    conn.execute("INSERT OR REPLACE INTO config(key, value) VALUES ('schema_version', ?)",
                 (str(SCHEMA_VERSION),))
    conn.commit()
