"""Workspace configuration (CONTRACT 4.1, 4.3): the placement and policy matrix, case by case.

Each valid combination of placement, trigger and priority is accepted; each invalid input
raises its typed error with its kind, and when several are wrong the first in the reference's
order wins. Canonical roots, overlap by components, fingerprints and lease names are checked
on real directories and symlinks.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from fusefs.session import errors as E
from fusefs.session.config import define
from fusefs.session.placement import (
    Mode,
    canonical_path,
    exclusive_workspace,
    is_within,
    root_lease_name,
    session_workspaces,
    shared_workspace,
)
from fusefs.session.policy import SnapshotPolicy
from store.lease import Leaser
from store.objects import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


@pytest.fixture
def leaser(store: Store) -> Leaser:
    return Leaser(store)


def spec(mode: str, store: Store, leaser: Leaser, path: Path):  # type: ignore[no-untyped-def]
    if mode == "per-session":
        return session_workspaces(store, path)
    if mode == "exclusive":
        return exclusive_workspace(store, path, leaser)
    return shared_workspace(store, path)


MODES = ["per-session", "exclusive", "shared"]
TRIGGERS = [None, "manual", "on_idle", "on_turn_done", "on_step_done"]
PRIORITIES = [None, "best_effort", "required"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("trigger", TRIGGERS)
@pytest.mark.parametrize("priority", PRIORITIES)
def test_matrix(tmp_path: Path, store: Store, leaser: Leaser, mode: str, trigger: str | None,
                priority: str | None) -> None:
    pol = SnapshotPolicy(trigger=trigger, priority=priority)
    sp = spec(mode, store, leaser, tmp_path / "ws")
    if mode == "shared" and priority == "required":
        with pytest.raises(E.SnapshotPolicyError) as ei:
            define(sp, policy=pol)
        assert ei.value.kind == "shared_required"
        return
    cfg = define(sp, policy=pol)
    assert cfg.placement is not None and cfg.policy is not None
    assert cfg.placement.mode is Mode(mode)
    assert cfg.policy.trigger == (trigger or "on_idle")
    assert cfg.policy.priority == (priority or "best_effort")
    assert cfg.policy.timeout_s == 60.0
    assert cfg.placement.fingerprint == f"{mode}:{tmp_path / 'ws'}"
    assert cfg.placement.consistency == ("fuzzy" if mode == "shared" else "quiescent")
    if mode == "exclusive":
        digest = hashlib.sha256(str(tmp_path / "ws").encode()).hexdigest()
        assert cfg.placement.lease_name == f"workspace-roots/{digest}"
    else:
        assert cfg.placement.lease_name is None


def test_no_placement_no_policy_is_an_unconfigured_workspace() -> None:
    cfg = define()
    assert cfg.placement is None and cfg.policy is None and not cfg.configured


# -- placement kinds ----------------------------------------------------------------------


def kind_of(exc_type: type[E.SessionError], fn) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(exc_type) as ei:
        fn()
    return ei.value.kind  # type: ignore[attr-defined]


def test_multiple_placements(tmp_path: Path, store: Store, leaser: Leaser) -> None:
    pol = SnapshotPolicy("manual")
    a = session_workspaces(store, tmp_path / "a")
    b = exclusive_workspace(store, tmp_path / "b", leaser)
    assert kind_of(E.WorkspacePlacementError,
                   lambda: define(a, b, policy=pol)) == "multiple_placements"
    assert kind_of(E.WorkspacePlacementError,
                   lambda: define(a, a, policy=pol)) == "multiple_placements"


@pytest.mark.parametrize("mode", MODES)
def test_nil_store(tmp_path: Path, leaser: Leaser, mode: str) -> None:
    sp = spec(mode, None, leaser, tmp_path / "ws")  # type: ignore[arg-type]
    assert kind_of(E.WorkspacePlacementError,
                   lambda: define(sp, policy=SnapshotPolicy("manual"))) == "nil_store"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", [None, "", "   "])
def test_empty_root(store: Store, leaser: Leaser, mode: str, path: str | None) -> None:
    sp = spec(mode, store, leaser, path)  # type: ignore[arg-type]
    assert kind_of(E.WorkspacePlacementError,
                   lambda: define(sp, policy=SnapshotPolicy("manual"))) == "empty_root"


def test_nil_leaser(tmp_path: Path, store: Store) -> None:
    sp = exclusive_workspace(store, tmp_path / "ws", None)
    assert kind_of(E.WorkspacePlacementError,
                   lambda: define(sp, policy=SnapshotPolicy("manual"))) == "nil_leaser"


@pytest.mark.parametrize("prefix", ["", "has space", "../up", "a//b", "a/./b", "é"])
def test_lease_name_invalid(tmp_path: Path, store: Store, leaser: Leaser, prefix: str) -> None:
    sp = exclusive_workspace(store, tmp_path / "ws", leaser, lease_prefix=prefix)
    assert kind_of(E.WorkspacePlacementError,
                   lambda: define(sp, policy=SnapshotPolicy("manual"))) == "lease_name_invalid"


def test_custom_lease_prefix(tmp_path: Path, store: Store, leaser: Leaser) -> None:
    cfg = define(exclusive_workspace(store, tmp_path / "ws", leaser, lease_prefix="team/roots"),
                 policy=SnapshotPolicy("manual"))
    assert cfg.placement is not None and cfg.placement.lease_name is not None
    assert cfg.placement.lease_name.startswith("team/roots/")


def _canon_failures(tmp_path: Path) -> list[str]:
    f = tmp_path / "file"
    f.write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    return [str(f / "sub"), str(tmp_path / "a\0b"), str(tmp_path / "dangling" / "x"),
            str(tmp_path / "loop1" / "x")]


@pytest.mark.parametrize("mode", MODES)
def test_canonicalize_failed(tmp_path: Path, store: Store, leaser: Leaser, mode: str) -> None:
    for bad in _canon_failures(tmp_path):
        sp = spec(mode, store, leaser, bad)  # type: ignore[arg-type]
        assert kind_of(E.WorkspacePlacementError, lambda sp=sp: define(
            sp, policy=SnapshotPolicy("manual"))) == "canonicalize_failed", bad


def test_workspace_tool_without_placement() -> None:
    assert kind_of(E.WorkspacePlacementError, lambda: define(
        requires_workspace=True)) == "workspace_tool_without_placement"


def test_tool_with_placement_is_fine(tmp_path: Path, store: Store) -> None:
    define(session_workspaces(store, tmp_path / "b"), policy=SnapshotPolicy("manual"),
           requires_workspace=True)


# -- policy kinds -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_placement_without_policy(tmp_path: Path, store: Store, leaser: Leaser,
                                  mode: str) -> None:
    sp = spec(mode, store, leaser, tmp_path / "ws")
    assert kind_of(E.SnapshotPolicyError, lambda: define(sp)) == "required"


def test_policy_without_placement() -> None:
    assert kind_of(E.SnapshotPolicyError,
                   lambda: define(policy=SnapshotPolicy("manual"))) == "without_workspace"


@pytest.mark.parametrize("trigger", ["", "idle", "on-idle", "MANUAL", 3])
def test_invalid_trigger(trigger: object) -> None:
    assert kind_of(E.SnapshotPolicyError, lambda: SnapshotPolicy(
        trigger=trigger).resolved()) == "invalid_trigger"  # type: ignore[arg-type]


@pytest.mark.parametrize("priority", ["", "best-effort", "must", 1])
def test_invalid_priority(priority: object) -> None:
    assert kind_of(E.SnapshotPolicyError, lambda: SnapshotPolicy(
        priority=priority).resolved()) == "invalid_priority"  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [-1, -0.001, float("nan"), float("inf"), "5", True])
def test_invalid_timeout(timeout: object) -> None:
    assert kind_of(E.SnapshotPolicyError, lambda: SnapshotPolicy(
        timeout_s=timeout).resolved()) == "invalid_timeout"  # type: ignore[arg-type]


def test_negative_idle_period_is_invalid_timeout() -> None:
    assert kind_of(E.SnapshotPolicyError,
                   lambda: SnapshotPolicy(idle_s=-1).resolved()) == "invalid_timeout"


def test_timeout_defaults() -> None:
    assert SnapshotPolicy(timeout_s=0).resolved().timeout_s == 60.0
    assert SnapshotPolicy(timeout_s=2.5).resolved().timeout_s == 2.5
    assert SnapshotPolicy().resolved().trigger == "on_idle"


# -- validation order ---------------------------------------------------------------------


def test_order_policy_options_before_placement(tmp_path: Path, store: Store) -> None:
    a = session_workspaces(store, tmp_path / "a")
    assert kind_of(E.SnapshotPolicyError, lambda: define(
        a, a, policy=SnapshotPolicy(trigger="bad"))) == "invalid_trigger"
    assert kind_of(E.SnapshotPolicyError, lambda: define(
        session_workspaces(None, ""), policy=SnapshotPolicy(timeout_s=-1))) == "invalid_timeout"


def test_order_placement_before_tools_and_pairing(tmp_path: Path, store: Store) -> None:
    a = session_workspaces(store, tmp_path / "a")
    assert kind_of(E.WorkspacePlacementError, lambda: define(
        a, a, requires_workspace=True)) == "multiple_placements"
    assert kind_of(E.WorkspacePlacementError, lambda: define(
        session_workspaces(None, tmp_path))) == "nil_store"


def test_order_tools_before_pairing() -> None:
    assert kind_of(E.WorkspacePlacementError, lambda: define(
        policy=SnapshotPolicy("manual"),
        requires_workspace=True)) == "workspace_tool_without_placement"


def test_order_shared_required_before_overlap(tmp_path: Path) -> None:
    root = tmp_path / "root"
    st = Store(root / "store")
    assert kind_of(E.SnapshotPolicyError, lambda: define(
        shared_workspace(st, root),
        policy=SnapshotPolicy(priority="required"))) == "shared_required"
    with pytest.raises(E.PersistenceOverlapError):
        define(shared_workspace(st, root), policy=SnapshotPolicy())


# -- persistence overlap ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_store_inside_root_is_refused(tmp_path: Path, mode: str) -> None:
    root = tmp_path / "root"
    st = Store(root / "deep" / "store")
    with pytest.raises(E.PersistenceOverlapError) as ei:
        define(spec(mode, st, Leaser(st), root), policy=SnapshotPolicy("manual"))
    assert ei.value.root == str(root)
    assert ei.value.path == str(root / "deep" / "store")


def test_state_and_spool_paths_inside_root_are_refused(tmp_path: Path, store: Store,
                                                       leaser: Leaser) -> None:
    root = tmp_path / "root"
    sp = exclusive_workspace(store, root, leaser)
    with pytest.raises(E.PersistenceOverlapError):
        define(sp, policy=SnapshotPolicy("manual"), state_base=root / "state")
    with pytest.raises(E.PersistenceOverlapError) as ei:
        define(sp, policy=SnapshotPolicy("manual"), persistence_paths=[str(root)])
    assert ei.value.path == str(root)


def test_overlap_is_by_components(tmp_path: Path) -> None:
    st = Store(tmp_path / "a" / "bc")
    cfg = define(shared_workspace(st, tmp_path / "a" / "b"), policy=SnapshotPolicy("manual"),
                 persistence_paths=[str(tmp_path / "a" / "b-spool")])
    assert cfg.placement is not None
    assert is_within("/a/b/c", "/a/b") and is_within("/a/b", "/a/b")
    assert not is_within("/a/bc", "/a/b") and not is_within("/a", "/a/b")


def test_overlap_through_a_symlink_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "alias").symlink_to(root)
    st = Store(tmp_path / "alias" / "store")
    with pytest.raises(E.PersistenceOverlapError):
        define(shared_workspace(st, root), policy=SnapshotPolicy("manual"))


# -- canonical roots, fingerprint, drift --------------------------------------------------


def test_canonical_path(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert canonical_path(tmp_path / "link") == str(real)
    assert canonical_path(str(tmp_path / "link") + "/new/../x/") == str(real / "x")
    assert canonical_path(tmp_path / "link" / "missing" / "deeper") == str(
        real / "missing" / "deeper")
    cwd = os.getcwd()
    os.chdir(real)
    try:
        assert canonical_path("rel") == str(real / "rel")
    finally:
        os.chdir(cwd)


def test_fingerprint_follows_the_canonical_root(tmp_path: Path, store: Store) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    a = define(shared_workspace(store, tmp_path / "link"), policy=SnapshotPolicy("manual"))
    b = define(shared_workspace(store, real), policy=SnapshotPolicy("manual"))
    assert a.placement is not None and b.placement is not None
    assert a.placement.fingerprint == b.placement.fingerprint == f"shared:{real}"
    b.placement.check_drift("s1", f"shared:{real}")
    with pytest.raises(E.PlacementDriftError) as ei:
        b.placement.check_drift("s1", f"exclusive:{real}")
    assert ei.value.recorded == f"exclusive:{real}" and ei.value.current == f"shared:{real}"


def test_root_lease_name_is_sha256_of_canonical_root() -> None:
    assert root_lease_name("/srv/ws") == (
        "workspace-roots/" + hashlib.sha256(b"/srv/ws").hexdigest())


def test_errors_carry_exit_code_and_kind() -> None:
    e = E.WorkspacePlacementError("nil_store", "x")
    assert e.exit_code == 10 and e.kind == "nil_store" and "nil_store" in str(e)
    r = E.RestoreError("swap_failed", "v1:blake3:" + "0" * 64, OSError(5, "EIO"))
    assert r.kind == "swap_failed" and isinstance(r.cause, OSError)
    b = E.WorkspaceRootBusyError("/srv/ws", 7)
    assert b.root == "/srv/ws" and b.holder_epoch == 7 and "/srv/ws" in str(b)
