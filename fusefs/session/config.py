"""Workspace configuration: a store, at most one placement and a snapshot policy, validated
up front (CONTRACT 4.1, 4.3) in the reference system's order:

1. policy options (trigger, priority, timeout),
2. placement resolution (one placement; store, root, leaser, lease name, canonical path),
3. tool requirements (tools that need a workspace need a placement),
4. policy/placement pairing (each needs the other),
5. shared placement with a required policy,
6. persistence overlap (store, index, state and spool paths outside the managed root),
7. path policy (``exclude`` needs the FUSE backend: refused with the fallback).

The first failing step raises its typed error; a returned ``WorkspaceConfig`` is immutable
and complete. Nothing here creates a file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from store.pathpolicy import PathPolicy, PathPolicyError

from .errors import (
    PersistenceOverlapError,
    QuotaWithoutFuseError,
    SnapshotPolicyError,
    WorkspacePlacementError,
)
from .placement import Mode, Placement, PlacementSpec, canonical_path, is_within, resolve
from .policy import REQUIRED, SnapshotPolicy

DEFAULT_LEASE_TTL_S = 30.0
BACKENDS = ("auto", "fuse", "fallback")


@dataclass(frozen=True)
class WorkspaceConfig:
    """A validated workspace configuration; build it with ``define``.

    ``placement`` and ``policy`` are both set or both None (an unconfigured workspace, whose
    sessions refuse checkpoint and restore). ``state_base`` holds one state directory per
    session; ``lease_ttl_s`` is the lease time to live in seconds (renewed at a third of it);
    ``backend`` chooses FUSE mounts or the no-FUSE fallback (``auto``: FUSE when available).
    ``paths``: the session's path policy (hide, protect, exclude; ``store.pathpolicy``).
    """

    store: Any
    placement: Placement | None
    policy: SnapshotPolicy | None
    state_base: str | None
    leaser: Any
    lease_ttl_s: float
    backend: str
    paths: PathPolicy = field(default_factory=PathPolicy)
    # caps on each session's upper layer (FUSE roots; ``fusefs.overlay``): content bytes
    # and inodes; None: no cap (recorded in the session's state directory when it opens)
    quota_bytes: int | None = None
    quota_inodes: int | None = None

    @property
    def configured(self) -> bool:
        return self.placement is not None


def define(*placements: PlacementSpec, policy: SnapshotPolicy | None = None,
           requires_workspace: bool = False, persistence_paths: Iterable[str] = (),
           state_base: str | os.PathLike[str] | None = None, leaser: Any = None,
           lease_ttl_s: float = DEFAULT_LEASE_TTL_S, backend: str = "auto",
           path_policy: PathPolicy | None = None,
           quota_bytes: int | None = None,
           quota_inodes: int | None = None) -> WorkspaceConfig:
    """Validate and return a workspace configuration.

    ``placements``: zero or one of ``session_workspaces``, ``exclusive_workspace``,
    ``shared_workspace``. ``requires_workspace``: some tool of the agent needs a root.
    ``persistence_paths``: further paths (spools, session stores) that must stay outside the
    managed root. ``state_base`` defaults to ``<store root>/sessions``. ``leaser`` guards the
    session leases (default: the exclusive placement's leaser, else one over the store).
    ``path_policy``: the path policy (default: none).
    ``quota_bytes``, ``quota_inodes``: caps on what each session's upper layer holds (FUSE
    backend only; EDQUOT beyond them, see ``fusefs.overlay``); None keeps what a resumed
    session recorded, 0 removes a cap.

    Raises SnapshotPolicyError, WorkspacePlacementError, PersistenceOverlapError or
    PathPolicyError, in the order given in the module docstring; ValueError for a bad ``backend`` or ``lease_ttl_s``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if not lease_ttl_s > 0:
        raise ValueError(f"lease ttl {lease_ttl_s!r} is not a positive number of seconds")
    for name, cap in (("quota_bytes", quota_bytes), ("quota_inodes", quota_inodes)):
        if cap is not None and (not isinstance(cap, int) or cap < 0):
            raise ValueError(f"{name} {cap!r} is not a count >= 0")
        if cap and backend == "fallback":
            raise ValueError(f"{name}: quotas are enforced by the FUSE layer, not by the "
                             "fallback backend")
    # 1. policy options
    resolved_policy = policy.resolved() if policy is not None else None
    # 2. placement resolution
    if len(placements) > 1:
        raise WorkspacePlacementError(WorkspacePlacementError.MULTIPLE_PLACEMENTS,
                                      f"{len(placements)} placements given, at most one allowed")
    placement = resolve(placements[0]) if placements else None
    # 3. tool requirements
    if requires_workspace and placement is None:
        raise WorkspacePlacementError(WorkspacePlacementError.WORKSPACE_TOOL_WITHOUT_PLACEMENT,
                                      "a tool needs a workspace but no placement is configured")
    # 4. policy/placement pairing
    if placement is not None and resolved_policy is None:
        raise SnapshotPolicyError(SnapshotPolicyError.REQUIRED,
                                  "a placement needs a snapshot policy")
    if placement is None and resolved_policy is not None:
        raise SnapshotPolicyError(SnapshotPolicyError.WITHOUT_WORKSPACE,
                                  "a snapshot policy needs a placement")
    # 5. shared + required
    if (placement is not None and placement.mode is Mode.SHARED and resolved_policy is not None
            and resolved_policy.priority == REQUIRED):
        raise SnapshotPolicyError(SnapshotPolicyError.SHARED_REQUIRED,
                                  "a required policy would stall the other writers of a "
                                  "shared root")
    store = placement.store if placement is not None else None
    base = None
    if state_base is not None:
        base = canonical_path(state_base)
    elif store is not None:
        base = os.path.join(canonical_path(store.root), "sessions")
    # 6. persistence overlap
    if placement is not None:
        paths: list[str] = [placement.store.root, placement.store.index_path]
        if base is not None:
            paths.append(base)
        paths.extend(os.fspath(p) for p in persistence_paths)
        for p in paths:
            cp = canonical_path(p)
            if is_within(cp, placement.path):
                raise PersistenceOverlapError(cp, placement.path)
        store_root = canonical_path(placement.store.root)
        if is_within(placement.path, store_root):
            raise PersistenceOverlapError(store_root, placement.path, root_inside=True)
    # 7. path policy: exclude is kept by the FUSE layer's upper across checkpoints
    if backend == "fallback" and path_policy is not None:
        refuse_exclude_without_fuse(path_policy)
    if leaser is None and placement is not None:
        leaser = placement.leaser or _default_leaser(store)
    return WorkspaceConfig(store, placement, resolved_policy, base, leaser, float(lease_ttl_s),
                           backend, path_policy if path_policy is not None else PathPolicy(),
                           quota_bytes, quota_inodes)


