"""Real programs inside a read-write session mount: git, editors' atomic saves, lockfiles,
sqlite3 shared by two processes, ``python -m venv`` + ``pip install``.

Each test mounts its own session over the standard lower tree and runs the programs in
child processes (never in the process serving the mount).
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fusehelpers as fh
import pytest

GIT_ENV = {
    "GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "Test", "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "LC_ALL": "C",
}


def git(repo: Path, *args: str) -> str:
    env = dict(os.environ, **GIT_ENV)
    r = subprocess.run(["git", "-c", "init.defaultBranch=main", "-c", "gc.auto=0", *args],
                       cwd=repo, env=env, capture_output=True, text=True)
    assert r.returncode == 0, f"git {' '.join(args)}: {r.stderr}"
    return r.stdout


def index_stat_data(repo: Path) -> dict[str, dict[str, str]]:
    """``git ls-files --debug``: per path the stat data git keeps in its index."""
    out: dict[str, dict[str, str]] = {}
    cur = ""
    for line in git(repo, "ls-files", "--debug").splitlines():
        if not line.startswith(" "):
            cur = line
            out[cur] = {}
            continue
        for k, v in re.findall(r"(\w+):\s*(\S+)", line):
            out[cur][k] = v
    return out


def file_stat_data(repo: Path, paths: list[str]) -> dict[str, tuple[int, ...]]:
    res = {}
    for p in paths:
        s = os.lstat(repo / p)
        res[p] = (s.st_ino, s.st_ctime_ns, s.st_mtime_ns, s.st_size, s.st_uid, s.st_gid,
                  s.st_mode)
    return res


def test_git_workflow_and_clean_status_after_remount(mounter: fh.Mounter,
                                                     lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    repo = d.mnt / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "src" / "pkg").mkdir(parents=True)
    for i in range(40):
        (repo / "src" / "pkg" / f"m{i}.py").write_text(f"VALUE = {i}\n" * (i + 1))
    (repo / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(repo / "run.sh", 0o755)
    os.symlink("src/pkg/m1.py", repo / "link")
    (repo / "README").write_text("readme\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "first")
    assert git(repo, "status", "--porcelain") == ""

    git(repo, "checkout", "-q", "-b", "feature")
    (repo / "README").write_text("feature readme\n")
    (repo / "src" / "pkg" / "m3.py").unlink()
    (repo / "src" / "new.py").write_text("new\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "feature")
    git(repo, "checkout", "-q", "main")
    assert (repo / "README").read_text() == "readme\n"
    assert (repo / "src" / "pkg" / "m3.py").read_text() == "VALUE = 3\n" * 4
    assert not (repo / "src" / "new.py").exists()
    git(repo, "checkout", "-q", "feature")
    assert (repo / "src" / "new.py").read_text() == "new\n"
    git(repo, "checkout", "-q", "main")
    git(repo, "merge", "-q", "--no-edit", "feature")
    assert (repo / "README").read_text() == "feature readme\n"
    git(repo, "gc", "-q", "--prune=now")
    assert git(repo, "count-objects", "-v").startswith("count: 0\n")
    git(repo, "fsck", "--strict", "--no-progress")
    assert git(repo, "log", "--format=%s").split() == ["feature", "first"]

    # Step past the timestamp granularity of git's racy-clean check, let one status refresh
    # and write the index, then take what git recorded.
    time.sleep(1.1)
    assert git(repo, "status", "--porcelain") == ""
    tracked = git(repo, "ls-files").split()
    idx_before = index_stat_data(repo)
    stat_before = file_stat_data(repo, tracked)
    index_bytes = (repo / ".git" / "index").read_bytes()

    mounter.remount(d)

    assert file_stat_data(repo, tracked) == stat_before
    for path, rec in idx_before.items():
        s = os.lstat(repo / path)
        csec, _, cns = rec["ctime"].partition(":")
        msec, _, mns = rec["mtime"].partition(":")
        assert (int(csec), int(cns)) == divmod(s.st_ctime_ns, 10**9), path
        assert (int(msec), int(mns)) == divmod(s.st_mtime_ns, 10**9), path
        assert int(rec["ino"]) == s.st_ino & 0xFFFFFFFF, path
        assert int(rec["size"]) == s.st_size, path
    assert git(repo, "status", "--porcelain") == ""
    # nothing needed refreshing, so git did not rewrite its index
    assert (repo / ".git" / "index").read_bytes() == index_bytes
    git(repo, "fsck", "--strict", "--no-progress")
    (repo / "README").write_text("changed after remount\n")
    assert git(repo, "status", "--porcelain") == " M README\n"


def test_git_repo_in_lower_snapshot(mounter: fh.Mounter, fuse_store: Path,
                                    tmp_path: Path) -> None:
    """A repository that came from the snapshot works: log, status, commit, gc."""
    src = tmp_path / "src"
    repo_src = src / "repo"
    repo_src.mkdir(parents=True)
    git(repo_src, "init", "-q")
    for i in range(20):
        (repo_src / f"f{i}.txt").write_text(f"{i}\n")
    git(repo_src, "add", "-A")
    git(repo_src, "commit", "-q", "-m", "in lower")
    d = mounter.rw(fh.snapshot(fuse_store, src))
    repo = d.mnt / "repo"
    assert git(repo, "status", "--porcelain") == ""
    (repo / "f3.txt").write_text("changed\n")
    git(repo, "commit", "-q", "-am", "in upper")
    git(repo, "gc", "-q", "--prune=now")
    git(repo, "fsck", "--strict", "--no-progress")
    assert git(repo, "log", "--format=%s").split("\n")[:2] == ["in upper", "in lower"]
    assert git(repo, "status", "--porcelain") == ""


EDITOR = textwrap.dedent("""
    import os, sys
    root, n = sys.argv[1], int(sys.argv[2])
    target = os.path.join(root, "doc.txt")
    for i in range(n):
        tmp = os.path.join(root, ".doc.txt.swp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.write(fd, (f"version {i}\\n" * (i % 50 + 1)).encode())
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, target)
        with open(target, "rb") as f:
            got = f.read()
        if got != (f"version {i}\\n" * (i % 50 + 1)).encode():
            sys.exit(f"iteration {i}: read back {got[:40]!r}")
