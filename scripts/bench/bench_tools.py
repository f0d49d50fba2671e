#!/usr/bin/env python3
"""Benchmark: the Grep and Glob tools against ripgrep and find run directly; Bash latency.

Builds (or reuses) a tree of 20,000 source-like files, then times each workload in-process
through the tools (as the MCP server calls them) and the equivalent ``rg``/``find`` command
as a subprocess on the same tree, alternating runs, and prints medians and ratios
(tool / direct; the goal is at most 1.5). ``--root`` times the tools on another spelling of
the tree (e.g. a mount of it) while the direct commands keep running on ``--tree``.
The Bash rows time ``true`` through a real MCP client talking to ``rewindfs mcp`` over stdio
(sandboxed as the server would run it) against ``bash -c true`` run directly; their ratio
has no goal of its own (the sandbox's cost), the latency is what to compare between runs.

    .venv/bin/python scripts/bench/bench_tools.py [--tree DIR] [--root DIR] [--runs N]
                                                   [--engine rg|python] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from tools.binding import DirBinding  # noqa: E402
from tools.context import ToolContext  # noqa: E402
from tools.glob import glob  # noqa: E402
from tools.grep import grep  # noqa: E402

WORDS = ["alpha", "beta", "gamma", "delta", "import os", "def main():", "return None",
         "class Widget:", "# TODO: tidy", "print(value)", "for item in items:", "if x:"]
EXTS = [".py", ".md", ".txt", ".c", ".js"]


def build_tree(root: str, files: int = 20000, seed: int = 7) -> None:
    """``files`` files in 20 x 20 directories (plus a few levels more in some), 0.1-8 KiB
    each, with a .git and a node_modules directory the tools prune."""
    rnd = random.Random(seed)
    n = 0
    per_dir = files // 400
    for a in range(20):
        for b in range(20):
            d = os.path.join(root, f"pkg{a}", f"mod{b}" if b % 5 else f"mod{b}/sub/deeper")
            os.makedirs(d, exist_ok=True)
            for c in range(per_dir):
                lines = [f"{rnd.choice(WORDS)} {i}" for i in range(rnd.randint(3, 200))]
                with open(os.path.join(d, f"file{c}{EXTS[c % len(EXTS)]}"), "w") as f:
                    f.write("\n".join(lines) + "\n")
                n += 1
    for noise in (".git/objects", "node_modules/dep"):
        os.makedirs(os.path.join(root, noise), exist_ok=True)
        with open(os.path.join(root, noise, "x.py"), "w") as f:
            f.write("# TODO: noise\n")


PRUNE = ["(", "-name", ".git", "-o", "-name", "node_modules", ")", "-prune", "-o"]


def workloads(ws: ToolContext) -> list[tuple[str, Callable[[], object], list[str]]]:
    """(name, tool call, equivalent direct command run in the tree)."""
    rg = ["rg", "--hidden", "-g", "!.git/", "-g", "!node_modules/"]
    return [
        ("Glob **/*.py", lambda: glob(ws, "**/*.py"),
         ["find", ".", *PRUNE, "-name", "*.py", "-printf", "%T@ %p\\n"]),
        ("Glob **/*", lambda: glob(ws, "**/*"),
         ["find", ".", *PRUNE, "-type", "f", "-printf", "%T@ %p\\n"]),
        ("Glob pkg3/**/*.md", lambda: glob(ws, "pkg3/**/*.md"),
         ["find", "pkg3", "-name", "*.md", "-printf", "%T@ %p\\n"]),
        ("Grep -l TODO", lambda: grep(ws, "TODO"), [*rg, "-l", "TODO"]),
        ("Grep content 'class Widget' -C1",
         lambda: grep(ws, "class Widget", output_mode="content", context=1),
         [*rg, "-n", "-C1", "class Widget"]),
        ("Grep count -i 'return none'",
         lambda: grep(ws, "return none", output_mode="count", ignore_case=True),
         [*rg, "-c", "-i", "return none"]),
        ("Grep -l 'def main' glob=*.py", lambda: grep(ws, "def main", glob="*.py"),
         [*rg, "-l", "-g", "*.py", "def main"]),
        ("Grep -l rare in pkg5", lambda: grep(ws, "gamma 17$", path="pkg5"),
         [*rg, "-l", "gamma 17$", "pkg5"]),
    ]


def bash_latency(root: str, runs: int) -> tuple[list[float], list[float]]:
    """Seconds per Bash ``true`` through MCP (a ``rewindfs mcp --root`` server over stdio,
    after two warm-up calls), and per ``bash -c true`` run directly, alternating."""
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    store = tempfile.mkdtemp(prefix="rewindfs-bench-store-")
    params = StdioServerParameters(command=sys.executable,
                                   args=["-m", "rewindfs.cli", "--store", store, "mcp",
                                         "--root", root], cwd=os.path.abspath(repo))
    t_mcp: list[float] = []
    t_direct: list[float] = []

    async def session() -> None:
        async with Client(params, read_timeout_seconds=120) as client:
            for _ in range(2):
                await client.call_tool("Bash", {"command": "true"})
            for _ in range(runs):
                t = time.perf_counter()
                r = await client.call_tool("Bash", {"command": "true"})
                t_mcp.append(time.perf_counter() - t)
                if r.is_error:
                    raise SystemExit(f"Bash failed: {r.content}")
                t_direct.append(timed(lambda: subprocess.run(["bash", "-c", "true"],
                                                             check=True)))

    anyio.run(session)
    return t_mcp, t_direct


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", help="tree to use (built there if missing or empty)")
    ap.add_argument("--root", help="where the tools see the tree (default: --tree)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--engine", choices=["rg", "python"], help="force a Grep engine")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = None
    tree = args.tree
    if tree is None:
        tmp = tempfile.TemporaryDirectory(prefix="rewindfs-bench-tools-")
        tree = tmp.name
    if not os.path.isdir(tree) or not os.listdir(tree):
        print(f"building a 20,000-file tree in {tree} ...", file=sys.stderr)
        build_tree(tree)
    if args.engine:
        os.environ["REWINDFS_GREP_ENGINE"] = args.engine
    ws = ToolContext(DirBinding(args.root or tree))
    rows = []
    for name, tool_call, cmd in workloads(ws):
        def direct(cmd: list[str] = cmd) -> None:
            # Output into a pipe that is read, as a caller would: ripgrep writing to
            # /dev/null stops at the first match of each file, which is not the same work.
            subprocess.run(cmd, cwd=tree, capture_output=True, check=False)
        timed(tool_call)
        timed(direct)                       # warm the caches for both
        t_tool, t_direct = [], []
        for _ in range(args.runs):
            t_tool.append(timed(tool_call))
            t_direct.append(timed(direct))
        mt, md = statistics.median(t_tool), statistics.median(t_direct)
        rows.append({"workload": name, "tool_ms": round(mt * 1000, 1),
                     "direct_ms": round(md * 1000, 1), "ratio": round(mt / md, 2),
                     "direct": " ".join(cmd)})
    t_mcp, t_bash = bash_latency(args.root or tree, max(args.runs, 20))
    mt, md = statistics.median(t_mcp), statistics.median(t_bash)
    rows.append({"workload": "Bash true (MCP stdio)", "tool_ms": round(mt * 1000, 1),
                 "direct_ms": round(md * 1000, 1), "ratio": round(mt / md, 2),
                 "direct": "bash -c true"})
    if args.json:
        print(json.dumps({"tree": tree, "root": args.root or tree, "runs": args.runs,
                          "rows": rows}, indent=2))
    else:
        print(f"{'workload':36} {'tool ms':>9} {'direct ms':>10} {'ratio':>6}")
        for r in rows:
            flag = "" if r["ratio"] <= 1.5 or r["workload"].startswith("Bash") \
                else "  (over 1.5x)"
            print(f"{r['workload']:36} {r['tool_ms']:9.1f} {r['direct_ms']:10.1f} "
                  f"{r['ratio']:6.2f}{flag}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
