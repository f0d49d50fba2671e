"""A shared catalog is bound to the store it indexes: the first store that opens it is
recorded (``catalog_meta`` ``store``, bucket and prefix in one spelling) and any other
store is refused with exit 2 naming both, before a snapshot could dedup against packs it
does not hold or a rebuild-index replace the catalog's rows with its own. A catalog of an
earlier version, which records none, adopts the first store that holds its packs.

Real SeaweedFS (two buckets) and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
from test_shared_store import REPO, Host, _cli, _configure_host


def _catalog_store(dsn: str) -> str | None:
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT value FROM catalog_meta WHERE key='store'").fetchone()
    return None if row is None else str(row[0])


def _project(tmp: Path) -> Path:
    src = tmp / "proj"
    src.mkdir()
    (src / "a.txt").write_text("the team's file\n" * 200)
    return src


def test_another_store_is_refused_by_the_catalog_of_a_store(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    url = f"s3://{s3_bucket}/team"
    a = Host("hostA", tmp_path, url, ep, pg_dsn)
    a.run("snapshot", str(_project(tmp_path)), "--label", "team")
    assert _catalog_store(pg_dsn) == url
    listed = a.run("list").stdout
    other = s3_env.new_bucket()  # type: ignore[attr-defined]
    for store in (f"s3://{other}/x", f"s3://{s3_bucket}", f"s3://{s3_bucket}/team/sub"):
        g = Host("hostG", tmp_path / store.replace("/", "_"), store, ep, pg_dsn)
        for cmd in (["list"], ["snapshot", str(tmp_path / "proj")], ["rebuild-index"]):
            r = g.run(*cmd, check=False)
            assert r.returncode == 2, (store, cmd, r.returncode, r.stderr)
            assert url in r.stderr and store in r.stderr, r.stderr
            assert r.stderr.count("\n") == 1, r.stderr
            assert not (g.local / "store.json").exists()  # nothing bound to the wrong pair
    # A directory bound to the wrong pair before (an earlier version) is refused at open.
    g_local = tmp_path / "g-bound"
    _configure_host(g_local, s3_env, f"s3://{other}/x", pg_dsn, tmp_path / "g-cache")
    for cmd in (["list"], ["snapshot", str(tmp_path / "proj")], ["rebuild-index"]):
        r = _cli(["--store", str(g_local), "--host-id", "hostG", *cmd], check=False)
        assert r.returncode == 2 and url in r.stderr and f"s3://{other}/x" in r.stderr, r.stderr
    assert _cli(["--store", f"s3://{other}/x", "--s3-endpoint", ep, "--catalog", pg_dsn,
                 "--local", str(tmp_path / "g2"), "list"], check=False).returncode == 2
    # Nothing of the team's changed; the same store spelt with a trailing slash is the
    # same store, also for the --local bound to it.
    assert a.run("list").stdout == listed
    a.opts[a.opts.index("--store") + 1] = f"{url}/"
    assert a.run("list").stdout == listed
    a.run("verify")
    assert _catalog_store(pg_dsn) == url


def test_every_spelling_of_a_store_opens_it_from_a_fresh_local_directory(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    """``s3://B/P/`` and ``s3://B//P`` are the store ``s3://B/P``: the first host records
    that spelling, and each later host's first command (a fresh --local, which probes the
    catalog before binding the directory) opens it under any of them."""
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    url = f"s3://{s3_bucket}/x"
    h1 = Host("h1", tmp_path, f"{url}/", ep, pg_dsn)
    h1.run("snapshot", str(_project(tmp_path)), "--label", "team")
    assert _catalog_store(pg_dsn) == url
    listed = h1.run("list").stdout
    for i, spelling in enumerate((f"{url}/", f"s3://{s3_bucket}//x", f"s3://{s3_bucket}//x//")):
        h = Host(f"h{i + 2}", tmp_path, spelling, ep, pg_dsn)
        r = h.run("list", check=False)
        assert r.returncode == 0, (spelling, r.stderr)
        assert r.stdout == listed, spelling
        assert json.loads((h.local / "store.json").read_text())["blobs"] == url
    assert _catalog_store(pg_dsn) == url


def test_a_catalog_of_an_earlier_version_adopts_the_store_holding_its_packs(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    url = f"s3://{s3_bucket}/team"
    a = Host("hostA", tmp_path, url, ep, pg_dsn)
    a.run("snapshot", str(_project(tmp_path)))
    listed = a.run("list").stdout
    with psycopg.connect(pg_dsn, autocommit=True) as c:  # as version 3 left it
        c.execute("DELETE FROM catalog_meta WHERE key='store'")
        c.execute("UPDATE catalog_meta SET value='3' WHERE key='schema_version'")
    other = s3_env.new_bucket()  # type: ignore[attr-defined]
    g = Host("hostG", tmp_path / "g", f"s3://{other}/x", ep, pg_dsn)
    r = g.run("list", check=False)
    assert r.returncode == 2 and "does not hold" in r.stderr, r.stderr
    g_local = tmp_path / "g-bound"
    _configure_host(g_local, s3_env, f"s3://{other}/x", pg_dsn, tmp_path / "g-cache")
    r = _cli(["--store", str(g_local), "list"], check=False)
    assert r.returncode == 2 and "does not hold" in r.stderr, r.stderr
    assert _catalog_store(pg_dsn) is None
    assert a.run("list").stdout == listed  # the store holding its packs: adopted
    assert _catalog_store(pg_dsn) == url
    r = g.run("list", check=False)
    assert r.returncode == 2 and url in r.stderr, r.stderr
    # An empty catalog of an earlier version adopts the first store.
    empty = s3_env.new_bucket()  # type: ignore[attr-defined]
    e = Host("hostE", tmp_path / "e", f"s3://{empty}/p", ep, pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("DELETE FROM catalog_meta WHERE key='store'")
        c.execute("TRUNCATE packs, objects")
    e.run("list")
    assert _catalog_store(pg_dsn) == f"s3://{empty}/p"


def test_rebuild_index_from_a_listing_lacking_the_catalogs_history_is_refused(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    """The bucket's history records of one snapshot gone (a partial listing), then the
    whole prefix emptied: rebuild-index exits 8 naming what it would drop and changes
    nothing; --force rebuilds from what the store holds."""
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    a = Host("hostA", tmp_path, f"s3://{s3_bucket}/team", ep, pg_dsn)
    src = _project(tmp_path)
    first = json.loads(a.run("snapshot", str(src), "--json").stdout)["ref"]
    (src / "b.txt").write_text("more\n")
    second = json.loads(a.run("snapshot", str(src), "--json").stdout)["ref"]
    listed = a.run("list").stdout
    s3 = s3_env.client()  # type: ignore[attr-defined]

    def keys(prefix: str) -> list[str]:
        got = s3.list_objects_v2(Bucket=s3_bucket, Prefix=f"team/{prefix}")
        return [o["Key"] for o in got.get("Contents", [])]

    for key in keys("snapshots/"):
        if json.loads(s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read())["ref"] == first:
            s3.delete_object(Bucket=s3_bucket, Key=key)
    r = a.run("rebuild-index", check=False)
    assert r.returncode == 8, (r.returncode, r.stderr)
    assert r.stderr.startswith("rewindfs: rebuild-index refused: ") and first in r.stderr
    assert "lacks 1 listed snapshot that" in r.stderr and "--force" in r.stderr, r.stderr
    assert a.run("list").stdout == listed
    for key in keys(""):
        s3.delete_object(Bucket=s3_bucket, Key=key)
    doc = json.loads(a.run("rebuild-index", "--json", check=False).stdout)
    assert doc["exit_code"] == 8 and doc["snapshots"] == 2, doc
    assert a.run("list").stdout == listed
    rebuilt = json.loads(a.run("rebuild-index", "--force", "--json").stdout)
    assert rebuilt["snapshots"] == 0 and rebuilt["packs"] == 0, rebuilt
    assert second not in a.run("list").stdout


def test_rebuild_index_from_a_listing_lacking_an_indexed_pack_is_refused(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    """A pack object of the bucket deleted (every snapshot record kept): rebuild-index
    exits 8 naming the pack and changes nothing (verify still finds what it found before);
    --force rebuilds from what the bucket holds."""
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    a = Host("hostA", tmp_path, f"s3://{s3_bucket}/team", ep, pg_dsn)
    src = _project(tmp_path)
    a.run("snapshot", str(src))
    (src / "b.txt").write_text("more of the team's work\n" * 100)
    a.run("snapshot", str(src))
    s3 = s3_env.client()  # type: ignore[attr-defined]
    got = s3.list_objects_v2(Bucket=s3_bucket, Prefix="team/packs/")
    packs = sorted(o["Key"] for o in got.get("Contents", []))
    assert len(packs) == 2, packs
    s3.delete_object(Bucket=s3_bucket, Key=packs[-1])
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        rows = c.execute("SELECT key, size, objects FROM packs ORDER BY key").fetchall()
        objects = c.execute("SELECT count(*) FROM objects").fetchone()
    lost = packs[-1].removeprefix("team/")
    r = a.run("rebuild-index", check=False)
    assert r.returncode == 8, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.startswith("rewindfs: rebuild-index refused: ") and lost in r.stderr
    assert "lacks 1 pack that the catalog indexes" in r.stderr and "--force" in r.stderr
    doc = json.loads(a.run("rebuild-index", "--json", check=False).stdout)
    assert doc["exit_code"] == 8 and doc["packs"] == 1, doc
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        assert c.execute("SELECT key, size, objects FROM packs ORDER BY key"
                         ).fetchall() == rows
        assert c.execute("SELECT count(*) FROM objects").fetchone() == objects
    rebuilt = json.loads(a.run("rebuild-index", "--force", "--json").stdout)
    assert rebuilt["packs"] == 1 and rebuilt["snapshots"] == 2, rebuilt


def test_a_local_directory_runs_as_the_host_id_first_given_with_it(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    """hostA's --local given --host-id hostD (or REWINDFS_HOST_ID) is refused with exit 2
    naming both; given no host id it runs as hostA (its sessions are its own, not another
    host's), not as the id derived from the machine."""
    ep = s3_env.endpoint  # type: ignore[attr-defined]
    a = Host("hostA", tmp_path, f"s3://{s3_bucket}/team", ep, pg_dsn)
    a.run("list")
    assert (a.local / "host_id").read_text() == "hostA\n"
    record = json.dumps({"state": "stopped", "head": None, "dirty": False, "mode": None,
                         "parent": None, "created_ns": 1, "spec": {}})
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("INSERT INTO sessions(id, host, record) VALUES ('s-of-a', 'hostA', %s)",
                  (record,))
    d = Host("hostD", tmp_path, f"s3://{s3_bucket}/team", ep, pg_dsn)
    d.local = a.local
    d.opts[d.opts.index("--local") + 1] = str(a.local)
    r = d.run("session", "list", check=False)
    assert r.returncode == 2 and "hostA" in r.stderr and "hostD" in r.stderr, r.stderr
    r = _cli(["--store", str(a.local), "session", "list"], env={"REWINDFS_HOST_ID": "hostD"},
             check=False)
    assert r.returncode == 2 and "hostA" in r.stderr and "hostD" in r.stderr, r.stderr
    r = _cli(["--store", str(a.local), "--host-id", "hostD", "session", "rm", "s-of-a"],
             check=False)
    assert r.returncode == 2, r.stderr
    env = {k: v for k, v in os.environ.items() if k != "REWINDFS_HOST_ID"}
    out = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(a.local),
                          "session", "list"], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "s-of-a" not in out.stdout, out.stdout  # hostA's own row, not another host's
    b = Host("hostB", tmp_path, f"s3://{s3_bucket}/team", ep, pg_dsn)
    assert "s-of-a  stopped" in b.run("session", "list").stdout  # on hostA, for hostB
