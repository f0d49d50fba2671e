"""Grep: modes, caps, messages, ignore rules, containment, binary files, multiline, types
(ripgrep is the one engine)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import fusehelpers as fh
import pytest

from tools import grep as grep_mod
from tools import sandbox
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.glob import glob
from tools.grep import grep
from tools.readfile import read_file

pytestmark = pytest.mark.skipif(shutil.which("rg") is None, reason="ripgrep is required")


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


def test_files_with_matches_sorted_by_path(ws: ToolContext) -> None:
    r = grep(ws, "main")
    assert r.text.split("\n") == [".hidden/h.py", "a.py", "b.txt", "src/c.py"]
    assert (r.data["total"], r.data["shown"], r.data["files"]) == (4, 4, 4)


def test_count_mode(ws: ToolContext) -> None:
    assert grep(ws, "o", output_mode="count").text.split("\n") == [
        ".gitignore:2", "a.py:2", "b.txt:3"]


def test_content_mode_line_numbers_and_context(ws: ToolContext) -> None:
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


def test_ignore_case_and_glob(ws: ToolContext) -> None:
    assert grep(ws, "main", ignore_case=True, path="src").text.split("\n") == [
        "src/c.py", "src/deep/d.md"]
    assert grep(ws, "main", glob="*.txt").text == "b.txt"
    assert grep(ws, "main", glob="!*.py").text == "b.txt"


def test_head_limit_cap_and_notice(tmp_path: Path) -> None:
    make(tmp_path / "r", {f"f{i:03d}.txt": "hit\nhit\n" for i in range(250)})
    w = ToolContext(DirBinding(tmp_path / "r"))
    lines = grep(w, "hit").text.split("\n")
    assert len(lines) == 201
    assert lines[199] == "f199.txt"
    assert lines[200] == ("[showing 200 of 250 files; narrow the search, raise head_limit, "
                          "or continue with offset=200]")
    lines = grep(w, "hit", output_mode="content", head_limit=3).text.split("\n")
    assert lines == ["f000.txt:1:hit", "f000.txt:2:hit", "f001.txt:1:hit",
                     "[showing 3 of 500 lines; narrow the search, raise head_limit, or "
                     "continue with offset=3]"]
    lines = grep(w, "hit", output_mode="content", head_limit=3, offset=3).text.split("\n")
    assert lines[:3] == ["f001.txt:2:hit", "f002.txt:1:hit", "f002.txt:2:hit"]
    assert grep(w, "hit", offset=248).text.split("\n") == ["f248.txt", "f249.txt"]
    r = grep(w, "hit", offset=250)
    assert r.render() == "offset 250 is past the end of the answer (250 entries)"


def test_long_lines_cut_at_64k(tmp_path: Path) -> None:
    make(tmp_path / "r", {"long.txt": "needle" + "x" * 70000 + "\n"})
    w = ToolContext(DirBinding(tmp_path / "r"))
    text = grep(w, "needle", output_mode="content").text
    assert text == ("long.txt:1:" + ("needle" + "x" * 70000)[:65536]
                    + " [... line cut at 65536 characters]")


def test_messages(ws: ToolContext) -> None:
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
    monkeypatch.setattr(grep_mod.M, "GREP_TIMEOUT_S", 0.0)
    r = grep(ws, "main")
    assert r.text.split("\n")[-1] == "[search stopped after 0 s; results are incomplete]"
    assert r.data["timed_out"] is True


def test_links_are_not_followed_out(tmp_path: Path) -> None:
    root = tmp_path / "r"
    make(root, {"in.txt": "secret? no\n"})
    make(tmp_path / "out", {"s.txt": "SECRET-OUTSIDE\n"})
    os.symlink(str(tmp_path / "out"), root / "outdir")
    os.symlink(str(tmp_path / "out" / "s.txt"), root / "outfile.txt")
    w = ToolContext(DirBinding(root))
    assert grep(w, "SECRET").render() == "no matches for 'SECRET' under ."
    assert not grep(w, "SECRET", path="outfile.txt").ok
    assert not grep(w, "SECRET", path="outdir").ok


def test_directory_swapped_for_outside_link_during_search(tmp_path: Path) -> None:
    root = tmp_path / "root"
    outside = tmp_path / "outside"
    make(root, {f"a/sub/f{i}.txt": "needle inside\n" for i in range(20)})
    make(outside, {f"sub/f{i}.txt": "needle SECRET-OUTSIDE\n" for i in range(20)})
    os.symlink(str(outside), root / "a_alt")
    w = ToolContext(DirBinding(root))
    found = 0
    with fh.exchanging(root / "a", root / "a_alt"):
        for _ in range(80):
            for path in (".", "a", "a/sub"):
                r = grep(w, "needle", path=path, output_mode="content")
                assert "SECRET" not in r.text
                found += r.text.count("needle inside")
    assert found > 0


def test_offset_with_context_groups(tmp_path: Path) -> None:
    make(tmp_path / "r", {"a.txt": "x\nhit\ny\n", "b.txt": "hit\nz\n"})
    w = ToolContext(DirBinding(tmp_path / "r"))
    whole = grep(w, "hit", output_mode="content", context=1).text.split("\n")
    assert whole == ["a.txt-1-x", "a.txt:2:hit", "a.txt-3-y", "--", "b.txt:1:hit",
                     "b.txt-2-z"]
    for skip in range(len(whole)):
        r = grep(w, "hit", output_mode="content", context=1, offset=skip, head_limit=2)
        assert r.text.split("\n")[:2] == whole[skip:skip + 2], skip


def test_binary_files_are_skipped_walked_or_named(ws: ToolContext) -> None:
    assert "bin.dat" not in grep(ws, "main").text
    assert grep(ws, "main", path="bin.dat").render() == "no matches for 'main' under bin.dat"
    r = grep(ws, "main", path="bin.dat", output_mode="content")
    assert r.render() == "no matches for 'main' under bin.dat" and "\0" not in r.text


def test_multiline_and_line_breaks(tmp_path: Path) -> None:
    make(tmp_path / "r", {"m.py": "def f(\n    x,\n):\n    pass\n", "o.txt": "one\n"})
    w = ToolContext(DirBinding(tmp_path / "r"))
    for pattern in ("f\\(\\n    x", "f\\(\n    x"):
        r = grep(w, pattern, output_mode="content")
        assert not r.ok and r.render() == (
            f"error: pattern {pattern!r} matches a line break: set multiline to true to let "
            "matches span lines")
        r = grep(w, pattern, output_mode="content", multiline=True)
        assert r.text.split("\n") == ["m.py:1:def f(", "m.py:2:    x,"]
    r = grep(w, "f\\(.*\\):", multiline=True, output_mode="count")
    assert r.text == "m.py:1"                  # one match (ripgrep counts matches here)
    assert grep(w, "f\\(.*\\):").render() == "no matches for 'f\\\\(.*\\\\):' under ."


def test_look_around_and_backreferences(tmp_path: Path) -> None:
    make(tmp_path / "r", {"a.txt": "foobar\nbazbar\nabab\n"})
    w = ToolContext(DirBinding(tmp_path / "r"))
    assert grep(w, "(?<=foo)bar", output_mode="content").text == "a.txt:1:foobar"
    assert grep(w, "(?<!o)bar", output_mode="content").text == "a.txt:2:bazbar"
    assert grep(w, "ba(?!r)", output_mode="content").text == "a.txt:2:bazbar\na.txt:3:abab"
    assert grep(w, "(ab)\\1", output_mode="content").text == "a.txt:3:abab"


def test_type_filter(ws: ToolContext) -> None:
    assert grep(ws, "main", type="py").text.split("\n") == [".hidden/h.py", "a.py",
                                                             "src/c.py"]
    assert grep(ws, "main", type="markdown", ignore_case=True).text == "src/deep/d.md"
    r = grep(ws, "main", type="nosuchtype")
    assert not r.ok and r.render().startswith("error: unknown file type 'nosuchtype': ")


def test_output_is_capped_in_bytes(tmp_path: Path) -> None:
    make(tmp_path / "r", {"big.txt": ("needle " + "y" * 1000 + "\n") * 500})
    w = ToolContext(DirBinding(tmp_path / "r"))
    r = grep(w, "needle", output_mode="content", head_limit=500)
    lines = r.text.split("\n")
    assert len(r.text.encode()) <= grep_mod.M.GREP_OUTPUT_CAP + 200
    assert lines[-1] == ("[showing 98 of 500 lines: the answer is capped at 100000 bytes; "
                         "narrow the search or continue with offset=98]")
    assert r.data["capped"] is True and r.data["shown"] == 98
    nxt = grep(w, "needle", output_mode="content", head_limit=500, offset=98)
    assert nxt.text.split("\n")[0] == "big.txt:99:needle " + "y" * 1000


def test_without_ripgrep_grep_fails_clearly(ws: ToolContext,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    r = grep(ws, "main")
    assert not r.ok and r.render() == (
        "error: ripgrep (rg) is not installed: Grep needs it (scripts/setup.sh installs the "
        "Debian package ripgrep)")


@pytest.mark.skipif(sandbox.bwrap() is None, reason="bubblewrap cannot run here")
def test_confined_and_unconfined_ripgrep_agree(ws: ToolContext,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [("main", {}), ("main", {"output_mode": "content", "context": 1}),
             ("o", {"output_mode": "count"}), ("MAIN", {"ignore_case": True, "glob": "*.md"})]
    confined = [grep(ws, p, **kw).text for p, kw in calls]      # type: ignore[arg-type]
    monkeypatch.setenv("REWINDFS_NO_SANDBOX", "1")
    assert [grep(ws, p, **kw).text for p, kw in calls] == confined  # type: ignore[arg-type]


def _answers_as_another_user(root: Path, calls: list[tuple[str, str]]) -> list[list[Any]]:
    """[ok, kind, text] of each (tool, path) call, Glob ``*``, Grep ``hi`` or ReadFile, on
    ``root``: as uid 65534 in a forked child when this is root (for whom no mode denies
    anything), else in this process."""
    def answers() -> list[list[Any]]:
        ctx = ToolContext(DirBinding(root))
        tools = {"Glob": lambda p: glob(ctx, "*", p), "Grep": lambda p: grep(ctx, "hi", p),
                 "ReadFile": lambda p: read_file(ctx, p)}
        out = []
        for tool, path in calls:
            r = tools[tool](path)
            out.append([r.ok, r.data.get("kind"), r.text])
        return out

    if os.geteuid() != 0:
        return answers()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, json.dumps(answers()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    out: list[list[Any]] = json.loads(got)
    return out


def test_a_path_this_user_cannot_read_or_name_is_one_typed_line() -> None:
    """A directory and a file of mode 000, and a name longer than 255 bytes: Glob, Grep
    and ReadFile answer one line naming the path and the cause, with a kind of its own
    (they answered the bare strerror with kind ``os``, and Grep ``search failed:
    Permission denied`` without the path, or ``search failed: ripgrep failed``)."""
    tmp = Path(tempfile.mkdtemp(prefix="/tmp/rewindfs-test-"))  # reachable by uid 65534
    try:
        os.chmod(tmp, 0o755)
        make(tmp, {"locked/b.txt": "hi\n", "secret.txt": "hi\n", "open.txt": "hi\n"})
        os.chmod(tmp / "locked", 0)
        os.chmod(tmp / "secret.txt", 0)
        long = "n" * 256
        calls = [("Glob", "locked"), ("Grep", "locked"), ("Grep", "secret.txt"),
                 ("ReadFile", "secret.txt"), ("Glob", long), ("Grep", long),
                 ("ReadFile", long), ("Grep", ".")]
        got = _answers_as_another_user(tmp, calls)
    finally:
        os.chmod(tmp / "locked", 0o755)
        shutil.rmtree(tmp)
    denied = ": permission denied: its owner and mode keep this user out"
    for (tool, path), (ok, kind, text) in zip(calls[:4], got[:4], strict=True):
        assert not ok and kind == "denied" and text.count("\n") == 0, (tool, text)
        assert text.startswith(f"{path}{denied}"), (tool, text)
    for (tool, path), (ok, kind, text) in zip(calls[4:7], got[4:7], strict=True):
        assert not ok and kind == "too_long", (tool, text)
        assert text == f"{path}: a name in it is too long (255 bytes at most per name)"
    ok, _, text = got[7]               # a search of the whole tree still finds what it can
    assert ok and text.splitlines() == ["open.txt"], text
