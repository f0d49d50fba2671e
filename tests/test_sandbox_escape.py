"""The Bash sandbox as a security boundary (CONTRACT 7): every escape fails, as root and as
an unprivileged user (uid 65534).

Each case runs one command through the Bash tool as the server runs it (as the user under
test, with a secret in the server's environment), and
checks on the host that nothing escaped. The same command is then run outside the sandbox
(``bash -c`` as that user) and must succeed there, so that no case passes because the
command was broken; the commands that unmount something run outside in the confinement
Bash had before (bubblewrap without a user namespace: a read-only bind of / with a tmpfs on
/tmp, as root), where they escaped, and where the host's own mounts stay as they are. Cases whose outside run needs root are run
outside as root also in the uid-65534 round (they show the command works on this machine),
and are skipped when the tests themselves do not run as root.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import fusehelpers as fh
import pytest
import treegen

from tools import sandbox
from tools.bash import run_bash
from tools.binding import DirBinding
from tools.context import ToolContext
from tools.sandbox import SandboxPolicy

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534
IS_ROOT = os.geteuid() == 0
CLONE_NEWNS = 0x00020000
SECRET_NAME = "AWS_SECRET_ACCESS_KEY"
SECRET = f"escape-suite-secret-{uuid.uuid4().hex}"

pytestmark = pytest.mark.skipif(sandbox.unavailable_reason() is not None,
                                reason=f"no sandbox here: {sandbox.unavailable_reason()}")

def _as(uid: int) -> dict[str, object]:
    """subprocess arguments running a child as ``uid`` (its own group, no others)."""
    if uid == os.geteuid():
        return {}
    return {"user": uid, "group": uid, "extra_groups": []}


@dataclass
class Arena:
    """A host directory tree for one case: ``base`` (owned by the user under test) holds
    the workspace ``root`` and ``host``, a directory outside the root the command must not
    reach. ``uid`` is the user the server runs as."""

    uid: int
    base: Path
    root: Path = field(init=False)
    host: Path = field(init=False)
    tun: Path | None = None
    """A tun device node the server sees at /dev/net/tun (bound there in a private mount
    namespace of its child; the host's node is untouched); uid 65534 only."""

    def __post_init__(self) -> None:
        self.root = self.base / "root"
        self.host = self.base / "host"
        for d in (self.root, self.host):
            d.mkdir()
        (self.host / "file").write_text("host file\n")
        for p in (self.base, self.root, self.host, self.host / "file"):
            os.chown(p, self.uid, self.uid)

    def inside(self, command: str, timeout: float = 60, **policy: object) -> dict:
        """Run ``command`` through the Bash tool as the server would, as ``uid`` (uid 65534:
        in a forked child, with this process's probes of the machine forgotten), with a
        secret in the server's environment; the result's text and data as a dict, which
        must be a confined run."""
        out = self.attempt(command, timeout, **policy)
        assert out["ok"] and out["data"]["confined"] is True, out
        return out

    def attempt(self, command: str, timeout: float = 60, **policy: object) -> dict:
        """``inside`` without its check: the Bash tool's answer as a dict (ok, text,
        data), a refusal included."""
        out_path = self.base / f"result-{uuid.uuid4().hex}.json"

        def serve() -> int:
            sandbox._probe_sandbox.cache_clear()
            sandbox.pids_cgroup_parent.cache_clear()
            ctx = ToolContext(DirBinding(self.root),
                              SandboxPolicy(**policy))  # type: ignore[arg-type]
            r = run_bash(ctx, command, timeout)
            out_path.write_text(json.dumps({"ok": r.ok, "text": r.text, "data": r.data}))
            return 0

        os.environ[SECRET_NAME] = SECRET
        try:
            if self.uid == NOBODY and os.geteuid() == 0:
                assert treegen.as_nobody(serve, None if self.tun is None else (
                    lambda: bind_in_private_namespace(self.tun, sandbox.TUN))) == 0
            else:
                assert self.tun is None, "a tun node of its own needs uid 65534 under root"
                serve()
        finally:
            del os.environ[SECRET_NAME]
            sandbox._probe_sandbox.cache_clear()
            sandbox.pids_cgroup_parent.cache_clear()
        out: dict = json.loads(out_path.read_text())
        out_path.unlink()
        return out

    def outside(self, command: str, as_root: bool = False, old_sandbox: bool = False
                ) -> str:
        """Run ``command`` with ``bash -c`` outside the sandbox, as ``uid`` (or as root),
        in the root directory, with the server's environment; output and stderr.
        ``old_sandbox``: as root in the former confinement (see the module docstring)."""
        uid = 0 if as_root else self.uid
        argv = ["bash", "-c", command]
        if old_sandbox:
            assert uid == 0
            argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
                    "--tmpfs", "/tmp", "--bind", str(self.root), str(self.root),
                    "--unshare-pid", "--die-with-parent", "--", *argv]
        env = dict(os.environ, **{SECRET_NAME: SECRET})
        p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=self.root,
                           timeout=60, **_as(uid))  # type: ignore[call-overload]
        return p.stdout + p.stderr


