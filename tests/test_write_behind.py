"""Write-behind timing (``Operations.admit`` and ``Operations.commit_loop``), in virtual time.

The handlers run in-process inside ``trio.run`` with a ``MockClock`` (no kernel mount) over a
real Overlay and Upper on real files; ``commit_loop`` runs with an hour's interval, so any
commit before that hour was asked for by ``admit``. Rules under test: once the unwritten
changes pass half of what the spill is sure to take, the background commit starts at once
(below half it does not); after a commit failed, the next attempt comes one interval later,
however many changes ask for it meanwhile.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

import pyfuse3
import trio
import trio.testing

from fusefs.inodes import ROOT_INO
from fusefs.lower import Lower
from fusefs.operations import Operations
from fusefs.overlay import Overlay
from fusefs.upper import DB_NAME, Upper
from store.objects import Store
from store.snapshot import snapshot

HOUR = 3600.0
PIECE = 4096  # bytes per write: inline content (a new file's first 16 KiB live in its row)


class Env:
    """A store with a one-file snapshot, and an Operations over an upper in ``state``."""

    def __init__(self, tmp: Path) -> None:
        src = tmp / "src"
        src.mkdir()
        (src / "lower.txt").write_bytes(b"from the lower\n")
        self.store = Store(tmp / "store")
        ref = snapshot(self.store, src)
        self.state = str(tmp / "state")
        up = Upper.open(self.state, store_root=self.store.root,
                        chunk_size=self.store.chunk_size, ref=ref)
        self.upper = up
        self.ops = Operations(Overlay(Lower(self.store, up.base), up, uid=0, gid=0),
                              no_open=False)
        self.made = 0  # files created through the handlers

    def committed_names(self) -> int:
        """Entries of the root directory in the upper's database, read by another
        connection: what commits wrote."""
        c = sqlite3.connect(os.path.join(self.state, DB_NAME))
        try:
            return int(c.execute("SELECT count(*) FROM dentries WHERE parent=?",
                                 (ROOT_INO,)).fetchone()[0])
        finally:
            c.close()

    async def write_file(self) -> None:
        """CREATE a new file in the root, WRITE 16 KiB of inline content in pieces, RELEASE:
        through the handlers, as the kernel sends them."""
        ops = self.ops
        fi, _ = await ops.create(ROOT_INO, f"f{self.made}".encode(), 0o644, os.O_WRONLY,
                                 pyfuse3.RequestContext())
        self.made += 1
        for off in range(0, 4 * PIECE, PIECE):
            assert await ops.write(fi.fh, off, b"w" * PIECE) == PIECE
        await ops.release(fi.fh)

    async def write_until(self, fraction: float) -> None:
        """Write new files until the overlay's pending changes (``pending_bytes``, not yet
        taken by a commit) pass ``fraction`` of the spill room."""
        ops = self.ops
        while ops.ov.pending_bytes <= fraction * self.upper.spill_room():
            await self.write_file()

    def run(self, body: Callable[[], Awaitable[None]]) -> None:
        """Run ``body`` with ``commit_loop(HOUR)`` in the background, in virtual time; then
        close the overlay as unmount does."""
        async def main() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.ops.commit_loop, HOUR)
                await body()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        finally:
            self.ops.close()
            self.store.close()


async def settled(ops: Operations, seconds: float) -> None:
    """Let ``seconds`` of virtual time pass, then wait for a commit under way to end (a
    commit holds ``upper_lock`` while its worker thread writes)."""
    await trio.sleep(seconds)
    async with ops.upper_lock:
        pass


def lock_upper(env: Env) -> sqlite3.Connection:
    """Another connection holding the upper's database for writing (a real SQLite lock);
    commits then fail at once (busy_timeout 0 on the upper's connection, instead of
    SQLite's 10 s of retries). ROLLBACK on it lets them succeed again."""
    env.upper.conn.execute("PRAGMA busy_timeout=0")
    holder = sqlite3.connect(os.path.join(env.state, DB_NAME), isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


async def fail_a_commit(env: Env) -> float:
    """Write past half of the spill room under ``lock_upper``: the commit admit asks for
    fails; the virtual time it failed by."""
    await env.write_until(0.5)
    await settled(env.ops, 1)
    assert env.ops.errors == 1
    return trio.current_time()


def test_commit_starts_once_unwritten_changes_pass_half_of_the_spill_room(
        tmp_path: Path) -> None:
    """Files written through the handlers stay in the overlay while they are below half
    of the spill room; the change that passes half has the batch in the database within a
    second of virtual time, not an hour."""
    env = Env(tmp_path)
    ops = env.ops
    assert env.upper.spill_room() > 64 * PIECE  # room for a few dozen files

    async def body() -> None:
        start = trio.current_time()
        await env.write_until(0.4)
        below = env.made
        await settled(ops, HOUR / 2)
        # Below half: nothing committed for half an hour of an hour's interval.
        assert env.committed_names() == 0
        assert ops.ov.dirty

        await env.write_until(0.5)
        await settled(ops, 1)
        assert trio.current_time() - start < HOUR  # well before the interval ran out
        assert env.committed_names() == env.made > below  # the whole batch, at once
        assert not ops.ov.dirty
        assert ops.errors == 0

    env.run(body)


def test_after_a_failed_commit_the_next_comes_one_interval_later_whatever_admit_asks(
        tmp_path: Path) -> None:
    """Another connection holds the upper's database for writing (a real SQLite lock):
    the commit admit asks for fails; more changes past half ask again at once, but the
    retry waits out the interval, and then writes everything."""
    env = Env(tmp_path)
    ops = env.ops
    holder = lock_upper(env)

    async def body() -> None:
        try:
            start = trio.current_time()
            failed_by = await fail_a_commit(env)
            assert failed_by - start <= 1
            holder.execute("ROLLBACK")  # the database can be written again

            first = env.made
            # The failed batch is still unwritten: every change on top of it is past half and
            # asks for a commit again (staying below the room, where admit would commit itself).
            await env.write_until(0.2)
            assert env.made > first
            assert trio.current_time() - failed_by < 1  # no commit of admit's own at the bound
            await settled(ops, start + HOUR - 1 - trio.current_time())
            assert env.committed_names() == 0  # not retried before the interval ran out
            assert ops.ov.dirty

            await settled(ops, failed_by + HOUR + 1 - trio.current_time())
            assert env.committed_names() == env.made  # the failed batch and the later one
            assert not ops.ov.dirty
            assert ops.errors == 1
        finally:
            holder.close()  # before the overlay closes: unmount writes

    env.run(body)


def test_after_a_failed_commit_the_retry_comes_one_interval_later_unasked(
        tmp_path: Path) -> None:
    """The commit admit asked for fails under a lock, and nothing changes afterwards:
    the retry still comes one interval after the failure, not two (a wait for the next
    interval or for admit after the failure's own)."""
    env = Env(tmp_path)
    ops = env.ops
    holder = lock_upper(env)

    async def body() -> None:
        try:
            failed_by = await fail_a_commit(env)
            holder.execute("ROLLBACK")
            await settled(ops, failed_by + HOUR + 1 - trio.current_time())
            assert env.committed_names() == env.made
            assert not ops.ov.dirty
        finally:
            holder.close()

    env.run(body)
