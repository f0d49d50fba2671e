"""Unified text diff of the changes between two snapshots (``diff --unified``).

Renders a ``store.diff`` change list the way ``git diff`` shows a working tree: a
``--- a/PATH`` / ``+++ b/PATH`` header and ``difflib`` hunks for text files, one line for
binary or large files, symlink targets as one-line files, mode changes as ``old mode`` /
``new mode`` lines. Content is read through any object with ``read_object(chunk id)``
(a Store, or the in-memory preview of a live mount). Reads only.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from typing import Protocol

from store.diff import Change
from store.ref import ObjectId
from store.tree import Entry, Kind

MAX_TEXT = 1 << 20  # bytes: larger files are reported, not diffed


class Reader(Protocol):
    def read_object(self, oid: ObjectId) -> bytes: ...


def _content(reader: Reader, e: Entry | None) -> bytes | None:
    """The bytes shown for ``e``: file content, symlink target; None for other kinds or
    when the file is too large."""
    if e is None:
        return b""
    if e.kind is Kind.SYMLINK:
        return e.target
    if e.kind is not Kind.FILE:
        return None
    if e.size > MAX_TEXT:
        return None
    return b"".join(reader.read_object(c) for c in e.chunks)


def _text(data: bytes) -> list[str] | None:
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode().splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def unified(reader: Reader, changes: Iterable[Change], context: int = 3) -> str:
    """The unified diff text of ``changes`` (directories only show their mode changes)."""
    out: list[str] = []
    for c in changes:
        path = os.fsdecode(c.path)
        a, b = c.old, c.new
        kinds = {e.kind for e in (a, b) if e is not None}
        if kinds == {Kind.DIR}:
            if a is not None and b is not None and a.mode != b.mode:
                out += [f"diff a/{path} b/{path}\n", f"old mode {a.mode:o}\n",
                        f"new mode {b.mode:o}\n"]
            continue
        head = [f"diff a/{path} b/{path}\n"]
        if a is None and b is not None:
            head.append(f"new {b.kind.name.lower()} mode {b.mode:o}\n")
        elif b is None and a is not None:
            head.append(f"deleted {a.kind.name.lower()} mode {a.mode:o}\n")
        elif a is not None and b is not None and a.mode != b.mode:
            head += [f"old mode {a.mode:o}\n", f"new mode {b.mode:o}\n"]
        old = _content(reader, a if a is None or a.kind is not Kind.DIR else None)
        new = _content(reader, b if b is None or b.kind is not Kind.DIR else None)
        if old == new:
            if len(head) > 1:
                out += head
            continue
        lines_a = _text(old) if old is not None else None
        lines_b = _text(new) if new is not None else None
        if lines_a is None or lines_b is None:
            out += head
            out.append(f"Binary or large files a/{path} and b/{path} differ\n")
            continue
        out += head
        for line in difflib.unified_diff(lines_a, lines_b,
                                         "/dev/null" if a is None else f"a/{path}",
                                         "/dev/null" if b is None else f"b/{path}",
                                         n=context):
            out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)
