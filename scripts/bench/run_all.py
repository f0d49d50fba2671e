"""Every benchmark of rewindfs in one go, and the Markdown tables of ratios the README shows.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/run_all.py [--quick] [--wait-load L] [--no-readme]

It runs, one after the other (never two at once, so they do not disturb each other), each in
its own process group with a time limit, every benchmark under ``scripts/bench/``, with
sizes and run counts chosen so that the whole run stays within 20 minutes on a 2-core
machine (``BUDGET_S``; the heavy ones take fewer runs here than alone, and the report says
so):

- ``bench_store.py``: snapshot, re-snapshot, materialize and stored size on the Django
  sdist against ``tar | zstd -3`` and git;
- ``bench_fuse.py``: a session mount against tmpfs, ext4 and fuse-overlayfs (cold runs drop
  the kernel caches when run as root);
- ``bench_checkpoint.py``: checkpoint and restore on trees of 2,000, 20,000 and 200,000
  files against git and tar+zstd with a staged swap (peers up to 20,000 files); the
  200,000-file tree only once it is built (``--big`` builds it: about 5 minutes, once);
- ``bench_sessions.py``: 100 FUSE sessions forked from one 20,000-file snapshot, against the
  no-FUSE fallback (a staged copy per session, the reference system's method; 3 sessions);
- ``bench_tools.py``: the Grep and Glob tools over a session mount of a 20,000-file tree
  against ``rg`` and ``find`` on a native copy, and Bash ``true`` through ``rewindfs mcp``
  without and with a path policy covering 200 files of that tree;
- ``bench_remote.py``: the shared store (SeaweedFS + PostgreSQL on loopback) against the
  local store: snapshot, re-snapshot, materialize, checkpoint of 10 changes, cold and warm
  256 MiB reads through a mount;
- ``bench_steps.py``: recording a step of the step change log at 1,000 dirty paths of a
  20,000-file session, against ``diff MNT``, and FUSE writes with and without steps;
- ``bench_sparse.py``: checkpoint of 4 KiB in a 1 TiB sparse file against a plain file;
- ``bench_write.py``: sequential FUSE writes of the working tree against a baseline
  revision (``ROUND_BASELINE``, main when this round's issues were filed), with and without
  a byte quota;
- ``bench_exclude.py``: checkpoint of a one-file change with 5,000 and 20,000 files kept
  under an excluded ``node_modules/``, against the same change without a policy;
- ``bench_scan.py``: no-open mode's scan of /proc for open writers, with a holder of 200
  threads and 1,000 descriptors and without, against the scan of ``SCAN_BASELINE``.

``--quick`` is a smoke run (5 to 10 minutes): one run of each benchmark except
``bench_exclude.py`` (5 runs, at the same kept-file counts: it takes seconds),
``bench_scan.py`` (3 runs) and the Bash rows of ``bench_tools.py`` (at least 20 calls each);
fewer sessions (20 FUSE, 2 fallback) and steps (10), 64 MiB FUSE writes, and never the
200,000-file checkpoint tree;
``--only NAME,...`` runs some of them (the others are reported as not run).
``--wait-load L`` waits (up to 10 minutes) until the 1-minute load average is below L
before starting; the load averages before and after each benchmark are part of the report.

It writes ``docs/performance.md`` (the tables of ratios, then each benchmark's own report)
and replaces the part of ``README.md`` between ``<!-- perf:begin -->`` and
``<!-- perf:end -->`` with the tables of ratios, so every figure there comes from this
script (``--doc FILE`` and ``--readme FILE`` write them elsewhere, e.g. into a copy). The
README's prose cites rows of these tables by their first cell (``CITED``): a report that
lacks one of them, of a benchmark that ran, is an error (exit 1, the row named). Raw
figures go to ``agent-data/bench/run_all/`` (``results.json`` holds the whole run;
``--from-results FILE`` writes the reports again from it, measuring nothing, e.g. after a
change of layout). Exit status 0 when every benchmark ran and every cited row is there, 1
when one failed or ran out of time, or its figures lack what its table reads (its section
then says so), or a cited row is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT_DIR = REPO / "agent-data" / "bench" / "run_all"
DOC = REPO / "docs" / "performance.md"
README = REPO / "README.md"
BEGIN, END = "<!-- perf:begin -->", "<!-- perf:end -->"
PY = sys.executable
BUDGET_S = 20 * 60
"""The whole run's time budget on a 2-core machine (seconds); a run over it says so."""
FEWER = "fewer runs under run_all: "
REMOTE_RUNS = 5
"""bench_remote.py's runs under run_all, as many as the many-hosts issue asks (medians of 5):
one run takes about 35 s on a quiet machine, 3 minutes at load 10."""
EXCLUDE_KEPT = (5000, 20000)
"""bench_exclude.py's kept-file counts under run_all, ``--quick`` included (the rows the
README cites are named by them; the whole benchmark takes seconds)."""

