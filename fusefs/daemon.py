"""The mount daemon: one process serving one mount (pyfuse3 allows one per process).

``serve(config, ready)`` opens the store and (for a session mount) locks and loads the
state directory, mounts, reports readiness through ``ready``, serves until the mount is
unmounted or SIGINT/SIGTERM arrives, then persists everything durably, unmounts and
returns an exit code. A session mount also serves its control socket (``control.py``:
checkpoint, restore, status). SIGUSR1 (and the exit) writes request counts per operation
and the CPU time to ``config.stats_path`` (default: ``stats.json`` next to the log; for a
log in the runtime directory, ``<key>.stats.json`` beside it). The log goes to
``config.log_path`` (session mounts: ``daemon.log`` in the state directory; a mount without
one, as the CLI starts it: ``<key>.log`` in the runtime directory's ``mounts``, removed
with that stats file when the daemon ends with 0, kept after a failure) or stderr.

It must never touch its own mount point from the serving thread (PYFUSE3.md trap 10).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import resource
import signal
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import FuseFSError, MountError, StateDirError, describe, leaf_errors
from .mounts import (
    EXIT_SUFFIX,
    claim_mountpoint,
    mount_device,
    mount_id,
    record_path,
    release_claim,
    remove_record,
    start_time,
    still_mounted,
    take_exit_record,
    write_record,
)

if TYPE_CHECKING:
    from store.objects import Store
    from store.sharedgc import MountPins

    from .overlay import Overlay

log = logging.getLogger("rewindfs.daemon")

Ready = Callable[[str | None], None]
"""``ready(None)`` once the mount serves; ``ready("one-line error")`` if it never will."""


@dataclass
class MountConfig:
    """What to serve where. ``ref`` is Ref text (None: the state directory's base)."""

    store_root: str
    mountpoint: str
    ref: str | None = None
    state_dir: str | None = None
    readonly: bool = False
    allow_other: bool = False
    log_path: str | None = None
    stats_path: str | None = None
    debug: bool = False
    cache_mib: int = 128
    quota_bytes: int | None = None  # caps to record in the upper (None: keep what it has)
    quota_inodes: int | None = None
    max_tasks: int = 8  # pyfuse3 worker tasks: requests that wait (fsync, big chunks)
    # do not hold up the others
    # OPEN/OPENDIR answered ENOSYS (README: no-open mode); None: where the patched binding
    # serves (its default), else file handles
    no_open: bool | None = None
    # The serving thread follows a serial requester's CPU (fusefs/affinity.py).
    follow_cpu: bool = True


LOG_KEEP = 10000
"""Log lines kept in memory at most while the log's disk is full."""
LOG_SLACK = 256 << 10
"""Bytes the log file keeps allocated beyond its end (fallocate FALLOC_FL_KEEP_SIZE), so
that what the daemon logs when its disk fills up still has room; renewed every
``LOG_SLACK // 4`` bytes written."""
_FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


class LogFile(logging.Handler):
    """The daemon's log file, made to survive a full disk: it keeps ``LOG_SLACK`` bytes
    allocated beyond its end while there is space, so the lines about a full disk are
    written; a line that still cannot be written (ENOSPC, or any other OSError) is kept in
    memory, at most ``LOG_KEEP`` of them (the oldest are then counted and dropped), and
    written before the next line once the disk has room again. Never raises, so logging
    never fails a request."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.pending: deque[bytes] = deque()
        self.dropped = 0
        self._unslacked = 0  # bytes written since the slack was last renewed
        self._renew_slack()

    def _renew_slack(self) -> None:
        try:
            end = os.fstat(self.fd).st_size
        except OSError:
            return
        if _libc.fallocate(self.fd, _FALLOC_FL_KEEP_SIZE, end, LOG_SLACK) == 0:
            self._unslacked = 0  # else: no space (or no fallocate); tried again later

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode(errors="replace")
        except Exception:
            self.handleError(record)
            return
        if len(self.pending) >= LOG_KEEP:
            self.pending.popleft()
            self.dropped += 1
        self.pending.append(line)
        self._drain()

    def _drain(self) -> bool:
        """Write what is pending; True once nothing is."""
        if self.dropped and self.pending:
            note = (f"({self.dropped} earlier log line(s) were lost: the log's disk was "
                    "full)\n").encode()
            self.pending.appendleft(note)
            self.dropped = 0
        while self.pending:
            buf = self.pending[0]
            try:
                n = os.write(self.fd, buf)
            except OSError:
                return False
            self._unslacked += n
            if n < len(buf):
                self.pending[0] = buf[n:]
                return False
            self.pending.popleft()
        if self._unslacked >= LOG_SLACK // 4:
            self._renew_slack()
        return True

    def close(self) -> None:
        self.acquire()
        try:
            if self.fd >= 0:
                if not self._drain():  # the last resort: stderr (it may be elsewhere)
                    for buf in self.pending:
                        try:
                            os.write(2, buf)
                        except OSError:
                            break
                os.close(self.fd)
                self.fd = -1
        finally:
            self.release()
        super().close()


def _setup_logging(path: str | None, debug: bool) -> None:
    handler: logging.Handler
    if path:
        handler = LogFile(path)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


READAHEAD_KIB = 1024
"""Kernel readahead window of the mount: FUSE sends READs of up to the window (and of up
to 1 MiB, libfuse's max_pages), so a sequential reader costs one request per 1 MiB instead
of one per 128 KiB (the kernel's default window)."""


def _raise_readahead(mountpoint: str) -> None:
    """Widen the mount's readahead window to READAHEAD_KIB through sysfs (root only;
    otherwise, or without sysfs, the kernel default stays). Call it after INIT was answered
    (INIT sets the window). Does not touch the mount."""
    try:
        dev = mount_device(mountpoint)
        if dev is None:
            return
        path = f"/sys/class/bdi/{dev}/read_ahead_kb"
        with open(path) as f:
            if int(f.read()) >= READAHEAD_KIB:
                return
        with open(path, "w") as f:
            f.write(str(READAHEAD_KIB))
    except Exception as e:  # a tuning step: never a reason to stop serving
        log.debug("readahead of %s left at the default: %s", mountpoint, e)


def _open(cfg: MountConfig) -> tuple[Store, Overlay]:
    """Open store, upper and overlay; raises FuseFSError or a store error."""
    from store.config import is_store_dir
    from store.errors import ObjectNotFoundError
    from store.objects import Store
    from store.ref import Ref

    from .lower import Lower
    from .overlay import Overlay
    from .upper import Upper

    if not os.path.isdir(cfg.store_root) or not is_store_dir(cfg.store_root):
        raise MountError(cfg.mountpoint, f"no store at {cfg.store_root}")
    store = Store(cfg.store_root)
    ref = Ref.parse(cfg.ref) if cfg.ref is not None else None

    def require(r: Ref) -> None:
        try:
            store.get_tree(r.tree_id)
        except ObjectNotFoundError:
            raise MountError(cfg.mountpoint, f"{r} is not in the store") from None

    upper = None
    try:
        if ref is not None:
            require(ref)  # before a new state directory records it as its base
        if cfg.state_dir is not None:
            upper = Upper.open(cfg.state_dir, store_root=store.root,
                               chunk_size=store.chunk_size, ref=ref)
            upper.set_quota(cfg.quota_bytes, cfg.quota_inodes)
            ref = upper.base
            require(ref)
        if ref is None:
            raise MountError(cfg.mountpoint, "a read-only mount needs a Ref")
        return store, Overlay(Lower(store, ref, cache_bytes=cfg.cache_mib << 20), upper)
    except BaseException:
        if upper is not None:
            upper.close()
        raise


def _pin(store: Store, ov: Overlay, cfg: MountConfig) -> MountPins | None:
    """On a shared store, pin what this mount serves for every host's GC (its Ref, or what
    its state directory pins: store/sharedgc.py ``MountPins``) and check that its base is
    still indexed (a GC that ran meanwhile may have deleted it: MountError). Returns the
    pins (None on an embedded store)."""
    from store.sharedgc import pin_mount

    from .session.fusetree import pinned_refs

    if not store.catalog.shared:
        return None
    pins = pin_mount(store, [ov.lower.ref] if cfg.state_dir is None
                     else pinned_refs(cfg.state_dir))
    if pins is not None and not store.catalog.has(ov.lower.ref.tree_id):
        pins.release()
        raise MountError(cfg.mountpoint, f"{ov.lower.ref} is not in the store")
    return pins


def refuse_no_open(cfg: MountConfig) -> None:
    """Raise MountError if ``cfg`` asks for no-open mode and the binding cannot serve it
    (a stock pyfuse3 does not hand the inode to requests without a handle)."""
    from . import binding

    if cfg.no_open is True and not binding.EXTENDED:
        raise MountError(cfg.mountpoint, "--no-open needs the patched pyfuse3 "
                         f"({binding.describe()})")


def refuse_overlap(cfg: MountConfig) -> None:
    """Raise MountError if the store, state directory, log or stats file lies inside the
    mount point: the daemon must never write through its own mount (it would wait on
    itself)."""
    mnt = os.path.realpath(cfg.mountpoint)
    for what, path in (("store", cfg.store_root), ("state directory", cfg.state_dir),
                       ("log", cfg.log_path), ("stats file", cfg.stats_path)):
        if path is None:
            continue
        real = os.path.realpath(path)
        if real == mnt or real.startswith(mnt.rstrip("/") + "/"):
            raise MountError(cfg.mountpoint, f"the {what} {path} is inside the mount point")


def serve(cfg: MountConfig, ready: Ready) -> int:
    """Run the daemon for ``cfg`` in this process; returns the exit code (0 clean) once
    unmounted. Raises (after ``ready(error)``) FuseFSError or a store error if the mount
    cannot start."""
    import pyfuse3
    import trio

    from . import binding
    from .operations import Operations, mount_options, tune_gc

    cfg.mountpoint = os.path.abspath(cfg.mountpoint)
    try:
        refuse_overlap(cfg)
        refuse_no_open(cfg)
    except MountError as e:
        ready(str(e))
        raise
    if cfg.log_path is None and cfg.state_dir is not None:
        from .upper import make_state_dir

        try:
            make_state_dir(cfg.state_dir)
        except StateDirError as e:
            ready(str(e))
            raise
        cfg.log_path = os.path.join(cfg.state_dir, "daemon.log")
    _setup_logging(cfg.log_path, cfg.debug)
    _raise_fd_limit()
    claim: int | None = None  # held until this daemon is done with the mount point
    try:
        claim = claim_mountpoint(cfg.mountpoint)  # before the state directory is touched
        store, ov = _open(cfg)
    except Exception as e:
        if claim is not None:
            release_claim(cfg.mountpoint, claim)
        log.error("cannot mount %s: %s", cfg.mountpoint, e)
        ready(str(e))
        raise
    gate = None
    # A shared store's GCs on other hosts cannot read this host's mount records.
    from store.sharedgc import unpin_mount

    mount_pin = None
    try:
        mount_pin = _pin(store, ov, cfg)
    except Exception as e:
        log.error("cannot mount %s: pinning what it serves in the catalog failed: %s",
                  cfg.mountpoint, e)
        unpin_mount(mount_pin)
        ready(str(e))
        release_claim(cfg.mountpoint, claim)
        raise
    if not ov.readonly:
        from .gate import Gate

        gate = Gate()  # checkpoint and restore pause changes through it
    ops = Operations(ov, gate=gate, no_open=cfg.no_open, follow_cpu=cfg.follow_cpu)
    options = mount_options(readonly=ov.readonly, allow_other=cfg.allow_other)
    # A log in the runtime directory (the CLI's for a mount without a state directory) is
    # this mount's alone, and so is its stats file; a clean end leaves neither behind.
    runtime_log = cfg.log_path is not None and cfg.log_path == record_path(cfg.mountpoint,
                                                                          ".log")
    stats_path = cfg.stats_path or (
        record_path(cfg.mountpoint, ".stats.json") if runtime_log else
        os.path.join(os.path.dirname(cfg.log_path), "stats.json") if cfg.log_path else None)

    def write_stats() -> None:
        if stats_path is None:
            return
        tmp = f"{stats_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(ops.stats(), pid=os.getpid()), f, sort_keys=True)
        os.replace(tmp, stats_path)

    async def signals(nursery: trio.Nursery) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGUSR1) as it:
            async for sig in it:
                if sig == signal.SIGUSR1:
                    try:
                        write_stats()
                    except OSError as e:
                        log.error("cannot write stats: %s", e)
                    continue
                log.info("signal %d: unmounting", sig)
                if our_mount is None:  # not mounted yet: just leave
                    nursery.cancel_scope.cancel()
                    return
                pyfuse3.terminate()
                return

    our_mount: int | None = None
    init_error: MountError | None = None

    async def main() -> None:
        nonlocal our_mount, init_error
        async with trio.open_nursery() as nursery:
            nursery.start_soon(signals, nursery)
            # Everything a client may look for once the mount shows up in the mount table
            # (control socket, mount record) exists before the mount does.
            if cfg.state_dir is not None:
                from .control import Live
                from .control import serve as serve_control

                assert gate is not None
                live = Live(ops, store, gate, mountpoint=cfg.mountpoint,
                            state_dir=os.path.abspath(cfg.state_dir))
                live.mount_pins = mount_pin
                await nursery.start(serve_control, live)
            take_exit_record(cfg.mountpoint)  # a failed earlier daemon's, nobody read it
            write_record(cfg.mountpoint, {
                "pid": os.getpid(), "started": start_time(os.getpid()),
                "mountpoint": cfg.mountpoint, "ref": str(ov.lower.ref),
                "state": cfg.state_dir, "log": cfg.log_path, "readonly": ov.readonly,
                "store": store.root})
            try:
                binding.init(ops, cfg.mountpoint, options)  # the helper's words kept
            except Exception as e:
                init_error = MountError(cfg.mountpoint, f"cannot mount: {e}")
                nursery.cancel_scope.cancel()
                return
            our_mount = mount_id(cfg.mountpoint)
            nursery.start_soon(ops.commit_loop)
            nursery.start_soon(ops.affinity_loop)
            ops.start_background(nursery)

            def serving() -> None:
                log.info("serving %s at %s%s", ov.lower.ref, cfg.mountpoint,
                         f" with state {cfg.state_dir}" if cfg.state_dir else " read-only")
                ready(None)
                # The kernel narrows the window when INIT is answered, which happens after
                # this callback returns: widen it from a task that runs after the reply.
                nursery.start_soon(trio.to_thread.run_sync, _raise_readahead, cfg.mountpoint)

            ops.on_init = serving  # ready once the kernel's INIT is answered
            try:
                await pyfuse3.main(min_tasks=1, max_tasks=cfg.max_tasks)
            finally:  # the teardown runs on the daemon's whole mask, at normal weight
                if ops.affinity is not None:
                    ops.affinity.disable("the session ended")
            nursery.cancel_scope.cancel()

    code = 0
    loop_error: BaseException | None = None
    try:
        tune_gc()
        trio.run(main)
    except BaseException as e:  # the loop itself failed: persist what we can, then leave
        loop_error = e
        log.error("serving loop ended: %s", describe(e), exc_info=e)
        code = 9
    if our_mount is None:  # never mounted: clean up, then report the first cause
        err = init_error or _start_error(cfg.mountpoint, loop_error)
        for what, step in (("mount record", lambda: remove_record(cfg.mountpoint, os.getpid())),
                           # an upper this start made was never served: nothing to keep
                           ("upper", ov.upper.discard if ov.upper is not None
                            and ov.upper.created else ops.close),
                           ("mount pin", lambda: unpin_mount(mount_pin)),
                           ("store", store.close)):
            try:
                step()
            except Exception as e:
                log.error("closing the %s after the failed start: %s", what, describe(e))
        log.error("%s", err)
        ready(str(err))
        release_claim(cfg.mountpoint, claim)
        raise err
    ready("the kernel ended the session before it was initialized")  # no-op once ready
    failure: str | None = None
    try:
        ops.close()
    except Exception as e:
        log.error("persisting the upper at unmount failed: %s: %s", type(e).__name__, e)
        code = 9
        failure = f"persisting the upper at unmount failed: {e}"
    try:
        # Unmount unless someone else already did: after a signal, a failed loop, or a
        # kernel that ended the session without an unmount, the mount must not stay.
        pyfuse3.close(unmount=our_mount is not None and still_mounted(cfg.mountpoint,
                                                                      our_mount))
    except Exception as e:
        log.error("unmount failed: %s", e)
        code = 9
        failure = failure or f"unmount failed: {e}"
    if code != 0:  # for `rewindfs umount`, which waits for this process but is not its parent
        try:
            write_record(cfg.mountpoint, {
                "pid": os.getpid(), "started": start_time(os.getpid()), "code": code,
                "error": failure or f"the daemon exited with {code} (see its log)"},
                EXIT_SUFFIX)
        except Exception as e:  # a runtime directory refused: the log still says it
            log.error("cannot write the exit record: %s", e)
    remove_record(cfg.mountpoint, os.getpid())
    clean = code == 0 and runtime_log
    if not (clean and cfg.stats_path is None):
        try:
            write_stats()
        except OSError:
            pass
    unpin_mount(mount_pin)
    store.close()
    log.info("unmounted %s (%d requests)", cfg.mountpoint, sum(ops.counts.values()))
    if clean:  # while the claim is held, so no other daemon serves there yet
        for path in (cfg.log_path, None if cfg.stats_path else stats_path):
            try:
                if path is not None:
                    os.unlink(path)
            except OSError:
                pass
    release_claim(cfg.mountpoint, claim)
    return code


def _start_error(mountpoint: str, loop_error: BaseException | None) -> FuseFSError:
    """Why a daemon stopped before it mounted: the typed error its loop raised (out of
    trio's exception group) when there is one, else a MountError naming the cause."""
    if loop_error is None:
        return MountError(mountpoint, "the daemon stopped before mounting")
    leaves = leaf_errors(loop_error)
    if len(leaves) == 1 and isinstance(leaves[0], FuseFSError):
        return leaves[0]
    return MountError(mountpoint, f"the daemon stopped before mounting: {describe(loop_error)}")


def fd_ready(fd: int | None) -> Ready:
    """A ``ready`` that writes ``ok`` or ``error: ...`` to ``fd`` once, then closes it."""
    done = False

    def ready(err: str | None) -> None:
        nonlocal done
        if done or fd is None:
            return
        done = True
        msg = "ok\n" if err is None else "error: " + " ".join(err.split()) + "\n"
        try:
            os.write(fd, msg.encode())
            os.close(fd)
        except OSError:
            pass

    return ready

