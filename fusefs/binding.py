"""Which pyfuse3 serves the mounts: the build patched by ``scripts/setup.sh`` (see
``scripts/pyfuse3/README.md``), or a stock one, detected at run time.

The patch adds ``pyfuse3.extensions``, a frozenset of feature names; a stock pyfuse3 has no
such attribute. ``EXTENDED`` is true when every feature the FUSE adapter relies on for
kernel caching is there: ``opendir`` answering a ``FileInfo`` with ``cache_readdir``,
``absent_xattr_prefixes``, the inode in handle requests and INIT capabilities.
"""

from __future__ import annotations

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
    capabilities}``; ``capabilities`` is the connection's ``[capable, want]`` FUSE_CAP_*
    bits once INIT was answered (patched binding only), else None."""
    caps = getattr(pyfuse3, "connection_capabilities", None)
    return {"kind": kind(), "version": getattr(pyfuse3, "__version__", "?"),
            "features": sorted(FEATURES), "listings_cached": EXTENDED,
            "capabilities": list(caps) if caps is not None else None}
