"""Sessions that move between the hosts of a shared store (issue 13.4, amended CONTRACT 4.9).

On a shared catalog (``store.catalog.shared``: PostgreSQL, store/pgcatalog.py) every
session is registered in the catalog's session registry (``sessions``: id -> host,
record), written by the session process itself::

    {"state": "running" | "stopped" | "removed", "head": Ref text | null, "dirty": bool | null,
     "mode": placement mode, "parent": id or Ref | null, "created_ns", "time_ns",
     "epoch": session lease epoch, "spec": the workspace spec (host.spec_of)}

- ``running`` once the process holds the session lease, before the root is usable; a
  resume whose mount fails before it serves puts the row it found back (``put_back``);
- ``stopped`` at shutdown, after the tree is closed (unmounted, the upper persisted) and
  before the leases are released: ``head`` is the restore pointer (the last checkpoint or
  restore), ``dirty`` whether the upper still holds changes no checkpoint took (None: it
  cannot be told, e.g. a session without FUSE, whose plain directory has no dirty set, or
  a fixed root, written back into its directory).

A host opening a session whose row names another host (``check_move_in``):

- its lease is held there and unexpired: ``SessionBusyError`` (it runs, or has not been
  gone for a lease ttl yet);
- ``running`` (so its process ended without a shutdown: crashed, killed, or cut off until
  its lease expired) or ``dirty`` not False: ``SessionChangesElsewhereError`` naming the
  host, unless the caller explicitly gives those changes up (``discard_upper``: resume
  from ``head``; the other host's upper stays on its disk, and is dropped there when the
  session comes back);
- ``removed`` (``session rm`` there: the row is a tombstone): ``SessionNotFoundError``, also
  on a host that still holds stale local state of it;
- a fixed root (exclusive, shared) never moves (its tree is the directory on that host):
  ``SessionError``; fork it instead.

Otherwise the session moves: this host makes it a fresh local state directory under its
own placement, with no upper, so it serves ``head`` exactly (the same tree, digest-equal),
and publishes itself as the session's host. A host whose local state of a session is
stale (the session ran elsewhere since) drops that state the same way before it opens
it. Of two hosts moving one session at once, the session lease lets exactly one win.

The embedded store (one host) registers nothing here; its registry is the state
directories (``registry.py``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from store.ref import Ref

from .errors import (
    SessionBusyError,
    SessionChangesElsewhereError,
    SessionError,
    SessionNotFoundError,
)

log = logging.getLogger("rewindfs.session")

RUNNING = "running"
STOPPED = "stopped"
REMOVED = "removed"


@dataclass(frozen=True)
class SessionEntry:
    """A session's row in a shared catalog's registry (see the module docstring)."""

    id: str
    host: str
    state: str
    head: str | None
    dirty: bool | None
    mode: str | None
    parent: str | None
    created_ns: int
    spec: dict[str, Any]
    epoch: int = 0  # the session lease epoch of its writer (0: a record of before 13.4b)

    @classmethod
    def parse(cls, session: str, host: str, record: str) -> SessionEntry:
        try:
            d = json.loads(record)
            dirty = d.get("dirty")
            return cls(session, host, str(d["state"]), d.get("head") or None,
                       None if dirty is None else bool(dirty), d.get("mode"),
                       d.get("parent"), int(d.get("created_ns") or 0),
                       dict(d.get("spec") or {}), int(d.get("epoch") or 0))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise SessionError(f"the catalog's record of session {session!r} is not readable "
                               f"({e})") from None


def shared(store: Any) -> bool:
    return bool(store is not None and getattr(store.catalog, "shared", False))


def entry(store: Any, session_id: str) -> SessionEntry | None:
    """The registry row of ``session_id`` in ``store``'s shared catalog, or None (no such
    row, or an embedded store)."""
    if not shared(store):
        return None
    row = store.catalog.session(session_id)
    return None if row is None else SessionEntry.parse(session_id, row[0], row[1])


def elsewhere(store: Any, session_id: str) -> SessionEntry | None:
    """The registry row of ``session_id`` if another host may have run it last: the row
    names another host than this one, or names this one but is ``superseded`` (a holder
    of a later lease epoch journaled since: this host's local state of it is stale)."""
    from store.hostid import host_id

    e = entry(store, session_id)
    if e is None:
        return None
    if e.host != host_id() or superseded(e, store.journal(session_id)):
        return e
    return None


def superseded(e: SessionEntry, events: list[Any]) -> bool:
    """Whether row ``e`` is not current: one of the session's journal ``events`` was
    appended at a later session lease epoch than the row's writer held (a holder that
    took the session over and did not register itself: it ended before it could). Such
    a row does not tell where the session ran last nor how it was left. A row without an
    epoch (written before rows recorded it) is taken as current."""
    return e.epoch > 0 and any(ev.epoch > e.epoch for ev in events)


def last_holder_host(leaser: Any, session_id: str) -> str | None:
    """The host of the session lease's last holder if it did not release it (it still
    holds it, crashed, or was cut off), else None."""
    row = leaser.store.catalog.lease(lease_name(session_id))
    if row is None or not row[0]:
        return None
    return str(row[0]).rsplit(":", 2)[0]


def publish(store: Any, session_id: str, state: str, *, head: Ref | None,
            dirty: bool | None, mode: str | None, parent: str | None, created_ns: int,
            epoch: int, spec: dict[str, Any]) -> None:
    """Register ``session_id`` as this host's in ``state`` (no-op on an embedded store),
    fenced by the session lease at ``epoch`` (the writer's, > 0: a session process holds
    its lease whenever it writes here): FencedError, nothing written, if that lease is at
    another epoch (taken over since, or ``epoch`` 0: no lease held; store/catalog.py)."""
    if not shared(store):
        return
    from store.hostid import host_id

    store.catalog.put_session(session_id, host_id(), json.dumps({
        "state": state, "head": None if head is None else str(head), "dirty": dirty,
        "mode": mode, "parent": parent, "created_ns": created_ns, "time_ns": time.time_ns(),
        "epoch": epoch, "spec": spec}, sort_keys=True),
        fence=lease_name(session_id), epoch=epoch)


def row(store: Any, session_id: str) -> tuple[str, str] | None:
    """The raw registry row of ``session_id``, ``(host, record)``, or None (no row, or an
    embedded store): what ``put_back`` writes again."""
    return store.catalog.session(session_id) if shared(store) else None


def put_back(store: Any, session_id: str, before: tuple[str, str] | None,
             epoch: int) -> None:
    """Undo this host's ``running`` row of a session opened here that never served (its
    mount failed before it did: nothing of it changed here): write ``before`` (``row``'s
    value when it was opened) again, fenced by the session lease at ``epoch`` as
    ``publish`` (FencedError if it moved on). No-op for ``before`` None (no row then)."""
    if not shared(store) or before is None:
        return
    store.catalog.put_session(session_id, before[0], before[1],
                              fence=lease_name(session_id), epoch=epoch)


def lease_name(session_id: str) -> str:
    """The name of ``session_id``'s session lease (CONTRACT 4.2)."""
    return f"session/{session_id}"


def forget(store: Any, session_id: str, epoch: int) -> None:
    """``session rm`` of a session whose row is this host's, by the holder of its session
    lease at ``epoch`` (fenced as ``publish``): the row becomes a tombstone (state
    ``removed``), so that a host holding stale local state of it (from before it moved
    here) does not open that state again: it gets SessionNotFoundError."""
    from store.hostid import host_id

    e = entry(store, session_id)
    if e is None or e.host != host_id():
        return
    store.catalog.put_session(session_id, host_id(), json.dumps({
        "state": REMOVED, "head": e.head, "dirty": False, "mode": e.mode,
        "parent": e.parent, "created_ns": e.created_ns, "time_ns": time.time_ns(),
        "epoch": epoch, "spec": {}}, sort_keys=True),
        fence=lease_name(session_id), epoch=epoch)


def check_move_in(leaser: Any, e: SessionEntry, *, discard_upper: bool = False,
                  op: str = "resume") -> Ref:
    """May session ``e`` (a row naming another host, or ``superseded``) be opened here?
    Returns the Ref it would serve: the session's restore pointer, its journal's last
    checkpoint or restore (the row's head only for a journal that has none). Raises
    SessionNotFoundError (removed there: a tombstone), SessionBusyError (its lease is held
    elsewhere), SessionChangesElsewhereError (changes may be in another host's upper:
    reason ``crashed``, ``dirty``, ``unknown``, or ``superseded``, naming the host of the
    lease's last holder that did not release it, else ``unknown``; with
    ``discard_upper`` only if it has no head), SessionError (a fixed root, or no
    head)."""
    if e.state == REMOVED:
        raise SessionNotFoundError(e.id)
    cur = leaser.current(lease_name(e.id))
    if cur is not None:
        raise SessionBusyError(e.id, cur.epoch, cur.holder,
                               max(0.0, (cur.expires_ns - leaser.now_ns()) / 1e9))
    if op != "fork" and e.mode not in (None, "per-session"):
        raise SessionError(f"session {e.id} has a fixed root ({e.mode}) on host {e.host}; "
                           "such a session does not move: fork it here instead")
    from .journal import restore_pointer

    reason = None
    # A running row was written when it started, and any row may lag the journal: the
    # journal has its checkpoints and restores since.
    events = leaser.store.journal(e.id)
    pointer = restore_pointer(events)
    if pointer is not None:
        e = replace(e, head=str(pointer))
    if superseded(e, events):
        reason = "superseded"
        e = replace(e, host=last_holder_host(leaser, e.id) or "unknown")
    elif e.state != STOPPED:
        reason = "crashed"
    elif e.dirty is None:
        reason = "unknown"
    elif e.dirty:
        reason = "dirty"
    if reason is not None and (not discard_upper or e.head is None or op == "fork"):
        raise SessionChangesElsewhereError(e.id, e.host, reason, e.head, op)
    if e.head is None:
        raise SessionError(f"session {e.id} has no checkpoint to open on this host")
    if reason is not None:
        log.warning("session %s: resuming from %s on this host, giving up the changes its "
                    "upper on host %s may hold (%s)", e.id, e.head, e.host, reason)
    return Ref.parse(e.head)


def movable_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """The part of another host's workspace spec that moves with a session: the policy,
    path policies, quotas, lease ttl, placement mode; never that host's paths (store,
    state base, roots) nor its backend (each host runs what it has)."""
    return {k: v for k, v in spec.items()
            if k not in ("store", "path", "state_base", "backend")}
