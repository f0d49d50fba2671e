"""Bash: output cap, exit codes, timeouts that kill the whole tree, confinement, permit,
the working directory kept between calls, background commands."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tools import sandbox
from tools.bash import bash_output, kill_shell, run_bash
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.sandbox import SandboxPolicy

HAS_BWRAP = sandbox.unavailable_reason() is None
MODES = ["confined", "unconfined"] if HAS_BWRAP else ["unconfined"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "unconfined":
        monkeypatch.setenv("REWINDFS_NO_SANDBOX", "1")
    return str(request.param)


@pytest.fixture
def ws(tmp_path: Path, request: pytest.FixtureRequest) -> ToolContext:
    """A workspace; in the unconfined mode the operator allowed running without sandbox."""
    root = tmp_path / "root"
    root.mkdir()
    unconfined = "mode" in request.fixturenames and \
        request.getfixturevalue("mode") == "unconfined"
    return ToolContext(DirBinding(root, hidden=[str(tmp_path / "state")]),
                       SandboxPolicy(unsafe_no_sandbox=unconfined))


def procs_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found


def wait_gone(marker: str, bound_s: float = 20.0) -> list[int]:
    end = time.monotonic() + bound_s
    while True:
        left = procs_with(marker)
        if not left or time.monotonic() > end:
            return left


def test_output_exit_code_and_cwd(ws: ToolContext, mode: str) -> None:
    r = run_bash(ws, "echo out; echo err >&2; pwd; exit 3")
    lines = r.text.split("\n")
    assert lines[:3] == ["out", "err", ws.root.real]
    assert lines[3] == "[exit code: 3]"
    assert r.data["exit_code"] == 3 and r.ok
    if mode == "unconfined":
        assert lines[4] == ("[note: ran unconfined (no sandbox available here): the command "
                            "could read and write outside the workspace]")
    else:
        assert len(lines) == 4
    assert run_bash(ws, "true").text.split("\n")[0] == "(no output)"


def test_output_capped_head_and_tail_kept(ws: ToolContext, mode: str) -> None:
    r = run_bash(ws, "printf 'H%.0s' $(seq 20000); printf 'M%.0s' $(seq 30000); "
                     "printf 'T%.0s' $(seq 20000)")
    out = r.text.split("\n[exit code: 0]")[0]
    head, rest = out.split("\n[... ", 1)
    omitted, tail = rest.split(" bytes of output omitted ...]\n", 1)
    assert head == "H" * 16384
    assert tail == "T" * 16384
    assert int(omitted) == 70000 - 2 * 16384
    assert r.data["output_bytes"] == 70000


def test_timeout_kills_grandchild_that_called_setsid(ws: ToolContext, mode: str) -> None:
    marker = f"rewindfs-test-{uuid.uuid4().hex}"
    cmd = (f"setsid bash -c 'touch gc.started; exec -a {marker} sleep 1000' & "
           f"(exec -a {marker}-child sleep 1000)")
    r = run_bash(ws, cmd, timeout=2)
    assert r.data["timed_out"] is True and r.data["exit_code"] is None
    assert "[timed out after 2 s: the command and every process it started were killed]" \
        in r.text
    assert (Path(ws.root.path) / "gc.started").exists()
    assert wait_gone(marker) == []


def test_background_processes_end_with_the_command(ws: ToolContext, mode: str) -> None:
    marker = f"rewindfs-test-{uuid.uuid4().hex}"
    r = run_bash(ws, f"(setsid bash -c 'exec -a {marker} sleep 1000' &) ; echo started")
    assert r.text.startswith("started\n[exit code: 0]")
    assert wait_gone(marker) == []


def test_bad_arguments(ws: ToolContext) -> None:
    assert run_bash(ws, "  ").render() == "error: command must not be empty"
    assert run_bash(ws, "true", timeout=601).render() == (
        "error: timeout must be between 1 and 600 seconds (got 601)")
    assert run_bash(ws, "true", timeout=0).render() == (
        "error: timeout must be between 1 and 600 seconds (got 0)")


@pytest.mark.skipif(not HAS_BWRAP, reason="bubblewrap does not work here")
def test_confined_root_writable_rest_read_only_hidden_invisible(tmp_path: Path) -> None:
    root = tmp_path / "root"
    state = tmp_path / "state"
    inner = root / "inner-state"          # a hidden path inside the root is masked too
    for d in (root, state, inner):
        d.mkdir()
    (state / "index.db").write_text("private")
    (inner / "key").write_text("private")
    ws = ToolContext(DirBinding(root, hidden=[str(state), str(inner)]))
    r = run_bash(ws, f"echo hi > in_root.txt && cat in_root.txt; "
                     f"touch {tmp_path}/outside.txt; "      # lands in the private /tmp
                     f"touch /usr/rewindfs-test 2>/dev/null || echo ro-usr; "
                     f"ls -A {state} 2>/dev/null | wc -l; "
                     f"cat {state}/index.db 2>/dev/null || echo hidden; "
                     f"ls -A {inner} | wc -l; "
                     f"touch /tmp/scratch && echo tmp-ok")
    assert r.text.split("\n") == ["hi", "ro-usr", "0", "hidden", "0", "tmp-ok",
                                  "[exit code: 0]"]
    assert (root / "in_root.txt").read_text() == "hi\n"
    assert not (tmp_path / "outside.txt").exists()
    assert not os.path.exists("/usr/rewindfs-test")
    assert r.data["confined"] is True


class PermitBinding(DirBinding):
    """A binding whose whole-workspace permit is an exclusive lock, as a checkpoint's is."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def write_permit(self) -> Iterator[None]:
        with self.lock:
            yield

    def checkpoint(self, label: str | None = None) -> str:
        with self.lock:
            return "done-exists" if (Path(self.root) / "done").exists() else "too-early"


