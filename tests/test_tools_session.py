"""The agent tools bound to a real session (tools/session_binding.py), across processes.

Every session is started with ``rewindfs session new --no-fuse`` (a detached session host)
and shut down at teardown, killed if it does not go, so no process outlives a test. The
working directory is outside /tmp on purpose: confined Bash gets a private /tmp, which would
hide a store under /tmp whatever the binding asks for.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp.client.stdio import StdioServerParameters
from session_support import stop_hosts

from fusefs.session.control import control_path, hold_write_permit, socket_dir
from fusefs.session.errors import SessionClosedError, SessionNotFoundError
from fusefs.session.journal import Journal
from store.browse import cat
from store.errors import InvalidRefError
from store.snapshot import compute_ref
from tools import sandbox
from tools.bash import run_bash
from tools.binding import PermitError
from tools.context import ToolContext
from tools.readfile import read_file
from tools.session_binding import SessionToolBinding
from tools.writefile import write_file

REPO = Path(__file__).resolve().parent.parent
CALC = "def add(a, b):\n    return a - b\n"
TEST = ("import unittest\nfrom calc import add\n\n"
        "class T(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "if __name__ == '__main__':\n    unittest.main()\n")


def tool_text(result: Any) -> str:
    """The text of an MCP tool call's answer: its content parts, joined."""
    return "".join(c.text for c in result.content)


def _outside_tmp() -> str:
    """A parent for test directories that is not under /tmp."""
    for d in ("/var/tmp", str(REPO / "agent-data")):
        if os.path.isdir(d) and os.access(d, os.W_OK) and not d.startswith("/tmp/"):
            return d
    os.makedirs(REPO / "agent-data", exist_ok=True)
    return str(REPO / "agent-data")


class Sessions:
    """Sessions of one store under ``place``, started and stopped through the CLI."""

    def __init__(self, place: Path) -> None:
        self.place = place
        self.store = place / "store"
        self.base = place / "ws"
        self.env = dict(os.environ, PYTHONPATH=str(REPO))

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(self.store),
                            *args], capture_output=True, text=True, cwd=str(self.place),
                           timeout=300, env=self.env)
        if check and p.returncode != 0:
            raise AssertionError(f"rewindfs {' '.join(args)} -> {p.returncode}: {p.stderr}")
        return p

    def mcp_server(self, sid: str, *extra: str) -> StdioServerParameters:
        """How an MCP client starts ``rewindfs mcp --session SID EXTRA...`` on this store."""
        return StdioServerParameters(
            command=sys.executable,
            args=["-m", "rewindfs", "--store", str(self.store), "mcp", "--session", sid,
                  *extra],
            cwd=str(REPO))

    def project(self, name: str = "proj") -> Path:
        """A tiny python project with a failing test."""
        d = self.place / name
        d.mkdir()
        (d / "calc.py").write_text(CALC)
        (d / "test_calc.py").write_text(TEST)
        return d

    def new(self, seed: Path | None = None, fuse: bool = False) -> tuple[str, Path]:
        args = ["session", "new", "--base", str(self.base), "--json"]
        if not fuse:
            args.append("--no-fuse")
        if seed is not None:
            args += ["--seed", str(seed)]
        out = json.loads(self.cli(*args).stdout)
        return out["id"], Path(out["root"])

    def close(self) -> None:
        stop_hosts(self.store / "sessions",
                   lambda sid: self.cli("session", "shutdown", sid, check=False))


def outside_tmp_sessions() -> Iterator[Sessions]:
    """Sessions in a fresh directory outside /tmp; every host is stopped and the directory
    removed afterwards (the body of the ``sessions`` fixtures)."""
    place = Path(tempfile.mkdtemp(prefix="rewindfs-tools-session-", dir=_outside_tmp()))
    s = Sessions(place)
    try:
        yield s
    finally:
        try:
            s.close()
        finally:
            shutil.rmtree(place, ignore_errors=True)


@pytest.fixture
def sessions() -> Iterator[Sessions]:
    yield from outside_tmp_sessions()


