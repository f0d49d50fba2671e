"""rebuild-index: the index comes back from the backend alone (packs' trailers and the
history objects); damaged packs and records are skipped and reported."""

from __future__ import annotations

import os

import pytest
from test_gc import reachable
from test_verify import build, new_store

from store.errors import RebuildShrinkError
from store.objects import Store
from store.rebuild import rebuild_index
from store.verify import verify


def drop_index(store: Store) -> Store:
    store.close()
    for suffix in ("", "-wal", "-shm"):
        try:
            os.unlink(store.index_path + suffix)
        except FileNotFoundError:
            pass
    return Store(store.root)


def test_rebuild_restores_snapshot_list_and_journals(tmp_path: object) -> None:
    s = new_store(tmp_path)
    a = build(s, seed=1, session="alpha")
    b = build(s, seed=2, session="beta")
    c = build(s, seed=3, session="alpha")
    s.forget(a.ref)  # still in alpha's journal
    s.add_snapshot(b.ref, "checkpoint", label="relabelled")  # re-listing replaces the row
    s.append_journal("beta", "WorkspaceRestored", c.ref, epoch=7)
    s.conn.execute("INSERT INTO named_refs(name, ref) VALUES ('pin', ?)", (str(a.ref),))
    snaps = s.list_snapshots()
    journals = {x: s.journal(x) for x in ("alpha", "beta")}
    objects = sorted(s.conn.execute("SELECT * FROM objects").fetchall())
    packs = sorted(s.conn.execute("SELECT * FROM packs").fetchall())
    assert [i.label for i in snaps] == ["seed 3", "relabelled"]
    labels = s.snapshot_labels()  # every label a listed Ref was given; forget drops them
    assert sorted((str(r), name) for r, name, _ in labels) == sorted(
        [(str(b.ref), "seed 2"), (str(b.ref), "relabelled"), (str(c.ref), "seed 3")])

    s2 = drop_index(s)
    assert s2.list_snapshots() == snaps  # a lost index is rebuilt at open
    assert s2.snapshot_labels() == labels
    assert s2.config_value("unverified_rebuild") == "1"
    rep = rebuild_index(s2)
    assert (rep.snapshots, rep.journal_events, rep.packs) == (2, 4, len(packs))
    assert rep.skipped_packs == rep.skipped_records == rep.unknown_keys == []
    assert s2.list_snapshots() == snaps and s2.snapshot_labels() == labels
    assert {x: s2.journal(x) for x in ("alpha", "beta")} == journals
    assert sorted(s2.conn.execute("SELECT * FROM objects").fetchall()) == objects
    assert sorted(s2.conn.execute("SELECT * FROM packs").fetchall()) == packs
    for b_ in (a, b, c):
        reachable(s2, b_.ref)
    assert s2.config_value("unverified_rebuild") == "1"
    assert verify(s2) == []
    assert s2.config_value("unverified_rebuild") is None


def test_rebuild_in_place_keeps_local_tables_and_drops_the_files_cache(tmp_path: object) -> None:
    s = new_store(tmp_path)
    a = build(s)
    s.conn.execute("INSERT INTO named_refs(name, ref) VALUES ('pin', ?)", (str(a.ref),))
    s.conn.execute("INSERT INTO state_dirs(path) VALUES ('/state/x')")
    s.conn.execute("INSERT INTO files_cache(path, size, mtime_ns, ctime_ns, inode, chunks, "
                   "trusted_before_ns) VALUES (?, 0, 0, 0, 0, ?, 0)",
                   (b"/x", b"".join(a.big.chunks)))
    s.conn.execute("DELETE FROM objects WHERE id=?", (a.spare_chunk,))
    s.conn.execute("DELETE FROM snapshots")
    rebuild_index(s)
    assert s.has(a.spare_chunk)
    assert [i.ref for i in s.list_snapshots()] == [a.ref]
    assert s.conn.execute("SELECT name FROM named_refs").fetchall() == [("pin",)]
    assert s.conn.execute("SELECT path FROM state_dirs").fetchall() == [("/state/x",)]
    assert s.conn.execute("SELECT COUNT(*) FROM files_cache").fetchone() == (0,)


