"""The README's shell examples run as written, one after the other, on a scratch set-up.

The examples to run are the README's fenced ``sh`` blocks (other blocks are synopses,
configuration, or need servers the test does not start, such as the shared mode's). In a
block, a line starting with ``$ `` is a command and the lines below it are the output it
shows, which is not compared (ids, Refs and times differ from run to run). The commands
of every block are joined, in order, into one bash script run with ``set -e``, so a
command that fails (a Ref form that does not resolve, a missing path, a refused restore)
fails the test, and the state they build (``cd``, ``S``, ``R``) carries from block to block
as it does for a reader typing them.

The scratch set-up stands for what the walk-through assumes: a temporary directory is "this
repository's root" (the working directory: ``agent-data/`` is made there) with the
repository's ``.venv/bin`` first on PATH (what ``source .venv/bin/activate`` does); HOME is
a temporary directory holding ``~/src/myproject``, a small git project with a
``setup.py``, a package and passing pytest tests; git has an identity; the runtime
directory is the test's own. One substitution is made: the example Ref prefix
``26b779fd`` stands for the first 8 hex digits of the Ref that the example's
``checkpoint --label "tests pass"`` printed, which a reader would type instead.

Whatever happens, teardown shuts down every session of the scratch store, kills every
daemon that recorded a mount in the test's runtime directory and lazily unmounts anything
still mounted under the scratch directory, before removing it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = REPO / ".venv" / "bin"
EXAMPLE_PREFIX = "26b779fd"

pytestmark = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK) or shutil.which("fusermount3") is None,
    reason="the walk-through's sessions and mounts need FUSE")


def sh_blocks(text: str) -> list[list[str]]:
    """The commands (``$ `` lines, prompt removed) of every fenced ``sh`` block, in order."""
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)
    return [[ln[2:] for ln in b.splitlines() if ln.startswith("$ ")] for b in blocks]


def script(blocks: list[list[str]]) -> str:
    """One bash script running every command in order, each shown (``$ CMD``) first."""
    prefix = ('"$(rewindfs list --json | python -c \'import json, sys; print(next(s["ref"]'
              '[10:18] for s in reversed(json.load(sys.stdin)) if s["label"] == "tests pass"))'
              '\')"')
    lines = ["set -e"]
    for i, block in enumerate(blocks, 1):
        lines.append(f"echo {shlex.quote(f'--- block {i}')}")
        for cmd in block:
            lines.append(f"echo {shlex.quote('$ ' + cmd)}")
            lines.append(cmd.replace(EXAMPLE_PREFIX, prefix))
    return "\n".join(lines) + "\n"


def mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [ln.split()[1] for ln in f if ln.split()[1].startswith(str(root) + "/")]


def make_project(home: Path, env: dict[str, str]) -> None:
    proj = home / "src" / "myproject"
    (proj / "myproject").mkdir(parents=True)
    (proj / "tests").mkdir()
    (proj / "setup.py").write_text(
        "from setuptools import setup\n\n"
        "setup(name='myproject', version='1.0', packages=['myproject'])\n")
    (proj / "myproject" / "__init__.py").write_text(
        'def greet(name):\n    return f"hello, {name}"\n')
    (proj / "tests" / "test_greet.py").write_text(
        "from myproject import greet\n\n\ndef test_greet():\n"
        "    assert greet('you') == 'hello, you'\n")
    (proj / ".gitignore").write_text("__pycache__/\n.pytest_cache/\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "first"]):
        subprocess.run(["git", *args], cwd=proj, env=env, check=True, capture_output=True)


@pytest.fixture
def scratch() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="rwsh-"))  # short: sockets live in its runtime dir
    (top / "run").mkdir(mode=0o700)
    try:
        yield top
    finally:
        store = top / "repo" / "agent-data" / "store"
        if store.is_dir():
            p = subprocess.run([str(BIN / "rewindfs"), "--store", str(store), "session",
                                "list", "--json"], capture_output=True, text=True,
                               env=dict(os.environ, XDG_RUNTIME_DIR=str(top / "run")))
            try:
                rows = json.loads(p.stdout)
            except json.JSONDecodeError:
                rows = []
            for row in rows:
                if row.get("state") == "running":
                    subprocess.run([str(BIN / "rewindfs"), "--store", str(store), "session",
                                    "shutdown", row["id"], "--force"], capture_output=True,
                                   timeout=120,
                                   env=dict(os.environ, XDG_RUNTIME_DIR=str(top / "run")))
        for rec in (top / "run" / "rewindfs" / "mounts").glob("*.json"):
            try:
                os.kill(int(json.loads(rec.read_text())["pid"]), signal.SIGKILL)
            except (OSError, ValueError, KeyError):
                pass
        for m in sorted(mounts_under(top), key=len, reverse=True):
            subprocess.run(["fusermount3", "-uz", m], capture_output=True)
        if not mounts_under(top):
            shutil.rmtree(top, ignore_errors=True)


def test_the_readme_shell_examples_run_as_written(scratch: Path) -> None:
    blocks = sh_blocks((REPO / "README.md").read_text())
    assert len(blocks) >= 8 and all(blocks), "the README's sh blocks (each with commands)"
    home, repo = scratch / "home", scratch / "repo"
    home.mkdir()
    repo.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("REWINDFS_")}
    env.update(PATH=f"{BIN}:{os.environ['PATH']}", HOME=str(home),
               XDG_RUNTIME_DIR=str(scratch / "run"), TMPDIR=str(scratch),
               GIT_AUTHOR_NAME="a reader", GIT_AUTHOR_EMAIL="reader@localhost",
               GIT_COMMITTER_NAME="a reader", GIT_COMMITTER_EMAIL="reader@localhost",
               GIT_CONFIG_NOSYSTEM="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    make_project(home, env)
    p = subprocess.run(["bash", "-c", script(blocks)], cwd=repo, env=env, text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600,
                       start_new_session=True)
    assert p.returncode == 0, p.stdout[-6000:]
    out = p.stdout
    # what the examples say they show
    assert re.search(r"^D\ttests$", out, re.M), out[-4000:]        # diff .
    assert "+oops" in out                                           # diff -u .
    assert re.search(r"^step 1 \(seq \d+\): \d+ path\(s\)", out, re.M)
    assert "restore" in out and "pre_restore" in out                # log $S
    assert "\n# more\n" in out          # the plain mount's change survived its remount
    assert (repo / "agent-data" / "myproject-at-checkpoint" / "tests" /
            "test_greet.py").is_file()
    assert "edited in the session" not in (home / "src" / "myproject" / "setup.py").read_text()
    assert mounts_under(scratch) == []
