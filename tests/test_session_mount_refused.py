"""A session whose root the kernel refuses to mount (issue 10 point 1: a failed session new
or resume leaves no mount, process, record or state behind).

The refusal is real: the CLI runs in a private mount namespace (``unshare -m``) that has been
filled with bind mounts up to ``fs.mount-max``, so the FUSE mount of the session root fails
in the kernel (ENOSPC) after every early check passed. The namespace, and every mount in it,
ends with its last process; the global limit is not touched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from session_support import REPO

from fusefs.session.fallback import fuse_available
from store.objects import Store

MOUNT_MAX = Path("/proc/sys/fs/mount-max")


def _skip_reason() -> str | None:
    if not fuse_available():
        return "needs /dev/fuse and fusermount3"
    if os.getuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) for a private mount namespace"
    try:
        limit = int(MOUNT_MAX.read_text())
    except (OSError, ValueError):
        return "fs.mount-max is not readable"
    if limit > 1_000_000:
        return f"fs.mount-max is {limit}: too many mounts to fill"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

# Run inside the new namespace: make every mount private, fill the namespace with bind
# mounts until the kernel refuses one (rbinds of subtrees holding 2**k mounts, largest
# first), then run the CLI given in argv and print its outcome and the mounts left under
# the test directory, as JSON.
_IN_NAMESPACE = r"""
import ctypes, json, os, subprocess, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18

def mount(src, dst, fstype, flags):
    ok = libc.mount(src.encode(), dst.encode(), fstype.encode() if fstype else None,
                    flags, None) == 0
    return 0 if ok else ctypes.get_errno()

fill, tmp = sys.argv[1], sys.argv[2]
os.makedirs(fill)
assert mount("none", "/", None, MS_REC | MS_PRIVATE) == 0
# Copies of mounts other processes make and remove under /tmp or /work (a suite running
# beside this one) would free slots here when their mount points are removed on the host
# (the kernel then detaches them in every namespace), letting the session mount through.
with open("/proc/self/mountinfo") as f:
    points = [line.split()[4].replace("\\040", " ") for line in f]
for point in sorted(points, key=len, reverse=True):
    if point.startswith(("/tmp/", "/work/", "/var/tmp/")):
        libc.umount2(point.encode(), 2)  # MNT_DETACH
assert mount("tmpfs", fill, "tmpfs", 0) == 0
src = fill + "/src"
os.mkdir(src)
assert mount("tmpfs", src, "tmpfs", 0) == 0
k = 0
while True:  # src/c{k} is a copy of src when it held 2**k mounts
    d = f"{src}/c{k}"
    os.mkdir(d)
    if mount(src, d, None, MS_BIND | MS_REC):
        break
    k += 1
n = 0
for j in range(k - 1, -1, -1):
    while True:
        d = f"{fill}/r{n}"
        os.mkdir(d)
        if mount(f"{src}/c{j}", d, None, MS_BIND | MS_REC):
            os.rmdir(d)
            break
        n += 1
os.mkdir(fill + "/probe")
refused = mount(fill, fill + "/probe", None, MS_BIND)
p = subprocess.run(sys.argv[3:], capture_output=True, text=True, cwd=tmp, timeout=600)
with open("/proc/self/mountinfo") as f:
    left = [line for line in f if tmp in line and fill not in line]
print(json.dumps({"refused": os.strerror(refused) if refused else None,
                  "rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr,
                  "mounts": left}))
"""


def _processes_under(tmp: Path) -> list[int]:
    """Live processes whose command line names ``tmp`` (the session processes' specs do)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(tmp) in cmd and "fusefs.session" in cmd and state != "Z":
            out.append(int(d.name))
    return out


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    try:
        yield tmp_path
    finally:
        for pid in _processes_under(tmp_path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _cli(tmp: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "rewindfs", "--store", str(tmp / "store"), *args, "--json"]


def _runtime_files() -> set[str]:
    d = Path(os.environ["XDG_RUNTIME_DIR"]) / "rewindfs"
    return {str(p) for p in d.rglob("*")} if d.is_dir() else set()


def _in_full_namespace(tmp: Path, argv: list[str]) -> dict[str, object]:
    before = _runtime_files()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c",
                        _IN_NAMESPACE, str(tmp / "fill"), str(tmp), *argv],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr
    out: dict[str, object] = json.loads(p.stdout)
    assert out["refused"] == os.strerror(28), out  # ENOSPC: the namespace is full
    out["runtime_left"] = sorted(_runtime_files() - before)
    return out


def _assert_refused_and_nothing_left(tmp: Path, out: dict[str, object]) -> None:
    assert out["rc"] == 9, out
    err = json.loads(str(out["stdout"]))
    assert err["kind"] == "MountError", err
    assert "cannot mount" in err["cause"], err
    assert out["mounts"] == [], out
    assert _processes_under(tmp) == []
    assert out["runtime_left"] == [], out  # no socket or record of the failed start


@pytest.mark.parametrize("placement", ["per-session", "exclusive", "shared"])
def test_session_new_on_a_refused_mount_fails_and_leaves_nothing(tmp: Path,
                                                                  placement: str) -> None:
    args = ["session", "new", "--placement", placement]
    if placement != "per-session":
        root = tmp / "root"
        root.mkdir()
        (root / "kept.txt").write_text("the fixed root's own file\n")
        args += ["--root", str(root)]
    out = _in_full_namespace(tmp, _cli(tmp, *args))
    _assert_refused_and_nothing_left(tmp, out)
    sessions = tmp / "store" / "sessions"
    assert not sessions.is_dir() or [p.name for p in sessions.iterdir()
                                     if p.is_dir() and p.name != "roots"] == []
    assert Store(tmp / "store").catalog.state_dirs() == []  # no upper pinned, none kept
    assert not list((tmp / "store" / "sessions").rglob("upper.sqlite"))
    if placement != "per-session":
        assert (tmp / "root" / "kept.txt").read_text() == "the fixed root's own file\n"
        assert sorted(p.name for p in (tmp / "root").iterdir()) == ["kept.txt"]
    else:
        base = tmp / "agent-data" / "workspaces"
        assert not base.is_dir() or list(base.iterdir()) == []


@pytest.mark.parametrize("op", ["resume", "fork"])
def test_session_resume_or_fork_on_a_refused_mount_fails_and_leaves_nothing(tmp: Path,
                                                                          op: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(*args: str) -> str:
        p = subprocess.run(_cli(tmp, *args), capture_output=True, text=True, cwd=str(tmp),
                           env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout

    sid = json.loads(run("session", "new"))["id"]
    run("session", "shutdown", sid)
    roots = tmp / "agent-data" / "workspaces"
    before = sorted(os.listdir(roots))
    out = _in_full_namespace(tmp, _cli(tmp, "session", op, sid))
    _assert_refused_and_nothing_left(tmp, out)
    sessions = tmp / "store" / "sessions"
    assert [p.name for p in sessions.iterdir() if p.is_dir() and p.name != "roots"] == [sid]
    assert sorted(os.listdir(roots)) == before  # a fork's root is gone again
    run("session", "resume", sid)  # the session is still whole, and resumes
    run("session", "shutdown", sid)
