"""The session's path policy inside the Bash sandbox: bwrap arguments for one call.

Computed when a call starts (``scan``), from what the policy covers then (a path created
later by the command is not covered until the next call):

- a ``hide`` match is covered by an empty, mode-0000, read-only object: a tmpfs over a
  directory, an empty file over anything else. Reading it fails with EACCES, changing or
  removing it with EACCES, EROFS or EBUSY, and nothing of its content is reachable. Its
  name still appears in its parent's listing (a bind mount cannot remove a directory
  entry; ``ls`` shows the name, with mode 0000 and size 0).
- a ``protect`` match is bound read-only over itself: changes fail with EROFS (EBUSY for
  removing or renaming the match itself).

How. Where ``sandbox.covers_in_sandbox`` (the kernel's mount API, and entering a
sandbox's namespaces), each cover is a ``sandbox.Cover`` naming the object by its path and
its identity (st_dev, st_ino, taken here without following links); once bwrap has built
the sandbox, and before the command runs, a helper makes them in the sandbox's mount
namespace, on the object found beneath the root without following any link and only if it
is still that object (else nothing runs).
Elsewhere they are bwrap arguments: ``--perms 0000 --tmpfs`` over a hidden directory,
``--ro-bind`` of the empty file over a hidden file, ``--ro-bind-fd`` from a descriptor
opened here without following links for a protected path (so a path swapped for a
symbolic link cannot bind something outside the root into the sandbox).

Identity. A match stays covered under another name (``tools.paths.Covered``): each scan
records the inode numbers of everything it covers (the matches and everything below them),
and the next scan covers those objects again wherever it meets them, so renaming a parent
directory of a hidden file (``mv secrets x``) leaves ``x/.env`` hidden; and a hard link to
a covered file, wherever it is, is covered like the file (inside the sandbox ``ln`` of a
covered file already fails with EXDEV: it is a mount of its own). The agent's tools check
the same identities (``tools.paths``).

Symbolic links are never covered (a bind would follow them); their targets are when they
match. The walk opens each directory relative to its parent with ``O_NOFOLLOW``
(tools.walk); below a covered directory it only records identities.

Cost. One ``open`` and ``fstat`` per directory of the workspace; a directory's listing
(and its entries' verdicts under the patterns) is kept between calls and read again only
when the directory changed (its inode, mtime or ctime differ, which every entry created,
removed or renamed in it changes, and which nothing unprivileged can set back), or changed
less than a second before it was listed (times come from a coarse clock). Plus one mount
per covered path: a few system calls each when made in the sandbox, about 1 ms each through
bwrap's binds (bwrap reads the whole mount table after every bind, so n binds cost
O(n^2)); nothing when the policy has no hide and no protect patterns.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tools.paths import Root
from tools.sandbox import Cover, CoverSet, covers_in_sandbox, empty_file
from tools.walk import list_dir, open_subdir

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
Matcher = Callable[[str], bool] | None
# A listing is kept only for a directory whose last change is at least this much older
# than the listing: a later change then gets a later time even from a coarse clock.
_SETTLED_NS = 1_000_000_000
# Walks of one scan before it gives up on a tree that keeps changing under it.
_ATTEMPTS = 3


class _Raced(Exception):
    """The tree changed under a walk at workspace path ``path`` (``scan`` walks again)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


@dataclass
class PolicyView:
    """How the sandbox covers the policy for one call: ``covers`` (``sandbox.Cover``, made
    in the sandbox, see :meth:`cover_set`) where ``sandbox.covers_in_sandbox``, else
    bwrap arguments (``argv``) and the descriptors they name (``fds``, owned: pass them to
    ``sandbox.start_shell``, which closes them, or call :meth:`close`). ``hidden`` and
    ``protected``: the workspace paths covered, in walk order; ``root_id``: the root's
    (st_dev, st_ino) when the scan opened it."""

    argv: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)
    covers: list[Cover] = field(default_factory=list)
    root_id: tuple[int, int] = (0, 0)

    def cover_set(self) -> CoverSet | None:
        """The covers for ``sandbox.start_shell(covers=...)``; None when there are none."""
        if not self.covers:
            return None
        return CoverSet(tuple(self.covers), self.root_id[0], self.root_id[1], empty_file())

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


