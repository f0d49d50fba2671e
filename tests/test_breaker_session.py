"""Hostile session placements from the breaker pass: a managed root inside the store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _cli(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "rewindfs", "--store", str(store), *args],
                          text=True, capture_output=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


@pytest.mark.parametrize("how", [["--placement", "exclusive", "--root", "{store}/sub"],
                                 ["--placement", "exclusive", "--root", "{store}"],
                                 ["--placement", "exclusive", "--root", "{link}/sub"],
                                 ["--base", "{store}/ws"]])
def test_root_inside_the_store_is_a_typed_refusal_that_creates_nothing(
        tmp_path: Path, how: list[str]) -> None:
    store = tmp_path / "store"
    assert _cli(store, "init").returncode == 0
    os.symlink(store, tmp_path / "link")
    before = sorted(os.listdir(store))
    args = [a.format(store=store, link=tmp_path / "link") for a in how]
    r = _cli(store, "session", "new", "--no-fuse", *args)
    assert r.returncode == 10, r.stderr
    assert r.stderr.startswith("rewindfs: ") and " is inside the " in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    after = sorted(os.listdir(store))
    assert after == before or set(after) - set(before) <= {"sessions"}
    assert not (store / "sub").exists() and not (store / "ws").exists()
    assert _cli(store, "session", "list").stdout.strip() == ""


@pytest.mark.parametrize("how", [["--placement", "exclusive", "--root", ""],
                                 ["--placement", "shared", "--root", " "],
                                 ["--base", ""]])
def test_empty_root_or_base_is_a_usage_error(tmp_path: Path, how: list[str]) -> None:
    store = tmp_path / "store"
    r = _cli(store, "session", "new", "--no-fuse", *how)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("rewindfs: ") and "is empty" in r.stderr, r.stderr
    assert "internal error" not in r.stderr


@pytest.mark.parametrize("how", [["--placement", "exclusive", "--root", "{f}"],
                                 ["--placement", "shared", "--root", "{f}"],
                                 ["--base", "{f}"]])
def test_root_or_base_that_is_a_file_is_a_typed_placement_error(tmp_path: Path,
                                                                  how: list[str]) -> None:
    f = tmp_path / "afile"
    f.write_text("keep me")
    r = _cli(tmp_path / "store", "session", "new", "--no-fuse",
             *[a.format(f=f) for a in how])
    assert r.returncode == 10, r.stderr
    assert "canonicalize_failed" in r.stderr and "is not a directory" in r.stderr, r.stderr
    assert f.read_text() == "keep me"
