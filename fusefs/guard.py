"""The sandbox guard of a mount: running sandboxes' covers against a removed or replaced name.

A Bash sandbox covers the path policy's objects with mounts on their dentries, inside its
own mount namespace (``tools.sandbox``). When the daemon removes or replaces the dentry at a
covered name (UNLINK, RMDIR, RENAME of either name, a restore), the kernel detaches those
mounts and the sandbox would see the new object at that name. So each sandbox registers here
the inode numbers (and workspace paths) of the objects it covers and, once bwrap reported
it, the first process of its pid namespace; before the daemon performs such an operation on
a covered object it SIGKILLs that process (which ends every process of the namespace) and
waits until it has exited, and only then performs the operation. A sandbox registered
before its first process is known is spoiled instead (its command must not start).

Everything here runs on the daemon's event loop (the control threads call in through the
mount's ``call_sync``); :meth:`SandboxGuard.hits` is one dict lookup per inode, and nothing
when no sandbox is registered.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import select
import signal
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

STOP_WAIT_S = 10.0     # how long an operation waits for a killed sandbox to exit
_POLL_S = 0.005        # the exit check's period while waiting


@dataclass(eq=False)
class Sandbox:
    """One registered sandbox: ``covers`` maps inode number -> workspace path (bytes);
    ``pidfd`` of its pid namespace's first process once bound (-1 before); ``stopped``:
    why it was killed (a path), or None; ``spoiled``: a covered object changed before the
    process was bound."""

    covers: dict[int, bytes]
    pidfd: int = -1
    pidns: int = 0          # the inode of its pid namespace, once bound
    stopped: bytes | None = None
    spoiled: bytes | None = None
    gone: bool = False
    paths: frozenset[bytes] = field(default_factory=frozenset)


class GuardError(OSError):
    """A covering sandbox could not be confirmed gone within ``STOP_WAIT_S`` (EBUSY): the
    operation is refused rather than exposing the new object to it."""

    def __init__(self, path: bytes) -> None:
        super().__init__(errno.EBUSY, "a sandbox covering this path did not exit",
                         os.fsdecode(path))


def _at_or_below(path: bytes, tops: frozenset[bytes]) -> bool:
    """Whether workspace path ``path`` is one of ``tops`` or below one."""
    if path in tops:
        return True
    i = path.rfind(b"/")
    while i > 0:
        if path[:i] in tops:
            return True
        i = path.rfind(b"/", 0, i)
    return False


def _pid_namespace(pid: int) -> int:
    """The inode number of process ``pid``'s pid namespace, 0 when it cannot be read."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return 0


