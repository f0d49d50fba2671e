"""Containment: no tool argument reads, lists or writes outside the workspace root.

Attacks: ``..``, absolute paths, relative and absolute symbolic links (to files and to
directories), link loops, a sibling directory whose name extends the root's, and a directory
swapped for a link to the outside while the tool runs (a few thousand times).
"""

from __future__ import annotations

import os
from pathlib import Path

import fusehelpers as fh
import pytest

from tools.binding import DirBinding
from tools.context import ToolContext
from tools.editfile import edit_file
from tools.readfile import read_file
from tools.writefile import write_file

SECRET = "SECRET-OUTSIDE"


@pytest.fixture
def env(tmp_path: Path) -> tuple[ToolContext, Path, Path]:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    sibling = tmp_path / "root2"
    for d in (root / "a" / "b", outside / "d", sibling):
        d.mkdir(parents=True)
    (root / "a" / "b" / "f.txt").write_text("inside\n")
    (outside / "secret.txt").write_text(SECRET + "\n")
    (outside / "d" / "secret.txt").write_text(SECRET + "\n")
    (sibling / "secret.txt").write_text(SECRET + "\n")
    os.symlink("../outside/secret.txt", root / "rel_file")
    os.symlink("../outside/d", root / "rel_dir")
    os.symlink(str(outside / "secret.txt"), root / "abs_file")
    os.symlink(str(outside / "d"), root / "abs_dir")
    os.symlink("a/../../outside/secret.txt", root / "sneaky")
    os.symlink("self", root / "self")
    os.symlink("ping", root / "pong")
    os.symlink("pong", root / "ping")
    os.symlink("a/b", root / "inner_dir")
    os.symlink(str(root / "a" / "b" / "f.txt"), root / "abs_inner")
    return ToolContext(DirBinding(root)), root, outside


def outside_state(tmp_path: Path) -> dict[str, str]:
    out = {}
    for base in ("outside", "root2"):
        for dirpath, _, files in os.walk(tmp_path / base):
            for f in files:
                p = os.path.join(dirpath, f)
                out[p] = Path(p).read_text()
    return out


ESCAPES = [
    "../outside/secret.txt", "a/../../outside/secret.txt", "a/b/../../../outside/secret.txt",
    "rel_file", "rel_dir/secret.txt", "abs_file", "abs_dir/secret.txt", "sneaky",
]


@pytest.mark.parametrize("path", ESCAPES)
def test_escapes_are_refused_for_every_file_tool(env: tuple[ToolContext, Path, Path],
                                                 tmp_path: Path, path: str) -> None:
    ws, root, outside = env
    before = outside_state(tmp_path)
    for r in (read_file(ws, path), write_file(ws, path, "pwned\n"),
              edit_file(ws, path, SECRET, "pwned")):
        assert not r.ok
        assert SECRET not in r.render()
        assert "outside the workspace root" in r.render(), r.render()
    assert outside_state(tmp_path) == before


def test_absolute_paths(env: tuple[ToolContext, Path, Path], tmp_path: Path) -> None:
    ws, root, outside = env
    assert read_file(ws, str(root / "a/b/f.txt")).text == "     1\tinside"
    for p in (str(outside / "secret.txt"), "/etc/passwd", str(tmp_path / "root2/secret.txt"),
              str(root) + "/../outside/secret.txt"):
        r = read_file(ws, p)
        assert r.render() == f"error: {p}: outside the workspace root; use a path inside it"
    assert write_file(ws, str(tmp_path / "root2/new.txt"), "x").ok is False
    assert not (tmp_path / "root2/new.txt").exists()


def test_links_inside_are_followed(env: tuple[ToolContext, Path, Path]) -> None:
    ws, root, _ = env
    assert read_file(ws, "inner_dir/f.txt").text == "     1\tinside"
    assert read_file(ws, "abs_inner").text == "     1\tinside"
    assert read_file(ws, "inner_dir/f.txt").data["path"] == "a/b/f.txt"


def test_dotdot_after_a_link_is_physical(env: tuple[ToolContext, Path, Path]) -> None:
    ws, _, _ = env
    # inner_dir is a/b, so inner_dir/../.. is the root itself: "outside" is looked up there.
    r = read_file(ws, "inner_dir/../../outside/secret.txt")
    assert r.render() == "error: outside: no such file or directory"


def test_link_loops(env: tuple[ToolContext, Path, Path]) -> None:
    ws, _, _ = env
    assert read_file(ws, "self").render() == "error: self: too many levels of symbolic links"
    assert read_file(ws, "ping/x").render() == "error: ping/x: too many levels of symbolic links"
    assert not write_file(ws, "pong", "x").ok


def test_writes_through_escaping_links_create_nothing_outside(
        env: tuple[ToolContext, Path, Path], tmp_path: Path) -> None:
    ws, root, outside = env
    before = outside_state(tmp_path)
    for p in ("rel_dir/new.txt", "abs_dir/sub/new.txt", "rel_dir/../new.txt"):
        r = write_file(ws, p, "pwned\n")
        assert not r.ok, p
    assert outside_state(tmp_path) == before
    assert sorted(os.listdir(outside)) == ["d", "secret.txt"]
    assert os.listdir(outside / "d") == ["secret.txt"]


def test_invalid_path(env: tuple[ToolContext, Path, Path]) -> None:
    ws, _, _ = env
    assert read_file(ws, "a\0b").render() == "error: a\0b: invalid path (contains a NUL byte)"


# --- the swap race ------------------------------------------------------------------------

def test_directory_swapped_for_outside_link_during_tool_calls(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "f.txt").write_text("inside\n")
    (outside / "f.txt").write_text(SECRET + "\n")
    os.symlink(str(outside), root / "a_alt")
    ws = ToolContext(DirBinding(root))
    seen_inside = refused = 0
    with fh.exchanging(root / "a", root / "a_alt") as swaps:
        for i in range(3000):
            r = read_file(ws, "a/f.txt")
            assert SECRET not in r.render()
            if r.ok:
                seen_inside += 1
            else:
                refused += 1
            w = write_file(ws, f"a/new{i % 7}.txt", "written\n")
            assert SECRET not in w.render()
            if i % 3 == 0:
                read_file(ws, "a/f.txt")
                edit_file(ws, "a/f.txt", "inside", "inside")   # refused: same text
                write_file(ws, "a/f.txt", "inside\n")
    assert swaps() > 100, "the swapper barely ran"
    assert seen_inside > 0 and refused > 0, (seen_inside, refused)
    assert sorted(os.listdir(outside)) == ["f.txt"]
    assert (outside / "f.txt").read_text() == SECRET + "\n"
