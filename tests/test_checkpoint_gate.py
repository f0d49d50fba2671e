"""The admission gate a checkpoint and a restore pause (``fusefs.gate``), driven on a trio
loop without a mount: paused mutations and writable opens wait and are all released by
``resume``; read-only opens wait only while opens are paused; ``drain`` waits for the
mutations already admitted; a waiting checkpoint goes before new write permits.
"""

from __future__ import annotations

import trio
import trio.testing

from fusefs.gate import Gate


def test_pause_parks_mutations_and_resume_releases_them() -> None:
    async def main() -> None:
        g = Gate()
        done: list[str] = []

        async def mutate(name: str) -> None:
            async with g.mutation():
                done.append(name)

        async def open_(name: str, writable: bool) -> None:
            async with g.opening(writable):
                done.append(name)

        g.pause()
        async with trio.open_nursery() as n:
            n.start_soon(mutate, "m1")
            n.start_soon(open_, "w", True)
            n.start_soon(open_, "r", False)
            await trio.testing.wait_all_tasks_blocked()
            assert done == ["r"] and g.parked == 2  # reads go on, changes wait
            g.resume()
        assert sorted(done) == ["m1", "r", "w"] and g.parked == 0

        g.pause(opens=True)
        done.clear()
        async with trio.open_nursery() as n:
            n.start_soon(open_, "r", False)
            await trio.testing.wait_all_tasks_blocked()
            assert done == []  # a restore pauses every open
            g.resume(opens=True)
        assert done == ["r"]

    trio.run(main)


def test_drain_waits_for_admitted_mutations() -> None:
    async def main() -> None:
        g = Gate()
        finish = trio.Event()
        order: list[str] = []

        async def slow() -> None:
            async with g.mutation():
                await finish.wait()  # e.g. a write waiting for a chunk in a worker thread
                order.append("mutation done")

        async def checkpoint() -> None:
            async with g.paused_for():
                order.append("frozen")

        async with trio.open_nursery() as n:
            n.start_soon(slow)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(checkpoint)
            await trio.testing.wait_all_tasks_blocked()
            assert order == [] and g.paused
            finish.set()
        assert order == ["mutation done", "frozen"] and not g.paused

    trio.run(main)


def test_waiting_checkpoint_goes_before_new_permits() -> None:
    async def main() -> None:
        g = Gate()
        order: list[str] = []
        release = trio.Event()

        async def tool(name: str, hold: trio.Event | None) -> None:
            async with g.write_permit():
                order.append(f"{name} start")
                if hold is not None:
                    await hold.wait()
                order.append(f"{name} end")

        async def checkpoint() -> None:
            async with g.exclusive():
                await g.no_permits()
                order.append("checkpoint")

        async with trio.open_nursery() as n:
            n.start_soon(tool, "t1", release)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(checkpoint)
            await trio.testing.wait_all_tasks_blocked()
            n.start_soon(tool, "t2", None)
            await trio.testing.wait_all_tasks_blocked()
            assert order == ["t1 start"] and g.permits == 1
            release.set()
        assert order == ["t1 start", "t1 end", "checkpoint", "t2 start", "t2 end"]

    trio.run(main)
