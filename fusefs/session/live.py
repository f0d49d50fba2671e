"""What a session needs from its live tree, whoever serves it.

``LiveTree`` is implemented by the no-FUSE fallback (a real directory, ``fallback.py``) and
by the FUSE mount daemon (lower + upper behind a mount). The session runtime
(``runtime.py``) holds leases, the journal and the policy, and calls only these methods;
it never touches files itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from store.ref import Ref

# Called by ``swap`` right after the new tree is committed on disk and before any clean-up:
# appends ``WorkspaceRestored``. If it raises, the tree stays the new one and the restore
# fails with kind append_failed.
OnCommit = Callable[[], None]

# Called by ``recover`` for an interrupted restore that had committed: ``(ref, seq_before)``
# -> True once ``WorkspaceRestored{ref}`` is in the journal (appended now if its last seq is
# still ``seq_before``), False if it cannot be appended (then the tree is rolled back).
RollForward = Callable[[Ref, int], bool]


class LiveTree(Protocol):
    """One session's live tree.

    ``root`` is the path tools use; ``consistency`` what a checkpoint of it promises
    (``quiescent`` or ``fuzzy``).
    """

    root: str
    consistency: str

    def recover(self, roll_forward: RollForward) -> None:
        """Finish or roll back a restore interrupted by a crash (start-up recovery)."""
        ...

    def is_empty(self) -> bool:
        """True if the root is missing or an empty directory."""
        ...

    def install(self, ref: Ref) -> None:
        """Populate an empty (or missing) root with ``ref`` (seed and fork)."""
        ...

    def capture(self, origin: str) -> Ref:
        """Freeze the live tree into the store (committed and listed with ``origin``) and
        return its Ref. The caller holds the exclusive checkpoint permit."""
        ...

    def swap(self, ref: Ref, seq_before: int, on_commit: OnCommit) -> None:
        """Make the live tree exactly ``ref``. Raises RestoreError with kind symlink_root,
        symlink_component, path_escape, swap_failed (nothing changed), rollback_failed
        (the tree may be mixed) or append_failed (``on_commit`` failed, the tree is ``ref``).
        ``seq_before`` is the journal's last seq, kept for ``recover``."""
        ...

    def close(self) -> None:
        """Stop serving the tree (unmount, detach, or nothing for a plain directory)."""
        ...
