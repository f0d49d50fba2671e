"""A FUSE session's live tree, inside the session process (CONTRACT 4.0, 4.1, 4.6).

Design: the session process *is* the mount daemon. ``FuseMount`` serves one overlay (lower +
upper) at the session root on this process's main thread (pyfuse3 allows one mount per
process and trio's signal handling wants the main thread), and the session runtime
(``runtime.SessionCore``, in other threads: control socket, lease renewer, policy) reaches
it through ``FuseTree``, whose ``capture`` and ``restore_live`` call the daemon's own
checkpoint and restore (``fusefs.control.Live``) on the event loop with
``trio.from_thread``. Nothing goes through a second process or socket, so a journal append
happens exactly where the contract puts it (pre-restore checkpoint before the swap,
``WorkspaceRestored`` right after it). This module runs its own small serving loop instead
of ``fusefs.daemon.serve`` because the session needs the ``Live`` object and must not serve
the mount's stand-alone control socket (the session host serves the session's).

Where the upper lives (``upper_dir``): ``<session state>/upper`` for per-session and
exclusive roots; ``<state base>/roots/<sha256 of the root>/upper`` for a shared root, whose
one mount serves every session attached to it. Each is registered in the store's
``state_dirs`` table, so GC keeps what it pins (``pinned_refs``).

Phases of a mount: ``prepare`` (the runtime takes the leases and decides the base: a seed
or fork Ref, an adopted directory, or the preserved upper) -> ``mounting`` -> ``serving`` ->
``stopped``. Before the mount, ``capture("seed")`` snapshots the real root (adoption) or
checkpoints a preserved upper offline; afterwards every capture is a live checkpoint.

Fixed roots (exclusive, shared) are mounted over the real directory. At the last leave the
mount is unmounted, the final tree (lower + upper, frozen without listing or journaling:
no synthetic checkpoint) is written back into the directory with the exact reconcile of the
fallback (``FixedTree.write_back``, rollback log and crash recovery included), and only
then is the upper cleared. So a fixed root with no upper is authoritative: the next mount
adopts it again (a resume journals a difference from the restore pointer as a restore),
while a fixed root that still has an upper was not written back (a crash): the upper is
mounted again and written back at the next clean shutdown.

Restart (4.6): the upper records its base; a resumed session whose restore pointer differs
(a crash between the upper's commit and the journal append) journals the recorded base as
``WorkspaceRestored`` before mounting it, with the preserved upper on top. A dead mount a
killed daemon left at the root is unmounted lazily first (the resuming process holds the
session's leases, so no live daemon of this session can be serving it).

Known limit: writes that reach a fixed root's real directory below the mount (a process
whose working directory was inside it before the mount, or a write between the adoption
snapshot and the mount) are not seen by the session and are replaced at write-back.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from store.ref import ObjectId, Ref

from .errors import RestoreError, SessionError
from .fallback import FixedTree, _is_empty_dir, force_rmtree, make_root
from .journal import Journal
from .live import OnCommit, RollForward

if TYPE_CHECKING:
    from fusefs.overlay import Overlay

    from .config import WorkspaceConfig
    from .registry import SessionRecord

log = logging.getLogger("rewindfs.session")

UPPER = "upper"
ROOTS = "roots"
ATTACH_FILE = "attach"  # a shared root's process: {"socket", "pid"} of its attach socket
DAEMON_LOG = "daemon.log"
MUTATION_NOTE_S = 0.02  # the policy hears of mutations at most this often

PREPARE = "prepare"
MOUNTING = "mounting"
SERVING = "serving"
STOPPED = "stopped"


class MountClosingError(SessionError):
    """The shared mount a session tried to attach to is being unmounted (its last session
    left): wait for its process to exit and start a new one."""


# -- state directories ------------------------------------------------------------------------

def root_key(root: str) -> str:
    return hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()


def shared_dir(state_base: str, root: str) -> str:
    """The directory of a shared root's mount: its upper, log and attach lock."""
    return os.path.join(state_base, ROOTS, root_key(root))


