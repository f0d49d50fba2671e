"""The ``rewindfs session`` and ``rewindfs log`` commands, end to end in subprocesses.

Each ``session new|resume|fork`` leaves a background session host; the fixture shuts every
host down at teardown (and kills any that does not go), so no process outlives a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from session_support import REPO, ref_of, stop_hosts

from fusefs.session.registry import Registry
from store.objects import Store


class Cli:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store = tmp / "store"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(self.store),
                            *args], capture_output=True, text=True, cwd=str(self.tmp),
                           timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
        if check and p.returncode != 0:
            raise AssertionError(f"rewindfs {' '.join(args)} -> {p.returncode}: {p.stderr}")
        return p

    def json(self, *args: str) -> object:
        return json.loads(self.run(*args, "--json").stdout)

    def new(self, *args: str) -> dict[str, str]:
        out = self.json("session", "new", "--no-fuse", *args)
        assert isinstance(out, dict)
        return out

    def cleanup(self) -> None:
        stop_hosts(self.store / "sessions",
                   lambda sid: self.run("session", "shutdown", sid, check=False))


@pytest.fixture
def cli(tmp_path: Path) -> Iterator[Cli]:
    c = Cli(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


def test_new_checkpoint_restore_log_fork_shutdown(cli: Cli) -> None:
    s = cli.new()
    assert set(s) >= {"id", "root"}
    root = Path(s["root"])
    assert root.is_dir() and root.parent == cli.tmp / "agent-data" / "workspaces"
    listed = cli.json("session", "list")
    assert [(r["id"], r["state"]) for r in listed] == [(s["id"], "running")]  # type: ignore
    (root / "f").write_text("one\n")
    a = cli.json("session", "checkpoint", s["id"])["ref"]  # type: ignore[index]
    assert a == str(ref_of(root))
    (root / "f").write_text("two\n")
    b = cli.run("session", "checkpoint", s["id"]).stdout.strip()
    cli.run("session", "restore", s["id"], a)
    assert (root / "f").read_text() == "one\n"
    log = cli.json("log", s["id"])
    assert [(e["event"], e.get("trigger"), e["ref"]) for e in log][1:] == [  # type: ignore
        ("WorkspaceCheckpointed", "manual", a), ("WorkspaceCheckpointed", "manual", b),
        ("WorkspaceCheckpointed", "pre_restore", b), ("WorkspaceRestored", None, a)]
    assert log[0]["trigger"] == "seed"  # type: ignore[index]
    text = cli.run("log", s["id"]).stdout.splitlines()
    assert len(text) == 5 and text[-1].split()[-1] == a

    f = cli.json("session", "fork", s["id"])
    assert isinstance(f, dict) and f["id"] != s["id"]
    assert (Path(f["root"]) / "f").read_text() == "one\n"
    assert cli.json("log", s["id"])[-1]["trigger"] == "fork"  # type: ignore[index]

    assert cli.json("session", "shutdown", s["id"])["state"] == "stopped"  # type: ignore
    states = {r["id"]: r["state"] for r in cli.json("session", "list")}  # type: ignore
    assert states == {s["id"]: "stopped", f["id"]: "running"}
    r = cli.json("session", "resume", s["id"])
    assert r == {"id": s["id"], "root": s["root"], "state": "running"}
    assert (root / "f").read_text() == "one\n"
    cli.run("session", "shutdown", s["id"])
    cli.run("session", "shutdown", f["id"])


def test_exclusive_root_race_through_the_cli(cli: Cli) -> None:
    root = cli.tmp / "project"
    root.mkdir()
    (root / "kept").write_text("adopted\n")
    Store(cli.store).close()  # the race is for the root, not for creating the store
    cmd = [sys.executable, "-m", "rewindfs", "--store", str(cli.store), "session", "new",
           "--no-fuse", "--placement", "exclusive", "--root", str(root), "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=str(cli.tmp)) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 10], outs
    loser = outs[[p.returncode for p in procs].index(10)][1]
    assert str(root) in loser and "epoch 1" in loser and "Traceback" not in loser
    won = json.loads(outs[[p.returncode for p in procs].index(0)][0])
    assert won["root"] == str(root)
    log = cli.json("log", won["id"])
    assert [e["trigger"] for e in log] == ["seed"]  # type: ignore
    assert log[0]["ref"] == str(ref_of(root))  # type: ignore[index]


@pytest.mark.parametrize("args,code,words", [
    (["--placement", "shared", "--root", "r", "--required"], 10, "shared_required"),
    (["--placement", "exclusive"], 2, "--root"),
    (["--root", "r"], 2, "--base"),
    (["--seed", "v1:blake3:" + "0" * 64], 4, "not in the store"),
    (["--seed", "no-such-dir"], 10, "neither a Ref nor a directory"),
    (["--placement", "shared", "--root", "r", "--seed", "."], 10, "shared root cannot"),
])
def test_errors_are_one_line_with_their_exit_code(cli: Cli, args: list[str], code: int,
                                                  words: str) -> None:
    p = cli.run("session", "new", "--no-fuse", *args, check=False)
    assert p.returncode == code, p.stderr
    assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert Registry(str(cli.store / "sessions")).list() == []


def test_unknown_session(cli: Cli) -> None:
    for args in (["log", "nope"], ["session", "resume", "nope"], ["session", "fork", "nope"]):
        p = cli.run(*args, check=False)
        assert p.returncode == 4 and "no session 'nope'" in p.stderr, p.stderr
    s = cli.new()
    cli.run("session", "shutdown", s["id"])
    p = cli.run("session", "checkpoint", s["id"], check=False)
    assert p.returncode == 10 and "closed" in p.stderr


def test_shutdown_checkpoints_only_when_asked(cli: Cli) -> None:
    s = cli.new()
    root = Path(s["root"])
    (root / "f").write_text("kept by the shutdown checkpoint\n")
    # The default makes no checkpoint (CONTRACT 4.9): the journal holds the seed alone.
    out = cli.json("session", "shutdown", s["id"])
    assert out["ref"] is None  # type: ignore[index]
    assert [e["trigger"] for e in cli.json("log", s["id"])] == ["seed"]  # type: ignore
    cli.run("session", "resume", s["id"])
    (root / "g").write_text("and this\n")
    want = str(ref_of(root))
    out = cli.json("session", "shutdown", s["id"], "--checkpoint")
    assert out["state"] == "stopped" and out["ref"] == want  # type: ignore[index]
    log = cli.json("log", s["id"])
    assert [(e["trigger"], e["ref"]) for e in log][-1] == ("shutdown", want)  # type: ignore
    states = {r["id"]: r["state"] for r in cli.json("session", "list")}  # type: ignore
    assert states == {s["id"]: "stopped"}


def test_list_shows_an_unreadable_record_and_every_readable_one(cli: Cli) -> None:
    """A session record that cannot be read (not JSON, not an object of a record's fields)
    does not hide the others: ``session list`` exits 0 with every readable session and one
    escaped line per unreadable record, marked unreadable with the reason."""
    from fusefs.session.registry import RECORD, SessionRecord

    Store(cli.store).close()
    reg = Registry(str(cli.store / "sessions"))
    good = ["20261204-010000-0000000a", "20261204-010000-0000000b"]
    for i, sid in enumerate(good):
        reg.create(SessionRecord(id=sid, fingerprint=None, mode=None, root=None,
                                 state_dir=reg.state_dir(sid), backend="fallback",
                                 created_ns=i + 1))
    bad = {"20261204-010000-0000000c": b"{\"id\": \"x\n\x1b[2J",  # cut short, a control byte
           "20261204-010000-0000000d": b"[1, 2]",
           "20261204-010000-0000000e": b"{\"id\": \"20261204-010000-0000000e\"}"}
    for sid, text in bad.items():
        os.mkdir(reg.state_dir(sid), 0o700)
        with open(os.path.join(reg.state_dir(sid), RECORD), "wb") as f:
            f.write(text)

    r = cli.run("session", "list")
    lines = r.stdout.splitlines()
    assert "\x1b" not in r.stdout and len(lines) == len(good) + len(bad), r.stdout
    for sid in good:
        assert any(ln.startswith(f"{sid}  stopped") for ln in lines), lines
    for sid in bad:
        line = [ln for ln in lines if ln.startswith(sid)]
        assert len(line) == 1 and " unreadable " in line[0], lines
    rows = cli.json("session", "list")
    assert isinstance(rows, list)
    assert sorted(x["id"] for x in rows if x["state"] == "unreadable") == sorted(bad)
    assert all(x["reason"] for x in rows if x["state"] == "unreadable"), rows
