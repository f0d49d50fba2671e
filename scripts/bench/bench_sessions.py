"""Benchmark: many sessions forked from one snapshot (issue 5).

Builds a synthetic tree (``--files`` small files in directories of 100), snapshots it once
as the parent, then forks ``--sessions`` sessions from that Ref through the session API and
measures, per session, the time until its root is usable (``fork_session`` returned), and
the store's growth in pack bytes (goal: none: a fork stores no file content). With the
no-FUSE fallback each fork materializes the tree, so its time grows with the tree; a FUSE
backend serves the snapshot as the lower layer without copying.

    .venv/bin/python scripts/bench/bench_sessions.py --files 20000 --sessions 100 \
        --backend fallback
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
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
        before = pack_bytes(st)
        times = []
        sessions = []
        for _ in range(args.sessions):
            t = time.perf_counter()
            s = ws.fork_session(str(parent))
            times.append((time.perf_counter() - t) * 1000)
            assert s.root is not None and os.path.isdir(s.root)
            sessions.append(s)
        growth = pack_bytes(st) - before
        for s in sessions:
            s.shutdown()
        print(f"backend: {ws.backend.name}; tree: {args.files} files; parent import "
              f"{t_import * 1000:.0f} ms")
        print(f"{args.sessions} forks: time until the root is usable, ms: median "
              f"{statistics.median(times):.1f}, p90 "
              f"{sorted(times)[int(0.9 * (len(times) - 1))]:.1f}, max {max(times):.1f}")
        print(f"store growth in pack bytes over all forks: {growth}")
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
