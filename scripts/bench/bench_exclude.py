"""What the ``exclude`` path policy costs a checkpoint, driven through the overlay API.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/bench_exclude.py [--kept 0,5000,20000] [--runs 5]

For each count N it makes a fresh store and session upper, writes N small files under
``node_modules/`` (100 per directory), checkpoints once, then measures the median of
``--runs`` checkpoints that each follow a one-file change outside ``node_modules``: once
with ``node_modules/`` excluded (the N files stay in the upper), and as the baseline in the
same run without a policy (the N files are frozen by the first checkpoint, so the upper is
empty before each measured one). It prints one line per N with both medians and their
ratio; it exits 0 whatever the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from fusefs.checkpoint import checkpoint_overlay  # noqa: E402
from fusefs.inodes import ROOT_INO  # noqa: E402
from fusefs.lower import Lower  # noqa: E402
from fusefs.overlay import Overlay  # noqa: E402
from fusefs.upper import Upper  # noqa: E402
from store.objects import Store  # noqa: E402
from store.snapshot import snapshot  # noqa: E402


def _file(ov: Overlay, d: int, name: bytes, data: bytes) -> None:
    n = ov.lookup(d, name)
    if n is None:
        fh, n = ov.create(d, name, 0o644, os.O_WRONLY, os.getuid(), os.getgid())
    else:
        fh = ov.open(n.ino, os.O_WRONLY | os.O_TRUNC)
    ov.write(fh, 0, data)
    ov.release(fh)


def _dir(ov: Overlay, d: int, name: bytes) -> int:
    n = ov.lookup(d, name) or ov.mkdir(d, name, 0o755, os.getuid(), os.getgid())
    return n.ino


def median_ms(kept: int, exclude: tuple[str, ...], runs: int) -> float:
    tmp = Path(tempfile.mkdtemp(prefix="bench-exclude-"))
    src = tmp / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg/main.py").write_bytes(b"print(1)\n")
    store = Store(tmp / "store", chunk_size=1 << 20)
    up = Upper.open(str(tmp / "state"), store_root=store.root, chunk_size=1 << 20,
                    ref=snapshot(store, src))
    up.set_exclude(exclude)
    ov = Overlay(Lower(store, up.base), up)
    nm = _dir(ov, ROOT_INO, b"node_modules")
    for i in range(kept):
        _file(ov, _dir(ov, nm, b"p%d" % (i // 100)), b"f%d.js" % i, b"x")
    ov.commit()
    checkpoint_overlay(ov)
    pkg = ov.resolve("pkg").ino
    times = []
    for k in range(runs):
        _file(ov, pkg, b"main.py", b"print(%d)\n" % k)
        ov.commit()
        t = time.perf_counter()
        checkpoint_overlay(ov)
        times.append((time.perf_counter() - t) * 1000)
    ov.close()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kept", default="0,5000,20000")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    for n in (int(x) for x in a.kept.split(",")):
        base = median_ms(n, (), a.runs)
        ex = median_ms(n, ("node_modules/",), a.runs)
        print(f"{n:>6} files under node_modules: checkpoint of one change {ex:.1f} ms "
              f"excluded, {base:.1f} ms without a policy (baseline): {ex / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
