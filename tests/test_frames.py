"""Framed chunks (store/pack.py, codec 2): a read of a few KiB of a big lower file
decompresses and verifies only the 64 KiB frames it touches, never other bytes.

Covers: exact bytes for random ranges against the plain file (through the store's frames,
the lower's cache and the overlay's read), a damaged frame or frame-table entry failing
only the reads that touch it, a store written in pack format 1 (``tests/data/store-format1``,
made by the code before framing) read, verified and deduplicated by the new code, and GC's
repack turning old records into framed ones under the same ids.
"""

from __future__ import annotations

import errno
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import blake3
import fusehelpers as fh
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusefs.lower import Lower
from fusefs.overlay import Overlay
from store.errors import IntegrityError
from store.gc import gc
from store.materialize import materialize
from store.objects import Store
from store.pack import (
    BLOCK_SIZE,
    FRAME_SIZE,
    Codec,
    FrameTable,
    Location,
    frame_tag,
    table_length,
)
from store.ref import ObjectId, Ref
from store.snapshot import snapshot
from store.verify import verify

CS = 256 << 10  # four frames per chunk
DATA = Path(__file__).resolve().parent / "data" / "store-format1"
FORMAT1_REF = "v1:blake3:b0723da83992959e8f6e8ee3cf1aec8e75c9efd748596983ffcf99dbb0e06078"


def mixed_bytes(n: int, seed: int) -> bytes:
    """``n`` bytes alternating compressible text and random runs (both frame codecs)."""
    rnd = random.Random(seed)
    out = bytearray()
    while len(out) < n:
        if rnd.random() < 0.5:
            out += rnd.randbytes(rnd.randrange(1, 3 * FRAME_SIZE))
        else:
            out += b"line %d of some text\n" % rnd.randrange(1000) * rnd.randrange(1, 3000)
    return bytes(out[:n])


@pytest.fixture(scope="module")
def framed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, Ref, bytes]:
    tmp = tmp_path_factory.mktemp("frames")
    # four chunks of text and random runs (framed), one of random bytes (raw blocks), and
    # a short tail (one record)
    content = (mixed_bytes(4 * CS, 1) + random.Random(9).randbytes(CS)
               + mixed_bytes(12_345, 3))
    src = tmp / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(content)
    s = Store(tmp / "store", chunk_size=CS)
    return s, snapshot(s, src), content


def _entry_chunks(s: Store, ref: Ref, name: bytes) -> list[ObjectId]:
    e = s.root_tree(ref).get(name)
    assert e is not None
    return list(e.chunks)


def test_new_chunks_are_framed_and_keep_their_ids(framed: tuple[Store, Ref, bytes]) -> None:
    s, ref, content = framed
    cids = _entry_chunks(s, ref, b"f.bin")
    locs = [s.locate(c) for c in cids]
    # a chunk of more than one frame is stored framed, or in raw blocks when no frame of
    # it compresses; the last one (12,345 bytes) is one record as before
    assert [loc.codec for loc in locs[:5]] == [Codec.FRAMED] * 4 + [Codec.BLOCKS]
    assert locs[5].codec in (Codec.RAW, Codec.ZSTD)
    assert locs[4].rec_length == CS + CS // BLOCK_SIZE * 32
    codecs = set()
    for loc in locs[:4]:
        head = s.backend.get_range(loc.pack, loc.rec_offset, table_length(loc.raw_length))
        codecs |= set(FrameTable.parse("t", head, loc.rec_length, loc.raw_length).codecs)
    assert codecs == {Codec.RAW, Codec.ZSTD}
    # ids are still the blake3 of each whole chunk: Refs and dedup are unchanged
    assert [bytes(c) for c in cids] == [blake3.blake3(content[i:i + CS]).digest()
                                        for i in range(0, len(content), CS)]
    assert b"".join(s.read_object(c) for c in cids) == content
    assert verify(s, full=True) == []


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_random_ranges_read_exact_bytes(framed: tuple[Store, Ref, bytes],
                                        data: st.DataObject) -> None:
    s, ref, content = framed
    cids = _entry_chunks(s, ref, b"f.bin")
    lower = Lower(s, ref, cache_bytes=data.draw(st.sampled_from([1, 200 << 10, 64 << 20])))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(cids) - 1))
        n = min(CS, len(content) - i * CS)
        lo = data.draw(st.integers(0, n))
        hi = data.draw(st.integers(lo, n))
        assert lower.read(cids[i], lo, hi) == content[i * CS + lo:i * CS + hi]


