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
without asking S3 again. Measures; judges nothing (exit status 0).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    args = ap.parse_args()
    from store.config import SharedConfig, configure

    weed = servers.SeaweedS3()
    pg = servers.PostgresCluster()
    os.environ.update(weed.env())
    try:
        with tempfile.TemporaryDirectory(prefix="bench-s3-hang-") as tmp:
            t = Path(tmp)
            bucket, dsn = weed.new_bucket(), pg.new_database()
            cfg = SharedConfig(f"s3://{bucket}/s", dsn, weed.endpoint, str(t / "cache-a"))
            configure(str(t / "a"), cfg)
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
    finally:
        weed.stop()
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
