"""What a session mount stores and caches: copy-up per chunk (CONTRACT 2.4), metadata
changes of lower files without copying data, the kernel's page cache kept for lower content
across opens (2.7), and a corrupt store answered with EIO by a daemon that keeps serving
(2.6, 7).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from fusehelpers import BIG_SIZE, pattern

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")

CHUNK = 1 << 20  # the default store chunk size the fixtures use


def stored_data_bytes(state: Path) -> int:
    """Bytes the upper's data files occupy on disk (allocated blocks, so holes are free)."""
    total = 0
    for p in (state / "data").rglob("*"):
        if p.is_file():
            total += os.stat(p).st_blocks * 512
    return total


def test_metadata_changes_of_lower_files_copy_no_data(mounter: fh.Mounter,
                                                      lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    big = d.mnt / "big.bin"
    os.chmod(big, 0o600)
    os.chown(big, *fh.OTHER_OWNER)
    os.utime(big, ns=(1, 2))
    os.setxattr(big, "user.tag", b"meta only")
    os.link(big, d.mnt / "big-link")
    os.rename(big, d.mnt / "dir" / "big-moved")
    mounter.unmount(d)
    assert d.state is not None
    assert stored_data_bytes(d.state) == 0
    fh.start(d, with_ref=False)
    moved = d.mnt / "dir" / "big-moved"
    st = os.stat(moved)
    assert (st.st_uid, st.st_mode & 0o7777, st.st_mtime_ns, st.st_nlink) == (
        fh.OTHER_OWNER[0], 0o600, 2, 2)
    assert moved.read_bytes() == pattern(BIG_SIZE)


def test_one_byte_write_copies_up_one_chunk(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    with open(d.mnt / "big.bin", "r+b") as f:
        f.seek(CHUNK + 12345)
        f.write(b"!")
    mounter.unmount(d)
    assert d.state is not None
    stored = stored_data_bytes(d.state)
    assert 0 < stored <= CHUNK + 64 * 1024, f"{stored} bytes stored for a one-byte write"
    fh.start(d, with_ref=False)
    want = bytearray(pattern(BIG_SIZE))
    want[CHUNK + 12345] = ord("!")
    assert (d.mnt / "big.bin").read_bytes() == bytes(want)


@contextlib.contextmanager
def pinned_in_page_cache(path: Path) -> Iterator[None]:
    """Hold every page of ``path`` in the page cache for the block: a shared read-only
    mapping, locked (mlock(2) faults every page in). A mapped page is never dropped by
    ``echo 3 > /proc/sys/vm/drop_caches`` (which a cold-cache benchmark or test beside this
    suite runs machine-wide) nor reclaimed, while the file system invalidating the file's
    cache on open (no FOPEN_KEEP_CACHE) still drops it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mlock.argtypes = libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            if libc.mlock(addr, size) != 0:
                raise OSError(ctypes.get_errno(), "mlock failed")
            yield
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_lower_content_keeps_the_page_cache_across_opens(mounter: fh.Mounter, lower_ref: str,
                                                         tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    d = mounter.ro(lower_ref, extra=["--stats-file", str(stats)])
    code = "import sys; open(sys.argv[1], 'rb').read()"
    big = d.mnt / "big.bin"
    subprocess.run([sys.executable, "-c", code, str(big)], check=True)
    with pinned_in_page_cache(big):
        first = fh.request_counts(d, stats)
        assert first.get("read", 0) > 0
        for _ in range(3):  # other processes, new opens
            subprocess.run([sys.executable, "-c", code, str(big)], check=True)
        again = fh.request_counts(d, stats)
    assert again.get("read", 0) == first["read"], "lower pages were read again"


def test_negative_lookups_are_cached(mounter: fh.Mounter, lower_ref: str,
                                     tmp_path: Path) -> None:
    stats = tmp_path / "stats.json"
    d = mounter.ro(lower_ref, extra=["--stats-file", str(stats)])
    missing = d.mnt / "dir" / "no-such-file"
    assert not missing.exists()
    first = fh.request_counts(d, stats)
    for _ in range(20):
        assert not missing.exists()
    assert fh.request_counts(d, stats).get("lookup", 0) == first.get("lookup", 0)


def corrupt_chunk(store_dir: Path, ref: str, name: bytes, index: int) -> None:
    """Flip every byte of the stored record of chunk ``index`` of root entry ``name``."""
    from store.objects import Store
    from store.ref import Ref

    st = Store(store_dir)
    try:
        entry = st.root_tree(Ref.parse(ref)).get(name)
        assert entry is not None
        loc = st.locate(entry.chunks[index])
    finally:
        st.close()
    path = store_dir / "backend" / loc.pack
    with open(path, "r+b") as f:
        f.seek(loc.rec_offset)
        data = f.read(loc.rec_length)
        f.seek(loc.rec_offset)
        f.write(bytes(b ^ 0xFF for b in data))


def test_corrupt_store_gives_eio_and_the_daemon_keeps_serving(mounter: fh.Mounter,
                                                              lower_ref: str,
                                                              fuse_store: Path) -> None:
    corrupt_chunk(fuse_store, lower_ref, b"big.bin", 1)
    d = mounter.ro(lower_ref)
    mounter.tracebacks_ok = True  # the integrity error may be logged with its traceback
    reader = textwrap.dedent("""
        import sys
        try:
            open(sys.argv[1], 'rb').read()
        except OSError as e:
            print(e.errno)
        else:
            print(0)
    """)
    r = subprocess.run([sys.executable, "-c", reader, str(d.mnt / "big.bin")],
                       capture_output=True, text=True, check=True)
    assert int(r.stdout) == errno.EIO
    # the same again (nothing cached wrongly), and everything else still answers
    r = subprocess.run([sys.executable, "-c", reader, str(d.mnt / "big.bin")],
                       capture_output=True, text=True, check=True)
    assert int(r.stdout) == errno.EIO
    assert d.proc is not None and d.proc.poll() is None
    assert (d.mnt / "plain.txt").read_bytes() == b"hello world\n"
    assert os.stat(d.mnt / "big.bin").st_size == BIG_SIZE
    assert fh.is_fuse_mounted(d.mnt)
    mounter.unmount(d)
    assert "big.bin" in d.log_text() or "ntegrity" in d.log_text()