""")

LOCKER = textwrap.dedent("""
    import errno, os, sys, time
    root, n = sys.argv[1], int(sys.argv[2])
    lock, target = os.path.join(root, "counter.lock"), os.path.join(root, "counter")
    done = 0
    while done < n:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            time.sleep(0.0005)
            continue
        with open(target, "rb") as f:
            value = int(f.read() or b"0")
        os.write(fd, b"%d" % (value + 1))
        os.close(fd)
        os.rename(lock, target)
        done += 1
""")


def test_editor_atomic_save_1000_times(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "doc.txt").write_bytes(b"original\n")
    subprocess.run([sys.executable, "-c", EDITOR, str(d.mnt), "1000"], check=True, timeout=600)
    assert (d.mnt / "doc.txt").read_bytes() == b"version 999\n" * 50
    assert sorted(os.listdir(d.mnt)).count(".doc.txt.swp") == 0
    mounter.remount(d)
    assert (d.mnt / "doc.txt").read_bytes() == b"version 999\n" * 50


def test_lockfile_loop_1000_times_by_two_processes(mounter: fh.Mounter, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)
    (d.mnt / "counter").write_bytes(b"0")
    procs = [subprocess.Popen([sys.executable, "-c", LOCKER, str(d.mnt), "500"])
             for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=600) == 0
    assert (d.mnt / "counter").read_bytes() == b"1000"
    assert not (d.mnt / "counter.lock").exists()


SQLITE_WORKER = textwrap.dedent("""
    import sqlite3, sys
    db, who, n, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    c = sqlite3.connect(db, timeout=60, isolation_level=None)
    c.execute("PRAGMA busy_timeout=60000")
    c.execute(f"PRAGMA journal_mode={mode}")
    for i in range(n):
        c.execute("BEGIN IMMEDIATE")
        c.execute("INSERT INTO t(who, i, payload) VALUES (?, ?, randomblob(3000))", (who, i))
        (total,) = c.execute("SELECT count(*) FROM t WHERE who=?", (who,)).fetchone()
        if total != i + 1:
            sys.exit(f"{who}: saw {total} own rows after {i + 1} inserts")
        c.execute("COMMIT")
    c.close()
