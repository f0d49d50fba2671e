"""Grep(pattern, path='.', ...): search file contents with ripgrep (CONTRACT 5).

ripgrep (``rg``) is the one engine: a required dependency (scripts/setup.sh installs it),
so the answer has one semantics everywhere: ripgrep's regex syntax, with look-around and
backreferences handed to PCRE2 (``--engine auto``); ``multiline`` lets a match span lines
(``.`` matches a newline too); without it a pattern naming ``\n`` is an error. Where
bubblewrap works, ripgrep is confined so that it sees only the workspace (see
tools.sandbox.confined_reader), which keeps a directory swapped for a link to the outside
from leading it there. Rules: hidden files are searched, symbolic links are not followed,
noise directories are pruned, .gitignore, .ignore and .rgignore files (from the root down)
are honoured, binary files (a NUL byte) are skipped, also when named as ``path``; ``glob``
filters like ripgrep's ``-g``, ``type`` like its ``--type`` (``py``, ``js``, ``rust``...).

Answers, sorted by path: ``files_with_matches`` lists paths; ``count`` lists ``path:N``
(matching lines); ``content`` lists ``path:line:text`` for matches and ``path-line-text`` for
context lines (line numbers dropped when ``line_numbers`` is False), with ``--`` between
non-adjacent groups when context is asked for. Lines are cut at GREP_LINE_CHARS characters;
``offset`` output lines are skipped, then at most ``head_limit`` lines and GREP_OUTPUT_CAP
bytes are shown, with a notice; the search stops after GREP_TIMEOUT_S or once ripgrep has
written GREP_RAW_CAP bytes. Paths are relative to the workspace root.
"""

from __future__ import annotations

import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass, field

from tools import messages as M
from tools import sandbox
from tools.context import ToolContext
from tools.paths import Located, PathError, locate
from tools.result import ToolResult, error, ok
from tools.walk import NOISE_DIRS

NAME = "Grep"
MODES = ("files_with_matches", "content", "count")
_ESCAPED_NEWLINE = re.compile(r"(?<!\\)(?:\\\\)*\\n")   # a regex's \n, not \\n
_BINARY_PROBE = 64 * 1024   # bytes of a named file inspected for a NUL (ripgrep's buffer)


@dataclass
class FileHits:
    """Matches in one file: ``path`` (workspace-relative), ``count`` of matching lines and,
    in content mode, ``n_lines`` (output lines this file takes, its inner ``--`` separators
    included) and either ``lines`` as (line number, is_match, text) or ``raw``, ripgrep's
    unparsed block for the file (parsed only when shown)."""

    path: str
    count: int = 0
    lines: list[tuple[int, bool, str]] = field(default_factory=list)
    raw: bytes | None = None
    n_lines: int = 0

    def content(self) -> list[tuple[int, bool, str]]:
        if self.raw is not None:
            self.lines = _parse_block(self.raw)
            self.raw = None
        return self.lines


_LINE_HEAD = re.compile(rb"(\d+)([:-])")


def _parse_block(body: bytes) -> list[tuple[int, bool, str]]:
    """Lines ``N:text`` (match) and ``N-text`` (context) of one file's ripgrep block."""
    out = []
    for line in body.split(b"\n"):
        m = _LINE_HEAD.match(line)
        if m is None:
            continue                        # a "--" separator
        out.append((int(m.group(1)), m.group(2) == b":",
                    line[m.end():].decode("utf-8", errors="replace")))
    return out


@dataclass
class Query:
    pattern: str
    mode: str
    ignore_case: bool
    before: int
    after: int
    glob: str | None
    type: str | None = None
    multiline: bool = False


# --- rendering ---------------------------------------------------------------------------

def _cut(text: str) -> str:
    if len(text) > M.GREP_LINE_CHARS:
        return text[:M.GREP_LINE_CHARS] + M.GREP_LINE_CUT.format(chars=M.GREP_LINE_CHARS)
    return text