FUSE_LABELS = {
    "grep_cold": "grep -r, cold", "grep_warm": "grep -r, warm",
    "stat_warm": "find -type f + xargs stat, warm", "git_status": "git status, warm",
    "untar": "untar the tree (create)", "rm_rf": "rm -rf of it",
    "seq_cold": "256 MiB sequential read, cold", "seq_warm": "256 MiB sequential read, warm",
    "rand_cold": "2,000 random 4 KiB reads, cold",
    "git_add": "git init + add -A of an untarred tree",
    "ls_cold": "ls -l of 100,000 entries, first after mount",
    "ls_warm": "ls -l of 100,000 entries, warm",
}


CITED: dict[str, tuple[str, tuple[str, ...]]] = {
    "Agent tools": ("tools", ("Bash true (MCP stdio)",
                              "Bash true, 100 hidden + 100 protected",
                              "Bash true, same policy, bwrap binds")),
    "Shared store": ("remote", ("first snapshot (s)", "unchanged re-snapshot (s)",
                                "materialize (s)", "checkpoint, 10 changes (ms)",
                                "cold read 256 MiB (MiB/s)", "warm re-read 256 MiB (MiB/s)")),
    "Step change log": ("steps", ("a step, round trip", "a step, in the daemon",
                                  "a step, in the daemon with its journal append",
                                  "a request without work, round trip",
                                  "FUSE write with a step every 50 ms")),
    "Excluded paths": ("exclude", ("5,000 files kept", "20,000 files kept")),
    "Sessions": ("sessions", ("resident size of a session process (RSS median)",)),
    "Sparse files": ("sparse", ("plain", "sparse, new")),
}
"""The rows the README's prose cites instead of stating figures of its own: table (its
``####`` heading) -> (the benchmark that fills it, the rows' first cells, code spans'
backticks left out). The prose names each as "label"."""


@dataclass
class Result:
    """One benchmark's run: its command, output, figures and the load around it."""

    name: str
    cmd: list[str]
    seconds: float = 0.0
    status: str = "not run"  # ok | failed (exit N) | timed out | skipped
    stdout: str = ""
    stderr: str = ""
    data: Any = None
    load_before: float = 0.0
    load_after: float = 0.0
    notes: list[str] = field(default_factory=list)


# -- running ------------------------------------------------------------------------------


def fuse_mounts_under(prefix: Path) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [ln.split()[1] for ln in f
                if ln.split()[2].startswith("fuse") and ln.split()[1].startswith(str(prefix))]


def unmount_under(prefix: Path) -> None:
    """Lazily unmount every FUSE mount under ``prefix`` (left by a benchmark we stopped)."""
    for m in sorted(fuse_mounts_under(prefix), key=len, reverse=True):
        subprocess.run(["fusermount3", "-uz", m], capture_output=True)


def run_bench(res: Result, timeout: float) -> None:
    """Run ``res.cmd`` from the repository root in its own process group; on timeout (or
    if this script is stopped) kill the group and unmount what it left."""
    print(f"run_all: {res.name}: {shlex.join(res.cmd)} (limit {timeout:.0f} s)", flush=True)
    res.load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(res.cmd, cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True, errors="replace")
    try:
        res.stdout, res.stderr = proc.communicate(timeout=timeout)
        res.status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except BaseException as e:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            res.stdout, res.stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            res.stdout, res.stderr = proc.communicate()
        res.status = "timed out" if isinstance(e, subprocess.TimeoutExpired) else "stopped"
        unmount_under(REPO / "agent-data" / "bench")
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
    finally:
        res.seconds = time.perf_counter() - t0
        res.load_after = os.getloadavg()[0]
        print(f"run_all: {res.name}: {res.status} in {res.seconds:.0f} s (load "
              f"{res.load_before:.1f} -> {res.load_after:.1f})", flush=True)
        if res.status != "ok":
            print("\n".join(res.stderr.strip().splitlines()[-15:]), file=sys.stderr)


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def parse_sessions(text: str) -> dict[str, Any]:
    """The figures ``bench_sessions.py`` prints (it has no JSON output)."""
    out: dict[str, Any] = {}
    m = re.search(r"^backend: (\w+)", text, re.M)
    if m:
        out["backend"] = m.group(1)
    m = re.search(r"(\d+) forks: time until the root is usable, ms: median ([\d.]+), "
                  r"p90 ([\d.]+), max ([\d.]+)", text)
    if m:
        out.update(sessions=int(m.group(1)), usable_median_ms=float(m.group(2)),
                   usable_p90_ms=float(m.group(3)), usable_max_ms=float(m.group(4)))
    m = re.search(r"read through it, ms: median ([\d.]+)", text)
    if m:
        out["read_median_ms"] = float(m.group(1))
    m = re.search(r"store growth over all forks: (\d+) pack bytes", text)
    if m:
        out["growth_bytes"] = int(m.group(1))
    m = re.search(r"RSS median ([\d.]+) MiB", text)
    if m:
        out["rss_median_mib"] = float(m.group(1))
    m = re.search(r"shutdown: ([\d.]+) ms per session", text)
    if m:
        out["shutdown_ms"] = float(m.group(1))
    return out


