"""Workspace placement (CONTRACT 4.1): where a session's live root is and how it is guarded.

Three modes:

- ``per-session``: live root ``<base>/<session-id>``; no root lease, isolated by construction.
- ``exclusive``: one fixed root, guarded by the root lease ``workspace-roots/<sha256 of the
  canonical root>``, taken after the session lease.
- ``shared``: one fixed root that several sessions (and humans) edit; no root lease; its
  checkpoints are ``fuzzy`` because writers outside the session may exist.

This module owns canonical paths (absolute, lexically clean, symlinks resolved on the longest
existing prefix), the overlap test by path components (``/a/bc`` does not overlap ``/a/b``),
the placement fingerprint ``<mode>:<canonical root or base>`` and the drift check. It never
creates or touches a directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .errors import InvalidSessionIdError, PlacementDriftError, WorkspacePlacementError

ROOT_LEASE_PREFIX = "workspace-roots"
_LEASE_SEGMENT = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class Mode(StrEnum):
    PER_SESSION = "per-session"
    EXCLUSIVE = "exclusive"
    SHARED = "shared"


def canonical_path(path: str | os.PathLike[str]) -> str:
    """Return ``path`` absolute, lexically clean, with symlinks resolved on its longest
    existing prefix (the rest need not exist yet).

    Raises WorkspacePlacementError ``empty_root`` for an empty path and
    ``canonicalize_failed`` for a NUL byte, an unreadable or looping prefix, a dangling
    symlink, or an existing non-directory with components below it.
    """
    p = os.fspath(path)
    if not isinstance(p, str):
        raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                      f"{p!r} is not a text path")
    if not p.strip():
        raise WorkspacePlacementError(WorkspacePlacementError.EMPTY_ROOT, "the root is empty")
    if "\0" in p:
        raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                      f"{p!r} contains a NUL byte")
    try:
        clean = os.path.abspath(p)
    except OSError as e:  # the working directory is gone
        raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                      f"{p}: {e}") from None
    parts = [c for c in clean.split("/") if c]
    existing = "/"
    i = 0
    while i < len(parts):
        cand = os.path.join(existing, parts[i])
        try:
            os.lstat(cand)
        except FileNotFoundError:
            break
        except NotADirectoryError:  # ``existing`` is a file with components below it
            raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                          f"{existing} is not a directory") from None
        except OSError as e:
            raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                          f"{cand}: {e.strerror}") from None
        existing = cand
        i += 1
    try:
        real = os.path.realpath(existing, strict=True)
        st = os.stat(real)
    except OSError as e:
        raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                      f"{existing}: {e.strerror or e}") from None
    rest = parts[i:]
    if rest and not stat.S_ISDIR(st.st_mode):
        raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                      f"{existing} is not a directory")
    return os.path.join(real, *rest) if rest else real


def is_within(path: str, root: str) -> bool:
    """True if canonical ``path`` equals ``root`` or lies under it, by whole components."""
    if root == "/":
        return True
    return path == root or path.startswith(root + "/")


def root_lease_name(root: str, prefix: str = ROOT_LEASE_PREFIX) -> str:
    """The root lease name of canonical ``root``: ``<prefix>/<sha256 hex of the root>``."""
    return f"{prefix}/{hashlib.sha256(root.encode('utf-8', 'surrogateescape')).hexdigest()}"


def check_lease_name(name: str) -> str:
    """Return ``name`` if it is a valid lease name (``[A-Za-z0-9._-]`` segments joined by
    ``/``, no ``.``/``..`` segment, at most 255 bytes), else raise ``lease_name_invalid``."""
    segs = name.split("/")
    if (not name or len(name.encode()) > 255
            or any(s in (".", "..") or not _LEASE_SEGMENT.fullmatch(s) for s in segs)):
        raise WorkspacePlacementError(WorkspacePlacementError.LEASE_NAME_INVALID,
                                      f"{name!r} is not a valid lease name")
    return name


def check_session_id(session_id: str) -> str:
    """Return ``session_id`` if it can name a directory and a journal (``[A-Za-z0-9_-]``,
    1 to 64 characters, not starting with ``-`` or ``_``); else raise
    InvalidSessionIdError (a ValueError, exit 10)."""
    if not isinstance(session_id, str) or not _SESSION_ID.fullmatch(session_id):
        raise InvalidSessionIdError(session_id)
    return session_id


@dataclass(frozen=True)
class PlacementSpec:
    """A placement as the caller asked for it, before resolution (see ``resolve``).

    ``path`` is the base directory for per-session roots and the root itself otherwise;
    ``store`` the workspace store (a ``store.objects.Store``); ``leaser`` the lease manager
    guarding an exclusive root; ``lease_prefix`` the first part of the root lease name.
    """

    mode: Mode
    store: Any
    path: str | os.PathLike[str] | None
    leaser: Any = None
    lease_prefix: str = ROOT_LEASE_PREFIX


def session_workspaces(store: Any, base: str | os.PathLike[str] | None) -> PlacementSpec:
    """Per-session roots ``<base>/<session-id>``."""
    return PlacementSpec(Mode.PER_SESSION, store, base)


def exclusive_workspace(store: Any, root: str | os.PathLike[str] | None, leaser: Any,
                        lease_prefix: str = ROOT_LEASE_PREFIX) -> PlacementSpec:
    """One fixed root held by one session at a time under a root lease from ``leaser``."""
    return PlacementSpec(Mode.EXCLUSIVE, store, root, leaser, lease_prefix)


def shared_workspace(store: Any, root: str | os.PathLike[str] | None) -> PlacementSpec:
    """One fixed root edited by several sessions and humans; checkpoints are fuzzy."""
    return PlacementSpec(Mode.SHARED, store, root)


@dataclass(frozen=True)
class Placement:
    """A resolved placement: ``path`` is the canonical base (per-session) or root (fixed)."""

    mode: Mode
    path: str
    store: Any = field(compare=False, repr=False)
    leaser: Any = field(default=None, compare=False, repr=False)
    lease_name: str | None = None

    @property
    def fixed(self) -> bool:
        return self.mode is not Mode.PER_SESSION

    @property
    def fingerprint(self) -> str:
        """``<mode>:<canonical root or base>``, recorded with each session."""
        return f"{self.mode.value}:{self.path}"

    @property
    def consistency(self) -> str:
        """Checkpoint consistency: ``fuzzy`` for shared roots, else ``quiescent``."""
        return "fuzzy" if self.mode is Mode.SHARED else "quiescent"

    def root_for(self, session_id: str) -> str:
        """The live root of ``session_id``."""
        if self.mode is Mode.PER_SESSION:
            return os.path.join(self.path, check_session_id(session_id))
        return self.path

    def check_drift(self, session_id: str, recorded: str) -> None:
        """Raise PlacementDriftError unless ``recorded`` is this placement's fingerprint."""
        if recorded != self.fingerprint:
            raise PlacementDriftError(session_id, recorded, self.fingerprint)


