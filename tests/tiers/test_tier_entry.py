"""The entry format (tiers/entry.py, docs/tiers.md "Keys and entries" and "Who must be
trusted"): the MAC is keyed by the tier's secret and covers the whole header, so a forged
entry (one made without the secret, with a valid unkeyed checksum), an entry made with
another secret, an entry of the previous format, and any tampered byte are `EntryError`s;
the namespace's encoding is unambiguous.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.tiers.entry import (
    HEADER_BYTES,
    EntryError,
    Namespace,
    check_secret,
    decode_entry,
    encode_entry,
    process_secret,
)

SECRET = b"entry-test-secret-0123456789abcdef"
OTHER_SECRET = b"another-domain-secret-0123456789ab"
NS = Namespace("test-model", "L2xH2xD16", "float16", 16, "tenant")
DIGEST = hashlib.sha256(b"block 1").digest()
PAYLOAD = bytes(range(48))
HEAD = struct.Struct("<4s16sBBHB32sQQ")  # the header before the MAC, as documented


def entry(payload: bytes = PAYLOAD, secret: bytes = SECRET, group: int = 0) -> bytes:
    return encode_entry(NS.ident(), group, DIGEST, 0, 1, len(payload), payload, secret=secret)


def forged_head(payload: bytes, magic: bytes = b"PKV2") -> bytes:
    """The header an attacker writes for NS / group 0 / DIGEST: every field is public."""
    return HEAD.pack(magic, NS.ident(), 0, 0, 1, 32, DIGEST, len(payload), len(payload))


def test_round_trip_and_layout() -> None:
    blob = entry()
    e = decode_entry(blob, NS.ident(), 0, DIGEST, secret=SECRET)
    assert (e.codec, e.item_size, e.raw_len, bytes(e.payload)) == (0, 1, 48, PAYLOAD)
    assert HEADER_BYTES == HEAD.size + 16 == 89
    assert blob[:4] == b"PKV2" and blob[HEADER_BYTES:] == PAYLOAD
    # The MAC is HMAC-SHA256 under the secret over header and payload, first 16 bytes.
    mac = hmac.new(SECRET, blob[: HEAD.size] + PAYLOAD, "sha256").digest()[:16]
    assert blob[HEAD.size : HEADER_BYTES] == mac
    assert SECRET not in blob


def test_another_secret_is_an_error() -> None:
    with pytest.raises(EntryError, match="MAC"):
        decode_entry(entry(secret=OTHER_SECRET), NS.ident(), 0, DIGEST, secret=SECRET)
    with pytest.raises(EntryError, match="MAC"):
        decode_entry(entry(), NS.ident(), 0, DIGEST, secret=OTHER_SECRET)


@pytest.mark.parametrize(
    "mac",
    [
        pytest.param(lambda m: hashlib.blake2b(m, digest_size=16).digest(), id="blake2b-128"),
        pytest.param(lambda m: hashlib.sha256(m).digest()[:16], id="sha256"),
        pytest.param(lambda m: hashlib.blake2b(m, digest_size=8).digest() * 2, id="blake2b-64"),
        pytest.param(lambda m: bytes(16), id="zeros"),
    ],
)
def test_forged_entries_are_errors(mac: Callable[[bytes], bytes]) -> None:
    """Whatever unkeyed checksum a writer without the secret computes, the entry fails."""
    head = forged_head(PAYLOAD)
    forged = head + mac(head + PAYLOAD) + PAYLOAD
    with pytest.raises(EntryError, match="MAC"):
        decode_entry(forged, NS.ident(), 0, DIGEST, secret=SECRET)


def test_previous_format_is_an_error() -> None:
    """A PKV1 entry with its valid blake2b-64 checksum (the old namespace id and format):
    rejected by its version, whatever it says."""
    old_ns = hashlib.blake2b(b"test-model|L2xH2xD16|float16|16|tenant", digest_size=16).digest()
    head = HEAD.pack(b"PKV1", old_ns, 0, 0, 1, 32, DIGEST, 48, 48)
    old = head + hashlib.blake2b(head + PAYLOAD, digest_size=8).digest() + PAYLOAD
    for ns_id in (old_ns, NS.ident()):
        with pytest.raises(EntryError, match="format version"):
            decode_entry(old, ns_id, 0, DIGEST, secret=SECRET)


def test_every_tampered_byte_is_an_error() -> None:
    """One bit flipped at any offset of the header (the MAC included) or of the payload."""
    blob = entry()
    for offset in range(len(blob)):
        for bit in (0x01, 0x80):
            bad = bytearray(blob)
            bad[offset] ^= bit
            with pytest.raises(EntryError):
                decode_entry(bytes(bad), NS.ident(), 0, DIGEST, secret=SECRET)


def test_moved_entry_is_an_error_even_if_asked_under_its_new_header() -> None:
    """An entry whose header was rewritten to name another digest, group, namespace or
    lengths, and asked for under exactly what it now says: the MAC covers the header."""
    blob = entry()
    other_digest = hashlib.sha256(b"block 2").digest()
    other_ns = Namespace("other-model", "L2xH2xD16", "float16", 16, "tenant")
    cases = [
        (blob[:4] + other_ns.ident() + blob[20:], other_ns.ident(), 0, DIGEST),
        (blob[:20] + b"\x03" + blob[21:], NS.ident(), 3, DIGEST),
        (blob[:25] + other_digest + blob[57:], NS.ident(), 0, other_digest),
        (blob[:57] + struct.pack("<Q", 47) + blob[65:], NS.ident(), 0, DIGEST),  # raw length
    ]
    for bad, ns_id, group, digest in cases:
        with pytest.raises(EntryError, match="MAC"):
            decode_entry(bad, ns_id, group, digest, secret=SECRET)


def test_secret_checks() -> None:
    assert check_secret(bytearray(16)) == bytes(16)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        check_secret(b"short")
    with pytest.raises(TypeError, match="bytes"):
        check_secret("a text secret of plenty of characters")
    with pytest.raises(TypeError, match="bytes"):
        check_secret(None)
    with pytest.raises(ValueError, match="at least 16"):
        encode_entry(NS.ident(), 0, DIGEST, 0, 1, 1, b"x", secret=b"")
    with pytest.raises(ValueError, match="at least 16"):
        decode_entry(entry(), NS.ident(), 0, DIGEST, secret=b"x" * 15)
    # The process's default secret: random (not a fixed public value), stable in a process.
    assert process_secret() == process_secret() and len(process_secret()) == 32
    assert process_secret() not in (bytes(32), b"\xff" * 32)


# ---- the namespace's encoding ----------------------------------------------------------------


def test_ambiguous_fields_get_different_ids() -> None:
    a = Namespace("a|b", "c", "float16", 16)
    b = Namespace("a", "b|c", "float16", 16)
    assert a.ident() != b.ident() and a.encoding() != b.encoding()
    # The separators of the old text encoding, and empty fields, are plain characters now.
    assert Namespace("m", "l", "d", 16, "").ident() != Namespace("m", "l", "d|16|", 16).ident()
    # An entry of one is an error in the other.
    blob = encode_entry(a.ident(), 0, DIGEST, 0, 1, 48, PAYLOAD, secret=SECRET)
    with pytest.raises(EntryError, match="namespace"):
        decode_entry(blob, b.ident(), 0, DIGEST, secret=SECRET)


def test_encoding_is_the_documented_one() -> None:
    ns = Namespace("mé", "", "bf16", 16, "t")
    assert ns.encoding() == (
        b"pagedkv-ns-2"
        + b"\x03\x00\x00\x00m\xc3\xa9"
        + b"\x00\x00\x00\x00"
        + b"\x04\x00\x00\x00bf16"
        + b"\x02\x00\x00\x0016"
        + b"\x01\x00\x00\x00t"
    )
    assert ns.ident() == hashlib.blake2b(ns.encoding(), digest_size=16).digest()


_text = st.text(alphabet=st.sampled_from("ab|\x00é:"), max_size=4)
_fields = st.tuples(_text, _text, _text, st.integers(1, 10**6), _text)


@given(_fields, _fields)
def test_encoding_is_injective(x: tuple[str, str, str, int, str], y: tuple[str, ...]) -> None:
    nx, ny = Namespace(*x), Namespace(*y)  # type: ignore[arg-type]
    assert (nx.encoding() == ny.encoding()) == (x == y)


def test_namespace_checks_its_fields() -> None:
    with pytest.raises(TypeError, match="model"):
        Namespace(b"m", "l", "d", 16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tenant"):
        Namespace("m", "l", "d", 16, None)  # type: ignore[arg-type]
    for bad in (0, -1, True, 16.0, "16"):
        with pytest.raises(ValueError, match="block_size"):
            Namespace("m", "l", "d", bad)  # type: ignore[arg-type]
