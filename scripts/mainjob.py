"""The main job: rewindfs used the way an agent harness uses it, end to end, unattended.

Usage (from the repository root; ``scripts/mainjob.sh`` runs the set-up first)::

    .venv/bin/python scripts/mainjob.py [SOURCE_DIR | --sdist]
        [--mode auto|session|mount|fallback] [--test-cmd CMD] [--scratch DIR] [--shared]

SOURCE_DIR defaults to this repository; ``--sdist`` takes the pinned Django sdist of the
benchmarks instead (downloaded with pip once, see ``scripts/bench/common.py``). Every step
goes through the ``rewindfs`` CLI on the default store (``$REWINDFS_STORE``, else
``./agent-data/store``) and ordinary programs (git, the project's tests, rm, a text edit):

1. ``rewindfs doctor``; stage a copy of the project (leaving out the store, this job's
   scratch directory and, for this repository, ``agent-data/`` and ``.venv``) and snapshot
   it: the seed Ref;
2. start a session on that seed: its root is a FUSE mount (``rewindfs session new --seed
   REF``; when the CLI's sessions run without FUSE here, ``rewindfs mount REF MNT --state
   DIR`` serves the same overlay and the live commands act on the mount point);
3. work in the mount: git (commit, or init + add + commit), the project's tests
   (``--test-cmd``; default: two quick test files of this repository, else
   ``python -m compileall`` of the project's top-level packages); close a step
   (``rewindfs session step``);
4. checkpoint; break things (``rm -rf`` a directory, edit, truncate, chmod, rename, add);
   ``rewindfs diff``, ``status`` and ``diff -u`` of the live tree; close a step and show
   the step change log (``log ID --changes``, ``diff ID --step N``: exactly the paths
   broken); restore the checkpoint while a process holds a file open for writing (the
   restore does not wait; the writer's later writes reach neither the tree nor a
   checkpoint) and show the tree is back exactly (every path's kind, mode, size, mtime and
   content; git sees the same state); break two places again and restore one of them
   alone (``restore ROOT REF --path P``); the history (``rewindfs log ID``, or the
   snapshot list in mount mode);
5. mount the seed read-only and read from it while the session is live; shut down; verify
   the store.

Where this user cannot use FUSE (``/dev/fuse`` missing or not openable, e.g. mode 0600,
or no ``fusermount3``), or with ``--mode fallback``, the same walk-through runs on the
sessions' no-FUSE fallback and says so: the root is a plain directory; ``session
checkpoint ID`` and ``session restore ID REF [--path P]`` replace the live-mount forms;
the changes are the diff of the checkpoint and a checkpoint of the broken tree (there is
no ``status``: nothing keeps a dirty set); ``session step`` is shown refused (no step log
there); ``materialize`` and ``cat`` of the seed replace the read-only mount.

``--shared`` runs the walk-through against a shared store: a SeaweedFS and a PostgreSQL
cluster that the job starts on loopback first (``scripts/localservers.py``, the tests' own
server code) and stops, removing their data, in its clean-up, whatever happened.

Each step prints the commands it ran with their wall-clock time, and its own time. The job
works in a scratch directory (default ``agent-data/mainjob/``) that it removes at the end,
so the store is all it leaves behind; whatever happens (a failed check, an exception,
SIGINT, SIGTERM), every mount it made is unmounted (``fusermount3 -uz`` as the last resort)
and every daemon it started is gone before it exits. Exit status 0 when every check held,
1 when one failed, 2 for bad arguments, 130 after SIGINT, 143 after SIGTERM.

``rewindfs doctor`` runs first and its findings are shown. Steps are methods of
``MainJob`` listed in ``MainJob.steps``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RW = REPO / ".venv" / "bin" / "rewindfs"
PY = REPO / ".venv" / "bin" / "python"
CMD_TIMEOUT_S = 900
"""No single command of the job may take longer than this (seconds)."""

REPO_TESTS = "tests/test_ref.py tests/test_diff.py"
"""This repository's tests that the job runs inside the mount (quick, no FUSE of their own)."""


TEXT_SUFFIXES = (".py", ".md", ".txt", ".rst", ".toml", ".cfg", ".js", ".html", ".c", ".h")
"""Files the job prefers to edit when it breaks things."""


WRITER = """
import sys
f = open(sys.argv[1], "a", buffering=1)
for line in sys.stdin:
    f.write(line)
    f.flush()
    print("ok", flush=True)
"""
"""A process that keeps a file open for writing across the restore (a log writer)."""


class CheckFailed(Exception):
    """A step found something other than what rewindfs promises."""


# -- small helpers ------------------------------------------------------------------------


def rmtree(path: Path) -> None:
    """Remove ``path`` entirely, read-only directories included (the product's own helper)."""
    from fusefs.session.fallback import force_rmtree

    force_rmtree(str(path))


def is_under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def rel(arg: str) -> str:
    """A path under the repository shown relative to it (commands run from there)."""
    p = Path(arg)
    if p.is_absolute() and is_under(p, REPO):
        return str(p.relative_to(REPO)) or "."
    return arg


def mount_table() -> list[tuple[str, str]]:
    """(mount point, file system type) of every mount, from /proc/self/mounts, in order."""
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            mnt = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            out.append((mnt, fields[2]))
    return out


def mounted(path: Path) -> str | None:
    """The file system type mounted exactly at ``path`` (the top mount), or None."""
    want = os.path.abspath(path)
    found = [fs for mnt, fs in mount_table() if mnt == want]
    return found[-1] if found else None


def mounts_under(root: Path) -> list[str]:
    """Mount points at or below ``root``, deepest first."""
    want = os.path.abspath(root)
    below = {mnt for mnt, _ in mount_table()
             if mnt == want or mnt.startswith(want.rstrip("/") + "/")}
    return sorted(below, key=len, reverse=True)


