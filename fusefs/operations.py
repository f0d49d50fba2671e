"""The pyfuse3 adapter: translates FUSE requests into ``Overlay`` calls and back.

Owns only what the protocol needs: ``EntryAttributes`` and timeouts, file handles as
returned by the overlay, readdirplus lookup counting, moving blocking work (big chunk
reads, fsync, upper commits) to worker threads, and the single error boundary: ``OSError``
becomes its errno, ``FUSEError`` passes, anything else is logged in one line and answered
with EIO, so no request can end the daemon (PYFUSE3.md traps 1, 2). ``forget`` never
raises at all.

All overlay calls run on the trio thread; between two ``await``s they are atomic.
"""

from __future__ import annotations

import errno
import functools
import gc
import logging
import os
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from time import perf_counter
from typing import Any, Protocol, TypeVar, cast

import pyfuse3
import trio
from pyfuse3 import (
    EntryAttributes,
    FileHandleT,
    FileInfo,
    FileNameT,
    FlagT,
    FUSEError,
    InodeT,
    ModeT,
    ReaddirToken,
    RequestContext,
    SetattrFields,
    StatvfsData,
    XAttrNameT,
)

from . import binding
from .affinity import ServingAffinity
from .errors import UpperSpilledError
from .guard import SandboxGuard
from .inodes import Node
from .lower import SMALL_CHUNK
from .overlay import Overlay, sync_paths
from .upper import INLINE_MAX, Batch

log = logging.getLogger("rewindfs.fuse")

# Every change passes through this daemon, so the kernel may cache names and attributes
# for long; what a restore changes is invalidated explicitly (CONTRACT 2.7). One cost no
# timeout spares: after each listing it fetches and each READ the kernel (6.18 here) drops
# the atime it holds for that directory or file (``fuse_invalidate_atime``, noatime or
# not), and the next stat of it is a GETATTR. No reply can spare it: READDIRPLUS entries
# "." and ".." are skipped, and no notification stores attributes. So the second
# ``git status`` after a mount sends a GETATTR per directory (3,248 for Django's tree) and
# the third 7 requests (tests/test_fuse_kernel_cache.py, a walk of a tree).
TIMEOUT_S = 3600.0
BLKSIZE = 128 << 10  # st_blksize: the I/O size tools pick; FUSE moves 128 KiB per request
COMMIT_INTERVAL_S = 1.0
SEQ_SLACK = 1 << 20  # a read this close to the previous one's end counts as sequential
PREFETCH = 3  # chunks loaded ahead of a sequential reader, in parallel worker threads

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

# The options of every mount this adapter serves (``mount_options``). With
# ``default_permissions`` the kernel checks every permission against the attributes these
# handlers return, and the handlers check none. Its cost: a GETATTR of a directory before the
# next permission check on it after each change in it, whatever the attribute timeout (the
# kernel, 6.18 here, marks a changed directory's attributes stale, mode and owner included,
# and ``fuse_permission`` fetches them again): 8,078 of untar's 71,632 requests, 18,186 of
# git add's 89,175. It stays: without it the kernel checks nothing, and this daemon cannot
# check in its place, since it sees no open (no-open mode) and none of the lookups, stats and
# reads the kernel answers from its caches; checking at READ/WRITE time instead refuses what
# POSIX allows (writing through the descriptor of a file created 0444, as git writes its
# objects; reading through a descriptor opened before a chmod 000). tests/test_fuse_perms.py
# holds the cases, each compared with a native directory.
MOUNT_OPTIONS = frozenset({"default_permissions", "fsname=rewindfs", "subtype=rewindfs",
                           "noatime"})


def mount_options(*, readonly: bool = False, allow_other: bool = False) -> set[str]:
    """The FUSE mount options for ``pyfuse3.init``: ``MOUNT_OPTIONS``, plus ``ro`` and
    ``allow_other`` when asked."""
    return set(MOUNT_OPTIONS) | ({"ro"} if readonly else set()) | (
        {"allow_other"} if allow_other else set())


# The cyclic collector's thresholds in a daemon (``tune_gc``): Python's default collects the
# young generation every 700 allocations, and a listing of a huge directory allocates a node,
# a set and a dict per entry, most of which live on.
GC_THRESHOLDS = (50_000, 20, 100)


