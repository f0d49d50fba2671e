"""The value every tool returns: success or error, a text for a model, and structured data.

Tools never raise for bad input or file-system trouble; they return an error result whose
``text`` is one of the templates in :mod:`tools.messages`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tools import messages as M


@dataclass(frozen=True)
class ToolResult:
    """``tool``: tool name (e.g. ``"ReadFile"``); ``ok``: False for an error;
    ``text``: the message or output, without the error prefix; ``data``: structured
    extras for programs (exit code, paths, counts), JSON-serialisable; ``images``: (MIME
    type, bytes) of images the answer carries (ReadFile of an image)."""

    tool: str
    ok: bool
    text: str
    data: dict[str, Any] = field(default_factory=dict)
    images: tuple[tuple[str, bytes], ...] = ()

    def render(self) -> str:
        """The text a model sees: errors start with ``error: ``."""
        return self.text if self.ok else M.ERROR_PREFIX + self.text

    def __str__(self) -> str:
        return self.render()


def ok(tool: str, text: str, images: tuple[tuple[str, bytes], ...] = (),
       **data: Any) -> ToolResult:
    return ToolResult(tool, True, text, data, images)


def error(tool: str, text: str, **data: Any) -> ToolResult:
    return ToolResult(tool, False, text, data)
