"""Ref parsing: one parser, and every malformed text gives InvalidRefError with its reason."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.errors import InvalidRefError
from store.ref import Ref, object_id

HEX = "0123456789abcdef" * 4


def test_parse_valid_roundtrip() -> None:
    r = Ref.parse("v1:blake3:" + HEX)
    assert r.tree_id == bytes.fromhex(HEX)
    assert str(r) == "v1:blake3:" + HEX
    assert Ref.parse(str(r)) == r
    assert Ref.parse(r) is r
    assert hash(Ref.parse(str(r))) == hash(r)


def test_ref_of_object_id() -> None:
    oid = object_id(b"tree bytes")
    assert Ref.parse(str(Ref(oid))).tree_id == oid


@given(st.binary(min_size=32, max_size=32))
@settings(deadline=None)
def test_parse_roundtrip_any_digest(digest: bytes) -> None:
    from store.ref import ObjectId

    r = Ref(ObjectId(digest))
    assert Ref.parse(str(r)) == r


@pytest.mark.parametrize("value, reason", [
    (None, "a Ref is a str"),
    (b"v1:blake3:" + HEX.encode(), "a Ref is a str"),
    (42, "a Ref is a str"),
    ("", "unknown version"),
    ("v2:blake3:" + HEX, "unknown version"),
    ("V1:blake3:" + HEX, "unknown version"),
    (" v1:blake3:" + HEX, "unknown version"),
    ("v1:sha256:" + HEX, "unknown algorithm"),
    ("v1:BLAKE3:" + HEX, "unknown algorithm"),
    ("v1:blake3:" + HEX[:-1], "digest has 63 characters, want 64"),
    ("v1:blake3:" + HEX + "0", "digest has 65 characters, want 64"),
    ("v1:blake3:" + HEX + "\n", "digest has 65 characters, want 64"),
    ("v1:blake3:", "digest has 0 characters, want 64"),
    ("v1:blake3:" + HEX.upper(), "digest is not lowercase hex"),
    ("v1:blake3:" + "g" + HEX[1:], "digest is not lowercase hex"),
    ("v1:blake3:" + " " + HEX[1:], "digest is not lowercase hex"),
])
def test_parse_invalid(value: object, reason: str) -> None:
    with pytest.raises(InvalidRefError) as ei:
        Ref.parse(value)
    assert ei.value.value == value
    assert ei.value.reason.startswith(reason)
    assert ei.value.exit_code == 3


@pytest.mark.parametrize("digest", [b"", b"x" * 31, b"x" * 33, "a" * 32])
def test_constructor_rejects_wrong_digest(digest: object) -> None:
    with pytest.raises(InvalidRefError):
        Ref(digest)  # type: ignore[arg-type]


@given(st.text(max_size=80))
@settings(deadline=None)
def test_parse_never_raises_other_errors(text: str) -> None:
    try:
        r = Ref.parse(text)
    except InvalidRefError:
        return
    assert str(r) == text