USERS = ["root", "nobody"] if IS_ROOT else ["self"]


@pytest.fixture(params=USERS)
def arena(request: pytest.FixtureRequest) -> Iterator[Arena]:
    uid = {"root": 0, "nobody": NOBODY, "self": os.geteuid()}[request.param]
    # Not under pytest's base directory (0700): uid 65534 must reach it.
    base = Path(tempfile.mkdtemp(prefix="rewindfs-escape-", dir="/tmp"))
    os.chmod(base, 0o755)
    try:
        yield Arena(uid, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def needs_root_outside() -> None:
    if not IS_ROOT:
        pytest.skip("the outside run of this command needs root")


# -- mounts, /proc, /sys, devices ------------------------------------------------------------


def test_remount_escape_fails(arena: Arena) -> None:
    needs_root_outside()
    target = arena.host / "remount"
    cmd = f"umount -l /tmp && mount -o remount,bind,rw / && echo x > {target}"
    r = arena.inside(cmd)
    assert r["data"]["exit_code"] != 0
    assert not target.exists()
    arena.outside(cmd, as_root=True, old_sandbox=True)
    assert target.read_text() == "x\n"


def test_unmounting_proc_shows_no_host_process(arena: Arena) -> None:
    needs_root_outside()
    cmd = f"umount -l /proc; test -d /proc/{os.getpid()} && echo SEEN-HOST-PROCESS"
    r = arena.inside(cmd)
    assert "SEEN-HOST-PROCESS" not in r["text"]
    assert "SEEN-HOST-PROCESS" in arena.outside(cmd, as_root=True, old_sandbox=True)


def test_proc_sys_is_read_only(arena: Arena) -> None:
    needs_root_outside()
    # 4 only silences the kernel's log line: the same write as a cache drop, dropping
    # nothing (the machine is shared).
    cmd = "echo 4 > /proc/sys/vm/drop_caches && echo WROTE"
    r = arena.inside(cmd)
    assert "WROTE" not in r["text"]
    assert "Read-only file system" in r["text"]
    assert "WROTE" in arena.outside(cmd, as_root=True)


def test_kernel_listings_of_host_tasks_are_masked(arena: Arena) -> None:
    needs_root_outside()
    if not os.path.exists("/proc/timer_list"):
        pytest.skip("no /proc/timer_list here")
    cmd = "wc -c < /proc/timer_list"
    first = arena.inside(cmd)["text"].split("\n")[0]
    assert first == "0" or first.endswith("/proc/timer_list: Permission denied"), first
    assert int(arena.outside(cmd, as_root=True)) > 0


def test_sys_is_not_writable(arena: Arena) -> None:
    needs_root_outside()
    files = sorted(glob.glob("/sys/block/*/queue/read_ahead_kb"))
    if not files:
        pytest.skip("no block device queue setting in /sys here")
    f = files[0]
    cmd = f"v=$(cat {f}) && echo $v > {f} && echo WROTE"     # writes its current value
    assert "WROTE" not in arena.inside(cmd)["text"]
    assert "WROTE" in arena.outside(cmd, as_root=True)


RAW_DEVICES = ("/dev/vda", "/dev/sda", "/dev/nvme0n1", "/dev/xvda", "/dev/mem", "/dev/vcs",
               "/dev/hwrng", "/dev/kmsg")


def test_raw_devices_are_unreadable(arena: Arena) -> None:
    needs_root_outside()
    # The first device root can read here (a container's device rules may refuse disks).
    cmd = "head -c 16 {dev} 2>/dev/null | wc -c"
    readable = [d for d in RAW_DEVICES if os.path.exists(d)
                and arena.outside(cmd.format(dev=d), as_root=True).strip() == "16"]
    if not readable:
        pytest.skip("root can read none of the raw devices here")
    r = arena.inside(cmd.format(dev=readable[0]))
    assert r["text"].split("\n")[0] == "0", r


# -- the seccomp filter and the limits -----------------------------------------------------

# keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_SESSION_KEYRING, create=1): the session keyring
KEYCTL = ("python3 -c 'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
          "r = libc.syscall(250, 0, -3, 1); "
          "print(\"KEYRING\" if r > 0 else \"errno %d\" % ctypes.get_errno())'")


@pytest.mark.parametrize("cmd, works", [
    ("unshare --user true && echo NESTED-USERNS", "NESTED-USERNS"),
    (KEYCTL, "KEYRING"),
], ids=["nested-user-namespace", "keyctl"])
def test_seccomp_refuses_nested_user_namespaces_and_keyrings(arena: Arena, cmd: str,
                                                             works: str) -> None:
    r = arena.inside(cmd)
    assert works not in r["text"]
    assert "Operation not permitted" in r["text"] or "errno 1\n" in r["text"], r
    assert works in arena.outside(cmd)


def test_mount_is_refused(arena: Arena) -> None:
    needs_root_outside()
    d = arena.root / "mnt"
    d.mkdir()
    cmd = f"mount -t tmpfs none {d} && echo MOUNTED"
    assert "MOUNTED" not in arena.inside(cmd)["text"]
    assert "MOUNTED" in arena.outside(f"unshare --mount -- {cmd}", as_root=True)


def test_file_size_and_memory_are_bounded(arena: Arena) -> None:
    big = "head -c 2097152 /dev/zero > big && echo WROTE; ls -l big | cut -d' ' -f5"
    r = arena.inside(big, max_file_bytes=1 << 20)
    assert "WROTE" not in r["text"] and "1048576" in r["text"], r
    assert "WROTE" in arena.outside(big)
    alloc = "python3 -c 'b = bytearray(512 << 20); print(\"ALLOCATED\")'"
    r = arena.inside(alloc, max_memory_bytes=256 << 20)
    assert "ALLOCATED" not in r["text"] and "MemoryError" in r["text"], r
    assert "ALLOCATED" in arena.outside(alloc)


def test_memory_backed_file_systems_are_bounded(arena: Arena) -> None:
    # tmpfs pages count against no process's RLIMIT_AS: an unsized /tmp or /dev (with
    # /dev/shm) holds up to half of the host's memory each, per command.
    needs_root_outside()
    fill = ("for d in /tmp /dev/shm /dev; do head -c 134217728 /dev/zero > $d/fill "
            "&& echo WROTE $d; rm -f $d/fill; done")
    r = arena.inside(fill, max_tmp_bytes=64 << 20)
    assert "WROTE" not in r["text"], r
    assert "No space left" in r["text"] and "Read-only file system" in r["text"], r
    outside = arena.outside(fill.replace("/dev/shm /dev", "/dev/shm"), old_sandbox=True,
                            as_root=True)
    assert "WROTE /tmp" in outside and "WROTE /dev/shm" in outside, outside
    assert "WROTE /dev" in arena.outside("head -c 1048576 /dev/zero > /dev/fill && "
                                         "echo WROTE /dev", old_sandbox=True, as_root=True)


# -- host secrets ------------------------------------------------------------------------------


def test_shadow_root_home_and_other_checkouts_are_unreadable(arena: Arena) -> None:
    needs_root_outside()
    checks = ("grep -c '^root:' /etc/shadow; ls -d /root /home; "
              f"cat {REPO}/pyproject.toml | grep -c '^name = \"rewindfs\"'")
    inside = arena.inside(checks)["text"]
    assert "No such file or directory" in inside     # /root, /home, the checkout
    lines = inside.split("\n")
    assert lines[0] in ("0", "grep: /etc/shadow: Permission denied"), inside
    assert "/root\n" not in inside and "\n1\n" not in inside, inside
    outside = arena.outside(checks, as_root=True)
    assert outside.split("\n")[0] == "1" and "/root\n" in outside, outside
    assert outside.rstrip("\n").endswith("\n1")


def test_environment_is_an_allowlist(arena: Arena) -> None:
    r = arena.inside("env")
    names = {line.split("=", 1)[0] for line in r["text"].split("\n")[:-1] if "=" in line}
    assert SECRET not in r["text"] and SECRET_NAME not in names
    allowed = {"PATH", "LANG", "LANGUAGE", "TERM", "HOME", "TMPDIR",
               "PYTHONDONTWRITEBYTECODE", "PWD", "SHLVL", "_"}
    assert names <= allowed | {n for n in names if n.startswith("LC_")}, names
    assert "HOME=/tmp" in r["text"].split("\n")
    assert SECRET in arena.outside("env")
    # An operator-named variable passes.
    named = arena.inside(f"echo ${SECRET_NAME}", env=[SECRET_NAME])
    assert named["text"].split("\n")[0] == SECRET


# -- processes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def host_sleeper(uid: int) -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "600"], **_as(uid))  # type: ignore[call-overload]
    try:
        yield p
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_host_process_cannot_be_killed(arena: Arena) -> None:
    with host_sleeper(arena.uid) as victim:
        cmd = f"kill -9 {victim.pid} && echo KILLED"
        r = arena.inside(cmd)
        assert "KILLED" not in r["text"]
        assert victim.poll() is None
        assert "KILLED" in arena.outside(cmd)
        assert victim.wait(10) == -signal.SIGKILL


PTRACE = ("python3 -c 'import ctypes,sys; libc = ctypes.CDLL(None, use_errno=True); "
          "r = libc.ptrace(16, int(sys.argv[1]), 0, 0); "       # PTRACE_ATTACH
          "print(\"ATTACHED\" if r == 0 else \"errno %d\" % ctypes.get_errno())' {pid}")


def test_host_process_cannot_be_traced(arena: Arena) -> None:
    yama = Path("/proc/sys/kernel/yama/ptrace_scope")
    if arena.uid != 0 and yama.exists() and yama.read_text().strip() != "0":
        pytest.skip("Yama keeps this user from tracing a process it did not start")
    with host_sleeper(arena.uid) as victim:
        cmd = PTRACE.format(pid=victim.pid)
        r = arena.inside(cmd)
        assert "ATTACHED" not in r["text"] and "errno" in r["text"], r
        assert "ATTACHED" in arena.outside(cmd)
    # Nor any process of its own (the seccomp filter refuses ptrace outright).
    own = arena.inside("sleep 30 & " + PTRACE.format(pid="$!"))
    assert "errno 1\n" in own["text"], own


FORKS = ("python3 -c 'import os, sys\n"
         "r, w = os.pipe()\nn = 0\n"
         "try:\n"
         "    for _ in range(int(sys.argv[1])):\n"
         "        if os.fork() == 0:\n"
         "            os.close(w); os.read(r, 1); os._exit(0)\n"   # lives while we do
         "        n += 1\n"
         "except OSError:\n    pass\n"
         "print(\"forked\", n)' {n}")


def test_process_count_is_bounded(arena: Arena) -> None:
    limit = 64
    r = arena.inside(FORKS.format(n=3 * limit), max_processes=limit)
    got = int(r["text"].split("\n")[0].split()[1])
    assert 0 < got < limit, r
    assert arena.outside(FORKS.format(n=3 * limit)).strip() == f"forked {3 * limit}"


def test_fork_bomb_ends_with_the_command(arena: Arena) -> None:
    marker = f"bomb{uuid.uuid4().hex[:12]}"
    r = arena.inside(f"{marker}() {{ {marker} | {marker} & }}; {marker}; sleep 30",
                     timeout=5, max_processes=128)
    assert r["data"]["timed_out"] is True
    # Nothing of it is left on the host, and the host still starts processes.
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    assert left == ""
    assert arena.outside("echo alive").strip() == "alive"


# -- the network -------------------------------------------------------------------------------


@contextlib.contextmanager
def listener(family: int, address: object) -> Iterator[socket.socket]:
    """A socket accepting (and closing) connections until the block ends."""
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind(address)  # type: ignore[arg-type]
    s.listen(16)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = s.accept()
            except OSError:
                return
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield s
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        s.close()
        t.join(5)


def test_loopback_tcp_listener_is_unreachable(arena: Arena) -> None:
    with listener(socket.AF_INET, ("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
        cmd = f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo CONNECTED"
        assert "CONNECTED" not in arena.inside(cmd)["text"]
        assert "CONNECTED" in arena.outside(cmd)
        # Nor with networking allowed: the user-mode network keeps the host's loopback out.
        if can_network(arena.uid) or own_tun(arena, 0o666):
            for host in ("127.0.0.1", sandbox.SLIRP_HOST):
                cmd_n = f"exec 3<>/dev/tcp/{host}/{port} && echo CONNECTED"
                assert "CONNECTED" not in arena.inside(cmd_n, network=True)["text"]


def can_network(uid: int) -> bool:
    """Whether slirp4netns can give ``uid``'s sandbox a network here (it needs the tun
    device, which some containers keep to root)."""
    if shutil.which("slirp4netns") is None or not os.path.exists(sandbox.TUN):
        return False
    return uid == 0 or os.stat(sandbox.TUN).st_mode & 0o006 == 0o006


def bind_in_private_namespace(node: Path, target: str) -> None:
    """In this (forked, single-threaded) process: a mount namespace of its own, where
    ``node`` is bound over ``target``; the host's mounts are untouched."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "--bind", str(node), target], check=True)


def own_tun(arena: Arena, mode: int) -> bool:
    """Give uid 65534's server a tun device node of ``mode`` (as the host's: char 10:200)
    at /dev/net/tun; False where that cannot be done here (not root, no tun device, no
    slirp4netns)."""
    if not (IS_ROOT and arena.uid == NOBODY and shutil.which("slirp4netns")
            and os.path.exists(sandbox.TUN)):
        return False
    node = arena.base / "tun"
    os.mknod(node, stat.S_IFCHR | 0o600, os.stat(sandbox.TUN).st_rdev)
    os.chmod(node, mode)
    arena.tun = node
    return True


def host_address() -> str | None:
    """An address of this machine other than loopback (IPv4), or None."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show", "scope", "global"],
                         capture_output=True, text=True).stdout.split()
    return out[out.index("inet") + 1].split("/")[0] if "inet" in out else None


