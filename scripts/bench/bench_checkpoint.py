"""Checkpoint and restore benchmark: a live session mount against git and tar+zstd.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/bench_checkpoint.py [--sizes 2000,20000,200000]
        [--runs 5] [--json FILE] [--no-peers-above N]

For each tree size it builds a tree of that many files from the pinned Django sdist (copies
of it side by side, each copy with its own mtimes so no two directories are equal; cached
under ``agent-data/bench/ckpt/``), snapshots it into a fresh store, mounts it as a session
and measures, warm cache, median of ``--runs``:

- mount time: ``rewindfs mount REF MNT --state DIR`` until it serves (the CLI, end to end);
- checkpoint after changing 10 files spread over the tree: ``elapsed_ms`` reported by the
  daemon, and ``rewindfs checkpoint MNT --json`` end to end;
- restore to the previous checkpoint (10 files differ): ``elapsed_ms`` from the daemon, and
  ``rewindfs restore MNT REF --json`` end to end;
- peers on a plain copy of the same tree, same 10 changes: ``git add -A && git commit``,
  ``git checkout`` of the previous commit, a tar+zstd archive of the whole tree, and its
  restore by extraction into a staging directory and a swap (the reference system's method;
  removing the old copy afterwards is not counted).

Goals (issue 4): checkpoint and restore under 50 ms inside the daemon on the 20,000-file tree,
and flat across sizes (within 2x from 2,000 to 200,000 files). It prints a Markdown table and
exits 0 whether or not the goals are met.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402
from common import BENCH_DIR, DJANGO, log, markdown_table, rmtree, sh  # noqa: E402

CACHE = BENCH_DIR / "ckpt"
PY = sys.executable


def build_tree(n: int) -> Path:
    """A tree of exactly ``n`` regular files: copies ``c000``, ``c001``... of the Django
    tree (the last one cut short), written with fresh mtimes. Cached."""
    dest = CACHE / f"src-{n}"
    done = CACHE / f".src-{n}.done"
    if done.exists():
        return dest
    rmtree(dest)
    src = common.unpacked_tree(*DJANGO)
    files = []
    for dirpath, dirs, names in os.walk(src):
        dirs.sort()
        for name in sorted(names):
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                files.append(os.path.relpath(p, src))
    log(f"bench_checkpoint: building a tree of {n} files")
    made = 0
    copy = 0
    while made < n:
        base = dest / f"c{copy:03d}"
        for rel in files[:n - made]:
            out = base / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, out)
        made += min(len(files), n - made)
        copy += 1
    done.parent.mkdir(parents=True, exist_ok=True)
    done.touch()
    return dest


def spread(root: Path, k: int) -> list[Path]:
    """``k`` files spread evenly over the tree (walk order)."""
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        files += [Path(dirpath) / n for n in sorted(names)]
    step = max(1, len(files) // k)
    return files[::step][:k]


def change(files: list[Path], round_: int) -> None:
    for f in files:
        with open(f, "ab") as fh:
            fh.write(b"# bench change %d\n" % round_)


def rewindfs(store: Path, *args: str) -> tuple[float, dict[str, Any]]:
    """Run the CLI; (wall seconds, parsed --json output)."""
    t0 = time.perf_counter()
    r = subprocess.run([PY, "-m", "rewindfs", "--store", str(store), *args, "--json"],
                       capture_output=True, text=True, cwd=common.REPO)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"rewindfs {' '.join(args)}: {r.stderr.strip()}")
    out = r.stdout.strip().splitlines()
    return dt, (json.loads(out[-1]) if out else {})


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def phases(runs: list[dict[str, float]]) -> dict[str, float]:
    """Median ms of each step the daemon reports, over ``runs``."""
    keys = {k for r in runs for k in r}
    return {k: round(med([r[k] for r in runs if k in r]), 2) for k in sorted(keys)}


def bench_size(n: int, runs: int, peers: bool) -> dict[str, Any]:
    from fusefs.control import Client
    from store.objects import Store
    from store.snapshot import snapshot

    tree = build_tree(n)
    common.warm(tree)
    r: dict[str, Any] = {"files": n}
    with common.scratch(f"ckpt-{n}-") as tmp:
        store = tmp / "st"
        st = Store(store)
        t0 = time.perf_counter()
        ref0 = snapshot(st, tree)
        r["snapshot_s"] = time.perf_counter() - t0
        st.close()
        mnt = tmp / "mnt"
        mnt.mkdir()
        mounts = []
        for i in range(max(1, min(runs, 3))):
            state = tmp / f"state{i}"
            dt, _ = rewindfs(store, "mount", str(ref0), str(mnt), "--state", str(state))
            mounts.append(dt)
            if i < max(1, min(runs, 3)) - 1:
                sh([PY, "-m", "rewindfs", "umount", str(mnt)], cwd=common.REPO)
        r["mount_s"] = med(mounts)
        try:
            c = Client.for_mount(str(mnt))
            targets = spread(mnt, 10)
            refs = [c.checkpoint()["ref"]]
            daemon_ck, cli_ck = [], []
            ck_phases: list[dict[str, float]] = []
            rs_phases: list[dict[str, float]] = []
            for i in range(2 * runs):
                change(targets, i)
                if i % 2 == 0:
                    out = c.checkpoint()
                    daemon_ck.append(out["elapsed_ms"])
                    ck_phases.append(out.get("phases", {}))
                else:
                    dt, out = rewindfs(store, "checkpoint", str(mnt))
                    cli_ck.append(dt * 1000)
                    daemon_ck.append(out["elapsed_ms"])
                refs.append(out["ref"])
            daemon_rs, cli_rs = [], []
            for i in range(2 * runs):
                target = refs[-2] if i % 2 == 0 else refs[-1]
                if i % 4 < 2:
                    out = c.restore(target)
                    rs_phases.append(out.get("phases", {}))
                else:
                    dt, out = rewindfs(store, "restore", str(mnt), target)
                    cli_rs.append(dt * 1000)
                daemon_rs.append(out["elapsed_ms"])
            r.update(checkpoint_daemon_ms=med(daemon_ck), checkpoint_cli_ms=med(cli_ck),
                     restore_daemon_ms=med(daemon_rs), restore_cli_ms=med(cli_rs),
                     checkpoint_phases_ms=phases(ck_phases), restore_phases_ms=phases(rs_phases))
        finally:
            sh([PY, "-m", "rewindfs", "umount", str(mnt)], cwd=common.REPO)
        if peers:
            r.update(peer_times(tree, tmp, runs))
    return r


def peer_times(tree: Path, tmp: Path, runs: int) -> dict[str, Any]:
    work = tmp / "work"
    sh(["cp", "-a", str(tree), str(work)])
    gitdir = tmp / "git"
    env = common.git_env(gitdir, work)
    sh(["git", "init", "-q"], env=env)
    sh("git add -A && git commit -qm base", env=env)
    targets = spread(work, 10)
    commits, checkouts, tars, untars = [], [], [], []
    for i in range(runs):
        change(targets, i)
        t0 = time.perf_counter()
        sh("git add -A && git commit -qm change", env=env)
        commits.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        sh("git checkout -q HEAD~1 -- . ", env=env)
        checkouts.append(time.perf_counter() - t0)
        sh("git checkout -q HEAD -- .", env=env)
    archive = tmp / "a.tar.zst"
    for _i in range(max(1, min(runs, 3))):
        t0 = time.perf_counter()
        sh(f"tar -C '{work}' -cf - . | zstd -3 -q -T0 -f -o '{archive}'")
        tars.append(time.perf_counter() - t0)
        staging = tmp / "staging"
        t0 = time.perf_counter()
        staging.mkdir()
        sh(f"zstd -dc '{archive}' | tar -x -C '{staging}'")
        os.rename(work, tmp / "backup")
        os.rename(staging, work)
        untars.append(time.perf_counter() - t0)
        rmtree(tmp / "backup")
    return {"git_commit_ms": med(commits) * 1000, "git_checkout_ms": med(checkouts) * 1000,
            "tar_zstd_ms": med(tars) * 1000, "untar_swap_ms": med(untars) * 1000}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="2000,20000,200000")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--no-peers-above", type=int, default=20000, metavar="N",
                    help="skip git and tar for trees larger than N files (default 20000: "
                         "on 200,000 files they take about 15 minutes, mostly untar and "
                         "rm of the old copy)")
    args = ap.parse_args()
    rows = []
    results = []
    t_start = time.perf_counter()
    for n in [int(x) for x in args.sizes.split(",")]:
        log(f"bench_checkpoint: {n} files")
        res = bench_size(n, args.runs, n <= args.no_peers_above)
        results.append(res)
        log(json.dumps(res))
        rows.append([n, res["mount_s"] * 1000, res["checkpoint_daemon_ms"],
                     res["checkpoint_cli_ms"], res.get("git_commit_ms", "-"),
                     res.get("tar_zstd_ms", "-"), res["restore_daemon_ms"],
                     res["restore_cli_ms"], res.get("git_checkout_ms", "-"),
                     res.get("untar_swap_ms", "-")])
    print(markdown_table(
        ["files", "mount ms (CLI)", "checkpoint ms (daemon)", "checkpoint ms (CLI)",
         "git add+commit ms", "tar+zstd ms", "restore ms (daemon)", "restore ms (CLI)",
         "git checkout ms", "untar+swap ms"], rows))
    by = {r["files"]: r for r in results}
    if 20000 in by:
        for k in ("checkpoint_daemon_ms", "restore_daemon_ms"):
            v = by[20000][k]
            print(f"goal: {k} on 20,000 files < 50 ms: {v:.1f} ms "
                  f"({'met' if v < 50 else 'missed'})")
    if len(by) > 1:
        lo, hi = by[min(by)], by[max(by)]
        for k in ("checkpoint_daemon_ms", "restore_daemon_ms"):
            ratio = hi[k] / lo[k]
            print(f"goal: {k} flat from {min(by)} to {max(by)} files (within 2x): "
                  f"{ratio:.2f}x ({'met' if ratio <= 2 else 'missed'})")
    print(f"total run time: {time.perf_counter() - t_start:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
