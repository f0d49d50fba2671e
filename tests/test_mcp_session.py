"""``rewindfs mcp --session ID`` end to end: an MCP client (the ``mcp`` library, over stdio)
drives the agent tools on a real session started with ``rewindfs session new --seed DIR``.

Sessions are shut down at teardown (see test_tools_session.Sessions); the MCP server exits
when its client closes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from mcp import Client
from test_tools_session import CALC, Sessions, outside_tmp_sessions, tool_text

from fusefs.session.journal import Journal
from store.objects import Store
from tools.mcp_server import TOOL_NAMES

FIXED = "def add(a, b):\n    return a + b\n"


@pytest.fixture
def sessions() -> Iterator[Sessions]:
    yield from outside_tmp_sessions()


def test_agent_session_read_edit_test_checkpoint_break_restore(sessions: Sessions) -> None:
    sid, root = sessions.new(sessions.project())
    # -B: no __pycache__, so the diff shows only what the agent changed.
    run_tests = "python3 -B -m unittest -q test_calc 2>&1; echo rc=$?"
    seen: dict[str, str] = {}

    async def agent() -> None:
        async with Client(sessions.mcp_server(sid, "--allow-restore"),
                          read_timeout_seconds=120) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
            assert names == sorted([*TOOL_NAMES, "changes", "checkpoint", "diff", "log", "restore"])

            r = await client.call_tool("ReadFile", {"path": "calc.py"})
            assert tool_text(r) == "     1\tdef add(a, b):\n     2\t    return a - b"
            r = await client.call_tool("Bash", {"command": run_tests})
            assert "FAILED" in tool_text(r) and "rc=1" in tool_text(r), tool_text(r)

            r = await client.call_tool("EditFile", {"path": "calc.py", "old": "a - b",
                                                    "new": "a + b"})
            assert not r.is_error, tool_text(r)
            r = await client.call_tool("Bash", {"command": run_tests})
            assert "OK" in tool_text(r) and "rc=0" in tool_text(r), tool_text(r)

            r = await client.call_tool("checkpoint", {})
            assert not r.is_error, tool_text(r)
            good = tool_text(r).removeprefix("checkpointed the workspace as ")
            seen["good"] = good

            # Break the file, see the tests fail and the change in the diff.
            r = await client.call_tool("WriteFile", {"path": "calc.py",
                                                     "content": "def add(a, b):\n    return 0\n"})
            assert not r.is_error, tool_text(r)
            r = await client.call_tool("Bash", {"command": run_tests})
            assert "FAILED" in tool_text(r) and "rc=1" in tool_text(r), tool_text(r)
            r = await client.call_tool("diff", {})
            assert tool_text(r).split("\n")[1:] == ["modified     calc.py"], tool_text(r)

            r = await client.call_tool("restore", {"ref": good})
            assert not r.is_error, tool_text(r)
            assert tool_text(r).startswith(f"restored the workspace to {good}; ")

            r = await client.call_tool("ReadFile", {"path": "calc.py"})
            assert tool_text(r) == "     1\tdef add(a, b):\n     2\t    return a + b"
            r = await client.call_tool("Bash", {"command": run_tests})
            assert "OK" in tool_text(r) and "rc=0" in tool_text(r), tool_text(r)

            r = await client.call_tool("log", {})
            triggers = [line.strip().split("  ")[2] for line in tool_text(r).split("\n")]
            assert triggers == ["checkpoint (seed)", "checkpoint (manual)",
                                "checkpoint (pre_restore)", "restored to"]
            r = await client.call_tool("restore", {"ref": "v1:nonsense"})
            assert r.is_error and tool_text(r).startswith("error: restore failed: ")

    anyio.run(agent)
    assert (root / "calc.py").read_text() == FIXED
    events = Journal(Store(sessions.store), sid).events()
    assert [(e.event, str(e.ref)) for e in events][-1] == ("WorkspaceRestored", seen["good"])


def test_restore_is_offered_only_with_allow_restore(sessions: Sessions) -> None:
    sid, root = sessions.new()

    async def agent() -> None:
        async with Client(sessions.mcp_server(sid), read_timeout_seconds=120) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
            assert names == sorted([*TOOL_NAMES, "changes", "checkpoint", "diff", "log"])
            r = await client.call_tool("WriteFile", {"path": "notes.txt", "content": "hi\n"})
            assert not r.is_error, tool_text(r)
            r = await client.call_tool("checkpoint", {})
            assert tool_text(r).startswith("checkpointed the workspace as ")
            r = await client.call_tool("changes", {})  # a session without FUSE: no steps
            assert not r.is_error
            assert tool_text(r) == "no steps recorded yet (a session without FUSE records none)"

    anyio.run(agent)
    assert (root / "notes.txt").read_text() == "hi\n"


def test_unknown_session_fails_to_start(sessions: Sessions) -> None:
    p = sessions.cli("mcp", "--session", "20000101-000000-00000000", check=False)
    assert p.returncode != 0
    assert "no session '20000101-000000-00000000'" in p.stderr
    assert "Traceback" not in p.stderr
    missing = sessions.place / "no-store"
    p = sessions.cli("--store", str(missing), "mcp", "--session", "x", check=False)
    assert p.returncode != 0 and not missing.exists()


def test_mcp_restore_of_one_path(sessions: Sessions) -> None:
    sid, root = sessions.new(sessions.project())
    original = (root / "calc.py").read_text()
    seed = str(Journal(Store(sessions.store), sid).events()[0].ref)
    answers: list[str] = []

    async def agent() -> None:
        async with Client(sessions.mcp_server(sid, "--allow-restore"),
                          read_timeout_seconds=120) as client:
            r = await client.call_tool("ReadFile", {"path": "calc.py"})  # before writing it
            assert not r.is_error, tool_text(r)
            for path, content in (("calc.py", "broken\n"), ("notes.txt", "kept\n")):
                r = await client.call_tool("WriteFile", {"path": path, "content": content})
                assert not r.is_error, tool_text(r)
            r = await client.call_tool("restore", {"ref": seed, "paths": ["calc.py"]})
            assert not r.is_error, tool_text(r)
            answers.append(tool_text(r))
            r = await client.call_tool("restore", {"ref": seed, "paths": ["../etc"]})
            assert r.is_error and "path_escape" in tool_text(r), tool_text(r)

    anyio.run(agent)
    assert answers[0].startswith(f"restored the workspace to calc.py from {seed}; ")
    assert (root / "calc.py").read_text() == original
    assert (root / "notes.txt").read_text() == "kept\n"
    last = Journal(Store(sessions.store), sid).events()[-1]
    assert last.event == "WorkspaceRestored" and str(last.ref) != seed


def test_mcp_refs_as_typed_and_path_restores_the_policy_covers(sessions: Sessions) -> None:
    """The diff and restore tools take every form of Ref a person types (@label, @-N, a
    prefix), scoped to the session; a path restore that would change a hidden or protected
    path (the path itself, or anything below it in the live tree or in the Ref) is refused
    as not found or protected, and changes nothing."""
    seed = sessions.project()
    (seed / "secrets").mkdir()
    (seed / "secrets" / "prod.key").write_text("prod\n")
    (seed / ".env").write_text("API_KEY=1\n")
    out = sessions.cli("session", "new", "--no-fuse", "--base", str(sessions.base), "--seed",
                       str(seed), "--hide", ".env", "--protect", "secrets/**", "--json")
    sid, root = json.loads(out.stdout)["id"], Path(json.loads(out.stdout)["root"])
    answers: dict[str, str] = {}

    async def agent() -> None:
        async with Client(sessions.mcp_server(sid, "--allow-restore"),
                          read_timeout_seconds=120) as client:
            r = await client.call_tool("checkpoint", {"label": "good"})
            assert not r.is_error, tool_text(r)
            good = tool_text(r).split(" as ")[1].split(" ")[0]
            # The user changes what the agent may not see or change.
            (root / ".env").write_text("API_KEY=2\n")
            (root / "secrets" / "prod.key").write_text("rotated\n")
            r = await client.call_tool("ReadFile", {"path": "calc.py"})
            assert not r.is_error, tool_text(r)
            r = await client.call_tool("WriteFile", {"path": "calc.py", "content": "broken\n"})
            assert not r.is_error, tool_text(r)
            r = await client.call_tool("diff", {"ref_a": "@good"})
            assert not r.is_error and "modified     calc.py" in tool_text(r), tool_text(r)
            r = await client.call_tool("diff", {"ref_a": good[len("v1:blake3:"):][:8],
                                                "ref_b": "@-1"})
            assert not r.is_error and tool_text(r).startswith("no changes"), tool_text(r)
            for paths, refused in (([".env"], ".env: no such file or directory"),
                                   (["secrets"], "secrets: permission denied (EACCES)"),
                                   (["calc.py", "secrets/prod.key"],
                                    "secrets/prod.key: permission denied (EACCES)")):
                r = await client.call_tool("restore", {"ref": "@good", "paths": paths})
                answers[paths[-1]] = tool_text(r)
                assert r.is_error and refused in tool_text(r), tool_text(r)
            r = await client.call_tool("restore", {"ref": "@nolabel", "paths": ["calc.py"]})
            assert r.is_error and "no snapshot labelled 'nolabel'" in tool_text(r), tool_text(r)
            r = await client.call_tool("restore", {"ref": "@-1", "paths": ["calc.py"]})
            assert not r.is_error, tool_text(r)
            answers["calc.py"] = tool_text(r)

    anyio.run(agent)
    assert "API_KEY" not in "".join(answers.values())
    assert (root / "calc.py").read_text() == CALC
    assert (root / ".env").read_text() == "API_KEY=2\n"
    assert (root / "secrets" / "prod.key").read_text() == "rotated\n"
    restores = [e for e in Journal(Store(sessions.store), sid).events()
                if e.event == "WorkspaceRestored"]
    assert len(restores) == 1
