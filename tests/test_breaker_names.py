"""Hostile names in the CLI's text output: a name holding a newline must not forge a line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from store.pathtext import text_path


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-P", "-m", "rewindfs", "--store", str(store), *args],
                          capture_output=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_text_path_quotes_only_what_would_break_a_line() -> None:
    assert text_path("src/main.py") == "src/main.py"
    assert text_path("é/ok 1") == "é/ok 1"
    assert text_path("x\nD\tsrc/main.py") == '"x\\nD\\tsrc/main.py"'
    assert text_path(os.fsdecode(b"bad\xff")) == '"bad\\377"'
    assert text_path('"q') == '"\\"q"'
    assert text_path("a\x7fb") == '"a\\177b"'


def test_diff_and_ls_text_cannot_be_forged_by_a_name(tmp_path: Path) -> None:
    store = tmp_path / "store"
    a = tmp_path / "a"
    a.mkdir()
    (a / "keep.txt").write_text("k")
    b = tmp_path / "b"
    b.mkdir()
    (b / "keep.txt").write_text("k")
    (b / "x\nD\tkeep.txt").write_text("evil")
    os.symlink("t\nu", b / "link")
    refs = []
    for d in (a, b):
        r = _cli(store, "snapshot", str(d))
        assert r.returncode == 0, r.stderr
        refs.append(_ref_from(r.stdout.decode()))
    df = _cli(store, "diff", *refs)
    assert df.returncode == 0, df.stderr
    lines = df.stdout.decode().splitlines()
    assert sorted(x for x in lines if x.startswith("A")) == sorted(
        ['A\t"x\\nD\\tkeep.txt"', "A\tlink"]), lines
    assert "D\tkeep.txt" not in lines
    ls = _cli(store, "ls", refs[1])
    assert ls.returncode == 0, ls.stderr
    out = ls.stdout.decode().splitlines()
    assert len(out) == 3, out
    assert any(line.endswith('link -> "t\\nu"') for line in out), out


def _ref_from(text: str) -> str:
    for word in text.split():
        if word.startswith("v1:blake3:"):
            return word
    raise AssertionError(f"no Ref in {text!r}")
