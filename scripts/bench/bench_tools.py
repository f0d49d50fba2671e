#!/usr/bin/env python3
"""Benchmark: the Grep and Glob tools against ripgrep and find run directly; Bash latency;
with ``--mcp`` the MCP server's own figures.

Builds (or reuses) a tree of 20,000 source-like files, then times each workload in-process
through the tools (as the MCP server calls them) and the equivalent ``rg``/``find`` command
as a subprocess on the same tree, alternating runs, and prints medians and ratios
(tool / direct; the goal is at most 1.5). ``--root`` times the tools on another spelling of
the tree (e.g. a mount of it) while the direct commands keep running on ``--tree``.
The Bash rows time ``true`` through a real MCP client talking to ``rewindfs mcp`` over stdio
(sandboxed as the server would run it) against ``bash -c true`` run directly; their ratio
has no goal of its own (the sandbox's cost), the latency is what to compare between runs.
The last row times Bash with a path policy hiding 100 files and protecting 100 more
(written first into the tree as the tools see it: ``--root`` when given) against the plain
Bash row (goal: at most 2x); the two servers run at once and are called in turn.

``--mcp`` starts ``rewindfs mcp --root`` (a real stdio server, driven by the ``mcp``
client) on a scratch directory and measures: a Bash ``true`` call (median of ``--runs``
x 10 calls) against spawning ``bash -c true`` directly; ReadFile of a 1 GiB sparse file
(wall time, the server's peak RSS growth from /proc/PID/status VmHWM and the bytes it
read from /proc/PID/io rchar) against ``head -c 8192`` of the same file. ``--server-repo
DIR`` runs another checkout's server (e.g. ``git archive`` of an older commit) for a
before/after comparison on the same machine.

    .venv/bin/python scripts/bench/bench_tools.py [--tree DIR] [--root DIR] [--runs N]
                                                   [--mcp [--server-repo DIR]] [--json]
                                                   [--bash-only]
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


POLICY_MATCHES = 100


def policy_paths(root: str, n: int = POLICY_MATCHES) -> None:
    """``n`` files matching the hide pattern (``.env``) and ``n`` matching the protect
    pattern (``*.lock``), spread over the tree's directories (idempotent)."""
    for i in range(n):
        d = os.path.join(root, f"pkg{i % 20}", f"mod{(i // 20) % 20}")
        os.makedirs(d, exist_ok=True)
        for name in (".env", "deps.lock"):
            path = os.path.join(d, name)
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write("x\n")


def bash_latency(root: str, runs: int,
                 extras: tuple[tuple[tuple[str, ...], dict[str, str]], ...] = (((), {}),)
                 ) -> tuple[list[list[float]], list[float]]:
    """Seconds per Bash ``true`` through MCP, one list per server: a ``rewindfs mcp --root``
    server over stdio per entry of ``extras`` (its further arguments, its further
    environment), all running at once and called in turn after two warm-up calls each, so
    that a change of the machine's load falls on every server alike; and per ``bash -c
    true`` run directly, in the same turns."""
    import contextlib

    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    repo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    store = tempfile.mkdtemp(prefix="rewindfs-bench-store-")
    params = [StdioServerParameters(command=sys.executable,
                                    args=["-m", "rewindfs.cli", "--store", store, "mcp",
                                          "--root", root, *extra], cwd=os.path.abspath(repo),
                                    env={**os.environ, **env})
              for extra, env in extras]
    t_mcp: list[list[float]] = [[] for _ in extras]
    t_direct: list[float] = []

    async def session() -> None:
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(Client(p, read_timeout_seconds=120))
                       for p in params]
            for client in clients:
                for _ in range(2):
                    await client.call_tool("Bash", {"command": "true"})
            for _ in range(runs):
                for client, times in zip(clients, t_mcp, strict=True):
                    t = time.perf_counter()
                    r = await client.call_tool("Bash", {"command": "true"})
                    times.append(time.perf_counter() - t)
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


def _proc_field(pid: int, name: str, field: str) -> int:
    """A number from /proc/PID/<name> (``status`` values in kB, ``io`` in bytes)."""
    with open(f"/proc/{pid}/{name}") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _server_pid() -> int:
    """The pid of this process's child running ``rewindfs ... mcp``."""
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                st = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        ppid = int(st[st.rfind(b")") + 2:].split()[1])
        if ppid == me and b"mcp" in cmd:
            return int(name)
    raise RuntimeError("the MCP server process was not found")


