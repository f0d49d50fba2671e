"""The session API an agent harness calls (CONTRACT 4; the CLI mirrors it).

    cfg = define(session_workspaces(store, "/srv/ws"), policy=SnapshotPolicy("manual"))
    ws = Workspace(cfg)
    s = ws.new_session(seed=None)        # or resume_session(id), fork_session(id_or_ref)
    a = s.checkpoint(); s.restore(a); s.log(); s.shutdown()

A ``SessionBackend`` opens sessions: ``FallbackBackend`` runs the session runtime in this
process over a plain directory (CONTRACT 4.7); a FUSE backend runs it inside the mount daemon
and hands back a client of its control socket with the same ``SessionHandle`` methods.
``Workspace`` chooses one from ``config.backend`` (``auto``: FUSE when /dev/fuse is usable and
the FUSE backend is installed, else the fallback).

Seed rules (CONTRACT 4.4), checked here before anything is registered where they need no
tree, and in the runtime (under the leases) where they do: a seed is a Ref or a directory
(imported first); refused for shared placement and for a non-empty fixed root, which is
adopted instead. A fork checkpoints the source session with trigger ``fork`` (or takes a
Ref as it is) and seeds the new session with it: no chunk is written.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any, Protocol

from store.objects import JournalEvent, Store
from store.ref import Ref

from . import moves
from .config import WorkspaceConfig, refuse_without_fuse
from .errors import (
    SeedError,
    SessionError,
    SessionNotFoundError,
    WorkspaceNotConfiguredError,
)
from .fallback import (
    FixedTree,
    PerSessionTree,
    force_rmtree,
    fuse_available,
    fuse_unavailable_reason,
)
from .journal import Journal
from .live import LiveTree
from .placement import Mode
from .registry import Registry, SessionRecord, new_session_id
from .runtime import SessionCore

FUSE_BACKEND_MODULE = "fusefs.session.fusebackend"


class SessionHandle(Protocol):
    """A live session as its backend serves it (the runtime itself, or a daemon client)."""

    id: str

    @property
    def epoch(self) -> int: ...

    @property
    def fault(self) -> str | None: ...

    def checkpoint(self, trigger: str = "manual", timeout_s: float | None = None,
                   label: str | None = None) -> Ref: ...

    def restore(self, ref: Ref, discard: bool = False, timeout_s: float | None = None,
                cancel: threading.Event | None = None,
                wait_writers_s: float | None = None,
                paths: list[str] | None = None) -> Ref | None: ...

    def turn_done(self, label: str | None = None) -> dict[str, Any] | None: ...

    def step_done(self, label: str | None = None) -> dict[str, Any] | None: ...

    def write_permit(self) -> contextlib.AbstractContextManager[None]: ...

    def mutated(self) -> None: ...

    def shutdown(self) -> None: ...


class SessionBackend(Protocol):
    """Opens sessions. ``open_new`` seeds (``seed`` is a Ref already in the store, or None
    to adopt the root as it is) and journals the seed event; ``open_existing`` resumes."""

    name: str

    def open_new(self, cfg: WorkspaceConfig, record: SessionRecord,
                 seed: Ref | None) -> SessionHandle: ...

    def open_existing(self, cfg: WorkspaceConfig, record: SessionRecord) -> SessionHandle: ...


class FallbackBackend:
    """The no-FUSE backend: the session runtime runs in this process on a real directory."""

    name = "fallback"

    def live_tree(self, cfg: WorkspaceConfig, record: SessionRecord) -> LiveTree:
        assert cfg.placement is not None and record.root is not None
        if cfg.placement.mode is Mode.PER_SESSION:
            return PerSessionTree(cfg.placement.store, record.root, record.id,
                                  record.state_dir)
        assert cfg.state_base is not None
        return FixedTree(cfg.placement.store, record.root, record.id,
                         cfg.placement.consistency, cfg.state_base)

    def open_new(self, cfg: WorkspaceConfig, record: SessionRecord,
                 seed: Ref | None) -> SessionHandle:
        refuse_without_fuse(cfg)
        core = SessionCore(cfg, record, self.live_tree(cfg, record))
        core.open_new(seed)
        return core

    def open_existing(self, cfg: WorkspaceConfig, record: SessionRecord) -> SessionHandle:
        refuse_without_fuse(cfg)
        core = SessionCore(cfg, record, self.live_tree(cfg, record))
        core.open_existing()
        return core


def label_snapshot(store: Store, ref: Ref, label: str) -> None:
    """Give ``ref`` (a checkpoint just taken) ``label`` in the store's snapshot list,
    keeping the origin it is listed with (CONTRACT 1.6: a label belongs to a Ref)."""
    row = store.catalog.snapshot(str(ref))  # (ref, time_ns, origin, label, ...)
    store.add_snapshot(ref, row[2] if row else "checkpoint", label)


def select_backend(cfg: WorkspaceConfig) -> SessionBackend:
    """The backend ``cfg.backend`` asks for. Raises SessionError if ``fuse`` is asked and
    the FUSE backend or /dev/fuse is unavailable."""
    if cfg.backend == "fallback":
        return FallbackBackend()
    try:
        mod = importlib.import_module(FUSE_BACKEND_MODULE)
    except ModuleNotFoundError as e:
        if e.name != FUSE_BACKEND_MODULE:
            raise
        mod = None
    if cfg.backend == "fuse":
        if mod is None:
            raise SessionError("the FUSE session backend is not installed; use the fallback "
                               "(--no-fuse)")
        why = fuse_unavailable_reason()
        if why is not None:
            raise SessionError(f"FUSE is not available here ({why}); use the fallback "
                               "(--no-fuse)")
    if mod is not None and fuse_available():
        backend: SessionBackend = mod.FuseBackend()
        return backend
    return FallbackBackend()


class Session:
    """One open session. ``root`` is the live directory tools use (None without placement).
    Use as a context manager to shut it down."""

    def __init__(self, workspace: Workspace, record: SessionRecord,
                 handle: SessionHandle | None) -> None:
        self.workspace = workspace
        self.record = record
        self.id = record.id
        self.root = record.root
        self._handle = handle

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _h(self, op: str) -> SessionHandle:
        if self._handle is None:
            raise WorkspaceNotConfiguredError(op)
        return self._handle

    @property
    def epoch(self) -> int:
        """The session lease epoch (0 without placement)."""
        return self._handle.epoch if self._handle is not None else 0

    @property
    def fault(self) -> str | None:
        """Why the session is faulted, or None."""
        return self._handle.fault if self._handle is not None else None

    @property
    def terminal(self) -> bool:
        """True if the session is terminally faulted (a lease taken over, a failed
        rollback): only a shutdown is served; a resume after it starts afresh."""
        return getattr(self._handle, "terminal_fault", None) is not None

    def checkpoint(self, trigger: str = "manual", timeout_s: float | None = None,
                   label: str | None = None) -> Ref:
        """Freeze the live tree and journal it; return the Ref (CONTRACT 4.5). ``trigger``:
        manual (clears a latched fault) or interrupt. ``label`` is kept with this
        checkpoint in the journal (``log`` shows it and ``@label`` in this session finds
        it, also when an unchanged tree gives an earlier checkpoint's Ref) and with the Ref
        in the store's snapshot list. Raises
        WorkspaceNotConfiguredError, SessionClosedError, SessionFaultedError,
        CheckpointError."""
        if trigger not in ("manual", "interrupt"):
            raise ValueError(f"a caller's checkpoint trigger is manual or interrupt, "
                             f"not {trigger!r}")
        return self._h("checkpoint").checkpoint(trigger, timeout_s, label or None)

    def restore(self, ref: Ref | str, discard: bool = False,
                timeout_s: float | None = None,
                cancel: threading.Event | None = None,
                wait_writers_s: float | None = None,
                paths: list[str] | None = None) -> Ref | None:
        """Make the live tree ``ref`` (CONTRACT 3.2, 4.7); return the pre_restore checkpoint
        (None with ``discard``). ``paths`` (relative to the root, ``/``-separated): restore
        only those paths (each a file, a directory, or absent in ``ref``: then removed)
        and leave the rest of the tree as it is; journaled as ``WorkspaceRestored`` of the
        tree that makes, with the paths and ``ref`` as source (``log()[-1].ref`` is that
        tree). A hostile path (absolute, ``..``, NUL, the root) is RestoreError
        path_escape, a path in neither tree path_not_found, both before anything changes. Never waits for open files: on a FUSE root, what they hold
        is detached (their later writes reach neither the restored tree nor any
        checkpoint). ``timeout_s`` (s, default the policy timeout) bounds the wait for write
        permits (tool calls in flight); ``wait_writers_s`` (s) instead waits that long for
        files open for writing to close and refuses (permit_failed) if any stays open (FUSE
        roots only: a plain directory cannot tell). Raises WorkspaceNotConfiguredError,
        InvalidRefError, RestoreError, and store errors for a target missing from the
        store."""
        h = self._h("restore")
        target = self.resolve(ref)
        if paths is not None:
            if isinstance(paths, str | bytes):
                raise TypeError("paths is a list of paths, not one path")
            return h.restore(target, discard, timeout_s, cancel, wait_writers_s,
                             [os.fsdecode(p) for p in paths])
        return h.restore(target, discard, timeout_s, cancel, wait_writers_s)

    def resolve(self, ref: Ref | str) -> Ref:
        """The Ref that ``ref`` names: a Ref, or a text ``store.resolve.resolve_ref`` reads
        with this session's scope (a unique hex prefix, ``@label``, ``@-N``: the Nth
        checkpoint back in this session's journal). Raises InvalidRefError."""
        if isinstance(ref, Ref):
            return ref
        from store.resolve import resolve_ref

        return resolve_ref(self.workspace.store, ref, session=self.id)

    def turn_done(self, label: str | None = None) -> dict[str, Any] | None:
        """The agent finished a turn: records a step like ``step_done`` (default label
        ``turn``), then checkpoints under on_turn_done."""
        if self._handle is None:
            return None
        return self._handle.turn_done(label)

    def step_done(self, label: str | None = None) -> dict[str, Any] | None:
        """The agent finished a step (a tool call, say): journal ``WorkspaceStep`` with the
        paths added, removed, modified and type-changed since the previous step (issue
        14.1; ``fusefs/steps.py``), then checkpoint under on_step_done. Returns
        ``{"seq", "step", "label", "changes": [{path, status, kind}], "elapsed_ms"}``, or
        None without FUSE (the fallback backend records no steps: it has no dirty set, and
        a snapshot-and-diff per step would cost a walk of the whole tree). Raises
        SessionClosedError, SessionFaultedError, JournalError."""
        if self._handle is None:
            return None
        return self._handle.step_done(label)

    def steps(self) -> list[dict[str, Any]]:
        """The session's recorded steps, oldest first (``Journal.steps``)."""
        return Journal(self.workspace.store, self.id).steps()

    @contextlib.contextmanager
    def write_permit(self) -> Iterator[None]:
        """Hold the shared write permit while mutating the root (a checkpoint or restore
        waits for it); its end restarts the idle timer."""
        if self._handle is None:
            yield
            return
        with self._handle.write_permit():
            yield

    @contextlib.contextmanager
    def background_writer(self) -> Iterator[None]:
        """Mark a command writing the root without a write permit while the block runs
        (see SessionRuntime.background_writer); a no-op where the handle sees every write
        itself (a FUSE mount)."""
        mark = getattr(self._handle, "background_writer", None)
        if mark is None:
            yield
            return
        with mark():
            yield

    def log(self) -> list[JournalEvent]:
        """The session's journal, oldest first."""
        return self.workspace.log(self.id)

    def restore_pointer(self) -> Ref | None:
        from .journal import restore_pointer

        return restore_pointer(self.log())

    def shutdown(self, checkpoint: bool = False) -> Ref | None:
        """Stop checkpoint work, unmount or detach, release the root lease, then the session
        lease (CONTRACT 4.9). No checkpoint is made unless ``checkpoint`` (amended 4.9):
        then the live tree is checkpointed first (trigger ``shutdown``) and its Ref
        returned; if that checkpoint fails the error is raised and the session keeps
        running. Idempotent (a closed session returns None)."""
        ref = None
        if checkpoint and self._handle is not None and self.workspace._is_open(self):
            ref = self._handle.checkpoint("shutdown", None)
        if self._handle is not None:
            self._handle.shutdown()
        self.workspace._closed(self)
        return ref


def remove_session(store: Any, registry: Registry, session_id: str, leaser: Any,
                   ttl_s: float = 30.0) -> SessionRecord | None:
    """Delete stopped session ``session_id``: its registry record, its state directory
    (upper layer, logs, control files) and, for per-session placement, its root. Returns
    the record (None when only the leftovers of an interrupted removal were there).

    Refused while a live process holds the session lease (SessionBusyError: shut it down
    first) or starts the session (SessionStartingError, a SessionBusyError: ``new``,
    ``fork`` or ``resume`` under way hold the start lock, ``registry.START_LOCK``, until the
    session process holds the lease); both are held during the removal, so no resume can
    start meanwhile. A
    dead mount a killed session process left at a per-session root is lazily unmounted; a
    live one is refused. GC: the upper is unlisted from the store's ``state_dirs`` before
    it is deleted, so what it alone pinned becomes collectable and GC never meets a listed
    directory that is gone. The journal stays in the store (it is append-only history, and
    its Refs stay live like every listed snapshot). Fixed roots (exclusive, shared) and a
    shared root's upper are never touched.

    Order, each step safe if the process dies after it: the record goes first (durably:
    the session no longer exists), then the ``state_dirs`` row, then the files. A removal
    that died part-way is finished by calling this again.

    Raises SessionNotFoundError (neither a record nor a state directory), SessionBusyError,
    SessionError (a live mount at the root)."""
    from fusefs.mounts import is_mounted
    from store.errors import LeaseBusyError

    from .fusetree import UPPER, clear_dead_mounts, unregister_state_dir
    from .registry import RECORD
    from .runtime import holder_id

    state_dir = registry.state_dir(session_id)
    with registry.starting(session_id, wait=False):  # SessionStartingError while one starts
        try:
            rec: SessionRecord | None = registry.load(session_id)
        except SessionNotFoundError:
            rec = None
        try:
            lease = leaser.acquire(f"session/{session_id}", holder_id(), ttl_s)
        except LeaseBusyError as e:
            from .errors import SessionBusyError

            wait = None if e.expires_ns is None else max(
                0.0, (e.expires_ns - leaser.now_ns()) / 1e9)
            raise SessionBusyError(session_id, e.epoch, e.holder, wait) from None
        try:
            root = rec.root if rec is not None and rec.mode == Mode.PER_SESSION.value else None
            if root is not None and is_mounted(root):
                clear_dead_mounts(root)
            if rec is not None:
                os.unlink(os.path.join(state_dir, RECORD))
                _fsync_dir(state_dir)
            if rec is None or rec.mode != Mode.SHARED.value:
                unregister_state_dir(store, os.path.join(state_dir, UPPER))
            moves.forget(store, session_id, lease.epoch)  # the catalog's row, if this host's
            force_rmtree(state_dir)
            if root is not None:
                force_rmtree(root)
        finally:
            leaser.release(lease)
    return rec


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Workspace:
    """Sessions under one validated ``WorkspaceConfig``."""

    def __init__(self, config: WorkspaceConfig, backend: SessionBackend | None = None) -> None:
        self.config = config
        self.store: Any = config.placement.store if config.placement is not None else None
        self.registry = Registry(config.state_base) if config.state_base else None
        self._backend = backend
        self._open: dict[str, Session] = {}
        self._lock = threading.Lock()

    @property
    def backend(self) -> SessionBackend:
        if self._backend is None:
            self._backend = select_backend(self.config)
        return self._backend

    def _is_open(self, s: Session) -> bool:
        with self._lock:
            return self._open.get(s.id) is s

    def _closed(self, s: Session) -> None:
        with self._lock:
            if self._open.get(s.id) is s:
                del self._open[s.id]

    def _remember(self, s: Session) -> Session:
        with self._lock:
            self._open[s.id] = s
        return s

    def sessions(self) -> list[SessionRecord]:
        """Every registered session of this store, oldest first."""
        return self.registry.list() if self.registry is not None else []

    def remove_session(self, session_id: str) -> SessionRecord | None:
        """Delete a stopped session (``remove_session``; its journal stays). Raises
        SessionNotFoundError, SessionBusyError (it runs: shut it down first)."""
        if self.registry is None or self.config.placement is None:
            raise SessionNotFoundError(session_id)
        with self._lock:
            if session_id in self._open:
                from .errors import SessionBusyError

                raise SessionBusyError(session_id, self._open[session_id].epoch)
        return remove_session(self.store, self.registry, session_id, self.config.leaser,
                              self.config.lease_ttl_s)

    def log(self, session_id: str) -> list[JournalEvent]:
        """The journal of ``session_id``, oldest first. Raises SessionNotFoundError."""
        if self.registry is None or not self.registry.exists(session_id):
            raise SessionNotFoundError(session_id)
        return Journal(self.store, session_id).events()

    # -- seeds ----------------------------------------------------------------------------

    def _seed_ref(self, seed: Ref | str | os.PathLike[str]) -> Ref:
        from store.snapshot import snapshot

        if isinstance(seed, Ref):
            ref = seed
        elif isinstance(seed, str) and seed.startswith("v1:"):
            ref = Ref.parse(seed)
        else:
            path = os.fspath(seed)
            if not os.path.isdir(path):
                raise SeedError(f"{path!r} is neither a Ref nor a directory")
            return snapshot(self.store, path, origin="seed")
        self.store.root_tree(ref)  # RefNotFoundError before anything is created
        return ref

    # -- opening --------------------------------------------------------------------------

    def new_session(self, seed: Ref | str | os.PathLike[str] | None = None, *,
                    parent: str | None = None) -> Session:
        """Start a session, seeded from ``seed`` (a Ref or a directory) or adopting what the
        root holds; its first journal event is ``WorkspaceCheckpointed{trigger=seed}``.

        Raises SeedError, WorkspaceRootBusyError, the store's errors for a missing seed, and
        whatever opening the live tree raises; nothing stays registered on failure."""
        cfg = self.config
        if cfg.placement is None or self.registry is None:
            if seed is not None:
                raise WorkspaceNotConfiguredError("seed")
            rec = SessionRecord(new_session_id(), None, None, None, "", "none",
                                time.time_ns(), parent)
            return Session(self, rec, None)
        if seed is not None and cfg.placement.mode is Mode.SHARED:
            raise SeedError("a shared root cannot be seeded")
        seed_ref = self._seed_ref(seed) if seed is not None else None
        backend = self.backend
        sid = new_session_id()
        rec = SessionRecord(sid, cfg.placement.fingerprint, cfg.placement.mode.value,
                            cfg.placement.root_for(sid), self.registry.state_dir(sid),
                            backend.name, time.time_ns(), parent)
        # The start lock, held until the session process holds the lease, keeps a
        # concurrent `session gc --stopped` from deleting the session while it starts.
        with self.registry.creating(rec):
            try:
                handle = backend.open_new(cfg, rec, seed_ref)
            except BaseException:
                force_rmtree(rec.state_dir)
                if cfg.placement.mode is Mode.PER_SESSION and rec.root is not None:
                    force_rmtree(rec.root)
                raise
        return self._remember(Session(self, rec, handle))

    def resume_session(self, session_id: str, *, discard_upper: bool = False) -> Session:
        """Open a registered session again after its process ended: its live tree with its
        un-checkpointed changes, after recovering an interrupted restore (CONTRACT 4.6).

        On a shared store, a session another host ran last moves here (``moves.py``) when
        that host stopped it holding no un-checkpointed change (``shutdown(checkpoint=
        True)``): it serves its last checkpoint, the same tree. ``discard_upper``: move it
        even though the other host's upper may hold changes (they are given up).

        Raises SessionNotFoundError, PlacementDriftError (another placement than the one it
        was created under), SessionBusyError (another process holds it),
        SessionChangesElsewhereError (another host may hold changes of it),
        WorkspaceRootBusyError."""
        cfg = self.config
        if cfg.placement is None or self.registry is None:
            raise SessionNotFoundError(session_id)
        away = moves.elsewhere(self.store, session_id)
        if away is not None:
            return self._move_in(away, discard_upper)
        with self.registry.starting(session_id):  # no removal meanwhile (see new_session)
            rec = self.registry.load(session_id)
            cfg.placement.check_drift(session_id, rec.fingerprint or "")
            backend = self.backend
            if rec.backend != backend.name:
                raise SessionError(f"session {session_id} runs on the {rec.backend} "
                                   f"backend, not {backend.name}")
            handle = backend.open_existing(cfg, rec)
        return self._remember(Session(self, rec, handle))

    def _move_in(self, away: moves.SessionEntry, discard_upper: bool) -> Session:
        """Open session ``away``, registered by another host, here (``moves.py``): a fresh
        state directory (a stale one of an earlier stay here is dropped first) under this
        workspace's per-session placement, with no upper, over its last checkpoint."""
        from .errors import SessionError
        from .registry import START_LOCK

        cfg = self.config
        assert cfg.placement is not None and self.registry is not None
        moves.check_move_in(cfg.leaser, away, discard_upper=discard_upper)
        if cfg.placement.mode is not Mode.PER_SESSION:
            raise SessionError(f"session {away.id} moves to a per-session placement only, "
                               f"not {cfg.placement.mode.value}")
        backend = self.backend
        sid = away.id
        rec = SessionRecord(sid, cfg.placement.fingerprint, cfg.placement.mode.value,
                            cfg.placement.root_for(sid), self.registry.state_dir(sid),
                            backend.name, away.created_ns, away.parent)
        if not os.path.isdir(rec.state_dir):
            with self.registry.creating(rec):
                try:
                    handle = backend.open_existing(cfg, rec)
                except BaseException:
                    force_rmtree(rec.state_dir)
                    if rec.root is not None:
                        force_rmtree(rec.root)
                    raise
            return self._remember(Session(self, rec, handle))
        with self.registry.starting(sid):
            self._drop_stale(rec, keep=START_LOCK)
            handle = backend.open_existing(cfg, rec)
        return self._remember(Session(self, rec, handle))

    def _drop_stale(self, rec: SessionRecord, keep: str) -> None:
        """Drop this host's stale state of session ``rec.id`` (it ran on another host
        since): its old per-session root, its upper (unlisted from ``state_dirs`` first)
        and every file of its state directory but ``keep``; then write ``rec``."""
        from .fusetree import UPPER, clear_dead_mounts, unregister_state_dir
        from .registry import RECORD, write_json_atomic

        assert self.registry is not None
        try:
            old: SessionRecord | None = self.registry.load(rec.id)
        except SessionNotFoundError:
            old = None
        for root in {r.root for r in (old, rec) if r is not None and r.root
                     and r.mode == Mode.PER_SESSION.value}:
            clear_dead_mounts(root)
            force_rmtree(root)
        unregister_state_dir(self.store, os.path.join(rec.state_dir, UPPER))
        for name in os.listdir(rec.state_dir):
            if name != keep:
                force_rmtree(os.path.join(rec.state_dir, name))
        write_json_atomic(os.path.join(rec.state_dir, RECORD), asdict(rec))

    def fork_session(self, id_or_ref: str | Ref) -> Session:
        """Start a session from another session's current state (checkpointed there with
        trigger ``fork``) or from a Ref. Copies no file content into the store.

        A session another host of a shared store ran last is forked from its last
        checkpoint when that host stopped it holding no un-checkpointed change
        (``moves.py``); nothing is journaled in it then.

        Raises InvalidRefError/SessionNotFoundError for an unknown source, SessionBusyError
        if the source session is live in another process, SessionChangesElsewhereError
        (another host may hold changes of it), and ``new_session``'s errors."""
        if isinstance(id_or_ref, Ref) or str(id_or_ref).startswith("v1:"):
            ref = Ref.parse(id_or_ref)
            return self.new_session(ref, parent=str(ref))
        sid = str(id_or_ref)
        with self._lock:
            src = self._open.get(sid)
        away = moves.elsewhere(self.store, sid) if src is None else None
        if src is not None:
            ref = src._h("fork").checkpoint("fork", None)
        elif away is not None:  # another host ran it last: its last checkpoint, if clean
            ref = moves.check_move_in(self.config.leaser, away, op="fork")
        else:
            if self.registry is None or not self.registry.exists(sid):
                raise SessionNotFoundError(sid)
            other = self.resume_session(sid)
            try:
                ref = other._h("fork").checkpoint("fork", None)
            finally:
                other.shutdown()
        return self.new_session(ref, parent=sid)

