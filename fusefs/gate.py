"""The admission gate of a live mount: how checkpoint and restore pause changes.

The FUSE adapter (``operations.py``) runs every mutating request inside ``mutation()`` and
every open inside ``opening(writable)``. A checkpoint calls ``pause()`` (new mutations and
writable opens wait, parked in the event loop; reads never wait), then ``drain()`` (waits
until the mutations already admitted have finished, including those suspended in a worker
thread), does its work, and ``resume()`` releases everything parked. A restore pauses every
open too (``pause(opens=True)``).

Write permits are the same idea one level up (CONTRACT 5, Bash): a tool holds a permit while
it runs, and a checkpoint or restore waits until no permit is held before pausing; new
permits wait while one runs.

Event-loop only (trio); not thread safe. Never await the gate from a handler that already
holds it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import trio


class _Mutation:
    """``Gate.mutation()``: one shared object, no per-request allocation (it is entered
    once per mutating FUSE request, so it is written as a plain class, not a generator)."""

    __slots__ = ("gate",)

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def __aenter__(self) -> None:
        g = self.gate
        if g._paused:
            await g._wait_admitted(False)
        g._inflight += 1

    async def __aexit__(self, *exc: object) -> None:
        g = self.gate
        g._inflight -= 1
        if g._inflight == 0 and g._idle is not None:
            g._idle.set()


class _ReadOpen:
    """``Gate.opening(False)``: waits only while a restore pauses opens."""

    __slots__ = ("gate",)

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def __aenter__(self) -> None:
        if self.gate._opens_paused:
            await self.gate._wait_admitted(True)

    async def __aexit__(self, *exc: object) -> None:
        return None


class Gate:
    """Admission of changes on one mount (see the module docstring)."""

    def __init__(self) -> None:
        self._paused = 0  # nested pauses
        self._opens_paused = 0
        self._inflight = 0
        self._idle: trio.Event | None = None  # made by a drain that waits; set at zero
        self._resumed = trio.Event()
        self._resumed.set()
        self.parked = 0  # requests waiting for a resume right now
        self.permits = 0  # write permits held
        self._no_permits = trio.Event()
        self._no_permits.set()
        self._permit_block = 0  # checkpoints or restores waiting for permits to end
        self._permits_open = trio.Event()
        self._permits_open.set()
        self._mutation = _Mutation(self)
        self._read_open = _ReadOpen(self)

    @property
    def paused(self) -> bool:
        return self._paused > 0

    async def _wait_admitted(self, opens_only: bool) -> None:
        while (self._opens_paused if opens_only else self._paused):
            self.parked += 1
            try:
                await self._resumed.wait()
            finally:
                self.parked -= 1

    def mutation(self) -> AbstractAsyncContextManager[None]:
        """Hold admission for one mutating request (waits while paused)."""
        return self._mutation

    def opening(self, writable: bool) -> AbstractAsyncContextManager[None]:
        """Hold admission for an open: a writable open counts as a mutation; a read-only
        open waits only while a restore pauses opens."""
        return self._mutation if writable else self._read_open

    def pause(self, *, opens: bool = False) -> None:
        """Stop admitting mutations (and with ``opens`` every open) until ``resume``."""
        if self._paused == 0:
            self._resumed = trio.Event()
        self._paused += 1
        if opens:
            self._opens_paused += 1

    def resume(self, *, opens: bool = False) -> None:
        """Undo one ``pause`` (with the same ``opens``); the last one releases the parked."""
        if opens:
            self._opens_paused -= 1
        self._paused -= 1
        if self._paused == 0:
            self._resumed.set()

    async def drain(self) -> None:
        """Wait until no admitted mutation is running (call after ``pause``)."""
        while self._inflight:
            if self._idle is None or self._idle.is_set():
                self._idle = trio.Event()
            await self._idle.wait()

    @asynccontextmanager
    async def paused_for(self, *, opens: bool = False) -> AsyncIterator[None]:
        """``pause`` + ``drain`` for the block, ``resume`` on every way out."""
        self.pause(opens=opens)
        try:
            await self.drain()
            yield
        finally:
            self.resume(opens=opens)

    # -- write permits -----------------------------------------------------------------------

    @asynccontextmanager
    async def write_permit(self) -> AsyncIterator[None]:
        """Hold a whole-workspace write permit (waits while a checkpoint or restore runs
        or waits for permits)."""
        while self._permit_block or self._paused:
            if self._permit_block:
                await self._permits_open.wait()
            else:
                await self._wait_admitted(False)
        self.permits += 1
        if self.permits == 1:
            self._no_permits = trio.Event()
        try:
            yield
        finally:
            self.permits -= 1
            if self.permits == 0:
                self._no_permits.set()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """For the block: no new write permit is granted (the waiting checkpoint or
        restore goes first); use ``no_permits`` inside to wait for the held ones."""
        if self._permit_block == 0:
            self._permits_open = trio.Event()
        self._permit_block += 1
        try:
            yield
        finally:
            self._permit_block -= 1
            if self._permit_block == 0:
                self._permits_open.set()

    async def no_permits(self) -> None:
        """Wait until no write permit is held."""
        while self.permits:
            await self._no_permits.wait()
