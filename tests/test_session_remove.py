"""Session lifetime through the CLI (issue 10, point 6): ``session rm`` and ``session gc
--stopped`` delete stopped sessions and keep GC safe; resume right after kill -9; a lease
held elsewhere is refused with how long it may still be held; ``session shutdown`` of a root
that processes still use refuses and lists them unless ``--force``.

Every session runs in its own process (the FUSE mount daemon, or the no-FUSE host); teardown
kills every process naming the test directory and lazily unmounts what is left there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from session_support import REPO

from fusefs.session.fallback import fuse_available
from store.lease import Leaser
from store.objects import Store

BACKENDS = ["fuse", "fallback"] if fuse_available() else ["fallback"]


def _procs_naming(path: Path) -> list[int]:
    out = []
    needle = os.fsencode(path)
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


class Cli:
    def __init__(self, tmp: Path, backend: str) -> None:
        self.tmp = tmp
        self.store = tmp / "store"
        self.base = tmp / "ws"
        self.flags = ["--no-fuse"] if backend == "fallback" else []

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(self.store),
                            *args], capture_output=True, text=True, cwd=str(self.tmp),
                           timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
        if ok:
            assert p.returncode == 0, f"rewindfs {' '.join(args)}: {p.returncode} {p.stderr}"
        return p

    def new(self) -> tuple[str, Path]:
        out = json.loads(self.run("session", "new", "--base", str(self.base), *self.flags,
                                  "--json").stdout)
        return out["id"], Path(out["root"])

    def listed(self) -> dict[str, str]:
        rows = json.loads(self.run("session", "list", "--json").stdout)
        return {r["id"]: r["state"] for r in rows}

    def pid(self, sid: str) -> int:
        from fusefs.session.control import control_path, request

        path = control_path(str(self.store / "sessions" / sid))
        assert path is not None
        return int(request(path, {"op": "status"}, 30)["pid"])

    def state_dirs(self) -> list[str]:
        s = Store(self.store)
        try:
            return [r[0] for r in s.conn.execute("SELECT path FROM state_dirs")]
        finally:
            s.close()


@pytest.fixture(params=BACKENDS)
def cli(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cli]:
    c = Cli(tmp_path, request.param)
    try:
        yield c
    finally:
        for pid in _procs_naming(tmp_path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        fh.unmount_leftovers([str(tmp_path)])


def test_rm_deletes_a_stopped_session_and_gc_stays_safe(cli: Cli) -> None:
    a, root_a = cli.new()
    b, root_b = cli.new()
    (root_a / "only-in-a").write_bytes(os.urandom(1 << 16))
    (root_b / "kept").write_text("b's work\n")
    cli.run("session", "checkpoint", a)
    p = cli.run("session", "rm", b, ok=False)  # running: refused, nothing touched
    assert p.returncode == 10 and "shut it down first" in p.stderr, p.stderr
    assert (root_b / "kept").read_text() == "b's work\n"
    cli.run("session", "shutdown", a)
    state_a = cli.store / "sessions" / a
    if not cli.flags:  # a FUSE session's upper is listed for GC while it exists
        assert any(d.startswith(str(state_a) + "/") for d in cli.state_dirs())
    cli.run("session", "rm", a)
    assert a not in cli.listed() and cli.listed()[b] == "running"
    assert not state_a.exists() and not root_a.exists()
    assert not any(d.startswith(str(state_a)) for d in cli.state_dirs())
    assert cli.run("session", "resume", a, ok=False).returncode == 4  # gone
    # GC runs (it would fail closed on a listed state directory that is gone) and keeps
    # what the running session uses; the store verifies.
    cli.run("gc")
    assert json.loads(cli.run("verify", "--json").stdout)["ok"]
    assert (root_b / "kept").read_text() == "b's work\n"
    cli.run("session", "checkpoint", b)
    cli.run("session", "shutdown", b)
    cli.run("session", "resume", b)
    assert (root_b / "kept").read_text() == "b's work\n"
    cli.run("session", "shutdown", b)
    assert cli.run("session", "rm", "20990101-000000-deadbeef", ok=False).returncode == 4


def test_gc_stopped_removes_every_stopped_session_and_keeps_running_ones(cli: Cli) -> None:
    ids = [cli.new()[0] for _ in range(3)]
    for sid in ids[:2]:
        cli.run("session", "shutdown", sid)
    out = json.loads(cli.run("session", "gc", "--stopped", "--json").stdout)
    assert sorted(out["removed"]) == sorted(ids[:2]) and out["running"] == [ids[2]]
    assert cli.listed() == {ids[2]: "running"}
    cli.run("session", "shutdown", ids[2])
    assert json.loads(cli.run("session", "gc", "--stopped", "--json").stdout)["removed"] == \
        [ids[2]]
    assert cli.listed() == {}
    cli.run("gc")


def test_resume_right_after_kill_9(cli: Cli) -> None:
    """The default lease ttl (30 s) is not waited for: the holder is gone from this host."""
    sid, root = cli.new()
    with open(root / "unsaved", "w") as f:  # durable before the crash: fsync
        f.write("not checkpointed\n")
        f.flush()
        os.fsync(f.fileno())
    pid = cli.pid(sid)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    cli.run("session", "resume", sid)
    assert (root / "unsaved").read_text() == "not checkpointed\n"
    cli.run("session", "shutdown", sid)


def test_resume_held_by_a_process_elsewhere_says_how_long(cli: Cli) -> None:
    sid, _ = cli.new()
    cli.run("session", "shutdown", sid)
    store = Store(cli.store)
    try:
        Leaser(store).acquire(f"session/{sid}", "another-host:4242:cafe", 45)
    finally:
        store.close()
    p = cli.run("session", "resume", sid, ok=False)
    assert p.returncode == 10
    assert "another-host:4242:cafe" in p.stderr and "expires in" in p.stderr, p.stderr
    left = float(p.stderr.split("expires in ")[1].split()[0])
    assert 0 < left <= 45
    assert cli.run("session", "rm", sid, ok=False).returncode == 10  # held: not removed
    assert sid in cli.listed()


def test_shutdown_of_a_root_in_use_refuses_and_lists_the_users(cli: Cli) -> None:
    sid, root = cli.new()
    (root / "f").write_text("x\n")
    user = subprocess.Popen(["sleep", "300"], cwd=root)
    reader = open(root / "f")  # noqa: SIM115 - held open across the shutdown attempts
    try:
        p = cli.run("session", "shutdown", sid, ok=False)
        assert p.returncode == 10, p.stderr
        line = p.stderr.strip()
        assert "\n" not in line and f"{user.pid} sleep 300" in line and "--force" in line
        assert f"{os.getpid()} " in line  # this process holds a file open in it
        assert cli.listed()[sid] == "running" and (root / "f").read_text() == "x\n"
        user.kill()
        user.wait()
        reader.close()
        cli.run("session", "shutdown", sid)  # nobody left: it goes
        assert cli.listed()[sid] == "stopped"
        cli.run("session", "resume", sid)
        user = subprocess.Popen(["sleep", "300"], cwd=root)
        cli.run("session", "shutdown", sid, "--force")
        assert cli.listed()[sid] == "stopped"
        if not cli.flags:
            assert not fh.is_fuse_mounted(root)
    finally:
        reader.close()
        user.kill()
        user.wait()


def test_gc_stopped_never_removes_a_session_while_it_starts(cli: Cli) -> None:
    """A session being started (``new``, ``resume``) has a record before its process holds
    the lease; `session gc --stopped` run beside it (a harness sweeping stopped sessions
    while another starts one) removed it in that window, so the start failed with "no
    session" (exit 4)."""
    import threading

    stop = threading.Event()
    removed: list[str] = []

    def sweep() -> None:
        while not stop.is_set():
            p = cli.run("session", "gc", "--stopped", "--json", ok=False)
            if p.returncode == 0:
                removed.extend(json.loads(p.stdout)["removed"])

    sweeper = threading.Thread(target=sweep)
    sweeper.start()
    try:
        started = [cli.new()[0] for _ in range(3)]
    finally:
        stop.set()
        sweeper.join()
    assert not set(started) & set(removed)
    assert all(cli.listed().get(sid) == "running" for sid in started)
    cli.run("session", "shutdown", started[0])
    sweeper = threading.Thread(target=sweep)
    stop.clear()
    sweeper.start()
    try:  # a resume racing the sweep: either it wins and runs, or the sweep removed it
        p = cli.run("session", "resume", started[0], ok=False)
    finally:
        stop.set()
        sweeper.join()
    if p.returncode == 0:
        assert cli.listed().get(started[0]) == "running" and started[0] not in removed
    else:
        assert p.returncode == 4 and started[0] in removed, p.stderr
    for sid in started:
        if sid not in removed:
            cli.run("session", "shutdown", sid)


def test_the_users_of_a_root_are_listed_one_line_each(tmp_path: Path) -> None:
    """`session shutdown` lists the processes using a root in its one-line error; a
    command line holding a line break (python -c with two statements) broke that line."""
    from fusefs.mounts import processes_using

    user = subprocess.Popen([sys.executable, "-c", "import time\ntime.sleep(300)"],
                            cwd=tmp_path)
    try:
        deadline = time.monotonic() + 30
        # until it runs python (between fork and exec it still shows this command line)
        while not any("time.sleep" in c for _, c in processes_using(str(tmp_path))):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        [(pid, cmd)] = processes_using(str(tmp_path))
        assert pid == user.pid and "\n" not in cmd and "import time\\x0atime.sleep" in cmd
    finally:
        user.kill()
        user.wait()