""")


@pytest.mark.parametrize("mode", ["delete", "wal"])
def test_sqlite_shared_by_two_processes(mounter: fh.Mounter, lower_ref: str, mode: str) -> None:
    d = mounter.rw(lower_ref)
    db = d.mnt / "dir" / "app.db"
    c = sqlite3.connect(db)
    c.execute(f"PRAGMA journal_mode={mode}")
    c.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, who TEXT, i INT, payload BLOB)")
    c.commit()
    c.close()
    n = 150
    procs = [subprocess.Popen([sys.executable, "-c", SQLITE_WORKER, str(db), who, str(n), mode])
             for who in ("p1", "p2")]
    for p in procs:
        assert p.wait(timeout=600) == 0

    def check() -> None:
        c = sqlite3.connect(db)
        try:
            assert c.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            assert c.execute("SELECT who, count(*), count(DISTINCT i) FROM t GROUP BY who "
                             "ORDER BY who").fetchall() == [("p1", n, n), ("p2", n, n)]
            assert c.execute("PRAGMA journal_mode").fetchone()[0] == mode
        finally:
            c.close()

    check()
    mounter.remount(d)
    check()


TINY_BACKEND = textwrap.dedent('''
    """A build backend without dependencies, so pip can build offline."""
    import base64, hashlib, os, tarfile, zipfile
    NAME, VERSION = "tinypkg", "1.0"

    def _files():
        for dp, _, fn in os.walk(NAME):
            for f in sorted(fn):
                yield os.path.join(dp, f)

    def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
        name = f"{NAME}-{VERSION}-py3-none-any.whl"
        di = f"{NAME}-{VERSION}.dist-info"
        records = []
        with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
            def add(arc, data):
                z.writestr(arc, data)
                h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                records.append(f"{arc},sha256={h.decode()},{len(data)}")
            for f in _files():
                with open(f, "rb") as fh:
                    add(f, fh.read())
            add(f"{di}/METADATA",
                f"Metadata-Version: 2.1\\nName: {NAME}\\nVersion: {VERSION}\\n".encode())
            add(f"{di}/WHEEL", b"Wheel-Version: 1.0\\nGenerator: tiny\\n"
                b"Root-Is-Purelib: true\\nTag: py3-none-any\\n")
            records.append(f"{di}/RECORD,,")
            z.writestr(f"{di}/RECORD", "\\n".join(records) + "\\n")
        return name

    def build_sdist(sdist_directory, config_settings=None):
        base = f"{NAME}-{VERSION}"
        with tarfile.open(os.path.join(sdist_directory, base + ".tar.gz"), "w:gz") as t:
            for f in ["pyproject.toml", "tiny_backend.py", "PKG-INFO", *_files()]:
                t.add(f, f"{base}/{f}")
        return base + ".tar.gz"
''')


def make_sdist(where: Path) -> Path:
    """Build ``tinypkg-1.0.tar.gz`` (a package with a module and a data file) in ``where``."""
    pkg = where / "tinypkg-src"
    (pkg / "tinypkg").mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(textwrap.dedent("""
        [build-system]
        requires = []
        build-backend = "tiny_backend"
        backend-path = ["."]

        [project]
        name = "tinypkg"
        version = "1.0"
    """))
    (pkg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
    (pkg / "tiny_backend.py").write_text(TINY_BACKEND)
    (pkg / "tinypkg" / "__init__.py").write_text(
        "from pathlib import Path\nVALUE = 42\n"
        "DATA = (Path(__file__).parent / 'data.txt').read_text()\n")
    (pkg / "tinypkg" / "data.txt").write_text("packaged data\n")
    dist = where / "dist"
    dist.mkdir()
    subprocess.run([sys.executable, "-c", f"import tiny_backend; "
                    f"tiny_backend.build_sdist({str(dist)!r})"], cwd=pkg, check=True)
    return dist / "tinypkg-1.0.tar.gz"


def test_venv_and_pip_install_of_local_sdist(mounter: fh.Mounter, lower_ref: str,
                                            tmp_path: Path) -> None:
    """``python -m venv`` in the mount, then pip builds the sdist (in an isolated build
    environment, itself in a temporary directory) and installs it into that venv. The venv is
    made without its own copy of pip (seeding pip is ~1,000 file creates that the other tests
    already cover, and would triple this test's time); the test's pip targets it with
    ``--python``."""
    sdist = make_sdist(tmp_path)
    d = mounter.rw(lower_ref)
    venv = d.mnt / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=600)
    py = venv / "bin" / "python"
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1",
               PIP_CACHE_DIR=str(tmp_path / "pip-cache"), TMPDIR=str(d.mnt / "tmp"))
    env.pop("VIRTUAL_ENV", None)
    (d.mnt / "tmp").mkdir()
    pip = [sys.executable, "-m", "pip", "--python", str(py)]
    subprocess.run([*pip, "install", "-q", str(sdist)], check=True, env=env, timeout=600)
    r = subprocess.run([str(py), "-c", "import tinypkg, sys; "
                        "print(tinypkg.VALUE, tinypkg.DATA.strip(), sys.prefix)"],
                       capture_output=True, text=True, check=True, env=env)
    assert r.stdout.split()[:3] == ["42", "packaged", "data"]
    assert r.stdout.split()[3] == str(venv)
    mounter.remount(d)
    r = subprocess.run([*pip, "list", "--format=freeze"], capture_output=True, text=True,
                       check=True, env=env)
    assert "tinypkg==1.0" in r.stdout.split()
    subprocess.run([*pip, "uninstall", "-q", "-y", "tinypkg"], check=True, env=env)
    r = subprocess.run([str(py), "-c", "import tinypkg"], capture_output=True, env=env)
    assert r.returncode != 0
