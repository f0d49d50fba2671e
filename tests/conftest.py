"""Shared pytest fixtures.

FUSE fixtures (see tests/fusehelpers.py): every mount is served by a separate
``rewindfs mount --foreground`` process and is always unmounted (lazily when busy) and its
daemon reaped at teardown, even when the test failed; a session-level safety net unmounts
anything still mounted under the test directories at the end.

Every test process gets a private runtime directory: ``XDG_RUNTIME_DIR`` is set at import to
a fresh 0700 directory (inherited by every daemon and CLI the tests start) and removed at
the end, so the suite never reads or writes the machine's shared ``$XDG_RUNTIME_DIR`` or
``/tmp/rewindfs-<uid>``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before anything reads it (fusehelpers, the product's modules, subprocesses started later).
PRIVATE_RUNTIME_DIR = tempfile.mkdtemp(prefix="rewindfs-xdg-")
os.environ["XDG_RUNTIME_DIR"] = PRIVATE_RUNTIME_DIR

sys.path.insert(0, os.path.dirname(__file__))

import fusehelpers as fh  # noqa: E402

# Directories outside pytest's 0700 base that tests create for other uids to traverse.
SHARED_TMP_PREFIX = "/tmp/rewindfs-test-"
MOD_COPIES = 48
SELFTEST = fh.SELFTEST  # see fusehelpers


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


def _test_failed(request: pytest.FixtureRequest) -> bool:
    rep = getattr(request.node, "rep_call", None)
    return rep is None or rep.failed


@pytest.fixture(scope="session", autouse=True)
def _fuse_safety_net(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Kill every daemon and unmount every mount the tests left behind."""
    yield
    killed = fh.kill_all_live()
    base = str(tmp_path_factory.getbasetemp())
    left = fh.unmount_leftovers([base, SHARED_TMP_PREFIX.rstrip("-")])
    if killed or left:
        print(f"\nFUSE safety net: killed {killed}, unmounted {left}", file=sys.stderr)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the private runtime directory (after the safety net stopped every daemon)."""
    shutil.rmtree(PRIVATE_RUNTIME_DIR, ignore_errors=True)


def _require_fuse() -> None:
    if SELFTEST:
        return
    # os.access, not os.path.exists: as a user /dev/fuse (0600 root in containers) may be
    # there and still refuse the mount, which is no failure of the test.
    if not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which(fh.FUSERMOUNT) is None:
        pytest.skip("needs /dev/fuse that this user can open, and fusermount3")


@pytest.fixture
def fuse_store(tmp_path: Path) -> Path:
    """A fresh store directory for FUSE tests (created by the first snapshot)."""
    return tmp_path / "store"


@pytest.fixture
def lower_ref(fuse_store: Path, tmp_path: Path) -> str:
    """Ref of the standard lower tree (``fusehelpers.build_lower``) in ``fuse_store``."""
    src = tmp_path / "lower-src"
    fh.build_lower(src)
    return fh.snapshot(fuse_store, src)


@pytest.fixture
def mounter(fuse_store: Path, tmp_path: Path, request: pytest.FixtureRequest
            ) -> Iterator[fh.Mounter]:
    """Starts mounts for one test; unmounts and reaps them all at teardown."""
    _require_fuse()
    m = (fh.SelftestMounter if SELFTEST else fh.Mounter)(tmp_path / "mounts", fuse_store)
    m.base.mkdir()
    yield m
    m.teardown(_test_failed(request))


@pytest.fixture(scope="module")
def mod_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("modstore") / "store"


@pytest.fixture(scope="module")
def mod_lower_ref(mod_store: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A lower holding ``MOD_COPIES`` copies ``t00``, ``t01``, ... of the standard tree, so
    that each test of a module gets untouched lower files on one shared mount."""
    src = tmp_path_factory.mktemp("lower-src")
    for i in range(MOD_COPIES):
        fh.build_lower(src / f"t{i:02d}")
    return fh.snapshot(mod_store, src)


@pytest.fixture(scope="module")
def mod_mounter(mod_store: Path, tmp_path_factory: pytest.TempPathFactory,
                request: pytest.FixtureRequest) -> Iterator[fh.Mounter]:
    """Like ``mounter``, shared by the tests of one module."""
    _require_fuse()
    m = (fh.SelftestMounter if SELFTEST else fh.Mounter)(tmp_path_factory.mktemp("modmounts"),
                                                         mod_store)
    failed_before = request.session.testsfailed
    yield m
    m.teardown(request.session.testsfailed > failed_before)


@pytest.fixture(scope="module")
def mod_rw(mod_mounter: fh.Mounter, mod_lower_ref: str) -> fh.Daemon:
    """One read-write mount of ``mod_lower_ref`` shared by a module's tests."""
    return mod_mounter.rw(mod_lower_ref)


@pytest.fixture
def lower(mod_rw: fh.Daemon) -> Path:
    """An untouched copy of the standard lower tree inside the shared read-write mount."""
    n = getattr(mod_rw, "_next_copy", 0)
    if n >= MOD_COPIES:
        pytest.fail(f"more than {MOD_COPIES} tests use the shared lower; raise MOD_COPIES")
    mod_rw._next_copy = n + 1  # type: ignore[attr-defined]
    return mod_rw.mnt / f"t{n:02d}"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[object]:
    """A fresh store (default chunk size) in ``tmp_path/"store"``."""
    from store.objects import Store

    s = Store(tmp_path / "store")
    yield s
    s.close()


# -- real servers for shared mode (tests/servers.py) ------------------------------------


@pytest.fixture(scope="session")
def seaweed() -> Iterator[object]:
    """One SeaweedFS S3 server on loopback for the whole test process; stopped at the end."""
    import servers

    srv = servers.SeaweedS3()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[object]:
    """One throwaway PostgreSQL cluster for the whole test process; stopped at the end."""
    import servers

    srv = servers.PostgresCluster()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def s3_env(seaweed: object, monkeypatch: pytest.MonkeyPatch) -> object:
    """The shared SeaweedFS, with its keys in the standard AWS environment variables."""
    for k, v in seaweed.env().items():  # type: ignore[attr-defined]
        monkeypatch.setenv(k, v)
    return seaweed


@pytest.fixture
def s3_bucket(s3_env: object) -> str:
    """A fresh, empty bucket on the shared SeaweedFS."""
    return s3_env.new_bucket()  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def pg_dsn(postgres: object) -> str:
    """The URL of a fresh, empty database on the shared PostgreSQL cluster."""
    return postgres.new_database()  # type: ignore[attr-defined,no-any-return]


@pytest.fixture
def own_seaweed(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """A SeaweedFS of this test alone (fault tests stop and restart it)."""
    import servers

    srv = servers.SeaweedS3()
    for k, v in srv.env().items():
        monkeypatch.setenv(k, v)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def own_postgres() -> Iterator[object]:
    """A PostgreSQL cluster of this test alone (fault tests restart it)."""
    import servers

    srv = servers.PostgresCluster()
    try:
        yield srv
    finally:
        srv.stop()
