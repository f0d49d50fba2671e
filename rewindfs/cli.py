"""The ``rewindfs`` command: a thin front door over the Python API.

Subcommands are registered by small modules (``rewindfs/cmd_*.py``), each exposing
``register(subparsers)``; a handler takes the parsed arguments and returns an exit code.
Imports of heavy modules happen inside handlers so that a short command starts fast.

Exit codes: 0 success; 1 generic failure; 2 usage error; 3 invalid Ref; 4 not found;
5 integrity failure; 6 destination problem; 7 limit exceeded; 8 GC refused; 9 mount or
daemon failure; 10 session or workspace error; 11 blob backend failed (``BackendError``);
12 catalog failed (``CatalogError``), also for a checkpoint or restore either caused;
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

Handler = Callable[[argparse.Namespace], int]

_MODULES = ("cmd_store", "cmd_mount", "cmd_tools", "cmd_session", "cmd_live", "cmd_doctor")


SHARED_STORE_ENV = ("REWINDFS_STORE", "REWINDFS_CATALOG", "REWINDFS_S3_ENDPOINT",
                    "REWINDFS_LOCAL")
"""The environment's defaults of ``--store``, ``--catalog``, ``--s3-endpoint`` and
``--local``."""


def default_store() -> str:
    """``--store`` default: ``$REWINDFS_STORE``, else ``./agent-data/store``."""
    return os.environ.get("REWINDFS_STORE") or os.path.join("agent-data", "store")


def resolve_store(args: argparse.Namespace) -> None:
    """Turn the shared-mode options into a store directory (store/config.py): for
    ``--store s3://BUCKET/PREFIX`` (with ``--catalog``, ``--s3-endpoint``), ``args.store``
    becomes this host's local directory (``--local``, default ``$XDG_STATE_HOME/rewindfs``),
    configured for that store. ``--host-id`` is put in the environment, so daemons and
    session hosts started from here use it too. Raises StoreConfigError (exit 2) for a
    catalog without a remote store or the reverse; a directory not configured yet is
    configured only once the bucket and the catalog answer (BackendError, exit 11, and
    CatalogError, exit 12, otherwise, with nothing written). A shared store's local
    directory records the first host id given with it and runs every later command as
    that one; another is StoreConfigError (``store.config.bind_host``)."""
    from store.hostid import ENV, check_host_id

    host = getattr(args, "host_id", None)
    if host:
        try:
            os.environ[ENV] = check_host_id(host)
        except ValueError as e:
            raise UsageError(f"--host-id: {e}") from None
    url = str(args.store)
    catalog = getattr(args, "catalog", None)
    if not url.startswith("s3://") and not catalog:
        from store import config

        try:
            shared = config.read(url) is not None  # a shared store's local directory
        except config.StoreConfigError:
            return  # not one: the command says so (doctor diagnoses it)
        if shared:
            _bind_host(url)
        return
    from store import config

    if not url.startswith("s3://"):
        raise config.StoreConfigError(f"--catalog needs a remote store (--store "
                                      f"s3://BUCKET/PREFIX), not the directory {url}")
    cache_bytes = os.environ.get("REWINDFS_CACHE_BYTES")
    cfg = config.SharedConfig(blobs=url, catalog=catalog or "",
                              s3_endpoint=getattr(args, "s3_endpoint", None) or None,
                              cache=os.environ.get("REWINDFS_CACHE") or None,
                              cache_bytes=int(cache_bytes) if cache_bytes
                              else config.DEFAULT_CACHE_BYTES)
    local = getattr(args, "local", None) or config.default_local_dir()
    cfg = cfg.check()  # the store's one spelling, for every comparison and record
    config.refuse_secrets(cfg)  # before any server is asked
    if config.read(local) is None:  # a first binding: written only once both servers answer
        config.probe(cfg)
    config.configure(local, cfg)
    args.store = os.path.abspath(local)
    _bind_host(args.store)


def _bind_host(local: str) -> None:
    """Run as the host id that the shared store's local directory ``local`` records
    (``store.config.bind_host``), recording the one given if it records none; exit 2 for
    another."""
    from store import config
    from store.hostid import ENV, check_host_id

    given = os.environ.get(ENV) or None
    if given is not None:
        try:
            check_host_id(given)
        except ValueError as e:
            raise UsageError(f"{ENV}: {e}") from None
    have = config.bind_host(os.path.abspath(local), given)
    if have is not None:
        os.environ[ENV] = have


def open_store(args: argparse.Namespace) -> Any:
    from store.objects import Store

    return Store(args.store)


def emit(args: argparse.Namespace, data: Any, text: str | None = None) -> None:
    """Print ``data`` as JSON with ``--json``, else ``text`` (or ``data`` itself)."""
    if getattr(args, "json", False):
        print(json.dumps(data, sort_keys=True))
    elif text is not None:
        if text:
            print(text)
    else:
        print(data)


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors (exit 2) also printed as one JSON document on stdout when
    the command line asks for ``--json``; subparsers inherit the class."""

    def error(self, message: str) -> Any:
        if "--json" in sys.argv[1:]:
            print(json.dumps(error_document(UsageError(message), 2), sort_keys=True))
        super().error(message)


