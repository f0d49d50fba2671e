"""Step change log benchmark (issue 14.1): the cost of recording a step on a live session.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/bench_steps.py [--files 20000] [--dirty 1000]
        [--steps 50] [--runs 5] [--json FILE]

Builds a synthetic tree of ``--files`` small files (100 per directory), starts a FUSE session
seeded with it (``rewindfs session new --seed``), makes ``--dirty`` of them dirty (spread
over the tree), records a first step (which journals all of them), then measures ``--steps``
steps, each after changing 10 more of the dirty files, so every step looks at a dirty set of
``--dirty`` paths:

- ``step``: one ``step_done`` request to the session process, round trip (the daemon's
  walk of the dirty set, the journal append whose barrier is shared (group commit,
  fusefs/session/journal.py), the socket), and the daemon's own part
  (``daemon_ms``); medians;
- the transport alone: a ``mutated`` request (the session answers it without work), round
  trip, median; the step's round trip is about this plus the daemon and journal part;
- baseline, same tree and dirty set: ``rewindfs diff MNT``'s request (the daemon's diff op:
  a checkpoint preview of the dirty set, then a tree diff), round trip, median;
- FUSE write throughput (the hot path the step log does not touch): 64 MiB written through
  the mount in 1 MiB writes, medians of ``--runs``, while nothing else runs and while a
  step is recorded every 50 ms from another thread; the ratio should stay near 1.

Goal: a step under 5 ms with 1,000 dirty paths at 20,000 files. It prints a Markdown table
and exits 0 whether or not the goal is met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common import log, markdown_table, scratch  # noqa: E402

from fusefs.control import Client  # noqa: E402
from fusefs.session.control import control_path, request  # noqa: E402

PY = sys.executable
REPO = Path(__file__).resolve().parents[2]
PER_DIR = 100


def build_tree(root: Path, n: int) -> list[str]:
    """``n`` files of a few hundred bytes, ``PER_DIR`` per directory; their paths."""
    rels = []
    for i in range(n):
        rel = f"d{i // PER_DIR:04d}/f{i % PER_DIR:03d}.txt"
        p = root / rel
        if i % PER_DIR == 0:
            p.parent.mkdir(parents=True)
        p.write_text(f"file {i}\n" * 40)
        rels.append(rel)
    return rels


def cli(store: Path, *args: str) -> str:
    p = subprocess.run([PY, "-m", "rewindfs", "--store", str(store), *args], check=True,
                       capture_output=True, text=True, cwd=str(REPO), timeout=600)
    return p.stdout


def write_mib_s(root: Path, mib: int = 64) -> float:
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(root / "throughput.bin", "wb") as f:
        for _ in range(mib):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    s = time.perf_counter() - t0
    os.unlink(root / "throughput.bin")
    return mib / s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--dirty", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="also write every figure to this file")
    args = ap.parse_args()
    res: dict[str, Any] = {"files": args.files, "dirty": args.dirty}
    with scratch("steps-") as tmp:
        store = tmp / "store"
        seed = tmp / "seed"
        log(f"bench_steps: a tree of {args.files} files")
        rels = build_tree(seed, args.files)
        out = json.loads(cli(store, "session", "new", "--seed", str(seed),
                             "--base", str(tmp / "ws"), "--json"))
        sid, root = out["id"], Path(out["root"])
        try:
            sock = control_path(str(store / "sessions" / sid))
            assert sock is not None
            stride = max(1, args.files // args.dirty)
            dirty = rels[::stride][:args.dirty]
            for rel in dirty:
                (root / rel).write_text("changed\n")
            t0 = time.perf_counter()
            first = request(sock, {"op": "step_done", "label": "dirty"}, 120)["step"]
            res["first_step_ms"] = (time.perf_counter() - t0) * 1000
            res["first_step_paths"] = len(first["changes"])
            rounds, daemon, journaled = [], [], []
            for k in range(args.steps):
                for rel in dirty[(k * 10) % len(dirty):][:10]:
                    (root / rel).write_text(f"changed again {k}\n")
                t0 = time.perf_counter()
                st = request(sock, {"op": "step_done", "label": f"s{k}"}, 120)["step"]
                rounds.append((time.perf_counter() - t0) * 1000)
                daemon.append(st["daemon_ms"])
                journaled.append(st["elapsed_ms"])
                assert len(st["changes"]) == 10, st["changes"]
            # The transport alone: a request the session answers without work (connect,
            # the server's thread per connection, JSON both ways), in the same turns.
            nulls = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                request(sock, {"op": "mutated"}, 120)
                nulls.append((time.perf_counter() - t0) * 1000)
            diffs = []
            mc = Client.for_mount(str(root))
            for _ in range(max(5, args.runs)):
                t0 = time.perf_counter()
                d = mc.diff()
                diffs.append((time.perf_counter() - t0) * 1000)
            assert len(d["changes"]) >= args.dirty
            res.update(step_ms=statistics.median(rounds),
                       step_daemon_ms=statistics.median(daemon),
                       step_session_ms=statistics.median(journaled),
                       noop_ms=statistics.median(nulls),
                       diff_ms=statistics.median(diffs))

            quiet = [write_mib_s(root) for _ in range(args.runs)]
            stop = threading.Event()

            def stepper() -> None:
                while not stop.is_set():
                    request(sock, {"op": "step_done", "label": "background"}, 120)
                    stop.wait(0.05)

            th = threading.Thread(target=stepper)
            th.start()
            try:
                busy = [write_mib_s(root) for _ in range(args.runs)]
            finally:
                stop.set()
                th.join()
            res.update(write_mib_s=statistics.median(quiet),
                       write_mib_s_stepping=statistics.median(busy))
        finally:
            subprocess.run([PY, "-m", "rewindfs", "--store", str(store), "session",
                            "shutdown", sid], cwd=str(REPO), capture_output=True, timeout=300)
    rows = [
        ["step (step_done request, round trip)", f"{res['step_ms']:.2f} ms",
         f"{res['diff_ms'] / res['step_ms']:.1f}x faster than diff MNT"],
        ["  of which in the daemon (what changed since the last step)", f"{res['step_daemon_ms']:.2f} ms", ""],
        ["  of which the daemon + the journal append (barrier shared: group commit)", f"{res['step_session_ms']:.2f} ms", ""],
        ["a request without work (connect, thread, JSON), round trip",
         f"{res['noop_ms']:.2f} ms", ""],
        ["baseline: diff MNT request, round trip", f"{res['diff_ms']:.2f} ms", ""],
        [f"first step ({res['first_step_paths']} paths journaled)",
         f"{res['first_step_ms']:.2f} ms", ""],
        ["FUSE write, quiet", f"{res['write_mib_s']:.0f} MiB/s", ""],
        ["FUSE write, a step every 50 ms", f"{res['write_mib_s_stepping']:.0f} MiB/s",
         f"{res['write_mib_s'] / res['write_mib_s_stepping']:.2f}x (quiet / stepping)"],
    ]
    print(f"\nStep log: {args.files} files, {args.dirty} dirty paths, 10 changed per step, "
          f"medians of {args.steps} steps (goal: a step under 5 ms)\n")
    print(markdown_table(["what", "figure", "ratio"], rows))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