def parse_exclude(text: str) -> list[dict[str, float]]:
    """The figures ``bench_exclude.py`` prints (it has no JSON output): per count of kept
    files, the median checkpoint with them excluded and without a policy, in ms."""
    return [{"kept": int(m.group(1)), "excluded_ms": float(m.group(2)),
             "baseline_ms": float(m.group(3))}
            for m in re.finditer(r"^\s*(\d+) files under node_modules: checkpoint of one change "
                                 r"([\d.]+) ms excluded, ([\d.]+) ms without a policy", text,
                                 re.M)]


def wait_for_load(limit: float, max_wait_s: float = 600) -> None:
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        print(f"run_all: load average {os.getloadavg()[0]:.1f} >= {limit}; waiting",
              flush=True)
        time.sleep(30)


# -- the tools benchmark needs a session mount of its tree ---------------------------------


def run_tools(res: Result, runs: int, timeout: float) -> None:
    """Build the 20,000-file tree (kept under ``agent-data/bench/tools-tree``) with the
    files the Bash policy row matches, snapshot it into a scratch store, serve it with
    ``rewindfs mount REF MNT --state DIR``, run ``bench_tools.py --tree TREE --root MNT``,
    unmount."""
    rw = str(Path(PY).parent / "rewindfs")
    tree = REPO / "agent-data" / "bench" / "tools-tree"
    work = REPO / "agent-data" / "bench" / "tmp" / "run_all-tools"
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    mnt = work / "mnt"
    mnt.mkdir()
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    try:
        if not (tree / ".built").exists():
            subprocess.run(["rm", "-rf", str(tree)], check=True)
            print("run_all: building the tools benchmark's 20,000-file tree", flush=True)
            importlib.import_module("bench_tools").build_tree(str(tree))
            (tree / ".built").touch()
        # The policy row's matches, before the snapshot: the tools (on the mount) and rg and
        # find (on the native tree) then see the same files, and the row covers them.
        importlib.import_module("bench_tools").policy_paths(str(tree))
        store = str(work / "store")
        ref = subprocess.run([rw, "--store", store, "snapshot", str(tree)], check=True,
                             capture_output=True, text=True).stdout.strip()
        subprocess.run([rw, "--store", store, "mount", ref, str(mnt), "--state",
                        str(work / "state")], check=True, capture_output=True, text=True)
        res.cmd = [PY, str(HERE / "bench_tools.py"), "--tree", str(tree), "--root", str(mnt),
                   "--runs", str(runs), "--json"]
        run_bench(res, timeout)
        if res.status == "ok":
            res.data = json.loads(res.stdout)
            res.notes.append("the tools see the tree through `rewindfs mount REF MNT --state "
                             "DIR`; rg and find run on the native tree")
    finally:
        if fuse_mounts_under(mnt):
            subprocess.run([rw, "umount", str(mnt)], capture_output=True, timeout=120)
        unmount_under(work)
        subprocess.run(["rm", "-rf", str(work)])


# -- the report ---------------------------------------------------------------------------


def fmt_s(s: float) -> str:
    if s >= 100:
        return f"{s:,.0f} s"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1000:.0f} ms" if s >= 0.01 else f"{s * 1000:.1f} ms"


def fmt_ms(ms: float) -> str:
    return fmt_s(ms / 1000)


def ratio(a: float, b: float) -> str:
    if not b:
        return "-"
    r = a / b
    if r < 0.1:
        return f"{r:.2g}x"
    return f"{r:.2f}x" if r < 10 else f"{r:.0f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table; a ``|`` inside a cell (even in a code span) is escaped."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.replace("\\|", "|").replace("|", "\\|")
                                 for c in cells) + " |"

    lines = [line(header), "|" + "|".join(" --- " for _ in header) + "|"]
    lines += [line(r) for r in rows]
    return "\n".join(lines)


def not_run(res: Result) -> str:
    if res.status == "ok":   # it ran, but left nothing this report reads
        return f"_Not available: the {res.name} benchmark gave no figures this report reads._"
    return f"_Not available: the {res.name} benchmark: {res.status}._"


def own_table_section(res: Result) -> str:
    """A benchmark that prints its own Markdown report on stdout (sparse, write, scan):
    that report, as it printed it."""
    if res.status != "ok" or not res.stdout.strip():
        return not_run(res)
    return res.stdout.strip()


def remote_section(res: Result) -> str:
    d = res.data
    if res.status != "ok" or not d:
        return not_run(res)
    from bench_remote import report

    return report(d)


SCAN_BASELINE = "2022d94"
"""main before this round's changes to the writer scan (every mount namespace, threads'
own descriptor tables): ``bench_scan.py`` compares the scan with its ``fusefs/writers.py``."""

ROUND_BASELINE = "9d1dbc7"
"""main when this round's issues were filed: the embedded store must stay within 1.1x of its
code (many hosts) and FUSE writes within 1.15x (agent history)."""


def has_commit(rev: str) -> bool:
    """Whether this clone holds commit ``rev`` (a shallow clone may not)."""
    return subprocess.run(["git", "cat-file", "-e", f"{rev}^{{commit}}"], cwd=REPO,
                          capture_output=True).returncode == 0


