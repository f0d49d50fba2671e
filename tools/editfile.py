"""EditFile(path, old, new, replace_all=False): exact substring replacement (CONTRACT 5).

The file must have been read (its ledger digest must still match); ``old`` must occur
exactly once unless ``replace_all``. Zero matches answers with the lines most like the first
line of ``old``; several answers with their line numbers. The answer shows a short unified
diff. In a file whose line breaks are CRLF, ``old`` and ``new`` written with LF breaks
are taken with CRLF ones, so the file keeps its endings. The file is replaced as
tools.writefile.replace_existing does (atomically, or in place for several hard links;
mode, owner and extended attributes kept).
"""

from __future__ import annotations

import difflib

from tools import messages as M
from tools.binding import PermitError
from tools.context import Seen, ToolContext
from tools.paths import PathError, locate
from tools.result import ToolResult, error, ok
from tools.writefile import (
    Refusal,
    change_failed,
    check_fresh,
    read_current,
    replace_existing,
    to_crlf,
    uses_crlf,
)

NAME = "EditFile"
_CLOSEST = 3            # lines shown when ``old`` is not found
_CLOSE_CUTOFF = 0.5     # minimum similarity ratio for a line to be shown


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _occurrences(text: str, old: str) -> list[int]:
    """Start indexes of non-overlapping occurrences of ``old`` (as str.replace counts)."""
    found = []
    i = text.find(old)
    while i >= 0:
        found.append(i)
        i = text.find(old, i + len(old))
    return found


def closest_lines(text: str, old: str) -> str:
    """The lines of ``text`` most similar to the first non-blank line of ``old``."""
    probe = next((ln.strip() for ln in old.split("\n") if ln.strip()), "")
    if not probe:
        return ""
    lines = text.split("\n")
    scored = []
    for number, line in enumerate(lines, 1):
        s = line.strip()
        if not s:
            continue
        m = difflib.SequenceMatcher(None, probe, s, autojunk=False)
        if m.real_quick_ratio() < _CLOSE_CUTOFF or m.quick_ratio() < _CLOSE_CUTOFF:
            continue
        r = m.ratio()
        if r >= _CLOSE_CUTOFF:
            scored.append((-r, number, line))
    scored.sort()
    best = sorted(scored[:_CLOSEST], key=lambda t: t[1])
    return "\n".join(M.EDIT_CLOSEST_LINE.format(number=n, text=ln[:M.READ_LINE_CHARS])
                     for _, n, ln in best)


def short_diff(rel: str, before: str, after: str) -> str:
    """A unified diff with one line of context, cut at EDIT_DIFF_MAX_LINES lines."""
    lines = list(difflib.unified_diff(before.splitlines(), after.splitlines(),
                                      f"a/{rel}", f"b/{rel}", n=1, lineterm=""))
    if len(lines) > M.EDIT_DIFF_MAX_LINES:
        omitted = len(lines) - M.EDIT_DIFF_MAX_LINES
        lines = lines[:M.EDIT_DIFF_MAX_LINES] + [M.EDIT_DIFF_CUT.format(omitted=omitted)]
    return "\n".join(lines)


def edit_file(ctx: ToolContext, path: str, old: str, new: str,
              replace_all: bool = False) -> ToolResult:
    """Replace ``old`` by ``new`` in ``path``."""
    if old == "":
        return error(NAME, M.EDIT_EMPTY_OLD, kind="empty_old")
    if old == new:
        return error(NAME, M.EDIT_SAME, kind="same")
    try:
        with ctx.binding.write_permit():
            with locate(ctx.root, path, write=True) as loc:
                if loc.st is None:
                    raise PathError("not_found", loc.rel)
                rel = loc.rel
                data, st = read_current(loc)
                check_fresh(ctx, rel, data, st)
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    raise Refusal("not_text", M.EDIT_NOT_TEXT.format(path=rel)) from None
                where: list[int] = []
                if uses_crlf(data):
                    where = _occurrences(text, to_crlf(old))
                    if where:
                        old, new = to_crlf(old), to_crlf(new)
                if not where:
                    where = _occurrences(text, old)
                if not where:
                    closest = closest_lines(text, old)
                    if closest:
                        msg = M.EDIT_NO_MATCH.format(path=rel, closest=closest)
                    else:
                        msg = M.EDIT_NO_MATCH_NONE.format(path=rel)
                    raise Refusal("no_match", msg)
                if len(where) > 1 and not replace_all:
                    listed = where[:M.EDIT_LINES_LISTED]
                    numbers = ", ".join(str(_line_of(text, i)) for i in listed)
                    if len(where) > len(listed):
                        numbers += M.EDIT_LINES_MORE.format(more=len(where) - len(listed))
                    raise Refusal("multiple", M.EDIT_MULTIPLE.format(
                        path=rel, count=len(where), lines=numbers))
                after = text.replace(old, new) if replace_all else text.replace(old, new, 1)
                out = after.encode("utf-8")
                replace_existing(loc, out, st)
    except (PathError, PermitError, Refusal, OSError) as e:
        return change_failed(NAME, path, e)
    ctx.record_read(rel, Seen.whole_of(out))
    count = len(where)
    head = M.EDIT_DONE.format(path=rel, count=count, s="" if count == 1 else "s")
    return ok(NAME, head + "\n" + short_diff(rel, text, after), path=rel, replacements=count,
              size=len(out))
