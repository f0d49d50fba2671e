"""The path policy's covers of a real session against changes made while a Bash command runs
and across a restart of the tools (a new binding, as an MCP server restart makes).

A running command's covers are mounts on the objects its call started with (tools.sandbox):
the tests below replace such an object under the command (the user's ``sed -i``, an
editor's save: write a temporary file, rename it over the name; a path restore) and look at
what the command then sees. Sessions are started and stopped through the CLI, outside /tmp
because confined Bash gets a private /tmp.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from test_tools_session import Sessions, outside_tmp_sessions

from fusefs.session.fallback import fuse_available
from store.pathpolicy import PathPolicy
from tools import sandbox
from tools.bash import bash_output, run_bash
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.paths import Covered
from tools.readfile import read_file
from tools.result import ToolResult
from tools.session_binding import SessionToolBinding

SECRET = "API_KEY=very-secret-value"
NEW_SECRET = "API_KEY=rotated-secret-value"
BACKENDS = ["fallback"] + (["fuse"] if fuse_available() else [])
needs_sandbox = pytest.mark.skipif(sandbox.unavailable_reason() is not None,
                                   reason="no bubblewrap sandbox here")
needs_fuse = pytest.mark.skipif(not fuse_available(), reason="needs FUSE")
# The command polls for sync/go (made by the test once it changed the tree): no timing.
# It polls from inside sync/, a directory of its own: a lookup of a missing name takes its
# directory's lock, which the user's change of a covered name holds while the daemon waits
# for the command to die, and a process blocked on it cannot die (README, Limits), so a
# poll in the changed directory can make the change fail with EBUSY.
_SYNC = "sync"
_WAIT_GO = (f"mkdir {_SYNC} && cd {_SYNC} && touch started && while [ ! -e go ]; "
            f"do sleep 0.02; done && cd .. && rm -r {_SYNC}; ")


@pytest.fixture
def sessions() -> Iterator[Sessions]:
    yield from outside_tmp_sessions()


def _new(s: Sessions, backend: str, seed: Path, *args: str) -> tuple[str, Path]:
    cmd = ["session", "new", "--base", str(s.base), "--json", "--seed", str(seed), *args]
    if backend == "fallback":
        cmd.append("--no-fuse")
    out = json.loads(s.cli(*cmd).stdout)
    return out["id"], Path(out["root"])


def _seed(s: Sessions) -> Path:
    d = s.place / "seed"
    (d / "secretsdir").mkdir(parents=True)
    (d / "conf").mkdir()
    (d / ".env").write_text(SECRET + "\n")
    (d / "secretsdir" / "key").write_text(SECRET + "\n")
    (d / "conf" / "app.lock").write_text("locked\n")
    (d / "app.py").write_text("print('app')\n")
    return d


def _during(ctx: ToolContext, root: Path, command: str,
            change: Callable[[], None]) -> ToolResult:
    """Run ``command`` in Bash; once it has started, ``change()`` the tree (as the user),
    then let the command go on."""
    box: list[ToolResult] = []
    t = threading.Thread(target=lambda: box.append(run_bash(ctx, _WAIT_GO + command,
                                                            timeout=120)))
    t.start()
    try:
        while not (root / _SYNC / "started").exists() and t.is_alive():
            time.sleep(0.02)
        change()
    finally:
        with contextlib.suppress(FileNotFoundError):   # the command failed before
            (root / _SYNC / "go").touch()
        t.join()
    return box[0]


def _replace(path: Path, text: str) -> None:
    """What ``sed -i`` and an editor's save do: a new file renamed over the name."""
    tmp = path.with_name(path.name + ".tmp-save")
    tmp.write_text(text)
    os.replace(tmp, path)


