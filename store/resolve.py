"""Refs people can type: one resolver from a user's text to a Ref.

``Ref.parse`` stays the parser of full Refs (``v1:blake3:<64 hex>``). Everywhere the CLI,
the session API or the MCP tools accept a Ref, ``resolve_ref`` also accepts:

- a unique prefix of at least 8 hex digits (``26b779fd``, or ``v1:blake3:26b779fd``), among
  the Refs the store knows: its snapshot list and every session journal; prefixes and full
  Refs are read in either case (``26B779FD``);
- ``@label``: the newest snapshot given that label (a listed Ref keeps every label it was
  given, ``Store.snapshot_labels``); with a session, the newest checkpoint of that session
  given that label (``checkpoint_labels``: the label each checkpoint was journaled with);
- ``@-N`` (N >= 1, only with a session): the Nth checkpoint back in the session's journal,
  ``@-1`` being its newest ``WorkspaceCheckpointed`` event (pre_restore, seed and fork
  checkpoints count; restores do not).

Anything else, a prefix under 8 digits, an unknown or ambiguous prefix, an unknown label or a
step past the journal's start is ``InvalidRefError`` (CLI exit 3) whose reason names the
candidates (at most ``SHOWN``; for a label, those of the session when there is one) and how
to list them. ``ref_form`` is the one reading of the text's form, for callers that check it
before they open a store. Resolution never checks that the Ref's trees are present; callers
that need them ask the store (``Store.root_tree``: RefNotFoundError). Nothing here imports
FUSE.
"""

from __future__ import annotations

import re
from typing import Any, Protocol

from .errors import InvalidRefError
from .objects import JournalEvent, SnapshotInfo
from .ref import Ref

MIN_PREFIX = 8
SHOWN = 5
"""Candidates an error names at most (prefixes, labels)."""
_FULL = "v1:blake3:"
_HEX_RE = re.compile(r"(?:v1:blake3:)?([0-9a-f]+)", re.IGNORECASE)
_BACK_RE = re.compile(r"@-([0-9]+)")
_CHECKPOINTED = "WorkspaceCheckpointed"
_FORMS = "want v1:blake3:<64 hex digits>, a prefix of 8 or more of them, @label or @-N"


class RefSource(Protocol):
    """What the resolver reads of a store (``store.objects.Store`` provides it)."""

    def list_snapshots(self) -> list[SnapshotInfo]: ...

    def snapshot_labels(self) -> list[tuple[Ref, str, int]]: ...

    def journal(self, session: str) -> list[JournalEvent]: ...

    def journal_refs(self) -> list[Ref]: ...

    def journal_record(self, session: str, seq: int) -> dict[str, Any]: ...


def checkpoint_labels(store: RefSource, session: str) -> list[tuple[JournalEvent, str]]:
    """The session's labelled checkpoints, oldest first: each ``WorkspaceCheckpointed``
    event with the label it was given (kept in its journal record), or, for an event
    journaled without that field, the label the snapshot list gives its Ref."""
    listed = {s.ref: s.label for s in store.list_snapshots() if s.label}
    out = []
    for e in store.journal(session):
        if e.event != "WorkspaceCheckpointed":
            continue
        try:
            rec = store.journal_record(session, e.seq)
        except KeyError:  # the record is lost: the index row alone
            rec = {}
        label = rec["label"] if "label" in rec else listed.get(e.ref)
        if label:
            out.append((e, str(label)))
    return out


def looks_like_ref(text: str) -> bool:
    """True if ``text`` has one of the forms ``resolve_ref`` reads (a Ref, a hex prefix of
    8 or more digits, ``@...``), so that a caller taking "a Ref or a directory/session id"
    can tell them apart."""
    if text[:3].lower() == "v1:" or text.startswith("@"):
        return True
    m = _HEX_RE.fullmatch(text)
    return m is not None and len(m.group(1)) >= MIN_PREFIX


