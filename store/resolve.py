"""Refs people can type: one resolver from a user's text to a Ref.

``Ref.parse`` stays the parser of full Refs (``v1:blake3:<64 hex>``). Everywhere the CLI,
the session API or the MCP tools accept a Ref, ``resolve_ref`` also accepts:

- a unique prefix of at least 8 hex digits (``26b779fd``, or ``v1:blake3:26b779fd``), among
  the Refs the store knows: its snapshot list and every session journal;
- ``@label``: the newest snapshot listed with that label; with a session, the newest one
  whose Ref is in that session's journal;
- ``@-N`` (N >= 1, only with a session): the Nth checkpoint back in the session's journal,
  ``@-1`` being its newest ``WorkspaceCheckpointed`` event (pre_restore, seed and fork
  checkpoints count; restores do not).

Anything else, an unknown or ambiguous prefix, an unknown label or a step past the journal's
start is ``InvalidRefError`` (CLI exit 3) whose reason names the candidates. Resolution
never checks that the Ref's trees are present; callers that need them ask the store
(``Store.root_tree``: RefNotFoundError). Nothing here imports FUSE.
"""

from __future__ import annotations

import re
from typing import Protocol

from .errors import InvalidRefError
from .objects import JournalEvent, SnapshotInfo
from .ref import Ref

MIN_PREFIX = 8
_PREFIX_RE = re.compile(r"(?:v1:blake3:)?([0-9a-f]{8,64})")
_BACK_RE = re.compile(r"@-([0-9]+)")
_CHECKPOINTED = "WorkspaceCheckpointed"
_SHOWN = 5  # candidates named in an error


class RefSource(Protocol):
    """What the resolver reads of a store (``store.objects.Store`` provides it)."""

    def list_snapshots(self) -> list[SnapshotInfo]: ...

    def journal(self, session: str) -> list[JournalEvent]: ...

    def journal_refs(self) -> list[Ref]: ...


def looks_like_ref(text: str) -> bool:
    """True if ``text`` has one of the forms ``resolve_ref`` reads (a Ref, a hex prefix,
    ``@...``), so that a caller taking "a Ref or a directory/session id" can tell them apart."""
    return text.startswith(("v1:", "@")) or _PREFIX_RE.fullmatch(text) is not None


def resolve_ref(store: RefSource, text: object, session: str | None = None) -> Ref:
    """The Ref that ``text`` names (see the module doc); ``session`` is the session id that
    scopes ``@label`` and enables ``@-N``. Raises InvalidRefError(text, reason)."""
    if isinstance(text, Ref):
        return text
    if not isinstance(text, str):
        raise InvalidRefError(text, "a Ref is a str")
    if text.startswith("v1:blake3:") and len(text) == len("v1:blake3:") + 64:
        return Ref.parse(text)
    if text.startswith("@-"):
        return _back(store, text, session)
    if text.startswith("@"):
        return _label(store, text, session)
    m = _PREFIX_RE.fullmatch(text)
    if m is None:
        return Ref.parse(text)  # the parser's own reason (version, length, case, ...)
    return _prefix(store, text, m.group(1))


def _prefix(store: RefSource, text: str, hexpart: str) -> Ref:
    known = {str(s.ref) for s in store.list_snapshots()} | {str(r) for r in store.journal_refs()}
    hits = sorted(r for r in known if r[len("v1:blake3:"):].startswith(hexpart))
    if len(hits) == 1:
        return Ref.parse(hits[0])
    if not hits:
        raise InvalidRefError(text, f"no snapshot or journal Ref starts with {hexpart}")
    raise InvalidRefError(text, f"prefix {hexpart} is ambiguous ({len(hits)} Refs): "
                                + ", ".join(hits[:_SHOWN]) + (" ..." if len(hits) > _SHOWN else ""))


def _label(store: RefSource, text: str, session: str | None) -> Ref:
    label = text[1:]
    if not label:
        raise InvalidRefError(text, "'@' needs a label (or '-N' with a session)")
    rows = [s for s in store.list_snapshots() if s.label == label]
    if session is not None:
        mine = {e.ref for e in store.journal(session)}
        rows = [s for s in rows if s.ref in mine]
    if not rows:
        where = f"session {session}" if session is not None else "the snapshot list"
        labels = sorted({s.label for s in store.list_snapshots() if s.label})
        raise InvalidRefError(text, f"no snapshot labelled {label!r} in {where}"
                                    + (f" (labels: {', '.join(labels[:_SHOWN])})" if labels else ""))
    return max(rows, key=lambda s: (s.time_ns, str(s.ref))).ref


def _back(store: RefSource, text: str, session: str | None) -> Ref:
    m = _BACK_RE.fullmatch(text)
    if m is None or int(m.group(1)) < 1:
        raise InvalidRefError(text, "want @-N with N >= 1")
    if session is None:
        raise InvalidRefError(text, "@-N counts checkpoints of a session; name the session")
    n = int(m.group(1))
    checkpoints = [e.ref for e in store.journal(session) if e.event == _CHECKPOINTED]
    if n > len(checkpoints):
        raise InvalidRefError(text, f"session {session} has {len(checkpoints)} checkpoint(s)")
    return checkpoints[-n]
