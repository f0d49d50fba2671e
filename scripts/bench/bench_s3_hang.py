"""How long a read through a mount takes to fail when the S3 server hangs.

Usage (from the repository root)::

    .venv/bin/python scripts/bench/bench_s3_hang.py [--size-mib 4] [--runs 1]

Starts a SeaweedFS and a throwaway PostgreSQL cluster on loopback (tests/servers.py, stopped
at the end), snapshots one file of random bytes on host A, mounts its Ref read-only on host
B (its own local directory and an empty range cache, so every range comes from S3), stops
SeaweedFS with SIGSTOP (it keeps accepting connections and never answers) and times one
``read`` of the file's first 128 KiB through the mount until it fails (EIO). The S3 bounds
are the environment's (defaults: 3 attempts, 3 s to connect, 10 s of silence while
reading). Prints, per run, the seconds to EIO, the errno and the daemon log's ``read
failed`` lines: how many requests the daemon answered EIO, and how many of them failed
without asking S3 again.

With ``--checkpoint``: a read-write mount on host A instead, a file written, SeaweedFS
stopped, ``rewindfs checkpoint`` started in the background and, one second later, timed
one after the other: ``ls`` of the mount's root, a read of the file, the create of a new
file, a write into the first one; then the checkpoint's seconds and exit status, and, after
SIGCONT, a second checkpoint's. Measures; judges nothing (exit status 0).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from store.config import SharedConfig

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

import servers  # noqa: E402

PY = sys.executable


def rewindfs(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([PY, "-m", "rewindfs", "--store", str(store), *args], cwd=REPO,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"rewindfs {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=4)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--checkpoint", action="store_true",
                    help="time requests into a read-write mount during a checkpoint")
    args = ap.parse_args()
    if args.checkpoint:
        return checkpoint_runs(args.runs)
    from store.config import SharedConfig, configure

    with shared_store() as (weed, t, cfg):
        dsn = cfg.catalog
        src = t / "src"
        src.mkdir()
        (src / "data.bin").write_bytes(os.urandom(args.size_mib << 20))
        ref = json.loads(rewindfs(t / "a", "snapshot", str(src), "--json").stdout)["ref"]
        print("run  seconds_to_error  errno  read_failed_lines  without_a_request")
        for run in range(args.runs):
            host = t / f"b{run}"
            configure(str(host), SharedConfig(cfg.blobs, dsn, weed.endpoint,
                                              str(t / f"cache-b{run}")))
            mnt = t / f"mnt{run}"
            mnt.mkdir()
            log = t / f"daemon{run}.log"
            rewindfs(host, "mount", "--ro", ref, str(mnt), "--log", str(log))
            assert weed.proc is not None
            os.killpg(weed.proc.pid, signal.SIGSTOP)
            err = 0
            t0 = time.monotonic()
            try:
                fd = os.open(mnt / "data.bin", os.O_RDONLY)
                try:
                    os.read(fd, 128 << 10)
                finally:
                    os.close(fd)
            except OSError as e:
                err = e.errno or 0
            elapsed = time.monotonic() - t0
            os.killpg(weed.proc.pid, signal.SIGCONT)
            rewindfs(host, "umount", str(mnt))
            lines = [x for x in log.read_text().splitlines() if "read failed" in x]
            held = [x for x in lines if "not asked again" in x]
            print(f"{run:>3}  {elapsed:16.1f}  {errno.errorcode.get(err, err):>5}  "
                  f"{len(lines):>17}  {len(held):>17}")
            for x in lines:
                print("     ", x[:300])
    return 0


@contextlib.contextmanager
def shared_store() -> Iterator[tuple[servers.SeaweedS3, Path, SharedConfig]]:
    """Real SeaweedFS and PostgreSQL on loopback and, in a temporary directory ``t``, a
    host ``t/a`` configured on a new bucket and database of theirs: (the S3 server, ``t``,
    that host's configuration). Both servers are stopped on the way out."""
    from store.config import SharedConfig, configure

    weed = servers.SeaweedS3()
    pg = servers.PostgresCluster()
    os.environ.update(weed.env())
    try:
        with tempfile.TemporaryDirectory(prefix="bench-s3-hang-") as tmp:
            t = Path(tmp)
            cfg = SharedConfig(f"s3://{weed.new_bucket()}/s", pg.new_database(),
                               weed.endpoint, str(t / "cache-a"))
            configure(str(t / "a"), cfg)
            yield weed, t, cfg
    finally:
        weed.stop()
        pg.stop()


def timed(what: str, fn: object) -> str:
    t0 = time.monotonic()
    try:
        fn()  # type: ignore[operator]
        out = "ok"
    except OSError as e:
        out = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"{what} {time.monotonic() - t0:.3f} s {out}"


def checkpoint_runs(runs: int) -> int:
    """``--checkpoint`` (see the module docstring)."""
    with shared_store() as (weed, t, _cfg):
        src = t / "src"
        src.mkdir()
        (src / "seed.txt").write_text("seed\n")
        ref = json.loads(rewindfs(t / "a", "snapshot", str(src), "--json").stdout)["ref"]
        for run in range(runs):
            mnt, state = t / f"mnt{run}", t / f"state{run}"
            mnt.mkdir()
            rewindfs(t / "a", "mount", ref, str(mnt), "--state", str(state))
            try:
                (mnt / "before.txt").write_text("before\n")
                assert weed.proc is not None
                os.killpg(weed.proc.pid, signal.SIGSTOP)
                try:
                    t0 = time.monotonic()
                    ck = subprocess.Popen([PY, "-m", "rewindfs", "--store", str(t / "a"),
                                           "checkpoint", str(mnt)], cwd=REPO, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    time.sleep(1.0)
                    lines = [
                        timed("ls", lambda m=mnt: os.listdir(m)),
                        timed("cat", lambda m=mnt: (m / "before.txt").read_bytes()),
                        timed("create", lambda m=mnt: (m / "new.txt").write_text("new\n")),
                        timed("write", lambda m=mnt: (m / "before.txt").write_text("w\n")),
                    ]
                    pending = ck.poll() is None
                    _out, err = ck.communicate()
                    ck_s = time.monotonic() - t0
                finally:
                    os.killpg(weed.proc.pid, signal.SIGCONT)
                t1 = time.monotonic()
                again = subprocess.run([PY, "-m", "rewindfs", "--store", str(t / "a"),
                                        "checkpoint", str(mnt)], cwd=REPO, text=True,
                                       capture_output=True)
                print(f"run {run}: " + "; ".join(lines)
                      + f"; checkpoint still running after them: {pending}")
                print(f"  checkpoint on the hung S3: {ck_s:.1f} s, exit {ck.returncode}"
                      f" ({err.strip()[:120]})")
                print(f"  checkpoint after SIGCONT: {time.monotonic() - t1:.1f} s, exit "
                      f"{again.returncode}")
            finally:
                rewindfs(t / "a", "umount", str(mnt))
    return 0


if __name__ == "__main__":
    sys.exit(main())
