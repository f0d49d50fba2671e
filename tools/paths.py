"""Containment: resolving a tool's path argument inside the workspace root.

Owns the only way the tools turn a path text into something they open. Resolution walks one
component at a time from an open directory descriptor of the root (``openat`` style, every
component opened with ``O_NOFOLLOW``), keeps a descriptor for every directory on the way, and
resolves symbolic links itself: a link's target is spliced into the remaining components and
``..`` pops the descriptor stack, so nothing ever climbs above the root. A directory swapped
for a symbolic link between check and use is caught by ``O_NOFOLLOW`` (``ELOOP``/``ENOTDIR``)
and re-examined. It must never call ``realpath`` on an argument, open a multi-component path
string, or follow a link the kernel resolves for it.

The session's path policy (``store.pathpolicy``) is applied here too, on the canonical path
of every component met: a ``hide`` match is answered as not found (so it is never read,
written or listed through a path argument), and a ``protect`` match refuses a resolution
made for a change (``write=True``) with EACCES.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from store.pathpolicy import PathPolicy
from tools import messages as M

MAX_LINKS = 40          # symbolic links followed per resolution (Linux's MAXSYMLINKS)
MAX_RETRIES = 8         # re-examinations of a component that changed under us

_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class PathError(Exception):
    """A path argument cannot be used. ``kind`` is one of: escape, not_found, not_dir,
    is_dir, not_regular, loop, invalid, tilde, changed, protected (EACCES of the path
    policy), denied (EACCES, EPERM), too_long (ENAMETOOLONG), io (EIO), disconnected
    (ENOTCONN), os (any other errno: its text is the reason). ``path`` is the text the
    caller gave (or the part resolved so far); ``text`` is the message from
    :mod:`tools.messages`."""

    _TEMPLATES = {
        "escape": M.PATH_ESCAPE, "not_found": M.PATH_NOT_FOUND, "not_dir": M.PATH_NOT_DIR,
        "is_dir": M.PATH_IS_DIR, "not_regular": M.PATH_NOT_REGULAR, "loop": M.PATH_LOOP,
        "invalid": M.PATH_INVALID, "tilde": M.PATH_TILDE, "changed": M.PATH_CHANGED,
        "os": M.PATH_OS_ERROR, "protected": M.PATH_PROTECTED, "denied": M.PATH_DENIED,
        "too_long": M.PATH_TOO_LONG, "io": M.PATH_IO, "disconnected": M.PATH_DISCONNECTED,
    }

    def __init__(self, kind: str, path: str, reason: str = "") -> None:
        self.kind = kind
        self.path = path
        self.reason = reason
        self.text = self._TEMPLATES[kind].format(path=path, reason=reason)
        super().__init__(self.text)

    @classmethod
    def from_os(cls, path: str, e: OSError) -> PathError:
        """Map an OSError met while using ``path`` to the closest kind."""
        kinds = {errno.ENOENT: "not_found", errno.ENOTDIR: "not_dir", errno.EISDIR: "is_dir",
                 errno.ELOOP: "loop", errno.EACCES: "denied", errno.EPERM: "denied",
                 errno.ENAMETOOLONG: "too_long", errno.EIO: "io",
                 errno.ENOTCONN: "disconnected"}
        kind = kinds.get(e.errno or 0, "os")
        return cls(kind, path, e.strerror or str(e))


# A hard link made this long before a scan started may still be missing from it (file
# times come from a coarse clock).
_LINK_MARGIN_NS = 2_000_000_000


class Covered:
    """What the path policy covered at the last scan of the tree (tools.policyview.scan),
    by identity: the inode numbers (on device ``dev``) of every hidden and every protected
    file and directory seen, the matches' own and everything below them. A covered object
    stays covered under another name: a parent directory renamed by a command, a hard link
    to a covered file. ``scanned_ns``: wall clock when that scan started (None: never)."""

    def __init__(self) -> None:
        self.hidden: frozenset[int] = frozenset()
        self.protected: frozenset[int] = frozenset()
        self.dev: int | None = None
        self.scanned_ns: int | None = None

    def hides(self, st: os.stat_result) -> bool:
        return st.st_dev == self.dev and st.st_ino in self.hidden

    def record(self, root_id: tuple[int, int], hidden_paths: Sequence[str],
               protected_paths: Sequence[str]) -> dict[str, Any]:
        """What to keep with the session (``tools.binding.KeepsCovers``): the root's
        identity (st_dev, st_ino), the inode numbers, and the workspace paths the scan
        covered (its matches, and covered objects under names no pattern matches)."""
        return {"root": list(root_id), "hidden": sorted(self.hidden),
                "protected": sorted(self.protected), "hidden_paths": list(hidden_paths),
                "protected_paths": list(protected_paths)}

    def load(self, rec: dict[str, Any], real: str) -> None:
        """Start from a saved ``record`` of the tree at ``real``: its inode numbers when
        the root is the same object (same st_dev and st_ino: the same mount), else
        (a new mount of the session: other numbers) the objects now at its paths, found
        without following a link in the last component. A record that does not parse
        adds nothing."""
        try:
            top = os.stat(real)
            hidden: set[int] = set()
            protected: set[int] = set()
            if rec.get("root") == [top.st_dev, top.st_ino]:
                hidden.update(int(i) for i in rec.get("hidden", ()))
                protected.update(int(i) for i in rec.get("protected", ()))
            else:
                for key, into in (("hidden_paths", hidden), ("protected_paths", protected)):
                    for rel in rec.get(key, ()):
                        try:
                            st = os.lstat(os.path.join(real, str(rel)))
                        except (OSError, ValueError):
                            continue
                        if st.st_dev == top.st_dev and not stat.S_ISLNK(st.st_mode):
                            into.add(st.st_ino)
        except (OSError, TypeError, ValueError, AttributeError):
            return
        self.hidden = frozenset(hidden)
        self.protected = frozenset(protected)
        self.dev = top.st_dev

    def protects(self, st: os.stat_result) -> bool:
        return st.st_dev == self.dev and st.st_ino in self.protected


class Root:
    """The workspace root: ``path`` as configured (absolute) and ``real``, its canonical
    form. Absolute arguments and absolute link targets are accepted when they lie under
    either spelling. ``policy``: the session's path policy (hide, protect); ``covered``:
    what it covered at the last scan, by identity (``Covered``)."""

    def __init__(self, path: str, policy: PathPolicy | None = None) -> None:
        self.path = os.path.abspath(path)
        self.real = os.path.realpath(self.path)
        self.policy = policy if policy is not None else PathPolicy()
        self.covered = Covered()
        self.scans: object = None  # tools.policyview's cache of directory listings
        # Where a scan keeps what it covered (``tools.binding.KeepsCovers.save_covers``),
        # and the key of what was kept last (saved again only when it changes).
        self.keep: Callable[[dict[str, Any]], None] | None = None
        self.kept: object = None

    def hides(self, rel: str, is_dir: bool = False) -> bool:
        """True when the agent must not see workspace path ``rel`` (by the policy's
        patterns; ``hides_found`` also by identity)."""
        return self.policy.hides(rel, is_dir)

    def hides_found(self) -> Callable[[str], bool]:
        """A test for paths a walk found under the root (Glob's and Grep's results): hidden
        by a pattern, or by identity (the path or a directory above it is a covered object
        under another name). Caches what it learns of directories for its own lifetime
        (one tool call)."""
        pol = self.policy
        if not pol.hide:
            return lambda rel: False
        covered = self.covered
        if not covered.hidden:
            return lambda rel: pol.hides(rel)
        dirs: dict[str, bool] = {}

        def by_identity(rel: str) -> bool:
            try:
                return covered.hides(os.lstat(os.path.join(self.real, rel)))
            except OSError:
                return False

        def test(rel: str) -> bool:
            if pol.hides(rel):
                return True
            parts = rel.split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                got = dirs.get(d)
                if got is None:
                    got = dirs[d] = by_identity(d)
                if got:
                    return True
            return by_identity(rel)
        return test

    def _check(self, rel: str, st: os.stat_result | None, write: bool) -> None:
        """Refuse ``rel`` under the policy: hidden -> not_found, protected (for a change)
        -> protected; by the patterns and by identity (``Covered``). A file with more than
        one link made after the last scan makes a scan first (tools.policyview), so a new
        link to a covered file is covered too."""
        pol = self.policy
        if not (pol.hide or pol.protect):
            return
        is_dir = st is not None and stat.S_ISDIR(st.st_mode)
        if pol.hides(rel, is_dir):
            raise PathError("not_found", rel)
        if write and pol.protects(rel, is_dir):
            raise PathError("protected", rel)
        if st is None:
            return
        covered = self.covered
        if not is_dir and st.st_nlink > 1 and (
                covered.scanned_ns is None
                or st.st_ctime_ns >= covered.scanned_ns - _LINK_MARGIN_NS):
            from tools.policyview import scan  # tools.policyview imports this module

            scan(self)
            covered = self.covered
        if covered.hides(st):
            raise PathError("not_found", rel)
        if write and covered.protects(st):
            raise PathError("protected", rel)

    def open(self) -> int:
        """An ``O_PATH`` descriptor of the root directory (caller closes it)."""
        return os.open(self.real, _DIR_FLAGS)

    def parts(self, text: str, shown: str) -> list[str]:
        """Components of ``text`` relative to the root; raises PathError(escape/invalid/
        tilde). A first component starting with ``~`` (``~``, ``~/x``, ``~user/x``) is
        refused: a shell would expand it to a home directory, so taking it literally would
        create a directory named ``~`` in the root."""
        if "\0" in text:
            raise PathError("invalid", shown, "contains a NUL byte")
        if text.startswith("~"):
            raise PathError("tilde", shown)
        if text.startswith("/"):
            given = _split(text)
            for base in (self.real, self.path):
                bparts = _split(base)
                if given[:len(bparts)] == bparts:
                    return given[len(bparts):]
            raise PathError("escape", shown)
        return _split(text)


def _split(text: str) -> list[str]:
    return [c for c in text.split("/") if c and c != "."]


@dataclass
class Located:
    """A resolved path: ``parent_fd`` (an owned ``O_PATH`` descriptor of the directory that
    holds the final component), ``name`` (that component; ``"."`` for the root itself),
    ``rel`` (the canonical path relative to the root, ``"."`` for the root) and ``st``
    (``lstat`` of the final component, None when it does not exist)."""

    parent_fd: int
    name: str
    rel: str
    st: os.stat_result | None

    def close(self) -> None:
        if self.parent_fd >= 0:
            os.close(self.parent_fd)
            self.parent_fd = -1

    def __enter__(self) -> Located:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def exists(self) -> bool:
        return self.st is not None

    @property
    def is_dir(self) -> bool:
        return self.st is not None and stat.S_ISDIR(self.st.st_mode)

    def open(self, flags: int, mode: int = 0o666) -> int:
        """Open the final component no-follow; a component that became a symbolic link
        since it was located raises PathError(changed)."""
        try:
            return os.open(self.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                           dir_fd=self.parent_fd)
        except OSError as e:
            if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and
                                          flags & os.O_DIRECTORY):
                raise PathError("changed", self.rel) from None
            raise PathError.from_os(self.rel, e) from None

    def open_dir(self) -> int:
        """A readable descriptor of the final component, which must be a directory."""
        return self.open(os.O_RDONLY | os.O_DIRECTORY)


def locate(root: Root, text: str, *, follow_final: bool = True,
           make_parents: bool = False, write: bool = False) -> Located:
    """Resolve ``text`` (relative to the root, or absolute under it) to a Located.

    Symbolic links are followed, the final one too unless ``follow_final`` is False, but
    only while they stay inside the root. Missing intermediate directories raise
    PathError(not_found) unless ``make_parents`` creates them. A missing final component
    is not an error (``st`` is None). ``write``: the caller means to change the final path
    (a protected one is refused). Raises PathError for every refusal.
    """
    shown = text if text else "."
    pending = root.parts(text, shown)
    pending.reverse()                      # pop() takes the next component
    stack: list[tuple[str, int]] = [("", root.open())]
    links = 0
    retries = 0
    try:
        while pending:
            comp = pending.pop()
            if comp == "..":
                if len(stack) == 1:
                    raise PathError("escape", shown)
                os.close(stack.pop()[1])
                continue
            if comp == ".":
                continue
            cur = stack[-1][1]
            last = not pending
            rel = _rel(stack, comp)
            try:
                st: os.stat_result | None = os.stat(comp, dir_fd=cur, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            except OSError as e:
                raise PathError.from_os(rel, e) from None
            # A change applies to the final path, and to a missing directory made on the
            # way; a followed link's target is checked when it is reached.
            root._check(rel, st, write and (st is None or (last and not (
                stat.S_ISLNK(st.st_mode) and follow_final))))
            if st is None:
                if last:
                    return _finish(stack, comp, rel, None)
                if not make_parents or retries >= MAX_RETRIES:
                    raise PathError("not_found", rel)
                retries += 1
                try:
                    os.mkdir(comp, 0o777, dir_fd=cur)
                except FileExistsError:
                    pass
                except OSError as e:
                    raise PathError.from_os(rel, e) from None
                pending.append(comp)
                continue
            if stat.S_ISLNK(st.st_mode):
                if last and not follow_final:
                    return _finish(stack, comp, rel, st)
                links += 1
                if links > MAX_LINKS:
                    raise PathError("loop", shown)
                try:
                    target = os.readlink(comp, dir_fd=cur)
                except OSError as e:
                    if e.errno in (errno.EINVAL, errno.ENOENT) and retries < MAX_RETRIES:
                        retries += 1           # changed since lstat: look again
                        pending.append(comp)
                        continue
                    raise PathError.from_os(rel, e) from None
                if not target:
                    raise PathError("not_found", rel)
                if target.startswith("/"):
                    tparts = root.parts(target, shown)
                    while len(stack) > 1:
                        os.close(stack.pop()[1])
                else:
                    tparts = _split(target)
                pending.extend(reversed(tparts))
                continue
            if last:
                return _finish(stack, comp, rel, st)
            if not stat.S_ISDIR(st.st_mode):
                raise PathError("not_dir", rel)
            try:
                fd = os.open(comp, _DIR_FLAGS, dir_fd=cur)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT) and \
                        retries < MAX_RETRIES:
                    retries += 1               # swapped since lstat: look again
                    pending.append(comp)
                    continue
                raise PathError.from_os(rel, e) from None
            stack.append((comp, fd))
        # The path named a directory already on the stack (root, "a/..", a link to a dir).
        if len(stack) == 1:
            fd = os.dup(stack[0][1])
            st = os.stat(fd)
            return _finish_owned(stack, fd, ".", ".", st)
        name = stack[-1][0]
        os.close(stack.pop()[1])
        rel = _rel(stack, name)
        try:
            st = os.stat(name, dir_fd=stack[-1][1], follow_symlinks=False)
        except OSError as e:
            raise PathError.from_os(rel, e) from None
        if stat.S_ISLNK(st.st_mode):
            raise PathError("changed", rel)
        root._check(rel, st, write)
        return _finish(stack, name, rel, st)
    except BaseException:
        for _, fd in stack:
            os.close(fd)
        raise


def _rel(stack: list[tuple[str, int]], comp: str) -> str:
    names = [n for n, _ in stack[1:]]
    names.append(comp)
    return "/".join(names)


def _finish(stack: list[tuple[str, int]], name: str, rel: str,
            st: os.stat_result | None) -> Located:
    """Keep the top directory's descriptor for the Located and close the rest."""
    parent = stack.pop()[1]
    for _, fd in stack:
        os.close(fd)
    stack.clear()
    return Located(parent, name, rel, st)


def _finish_owned(stack: list[tuple[str, int]], fd: int, name: str, rel: str,
                  st: os.stat_result) -> Located:
    for _, f in stack:
        os.close(f)
    stack.clear()
    return Located(fd, name, rel, st)


def open_located(root: Root, text: str, flags: int, *, follow_final: bool = True) -> \
        tuple[Located, int]:
    """Locate ``text`` and open it no-follow with ``flags``; a component that changed between
    the two steps is resolved again (a few times) before PathError(changed) is returned.
    Returns the Located (caller closes) and the open descriptor (caller closes)."""
    for attempt in range(MAX_RETRIES):
        loc = locate(root, text, follow_final=follow_final)
        try:
            if loc.st is None:
                raise PathError("not_found", loc.rel)
            return loc, loc.open(flags)
        except PathError as e:
            loc.close()
            if e.kind != "changed" or attempt == MAX_RETRIES - 1:
                raise
    raise AssertionError("unreachable")
