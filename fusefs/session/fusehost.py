"""The FUSE session process: the mount daemon that owns one or more sessions (CONTRACT 4.0).

Started by ``FuseBackend`` (``fusebackend.py``), directly or forked from its pre-imported
parent (``zygote.py``)::

    python -m fusefs.session.fusehost --spec JSON --ready-fd N (--new ID [--seed REF] | --resume ID)

It loads the registered session, opens it with the session runtime (leases, recovery, seed
or adoption, the seed journal event; all before anything is mounted), mounts the root on
the main thread (``fusetree.FuseMount.run``), then serves each session's control socket
(``host.Host`` protocol, plus ``diff`` and ``mutated``) and reports ``{"ok": true, "id",
"root", "pid", "socket"}`` (or the typed error, see ``control.error_reply``) on the ready
descriptor. A shared root's process also serves an attach socket (``attach.sock`` path
recorded in the shared root's directory as ``attach``): a later session of the same root
is opened inside this process (``attach {id, resume, spec}``, under its own policy),
sharing its mount. ``shutdown``
of a session shuts it down before replying (``exits``: whether the process ends with it);
the last one to leave unmounts, writes a fixed root back, and the process exits. SIGTERM
and SIGINT unmount and shut every session down in the contract's order.

The log (this process's stdout/stderr and the logging output) is ``daemon.log`` in the
session's state directory (a shared root's: in the shared root's directory).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socketserver
import sys
import threading
import time
from typing import Any

from store.ref import Ref

from ..errors import MountError, describe
from .control import error_reply, socket_dir
from .fusetree import ATTACH_FILE
from .host import Host, config_from_spec, shutdown_checkpoint
from .registry import Registry, SessionRecord, write_json_atomic

log = logging.getLogger("rewindfs.session")

SPEC_FILE = "host.json"


class FuseHost(Host):
    """The control socket of one session whose tree is a FUSE mount in this process."""

    def __init__(self, session: Any, process: SessionProcess) -> None:
        super().__init__(session)
        self.process = process
        self.closed = threading.Event()
        self._cv = threading.Condition()
        self._inflight = 0  # requests dispatched whose reply is not sent yet
        self._tls = threading.local()
        self.looping = False  # its host loop runs (``SessionProcess.start_host``)

    def dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._cv:
            self._inflight += 1
        self._tls.dispatched = True
        return self._dispatch(req)

    def replied(self, req: Any) -> None:
        if getattr(self._tls, "dispatched", False):
            self._tls.dispatched = False
            with self._cv:
                self._inflight -= 1
                self._cv.notify_all()
        if getattr(self._tls, "stopping", False):
            # only now: the process may exit once this host stops. A shutdown refused
            # before anything stopped (its checkpoint failed) leaves the session running.
            self._tls.stopping = False
            self.done.set()

    def _dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        s = self.session
        op = req.get("op")
        mount = self.process.mount
        if op == "status":
            out = Host.dispatch(self, req)
            live = mount.live
            if live is not None:  # the mount's own figures (``rewindfs status MNT``)
                daemon = mount.call(live.current_status, False)  # catalog: asked above
                if str(out.get("catalog") or "ok") != "ok":
                    # the journal cannot be read: the Ref the mount serves is the pointer
                    # (each checkpoint and restore rebases the lower on it)
                    out["ref"] = daemon["ref"]
                out.update({k: v for k, v in daemon.items() if k not in out})
            out.update(mountpoint=mount.mountpoint, state=s.record.state_dir,
                       backend="fuse", users=mount.users)
            return out
        if op == "checkpoint":
            t0 = time.perf_counter()
            out = Host.dispatch(self, req)
            last = mount.last
            out.update(elapsed_ms=round((time.perf_counter() - t0) * 1000, 3),
                       unchanged=last.get("unchanged"), packs=last.get("packs", 0),
                       bytes=last.get("bytes", 0), phases=last.get("phases"))
            return out
        if op == "restore":
            t0 = time.perf_counter()
            out = Host.dispatch(self, req)
            # the daemon's counts, as ``rewindfs restore MNT`` prints them for any mount
            out.update(elapsed_ms=round((time.perf_counter() - t0) * 1000, 3),
                       changes=mount.last.get("changes"), detached=mount.last.get("detached"),
                       invalidated=mount.last.get("invalidated"))
            return out
        if op == "diff":
            live = mount.live
            if live is None:
                raise RuntimeError("the mount is not serving")
            unified = bool(req.get("unified"))
            out = mount.call_sync(lambda: live.diff(unified))
            return dict(out, ok=True)
        if op == "mutated":
            s._h("mutated").mutated()
            return {"ok": True}
        if op == "shutdown":
            ref = shutdown_checkpoint(s, req)  # raises: nothing stopped
            self._tls.stopping = True
            s.shutdown()
            return {"ok": True, "ref": ref, "exits": self.process.last_one(self)}
        return Host.dispatch(self, req)

    def hold_sandbox(self, req: dict[str, Any], send: Any, readline: Any) -> None:
        """The ``sandbox`` request: register the sandbox's covers with the mount's guard
        (``fusefs.guard``), answer ``{"pid", "start"}`` with ``spoiled`` and ``{"end"}``
        (or the connection's end) with ``stopped``, forgetting it then."""
        mount = self.process.mount
        live = mount.live
        if live is None:
            raise RuntimeError("the mount is not serving")
        guard = live.ops.guard
        covers = [(int(ino), os.fsencode(str(path))) for ino, path in req.get("covers") or ()]
        token: int | None = mount.call_sync(guard.register, covers)

        def shown(path: bytes | None) -> str | None:
            return None if path is None else os.fsdecode(path)

        try:
            send({"ok": True})
            while True:
                line = readline()
                if not line:
                    return
                msg = json.loads(line)
                if msg.get("end"):
                    stopped = mount.call_sync(guard.end, token)
                    token = None
                    send({"ok": True, "stopped": shown(stopped)})
                    return
                try:
                    got = mount.call_sync(guard.bind, token, int(msg["pid"]), int(msg["start"]))
                except Exception as e:
                    send(error_reply(e))
                    continue
                send({"ok": True, "spoiled": shown(got)})
        except OSError:
            pass  # the client went away
        finally:
            if token is not None:
                try:
                    mount.call_sync(guard.end, token)
                except Exception as e:   # the mount stopped: nothing left to guard
                    log.debug("sandbox guard: %s", e)

    def stop(self) -> None:
        """Shut the session down (idempotent) and stop serving its socket, after the
        replies in flight are sent (bounded wait)."""
        try:
            self.session.shutdown()
        finally:
            with self._cv:
                self._cv.wait_for(lambda: self._inflight <= 0, timeout=30)
            self.close_socket()
            self.closed.set()


class _AttachHandler(socketserver.StreamRequestHandler):
    server: _AttachServer

    def handle(self) -> None:
        try:
            req = json.loads(self.rfile.readline())
            reply = self.server.process.attach(req)
        except Exception as e:
            reply = error_reply(e)
        try:
            self.wfile.write(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass


class _AttachServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    process: SessionProcess


class SessionProcess:
    """The sessions of this process and their one mount."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from .fusetree import DAEMON_LOG, FuseMount, shared_dir, upper_dir
        from .placement import Mode

        self.spec = spec
        self.cfg = config_from_spec(dict(spec, backend="fuse"))
        assert self.cfg.placement is not None and self.cfg.state_base is not None
        self.registry = Registry(self.cfg.state_base)
        self.hosts: list[FuseHost] = []
        self.lock = threading.Lock()
        self.placement = self.cfg.placement
        self.shared = self.placement.mode is Mode.SHARED
        self._mount_cls = FuseMount
        self._upper_dir = upper_dir
        self._shared_dir = shared_dir
        self._log_name = DAEMON_LOG
        self.mount: Any = None
        self._attach: _AttachServer | None = None
        self._attach_path: str | None = None

    # -- opening ---------------------------------------------------------------------------

    def make_mount(self, rec: SessionRecord) -> Any:
        assert rec.root is not None and self.cfg.state_base is not None
        fixed = self.placement.fixed
        m = self._mount_cls(
            self.cfg.store if self.cfg.store is not None else self.placement.store,
            rec.root, self._upper_dir(self.cfg, rec), fixed=fixed,
            consistency=self.placement.consistency, state_base=self.cfg.state_base,
            state_dir=rec.state_dir)
        # The spec's caps (session new/resume --quota-*) go into the upper as it opens.
        m.quota = (self.cfg.quota_bytes, self.cfg.quota_inodes)
        m.exclude = self.cfg.paths.exclude  # kept in the upper, out of every Ref
        return m

    def log_path(self, rec: SessionRecord) -> str:
        assert rec.root is not None and self.cfg.state_base is not None
        if self.shared:
            d = self._shared_dir(self.cfg.state_base, rec.root)
            os.makedirs(d, mode=0o700, exist_ok=True)
            return os.path.join(d, self._log_name)
        return os.path.join(rec.state_dir, self._log_name)

    def open(self, session_id: str, new: bool, seed: Ref | None,
             spec: dict[str, Any] | None = None) -> FuseHost:
        """Open a registered session on this process's mount, under its own workspace
        ``spec`` (policy, lease ttl; default this process's), and serve its control socket
        (once the mount serves). Raises the runtime's typed errors."""
        from .api import Session, Workspace
        from .fusetree import FuseTree
        from .runtime import SessionCore

        cfg = self.cfg if spec is None else config_from_spec(dict(spec, backend="fuse"))
        assert cfg.placement is not None
        if cfg.placement != self.placement:
            raise ValueError(f"session {session_id} is placed at {cfg.placement.fingerprint}, "
                             f"this process serves {self.placement.fingerprint}")
        rec = self.registry.load(session_id)
        self.placement.check_drift(session_id, rec.fingerprint or "")
        if self.mount is None:
            self.mount = self.make_mount(rec)
        tree = FuseTree(cfg, rec, self.mount)
        core = SessionCore(cfg, rec, tree)
        try:
            if new:
                core.open_new(seed)
            else:
                core.open_existing()
        except BaseException:
            tree.close()
            raise
        self.mount.on_mutation.append(core.mutated)
        session = Session(Workspace(cfg, backend=_NoBackend()), rec, core)
        write_json_atomic(os.path.join(rec.state_dir, SPEC_FILE), spec or self.spec)
        host = FuseHost(session, self)
        with self.lock:
            self.hosts.append(host)
        return host

    def attach(self, req: dict[str, Any]) -> dict[str, Any]:
        """The ``attach`` request of a later session of a shared root."""
        if req.get("op") != "attach":
            raise ValueError(f"unknown attach request {req.get('op')!r}")
        spec = req.get("spec")
        host = self.open(str(req["id"]), not req.get("resume"), None,
                         spec if isinstance(spec, dict) else None)
        try:
            self.start_host(host)
        except BaseException:
            if not host.looping:
                self.discard(host)
            raise
        return self.ready_reply(host)

    def start_host(self, host: FuseHost) -> None:
        host.serve()
        loop = threading.Thread(target=self._host_loop, args=(host,),
                                name=f"host-{host.session.id}", daemon=True)
        loop.start()
        host.looping = True

    def discard(self, host: FuseHost) -> None:
        """Shut down (idempotent) and forget a session whose host loop never started: its
        start failed, so nothing will ever set ``done`` or ``closed`` for it."""
        try:
            host.session.shutdown()
        except Exception as e:
            log.error("session %s: shutdown failed: %s", host.session.id, describe(e))
        finally:
            if getattr(host, "_server", None) is not None:
                host.close_socket()
            with self.lock:
                if host in self.hosts:
                    self.hosts.remove(host)

    def _host_loop(self, host: FuseHost) -> None:
        host.done.wait()
        try:
            host.stop()
        except Exception as e:
            log.error("session %s: shutdown failed: %s: %s", host.session.id,
                      type(e).__name__, e)
        with self.lock:
            if host in self.hosts:
                self.hosts.remove(host)

    def last_one(self, host: FuseHost) -> bool:
        """True if ``host``'s session was the last open one (the process exits)."""
        with self.lock:
            return all(h is host or h.session._handle.state != "open" for h in self.hosts)

    def ready_reply(self, host: FuseHost) -> dict[str, Any]:
        s = host.session
        return {"ok": True, "id": s.id, "root": s.root, "pid": os.getpid(),
                "socket": host.sock_path}

    def serve_attach(self, rec: SessionRecord) -> None:
        """Serve the attach socket of a shared root (recorded as ``attach`` beside its
        upper)."""
        import hashlib

        assert rec.root is not None and self.cfg.state_base is not None
        d = self._shared_dir(self.cfg.state_base, rec.root)
        key = hashlib.sha256(d.encode()).hexdigest()[:16]
        path = os.path.join(socket_dir(), f"a-{key}.sock")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        old = os.umask(0o177)
        try:
            server = _AttachServer(path, _AttachHandler)
        finally:
            os.umask(old)
        server.process = self
        threading.Thread(target=server.serve_forever, args=(0.05,), name="attach",
                         daemon=True).start()
        write_json_atomic(os.path.join(d, ATTACH_FILE), {"socket": path, "pid": os.getpid()})
        self._attach = server
        self._attach_path = path

    def stop_attach(self) -> None:
        if self._attach is None:
            return
        assert self._attach_path is not None
        self._attach.shutdown()
        self._attach.server_close()
        record = os.path.join(os.path.dirname(self.mount.upper_dir), ATTACH_FILE)
        try:
            with open(record) as f:
                if json.load(f).get("socket") == self._attach_path:
                    os.unlink(record)
        except (OSError, ValueError):
            pass
        try:
            os.unlink(self._attach_path)
        except FileNotFoundError:
            pass
        self._attach = None

    def shutdown_all(self) -> None:
        with self.lock:
            hosts = list(self.hosts)
        for h in hosts:
            if h.looping:
                h.done.set()
            else:  # never served: no loop would ever close it
                self.discard(h)
        for h in hosts:
            if h.looping:
                h.closed.wait(300)


class _NoBackend:
    """The in-process session's Workspace never opens further sessions itself."""

    name = "fuse"

    def open_new(self, *a: Any) -> Any:
        raise RuntimeError("not available inside a session process")

    open_existing = open_new


def _setup_logging(path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    from fusefs.daemon import LogFile

    handler = LogFile(path)  # survives a full disk (lines kept until there is room)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fusefs.session.fusehost")
    ap.add_argument("--spec", required=True, help="workspace spec as JSON")
    ap.add_argument("--ready-fd", type=int, required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--new", metavar="ID")
    g.add_argument("--resume", metavar="ID")
    ap.add_argument("--seed", metavar="REF")
    args = ap.parse_args(argv)
    ready_fd: int | None = args.ready_fd

    def report(data: dict[str, Any]) -> None:
        """Write the ready report once. A failure names this process (``pid``) so that
        the caller can wait until it is gone before it removes what it made."""
        nonlocal ready_fd
        if ready_fd is None:
            return
        if not data.get("ok"):
            data = dict(data, pid=os.getpid())
        try:
            os.write(ready_fd, json.dumps(data).encode() + b"\n")
        except OSError:
            pass
        os.close(ready_fd)
        ready_fd = None

    proc: SessionProcess | None = None
    try:
        proc = SessionProcess(json.loads(args.spec))
        sid = args.new or args.resume
        rec = proc.registry.load(sid)
        _setup_logging(proc.log_path(rec))
        log.info("session %s: %s (pid %d)", sid, "new" if args.new else "resume",
                 os.getpid())
        socket_dir()  # a runtime directory we cannot use fails before anything is taken
        proc.mount = mount = proc.make_mount(rec)
    except BaseException as e:
        log.error("cannot open the session: %s", describe(e))
        report(error_reply(e))
        return int(getattr(e, "exit_code", 1) or 1)
    opened: list[FuseHost] = []
    failed: list[BaseException] = []

    def opener() -> None:
        # The runtime opens the session (leases, recovery, seed). A new session's tree is
        # mounted as soon as its base is known (``mount.decided``), while the seed event is
        # journaled: the root is reported usable only when both are done.
        try:
            assert proc is not None
            opened.append(proc.open(sid, bool(args.new),
                                    Ref.parse(args.seed) if args.seed else None))
        except BaseException as e:
            from store.errors import StoreError

            from .errors import SessionError

            log.error("cannot open the session: %s: %s", type(e).__name__, e,
                      exc_info=not isinstance(e, SessionError | StoreError))
            failed.append(e)
        finally:
            mount.decided.set()

    ot = threading.Thread(target=opener, name="open", daemon=True)
    ot.start()
    mount.decided.wait()
    if failed:  # before anything was mounted (the runtime released the leases already)
        ot.join()
        report(error_reply(failed[0]))
        return int(getattr(failed[0], "exit_code", 1) or 1)

    def lifecycle() -> None:
        mount.ready.wait()
        ot.join()
        if failed:  # the session was closed again by the runtime (mount stopped)
            report(error_reply(failed[0]))
            return
        host = opened[0]
        if mount.error is not None:
            # The kernel (or fusermount3) refused the mount: the session goes, before the
            # report, so that the process exits right after it (nothing waits on it).
            try:
                assert proc is not None
                proc.discard(host)
            finally:
                report(error_reply(MountError(mount.mountpoint, mount.error,
                                                 because=mount.error_cause)))
            return
        try:
            assert proc is not None
            proc.start_host(host)
            if proc.shared:
                proc.serve_attach(rec)
        except BaseException as e:
            # Nothing may stay: shut the session down (its host loop does, if it started),
            # wait for the unmount, and only then report.
            log.error("cannot serve the control socket: %s", describe(e))
            if host.looping:
                host.done.set()
            else:
                proc.discard(host)
            mount.unmounted.wait(300)
            report(error_reply(e))
            return
        report(proc.ready_reply(host))

    t = threading.Thread(target=lifecycle, name="lifecycle", daemon=True)
    t.start()
    code = mount.run()
    t.join()
    # The mount ended (the last session left, a signal, or an unmount from outside): shut
    # every session still open down in the contract's order, then leave.
    proc.stop_attach()
    proc.shutdown_all()
    if (mount.error is not None or failed) and code == 0:
        code = int(getattr(failed[0], "exit_code", 9) or 9) if failed else 9
    log.info("session process %d exits with %d", os.getpid(), code)
    return code


if __name__ == "__main__":
    sys.exit(main())
