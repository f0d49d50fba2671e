"""Grep(pattern, path='.', ...): search file contents (CONTRACT 5).

Two engines give the same answer. ripgrep runs when it is installed and bubblewrap works:
it is confined so that it sees only the workspace (see tools.sandbox.confined_reader), which
keeps a directory swapped for a link to the outside from leading it there. Otherwise a Python
engine walks the tree by descriptors (tools.walk) with the same rules: hidden files are
searched, symbolic links are not followed, noise directories are pruned, .gitignore, .ignore
and .rgignore files (from the root down) are honoured, binary files (a NUL byte) are skipped,
``glob`` filters like ripgrep's ``-g``. The Python engine uses Python ``re`` syntax.

Answers, sorted by path: ``files_with_matches`` lists paths; ``count`` lists ``path:N``
(matching lines); ``content`` lists ``path:line:text`` for matches and ``path-line-text`` for
context lines (line numbers dropped when ``line_numbers`` is False), with ``--`` between
non-adjacent groups when context is asked for. Lines are cut at GREP_LINE_CHARS characters;
at most ``head_limit`` lines are shown, with a notice; the search stops after GREP_TIMEOUT_S.
Paths are relative to the workspace root.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import time
from dataclasses import dataclass, field

import pathspec

from tools import messages as M
from tools import sandbox
from tools.context import ToolContext
from tools.paths import PathError, locate
from tools.readfile import read_all
from tools.result import ToolResult, error, ok
from tools.walk import NOISE_DIRS, list_dir, open_subdir

NAME = "Grep"
MODES = ("files_with_matches", "content", "count")
IGNORE_FILES = (".gitignore", ".ignore", ".rgignore")   # later ones take precedence


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


# --- rendering ---------------------------------------------------------------------------

def _cut(text: str) -> str:
    if len(text) > M.GREP_LINE_CHARS:
        return text[:M.GREP_LINE_CHARS] + M.GREP_LINE_CUT.format(chars=M.GREP_LINE_CHARS)
    return text


def render(hits: list[FileHits], q: Query, line_numbers: bool,
           limit: int) -> tuple[list[str], int]:
    """The first ``limit`` output lines for ``hits`` (sorted here by path) and the number
    of lines the whole answer has."""
    hits = sorted(hits, key=lambda h: h.path)
    if q.mode == "files_with_matches":
        return [h.path for h in hits[:limit]], len(hits)
    if q.mode == "count":
        return [f"{h.path}:{h.count}" for h in hits[:limit]], len(hits)
    grouped = q.before > 0 or q.after > 0
    total = sum(h.n_lines for h in hits) + (len(hits) - 1 if grouped and hits else 0)
    out: list[str] = []
    for h in hits:
        if len(out) >= limit:
            break
        prev = None
        for number, is_match, text in h.content():
            if grouped and out and (prev is None or number != prev + 1):
                out.append("--")
            sep = ":" if is_match else "-"
            if line_numbers:
                out.append(f"{h.path}{sep}{number}{sep}{_cut(text)}")
            else:
                out.append(f"{h.path}{sep}{_cut(text)}")
            prev = number
    return out[:limit], total


# --- ripgrep engine ----------------------------------------------------------------------

def _rg_argv(rg: str, q: Query, target: str) -> list[str]:
    argv = [rg, "--no-config", "--hidden", "--no-require-git", "--no-ignore-global",
            "--no-ignore-exclude", "--no-messages", "--null", "--color", "never"]
    for noise in sorted(NOISE_DIRS):
        argv += ["-g", f"!{noise}/"]
    if q.glob:
        argv += ["-g", q.glob]
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


def _search_rg(rg: str, bw: str, ctx: ToolContext, q: Query, base_rel: str, is_dir: bool,
               deadline: float) -> tuple[list[FileHits], bool, str | None]:
    """Run ripgrep confined; returns (hits, timed out, error text)."""
    root = ctx.root.real
    if is_dir:
        cwd_rel, target = base_rel, "."
    else:
        parent, _, name = base_rel.rpartition("/")
        cwd_rel, target = (parent or "."), name
    cwd = root if cwd_rel == "." else f"{root}/{cwd_rel}"
    prefix = "" if cwd_rel == "." else cwd_rel + "/"
    argv = sandbox.confined_reader(bw, root, cwd, _rg_argv(rg, q, target))
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        return [], False, M.GREP_FAILED.format(reason=e.strerror or e)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        cut = out.rfind(b"\n")
        out = out[:cut + 1] if cut >= 0 else b""
    if proc.returncode == 2 and not timed_out and not out:
        reason = err.decode("utf-8", errors="replace").strip().splitlines()
        text = "\n".join(reason[-6:]) or "ripgrep failed"
        if "regex" in text.lower():
            return [], False, M.GREP_BAD_PATTERN.format(pattern=q.pattern, reason=text)
        return [], False, M.GREP_FAILED.format(reason=text)
    return _rg_parse(out, q, prefix), timed_out, None


# --- Python engine -----------------------------------------------------------------------

class _Ignores:
    """Ignore rules in force at one directory: a list of (directory prefix, spec)."""

    def __init__(self, rules: tuple[tuple[str, pathspec.PathSpec], ...] = ()) -> None:
        self.rules = rules

    def with_dir(self, fd: int, prefix: str, names: set[str]) -> _Ignores:
        added = []
        for fname in IGNORE_FILES:
            if fname not in names:
                continue
            try:
                f = os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                            dir_fd=fd)
            except OSError:
                continue
            try:
                if not stat.S_ISREG(os.fstat(f).st_mode):
                    continue
                lines = read_all(f).decode("utf-8", errors="replace").splitlines()
            finally:
                os.close(f)
            added.append((prefix, pathspec.GitIgnoreSpec.from_lines(lines)))
        return _Ignores(self.rules + tuple(added)) if added else self

    def ignored(self, path: str, is_dir: bool) -> bool:
        verdict = False
        for prefix, spec in self.rules:
            if prefix and not path.startswith(prefix):
                continue
            sub = path[len(prefix):] + ("/" if is_dir else "")
            res = spec.check_file(sub)
            if res.include is not None:
                verdict = res.include
        return verdict


class _Glob:
    """ripgrep's ``-g``: a gitignore-style glob; ``!glob`` excludes, else whitelists files."""

    def __init__(self, glob: str) -> None:
        self.negated = glob.startswith("!")
        self.spec = pathspec.GitIgnoreSpec.from_lines([glob[1:] if self.negated else glob])

    def excludes(self, path: str, is_dir: bool) -> bool:
        hit = self.spec.match_file(path + ("/" if is_dir else ""))
        if self.negated:
            return hit
        return not is_dir and not hit


