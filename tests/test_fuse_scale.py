"""Work whose cost must not grow with the tree: renaming a lower directory with 20,000
descendants writes O(1) rows to the upper layer (CONTRACT 2.2), and ``rm -rf`` of large
lower and upper directories finishes in one pass (stable readdir cookies), and ``ls -l`` of
a wide lower directory, the first after the mount, lists what was snapshotted.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import fusehelpers as fh
import pytest

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")

DIRS, FILES_PER_DIR = 200, 99  # 200 directories + 19,800 files = 20,000 descendants


@pytest.fixture(scope="module")
def big_lower(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(store dir, Ref) of a tree with ``big/`` (20,000 descendants) and ``wide/`` (one
    directory of 3,000 files)."""
    base = tmp_path_factory.mktemp("scale")
    src = base / "src"
    for i in range(DIRS):
        d = src / "big" / f"d{i:03d}"
        d.mkdir(parents=True)
        for j in range(FILES_PER_DIR):
            (d / f"f{j:02d}").write_bytes(b"%d/%d\n" % (i, j))
    (src / "wide").mkdir()
    for j in range(3000):
        (src / "wide" / f"w{j:05d}").write_bytes(b"")
    store = base / "store"
    return store, fh.snapshot(store, src)


def total_rows(state: Path) -> int:
    return sum(fh.row_counts(state).values())


def test_rename_of_lower_dir_with_20000_descendants_writes_o1_rows(
        big_lower: tuple[Path, str], tmp_path: Path) -> None:
    store, ref = big_lower
    m = fh.Mounter(tmp_path / "mounts", store)
    m.base.mkdir()
    failed = True
    try:
        d = m.rw(ref)
        assert d.state is not None
        ino_before = os.stat(d.mnt / "big" / "d123" / "f45").st_ino
        m.unmount(d)
        rows_before = total_rows(d.state)
        fh.start(d, with_ref=False)
        os.rename(d.mnt / "big", d.mnt / "renamed")
        assert (d.mnt / "renamed" / "d123" / "f45").read_bytes() == b"123/45\n"
        assert not os.path.lexists(d.mnt / "big")
        m.unmount(d)
        grown = total_rows(d.state) - rows_before
        assert grown <= 10, f"rename wrote {grown} rows: {fh.row_counts(d.state)}"
        fh.start(d, with_ref=False)
        assert sorted(os.listdir(d.mnt / "renamed"))[:2] == ["d000", "d001"]
        assert len(os.listdir(d.mnt / "renamed")) == DIRS
        assert os.stat(d.mnt / "renamed" / "d123" / "f45").st_ino == ino_before
        assert (d.mnt / "renamed" / "d199" / "f98").read_bytes() == b"199/98\n"
        failed = False
    finally:
        m.teardown(failed)


