"""verify: a healthy store reports nothing; each documented invariant, broken by hand, is
reported by its stable name (and, where the damage allows, nothing else is)."""

from __future__ import annotations

import json
import os
import random
import re
import time
from dataclasses import dataclass, replace

import pytest

from store.objects import Store, Writer
from store.pack import ObjKind
from store.ref import ObjectId, Ref, object_id
from store.tree import MAGIC, Entry, Kind, encode_tree
from store.verify import INVARIANTS, Problem, verify

CHUNK = 64 << 10


@dataclass
class Built:
    """A small store: ``ref`` is listed and journaled; ids name its parts."""

    store: Store
    ref: Ref
    big: Entry           # a two-chunk incompressible file in the root
    small_chunk: ObjectId
    sub_tree: ObjectId
    spare_chunk: ObjectId  # indexed, in the same pack, reachable from nothing


def file_entry(w: Writer, name: bytes, data: bytes) -> Entry:
    chunks = tuple(w.put_chunk(data[i:i + CHUNK]) for i in range(0, len(data), CHUNK))
    return Entry(name, Kind.FILE, 0o644, 1000, 1000, 1_700_000_000_123_456_789, len(data),
                 chunks)


def new_store(tmp_path: object) -> Store:
    return Store(os.path.join(str(tmp_path), "store"), chunk_size=CHUNK)


def build(store: Store, seed: int = 1, session: str = "s1") -> Built:
    rnd = random.Random(seed)
    with store.writer() as w:
        big = file_entry(w, b"big.bin", rnd.randbytes(CHUNK + 1000))
        small = file_entry(w, b"small.txt", b"hello %d\n" % seed * 50)
        sub = w.put_tree([small, Entry(b"link", Kind.SYMLINK, 0o777, 0, 0, 5, 3,
                                       target=b"../x"),
                          Entry(b"empty", Kind.DIR, 0o755, 0, 0, 0,
                                tree_id=w.put_tree([]))])
        root = w.put_tree([big, Entry(b"sub", Kind.DIR, 0o755, 0, 0, 7, tree_id=sub)])
        spare = w.put_chunk(b"not referenced %d" % seed)
        w.commit()
        ref = Ref(root)
        store.add_snapshot(ref, "test", label=f"seed {seed}")
        store.append_journal(session, "WorkspaceCheckpointed", ref, trigger="manual",
                             consistency="quiescent")
    return Built(store, ref, big, small.chunks[0], sub, spare)


@pytest.fixture
def built(tmp_path: object) -> Built:
    return build(new_store(tmp_path))


def names(problems: list[Problem]) -> set[str]:
    return {p.invariant for p in problems}


def pack_path(store: Store, key: str) -> str:
    return os.path.join(store.root, "backend", *key.split("/"))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def listed_with(store: Store, w: Writer, extra: list[Entry]) -> Ref:
    """Commit a root holding ``extra`` and list it."""
    root = w.put_tree(extra)
    w.commit()
    ref = Ref(root)
    store.add_snapshot(ref, "test")
    return ref


def test_invariants_are_documented_with_the_schema() -> None:
    import store.schema

    doc = store.schema.__doc__ or ""
    assert re.findall(r"^- \[([a-z-]+)\]", doc, re.M) == list(INVARIANTS)


def test_healthy_store_reports_nothing(built: Built) -> None:
    build(built.store, seed=2, session="s2")
    assert verify(built.store) == []
    assert verify(built.store, full=False) == []


def test_empty_store_reports_nothing(tmp_path: object) -> None:
    assert verify(new_store(tmp_path)) == []


def test_object_hash_stored_bytes_under_a_wrong_id(built: Built) -> None:
    s = built.store
    data = b"these bytes are not what the id says" * 10
    wrong = object_id(b"something else")
    with s.writer() as w:
        w.put(wrong, ObjKind.CHUNK, data)
        listed_with(s, w, [Entry(b"f", Kind.FILE, 0o644, 0, 0, 0, len(data), (wrong,))])
    problems = verify(s)
    assert names(problems) == {"object-hash"}
    assert [p.key for p in problems] == [wrong.hex()]