def resolve(spec: PlacementSpec) -> Placement:
    """Resolve ``spec``: check store, root and leaser, canonicalize the path, name the lease.

    Raises WorkspacePlacementError with kind nil_store, empty_root, nil_leaser,
    lease_name_invalid or canonicalize_failed (also for a root or base that exists and is not
    a directory).
    """
    if spec.store is None:
        raise WorkspacePlacementError(WorkspacePlacementError.NIL_STORE,
                                      f"{spec.mode.value} placement without a store")
    if spec.path is None or not os.fspath(spec.path).strip():
        what = "base" if spec.mode is Mode.PER_SESSION else "root"
        raise WorkspacePlacementError(WorkspacePlacementError.EMPTY_ROOT,
                                      f"{spec.mode.value} placement without a {what}")
    lease_name = None
    if spec.mode is Mode.EXCLUSIVE:
        if spec.leaser is None:
            raise WorkspacePlacementError(WorkspacePlacementError.NIL_LEASER,
                                          "an exclusive root needs a leaser")
        check_lease_name(f"{spec.lease_prefix}/x")
    path = canonical_path(spec.path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise WorkspacePlacementError(WorkspacePlacementError.CANONICALIZE_FAILED,
                                      f"{path} is not a directory")
    if spec.mode is Mode.EXCLUSIVE:
        lease_name = check_lease_name(root_lease_name(path, spec.lease_prefix))
    return Placement(spec.mode, path, spec.store, spec.leaser, lease_name)
