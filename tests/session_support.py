"""Helpers shared by the session tests (tests/test_session_*.py).

``BACKENDS`` lists the session backends the behavioural tests run against: the no-FUSE
fallback always, the FUSE backend when it is installed and /dev/fuse is usable, so that both
pass the same tests (CONTRACT 4.7). Child processes run small scripts against the same
store, for lease races and crashes.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fusefs.session import (
    SnapshotPolicy,
    Workspace,
    define,
    exclusive_workspace,
    session_workspaces,
    shared_workspace,
)
from fusefs.session.control import control_path, request
from fusefs.session.fallback import fuse_available
from store.lease import Leaser
from store.objects import Store
from store.ref import Ref
from store.snapshot import compute_ref

REPO = Path(__file__).resolve().parent.parent
MODES = ["per-session", "exclusive", "shared"]


def _fuse_param() -> Any:
    ok = (importlib.util.find_spec("fusefs.session.fusebackend") is not None
          and fuse_available())
    return pytest.param("fuse", marks=pytest.mark.skipif(
        not ok, reason="FUSE session backend or /dev/fuse not available"))


BACKENDS = ["fallback", _fuse_param()]


def workspace(tmp: Path, mode: str, backend: str = "fallback", *,
              policy: SnapshotPolicy | None = None, ttl: float = 30.0,
              root: Path | None = None, store: Store | None = None) -> Workspace:
    """A workspace of ``mode`` over ``tmp/store``; the root (or base) is ``tmp/ws``."""
    st = store or Store(tmp / "store")
    where = root or (tmp / "ws")
    if mode == "per-session":
        spec = session_workspaces(st, where)
    elif mode == "exclusive":
        spec = exclusive_workspace(st, where, Leaser(st))
    else:
        spec = shared_workspace(st, where)
    cfg = define(spec, policy=policy or SnapshotPolicy("manual"), backend=backend,
                 lease_ttl_s=ttl)
    return Workspace(cfg)


def ref_of(path: str | os.PathLike[str]) -> Ref:
    """The Ref a directory would snapshot to (nothing written)."""
    return compute_ref(path)


def populate(root: str | os.PathLike[str], variant: int = 0) -> None:
    """Fill ``root`` with files, nested and empty directories, a symlink, a fifo, an
    executable and a read-only directory; ``variant`` changes some of them."""
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    (r / "src" / "pkg").mkdir(parents=True, exist_ok=True)
    (r / "src" / "pkg" / "mod.py").write_text(f"x = {variant}\n")
    (r / "src" / "main.py").write_text("print('hi')\n")
    (r / "README").write_text("readme\n" * (variant + 1))
    (r / "empty").mkdir(exist_ok=True)
    link = r / "link"
    if link.is_symlink():
        link.unlink()
    link.symlink_to("src/main.py" if variant == 0 else "README")
    if not (r / "pipe").exists():
        os.mkfifo(r / "pipe")
    run = r / "run.sh"
    run.write_text("#!/bin/sh\n")
    run.chmod(0o755)
    ro = r / "ro"
    if ro.exists():
        ro.chmod(0o755)
    ro.mkdir(exist_ok=True)
    (ro / "fixed.txt").write_text(f"fixed {variant}\n")
    ro.chmod(0o555)
    if variant:
        (r / f"new{variant}").mkdir(exist_ok=True)
        (r / f"new{variant}" / "f").write_text("new\n")


def pack_count(store: Store) -> int:
    return int(store.conn.execute("SELECT COUNT(*) FROM packs").fetchone()[0])


def child(code: str, *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``code`` (dedented) in a child Python with the repository importable."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=e,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(REPO))


def stop_hosts(state: Path, shutdown: Callable[[str], object]) -> None:
    """Stop every session host that still answers under ``state`` (a store's ``sessions``
    directory): ``shutdown(session_id)`` (the CLI's ``session shutdown``, whatever it
    returns), then SIGKILL of the pid it answered with, in case it did not go."""
    for d in state.iterdir() if state.is_dir() else ():
        path = control_path(str(d))
        if path is None:
            continue
        try:
            pid = int(request(path, {"op": "status"}, 30)["pid"])
        except (OSError, ValueError, KeyError):
            continue
        shutdown(d.name)
        try:
            os.kill(pid, signal.SIGKILL)  # normally gone already
        except ProcessLookupError:
            pass


def read_line(p: subprocess.Popen[str]) -> str:
    """The child's next stdout line (fails with its stderr if it exited)."""
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.wait()
        err = p.stderr.read() if p.stderr is not None else ""
        raise AssertionError(f"child exited {p.returncode}: {err}")
    return line.strip()


def reap(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        p.kill()
    p.wait()
    for f in (p.stdin, p.stdout, p.stderr):
        if f is not None:
            f.close()


def retry(fn: Any, exc: type[BaseException], timeout_s: float = 60.0) -> Any:
    """Call ``fn`` until it stops raising ``exc`` (a lease expiring); re-raise after
    ``timeout_s``. This bounds a wait; no test asserts on how long it took."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except exc:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
