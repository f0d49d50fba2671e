"""ReadFile, WriteFile and EditFile against a plain directory root: behaviour and caps."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.binding import DirBinding
from tools.context import ToolContext
from tools.editfile import edit_file
from tools.readfile import read_file
from tools.writefile import write_file


@pytest.fixture
def ws(tmp_path: Path) -> ToolContext:
    root = tmp_path / "root"
    root.mkdir()
    return ToolContext(DirBinding(root))


def put(ws: ToolContext, rel: str, text: str | bytes) -> Path:
    p = Path(ws.root.path) / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        p.write_text(text)
    else:
        p.write_bytes(text)
    return p


# --- ReadFile ---------------------------------------------------------------------------

def test_read_numbers_lines_like_cat_n(ws: ToolContext) -> None:
    put(ws, "a.txt", "one\ntwo\n")
    r = read_file(ws, "a.txt")
    assert r.ok
    assert r.render() == "     1\tone\n     2\ttwo"


def test_read_default_limit_2000_and_next_offset_notice(ws: ToolContext) -> None:
    put(ws, "big.txt", "".join(f"l{i}\n" for i in range(1, 2501)))
    r = read_file(ws, "big.txt")
    lines = r.text.split("\n")
    assert len(lines) == 2001
    assert lines[1999] == "  2000\tl2000"
    assert lines[-1] == "[lines 1-2000 of 2500; continue with offset=2001]"
    r2 = read_file(ws, "big.txt", offset=2001)
    assert r2.text.split("\n")[0] == "  2001\tl2001"
    assert r2.text.split("\n")[-1] == "  2500\tl2500"
    r3 = read_file(ws, "big.txt", offset=10, limit=5)
    assert r3.text.split("\n") == [f"{i:6d}\tl{i}" for i in range(10, 15)] + [
        "[lines 10-14 of 2500; continue with offset=15]"]


def test_read_cuts_lines_at_2000_characters(ws: ToolContext) -> None:
    put(ws, "long.txt", "x" * 2000 + "\n" + "y" * 2001 + "\n")
    lines = read_file(ws, "long.txt").text.split("\n")
    assert lines[0] == "     1\t" + "x" * 2000
    assert lines[1] == "     2\t" + "y" * 2000 + " [... line cut at 2000 characters]"


def test_read_errors(ws: ToolContext) -> None:
    put(ws, "a.txt", "one\n")
    put(ws, "empty.txt", "")
    os.mkdir(os.path.join(ws.root.path, "d"))
    assert read_file(ws, "nope").render() == "error: nope: no such file or directory"
    assert read_file(ws, "d").render() == "error: d: is a directory"
    assert read_file(ws, "a.txt", offset=5).render() == (
        "error: a.txt: offset 5 is past the end of the file (1 lines)")
    assert read_file(ws, "a.txt", offset=0).render() == (
        "error: offset must be >= 1 and limit >= 1 (got offset=0, limit=2000)")
    assert read_file(ws, "empty.txt").render() == "empty.txt: empty file"
    os.mkfifo(os.path.join(ws.root.path, "fifo"))
    assert read_file(ws, "fifo").render() == "error: fifo: not a regular file"


def test_read_binary_is_not_shown_but_recorded(ws: ToolContext) -> None:
    put(ws, "b.bin", b"\x00\x01\x02abc")
    r = read_file(ws, "b.bin")
    assert r.ok and r.render() == "b.bin: binary file (6 bytes); not shown"
    assert write_file(ws, "b.bin", "text now").ok


# --- WriteFile --------------------------------------------------------------------------

def test_write_creates_file_and_parents(ws: ToolContext) -> None:
    r = write_file(ws, "src/pkg/new.py", "print(1)\nprint(2)\n")
    assert r.render() == "created src/pkg/new.py (2 lines, 18 bytes)"
    assert (Path(ws.root.path) / "src/pkg/new.py").read_text() == "print(1)\nprint(2)\n"
    # Our own write counts as seen: writing again needs no read.
    r2 = write_file(ws, "src/pkg/new.py", "x\n")
    assert r2.render() == "wrote src/pkg/new.py (1 lines, 2 bytes)"
    assert not [n for n in os.listdir(Path(ws.root.path) / "src/pkg") if n.endswith(".tmp")]


def test_overwrite_requires_a_read(ws: ToolContext) -> None:
    p = put(ws, "a.txt", "orig\n")
    r = write_file(ws, "a.txt", "new\n")
    assert r.render() == ("error: a.txt: exists but has not been read; read it with ReadFile "
                          "before changing it")
    assert p.read_text() == "orig\n"
    read_file(ws, "a.txt", limit=1)
    assert write_file(ws, "a.txt", "new\n").ok
    assert p.read_text() == "new\n"


def test_stale_write_refused_after_another_process_changed_the_file(ws: ToolContext) -> None:
    p = put(ws, "a.txt", "v1\n")
    assert read_file(ws, "a.txt").ok
    subprocess.run([sys.executable, "-c", f"open({str(p)!r}, 'w').write('v2 other\\n')"],
                   check=True)
    r = write_file(ws, "a.txt", "mine\n")
    assert r.render() == ("error: a.txt: changed since it was last read; read it again with "
                          "ReadFile before changing it")
    assert p.read_text() == "v2 other\n"
    e = edit_file(ws, "a.txt", "v2", "v3")
    assert e.render() == r.render().replace("WriteFile", "EditFile")
    assert p.read_text() == "v2 other\n"
    read_file(ws, "a.txt")
    assert write_file(ws, "a.txt", "mine\n").ok


def test_write_keeps_mode_and_replaces_atomically(ws: ToolContext) -> None:
    p = put(ws, "run.sh", "#!/bin/sh\n")
    os.chmod(p, 0o751)
    ino = p.stat().st_ino
    read_file(ws, "run.sh")
    assert write_file(ws, "run.sh", "#!/bin/sh\necho hi\n").ok
    assert p.stat().st_mode & 0o7777 == 0o751
    assert p.stat().st_ino != ino          # a new inode renamed over the old name


def test_write_through_symlink_inside_root_writes_target(ws: ToolContext) -> None:
    p = put(ws, "real.txt", "a\n")
    os.symlink("real.txt", os.path.join(ws.root.path, "link.txt"))
    read_file(ws, "link.txt")
    assert write_file(ws, "link.txt", "b\n").render() == "wrote real.txt (1 lines, 2 bytes)"
    assert p.read_text() == "b\n"
    assert os.path.islink(os.path.join(ws.root.path, "link.txt"))


def _create_same(root: str, barrier: multiprocessing.synchronize.Barrier, i: int,  # type: ignore[name-defined]
                 q: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    w = ToolContext(DirBinding(root))
    barrier.wait()
    r = write_file(w, "race/new.txt", f"writer {i}\n")
    q.put((i, r.ok, r.render()))


def test_concurrent_creation_exactly_one_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    for round_ in range(10):
        root = tmp_path / f"r{round_}"
        root.mkdir()
        n = 6
        barrier = ctx.Barrier(n)
        q = ctx.Queue()
        procs = [ctx.Process(target=_create_same, args=(str(root), barrier, i, q))
                 for i in range(n)]
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for _ in range(n)]
        for p in procs:
            p.join(60)
        winners = [r for r in results if r[1]]
        assert len(winners) == 1, results
        losers = [r for r in results if not r[1]]
        # A loser either lost the link race or arrived after the winner: both refuse.
        for _, _, text in losers:
            assert text in (
                "error: race/new.txt: was created by someone else meanwhile; read it with "
                "ReadFile before changing it",
                "error: race/new.txt: exists but has not been read; read it with ReadFile "
                "before changing it")
        assert (root / "race/new.txt").read_text() == f"writer {winners[0][0]}\n"
        assert os.listdir(root / "race") == ["new.txt"]


# --- EditFile ---------------------------------------------------------------------------

def test_edit_replaces_unique_substring_with_diff(ws: ToolContext) -> None:
    p = put(ws, "m.py", "def f():\n    return 1\n\ndef g():\n    return 2\n")
    read_file(ws, "m.py")
    r = edit_file(ws, "m.py", "return 1", "return 10")
    assert r.render() == (
        "edited m.py: 1 replacement\n"
        "--- a/m.py\n+++ b/m.py\n@@ -1,3 +1,3 @@\n def f():\n-    return 1\n+    return 10\n ")
    assert p.read_text() == "def f():\n    return 10\n\ndef g():\n    return 2\n"
    # Its own edit keeps the ledger fresh: a second edit needs no read.
    assert edit_file(ws, "m.py", "return 2", "return 20").ok


def test_edit_refusals(ws: ToolContext) -> None:
    p = put(ws, "m.py", "x = 1\ny = 1\nx = 1\nvalue_total = compute(a, b)\n")
    assert edit_file(ws, "m.py", "x", "x").render() == (
        "error: old and new are identical; nothing to change")
    assert edit_file(ws, "m.py", "", "y").render() == (
        "error: old must not be empty; use WriteFile to create or replace a whole file")
    assert edit_file(ws, "m.py", "x = 1", "x = 2").render() == (
        "error: m.py: exists but has not been read; read it with ReadFile before changing it")
    read_file(ws, "m.py")
    assert edit_file(ws, "m.py", "x = 1", "x = 2").render() == (
        "error: m.py: old text occurs 2 times (lines 1, 3); include more context to make it "
        "unique, or set replace_all")
    assert edit_file(ws, "m.py", "value_totl = compute(a, b)", "v").render() == (
        "error: m.py: old text not found. Closest lines:\n"
        "     4\tvalue_total = compute(a, b)")
    assert edit_file(ws, "m.py", "zzzzqqqq", "v").render() == (
        "error: m.py: old text not found, and no line resembles its first line")
    assert p.read_text() == "x = 1\ny = 1\nx = 1\nvalue_total = compute(a, b)\n"
    r = edit_file(ws, "m.py", "x = 1", "x = 2", replace_all=True)
    assert r.text.startswith("edited m.py: 2 replacements\n")
    assert p.read_text() == "x = 2\ny = 1\nx = 2\nvalue_total = compute(a, b)\n"


def test_edit_diff_is_cut(ws: ToolContext) -> None:
    put(ws, "m.txt", "".join(f"a{i}\n" for i in range(200)))
    read_file(ws, "m.txt")
    r = edit_file(ws, "m.txt", "a", "b", replace_all=True)
    lines = r.text.split("\n")
    assert lines[0] == "edited m.txt: 200 replacements"
    assert len(lines) == 1 + 60 + 1
    assert lines[-1] == "[... diff cut: 343 more lines]"


def test_edit_refuses_non_utf8(ws: ToolContext) -> None:
    put(ws, "l1.txt", b"caf\xe9\n")
    read_file(ws, "l1.txt")
    assert edit_file(ws, "l1.txt", "caf", "tea").render() == (
        "error: l1.txt: not UTF-8 text; cannot edit it")


def test_creation_loses_to_a_file_created_after_the_check(ws: ToolContext) -> None:
    from tools.paths import locate
    from tools.writefile import Refusal, create_new

    with locate(ws.root, "late.txt") as loc:
        assert loc.st is None
        put(ws, "late.txt", "theirs\n")          # appears between check and create
        with pytest.raises(Refusal) as ei:
            create_new(loc, b"mine\n")
    assert ei.value.kind == "created"
    assert (Path(ws.root.path) / "late.txt").read_text() == "theirs\n"
    assert os.listdir(ws.root.path) == ["late.txt"]


# --- ReadFile caps, binary prefix, images, ledger records (issue 11, point 8) --------------

def test_read_caps_the_answer_in_bytes_with_the_paging_hint(ws: ToolContext) -> None:
    put(ws, "wide.txt", "".join(f"{i:05d} " + "w" * 993 + "\n" for i in range(1, 501)))
    r = read_file(ws, "wide.txt")
    lines = r.text.split("\n")
    assert len(r.text.encode()) <= 100_000 + 200
    assert lines[-1] == ("[lines 1-99 of 500; the answer is capped at 100000 bytes; "
                         "continue with offset=100]")
    assert (r.data["last_line"], r.data["total_lines"], r.data["capped"]) == (99, 500, True)
    nxt = read_file(ws, "wide.txt", offset=100)
    assert nxt.text.startswith("   100\t00100 ")
    # The whole file was hashed although 99 lines were shown: an edit is allowed.
    assert edit_file(ws, "wide.txt", "00500 w", "00500 W").ok


def test_read_of_a_large_text_file_stops_early_and_records_what_it_read(
        ws: ToolContext) -> None:
    p = put(ws, "big.log", "")
    line = "x" * 99 + "\n"
    with open(p, "w") as f:
        for _ in range(200_000):                    # 20 MB: above the whole-hash size
            f.write(line)
    r = read_file(ws, "big.log", limit=10)
    assert r.text.split("\n")[-1] == ("[lines 1-10; the file goes on; continue with "
                                      "offset=11]")
    assert r.data["total_lines"] is None
    seen = ws.recorded("big.log")
    assert seen is not None and not seen.whole and seen.length < 4 * 1024 * 1024
    assert edit_file(ws, "big.log", "x" * 99 + "\n", "y\n", replace_all=False).render() \
        .startswith("error: big.log: old text occurs 200000 times (lines 1, 2, 3,")
    # Changed by someone else after the read (its ctime moves): refused.
    with open(p, "r+") as f:
        f.seek(10_000_000)
        f.write("z")
    assert edit_file(ws, "big.log", "z", "Z").render() == (
        "error: big.log: changed since it was last read; read it again with ReadFile before "
        "changing it")
    assert read_file(ws, "big.log", limit=1).ok
    assert edit_file(ws, "big.log", "z", "Z").ok


def test_repeated_match_message_is_capped(ws: ToolContext) -> None:
    put(ws, "rep.txt", "same\n" * 100)
    read_file(ws, "rep.txt")
    r = edit_file(ws, "rep.txt", "same", "other")
    numbers = ", ".join(str(i) for i in range(1, 21))
    assert r.render() == (f"error: rep.txt: old text occurs 100 times (lines {numbers} and "
                          "80 more); include more context to make it unique, or set "
                          "replace_all")


def test_binary_detection_reads_only_a_prefix(ws: ToolContext) -> None:
    p = put(ws, "sparse.img", b"")
    with open(p, "wb") as f:
        f.truncate(1 << 30)
    r = read_file(ws, "sparse.img")
    assert r.render() == f"sparse.img: binary file ({1 << 30} bytes); not shown"
    seen = ws.recorded("sparse.img")
    assert seen is not None and not seen.whole and seen.length == 8192
    # A write over it is checked against that record: allowed while unchanged ...
    assert write_file(ws, "sparse.img", "now text\n").ok
    assert p.read_text() == "now text\n"


def test_binary_record_refuses_a_write_after_a_change(ws: ToolContext) -> None:
    p = put(ws, "blob.bin", b"\0\1\2" * 10_000)
    assert read_file(ws, "blob.bin").data["kind"] == "binary"
    with open(p, "r+b") as f:                     # past the prefix that was read
        f.seek(20_000)
        f.write(b"\7")
    assert write_file(ws, "blob.bin", "x").render() == (
        "error: blob.bin: changed since it was last read; read it again with ReadFile "
        "before changing it")


PNG = (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\1\0\0\0\1\x08\x06\0\0\0\x1f\x15\xc4\x89"
       b"\0\0\0\rIDATx\x9cc\xf8\xff\xff?\0\x05\xfe\x02\xfe\xa7\x35\x81\x84\0\0\0\0IEND"
       b"\xaeB`\x82")


@pytest.mark.parametrize("name,data,mime", [
    ("p.png", PNG, "image/png"),
    ("j.jpg", b"\xff\xd8\xff\xe0\0\x10JFIF\0" + b"\0" * 100, "image/jpeg"),
    ("g.gif", b"GIF89a\1\0\1\0" + b"\0" * 30, "image/gif"),
    ("w.webp", b"RIFF\x24\0\0\0WEBPVP8 " + b"\0" * 30, "image/webp"),
])
def test_images_are_returned_as_images(ws: ToolContext, name: str, data: bytes,
                                       mime: str) -> None:
    put(ws, name, data)
    r = read_file(ws, name)
    assert r.ok and r.images == ((mime, data),)
    assert r.data["kind"] == "image" and r.data["mime_type"] == mime
    seen = ws.recorded(name)
    assert seen is not None and seen.whole


# --- CRLF, xattrs, hard links (issue 11, point 9) -----------------------------------------

def test_edit_of_a_crlf_file_matches_lf_text_and_keeps_crlf(ws: ToolContext) -> None:
    p = put(ws, "win.txt", b"")
    p.write_bytes(b"one\r\ntwo\r\nthree\r\n")
    read_file(ws, "win.txt")
    r = edit_file(ws, "win.txt", "one\ntwo\n", "one\nzwei\nand more\n")
    assert r.ok, r.render()
    assert p.read_bytes() == b"one\r\nzwei\r\nand more\r\nthree\r\n"
    assert edit_file(ws, "win.txt", "three", "drei\nvier").ok
    assert p.read_bytes() == b"one\r\nzwei\r\nand more\r\ndrei\r\nvier\r\n"
    r = write_file(ws, "win.txt", "a\nb\n")
    assert r.ok and r.data["crlf"] is True
    assert p.read_bytes() == b"a\r\nb\r\n"
    assert read_file(ws, "win.txt").text == "     1\ta\n     2\tb"


def test_edit_keeps_xattrs_mode_and_owner(ws: ToolContext) -> None:
    p = put(ws, "x.txt", "hello\n")
    try:
        os.setxattr(p, "user.origin", b"agent-test")
    except OSError as e:
        pytest.skip(f"no user xattrs here: {e}")
    os.chmod(p, 0o640)
    st = p.stat()
    read_file(ws, "x.txt")
    assert edit_file(ws, "x.txt", "hello", "bye").ok
    assert os.getxattr(p, "user.origin") == b"agent-test"
    assert write_file(ws, "x.txt", "again\n").ok
    after = p.stat()
    assert os.getxattr(p, "user.origin") == b"agent-test"
    assert (after.st_mode, after.st_uid, after.st_gid) == (st.st_mode, st.st_uid, st.st_gid)


def test_edit_of_a_hard_linked_file_keeps_one_file(ws: ToolContext) -> None:
    p = put(ws, "a.txt", "shared line\nlonger tail that will shrink\n")
    other = Path(ws.root.path) / "b.txt"
    os.link(p, other)
    ino = p.stat().st_ino
    read_file(ws, "a.txt")
    assert edit_file(ws, "a.txt", "longer tail that will shrink", "tail").ok
    assert other.read_text() == "shared line\ntail\n"
    assert p.stat().st_ino == ino and p.stat().st_nlink == 2
    assert write_file(ws, "a.txt", "whole\n").ok
    assert other.read_text() == "whole\n" and other.stat().st_ino == ino


# --- '~' (issue 11, point 12) -------------------------------------------------------------

@pytest.mark.parametrize("path", ["~", "~/x.txt", "~root/x.txt", "~nobody"])
def test_tilde_paths_are_refused(ws: ToolContext, path: str) -> None:
    want = (f"error: {path}: '~' is not expanded here (no home directory); use a path "
            "relative to the workspace root")
    assert write_file(ws, path, "x\n").render() == want
    assert read_file(ws, path).render() == want
    assert edit_file(ws, path, "a", "b").render() == want
    assert os.listdir(ws.root.path) == []


# --- the same edits on a session mount (the FUSE overlay) ---------------------------------

def test_edits_on_a_session_mount_keep_crlf_xattrs_and_hard_links(
        mounter: object, lower_ref: str) -> None:
    d = mounter.rw(lower_ref)                                # type: ignore[attr-defined]
    mnt = Path(d.mnt)
    ws = ToolContext(DirBinding(mnt))
    (mnt / "win.txt").write_bytes(b"a\r\nb\r\n")
    (mnt / "tagged.txt").write_text("v1\n")
    os.setxattr(mnt / "tagged.txt", "user.tag", b"kept")
    (mnt / "one.txt").write_text("shared\n")
    os.link(mnt / "one.txt", mnt / "two.txt")
    for rel in ("win.txt", "tagged.txt", "one.txt"):
        assert read_file(ws, rel).ok
    assert edit_file(ws, "win.txt", "a\nb", "x\ny\nz").ok
    assert (mnt / "win.txt").read_bytes() == b"x\r\ny\r\nz\r\n"
    assert edit_file(ws, "tagged.txt", "v1", "v2").ok
    assert os.getxattr(mnt / "tagged.txt", "user.tag") == b"kept"
    assert edit_file(ws, "one.txt", "shared", "changed through one name").ok
    assert (mnt / "two.txt").read_text() == "changed through one name\n"
    assert os.stat(mnt / "one.txt").st_ino == os.stat(mnt / "two.txt").st_ino
    with open(mnt / "sparse.img", "wb") as f:
        f.truncate(1 << 30)
    r = read_file(ws, "sparse.img")
    assert r.render() == f"sparse.img: binary file ({1 << 30} bytes); not shown"
