"""Sparse-file checkpoint benchmark: a 1 TiB sparse file beside the same data in a plain file.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/bench_sparse.py [--runs 3] [--chunk-size 1M]
        [--size-gib 1024] [--json FILE]

It snapshots a small tree into a fresh store (``--chunk-size``: the store's chunk size),
mounts it as a session (``rewindfs mount REF MNT --state DIR``) and measures, median of
``--runs``, three checkpoints after writing the same 4 KiB of data:

- plain: into a new 4 KiB file (the baseline);
- sparse, new: into a new file of ``--size-gib`` GiB (1 TiB: the size limit), the 4 KiB at
  the middle, everything else a hole (``truncate`` then one ``pwrite``);
- sparse, lower: into a sparse file of the same size already checkpointed, so the data
  lands next to its lower chunk list (copy-up of one chunk of a file of a million chunk
  slots).

Each is timed inside the daemon (``elapsed_ms`` of the control socket's checkpoint) and end to
end; ``st_blocks`` of the new sparse file and the tree version of the resulting Ref are shown too. The cost of a
checkpoint must follow the data written and the chunk list's runs, not the logical size
(issue 10 point 5): the goal is under 10 s for the 1 TiB file (it took 366 s for two such
files before chunk runs), and a ratio to the plain file near 1. It prints a Markdown table
and exits 0 whether or not the goal is met.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402
from common import log, markdown_table, sh  # noqa: E402

PY = sys.executable
DATA = bytes(range(256)) * 16  # 4 KiB


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


rewindfs = common.rewindfs_json


def checkpoint(mnt: Path) -> tuple[float, float, str]:
    """(daemon ms, end-to-end ms, Ref) of one checkpoint of ``mnt``."""
    from fusefs.control import Client

    t0 = time.perf_counter()
    out = Client.for_mount(str(mnt)).checkpoint()
    return out["elapsed_ms"], (time.perf_counter() - t0) * 1000, out["ref"]


def tree_version(store: Path, ref: str) -> int:
    from store.objects import Store
    from store.ref import Ref

    st = Store(store)
    try:
        return st.root_tree(Ref.parse(ref)).version
    finally:
        st.close()


def write_at(path: Path, off: int, size: int | None) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        os.pwrite(fd, DATA, off)
    finally:
        os.close(fd)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from store.objects import Store
    from store.snapshot import snapshot

    size = args.size_gib << 30
    middle = (size // 2) & ~0xFFF
    rows: dict[str, list[tuple[float, float]]] = {"plain": [], "sparse, new": [],
                                                  "sparse, lower": []}
    info: dict[str, Any] = {"size": size, "chunk_size": _size(args.chunk_size)}
    with common.scratch("sparse-") as tmp:
        src = tmp / "src"
        src.mkdir()
        (src / "README").write_text("a small tree\n")
        store = tmp / "st"
        st = Store(store, chunk_size=info["chunk_size"])
        ref0 = snapshot(st, src)
        st.close()
        mnt = tmp / "mnt"
        mnt.mkdir()
        rewindfs(store, "mount", str(ref0), str(mnt), "--state", str(tmp / "state"))
        try:
            write_at(mnt / "warmup", 0, None)  # the first checkpoint of a mount pays more
            checkpoint(mnt)
            for i in range(args.runs):
                write_at(mnt / f"plain{i}", 0, None)
                ms, e2e, _ = checkpoint(mnt)
                rows["plain"].append((ms, e2e))
                log(f"run {i}: plain {ms:.0f} ms")
                sparse = mnt / f"sparse{i}.img"
                write_at(sparse, middle, size)
                info["st_blocks_upper"] = os.stat(sparse).st_blocks
                ms, e2e, ref = checkpoint(mnt)
                rows["sparse, new"].append((ms, e2e))
                info["tree_version"] = tree_version(store, ref)
                log(f"run {i}: sparse, new {ms:.0f} ms")
                write_at(sparse, middle + (64 << 20), None)  # another chunk, beside lower
                ms, e2e, _ = checkpoint(mnt)
                rows["sparse, lower"].append((ms, e2e))
                log(f"run {i}: sparse, lower {ms:.0f} ms")
        finally:
            sh([PY, "-m", "rewindfs", "umount", str(mnt)], cwd=common.REPO)
    out: dict[str, Any] = dict(info)
    for k, v in rows.items():
        out[k] = {"daemon_ms": statistics.median(x for x, _ in v),
                  "end_to_end_ms": statistics.median(y for _, y in v)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk-size", default="1M", help="the store's chunk size (64K..8M)")
    ap.add_argument("--size-gib", type=int, default=1024, help="sparse file size, GiB")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    r = run(args)
    base = r["plain"]["daemon_ms"]
    slots = -(-r["size"] // r["chunk_size"])
    table = [[k, f"{r[k]['daemon_ms']:.1f} ms", f"{r[k]['end_to_end_ms']:.1f} ms",
              f"{r[k]['daemon_ms'] / base:.2f}x"]
             for k in ("plain", "sparse, new", "sparse, lower")]
    print(f"Checkpoint of 4 KiB of data, alone and in a {r['size'] >> 30} GiB sparse file "
          f"({slots:,} chunk slots of {r['chunk_size'] >> 10} KiB; the tree is written in "
          f"version {r['tree_version']}; its st_blocks before the checkpoint: "
          f"{r['st_blocks_upper']}), median of {args.runs} runs:\n")
    print(markdown_table(["write", "checkpoint (daemon)", "checkpoint (end to end)",
                          "daemon / plain"], table))
    worst = max(r["sparse, new"]["daemon_ms"], r["sparse, lower"]["daemon_ms"]) / 1000
    print(f"\nGoal: under 10 s for the sparse file: {worst:.2f} s "
          f"({'met' if worst < 10 else 'NOT met'}).")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
