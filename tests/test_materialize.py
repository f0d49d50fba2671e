"""materialize(ref, dest) (CONTRACT 1.5): exact round trips, the three destination cases,
hostile trees, caps, corruption, and races against the destination.

Hostile trees are written as raw tree objects following the byte layout documented in
``store/tree.py`` (the product's encoder refuses to produce them).
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import treegen
from hypothesis import HealthCheck, given, settings

from store.browse import resolve
from store.errors import (
    ArchiveEntryError,
    ArchiveLimitError,
    DestNotEmptyError,
    IntegrityError,
    MaterializeError,
    NotDirError,
    ObjectNotFoundError,
)
from store.materialize import materialize
from store.objects import Store
from store.pack import ObjKind
from store.ref import ObjectId, Ref, object_id
from store.snapshot import compute_ref, snapshot
from store.tree import Entry, Kind

CS = 64 << 10


@pytest.fixture
def small(tmp_path: Path) -> Store:
    return Store(tmp_path / "small-store", chunk_size=CS)


def rmtree(path: Path) -> None:
    """Remove a tree that may hold read-only directories."""
    for dirpath, dirnames, _ in os.walk(path):
        for d in dirnames:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o700)
    shutil.rmtree(path)


def listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


# -- round trips --------------------------------------------------------------------------


def test_round_trip_rich_tree_is_exact(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    treegen.build_rich_tree(src, CS)
    ref = snapshot(small, src)
    dest = tmp_path / "dest"
    result = materialize(small, ref, dest)
    assert not result.already_equal and result.sockets_skipped == 0
    treegen.assert_same_tree(src, dest)
    # Holes stay holes: the sparse file has two chunks with data, three holes.
    assert treegen.allocated(dest / "src" / "sparse") <= 2 * CS + 8192
    assert treegen.allocated(dest / "src" / "zeros") <= 8192
    assert result.bytes < sum(e.stat().st_size for e in (src / "src").iterdir() if e.is_file())
    # Read-only directories came back read-only, with their content.
    assert stat.S_IMODE(os.lstat(dest / "readonly").st_mode) == 0o555
    assert (dest / "readonly" / "inside").read_bytes() == b"cannot add here\n"
    # What was written snapshots to the same Ref.
    assert compute_ref(dest, chunk_size=CS) == ref
    assert snapshot(small, dest) == ref


def test_round_trip_with_default_chunk_size(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    treegen.build_rich_tree(src, store.chunk_size)
    ref = snapshot(store, src)
    materialize(store, ref, tmp_path / "dest")
    treegen.assert_same_tree(src, tmp_path / "dest")


_example = itertools.count()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(spec=treegen.with_hardlinks(treegen.tree_specs(CS)))
def test_round_trip_generated_trees(tmp_path: Path, small: Store, spec: treegen.Node) -> None:
    n = next(_example)
    src, dest = tmp_path / f"src{n}", tmp_path / f"dest{n}"
    treegen.build_tree(src, spec)
    try:
        ref = snapshot(small, src)
        materialize(small, ref, dest)
        treegen.assert_same_tree(src, dest)
        assert compute_ref(dest, chunk_size=CS) == ref
    finally:
        for p in (src, dest):
            if p.exists():
                rmtree(p)


def test_setuid_and_setgid_are_dropped(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "tool").write_bytes(b"#!/bin/sh\n")
    os.chmod(src / "tool", 0o6755)
    (src / "shared").mkdir()
    os.chmod(src / "shared", 0o3775)
    ref = snapshot(store, src)
    materialize(store, ref, tmp_path / "dest")
    assert stat.S_IMODE(os.lstat(tmp_path / "dest" / "tool").st_mode) == 0o755
    assert stat.S_IMODE(os.lstat(tmp_path / "dest" / "shared").st_mode) == 0o1775


def test_sockets_are_skipped_and_counted(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"x")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(src / "sock"))
        ref = snapshot(store, src)
    result = materialize(store, ref, tmp_path / "dest")
    assert result.sockets_skipped == 1 and result.entries == 2 and result.bytes == 1
    assert listing(tmp_path / "dest") == ["f"]


def test_progress_reports_entries_and_bytes(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}").write_bytes(b"ab")
    ref = snapshot(store, src)
    calls: list[tuple[int, int]] = []
    materialize(store, ref, tmp_path / "dest", progress=lambda e, b: calls.append((e, b)))
    assert calls == [(1, 2), (2, 4), (3, 6)]


# -- destination cases ---------------------------------------------------------------------


@pytest.fixture
def simple(tmp_path: Path, store: Store) -> tuple[Path, Ref]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"alpha\n")
    (src / "sub").mkdir()
    (src / "sub" / "b.txt").write_bytes(b"beta\n")
    return src, snapshot(store, src)


def test_missing_dest_is_created(tmp_path: Path, store: Store, simple: tuple[Path, Ref]
                                 ) -> None:
    src, ref = simple
    r = materialize(store, ref, tmp_path / "new")
    assert (r.entries, r.bytes) == (3, 11)
    treegen.assert_same_tree(src, tmp_path / "new")
    with pytest.raises(MaterializeError):
        materialize(store, ref, tmp_path / "no" / "parent")
    assert not (tmp_path / "no").exists()


def test_empty_dest_is_filled_and_keeps_its_mode(tmp_path: Path, store: Store,
                                                simple: tuple[Path, Ref]) -> None:
    src, ref = simple
    dest = tmp_path / "dest"
    dest.mkdir(mode=0o750)
    os.chmod(dest, 0o750)
    materialize(store, ref, dest)
    treegen.assert_same_tree(src, dest)
    assert stat.S_IMODE(dest.stat().st_mode) == 0o750


def test_equal_non_empty_dest_succeeds_without_writes(tmp_path: Path, store: Store,
                                                      simple: tuple[Path, Ref]) -> None:
    src, ref = simple
    dest = tmp_path / "dest"
    treegen.cp_a(src, dest)
    before = (treegen.describe(dest), dest.stat().st_mtime_ns, dest.stat().st_ctime_ns)
    r = materialize(store, ref, dest)
    assert r.already_equal and (r.entries, r.bytes) == (0, 0)
    assert (treegen.describe(dest), dest.stat().st_mtime_ns, dest.stat().st_ctime_ns) == before


def test_different_non_empty_dest_is_refused_untouched(tmp_path: Path, store: Store,
                                                       simple: tuple[Path, Ref]) -> None:
    src, ref = simple
    dest = tmp_path / "dest"
    treegen.cp_a(src, dest)
    (dest / "a.txt").write_bytes(b"ALPHA\n")
    (dest / "extra").mkdir()
    before = treegen.describe(dest)
    with pytest.raises(DestNotEmptyError) as ei:
        materialize(store, ref, dest)
    assert ei.value.want == str(ref)
    assert ei.value.got == str(compute_ref(dest))
    assert ei.value.dest == str(dest)
    assert treegen.describe(dest) == before


def test_non_directory_dest(tmp_path: Path, store: Store, simple: tuple[Path, Ref]) -> None:
    _, ref = simple
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotDirError):
        materialize(store, ref, tmp_path / "file")
    target = tmp_path / "target"
    target.mkdir()
    os.symlink(target, tmp_path / "link")
    with pytest.raises(NotDirError):
        materialize(store, ref, tmp_path / "link")
    assert listing(target) == [] and (tmp_path / "file").read_bytes() == b"x"


def test_dest_with_symlinked_parent_is_refused(tmp_path: Path, store: Store,
                                               simple: tuple[Path, Ref]) -> None:
    _, ref = simple
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "alias")
    with pytest.raises(MaterializeError, match="symbolic link"):
        materialize(store, ref, tmp_path / "alias" / "dest")
    assert listing(real) == []


def test_unknown_ref_touches_nothing(tmp_path: Path, store: Store) -> None:
    with pytest.raises(ObjectNotFoundError):
        materialize(store, Ref(ObjectId(bytes(32))), tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


# -- hostile trees --------------------------------------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def raw_entry(name: bytes, kind: Kind, *, mode: int = 0o644, size: int = 0,
              chunks: tuple[bytes, ...] = (), tree_id: bytes | None = None,
              target: bytes = b"") -> bytes:
    """One entry in the documented tree layout, with no checks at all."""
    out = varint(len(name)) + name + bytes([int(kind)]) + varint(mode) + varint(0) + varint(0)
    out += varint(2 * 1_700_000_000_000_000_000)  # zigzag mtime
    if kind is Kind.DIR:
        out += varint(0) + (tree_id or bytes(32))
    elif kind is Kind.FILE:
        out += varint(size) + varint(len(chunks)) + b"".join(chunks)
    elif kind is Kind.SYMLINK:
        out += varint(len(target)) + varint(len(target)) + target
    else:
        out += varint(0)
    return out + varint(0) + b"\0"  # no xattrs, no link group


def put_raw_tree(s: Store, entries: list[bytes]) -> ObjectId:
    raw = b"RWT1" + varint(len(entries)) + b"".join(entries)
    oid = object_id(raw)
    with s.writer() as w:
        w.put(oid, ObjKind.TREE, raw)
        w.commit()
    return oid


def put_tree(s: Store, entries: list[Entry]) -> ObjectId:
    with s.writer() as w:
        oid = w.put_tree(entries)
        w.commit()
    return oid


def file_entry(s: Store, name: bytes, data: bytes) -> Entry:
    with s.writer() as w:
        cid = w.put_chunk(data)
        w.commit()
    return Entry(name, Kind.FILE, 0o644, 0, 0, 0, len(data), (cid,))


def dir_entry(name: bytes, tree_id: ObjectId) -> Entry:
    return Entry(name, Kind.DIR, 0o755, 0, 0, 0, tree_id=tree_id)


HOSTILE_NAMES = [b"..", b".", b"a/b", b"/etc", b"x\0y", b"n" * 256, b""]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the destination that must never change."""
    o = tmp_path / "outside"
    o.mkdir()
    (o / "keep").write_bytes(b"keep\n")
    return o


