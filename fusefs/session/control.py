"""The control socket of a session host (CONTRACT 4.0): how the CLI reaches a live session.

A host process (``host.py`` for no-FUSE sessions) serves a Unix stream socket, mode 0600,
in the runtime directory (``$XDG_RUNTIME_DIR/rewindfs/``, else ``/tmp/rewindfs-<uid>/``;
``fusefs.mounts.runtime_dir``) named
``<session id>.sock``; its path is recorded in the session's state directory as ``control``.
Protocol: one JSON object per line each way. Requests ``{"op": ..., ...}``: ``status``,
``checkpoint {trigger}``, ``restore {ref, discard, timeout_s}``, ``turn_done``,
``step_done``, ``shutdown``, ``write_permit``, ``background_writer``. Replies ``{"ok": true, ...}`` or ``{"ok":
false, "error": <class name>, "kind": <kind or null>, "message": ..., "exit_code": ...}``.

``write_permit`` is the one request that keeps its connection: the host takes the session's
whole-workspace write permit (a checkpoint or restore waits for it; the request itself waits
while one runs or is waiting), replies ``{"ok": true}`` and holds the permit until the client
closes the connection (or sends anything more). A client that dies releases it with its
socket. ``hold_write_permit`` is the client side. ``background_writer`` (no-FUSE hosts
only) keeps its connection the same way: it marks a command writing without a permit, so
checkpoints taken meanwhile are journaled fuzzy (``hold_background_writer``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
from collections.abc import Iterator
from typing import Any

from ..mounts import runtime_dir
from .errors import SessionError

CONTROL_FILE = "control"


class HostError(SessionError):
    """A session host refused or failed a request; ``error`` and ``kind`` name the typed
    error it raised, ``exit_code`` is that error's."""

    def __init__(self, error: str, kind: str | None, message: str, exit_code: int) -> None:
        self.error = error
        self.kind = kind
        self.exit_code = exit_code
        super().__init__(message)


def socket_dir() -> str:
    """The directory of control sockets: the runtime directory itself
    (``fusefs.mounts.runtime_dir``, 0700). Raises RuntimeDirError."""
    return runtime_dir()


def error_reply(e: BaseException) -> dict[str, Any]:
    """A failed reply for ``e``; ``fields`` carries the error's attributes (exceptions as
    text) so that a client can raise the same typed error again."""
    fields = {k: v if v is None or isinstance(v, str | int | float | bool) else str(v)
              for k, v in vars(e).items() if not k.startswith("_")}
    return {"ok": False, "error": type(e).__name__, "kind": getattr(e, "kind", None),
            "message": str(e), "exit_code": int(getattr(e, "exit_code", 1) or 1),
            "fields": fields}


def raise_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """Return ``reply`` if it is a success, else raise it as HostError, carrying the typed
    error's own fields (``host``, ``ref``, ...) besides its name, kind and exit code."""
    if reply.get("ok"):
        return reply
    e = HostError(str(reply.get("error")), reply.get("kind"), str(reply.get("message")),
                  int(reply.get("exit_code") or 1))
    fields = reply.get("fields")
    if isinstance(fields, dict):
        for k, v in fields.items():
            if isinstance(k, str) and not k.startswith("_") and k not in vars(e):
                setattr(e, k, v)
    raise e


def control_path(state_dir: str) -> str | None:
    """The control socket recorded for a session, or None."""
    try:
        with open(os.path.join(state_dir, CONTROL_FILE)) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _exchange(s: socket.socket, path: str, req: dict[str, Any]) -> dict[str, Any]:
    """Send ``req`` on the connected ``s`` and read one reply line."""
    s.sendall(json.dumps(req).encode() + b"\n")
    return _reply(s, path)


def _reply(s: socket.socket, path: str) -> dict[str, Any]:
    """Read one reply line from ``s`` (one request outstanding)."""
    buf = b""
    while not buf.endswith(b"\n"):
        data = s.recv(65536)
        if not data:
            break
        buf += data
    if not buf:
        raise ConnectionResetError(f"{path}: the session host closed the connection")
    out: dict[str, Any] = json.loads(buf)
    return out


