"""``rewindfs doctor``: is this machine ready for rewindfs, and if not, what fixes it.

Each check looks, never changes anything, and reports ``ok``, ``warn`` (works, but something a
user may want is missing) or ``fail`` (a part of rewindfs cannot work here), with the cause
and the command that fixes it, in the form that works on this machine (``as_root``: as is
for root, else through sudo, else su; packages through the package manager on PATH).
Checks: the FUSE device and ``fusermount3``; the runtime directory (owner and mode);
``user_allow_other`` for ``--allow-other``; bubblewrap and user namespaces for the Bash
sandbox, slirp4netns and /dev/net/tun for its ``--network``; ripgrep for Grep; that this
user can use the store directory (owner and mode of one it cannot); free space
where the store and session states live; the FUSE binding in use; this user's mounts whose
daemon is gone (a warning with the commands that recover each); for the local directory
of a shared store (``store.json``), that its bucket answers with this environment's
credentials and that its PostgreSQL catalog answers with a schema this program reads (read
only: nothing is created or migrated). Exit 0 without a ``fail``, else 1. ``--json`` prints
``{"ok": bool, "checks": [{"name", "status", "detail", "fix"}]}``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from rewindfs.cli import add_json, emit

MIN_FREE_BYTES = 1 << 30


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def register(sub: Any) -> None:
    p = sub.add_parser("doctor", help="check this machine for what rewindfs needs; say how "
                                      "to fix what is missing")
    p.add_argument("--allow-other", action="store_true",
                   help="mounts will use --allow-other: user_allow_other is then required")
    add_json(p)
    p.set_defaults(handler=cmd_doctor)


def as_root(command: str) -> str:
    """``command`` (shell text) as this user can run it as root on this machine: as is for
    root, through sudo where it is installed, else through su (root's password), else
    marked "as root:" (neither is installed)."""
    if os.getuid() == 0:
        return command
    shell = any(c in command for c in "|>&;")
    if shutil.which("sudo"):
        return f"sudo sh -c {shlex.quote(command)}" if shell else f"sudo {command}"
    if shutil.which("su"):
        return f"su -c {shlex.quote(command)}"
    return f"as root: {command}"


_INSTALL = (("apt-get", "apt-get install"), ("dnf", "dnf install"), ("yum", "yum install"),
            ("zypper", "zypper install"), ("apk", "apk add"), ("pacman", "pacman -S"))
"""Package managers by the program that names them, and their install command (fuse3,
bubblewrap, ripgrep and slirp4netns are the packages' names in each)."""


def install(package: str) -> str:
    """The command that installs ``package`` with this machine's package manager, as
    root (``as_root``)."""
    for prog, cmd in _INSTALL:
        if shutil.which(prog):
            return as_root(f"{cmd} {package}")
    return f"install the {package} package (no known package manager is on PATH)"


def check_fuse() -> list[Check]:
    out = []
    if not os.path.exists("/dev/fuse"):
        out.append(Check("fuse_device", "fail", "/dev/fuse does not exist (sessions fall back "
                         "to plain directories; mount is unavailable)",
                         as_root("modprobe fuse") + " (in a container: run it with "
                         "--device /dev/fuse)"))
    else:
        try:
            os.close(os.open("/dev/fuse", os.O_RDWR))
            out.append(Check("fuse_device", "ok", "/dev/fuse opens read-write"))
        except OSError as e:
            out.append(Check("fuse_device", "fail", f"/dev/fuse cannot be opened: "
                             f"{os.strerror(e.errno or 0)} (sessions fall back to plain "
                             "directories; mount is unavailable)",
                             as_root("chmod 0666 /dev/fuse")))
    fm = shutil.which("fusermount3")
    if fm is None:
        out.append(Check("fusermount3", "fail", "fusermount3 is not on PATH",
                         install("fuse3")))
    elif os.getuid() != 0 and not os.stat(fm).st_mode & 0o4000:
        out.append(Check("fusermount3", "fail", f"{fm} is not setuid root, so a non-root "
                         "user cannot mount", as_root(f"chmod u+s {fm}")))
    else:
        out.append(Check("fusermount3", "ok", fm))
    return out


def check_runtime_dir() -> Check:
    from fusefs.mounts import xdg_passed_over

    c = _check_runtime_base()
    passed_over = xdg_passed_over()
    if passed_over is None:
        return c
    return Check("runtime_dir", "warn" if c.status == "ok" else c.status,
                 f"{passed_over}, so rewindfs uses another: {c.detail}",
                 c.fix or "unset XDG_RUNTIME_DIR, or log in as this user (su - USER) to get "
                          "one of yours")


def _check_runtime_base() -> Check:
    from fusefs.mounts import runtime_base

    d = runtime_base()
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        return Check("runtime_dir", "ok", f"{d} will be created (mode 0700) on first use")
    except OSError as e:
        return Check("runtime_dir", "fail", f"{d} cannot be looked at: {e.strerror}",
                     "export XDG_RUNTIME_DIR=$(mktemp -d)")
    if not os.path.isdir(d) or os.path.islink(d):
        return Check("runtime_dir", "fail", f"{d} is not a directory",
                     f"rm {d}  (or set XDG_RUNTIME_DIR to a private directory)")
    if st.st_uid != os.getuid():
        return Check("runtime_dir", "fail", f"{d} belongs to uid {st.st_uid}, not to you "
                     f"(uid {os.getuid()})",
                     f"export XDG_RUNTIME_DIR=$(mktemp -d)  (or {as_root(f'rm -r {d}')})")
    loose = [p for p in (d, os.path.join(d, "mounts"))
             if os.path.isdir(p) and os.lstat(p).st_mode & 0o077]
    if loose:
        return Check("runtime_dir", "warn", f"{', '.join(loose)} is open to other users "
                     f"(mode {oct(os.lstat(loose[0]).st_mode & 0o777)}); rewindfs tightens "
                     "it to 0700 on next use", f"chmod 700 {' '.join(loose)}")
    return Check("runtime_dir", "ok", f"{d} is yours, mode 0700")


def check_allow_other(wanted: bool) -> Check:
    try:
        with open("/etc/fuse.conf") as f:
            lines = [ln.split("#", 1)[0].strip() for ln in f]
    except OSError:
        lines = []
    if "user_allow_other" in lines:
        return Check("user_allow_other", "ok", "/etc/fuse.conf has user_allow_other")
    if os.getuid() == 0:
        return Check("user_allow_other", "ok", "not set in /etc/fuse.conf; root may use "
                     "--allow-other without it")
    return Check("user_allow_other", "fail" if wanted else "warn",
                 "/etc/fuse.conf lacks user_allow_other: --allow-other mounts are refused "
                 "for non-root users",
                 as_root("echo user_allow_other >> /etc/fuse.conf"))


def check_sandbox() -> Check:
    from tools import sandbox  # the Bash tool's own test of its sandbox

    reason = sandbox.unavailable_reason()
    if reason is None:
        return Check("bash_sandbox", "ok", f"{shutil.which('bwrap')} builds the Bash sandbox "
                     "(user, pid and network namespaces, seccomp)")
    detail = f"{reason}: the Bash tool refuses to run"
    if "REWINDFS_NO_SANDBOX" in reason:
        fix = "unset REWINDFS_NO_SANDBOX"
    elif "bwrap" in reason and "not installed" in reason:
        fix = install("bubblewrap")
    elif "namespaces" in reason:
        fix = as_root("sysctl -w kernel.unprivileged_userns_clone=1 "
                      "user.max_user_namespaces=15000")
    else:
        fix = "bash scripts/setup.sh"
    return Check("bash_sandbox", "fail", detail, fix)


def check_sandbox_network() -> Check:
    """Whether ``rewindfs mcp --network`` can give the Bash sandbox a network here (a
    warning: only that option needs it)."""
    from tools import sandbox

    reason = sandbox.network_unavailable_reason()
    if reason is None:
        return Check("sandbox_network", "ok", "slirp4netns can give the Bash sandbox a "
                                              "network (rewindfs mcp --network)")
    if "slirp4netns is not installed" in reason:
        fix = install("slirp4netns")
    elif "does not exist" in reason:
        fix = as_root("modprobe tun")
    else:
        fix = as_root(f"chmod 0666 {sandbox.TUN}") + " (its usual mode)"
    return Check("sandbox_network", "warn", f"{reason}: with rewindfs mcp --network, Bash "
                 "refuses every command", fix)


def check_ripgrep() -> Check:
    rg = shutil.which("rg")
    if rg is None:
        return Check("ripgrep", "fail", "rg is not installed: the Grep tool cannot run",
                     install("ripgrep"))
    return Check("ripgrep", "ok", rg)


def _existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    return p


def check_space(name: str, path: str) -> Check:
    at = _existing(path)
    st = os.statvfs(at)
    free = st.f_bavail * st.f_frsize
    shown = f"{free / (1 << 30):.1f} GiB free at {at} (for {path})"
    if free < MIN_FREE_BYTES:
        return Check(name, "warn", shown + "; writes fail with ENOSPC when it runs out",
                     "free space on that file system or choose another with --store")
    return Check(name, "ok", shown)


def check_binding() -> Check:
    try:
        import pyfuse3
    except ImportError as e:
        return Check("fuse_binding", "fail", f"pyfuse3 does not import: {e}",
                     "bash scripts/setup.sh")
    version = getattr(pyfuse3, "__version__", "?")
    try:
        from fusefs.binding import describe

        detail = describe()
    except ImportError:
        detail = f"stock pyfuse3 {version}"
    return Check("fuse_binding", "ok", detail)


def check_serving_cpu() -> Check:
    """Whether a mount's serving thread can follow a serial requester's CPU
    (``fusefs.affinity``): informational, never a failure."""
    try:
        from fusefs.affinity import unavailable

        why = unavailable()
    except ImportError as e:
        return Check("serving_cpu", "ok", f"not known: {e}")
    if why is None:
        return Check("serving_cpu", "ok", "in no-open mode the serving thread follows a "
                     "process making requests one after another to its CPU")
    return Check("serving_cpu", "ok", f"the scheduler places the serving thread: {why}")


def check_shared_store(store: str) -> list[Check]:
    """For the local directory of a shared store: can this host reach its bucket and its
    catalog? Nothing for an embedded store; a failed ``store_access`` for a store directory
    this user cannot use (another user's, say)."""
    from store import config
    from store.dirs import access_problem
    from store.errors import StoreError

    denied = access_problem(store)
    if denied:
        return [Check("store_access", "fail", f"store directory {os.path.abspath(store)} is "
                      f"{denied}", "point --store (or REWINDFS_STORE) at a store of yours, "
                      "or run rewindfs as the store's owner")]
    try:
        cfg = config.read(store)
    except config.StoreConfigError as e:
        return [Check("shared_config", "fail", str(e), "fix or remove that file")]
    if cfg is None:
        return []
    from store.errors import redact
    from store.pgcatalog import SCHEMA_VERSION, probe
    from store.s3 import S3Backend, parse_s3_url

    out: list[Check] = []
    where = f" at {redact(cfg.s3_endpoint)}" if cfg.s3_endpoint else ""
    try:
        bucket, prefix = parse_s3_url(cfg.blobs)
        S3Backend(bucket, prefix, endpoint_url=cfg.s3_endpoint, max_attempts=2,
                  read_timeout=10.0).check()
        out.append(Check("shared_blobs", "ok", f"{cfg.blobs}{where} answers"))
    except (StoreError, ValueError) as e:
        out.append(Check("shared_blobs", "fail", str(e),
                         "check the endpoint and the credentials (AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials) and "
                         "that the bucket exists"))
    try:
        have = probe(cfg.catalog)
    except StoreError as e:
        out.append(Check("shared_catalog", "fail", str(e),
                         "check that the server runs and the database exists; a password "
                         "comes from PGPASSWORD, ~/.pgpass or PGPASSFILE"))
        return out
    if have is None:
        out.append(Check("shared_catalog", "ok", "the catalog answers; its schema is made "
                                                 "by the first command that opens it"))
    elif have > SCHEMA_VERSION:
        out.append(Check("shared_catalog", "fail", f"the catalog has schema version {have}; "
                         f"this program reads up to {SCHEMA_VERSION}",
                         "upgrade rewindfs on this host"))
    else:
        out.append(Check("shared_catalog", "ok", f"the catalog answers (schema version "
                                                 f"{have})"))
    return out


def check_dead_mounts(store: str) -> list[Check]:
    """A warning for each mount of this user whose daemon is gone (killed: the mount is left
    dead, every access fails with ENOTCONN), with the commands that recover it (those
    ``status`` names). Only mounts recorded in this runtime directory whose daemon is not
    running are looked at, so no live daemon is asked anything."""
    import stat

    from fusefs.mounts import alive, own_mounts, read_record, runtime_base
    from rewindfs.cmd_live import dead_mount_error

    base = runtime_base()
    for level in (base, os.path.join(base, "mounts")):
        # Reading a record makes (or tightens) these levels: only where that changes
        # nothing (a missing or loose one holds no record to read, or runtime_dir says so).
        try:
            st = os.lstat(level)
        except OSError:
            return [Check("dead_mount", "ok", "no mount of this user is recorded")]
        if (not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid()
                or stat.S_IMODE(st.st_mode) != 0o700):
            return []
    out = []
    for mnt in own_mounts():
        rec = read_record(mnt)
        pid = rec.get("pid") if rec is not None else None
        if not isinstance(pid, int) or alive(pid, rec.get("started") if rec else None):
            continue
        err = dead_mount_error(mnt, store)
        if err is None:
            continue
        out.append(Check("dead_mount", "warn", f"{mnt}: its daemon (pid {pid}) is gone and "
                         "the mount is dead (every access fails with ENOTCONN)",
                         str(getattr(err, "fix", "") or "")))
    return out or [Check("dead_mount", "ok", "no mount of this user is dead")]


def run_checks(store: str, allow_other: bool = False) -> list[Check]:
    """Every check, in the order shown. A check that cannot look (a permission error, say)
    is reported as failed with its cause, never raised."""
    steps: list[tuple[str, Callable[[], Check | list[Check]]]] = [
        ("fuse_device", check_fuse), ("fuse_binding", check_binding),
        ("serving_cpu", check_serving_cpu),
        ("runtime_dir", check_runtime_dir),
        ("user_allow_other", lambda: check_allow_other(allow_other)),
        ("bash_sandbox", check_sandbox), ("sandbox_network", check_sandbox_network),
        ("ripgrep", check_ripgrep),
        ("store_space", lambda: check_space("store_space", store)),
        ("state_space", lambda: check_space("state_space", os.path.join(store, "sessions"))),
        ("shared_store", lambda: check_shared_store(store)),
        ("dead_mount", lambda: check_dead_mounts(store))]
    out: list[Check] = []
    for name, fn in steps:
        try:
            got = fn()
        except OSError as e:
            got = Check(name, "fail", f"cannot check: {e}", "")
        out.extend(got if isinstance(got, list) else [got])
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = run_checks(args.store, args.allow_other)
    ok = not any(c.status == "fail" for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name}: {c.detail}")
        if c.fix and c.status != "ok":
            lines.append(f"      fix: {c.fix}")
    lines.append("ready" if ok else "not ready: see the fix lines above")
    emit(args, {"ok": ok, "checks": [asdict(c) for c in checks]}, "\n".join(lines))
    return 0 if ok else 1
