"""Mounting as an unprivileged user, who goes through the setuid helper ``fusermount3``:
a mount the helper refuses fails with the helper's own reason in the CLI's one-line error,
and leaves no upper behind in the state directory it was given (only its log and the empty
lock file).

The user is uid 65534 in a forked child of this (root) process, in a private mount
namespace where a 0666 copy of the FUSE device node is bound over ``/dev/fuse`` (as
Debian's udev leaves it; some machines keep it 0600) and, for the ``user_allow_other``
case, a test file over ``/etc/fuse.conf``; the host's files are never touched. The child
runs ``rewindfs mount --foreground`` in-process: the venv's interpreter may live under a
0700 ``/root``, which uid 65534 cannot execute, so every module the daemon needs is
imported before the fork.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import fusefs.control
import fusefs.daemon
import fusefs.gate
import fusefs.operations
import fusefs.writers
import rewindfs.cli
import rewindfs.cmd_mount
import store.sharedgc
from fusefs.session.fallback import fuse_available
from store.objects import Store
from store.snapshot import snapshot

NOBODY = 65534
CLONE_NEWNS = 0x00020000
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MNT_DETACH = 2

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not fuse_available() or shutil.which("fusermount3") is None,
    reason="needs root (to act as another user in a private mount namespace) and FUSE")

# Loaded now: uid 65534 may not read the interpreter's own directory after the fork.
_PRELOADED = (fusefs.control, fusefs.daemon, fusefs.gate, fusefs.operations, fusefs.writers,
              rewindfs.cli, rewindfs.cmd_mount, store.sharedgc)


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory outside pytest's 0700 base, which uid 65534 can reach."""
    d = Path(tempfile.mkdtemp(prefix="/tmp/rewindfs-test-unpriv-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d)


def _chown_tree(top: Path, uid: int) -> None:
    os.chown(top, uid, uid)
    for dirpath, dirs, files in os.walk(top):
        for n in dirs + files:
            os.chown(os.path.join(dirpath, n), uid, uid, follow_symlinks=False)


def _mount(libc: ctypes.CDLL, src: str, dst: str, flags: int) -> None:
    if libc.mount(src.encode(), dst.encode(), None, flags, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount {src} {dst}")


def run_as_nobody(base: Path, argv: list[str], fuse_conf: str | None) -> tuple[int, str]:
    """``rewindfs ARGV`` as uid/gid 65534 in a forked child (see the module's docstring);
    returns its exit code and what it wrote on stderr."""
    dev = base / "fuse-0666"
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.stat("/dev/fuse").st_rdev)
    os.chmod(dev, 0o666)
    conf = base / "fuse.conf"
    if fuse_conf is not None:
        conf.write_text(fuse_conf)
    run = base / "run"
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    err = base / "stderr"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 99
        try:
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            os.dup2(fd, 2)
            os.dup2(fd, 1)
            sys.stderr = sys.stdout = os.fdopen(fd, "w", buffering=1)  # pytest's capture
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(CLONE_NEWNS) != 0:
                os._exit(98)
            _mount(libc, "none", "/", MS_REC | MS_PRIVATE)
            # Copies of other processes' FUSE mounts would keep those alive here.
            with open("/proc/self/mountinfo") as f:
                fuse = [ln.split()[4] for ln in f if " - fuse" in ln]
            for point in sorted(fuse, key=len, reverse=True):
                libc.umount2(point.encode(), MNT_DETACH)
            _mount(libc, str(dev), "/dev/fuse", MS_BIND)
            if fuse_conf is not None:
                _mount(libc, str(conf), "/etc/fuse.conf", MS_BIND)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.environ["XDG_RUNTIME_DIR"] = str(run)
            os.chdir(base)
            code = rewindfs.cli.main(argv)
        except BaseException as e:
            print(f"child: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err.read_text()


@pytest.mark.parametrize("ro", [False, True], ids=["rw", "ro"])
def test_allow_other_without_user_allow_other_names_the_cause(base: Path, ro: bool) -> None:
    """fusermount3 refuses ``allow_other`` for a user when /etc/fuse.conf lacks
    ``user_allow_other``, and says so on its stderr only; the CLI's error used to be
    ``cannot mount: fuse_session_mount failed``, and the fresh state directory kept an
    upper (database, reserve, spill: 12 MiB) that no mount ever served."""
    src = base / "src"
    src.mkdir()
    (src / "a.txt").write_text("a\n")
    st = Store(base / "store")
    ref = snapshot(st, src)
    st.close()
    _chown_tree(base / "store", NOBODY)
    home = base / "home"  # the user's own: the state directory is made there
    mnt, state = home / "mnt", home / "state"
    mnt.mkdir(parents=True)
    _chown_tree(home, NOBODY)
    argv = ["--store", str(base / "store"), "mount", str(ref), str(mnt), "--foreground",
            "--allow-other"]
    argv += ["--ro"] if ro else ["--state", str(state)]
    code, err = run_as_nobody(base, argv, fuse_conf="# mount_max = 1000\n")
    assert code == 9, err
    errors = [ln for ln in err.splitlines() if ln.startswith("rewindfs: ")]
    assert len(errors) == 1, err
    assert "user_allow_other" in errors[0] and "/etc/fuse.conf" in errors[0], err
    assert "fusermount3" in errors[0], err
    with open("/proc/self/mounts") as f:
        assert not [ln for ln in f if str(base) in ln]
    assert not list((base / "run").glob("rewindfs/mounts/*.json"))
    assert not list((base / "run").glob("rewindfs/*.sock"))
    if not ro:
        left = {p.name for p in state.iterdir()}
        assert left <= {"daemon.log", "lock"}, left  # the log says why; no upper
        assert "user_allow_other" in (state / "daemon.log").read_text()
