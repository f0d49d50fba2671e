"""The MCP server end to end: a client talks to ``rewindfs mcp`` over stdio."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from test_tools_session import CALC, REPO, TEST, tool_text

from tools.binding import DirBinding
from tools.mcp_server import TOOL_NAMES, build_server


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
            assert tool_text(r) == "     1\tdef add(a, b):\n     2\t    return a - b"

            r = await client.call_tool("Bash", {"command": run_tests})
            assert "FAILED" in tool_text(r) and "rc=1" in tool_text(r)

            r = await client.call_tool("EditFile", {"path": "calc.py", "old": "a - b",
                                                    "new": "a + b"})
            assert not r.is_error, tool_text(r)
            assert tool_text(r).startswith("edited calc.py: 1 replacement\n")

            r = await client.call_tool("Bash", {"command": run_tests, "timeout": 60})
            assert "OK" in tool_text(r) and "rc=0" in tool_text(r), tool_text(r)
            assert tool_text(r).endswith("[exit code: 0]")

            r = await client.call_tool("ReadFile", {"path": "calc.py"})
            assert tool_text(r) == "     1\tdef add(a, b):\n     2\t    return a + b"

            r = await client.call_tool("Grep", {"pattern": "def add",
                                                "output_mode": "content"})
            assert tool_text(r) == "calc.py:1:def add(a, b):"
            r = await client.call_tool("Glob", {"pattern": "**/*.py"})
            assert sorted(tool_text(r).split("\n")) == ["calc.py", "test_calc.py"]

            r = await client.call_tool("WriteFile", {"path": "calc.py", "content": "x"})
            assert not r.is_error                  # our own edit was recorded
            (root / "calc.py").write_text("changed behind our back\n")
            r = await client.call_tool("WriteFile", {"path": "calc.py", "content": "y"})
            assert r.is_error
            assert tool_text(r) == ("error: calc.py: changed since it was last read; read it "
                               "again with ReadFile before changing it")
            r = await client.call_tool("ReadFile", {"path": "../outside"})
            assert r.is_error and "outside the workspace root" in tool_text(r)

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
            assert tool_text(r) == "checkpointed x"
            assert tool_text(await client.call_tool("log", {})) == "1 seed"
            if allow_restore:
                r = await client.call_tool("restore", {"ref": "bad"})
                assert r.is_error
                assert tool_text(r) == "error: restore failed: no such ref"

    anyio.run(session)


def test_plain_directory_offers_only_the_workspace_tools(tmp_path: Path) -> None:
    server = build_server(DirBinding(tmp_path), allow_restore=True)

    async def session() -> None:
        async with Client(server) as client:
            names = sorted(t.name for t in (await client.list_tools()).tools)
            assert names == sorted(TOOL_NAMES)

    anyio.run(session)


# --- Claude Code's argument names, schemas, annotations, structured results (issue 11.7) --

PROJECT = {
    "calc.py": "def add(a, b):\n    return a - b\n",
    "notes.txt": "Alpha\nbeta\nALPHA again\ngamma\n",
    "win.txt": "one\r\ntwo\r\n",
    "sub/deep.py": "import os\n",
}

# (tool, native arguments, Claude Code's arguments) in call order; each pair must answer
# the same text in two identical workspaces.
CALLS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("ReadFile", {"path": "calc.py", "offset": 2, "limit": 1},
     {"file_path": "calc.py", "offset": 2, "limit": 1}),
    ("ReadFile", {"path": "win.txt"}, {"file_path": "win.txt"}),
    ("EditFile", {"path": "calc.py", "old": "a - b", "new": "a + b"},
     {"file_path": "calc.py", "old_string": "a - b", "new_string": "a + b"}),
    ("EditFile", {"path": "win.txt", "old": "one\ntwo", "new": "1\n2", "replace_all": True},
     {"file_path": "win.txt", "old_string": "one\ntwo", "new_string": "1\n2",
      "replace_all": True}),
    ("WriteFile", {"path": "new/made.txt", "content": "x\n"},
     {"file_path": "new/made.txt", "content": "x\n"}),
    ("Glob", {"pattern": "**/*.py"}, {"pattern": "**/*.py"}),
    ("Grep", {"pattern": "alpha", "ignore_case": True, "output_mode": "content",
              "line_numbers": False, "after": 1},
     {"pattern": "alpha", "-i": True, "output_mode": "content", "-n": False, "-A": 1}),
    ("Grep", {"pattern": "a", "output_mode": "content", "before": 1, "head_limit": 2,
              "offset": 1},
     {"pattern": "a", "output_mode": "content", "-B": 1, "head_limit": 2, "offset": 1}),
    ("Grep", {"pattern": "import", "type": "py", "context": 0},
     {"pattern": "import", "type": "py", "-C": 0}),
    ("Grep", {"pattern": "Alpha\nbeta", "multiline": True, "output_mode": "count"},
     {"pattern": "Alpha\nbeta", "multiline": True, "output_mode": "count"}),
    ("Bash", {"command": "cd sub && pwd | sed 's|.*/||'"},
     {"command": "cd sub && pwd | sed 's|.*/||'", "description": "enter sub"}),
    ("Bash", {"command": "ls"}, {"command": "ls", "timeout": 30}),
    ("Bash", {"command": "echo bg", "run_in_background": True},
     {"command": "echo bg", "run_in_background": True, "description": "a job"}),
    ("Bash", {"command": "true"}, {"command": "true"}),
    ("BashOutput", {"bash_id": "bash_1", "wait": 60}, {"bash_id": "bash_1", "wait": 60}),
    ("KillShell", {"shell_id": "bash_1"}, {"shell_id": "bash_1"}),
]


def _project(root: Path) -> None:
    for rel, content in PROJECT.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode())


def _stdio(tmp_path: Path, root: Path) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "rewindfs.cli", "--store", str(tmp_path / "store"), "mcp", "--root",
              str(root)], cwd=str(REPO))


def test_claude_style_arguments_answer_like_native_ones(tmp_path: Path) -> None:
    answers: dict[str, list[tuple[str, bool]]] = {}
    for variant in ("native", "claude"):
        root = tmp_path / variant
        _project(root)

        async def session(root: Path = root, variant: str = variant) -> None:
            async with Client(_stdio(tmp_path, root), read_timeout_seconds=120) as client:
                got = []
                for tool, native, claude in CALLS:
                    r = await client.call_tool(tool, native if variant == "native"
                                               else claude)
                    got.append((tool_text(r).replace(str(root), "ROOT"), bool(r.is_error)))
                answers[variant] = got

        anyio.run(session)
    assert answers["native"] == answers["claude"]
    by_call = dict(zip([f"{i}:{c[0]}" for i, c in enumerate(CALLS)], answers["native"],
                       strict=True))
    assert all(not err for _, err in answers["native"]), by_call
    assert by_call["1:ReadFile"][0] == "     1\tone\n     2\ttwo"
    assert by_call["6:Grep"][0] == ("notes.txt:Alpha\nnotes.txt-beta\nnotes.txt:ALPHA again\n"
                                    "notes.txt-gamma")
    assert by_call["9:Grep"][0] == "notes.txt:1"
    assert by_call["10:Bash"][0] == "sub\n[exit code: 0]"
    assert by_call["11:Bash"][0] == "deep.py\n[exit code: 0]"     # still in sub
    assert by_call["14:BashOutput"][0] == "bg\n[exit code: 0]"
    for variant in ("native", "claude"):
        assert (tmp_path / variant / "win.txt").read_bytes() == b"1\r\n2\r\n"


def test_unknown_and_ill_typed_arguments_are_errors(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Hello\n")
    server = build_server(DirBinding(tmp_path))

    async def session() -> None:
        async with Client(server) as client:
            r = await client.call_tool("Grep", {"pattern": "hello", "-i": True})
            assert not r.is_error and tool_text(r) == "a.txt"
            r = await client.call_tool("Grep", {"pattern": "hello", "--ignore-case": True})
            assert r.is_error and tool_text(r) == (
                "error: Grep does not take '--ignore-case'; it accepts: pattern, path, glob, "
                "type, output_mode, ignore_case, -i, line_numbers, -n, before, -B, after, "
                "-A, context, -C, multiline, head_limit, offset")
            r = await client.call_tool("ReadFile", {"path": "a.txt", "lines": 3})
            assert r.is_error and tool_text(r).startswith(
                "error: ReadFile does not take 'lines'; it accepts: path, file_path, offset, "
                "limit")
            r = await client.call_tool("Grep", {"pattern": "x", "output_mode": "lines"})
            assert r.is_error and tool_text(r) == (
                "error: output_mode must be one of files_with_matches, content, count (got "
                "'lines')")
            r = await client.call_tool("ReadFile", {"path": "a.txt", "limit": "many"})
            assert r.is_error and tool_text(r) == "error: limit must be of type integer (got str)"
            r = await client.call_tool("ReadFile", {"path": "a.txt", "limit": "5"})
            assert not r.is_error
            r = await client.call_tool("ReadFile", {"path": "a.txt", "file_path": "b.txt"})
            assert r.is_error and tool_text(r) == (
                "error: path and file_path name the same argument with different values")
            r = await client.call_tool("EditFile", {"file_path": "a.txt", "old": "x"})
            assert r.is_error and tool_text(r) == "error: EditFile needs 'new' or 'new_string'"
            r = await client.call_tool("Nope", {})
            assert r.is_error and tool_text(r).startswith("error: no tool named 'Nope'")

    anyio.run(session)


def test_schemas_descriptions_enums_and_annotations(tmp_path: Path) -> None:
    server = build_server(SessionLike(tmp_path), allow_restore=True)

    async def session() -> None:
        async with Client(server) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            for t in tools.values():
                assert t.description and t.annotations is not None, t.name
                schema = t.input_schema
                assert schema["additionalProperties"] is False, t.name
                for name, prop in schema["properties"].items():
                    assert prop.get("description"), (t.name, name)
            grep = tools["Grep"].input_schema["properties"]
            assert grep["output_mode"]["enum"] == ["files_with_matches", "content", "count"]
            assert grep["-i"]["description"].startswith("Alias of `ignore_case`.")
            assert tools["ReadFile"].input_schema["properties"]["file_path"]["type"] == "string"
            ann = {n: (t.annotations.read_only_hint, t.annotations.destructive_hint,
                       t.annotations.idempotent_hint) for n, t in tools.items()
                   if t.annotations is not None}
            assert ann["ReadFile"] == ann["Glob"] == ann["Grep"] == (True, False, True)
            assert ann["EditFile"] == (False, True, False)
            assert ann["Bash"] == (False, True, False)
            assert ann["restore"] == (False, True, False)
            assert ann["log"] == (True, False, True)

    anyio.run(session)


def test_structured_results_besides_the_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("x\ny\nx\n")
    server = build_server(DirBinding(tmp_path))

    async def session() -> None:
        async with Client(server) as client:
            r = await client.call_tool("Bash", {"command": "echo hi; exit 4"})
            sc = r.structured_content
            assert sc is not None
            assert (sc["ok"], sc["exit_code"], sc["timed_out"]) == (True, 4, False)
            r = await client.call_tool("Bash", {"command": "sleep 5", "timeout": 1})
            assert r.structured_content is not None
            assert r.structured_content["timed_out"] is True
            assert r.structured_content["exit_code"] is None
            r = await client.call_tool("Grep", {"pattern": "x", "output_mode": "count"})
            assert r.structured_content is not None
            assert (r.structured_content["total"], r.structured_content["files"]) == (1, 1)
            r = await client.call_tool("ReadFile", {"path": "a.txt"})
            assert r.structured_content is not None
            assert r.structured_content["total_lines"] == 3
            r = await client.call_tool("ReadFile", {"path": "missing"})
            assert r.is_error and r.structured_content is not None
            assert r.structured_content == {"ok": False, "kind": "not_found"}

    anyio.run(session)


def test_image_read_is_image_content(tmp_path: Path) -> None:
    import base64

    png = (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\1\0\0\0\1\x08\x06\0\0\0\x1f\x15\xc4\x89"
           b"\0\0\0\0IEND\xaeB`\x82")
    (tmp_path / "pic.png").write_bytes(png)
    server = build_server(DirBinding(tmp_path))

    async def session() -> None:
        async with Client(server) as client:
            r = await client.call_tool("ReadFile", {"file_path": "pic.png"})
            assert not r.is_error
            kinds = [c.type for c in r.content]
            assert kinds == ["text", "image"]
            img = r.content[1]
            assert img.mime_type == "image/png"             # type: ignore[union-attr]
            assert base64.b64decode(img.data) == png        # type: ignore[union-attr]

    anyio.run(session)


def _rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_read_of_a_1_gib_sparse_file_reads_only_a_prefix(tmp_path: Path) -> None:
    with open(tmp_path / "disk.img", "wb") as f:
        f.truncate(1 << 30)
    server = build_server(DirBinding(tmp_path))

    async def session() -> None:
        async with Client(server) as client:
            before = _rchar()
            r = await client.call_tool("ReadFile", {"file_path": "disk.img"})
            read = _rchar() - before
            assert not r.is_error
            assert tool_text(r) == f"disk.img: binary file ({1 << 30} bytes); not shown"
            assert r.structured_content is not None
            assert r.structured_content["kind"] == "binary"
            assert read < 4 * 1024 * 1024, read     # not the whole 1 GiB

    anyio.run(session)


def test_checkpoint_label_reaches_the_binding(tmp_path: Path) -> None:
    server = build_server(SessionLike(tmp_path))

    async def session() -> None:
        async with Client(server) as client:
            r = await client.call_tool("checkpoint", {"label": "before refactor"})
            assert tool_text(r) == "checkpointed before refactor"
            r = await client.call_tool("checkpoint", {"name": "x"})
            assert r.is_error and tool_text(r) == (
                "error: checkpoint does not take 'name'; it accepts: label")

    anyio.run(session)