def assert_untouched(tmp_path: Path, outside: Path, before: list[str]) -> None:
    assert listing(tmp_path) == before
    assert listing(outside) == ["keep"] and (outside / "keep").read_bytes() == b"keep\n"


@pytest.mark.parametrize("name", HOSTILE_NAMES, ids=lambda n: repr(n[:8]) + f"-{len(n)}")
@pytest.mark.parametrize("nested", [False, True], ids=["root", "nested"])
def test_hostile_names_are_refused_and_dest_left_empty(
        tmp_path: Path, store: Store, outside: Path, name: bytes, nested: bool) -> None:
    with store.writer() as w:
        cid = w.put_chunk(b"payload\n")
        w.commit()
    bad = put_raw_tree(store, [raw_entry(name, Kind.FILE, size=8, chunks=(cid,))])
    if nested:
        # A valid root whose first entry gets written before the hostile subtree is met.
        root = put_tree(store, [file_entry(store, b"aaa-first", b"written first\n"),
                                dir_entry(b"zzz", bad)])
    else:
        root = bad
    ref = Ref(root)
    before = listing(tmp_path)
    with pytest.raises(ArchiveEntryError):
        materialize(store, ref, tmp_path / "dest")
    assert_untouched(tmp_path, outside, before)  # a destination it created is removed
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ArchiveEntryError):
        materialize(store, ref, empty)
    assert listing(empty) == []
    assert_untouched(tmp_path, outside, sorted(before + ["empty"]))


