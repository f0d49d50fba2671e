"""FUSE sequential write throughput of a session mount, against a baseline revision.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/bench_write.py [--baseline REV] [--runs 11] [--mib 256]

Mounts three read-write session mounts (``rewindfs mount REF MNT --state DIR``) over the
same small snapshot: the code of ``--baseline`` (default ``main``; unpacked with ``git
archive`` into a temporary directory and run from there), the code of this working tree,
and this working tree with a byte quota set (``--quota-bytes 1T``, so the quota's
accounting runs on every write without refusing any). Each run writes ``--mib`` MiB with
``dd bs=1M`` into a new file (no fsync: what is timed is the FUSE write path and the
daemon's copy into its upper data file, after a sync so no contender's dirty pages
throttle another's) and deletes it; the contenders take turns, run
after run, each going first in turn, so load on the shared machine hits them alike. Prints the median time and
throughput of each and the ratios against the baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parents[1] / "tests"))

import fusehelpers as fh  # noqa: E402

sys.path.insert(0, str(HERE))
from common import unpack  # noqa: E402


def daemon(tmp: Path, name: str, store: Path, ref: str, tree: Path | None,
           extra: list[str]) -> fh.Daemon:
    d = fh.Daemon(store=store, mnt=tmp / f"mnt-{name}", ref=ref, state=tmp / f"state-{name}",
                  log=tmp / f"{name}.log", extra=extra)
    if tree is not None:  # run that tree's code: its directory first on sys.path
        d.command = ["sh", "-c", 'cd "$1" && shift && exec "$@"', "sh", str(tree),
                     *d.argv()]
    return fh.start(d)


def one_run(mnt: Path, mib: int) -> float:
    target = mnt / "seq.bin"
    # Each run starts with no dirty pages: otherwise the previous contender's 256 MiB still
    # being written back to the upper data files' disk throttles this run's writes.
    os.sync()
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={mib}"],
                   check=True, capture_output=True)
    s = time.perf_counter() - t0
    target.unlink()
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision to compare with")
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--mib", type=int, default=256, help="MiB written per run")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=REPO / "agent-data" if (REPO / "agent-data").is_dir()
                                     else None) as t:
        tmp = Path(t)
        commit = unpack(args.baseline, tmp / "baseline")
        src = tmp / "src"
        src.mkdir()
        (src / "README").write_text("bench\n")
        store = tmp / "store"
        ref = fh.snapshot(store, src)
        mounts = {}
        try:
            mounts["baseline"] = daemon(tmp, "baseline", store, ref, tmp / "baseline", [])
            mounts["current"] = daemon(tmp, "current", store, ref, None, [])
            mounts["current+quota"] = daemon(tmp, "quota", store, ref, None,
                                             ["--quota-bytes", "1T"])
            times: dict[str, list[float]] = {k: [] for k in mounts}
            for d in mounts.values():  # warm-up
                one_run(d.mnt, min(args.mib, 16))
            names = list(mounts)
            for i in range(args.runs):  # each contender goes first in turn
                for k in names[i % len(names):] + names[:i % len(names)]:
                    times[k].append(one_run(mounts[k].mnt, args.mib))
        finally:
            for d in mounts.values():
                fh.stop(d)
    base = statistics.median(times["baseline"])
    base_min = min(times["baseline"])
    print(f"Sequential write of {args.mib} MiB (dd bs=1M, no fsync) through a session mount; "
          f"medians of {args.runs} runs, baseline {args.baseline} = {commit[:12]}; the fastest "
          f"run of each too (what is left when nothing else on the machine interferes)")
    print("| mount | median s | MiB/s | time / baseline | fastest s | fastest / baseline's "
          "| runs (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.3f} | {args.mib / med:.0f} | {med / base:.3f}x | {min(v):.3f} | "
              f"{min(v) / base_min:.3f}x | " + ", ".join(f"{x:.3f}" for x in v) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