def ref_form(text: object) -> Ref | str | None:
    """What form ``text`` has: the Ref it spells out in full (``v1:blake3:`` and 64 hex
    digits, either case), or the lower-case hex digits of a prefix (8 to 64 of them, with or
    without ``v1:blake3:``; the store tells which Ref they name), or None for ``@label`` and
    ``@-N``. Raises InvalidRefError(text, reason) for text of no form, a prefix under
    ``MIN_PREFIX`` digits included."""
    if isinstance(text, Ref):
        return text
    if not isinstance(text, str):
        raise InvalidRefError(text, "a Ref is a str")
    if text.startswith("@"):
        return None
    m = _HEX_RE.fullmatch(text)
    if m is None:
        if text[:3].lower() == "v1:":
            return Ref.parse(text)  # the parser's own reason (algorithm, digits, ...)
        raise InvalidRefError(text, _FORMS)
    digits = m.group(1).lower()
    if len(digits) < MIN_PREFIX:
        raise InvalidRefError(text, f"a prefix needs at least {MIN_PREFIX} hex digits, this "
                                    f"has {len(digits)}")
    if len(digits) > 64:
        raise InvalidRefError(text, f"{len(digits)} hex digits, a Ref has 64")
    if len(digits) == 64 and len(text) > 64:  # v1:blake3: and every digit: a full Ref
        return Ref.parse(_FULL + digits)
    return digits


def resolve_ref(store: RefSource, text: object, session: str | None = None) -> Ref:
    """The Ref that ``text`` names (see the module doc); ``session`` is the session id that
    scopes ``@label`` and enables ``@-N``. Raises InvalidRefError(text, reason)."""
    form = ref_form(text)
    if isinstance(form, Ref):
        return form
    assert isinstance(text, str)
    if form is not None:
        return _prefix(store, text, form)
    if text.startswith("@-"):
        return _back(store, text, session)
    return _label(store, text, session)


def _some(names: list[str]) -> str:
    """At most SHOWN of ``names``, and how many more there are."""
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def _prefix(store: RefSource, text: str, hexpart: str) -> Ref:
    known = {str(s.ref) for s in store.list_snapshots()} | {str(r) for r in store.journal_refs()}
    hits = sorted(r for r in known if r[len(_FULL):].startswith(hexpart))
    if len(hits) == 1:
        return Ref.parse(hits[0])
    if not hits:
        raise InvalidRefError(text, f"no snapshot or journal Ref starts with {hexpart}")
    raise InvalidRefError(text, f"prefix {hexpart} is ambiguous ({len(hits)} Refs): "
                                + _some(hits) + "; give more digits")


def _label(store: RefSource, text: str, session: str | None) -> Ref:
    label = text[1:]
    if not label:
        raise InvalidRefError(text, "'@' needs a label (or '-N' with a session)")
    if session is not None:
        return _session_label(store, text, label, session)
    given = store.snapshot_labels()  # every label a listed Ref was given
    rows = [(t, str(ref), ref) for ref, name, t in given if name == label]
    if not rows:
        # the store's labels, newest first
        labels = list(dict.fromkeys(name for _, name, _ in sorted(
            given, key=lambda g: (g[2], str(g[0])), reverse=True)))
        raise InvalidRefError(text, f"no snapshot labelled {label!r} in the snapshot list"
                                    + (f" (its labels, newest first: {_some(labels)}; "
                                       "`rewindfs list` lists them)"
                                       if labels else " (it has no labels)"))
    return max(rows)[2]


def _session_label(store: RefSource, text: str, label: str, session: str) -> Ref:
    """``@label`` in a session: the newest of its checkpoints given that label."""
    given = checkpoint_labels(store, session)
    for e, name in reversed(given):
        if name == label:
            return e.ref
    labels = list(dict.fromkeys(name for _, name in reversed(given)))
    raise InvalidRefError(text, f"no snapshot labelled {label!r} in session {session}"
                                + (f" (its labels, newest first: {_some(labels)}; the "
                                   "session's log lists them)" if labels else
                                   " (it has no labels)"))


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
