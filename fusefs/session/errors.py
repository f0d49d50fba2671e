"""Typed errors of the session layer (CONTRACT 4), in one module.

Every error a workspace configuration, a session or its restore can raise is defined here,
carries the fields a caller needs (kind, root, path, ref, epoch, cause) and an ``exit_code``
the CLI returns (10: session or workspace error). Callers match on the class and its ``kind``,
never on the message. Nothing here imports FUSE.
"""

from __future__ import annotations

from typing import ClassVar

from store.errors import typed_cause

from ..errors import shown_users


class SessionError(Exception):
    """A session or workspace operation failed."""

    exit_code = 10


# -- configuration (CONTRACT 4.1, 4.3) ------------------------------------------------------


class WorkspacePlacementError(SessionError, ValueError):
    """A workspace placement is missing, duplicated or cannot be resolved.

    ``kind`` is one of ``KINDS``; ``detail`` says which value was wrong.
    """

    MULTIPLE_PLACEMENTS = "multiple_placements"
    NIL_STORE = "nil_store"
    EMPTY_ROOT = "empty_root"
    CANONICALIZE_FAILED = "canonicalize_failed"
    NIL_LEASER = "nil_leaser"
    LEASE_NAME_INVALID = "lease_name_invalid"
    WORKSPACE_TOOL_WITHOUT_PLACEMENT = "workspace_tool_without_placement"
    KINDS: ClassVar[frozenset[str]] = frozenset({
        MULTIPLE_PLACEMENTS, NIL_STORE, EMPTY_ROOT, CANONICALIZE_FAILED, NIL_LEASER,
        LEASE_NAME_INVALID, WORKSPACE_TOOL_WITHOUT_PLACEMENT})

    def __init__(self, kind: str, detail: str = "") -> None:
        assert kind in self.KINDS, kind
        self.kind = kind
        self.detail = detail
        super().__init__(f"workspace placement error ({kind})" + (f": {detail}" if detail else ""))


class SnapshotPolicyError(SessionError, ValueError):
    """A snapshot policy is invalid or does not fit the placement. ``kind`` is one of ``KINDS``."""

    REQUIRED = "required"
    WITHOUT_WORKSPACE = "without_workspace"
    INVALID_TRIGGER = "invalid_trigger"
    INVALID_PRIORITY = "invalid_priority"
    INVALID_TIMEOUT = "invalid_timeout"
    SHARED_REQUIRED = "shared_required"
    KINDS: ClassVar[frozenset[str]] = frozenset({
        REQUIRED, WITHOUT_WORKSPACE, INVALID_TRIGGER, INVALID_PRIORITY, INVALID_TIMEOUT,
        SHARED_REQUIRED})

    def __init__(self, kind: str, detail: str = "") -> None:
        assert kind in self.KINDS, kind
        self.kind = kind
        self.detail = detail
        super().__init__(f"snapshot policy error ({kind})" + (f": {detail}" if detail else ""))


class WorkspaceRootError(SessionError):
    """The session's root directory ``root`` (or a missing parent of it) cannot be made:
    ``cause`` names the path at fault and what to do (from ``store.dirs``)."""

    def __init__(self, root: str, cause: str) -> None:
        self.root = root
        self.cause = cause
        super().__init__(f"workspace root {root}: {cause}")


class PersistenceOverlapError(SessionError, ValueError):
    """A store, index, state or spool path is equal to or under a managed root, or (with
    ``root_inside``) the managed root is equal to or under the store ``path``."""

    def __init__(self, path: str, root: str, *, root_inside: bool = False) -> None:
        self.path = path
        self.root = root
        super().__init__(f"managed root {root} is inside the store {path}" if root_inside
                         else f"persistence path {path} is inside the managed root {root}")


class PlacementDriftError(SessionError):
    """A session is resumed under another placement than the one it was created with."""

    def __init__(self, session: str, recorded: str, current: str) -> None:
        self.session = session
        self.recorded = recorded
        self.current = current
        super().__init__(f"session {session} was created under placement {recorded}, "
                         f"not {current}")


# -- leases (CONTRACT 4.2) --------------------------------------------------------------------


class WorkspaceRootBusyError(SessionError):
    """Another session holds the root lease of an exclusive root."""

    def __init__(self, root: str, holder_epoch: int) -> None:
        self.root = root
        self.holder_epoch = holder_epoch
        super().__init__(f"workspace root {root} is held by another session "
                         f"(lease epoch {holder_epoch})")


class SessionBusyError(SessionError):
    """Another live process holds the session's lease. ``holder`` is its id
    (``host:pid:nonce``, "" if unknown); ``wait_s`` how long until its lease expires
    unless renewed (None if unknown). A holder on this host is alive (a dead one is taken
    over at once), so the message says to shut it down; one elsewhere may have died, so
    the message says how long until the lease can be taken over."""

    def __init__(self, session: str, holder_epoch: int, holder: str = "",
                 wait_s: float | None = None) -> None:
        from store.hostid import host_id

        self.session = session
        self.holder_epoch = holder_epoch
        self.holder = holder
        self.wait_s = wait_s
        host, _, rest = holder.partition(":")
        pid = rest.partition(":")[0]
        msg = f"session {session} is held by another process (lease epoch {holder_epoch}"
        if host == host_id() and pid:
            msg += f", pid {pid} on this host); shut it down first"
        elif holder:
            msg += f", {holder})"
            if wait_s is not None:
                msg += (f"; if that process is gone, its lease expires in {wait_s:.0f} s "
                        "and the session can be resumed then")
        else:
            msg += ")"
        super().__init__(msg)


