"""Session records: which sessions exist, where their state and roots are.

Each session has a state directory ``<state base>/<session id>`` (mode 0700, on local disk,
never under a managed root) holding ``session.json``::

    {"id", "fingerprint", "mode", "root", "state_dir", "backend", "created_ns", "parent"}

written atomically (temporary file, fsync, rename, fsync of the directory). The record never
changes after creation except for ``backend``-private files beside it (swap logs, the FUSE
upper layer, the control socket path). This module never touches a live root.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from .errors import SessionNotFoundError, SessionStartingError
from .placement import check_session_id

RECORD = "session.json"
START_LOCK = "start.lock"
"""In a state directory: flock'ed exclusively by the process that starts the session (new,
fork or resume) until the session process holds the session lease, and by a removal; a
removal finding it held refuses (``SessionStartingError``), so ``session gc --stopped``
never deletes a session whose start is under way (before the lease, nothing else says so)."""


@dataclass(frozen=True)
class SessionRecord:
    """A session as registered. ``root`` is None for a session without placement;
    ``parent`` is the session id or Ref it was forked from, if any."""

    id: str
    fingerprint: str | None
    mode: str | None
    root: str | None
    state_dir: str
    backend: str
    created_ns: int
    parent: str | None = None


def new_session_id() -> str:
    """A fresh id: ``<UTC yyyymmdd-HHMMSS>-<8 random hex>`` (sorts by creation time)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def write_json_atomic(path: str, data: object) -> None:
    """Replace ``path`` with ``data`` as JSON durably (temp file, fsync, rename, dir fsync)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(data, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    dfd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Registry:
    """Session records under ``state_base``."""

    def __init__(self, state_base: str) -> None:
        self.state_base = state_base

    def state_dir(self, session_id: str) -> str:
        return os.path.join(self.state_base, check_session_id(session_id))

    def create(self, record: SessionRecord) -> SessionRecord:
        """Create the state directory (0700) and write the record. Raises FileExistsError if
        the session id is taken."""
        os.makedirs(self.state_base, mode=0o700, exist_ok=True)
        os.mkdir(record.state_dir, 0o700)
        write_json_atomic(os.path.join(record.state_dir, RECORD), asdict(record))
        return record

    @contextlib.contextmanager
    def creating(self, record: SessionRecord) -> Iterator[SessionRecord]:
        """``create`` the session, holding its start lock (``START_LOCK``) from before the
        record exists until the block ends: open the session in the block. Raises
        FileExistsError if the session id is taken."""
        os.makedirs(self.state_base, mode=0o700, exist_ok=True)
        os.mkdir(record.state_dir, 0o700)
        with _start_lock(record.state_dir, wait=True):
            write_json_atomic(os.path.join(record.state_dir, RECORD), asdict(record))
            yield record

    @contextlib.contextmanager
    def starting(self, session_id: str, wait: bool = True) -> Iterator[None]:
        """Hold the start lock (``START_LOCK``) of session ``session_id``, whose state
        directory exists, for the block: around opening it again (resume), or removing
        it. ``wait``: block while another process holds it, else raise
        SessionStartingError. Raises SessionNotFoundError (no state directory)."""
        d = self.state_dir(session_id)
        if not os.path.isdir(d):
            raise SessionNotFoundError(session_id)
        with _start_lock(d, wait):
            yield

    def load(self, session_id: str) -> SessionRecord:
        """The record of ``session_id``. Raises SessionNotFoundError (no such session, or
        a record that cannot be read: see :meth:`listing`)."""
        try:
            return _read(os.path.join(self.state_dir(session_id), RECORD))
        except (ValueError, TypeError, FileNotFoundError, NotADirectoryError):
            raise SessionNotFoundError(session_id) from None

    def exists(self, session_id: str) -> bool:
        try:
            self.load(session_id)
        except SessionNotFoundError:
            return False
        return True

    def listing(self) -> tuple[list[SessionRecord], list[Unreadable]]:
        """Every registered session whose record can be read (oldest first), and every
        record that cannot (by name): a state directory named as a session id holding a
        ``session.json`` that is not JSON, not an object of the record's fields, or cannot
        be opened (other than missing: a session being created has its directory first,
        then its record; an entry named as no session id is not a session)."""
        try:
            names = os.listdir(self.state_base)
        except FileNotFoundError:
            return [], []
        out = []
        bad = []
        for name in names:
            try:
                path = os.path.join(self.state_dir(name), RECORD)
            except ValueError:
                continue
            try:
                out.append(_read(path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            except (ValueError, TypeError, OSError) as e:
                bad.append(Unreadable(name, f"{type(e).__name__}: {e}"))
        return sorted(out, key=lambda r: (r.created_ns, r.id)), sorted(bad)

    def list(self) -> list[SessionRecord]:
        """Every registered session whose record can be read, oldest first."""
        return self.listing()[0]


@dataclass(frozen=True, order=True)
class Unreadable:
    """A session record that cannot be read: the session id it is filed under and why
    (``<exception type>: <message>``)."""

    id: str
    reason: str


def _read(path: str) -> SessionRecord:
    """The session record in file ``path``. Raises OSError, ValueError (not JSON: also
    UnicodeDecodeError), TypeError (not an object of the record's fields, or a field of
    another type)."""
    with open(path, "rb") as f:
        data = json.loads(f.read())
    if not isinstance(data, dict):
        raise TypeError(f"a record is a JSON object, not {type(data).__name__}")
    rec = SessionRecord(**data)
    for name, kind in (("id", str), ("state_dir", str), ("backend", str), ("created_ns", int)):
        if type(getattr(rec, name)) is not kind:
            raise TypeError(f"field {name} is {type(getattr(rec, name)).__name__}")
    return rec


@contextlib.contextmanager
def _start_lock(state_dir: str, wait: bool) -> Iterator[None]:
    """flock ``START_LOCK`` in ``state_dir`` (a session's) exclusively for the block;
    SessionStartingError if ``wait`` is false and another process holds it."""
    fd = os.open(os.path.join(state_dir, START_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise SessionStartingError(os.path.basename(state_dir)) from None
        yield
    finally:
        os.close(fd)
