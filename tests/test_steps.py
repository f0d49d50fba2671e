"""The step change log (issue 14.1) on real FUSE sessions, through the CLI and an MCP client.

Each step journals the paths changed since the previous step: the MCP server closes one
after every mutating tool call, ``rewindfs session step`` and ``Session.step_done`` on
demand. Read back with ``rewindfs log ID --changes``, ``rewindfs diff ID --step N`` and the
MCP tool ``changes``. Sessions are started with ``rewindfs session new`` (a mount daemon
each) in a directory outside /tmp (the Bash sandbox has its own /tmp), shut down at
teardown, and anything left mounted there is unmounted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import fusehelpers as fh
import pytest
from mcp import Client
from test_tools_session import Sessions, outside_tmp_sessions, tool_text

from fusefs.session.fallback import fuse_available

pytestmark = pytest.mark.skipif(not fuse_available(), reason="needs /dev/fuse and fusermount3")


@pytest.fixture
def sessions() -> Iterator[Sessions]:
    for s in outside_tmp_sessions():
        try:
            yield s
        finally:
            s.close()
            fh.unmount_leftovers([str(s.place)])


def new_fuse(s: Sessions, files: dict[str, str]) -> tuple[str, Path]:
    """A FUSE session (a mount daemon) seeded with ``files``."""
    seed = s.place / "seed"
    seed.mkdir()
    for name, body in files.items():
        (seed / name).write_text(body)
    out = json.loads(s.cli("session", "new", "--base", str(s.base), "--seed", str(seed),
                           "--json").stdout)
    return out["id"], Path(out["root"])


def steps(s: Sessions, sid: str) -> list[dict[str, Any]]:
    """The session's steps from ``log --changes --json``."""
    events = json.loads(s.cli("log", sid, "--changes", "--json").stdout)
    return [e for e in events if e["event"] == "WorkspaceStep"]


def paths(step: dict[str, Any]) -> dict[str, str]:
    return {c["path"]: c["status"] for c in step["changes"]}


def step(s: Sessions, sid: str, label: str | None = None) -> dict[str, Any]:
    args = ["session", "step", sid, "--json"] + (["--label", label] if label else [])
    out: dict[str, Any] = json.loads(s.cli(*args).stdout)
    return out


def test_each_mcp_tool_call_is_one_step_with_exactly_its_paths(sessions: Sessions) -> None:
    sid, root = new_fuse(sessions, {"a.txt": "alpha\n", "b.txt": "beta\n", "keep.txt": "k\n"})
    params = sessions.mcp_server(sid)
    answers: dict[str, str] = {}

    async def agent() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            names = {t.name for t in (await client.list_tools()).tools}
            assert "changes" in names
            for name in ("a.txt", "b.txt"):
                r = await client.call_tool("ReadFile", {"path": name})  # reads: no step
                assert not r.is_error, tool_text(r)
                r = await client.call_tool("EditFile", {"path": name, "old": "a\n",
                                                        "new": "A\n"})
                assert not r.is_error, tool_text(r)
            r = await client.call_tool("WriteFile", {"path": "c.txt", "content": "gamma\n"})
            assert not r.is_error, tool_text(r)
            r = await client.call_tool("Bash", {"command": "echo delta > d.txt"})
            assert not r.is_error, tool_text(r)
            answers["4"] = tool_text(await client.call_tool("changes", {"step": 4}))
            answers["all"] = tool_text(await client.call_tool("changes", {}))
            r = await client.call_tool("changes", {"step": 9})
            assert r.is_error and "has no step 9 (it has 4)" in tool_text(r), tool_text(r)

    anyio.run(agent)
    got = steps(sessions, sid)
    assert [paths(st) for st in got] == [{"a.txt": "modified"}, {"b.txt": "modified"},
                                         {"c.txt": "added"}, {"d.txt": "added"}]
    assert [st["step"] for st in got] == [1, 2, 3, 4]
    assert [st["label"] for st in got] == ["EditFile a.txt", "EditFile b.txt",
                                           "WriteFile c.txt", "Bash echo delta > d.txt"]
    for n, want in enumerate(["a.txt", "b.txt", "c.txt", "d.txt"], 1):
        d = json.loads(sessions.cli("diff", sid, "--step", str(n), "--json").stdout)
        assert [c["path"] for c in d["changes"]] == [want]
    assert sessions.cli("diff", sid, "--step", "4").stdout == "A\td.txt\n"
    assert answers["4"] == "step 4 (Bash echo delta > d.txt): 1 changed path\nadded        d.txt"
    assert answers["all"].count("\n") == 7 and "modified     a.txt" in answers["all"]
    text_log = sessions.cli("log", sid, "--changes").stdout
    assert "step 3 WriteFile c.txt" in text_log and "      A\tc.txt" in text_log
    missing = sessions.cli("diff", sid, "--step", "5", check=False)
    assert missing.returncode == 10 and "has no step 5 (it has 4)" in missing.stderr


