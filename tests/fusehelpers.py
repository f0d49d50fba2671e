"""Helpers for tests that mount a real rewindfs filesystem in a separate process.

A mount is served by ``rewindfs mount ... --foreground`` started with ``subprocess.Popen`` in
its own session (so it has its own process group); the helper polls ``/proc/self/mountinfo``
with a deadline until the mount appears, and tears it down with ``fusermount3 -u`` (lazily,
``-uz``, when busy), then reaps the daemon, killing its whole group if it does not leave.
Tests never touch a mountpoint from the process that serves it (PYFUSE3.md trap 10): the
daemon is always another process.

Every daemon started here is remembered in ``LIVE`` so that a session-level safety net (and
an ``atexit`` hook as the last resort) can unmount and kill whatever a crashed test left.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MOUNT_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0
FUSERMOUNT = "fusermount3"
AS_ROOT = os.geteuid() == 0
OTHER_OWNER = (1234, 5678) if AS_ROOT else (os.getuid(), os.getgid())
"""An owner (uid, gid) a test may chown a file to: another one as root, the user's own
otherwise (giving a file away needs CAP_CHOWN; the suite also runs as a plain user)."""

# REWINDFS_FUSE_SELFTEST=1 runs the FUSE tests against plain copies on the local filesystem
# instead of mounts: a check of the tests' own expectations, never of rewindfs. ``snapshot``
# then returns the source directory and ``SelftestMounter`` copies it.
SELFTEST = os.environ.get("REWINDFS_FUSE_SELFTEST") == "1"

# Daemons started by this process that have not been torn down yet, by mountpoint.
LIVE: dict[str, Daemon] = {}


class MountError(AssertionError):
    """A daemon did not mount, did not unmount, or exited badly; carries its log tail."""


# -- mount table -----------------------------------------------------------------------------

def _unescape(field_: str) -> str:
    """Decode the octal escapes (``\\040`` for a space) used in /proc/self/mountinfo."""
    out = []
    i = 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1:i + 4].isdigit() and i + 4 <= len(field_):
            out.append(chr(int(field_[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def mount_table() -> list[tuple[str, str]]:
    """Return ``(mountpoint, fstype)`` for every mount this process sees, in mount order."""
    rows = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts = left.split()
            rows.append((_unescape(parts[4]), right.split()[0] if right else ""))
    return rows


def fstype(path: str | os.PathLike[str]) -> str | None:
    """The fstype of the mount whose mountpoint is exactly ``path`` (last one wins)."""
    p = os.path.abspath(os.fspath(path))
    found = None
    for mp, t in mount_table():
        if mp == p:
            found = t
    return found


def is_fuse_mounted(path: str | os.PathLike[str]) -> bool:
    t = fstype(path)
    return t is not None and t.startswith("fuse")


def fusermount(path: str | os.PathLike[str], lazy: bool = False) -> bool:
    """Run ``fusermount3 -u`` (``-uz`` when ``lazy``); True on success."""
    args = [FUSERMOUNT, "-uz" if lazy else "-u", os.fspath(path)]
    r = subprocess.run(args, capture_output=True, text=True)
    return r.returncode == 0


def unmount_leftovers(prefixes: list[str]) -> list[str]:
    """Lazily unmount every mount under one of ``prefixes`` (deepest first); return them."""
    done = []
    prefixes = [os.path.abspath(p).rstrip("/") + "/" for p in prefixes]
    for mp, t in reversed(mount_table()):
        if not any((mp + "/").startswith(p) for p in prefixes):
            continue
        if t.startswith("fuse"):
            fusermount(mp, lazy=True)
        else:
            subprocess.run(["umount", "-l", mp], capture_output=True)
        done.append(mp)
    return done


# -- daemons ---------------------------------------------------------------------------------

@dataclass
class Daemon:
    """One mount daemon (a ``rewindfs mount --foreground`` process) and what it serves."""

    store: Path
    mnt: Path
    log: Path
    ref: str | None = None
    state: Path | None = None
    ro: bool = False
    allow_other: bool = False
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    returncodes: list[int] = field(default_factory=list)
    command: list[str] | None = None  # another FUSE daemon's argv instead of rewindfs'

    def argv(self, with_ref: bool = True) -> list[str]:
        if self.command is not None:
            return list(self.command)
        a = [sys.executable, "-m", "rewindfs", "--store", str(self.store), "mount"]
        if self.ro:
            a.append("--ro")
        if with_ref and self.ref is not None:
            a.append(self.ref)
        a.append(str(self.mnt))
        if self.state is not None:
            a += ["--state", str(self.state)]
        if self.allow_other:
            a.append("--allow-other")
        a.append("--foreground")
        return a + list(self.extra)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the daemon's stdout/stderr and of any log in its state."""
        out = []
        files = [self.log]
        if self.state is not None and self.state.is_dir():
            files += sorted(p for p in self.state.rglob("*.log") if p.is_file())
        for p in files:
            try:
                lines = p.read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"--- {p} (last {n} lines) ---")
            out += lines[-n:]
        return "\n".join(out)

    def log_text(self) -> str:
        parts = []
        files = [self.log]
        if self.state is not None and self.state.is_dir():
            files += sorted(p for p in self.state.rglob("*.log") if p.is_file())
        for p in files:
            try:
                parts.append(p.read_text(errors="replace"))
            except OSError:
                pass
        return "\n".join(parts)


