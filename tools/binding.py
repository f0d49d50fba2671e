"""What the agent tools need from a session: a root path and a few optional calls.

The tools never import the session layer. A session (or anything else) plugs in by
providing an object shaped like :class:`SessionBinding`; :class:`DirBinding` serves a plain
directory. Checkpoint, log, diff, restore and the step log are optional: the MCP server offers those tools
only when the binding has them (see :func:`capabilities`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from store.pathpolicy import PathPolicy


class PermitError(Exception):
    """The session could not grant the write permit (it is closed, faulted or gone); the
    message says why. Tools answer it as an error result."""


class SessionBinding(Protocol):
    """The minimal session API the tools use.

    ``root``: absolute path of the live workspace root (a mount point or a directory).
    ``write_permit()``: a context manager held while a tool may change the workspace in
    ways the session cannot see request by request (Bash holds it for the whole command),
    so that a checkpoint requested meanwhile waits for it. Raises PermitError when the
    session refuses it.
    ``hidden_paths()``: absolute paths a sandboxed command must not see at all (the store,
    state directories, spools); they are masked when Bash runs confined.
    """

    @property
    def root(self) -> str: ...

    def write_permit(self) -> contextlib.AbstractContextManager[None]: ...

    def hidden_paths(self) -> Sequence[str]: ...


@runtime_checkable
class CanCheckpoint(Protocol):
    """Optional: freeze the workspace; returns a short text for the model (the new Ref)."""

    def checkpoint(self, label: str | None = None) -> str: ...


@runtime_checkable
class CanLog(Protocol):
    """Optional: the session's journal as text, newest last."""

    def log(self) -> str: ...


@runtime_checkable
class CanDiff(Protocol):
    """Optional: changes between two Refs (None = the live workspace / last checkpoint)."""

    def diff(self, ref_a: str | None = None, ref_b: str | None = None) -> str: ...


@runtime_checkable
class CanRestore(Protocol):
    """Optional: point the workspace at another Ref; returns a short text."""

    def restore(self, ref: str, paths: list[str] | None = None) -> str: ...


@runtime_checkable
class HasPathPolicy(Protocol):
    """Optional: the session's path policy (hide, protect; ``store.pathpolicy``), applied
    by every tool's path resolution (tools.paths) and by the Bash sandbox."""

    def path_policy(self) -> PathPolicy: ...


def path_policy(binding: object) -> PathPolicy:
    """``binding``'s path policy, or an empty one when it has none."""
    if isinstance(binding, HasPathPolicy):
        return binding.path_policy()
    return PathPolicy()


@runtime_checkable
class KeepsCovers(Protocol):
    """Optional: a place kept with the session for what the path policy covered at the
    last scan (``tools.paths.Covered.record``: a JSON-able dict), so that tools started
    again (an MCP server restart) cover the same objects, also those a command moved to
    names no pattern matches. ``load_covers``: the record last saved, None when there is
    none or it cannot be read; ``save_covers`` replaces it (OSError when it cannot)."""

    def load_covers(self) -> dict[str, Any] | None: ...

    def save_covers(self, record: dict[str, Any]) -> None: ...


@runtime_checkable
class CanMarkBackground(Protocol):
    """Optional: a context manager held while a background command runs, which holds no
    write permit. A session that cannot see such writes request by request (the no-FUSE
    fallback) marks checkpoints taken meanwhile ``fuzzy``. Raises PermitError when the
    session refuses (closed, faulted)."""

    def background_writer(self) -> contextlib.AbstractContextManager[None]: ...


class SandboxRegistration(Protocol):
    """A running sandbox's registration with the session's guard (see
    :class:`GuardsSandboxes`): ``bind(pid)`` names the first process of its pid
    namespace and returns the covered path removed
    or replaced since the registration (the command must then not run), else None;
    ``end()`` forgets it and returns the covered path whose removal or replacement
    outside the sandbox stopped it, else None; ``close()`` forgets it."""

    def bind(self, pid: int) -> str | None: ...

    def end(self) -> str | None: ...

    def close(self) -> None: ...


@runtime_checkable
class GuardsSandboxes(Protocol):
    """Optional: a session whose file system stops a running sandbox before it removes or
    replaces an object the sandbox's path policy covers (the covers are mounts on those
    dentries: they would not survive it). ``guard_sandbox(covers)``: register a sandbox
    about to start, covering ``covers`` ((inode number, workspace path) pairs); None where
    the session has no such guard. Raises OSError when it refuses (EBUSY: a restore of a
    covered path runs) or cannot be asked."""

    def guard_sandbox(self, covers: list[tuple[int, str]]) -> SandboxRegistration | None: ...


def background_writer(binding: object) -> contextlib.AbstractContextManager[None]:
    """The binding's background-writer mark, or a no-op where it has none."""
    if isinstance(binding, CanMarkBackground):
        return binding.background_writer()
    return contextlib.nullcontext()


@runtime_checkable
class CanStep(Protocol):
    """Optional: the step change log. ``step_done(label)`` closes a step (the MCP server
    calls it after every mutating tool call: WriteFile, EditFile, Bash) and ``changes``
    answers with the paths a step changed (None: the recent steps) as text."""

    def step_done(self, label: str | None = None) -> None: ...

    def changes(self, step: int | None = None) -> str: ...


def capabilities(binding: object) -> frozenset[str]:
    """Names of the optional calls ``binding`` provides: subset of
    checkpoint/log/diff/restore/step."""
    found = set()
    for name, proto in (("checkpoint", CanCheckpoint), ("log", CanLog), ("diff", CanDiff),
                        ("restore", CanRestore), ("step", CanStep)):
        if isinstance(binding, proto):
            found.add(name)
    return frozenset(found)


class DirBinding:
    """A plain directory as a workspace: no checkpoints, a write permit that never waits.
    ``hidden``: absolute paths a confined command must not see; ``policy``: path policy."""

    def __init__(self, root: str | os.PathLike[str], hidden: Sequence[str] = (),
                 policy: PathPolicy | None = None) -> None:
        path = os.path.abspath(os.fspath(root))
        if not os.path.isdir(path):
            raise NotADirectoryError(f"workspace root is not a directory: {path}")
        self._root = path
        self._hidden = tuple(os.path.abspath(h) for h in hidden)
        self._policy = policy if policy is not None else PathPolicy()

    @property
    def root(self) -> str:
        return self._root

    def path_policy(self) -> PathPolicy:
        return self._policy

    @contextlib.contextmanager
    def write_permit(self) -> Iterator[None]:
        yield

    def hidden_paths(self) -> Sequence[str]:
        return self._hidden
