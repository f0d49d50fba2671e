"""The kernel's caches on a real mount: directory listings and file pages the kernel keeps
(with the patched pyfuse3, ``scripts/pyfuse3/``) are never stale after a restore or a
checkpoint, changes made through the mount show at once, and the requests the kernel then
answers itself no longer reach the daemon. The binding in use is reported by ``status``.
Tests that count requests only hold with the patched binding and are skipped on stock.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import fusehelpers as fh
import pytest
from ckpt_support import cli, client

from fusefs import binding

pytestmark = pytest.mark.skipif(fh.SELFTEST, reason="needs real mounts")

patched_only = pytest.mark.skipif(not binding.EXTENDED,
                                  reason="the stock pyfuse3 cannot cache listings")


# The mount's default (no-open with the patched binding, handles with a stock one) and
# the explicit handle mode.
MODES = [pytest.param([], id="default"), pytest.param(["--open-handles"], id="open-handles")]


def listing(d: Path) -> set[str]:
    return set(os.listdir(d))


def requests(m: Path) -> dict[str, int]:
    return dict(client(m).status()["requests"])


def test_status_names_the_binding_in_use(mounter: fh.Mounter, lower_ref: str) -> None:
    m = mounter.rw(lower_ref).mnt
    st = client(m).status()
    want = os.environ.get("REWINDFS_EXPECT_BINDING") or binding.kind()
    assert st["binding"]["kind"] == want
    assert st["binding"]["listings_cached"] is (want == "patched")
    # no-open mode is the default where the patched binding serves; --open-handles opts out
    assert st["no_open"] is (want == "patched")
    assert st["writers_found_by"] == ("proc_scan" if want == "patched" else "handles")
    st = client(mounter.rw(lower_ref, extra=["--open-handles"]).mnt).status()
    assert st["no_open"] is False and st["writers_found_by"] == "handles"


def test_no_open_is_refused_by_a_stock_binding(mounter: fh.Mounter, fuse_store: Path,
                                               lower_ref: str, tmp_path: Path) -> None:
    mnt = tmp_path / "m"
    mnt.mkdir()
    r = cli(fuse_store, "mount", lower_ref, str(mnt), "--state", str(tmp_path / "s"),
            "--no-open", "--open-handles", check=False)
    assert r.returncode == 2 and "not allowed with" in r.stderr
    if binding.EXTENDED:
        return
    r = cli(fuse_store, "mount", lower_ref, str(mnt), "--state", str(tmp_path / "s"),
            "--no-open", check=False)
    assert r.returncode == 9 and "--no-open needs the patched pyfuse3" in r.stderr
    assert not (tmp_path / "s").exists()


def test_restore_never_leaves_a_stale_listing_or_page(mounter: fh.Mounter,
                                                      lower_ref: str) -> None:
    m = mounter.rw(lower_ref).mnt
    (m / "d" / "deep").mkdir(parents=True)
    for name in ("a", "b"):
        (m / "d" / name).write_bytes(b"first " + name.encode())
    (m / "d" / "deep" / "x").write_bytes(b"x1")
    (m / "page.txt").write_bytes(b"one" * 1000)
    times = {p: os.stat(m / p).st_mtime_ns for p in ("d", "d/deep", "page.txt")}
    first = client(m).checkpoint()["ref"]
    (m / "d" / "a").unlink()
    (m / "d" / "c").write_bytes(b"second c")
    (m / "d" / "deep" / "y").write_bytes(b"y2")
    (m / "page.txt").write_bytes(b"two" * 1000)
    for p, t in times.items():  # same mtimes and sizes: only the contents tell them apart
        os.utime(m / p, ns=(t, t))
    second = client(m).checkpoint()["ref"]

    for _ in range(3):
        # listed twice (the second from the kernel's cache when it keeps listings), and
        # the file read twice (its pages kept)
        for _ in range(2):
            assert listing(m / "d") == {"b", "c", "deep"}
            assert listing(m / "d" / "deep") == {"x", "y"}
            assert (m / "page.txt").read_bytes() == b"two" * 1000
        client(m).restore(first)
        for _ in range(2):
            assert listing(m / "d") == {"a", "b", "deep"}
            assert listing(m / "d" / "deep") == {"x"}
            assert (m / "d" / "a").read_bytes() == b"first a"
            assert (m / "page.txt").read_bytes() == b"one" * 1000
        client(m).restore(second)


def test_cached_listing_follows_every_change_through_the_mount(mounter: fh.Mounter,
                                                               lower_ref: str) -> None:
    m = mounter.rw(lower_ref).mnt
    d, e = m / "d", m / "e"
    d.mkdir()
    e.mkdir()
    (d / "f").write_bytes(b"f")
    assert listing(d) == listing(d) == {"f"}
    (d / "g").write_bytes(b"g")
    assert listing(d) == {"f", "g"}
    os.rename(d / "f", e / "f")
    assert listing(d) == {"g"} and listing(e) == {"f"}
    os.link(e / "f", d / "h")
    os.symlink("g", d / "s")
    os.mkdir(d / "sub")
    assert listing(d) == {"g", "h", "s", "sub"}
    client(m).checkpoint()
    assert listing(d) == {"g", "h", "s", "sub"}
    (d / "g").unlink()
    os.rmdir(d / "sub")
    assert listing(d) == listing(d) == {"h", "s"}


def _make_empty_files(d: Path, names: set[str]) -> set[str]:
    """Create an empty file (mode 0644) for each of ``names`` in ``d``, in name order;
    returns ``names``."""
    for name in sorted(names):
        os.close(os.open(d / name, os.O_CREAT | os.O_WRONLY, 0o644))
    return names


@pytest.mark.parametrize("mode", MODES)
def test_a_listing_read_in_part_across_a_checkpoint_is_not_kept(mounter: fh.Mounter,
                                                                lower_ref: str,
                                                                mode: list[str]) -> None:
    # A checkpoint moves a directory's upper entries into the lower, under other readdir
    # cookies: the listing in progress goes on where it was, and a listing the kernel
    # cached only in part is not kept as the whole.
    m = mounter.rw(lower_ref, extra=mode).mnt
    d = m / "many"
    d.mkdir()
    names = _make_empty_files(d, {f"entry-{i:05d}-named-at-some-length" for i in range(3000)})
    for phase in ("upper entries", "lower entries"):
        with os.scandir(d) as it:
            seen = [next(it).name for _ in range(10)]
            client(m).checkpoint()
            seen += [e.name for e in it]
        assert len(seen) == len(set(seen)) and set(seen) == names, phase
        assert listing(d) == listing(d) == names, phase
        # the second round lists a lower directory with new upper entries beside it
        names |= _make_empty_files(d, {f"new-{i:03d}" for i in range(300)})


@pytest.mark.parametrize("mode", MODES)
def test_two_listings_of_one_directory_across_a_checkpoint(mounter: fh.Mounter,
                                                           lower_ref: str,
                                                           mode: list[str]) -> None:
    # One lister is part way through when a checkpoint moves the directory's entries into
    # the lower, then a second lists it from the start: each sees every entry once (in
    # no-open mode both listings reach the daemon without a handle of their own).
    m = mounter.rw(lower_ref, extra=mode).mnt
    d = m / "many"
    d.mkdir()
    names = _make_empty_files(d, {f"entry-{i:05d}-named-at-some-length" for i in range(3000)})
    for phase in ("upper entries", "lower entries"):
        with os.scandir(d) as first:
            seen = [next(first).name for _ in range(10)]
            client(m).checkpoint()
            with os.scandir(d) as second:
                again = [next(second).name for _ in range(10)]
                seen += [e.name for e in first]
                again += [e.name for e in second]
        for got in (seen, again):
            assert len(got) == len(set(got)) and set(got) == names, phase
        names |= _make_empty_files(d, {f"new-{i:03d}" for i in range(300)})


@patched_only
def test_a_second_listing_and_writes_reach_the_daemon_no_more(mounter: fh.Mounter,
                                                              lower_ref: str) -> None:
    m = mounter.rw(lower_ref).mnt
    os.listdir(m / "dir")
    before = requests(m)
    for _ in range(5):
        os.listdir(m / "dir")
    after = requests(m)
    assert after.get("readdir", 0) == before.get("readdir", 0)
    with open(m / "written.bin", "wb", buffering=0) as f:
        for _ in range(20):
            f.write(b"x" * 100)
    done = requests(m)
    assert done.get("write", 0) - after.get("write", 0) == 20
    assert done.get("getxattr", 0) == after.get("getxattr", 0)  # no security.capability


def _walk(top: Path) -> tuple[int, int]:
    """List every directory under ``top``, lstat every entry and read every file, as
    ``git status`` or ``grep -r`` do; returns (directories below ``top``, files)."""
    dirs = files = 0
    for path, subdirs, names in os.walk(top):
        for name in subdirs + names:
            os.lstat(os.path.join(path, name))
        for name in names:
            with open(os.path.join(path, name), "rb") as f:
                f.read()
        dirs += len(subdirs)
        files += len(names)
    return dirs, files


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


# The requests a mount with handles (--open-handles) sends for every open and close, cached
# or not.
HANDLE_OPS = {"open", "release", "opendir", "releasedir", "flush"}


@patched_only
@pytest.mark.parametrize("mode", MODES)
def test_a_walk_of_a_tree_reaches_the_daemon_no_more_from_its_third_time(
        mounter: fh.Mounter, fuse_store: Path, tmp_path: Path, mode: list[str]) -> None:
    """The entries, attributes (those of READDIRPLUS entries included), listings and pages
    the daemon hands out stay in the kernel: a third walk of a tree sends no request but
    the handle bookkeeping of --open-handles. The second sends at most a GETATTR per
    directory listed and per file read: after fetching a listing or a file's pages the kernel drops the
    atime it holds for them (``fuse_invalidate_atime``, noatime or not), and the next stat
    asks for it."""
    src = tmp_path / "walk-src"
    for i in range(4):
        for j in range(3):
            d = src / "tree" / f"d{i}" / f"e{j}"
            d.mkdir(parents=True)
            for k in range(3):
                (d / f"f{k}.txt").write_bytes(b"%d %d %d\n" % (i, j, k))
        (src / "tree" / f"d{i}" / "top.txt").write_bytes(b"top %d\n" % i)
    m = mounter.rw(fh.snapshot(fuse_store, src), extra=mode).mnt
    counts = [requests(m)]
    for _ in range(3):
        shape = _walk(m / "tree")
        counts.append(requests(m))
    dirs, files = shape
    assert (dirs, files) == (16, 40)
    first, second, third = (_delta(b, a) for a, b in zip(counts, counts[1:], strict=False))
    bookkeeping = {op: n for op, n in first.items() if op in HANDLE_OPS}
    assert first.get("lookup", 0) <= 1 and first.get("getattr", 0) <= 1, first  # "tree"
    assert first.get("read", 0) == files and first.get("readdir", 0) <= 2 * (dirs + 1)
    assert set(second) - HANDLE_OPS <= {"getattr"}, second
    assert second.get("getattr", 0) <= (dirs + 1) + files, second  # "tree" listed too
    assert {op: n for op, n in third.items() if op not in HANDLE_OPS} == {}, third
    if not mode:  # no-open mode: not even the handles
        assert third == {}, third
    else:
        assert {op: n for op, n in third.items() if op in HANDLE_OPS} == bookkeeping


def test_user_xattrs_read_and_other_namespaces_are_unsupported(mounter: fh.Mounter,
                                                                lower_ref: str) -> None:
    m = mounter.rw(lower_ref).mnt
    os.listdir(m)  # the lower entries' inodes made by a listing with attributes
    assert os.listxattr(m / "exec.sh") == ["user.note"]
    assert os.getxattr(m / "exec.sh", "user.note") == b"exec"
    assert os.listxattr(m / "plain.txt") == os.listxattr(m / "ro.txt") == []
    p = m / "plain.txt"
    os.setxattr(p, "user.note", b"kept")
    assert os.getxattr(p, "user.note") == b"kept"
    assert os.listxattr(m / "ro.txt") == []  # an attribute of one file only
    assert os.getxattr(m / "exec.sh", "user.note") == b"exec"
    for name, err in [("security.capability", errno.ENOTSUP), ("security.selinux", errno.ENOTSUP),
                      ("system.posix_acl_access", errno.ENOTSUP), ("trusted.x", errno.ENOTSUP),
                      ("user.absent", errno.ENODATA)]:
        with pytest.raises(OSError) as ei:
            os.getxattr(p, name)
        assert ei.value.errno == err, name
    with pytest.raises(OSError) as ei:
        os.setxattr(p, "security.x", b"1")
    assert ei.value.errno == errno.ENOTSUP


# -- no-open mode (rewindfs mount --no-open) --------------------------------------------------

@patched_only
def test_no_open_mode_reads_writes_and_lists_by_inode(mounter: fh.Mounter,
                                                      lower_ref: str) -> None:
    m = mounter.rw(lower_ref, extra=["--no-open"]).mnt
    st = client(m).status()
    assert st["no_open"] is True
    before = requests(m)
    assert (m / "plain.txt").read_bytes() == b"hello world\n"
    assert (m / "big.bin").read_bytes()[:4] == (m / "big.bin").read_bytes()[:4]
    with open(m / "plain.txt", "r+b") as f:  # opened, written, fsynced without a handle
        f.seek(6)
        f.write(b"there")
        f.flush()
        os.fsync(f.fileno())
    assert (m / "plain.txt").read_bytes() == b"hello there\n"
    with open(m / "plain.txt", "ab") as f:
        f.write(b"appended\n")
    assert (m / "plain.txt").read_bytes() == b"hello there\nappended\n"
    with open(m / "plain.txt", "wb") as f:  # O_TRUNC reaches the daemon as a SETATTR
        f.write(b"short\n")
    assert (m / "plain.txt").read_bytes() == b"short\n"
    (m / "made.txt").write_bytes(b"made\n")
    # the kernel sends no RELEASE here, not even for a created file: no handle is kept
    assert client(m).status()["open_handles"] == 0
    assert listing(m / "dir") == listing(m / "dir")
    assert "made.txt" in listing(m)
    after = requests(m)
    for op in ("open", "opendir"):  # one ENOSYS each, then the kernel stops asking
        assert after.get(op, 0) - before.get(op, 0) <= 1
    assert after.get("releasedir", 0) == before.get("releasedir", 0)
    client(m).checkpoint()
    assert (m / "plain.txt").read_bytes() == b"short\n"


@patched_only
def test_no_open_mode_restore_shows_the_target_at_once(mounter: fh.Mounter,
                                                       lower_ref: str) -> None:
    m = mounter.rw(lower_ref, extra=["--no-open"]).mnt
    (m / "d").mkdir()
    (m / "d" / "a").write_bytes(b"a1")
    first = client(m).checkpoint()["ref"]
    (m / "d" / "b").write_bytes(b"b2")
    (m / "d" / "a").write_bytes(b"a2")
    assert listing(m / "d") == listing(m / "d") == {"a", "b"}
    keep = open(m / "d" / "a", "rb")  # noqa: SIM115 - held across the restore
    try:
        st = client(m).status()
        assert st["open_writers"] == 0 and st["writers_found_by"] == "proc_scan"
        # a reader is no writer (the /proc scan tells them apart): no wait
        client(m).restore(first, wait_writers=60)
        assert listing(m / "d") == {"a"}
        assert (m / "d" / "a").read_bytes() == b"a1"
        assert keep.read() == b"a2"  # the old inode, detached, still reads
    finally:
        keep.close()


@patched_only
def test_no_open_mode_clears_setuid_bits_itself_without_a_getattr_per_chown(
        mounter: fh.Mounter, lower_ref: str) -> None:
    """FUSE_HANDLE_KILLPRIV_V2 (added to the INIT reply by the binding): the kernel sends a
    chown without first asking for the mode it would clear, and the daemon clears
    S_ISUID, and S_ISGID of a group-executable file, as the kernel did before
    (tests/test_fuse_perms.py covers an unprivileged writer's write and truncate,
    tests/test_fuse_ops.py that root's keep the bits)."""
    import pyfuse3

    d = mounter.rw(lower_ref)
    m = d.mnt
    offered, added = client(m).status()["binding"]["init_flags"]
    assert added == pyfuse3.INIT_HANDLE_KILLPRIV_V2 and offered & added == added
    for name, mode in (("gx", 0o6775), ("nogx", 0o6745), ("sgid", 0o2644)):
        (m / name).write_bytes(b"x")
        os.chmod(m / name, mode)
    os.chmod(m / "dir", 0o2755)
    for name in ("gx", "nogx", "sgid", "dir"):
        os.stat(m / name)  # the kernel now holds every attribute
    before = requests(m)
    for name in ("gx", "nogx", "sgid", "dir"):
        os.chown(m / name, 1000, 1000)
    after = requests(m)
    assert after.get("getattr", 0) == before.get("getattr", 0)
    assert after.get("setattr", 0) - before.get("setattr", 0) == 4
    want = {"gx": 0o0775, "nogx": 0o2745, "sgid": 0o2644, "dir": 0o2755}

    def modes() -> dict[str, int]:
        return {n: os.stat(m / n).st_mode & 0o7777 for n in want}

    assert modes() == want
    client(m).checkpoint()
    mounter.remount(d)
    assert modes() == want


# Asks the mount for a user attribute that does not exist, as fast as it can, until a file
# outside the mount appears: every call is a GETXATTR the kernel cannot answer itself. Says
# "streaming" once its first one was answered, and at the end how many it made.
_GETXATTR_STREAM = """
import errno, os, sys
path, stop, n = sys.argv[1], sys.argv[2], 0
while n % 64 or not os.path.exists(stop):
    try:
        os.getxattr(path, "user.absent")
    except OSError as e:
        if e.errno != errno.ENODATA:
            sys.exit(f"getxattr: {e}")
    n += 1
    if n == 1:
        print("streaming", flush=True)
print(n)
"""


def test_a_stream_of_requests_leaves_fsync_and_checkpoints_served(
        mounter: fh.Mounter, lower_ref: str, tmp_path: Path) -> None:
    """The binding reads queued requests without a round through the event loop
    (``eager_requests``), but a steady stream of them from three processes still lets the
    daemon's other work run: an fsync finishes in its worker thread and is durable, a
    checkpoint and status are answered, and every request of the stream is answered
    right."""
    d = mounter.rw(lower_ref)
    m = d.mnt
    (m / "target").write_bytes(b"t")
    stop = tmp_path / "stop"
    streams = [subprocess.Popen([sys.executable, "-c", _GETXATTR_STREAM, str(m / "target"),
                                 str(stop)], stdout=subprocess.PIPE, text=True)
               for _ in range(3)]
    try:
        for p in streams:  # all three flow from here until ``stop``
            assert p.stdout is not None and p.stdout.readline() == "streaming\n"
        with open(m / "synced.bin", "wb") as f:
            f.write(b"durable" * 1000)
            f.flush()
            os.fsync(f.fileno())
        ref = client(m).checkpoint(label="under load")["ref"]
    finally:
        stop.touch()
        outs = [p.communicate(timeout=60) for p in streams]
    assert [p.returncode for p in streams] == [0, 0, 0], outs
    assert all(int(out) > 0 for out, _ in outs)
    d = mounter.remount(d)
    assert (d.mnt / "synced.bin").read_bytes() == b"durable" * 1000
    (d.mnt / "synced.bin").write_bytes(b"changed")
    client(d.mnt).restore(ref)
    assert (d.mnt / "synced.bin").read_bytes() == b"durable" * 1000


@patched_only
def test_no_open_mode_makes_files_without_a_release_per_file(mounter: fh.Mounter,
                                                             lower_ref: str) -> None:
    """In no-open mode CREATE answers ENOSYS: the kernel makes new files with MKNOD and
    opens them itself, so closing one sends no RELEASE. open(2) keeps its meaning: the
    mode under the umask, O_EXCL, O_CREAT of an existing file (not truncated) and O_TRUNC."""
    d = mounter.rw(lower_ref)
    m = d.mnt
    before = requests(m)
    old = os.umask(0o027)
    try:
        for i in range(10):
            fd = os.open(m / f"new{i}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            os.write(fd, b"made %d" % i)
            os.close(fd)
    finally:
        os.umask(old)
    after = requests(m)
    assert after.get("create", 0) - before.get("create", 0) <= 1  # only the first asks
    assert after.get("mknod", 0) - before.get("mknod", 0) >= 9
    assert after.get("release", 0) == before.get("release", 0)
    assert [os.stat(m / f"new{i}").st_mode & 0o7777 for i in range(10)] == [0o640] * 10
    assert fh.errno_of(os.open, m / "new0", os.O_WRONLY | os.O_CREAT | os.O_EXCL) \
        == errno.EEXIST
    fd = os.open(m / "new1", os.O_RDWR | os.O_CREAT, 0o600)  # exists: opened as it is
    assert os.read(fd, 100) == b"made 1"
    os.close(fd)
    os.close(os.open(m / "new2", os.O_WRONLY | os.O_CREAT | os.O_TRUNC))
    assert (m / "new2").read_bytes() == b""
    d = mounter.remount(d)
    assert [(d.mnt / f"new{i}").read_bytes() for i in (0, 1, 2, 9)] == \
        [b"made 0", b"made 1", b"", b"made 9"]
