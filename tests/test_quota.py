"""Per-session quotas (issue 14 point 4): caps on the upper's content bytes and inodes.

On real mounts: a 10 MiB cap refuses the 11th MiB with EDQUOT, a write straddling the cap is
short, the session keeps working once a delete frees space, a checkpoint empties the upper
(so its use drops), an inode cap refuses creates with EDQUOT, ``status`` shows use against
the caps (JSON and text), and a remount keeps the caps recorded in the state directory.
Without a mount: the in-memory counters the overlay keeps on each request equal a count
from scratch after every kind of change.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli, client, overlay_env
from test_overlay import CS, Env, node

from fusefs.checkpoint import checkpoint_overlay
from fusefs.inodes import ROOT_INO
from fusefs.overlay import Overlay, held_bytes

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


def write_mib(path: Path, n: int, flags: int = os.O_CREAT | os.O_WRONLY) -> int:
    """Write ``n`` MiB to ``path`` in 1 MiB calls; return the bytes written. The first call
    that fails raises its OSError."""
    fd = os.open(path, flags, 0o644)
    done = 0
    try:
        for _ in range(n):
            got = os.write(fd, b"x" * MIB)
            done += got
            if got < MIB:
                break
    finally:
        os.close(fd)
    return done


needs_mount = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")


@needs_mount
def test_byte_quota_refuses_the_11th_mib(mounter: fh.Mounter, fuse_store: Path,
                                         lower_ref: str) -> None:
    d = mounter.rw(lower_ref, extra=["--quota-bytes", "10M"])
    m = d.mnt
    assert write_mib(m / "ten.bin", 10) == 10 * MIB
    with pytest.raises(OSError) as e:
        write_mib(m / "ten.bin", 1, os.O_WRONLY | os.O_APPEND)
    assert e.value.errno == errno.EDQUOT
    with pytest.raises(OSError) as e:  # a truncate that would grow the upper past the cap
        os.truncate(m / "ten.bin", 11 * MIB)
    assert e.value.errno == errno.EDQUOT
    st = client(m).status()
    assert st["quota"] == {"bytes_used": 10 * MIB, "bytes_cap": 10 * MIB,
                           "inodes_used": 1, "inodes_cap": None}
    text = cli(fuse_store, "status", str(m)).stdout
    assert "quota:     10,485,760 bytes of 10,485,760, 1 inodes (no cap)" in text

    # a delete frees the space: the session keeps working, and a write straddling the cap
    # is cut short there
    (m / "ten.bin").unlink()
    assert write_mib(m / "nine.bin", 9) == 9 * MIB
    fd = os.open(m / "nine.bin", os.O_WRONLY | os.O_APPEND)
    try:
        assert os.write(fd, b"y" * (2 * MIB)) == MIB
    finally:
        os.close(fd)
    assert os.path.getsize(m / "nine.bin") == 10 * MIB
    # overwriting what the upper already holds is no growth
    fd = os.open(m / "nine.bin", os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"z" * MIB, 0) == MIB
    finally:
        os.close(fd)

    # a checkpoint freezes the upper into the store: it is empty again, the use drops
    client(m).checkpoint()
    assert client(m).status()["quota"]["bytes_used"] == 0
    assert write_mib(m / "after.bin", 10) == 10 * MIB

    # the cap is recorded in the state directory: a remount without the flag keeps it
    mounter.remount(d)
    assert client(m).status()["quota"]["bytes_cap"] == 10 * MIB
    with pytest.raises(OSError) as e:
        write_mib(m / "more.bin", 1)
    assert e.value.errno == errno.EDQUOT


@needs_mount
def test_inode_quota_refuses_creates(mounter: fh.Mounter, fuse_store: Path,
                                     lower_ref: str) -> None:
    m = mounter.rw(lower_ref, extra=["--quota-inodes", "5"]).mnt
    for i in range(5):
        (m / f"f{i}").write_text("x")
    for make in (lambda: (m / "f5").write_text("x"), lambda: (m / "d").mkdir(),
                 lambda: os.symlink("f0", m / "s"), lambda: os.mkfifo(m / "p")):
        with pytest.raises(OSError) as e:
            make()
        assert e.value.errno == errno.EDQUOT
    out = json.loads(cli(fuse_store, "status", str(m), "--json").stdout)
    assert out["quota"]["inodes_used"] == 5 and out["quota"]["inodes_cap"] == 5
    (m / "f0").unlink()
    (m / "d").mkdir()  # room again after a delete
    assert (m / "d").is_dir()


@needs_mount
def test_bad_quota_arguments_are_usage_errors(mounter: fh.Mounter, fuse_store: Path,
                                              lower_ref: str, tmp_path: Path) -> None:
    for bad in (["--quota-bytes", "lots"], ["--quota-inodes", "-1"]):
        r = cli(fuse_store, "mount", lower_ref, str(tmp_path / "m"), "--state",
                str(tmp_path / "s"), *bad, check=False)
        assert r.returncode == 2, r.stderr
    r = cli(fuse_store, "mount", "--ro", lower_ref, str(tmp_path / "m"), "--quota-bytes",
            "1M", check=False)
    assert r.returncode == 2 and "--state" in r.stderr


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    yield from overlay_env(Env(tmp_path), check_state=False)


def _check_counts(ov: Overlay) -> None:
    used_b, used_i = ov.used_bytes, ov.used_inodes
    ov.recount()
    assert (ov.used_bytes, ov.used_inodes) == (used_b, used_i)


def test_counters_follow_every_change(env: Env) -> None:
    ov = env.mount()
    assert ov.used_bytes == 0 and ov.used_inodes == 0
    fh_, n = ov.create(ROOT_INO, b"new.bin", 0o644, os.O_RDWR, 0, 0)
    ov.write(fh_, 0, b"a" * 100)  # inline
    assert ov.used_bytes == 100 and ov.used_inodes == 1
    ov.write(fh_, 0, b"b" * (3 * CS + 5))  # spilled to a data file
    assert ov.used_bytes == 3 * CS + 5 == held_bytes(n, CS)
    _check_counts(ov)
    ov.setattr(n.ino, size=CS)
    assert ov.used_bytes == CS
    ov.write(fh_, 10 * CS, b"c")  # a hole past the end counts (the size grows)
    assert ov.used_bytes == 10 * CS + 1
    _check_counts(ov)
    # a lower file: its copy-up costs an inode row, each chunk written into it its length
    big = node(ov, "big.bin")
    size = big.size
    fh2 = ov.open(big.ino, os.O_RDWR)
    ov.write(fh2, 1, b"z")
    assert ov.used_bytes == 10 * CS + 1 + min(CS, size)
    _check_counts(ov)
    ov.release(fh2)
    # an unlinked file still open counts until it is closed and forgotten
    ov.unlink(ROOT_INO, b"new.bin")
    assert ov.used_bytes == 10 * CS + 1 + min(CS, size)
    ov.release(fh_)
    ov.forget(n.ino, n.nlookup)
    assert ov.used_bytes == min(CS, size)
    _check_counts(ov)
    ov.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    _check_counts(ov)
    checkpoint_overlay(ov, origin="checkpoint")
    assert ov.used_bytes == 0 and ov.used_inodes == 0
    _check_counts(ov)


def test_xattr_bytes_follow_every_change(env: Env) -> None:
    """xattr bytes count from a copy-up on, through set, replace, remove, unlink and a
    checkpoint, as a count from scratch finds them; the cap refuses a set past it."""
    ov = env.mount()
    big = node(ov, "big.bin")
    ov.setxattr(big.ino, b"user.a", b"1" * 100)   # a copy-up: the row and the value
    assert ov.used_bytes == len(b"user.a") + 100
    _check_counts(ov)
    ov.setxattr(big.ino, b"user.a", b"2" * 10)    # replaced
    ov.setxattr(ROOT_INO, b"user.r", b"r" * 7)     # the root's row holds them too
    assert ov.used_bytes == len(b"user.a") + 10 + len(b"user.r") + 7
    _check_counts(ov)
    ov.removexattr(big.ino, b"user.a")
    assert ov.used_bytes == len(b"user.r") + 7
    d = ov.mkdir(ROOT_INO, b"d", 0o755, 0, 0)
    ov.setxattr(d.ino, b"user.d", b"d" * 50)
    _check_counts(ov)
    ov.quota_bytes = ov.used_bytes + 60
    with pytest.raises(OSError) as e:
        ov.setxattr(d.ino, b"user.e", b"e" * 60)
    assert e.value.errno == errno.EDQUOT and b"user.e" not in d.xattrs
    ov.setxattr(d.ino, b"user.e", b"e" * 54)       # exactly to the cap
    assert ov.used_bytes == ov.quota_bytes
    ov.rmdir(ROOT_INO, b"d")
    _check_counts(ov)
    checkpoint_overlay(ov, origin="checkpoint")
    _check_counts(ov)


def test_caps_refuse_in_the_overlay(env: Env) -> None:
    ov = env.mount()
    ov.quota_bytes, ov.quota_inodes = 2 * CS, 2
    fh_, _ = ov.create(ROOT_INO, b"a", 0o644, os.O_RDWR, 0, 0)
    assert ov.write(fh_, 0, b"x" * (3 * CS)) == 2 * CS  # cut short at the cap
    with pytest.raises(OSError) as e:
        ov.write(fh_, 2 * CS, b"x")
    assert e.value.errno == errno.EDQUOT
    ov.create(ROOT_INO, b"b", 0o644, os.O_RDWR, 0, 0)
    with pytest.raises(OSError) as e:
        ov.mkdir(ROOT_INO, b"c", 0o755, 0, 0)
    assert e.value.errno == errno.EDQUOT


@needs_mount
def test_extended_attributes_count_against_the_byte_quota(mounter: fh.Mounter,
                                                          fuse_store: Path,
                                                          lower_ref: str) -> None:
    """The upper holds xattr names and values as it holds content: they count, and a set
    that would pass the cap fails with EDQUOT (400 values of 60,000 bytes went into a full
    10 MiB quota before)."""
    m = mounter.rw(lower_ref, extra=["--quota-bytes", "1M"]).mnt
    (m / "f").write_text("x")
    value = b"v" * 60_000
    with pytest.raises(OSError) as e:
        for i in range(40):
            os.setxattr(m / "f", f"user.k{i}", value)
    assert e.value.errno == errno.EDQUOT
    assert i == MIB // (60_000 + len("user.k0")) and len(os.listxattr(m / "f")) == i
    with pytest.raises(OSError) as e:  # on a directory and on the root as well
        os.setxattr(m, "user.big", value)
    assert e.value.errno == errno.EDQUOT
    q = json.loads(cli(fuse_store, "status", str(m), "--json").stdout)["quota"]
    assert MIB - 60_000 < q["bytes_used"] <= MIB
    os.removexattr(m / "f", "user.k0")   # room again after a removal
    os.setxattr(m, "user.small", b"s" * 1000)
    os.unlink(m / "f")
    os.mkdir(m / "d")
    os.setxattr(m / "d", "user.big", value)
    q = json.loads(cli(fuse_store, "status", str(m), "--json").stdout)["quota"]
    assert q["bytes_used"] == len("user.small") + 1000 + len("user.big") + 60_000


@needs_mount
def test_session_quota_is_kept_by_resume(tmp_path: Path) -> None:
    st = tmp_path / "store"
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "f.txt").write_text("seed\n")
    seed = json.loads(cli(st, "snapshot", str(tmp_path / "p"), "--json").stdout)["ref"]
    r = cli(st, "session", "new", "--no-fuse", "--seed", seed, "--quota-bytes", "1M",
            check=False)
    assert r.returncode == 2 and "--no-fuse" in r.stderr
    s = json.loads(cli(st, "session", "new", "--seed", seed, "--base", str(tmp_path / "ws"),
                       "--quota-bytes", "2M", "--quota-inodes", "10", "--json").stdout)
    try:
        root = Path(s["root"])
        assert write_mib(root / "a.bin", 2) == 2 * MIB
        with pytest.raises(OSError) as e:
            write_mib(root / "b.bin", 1)
        assert e.value.errno == errno.EDQUOT
        cli(st, "session", "shutdown", s["id"])
        cli(st, "session", "resume", s["id"])
        with pytest.raises(OSError) as e:
            write_mib(root / "b.bin", 1)
        assert e.value.errno == errno.EDQUOT
        q = json.loads(cli(st, "status", str(root), "--json").stdout)["quota"]
        assert q["bytes_cap"] == 2 * MIB and q["inodes_cap"] == 10
        assert q["bytes_used"] == 2 * MIB
        (root / "a.bin").unlink()
        assert write_mib(root / "b.bin", 1) == MIB
    finally:
        cli(st, "session", "shutdown", s["id"], "--force", check=False)


def test_quotas_are_refused_on_the_automatic_no_fuse_fallback(tmp_path: Path) -> None:
    """A user who cannot open /dev/fuse gets the no-FUSE fallback without asking for it:
    a quota there is refused like an exclude pattern (exit 10, nothing started) instead
    of being accepted and never enforced; without one the session starts on the fallback."""
    from test_mainjob import without_dev_fuse

    prefix = without_dev_fuse(tmp_path)
    st = tmp_path / "store"
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "f.txt").write_text("seed\n")
    seed = json.loads(cli(st, "snapshot", str(tmp_path / "p"), "--json").stdout)["ref"]

    started: list[str] = []

    def new(*extra: str) -> subprocess.CompletedProcess[str]:
        r = subprocess.run([*prefix, sys.executable, "-m", "rewindfs", "--store", str(st),
                            "session", "new", "--seed", seed, "--base", str(tmp_path / "ws"),
                            "--json", *extra], capture_output=True, text=True, cwd=REPO)
        if r.returncode == 0:
            started.append(json.loads(r.stdout)["id"])
        return r

    try:
        for extra, option in ((("--quota-bytes", "10M"), "quota_bytes"),
                              (("--quota-inodes", "100"), "quota_inodes"),
                              (("--exclude", "node_modules/"), "exclude")):
            r = new(*extra)
            assert r.returncode == 10, (extra, r.stdout, r.stderr)
            assert f"{option} needs a FUSE session: the no-FUSE fallback" in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert not (st / "sessions").exists() or not list((st / "sessions").iterdir())
        r = new()
        assert r.returncode == 0, r.stderr
        root = json.loads(r.stdout)["root"]
        assert not os.path.ismount(root)  # the fallback: a plain directory
        assert (Path(root) / "f.txt").read_text() == "seed\n"
    finally:
        for sid in started:
            cli(st, "session", "shutdown", sid, "--force", check=False)