def processes_naming(root: Path) -> list[int]:
    """This user's processes, other than this one and its parents, whose command line
    names a path at or below ``root``: daemons and session processes the job's commands
    started there."""
    needle = os.fsencode(os.path.abspath(root))
    mine = {os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in mine:
        mine.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in mine:
            continue
        try:
            if os.stat(f"/proc/{d}").st_uid != os.getuid():
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if any(needle in a for a in args):
            out.append(int(d))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def manifest(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``root`` (no symlink followed) -> (kind, mode 07777, size, mtime ns,
    sha256 of the content or the symlink target). Two equal manifests mean the trees are
    equal for every program that reads them."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            key = os.path.relpath(p, root)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                out[key] = ("file", mode, st.st_size, st.st_mtime_ns, h.hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[key] = ("symlink", mode, st.st_size, st.st_mtime_ns, os.readlink(p))
            elif stat.S_ISDIR(st.st_mode):
                out[key] = ("dir", mode, 0, st.st_mtime_ns, "")
            else:
                out[key] = ("other", mode, 0, st.st_mtime_ns, stat.S_IFMT(st.st_mode))
    return out


def manifest_diff(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]]) -> list[str]:
    """Lines naming the paths where two manifests differ (at most 20)."""
    lines = []
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            lines.append(f"{k}: {a.get(k)} != {b.get(k)}")
            if len(lines) == 20:
                break
    return lines


# -- running commands ---------------------------------------------------------------------


class Runner:
    """Runs and shows commands: each is printed with its wall-clock time."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def run(self, argv: Sequence[str], shown: str, cwd: Path, check: bool = True,
            timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        print(f"       $ {shown}", end="", flush=True)
        t0 = time.perf_counter()
        # its own process group, so that everything it started dies with it if the job
        # stops it (timeout, SIGINT, SIGTERM); daemons it starts leave that group themselves
        proc = subprocess.Popen(list(argv), cwd=cwd, env=self.env, text=True,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, errors="replace",
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException as e:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            print("   [stopped]")
            if isinstance(e, subprocess.TimeoutExpired):
                raise CheckFailed(f"{shown} took longer than {timeout:.0f} s") from e
            raise
        p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        print(f"   [{time.perf_counter() - t0:.2f} s]")
        if check and p.returncode != 0:
            tail = (p.stderr.strip() or p.stdout.strip())[-2000:]
            raise CheckFailed(f"{shown} exited {p.returncode}: {tail}")
        return p

    def rw(self, *args: str, check: bool = True, json_out: bool = True,
           ) -> tuple[Any, subprocess.CompletedProcess[str]]:
        """``rewindfs ARGS [--json]`` from the repository root: (parsed JSON, process)."""
        shown = "rewindfs " + " ".join(shlex.quote(rel(a)) for a in args)
        argv = [str(RW), *args] + (["--json"] if json_out else [])
        p = self.run(argv, shown, REPO, check=check)
        data = None
        if json_out and p.stdout.strip():
            try:
                data = json.loads(p.stdout)
            except json.JSONDecodeError:
                if check:
                    raise CheckFailed(f"{shown} printed no JSON: {p.stdout[:500]}") from None
        return data, p

    def sh(self, line: str, cwd: Path, check: bool = True,
           timeout: float = CMD_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """A shell line run in ``cwd`` (shown as ``(cd CWD && LINE)``)."""
        return self.run(["bash", "-c", line], f"(cd {rel(str(cwd))} && {line})", cwd,
                        check=check, timeout=timeout)


# -- the live workspace: a session, or a mount with a state directory ---------------------


class Live:
    """What the job needs of a live workspace; ``root`` is where programs work."""

    kind = ""
    root = Path()

    def start(self, seed: str) -> str:
        raise NotImplementedError

    r: Runner

    def checkpoint(self, label: str) -> tuple[str, str]:
        """``rewindfs checkpoint ROOT``: (Ref, a note on its timing)."""
        data, _ = self.r.rw("checkpoint", str(self.root), "--label", label)
        return data["ref"], f"{daemon_ms(data)} inside the daemon"

    def restore(self, ref: str, paths: Sequence[str] = ()) -> tuple[str, str]:
        """``rewindfs restore ROOT REF [--path P]...``: (the pre_restore Ref, a note on its
        timing)."""
        data, _ = self.r.rw("restore", str(self.root), ref, *path_args(paths))
        return data.get("pre_restore") or "", f"{daemon_ms(data)} inside the daemon"

    def step(self, label: str) -> dict[str, Any] | None:
        """Close a step of the session's change log (``rewindfs session step ID``): the step
        (``step``, ``seq``, ``changes``), or None where the workspace keeps no step log."""
        return None

    def changes_since(self, ref: str) -> tuple[list[dict[str, Any]], str]:
        """The live tree's changes since ``ref`` (its last checkpoint), as ``rewindfs diff
        MNT`` lists them (``path``, ``status``), and the unified diff text; shows the
        status of the live mount too."""
        data, _ = self.r.rw("diff", str(self.root))
        status, _ = self.r.rw("status", str(self.root))
        _, p = self.r.rw("diff", "-u", str(self.root), json_out=False)
        self.status_note = (f"status: {status['dirty_inodes']} dirty inode(s), "
                            f"{status['dirty_bytes']:,} dirty byte(s)")
        return data["changes"], p.stdout

    status_note = ""

    def history(self, refs: dict[str, str]) -> list[tuple[str, str]]:
        """(what, Ref) of the workspace's history, oldest first."""
        raise NotImplementedError

    def stop(self) -> str:
        raise NotImplementedError

    def cleanup(self) -> None:
        """Unmount and end whatever is left, quietly; safe to call at any time."""
        raise NotImplementedError


def path_args(paths: Sequence[str]) -> list[str]:
    return [a for p in paths for a in ("--path", p)]


def daemon_ms(data: Any) -> str:
    if isinstance(data, dict) and "elapsed_ms" in data:
        return f"{data['elapsed_ms']:.1f} ms"
    return "?"


def lazy_unmount(path: Path) -> None:
    if mounted(path):
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)


def end_pid(pid: int | None) -> None:
    """SIGTERM ``pid`` (a daemon the job started), then SIGKILL after 10 s."""
    if pid is None or not alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


