"""Confinement and process-tree control for commands the tools start (Bash, ripgrep).

Owns the bubblewrap command lines and the fallback that kills a whole process tree without
it. With bubblewrap working, a command runs in new PID and mount namespaces: killing
bubblewrap ends the namespace's init, and the kernel kills every process in it, including
those that called ``setsid``. Without it, commands run under a small subreaper helper that
adopts every orphaned descendant and kills them all when the command ends or it is told to
stop. ``REWINDFS_NO_SANDBOX=1`` forces the unconfined path (for tests and for machines where
bubblewrap misbehaves).
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Sequence

_PROBE_TIMEOUT_S = 10


def bwrap() -> str | None:
    """Path of a usable ``bwrap``, or None (missing, disabled, or failing here)."""
    if os.environ.get("REWINDFS_NO_SANDBOX") == "1":
        return None
    path = shutil.which("bwrap")
    if path is None:
        return None
    return path if _probe(path) else None


@functools.lru_cache(maxsize=4)
def _probe(path: str) -> bool:
    """Whether bubblewrap can create the namespaces we need on this machine."""
    argv = [path, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--tmpfs", "/tmp", "--unshare-pid", "--die-with-parent", "--", "true"]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=_PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _mask(path: str) -> list[str]:
    """bwrap arguments hiding ``path`` (an empty tmpfs over a directory, /dev/null over
    anything else); nothing when it does not exist."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    if stat.S_ISDIR(st.st_mode):
        return ["--tmpfs", path]
    return ["--ro-bind", "/dev/null", path]


def confined_shell(bwrap_path: str, root: str, cwd: str, hidden: Sequence[str],
                   command: str) -> list[str]:
    """argv running ``bash -c command`` with ``root`` writable, a private /tmp, every
    ``hidden`` path masked, the rest of the file system read-only, in a PID namespace that
    dies with its parent. ``root``, ``cwd`` and ``hidden`` are canonical absolute paths."""
    argv = [bwrap_path, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--tmpfs", "/tmp"]
    # The private /tmp would also hide this interpreter's environment (a virtualenv or a
    # checkout under /tmp): keep it visible, read-only.
    prefix = os.path.realpath(sys.prefix)
    if prefix.startswith("/tmp/") and not any(
            prefix == h or prefix.startswith(h.rstrip("/") + "/") for h in hidden):
        argv += ["--ro-bind", prefix, prefix]
    for h in hidden:
        argv += _mask(h)
    argv += ["--bind", root, root, "--unshare-pid", "--die-with-parent", "--new-session",
             "--chdir", cwd, "--setenv", "TMPDIR", "/tmp", "--", "bash", "-c", command]
    return argv


def _system_view() -> list[str]:
    """bwrap arguments giving a sandbox the system's programs and libraries and nothing
    else: /usr read-only, and /bin, /lib, /lib64, /sbin as on the host."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    return argv


def confined_reader(bwrap_path: str, root: str, cwd: str, argv: Sequence[str]) -> list[str]:
    """argv running a read-only program (ripgrep) that sees only ``root`` (read-only) and
    the system's programs and libraries, so no symbolic link, even one swapped in while it
    runs, can lead it to a file outside the workspace."""
    # No PID namespace or new session: the reader never forks, its caller starts it in a
    # new session without a terminal, and --die-with-parent ends it with bubblewrap. Each
    # of those options costs milliseconds per search.
    return [bwrap_path, *_system_view(), "--ro-bind", root, root, "--die-with-parent",
            "--chdir", cwd, "--", *argv]


# The subreaper helper, run as ``python -S -I -c REAPER argv...``. It becomes a child
# subreaper (orphans of its descendants are re-parented to it), asks for SIGTERM when its
# parent dies, runs argv, and when argv exits or SIGTERM arrives kills every descendant,
# repeating until none is left (a killed process's children come back to it as orphans).
REAPER = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)
libc.prctl(1, signal.SIGTERM, 0, 0, 0)
me = os.getpid()
def kids():
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if int(fields[1]) == me:
            out.append(int(name))
    return out
def kill_all():
    while True:
        pids = kids()
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in pids:
            try:
                os.waitpid(p, 0)
            except ChildProcessError:
                pass
def stop(signum, frame):
    kill_all()
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execvp(sys.argv[1], sys.argv[1:])
while True:
    try:
        _, status = os.waitpid(child, 0)
        break
    except ChildProcessError:
        status = 0
        break
kill_all()
sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


def reaped_shell(command: str) -> list[str]:
    """argv running ``bash -c command`` under the subreaper helper (no confinement)."""
    return [sys.executable, "-S", "-I", "-c", REAPER, "bash", "-c", command]
