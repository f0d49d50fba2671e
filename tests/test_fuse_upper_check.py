"""The upper layer's check (``fusefs.upper.check``) names every broken invariant.

A real mount makes an upper with one of everything (new and copied-up inodes, whiteouts, an
opaque directory, a renamed lower directory, xattrs, hard links, partial copy-up), then is
unmounted cleanly; the check must find nothing. Then, for each invariant documented in
``fusefs.upper``'s docstring, a copy of that state directory is broken by hand and the check
must report the invariant by its name.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
from collections.abc import Callable
from pathlib import Path

import fusehelpers as fh
import pytest

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


def documented_invariants() -> list[str]:
    import fusefs.upper

    doc = fusefs.upper.__doc__ or ""
    return re.findall(r"^- \[([a-z-]+)\]", doc, re.M)


def db(state: Path) -> sqlite3.Connection:
    return sqlite3.connect(state / "upper.sqlite", isolation_level=None)


def one(c: sqlite3.Connection, sql: str, *args: object) -> object:
    row = c.execute(sql, args).fetchone()
    assert row is not None, f"no row for {sql}"
    return row[0]


def data_files(state: Path) -> list[Path]:
    return sorted(p for p in (state / "data").rglob("*") if p.is_file())


# Each breaker damages a copy of a sound state directory in one way.
def break_meta(s: Path) -> None:
    db(s).execute("DELETE FROM meta WHERE key='next_cookie'")


def break_root(s: Path) -> None:
    c = db(s)
    other = one(c, "SELECT ino FROM inodes WHERE kind=1 AND ino<>1")
    c.execute("UPDATE inodes SET parent=? WHERE ino=1", (other,))


def break_ino_range(s: Path) -> None:
    db(s).execute("UPDATE meta SET value='2' WHERE key='next_ino'")


def break_kind_fields(s: Path) -> None:
    c = db(s)
    ino = one(c, "SELECT ino FROM inodes WHERE kind=2")
    c.execute("UPDATE inodes SET target=x'41' WHERE ino=?", (ino,))


def break_dentry_parent(s: Path) -> None:
    c = db(s)
    ino = one(c, "SELECT ino FROM dentries WHERE ino<>0")
    c.execute("INSERT INTO dentries(parent, name, ino, cookie) VALUES (987654, x'6f', ?, 1)",
              (ino,))


def break_dentry_target(s: Path) -> None:
    c = db(s)
    cookie = int(one(c, "SELECT value FROM meta WHERE key='next_cookie'"))
    c.execute("INSERT INTO dentries(parent, name, ino, cookie) VALUES (1, x'67686f7374', "
              "123456789, ?)", (cookie - 1 if cookie > 1 else 1,))


def break_whiteout_lower(s: Path) -> None:
    c = db(s)
    opaque = one(c, "SELECT ino FROM inodes WHERE kind=1 AND lower_tree IS NULL AND nlink>0")
    c.execute("INSERT INTO dentries(parent, name, ino, cookie) VALUES (?, x'7768', 0, 0)",
              (opaque,))


def break_dir_one_name(s: Path) -> None:
    c = db(s)
    parent, ino = c.execute("SELECT d.parent, d.ino FROM dentries d JOIN inodes i "
                            "ON i.ino=d.ino WHERE i.kind=1").fetchone()
    c.execute("INSERT INTO dentries(parent, name, ino, cookie) VALUES (?, x'74776963', ?, 0)",
              (parent, ino))


def break_dir_reachable(s: Path) -> None:
    c = db(s)
    a, b = [r[0] for r in c.execute("SELECT ino FROM inodes WHERE kind=1 AND ino<>1 "
                                    "AND nlink>0 LIMIT 2")]
    c.execute("UPDATE inodes SET parent=? WHERE ino=?", (b, a))
    c.execute("UPDATE inodes SET parent=? WHERE ino=?", (a, b))


def break_closure(s: Path) -> None:
    c = db(s)
    ino, origin = c.execute("SELECT ino, origin FROM inodes WHERE kind<>1 AND nlink>0 "
                            "AND substr(origin, 1, 1)=x'70'").fetchone()
    # the lower identity now names a directory (inode 999999) that has no row
    c.execute("UPDATE inodes SET origin=? WHERE ino=?",
              (origin[:1] + (999999).to_bytes(8, "little") + origin[9:], ino))


def break_nlink_file(s: Path) -> None:
    c = db(s)
    ino = one(c, "SELECT ino FROM inodes WHERE kind=2 AND nlink>0")
    c.execute("UPDATE inodes SET nlink=nlink+1 WHERE ino=?", (ino,))


def break_nlink_dir(s: Path) -> None:
    c = db(s)
    ino = one(c, "SELECT ino FROM inodes WHERE kind=1 AND lower_tree IS NULL AND nlink>0")
    c.execute("UPDATE inodes SET nlink=nlink+3 WHERE ino=?", (ino,))


def break_cookie(s: Path) -> None:
    c = db(s)
    rows = c.execute("SELECT parent, name, cookie FROM dentries WHERE ino<>0 LIMIT 2").fetchall()
    c.execute("UPDATE dentries SET cookie=? WHERE parent=? AND name=?",
              (rows[0][2], rows[1][0], rows[1][1]))


def break_xattr_owner(s: Path) -> None:
    db(s).execute("INSERT INTO xattrs(ino, name, value) VALUES (55555555, x'757365722e78', x'31')")


def break_data_owner(s: Path) -> None:
    p = s / "data" / f"{4242 & 0xFF:02x}" / "4242"
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(b"orphan")


def break_data_size(s: Path) -> None:
    c = db(s)
    files = data_files(s)
    assert files, "the sound state has no data file"
    ino = int(files[0].name)
    size = one(c, "SELECT size FROM inodes WHERE ino=?", ino)
    with open(files[0], "ab") as f:
        f.truncate(int(str(size)) + 10)


def break_inline(s: Path) -> None:
    c = db(s)
    ino = one(c, "SELECT ino FROM inodes WHERE kind=2 AND lower_len>0")
    c.execute("UPDATE inodes SET inline=x'41' WHERE ino=?", (ino,))


def break_present_range(s: Path) -> None:
    c = db(s)
    ino = one(c, "SELECT ino FROM inodes WHERE kind=2 AND lower_len=0")
    c.execute("UPDATE inodes SET present=x'ff' WHERE ino=?", (ino,))


def break_origin_unique(s: Path) -> None:
    c = db(s)
    rows = c.execute("SELECT ino, origin FROM inodes WHERE origin IS NOT NULL LIMIT 2").fetchall()
    c.execute("UPDATE inodes SET origin=? WHERE ino=?", (rows[0][1], rows[1][0]))


BREAKERS: dict[str, Callable[[Path], None]] = {
    "meta": break_meta, "root": break_root, "ino-range": break_ino_range,
    "kind-fields": break_kind_fields, "dentry-parent": break_dentry_parent,
    "dentry-target": break_dentry_target, "whiteout-lower": break_whiteout_lower,
    "dir-one-name": break_dir_one_name, "dir-reachable": break_dir_reachable,
    "closure": break_closure,
    "nlink-file": break_nlink_file, "nlink-dir": break_nlink_dir, "cookie": break_cookie,
    "xattr-owner": break_xattr_owner, "inline": break_inline, "data-owner": break_data_owner,
    "data-size": break_data_size, "present-range": break_present_range,
    "origin-unique": break_origin_unique,
}


@pytest.fixture(scope="module")
def sound_state(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(store dir, state dir) of an upper made through a real mount, cleanly unmounted."""
    base = tmp_path_factory.mktemp("upper-check")
    store = base / "store"
    src = base / "src"
    fh.build_lower(src)
    ref = fh.snapshot(store, src)
    m = fh.Mounter(base / "mounts", store)
    m.base.mkdir()
    try:
        d = m.rw(ref)
        mnt = d.mnt
        os.mkdir(mnt / "newdir")
        os.mkdir(mnt / "newdir" / "nested")
        (mnt / "newdir" / "f").write_bytes(b"new file\n")
        (mnt / "newdir" / "g").write_bytes(b"another\n")
        (mnt / "newdir" / "large").write_bytes(fh.pattern(300_000))  # too big to be inline
        os.link(mnt / "newdir" / "f", mnt / "newdir" / "f2")
        os.setxattr(mnt / "newdir" / "f", "user.k", b"v")
        os.chmod(mnt / "plain.txt", 0o600)
        os.chmod(mnt / "exec.sh", 0o700)
        os.unlink(mnt / "ro.txt")  # a whiteout
        subprocess.run(["rm", "-rf", str(mnt / "dir" / "sub")], check=True)
        os.mkdir(mnt / "dir" / "sub")  # an opaque directory over a removed lower one
        os.rename(mnt / "dir", mnt / "moved")
        with open(mnt / "big.bin", "r+b") as f:  # partial copy-up
            f.seek(1_100_000)
            f.write(b"XYZ")
        os.symlink("moved", mnt / "sl")
        m.unmount(d)
        assert d.state is not None
        return store, d.state
    finally:
        m.teardown(failed=False)


def test_sound_upper_passes(sound_state: tuple[Path, Path]) -> None:
    store, state = sound_state
    assert fh.upper_problems(state, store) == []
    assert fh.upper_problems(state) == []


def test_every_documented_invariant_has_a_breaker() -> None:
    assert sorted(documented_invariants()) == sorted(BREAKERS)


@pytest.mark.parametrize("name", sorted(BREAKERS))
def test_check_names_the_broken_invariant(sound_state: tuple[Path, Path], tmp_path: Path,
                                          name: str) -> None:
    store, state = sound_state
    broken = tmp_path / "state"
    subprocess.run(["cp", "-a", str(state), str(broken)], check=True)
    (broken / "lock").unlink(missing_ok=True)
    BREAKERS[name](broken)
    found = fh.upper_problems(broken, store)
    names = {re.match(r"\[([a-z-]+)\]", p).group(1) for p in found}  # type: ignore[union-attr]
    assert name in names, found
