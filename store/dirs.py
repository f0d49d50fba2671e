"""Making a directory this program keeps its data in (a store, a state directory), with a
one-line cause when it cannot be made.

``os.makedirs`` reports only an errno and one path (``[Errno 17] File exists``); a user
needs to know which path is in the way and why. ``make_private_dir`` raises
``DirectoryError`` (exit 1) naming the directory's role, the path at fault and a fix; a
caller of another layer re-raises its message under its own error type.
"""

from __future__ import annotations

import errno
import os

from .errors import StoreError


class DirectoryError(StoreError):
    """A directory (``what``: its role, e.g. ``store``) cannot be made or used at ``path``:
    ``cause`` names the path at fault and what to do."""

    def __init__(self, what: str, path: str, cause: str) -> None:
        self.what = what
        self.path = path
        self.cause = cause
        super().__init__(f"{what} {path}: {cause}")


def _first_missing(path: str) -> tuple[str, str]:
    """The deepest existing ancestor of ``path`` and the child of it that is missing."""
    child = path
    parent = os.path.dirname(path)
    while parent != child and not os.path.lexists(parent):
        child, parent = parent, os.path.dirname(parent)
    return parent, child


def make_private_dir(path: str, what: str) -> None:
    """Make ``path`` (absolute) and its missing parents, mode 0700; a directory already
    there is kept as it is. Raises DirectoryError (exit 1) when ``path`` or one of its
    parents is not a directory, a level cannot be made (no permission, a read-only or
    virtual file system such as /proc) or a name is too long."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        return
    except OSError as e:
        err = e
    if err.errno == errno.ENAMETOOLONG:
        raise DirectoryError(what, path, "a name in it is too long (255 bytes at most per "
                                         "name); choose a shorter path") from None
    if os.path.lexists(path) and not os.path.isdir(path):
        raise DirectoryError(what, path, "it is a file, not a directory; give a directory "
                                         "(or move the file away)") from None
    parent, child = _first_missing(path)
    if os.path.lexists(parent) and not os.path.isdir(parent):
        raise DirectoryError(what, path, f"its parent {parent} is a file, not a directory; "
                                         "choose another path") from None
    reason = err.strerror or str(err)
    raise DirectoryError(what, path, f"{child} cannot be created in {parent} ({reason}); "
                                     "choose a path under a directory you can write") from None
