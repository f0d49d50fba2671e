"""The dirs cache (store/dircache.py): an unchanged directory's tree is taken without
opening its entries, and every change a user can make is still seen.

The first tests run on real time (one wait past a whole second, so rows are trusted under
the same-tick rule). The property test moves the trust horizon into the future instead, so
that every snapshot records and trusts rows at once, and waits for the next timestamp tick
before each change: it then checks, after every random change, that a snapshot using the
caches gives the Ref of a walk that uses none (``compute_ref``).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import treegen
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import store.snapshot as snapshot_mod
from store import schema
from store.browse import cat, resolve
from store.objects import Store
from store.snapshot import compute_ref, run_snapshot

CS = 64 << 10
_COARSE = getattr(time, "CLOCK_REALTIME_COARSE", 5)


@pytest.fixture
def small(tmp_path: Path) -> Store:
    return Store(tmp_path / "store", chunk_size=CS)


def wait_next_second() -> None:
    now = time.time()
    time.sleep(1.02 - (now - int(now)))


def deep_tree(root: Path) -> None:
    """root/{top.txt, a/{a.txt, b/{b.txt, c/{c.txt, d/deep.txt}}}, side/{s1,s2}/x.txt}."""
    d = root / "a" / "b" / "c" / "d"
    d.mkdir(parents=True)
    (root / "top.txt").write_bytes(b"top\n")
    (root / "a" / "a.txt").write_bytes(b"a\n")
    (root / "a" / "b" / "b.txt").write_bytes(b"b\n")
    (root / "a" / "b" / "c" / "c.txt").write_bytes(b"c\n")
    (d / "deep.txt").write_bytes(b"deep v1\n")
    for s in ("s1", "s2"):
        (root / "side" / s).mkdir(parents=True)
        (root / "side" / s / "x.txt").write_bytes(s.encode())


DIRS = 8  # root, a, a/b, a/b/c, a/b/c/d, side, side/s1, side/s2


@pytest.fixture
def warm(tmp_path: Path, small: Store) -> Path:
    """The deep tree, snapshotted once its timestamps are older than a second boundary,
    and once more to show that every directory then comes from the dirs cache."""
    src = tmp_path / "src"
    deep_tree(src)
    wait_next_second()
    first = run_snapshot(small, src)
    assert first.dirs_cached == 0 and first.files_read == 7
    again = run_snapshot(small, src)
    assert again.ref == first.ref
    assert (again.dirs_cached, again.files_read, again.files, again.dirs) == (DIRS, 0, 7, 7)
    return src


def test_a_change_deep_in_the_tree_is_seen(warm: Path, small: Store) -> None:
    before = compute_ref(warm, chunk_size=CS)
    (warm / "a" / "b" / "c" / "d" / "deep.txt").write_bytes(b"deep v2\n")  # same size
    r = run_snapshot(small, warm)
    assert r.ref != before and r.ref == compute_ref(warm, chunk_size=CS)
    assert b"".join(cat(small, r.ref, "a/b/c/d/deep.txt")) == b"deep v2\n"
    # Only the changed directory and its ancestors are encoded again.
    assert r.dirs_cached == DIRS - 5 and r.files_read == 1


def test_touch_d_deep_in_the_tree_is_seen(warm: Path, small: Store) -> None:
    f = warm / "a" / "b" / "c" / "c.txt"
    old = f.stat().st_mtime_ns
    f.write_bytes(b"C\n")
    subprocess.run(["touch", "-d", f"@{old // 10**9}.{old % 10**9:09d}", str(f)], check=True)
    assert f.stat().st_mtime_ns == old
    r = run_snapshot(small, warm)
    assert b"".join(cat(small, r.ref, "a/b/c/c.txt")) == b"C\n"
    assert r.ref == compute_ref(warm, chunk_size=CS)


@pytest.mark.parametrize("where", ["same-dir", "other-dir", "dir-rename"])
def test_a_rename_is_seen(warm: Path, small: Store, where: str) -> None:
    if where == "same-dir":
        os.rename(warm / "a" / "b" / "b.txt", warm / "a" / "b" / "renamed.txt")
        gone, there = "a/b/b.txt", "a/b/renamed.txt"
    elif where == "other-dir":
        os.rename(warm / "side" / "s1" / "x.txt", warm / "side" / "s2" / "y.txt")
        gone, there = "side/s1/x.txt", "side/s2/y.txt"
    else:
        os.rename(warm / "a" / "b" / "c", warm / "a" / "b" / "C")
        gone, there = "a/b/c/c.txt", "a/b/C/c.txt"
    r = run_snapshot(small, warm)
    assert r.ref == compute_ref(warm, chunk_size=CS)
    assert resolve(small, r.ref, there) is not None
    with pytest.raises(KeyError):
        resolve(small, r.ref, gone)


@pytest.mark.parametrize("on", ["file", "dir"])
def test_an_xattr_change_is_seen(warm: Path, small: Store, on: str) -> None:
    if not treegen.xattrs_supported(warm):
        pytest.skip("no user xattrs here")
    path = warm / "a" / "b" / "c" / ("c.txt" if on == "file" else "d")
    os.setxattr(path, "user.k", b"v1")
    r1 = run_snapshot(small, warm)
    entry = resolve(small, r1.ref, os.fsencode(path.relative_to(warm)))
    assert entry is not None and entry.xattrs == ((b"user.k", b"v1"),)
    os.setxattr(path, "user.k", b"v2")  # same length, only ctime moves
    r2 = run_snapshot(small, warm)
    entry = resolve(small, r2.ref, os.fsencode(path.relative_to(warm)))
    assert entry is not None and entry.xattrs == ((b"user.k", b"v2"),)
    assert r2.ref == compute_ref(warm, chunk_size=CS)


def test_metadata_of_a_subdirectory_is_seen(warm: Path, small: Store) -> None:
    d = warm / "side" / "s1"
    os.chmod(d, 0o700)
    r1 = run_snapshot(small, warm)
    assert r1.ref == compute_ref(warm, chunk_size=CS)
    os.utime(d, ns=(5, 5))
    r2 = run_snapshot(small, warm)
    assert r2.ref != r1.ref and r2.ref == compute_ref(warm, chunk_size=CS)


def test_replacing_a_file_by_a_symlink_or_a_directory_is_seen(warm: Path, small: Store) -> None:
    f = warm / "side" / "s2" / "x.txt"
    f.unlink()
    os.symlink("elsewhere", f)
    r1 = run_snapshot(small, warm)
    assert r1.ref == compute_ref(warm, chunk_size=CS)
    f.unlink()
    f.mkdir()
    r2 = run_snapshot(small, warm)
    assert r2.ref == compute_ref(warm, chunk_size=CS) != r1.ref


def test_hard_links_keep_their_groups(warm: Path, small: Store) -> None:
    """A file gaining a name elsewhere joins a group; renaming a directory on the path of
    the other name changes the group id, though no stat in the first directory changes."""
    os.link(warm / "a" / "a.txt", warm / "side" / "s1" / "link")
    r1 = run_snapshot(small, warm)
    assert r1.ref == compute_ref(warm, chunk_size=CS)
    a = resolve(small, r1.ref, "a/a.txt")
    assert a is not None and a.link_group is not None
    wait_next_second()
    run_snapshot(small, warm)
    os.rename(warm / "side" / "s1", warm / "side" / "s9")
    r2 = run_snapshot(small, warm)
    assert r2.ref == compute_ref(warm, chunk_size=CS)
    a2 = resolve(small, r2.ref, "a/a.txt")
    assert a2 is not None and a2.link_group not in (None, a.link_group)
    os.unlink(warm / "side" / "s9" / "link")
    r3 = run_snapshot(small, warm)
    a3 = resolve(small, r3.ref, "a/a.txt")
    assert a3 is not None and a3.link_group is None
    assert r3.ref == compute_ref(warm, chunk_size=CS)


def test_row_of_a_tree_no_longer_indexed_is_not_trusted(warm: Path, small: Store) -> None:
    r = run_snapshot(small, warm)
    side = resolve(small, r.ref, "side")
    assert side is not None and side.tree_id is not None
    small.conn.execute("DELETE FROM objects WHERE id=?", (side.tree_id,))
    again = run_snapshot(small, warm)
    assert again.ref == r.ref and small.has(side.tree_id)
    assert again.dirs_cached == DIRS - 1  # only side was encoded (and stored) again


def test_same_path_new_content_after_replacing_the_whole_tree(warm: Path, small: Store,
                                                              tmp_path: Path) -> None:
    """A tree moved away and another put at the same path (inode numbers may be reused)."""
    os.rename(warm, tmp_path / "old")
    deep_tree(warm)
    (warm / "a" / "b" / "b.txt").write_bytes(b"B\n")
    r = run_snapshot(small, warm)
    assert r.ref == compute_ref(warm, chunk_size=CS)
    assert b"".join(cat(small, r.ref, "a/b/b.txt")) == b"B\n"


# -- property: with rows trusted at once, a cached snapshot equals an uncached walk --------


def _next_tick() -> None:
    """Wait until the clock file timestamps come from has moved on."""
    t0 = time.clock_gettime_ns(_COARSE)
    while time.clock_gettime_ns(_COARSE) == t0:
        time.sleep(0.0005)


def _listing(root: Path) -> tuple[list[Path], list[Path]]:
    """(files, directories) below root, directories including root, in a stable order."""
    files, dirs = [], [root]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for n in sorted(filenames):
            p = Path(dirpath) / n
            if p.is_file() and not p.is_symlink():
                files.append(p)
        dirs.extend(Path(dirpath) / n for n in dirnames
                    if not (Path(dirpath) / n).is_symlink())
    return files, dirs


_OPS = st.lists(st.tuples(st.sampled_from(["write", "same-size", "touch-d", "rename",
                                           "move", "unlink", "mkdir", "rmdir", "chmod",
                                           "chmod-dir", "utime-dir", "xattr", "link",
                                           "symlink", "nothing"]),
                          st.integers(0, 10**6), st.integers(0, 10**6)),
                min_size=1, max_size=12)


def _apply(root: Path, op: str, i: int, j: int, counter: list[int]) -> None:
    files, dirs = _listing(root)
    counter[0] += 1
    n = counter[0]
    d = dirs[j % len(dirs)]
    if op == "mkdir":
        (d / f"new{n}").mkdir()
    elif op == "rmdir" and len(dirs) > 1:
        victim = dirs[1 + j % (len(dirs) - 1)]
        subprocess.run(["rm", "-rf", "--", str(victim)], check=True)
    elif op == "chmod-dir" and len(dirs) > 1:
        os.chmod(dirs[1 + j % (len(dirs) - 1)], 0o700 | (n & 0o55))
    elif op == "utime-dir" and len(dirs) > 1:
        os.utime(dirs[1 + j % (len(dirs) - 1)], ns=(n, n))
    elif op == "symlink":
        os.symlink(f"target-{n}", d / f"sym{n}")
    elif not files:
        (d / f"f{n}").write_bytes(b"x" * (n % 7))
    else:
        f = files[i % len(files)]
        if op == "write":
            f.write_bytes(os.urandom(n % 300))
        elif op in ("same-size", "touch-d"):
            old = f.stat()
            f.write_bytes(bytes((b + 1) % 256 for b in f.read_bytes()))
            if op == "touch-d":
                os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))
        elif op == "rename":
            f.rename(f.parent / f"r{n}")
        elif op == "move":
            f.rename(d / f"m{n}")
        elif op == "unlink":
            f.unlink()
        elif op == "chmod":
            os.chmod(f, 0o600 | (n & 0o155))
        elif op == "xattr":
            try:
                os.setxattr(f, "user.k", str(n % 2).encode())
            except OSError:
                pass
        elif op == "link":
            os.link(f, d / f"l{n}")


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_cached_snapshots_equal_uncached_walks(tmp_path_factory: pytest.TempPathFactory,
                                               monkeypatch: pytest.MonkeyPatch,
                                               ops: list[tuple[str, int, int]]) -> None:
    monkeypatch.setattr(snapshot_mod, "trust_horizon_ns", lambda: 1 << 62)
    base = tmp_path_factory.mktemp("prop")
    s = Store(base / "store", chunk_size=CS)
    src = base / "src"
    deep_tree(src)
    run_snapshot(s, src)
    r = run_snapshot(s, src)
    assert r.dirs_cached == DIRS
    counter = [0]
    for op, i, j in ops:
        _next_tick()
        _apply(src, op, i, j, counter)
        r = run_snapshot(s, src)
        assert r.ref == compute_ref(src, chunk_size=CS), (op, counter[0])
    s.close()


def test_a_store_of_an_older_schema_gets_the_table(tmp_path: Path) -> None:
    s = Store(tmp_path / "store", chunk_size=CS)
    s.conn.execute("DROP TABLE dirs_cache")
    s.conn.execute("UPDATE config SET value='1' WHERE key='schema_version'")
    s.close()
    s = Store(tmp_path / "store")
    src = tmp_path / "src"
    deep_tree(src)
    r = run_snapshot(s, src)
    assert r.ref == compute_ref(src, chunk_size=CS)
    assert s.config_value("schema_version") == str(schema.SCHEMA_VERSION)
    assert s.conn.execute("SELECT COUNT(*) FROM dirs_cache").fetchone() is not None
