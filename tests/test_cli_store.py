"""The store commands of the ``rewindfs`` console script, run as a user runs them.

Every call goes through the installed console script in a subprocess: JSON shapes, exit
codes, one-line errors without a traceback, and a round trip snapshot -> materialize ->
same Ref through the CLI alone.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest

RW = Path(sys.executable).parent / "rewindfs"
REF_PREFIX = "v1:blake3:"
MISSING_REF = REF_PREFIX + "ab" * 32


def env_for(store: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REWINDFS_DEBUG", "REWINDFS_STORE")}
    if store is not None:
        env["REWINDFS_STORE"] = str(store)
    return env


def rw(store: Path | None, *args: str, cwd: Path | None = None,
       code: int = 0) -> subprocess.CompletedProcess[bytes]:
    """Run ``rewindfs ARGS``; assert its exit status is ``code``."""
    p = subprocess.run([str(RW), *args], capture_output=True, env=env_for(store), cwd=cwd,
                       timeout=120)
    assert p.returncode == code, (args, p.returncode, p.stdout, p.stderr)
    return p


def rwj(store: Path, *args: str, code: int = 0) -> Any:
    """Run ``rewindfs ARGS --json`` and parse its output."""
    return json.loads(rw(store, *args, "--json", code=code).stdout)


def assert_one_line_error(p: subprocess.CompletedProcess[bytes], *words: str) -> str:
    err = p.stderr.decode()
    assert err.startswith("rewindfs: "), err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and not p.stdout
    for w in words:
        assert w in err, (w, err)
    return err


def make_tree(root: Path) -> None:
    """A small tree with the kinds and metadata a snapshot must keep."""
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "README.md").write_text("hello\n")
    (root / "src" / "pkg" / "mod.py").write_text("x = 1\n" * 100)
    (root / "src" / "blob.bin").write_bytes(bytes(range(256)) * 64)
    (root / "src" / "run.sh").write_text("#!/bin/sh\n")
    (root / "src" / "run.sh").chmod(0o755)
    os.symlink("src/pkg/mod.py", root / "link")
    os.symlink("/nowhere/at/all", root / "dangling")
    os.link(root / "README.md", root / "README.hardlink")
    (root / os.fsdecode(b"caf\xe9")).write_bytes(b"latin-1 name\n")
    os.utime(root / "src" / "pkg" / "mod.py", ns=(1_000_000_123, 1_600_000_000_123_456_789))


def tree_state(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path with kind, mode, mtime (ns), content or target, and link count."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = ("l", os.readlink(p))
            elif os.path.isdir(p):
                out[rel] = ("d", st.st_mode, st.st_mtime_ns)
            else:
                out[rel] = ("f", st.st_mode, st.st_mtime_ns, st.st_nlink,
                            Path(p).read_bytes())
    return out


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    root.mkdir()
    make_tree(root)
    return root


def test_help_lists_every_store_command() -> None:
    out = rw(None, "--help").stdout.decode()
    for cmd in ("init", "snapshot", "list", "forget", "materialize", "ls", "cat", "diff", "gc",
                "verify", "stats", "rebuild-index"):
        assert f"\n    {cmd}" in out, cmd


def test_usage_error_exits_2(store: Path) -> None:
    p = rw(store, "snapshot", code=2)
    assert b"usage:" in p.stderr
    rw(store, "no-such-command", code=2)


def test_store_is_created_on_first_use_at_the_default_place(tmp_path: Path) -> None:
    assert rw(None, "list", cwd=tmp_path).stdout == b""
    assert (tmp_path / "agent-data" / "store" / "index.sqlite").is_file()
    data = json.loads(rw(None, "init", "--json", cwd=tmp_path).stdout)
    assert data["root"] == str(tmp_path / "agent-data" / "store")
    assert data["chunk_size"] == 1 << 20
    # --store wins over $REWINDFS_STORE
    other = tmp_path / "other"
    rw(tmp_path / "env-store", "--store", str(other), "init", cwd=tmp_path)
    assert (other / "index.sqlite").is_file()
    assert not (tmp_path / "env-store").exists()


def test_init_fixes_chunk_size_and_level_once(store: Path) -> None:
    assert rwj(store, "init", "--chunk-size", "256K", "--level", "5") == {
        "root": str(store), "chunk_size": 256 << 10, "level": 5}
    assert rwj(store, "init")["chunk_size"] == 256 << 10
    assert_one_line_error(rw(store, "init", "--chunk-size", "1M", code=1), "262144")
    assert_one_line_error(rw(store.with_name("s2"), "init", "--chunk-size", "3000", code=1),
                          "power of two")
    rw(store, "init", "--chunk-size", "lots", code=2)


def test_snapshot_prints_the_ref_and_lists_it(store: Path, tree: Path) -> None:
    text = rw(store, "snapshot", str(tree), "--label", "first").stdout.decode()
    ref = text.strip()
    assert text == ref + "\n" and ref.startswith(REF_PREFIX) and len(ref) == 74
    data = rwj(store, "snapshot", str(tree))
    assert data["ref"] == ref
    assert data["files"] == 6 and data["packs_written"] == 0
    assert isinstance(data["elapsed_ms"], float)
    rw(store, "snapshot", str(tree), "--label", "first")
    listed = rwj(store, "list")
    assert [(s["ref"], s["label"], s["origin"]) for s in listed] == [(ref, "first", "snapshot")]
    assert isinstance(listed[0]["time_ns"], int)
    assert ref in rw(store, "list").stdout.decode()


def test_round_trip_through_the_cli(store: Path, tree: Path, tmp_path: Path) -> None:
    ref = rwj(store, "snapshot", str(tree))["ref"]
    dest = tmp_path / "dest"
    data = rwj(store, "materialize", ref, str(dest))
    assert data["ref"] == ref and data["dest"] == str(dest)
    assert tree_state(dest) == tree_state(tree)
    assert rwj(store, "snapshot", str(dest))["ref"] == ref
    # materialize onto the equal tree: success, nothing changed
    before = tree_state(dest)
    rwj(store, "materialize", ref, str(dest))
    assert tree_state(dest) == before


def test_ls_and_cat(store: Path, tree: Path) -> None:
    ref = rwj(store, "snapshot", str(tree))["ref"]
    root = {e["name"]: e for e in rwj(store, "ls", ref)}
    assert sorted(root) == sorted(os.listdir(tree))
    assert root["src"]["kind"] == "dir"
    assert root["link"]["kind"] == "symlink" and root["link"]["target"] == "src/pkg/mod.py"
    assert root["README.md"]["size"] == 6 and root["README.md"]["mode"] == 0o644
    sub = rwj(store, "ls", ref, "src/pkg")
    assert [(e["name"], e["mtime_ns"]) for e in sub] == [("mod.py", 1_600_000_000_123_456_789)]
    assert [e["name"] for e in rwj(store, "ls", ref, "/src/")] == ["blob.bin", "pkg", "run.sh"]
    text = rw(store, "ls", ref, "src").stdout.decode().splitlines()
    assert len(text) == 3 and text[2].startswith("-rwxr-xr-x") and text[2].endswith(" run.sh")
    assert rw(store, "cat", ref, "src/blob.bin").stdout == (tree / "src/blob.bin").read_bytes()
    assert rw(store, "cat", ref, os.fsdecode(b"caf\xe9")).stdout == b"latin-1 name\n"


def test_diff_reports_each_kind_of_change(store: Path, tree: Path) -> None:
    a = rwj(store, "snapshot", str(tree))["ref"]
    (tree / "README.md").write_text("changed\n")
    (tree / "src" / "blob.bin").unlink()
    (tree / "new.txt").write_text("new\n")
    (tree / "link").unlink()
    (tree / "link").mkdir()
    b = rwj(store, "snapshot", str(tree))["ref"]
    data = rwj(store, "diff", a, b)
    assert data["a"] == a and data["b"] == b
    got = {c["path"]: c["status"] for c in data["changes"]}
    assert got["README.md"] == "modified"
    assert got["src/blob.bin"] == "removed"
    assert got["new.txt"] == "added"
    assert got["link"] == "type_changed"
    link = next(c for c in data["changes"] if c["path"] == "link")
    assert (link["old_kind"], link["new_kind"]) == ("symlink", "dir")
    lines = rw(store, "diff", a, b).stdout.decode().splitlines()
    assert "A\tnew.txt" in lines and "D\tsrc/blob.bin" in lines and "T\tlink" in lines
    assert rwj(store, "diff", a, a)["changes"] == []


def test_user_errors_are_one_line_with_their_exit_code(store: Path, tree: Path,
                                                       tmp_path: Path) -> None:
    ref = rwj(store, "snapshot", str(tree))["ref"]
    assert_one_line_error(rw(store, "ls", "v1:blake3:abc", code=3), "invalid ref")
    assert_one_line_error(rw(store, "cat", ref[:-1] + "g", "README.md", code=3), "invalid ref")
    assert_one_line_error(rw(store, "diff", ref, "HEAD", code=3), "invalid ref")
    assert_one_line_error(rw(store, "ls", ref, "no/such/dir", code=4), "no/such/dir")
    assert_one_line_error(rw(store, "cat", ref, "missing.txt", code=4), "missing.txt")
    assert_one_line_error(rw(store, "cat", ref, "src", code=1), "src")
    assert_one_line_error(rw(store, "ls", MISSING_REF, code=4))
    assert_one_line_error(rw(store, "forget", MISSING_REF, code=4), "not in the snapshot list")
    assert_one_line_error(rw(store, "snapshot", str(tmp_path / "nope"), code=1), "nope")
    # a destination holding another tree is refused and left as it was
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine\n")
    assert_one_line_error(rw(store, "materialize", ref, str(other), code=6), str(other))
    assert [p.name for p in other.iterdir()] == ["keep.txt"]
    assert_one_line_error(rw(store, "materialize", ref, str(other / "keep.txt"), code=6))
    assert (other / "keep.txt").read_text() == "mine\n"


def test_forget_then_gc_frees_only_what_is_unreachable(store: Path, tree: Path,
                                                       tmp_path: Path) -> None:
    keep = rwj(store, "snapshot", str(tree), "--label", "keep")["ref"]
    (tree / "big.bin").write_bytes(os.urandom(300_000))
    gone = rwj(store, "snapshot", str(tree), "--label", "gone")["ref"]
    assert rwj(store, "forget", gone) == {"ref": gone, "forgotten": True}
    assert [s["ref"] for s in rwj(store, "list")] == [keep]
    before = rwj(store, "stats")
    report = rwj(store, "gc")
    assert isinstance(report["elapsed_ms"], float)
    after = rwj(store, "stats")
    assert after["stored_bytes"] < before["stored_bytes"]
    rwj(store, "materialize", keep, str(tmp_path / "kept"))
    assert_one_line_error(rw(store, "materialize", gone, str(tmp_path / "x"), code=4))
    assert rwj(store, "verify")["ok"] is True


def test_verify_names_a_broken_invariant_and_exits_5(store: Path, tree: Path) -> None:
    rwj(store, "snapshot", str(tree))
    healthy = rwj(store, "verify")
    assert healthy["ok"] is True and healthy["problems"] == []
    assert rw(store, "verify").stdout == b"ok\n"
    packs = sorted((store / "backend" / "packs").iterdir())
    assert packs
    data = bytearray(packs[0].read_bytes())
    data[len(data) // 3] ^= 0xFF
    packs[0].chmod(0o644)
    packs[0].write_bytes(bytes(data))
    out = rwj(store, "verify", code=5)
    assert out["ok"] is False and out["problems"]
    for p in out["problems"]:
        assert set(p) == {"invariant", "key", "detail"} and p["invariant"]
    assert rw(store, "verify", code=5).stdout


def test_stats_shape(store: Path, tree: Path) -> None:
    rwj(store, "snapshot", str(tree))
    data = rwj(store, "stats")
    for key in ("logical_bytes", "stored_bytes"):
        assert isinstance(data[key], int) and data[key] > 0, key
    assert "logical_bytes" in rw(store, "stats").stdout.decode()


def test_rebuild_index_keeps_the_snapshot_list_and_gates_gc(store: Path, tree: Path) -> None:
    ref = rwj(store, "snapshot", str(tree), "--label", "l")["ref"]
    report = rwj(store, "rebuild-index")
    assert report["snapshots"] == 1 and report["packs"] >= 1
    assert [(s["ref"], s["label"]) for s in rwj(store, "list")] == [(ref, "l")]
    assert_one_line_error(rw(store, "gc", code=8), "verify")
    assert rwj(store, "verify")["ok"] is True
    rwj(store, "gc")


def _run_with_tty_stderr(store: Path, *args: str) -> tuple[int, bytes]:
    """Run ``rewindfs ARGS`` with stderr on a pseudo-terminal; return (status, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    try:
        p = subprocess.run([str(RW), *args], stdout=subprocess.DEVNULL, stderr=slave,
                           env=env_for(store), timeout=120)
        os.close(slave)
        chunks = []
        while True:
            try:
                b = os.read(master, 65536)
            except OSError:
                break
            if not b:
                break
            chunks.append(b)
        return p.returncode, b"".join(chunks)
    finally:
        os.close(master)


def test_progress_bar_only_on_a_terminal_and_never_with_json(store: Path, tree: Path) -> None:
    assert rw(store, "snapshot", str(tree)).stderr == b""
    code, err = _run_with_tty_stderr(store, "snapshot", str(tree))
    assert code == 0 and b"snapshot" in err
    code, err = _run_with_tty_stderr(store, "snapshot", str(tree), "--json")
    assert code == 0 and err == b""
