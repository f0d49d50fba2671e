"""One conformance suite for both catalogs (store/catalog.py): the embedded SQLite index and
the shared PostgreSQL catalog, the latter on a real throwaway cluster (tests/servers.py).

Then what only the shared catalog has: its versioned schema, reconnection after a server
restart, a typed error while the server is down, and two hosts racing for one lease.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from store import schema
from store.catalog import Catalog, Lease, SQLiteCatalog
from store.errors import CatalogError, FencedError, LeaseBusyError, LeaseLostError
from store.pack import Codec, Location, ObjKind
from store.ref import ObjectId

S = 1_000_000_000


def open_catalog(spec: str) -> Catalog:
    """A catalog from a test spec: a PostgreSQL URL, else the path of an SQLite index."""
    if spec.startswith("postgresql://"):
        from store.pgcatalog import PostgresCatalog

        return PostgresCatalog(spec)
    conn = sqlite3.connect(spec, isolation_level=None, timeout=60)
    conn.execute("PRAGMA busy_timeout=60000")
    schema.create(conn)
    return SQLiteCatalog(lambda: conn)


@pytest.fixture(params=["sqlite", "postgresql"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "index.sqlite")
    return str(request.getfixturevalue("pg_dsn"))


@pytest.fixture
def cat(spec: str) -> Iterator[Catalog]:
    c = open_catalog(spec)
    yield c
    c.close()


def _loc(n: int, pack: str = "packs/a.pack") -> Location:
    return Location(ObjectId(bytes([n]) * 32), ObjKind.CHUNK if n % 2 else ObjKind.TREE, pack,
                    4 + n * 10, 10, Codec.ZSTD, n, 100 + n)


def never_dead(holder: str) -> bool:
    return False


def test_objects_and_packs(cat: Catalog) -> None:
    a, b = _loc(1), _loc(2)
    assert not cat.has(a.oid) and cat.locate(a.oid) is None
    cat.add_objects([a, b], [("packs/a.pack", 1000, 2)])
    assert cat.has(a.oid) and cat.has(b.oid)
    assert cat.locate(a.oid) == a
    assert cat.locate_many([a.oid, _loc(3).oid, b.oid]) == {a.oid: a, b.oid: b}
    assert cat.locate_many([]) == {}
    # Adding an indexed object again (another host wrote it too) keeps the first row.
    cat.add_objects([_loc(1, "packs/b.pack")], [("packs/b.pack", 500, 1)])
    assert cat.locate(a.oid) == a
    assert cat.packs() == [("packs/a.pack", 1000, 2), ("packs/b.pack", 500, 1)]
    many = [_loc(i % 250, f"packs/{i}.pack") for i in range(3, 1203)]
    cat.add_objects(many, [])
    assert len(cat.locate_many(list(dict.fromkeys(m.oid for m in many)))) == 250


def test_snapshot_list(cat: Catalog) -> None:
    assert cat.snapshots() == [] and cat.snapshot("r1") is None
    cat.put_snapshot(("r2", 20, "checkpoint", None, "snapshots/2.json"))
    cat.put_snapshot(("r1", 10, "snapshot", "first", "snapshots/1.json"))
    assert cat.snapshots() == [("r1", 10, "snapshot", "first", "snapshots/1.json"),
                               ("r2", 20, "checkpoint", None, "snapshots/2.json")]
    cat.put_snapshot(("r1", 30, "import", "again", "snapshots/3.json"))  # re-listing
    assert cat.snapshot("r1") == ("r1", 30, "import", "again", "snapshots/3.json")
    assert [r[0] for r in cat.snapshots()] == ["r2", "r1"]
    assert cat.delete_snapshot("r2") and not cat.delete_snapshot("r2")
    assert [r[0] for r in cat.snapshots()] == ["r1"]
    # What a listing checks first, in one call: the root's kind and the ref's row.
    tree, chunk = _loc(2), _loc(1)
    cat.add_objects([tree, chunk], [("packs/a.pack", 1000, 2)])
    assert cat.before_listing("r1", tree.oid) == (int(ObjKind.TREE), cat.snapshot("r1"))
    assert cat.before_listing("r9", chunk.oid) == (int(ObjKind.CHUNK), None)
    assert cat.before_listing("r9", _loc(3).oid) == (None, None)


def _ev(session: str, seq: int, epoch: int = 1) -> tuple[str, int, int, int, str, str,
                                                          str | None, str | None, str]:
    return (session, seq, seq * 10, epoch, "WorkspaceCheckpointed", f"ref{seq}", "manual",
            "quiescent", f"journal/{session}/{seq:012d}.json")


def test_journal(cat: Catalog) -> None:
    assert cat.last_seq("s") == 0 and cat.journal("s") == []
    assert cat.add_journal(_ev("s", 1)) and cat.add_journal(_ev("s", 2))
    assert cat.add_journal(_ev("t", 1))
    assert not cat.add_journal(_ev("s", 2, epoch=9))  # (session, seq) exists: ignored
    assert cat.last_seq("s") == 2
    assert cat.journal("s") == [_ev("s", 1), _ev("s", 2)]
    restored = ("s", 3, 30, 1, "WorkspaceRestored", "ref3", None, None, "journal/s/3.json")
    cat.add_journal(restored)
    assert cat.journal("s")[-1] == restored
    assert sorted(cat.journal_refs()) == ["ref1", "ref2", "ref3"]


def test_fenced_append_refused_after_takeover(cat: Catalog) -> None:
    first = cat.lease_acquire("session/s", "hostA:1:a", 10 * S, 0, never_dead)
    assert cat.add_journal(_ev("s", 1, first.epoch), fence="session/s")
    second = cat.lease_acquire("session/s", "hostB:1:b", 10 * S, 20 * S, never_dead)  # expired
    assert second.epoch == first.epoch + 1
    with pytest.raises(FencedError) as ei:
        cat.add_journal(_ev("s", 2, first.epoch), fence="session/s")
    assert ei.value.epoch == first.epoch and ei.value.current == second.epoch
    assert cat.last_seq("s") == 1
    assert cat.add_journal(_ev("s", 2, second.epoch), fence="session/s")
    # A session that never had the lease is not fenced (nothing to be fenced against).
    assert cat.add_journal(_ev("u", 1, 5), fence="session/u")


def test_named_refs(cat: Catalog) -> None:
    assert cat.named_ref("n") is None and cat.named_refs() == []
    cat.set_named_ref("n", "r1")
    cat.set_named_ref("m", "r2")
    cat.set_named_ref("n", "r3")
    assert cat.named_ref("n") == "r3"
    assert cat.named_refs() == [("m", "r2"), ("n", "r3")]
    assert cat.delete_named_ref("m") and not cat.delete_named_ref("m")
    assert cat.named_refs() == [("n", "r3")]


def test_state_dirs(cat: Catalog) -> None:
    cat.add_state_dir("/var/s/1", "h1")
    cat.add_state_dir("/var/s/1", "h1")
    cat.add_state_dir("/var/s/2", "h1")
    assert [p for p, _ in cat.state_dirs("h1")] == ["/var/s/1", "/var/s/2"]
    cat.remove_state_dir("/var/s/1", "h1")
    assert [p for p, _ in cat.state_dirs("h1")] == ["/var/s/2"]


def test_session_registry(cat: Catalog) -> None:
    assert cat.session("x") is None
    cat.put_session("x", "h1", '{"id": "x"}')
    cat.put_session("y", "h2", '{"id": "y"}')
    assert cat.session("x") == ("h1", '{"id": "x"}')
    cat.put_session("x", "h2", '{"id": "x", "moved": true}')
    assert cat.sessions() == [("x", "h2", '{"id": "x", "moved": true}'),
                              ("y", "h2", '{"id": "y"}')]
    assert cat.delete_session("x") and not cat.delete_session("x")


def test_fenced_registry_write_refused_after_takeover(cat: Catalog) -> None:
    first = cat.lease_acquire("session/x", "hostA:1:a", 10 * S, 0, never_dead)
    cat.put_session("x", "hostA", '{"state": "running"}', fence="session/x",
                    epoch=first.epoch)
    second = cat.lease_acquire("session/x", "hostB:1:b", 10 * S, 20 * S, never_dead)
    cat.put_session("x", "hostB", '{"state": "running", "moved": true}', fence="session/x",
                    epoch=second.epoch)
    # The stale holder's late write (say its shutdown's "stopped") is refused, typed, and
    # changes nothing.
    with pytest.raises(FencedError) as ei:
        cat.put_session("x", "hostA", '{"state": "stopped"}', fence="session/x",
                        epoch=first.epoch)
    assert ei.value.epoch == first.epoch and ei.value.current == second.epoch
    assert cat.session("x") == ("hostB", '{"state": "running", "moved": true}')


def test_lease_rules(cat: Catalog) -> None:
    a = cat.lease_acquire("root/r", "h1:1:a", 10 * S, 0, never_dead)
    assert a == Lease("root/r", "h1:1:a", 1, 10 * S)
    again = cat.lease_acquire("root/r", "h1:1:a", 10 * S, 5 * S, never_dead)
    assert again.epoch == 1 and again.expires_ns == 15 * S
    with pytest.raises(LeaseBusyError) as ei:
        cat.lease_acquire("root/r", "h2:1:b", 10 * S, 6 * S, never_dead)
    assert ei.value.holder == "h1:1:a" and ei.value.epoch == 1
    assert cat.lease_renew(again, 10 * S, 7 * S).expires_ns == 17 * S
    # Expired: taken over; the old holder can no longer renew.
    b = cat.lease_acquire("root/r", "h2:1:b", 10 * S, 18 * S, never_dead)
    assert b.epoch == 2
    with pytest.raises(LeaseLostError):
        cat.lease_renew(again, 10 * S, 19 * S)
    cat.lease_release(again)  # not the holder any more: a no-op
    assert cat.lease("root/r") == ("h2:1:b", 2, 28 * S)
    cat.lease_release(b)
    c = cat.lease_acquire("root/r", "h1:2:c", 10 * S, 19 * S, never_dead)
    assert c.epoch == 3
    # A provably dead holder is taken over at once, before it expires.
    d = cat.lease_acquire("root/r", "h3:1:d", 10 * S, 20 * S, lambda h: h == "h1:2:c")
    assert d.epoch == 4


def test_config(cat: Catalog) -> None:
    assert cat.config_value("unverified_rebuild") is None
    cat.set_config("unverified_rebuild", "1")
    assert cat.config_value("unverified_rebuild") == "1"
    cat.set_config("unverified_rebuild", None)
    assert cat.config_value("unverified_rebuild") is None


def test_reopened_catalog_keeps_everything(spec: str) -> None:
    c = open_catalog(spec)
    c.add_objects([_loc(1)], [("packs/a.pack", 10, 1)])
    c.put_snapshot(("r1", 1, "snapshot", None, "k"))
    c.lease_acquire("l", "h:1:x", 10 * S, 0, never_dead)
    c.close()
    c = open_catalog(spec)
    try:
        assert c.locate(_loc(1).oid) == _loc(1)
        assert [r[0] for r in c.snapshots()] == ["r1"]
        assert c.lease("l") == ("h:1:x", 1, 10 * S)
    finally:
        c.close()


def _race(spec: str, holder: str, barrier: object, out: object) -> None:
    cat = open_catalog(spec)
    won = []
    for i in range(20):
        barrier.wait()  # type: ignore[attr-defined]
        try:
            lease = cat.lease_acquire(f"session/race-{i}", holder, 60 * S, 0, never_dead)
        except LeaseBusyError:
            continue
        won.append((i, lease.epoch))
    cat.close()
    out.put((holder, won))  # type: ignore[attr-defined]


def test_two_hosts_racing_for_one_lease_give_one_winner(spec: str) -> None:
    open_catalog(spec).close()  # schema in place before the race
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(spec, h, barrier, out))
             for h in ("hostA:1:a", "hostB:1:b")]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    a = {i for i, _ in results["hostA:1:a"]}
    b = {i for i, _ in results["hostB:1:b"]}
    assert a | b == set(range(20)) and not a & b
    assert all(epoch == 1 for won in results.values() for _, epoch in won)
    # The loser of each race is fenced: its append stamped with a guessed epoch is refused.
    cat = open_catalog(spec)
    try:
        for i in range(20):
            winner = "hostA:1:a" if i in a else "hostB:1:b"
            assert cat.lease(f"session/race-{i}")[0] == winner  # type: ignore[index]
    finally:
        cat.close()


# -- PostgreSQL only ---------------------------------------------------------------------


def test_pg_schema_is_versioned_and_newer_is_refused(pg_dsn: str) -> None:
    import psycopg

    from store.pgcatalog import SCHEMA_VERSION, PostgresCatalog

    c = PostgresCatalog(pg_dsn)
    assert c.schema_version() == SCHEMA_VERSION
    c.close()
    PostgresCatalog(pg_dsn).close()  # a second open migrates nothing and keeps the version
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("UPDATE catalog_meta SET value=%s WHERE key='schema_version'",
                     (str(SCHEMA_VERSION + 1),))
    with pytest.raises(CatalogError, match="schema version"):
        PostgresCatalog(pg_dsn)


def test_pg_unreachable_is_catalog_error_without_password() -> None:
    import servers

    from store.pgcatalog import PostgresCatalog

    dsn = f"postgresql://u:sekret-pw@127.0.0.1:{servers.free_port()}/x"
    with pytest.raises(CatalogError) as ei:
        PostgresCatalog(dsn, timeout_s=1)
    assert "sekret-pw" not in str(ei.value)


def test_pg_restart_reconnects(own_postgres: object) -> None:
    from store.pgcatalog import PostgresCatalog

    dsn = own_postgres.new_database()  # type: ignore[attr-defined]
    c = PostgresCatalog(dsn, timeout_s=2)
    try:
        c.put_snapshot(("r1", 1, "snapshot", None, "k1"))
        own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
        with pytest.raises(CatalogError):
            c.snapshots()
        own_postgres.start()  # type: ignore[attr-defined]
        c.put_snapshot(("r2", 2, "snapshot", None, "k2"))
        assert [r[0] for r in c.snapshots()] == ["r1", "r2"]
    finally:
        c.close()


def test_pg_gone_is_catalog_error_at_once_whatever_the_pool_timeout(
        own_postgres: object) -> None:
    """The first operation after the server went away is a CatalogError naming the
    connection's failure, not a wait for the pool's timeout (here an hour: it waited all of
    it, 10 s with the default, before `status` of a session could say the catalog is
    unreachable); the next ones too, and the first after its return reconnects."""
    from store.pgcatalog import PostgresCatalog

    dsn = own_postgres.new_database()  # type: ignore[attr-defined]
    c = PostgresCatalog(dsn, timeout_s=3600)
    try:
        c.put_snapshot(("r1", 1, "snapshot", None, "k1"))
        assert [r[0] for r in c.snapshots()] == ["r1"]  # a pooled connection, idle now
        own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
        for _ in range(2):
            with pytest.raises(CatalogError, match="cannot reach the catalog at "):
                c.snapshots()
        own_postgres.start()  # type: ignore[attr-defined]
        c.put_snapshot(("r2", 2, "snapshot", None, "k2"))
        assert [r[0] for r in c.snapshots()] == ["r1", "r2"]
    finally:
        c.close()


def test_pg_state_dirs_are_per_host(pg_dsn: str) -> None:
    from store.pgcatalog import PostgresCatalog

    c = PostgresCatalog(pg_dsn)
    try:
        c.add_state_dir("/s/1", "hostA")
        c.add_state_dir("/s/1", "hostB")
        c.remove_state_dir("/s/1", "hostA")
        assert c.state_dirs("hostA") == []
        assert c.state_dirs() == [("/s/1", "hostB")]
    finally:
        c.close()


def test_sqlite_catalog_is_the_store_index(tmp_path: Path) -> None:
    from store.objects import Store

    st = Store(tmp_path / "st")
    assert isinstance(st.catalog, SQLiteCatalog)
    st.catalog.set_named_ref("n", "r")
    assert st.conn.execute("SELECT ref FROM named_refs WHERE name='n'").fetchone() == ("r",)
    assert os.path.exists(st.index_path)


def _host_store(spec: str, tmp_path: Path, name: str) -> object:
    """A store on catalog ``spec``: for SQLite the embedded store, for PostgreSQL host
    ``name``'s store of a shared catalog, its packs in a directory every host shares."""
    from store.backend import LocalDirBackend
    from store.objects import Store

    if not spec.startswith("postgresql://"):
        return Store(tmp_path / "store")
    return Store(tmp_path / name, backend=LocalDirBackend(tmp_path / "blobs"),
                 catalog=open_catalog(spec))