class SessionLive(Live):
    """``rewindfs session new --seed REF``: the session host is the mount daemon."""

    kind = "session"

    def __init__(self, run: Runner, base: Path, store_root: Path) -> None:
        self.r = run
        self.base = base
        self.store_root = store_root
        self.id: str | None = None
        self.pid: int | None = None

    def start(self, seed: str) -> str:
        data, _ = self.r.rw("session", "new", "--seed", seed, "--base", str(self.base))
        self.id, self.root = data["id"], Path(data["root"])
        self.pid = self._pid()
        return f"session {self.id}, root {rel(str(self.root))}"

    def _pid(self) -> int | None:
        """The session host's pid, read from its control socket's status reply."""
        try:
            from fusefs.session.control import live_host, request
            from fusefs.session.placement import canonical_path
            from fusefs.session.registry import Registry

            assert self.id is not None
            reg = Registry(os.path.join(canonical_path(str(self.store_root)), "sessions"))
            path = live_host(reg.load(self.id).state_dir)
            return int(request(path, {"op": "status"})["pid"]) if path else None
        except Exception:  # noqa: BLE001 - only used to make sure it ends
            return None

    def step(self, label: str) -> dict[str, Any] | None:
        assert self.id is not None
        data, _ = self.r.rw("session", "step", self.id, "--label", label)
        return dict(data)

    def history(self, refs: dict[str, str]) -> list[tuple[str, str]]:
        assert self.id is not None
        # The journal as JSON: its text lines end with labels, so their last word is no Ref.
        data, _ = self.r.rw("log", self.id)
        out = []
        for e in data:
            if e["event"] == "WorkspaceCheckpointed":
                what = f"checkpoint {e['trigger']}/{e['consistency']}"
            elif "step" in e:
                what = "step"
            else:
                what = "restore --path" if e.get("paths") else "restore"
            label = e.get("label") or ""
            print(f"         {e['seq']:>4}  {what:<26} {e['ref']}  {label}")
            out.append((what, e["ref"]))
        return out

    def stop(self) -> str:
        assert self.id is not None
        self.r.rw("session", "shutdown", self.id)
        sid, self.id = self.id, None
        return f"session {sid} stopped"

    def cleanup(self) -> None:
        if self.id is not None:
            subprocess.run([str(RW), "session", "shutdown", self.id, "--force"], cwd=REPO,
                           env=self.r.env, capture_output=True, timeout=180)
            self.id = None
        lazy_unmount(self.root)
        end_pid(self.pid)


class FallbackLive(SessionLive):
    """A session on the no-FUSE fallback (``rewindfs session new`` where FUSE is not usable,
    or ``--no-fuse``): the root is a plain directory, a checkpoint is a snapshot of it and a
    restore a staged swap, so the live-mount commands (``checkpoint ROOT``, ``diff ROOT``,
    ``status ROOT``) have nothing to talk to; the session commands do the same work."""

    kind = "fallback session"

    def __init__(self, run: Runner, base: Path, store_root: Path, forced: bool) -> None:
        super().__init__(run, base, store_root)
        self.forced = forced

    def start(self, seed: str) -> str:
        data, _ = self.r.rw("session", "new", "--seed", seed, "--base", str(self.base),
                            *(["--no-fuse"] if self.forced else []))
        self.id, self.root = data["id"], Path(data["root"])
        self.pid = self._pid()
        return f"session {self.id}, root {rel(str(self.root))}"

    def checkpoint(self, label: str) -> tuple[str, str]:
        """``rewindfs session checkpoint ID`` (the session form takes no label)."""
        assert self.id is not None
        data, _ = self.r.rw("session", "checkpoint", self.id)
        return data["ref"], f"{daemon_ms(data)} end to end, a snapshot of the root"

    def restore(self, ref: str, paths: Sequence[str] = ()) -> tuple[str, str]:
        assert self.id is not None
        data, _ = self.r.rw("session", "restore", self.id, ref, *path_args(paths))
        return data.get("pre_restore") or "", f"{daemon_ms(data)} end to end"

    def step(self, label: str) -> dict[str, Any] | None:
        """The fallback keeps no step log (no dirty set): ``session step`` refuses (exit 10);
        shown, then None."""
        assert self.id is not None
        data, p = self.r.rw("session", "step", self.id, "--label", label, check=False)
        if p.returncode != 10:
            raise CheckFailed(f"session step on the fallback exited {p.returncode}, not 10 "
                              f"(refused): {p.stdout.strip()[:500]}")
        print(f"         refused as documented: {(data or {}).get('error', p.stderr.strip())}")
        return None

    def changes_since(self, ref: str) -> tuple[list[dict[str, Any]], str]:
        """No daemon keeps a dirty set here: checkpoint the broken tree (``session
        checkpoint``) and diff the two Refs (``rewindfs diff A B``, ``-u``)."""
        assert self.id is not None
        data, _ = self.r.rw("session", "checkpoint", self.id)
        broken = data["ref"]
        diff, _ = self.r.rw("diff", ref, broken)
        _, p = self.r.rw("diff", "-u", ref, broken, json_out=False)
        self.status_note = ("no `status` on the fallback (nothing keeps a dirty set): the "
                            f"broken tree was checkpointed as {broken} and diffed against the "
                            "checkpoint")
        return diff["changes"], p.stdout


class MountLive(Live):
    """``rewindfs mount REF MNT --state DIR`` and the live commands on ``MNT``."""

    kind = "mount"

    def __init__(self, run: Runner, mnt: Path, state: Path) -> None:
        self.r = run
        self.root = mnt
        self.state = state
        self.pid: int | None = None
        self.refs: list[str] = []

    def start(self, seed: str) -> str:
        self.root.mkdir(parents=True, exist_ok=True)
        data, _ = self.r.rw("mount", seed, str(self.root), "--state", str(self.state))
        self.pid = int(data["pid"])
        return f"daemon pid {self.pid}, upper layer in {rel(str(self.state))}"

    def history(self, refs: dict[str, str]) -> list[tuple[str, str]]:
        data, _ = self.r.rw("list")
        mine = set(refs.values())
        out = []
        for s in data:
            if s["ref"] in mine:
                print(f"         {s['origin']:<12} {s['ref']}  {s.get('label') or ''}")
                out.append((s["origin"], s["ref"]))
        return out

    def stop(self) -> str:
        self.r.rw("umount", str(self.root))
        pid, self.pid = self.pid, None
        if pid is not None and alive(pid):
            raise CheckFailed(f"the daemon {pid} is still running after umount")
        return f"unmounted, daemon {pid} gone"

    def cleanup(self) -> None:
        lazy_unmount(self.root)
        end_pid(self.pid)


# -- the job ------------------------------------------------------------------------------


