"""Glob: ``**`` semantics, pruning, order, cap and containment."""

from __future__ import annotations

import os
import resource
from pathlib import Path

import fusehelpers as fh
import pytest
from tree_support import make_chain, remove_chain

from tools import glob as glob_module
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.glob import glob


def make(root: Path, files: dict[str, int]) -> None:
    """Create files with the given mtimes (seconds)."""
    for rel, mtime in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(rel)
        os.utime(p, (mtime, mtime))


@pytest.fixture
def ws(tmp_path: Path) -> ToolContext:
    root = tmp_path / "root"
    make(root, {
        "a.py": 100, "b.txt": 100, "src/c.py": 300, "src/deep/er/d.py": 200,
        "src/deep/e.md": 400, ".github/ci.py": 50, "node_modules/m/x.py": 999,
        ".git/hooks/h.py": 999, "pkg/__pycache__/c.py": 999, ".venv/lib/v.py": 999,
    })
    return ToolContext(DirBinding(root))


def test_globstar_matches_zero_or_more_dirs_newest_first(ws: ToolContext) -> None:
    r = glob(ws, "**/*.py")
    assert r.text.split("\n") == ["src/c.py", "src/deep/er/d.py", "a.py", ".github/ci.py"]


def test_star_stays_within_one_component(ws: ToolContext) -> None:
    assert glob(ws, "*.py").text == "a.py"
    assert glob(ws, "src/*").text == "src/c.py"
    assert glob(ws, "src/**").text.split("\n") == ["src/deep/e.md", "src/c.py",
                                                   "src/deep/er/d.py"]
    assert glob(ws, "src/**/d.py").text == "src/deep/er/d.py"
    assert glob(ws, "**/deep/*.{md,py}").text == "src/deep/e.md"


def test_path_argument_and_paths_relative_to_root(ws: ToolContext) -> None:
    assert glob(ws, "*.py", path="src").text == "src/c.py"
    assert glob(ws, "**/*.py", path="src/deep").text == "src/deep/er/d.py"


def test_noise_dirs_pruned_unless_named(ws: ToolContext) -> None:
    assert "node_modules" not in glob(ws, "**/*").text
    assert glob(ws, "node_modules/**/*.py").text == "node_modules/m/x.py"
    assert glob(ws, "**/*.py", path="node_modules").text == "node_modules/m/x.py"


def test_ties_sorted_by_path(tmp_path: Path) -> None:
    make(tmp_path / "r", {"b.txt": 5, "a.txt": 5, "c/a.txt": 5, "z.txt": 6})
    w = ToolContext(DirBinding(tmp_path / "r"))
    assert glob(w, "**/*.txt").text.split("\n") == ["z.txt", "a.txt", "b.txt", "c/a.txt"]


def test_cap_500_with_notice(tmp_path: Path) -> None:
    root = tmp_path / "r"
    make(root, {f"d{i % 7}/f{i:04d}.txt": 1000 + i for i in range(620)})
    w = ToolContext(DirBinding(root))
    r = glob(w, "**/*.txt")
    lines = r.text.split("\n")
    assert len(lines) == 501
    assert lines[0] == "d3/f0619.txt"
    assert lines[499] == "d1/f0120.txt"
    assert lines[500] == "[showing the newest 500 of 620 matches; narrow the pattern or path]"
    assert r.data["total"] == 620


def test_messages(ws: ToolContext) -> None:
    assert glob(ws, "*.nothing").render() == "no files match '*.nothing' under ."
    assert glob(ws, "../*").render() == (
        "error: invalid glob pattern '../*': '..' is not allowed in a pattern")
    assert glob(ws, "*", path="../x").render() == (
        "error: ../x: outside the workspace root; use a path inside it")
    assert glob(ws, "*", path="a.py").render() == "error: a.py: not a directory"


def test_links_are_not_followed_out(tmp_path: Path) -> None:
    root = tmp_path / "r"
    make(root, {"in.py": 1})
    make(tmp_path / "out", {"secret.py": 1, "sub/s2.py": 1})
    os.symlink(str(tmp_path / "out"), root / "outdir")
    os.symlink("../out/secret.py", root / "outfile.py")
    w = ToolContext(DirBinding(root))
    r = glob(w, "**/*.py")
    assert "secret" not in r.text and "s2" not in r.text
    assert sorted(r.text.split("\n")) == ["in.py", "outfile.py"]   # the link's own name
    assert not glob(w, "*.py", path="outdir").ok


