"""Secrets of a shared store's servers are never written or printed: a catalog URL or an
S3 endpoint holding a password is refused with exit 2 before anything is stored (the
message says how to give it instead), and the server errors that quote a URL mask its
password (``store.errors.redact``) but keep the rest of it.

Real SeaweedFS and PostgreSQL (trust authentication: ``PGPASSWORD`` is accepted and not
needed; a cluster of its own asking a role for a SCRAM password, for a refused login); a
port nothing listens on for the servers that do not answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_shared_store import _cli

SECRET = "Sekr3t-pw-42"


def _with_password(dsn: str) -> str:
    """``dsn`` (``postgresql://USER@HOST/DB``) with ``SECRET`` as USER's password."""
    scheme, rest = dsn.split("://", 1)
    user, _, host = rest.rpartition("@")
    return f"{scheme}://{user or 'postgres'}:{SECRET}@{host}"


def _no_secret(*texts: str) -> None:
    for t in texts:
        assert SECRET not in t, t


def test_a_catalog_password_is_refused_and_store_json_never_holds_one(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    local = tmp_path / "l"
    opts = ["--store", f"s3://{s3_bucket}/x", "--s3-endpoint",
            s3_env.endpoint, "--local", str(local)]  # type: ignore[attr-defined]
    base, _, db = pg_dsn.rpartition("/")
    query_form = f"{base}/{db}?password={SECRET}&user=postgres"
    for dsn in (_with_password(pg_dsn), query_form):
        r = _cli([*opts, "--catalog", dsn, "list"], check=False)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert r.stderr.count("\n") == 1 and "PGPASSWORD" in r.stderr, r.stderr
        _no_secret(r.stdout, r.stderr)
        assert not (local / "store.json").exists()
    r = _cli([*opts, "--catalog", query_form, "list"], check=False)
    assert "password=***&user=postgres" in r.stderr, r.stderr  # only the value is masked
    # The libpq way: the URL without the password, the password in the environment.
    _cli([*opts, "--catalog", pg_dsn, "list"], env={"PGPASSWORD": SECRET})
    text = (local / "store.json").read_text()
    _no_secret(text)
    assert json.loads(text)["catalog"] == pg_dsn
    # A bound directory given the password again: still refused, the file unchanged.
    r = _cli([*opts, "--catalog", _with_password(pg_dsn), "list"], check=False)
    assert r.returncode == 2, r.stderr
    _no_secret(r.stdout, r.stderr, (local / "store.json").read_text())
    _cli(["--store", str(local), "list"], env={"PGPASSWORD": SECRET})


def test_an_s3_endpoint_with_credentials_is_refused(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    ep = s3_env.endpoint.replace("://", f"://AKIAEXAMPLE:{SECRET}@")  # type: ignore[attr-defined]
    r = _cli(["--store", f"s3://{s3_bucket}/x", "--s3-endpoint", ep, "--catalog", pg_dsn,
              "--local", str(tmp_path / "l"), "list"], check=False)
    assert r.returncode == 2 and "AWS_ACCESS_KEY_ID" in r.stderr, r.stderr
    _no_secret(r.stdout, r.stderr)
    assert not (tmp_path / "l" / "store.json").exists()


def test_server_errors_mask_passwords_and_keep_the_rest(s3_env: object) -> None:
    import servers

    from store.errors import BackendError, CatalogError
    from store.pgcatalog import PostgresCatalog
    from store.s3 import S3Backend

    port = servers.free_port()
    ep = f"http://AKIAEXAMPLE:{SECRET}@127.0.0.1:{port}"
    s3 = S3Backend("bucket", "p", endpoint_url=ep, max_attempts=1, connect_timeout=1)
    with pytest.raises(BackendError) as bi:
        s3.check()
    _no_secret(str(bi.value), repr(s3))
    assert "EndpointConnectionError" in str(bi.value) and f"127.0.0.1:{port}" in str(bi.value)
    dsn = f"postgresql://127.0.0.1:{port}/x?password={SECRET}&user=postgres"
    with pytest.raises(CatalogError) as ci:
        PostgresCatalog(dsn, timeout_s=1)
    _no_secret(str(ci.value))
    assert "password=***&user=postgres" in str(ci.value), ci.value


def test_a_store_json_of_an_earlier_version_with_secrets_is_never_echoed(
        s3_env: object, s3_bucket: str, tmp_path: Path) -> None:
    """A ``store.json`` written before the refusal (its catalog URL and S3 endpoint with
    passwords; SeaweedFS answers, the catalog does not): ``doctor`` and a command name
    both servers with the passwords masked."""
    import servers

    port = servers.free_port()
    local = tmp_path / "l"
    local.mkdir(mode=0o700)
    (local / "store.json").write_text(json.dumps({
        "blobs": f"s3://{s3_bucket}/x", "cache": str(tmp_path / "cache"),
        "catalog": f"postgresql://postgres:{SECRET}@127.0.0.1:{port}/db",
        "s3_endpoint": s3_env.endpoint.replace(  # type: ignore[attr-defined]
            "://", f"://AKIAEXAMPLE:{SECRET}@")}))
    r = _cli(["--store", str(local), "doctor", "--json"], check=False)
    _no_secret(r.stdout, r.stderr)
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["shared_blobs"]["status"] == "ok", checks
    assert "AKIAEXAMPLE:***@" in checks["shared_blobs"]["detail"], checks
    assert f"127.0.0.1:{port}" in checks["shared_catalog"]["detail"], checks
    r = _cli(["--store", str(local), "list"], check=False)
    assert r.returncode == 12, r.stderr
    _no_secret(r.stdout, r.stderr)
    assert "postgres:***@" in r.stderr, r.stderr


def test_a_refused_login_is_a_login_refusal_never_unreachable(
        s3_env: object, s3_bucket: str, own_postgres: object, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster whose pg_hba.conf asks TCP logins for a SCRAM password: a wrong
    PGPASSWORD, and none at all, are exit 12 ``CatalogAuthError`` saying the catalog
    refused the login with the server's reason (not that it cannot be reached), the
    password never printed; on a first binding (the probe) and on a bound directory (the
    catalog's first connection) alike. The right password then works."""
    dsn = own_postgres.password_role("alice", SECRET)  # type: ignore[attr-defined]
    monkeypatch.delenv("PGPASSWORD", raising=False)
    nofile = {"PGPASSFILE": str(tmp_path / "no-pgpass")}
    wrong = {**nofile, "PGPASSWORD": SECRET[::-1]}
    local = tmp_path / "l"
    opts = ["--store", f"s3://{s3_bucket}/x", "--s3-endpoint",
            s3_env.endpoint, "--catalog", dsn,  # type: ignore[attr-defined]
            "--local", str(local)]

    def refused(env: dict[str, str], reason: str) -> None:
        r = _cli([*opts, "list"], env, check=False)
        assert r.returncode == 12, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
        assert f"refused the login ({reason})" in r.stderr, r.stderr
        assert "cannot reach" not in r.stderr and "PGPASSWORD" in r.stderr, r.stderr
        _no_secret(r.stdout, r.stderr)
        assert SECRET[::-1] not in r.stderr
        r = _cli([*opts, "list", "--json"], env, check=False)
        doc = json.loads(r.stdout)
        assert (doc["type"], doc["exit_code"], doc["reason"]) == ("CatalogAuthError", 12,
                                                                  reason), doc

    refused(wrong, 'password authentication failed for user "alice"')
    refused(nofile, "it asks for a password and none was given")
    assert not (local / "store.json").exists()
    _cli([*opts, "list"], {**nofile, "PGPASSWORD": SECRET})
    assert (local / "store.json").exists()
    refused(wrong, 'password authentication failed for user "alice"')


def test_a_libpq_keyword_catalog_string_is_refused_without_its_password(
        s3_env: object, s3_bucket: str, pg_dsn: str, tmp_path: Path) -> None:
    # The real catalog's address in libpq's keyword/value form, with a password, plain
    # and quoted: refused (a URL is asked for) and the password never echoed.
    rest = pg_dsn.split("://", 1)[1]
    user, _, hostpart = rest.rpartition("@")
    hostport, _, db = hostpart.partition("/")
    host, _, port = hostport.partition(":")
    keywords = f"host={host} port={port or 5432} dbname={db} user={user or 'postgres'}"
    for dsn in (f"{keywords} password={SECRET}", f"{keywords} password = '{SECRET} x'"):
        r = _cli(["--store", f"s3://{s3_bucket}/x", "--s3-endpoint",
                  s3_env.endpoint, "--local", str(tmp_path / "l"),  # type: ignore[attr-defined]
                  "--catalog", dsn, "list"], check=False)
        assert r.returncode == 2 and "postgresql:// URL" in r.stderr, r.stderr
        assert f"dbname={db}" in r.stderr and "password" in r.stderr, r.stderr
        _no_secret(r.stdout, r.stderr)
        assert not (tmp_path / "l" / "store.json").exists()
