"""What the CLI answers when a shared store's server fails under a live mount or session
(issue 13): the exit code names the server that failed (11: S3, ``BackendError``; 12:
PostgreSQL, ``CatalogError``) with one clear line, ``session shutdown --checkpoint`` whose
checkpoint fails leaves the session running with every change, and ``status`` of a live
mount answers from its daemon while the catalog is down.

Real FUSE, real SeaweedFS and PostgreSQL of each test alone (``own_seaweed``,
``own_postgres``), stopped and started again by the test.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli, shared_store_on
from session_support import ref_of
from test_shared_sessions import SessionHost, project
from test_shared_store import two_hosts

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


@pytest.fixture
def fuse_store(tmp_path: Path, own_seaweed: object, own_postgres: object) -> Path:
    """This host's local directory of a shared store on servers of this test alone."""
    return shared_store_on(tmp_path, own_seaweed, own_postgres)


@pytest.fixture
def host(own_seaweed: object, own_postgres: object, tmp_path: Path) -> Iterator[SessionHost]:
    """One host of a shared store on servers of this test alone; its sessions are stopped
    at the end."""
    a, _ = two_hosts(own_seaweed, own_seaweed.new_bucket(),  # type: ignore[attr-defined]
                     own_postgres.new_database(), tmp_path, SessionHost)  # type: ignore[attr-defined]
    assert isinstance(a, SessionHost)
    try:
        yield a
    finally:
        a.cleanup()


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def _failed(r: object, code: int, server: str) -> dict[str, object]:
    """The ``--json`` failure of ``r`` (a CompletedProcess): exit ``code``, one line on
    stderr naming ``server`` (``postgresql://`` or ``s3://``) once, no doubled prefix."""
    assert r.returncode == code, (r.returncode, r.stderr)  # type: ignore[attr-defined]
    line = _one_line(r.stderr)  # type: ignore[attr-defined]
    assert server in line, line
    assert "failed: checkpoint" not in line and line.count("checkpoint (") <= 1, line
    doc = json.loads(r.stdout)  # type: ignore[attr-defined]
    assert doc["exit_code"] == code and doc["ok"] is False, doc
    assert isinstance(doc, dict)
    return doc


# -- checkpoint / restore / step exit codes -------------------------------------------------


def test_a_mount_checkpoint_with_the_catalog_down_exits_12(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, own_postgres: object) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "new.txt").write_text("written before the outage\n")
    own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        r = cli(fuse_store, "checkpoint", str(d.mnt), "--json", check=False)
        doc = _failed(r, 12, "postgresql://")
        assert doc["type"] == "CheckpointError" and doc["cause_type"] == "CatalogError", doc
        assert str(doc["error"]).startswith("checkpoint (manual) failed: "), doc
        assert (d.mnt / "new.txt").read_text() == "written before the outage\n"
    finally:
        own_postgres.start()  # type: ignore[attr-defined]
    ref = json.loads(cli(fuse_store, "checkpoint", str(d.mnt), "--json").stdout)["ref"]
    assert ref != lower_ref


def test_a_mount_checkpoint_with_s3_gone_exits_11(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, own_seaweed: object) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "big.bin").write_bytes(os.urandom(2 << 20))
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        r = cli(fuse_store, "checkpoint", str(d.mnt), "--json", check=False)
        doc = _failed(r, 11, "s3://")
        assert doc["type"] == "CheckpointError" and doc["cause_type"] == "BackendError", doc
    finally:
        own_seaweed.start()  # type: ignore[attr-defined]


