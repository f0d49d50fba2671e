"""Descriptor-based directory walking for Glob, and the ignore rules Glob and Grep share.

Every directory is opened relative to its parent's descriptor with ``O_NOFOLLOW``, so a
walk never leaves the directory it started in, even when a directory is swapped for a
symbolic link while it runs (the open fails and the entry is skipped). Symbolic links are
never followed. Also owns the list of noise directories the tools prune and the ignore
files they honour (``.gitignore``, ``.ignore``, ``.rgignore``, from the root down, with
gitignore semantics as ripgrep applies them with ``--no-require-git``).
"""

from __future__ import annotations

import os
import stat

import pathspec

# Directories that hold tool state, caches or dependencies rather than the project's source.
NOISE_DIRS = frozenset({
    ".git", ".hg", ".svn", "node_modules", ".venv", "venv", "__pycache__", ".mypy_cache",
    ".pytest_cache", ".ruff_cache", ".tox", ".nox", ".gradle", ".idea", ".cache",
})

_SUBDIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def open_subdir(parent_fd: int, name: str) -> int | None:
    """A readable descriptor of directory ``name`` under ``parent_fd``; None when it is
    gone, is not a directory (any more) or cannot be opened."""
    try:
        return os.open(name, _SUBDIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None


def list_dir(fd: int) -> list[os.DirEntry[str]]:
    """Entries of the directory open at ``fd`` (empty when it cannot be read)."""
    try:
        with os.scandir(fd) as it:
            return list(it)
    except OSError:
        return []


def join(prefix: str, name: str) -> str:
    """``prefix/name`` for workspace-relative paths, where the root's prefix is ``"."``."""
    return name if prefix in ("", ".") else f"{prefix}/{name}"


IGNORE_FILES = (".gitignore", ".ignore", ".rgignore")   # later ones take precedence
_IGNORE_FILE_MAX = 1 << 20                              # bytes read of one ignore file


def _read_small(fd: int, name: str) -> list[str] | None:
    try:
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                    dir_fd=fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(f).st_mode):
            return None
        data = os.read(f, _IGNORE_FILE_MAX)
    except OSError:
        return None
    finally:
        os.close(f)
    return data.decode("utf-8", errors="replace").splitlines()


class Ignores:
    """Ignore rules in force at one directory: (directory prefix, spec) pairs, outermost
    first. ``with_dir`` adds a directory's own ignore files; ``ignored`` applies the rules
    to a workspace path the way git does (the last matching rule wins, ``!`` re-includes)."""

    def __init__(self, rules: tuple[tuple[str, pathspec.PathSpec], ...] = ()) -> None:
        self.rules = rules

    def with_dir(self, fd: int, prefix: str, names: set[str] | frozenset[str]) -> Ignores:
        """The rules below the directory open at ``fd`` (workspace path ``prefix``, empty
        or ending with "/"), whose entry names are ``names``."""
        added = []
        for fname in IGNORE_FILES:
            if fname not in names:
                continue
            lines = _read_small(fd, fname)
            if lines:
                added.append((prefix, pathspec.GitIgnoreSpec.from_lines(lines)))
        return Ignores(self.rules + tuple(added)) if added else self

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


def ancestor_ignores(root_fd: int, parts: list[str]) -> Ignores:
    """The rules in force at the directory ``parts`` below the root open at ``root_fd``:
    the ignore files of the root and of each directory on the way (not of the last one,
    which the walk reads itself)."""
    ign = Ignores()
    fd = os.dup(root_fd)
    prefix = ""
    try:
        for part in parts:
            ign = ign.with_dir(fd, prefix, {e.name for e in list_dir(fd)})
            sub = open_subdir(fd, part)
            if sub is None:
                return ign
            os.close(fd)
            fd = sub
            prefix += part + "/"
        return ign
    finally:
        os.close(fd)
