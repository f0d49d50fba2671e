"""Descriptor-based directory walking shared by Glob and the Python Grep.

Every directory is opened relative to its parent's descriptor with ``O_NOFOLLOW``, so a
walk never leaves the directory it started in, even when a directory is swapped for a
symbolic link while it runs (the open fails and the entry is skipped). Symbolic links are
never followed. Also owns the list of noise directories the tools prune.
"""

from __future__ import annotations

import os

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
