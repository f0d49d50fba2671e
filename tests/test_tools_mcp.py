"""The MCP server end to end: a client talks to ``rewindfs mcp`` over stdio."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from tools.binding import DirBinding
from tools.mcp_server import TOOL_NAMES, build_server

REPO = Path(__file__).resolve().parent.parent

CALC = "def add(a, b):\n    return a - b\n"
TEST = ("import unittest\nfrom calc import add\n\n"
        "class T(unittest.TestCase):\n"
        "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
        "if __name__ == '__main__':\n    unittest.main()\n")


def text(result: Any) -> str:
    return "".join(c.text for c in result.content)


def test_end_to_end_over_stdio(tmp_path: Path) -> None:
    root = tmp_path / "proj"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    (root / "test_calc.py").write_text(TEST)
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "rewindfs.cli", "--store", str(tmp_path / "store"), "mcp",
              "--root", str(root)],
        cwd=str(REPO))
    # -B: the edit below keeps calc.py's size and may land in the second of the first run,
    # and a .pyc written by that run would then pass its (mtime seconds, size) check and
    # be reused, so the second run would test the old code.
    # (The sandbox sets PYTHONDONTWRITEBYTECODE as well; /usr/bin's python3 runs it: the
    # interpreter of this test's virtualenv is not visible inside.)
    run_tests = "python3 -B -m unittest -q test_calc 2>&1; echo rc=$?"

    async def session() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            tools = await client.list_tools()
            assert sorted(t.name for t in tools.tools) == sorted(TOOL_NAMES)

            r = await client.call_tool("ReadFile", {"path": "calc.py"})
            assert not r.is_error
            assert text(r) == "     1\tdef add(a, b):\n     2\t    return a - b"

            r = await client.call_tool("Bash", {"command": run_tests})
            assert "FAILED" in text(r) and "rc=1" in text(r)

            r = await client.call_tool("EditFile", {"path": "calc.py", "old": "a - b",
                                                    "new": "a + b"})
            assert not r.is_error, text(r)
            assert text(r).startswith("edited calc.py: 1 replacement\n")

            r = await client.call_tool("Bash", {"command": run_tests, "timeout": 60})
            assert "OK" in text(r) and "rc=0" in text(r), text(r)
            assert text(r).endswith("[exit code: 0]")

            r = await client.call_tool("ReadFile", {"path": "calc.py"})
            assert text(r) == "     1\tdef add(a, b):\n     2\t    return a + b"

            r = await client.call_tool("Grep", {"pattern": "def add",
                                                "output_mode": "content"})
            assert text(r) == "calc.py:1:def add(a, b):"
            r = await client.call_tool("Glob", {"pattern": "**/*.py"})
            assert sorted(text(r).split("\n")) == ["calc.py", "test_calc.py"]

            r = await client.call_tool("WriteFile", {"path": "calc.py", "content": "x"})
            assert not r.is_error                  # our own edit was recorded
            (root / "calc.py").write_text("changed behind our back\n")
            r = await client.call_tool("WriteFile", {"path": "calc.py", "content": "y"})
            assert r.is_error
            assert text(r) == ("error: calc.py: changed since it was last read; read it "
                               "again with ReadFile before changing it")
            r = await client.call_tool("ReadFile", {"path": "../outside"})
            assert r.is_error and "outside the workspace root" in text(r)

    anyio.run(session)
    assert (root / "calc.py").read_text() == "changed behind our back\n"


class SessionLike(DirBinding):
    """A binding with every optional session call."""

    def checkpoint(self, label: str | None = None) -> str:
        return f"checkpointed {label}"

    def log(self) -> str:
        return "1 seed"

    def diff(self, ref_a: str | None = None, ref_b: str | None = None) -> str:
        return f"diff {ref_a} {ref_b}"

    def restore(self, ref: str) -> str:
        if ref == "bad":
            raise ValueError("no such ref")
        return f"restored {ref}"


@pytest.mark.parametrize("allow_restore", [False, True])
def test_session_tools_only_when_the_binding_has_them(tmp_path: Path,
                                                      allow_restore: bool) -> None:
    server = build_server(SessionLike(tmp_path), allow_restore=allow_restore)

    async def session() -> None:
        async with Client(server) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
            extra = ["checkpoint", "diff", "log"] + (["restore"] if allow_restore else [])
            assert names == sorted(list(TOOL_NAMES) + extra)
            r = await client.call_tool("checkpoint", {"label": "x"})
            assert text(r) == "checkpointed x"
            assert text(await client.call_tool("log", {})) == "1 seed"
            if allow_restore:
                r = await client.call_tool("restore", {"ref": "bad"})
                assert r.is_error
                assert text(r) == "error: restore failed: no such ref"

    anyio.run(session)


def test_plain_directory_offers_only_the_six_tools(tmp_path: Path) -> None:
    server = build_server(DirBinding(tmp_path), allow_restore=True)

    async def session() -> None:
        async with Client(server) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
            assert names == sorted(TOOL_NAMES)

    anyio.run(session)
