"""Typed errors of the store layer, in one module.

Each class's docstring says what went wrong; each instance carries the fields a caller needs
(ref, path, key, cause) and an ``exit_code`` that the CLI returns. Nothing here imports FUSE.

Exit codes (documented in README): 1 generic store error, 2 usage (argparse), 3 invalid ref,
4 not found, 5 integrity failure, 6 destination problem, 7 limit exceeded, 8 GC refused,
11 blob backend failure (the S3 server: unreachable, refusing, timed out), 12 catalog
failure (the PostgreSQL catalog: unreachable, refusing the login, another schema
version). 9 and 10 are the mount's and the session's (fusefs).
"""

from __future__ import annotations

from typing import Any


class StoreError(Exception):
    """A store operation failed."""

    exit_code = 1


class InvalidRefError(StoreError, ValueError):
    """A text is not a Ref of the form ``v1:blake3:<64 lowercase hex>``."""

    exit_code = 3

    def __init__(self, value: Any, reason: str) -> None:
        self.value = value
        self.reason = reason
        super().__init__(f"invalid ref {value!r}: {reason}")


class ObjectNotFoundError(StoreError, KeyError):
    """An object id (chunk or tree) is not in the store index."""

    exit_code = 4

    def __init__(self, object_id: str) -> None:
        self.object_id = object_id
        super().__init__(f"object {object_id} is not in the store")

    def __str__(self) -> str:
        return str(self.args[0])


class RefNotFoundError(ObjectNotFoundError):
    """A well-formed Ref whose root tree is not in the store (exit 4 wherever a Ref is
    used: mount, restore, session, materialize, ls, cat)."""

    def __init__(self, ref: str) -> None:
        self.ref = ref
        StoreError.__init__(self, f"snapshot {ref} is not in the store")
        self.object_id = ref.rpartition(":")[2]


class SnapshotNotFoundError(StoreError, KeyError):
    """A path inside a snapshot does not exist (``ls``/``cat``)."""

    exit_code = 4

    def __init__(self, ref: str, path: str) -> None:
        self.ref = ref
        self.path = path
        super().__init__(f"{path!r} does not exist in {ref}")

    def __str__(self) -> str:
        return str(self.args[0])


class IntegrityError(StoreError):
    """Stored bytes do not hash to their id, or a stored object is malformed.

    ``ref`` is the snapshot (or object id) being read; ``got`` says what was found instead.
    """

    exit_code = 5

    def __init__(self, ref: str, got: str) -> None:
        self.ref = ref
        self.got = got
        super().__init__(f"integrity failure in {ref}: {got}")


SERVER_EXIT_CODES = frozenset({11, 12})
"""The exit codes of a failed server of the store: 11 the blob backend (``BackendError``:
S3, or the backend directory), 12 the shared catalog (``CatalogError``, PostgreSQL). An
operation that failed because of one (a snapshot, a checkpoint, a restore) exits with its
code."""


def typed_cause(cause: BaseException | str, cause_type: str | None = None,
                exit_code: int | None = None, *, otherwise: int) -> tuple[str | None, int]:
    """``(cause_type, exit_code)`` of an error with underlying ``cause``: the cause's class
    name (or ``cause_type``, given when the cause came as text through a control socket)
    and its exit code when it is a failed server's (``SERVER_EXIT_CODES``), else
    ``otherwise`` (the wrapping error's own code)."""
    if isinstance(cause, BaseException):
        cause_type = cause_type or getattr(cause, "cause_type", None) or type(cause).__name__
        if exit_code is None:
            exit_code = getattr(cause, "exit_code", None)
    code = exit_code if isinstance(exit_code, int) and exit_code in SERVER_EXIT_CODES \
        else otherwise
    return cause_type, code


