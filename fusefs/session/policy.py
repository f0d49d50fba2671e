"""Snapshot policy (CONTRACT 4.3): when a session checkpoints by itself, and what a failure means.

``SnapshotPolicy`` is the caller's wish; ``SnapshotPolicy.resolved()`` validates it (an unset
trigger becomes ``on_idle``, a zero timeout 60 s). ``PolicyRunner`` runs it for one session:

- ``on_turn_done`` / ``on_step_done``: the session API's ``turn_done()`` / ``step_done()``.
- ``on_idle``: after ``idle_s`` seconds with no mutation (``mutated()`` is called when a
  mutating request or a write permit ends).
- ``best_effort``: checkpoints run on one worker thread and coalesce (a request arriving while
  one is queued joins it; while one runs, at most one more is queued); failures are logged.
- ``required``: the checkpoint runs in the caller, bounded by ``timeout_s``; a failure latches
  a fault that only a successful manual checkpoint clears (``manual_succeeded``).

The runner never touches files itself: it calls the ``checkpoint(trigger, timeout_s)`` it was
given. Journal trigger names are ``idle``, ``turn_done``, ``step_done``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from .errors import SessionFaultedError, SnapshotPolicyError

log = logging.getLogger("rewindfs.session")

MANUAL = "manual"
ON_IDLE = "on_idle"
ON_TURN_DONE = "on_turn_done"
ON_STEP_DONE = "on_step_done"
TRIGGERS = (MANUAL, ON_IDLE, ON_TURN_DONE, ON_STEP_DONE)
BEST_EFFORT = "best_effort"
REQUIRED = "required"
PRIORITIES = (BEST_EFFORT, REQUIRED)
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_IDLE_S = 5.0

# policy trigger -> journal trigger of the checkpoints it makes
JOURNAL_TRIGGER = {ON_IDLE: "idle", ON_TURN_DONE: "turn_done", ON_STEP_DONE: "step_done"}


@dataclass(frozen=True)
class SnapshotPolicy:
    """When to checkpoint. ``trigger`` None means on_idle; ``priority`` None means best_effort;
    ``timeout_s`` (seconds, 0 -> 60) bounds a checkpoint's wait; ``idle_s`` (seconds) is the
    quiet period of on_idle."""

    trigger: str | None = None
    priority: str | None = None
    timeout_s: float = 0
    idle_s: float = DEFAULT_IDLE_S

    def resolved(self) -> SnapshotPolicy:
        """Return the policy with defaults applied.

        Raises SnapshotPolicyError invalid_trigger, invalid_priority or invalid_timeout
        (a negative, non-numeric or non-finite timeout or quiet period).
        """
        trigger = ON_IDLE if self.trigger is None else self.trigger
        if trigger not in TRIGGERS:
            raise SnapshotPolicyError(SnapshotPolicyError.INVALID_TRIGGER,
                                      f"{self.trigger!r} is not one of {', '.join(TRIGGERS)}")
        priority = BEST_EFFORT if self.priority is None else self.priority
        if priority not in PRIORITIES:
            raise SnapshotPolicyError(SnapshotPolicyError.INVALID_PRIORITY,
                                      f"{self.priority!r} is not one of {', '.join(PRIORITIES)}")
        for name, v in (("timeout", self.timeout_s), ("idle period", self.idle_s)):
            if (isinstance(v, bool) or not isinstance(v, int | float) or v != v or v < 0
                    or v == float("inf")):
                raise SnapshotPolicyError(SnapshotPolicyError.INVALID_TIMEOUT,
                                          f"{name} {v!r} is not a non-negative number of seconds")
        timeout = float(self.timeout_s) or DEFAULT_TIMEOUT_S
        return replace(self, trigger=trigger, priority=priority, timeout_s=timeout,
                       idle_s=float(self.idle_s))


Checkpoint = Callable[[str, float], object]


class PolicyRunner:
    """Runs one session's resolved ``policy`` by calling ``checkpoint(trigger, timeout_s)``.

    Thread-safe. ``fault`` is the latched fault text (None when healthy).
    """

    def __init__(self, policy: SnapshotPolicy, checkpoint: Checkpoint, session_id: str) -> None:
        assert policy.trigger in TRIGGERS and policy.priority in PRIORITIES, "resolve first"
        self.policy = policy
        self._checkpoint = checkpoint
        self.session_id = session_id
        self.fault: str | None = None
        self._cv = threading.Condition()
        self._queued: str | None = None  # journal trigger of the queued best-effort run
        self._running = False
        self._stopped = False
        self._dirty = False
        self._last_mutation = time.monotonic()
        self._threads: list[threading.Thread] = []
        self.failures = 0

    def start(self) -> None:
        """Start the worker (best_effort) and the idle watcher (on_idle)."""
        if self.policy.priority == BEST_EFFORT and self.policy.trigger != MANUAL:
            self._spawn(self._worker, "checkpoint-worker")
        if self.policy.trigger == ON_IDLE:
            self._spawn(self._idle_watcher, "idle-watcher")

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=f"{name}-{self.session_id}", daemon=True)
        self._threads.append(t)
        t.start()

    # -- signals from the session -------------------------------------------------------

    def mutated(self) -> None:
        """A mutation ended: restart the quiet period."""
        with self._cv:
            self._dirty = True
            self._last_mutation = time.monotonic()
            self._cv.notify_all()

    def turn_done(self) -> None:
        self._event(ON_TURN_DONE)

    def step_done(self) -> None:
        self._event(ON_STEP_DONE)

    def manual_succeeded(self) -> None:
        """A manual checkpoint succeeded: clear the latched fault."""
        with self._cv:
            self.fault = None
            self._dirty = False

    def _event(self, trigger: str) -> None:
        if self.fault is not None and self.policy.priority == REQUIRED:
            raise SessionFaultedError(self.session_id, self.fault, terminal=False)
        if self.policy.trigger != trigger:
            return
        self.run(JOURNAL_TRIGGER[trigger])

    def run(self, journal_trigger: str) -> None:
        """Checkpoint now by policy: synchronously if required (raising the failure after
        latching it), else queued and coalesced."""
        if self.policy.priority == REQUIRED:
            try:
                self._checkpoint(journal_trigger, self.policy.timeout_s)
            except Exception as e:
                with self._cv:
                    self.fault = f"required {journal_trigger} checkpoint failed: {e}"
                    self.failures += 1
                raise
            with self._cv:
                self._dirty = False
            return
        with self._cv:
            if self._stopped:
                return
            if self._queued is None:
                self._queued = journal_trigger
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no best-effort checkpoint is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queued is not None or self._running:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self) -> None:
        """Stop checkpoint work: drop what is queued, wait for a running checkpoint to end."""
        with self._cv:
            self._stopped = True
            self._queued = None
            self._cv.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()

    # -- threads ------------------------------------------------------------------------

    def _worker(self) -> None:
        while True:
            with self._cv:
                while self._queued is None and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                trigger = self._queued
                assert trigger is not None
                self._queued = None
                self._running = True
                self._dirty = False
            try:
                self._checkpoint(trigger, self.policy.timeout_s)
            except Exception as e:
                self.failures += 1
                log.warning("session %s: best-effort %s checkpoint failed: %s",
                            self.session_id, trigger, e)
            finally:
                with self._cv:
                    self._running = False
                    self._cv.notify_all()

    def _idle_watcher(self) -> None:
        with self._cv:
            while not self._stopped:
                if not self._dirty:
                    self._cv.wait()
                    continue
                left = self._last_mutation + self.policy.idle_s - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                self._dirty = False
                if self.policy.priority == BEST_EFFORT:
                    if self._queued is None:
                        self._queued = "idle"
                    self._cv.notify_all()
                    continue
                self._cv.release()
                try:
                    self.run("idle")
                except Exception as e:
                    log.warning("session %s: required idle checkpoint failed: %s",
                                self.session_id, e)
                finally:
                    self._cv.acquire()
