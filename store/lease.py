"""Leases (CONTRACT 4.2): exclusive, expiring claims on a name, kept in the catalog's
``leases`` table (store/catalog.py: embedded SQLite or shared PostgreSQL).

A lease is held by one holder (an opaque id such as ``host:pid:nonce``) until it expires or
is released. Each acquisition of a name by a new holder increases its epoch by one, so a
holder can stamp its writes with the epoch and a stale holder is recognisable. A crashed
holder's lease expires and the next ``acquire`` takes it over. Every change runs in one
catalog transaction that locks the row, so acquisitions are atomic across threads,
processes and hosts. Journal appends stamped with an epoch are fenced by it
(``Store.append_journal(fence=...)``): a holder that was taken over cannot append.

Release keeps the row (holder cleared, expired) so the epoch keeps increasing. Times are
wall-clock ns of the catalog's clock (``Catalog.clock_ns``; injectable for tests): this
host's for the embedded catalog, the PostgreSQL server's ``now()`` for a shared one, read
in the transaction that stamps or compares them, so a host whose clock is skewed can
neither take a lease early nor hold one past its expiry by the server's clock. This module never touches FUSE or sessions: the session layer decides what a
lost lease means.
"""

from __future__ import annotations

from collections.abc import Callable

from .catalog import Lease
from .hostid import host_id
from .objects import Store

__all__ = ["Lease", "Leaser", "holder_is_dead", "holder_name"]


def holder_name(pid: int, nonce: str) -> str:
    """A holder id ``host:pid:nonce`` of this host (``store.hostid.host_id``)."""
    return f"{host_id()}:{pid}:{nonce}"


def holder_is_dead(holder: str) -> bool:
    """True if ``holder`` (``host:pid:nonce``) names a process of this host (same host id)
    that no longer exists or has exited and waits to be reaped (a zombie: state ``Z`` or
    ``X`` in ``/proc/PID/stat``, proc(5)): its lease can be taken over before it expires (a
    holder killed with -9, whose parent, often init in a container, reaps it later). A
    holder of another host, of another form, or whose pid is alive (even if reused) is
    trusted until its lease expires."""
    import errno
    import os

    parts = holder.split(":")
    if len(parts) != 3 or parts[0] != host_id() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.ESRCH
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return False  # no procfs to tell: trusted, as any live pid
    return state in ([b"Z"], [b"X"])


class Leaser:
    """Acquire, renew and release leases in ``store``'s catalog (store/catalog.py: the
    rules, and the row lock that makes of two racing hosts exactly one winner)."""

    def __init__(self, store: Store, *, clock: Callable[[], int] | None = None) -> None:
        self.store = store
        self.clock = clock  # None: the catalog's clock (a shared catalog's: the server's)

    def now_ns(self) -> int:
        """The time every lease of this catalog is stamped and compared with (ns since the
        epoch): ``clock``, else the catalog's (``Catalog.clock_ns``)."""
        return self.clock() if self.clock is not None else self.store.catalog.clock_ns()

    def _now(self) -> int | None:
        return self.clock() if self.clock is not None else None

    @staticmethod
    def _ttl_ns(ttl_s: float) -> int:
        if not ttl_s > 0:
            raise ValueError(f"lease ttl must be positive, got {ttl_s!r}")
        return int(ttl_s * 1e9)

    def acquire(self, name: str, holder: str, ttl_s: float) -> Lease:
        """Take ``name`` for ``holder`` for ``ttl_s`` seconds and return the Lease.

        A free name starts at epoch 1; an expired or released one, or one whose holder is
        provably dead (``holder_is_dead``), is taken over with epoch + 1; the current holder
        re-acquiring extends its lease at the same epoch. Raises LeaseBusyError(name,
        holder, epoch, expires_ns) naming the current holder otherwise.
        """
        if not name or not holder:
            raise ValueError("lease name and holder must be non-empty")
        return self.store.catalog.lease_acquire(name, holder, self._ttl_ns(ttl_s),
                                                self._now(), holder_is_dead)

    def renew(self, lease: Lease, ttl_s: float) -> Lease:
        """Extend ``lease`` to now + ``ttl_s``. Raises LeaseLostError if it was taken over or
        released (a lease that expired but was not taken yet can still be renewed)."""
        return self.store.catalog.lease_renew(lease, self._ttl_ns(ttl_s), self._now())

    def release(self, lease: Lease) -> None:
        """Give ``lease`` up; a no-op if it is no longer held by this holder and epoch."""
        self.store.catalog.lease_release(lease)

    def current(self, name: str) -> Lease | None:
        """The unexpired lease on ``name``, or None if it is free."""
        row = self.store.catalog.lease(name)
        if row is None or not row[0] or row[2] <= self.now_ns():
            return None
        return Lease(name, row[0], row[1], row[2])

    def held(self, lease: Lease) -> bool:
        """True while ``lease`` is unexpired and still this holder's at this epoch; False is
        the lost signal."""
        cur = self.current(lease.name)
        return cur is not None and cur.holder == lease.holder and cur.epoch == lease.epoch