def refuse_exclude_without_fuse(paths: PathPolicy) -> None:
    """Raise PathPolicyError when ``paths`` has ``exclude`` patterns: they are kept out of
    every Ref by the FUSE layer's upper (``fusefs.checkpoint``); a session on the no-FUSE
    fallback checkpoints a plain directory whole, so refusing beats freezing them
    silently into every Ref."""
    if paths.exclude:
        raise PathPolicyError(paths.source, "exclude needs a FUSE session: the no-FUSE "
                              "fallback (--no-fuse, or no usable /dev/fuse here) would "
                              "checkpoint the excluded paths; remove the exclude patterns "
                              "or run the session on FUSE")


def refuse_without_fuse(cfg: WorkspaceConfig) -> None:
    """What only a FUSE session keeps, refused for a session on the no-FUSE fallback
    (chosen or automatic): ``exclude`` patterns (PathPolicyError, see
    ``refuse_exclude_without_fuse``) and quotas (QuotaWithoutFuseError: nothing counts a
    plain directory's writes)."""
    refuse_exclude_without_fuse(cfg.paths)
    for option, cap in (("quota_bytes", cfg.quota_bytes), ("quota_inodes", cfg.quota_inodes)):
        if cap:
            raise QuotaWithoutFuseError(option)


def _default_leaser(store: Any) -> Any:
    from store.lease import Leaser

    return Leaser(store)
