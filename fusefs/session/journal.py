"""A session's journal (CONTRACT 4.5): what happened to its workspace, oldest first.

Events live in the store (``Store.append_journal``: a durable backend object, then an index
row), so they survive the session process and rebuild with the store. Three events exist:

- ``WorkspaceCheckpointed{ref, consistency, trigger}``: trigger is one of ``TRIGGERS``,
  consistency ``quiescent`` or ``fuzzy``;
- ``WorkspaceRestored{ref}``; a path restore (only some paths taken from a Ref) is a
  ``WorkspaceRestored`` of the tree it made (the live tree after it, a real Ref), with
  ``paths`` (relative to the root) and ``source`` (the Ref they came from) kept in the
  event's backend object (``Store.journal_record``), not in the journal's index row;
- ``WorkspaceStep{step, label, changes}`` (issue 14.1, the step change log): ``step`` is 1,
  2, ... per session, ``changes`` the paths changed since the previous step, each
  ``{path, status, kind}`` (status ``added``, ``removed``, ``modified`` or
  ``type_changed``); ``ref`` is the lower the step was seen on (no snapshot is taken).
  Its paths, label and the fingerprints the daemon continues from after a restart live in
  the event's backend object (``Store.journal_record``), which rebuilds with the store.

Each carries seq (1, 2, ... per session), time (ns) and the session lease epoch of the
appender. Snapshot before append, always: an event may only name a Ref whose root tree is
already committed in the store, so the journal never points at something missing. The
restore pointer is the Ref of the last checkpointed-or-restored event (steps do not move it).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from store.errors import StoreError
from store.objects import JournalEvent
from store.ref import Ref

from .errors import SessionError

CHECKPOINTED = "WorkspaceCheckpointed"
RESTORED = "WorkspaceRestored"
STEP = "WorkspaceStep"
TRIGGERS = ("manual", "idle", "interrupt", "turn_done", "step_done", "seed", "pre_restore",
            "fork", "shutdown")
CONSISTENCIES = ("quiescent", "fuzzy")
GROUP_COMMIT_S = 0.2  # a step's record is durable against a power loss this soon after it

log = logging.getLogger(__name__)


class JournalError(SessionError):
    """An event could not be appended; ``cause`` says why (the journal is unchanged)."""

    def __init__(self, session: str, cause: BaseException | str) -> None:
        self.session = session
        self.cause = cause
        super().__init__(f"cannot append to the journal of session {session}: {cause}")


class Journal:
    """The journal of session ``session_id`` in ``store`` (a ``store.objects.Store``)."""

    def __init__(self, store: Any, session_id: str) -> None:
        self.store = store
        self.session_id = session_id
        # (seq of the last event this object knows of, steps up to it): the next step's
        # number without listing the journal, while no other appender added events.
        self._known: tuple[int, int] | None = None

    def _check_committed(self, ref: Ref) -> None:
        if not self.store.has(ref.tree_id):
            raise JournalError(self.session_id, f"{ref} is not committed in the store")

    def checkpointed(self, ref: Ref, trigger: str, consistency: str, epoch: int,
                     label: str | None = None) -> int:
        """Append ``WorkspaceCheckpointed``; return its seq. ``label``: the label this
        checkpoint was given, kept in the event's backend object (``label_of``). Raises ValueError for an unknown
        trigger or consistency, JournalError if ``ref`` is not in the store, and
        store.errors.FencedError if the session lease is no longer at ``epoch`` (taken over:
        this holder may not append any more)."""
        if trigger not in TRIGGERS:
            raise ValueError(f"unknown checkpoint trigger {trigger!r}")
        if consistency not in CONSISTENCIES:
            raise ValueError(f"unknown consistency {consistency!r}")
        self._check_committed(ref)
        return self._appended(int(self.store.append_journal(
            self.session_id, CHECKPOINTED, ref, epoch=epoch, trigger=trigger,
            consistency=consistency, fence=self._fence(epoch),
            data={"label": label})))

    def restored(self, ref: Ref, epoch: int, paths: list[str] | None = None,
                 source: Ref | None = None) -> int:
        """Append ``WorkspaceRestored``; return its seq. ``paths`` and ``source``: a path
        restore (``ref`` is then the tree it made). Raises JournalError if ``ref`` is not
        in the store, FencedError as ``checkpointed``."""
        self._check_committed(ref)
        detail = None
        if paths is not None:
            detail = {"paths": list(paths), "source": str(source) if source else None}
        return self._appended(int(self.store.append_journal(
            self.session_id, RESTORED, ref, epoch=epoch, fence=self._fence(epoch),
            data=detail)))

    def _fence(self, epoch: int) -> str | None:
        # An epoch is that of the session lease: appends are fenced by it (none without).
        return f"session/{self.session_id}" if epoch else None

    def step(self, ref: Ref, label: str | None, changes: list[dict[str, Any]],
             fingerprints: dict[str, Any], epoch: int, durable: bool = True
             ) -> tuple[int, int]:
        """Append ``WorkspaceStep``; return (seq, step number). ``ref`` is the lower the
        changes were seen on. ``durable=False``: the record waits for the next barrier
        (``Store.append_journal``; ``GroupCommit`` runs one soon). Raises JournalError if
        ``ref`` is not in the store, FencedError as ``checkpointed``."""
        self._check_committed(ref)
        n = 1 + self._step_count()
        data = {"step": n, "label": label, "changes": changes, "fingerprints": fingerprints}
        seq = int(self.store.append_journal(self.session_id, STEP, ref, epoch=epoch,
                                            fence=self._fence(epoch), data=data,
                                            durable=durable))
        self._known = (seq, n) if seq == self._known_seq + 1 else None
        return seq, n

    @property
    def _known_seq(self) -> int:
        return self._known[0] if self._known is not None else -1

    def _step_count(self) -> int:
        """How many steps the journal holds: from what this object appended, while the
        journal's last seq is the one it knows (one indexed query), else by listing it."""
        known = self._known
        if known is not None and self.store.catalog.last_seq(self.session_id) == known[0]:
            return known[1]
        events = self.events()
        n = sum(1 for e in events if e.event == STEP)
        self._known = (events[-1].seq if events else 0, n)
        return n

    def _appended(self, seq: int) -> int:
        """Note a non-step event appended at ``seq`` (the step count is unchanged)."""
        known = self._known
        self._known = (seq, known[1]) if known is not None and seq == known[0] + 1 else None
        return seq

    def events(self) -> list[JournalEvent]:
        """Every event, oldest first."""
        return list(self.store.journal(self.session_id))

    def steps(self) -> list[dict[str, Any]]:
        """Every ``WorkspaceStep`` as ``step_dict`` gives it, oldest first (one backend
        read per step)."""
        return [step_dict(e, self.record(e.seq)) for e in self.events() if e.event == STEP]

    def record(self, seq: int) -> dict[str, Any]:
        """The backend object of event ``seq``; ``{"lost": True}`` when a power loss took it
        before its barrier (a step's record is made durable shortly after the step: see
        ``GroupCommit``), or left it damaged."""
        try:
            rec = self.store.journal_record(self.session_id, seq)
        except (KeyError, ValueError, OSError, StoreError):
            return {"lost": True}
        return rec if isinstance(rec, dict) else {"lost": True}

    def step_record(self, n: int) -> dict[str, Any]:
        """Step ``n`` (1-based) as ``step_dict`` gives it. Raises KeyError when the session
        has no step ``n``."""
        steps = [e for e in self.events() if e.event == STEP]
        if not 1 <= n <= len(steps):
            raise KeyError(f"session {self.session_id} has no step {n} (it has {len(steps)})")
        e = steps[n - 1]
        return step_dict(e, self.record(e.seq))

    def resume_point(self) -> tuple[dict[str, Any], dict[str, str]]:
        """(fingerprints, carried changes) the step log continues from after a restart: the
        fingerprints of the steps since the last checkpoint or restore, folded (a restart
        then reports only what changed after the last step). Changes carried over a
        checkpoint that no step recorded before the restart are reported by the next step
        only if they are still in the upper."""
        fps: dict[str, Any] = {}
        for e in self.events():
            if e.event != STEP:
                fps = {}
                continue
            rec = self.record(e.seq)  # a lost step: the next one reports its paths too
            for p, fp in (rec.get("fingerprints") or {}).items():
                if fp is None:
                    fps.pop(p, None)
                else:
                    fps[p] = tuple(fp)
        return fps, {}

    def last_seq(self) -> int:
        ev = self.events()
        return ev[-1].seq if ev else 0

    def restore_pointer(self) -> Ref | None:
        """The Ref of the last checkpointed-or-restored event (None for an empty journal)."""
        return restore_pointer(self.events())


