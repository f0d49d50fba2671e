"""Session subcommands: ``session new|list|resume|fork|shutdown|rm|gc|checkpoint|restore``
and ``log ID``.

``session new``, ``resume`` and ``fork`` start a session host in the background (the mount
daemon for FUSE sessions; ``fusefs.session.host`` for no-FUSE ones) and return once the
session's root is usable, printing its id and root (``--json``: ``id``, ``root``, ``state``).
The other commands talk to that host over its control socket. The workspace is validated
here first, so a bad placement or policy fails before anything starts (exit code 10).
Default placement ``per-session`` under ``./agent-data/workspaces``; default policy manual.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from rewindfs.cli import add_json, emit
from rewindfs.cmd_live import seconds

POLICIES = {"manual": "manual", "on-idle": "on_idle", "on-turn-done": "on_turn_done",
            "on-step-done": "on_step_done"}
DEFAULT_BASE = os.path.join("agent-data", "workspaces")


class UsageError(Exception):
    """Command-line arguments that do not fit together (exit code 2)."""

    exit_code = 2


def _placement_args(p: argparse.ArgumentParser, defaults: bool) -> None:
    p.add_argument("--placement", choices=("per-session", "exclusive", "shared"),
                   default="per-session" if defaults else None,
                   help="where the live root is (default: per-session)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--root", help="the fixed root (exclusive, shared)")
    g.add_argument("--base", help="parent of per-session roots (default: "
                                  f"./{DEFAULT_BASE})")
    p.add_argument("--policy", choices=tuple(POLICIES), default="manual" if defaults else None,
                   help="when to checkpoint by itself (default: manual)")
    p.add_argument("--required", action="store_true", default=None,
                   help="a failed policy checkpoint faults the session until a manual one")
    p.add_argument("--idle", type=float, default=None, metavar="S",
                   help="quiet period of on-idle in seconds (default 5)")
    p.add_argument("--lease-ttl", type=float, default=None, metavar="S",
                   help="lease time to live in seconds (default 30)")
    p.add_argument("--no-fuse", action="store_true",
                   help="run on a plain directory even where FUSE is available")
    for kind, what in (("hide", "invisible to the agent's tools and Bash"),
                       ("protect", "the agent's tools and Bash cannot change it"),
                       ("exclude", "derived data (node_modules, .venv, build outputs) "
                                   "kept in the session's upper and out of every "
                                   "checkpoint (FUSE sessions only)")):
        p.add_argument(f"--{kind}", action="append", default=[], metavar="GLOB",
                       help=f"path policy, gitignore syntax: {what} (repeatable; recorded "
                            "in the session spec, added to .rewindfs.toml's)")

    from rewindfs.cmd_store import add_quota_args

    add_quota_args(p)


def register(sub: Any) -> None:
    p = sub.add_parser("session", help="agent sessions: new, list, resume, fork, checkpoint, "
                                       "restore, step, shutdown, rm, gc")
    ss = p.add_subparsers(dest="session_command", required=True, metavar="SUBCOMMAND")

    n = ss.add_parser("new", help="start a session; print its id and root")
    n.add_argument("--seed", metavar="REF|DIR", help="start from a Ref or a directory")
    _placement_args(n, defaults=True)
    add_json(n)
    n.set_defaults(handler=cmd_new)

    ls = ss.add_parser("list", help="list sessions, oldest first")
    add_json(ls)
    ls.set_defaults(handler=cmd_list)

    r = ss.add_parser("resume", help="start the host of a stopped session again")
    r.add_argument("id", type=session_id)
    r.add_argument("--discard-upper", action="store_true",
                   help="a session another host of a shared store may hold un-checkpointed "
                        "changes of: resume it here from its last checkpoint, giving those "
                        "changes up")
    _placement_args(r, defaults=False)
    add_json(r)
    r.set_defaults(handler=cmd_resume)

    f = ss.add_parser("fork", help="start a session from another session's state or a Ref")
    f.add_argument("source", metavar="ID|REF")
    _placement_args(f, defaults=False)
    add_json(f)
    f.set_defaults(handler=cmd_fork)

    sd = ss.add_parser("shutdown", help="stop a session (no checkpoint is made unless "
                                        "--checkpoint)")
    sd.add_argument("id", type=session_id)
    sd.add_argument("--force", action="store_true",
                    help="unmount even while processes use the root (they lose the tree)")
    sd.add_argument("--checkpoint", action="store_true",
                    help="checkpoint first (trigger shutdown; if it fails the session keeps "
                         "running), so the session holds no un-checkpointed change and can "
                         "be resumed on another host of a shared store")
    add_json(sd)
    sd.set_defaults(handler=cmd_shutdown)

    rm = ss.add_parser("rm", help="delete a stopped session's state and registry entry")
    rm.add_argument("id", type=session_id)
    add_json(rm)
    rm.set_defaults(handler=cmd_rm)

    gc = ss.add_parser("gc", help="delete stopped sessions")
    gc.add_argument("--stopped", action="store_true", required=True,
                    help="delete every session that is not running (as `session rm`)")
    add_json(gc)
    gc.set_defaults(handler=cmd_gc)

    c = ss.add_parser("checkpoint", help="checkpoint a running session; print the Ref")
    c.add_argument("id", type=session_id)
    c.add_argument("--label", help="label kept with the Ref in the snapshot list ('list', "
                                   "'@label')")
    add_json(c)
    c.set_defaults(handler=cmd_checkpoint, daemon_completes=True)

    st = ss.add_parser("step", help="record a step of a running session: journal the paths "
                                    "changed since the previous step")
    st.add_argument("id", type=session_id)
    st.add_argument("--label", default=None, help="what the step was (e.g. the tool call)")
    add_json(st)
    st.set_defaults(handler=cmd_step)

    rs = ss.add_parser("restore", help="restore a running session to a Ref")
    rs.add_argument("id", type=session_id)
    rs.add_argument("ref")
    rs.add_argument("--discard", action="store_true",
                    help="do not checkpoint the current state first")
    rs.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="how long to wait for tool calls in flight (write permits) to end "
                         "(default: the policy timeout)")
    rs.add_argument("--wait-writers", type=seconds, default=None, metavar="SECONDS",
                    help="wait up to SECONDS for files open for writing to close, else "
                         "refuse (default: never wait; open files keep their old inodes)")
    rs.add_argument("--path", action="append", dest="paths", metavar="P",
                    help="restore only this path (relative to the session root; a file, a "
                         "directory, or absent in REF: then it is removed); repeatable")
    add_json(rs)
    rs.set_defaults(handler=cmd_restore, daemon_completes=True)

    lg = sub.add_parser("log", help="a session's journal, oldest first")
    lg.add_argument("id", type=session_id)
    lg.add_argument("--changes", action="store_true",
                    help="also the paths each step changed (one line per path)")
    add_json(lg)
    lg.set_defaults(handler=cmd_log)


# -- helpers ----------------------------------------------------------------------------


def session_id(text: str) -> str:
    """The argparse type of a session id argument: ``text`` if it can be a session id
    (``fusefs.session.placement.check_session_id``), else a usage error (exit 2) naming
    it escaped, before any registry is read (a registry row of another program's could
    hold such an id)."""
    from fusefs.session.errors import InvalidSessionIdError
    from fusefs.session.placement import check_session_id

    try:
        return check_session_id(text)
    except InvalidSessionIdError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _state_base(store_path: str) -> str:
    from fusefs.session.placement import canonical_path

    return os.path.join(canonical_path(store_path), "sessions")


def _registry(args: argparse.Namespace) -> Any:
    from fusefs.session.registry import Registry

    return Registry(_state_base(args.store))


def _spec_from_args(args: argparse.Namespace, base: dict[str, Any] | None) -> dict[str, Any]:
    """The workspace spec: ``base`` (a recorded spec) overridden by what was given."""
    spec: dict[str, Any] = dict(base or {})
    spec["store"] = os.path.abspath(args.store)
    if args.placement is not None:
        spec["placement"] = args.placement
    spec.setdefault("placement", "per-session")
    if args.root is not None or args.base is not None:
        if spec["placement"] == "per-session" and args.root is not None:
            raise UsageError("per-session placement takes --base, not --root")
        if spec["placement"] != "per-session" and args.base is not None:
            raise UsageError(f"{spec['placement']} placement takes --root, not --base")
        given = args.root if args.root is not None else args.base
        if not given.strip():
            raise UsageError(f"--{'root' if args.root is not None else 'base'} is empty")
        spec["path"] = os.path.abspath(given)
    elif args.placement is not None and base is not None and \
            base.get("placement") != args.placement:
        spec.pop("path", None)
    if "path" not in spec:
        if spec["placement"] != "per-session":
            raise UsageError(f"{spec['placement']} placement needs --root")
        spec["path"] = os.path.abspath(DEFAULT_BASE)
    if args.policy is not None:
        spec["policy"] = POLICIES[args.policy]
    spec.setdefault("policy", "manual")
    if args.required:
        spec["required"] = True
    if args.idle is not None:
        spec["idle_s"] = args.idle
    if args.lease_ttl is not None:
        spec["ttl"] = args.lease_ttl
    if args.no_fuse:
        spec["backend"] = "fallback"
    spec.setdefault("backend", "auto")
    from store.pathpolicy import PathPolicy

    given = PathPolicy(tuple(args.hide), tuple(args.protect), tuple(args.exclude),
                       source="the command line")
    paths = PathPolicy.from_spec(spec.get("paths")).merged(given)
    if paths.empty:
        spec.pop("paths", None)
    else:
        spec["paths"] = paths.to_spec()
    for key in ("quota_bytes", "quota_inodes"):
        if getattr(args, key, None) is not None:
            spec[key] = getattr(args, key)
    if (spec.get("quota_bytes") or spec.get("quota_inodes")) and spec["backend"] == "fallback":
        raise UsageError("quotas are enforced by the FUSE layer: not with --no-fuse")
    return spec


def _with_seed_policy(args: argparse.Namespace, spec: dict[str, Any],
                      seed: str | None) -> dict[str, Any]:
    """``spec`` with the policy of the seed's ``.rewindfs.toml`` added (its patterns first)."""
    from store.errors import InvalidRefError, ObjectNotFoundError
    from store.objects import Store
    from store.pathpolicy import PathPolicy, seed_policy

    if not seed:
        return spec
    try:
        found = seed_policy(None if os.path.isdir(seed) else
                            Store(os.path.abspath(args.store)), seed)
    except (InvalidRefError, ObjectNotFoundError):
        return spec      # not a usable seed: the session host reports it with its cause
    if found.empty:
        return spec
    out = dict(spec)
    out["paths"] = found.merged(PathPolicy.from_spec(spec.get("paths"))).to_spec()
    return out


