"""Mount subcommands: ``mount`` (read-only snapshot or read-write session) and ``umount``.

``rewindfs mount --ro REF MNT`` serves a snapshot read-only; ``rewindfs mount REF MNT
--state DIR`` serves a session overlay whose upper lives in DIR; ``rewindfs mount MNT
--state DIR`` remounts DIR on the base it records. By default the command starts the
daemon in the background and returns once the mount serves (exit 0) or with a one-line
error (exit 9, or the error's own code); ``--foreground`` makes this process the daemon.
``rewindfs umount MNT`` unmounts and waits until the daemon has persisted everything; it
exits 9 with the daemon's error if the daemon failed (for example if persisting failed).
FUSE modules are imported inside handlers.
"""

from __future__ import annotations

import argparse
import errno
import os
import select
import stat
import subprocess
import sys
import time
from typing import Any

from rewindfs.cli import SHARED_STORE_ENV, add_json, emit, open_store
from rewindfs.cmd_store import add_quota_args

EXIT_MOUNT = 9
READY_TIMEOUT_S = 120.0


class UsageError(Exception):
    """The arguments do not describe a mount (exit code 2)."""

    exit_code = 2


class DaemonError(Exception):
    """The background daemon reported that it cannot serve (exit code 9)."""

    exit_code = EXIT_MOUNT