def test_network_is_off_by_default_and_opt_in_goes_through_user_mode(arena: Arena) -> None:
    # For uid 65534 where the host keeps its tun device to root: a node open to it. (As a
    # user other than root, bubblewrap nests the command's user namespace in the one that
    # owns its network namespace, which slirp4netns must join instead.)
    if not can_network(arena.uid) and not own_tun(arena, 0o666):
        pytest.skip("slirp4netns cannot run for this user here (no tun device)")
    addr = host_address()
    if addr is None:
        pytest.skip("this machine has no address besides loopback")
    with listener(socket.AF_INET, ("0.0.0.0", 0)) as s:
        port = s.getsockname()[1]
        cmd = f"exec 3<>/dev/tcp/{addr}/{port} && echo CONNECTED"
        assert "CONNECTED" not in arena.inside(cmd)["text"]
        assert "CONNECTED" in arena.outside(cmd)
        r = arena.inside(f"{cmd}; grep -c tap0 /proc/net/dev", network=True)
        assert r["text"].split("\n")[:2] == ["CONNECTED", "1"], r
        # The host's loopback (slirp4netns's 10.0.2.2) only with the separate option.
        loop = f"exec 3<>/dev/tcp/{sandbox.SLIRP_HOST}/{port} && echo CONNECTED"
        assert "CONNECTED" not in arena.inside(loop, network=True)["text"]
        assert "CONNECTED" in arena.inside(loop, network=True, host_loopback=True)["text"]