def test_over_long_path_is_refused(tmp_path: Path, store: Store, outside: Path) -> None:
    leaf = put_tree(store, [file_entry(store, b"f", b"x")])
    tid = leaf
    for _ in range(17):  # 17 levels of 255-byte names: over 4096 bytes of path
        tid = put_tree(store, [dir_entry(b"d" * 255, tid)])
    before = listing(tmp_path)
    with pytest.raises(ArchiveEntryError, match="4096"):
        materialize(store, Ref(tid), tmp_path / "dest")
    assert_untouched(tmp_path, outside, before)


@pytest.mark.parametrize("target", [b"", b"a\0b", b"x" * 4096])
def test_bad_symlink_targets_are_refused(tmp_path: Path, store: Store, target: bytes) -> None:
    tid = put_raw_tree(store, [raw_entry(b"l", Kind.SYMLINK, mode=0o777, target=target)])
    with pytest.raises(ArchiveEntryError):
        materialize(store, Ref(tid), tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_symlink_then_dir_of_the_same_name_is_rejected(tmp_path: Path, store: Store,
                                                       outside: Path) -> None:
    """The classic escape: ``a -> outside`` then ``a/x``. In a tree both names must be one
    entry, so the decoder refuses the duplicate before anything is written."""
    inner = put_tree(store, [file_entry(store, b"x", b"escaped?\n")])
    tid = put_raw_tree(store, [
        raw_entry(b"a", Kind.SYMLINK, mode=0o777, target=os.fsencode(outside)),
        raw_entry(b"a", Kind.DIR, mode=0o755, tree_id=inner),
    ])
    before = listing(tmp_path)
    with pytest.raises(IntegrityError, match="strictly increasing"):
        materialize(store, Ref(tid), tmp_path / "dest")
    assert_untouched(tmp_path, outside, before)


def test_xattrs_outside_user_namespace_are_refused(tmp_path: Path, store: Store) -> None:
    e = file_entry(store, b"f", b"x")
    for name in (b"security.capability", b"trusted.x", b"user."):
        tid = put_tree(store, [Entry(e.name, e.kind, e.mode, 0, 0, 0, e.size, e.chunks,
                                     xattrs=((name, b"v"),))])
        with pytest.raises(ArchiveEntryError, match="xattr"):
            materialize(store, Ref(tid), tmp_path / "dest")
        assert not (tmp_path / "dest").exists()


def test_disagreeing_hard_link_members_are_refused(tmp_path: Path, store: Store) -> None:
    a = file_entry(store, b"a", b"one\n")
    b = file_entry(store, b"b", b"two\n")
    group = b"g" * 32
    tid = put_tree(store, [Entry(a.name, a.kind, a.mode, 0, 0, 0, a.size, a.chunks,
                                 link_group=group),
                           Entry(b.name, b.kind, b.mode, 0, 0, 0, b.size, b.chunks,
                                 link_group=group)])
    with pytest.raises(ArchiveEntryError, match="hard-link"):
        materialize(store, Ref(tid), tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


# -- caps -----------------------------------------------------------------------------------


def test_entry_cap(tmp_path: Path, store: Store, outside: Path) -> None:
    entries = [file_entry(store, f"f{i:02d}".encode(), b"x") for i in range(10)]
    ref = Ref(put_tree(store, entries))
    before = listing(tmp_path)
    with pytest.raises(ArchiveLimitError) as ei:
        materialize(store, ref, tmp_path / "dest", max_entries=5)
    assert (ei.value.limit, ei.value.cap, ei.value.observed) == ("entries", 5, 6)
    assert_untouched(tmp_path, outside, before)
    assert materialize(store, ref, tmp_path / "dest", max_entries=10).entries == 10


def test_byte_cap_counts_written_bytes(tmp_path: Path, store: Store, outside: Path) -> None:
    entries = [file_entry(store, f"f{i}".encode(), bytes([65 + i]) * 100) for i in range(3)]
    ref = Ref(put_tree(store, entries))
    empty = tmp_path / "dest"
    empty.mkdir()
    before = listing(tmp_path)
    with pytest.raises(ArchiveLimitError) as ei:
        materialize(store, ref, empty, max_bytes=250)
    assert (ei.value.limit, ei.value.cap, ei.value.observed) == ("bytes", 250, 300)
    assert listing(empty) == []
    assert_untouched(tmp_path, outside, before)
    assert materialize(store, ref, empty, max_bytes=300).bytes == 300


def test_holes_do_not_count_as_written_bytes(tmp_path: Path, small: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "sparse", "wb") as fh:
        fh.truncate(100 * CS)
        fh.write(b"head")
    ref = snapshot(small, src)
    r = materialize(small, ref, tmp_path / "dest", max_bytes=CS)
    assert r.bytes == CS
    assert os.path.getsize(tmp_path / "dest" / "sparse") == 100 * CS


def test_shared_subtrees_cannot_multiply_past_the_cap(tmp_path: Path, store: Store) -> None:
    """Each level lists the previous tree twice: 2**20 files from 21 small objects."""
    tid = put_tree(store, [file_entry(store, b"f", b"x")])
    for _ in range(20):
        tid = put_tree(store, [dir_entry(b"a", tid), dir_entry(b"b", tid)])
    with pytest.raises(ArchiveLimitError) as ei:
        materialize(store, Ref(tid), tmp_path / "dest", max_entries=500)
    assert ei.value.observed == 501
    assert not (tmp_path / "dest").exists()


# -- corruption ------------------------------------------------------------------------------


@pytest.mark.parametrize("content", ["random", "text"])
def test_flipped_byte_in_a_pack_raises_integrity_error(tmp_path: Path, small: Store,
                                                       content: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a-small").write_bytes(b"small file, written before the damaged one\n")
    data = os.urandom(3 * CS) if content == "random" else b"some text line\n" * 20000
    (src / "big").write_bytes(data)
    ref = snapshot(small, src)
    entry = resolve(small, ref, b"big")
    assert entry is not None
    loc = small.locate(entry.chunks[1])
    pack = os.path.join(small.root, "backend", *loc.pack.split("/"))
    os.chmod(pack, 0o600)
    with open(pack, "r+b") as fh:
        fh.seek(loc.rec_offset + loc.rec_length // 2)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0x01]))
    fresh = Store(small.root)  # no cached records
    with pytest.raises(IntegrityError):
        materialize(fresh, ref, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(IntegrityError):
        materialize(fresh, ref, empty)
    assert listing(empty) == []


def test_missing_chunk_raises_integrity_error(tmp_path: Path, store: Store) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"will go missing\n")
    ref = snapshot(store, src)
    entry = resolve(store, ref, b"f")
    assert entry is not None
    store.conn.execute("DELETE FROM objects WHERE id=?", (entry.chunks[0],))
    with pytest.raises(IntegrityError, match="missing"):
        materialize(store, ref, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


def test_size_that_disagrees_with_content_is_an_integrity_error(tmp_path: Path,
                                                               store: Store) -> None:
    e = file_entry(store, b"f", b"12345")
    for size in (4, 6):
        tid = put_tree(store, [Entry(b"f", Kind.FILE, 0o644, 0, 0, 0, size, e.chunks)])
        with pytest.raises(IntegrityError):
            materialize(store, Ref(tid), tmp_path / "dest")
        assert not (tmp_path / "dest").exists()


# -- races against the destination -------------------------------------------------------------


def test_directory_swapped_for_a_symlink_mid_extraction(tmp_path: Path, store: Store,
                                                        outside: Path) -> None:
    """Writes go through the directory fd, never through the path that now is a symlink."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f1").write_bytes(b"one\n")
    (src / "d" / "f2").write_bytes(b"two\n")
    ref = snapshot(store, src)
    dest = tmp_path / "dest"

    def attacker(entries: int, _bytes: int) -> None:
        if entries == 2:  # d and d/f1 are done
            os.rename(dest / "d", dest / "moved")
            os.symlink(outside, dest / "d")

    materialize(store, ref, dest, progress=attacker)
    assert listing(outside) == ["keep"]
    assert listing(dest / "moved") == ["f1", "f2"]


def test_hard_link_source_swapped_for_a_symlink(tmp_path: Path, store: Store,
                                                outside: Path) -> None:
    src = tmp_path / "src"
    (src / "hard").mkdir(parents=True)
    (src / "other").mkdir()
    (src / "hard" / "keep").write_bytes(b"shared\n")
    os.link(src / "hard" / "keep", src / "other" / "b")
    ref = snapshot(store, src)
    dest = tmp_path / "dest"

    def attacker(entries: int, _bytes: int) -> None:
        if entries == 2:  # hard and hard/keep are done; other/b will link to hard/keep
            os.rename(dest / "hard", dest / "moved")
            os.symlink(outside, dest / "hard")

    with pytest.raises(MaterializeError, match="replaced"):
        materialize(store, ref, dest, progress=attacker)
    assert not dest.exists()
    assert listing(outside) == ["keep"]
    assert (outside / "keep").read_bytes() == b"keep\n"
    assert os.lstat(outside / "keep").st_nlink == 1


# -- as an unprivileged user --------------------------------------------------------------------



def _chown_tree(path: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        os.chown(dirpath, uid, uid)
        for n in dirnames + filenames:
            os.chown(os.path.join(dirpath, n), uid, uid, follow_symlinks=False)


def _nobody_store(base: Path, src: Path) -> tuple[Ref, Path, Callable[..., Any]]:
    """``src`` snapshotted into ``base/store``, handed to uid 65534, with a work directory
    of that user: (the Ref, the work directory, the CLI run as that user on the store)."""
    import subprocess
    import sys

    st = Store(base / "store")
    ref = snapshot(st, src)
    st.close()
    _chown_tree(base / "store", 65534)
    work = base / "work"
    work.mkdir()
    os.chown(work, 65534, 65534)
    repo = Path(__file__).resolve().parent.parent

    def as_nobody_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
             sys.executable, "-m", "rewindfs", "--store", str(base / "store"), *args],
            capture_output=True, text=True, cwd=repo, env={**os.environ, "HOME": str(work)})

    return ref, work, as_nobody_cli


@pytest.fixture
def nobody_base() -> Path:
    if not treegen.AS_ROOT:
        pytest.skip("needs root to act as another user")
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="/tmp/rewindfs-test-mat-"))
    os.chmod(base, 0o755)
    yield base  # type: ignore[misc]
    rmtree(base)


def _without_owner(desc: treegen.Description) -> dict[bytes, tuple[object, ...]]:
    out = {}
    for path, d in desc.items():
        if d[0] == "symlink":
            out[path] = (d[0], *d[3:])
        else:
            out[path] = (d[0], d[1], *d[4:])
    return out


def test_read_only_dirs_round_trip_and_wipe_as_unprivileged_user(nobody_base: Path) -> None:
    """Without root's override, modes must be applied deepest first and the wipe must
    make read-only directories writable again before emptying them."""
    src = nobody_base / "src"
    (src / "ro" / "inner").mkdir(parents=True)
    (src / "ro" / "f").write_bytes(b"read-only file\n")
    (src / "ro" / "inner" / "g").write_bytes(b"deeper\n")
    (src / "z").mkdir()
    os.link(src / "ro" / "f", src / "z" / "h")
    (src / "sealed").mkdir()
    (src / "sealed" / "s").write_bytes(b"sealed\n")
    os.symlink("ro/f", src / "link")
    os.chmod(src / "ro" / "f", 0o444)
    os.chmod(src / "ro" / "inner" / "g", 0o400)
    os.chmod(src / "ro" / "inner", 0o500)
    os.chmod(src / "ro", 0o555)
    os.chmod(src / "sealed", 0o000)
    os.chmod(src / "z", 0o555)
    st = Store(nobody_base / "store")
    ref = snapshot(st, src)
    # A second snapshot where a file after the read-only directory has lost its chunk.
    (nobody_base / "src2").mkdir()
    treegen.cp_a(src / "ro", nobody_base / "src2" / "a-ro")
    (nobody_base / "src2" / "b-missing").write_bytes(b"its chunk will be gone\n")
    broken = snapshot(st, nobody_base / "src2")
    entry = resolve(st, broken, b"b-missing")
    assert entry is not None
    st.conn.execute("DELETE FROM objects WHERE id=?", (entry.chunks[0],))
    st.close()
    _chown_tree(nobody_base / "store", 65534)
    for d in ("dest", "dest2"):
        (nobody_base / d).mkdir()
        os.chown(nobody_base / d, 65534, 65534)

    def child() -> int:
        s = Store(nobody_base / "store")
        r = materialize(s, ref, nobody_base / "dest")
        if r.entries != 9:
            return 4
        try:
            materialize(s, broken, nobody_base / "dest2")
        except IntegrityError:
            return 3 if not os.listdir(nobody_base / "dest2") else 5
        return 6

    assert treegen.as_nobody(child) == 3
    got = treegen.describe(nobody_base / "dest")
    assert _without_owner(got) == _without_owner(treegen.describe(src))
    assert {d[2] for d in got.values() if d[0] != "symlink"} == {65534}


def test_non_root_materializes_a_root_owned_snapshot_twice(nobody_base: Path) -> None:
    """A non-root materialize cannot give entries their recorded owners (the files are
    its own), so a second one into the same destination must still find "the same tree"
    (exit 0, already_equal) rather than refuse it as different (exit 6)."""
    import json

    src = nobody_base / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_bytes(b"print('root owned')\n")
    (src / "README").write_bytes(b"owned by root, group 0\n")
    os.symlink("pkg/mod.py", src / "link")
    os.chmod(src / "pkg" / "mod.py", 0o4755)  # setuid: never written by materialize
    os.chown(src / "README", 0, 4)
    ref, work, as_nobody_cli = _nobody_store(nobody_base, src)

    first = as_nobody_cli("materialize", str(ref), str(work / "out"), "--json")
    assert first.returncode == 0, first.stderr
    assert not json.loads(first.stdout)["already_equal"]
    assert os.stat(work / "out" / "README").st_uid == 65534
    second = as_nobody_cli("materialize", str(ref), str(work / "out"), "--json")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["already_equal"]
    # Still "the same tree" only where it is one: different content is refused.
    (work / "out" / "README").write_bytes(b"changed\n")
    third = as_nobody_cli("materialize", str(ref), str(work / "out"))
    assert third.returncode == 6, third.stderr


def test_non_root_materializes_mode_0000_entries_twice(nobody_base: Path) -> None:
    """A non-root extraction writes a mode-0000 file or directory (content first, mode
    last) but cannot read it back: a second materialize into the same destination reads
    what it owns from a user namespace of its own and finds "the same tree" (exit 0,
    already_equal), still refuses different content (exit 6, naming the Ref it found),
    and says "unreadable" for an entry of another user it may not read."""
    import json
    import shutil
    import subprocess

    if shutil.which("unshare") is None or subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "-r",
             "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged user namespaces here")
    src = nobody_base / "src"
    (src / "sealed").mkdir(parents=True)
    (src / "sealed" / "inner").write_bytes(b"behind a mode-0000 directory\n")
    (src / "secret").write_bytes(b"mode 0000\n")
    (src / "plain").write_bytes(b"readable\n")
    os.chmod(src / "secret", 0)
    os.chmod(src / "sealed", 0)
    ref, work, as_nobody_cli = _nobody_store(nobody_base, src)

    out = work / "out"
    first = as_nobody_cli("materialize", str(ref), str(out), "--json")
    assert first.returncode == 0, first.stderr
    assert not json.loads(first.stdout)["already_equal"]
    assert stat.S_IMODE(os.stat(out / "secret").st_mode) == 0
    second = as_nobody_cli("materialize", str(ref), str(out), "--json")
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout)["already_equal"]
    assert stat.S_IMODE(os.stat(out / "secret").st_mode) == 0  # nothing changed
    with open(out / "sealed" / "inner", "ab") as f:  # as root
        f.write(b"changed\n")
    third = as_nobody_cli("materialize", str(ref), str(out))
    assert third.returncode == 6 and "v1:blake3:" in third.stderr.split("holds")[1], \
        third.stderr
    os.chown(out / "secret", 0, 0)  # no longer this user's: not readable in its namespace
    fourth = as_nobody_cli("materialize", str(ref), str(out))
    assert fourth.returncode == 6 and "unreadable" in fourth.stderr, fourth.stderr
    assert "secret" in fourth.stderr
