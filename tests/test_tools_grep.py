"""Grep: modes, caps, messages, ignore rules, containment; ripgrep and Python agree."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

from tools import grep as grep_mod
from tools import sandbox
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.grep import grep

ENGINES = ["python"]
if shutil.which("rg") and sandbox.bwrap():
    ENGINES.insert(0, "rg")


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("REWINDFS_GREP_ENGINE", str(request.param))
    return str(request.param)


def make(root: Path, files: dict[str, str | bytes]) -> None:
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)


@pytest.fixture
def ws(tmp_path: Path) -> ToolContext:
    root = tmp_path / "root"
    make(root, {
        "a.py": "import os\n\ndef main():\n    return os.getcwd()\n",
        "b.txt": "one\ntwo\nthree\nfour\nfive\nsix\nseven\nmain here\n",
        "src/c.py": "def main():\n    pass\n",
        "src/deep/d.md": "MAIN in caps\n",
        ".hidden/h.py": "main = 1\n",
        ".gitignore": "ignored/\n*.log\n",
        "ignored/i.py": "main()\n",
        "x.log": "main\n",
        "bin.dat": b"main\x00\x01\x02",
        "node_modules/n.js": "main\n",
        ".git/config": "main\n",
    })
    return ToolContext(DirBinding(root))


def test_files_with_matches_sorted_by_path(ws: ToolContext, engine: str) -> None:
    r = grep(ws, "main")
    assert r.text.split("\n") == [".hidden/h.py", "a.py", "b.txt", "src/c.py"]
    assert r.data["engine"] == engine


def test_count_mode(ws: ToolContext, engine: str) -> None:
    assert grep(ws, "o", output_mode="count").text.split("\n") == [
        ".gitignore:2", "a.py:2", "b.txt:3"]


def test_content_mode_line_numbers_and_context(ws: ToolContext, engine: str) -> None:
    assert grep(ws, "main", path="src", output_mode="content").text == "src/c.py:1:def main():"
    r = grep(ws, "^(two|six)$", path="b.txt", output_mode="content", context=1)
    assert r.text.split("\n") == ["b.txt-1-one", "b.txt:2:two", "b.txt-3-three", "--",
                                  "b.txt-5-five", "b.txt:6:six", "b.txt-7-seven"]
    r = grep(ws, "^(two|three)$", output_mode="content", before=1, line_numbers=False)
    assert r.text.split("\n") == ["b.txt-one", "b.txt:two", "b.txt:three"]
    r = grep(ws, "main", output_mode="content", after=1, glob="*.py")
    assert r.text.split("\n") == [".hidden/h.py:1:main = 1", "--", "a.py:3:def main():",
                                  "a.py-4-    return os.getcwd()", "--",
                                  "src/c.py:1:def main():", "src/c.py-2-    pass"]


def test_ignore_case_and_glob(ws: ToolContext, engine: str) -> None:
    assert grep(ws, "main", ignore_case=True, path="src").text.split("\n") == [
        "src/c.py", "src/deep/d.md"]
    assert grep(ws, "main", glob="*.txt").text == "b.txt"
    assert grep(ws, "main", glob="!*.py").text == "b.txt"


def test_head_limit_cap_and_notice(tmp_path: Path, engine: str) -> None:
    make(tmp_path / "r", {f"f{i:03d}.txt": "hit\nhit\n" for i in range(250)})
    w = ToolContext(DirBinding(tmp_path / "r"))
    lines = grep(w, "hit").text.split("\n")
    assert len(lines) == 201
    assert lines[199] == "f199.txt"
    assert lines[200] == "[showing 200 of 250 files; narrow the search or raise head_limit]"
    lines = grep(w, "hit", output_mode="content", head_limit=3).text.split("\n")
    assert lines == ["f000.txt:1:hit", "f000.txt:2:hit", "f001.txt:1:hit",
                     "[showing 3 of 500 lines; narrow the search or raise head_limit]"]


def test_long_lines_cut_at_64k(tmp_path: Path, engine: str) -> None:
    make(tmp_path / "r", {"long.txt": "needle" + "x" * 70000 + "\n"})
    w = ToolContext(DirBinding(tmp_path / "r"))
    text = grep(w, "needle", output_mode="content").text
    assert text == ("long.txt:1:" + ("needle" + "x" * 70000)[:65536]
                    + " [... line cut at 65536 characters]")


def test_messages(ws: ToolContext, engine: str) -> None:
    assert grep(ws, "zzz").render() == "no matches for 'zzz' under ."
    assert grep(ws, "x", output_mode="lines").render() == (
        "error: output_mode must be one of files_with_matches, content, count "
        "(got 'lines')")
    assert grep(ws, "x", head_limit=0).render() == "error: head_limit must be >= 1 (got 0)"
    assert grep(ws, "x", context=-1).render() == "error: context must be >= 0 (got -1)"
    assert grep(ws, "x", path="nope").render() == "error: nope: no such file or directory"
    assert grep(ws, "x", path="../..").render() == (
        "error: ../..: outside the workspace root; use a path inside it")
    r = grep(ws, "(unclosed")
    assert r.render().startswith("error: invalid regular expression '(unclosed': ")


def test_timeout_notice(ws: ToolContext, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWINDFS_GREP_ENGINE", "python")
    monkeypatch.setattr(grep_mod.M, "GREP_TIMEOUT_S", 0.0)
    r = grep(ws, "main")
    assert r.text.split("\n")[-1] == "[search stopped after 0 s; results are incomplete]"
    assert r.data["timed_out"] is True


def test_links_are_not_followed_out(tmp_path: Path, engine: str) -> None:
    root = tmp_path / "r"
    make(root, {"in.txt": "secret? no\n"})
    make(tmp_path / "out", {"s.txt": "SECRET-OUTSIDE\n"})
    os.symlink(str(tmp_path / "out"), root / "outdir")
    os.symlink(str(tmp_path / "out" / "s.txt"), root / "outfile.txt")
    w = ToolContext(DirBinding(root))
    assert grep(w, "SECRET").render() == "no matches for 'SECRET' under ."
    assert not grep(w, "SECRET", path="outfile.txt").ok
    assert not grep(w, "SECRET", path="outdir").ok


def _swapper(root: str, stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    a, alt = os.path.join(root, "a"), os.path.join(root, "a_alt")
    while not stop.is_set():
        libc.renameat2(-100, a.encode(), -100, alt.encode(), 2)   # RENAME_EXCHANGE


def test_directory_swapped_for_outside_link_during_search(tmp_path: Path, engine: str) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    make(root, {f"a/sub/f{i}.txt": "needle inside\n" for i in range(20)})
    make(outside, {f"sub/f{i}.txt": "needle SECRET-OUTSIDE\n" for i in range(20)})
    os.symlink(str(outside), root / "a_alt")
    w = ToolContext(DirBinding(root))
    ctx = multiprocessing.get_context("fork")
    stop = ctx.Event()
    proc = ctx.Process(target=_swapper, args=(str(root), stop))
    proc.start()
    found = 0
    try:
        for _ in range(200 if engine == "python" else 80):
            for path in (".", "a", "a/sub"):
                r = grep(w, "needle", path=path, output_mode="content")
                assert "SECRET" not in r.text
                found += r.text.count("needle inside")
    finally:
        stop.set()
        proc.join(30)
    assert found > 0


@pytest.mark.skipif(len(ENGINES) < 2, reason="ripgrep cannot run confined here")
@pytest.mark.parametrize("kwargs", [
    {"output_mode": "content", "context": 2},
    {"output_mode": "content", "before": 1, "head_limit": 7},
    {"output_mode": "content", "after": 3, "line_numbers": False},
    {"output_mode": "count", "ignore_case": True},
    {"glob": "d*/**"},
])
def test_engines_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       kwargs: dict[str, object]) -> None:
    files = {}
    for i in range(12):
        body = "".join(("Hit" if (j * 7 + i) % 5 == 0 else "miss") + f" {j}\n"
                       for j in range(30))
        files[f"d{i % 3}/f{i}.txt"] = body
    make(tmp_path / "r", files)
    w = ToolContext(DirBinding(tmp_path / "r"))
    answers = []
    for eng in ("rg", "python"):
        monkeypatch.setenv("REWINDFS_GREP_ENGINE", eng)
        r = grep(w, "hit", **kwargs) if kwargs.get("ignore_case") else grep(w, "Hit", **kwargs)
        answers.append((r.text, r.data["total"]))
    assert answers[0] == answers[1]