def store_section(res: Result) -> str:
    d = res.data
    if res.status != "ok" or not d:
        return not_run(res)
    snap = d["snapshot_s"]
    rows = [
        ["first snapshot", fmt_s(snap), "`git add -A && git commit`",
         fmt_s(d["git_commit_s"]), ratio(snap, d["git_commit_s"])],
        ["first snapshot", fmt_s(snap), "`tar -c | zstd -3`", fmt_s(d["tar_zstd_s"]),
         ratio(snap, d["tar_zstd_s"])],
        ["re-snapshot, unchanged tree", fmt_s(d["resnapshot_s"]), "first snapshot",
         fmt_s(snap), ratio(d["resnapshot_s"], snap)],
        ["materialize", fmt_s(d["materialize_s"]), "`zstd -dc | tar -x`",
         fmt_s(d["tar_x_s"]), ratio(d["materialize_s"], d["tar_x_s"])],
        ["materialize", fmt_s(d["materialize_s"]), "`git checkout`",
         fmt_s(d["git_checkout_s"]), ratio(d["materialize_s"], d["git_checkout_s"])],
        ["stored size (packs)", f"{d['pack_bytes'] / 1e6:.1f} MB", "`tar | zstd -3` file",
         f"{d['tar_zstd_bytes'] / 1e6:.1f} MB", ratio(d["pack_bytes"], d["tar_zstd_bytes"])],
    ]
    out = (f"Store, on the {d['tree']} sdist ({d['files']:,} files, {d['bytes'] / 1e6:.0f} "
           f"MB), warm cache, median of {d['runs']} run(s):\n\n" +
           table(["operation", "rewindfs", "peer", "peer's figure", "rewindfs / peer"], rows))
    b = d.get("baseline")
    if b:
        brows = [[what, fmt_s(b[f"current_{op}"]), fmt_s(b[f"baseline_{op}"]),
                  ratio(b[f"current_{op}"], b[f"baseline_{op}"]),
                  ratio(b[f"current_cpu_{op}"], b[f"baseline_cpu_{op}"])
                  if f"current_cpu_{op}" in b else "-"]
                 for what, op in (("first snapshot", "snapshot_s"),
                                  ("re-snapshot, unchanged tree", "resnapshot_s"),
                                  ("materialize", "materialize_s"))]
        brows.append(["stored size (packs)", f"{b['current_pack_bytes'] / 1e6:.2f} MB",
                      f"{b['baseline_pack_bytes'] / 1e6:.2f} MB",
                      ratio(b["current_pack_bytes"], b["baseline_pack_bytes"]), "-"])
        out += (f"\n\nThe embedded store (local directory + SQLite) against its code at "
                f"{b['commit'][:7]}, before the shared store was built (each in its own "
                f"interpreter, taking turns; median of {b['runs']} run(s); goal: within 1.1x; "
                f"{'met' if b['within_1_1x'] else 'missed'}):\n\n" +
                table(["operation", "this commit", f"at {b['commit'][:7]}", "ratio",
                       "CPU time ratio"], brows))
    return out


def fuse_section(res: Result) -> str:
    d = res.data
    if res.status != "ok" or not d or "rewindfs" not in d:
        return not_run(res)
    rw = d["rewindfs"]
    names = [n for n in ("ext4", "tmpfs", "fuse-overlayfs") if n in d]
    rows = []
    for key, label in FUSE_LABELS.items():
        if key not in rw:
            continue
        row = [label, fmt_s(rw[key]["s"])]
        row += [fmt_s(d[n][key]["s"]) if key in d[n] else "-" for n in names]
        row += [ratio(rw[key]["s"], d[n][key]["s"]) if key in d[n] else "-" for n in names]
        row.append(f"{rw[key]['requests']:,}" if "requests" in rw[key] else "-")
        rows.append(row)
    header = (["workload", "rewindfs"] + names + [f"rewindfs / {n}" for n in names]
              + ["FUSE requests"])
    runs = sorted({len(v.get("runs", [])) for v in rw.values()})
    how = (f"median of {runs[-1]} runs ({runs[0]} for the cold ones, untar and rm -rf)"
           if len(runs) > 1 else f"median of {runs[0] if runs else '?'} run(s)")
    return ("A read-write session mount (`rewindfs mount REF MNT --state DIR`) over the "
            "Django sdist with its .git and a 256 MiB file, against the same tree on "
            f"tmpfs, on ext4 (the local disk) and under fuse-overlayfs; {how}:"
            "\n\n" + table(header, rows))