class UsageError(Exception):
    """The command line is not of a command's form (argparse's exit 2)."""

    exit_code = 2


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, bytes):
        return os.fsdecode(v)
    if isinstance(v, (list, tuple, set, frozenset)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def error_document(e: BaseException, exit_code: int) -> dict[str, Any]:
    """The ``--json`` form of a failure: ``ok`` false, ``error`` (the one-line message),
    ``type`` (the error class, the daemon's for an error raised there), ``kind`` (the
    error's own ``kind`` where it has one, else the class name), ``exit_code``, and every public field of the typed error (``ref``, ``path``,
    ``cause``, ...), values as JSON scalars or text."""
    doc: dict[str, Any] = {f: _jsonable(v) for f, v in vars(e).items()
                           if not f.startswith("_") and f not in ("args",)}
    # A daemon's error reaches the CLI as HostError naming the typed error it raised.
    remote = doc.pop("error", None)
    etype = remote if isinstance(remote, str) and remote else type(e).__name__
    kind = getattr(e, "kind", None)
    doc.update({"ok": False, "error": str(e), "type": etype,
                "kind": kind if isinstance(kind, str) and kind else etype,
                "exit_code": exit_code})
    return doc


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rewindfs", description=__doc__.split("\n")[0])
    p.add_argument("--store", default=default_store(),
                   help="store directory, or s3://BUCKET/PREFIX for a shared store "
                        "(default: $REWINDFS_STORE or ./agent-data/store)")
    p.add_argument("--catalog", default=os.environ.get("REWINDFS_CATALOG"),
                   help="shared catalog of an s3:// store: postgresql://... "
                        "(default: $REWINDFS_CATALOG)")
    p.add_argument("--s3-endpoint", default=os.environ.get("REWINDFS_S3_ENDPOINT"),
                   help="S3 endpoint URL for SeaweedFS, MinIO, ... "
                        "(default: $REWINDFS_S3_ENDPOINT, else AWS)")
    p.add_argument("--local", default=os.environ.get("REWINDFS_LOCAL"),
                   help="this host's local directory of an s3:// store: session state, "
                        "caches (default: $REWINDFS_LOCAL or $XDG_STATE_HOME/rewindfs)")
    p.add_argument("--host-id", default=None,
                   help="this host's id in leases and the catalog (default: "
                        "$REWINDFS_HOST_ID, else derived from machine id and boot id)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    import importlib

    for name in _MODULES:
        try:
            mod = importlib.import_module(f"rewindfs.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"rewindfs.{name}":
                continue
            raise
        mod.register(sub)
    return p


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    as_json = bool(getattr(args, "json", False))
    try:
        resolve_store(args)
        return handler(args)
    except KeyboardInterrupt as e:
        return _fail(e, 130, interrupted_line(args), as_json)
    except BrokenPipeError:
        return 0
    except Exception as e:  # one line for user errors, traceback only when asked
        if os.environ.get("REWINDFS_DEBUG"):
            raise
        code = getattr(e, "exit_code", None)
        if code is None and not isinstance(e, OSError):
            return _fail(e, 1, f"internal error: {type(e).__name__}: {e}", as_json)
        return _fail(e, int(code or 1), str(e), as_json)


def interrupted_line(args: argparse.Namespace) -> str:
    """The line for Ctrl-C of the command parsed into ``args``: a command whose parser sets
    ``daemon_completes`` (a checkpoint or restore, of a mount or a session) asked a daemon
    for the work, which runs to its end there, so the line says how to see what happened."""
    if getattr(args, "daemon_completes", False):
        what = getattr(args, "session_command", None) or args.command
        return (f"interrupted; a {what} the daemon already received still completes there: "
                "see 'rewindfs list' (or 'rewindfs log ID' for a session); a restore is "
                "undone by restoring its pre_restore Ref")
    return "interrupted"


def _fail(e: BaseException, code: int, line: str, as_json: bool) -> int:
    """Report a failure: the one line on stderr, and with ``--json`` the error document on
    stdout (so a caller that parses stdout always gets JSON)."""
    print(f"rewindfs: {line}", file=sys.stderr)
    if as_json:
        print(json.dumps(error_document(e, code), sort_keys=True))
    return code


if __name__ == "__main__":
    sys.exit(main())
