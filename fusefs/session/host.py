"""A session host: the process that owns one no-FUSE session for the CLI (CONTRACT 4.0).

``rewindfs session new`` (and ``resume``, ``fork``) starts ``python -m fusefs.session.host``
detached; the host opens the session (leases, seed, recovery), records its control socket
in the state directory, reports ``{"ok": true, "id", "root"}`` (or the typed error) on the
file descriptor given by ``--ready-fd`` and then serves the control socket (``control.py``)
until a ``shutdown`` request or SIGTERM/SIGINT, when it shuts the session down in the
contract's order. A FUSE session's host is its mount daemon, which serves the same protocol.

The workspace is described by a spec, recorded as ``host.json`` in the state directory so
that ``resume`` can start a host with the same configuration::

    {"store", "placement", "path", "policy", "required", "ttl", "idle_s"}

and optionally ``quota_bytes``, ``quota_inodes`` (caps on the upper layer of a FUSE root),
``paths`` (the path policy, ``{"hide": [...], "protect": [...], "exclude":
[...]}``, see ``store.pathpolicy``), ``timeout_s`` (policy timeout), ``state_base`` and
``backend`` (``fallback`` when absent; ``auto`` or ``fuse`` open the session on the FUSE backend, whose own session
process then serves it: this host reports it ready and exits).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socketserver
import sys
import threading
from collections.abc import Callable
from typing import Any

from .config import WorkspaceConfig, define
from .control import CONTROL_FILE, error_reply, socket_dir
from .errors import RestoreError
from .placement import exclusive_workspace, session_workspaces, shared_workspace
from .policy import SnapshotPolicy
from .registry import write_json_atomic

SPEC_FILE = "host.json"
log = logging.getLogger("rewindfs.session")


def config_from_spec(spec: dict[str, Any]) -> WorkspaceConfig:
    """Build and validate the workspace configuration a spec describes."""
    from store.lease import Leaser
    from store.objects import Store
    from store.pathpolicy import PathPolicy

    st = Store(spec["store"])
    mode = spec["placement"]
    if mode == "per-session":
        p = session_workspaces(st, spec["path"])
    elif mode == "exclusive":
        p = exclusive_workspace(st, spec["path"], Leaser(st))
    elif mode == "shared":
        p = shared_workspace(st, spec["path"])
    else:
        raise ValueError(f"unknown placement {mode!r}")
    policy = SnapshotPolicy(spec.get("policy") or "manual",
                            "required" if spec.get("required") else "best_effort",
                            timeout_s=float(spec.get("timeout_s", 0)),
                            idle_s=float(spec.get("idle_s", 5.0)))
    return define(p, policy=policy, backend=spec.get("backend") or "fallback",
                  lease_ttl_s=float(spec.get("ttl", 30)), state_base=spec.get("state_base"),
                  path_policy=PathPolicy.from_spec(spec.get("paths")),
                  quota_bytes=spec.get("quota_bytes"), quota_inodes=spec.get("quota_inodes"))


def shutdown_checkpoint(session: Any, req: dict[str, Any]) -> str | None:
    """The checkpoint of a ``shutdown`` request with ``"checkpoint": true`` (``session
    shutdown --checkpoint``, amended CONTRACT 4.9), taken before anything stops, trigger
    ``shutdown``; its Ref as text, or None when not asked. A failure raises (the session
    keeps running: nothing is stopped)."""
    if not req.get("checkpoint"):
        return None
    return str(session._h("checkpoint").checkpoint("shutdown", req.get("timeout_s")))


def spec_of(cfg: WorkspaceConfig, backend: str) -> dict[str, Any]:
    """The workspace spec (``config_from_spec``) that rebuilds ``cfg`` (on ``backend``)
    in a session process. Leases live in the store's catalog (a leaser over the same
    store)."""
    p = cfg.placement
    pol = cfg.policy
    assert p is not None and pol is not None
    return {"store": p.store.root, "placement": p.mode.value, "path": p.path,
            "policy": pol.trigger, "required": pol.priority == "required",
            "timeout_s": pol.timeout_s, "idle_s": pol.idle_s, "ttl": cfg.lease_ttl_s,
            "state_base": cfg.state_base, "backend": backend, "paths": cfg.paths.to_spec(),
            **{k: v for k, v in (("quota_bytes", cfg.quota_bytes),
                                 ("quota_inodes", cfg.quota_inodes)) if v is not None}}


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        line = self.rfile.readline()
        req: Any = None
        try:
            req = json.loads(line)
            if isinstance(req, dict) and req.get("op") == "write_permit":
                self.server.host.hold_write_permit(self._send, self.rfile.readline)
                return
            if isinstance(req, dict) and req.get("op") == "background_writer":
                self.server.host.hold_background_writer(self._send, self.rfile.readline)
                return
            if isinstance(req, dict) and req.get("op") == "sandbox":
                self.server.host.hold_sandbox(req, self._send, self.rfile.readline)
                return
            reply = self.server.host.dispatch(req)
        except Exception as e:
            reply = error_reply(e)
        try:
            self._send(reply)
        except OSError:
            pass  # the client went away
        finally:
            self.server.host.replied(req)

    def _send(self, reply: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(reply).encode() + b"\n")
        self.wfile.flush()


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    host: Host


class Host:
    """Serves one open ``Session`` on a control socket."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.last_pointer: str | None = None  # the restore pointer read last
        self.done = threading.Event()
        self.sock_path = os.path.join(socket_dir(), f"{session.id}.sock")
        self._note_pointer()  # so status knows the Ref served if the catalog goes away

    def dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        try:
            return self._serve_op(req, op)
        finally:
            if op in ("checkpoint", "restore", "turn_done", "step_done"):
                self._note_pointer()  # the restore pointer may have moved

    def _note_pointer(self) -> None:
        """Read the restore pointer into ``last_pointer`` while the catalog answers (a
        failure is logged: ``last_pointer`` keeps what was read before)."""
        try:
            self.pointer()
        except Exception as e:
            log.warning("reading the restore pointer of %s failed: %s", self.session.id, e)

    def _serve_op(self, req: dict[str, Any], op: Any) -> dict[str, Any]:
        s = self.session
        if op == "status":
            ref, catalog = self.pointer()
            out = {"ok": True, "id": s.id, "root": s.root, "pid": os.getpid(),
                   "epoch": s.epoch, "fault": s.fault, "terminal": s.terminal,
                   "ref": ref}
            if catalog is not None:
                out["catalog"] = catalog
            return out
        if op == "checkpoint":
            trigger = req.get("trigger") or "manual"
            handle = s._h("checkpoint")
            label = str(req["label"]) if req.get("label") else None
            ref = handle.checkpoint(trigger, req.get("timeout_s"), label)
            return {"ok": True, "ref": str(ref)}
        if op == "restore":
            paths = req.get("paths")
            if paths is not None and not (isinstance(paths, list)
                                          and all(isinstance(p, str) for p in paths)):
                raise RestoreError(RestoreError.PATH_ESCAPE, str(req.get("ref") or ""),
                                   "paths must be a list of strings")
            # a Ref, or what a user typed (prefix, @label, @-N), read against this
            # session's store wherever the client runs
            target = s.resolve(str(req.get("ref")))
            pre = s.restore(target, bool(req.get("discard")),
                            req.get("timeout_s"), wait_writers_s=req.get("wait_writers_s"),
                            paths=paths)
            out = {"ok": True, "ref": str(target), "pre_restore": str(pre) if pre else None}
            if paths is not None:  # the tree the path restore made, as journaled
                from fusefs.restore import normalize_paths

                restores = [e for e in s.log() if e.event == "WorkspaceRestored"]
                out.update(ref=str(restores[-1].ref) if restores else None,
                           source=str(target),
                           paths=[os.fsdecode(p) for p in normalize_paths(paths)])
            return out
        if op in ("turn_done", "step_done"):
            done = s.turn_done if op == "turn_done" else s.step_done
            return {"ok": True, "step": done(req.get("label"))}
        if op == "shutdown":
            ref = shutdown_checkpoint(s, req)
            self.done.set()
            return {"ok": True, "ref": ref}
        raise ValueError(f"unknown control request {op!r}")

    def pointer(self) -> tuple[str | None, str | None]:
        """``(ref, catalog)`` of a ``status``: the session's restore pointer as text (read
        from its journal), and on a shared store ``"ok"``. With the catalog unreachable,
        status still answers (from this process's own state): ``ref`` is then the pointer
        this host read last (at start, after each checkpoint, restore or step, and at each
        status; None only if none of them could), ``catalog`` ``"unreachable: <reason>"``."""
        from store.errors import CatalogError

        s = self.session
        try:
            p = s.restore_pointer()
        except CatalogError as e:
            return self.last_pointer, f"unreachable: {e}"
        self.last_pointer = str(p) if p else None
        store = s.workspace.store
        shared = store is not None and bool(getattr(store.catalog, "shared", False))
        return self.last_pointer, "ok" if shared else None

    def replied(self, req: Any) -> None:
        """Called after the reply to ``req`` was sent (or could not be)."""

    def hold_write_permit(self, send: Callable[[dict[str, Any]], None],
                          wait_closed: Callable[[], object]) -> None:
        """The ``write_permit`` request: take the session's write permit, ``send`` the ok
        reply, and hold the permit until ``wait_closed`` returns (the client closed the
        connection). A refusal (closed, faulted session) raises before anything is sent."""
        with self.session.write_permit():
            try:
                send({"ok": True})
            except OSError:
                return  # the client gave up waiting: release at once
            wait_closed()

    def hold_background_writer(self, send: Callable[[dict[str, Any]], None],
                               wait_closed: Callable[[], object]) -> None:
        """The ``background_writer`` request: mark a background writer (checkpoints taken
        meanwhile are fuzzy), ``send`` the ok reply, keep the mark until the client closes
        the connection."""
        with self.session.background_writer():
            try:
                send({"ok": True})
            except OSError:
                return
            wait_closed()

    def hold_sandbox(self, req: dict[str, Any], send: Callable[[dict[str, Any]], None],
                     readline: Callable[[], bytes]) -> None:
        """The ``sandbox`` request (``control.SandboxRegistration``): registers a sandbox
        with the mount daemon's guard. Only a FUSE mount has one: refused here."""
        raise ValueError("the sandbox guard needs the session's FUSE mount")

    def serve(self) -> None:
        try:
            os.unlink(self.sock_path)
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            server = _Server(self.sock_path, _Handler)
        finally:
            os.umask(old)
        try:
            os.chmod(self.sock_path, 0o600)
            server.host = self
            t = threading.Thread(target=server.serve_forever, args=(0.05,), name="control",
                                 daemon=True)
            t.start()
        except BaseException:
            server.server_close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.sock_path)
            raise
        self._t = t
        self._server = server  # from now on ``close_socket`` undoes all of this
        with open(os.path.join(self.session.record.state_dir, CONTROL_FILE) + ".tmp", "w") as f:
            f.write(self.sock_path)
        os.rename(os.path.join(self.session.record.state_dir, CONTROL_FILE) + ".tmp",
                  os.path.join(self.session.record.state_dir, CONTROL_FILE))

    def wait_and_stop(self) -> None:
        while not self.done.wait(1.0):
            pass
        try:
            self.session.shutdown()
        finally:
            self.close_socket()

    def close_socket(self) -> None:
        """Stop serving: drop the state dir's pointer to this socket (only if it still names
        it), shut the server down and remove the socket file."""
        try:
            path = os.path.join(self.session.record.state_dir, CONTROL_FILE)
            with open(path) as f:
                if f.read().strip() == self.sock_path:
                    os.unlink(path)
        except FileNotFoundError:
            pass
        self._server.shutdown()
        self._server.server_close()
        try:
            os.unlink(self.sock_path)
        except FileNotFoundError:
            pass