def test_a_mount_checkpoint_with_s3_hung_exits_11(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, own_seaweed: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOPped SeaweedFS (accepts connections, never answers): the daemon gives up
    after the attempts and timeouts its environment sets."""
    import signal

    for k, v in (("REWINDFS_S3_ATTEMPTS", "2"), ("REWINDFS_S3_READ_TIMEOUT", "0.5"),
                 ("REWINDFS_S3_CONNECT_TIMEOUT", "0.5")):
        monkeypatch.setenv(k, v)  # the daemon's environment
    d = mounter.rw(lower_ref)
    (d.mnt / "big.bin").write_bytes(os.urandom(2 << 20))
    group = own_seaweed.proc.pid  # type: ignore[attr-defined]
    os.killpg(group, signal.SIGSTOP)
    try:
        r = cli(fuse_store, "checkpoint", str(d.mnt), "--json", check=False)
    finally:
        os.killpg(group, signal.SIGCONT)
    doc = _failed(r, 11, "s3://")
    assert doc["cause_type"] == "BackendError", doc
    ref = json.loads(cli(fuse_store, "checkpoint", str(d.mnt), "--json").stdout)["ref"]
    assert ref != lower_ref


def test_session_checkpoint_restore_and_step_name_the_failed_server(
        host: SessionHost, tmp_path: Path, own_postgres: object, own_seaweed: object) -> None:
    s = host.started("new", "--seed", str(project(tmp_path, 1 << 20)))
    sid, root = s["id"], Path(s["root"])
    first = json.loads(host.session("checkpoint", sid, "--json").stdout)["ref"]
    (root / "README").write_text("changed\n")
    own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        for args in (("session", "checkpoint", sid), ("checkpoint", str(root))):
            doc = _failed(host.run(*args, "--json", check=False), 12, "postgresql://")
            assert doc["type"] == "CheckpointError" and doc["cause_type"] == "CatalogError"
            assert str(doc["error"]).count("checkpoint (manual) failed") == 1, doc
        r = host.run("restore", str(root), first, "--json", check=False)
        assert r.returncode == 12, r.stderr
        _one_line(r.stderr)
        r = host.run("session", "step", sid, "--json", check=False)
        assert r.returncode == 12, r.stderr
        _one_line(r.stderr)
        assert (root / "README").read_text() == "changed\n"
    finally:
        own_postgres.start()  # type: ignore[attr-defined]
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        (root / "pkg" / "more.bin").write_bytes(os.urandom(1 << 20))
        for args in (("session", "checkpoint", sid), ("checkpoint", str(root))):
            doc = _failed(host.run(*args, "--json", check=False), 11, "s3://")
            assert doc["type"] == "CheckpointError" and doc["cause_type"] == "BackendError"
    finally:
        own_seaweed.start()  # type: ignore[attr-defined]
    want = ref_of(root)
    assert json.loads(host.session("checkpoint", sid, "--json").stdout)["ref"] == str(want)


def test_snapshot_seed_and_gc_with_s3_gone_exit_11(
        host: SessionHost, tmp_path: Path, own_seaweed: object) -> None:
    """``snapshot DIR``, ``session new --seed DIR`` and ``gc`` with SeaweedFS stopped: exit
    11 with the cause typed BackendError (were 1, 1 and 8: exit 8 is GC's refusals)."""
    src = project(tmp_path, 1 << 20)
    host.run("list")  # binds the local directory while both servers answer
    own_seaweed.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        doc = _failed(host.run("snapshot", str(src), "--json", check=False), 11, "s3://")
        assert doc["type"] == "SnapshotError" and doc["cause_type"] == "BackendError", doc
        r = host.session("new", "--seed", str(src), "--base", str(host.base), "--json",
                         check=False)
        doc = _failed(r, 11, "s3://")
        assert doc["cause_type"] == "BackendError", doc
        doc = _failed(host.run("gc", "--json", check=False), 11, "s3://")
        assert doc["type"] == "GCError" and doc["cause_type"] == "BackendError", doc
    finally:
        own_seaweed.start()  # type: ignore[attr-defined]
    assert json.loads(host.run("snapshot", str(src), "--json").stdout)["ref"]
    host.run("gc")


# -- status of a live mount with the catalog down -------------------------------------------


def test_status_of_a_session_mount_answers_with_the_catalog_down(
        host: SessionHost, tmp_path: Path, own_postgres: object) -> None:
    root = Path(host.started("new", "--seed", str(project(tmp_path, 1 << 20)))["root"])
    (root / "README").write_text("changed\n")
    up = json.loads(host.run("status", str(root), "--json").stdout)
    assert up["catalog"] == "ok", up
    own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        r = host.run("status", str(root), "--json", check=False)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["dirty_inodes"] >= 1 and doc["pid"] == up["pid"], doc
        assert doc["ref"] == up["ref"], doc
        assert str(doc["catalog"]).startswith("unreachable: "), doc
        assert "postgresql://" in str(doc["catalog"]), doc
        text = host.run("status", str(root)).stdout
        assert "catalog:   unreachable: " in text, text
    finally:
        own_postgres.start()  # type: ignore[attr-defined]
    assert json.loads(host.run("status", str(root), "--json").stdout)["catalog"] == "ok"


def test_status_of_a_plain_mount_answers_with_the_catalog_down(
        mounter: fh.Mounter, fuse_store: Path, lower_ref: str, own_postgres: object) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "new.txt").write_text("x\n")
    own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        r = cli(fuse_store, "status", str(d.mnt), "--json", check=False)
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["ref"] == lower_ref and doc["dirty_inodes"] >= 1, doc
        assert str(doc["catalog"]).startswith("unreachable: "), doc
    finally:
        own_postgres.start()  # type: ignore[attr-defined]


def test_status_of_a_session_without_fuse_knows_its_ref_with_the_catalog_down(
        host: SessionHost, tmp_path: Path, own_postgres: object) -> None:
    """A session in a plain directory (no FUSE) whose status was never asked before the
    outage still says which Ref it serves: the one it started from, then after a
    checkpoint or a restore (also never asked about) the new one (it said None: the pointer
    was only read by status)."""
    from fusefs.session.control import control_path, request

    s = host.started("new", "--no-fuse", "--seed", str(project(tmp_path, 1 << 20)))
    sid, root = s["id"], Path(s["root"])
    path = control_path(str(host.local / "sessions" / sid))
    assert path is not None

    def status_while_down() -> dict[str, object]:
        own_postgres.stop(keep_data=True)  # type: ignore[attr-defined]
        try:
            doc = request(path, {"op": "status"}, 60)
            assert str(doc["catalog"]).startswith("unreachable: "), doc
            return doc
        finally:
            own_postgres.start()  # type: ignore[attr-defined]

    first = status_while_down()["ref"]
    assert first is not None and first == str(ref_of(root))
    (root / "README").write_text("changed\n")
    checkpoint = json.loads(host.session("checkpoint", sid, "--json").stdout)["ref"]
    assert checkpoint != first
    assert status_while_down()["ref"] == checkpoint
    restored = json.loads(host.session("restore", sid, str(first), "--json").stdout)["ref"]
    assert status_while_down()["ref"] == restored == first
    assert (root / "README").read_text() != "changed\n"
    up = request(path, {"op": "status"}, 60)  # reconnected
    assert (up["ref"], up["catalog"]) == (first, "ok"), up


# -- shutdown --checkpoint that fails keeps the session running -----------------------------


@pytest.mark.parametrize("server", ["postgres", "seaweed"])
def test_a_failed_shutdown_checkpoint_keeps_the_session_running(
        host: SessionHost, tmp_path: Path, own_postgres: object, own_seaweed: object,
        server: str) -> None:
    srv, code, name = ((own_postgres, 12, "postgresql://") if server == "postgres"
                       else (own_seaweed, 11, "s3://"))
    s = host.started("new", "--seed", str(project(tmp_path, 1 << 20)))
    sid, root = s["id"], Path(s["root"])
    (root / "README").write_text("changed before the outage\n")
    (root / "pkg" / "new.bin").write_bytes(os.urandom(1 << 20))
    pid = host.pid(sid)
    srv.stop(keep_data=True)  # type: ignore[attr-defined]
    try:
        r = host.session("shutdown", sid, "--checkpoint", "--json", check=False)
        doc = _failed(r, code, name)
        assert doc["type"] == "CheckpointError", doc
        # Still running, with every change, and it takes new ones.
        assert host.pid(sid) == pid
        assert (root / "README").read_text() == "changed before the outage\n"
        (root / "during.txt").write_text("written during the outage\n")
    finally:
        srv.start()  # type: ignore[attr-defined]
    listed = json.loads(host.session("list", "--json").stdout)
    assert [(x["id"], x["state"]) for x in listed] == [(sid, "running")]
    want = ref_of(root)
    out = json.loads(host.session("shutdown", sid, "--checkpoint", "--json").stdout)
    assert out["ref"] == str(want)
