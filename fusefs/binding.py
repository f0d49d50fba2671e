"""Which pyfuse3 serves the mounts: the build patched by ``scripts/setup.sh`` (see
``scripts/pyfuse3/README.md``), or a stock one, detected at run time.

The patch adds ``pyfuse3.extensions``, a frozenset of feature names; a stock pyfuse3 has no
such attribute. ``EXTENDED`` is true when every feature the FUSE adapter relies on for
kernel caching is there: ``opendir`` answering a ``FileInfo`` with ``cache_readdir``,
``absent_xattr_prefixes``, the inode in handle requests and INIT capabilities.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Any

import pyfuse3

NEEDED = frozenset({"file_info_flags", "opendir_file_info", "inode_in_requests",
                    "init_capabilities", "absent_xattr_prefixes"})

FEATURES: frozenset[str] = frozenset(getattr(pyfuse3, "extensions", ()))
EXTENDED = NEEDED <= FEATURES


def kind() -> str:
    """``"patched"`` or ``"stock"``."""
    return "patched" if EXTENDED else "stock"


def describe() -> str:
    """One line for people (``rewindfs doctor``): which pyfuse3, patched or not."""
    version = getattr(pyfuse3, "__version__", "?")
    if EXTENDED:
        return (f"pyfuse3 {version} with scripts/pyfuse3/kernel-cache.patch "
                "(kernel-cached listings, no xattr round trip per write)")
    return (f"stock pyfuse3 {version} (works; listings are not kernel-cached: "
            "bash scripts/setup.sh builds the patched one)")


def info() -> dict[str, Any]:
    """What ``status`` reports: ``{kind, version, features, listings_cached,
    capabilities, init_flags}``; ``capabilities`` is the connection's ``[capable, want]``
    FUSE_CAP_* bits once INIT was answered (patched binding only), else None;
    ``init_flags`` the kernel protocol's INIT flags ``[offered, added by the binding]``
    (``[0, 0]`` when the binding adds none), or None without that feature."""
    caps = getattr(pyfuse3, "connection_capabilities", None)
    flags = getattr(pyfuse3, "init_flags", None)
    return {"kind": kind(), "version": getattr(pyfuse3, "__version__", "?"),
            "features": sorted(FEATURES), "listings_cached": EXTENDED,
            "capabilities": list(caps) if caps is not None else None,
            "init_flags": list(flags()) if callable(flags) else None}


_init_lock = threading.Lock()


def init(ops: Any, mountpoint: str, options: set[str]) -> None:
    """``pyfuse3.init(ops, mountpoint, options)``, keeping what the mount writes on stderr.

    For a user without CAP_SYS_ADMIN libfuse mounts through the setuid helper
    ``fusermount3``, which says why it refused (``option allow_other only allowed if
    'user_allow_other' is set in /etc/fuse.conf``, ``user has no write access to
    mountpoint``, ``too many FUSE filesystems mounted``) only on the stderr it inherits;
    libfuse's own messages (``fuse: failed to open /dev/fuse``) go there too, while the
    exception says only ``fuse_session_mount failed``. While this runs, file descriptor 2
    is a temporary file; what was written to it is copied to the real stderr afterwards
    (the daemon's log), and on failure it ends the RuntimeError's message:
    ``fuse_session_mount failed: fusermount3: ...`` (one line, the helper's lines joined
    by ``; ``). Raises what ``pyfuse3.init`` raises otherwise."""
    with _init_lock, tempfile.TemporaryFile() as said:
        saved = os.dup(2)
        try:
            os.dup2(said.fileno(), 2)
            try:
                pyfuse3.init(ops, mountpoint, options)
                failed: Exception | None = None
            except Exception as e:
                failed = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        said.seek(0)
        text = said.read()
    if text:
        try:
            view = memoryview(text)
            while view:
                view = view[os.write(2, view):]
        except OSError:
            pass  # the log is gone or full: the error below still carries the lines
    if failed is None:
        return
    lines = [ln.strip() for ln in text.decode(errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise failed
    raise RuntimeError(f"{failed}: {'; '.join(lines)}") from failed
