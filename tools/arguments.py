"""The tools' argument contracts: names, aliases, types, enums, defaults, descriptions.

One :class:`ToolSpec` per MCP tool declares every argument once: its native name (the
keyword of the Python function), the names Claude Code's tools use for it (``file_path``,
``old_string``, ``-i``, ...) as aliases, its JSON type, enum and bounds, and a description.
From that the MCP server publishes the input schema (native and alias names alike, no other
property allowed) and :meth:`ToolSpec.bind` turns a call's arguments into native keywords,
refusing an unknown name with the list of accepted ones, a value of the wrong type, or two
names for one argument with different values. The Python functions stay the only
implementation; nothing here runs a tool.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tools import messages as M

_JSON_TYPES: dict[str, type | tuple[type, ...]] = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool,
    "array": list}  # an array of strings


class ArgumentError(ValueError):
    """Arguments a tool cannot take; the message says which and what is accepted."""


@dataclass(frozen=True)
class Arg:
    """One argument: ``name`` (native), ``type`` (a JSON type name), ``description``,
    ``aliases`` (other accepted names), ``required``, ``default`` (what an absent argument
    means; None: the function's own default), ``enum``, ``minimum``, ``maximum``."""

    name: str
    type: str
    description: str
    aliases: tuple[str, ...] = ()
    required: bool = False
    default: Any = None
    enum: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None

    def schema(self, alias_of: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "array":
            out["items"] = {"type": "string"}
        if alias_of is None:
            text = self.description
        else:
            text = M.ARG_ALIAS.format(name=alias_of) + " " + self.description
        out["description"] = text
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.default is not None:
            out["default"] = self.default
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out

    def coerce(self, given: str, value: Any) -> Any:
        """``value`` checked against the type (JSON text of a number or boolean, as some
        clients send it, is accepted); raises ArgumentError."""
        if value is None and not self.required:
            return None
        if isinstance(value, str) and self.type in ("integer", "number", "boolean"):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        want = _JSON_TYPES[self.type]
        ok = isinstance(value, want)
        if self.type in ("integer", "number") and isinstance(value, bool):
            ok = False
        if self.type == "integer" and isinstance(value, float) and value.is_integer():
            value, ok = int(value), True
        if ok and self.type == "array" and not all(isinstance(v, str) for v in value):
            ok = False
        if not ok:
            raise ArgumentError(M.ARG_BAD_TYPE.format(name=given, type=self.type,
                                                      got=type(value).__name__))
        if self.enum is not None and value not in self.enum:
            raise ArgumentError(M.ARG_BAD_ENUM.format(name=given, value=value,
                                                      allowed=", ".join(self.enum)))
        return value


@dataclass(frozen=True)
class ToolSpec:
    """An MCP tool: ``name``, ``description``, ``args``, and its MCP annotations
    (``read_only``, ``destructive``, ``idempotent``; ``open_world`` False: the tools act
    on the workspace only)."""

    name: str
    description: str
    args: tuple[Arg, ...]
    read_only: bool
    destructive: bool
    idempotent: bool
    title: str | None = None

    def input_schema(self) -> dict[str, Any]:
        """The JSON Schema of the arguments: every native and alias name, nothing else."""
        props: dict[str, Any] = {}
        required = []
        for a in self.args:
            props[a.name] = a.schema()
            for alias in a.aliases:
                props[alias] = a.schema(alias_of=a.name)
            if a.required and not a.aliases:
                required.append(a.name)
        out: dict[str, Any] = {"type": "object", "properties": props,
                               "additionalProperties": False}
        if required:
            out["required"] = required
        return out

    def accepted(self) -> list[str]:
        names = []
        for a in self.args:
            names.append(a.name)
            names.extend(a.aliases)
        return names

    def bind(self, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
        """Native keyword arguments for a call with ``arguments``; raises ArgumentError for
        an unknown name (listing the accepted ones), a wrong type or enum value, a missing
        required argument, or one argument given twice with different values."""
        given = dict(arguments or {})
        by_name: dict[str, Arg] = {}
        for a in self.args:
            by_name[a.name] = a
            for alias in a.aliases:
                by_name[alias] = a
        unknown = sorted(k for k in given if k not in by_name)
        if unknown:
            raise ArgumentError(M.ARG_UNKNOWN.format(
                tool=self.name, names=", ".join(repr(k) for k in unknown),
                accepted=", ".join(self.accepted())))
        out: dict[str, Any] = {}
        source: dict[str, str] = {}
        for key, value in given.items():
            a = by_name[key]
            v = a.coerce(key, value)
            if v is None:
                continue
            if a.name in out and out[a.name] != v:
                raise ArgumentError(M.ARG_TWICE.format(first=source[a.name], second=key))
            out[a.name] = v
            source[a.name] = key
        for a in self.args:
            if a.required and a.name not in out:
                names = " or ".join(repr(n) for n in (a.name, *a.aliases))
                raise ArgumentError(M.ARG_MISSING.format(tool=self.name, names=names))
        return out


# --- the tools ----------------------------------------------------------------------------

_PATH_DESC = ("Path of the file, relative to the workspace root (an absolute path must lie "
              "inside the root; '~' is not expanded).")

READFILE = ToolSpec("ReadFile", M.DESCRIBE_READFILE, (
    Arg("path", "string", _PATH_DESC, ("file_path",), required=True),
    Arg("offset", "integer", "First line to show, 1-based.", default=1, minimum=1),
    Arg("limit", "integer", "Most lines to show.", default=M.READ_DEFAULT_LIMIT, minimum=1),
), read_only=True, destructive=False, idempotent=True)

WRITEFILE = ToolSpec("WriteFile", M.DESCRIBE_WRITEFILE, (
    Arg("path", "string", _PATH_DESC, ("file_path",), required=True),
    Arg("content", "string", "The whole new content of the file (UTF-8).", required=True),
), read_only=False, destructive=True, idempotent=True)

EDITFILE = ToolSpec("EditFile", M.DESCRIBE_EDITFILE, (
    Arg("path", "string", _PATH_DESC, ("file_path",), required=True),
    Arg("old", "string", "The exact text to replace (not empty).", ("old_string",),
        required=True),
    Arg("new", "string", "The text to put in its place (different from old).",
        ("new_string",), required=True),
    Arg("replace_all", "boolean", "Replace every occurrence, not just one.", default=False),
), read_only=False, destructive=True, idempotent=False)

GLOB = ToolSpec("Glob", M.DESCRIBE_GLOB, (
    Arg("pattern", "string", "The glob, e.g. '**/*.py' or 'src/*.{c,h}'.", required=True),
    Arg("path", "string", "Directory to search under, relative to the workspace root.",
        default="."),
    Arg("include_ignored", "boolean", "Also list files that .gitignore/.ignore exclude.",
        default=False),
), read_only=True, destructive=False, idempotent=True)

GREP = ToolSpec("Grep", M.DESCRIBE_GREP, (
    Arg("pattern", "string", "Regular expression (ripgrep syntax; look-around allowed).",
        required=True),
    Arg("path", "string", "File or directory to search, relative to the workspace root.",
        default="."),
    Arg("glob", "string", "Only files matching this glob (ripgrep -g), e.g. '*.py' or "
        "'!tests/**'."),
    Arg("type", "string", "Only files of this ripgrep type (rg --type), e.g. 'py', 'js', "
        "'rust'."),
    Arg("output_mode", "string", "What to show: matching files, matching lines, or counts.",
        default="files_with_matches", enum=("files_with_matches", "content", "count")),
    Arg("ignore_case", "boolean", "Case-insensitive search.", ("-i",), default=False),
    Arg("line_numbers", "boolean", "Show line numbers (content mode).", ("-n",),
        default=True),
    Arg("before", "integer", "Lines of context before each match (content mode).", ("-B",),
        minimum=0),
    Arg("after", "integer", "Lines of context after each match (content mode).", ("-A",),
        minimum=0),
    Arg("context", "integer", "Lines of context before and after each match (content "
        "mode).", ("-C",), minimum=0),
    Arg("multiline", "boolean", "Let matches span lines ('.' matches a newline too).",
        default=False),
    Arg("head_limit", "integer", "Most output lines (entries in files/count modes).",
        default=M.GREP_HEAD_LIMIT, minimum=1),
    Arg("offset", "integer", "Output lines (entries) to skip before head_limit applies.",
        default=0, minimum=0),
), read_only=True, destructive=False, idempotent=True)

BASH = ToolSpec("Bash", M.DESCRIBE_BASH, (
    Arg("command", "string", "The bash command line.", required=True),
    Arg("timeout", "number", "Seconds before the command is killed (foreground only; note: "
        "seconds, not milliseconds).", default=M.BASH_DEFAULT_TIMEOUT_S, minimum=1,
        maximum=M.BASH_MAX_TIMEOUT_S),
    Arg("run_in_background", "boolean", "Start the command and answer at once with its id; "
        "read its output with BashOutput, stop it with KillShell.", default=False),
    Arg("description", "string", "A few words saying what the command does (shown to "
        "people; not used to run it)."),
), read_only=False, destructive=True, idempotent=False)

BASH_OUTPUT = ToolSpec("BashOutput", M.DESCRIBE_BASH_OUTPUT, (
    Arg("bash_id", "string", "Id of the background command (from Bash).", ("shell_id",),
        required=True),
    Arg("filter", "string", "Only show the new output lines matching this regular "
        "expression (the others are consumed)."),
    Arg("wait", "number", "Seconds to wait for the command to end before answering "
        "(default 0: answer at once).", default=0, minimum=0, maximum=M.BASH_MAX_TIMEOUT_S),
), read_only=True, destructive=False, idempotent=False)

KILL_SHELL = ToolSpec("KillShell", M.DESCRIBE_KILL_SHELL, (
    Arg("shell_id", "string", "Id of the background command (from Bash).", ("bash_id",),
        required=True),
), read_only=False, destructive=True, idempotent=True)

CHECKPOINT = ToolSpec("checkpoint", M.DESCRIBE_CHECKPOINT, (
    Arg("label", "string", "A label kept with the checkpoint in the snapshot list and "
        "shown by log."),
), read_only=False, destructive=False, idempotent=True)

LOG = ToolSpec("log", M.DESCRIBE_LOG, (), read_only=True, destructive=False,
               idempotent=True)

DIFF = ToolSpec("diff", M.DESCRIBE_DIFF, (
    Arg("ref_a", "string", "The older ref (default: the last checkpoint or restore). " +
        M.REF_FORMS),
    Arg("ref_b", "string", "The newer ref (default: the live workspace). " + M.REF_FORMS),
), read_only=True, destructive=False, idempotent=True)

RESTORE = ToolSpec("restore", M.DESCRIBE_RESTORE, (
    Arg("ref", "string", "The ref to restore. " + M.REF_FORMS, required=True),
    Arg("paths", "array", "Restore only these paths (relative to the workspace root; each "
        "becomes what the ref holds there, or is removed where it holds nothing); the rest "
        "stays as it is."),
), read_only=False, destructive=True, idempotent=False)

CHANGES = ToolSpec("changes", M.DESCRIBE_CHANGES, (
    Arg("step", "integer", "One step's number (default: the recent steps).", minimum=1),
), read_only=True, destructive=False, idempotent=True)

TOOLS = (READFILE, WRITEFILE, EDITFILE, GLOB, GREP, BASH, BASH_OUTPUT, KILL_SHELL)
SESSION_TOOLS = {"checkpoint": CHECKPOINT, "log": LOG, "diff": DIFF, "restore": RESTORE,
                 "changes": CHANGES}
