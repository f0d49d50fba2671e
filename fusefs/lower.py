"""The lower layer: one immutable snapshot (a Ref) read through the store.

Owns reads of trees and chunks for the overlay, a small cache of decompressed chunks and
frames, the per-tree count of subdirectories (for a directory's ``st_nlink``) and the index
of hard-link groups (for a linked file's ``st_nlink``). It never writes to the store.

File content is split in fixed chunks of ``chunk_size`` bytes: chunk ``i`` of a file holds
bytes ``[i * chunk_size, (i + 1) * chunk_size)``, the last one is shorter (CONTRACT 0). A
chunk stored in frames or raw blocks (store/pack.py) can be read a unit at a time: ``read``
of a few KiB then decompresses and verifies one 64 KiB frame or reads one 4 KiB block, not
the whole chunk; a whole chunk (big reads, sequential readers, copy-up) is still read and
verified whole by ``chunk``.

Thread use: ``load_chunks`` may run in a worker thread (the store is thread safe and the
chunk cache has a lock); everything else runs on the caller's thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from store.errors import ObjectNotFoundError, StoreError
from store.objects import Store
from store.pack import Codec, Location, unit_size
from store.ref import ObjectId, Ref
from store.tree import Kind, Tree

# Chunks up to this plaintext size are read on the request thread; bigger ones are worth a
# worker thread, since decompressing them would stall every other request. A read of at
# most this many bytes of a bigger chunk stored in frames or blocks reads only those.
SMALL_CHUNK = 256 << 10
LOCATE_AHEAD = 256  # chunks of a file located in one catalog query


class Lower:
    """Read access to the snapshot ``ref`` in ``store``.

    ``cache_bytes`` bounds the decompressed-chunk cache (bytes).
    """

    def __init__(self, store: Store, ref: Ref, *, cache_bytes: int = 128 << 20) -> None:
        self.store = store
        self.ref = ref
        self.chunk_size = store.chunk_size
        # whole chunks by id, frames by (id, unit size, index) (blocks are not kept: read)
        self._cache: OrderedDict[bytes | tuple[bytes, int, int], bytes] = OrderedDict()
        self._cache_size = 0
        self._cache_max = cache_bytes
        self._lock = threading.Lock()
        self._subdirs: dict[bytes, int] = {}
        self._groups: dict[bytes, int] | None = None
        # Where chunks are stored (read_object re-locates one that GC moved meanwhile).
        self._locs: dict[bytes, Location] = {}
        self._pages: dict[bytes, int | None] = {}  # chunk id -> data pages (None: unknown)
        # On a shared store, where every object of the snapshot lies is copied to this host
        # now, so that reading it needs no catalog (one that became unreachable). A walk
        # that fails leaves each read to look its objects up and raise its own error.
        try:
            store.locate_tree(ref.tree_id)
        except StoreError:
            pass

    @property
    def root_tree(self) -> ObjectId:
        return self.ref.tree_id

    def tree(self, tree_id: ObjectId) -> Tree:
        """The decoded tree (verified; raises the store's IntegrityError if corrupt)."""
        return self.store.get_tree(tree_id)

    def subdirs(self, tree_id: ObjectId) -> int:
        """Number of directory entries in the tree ``tree_id``."""
        n = self._subdirs.get(tree_id)
        if n is None:
            n = sum(1 for e in self.tree(tree_id).entries if e.kind is Kind.DIR)
            self._subdirs[tree_id] = n
        return n

    def link_count(self, group: bytes) -> int:
        """Number of names of the hard-link group ``group`` in the whole snapshot.

        The first call walks every tree of the snapshot once (only snapshots holding hard
        links ever ask)."""
        if self._groups is None:
            # Equal subtrees are walked once per place: each place holds its own names.
            groups: dict[bytes, int] = {}
            todo = [self.root_tree]
            while todo:
                tid = todo.pop()
                for e in self.tree(tid).entries:
                    if e.kind is Kind.DIR and e.tree_id is not None:
                        todo.append(e.tree_id)
                    elif e.link_group is not None:
                        groups[e.link_group] = groups.get(e.link_group, 0) + 1
            self._groups = groups
        return max(1, self._groups.get(group, 1))

    def data_pages(self, cids: Iterable[bytes]) -> dict[bytes, int]:
        """Data pages (``store.chunker.data_pages``) of each chunk of ``cids`` whose count
        this host recorded (cached here; one query for the ids not cached yet). Ids
        without a record are left out: the caller counts all their pages."""
        ids = set(cids)
        want = [c for c in ids if c not in self._pages]
        if want:
            found = self.store.chunk_pages(want)
            if len(self._pages) + len(want) > 1 << 16:
                self._pages.clear()
            for c in want:
                self._pages[c] = found.get(c)
        return {c: n for c in ids if (n := self._pages.get(c)) is not None}

    # -- chunks --------------------------------------------------------------------------

    def cached(self, cid: bytes) -> bytes | None:
        with self._lock:
            data = self._cache.get(cid)
            if data is not None:
                self._cache.move_to_end(cid)
            return data

    def _put(self, key: bytes | tuple[bytes, int, int], data: bytes) -> None:
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = data
            self._cache_size += len(data)
            while self._cache_size > self._cache_max and len(self._cache) > 4:
                _, old = self._cache.popitem(last=False)
                self._cache_size -= len(old)

    def chunk(self, cid: bytes) -> bytes:
        """The plaintext of chunk ``cid`` (verified), through the cache."""
        data = self.cached(cid)
        if data is None:
            data = self.store.read_object(ObjectId(cid), self._locs.get(cid))
            self._put(cid, data)
        return data

    def located(self, cid: bytes) -> bool:
        """True if where ``cid`` is stored is known (``locate_ahead`` need not ask)."""
        return cid in self._locs

    def locate_ahead(self, cids: Sequence[bytes]) -> None:
        """Look up where the chunks ``cids`` (a file's, from the one read next) are stored,
        in one catalog query, unless the first is known already: a sequential reader then
        asks the catalog once per LOCATE_AHEAD chunks instead of once per chunk (a round
        trip each on a shared catalog)."""
        if not cids or cids[0] in self._locs:
            return
        found = self.store.locate_many(ObjectId(bytes(c)) for c in cids)
        if len(self._locs) + len(found) > 1 << 16:
            self._locs.clear()
        self._locs.update(found)

    def read(self, cid: bytes, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of chunk ``cid`` (verified): from the cached chunk, else, for
        at most SMALL_CHUNK bytes of a chunk stored in frames or blocks, from those (each
        verified; frames are cached, blocks are not: see below), else from the whole
        chunk. Raises the store's IntegrityError and ObjectNotFoundError.

        A block is a page (4 KiB): the kernel asks for page-aligned ranges and keeps
        what a read returns in its page cache, so a block is not asked for twice while
        that copy lives, and keeping it here too cost every cold random read an
        allocation that stayed (and pushed frames and whole chunks out of the cache)."""
        data = self.cached(cid)
        if data is not None:
            return data[lo:hi]
        loc = self._locs.get(cid) or self._loc(cid)
        unit = None if loc is None else unit_size(loc.codec)
        if loc is None or unit is None or hi <= lo or hi - lo > SMALL_CHUNK:
            return self.chunk(cid)[lo:hi]
        first, last = lo // unit, (hi - 1) // unit
        base = first * unit
        if loc.codec is Codec.BLOCKS:
            got = self.store.read_frames(ObjectId(cid), first, last, loc)
            if got is None:  # repacked otherwise meanwhile
                self._locs.pop(cid, None)
                return self.chunk(cid)[lo:hi]
            one = got[0] if len(got) == 1 else b"".join(got)
            return one[lo - base:hi - base]
        frames: list[bytes | None] = []
        with self._lock:
            for i in range(first, last + 1):
                f = self._cache.get((cid, unit, i))
                if f is not None:
                    self._cache.move_to_end((cid, unit, i))
                frames.append(f)
        if None in frames:
            missing = [first + k for k, f in enumerate(frames) if f is None]
            got = self.store.read_frames(ObjectId(cid), missing[0], missing[-1], loc)
            if got is None:  # repacked otherwise meanwhile
                self._locs.pop(cid, None)
                return self.chunk(cid)[lo:hi]
            for k, f in enumerate(got):
                i = missing[0] + k
                self._put((cid, unit, i), f)
                frames[i - first] = f
        out = frames[0] if len(frames) == 1 else b"".join(f for f in frames if f is not None)
        assert out is not None
        return out[lo - base:hi - base]

    def _loc(self, cid: bytes) -> Location | None:
        loc = self._locs.get(cid)
        if loc is None:
            try:
                loc = self.store.locate(ObjectId(cid))
            except ObjectNotFoundError:
                return None  # let the read raise its own error
            if len(self._locs) > 1 << 16:
                self._locs.clear()
            self._locs[cid] = loc
        return loc

    def is_small(self, cid: bytes, whole: bool = True) -> bool:
        """True if reading ``cid`` is cheap enough for the request thread: whole, or (with
        ``whole`` false) a few of its frames or blocks."""
        loc = self._loc(cid)
        if loc is None:
            return True  # let the read raise its own error on the request thread
        return loc.raw_length <= SMALL_CHUNK or (not whole and unit_size(loc.codec) is not None)

    def load_chunks(self, cids: Iterable[bytes]) -> None:
        """Read chunks into the cache; safe to call from a worker thread."""
        for cid in cids:
            self.chunk(cid)