def bench_mcp(runs: int, as_json: bool, repo: str | None = None) -> int:
    """The MCP server's figures (see the module docstring); prints a table or JSON.
    ``repo``: the checkout whose server is started (default: this one)."""
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    repo = repo or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="rewindfs-bench-mcp-") as tmp:
        root = os.path.join(tmp, "root")
        os.mkdir(root)
        sparse = os.path.join(root, "disk.img")
        with open(sparse, "wb") as f:
            f.truncate(1 << 30)
        params = StdioServerParameters(
            command=sys.executable, cwd=repo,
            args=["-m", "rewindfs.cli", "--store", os.path.join(tmp, "store"), "mcp",
                  "--root", root])

        async def session() -> None:
            async with Client(params, read_timeout_seconds=120) as client:
                pid = _server_pid()
                await client.call_tool("Bash", {"command": "true"})       # warm up
                bash = []
                for _ in range(runs * 10):
                    t = time.perf_counter()
                    await client.call_tool("Bash", {"command": "true"})
                    bash.append(time.perf_counter() - t)
                hwm0 = _proc_field(pid, "status", "VmHWM")
                rchar0 = _proc_field(pid, "io", "rchar")
                t = time.perf_counter()
                r = await client.call_tool("ReadFile", {"path": "disk.img"})
                read_s = time.perf_counter() - t
                assert not r.is_error
                out["bash_true_ms"] = round(statistics.median(bash) * 1000, 2)
                out["sparse_read_ms"] = round(read_s * 1000, 2)
                out["sparse_read_rss_growth_mib"] = round(
                    (_proc_field(pid, "status", "VmHWM") - hwm0) / 1024, 2)
                out["sparse_read_bytes"] = _proc_field(pid, "io", "rchar") - rchar0

        anyio.run(session)
        direct = []
        for _ in range(runs * 10):
            direct.append(timed(lambda: subprocess.run(["bash", "-c", "true"], check=True)))
        head = statistics.median(timed(lambda: subprocess.run(
            ["head", "-c", "8192", sparse], capture_output=True, check=True))
            for _ in range(runs))
    out["direct_bash_true_ms"] = round(statistics.median(direct) * 1000, 2)
    out["head_8k_ms"] = round(head * 1000, 2)
    if as_json:
        print(json.dumps(out, indent=2))
        return 0
    b, d = float(out["bash_true_ms"]), float(out["direct_bash_true_ms"])  # type: ignore[arg-type]
    rd, hd = float(out["sparse_read_ms"]), float(out["head_8k_ms"])  # type: ignore[arg-type]
    print(f"{'figure':44} {'value':>10} {'baseline':>10} {'ratio':>7}")
    print(f"{'Bash true through MCP (ms, median)':44} {b:10.2f} {d:10.2f} {b / d:7.2f}"
          "   (baseline: bash -c true spawned directly)")
    print(f"{'ReadFile 1 GiB sparse file (ms)':44} {rd:10.2f} {hd:10.2f} {rd / hd:7.2f}"
          "   (baseline: head -c 8192 of it)")
    print(f"{'  server peak RSS growth (MiB)':44} {out['sparse_read_rss_growth_mib']!s:>10}")
    print(f"{'  bytes the server read (rchar)':44} {out['sparse_read_bytes']!s:>10}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", help="tree to use (built there if missing or empty)")
    ap.add_argument("--root", help="where the tools see the tree (default: --tree)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mcp", action="store_true",
                    help="only the MCP server figures (Bash latency, sparse ReadFile)")
    ap.add_argument("--server-repo", help="with --mcp: start the server of this checkout "
                    "(e.g. an older commit, for a before/after figure)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--bash-only", action="store_true", help="only the two Bash rows")
    args = ap.parse_args()
    if args.mcp:
        return bench_mcp(args.runs, args.json, args.server_repo)
    tmp = None
    tree = args.tree
    if tree is None:
        tmp = tempfile.TemporaryDirectory(prefix="rewindfs-bench-tools-")
        tree = tmp.name
    if not os.path.isdir(tree) or not os.listdir(tree):
        print(f"building a 20,000-file tree in {tree} ...", file=sys.stderr)
        build_tree(tree)
    ws = ToolContext(DirBinding(args.root or tree))
    rows = []
    for name, tool_call, cmd in ([] if args.bash_only else workloads(ws)):
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
    # Bash alone, and with a path policy matching POLICY_MATCHES hidden and as many
    # protected files, written where the tools see the tree (with --root, a mount of it:
    # the native tree would not show them there); the second row's ratio is against the
    # first (goal: 2), both servers running at once and called in turn.
    # A third server makes the covers with bubblewrap's own binds (what the sandbox falls
    # back to where they cannot be made in the sandbox), for comparison.
    policy_paths(args.root or tree)
    pol = ("--hide-glob", ".env", "--protect", "*.lock")
    (t_mcp, t_pol, t_binds), t_bash = bash_latency(
        args.root or tree, max(args.runs, 20),
        (((), {}), (pol, {}), (pol, {"REWINDFS_BWRAP_COVERS": "1"})))
    mt, md = statistics.median(t_mcp), statistics.median(t_bash)
    rows.append({"workload": "Bash true (MCP stdio)", "tool_ms": round(mt * 1000, 1),
                 "direct_ms": round(md * 1000, 1), "ratio": round(mt / md, 2),
                 "direct": "bash -c true"})
    mp = statistics.median(t_pol)
    rows.append({"workload": f"Bash true, {POLICY_MATCHES} hidden + {POLICY_MATCHES} "
                             "protected", "tool_ms": round(mp * 1000, 1),
                 "direct_ms": round(mt * 1000, 1), "ratio": round(mp / mt, 2),
                 "direct": "Bash true (MCP stdio), no policy"})
    mb = statistics.median(t_binds)
    rows.append({"workload": "Bash true, same policy, bwrap binds",
                 "tool_ms": round(mb * 1000, 1),
                 "direct_ms": round(mt * 1000, 1), "ratio": round(mb / mt, 2),
                 "direct": "Bash true (MCP stdio), no policy"})
    if args.json:
        print(json.dumps({"tree": tree, "root": args.root or tree, "runs": args.runs,
                          "rows": rows}, indent=2))
    else:
        print(f"{'workload':36} {'tool ms':>9} {'direct ms':>10} {'ratio':>6}")
        for r in rows:
            goal = 2.0 if "protected" in r["workload"] else 1.5
            flag = "" if r["ratio"] <= goal or r["workload"] == "Bash true (MCP stdio)" \
                or "bwrap binds" in r["workload"] \
                else f"  (over {goal:g}x)"
            print(f"{r['workload']:36} {r['tool_ms']:9.1f} {r['direct_ms']:10.1f} "
                  f"{r['ratio']:6.2f}{flag}")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