@needs_sandbox
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_moved_hidden_file_stays_hidden_after_the_tools_restart(sessions: Sessions,
                                                                  backend: str) -> None:
    """``mv secretsdir moved`` in one call; then the tools start again (a new binding: an
    MCP server restart) and ``moved/key`` is still hidden, for Bash and for ReadFile; and
    again after the session is shut down and resumed (a new mount where FUSE serves)."""
    sid, root = _new(sessions, backend, _seed(sessions), "--hide", "secretsdir/key")
    ctx = ToolContext(SessionToolBinding(sessions.store, sid))
    b = run_bash(ctx, "mv secretsdir moved && echo moved")
    assert "moved" in b.text, b.text
    ctx.close()
    for attempt in ("tools restarted", "session resumed"):
        again = ToolContext(SessionToolBinding(sessions.store, sid))
        b = run_bash(again, "cat moved/key; echo rc=$?; cat app.py")
        assert SECRET not in b.text and "rc=1" in b.text, (attempt, b.text)
        assert "print('app')" in b.text
        r = read_file(again, "moved/key")
        assert not r.ok and SECRET not in r.text, (attempt, r.text)
        assert (root / "moved" / "key").read_text() == SECRET + "\n"   # the user's view
        again.close()
        if attempt == "tools restarted":     # a new mount: other inode numbers, maybe
            sessions.cli("session", "shutdown", sid)
            out = json.loads(sessions.cli("session", "resume", sid, "--json").stdout)
            root = Path(out["root"])


def _unlink_and_create(path: Path, text: str) -> None:
    path.unlink()
    path.write_text(text)


def _move_away_and_create(path: Path, text: str) -> None:
    os.rename(path, path.with_name(path.name + ".old"))
    path.write_text(text)


def _exchange_with_new(path: Path, text: str) -> None:
    """renameat2(RENAME_EXCHANGE) of the name with a new file: both names stay."""
    other = path.with_name(path.name + ".new")
    other.write_text(text)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(-100, os.fsencode(path), -100, os.fsencode(other), 2) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _stopped(b: ToolResult, path: str) -> None:
    """``b`` is the answer of a command the session stopped for ``path``."""
    assert not b.ok and b.data.get("kind") == "cover_changed", b.text
    assert b.data.get("path") == path, b.text
    assert f"{path} was removed, replaced or linked" in b.text, b.text


def _link_as_alias(path: Path) -> None:
    """A hard link the user makes: a new name (``alias``) no cover sits on."""
    os.link(path, path.with_name("alias"))


_ROTATED = NEW_SECRET + "\n"


@needs_sandbox
@needs_fuse
@pytest.mark.parametrize(("change", "name", "seen"), [
    pytest.param(lambda p: _replace(p, _ROTATED), ".env", NEW_SECRET, id="rename-over"),
    pytest.param(lambda p: _unlink_and_create(p, _ROTATED), ".env", NEW_SECRET,
                 id="unlink-create"),
    pytest.param(lambda p: _move_away_and_create(p, _ROTATED), ".env", NEW_SECRET,
                 id="rename-away-create"),
    pytest.param(lambda p: _exchange_with_new(p, _ROTATED), ".env", NEW_SECRET,
                 id="exchange"),
    pytest.param(_link_as_alias, "alias", SECRET, id="new-link"),
])
def test_a_running_command_is_stopped_before_its_hidden_file_is_changed(
        sessions: Sessions, change: Callable[[Path], None], name: str, seen: str) -> None:
    """The user replaces a hidden file, or links it under a new name, while a command runs
    (``change(root / ".env")``): the daemon kills the command before the change (its cover,
    a mount on the old dentry, would not survive a replacement; a new link is a name no
    cover sits on); the command never reads ``name``, the user's change takes effect (the
    user reads ``seen`` there), and the next call covers ``name`` too."""
    sid, root = _new(sessions, "fuse", _seed(sessions), "--hide", ".env")
    ctx = ToolContext(SessionToolBinding(sessions.store, sid))
    b = _during(ctx, root, f"cat {name}; echo rc=$?", lambda: change(root / ".env"))
    assert (root / name).read_text() == seen + "\n"
    _stopped(b, ".env")
    assert SECRET not in b.text and NEW_SECRET not in b.text, b.text
    assert "rc=" not in b.text, b.text
    b = run_bash(ctx, f"cat {name}; echo rc=$?")
    assert SECRET not in b.text and NEW_SECRET not in b.text, b.text
    assert "rc=1" in b.text, b.text
    ctx.close()


