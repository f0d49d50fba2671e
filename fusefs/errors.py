"""Typed errors of the FUSE layer (overlay, upper layer, mount daemon), in one module.

POSIX failures of a filesystem operation are plain ``OSError(errno, ...)``: the overlay
raises them and the FUSE adapter answers with their errno. The classes below are for
everything that is not one request failing: opening a state directory, mounting, unmounting.
Each carries the fields a caller needs and an ``exit_code`` the CLI returns (9: mount or
daemon failure, see ``rewindfs/cli.py``).
"""

from __future__ import annotations

import shlex


class FuseFSError(Exception):
    """A mount, unmount or state-directory operation failed."""

    exit_code = 9


class StateLockedError(FuseFSError):
    """Another daemon holds the state directory's lock; a state directory serves one mount."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        super().__init__(f"state directory {state_dir} is in use by another mount daemon")


class StateDirError(FuseFSError):
    """The state directory cannot be made at ``state_dir`` (a file is in the way, a parent
    cannot be created, a name is too long); ``cause`` names the path at fault and a fix."""

    def __init__(self, state_dir: str, cause: str) -> None:
        self.state_dir = state_dir
        self.cause = cause
        super().__init__(f"state directory {state_dir}: {cause}")


class StateFullError(FuseFSError):
    """The state directory's file system has no space (ENOSPC) for what opening it must
    write (``what``); nothing in it was lost or changed."""

    def __init__(self, state_dir: str, what: str) -> None:
        self.state_dir = state_dir
        self.what = what
        super().__init__(f"state directory {state_dir}: no space left on device (ENOSPC): "
                         f"{what}; free space on its file system and mount again")


class UpperSpilledError(FuseFSError):
    """At unmount the upper's database had no space (ENOSPC): ``batches`` batches of
    changes were kept in the state directory's spill instead; the next mount applies them
    once there is space. Nothing is lost."""

    def __init__(self, state_dir: str, batches: int) -> None:
        self.state_dir = state_dir
        self.batches = batches
        super().__init__(f"state directory {state_dir}: no space left on device (ENOSPC) "
                         f"for the upper's database; {batches} batch(es) of changes are "
                         "kept in its spill and applied at the next mount once space is "
                         "free")


class BaseMismatchError(FuseFSError):
    """The state directory's upper layer sits on another Ref than the one asked for."""

    def __init__(self, state_dir: str, recorded: str, requested: str) -> None:
        self.state_dir = state_dir
        self.recorded = recorded
        self.requested = requested
        super().__init__(f"state directory {state_dir} sits on {recorded}, not {requested}; "
                         "mount it without a Ref to use its recorded base")


class NoBaseError(FuseFSError):
    """A state directory without a recorded base was mounted without a Ref."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        super().__init__(f"state directory {state_dir} records no base Ref; give one")


class UpperFormatError(FuseFSError):
    """The state directory's upper layer is of an unknown format or was made for another
    store (``what`` says which)."""

    def __init__(self, state_dir: str, what: str) -> None:
        self.state_dir = state_dir
        self.what = what
        super().__init__(f"state directory {state_dir}: {what}")


class MountError(FuseFSError):
    """The mount could not be set up, or an unmount failed; ``cause`` says why. ``because``:
    the store's error that stopped it, if any (a blob backend that cannot be read); then
    ``cause_type`` is its class name and ``exit_code`` 11 or 12 when it is a failed
    server's (``store.errors.typed_cause``), else 9."""

    def __init__(self, mountpoint: str, cause: str, *,
                 because: BaseException | None = None) -> None:
        self.mountpoint = mountpoint
        self.cause = cause
        if because is not None:
            from store.errors import typed_cause

            self.cause_type, self.exit_code = typed_cause(because, otherwise=9)
        super().__init__(f"{mountpoint}: {cause}")


def shown_users(users: list[str], most: int = 10) -> str:
    """``"pid command"`` entries of the processes that hold a path, for one line: the first
    ``most``, then ``...``."""
    return "; ".join(users[:most]) + ("; ..." if len(users) > most else "")


class MountBusyError(MountError):
    """An unmount was refused because the mount is in use (EBUSY). ``users`` lists
    ``"pid command"`` of each process whose cwd, root, open or mapped file is inside it (as
    far as /proc shows; empty when none is seen, e.g. a mount below it)."""

    def __init__(self, mountpoint: str, users: list[str]) -> None:
        self.users = users
        held = (f"in use by {len(users)} process(es): {shown_users(users)}; stop them (or "
                "move them out), or" if users else "in use (a process or a mount below it);")
        q = shlex.quote(mountpoint)
        super().__init__(mountpoint, f"busy (Device or resource busy): {held} detach it "
                                     f"anyway with `rewindfs umount --lazy {q}`")


class RuntimeDirError(FuseFSError):
    """A level of the runtime directory (``fusefs.mounts.runtime_dir``) cannot be made
    private to this user: it is not a directory of ours. ``path`` is the level, ``cause``
    says what is wrong and what to do."""

    def __init__(self, path: str, cause: str) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"runtime directory {path}: {cause}")


def leaf_errors(e: BaseException) -> list[BaseException]:
    """The exceptions inside ``e`` with exception groups flattened (a trio nursery raises
    an ExceptionGroup around what its tasks raised), in order; ``[e]`` for a plain one."""
    if isinstance(e, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in e.exceptions:
            out += leaf_errors(inner)
        return out
    return [e]


def describe(e: BaseException) -> str:
    """One line naming the real cause of ``e``: ``Type: message`` of each leaf exception
    (``leaf_errors``), joined with ``; ``."""
    return "; ".join(f"{type(x).__name__}: {x}" for x in leaf_errors(e))