def upper_dir(cfg: WorkspaceConfig, record: SessionRecord) -> str:
    """Where the upper of ``record``'s mount lives (see the module docstring)."""
    assert record.root is not None
    if record.mode == "shared":
        assert cfg.state_base is not None
        return os.path.join(shared_dir(cfg.state_base, record.root), UPPER)
    return os.path.join(record.state_dir, UPPER)


def _db(d: str) -> str:
    from fusefs.upper import DB_NAME

    return os.path.join(d, DB_NAME)


def has_upper(d: str) -> bool:
    """True if ``d`` holds an upper (made by a mount and not cleared by a write-back)."""
    return os.path.exists(_db(d))


def _read_only(d: str) -> sqlite3.Connection:
    # Read-only, without creating anything, and fine while the daemon holds the upper.
    return sqlite3.connect(f"file:{_db(d)}?mode=ro", uri=True, timeout=60)


def upper_base(d: str) -> Ref | None:
    """The base Ref the upper in ``d`` records, or None if there is no upper."""
    if not has_upper(d):
        return None
    c = _read_only(d)
    try:
        row = c.execute("SELECT value FROM meta WHERE key='base'").fetchone()
    finally:
        c.close()
    return Ref.parse(row[0]) if row else None


def pinned_refs(d: str) -> list[Ref]:
    """What the upper in state directory ``d`` pins for GC: its base, every lower tree a
    row shows through (as Refs of those trees), the older lowers its daemon still serves
    to detached inodes (``held_lowers``: files unlinked or removed by a restore while open),
    and the tree of what excluded files kept across checkpoints still read (``kept_tree``).
    An existing directory without an upper pins nothing; a missing directory or an
    unreadable upper raises (GC fails closed)."""
    if not os.path.isdir(d):
        raise FileNotFoundError(f"state directory {d} is missing")
    if not has_upper(d):
        return []
    c = _read_only(d)
    try:
        row = c.execute("SELECT value FROM meta WHERE key='base'").fetchone()
        trees = c.execute("SELECT DISTINCT lower_tree FROM inodes "
                          "WHERE lower_tree IS NOT NULL").fetchall()
        held = c.execute("SELECT value FROM meta WHERE key='held_lowers'").fetchone()
        kept = c.execute("SELECT value FROM meta WHERE key='kept_tree'").fetchone()
    finally:
        c.close()
    if row is None:
        raise ValueError(f"the upper in {d} records no base")
    out = [Ref.parse(row[0])]
    for text in (held[0].split() if held else []) + (kept[0].split() if kept else []):
        r = Ref.parse(text)
        if r not in out:
            out.append(r)
    for (t,) in trees:
        r = Ref(ObjectId(bytes(t)))
        if r not in out:
            out.append(r)
    return out


def state_dirs_reader(path: str) -> list[Ref]:
    """``store.gc``'s reader of registered state directories (see ``pinned_refs``)."""
    return pinned_refs(path)


def register_state_dir(store: Any, d: str) -> None:
    """List ``d`` as this host's in the catalog's ``state_dirs`` (GC keeps what it pins)."""
    from store.hostid import host_id

    store.catalog.add_state_dir(os.path.abspath(d), host_id())


def unregister_state_dir(store: Any, d: str) -> None:
    from store.hostid import host_id

    store.catalog.remove_state_dir(os.path.abspath(d), host_id())


def clear_upper(d: str) -> None:
    """Drop the upper in ``d`` after its tree was written back. The database goes first
    (durably), so a crash part-way leaves no upper rather than a broken one; ``open_overlay``
    removes any leftovers before a new upper is made."""
    try:
        os.unlink(_db(d))
    except FileNotFoundError:
        pass
    _fsync_dir(d)
    _remove_leftovers(d)


