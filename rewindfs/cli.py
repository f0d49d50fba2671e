"""The ``rewindfs`` command: a thin front door over the Python API.

Subcommands are registered by small modules (``rewindfs/cmd_*.py``), each exposing
``register(subparsers)``; a handler takes the parsed arguments and returns an exit code.
Imports of heavy modules happen inside handlers so that a short command starts fast.

Exit codes: 0 success; 1 generic failure; 2 usage error; 3 invalid Ref; 4 not found;
5 integrity failure; 6 destination problem; 7 limit exceeded; 8 GC refused; 9 mount or
daemon failure; 10 session or workspace error; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

Handler = Callable[[argparse.Namespace], int]

_MODULES = ("cmd_store", "cmd_mount", "cmd_tools", "cmd_session", "cmd_live")


def default_store() -> str:
    """``--store`` default: ``$REWINDFS_STORE``, else ``./agent-data/store``."""
    return os.environ.get("REWINDFS_STORE") or os.path.join("agent-data", "store")


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rewindfs", description=__doc__.split("\n")[0])
    p.add_argument("--store", default=default_store(),
                   help="store directory (default: $REWINDFS_STORE or ./agent-data/store)")
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
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("rewindfs: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # one line for user errors, traceback only when asked
        code = getattr(e, "exit_code", None)
        if code is None and not isinstance(e, OSError):
            if os.environ.get("REWINDFS_DEBUG"):
                raise
            print(f"rewindfs: internal error: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        if os.environ.get("REWINDFS_DEBUG"):
            raise
        print(f"rewindfs: {e}", file=sys.stderr)
        return int(code or 1)


if __name__ == "__main__":
    sys.exit(main())
