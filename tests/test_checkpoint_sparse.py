"""Checkpointing a sparse file costs its data, not its apparent size (CONTRACT 3.1)."""

import os

from fusefs.checkpoint import FileJob, MemoryWriter, file_chunks
from store import chunker
from store.objects import Store
from store.tree import ChunkList


class CountingWriter(MemoryWriter):
    def __init__(self, store):
        super().__init__(store)
        self.bytes_hashed = 0

    def put_chunk(self, data):
        self.bytes_hashed += len(data)
        return super().put_chunk(data)


def test_holes_are_neither_read_nor_hashed(tmp_path):
    store = Store(tmp_path / "store")
    cs = store.chunk_size
    path = tmp_path / "data"
    size = 64 << 30
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(40 << 30)
        f.write(b"HELLO")
    w = CountingWriter(store)
    job = FileJob(size=size, lower_chunks=ChunkList(), lower_len=0, present=frozenset(),
                  data_path=str(path))
    ids = file_chunks(job, store, w)
    assert len(ids) == size // cs
    data_index = (40 << 30) // cs
    zero = chunker.zero_chunk_id(cs)
    assert all(cid == zero for i, cid in enumerate(ids) if i != data_index)
    assert w.chunks[ids[data_index]][:5] == b"HELLO"
    # One zero chunk and one data chunk were hashed, not 64 GiB of zeros.
    assert w.bytes_hashed == 2 * cs
    os.unlink(path)


def test_a_data_file_shorter_than_the_size_reads_as_zeros(tmp_path):
    store = Store(tmp_path / "store")
    cs = store.chunk_size
    path = tmp_path / "data"
    path.write_bytes(b"x" * 10)
    w = CountingWriter(store)
    job = FileJob(size=3 * cs, lower_chunks=ChunkList(), lower_len=0, present=frozenset(),
                  data_path=str(path))
    ids = file_chunks(job, store, w)
    assert w.chunks[ids[0]] == b"x" * 10 + bytes(cs - 10)
    assert ids[1] == ids[2] == chunker.zero_chunk_id(cs)