def test_damaged_packs_and_records_are_skipped_and_reported(tmp_path: object) -> None:
    s = new_store(tmp_path)
    a = build(s, seed=1)
    b = build(s, seed=2, session="s2")
    bad_pack = s.locate(b.spare_chunk).pack  # b's own objects (a's pack holds shared ones)
    path = os.path.join(s.root, "backend", *bad_pack.split("/"))
    with open(path, "r+b") as f:  # break the footer magic
        f.seek(-1, os.SEEK_END)
        f.write(b"?")
    s.backend.put("snapshots/00000000000000000001-1-add.json", b"[]")
    s.backend.put("journal/s9/000000000001.json", b"{}")
    s.backend.put("stray/blob", b"x")
    s2 = drop_index(s)
    rep = rebuild_index(s2)
    assert [k for k, _ in rep.skipped_packs] == [bad_pack]
    assert sorted(k for k, _ in rep.skipped_records) == [
        "journal/s9/000000000001.json", "snapshots/00000000000000000001-1-add.json"]
    assert rep.unknown_keys == ["stray/blob"]
    reachable(s2, a.ref)
    assert not s2.has(b.spare_chunk)
    problems = verify(s2)
    assert {p.invariant for p in problems} == {"snapshot-root", "journal-ref", "history-object"}
    assert s2.config_value("unverified_rebuild") == "1"


def test_rebuild_refuses_to_drop_the_rows_of_a_pack_the_store_lost(tmp_path: object) -> None:
    """A pack the index holds gone from the store (its snapshot records kept): the rebuild
    would silently drop its rows, and with them the second snapshot's trees; it is refused
    (exit 8) naming the pack, nothing changed; --force indexes what the store holds."""
    s = new_store(tmp_path)
    build(s, seed=1)
    b = build(s, seed=2, session="s2")
    lost = s.locate(b.spare_chunk).pack
    os.unlink(os.path.join(s.root, "backend", *lost.split("/")))
    before = [sorted(s.conn.execute(f"SELECT * FROM {t}").fetchall())
              for t in ("objects", "packs", "snapshots", "journal")]
    with pytest.raises(RebuildShrinkError) as e:
        rebuild_index(s)
    assert e.value.exit_code == 8 and e.value.packs == 1 and e.value.snapshots == 0
    assert lost in str(e.value) and "1 pack that the catalog indexes" in str(e.value)
    assert [sorted(s.conn.execute(f"SELECT * FROM {t}").fetchall())
            for t in ("objects", "packs", "snapshots", "journal")] == before
    assert s.config_value("unverified_rebuild") is None
    rep = rebuild_index(s, force=True)
    assert rep.packs == len(before[1]) - 1 and not s.has(b.spare_chunk)
    assert s.config_value("unverified_rebuild") == "1"


def test_rebuild_twice_gives_the_same_index(tmp_path: object) -> None:
    s = new_store(tmp_path)
    build(s, seed=1)
    build(s, seed=2, session="s2")
    rebuild_index(s)
    first = [sorted(s.conn.execute(f"SELECT * FROM {t}").fetchall())
             for t in ("objects", "packs", "snapshots", "journal")]
    rebuild_index(s)
    assert [sorted(s.conn.execute(f"SELECT * FROM {t}").fetchall())
            for t in ("objects", "packs", "snapshots", "journal")] == first


def test_catch_up_brings_back_every_label_the_history_gives(tmp_path: object) -> None:
    """Listings durable in the backend whose index rows a crash lost: catch-up writes the
    row and every label the Ref was given since it was listed (not the newest alone)."""
    from store.rebuild import catch_up

    s = new_store(tmp_path)
    a = build(s, seed=1)
    s.add_snapshot(a.ref, "checkpoint", label="P1")
    s.add_snapshot(a.ref, "checkpoint", label="P2")
    labels = s.snapshot_labels()
    assert [name for _, name, _ in labels] == ["seed 1", "P1", "P2"]
    rows = s.list_snapshots()
    s.conn.execute("DELETE FROM snapshots")
    s.conn.execute("DELETE FROM snapshot_labels")
    assert catch_up(s) > 0
    assert s.list_snapshots() == rows and s.snapshot_labels() == labels