def test_checkpoint_requested_while_bash_runs_waits_for_it(tmp_path: Path) -> None:
    b = PermitBinding(tmp_path)
    ws = ToolContext(b)
    got: list[str] = []

    def checkpoint_when_started() -> None:
        while not (tmp_path / "started").exists():
            time.sleep(0.01)
        got.append(b.checkpoint())

    t = threading.Thread(target=checkpoint_when_started)
    t.start()
    r = run_bash(ws, "touch started; sleep 1; touch done")
    t.join(30)
    assert r.data["exit_code"] == 0
    assert got == ["done-exists"]


def test_without_a_sandbox_bash_refuses_naming_the_cause(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("REWINDFS_NO_SANDBOX", "1")
    ws = ToolContext(DirBinding(tmp_path))
    r = run_bash(ws, "touch ran")
    assert not r.ok and r.data["kind"] == "sandbox"
    assert r.render() == (
        "error: refused: no sandbox can be built here (the sandbox is disabled by "
        "REWINDFS_NO_SANDBOX=1); the operator may run `rewindfs mcp` with "
        "--unsafe-no-sandbox to allow unconfined commands")
    assert not (tmp_path / "ran").exists()
    monkeypatch.setenv("PATH", str(tmp_path))             # no bwrap on PATH
    monkeypatch.delenv("REWINDFS_NO_SANDBOX")
    assert sandbox.unavailable_reason() == "bubblewrap (bwrap) is not installed"


def test_unconfined_runs_get_the_allowlisted_environment_too(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWINDFS_NO_SANDBOX", "1")
    monkeypatch.setenv("REWINDFS_TEST_SECRET", "leaked")
    ws = ToolContext(DirBinding(tmp_path), SandboxPolicy(unsafe_no_sandbox=True))
    r = run_bash(ws, "echo \"[$REWINDFS_TEST_SECRET]\"")
    assert r.text.split("\n")[0] == "[]"
    assert r.data["confined"] is False


STALE = "import mod\nprint(mod.VALUE)\n"


def test_same_size_edit_within_a_second_never_runs_stale_bytecode(ws: ToolContext,
                                                                  mode: str) -> None:
    """Python takes a ``__pycache__`` entry as current when the source's mtime (whole
    seconds) and size match: an edit of the same size within one second would run the old
    code. The sandbox's environment keeps Python from writing bytecode."""
    root = Path(ws.root.path)
    src = root / "mod.py"
    (root / "main.py").write_text(STALE)
    src.write_text("VALUE = 1\n")
    stamp = os.stat(src).st_mtime_ns
    assert run_bash(ws, "python3 main.py").text.split("\n")[0] == "1"
    src.write_text("VALUE = 2\n")                     # same size, same second:
    os.utime(src, ns=(stamp, stamp))
    assert run_bash(ws, "python3 main.py").text.split("\n")[0] == "2"
    # What the sandbox prevents: the same two runs where bytecode is written.
    src.write_text("VALUE = 1\n")
    os.utime(src, ns=(stamp, stamp))
    env = {"PATH": os.environ["PATH"]}
    run = [sys.executable, "-c", "import runpy; runpy.run_path('main.py')"]
    first = subprocess.run(run, cwd=root, env=env, capture_output=True, text=True)
    src.write_text("VALUE = 2\n")
    os.utime(src, ns=(stamp, stamp))
    second = subprocess.run(run, cwd=root, env=env, capture_output=True, text=True)
    assert (first.stdout, second.stdout) == ("1\n", "1\n")


CG_PARENT = sandbox.pids_cgroup_parent() if HAS_BWRAP else None
COUNT_FORKS = ("python3 -c 'import os\nr, w = os.pipe()\nn = 0\n"
               "try:\n    for _ in range(200):\n        if os.fork() == 0:\n"
               "            os.close(w); os.read(r, 1); os._exit(0)\n        n += 1\n"
               "except OSError:\n    pass\nprint(n)'")


@pytest.mark.skipif(CG_PARENT is None, reason="no pids cgroup this process may create here")
@pytest.mark.parametrize("per_command", [False, True], ids=["spawner", "per-command"])
def test_pids_cgroup_bounds_a_command_and_is_removed_afterwards(
        ws: ToolContext, per_command: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways of placing a command in a pids cgroup: born there from a spawner thread
    (cgroup v1), or moved there before it runs (cgroup v2, where one process's threads
    share a cgroup)."""
    assert CG_PARENT is not None
    if per_command:
        monkeypatch.setattr(sandbox, "_threads_may_differ", lambda parent: False)
    ws = ToolContext(ws.binding, SandboxPolicy(max_processes=40))
    before = set(os.listdir(CG_PARENT))
    r = run_bash(ws, COUNT_FORKS)        # as root RLIMIT_NPROC would not bound it
    assert 0 < int(r.text.split("\n")[0]) < 40, r.text
    # Only this process's cgroups are compared: other servers on the machine (a suite
    # running beside this one) make and remove their own under the same parent.
    mine = f"rewindfs-bash-{os.getpid()}-"

    def own(prefix: str) -> set[str]:
        return {n for n in os.listdir(CG_PARENT) if n.startswith(prefix)}

    if per_command:
        assert own(mine) == {n for n in before if n.startswith(mine)}
    # Nothing is left behind when the server exits.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tools.bash import run_bash; "
            "from tools.binding import DirBinding; from tools.context import ToolContext; "
            "print(run_bash(ToolContext(DirBinding(sys.argv[2])), 'true').data['confined'])")
    child = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).parent.parent),
                              ws.root.real], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    out, err = child.communicate(timeout=120)
    assert out == "True\n", err
    assert own(f"rewindfs-bash-{child.pid}-") == set()


def test_working_directory_persists_between_calls(ws: ToolContext, mode: str) -> None:
    root = Path(ws.root.real)
    (root / "src" / "pkg").mkdir(parents=True)
    r = run_bash(ws, "cd src && pwd")
    assert r.text.split("\n")[0] == f"{root}/src" and r.data["cwd"] == "src"
    r = run_bash(ws, "pwd; cd pkg; touch here")
    assert r.text.split("\n")[0] == f"{root}/src" and r.data["cwd"] == "src/pkg"
    assert (root / "src" / "pkg" / "here").exists()
    assert run_bash(ws, "pwd").text.split("\n")[0] == f"{root}/src/pkg"
    # A failing command keeps the directory it ended in; exec and a timeout keep the old one.
    assert run_bash(ws, "cd ..; false").data["cwd"] == "src"
    assert run_bash(ws, "cd pkg; exec true").data["cwd"] == "src"
    assert run_bash(ws, "cd pkg; sleep 5", timeout=1).data["cwd"] == "src"
    # Leaving the workspace resets to the root, with a note.
    r = run_bash(ws, "cd /")
    assert ("[note: the command ended in /, outside the workspace; the next command starts "
            "in the workspace root]") in r.text
    assert run_bash(ws, "pwd").text.split("\n")[0] == str(root)
    # A directory removed meanwhile: the command runs in the root, with a note.
    run_bash(ws, "cd src/pkg")
    (root / "src" / "pkg" / "here").unlink()
    (root / "src" / "pkg").rmdir()
    r = run_bash(ws, "pwd")
    assert r.text.split("\n")[0] == str(root)
    assert "[note: the working directory src/pkg no longer exists; the command ran in the " \
        "workspace root]" in r.text


def test_each_connection_has_its_own_directory(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    a, b = ToolContext(DirBinding(tmp_path)), ToolContext(DirBinding(tmp_path))
    run_bash(a, "cd d")
    assert run_bash(b, "pwd").text.split("\n")[0] == str(tmp_path.resolve())
    assert run_bash(a, "pwd").text.split("\n")[0] == str(tmp_path.resolve() / "d")


def _sleeper(marker: str) -> str:
    """A command that lives 300 s as a process whose command line holds ``marker``."""
    return f"bash -c 'sleep 300; :' {marker}"


def _sleepers(marker: str) -> list[int]:
    """The processes :func:`_sleeper` started (not the shell or helper whose command line
    holds the marker too)."""
    found = []
    for pid in procs_with(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"bash\0-c\0sleep 300; :\0"):
                    found.append(pid)
        except OSError:
            pass
    return found


def _wait_for(cond: object, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not cond():                                   # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_background_command_output_and_exit(ws: ToolContext, mode: str) -> None:
    root = Path(ws.root.real)
    (root / "sub").mkdir()
    run_bash(ws, "cd sub")
    r = run_bash(ws, "echo first; while [ ! -e go ]; do sleep 0.02; done; echo second; "
                     "pwd; exit 3", run_in_background=True)
    assert r.ok and r.data["bash_id"] == "bash_1"
    assert r.text.startswith('started bash_1 in the background; read its output with '
                             'BashOutput(bash_id="bash_1")')
    job = ws.jobs.get("bash_1")
    assert job is not None
    _wait_for(lambda: job.total > 0)
    out = bash_output(ws, "bash_1")
    assert out.text == "first\n[still running]" and out.data["status"] == "running"
    assert bash_output(ws, "bash_1").text == "(no new output)\n[still running]"
    (root / "sub" / "go").touch()
    job.done.wait(30)
    out = bash_output(ws, "bash_1")
    assert out.text == f"second\n{root}/sub\n[exit code: 3]"
    assert (out.data["status"], out.data["exit_code"]) == ("exited", 3)
    assert kill_shell(ws, "bash_1").text == "bash_1 had already ended: [exit code: 3]"


def test_background_filter_and_unknown_ids(ws: ToolContext) -> None:
    r = run_bash(ws, "printf 'ok 1\\nbad 2\\nok 3\\n'", run_in_background=True)
    job = ws.jobs.get(r.data["bash_id"])
    assert job is not None and job.done.wait(30)
    assert bash_output(ws, job.id, filter="^ok").text == "ok 1\nok 3\n[exit code: 0]"
    assert bash_output(ws, "bash_9").render() == (
        "error: no background command 'bash_9' (known: bash_1)")
    assert kill_shell(ws, "bash_9").render() == (
        "error: no background command 'bash_9' (known: bash_1)")
    assert bash_output(ws, job.id, filter="(").render().startswith(
        "error: invalid filter '(': ")
    r = run_bash(ws, "sleep 0.3; echo late", run_in_background=True)
    out = bash_output(ws, r.data["bash_id"], wait=60)
    assert out.text == "late\n[exit code: 0]"
    assert bash_output(ws, r.data["bash_id"], wait=-1).render() == (
        "error: wait must be between 0 and 600 seconds (got -1)")


def test_kill_shell_stops_the_whole_tree(ws: ToolContext, mode: str) -> None:
    marker = f"rewindfs-bg-{uuid.uuid4().hex}"
    r = run_bash(ws, f"(setsid {_sleeper(marker)} &); {_sleeper(marker)}",
                 run_in_background=True)
    _wait_for(lambda: len(_sleepers(marker)) == 2)
    k = kill_shell(ws, r.data["bash_id"])
    assert k.text == f"stopped {r.data['bash_id']} and every process it started"
    _wait_for(lambda: not procs_with(marker))
    assert bash_output(ws, r.data["bash_id"]).data["status"] == "killed"


def test_closing_the_connection_ends_its_background_commands(ws: ToolContext) -> None:
    marker = f"rewindfs-bg-{uuid.uuid4().hex}"
    run_bash(ws, _sleeper(marker), run_in_background=True)
    _wait_for(lambda: bool(_sleepers(marker)))
    ws.close()
    _wait_for(lambda: not procs_with(marker))


def test_background_command_holds_no_write_permit(tmp_path: Path) -> None:
    b = PermitBinding(tmp_path)
    ws = ToolContext(b)
    r = run_bash(ws, "touch started; sleep 300", run_in_background=True)
    _wait_for(lambda: (tmp_path / "started").exists())
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.checkpoint(), done.set()))
    t.start()
    assert done.wait(30), "a checkpoint waited for a background command"
    t.join()
    kill_shell(ws, r.data["bash_id"])