def _rows_of_deleted_packs(st: object) -> dict[str, int]:
    """This host's index rows that name a pack the catalog no longer has, by table."""
    packs = {k for k, _, _ in st.catalog.packs()}  # type: ignore[attr-defined]
    out = {}
    for table in ("located", "objects"):
        rows = st.conn.execute(f"SELECT pack FROM {table}").fetchall()  # type: ignore[attr-defined]
        out[table] = sum(1 for (p,) in rows if p not in packs)
    return out


def test_gc_leaves_no_location_of_a_deleted_pack(spec: str, tmp_path: Path) -> None:
    """GC deletes the packs only a forgotten snapshot reached: no index row of the host
    that ran it names one of them afterwards (a shared store's hosts keep a copy of the
    catalog's object rows, ``located``, which GC left behind, so it grew with every pack
    ever read), and another host prunes its copy when its next writer sees that a GC ran.
    What stays live reads as before."""
    from store.browse import cat
    from store.gc import gc
    from store.snapshot import run_snapshot

    shared = spec.startswith("postgresql://")
    a = _host_store(spec, tmp_path, "host-a")
    b = _host_store(spec, tmp_path, "host-b") if shared else None
    refs = []
    for name in ("gone", "kept"):
        src = tmp_path / name
        (src / "sub").mkdir(parents=True)
        (src / "sub" / f"{name}.bin").write_bytes(os.urandom(200 << 10))
        refs.append(run_snapshot(a, src).ref)  # type: ignore[arg-type]
    gone, kept = refs
    for st in (a, b) if b is not None else (a,):
        for ref, name in ((gone, "gone"), (kept, "kept")):
            assert b"".join(cat(st, ref, f"sub/{name}.bin"))  # type: ignore[arg-type]
            st.locate_tree(ref.tree_id)  # type: ignore[attr-defined]
    located = a.conn.execute("SELECT count(*) FROM located").fetchone()[0]  # type: ignore[attr-defined]
    assert (located > 0) == shared
    assert a.forget(gone)  # type: ignore[attr-defined]
    report = gc(a, grace_s=0.0)  # type: ignore[arg-type]
    assert report.packs_deleted >= 1
    assert _rows_of_deleted_packs(a) == {"located": 0, "objects": 0}
    if b is not None:
        assert report.located_pruned > 0
        assert _rows_of_deleted_packs(b)["located"] > 0  # until its next writer
        src = tmp_path / "b-src"
        src.mkdir()
        (src / "x").write_text("b writes\n")
        run_snapshot(b, src)  # type: ignore[arg-type]
        assert _rows_of_deleted_packs(b) == {"located": 0, "objects": 0}
        assert b.conn.execute("SELECT count(*) FROM located_trees").fetchone()[0] == 0  # type: ignore[attr-defined]
    for st in (a, b) if b is not None else (a,):
        assert b"".join(cat(st, kept, "sub/kept.bin")) == \
            (tmp_path / "kept" / "sub" / "kept.bin").read_bytes()  # type: ignore[arg-type]
        st.locate_tree(kept.tree_id)  # type: ignore[attr-defined]
        st.close()  # type: ignore[attr-defined]
        if shared:
            st.catalog.close()  # type: ignore[attr-defined]


