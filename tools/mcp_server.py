"""The MCP server: the agent tools (and the session's optional calls) over stdio.

Serves ReadFile, WriteFile, EditFile, Glob, Grep, Bash, BashOutput and KillShell for one
binding; checkpoint, log, diff and changes when the binding provides them
(tools.binding.capabilities), and restore only when started with ``allow_restore``. With the
step log (``changes``), each WriteFile, EditFile and Bash call closes a step once it returns,
labelled with the tool and its path or command, so the journal says which paths each call
changed. Each tool's arguments, their aliases
(Claude Code's names) and descriptions, and its annotations come from tools.arguments;
an unknown or ill-typed argument is an error answer listing what the tool accepts. Each call
answers with the tool's text rendering (plus image content for an image read) and its
structured data (``ok`` and the tool's data: exit code, timed out, counts); errors are
answers flagged ``is_error``, never protocol failures. Tools run in worker threads.

State per connection (the MCP server's lifespan, entered once per client connection): one
ToolContext, so the read ledger, Bash's working directory and background commands belong
to that connection; its background commands are killed when it ends.
"""

from __future__ import annotations

import base64
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from mcp.server import Server
from mcp.server.stdio import stdio_server
from mcp.types import (
    CallToolRequestParams,
    CallToolResult,
    ImageContent,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
    ToolAnnotations,
)

from tools import arguments as A
from tools import messages as M
from tools.bash import bash_output, kill_shell, run_bash
from tools.binding import SessionBinding, capabilities
from tools.context import ToolContext
from tools.editfile import edit_file
from tools.glob import glob
from tools.grep import grep
from tools.readfile import read_file
from tools.result import ToolResult
from tools.sandbox import SandboxPolicy
from tools.writefile import write_file

_log = logging.getLogger(__name__)

TOOL_NAMES = tuple(spec.name for spec in A.TOOLS)



def _bash(ctx: ToolContext, command: str, timeout: float = M.BASH_DEFAULT_TIMEOUT_S,
          run_in_background: bool = False, description: str | None = None) -> ToolResult:
    return run_bash(ctx, command, timeout, run_in_background)


# Native tool function per tool name: (context, **native arguments) -> ToolResult.
_RUN: dict[str, Callable[..., ToolResult]] = {
    "ReadFile": read_file, "WriteFile": write_file, "EditFile": edit_file, "Glob": glob,
    "Grep": grep, "Bash": _bash, "BashOutput": bash_output, "KillShell": kill_shell,
}


# The calls that may change the tree, each closing a step labelled with this argument.
STEPPED = {"WriteFile": "path", "EditFile": "path", "Bash": "command"}


def _close_step(binding: Any, label: str) -> None:
    """Journal the step of a mutating call (``CanStep``); a failure leaves its changes to
    the next step and only a log line (the call itself succeeded or failed on its own)."""
    try:
        binding.step_done(label)
    except Exception as e:
        _log.warning("recording the step of %s failed: %s", label, e)


def answer(r: ToolResult) -> CallToolResult:
    """The MCP answer for a tool result: its text, its images, its data as structured
    content."""
    content: list[Any] = [TextContent(type="text", text=r.render())]
    for mime, data in r.images:
        content.append(ImageContent(type="image", data=base64.b64encode(data).decode(),
                                    mime_type=mime))
    return CallToolResult(content=content, structured_content={"ok": r.ok, **r.data},
                          is_error=not r.ok)


def _text_answer(text: str, is_error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=is_error)


def _session_call(call: str, fn: Callable[[], str]) -> CallToolResult:
    try:
        text = fn()
    except Exception as e:  # a failed session call is an answer the model can read
        return _text_answer(M.ERROR_PREFIX + M.SESSION_FAILED.format(call=call, reason=e),
                            is_error=True)
    return _text_answer(text)


def _as_tool(spec: A.ToolSpec) -> Tool:
    return Tool(name=spec.name, description=spec.description,
                input_schema=spec.input_schema(),
                annotations=ToolAnnotations(title=spec.title, read_only_hint=spec.read_only,
                                            destructive_hint=spec.destructive,
                                            idempotent_hint=spec.idempotent,
                                            open_world_hint=False))


def build_server(binding: SessionBinding, allow_restore: bool = False,
                 name: str = "rewindfs", sandbox: SandboxPolicy | None = None) \
        -> Server[ToolContext]:
    """A low-level MCP Server serving the tools for ``binding``, one ToolContext per
    connection; Bash confined by ``sandbox``."""
    caps = capabilities(binding)
    b: Any = binding
    session_calls: dict[str, Callable[[dict[str, Any]], str]] = {}
    if "checkpoint" in caps:
        session_calls["checkpoint"] = lambda a: b.checkpoint(a.get("label"))
    if "log" in caps:
        session_calls["log"] = lambda a: b.log()
    if "diff" in caps:
        session_calls["diff"] = lambda a: b.diff(a.get("ref_a"), a.get("ref_b"))
    if "restore" in caps and allow_restore:
        session_calls["restore"] = lambda a: (b.restore(a["ref"]) if a.get("paths") is None
                                              else b.restore(a["ref"], a["paths"]))
    if "step" in caps:
        session_calls["changes"] = lambda a: b.changes(a.get("step"))
    specs = {s.name: s for s in A.TOOLS}
    for call in session_calls:
        specs[call] = A.SESSION_TOOLS[call]
    listed = ListToolsResult(tools=[_as_tool(s) for s in specs.values()])

    @contextlib.asynccontextmanager
    async def lifespan(_: Server[ToolContext]) -> AsyncIterator[ToolContext]:
        ctx = ToolContext(binding, sandbox)
        try:
            yield ctx
        finally:
            await anyio.to_thread.run_sync(ctx.close)

    async def list_tools(rc: Any, params: PaginatedRequestParams | None) -> ListToolsResult:
        return listed

    async def call_tool(rc: Any, params: CallToolRequestParams) -> CallToolResult:
        spec = specs.get(params.name)
        if spec is None:
            return _text_answer(M.ERROR_PREFIX + M.ARG_UNKNOWN_TOOL.format(
                tool=params.name, tools=", ".join(specs)), is_error=True)
        try:
            kwargs = spec.bind(params.arguments)
        except A.ArgumentError as e:
            return _text_answer(M.ERROR_PREFIX + str(e), is_error=True)
        if spec.name in session_calls:
            fn = session_calls[spec.name]
            return await anyio.to_thread.run_sync(
                lambda: _session_call(spec.name, lambda: fn(kwargs)))
        ctx: ToolContext = rc.lifespan_context
        run = _RUN[spec.name]
        result = await anyio.to_thread.run_sync(lambda: run(ctx, **kwargs))
        if spec.name in STEPPED and "step" in caps:
            label = f"{spec.name} {kwargs.get(STEPPED[spec.name])}"[:M.STEP_LABEL_MAX]
            await anyio.to_thread.run_sync(lambda: _close_step(b, label))
        return answer(result)

    return Server(name, instructions=M.SERVER_INSTRUCTIONS, lifespan=lifespan,
                  on_list_tools=list_tools, on_call_tool=call_tool,
                  get_tool_input_schema=lambda n: specs[n].input_schema() if n in specs
                  else None)


def serve_stdio(binding: SessionBinding, allow_restore: bool = False,
                sandbox: SandboxPolicy | None = None) -> None:
    """Serve the tools for ``binding`` on stdin/stdout until the client closes."""
    server = build_server(binding, allow_restore, sandbox=sandbox)

    async def main() -> None:
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())

    anyio.run(main)