def start(d: Daemon, *, with_ref: bool = True, timeout: float = MOUNT_TIMEOUT_S) -> Daemon:
    """Start ``d``'s daemon and return once its mount is visible (MountError otherwise)."""
    d.mnt.mkdir(parents=True, exist_ok=True)
    if is_fuse_mounted(d.mnt):
        raise MountError(f"{d.mnt} is already a FUSE mount")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(d.log, "ab") as logf:
        logf.write(f"=== start: {' '.join(d.argv(with_ref))}\n".encode())
        logf.flush()
        d.proc = subprocess.Popen(d.argv(with_ref), stdin=subprocess.DEVNULL, stdout=logf,
                                  stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                  start_new_session=True)
    LIVE[str(d.mnt)] = d
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not is_fuse_mounted(d.mnt):
        rc = d.proc.poll()
        if rc is not None:
            d.returncodes.append(rc)
            LIVE.pop(str(d.mnt), None)
            d.proc = None
            raise MountError(f"daemon for {d.mnt} exited with {rc} before mounting\n"
                             + d.log_tail())
        if time.monotonic() > deadline:
            kill(d)
            raise MountError(f"{d.mnt} not mounted after {timeout} s\n" + d.log_tail())
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return d


def _wait_exit(d: Daemon, timeout: float) -> int | None:
    assert d.proc is not None
    try:
        return d.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _killpg(d: Daemon, sig: int) -> None:
    assert d.proc is not None
    try:
        os.killpg(d.proc.pid, sig)
    except ProcessLookupError:
        pass


def stop(d: Daemon, *, timeout: float = EXIT_TIMEOUT_S, busy_grace: float = 5.0) -> int:
    """Unmount ``d`` cleanly and reap its daemon; return the daemon's exit code.

    ``fusermount3 -u`` is retried for ``busy_grace`` seconds while the mount is busy
    (processes of the test may still be closing files). If it stays busy, the mount is
    detached lazily (``-uz``), the daemon gets ``busy_grace`` more seconds to leave (it
    cannot while something still holds the detached mount), is then killed with its group,
    and MountError is raised. A daemon that does not leave within ``timeout`` seconds of a
    clean unmount is killed the same way.
    """
    if d.proc is None:
        return 0
    deadline = time.monotonic() + busy_grace
    lazy = False
    while is_fuse_mounted(d.mnt):
        if fusermount(d.mnt):
            break
        if d.proc.poll() is not None or time.monotonic() > deadline:
            fusermount(d.mnt, lazy=True)
            lazy = d.proc.poll() is None
            break
        time.sleep(0.05)
    rc = _wait_exit(d, busy_grace if lazy else timeout)
    if rc is None:
        _killpg(d, signal.SIGKILL)
        d.proc.wait()
        _forget(d, -9)
        why = "was busy, detached lazily, and its daemon" if lazy else "daemon"
        raise MountError(f"{d.mnt} {why} did not exit after unmount; killed\n"
                         + d.log_tail())
    _killpg(d, signal.SIGKILL)  # children it may have left behind
    _forget(d, rc)
    return rc


