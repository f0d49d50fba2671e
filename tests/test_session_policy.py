"""The snapshot policy runner (CONTRACT 4.3) on its own: which events checkpoint, how
best-effort requests coalesce, how a required failure latches and what clears it.

The runner is given a checkpoint function; here it records its calls and can be held on an
event, so the order of events is controlled without timing.
"""

from __future__ import annotations

import threading
import time

import pytest

from fusefs.session.errors import SessionFaultedError
from fusefs.session.policy import PolicyRunner, SnapshotPolicy


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail: Exception | None = None

    def __call__(self, trigger: str, timeout_s: float) -> object:
        self.entered.set()
        self.gate.wait()
        self.calls.append(trigger)
        if self.fail is not None:
            raise self.fail
        return trigger


def runner(trigger: str, priority: str, rec: Recorder, **kw: float) -> PolicyRunner:
    r = PolicyRunner(SnapshotPolicy(trigger, priority, **kw).resolved(), rec, "s1")
    r.start()
    return r


@pytest.mark.parametrize("trigger,event,journal", [
    ("on_turn_done", "turn_done", "turn_done"), ("on_step_done", "step_done", "step_done")])
@pytest.mark.parametrize("priority", ["best_effort", "required"])
def test_each_trigger_fires_on_its_event_only(trigger: str, event: str, journal: str,
                                              priority: str) -> None:
    rec = Recorder()
    r = runner(trigger, priority, rec)
    other = "step_done" if event == "turn_done" else "turn_done"
    getattr(r, other)()
    getattr(r, event)()
    assert r.wait_idle(60)
    r.stop()
    assert rec.calls == [journal]


def test_manual_policy_never_checkpoints_by_itself() -> None:
    rec = Recorder()
    r = runner("manual", "best_effort", rec, idle_s=0)
    r.turn_done()
    r.step_done()
    r.mutated()
    assert r.wait_idle(60)
    r.stop()
    assert rec.calls == []


def test_best_effort_requests_coalesce() -> None:
    rec = Recorder()
    rec.gate.clear()
    r = runner("on_turn_done", "best_effort", rec)
    r.turn_done()
    assert rec.entered.wait(60)  # the first one is running and held
    for _ in range(10):
        r.turn_done()  # all of these join one queued run
    rec.gate.set()
    assert r.wait_idle(60)
    r.stop()
    assert rec.calls == ["turn_done", "turn_done"]


def test_best_effort_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    rec = Recorder()
    rec.fail = OSError(28, "No space left on device")
    r = runner("on_step_done", "best_effort", rec)
    r.step_done()
    assert r.wait_idle(60)
    r.stop()
    assert r.failures == 1 and r.fault is None
    assert "No space left" in caplog.text


def test_required_failure_latches_until_manual_success() -> None:
    rec = Recorder()
    rec.fail = OSError(5, "EIO")
    r = runner("on_turn_done", "required", rec)
    with pytest.raises(OSError):
        r.turn_done()
    assert r.fault is not None
    rec.fail = None
    with pytest.raises(SessionFaultedError) as ei:
        r.turn_done()
    assert not ei.value.terminal
    assert rec.calls == ["turn_done"], "a latched session does not checkpoint by policy"
    r.manual_succeeded()
    r.turn_done()
    assert r.fault is None and rec.calls == ["turn_done", "turn_done"]
    r.stop()


def test_stop_drops_queued_work_and_waits_for_the_running_one() -> None:
    rec = Recorder()
    rec.gate.clear()
    r = runner("on_turn_done", "best_effort", rec)
    r.turn_done()
    assert rec.entered.wait(60)
    r.turn_done()  # queued behind the running one
    t = threading.Thread(target=r.stop)
    t.start()
    rec.gate.set()
    t.join(60)
    assert not t.is_alive()
    assert rec.calls == ["turn_done"]
    r.turn_done()  # after stop: nothing runs
    assert rec.calls == ["turn_done"]


def test_idle_fires_once_per_quiet_period_after_mutations() -> None:
    rec = Recorder()
    r = runner("on_idle", "best_effort", rec, idle_s=0.05)
    assert r.wait_idle(60)
    assert rec.calls == []  # no mutation, no checkpoint
    r.mutated()
    deadline = time.monotonic() + 60
    while not rec.calls:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert r.wait_idle(60)
    r.stop()
    assert rec.calls == ["idle"]