def checkpoint_section(res: Result) -> str:
    d = res.data
    if res.status != "ok" or not d:
        return not_run(res)
    rows = []
    for r in d:
        rows.append([
            f"{r['files']:,}", fmt_ms(r["checkpoint_daemon_ms"]),
            fmt_ms(r["checkpoint_cli_ms"]),
            fmt_ms(r["git_commit_ms"]) if "git_commit_ms" in r else "-",
            ratio(r["checkpoint_cli_ms"], r["git_commit_ms"]) if "git_commit_ms" in r else "-",
            fmt_ms(r["tar_zstd_ms"]) if "tar_zstd_ms" in r else "-",
            fmt_ms(r["restore_daemon_ms"]), fmt_ms(r["restore_cli_ms"]),
            fmt_ms(r["git_checkout_ms"]) if "git_checkout_ms" in r else "-",
            ratio(r["restore_cli_ms"], r["git_checkout_ms"]) if "git_checkout_ms" in r
            else "-",
            fmt_ms(r["untar_swap_ms"]) if "untar_swap_ms" in r else "-",
        ])
    out = ("Checkpoint after changing 10 files, and restore to the previous checkpoint, on a "
           "live session mount; \"daemon\" is `elapsed_ms` measured inside the daemon, "
           "\"CLI\" is `rewindfs checkpoint|restore MNT` end to end (interpreter start "
           "included), compared with the same work done with git and with a tar+zstd "
           "archive restored by extraction and a staged directory swap:\n\n")
    out += table(["files", "checkpoint (daemon)", "checkpoint (CLI)", "git add+commit",
                  "CLI / git", "tar+zstd", "restore (daemon)", "restore (CLI)",
                  "git checkout", "CLI / git", "untar+swap"], rows)
    if len(d) > 1:
        lo, hi = d[0], d[-1]
        out += (f"\n\nFrom {lo['files']:,} to {hi['files']:,} files, checkpoint inside the "
                f"daemon grows {ratio(hi['checkpoint_daemon_ms'], lo['checkpoint_daemon_ms'])}"
                f" and restore {ratio(hi['restore_daemon_ms'], lo['restore_daemon_ms'])}.")
    return out


def sessions_section(fuse: Result, fallback: Result) -> str:
    d, f = fuse.data or {}, fallback.data or {}
    if fuse.status != "ok" or "usable_median_ms" not in d:
        return not_run(fuse)
    peer = fallback.status == "ok" and "usable_median_ms" in f
    rows = [["time until the root is usable (median)", fmt_ms(d["usable_median_ms"]),
             fmt_ms(f["usable_median_ms"]) if peer else "-",
             ratio(d["usable_median_ms"], f["usable_median_ms"]) if peer else "-"],
            ["... p90", fmt_ms(d["usable_p90_ms"]),
             fmt_ms(f["usable_p90_ms"]) if peer else "-",
             ratio(d["usable_p90_ms"], f["usable_p90_ms"]) if peer else "-"],
            ["store growth over all forks", f"{d.get('growth_bytes', '?')} bytes",
             f"{f.get('growth_bytes', '?')} bytes" if peer else "-", ""]]
    extra = ""
    if "rss_median_mib" in d:
        rows.append(["resident size of a session process (RSS median)",
                     f"{d['rss_median_mib']:.0f} MiB", "-", ""])
        extra = " Each FUSE session is one process (its RSS includes shared pages)."
    return (f"{d.get('sessions', '?')} sessions forked one after the other from one "
            f"20,000-file snapshot (FUSE backend), against the no-FUSE fallback, which "
            f"copies the tree into each session's root (the reference system's method; "
            f"{f.get('sessions', '?')} sessions).{extra}\n\n" +
            table(["", "rewindfs (FUSE)", "staged copy (fallback)", "rewindfs / copy"], rows))


def tools_section(res: Result) -> str:
    d = res.data
    if res.status != "ok" or not d:
        return not_run(res)
    rows = [[f"`{r['workload']}`", fmt_ms(r["tool_ms"]), fmt_ms(r["direct_ms"]),
             ratio(r["tool_ms"], r["direct_ms"])] for r in d["rows"]]
    return (f"The agent tools (in process, as the MCP server calls them) over a session mount "
            f"of a 20,000-file tree, against `rg` and `find` run directly on the native tree; "
            f"median of {d['runs']} runs. The Bash row is `true` through a real MCP client "
            f"and `rewindfs mcp` over stdio (sandboxed), against `bash -c true`, median of "
            f"at least 20 calls; the row after it is the same call with a path policy "
            f"covering 100 hidden and 100 protected files of the tree, against the Bash row "
            f"(goal: at most 2x; their servers run at once, called in turn), and the last "
            f"row makes those covers with bubblewrap's binds instead:\n\n" +
            table(["workload", "tool", "direct", "tool / direct"], rows))


def option(cmd: list[str], name: str) -> str:
    """The value given to option ``name`` in ``cmd`` ("?" when absent)."""
    return cmd[cmd.index(name) + 1] if name in cmd[:-1] else "?"


