"""Glob(pattern, path='.', include_ignored=False): files whose path matches a glob, newest
first (CONTRACT 5).

Pattern syntax: ``*``, ``?`` and ``[...]`` match within one path component, ``**`` matches
any number of components (zero included), ``{a,b}`` alternatives are expanded. Patterns are
relative to ``path`` (or absolute under the root); dotfiles match like any other name.
Directories are descended, never listed; noise directories (tools.walk.NOISE_DIRS) are
pruned unless the pattern names them literally; files and directories the ignore files
(.gitignore, .ignore, .rgignore, as Grep honours them: tools.walk.Ignores) exclude are left
out unless ``include_ignored``. The walk matches components as it goes, so it only opens
directories some pattern can still match below, depth first on a stack of its own with at
most ``_OPEN_DIRS`` directories open (so any depth is walked). Results are sorted newest
first, then by path, and capped at GLOB_MAX_RESULTS with a notice. Paths in the answer are
relative to the workspace root.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import bracex

from tools import messages as M
from tools.context import ToolContext
from tools.paths import PathError, locate
from tools.result import ToolResult, error, ok
from tools.walk import NOISE_DIRS, Ignores, ancestor_ignores, list_dir, open_subdir

NAME = "Glob"
_MAX_EXPANSIONS = 256
_STAR2 = "**"


class PatternError(ValueError):
    """A glob pattern that cannot be used; the message is the reason."""


@dataclass(frozen=True)
class _Segment:
    literal: str | None                      # exact name, when the segment has no wildcard
    match: Callable[[str], object] | None    # matcher of one name, for wildcard segments
    globstar: bool


def _compile_segment(seg: str) -> _Segment:
    if seg == _STAR2:
        return _Segment(None, None, True)
    if not any(c in seg for c in "*?["):
        return _Segment(seg, None, False)
    seg = re.sub(r"\*{2,}", "*", seg)
    if seg == "*":
        return _Segment(None, _any, False)
    return _Segment(None, re.compile(fnmatch.translate(seg), re.DOTALL).match, False)


def _any(name: str) -> bool:
    """Matcher of the segment ``*``: every name."""
    return True


class State:
    """A set of (pattern, segment index) positions, closed under ``**`` matching zero
    components, with its transitions precomputed: ``accepts`` (a whole pattern matched),
    ``alive`` (a directory in this state can still lead to a match)."""

    __slots__ = ("positions", "accepts", "alive", "literals", "always", "lits", "wilds",
                 "one", "_memo")

    def __init__(self, m: Matcher, positions: frozenset[tuple[int, int]]) -> None:
        self.positions = positions
        self.accepts = any(si == len(m.patterns[pi]) for pi, si in positions)
        self.alive = any(si < len(m.patterns[pi]) for pi, si in positions)
        always: list[tuple[int, int]] = []
        lits: dict[str, list[tuple[int, int]]] = {}
        wilds: list[tuple[Callable[[str], object], tuple[int, int]]] = []
        for pi, si in sorted(positions):
            segs = m.patterns[pi]
            if si >= len(segs):
                continue
            seg = segs[si]
            if seg.globstar:
                always.append((pi, si))
            elif seg.literal is not None:
                lits.setdefault(seg.literal, []).append((pi, si + 1))
            elif seg.match is not None:
                wilds.append((seg.match, (pi, si + 1)))
        self.literals = frozenset(lits)
        self.always = tuple(always)
        self.lits = {k: tuple(v) for k, v in lits.items()}
        self.wilds = tuple(wilds)
        # The common case (``**/*.py``, ``src/*``): one wildcard and no literal to test.
        self.one = wilds[0][0] if len(wilds) == 1 and not lits else None
        self._memo: dict[tuple[object, ...], State | None] = {}


class Matcher:
    """Matches workspace paths one component at a time against a set of glob patterns.
    ``start`` is the state at the base directory; ``step`` moves a state over one name
    (None when nothing can match any more)."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns: list[list[_Segment]] = []
        for p in patterns:
            segs = [s for s in p.split("/") if s not in ("", ".")]
            if ".." in segs:
                raise PatternError("'..' is not allowed in a pattern")
            if not segs:
                raise PatternError("empty pattern")
            self.patterns.append([_compile_segment(s) for s in segs])
        self._states: dict[frozenset[tuple[int, int]], State] = {}
        self.start = self._state([(i, 0) for i in range(len(self.patterns))])

    def _state(self, positions: list[tuple[int, int]]) -> State:
        out: set[tuple[int, int]] = set()
        todo = list(positions)
        while todo:
            pi, si = todo.pop()
            if (pi, si) in out:
                continue
            out.add((pi, si))
            segs = self.patterns[pi]
            if si < len(segs) and segs[si].globstar:
                todo.append((pi, si + 1))
        key = frozenset(out)
        st = self._states.get(key)
        if st is None:
            st = self._states[key] = State(self, key)
        return st

    def step_hit(self, state: State, hit: bool) -> State | None:
        """Next state of a one-wildcard state (``state.one``) when it matches or not."""
        key = (None, (hit,))
        try:
            return state._memo[key]
        except KeyError:
            pass
        nxt = list(state.always) + ([state.wilds[0][1]] if hit else [])
        result = self._state(nxt) if nxt else None
        state._memo[key] = result
        return result

    def step(self, state: State, name: str) -> State | None:
        lit: str | None
        hits: tuple[bool, ...]
        if state.one is not None:
            lit, hits = None, (state.one(name) not in (None, False),)
        else:
            lit = name if name in state.literals else None
            hits = tuple(match(name) not in (None, False) for match, _ in state.wilds)
        key = (lit, hits)
        try:
            return state._memo[key]
        except KeyError:
            pass
        nxt = list(state.always)
        if lit is not None:
            nxt.extend(state.lits[lit])
        nxt.extend(pos for (_, pos), hit in zip(state.wilds, hits, strict=True) if hit)
        result = self._state(nxt) if nxt else None
        state._memo[key] = result
        return result


