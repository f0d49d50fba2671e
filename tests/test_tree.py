"""Canonical tree encoding: round trip, and rejection of malformed or non-canonical bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.errors import ArchiveEntryError, IntegrityError
from store.ref import ObjectId
from store.tree import EMPTY_TREE, MAGIC, Entry, Kind, decode_tree, encode_tree

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
        chunks = tuple(draw(st.lists(digests, max_size=4)))
        return Entry(**common, size=draw(st.integers(0, 2**40)), chunks=chunks)  # type: ignore[arg-type]
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
    (b"RWT2\x00", "bad magic"),
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