class MainJob:
    def __init__(self, source: Path, mode: str, test_cmd: str | None, scratch: Path,
                 no_fuse: str | None = None, shared: bool = False) -> None:
        self.source = source.resolve()
        self.mode = mode
        self.shared = shared
        self.servers: list[Any] = []
        """The SeaweedFS and PostgreSQL servers ``--shared`` started (stopped at clean-up)."""
        self.shared_store = ""
        self.no_fuse = no_fuse
        """Why FUSE is not usable by this user (None when it is): the walk-through then
        runs on the sessions' no-FUSE fallback."""
        self.scratch = scratch.resolve()
        self.staged = self.scratch / "project"
        self.ro = self.scratch / "ro"
        home = self.scratch / "home"
        env = dict(os.environ)
        env.update({"HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
                    "GIT_AUTHOR_NAME": "rewindfs main job", "GIT_AUTHOR_EMAIL": "mainjob@localhost",
                    "GIT_COMMITTER_NAME": "rewindfs main job",
                    "GIT_COMMITTER_EMAIL": "mainjob@localhost",
                    # no background `git gc --auto` changing .git behind the job's back; a
                    # tree copied with its owners may belong to another uid
                    "GIT_CONFIG_COUNT": "3", "GIT_CONFIG_KEY_0": "gc.auto",
                    "GIT_CONFIG_VALUE_0": "0", "GIT_CONFIG_KEY_1": "maintenance.auto",
                    "GIT_CONFIG_VALUE_1": "false", "GIT_CONFIG_KEY_2": "safe.directory",
                    "GIT_CONFIG_VALUE_2": "*"})
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        self.r = Runner(env)
        self.test_cmd = test_cmd
        self.store_root = Path()
        self.refs: dict[str, str] = {}
        self.live: Live | None = None
        self.ro_pid: int | None = None
        self.checkpointed: dict[str, tuple[Any, ...]] = {}
        self.git_state = ""
        self.broken: dict[str, str] = {}
        self.writer: subprocess.Popen[str] | None = None
        self.last_step: dict[str, Any] | None = None
        self.steps: list[tuple[str, Callable[[], str]]] = [
            ("check the machine (rewindfs doctor)", self.doctor),
            *([("start a local SeaweedFS (S3) and PostgreSQL", self.start_servers)]
              if shared else []),
            ("open the shared store (S3 + PostgreSQL)" if shared else "open the default store",
             self.open_store),
            ("stage a copy of the project", self.stage),
            ("snapshot it (the seed)", self.snapshot_seed),
            ("start a session on the seed", self.start),
            ("git in the mount", self.git),
            ("run the project's tests in the mount", self.tests),
            ("checkpoint", self.checkpoint),
            ("break things", self.break_things),
            ("what changed since the checkpoint (rewindfs diff)", self.diff_live),
            ("the step change log (session step, log --changes, diff --step)",
             self.step_log),
            ("restore the checkpoint while a process holds a file open", self.restore),
            ("the tree is back", self.compare),
            ("break again, restore only some paths (restore --path)", self.path_restore),
            ("the history", self.history),
            ("mount the seed read-only and read from it" if self.no_fuse is None else
             "write the seed out and read from it (rewindfs materialize)", self.browse_old),
            ("shut the session down", self.stop),
            ("verify the store", self.verify),
        ]

    # -- driver --------------------------------------------------------------------------

    def run(self) -> int:
        print(f"rewindfs main job: project {self.source}")
        if self.no_fuse is not None:
            print(f"note: FUSE is not usable here ({self.no_fuse}), so the walk-through runs "
                  "on the sessions' no-FUSE fallback: the session root is a plain directory, "
                  "a checkpoint is a snapshot of it and a restore a staged swap; commands "
                  "that need a live mount (checkpoint/restore/diff/status ROOT, the step log, "
                  "mount --ro) are replaced by their session and Ref forms, and `rewindfs "
                  "doctor` below names the fix")
        if is_under(self.source, self.scratch):
            print(f"mainjob: the project may not be inside {self.scratch}", file=sys.stderr)
            return 2
        rmtree(self.scratch)
        (self.scratch / "home").mkdir(parents=True)
        total0 = time.perf_counter()
        ok, code = True, 0
        try:
            for i, (title, step) in enumerate(self.steps, 1):
                print(f"[{i:2d}/{len(self.steps)}] {title}", flush=True)
                t0 = time.perf_counter()
                try:
                    summary = step()
                except CheckFailed as e:
                    print(f"       FAILED: {e}")
                    ok = False
                    break
                print(f"       -> {summary}  [{time.perf_counter() - t0:.2f} s]", flush=True)
        except KeyboardInterrupt:
            print("\n       interrupted (SIGINT)")
            ok, code = False, 130
        except SystemExit as e:
            print(f"\n       stopped (exit {e.code})")
            ok, code = False, int(e.code or 1)
        finally:
            left = self.cleanup()
        if left:
            ok = False
            print(f"FAILED: still there after clean-up: {left}")
        else:
            print("clean-up: nothing mounted or running")
        store = rel(str(self.store_root)) if self.store_root != Path() else "(none)"
        if self.shared:
            store = (f"{self.shared_store or '(none)'} on the job's servers, which are stopped "
                     "and their data removed: nothing")
        on = " on the no-FUSE fallback" if self.no_fuse is not None else ""
        on += " against a shared store" if self.shared else ""
        print(f"main job{on} {'done' if ok else 'FAILED'} in "
              f"{time.perf_counter() - total0:.1f} s; left behind: the store {store}")
        return 0 if ok else (code or 1)

    def cleanup(self) -> list[str]:
        """Unmount and end everything the job started, remove the scratch directory; return
        what is still mounted or running afterwards, and any step that failed (nothing,
        normally). Never raises: every step runs even when an earlier one failed, and
        mounts or daemons the job does not know of (a failed start's, or one a command it
        ran made) are found under the scratch directory."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        problems: list[str] = []

        def attempt(what: str, fn: Callable[[], object]) -> None:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the clean-up must go on
                problems.append(f"{what} failed: {type(e).__name__}: {e}")

        try:
            attempt("ending the writer process", self.end_writer)
            if self.live is not None:
                attempt(f"stopping the {self.live.kind}", self.live.cleanup)
            attempt("unmounting the read-only mount", lambda: lazy_unmount(self.ro))
            attempt("ending the read-only daemon", lambda: end_pid(self.ro_pid))
            for m in mounts_under(self.scratch):
                attempt(f"unmounting {m}", lambda m=m: lazy_unmount(Path(m)))
            for pid in processes_naming(self.scratch):
                attempt(f"ending process {pid}", lambda pid=pid: end_pid(pid))
            # the servers last: the session's clean-up above still talks to the catalog
            while self.servers:
                srv = self.servers.pop()
                attempt(f"stopping {type(srv).__name__}", srv.stop)
            left = [f"mount {m}" for m in mounts_under(self.scratch)]
            pids = {self.ro_pid, getattr(self.live, "pid", None), *processes_naming(self.scratch)}
            left += [f"process {pid}" for pid in sorted(p for p in pids if p is not None)
                     if alive(pid)]
            if not left:
                attempt(f"removing {self.scratch}", lambda: rmtree(self.scratch))
            return left + problems
        except BaseException as e:  # noqa: BLE001 - report, never crash
            return [*problems, f"the clean-up failed: {type(e).__name__}: {e}"]
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    # -- steps ---------------------------------------------------------------------------

    def doctor(self) -> str:
        """``rewindfs doctor``: what this machine offers; only shown, never a failed check
        (a missing piece the walk-through needs fails its own step)."""
        data, _ = self.r.rw("doctor", check=False)
        if not data:
            raise CheckFailed("rewindfs doctor printed no JSON")
        counts = {k: sum(c["status"] == k for c in data["checks"]) for k in ("ok", "warn", "fail")}
        for c in data["checks"]:
            if c["status"] != "ok":
                print(f"         {c['status']}: {c['name']}: {c['detail']}")
                if c.get("fix"):
                    print(f"           fix: {c['fix']}")
        binding = next((c["detail"] for c in data["checks"] if c["name"] == "fuse_binding"), "?")
        if self.no_fuse is not None:
            named = [c for c in data["checks"] if c["name"] in ("fuse_device", "fusermount3")
                     and c["status"] == "fail" and c.get("fix")]
            if not named:
                raise CheckFailed(f"FUSE is not usable ({self.no_fuse}) but rewindfs doctor "
                                  "names no cause and fix for it")
        return (f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failed; "
                f"binding: {binding}")

    def end_writer(self) -> None:
        w, self.writer = self.writer, None
        if w is not None and w.poll() is None:
            w.kill()
            w.wait(timeout=30)

    def start_servers(self) -> str:
        """``--shared``: a SeaweedFS (``weed mini``) and a throwaway PostgreSQL cluster on
        127.0.0.1, free ports, data in temporary directories (``scripts/localservers.py``,
        as the tests start them); a fresh bucket and database. Every command after this
        one gets the shared store from the environment (``REWINDFS_STORE=s3://...``,
        ``REWINDFS_S3_ENDPOINT``, ``REWINDFS_CATALOG``, ``REWINDFS_LOCAL``, and the S3 keys
        as ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``)."""
        import localservers

        t0 = time.perf_counter()
        s3 = localservers.SeaweedS3()
        self.servers.append(s3)
        pg = localservers.PostgresCluster()
        self.servers.append(pg)
        bucket, dsn = s3.new_bucket(), pg.new_database()
        self.shared_store = f"s3://{bucket}/mainjob"
        self.r.env.update(s3.env())
        self.r.env.update(REWINDFS_STORE=self.shared_store, REWINDFS_S3_ENDPOINT=s3.endpoint,
                          REWINDFS_CATALOG=dsn, REWINDFS_LOCAL=str(self.scratch / "local"))
        for k in ("REWINDFS_STORE", "REWINDFS_S3_ENDPOINT", "REWINDFS_CATALOG",
                  "REWINDFS_LOCAL"):
            print(f"       {k}={self.r.env[k]}")
        return (f"SeaweedFS S3 at {s3.endpoint} (bucket {bucket}, data in {s3.dir}), "
                f"PostgreSQL at 127.0.0.1:{pg.port} (database {dsn.rsplit('/', 1)[-1]}, data "
                f"in {pg.dir}), up in {time.perf_counter() - t0:.1f} s")

    def open_store(self) -> str:
        data, _ = self.r.rw("init")
        self.store_root = Path(data["root"])
        if self.shared:
            return f"{self.shared_store}, this host's local part {rel(data['root'])}"
        return f"store {rel(data['root'])}"

    def stage(self) -> str:
        """Copy the project with its metadata (tar, POSIX format), leaving out what changes
        while the job runs: the store, the scratch directory, the repository's agent-data/
        and the CLI's own virtualenv."""
        if is_under(self.source, self.store_root):
            raise CheckFailed(f"the project {self.source} is inside the store")
        # A .git that is a file (a worktree's or submodule's gitlink) names a repository
        # outside the project: copied as it is, git in the mount would commit into that
        # real repository. The copy gets a repository of its own at the same HEAD instead.
        gitlink = (self.source / ".git").is_file()
        candidates = [p for p in (self.store_root, self.scratch, REPO / "agent-data",
                                  REPO / ".venv", *([self.source / ".git"] if gitlink else []))
                      if is_under(p, self.source) and p != self.source]
        excluded = sorted({p for p in candidates
                           if not any(q != p and is_under(p, q) for q in candidates)})
        self.staged.mkdir(parents=True)
        excl = " ".join(shlex.quote(f"--exclude=./{p.relative_to(self.source)}")
                        for p in excluded)
        self.r.sh(f"tar --format=posix -cf - {excl} . | tar -xpf - -C {shlex.quote(str(self.staged))}",
                  self.source)
        if gitlink:
            q = shlex.quote
            self.r.sh(f"git init -q && git fetch -q --depth 1 {q('file://' + str(self.source))} "
                      "HEAD && git reset -q FETCH_HEAD", self.staged)
        files = size = 0
        for dirpath, _dirs, names in os.walk(self.staged):
            for n in names:
                st = os.lstat(os.path.join(dirpath, n))
                if stat.S_ISREG(st.st_mode):
                    files += 1
                    size += st.st_size
        if files < 3:
            raise CheckFailed("the project needs at least 3 regular files")
        left_out = ", ".join(str(p.relative_to(self.source)) for p in excluded) or "nothing"
        own = "; .git was a link to a repository outside the project (a worktree): the copy " \
              "got a repository of its own at the same HEAD" if gitlink else ""
        return f"{files:,} files, {size / 1e6:.1f} MB (left out: {left_out}){own}"

    def snapshot_seed(self) -> str:
        data, _ = self.r.rw("snapshot", str(self.staged), "--label", "mainjob: seed")
        self.refs["seed"] = data["ref"]
        return (f"{data['ref']}: {data['files']:,} files, {data['bytes'] / 1e6:.1f} MB in "
                f"{data['elapsed_ms'] / 1000:.2f} s inside the store")

    def start(self) -> str:
        notes = []
        if self.no_fuse is not None or self.mode == "fallback":
            live = FallbackLive(self.r, self.scratch / "workspaces", self.store_root,
                                forced=self.no_fuse is None)
            self.live = live
            what = live.start(self.refs["seed"])
            fs = mounted(live.root)
            if fs is not None:
                raise CheckFailed(f"the fallback session root {live.root} is a {fs} mount, "
                                  "not a plain directory")
            entries = len(os.listdir(live.root))
            return (f"{what}; a plain directory (the no-FUSE fallback), {entries} entries "
                    "at its root")
        if self.mode in ("auto", "session"):
            live: Live = SessionLive(self.r, self.scratch / "workspaces", self.store_root)
            self.live = live
            what = live.start(self.refs["seed"])
            fs = mounted(live.root)
            if fs is None or not fs.startswith("fuse"):
                if self.mode == "session":
                    raise CheckFailed(f"the session root {live.root} is not a FUSE mount")
                notes.append("`rewindfs session new` served a plain directory (its no-FUSE "
                             "fallback) here, so the job serves the seed with `rewindfs mount "
                             "REF MNT --state DIR` instead")
                live.stop()
                live.cleanup()
                self.live = None
        if self.live is None:
            live = MountLive(self.r, self.scratch / "mnt", self.scratch / "state")
            self.live = live
            what = live.start(self.refs["seed"])
        fs = mounted(self.live.root)
        if fs is None or not fs.startswith("fuse"):
            raise CheckFailed(f"{self.live.root} is not a FUSE mount (found {fs})")
        for n in notes:
            print(f"       note: {n}")
        entries = len(os.listdir(self.live.root))
        return (f"{what}; {rel(str(self.live.root))} is a {fs} mount, {entries} entries at "
                "its root")

    @property
    def root(self) -> Path:
        assert self.live is not None
        return self.live.root

    def git(self) -> str:
        if (self.root / ".git").is_dir():
            p = self.r.sh("git status --porcelain | wc -l", self.root)
            before = int(p.stdout.strip() or 0)
            self.r.sh("git add -A && git commit -q --allow-empty -m 'work in the mount'",
                      self.root)
            done = f"an existing repository: {before} path(s) changed since its HEAD, committed"
        else:
            self.r.sh("git init -q && git add -A && git commit -q -m 'work in the mount'",
                      self.root)
            done = "git init, add, commit of the whole tree"
        p = self.r.sh("git status --porcelain && git log --oneline -1", self.root)
        status = p.stdout.strip().splitlines()
        if len(status) != 1:
            raise CheckFailed(f"git status is not clean after the commit: {status[:5]}")
        return f"{done}; clean status; HEAD {status[-1]}"

    def tests(self) -> str:
        cmd = self.test_cmd
        if cmd is None:
            if self.source == REPO:
                cmd = f"{shlex.quote(str(PY))} -m pytest -q -p no:cacheprovider {REPO_TESTS}"
            else:  # byte-compile the project's top-level Python packages (or every file)
                pkgs = sorted(d for d in os.listdir(self.root)
                              if (self.root / d / "__init__.py").is_file())
                cmd = (f"{shlex.quote(str(PY))} -m compileall -q "
                       f"{' '.join(shlex.quote(d) for d in pkgs) or '.'}")
        p = self.r.sh(cmd, self.root)
        tail = (p.stdout.strip().splitlines() or ["(no output)"])[-1]
        # close a step here, so that the one after breaking things holds just that
        assert self.live is not None
        self.last_step = self.live.step("git and the tests")
        closed = (f"; step {self.last_step['step']} closed ({len(self.last_step['changes'])} "
                  "path(s))" if self.last_step else "")
        return f"passed: {tail}{closed}"

    def checkpoint(self) -> str:
        assert self.live is not None
        ref, note = self.live.checkpoint("mainjob: after work")
        self.refs["work"] = ref
        self.checkpointed = manifest(self.root)
        self.git_state = self.r.sh("git status --porcelain && git rev-parse HEAD",
                                   self.root).stdout
        return f"{ref} ({note}); {len(self.checkpointed):,} paths recorded to compare later"

    def break_things(self) -> str:
        """rm -rf the largest top-level directory (not .git), and edit, truncate, chmod,
        rename and add files elsewhere."""
        tops = [d for d in os.listdir(self.root)
                if d != ".git" and (self.root / d).is_dir() and not (self.root / d).is_symlink()]
        if not tops:
            raise CheckFailed("the project has no directory besides .git to remove")

        def size(d: str) -> int:
            return sum(1 for k in self.checkpointed if k == d or k.startswith(d + "/"))

        victim = max(sorted(tops), key=size)

        def writable(outside: str) -> list[str]:
            """Non-empty writable files outside ``outside`` and .git, source files first."""
            found = sorted(k for k, v in self.checkpointed.items()
                           if v[0] == "file" and v[1] & 0o200 and v[2] > 0
                           and not k.startswith(".git/") and "__pycache__" not in k
                           and not (outside and k.startswith(outside + "/")))
            text = [k for k in found if k.endswith(TEXT_SUFFIXES)]
            return text if len(text) >= 3 else found

        files = writable(victim)
        if len(files) < 3:  # a tiny project: edit files, remove nothing
            victim, files = "", writable("")
        if len(files) < 3:
            raise CheckFailed("the project needs at least 3 non-empty writable files")
        edited, truncated, renamed = files[0], files[len(files) // 2], files[-1]
        lines = []
        if victim:
            lines.append(f"rm -rf {shlex.quote(victim)}")
        lines += [f"printf '\\n# broken by the rewindfs main job\\n' >> {shlex.quote(edited)}",
                  f"truncate -s 0 {shlex.quote(truncated)}",
                  f"chmod a+x {shlex.quote(edited)}",
                  f"mv {shlex.quote(renamed)} {shlex.quote(renamed)}.moved",
                  "echo 'a file the main job added' > MAINJOB-NEW-FILE.txt"]
        self.r.sh(" && ".join(lines), self.root)
        self.broken = {edited: "modified", truncated: "modified", renamed: "removed",
                       renamed + ".moved": "added", "MAINJOB-NEW-FILE.txt": "added"}
        if victim:
            self.broken[victim] = "removed"
        removed = f"removed {victim}/ ({size(victim):,} paths), " if victim else ""
        p = self.r.sh("git status --short | wc -l", self.root)
        return (f"{removed}edited {edited}, truncated {truncated}, renamed {renamed}, added "
                f"MAINJOB-NEW-FILE.txt; git status now lists {p.stdout.strip()} path(s)")

    def diff_live(self) -> str:
        assert self.live is not None
        changes, unified = self.live.changes_since(self.refs["work"])
        got = {c["path"]: c["status"] for c in changes}
        shown = [c for c in changes if c["path"] != ".git"
                 and not c["path"].startswith(".git/")]
        for c in shown[:12]:
            print(f"         {c['status']:<9} {c['path']}")
        more = len(shown) - 12 if len(shown) > 12 else 0
        in_git = len(changes) - len(shown)
        if more or in_git:
            print(f"         ... and {more} more, {in_git} under .git")
        wrong = {p: s for p, s in self.broken.items() if got.get(p) != s}
        if wrong:
            raise CheckFailed(f"diff missed or misreported {wrong}")
        hunk = [ln for ln in unified.splitlines() if "broken by the rewindfs main job" in ln]
        if not hunk:
            raise CheckFailed("diff -u does not show the edit")
        return (f"{len(got)} change(s), the {len(self.broken)} made above among them; "
                f"{self.live.status_note}; diff -u shows the edit: {hunk[0]!r}")

    def step_log(self) -> str:
        """Close a step after breaking things (``rewindfs session step ID``): it lists the
        paths changed since the step closed after the tests, each with its status; ``log
        --changes`` shows them and ``diff ID --step N`` gives them back from the journal."""
        assert self.live is not None
        step = self.live.step("break things")
        if step is None:
            return ("no step log here: " + ("the no-FUSE fallback has no dirty set to take "
                    "steps from" if self.no_fuse is not None or self.mode == "fallback"
                    else "a plain mount is not a session"))
        got = {c["path"]: c["status"] for c in step["changes"]}
        wrong = {p: (s, got.get(p)) for p, s in self.broken.items() if got.get(p) != s}
        if wrong:
            raise CheckFailed(f"step {step['step']} misses or misreports {wrong} "
                              "(expected, found)")
        # git's own bookkeeping (``git status`` above may refresh .git/index) is the only
        # other change allowed
        extra = sorted(p for p in set(got) - set(self.broken)
                       if p != ".git" and not p.startswith(".git/"))
        if extra:
            raise CheckFailed(f"step {step['step']} lists paths nothing changed: {extra[:10]}")
        sid = getattr(self.live, "id", None)
        assert sid is not None
        _, p = self.r.rw("log", sid, "--changes", json_out=False)
        lines = p.stdout.splitlines()
        at = next((i for i, ln in enumerate(lines) if f"step {step['step']} break things" in ln),
                  None)
        if at is None:
            raise CheckFailed(f"log --changes does not show step {step['step']}")
        for ln in lines[at:at + 1 + len(got)]:
            print(f"         {ln}")
        data, _ = self.r.rw("diff", sid, "--step", str(step["step"]))
        back = {c["path"]: c["status"] for c in data["changes"]}
        if back != got:
            raise CheckFailed(f"diff --step {step['step']} gives {back}, the step said {got}")
        in_git = len(got) - len(self.broken)
        return (f"step {step['step']} holds the {len(self.broken)} path(s) broken above"
                + (f" and {in_git} of git's under .git" if in_git else ", exactly") + " (after "
                f"step {self.last_step['step'] if self.last_step else '?'}, git and the "
                f"tests); log --changes lists them; diff --step {step['step']} gives them back")

    def restore(self) -> str:
        """Restore while a process (a log writer, say) holds a file that the restore removes
        open for writing: the restore goes through at once, the writer keeps working on
        the detached file, and what it writes afterwards reaches neither the restored
        tree (``compare`` checks the tree is exactly the checkpoint's) nor any checkpoint."""
        assert self.live is not None
        log = self.root / "MAINJOB-WRITER.log"
        self.writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(log)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        assert self.writer.stdin is not None and self.writer.stdout is not None
        self.writer.stdin.write("before the restore\n")
        self.writer.stdin.flush()
        if self.writer.stdout.readline() != "ok\n":
            raise CheckFailed("the writer process could not write into the mount")
        t0 = time.perf_counter()
        pre, note = self.live.restore(self.refs["work"])
        took = time.perf_counter() - t0
        if pre:
            self.refs["pre_restore"] = pre
        self.writer.stdin.write("after the restore\n")
        self.writer.stdin.flush()
        if self.writer.stdout.readline() != "ok\n":
            raise CheckFailed("the writer's handle stopped working after the restore")
        self.writer.stdin.close()
        if self.writer.wait(timeout=60) != 0:
            raise CheckFailed("the writer process failed after the restore")
        self.writer = None
        if log.exists():
            raise CheckFailed(f"{log.name} is in the restored tree")
        return (f"back at {self.refs['work']} ({note}; {took:.2f} s with the writer holding "
                f"{log.name} open: no wait); the broken state was checkpointed first as "
                f"{pre or '(none)'}; the writer kept writing to its detached file, which is "
                "not in the restored tree")

    def compare(self) -> str:
        now = manifest(self.root)
        bad = manifest_diff(self.checkpointed, now)
        if bad:
            raise CheckFailed("the restored tree differs from the checkpoint:\n" +
                              "\n".join(bad))
        git_now = self.r.sh("git status --porcelain && git rev-parse HEAD", self.root).stdout
        if git_now != self.git_state:
            raise CheckFailed(f"git sees another state after the restore: {git_now[:500]}")
        return (f"all {len(now):,} paths equal in kind, mode, size, mtime and content; "
                "git status clean at the same HEAD")

    def path_restore(self) -> str:
        """Break the tree again in two places, then ``restore ROOT REF --path P`` only one
        of them: P is the checkpoint's again (every path below it), the other change stays."""
        assert self.live is not None
        victim = next((p for p, s in self.broken.items() if s == "removed"
                       and self.checkpointed.get(p, ("",))[0] == "dir"), None)
        edited = next(p for p, s in self.broken.items() if s == "modified")
        target = victim or edited
        q = shlex.quote
        self.r.sh(f"rm -rf {q(target)} && echo 'kept by the path restore' > "
                  "MAINJOB-KEPT.txt", self.root)
        _, note = self.live.restore(self.refs["work"], [target])
        now = manifest(self.root)

        def under(m: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
            return {k: v for k, v in m.items() if k == target or k.startswith(target + "/")}

        bad = manifest_diff(under(self.checkpointed), under(now))
        if bad:
            raise CheckFailed(f"{target} differs from the checkpoint after the path "
                              "restore:\n" + "\n".join(bad))
        if not (self.root / "MAINJOB-KEPT.txt").is_file():
            raise CheckFailed("the path restore removed MAINJOB-KEPT.txt, outside its path")
        self.r.sh("rm MAINJOB-KEPT.txt", self.root)
        return (f"{target} is the checkpoint's again ({len(under(now)):,} path(s) equal; "
                f"{note}); MAINJOB-KEPT.txt, outside the path, was left as it was")

    def history(self) -> str:
        assert self.live is not None
        events = self.live.history(self.refs)
        refs = [r for _, r in events]
        for name in ("seed", "work", "pre_restore"):
            if name in self.refs and self.refs[name] not in refs:
                raise CheckFailed(f"the {name} checkpoint {self.refs[name]} is not in the "
                                  "history")
        return f"{len(events)} event(s): " + ", ".join(w for w, _ in events)

    def browse_old(self) -> str:
        if self.no_fuse is not None:
            return self.write_out_old()
        self.ro.mkdir()
        data, _ = self.r.rw("mount", "--ro", self.refs["seed"], str(self.ro))
        self.ro_pid = int(data["pid"])
        old = manifest(self.ro)
        staged = manifest(self.staged)
        bad = manifest_diff(staged, old)
        if bad:
            raise CheckFailed("the read-only mount of the seed differs from the staged "
                              "project:\n" + "\n".join(bad))
        some = next(k for k, v in sorted(old.items()) if v[0] == "file")
        p = self.r.sh(f"head -c 200 {shlex.quote(some)} | wc -c && "
                      f"touch {shlex.quote(some)} 2>&1 || true", self.ro)
        if "Read-only file system" not in p.stdout:
            raise CheckFailed(f"a write to the read-only mount was not refused: {p.stdout}")
        self.r.rw("umount", str(self.ro))
        pid, self.ro_pid = self.ro_pid, None
        if alive(pid):
            raise CheckFailed(f"the read-only daemon {pid} still runs after umount")
        return (f"the seed reads back as staged ({len(old):,} paths, all equal) while the "
                "session is live; writes refused (EROFS); unmounted")

    def write_out_old(self) -> str:
        """Without FUSE there is no read-only mount: ``rewindfs materialize`` writes the seed
        out as a real directory (every chunk verified) and ``rewindfs cat`` reads one file
        of it straight from the store."""
        copy = self.scratch / "seed-copy"
        data, _ = self.r.rw("materialize", self.refs["seed"], str(copy))
        old = manifest(copy)
        bad = manifest_diff(manifest(self.staged), old)
        if bad:
            raise CheckFailed("the seed written out differs from the staged project:\n" +
                              "\n".join(bad))
        some = next(k for k, v in sorted(old.items()) if v[0] == "file")
        _, p = self.r.rw("cat", self.refs["seed"], some, json_out=False)
        if p.stdout != (copy / some).read_text(errors="replace"):
            raise CheckFailed(f"rewindfs cat of {some} differs from the file written out")
        return (f"the seed written out reads back as staged ({len(old):,} paths, all equal, "
                f"{data['entries']:,} entries in {daemon_ms(data)}); `rewindfs cat` of {some} "
                "gives the same bytes (read-only mounts need FUSE)")

    def stop(self) -> str:
        assert self.live is not None
        what = self.live.stop()
        if mounted(self.root):
            raise CheckFailed(f"{self.root} is still mounted")
        pid = getattr(self.live, "pid", None)
        deadline = time.monotonic() + 30
        while pid is not None and alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid is not None and alive(pid):
            raise CheckFailed(f"the session process {pid} still runs")
        return f"{what}; {rel(str(self.root))} is no longer a mount"

    def verify(self) -> str:
        data, p = self.r.rw("verify", check=False)
        if p.returncode != 0 or not data or not data.get("ok"):
            raise CheckFailed(f"verify reported problems: {p.stdout.strip()[:2000]}")
        stats, _ = self.r.rw("stats")
        return (f"every object re-hashed, no broken invariant ({daemon_ms(data)}); store: "
                f"{stats['snapshots']} snapshot(s), {stats['stored_bytes'] / 1e6:.1f} MB stored "
                f"for {stats['logical_bytes'] / 1e6:.1f} MB")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="mainjob.py", description=__doc__.split("\n")[0])
    ap.add_argument("source", nargs="?", help="the project directory (default: this "
                    "repository)")
    ap.add_argument("--sdist", action="store_true",
                    help="use the pinned Django sdist of the benchmarks as the project")
    ap.add_argument("--mode", choices=("auto", "session", "mount", "fallback"),
                    default="auto",
                    help="session: `rewindfs session new`; mount: `rewindfs mount --state`; "
                    "fallback: a session on the no-FUSE fallback (`--no-fuse`); auto: a "
                    "session when its root is a FUSE mount, else a mount, and the fallback "
                    "where FUSE is not usable")
    ap.add_argument("--test-cmd", help="the project's test command, run in the mount root")
    ap.add_argument("--shared", action="store_true",
                    help="run against a shared store: a local SeaweedFS (S3) and PostgreSQL "
                    "that the job starts, and stops at the end (even on failure)")
    ap.add_argument("--scratch", type=Path, default=REPO / "agent-data" / "mainjob",
                    help="scratch directory, removed at the end (default agent-data/mainjob)")
    args = ap.parse_args(argv)
    if args.sdist and args.source:
        ap.error("give a directory or --sdist, not both")
    if args.sdist:
        sys.path.insert(0, str(REPO / "scripts" / "bench"))
        from common import DJANGO, unpacked_tree

        source = unpacked_tree(*DJANGO)
    else:
        source = Path(args.source) if args.source else REPO
    if not source.is_dir():
        print(f"mainjob: {source} is not a directory", file=sys.stderr)
        return 2
    from fusefs.session.fallback import fuse_unavailable_reason

    no_fuse = fuse_unavailable_reason()
    if no_fuse is not None and args.mode in ("session", "mount"):
        print(f"mainjob: FUSE is not usable here ({no_fuse}); --mode {args.mode} needs it "
              "(--mode auto runs on the no-FUSE fallback)", file=sys.stderr)
        return 1
    os.umask(0o022)

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    return MainJob(source, args.mode, args.test_cmd, args.scratch, no_fuse, args.shared).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