def _remove_leftovers(d: str) -> None:
    from fusefs.upper import DATA_DIR

    for suffix in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_db(d) + suffix)
    force_rmtree(os.path.join(d, DATA_DIR))


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_overlay(store: Any, d: str, ref: Ref | None, cache_mib: int = 128,
                 quota: tuple[int | None, int | None] = (None, None),
                 exclude: tuple[str, ...] | None = None) -> Overlay:
    """Open (creating with base ``ref`` if new) and lock the upper in ``d`` and return the
    overlay over its base; ``quota`` (bytes, inodes) is recorded in the upper first (None
    keeps what it records, 0 removes a cap), and so are the ``exclude`` patterns (None
    keeps the recorded ones). Raises StateLockedError, BaseMismatchError, NoBaseError and
    the store's ObjectNotFoundError for a base missing from the store."""
    from fusefs.lower import Lower
    from fusefs.overlay import Overlay
    from fusefs.upper import Upper

    if not has_upper(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        _remove_leftovers(d)
    upper = Upper.open(d, store_root=store.root, chunk_size=store.chunk_size, ref=ref)
    try:
        upper.set_quota(*quota)
        upper.set_exclude(exclude)
        store.get_tree(upper.base.tree_id)
        return Overlay(Lower(store, upper.base, cache_bytes=cache_mib << 20), upper)
    except BaseException:
        upper.close()
        raise


def freeze_offline(store: Any, d: str) -> Ref:
    """The Ref of the tree the (unmounted) upper in ``d`` shows, written to the store but not
    listed and not journaled; the upper is left as it is. Excluded paths are in it: it is
    what a fixed root's real directory gets back."""
    from fusefs import checkpoint as ck

    ov = open_overlay(store, d, None)
    ov.exclude = None
    try:
        p = ck.plan(ov)
        if p.unchanged:
            return p.base
        with store.writer() as w:
            ref = ck.build(p, store, w)
            w.commit()
        return ref
    finally:
        assert ov.upper is not None
        ov.upper.close()


def upper_holds_changes(store: Any, d: str, pointer: Ref | None) -> bool:
    """True if the (unmounted) upper in ``d`` shows a tree other than ``pointer``: it sits
    on another base, or a checkpoint of it would write something. No upper: False. The
    session's excluded paths are no such change (they are in no tree: a session that
    moves starts without them, like a fresh clone), so with exclude patterns the tree a
    checkpoint would make is built in memory and compared."""
    from fusefs import checkpoint as ck

    if not has_upper(d):
        return False
    if upper_base(d) != pointer:
        return True
    ov = open_overlay(store, d, None)
    try:
        p = ck.plan(ov)
        if p.unchanged:
            return False
        if ov.exclude is None:
            return True
        return ck.build(p, store, ck.MemoryWriter(store)) != pointer
    finally:
        assert ov.upper is not None
        ov.upper.close()


# -- the mount ------------------------------------------------------------------------------

class FuseMount:
    """One mount of lower + upper at ``mountpoint``, served by ``run`` on the main thread.

    ``fixed`` roots are written back at the last ``leave``; ``state_base`` holds the
    write-back's reconcile log; ``state_dir`` is the session state directory named in the
    mount record (how ``rewindfs checkpoint MNT`` finds the session's control socket).
    ``users`` counts the sessions using the mount (one, or several when shared).
    """

    def __init__(self, store: Any, mountpoint: str, upper: str, *, fixed: bool,
                 consistency: str, state_base: str, state_dir: str) -> None:
        self.store = store
        self.mountpoint = mountpoint
        self.upper_dir = upper
        self.fixed = fixed
        self.consistency = consistency
        self.state_base = state_base
        self.state_dir = state_dir  # the session state directory named in the mount record
        self.base: Ref | None = None  # base of a new upper, decided while preparing
        self.phase = PREPARE
        self.ready = threading.Event()  # serving, or failed to mount (see ``error``)
        self.unmounted = threading.Event()
        self.error: str | None = None
        self.persist_error: str | None = None  # set when the last persist failed (``leave``)
        self.served = False  # the mount served at some point (a fixed root is written back)
        self.error_cause: BaseException | None = None  # the store's error behind ``error``
        self.live: Any = None  # fusefs.control.Live while serving
        # caps recorded in the upper when it opens (bytes, inodes; None: keep the recorded)
        self.quota: tuple[int | None, int | None] = (None, None)
        self.exclude: tuple[str, ...] | None = None  # exclude patterns recorded likewise
        self.last: dict[str, Any] = {}  # the daemon's last checkpoint or restore reply
        # The step log's state a preserved upper continues from (``Journal.resume_point``)
        self.step_resume: tuple[dict[str, Any], dict[str, str]] | None = None
        self.on_mutation: list[Callable[[], None]] = []
        self._token: Any = None
        self._lock = threading.Lock()
        self._users = 0
        self._closing = False
        self._finished = False
        self._restore_lock: Any = None
        self._stop_requested = False
        self._initialized = False  # pyfuse3.init succeeded: pyfuse3.main runs or ran
        self.decided = threading.Event()  # a new session's base is known: mount meanwhile
        self.root_fd: int | None = None  # the real directory under a fixed root's mount

    # -- users (shared placement) --------------------------------------------------------

    def join(self) -> None:
        """A session starts using the mount. Raises MountClosingError once it is closing."""
        with self._lock:
            if self._closing:
                raise MountClosingError(f"the mount at {self.mountpoint} is closing")
            self._users += 1

    @property
    def users(self) -> int:
        return self._users

    @property
    def closing(self) -> bool:
        return self._closing

    def leave(self) -> None:
        """A session stops using the mount; the last one unmounts it and writes a fixed
        root back (CONTRACT 4.1, 4.9). Blocks until that is done. Raises MountError if
        persisting the upper failed at the unmount (a full disk: see ``fusefs/upper.py``)."""
        with self._lock:
            self._users -= 1
            last = self._users <= 0
            if last:
                self._closing = True
        if last:
            self.stop()
            self.finish()
            if self.persist_error is not None:  # the caller's shutdown fails with the cause
                from fusefs.errors import MountError

                raise MountError(self.mountpoint, self.persist_error)

    # -- preparing -----------------------------------------------------------------------

    def prepare_root(self) -> None:
        """Create a missing per-session root and, for a fixed root, keep a handle on the
        real directory before anything is mounted over it."""
        make_root(self.mountpoint)
        if self.fixed and self.root_fd is None:
            self.root_fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY
                                   | os.O_NOFOLLOW | os.O_CLOEXEC)

    def check_root(self) -> None:
        """Before mounting (the caller holds the session's leases): see
        ``clear_dead_mounts``."""
        clear_dead_mounts(self.mountpoint)

    # -- serving (main thread) -----------------------------------------------------------

    def run(self, cache_mib: int = 128, max_tasks: int = 8) -> int:
        """Mount and serve until unmounted (``stop``, SIGTERM/SIGINT, or ``fusermount -u``);
        then persist the upper durably and unmount. Returns 0, or 9 if the loop or the
        unmount failed; ``error`` says why a mount never served."""
        import signal

        import pyfuse3
        import trio

        from fusefs import binding
        from fusefs.control import Live
        from fusefs.mounts import mount_id, remove_record, start_time, still_mounted, write_record
        from fusefs.operations import Operations, mount_options, tune_gc

        with self._lock:
            if self._stop_requested:
                return self._failed("the session closed before its root was mounted")
            self.phase = MOUNTING
        fresh = not has_upper(self.upper_dir)  # made now: nothing of it to keep if unserved
        try:
            self.prepare_root()
            register_state_dir(self.store, self.upper_dir)
            ov = open_overlay(self.store, self.upper_dir, self.base, cache_mib, self.quota,
                              self.exclude)
        except Exception as e:
            self.error_cause = e
            return self._failed(f"cannot open the upper: {type(e).__name__}: {e}")
        gate = _notifying_gate(self)
        ops = Operations(ov, gate=gate)
        live = Live(ops, self.store, gate, mountpoint=self.mountpoint,
                    state_dir=self.state_dir)
        if self.step_resume is not None:
            live.steps.resume(*self.step_resume)
        our_mount: int | None = None
        init_error: str | None = None

        async def signals(nursery: trio.Nursery) -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as it:
                async for sig in it:
                    log.info("signal %d: unmounting %s", sig, self.mountpoint)
                    live.closing = True
                    if our_mount is None:
                        nursery.cancel_scope.cancel()
                    else:
                        pyfuse3.terminate()
                    return

        def serving() -> None:
            self.phase = SERVING
            self.served = True
            log.info("serving %s at %s (upper %s)", ov.lower.ref, self.mountpoint,
                     self.upper_dir)
            self.ready.set()

        async def main() -> None:
            nonlocal our_mount, init_error
            self._restore_lock = trio.Lock()
            with self._lock:  # a ``stop`` from now on terminates through the token
                self._token = trio.lowlevel.current_trio_token()
                if self._stop_requested:
                    init_error = "the session closed before its root was mounted"
                    return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(signals, nursery)
                try:
                    binding.init(ops, self.mountpoint, mount_options())
                except Exception as e:
                    init_error = f"cannot mount {self.mountpoint}: {e}"
                    nursery.cancel_scope.cancel()
                    return
                self._initialized = True
                our_mount = mount_id(self.mountpoint)
                self.live = live
                write_record(self.mountpoint, {
                    "pid": os.getpid(), "started": start_time(os.getpid()),
                    "mountpoint": self.mountpoint, "ref": str(ov.lower.ref),
                    "state": self.state_dir, "log": os.path.join(self.state_dir, DAEMON_LOG),
                    "readonly": False})
                nursery.start_soon(ops.commit_loop)
                ops.start_background(nursery)
                ops.on_init = serving
                await pyfuse3.main(min_tasks=1, max_tasks=max_tasks)
                nursery.cancel_scope.cancel()

        from fusefs.errors import describe

        code = 0
        try:
            tune_gc()
            trio.run(main)
        except BaseException as e:  # the loop failed: persist what we can, then unmount
            log.error("serving loop ended: %s", describe(e), exc_info=e)
            init_error = init_error or f"the mount stopped before it served: {describe(e)}"
            code = 9
        self.phase = STOPPED
        self.live = None
        try:
            ops.close()
        except Exception as e:
            log.error("persisting the upper at unmount failed: %s: %s", type(e).__name__, e)
            self.persist_error = f"persisting the upper at unmount failed: {e}"
            code = 9
        if our_mount is not None:
            try:
                pyfuse3.close(unmount=still_mounted(self.mountpoint, our_mount))
            except Exception as e:
                log.error("unmount of %s failed: %s", self.mountpoint, e)
                code = 9
            remove_record(self.mountpoint, os.getpid())
            log.info("unmounted %s (%d requests)", self.mountpoint, sum(ops.counts.values()))
        if not self.ready.is_set():
            self.error = init_error or "the mount ended before it served"
            log.error("%s", self.error)
            code = code or 9
            if fresh:  # no request was served: the upper made for this mount goes again
                try:
                    force_rmtree(self.upper_dir)
                    unregister_state_dir(self.store, self.upper_dir)
                except Exception as e:
                    log.error("removing the unused upper %s failed: %s: %s", self.upper_dir,
                              type(e).__name__, e)
        self.unmounted.set()
        self.ready.set()
        return code

    def _failed(self, why: str) -> int:
        """Never served, because of ``why``: 9, or the exit code of the failed server behind
        it (``error_cause``: 11 the blob backend, 12 the catalog)."""
        log.error("%s", why)
        self.error = why
        self.phase = STOPPED
        self.unmounted.set()
        self.ready.set()
        from fusefs.errors import MountError

        return int(MountError(self.mountpoint, why, because=self.error_cause).exit_code)

    def mutated(self) -> None:
        for fn in list(self.on_mutation):
            try:
                fn()
            except Exception as e:  # a policy hook must never fail a request
                log.warning("mutation hook failed: %s", e)

    # -- calls from other threads ----------------------------------------------------------

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        """Wait until the mount serves. Raises SessionError if it never will."""
        if not self.ready.wait(timeout_s) or self.phase != SERVING:
            raise SessionError(f"the mount at {self.mountpoint} is not serving"
                               + (f": {self.error}" if self.error else ""))

    def call(self, afn: Callable[..., Any], *args: Any) -> Any:
        """Run ``await afn(*args)`` on the event loop and return its result."""
        import trio

        self.wait_serving()
        try:
            return trio.from_thread.run(afn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise SessionError(f"the mount at {self.mountpoint} has stopped") from None

    def call_sync(self, fn: Callable[..., Any], *args: Any) -> Any:
        import trio

        self.wait_serving()
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise SessionError(f"the mount at {self.mountpoint} has stopped") from None

    def checkpoint(self, origin: str) -> Ref:
        """A live checkpoint (CONTRACT 3.1), listed with ``origin``; returns its Ref."""
        self.wait_serving()
        live = self.live

        async def run() -> dict[str, Any]:
            out: dict[str, Any] = await live.checkpoint(None, "manual", None, origin)
            return out

        out = self.call(run)
        self.last = out
        return Ref.parse(out["ref"])

    def restore(self, ref: Ref, discard: bool, timeout_s: float,
                on_pre: Callable[[Ref], None] | None, on_commit: Callable[..., None],
                wait_writers_s: float | None = None,
                paths: list[str] | None = None) -> Ref | None:
        """A live restore (CONTRACT 3.2): the pre-restore checkpoint (unless ``discard``)
        goes to ``on_pre`` before the swap, ``on_commit`` right after it (for a path
        restore, ``paths``, as ``on_commit(tree made, normalized paths)``). Returns the
        pre-restore Ref. Raises RestoreError."""
        self.wait_serving()
        live = self.live

        def committed(target: Ref) -> None:
            if paths is None:
                on_commit()
            else:
                from fusefs.restore import normalize_paths

                on_commit(target, [os.fsdecode(p) for p in normalize_paths(paths)])

        async def run() -> dict[str, Any]:
            async with self._restore_lock:
                live.on_pre_restore = on_pre
                live.on_restored = committed
                try:
                    out: dict[str, Any] = await live.restore(
                        ref, discard=discard, timeout_s=timeout_s,
                        wait_writers_s=wait_writers_s, paths=paths)
                    return out
                finally:
                    live.on_pre_restore = None
                    live.on_restored = None

        out = self.call(run)
        self.last = out
        return Ref.parse(out["pre_restore"]) if out.get("pre_restore") else None

    def stop(self) -> None:
        """Unmount (if serving) and wait until the upper is persisted and the mount gone."""
        import trio

        with self._lock:
            self._stop_requested = True
            if self.phase == PREPARE:
                self.phase = STOPPED
                self.unmounted.set()
                self.ready.set()
                return
            token = self._token
        live = self.live
        if live is not None:
            live.closing = True
        if token is not None and not self.unmounted.is_set():
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(_terminate, self, trio_token=token)
        self.unmounted.wait()

    def finish(self) -> None:
        """After the unmount: write a fixed root back (once)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        try:
            if self.fixed and self.served and has_upper(self.upper_dir):
                self.write_back()
        finally:
            if self.root_fd is not None:
                os.close(self.root_fd)
                self.root_fd = None

    def write_back(self) -> None:
        """Make the real directory under the (now unmounted) fixed root hold the final tree
        exactly, then clear the upper. Refused (logged, the upper kept for the next mount)
        if the path no longer leads to the directory that was mounted over."""
        from fusefs.mounts import is_mounted

        if is_mounted(self.mountpoint):
            log.error("%s is still mounted: not written back (the upper is kept)",
                      self.mountpoint)
            return
        assert self.root_fd is not None
        a, b = os.fstat(self.root_fd), os.stat(self.mountpoint, follow_symlinks=False)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            log.error("%s is no longer the directory that was mounted over: not written "
                      "back (the upper is kept)", self.mountpoint)
            return
        t0 = time.perf_counter()
        ref = freeze_offline(self.store, self.upper_dir)
        tree = FixedTree(self.store, self.mountpoint, "write-back", self.consistency,
                         self.state_base)
        tree.write_back(ref)
        clear_upper(self.upper_dir)
        log.info("wrote %s back into %s in %.1f ms", ref, self.mountpoint,
                 (time.perf_counter() - t0) * 1000)


def clear_dead_mounts(path: str) -> None:
    """Lazily unmount what a killed daemon of ours left at ``path`` (a rewindfs mount whose
    daemon is gone); raise SessionError for any other mount there. Call it holding the
    session's leases."""
    from fusefs.mounts import fstype

    for _ in range(8):
        t = fstype(path)
        if t is None:
            return
        if t != "fuse.rewindfs" or _served(path):
            raise SessionError(f"{path} is already a mount point ({t}) that another daemon "
                               "serves")
        log.warning("lazily unmounting the dead mount a killed daemon left at %s", path)
        _lazy_unmount(path)
    raise SessionError(f"cannot unmount the dead mounts at {path}")


def _served(path: str) -> bool:
    """True unless the rewindfs mount at ``path`` has lost its daemon: its mount record
    names a process that is gone, or (no record) the mount answers ENOTCONN."""
    from fusefs.mounts import alive, dead, read_record

    rec = read_record(path)
    if rec is not None and isinstance(rec.get("pid"), int):
        return alive(rec["pid"], rec.get("started"))
    return not dead(path)


def _lazy_unmount(path: str) -> None:
    import shutil
    import subprocess

    tool = shutil.which("fusermount3")
    if tool is not None:
        subprocess.run([tool, "-uz", path], capture_output=True, timeout=60)
    else:
        subprocess.run(["umount", "-l", path], capture_output=True, timeout=60)


def _terminate(mount: FuseMount) -> None:
    """On the event loop: end ``pyfuse3.main`` (which runs once the mount is initialized;
    before that ``run`` sees the stop request itself)."""
    import pyfuse3

    if mount._initialized:
        pyfuse3.terminate()


def _notifying_gate(mount: FuseMount) -> Any:
    """A ``fusefs.gate.Gate`` that also tells the session policy that a mutation ended (at
    most every ``MUTATION_NOTE_S``), so on_idle counts the requests through the mount."""
    from fusefs.gate import Gate

    class NotifyingGate(Gate):
        _last = 0.0

        @asynccontextmanager
        async def mutation(self) -> AsyncIterator[None]:
            async with Gate.mutation(self):
                yield
            now = time.monotonic()
            if now - self._last >= MUTATION_NOTE_S:
                self._last = now
                mount.mutated()

    return NotifyingGate()


# -- the session's view -------------------------------------------------------------------------

class FuseTree:
    """``LiveTree`` of one session over ``mount`` (see the module docstring)."""

    def __init__(self, cfg: WorkspaceConfig, record: SessionRecord, mount: FuseMount) -> None:
        assert cfg.placement is not None and record.root is not None
        self.cfg = cfg
        self.record = record
        self.mount = mount
        self.root = record.root
        self.consistency = cfg.placement.consistency
        self.store: Any = cfg.store if cfg.store is not None else cfg.placement.store
        self.journal = Journal(self.store, record.id)
        self._joined = False
        mount.join()
        self._joined = True

    @property
    def _attached(self) -> bool:
        return self.mount.phase != PREPARE

    def recover(self, roll_forward: RollForward) -> None:
        """Before mounting: undo a write-back a crash interrupted, then reconcile the upper's
        recorded base (or, for a written-back fixed root, the directory) with the restore
        pointer, journaling a difference as a restore (CONTRACT 4.6)."""
        if self._attached:
            return  # a shared mount already serving: nothing of it is ours to recover
        m = self.mount
        m.check_root()
        if m.fixed:
            FixedTree(self.store, self.root, "write-back", self.consistency,
                      m.state_base).recover(lambda _r, _s: True)
        pointer = self.journal.restore_pointer()
        if has_upper(m.upper_dir):
            base = upper_base(m.upper_dir)
            if pointer is not None and base is not None and base != pointer:
                log.warning("session %s: the upper sits on %s, the journal on %s; mounting "
                            "the upper and journaling it as a restore", self.record.id, base,
                            pointer)
                roll_forward(base, self.journal.last_seq())
            m.step_resume = self.journal.resume_point()
        elif pointer is not None:
            if m.fixed:  # written back at the last shutdown: the directory is the tree
                m.prepare_root()
                ref = self._snapshot_root("adopt")
                if ref != pointer:
                    roll_forward(ref, self.journal.last_seq())
                m.base = ref
            else:
                m.base = pointer

    def is_empty(self) -> bool:
        if self._attached or has_upper(self.mount.upper_dir) or self.mount.base is not None:
            return False
        return _is_empty_dir(self.root)

    def install(self, ref: Ref) -> None:
        """Seed or fork: the new upper sits on ``ref``; nothing is copied."""
        if self._attached or has_upper(self.mount.upper_dir):
            raise SessionError(f"{self.root} already has a tree; it cannot be seeded")
        self.store.root_tree(ref)
        self.mount.base = ref
        self.mount.decided.set()

    def _snapshot_root(self, origin: str) -> Ref:
        from store.snapshot import snapshot

        self.mount.prepare_root()
        return snapshot(self.store, self.root, origin=origin)

    def capture(self, origin: str) -> Ref:
        """A live checkpoint; before the mount (adoption, seeding a new session) a snapshot
        of the real root, or an offline checkpoint of a preserved upper."""
        m = self.mount
        if self._attached:
            return m.checkpoint(origin)
        if origin != "seed":
            m.wait_serving()
            return m.checkpoint(origin)
        if has_upper(m.upper_dir):
            from fusefs.checkpoint import checkpoint_overlay

            ov = open_overlay(self.store, m.upper_dir, None)
            try:
                ref = checkpoint_overlay(ov, origin=origin).ref
            finally:
                ov.close()
            m.decided.set()
            return ref
        ref = self._snapshot_root(origin)
        m.base = ref
        m.decided.set()
        return ref

    def restore_live(self, ref: Ref, discard: bool, timeout_s: float,
                     on_pre: Callable[[Ref], None] | None, on_commit: Callable[..., None],
                     wait_writers_s: float | None = None,
                     paths: list[str] | None = None) -> Ref | None:
        """Pause (waiting for writers only with ``wait_writers_s``), checkpoint
        (``on_pre``), swap, ``on_commit``, resume, all inside the daemon (CONTRACT 3.2);
        ``paths``: a path restore (``Live.restore``). Raises RestoreError."""
        if not self._attached:
            raise RestoreError(RestoreError.SWAP_FAILED, str(ref), "the root is not mounted")
        return self.mount.restore(ref, discard, timeout_s, on_pre, on_commit, wait_writers_s,
                                  paths)

    def step(self) -> dict[str, Any]:
        """Close a step in the daemon (``fusefs.control.Live.step``): the paths changed since
        the previous step. Raises SessionError when the mount has stopped."""
        live = self.mount.live if self._attached else None
        if live is None:
            self.mount.wait_serving()
            live = self.mount.live

        async def run() -> dict[str, Any]:
            out: dict[str, Any] = await live.step()
            return out

        out: dict[str, Any] = self.mount.call(run)
        return out

    def unstep(self, changes: list[dict[str, Any]]) -> None:
        """A step's changes that could not be journaled: the next step reports them."""
        live = self.mount.live
        if live is not None:
            self.mount.call_sync(live.steps.give_back, changes)

    def swap(self, ref: Ref, seq_before: int, on_commit: OnCommit) -> None:
        del seq_before  # the upper's recorded base is what recovery compares
        self.restore_live(ref, True, 60.0, None, on_commit)

    def holds_changes(self, pointer: Ref | None) -> bool | None:
        """After ``close``: does the upper still hold changes no checkpoint took (its tree
        differs from ``pointer``, the restore pointer)? None for a fixed root (written back
        into its directory) or a mount other sessions still use (``moves.py``)."""
        m = self.mount
        if m.fixed or not m.unmounted.is_set():
            return None
        return upper_holds_changes(self.store, m.upper_dir, pointer)

    @property
    def served(self) -> bool:
        """True once the mount served (for any of its sessions)."""
        return bool(self.mount.served)

    def close(self) -> None:
        """Leave the mount: the last session unmounts it (and writes a fixed root back)."""
        if self._joined:
            self._joined = False
            self.mount.leave()
