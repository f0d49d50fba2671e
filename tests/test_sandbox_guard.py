"""fusefs.guard on its own, with real processes: what the daemon does on a hit (the FUSE
side is tests/test_path_policy_covers.py)."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator

import pytest
import trio

from fusefs.guard import SandboxGuard, start_ticks


@pytest.fixture
def proc() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "600"])
    try:
        yield p
    finally:
        p.kill()
        p.wait()


def test_a_hit_kills_the_bound_process_and_returns_once_it_exited(
        proc: subprocess.Popen[bytes]) -> None:
    g = SandboxGuard()
    token = g.register([(41, b".env"), (42, b"conf/app.lock")])
    assert g.bind(token, proc.pid, start_ticks(proc.pid)) is None
    trio.run(g.clear, 0, 7, 99)             # objects it does not cover: nothing happens
    assert proc.poll() is None
    trio.run(g.clear, 0, 99, 42)
    assert proc.poll() == -9                # exited (a zombie until reaped) before return
    assert not g.by_ino and g.end(token) == b"conf/app.lock"


def test_a_hit_before_the_bind_spoils_the_start(proc: subprocess.Popen[bytes]) -> None:
    g = SandboxGuard()
    token = g.register([(41, b".env")])
    trio.run(g.clear, 0, 41)
    assert g.bind(token, proc.pid, start_ticks(proc.pid)) == b".env"
    assert proc.poll() is None and g.end(token) is None


def test_a_bind_to_another_process_under_the_same_pid_is_refused(
        proc: subprocess.Popen[bytes]) -> None:
    g = SandboxGuard()
    token = g.register([(41, b".env")])
    with pytest.raises(ProcessLookupError):
        g.bind(token, proc.pid, start_ticks(proc.pid) - 1)


def test_a_restore_stops_those_under_its_paths_and_refuses_new_ones() -> None:
    g = SandboxGuard()
    a = g.register([(41, b"secrets/key")])
    b = g.register([(42, b"secretsdir")])
    assert g.under([b"secrets"]) == [g.sandboxes[a]]
    assert g.under([b"secrets/key/x", b"secret"]) == []
    assert len(g.under(None)) == 2
    with g.restoring([b"secrets"]):
        with pytest.raises(OSError) as e:
            g.register([(43, b"secrets/other")])
        assert e.value.errno == errno.EBUSY
        g.register([(44, b"elsewhere")])
    g.register([(43, b"secrets/other")])
    assert g.end(b) is None


def test_every_name_of_a_hard_linked_covered_object_counts_for_a_restore() -> None:
    """A covered object with two names (a user's hard link): a path restore of either name
    stops the sandbox, and a start during a restore of either is refused. Only the name
    given last counted, so `restore --path .env` left a command reading the restored .env."""
    g = SandboxGuard()
    a = g.register([(41, b".env"), (41, b"docs/alias")])
    assert g.under([b".env"]) == [g.sandboxes[a]]
    assert g.under([b"docs"]) == [g.sandboxes[a]]
    with g.restoring([b".env"]):
        with pytest.raises(OSError) as e:
            g.register([(45, b"docs/x"), (45, b".env")])
        assert e.value.errno == errno.EBUSY