def compile_patterns(pattern: str) -> Matcher:
    """A Matcher for ``pattern`` with braces expanded; raises PatternError."""
    if not pattern or "\0" in pattern:
        raise PatternError("empty pattern" if not pattern else "contains a NUL byte")
    try:
        expanded = bracex.expand(pattern, limit=_MAX_EXPANSIONS)
    except Exception as e:  # bracex raises its own errors for runaway expansions
        raise PatternError(str(e)) from None
    return Matcher(expanded)


def find(ctx: ToolContext, pattern: str, path: str = ".",
         include_ignored: bool = False) -> tuple[list[tuple[int, str]], str]:
    """All matches as (-mtime_ns, workspace-relative path), unsorted, and the base's rel.
    Raises PathError or PatternError."""
    if pattern.startswith("~"):
        raise PathError("tilde", pattern)
    if pattern.startswith("/"):
        rel_parts = ctx.root.parts(pattern, pattern)
        pattern = "/".join(rel_parts)
        path = "."
    matcher = compile_patterns(pattern)
    with locate(ctx.root, path) as loc:
        if loc.st is None:
            raise PathError("not_found", loc.rel)
        if not loc.is_dir:
            raise PathError("not_dir", loc.rel)
        fd = loc.open_dir()
        base = loc.rel
    out: list[tuple[int, str]] = []
    try:
        ign: Ignores | None = None
        if not include_ignored:
            root_fd = os.open(ctx.root.real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                ign = ancestor_ignores(root_fd, [] if base == "." else base.split("/"))
            finally:
                os.close(root_fd)
        _walk(matcher, fd, "" if base == "." else base + "/", matcher.start, out, ign)
    finally:
        os.close(fd)
    hidden = ctx.root.hides_found()
    return [f for f in out if not hidden(f[1])], base


# Descriptors of directories one walk holds open at most besides its base: a deeper walk
# closes its shallowest ones and reopens each through ".." of its child on the way back.
_OPEN_DIRS = 64


@dataclass
class _Dir:
    """A directory of the walk with subdirectories still to descend: its descriptor (None
    while closed), workspace prefix (ending with "/" or empty), identity (st_dev, st_ino),
    the ignore rules in force below it, and its subdirectories to go with their states,
    last first."""
    fd: int | None
    prefix: str
    ident: tuple[int, int] | None
    ign: Ignores | None
    todo: list[tuple[str, State]]


def _walk(m: Matcher, fd: int, prefix: str, state: State,
          out: list[tuple[int, str]], ign: Ignores | None) -> None:
    """Collect (-mtime_ns, path) of matches under ``fd`` (left open); ``prefix`` ends with
    "/" or is empty (the root); ``ign``: the ignore rules in force (None: ignore nothing).
    Depth first with a stack of its own, so depth is bounded neither by Python's recursion
    limit nor by the process's descriptor limit (at most ``_OPEN_DIRS`` + 2 open)."""
    ign, todo = _scan(m, fd, prefix, state, out, ign)
    stack = [_Dir(fd, prefix, _ident(fd), ign, todo)]
    low = 1                                # the shallowest open directory but the base
    try:
        while stack:
            cur = stack[-1]
            if not cur.todo:
                stack.pop()
                if stack:
                    low = _leave(stack, cur, low)
                continue
            name, nxt = cur.todo.pop()
            assert cur.fd is not None
            sub = open_subdir(cur.fd, name)
            if sub is None:
                continue
            try:
                sub_prefix = cur.prefix + name + "/"
                sub_ign, sub_todo = _scan(m, sub, sub_prefix, nxt, out, cur.ign)
                ident = _ident(sub) if sub_todo else None
            except BaseException:
                os.close(sub)
                raise
            if ident is None:                  # nothing to descend: no need to keep it
                os.close(sub)
                continue
            stack.append(_Dir(sub, sub_prefix, ident, sub_ign, sub_todo))
            if len(stack) - low > _OPEN_DIRS:
                old = stack[low]
                assert old.fd is not None
                os.close(old.fd)
                old.fd = None
                low += 1
    finally:
        for d in stack[1:]:
            if d.fd is not None:
                os.close(d.fd)


def _ident(fd: int) -> tuple[int, int] | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _leave(stack: list[_Dir], done: _Dir, low: int) -> int:
    """Close directory ``done``, just taken off ``stack`` (``low``: the index of the
    shallowest open directory but the base), reopening its parent when the walk closed
    it. The new ``low``."""
    parent = len(stack) - 1
    try:
        if stack[parent].fd is None:
            _reopen(stack, parent, done.fd)
            low = parent
    finally:
        if done.fd is not None:
            os.close(done.fd)
            done.fd = None
    return min(low, len(stack))


def _reopen(stack: list[_Dir], i: int, child: int | None) -> None:
    """Open ``stack[i]`` again: as ``..`` of its open ``child``, else one component at a
    time from the base (a child without search permission), and only if it is the same
    directory as listed; when neither is, the tree changed under the walk and it has
    nothing more to descend."""
    want = stack[i]
    if child is not None:
        up = open_subdir(child, "..")
        if up is not None:
            if _ident(up) == want.ident:
                want.fd = up
                return
            os.close(up)
    fd = stack[0].fd
    assert fd is not None
    for k in range(1, i + 1):
        name = stack[k].prefix[len(stack[k - 1].prefix):-1]
        sub = open_subdir(fd, name)
        if k > 1:
            os.close(fd)
        if sub is None or _ident(sub) != stack[k].ident:
            if sub is not None:
                os.close(sub)
            want.todo.clear()
            return
        fd = sub
    want.fd = fd


def _scan(m: Matcher, fd: int, prefix: str, state: State, out: list[tuple[int, str]],
          ign: Ignores | None) -> tuple[Ignores | None, list[tuple[str, State]]]:
    """List directory ``fd`` (workspace ``prefix``, in ``state``, under rules ``ign``):
    collect the matching files in it into ``out``; the rules below it, and its
    subdirectories to descend with their states (last first)."""
    one = state.one
    if one is not None:                     # one wildcard: two possible next states
        yes, no = m.step_hit(state, True), m.step_hit(state, False)
        always = yes if one is _any else None
    entries = list_dir(fd)
    check: Ignores | None = None            # the rules to apply here, when there are any
    if ign is not None:
        ign = ign.with_dir(fd, prefix, {e.name for e in entries})
        check = ign if ign.rules else None
    todo: list[tuple[str, State]] = []
    for entry in entries:
        name = entry.name
        if one is None:
            nxt = m.step(state, name)
        elif always is not None:
            nxt = always
        else:
            nxt = yes if one(name) is not None else no
        if nxt is None:
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if is_dir:
            if not nxt.alive or (name in NOISE_DIRS and name not in state.literals):
                continue
            if check is not None and check.ignored(prefix + name, True):
                continue
            todo.append((name, nxt))
        elif nxt.accepts:
            if check is not None and check.ignored(prefix + name, False):
                continue
            try:
                out.append((-entry.stat(follow_symlinks=False).st_mtime_ns, prefix + name))
            except OSError:
                continue
    todo.reverse()
    return ign, todo


def glob(ctx: ToolContext, pattern: str, path: str = ".",
         include_ignored: bool = False) -> ToolResult:
    """Files under ``path`` matching ``pattern``, newest first, at most GLOB_MAX_RESULTS;
    ``include_ignored`` lists files the ignore files exclude too."""
    try:
        found, base = find(ctx, pattern, path, include_ignored)
    except PatternError as e:
        return error(NAME, M.GLOB_BAD_PATTERN.format(pattern=pattern, reason=e), kind="pattern")
    except PathError as e:
        return error(NAME, e.text, kind=e.kind)
    if not found:
        return ok(NAME, M.GLOB_NONE.format(pattern=pattern, path=base), paths=[], total=0,
                  shown=0)
    found.sort()                                    # newest first, then by path
    total = len(found)
    paths = [p for _, p in found[:M.GLOB_MAX_RESULTS]]
    text = "\n".join(paths)
    if total > M.GLOB_MAX_RESULTS:
        text += "\n" + M.GLOB_CAPPED.format(shown=M.GLOB_MAX_RESULTS, total=total)
    return ok(NAME, text, paths=paths, total=total, shown=len(paths))