def tune_gc() -> None:
    """Before a daemon's event loop starts: what is alive now (modules, the overlay as
    loaded) leaves the cyclic collector's view (``gc.freeze``; reference counting still
    frees it), and collections run at ``GC_THRESHOLDS``. The first ``ls -l`` of 100,000
    lower entries spent an eighth of its time in the collector before."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)

# What ``opendir`` answers with the patched binding (``fusefs.binding``): the kernel keeps
# the listing until the directory changes through the mount, or a restore invalidates it.
DIR_CACHE: dict[str, Any] = {"keep_cache": True, "cache_readdir": True}


class Gate(Protocol):
    """Admission of changes (checkpoint and restore pause it; see ``fusefs.gate``)."""

    def mutation(self) -> AbstractAsyncContextManager[Any]: ...

    def opening(self, writable: bool) -> AbstractAsyncContextManager[Any]: ...


class _Admit:
    """Admits everything at once (no checkpoint or restore can pause this mount)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


class OpenGate:
    """A ``Gate`` that never pauses."""

    _admit = _Admit()

    def mutation(self) -> _Admit:
        return self._admit

    def opening(self, writable: bool) -> _Admit:
        return self._admit


def _boundary(fn: F) -> F:
    """Wrap a handler: count it, map OSError to its errno, anything else to EIO + a log."""
    op = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Operations, *args: Any) -> Any:
        self.counts[op] += 1
        aff = self.affinity
        if aff is not None and aff.reason is None:
            aff.request()
        t0 = perf_counter()
        try:
            return await fn(self, *args)
        except FUSEError:
            raise
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None
        except Exception as e:  # the boundary: a request never kills the daemon
            self.log_unexpected(op, e)
            raise FUSEError(errno.EIO) from None
        finally:
            self.seconds[op] += perf_counter() - t0

    return cast(F, handler)