class SnapshotError(StoreError):
    """A directory could not be imported; nothing it wrote is referenced. ``because``: the
    store's error that stopped it, if any; then ``cause_type`` is its class name and
    ``exit_code`` 11 or 12 when it is a failed server's (``typed_cause``), else 1."""

    exit_code = 1

    def __init__(self, root: str, cause: str, *, err: int | None = None,
                 because: BaseException | None = None) -> None:
        self.root = root
        self.cause = cause
        self.err = err  # the errno of the OSError behind ``cause``, where there was one
        self.cause_type: str | None = None
        if because is not None:
            self.cause_type, self.exit_code = typed_cause(because, otherwise=1)
        super().__init__(f"cannot snapshot {root}: {cause}")


class MaterializeError(StoreError):
    """A snapshot could not be written out; what was written has been wiped."""

    exit_code = 6

    def __init__(self, ref: str, dest: str, cause: BaseException | str) -> None:
        self.ref = ref
        self.dest = dest
        self.cause = cause
        super().__init__(f"cannot materialize {ref} into {dest}: {cause}")


class DestNotEmptyError(StoreError):
    """The destination holds a different tree; nothing was touched."""

    exit_code = 6

    def __init__(self, dest: str, want: str, got: str) -> None:
        self.dest = dest
        self.want = want
        self.got = got
        super().__init__(f"{dest} is not empty and holds {got}, not {want}")


class NotDirError(StoreError):
    """The destination exists and is not a directory."""

    exit_code = 6

    def __init__(self, dest: str) -> None:
        self.dest = dest
        super().__init__(f"{dest} exists and is not a directory")


class ArchiveEntryError(StoreError):
    """A tree entry is hostile or malformed (bad name, path too long, escape attempt)."""

    exit_code = 5

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"refusing entry {path!r}: {reason}")


class ArchiveLimitError(StoreError):
    """A materialize cap was exceeded; ``observed`` is what was counted when it tripped."""

    exit_code = 7

    def __init__(self, limit: str, cap: int, observed: int) -> None:
        self.limit = limit
        self.cap = cap
        self.observed = observed
        super().__init__(f"{limit} limit exceeded: {observed} > {cap}")


class GCError(StoreError):
    """Garbage collection refused to run or failed at one step; it can be re-run.
    ``because``: the store's error that stopped the step, if any; then ``cause_type`` is its
    class name and ``exit_code`` 11 or 12 when it is a failed server's (``typed_cause``),
    else 8 (a refusal, or a store that is not as GC needs it)."""

    exit_code = 8

    def __init__(self, op: str, key: str, cause: str, *,
                 because: BaseException | None = None) -> None:
        self.op = op
        self.key = key
        self.cause = cause
        self.cause_type: str | None = None
        if because is not None:
            self.cause_type, self.exit_code = typed_cause(because, otherwise=8)
        super().__init__(f"gc {op} {key}: {cause}")


class WritersBusyError(GCError):
    """``gc`` or ``rebuild-index`` on a shared store refused (nothing changed): writers
    (snapshots, checkpoints, seeds) of some hosts were still uploading to the store when
    its wait ran out. ``command`` is ``gc`` or ``rebuild-index``; ``writers`` lists each
    one still pinned as ``(host, pid, expires_in_s)`` (its pin's remaining life by the
    catalog server's clock, seconds); ``count`` is how many there were, ``wait_s`` the
    wait that ran out (s). The message says what to do: let them finish and run the
    command again, or wait longer (``--wait``); a writer that died lets go when its pin
    expires, or at once where the command runs on its host (a provably dead holder:
    ``store.lease.holder_is_dead``; such pins are dropped, not listed here)."""

    def __init__(self, command: str, writers: list[tuple[str, int | None, float]],
                 count: int, wait_s: float) -> None:
        self.command = command
        self.writers = writers
        self.count = count
        self.wait_s = wait_s
        who = ", ".join(f"{host}" + ("" if pid is None else f" pid {pid}")
                        + f" (pin expires in {max(0, round(left))} s)"
                        for host, pid, left in writers)
        more = f" and {count - len(writers)} more" if count > len(writers) else ""
        what = "writer is" if count == 1 else "writers are"
        cause = (f"{count} {what} still uploading to this store: {who}{more}; nothing "
                 f"{'deleted' if command == 'gc' else 'changed'}. Let the snapshot or "
                 f"checkpoint finish and run {command} again, or give it longer with "
                 f"--wait SECONDS (waited {wait_s:g} s); a writer that died lets go when "
                 f"its pin expires (at once for the {command} of its own host)")
        super().__init__("wait", "writers", cause)
        self.args = (f"{command} refused: {cause}",)