def test_checkpoint_requested_while_bash_runs_waits_for_it(sessions: Sessions) -> None:
    sid, root = sessions.new(sessions.project())
    binding = SessionToolBinding(sessions.store, sid)
    ctx = ToolContext(binding)
    command = ("touch started; while [ ! -e go ]; do sleep 0.02; done; "
               "echo written-last > late.txt")
    result: dict[str, object] = {}
    bash = threading.Thread(target=lambda: result.update(r=run_bash(ctx, command, 300)))
    bash.start()
    ckpt = None
    try:
        while not (root / "started").exists():
            assert bash.is_alive(), result
            time.sleep(0.01)
        # Bash holds the permit now. Ask for a checkpoint from another process, then wait
        # until it is parked: a new write permit is refused admission while a checkpoint
        # waits, so a probe that blocks proves the checkpoint is waiting for Bash.
        ckpt = subprocess.Popen([sys.executable, "-m", "rewindfs", "--store",
                                 str(sessions.store), "session", "checkpoint", sid, "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=sessions.env, cwd=str(sessions.place))
        sock = control_path(str(sessions.store / "sessions" / sid))
        assert sock is not None
        while True:
            assert ckpt.poll() is None, "the checkpoint did not wait for Bash"
            try:
                with hold_write_permit(sock, timeout_s=0.2):
                    pass
            except TimeoutError:
                break
            time.sleep(0.02)
        assert ckpt.poll() is None
        (root / "go").touch()
        out, err = ckpt.communicate(timeout=300)
        assert ckpt.returncode == 0, err
    finally:
        if not (root / "go").exists():
            (root / "go").touch()
        bash.join()
        if ckpt is not None and ckpt.poll() is None:
            ckpt.kill()
            ckpt.wait()
    r = result["r"]
    assert r.ok and r.data["exit_code"] == 0, r.render()  # type: ignore[attr-defined]
    ref = json.loads(out)["ref"]
    # The checkpoint holds everything the command wrote, its last file included.
    assert (root / "late.txt").read_text() == "written-last\n"
    assert ref == str(compute_ref(root, chunk_size=binding.store.chunk_size))
    last = Journal(binding.store, sid).events()[-1]
    assert (last.trigger, str(last.ref)) == ("manual", ref)


def test_a_dead_holder_releases_the_write_permit(sessions: Sessions) -> None:
    sid, root = sessions.new()
    sock = control_path(str(sessions.store / "sessions" / sid))
    code = ("import sys, time\n"
            "from fusefs.session.control import hold_write_permit\n"
            "with hold_write_permit(sys.argv[1]):\n"
            "    print('held', flush=True)\n"
            "    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(sock)], stdout=subprocess.PIPE,
                              text=True, env=sessions.env)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        (root / "f").write_text("x\n")
        holder.kill()
        holder.wait()
        # Killed while holding it: the socket closes, the host releases the permit.
        ref = json.loads(sessions.cli("session", "checkpoint", sid, "--json").stdout)["ref"]
        assert ref == str(compute_ref(root))
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


@pytest.mark.skipif(sandbox.unavailable_reason() is not None, reason="no sandbox here")
def test_store_state_and_other_sessions_are_hidden_from_confined_bash(
        sessions: Sessions) -> None:
    assert not str(sessions.place).startswith("/tmp/")
    other_id, other_root = sessions.new()
    (other_root / "secret.txt").write_text("other session\n")
    sid, root = sessions.new(sessions.project())
    binding = SessionToolBinding(sessions.store, sid)
    ctx = ToolContext(binding)
    state = sessions.store / "sessions" / sid
    assert (sessions.store / "index.sqlite").exists() and (state / "session.json").exists()
    r = run_bash(ctx, f"ls -A {sessions.store} 2>/dev/null | wc -l; "
                      f"cat {sessions.store}/index.sqlite 2>/dev/null || echo no-index; "
                      f"cat {state}/session.json 2>/dev/null || echo no-state; "
                      f"ls -A {socket_dir()} 2>/dev/null | wc -l; "
                      f"ls -A {sessions.base}; "
                      f"cat {other_root}/secret.txt 2>/dev/null || echo no-other; "
                      f"echo mine > mine.txt && cat mine.txt")
    assert r.ok and r.data["confined"], r.render()
    lines = r.text.split("\n")
    assert lines[:7] == ["0", "no-index", "no-state", "0", sid, "no-other", "mine"], r.text
    assert (root / "mine.txt").read_text() == "mine\n"       # the root stays writable
    assert (other_root / "secret.txt").read_text() == "other session\n"
    assert other_id in os.listdir(sessions.base)


def test_session_calls_as_text(sessions: Sessions) -> None:
    sid, root = sessions.new(sessions.project())
    binding = SessionToolBinding(sessions.store, sid)
    ctx = ToolContext(binding)
    seed = Journal(binding.store, sid).events()[0].ref
    assert binding.diff() == f"no changes from {seed} to the live workspace"

    assert read_file(ctx, "calc.py").ok
    assert write_file(ctx, "calc.py", "def add(a, b):\n    return a + b\n").ok
    assert write_file(ctx, "pkg/new.py", "x = 1\n").ok
    (root / "test_calc.py").unlink()
    text = binding.diff()
    head, *rows = text.split("\n")
    assert head == f"4 changed paths from {seed} to the live workspace:"
    assert rows == ["modified     calc.py", "added        pkg/", "added        pkg/new.py",
                    "removed      test_calc.py"]

    cp = binding.checkpoint()
    a = cp.removeprefix("checkpointed the workspace as ")
    assert a == str(compute_ref(root))
    assert binding.checkpoint("named") == (f"checkpointed the workspace as {a} "
                                           "(label 'named')")
    assert [i.label for i in binding.store.list_snapshots() if str(i.ref) == a] == ["named"]
    assert binding.diff(str(seed), a) == text.replace("the live workspace", a)

    undo = binding.restore(str(seed))
    pre = undo.split(" checkpointed as ")[1].split(" ")[0]
    assert undo == (f"restored the workspace to {seed}; the state before was checkpointed "
                    f"as {pre} (restore that ref to undo)")
    assert (root / "calc.py").read_text() == CALC and not (root / "pkg").exists()
    log = binding.log().split("\n")
    assert [line.strip().split("  ")[2:] for line in log] == [
        ["checkpoint (seed)", str(seed)], ["checkpoint (manual)", a],
        ["checkpoint (manual)", a, "'named'"],
        ["checkpoint (pre_restore)", pre],   # the same tree: each checkpoint its own label
        ["restored to", str(seed)]]
    assert pre == a
    with pytest.raises(InvalidRefError):
        binding.restore("not-a-ref")


def test_unknown_and_stopped_sessions_are_typed_errors(sessions: Sessions) -> None:
    sid, _ = sessions.new()
    binding = SessionToolBinding(sessions.store, sid)
    with pytest.raises(SessionNotFoundError):
        SessionToolBinding(sessions.store, "20000101-000000-00000000")
    sessions.cli("session", "shutdown", sid)
    with pytest.raises(SessionClosedError):
        SessionToolBinding(sessions.store, sid)
    with pytest.raises(PermitError, match=f"session {sid} is closed"):
        with binding.write_permit():
            pass
    # Tool calls on the stopped session are error answers, not exceptions.
    ctx = ToolContext(binding)
    for r in (write_file(ctx, "new.txt", "x\n"), run_bash(ctx, "touch x")):
        assert not r.ok and r.render() == (f"error: the workspace cannot be changed now: "
                                           f"session {sid} is closed")


def _wait_path(p: Path, job_done: threading.Event | None = None) -> None:
    deadline = time.monotonic() + 60
    while not p.exists():
        assert time.monotonic() < deadline, f"{p} did not appear"
        assert job_done is None or not job_done.is_set(), "the job ended early"
        time.sleep(0.02)


@pytest.mark.parametrize("fuse", [False, True], ids=["fallback", "fuse"])
def test_background_command_holds_no_permit_and_fallback_checkpoints_are_fuzzy(
        sessions: Sessions, fuse: bool) -> None:
    if fuse and not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse")
    sid, root = sessions.new(sessions.project(), fuse=fuse)
    binding = SessionToolBinding(sessions.store, sid)
    ctx = ToolContext(binding)
    try:
        r = run_bash(ctx, "echo from-the-job > job.txt; touch started; sleep 300",
                     run_in_background=True)
        assert r.ok, r.render()
        job = ctx.jobs.get(r.data["bash_id"])
        assert job is not None
        _wait_path(root / "started", job.done)
        # The checkpoint does not wait for the job (it would wait 300 s for a permit).
        ref = binding.checkpoint().removeprefix("checkpointed the workspace as ")
        last = Journal(binding.store, sid).events()[-1]
        assert str(last.ref) == ref
        assert last.consistency == ("quiescent" if fuse else "fuzzy")
        assert b"".join(cat(binding.store, ref, "job.txt")) == b"from-the-job\n"
        # Nor does a restore (it would wait the job's 300 s for a permit).
        seed = Journal(binding.store, sid).events()[0].ref
        assert binding.restore(str(seed)).startswith(f"restored the workspace to {seed}")
        assert not (root / "job.txt").exists() and job.running
    finally:
        ctx.close()
    assert job.done.is_set()
    (root / "after.txt").write_text("x\n")
    binding.checkpoint()
    assert Journal(binding.store, sid).events()[-1].consistency == "quiescent"