def request(path: str, req: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
    """Send one request and return the reply (raises OSError if nobody serves ``path``)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        return _exchange(s, path, req)


@contextlib.contextmanager
def hold_write_permit(path: str, timeout_s: float | None = None) -> Iterator[None]:
    """Hold the session's whole-workspace write permit for the ``with`` block, across
    processes (the ``write_permit`` request). Waits (up to ``timeout_s``, default without
    end) while a checkpoint or restore runs or waits.

    Raises OSError if nobody serves ``path`` or the wait times out, HostError if the session
    refuses (closed or faulted)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        raise_reply(_exchange(s, path, {"op": "write_permit"}))
        yield


@contextlib.contextmanager
def hold_background_writer(path: str, timeout_s: float | None = 30.0) -> Iterator[None]:
    """Mark a background writer on the session for the ``with`` block (the
    ``background_writer`` request). Raises OSError if nobody serves ``path``, HostError if
    the session refuses (closed or faulted)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        s.connect(path)
        raise_reply(_exchange(s, path, {"op": "background_writer"}))
        s.settimeout(None)
        yield


class SandboxRegistration:
    """A sandbox registered with the mount daemon's guard (the ``sandbox`` request, held on
    one connection; ``fusefs.guard``): made with its covers ((inode number, workspace
    path) pairs) before the sandbox starts (and before its covers are made: its answer is
    awaited, so a covered name replaced after the scan either fails the covers' identity
    check or spoils the start at :meth:`bind`); :meth:`bind` gives the
    first process of its pid namespace, :meth:`end` (or :meth:`close`, or the
    connection's end) forgets it. Every method raises OSError: nobody serves ``path``,
    the host went away, or it refused (EBUSY: no FUSE mount, a restore of a covered path
    running, the process gone)."""

    def __init__(self, path: str, covers: list[tuple[int, str]],
                 timeout_s: float | None = 30.0) -> None:
        self.path = path
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect(path)
            req = {"op": "sandbox", "covers": [list(c) for c in covers]}
            # The answer is awaited before the sandbox starts: its covers are made after
            # the guard holds them, so a name replaced meanwhile spoils the start instead
            # of dropping a cover nothing watches.
            self._ok(_exchange(self.sock, path, req))
        except BaseException:
            self.close()
            raise

    def _ok(self, got: dict[str, Any]) -> dict[str, Any]:
        try:
            return raise_reply(got)
        except HostError as e:
            raise OSError(errno.EBUSY, str(e)) from e

    def bind(self, pid: int) -> str | None:
        """Tell the guard the sandbox's first process (``pid``, with its start time: an
        identity a reused pid does not share); returns the covered path that was removed
        or replaced since the registration (the command must not run), else None."""
        from ..guard import start_ticks

        if self.sock is None:
            raise OSError(errno.EBADF, "the sandbox's registration is closed")
        req = {"pid": pid, "start": start_ticks(pid)}
        got = self._ok(_exchange(self.sock, self.path, req))
        spoiled = got.get("spoiled")
        return None if spoiled is None else str(spoiled)

    def end(self) -> str | None:
        """Forget the sandbox (its processes have ended); returns the covered path whose
        removal or replacement outside the sandbox made the daemon stop it, else None."""
        if self.sock is None:
            return None
        try:
            got = self._ok(_exchange(self.sock, self.path, {"end": True}))
        finally:
            self.close()
        stopped = got.get("stopped")
        return None if stopped is None else str(stopped)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def live_host(state_dir: str) -> str | None:
    """The control socket of the session's live host, or None if none answers."""
    path = control_path(state_dir)
    if path is None:
        return None
    try:
        request(path, {"op": "status"}, timeout_s=30)
    except (OSError, ValueError):
        return None
    return path
