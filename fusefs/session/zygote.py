"""A pre-imported parent that forks FUSE session processes (issue 5: time to a usable root).

Starting a Python interpreter and importing pyfuse3, trio and the product takes ~0.4 s here,
more than the whole budget of a fork. ``Zygote`` starts one helper process per client
process, which imports everything a session process needs (and opens nothing: no store, no
SQLite connection, no thread) and then forks on request. Each request carries the session
process's argv, environment and working directory, and the ready pipe's write end as an
``SCM_RIGHTS`` descriptor; the helper double-forks so the session process is detached (its
own session, reparented away from the helper, never a zombie of it) and runs
``fusehost.main`` there.

The helper exits when its client closes the socket (the client process ended). Session
processes it started live on: they belong to their sessions, not to the client.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from typing import Any

PRELOAD = ("pyfuse3", "trio", "sqlite_utils", "fusefs.operations", "fusefs.overlay",
           "fusefs.control", "fusefs.checkpoint", "fusefs.restore", "fusefs.gate",
           "fusefs.mounts", "store.objects", "store.lease", "store.snapshot",
           "store.materialize", "store.diff", "fusefs.session.fusehost",
           "fusefs.session.fusetree", "fusefs.session.runtime", "fusefs.session.api")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _set_name(name: bytes) -> None:
    """Name this process (``ps -o comm``, ``top``) so that session processes are not
    mistaken for the helper whose command line they inherited. Best effort."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _child(req: dict[str, Any], ready_fd: int, sock: socket.socket) -> None:
    """In the forked child: detach and run the session process (never returns)."""
    code = 1
    try:
        os.setsid()
        if os.fork():
            os._exit(0)
        sock.close()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        _set_name(b"rewindfs-session")
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        from fusefs.session import fusehost

        code = fusehost.main(list(req["argv"]) + ["--ready-fd", str(ready_fd)])
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def serve(fd: int) -> None:
    """The helper's loop on the connected socket ``fd``."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    sock.sendall(b"ready\n")
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 1)
        except OSError:
            return
        if not msg:
            return
        try:
            req = json.loads(msg)
            pid = os.fork()
            if pid == 0:
                _child(req, fds[0], sock)
            os.waitpid(pid, 0)
            reply = b"ok\n"
        except Exception as e:
            reply = f"error {type(e).__name__}: {e}\n".encode()
        finally:
            for f in fds:
                os.close(f)
        sock.sendall(reply)


class Zygote:
    """The client side: one helper per client process, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = 0

    def _start(self) -> socket.socket:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"]
                                    if env.get("PYTHONPATH") else "")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "fusefs.session.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), start_new_session=True, env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        if ours.recv(64) != b"ready\n":
            ours.close()
            raise RuntimeError("the session process helper did not start")
        self._sock = ours
        self._owner = os.getpid()
        return ours

    def spawn(self, argv: list[str], ready_w: int) -> None:
        """Start ``fusehost.main(argv + ['--ready-fd', N])`` detached, with this process's
        environment and working directory, ``ready_w`` as N. Raises RuntimeError."""
        req = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        with self._lock:
            for attempt in (0, 1):
                sock = self._sock if self._owner == os.getpid() else None
                try:
                    if sock is None:
                        sock = self._start()
                    socket.send_fds(sock, [req], [ready_w])
                    reply = sock.recv(4096)
                except OSError:
                    self.close()
                    if attempt:
                        raise
                    continue
                if reply != b"ok\n":
                    raise RuntimeError(f"the session process helper failed: "
                                       f"{reply.decode(errors='replace').strip()}")
                return

    def close(self) -> None:
        if self._sock is not None and self._owner == os.getpid():
            self._sock.close()
            if self._proc is not None:
                self._proc.wait()
        self._sock = None
        self._proc = None


if __name__ == "__main__":
    serve(int(sys.argv[1]))