def wait_exit(d: Daemon, timeout: float) -> int:
    """Wait for a daemon that is leaving on its own (a signal); return its exit code.
    Kills its group and raises MountError if it is still there after ``timeout`` s."""
    assert d.proc is not None
    rc = _wait_exit(d, timeout)
    if rc is None:
        kill(d)
        raise MountError(f"daemon for {d.mnt} still running after {timeout} s\n"
                         + d.log_tail())
    _killpg(d, signal.SIGKILL)
    _forget(d, rc)
    return rc


def kill(d: Daemon) -> None:
    """``kill -9`` the daemon's whole process group, reap it and lazily unmount."""
    if d.proc is None:
        return
    _killpg(d, signal.SIGKILL)
    try:
        d.proc.kill()
    except ProcessLookupError:
        pass
    d.proc.wait()
    if is_fuse_mounted(d.mnt):
        fusermount(d.mnt, lazy=True)
    _forget(d, -9)


def _forget(d: Daemon, rc: int) -> None:
    d.returncodes.append(rc)
    d.proc = None
    LIVE.pop(str(d.mnt), None)


def kill_all_live() -> list[str]:
    """Kill and lazily unmount every daemon started here that is still up."""
    names = list(LIVE)
    for d in list(LIVE.values()):
        kill(d)
    return names


atexit.register(kill_all_live)


# -- the CLI as a user runs it -----------------------------------------------------------------

def user_env() -> dict[str, str]:
    """This process's environment as a user's shell would give it to the CLI: without
    REWINDFS_DEBUG (tracebacks instead of the one-line errors) and REWINDFS_STORE (a store
    the test did not choose), with PYTHONPATH at the repository."""
    env = {k: v for k, v in os.environ.items() if k not in ("REWINDFS_DEBUG", "REWINDFS_STORE")}
    env["PYTHONPATH"] = str(REPO)
    return env


