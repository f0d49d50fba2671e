"""File size limit of a session overlay: sizes a checkpoint could not list get EFBIG."""

from __future__ import annotations

import errno
import os

import pytest
from test_overlay import Env, env, ino, ov, read, write  # noqa: F401,F811

from fusefs.overlay import MAX_FILE_SIZE, Overlay


def test_truncate_and_write_beyond_the_limit_are_efbig(env: Env, ov: Overlay) -> None:  # noqa: F811
    write(ov, "huge", b"abc")
    i = ino(ov, "huge")
    with pytest.raises(OSError) as e:
        ov.setattr(i, size=MAX_FILE_SIZE + 1)
    assert e.value.errno == errno.EFBIG
    assert ov.getattr(i).size == 3
    fh = ov.open(i, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as e:
            ov.write(fh, MAX_FILE_SIZE, b"x")
        assert e.value.errno == errno.EFBIG
    finally:
        ov.release(fh)
    assert read(ov, "huge") == b"abc"
    ov.setattr(i, size=MAX_FILE_SIZE)
    assert ov.getattr(i).size == MAX_FILE_SIZE
