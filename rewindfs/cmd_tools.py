"""``rewindfs mcp``: serve the agent tools over MCP (stdio) for one workspace root."""

from __future__ import annotations

import argparse
import os
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("mcp", help="serve the agent tools over MCP on stdin/stdout")
    p.add_argument("--root", required=True, help="workspace root directory")
    p.add_argument("--hide", action="append", default=[], metavar="PATH",
                   help="path Bash must not see (repeatable; the store is always hidden)")
    p.add_argument("--allow-restore", action="store_true",
                   help="also offer the restore tool (when the workspace supports it)")
    p.set_defaults(handler=run_mcp)


def run_mcp(args: argparse.Namespace) -> int:
    from tools.binding import DirBinding
    from tools.mcp_server import serve_stdio

    hidden = [os.path.abspath(h) for h in args.hide]
    hidden.append(os.path.abspath(args.store))
    serve_stdio(DirBinding(args.root, hidden=hidden), allow_restore=args.allow_restore)
    return 0
