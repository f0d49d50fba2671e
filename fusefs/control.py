"""The control channel of a live mount: checkpoint, restore, status and diff, in the daemon.

``Live`` runs inside the mount daemon, on its trio event loop, next to the FUSE adapter, and
does the ordering of CONTRACT 3.1 and 3.2 around the data steps of ``checkpoint.py`` and
``restore.py``; ``serve`` exposes it on a Unix socket; ``Client`` is the caller's side (the
CLI, the session runtime, tools).

Socket: in the runtime directory (``fusefs.mounts.runtime_dir``), named
``m-<hash of the state directory>.sock`` (short: socket paths are limited to 107 bytes),
mode 0600; its path is recorded in the state directory as ``control``, which is how a client
finds it from the mount point (the daemon's mount record names the state directory).
Protocol, shared with the no-FUSE session host (``fusefs.session.control``): one JSON object
per line each way; requests ``{"op": ...}``:

- ``status``: ``{ref, dirty_inodes, dirty_bytes, detached_inodes, held_lowers,
  open_handles, writable_handles, open_writers, writers_found_by, writer_pids,
  writers_unseen_processes, parked, paused, mountpoint, state, pid, requests, binding,
  affinity, no_open, kernel_inodes, quota}`` (``requests``: FUSE requests served so far by
  operation, those that reached a handler; ``binding``: ``fusefs.binding.info()``;
  ``affinity``: ``fusefs.affinity.ServingAffinity.info()``, the serving thread's CPU,
  null before the kernel's INIT;
  ``kernel_inodes``: inodes the kernel holds a lookup on. In no-open mode
  ``open_handles`` and ``writable_handles`` are 0 (no file has a handle);
  ``open_writers`` is the number of files open for writing, found by their writable
  handles (``writers_found_by`` ``handles``) or, in no-open mode, by a scan of /proc
  (``proc_scan``, ``fusefs.writers``: ``writer_pids`` holds them,
  ``writers_unseen_processes`` counts the processes the daemon may not inspect, whose
  writers are not seen))
- ``checkpoint {label?, trigger?, timeout_s?}``: ``{ref, elapsed_ms, unchanged, packs,
  bytes}``
- ``restore {ref, discard?, timeout_s?, wait_writers_s?, paths?}``: ``{ref, pre_restore,
  changes, detached, invalidated, elapsed_ms}``; with ``paths`` (a path restore) also
  ``source`` (the Ref asked for) and ``paths`` (normalized); ``ref`` is then the tree made
  for it (``restore.path_target``)
- ``diff``: ``{base, ref, changes: [{path, status}]}`` (changes since the last checkpoint)
- ``write_permit``: replies ``{ok}`` once granted and holds the permit until the client
  closes the connection.

Replies carry ``"ok": true``; a failure is ``{"ok": false, "error": class name, "kind",
"message", "exit_code"}``. ``elapsed_ms`` is measured inside the daemon, from the request to
the end of the last step (for restore: after the kernel caches are invalidated).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from store.errors import RefNotFoundError
from store.ref import Ref
from store.tree import Kind

from . import binding
from .session.control import CONTROL_FILE, error_reply, raise_reply, request, socket_dir
from .session.errors import CheckpointError, RestoreError

if TYPE_CHECKING:
    import trio

    from store.objects import Store, Writer

    from .checkpoint import Plan
    from .gate import Gate
    from .operations import Operations
    from .writers import Scan

log = logging.getLogger("rewindfs.control")

DEFAULT_TIMEOUT_S = 60.0
MAX_LINE = 1 << 20


def socket_path_for(state_dir: str) -> str:
    """The control socket path of the mount whose state directory is ``state_dir``."""
    key = hashlib.sha256(os.path.abspath(state_dir).encode()).hexdigest()[:16]
    return os.path.join(socket_dir(), f"m-{key}.sock")


# -- daemon side ---------------------------------------------------------------------------------

class Live:
    """A live session mount as checkpoint and restore see it (event-loop side).

    ``ops`` is the FUSE adapter (its overlay, gate and upper lock); ``on_restored(ref)`` is
    called right after a restore's swap commits (the session appends ``WorkspaceRestored``
    there; if it raises, the restore fails with kind append_failed and the tree stays the
    target); ``origin`` is the snapshot-list origin of manual checkpoints.
    """

    def __init__(self, ops: Operations, store: Store, gate: Gate, *, mountpoint: str,
                 state_dir: str) -> None:
        import trio

        self.ops = ops
        self.ov = ops.ov
        self.store = store
        self.gate = gate
        self.mountpoint = mountpoint
        self.state_dir = state_dir
        self._busy = trio.Lock()  # one checkpoint or restore at a time
        self.phases: dict[str, float] = {}  # ms per step of the last checkpoint or restore
        self._t = 0.0
        self.on_restored: Callable[[Ref], None] | None = None
        # Called right after a restore's pre-restore checkpoint (the session journals it
        # there, before the swap); if it raises, the restore fails and nothing is swapped.
        self.on_pre_restore: Callable[[Ref], None] | None = None
        self.closing = False
        # A shared store's pins of what this mount serves (store/sharedgc.py MountPins, set
        # by the mount daemon): replaced after each checkpoint and restore.
        self.mount_pins: Any = None
        self._device: str | None = None  # the mount's major:minor (the writer scan's key)
        from .steps import StepTracker

        self.steps = StepTracker(ops.ov)  # the step change log's state (fusefs/steps.py)

    # -- helpers ---------------------------------------------------------------------------

    async def _syncfs(self) -> None:
        """Flush the kernel's dirty pages of the mount (worker threads; before pausing, as
        the WRITEs this causes pass the gate): a syncfs(2), then ``launder`` of every file
        of the mount some process holds mapped shared and writable (``writers.mapped``),
        since syncfs does not wait until a FUSE mount's writeback has reached the daemon
        (README: Limits)."""
        import trio

        from . import writers
        from .overlay import syncfs

        try:
            await trio.to_thread.run_sync(syncfs, self.mountpoint)
        except OSError as e:
            log.warning("syncfs of %s failed: %s", self.mountpoint, e)
        device = self._mount_device()
        if device is None:
            return
        try:
            inodes, _ = await trio.to_thread.run_sync(writers.mapped, device)
        except OSError as e:
            log.warning("finding the mapped files of %s failed: %s", self.mountpoint, e)
            return
        if inodes:
            await trio.to_thread.run_sync(launder, sorted(inodes))

    def _mount_device(self) -> str | None:
        """The mount's ``major:minor`` (found once; None while not mounted)."""
        if self._device is None:
            from .mounts import mount_device

            self._device = mount_device(self.mountpoint)
        return self._device

    def _listed(self, ref: Ref) -> bool:
        return self.store.catalog.snapshot(str(ref)) is not None

    async def _upload_ahead(self, p: Plan, w: Writer) -> None:
        """A shared store's checkpoint, before it pauses anything: hash the changes planned
        in ``p`` (the overlay as it was, mutations going on) and upload them through ``w``,
        committed (indexed, in no snapshot). The paused freeze that follows then finds
        those chunks and trees stored and uploads only what changed meanwhile: the time
        mutations wait holds no upload of what was there before.

        A speculative pass: whatever it uploaded that the freeze does not use is left
        unreferenced (GC removes it). Raises the store's error (BackendError, a catalog
        error) when the upload fails: the checkpoint fails then, nothing paused. Any other
        failure (the overlay changed under the build: a data file removed meanwhile) is
        logged and leaves the work to the freeze."""
        import trio

        from store.errors import StoreError

        from . import checkpoint as ck

        store = self.store
        log.info("checkpoint: uploading %d changed directories ahead of the pause",
                 len(p.dirs))

        def work() -> None:
            ck.build(p, store, w)
            w.commit()

        try:
            await trio.to_thread.run_sync(work)
        except StoreError:
            raise
        except Exception as e:
            log.info("checkpoint: upload ahead stopped (%s: %s); the freeze does it",
                     type(e).__name__, e)

    @asynccontextmanager
    async def _ahead(self, wanted: bool,
                     fail: Callable[[Exception], Exception]) -> AsyncIterator[Writer | None]:
        """For the block, on a shared store (and if ``wanted``) with changes to checkpoint:
        an open write batch with them uploaded ahead (``_upload_ahead``, then the pages
        written meanwhile flushed), to give the freeze; closed on the way out. Else None:
        the freeze writes with a batch of its own (an embedded store writes locally). An
        error opening the batch or uploading is raised as ``fail(error)``, logged, before
        anything pauses."""
        import trio

        from . import checkpoint as ck

        p: Plan | None = None
        if wanted and self.store.catalog.shared:
            try:  # the overlay as it is (this thread, atomic); a failure leaves it to the freeze
                p = ck.plan(self.ov)
            except Exception as e:
                log.info("checkpoint: no upload ahead (plan failed: %s: %s)",
                         type(e).__name__, e)
        if p is None or p.unchanged:
            yield None
            return
        try:
            writer = await trio.to_thread.run_sync(self.store.writer)
        except Exception as e:
            log.error("checkpoint failed: %s: %s", type(e).__name__, e)
            raise fail(e) from e
        try:
            try:
                await self._upload_ahead(p, writer)
            except Exception as e:
                log.error("checkpoint failed: %s: %s", type(e).__name__, e)
                raise fail(e) from e
            self._lap("upload_ahead")
            await self._syncfs()  # pages written meanwhile reach the daemon
            self._lap("syncfs_again")
            yield writer
        finally:
            # Shielded: a cancelled upload (the mount shutting down) still closes the
            # write batch, whose renewed writer pin would otherwise hold off GC for good.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(writer.close)

    async def _freeze(self, *, origin: str, label: str | None,
                      list_it: bool = True, writer: Writer | None = None) -> dict[str, Any]:
        """Freeze, commit, list and rebase; the caller has paused and drained the gate and
        holds the upper lock. ``writer``: the open write batch to commit through (the one
        that uploaded ahead; its counts include that upload), else one of its own. Returns
        what it did."""
        import trio

        from . import checkpoint as ck

        ov = self.ov
        store = self.store
        lap = self._lap
        pending = self.steps.pending() if ov.upper is not None else {}
        lap("steps")
        p = ck.plan(ov)
        lap("plan")
        if p.unchanged:
            ref = p.base
            row = self.store.catalog.snapshot(str(ref)) if list_it else None
            if list_it and row is None:
                await trio.to_thread.run_sync(store.add_snapshot, ref, origin, label)
            elif row is not None and label and label != row[3]:
                # the same Ref under a label it was not given yet: listed again with it
                # (its origin kept), so ``@label`` finds it; without a new label nothing
                # is written
                await trio.to_thread.run_sync(store.add_snapshot, ref, row[2], label)
            return {"ref": ref, "unchanged": True, "packs": 0, "bytes": 0,
                    "uppers": p.uppers, "kept": [], "rebase": None}

        def commit_in(w: Writer) -> tuple[Ref, int, int]:
            ref = ck.build(p, store, w)
            w.commit()
            ck.crash_point("checkpoint.committed")
            if list_it and (ref != p.base or not self._listed(ref)):
                store.add_snapshot(ref, origin, label)
            ck.crash_point("checkpoint.listed")
            return ref, w.packs_written, w.bytes_written

        def work() -> tuple[Ref, int, int]:
            if writer is not None:
                return commit_in(writer)
            with store.writer() as w:
                return commit_in(w)

        ref, packs, nbytes = await trio.to_thread.run_sync(work)
        lap("build_commit_list")
        # Directories with upper entries: their entries become lower ones, under other
        # readdir cookies, behind the kernel's back (see ``folded`` below).
        folded = [n.ino for n in p.uppers if n.kind is Kind.DIR]
        rb = ck.prepare(ov, p, ref)
        upper = ov.upper
        assert upper is not None
        await trio.to_thread.run_sync(ck.reset_upper, upper, rb)
        lap("reset_upper")
        ck.crash_point("checkpoint.reset")
        ck.apply(ov, p, rb)
        self.steps.reset(pending)  # carried into the next step: nothing lost
        self._forget_pending_batches()
        lap("apply")
        await trio.to_thread.run_sync(ck.drop_data, rb.drop_data)
        lap("drop_data")
        return {"ref": ref, "unchanged": ref == p.base, "packs": packs, "bytes": nbytes,
                "uppers": p.uppers, "folded": folded, "kept": p.kept, "rebase": rb}

    def _repin(self) -> None:
        """Worker thread, the upper lock held: pin what the state directory pins now (a
        shared store's mount pins, after the base changed). A failure is logged: what was
        just done is durable and its Ref listed or journaled."""
        if self.mount_pins is None:
            return
        from .session.fusetree import pinned_refs

        try:
            self.mount_pins.replace(pinned_refs(self.state_dir))
        except Exception as e:
            log.warning("re-pinning the mount's Refs in the catalog failed: %s: %s",
                        type(e).__name__, e)

    def _lap(self, name: str) -> None:
        """Record the time since the previous lap under ``name`` (ms, in ``phases``)."""
        now = time.perf_counter()
        self.phases[name] = round((now - self._t) * 1000, 3)
        self._t = now

    def _start_laps(self) -> None:
        self.phases = {}
        self._t = time.perf_counter()

    def _forget_pending_batches(self) -> None:
        """Batches that failed to write before a reset describe the old upper: drop them."""
        forget = getattr(self.ops, "forget_unwritten", None)
        if forget is not None:
            forget()

    def _writable_handles(self) -> int:
        return sum(1 for h in self.ov.handles.values() if h.writable)

    # -- open writers ----------------------------------------------------------------------

    @property
    def no_open(self) -> bool:
        """The mount serves in no-open mode (open(2) does not reach the daemon)."""
        return bool(getattr(self.ops, "no_open", False))

    def scan_writers_now(self) -> Scan | None:
        """No-open mode: the files of this mount open for writing, found by a scan of /proc
        (``fusefs.writers``; it sends no request to the mount, so any thread may call it,
        the serving one too; 2.5 ms for 92 processes on an idle 2-core host, 30 ms for 137
        at load 6, more for many descriptors open for writing: scripts/bench/bench_scan.py). None in handle
        mode, where the handles tell."""
        from . import writers

        if not self.no_open:
            return None
        device = self._mount_device()
        if device is None:  # not (or no longer) mounted: no writer
            return writers.Scan()
        return writers.scan(device)

    async def scan_writers(self) -> Scan | None:
        """``scan_writers_now`` in a worker thread."""
        import trio

        if not self.no_open:
            return None
        return await trio.to_thread.run_sync(self.scan_writers_now)

    def _writer_inodes(self, seen: Scan | None) -> set[int]:
        """Inode numbers of the files open for writing: by writable handles (in no-open
        mode: files created through the mount), and those the scan ``seen`` found."""
        out = {h.node.ino for h in self.ov.handles.values() if h.writable}
        if seen is not None:
            out.update(seen.inodes)
        return out

    def _scan_soon(self) -> Callable[[], Awaitable[Scan | None]]:
        """Start ``scan_writers_now`` in a thread of its own now; returns the awaitable that
        gives its result (a restore overlaps the scan with its verify and freeze)."""
        import trio

        if not self.no_open:
            async def nothing() -> Scan | None:
                return None
            return nothing
        done = trio.Event()
        got: list[Any] = []
        token = trio.lowlevel.current_trio_token()

        def deliver(outcome: Any) -> None:
            got.append(outcome)
            try:
                trio.from_thread.run_sync(done.set, trio_token=token)
            except trio.RunFinishedError:
                pass

        trio.lowlevel.start_thread_soon(self.scan_writers_now, deliver)

        async def result() -> Scan | None:
            await done.wait()
            return cast("Scan | None", got[0].unwrap())
        return result

    async def _count_writers(self) -> int:
        return len(self._writer_inodes(await self.scan_writers()))

    # -- requests --------------------------------------------------------------------------

    async def checkpoint(self, label: str | None = None, trigger: str = "manual",
                         timeout_s: float | None = None,
                         origin: str = "checkpoint") -> dict[str, Any]:
        """CONTRACT 3.1. Raises CheckpointError (nothing changed) when a write permit is
        still held after ``timeout_s`` or a step fails."""
        import trio

        t0 = time.perf_counter()
        if self.ov.upper is None:
            raise CheckpointError(trigger, "a read-only mount has nothing to checkpoint")
        async with self._busy:
            self._start_laps()
            async with self.gate.exclusive():
                with trio.move_on_after(timeout_s or DEFAULT_TIMEOUT_S) as cs:
                    await self.gate.no_permits()
                if cs.cancelled_caught:
                    raise CheckpointError(trigger, "a write permit was still held after "
                                                   f"{timeout_s or DEFAULT_TIMEOUT_S} s")
                self._lap("permits")
                await self._syncfs()
                self._lap("syncfs")
                async with self._ahead(True, lambda e: CheckpointError(trigger, e)) as writer:
                    done = await self._paused_freeze(trigger, origin, label, writer)
                await self._drop_folded_listings(done)
        ms = (time.perf_counter() - t0) * 1000
        log.info("checkpoint (%s) -> %s in %.1f ms%s", trigger, done["ref"], ms,
                 " (unchanged)" if done["unchanged"] else "")
        return {"ref": str(done["ref"]), "elapsed_ms": ms, "unchanged": done["unchanged"],
                "packs": done["packs"], "bytes": done["bytes"], "trigger": trigger,
                "phases": dict(self.phases)}

    async def _paused_freeze(self, trigger: str, origin: str, label: str | None,
                             writer: Writer | None) -> dict[str, Any]:
        """``_freeze`` with mutations paused and drained and the upper lock held, then the
        mount's pins replaced; a failure is CheckpointError (nothing changed)."""
        import trio

        async with self.gate.paused_for():
            self._lap("drain")
            async with self.ops.upper_lock:
                try:
                    done = await self._freeze(origin=origin, label=label, writer=writer)
                except Exception as e:
                    log.error("checkpoint failed: %s: %s", type(e).__name__, e)
                    raise CheckpointError(trigger, e) from e
                if done["rebase"] is not None and self.mount_pins is not None:
                    await trio.to_thread.run_sync(self._repin)
                    self._lap("repin")
        return done

    async def _drop_folded_listings(self, done: dict[str, Any]) -> None:
        """After a freeze: drop the kernel's cached listing of every directory whose
        entries moved from the upper into the new lower (their readdir cookies changed, so
        a listing the kernel had only partly cached would go on at a wrong position)."""
        import trio

        from . import restore as rs

        inv = rs.known_to_kernel(self.ov, rs.Invalidation(listings=done.get("folded", [])))
        if inv:
            await trio.to_thread.run_sync(invalidate, inv)
        self._lap("invalidate")

    async def _admit_restore(self, target: Ref, permits_s: float,
                             writers_s: float | None, wanted: list[bytes] | None,
                             stack: AsyncExitStack,
                             ahead: AbstractAsyncContextManager[Writer | None]
                             ) -> Writer | None:
        """Pause admission of opens and mutations for a restore and drain what runs: first
        wait up to ``permits_s`` for write permits (tool calls in flight) to end, then, with
        ``writers_s``, up to that long for files open for writing to close. Returns paused
        (the caller resumes with ``opens=True``). Raises RestoreError(permit_failed), not
        paused, when a wait runs out. Between the two, the running sandboxes covering
        ``wanted`` (None: anything) are stopped (``fusefs.guard``; a restore changes the
        dentries their covers are mounted on): RestoreError(permit_failed) when one is not
        confirmed gone in time. In no-open mode the writers are those a scan of /proc
        finds (``scan_writers``), polled every 50 ms: an approximation, since processes
        the daemon may not inspect are not seen. ``ahead`` (``_ahead``), entered into
        ``stack`` once the pages are flushed, before the pause, gives the pre-restore
        freeze's write batch, returned."""
        import trio

        with trio.move_on_after(permits_s) as cs:
            await self.gate.no_permits()
        if cs.cancelled_caught:
            raise RestoreError(RestoreError.PERMIT_FAILED, str(target),
                               f"a write permit still held after {permits_s} s")
        self._lap("permits")
        guard = self.ops.guard
        try:
            await guard.stop(guard.under(wanted))
        except OSError as e:
            raise RestoreError(RestoreError.PERMIT_FAILED, str(target), str(e)) from e
        await self._syncfs()  # dirty pages reach the daemon before anything pauses
        self._lap("syncfs")
        writer = await stack.enter_async_context(ahead)
        deadline = trio.current_time() + (writers_s or 0.0)
        poll = 0.05 if self.no_open else 0.005
        while True:
            if writers_s is not None:
                # Unpaused, so a writer can finish and close; then pause and look again
                # (a new writable open parks once paused; with no-open, its writes do).
                with trio.move_on_at(deadline):
                    while await self._count_writers():
                        await trio.sleep(poll)
            self.gate.pause(opens=True)
            try:
                await self.gate.drain()
            except BaseException:
                self.gate.resume(opens=True)
                raise
            if writers_s is None:
                return writer
            n = await self._count_writers()
            if n == 0:
                return writer
            self.gate.resume(opens=True)
            if trio.current_time() >= deadline:
                raise RestoreError(RestoreError.PERMIT_FAILED, str(target),
                                   f"{n} file(s) still open for writing after {writers_s} s")

    async def restore(self, ref: Ref | str, *, discard: bool = False,
                      timeout_s: float | None = None, wait_writers_s: float | None = None,
                      label: str | None = None,
                      paths: list[str] | None = None) -> dict[str, Any]:
        """:meth:`_restore`; no sandbox covering what it may change (anything, for a whole
        restore; for a path restore, a path at or below one of ``paths``) registers while
        it runs, and those running are stopped once the write permits are released
        (:meth:`_admit_restore`). A failure is logged (``restore failed: <type>: <message>``,
        as a failed checkpoint is) and raised as it came."""
        from . import restore as rs

        guard = self.ops.guard
        try:
            wanted = None if paths is None else rs.normalize_paths(paths)
            with guard.restoring(wanted):
                return await self._restore(ref, discard=discard, timeout_s=timeout_s,
                                           wait_writers_s=wait_writers_s, label=label,
                                           paths=paths)
        except Exception as e:
            log.error("restore failed: %s: %s", type(e).__name__, e)
            raise

    async def _restore(self, ref: Ref | str, *, discard: bool = False,
                       timeout_s: float | None = None, wait_writers_s: float | None = None,
                       label: str | None = None,
                       paths: list[str] | None = None) -> dict[str, Any]:
        """CONTRACT 3.2 with its amendment: never waits for open files; what they hold is
        detached (``restore.py``). Waits up to ``timeout_s`` (default 60 s) for write
        permits (tool calls in flight) to end; with ``wait_writers_s``, also up to that long
        for files open for writing to close, else refuses (the old behaviour). In no-open
        mode the files open for writing are those ``scan_writers`` finds. Raises
        RestoreError: permit_failed (a permit, or with ``wait_writers_s`` a writer, still
        there), swap_failed (the target is not complete in the store, or a step before the
        swap failed), closing, append_failed (``on_restored`` failed after the swap: the
        tree is the target). Except append_failed, nothing changed."""
        import trio

        from store.resolve import resolve_ref

        from . import checkpoint as ck
        from . import restore as rs

        t0 = time.perf_counter()
        # a Ref, or what a user typed (prefix, @label) read against this mount's store
        target = source = resolve_ref(self.store, ref)
        wanted = None if paths is None else rs.normalize_paths(paths)
        if self.ov.upper is None:
            raise RestoreError(RestoreError.SWAP_FAILED, str(target), "a read-only mount")
        if self.closing:
            raise RestoreError(RestoreError.CLOSING, str(target))
        if wait_writers_s is not None and wait_writers_s < 0:
            raise RestoreError(RestoreError.PERMIT_FAILED, str(target),
                               f"wait_writers_s must not be negative, not {wait_writers_s}")
        wait = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        ov = self.ov
        if self.mount_pins is not None:  # before it is verified: see MountPins.add
            try:
                await trio.to_thread.run_sync(self.mount_pins.add, [target])
            except Exception as e:
                raise RestoreError.because(RestoreError.SWAP_FAILED, str(target),
                                           "cannot pin the target in the catalog", e) from e
        append_error: BaseException | None = None
        discarded: dict[str, str] = {}
        async with self._busy, self.gate.exclusive(), AsyncExitStack() as stack:
            self._start_laps()
            writer = await self._admit_restore(
                target, wait, wait_writers_s, wanted, stack, self._ahead(
                    not discard, lambda e: RestoreError.because(
                        RestoreError.SWAP_FAILED, str(target),
                        "pre-restore checkpoint failed", e)))
            ck.crash_point("restore.paused")
            # Paused: writes wait from here. The scan for open writers (no-open mode) runs
            # beside the verify and the freeze.
            scanned = self._scan_soon()
            try:
                # Verified against the current lower before anything changes (the clean
                # tree below differs, so the swap diffs again).
                self._lap("drain")
                if wanted is None:
                    await trio.to_thread.run_sync(rs.verify, self.store, ov.lower.ref, target)
                else:
                    await trio.to_thread.run_sync(self.store.root_tree, source)
                    rs.check_paths(ov, source, wanted)
                    await trio.to_thread.run_sync(self._verify_paths, source, wanted)
                self._lap("verify")
                async with self.ops.upper_lock:
                    pre: Ref | None = None
                    rb0: ck.Rebase
                    if not discard:
                        try:
                            done = await self._freeze(origin="pre_restore", label=label,
                                                      writer=writer)
                        except Exception as e:
                            raise RestoreError.because(
                                RestoreError.SWAP_FAILED, str(target),
                                "pre-restore checkpoint failed", e) from e
                        pre = done["ref"]
                        if self.on_pre_restore is not None:
                            self.on_pre_restore(pre)
                        rb0 = ck.Rebase(ov.lower.ref)
                        uppers = done["uppers"]
                        kept, freeze = done["kept"], done["rebase"]
                    else:
                        discarded = self.steps.pending()
                        rb0, uppers, kept = await self._clean_discard()
                        freeze = rb0
                    ck.crash_point("restore.checkpointed")
                    try:
                        if wanted is not None:
                            target = await trio.to_thread.run_sync(
                                rs.path_target, self.store, ov.lower.ref, source, wanted)
                            self._lap("path_target")
                        split = rs.split_cross(ov, freeze)
                        if kept:  # excluded entries stay as they are (restore.py)
                            target = await trio.to_thread.run_sync(
                                rs.keep_target, self.store, ov.lower.ref, target, kept)
                        changes = rs.outside_kept(await trio.to_thread.run_sync(
                            rs.verify, self.store, ov.lower.ref, target), kept)
                        self._lap("diff")
                        ck.crash_point("restore.verified")
                        seen = await scanned()
                        self._lap("scan_writers")
                        sp = rs.plan_swap(ov, changes, target, rb0, uppers,
                                          rs.writers(ov, seen.inodes if seen else ()))
                        rs.graft_swap(ov, sp, kept, freeze)
                        sp.invalidation.entries.extend(split)
                        self._lap("plan_swap")
                        upper = ov.upper
                        assert upper is not None
                        try:
                            await trio.to_thread.run_sync(ck.reset_upper, upper, sp.rebase)
                        except OSError as e:  # a full state disk: one transaction, not made
                            raise RestoreError(RestoreError.SWAP_FAILED, str(target),
                                               f"cannot record the restore: {e}") from e
                        self._lap("reset_upper")
                    except BaseException:
                        if discard:  # the discard freeze is applied in memory: record it
                            await self._persist_rebase(rb0)
                        raise
                    ck.crash_point("restore.swapped")
                    detached = -len(ov.unlinked)
                    rs.apply_swap(ov, sp)
                    detached += len(ov.unlinked)  # inodes the kernel holds on paths that went
                    # The restore's own changes are journaled as the restore, not as a step:
                    # the next step starts from the restored tree (plus what was carried).
                    self.steps.reset(discarded if discard else self.steps.carry)
                    self._forget_pending_batches()
                    self._lap("apply_swap")
                    # Before any request is admitted again: a detached writer's next write
                    # may make a data file at a path this would remove.
                    await trio.to_thread.run_sync(ck.drop_data, sp.rebase.drop_data)
                    self._lap("drop_data")
                    await trio.to_thread.run_sync(self._repin)
                if self.on_restored is not None:
                    try:
                        self.on_restored(target)
                    except BaseException as e:
                        append_error = e
                ck.crash_point("restore.appended")
            finally:
                self.gate.resume(opens=True)  # release the parked requests on every path
            # Directories whose upper entries the pre-restore freeze folded into the lower
            # changed their readdir cookies too (see _drop_folded_listings).
            folded = {n.ino for n in uppers or () if n.kind is Kind.DIR}
            sp.invalidation.listings.extend(sorted(folded - set(sp.invalidation.listings)))
            inv = rs.known_to_kernel(ov, sp.invalidation)
            await trio.to_thread.run_sync(invalidate, inv)
            self._lap("invalidate")
        ms = (time.perf_counter() - t0) * 1000
        log.info("restore -> %s%s in %.1f ms (%d changes, %d detached, %d invalidated)",
                 target, "" if wanted is None else f" (paths {wanted!r} of {source})",
                 ms, sp.changes, detached, len(inv))
        if append_error is not None:
            raise RestoreError(RestoreError.APPEND_FAILED, str(target), append_error)
        out: dict[str, Any] = {
            "ref": str(target), "pre_restore": str(pre) if pre else None,
            "changes": sp.changes, "detached": detached, "invalidated": len(inv),
            "elapsed_ms": ms, "phases": dict(self.phases)}
        if wanted is not None:
            out["source"] = str(source)
            out["paths"] = [os.fsdecode(p) for p in wanted]
        return out

    def _verify_paths(self, source: Ref, wanted: list[bytes]) -> None:
        """Check that ``source``'s content at ``wanted`` is complete in the store, before
        anything changes (worker thread): the current lower with those paths replaced
        differs from it only there, so the diff reads only what the restore will."""
        from . import restore as rs

        rs.verify(self.store, self.ov.lower.ref,
                  rs.path_target(self.store, self.ov.lower.ref, source, wanted))

    async def _clean_discard(self) -> Any:
        """Freeze the upper without listing it and rebase onto it in memory only (the
        upper keeps recording the old base until the swap commits)."""
        import trio

        from . import checkpoint as ck

        ov = self.ov
        store = self.store
        p = ck.plan(ov)
        if p.unchanged:
            return ck.Rebase(ov.lower.ref), p.uppers, []

        def work() -> Ref:
            with store.writer() as w:
                ref = ck.build(p, store, w)
                w.commit()
                return ref

        ref = await trio.to_thread.run_sync(work)
        rb = ck.prepare(ov, p, ref)
        ck.apply(ov, p, rb)
        return rb, p.uppers, p.kept

    async def _persist_rebase(self, rb: Any) -> None:
        import trio

        from . import checkpoint as ck

        if rb.ref == self.ov.lower.ref and self.ov.upper is not None and \
                self.ov.upper.base != rb.ref:
            ck.kept_rows(self.ov, rb, rb.ref.tree_id)
            await trio.to_thread.run_sync(ck.reset_upper, self.ov.upper, rb)

    async def current_status(self, catalog: bool = True) -> dict[str, Any]:
        """``status``, with the writer scan (no-open mode) run in a worker thread; with
        ``catalog``, on a shared store, also ``catalog``: ``"ok"`` or ``"unreachable:
        <reason>"`` (``store.catalog.catalog_state``, asked in a worker thread: every other
        figure is the daemon's own and answers with the catalog down)."""
        import trio

        from store.catalog import catalog_state

        out = self.status(await self.scan_writers())
        if catalog:
            state = await trio.to_thread.run_sync(catalog_state, self.store.catalog)
            if state is not None:
                out["catalog"] = state
        return out

    def status(self, seen: Scan | None = None) -> dict[str, Any]:
        """Counts of the live mount (``seen``: a writer scan just made, else one is made
        here in no-open mode). ``dirty_*``: changes the next checkpoint takes (linked
        inodes with an upper row); ``detached_inodes``: inodes no name reaches (unlinked, or
        removed by a restore) that the kernel still holds, whose changes no checkpoint
        takes; ``held_lowers``: older lowers those still read (GC keeps them); ``quota``:
        what the upper holds against the session's caps (``bytes_used``, ``bytes_cap``,
        ``inodes_used``, ``inodes_cap``; a cap None: none; detached inodes count);
        ``open_writers`` and the fields after it: see the module docstring."""
        from . import checkpoint as ck

        ov = self.ov
        if seen is None:
            seen = self.scan_writers_now()
        cs = ov.cs
        dirty = 0
        nbytes = 0
        held = sum(1 for n in ov.nodes.values() if n.nlookup > 0)
        for n in ck.dirty_nodes(ov):  # excluded paths aside
            dirty += 1
            if n.kind == 2:
                nbytes += max(0, n.size - n.lower_len) + len(n.present) * cs
        return {"ref": str(ov.lower.ref), "dirty_inodes": dirty, "dirty_bytes": nbytes,
                "detached_inodes": len(ov.unlinked), "held_lowers": ov.held_lowers(),
                "open_handles": len(ov.handles), "writable_handles": self._writable_handles(),
                "open_writers": len(self._writer_inodes(seen)),
                "writers_found_by": "handles" if seen is None else "proc_scan",
                "writer_pids": sorted(set().union(*seen.inodes.values())) if seen else [],
                "writers_unseen_processes": seen.unseen if seen else 0,
                "open_dirs": len(ov.dirs), "parked": self.gate.parked,
                "paused": self.gate.paused, "permits": self.gate.permits,
                "mountpoint": self.mountpoint, "state": self.state_dir, "pid": os.getpid(),
                "requests": dict(self.ops.counts), "binding": binding.info(),
                "affinity": self.ops.affinity.info() if self.ops.affinity else None,
                "no_open": self.no_open, "kernel_inodes": held,
                "quota": ov.quota(),
                **self._disk()}

    def _disk(self) -> dict[str, Any]:
        """The state directory's disk as the upper sees it (see "A full disk" in upper.py):
        ``disk_full`` while only removals are accepted; batches of changes waiting in the
        spill and in memory (written at the next commit that has room)."""
        up = self.ov.upper
        if up is None:
            return {}
        return {"disk_full": not (up.reserve_full and not up.spilled and not up.failing),
                "spilled_batches": len(up.spilled),
                "unwritten_batches": len(getattr(self.ops, "_failed", []))}

    def diff(self, unified: bool = False) -> dict[str, Any]:
        """The changes since the last checkpoint (the lower), computed without writing;
        with ``unified`` also their unified text diff (``text``)."""
        from store.diff import diff_trees

        from . import checkpoint as ck

        base = self.ov.lower.ref
        ref, mw = ck.preview(self.ov)
        changes = diff_trees(mw, base.tree_id, ref.tree_id)  # type: ignore[arg-type]
        out: dict[str, Any] = {
            "base": str(base), "ref": str(ref),
            "changes": [{"path": os.fsdecode(c.path), "status": c.status,
                         "old_kind": c.old.kind.name.lower() if c.old else None,
                         "new_kind": c.new.kind.name.lower() if c.new else None}
                        for c in changes]}
        if unified:
            from .textdiff import unified as render

            out["text"] = render(mw, changes)
        return out

    async def step(self) -> dict[str, Any]:
        """Close a step of the step change log (``fusefs/steps.py``): the paths changed since
        the previous step, ``{"changes": [{"path", "status", "kind"}...], "fingerprints":
        {...}, "base": Ref text, "elapsed_ms": float}``. Event-loop thread; reads only.
        Raises CheckpointError on a read-only mount."""
        t0 = time.perf_counter()
        if self.ov.upper is None:
            raise CheckpointError("step_done", "a read-only mount has no steps")
        async with self._busy:  # never between a checkpoint's pending and its reset
            out = self.steps.step()
        out["base"] = str(self.ov.lower.ref)
        out["elapsed_ms"] = (time.perf_counter() - t0) * 1000
        return out

    async def dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        aff = self.ops.affinity
        if aff is None:
            return await self._dispatch(req)
        with aff.control_work():  # unpinned if its requester is gone; never idle
            return await self._dispatch(req)

    async def _dispatch(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "status":
            return dict(await self.current_status(), ok=True)
        if op == "checkpoint":
            out = await self.checkpoint(req.get("label"), req.get("trigger") or "manual",
                                        req.get("timeout_s"))
            return dict(out, ok=True)
        if op == "restore":
            paths = req.get("paths")
            if paths is not None and not (isinstance(paths, list)
                                          and all(isinstance(p, str) for p in paths)):
                raise RestoreError(RestoreError.PATH_ESCAPE, str(req.get("ref") or ""),
                                   "paths must be a list of strings")
            out = await self.restore(req.get("ref", ""), discard=bool(req.get("discard")),
                                     timeout_s=req.get("timeout_s"),
                                     wait_writers_s=req.get("wait_writers_s"), paths=paths)
            return dict(out, ok=True)
        if op == "diff":
            return dict(self.diff(bool(req.get("unified"))), ok=True)
        if op == "step":
            return dict(await self.step(), ok=True)
        raise ValueError(f"unknown control request {op!r}")


def launder(inodes: list[int]) -> None:
    """Make the kernel write the dirty pages of each of ``inodes`` and wait for the daemon's
    replies: an invalidation of the file's pages (``invalidate_inode``, not attr_only)
    writes a dirty page back before it drops it (``fuse_launder_folio`` in fs/fuse/file.c);
    clean pages are dropped too, and read again when needed. Blocking: call from a worker
    thread while the event loop serves the WRITEs (PYFUSE3.md trap 8); inodes the kernel
    no longer holds are skipped."""
    import errno

    import pyfuse3

    for ino in inodes:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=False)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("invalidate_inode(%d) to write its mapped pages: %s", ino, e)


