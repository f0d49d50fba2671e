"""Test helper: build interesting real trees on disk and compare two trees exactly.

- ``build_rich_tree(root, chunk_size)``: one tree with every feature a snapshot must keep:
  empty, small, multi-chunk, all-zero and sparse files; modes; owners (when root); ns
  mtimes (negative too); relative, absolute, dangling and non-UTF-8 symlinks; empty and
  read-only directories; hard links inside one directory and across directories; user
  xattrs on files and directories; a fifo; non-UTF-8, 255-byte and odd names.
- ``tree_specs()`` (hypothesis) and ``build_tree(root, spec)``: generated trees of the same
  features, small enough for property tests.
- ``describe(root)`` and ``assert_same_tree(a, b)``: everything a user can observe about
  every path below a root (kind, mode, owner, mtime ns, size, content digest, symlink
  target, user xattrs, which paths share an inode), without following symlinks. The root's
  own metadata is left out, as a Ref leaves it out.
- ``allocated(path)``: bytes a file really occupies (to check that holes stay holes).

Other test modules reuse this; it imports nothing from the product.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

AS_ROOT = os.geteuid() == 0

# -- describing and comparing ---------------------------------------------------------

Description = dict[bytes, tuple[object, ...]]


def _xattrs(path: bytes) -> tuple[tuple[str, bytes], ...]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return ()
    return tuple(sorted((n, os.getxattr(path, n, follow_symlinks=False))
                        for n in names if n.startswith("user.")))


def _digest(path: bytes) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def describe(root: str | os.PathLike[str]) -> Description:
    """Map each root-relative path (bytes) below ``root`` to what a user observes of it.

    Hard links show as the sorted tuple of the paths (inside ``root``) sharing the inode,
    so two trees compare equal only if their link structure is the same.
    """
    top = os.fsencode(os.fspath(root))
    out: Description = {}
    inodes: dict[tuple[int, int], list[bytes]] = {}
    stack = [b""]
    while stack:
        rel = stack.pop()
        full = top + b"/" + rel if rel else top
        for name in sorted(os.listdir(full)):
            crel = rel + b"/" + name if rel else name
            p = full + b"/" + name
            s = os.lstat(p)
            m = s.st_mode
            common = (stat.S_IMODE(m), s.st_uid, s.st_gid, s.st_mtime_ns)
            if stat.S_ISDIR(m):
                out[crel] = ("dir", *common, _xattrs(p))
                stack.append(crel)
            elif stat.S_ISREG(m):
                out[crel] = ("file", *common, s.st_size, _digest(p), _xattrs(p))
                if s.st_nlink > 1:
                    inodes.setdefault((s.st_dev, s.st_ino), []).append(crel)
            elif stat.S_ISLNK(m):
                out[crel] = ("symlink", s.st_uid, s.st_gid, s.st_mtime_ns, os.readlink(p))
            elif stat.S_ISFIFO(m):
                out[crel] = ("fifo", *common)
            elif stat.S_ISSOCK(m):
                out[crel] = ("socket", *common)
            else:
                out[crel] = ("other", m)
    for paths in inodes.values():
        if len(paths) > 1:
            group = tuple(sorted(paths))
            for p in paths:
                out[p] = out[p] + (("links", group),)
    return out


def assert_same_tree(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> None:
    """Raise AssertionError naming every path that differs between the trees."""
    da, db = describe(a), describe(b)
    if da == db:
        return
    lines = []
    for p in sorted(set(da) | set(db)):
        if da.get(p) != db.get(p):
            lines.append(f"{p!r}:\n    {da.get(p)}\n    {db.get(p)}")
    raise AssertionError(f"trees {a} and {b} differ at {len(lines)} paths:\n"
                         + "\n".join(lines[:20]))


def allocated(path: str | os.PathLike[str]) -> int:
    """Bytes allocated on disk for ``path`` (st_blocks * 512)."""
    return os.lstat(path).st_blocks * 512


def xattrs_supported(directory: str | os.PathLike[str]) -> bool:
    """True if user xattrs can be set on files in ``directory``."""
    probe = os.path.join(os.fspath(directory), ".xattr-probe")
    with open(probe, "wb"):
        pass
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        os.unlink(probe)


def set_dir_times(root: bytes, dirs: list[tuple[bytes, int, int]]) -> None:
    """Apply (path, mode, mtime_ns) to directories, deepest first, after their content."""
    for rel, mode, mtime in sorted(dirs, key=lambda d: -d[0].count(b"/")):
        p = root + b"/" + rel
        os.chmod(p, mode)
        os.utime(p, ns=(mtime, mtime))


# -- the rich tree ----------------------------------------------------------------------


def build_rich_tree(root: str | os.PathLike[str], chunk_size: int = 1 << 20) -> None:
    """Create ``root`` (must not exist) holding every feature listed in the module doc."""
    r = os.fsencode(os.fspath(root))
    os.mkdir(r)
    t0 = 1_700_000_000_123_456_789
    dirs: list[tuple[bytes, int, int]] = []

    def d(rel: bytes, mode: int = 0o755) -> None:
        os.mkdir(r + b"/" + rel)
        dirs.append((rel, mode, t0 + 1000 * len(dirs) + 7))

    def f(rel: bytes, data: bytes, mode: int = 0o644, mtime: int = t0,
          owner: tuple[int, int] | None = None) -> bytes:
        p = r + b"/" + rel
        with open(p, "wb") as fh:
            fh.write(data)
        os.chmod(p, mode)
        if owner and AS_ROOT:
            os.chown(p, *owner)
        os.utime(p, ns=(mtime, mtime))
        return p

    def link(target: bytes, rel: bytes, mtime: int = t0 - 5) -> None:
        p = r + b"/" + rel
        os.symlink(target, p)
        os.utime(p, ns=(mtime, mtime), follow_symlinks=False)

    cs = chunk_size
    d(b"src")
    f(b"src/main.py", b"print('hello')\n" * 40, 0o755)
    f(b"src/empty", b"", 0o600)
    f(b"src/big.bin", bytes(range(256)) * (cs * 7 // 512) + b"tail", mtime=t0 + 1)
    f(b"src/exact", b"x" * cs, 0o640, mtime=-1_234_567_890_123)
    f(b"src/zeros", bytes(2 * cs + 10), mtime=t0 + 2)
    f(b"src/owned", b"owned by someone else\n", 0o640, owner=(1234, 5678))
    f(b"src/sticky", b"sticky\n", 0o1644)
    # sparse: 5 chunks, data in chunks 1 and 3 only, trailing hole
    sp = r + b"/src/sparse"
    with open(sp, "wb") as fh:
        fh.truncate(5 * cs + 123)
        fh.seek(cs)
        fh.write(b"D" * cs)
        fh.seek(3 * cs + 10)
        fh.write(b"middle")
    os.utime(sp, ns=(t0 + 3, t0 + 3))
    d(b"src/sub")
    d(b"src/sub/deeper")
    f(b"src/sub/deeper/leaf.txt", b"leaf\n", mtime=t0 + 4)
    d(b"empty-dir", 0o700)
    d(b"readonly", 0o555)
    f(b"readonly/inside", b"cannot add here\n", 0o444)
    d(b"readonly/ro-sub", 0o500)
    # names
    d(b"names")
    f(b"names/caf\xe9-latin1", b"not utf-8\n")
    f(b"names/" + b"n" * 255, b"long name\n")
    f(b"names/a b\nc", b"odd\n")
    f("names/\u00e9t\u00e9".encode(), b"utf-8\n")
    f(b"names/-dash", b"dash\n")
    # symlinks, stored verbatim
    d(b"links")
    link(b"../src/main.py", b"links/relative")
    link(b"/etc/passwd", b"links/absolute")
    link(b"no/such/target", b"links/dangling")
    link(b"\xff\xfe-odd-target", b"links/bytes-target")
    link(b"../links", b"links/to-own-dir")
    # hard links: three names across two dirs, and a pair in one dir
    d(b"hard")
    d(b"hard/other")
    a = f(b"hard/a", b"shared content\n", 0o600, mtime=t0 + 9)
    os.link(a, r + b"/hard/b")
    os.link(a, r + b"/hard/other/c")
    p = f(b"hard/other/pair1", b"pair\n", mtime=t0 + 10)
    os.link(p, r + b"/hard/other/pair2")
    # user xattrs on a file and a directory
    d(b"xattr")
    x = f(b"xattr/file", b"with xattrs\n", mtime=t0 + 11)
    os.setxattr(x, b"user.note", b"hello")
    os.setxattr(x, b"user.empty", b"")
    os.setxattr(x, b"user.binary", bytes(range(256)))
    os.utime(x, ns=(t0 + 11, t0 + 11))
    os.setxattr(r + b"/xattr", b"user.dir", b"on a directory")
    # a fifo
    os.mkfifo(r + b"/fifo", 0o640)
    os.utime(r + b"/fifo", ns=(t0 + 12, t0 + 12))
    set_dir_times(r, dirs)


# -- generated trees --------------------------------------------------------------------


@dataclass
class Node:
    """A generated tree node; ``kind`` is dir, file, symlink, fifo or hardlink."""

    kind: str
    mode: int = 0o644
    mtime: int = 0
    data: bytes = b""
    sparse: int = 0  # extra hole bytes written before ``data`` (file)
    target: bytes = b""  # symlink target, or the root-relative path a hardlink names
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    owner: tuple[int, int] = (0, 0)
    children: dict[bytes, Node] = field(default_factory=dict)


_NAMES = st.one_of(
    st.sampled_from([b"a", b"b", b"src", b"x.py", b"caf\xe9", b"\xff\xfe", b"sp ace",
                     b"-", b"..a", b".hidden", b"n" * 255, "\u00e9".encode()]),
    st.binary(min_size=1, max_size=8).filter(
        lambda n: b"/" not in n and b"\0" not in n and n not in (b".", b"..")),
)
_MTIMES = st.one_of(st.integers(-2 * 10**18, 4 * 10**18),
                    st.sampled_from([0, 1, 1_700_000_000_000_000_000]))
_OWNERS = st.sampled_from([(0, 0), (1000, 1000), (65534, 65534), (123456, 7)]
                          if AS_ROOT else [(os.getuid(), os.getgid())])
_XATTRS = st.dictionaries(st.sampled_from([b"user.a", b"user.b", b"user.long." + b"k" * 40]),
                          st.binary(max_size=40), max_size=2)


def _content(chunk_size: int) -> st.SearchStrategy[bytes]:
    pattern = st.binary(min_size=1, max_size=64)
    return st.one_of(
        st.binary(max_size=300),
        st.builds(lambda p, n: (p * (n // len(p) + 1))[:n], pattern,
                  st.sampled_from([chunk_size - 1, chunk_size, chunk_size + 1,
                                   2 * chunk_size + 17])),
    )


def _leaf(chunk_size: int) -> st.SearchStrategy[Node]:
    file = st.builds(lambda data, mode, mtime, xattrs, owner, sparse: Node(
        "file", mode, mtime, data, sparse, xattrs=xattrs, owner=owner),
        _content(chunk_size), st.sampled_from([0o644, 0o600, 0o755, 0o400, 0o1755]),
        _MTIMES, _XATTRS, _OWNERS, st.sampled_from([0, 0, 0, chunk_size, 3 * chunk_size]))
    symlink = st.builds(lambda target, mtime, owner: Node("symlink", 0o777, mtime,
                                                          target=target, owner=owner),
                        st.binary(min_size=1, max_size=30).filter(lambda t: b"\0" not in t),
                        _MTIMES, _OWNERS)
    fifo = st.builds(lambda mode, mtime: Node("fifo", mode, mtime),
                     st.sampled_from([0o644, 0o600]), _MTIMES)
    return st.one_of(file, file, symlink, fifo)


def tree_specs(chunk_size: int = 64 << 10, max_leaves: int = 12) -> st.SearchStrategy[Node]:
    """Generated root nodes (kind dir); hard links are added by ``with_hardlinks``."""
    def dirs(children: st.SearchStrategy[Node]) -> st.SearchStrategy[Node]:
        return st.builds(lambda ch, mode, mtime, xattrs, owner: Node(
            "dir", mode, mtime, xattrs=xattrs, owner=owner, children=ch),
            st.dictionaries(_NAMES, children, max_size=4),
            st.sampled_from([0o755, 0o700, 0o555, 0o1777]), _MTIMES, _XATTRS, _OWNERS)

    tree = st.recursive(_leaf(chunk_size), dirs, max_leaves=max_leaves)
    return st.builds(lambda ch: Node("dir", children=ch),
                     st.dictionaries(_NAMES, tree, max_size=5))


def _files(node: Node, prefix: bytes = b"") -> list[tuple[bytes, Node, Node]]:
    """(path, node, parent) of every file below ``node``."""
    out = []
    for name, child in node.children.items():
        path = prefix + b"/" + name if prefix else name
        if child.kind == "file":
            out.append((path, child, node))
        elif child.kind == "dir":
            out.extend(_files(child, path))
    return out


@st.composite
def with_hardlinks(draw: st.DrawFn, specs: st.SearchStrategy[Node]) -> Node:
    """A generated tree where some files get extra names (hard links) in some directory."""
    root = draw(specs)
    files = _files(root)
    dirs = [root] + [c for c in _walk_dirs(root)]
    for _ in range(draw(st.integers(0, 3))):
        if not files:
            break
        path, _, _ = draw(st.sampled_from(files))
        where = draw(st.sampled_from(dirs))
        name = draw(_NAMES)
        if name in where.children:
            continue
        where.children[name] = Node("hardlink", target=path)
    return root


def _walk_dirs(node: Node) -> list[Node]:
    out = []
    for child in node.children.values():
        if child.kind == "dir":
            out.append(child)
            out.extend(_walk_dirs(child))
    return out


def build_tree(root: str | os.PathLike[str], spec: Node) -> None:
    """Create ``root`` (must not exist) from ``spec``; the root's own metadata is left as
    created. Hard links are made after everything else, metadata of directories last."""
    r = os.fsencode(os.fspath(root))
    os.mkdir(r)
    dirs: list[tuple[bytes, Node]] = []
    links: list[tuple[bytes, bytes]] = []

    def walk(node: Node, rel: bytes) -> None:
        for name, c in node.children.items():
            crel = rel + b"/" + name if rel else name
            p = r + b"/" + crel
            if c.kind == "dir":
                os.mkdir(p)
                dirs.append((crel, c))
                walk(c, crel)
            elif c.kind == "file":
                with open(p, "wb") as fh:
                    if c.sparse:
                        fh.truncate(c.sparse)
                        fh.seek(c.sparse)
                    fh.write(c.data)
                for k, v in c.xattrs.items():
                    os.setxattr(p, k, v)
                if AS_ROOT:
                    os.chown(p, *c.owner)
                os.chmod(p, c.mode)
                os.utime(p, ns=(c.mtime, c.mtime))
            elif c.kind == "symlink":
                os.symlink(c.target, p)
                if AS_ROOT:
                    os.chown(p, *c.owner, follow_symlinks=False)
                os.utime(p, ns=(c.mtime, c.mtime), follow_symlinks=False)
            elif c.kind == "fifo":
                os.mkfifo(p)
                os.chmod(p, c.mode)
                os.utime(p, ns=(c.mtime, c.mtime))
            elif c.kind == "hardlink":
                links.append((crel, c.target))

    walk(spec, b"")
    for crel, target in links:
        os.link(r + b"/" + target, r + b"/" + crel)
    for crel, c in sorted(dirs, key=lambda d: -d[0].count(b"/")):
        p = r + b"/" + crel
        for k, v in c.xattrs.items():
            os.setxattr(p, k, v)
        if AS_ROOT:
            os.chown(p, *c.owner)
        os.chmod(p, c.mode)
        os.utime(p, ns=(c.mtime, c.mtime))


def cp_a(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """``cp -a src dst`` (dst must not exist): the reference copy for determinism tests."""
    import subprocess

    subprocess.run(["cp", "-a", "--", os.fspath(src), os.fspath(dst)], check=True)


def rel_path(root: Path, rel: bytes) -> bytes:
    return os.fsencode(root) + b"/" + rel


def as_nobody(fn, before=None) -> int:  # type: ignore[no-untyped-def]
    """Run ``fn()`` in a forked child with uid/gid 65534; return its exit status.
    ``before()``, if given, runs in the child first, still as this user."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 99
        try:
            if before is not None:
                before()
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
