"""Sessions (CONTRACT 4): workspace configuration, placement, leases, snapshot policy, journal,
seed and fork, restart, and the no-FUSE fallback. Everything a caller needs is importable
from here; the typed errors also from ``fusefs.session.errors``."""

from .api import FallbackBackend, Session, SessionBackend, SessionHandle, Workspace
from .config import WorkspaceConfig, define
from .errors import (
    CheckpointError,
    PersistenceOverlapError,
    PlacementDriftError,
    RestoreError,
    SeedError,
    SessionBusyError,
    SessionClosedError,
    SessionError,
    SessionFaultedError,
    SessionNotFoundError,
    SnapshotPolicyError,
    WorkspaceNotConfiguredError,
    WorkspacePlacementError,
    WorkspaceRootBusyError,
)
from .placement import Mode, exclusive_workspace, session_workspaces, shared_workspace
from .policy import SnapshotPolicy

__all__ = [
    "CheckpointError", "FallbackBackend", "Mode", "PersistenceOverlapError",
    "PlacementDriftError", "RestoreError", "SeedError", "Session", "SessionBackend",
    "SessionBusyError", "SessionClosedError", "SessionError", "SessionFaultedError",
    "SessionHandle", "SessionNotFoundError", "SnapshotPolicy", "SnapshotPolicyError",
    "Workspace", "WorkspaceConfig", "WorkspaceNotConfiguredError",
    "WorkspacePlacementError", "WorkspaceRootBusyError", "define", "exclusive_workspace",
    "session_workspaces", "shared_workspace",
]
