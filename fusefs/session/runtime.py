"""The session runtime: one live session's leases, permits, journal, policy and state.

This is the session process's side of CONTRACT 4 and knows nothing of FUSE: it runs inside
the caller for the no-FUSE fallback and inside the mount daemon for FUSE sessions, over a
``LiveTree`` that does the file work.

Lifecycle: ``open_new`` / ``open_existing`` take the session lease, then (exclusive
placement) the root lease, recover an interrupted restore, and for a new session seed or
adopt the tree and journal ``WorkspaceCheckpointed{trigger=seed}`` first of all. A renewer
thread renews both leases every third of their ttl; a lost lease faults the session
terminally. ``shutdown`` stops checkpoint work, closes the tree, releases the root lease,
then the session lease, and makes no checkpoint (CONTRACT 4.9).

Permits: mutations (tools, agent commands) hold a shared write permit; checkpoint and
restore take the exclusive permit, which pauses admission of new write permits and waits
up to a timeout for held ones to end.

Faults: terminal (lost lease, failed rollback) refuse everything but shutdown; a latched
fault (a failed required checkpoint, a failed journal append after a restore) refuses
restore and policy events until a successful manual checkpoint clears it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

from store.errors import LeaseBusyError, LeaseLostError
from store.ref import Ref

from . import moves
from .config import WorkspaceConfig
from .errors import (
    CheckpointError,
    RestoreError,
    SeedError,
    SessionBusyError,
    SessionClosedError,
    SessionFaultedError,
    WorkspaceRootBusyError,
)
from .journal import GroupCommit, Journal, JournalError
from .live import LiveTree
from .placement import Mode
from .policy import PolicyRunner
from .registry import SessionRecord

log = logging.getLogger("rewindfs.session")

OPEN = "open"
CLOSING = "closing"
CLOSED = "closed"


class PermitGate:
    """Shared write permits and one exclusive permit, preferring the exclusive waiter."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._writers = 0
        self._exclusive = False
        self._waiting = 0

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """Hold a write permit; waits while a checkpoint or restore runs or waits."""
        with self._cv:
            while self._exclusive or self._waiting:
                self._cv.wait()
            self._writers += 1
        try:
            yield
        finally:
            with self._cv:
                self._writers -= 1
                self._cv.notify_all()

    def acquire_exclusive(self, timeout_s: float) -> bool:
        """Pause admission and wait up to ``timeout_s`` for writers to end; False on timeout
        (admission resumes)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._waiting += 1
            try:
                while self._exclusive or self._writers:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(left)
                self._exclusive = True
                return True
            finally:
                self._waiting -= 1
                self._cv.notify_all()

    def release_exclusive(self) -> None:
        with self._cv:
            self._exclusive = False
            self._cv.notify_all()


def holder_id() -> str:
    """A lease holder id unique to this process and runtime: ``host:pid:nonce``."""
    from store.lease import holder_name

    return holder_name(os.getpid(), secrets.token_hex(4))


class SessionCore:
    """One live session: ``record`` (registered), ``tree`` (its live tree) under ``cfg``."""

    def __init__(self, cfg: WorkspaceConfig, record: SessionRecord, tree: LiveTree) -> None:
        assert cfg.placement is not None and cfg.policy is not None
        self.cfg = cfg
        self.placement = cfg.placement
        self.record = record
        self.id = record.id
        self.tree = tree
        self.store: Any = cfg.store if cfg.store is not None else cfg.placement.store
        self.journal = Journal(self.store, record.id)
        self.barrier = GroupCommit(self.store.backend)  # of the steps' records
        self.gate = PermitGate()
        self._background = 0                  # background writers running (no permit)
        self._background_lock = threading.Lock()
        self.policy = PolicyRunner(cfg.policy, self._policy_checkpoint, record.id)
        self.state = OPEN
        self.terminal_fault: str | None = None
        self.latched_fault: str | None = None
        self._holder = holder_id()
        self._leases: list[Any] = []
        self._lease_lock = threading.Lock()
        self._renewed: list[float] = []  # time.monotonic() each lease was last renewed
        self._lapsed: dict[str, str] = {}  # lease name -> why it lapsed (_renew_loop)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._op_lock = threading.Lock()  # one checkpoint or restore at a time
        self._step_lock = threading.Lock()  # steps are numbered in the order they close
        # The last checkpoint was a shutdown's and no mutation was seen since (moves.py)
        self._shutdown_checkpointed = False
        # The registry row found when the session was opened here (``moves.row``), put back
        # if it closes before its tree ever served (``_put_back``).
        self._row_before: tuple[str, str] | None = None

    # -- leases (CONTRACT 4.2) ----------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The session lease epoch stamped on every journal event."""
        return int(self._leases[0].epoch) if self._leases else 0

    def _acquire_leases(self) -> None:
        leaser = self.cfg.leaser
        ttl = self.cfg.lease_ttl_s
        try:
            self._leases.append(leaser.acquire(f"session/{self.id}", self._holder, ttl))
        except LeaseBusyError as e:
            wait = (None if e.expires_ns is None
                    else max(0.0, (e.expires_ns - time.time_ns()) / 1e9))
            raise SessionBusyError(self.id, e.epoch, e.holder, wait) from None
        if self.placement.mode is Mode.EXCLUSIVE:
            assert self.placement.lease_name is not None
            try:
                self._leases.append(self.placement.leaser.acquire(
                    self.placement.lease_name, self._holder, ttl))
            except LeaseBusyError as e:
                self._release_leases()
                raise WorkspaceRootBusyError(self.placement.path, e.epoch) from None
        self._renewer = threading.Thread(target=self._renew_loop, name=f"lease-{self.id}",
                                         daemon=True)
        self._renewer.start()

    def _leaser_of(self, i: int) -> Any:
        return self.cfg.leaser if i == 0 else self.placement.leaser

    def _renew_loop(self) -> None:
        """Renew every lease at a third of its time to live. A renewal that fails for any
        reason but a lost lease (a busy index, a catalog that cannot be reached) is tried
        again at the next tick; a lease not renewed for a whole time to live (the catalog's
        copy has expired by then, wherever its clock is) is lapsed: ``fault`` says so and
        checkpoints, steps and restores wait for its renewal. The first renewal that reaches
        the catalog again (this loop's or ``leases_healthy``'s) renews it if it is still this
        holder's at its epoch (``Leaser.renew``: compare-and-set on holder and epoch) and
        clears the lapse; only a lease seen lost (taken over: its epoch moved, or released)
        faults the session terminally."""
        ttl = self.cfg.lease_ttl_s
        self._renewed = [time.monotonic()] * len(self._leases)
        while not self._stop.wait(ttl / 3):
            with self._lease_lock:
                for i, lease in enumerate(list(self._leases)):
                    try:
                        self._renew_one(i)
                    except LeaseLostError:
                        return
                    except Exception as e:
                        log.warning("session %s: renewing %s failed: %s", self.id, lease.name, e)
                        if (time.monotonic() - self._renewed[i] >= ttl
                                and lease.name not in self._lapsed):
                            self._lapsed[lease.name] = (
                                f"lease {lease.name} not renewed for {ttl:g} s ({e}); "
                                "renewed when the catalog answers unless another holder "
                                "took it over")
                            log.warning("session %s: %s", self.id, self._lapsed[lease.name])

    def _renew_one(self, i: int) -> None:
        """Renew lease ``i`` (``_lease_lock`` held) and clear its lapse. Raises
        LeaseLostError (after faulting the session terminally) if another holder took it
        over or it was released, and the catalog's errors if it cannot be reached."""
        lease = self._leases[i]
        asked = time.monotonic()  # before the catalog stamps the new expiry
        try:
            self._leases[i] = self._leaser_of(i).renew(lease, self.cfg.lease_ttl_s)
        except LeaseLostError:
            self._fault_terminal(f"lease {lease.name} lost (epoch {lease.epoch})")
            raise
        if i < len(self._renewed):
            self._renewed[i] = asked
        if self._lapsed.pop(lease.name, None) is not None:
            log.warning("session %s: lease %s renewed at epoch %d after it lapsed", self.id,
                        lease.name, lease.epoch)

    def leases_healthy(self) -> bool:
        """True if every lease is held. A lease the catalog shows expired (a renewal could
        not reach it for a whole time to live) is renewed here first if it is still this
        holder's at its epoch; one taken over faults the session terminally (False).
        False once the leases are released (or before they are taken): no lease, nothing
        held. Raises the catalog's errors if it cannot be reached."""
        with self._lease_lock:
            if not self._leases:
                return False
            for i, lease in enumerate(self._leases):
                if lease.name not in self._lapsed and self._leaser_of(i).held(lease):
                    continue
                try:
                    self._renew_one(i)
                except LeaseLostError:
                    return False
            return True

    def _release_leases(self) -> None:
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join()
        with self._lease_lock:
            # Root lease first, then the session lease (CONTRACT 4.9).
            for i in reversed(range(len(self._leases))):
                try:
                    self._leaser_of(i).release(self._leases[i])
                except Exception as e:
                    log.warning("session %s: releasing %s failed: %s", self.id,
                                self._leases[i].name, e)
            self._leases.clear()

    def _fault_terminal(self, cause: str) -> None:
        if self.terminal_fault is None:
            self.terminal_fault = cause
            log.error("session %s faulted: %s", self.id, cause)

    # -- opening -------------------------------------------------------------------------

    def open_new(self, seed: Ref | None, seeded_by_fork: bool = False) -> Ref:
        """Take the leases, check the seed rules (CONTRACT 4.4), seed or adopt the tree and
        journal the seed event. Returns the seed Ref. On failure the leases are released."""
        self._acquire_leases()
        try:
            self.tree.recover(self._roll_forward)
            empty = self.tree.is_empty()
            if seed is not None and self.placement.mode is Mode.SHARED:
                raise SeedError("a shared root cannot be seeded")
            if seed is not None and not empty:
                raise SeedError(f"the root {self.tree.root} is not empty; it would be adopted, "
                                "so it cannot also be seeded")
            with self._exclusive(self.policy.policy.timeout_s, "seed"):
                if seed is None:
                    ref = self.tree.capture("seed")  # adopt what is there (maybe nothing)
                else:
                    self.tree.install(seed)
                    ref = seed
                self.journal.checkpointed(ref, "seed", self.tree.consistency, self.epoch)
            self._publish(moves.RUNNING, ref)
        except BaseException:
            self._release_leases()
            raise
        self.policy.start()
        return ref

    def open_existing(self) -> Ref | None:
        """Take the leases and recover an interrupted restore; returns the restore pointer.
        The live tree (with its un-checkpointed changes) is kept as it is."""
        self._acquire_leases()
        try:
            before = None
            if moves.shared(self.store):
                # Registered first, at this epoch: a restore the recovery journals is then
                # this holder's, not a later one's (moves.superseded), even if this process
                # ends before it serves.
                before = self.journal.restore_pointer()
                self._row_before = moves.row(self.store, self.id)
                self._publish(moves.RUNNING, before)
            self.tree.recover(self._roll_forward)
            pointer = self.journal.restore_pointer()
            if pointer is not None and self.tree.is_empty() and not os.path.isdir(
                    self.tree.root):
                self.tree.install(pointer)  # the root was removed while closed
            if pointer != before:
                self._publish(moves.RUNNING, pointer)
        except BaseException:
            self._release_leases()
            raise
        self.policy.start()
        return pointer

    def _roll_forward(self, ref: Ref, seq_before: int) -> bool:
        if self.journal.last_seq() != seq_before:
            return True
        try:
            self.journal.restored(ref, self.epoch)
        except Exception as e:
            log.warning("session %s: cannot journal the interrupted restore: %s", self.id, e)
            return False
        return True

    # -- permits ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def write_permit(self) -> Iterator[None]:
        """Hold a write permit for a mutation; when it ends the idle timer restarts."""
        self._check_usable()
        self._shutdown_checkpointed = False
        with self.gate.write():
            yield
        self.policy.mutated()

    @contextlib.contextmanager
    def background_writer(self) -> Iterator[None]:
        """Mark a command that may write the root without a write permit (a background Bash
        command) for as long as the block runs: checkpoints never wait for it, and those
        of a tree whose writes bypass the session (``writes_unseen``: the no-FUSE
        fallback's plain directory) taken meanwhile are journaled ``fuzzy``."""
        self._check_usable()
        self._shutdown_checkpointed = False
        with self._background_lock:
            self._background += 1
        try:
            yield
        finally:
            with self._background_lock:
                self._background -= 1
            self.policy.mutated()

    def _consistency(self) -> str:
        """What a checkpoint taken now promises (CONTRACT 4.5)."""
        with self._background_lock:
            busy = self._background > 0
        if busy and getattr(self.tree, "writes_unseen", False):
            return "fuzzy"
        return str(self.tree.consistency)

    def mutated(self) -> None:
        """A mutation happened outside any permit (restarts the idle timer)."""
        self._shutdown_checkpointed = False
        self.policy.mutated()

    @contextlib.contextmanager
    def _exclusive(self, timeout_s: float, what: str) -> Iterator[None]:
        with self._op_lock:
            if not self.gate.acquire_exclusive(timeout_s):
                raise CheckpointError(what, f"writers did not finish within {timeout_s} s")
            try:
                yield
            finally:
                self.gate.release_exclusive()

    def _check_usable(self) -> None:
        if self.state != OPEN:
            raise SessionClosedError(self.id)
        if self.terminal_fault is not None:
            raise SessionFaultedError(self.id, self.terminal_fault, terminal=True)

    # -- checkpoint (CONTRACT 4.3, 4.5) ------------------------------------------------------

    def checkpoint(self, trigger: str = "manual", timeout_s: float | None = None,
                   label: str | None = None) -> Ref:
        """Freeze the live tree, journal ``WorkspaceCheckpointed{ref, consistency, trigger}``
        (with ``label``, this checkpoint's own) and return the Ref. A manual success clears a latched fault.

        Raises SessionClosedError, SessionFaultedError (terminal), CheckpointError (writers
        did not finish within ``timeout_s``, default the policy timeout, or the snapshot
        failed; nothing journaled)."""
        self._check_usable()
        timeout = self.policy.policy.timeout_s if timeout_s is None else timeout_s
        with self._exclusive(timeout, trigger):
            try:
                ref = self.tree.capture("checkpoint")
            except Exception as e:
                raise CheckpointError(trigger, e) from e
            if not self.leases_healthy():
                self._check_usable()  # taken over just now: terminally faulted
                raise CheckpointError(trigger, "the session lease is not held")
            self.journal.checkpointed(ref, trigger, self._consistency(), self.epoch, label)
            if label:
                from .api import label_snapshot

                label_snapshot(self.store, ref, label)
            self._shutdown_checkpointed = trigger == "shutdown"
        if trigger == "manual":
            self.latched_fault = None
            self.policy.manual_succeeded()
        return ref

    def _policy_checkpoint(self, trigger: str, timeout_s: float) -> object:
        return self.checkpoint(trigger, timeout_s)

    def turn_done(self, label: str | None = None) -> dict[str, Any] | None:
        """Record a step (label default ``turn``), then the on_turn_done policy."""
        self._check_usable()
        rec = self.record_step("turn" if label is None else label)
        self.policy.turn_done()
        return rec

    def step_done(self, label: str | None = None) -> dict[str, Any] | None:
        """Record a step (``record_step``), then the on_step_done policy."""
        self._check_usable()
        rec = self.record_step(label)
        self.policy.step_done()
        return rec

    def record_step(self, label: str | None = None) -> dict[str, Any] | None:
        """Journal ``WorkspaceStep`` with the paths changed since the previous step (issue
        14.1), whether or not anything changed; returns ``{"seq", "step", "label",
        "changes", "elapsed_ms"}`` (elapsed: the daemon's part plus the append), or None
        for a live tree that keeps no step log (the fallback backend). Raises
        SessionClosedError, SessionFaultedError, JournalError (the changes are then kept
        for the next step)."""
        self._check_usable()
        step = getattr(self.tree, "step", None)
        if step is None:
            return None
        t0 = time.perf_counter()
        with self._step_lock:
            out = step()
            try:
                if not self.leases_healthy():
                    raise JournalError(self.id, "the session lease is not held")
                seq, n = self.journal.step(Ref.parse(out["base"]), label, out["changes"],
                                           out["fingerprints"], self.epoch, durable=False)
            except BaseException:
                self.tree.unstep(out["changes"])  # type: ignore[attr-defined]
                raise
            self.barrier.due()  # durable against a power loss soon (GroupCommit)
        return {"seq": seq, "step": n, "label": label, "changes": out["changes"],
                "elapsed_ms": (time.perf_counter() - t0) * 1000,
                "daemon_ms": out["elapsed_ms"]}

    @property
    def fault(self) -> str | None:
        return (self.terminal_fault or self.latched_fault or self.policy.fault
                or next(iter(self._lapsed.values()), None))

    # -- restore (CONTRACT 3.2, 4.7, 4.8) ------------------------------------------------

    def restore(self, ref: Ref, discard: bool = False, timeout_s: float | None = None,
                cancel: threading.Event | None = None,
                wait_writers_s: float | None = None,
                paths: list[str] | None = None) -> Ref | None:
        """Make the live tree ``ref``, journaling ``WorkspaceRestored{ref}``. Unless
        ``discard``, the current state is checkpointed first (trigger pre_restore) and that
        Ref returned, so the restore can be undone. With ``paths``, only those paths
        (relative to the root) are made ``ref``'s; the journal then names the tree that
        made, with the paths and ``ref`` as its source (``Journal.restored``).

        Raises RestoreError (kinds of CONTRACT 4.8) and the store's errors for a target
        that is not complete in the store (ObjectNotFoundError, IntegrityError).
        ``timeout_s`` bounds the wait for write permits; ``wait_writers_s`` (a live tree
        only) the wait for files open for writing (``Session.restore``)."""
        sref = str(ref)
        if cancel is not None and cancel.is_set():
            raise RestoreError(RestoreError.CONTEXT_DONE, sref, "cancelled before start")
        if self.state != OPEN:
            raise RestoreError(RestoreError.CLOSING, sref)
        if self._lapsed and self.terminal_fault is None:
            try:
                self.leases_healthy()  # the catalog back: renew a lapsed lease first
            except Exception as e:
                log.warning("session %s: renewing a lapsed lease failed: %s", self.id, e)
        if self.fault is not None:
            raise RestoreError(RestoreError.FAULTED, sref, self.fault)
        timeout = self.policy.policy.timeout_s if timeout_s is None else timeout_s
        with self._op_lock:
            if not self.gate.acquire_exclusive(timeout):
                raise RestoreError(RestoreError.PERMIT_FAILED, sref,
                                   f"writers did not finish within {timeout} s")
            try:
                return self._restore_locked(ref, discard, cancel, timeout, wait_writers_s,
                                            paths)
            finally:
                self.gate.release_exclusive()

    def _restore_locked(self, ref: Ref, discard: bool, cancel: threading.Event | None,
                        timeout_s: float, wait_writers_s: float | None = None,
                        paths: list[str] | None = None) -> Ref | None:
        sref = str(ref)
        if cancel is not None and cancel.is_set():
            raise RestoreError(RestoreError.CONTEXT_DONE, sref, "cancelled")
        if not self.leases_healthy():
            raise RestoreError(RestoreError.LEASE_UNHEALTHY, sref)
        restore_live = getattr(self.tree, "restore_live", None)
        if restore_live is not None:
            return self._restore_live(ref, discard, restore_live, timeout_s, wait_writers_s,
                                      paths)
        wanted = None
        if paths is not None:
            from fusefs.restore import normalize_paths

            wanted = normalize_paths(paths)
            self._check_paths_plain(ref, wanted)
        pre = None
        if not discard or wanted is not None:
            try:
                # A path restore on a plain directory takes its target from the tree as it
                # is, so it captures it also with ``discard`` (then not journaled).
                pre = self.tree.capture("checkpoint")
            except Exception as e:
                raise RestoreError.because(RestoreError.SWAP_FAILED, sref,
                                           "pre-restore checkpoint failed", e) from e
            if not discard:
                self.journal.checkpointed(pre, "pre_restore", self._consistency(),
                                          self.epoch)
        verify_complete(self.store, ref)
        target = ref
        if wanted is not None:
            assert pre is not None
            target = self._path_target(pre, ref, wanted)
            if discard:
                pre = None

        def on_commit() -> None:
            if wanted is None:
                self.journal.restored(ref, self.epoch)
            else:
                self.journal.restored(target, self.epoch,
                                      [os.fsdecode(p) for p in wanted], ref)

        try:
            self.tree.swap(target, self.journal.last_seq(), on_commit)
        except RestoreError as e:
            if e.kind == RestoreError.ROLLBACK_FAILED:
                self._fault_terminal(f"restore rollback failed: {e.cause}")
            elif e.kind == RestoreError.APPEND_FAILED:
                self.latched_fault = f"restore of {sref} done but not journaled: {e.cause}"
            raise
        return pre

    def _check_paths_plain(self, source: Ref, wanted: list[bytes]) -> None:
        """RestoreError(path_not_found), before anything changes, for a path of a path
        restore that is in neither the plain directory root nor ``source``."""
        from fusefs.restore import _Trees

        self.store.root_tree(source)  # RefNotFoundError first
        src = _Trees(self.store, source.tree_id)
        root = os.fsencode(str(getattr(self.tree, "root", "")))
        for p in wanted:
            if src.entry(p) is None and not os.path.lexists(os.path.join(root, p)):
                raise RestoreError(RestoreError.PATH_NOT_FOUND, str(source),
                                   f"{os.fsdecode(p)!r} is in neither the live tree nor "
                                   f"{source}")

    def _path_target(self, base: Ref, source: Ref, wanted: list[bytes]) -> Ref:
        """The tree of a path restore on a plain directory: ``base`` (the captured root)
        with ``wanted`` from ``source``."""
        from fusefs.restore import path_target

        return path_target(self.store, base, source, wanted)

    def _restore_live(self, ref: Ref, discard: bool, restore_live: Any,
                      timeout_s: float, wait_writers_s: float | None,
                      paths: list[str] | None = None) -> Ref | None:
        """A tree that restores inside its daemon (FUSE): the daemon pauses, checkpoints,
        verifies and swaps in the order of CONTRACT 3.2; the journal appends happen from
        its hooks, the pre-restore checkpoint before the swap and ``WorkspaceRestored``
        right after it."""
        sref = str(ref)
        self.store.root_tree(ref)  # RefNotFoundError before anything changes
        pres: list[Ref] = []

        def on_pre(pre: Ref) -> None:
            self.journal.checkpointed(pre, "pre_restore", self.tree.consistency, self.epoch)
            pres.append(pre)

        def on_commit(done: Ref | None = None, wanted: list[str] | None = None) -> None:
            if wanted is None:
                self.journal.restored(ref, self.epoch)
            else:  # a path restore: ``done`` is the tree it made
                self.journal.restored(done or ref, self.epoch, wanted, ref)

        try:
            restore_live(ref, discard, timeout_s, None if discard else on_pre, on_commit,
                         wait_writers_s, paths)
        except RestoreError as e:
            if e.kind == RestoreError.ROLLBACK_FAILED:
                self._fault_terminal(f"restore rollback failed: {e.cause}")
            elif e.kind == RestoreError.APPEND_FAILED:
                self.latched_fault = f"restore of {sref} done but not journaled: {e.cause}"
            raise
        except Exception as e:
            raise RestoreError(RestoreError.SWAP_FAILED, sref, e) from e
        return pres[0] if pres else None

    # -- shutdown (CONTRACT 4.9) ---------------------------------------------------------

    def shutdown(self) -> None:
        """Stop checkpoint work, close the tree, release the root lease, then the session
        lease. Idempotent. No checkpoint is made."""
        if self.state == CLOSED:
            return
        self.state = CLOSING
        self.policy.stop()
        with self._op_lock:
            if self.state == CLOSED:  # a concurrent shutdown (its request, the host's stop)
                return
            try:
                self.barrier.close()
                self.tree.close()
                if moves.shared(self.store):
                    if self._unserved():
                        self._put_back()
                    else:
                        self._publish_stopped()
            finally:
                self._release_leases()
                self.state = CLOSED

    # -- the shared catalog's session registry (fusefs/session/moves.py) ---------------

    def _publish(self, state: str, head: Ref | None, dirty: bool | None = None) -> None:
        """Register this session as this host's in ``state`` (shared catalogs only)."""
        if not moves.shared(self.store):
            return
        from .host import spec_of

        moves.publish(self.store, self.id, state, head=head, dirty=dirty,
                      mode=self.record.mode, parent=self.record.parent,
                      created_ns=self.record.created_ns, epoch=self.epoch,
                      spec=spec_of(self.cfg, self.record.backend))

    def _unserved(self) -> bool:
        """True if this session was resumed here and its tree never served (a mount that
        failed before it did: a store that cannot be read, a refused mount)."""
        return self._row_before is not None and getattr(self.tree, "served", True) is False

    def _put_back(self) -> None:
        """At shutdown of a session that never served here: its row as it was found, so
        that no host takes this one for the session's (nothing of it changed here). A
        failure is logged, as ``_publish_stopped``'s."""
        try:
            moves.put_back(self.store, self.id, self._row_before, self.epoch)
            log.info("session %s: never served here; its registry row is put back", self.id)
        except Exception as e:
            log.error("session %s: putting its registry row back failed: %s: %s",
                      self.id, type(e).__name__, e)

    def _publish_stopped(self) -> None:
        """At shutdown, the tree closed, the leases still held: ``stopped`` with the restore
        pointer and whether the upper still holds un-checkpointed changes (the tree's
        ``holds_changes(pointer)``; None where it cannot tell). A failure is logged: the
        row then still says ``running``, which other hosts treat as changes held here.
        A holder whose lease was taken over writes nothing (the row is the new holder's:
        ``moves.publish`` is fenced by the lease epoch, FencedError logged here)."""
        try:
            if not self.leases_healthy():
                log.warning("session %s: not registered as stopped: its lease is not held",
                            self.id)
                return
            pointer = self.journal.restore_pointer()
            probe = getattr(self.tree, "holds_changes", None)
            dirty = None if probe is None else probe(pointer)
            if dirty is None and self._shutdown_checkpointed:
                dirty = False  # a tree that keeps no dirty set, checkpointed just now
            self._publish(moves.STOPPED, pointer, dirty)
        except Exception as e:
            log.error("session %s: registering the shutdown in the catalog failed: %s: %s",
                      self.id, type(e).__name__, e)

def verify_complete(store: Any, ref: Ref) -> None:
    """Check that every tree and chunk reachable from ``ref`` is indexed in ``store``.

    Raises ObjectNotFoundError for the first missing object."""
    from store.errors import ObjectNotFoundError
    from store.tree import Kind

    seen: set[bytes] = set()
    stack = [ref.tree_id]
    while stack:
        tid = stack.pop()
        if tid in seen:
            continue
        seen.add(tid)
        tree = store.get_tree(tid)
        for e in tree.entries:
            if e.kind is Kind.DIR and e.tree_id is not None:
                stack.append(e.tree_id)
            elif e.kind is Kind.FILE:
                for cid in e.chunks.distinct():
                    if cid not in seen:
                        if not store.has(cid):
                            raise ObjectNotFoundError(cid.hex())
                        seen.add(cid)