class Operations(pyfuse3.Operations):
    """pyfuse3 operations over ``overlay``; ``timeout`` (s) for entries and attributes.

    Every mutating handler runs inside ``gate.mutation()`` and ``open`` inside
    ``gate.opening(writable)``; ``upper_lock`` is held around every write-behind batch
    (checkpoint and restore take it to reset the upper).
    """

    supports_dot_lookup = False
    enable_writeback_cache = False
    # Only ``user.`` attributes exist here (``Overlay.setxattr``: others are ENOTSUP): with
    # the patched binding the kernel's security.capability query before every write, and
    # ls's security.selinux and ACL queries, are answered ENOTSUP without reaching a
    # handler; ENOTSUP (not ENODATA) tells ls the namespace is unsupported on the whole
    # device, so it stops asking after the first file.
    absent_xattr_prefixes = (b"security.", b"system.", b"trusted.")
    absent_xattr_errno = errno.EOPNOTSUPP
    # With the patched binding, handle requests also carry the inode (no-open mode).
    inode_in_requests = True
    # ... and a write its FUSE_WRITE_* flags, once ``init_flags`` is set (no-open mode).
    write_flags_in_requests = True
    # With the patched binding, a worker that answered a request reads the next one at
    # once when the kernel has queued it, without a round through the event loop; after
    # this many in a row it waits once, so that timers and worker threads' results run:
    # 128 serial requests take about 2 ms (an untar's, at 15 us each). With the serving
    # thread on the requester's CPU (fusefs/affinity.py) the next request is nearly always
    # queued when a reply is written, so the run ends at this count; 32 cost an untar
    # ~5% more (a round through trio each).
    eager_requests = 128
    # With the patched binding, replies can be written under SCHED_IDLE, so the woken
    # requester runs on the serving thread's CPU (fusefs/affinity.py turns it on).
    idle_replies = True

    def __init__(self, overlay: Overlay, *, timeout: float = TIMEOUT_S,
                 gate: Gate | None = None, upper_lock: trio.Lock | None = None,
                 no_open: bool | None = None, follow_cpu: bool = True) -> None:
        """``no_open``: answer OPEN and OPENDIR with ENOSYS, so the kernel sends no more
        OPEN/RELEASE or OPENDIR/RELEASEDIR on this connection and later requests come
        with handle 0 (addressed by inode); needs the patched binding (ValueError
        without it). None (the default): no-open mode where the patched binding serves,
        handles with a stock one (``binding.EXTENDED``)."""
        super().__init__()
        if no_open is None:
            no_open = binding.EXTENDED
        if no_open and not binding.EXTENDED:
            raise ValueError("no-open mode needs the patched pyfuse3 "
                             "(scripts/pyfuse3/; bash scripts/setup.sh builds it)")
        self.no_open = no_open
        # O_TRUNC then arrives as a SETATTR: an OPEN answered ENOSYS cannot truncate.
        self.init_unwant = getattr(pyfuse3, "CAP_ATOMIC_O_TRUNC", 0) if no_open else 0
        # FUSE_HANDLE_KILLPRIV_V2: the kernel no longer clears S_ISUID/S_ISGID itself; it
        # says when to (WRITE_KILL_SUIDGID on a write, ``kill_suidgid`` on a truncate or
        # chown: the writer lacks CAP_FSETID, or it is a chown), and this daemon does.
        # Spared: a GETATTR before every chown of a file, which the kernel sends to learn
        # the mode it would clear, and the security.capability query before every write
        # but the first after the file's attributes were last fetched (SB_NOSEC). Only in
        # no-open mode, where an O_TRUNC comes as a SETATTR: its flag in an OPEN does not
        # reach the handler.
        self.init_flags = getattr(pyfuse3, "INIT_HANDLE_KILLPRIV_V2", 0) if no_open else 0
        self._kill_write_flag = getattr(pyfuse3, "WRITE_KILL_SUIDGID", 0)
        self.ov = overlay
        self.timeout = timeout
        self.gate: Gate = gate or OpenGate()
        self.upper_lock = upper_lock or trio.Lock()
        self.guard = SandboxGuard()  # running sandboxes' covers (fusefs/guard.py)
        self.counts: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)  # wall time in handlers
        self.errors = 0
        self._failed: list[Batch] = []
        # An upper bound of the spill payload of batches taken from the overlay and not
        # yet written (being written, or ``_failed``): ``admit`` counts them.
        self._unwritten = 0
        self._unsynced: list[str] = []  # data files whose sync failed: synced at the next fsync
        self._inflight: dict[bytes, trio.Event] = {}
        self._commit_soon = trio.Event()  # set: commit_loop commits without waiting more
        self._nursery: trio.Nursery | None = None
        self.on_init: Callable[[], None] | None = None
        # Set at INIT, on the thread that answers requests (fusefs/affinity.py).
        self.affinity: ServingAffinity | None = None
        self.follow_cpu = follow_cpu

    def init(self) -> None:
        """The kernel's INIT was answered: the mount serves from now on."""
        try:
            self.affinity = ServingAffinity(self.no_open, self.follow_cpu)
        except Exception as e:  # init must not raise (pyfuse3 docs)
            self.log_unexpected("init", e)
        if self.on_init is not None:
            try:
                self.on_init()
            except Exception as e:  # init must not raise (pyfuse3 docs)
                self.log_unexpected("init", e)

    # -- helpers ---------------------------------------------------------------------------

    def log_unexpected(self, op: str, e: BaseException) -> None:
        self.errors += 1
        where = ""
        tb = traceback.extract_tb(e.__traceback__)
        if tb:
            f = tb[-1]
            where = f" at {os.path.basename(f.filename)}:{f.lineno} in {f.name}"
        log.error("%s failed: %s: %s%s; answered EIO", op, type(e).__name__, e, where)

    def attrs(self, n: Node) -> EntryAttributes:
        a = EntryAttributes()
        a.st_ino = InodeT(n.ino)
        a.generation = 0
        a.entry_timeout = self.timeout
        a.attr_timeout = self.timeout
        a.st_mode = ModeT(n.st_mode)
        a.st_nlink = n.nlink
        a.st_uid = n.uid
        a.st_gid = n.gid
        a.st_rdev = n.rdev
        a.st_size = n.size
        a.st_blksize = BLKSIZE
        a.st_blocks = self.ov.blocks(n)
        a.st_atime_ns = n.atime_ns
        a.st_mtime_ns = n.mtime_ns
        a.st_ctime_ns = n.ctime_ns
        return a

    def _entry(self, n: Node | None) -> EntryAttributes:
        if n is None:  # a cached negative lookup (PYFUSE3.md trap 18)
            a = EntryAttributes()
            a.st_ino = InodeT(0)
            a.entry_timeout = self.timeout
            return a
        return self.attrs(n)

    async def _fetch(self, cid: bytes) -> None:
        """Load lower chunk ``cid`` into the cache in a worker thread, once even when
        several requests (kernel readahead runs them in parallel) need it."""
        ev = self._inflight.get(cid)
        if ev is not None:
            await ev.wait()
            return
        ev = self._inflight[cid] = trio.Event()
        try:
            await trio.to_thread.run_sync(self.ov.lower.chunk, cid)
        finally:
            del self._inflight[cid]
            ev.set()

    async def _prefetch(self, cid: bytes) -> None:
        try:
            await self._fetch(cid)
        except Exception as e:  # the reader that needs it will see the error itself
            log.debug("prefetch of a chunk failed: %s", e)

    async def _load_chunks(self, fh: int, off: int, size: int, whole: bool = True) -> None:
        """Load in worker threads the lower chunks a request of ``[off, off+size)`` needs
        (``whole``: a write copies them up; else a read of at most SMALL_CHUNK bytes needs
        only their frames or blocks where they have them, cheap enough on this thread
        unless a whole load is under way)."""
        lower = self.ov.lower
        whole = whole or size > SMALL_CHUNK
        for cid in self.ov.lower_chunks_needed(fh, off, size):
            if whole or cid in self._inflight or not lower.is_small(cid, whole=False):
                await self._fetch(cid)
        h = self.ov.handles.get(fh) if fh > 0 else self.ov.inode_handles.get(fh)
        if h is None or self._nursery is None:
            return
        near = abs(off - h.seq_end) <= SEQ_SLACK
        # A sequential reader (two requests in a row each near the previous one's end, or
        # the first one at 0): load the next chunks meanwhile. One near request alone is
        # as likely a random reader's, which needs none of them.
        sequential = near and (h.seq_near or off == 0)
        h.seq_end, h.seq_near = off + size, near
        if sequential:
            for cid in self.ov.lower_chunks_needed(fh, off + size, PREFETCH * self.ov.cs):
                if cid not in self._inflight:
                    self._nursery.start_soon(self._prefetch, cid)

    def start_background(self, nursery: trio.Nursery) -> None:
        """Let the adapter start background work (chunk prefetch) in ``nursery``."""
        self._nursery = nursery

    async def commit(self, durable: bool = False) -> None:
        """Write the overlay's changes to the upper in a worker thread; ``durable`` first
        syncs data files written since their last sync and commits synchronously. Raises
        OSError (ENOSPC on a full disk: see ``upper.py``); what failed is kept and written
        first by the next call, so an acknowledged change is never dropped."""
        upper = self.ov.upper
        if upper is None:
            return
        async with self.upper_lock:
            if not durable and not self.ov.dirty and not self._failed and not upper.spilled:
                if not upper.reserve_full:
                    upper.regrow_reserve()  # space may be back (a checkpoint, another rm)
                return
            paths = self._unsynced + self.ov.take_unsynced() if durable else []
            self._unwritten += self.ov.pending_bytes
            batches = self._failed + [self.ov.collect()]
            self._failed = []
            if durable:
                self._unsynced = []

            def work() -> None:
                try:
                    sync_paths(paths, upper.data_dir)
                except BaseException:
                    self._unsynced = paths + self._unsynced
                    self._failed = batches
                    raise
                for i, b in enumerate(batches):
                    try:
                        upper.write(b, durable and i == len(batches) - 1)
                    except BaseException:
                        self._failed = batches[i:]
                        raise
                self._unwritten = 0  # in the database, or in the spill (``spilled_bytes``)

            aff = self.affinity
            await trio.to_thread.run_sync(work if aff is None else aff.beside(work))

    def forget_unwritten(self) -> None:
        """Drop the batches that failed to write, and their count in ``admit``'s bound: a
        checkpoint or restore reset the upper they describe."""
        self._failed = []
        self._unwritten = 0

    async def admit(self, more: int) -> None:
        """Before a change that adds at most ``more`` bytes to the next batch's spill
        payload (``Overlay.change_bytes`` and the inline content or xattrs it writes) is
        applied: if what is not yet written would then exceed what the spill is sure to
        take (``Upper.spill_room``), commit first (``commit``, in order, as fsync does), so
        that a full disk never leaves acknowledged changes that fit nowhere. Raises
        OSError(ENOSPC) if the change still does not fit (the disk is full: the commit went
        to the spill, or could not be written): the change is then not applied. An upper
        without a spill (its disk was full when it was made) commits before every change
        and refuses it only while ``has_room`` is false: the one change then unwritten
        has no fallback."""
        upper = self.ov.upper
        if upper is None:
            return
        held, room = self._unwritten + self.ov.pending_bytes + more, upper.spill_room()
        if held <= room:
            if held > room >> 1:
                # Half-way: the background commit starts now, so that by the bound the
                # batch is usually written and this handler need not wait for it.
                self._commit_soon.set()
            return
        await self.commit()
        if self._unwritten + self.ov.pending_bytes + more > upper.spill_room() and \
                (upper.spill_slot or not upper.has_room()):
            raise OSError(errno.ENOSPC, "No space left on device (ENOSPC): the state "
                          "directory's disk cannot take more unwritten changes",
                          upper.state_dir)

    persist = commit

    def close(self) -> None:
        """At unmount, after the event loop ended: write any batch that failed earlier, then
        persist everything durably and close the upper (``Overlay.close``). Raises OSError
        if changes could not be written anywhere (they are lost), UpperSpilledError if they
        were kept in the spill for the next mount."""
        upper = self.ov.upper
        try:
            if upper is not None:
                failed, self._failed = self._failed, []
                try:
                    sync_paths(self._unsynced, upper.data_dir)
                    for b in failed:
                        upper.write(b)
                except BaseException:
                    upper.close()
                    raise
            self.ov.close()
        except OSError as e:
            raise OSError(e.errno, f"{e.strerror}; the changes since the last successful "
                          "commit are lost", e.filename) from e
        if upper is not None and upper.spilled:
            raise UpperSpilledError(upper.state_dir, len(upper.spilled))

    async def commit_loop(self, interval: float = COMMIT_INTERVAL_S) -> None:
        """Batch commits between fsyncs (CONTRACT 2.5): every ``interval`` seconds, or
        sooner when ``admit`` finds the unwritten changes half-way to what the spill is
        sure to take; after a failure, ``interval`` seconds later, whatever ``admit``
        asks meanwhile."""
        last: str | None = None  # the failure logged last: a full disk logs once, not per try
        retry = False
        while True:
            if not retry:
                with trio.move_on_after(interval):
                    await self._commit_soon.wait()
            retry = False
            self._commit_soon = trio.Event()
            try:
                await self.commit()
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                if why != last:
                    self.errors += 1
                    log.error("write-behind commit failed: %s; kept and tried again every "
                              "%g s", why, interval)
                    last = why
                # Not sooner, whatever admit asks meanwhile: a failing commit (a locked or
                # failing upper) is not retried at every change; and not later either.
                await trio.sleep(interval)
                retry = True
                continue
            if last is not None:
                log.info("write-behind commits work again")
                last = None

    async def affinity_loop(self, interval: float = 1.0) -> None:
        """Every ``interval`` seconds, unpin the serving thread if the requester it
        follows has ended (fusefs/affinity.py): a mount left alone is not kept on one CPU
        until the next request."""
        while True:
            await trio.sleep(interval)
            if self.affinity is not None and self.affinity.reason is None:
                self.affinity.release_if_gone()

    def stats(self) -> dict[str, Any]:
        """Requests served per operation, seconds spent inside each operation's handler
        (wall time, awaits included), and the daemon's CPU time (s)."""
        t = os.times()
        return {"requests": dict(self.counts), "total": sum(self.counts.values()),
                "handler_s": {k: round(v, 6) for k, v in self.seconds.items()},
                "cpu_s": t.user + t.system, "errors": self.errors, "time": time.time()}

    # -- names -----------------------------------------------------------------------------

    @_boundary
    async def lookup(self, parent_inode: InodeT, name: FileNameT,
                     ctx: RequestContext) -> EntryAttributes:
        return self._entry(self.ov.lookup(parent_inode, name))

    async def forget(self, inode_list: Sequence[tuple[InodeT, int]]) -> None:
        self.counts["forget"] += 1
        for ino, n in inode_list:
            try:
                self.ov.forget(ino, n)
            except Exception as e:  # forget must not raise (pyfuse3 docs)
                self.log_unexpected("forget", e)

    @_boundary
    async def getattr(self, inode: InodeT, ctx: RequestContext) -> EntryAttributes:
        return self.attrs(self.ov.getattr(inode))

    @_boundary
    async def setattr(self, inode: InodeT, attr: EntryAttributes, fields: SetattrFields,
                      fh: FileHandleT | None, ctx: RequestContext) -> EntryAttributes:
        async with self.gate.mutation():
            await self.admit(self.ov.change_bytes(inode))
            n = self.ov.setattr(
                inode,
                mode=attr.st_mode if fields.update_mode else None,
                uid=attr.st_uid if fields.update_uid else None,
                gid=attr.st_gid if fields.update_gid else None,
                size=attr.st_size if fields.update_size else None,
                atime_ns=attr.st_atime_ns if fields.update_atime else None,
                mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
                ctime_ns=attr.st_ctime_ns if fields.update_ctime else None,
                kill_suidgid=bool(getattr(fields, "kill_suidgid", False)))
        return self.attrs(n)

    @_boundary
    async def readlink(self, inode: InodeT, ctx: RequestContext) -> FileNameT:
        return FileNameT(self.ov.readlink(inode))

    @_boundary
    async def mknod(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, rdev: int,
                    ctx: RequestContext) -> EntryAttributes:
        async with self.gate.mutation():
            await self.admit(self.ov.change_bytes(parent_inode, name))
            return self.attrs(self.ov.mknod(parent_inode, name, mode, rdev, ctx.uid, ctx.gid))

    @_boundary
    async def mkdir(self, parent_inode: InodeT, name: FileNameT, mode: ModeT,
                    ctx: RequestContext) -> EntryAttributes:
        async with self.gate.mutation():
            await self.admit(self.ov.change_bytes(parent_inode, name))
            return self.attrs(self.ov.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_boundary
    async def symlink(self, parent_inode: InodeT, name: FileNameT, target: FileNameT,
                      ctx: RequestContext) -> EntryAttributes:
        async with self.gate.mutation():
            await self.admit(self.ov.change_bytes(parent_inode, name) + len(target))
            return self.attrs(self.ov.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    def _ino_at(self, parent: int, name: bytes) -> int:
        """The inode number ``name`` in directory ``parent`` names, 0 for none."""
        try:
            n = self.ov._child(self.ov._dir(parent), name)
        except (OSError, KeyError):
            return 0
        return 0 if n is None else n.ino

    async def _unguard(self, ctx: RequestContext, *names: tuple[int, bytes]) -> None:
        """Before the dentries ``names`` ((parent inode, name) pairs) are removed or
        replaced for the requester of ``ctx``: stop the running sandboxes covering their
        objects (fusefs/guard.py). With no await after it, the operation then runs before
        any new registration."""
        if self.guard.by_ino:
            await self.guard.clear(ctx.pid, *(self._ino_at(p, n) for p, n in names))

    @_boundary
    async def unlink(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        async with self.gate.mutation():
            await self._unguard(ctx, (parent_inode, bytes(name)))
            await self.admit(self.ov.change_bytes(parent_inode, name))
            self.ov.unlink(parent_inode, name)

    @_boundary
    async def rmdir(self, parent_inode: InodeT, name: FileNameT, ctx: RequestContext) -> None:
        async with self.gate.mutation():
            await self._unguard(ctx, (parent_inode, bytes(name)))
            await self.admit(self.ov.change_bytes(parent_inode, name))
            self.ov.rmdir(parent_inode, name)

    @_boundary
    async def rename(self, parent_inode_old: InodeT, name_old: FileNameT,
                     parent_inode_new: InodeT, name_new: FileNameT, flags: FlagT,
                     ctx: RequestContext) -> None:
        async with self.gate.mutation():
            # both names: the source's object leaves its name, the target's is replaced
            # (or, with RENAME_EXCHANGE, moved)
            await self._unguard(ctx, (parent_inode_old, bytes(name_old)),
                                (parent_inode_new, bytes(name_new)))
            await self.admit(self.ov.change_bytes(parent_inode_old, bytes(name_old))
                             + self.ov.change_bytes(parent_inode_new, bytes(name_new)))
            self.ov.rename(parent_inode_old, bytes(name_old), parent_inode_new,
                           bytes(name_new), flags)

    @_boundary
    async def link(self, inode: InodeT, new_parent_inode: InodeT, new_name: FileNameT,
                   ctx: RequestContext) -> EntryAttributes:
        async with self.gate.mutation():
            if self.guard.by_ino:   # a new name of a covered object: no cover on it
                await self.guard.clear(ctx.pid, inode)
            await self.admit(self.ov.change_bytes(inode)
                             + self.ov.change_bytes(new_parent_inode, bytes(new_name)))
            return self.attrs(self.ov.link(inode, new_parent_inode, new_name))

    # -- files -----------------------------------------------------------------------------

    def _fh(self, fh: int, inode: int | None) -> int:
        """``fh``, or for a request without a handle (no-open mode) one for ``inode``."""
        if fh or not inode:
            return fh
        return self.ov.inode_fh(inode)

    @_boundary
    async def open(self, inode: InodeT, flags: FlagT, ctx: RequestContext) -> FileInfo:
        if self.no_open:  # the kernel opens on its own from now on (file.c, no_open)
            raise FUSEError(errno.ENOSYS)
        writable = flags & os.O_ACCMODE != os.O_RDONLY or bool(flags & os.O_TRUNC)
        async with self.gate.opening(writable):
            if flags & os.O_TRUNC:  # truncates: marks rows as a setattr does
                await self.admit(self.ov.change_bytes(inode))
            return FileInfo(fh=FileHandleT(self.ov.open(inode, flags)), keep_cache=True)

    @_boundary
    async def create(self, parent_inode: InodeT, name: FileNameT, mode: ModeT, flags: FlagT,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        if self.no_open:
            # The kernel sends RELEASE for every file made by CREATE, even on a connection
            # that opens files itself. Answered ENOSYS once, it makes new files with MKNOD
            # from then on and opens them as every other file (fs/fuse/dir.c, no_create):
            # one request fewer per file made.
            raise FUSEError(errno.ENOSYS)
        async with self.gate.mutation():
            await self.admit(self.ov.change_bytes(parent_inode, name))
            fh, n = self.ov.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
            return FileInfo(fh=FileHandleT(fh), keep_cache=True), self.attrs(n)

    @_boundary
    async def read(self, fh: FileHandleT, off: int, size: int,
                   inode: InodeT | None = None) -> bytes:
        h = self._fh(fh, inode)
        await self._load_chunks(h, off, size, whole=False)
        return self.ov.read(h, off, size)

    @_boundary
    async def write(self, fh: FileHandleT, off: int, buf: bytes,
                    inode: InodeT | None = None, flags: int = 0) -> int:
        async with self.gate.mutation():
            h = self._fh(fh, inode)
            await self._load_chunks(h, off, len(buf))
            node = self.ov.handle(h).node
            # Inline content grows by the zeros before ``off`` too (a write past its end).
            grown = min(off + len(buf), INLINE_MAX) - len(node.inline or b"")
            await self.admit(self.ov.change_bytes(node.ino)
                             + max(min(len(buf), INLINE_MAX), grown))
            return self.ov.write(h, off, buf, bool(flags & self._kill_write_flag))

    async def flush(self, fh: FileHandleT, inode: InodeT | None = None) -> None:
        """ENOSYS: the kernel then stops sending FLUSH on every close(2) of this
        connection. Durability is promised at fsync (CONTRACT 2.5), not at close."""
        raise FUSEError(errno.ENOSYS)

    @_boundary
    async def release(self, fh: FileHandleT, inode: InodeT | None = None) -> None:
        self.ov.release(fh)

    @_boundary
    async def fsync(self, fh: FileHandleT, datasync: bool, inode: InodeT | None = None) -> None:
        async with self.gate.mutation():
            fd = self.ov.sync_fd(self._fh(fh, inode))
            if fd is not None:
                def sync() -> None:
                    try:
                        os.fdatasync(fd)
                    finally:
                        os.close(fd)
                await trio.to_thread.run_sync(sync)
            await self.commit(durable=True)

    # -- directories -------------------------------------------------------------------

    @_boundary
    async def opendir(self, inode: InodeT, ctx: RequestContext) -> FileHandleT:
        if self.no_open:  # listings then kept by default (FOPEN_CACHE_DIR)
            raise FUSEError(errno.ENOSYS)
        fh = FileHandleT(self.ov.opendir(inode))
        if binding.EXTENDED:  # the patched binding takes a FileInfo here
            return cast(FileHandleT, FileInfo(fh=fh, **DIR_CACHE))
        return fh

    @_boundary
    async def readdir(self, fh: FileHandleT, start_id: int, token: ReaddirToken,
                      inode: InodeT | None = None) -> None:
        ov = self.ov
        entries = (ov.readdir_inode(inode, start_id) if not fh and inode
                   else ov.readdir(fh, start_id))
        given = 0
        last = start_id
        for name, n, cookie in entries:
            dot = name in (b".", b"..")
            if not pyfuse3.readdir_reply(token, FileNameT(name), self.attrs(n), cookie):
                if not dot:
                    ov.release_unused(n)
                if given and self._nursery is not None:
                    # The kernel asks for the rest from ``last`` once it has taken in
                    # this part: make the nodes of the next part meanwhile.
                    self._nursery.start_soon(self._list_ahead, fh, inode or 0, last, given)
                break
            if not dot:  # readdirplus counts a lookup per accepted entry (trap 5)
                ov.remember(n)
            given += 1
            last = cookie

    async def _list_ahead(self, fh: int, inode: int, start: int, count: int) -> None:
        """``Overlay.list_ahead`` as a background task: a failure only loses the head
        start (the READDIR makes what is missing), so it is logged, never raised."""
        try:
            self.ov.list_ahead(fh, inode, start, count)
        except Exception as e:
            log.debug("making a listing's next nodes ahead failed: %s", e)

    @_boundary
    async def releasedir(self, fh: FileHandleT, inode: InodeT | None = None) -> None:
        self.ov.releasedir(fh)

    @_boundary
    async def fsyncdir(self, fh: FileHandleT, datasync: bool,
                       inode: InodeT | None = None) -> None:
        async with self.gate.mutation():
            await self.commit(durable=True)

    # -- the rest --------------------------------------------------------------------------

    @_boundary
    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        s = StatvfsData()
        for k, v in self.ov.statfs().items():
            setattr(s, k, v)
        return s

    @_boundary
    async def access(self, inode: InodeT, mode: ModeT, ctx: RequestContext) -> bool:
        groups = pyfuse3.get_sup_groups(ctx.pid) | {ctx.gid}
        return self.ov.access(inode, mode, ctx.uid, groups)

    @_boundary
    async def setxattr(self, inode: InodeT, name: XAttrNameT, value: bytes,
                       ctx: RequestContext) -> None:
        async with self.gate.mutation():
            await self.admit(self.ov.change_bytes(inode) + len(name) + len(value))
            self.ov.setxattr(inode, name, value)

    @_boundary
    async def getxattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> bytes:
        # The kernel asks for security.capability before every write and chown: a missing
        # attribute is answered without building an OSError to translate.
        v = self.ov.xattr(inode, name)
        if v is None:
            if name.startswith(self.absent_xattr_prefixes):  # as the patched binding says
                raise FUSEError(self.absent_xattr_errno)
            raise FUSEError(errno.ENODATA)
        return v

    @_boundary
    async def listxattr(self, inode: InodeT, ctx: RequestContext) -> Sequence[XAttrNameT]:
        return [XAttrNameT(n) for n in self.ov.listxattr(inode)]

    @_boundary
    async def removexattr(self, inode: InodeT, name: XAttrNameT, ctx: RequestContext) -> None:
        async with self.gate.mutation():
            await self.admit(self.ov.change_bytes(inode))
            self.ov.removexattr(inode, name)