def test_network_refused_naming_a_tun_device_this_user_cannot_open(arena: Arena) -> None:
    """A tun device of mode 0600 (root's alone, as some containers keep it): Bash with
    networking refuses before anything starts, naming the device (kind ``network``)."""
    if not own_tun(arena, 0o600):
        pytest.skip("needs root, a tun device and slirp4netns, for uid 65534")
    marker = arena.root / "ran"
    r = arena.attempt(f"touch {marker}", network=True)
    assert not r["ok"] and r["data"]["kind"] == "network", r
    assert sandbox.TUN in r["text"] and "Permission denied" in r["text"], r
    assert not marker.exists()
    assert arena.inside(f"touch {marker}")["data"]["exit_code"] == 0  # no network: runs


ABSTRACT = ("python3 -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); "
            "s.connect(\"\\0\" + sys.argv[1]); print(\"CONNECTED\")' {name}")


def test_abstract_unix_socket_is_unreachable(arena: Arena) -> None:
    name = f"rewindfs-escape-{uuid.uuid4().hex}"
    with listener(socket.AF_UNIX, "\0" + name):
        cmd = ABSTRACT.format(name=name)
        r = arena.inside(cmd)
        assert "CONNECTED" not in r["text"] and "ConnectionRefusedError" in r["text"], r
        assert "CONNECTED" in arena.outside(cmd)


