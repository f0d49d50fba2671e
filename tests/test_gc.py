"""GC: forgotten objects go; everything reachable from the snapshot list, journals, named
refs, state directories and extra roots stays; GC fails closed when it cannot prove what is
live; a snapshot running in another process at the same time loses nothing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_verify import Built, build, file_entry, new_store

from store.errors import GCError
from store.gc import gc
from store.objects import Store
from store.pack import ObjKind, PackBuilder
from store.rebuild import rebuild_index
from store.ref import ObjectId, Ref, object_id
from store.tree import Entry, Kind
from store.verify import verify


def reachable(store: Store, ref: Ref) -> set[ObjectId]:
    """Every object id under ``ref``, each read back (and so verified) on the way."""
    out: set[ObjectId] = set()
    stack = [ref.tree_id]
    while stack:
        tid = stack.pop()
        if tid in out:
            continue
        out.add(tid)
        for e in store.get_tree(tid):
            if e.kind is Kind.DIR:
                assert e.tree_id is not None
                stack.append(e.tree_id)
            elif e.kind is Kind.FILE:
                data = b"".join(store.iter_file(e))
                assert len(data) == e.size
                out.update(e.chunks)
    return out


def all_ids(store: Store) -> set[bytes]:
    return {r[0] for r in store.conn.execute("SELECT id FROM objects")}


def backend_packs(store: Store) -> set[str]:
    return set(store.backend.list("packs/"))


def indexed_packs(store: Store) -> set[str]:
    return {r[0] for r in store.conn.execute("SELECT key FROM packs")}


def test_forgotten_snapshot_objects_go_and_listed_ones_stay(tmp_path: object) -> None:
    s = new_store(tmp_path)
    a = build(s, seed=1)
    b = build(s, seed=2, session="s2")
    a_ids = reachable(s, a.ref)
    b_ids = reachable(s, b.ref)
    s.forget(a.ref)
    s.conn.execute("DELETE FROM journal WHERE session='s1'")  # drop a's only journal too
    for k in s.backend.list("journal/s1/"):
        s.backend.delete(k)
    rep = gc(s)
    assert rep.objects_deleted >= len(a_ids - b_ids)
    assert rep.bytes_freed > 0
    assert all_ids(s).isdisjoint(a_ids - b_ids)
    assert not s.has(a.spare_chunk)
    # The chunks' data page counts (st_blocks) go with them; the kept ones stay.
    paged = {bytes(r[0]) for r in s.conn.execute("SELECT id FROM chunk_pages")}
    assert paged and paged <= all_ids(s)
    # b's unreferenced chunk shares a mostly live pack: it stays until that pack is sparse.
    assert s.has(b.spare_chunk)
    assert reachable(s, b.ref) == b_ids
    assert backend_packs(s) == indexed_packs(s)
    assert verify(s) == []
    again = gc(s)  # idempotent
    assert (again.packs_deleted, again.packs_repacked, again.objects_deleted) == (0, 0, 0)


def test_journals_named_refs_state_dirs_and_extra_roots_keep_objects(tmp_path: object) -> None:
    s = new_store(tmp_path)
    listed = build(s, seed=1, session="a")
    journaled = build(s, seed=2, session="b")
    named = build(s, seed=3, session="c")
    state = build(s, seed=4, session="d")
    extra = build(s, seed=5, session="e")
    gone = build(s, seed=6, session="f")
    for b in (journaled, named, state, extra, gone):
        s.forget(b.ref)
    for session in ("c", "d", "e", "f"):
        s.conn.execute("DELETE FROM journal WHERE session=?", (session,))
        for k in s.backend.list(f"journal/{session}/"):
            s.backend.delete(k)
    s.conn.execute("INSERT INTO named_refs(name, ref) VALUES ('pin', ?)", (str(named.ref),))
    s.conn.execute("INSERT INTO state_dirs(path) VALUES ('/state/x')")
    keep = {b.ref: reachable(s, b.ref) for b in (listed, journaled, named, state, extra)}
    gone_only = reachable(s, gone.ref) - set().union(*keep.values())
    assert gone_only

    asked: list[str] = []

    def reader(path: str) -> list[Ref]:
        asked.append(path)
        return [state.ref]

    gc(s, extra_live=[extra.ref], state_dirs_reader=reader)
    assert asked == ["/state/x"]
    for ref, ids in keep.items():
        assert reachable(s, ref) == ids
    assert all_ids(s).isdisjoint(gone_only)
    assert verify(s) == []


def test_state_dir_without_reader_or_unreadable_fails_closed(built: Built) -> None:
    s = built.store
    s.forget(built.ref)
    s.conn.execute("DELETE FROM journal")
    for k in s.backend.list("journal/"):
        s.backend.delete(k)
    s.conn.execute("INSERT INTO state_dirs(path) VALUES ('/state/x')")
    before = (s.backend.list(), all_ids(s))
    with pytest.raises(GCError) as ei:
        gc(s)
    assert (ei.value.op, ei.value.key) == ("live", "/state/x")

    def broken(path: str) -> list[Ref]:
        raise OSError(5, "I/O error", path)

    with pytest.raises(GCError) as ei:
        gc(s, state_dirs_reader=broken)
    assert ei.value.key == "/state/x" and "I/O error" in ei.value.cause
    assert (s.backend.list(), all_ids(s)) == before
    assert ei.value.exit_code == 8


@pytest.fixture
def built(tmp_path: object) -> Built:
    return build(new_store(tmp_path))


def test_refuses_after_rebuild_until_verified(built: Built) -> None:
    s = built.store
    s.forget(built.ref)
    before = s.backend.list()
    rebuild_index(s)
    with pytest.raises(GCError) as ei:
        gc(s)
    assert ei.value.op == "check" and "verify" in ei.value.cause
    assert s.backend.list() == before
    s.conn.execute("UPDATE packs SET size=size+1")
    assert verify(s) != []
    with pytest.raises(GCError):
        gc(s)
    s.conn.execute("UPDATE packs SET size=size-1")
    assert verify(s) == []
    gc(s)  # the journal still names the ref, so its objects stay
    reachable(s, built.ref)


def test_repacks_sparse_pack(tmp_path: object) -> None:
    s = new_store(tmp_path)
    with s.writer() as w:
        keep = file_entry(w, b"keep", b"k" * 5000)
        drop = file_entry(w, b"drop", os.urandom(200_000))
        keep_ref = Ref(w.put_tree([keep]))
        drop_ref = Ref(w.put_tree([drop]))
        w.commit()
        s.add_snapshot(keep_ref, "test")
        s.add_snapshot(drop_ref, "test")
    (old_pack,) = indexed_packs(s)
    s.forget(drop_ref)
    rep = gc(s)
    assert rep.packs_repacked == 1 and rep.packs_written == 1
    assert old_pack not in backend_packs(s)
    assert backend_packs(s) == indexed_packs(s) != {old_pack}
    assert not s.has(drop.chunks[0])
    assert reachable(s, keep_ref) == {keep_ref.tree_id, *keep.chunks}
    assert rep.bytes_freed > 150_000
    assert verify(s) == []
    assert gc(s).packs_repacked == 0


def test_mostly_live_pack_is_kept(tmp_path: object) -> None:
    s = new_store(tmp_path)
    with s.writer() as w:
        keep = file_entry(w, b"keep", os.urandom(200_000))
        drop = file_entry(w, b"drop", os.urandom(5_000))
        keep_ref = Ref(w.put_tree([keep]))
        drop_ref = Ref(w.put_tree([drop]))
        w.commit()
        s.add_snapshot(keep_ref, "test")
        s.add_snapshot(drop_ref, "test")
    packs = indexed_packs(s)
    s.forget(drop_ref)
    rep = gc(s)
    assert (rep.packs_repacked, rep.packs_deleted) == (0, 0)
    assert indexed_packs(s) == backend_packs(s) == packs
    reachable(s, keep_ref)
    assert verify(s) == []


def test_unindexed_leftover_packs_go_unknown_keys_stay(built: Built) -> None:
    s = built.store
    emitted: list[str] = []

    def emit(key: str, data: bytes, rows: object) -> None:
        s.backend.put(key, data)
        emitted.append(key)

    pb = PackBuilder(emit)
    pb.add(object_id(b"orphan"), ObjKind.CHUNK, b"orphan")
    pb.flush()
    for k in ("packs/not-a-pack", "packs/" + "A" * 64 + ".pack", "elsewhere/blob"):
        s.backend.put(k, b"keep me")
    assert verify(s) == []  # a leftover pack is not a problem, only garbage
    rep = gc(s)
    assert rep.leftover_packs == 1 and rep.packs_deleted == 1
    assert not s.backend.exists(emitted[0])
    assert sorted(rep.unknown_keys) == sorted(["packs/not-a-pack", "packs/" + "A" * 64 + ".pack",
                                               "elsewhere/blob"])
    for k in rep.unknown_keys:
        assert s.backend.get(k) == b"keep me"
    reachable(s, built.ref)


def test_files_cache_rows_of_deleted_chunks_are_pruned(tmp_path: object) -> None:
    s = new_store(tmp_path)
    a = build(s, seed=1, session="a")
    b = build(s, seed=2, session="b")
    s.forget(a.ref)
    s.conn.execute("DELETE FROM journal WHERE session='a'")
    for k in s.backend.list("journal/a/"):
        s.backend.delete(k)
    ins = ("INSERT INTO files_cache(path, size, mtime_ns, ctime_ns, inode, chunks, "
           "trusted_before_ns) VALUES (?, 0, 0, 0, 0, ?, 0)")
    s.conn.execute(ins, (b"/a/big", b"".join(a.big.chunks)))
    s.conn.execute(ins, (b"/b/big", b"".join(b.big.chunks)))
    rep = gc(s)
    assert rep.files_cache_pruned == 1
    assert [r[0] for r in s.conn.execute("SELECT path FROM files_cache")] == [b"/b/big"]


def test_unreadable_live_tree_fails_closed(built: Built) -> None:
    s = built.store
    build(s, seed=2, session="s2")
    s.forget(built.ref)  # garbage exists, but a live tree is gone: delete nothing
    loc = s.locate(built.sub_tree)
    os.unlink(os.path.join(s.root, "backend", *loc.pack.split("/")))
    s = Store(s.root)  # no cached trees
    before = (s.backend.list(), all_ids(s))
    with pytest.raises(GCError) as ei:
        gc(s)
    assert ei.value.op == "mark"
    assert (s.backend.list(), all_ids(s)) == before


def test_live_object_missing_from_index_fails_closed(built: Built) -> None:
    """A pack whose rows were lost looks like a crash leftover; GC must not delete it."""
    s = built.store
    pack = s.locate(built.big.chunks[0]).pack
    trees = [r[0] for r in s.conn.execute("SELECT id FROM objects WHERE pack=? AND kind=2",
                                          (pack,))]
    s.conn.execute("DELETE FROM objects WHERE pack=? AND kind=1", (pack,))
    before = s.backend.list()
    with pytest.raises(GCError) as ei:
        gc(s)
    assert ei.value.op == "mark" and "not indexed" in ei.value.cause
    assert s.backend.list() == before
    assert trees


# -- a snapshot in another process, concurrently with GC -------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SNAPSHOTTER = r"""
import os, random, sys
from store.objects import Store
from store.snapshot import snapshot