def run_cli(store: str | os.PathLike[str] | None, *args: str, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m rewindfs [--store STORE] ARGS...`` in ``cwd`` (default: the repository)
    with ``env`` (default: :func:`user_env`), output as text, whatever its exit status;
    raises subprocess.TimeoutExpired after 120 s."""
    argv = [sys.executable, "-m", "rewindfs"]
    if store is not None:
        argv += ["--store", os.fspath(store)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, cwd=cwd or REPO,
                          env=user_env() if env is None else env, timeout=120)


# -- store and state ---------------------------------------------------------------------------

def snapshot(store_dir: str | os.PathLike[str], src: str | os.PathLike[str]) -> str:
    """Snapshot directory ``src`` into the store at ``store_dir``; return the Ref text."""
    if SELFTEST:
        return os.fspath(src)
    from store.objects import Store
    from store.snapshot import snapshot as take

    st = Store(os.fspath(store_dir))
    try:
        return str(take(st, os.fspath(src)))
    finally:
        st.close()


def upper_problems(state: Path, store_dir: Path | None = None) -> list[str]:
    """The upper layer's broken invariants (``fusefs.upper.check``) as ``[name] detail``
    strings; with ``store_dir`` also the checks that need the lower trees."""
    from fusefs.upper import check

    if store_dir is None:
        return [str(p) for p in check(os.fspath(state))]
    from store.objects import Store

    st = Store(os.fspath(store_dir))
    try:
        return [str(p) for p in check(os.fspath(state), st)]
    finally:
        st.close()


def sqlite_files(state: Path) -> list[Path]:
    """SQLite databases in a state directory (found by their header, whatever their name)."""
    found = []
    for p in sorted(state.rglob("*")):
        if not p.is_file() or p.name.endswith(("-wal", "-shm", "-journal")):
            continue
        try:
            with open(p, "rb") as f:
                head = f.read(16)
        except OSError:
            continue
        if head == b"SQLite format 3\x00":
            found.append(p)
    return found


def row_counts(state: Path) -> dict[str, int]:
    """``{"<db file>:<table>": rows}`` for every table of every SQLite file in ``state``.

    Opened read-only, so call it while no daemon serves ``state`` (after a clean unmount or
    a kill) to see what reached disk.
    """
    counts: dict[str, int] = {}
    for db in sqlite_files(state):
        c = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in c.execute(
                "SELECT name FROM sqlite_master WHERE type='table' "
                "AND name NOT LIKE 'sqlite_%'")]
            for t in tables:
                counts[f"{db.name}:{t}"] = c.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]
        finally:
            c.close()
    return counts


# -- system calls the standard library lacks ---------------------------------------------------

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]
_libc.renameat2.restype = ctypes.c_int


def renameat2(src: str | os.PathLike[str], dst: str | os.PathLike[str], flags: int) -> None:
    """``renameat2(2)`` with ``RENAME_NOREPLACE``/``RENAME_EXCHANGE``; raises OSError."""
    s, t = os.fsencode(src), os.fsencode(dst)
    if _libc.renameat2(AT_FDCWD, s, AT_FDCWD, t, flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fspath(src), None, os.fspath(dst))


def _exchange_loop(a: str, b: str, stop: Any, count: Any) -> None:
    """Swap ``a`` and ``b`` until ``stop`` is set; the number of swaps into ``count``. Where
    RENAME_EXCHANGE is refused, in three renames (a window with no ``a`` at all)."""
    n, atomic = 0, True
    while not stop.is_set():
        if atomic:
            try:
                renameat2(a, b, RENAME_EXCHANGE)
            except OSError:
                atomic = False
                continue
        else:
            os.rename(a, a + ".tmp")
            os.rename(b, a)
            os.rename(a + ".tmp", b)
        n += 1
    count.value = n


@contextlib.contextmanager
def exchanging(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> Iterator[Callable[[], int]]:
    """For the ``with`` block, a forked process swaps the names ``a`` and ``b`` over and
    over (renameat2 RENAME_EXCHANGE: a race against what the block does); yields a function
    that gives the number of swaps once the block has ended. The process is stopped and
    reaped on the way out, killed if it does not stop within 30 s."""
    ctx = multiprocessing.get_context("fork")
    stop, count = ctx.Event(), ctx.Value("l", 0)
    proc = ctx.Process(target=_exchange_loop, args=(os.fspath(a), os.fspath(b), stop, count))
    proc.start()
    try:
        yield lambda: int(count.value)
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join()


def errno_of(fn, *args, **kw) -> int:  # type: ignore[no-untyped-def]
    """Call ``fn``; return 0 on success or the errno of the OSError it raised."""
    try:
        fn(*args, **kw)
    except OSError as e:
        return e.errno or -1
    return 0


def walk_tree(root: str | os.PathLike[str]) -> Iterator[str]:
    """Relative paths of everything under ``root`` (not following symlinks), sorted."""
    root = os.fspath(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for n in dirnames + filenames:
            out.append(n if rel == "." else os.path.join(rel, n))
    return iter(sorted(out))


def request_counts(d: Daemon, stats_file: Path, timeout: float = 10.0) -> dict[str, int]:
    """Per-operation FUSE request counts of a daemon started with ``--stats-file
    stats_file``: asks with SIGUSR1 and waits for the file to be rewritten."""
    before = stats_file.stat().st_mtime_ns if stats_file.exists() else 0
    os.kill(d.pid, signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stats_file.exists() and stats_file.stat().st_mtime_ns != before:
            try:
                return dict(json.loads(stats_file.read_text())["requests"])
            except (ValueError, KeyError):
                pass
        time.sleep(0.01)
    raise MountError(f"daemon for {d.mnt} did not write {stats_file} on SIGUSR1")


def drop_caches() -> None:
    """Write back dirty data and drop the page, dentry and inode caches (needs root)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class Mounter:
    """Starts the mounts of one test (or module) under ``base`` and tears them all down.

    ``teardown`` unmounts every daemon still up, then fails (MountError) if a daemon exited
    non-zero after a clean unmount, left an upper layer that breaks one of its documented
    invariants (``fusefs.upper.check``), or logged a Python traceback (a handler's unexpected
    exception is answered with EIO, and a test that does not expect it must not pass over it
    silently); the daemons' log tails are printed when the test failed or teardown found a
    problem.
    """

    def __init__(self, base: Path, store: Path) -> None:
        self.base = base
        self.store = store
        self.daemons: list[Daemon] = []
        self._n = 0
        self.tracebacks_ok = False
        self.check_upper = True

    def _new_dir(self, kind: str) -> Path:
        self._n += 1
        p = self.base / f"{kind}{self._n}"
        p.mkdir(parents=True, exist_ok=False)
        return p

    def ro(self, ref: str, mnt: Path | None = None, extra: list[str] | None = None) -> Daemon:
        """Mount ``ref`` read-only."""
        d = Daemon(store=self.store, mnt=mnt or self._new_dir("ro"), ref=ref, ro=True,
                   log=self.base / f"daemon{self._n}-ro.log", extra=list(extra or []))
        self.daemons.append(d)
        return start(d)

    def rw(self, ref: str | None, *, state: Path | None = None, mnt: Path | None = None,
           allow_other: bool = False, extra: list[str] | None = None) -> Daemon:
        """Mount a read-write session over ``ref`` with state directory ``state`` (new if
        None); ``ref=None`` remounts the base recorded in ``state``. ``extra``: more
        arguments for ``rewindfs mount``."""
        mnt = mnt or self._new_dir("mnt")
        state = state or self.base / f"state{self._n}"
        d = Daemon(store=self.store, mnt=mnt, ref=ref, state=state, allow_other=allow_other,
                   log=self.base / f"daemon{self._n}-rw.log", extra=list(extra or []))
        self.daemons.append(d)
        return start(d, with_ref=ref is not None)

    def unmount(self, d: Daemon) -> None:
        """Unmount ``d`` cleanly; its daemon must exit with status 0."""
        rc = stop(d)
        if rc != 0:
            raise MountError(f"daemon for {d.mnt} exited with {rc} after unmount\n"
                             + d.log_tail())

    def remount(self, d: Daemon, *, with_ref: bool = False) -> Daemon:
        """Unmount ``d`` cleanly and mount its state directory again at the same place
        (without a Ref, so the recorded base is used, unless ``with_ref``)."""
        self.unmount(d)
        return start(d, with_ref=with_ref)

    def kill9(self, d: Daemon) -> None:
        """``kill -9`` the daemon (its whole group), reap it and lazily unmount."""
        kill(d)

    def restart(self, d: Daemon, *, with_ref: bool = False) -> Daemon:
        """Start ``d`` again after ``kill9`` (same state directory and mountpoint)."""
        return start(d, with_ref=with_ref)

    def teardown(self, failed: bool) -> None:
        problems = []
        for d in self.daemons:
            if d.proc is not None:
                try:
                    rc = stop(d)
                except MountError as e:
                    problems.append(str(e))
                    continue
                if rc != 0:
                    problems.append(f"daemon for {d.mnt} exited with {rc} after unmount")
            if not self.tracebacks_ok and "Traceback (most recent call last)" in d.log_text():
                problems.append(f"daemon for {d.mnt} logged a traceback")
            if self.check_upper and d.state is not None and not d.ro and d.returncodes \
                    and d.returncodes[-1] == 0:
                broken = upper_problems(d.state, d.store)
                if broken:
                    problems.append(f"upper of {d.state} breaks invariants after a clean "
                                    f"unmount: {broken}")
        leftovers = unmount_leftovers([str(self.base)])
        if leftovers:
            problems.append(f"mounts left behind: {leftovers}")
        if failed or problems:
            for d in self.daemons:
                print(d.log_tail(), file=sys.stderr)
        if problems:
            raise MountError("; ".join(problems))


# -- a lower tree with one of everything --------------------------------------------------------

MTIME_NS = 1_600_000_000_123_456_789  # a fixed mtime with a non-zero ns part
BIG_SIZE = 3 * (1 << 20) + 12345  # several chunks at the default 1 MiB chunk size


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible bytes that differ at every offset (so misplaced ranges show)."""
    block = bytes((i * 7 + seed * 13 + (i >> 8)) & 0xFF for i in range(65536))
    reps = n // len(block) + 1
    return (block * reps)[:n]


def build_lower(root: Path) -> None:
    """Fill ``root`` with the standard lower tree the FUSE tests rely on::

        exec.sh        0755, "#!/bin/sh\\necho hi\\n", xattr user.note=b"exec"
        ro.txt         0444, b"read only\\n"
        plain.txt      0644, b"hello world\\n", mtime MTIME_NS
        big.bin        0644, pattern(BIG_SIZE)
        link1, link2   one file with two names (st_nlink 2), b"linked\\n"
        sym -> plain.txt
        fifo           a fifo
        empty/         an empty directory
        dir/a.txt, dir/sub/b.txt, dir/sub/deeper/c.txt
    """
    root.mkdir(parents=True, exist_ok=True)
    (root / "exec.sh").write_bytes(b"#!/bin/sh\necho hi\n")
    os.chmod(root / "exec.sh", 0o755)
    os.setxattr(root / "exec.sh", "user.note", b"exec")
    (root / "ro.txt").write_bytes(b"read only\n")
    os.chmod(root / "ro.txt", 0o444)
    (root / "plain.txt").write_bytes(b"hello world\n")
    (root / "big.bin").write_bytes(pattern(BIG_SIZE))
    (root / "link1").write_bytes(b"linked\n")
    os.link(root / "link1", root / "link2")
    os.symlink("plain.txt", root / "sym")
    os.mkfifo(root / "fifo")
    (root / "empty").mkdir()
    (root / "dir" / "sub" / "deeper").mkdir(parents=True)
    (root / "dir" / "a.txt").write_bytes(b"a\n")
    (root / "dir" / "sub" / "b.txt").write_bytes(b"b\n")
    (root / "dir" / "sub" / "deeper" / "c.txt").write_bytes(b"c\n")
    for p in [root / "plain.txt", root / "exec.sh", root / "big.bin"]:
        os.utime(p, ns=(MTIME_NS, MTIME_NS))


class SelftestMounter(Mounter):
    """``Mounter`` for REWINDFS_FUSE_SELFTEST: a "mount" is a ``cp -a`` copy of the source."""

    def rw(self, ref: str | None, *, state: Path | None = None, mnt: Path | None = None,
           allow_other: bool = False) -> Daemon:
        mnt = mnt or self.base / f"mnt{self._n}"
        self._n += 1
        if ref is not None:
            subprocess.run(["cp", "-a", ref, str(mnt)], check=True)
        return Daemon(store=self.store, mnt=mnt, ref=ref, log=self.base / "none.log")

    def ro(self, ref: str, mnt: Path | None = None) -> Daemon:
        return self.rw(ref, mnt=mnt)

    def unmount(self, d: Daemon) -> None:
        pass

    def remount(self, d: Daemon, *, with_ref: bool = False) -> Daemon:
        return d

    def kill9(self, d: Daemon) -> None:
        pass

    def restart(self, d: Daemon, *, with_ref: bool = False) -> Daemon:
        return d

    def teardown(self, failed: bool) -> None:
        pass
