"""Sparse files of a session overlay cost their data, not their size (issue 10 point 5):
checkpoint, lower reads, copy-up, diff, materialize, verify, gc, cat and ``st_blocks`` of a
1 TiB file with a few KiB of data walk its chunk runs, never its 16 million chunk slots
(the store here has 64 KiB chunks). An upper of format 1 (every chunk id) is migrated.
"""

from __future__ import annotations

import os
import sqlite3
from itertools import islice
from pathlib import Path

from test_overlay import CS, Env, env, ino, ov  # noqa: F401

from fusefs.checkpoint import checkpoint_overlay
from fusefs.overlay import MAX_FILE_SIZE, Overlay
from fusefs.restore import restore_overlay
from fusefs.upper import check
from store import chunker
from store.browse import cat
from store.diff import diff
from store.gc import gc
from store.materialize import materialize
from store.ref import DIGEST_SIZE
from store.snapshot import compute_ref
from store.tree import ChunkList, decode_runs
from store.verify import verify

TIB = MAX_FILE_SIZE
A = b"A" * 4096
B = b"B" * 4096


def _pwrite(ov: Overlay, path: str, off: int, data: bytes,  # noqa: F811
            size: int | None = None) -> None:
    i = ino(ov, path)
    if size is not None:
        ov.setattr(i, size=size)
    fh = ov.open(i, os.O_WRONLY)
    try:
        assert ov.write(fh, off, data) == len(data)
    finally:
        ov.release(fh)


def _pread(ov: Overlay, path: str, off: int, size: int) -> bytes:  # noqa: F811
    fh = ov.open(ino(ov, path), os.O_RDONLY)
    try:
        return ov.read(fh, off, size)
    finally:
        ov.release(fh)


def test_a_1_tib_sparse_file_round_trips_by_its_runs(env: Env, ov: Overlay,  # noqa: F811
                                                     tmp_path: Path) -> None:
    fh, _ = ov.create(1, b"disk.img", 0o644, os.O_WRONLY, 0, 0)
    ov.release(fh)
    mid = TIB // 2
    _pwrite(ov, "disk.img", mid, A, size=TIB)
    r1 = checkpoint_overlay(ov)
    e = env.store.root_tree(r1.ref).get(b"disk.img")
    assert e is not None and e.size == TIB and len(e.chunks) == TIB // CS
    zero = chunker.zero_chunk_id(CS)
    assert [k for _, k in e.chunks.runs()] == [mid // CS, 1, TIB // CS - mid // CS - 1]
    assert e.chunks[0] == zero and e.chunks[mid // CS] != zero
    assert env.store.root_tree(r1.ref).version == 2

    # Lower reads and st_blocks, then a copy-up of one chunk beside the lower runs.
    assert _pread(ov, "disk.img", mid - 10, 4106) == bytes(10) + A
    assert _pread(ov, "disk.img", TIB - 5, 100) == bytes(5)
    assert ov.blocks(ov.getattr(ino(ov, "disk.img"))) == len(A) // 512  # its data page
    _pwrite(ov, "disk.img", mid + 4096, B)  # same chunk: copied up, merged
    _pwrite(ov, "disk.img", 3 * CS, B)  # a hole chunk
    r2 = checkpoint_overlay(ov)
    e2 = env.store.root_tree(r2.ref).get(b"disk.img")
    assert e2 is not None and e2.chunks.run_count == 5
    assert _pread(ov, "disk.img", mid, 8192) == A + B
    assert _pread(ov, "disk.img", 3 * CS - 1, 4098) == b"\0" + B + b"\0"

    # The store side: diff, cat, verify, gc, materialize.
    changes = diff(env.store, r1.ref, r2.ref)
    assert [(c.status, c.path) for c in changes] == [("modified", b"disk.img")]
    env.store.add_snapshot(r2.ref, "test", None)
    head = b"".join(islice(cat(env.store, r2.ref, "disk.img"), 4))
    assert head == bytes(3 * CS) + B + bytes(CS - 4096)
    assert verify(env.store) == []
    gc(env.store)
    assert verify(env.store) == []
    out = tmp_path / "out"
    res = materialize(env.store, r2.ref, out)
    assert res.bytes < 1 << 20  # the small tree and two data chunks; holes stay holes
    st = os.stat(out / "disk.img")
    assert st.st_size == TIB and st.st_blocks * 512 <= 4 * CS
    with open(out / "disk.img", "rb") as f:
        f.seek(mid)
        assert f.read(8192) == A + B
    # ``snapshot DIR`` finds the same runs by SEEK_DATA: the copy has the same Ref.
    assert compute_ref(out, chunk_size=CS) == r2.ref
    # Restore to the first checkpoint: the file is as it was.
    restore_overlay(ov, r1.ref, discard=True)
    assert _pread(ov, "disk.img", mid, 8192) == A + bytes(4096)
    assert _pread(ov, "disk.img", 3 * CS, 10) == bytes(10)


def test_an_upper_of_format_1_is_migrated(env: Env, ov: Overlay) -> None:  # noqa: F811
    _pwrite(ov, "big.bin", 2 * CS + 7, b"X")  # a copy-up of one chunk of a lower file
    want = _pread(ov, "big.bin", 0, 1 << 20)
    ov.close()
    env.ov = None
    # Rewrite the upper as format 1 wrote it: every chunk id, concatenated.
    c = sqlite3.connect(os.path.join(env.state, "upper.sqlite"))
    try:
        rows = c.execute("SELECT ino, lower_chunks FROM inodes "
                         "WHERE lower_chunks IS NOT NULL").fetchall()
        assert rows
        for i, runs in rows:
            c.execute("UPDATE inodes SET lower_chunks=? WHERE ino=?",
                      (b"".join(decode_runs(runs)), i))
        c.execute("UPDATE meta SET value='1' WHERE key='format'")
        c.commit()
    finally:
        c.close()
    ov2 = env.mount()
    assert _pread(ov2, "big.bin", 0, 1 << 20) == want
    n = ov2.getattr(ino(ov2, "big.bin"))
    assert isinstance(n.lower_chunks, ChunkList) and len(n.lower_chunks) == 6
    ov2.close()
    env.ov = None
    assert check(env.state, env.store) == []
    c = sqlite3.connect(os.path.join(env.state, "upper.sqlite"))
    try:
        assert c.execute("SELECT value FROM meta WHERE key='format'").fetchone()[0] == "2"
        blob = c.execute("SELECT lower_chunks FROM inodes WHERE lower_chunks IS NOT NULL"
                         ).fetchone()[0]
        assert len(decode_runs(blob)) == 6 and len(blob) != 6 * DIGEST_SIZE
    finally:
        c.close()
