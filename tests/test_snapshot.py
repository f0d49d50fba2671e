"""snapshot(dir) -> Ref (CONTRACT 1.4), compute_ref, and browsing a snapshot (ls/cat).

Determinism (a tree and its ``cp -a`` copy give one Ref), the files cache (an unchanged
tree is not re-read and writes no pack; a same-size rewrite in one timestamp tick and a
``touch -d`` are seen), fail-closed reading, hard-link groups, and ``ls``/``cat``/
``resolve``. Round trips through materialize are in test_materialize.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import blake3
import pytest
import treegen

from store.browse import cat, ls, resolve
from store.errors import SnapshotError, SnapshotNotFoundError, StoreError
from store.gc import gc
from store.objects import Store
from store.rebuild import rebuild_index
from store.ref import Ref
from store.snapshot import compute_ref, run_snapshot, snapshot
from store.tree import Kind
from store.verify import verify

CS = 64 << 10


@pytest.fixture
def small(tmp_path: Path) -> Store:
    """A store with the smallest chunk size, so multi-chunk files stay small."""
    return Store(tmp_path / "small-store", chunk_size=CS)


def packs(s: Store) -> list[str]:
    return s.backend.list("packs/")


def wait_next_second() -> None:
    """Sleep past the next whole second, so everything written so far is older than the
    files cache's trust horizon of the next snapshot."""
    now = time.time()
    time.sleep(1.02 - (now - int(now)))


def files_cache_rows(s: Store) -> int:
    return int(s.conn.execute("SELECT COUNT(*) FROM files_cache").fetchone()[0])


# -- determinism ------------------------------------------------------------------------


