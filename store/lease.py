"""Leases (CONTRACT 4.2): exclusive, expiring claims on a name, kept in the ``leases`` table.

A lease is held by one holder (an opaque id such as ``host:pid:nonce``) until it expires or
is released. Each acquisition of a name by a new holder increases its epoch by one, so a
holder can stamp its writes with the epoch and a stale holder is recognisable. A crashed
holder's lease expires and the next ``acquire`` takes it over. Every change runs in one
``BEGIN IMMEDIATE`` transaction, so acquisitions are atomic across threads and processes.

Release keeps the row (holder cleared, expired) so the epoch keeps increasing. Times are
wall-clock ns (``time.time_ns``; injectable for tests), since holders live in different
processes. This module never touches FUSE or sessions: the session layer decides what a
lost lease means.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import LeaseBusyError, LeaseLostError
from .objects import Store


@dataclass(frozen=True, slots=True)
class Lease:
    """A held lease: ``expires_ns`` is wall-clock ns by which the holder must renew."""

    name: str
    holder: str
    epoch: int
    expires_ns: int


def holder_is_dead(holder: str) -> bool:
    """True if ``holder`` (``host:pid:nonce``) names a process of this host that no longer
    exists: its lease can be taken over before it expires (a holder killed with -9). A
    holder of another host, of another form, or whose pid is alive (even if reused) is
    trusted until its lease expires."""
    import errno
    import os
    import socket

    parts = holder.split(":")
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.ESRCH
    return False


class Leaser:
    """Acquire, renew and release leases in ``store``'s index."""

    def __init__(self, store: Store, *, clock: Callable[[], int] = time.time_ns) -> None:
        self.store = store
        self.clock = clock

    def _tx(self) -> sqlite3.Connection:
        c = self.store.conn
        c.execute("BEGIN IMMEDIATE")
        return c

    @staticmethod
    def _ttl_ns(ttl_s: float) -> int:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s!r}")
        return int(ttl_s * 1e9)

    def acquire(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Take ``name`` for ``holder`` for ``ttl_s`` seconds and return the Lease.

        A free name starts at epoch 1; an expired or released one is taken over with epoch
        + 1; the current holder re-acquiring extends its lease at the same epoch. Raises
        LeaseBusyError(name, holder, epoch, expires_ns) naming the current holder
        otherwise.
        """
        if not name or not holder:
            raise ValueError("lease name and holder must be non-empty")
        ttl = self._ttl_ns(ttl_s)
        c = self._tx()
        try:
            row = c.execute("SELECT holder, epoch, expires_ns FROM leases WHERE name=?",
                            (name,)).fetchone()
            now = self.clock()
            if row is None:
                epoch = 1
            elif row[0] == holder and row[2] > now:
                epoch = row[1]
            elif row[2] <= now or holder_is_dead(row[0]):
                epoch = row[1] + 1
            else:
                raise LeaseBusyError(name, row[0], row[1], row[2])
            lease = Lease(name, holder, epoch, now + ttl)
            c.execute("INSERT OR REPLACE INTO leases(name, holder, epoch, expires_ns) "
                      "VALUES (?, ?, ?, ?)", (name, holder, epoch, lease.expires_ns))
            c.execute("COMMIT")
            return lease
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend ``lease`` to now + ``ttl_s``. Raises LeaseLostError if it was taken over or
        released (a lease that expired but was not taken yet can still be renewed)."""
        ttl = self._ttl_ns(ttl_s)
        c = self._tx()
        try:
            row = c.execute("SELECT holder, epoch FROM leases WHERE name=?",
                            (lease.name,)).fetchone()
            if row is None or row[0] != lease.holder or row[1] != lease.epoch:
                raise LeaseLostError(lease.name, lease.holder, lease.epoch)
            new = Lease(lease.name, lease.holder, lease.epoch, self.clock() + ttl)
            c.execute("UPDATE leases SET expires_ns=? WHERE name=?", (new.expires_ns, lease.name))
            c.execute("COMMIT")
            return new
        except BaseException:
            c.execute("ROLLBACK")
            raise

    def release(self, lease: Lease) -> None:
        """Give ``lease`` up; a no-op if it is no longer held by this holder and epoch."""
        self.store.conn.execute(
            "UPDATE leases SET holder='', expires_ns=0 WHERE name=? AND holder=? AND epoch=?",
            (lease.name, lease.holder, lease.epoch))

    def current(self, name: str) -> Lease | None:
        """The unexpired lease on ``name``, or None if it is free."""
        row = self.store.conn.execute("SELECT holder, epoch, expires_ns FROM leases "
                                      "WHERE name=?", (name,)).fetchone()
        if row is None or not row[0] or row[2] <= self.clock():
            return None
        return Lease(name, row[0], row[1], row[2])

    def held(self, lease: Lease) -> bool:
        """True while ``lease`` is unexpired and still this holder's at this epoch; False is
        the lost signal."""
        cur = self.current(lease.name)
        return cur is not None and cur.holder == lease.holder and cur.epoch == lease.epoch
