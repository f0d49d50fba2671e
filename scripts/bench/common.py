"""Shared helpers of the benchmarks: the test trees, timing, peers' commands, tables.

Everything a benchmark downloads or writes lives under ``agent-data/bench/`` (gitignored):

    agent-data/bench/sdist/<Name>-<version>.tar.gz   sdists fetched with pip, kept
    agent-data/bench/src/<Name>-<version>/           each unpacked once, then only read
    agent-data/bench/tmp/<run>/                      one run's scratch, removed afterwards

Timings are wall-clock seconds of warm-cache runs (a benchmark reads its tree once before
timing anything, so no contender pays for the first read from disk); each figure is the
median of ``runs`` runs.
"""

from __future__ import annotations

import os
import shutil
import stat
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO / "agent-data" / "bench"

DJANGO = ("django", "5.1.4")
"""The pinned sdist the benchmarks run on: 6,809 files, 55 MB unpacked."""

T = TypeVar("T")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def fetch_sdist(name: str, version: str) -> Path:
    """Return the path of the ``name==version`` sdist, downloading it with pip once."""
    dest = BENCH_DIR / "sdist"
    dest.mkdir(parents=True, exist_ok=True)
    found = _find_sdist(dest, name, version)
    if found is None:
        log(f"bench: downloading the {name} {version} sdist with pip")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", ":all:", f"{name}=={version}", "-d", str(dest)],
                       check=True)
        found = _find_sdist(dest, name, version)
        if found is None:
            raise RuntimeError(f"pip did not bring an sdist of {name}=={version} into {dest}")
    return found


def _find_sdist(folder: Path, name: str, version: str) -> Path | None:
    want = f"{name}-{version}".lower().replace("_", "-")
    for p in sorted(folder.iterdir()):
        stem = p.name.lower().replace("_", "-")
        if stem in (f"{want}.tar.gz", f"{want}.tar.bz2", f"{want}.tgz"):
            return p
    return None


def unpacked_tree(name: str = DJANGO[0], version: str = DJANGO[1]) -> Path:
    """Return the sdist unpacked under ``agent-data/bench/src/`` (done once, then reused).

    The tree is never modified afterwards, so its mtimes and ctimes stay old: a files cache
    may trust it on a second snapshot.
    """
    sdist = fetch_sdist(name, version)
    src = BENCH_DIR / "src"
    src.mkdir(parents=True, exist_ok=True)
    done = src / f".{sdist.name}.unpacked"
    with tarfile.open(sdist) as tf:
        top = tf.getmembers()[0].name.split("/")[0]
        if not done.exists():
            shutil.rmtree(src / top, ignore_errors=True)
            log(f"bench: unpacking {sdist.name}")
            tf.extractall(src, filter="tar")
            done.touch()
    return src / top


def tree_size(root: Path) -> tuple[int, int]:
    """(regular files, their bytes) under ``root``, symlinks not followed."""
    files = size = 0
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            st = os.lstat(os.path.join(dirpath, n))
            if stat.S_ISREG(st.st_mode):
                files += 1
                size += st.st_size
    return files, size


def warm(root: Path) -> None:
    """Read every file under ``root`` once, so later timings see a warm page cache."""
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    while f.read(1 << 20):
                        pass


def dir_bytes(root: Path) -> int:
    """Apparent size in bytes of every regular file under ``root``."""
    return tree_size(root)[1]


@contextmanager
def scratch(prefix: str) -> Iterator[Path]:
    """A fresh directory under ``agent-data/bench/tmp/``, removed (even read-only parts)
    afterwards."""
    base = BENCH_DIR / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield d
    finally:
        rmtree(d)


def unpack(rev: str, dest: Path) -> str:
    """The tree of git revision ``rev`` of this repository written to the new directory
    ``dest`` (``git archive | tar -x``), so that a benchmark can run that revision's code
    beside this working tree's; returns the commit id. Raises CalledProcessError for an
    unknown revision."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.Popen(["git", "archive", commit], cwd=REPO, stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        raise subprocess.CalledProcessError(archive.returncode, ["git", "archive", commit])
    return commit


def rmtree(path: Path) -> None:
    """Remove ``path`` entirely, read-only directories included (the product's own helper)."""
    from fusefs.session.fallback import force_rmtree

    force_rmtree(str(path))


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(seconds, result) of one call of ``fn``."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median_time(runs: int, fn: Callable[[int], Any],
                setup: Callable[[int], Any] | None = None) -> tuple[float, list[Any]]:
    """Median seconds of ``runs`` calls ``fn(i)``; ``setup(i)`` runs untimed before each.

    Returns (median seconds, results of every call)."""
    times, results = timed_runs(runs, fn, setup)
    return statistics.median(times), results


def timed_runs(runs: int, fn: Callable[[int], Any], setup: Callable[[int], Any] | None = None
               ) -> tuple[list[float], list[Any]]:
    """Seconds of each of ``runs`` calls ``fn(i)`` (``setup(i)`` untimed before each), and
    the results of every call."""
    times: list[float] = []
    results: list[Any] = []
    for i in range(runs):
        if setup is not None:
            setup(i)
        t0 = time.perf_counter()
        results.append(fn(i))
        times.append(time.perf_counter() - t0)
    return times, results


def sh(cmd: str | Sequence[str], cwd: Path | None = None, env: dict[str, str] | None = None,
       ) -> subprocess.CompletedProcess[bytes]:
    """Run a command (a shell line if ``cmd`` is a str); output kept; RuntimeError with its
    stderr when it fails."""
    full_env = None if env is None else {**os.environ, **env}
    p = subprocess.run(cmd, shell=isinstance(cmd, str), cwd=cwd, env=full_env,
                       capture_output=True)
    if p.returncode != 0:
        raise RuntimeError(f"{cmd!r} exited {p.returncode}: "
                           f"{p.stderr.decode(errors='replace').strip()}")
    return p


def git_env(git_dir: Path, work_tree: Path) -> dict[str, str]:
    """Environment for git on ``work_tree`` with its repository kept elsewhere, so the tree
    being measured is never changed by git."""
    return {"GIT_DIR": str(git_dir), "GIT_WORK_TREE": str(work_tree),
            "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@localhost",
            "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@localhost",
            "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(git_dir.parent)}


def mb_s(nbytes: int, seconds: float) -> float:
    return nbytes / 1e6 / seconds if seconds > 0 else float("inf")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; floats shown with 3 significant digits."""
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def rewindfs_json(store: Path, *args: str) -> dict[str, Any]:
    """``rewindfs --store STORE ARGS --json`` with this interpreter, from the repository
    root: the last JSON line it printed ({} for none). Raises RuntimeError with its stderr
    when it fails."""
    import json

    r = subprocess.run([sys.executable, "-m", "rewindfs", "--store", str(store), *args,
                        "--json"], capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"rewindfs {' '.join(args)}: {r.stderr.strip()}")
    out = r.stdout.strip().splitlines()
    return dict(json.loads(out[-1])) if out else {}