def render(hits: list[FileHits], q: Query, line_numbers: bool,
           limit: int, skip: int = 0) -> tuple[list[str], int]:
    """Output lines ``skip`` to ``skip + limit`` for ``hits`` (sorted here by path) and the
    number of lines the whole answer has."""
    hits = sorted(hits, key=lambda h: h.path)
    if q.mode == "files_with_matches":
        return [h.path for h in hits[skip:skip + limit]], len(hits)
    if q.mode == "count":
        return [f"{h.path}:{h.count}" for h in hits[skip:skip + limit]], len(hits)
    grouped = q.before > 0 or q.after > 0
    total = sum(h.n_lines for h in hits) + (len(hits) - 1 if grouped and hits else 0)
    out: list[str] = []
    pos = 0                     # index in the whole answer of the next line produced
    for i, h in enumerate(hits):
        lead = 1 if grouped and i > 0 else 0     # the "--" before this file's lines
        if pos + lead + h.n_lines <= skip:
            pos += lead + h.n_lines              # skipped whole, without parsing it
            continue
        produced: list[str] = ["--"] if lead else []
        prev = None
        for number, is_match, text in h.content():
            if grouped and prev is not None and number != prev + 1:
                produced.append("--")
            sep = ":" if is_match else "-"
            if line_numbers:
                produced.append(f"{h.path}{sep}{number}{sep}{_cut(text)}")
            else:
                produced.append(f"{h.path}{sep}{_cut(text)}")
            prev = number
        for line in produced:
            if pos >= skip:
                out.append(line)
            pos += 1
        if len(out) >= limit:
            break
    return out[:limit], total


# --- ripgrep engine ----------------------------------------------------------------------

def _rg_argv(rg: str, q: Query, target: str) -> list[str]:
    argv = [rg, "--no-config", "--hidden", "--no-require-git", "--no-ignore-global",
            "--no-ignore-exclude", "--no-messages", "--null", "--color", "never"]
    for noise in sorted(NOISE_DIRS):
        argv += ["-g", f"!{noise}/"]
    if q.glob:
        argv += ["-g", q.glob]
    if q.type:
        argv += ["--type", q.type]
    if q.multiline:
        argv += ["--multiline", "--multiline-dotall"]
    argv += ["--engine", "auto"]      # PCRE2 only for what the default engine cannot do
    if q.ignore_case:
        argv.append("-i")
    if q.mode == "files_with_matches":
        argv.append("-l")
    elif q.mode == "count":
        argv.append("-c")
    else:
        argv += ["-n", "--heading", "--with-filename", "-B", str(q.before),
                 "-A", str(q.after)]
    argv += ["-e", q.pattern, "--", target]
    return argv


def _rg_parse(out: bytes, q: Query, prefix: str) -> list[FileHits]:
    """Parse ``--null`` output; ``prefix`` turns rg's paths into workspace paths. Content
    mode uses ``--heading``: one block per file, ``path NUL`` then its lines, blocks
    separated by an empty line (no content line is empty: each starts with its number)."""
    def wpath(p: bytes) -> str:
        s = p.decode("utf-8", errors="surrogateescape")
        if s.startswith("./"):
            s = s[2:]
        return prefix + s

    if q.mode == "files_with_matches":
        paths = {p.strip(b"\n") for p in out.split(b"\0")}
        return [FileHits(wpath(p), 1) for p in paths if p]
    hits: list[FileHits] = []
    if q.mode == "count":
        for line in out.split(b"\n"):
            p, nul, rest = line.partition(b"\0")
            if nul and rest.isdigit():
                hits.append(FileHits(wpath(p), int(rest)))
        return hits
    body_all = out.rstrip(b"\n")
    if not body_all:
        return hits
    for block in body_all.split(b"\n\n"):
        p, nul, body = block.partition(b"\0")
        if nul:
            hits.append(FileHits(wpath(p), raw=body, n_lines=body.count(b"\n") + 1))
    return hits