# -- writing outside the root ------------------------------------------------------------------


def test_dotdot_symlink_and_hard_link_do_not_leave_the_root(arena: Arena) -> None:
    h = arena.host
    cases = [
        (f"echo x > {arena.root}/../host/dotdot", h / "dotdot"),
        ("echo x > ../host/dotdot-relative", h / "dotdot-relative"),
        (f"ln -s {h} link && echo x > link/symlink", h / "symlink"),
        ("ln -s ../host rel && echo x > rel/symlink-relative", h / "symlink-relative"),
    ]
    for cmd, target in cases:
        arena.inside(cmd)
        assert not target.exists(), cmd
        for leftover in ("link", "rel"):
            with contextlib.suppress(FileNotFoundError):
                (arena.root / leftover).unlink()
        arena.outside(cmd)
        assert target.read_text() == "x\n", cmd
    hard = f"ln {h}/file hard && echo changed > hard"
    arena.inside(hard)
    assert (h / "file").read_text() == "host file\n"
    assert not (arena.root / "hard").exists()
    arena.outside(hard)
    assert (h / "file").read_text() == "changed\n"


def _set_id_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.stat().st_mode & 0o6000)


def test_no_set_user_id_program_is_left_in_the_root(arena: Arena) -> None:
    # The sandbox's uid is the server's, and a plain workspace directory has no nosuid:
    # a set-user-ID copy of a shell left there is root (or the server's user) for any
    # local user who runs it. io_uring's openat would pass the mode unseen by seccomp.
    plant = ("cp /usr/bin/true chmod-u && chmod u+s chmod-u; "
             "cp /usr/bin/true chmod-g && chmod g+s chmod-g; "
             "install -m 4755 /usr/bin/true install-u; "
             "python3 -c \"import os; os.close(os.open('open-u', os.O_CREAT | os.O_WRONLY, "
             "0o4755))\"; "
             "python3 -c \"import ctypes, os; libc = ctypes.CDLL(None, use_errno=True); "
             "fd = libc.syscall(425, 4, ctypes.create_string_buffer(120)); "
             "print('IO_URING' if fd >= 0 else os.strerror(ctypes.get_errno()))\"")
    r = arena.inside(plant)
    assert _set_id_files(arena.root) == [], r
    assert "Operation not permitted" in r["text"] and "IO_URING" not in r["text"], r
    for p in list(arena.root.iterdir()):
        p.unlink()
    out = arena.outside(plant)
    assert _set_id_files(arena.root) == ["chmod-g", "chmod-u", "install-u", "open-u"], out
    assert "IO_URING" in out, out


