"""Helpers shared by the checkpoint and restore tests: what a tree looks like to a user.

``overlay_listing`` reads an overlay through its public methods (as the FUSE adapter does)
and ``tree_listing`` reads a snapshot from the store; both give ``{path: Item}`` for every
path below the root, so a test can say "the mount shows exactly this snapshot".
``dir_listing`` does the same for a real directory (a mount seen through syscalls, or a
model kept in plain directories).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import blake3

from fusefs.inodes import ROOT_INO
from fusefs.overlay import Overlay
from store.objects import Store
from store.ref import Ref
from store.tree import Kind


@dataclass(frozen=True)
class Item:
    """One path as a user sees it (times in ns; ``digest`` of the content or target)."""

    kind: str
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    digest: str
    xattrs: tuple[tuple[bytes, bytes], ...]
    nlink: int


def _digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()[:16]


def overlay_listing(ov: Overlay, *, with_ino: bool = False) -> dict[bytes, object]:
    """Every path of the overlay -> Item (or (Item, ino) with ``with_ino``)."""
    out: dict[bytes, object] = {}
    seen = []
    todo = [(ROOT_INO, b"")]
    while todo:
        ino, path = todo.pop()
        fh = ov.opendir(ino)
        try:
            kids = []
            for name, n, _c in ov.readdir(fh, 0):
                if name not in (b".", b".."):
                    ov.remember(n)  # as the kernel does for a readdirplus entry
                    kids.append((name, n))
        finally:
            ov.releasedir(fh)
        for name, n in kids:
            p = path + b"/" + name if path else name
            kind = n.kind.name.lower()
            if n.kind is Kind.FILE:
                h = ov.open(n.ino, os.O_RDONLY)
                try:
                    content = ov.read(h, 0, n.size + 1)
                finally:
                    ov.release(h)
                dg = _digest(content)
            elif n.kind is Kind.SYMLINK:
                dg = _digest(n.target)
            else:
                dg = ""
            item = Item(kind, n.mode, n.uid, n.gid, n.mtime_ns,
                        n.size if n.kind in (Kind.FILE, Kind.SYMLINK) else 0, dg,
                        tuple(sorted(n.xattrs.items())), n.nlink)
            out[p] = (item, n.ino) if with_ino else item
            if n.kind is Kind.DIR:
                todo.append((n.ino, p))
            seen.append(n)
    for n in seen:
        ov.forget(n.ino, 1)
    return out


def tree_listing(store: Store, ref: Ref) -> dict[bytes, Item]:
    """Every path of snapshot ``ref`` -> Item (nlink: names of the hard-link group, or
    2 + subdirectories for a directory)."""
    out: dict[bytes, Item] = {}
    groups: dict[bytes, int] = {}
    rows = []
    todo = [(ref.tree_id, b"")]
    while todo:
        tid, path = todo.pop()
        for e in store.get_tree(tid).entries:
            p = path + b"/" + e.name if path else e.name
            rows.append((p, e))
            if e.link_group is not None:
                groups[e.link_group] = groups.get(e.link_group, 0) + 1
            if e.kind is Kind.DIR and e.tree_id is not None:
                todo.append((e.tree_id, p))
    for p, e in rows:
        if e.kind is Kind.FILE:
            dg = _digest(b"".join(store.read_object(c) for c in e.chunks))
            nlink = groups.get(e.link_group, 1) if e.link_group is not None else 1
        elif e.kind is Kind.SYMLINK:
            dg, nlink = _digest(e.target), 1
        elif e.kind is Kind.DIR:
            assert e.tree_id is not None
            dg = ""
            nlink = 2 + sum(1 for c in store.get_tree(e.tree_id).entries if c.kind is Kind.DIR)
        else:
            dg, nlink = "", 1
        out[p] = Item(e.kind.name.lower(), e.mode, e.uid, e.gid, e.mtime_ns,
                      e.size if e.kind in (Kind.FILE, Kind.SYMLINK) else 0, dg, e.xattrs, nlink)
    return out


_KINDS = {stat.S_IFDIR: "dir", stat.S_IFREG: "file", stat.S_IFLNK: "symlink",
          stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket"}


def dir_listing(root: str | os.PathLike[str], *, mtimes: bool = True,
                owners: bool = True) -> dict[bytes, Item]:
    """Every path below the real directory ``root`` -> Item (symlinks not followed).
    ``mtimes=False`` / ``owners=False`` zero those fields (for models whose times differ)."""
    out: dict[bytes, Item] = {}
    base = os.fsencode(os.fspath(root))
    for dirpath, dirnames, filenames in os.walk(base):
        rel = os.path.relpath(dirpath, base)
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            p = name if rel == b"." else os.path.join(rel, name)
            st = os.lstat(full)
            kind = _KINDS[stat.S_IFMT(st.st_mode)]
            if kind == "file":
                with open(full, "rb") as f:
                    dg = _digest(f.read())
            elif kind == "symlink":
                dg = _digest(os.readlink(full))
            else:
                dg = ""
            try:
                xs = tuple(sorted((os.fsencode(k), os.getxattr(full, k, follow_symlinks=False))
                                  for k in os.listxattr(full, follow_symlinks=False)
                                  if k.startswith("user.")))
            except OSError:
                xs = ()
            out[p] = Item(kind, stat.S_IMODE(st.st_mode), st.st_uid if owners else 0,
                          st.st_gid if owners else 0, st.st_mtime_ns if mtimes else 0,
                          st.st_size if kind in ("file", "symlink") else 0, dg, xs,
                          st.st_nlink)
    return out


def strip(listing: dict[bytes, object], *, mtimes: bool = False,
          owners: bool = False) -> dict[bytes, Item]:
    """``listing`` with mtimes and/or owners zeroed (flags say what to keep)."""
    out = {}
    for p, v in listing.items():
        it = v[0] if isinstance(v, tuple) else v
        assert isinstance(it, Item)
        out[p] = Item(it.kind, it.mode, it.uid if owners else 0, it.gid if owners else 0,
                      it.mtime_ns if mtimes else 0, it.size, it.digest, it.xattrs, it.nlink)
    return out


class HasOverlay(Protocol):
    """What :func:`overlay_env` needs of a test's Env: its store, state directory and the
    overlay it opened last (None: none yet)."""

    store: Store
    state: str
    ov: Overlay | None


E = TypeVar("E", bound=HasOverlay)


def overlay_env(e: E, check_state: bool = True) -> Iterator[E]:
    """The body of an ``env`` fixture: yields ``e``, then closes its overlay if it still
    holds the upper's lock, asserts that ``fusefs.upper.check`` finds no problem in the
    state directory (``check_state``) and closes the store."""
    from fusefs.upper import check

    yield e
    if e.ov is not None and e.ov.upper is not None and e.ov.upper._lock_fd is not None:
        e.ov.close()
    if check_state and os.path.exists(e.state):
        problems = check(e.state, e.store)
        assert problems == [], "\n".join(map(str, problems))
    e.store.close()


def shared_store_on(tmp: Path, seaweed: Any, postgres: Any) -> Path:
    """``tmp``/local configured as this host's directory of a new shared store on the
    given servers (``servers.Seaweed``, ``servers.Postgres``: a new bucket and a new
    database), with its cache in ``tmp``/cache; returns that directory."""
    from store.config import SharedConfig, configure

    local = tmp / "local"
    configure(str(local), SharedConfig(
        blobs=f"s3://{seaweed.new_bucket()}/s", catalog=postgres.new_database(),
        s3_endpoint=seaweed.endpoint, cache=str(tmp / "cache")))
    return local


# -- live mounts ----------------------------------------------------------------------------

def cli(store: str | os.PathLike[str], *args: str, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``rewindfs --store STORE ARGS...`` as a user would; output as text."""

    r = subprocess.run([sys.executable, "-m", "rewindfs", "--store", os.fspath(store), *args],
                       capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if check and r.returncode != 0:
        raise AssertionError(f"rewindfs {' '.join(args)} exited {r.returncode}: {r.stderr}")
    return r


def read_in(store: str | os.PathLike[str], ref: str, path: str) -> bytes:
    """The bytes of ``path`` in snapshot ``ref`` of the store at ``store`` (read from the
    store, not a mount)."""
    from store.browse import cat

    st = Store(os.fspath(store))
    try:
        return b"".join(cat(st, Ref.parse(ref), path))
    finally:
        st.close()


def client(mnt: str | os.PathLike[str]):  # type: ignore[no-untyped-def]
    """The control client of the session mounted at ``mnt``."""
    from fusefs.control import Client

    return Client.for_mount(os.fspath(mnt))


def recorded_base(state: str | os.PathLike[str]) -> str:
    """The base Ref the upper in ``state`` records (read-only; the daemon may be down)."""
    import sqlite3

    c = sqlite3.connect(f"file:{os.path.join(os.fspath(state), 'upper.sqlite')}?mode=ro",
                        uri=True)
    try:
        return str(c.execute("SELECT value FROM meta WHERE key='base'").fetchone()[0])
    finally:
        c.close()


def pack_count(store: str | os.PathLike[str]) -> int:
    d = os.path.join(os.fspath(store), "backend", "packs")
    return len(os.listdir(d)) if os.path.isdir(d) else 0
