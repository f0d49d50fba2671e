"""Object ids and Refs: raw 32-byte blake3 digests inside, hex only at the edges.

A Ref names a snapshot: the text ``v1:blake3:<64 lowercase hex>``, the blake3 digest of the
root tree's canonical encoding (see ``tree.py``). ``Ref.parse`` is the only way from text to
a Ref; anything else raises ``InvalidRefError(value, reason)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NewType

import blake3

from .errors import InvalidRefError

ObjectId = NewType("ObjectId", bytes)
"""The blake3 digest (32 raw bytes) of an object's plaintext: a chunk or a tree encoding."""

DIGEST_SIZE = 32
_PREFIX = "v1:blake3:"
_HEX = re.compile(r"[0-9a-f]{64}")


def object_id(data: bytes | memoryview) -> ObjectId:
    """Return the id of ``data``: its blake3 digest, 32 bytes."""
    return ObjectId(blake3.blake3(data).digest())


@dataclass(frozen=True, slots=True)
class Ref:
    """A snapshot's identity: the id of its root tree."""

    tree_id: ObjectId

    def __post_init__(self) -> None:
        if not isinstance(self.tree_id, bytes) or len(self.tree_id) != DIGEST_SIZE:
            raise InvalidRefError(self.tree_id, "a Ref holds a 32-byte digest")

    @classmethod
    def parse(cls, value: object) -> Ref:
        """Parse ``v1:blake3:<64 lowercase hex>``.

        Raises InvalidRefError(value, reason) for anything else (wrong type, version,
        algorithm, length, upper-case or non-hex digits, surrounding white space).
        """
        if isinstance(value, Ref):
            return value
        if not isinstance(value, str):
            raise InvalidRefError(value, "a Ref is a str")
        if not value.startswith("v1:"):
            raise InvalidRefError(value, "unknown version (want 'v1:')")
        if not value.startswith(_PREFIX):
            raise InvalidRefError(value, "unknown algorithm (want 'blake3')")
        digest = value[len(_PREFIX):]
        if len(digest) != 2 * DIGEST_SIZE:
            raise InvalidRefError(value, f"digest has {len(digest)} characters, want 64")
        if not _HEX.fullmatch(digest):
            raise InvalidRefError(value, "digest is not lowercase hex")
        return cls(ObjectId(bytes.fromhex(digest)))

    def __str__(self) -> str:
        return _PREFIX + self.tree_id.hex()

    def __repr__(self) -> str:
        return f"Ref({str(self)!r})"
