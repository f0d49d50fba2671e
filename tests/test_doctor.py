"""``rewindfs doctor`` on this machine, through the console script: it names a loose or
foreign runtime directory and a missing ``user_allow_other`` with the command that fixes
each, and its ``--json`` parses. The ``/etc/fuse.conf`` it reads is swapped only inside a
private mount namespace of the child (the host's file is never touched)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fusehelpers as fh
import pytest

ROOT = os.getuid() == 0
CLONE_NEWNS = 0x00020000


def doctor(tmp: Path, *extra: str, runtime: Path) -> tuple[int, dict[str, Any]]:
    p = fh.run_cli(tmp / "store", "doctor", "--json", *extra,
                   env=dict(fh.user_env(), XDG_RUNTIME_DIR=str(runtime)))
    return p.returncode, json.loads(p.stdout)


def by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in doc["checks"]}


def test_a_fresh_runtime_dir_is_fine_and_json_parses(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    code, doc = doctor(tmp_path, runtime=run)
    checks = by_name(doc)
    assert {"fuse_device", "fusermount3", "runtime_dir", "user_allow_other", "bash_sandbox",
            "ripgrep", "store_space", "fuse_binding"} <= set(checks)
    assert all(c["status"] in ("ok", "warn", "fail") for c in doc["checks"])
    assert checks["runtime_dir"]["status"] == "ok"
    assert doc["ok"] is (code == 0) and doc["ok"] is all(
        c["status"] != "fail" for c in doc["checks"])
    assert not (run / "rewindfs").exists()  # doctor only looks


def test_a_loose_runtime_dir_is_named_with_its_fix(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "rewindfs").mkdir(parents=True)
    os.chmod(run / "rewindfs", 0o755)
    _, doc = doctor(tmp_path, runtime=run)
    c = by_name(doc)["runtime_dir"]
    assert c["status"] == "warn" and "chmod 700" in c["fix"]
    assert str(run / "rewindfs") in c["detail"]
    assert os.stat(run / "rewindfs").st_mode & 0o777 == 0o755


@pytest.mark.skipif(not ROOT, reason="needs root to chown")
def test_a_runtime_dir_of_another_user_fails(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "rewindfs").mkdir(parents=True, mode=0o700)
    os.chown(run / "rewindfs", 65534, 65534)
    code, doc = doctor(tmp_path, runtime=run)
    c = by_name(doc)["runtime_dir"]
    assert code == 1 and c["status"] == "fail" and "XDG_RUNTIME_DIR" in c["fix"]


@pytest.fixture
def nobody_tmp() -> Iterator[Path]:
    """A fresh directory under /tmp that uid 65534 can reach (mode 0755: pytest's tmp_path
    lies below a 0700 directory), removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="/tmp/rewindfs-test-"))
    try:
        os.chmod(tmp, 0o755)
        yield tmp
    finally:
        shutil.rmtree(tmp)


def _doctor_as_nobody(tmp: Path, conf: str, path: str | None = None,
                      binds: Sequence[tuple[Path, str]] = ()) -> tuple[int, dict[str, Any]]:
    """``rewindfs doctor --allow-other --json`` as uid 65534 (:func:`_as_nobody`) with an
    /etc/fuse.conf that reads ``conf``, PATH ``path`` (if given) and ``binds`` besides, on a
    store and runtime directory of its own in ``tmp`` (a ``nobody_tmp``); its exit status
    and JSON document."""
    (tmp / "fuse.conf").write_text(conf)
    for d in ("run", "store"):
        (tmp / d).mkdir(mode=0o700)
        os.chown(tmp / d, 65534, 65534)
    out = tmp / "out.json"
    code = _as_nobody(["--store", str(tmp / "store"), "doctor", "--allow-other", "--json"], out,
                      run=tmp / "run", path=path,
                      binds=[(tmp / "fuse.conf", "/etc/fuse.conf"), *binds])
    return code, json.loads(out.read_text())


@pytest.mark.skipif(not ROOT, reason="needs root for a mount namespace")
@pytest.mark.parametrize("conf,status", [("# nothing\n", "fail"),
                                         ("user_allow_other\n", "ok")])
def test_user_allow_other_as_an_unprivileged_user(nobody_tmp: Path, conf: str,
                                                  status: str) -> None:
    code, doc = _doctor_as_nobody(nobody_tmp, conf)
    c = by_name(doc)["user_allow_other"]
    assert c["status"] == status, doc
    if status == "fail":
        assert code == 1 and "user_allow_other" in c["fix"] and "fuse.conf" in c["fix"]


def bin_dir(at: Path, names: tuple[str, ...]) -> str:
    """A directory holding only programs named ``names`` (each /bin/true: doctor only looks
    them up), to be the whole PATH of a doctor run."""
    at.mkdir(mode=0o755)
    for n in names:
        (at / n).symlink_to("/bin/true")
    return str(at)