def test_object_hash_flipped_byte_names_the_object(built: Built) -> None:
    s = built.store
    cid = built.big.chunks[0]  # 64 KiB of random bytes: a record of its own, stored raw
    loc = s.locate(cid)
    assert loc.codec == 0 and loc.raw_length == loc.rec_length == CHUNK
    flip(pack_path(s, loc.pack), loc.rec_offset + loc.rec_length // 2)
    problems = verify(s)
    assert names(problems) == {"object-hash", "pack-trailer"}
    assert [p.key for p in problems if p.invariant == "object-hash"] == [cid.hex()]
    assert [p.key for p in problems if p.invariant == "pack-trailer"] == [loc.pack]


def test_object_location_row_pointing_at_unindexed_pack(built: Built) -> None:
    s = built.store
    pack = s.locate(built.spare_chunk).pack
    s.conn.execute("DELETE FROM packs WHERE key=?", (pack,))
    problems = verify(s)
    assert names(problems) == {"object-location"}
    n = s.conn.execute("SELECT COUNT(*) FROM objects WHERE pack=?", (pack,)).fetchone()[0]
    assert len(problems) == n


def test_object_location_row_differs_from_trailer(built: Built) -> None:
    s = built.store
    s.conn.execute("UPDATE objects SET raw_length=raw_length+1 WHERE id=?", (built.spare_chunk,))
    problems = verify(s)
    assert "object-location" in names(problems)
    assert names(problems) <= {"object-location", "object-hash"}
    assert {p.key for p in problems} == {built.spare_chunk.hex()}


def test_object_location_deleted_pack(built: Built) -> None:
    s = built.store
    pack = s.locate(built.spare_chunk).pack
    os.unlink(pack_path(s, pack))
    problems = verify(s)
    assert names(problems) == {"object-location"}
    assert built.big.chunks[0].hex() in {p.key for p in problems}


def test_pack_trailer_corrupt_index(built: Built) -> None:
    s = built.store
    pack = s.locate(built.spare_chunk).pack
    path = pack_path(s, pack)
    flip(path, os.path.getsize(path) - 48 - 10)  # inside the trailer index
    problems = verify(s)
    assert names(problems) == {"pack-trailer"}
    assert {p.key for p in problems} == {pack}


def test_pack_trailer_size_differs_from_index(built: Built) -> None:
    s = built.store
    s.conn.execute("UPDATE packs SET size=size+1")
    assert names(verify(s)) == {"pack-trailer"}


def test_pack_indexed_object_row_lost(built: Built) -> None:
    s = built.store
    s.conn.execute("DELETE FROM objects WHERE id=?", (built.spare_chunk,))
    problems = verify(s)
    assert problems == [Problem("pack-indexed", built.spare_chunk.hex(), problems[0].detail)]


def test_tree_decodes_non_canonical_tree(built: Built) -> None:
    s = built.store
    a = encode_tree([Entry(b"a", Kind.FIFO, 0, 0, 0, 0)])[len(MAGIC) + 1:]
    b = encode_tree([Entry(b"b", Kind.FIFO, 0, 0, 0, 0)])[len(MAGIC) + 1:]
    unsorted = MAGIC + b"\x02" + b + a
    with s.writer() as w:
        tid = object_id(unsorted)
        w.put(tid, ObjKind.TREE, unsorted)
        listed_with(s, w, [Entry(b"d", Kind.DIR, 0o755, 0, 0, 0, tree_id=tid)])
    problems = verify(s)
    assert names(problems) == {"tree-decodes"}
    assert [p.key for p in problems] == [tid.hex()]


def test_tree_decodes_hostile_name(built: Built) -> None:
    s = built.store
    ok = encode_tree([Entry(b"..x", Kind.FIFO, 0, 0, 0, 0)])
    bad = ok.replace(b"\x03..x", b"\x02..")
    assert bad != ok
    with s.writer() as w:
        tid = object_id(bad)
        w.put(tid, ObjKind.TREE, bad)
        w.commit()
        s.add_snapshot(Ref(tid), "test")
    assert names(verify(s)) == {"tree-decodes"}


def test_tree_complete_missing_chunk_and_child(built: Built) -> None:
    s = built.store
    missing = object_id(b"never stored")
    with s.writer() as w:
        listed_with(s, w, [
            Entry(b"f", Kind.FILE, 0o644, 0, 0, 0, 5, (missing,)),
            Entry(b"d", Kind.DIR, 0o755, 0, 0, 0, tree_id=missing),
            Entry(b"c", Kind.DIR, 0o755, 0, 0, 0, tree_id=built.spare_chunk),  # a chunk
        ])
    problems = verify(s)
    assert names(problems) == {"tree-complete"}
    assert len(problems) == 3


def test_file_size(built: Built) -> None:
    s = built.store
    with s.writer() as w:
        listed_with(s, w, [replace(built.big, size=built.big.size + 1)])
    assert names(verify(s)) == {"file-size"}


def list_by_hand(s: Store, ref: Ref) -> None:
    """List ``ref`` as add_snapshot would, without its checks (it refuses such refs)."""
    key = f"snapshots/{time.time_ns():020d}-{os.getpid()}-add.json"
    rec = {"op": "add", "ref": str(ref), "time_ns": 1, "origin": "test", "label": None}
    s.backend.put(key, json.dumps(rec, sort_keys=True).encode())
    s.conn.execute("INSERT OR REPLACE INTO snapshots(ref, time_ns, origin, label, key) "
                   "VALUES (?, 1, 'test', NULL, ?)", (str(ref), key))


def test_snapshot_root(built: Built) -> None:
    s = built.store
    ghost = Ref(object_id(b"ghost"))
    list_by_hand(s, ghost)
    assert verify(s) == [Problem("snapshot-root", str(ghost), verify(s)[0].detail)]
    s.forget(ghost)
    list_by_hand(s, Ref(built.spare_chunk))  # a chunk is not a tree
    assert names(verify(s)) == {"snapshot-root"}


def test_journal_ref(built: Built) -> None:
    s = built.store
    s.append_journal("s1", "WorkspaceRestored", Ref(object_id(b"ghost")))
    problems = verify(s)
    assert names(problems) == {"journal-ref"}
    assert problems[0].key == "journal/s1/000000000002.json"


def test_named_ref(built: Built) -> None:
    s = built.store
    s.conn.execute("INSERT INTO named_refs(name, ref) VALUES ('pin', ?)",
                   (str(Ref(object_id(b"ghost"))),))
    assert [(p.invariant, p.key) for p in verify(s)] == [("named-ref", "pin")]
    s.conn.execute("UPDATE named_refs SET ref='not a ref'")
    assert names(verify(s)) == {"named-ref"}


def test_history_object_row_without_record(built: Built) -> None:
    s = built.store
    (key,) = s.conn.execute("SELECT key FROM snapshots").fetchone()
    s.backend.delete(key)
    problems = verify(s)
    assert [(p.invariant, p.key) for p in problems] == [("history-object", str(built.ref))]


def test_history_object_row_differs_from_record(built: Built) -> None:
    s = built.store
    s.conn.execute("UPDATE snapshots SET label='edited'")
    s.conn.execute("UPDATE journal SET trigger_='idle'")
    problems = verify(s)
    assert names(problems) == {"history-object"}
    assert len(problems) == 2


def test_history_object_journal_object_lost_and_garbage_record(built: Built) -> None:
    s = built.store
    s.backend.delete("journal/s1/000000000001.json")
    s.backend.put("snapshots/00000000000000000001-1-add.json", b"{not json")
    problems = verify(s)
    assert names(problems) == {"history-object"}
    assert {p.key for p in problems} == {"journal/s1/1",
                                        "snapshots/00000000000000000001-1-add.json"}


def test_journal_seq_gap(built: Built) -> None:
    s = built.store
    rec = json.loads(s.backend.get("journal/s1/000000000001.json"))
    rec["seq"] = 3
    s.backend.put("journal/s1/000000000003.json", json.dumps(rec).encode())
    assert [(p.invariant, p.key) for p in verify(s)] == [("journal-seq", "s1")]


def test_records_a_crash_kept_from_the_index_are_caught_up(built: Built) -> None:
    """A record durable in the backend whose row was never written is applied, not
    reported: the index lags, nothing is broken."""
    s = built.store
    b2 = build(s, seed=2, session="s1")
    s.conn.execute("DELETE FROM snapshots WHERE ref=?", (str(b2.ref),))
    s.conn.execute("DELETE FROM journal WHERE seq=2")
    assert verify(s) == []
    assert [i.ref for i in s.list_snapshots()] == [built.ref, b2.ref]
    assert [e.ref for e in s.journal("s1")] == [built.ref, b2.ref]
    assert s.append_journal("s1", "WorkspaceRestored", built.ref) == 3


def test_forget_record_is_caught_up(built: Built) -> None:
    s = built.store
    (key,) = s.conn.execute("SELECT key FROM snapshots").fetchone()
    s.forget(built.ref)
    s.conn.execute("INSERT INTO snapshots(ref, time_ns, origin, label, key) "
                   "VALUES (?, 1, 'test', NULL, ?)", (str(built.ref), key))
    assert verify(s) == []
    assert s.list_snapshots() == []


def test_clean_full_run_clears_unverified_rebuild(built: Built) -> None:
    s = built.store
    s.set_config("unverified_rebuild", "1")
    s.conn.execute("UPDATE packs SET size=size+1")
    assert verify(s) != []
    assert s.config_value("unverified_rebuild") == "1"
    s.conn.execute("UPDATE packs SET size=size-1")
    assert verify(s, full=False) == []
    assert s.config_value("unverified_rebuild") == "1"
    assert verify(s) == []
    assert s.config_value("unverified_rebuild") is None


def test_progress_reaches_total(built: Built) -> None:
    seen: list[tuple[int, int]] = []
    verify(built.store, progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1] > 0