def invalidate(inv: Any) -> None:
    """Drop the kernel's cached names, attributes and directory listings listed in ``inv``
    (a ``restore.Invalidation``). Blocking: call from a worker thread, never from a handler
    (PYFUSE3.md traps 8, 16); entries the kernel no longer holds are skipped. A listing
    the kernel keeps (``FOPEN_CACHE_DIR``) lives in the directory's page cache: dropping
    the pages (``attr_only=False``) drops it."""
    import errno

    import pyfuse3

    for parent, name, ino in reversed(inv.deleted):  # children before their directory
        try:
            pyfuse3.invalidate_entry(parent, name, deleted=ino)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                log.warning("invalidate_entry(%d, %r, deleted=%d): %s", parent, name, ino, e)
    for parent, name in inv.entries:
        try:
            pyfuse3.invalidate_entry(parent, name)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("invalidate_entry(%d, %r): %s", parent, name, e)
    for ino, attr_only in [(i, True) for i in inv.inodes] + [(i, False) for i in inv.listings]:
        try:
            pyfuse3.invalidate_inode(ino, attr_only=attr_only)
        except OSError as e:
            if e.errno != errno.ENOENT:
                log.warning("invalidate_inode(%d): %s", ino, e)


# -- the socket server ------------------------------------------------------------------------