# -- the session mount ---------------------------------------------------------------------


def test_session_mount_serves_the_sandbox_mapped_to_its_owner(mounter: fh.Mounter,
                                                              lower_ref: str) -> None:
    """A FUSE mount without allow_other admits only its owner (root, when the server runs
    as root): the sandbox's user namespace maps its ids to the owner, so Bash reads and
    writes the mount, while another uid is refused by the same mount."""
    d = mounter.rw(lower_ref)
    mnt = str(d.mnt)
    ctx = ToolContext(DirBinding(mnt))
    r = run_bash(ctx, "cat plain.txt && echo made > made.txt && stat -c '%u:%g' made.txt "
                      "&& grep -E '^(Cap(Eff|Prm|Bnd)|NoNewPrivs)' /proc/self/status")
    assert r.data["confined"] is True and r.data["exit_code"] == 0, r.render()
    uid, gid = os.getuid(), os.getgid()
    assert r.text.split("\n")[:6] == [
        "hello world", f"{uid}:{gid}", "CapPrm:\t0000000000000000",
        "CapEff:\t0000000000000000", "CapBnd:\t0000000000000000", "NoNewPrivs:\t1"], r.text
    st = os.stat(os.path.join(mnt, "made.txt"))
    assert (st.st_uid, st.st_gid) == (uid, gid)
    if IS_ROOT:                                  # another uid: the mount refuses it
        def other() -> int:
            try:
                os.stat(os.path.join(mnt, "plain.txt"))
            except PermissionError:
                return 3
            return 0
        assert treegen.as_nobody(other) == 3


