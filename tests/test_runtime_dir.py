"""The runtime directory and failed starts (issue 10, point 1), through the real CLI.

A fresh machine may already hold a runtime directory with loose bits (an older release, a
umask of 022): every mount and session must still start, and the directory ends up 0700. A
level owned by another user is refused with a message saying what to do. A start that fails
(before or after its root was mounted) reports its real cause in one line and in the daemon
log, and leaves no mount, no process, no session record and no state behind.

Every command runs with its own runtime directory (``XDG_RUNTIME_DIR``, or ``TMPDIR`` for
the ``/tmp/rewindfs-<uid>`` fallback) inside the test's scratch directory; teardown kills
every process that names the scratch directory and lazily unmounts whatever is left there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from session_support import REPO

from fusefs.session.fallback import fuse_available
from fusefs.session.fusetree import shared_dir

pytestmark = pytest.mark.skipif(not fuse_available(), reason="needs /dev/fuse and fusermount3")

UID = os.getuid()


def _procs_naming(path: Path) -> list[int]:
    """Processes (other than this one) whose command line names ``path``."""
    out = []
    needle = os.fsencode(path)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


class Box:
    """A scratch directory with a store, a snapshot, and the environment of the CLI."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.store = base / "store"
        self.env = dict(os.environ, PYTHONPATH=str(REPO))
        self.rt: Path | None = None  # the runtime directory, once chosen
        src = base / "src"
        src.mkdir()
        (src / "a").write_text("lower\n")
        self.ref = fh.snapshot(self.store, src)

    def runtime(self, kind: str) -> Path:
        """Point the CLI at a runtime directory under the box; return its path (not
        created). ``xdg``: ``$XDG_RUNTIME_DIR/rewindfs``; ``tmp``: ``$TMPDIR/rewindfs-<uid>``."""
        if kind == "xdg":
            xdg = self.base / "xdg"
            xdg.mkdir(mode=0o700)
            self.env["XDG_RUNTIME_DIR"] = str(xdg)
            self.env.pop("TMPDIR", None)
            self.rt = xdg / "rewindfs"
            return self.rt
        tmp = self.base / "tmp"
        tmp.mkdir()
        self.env.pop("XDG_RUNTIME_DIR", None)
        self.env["TMPDIR"] = str(tmp)
        self.rt = tmp / f"rewindfs-{UID}"
        return self.rt

    def rw(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        p = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(self.store),
                            *args], capture_output=True, text=True, cwd=str(self.base),
                           env=self.env, timeout=300)
        if ok:
            assert p.returncode == 0, f"rewindfs {' '.join(args)}: {p.returncode} {p.stderr}"
        return p

    def sessions(self) -> list[str]:
        d = self.store / "sessions"
        return sorted(p.name for p in d.iterdir() if p.name != "roots") if d.is_dir() else []

    def assert_nothing_left(self) -> None:
        mounted = [m for m, _ in fh.mount_table() if m.startswith(str(self.base) + "/")]
        assert mounted == [], mounted
        deadline = time.monotonic() + 30  # a process reports before its exit completes
        while _procs_naming(self.base) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _procs_naming(self.base) == []
        # A daemon's claim of its mount point (a lock file) goes when the daemon ends.
        if self.rt is not None and (self.rt / "mounts").is_dir():
            assert sorted(p.name for p in (self.rt / "mounts").glob("*.lock")) == []