async def serve(live: Live, *, task_status: Any = None) -> None:
    """Serve ``live`` on its control socket until cancelled; records the socket path in the
    state directory and removes both on the way out. Use with ``nursery.start``."""
    import trio

    path = socket_path_for(live.state_dir)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        await sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(16)
    record = os.path.join(live.state_dir, CONTROL_FILE)
    with open(record + ".tmp", "w") as f:
        f.write(path)
    os.replace(record + ".tmp", record)
    log.info("control socket %s", path)
    listener = trio.SocketListener(sock)
    try:
        if task_status is not None:
            task_status.started(path)
        await trio.serve_listeners(lambda stream: _connection(live, stream), [listener])
    finally:
        for p in (record, path):
            try:
                if p == record:
                    with open(record) as f:
                        if f.read().strip() != path:
                            continue
                os.unlink(p)
            except OSError:
                pass
        with trio.CancelScope(shield=True):
            await listener.aclose()


async def _readline(stream: Any, buf: bytearray) -> bytes | None:
    while b"\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
        if len(buf) > MAX_LINE:
            raise ValueError("control request too long")
    i = buf.index(b"\n")
    line = bytes(buf[:i])
    del buf[:i + 1]
    return line


async def _connection(live: Live, stream: Any) -> None:
    async with stream:
        buf = bytearray()
        try:
            line = await _readline(stream, buf)
        except (OSError, ValueError, Exception) as e:  # noqa: B014 - a broken client
            log.debug("control connection: %s", e)
            return
        if line is None:
            return
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("a control request is a JSON object")
            if req.get("op") == "write_permit":
                async with live.gate.write_permit():
                    await stream.send_all(json.dumps({"ok": True}).encode() + b"\n")
                    while await stream.receive_some(65536):
                        pass
                return
            reply = await live.dispatch(req)
        except Exception as e:
            reply = error_reply(e)
        try:
            await stream.send_all(json.dumps(reply).encode() + b"\n")
        except Exception:  # the client went away
            pass


