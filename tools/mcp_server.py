"""The MCP server: the six agent tools (and the session's optional calls) over stdio.

Serves ReadFile, WriteFile, EditFile, Glob, Grep and Bash for one binding; checkpoint, log
and diff when the binding provides them (tools.binding.capabilities), and restore only when
started with ``allow_restore``. Each call answers with the tool's text rendering; errors are
answers flagged ``is_error``, never protocol failures. Tools run in worker threads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.types import CallToolResult, TextContent

from tools import messages as M
from tools.bash import run_bash
from tools.binding import SessionBinding, capabilities
from tools.context import ToolContext
from tools.editfile import edit_file
from tools.glob import glob
from tools.grep import grep
from tools.readfile import read_file
from tools.result import ToolResult
from tools.sandbox import SandboxPolicy
from tools.writefile import write_file

TOOL_NAMES = ("ReadFile", "WriteFile", "EditFile", "Glob", "Grep", "Bash")


def _answer(r: ToolResult) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=r.render())],
                          is_error=not r.ok)


def _session_call(call: str, fn: Callable[[], str]) -> CallToolResult:
    try:
        text = fn()
    except Exception as e:  # a failed session call is an answer the model can read
        return CallToolResult(content=[TextContent(type="text", text=M.ERROR_PREFIX +
                                                    M.SESSION_FAILED.format(call=call,
                                                                            reason=e))],
                              is_error=True)
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=False)


def build_server(binding: SessionBinding, allow_restore: bool = False,
                 name: str = "rewindfs", sandbox: SandboxPolicy | None = None) \
        -> MCPServer[Any]:
    """An MCPServer serving the tools for ``binding``; Bash confined by ``sandbox``."""
    ctx = ToolContext(binding, sandbox)
    server: MCPServer[Any] = MCPServer(name=name, instructions=M.SERVER_INSTRUCTIONS)

    def ReadFile(path: str, offset: int = 1, limit: int = M.READ_DEFAULT_LIMIT) \
            -> CallToolResult:
        return _answer(read_file(ctx, path, offset, limit))

    def WriteFile(path: str, content: str) -> CallToolResult:
        return _answer(write_file(ctx, path, content))

    def EditFile(path: str, old: str, new: str, replace_all: bool = False) -> CallToolResult:
        return _answer(edit_file(ctx, path, old, new, replace_all))

    def Glob(pattern: str, path: str = ".") -> CallToolResult:
        return _answer(glob(ctx, pattern, path))

    def Grep(pattern: str, path: str = ".", glob: str | None = None,
             output_mode: str = "files_with_matches", ignore_case: bool = False,
             line_numbers: bool = True, before: int = 0, after: int = 0, context: int = 0,
             head_limit: int = M.GREP_HEAD_LIMIT) -> CallToolResult:
        return _answer(grep(ctx, pattern, path, glob, output_mode, ignore_case, line_numbers,
                            before, after, context, head_limit))

    def Bash(command: str, timeout: float = M.BASH_DEFAULT_TIMEOUT_S) -> CallToolResult:
        return _answer(run_bash(ctx, command, timeout))

    for fn, text in ((ReadFile, M.DESCRIBE_READFILE), (WriteFile, M.DESCRIBE_WRITEFILE),
                     (EditFile, M.DESCRIBE_EDITFILE), (Glob, M.DESCRIBE_GLOB),
                     (Grep, M.DESCRIBE_GREP), (Bash, M.DESCRIBE_BASH)):
        server.add_tool(fn, name=fn.__name__, description=text)

    caps = capabilities(binding)
    b: Any = binding
    if "checkpoint" in caps:
        def checkpoint(label: str | None = None) -> CallToolResult:
            return _session_call("checkpoint", lambda: b.checkpoint(label))
        server.add_tool(checkpoint, name="checkpoint", description=M.DESCRIBE_CHECKPOINT)
    if "log" in caps:
        def log() -> CallToolResult:
            return _session_call("log", lambda: b.log())
        server.add_tool(log, name="log", description=M.DESCRIBE_LOG)
    if "diff" in caps:
        def diff(ref_a: str | None = None, ref_b: str | None = None) -> CallToolResult:
            return _session_call("diff", lambda: b.diff(ref_a, ref_b))
        server.add_tool(diff, name="diff", description=M.DESCRIBE_DIFF)
    if "restore" in caps and allow_restore:
        def restore(ref: str) -> CallToolResult:
            return _session_call("restore", lambda: b.restore(ref))
        server.add_tool(restore, name="restore", description=M.DESCRIBE_RESTORE)
    return server


def serve_stdio(binding: SessionBinding, allow_restore: bool = False,
                sandbox: SandboxPolicy | None = None) -> None:
    """Serve the tools for ``binding`` on stdin/stdout until the client closes."""
    build_server(binding, allow_restore, sandbox=sandbox).run("stdio")