@dataclass
class _Listing:
    """One directory as last listed: ``key`` (inode, mtime, ctime) on device ``dev``; its
    entries that are not symbolic links by name (is a directory, inode number) and by
    inode number (names), ``inos``/``file_inos`` (of all of them, of the non-directories),
    ``subdirs`` (names), and the names the patterns hide and protect."""

    key: tuple[int, int, int]
    dev: int
    entries: dict[str, tuple[bool, int]]
    by_ino: dict[int, list[str]]
    inos: frozenset[int]
    file_inos: frozenset[int]
    subdirs: tuple[str, ...]
    hide: frozenset[str]
    protect: frozenset[str]
    plan: _Plan | None = None


@dataclass(frozen=True)
class _Plan:
    """What one scan did in a directory (``_Walk.plan``), under ``mode`` and the covered
    identities ``was_hidden`` and ``was_protected`` of the scan before it: the covers it
    made (``sandbox.Cover``, workspace path), the identities it recorded, whether the
    directory is an uncovered one (``open_dir``: its other names of covered files are
    covered too, ``_Walk.aliases``), and the subdirectories walked, with their modes."""

    mode: str | None
    was_hidden: frozenset[int]
    was_protected: frozenset[int]
    covers: tuple[tuple[Cover, str], ...]
    hidden_inos: frozenset[int]
    protected_inos: frozenset[int]
    open_dir: bool
    below: tuple[tuple[str, str | None], ...]


class _Cache:
    """Listings by workspace path (``Root.scans``), the lock serializing scans, and the
    other names of covered files the last scan covered (``aliases``: the covered
    identities it started from, and its covers; ``_Walk.aliases``)."""

    def __init__(self) -> None:
        self.dirs: dict[str, _Listing] = {}
        self.lock = threading.Lock()
        self.aliases: tuple[frozenset[int], frozenset[int], tuple[tuple[Cover, str], ...]] \
            | None = None


def policy_view(root: Root) -> PolicyView:
    """The view of ``root``'s path policy for a command starting now (module docstring)."""
    return scan(root, want_view=True)