def test_rm_rf_of_wide_lower_and_upper_dirs_in_one_pass(big_lower: tuple[Path, str],
                                                        tmp_path: Path) -> None:
    store, ref = big_lower
    m = fh.Mounter(tmp_path / "mounts", store)
    m.base.mkdir()
    failed = True
    try:
        d = m.rw(ref)
        wide = d.mnt / "wide"
        for j in range(0, 3000, 10):  # a mix of lower, copied-up and new entries
            (wide / f"w{j:05d}").write_bytes(b"changed")
        for j in range(700):
            (wide / f"n{j:05d}").write_bytes(b"")
        r = subprocess.run(["rm", "-rf", str(wide)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert not os.path.lexists(wide)
        r = subprocess.run(["rm", "-rf", str(d.mnt / "big" / "d000"), str(d.mnt / "big" / "d001")],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert len(os.listdir(d.mnt / "big")) == DIRS - 2
        m.remount(d)
        assert not os.path.lexists(wide)
        assert len(os.listdir(d.mnt / "big")) == DIRS - 2
        failed = False
    finally:
        m.teardown(failed)


def test_ls_l_of_a_wide_lower_dir_first_after_mount_matches_its_source(
        big_lower: tuple[Path, str], tmp_path: Path) -> None:
    """The daemon's first listing with attributes (READDIRPLUS) of 3,000 lower entries,
    served with the collector tuned for it (``fusefs.operations.tune_gc``), gives what
    ``ls -l`` gives on the snapshotted tree; so does a second one from the kernel's
    caches, and one after a remount."""
    store, ref = big_lower
    src = store.parent / "src"

    def ls_l(d: Path) -> list[str]:
        r = subprocess.run(["ls", "-ln", "--time-style=+%s", str(d)], capture_output=True,
                           text=True, env=dict(os.environ, LC_ALL="C"))
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    want = ls_l(src / "wide")
    assert len(want) == 3001  # "total" and 3,000 entries
    m = fh.Mounter(tmp_path / "mounts", store)
    m.base.mkdir()
    failed = True
    try:
        d = m.rw(ref)
        assert ls_l(d.mnt / "wide") == want
        assert ls_l(d.mnt / "wide") == want
        d = m.remount(d)
        assert ls_l(d.mnt / "wide") == want
        failed = False
    finally:
        m.teardown(failed)


def test_a_first_listing_gives_each_kind_what_a_lookup_of_it_gives(
        mounter: fh.Mounter, fuse_store: Path, tmp_path: Path) -> None:
    """Nodes made for a listing with attributes (READDIRPLUS, ``Node.from_entry``, the data
    pages of its files asked for ``PAGES_AHEAD`` at a time) are the nodes a lookup makes:
    for a directory holding every kind (empty files, files with data, one of zeros, a
    symlink, a subdirectory, a FIFO, a file with an xattr, two names of one file), the
    attributes after a first listing equal those a lookup by name gives on a fresh mount,
    inode numbers and st_blocks included, and match the source's; every empty file has a
    number of its own."""
    src = tmp_path / "src"
    d = src / "mixed"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "inner").write_bytes(b"x")
    for i in range(3):
        (d / f"empty{i}").write_bytes(b"")
    (d / "data").write_bytes(b"some bytes\n" * 500)
    os.symlink("data", d / "link")
    os.mkfifo(d / "fifo")
    (d / "tagged").write_bytes(b"t")
    os.setxattr(d / "tagged", "user.k", b"v")
    (d / "zeros").write_bytes(bytes(3 * 4096))
    for i in range(1500):  # more files with data than one look-ahead of their data pages
        (d / f"w{i:04d}").write_bytes(b"%d\n" % i * (1 + i % 3000))
    (d / "hard1").write_bytes(b"shared")
    os.link(d / "hard1", d / "hard2")
    os.chmod(d / "data", 0o640)
    os.utime(d / "empty1", ns=(1_000_000_000, 1_234_567_891))
    ref = fh.snapshot(fuse_store, src)
    names = sorted(os.listdir(d))
    fields = ("st_mode", "st_size", "st_nlink", "st_uid", "st_gid", "st_mtime_ns")

    def attrs(root: Path, name: str) -> tuple[int, ...]:
        st = os.lstat(root / name)
        return tuple(getattr(st, f) for f in fields) + (st.st_blocks, st.st_ino)

    listed = mounter.rw(ref)
    assert sorted(e.name for e in os.scandir(listed.mnt / "mixed")) == names
    after_listing = {n: attrs(listed.mnt / "mixed", n) for n in names}
    looked_up = mounter.rw(ref)  # a fresh daemon: each name looked up, never listed
    by_lookup = {n: attrs(looked_up.mnt / "mixed", n) for n in names}
    assert after_listing == by_lookup
    # the source's own figures, but a directory's size (ext4 gives its blocks')
    # the source's own figures (not st_blocks: the source's file system may allocate
    # otherwise), but a directory's size (ext4 gives its blocks')
    assert {n: a[:-2] for n, a in after_listing.items() if n != "sub"} == {
        n: attrs(d, n)[:-2] for n in names if n != "sub"}
    assert after_listing["sub"][:1] + after_listing["sub"][2:-2] == \
        attrs(d, "sub")[:1] + attrs(d, "sub")[2:-2]
    assert after_listing["data"][-2] == 16 and after_listing["zeros"][-2] == 0
    inos = {n: a[-1] for n, a in after_listing.items()}
    assert inos["hard1"] == inos["hard2"]
    assert len(set(inos.values())) == len(names) - 1
    assert os.getxattr(listed.mnt / "mixed" / "tagged", "user.k") == b"v"
    assert os.readlink(listed.mnt / "mixed" / "link") == "data"


def test_a_listing_in_parts_shows_changes_made_between_the_parts(
        mounter: fh.Mounter, fuse_store: Path, tmp_path: Path) -> None:
    """A listing of 5,000 lower files read in parts, with changes in between to entries
    the daemon has already made nodes for ahead of the next READDIR
    (``Overlay.list_ahead``): removed and renamed-away names are not listed, every other
    name is listed once, with the attributes it has now (a chmod, a write), and untouched
    files have the inode numbers a lookup on a fresh mount gives them."""
    src = tmp_path / "src"
    (src / "wide").mkdir(parents=True)
    (src / "other").mkdir()
    names = [f"f{i:05d}" for i in range(5000)]
    for i, name in enumerate(names):
        (src / "wide" / name).write_bytes(b"%d\n" % i)
    ref = fh.snapshot(fuse_store, src)
    d = mounter.rw(ref)
    wide = d.mnt / "wide"
    it = os.scandir(wide)
    first = [next(it) for _ in range(500)]  # the first part read: the next is made ahead
    removed = set(names[1000:1010])
    for name in removed:
        os.unlink(wide / name)
    os.rename(wide / names[1300], d.mnt / "other" / "moved")
    os.chmod(wide / names[1100], 0o600)
    with open(wide / names[1200], "ab") as f:
        f.write(b"more\n")
    rest = list(it)
    it.close()
    listed = [e.name for e in first + rest]
    gone = removed | {names[1300]}
    assert sorted(listed) == [n for n in names if n not in gone]
    assert len(set(listed)) == len(listed)
    seen = {e.name: e.stat(follow_symlinks=False) for e in first + rest}
    assert stat.S_IMODE(seen[names[1100]].st_mode) == 0o600
    assert seen[names[1200]].st_size == len(b"1200\n") + len(b"more\n")
    fresh = mounter.rw(ref)
    for name in names[::97] + names[990:1020] + names[1290:1310]:
        if name not in gone and name not in (names[1100], names[1200]):
            st = os.lstat(fresh.mnt / "wide" / name)
            assert (seen[name].st_ino, seen[name].st_mode, seen[name].st_size) == (
                st.st_ino, st.st_mode, st.st_size), name