def steps_section(res: Result) -> str:
    d = res.data
    if res.status != "ok" or not d:
        return not_run(res)
    diff = "`rewindfs diff MNT` request, round trip"
    rows = [
        ["a step, round trip", fmt_ms(d["step_ms"]), diff, fmt_ms(d["diff_ms"]),
         ratio(d["step_ms"], d["diff_ms"])],
        ["a step, in the daemon", fmt_ms(d["step_daemon_ms"]), diff, fmt_ms(d["diff_ms"]),
         ratio(d["step_daemon_ms"], d["diff_ms"])],
        ["a step, in the daemon with its journal append", fmt_ms(d["step_session_ms"]), diff,
         fmt_ms(d["diff_ms"]), ratio(d["step_session_ms"], d["diff_ms"])],
        *([["a request without work, round trip", fmt_ms(d["noop_ms"]),
             "a step, round trip", fmt_ms(d["step_ms"]), ratio(d["noop_ms"], d["step_ms"])]]
          if "noop_ms" in d else []),
        [f"the first step ({d['first_step_paths']:,} paths)", fmt_ms(d["first_step_ms"]),
         diff, fmt_ms(d["diff_ms"]), ratio(d["first_step_ms"], d["diff_ms"])],
        ["FUSE write with a step every 50 ms", f"{d['write_mib_s_stepping']:.0f} MiB/s",
         "FUSE write, nothing else running", f"{d['write_mib_s']:.0f} MiB/s",
         ratio(d["write_mib_s"], d["write_mib_s_stepping"])],
    ]
    met = "met" if d["step_ms"] < 5 else "missed"
    return (f"Recording a step (`step_done`, a request to the session process) on a FUSE "
            f"session of {d['files']:,} files with {d['dirty']:,} dirty paths, 10 of them "
            f"changed before each step, medians of {option(res.cmd, '--steps')} steps; "
            f"against `rewindfs diff MNT` of the same dirty set; a request the session "
            f"answers without work (the transport alone: connect, the server's thread, "
            f"JSON), against a step; and 64 MiB written through "
            f"the mount, medians of {option(res.cmd, '--runs')} runs (its ratio is of the "
            f"times: above 1 the writes are slower while steps are recorded):\n\n"
            + table(["", "figure", "baseline", "baseline's figure", "figure / baseline"],
                    rows)
            + f"\n\nGoal: a step under 5 ms, round trip: {fmt_ms(d['step_ms'])} ({met}).")


def exclude_section(res: Result) -> str:
    d = res.data
    if res.status != "ok" or not d:
        return not_run(res)
    rows = [[f"{r['kept']:,} files kept", fmt_ms(r["excluded_ms"]), fmt_ms(r["baseline_ms"]),
             ratio(r["excluded_ms"], r["baseline_ms"]),
             f"{(r['excluded_ms'] - r['baseline_ms']) / r['kept'] * 1000:.1f} µs"
             if r["kept"] else "-"] for r in d]
    return ("Checkpoint of a one-file change (through the overlay API, no FUSE) with files "
            "kept under an excluded `node_modules/` (they stay in the upper), against the "
            "same change without a policy (the files frozen by a first checkpoint, the "
            f"upper then empty); medians of {option(res.cmd, '--runs')} checkpoints:\n\n"
            + table(["files under node_modules/", "checkpoint, excluded",
                     "checkpoint, no policy", "excluded / no policy",
                     "extra per kept file"], rows))


def machine() -> str:
    mem = ""
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=REPO, capture_output=True, text=True).stdout.strip()
    if dirty:  # the figures are not of that commit alone
        commit += " with uncommitted changes"
    return (f"{os.cpu_count()} CPUs{mem}, Linux {platform.release()}, Python "
            f"{platform.python_version()}; commit {commit}")


def section(title: str, render: Callable[..., str], *res: Result,
            broken: list[str] | None = None) -> str:
    """``#### title`` and ``render(*res)``; when the figures a benchmark saved lack what the
    table reads (a renamed key), a line saying so instead, and its name in ``broken``."""
    try:
        body = render(*res)
    except (KeyError, IndexError, TypeError, ValueError) as e:
        body = (f"_Not available: the {res[0].name} benchmark's figures do not fit this "
                f"table ({type(e).__name__}: {e})._")
        if broken is not None:
            broken.append(res[0].name)
    return f"#### {title}\n\n{body}"


def summary(results: dict[str, Result], cmdline: str, total_s: float, day: str,
            where: str, broken: list[str] | None = None) -> str:
    """The tables of ratios of one run (Markdown); the benchmarks whose figures could not be
    rendered are appended to ``broken``."""
    loads = ", ".join(f"{r.name} {r.load_before:.1f}->{r.load_after:.1f}"
                      for r in results.values() if r.status != "not run")
    parts = [
        f"Measured by `{cmdline}` on {day} ({where}), "
        f"in {total_s / 60:.1f} minutes. Times are wall clock; a ratio is rewindfs's time "
        "(or size) divided by the peer's: below 1 rewindfs is faster (smaller). 1-minute "
        f"load average before->after each benchmark: {loads} (other work on the machine "
        "inflates the figures; compare ratios from one run).",
        section("Store", store_section, results["store"], broken=broken),
        section("Session mount", fuse_section, results["fuse"], broken=broken),
        section("Checkpoint and restore", checkpoint_section, results["checkpoint"],
                broken=broken),
        section("Sessions", sessions_section, results["sessions"],
                results["sessions-fallback"], broken=broken),
        section("Agent tools", tools_section, results["tools"], broken=broken),
        section("Shared store", remote_section, results["remote"], broken=broken)
        if "remote" in results else "#### Shared store\n\n(not in this run)",
    ]
    for name, title, render in (
            ("steps", "Step change log", steps_section),
            ("sparse", "Sparse files", own_table_section),
            ("write", "FUSE writes against a baseline revision", own_table_section),
            ("exclude", "Excluded paths", exclude_section),
            ("scan", "Writer scan of no-open mode against a baseline revision",
             own_table_section)):
        if name in results:
            parts.append(section(title, render, results[name], broken=broken))
    fewer = [f"{r.name} {n.removeprefix(FEWER)}" for r in results.values() for n in r.notes
             if n.startswith(FEWER)]
    if fewer:
        parts.insert(1, "Fewer runs than each benchmark takes alone, to fit the run in "
                        f"{BUDGET_S // 60} minutes: " + "; ".join(fewer) + ".")
    return "\n\n".join(parts) + "\n"


