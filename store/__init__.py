"""rewindfs store: content-addressed chunks and trees, snapshot list, journals, GC.

Knows nothing of FUSE. Typed errors live in ``store.errors``.
"""

from .errors import *  # noqa: F401,F403
from .objects import JournalEvent, SnapshotInfo, Store, Writer  # noqa: F401
from .ref import ObjectId, Ref  # noqa: F401
from .tree import Entry, Kind, Tree  # noqa: F401