root, tree, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rnd = random.Random(seed)
store = Store(root)
listed = []
for i in range(n):
    for _ in range(3):  # rewrite, add and delete files so every snapshot has new content
        name = os.path.join(tree, f"f{rnd.randrange(12)}")
        with open(name, "wb") as f:
            f.write(rnd.randbytes(rnd.randrange(0, 200_000)))
    victim = os.path.join(tree, f"f{rnd.randrange(12)}")
    if os.path.exists(victim) and rnd.random() < 0.3:
        os.unlink(victim)
    ref = snapshot(store, tree, label=f"iteration {i}")
    listed.append(ref)
    if len(listed) > 2 and rnd.random() < 0.6:  # forgetting makes garbage for GC to find
        store.forget(listed.pop(rnd.randrange(len(listed) - 1)))
    print(ref, flush=True)
print("done", flush=True)
"""


def test_concurrent_snapshot_in_another_process_loses_nothing_and_verifies(tmp_path: object) -> None:
    from store.materialize import materialize
    from store.snapshot import compute_ref, snapshot

    s = new_store(tmp_path)
    tree = os.path.join(str(tmp_path), "tree")
    os.makedirs(os.path.join(tree, "fixed"))
    with open(os.path.join(tree, "fixed", "same"), "wb") as f:
        f.write(os.urandom(150_000))  # unchanged throughout: reused from the files cache
    first = snapshot(s, tree)
    child = subprocess.Popen([sys.executable, "-c", _SNAPSHOTTER, s.root, tree, "25", "7"],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    runs = 0
    try:
        while child.poll() is None or runs < 3:
            gc(s)
            assert verify(s) == []  # verify, too, sees a consistent store while writers run
            runs += 1
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert out.splitlines()[-1] == "done"
    gc(s)
    assert verify(s) == []
    listed = s.list_snapshots()
    assert first in {i.ref for i in listed} and len(listed) >= 3
    for n, info in enumerate(listed):
        dest = os.path.join(str(tmp_path), f"out{n}")
        materialize(s, info.ref, dest)
        assert compute_ref(dest, chunk_size=s.chunk_size) == info.ref
    assert backend_packs(s) == indexed_packs(s)


def test_reader_whose_object_is_repacked_mid_read_gets_the_bytes(tmp_path: object) -> None:
    """A reader that located an object just before GC moved it reads it from its new pack."""
    s = new_store(tmp_path)
    with s.writer() as w:
        keep = file_entry(w, b"keep", b"k" * 5000)
        drop = file_entry(w, b"drop", os.urandom(200_000))
        keep_ref = Ref(w.put_tree([keep]))
        drop_ref = Ref(w.put_tree([drop]))
        w.commit()
        s.add_snapshot(keep_ref, "test")
        s.add_snapshot(drop_ref, "test")
    s.forget(drop_ref)

    class GCBetweenLocateAndRead(Store):
        collected = False

        def locate(self, oid: ObjectId, *, fresh: bool = False):  # type: ignore[no-untyped-def]
            loc = super().locate(oid, fresh=fresh)
            if not self.collected:
                self.collected = True
                assert gc(s).packs_repacked == 1
            return loc

    reader = GCBetweenLocateAndRead(s.root)
    assert reader.read_object(keep.chunks[0]) == b"k" * 5000
    assert reader.collected


def test_stats_count_logical_unique_and_stored_bytes(tmp_path: object) -> None:
    from store.stats import stats

    s = new_store(tmp_path)
    shared = os.urandom(100_000)
    text = b"line of text\n" * 20_000
    noise = os.urandom(300_000)
    with s.writer() as w:
        a = Ref(w.put_tree([file_entry(w, b"x", shared)]))
        sub = w.put_tree([file_entry(w, b"x", shared), file_entry(w, b"t", text),
                          file_entry(w, b"n", noise)])
        b = Ref(w.put_tree([file_entry(w, b"copy", shared),
                            file_entry(w, b"empty", b""),
                            Entry(b"d", Kind.DIR, 0o755, 0, 0, 0, tree_id=sub)]))
        w.commit()
        s.add_snapshot(a, "test")
        s.add_snapshot(b, "test")
    st = stats(s)
    assert st.snapshots == 2 and st.files == 6
    assert st.logical_bytes == 3 * len(shared) + len(text) + len(noise)
    assert st.unique_bytes == len(shared) + len(text) + len(noise)
    assert st.dedup_ratio == st.logical_bytes / st.unique_bytes
    assert st.stored_bytes == sum(len(s.backend.get(k)) for k in s.backend.list("packs/"))
    assert st.stored_bytes < st.unique_bytes  # the text compresses
    assert st.compression_ratio > 1
    s.forget(b)
    gc(s)
    after = stats(s)
    assert (after.snapshots, after.files, after.logical_bytes) == (1, 1, len(shared))
    assert after.unique_bytes == len(shared)
    assert len(shared) < after.stored_bytes < len(shared) + 1000