class RebuildShrinkError(GCError):
    """``rebuild-index`` refused (nothing changed): the store's listing lacks what the
    catalog indexes, so the rebuilt catalog would lose it: ``snapshots`` listed Refs and
    ``journal_events`` journal events (at least) with no record in the store, ``packs``
    indexed packs it does not list (their objects' rows would go, and every tree and file
    they hold with them). A listing of a damaged, emptied or wrong bucket or
    prefix looks so; the message says what to do: check the store (``verify``), or
    ``rebuild-index --force`` to index only what it holds. ``examples``: a few of the Refs
    and pack keys it would drop."""

    def __init__(self, snapshots: int, journal_events: int, examples: list[str],
                 packs: int = 0) -> None:
        self.snapshots = snapshots
        self.journal_events = journal_events
        self.packs = packs
        self.examples = examples
        lost = [f"{n} {what}{'' if n == 1 else 's'}"
                for n, what in ((snapshots, "listed snapshot"),
                                (journal_events, "journal event"), (packs, "pack")) if n]
        eg = f" (e.g. {', '.join(examples)})" if examples else ""
        cause = (f"the store's listing lacks {' and '.join(lost)} that the catalog indexes"
                 f"{eg}; the rebuilt catalog would lose them; nothing changed. Check that "
                 "this is the store's bucket and prefix and that it lists (verify), or run "
                 "rebuild-index --force to index only what the store holds")
        super().__init__("check", "history", cause)
        self.args = (f"rebuild-index refused: {cause}",)


class GCBusyError(GCError):
    """``gc`` or ``rebuild-index`` on a shared store refused (nothing changed): another
    ``gc`` or ``rebuild-index`` holds the store's ``gc`` lease. ``command`` is the refused
    command (``gc`` or ``rebuild-index``); ``host`` and ``pid`` name the holder (``pid`` None
    when its holder id has no pid); ``expires_in_s`` is how long its lease runs unless it is
    renewed (s, by the catalog server's clock; None if unknown), ``ttl_s`` the lease's ttl
    (s). The message says what to do: let it finish and run the command again; a holder
    that died lets go when its lease expires (at once for a command on its own host)."""

    def __init__(self, command: str, host: str, pid: int | None,
                 expires_in_s: float | None, ttl_s: float) -> None:
        self.command = command
        self.host = host
        self.pid = pid
        self.expires_in_s = expires_in_s
        self.ttl_s = ttl_s
        who = host + ("" if pid is None else f" pid {pid}")
        left = ("" if expires_in_s is None
                else f" (its lease runs out in {max(0, round(expires_in_s))} s unless renewed)")
        cause = (f"another gc or rebuild-index is running on this store: {who}{left}; "
                 f"nothing {'deleted' if command == 'gc' else 'changed'}. Let it finish and "
                 f"run {command} again; if it died, its lease lapses within {ttl_s:g} s "
                 f"(at once for the {command} of its own host)")
        super().__init__("check", "gc", cause)
        self.args = (f"{command} refused: {cause}",)


class BackendError(StoreError):
    """A blob backend operation failed."""

    exit_code = 11


class StoreFullError(BackendError):
    """The store's disk (its backend directory or its index) has no space left: ENOSPC
    (or EDQUOT). Nothing half-written is referenced; free space and try again. ``where``
    says what could not be written; ``errno`` is ``errno.ENOSPC``."""

    errno = 28  # errno.ENOSPC
    exit_code = 1  # this host's disk, not a failing backend server

    def __init__(self, where: str, cause: object = None) -> None:
        self.where = where
        self.cause = "" if cause is None else str(cause)
        detail = f" ({self.cause})" if self.cause else ""
        super().__init__(f"no space left for the store (ENOSPC): cannot write {where}"
                         f"{detail}; free space on its disk and try again")