@needs_sandbox
@needs_fuse
def test_a_running_command_is_stopped_before_its_protected_file_is_replaced(
        sessions: Sessions) -> None:
    sid, root = _new(sessions, "fuse", _seed(sessions), "--protect", "conf/app.lock")
    ctx = ToolContext(SessionToolBinding(sessions.store, sid))
    b = _during(ctx, root, "echo pwned >> conf/app.lock; echo w=$?",
                lambda: _replace(root / "conf" / "app.lock", "relocked\n"))
    assert (root / "conf" / "app.lock").read_text() == "relocked\n", b.text
    _stopped(b, "conf/app.lock")
    assert "w=" not in b.text, b.text
    ctx.close()


@needs_sandbox
@needs_fuse
@pytest.mark.parametrize("restore", [["--path", ".env"], []], ids=["path-restore", "whole"])
def test_a_background_command_is_stopped_before_a_restore_changes_its_hidden_file(
        sessions: Sessions, restore: list[str]) -> None:
    """A foreground call holds a write permit (a restore waits for it); a background
    command does not, so a restore (of .env alone, or of the whole tree, to the ref before
    .env was rewritten) changes what it covers while it runs: the daemon stops it first,
    then restores."""
    sid, root = _new(sessions, "fuse", _seed(sessions), "--hide", ".env")
    ref = json.loads(sessions.cli("log", sid, "--json").stdout)[0]["ref"]
    (root / ".env").write_text(NEW_SECRET + "\n")
    ctx = ToolContext(SessionToolBinding(sessions.store, sid))
    try:
        r = run_bash(ctx, _WAIT_GO + "cat .env > seen 2>&1; mv seen seen.done",
                     run_in_background=True)
        assert r.ok, r.text
        for _ in range(6000):
            if (root / _SYNC / "started").exists():
                break
            time.sleep(0.02)
        sessions.cli("session", "restore", sid, ref, *restore)
        assert (root / ".env").read_text() == SECRET + "\n"
        with contextlib.suppress(FileNotFoundError):   # a whole restore removed sync/
            (root / _SYNC / "go").touch()
        out = bash_output(ctx, r.data["bash_id"], wait=60)
        assert out.data["status"] == "killed", out.text
        assert ".env was removed, replaced or linked" in out.text, out.text
        assert not (root / "seen.done").exists() and not (root / "seen").exists()
    finally:
        ctx.close()


def test_a_record_of_another_mount_covers_the_objects_at_its_paths(tmp_path: Path) -> None:
    """A saved record whose root is another object (a new mount of the session) is taken
    by its paths: the objects there now are covered, its inode numbers are not used."""
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "key").write_text(SECRET)
    (tmp_path / "other").write_text("x")
    (tmp_path / "lnk").symlink_to("other")
    other = (tmp_path / "other").stat().st_ino
    rec = Covered().record((0, 0), ["moved", "lnk"], [])
    rec["hidden"] = [other]
    covered = Covered()
    covered.load(rec, str(tmp_path))
    assert covered.hides((tmp_path / "moved").stat())
    assert not covered.hides((tmp_path / "other").stat())   # neither the number nor the link
    top = tmp_path.stat()
    rec["root"] = [top.st_dev, top.st_ino]
    covered.load(rec, str(tmp_path))
    assert covered.hides((tmp_path / "other").stat())
    assert not covered.hides((tmp_path / "moved").stat())


@needs_sandbox
@pytest.mark.xfail(strict=True, reason="issue 14: identities are inode numbers; a file "
                   "renamed over a covered object's new name is a new object")
def test_a_replaced_file_under_a_name_no_pattern_matches_stays_hidden(tmp_path: Path) -> None:
    """``mv secretsdir moved`` by a command; the user then saves ``moved/key`` (a new file
    renamed over it): the next call must still not read it."""
    root = tmp_path / "root"
    (root / "secretsdir").mkdir(parents=True)
    (root / "secretsdir" / "key").write_text(SECRET + "\n")
    ctx = ToolContext(DirBinding(root, policy=PathPolicy(hide=("secretsdir/key",))))
    assert "moved" in run_bash(ctx, "mv secretsdir moved && echo moved").text
    _replace(root / "moved" / "key", NEW_SECRET + "\n")
    b = run_bash(ctx, "cat moved/key; echo rc=$?")
    assert NEW_SECRET not in b.text and "rc=1" in b.text, b.text
