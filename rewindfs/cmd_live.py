"""Live-mount subcommands: ``checkpoint``, ``restore``, ``status`` of a mounted session, and
the mount and unified forms of ``diff``.

``rewindfs checkpoint MNT [--label TEXT]`` prints the Ref; ``rewindfs restore MNT REF
[--path P ...] [--discard] [--timeout S] [--wait-writers SECONDS]`` repoints the mount, or
with ``--path`` only those paths (the current state is checkpointed first unless
``--discard``; files open for writing are detached unless ``--wait-writers`` waits for them); ``rewindfs status MNT`` shows the lower Ref, dirty and
detached inodes and open handles. Each talks to the mount daemon through its control socket
(``fusefs.control``); ``elapsed_ms`` in ``--json`` output is measured inside the daemon.
``rewindfs diff MNT`` lists the changes since the last checkpoint and ``--unified`` (also for
``diff REF_A REF_B``) prints a unified text diff. Exit codes: 9 when no live mount answers,
10 for a refused checkpoint or restore (``kind`` in ``--json`` errors), 3 invalid Ref.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from rewindfs.cli import add_json, emit, open_store
from rewindfs.cmd_store import change_lines
from store.pathtext import text_paths


def seconds(text: str) -> float:
    """An argparse type: a duration in seconds, >= 0 (else a usage error, exit 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, not {text}")
    return value


def register(sub: Any) -> None:
    p = sub.add_parser("checkpoint", help="checkpoint a mounted session; print the Ref")
    p.add_argument("mountpoint", metavar="MNT")
    p.add_argument("--label", help="label shown by 'list'")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for write permits to end (default 60)")
    add_json(p)
    p.set_defaults(handler=cmd_checkpoint, daemon_completes=True)

    p = sub.add_parser("restore", help="repoint a mounted session at a Ref")
    p.add_argument("mountpoint", metavar="MNT")
    p.add_argument("ref", metavar="REF")
    p.add_argument("--discard", action="store_true",
                   help="drop the changes since the last checkpoint instead of "
                        "checkpointing them first")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds to wait for write permits (tool calls in flight) to end "
                        "(default 60)")
    p.add_argument("--wait-writers", type=seconds, default=None, metavar="SECONDS",
                   help="wait up to SECONDS for files open for writing to close, else refuse "
                        "(exit 10, permit_failed); default: never wait, open files keep "
                        "their old, detached inodes")
    p.add_argument("--path", action="append", dest="paths", metavar="P",
                   help="restore only this path (relative to the mount root; a file, a "
                        "directory, or absent in REF: then it is removed); repeatable; the "
                        "rest of the tree stays as it is")
    add_json(p)
    p.set_defaults(handler=cmd_restore, daemon_completes=True)

    p = sub.add_parser("status", help="lower Ref, dirty and detached inodes, open handles "
                                      "of a mounted session")
    p.add_argument("mountpoint", metavar="MNT")
    add_json(p)
    p.set_defaults(handler=cmd_status)


class _Live:
    """The control client of the mount at ``mnt``; a daemon that does not answer (gone,
    or its socket stale) is NotLiveError (exit 9), not a bare OSError. Where the daemon is
    gone and left its mount dead, the error says so and how to recover (its ``fix``)."""

    def __init__(self, mnt: str, store: str) -> None:
        from fusefs.control import Client, NotLiveError

        self.mnt, self.store = mnt, store
        try:
            self.client = Client.for_mount(mnt)
        except NotLiveError as e:
            raise dead_mount_error(mnt, store) or e from None

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.client, name)

        def call(*args: Any, **kw: Any) -> Any:
            from fusefs.control import NotLiveError

            try:
                return fn(*args, **kw)
            except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError) as e:
                raise dead_mount_error(self.mnt, self.store) or NotLiveError(
                    self.mnt, f"its daemon does not answer ({e})") from None

        return call


def _client(mnt: str, store: str) -> Any:
    return _Live(mnt, store)


