"""ReadFile(path, offset=1, limit=2000): numbered lines of a text file, or an image (CONTRACT 5).

Output is ``cat -n`` style (line number right-aligned in six columns, a tab, the line
without its line break), each line cut at READ_LINE_CHARS characters, at most READ_MAX_BYTES
bytes per answer (about 25,000 tokens), with a notice giving the next offset when more lines
remain. The file is read as a stream: memory stays bounded whatever its size.

What is decided from a bounded prefix (the first READ_PROBE_BYTES bytes): a PNG, JPEG, GIF
or WebP signature makes the answer an image (at most READ_IMAGE_MAX bytes), returned as MCP
image content; a NUL byte makes the file binary (a notice, no content). Nothing past the
prefix is read for a binary file, so a 1 GiB sparse file answers at once.

What a read records in the ledger (tools.context.Seen), so that WriteFile and EditFile can
tell whether the file changed since:
- a text file of at most READ_HASH_WHOLE_MAX bytes, and an image: the blake3 of the whole
  file (read to its end, however many lines were shown);
- a larger text file: the blake3 of the bytes read (from the start to where the answer
  stopped) and the file's identity (device, inode, size, mtime and ctime in ns);
- a binary file (and an image too large to show): the same over the prefix.
A later change passes the freshness check only when the recorded digest still matches and,
for a partial record, the identity is unchanged (any write changes ctime).
"""

from __future__ import annotations

import os
import stat

import blake3

from tools import messages as M
from tools.context import Seen, ToolContext
from tools.paths import PathError, open_located
from tools.result import ToolResult, error, ok

NAME = "ReadFile"
READ_PROBE_BYTES = 8192            # prefix inspected for a NUL byte or an image signature
_BLOCK = 1 << 20                   # bytes read per system call
_LINE_KEEP = 4 * M.READ_LINE_CHARS + 4   # bytes kept of one line (enough for the cut)

# (signature test, MIME type, name) of the image formats returned as image content.
_IMAGES = (
    (lambda h: h.startswith(b"\x89PNG\r\n\x1a\n"), "image/png", "PNG"),
    (lambda h: h.startswith(b"\xff\xd8\xff"), "image/jpeg", "JPEG"),
    (lambda h: h[:6] in (b"GIF87a", b"GIF89a"), "image/gif", "GIF"),
    (lambda h: h[:4] == b"RIFF" and h[8:12] == b"WEBP", "image/webp", "WebP"),
)


def image_kind(head: bytes) -> tuple[str, str] | None:
    """(MIME type, format name) when ``head`` starts with a known image signature."""
    for test, mime, kind in _IMAGES:
        if test(head):
            return mime, kind
    return None


