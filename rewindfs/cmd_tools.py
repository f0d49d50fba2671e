"""``rewindfs mcp``: serve the agent tools over MCP (stdio) for one workspace.

``--session ID`` binds the tools to a running session of the store (``rewindfs session
new``): its root, its write permit (held by Bash, WriteFile and EditFile so that a
checkpoint waits for them), and its checkpoint, log and diff; restore only with
``--allow-restore``. ``--root DIR`` serves a plain directory (the file, search and Bash
tools, no session calls). Bash runs every command in the sandbox of ``tools.sandbox``: ``--network`` gives it
outbound access in user mode (``--network-host-loopback`` also the host's loopback),
``--env NAME`` passes one of the server's variables on, ``--unsafe-no-sandbox`` runs
commands unconfined where no sandbox can be built (else Bash refuses). Path policies: the
session's (its spec), or for ``--root`` the directory's ``.rewindfs.toml``, plus
``--hide-glob GLOB`` and ``--protect GLOB`` (store.pathpolicy).
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
    p.add_argument("--hide-glob", action="append", default=[], metavar="GLOB",
                   help="path policy: workspace paths (gitignore syntax) invisible to the "
                        "tools and Bash (repeatable; added to the session's)")
    p.add_argument("--protect", action="append", default=[], metavar="GLOB",
                   help="path policy: workspace paths (gitignore syntax) the tools and Bash "
                        "cannot change (repeatable; added to the session's)")
    p.add_argument("--allow-restore", action="store_true",
                   help="also offer the restore tool (when the workspace supports it)")
    p.add_argument("--network", action="store_true",
                   help="let Bash commands reach the network (outbound, through slirp4netns; "
                        "the host's loopback stays out of reach)")
    p.add_argument("--network-host-loopback", action="store_true",
                   help="with --network, also let commands reach the host's loopback "
                        "services at 10.0.2.2")
    p.add_argument("--env", action="append", default=[], metavar="NAME",
                   help="pass the server's environment variable NAME to Bash commands "
                        "(repeatable; by default only PATH, LANG, LC_* and TERM pass)")
    p.add_argument("--unsafe-no-sandbox", action="store_true",
                   help="where no sandbox can be built (no bubblewrap, no user namespaces), "
                        "run Bash commands unconfined instead of refusing them")
    p.set_defaults(handler=run_mcp)


def run_mcp(args: argparse.Namespace) -> int:
    from store.pathpolicy import PathPolicy, seed_policy

    hidden = [os.path.abspath(h) for h in args.hide]
    given = PathPolicy(hide=tuple(args.hide_glob), protect=tuple(args.protect),
                       source="the command line")
    binding: Any
    if args.session is not None:
        from tools.session_binding import SessionToolBinding

        binding = SessionToolBinding(args.store, args.session, hidden=hidden, policy=given)
    else:
        from tools.binding import DirBinding

        hidden.append(os.path.abspath(args.store))
        # A plain directory is its own seed: its .rewindfs.toml (then protected) applies.
        paths = seed_policy(None, args.root).merged(given) if os.path.isdir(args.root) \
            else given
        binding = DirBinding(args.root, hidden=hidden, policy=paths)
    from tools.mcp_server import serve_stdio  # the mcp library loads slowly: after the checks
    from tools.sandbox import SandboxPolicy

    if args.network_host_loopback and not args.network:
        raise SystemExit("rewindfs mcp: --network-host-loopback needs --network")
    policy = SandboxPolicy(network=args.network, host_loopback=args.network_host_loopback,
                           env=tuple(args.env), unsafe_no_sandbox=args.unsafe_no_sandbox)
    serve_stdio(binding, allow_restore=args.allow_restore, sandbox=policy)
    return 0

