"""The main job: rewindfs end to end on a real source tree, through the ``rewindfs`` CLI.

Usage (from the repository root; ``scripts/mainjob.sh`` runs the set-up first)::

    .venv/bin/python scripts/mainjob.py [SOURCE_DIR]

SOURCE_DIR defaults to this repository. The job uses the default store (``--store`` is not
given: ``$REWINDFS_STORE``, else ``./agent-data/store``) and works in a scratch directory,
``agent-data/mainjob/``, that it removes at the end, so the store is all it leaves behind.
Each step prints the commands it runs, what they answered and how long they took (wall
clock, interpreter start included; ``in store`` is the time measured inside the command).
Exit status 0 when every check held, 1 otherwise.

Steps are methods of ``MainJob`` listed in ``MainJob.steps``; a later feature adds its steps
there.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RW = REPO / ".venv" / "bin" / "rewindfs"


class CheckFailed(Exception):
    """A step found something other than what rewindfs promises."""


def rmtree(path: Path) -> None:
    """Remove ``path`` entirely, making read-only directories writable first."""
    if not path.exists() and not path.is_symlink():
        return
    for dirpath, dirs, _files in os.walk(path):
        for d in dirs:
            p = os.path.join(dirpath, d)
            if not os.path.islink(p):
                os.chmod(p, 0o755)
    os.chmod(path, 0o755)
    shutil.rmtree(path)


def is_under(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
        return True
    except ValueError:
        return False


def count_tree(root: Path) -> tuple[int, int]:
    """(entries, bytes of regular files) under ``root``, symlinks not followed."""
    n = size = 0
    for dirpath, dirs, files in os.walk(root):
        n += len(dirs) + len(files)
        for f in files:
            st = os.lstat(os.path.join(dirpath, f))
            if not os.path.islink(os.path.join(dirpath, f)):
                size += st.st_size
    return n, size


class MainJob:
    def __init__(self, source: Path) -> None:
        self.source = source.resolve()
        self.scratch = REPO / "agent-data" / "mainjob"
        self.original = self.scratch / "original"
        self.changed = self.scratch / "changed"
        self.restored = self.scratch / "restored"
        self.cli_seconds = 0.0
        self.refs: dict[str, str] = {}
        self.expected: dict[str, str] = {}
        self.store_root = Path()
        self.steps: list[tuple[str, Callable[[], str]]] = [
            ("open the default store", self.open_store),
            ("stage a copy of the source tree", self.stage),
            ("snapshot the tree", self.snapshot_original),
            ("list the snapshots", self.list_snapshots),
            ("re-snapshot the unchanged tree", self.resnapshot),
            ("make a changed copy and snapshot it", self.snapshot_changed),
            ("diff the two snapshots", self.diff),
            ("browse the first snapshot (ls, cat)", self.browse),
            ("materialize the first snapshot", self.materialize),
            ("show the materialized tree is equal", self.compare),
            ("materialize onto a different tree", self.refuse_overwrite),
            ("verify the store", self.verify),
            ("store statistics", self.stats),
        ]

    # -- plumbing ----------------------------------------------------------------------

    def rw(self, *args: str, check: bool = True) -> tuple[Any, subprocess.CompletedProcess[str]]:
        """Run ``rewindfs ARGS --json`` from the repository root; return (parsed JSON, the
        process). Prints the command line."""
        shown = " ".join(shlex.quote(self.rel(a)) for a in args)
        print(f"       $ rewindfs {shown}")
        t0 = time.perf_counter()
        p = subprocess.run([str(RW), *args, "--json"], cwd=REPO, text=True,
                           capture_output=True)
        self.cli_seconds = time.perf_counter() - t0
        if check and p.returncode != 0:
            raise CheckFailed(f"rewindfs {shown} exited {p.returncode}: {p.stderr.strip()}")
        data = json.loads(p.stdout) if p.stdout.strip() else None
        return data, p

    @staticmethod
    def rel(arg: str) -> str:
        """Show paths under the repository relative to it."""
        p = Path(arg)
        if p.is_absolute() and is_under(p, REPO):
            return str(p.relative_to(REPO)) or "."
        return arg

    @staticmethod
    def ms(data: Any) -> str:
        if isinstance(data, dict) and "elapsed_ms" in data:
            return f" (in store {data['elapsed_ms'] / 1000:.2f} s)"
        return ""

    def run(self) -> int:
        print(f"rewindfs main job: source {self.source}")
        if is_under(self.source, self.scratch):
            print(f"mainjob: the source may not be inside {self.scratch}", file=sys.stderr)
            return 2
        rmtree(self.scratch)
        total0 = time.perf_counter()
        ok = True
        try:
            for i, (title, step) in enumerate(self.steps, 1):
                print(f"[{i:2d}/{len(self.steps)}] {title}")
                t0 = time.perf_counter()
                try:
                    summary = step()
                except CheckFailed as e:
                    print(f"       FAILED: {e}")
                    ok = False
                    break
                print(f"       -> {summary}  [{time.perf_counter() - t0:.2f} s]")
        finally:
            rmtree(self.scratch)
        print(f"main job {'done' if ok else 'FAILED'} in {time.perf_counter() - total0:.1f} s; "
              f"left behind: the store {self.rel(str(self.store_root))}")
        return 0 if ok else 1

    # -- steps -------------------------------------------------------------------------

    def open_store(self) -> str:
        data, _ = self.rw("init")
        self.store_root = Path(data["root"])
        return f"store {self.rel(data['root'])}, chunk size {data['chunk_size']} B"

    def stage(self) -> str:
        """Copy the source with everything metadata-exact (tar, POSIX format: ns mtimes,
        xattrs, hard links, modes, owners), leaving out what changes while the job runs:
        the store, this scratch directory, the repository's agent-data/ and the CLI's own
        virtualenv."""
        if is_under(self.source, self.store_root):
            raise CheckFailed(f"the source {self.source} is inside the store")
        candidates = [p for p in (self.store_root, self.scratch, REPO / "agent-data",
                                  REPO / ".venv")
                      if is_under(p, self.source) and p != self.source]
        excluded = sorted({p for p in candidates
                           if not any(q != p and is_under(p, q) for q in candidates)})
        self.original.mkdir(parents=True)
        excl = [f"--exclude=./{p.relative_to(self.source)}" for p in excluded]
        cmd = (f"tar --format=posix --xattrs --xattrs-include='user.*' -cf - "
               f"{' '.join(shlex.quote(e) for e in excl)} -C {shlex.quote(str(self.source))} . "
               f"| tar --xattrs --xattrs-include='user.*' -xpf - "
               f"-C {shlex.quote(str(self.original))}")
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True)
        if p.returncode != 0:
            raise CheckFailed(f"copying the source failed: {p.stderr.strip()}")
        n, size = count_tree(self.original)
        left_out = ", ".join(str(p.relative_to(self.source)) for p in excluded) or "nothing"
        return (f"{self.rel(str(self.original))}: {n:,} entries, {size / 1e6:.1f} MB "
                f"(left out: {left_out})")

    def snapshot_original(self) -> str:
        data, _ = self.rw("snapshot", str(self.original), "--label", "mainjob: original")
        self.refs["original"] = data["ref"]
        rate = data["bytes"] / 1e6 / max(data["elapsed_ms"] / 1000, 1e-9)
        return (f"{data['ref']}: {data['files']:,} files, {data['bytes'] / 1e6:.1f} MB, "
                f"{rate:.0f} MB/s{self.ms(data)}")

    def list_snapshots(self) -> str:
        data, _ = self.rw("list")
        mine = [s for s in data if s["ref"] == self.refs["original"]]
        if not mine:
            raise CheckFailed("the snapshot is not in the list")
        return f"{len(data)} snapshot(s) listed, ours labelled {mine[-1]['label']!r}"

    def resnapshot(self) -> str:
        packs = self.store_root / "backend" / "packs"
        before = sorted(packs.iterdir()) if packs.is_dir() else []
        data, _ = self.rw("snapshot", str(self.original), "--label", "mainjob: original")
        if data["ref"] != self.refs["original"]:
            raise CheckFailed(f"unchanged tree gave another Ref: {data['ref']}")
        after = sorted(packs.iterdir()) if packs.is_dir() else []
        if after != before:
            raise CheckFailed(f"re-snapshot of an unchanged tree wrote {len(after) - len(before)}"
                              " pack(s)")
        return (f"same Ref, no pack written, {data['files_read']:,} of {data['files']:,} files "
                f"read again (the rest came from the files cache){self.ms(data)}")

    def snapshot_changed(self) -> str:
        p = subprocess.run(["cp", "-a", str(self.original), str(self.changed)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise CheckFailed(f"cp -a failed: {p.stderr.strip()}")
        files = sorted(
            Path(d, f) for d, _dirs, fs in os.walk(self.changed) for f in fs
            if os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f))
            and os.access(os.path.join(d, f), os.W_OK) and "/.git/" not in os.path.join(d, f))
        if len(files) < 3:
            raise CheckFailed("the source tree needs at least 3 writable regular files")
        modified, removed, chmodded = files[0], files[len(files) // 2], files[-1]
        with open(modified, "ab") as f:
            f.write(b"\n# changed by the rewindfs main job\n")
        removed.unlink()
        chmodded.chmod(chmodded.stat().st_mode ^ 0o100)
        added = self.changed / "MAINJOB-NEW-FILE.txt"
        added.write_text("a file the main job added\n")

        def key(p: Path) -> str:
            return str(p.relative_to(self.changed))

        self.expected = {key(modified): "modified", key(removed): "removed",
                         key(chmodded): "modified", key(added): "added"}
        self.modified_path = key(modified)
        data, _ = self.rw("snapshot", str(self.changed), "--label", "mainjob: changed")
        self.refs["changed"] = data["ref"]
        return (f"{data['ref']} (edited {key(modified)}, removed {key(removed)}, "
                f"chmod u^x {key(chmodded)}, added {key(added)}){self.ms(data)}")

    def diff(self) -> str:
        data, _ = self.rw("diff", self.refs["original"], self.refs["changed"])
        got = {c["path"]: c["status"] for c in data["changes"]}
        for c in data["changes"]:
            print(f"         {c['status']:<12} {c['path']}")
        wrong = {p: s for p, s in self.expected.items() if got.get(p) != s}
        if wrong:
            raise CheckFailed(f"diff missed or misreported {wrong}; it said {got}")
        return f"{len(got)} change(s), the expected {len(self.expected)} among them{self.ms(data)}"

    def browse(self) -> str:
        data, _ = self.rw("ls", self.refs["original"])
        names = [e["name"] for e in data]
        p = subprocess.run([str(RW), "cat", self.refs["original"], self.modified_path],
                           cwd=REPO, capture_output=True)
        print(f"       $ rewindfs cat {self.refs['original']} {shlex.quote(self.modified_path)}")
        if p.returncode != 0:
            raise CheckFailed(f"cat failed: {p.stderr.decode(errors='replace').strip()}")
        want = (self.original / self.modified_path).read_bytes()
        if p.stdout != want:
            raise CheckFailed("cat gave other bytes than the original file")
        return (f"root lists {len(names)} entries; cat {self.modified_path} gives the original "
                f"{len(want):,} bytes, not the edited ones")

    def materialize(self) -> str:
        data, _ = self.rw("materialize", self.refs["original"], str(self.restored))
        return f"written to {self.rel(str(self.restored))}{self.ms(data)}"

    def compare(self) -> str:
        print(f"       $ diff -r --no-dereference {self.rel(str(self.original))} "
              f"{self.rel(str(self.restored))}")
        p = subprocess.run(["diff", "-r", "--no-dereference", str(self.original),
                            str(self.restored)], capture_output=True, text=True)
        if p.returncode != 0:
            raise CheckFailed(f"diff -r found differences:\n{p.stdout[:2000]}{p.stderr[:500]}")
        data, _ = self.rw("snapshot", str(self.restored), "--label", "mainjob: original")
        if data["ref"] != self.refs["original"]:
            raise CheckFailed(f"the materialized tree snapshots to {data['ref']}, not "
                              f"{self.refs['original']}: metadata differs")
        again, _ = self.rw("materialize", self.refs["original"], str(self.restored))
        return ("diff -r: equal contents; re-snapshot: the same Ref, so modes, mtimes, links "
                "and xattrs are equal too; materialize onto the equal tree: nothing to write"
                f"{self.ms(again)}")

    def refuse_overwrite(self) -> str:
        _, p = self.rw("materialize", self.refs["changed"], str(self.restored), check=False)
        if p.returncode != 6:
            raise CheckFailed(f"materialize onto a different tree exited {p.returncode}, "
                              "expected 6 (destination problem)")
        return f"refused with exit 6, nothing touched: {p.stderr.strip()}"

    def verify(self) -> str:
        data, p = self.rw("verify", check=False)
        if p.returncode != 0 or not data or not data.get("ok"):
            raise CheckFailed(f"verify reported problems: {p.stdout.strip()[:2000]}")
        return f"no broken invariant{self.ms(data)}"

    def stats(self) -> str:
        data, _ = self.rw("stats")
        return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                         for k, v in data.items())


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        print("usage: mainjob.py [SOURCE_DIR]", file=sys.stderr)
        return 2
    source = Path(argv[0]) if argv else REPO
    if not source.is_dir():
        print(f"mainjob: {source} is not a directory", file=sys.stderr)
        return 2
    os.umask(0o022)
    return MainJob(source).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