class SessionStartingError(SessionBusyError):
    """Another process is starting the session (``new``, ``fork`` or ``resume``: it holds
    the session's start lock, ``registry.START_LOCK``, until the session process holds
    the lease), so it is not removed."""

    def __init__(self, session: str) -> None:
        super().__init__(session, 0)
        self.args = (f"session {session} is being started by another process; it is "
                     "not removed",)


class SessionChangesElsewhereError(SessionError):
    """A session of a shared store cannot be opened on this host (``op``: resume or fork)
    because the catalog says its upper on host ``host`` may hold changes no checkpoint
    took. ``reason``: ``crashed`` (its process there ended without a shutdown, or cannot
    be reached: its lease expired), ``dirty`` (stopped without ``--checkpoint`` with
    changes in its upper), ``unknown`` (stopped where that cannot be told: a session
    without FUSE, or with a fixed root), ``superseded`` (a later holder of its lease ran
    it and the catalog's record does not say how it left it; ``host`` is that holder's
    if it did not release the lease, else ``unknown``). ``head`` is its last checkpoint or
    restore (the tree that opening it here would serve), None if it has none."""

    kind = "changes_elsewhere"

    def __init__(self, session: str, host: str, reason: str, head: str | None,
                 op: str = "resume") -> None:
        self.session = session
        self.host = host
        self.reason = reason
        self.head = head
        self.op = op
        why = {"crashed": "its process there ended without a shutdown",
               "dirty": "it was stopped there without --checkpoint",
               "superseded": "a later holder of its lease ran it there, and the catalog "
                             "does not record how it left it",
               }.get(reason, "it was stopped there where its changes cannot be told")
        there = (f"resume it on {host} (then `session shutdown {session} --checkpoint` "
                 "there lets it move)")
        if op == "fork":
            other = (f"or fork its last checkpoint here (`session fork {head}`)" if head
                     else "it has no checkpoint to fork")
        else:
            other = ("or resume here with --discard-upper to start from its last "
                     f"checkpoint {head} without those changes" if head
                     else "it has no checkpoint to start from here")
        super().__init__(f"session {session}: its upper on host {host} may hold changes "
                         f"no checkpoint took ({why}); {there}, {other}")


class RootInUseError(SessionError):
    """A session's root is still used by processes (their cwd, root, open files or
    mappings are inside it), so it is not shut down: like umount(8) on EBUSY. ``users``
    lists ``"pid command"`` of each."""

    def __init__(self, session: str, root: str, users: list[str]) -> None:
        self.session = session
        self.root = root
        self.users = users
        super().__init__(f"session {session}: its root {root} is in use by {len(users)} "
                         f"process(es): {shown_users(users)}; stop them, or shut down with --force (they "
                         "then lose the tree)")


# -- session lifetime --------------------------------------------------------------------------


class InvalidSessionIdError(SessionError, ValueError):
    """``session`` cannot be a session id (``placement.check_session_id``: it would not
    name one directory, or a journal), whether given or read from a session registry;
    the message shows it escaped (``repr``), so no character of it acts on a terminal or
    splits the line."""

    def __init__(self, session: object) -> None:
        self.session = session
        super().__init__(f"invalid session id {session!r}: an id is 1 to 64 of "
                         "[A-Za-z0-9_-], not starting with '-' or '_'")


class SessionNotFoundError(SessionError, KeyError):
    """No session with this id is registered in the store."""

    exit_code = 4

    def __init__(self, session: str) -> None:
        self.session = session
        super().__init__(f"no session {session!r}")

    def __str__(self) -> str:
        return str(self.args[0])


class SessionClosedError(SessionError):
    """The session has been shut down; open it again with ``resume_session``."""

    def __init__(self, session: str) -> None:
        self.session = session
        super().__init__(f"session {session} is closed")


class SessionFaultedError(SessionError):
    """The session is faulted. ``terminal`` faults (lost lease, failed rollback) last until
    shutdown; the others (a failed required checkpoint, a failed journal append) are cleared
    by a successful manual checkpoint. ``cause`` says what faulted it."""

    def __init__(self, session: str, cause: str, terminal: bool) -> None:
        self.session = session
        self.cause = cause
        self.terminal = terminal
        what = "terminally faulted" if terminal else "faulted (a manual checkpoint clears it)"
        super().__init__(f"session {session} is {what}: {cause}")