def restore_pointer(events: list[JournalEvent]) -> Ref | None:
    """The Ref of the last checkpointed-or-restored event of ``events`` (None if none)."""
    for e in reversed(events):
        if e.event != STEP:
            return e.ref
    return None


def step_dict(e: JournalEvent, rec: dict[str, Any]) -> dict[str, Any]:
    """One step as plain data (the JSON shape of ``rewindfs log --changes --json``):
    ``{seq, time_ns, epoch, event, ref, step, label, changes: [{path, status, kind}]}``."""
    d = {"seq": e.seq, "time_ns": e.time_ns, "epoch": e.epoch, "event": e.event,
         "ref": str(e.ref), "step": rec.get("step"), "label": rec.get("label"),
         "changes": list(rec.get("changes") or [])}
    if rec.get("lost"):
        d["lost"] = True
    return d


def event_dict(e: JournalEvent) -> dict[str, object]:
    """One event as plain data (the JSON shape of ``rewindfs log --json``)."""
    d: dict[str, object] = {"seq": e.seq, "time_ns": e.time_ns, "epoch": e.epoch,
                            "event": e.event, "ref": str(e.ref)}
    if e.event == CHECKPOINTED:
        d["trigger"] = e.trigger
        d["consistency"] = e.consistency
    return d