def register(sub: Any) -> None:
    p = sub.add_parser("mount", help="mount a snapshot (--ro) or a session overlay (--state)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("targets", nargs="+", metavar="[REF] MNT",
                   help="Ref to serve (optional with --state: the recorded base) and the "
                        "mount point")
    p.add_argument("--ro", action="store_true", help="serve REF read-only (EROFS on changes)")
    p.add_argument("--state", metavar="DIR",
                   help="session state directory holding the upper layer (locked while "
                        "mounted)")
    p.add_argument("--foreground", action="store_true",
                   help="run the daemon in this process until unmounted")
    p.add_argument("--allow-other", action="store_true",
                   help="let other users (still subject to permissions) use the mount")
    p.add_argument("--log", metavar="FILE",
                   help="daemon log (default: DIR/daemon.log, or the runtime directory for "
                        "read-only mounts, removed after a clean unmount; stderr with "
                        "--foreground)")
    p.add_argument("--debug", action="store_true", help="log at debug level")
    p.add_argument("--cache-mib", type=int, default=128,
                   help="decompressed lower chunks kept in memory (MiB, default 128)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--no-open", dest="no_open", action="store_const", const=True,
                     default=None,
                     help="no-open mode (the default with the patched pyfuse3; refused "
                          "with a stock one): the kernel stops sending OPEN/RELEASE and "
                          "OPENDIR/RELEASEDIR, open writers are found by a /proc scan "
                          "(see README)")
    how.add_argument("--open-handles", dest="no_open", action="store_const", const=False,
                     help="every open and close reaches the daemon, which counts open "
                          "and writable handles (the mode of a stock pyfuse3)")
    p.add_argument("--no-follow-cpu", dest="follow_cpu", action="store_false",
                   help="leave the serving thread's CPU to the scheduler (by default, in "
                        "no-open mode, it moves to the CPU of a process making requests "
                        "one after another; see README)")
    add_quota_args(p)
    p.add_argument("--stats-file", metavar="FILE", help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    add_json(p)
    p.set_defaults(handler=cmd_mount)

    p = sub.add_parser("umount", help="unmount and wait for the daemon to persist and exit")
    p.add_argument("mountpoint", metavar="MNT")
    p.add_argument("--lazy", action="store_true",
                   help="detach even while busy (fusermount3 -uz)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds to wait for the daemon to exit (default 60)")
    add_json(p)
    p.set_defaults(handler=cmd_umount)


def _parse_targets(args: argparse.Namespace) -> tuple[str | None, str]:
    t = args.targets
    if len(t) > 2:
        raise UsageError("mount takes [REF] MNT")
    ref, mnt = (t[0], t[1]) if len(t) == 2 else (None, t[0])
    if args.ro and args.state:
        raise UsageError("--ro serves a snapshot without a state directory; drop --state")
    if args.ro and ref is None:
        raise UsageError("--ro needs a REF")
    if not args.ro and not args.state:
        raise UsageError("a read-write mount needs --state DIR (or use --ro)")
    if args.ro and (args.quota_bytes is not None or args.quota_inodes is not None):
        raise UsageError("quotas cap a session's upper layer: they need --state, not --ro")
    return ref, os.path.abspath(mnt)


def _checked_targets(args: argparse.Namespace) -> tuple[str | None, str]:
    """The Ref (resolved) and mount point of ``mount``, checked: raises InvalidRefError,
    RefNotFoundError, UsageError, MountError (a mount there, dead or alive; not a
    directory)."""
    from fusefs.errors import MountError
    from fusefs.mounts import dead, is_mounted

    ref, mnt = _parse_targets(args)
    if ref is not None:
        from rewindfs.cmd_store import parse_ref
        from store.config import is_store_dir

        if is_store_dir(args.store):
            # A prefix or @label resolved; RefNotFoundError (exit 4, as for sessions and
            # restore) before anything starts
            ref = str(parse_ref(args, ref))
            open_store(args).root_tree(ref)
        else:
            from store.ref import Ref

            Ref.parse(ref)  # InvalidRefError (exit 3) before anything starts
    if is_mounted(mnt):
        if dead(mnt):  # its daemon was killed
            raise MountError(mnt, "a dead mount is left there (its daemon is gone); run "
                                  "`rewindfs umount` on it first")
        raise MountError(mnt, "something is already mounted there")
    try:
        is_dir = stat.S_ISDIR(os.stat(mnt).st_mode)
    except FileNotFoundError:
        raise MountError(mnt, "mount point does not exist (mkdir it)") from None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise MountError(mnt, "mount point name too long (255 bytes at most per name, "
                                  "4095 in all)") from None
        raise MountError(mnt, f"mount point cannot be reached ({e.strerror})") from None
    if not is_dir:
        raise MountError(mnt, "mount point is not a directory")
    return ref, mnt


def cmd_mount(args: argparse.Namespace) -> int:
    from fusefs.daemon import MountConfig, fd_ready, refuse_no_open, refuse_overlap, serve
    from fusefs.mounts import record_path
    from fusefs.upper import make_state_dir

    if args.foreground:
        # The daemon a background mount started: a refusal of these checks (a mount that
        # appeared at the path since the CLI made them) must reach the waiting CLI.
        ready = fd_ready(args.ready_fd)
        try:
            ref, mnt = _checked_targets(args)
        except Exception as e:
            ready(str(e))
            raise
    else:
        ref, mnt = _checked_targets(args)
    store = os.path.abspath(args.store)
    state = os.path.abspath(args.state) if args.state else None
    log_path = os.path.abspath(args.log) if args.log else None
    stats_path = os.path.abspath(args.stats_file) if args.stats_file else None

    cfg = MountConfig(store_root=store, mountpoint=mnt, ref=ref, state_dir=state,
                      readonly=args.ro, allow_other=args.allow_other, log_path=log_path,
                      stats_path=stats_path, debug=args.debug, cache_mib=args.cache_mib,
                      no_open=args.no_open, follow_cpu=args.follow_cpu,
                      quota_bytes=args.quota_bytes,
                      quota_inodes=args.quota_inodes)
    if args.foreground:
        return serve(cfg, ready)
    refuse_overlap(cfg)
    refuse_no_open(cfg)

    if log_path is None:
        if state is not None:
            make_state_dir(state)
            log_path = os.path.join(state, "daemon.log")
        else:
            log_path = record_path(mnt, ".log")
    argv = [sys.executable, "-P", "-m", "rewindfs", "--store", store, "mount", *(
        [ref] if ref is not None else []), mnt, "--foreground", "--log", log_path]
    if args.ro:
        argv.append("--ro")
    if state is not None:
        argv += ["--state", state]
    if args.allow_other:
        argv.append("--allow-other")
    if args.debug:
        argv.append("--debug")
    if args.no_open is not None:
        argv.append("--no-open" if args.no_open else "--open-handles")
    if not args.follow_cpu:
        argv.append("--no-follow-cpu")
    if args.cache_mib != 128:
        argv += ["--cache-mib", str(args.cache_mib)]
    if args.quota_bytes is not None:
        argv += ["--quota-bytes", str(args.quota_bytes)]
    if args.quota_inodes is not None:
        argv += ["--quota-inodes", str(args.quota_inodes)]
    if stats_path is not None:
        argv += ["--stats-file", stats_path]
    r, w = os.pipe()
    argv += ["--ready-fd", str(w)]
    # The daemon gets ``--store`` the store directory (for a shared store: this host's
    # local directory, whose store.json names it); the shared options in the environment
    # would contradict that (a catalog without an s3:// store is a usage error, exit 2).
    env = {k: v for k, v in os.environ.items() if k not in SHARED_STORE_ENV}
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(argv, pass_fds=(w,), stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=logf, env=env,
                                start_new_session=True, close_fds=True)
    os.close(w)
    msg = _read_ready(r, proc)
    if msg != "ok":
        raise DaemonError(msg.removeprefix("error: "))
    emit(args, {"mountpoint": mnt, "pid": proc.pid, "ref": ref, "state": state,
                "log": log_path}, f"mounted at {mnt} (pid {proc.pid})")
    return 0


def _read_ready(fd: int, proc: subprocess.Popen[bytes]) -> str:
    """The daemon's one-line readiness report, or why there is none."""
    buf = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                proc.kill()
                return f"daemon did not report ready within {READY_TIMEOUT_S:.0f} s"
            rl, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not rl:
                continue
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buf += chunk
    finally:
        os.close(fd)
    text = buf.decode(errors="replace").strip()
    if text:
        return text
    try:
        rc = proc.wait(5)
    except subprocess.TimeoutExpired:
        rc = None
    return f"daemon exited with {rc} before mounting (see its log)"


def cmd_umount(args: argparse.Namespace) -> int:
    from fusefs.errors import MountError
    from fusefs.mounts import alive, clear_dead, is_mounted, read_record, take_exit_record

    mnt = os.path.abspath(args.mountpoint)
    if not is_mounted(mnt):
        raise MountError(mnt, "not mounted")
    rec = read_record(mnt)
    r = subprocess.run(["fusermount3", "-uz" if args.lazy else "-u", mnt],
                       capture_output=True, text=True)
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
        if "busy" in why.lower() and not args.lazy:
            from fusefs.errors import MountBusyError
            from fusefs.mounts import processes_using

            pid = rec.get("pid") if rec is not None else None
            users = processes_using(mnt, exclude=(pid,) if isinstance(pid, int) else ())
            raise MountBusyError(mnt, [f"{p} {cmd}" for p, cmd in users])
        raise MountError(mnt, why.removeprefix("fusermount3: "))
    waited = 0.0
    if rec is not None and isinstance(rec.get("pid"), int):
        pid, started = rec["pid"], rec.get("started")
        t0 = time.monotonic()
        while alive(pid, started):
            if time.monotonic() - t0 > args.timeout:
                raise MountError(mnt, f"daemon {pid} still running {args.timeout:.0f} s "
                                      "after unmount")
            time.sleep(0.02)
        waited = time.monotonic() - t0
        clear_dead(mnt, rec)  # a daemon killed (-9) left its record, lock and socket
        ex = take_exit_record(mnt)
        if ex is not None and ex.get("pid") == pid and ex.get("started") == started:
            raise MountError(mnt, f"unmounted, but the daemon failed (exit {ex.get('code')}): "
                                  f"{ex.get('error')}")
    emit(args, {"mountpoint": mnt, "elapsed_ms": round(waited * 1000, 1)},
         f"unmounted {mnt}")
    return 0