class SeedError(SessionError, ValueError):
    """A seed or fork source is refused (CONTRACT 4.4): shared placement, a non-empty root
    that is not being adopted, or a source that cannot be read."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"seed refused: {reason}")


class QuotaWithoutFuseError(SessionError, ValueError):
    """A quota was asked of a session on the no-FUSE fallback, which cannot enforce it (the
    FUSE layer counts the upper; a plain directory has none). ``option``: the quota's
    name (``quota_bytes``, ``quota_inodes``). Nothing was started."""

    def __init__(self, option: str) -> None:
        self.option = option
        flag = "--" + option.replace("_", "-")
        super().__init__(f"{option} needs a FUSE session: the no-FUSE fallback (--no-fuse, "
                         "or no usable /dev/fuse here) would not enforce it; remove "
                         f"{flag} or run the session on FUSE")


class WorkspaceNotConfiguredError(SessionError):
    """Checkpoint or restore was asked of a session without a workspace placement; nothing
    was touched (CONTRACT 4.10)."""

    def __init__(self, op: str) -> None:
        self.op = op
        super().__init__(f"cannot {op}: the session has no workspace placement")


class CheckpointError(SessionError):
    """A checkpoint failed; the journal and the live tree are unchanged. ``trigger`` is what
    asked for it; ``cause`` is the underlying error (a CheckpointError given as cause, one
    raised further down, is unwrapped: its message is said once); ``cause_type`` its class
    name (None for a refusal of the session's own, as a write permit still held);
    ``exit_code`` 11 or 12 when the cause is a failed blob backend or catalog
    (``typed_cause``), else 10. ``cause_type`` and ``exit_code`` are given by a client
    that rebuilds the error from a control reply."""

    cause: BaseException | str
    cause_type: str | None

    def __init__(self, trigger: str, cause: BaseException | str, *,
                 cause_type: str | None = None, exit_code: int | None = None) -> None:
        if isinstance(cause, CheckpointError):
            cause_type = cause_type or cause.cause_type
            exit_code = exit_code or cause.exit_code
            cause = cause.cause
        self.trigger = trigger
        self.cause = cause
        self.cause_type, self.exit_code = typed_cause(cause, cause_type, exit_code, otherwise=10)
        super().__init__(f"checkpoint ({trigger}) failed: {cause}")


# -- restore (CONTRACT 4.8) -------------------------------------------------------------------


class RestoreError(SessionError):
    """A restore failed. ``kind`` is one of ``KINDS``; ``ref`` is the target; ``cause`` the
    underlying error, ``cause_type`` and ``exit_code`` as for CheckpointError (11 or 12 when
    a failed blob backend or catalog caused it, else 10). Unless the kind is rollback_failed or append_failed (which fault the
    session), the live tree is as it was before the call."""

    CONTEXT_DONE = "context_done"
    FAULTED = "faulted"
    CLOSING = "closing"
    PERMIT_FAILED = "permit_failed"
    LEASE_UNHEALTHY = "lease_unhealthy"
    SYMLINK_ROOT = "symlink_root"
    SYMLINK_COMPONENT = "symlink_component"
    PATH_ESCAPE = "path_escape"  # also: a path restore's path is hostile (.., absolute, NUL)
    PATH_NOT_FOUND = "path_not_found"  # a path restore's path is in neither tree
    SWAP_FAILED = "swap_failed"
    ROLLBACK_FAILED = "rollback_failed"
    APPEND_FAILED = "append_failed"
    KINDS: ClassVar[frozenset[str]] = frozenset({
        CONTEXT_DONE, FAULTED, CLOSING, PERMIT_FAILED, LEASE_UNHEALTHY, SYMLINK_ROOT,
        SYMLINK_COMPONENT, PATH_ESCAPE, PATH_NOT_FOUND, SWAP_FAILED, ROLLBACK_FAILED,
        APPEND_FAILED})

    def __init__(self, kind: str, ref: str = "", cause: BaseException | str = "", *,
                 cause_type: str | None = None, exit_code: int | None = None) -> None:
        assert kind in self.KINDS, kind
        self.kind = kind
        self.ref = ref
        self.cause = cause
        self.cause_type, self.exit_code = typed_cause(cause, cause_type, exit_code, otherwise=10)
        msg = f"restore{' of ' + ref if ref else ''} failed ({kind})"
        super().__init__(msg + (f": {cause}" if str(cause) else ""))

    @classmethod
    def because(cls, kind: str, ref: str, what: str, e: BaseException) -> RestoreError:
        """The RestoreError ``kind`` of ``ref`` whose cause is ``what`` failing with ``e``
        (cause text ``"<what>: <e>"``, typed as ``e``: ``typed_cause``)."""
        cause_type, code = typed_cause(e, otherwise=10)
        return cls(kind, ref, f"{what}: {e}", cause_type=cause_type, exit_code=code)


__all__ = [
    "CheckpointError", "PersistenceOverlapError", "PlacementDriftError", "RestoreError",
    "QuotaWithoutFuseError", "RootInUseError", "SeedError", "SessionBusyError", "SessionClosedError", "SessionError",
    "SessionFaultedError", "SessionNotFoundError", "SessionStartingError", "SnapshotPolicyError",
    "WorkspaceNotConfiguredError", "WorkspacePlacementError", "WorkspaceRootBusyError",
]