def test_cp_a_copy_and_other_store_give_the_same_ref(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    treegen.build_rich_tree(src, CS)
    ref = snapshot(small, src)
    treegen.cp_a(src, tmp_path / "elsewhere")
    other = Store(tmp_path / "other-store", chunk_size=CS)
    assert snapshot(other, tmp_path / "elsewhere") == ref
    assert compute_ref(tmp_path / "elsewhere", chunk_size=CS) == ref
    assert compute_ref(src, chunk_size=CS) == ref


def test_compute_ref_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    treegen.build_rich_tree(src, CS)
    before = treegen.describe(tmp_path)
    ref = compute_ref(src, chunk_size=CS)
    assert isinstance(ref, Ref)
    assert treegen.describe(tmp_path) == before


def test_any_change_changes_the_ref(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    treegen.build_rich_tree(src, CS)
    seen = {snapshot(small, src)}
    changes = [
        lambda: os.chmod(src / "src" / "main.py", 0o700),
        lambda: os.utime(src / "src" / "main.py", ns=(1, 2)),
        lambda: os.setxattr(src / "src" / "main.py", "user.new", b"v"),
        lambda: os.symlink("x", src / "empty-dir" / "new-link"),
        lambda: os.link(src / "src" / "exact", src / "src" / "exact-link"),
        lambda: (src / "src" / "sub" / "deeper" / "leaf.txt").write_bytes(b"LEAF\n"),
    ]
    if treegen.AS_ROOT:
        changes.append(lambda: os.chown(src / "src" / "main.py", 4321, 4321))
    for change in changes:
        change()
        ref = snapshot(small, src)
        assert ref not in seen
        seen.add(ref)


# -- files cache --------------------------------------------------------------------------


def test_resnapshot_unchanged_tree_writes_no_pack_and_reads_nothing(
        tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    treegen.build_rich_tree(src, CS)
    first = run_snapshot(small, src)
    assert first.packs_written >= 1 and first.files_read == first.files - 3  # 3 hard links
    listed = packs(small)
    # Right away: files written in this second are not trusted, so they are read again,
    # but nothing new is stored.
    again = run_snapshot(small, src)
    assert again.ref == first.ref
    assert again.packs_written == 0 and packs(small) == listed
    # Once the tree is older than a snapshot's start, nothing is read at all.
    wait_next_second()
    run_snapshot(small, src)
    quiet = run_snapshot(small, src)
    assert quiet.ref == first.ref
    assert (quiet.files_read, quiet.bytes_read, quiet.packs_written) == (0, 0, 0)
    assert packs(small) == listed


def test_touch_d_with_old_mtime_is_seen(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    f = src / "f.txt"
    f.write_bytes(b"version one\n")
    old = f.stat().st_mtime_ns
    wait_next_second()
    run_snapshot(small, src)
    trusted = run_snapshot(small, src)
    assert trusted.files_read == 0  # the cache is in use for this file
    f.write_bytes(b"version two\n")  # same size
    stamp = f"@{old // 10**9}.{old % 10**9:09d}"
    subprocess.run(["touch", "-d", stamp, str(f)], check=True)
    assert f.stat().st_mtime_ns == old
    after = run_snapshot(small, src)
    assert after.files_read == 1 and after.ref != trusted.ref
    assert b"".join(cat(small, after.ref, b"f.txt")) == b"version two\n"


@contextlib.contextmanager
def coarse_fs(tmp_path: Path) -> Iterator[Path]:
    """A loop-mounted ext4 with 128-byte inodes: timestamps have 1 s granularity, so a
    rewrite within the same second leaves size, mtime and ctime unchanged."""
    if not treegen.AS_ROOT or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 for a loop mount")
    img = tmp_path / "coarse.img"
    mnt = tmp_path / "coarse"
    mnt.mkdir()
    with open(img, "wb") as fh:
        fh.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(img)], check=True,
                   capture_output=True)
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_same_size_rewrite_within_one_timestamp_tick_is_seen(tmp_path: Path,
                                                              small: Store) -> None:
    with coarse_fs(tmp_path) as mnt:
        src = mnt / "src"
        src.mkdir()
        f = src / "f.txt"
        for _ in range(10):
            f.write_bytes(b"AAAA")
            st1 = f.stat()
            first = run_snapshot(small, src)
            f.write_bytes(b"BBBB")
            st2 = f.stat()
            sig = (st1.st_ino, st1.st_size, st1.st_mtime_ns, st1.st_ctime_ns)
            if sig == (st2.st_ino, st2.st_size, st2.st_mtime_ns, st2.st_ctime_ns):
                break  # the rewrite is invisible to stat: exactly the case to test
        else:
            pytest.skip("could not rewrite within one timestamp tick")
        second = run_snapshot(small, src)
        assert second.ref != first.ref
        assert b"".join(cat(small, second.ref, b"f.txt")) == b"BBBB"


def test_deleted_chunk_is_not_trusted_from_the_cache(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"content\n")
    wait_next_second()
    first = run_snapshot(small, src)
    entry = resolve(small, first.ref, b"f")
    assert entry is not None
    # The chunk and the tree holding it disappear from the index (as after gc of a
    # forgotten snapshot); the files cache row still names the chunk.
    small.conn.execute("DELETE FROM objects WHERE id IN (?, ?)",
                       (entry.chunks[0], first.ref.tree_id))
    again = run_snapshot(small, src)
    assert again.ref == first.ref and again.files_read == 1 and again.dirs_cached == 0
    assert small.has(entry.chunks[0])


def test_caches_after_forget_and_gc(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_bytes(b"content\n")
    (src / "g").write_bytes(b"other\n")
    wait_next_second()
    run_snapshot(small, src)
    first = run_snapshot(small, src)
    assert first.files_read == 0 and first.dirs_cached == 3
    assert small.forget(first.ref)
    report = gc(small)
    assert report.dirs_cache_pruned == 3 and not small.has(first.ref.tree_id)
    again = run_snapshot(small, src)
    assert again.ref == first.ref and (again.files_read, again.dirs_cached) == (2, 0)
    assert verify(small) == []
    assert b"".join(cat(small, again.ref, b"a/b/f")) == b"content\n"


# -- fail closed --------------------------------------------------------------------------


def test_device_node_is_recorded_by_kind_and_rdev(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok").write_bytes(b"fine\n")
    try:
        os.mknod(src / "null", 0o600 | 0o020000, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("cannot create a device node")
    ref = snapshot(store, src)
    e = store.root_tree(ref).get(b"null")
    assert e is not None and e.kind is Kind.CHAR and e.rdev == os.makedev(1, 3)
    assert e.size == 0 and e.mode == 0o600
    assert [s.ref for s in store.list_snapshots()] == [ref]
    assert snapshot(store, src) == ref


def test_directory_changing_while_read_fails_closed(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}").write_bytes(b"x")

    def meddle(files: int, _bytes: int) -> None:
        if files == 1:
            (src / "late-arrival").write_bytes(b"y")

    with pytest.raises(SnapshotError) as ei:
        snapshot(store, src, progress=meddle)
    assert "changed while read" in ei.value.cause
    assert store.list_snapshots() == []


def test_file_changing_while_read_fails_closed(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    big = src / "big"
    with open(big, "wb") as fh:
        fh.write(os.urandom(1 << 20) * 48)
    stop = threading.Event()
    ticks = [0]

    def touch() -> None:
        while not stop.is_set():
            os.utime(big, ns=(ticks[0], ticks[0]))
            ticks[0] += 1

    t = threading.Thread(target=touch)
    t.start()
    try:
        while ticks[0] < 100:
            time.sleep(0.001)
        with pytest.raises(SnapshotError) as ei:
            snapshot(store, src)
    finally:
        stop.set()
        t.join()
    assert "big" in ei.value.cause and "changed while read" in ei.value.cause
    assert store.list_snapshots() == []



@pytest.mark.parametrize("what", ["file", "dir"])
def test_unreadable_entry_fails_closed(what: str) -> None:
    if not treegen.AS_ROOT:
        pytest.skip("needs root to act as another user")
    base = Path(tempfile.mkdtemp(prefix="/tmp/rewindfs-test-snap-"))
    try:
        os.chmod(base, 0o755)
        src = base / "src"
        src.mkdir()
        (src / "readable").write_bytes(b"ok\n")
        secret = src / "secret"
        if what == "file":
            secret.write_bytes(b"root only\n")
            os.chmod(secret, 0o600)
        else:
            secret.mkdir(mode=0o700)
        os.chown(src, 65534, 65534)
        (base / "st").mkdir()
        os.chown(base / "st", 65534, 65534)

        def child() -> int:
            s = Store(base / "st" / "store")
            try:
                snapshot(s, src)
            except SnapshotError as e:
                return 3 if "secret" in e.cause and not s.list_snapshots() else 4
            return 0

        assert treegen.as_nobody(child) == 3
    finally:
        shutil.rmtree(base)


def test_store_inside_the_tree_is_refused(tmp_path: Path) -> None:
    s = Store(tmp_path / "tree" / "store")
    (tmp_path / "tree" / "f").write_bytes(b"x")
    with pytest.raises(SnapshotError, match="store"):
        snapshot(s, tmp_path / "tree")


def test_missing_or_non_directory_root(tmp_path: Path, store: Store) -> None:
    with pytest.raises(SnapshotError, match="no such"):
        snapshot(store, tmp_path / "nope")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(SnapshotError, match="not a directory"):
        snapshot(store, tmp_path / "file")


# -- what is recorded ---------------------------------------------------------------------


def test_symlinks_are_recorded_not_followed(tmp_path: Path, store: Store) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"outside the tree\n")
    src = tmp_path / "src"
    src.mkdir()
    os.symlink(outside, src / "dirlink")
    os.symlink(outside / "secret.txt", src / "filelink")
    r = run_snapshot(store, src)
    assert r.files == 0 and r.bytes == 0
    entries = {e.name: e for e in ls(store, r.ref)}
    assert entries[b"dirlink"].kind is Kind.SYMLINK
    assert entries[b"dirlink"].target == os.fsencode(outside)
    with pytest.raises(SnapshotNotFoundError):
        resolve(store, r.ref, b"dirlink/secret.txt")


def test_hard_link_groups(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    (src / "one").mkdir(parents=True)
    (src / "two").mkdir()
    (src / "one" / "a").write_bytes(b"linked\n")
    os.link(src / "one" / "a", src / "two" / "b")
    (src / "one" / "lonely").write_bytes(b"other link outside the tree\n")
    os.link(src / "one" / "lonely", tmp_path / "outside-link")
    (src / "other").mkdir()
    (src / "other" / "x").write_bytes(b"x")
    ref = snapshot(store, src)
    a = resolve(store, ref, b"one/a")
    b = resolve(store, ref, b"two/b")
    lonely = resolve(store, ref, b"one/lonely")
    assert a is not None and b is not None and lonely is not None
    assert a.link_group == b.link_group == blake3.blake3(b"one/a\0two/b").digest()
    assert lonely.link_group is None
    # The group id depends on its members only: a change elsewhere keeps both subtrees.
    (src / "other" / "x").write_bytes(b"y")
    ref2 = snapshot(store, src)
    assert ref2 != ref
    for d in (b"one", b"two"):
        e1, e2 = resolve(store, ref, d), resolve(store, ref2, d)
        assert e1 is not None and e2 is not None and e1.tree_id == e2.tree_id


def test_sparse_and_zero_chunks_are_stored_once(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as fh:
        fh.truncate(200 * CS)
    (src / "zeros").write_bytes(bytes(3 * CS))
    r = run_snapshot(small, src)
    sparse = resolve(small, r.ref, b"sparse")
    zeros = resolve(small, r.ref, b"zeros")
    assert sparse is not None and zeros is not None
    assert len(set(sparse.chunks)) == 1 and set(sparse.chunks) == set(zeros.chunks)
    assert r.stored_bytes < 4096
    assert sum(len(b) for b in cat(small, r.ref, b"sparse")) == 200 * CS


def test_user_xattrs_and_kinds_recorded(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    if not treegen.xattrs_supported(src):
        pytest.skip("no user xattrs here")
    (src / "f").write_bytes(b"x")
    os.setxattr(src / "f", "user.b", b"2")
    os.setxattr(src / "f", "user.a", b"")
    os.mkfifo(src / "fifo")
    ref = snapshot(store, src)
    f = resolve(store, ref, "f")
    fifo = resolve(store, ref, "fifo")
    assert f is not None and fifo is not None
    assert f.xattrs == ((b"user.a", b""), (b"user.b", b"2"))
    assert fifo.kind is Kind.FIFO and fifo.size == 0


def test_progress_reports_running_totals(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}").write_bytes(b"x" * (i + 1))
    calls: list[tuple[int, int]] = []
    r = run_snapshot(store, src, progress=lambda f, b: calls.append((f, b)))
    assert [c[0] for c in calls] == [1, 2, 3, 4, 5]
    assert calls[-1] == (r.files, r.bytes) == (5, 15)


def test_snapshot_is_listed_with_origin_and_label(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    ref = snapshot(store, src, label="first", origin="seed")
    [info] = store.list_snapshots()
    assert (info.ref, info.origin, info.label) == (ref, "seed", "first")


def test_resnapshot_without_a_label_keeps_the_label(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    ref = snapshot(store, src, label="release 1")
    assert snapshot(store, src) == ref
    store.add_snapshot(ref, "checkpoint")
    [info] = store.list_snapshots()
    assert (info.origin, info.label) == ("checkpoint", "release 1")
    assert snapshot(store, src, label="release 2") == ref
    assert [i.label for i in store.list_snapshots()] == ["release 2"]
    # The history objects say the same: a rebuilt index keeps the label too.
    rebuild_index(store)
    assert [i.label for i in store.list_snapshots()] == ["release 2"]
    assert verify(store) == []


# -- browse ------------------------------------------------------------------------------


def test_ls_cat_resolve(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    treegen.build_rich_tree(src, CS)
    ref = snapshot(small, src)
    names = [e.name for e in ls(small, ref)]
    assert names == sorted(os.fsencode(n) for n in os.listdir(src))
    assert [e.name for e in ls(small, ref, "src/sub/")] == [b"deeper"]
    assert [e.name for e in ls(small, ref, b"src/main.py")] == [b"main.py"]
    assert resolve(small, ref, b"") is None and resolve(small, ref, "/./") is None
    for rel in (b"src/big.bin", b"src/sparse", b"names/caf\xe9-latin1", b"src/empty"):
        assert b"".join(cat(small, ref, rel)) == (src / os.fsdecode(rel)).read_bytes()
    for missing in (b"nope", b"src/nope", b"src/main.py/x", b"links/to-own-dir/relative",
                    b"src/../src"):
        with pytest.raises(SnapshotNotFoundError):
            resolve(small, ref, missing)
    for not_file in (b"src", b"links/relative", b""):
        with pytest.raises(StoreError, match="not a file"):
            list(cat(small, ref, not_file))


def test_directory_swapped_for_a_symlink_mid_walk_is_not_followed(tmp_path: Path,
                                                                  store: Store) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 1000)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"a{i}").write_bytes(b"7 bytes")
    for i in range(10):
        (src / f"b{i}").mkdir()
        (src / f"b{i}" / "inner").write_bytes(b"6bytes")
    seen: list[int] = []
    unvisited: list[int] = []

    def attacker(files: int, done: int) -> None:
        seen.append(done)
        if not unvisited and done % 6 == 1:
            # An a-file was just read in the root; no b directory is open now. Each of
            # them becomes a symlink to outside; the listing, taken earlier, still says
            # "directory" for the ones not walked yet.
            unvisited.append(10 - (done - 7) // 6)
            for i in range(10):
                os.rename(src / f"b{i}", tmp_path / f"moved{i}")
                os.symlink(outside, src / f"b{i}")

    with pytest.raises(SnapshotError, match="changed while read"):
        snapshot(store, src, progress=attacker)
    assert store.list_snapshots() == []
    if unvisited[0] == 0:
        pytest.skip("the listing put every b directory before the first a file")
    # Only the tree's own small files were read, never the 1000-byte secret.
    assert max(seen) < 1000
