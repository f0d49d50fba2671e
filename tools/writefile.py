"""WriteFile(path, content): create or replace a whole file (CONTRACT 5, amended by 5 edits).

A new file is written to a temporary name and hard-linked into place, so a concurrent
creation of the same name is never clobbered (exactly one creator wins). Replacing an
existing file requires a ledger record that the file still matches (see tools.context).
A file with one link is replaced atomically: the new content goes to a temporary file in
the same directory, is fsynced, gets the old file's mode, owner (when permitted) and
extended attributes, and is renamed over the old name. A file with several hard links is
rewritten in place (whole content, truncated to its length, then fsync), so its names stay
one file; that rewrite is not atomic. An existing file whose lines end with CRLF keeps
CRLF: new content written with bare LF line breaks gets CRLF ones. Missing parent
directories are created. Also home of the write primitives EditFile shares.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat

from tools import messages as M
from tools.binding import PermitError
from tools.context import Seen, ToolContext
from tools.paths import Located, PathError, locate
from tools.readfile import read_all, split_lines
from tools.result import ToolResult, error, ok

NAME = "WriteFile"
_CRLF_PROBE = 64 * 1024  # bytes that decide a partially read file's line breaks


class Refusal(Exception):
    """A write refused for a reason the model can act on: ``text`` and ``kind``."""

    def __init__(self, kind: str, text: str) -> None:
        self.kind = kind
        self.text = text
        super().__init__(text)


def change_failed(tool: str, path: str, e: PathError | PermitError | Refusal | OSError
                  ) -> ToolResult:
    """The error answer of ``tool`` (WriteFile, EditFile) whose change of ``path`` (the
    argument as given) failed with ``e``: its text and kind (``permit`` for a write permit
    refused, the PathError kind of an OSError)."""
    if isinstance(e, PermitError):
        return error(tool, M.PERMIT_FAILED.format(reason=e), kind="permit")
    if isinstance(e, OSError):
        e = PathError.from_os(path, e)
    return error(tool, e.text, kind=e.kind)


def _temp_name(name: str) -> str:
    return f".{name[:200]}.{secrets.token_hex(6)}.tmp"


def _write_temp(loc: Located, data: bytes, mode: int = 0o666) -> str:
    """Write ``data`` to a new fsynced temporary file beside ``loc``; returns its name."""
    tmp = _temp_name(loc.name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 mode, dir_fd=loc.parent_fd)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink_quiet(loc, tmp)
        raise
    os.close(fd)
    return tmp


def _unlink_quiet(loc: Located, name: str) -> None:
    try:
        os.unlink(name, dir_fd=loc.parent_fd)
    except OSError:
        pass


def _sync_dir(loc: Located) -> None:
    try:
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=loc.parent_fd)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_new(loc: Located, data: bytes) -> None:
    """Create ``loc`` with ``data``; Refusal(created) when the name appeared meanwhile."""
    tmp = _write_temp(loc, data)
    try:
        os.link(tmp, loc.name, src_dir_fd=loc.parent_fd, dst_dir_fd=loc.parent_fd,
                follow_symlinks=False)
    except FileExistsError:
        raise Refusal("created", M.STALE_CREATED.format(path=loc.rel)) from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        _create_exclusive(loc, data)    # no hard links here: O_EXCL still never clobbers
    finally:
        _unlink_quiet(loc, tmp)
    _sync_dir(loc)


def _create_exclusive(loc: Located, data: bytes) -> None:
    try:
        fd = os.open(loc.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                     os.O_CLOEXEC, 0o666, dir_fd=loc.parent_fd)
    except FileExistsError:
        raise Refusal("created", M.STALE_CREATED.format(path=loc.rel)) from None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_current(loc: Located, limit: int | None = None) -> tuple[bytes, os.stat_result]:
    """Bytes (all, or the first ``limit``) and stat of the existing regular file at ``loc``
    (opened no-follow)."""
    fd = loc.open(os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise PathError("is_dir", loc.rel)
        if not stat.S_ISREG(st.st_mode):
            raise PathError("not_regular", loc.rel)
        if limit is None:
            return read_all(fd), st
        chunks, left = [], limit
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def check_fresh(ctx: ToolContext, rel: str, current: bytes, st: os.stat_result) -> None:
    """Refusal unless the ledger holds a record for ``rel`` that the file (``current``,
    ``st``) still matches."""
    seen = ctx.recorded(rel)
    if seen is None:
        raise Refusal("not_read", M.STALE_NOT_READ.format(path=rel))
    if not seen.matches(current, st):
        raise Refusal("stale", M.STALE_CHANGED.format(path=rel))


def uses_crlf(data: bytes) -> bool:
    """Whether most line breaks of ``data`` are CRLF."""
    crlf = data.count(b"\r\n")
    return crlf > 0 and crlf >= data.count(b"\n") - crlf


def to_crlf(text: str) -> str:
    """``text`` with every line break as CRLF."""
    return text.replace("\r\n", "\n").replace("\n", "\r\n")


def _copy_xattrs(src_fd: int, dst_fd: int) -> None:
    """Copy the extended attributes of ``src_fd`` to ``dst_fd``. A ``user.`` attribute that
    cannot be set raises; others (``security.``, ``trusted.``: not ours to set) are
    skipped when refused."""
    try:
        names = os.listxattr(src_fd)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        raise
    for name in names:
        try:
            value = os.getxattr(src_fd, name)
            os.setxattr(dst_fd, name, value)
        except OSError:
            if name.startswith("user."):
                raise


def _rewrite_in_place(loc: Located, data: bytes) -> None:
    """Write ``data`` over the file at ``loc`` (all its hard links see it), truncate it to
    that length and fsync it."""
    fd = loc.open(os.O_WRONLY | os.O_NONBLOCK)
    try:
        view = memoryview(data)
        pos = 0
        while pos < len(data):
            pos += os.pwrite(fd, view[pos:], pos)
        os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_existing(loc: Located, data: bytes, old: os.stat_result) -> None:
    """Replace the content of the file at ``loc`` (whose stat was ``old``): in place when it
    has several hard links, else atomically, keeping mode, owner (if allowed) and extended
    attributes."""
    if old.st_nlink > 1:
        _rewrite_in_place(loc, data)
        return
    tmp = _write_temp(loc, data, 0o600)
    try:
        src = loc.open(os.O_RDONLY | os.O_NONBLOCK)
        try:
            dst = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=loc.parent_fd)
            try:
                _copy_xattrs(src, dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
    except BaseException:
        _unlink_quiet(loc, tmp)
        raise
    try:
        os.chmod(tmp, stat.S_IMODE(old.st_mode), dir_fd=loc.parent_fd, follow_symlinks=False)
    except (NotImplementedError, OSError):
        fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=loc.parent_fd)
        try:
            os.fchmod(fd, stat.S_IMODE(old.st_mode))
        finally:
            os.close(fd)
    try:
        os.chown(tmp, old.st_uid, old.st_gid, dir_fd=loc.parent_fd, follow_symlinks=False)
    except OSError:
        pass                            # not permitted: the file becomes the writer's
    try:
        os.rename(tmp, loc.name, src_dir_fd=loc.parent_fd, dst_dir_fd=loc.parent_fd)
    except BaseException:
        _unlink_quiet(loc, tmp)
        raise
    _sync_dir(loc)


def count_lines(data: bytes) -> int:
    return len(split_lines(data.decode("utf-8", errors="replace")))


def write_file(ctx: ToolContext, path: str, content: str) -> ToolResult:
    """Create ``path`` or replace it with ``content`` (UTF-8). The data holds ``path``,
    ``created``, ``size`` (bytes written), ``lines`` and ``crlf`` (CRLF line breaks kept)."""
    data = content.encode("utf-8", errors="surrogateescape")
    crlf = False
    try:
        with ctx.binding.write_permit():
            with locate(ctx.root, path, make_parents=True, write=True) as loc:
                if loc.st is None:
                    create_new(loc, data)
                    created = True
                else:
                    # A partial record is checked on its prefix and the file's identity:
                    # no need to read a large or sparse file whole.
                    seen = ctx.recorded(loc.rel)
                    limit = None if seen is None or seen.whole else max(seen.length,
                                                                        _CRLF_PROBE)
                    current, st = read_current(loc, 0 if seen is None else limit)
                    check_fresh(ctx, loc.rel, current, st)
                    if uses_crlf(current) and "\n" in content and "\r\n" not in content:
                        crlf = True
                        data = to_crlf(content).encode("utf-8", errors="surrogateescape")
                    replace_existing(loc, data, st)
                    created = False
                rel = loc.rel
    except (PathError, PermitError, Refusal, OSError) as e:
        return change_failed(NAME, path, e)
    ctx.record_read(rel, Seen.whole_of(data))
    template = M.WRITE_CREATED if created else M.WRITE_UPDATED
    lines = count_lines(data)
    text = template.format(path=rel, lines=lines, size=len(data))
    if crlf:
        text += " " + M.WRITE_CRLF_KEPT
    return ok(NAME, text, path=rel, created=created, size=len(data), lines=lines, crlf=crlf)
