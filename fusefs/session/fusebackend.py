"""The FUSE session backend: every session root is a rewindfs mount (CONTRACT 4.0).

``FuseBackend`` is what ``api.select_backend`` picks when /dev/fuse works. Each session runs
in a session process that is its mount daemon (``fusehost.py``; the tree side is
``fusetree.py``); this module is the caller's side: it starts that process (forked from a
pre-imported parent, ``zygote.py``, unless ``REWINDFS_SESSION_ZYGOTE=0``), waits until the
root is mounted and the session open, and hands back a ``RemoteSession``, a client of the
session's control socket with the ``SessionHandle`` methods. Typed errors raised in the
session process come back as the same classes with the same fields.

Placement:

- per-session and exclusive: one process per session (``--new ID`` / ``--resume ID``);
- shared: one process per root serves every session of it. The caller looks for a live one
  through the root's ``attach`` record (under ``<state base>/roots/<sha256 of root>/``, a
  lock file there serializes callers) and attaches the session to it, or starts one.

Seed and fork (CONTRACT 4.4): the new session's upper is empty over the seed Ref: nothing is
copied, so time to a usable root does not grow with the tree. GC: every upper directory is
listed in the store's ``state_dirs`` table; ``state_dirs_reader`` (re-exported from
``fusetree``) tells GC what it pins.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from store.ref import Ref

from .config import WorkspaceConfig
from .control import HostError, request
from .errors import SessionClosedError, SessionError
from .fusetree import ATTACH_FILE, shared_dir, state_dirs_reader, unregister_state_dir, upper_dir
from .host import spec_of
from .placement import Mode
from .registry import SessionRecord
from .zygote import REPO, Zygote

__all__ = ["FuseBackend", "RemoteSession", "state_dirs_reader"]

READY_TIMEOUT_S = 120.0
EXIT_TIMEOUT_S = 120.0
ZYGOTE_ENV = "REWINDFS_SESSION_ZYGOTE"

_zygote = Zygote()


# -- errors across the socket ------------------------------------------------------------------

def _error_classes() -> dict[str, type[BaseException]]:
    from fusefs import errors as fe
    from store import errors as se

    from . import errors as xe

    out: dict[str, type[BaseException]] = {}
    for mod in (se, fe, xe):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, type) and issubclass(obj, Exception):
                out[name] = obj
    return out


def rebuild_error(reply: dict[str, Any]) -> BaseException:
    """The typed error a failed reply describes: the same class (from the store's, the FUSE
    layer's or the session layer's errors) with the same fields and message, else
    ``HostError``."""
    name = str(reply.get("error"))
    cls = _error_classes().get(name)
    fields = reply.get("fields")
    message = str(reply.get("message"))
    if cls is None or not isinstance(fields, dict):
        return HostError(name, reply.get("kind"), message, int(reply.get("exit_code") or 1))
    e = cls.__new__(cls)
    Exception.__init__(e, message)
    e.__dict__.update(fields)
    return e


def _check(reply: dict[str, Any]) -> dict[str, Any]:
    if reply.get("ok"):
        return reply
    raise rebuild_error(reply)


# -- starting session processes ------------------------------------------------------------------

def _log_tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _spawn(argv: list[str], log_path: str) -> dict[str, Any]:
    """Start a session process with ``argv``; return its ready report (raising the typed
    error it reports, or SessionError if it dies without a word)."""
    r, w = os.pipe()
    proc: subprocess.Popen[bytes] | None = None
    try:
        if os.environ.get(ZYGOTE_ENV, "1") != "0":
            _zygote.spawn(argv, w)
        else:
            env = dict(os.environ)
            env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"]
                                        if env.get("PYTHONPATH") else "")
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "fusefs.session.fusehost", *argv,
                 "--ready-fd", str(w)], pass_fds=(w,), start_new_session=True, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    try:
        buf = b""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not buf.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                raise SessionError("the session process did not report within "
                                   f"{READY_TIMEOUT_S} s")
            data = os.read(r, 65536)
            if not data:
                break
            buf += data
    finally:
        os.close(r)
    if proc is not None:
        threading.Thread(target=proc.wait, daemon=True).start()  # reaped when it exits
    if not buf:
        raise SessionError("the session process exited before it was ready:\n"
                           + _log_tail(log_path))
    reply: dict[str, Any] = json.loads(buf)
    if not reply.get("ok") and isinstance(reply.get("pid"), int):
        # It cleans up (unmounts) before it reports; wait until it is gone, so that the
        # caller may remove the session's state without a process still using it.
        _wait_exit(reply["pid"], EXIT_TIMEOUT_S)
    return _check(reply)


def _alive(pid: int) -> bool:
    from fusefs.mounts import alive

    return alive(pid, None)


def _wait_exit(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def _root_lock(d: str) -> Iterator[None]:
    """Serialize the callers that find or start a shared root's process."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(d, "attach.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _attach_record(d: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(d, ATTACH_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class FuseBackend:
    """Opens sessions whose roots are rewindfs mounts (see the module docstring)."""

    name = "fuse"

    def open_new(self, cfg: WorkspaceConfig, record: SessionRecord,
                 seed: Ref | None) -> RemoteSession:
        argv = ["--new", record.id] + (["--seed", str(seed)] if seed is not None else [])
        try:
            return self._open(cfg, record, argv, resume=False)
        except BaseException:
            if record.mode != Mode.SHARED.value:
                store = cfg.placement.store if cfg.placement is not None else None
                if store is not None:
                    unregister_state_dir(store, upper_dir(cfg, record))
            raise

    def open_existing(self, cfg: WorkspaceConfig, record: SessionRecord) -> RemoteSession:
        return self._open(cfg, record, ["--resume", record.id], resume=True)

    def _open(self, cfg: WorkspaceConfig, record: SessionRecord, argv: list[str],
              resume: bool) -> RemoteSession:
        ws_spec = spec_of(cfg, "fuse")
        spec = ["--spec", json.dumps(ws_spec)]
        if record.mode != Mode.SHARED.value:
            log = os.path.join(record.state_dir, "daemon.log")
            return RemoteSession(record, _spawn(spec + argv, log))
        assert cfg.state_base is not None and record.root is not None
        d = shared_dir(cfg.state_base, record.root)
        log = os.path.join(d, "daemon.log")
        with _root_lock(d):
            for _ in range(3):
                rec = _attach_record(d)
                if rec is None or not _alive(int(rec.get("pid", 0))):
                    return RemoteSession(record, _spawn(spec + argv, log))
                try:
                    reply = request(str(rec["socket"]), {"op": "attach", "id": record.id,
                                                         "resume": resume, "spec": ws_spec},
                                    READY_TIMEOUT_S)
                except OSError:
                    reply = None
                if reply is not None and reply.get("ok"):
                    return RemoteSession(record, reply)
                if reply is not None and reply.get("error") != "MountClosingError":
                    raise rebuild_error(reply)
                # The process is closing (its last session left): wait for it to go.
                _wait_exit(int(rec["pid"]), EXIT_TIMEOUT_S)
            raise SessionError(f"cannot attach to the mount of {record.root}")


