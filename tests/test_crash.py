"""Crash: kill -9 a snapshot in a subprocess at random points. Afterwards verify is clean,
every earlier snapshot materializes exactly, and GC removes what the crash left (no pack
without index rows remains). The seed is printed; set REWINDFS_CRASH_SEED to replay it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from store.gc import gc
from store.materialize import materialize
from store.objects import Store
from store.snapshot import compute_ref, snapshot
from store.verify import verify

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ITERATIONS = 5

_CHILD = r"""
import os, random, sys
from store.objects import Store
from store.snapshot import snapshot

root, tree, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
rnd = random.Random(seed)
store = Store(root, chunk_size=64 << 10)
print("ready", flush=True)
i = 0
while True:
    for _ in range(40):  # new content every round, so every snapshot writes packs
        with open(os.path.join(tree, f"f{rnd.randrange(150)}"), "wb") as f:
            f.write(rnd.randbytes(rnd.randrange(0, 150_000)))
    snapshot(store, tree, label=f"child {i}")
    i += 1
"""


def _fill(tree: str, rnd: random.Random, n: int) -> None:
    os.makedirs(tree, exist_ok=True)
    for i in range(n):
        with open(os.path.join(tree, f"f{i}"), "wb") as f:
            f.write(rnd.randbytes(rnd.randrange(0, 100_000)))


def test_kill_snapshot_at_random_points(tmp_path: object) -> None:
    seed = int(os.environ.get("REWINDFS_CRASH_SEED") or random.randrange(1 << 32))
    print(f"crash test seed: {seed} (REWINDFS_CRASH_SEED={seed} replays it)")
    rnd = random.Random(seed)
    base = str(tmp_path)
    root = os.path.join(base, "store")
    s = Store(root, chunk_size=64 << 10)
    kept = os.path.join(base, "kept")
    busy = os.path.join(base, "busy")
    _fill(busy, rnd, 150)
    earlier = []
    for it in range(ITERATIONS):
        _fill(kept, rnd, 5 + it)  # an earlier snapshot that must survive every crash
        earlier.append(snapshot(s, kept, label=f"earlier {it}"))
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, root, busy, str(rnd.randrange(1 << 32))],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline() == "ready\n"
            time.sleep(rnd.uniform(0.0, 0.6))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            _, err = child.communicate(timeout=60)
        assert child.returncode == -signal.SIGKILL, err

        s = Store(root)  # as a process starting after the crash would
        assert verify(s) == [], f"seed {seed}, iteration {it}"
        for n, ref in enumerate(earlier):
            dest = os.path.join(base, f"out-{it}-{n}")
            materialize(s, ref, dest)
            assert compute_ref(dest, chunk_size=s.chunk_size) == ref
        rep = gc(s)
        print(f"iteration {it}: {len(s.list_snapshots())} listed, gc removed "
              f"{rep.leftover_packs} leftover packs, {rep.objects_deleted} unlisted objects")
        indexed = {r[0] for r in s.conn.execute("SELECT key FROM packs")}
        assert set(s.backend.list("packs/")) == indexed, f"seed {seed}, iteration {it}"
        assert verify(s) == [], f"seed {seed}, iteration {it}"
        assert set(earlier) <= {i.ref for i in s.list_snapshots()}


_AT_POINT = r"""
import os, signal, sys
from store.objects import Store
from store.snapshot import snapshot

root, tree, point = sys.argv[1], sys.argv[2], sys.argv[3]
store = Store(root)


def die(*_args, **_kw):
    os.kill(os.getpid(), signal.SIGKILL)


if point == "packs-put":  # the commit's barrier: packs are in the backend, not indexed
    store.backend.sync = die
elif point == "indexed":  # objects indexed, the snapshot-list record not yet written
    Store._history_put = die
elif point == "record-durable":  # the record is durable, its index row not yet written
    put = Store._history_put

    def put_then_die(self, key, record):
        put(self, key, record)
        die()

    Store._history_put = put_then_die
snapshot(store, tree)
print("not killed", flush=True)
"""


def test_kill_at_each_commit_step(tmp_path: object) -> None:
    """The three windows of the write order, each hit exactly once."""
    base = str(tmp_path)
    root = os.path.join(base, "store")
    s = Store(root, chunk_size=64 << 10)
    rnd = random.Random(5)
    kept = os.path.join(base, "kept")
    _fill(kept, rnd, 8)
    earlier = snapshot(s, kept)
    busy = os.path.join(base, "busy")
    for n, point in enumerate(["packs-put", "indexed", "record-durable"]):
        _fill(busy, rnd, 20)
        child = subprocess.run([sys.executable, "-c", _AT_POINT, root, busy, point], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
        s = Store(root)
        packs = set(s.backend.list("packs/"))
        indexed = {r[0] for r in s.conn.execute("SELECT key FROM packs")}
        assert verify(s) == [], point
        materialize(s, earlier, os.path.join(base, f"out-{n}"))
        listed = {i.ref for i in s.list_snapshots()}
        rep = gc(s)
        if point == "packs-put":
            assert len(packs - indexed) == rep.leftover_packs == 1
        elif point == "indexed":
            assert listed == {earlier} and rep.objects_deleted > 0
        else:  # the durable record lists the snapshot: verify caught the index up
            busy_ref = compute_ref(busy, chunk_size=s.chunk_size)
            assert listed == {earlier, busy_ref}
            materialize(s, busy_ref, os.path.join(base, "busy-out"))
            assert compute_ref(os.path.join(base, "busy-out"), chunk_size=s.chunk_size) \
                == busy_ref
        assert set(s.backend.list("packs/")) == {r[0] for r in
                                                 s.conn.execute("SELECT key FROM packs")}
        assert verify(s) == [], point
