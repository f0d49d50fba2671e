"""Making a directory this program keeps its data in (a store, a state directory), with a
one-line cause when it cannot be made.

``os.makedirs`` reports only an errno and one path (``[Errno 17] File exists``); a user
needs to know which path is in the way and why. ``make_dir`` (and ``make_private_dir``,
mode 0700) raises ``DirectoryError`` (exit 1) naming the directory's role, the path at
fault and a fix; a caller of another layer re-raises its cause under its own error type.
"""

from __future__ import annotations

import errno
import os
import pwd

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


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def access_problem(path: str) -> str | None:
    """Why this user cannot read, write and search the directory ``path``: its owner and
    mode next to this user (``not accessible to this user alice (uid 1000): it belongs to
    root (uid 0), mode 0700``); None when it can, or when ``path`` is not there."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if os.access(path, os.R_OK | os.W_OK | os.X_OK):
        return None
    return (f"not accessible to this user {_user(os.geteuid())}: it belongs to "
            f"{_user(st.st_uid)}, mode {st.st_mode & 0o7777:04o}")


def make_private_dir(path: str, what: str) -> None:
    """``make_dir`` with mode 0700."""
    make_dir(path, what, 0o700)


def make_dir(path: str, what: str, mode: int) -> None:
    """Make ``path`` (absolute) and its missing parents with ``mode`` (less the umask); a
    directory already there is kept as it is. ``what``: its role in the messages. Raises
    DirectoryError (exit 1) when ``path`` or one of its parents is not a directory, this
    user cannot use it (``access_problem``), a level cannot be made (no permission, a
    read-only or virtual file system such as /proc) or a name is too long."""
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
    except OSError as e:
        err = e
    else:
        denied = access_problem(path)
        if denied:
            raise DirectoryError(what, path, f"{denied}; use a directory of yours, or run as "
                                             "its owner")
        return
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
    denied = access_problem(parent)
    if denied:
        raise DirectoryError(what, path, f"its parent {parent} is {denied}; choose a path "
                                         "under a directory of yours") from None
    reason = err.strerror or str(err)
    raise DirectoryError(what, path, f"{child} cannot be created in {parent} ({reason}); "
                                     "choose a path under a directory you can write") from None
