"""Path policies of a real session: given on ``session new`` and in the seed's
``.rewindfs.toml``, recorded in the session spec (kept by resume), reaching the tools through
the session binding; hidden files stay in the user's view of the live root (the FUSE mount
where FUSE is available).

Sessions are started and stopped through the CLI (tests/test_tools_session.py's Sessions),
outside /tmp because confined Bash gets a private /tmp.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_tools_session import Sessions, outside_tmp_sessions

from fusefs.session.fallback import fuse_available
from tools import sandbox
from tools.bash import run_bash
from tools.context import ToolContext
from tools.glob import glob
from tools.grep import grep
from tools.readfile import read_file
from tools.session_binding import SessionToolBinding
from tools.writefile import write_file

SECRET = "API_KEY=very-secret-value"
BACKENDS = ["fallback"] + (["fuse"] if fuse_available() else [])
HAS_BWRAP = sandbox.unavailable_reason() is None


@pytest.fixture
def sessions() -> Iterator[Sessions]:
    yield from outside_tmp_sessions()


def _seed(s: Sessions) -> Path:
    d = s.place / "seed"
    (d / "secrets").mkdir(parents=True)
    (d / "src").mkdir()
    (d / ".env").write_text(SECRET + "\n")
    (d / "secrets" / "prod.key").write_text("prod\n")
    (d / "src" / "app.py").write_text("print('app')\n")
    (d / ".rewindfs.toml").write_text('[policy]\nprotect = ["secrets/**"]\n')
    return d


def _new(s: Sessions, backend: str, *args: str) -> tuple[str, Path]:
    cmd = ["session", "new", "--base", str(s.base), "--json", *args]
    if backend == "fallback":
        cmd.append("--no-fuse")
    out = json.loads(s.cli(*cmd).stdout)
    return out["id"], Path(out["root"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_session_policy_reaches_tools_and_survives_resume(sessions: Sessions,
                                                          backend: str) -> None:
    sid, root = _new(sessions, backend, "--seed", str(_seed(sessions)), "--hide", ".env")
    spec = json.loads((sessions.store / "sessions" / sid / "host.json").read_text())
    assert spec["paths"]["hide"] == [".env"]
    assert "secrets/**" in spec["paths"]["protect"]      # from the seed's .rewindfs.toml
    for attempt in ("first", "resumed"):
        ctx = ToolContext(SessionToolBinding(sessions.store, sid))
        r = read_file(ctx, ".env")
        assert not r.ok and "no such file" in r.text and SECRET not in r.text, attempt
        assert ".env" not in glob(ctx, "**/*", path=".").data.get("paths", [])
        assert "very-secret" not in grep(ctx, "secret", output_mode="content").text
        w = write_file(ctx, "secrets/prod.key", "stolen\n")
        assert not w.ok and w.data["kind"] == "protected", w.text
        t = write_file(ctx, ".rewindfs.toml", "[policy]\n")
        assert not t.ok and t.data["kind"] == "protected", t.text
        assert write_file(ctx, f"src/new_{attempt}.py", "x = 1\n").ok
        if HAS_BWRAP:
            b = run_bash(ctx, "cat .env; echo cat=$?; echo x > secrets/prod.key; "
                              "echo write=$?; cat src/app.py")
            assert SECRET not in b.text and "cat=1" in b.text and "write=1" in b.text, b.text
            assert "print('app')" in b.text
        # The user sees everything in the live root (the mount for a FUSE session).
        assert (root / ".env").read_text() == SECRET + "\n"
        assert (root / "secrets" / "prod.key").read_text() == "prod\n"
        if attempt == "first":
            sessions.cli("session", "shutdown", sid)
            out = json.loads(sessions.cli("session", "resume", sid, "--json").stdout)
            root = Path(out["root"])


def test_bad_policy_is_refused_before_anything_starts(sessions: Sessions) -> None:
    seed = sessions.place / "seed"
    seed.mkdir()
    (seed / ".rewindfs.toml").write_text('[policy]\nhide = ".env"\n')
    p = sessions.cli("session", "new", "--no-fuse", "--base", str(sessions.base), "--seed",
                     str(seed), check=False)
    assert p.returncode == 10, p.stderr
    assert "hide is not a list of strings" in p.stderr
    assert not (sessions.store / "sessions").exists() or \
        not list((sessions.store / "sessions").iterdir())


def test_exclude_is_refused_on_the_no_fuse_fallback(sessions: Sessions) -> None:
    """The fallback checkpoints a plain directory whole: asking it for exclude fails (exit
    10) before anything starts, instead of freezing the excluded paths into every Ref."""
    p = sessions.cli("session", "new", "--no-fuse", "--base", str(sessions.base),
                     "--exclude", "node_modules/", check=False)
    assert p.returncode == 10, p.stderr
    assert "exclude needs a FUSE session" in p.stderr
    assert not (sessions.store / "sessions").exists() or \
        not list((sessions.store / "sessions").iterdir())


def _ls(s: Sessions, ref: str, path: str = "") -> set[str]:
    out = json.loads(s.cli("ls", ref, *([path] if path else []), "--json").stdout)
    return {e["name"] for e in out}


@pytest.mark.skipif("fuse" not in BACKENDS, reason="needs FUSE")
def test_excluded_node_modules_is_in_no_checkpoint_and_survives_restore(
        sessions: Sessions) -> None:
    """On a real mount: an excluded node_modules is not in the checkpoint's tree, survives
    a restore (same inode, same content), is in no diff, dirty count or step, and a fork
    starts without it, like a fresh clone."""
    seed = _seed(sessions)
    (seed / ".rewindfs.toml").write_text('[policy]\nexclude = ["__pycache__/"]\n')
    sid, root = _new(sessions, "fuse", "--seed", str(seed), "--exclude", "node_modules/")
    fork = None
    try:
        seed_ref = json.loads(sessions.cli("log", sid, "--json").stdout)[0]["ref"]
        (root / "node_modules/left-pad").mkdir(parents=True)
        (root / "node_modules/left-pad/index.js").write_text("module.exports = 1\n")
        (root / "src/__pycache__").mkdir()
        (root / "src/__pycache__/app.cpython-311.pyc").write_bytes(b"\0pyc")
        (root / "src/app.py").write_text("print('v2')\n")
        sessions.cli("session", "step", sid, "--label", "install")
        ref = json.loads(sessions.cli("session", "checkpoint", sid, "--json").stdout)["ref"]
        assert "node_modules" not in _ls(sessions, ref) and "src" in _ls(sessions, ref)
        assert _ls(sessions, ref, "src") == {"app.py"}
        assert sessions.cli("cat", ref, "src/app.py").stdout == "print('v2')\n"
        st = json.loads(sessions.cli("status", str(root), "--json").stdout)
        assert st["dirty_inodes"] == 0, st
        # changes below node_modules: in no diff, no dirty count, no step
        (root / "node_modules/left-pad/index.js").write_text("module.exports = 2\n")
        (root / "node_modules/new.js").write_text("x\n")
        assert json.loads(sessions.cli("diff", str(root), "--json").stdout)["changes"] == []
        st = json.loads(sessions.cli("status", str(root), "--json").stdout)
        assert st["dirty_inodes"] == 0, st
        sessions.cli("session", "step", sid, "--label", "build")
        log = json.loads(sessions.cli("log", sid, "--changes", "--json").stdout)
        steps = [e for e in log if e.get("event") == "step" or "step" in e]
        paths = {c["path"] for e in steps for c in e.get("changes", [])}
        assert "src/app.py" in paths, log
        assert not [p for p in paths if "node_modules" in p or "__pycache__" in p], paths
        ino = (root / "node_modules/left-pad/index.js").stat().st_ino
        # a restore leaves it as it is
        sessions.cli("session", "restore", sid, seed_ref)
        assert (root / "src/app.py").read_text() == "print('app')\n"
        assert (root / "node_modules/left-pad/index.js").read_text() == "module.exports = 2\n"
        assert (root / "node_modules/left-pad/index.js").stat().st_ino == ino
        assert (root / "src/__pycache__/app.cpython-311.pyc").read_bytes() == b"\0pyc"
        sessions.cli("session", "restore", sid, ref, "--path", "src")
        assert (root / "src/app.py").read_text() == "print('v2')\n"
        assert (root / "src/__pycache__/app.cpython-311.pyc").exists()
        # a fork starts without it; a resume here keeps it
        out = json.loads(sessions.cli("session", "fork", sid, "--json").stdout)
        fork, froot = out["id"], Path(out["root"])
        assert not (froot / "node_modules").exists()
        assert (froot / "src/app.py").read_text() == "print('v2')\n"
        sessions.cli("session", "shutdown", sid)
        root = Path(json.loads(sessions.cli("session", "resume", sid, "--json").stdout)["root"])
        assert (root / "node_modules/new.js").read_text() == "x\n"
        ref2 = json.loads(sessions.cli("session", "checkpoint", sid, "--json").stdout)["ref"]
        assert "node_modules" not in _ls(sessions, ref2)
    finally:
        for x in (sid, fork):
            if x is not None:
                sessions.cli("session", "shutdown", x, "--force", check=False)


@pytest.mark.skipif(not fuse_available(), reason="needs FUSE (a real mount)")
def test_hard_links_across_the_exclude_boundary_fail_with_exdev(sessions: Sessions) -> None:
    """On a real mount: ln of a file across the exclude boundary fails with EXDEV, also for
    a file frozen by a checkpoint or kept in node_modules; mv of a file with two names
    across falls back to copying, and the checkpoint after holds the names outside only."""
    import errno
    import subprocess

    seed = _seed(sessions)
    sid, root = _new(sessions, "fuse", "--seed", str(seed), "--exclude", "node_modules/")
    try:
        (root / "node_modules").mkdir()
        (root / "node_modules/kept.js").write_text("k\n")
        sessions.cli("session", "checkpoint", sid)
        for src, dst in (("src/app.py", "node_modules/app.py"),
                         ("node_modules/kept.js", "src/kept.js")):
            with pytest.raises(OSError) as e:
                os.link(root / src, root / dst)
            assert e.value.errno == errno.EXDEV, (src, dst)
        os.link(root / "src/app.py", root / "src/alias.py")  # one side: one inode
        sessions.cli("session", "checkpoint", sid)
        assert (root / "src/alias.py").stat().st_ino == (root / "src/app.py").stat().st_ino
        assert (root / "src/app.py").stat().st_nlink == 2
        subprocess.run(["mv", str(root / "src/alias.py"), str(root / "node_modules/")],
                       check=True)
        assert (root / "node_modules/alias.py").read_text() == "print('app')\n"
        assert (root / "src/app.py").stat().st_nlink == 1
        ref = json.loads(sessions.cli("session", "checkpoint", sid, "--json").stdout)["ref"]
        assert _ls(sessions, ref, "src") == {"app.py"}
        assert "node_modules" not in _ls(sessions, ref)
    finally:
        sessions.cli("session", "shutdown", sid, "--force", check=False)


def test_diff_tool_does_not_name_hidden_paths(sessions: Sessions) -> None:
    """The session's diff for the agent lists what changed, but never a hidden path."""
    sid, root = _new(sessions, "fallback", "--seed", str(_seed(sessions)), "--hide", ".env")
    binding = SessionToolBinding(sessions.store, sid)
    (root / ".env").write_text("API_KEY=rotated\n")      # the user changes both
    (root / "src" / "app.py").write_text("print('changed')\n")
    text = binding.diff()
    assert "src/app.py" in text and ".env" not in text, text


