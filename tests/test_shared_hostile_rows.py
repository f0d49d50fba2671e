"""Values in the shared catalog that rewindfs did not write (another program's, a damaged
or hostile row) are typed errors naming the value escaped, never an internal error: a
schema version that is not a number (exit 12, as a newer one), a session registry row
whose id cannot be a session id (exit 2: the id given to a session command is refused as
one, before any registry is read).

Real SeaweedFS and PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
from test_shared_store import Host


def _host(s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> Host:
    a = Host("hostA", tmp_path, f"s3://{s3_bucket}/team",
             s3_env.endpoint, pg_dsn)  # type: ignore[attr-defined]
    a.run("list")
    return a


def test_a_schema_version_that_is_not_a_number_is_a_catalog_error(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    a = _host(s3_env, s3_bucket, pg_dsn, tmp_path)
    for bad in ("abc", "4\n\x1b[2J", "-1", "x" * 100):
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute("UPDATE catalog_meta SET value=%s WHERE key='schema_version'", (bad,))
        for h in (a, Host("hostB", tmp_path, a.opts[1], a.opts[3], pg_dsn)):
            r = h.run("list", check=False)  # A opens it; B's first binding probes it
            assert r.returncode == 12, (bad, r.returncode, r.stderr)
            assert "internal error" not in r.stderr and repr(bad)[:30] in r.stderr, r.stderr
            assert r.stderr.count("\n") == 1 and "\x1b" not in r.stderr, r.stderr
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("UPDATE catalog_meta SET value='4' WHERE key='schema_version'")
    a.run("list")


def test_a_session_id_that_cannot_be_one_is_refused_before_the_registry(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    a = _host(s3_env, s3_bucket, pg_dsn, tmp_path)
    record = json.dumps({"state": "stopped", "head": None, "dirty": False, "mode": None,
                         "parent": None, "created_ns": 1, "spec": {}})
    for bad, host in (("../../../pwned", "hostX"), ("../../../pwned2", "hostA"),
                      ("x\ny", "hostX"), ("-rf", "hostA")):
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute("INSERT INTO sessions(id, host, record) VALUES (%s, %s, %s)",
                      (bad, host, record))
        for cmd in ("rm", "resume", "shutdown", "checkpoint"):
            r = a.run("session", cmd, "--", bad, check=False)
            assert r.returncode == 2, (bad, cmd, r.returncode, r.stderr)
            assert "internal error" not in r.stderr, r.stderr
            assert f"invalid session id {bad!r}" in r.stderr, r.stderr
            assert "\n" not in bad or bad not in r.stderr, r.stderr  # escaped, one line
    assert not (tmp_path / "pwned").exists()


def test_session_list_prints_registry_values_escaped(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    a = _host(s3_env, s3_bucket, pg_dsn, tmp_path)
    record = json.dumps({"state": "stopped\nforged  running", "head": None, "dirty": False,
                         "mode": "per-session", "parent": None, "created_ns": 1, "spec": {}})
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("INSERT INTO sessions(id, host, record) VALUES "
                  "('x\nfake-session  running per-session /tmp/x', 'hostX', %s), "
                  "('s-ok', 'host\x1b[2JY', %s)", (record, record))
    lines = a.run("session", "list").stdout.splitlines()
    assert len(lines) == 2, lines
    [forged] = [line for line in lines if line.endswith("on hostX")]
    assert forged.startswith(repr("x\nfake-session  running per-session /tmp/x")), lines
    assert repr("stopped\nforged  running") in forged, lines
    [ok] = [line for line in lines if line.startswith("s-ok  ")]
    assert ok.endswith(f"on {repr(chr(27).join(['host', '[2JY']))}"), lines
    assert "\x1b" not in "".join(lines)


def test_session_list_shows_an_unreadable_registry_row_and_lists_the_others(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    """A registry row whose record is not readable is one escaped line marked unreadable
    with the reason; every readable row is listed; exit 0."""
    a = _host(s3_env, s3_bucket, pg_dsn, tmp_path)
    record = json.dumps({"state": "stopped", "head": None, "dirty": False,
                         "mode": "per-session", "parent": None, "created_ns": 1, "spec": {}})
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        c.execute("INSERT INTO sessions(id, host, record) VALUES "
                  "('s-ok', 'hostX', %s), ('s-bad\x1b[2J', 'hostX', %s)",
                  (record, "{not json\n"))
    r = a.run("session", "list")
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and "\x1b" not in r.stdout, lines
    assert any(line.startswith("s-ok  stopped") for line in lines), lines
    [bad] = [line for line in lines if " unreadable " in line]
    assert bad.startswith(repr("s-bad\x1b[2J")) and "not readable" in bad, lines