def test_gc_leaves_no_page_count_of_a_deleted_chunk(spec: str, tmp_path: Path) -> None:
    """GC deletes the chunks only a forgotten snapshot reached: the host that ran it keeps
    no data page count (``chunk_pages``, what st_blocks counts) of any chunk no longer
    indexed (a shared store's GC left them, so they grew with every chunk ever written),
    and keeps those of what stays live."""
    from store.gc import gc
    from store.snapshot import run_snapshot

    shared = spec.startswith("postgresql://")
    a = _host_store(spec, tmp_path, "host-a")
    refs = []
    for name in ("gone", "kept"):
        src = tmp_path / name
        src.mkdir()
        (src / f"{name}.bin").write_bytes(os.urandom(300 << 10) + bytes(64 << 10))
        refs.append(run_snapshot(a, src).ref)  # type: ignore[arg-type]
    gone = refs[0]

    def paged() -> set[bytes]:
        return {bytes(r[0]) for r in a.conn.execute("SELECT id FROM chunk_pages")}  # type: ignore[attr-defined]

    before = paged()
    assert before and all(a.has(ObjectId(i)) for i in before)  # type: ignore[attr-defined]
    assert a.forget(gone)  # type: ignore[attr-defined]
    report = gc(a, grace_s=0.0)  # type: ignore[arg-type]
    assert report.objects_deleted >= 1
    after = paged()
    assert after and after < before and all(a.has(ObjectId(i)) for i in after)  # type: ignore[attr-defined]
    assert not [i for i in before - after if a.has(ObjectId(i))]  # type: ignore[attr-defined]
    assert report.chunk_pages_pruned == len(before - after)
    assert gc(a, grace_s=0.0).chunk_pages_pruned == 0  # type: ignore[arg-type]
    a.close()  # type: ignore[attr-defined]
    if shared:
        a.catalog.close()  # type: ignore[attr-defined]
