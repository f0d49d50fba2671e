"""Leases: exclusive per name, increasing epochs, idempotent release, expiry takeover,
atomic across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store.errors import LeaseBusyError, LeaseLostError
from store.lease import Lease, Leaser
from store.objects import Store

S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * S

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def store(tmp_path: str) -> Store:
    return Store(os.path.join(tmp_path, "store"))


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_acquire_busy_release(store: Store, clock: Clock) -> None:
    ls = Leaser(store, clock=clock)
    a = ls.acquire("session/1", "A", 10)
    assert a == Lease("session/1", "A", 1, clock.now + 10 * S)
    with pytest.raises(LeaseBusyError) as ei:
        ls.acquire("session/1", "B", 10)
    assert (ei.value.name, ei.value.holder, ei.value.epoch) == ("session/1", "A", 1)
    assert ls.current("session/1") == a
    assert ls.acquire("session/2", "B", 10).epoch == 1  # names are independent
    ls.release(a)
    ls.release(a)  # idempotent
    assert ls.current("session/1") is None
    b = ls.acquire("session/1", "B", 10)
    assert b.epoch == 2 and b.holder == "B"
    ls.release(a)  # a stale release does not drop the new holder's lease
    assert ls.current("session/1") == b


def test_reacquire_by_holder_keeps_epoch(store: Store, clock: Clock) -> None:
    ls = Leaser(store, clock=clock)
    a = ls.acquire("n", "A", 10)
    clock.now += 5 * S
    again = ls.acquire("n", "A", 10)
    assert again.epoch == a.epoch and again.expires_ns == clock.now + 10 * S


def test_expiry_takeover_and_lost_signal(store: Store, clock: Clock) -> None:
    ls = Leaser(store, clock=clock)
    a = ls.acquire("root", "A", 10)
    clock.now += 9 * S
    a = ls.renew(a, 10)
    clock.now += 9 * S
    with pytest.raises(LeaseBusyError):
        ls.acquire("root", "B", 10)
    assert ls.held(a)
    clock.now += 2 * S  # expired: anyone may take it
    assert not ls.held(a)
    assert ls.current("root") is None
    b = ls.acquire("root", "B", 10)
    assert b.epoch == a.epoch + 1
    with pytest.raises(LeaseLostError) as ei:
        ls.renew(a, 10)
    assert (ei.value.holder, ei.value.epoch) == ("A", a.epoch)
    assert ls.current("root") == b


def test_expired_but_not_taken_can_be_renewed(store: Store, clock: Clock) -> None:
    ls = Leaser(store, clock=clock)
    a = ls.acquire("n", "A", 1)
    clock.now += 5 * S
    a2 = ls.renew(a, 1)
    assert a2.epoch == a.epoch and ls.held(a2)


def test_renew_after_release_is_lost(store: Store, clock: Clock) -> None:
    ls = Leaser(store, clock=clock)
    a = ls.acquire("n", "A", 10)
    ls.release(a)
    with pytest.raises(LeaseLostError):
        ls.renew(a, 10)


def test_bad_arguments(store: Store) -> None:
    ls = Leaser(store)
    with pytest.raises(ValueError):
        ls.acquire("n", "A", 0)
    with pytest.raises(ValueError):
        ls.acquire("", "A", 1)
    with pytest.raises(ValueError):
        ls.acquire("n", "", 1)


def test_epochs_survive_reopen(tmp_path: str) -> None:
    root = os.path.join(tmp_path, "store")
    ls = Leaser(Store(root))
    ls.release(ls.acquire("n", "A", 60))
    assert Leaser(Store(root)).acquire("n", "B", 60).epoch == 2


_RACER = r"""
import sys
import time
from pathlib import Path
from store.objects import Store
from store.lease import Leaser
from store.errors import LeaseBusyError
store = Store(sys.argv[1])
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.readline()
try:
    lease = Leaser(store).acquire("contended", sys.argv[2], 600)
    print("won", lease.epoch)
except LeaseBusyError as e:
    print("busy", e.holder)
"""


def test_exactly_one_process_wins(tmp_path: str) -> None:
    root = os.path.join(tmp_path, "store")
    Store(root)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, root, f"p{i}"], cwd=repo,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        for p in procs:  # release them all at once
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60)[0].split() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    winners = [o for o in outs if o[0] == "won"]
    assert len(winners) == 1 and winners[0][1] == "1"
    holder = Leaser(Store(root)).current("contended")
    assert holder is not None
    assert all(o == ["busy", holder.holder] for o in outs if o[0] == "busy")


def test_a_dead_holder_of_this_host_is_taken_over_before_expiry(tmp_path, monkeypatch):
    import socket

    from store.hostid import host_id
    from store.lease import holder_is_dead

    store = Store(tmp_path / "s")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = f"{host_id()}:{child.pid}:abcd"
    alive = f"{host_id()}:1:abcd"
    assert holder_is_dead(dead)
    assert not holder_is_dead(alive)
    assert not holder_is_dead(f"otherhost:{child.pid}:abcd")
    # Another host id on the same machine (a second "host" of the tests, a container) is
    # never judged by this machine's pids, nor is the bare host name.
    assert not holder_is_dead(f"{socket.gethostname()}:{child.pid}:abcd")
    monkeypatch.setenv("REWINDFS_HOST_ID", "hostB")
    assert not holder_is_dead(dead)
    assert holder_is_dead(f"hostB:{child.pid}:abcd")
    monkeypatch.delenv("REWINDFS_HOST_ID")
    # A holder killed with -9 that its parent has not reaped yet (a zombie: init reaps
    # orphans late in some containers) is dead too; `session resume` right after the kill
    # was refused for the whole lease ttl while it lingered.
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] \
                != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert holder_is_dead(f"{host_id()}:{zombie.pid}:abcd")
    finally:
        zombie.wait()
    leaser = Leaser(store)
    first = leaser.acquire("session/x", dead, 3600)
    second = leaser.acquire("session/x", "me:1:zz", 3600)
    assert second.epoch == first.epoch + 1