@pytest.mark.skipif(not HAS_BWRAP, reason="no bubblewrap sandbox here")
@pytest.mark.parametrize("backend", BACKENDS)
def test_renamed_parents_and_hard_links_stay_covered_in_a_session(sessions: Sessions,
                                                                  backend: str) -> None:
    """On the session's live root (the FUSE mount where there is one), a hidden file moved
    with its parent directory by one Bash call stays hidden from the next, and a hard link
    to it is hidden too (inode numbers of the mount's listings and lookups agree)."""
    seed = sessions.place / "seed"
    (seed / "secretsdir").mkdir(parents=True)
    (seed / "secretsdir" / "key").write_text(SECRET + "\n")
    (seed / "app.py").write_text("print('app')\n")
    sid, root = _new(sessions, backend, "--seed", str(seed), "--hide", "secretsdir/key")
    ctx = ToolContext(SessionToolBinding(sessions.store, sid))
    b = run_bash(ctx, "mv secretsdir moved && echo moved")
    assert "moved" in b.text, b.text
    os.link(root / "moved" / "key", root / "alias")         # the user's, or anyone's
    b = run_bash(ctx, "cat moved/key; echo rc=$?; cat alias; echo rc2=$?; cat app.py")
    assert SECRET not in b.text and "rc=1" in b.text and "rc2=1" in b.text, b.text
    assert "print('app')" in b.text
    for p in ("moved/key", "alias"):
        r = read_file(ctx, p)
        assert not r.ok and SECRET not in r.text, p
    assert (root / "moved" / "key").read_text() == SECRET + "\n"
