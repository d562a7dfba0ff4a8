"""The framing of one stored block (docs/tiers.md, "Entries" and "Who must be trusted").

    magic  b"PKV2"                      4 bytes   the format's version (PKV1 entries: misses)
    namespace id                        16 bytes  blake2b-128 of the namespace's encoding
    group                               1 byte
    codec                               1 byte    0 raw, 1 lz4, 2 byte-shuffle + lz4
    item size                           2 bytes   the shuffle's element size (LE)
    digest length                       1 byte
    digest (zero padded)                32 bytes
    raw length, payload length          2 x 8 bytes (LE)
    mac                                 16 bytes  HMAC-SHA256(secret, all above + payload),
                                                  its first 128 bits
    payload

The namespace's encoding is ``b"pagedkv-ns-2"`` then each field (model, layout, dtype, block
size in decimal, tenant) as its UTF-8 length (4 bytes LE) and its UTF-8 bytes: no two
namespaces share an encoding, whatever characters their fields hold.

The MAC is keyed by the tier's *secret* (16 bytes or more, never stored in an entry or
sent to a server): without the secret nobody can make an entry that passes, and because the
MAC covers the whole header an entry moved under another namespace, group or digest, or
with other lengths, fails too. A decoded entry must match the namespace, group and digest
asked for, its lengths and its MAC; anything else is an `EntryError`, which every store
turns into a miss: a damaged, truncated, forged or foreign entry, an entry made with
another secret, or a digest collision of keys, is never a wrong hit.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

MAGIC = b"PKV2"
_HEAD = struct.Struct("<4s16sBBHB32sQQ")
_MAC = 16
HEADER_BYTES = _HEAD.size + _MAC
#: The shortest secret accepted: 128 bits.
MIN_SECRET_BYTES = 16
_NS_TAG = b"pagedkv-ns-2"
_U32 = struct.Struct("<I")


class EntryError(ValueError):
    """An entry that must not be served: wrong namespace or key, damaged, truncated, or
    not made with this tier's secret."""


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

    def __post_init__(self) -> None:
        for name in ("model", "layout", "dtype", "tenant"):
            value: object = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Namespace.{name} must be a str, got {value!r}")
        size: object = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"Namespace.block_size must be a positive int, got {size!r}")

    def encoding(self) -> bytes:
        """The namespace's fields, each length-prefixed (module docstring): unambiguous."""
        fields = (self.model, self.layout, self.dtype, str(self.block_size), self.tenant)
        parts = [_NS_TAG]
        for field in fields:
            raw = field.encode()
            parts += (_U32.pack(len(raw)), raw)
        return b"".join(parts)

    def ident(self) -> bytes:
        """16 bytes naming the namespace inside every entry and remote key."""
        return hashlib.blake2b(self.encoding(), digest_size=16).digest()


def check_secret(secret: object) -> bytes:
    """`secret` as bytes, checked: bytes (or bytearray) of at least 16 bytes."""
    if not isinstance(secret, bytes | bytearray):
        raise TypeError(f"the tier secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the tier secret must be at least {MIN_SECRET_BYTES} bytes (128 bits), "
            f"got {len(secret)}"
        )
    return bytes(secret)


#: The secret of in-process stores built without one: random, never leaves the process.
_PROCESS_SECRET = secrets.token_bytes(32)


def process_secret() -> bytes:
    """This process's random secret, the default of the host tiers (an entry never leaves
    the process that made it, so nothing else needs the secret)."""
    return _PROCESS_SECRET


_KEY_TAG = b"pagedkv-remote-key-1"


def key_ident(namespace: Namespace, secret: bytes) -> bytes:
    """16 bytes naming the namespace in a shared store's keys, keyed by the secret:
    HMAC-SHA256(secret, tag + the namespace's encoding), its first 128 bits. Two trust
    domains (two secrets) thus use disjoint keys on one server, so a presence check (EXISTS)
    finds only entries made with this secret, as a get (whose MAC check needs the whole
    value) accepts only those; without the secret nobody can tell which namespace a key
    belongs to, or name a key of it beforehand."""
    h = hmac.new(check_secret(secret), _KEY_TAG, "sha256")
    h.update(namespace.encoding())
    return h.digest()[:16]


def _mac(secret: bytes, head: bytes, payload: bytes | memoryview) -> bytes:
    # OpenSSL's HMAC releases the GIL on large updates and uses the CPU's SHA extensions:
    # 2.4 to 3 times blake2b's rate on the machine this was measured on (docs/tiers.md).
    h = hmac.new(secret, head, "sha256")
    h.update(payload)
    return h.digest()[:_MAC]


def encode_entry(
    ns_id: bytes,
    group: int,
    digest: bytes,
    codec: int,
    item_size: int,
    raw_len: int,
    payload: bytes | memoryview,
    *,
    secret: bytes,
) -> bytes:
    """Frame `payload` (the block after the codec) for storage, MACed with `secret`."""
    secret = check_secret(secret)
    if len(digest) > 32:
        raise ValueError("digests are at most 32 bytes")
    head = _HEAD.pack(
        MAGIC, ns_id, group, codec, item_size, len(digest), digest, raw_len, len(payload)
    )
    return b"".join((head, _mac(secret, head, payload), payload))


@dataclass(frozen=True, slots=True)
class Entry:
    codec: int
    item_size: int
    raw_len: int
    payload: memoryview


def decode_entry(
    blob: bytes | memoryview, ns_id: bytes, group: int, digest: bytes, *, secret: bytes
) -> Entry:
    """Check a stored entry against the key it was asked for and its MAC under `secret`;
    raise `EntryError` if it is not exactly that block, whole, made with that secret."""
    secret = check_secret(secret)
    view = memoryview(blob)
    if len(view) < HEADER_BYTES:
        raise EntryError("entry shorter than its header")
    magic, ns, g, codec, item, dlen, dig, raw_len, plen = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise EntryError("not a pagedkv entry of this format version")
    if ns != ns_id:
        raise EntryError("entry from another namespace")
    if g != group or dlen != len(digest) or dig[:dlen] != digest:
        raise EntryError("entry of another block")
    payload = view[HEADER_BYTES:]
    if len(payload) != plen:
        raise EntryError(f"payload of {len(payload)} bytes, header says {plen}")
    mac = _mac(secret, bytes(view[: _HEAD.size]), payload)
    if not hmac.compare_digest(mac, bytes(view[_HEAD.size : HEADER_BYTES])):
        raise EntryError("MAC mismatch: damaged, forged, or made with another secret")
    return Entry(codec, item, raw_len, payload)


__all__ = [
    "HEADER_BYTES",
    "MIN_SECRET_BYTES",
    "Entry",
    "EntryError",
    "Namespace",
    "check_secret",
    "decode_entry",
    "encode_entry",
    "key_ident",
    "process_secret",
]