def read_all(fd: int) -> bytes:
    """All bytes from an open descriptor (from its current offset)."""
    chunks: list[bytes] = []
    while True:
        b = os.read(fd, _BLOCK)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def split_lines(text: str) -> list[str]:
    """Lines of ``text`` without their newline; a final newline adds no empty line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _render_line(number: int, raw: bytes, cut: bool) -> str:
    text = raw.decode("utf-8", errors="replace")
    if text.endswith("\r"):
        text = text[:-1]
    if cut or len(text) > M.READ_LINE_CHARS:
        text = text[:M.READ_LINE_CHARS] + M.READ_LINE_CUT.format(chars=M.READ_LINE_CHARS)
    return f"{number:6d}\t{text}"


class _Lines:
    """Collects the numbered lines ``first``..``last`` from a byte stream fed in blocks,
    within a byte budget for the rendering; counts every line."""

    def __init__(self, first: int, limit: int) -> None:
        self.first = first
        self.last_wanted = first + limit - 1
        self.count = 0                  # complete lines seen
        self.shown: list[str] = []
        self.size = 0                   # bytes of the rendering so far
        self.full = False               # the budget or the limit is reached
        self.cur = bytearray()          # the current line's kept bytes
        self.cur_len = 0                # the current line's length so far

    def _end_line(self) -> None:
        self.count += 1
        n = self.count
        if not self.full and self.first <= n <= self.last_wanted:
            line = _render_line(n, bytes(self.cur), self.cur_len > len(self.cur))
            cost = len(line.encode("utf-8")) + 1
            if self.shown and self.size + cost > M.READ_MAX_BYTES:
                self.full = True
            else:
                self.shown.append(line)
                self.size += cost
                if n == self.last_wanted:
                    self.full = True
        self.cur.clear()
        self.cur_len = 0

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            piece = data[start:] if nl < 0 else data[start:nl]
            room = _LINE_KEEP - len(self.cur)
            if room > 0 and self._wanted():
                self.cur += piece[:room]
            self.cur_len += len(piece)
            if nl < 0:
                return
            self._end_line()
            start = nl + 1

    def _wanted(self) -> bool:
        return not self.full and self.first <= self.count + 1 <= self.last_wanted

    def finish(self) -> None:
        """End of file: a last line without a line break still counts."""
        if self.cur_len:
            self._end_line()

    @property
    def long_line(self) -> bool:
        """The current (unfinished) line is longer than READ_LONG_LINE_SCAN bytes."""
        return self.cur_len > M.READ_LONG_LINE_SCAN


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_file(ctx: ToolContext, path: str, offset: int = 1,
              limit: int = M.READ_DEFAULT_LIMIT) -> ToolResult:
    """Read ``limit`` lines of ``path`` from line ``offset`` (1-based), at most
    READ_MAX_BYTES of text; an image is answered as image content. The data holds
    ``path``, ``kind`` (text, binary, image), ``size`` (bytes), ``first_line``,
    ``last_line``, ``total_lines`` (None when the file was not read to its end) and
    ``capped`` (the byte cap cut the answer)."""
    if offset < 1 or limit < 1:
        return error(NAME, M.READ_BAD_ARGS.format(offset=offset, limit=limit))
    try:
        loc, fd = open_located(ctx.root, path, os.O_RDONLY | os.O_NONBLOCK)
    except PathError as e:
        return error(NAME, e.text, kind=e.kind)
    rel = loc.rel
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return error(NAME, M.PATH_IS_DIR.format(path=rel), kind="is_dir")
        if not stat.S_ISREG(st.st_mode):
            return error(NAME, M.PATH_NOT_REGULAR.format(path=rel), kind="not_regular")
        return _read_open(ctx, rel, fd, st, offset, limit)
    except OSError as e:
        failed = PathError.from_os(rel, e)
        return error(NAME, failed.text, kind=failed.kind)
    finally:
        os.close(fd)
        loc.close()


def _read_open(ctx: ToolContext, rel: str, fd: int, st: os.stat_result, offset: int,
               limit: int) -> ToolResult:
    head = os.read(fd, READ_PROBE_BYTES)
    hasher = blake3.blake3(head)
    size = st.st_size
    image = image_kind(head)
    if image is not None and size <= M.READ_IMAGE_MAX:
        mime, kind = image
        body = bytearray(head)
        while len(body) <= M.READ_IMAGE_MAX:
            b = os.read(fd, _BLOCK)
            if not b:
                break
            body += b
        if len(body) <= M.READ_IMAGE_MAX:
            data = bytes(body)
            ctx.record_read(rel, Seen.whole_of(data))
            return ok(NAME, M.READ_IMAGE.format(path=rel, kind=kind, size=len(data)),
                      images=((mime, data),), path=rel, kind="image", mime_type=mime,
                      size=len(data))
    if image is not None or b"\0" in head:
        ctx.record_read(rel, Seen(hasher.hexdigest(), len(head), False, _identity(st)))
        if image is not None:
            return ok(NAME, M.READ_IMAGE_TOO_LARGE.format(path=rel, kind=image[1], size=size,
                                                          cap=M.READ_IMAGE_MAX),
                      path=rel, kind="binary", size=size)
        return ok(NAME, M.READ_BINARY.format(path=rel, size=size), path=rel, kind="binary",
                  binary=True, size=size)
    whole = size <= M.READ_HASH_WHOLE_MAX
    lines = _Lines(offset, limit)
    lines.feed(head)
    read = len(head)
    at_end = not head
    stopped_long = False
    while not at_end:
        if not whole and lines.full:
            break
        if not whole and lines.long_line:
            stopped_long = True
            break
        b = os.read(fd, _BLOCK)
        if not b:
            at_end = True
            break
        hasher.update(b)
        lines.feed(b)
        read += len(b)
    if at_end:
        lines.finish()
    if at_end and whole:
        ctx.record_read(rel, Seen(hasher.hexdigest(), read, True, None))
    else:
        ctx.record_read(rel, Seen(hasher.hexdigest(), read, False, _identity(st)))
    total = lines.count if at_end else None
    if total == 0:
        return ok(NAME, M.READ_EMPTY.format(path=rel), path=rel, kind="text", size=size,
                  total_lines=0)
    if not lines.shown:
        if stopped_long:
            return error(NAME, M.READ_LONG_LINE.format(path=rel, line=lines.count + 1,
                                                       scan=M.READ_LONG_LINE_SCAN),
                         kind="long_line")
        return error(NAME, M.READ_PAST_END.format(path=rel, offset=offset, total=total),
                     kind="past_end", total_lines=total)
    last = offset + len(lines.shown) - 1
    text = "\n".join(lines.shown)
    capped = lines.size > 0 and len(lines.shown) < limit and (total is None or last < total)
    if stopped_long and (total is None):
        text += "\n" + M.READ_LONG_LINE.format(path=rel, line=lines.count + 1,
                                               scan=M.READ_LONG_LINE_SCAN)
    elif total is None:
        note = M.READ_CAPPED_OPEN if capped else M.READ_MORE_OPEN
        text += "\n" + note.format(first=offset, last=last, next=last + 1,
                                   cap=M.READ_MAX_BYTES)
    elif last < total:
        note = M.READ_CAPPED if capped else M.READ_MORE
        text += "\n" + note.format(first=offset, last=last, total=total, next=last + 1,
                                   cap=M.READ_MAX_BYTES)
    return ok(NAME, text, path=rel, kind="text", size=size, first_line=offset,
              last_line=last, total_lines=total, capped=capped)
