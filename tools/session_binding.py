"""The agent tools bound to a live session, by id: what ``rewindfs mcp --session ID`` serves.

Owns :class:`SessionToolBinding`, a ``tools.binding.SessionBinding`` with every optional
call (checkpoint, log, diff, restore, the step log). It reaches the session only the way every client
does (CONTRACT 4.0): the session's registry record (its state directory), the control
socket recorded there (status, checkpoint, restore, write_permit) and the store (journal
and trees). So it works the same whichever process serves the session (the no-FUSE session
host or a FUSE mount daemon), and it must never touch a backend's private state or the
session's live tree other than through the tools.

The control socket path is read again for every request, so a session resumed by another
host process is found; a session with no live host answers ``SessionClosedError``.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import stat
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from fusefs.session.control import (
    SandboxRegistration,
    control_path,
    hold_background_writer,
    hold_write_permit,
    raise_reply,
    request,
    socket_dir,
)
from fusefs.session.errors import SessionClosedError, SessionError
from fusefs.session.host import SPEC_FILE
from fusefs.session.journal import CHECKPOINTED, STEP, Journal
from fusefs.session.placement import canonical_path
from fusefs.session.registry import Registry, SessionRecord
from store.diff import Change, diff_trees
from store.objects import Store
from store.pathpolicy import PathPolicy
from store.pathtext import text_path, text_paths
from store.ref import ObjectId, Ref
from store.resolve import checkpoint_labels, resolve_ref
from store.snapshot import compute_ref
from store.tree import Entry, Kind, Tree, decode_tree
from tools import messages as M
from tools.binding import PermitError
from tools.paths import PathError
from tools.walk import list_dir, open_subdir

COVERS_FILE = "covers.json"  # in a session's state directory: what its path policy covered
STATE_DIR_NAME = "sessions"  # the session state base under the store (fusefs.session.config)
_STATUS_TIMEOUT_S = 30.0


def state_base(store_root: str) -> str:
    """The directory holding the state directories of ``store_root``'s sessions."""
    return os.path.join(canonical_path(store_root), STATE_DIR_NAME)


class _LiveTrees:
    """Trees looked up first among those of a live directory computed in memory, then in
    the store (what ``store.diff.diff_trees`` needs from a store)."""

    def __init__(self, store: Store, trees: dict[ObjectId, bytes]) -> None:
        self._store = store
        self._trees = trees

    def get_tree(self, tree_id: ObjectId) -> Tree:
        data = self._trees.get(tree_id)
        if data is None:
            return self._store.get_tree(tree_id)
        return decode_tree(data, tree_id.hex())