def scan(root: Root, want_view: bool = False) -> PolicyView:
    """Walk the workspace, cover what the policy covers now (patterns and identities),
    record the identities in ``root.covered``, and (``want_view``) build the bwrap
    arguments. An unreadable root covers nothing.

    Fails closed: a walk that a concurrent change made inconsistent (a directory it
    listed gone or replaced before it was walked, or any directory changed between its
    listing and the end of the walk, so that a subtree may have moved where the walk had
    already been) is walked again, up to ``_ATTEMPTS`` times; then OSError (ESTALE) is
    raised and nothing is recorded (``root.covered`` keeps the identities of the last
    consistent scan, so a covered file renamed during the race stays covered)."""
    view = PolicyView()
    pol = root.policy
    if not (pol.hide or pol.protect):
        return view
    cache = root.scans
    if not isinstance(cache, _Cache):
        cache = root.scans = _Cache()
    with cache.lock:
        for attempt in range(_ATTEMPTS):
            started = time.time_ns()
            try:
                top = os.open(root.real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                return view
            try:
                st = os.fstat(top)
                view.root_id = (st.st_dev, st.st_ino)
                w = _Walk(root, cache, view, want_view, started)
                w.walk(top)
                w.aliases(top)
                w.recheck(top)
                break
            except _Raced as e:
                view.close()
                view = PolicyView()
                cache.aliases = None
                if attempt + 1 == _ATTEMPTS:
                    raise OSError(errno.ESTALE, f"{e.path or '.'} kept changing while the "
                                  "session's path policy was applied; nothing ran") from None
            except BaseException:
                view.close()
                raise
            finally:
                os.close(top)
        covered = root.covered
        # The same objects when unchanged: a kept plan is for the identities it was made under.
        hidden, protected = frozenset(w.hidden_inos), frozenset(w.protected_inos)
        if hidden != covered.hidden:
            covered.hidden = hidden
        if protected != covered.protected:
            covered.protected = protected
        covered.dev = w.dev
        covered.scanned_ns = started
        cache.dirs = w.seen
        if root.keep is not None:
            _keep(root, view)
    return view


def _keep(root: Root, view: PolicyView) -> None:
    """Save what this scan covered with the session when it differs from what was saved
    last; a failure to save keeps the old record (the patterns still apply)."""
    covered = root.covered
    key = (view.root_id, covered.hidden, covered.protected, tuple(view.hidden),
           tuple(view.protected))
    if key == root.kept or root.keep is None:
        return
    try:
        root.keep(covered.record(view.root_id, view.hidden, view.protected))
    except OSError:
        return
    root.kept = key


class _Walk:
    """One scan (``scan``)."""

    def __init__(self, root: Root, cache: _Cache, view: PolicyView, want_view: bool,
                 started: int) -> None:
        self.root = root
        self.real = root.real + "/"
        self.cache = cache
        self.old = cache.dirs
        self.replanned = False                 # some directory's plan was made anew
        self.seen: dict[str, _Listing] = {}
        self.view = view
        self.want_view = want_view
        self.premount = want_view and covers_in_sandbox()
        self.started = started
        self.hide = root.policy.matcher("hide")
        self.protect = root.policy.matcher("protect")
        self.was_hidden = root.covered.hidden
        self.was_protected = root.covered.protected
        self.hidden_inos: set[int] = set()
        self.protected_inos: set[int] = set()
        self.dev: int | None = None
        self.open_dirs: list[tuple[str, _Listing]] = []   # uncovered directories met
        self.done: set[str] = set()                        # paths covered
        self.listed: list[tuple[str, _Listing]] = []       # every directory listed

    def listing(self, top: int, prefix: str) -> _Listing | None:
        """Directory ``prefix`` (``""``: the root ``top``): its kept listing when its
        inode, mtime and ctime are those it had when listed (a ``stat`` by path, no open:
        on a FUSE mount an open and a close are two requests to the daemon), else read now
        from the directory opened one component at a time without following a link. None
        when it cannot be read; raises _Raced when it is gone or no directory (any more):
        its parent listed it as one, so the tree changed under the walk."""
        try:
            st = os.stat(prefix or ".", dir_fd=top, follow_symlinks=False)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                raise _Raced(prefix) from None
            return None
        if not stat.S_ISDIR(st.st_mode):
            raise _Raced(prefix)
        if self.dev is None:
            self.dev = st.st_dev
        got = self.old.get(prefix)
        if got is not None and got.key == (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) \
                and got.dev == st.st_dev:
            self.seen[prefix] = got
            self.listed.append((prefix, got))
            return got
        fd = self.open_path(top, prefix)
        if fd is None:
            raise _Raced(prefix)
        try:
            rec = self.read_listing(fd, prefix)
        finally:
            if fd != top:
                os.close(fd)
        if rec is not None:
            self.listed.append((prefix, rec))
        return rec

    def read_listing(self, fd: int, prefix: str) -> _Listing | None:
        """The listing of directory ``fd`` (workspace path ``prefix``), kept for the next
        scan once the directory is settled (``_SETTLED_NS``)."""
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
        pre = prefix + "/" if prefix else ""
        entries: dict[str, tuple[bool, int]] = {}
        by_ino: dict[int, list[str]] = {}
        hide: set[str] = set()
        protect: set[str] = set()
        for name, (is_dir, ino) in _entries(fd).items():
            entries[name] = (is_dir, ino)
            by_ino.setdefault(ino, []).append(name)
            path = pre + name + ("/" if is_dir else "")
            if self.hide is not None and self.hide(path):
                hide.add(name)
            if self.protect is not None and self.protect(path):
                protect.add(name)
        rec = _Listing(key, st.st_dev, entries, by_ino, frozenset(by_ino),
                       frozenset(ino for is_dir, ino in entries.values() if not is_dir),
                       tuple(n for n, (is_dir, _) in entries.items() if is_dir),
                       frozenset(hide), frozenset(protect))
        if self.started - st.st_ctime_ns >= _SETTLED_NS:
            self.seen[prefix] = rec
        return rec

    def walk(self, top: int) -> None:
        """Walk the tree below the root ``top``, depth first and in listing order, with
        a stack of its own (a tree deeper than Python's recursion limit is walked too)."""
        todo: list[tuple[str, str | None]] = [("", None)]
        while todo:
            prefix, mode = todo.pop()
            below = self.dir(top, prefix, mode)
            pre = prefix + "/" if prefix else ""
            todo.extend((pre + name, sub) for name, sub in reversed(below))

    def recheck(self, top: int) -> None:
        """Raise _Raced unless every directory listed is as it was listed: same inode,
        mtime and ctime (a stat by path each), and, for one changed less than
        ``_SETTLED_NS`` before the walk began (a coarse clock may give a later change the
        same times), the same entries."""
        for prefix, rec in self.listed:
            try:
                st = os.stat(prefix or ".", dir_fd=top, follow_symlinks=False)
            except OSError:
                raise _Raced(prefix) from None
            if (st.st_ino, st.st_mtime_ns, st.st_ctime_ns) != rec.key \
                    or st.st_dev != rec.dev:
                raise _Raced(prefix)
            if self.started - st.st_ctime_ns < _SETTLED_NS:
                fd = self.open_path(top, prefix)
                if fd is None:
                    raise _Raced(prefix)
                try:
                    same = _entries(fd) == rec.entries
                finally:
                    if fd != top:
                        os.close(fd)
                if not same:
                    raise _Raced(prefix)

    def dir(self, top: int, prefix: str, mode: str | None) -> tuple[tuple[str, str | None], ...]:
        """Walk directory ``prefix`` below the root ``top`` (``""`` for the root);
        ``mode``: ``hide`` or ``protect`` when an ancestor is covered so (only identities
        are recorded below it, and hidden matches below a protected one). Per directory
        the work is set operations over its kept listing, plus the covered entries. The
        subdirectories to walk next, with their modes."""
        rec = self.listing(top, prefix)
        if rec is None:
            return ()
        plan = rec.plan
        if plan is None or plan.mode != mode or plan.was_hidden is not self.was_hidden \
                or plan.was_protected is not self.was_protected \
                or self.old.get(prefix) is not rec:
            plan = self.plan(top, rec, prefix, mode)
        elif plan.covers:                      # unchanged since the last scan: its covers
            view = self.view
            for c, rel in plan.covers:
                view.covers.append(c)
                (view.hidden if c.hide else view.protected).append(rel)
                self.done.add(rel)
        self.hidden_inos |= plan.hidden_inos
        self.protected_inos |= plan.protected_inos
        if plan.open_dir:
            self.open_dirs.append((prefix, rec))
        return plan.below

    def plan(self, top: int, rec: _Listing, prefix: str, mode: str | None) -> _Plan:
        """What the walk does in directory ``prefix`` (listing ``rec``, ``mode`` as for
        :meth:`dir`): its covers made now (added to the view), the identities recorded,
        the subdirectories to walk. Kept with the listing (``rec.plan``) when the covers
        are made in the sandbox: a later scan that finds the directory unchanged, under
        the same identities covered before, reuses it (the covered objects' identities
        included: a name in an unchanged directory is the same object)."""
        # Identities are those of the root's file system; a file system mounted inside it
        # is covered by the patterns alone.
        same = rec.dev == self.dev
        pre = prefix + "/" if prefix else ""
        below: dict[str, str | None] = {}     # subdirectory -> its mode
        hidden_inos: set[int] = set()
        protected_inos: set[int] = set()
        open_dir = False
        first = len(self.view.covers)
        if mode == "hide":
            if same:
                hidden_inos |= rec.inos
            below = dict.fromkeys(rec.subdirs, "hide")
        else:
            hide = set(rec.hide)
            if same and self.was_hidden:
                for ino in rec.inos & self.was_hidden:
                    hide.update(rec.by_ino[ino])
            protect: set[str] = set()
            if mode != "protect":
                protect = set(rec.protect)
                if same and self.was_protected:
                    for ino in rec.inos & self.was_protected:
                        protect.update(rec.by_ino[ino])
                protect -= hide
            for name in sorted(hide):
                is_dir, ino = rec.entries[name]
                self.cover(top, pre + name, is_dir, "hide")
                if same:
                    hidden_inos.add(ino)
                if is_dir:
                    below[name] = "hide"
            for name in sorted(protect):
                is_dir, ino = rec.entries[name]
                if not self.cover(top, pre + name, is_dir, "protect"):
                    continue
                if same:
                    protected_inos.add(ino)
                if is_dir:
                    below[name] = "protect"
            if mode == "protect":
                if same:
                    protected_inos |= rec.inos - {rec.entries[n][1] for n in hide}
            elif same:
                open_dir = True
            for name in rec.subdirs:
                if name not in below and name not in hide:
                    below[name] = mode
        made = self.view.covers[first:]
        plan = _Plan(mode, self.was_hidden, self.was_protected,
                     tuple((c, os.fsdecode(c.rel)) for c in made), frozenset(hidden_inos),
                     frozenset(protected_inos), open_dir, tuple(below.items()))
        self.replanned = True
        if self.premount:
            rec.plan = plan
        return plan

    def cover(self, top: int, rel: str, is_dir: bool, kind: str) -> bool:
        """Add the mount covering workspace path ``rel`` (below the root ``top``); False
        when it is not covered after all (gone, or a symbolic link now)."""
        view = self.view
        if self.premount:
            # The identity the cover maker checks. A directory on the way swapped for a
            # link since it was walked makes this another object's: the cover maker, which
            # follows no link, then finds none there, and nothing runs.
            try:
                st = os.stat(rel, dir_fd=top, follow_symlinks=False)
            except OSError:
                return False
            if stat.S_ISLNK(st.st_mode):
                return False                   # swapped for a link since listed: never bound
            view.covers.append(Cover(os.fsencode(rel), kind == "hide",
                                     stat.S_ISDIR(st.st_mode), st.st_dev, st.st_ino))
            (view.hidden if kind == "hide" else view.protected).append(rel)
            self.done.add(rel)
            return True
        if kind == "hide":
            if self.want_view:
                if is_dir:
                    view.argv += ["--perms", "0000", "--tmpfs", self.real + rel]
                else:
                    view.argv += ["--ro-bind", empty_file(), self.real + rel]
            view.hidden.append(rel)
            self.done.add(rel)
            return True
        if self.want_view:
            parent, _, name = rel.rpartition("/")
            fd = self.open_path(top, parent)
            if fd is None:
                return False
            try:
                pfd = os.open(name, _PATH_FLAGS, dir_fd=fd)
            except OSError:
                return False
            finally:
                if fd != top:
                    os.close(fd)
            view.fds.append(pfd)
            if stat.S_ISLNK(os.fstat(pfd).st_mode):
                return False                   # swapped for a link since listed: never bound
            view.argv += ["--ro-bind-fd", str(pfd), self.real + rel]
        view.protected.append(rel)
        self.done.add(rel)
        return True

    def aliases(self, top: int) -> None:
        """Cover the other names of covered files met in uncovered directories (hard
        links), like the files themselves. When every directory's plan was kept, under
        the identities the last scan started from, those are the names it covered."""
        memo, view = self.cache.aliases, self.view
        if memo is not None and not self.replanned and memo[0] is self.was_hidden \
                and memo[1] is self.was_protected:
            for c, rel in memo[2]:
                view.covers.append(c)
                (view.hidden if c.hide else view.protected).append(rel)
                self.done.add(rel)
            return
        first = len(view.covers)
        self.scan_aliases(top)
        self.cache.aliases = None
        if self.premount:
            self.cache.aliases = (self.was_hidden, self.was_protected,
                                  tuple((c, os.fsdecode(c.rel)) for c in view.covers[first:]))

    def scan_aliases(self, top: int) -> None:
        covered = self.hidden_inos | self.protected_inos
        for prefix, rec in self.open_dirs:
            pre = prefix + "/" if prefix else ""
            found = rec.file_inos & covered
            if not found:
                continue
            todo = [(name, ino) for ino in found for name in rec.by_ino[ino]
                    if pre + name not in self.done]
            if not todo:
                continue
            for name, ino in todo:
                kind = "hide" if ino in self.hidden_inos else "protect"
                self.cover(top, pre + name, False, kind)

    def open_path(self, top: int, prefix: str) -> int | None:
        """Directory ``prefix`` opened one component at a time, never following a link."""
        fd = top
        for comp in prefix.split("/") if prefix else ():
            sub = open_subdir(fd, comp)
            if fd != top:
                os.close(fd)
            if sub is None:
                return None
            fd = sub
        return fd


def _entries(fd: int) -> dict[str, tuple[bool, int]]:
    """The entries of directory ``fd`` that are not symbolic links: name -> (is a
    directory, inode number), from readdir alone (no stat)."""
    out: dict[str, tuple[bool, int]] = {}
    for entry in list_dir(fd):
        try:
            if entry.is_symlink():
                continue
            out[entry.name] = (entry.is_dir(follow_symlinks=False), entry.inode())
        except OSError:
            continue
    return out
