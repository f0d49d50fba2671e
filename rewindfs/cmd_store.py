"""Store subcommands: init, snapshot, list, forget, materialize, ls, cat, diff, gc, verify,
stats, rebuild-index.

Each handler opens the store named by ``--store``, calls one function of the store API and
renders its result as text, or as JSON with ``--json`` (a Ref always under the key ``ref``,
durations under ``elapsed_ms``). Store modules are imported inside handlers so that
``rewindfs --help`` and other short commands do not pay for them. Errors are left to the
front door (``rewindfs.cli.main``), which prints one line and returns the error's
``exit_code``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rewindfs.cli import add_json, emit, open_store
from store.pathtext import text_path

EXIT_NOT_FOUND = 4
EXIT_INTEGRITY = 5


class NotFoundError(Exception):
    """A command-line argument names something that does not exist (exit code 4)."""

    exit_code = EXIT_NOT_FOUND


def register(sub: Any) -> None:
    p = sub.add_parser("init", help="create the store (optional: any command creates it)")
    p.add_argument("--chunk-size", type=size_arg, default=None, metavar="BYTES",
                   help="chunk size, a power of two from 64K to 8M (default 1M); fixed "
                        "when the store is created")
    p.add_argument("--level", type=int, default=None, help="zstd level (default 3)")
    add_json(p)
    p.set_defaults(handler=cmd_init)

    p = sub.add_parser("snapshot", help="import a directory; print its Ref")
    p.add_argument("dir", help="directory to snapshot (symlinks are not followed)")
    p.add_argument("--label", help="label shown by 'list'")
    add_json(p)
    p.set_defaults(handler=cmd_snapshot)

    p = sub.add_parser("list", help="list snapshots, oldest first")
    add_json(p)
    p.set_defaults(handler=cmd_list)

    p = sub.add_parser("forget", help="drop a Ref from the snapshot list (gc frees it)")
    p.add_argument("ref")
    add_json(p)
    p.set_defaults(handler=cmd_forget)

    p = sub.add_parser(
        "materialize", help="write a snapshot out as a real directory",
        description="Write snapshot REF out at DEST. Run as root, entries get their recorded "
        "owners; run as another user, every entry is owned by that user (owners are not "
        "applied) and device nodes are skipped; sockets are always skipped, setuid and "
        "setgid bits always dropped. A non-empty DEST is compared, not written: it holds "
        "the same tree (exit 0, nothing written) when it equals what this materialize "
        "would write, so a second run by the same user into the same DEST succeeds.")
    p.add_argument("ref")
    p.add_argument("dest", help="missing or empty: extract; non-empty: compare")
    add_json(p)
    p.set_defaults(handler=cmd_materialize)

    p = sub.add_parser("ls", help="list a directory inside a snapshot")
    p.add_argument("ref")
    p.add_argument("path", nargs="?", default="", help="path inside the snapshot (default: root)")
    add_json(p)
    p.set_defaults(handler=cmd_ls)

    p = sub.add_parser("cat", help="write a file of a snapshot to stdout")
    p.add_argument("ref")
    p.add_argument("path")
    p.set_defaults(handler=cmd_cat)

    p = sub.add_parser("diff", help="list paths added, removed, modified between two Refs "
                                    "(or since the last checkpoint of a mount: diff MNT)")
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B", nargs="?")
    p.add_argument("--unified", "-u", action="store_true",
                   help="print a unified text diff of the changed files")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="with a session id as A: the paths step N of its journal changed")
    add_json(p)
    p.set_defaults(handler=cmd_diff)

    p = sub.add_parser("gc", help="delete objects no listed snapshot or journal reaches")
    p.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                   help="shared store: keep packs indexed less than this long ago, and "
                        "everything their trees reach (default 3600)")
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="shared store: how long to wait for writers of other hosts to "
                        "finish before refusing (default 120)")
    add_json(p)
    p.set_defaults(handler=cmd_gc)

    p = sub.add_parser("verify", help="re-hash every reachable object, check every invariant "
                                      "(exit 5 when a problem is found)")
    add_json(p)
    p.set_defaults(handler=cmd_verify)

    p = sub.add_parser("stats", help="logical and stored sizes, dedup and compression ratios")
    add_json(p)
    p.set_defaults(handler=cmd_stats)

    p = sub.add_parser("rebuild-index", help="recreate the index from the backend alone")
    p.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="shared store: how long to wait for writers of other hosts to "
                        "finish before refusing, as gc (default 120)")
    p.add_argument("--force", action="store_true",
                   help="rebuild even if the store lacks listed snapshots, journal "
                        "events or packs the index holds (refused otherwise)")
    add_json(p)
    p.set_defaults(handler=cmd_rebuild_index)


# -- helpers ------------------------------------------------------------------------------


def parse_ref(args: argparse.Namespace, text: str, session: str | None = None) -> Any:
    """The Ref named by ``text``: a full Ref, a unique prefix of 8+ hex digits, ``@label``,
    or with ``session`` also ``@-N`` (``store.resolve``). InvalidRefError (exit 3)
    otherwise. The store is opened only when ``text`` is not a full Ref."""
    from store.ref import Ref
    from store.resolve import ref_form, resolve_ref

    form = ref_form(text)
    if isinstance(form, Ref):
        return form
    return resolve_ref(open_store(args), text, session)


def size_arg(text: str) -> int:
    """A byte count: digits, optionally followed by K, M, G or T (powers of 1024; KiB, MB
    ... are read the same)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    digits = t[:-1] if mult > 1 else t
    if not digits.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1048576, 512K, 1M)")
    return int(digits) * mult


