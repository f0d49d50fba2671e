"""The tools' context for one session: its binding, its root and the ledger of reads.

The ledger records, per workspace path, the blake3 digest of the whole file as the agent
last saw it (by ReadFile, or by its own WriteFile/EditFile). WriteFile and EditFile refuse to
change an existing file unless the ledger holds a digest that still matches the file.
"""

from __future__ import annotations

import threading

import blake3

from tools.binding import SessionBinding
from tools.paths import Root
from tools.sandbox import SandboxPolicy


def digest(data: bytes) -> str:
    """Hex blake3 of ``data``."""
    return blake3.blake3(data).hexdigest()


class ToolContext:
    """What every tool call gets: ``binding`` (the session), ``root`` (its containment root),
    ``sandbox`` (how Bash commands are confined) and the read ledger. One per binding;
    thread-safe."""

    def __init__(self, binding: SessionBinding,
                 sandbox: SandboxPolicy | None = None) -> None:
        self.binding = binding
        self.sandbox = sandbox if sandbox is not None else SandboxPolicy()
        self.root = Root(binding.root)
        self._reads: dict[str, str] = {}
        self._lock = threading.Lock()

    def record_read(self, rel: str, hexdigest: str) -> None:
        with self._lock:
            self._reads[rel] = hexdigest

    def recorded(self, rel: str) -> str | None:
        with self._lock:
            return self._reads.get(rel)

    def forget(self, rel: str) -> None:
        with self._lock:
            self._reads.pop(rel, None)