AS_ROOT_FORMS = [
    (("sudo", "su", "apt-get"), "sudo sh -c 'echo user_allow_other >> /etc/fuse.conf'",
     "sudo apt-get install {}"),
    (("su", "dnf"), "su -c 'echo user_allow_other >> /etc/fuse.conf'",
     "su -c 'dnf install {}'"),
    ((), "as root: echo user_allow_other >> /etc/fuse.conf",
     "install the {} package (no known package manager is on PATH)"),
]


@pytest.mark.skipif(not ROOT, reason="needs root for a mount namespace and uid 65534")
@pytest.mark.parametrize("programs,conf_fix,install_fix", AS_ROOT_FORMS)
def test_fix_lines_for_a_user_take_the_way_to_root_this_machine_has(
        nobody_tmp: Path, programs: tuple[str, ...], conf_fix: str, install_fix: str) -> None:
    """As uid 65534, the fix lines go through sudo only where sudo is installed, else su,
    else say "as root"; packages come from the package manager on PATH."""
    code, doc = _doctor_as_nobody(nobody_tmp, "# nothing\n", bin_dir(nobody_tmp / "bin", programs))
    checks = by_name(doc)
    assert code == 1
    assert checks["user_allow_other"]["fix"] == conf_fix
    for name, package in (("ripgrep", "ripgrep"), ("fusermount3", "fuse3"),
                          ("bash_sandbox", "bubblewrap"), ("sandbox_network", "slirp4netns")):
        assert checks[name]["fix"] == install_fix.format(package), (name, checks[name])
    if "sudo" not in programs:
        assert not any("sudo" in c["fix"] for c in checks.values()), checks


def test_root_is_never_told_sudo(tmp_path: Path) -> None:
    if not ROOT:
        pytest.skip("needs root")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env_path = bin_dir(tmp_path / "bin", ("sudo", "apt-get"))
    p = fh.run_cli(tmp_path / "store", "doctor", "--json",
                   env=dict(fh.user_env(), XDG_RUNTIME_DIR=str(run), PATH=env_path))
    checks = by_name(json.loads(p.stdout))
    assert checks["ripgrep"]["fix"] == "apt-get install ripgrep"
    assert not any("sudo" in c["fix"] for c in checks.values()), checks


@pytest.mark.skipif(not ROOT, reason="needs root for a mount namespace and uid 65534")
def test_a_tun_device_closed_to_the_user_is_a_warning_with_its_fix(nobody_tmp: Path) -> None:
    """/dev/net/tun 0600 (root's alone), as uid 65534: sandbox_network warns, naming the
    device, and the fix opens it (here, without sudo on PATH, through su)."""
    if not os.path.exists("/dev/net/tun"):
        pytest.skip("no tun device")
    node = nobody_tmp / "tun"
    os.mknod(node, stat.S_IFCHR | 0o600, os.stat("/dev/net/tun").st_rdev)
    code, doc = _doctor_as_nobody(nobody_tmp, "user_allow_other\n",
                                  bin_dir(nobody_tmp / "bin", ("su", "slirp4netns")),
                                  binds=[(node, "/dev/net/tun")])
    assert code in (0, 1)
    c = by_name(doc)["sandbox_network"]
    assert c["status"] == "warn" and "/dev/net/tun" in c["detail"], c
    assert "Permission denied" in c["detail"] and "mode 0600" in c["detail"], c
    assert c["fix"] == "su -c 'chmod 0666 /dev/net/tun' (its usual mode)", c


@pytest.mark.skipif(fh.SELFTEST, reason="needs a real mount")
def test_a_dead_mount_is_a_warning_with_the_fix_status_gives(
        mounter: fh.Mounter, lower_ref: str, fuse_store: Path, tmp_path: Path) -> None:
    """kill -9 of a mount's daemon leaves a dead mount: doctor warns about it (it does not
    say ``ready`` beside it without a word) with the same recovery commands as ``status``."""
    d = mounter.rw(lower_ref)
    assert d.proc is not None

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return fh.run_cli(fuse_store, *args)

    p = cli("doctor", "--json")
    assert [c["status"] for c in json.loads(p.stdout)["checks"]
            if c["name"] == "dead_mount" and str(d.mnt) in c["detail"]] == []
    os.killpg(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    try:
        p = cli("doctor", "--json")
        mine = [c for c in json.loads(p.stdout)["checks"]
                if c["name"] == "dead_mount" and c["detail"].startswith(f"{d.mnt}:")]
        assert len(mine) == 1 and mine[0]["status"] == "warn", p.stdout
        s = cli("status", str(d.mnt), "--json")
        assert s.returncode == 9
        fix = json.loads(s.stdout)["fix"]
        assert fix and mine[0]["fix"] == fix and "rewindfs umount" in fix, (mine, fix)
        text = cli("doctor").stdout
        assert f"warn  dead_mount: {d.mnt}: its daemon (pid {d.proc.pid}) is gone" in text
        assert f"      fix: {fix}" in text
    finally:
        u = cli("umount", str(d.mnt))
        mounter.kill9(d)  # reaps and forgets the killed daemon
    assert u.returncode == 0, u.stderr
    p = cli("doctor", "--json")
    assert not any(str(d.mnt) in c["detail"] for c in json.loads(p.stdout)["checks"])


@functools.cache
def _warm_cli_main() -> Callable[[list[str]], int]:
    """``rewindfs.cli.main``, once a doctor and a list on a scratch store (as this process's
    user) have imported the modules they need, so a child of uid 65534 need not read them."""
    from rewindfs.cli import main

    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()), \
            contextlib.redirect_stderr(io.StringIO()):
        main(["--store", os.path.join(scratch, "store"), "doctor"])
        main(["--store", os.path.join(scratch, "store"), "list"])
    return main