class RemoteSession:
    """A session served by its session process, reached over its control socket."""

    remote = True

    def __init__(self, record: SessionRecord, ready: dict[str, Any]) -> None:
        self.record = record
        self.id = record.id
        self.root = ready.get("root")
        self.pid = int(ready["pid"])
        self.socket = str(ready["socket"])
        self._closed = False

    def _call(self, req: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        if self._closed:
            raise SessionClosedError(self.id)
        try:
            reply = request(self.socket, req, timeout_s)
        except OSError as e:
            raise SessionClosedError(self.id) from e
        return _check(reply)

    def status(self) -> dict[str, Any]:
        return self._call({"op": "status"}, 60)

    @property
    def epoch(self) -> int:
        return int(self.status().get("epoch") or 0)

    @property
    def fault(self) -> str | None:
        f = self.status().get("fault")
        return None if f is None else str(f)

    def checkpoint(self, trigger: str = "manual", timeout_s: float | None = None,
                   label: str | None = None) -> Ref:
        out = self._call({"op": "checkpoint", "trigger": trigger, "timeout_s": timeout_s,
                          "label": label})
        return Ref.parse(out["ref"])

    def restore(self, ref: Ref, discard: bool = False, timeout_s: float | None = None,
                cancel: threading.Event | None = None,
                wait_writers_s: float | None = None,
                paths: list[str] | None = None) -> Ref | None:
        from .errors import RestoreError

        if cancel is not None and cancel.is_set():
            raise RestoreError(RestoreError.CONTEXT_DONE, str(ref), "cancelled before start")
        if self._closed:
            raise RestoreError(RestoreError.CLOSING, str(ref))
        req: dict[str, Any] = {"op": "restore", "ref": str(ref), "discard": discard,
                               "timeout_s": timeout_s, "wait_writers_s": wait_writers_s}
        if paths is not None:
            req["paths"] = list(paths)
        out = self._call(req)
        pre = out.get("pre_restore")
        return Ref.parse(pre) if pre else None

    def turn_done(self, label: str | None = None) -> dict[str, Any] | None:
        step: dict[str, Any] | None = self._call({"op": "turn_done", "label": label})["step"]
        return step

    def step_done(self, label: str | None = None) -> dict[str, Any] | None:
        step: dict[str, Any] | None = self._call({"op": "step_done", "label": label})["step"]
        return step

    def mutated(self) -> None:
        self._call({"op": "mutated"})

    @contextlib.contextmanager
    def write_permit(self) -> Iterator[None]:
        import socket

        from .control import _exchange

        if self._closed:
            raise SessionClosedError(self.id)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(self.socket)
                reply = _exchange(s, self.socket, {"op": "write_permit"})
            except OSError as e:
                raise SessionClosedError(self.id) from e
            _check(reply)
            yield

    def shutdown(self) -> None:
        """Shut the session down in the contract's order (in its process) and return once
        its root is unmounted (or detached from a shared mount) and its leases released;
        when it was the process's last session, also once the process has exited."""
        if self._closed:
            return
        try:
            out = request(self.socket, {"op": "shutdown"})
        except (FileNotFoundError, ConnectionRefusedError):
            out = {"ok": True, "exits": True}  # the process was gone already
        except OSError as e:
            self._closed = True
            raise SessionError(f"the session process of {self.id} failed during its "
                               f"shutdown: {e}") from e
        self._closed = True
        _check(out)
        if out.get("exits", True) and not _wait_exit(self.pid, EXIT_TIMEOUT_S):
            raise SessionError(f"the session process {self.pid} of {self.id} did not exit")