def main(argv: list[str] | None = None) -> int:
    from .api import Workspace

    ap = argparse.ArgumentParser(prog="python -m fusefs.session.host")
    ap.add_argument("--spec", required=True, help="workspace spec as JSON")
    ap.add_argument("--ready-fd", type=int, required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--new", action="store_true")
    g.add_argument("--resume", metavar="ID")
    g.add_argument("--fork", metavar="ID_OR_REF")
    ap.add_argument("--seed")
    ap.add_argument("--parent")
    ap.add_argument("--discard-upper", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ready = os.fdopen(args.ready_fd, "w")

    def report(data: dict[str, Any]) -> None:
        ready.write(json.dumps(data) + "\n")
        ready.close()

    # A FUSE session gets its own session process; from a one-shot host start it directly
    # rather than through a pre-imported parent that would end with this host.
    os.environ.setdefault("REWINDFS_SESSION_ZYGOTE", "0")
    s = None
    try:
        socket_dir()  # a runtime directory we cannot use fails before anything is taken
        spec = json.loads(args.spec)
        ws = Workspace(config_from_spec(spec))
        if args.new:
            if args.seed and args.parent:
                s = ws.new_session(args.seed, parent=args.parent)
            else:
                s = ws.new_session(args.seed)
        elif args.resume:
            s = ws.resume_session(args.resume, discard_upper=args.discard_upper)
        else:
            s = ws.fork_session(args.fork)
        if getattr(s._handle, "remote", False):
            # A FUSE session: its own session process serves it; this host is done.
            report({"ok": True, "id": s.id, "root": s.root,
                    "pid": getattr(s._handle, "pid", None)})
            return 0
        write_json_atomic(os.path.join(s.record.state_dir, SPEC_FILE), spec)
        logfd = os.open(os.path.join(s.record.state_dir, "host.log"),
                        os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.dup2(logfd, 1)
        os.dup2(logfd, 2)
        os.close(logfd)
        host = Host(s)
        host.serve()
    except BaseException as e:
        if s is not None:  # opened, but it cannot be served: leave nothing behind
            try:
                s.shutdown()
                if not args.resume:
                    ws.remove_session(s.id)
            except Exception as e2:
                log.error("cleaning %s up after the failed start: %s", s.id, e2)
        report(error_reply(e))
        return int(getattr(e, "exit_code", 1) or 1)
    signal.signal(signal.SIGTERM, lambda *_: host.done.set())
    signal.signal(signal.SIGINT, lambda *_: host.done.set())
    report({"ok": True, "id": s.id, "root": s.root, "pid": os.getpid()})
    host.wait_and_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