def table_rows(summ: str) -> dict[str, set[str]]:
    """The first cells (backticks left out) of every table row of the report ``summ``, by
    the ``####`` heading the table is under."""
    out: dict[str, set[str]] = {}
    heading = ""
    for ln in summ.splitlines():
        if ln.startswith("#### "):
            heading = ln[5:].strip()
            out[heading] = set()
        elif ln.startswith("| ") and heading:
            out[heading].add(ln[2:].split(" | ")[0].strip().replace("`", ""))
    return out


def missing_cited(summ: str, results: dict[str, Result]) -> list[str]:
    """The rows of ``CITED`` that ``summ`` lacks although their benchmark ran ok (one that
    did not run, or failed, is reported as such elsewhere)."""
    rows = table_rows(summ)
    return [f'"{label}" ({heading})' for heading, (bench, labels) in CITED.items()
            if bench in results and results[bench].status == "ok"
            for label in labels if label not in rows.get(heading, set())]


def full_report(results: dict[str, Result], summ: str) -> str:
    out = ["# rewindfs performance", "",
           "Written by `scripts/bench/run_all.py`; do not edit by hand. The README shows the "
           "tables of ratios below; each benchmark's own report follows them.", "",
           "## Ratios", "", summ, "## Each benchmark's report", ""]
    for r in results.values():
        out += [f"### {r.name}", "", f"`{shlex.join(r.cmd)}`: {r.status} in "
                f"{r.seconds:.0f} s.", ""]
        out += [f"Note: {n}." for n in r.notes]
        if r.stdout.strip() and r.name != "tools":
            out += ["", "```", r.stdout.strip(), "```", ""]
        elif r.data is not None:
            out += ["", "```", json.dumps(r.data, indent=1), "```", ""]
    return "\n".join(out) + "\n"


def splice_readme(readme: Path, summ: str) -> bool:
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"run_all: {readme} has no {BEGIN} ... {END} section; not changed",
              file=sys.stderr)
        return False
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{summ}{END}{tail}")
    return True


