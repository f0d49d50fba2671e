"""ReadFile(path, offset=1, limit=2000): numbered lines of a text file (CONTRACT 5).

Output is ``cat -n`` style (line number right-aligned in six columns, a tab, the line), each
line cut at 2000 characters, with a notice giving the next offset when more lines remain.
Every read records the blake3 of the whole file in the workspace ledger.
"""

from __future__ import annotations

import os
import stat

from tools import messages as M
from tools.context import ToolContext, digest
from tools.paths import PathError, open_located
from tools.result import ToolResult, error, ok

NAME = "ReadFile"
_BINARY_PROBE = 8192     # bytes inspected for a NUL to call a file binary


def read_all(fd: int) -> bytes:
    """All bytes from an open descriptor (from its current offset)."""
    chunks: list[bytes] = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def number_lines(lines: list[str], first: int) -> str:
    """``cat -n`` rendering of ``lines`` numbered from ``first``, cutting long lines."""
    out = []
    cut = M.READ_LINE_CUT.format(chars=M.READ_LINE_CHARS)
    for i, line in enumerate(lines, first):
        if len(line) > M.READ_LINE_CHARS:
            line = line[:M.READ_LINE_CHARS] + cut
        out.append(f"{i:6d}\t{line}")
    return "\n".join(out)


def split_lines(text: str) -> list[str]:
    """Lines of ``text`` without their newline; a final newline adds no empty line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def read_file(ctx: ToolContext, path: str, offset: int = 1,
              limit: int = M.READ_DEFAULT_LIMIT) -> ToolResult:
    """Read ``limit`` lines of ``path`` from line ``offset`` (1-based)."""
    if offset < 1 or limit < 1:
        return error(NAME, M.READ_BAD_ARGS.format(offset=offset, limit=limit))
    try:
        loc, fd = open_located(ctx.root, path, os.O_RDONLY | os.O_NONBLOCK)
    except PathError as e:
        return error(NAME, e.text, kind=e.kind)
    rel = loc.rel
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return error(NAME, M.PATH_IS_DIR.format(path=rel), kind="is_dir")
        if not stat.S_ISREG(st.st_mode):
            return error(NAME, M.PATH_NOT_REGULAR.format(path=rel), kind="not_regular")
        data = read_all(fd)
    except OSError as e:
        return error(NAME, PathError.from_os(rel, e).text, kind="os")
    finally:
        os.close(fd)
        loc.close()
    ctx.record_read(rel, digest(data))
    if b"\0" in data[:_BINARY_PROBE]:
        return ok(NAME, M.READ_BINARY.format(path=rel, size=len(data)), path=rel, binary=True)
    lines = split_lines(data.decode("utf-8", errors="replace"))
    total = len(lines)
    if total == 0:
        return ok(NAME, M.READ_EMPTY.format(path=rel), path=rel, total_lines=0)
    if offset > total:
        return error(NAME, M.READ_PAST_END.format(path=rel, offset=offset, total=total),
                     kind="past_end", total_lines=total)
    last = min(total, offset + limit - 1)
    text = number_lines(lines[offset - 1:last], offset)
    if last < total:
        text += "\n" + M.READ_MORE.format(first=offset, last=last, total=total, next=last + 1)
    return ok(NAME, text, path=rel, first_line=offset, last_line=last, total_lines=total)