def _read_bounded(proc: subprocess.Popen[bytes], deadline: float, cap: int,
                  end: bytes) -> tuple[bytes, bytes, str | None]:
    """ripgrep's stdout (at most ``cap`` bytes, cut after the last ``end`` byte when reading
    stops early) and stderr; the third value says why reading stopped early ("timeout",
    "output") or is None."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    stopped: str | None = None
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    open_fds = 2
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                stopped = "timeout"
                break
            for key, _ in sel.select(left):
                fd = key.fd
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    open_fds -= 1
                elif fd == proc.stdout.fileno():
                    out += data
                else:
                    err += data[:max(0, 65536 - len(err))]
            if len(out) > cap:
                stopped = "output"
                break
    finally:
        sel.close()
    if stopped is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        del out[cap:]
        cut = out.rfind(end)
        del out[cut + 1 if cut >= 0 else 0:]
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return bytes(out), bytes(err), stopped


def _probe(loc: Located) -> bool:
    """Open what ``loc`` names (the directory or the file to search) for reading, so that
    one this user cannot read fails here, by name, with the typed PathError (denied, io,
    disconnected, ...) instead of ripgrep's own text; for a file, whether it has a NUL
    byte in its first _BINARY_PROBE bytes (ripgrep skips such files when it finds them by
    walking; named ones it would search)."""
    if loc.is_dir:
        os.close(loc.open_dir())
        return False
    fd = loc.open(os.O_RDONLY | os.O_NONBLOCK)
    try:
        return b"\0" in os.pread(fd, _BINARY_PROBE, 0)
    except OSError as e:
        raise PathError.from_os(loc.rel, e) from None
    finally:
        os.close(fd)


def _search_rg(rg: str, bw: str | None, ctx: ToolContext, q: Query, base_rel: str,
               is_dir: bool, deadline: float) -> tuple[list[FileHits], str | None, str | None]:
    """Run ripgrep (confined when ``bw``); returns (hits, why it stopped early or None,
    error text or None)."""
    root = ctx.root.real
    if is_dir:
        cwd_rel, target = base_rel, "."
    else:
        parent, _, name = base_rel.rpartition("/")
        cwd_rel, target = (parent or "."), name
    cwd = root if cwd_rel == "." else f"{root}/{cwd_rel}"
    prefix = "" if cwd_rel == "." else cwd_rel + "/"
    argv = _rg_argv(rg, q, target)
    if bw is not None:
        argv = sandbox.confined_reader(bw, root, cwd, argv)
    try:
        proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as e:
        return [], None, M.GREP_FAILED.format(reason=e.strerror or e)
    end = b"\0" if q.mode == "files_with_matches" else b"\n"
    out, err, stopped = _read_bounded(proc, deadline, M.GREP_RAW_CAP, end)
    if proc.returncode == 2 and stopped is None and not out:
        reason = err.decode("utf-8", errors="replace").strip().splitlines()
        text = "\n".join(reason[-8:]) or "ripgrep failed"
        low = text.lower()
        if "literal" in low and "not allowed" in low:
            return [], None, M.GREP_NEEDS_MULTILINE.format(pattern=q.pattern)
        if "regex" in low or "not allowed" in low or "look-around" in low:
            return [], None, M.GREP_BAD_PATTERN.format(pattern=q.pattern, reason=text)
        if "file type" in low:
            return [], None, M.GREP_BAD_TYPE.format(type=q.type, reason=text)
        return [], None, M.GREP_FAILED.format(reason=text)
    return _rg_parse(out, q, prefix), stopped, None


# --- the tool ----------------------------------------------------------------------------

def grep(ctx: ToolContext, pattern: str, path: str = ".", glob: str | None = None,
         output_mode: str = "files_with_matches", ignore_case: bool = False,
         line_numbers: bool = True, before: int = 0, after: int = 0, context: int = 0,
         head_limit: int = M.GREP_HEAD_LIMIT, offset: int = 0, type: str | None = None,
         multiline: bool = False) -> ToolResult:
    """Search ``path`` for ``pattern``; see the module docstring for the answer's shape.
    ``offset``: output lines (entries in files/count modes) skipped before ``head_limit``;
    ``type``: a ripgrep file type; ``multiline``: matches may span lines. The data holds
    ``total`` (lines or entries of the whole answer), ``shown``, ``files``, ``timed_out``
    and ``capped`` (the output cap cut the answer)."""
    if output_mode not in MODES:
        return error(NAME, M.GREP_BAD_MODE.format(mode=output_mode), kind="mode")
    for name, value, minimum in (("before", before, 0), ("after", after, 0),
                                 ("context", context, 0), ("head_limit", head_limit, 1),
                                 ("offset", offset, 0)):
        if value < minimum:
            return error(NAME, M.GREP_BAD_NUMBER.format(name=name, minimum=minimum,
                                                        value=value), kind="argument")
    if not pattern:
        return error(NAME, M.GREP_BAD_PATTERN.format(pattern=pattern, reason="empty pattern"),
                     kind="pattern")
    if not multiline and ("\n" in pattern or _ESCAPED_NEWLINE.search(pattern)):
        return error(NAME, M.GREP_NEEDS_MULTILINE.format(pattern=pattern), kind="pattern")
    rg = shutil.which("rg")
    if rg is None:
        return error(NAME, M.GREP_NO_RG, kind="no_rg")
    q = Query(pattern, output_mode, ignore_case, before or context, after or context,
              glob or None, type or None, multiline)
    try:
        with locate(ctx.root, path) as loc:
            if loc.st is None:
                raise PathError("not_found", loc.rel)
            base_rel, is_dir = loc.rel, loc.is_dir
            if not is_dir and not stat.S_ISREG(loc.st.st_mode):
                raise PathError("not_regular", loc.rel)
            binary = _probe(loc)
    except PathError as e:
        return error(NAME, e.text, kind=e.kind)
    none = ok(NAME, M.GREP_NONE.format(pattern=pattern, path=base_rel), total=0, shown=0,
              files=0, timed_out=False, capped=False)
    if binary:
        return none
    deadline = time.monotonic() + M.GREP_TIMEOUT_S
    hits, stopped, err = _search_rg(rg, sandbox.bwrap(), ctx, q, base_rel, is_dir, deadline)
    hidden = ctx.root.hides_found()                           # the path policy's hide
    hits = [h for h in hits if not hidden(h.path)]
    if err is not None:
        return error(NAME, err, kind="search")
    shown, total = render(hits, q, line_numbers, head_limit, offset)
    if not shown and stopped is None:
        if total:
            return ok(NAME, M.GREP_PAST_OFFSET.format(offset=offset, total=total),
                      total=total, shown=0, files=len(hits), timed_out=False, capped=False)
        return none
    size = 0
    for i, line in enumerate(shown):
        size += len(line.encode("utf-8", errors="surrogateescape")) + 1
        if size > M.GREP_OUTPUT_CAP and i > 0:
            shown = shown[:i]
            break
    n_shown = len(shown)
    capped = n_shown < min(head_limit, max(0, total - offset))
    unit = "lines" if output_mode == "content" else "files"
    if capped:
        shown.append(M.GREP_BYTES_CAPPED.format(shown=n_shown, total=total, unit=unit,
                                                cap=M.GREP_OUTPUT_CAP,
                                                next=offset + n_shown))
    elif offset + n_shown < total:
        shown.append(M.GREP_CAPPED.format(shown=n_shown, total=total, unit=unit,
                                          next=offset + n_shown))
    if stopped == "timeout":
        shown.append(M.GREP_TIMEOUT.format(seconds=M.GREP_TIMEOUT_S))
    elif stopped == "output":
        shown.append(M.GREP_RAW_STOPPED.format(cap=M.GREP_RAW_CAP))
    return ok(NAME, "\n".join(shown), total=total, shown=n_shown, files=len(hits),
              timed_out=stopped == "timeout", capped=capped or stopped == "output")