def test_directory_swapped_for_outside_link_during_glob(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make(root, {f"a/sub/in{i}.py": 1 for i in range(5)})
    make(tmp_path / "outside", {f"sub/SECRET{i}.py": 1 for i in range(5)})
    os.symlink(str(tmp_path / "outside"), root / "a_alt")
    w = ToolContext(DirBinding(root))
    listed = 0
    with fh.exchanging(root / "a", root / "a_alt"):
        for _ in range(1000):
            for path in (".", "a", "a/sub"):
                r = glob(w, "**/*.py", path=path)
                assert "SECRET" not in r.text
                listed += r.text.count("in0.py")
    assert listed > 0


def test_a_tree_deeper_than_the_recursion_limit_and_open_file_limit_is_globbed(
        tmp_path: Path) -> None:
    """1,500 nested directories (deeper than PATH_MAX, Python's recursion limit and the
    1,024 descriptors a user may open): Glob finds the file at the bottom, under a limit
    of 200 more descriptors than are open now, and by a pattern that names it literally."""
    root = tmp_path / "root"
    root.mkdir()
    w = ToolContext(DirBinding(root))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        rel = make_chain(root, 1500, "bottom.txt", "x")
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 200,
                                                    hard))
        try:
            r = glob(w, "**/bottom.txt")
            literal = glob(w, rel)
            none = glob(w, "**/absent")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert r.ok and r.data["paths"] == [rel], r.text[:200]
        assert literal.ok and literal.data["paths"] == [rel], literal.text[:200]
        assert none.ok and none.data["paths"] == []
    finally:
        remove_chain(root, "bottom.txt")


def test_deep_walk_reopens_only_the_directory_it_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk deeper than the directories it keeps open climbs back through ``..``; when a
    directory on the way was moved out of the workspace meanwhile, ``..`` leads outside, and
    the walk reopens the directory it listed from the workspace instead."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    make(root, {"/".join(["d"] * 10) + "/s/hit.txt": 1})
    make(outside, {"s/SECRET.txt": 1})
    make_chain(root / "/".join(["d"] * 10), 100, "bottom.txt", "x")
    bottom = os.stat(root / "/".join(["d"] * 110))
    real = glob_module.list_dir

    def listing(fd: int) -> list[os.DirEntry[str]]:
        """Entries in name order (the chain "d" before "s"); at the bottom of the chain,
        move its 11th directory to outside/moved."""
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (bottom.st_dev, bottom.st_ino):
            os.rename(root / "/".join(["d"] * 11), outside / "moved")
        return sorted(real(fd), key=lambda e: e.name)

    monkeypatch.setattr(glob_module, "list_dir", listing)
    try:
        r = glob(ToolContext(DirBinding(root)), "**/*.txt")
    finally:
        remove_chain(outside / "moved", "bottom.txt")
    assert "SECRET" not in r.text
    assert "/".join(["d"] * 10) + "/s/hit.txt" in r.data["paths"]


def test_gitignore_is_honoured_like_grep(tmp_path: Path) -> None:
    import shutil

    from tools.grep import grep

    root = tmp_path / "r"
    make(root, {"keep.py": 5, "build/out.py": 5, "gen.py": 5, "sub/local.py": 5,
                "sub/x.tmp.py": 5, "sub/deeper/again.py": 5, "docs/a.py": 5})
    (root / ".gitignore").write_text("build/\ngen.py\n*.tmp.py\n")
    (root / "sub" / ".gitignore").write_text("deeper/\n")
    (root / "docs" / ".ignore").write_text("*\n!a.py\n")
    w = ToolContext(DirBinding(root))
    shown = sorted(glob(w, "**/*.py").text.split("\n"))
    assert shown == ["docs/a.py", "keep.py", "sub/local.py"]
    assert sorted(glob(w, "*.py", path="sub").text.split("\n")) == ["sub/local.py"]
    every = sorted(glob(w, "**/*.py", include_ignored=True).text.split("\n"))
    assert every == ["build/out.py", "docs/a.py", "gen.py", "keep.py", "sub/deeper/again.py",
                     "sub/local.py", "sub/x.tmp.py"]
    if shutil.which("rg"):
        for p in every:
            (root / p).write_text("needle\n")
        assert sorted(grep(w, "needle").text.split("\n")) == shown


@pytest.mark.parametrize("arg", [{"pattern": "~/*.py"}, {"pattern": "*.py", "path": "~"},
                                 {"pattern": "*", "path": "~root"}])
def test_tilde_is_refused(ws: ToolContext, arg: dict[str, str]) -> None:
    r = glob(ws, **arg)
    shown = arg.get("path", arg["pattern"])
    assert r.render() == (f"error: {shown}: '~' is not expanded here (no home directory); "
                          "use a path relative to the workspace root")