def count_arg(text: str) -> int:
    """A count >= 0 (an argparse type)."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"not a count: {text!r}")
    return int(text)


def add_quota_args(p: argparse.ArgumentParser) -> None:
    """``--quota-bytes`` and ``--quota-inodes``: caps on a session's upper layer, recorded
    in its state directory (given again they replace the recorded ones; 0 removes one)."""
    p.add_argument("--quota-bytes", type=size_arg, default=None, metavar="SIZE",
                   help="cap on the content bytes of the upper layer (changes since the "
                        "last checkpoint), e.g. 10M, 2G; beyond it writes fail with EDQUOT; "
                        "recorded in the state, kept by remounts; 0 removes the cap")
    p.add_argument("--quota-inodes", type=count_arg, default=None, metavar="N",
                   help="cap on the inodes of the upper layer; beyond it creates fail with "
                        "EDQUOT; recorded in the state, kept by remounts; 0 removes the cap")


def inner_path(text: str) -> bytes:
    """A path inside a snapshot as raw bytes, without leading/trailing ``/`` or ``.``."""
    parts = [p for p in os.fsencode(text).split(b"/") if p and p != b"."]
    return b"/".join(parts)


def jsonable(obj: Any) -> Any:
    """``obj`` made of JSON types: dataclasses to dicts, Refs and ids to text, bytes (paths,
    names) decoded with surrogateescape, enums to lower-case names."""
    from store.ref import Ref

    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, Ref):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.name.lower()
    if isinstance(obj, bytes | bytearray | memoryview):
        return os.fsdecode(bytes(obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not f.name.startswith("_")}
    if isinstance(obj, dict):
        return {str(jsonable(k)): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [jsonable(v) for v in obj]
    return str(obj)


def kv_text(data: dict[str, Any]) -> str:
    """``key: value`` lines for a flat result (nested values shown as JSON)."""
    import json

    width = max((len(k) for k in data), default=0)
    lines = []
    for k, v in data.items():
        if isinstance(v, float):
            shown: Any = f"{v:.4g}"
        elif isinstance(v, str | int) or v is None:
            shown = v
        else:
            shown = json.dumps(v)
        lines.append(f"{k + ':':<{width + 1}} {shown}")
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def elapsed_ms(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)


class Progress:
    """A tqdm bar of bytes on stderr for long work; silent unless stderr is a TTY and the
    command is not run with ``--json``.

    ``progress(count_done, bytes_done)`` (running totals of files or entries, and bytes) is
    the callback shape of snapshot and materialize; ``progress.done_total(done, total)`` that of verify (bytes).
    """

    def __init__(self, args: argparse.Namespace, desc: str) -> None:
        self.bar: Any = None
        if not getattr(args, "json", False) and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                            file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, count_done: int, bytes_done: int) -> None:
        if self.bar is not None:
            self.bar.n = bytes_done
            self.bar.set_postfix_str(f"{count_done:,} done", refresh=False)
            self.bar.update(0)

    def done_total(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.total = total
            self.bar.n = done
            self.bar.update(0)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


@contextmanager
def progress(args: argparse.Namespace, desc: str) -> Iterator[Progress]:
    bar = Progress(args, desc)
    try:
        yield bar
    finally:
        bar.close()


def _time_text(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / 1e9))


# -- handlers -----------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    from store.errors import StoreError
    from store.objects import DEFAULT_CHUNK_SIZE, DEFAULT_LEVEL, Store

    st = Store(args.store, chunk_size=args.chunk_size or DEFAULT_CHUNK_SIZE,
               level=DEFAULT_LEVEL if args.level is None else args.level)
    for name, asked, got in (("chunk size", args.chunk_size, st.chunk_size),
                             ("zstd level", args.level, st.level)):
        if asked is not None and asked != got:
            raise StoreError(f"store {st.root} already exists with {name} {got}, not {asked}")
    emit(args, {"root": st.root, "chunk_size": st.chunk_size, "level": st.level},
         f"store {st.root} (chunk size {human_bytes(st.chunk_size)}, zstd level {st.level})")
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    from store.snapshot import run_snapshot

    st = open_store(args)
    t0 = time.perf_counter()
    with progress(args, "snapshot") as bar:
        result = run_snapshot(st, args.dir, label=args.label, progress=bar)
    data = {"ref": str(result.ref), "path": os.path.abspath(args.dir), "label": args.label}
    data.update({k: v for k, v in jsonable(result).items() if k not in data})
    data["elapsed_ms"] = elapsed_ms(t0)
    emit(args, data, str(result.ref))
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    st = open_store(args)
    rows = st.list_snapshots()
    given: dict[str, list[str]] = {}  # Ref -> every label it was given, newest first
    for ref, label, _t in reversed(st.snapshot_labels()):
        given.setdefault(str(ref), []).append(label)
    data = [{"ref": str(r.ref), "time_ns": r.time_ns, "origin": r.origin, "label": r.label,
             "labels": given.get(str(r.ref), [])} for r in rows]
    text = "\n".join(f"{_time_text(r.time_ns)}  {r.origin:<10} {r.ref}  "
                     f"{', '.join(given.get(str(r.ref), []))}".rstrip() for r in rows)
    emit(args, data, text)
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    ref = parse_ref(args, args.ref)
    st = open_store(args)
    if not st.forget(ref):
        raise NotFoundError(f"{ref} is not in the snapshot list")
    emit(args, {"ref": str(ref), "forgotten": True}, f"forgot {ref}")
    return 0


def cmd_materialize(args: argparse.Namespace) -> int:
    from store.materialize import materialize

    ref = parse_ref(args, args.ref)
    st = open_store(args)
    t0 = time.perf_counter()
    with progress(args, "materialize") as bar:
        result = materialize(st, ref, args.dest, progress=bar)
    data = {"ref": str(ref), "dest": os.path.abspath(args.dest), "elapsed_ms": elapsed_ms(t0)}
    extra = jsonable(result)
    if isinstance(extra, dict):
        data.update({k: v for k, v in extra.items() if k not in data})
    emit(args, data, kv_text(data))
    return 0


def _entry_dict(e: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"name": os.fsdecode(e.name), "kind": e.kind.name.lower(),
                         "mode": e.mode, "uid": e.uid, "gid": e.gid, "mtime_ns": e.mtime_ns,
                         "size": e.size}
    if e.kind.name == "SYMLINK":
        d["target"] = os.fsdecode(e.target)
    if e.kind.is_device:
        d["rdev"] = e.rdev
    if e.xattrs:
        d["xattrs"] = [os.fsdecode(k) for k, _ in e.xattrs]
    if e.link_group is not None:
        d["link_group"] = e.link_group.hex()
    return d


def cmd_ls(args: argparse.Namespace) -> int:
    import stat as stat_mod

    from store.browse import ls

    ref = parse_ref(args, args.ref)
    st = open_store(args)
    entries = ls(st, ref, inner_path(args.path))
    data = [_entry_dict(e) for e in entries]
    lines = []
    for e, d in zip(entries, data, strict=True):
        perms = stat_mod.filemode(e.st_mode)
        size = f"{os.major(e.rdev)}, {os.minor(e.rdev)}" if "rdev" in d else str(e.size)
        line = (f"{perms} {e.uid:>5} {e.gid:>5} {size:>10} "
                f"{_time_text(e.mtime_ns)} {text_path(d['name'])}")
        if "target" in d:
            line += f" -> {text_path(d['target'])}"
        lines.append(line)
    emit(args, data, "\n".join(lines))
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    from store.browse import cat

    ref = parse_ref(args, args.ref)
    st = open_store(args)
    out = sys.stdout.buffer
    for block in cat(st, ref, inner_path(args.path)):
        out.write(block)
    out.flush()
    return 0


_STATUS_CHAR = {"added": "A", "removed": "D", "modified": "M", "type_changed": "T"}


def change_lines(changes: list[dict[str, Any]]) -> list[str]:
    """One ``<status letter>\t<path>`` line per change (``{"path", "status"}``; the format
    of every ``diff``, ``log --changes`` and ``session step``), the path as ``text_path``
    quotes it."""
    return [f"{_STATUS_CHAR.get(c['status'], '?')}\t{text_path(c['path'])}" for c in changes]


def cmd_diff(args: argparse.Namespace) -> int:
    if args.b is None or args.unified or args.step is not None:  # see rewindfs/cmd_live.py
        from rewindfs.cmd_live import cmd_diff as live_diff

        return live_diff(args)
    from store.diff import diff

    a = parse_ref(args, args.a)
    b = parse_ref(args, args.b)
    st = open_store(args)
    t0 = time.perf_counter()
    changes = diff(st, a, b)
    ms = elapsed_ms(t0)
    rows = []
    for c in changes:
        row: dict[str, Any] = {"path": os.fsdecode(c.path), "status": c.status}
        row["old_kind"] = c.old.kind.name.lower() if c.old is not None else None
        row["new_kind"] = c.new.kind.name.lower() if c.new is not None else None
        rows.append(row)
    text = "\n".join(change_lines(rows))
    emit(args, {"a": str(a), "b": str(b), "changes": rows, "elapsed_ms": ms}, text)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from fusefs.mounts import served_refs
    from fusefs.session.fusetree import state_dirs_reader
    from store.gc import gc
    from store.ref import Ref

    st = open_store(args)
    t0 = time.perf_counter()
    # What live mounts serve (a plain rw mount's state directory is not registered).
    shared = {k: v for k, v in (("grace_s", args.grace), ("wait_s", args.wait))
              if v is not None}
    report = gc(st, extra_live=[Ref.parse(r) for r in served_refs(st.root)],
                state_dirs_reader=state_dirs_reader, **shared)
    data = jsonable(report)
    if not isinstance(data, dict):
        data = {"report": data}
    data["elapsed_ms"] = elapsed_ms(t0)
    emit(args, data, kv_text(data))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from store.verify import verify

    st = open_store(args)
    t0 = time.perf_counter()
    with progress(args, "verify") as bar:
        problems = verify(st, progress=bar.done_total)
    rows = [{"invariant": p.invariant, "key": jsonable(p.key), "detail": p.detail}
            for p in problems]
    data = {"ok": not rows, "problems": rows, "elapsed_ms": elapsed_ms(t0)}
    text = "\n".join(f"{r['invariant']}\t{r['key']}\t{r['detail']}" for r in rows) or "ok"
    emit(args, data, text)
    return EXIT_INTEGRITY if rows else 0


def cmd_stats(args: argparse.Namespace) -> int:
    from store.stats import stats

    st = open_store(args)
    data = jsonable(stats(st))
    if not isinstance(data, dict):
        data = {"stats": data}
    emit(args, data, kv_text(data))
    return 0


def cmd_rebuild_index(args: argparse.Namespace) -> int:
    from store.rebuild import rebuild_index

    st = open_store(args)
    t0 = time.perf_counter()
    result = rebuild_index(st, wait_s=args.wait, force=args.force)
    data = jsonable(result)
    if not isinstance(data, dict):
        data = {} if data is None else {"result": data}
    data["elapsed_ms"] = elapsed_ms(t0)
    emit(args, data, kv_text(data))
    return 0