class BlobNotFoundError(BackendError, KeyError):
    """A backend key does not exist."""

    exit_code = 4

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"blob {key!r} not found")

    def __str__(self) -> str:
        return str(self.args[0])


class BlobConflictError(BackendError):
    """A key was put again with different bytes; backend objects are immutable."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"blob {key!r} already exists with different content")


class InvalidKeyError(BackendError, ValueError):
    """A backend key is not of the allowed form (``[A-Za-z0-9._-]`` segments joined by ``/``)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"invalid blob key {key!r}")


class StoreLockedError(StoreError):
    """Another process holds a lock that this operation needs."""


class LeaseBusyError(StoreError):
    """A lease is held by another holder and has not expired."""

    exit_code = 10

    def __init__(self, name: str, holder: str, epoch: int,
                 expires_ns: int | None = None) -> None:
        self.name = name
        self.holder = holder
        self.epoch = epoch
        self.expires_ns = expires_ns  # wall-clock ns the holder must renew by, if known
        super().__init__(f"lease {name!r} is held by {holder} (epoch {epoch})")


class LeaseLostError(StoreError):
    """A lease was taken over (or released) since the caller acquired it."""

    exit_code = 10

    def __init__(self, name: str, holder: str, epoch: int) -> None:
        self.name = name
        self.holder = holder
        self.epoch = epoch
        super().__init__(f"lease {name!r} epoch {epoch} held by {holder} is lost")


class FencedError(LeaseLostError):
    """A write stamped with a lease epoch that is no longer the lease's current one: the
    holder was taken over, so its late journal append or checkpoint is refused."""

    def __init__(self, name: str, epoch: int, current: int) -> None:
        self.current = current
        super().__init__(name, "", epoch)
        self.args = (f"lease {name!r}: a write of epoch {epoch} is refused, the lease is at "
                     f"epoch {current} (taken over)",)

    def __str__(self) -> str:
        return str(self.args[0])


class WriterPinLostError(StoreError):
    """A writer's pin in a shared catalog is gone (it expired and a GC removed it: see
    store/sharedgc.py), so what it uploaded may be deleted and its commit is refused."""

    def __init__(self, holder: str) -> None:
        self.holder = holder
        super().__init__(f"writer pin {holder} expired and was removed by a gc; nothing "
                         "was indexed, write again")


class CatalogError(StoreError):
    """The catalog (the shared metadata database) cannot be reached or used, or its schema
    is of another version than this program's."""

    exit_code = 12


class CatalogAuthError(CatalogError):
    """The catalog's server answered and refused the login: no such role, a password it
    asks for and none was given, a wrong one, or no pg_hba.conf entry for this client.
    ``catalog``: its URL (any password masked); ``reason``: the server's words (libpq's
    when no password was given), never the password."""

    def __init__(self, catalog: str, reason: str) -> None:
        self.catalog = catalog
        self.reason = reason
        super().__init__(f"the catalog at {catalog} refused the login ({reason}); check "
                         "the user in the URL and its password (PGPASSWORD, ~/.pgpass or "
                         "PGPASSFILE)")


_USERINFO_PASSWORD = r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*):[^\s/@]*@"
_PASSWORD_PARAM = r"(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&'\"]+)"


def redact(text: str) -> str:
    """``text`` (a URL, a libpq DSN or a message naming one) with every secret replaced by
    ``***``: the password of a URL's userinfo (``scheme://user:***@host``, an S3 endpoint's
    or a PostgreSQL URL's) and the value of a ``password=`` parameter (URL query or libpq
    keyword form; the rest of the query is kept). The one place secrets are masked."""
    import re

    text = re.sub(_USERINFO_PASSWORD, r"\1:***@", text)
    return re.sub(_PASSWORD_PARAM, r"\1***", text)


def has_secret(url: str) -> bool:
    """True if ``url`` (a URL or a libpq DSN) holds a password (what ``redact`` masks)."""
    return redact(url) != url