# -- main ---------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: one run of each benchmark (exclude 5, scan 3, "
                         "Bash calls at least 20), fewer sessions and steps, smaller writes")
    ap.add_argument("--wait-load", type=float, metavar="L",
                    help="wait (at most 10 minutes) for a 1-minute load average below L")
    ap.add_argument("--big", action="store_true",
                    help="include the 200,000-file checkpoint tree even when it is not built "
                    "yet (building it takes about 5 minutes more, once)")
    ap.add_argument("--no-readme", action="store_true", help="do not touch README.md")
    ap.add_argument("--readme", type=Path, default=README, metavar="FILE",
                    help="the README whose tables to replace (default: this repository's)")
    ap.add_argument("--doc", type=Path, default=DOC, metavar="FILE",
                    help="where the full report goes (default: docs/performance.md)")
    ap.add_argument("--only", help="comma-separated benchmarks to run (store, fuse, "
                    "checkpoint, remote, sessions, steps, sparse, write, exclude, scan, tools); "
                    "the others are reported as not run")
    ap.add_argument("--from-results", metavar="FILE", type=Path,
                    help="measure nothing: write the reports again from a run's saved "
                    "results (agent-data/bench/run_all/results.json)")
    args = ap.parse_args(argv)
    readme = None if args.no_readme else args.readme
    if args.from_results:
        return write_reports(json.loads(args.from_results.read_text()), args.doc, readme)
    if args.wait_load:
        wait_for_load(args.wait_load)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    q = args.quick
    j = {n: OUT_DIR / f"{n}.json"
         for n in ("store", "fuse", "checkpoint", "remote", "steps", "sparse")}
    for p in j.values():
        p.unlink(missing_ok=True)
    bench = [PY]
    big_built = (REPO / "agent-data" / "bench" / "ckpt" / ".src-200000.done").exists()
    sizes = "2000,20000" + (",200000" if (big_built or args.big) and not q else "")
    # (name, command, time limit in seconds, how to read its figures)
    plan: list[tuple[str, list[str], float, Callable[[Result], Any]]] = [
        ("store", [*bench, str(HERE / "bench_store.py"), "--runs", "1" if q else "3",
                   *(["--baseline", ROUND_BASELINE] if has_commit(ROUND_BASELINE) else []),
                   "--json", str(j["store"])], 300, lambda r: load_json(j["store"])),
        ("fuse", [*bench, str(HERE / "bench_fuse.py"), "--runs", "1" if q else "3",
                  "--heavy-runs", "1", "--json", str(j["fuse"])], 600,
         lambda r: load_json(j["fuse"])),
        ("checkpoint", [*bench, str(HERE / "bench_checkpoint.py"), "--sizes", sizes,
                        "--runs", "1" if q else "3",
                        "--no-peers-above", "20000", "--json", str(j["checkpoint"])],
         480 if big_built else 900 if args.big else 300,
         lambda r: load_json(j["checkpoint"])),
        ("remote", [*bench, str(HERE / "bench_remote.py"), "--runs",
                    "1" if q else str(REMOTE_RUNS), "--json", str(j["remote"])], 900,
         lambda r: load_json(j["remote"])),
        ("sessions", [*bench, str(HERE / "bench_sessions.py"), "--files", "20000",
                      "--sessions", "20" if q else "100", "--backend", "fuse"], 180,
         lambda r: parse_sessions(r.stdout)),
        ("sessions-fallback", [*bench, str(HERE / "bench_sessions.py"), "--files", "20000",
                               "--sessions", "2" if q else "3", "--backend", "fallback"], 180,
         lambda r: parse_sessions(r.stdout)),
        ("steps", [*bench, str(HERE / "bench_steps.py"), "--files", "20000", "--dirty", "1000",
                   "--steps", "10" if q else "30", "--runs", "1" if q else "5",
                   "--json", str(j["steps"])], 300, lambda r: load_json(j["steps"])),
        ("sparse", [*bench, str(HERE / "bench_sparse.py"), "--runs", "1" if q else "3",
                    "--json", str(j["sparse"])], 300, lambda r: load_json(j["sparse"])),
        ("write", [*bench, str(HERE / "bench_write.py"), "--runs", "1" if q else "11",
                   *(["--baseline", ROUND_BASELINE] if has_commit(ROUND_BASELINE) else []),
                   "--mib", "64" if q else "256"], 300, lambda r: None),
        ("exclude", [*bench, str(HERE / "bench_exclude.py"), "--kept",
                     ",".join(str(n) for n in EXCLUDE_KEPT), "--runs", "5"],
         240, lambda r: parse_exclude(r.stdout)),
        ("scan", [*bench, str(HERE / "bench_scan.py"), "--runs", "3" if q else "20",
                  *(["--baseline", SCAN_BASELINE] if has_commit(SCAN_BASELINE) else [])],
         240, lambda r: None),
    ]
    # (name, option, its value here, its default alone) for the report's note
    fewer = {"remote": ("--runs", 1 if q else REMOTE_RUNS, 5),
             "steps": ("--runs", 1 if q else 5, 5),
             "write": ("--runs", 1 if q else 11, 11)}
    only = set(args.only.split(",")) if args.only else None
    results: dict[str, Result] = {}
    t0 = time.perf_counter()
    for name, cmd, limit, read in plan:
        res = results[name] = Result(name, cmd)
        if only is not None and name.split("-")[0] not in only:
            continue
        if name in fewer:
            opt, here, alone = fewer[name]
            if here < alone:
                res.notes.append(f"{FEWER}{opt} {here} (alone: {alone})")
        run_bench(res, limit)
        if res.status == "ok":
            res.data = read(res)
    tools = results["tools"] = Result("tools", [])
    if only is None or "tools" in only:
        run_tools(tools, 1 if q else 3, 240)
    total = time.perf_counter() - t0
    for r in results.values():
        (OUT_DIR / f"{r.name}.out").write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    run = {"cmdline": "scripts/bench/run_all.py" + "".join(f" {a}" for a in argv),
           "total_s": total, "day": datetime.date.today().isoformat(), "machine": machine(),
           "results": [dataclasses.asdict(r) for r in results.values()]}
    (OUT_DIR / "results.json").write_text(json.dumps(run, indent=1))
    return write_reports(run, args.doc, readme)


def write_reports(run: dict[str, Any], doc: Path, readme: Path | None) -> int:
    """Render the tables of one run (as saved in ``results.json``) into ``doc`` (the full
    report) and, unless ``readme`` is None, between its markers; 1 when a benchmark was not
    ok, its figures did not fit its table or a row of ``CITED`` is missing, else 0."""
    results = {d["name"]: Result(**d) for d in run["results"]}
    total = run["total_s"]
    broken: list[str] = []
    summ = summary(results, run["cmdline"], total, run["day"], run["machine"], broken)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(full_report(results, summ))
    print(summ)
    print(f"run_all: wrote {doc}", end="")
    if readme is not None and splice_readme(readme, summ):
        print(f" and the tables in {readme}", end="")
    print(f"; total {total / 60:.1f} minutes (budget {BUDGET_S // 60})")
    if total > BUDGET_S:
        print(f"run_all: the run took longer than its {BUDGET_S // 60}-minute budget",
              file=sys.stderr)
    bad = [r.name for r in results.values() if r.status not in ("ok", "not run")]
    if bad:
        print(f"run_all: not ok: {', '.join(bad)}", file=sys.stderr)
    if broken:
        print(f"run_all: figures that do not fit their table: {', '.join(broken)}",
              file=sys.stderr)
    missing = missing_cited(summ, results)
    if missing:
        print("run_all: the README cites rows this report lacks: " + "; ".join(missing),
              file=sys.stderr)
    return 1 if bad or broken or missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
