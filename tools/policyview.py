"""The session's path policy inside the Bash sandbox: bwrap arguments for one call.

Computed when a call starts, from the paths that match then (a path created later by the
command is not covered until the next call):

- a ``hide`` match is covered by an empty, mode-0000 object: a tmpfs over a directory, an
  empty read-only file over anything else. Reading it fails with EACCES, changing or
  removing it with EACCES, EROFS or EBUSY, and nothing of its content is reachable. Its
  name still appears in its parent's listing (a bind mount cannot remove a directory
  entry).
- a ``protect`` match is bound read-only over itself (``--ro-bind-fd`` from a descriptor
  opened here without following links, so a path swapped for a symbolic link cannot bind
  something outside the root into the sandbox): changes fail with EROFS (EBUSY for
  removing or renaming the match itself).

Symbolic links are never covered (a bind would follow them); their targets are when they
match. The walk opens each directory relative to its parent with ``O_NOFOLLOW``
(tools.walk) and does not descend into a hidden directory. Cost: one ``scandir`` per
directory of the workspace plus one mount per match; nothing when the policy has no hide
and no protect patterns.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from tools.paths import Root
from tools.walk import list_dir, open_subdir

_PATH_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
Matcher = Callable[[str], bool] | None


@dataclass
class PolicyView:
    """bwrap arguments (``argv``) and the descriptors they name (``fds``, owned: pass them to
    ``sandbox.start_shell``, which closes them, or call :meth:`close`). ``hidden`` and
    ``protected``: the workspace paths covered, in walk order."""

    argv: list[str] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    protected: list[str] = field(default_factory=list)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


@functools.cache
def _empty_file() -> str:
    """An empty mode-0000 file of this process (in a private 0700 directory, removed at
    exit), the source bound over hidden files."""
    d = tempfile.mkdtemp(prefix="rewindfs-hidden-")
    path = os.path.join(d, "empty")
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0))
    os.chmod(path, 0)
    atexit.register(shutil.rmtree, d, True)
    return path


def policy_view(root: Root) -> PolicyView:
    """The view of ``root``'s path policy for a command starting now (module docstring)."""
    view = PolicyView()
    pol = root.policy
    if not (pol.hide or pol.protect):
        return view
    try:
        top = os.open(root.real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return view
    try:
        _walk(root, top, ".", view)
    except BaseException:
        view.close()
        raise
    finally:
        os.close(top)
    return view


def _walk(root: Root, fd: int, prefix: str, view: PolicyView, covered: bool = False,
          tests: tuple[Matcher, Matcher] | None = None) -> None:
    """Cover the matches under directory ``fd`` (workspace path ``prefix``); ``covered``: an
    ancestor is bound read-only already, so only hidden matches are added below it."""
    hide, protect = tests if tests is not None else (root.policy.matcher("hide"),
                                                     root.policy.matcher("protect"))
    pre = "" if prefix in ("", ".") else prefix + "/"
    real = root.real + "/"
    for entry in list_dir(fd):
        try:                               # the entry's type from readdir: no stat
            if entry.is_symlink():
                continue
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        rel = pre + entry.name
        path = rel + "/" if is_dir else rel
        if hide is not None and hide(path):
            if is_dir:
                view.argv += ["--perms", "0000", "--tmpfs", real + rel]
            else:
                view.argv += ["--ro-bind", _empty_file(), real + rel]
            view.hidden.append(rel)
            continue                       # nothing under a hidden directory is reachable
        here = covered
        if not covered and protect is not None and protect(path):
            try:
                pfd = os.open(entry.name, _PATH_FLAGS, dir_fd=fd)
            except OSError:
                continue
            view.fds.append(pfd)
            now = os.fstat(pfd)
            if stat.S_ISLNK(now.st_mode):
                continue                   # swapped for a link since listed: never bound
            is_dir = stat.S_ISDIR(now.st_mode)
            view.argv += ["--ro-bind-fd", str(pfd), real + rel]
            view.protected.append(rel)
            here = True
        if is_dir and (hide is not None or not here):
            sub = open_subdir(fd, entry.name)
            if sub is None:
                continue
            try:
                _walk(root, sub, rel, view, here, (hide, protect))
            finally:
                os.close(sub)