# -- client side -----------------------------------------------------------------------------

def _typed(r: dict[str, Any]) -> dict[str, Any]:
    """The typed cause of a failed reply ``r`` (``cause_type``, ``exit_code``: see
    ``store.errors.typed_cause``), as keyword arguments of the error rebuilt from it."""
    fields = r.get("fields") or {}
    code = r.get("exit_code")
    return {"cause_type": fields.get("cause_type") or None,
            "exit_code": code if isinstance(code, int) else None}


_ERRORS: dict[str, Callable[[dict[str, Any]], Exception]] = {
    # the cause, not the message (which already says "restore ... failed (kind): ")
    "RestoreError": lambda r: RestoreError(
        r.get("kind") or RestoreError.SWAP_FAILED, str(r.get("ref") or ""),
        str((r.get("fields") or {}).get("cause") or r.get("message")), **_typed(r)),
    "CheckpointError": lambda r: CheckpointError(
        str(r.get("trigger") or (r.get("fields") or {}).get("trigger") or "manual"),
        str((r.get("fields") or {}).get("cause") or r.get("message")), **_typed(r)),
    "RefNotFoundError": lambda r: RefNotFoundError(str(r.get("ref") or "")),
}


class NotLiveError(Exception):
    """No live session mount answers at this mount point or state directory; ``fix``: how
    to recover, where that is known (a dead mount its daemon left)."""

    exit_code = 9

    def __init__(self, where: str, why: str, fix: str | None = None) -> None:
        self.where = where
        self.fix = fix
        super().__init__(f"{where}: {why}" + (f"; to recover, {fix}" if fix else ""))