def _exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def start_ticks(pid: int) -> int:
    """The start time of process ``pid`` (clock ticks since boot, /proc/PID/stat field 22):
    with the pid, an identity a reused pid does not share. Raises OSError when gone."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rfind(b")") + 2:].split()[19])


class SandboxGuard:
    """The registry of running sandboxes of one mount (module docstring)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self.sandboxes: dict[int, Sandbox] = {}
        self.by_ino: dict[int, list[Sandbox]] = {}   # only sandboxes not yet gone
        self._restores: list[frozenset[bytes] | None] = []   # the paths of running restores

    @contextlib.contextmanager
    def restoring(self, paths: Iterable[bytes] | None) -> Iterator[None]:
        """While the block runs, a sandbox covering something at or below ``paths``
        (None: anything) is refused registration (a restore runs there)."""
        entry = None if paths is None else frozenset(paths)
        self._restores.append(entry)
        try:
            yield
        finally:
            self._restores.remove(entry)

    def _restored(self, covered: Iterable[bytes]) -> bool:
        for r in self._restores:
            if r is None or any(_at_or_below(c, r) for c in covered):
                return True
        return False

    # -- registration (from the control channel) -------------------------------------------

    def register(self, covers: Iterable[tuple[int, bytes]]) -> int:
        """Register a sandbox about to start, covering ``covers`` ((inode number, workspace
        path) pairs); returns its token."""
        pairs = list(covers)
        sb = Sandbox(dict(pairs))
        sb.paths = frozenset(path for _, path in pairs)  # every name of a hard-linked object
        if self._restored(sb.paths):
            raise OSError(errno.EBUSY, "a restore of a covered path is running")
        token = next(self._ids)
        self.sandboxes[token] = sb
        for ino in sb.covers:
            self.by_ino.setdefault(ino, []).append(sb)
        return token

    def bind(self, token: int, pid: int, ticks: int) -> bytes | None:
        """Bind the sandbox to its pid namespace's first process (``pid`` with start time
        ``ticks``, :func:`start_ticks`); returns the covered path that changed since
        :meth:`register` (the command must not start), else None. Raises KeyError for an
        unknown token, OSError when the process is gone or is another one."""
        sb = self.sandboxes[token]
        if sb.spoiled is not None:
            return sb.spoiled
        fd = os.pidfd_open(pid)
        try:
            if start_ticks(pid) != ticks:
                raise ProcessLookupError(errno.ESRCH, f"process {pid} is another one")
        except BaseException:
            os.close(fd)
            raise
        sb.pidfd = fd
        sb.pidns = _pid_namespace(pid)
        return None

    def end(self, token: int) -> bytes | None:
        """Forget the sandbox; returns the covered path whose change stopped it, or None."""
        sb = self.sandboxes.pop(token, None)
        if sb is None:
            return None
        self._drop(sb)
        if sb.pidfd >= 0:
            os.close(sb.pidfd)
            sb.pidfd = -1
        return sb.stopped

    def _drop(self, sb: Sandbox) -> None:
        if sb.gone:
            return
        sb.gone = True
        for ino in sb.covers:
            lst = self.by_ino.get(ino)
            if lst is not None:
                with contextlib.suppress(ValueError):
                    lst.remove(sb)
                if not lst:
                    del self.by_ino[ino]

    # -- the check (from the operations) ---------------------------------------------------

    def hits(self, *inos: int) -> list[Sandbox]:
        """The live sandboxes covering any of ``inos`` (0: none)."""
        by = self.by_ino
        if not by:
            return []
        out: list[Sandbox] = []
        for ino in inos:
            got = by.get(ino)
            if got:
                out.extend(sb for sb in got if sb not in out)
        return out

    def under(self, paths: Iterable[bytes] | None) -> list[Sandbox]:
        """The live sandboxes covering something at or below one of ``paths`` (workspace
        paths; None: the whole tree)."""
        live = [sb for sb in self.sandboxes.values() if not sb.gone]
        if paths is None or not live:
            return live
        tops = frozenset(paths)
        return [sb for sb in live if any(_at_or_below(c, tops) for c in sb.paths)]

    async def stop(self, found: list[Sandbox], ino: int = 0) -> None:
        """SIGKILL the first process of each sandbox in ``found`` and wait until each has
        exited (the path reported: the one it covers as inode ``ino``, else its first
        covered one); a sandbox not bound yet is spoiled. Raises GuardError when one is
        still there after ``STOP_WAIT_S``."""
        import trio

        waiting: list[Sandbox] = []
        for sb in found:
            path = sb.covers.get(ino) or min(sb.paths, default=b"")
            if sb.pidfd < 0:
                sb.spoiled = sb.spoiled or path
                self._drop(sb)
                continue
            if _exited(sb.pidfd):
                self._drop(sb)
                continue
            if sb.stopped is None:
                sb.stopped = path
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(sb.pidfd, signal.SIGKILL)
            waiting.append(sb)
        with trio.move_on_after(STOP_WAIT_S):
            while waiting:
                waiting = [sb for sb in waiting if sb.pidfd >= 0 and not _exited(sb.pidfd)]
                if waiting:
                    await trio.sleep(_POLL_S)
        if waiting:
            raise GuardError(waiting[0].stopped or b"")
        for sb in found:
            self._drop(sb)

    async def clear(self, requester: int, *inos: int) -> None:
        """Before removing or replacing the dentries of the objects ``inos`` (0: no
        object) for process ``requester``: stop every sandbox covering one of them, except
        the requester's own (its covered names are mount points there, which the kernel
        does not let it remove or replace, so its request names another link of the
        object; killing it would wait on this very request). Returns at once when none
        does; raises GuardError (:meth:`stop`)."""
        mine: int | None = None
        while self.by_ino:
            for ino in inos:
                found = self.hits(ino)
                if found and any(sb.pidns for sb in found):
                    if mine is None:
                        mine = _pid_namespace(requester) if requester > 0 else 0
                    found = [sb for sb in found if not (mine and sb.pidns == mine)]
                if found:
                    await self.stop(found, ino)
                    break
            else:
                return
