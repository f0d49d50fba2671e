"""The no-FUSE fallback (CONTRACT 4.7): a session's live tree is a plain directory.

Used when /dev/fuse is missing or the caller asks for it. Checkpoint is a snapshot of the
root (``quiescent`` for per-session and exclusive roots, ``fuzzy`` for shared ones, which
are retried a few times when a concurrent writer changes a file while it is read). Restore:

- per-session roots, a staged swap (the reference system's method)::

      materialize ref -> <base>/.<id>.staging        (log: staged, written first)
      rename root     -> <base>/.<id>.backup
      rename staging  -> root                        (log: committed)
      journal WorkspaceRestored{ref}
      remove backup, remove log

  Start-up recovery (``recover``): before the second rename the old root comes back and
  staging is removed; after it, the restore is finished (journaled if it was not yet).

- fixed roots (exclusive, shared), an exact manifest reconcile (``reconcile.py``) with
  rollback copies, serialized per root by a lock file, logged in
  ``<state base>/roots/<sha256 of root>/reconcile.json``. Scratch directories are siblings of
  the root, unique to the session: ``.<root name>.<id>.staging`` and ``.rollback``.
  Recovery rolls an uncommitted reconcile back; a committed one is journaled and cleaned.

Crash windows (what start-up recovery finds and does; the journal is appended only after
the commit, so before it the restore pointer still names the old tree):

    window                                   on disk                  recovery
    materializing staging                    staging, no log          remove staging
    log staged .. first rename               root, staging, log       remove staging
    first rename .. second rename            backup, staging, log     backup -> root
    second rename .. journal append          root, backup, log        journal, remove backup
    journal append .. clean-up               root, backup, log        remove backup
    reconcile log planned .. committed       mixed root, scratch      roll the steps back
    reconcile committed .. journal append    new root, scratch        journal, remove scratch

Both refuse a root that is a symlink (symlink_root) or has a symlink above it
(symlink_component). Crash tests set ``REWINDFS_CRASH_AT`` to a point name (``swap:staged``,
``swap:backup``, ``swap:committed``, ``swap:journaled``, ``reconcile:planned``,
``reconcile:step:<n>`` (before step n), ``reconcile:step:mid``, ``reconcile:step:last``,
``reconcile:committed``, ``reconcile:journaled``): the process kills
itself with SIGKILL there.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from store.dirs import DirectoryError, make_dir
from store.errors import SnapshotError
from store.ref import Ref

from . import reconcile as rc
from .errors import RestoreError, WorkspaceRootError
from .live import OnCommit, RollForward
from .registry import write_json_atomic

log = logging.getLogger("rewindfs.session")

CRASH_ENV = "REWINDFS_CRASH_AT"
SWAP_LOG = "swap.json"
RECONCILE_LOG = "reconcile.json"
SHARED_SNAPSHOT_TRIES = 3


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL if ``$REWINDFS_CRASH_AT`` names this point (tests)."""
    if os.environ.get(CRASH_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _step_crash_points(i: int, n: int) -> None:
    crash_point(f"reconcile:step:{i}")
    if i == n // 2:
        crash_point("reconcile:step:mid")
    if i == n - 1:
        crash_point("reconcile:step:last")


def force_rmtree(path: str) -> None:
    """Remove ``path`` (a tree, a file or a symlink) even with read-only directories in it;
    a missing path is fine. Never follows a symlink."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return

    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    os.chmod(path, 0o700)
    shutil.rmtree(path)


def _is_empty_dir(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True


def make_root(root: str, path: str | None = None) -> None:
    """Make the directory ``path`` (default: the workspace root ``root`` itself; a caller
    that makes the root in another way gives its parent) and its missing parents, mode
    0755. Raises WorkspaceRootError (exit 10) naming ``root``, the path in the way (a file,
    a parent this user cannot write, a virtual file system such as /proc, a name too long)
    and a fix."""
    try:
        make_dir(root if path is None else path, "workspace root", 0o755)
    except DirectoryError as e:
        raise WorkspaceRootError(root, e.cause) from None


def _check_root(path: str) -> None:
    """Raise RestoreError symlink_root / symlink_component unless ``path`` is reached
    without any symlink (missing trailing components are fine)."""
    parts = [p for p in path.split("/") if p]
    cur = ""
    for i, p in enumerate(parts):
        cur += "/" + p
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            kind = RestoreError.SYMLINK_ROOT if i == len(parts) - 1 else \
                RestoreError.SYMLINK_COMPONENT
            raise RestoreError(kind, cause=f"{cur} is a symlink")


class _DirTree:
    """What both fallback trees share: capture, emptiness, install."""

    root: str
    consistency: str
    writes_unseen = True    # a plain directory: writes reach it without the session seeing

    def __init__(self, store: Any, root: str, session_id: str, consistency: str) -> None:
        self.store = store
        self.root = root
        self.id = session_id
        self.consistency = consistency

    def is_empty(self) -> bool:
        return _is_empty_dir(self.root)

    def _ensure_root(self) -> None:
        _check_root(self.root)
        if not os.path.lexists(self.root):
            make_root(self.root)

    def capture(self, origin: str) -> Ref:
        """Snapshot the root (created empty if missing). Raises RestoreError for a symlinked
        root and SnapshotError when it cannot be read."""
        from store.snapshot import snapshot

        self._ensure_root()
        tries = SHARED_SNAPSHOT_TRIES if self.consistency == "fuzzy" else 1
        for i in range(tries):
            try:
                return snapshot(self.store, self.root, origin=origin)
            except SnapshotError:
                if i == tries - 1:
                    raise
        raise AssertionError("unreachable")

    def install(self, ref: Ref) -> None:
        """Materialize ``ref`` into the missing or empty root."""
        from store.materialize import materialize

        _check_root(self.root)
        make_root(self.root, os.path.dirname(self.root))
        materialize(self.store, ref, self.root)

    def close(self) -> None:
        """A plain directory is always written back: nothing to do."""


class PerSessionTree(_DirTree):
    """A per-session root ``<base>/<id>`` restored by a staged swap."""

    def __init__(self, store: Any, root: str, session_id: str, state_dir: str) -> None:
        super().__init__(store, root, session_id, "quiescent")
        base = os.path.dirname(root)
        self.staging = os.path.join(base, f".{session_id}.staging")
        self.backup = os.path.join(base, f".{session_id}.backup")
        self.log_path = os.path.join(state_dir, SWAP_LOG)

    def swap(self, ref: Ref, seq_before: int, on_commit: OnCommit) -> None:
        from store.materialize import materialize

        sref = str(ref)
        _check_root(self.root)
        force_rmtree(self.staging)
        force_rmtree(self.backup)
        try:
            materialize(self.store, ref, self.staging)
        except Exception as e:
            force_rmtree(self.staging)
            raise RestoreError(RestoreError.SWAP_FAILED, sref, e) from e
        write_json_atomic(self.log_path, {"phase": "staged", "ref": sref,
                                          "seq_before": seq_before})
        crash_point("swap:staged")
        try:
            _check_root(self.root)
            os.rename(self.root, self.backup)
        except Exception as e:
            force_rmtree(self.staging)
            os.unlink(self.log_path)
            if isinstance(e, RestoreError):
                raise
            raise RestoreError(RestoreError.SWAP_FAILED, sref, e) from e
        crash_point("swap:backup")
        try:
            os.rename(self.staging, self.root)
        except OSError as e:
            try:
                os.rename(self.backup, self.root)
            except OSError as e2:
                raise RestoreError(RestoreError.ROLLBACK_FAILED, sref, e2) from e
            force_rmtree(self.staging)
            os.unlink(self.log_path)
            raise RestoreError(RestoreError.SWAP_FAILED, sref, e) from e
        write_json_atomic(self.log_path, {"phase": "committed", "ref": sref,
                                          "seq_before": seq_before})
        crash_point("swap:committed")
        try:
            on_commit()
        except Exception as e:
            self._cleanup()
            raise RestoreError(RestoreError.APPEND_FAILED, sref, e) from e
        crash_point("swap:journaled")
        self._cleanup()

    def _cleanup(self) -> None:
        force_rmtree(self.backup)
        force_rmtree(self.staging)
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass

    def recover(self, roll_forward: RollForward) -> None:
        try:
            with open(self.log_path, "rb") as f:
                entry = json.loads(f.read())
        except FileNotFoundError:
            force_rmtree(self.staging)  # a crash while materializing
            return
        ref = Ref.parse(entry["ref"])
        root_there = os.path.lexists(self.root)
        backup_there = os.path.lexists(self.backup)
        if not root_there and backup_there:
            log.warning("session %s: rolling back an interrupted restore", self.id)
            os.rename(self.backup, self.root)
        elif root_there and backup_there and not os.path.lexists(self.staging):
            if roll_forward(ref, int(entry["seq_before"])):
                log.warning("session %s: finished an interrupted restore of %s", self.id, ref)
            else:
                log.warning("session %s: undoing an unjournaled restore of %s", self.id, ref)
                os.rename(self.root, self.staging)
                os.rename(self.backup, self.root)
        self._cleanup()


def _root_key(root: str) -> str:
    return hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()


class FixedTree(_DirTree):
    """A fixed root (exclusive or shared) restored by an exact reconcile."""

    def __init__(self, store: Any, root: str, session_id: str, consistency: str,
                 state_base: str) -> None:
        super().__init__(store, root, session_id, consistency)
        parent, name = os.path.split(root)
        self.staging = os.path.join(parent, f".{name}.{session_id}.staging")
        self.rollback = os.path.join(parent, f".{name}.{session_id}.rollback")
        self.ctl_dir = os.path.join(state_base, "roots", _root_key(root))
        self.log_path = os.path.join(self.ctl_dir, RECONCILE_LOG)

    @contextmanager
    def _root_lock(self) -> Iterator[None]:
        os.makedirs(self.ctl_dir, 0o700, exist_ok=True)
        fd = os.open(os.path.join(self.ctl_dir, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def swap(self, ref: Ref, seq_before: int, on_commit: OnCommit) -> None:
        with self._root_lock():
            self._reconcile(ref, on_commit, {"session": self.id, "ref": str(ref),
                                             "seq_before": seq_before})

    def write_back(self, ref: Ref) -> None:
        """Make the root exactly ``ref`` without journaling anything (a FUSE session's final
        tree, written into the directory it was mounted over, after the unmount). Same log
        and crash recovery as a restore; ``recover`` rolls an interrupted one back. Raises
        RestoreError."""
        with self._root_lock():
            self._reconcile(ref, None, {"session": f"write-back:{self.id}", "ref": str(ref),
                                        "seq_before": 0})

    def _reconcile(self, ref: Ref, on_commit: OnCommit | None,
                   entry: dict[str, Any]) -> None:
        from store.materialize import materialize

        sref = str(ref)
        _check_root(self.root)
        force_rmtree(self.staging)
        force_rmtree(self.rollback)
        try:
            materialize(self.store, ref, self.staging)
            os.mkdir(self.rollback, 0o700)
        except Exception as e:
            force_rmtree(self.staging)
            force_rmtree(self.rollback)
            raise RestoreError(RestoreError.SWAP_FAILED, sref, e) from e
        fds: list[int] = []
        try:
            try:
                fds.append(rc.open_root(self.root))
                fds.append(rc.open_root(self.staging))
                fds.append(rc.open_root(self.rollback))
                steps = rc.plan(fds[0], fds[1])
            except RestoreError:
                raise
            except Exception as e:
                raise RestoreError(RestoreError.SWAP_FAILED, sref, e) from e
            sides = rc.Sides(*fds)
            entry = dict(entry, phase="planned", staging=self.staging, rollback=self.rollback,
                         root=self.root, steps=steps)
            write_json_atomic(self.log_path, entry)
            crash_point("reconcile:planned")
            try:
                rc.apply(sides, steps, lambda i: _step_crash_points(i, len(steps)))
            except Exception as e:
                try:
                    rc.rollback_plan(sides, steps)
                except Exception as e2:
                    raise RestoreError(RestoreError.ROLLBACK_FAILED, sref, e2) from e
                write_json_atomic(self.log_path, dict(entry, phase="rolledback"))
                self._cleanup()
                if isinstance(e, RestoreError):
                    e.ref = e.ref or sref
                    raise
                raise RestoreError(RestoreError.SWAP_FAILED, sref, e) from e
            write_json_atomic(self.log_path, dict(entry, phase="committed"))
            crash_point("reconcile:committed")
        finally:
            for fd in fds:
                os.close(fd)
        if on_commit is not None:
            try:
                on_commit()
            except Exception as e:
                self._cleanup()
                raise RestoreError(RestoreError.APPEND_FAILED, sref, e) from e
        crash_point("reconcile:journaled")
        self._cleanup()

    def _cleanup(self) -> None:
        force_rmtree(self.staging)
        force_rmtree(self.rollback)
        try:
            os.unlink(self.log_path)
        except FileNotFoundError:
            pass

    def recover(self, roll_forward: RollForward) -> None:
        """Finish or undo a reconcile of this root that a crash interrupted (whichever
        session ran it; for another session's, ``roll_forward`` is not asked and a committed
        reconcile is kept as it is, unjournaled in the crashed session)."""
        with self._root_lock():
            try:
                with open(self.log_path, "rb") as f:
                    entry = json.loads(f.read())
            except FileNotFoundError:
                force_rmtree(self.staging)
                force_rmtree(self.rollback)
                return
            staging, rollback = entry["staging"], entry["rollback"]
            ref = Ref.parse(entry["ref"])
            if entry["phase"] == "committed":
                if entry["session"] == self.id:
                    roll_forward(ref, int(entry["seq_before"]))
                log.warning("reconcile of %s to %s was interrupted after its commit; kept",
                            self.root, ref)
            elif entry["phase"] == "planned":
                log.warning("rolling back an interrupted reconcile of %s to %s", self.root, ref)
                fds = [rc.open_root(self.root), rc.open_root(staging), rc.open_root(rollback)]
                try:
                    rc.rollback_plan(rc.Sides(*fds), entry["steps"])
                finally:
                    for fd in fds:
                        os.close(fd)
                write_json_atomic(self.log_path, dict(entry, phase="rolledback"))
            force_rmtree(staging)
            force_rmtree(rollback)
            os.unlink(self.log_path)


def fuse_unavailable_reason() -> str | None:
    """Why this process cannot mount FUSE file systems, or None when it can: /dev/fuse
    must exist and open read-write for this user (it is mode 0600 on some machines), and
    ``fusermount3`` must be on PATH (setuid root, for a user other than root; ``rewindfs
    doctor`` checks the same). Opening the device creates a FUSE connection that
    closing it ends; nothing is mounted."""
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC))
    except OSError as e:
        return f"/dev/fuse cannot be opened: {os.strerror(e.errno or 0)}"
    fm = shutil.which("fusermount3")
    if fm is None:
        return "fusermount3 is not on PATH"
    if os.getuid() != 0 and not os.stat(fm).st_mode & stat.S_ISUID:
        return f"{fm} is not setuid root, so this user cannot mount"
    return None


def fuse_available() -> bool:
    """True if this process can mount FUSE file systems (see fuse_unavailable_reason)."""
    return fuse_unavailable_reason() is None