def find_socket(mount_or_state: str) -> str:
    """The control socket of the session mount that holds ``mount_or_state``: a mount point,
    any path inside a mount, or a state directory. Raises NotLiveError."""
    from .mounts import recorded_mount

    path = os.path.abspath(mount_or_state)
    state = None
    # The nearest mount point at or above ``path`` that a daemon recorded: a path inside a
    # mount (``.`` from a subdirectory) finds its mount. State directories never lie inside
    # a mount, so only without any record is ``path`` taken for one.
    found = recorded_mount(path)
    rec: dict[str, Any] | None = None
    if found is not None:
        path, rec = found
        if rec.get("state"):
            state = str(rec["state"])
    elif os.path.exists(os.path.join(path, CONTROL_FILE)):
        state = path
    if state is None:
        if rec is not None:
            raise NotLiveError(path, "a read-only mount has no control channel")
        raise NotLiveError(path, "no rewindfs session mount here")
    try:
        with open(os.path.join(state, CONTROL_FILE)) as f:
            sock = f.read().strip()
    except FileNotFoundError:
        raise NotLiveError(path, "its daemon serves no control socket") from None
    return sock


@dataclass
class Client:
    """Calls a live mount's control socket. Each method returns the reply as a dict (``ref``
    as text, ``elapsed_ms`` measured in the daemon) or raises the daemon's typed error:
    RestoreError (with its ``kind``), CheckpointError, or ``HostError`` for anything else;
    OSError if no daemon answers."""

    socket_path: str
    timeout_s: float | None = None

    @classmethod
    def for_mount(cls, mount_or_state: str) -> Client:
        return cls(find_socket(mount_or_state))

    def call(self, req: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        reply = request(self.socket_path, req, timeout_s or self.timeout_s)
        if not reply.get("ok"):
            make = _ERRORS.get(str(reply.get("error")))
            if make is not None:
                raise make(dict(reply, ref=req.get("ref"), trigger=req.get("trigger")))
        return raise_reply(reply)

    def checkpoint(self, label: str | None = None, trigger: str = "manual",
                   timeout_s: float | None = None) -> dict[str, Any]:
        return self.call({"op": "checkpoint", "label": label, "trigger": trigger,
                          "timeout_s": timeout_s})

    def restore(self, ref: Ref | str, discard: bool = False,
                timeout: float | None = None,
                wait_writers: float | None = None,
                paths: list[str] | None = None) -> dict[str, Any]:
        """Restore the mount to ``ref`` (see ``Live.restore``): ``timeout`` (s) bounds the
        wait for write permits, ``wait_writers`` (s, None: never wait) the wait for files
        open for writing; ``paths`` makes it a path restore of those paths only."""
        req: dict[str, Any] = {"op": "restore", "ref": str(ref), "discard": discard,
                               "timeout_s": timeout, "wait_writers_s": wait_writers}
        if paths is not None:
            req["paths"] = list(paths)
        return self.call(req)

    def status(self) -> dict[str, Any]:
        return self.call({"op": "status"})

    def diff(self, unified: bool = False) -> dict[str, Any]:
        return self.call({"op": "diff", "unified": unified})


def attach(nursery: trio.Nursery, ops: Operations, store: Store, *, mountpoint: str,
           state_dir: str) -> Live:
    """Daemon wiring in one call: a ``Live`` for ``ops`` whose control socket is served in
    ``nursery``. ``ops`` must have been made with a ``fusefs.gate.Gate``."""
    from .gate import Gate

    gate = ops.gate
    assert isinstance(gate, Gate), "Operations needs a fusefs.gate.Gate"
    live = Live(ops, store, gate, mountpoint=mountpoint, state_dir=state_dir)
    nursery.start_soon(_serve_logged, live)
    return live


async def _serve_logged(live: Live) -> None:
    try:
        await serve(live)
    except Exception as e:
        log.error("control socket failed: %s: %s", type(e).__name__, e)