@pytest.fixture
def box() -> Iterator[Box]:
    # Short paths: a socket path under the runtime directory must fit 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="rwrt-"))
    try:
        yield Box(base)
    finally:
        for pid in _procs_naming(base):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        fh.unmount_leftovers([str(base)])
        subprocess.run(["chown", "-R", str(UID), str(base)], capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.mark.parametrize("kind", ["xdg", "tmp"])
def test_a_loose_runtime_dir_is_tightened_and_every_start_works(box: Box, kind: str) -> None:
    """From ``<runtime>/rewindfs`` (or ``/tmp/rewindfs-<uid>``) and its ``mounts`` existing
    0755: a read-only mount and unmount, then a read-write mount and a FUSE session all
    start, and every level is 0700 afterwards."""
    rt = box.runtime(kind)
    (rt / "mounts").mkdir(parents=True)
    os.chmod(rt, 0o755)
    os.chmod(rt / "mounts", 0o755)
    ro, mnt = box.base / "ro", box.base / "mnt"
    ro.mkdir()
    mnt.mkdir()
    box.rw("mount", "--ro", box.ref, str(ro))
    assert (ro / "a").read_text() == "lower\n"
    box.rw("umount", str(ro))
    box.rw("mount", box.ref, str(mnt), "--state", str(box.base / "state"))
    (mnt / "b").write_text("upper\n")
    box.rw("umount", str(mnt))
    out = json.loads(box.rw("session", "new", "--base", str(box.base / "ws"),
                            "--json").stdout)
    assert fh.is_fuse_mounted(out["root"])
    assert (Path(out["root"]) / "b").exists() is False
    box.rw("session", "shutdown", out["id"])
    assert (_mode(rt), _mode(rt / "mounts")) == (0o700, 0o700)
    box.assert_nothing_left()


def test_a_clean_unmount_leaves_nothing_in_the_runtime_dir(box: Box) -> None:
    """A read-only mount logs into the runtime directory (``mounts/<key>.log``); once it is
    unmounted (``umount``, or SIGTERM to its daemon) nothing of it is left there: no
    record, lock, log or stats file. A state directory's mount leaves nothing there
    either."""
    rt = box.runtime("xdg")
    ro, mnt = box.base / "ro", box.base / "mnt"
    ro.mkdir()
    mnt.mkdir()
    out = json.loads(box.rw("mount", "--ro", box.ref, str(ro), "--json").stdout)
    assert Path(out["log"]).parent == rt / "mounts" and Path(out["log"]).exists()
    os.kill(out["pid"], signal.SIGUSR1)  # a stats file of its own, beside the log
    deadline = time.monotonic() + 30
    while not list((rt / "mounts").glob("*.stats.json")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [p.name for p in (rt / "mounts").glob("*.stats.json")] == [
        Path(out["log"]).name.replace(".log", ".stats.json")]
    box.rw("umount", str(ro))
    assert sorted(os.listdir(rt / "mounts")) == []
    pid = json.loads(box.rw("mount", "--ro", box.ref, str(ro), "--json").stdout)["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while (fh.is_fuse_mounted(ro) or _procs_naming(box.base)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sorted(os.listdir(rt / "mounts")) == []
    box.rw("mount", box.ref, str(mnt), "--state", str(box.base / "state"))
    box.rw("umount", str(mnt))
    assert sorted(os.listdir(rt / "mounts")) == []
    box.assert_nothing_left()


@pytest.mark.skipif(UID != 0, reason="making a directory of another user needs root")
def test_an_xdg_runtime_dir_of_another_user_is_passed_over(box: Box) -> None:
    """``su USER`` without ``-`` keeps the caller's XDG_RUNTIME_DIR (``/run/user/0``), in
    which that user can make nothing: every mount and session failed with "cannot create
    it (Permission denied)" (and root made its runtime directory inside another user's).
    As the XDG spec asks of a runtime directory the user does not own, rewindfs uses
    ``$TMPDIR/rewindfs-<uid>`` instead, leaves the other one untouched, and doctor says
    so."""
    xdg = box.base / "xdg-of-another"
    xdg.mkdir(mode=0o700)
    os.chown(xdg, 65534, 65534)
    tmp = box.base / "tmp"
    tmp.mkdir()
    box.env.update(XDG_RUNTIME_DIR=str(xdg), TMPDIR=str(tmp))
    box.rt = tmp / f"rewindfs-{UID}"
    ro = box.base / "ro"
    ro.mkdir()
    box.rw("mount", "--ro", box.ref, str(ro))
    assert (ro / "a").read_text() == "lower\n"
    assert [p.suffix for p in (box.rt / "mounts").iterdir()].count(".json") == 1
    box.rw("umount", str(ro))
    out = json.loads(box.rw("session", "new", "--base", str(box.base / "ws"),
                            "--json").stdout)
    assert fh.is_fuse_mounted(out["root"])
    assert (box.rt / f"{out['id']}.sock").exists()
    box.rw("session", "shutdown", out["id"])
    assert list(xdg.iterdir()) == []
    doc = json.loads(box.rw("doctor", "--json", ok=False).stdout)
    c = {c["name"]: c for c in doc["checks"]}["runtime_dir"]
    assert c["status"] == "warn" and "belongs to uid 65534" in c["detail"], c
    assert str(box.rt) in c["detail"] and "XDG_RUNTIME_DIR" in c["fix"], c
    box.assert_nothing_left()


@pytest.mark.skipif(UID != 0, reason="making a directory of another user needs root")
def test_a_runtime_dir_of_another_user_is_refused_and_nothing_starts(box: Box) -> None:
    rt = box.runtime("xdg")
    rt.mkdir(mode=0o700)
    os.chown(rt, 65534, 65534)
    mnt, state = box.base / "mnt", box.base / "state"
    mnt.mkdir()
    p = box.rw("mount", box.ref, str(mnt), "--state", str(state), ok=False)
    assert p.returncode == 9
    line = p.stderr.strip()
    assert "\n" not in line and str(rt) in line and "belongs to uid 65534" in line, line
    assert "XDG_RUNTIME_DIR" in line  # what to do
    assert "belongs to uid 65534" in (state / "daemon.log").read_text()
    # Refused before the state directory was opened: it records no base, so a retry on
    # another Ref is not refused for a mount that never happened.
    assert sorted(p.name for p in state.iterdir()) == ["daemon.log"]
    p = box.rw("session", "new", "--base", str(box.base / "ws"), ok=False)
    assert p.returncode != 0 and "belongs to uid 65534" in p.stderr, p.stderr
    assert box.sessions() == []
    assert not (box.base / "ws").exists() or list((box.base / "ws").iterdir()) == []
    box.assert_nothing_left()


def test_a_runtime_dir_too_long_for_sockets_is_refused_with_its_cause(box: Box) -> None:
    tmp = box.base / ("t" * 80)
    tmp.mkdir()
    box.env.pop("XDG_RUNTIME_DIR", None)
    box.env["TMPDIR"] = str(tmp)
    mnt = box.base / "mnt"
    mnt.mkdir()
    p = box.rw("mount", box.ref, str(mnt), "--state", str(box.base / "state"), ok=False)
    assert p.returncode == 9 and "too long" in p.stderr and "XDG_RUNTIME_DIR" in p.stderr
    box.assert_nothing_left()


def test_a_mount_whose_control_socket_fails_leaves_nothing(box: Box) -> None:
    """Something in the way of the control socket (here a directory at its path): the
    daemon stops before mounting, and says why (not just that it stopped)."""
    rt = box.runtime("xdg")
    state, mnt = box.base / "state", box.base / "mnt"
    mnt.mkdir()
    sock = _control_socket(box, state)
    sock.parent.mkdir(parents=True)
    sock.mkdir()
    assert rt.is_dir()
    p = box.rw("mount", box.ref, str(mnt), "--state", str(state), ok=False)
    assert p.returncode == 9
    assert "IsADirectoryError" in p.stderr or "Is a directory" in p.stderr, p.stderr
    log = (state / "daemon.log").read_text()
    assert "Is a directory" in log and "sub-exception" not in log.splitlines()[-1]
    box.assert_nothing_left()
    # Once the way is clear, the same state directory mounts.
    sock.rmdir()
    box.rw("mount", box.ref, str(mnt), "--state", str(state))
    box.rw("umount", str(mnt))
    box.assert_nothing_left()


def _control_socket(box: Box, state: Path) -> Path:
    """Where the daemon of state directory ``state`` serves its control socket."""
    key = hashlib.sha256(os.path.abspath(state).encode()).hexdigest()[:16]
    return Path(box.env["XDG_RUNTIME_DIR"]) / "rewindfs" / f"m-{key}.sock"


def _attach_socket(box: Box, root: Path) -> Path:
    """Where the process of a shared ``root`` serves its attach socket."""
    d = shared_dir(os.path.join(os.path.realpath(box.store), "sessions"), os.path.realpath(root))
    key = hashlib.sha256(d.encode()).hexdigest()[:16]
    return Path(box.env["XDG_RUNTIME_DIR"]) / "rewindfs" / f"a-{key}.sock"


def test_a_session_that_fails_after_its_root_was_mounted_leaves_nothing(box: Box) -> None:
    """A shared root's process mounts the root, then cannot serve its attach socket: the
    session is shut down, the root unmounted and the process gone before ``session new``
    reports the cause; no session stays registered. Then the same start works."""
    rt = box.runtime("xdg")
    root = box.base / "root"
    root.mkdir()
    (root / "mine").write_text("kept\n")
    sock = _attach_socket(box, root)
    sock.parent.mkdir(parents=True)
    sock.mkdir()
    assert rt.is_dir()
    p = box.rw("session", "new", "--placement", "shared", "--root", str(root), ok=False)
    assert p.returncode != 0 and "Is a directory" in p.stderr, p.stderr
    assert box.sessions() == []
    assert not fh.is_fuse_mounted(root) and (root / "mine").read_text() == "kept\n"
    box.assert_nothing_left()
    sock.rmdir()
    out = json.loads(box.rw("session", "new", "--placement", "shared", "--root", str(root),
                            "--json").stdout)
    assert fh.is_fuse_mounted(root) and box.sessions() == [out["id"]]
    box.rw("session", "shutdown", out["id"])
    box.assert_nothing_left()


def test_resume_and_fork_that_fail_leave_the_session_as_it_was(box: Box) -> None:
    box.runtime("xdg")
    ws = box.base / "ws"
    out = json.loads(box.rw("session", "new", "--base", str(ws), "--json").stdout)
    sid, root = out["id"], Path(out["root"])
    (root / "work").write_text("un-checkpointed\n")
    box.rw("session", "shutdown", sid)
    good = box.env["XDG_RUNTIME_DIR"]
    box.env["XDG_RUNTIME_DIR"] = str(box.base / "x")  # not a directory: the /tmp fallback
    box.env["TMPDIR"] = str(box.base / ("t" * 80))    # ... whose path is too long
    for args in (["session", "resume", sid], ["session", "fork", sid]):
        p = box.rw(*args, ok=False)
        assert p.returncode != 0 and "too long" in p.stderr, p.stderr
        assert box.sessions() == [sid]
        box.assert_nothing_left()
    box.env["XDG_RUNTIME_DIR"] = good
    box.env.pop("TMPDIR")
    box.rw("session", "resume", sid)
    assert (root / "work").read_text() == "un-checkpointed\n"
    box.rw("session", "shutdown", sid)
    box.assert_nothing_left()


def test_umount_of_a_killed_daemons_mount_leaves_nothing_in_the_runtime_dir(box: Box) -> None:
    """kill -9 of a daemon left its mount record, its lock file and its control socket in
    the runtime directory after `rewindfs umount` of the dead mount (they went only at
    the next mount there): the umount removes them, and the next mount works."""
    rt = box.runtime("xdg")
    mnt = box.base / "mnt"
    mnt.mkdir()
    box.rw("mount", box.ref, str(mnt), "--state", str(box.base / "state"))
    rec = json.loads(next((rt / "mounts").glob("*.json")).read_text())
    os.kill(rec["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _procs_naming(box.base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.suffix for p in (rt / "mounts").iterdir()) == [".json", ".lock"]
    box.rw("umount", str(mnt))
    assert sorted(p.name for p in rt.iterdir()) == ["mounts"]
    assert list((rt / "mounts").iterdir()) == []
    box.rw("mount", str(mnt), "--state", str(box.base / "state"))
    box.rw("umount", str(mnt))
    box.assert_nothing_left()
    assert list((rt / "mounts").iterdir()) == []


def test_two_mounts_started_together_at_one_mount_point_give_one_mount(box: Box) -> None:
    """Both passed the CLI's "already mounted" check and stacked two mounts at one path:
    the second hid the first, replaced its record and control socket, and `umount` then
    left the first one serving there. Now the daemon claims the mount point (a lock in the
    runtime directory) before it opens anything: one mount, the other start fails exit 9
    naming the cause and leaves nothing."""
    box.runtime("xdg")
    mnt = box.base / "mnt"
    mnt.mkdir()
    argv = [sys.executable, "-m", "rewindfs", "--store", str(box.store)]
    procs = [subprocess.Popen([*argv, "mount", box.ref, str(mnt), "--state",
                               str(box.base / f"state{i}")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=str(box.base),
                              env=box.env) for i in range(2)]
    outs = [(p.wait(300), p.stderr.read() if p.stderr else "") for p in procs]
    for p in procs:
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()
    assert sorted(code for code, _ in outs) == [0, 9], outs
    err = next(e for code, e in outs if code == 9).strip()
    assert "\n" not in err and ("already mounted" in err or "another rewindfs daemon" in err)
    assert [m for m, _ in fh.mount_table()].count(str(mnt)) == 1
    loser = next(i for i, (code, _) in enumerate(outs) if code == 9)
    assert not (box.base / f"state{loser}" / "upper.sqlite").exists()
    (mnt / "b").write_text("upper\n")
    box.rw("umount", str(mnt))
    assert not fh.is_fuse_mounted(str(mnt))
    box.assert_nothing_left()


def test_a_daemon_that_finds_its_mount_point_taken_tells_the_waiting_cli(box: Box) -> None:
    """A background mount's daemon (``mount --foreground --ready-fd``) repeats the CLI's
    checks of the mount point; one that found a mount there (another start won the race
    since the CLI looked) exited 9 without a word on its ready pipe, so the CLI said only
    "daemon exited with 9 before mounting (see its log)": two mounts started together
    failed the test above so about one run in eight."""
    box.runtime("xdg")
    mnt = box.base / "mnt"
    mnt.mkdir()
    box.rw("mount", box.ref, str(mnt), "--state", str(box.base / "state0"))
    r, w = os.pipe()
    try:
        p = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(box.store),
                            "mount", box.ref, str(mnt), "--state", str(box.base / "state1"),
                            "--foreground", "--ready-fd", str(w)], pass_fds=(w,),
                           capture_output=True, text=True, cwd=str(box.base), env=box.env,
                           timeout=120)
        os.close(w)
        said = os.read(r, 4096).decode()
    finally:
        os.close(r)
    assert p.returncode == 9, p.stderr
    assert said.startswith("error: ") and "already mounted there" in said, (said, p.stderr)
    assert not (box.base / "state1").exists()
    box.rw("umount", str(mnt))
    box.assert_nothing_left()


_CLAIMER = """
import os, sys, time
from fusefs.errors import MountError
from fusefs.mounts import claim_mountpoint, release_claim
mnt, marker, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
held = 0
while held < rounds:
    try:
        fd = claim_mountpoint(mnt)
    except MountError:
        continue
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        sys.exit(3)  # two claimants hold the mount point at once
    time.sleep(0.0005)
    os.unlink(marker)
    release_claim(mnt, fd)
    held += 1
"""


def test_claims_of_one_mount_point_exclude_each_other_while_lock_files_come_and_go(
        tmp_path: Path) -> None:
    """The lock file is unlinked at every release: a claimant that opened it just before
    locks an unlinked file, and must see that and start again, or two would hold the
    mount point at once (each on its own file). Four processes claim and release one
    mount point 300 times each; at no time do two hold it, and no lock file stays."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    marker = tmp_path / "inside"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", _CLAIMER, str(mnt), str(marker), "300"],
                              env=env, cwd=str(REPO)) for _ in range(4)]
    codes = [p.wait(300) for p in procs]
    assert codes == [0, 0, 0, 0]
    from fusefs.mounts import record_path

    assert not os.path.exists(record_path(str(mnt), ".lock"))
