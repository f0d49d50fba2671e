"""Paths as one line of text: how the CLI and the agent tools print a name.

A file name may hold any byte but ``/`` and NUL: a newline or a tab in it would forge a line
of a listing (a name ``x<newline>D<tab>src/main.py`` reads as a second change), and other
control bytes would reach the terminal. ``text_path`` is the one rendering every listing
uses, and the one for a step's label (a Bash command may span lines); text that prints as
it is (and does not start with ``"``) is left as it is.
"""

from __future__ import annotations

import os

_C_ESCAPES = {0x0A: "\\n", 0x09: "\\t", 0x0D: "\\r", 0x22: '\\"', 0x5C: "\\\\"}


def text_path(path: str) -> str:
    """``path`` (decoded with surrogateescape) for one line of text output: as it is when it
    is printable, else C-quoted as git does (``"a\\nb"``, other control bytes and bytes that
    are not UTF-8 as ``\\ooo`` octal), so a name holding a newline cannot forge a line."""
    if path.isprintable() and not path.startswith('"'):
        return path
    raw = os.fsencode(path)
    out = []
    i = 0
    while i < len(raw):
        b = raw[i]
        if b in _C_ESCAPES:
            out.append(_C_ESCAPES[b])
        elif b < 0x20 or b == 0x7F:
            out.append(f"\\{b:03o}")
        elif b < 0x80:
            out.append(chr(b))
        else:  # keep a valid UTF-8 sequence, escape a stray byte
            n = 2 if b >> 5 == 0b110 else 3 if b >> 4 == 0b1110 else 4 if b >> 3 == 0b11110 else 0
            try:
                ch = raw[i:i + n].decode() if n else ""
            except UnicodeDecodeError:
                ch = ""
            if ch and ch.isprintable():
                out.append(ch)
                i += n
                continue
            out.append(f"\\{b:03o}")
        i += 1
    return '"' + "".join(out) + '"'


def text_paths(paths: list[str]) -> str:
    """``paths`` on one line: each as ``text_path`` renders it, joined by ``, ``."""
    return ", ".join(text_path(p) for p in paths)