def _recorded_spec(state_dir: str) -> dict[str, Any] | None:
    from fusefs.session.host import SPEC_FILE

    try:
        with open(os.path.join(state_dir, SPEC_FILE)) as f:
            out: dict[str, Any] = json.load(f)
            return out
    except FileNotFoundError:
        return None


def _spawn(spec: dict[str, Any], mode: list[str]) -> dict[str, Any]:
    """Start a session host with ``mode`` arguments; return its ready report. The host runs
    with ``-P`` so that a directory named like a package in the working directory (a store
    called ``store``) cannot shadow the product's modules."""
    from fusefs.session.control import raise_reply
    from fusefs.session.host import config_from_spec

    config_from_spec(spec)  # typed configuration errors before anything starts
    r, w = os.pipe()
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "fusefs.session.host", "--spec", json.dumps(spec),
                 "--ready-fd", str(w), *mode],
                pass_fds=(w,), start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err)
        finally:
            os.close(w)
        with os.fdopen(r) as ready:
            line = ready.readline()
        if not line:
            code = proc.wait()
            err.seek(0)
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(f"the session host exited with code {code}: "
                               f"{tail[0] if tail else 'no message'}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            proc.wait()
        return raise_reply(reply)


def _show(args: argparse.Namespace, reply: dict[str, Any]) -> int:
    emit(args, {"id": reply["id"], "root": reply["root"], "state": "running"},
         f"{reply['id']} {reply['root']}")
    return 0


def _live(args: argparse.Namespace, session_id: str) -> str | None:
    from fusefs.session.control import live_host

    rec = _registry(args).load(session_id)
    return live_host(rec.state_dir)


def _ask(args: argparse.Namespace, session_id: str, req: dict[str, Any]) -> dict[str, Any]:
    from fusefs.session.control import raise_reply, request
    from fusefs.session.errors import SessionClosedError

    path = _live(args, session_id)
    if path is None:
        raise SessionClosedError(session_id)
    return raise_reply(request(path, req))


# -- handlers -----------------------------------------------------------------------------


def cmd_new(args: argparse.Namespace) -> int:
    spec = _spec_from_args(args, None)
    seed = args.seed
    from store.resolve import looks_like_ref

    if seed and not os.path.isdir(seed) and looks_like_ref(seed):
        from rewindfs.cmd_store import parse_ref

        seed = str(parse_ref(args, seed))  # a prefix or @label of a snapshot
    spec = _with_seed_policy(args, spec, seed)
    mode = ["--new"] + (["--seed", seed] if seed else [])
    return _show(args, _spawn(spec, mode))


def cmd_list(args: argparse.Namespace) -> int:
    from fusefs.session.control import live_host

    away, unreadable = _registered_elsewhere(args)
    rows: list[dict[str, Any]] = []
    records, bad = _registry(args).listing()
    for rec in records:
        if rec.id in away:
            continue  # it ran on another host since: that host's row below says how it is
        rows.append({"id": rec.id, "root": rec.root, "placement": rec.mode,
                     "state": "running" if live_host(rec.state_dir) else "stopped",
                     "parent": rec.parent})
    for sid, reason in [(u.id, u.reason) for u in bad] + unreadable:
        rows.append({"id": sid, "root": None, "placement": None, "state": "unreadable",
                     "parent": None, "reason": reason})
    for e in away.values():  # a shared store's sessions of other hosts (host: where)
        if e.state == "removed":  # `session rm` there (a stale local record is hidden)
            continue
        rows.append({"id": e.id, "root": None, "placement": e.mode, "state": e.state,
                     "parent": e.parent, "host": e.host})
    if getattr(args, "json", False):
        emit(args, rows)
    else:
        for r in rows:
            where = (f"on {_shown(r['host'])}" if r.get("host") else
                     repr(r["reason"]) if r["state"] == "unreadable" else r["root"])
            print(f"{_shown_id(r['id'])}  {_shown(r['state']):<8} {_shown(r['placement']):<12} "
                  f"{where}")
    return 0


def _shown_id(text: str) -> str:
    """A session id as ``session list`` prints it: as it is if it is a valid one, else
    escaped (``repr``), so that a registry row of another program's cannot add a line or
    send a terminal control sequence."""
    from fusefs.session.errors import InvalidSessionIdError
    from fusefs.session.placement import check_session_id

    try:
        return check_session_id(text)
    except InvalidSessionIdError:
        return repr(text)


def _shown(text: object) -> str:
    """A registry field (host, state, placement) as ``session list`` prints it: escaped
    (``repr``) unless it is printable text without spaces."""
    if text is None:
        return str(None)
    if isinstance(text, str) and text.isprintable() and " " not in text:
        return text
    return repr(text)


def _registered_elsewhere(args: argparse.Namespace
                          ) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """id -> registry row of every session a shared store's catalog registers on another
    host (``fusefs.session.moves``), and (id, reason) of each such row that cannot be read
    (SessionError); both empty for an embedded store."""
    from store import config

    if config.read(args.store) is None:
        return {}, []
    from fusefs.session.errors import SessionError
    from fusefs.session.moves import SessionEntry
    from store.hostid import host_id
    from store.objects import Store

    st = Store(args.store)
    rows, bad = {}, []
    try:
        for sid, host, record in st.catalog.sessions():
            if host == host_id():
                continue
            try:
                rows[sid] = SessionEntry.parse(sid, host, record)
            except SessionError as e:
                bad.append((sid, str(e)))
    finally:
        st.close()
    return rows, bad


def _elsewhere(args: argparse.Namespace, session_id: str) -> Any:
    """The shared catalog's registry row of ``session_id`` if another host ran it last
    (``fusefs.session.moves``), else None (also for an embedded store)."""
    from store import config

    if config.read(args.store) is None:
        return None
    from fusefs.session.moves import elsewhere
    from store.objects import Store

    st = Store(args.store)
    try:
        return elsewhere(st, session_id)
    finally:
        st.close()


def _moved_spec(args: argparse.Namespace, away: Any) -> dict[str, Any]:
    """The spec of a session moving here from another host: its recorded policy, path
    policies and quotas, this host's store and placement paths, this command's options."""
    from fusefs.session.moves import movable_spec

    return _spec_from_args(args, movable_spec(away.spec))


def cmd_resume(args: argparse.Namespace) -> int:
    away = _elsewhere(args, args.id)
    if away is not None:  # another host ran it last: it moves here (or is refused)
        mode = ["--resume", args.id] + (["--discard-upper"] if args.discard_upper else [])
        return _show(args, _spawn(_moved_spec(args, away), mode))
    rec = _registry(args).load(args.id)
    path = _live(args, args.id)
    if path is not None:
        _refuse_terminal(rec.id, path)
        return _show(args, {"id": rec.id, "root": rec.root})
    base = _recorded_spec(rec.state_dir)
    if base is None and rec.fingerprint:
        mode, _, where = rec.fingerprint.partition(":")
        base = {"placement": mode, "path": where}
    spec = _spec_from_args(args, base)
    return _show(args, _spawn(spec, ["--resume", args.id]))


def _refuse_terminal(session_id: str, path: str) -> None:
    """Raise SessionFaultedError (exit 10) if the running session process at control
    socket ``path`` is terminally faulted: resuming it would report a root that serves
    nothing further (no checkpoint, step or restore). The message says how to recover."""
    from fusefs.session.control import request
    from fusefs.session.errors import SessionFaultedError

    st = request(path, {"op": "status"}, 60)
    if st.get("ok") and st.get("terminal"):
        raise SessionFaultedError(
            session_id, f"{st.get('fault')}; its process (pid {st.get('pid')}) still runs: "
            f"run 'rewindfs session shutdown {session_id}', then 'rewindfs session resume "
            f"{session_id}'", terminal=True)


def cmd_fork(args: argparse.Namespace) -> int:
    from rewindfs.cmd_store import parse_ref
    from store.resolve import looks_like_ref

    src = args.source
    if looks_like_ref(src) and not _registry(args).exists(src):
        src = str(parse_ref(args, src))
        spec = _with_seed_policy(args, _spec_from_args(args, None), src)
        return _show(args, _spawn(spec, ["--new", "--seed", src, "--parent", src]))
    away = _elsewhere(args, src)
    if away is not None:  # another host ran it last: forked from its last checkpoint
        return _show(args, _spawn(_moved_spec(args, away), ["--fork", src]))
    rec = _registry(args).load(src)
    spec = _spec_from_args(args, _recorded_spec(rec.state_dir))
    if _live(args, src) is not None:
        ref = _ask(args, src, {"op": "checkpoint", "trigger": "fork"})["ref"]
        return _show(args, _spawn(spec, ["--new", "--seed", ref, "--parent", src]))
    return _show(args, _spawn(spec, ["--fork", src]))


def cmd_shutdown(args: argparse.Namespace) -> int:
    from fusefs.session.control import raise_reply, request

    path = _live(args, args.id)
    if path is None:
        emit(args, {"id": args.id, "state": "stopped"}, f"{args.id} is not running")
        return 0
    status = raise_reply(request(path, {"op": "status"}))
    pid = int(status["pid"])
    root = status.get("root")
    # Like umount(8) on EBUSY: a root still in use is not pulled away from its users,
    # unless asked. (A shared root stays mounted while other sessions use it.)
    if root and not args.force and int(status.get("users") or 1) <= 1:
        from fusefs.mounts import processes_using
        from fusefs.session.errors import RootInUseError

        users = processes_using(str(root), exclude=(pid,))
        if users:
            raise RootInUseError(args.id, str(root), [f"{p} {cmd}" for p, cmd in users])
    # A FUSE session replies once it is shut down; its process lives on while other
    # sessions of the same shared root use it ("exits": false).
    done = raise_reply(request(path, {"op": "shutdown", "checkpoint": args.checkpoint}))
    exits = done.get("exits", True)
    deadline = time.monotonic() + 120
    while exits and time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    else:
        if exits:
            raise RuntimeError(f"the host of {args.id} (pid {pid}) did not exit")
    ref = done.get("ref")
    emit(args, {"id": args.id, "state": "stopped", "ref": ref},
         f"{args.id} stopped" + (f" at {ref}" if ref else ""))
    return 0


def _remove(args: argparse.Namespace, session_id: str) -> Any:
    from fusefs.session.api import remove_session
    from store.lease import Leaser
    from store.objects import Store

    store = Store(args.store)
    try:
        return remove_session(store, _registry(args), session_id, Leaser(store))
    finally:
        store.close()


def cmd_rm(args: argparse.Namespace) -> int:
    _remove(args, args.id)
    emit(args, {"id": args.id, "removed": True}, f"{args.id} removed")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from fusefs.session.control import live_host
    from fusefs.session.errors import SessionBusyError

    removed, running = [], []
    for rec in _registry(args).list():
        if live_host(rec.state_dir) is not None:
            running.append(rec.id)
            continue
        try:
            _remove(args, rec.id)
        except SessionBusyError:  # started meanwhile, or held by a process elsewhere
            running.append(rec.id)
            continue
        removed.append(rec.id)
    emit(args, {"removed": removed, "running": running},
         "\n".join([f"{i} removed" for i in removed]
                   + [f"{len(running)} running session(s) kept"]))
    return 0


def cmd_checkpoint(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    ref = _ask(args, args.id, {"op": "checkpoint", "label": args.label})["ref"]
    emit(args, {"id": args.id, "ref": ref,
                "elapsed_ms": round((time.monotonic() - t0) * 1000, 3)}, ref)
    return 0


def cmd_step(args: argparse.Namespace) -> int:
    from fusefs.session.errors import SessionError
    from rewindfs.cmd_store import change_lines

    step = _ask(args, args.id, {"op": "step_done", "label": args.label}).get("step")
    if step is None:
        raise SessionError(f"session {args.id} keeps no step log (the no-FUSE backend has "
                           "no dirty set to take it from)")
    emit(args, dict(step, id=args.id),
         "\n".join([f"step {step['step']} (seq {step['seq']}): "
                    f"{len(step['changes'])} path(s)"] + change_lines(step["changes"])))
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    from rewindfs.cmd_store import parse_ref

    ref = str(parse_ref(args, args.ref, session=args.id))
    t0 = time.monotonic()
    req = {"op": "restore", "ref": ref, "discard": args.discard, "timeout_s": args.timeout,
           "wait_writers_s": args.wait_writers}
    if args.paths is not None:
        req["paths"] = args.paths
    reply = _ask(args, args.id, req)
    out = {"id": args.id, "ref": reply.get("ref") or ref, "pre_restore": reply.get("pre_restore"),
           "elapsed_ms": round((time.monotonic() - t0) * 1000, 3)}
    if "detached" in reply:  # a FUSE session: the inodes the restore detached
        out["detached"] = reply["detached"]
    if args.paths is not None:
        out["source"], out["paths"] = ref, reply.get("paths")
    emit(args, out, str(out["ref"]))
    return 0


def _label_of(e: Any, labels: dict[int, str]) -> dict[str, str]:
    """``{"label": ...}`` for a checkpoint given a label (``checkpoint_labels``), else ``{}``."""
    label = labels.get(e.seq)
    return {"label": label} if label else {}


def cmd_log(args: argparse.Namespace) -> int:
    from fusefs.session.journal import STEP, Journal, event_dict, restore_detail, step_dict
    from rewindfs.cmd_store import change_lines
    from store.objects import Store
    from store.pathtext import text_path, text_paths
    from store.resolve import checkpoint_labels

    _registry(args).load(args.id)  # SessionNotFoundError for an unknown id
    store = Store(args.store)
    journal = Journal(store, args.id)
    events = journal.events()
    steps: dict[int, dict[str, Any]] = {}
    labels = {e.seq: name for e, name in checkpoint_labels(store, args.id)}
    for e in events:
        if e.event == STEP:
            steps[e.seq] = step_dict(e, journal.record(e.seq))
            if not args.changes:
                del steps[e.seq]["changes"]
    if getattr(args, "json", False):
        emit(args, [steps.get(e.seq) or dict(event_dict(e), **restore_detail(store, e),
                                             **_label_of(e, labels))
                    for e in events])
        return 0
    for e in events:
        when = datetime.datetime.fromtimestamp(e.time_ns / 1e9).isoformat(timespec="seconds")
        st = steps.get(e.seq)
        if st is not None:
            what = ("step (record lost)" if st.get("lost") else f"step {st['step']}"
                    + (f" {text_path(st['label'])}" if st["label"] else ""))
        else:
            what = ("checkpoint " + f"{e.trigger}/{e.consistency}"
                    if e.event == "WorkspaceCheckpointed" else "restore")
        detail = restore_detail(store, e)
        if detail:
            what = "restore --path"
        print(f"{e.seq:>4}  {when}  {what:<26} epoch {e.epoch}  {e.ref}"
              + (f"  {text_paths(detail.get('paths') or [])} from {detail.get('source')}"
                 if detail else "")
              + "".join(f"  {v!r}" for v in _label_of(e, labels).values()))
        if st is not None and args.changes:
            for line in change_lines(st["changes"]):
                print("      " + line)
    return 0
