"""Cost of no-open mode's writer scan of /proc (``fusefs/writers.py``), against a baseline.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/bench_scan.py [--baseline REV] [--runs 20]
        [--threads 200] [--fds 1000]

Starts a holder process of ``--threads`` threads sharing one descriptor table and
``--fds`` descriptors (two fifths regular files open for writing, three tenths open for
reading, the rest pipe ends), none of them on the device scanned (``/dev/shm``'s, a mount
without writers), then times one scan of the whole machine: with ``writers.py`` of
``--baseline`` (default ``main``, read with ``git show``), with this working tree's, and
with this working tree's where kcmp(2) is refused (every thread's table read). Then the
same without the holder (the machine as it is). The contenders take turns, run after run,
so load on the shared machine hits them alike. Prints the median milliseconds and the
ratios against the baseline, measured in the same run, and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fusefs import writers  # noqa: E402

HOLDER = r"""
import os, sys, threading
d, threads, fds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
for i in range(fds * 2 // 5):
    held.append(os.open(f"{d}/w{i}", os.O_WRONLY | os.O_CREAT, 0o644))
for i in range(fds * 3 // 10):
    open(f"{d}/r{i}", "w").close()
    held.append(os.open(f"{d}/r{i}", os.O_RDONLY))
while len(held) < fds:
    held.extend(os.pipe())
stop = threading.Event()
for _ in range(threads - 1):
    threading.Thread(target=stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
"""


def module_at(rev: str) -> types.ModuleType:
    """``fusefs/writers.py`` as of ``rev``, as a module of its own."""
    src = subprocess.run(["git", "show", f"{rev}:fusefs/writers.py"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(f"writers_{rev}")
    sys.modules[mod.__name__] = mod  # dataclasses looks its module up
    exec(compile(src, f"{rev}:fusefs/writers.py", "exec"), mod.__dict__)
    return mod


def no_kcmp() -> types.ModuleType:
    """This tree's ``writers`` where kcmp is refused (its number unknown)."""
    mod = types.ModuleType("writers_no_kcmp")
    sys.modules[mod.__name__] = mod
    exec(compile(Path(writers.__file__).read_text(), writers.__file__, "exec"), mod.__dict__)
    mod._SYS_KCMP = None
    return mod


def measure(contenders: dict[str, Callable[[], object]], runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(runs):
        for name, fn in contenders.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def report(title: str, times: dict[str, list[float]]) -> None:
    base = statistics.median(times["baseline"])
    print(f"\n{title}\n")
    print("| scan | median ms | ms / baseline |")
    print("| --- | ---: | ---: |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.1f} | {med / base:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="main", help="git revision to compare with")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=200)
    ap.add_argument("--fds", type=int, default=1000)
    args = ap.parse_args()
    st = os.stat("/dev/shm")
    device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    old, off = module_at(args.baseline), no_kcmp()
    commit = subprocess.run(["git", "rev-parse", args.baseline], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    contenders: dict[str, Callable[[], object]] = {
        "baseline": lambda: old.scan(device), "this tree": lambda: writers.scan(device),
        "this tree, kcmp refused": lambda: off.scan(device)}
    print(f"bench_scan: baseline {args.baseline} = {commit[:12]}, {args.runs} runs, "
          f"load average before {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    with tempfile.TemporaryDirectory(prefix="bench-scan-") as d:
        p = subprocess.Popen([sys.executable, "-c", HOLDER, d, str(args.threads),
                              str(args.fds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            seen = writers.scan(device)
            times = measure(contenders, args.runs)
        finally:
            p.kill()
            p.wait(30)
    report(f"With a holder of {args.threads} threads and {args.fds} descriptors "
           f"({seen.processes} processes, {seen.tables} tables read by this tree):", times)
    seen = writers.scan(device)
    report(f"The machine alone ({seen.processes} processes, {seen.tables} tables):",
           measure(contenders, args.runs))
    print(f"\nload average after {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
