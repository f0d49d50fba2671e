"""``rewindfs mcp``: serve the agent tools over MCP (stdio) for one workspace.

``--session ID`` binds the tools to a running session of the store (``rewindfs session
new``): its root, its write permit (held by Bash, WriteFile and EditFile so that a
checkpoint waits for them), and its checkpoint, log and diff; restore only with
``--allow-restore``. ``--root DIR`` serves a plain directory (the six tools only).
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("mcp", help="serve the agent tools over MCP on stdin/stdout")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--session", metavar="ID", help="a running session of the store")
    g.add_argument("--root", help="a plain workspace directory (no checkpoints)")
    p.add_argument("--hide", action="append", default=[], metavar="PATH",
                   help="path Bash must not see (repeatable; the store is always hidden)")
    p.add_argument("--allow-restore", action="store_true",
                   help="also offer the restore tool (when the workspace supports it)")
    p.set_defaults(handler=run_mcp)


def run_mcp(args: argparse.Namespace) -> int:
    hidden = [os.path.abspath(h) for h in args.hide]
    binding: Any
    if args.session is not None:
        from tools.session_binding import SessionToolBinding

        binding = SessionToolBinding(args.store, args.session, hidden=hidden)
    else:
        from tools.binding import DirBinding

        hidden.append(os.path.abspath(args.store))
        binding = DirBinding(args.root, hidden=hidden)
    from tools.mcp_server import serve_stdio  # the mcp library loads slowly: after the checks

    serve_stdio(binding, allow_restore=args.allow_restore)
    return 0

