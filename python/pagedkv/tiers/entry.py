"""The framing of one stored block (docs/tiers.md, "Entries").

    magic  b"PKV1"                      4 bytes
    namespace id                        16 bytes  blake2b-128 of the namespace's text
    group                               1 byte
    codec                               1 byte    0 raw, 1 lz4, 2 byte-shuffle + lz4
    item size                           2 bytes   the shuffle's element size (LE)
    digest length                       1 byte
    digest (zero padded)                32 bytes
    raw length, payload length          2 x 8 bytes (LE)
    checksum                            8 bytes   blake2b-64 of everything above + payload
    payload

A decoded entry must match the namespace, group and digest asked for, its lengths and its
checksum; anything else is an `EntryError`, which every store turns into a miss: a damaged,
truncated or foreign entry, or a digest collision of keys, is never a wrong hit.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

MAGIC = b"PKV1"
_HEAD = struct.Struct("<4s16sBBHB32sQQ")
_SUM = 8
HEADER_BYTES = _HEAD.size + _SUM


class EntryError(ValueError):
    """An entry that must not be served: wrong namespace or key, damaged, truncated."""


@dataclass(frozen=True, slots=True)
class Namespace:
    """What must match for a stored block to be valid here: the model, the KV layout (layers
    and heads of the block's page), the dtype, the block size and the tenant's cache salt
    (digests already include the salt; the namespace also separates models that hash alike)."""

    model: str
    layout: str
    dtype: str
    block_size: int
    tenant: str = ""

    def text(self) -> str:
        return f"{self.model}|{self.layout}|{self.dtype}|{self.block_size}|{self.tenant}"

    def ident(self) -> bytes:
        """16 bytes naming the namespace inside every entry and remote key."""
        return hashlib.blake2b(self.text().encode(), digest_size=16).digest()


def _checksum(head: bytes, payload: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(head, digest_size=_SUM)
    h.update(payload)
    return h.digest()


def encode_entry(
    ns_id: bytes,
    group: int,
    digest: bytes,
    codec: int,
    item_size: int,
    raw_len: int,
    payload: bytes | memoryview,
) -> bytes:
    """Frame `payload` (the block after the codec) for storage."""
    if len(digest) > 32:
        raise ValueError("digests are at most 32 bytes")
    head = _HEAD.pack(
        MAGIC, ns_id, group, codec, item_size, len(digest), digest, raw_len, len(payload)
    )
    return b"".join((head, _checksum(head, payload), payload))


@dataclass(frozen=True, slots=True)
class Entry:
    codec: int
    item_size: int
    raw_len: int
    payload: memoryview


def decode_entry(blob: bytes | memoryview, ns_id: bytes, group: int, digest: bytes) -> Entry:
    """Check a stored entry against the key it was asked for; raise `EntryError` if it is
    not exactly that block, whole."""
    view = memoryview(blob)
    if len(view) < HEADER_BYTES:
        raise EntryError("entry shorter than its header")
    magic, ns, g, codec, item, dlen, dig, raw_len, plen = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise EntryError("not a pagedkv entry")
    if ns != ns_id:
        raise EntryError("entry from another namespace")
    if g != group or dlen != len(digest) or dig[:dlen] != digest:
        raise EntryError("entry of another block")
    payload = view[HEADER_BYTES:]
    if len(payload) != plen:
        raise EntryError(f"payload of {len(payload)} bytes, header says {plen}")
    if _checksum(bytes(view[: _HEAD.size]), payload) != bytes(view[_HEAD.size : HEADER_BYTES]):
        raise EntryError("checksum mismatch")
    return Entry(codec, item, raw_len, payload)


__all__ = ["HEADER_BYTES", "Entry", "EntryError", "Namespace", "decode_entry", "encode_entry"]