def test_overlay_reads_across_chunks_and_frames(framed: tuple[Store, Ref, bytes]) -> None:
    s, ref, content = framed
    ov = Overlay(Lower(s, ref))
    node = ov.lookup(1, b"f.bin")
    assert node is not None
    h = ov.open(node.ino, 0)
    rnd = random.Random(3)
    for _ in range(300):
        off = rnd.randrange(len(content) + 10)
        size = rnd.choice([1, 4096, FRAME_SIZE + 1, 128 << 10, CS + 7])
        assert ov.read(h, off, size) == content[off:off + size]
    ov.release(h)


def _frame_file_offset(s: Store, loc: Location, index: int) -> tuple[Path, int, int]:
    """(pack path, offset of frame ``index``'s stored bytes in it, their length)."""
    head = s.backend.get_range(loc.pack, loc.rec_offset, table_length(loc.raw_length))
    t = FrameTable.parse("t", head, loc.rec_length, loc.raw_length)
    return (Path(s.root) / "backend" / loc.pack, loc.rec_offset + t.offsets[index],
            t.lengths[index])


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["frame", "tag", "length"])
def test_a_damaged_frame_fails_only_the_reads_that_touch_it(tmp_path: Path,
                                                            where: str) -> None:
    content = mixed_bytes(3 * CS, 2)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(content)
    s = Store(tmp_path / "store", chunk_size=CS)
    ref = snapshot(s, src)
    cids = _entry_chunks(s, ref, b"f.bin")
    loc = s.locate(cids[1])
    assert loc.codec is Codec.FRAMED
    pack, off, n = _frame_file_offset(s, loc, 2)
    row = loc.rec_offset + 8 + 2 * 37  # frame 2's table row
    _flip(pack, {"frame": off + n // 2, "tag": row + 5 + 17, "length": row + 3}[where])
    lower = Lower(s, ref)
    for lo, hi in [(2 * FRAME_SIZE, 2 * FRAME_SIZE + 4096), (3 * FRAME_SIZE - 1, 3 * FRAME_SIZE),
                   (0, CS)]:
        with pytest.raises(IntegrityError):
            lower.read(cids[1], lo, hi)
    # the same read fails again (nothing wrong was cached) ...
    with pytest.raises(IntegrityError):
        lower.read(cids[1], 2 * FRAME_SIZE, 2 * FRAME_SIZE + 1)
    # ... while every other frame of that chunk, and the other chunks, read exactly (a
    # wrong stored length leaves the table inconsistent: then the whole chunk fails)
    for lo, hi in [(0, 4096), (FRAME_SIZE, 2 * FRAME_SIZE), (3 * FRAME_SIZE, CS),
                   (2 * FRAME_SIZE - 10, 2 * FRAME_SIZE)]:
        if where == "length":
            with pytest.raises(IntegrityError):
                lower.read(cids[1], lo, hi)
        else:
            assert lower.read(cids[1], lo, hi) == content[CS + lo:CS + hi]
    for i in (0, 2):
        assert lower.read(cids[i], 100, CS) == content[i * CS + 100:(i + 1) * CS]
    if where == "tag":
        # the content itself is intact: a whole read checks it against the chunk id
        assert s.read_object(cids[1]) == content[CS:2 * CS]
    else:
        with pytest.raises(IntegrityError):
            s.read_object(cids[1])
        with pytest.raises(IntegrityError):
            materialize(s, ref, tmp_path / "out")
        assert not (tmp_path / "out").exists()
    # verify names the chunk (and the pack, whose bytes no longer hash to its key)
    problems = verify(s, full=True)
    assert {(p.invariant, p.key) for p in problems} == {("object-hash", cids[1].hex()),
                                                        ("pack-trailer", loc.pack)}


@pytest.mark.parametrize("where", ["block", "tag"])
def test_a_damaged_block_fails_only_the_reads_that_touch_it(tmp_path: Path,
                                                            where: str) -> None:
    content = random.Random(8).randbytes(3 * CS)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(content)
    s = Store(tmp_path / "store", chunk_size=CS)
    ref = snapshot(s, src)
    cids = _entry_chunks(s, ref, b"f.bin")
    loc = s.locate(cids[1])
    assert loc.codec is Codec.BLOCKS
    step = 32 + BLOCK_SIZE
    at = loc.rec_offset + 5 * step + {"block": 32 + 1000, "tag": 7}[where]
    _flip(Path(s.root) / "backend" / loc.pack, at)
    lower = Lower(s, ref)
    b5 = 5 * BLOCK_SIZE
    for lo, hi in [(b5, b5 + BLOCK_SIZE), (b5 + 4095, b5 + 4096), (b5 - 1, b5 + 1), (0, CS)]:
        with pytest.raises(IntegrityError):
            lower.read(cids[1], lo, hi)
    for lo, hi in [(0, b5), (b5 + BLOCK_SIZE, CS), (b5 - BLOCK_SIZE, b5)]:
        assert lower.read(cids[1], lo, hi) == content[CS + lo:CS + hi]
    for i in (0, 2):
        assert lower.read(cids[i], 0, CS) == content[i * CS:(i + 1) * CS]
    if where == "tag":
        assert s.read_object(cids[1]) == content[CS:2 * CS]
    else:
        with pytest.raises(IntegrityError):
            s.read_object(cids[1])
    problems = verify(s, full=True)
    assert {(p.invariant, p.key) for p in problems} == {("object-hash", cids[1].hex()),
                                                        ("pack-trailer", loc.pack)}


@pytest.mark.parametrize("kind", ["framed", "blocks"])
def test_an_index_row_pointing_at_another_chunks_record_is_refused(tmp_path: Path,
                                                                   kind: str) -> None:
    """Frames and blocks verify only as part of their own chunk: tags are keyed by the
    chunk id, so an index row misdirected to another chunk's record (well-formed, of the
    same codec and length) gives IntegrityError, never that chunk's bytes."""
    rnd = random.Random(4)
    src = tmp_path / "src"
    src.mkdir()
    make = rnd.randbytes if kind == "blocks" else (lambda n: mixed_bytes(n, rnd.randrange(1 << 30)))
    a_bytes, b_bytes = make(CS), make(CS)
    (src / "a.bin").write_bytes(a_bytes)
    (src / "b.bin").write_bytes(b_bytes)
    s = Store(tmp_path / "store", chunk_size=CS)
    ref = snapshot(s, src)
    [a], [b] = _entry_chunks(s, ref, b"a.bin"), _entry_chunks(s, ref, b"b.bin")
    la = s.locate(a)
    assert la.codec is (Codec.BLOCKS if kind == "blocks" else Codec.FRAMED)
    assert s.locate(b).codec is la.codec
    s.conn.execute("UPDATE objects SET pack=?, rec_offset=?, rec_length=? WHERE id=?",
                   (la.pack, la.rec_offset, la.rec_length, b))
    lower = Lower(s, ref)
    with pytest.raises(IntegrityError):
        lower.read(b, 0, 10)
    with pytest.raises(IntegrityError):
        lower.read(b, FRAME_SIZE, FRAME_SIZE + 10)
    with pytest.raises(IntegrityError):
        s.read_object(b)
    assert lower.read(a, 0, 10) == a_bytes[:10]


def _format1_source(dest: Path) -> None:
    """The tree tests/data/store-format1 holds (see its README)."""
    r = random.Random(7)
    (dest / "sub").mkdir(parents=True)
    out = bytearray()
    i = 0
    n = (2 << 20) + 12345
    while len(out) < n:
        out += b"line %08d of a file written by the format 1 store\n" % i
        i += 1
    (dest / "big.txt").write_bytes(bytes(out[:n]))
    (dest / "rand.bin").write_bytes(r.randbytes(66 << 10))
    (dest / "sub" / "small.txt").write_bytes(b"hello old store\n")
    (dest / "link").symlink_to("big.txt")


def _format1_store(tmp_path: Path) -> Store:
    root = tmp_path / "old"
    shutil.copytree(DATA, root / "backend", ignore=shutil.ignore_patterns("README*"))
    return Store(root)  # no index: rebuilt from the pack trailers


def test_a_format1_store_reads_verifies_and_dedups(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _format1_source(src)
    s = _format1_store(tmp_path)
    ref = Ref.parse(FORMAT1_REF)
    assert [str(i.ref) for i in s.list_snapshots()] == [FORMAT1_REF]
    cids = _entry_chunks(s, ref, b"big.txt")
    assert {s.locate(c).codec for c in cids} == {Codec.ZSTD}  # single-frame records
    assert verify(s, full=True) == []
    out = tmp_path / "out"
    materialize(s, ref, out)
    for name in ("big.txt", "rand.bin", "sub/small.txt"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert (out / "link").readlink() == Path("big.txt")
    content = (src / "big.txt").read_bytes()
    lower = Lower(s, ref)
    rnd = random.Random(5)
    for _ in range(50):
        i = rnd.randrange(len(cids))
        lo = rnd.randrange(1 << 20)
        hi = min(lo + 4096, len(content) - i * (1 << 20))
        assert lower.read(cids[i], lo, hi) == content[i * (1 << 20) + lo:i * (1 << 20) + hi]
    # the same files snapshotted by the new code into the old store: the same chunk ids,
    # so no chunk is written (only the trees, whose mtimes differ)
    chunks = s.conn.execute("SELECT COUNT(*) FROM objects WHERE kind=1").fetchone()
    ref2 = snapshot(s, src)
    assert s.conn.execute("SELECT COUNT(*) FROM objects WHERE kind=1").fetchone() == chunks
    assert _entry_chunks(s, ref2, b"big.txt") == cids
    # into a fresh store: the same chunk ids again, now framed where above one frame
    fresh = Store(tmp_path / "fresh")
    ref3 = snapshot(fresh, src)
    assert _entry_chunks(fresh, ref3, b"big.txt") == cids
    assert [fresh.locate(c).codec for c in cids] == [Codec.FRAMED] * 2 + [Codec.ZSTD]


def test_gc_repack_frames_old_chunks_under_the_same_ids(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _format1_source(src)
    s = _format1_store(tmp_path)
    ref = Ref.parse(FORMAT1_REF)
    assert verify(s, full=True) == []  # lets GC run after the rebuild
    (src / "rand.bin").unlink()  # a second snapshot without it; forget the first
    ref2 = snapshot(s, src)
    s.forget(ref)
    gc(s)
    cids = _entry_chunks(s, ref2, b"big.txt")
    # the two 1 MiB chunks are framed now; the last one (12,345 bytes) is one frame
    assert [s.locate(c).codec for c in cids] == [Codec.FRAMED] * 2 + [Codec.ZSTD]
    content = (src / "big.txt").read_bytes()
    lower = Lower(s, ref2)
    assert lower.read(cids[1], 70_000, 140_000) == content[(1 << 20) + 70_000:
                                                           (1 << 20) + 140_000]
    assert verify(s, full=True) == []


def test_frame_table_bounds(tmp_path: Path) -> None:
    """A table claiming another frame size or count is refused before any frame is read."""
    head = struct.pack(">II", FRAME_SIZE, 2) + struct.pack(">IB32s", 10, 1, b"t" * 32) * 2
    FrameTable.parse("t", head, len(head) + 20, 2 * FRAME_SIZE)
    for bad in [struct.pack(">II", FRAME_SIZE * 2, 2) + head[8:],
                struct.pack(">II", FRAME_SIZE, 3) + head[8:]]:
        with pytest.raises(IntegrityError):
            FrameTable.parse("t", bad, len(head) + 20, 2 * FRAME_SIZE)
    with pytest.raises(IntegrityError):
        FrameTable.parse("t", head, len(head) + 21, 2 * FRAME_SIZE)
    with pytest.raises(IntegrityError):
        FrameTable.parse("t", head, len(head) + 20, 3 * FRAME_SIZE)


def test_unit_tags_are_keyed_blake3_of_offset_then_plaintext() -> None:
    """The tag of a frame or block is what packs already on disk hold: keyed blake3 (key:
    the chunk id) of its plaintext offset (8 bytes, big endian) followed by its plaintext,
    whatever the unit's size or where its bytes sit (a view into a record)."""
    oid = ObjectId(blake3.blake3(b"some chunk").digest())
    rnd = random.Random(5)
    for n in (0, 1, BLOCK_SIZE - 1, BLOCK_SIZE, FRAME_SIZE):
        plain = rnd.randbytes(n)
        for off in (0, BLOCK_SIZE, 7 * FRAME_SIZE, (1 << 40) + 3):
            h = blake3.blake3(key=oid)
            h.update(struct.pack(">Q", off))
            h.update(plain)
            want = h.digest()
            assert frame_tag(oid, off, plain) == want
            assert frame_tag(oid, off, memoryview(b"x" * 32 + plain)[32:]) == want


# -- through a real mount ------------------------------------------------------------------

_PREAD = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: each read asks its pages
for spec in sys.argv[2:]:
    off, n = map(int, spec.split(":"))
    if off < 0:  # the file's pages leave the page cache: the next reads ask the daemon
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        continue
    try:
        data = os.pread(fd, n, off)
    except OSError as e:
        print("E", e.errno)
    else:
        sys.stdout.buffer.write(b"D %d " % len(data) + data.hex().encode() + b"\\n")
"""


def _preads(path: Path, spans: list[tuple[int, int]]) -> list[bytes | int]:
    """pread each ``(offset, length)`` of ``path`` in another process: the bytes, or the
    errno of a failed read. A negative offset drops the file's cached pages instead (no
    result)."""
    out = subprocess.run([sys.executable, "-c", _PREAD, str(path)]
                         + [f"{o}:{n}" for o, n in spans],
                         capture_output=True, check=True).stdout.splitlines()
    res: list[bytes | int] = []
    for line in out:
        kind, val, *rest = line.split(b" ")
        res.append(int(val) if kind == b"E" else bytes.fromhex((rest or [b""])[0].decode()))
    return res


@pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")
def test_mount_random_reads_are_exact_and_a_damaged_unit_is_eio_only_where_touched(
        mounter: fh.Mounter, fuse_store: Path, tmp_path: Path) -> None:
    mb = 1 << 20
    src = tmp_path / "src"
    src.mkdir()
    files = {b"mixed.bin": mixed_bytes(3 * mb + 777, 11),
             b"rand.bin": random.Random(12).randbytes(3 * mb + 777)}
    for name, data in files.items():
        (src / name.decode()).write_bytes(data)
    ref = fh.snapshot(fuse_store, src)
    st = Store(fuse_store)
    r = Ref.parse(ref)
    cm, cr = _entry_chunks(st, r, b"mixed.bin"), _entry_chunks(st, r, b"rand.bin")
    lm, lr = st.locate(cm[1]), st.locate(cr[1])
    assert (lm.codec, lr.codec) == (Codec.FRAMED, Codec.BLOCKS)
    pack, off, n = _frame_file_offset(st, lm, 3)  # bytes [mb + 3 * 64K, mb + 4 * 64K)
    _flip(pack, off + n // 3)
    _flip(Path(st.root) / "backend" / lr.pack, lr.rec_offset + 7 * (32 + BLOCK_SIZE) + 40)
    st.close()
    d = mounter.ro(ref)
    mounter.tracebacks_ok = True  # the integrity errors may be logged with a traceback
    rnd = random.Random(13)
    bad = {b"mixed.bin": (mb + 3 * FRAME_SIZE, mb + 4 * FRAME_SIZE),
           b"rand.bin": (mb + 7 * BLOCK_SIZE, mb + 8 * BLOCK_SIZE)}
    for name, data in files.items():
        lo_bad, hi_bad = bad[name]
        spans: list[tuple[int, int]] = []
        while len(spans) < 300:
            # a page, or (straddling two units) half of one and half of the next
            o = rnd.randrange(len(data) // 4096 - 1) * 4096 + (0 if len(spans) % 3 else 2048)
            if o + 4096 <= lo_bad or o >= hi_bad:
                spans.append((o, 4096))
        spans += [(lo_bad, 4096), (hi_bad - 4096, 4096), (len(data) - 777, 4096)]
        # Twice, the file's pages dropped in between: every read asks the daemon again,
        # which keeps no block and verifies each one it reads.
        got = _preads(d.mnt / name.decode(), spans + [(-1, 0)] + spans)
        assert len(got) == 2 * len(spans)
        for g in (got[:len(spans)], got[len(spans):]):
            assert g[-3:-1] == [errno.EIO, errno.EIO]
            assert g[-1] == data[-777:]
            for (o, ln), b in zip(spans[:-3], g[:-3], strict=True):
                assert b == data[o:o + ln], (name, o)
