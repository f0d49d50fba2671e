"""A chain of nested directories deeper than PATH_MAX and Python's recursion limit:
``top/d/d/.../d``, built and removed one level at a time relative to a descriptor, with
two descriptors open at most (a user's limit may be 1,024)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

LINK = "d"                                     # the name of every directory of the chain


def make_chain(top: Path, depth: int, leaf: str, text: str) -> str:
    """Create ``depth`` nested directories under the existing directory ``top`` and the
    file ``leaf`` (mode 0600, holding ``text``) in the deepest; its path below ``top``."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):                 # os.makedirs itself recurses per level
            os.mkdir(LINK, dir_fd=fd)
            sub = os.open(LINK, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        with open(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), "w") as f:
            f.write(text)
    finally:
        os.close(fd)
    return "/".join([LINK] * depth + [leaf])


def remove_chain(top: Path, leaf: str) -> None:
    """Remove the chain below ``top`` (a file ``leaf`` at any level) without recursion:
    shutil.rmtree, and so pytest's tmp_path clean-up, recurse per level."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    depth = 0
    while True:                                # down to the bottom, one descriptor held
        try:
            sub = os.open(LINK, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        except FileNotFoundError:
            break
        os.close(fd)
        fd, depth = sub, depth + 1
    try:
        while True:                            # and up again through "..", removing
            with contextlib.suppress(FileNotFoundError):
                os.unlink(leaf, dir_fd=fd)
            if depth == 0:
                break
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd, depth = up, depth - 1
            os.rmdir(LINK, dir_fd=fd)
    finally:
        os.close(fd)