def _scan_file(fd: int, name: str, path: str, rx: re.Pattern[str], q: Query,
               explicit: bool) -> FileHits | None:
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                    dir_fd=fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(f).st_mode):
            return None
        data = read_all(f)
    except OSError:
        return None
    finally:
        os.close(f)
    if b"\0" in data and not explicit:
        return None
    text = data.decode("utf-8", errors="replace")
    if rx.search(text) is None:
        return None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    matched = [i for i, ln in enumerate(lines) if rx.search(ln)]
    if not matched:
        return None
    h = FileHits(path, len(matched))
    if q.mode == "content":
        keep: dict[int, bool] = {}
        for i in matched:
            for j in range(max(0, i - q.before), min(len(lines), i + q.after + 1)):
                keep.setdefault(j, False)
            keep[i] = True
        h.lines = [(j + 1, keep[j], lines[j]) for j in sorted(keep)]
        gaps = sum(1 for a, b in zip(h.lines, h.lines[1:], strict=False) if b[0] != a[0] + 1)
        h.n_lines = len(h.lines) + (gaps if q.before or q.after else 0)
    return h


def _search_py(ctx: ToolContext, q: Query, base_rel: str, is_dir: bool,
               deadline: float) -> tuple[list[FileHits], bool, str | None]:
    flags = re.MULTILINE | (re.IGNORECASE if q.ignore_case else 0)
    try:
        rx = re.compile(q.pattern, flags)
    except re.error as e:
        return [], False, M.GREP_BAD_PATTERN.format(pattern=q.pattern, reason=e)
    hits: list[FileHits] = []
    root_fd = os.open(ctx.root.real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    parts = [] if base_rel == "." else base_rel.split("/")
    if not is_dir:
        parts, fname = parts[:-1], parts[-1]
    ign = _Ignores()
    fd = root_fd
    prefix = ""
    try:
        for part in parts:                  # ignore files of the base's ancestors
            ign = ign.with_dir(fd, prefix, {e.name for e in list_dir(fd)})
            sub = open_subdir(fd, part)
            os.close(fd)
            fd = -1
            if sub is None:
                return [], False, M.PATH_CHANGED.format(path=base_rel)
            fd = sub
            prefix += part + "/"
        if not is_dir:
            h = _scan_file(fd, fname, prefix + fname, rx, q, explicit=True)
            return ([h] if h else []), False, None
        glob = _Glob(q.glob) if q.glob else None
        timed_out = _walk_py(fd, prefix, "", ign, glob, rx, q, deadline, hits)
        return hits, timed_out, None
    finally:
        if fd >= 0:
            os.close(fd)


def _walk_py(fd: int, prefix: str, sub: str, ign: _Ignores, glob: _Glob | None,
             rx: re.Pattern[str], q: Query, deadline: float, hits: list[FileHits]) -> bool:
    """Search the directory at ``fd``; ``prefix`` is its workspace path with a trailing "/"
    (or empty), ``sub`` its path relative to the search base. Returns True on timeout."""
    entries = list_dir(fd)
    ign = ign.with_dir(fd, prefix, {e.name for e in entries})
    for entry in sorted(entries, key=lambda e: e.name):
        if time.monotonic() > deadline:
            return True
        name = entry.name
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
            is_file = entry.is_file(follow_symlinks=False)
        except OSError:
            continue
        if not is_dir and not is_file:
            continue                         # links, fifos, sockets, devices
        if is_dir and name in NOISE_DIRS:
            continue
        path = prefix + name
        if ign.ignored(path, is_dir):
            continue
        if glob is not None and glob.excludes(sub + name, is_dir):
            continue
        if is_dir:
            child = open_subdir(fd, name)
            if child is None:
                continue
            try:
                if _walk_py(child, path + "/", sub + name + "/", ign, glob, rx, q, deadline,
                            hits):
                    return True
            finally:
                os.close(child)
        else:
            h = _scan_file(fd, name, path, rx, q, explicit=False)
            if h is not None:
                hits.append(h)
    return False


# --- the tool ----------------------------------------------------------------------------

def engine() -> str:
    """``"rg"`` when ripgrep can run confined here, else ``"python"``."""
    if os.environ.get("REWINDFS_GREP_ENGINE") == "python":
        return "python"
    return "rg" if shutil.which("rg") and sandbox.bwrap() else "python"


def grep(ctx: ToolContext, pattern: str, path: str = ".", glob: str | None = None,
         output_mode: str = "files_with_matches", ignore_case: bool = False,
         line_numbers: bool = True, before: int = 0, after: int = 0, context: int = 0,
         head_limit: int = M.GREP_HEAD_LIMIT) -> ToolResult:
    """Search ``path`` for ``pattern``; see the module docstring for the answer's shape."""
    if output_mode not in MODES:
        return error(NAME, M.GREP_BAD_MODE.format(mode=output_mode), kind="mode")
    for name, value, minimum in (("before", before, 0), ("after", after, 0),
                                 ("context", context, 0), ("head_limit", head_limit, 1)):
        if value < minimum:
            return error(NAME, M.GREP_BAD_NUMBER.format(name=name, minimum=minimum,
                                                        value=value), kind="argument")
    if not pattern:
        return error(NAME, M.GREP_BAD_PATTERN.format(pattern=pattern, reason="empty pattern"),
                     kind="pattern")
    q = Query(pattern, output_mode, ignore_case, before or context, after or context,
              glob or None)
    try:
        with locate(ctx.root, path) as loc:
            if loc.st is None:
                raise PathError("not_found", loc.rel)
            base_rel, is_dir = loc.rel, loc.is_dir
            if not is_dir and not stat.S_ISREG(loc.st.st_mode):
                raise PathError("not_regular", loc.rel)
    except PathError as e:
        return error(NAME, e.text, kind=e.kind)
    deadline = time.monotonic() + M.GREP_TIMEOUT_S
    used = engine()
    if used == "rg":
        rg, bw = shutil.which("rg"), sandbox.bwrap()
        assert rg is not None and bw is not None
        hits, timed_out, err = _search_rg(rg, bw, ctx, q, base_rel, is_dir, deadline)
    else:
        hits, timed_out, err = _search_py(ctx, q, base_rel, is_dir, deadline)
    if err is not None:
        return error(NAME, err, kind="search", engine=used)
    shown, total = render(hits, q, line_numbers, head_limit)
    if not shown and not timed_out:
        return ok(NAME, M.GREP_NONE.format(pattern=pattern, path=base_rel), engine=used,
                  total=0, files=0)
    if total > head_limit:
        unit = "lines" if output_mode == "content" else "files"
        shown.append(M.GREP_CAPPED.format(shown=head_limit, total=total, unit=unit))
    if timed_out:
        shown.append(M.GREP_TIMEOUT.format(seconds=M.GREP_TIMEOUT_S))
    return ok(NAME, "\n".join(shown), engine=used, total=total, files=len(hits),
              timed_out=timed_out)
