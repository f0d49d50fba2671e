"""Benchmark: many sessions forked from one snapshot (issue 5).

Builds a synthetic tree (``--files`` small files in directories of 100), snapshots it once
as the parent, then forks ``--sessions`` sessions from that Ref through the session API and
measures, per session, the time until its root is usable (``fork_session`` returned, and
then also until a file deep in the tree has been read through the root), and the store's
growth in pack bytes (goal: none: a fork stores no file content). With the no-FUSE fallback
each fork materializes the tree, so its time grows with the tree; the FUSE backend serves
the snapshot as the lower layer of an empty upper, forking each session process from a
pre-imported parent (``fusefs/session/zygote.py``; its one-time start is reported apart and
not counted in the per-fork figures). All sessions stay live until the end; the FUSE run
also reports the session processes' memory (RSS, shared pages included).

    .venv/bin/python scripts/bench/bench_sessions.py --files 20000 --sessions 100 \
        --backend fuse
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fusefs.session import SnapshotPolicy, Workspace, define, session_workspaces  # noqa: E402
from store.objects import Store  # noqa: E402
from store.snapshot import snapshot  # noqa: E402


def make_tree(root: Path, files: int) -> None:
    for i in range(files):
        d = root / f"d{i // 100:04d}"
        if i % 100 == 0:
            d.mkdir(parents=True)
        (d / f"f{i:06d}.txt").write_bytes(f"file {i}\n".encode() * 16)


def pack_bytes(store: Store) -> int:
    row = store.conn.execute("SELECT COALESCE(SUM(size), 0) FROM packs").fetchone()
    return int(row[0])


def pack_count(store: Store) -> int:
    return int(store.conn.execute("SELECT COUNT(*) FROM packs").fetchone()[0])


def summary(ms: list[float]) -> str:
    s = sorted(ms)
    return (f"median {statistics.median(s):.1f}, p90 {s[int(0.9 * (len(s) - 1))]:.1f}, "
            f"max {s[-1]:.1f}")


def session_rss_mib(sessions: Sequence[object]) -> list[float]:
    """RSS of each FUSE session process (MiB), from /proc; empty for the fallback."""
    out = []
    for s in sessions:
        pid = getattr(getattr(s, "_handle", None), "pid", None)
        if pid is None:
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out.append(int(line.split()[1]) / 1024)
        except OSError:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--backend", choices=("fallback", "fuse", "auto"), default="auto")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="bench-sessions-",
                                    dir=os.environ.get("BENCH_TMP") or None))
    try:
        src = scratch / "src"
        make_tree(src, args.files)
        st = Store(scratch / "store")
        t0 = time.perf_counter()
        parent = snapshot(st, src, origin="seed")
        t_import = time.perf_counter() - t0
        ws = Workspace(define(session_workspaces(st, scratch / "ws"),
                              policy=SnapshotPolicy("manual"), backend=args.backend))
        warm_ms = 0.0
        if ws.backend.name == "fuse":
            # The pre-imported parent starts once per client process: time it apart.
            t = time.perf_counter()
            ws.fork_session(str(parent)).shutdown()
            warm_ms = (time.perf_counter() - t) * 1000
        before = pack_bytes(st)
        packs_before = pack_count(st)
        times = []
        read_times = []
        sessions = []
        deep = f"d{(args.files - 1) // 100:04d}/f{args.files - 1:06d}.txt"
        for _ in range(args.sessions):
            t = time.perf_counter()
            s = ws.fork_session(str(parent))
            times.append((time.perf_counter() - t) * 1000)
            assert s.root is not None
            with open(os.path.join(s.root, deep), "rb") as f:
                assert f.read().startswith(b"file ")
            read_times.append((time.perf_counter() - t) * 1000)
            sessions.append(s)
        growth = pack_bytes(st) - before
        new_packs = pack_count(st) - packs_before
        rss = session_rss_mib(sessions)
        t = time.perf_counter()
        for s in sessions:
            s.shutdown()
        t_shutdown = (time.perf_counter() - t) * 1000 / max(1, len(sessions))
        print(f"backend: {ws.backend.name}; tree: {args.files} files; parent import "
              f"{t_import * 1000:.0f} ms" + (f"; first session (starts the pre-imported "
                                             f"parent) {warm_ms:.0f} ms" if warm_ms else ""))
        print(f"{args.sessions} forks: time until the root is usable, ms: "
              f"{summary(times)}")
        print(f"  ... and a file deep in the tree read through it, ms: {summary(read_times)}")
        print(f"store growth over all forks: {growth} pack bytes, {new_packs} packs")
        if rss:
            print(f"session processes: RSS median {statistics.median(rss):.1f} MiB "
                  f"(shared pages included), {len(rss)} processes")
        print(f"shutdown: {t_shutdown:.1f} ms per session")
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