def dead_mount_error(path: str, store: str) -> Exception | None:
    """For ``path`` at or inside a rewindfs mount whose daemon is gone (the mount answers
    ENOTCONN): a NotLiveError naming the mount and, as its ``fix``, the commands that
    recover it (for a session, ``session resume``; for a plain mount, ``umount`` then
    ``mount`` again on the same state directory); else None. ``store``: the CLI's store,
    left out of the commands when theirs is the same."""
    import shlex

    from fusefs.control import NotLiveError
    from fusefs.mounts import alive, dead, fstype, recorded_mount

    found = recorded_mount(path)
    if found is None:   # no record (another runtime directory, say): the mount itself
        mnt = os.path.abspath(path)
        while fstype(mnt) is None and mnt != os.path.dirname(mnt):
            mnt = os.path.dirname(mnt)
        found = (mnt, {})
    mnt, rec = found
    pid = rec.get("pid")
    if fstype(mnt) != "fuse.rewindfs" or (
            isinstance(pid, int) and alive(pid, rec.get("started"))) or not dead(mnt):
        return None   # (statfs last: a live daemon that does not answer could block it)
    from fusefs.session.fusetree import ROOTS
    from fusefs.session.registry import RECORD

    state = str(rec.get("state") or "")
    session = bool(state) and os.path.exists(os.path.join(state, RECORD))
    shared = bool(state) and os.path.basename(os.path.dirname(state)) == ROOTS
    # A session's state lies at <store>/sessions/<id>, a shared root's at
    # <store>/sessions/roots/<key>; a plain mount's record names its store.
    theirs = str(rec.get("store") or "") or (
        os.path.dirname(os.path.dirname(state)) if session else
        os.path.dirname(os.path.dirname(os.path.dirname(state))) if shared else "")
    opt = (f"--store {shlex.quote(theirs)} " if theirs and os.path.realpath(theirs)
           != os.path.realpath(store) else "")
    q = shlex.quote(mnt)
    unmount = f"`rewindfs umount {q}` (or `fusermount3 -u {q}`) detaches it"
    kept = "what its upper layer kept (every change fsynced before the daemon died)"
    if session:
        fix = (f"`rewindfs {opt}session resume {os.path.basename(state)}` detaches the dead "
               f"mount and mounts the session again with {kept}")
    elif shared:
        fix = (f"`rewindfs {opt}session resume ID` of one of its sessions (`rewindfs "
               f"{opt}session list`) detaches the dead mount and mounts the root again with "
               f"{kept}")
    elif state:
        fix = (f"{unmount}; then `rewindfs {opt}mount {q} --state {shlex.quote(state)}` "
               f"serves it again with {kept}")
    elif rec.get("ref"):
        fix = f"{unmount}; `rewindfs {opt}mount --ro {rec['ref']} {q}` serves it again"
    else:
        fix = unmount
    who = f" (pid {pid})" if isinstance(pid, int) else ""
    return NotLiveError(mnt, f"its daemon{who} is gone and the mount is dead (every access "
                             "fails with ENOTCONN, 'Transport endpoint is not connected')",
                        fix)


def cmd_checkpoint(args: argparse.Namespace) -> int:
    r = _client(args.mountpoint, args.store).checkpoint(label=args.label,
                                                        timeout_s=args.timeout)
    emit(args, {"ref": r["ref"], "elapsed_ms": r["elapsed_ms"], "unchanged": r["unchanged"],
                "packs": r["packs"], "bytes": r["bytes"]}, r["ref"])
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from store.ref import Ref
    from store.resolve import ref_form

    # The text's form is checked here (InvalidRefError, exit 3, before the daemon is asked);
    # a prefix, @label or @-N on a session is resolved by the daemon against the mount's own
    # store, so it works from inside the mount, where ./agent-data/store is not the store.
    form = ref_form(args.ref)
    ref: Ref | str = form if isinstance(form, Ref) else args.ref
    r = _client(args.mountpoint, args.store).restore(
        ref, discard=args.discard, timeout=args.timeout, wait_writers=args.wait_writers,
        paths=args.paths)
    text = r["ref"] + (f" (was {r['pre_restore']})" if r.get("pre_restore") else "")
    out = {"ref": r["ref"], "pre_restore": r.get("pre_restore"), "changes": r["changes"],
           "detached": r["detached"], "elapsed_ms": r["elapsed_ms"]}
    if args.paths is not None:
        out["source"], out["paths"] = r.get("source"), r.get("paths")
        text += f"\n{text_paths(r.get('paths') or [])} from {r.get('source')}"
    emit(args, out, text)
    return 0


def _quota_text(q: dict[str, Any]) -> str:
    """``12,345 of 10,485,760 bytes, 3 of no cap inodes``: use against the caps."""
    def one(used: Any, cap: Any, unit: str) -> str:
        return f"{int(used or 0):,} {unit}" + (f" of {int(cap):,}" if cap else " (no cap)")

    return (one(q.get("bytes_used"), q.get("bytes_cap"), "bytes") + ", "
            + one(q.get("inodes_used"), q.get("inodes_cap"), "inodes"))