class SessionToolBinding:
    """The tools' binding for session ``session_id`` of the store at ``store``.

    ``hidden``: further paths confined commands must not see. ``policy``: further path
    policy patterns, added to those of the session spec. ``permit_timeout_s``: how
    long ``write_permit`` waits for a running checkpoint or restore (None: as long as it
    takes; the session bounds its own operations by its policy timeout). Raises
    SessionNotFoundError for an unknown id and SessionClosedError when no host serves the
    session.
    """

    def __init__(self, store: Store | str | os.PathLike[str], session_id: str, *,
                 hidden: Sequence[str] = (), policy: PathPolicy | None = None,
                 permit_timeout_s: float | None = None) -> None:
        root = store.root if isinstance(store, Store) else os.path.abspath(os.fspath(store))
        # The record first: an unknown id or store is refused before a store is created.
        self.record: SessionRecord = Registry(state_base(root)).load(session_id)
        self.store: Store = store if isinstance(store, Store) else Store(root)
        self.id = session_id
        self.permit_timeout_s = permit_timeout_s
        self._hidden = tuple(os.path.abspath(h) for h in hidden)
        self._policy = recorded_policy(self.record.state_dir).merged(policy or PathPolicy())
        status = self._ask({"op": "status"}, _STATUS_TIMEOUT_S)
        # A session host answers "root"; a FUSE mount daemon "mountpoint".
        live_root = status.get("root") or status.get("mountpoint") or self.record.root
        self._root = os.path.abspath(str(live_root or ""))
        if not os.path.isdir(self._root):
            raise SessionClosedError(session_id)

    # -- the control socket ---------------------------------------------------------------

    def _socket(self) -> str:
        path = control_path(self.record.state_dir)
        if path is None:
            raise SessionClosedError(self.id)
        return path

    def _ask(self, req: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        path = self._socket()
        try:
            reply = request(path, req, timeout_s)
        except (ConnectionRefusedError, FileNotFoundError):
            raise SessionClosedError(self.id) from None
        return raise_reply(reply)

    # -- SessionBinding ---------------------------------------------------------------------

    @property
    def root(self) -> str:
        """The session's live root (a mount point, or a directory without FUSE)."""
        return self._root

    @contextlib.contextmanager
    def write_permit(self) -> Iterator[None]:
        """Hold the session's whole-workspace write permit, held by the session process
        for as long as this block runs (a checkpoint or restore waits for it). Raises
        PermitError when the session is stopped, closing or faulted."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(hold_write_permit(self._socket(),
                                                      self.permit_timeout_s))
            except (ConnectionRefusedError, FileNotFoundError):
                raise PermitError(SessionClosedError(self.id)) from None
            except (SessionError, OSError) as e:
                raise PermitError(e) from e
            yield

    @contextlib.contextmanager
    def background_writer(self) -> Iterator[None]:
        """Held while a background command runs (it holds no write permit). A FUSE mount
        captures its writes in the file system: nothing to do. A no-FUSE session is told,
        so that checkpoints taken meanwhile are journaled fuzzy. Raises PermitError when
        the session is stopped, closing or faulted."""
        if self.record.backend != "fallback":
            yield
            return
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(hold_background_writer(self._socket()))
            except (ConnectionRefusedError, FileNotFoundError):
                raise PermitError(SessionClosedError(self.id)) from None
            except (SessionError, OSError) as e:
                raise PermitError(e) from e
            yield

    def guard_sandbox(self, covers: list[tuple[int, str]]) -> SandboxRegistration | None:
        """Register a sandbox about to start with the FUSE mount's guard
        (``tools.binding.GuardsSandboxes``); None for a no-FUSE session (no daemon sees
        the changes) or no covers. Raises OSError when the host refuses or is gone."""
        if self.record.backend == "fallback" or not covers:
            return None
        try:
            return SandboxRegistration(self._socket(), covers)
        except SessionClosedError as e:
            raise OSError(errno.ESHUTDOWN, str(e)) from e

    def path_policy(self) -> PathPolicy:
        """The session's path policy (its spec's, plus what this binding was given)."""
        return self._policy

    def hidden_paths(self) -> Sequence[str]:
        """What a confined command must not see: the store (index, packs, journals), the
        session state directories, the control sockets, and for per-session placement the
        base directory, so other sessions' roots and restore scratch stay invisible (the
        root itself is mounted back over it)."""
        out = [self.store.root, state_base(self.store.root), self.record.state_dir,
               socket_dir(), *self._hidden]
        if self.record.mode == "per-session" and self.record.root is not None:
            out.append(os.path.dirname(self.record.root))
        kept: list[str] = []
        for p in sorted(out, key=len):  # a path under a hidden one is hidden already
            if not any(p == k or p.startswith(k.rstrip("/") + "/") for k in kept):
                kept.append(p)
        return kept

    def load_covers(self) -> dict[str, Any] | None:
        """What the path policy covered at the tools' last scan of this session
        (``tools.binding.KeepsCovers``), from its state directory; None when nothing was
        saved or the file cannot be read."""
        try:
            with open(os.path.join(self.record.state_dir, COVERS_FILE), "rb") as f:
                got = json.loads(f.read())
        except (OSError, ValueError):
            return None
        return got if isinstance(got, dict) else None

    def save_covers(self, record: dict[str, Any]) -> None:
        """Replace the saved record (written whole, then renamed over the old one)."""
        path = os.path.join(self.record.state_dir, COVERS_FILE)
        tmp = f"{path}.{os.getpid()}.{threading.get_native_id()}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f, separators=(",", ":"))
        os.replace(tmp, path)

    # -- session calls, answered as text for a model ---------------------------------------

    def checkpoint(self, label: str | None = None) -> str:
        """Checkpoint (trigger manual) through the session process; the answer names the
        Ref. ``label`` is kept with this checkpoint in the session's journal (``log`` shows
        it, ``@label`` finds it, also when an unchanged workspace gives the Ref of an
        earlier checkpoint) and with the Ref in the store's snapshot list. Raises the session's typed error (as HostError) on failure."""
        ref = self._ask({"op": "checkpoint", "trigger": "manual", "label": label})["ref"]
        if label:
            return M.SESSION_CHECKPOINTED_LABEL.format(ref=ref, label=label)
        return M.SESSION_CHECKPOINTED.format(ref=ref)

    def resolve(self, ref: str) -> Ref:
        """The Ref ``ref`` names as a person types it (``store.resolve``): a full Ref, a
        unique prefix of 8+ hex digits, ``@label`` (the newest in this session's journal)
        or ``@-N`` (this session's Nth checkpoint back). Raises InvalidRefError."""
        return resolve_ref(self.store, ref.strip(), session=self.id)

    def restore(self, ref: str, paths: list[str] | None = None) -> str:
        """Restore the workspace to ``ref`` (as ``resolve`` reads it) through the session
        process (the state before is checkpointed first); with ``paths`` (relative to the
        root) only those paths, each refused before anything changes when it, or anything
        below it in the live tree or in ``ref``, is hidden (PathError not_found) or
        protected (PathError protected) by the path policy. Raises InvalidRefError,
        PathError, or the session's error as HostError."""
        target_ref = self.resolve(ref)
        target = str(target_ref)
        req: dict[str, object] = {"op": "restore", "ref": target}
        if paths is not None:
            self._check_restore_paths(target_ref, paths)
            req["paths"] = list(paths)
        reply = self._ask(req)
        pre = reply.get("pre_restore")
        if paths is not None:
            target = f"{text_paths(reply.get('paths') or paths)} from {target}"
        if pre:
            return M.SESSION_RESTORED_UNDO.format(ref=target, pre=pre)
        return M.SESSION_RESTORED.format(ref=target)

    def _check_restore_paths(self, target: Ref, paths: list[str]) -> None:
        """Refuse a path restore that would change what the path policy hides or protects:
        each path, and every path below it in the live tree and in ``target``. Paths the
        session refuses anyway (``..``, absolute, the root) are left to it."""
        pol = self._policy
        if not (pol.hide or pol.protect):
            return
        for text in paths:
            parts = [c for c in text.split("/") if c and c != "."]
            if not parts or ".." in parts or text.startswith("/"):
                continue
            for rel, is_dir in [*self._live_below(parts), *self._ref_below(target, parts)]:
                if pol.hides(rel, is_dir):
                    raise PathError("not_found", text)
                if pol.protects(rel, is_dir):
                    raise PathError("protected", text)

    def _live_below(self, parts: list[str]) -> Iterator[tuple[str, bool]]:
        """``(path, is_dir)`` of the live path ``parts`` and everything below it, walked
        without following a symbolic link; nothing when it is absent."""
        fd = os.open(self._root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for comp in parts[:-1]:
                sub = open_subdir(fd, comp)
                os.close(fd)
                if sub is None:
                    return
                fd = sub
            rel = "/".join(parts)
            try:
                st = os.stat(parts[-1], dir_fd=fd, follow_symlinks=False)
            except OSError:
                return
            is_dir = stat.S_ISDIR(st.st_mode)
            yield rel, is_dir
            if not is_dir:
                return
            todo = [(rel, open_subdir(fd, parts[-1]))]
            while todo:
                prefix, dfd = todo.pop()
                if dfd is None:
                    continue
                try:
                    for entry in list_dir(dfd):
                        sub_dir = entry.is_dir(follow_symlinks=False)
                        path = f"{prefix}/{entry.name}"
                        yield path, sub_dir
                        if sub_dir:
                            todo.append((path, open_subdir(dfd, entry.name)))
                finally:
                    os.close(dfd)
        finally:
            os.close(fd)

    def _ref_below(self, target: Ref, parts: list[str]) -> Iterator[tuple[str, bool]]:
        """``(path, is_dir)`` of path ``parts`` in ``target`` and everything below it."""
        tree: Tree | None = self.store.root_tree(target)
        entry: Entry | None = None
        for comp in parts:
            if tree is None:
                return
            entry = tree.get(os.fsencode(comp))
            if entry is None:
                return
            tree = (self.store.get_tree(entry.tree_id)
                    if entry.kind is Kind.DIR and entry.tree_id is not None else None)
        assert entry is not None
        todo = [("/".join(parts), entry)]
        while todo:
            rel, e = todo.pop()
            yield rel, e.kind is Kind.DIR
            if e.kind is Kind.DIR and e.tree_id is not None:
                todo.extend((f"{rel}/{os.fsdecode(c.name)}", c)
                            for c in self.store.get_tree(e.tree_id).entries)

    def log(self) -> str:
        """The session's journal, oldest first, one line per event (times in UTC); a
        checkpoint shows the label it was given (``store.resolve.checkpoint_labels``)."""
        journal = Journal(self.store, self.id)
        events = journal.events()
        if not events:
            return M.SESSION_LOG_EMPTY
        labels = {e.seq: name for e, name in checkpoint_labels(self.store, self.id)}
        lines = []
        for e in events:
            when = datetime.datetime.fromtimestamp(e.time_ns / 1e9, datetime.UTC)
            t = when.strftime("%Y-%m-%dT%H:%M:%SZ")
            if e.event == CHECKPOINTED:
                line = M.SESSION_LOG_CHECKPOINT.format(seq=e.seq, time=t, trigger=e.trigger,
                                                       ref=e.ref)
                label = labels.get(e.seq)
                if label:
                    line += M.SESSION_LOG_LABEL.format(label=label)
                lines.append(line)
            elif e.event == STEP:
                rec = journal.record(e.seq)
                n = len(rec.get("changes") or [])
                label = f" {text_path(rec['label'])}" if rec.get("label") else ""
                lines.append(M.SESSION_LOG_STEP.format(seq=e.seq, time=t, step=rec.get("step"),
                                                       count=n, s="" if n == 1 else "s",
                                                       label=label))
            else:
                lines.append(M.SESSION_LOG_RESTORE.format(seq=e.seq, time=t, ref=e.ref))
        return "\n".join(lines)

    def step_done(self, label: str | None = None) -> None:
        """Close a step through the session process (``Session.step_done``): the journal
        records the paths changed since the previous step. Raises the session's error as
        HostError (its changes are then reported by the next step)."""
        self._ask({"op": "step_done", "label": label})

    def changes(self, step: int | None = None) -> str:
        """The paths step ``step`` changed, or (None) those of the last STEPS_SHOWN steps,
        one ``status path`` line each under a head line per step. Raises LookupError for a
        step the session does not have."""
        journal = Journal(self.store, self.id)
        if step is not None:
            try:
                shown = [journal.step_record(int(step))]
            except KeyError:
                count = sum(1 for e in journal.events() if e.event == STEP)
                raise LookupError(M.STEP_NOT_FOUND.format(step=step, count=count)) from None
        else:
            shown = journal.steps()[-M.STEPS_SHOWN:]
        if not shown:
            return M.STEPS_NONE
        lines = []
        hides = self._policy.hides
        for st in shown:
            st = dict(st, changes=[c for c in st["changes"]        # hidden: never named
                                   if not hides(c["path"], c.get("kind") == "dir")])
            n = len(st["changes"])
            label = f" ({text_path(st['label'])})" if st["label"] else ""
            lines.append(M.STEP_HEAD.format(step=st["step"], label=label, count=n,
                                            s="" if n == 1 else "s"))
            for c in st["changes"][:M.SESSION_DIFF_MAX]:
                path = text_path(c["path"] + ("/" if c.get("kind") == "dir" else ""))
                lines.append(M.SESSION_DIFF_LINE.format(status=c["status"], path=path))
            if n > M.SESSION_DIFF_MAX:
                lines.append(M.SESSION_DIFF_CAPPED.format(shown=M.SESSION_DIFF_MAX, total=n))
        return "\n".join(lines)

    def diff(self, ref_a: str | None = None, ref_b: str | None = None) -> str:
        """Paths changed from ``ref_a`` (default: the last checkpoint or restore) to
        ``ref_b`` (default: the live workspace, hashed in memory without writing to the
        store; that reads every file). At most SESSION_DIFF_MAX lines; paths the path
        policy hides are left out.

        Raises InvalidRefError, ObjectNotFoundError for a Ref not in the store,
        SnapshotError if the workspace changed while it was read."""
        if ref_a:
            a = self.resolve(ref_a)
        else:
            pointer = Journal(self.store, self.id).restore_pointer()
            if pointer is None:
                return M.SESSION_LOG_EMPTY
            a = pointer
        if ref_b:
            b = self.resolve(ref_b)
            changes = diff_trees(self.store, a.tree_id, b.tree_id)
            shown_b = str(b)
        else:
            trees: dict[ObjectId, bytes] = {}
            live = compute_ref(self._root, chunk_size=self.store.chunk_size, trees=trees)
            source: Any = _LiveTrees(self.store, trees)
            changes = diff_trees(source, a.tree_id, live.tree_id)
            shown_b = M.SESSION_DIFF_LIVE
        changes = [c for c in changes if not self._policy.hides(
            os.fsdecode(c.path), _is_dir(c))]                        # hidden: never named
        return render_changes(changes, str(a), shown_b)


def recorded_policy(state_dir: str) -> PathPolicy:
    """The path policy recorded in a session's spec (``host.json`` of its state directory);
    empty when there is none. Raises PathPolicyError for a malformed one."""
    try:
        with open(os.path.join(state_dir, SPEC_FILE), "rb") as f:
            spec = json.load(f)
    except FileNotFoundError:
        return PathPolicy()
    return PathPolicy.from_spec(spec.get("paths") if isinstance(spec, dict) else None)


def _is_dir(c: Change) -> bool:
    entry = c.new if c.new is not None else c.old
    return entry is not None and entry.kind is Kind.DIR


def render_changes(changes: list[Change], a: str, b: str) -> str:
    """``changes`` as text for a model: a head line, then one ``status path`` line each."""
    if not changes:
        return M.SESSION_DIFF_NONE.format(a=a, b=b)
    n = len(changes)
    lines = [M.SESSION_DIFF_HEAD.format(count=n, s="" if n == 1 else "s", a=a, b=b)]
    for c in changes[:M.SESSION_DIFF_MAX]:
        path = os.fsdecode(c.path)
        entry = c.new if c.new is not None else c.old
        if entry is not None and entry.kind is Kind.DIR:
            path += "/"
        lines.append(M.SESSION_DIFF_LINE.format(status=c.status, path=text_path(path)))
    if n > M.SESSION_DIFF_MAX:
        lines.append(M.SESSION_DIFF_CAPPED.format(shown=M.SESSION_DIFF_MAX, total=n))
    return "\n".join(lines)
