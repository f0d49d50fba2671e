"""The tools' context for one session: its binding, its root, the ledger of reads, and the
state one MCP connection keeps between calls (Bash's working directory, background jobs).

The ledger records, per workspace path, what the agent last saw of the file (a
:class:`Seen`: by ReadFile, or by its own WriteFile/EditFile). WriteFile and EditFile refuse
to change an existing file unless the ledger holds a record the file still matches
(:meth:`Seen.matches`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import blake3

from tools.binding import KeepsCovers, SessionBinding, path_policy
from tools.paths import Root
from tools.sandbox import SandboxPolicy

if TYPE_CHECKING:
    from tools.jobs import Jobs


def digest(data: bytes) -> str:
    """Hex blake3 of ``data``."""
    return blake3.blake3(data).hexdigest()


@dataclass(frozen=True)
class Seen:
    """What a read saw of a file. ``digest``: hex blake3 of its first ``length`` bytes;
    ``whole``: those were the whole file. A partial record (a capped text read, a binary or
    large image read) also keeps ``identity``: (st_dev, st_ino, st_size, st_mtime_ns,
    st_ctime_ns) at the read."""

    digest: str
    length: int
    whole: bool
    identity: tuple[int, int, int, int, int] | None

    @classmethod
    def whole_of(cls, data: bytes) -> Seen:
        return cls(digest(data), len(data), True, None)

    def matches(self, current: bytes, st: os.stat_result) -> bool:
        """Whether the file, now ``current`` with stat ``st``, is still what was seen: the
        same bytes for a whole record; for a partial one the same identity (any write
        changes ctime) and the same bytes over the part that was read."""
        if self.whole:
            return digest(current) == self.digest
        here = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        return here == self.identity and digest(current[:self.length]) == self.digest


class ToolContext:
    """What every tool call gets: ``binding`` (the session), ``root`` (its containment root),
    ``sandbox`` (how Bash commands are confined) and the read ledger; also the connection's
    Bash state: ``cwd`` (workspace-relative working directory, ``"."`` at first) and
    ``jobs`` (background commands). One per MCP connection; thread-safe."""

    def __init__(self, binding: SessionBinding,
                 sandbox: SandboxPolicy | None = None) -> None:
        self.binding = binding
        self.sandbox = sandbox if sandbox is not None else SandboxPolicy()
        self.root = Root(binding.root, path_policy(binding))
        if isinstance(binding, KeepsCovers) and (self.root.policy.hide
                                                 or self.root.policy.protect):
            saved = binding.load_covers()
            if saved is not None:
                self.root.covered.load(saved, self.root.real)
            self.root.keep = binding.save_covers
        self._reads: dict[str, Seen] = {}
        self._lock = threading.Lock()
        self.cwd = "."
        self._jobs: Jobs | None = None

    def record_read(self, rel: str, seen: Seen | str) -> None:
        """Record what was seen of ``rel``; a plain hex digest means the whole file."""
        if isinstance(seen, str):
            seen = Seen(seen, -1, True, None)
        with self._lock:
            self._reads[rel] = seen

    def recorded(self, rel: str) -> Seen | None:
        with self._lock:
            return self._reads.get(rel)

    def forget(self, rel: str) -> None:
        with self._lock:
            self._reads.pop(rel, None)

    @property
    def jobs(self) -> Jobs:
        """The background commands of this connection (created on first use)."""
        with self._lock:
            if self._jobs is None:
                from tools.jobs import Jobs
                self._jobs = Jobs()
            return self._jobs

    def close(self) -> None:
        """End the connection's background commands (their whole process trees)."""
        with self._lock:
            jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.close()