def cmd_status(args: argparse.Namespace) -> int:
    r = _client(args.mountpoint, args.store).status()
    r.pop("ok", None)
    text = "\n".join([
        f"ref:       {r['ref']}",
        f"dirty:     {r['dirty_inodes']} inodes, {r['dirty_bytes']} bytes",
        f"detached:  {r.get('detached_inodes', 0)} inodes (unlinked or removed by a restore, "
        f"still open; in no checkpoint), holding {len(r.get('held_lowers') or [])} "
        f"older lower(s) against gc",
        f"open:      {r['open_handles']} handles ({r['writable_handles']} writable), "
        f"{r['open_dirs']} directories"
        + (" (no-open mode: the daemon keeps no handles, not even for files created "
           f"through the mount; the kernel holds {r.get('kernel_inodes', 0)} inodes)"
           if r.get("no_open") else ""),
        f"writers:   {_writers_text(r)}",
        f"cpu:       {_affinity_text(r.get('affinity'))}",
        f"state:     {r['state']}",
        f"disk:      {_disk_text(r)}",
        f"quota:     {_quota_text(r.get('quota') or {})}",
        *([f"catalog:   {r['catalog']}"] if r.get("catalog") else []),
        f"daemon:    pid {r['pid']}"])
    emit(args, r, text)
    return 0


def _affinity_text(a: dict[str, Any] | None) -> str:
    """``serving thread on CPU 1, following pid 40 (3 moves)`` (fusefs/affinity.py)."""
    if not a:
        return "the scheduler's choice"
    if not a.get("following"):
        return f"the scheduler's choice ({a.get('reason')})"
    moves = (f"{a.get('pins', 0)} moves, left {a.get('others', 0)} times for another "
             f"process's request, {a.get('starved', 0)} for other work")
    if a.get("cpu") is None:
        return f"the scheduler's choice until one process makes the requests ({moves})"
    return f"serving thread on CPU {a['cpu']}, following pid {a.get('pid')} ({moves})"


def _writers_text(r: dict[str, Any]) -> str:
    """``2 files open for writing (by pids 10, 11; found by a scan of /proc, ...)``."""
    n = int(r.get("open_writers") or 0)
    text = f"{n} file(s) open for writing"
    if r.get("writers_found_by") != "proc_scan":
        return text + " (open handles)"
    pids = r.get("writer_pids") or []
    if pids:
        text += " by pid " + ", ".join(str(p) for p in pids)
    unseen = int(r.get("writers_unseen_processes") or 0)
    return text + (" (found by a scan of /proc; "
                   + (f"{unseen} process(es) the daemon may not inspect, whose writers are "
                      "not seen)" if unseen else "every process inspected)"))


def _disk_text(r: dict[str, Any]) -> str:
    if not r.get("disk_full"):
        return "ok"
    return (f"full (ENOSPC): only removals are accepted; {r.get('spilled_batches', 0)} "
            f"batch(es) of changes in the spill, {r.get('unwritten_batches', 0)} in memory")


def is_mount_arg(arg: str) -> bool:
    """True if ``arg`` names a directory (a mount point), not a Ref."""
    return not arg.startswith("v1:") and os.path.isdir(arg)


def _diff_step(args: argparse.Namespace) -> int:
    """``diff ID --step N``: what step N of session ID changed (from its journal)."""
    from fusefs.session.errors import SessionError
    from fusefs.session.journal import Journal
    from fusefs.session.registry import Registry
    from rewindfs.cmd_session import _state_base

    if args.b is not None or args.unified:
        raise SessionError("diff --step takes one session id and no --unified")
    Registry(_state_base(args.store)).load(args.a)  # SessionNotFoundError for an unknown id
    try:
        st = Journal(open_store(args), args.a).step_record(args.step)
    except KeyError as e:
        raise SessionError(str(e.args[0])) from None
    emit(args, {"id": args.a, "step": st["step"], "seq": st["seq"], "label": st["label"],
                "ref": st["ref"], "changes": st["changes"]}, "\n".join(change_lines(st["changes"])))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    """``diff MNT`` (changes since the last checkpoint) and ``diff --unified A B``."""
    import time


    if getattr(args, "step", None) is not None:
        return _diff_step(args)
    if args.b is None:
        r = _client(args.a, args.store).diff(unified=args.unified)
        text = r.get("text") if args.unified else "\n".join(change_lines(r["changes"]))
        emit(args, {"a": r["base"], "b": r["ref"], "changes": r["changes"],
                    **({"text": r["text"]} if args.unified else {})}, text or "")
        return 0
    from fusefs.textdiff import unified
    from rewindfs.cmd_store import parse_ref
    from store.diff import diff

    a, b = parse_ref(args, args.a), parse_ref(args, args.b)
    st = open_store(args)
    t0 = time.perf_counter()
    changes = diff(st, a, b)
    text = unified(st, changes)
    ms = (time.perf_counter() - t0) * 1000
    rows = [{"path": os.fsdecode(c.path), "status": c.status} for c in changes]
    emit(args, {"a": str(a), "b": str(b), "changes": rows, "text": text, "elapsed_ms": ms},
         text.rstrip("\n"))
    return 0
