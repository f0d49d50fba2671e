"""What a user of the CLI relies on at its front door (issue 15, points 1-3), through the
console script in subprocesses and real mounts:

- under ``--json`` every failure prints one JSON document on stdout (``ok`` false, ``error``,
  ``type``, ``kind``, ``exit_code`` and the typed error's fields) and keeps the exit code;
- the live commands (``checkpoint``, ``restore``, ``status``, ``diff``) accept any path inside
  a mount, ``.`` from a subdirectory included;
- a Ref that is not in the store is exit 4 wherever it is used.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import fusehelpers as fh
import pytest
from fusehelpers import run_cli as run

MISSING = "v1:blake3:" + "ab" * 32


def failure(p: subprocess.CompletedProcess[str], code: int) -> dict[str, Any]:
    """The JSON document of a failed ``--json`` call, checked for its common shape."""
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is False and doc["exit_code"] == code
    assert doc["error"] and doc["type"] and doc["kind"]
    assert p.stderr.splitlines()[-1].startswith("rewindfs")
    assert code == 2 or p.stderr.count("\n") == 1  # usage errors show the usage line too
    return doc


def test_json_failures_are_json_on_stdout(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x\n")
    store = tmp_path / "store"
    ref = json.loads(run(store, "snapshot", str(src), "--json").stdout)["ref"]

    doc = failure(run(store, "ls", "v1:blake3:nothex", "--json"), 3)
    assert doc["type"] == "InvalidRefError" and doc["value"] == "v1:blake3:nothex"
    doc = failure(run(store, "ls", ref, "no/such", "--json"), 4)
    assert doc["type"] == "SnapshotNotFoundError" and doc["path"] == "no/such"
    (src / "g").write_text("other\n")
    doc = failure(run(store, "materialize", ref, str(src), "--json"), 6)
    assert doc["type"] == "DestNotEmptyError"
    doc = failure(run(store, "snapshot", "--json"), 2)  # usage: DIR missing
    assert doc["type"] == "UsageError"
    # Without --json a failure prints nothing on stdout.
    p = run(store, "cat", ref, "no/such")
    assert p.returncode == 4 and p.stdout == ""


def test_a_missing_ref_is_exit_4_everywhere(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x\n")
    store = tmp_path / "store"
    run(store, "snapshot", str(src))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    p = run(store, "cat", MISSING, "f")
    assert p.returncode == 4 and "not in the store" in p.stderr
    for args in (["ls", MISSING],
                 ["materialize", MISSING, str(tmp_path / "out")],
                 ["mount", "--ro", MISSING, str(mnt)],
                 ["mount", MISSING, str(mnt), "--state", str(tmp_path / "state")],
                 ["session", "new", "--seed", MISSING, "--no-fuse",
                  "--base", str(tmp_path / "ws")]):
        doc = failure(run(store, *args, "--json"), 4)
        assert doc["type"] == "RefNotFoundError", (args, doc)
    assert not fh.is_fuse_mounted(mnt)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")
def test_live_commands_take_any_path_inside_the_mount(mounter: fh.Mounter, fuse_store: Path,
                                                      lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    sub = d.mnt / "dir" / "sub"
    (sub / "new.txt").write_text("new\n")

    st = json.loads(run(fuse_store, "status", ".", "--json", cwd=sub).stdout)
    assert st["ref"] == lower_ref and st["dirty_inodes"] >= 1
    out = run(fuse_store, "diff", ".", cwd=sub).stdout
    assert "A\tdir/sub/new.txt" in out
    ck = run(fuse_store, "checkpoint", "deeper", "--json", cwd=sub)
    assert ck.returncode == 0, ck.stderr
    ref = json.loads(ck.stdout)["ref"]
    (sub / "new.txt").unlink()

    doc = failure(run(fuse_store, "restore", ".", MISSING, "--json", cwd=sub), 4)
    assert doc["type"] == "RefNotFoundError"
    assert not (sub / "new.txt").exists()  # a refused restore changes nothing
    r = run(fuse_store, "restore", str(sub / "deeper"), ref, "--discard", "--json")
    assert r.returncode == 0, r.stderr
    assert (sub / "new.txt").read_text() == "new\n"
    # A directory that is no mount and lies in none is still refused (exit 9).
    doc = failure(run(fuse_store, "status", str(d.mnt.parent), "--json"), 9)
    assert doc["type"] == "NotLiveError"


def test_ctrl_c_of_a_checkpoint_or_restore_says_the_daemon_may_finish_it() -> None:
    """Ctrl-C after a checkpoint or restore reached the daemon does not stop it there (the
    daemon runs it to its end), so the line says where to look; other commands just say
    interrupted. The arguments are the ones the real argument parser gives."""
    from rewindfs.cli import build_parser, interrupted_line

    parser = build_parser()
    for what, argv in (("checkpoint", ["checkpoint", "m"]), ("restore", ["restore", "m", "@x"]),
                       ("checkpoint", ["session", "checkpoint", "s"]),
                       ("restore", ["session", "restore", "s", "@x"])):
        line = interrupted_line(parser.parse_args(argv))
        assert f"a {what} the daemon already received still completes there" in line, argv
        assert "rewindfs list" in line and "pre_restore" in line
    for argv in (["list"], ["status", "m"], ["session", "step", "s"], ["session", "new"]):
        assert interrupted_line(parser.parse_args(argv)) == "interrupted", argv