# -- the operator's options, end to end ------------------------------------------------------


def mcp_bash(tmp: Path, options: list[str], commands: list[str],
             env: dict[str, str]) -> list[tuple[bool, str]]:
    """(is_error, text) of each Bash call to ``rewindfs mcp --root`` with ``options``,
    through the mcp SDK's client over stdio, the server given ``env``."""
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    root = tmp / "root"
    root.mkdir(exist_ok=True)
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "rewindfs.cli", "--store", str(tmp / "store"), "mcp", "--root", str(root),
              *options], cwd=str(REPO), env=env)
    out: list[tuple[bool, str]] = []

    async def session() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            for c in commands:
                r = await client.call_tool("Bash", {"command": c})
                out.append((bool(r.is_error), "".join(getattr(x, "text", "")
                                                      for x in r.content)))

    anyio.run(session)
    return out


def test_mcp_options_env_and_unsafe_no_sandbox(tmp_path: Path) -> None:
    env = dict(os.environ, **{SECRET_NAME: SECRET, "REWINDFS_TEST_NAMED": "named-value"})
    show = f'echo "[${SECRET_NAME}] [$REWINDFS_TEST_NAMED]"'
    (err, text), = mcp_bash(tmp_path, ["--env", "REWINDFS_TEST_NAMED"], [show], env)
    assert not err and text.split("\n")[0] == "[] [named-value]", text
    (err, text), = mcp_bash(tmp_path, [], [show], env)
    assert text.split("\n")[0] == "[] []", text
    # Without a sandbox: refused, unless the operator allows running unconfined.
    env["REWINDFS_NO_SANDBOX"] = "1"
    (err, text), = mcp_bash(tmp_path, [], ["touch ran"], env)
    assert err and "refused: no sandbox can be built here" in text
    assert not (tmp_path / "root" / "ran").exists()
    (err, text), (_, shown) = mcp_bash(tmp_path, ["--unsafe-no-sandbox"], ["touch ran", show],
                                       env)
    assert not err and "ran unconfined" in text
    assert (tmp_path / "root" / "ran").exists()
    assert shown.split("\n")[0] == "[] []", shown      # the allowlist holds unconfined too