WRITER = """
import sys
# One file per line read from stdin, written by a process no tool call knows about.
for line in sys.stdin:
    name = line.strip()
    with open(name, "w") as f:
        f.write("written in the background\\n")
    print("done", flush=True)
"""


def test_a_background_writer_is_attributed_to_the_next_step(sessions: Sessions) -> None:
    sid, root = new_fuse(sessions, {"a.txt": "a\n"})
    writer = subprocess.Popen([sys.executable, "-c", WRITER], cwd=root, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert writer.stdin is not None and writer.stdout is not None
    try:
        (root / "tool.txt").write_text("a tool's write\n")
        assert paths(step(sessions, sid, "tool")) == {"tool.txt": "added"}
        writer.stdin.write("server.log\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "done\n"
        assert step(sessions, sid)["changes"] == [
            {"path": "server.log", "kind": "file", "status": "added"}]
        writer.stdin.write("server.log\n")  # rewritten: modified, seen once
        writer.stdin.flush()
        assert writer.stdout.readline() == "done\n"
        assert paths(step(sessions, sid)) == {"server.log": "modified"}
        assert paths(step(sessions, sid)) == {}  # nothing since
    finally:
        writer.stdin.close()
        writer.wait(30)
    assert [len(st["changes"]) for st in steps(sessions, sid)] == [1, 1, 1, 0]


def test_checkpoint_and_restore_between_steps_lose_nothing(sessions: Sessions) -> None:
    sid, root = new_fuse(sessions, {"a.txt": "a\n", "b.txt": "b\n", "c.txt": "c\n"})
    (root / "a.txt").write_text("a1\n")
    first = step(sessions, sid)
    assert paths(first) == {"a.txt": "modified"}
    (root / "new.txt").write_text("n\n")
    (root / "b.txt").unlink()
    (root / "a.txt").write_text("a2\n")
    (root / "gone.txt").write_text("made and removed again: no net change\n")
    good = sessions.cli("session", "checkpoint", sid).stdout.strip()
    (root / "gone.txt").unlink()
    (root / "c.txt").write_text("c1\n")
    (root / "d").mkdir()
    (root / "d" / "f.txt").write_text("f\n")
    assert paths(step(sessions, sid)) == {"new.txt": "added", "b.txt": "removed",
                                          "a.txt": "modified", "c.txt": "modified",
                                          "d": "added", "d/f.txt": "added"}
    # A change just before a restore is the agent's (next step); what the restore itself
    # changes (d, d/f.txt and c.txt go back) is journaled as the restore only.
    (root / "late.txt").write_text("l\n")
    sessions.cli("session", "restore", sid, good)
    assert not (root / "d").exists()
    assert paths(step(sessions, sid)) == {"late.txt": "added"}
    (root / "after.txt").write_text("x\n")
    assert paths(step(sessions, sid)) == {"after.txt": "added"}
    events = [e["event"] for e in json.loads(sessions.cli("log", sid, "--json").stdout)]
    assert events == ["WorkspaceCheckpointed", "WorkspaceStep", "WorkspaceCheckpointed",
                      "WorkspaceStep", "WorkspaceCheckpointed", "WorkspaceRestored",
                      "WorkspaceStep", "WorkspaceStep"]


def test_a_resumed_session_continues_from_its_last_step(sessions: Sessions) -> None:
    sid, root = new_fuse(sessions, {"a.txt": "a\n"})
    (root / "a.txt").write_text("a1\n")
    (root / "b.txt").write_text("b\n")
    assert paths(step(sessions, sid)) == {"a.txt": "modified", "b.txt": "added"}
    (root / "c.txt").write_text("c: after the last step, before the restart\n")
    sessions.cli("session", "shutdown", sid)
    sessions.cli("session", "resume", sid)
    (root / "b.txt").write_text("b1\n")
    assert paths(step(sessions, sid)) == {"c.txt": "added", "b.txt": "modified"}


def test_a_session_without_fuse_refuses_steps_clearly(sessions: Sessions) -> None:
    sid, _root = sessions.new()
    p = sessions.cli("session", "step", sid, check=False)
    assert p.returncode == 10
    assert "keeps no step log (the no-FUSE backend" in p.stderr
    assert "Traceback" not in p.stderr


def _kill_session_process(s: Sessions, sid: str) -> None:
    """kill -9 of the session's process (its FUSE daemon too), as a crash would."""
    import os
    import signal
    import time

    from fusefs.session.control import control_path, request

    sock = control_path(str(s.store / "sessions" / sid))
    assert sock is not None
    pid = int(request(sock, {"op": "status"}, 30)["pid"])
    os.kill(pid, signal.SIGKILL)
    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"session process {pid} did not die")


def _write_synced(path: Path, text: str) -> None:
    """Write ``text`` and fsync it: only then does it survive kill -9 of the daemon
    (CONTRACT 2.5), so what the steps after a crash see is known."""
    import os

    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def test_an_acknowledged_step_survives_kill_9_of_the_session_process(
        sessions: Sessions) -> None:
    """A step's record waits for a shared barrier (group commit), but once the step is
    acknowledged it survives a crash of any process: it is in the kernel's page cache."""
    sid, root = new_fuse(sessions, {"a.txt": "a\n"})
    _write_synced(root / "a.txt", "a1\n")
    assert step(sessions, sid, "edit a")["step"] == 1
    _kill_session_process(sessions, sid)
    fh.unmount_leftovers([str(root)])
    sessions.cli("session", "resume", sid)
    got = steps(sessions, sid)
    assert [(g["step"], g["label"], paths(g)) for g in got] == \
        [(1, "edit a", {"a.txt": "modified"})]
    assert (root / "a.txt").read_text() == "a1\n"
    (root / "b.txt").write_text("b\n")
    assert paths(step(sessions, sid)) == {"b.txt": "added"}


def test_a_step_record_lost_to_a_power_loss_loses_no_change(sessions: Sessions) -> None:
    """What a power loss before the barrier does to the newest step records (simulated on
    the backend after kill -9: one record gone, the next seq's object left empty): the
    step reads as lost, the next step reports its paths with its own, and appending goes
    on over the damaged object."""
    sid, root = new_fuse(sessions, {"a.txt": "a\n", "b.txt": "b\n"})
    _write_synced(root / "a.txt", "a1\n")
    first = step(sessions, sid)
    _write_synced(root / "b.txt", "b1\n")
    second = step(sessions, sid)
    _kill_session_process(sessions, sid)
    fh.unmount_leftovers([str(root)])
    journal = sessions.store / "backend" / "journal" / sid
    (journal / f"{second['seq']:012d}.json").unlink()
    (journal / f"{second['seq'] + 1:012d}.json").write_bytes(b"")
    sessions.cli("session", "resume", sid)
    got = steps(sessions, sid)
    assert [g["step"] for g in got] == [first["step"], None]
    assert got[1].get("lost") is True and got[1]["changes"] == []
    assert "record lost" in sessions.cli("log", sid, "--changes").stdout
    (root / "c.txt").write_text("c\n")
    third = step(sessions, sid)
    assert paths(third) == {"b.txt": "modified", "c.txt": "added"}
    assert third["step"] == 3 and third["seq"] > second["seq"]
    assert paths(steps(sessions, sid)[-1]) == {"b.txt": "modified", "c.txt": "added"}


def test_hostile_names_are_quoted_in_every_listing_of_changes(sessions: Sessions) -> None:
    """A name holding a newline and a tab is one quoted line (``store.pathtext``) in the MCP
    ``changes`` and ``diff`` answers and in the CLI's step, log and path-restore text (the
    MCP answers and the restore lines printed it raw: a forged ``D keep.txt`` line)."""
    sid, root = new_fuse(sessions, {"keep.txt": "k\n"})
    evil = "x\nD\tkeep.txt"
    quoted = '"x\\nD\\tkeep.txt"'
    (root / evil).write_text("evil\n")
    assert sessions.cli("session", "step", sid).stdout.splitlines()[1:] == [f"A\t{quoted}"]
    sessions.cli("session", "step", sid, "--label", "echo a\nadded        forged.txt")
    params = sessions.mcp_server(sid)
    answers: dict[str, str] = {}

    async def agent() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            answers["changes"] = tool_text(await client.call_tool("changes", {"step": 1}))
            answers["diff"] = tool_text(await client.call_tool("diff", {}))
            answers["all"] = tool_text(await client.call_tool("changes", {}))
            answers["log"] = tool_text(await client.call_tool("log", {}))

    anyio.run(agent)
    assert answers["changes"].splitlines()[1:] == [f"added        {quoted}"]
    label = '"echo a\\nadded        forged.txt"'  # a step's label is quoted the same way
    assert answers["all"].splitlines()[-1] == f"step 2 ({label}): 0 changed paths"
    assert "forged" not in answers["log"].replace(label, "")
    assert answers["diff"].splitlines()[1:] == [f"added        {quoted}"]
    seed = json.loads(sessions.cli("log", sid, "--json").stdout)[0]["ref"]
    out = sessions.cli("session", "restore", sid, seed, "--path", evil).stdout
    assert not (root / evil).exists() and out.count("\n") == 1
    log = sessions.cli("log", sid).stdout.splitlines()
    assert log[-1].endswith(f"  {quoted} from {seed}")
    assert sum("keep.txt" in line for line in log) == 1
    assert sum("forged" in line for line in log) == 1 and f"step 2 {label}" in log[-3]
    (root / evil).write_text("again\n")
    out = sessions.cli("restore", str(root), seed, "--path", evil).stdout
    assert out.splitlines()[1:] == [f"{quoted} from {seed}"]


def test_a_background_write_goes_to_the_next_step_closed_after_it(sessions: Sessions) -> None:
    """The rule README states: a step holds what changed between the previous step's end and
    its own; read-only calls (ReadFile, Glob, Grep, BashOutput) close none, and what a
    background command writes after its Bash call returned is in a later step."""
    sid, root = new_fuse(sessions, {"a.txt": "a\n"})
    writer = subprocess.Popen([sys.executable, "-c", WRITER], cwd=root, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert writer.stdin is not None and writer.stdout is not None
    params = sessions.mcp_server(sid)

    def background(name: str) -> None:
        assert writer.stdin is not None and writer.stdout is not None
        writer.stdin.write(name + "\n")
        writer.stdin.flush()
        assert writer.stdout.readline() == "done\n"

    async def agent() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            await anyio.to_thread.run_sync(background, "server.log")
            for call, args in (("ReadFile", {"path": "a.txt"}), ("Glob", {"pattern": "*"}),
                               ("Grep", {"pattern": "a"})):
                assert not (await client.call_tool(call, args)).is_error
            assert not (await client.call_tool("WriteFile", {"path": "t.txt",
                                                             "content": "t\n"})).is_error
            r = await client.call_tool("Bash", {
                "command": "while [ ! -e go ]; do sleep 0.05; done; echo j > job.txt",
                "run_in_background": True})
            assert not r.is_error, tool_text(r)
            job = r.structured_content["bash_id"]  # type: ignore[index]
            (root / "go").write_text("")
            done = await client.call_tool("BashOutput", {"bash_id": job, "wait": 60})
            assert done.structured_content["status"] == "exited", tool_text(done)  # type: ignore
            assert not (await client.call_tool("Bash", {"command": "true"})).is_error

    try:
        anyio.run(agent)
    finally:
        writer.stdin.close()
        writer.wait(30)
    assert [paths(st) for st in steps(sessions, sid)] == [
        {"server.log": "added", "t.txt": "added"}, {}, {"go": "added", "job.txt": "added"}]