def restore_detail(store: Any, e: JournalEvent) -> dict[str, Any]:
    """``paths`` and ``source`` of a path restore event (empty for any other event, or
    when its durable record cannot be read)."""
    if e.event != RESTORED:
        return {}
    try:
        got = store.journal_record(e.session, e.seq)
    except (KeyError, ValueError, OSError):  # a lost record: the index row still stands
        return {}
    return {k: got[k] for k in ("paths", "source") if k in got}


class GroupCommit:
    """The barrier of records appended with ``durable=False`` (a session's steps): one
    ``backend.sync()`` at most ``delay_s`` after the first record since the last one, for
    all of them (group commit), on a thread of its own; ``close`` runs the last one.

    What a crash loses: nothing when a process dies (the records are in the kernel's
    page cache, the index rows committed). A power loss or kernel crash before the barrier
    can lose the records of the steps of the last ``delay_s``: those steps then read as
    ``lost`` (no paths), and their changes are not lost, since the step log continues from
    the last step whose record survived (``Journal.resume_point``), so the first step
    after the restart reports them. Any durable write of the store (a checkpoint, a
    restore) is a barrier for the steps before it too."""

    def __init__(self, backend: Any, delay_s: float = GROUP_COMMIT_S) -> None:
        self.backend = backend
        self.delay_s = delay_s
        self._due = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def due(self) -> None:
        """A record waits for the barrier."""
        with self._lock:
            if self._stop.is_set():
                self._sync()
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="journal-barrier",
                                                daemon=True)
                self._thread.start()
        self._due.set()

    def _sync(self) -> None:
        try:
            self.backend.sync()
        except Exception as e:  # the records stay pending: the next barrier tries again
            log.warning("journal barrier failed (retried at the next one): %s", e)

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._stop.wait(self.delay_s)
            self._due.clear()
            self._sync()
            if self._stop.is_set():
                return

    def close(self) -> None:
        """Run the last barrier and stop the thread. Idempotent."""
        with self._lock:
            self._stop.set()
            t = self._thread
        self._due.set()
        if t is not None and t is not threading.current_thread():
            t.join()
        self._sync()
