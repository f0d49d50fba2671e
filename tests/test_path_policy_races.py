"""The Bash sandbox's policy scan against a tree that changes while it is walked (issue 14).

A background command, or the user, may rename directories while the scan runs. A walk that
missed a subtree would leave a hidden file without a cover (readable by the next command)
and drop its identity from the session's record (readable by every tool afterwards). These
tests make the change at the exact point of the walk where it hurts, on a real directory:
the scan walks again, or fails closed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from tree_support import make_chain, remove_chain

from store.pathpolicy import PathPolicy
from tools import policyview
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.paths import Root

SECRET = "API_KEY=very-secret-value\n"


def _root(tmp_path: Path, hide: tuple[str, ...] = (".env",)) -> tuple[Path, Root]:
    top = tmp_path / "root"
    top.mkdir()
    ctx = ToolContext(DirBinding(top, policy=PathPolicy(hide=hide)))
    return top, ctx.root


def _on_listing(monkeypatch: pytest.MonkeyPatch,
                hook: Callable[[str], None]) -> None:
    """Call ``hook(prefix)`` each time the walk is about to list directory ``prefix``."""
    listing = policyview._Walk.listing

    def wrapped(self: policyview._Walk, top: int, prefix: str) -> object:
        hook(prefix)
        return listing(self, top, prefix)

    monkeypatch.setattr(policyview._Walk, "listing", wrapped)


def test_a_directory_renamed_after_its_parent_was_listed_is_still_covered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mv sub zz`` between the root's listing and the walk of ``sub``: the hidden file,
    now ``zz/deep/.env``, is covered and its identity recorded."""
    top, root = _root(tmp_path)
    (top / "sub" / "deep").mkdir(parents=True)
    (top / "sub" / "deep" / ".env").write_text(SECRET)
    moved: list[str] = []

    def hook(prefix: str) -> None:
        if prefix == "sub" and not moved:
            os.rename(top / "sub", top / "zz")
            moved.append(prefix)

    _on_listing(monkeypatch, hook)
    view = policyview.scan(root, want_view=True)
    view.close()
    assert moved
    assert "zz/deep/.env" in view.hidden, view.hidden
    assert root.covered.hides((top / "zz" / "deep" / ".env").stat())


def test_a_subtree_moved_where_the_walk_had_been_is_still_covered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory not yet walked is moved into one already listed: the walk would not meet
    it anywhere; the scan sees the listed directory changed and walks again."""
    top, root = _root(tmp_path)
    for d in ("a", "b"):
        (top / d / "inner").mkdir(parents=True)
        (top / d / "inner" / ".env").write_text(SECRET)
    first: list[str] = []

    def hook(prefix: str) -> None:
        if prefix in ("a", "b"):
            if not first:
                first.append(prefix)           # listed next: the walk has been there
            elif len(first) == 1 and prefix != first[0]:
                os.rename(top / prefix / "inner", top / first[0] / "moved")
                first.append(prefix)

    _on_listing(monkeypatch, hook)
    view = policyview.scan(root, want_view=True)
    view.close()
    assert len(first) == 2
    assert f"{first[0]}/moved/.env" in view.hidden, view.hidden
    assert root.covered.hides((top / first[0] / "moved" / ".env").stat())


def test_a_tree_that_keeps_changing_fails_closed_and_keeps_what_was_covered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rename loop racing every walk: the scan raises ESTALE (the Bash call runs nothing)
    and the identities of the last whole scan stay recorded, so the file stays hidden for
    the tools under any name."""
    top, root = _root(tmp_path)
    (top / "sub" / "deep").mkdir(parents=True)
    (top / "sub" / "deep" / ".env").write_text(SECRET)
    policyview.scan(root, want_view=True).close()
    secret = (top / "sub" / "deep" / ".env").stat()
    assert root.covered.hides(secret)

    def hook(prefix: str) -> None:
        if prefix == "sub":
            os.rename(top / "sub", top / "zz")
        elif prefix == "zz":
            os.rename(top / "zz", top / "sub")

    (top / "new").mkdir()                      # the root changed: its listing is read again
    _on_listing(monkeypatch, hook)
    with pytest.raises(OSError) as got:
        policyview.scan(root, want_view=True)
    assert got.value.errno == errno.ESTALE
    assert "nothing ran" in str(got.value)
    assert root.covered.hides(secret)


def test_a_tree_deeper_than_the_recursion_limit_is_walked(tmp_path: Path) -> None:
    """1,200 nested directories (a command's ``mkdir a; cd a`` loop): the scan covers the
    hidden file at the bottom instead of failing every later call."""
    top, root = _root(tmp_path)
    try:
        rel = make_chain(top, 1200, ".env", SECRET)
        view = policyview.scan(root, want_view=True)
        view.close()
        assert rel in view.hidden
    finally:
        remove_chain(top, ".env")
