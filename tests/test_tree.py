"""Canonical tree encoding: round trip, and rejection of malformed or non-canonical bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import chunker
from store.errors import ArchiveEntryError, IntegrityError
from store.ref import ObjectId, object_id
from store.tree import (
    EMPTY_TREE,
    MAGIC,
    V1_REPEATS_MAX,
    ChunkList,
    Entry,
    Kind,
    decode_runs,
    decode_tree,
    encode_runs,
    encode_tree,
    tree_version,
)

names = st.binary(min_size=1, max_size=255).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))
digests = st.binary(min_size=32, max_size=32).map(ObjectId)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
xattrs = st.dictionaries(st.binary(min_size=1, max_size=20).map(lambda b: b"user." + b),
                         st.binary(max_size=40), max_size=3).map(
    lambda d: tuple(sorted(d.items())))


@st.composite
def entries(draw: st.DrawFn, name: bytes) -> Entry:
    kind = draw(st.sampled_from(list(Kind)))
    common = dict(name=name, kind=kind, mode=draw(st.integers(0, 0o7777)), uid=draw(u32),
                  gid=draw(u32), mtime_ns=draw(st.integers(-2**62, 2**62)),
                  xattrs=draw(xattrs), link_group=draw(st.none() | st.binary(min_size=32,
                                                                              max_size=32)))
    if kind is Kind.DIR:
        return Entry(**common, tree_id=draw(digests))  # type: ignore[arg-type]
    if kind is Kind.FILE:
        # Runs of ids, some repeated past the version 1 bound (a sparse file's holes).
        runs = draw(st.lists(st.tuples(digests, st.sampled_from(
            [1, 1, 2, 3, V1_REPEATS_MAX, V1_REPEATS_MAX + 1, 1 << 24])), max_size=4))
        chunks = ChunkList.from_runs(runs)
        return Entry(**common, size=draw(st.integers(0, 2**40)), chunks=chunks)  # type: ignore[arg-type]
    if kind.is_device:
        return Entry(**common, rdev=draw(u32))  # type: ignore[arg-type]
    if kind is Kind.SYMLINK:
        target = draw(st.binary(max_size=300))
        return Entry(**common, size=len(target), target=target)  # type: ignore[arg-type]
    return Entry(**common)  # type: ignore[arg-type]


@st.composite
def trees(draw: st.DrawFn) -> list[Entry]:
    ns = draw(st.sets(names, max_size=8))
    return [draw(entries(n)) for n in ns]


@given(trees())
@settings(max_examples=100, deadline=None)
def test_roundtrip(es: list[Entry]) -> None:
    enc = encode_tree(es)
    t = decode_tree(enc)
    assert list(t.entries) == sorted(es, key=lambda e: e.name)
    assert encode_tree(t.entries) == enc
    for e in es:
        assert t.get(e.name) == e
    # the decoder builds its entries without Entry's __init__: they are the same values
    assert hash(t.entries) == hash(tuple(sorted(es, key=lambda e: e.name)))
    for e in t.entries:
        assert type(e) is Entry and type(e.chunks) is ChunkList
        with pytest.raises(AttributeError):
            e.name = b"other"  # type: ignore[misc]


@given(trees())
@settings(deadline=None)
def test_order_of_input_does_not_matter(es: list[Entry]) -> None:
    assert encode_tree(es) == encode_tree(list(reversed(es)))


@given(trees(), st.data())
@settings(max_examples=150, deadline=None)
def test_mutations_never_decode_to_other_canonical_bytes(es: list[Entry],
                                                         data: st.DataObject) -> None:
    """Any byte string the decoder accepts re-encodes to itself (no second encoding)."""
    enc = bytearray(encode_tree(es))
    i = data.draw(st.integers(0, len(enc) - 1))
    op = data.draw(st.sampled_from(["flip", "drop", "insert", "truncate"]))
    if op == "flip":
        enc[i] ^= data.draw(st.integers(1, 255))
    elif op == "drop":
        del enc[i]
    elif op == "insert":
        enc.insert(i, data.draw(st.integers(0, 255)))
    else:
        del enc[i:]
    try:
        t = decode_tree(bytes(enc))
    except (IntegrityError, ArchiveEntryError):
        return
    assert encode_tree(t.entries) == bytes(enc)


def _file(name: bytes) -> Entry:
    return Entry(name, Kind.FILE, 0o644, 0, 0, 0)


def test_empty_tree() -> None:
    assert EMPTY_TREE == MAGIC + b"\x00"
    assert len(decode_tree(EMPTY_TREE)) == 0


@pytest.mark.parametrize("data, why", [
    (b"", "truncated"),
    (b"RWT3\x00", "bad magic"),
    (b"RWT2\x00", "version 1 holds"),
    (MAGIC, "truncated varint"),
    (MAGIC + b"\x00\x00", "trailing bytes"),
    (MAGIC + b"\x80\x00", "non-canonical varint"),
    (MAGIC + b"\x7f", "entry count larger"),
    (MAGIC + b"\x01\x01a\x09\x00\x00\x00\x00\x00\x00\x00", "unknown kind"),
    (MAGIC + b"\x01\x01a\x02\xff\x7f\x00\x00\x00\x00\x00\x00\x00", "mode has bits"),
    (MAGIC + b"\x01\x01a\x04\x00\x00\x00\x00\x01\x00\x00", "special file with a size"),
    (MAGIC + b"\x01\x01a\x03\x00\x00\x00\x00\x02\x01x\x00\x00", "symlink size differs"),
    (MAGIC + b"\x01\x01a\x04\x00\x00\x00\x00\x00\x00\x02", "bad link flag"),
])
def test_malformed_rejected(data: bytes, why: str) -> None:
    with pytest.raises(IntegrityError) as ei:
        decode_tree(data, "t1")
    assert why in ei.value.got
    assert ei.value.ref == "t1"


def test_unsorted_and_duplicate_names_rejected() -> None:
    a, b = encode_tree([_file(b"a")]), encode_tree([_file(b"b")])
    body_a, body_b = a[len(MAGIC) + 1:], b[len(MAGIC) + 1:]
    with pytest.raises(IntegrityError, match="strictly increasing"):
        decode_tree(MAGIC + b"\x02" + body_b + body_a)
    with pytest.raises(IntegrityError, match="strictly increasing"):
        decode_tree(MAGIC + b"\x02" + body_a + body_a)
    with pytest.raises(ArchiveEntryError, match="duplicate"):
        encode_tree([_file(b"a"), _file(b"a")])


def test_unsorted_xattrs_rejected() -> None:
    e = Entry(b"f", Kind.FIFO, 0, 0, 0, 0, xattrs=((b"user.a", b"1"), (b"user.b", b"2")))
    enc = encode_tree([e])
    swapped = enc.replace(b"\x06user.a\x011\x06user.b\x012", b"\x06user.b\x012\x06user.a\x011")
    assert swapped != enc
    with pytest.raises(IntegrityError, match="xattrs not strictly increasing"):
        decode_tree(swapped)


@pytest.mark.parametrize("name, reason", [
    (b"..", "name is '..'"), (b".", "name is '.'"), (b"a/b", "'/'"), (b"a\0b", "NUL"),
    (b"x" * 256, "over 255"),
])
def test_hostile_names_rejected(name: bytes, reason: str) -> None:
    ok = encode_tree([_file(b"n")])
    assert ok.startswith(MAGIC + b"\x01\x01n")
    n = len(name)
    varint = bytes([n]) if n < 128 else bytes([n & 0x7F | 0x80, n >> 7])
    bad = MAGIC + b"\x01" + varint + name + ok[len(MAGIC) + 3:]
    with pytest.raises(ArchiveEntryError) as ei:
        decode_tree(bad)
    assert reason in ei.value.reason
    with pytest.raises(ArchiveEntryError):
        encode_tree([_file(name)])


def test_name_of_255_bytes_and_non_utf8_accepted() -> None:
    es = [_file(b"x" * 255), _file(b"\xff\xfe"), _file(b"\n")]
    assert decode_tree(encode_tree(es)).entries == tuple(sorted(es, key=lambda e: e.name))


def test_metadata_changes_the_encoding() -> None:
    base = Entry(b"f", Kind.FILE, 0o644, 1, 2, 3, 0)
    variants = [
        Entry(b"f", Kind.FILE, 0o600, 1, 2, 3, 0),
        Entry(b"f", Kind.FILE, 0o644, 9, 2, 3, 0),
        Entry(b"f", Kind.FILE, 0o644, 1, 9, 3, 0),
        Entry(b"f", Kind.FILE, 0o644, 1, 2, 4, 0),
        Entry(b"f", Kind.FILE, 0o644, 1, 2, 3, 0, xattrs=((b"user.k", b"v"),)),
        Entry(b"f", Kind.FILE, 0o644, 1, 2, 3, 0, link_group=b"g" * 32),
        Entry(b"f", Kind.FIFO, 0o644, 1, 2, 3, 0),
    ]
    encs = {encode_tree([v]) for v in variants} | {encode_tree([base])}
    assert len(encs) == len(variants) + 1


# -- versions: old trees keep their encoding and their ids -----------------------------------

MIB = 1 << 20
# Ids computed with the encoder as it was before tree version 2 existed (commit 6c0f72e).
OLD_SMALL_TREE_ID = "63e95dff763a6f148244b82930d8038e5a3859179e8d288909a8e7ddb3922715"
OLD_SUBTREE_ID = "b9dd481f4ba9111eb75402c41d24dbce6862f6967dc77613e6d3a3eec57f4341"
OLD_BIG_TREE_ID = "70ad6d24aac644f875eef181da4a2069d07f9c6fd9a88fcf75f1fc78a48bacda"


def _old_small_tree() -> list[Entry]:
    z = chunker.zero_chunk_id(MIB)
    a = object_id(b"a" * MIB)
    b = object_id(b"tail")
    sub = encode_tree([Entry(b"inner.txt", Kind.FILE, 0o644, 1000, 1000,
                             1_700_000_000_123_456_789, 5, (object_id(b"hello"),))])
    assert object_id(sub).hex() == OLD_SUBTREE_ID
    return [
        Entry(b"dir", Kind.DIR, 0o755, 1000, 1000, 1_700_000_000_000_000_000,
              tree_id=object_id(sub)),
        Entry(b"sparse.img", Kind.FILE, 0o600, 0, 0, -5, 6 * MIB + 4,
              (a, z, z, z, z, a, b), xattrs=((b"user.k", b"v"),)),
        Entry(b"link", Kind.SYMLINK, 0o777, 1, 2, 3, 9, target=b"dir/inner"),
        Entry(b"fifo", Kind.FIFO, 0o644, 0, 0, 0),
        Entry(b"empty", Kind.FILE, 0o444, 0, 0, 0, 0, ()),
    ]


def _old_big_entry() -> Entry:
    """A file of 70,000 hole chunks and one data chunk: over the version 1 bound."""
    z = chunker.zero_chunk_id(MIB)
    d = object_id(b"d" * 4096)
    return Entry(b"big.img", Kind.FILE, 0o644, 0, 0, 0, 70_000 * MIB + 4096,
                 ChunkList.from_runs([(z, 70_000), (d, 1)]))


def test_a_tree_version_1_holds_keeps_its_old_id() -> None:
    enc = encode_tree(_old_small_tree())
    assert enc[:4] == b"RWT1"
    assert object_id(enc).hex() == OLD_SMALL_TREE_ID
    t = decode_tree(enc)
    assert t.version == 1 and list(t.entries) == sorted(_old_small_tree(), key=lambda e: e.name)
    e = t.get(b"sparse.img")
    assert e is not None and e.chunks.run_count == 4 and len(e.chunks) == 7


def test_an_old_version_1_tree_over_the_bound_still_reads_and_reencodes() -> None:
    big = [_old_big_entry()]
    old = encode_tree(big, version=1)  # the bytes the old encoder wrote
    assert object_id(old).hex() == OLD_BIG_TREE_ID and len(old) > 70_000 * 32
    t = decode_tree(old)
    assert t.version == 1 and t.entries == tuple(big)
    assert encode_tree(t.entries, t.version) == old  # verify re-encodes it in its version
    new = encode_tree(big)  # the same entries are now written in version 2, small
    assert new[:4] == b"RWT2" and len(new) < 200
    t2 = decode_tree(new)
    assert t2.version == 2 and t2.entries == t.entries
    assert tree_version(big) == 2


def test_version_is_chosen_by_the_repeats_bound() -> None:
    z = chunker.zero_chunk_id(MIB)

    def f(n: int) -> Entry:
        return Entry(b"f", Kind.FILE, 0o644, 0, 0, 0, n * MIB, ChunkList.from_runs([(z, n)]))

    assert encode_tree([f(V1_REPEATS_MAX + 1)])[:4] == b"RWT1"  # repeats == the bound
    assert encode_tree([f(V1_REPEATS_MAX + 2)])[:4] == b"RWT2"


def test_version_2_rejects_non_canonical_runs() -> None:
    good = encode_tree([_old_big_entry()])
    e = _old_big_entry()
    z = chunker.zero_chunk_id(MIB)
    head = good[:good.index(z) - 4]  # up to the run count of the file (1 + 3 bytes)
    tail = good[good.index(z) + 32 + 1 + 32:]  # after both runs

    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append(n & 0x7F | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)

    def runs(*rs: tuple[int, bytes]) -> bytes:
        return varint(len(rs)) + b"".join(varint(k) + cid for k, cid in rs)

    d = e.chunks[len(e.chunks) - 1]
    assert head + runs((70_000, z), (1, d)) + tail == good
    with pytest.raises(IntegrityError) as ei:
        decode_tree(head + runs((35_000, z), (35_000, z), (1, d)) + tail)
    assert "adjacent runs" in ei.value.got
    with pytest.raises(IntegrityError) as ei:
        decode_tree(head + runs((70_000, z), (0, d)) + tail)
    assert "empty run" in ei.value.got


def test_chunk_list_is_a_sequence_of_slots() -> None:
    a, b = object_id(b"a"), object_id(b"b")
    cl = ChunkList([a, a, b, b, b, a])
    assert len(cl) == 6 and cl.run_count == 3 and cl.repeats == 3
    assert [cl[i] for i in range(6)] == [a, a, b, b, b, a] == list(cl)
    assert cl[-1] == a and cl[:3] == ChunkList([a, a, b]) and cl[2:] == (b, b, b, a)
    assert list(cl.between(1, 4)) == [(a, 1), (b, 2)]
    assert cl.distinct() == {a, b}
    # the bytes a file's content digest (so its derived inode number) is made of
    assert cl.slot_bytes() == a + a + b + b + b + a
    assert ChunkList([a, b]).slot_bytes() == a + b and ChunkList().slot_bytes() == b""
    assert decode_runs(encode_runs(cl)) == cl and encode_runs(ChunkList()) == b""
    huge = ChunkList.from_runs([(a, 1), (b, 1 << 40), (a, 1)])
    assert len(huge) == (1 << 40) + 2 and huge[1 << 39] == b and huge[-1] == a
    with pytest.raises(IndexError):
        cl[6]