def _as_nobody(argv: list[str], out: Path, err: Path | None = None, *, run: Path,
               path: str | None = None, binds: Sequence[tuple[Path, str]] = ()) -> int:
    """``rewindfs ARGV`` as uid/gid 65534 in a forked child; its exit status (98: no mount
    namespace). Its stdout goes to ``out``, its stderr to ``err`` (else the test's), its
    XDG_RUNTIME_DIR is ``run`` and its PATH ``path`` (if given); with ``binds``, it runs in
    a private mount namespace where each (file, target) pair's file is bind-mounted over
    target (the host's target is never touched). uid 65534 cannot exec or read the venv's
    interpreter and library under /root, hence the fork, and the modules it needs are
    imported first, as root (:func:`_warm_cli_main`)."""
    main = _warm_cli_main()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 99
        try:
            if binds:
                if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNS) != 0:
                    os._exit(98)
                subprocess.run(["mount", "--make-rprivate", "/"], check=True)
                for file, target in binds:
                    subprocess.run(["mount", "--bind", str(file), target], check=True)
            o = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            e = None if err is None else os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                 0o666)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.environ["XDG_RUNTIME_DIR"] = str(run)
            if path is not None:
                os.environ["PATH"] = path
            sys.stdout = os.fdopen(o, "w")  # pytest's capture replaced sys.stdout
            if e is not None:
                sys.stderr = os.fdopen(e, "w")
            code = main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not ROOT, reason="needs root for a store of another user and uid 65534")
def test_a_store_of_another_user_is_named_not_taken_for_a_bad_store_json(
        nobody_tmp: Path) -> None:
    """REWINDFS_STORE pointing at root's 0700 store, as uid 65534: doctor fails
    ``store_access`` naming the owner and the mode (not a store.json that does not exist),
    and a command says the same in one line (exit 1), for a directory below it too."""
    store, run = nobody_tmp / "store", nobody_tmp / "run"
    store.mkdir(mode=0o700)
    run.mkdir(mode=0o700)
    os.chown(run, 65534, 65534)
    out, err = nobody_tmp / "out", nobody_tmp / "err"
    code = _as_nobody(["--store", str(store), "doctor", "--json"], out, err, run=run)
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    list_code = _as_nobody(["--store", str(store), "list"], out, err, run=run)
    list_err = err.read_text()
    sub_code = _as_nobody(["--store", str(store / "sub"), "list"], out, err, run=run)
    sub_err = err.read_text()
    assert code == 1 and "shared_config" not in checks, checks
    c = checks["store_access"]
    assert c["status"] == "fail" and c["detail"] == (
        f"store directory {store} is not accessible to this user nobody (uid 65534): it "
        "belongs to root (uid 0), mode 0700"), c
    assert "--store" in c["fix"] and "REWINDFS_STORE" in c["fix"], c
    assert list_code == 1 and list_err.count("\n") == 1, list_err
    assert list_err.startswith(f"rewindfs: store {store}: not accessible to this user nobody "
                               "(uid 65534): it belongs to root (uid 0), mode 0700; "), list_err
    assert sub_code == 1 and f"its parent {store} is not accessible" in sub_err, sub_err


def _serving_cpu(tmp: Path, prefix: Sequence[str] = ()) -> dict[str, Any]:
    run = tmp / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    p = subprocess.run([*prefix, sys.executable, "-m", "rewindfs", "--store",
                        str(tmp / "store"), "doctor", "--json"], capture_output=True,
                       text=True, cwd=fh.REPO, timeout=120,
                       env=dict(fh.user_env(), XDG_RUNTIME_DIR=str(run)))
    return by_name(json.loads(p.stdout))["serving_cpu"]


@pytest.mark.skipif(not ROOT or len(os.sched_getaffinity(0)) < 2
                    or not shutil.which("taskset"),
                    reason="following needs 2 CPUs and CAP_SYS_NICE (root)")
def test_doctor_says_whether_the_serving_thread_can_follow_a_requester(
        tmp_path: Path) -> None:
    import pyfuse3

    c = _serving_cpu(tmp_path)
    assert c["status"] == "ok"
    if "idle_replies" not in getattr(pyfuse3, "extensions", ()):
        assert "patched binding" in c["detail"]
        return
    assert "follows" in c["detail"]
    one = _serving_cpu(tmp_path, ["taskset", "-c", str(min(os.sched_getaffinity(0)))])
    assert one["status"] == "ok" and "one CPU allowed" in one["detail"]
