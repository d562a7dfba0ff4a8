"""The host-memory tiers and the codecs (docs/tiers.md, "Host tiers" and "Codecs").

HostTier / CompressedHostTier: round trips, LRU order, byte budgets at and past their
limits, an entry larger than the budget, damaged / truncated / foreign entries (corrupted in
place, in the store's own memory) read as misses and are removed, `drain_removed`, stats,
many threads at once. Codecs: every codec round-trips random and structured data of every
length (odd ones too), compressed payloads that do not pay are stored raw, and payloads that
do not decode are `EntryError`s.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

from pagedkv.tiers import codec as C
from pagedkv.tiers.base import TierKey
from pagedkv.tiers.entry import HEADER_BYTES, EntryError, Namespace, encode_entry
from pagedkv.tiers.host import CompressedHostTier, HostTier, item_size_of

pytest.importorskip("lz4")

NS = Namespace("test-model", "L2xH2xD16", "float16", 16)
OTHER_NS = Namespace("other-model", "L2xH2xD16", "float16", 16)
SECRET = b"host-test-secret-0123456789abcdef"
BLOCK = 4096  # bytes of one test block


def key(i: int, group: int = 0) -> TierKey:
    return TierKey(group, i.to_bytes(4, "little") * 8)  # 32-byte digests


def kv_like(n: int, seed: int, dtype: Any = np.float16) -> bytes:
    """`n` bytes of normal values in `dtype` (a random tail byte if `n` is odd)."""
    rng = np.random.default_rng(seed)
    size = np.dtype(dtype).itemsize
    body = rng.standard_normal(n // size).astype(dtype).tobytes()
    return body + rng.integers(0, 256, n - len(body), dtype=np.uint8).tobytes()


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def block(i: int) -> bytes:
    """Incompressible test block `i` (the compressed tier stores it raw: fixed sizes)."""
    return random_bytes(BLOCK, i)


ENTRY = HEADER_BYTES + BLOCK  # what one raw block takes of a budget

TIERS = {
    "host": lambda budget, ns=NS: HostTier(budget, ns),
    "compressed": lambda budget, ns=NS: CompressedHostTier(budget, ns),
}


@pytest.fixture(params=list(TIERS))
def make(request: pytest.FixtureRequest) -> Any:
    return TIERS[request.param]


# ---- round trips, LRU, budgets ---------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 3, 4095, 4096, 65537])
@pytest.mark.parametrize("kind", ["random", "zeros", "fp16"])
def test_round_trip(make: Any, n: int, kind: str) -> None:
    data = {"random": random_bytes(n, 1), "zeros": bytes(n), "fp16": kv_like(n, 2)}[kind]
    t = make(10 * (n + HEADER_BYTES) + 1000)
    assert t.put(key(1), data)
    assert t.get(key(1)) == data
    assert t.get(key(1)) == data  # reading does not consume
    st = t.stats()
    assert (st.puts, st.hits, st.misses, st.entries) == (1, 2, 0, 1)
    assert st.raw_bytes_in == n and st.raw_bytes_out == 2 * n
    assert st.stored_bytes == st.extra["stored_bytes_in"] <= n + HEADER_BYTES


def test_put_takes_any_contiguous_buffer(make: Any) -> None:
    arr = np.arange(1000, dtype=np.float16).reshape(10, 100)
    t = make(100_000)
    assert t.put(key(1), memoryview(arr))  # 2-D, format "e": read as its bytes
    assert t.put(key(2), arr)  # type: ignore[arg-type]  # any buffer works
    assert t.put(key(3), bytearray(arr.tobytes()))  # type: ignore[arg-type]
    for i in (1, 2, 3):
        assert t.get(key(i)) == arr.tobytes()
    with pytest.raises(ValueError, match="contiguous"):
        t.put(key(4), memoryview(arr[:, ::2]))
    with pytest.raises(ValueError, match="contiguous"):
        t.put(key(4), memoryview(b"abcdef")[::2])


def test_miss_and_groups_are_separate(make: Any) -> None:
    t = make(100_000)
    assert t.get(key(1)) is None
    assert t.put(key(1, group=0), block(1))
    assert t.put(key(1, group=1), block(2))
    assert t.get(key(1, group=0)) == block(1)
    assert t.get(key(1, group=1)) == block(2)
    assert t.get(key(1, group=2)) is None
    assert t.get(TierKey(0, key(1).digest[:16])) is None  # a shorter digest is another key
    st = t.stats()
    assert (st.gets, st.hits, st.misses, st.corrupt) == (5, 2, 3, 0)


def test_lru_order(make: Any) -> None:
    t = make(3 * ENTRY)
    for i in range(3):
        assert t.put(key(i), block(i))
    assert t.get(key(0)) == block(0)  # 0 is now the most recent: 1 is the oldest
    assert t.count_present([key(1), key(2)]) == 2  # a look-up does not refresh 1
    assert t.put(key(3), block(3))
    assert t.drain_removed() == [key(1)]
    assert t.put(key(4), block(4))
    assert t.drain_removed() == [key(2)]
    assert [t.get(key(i)) is not None for i in range(5)] == [True, False, False, True, True]
    assert t.stats().evictions == 2
    assert t.drain_removed() == []


def test_budget_at_its_limit(make: Any) -> None:
    t = make(3 * ENTRY)  # exactly three entries
    for i in range(3):
        assert t.put(key(i), block(i))
    st = t.stats()
    assert (st.entries, st.stored_bytes, st.evictions) == (3, 3 * ENTRY, 0)
    assert t.put(key(3), block(3))  # one past: the oldest goes
    st = t.stats()
    assert (st.entries, st.stored_bytes, st.evictions) == (3, 3 * ENTRY, 1)
    assert t.drain_removed() == [key(0)]

    t = make(3 * ENTRY - 1)  # one byte short of three
    for i in range(3):
        assert t.put(key(i), block(i))
    st = t.stats()
    assert (st.entries, st.stored_bytes, st.evictions) == (2, 2 * ENTRY, 1)
    assert t.count_present([key(1), key(2)]) == 2 and t.count_present([key(0)]) == 0


def test_a_put_evicts_as_many_as_it_needs(make: Any) -> None:
    t = make(4 * ENTRY)
    for i in range(4):
        assert t.put(key(i), block(i))
    big = random_bytes(3 * BLOCK, 9)  # needs the room of three small ones
    assert t.put(key(9), big)
    assert t.drain_removed() == [key(0), key(1), key(2)]
    assert t.get(key(3)) == block(3) and t.get(key(9)) == big
    assert t.stats().stored_bytes == ENTRY + HEADER_BYTES + 3 * BLOCK


def test_entry_larger_than_the_budget(make: Any) -> None:
    t = make(2 * ENTRY)
    assert t.put(key(0), block(0))
    assert not t.put(key(1), random_bytes(2 * ENTRY - HEADER_BYTES + 1, 5))  # 1 byte over
    st = t.stats()
    assert (st.dropped_puts, st.evictions, st.entries, st.puts) == (1, 0, 1, 1)
    assert t.get(key(0)) == block(0)  # nothing was evicted for it
    assert t.drain_removed() == []
    assert t.put(key(2), random_bytes(2 * ENTRY - HEADER_BYTES, 6))  # exactly the budget
    assert t.drain_removed() == [key(0)]
    assert t.stats().stored_bytes == 2 * ENTRY

    zero = make(0)
    assert not zero.put(key(0), b"")  # even an empty block has a header
    assert zero.stats().dropped_puts == 1


def test_replacing_a_key(make: Any) -> None:
    t = make(2 * ENTRY)
    assert t.put(key(0), block(0))
    assert t.put(key(1), block(1))
    assert t.put(key(0), block(7))  # replaced in place: nothing evicted or removed
    assert t.get(key(0)) == block(7)
    st = t.stats()
    assert (st.entries, st.stored_bytes, st.evictions) == (2, 2 * ENTRY, 0)
    assert t.drain_removed() == []
    assert t.put(key(2), block(2))  # the replacement refreshed 0: 1 is the oldest
    assert t.drain_removed() == [key(1)]
    assert not t.put(key(0), random_bytes(2 * ENTRY, 3))  # too large: the old one stays
    assert t.get(key(0)) == block(7)


def test_compressed_budget_counts_stored_bytes() -> None:
    t = CompressedHostTier(20_000, NS)
    zeros = bytes(100_000)  # 100 KB of zeros is a few hundred bytes of lz4
    for i in range(10):
        assert t.put(key(i), zeros)
    st = t.stats()
    assert st.entries == 10 and st.evictions == 0 and st.stored_bytes < 20_000
    assert st.raw_bytes_in == 1_000_000 > 50 * st.stored_bytes
    assert st.compression_ratio > 50
    assert all(t.get(key(i)) == zeros for i in range(10))
    assert not HostTier(20_000, NS).put(key(0), zeros)  # the raw tier cannot hold one


def test_count_present_is_a_prefix(make: Any) -> None:
    t = make(100_000)
    for i in (0, 1, 3):
        t.put(key(i), block(i))
    assert t.count_present([]) == 0
    assert t.count_present([key(0), key(1), key(2), key(3)]) == 2
    assert t.count_present([key(3), key(0)]) == 2
    assert t.count_present([key(2), key(0)]) == 0


def test_drain_removed_reports_evictions_and_discards(make: Any) -> None:
    t = make(3 * ENTRY)
    for i in range(3):
        t.put(key(i), block(i))
    t.discard(key(1))
    t.discard(key(1))  # absent now: a no-op, reported once
    t.discard(key(42))
    t.put(key(3), block(3))  # fits in the room 1 left
    t.put(key(4), block(4))  # evicts 0
    assert t.drain_removed() == [key(1), key(0)]
    assert t.drain_removed() == []
    st = t.stats()
    assert (st.evictions, st.extra["discards"], st.entries) == (1, 1, 3)
    t.clear()
    assert sorted(t.drain_removed()) == sorted([key(2), key(3), key(4)])
    assert t.stats().entries == 0 and t.stats().stored_bytes == 0 and len(t) == 0


def test_stats_and_media() -> None:
    raw, comp = HostTier(10**6, NS), CompressedHostTier(10**6, NS)
    assert (raw.medium, comp.medium) == ("CPU", "CPU_COMPRESSED")
    assert raw.stats().compression_ratio == 1.0  # before any put
    data = np.zeros(8192, np.float16).tobytes()
    for t in (raw, comp):
        assert t.put(key(0), data)
        assert t.get(key(0)) == data
        assert t.get(key(1)) is None
        st = t.stats()
        assert (st.raw_bytes_in, st.raw_bytes_out, st.hits, st.misses) == (16384, 16384, 1, 1)
        assert st.seconds_put > 0 and st.seconds_get > 0
    assert raw.stats().compression_ratio == 16384 / (16384 + HEADER_BYTES)  # framing only
    assert comp.stats().compression_ratio > 16384 / (HEADER_BYTES + 100)  # under 100 B of lz4
    s = comp.stats()
    s.extra["stored_bytes_in"] = -1  # a snapshot: changing it changes nothing
    assert comp.stats().extra["stored_bytes_in"] > 0


def test_default_codec_follows_the_dtype() -> None:
    assert item_size_of("bfloat16") == item_size_of("torch.float16") == 2
    assert item_size_of("float32") == 4 and item_size_of("fp8") == 1 and item_size_of("?") == 2
    t = CompressedHostTier(1000, Namespace("m", "l", "float32", 16))
    assert isinstance(t.codec, C.ShuffleLz4Codec) and t.codec.item_size == 4
    t = CompressedHostTier(1000, NS, C.Lz4Codec())
    assert t.codec.codec_id == C.LZ4


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        HostTier(-1, NS)
    with pytest.raises(TypeError):
        HostTier(1.5, NS)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        HostTier(10, "ns")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        CompressedHostTier(10, NS, "lz4")  # type: ignore[arg-type]
    t = HostTier(10_000, NS)
    with pytest.raises(ValueError, match="digest"):
        t.put(TierKey(0, bytes(33)), b"x")
    with pytest.raises(ValueError, match="group"):
        t.put(TierKey(256, b"d"), b"x")
    with pytest.raises(ValueError):
        C.Lz4Codec(0)


# ---- damaged, truncated and foreign entries --------------------------------------------------


def _flip(offset: int) -> Any:
    def damage(blob: bytearray) -> None:
        blob[offset] ^= 0x01

    return damage


# offsets in the header: magic 0, namespace 4, group 20, codec 21, item size 22, digest
# length 24, digest 25, raw length 57, payload length 65, MAC 73, payload 89
DAMAGE = {
    "magic": _flip(0),
    "namespace": _flip(10),
    "group": _flip(20),
    "codec": _flip(21),
    "item size": _flip(22),
    "digest": _flip(40),
    "raw length": _flip(57),
    "payload length": _flip(65),
    "MAC": _flip(75),
    "payload first byte": _flip(HEADER_BYTES),
    "payload last byte": _flip(-1),
    "truncated by one": lambda b: b.__delitem__(slice(-1, None)),
    "truncated to the header": lambda b: b.__delitem__(slice(HEADER_BYTES, None)),
    "truncated inside the header": lambda b: b.__delitem__(slice(40, None)),
    "one byte more": lambda b: b.append(0),
    "empty": lambda b: b.clear(),
}


def _stored(t: Any, k: TierKey) -> bytearray:
    blob: bytearray = t._entries[k][0]
    return blob


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("data", ["fp16", "zeros"])
def test_damaged_entry_is_a_miss(make: Any, damage: str, data: str) -> None:
    """The stored bytes are corrupted in place; the get is a miss, never wrong data, and
    the entry is dropped (reported like an eviction)."""
    t = make(100_000)
    payload = kv_like(BLOCK, 3) if data == "fp16" else bytes(BLOCK)
    for i in range(3):
        assert t.put(key(i), payload)
    DAMAGE[damage](_stored(t, key(1)))
    assert t.get(key(1)) is None
    st = t.stats()
    assert (st.corrupt, st.misses, st.hits, st.entries) == (1, 1, 0, 2)
    assert t.drain_removed() == [key(1)]
    assert t.count_present([key(0), key(1), key(2)]) == 1
    assert t.get(key(0)) == payload and t.get(key(2)) == payload
    assert t.stats().stored_bytes == 2 * len(_stored(t, key(0)))


def test_foreign_entries_are_misses(make: Any) -> None:
    """An entry of another namespace, or of another key (a digest collision), stored under
    this key: a miss, never that entry's bytes."""
    t, other = make(100_000), make(100_000, OTHER_NS)
    data = kv_like(BLOCK, 4)
    other.put(key(1), data)
    t.put(key(1), bytes(BLOCK))
    _stored(t, key(1))[:] = _stored(other, key(1))  # same key, other namespace
    assert t.get(key(1)) is None
    t.put(key(2), data)
    t.put(key(3), bytes(BLOCK))
    _stored(t, key(3))[:] = _stored(t, key(2))  # key 2's entry under key 3
    assert t.get(key(3)) is None
    t.put(key(4, group=1), bytes(BLOCK))
    _stored(t, key(4, group=1))[:] = _stored(t, key(2))  # other group
    assert t.get(key(4, group=1)) is None
    assert t.stats().corrupt == 3
    assert t.get(key(2)) == data


@pytest.mark.parametrize("cls", [HostTier, CompressedHostTier])
def test_secrets_decide_which_entries_pass(cls: Any) -> None:
    """An entry made under another secret is a miss; under the same secret it hits in
    another store; stores built without a secret share the process's random one."""
    data = kv_like(BLOCK, 7)
    mine, same, other = (cls(100_000, NS, secret=s) for s in (SECRET, SECRET, b"o" * 16))
    default_a, default_b = cls(100_000, NS), cls(100_000, NS)
    for store in (mine, same, other, default_a, default_b):
        assert store.put(key(1), data)
    assert bytes(_stored(mine, key(1))) != bytes(_stored(other, key(1)))
    _stored(same, key(1))[:] = _stored(mine, key(1))
    assert same.get(key(1)) == data  # same secret: the copied entry passes
    _stored(default_b, key(1))[:] = _stored(default_a, key(1))
    assert default_b.get(key(1)) == data
    blobs = {id(t): bytes(_stored(t, key(1))) for t in (mine, other)}
    for victim, source in ((mine, other), (other, mine), (default_a, mine)):
        _stored(victim, key(1))[:] = blobs[id(source)]
        assert victim.get(key(1)) is None
        assert victim.stats().corrupt == 1
    assert "secret" not in repr(mine) and SECRET.decode() not in repr(mine)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        cls(1000, NS, secret=b"too short")
    with pytest.raises(TypeError, match="bytes"):
        cls(1000, NS, secret="a text secret, long enough")


@pytest.mark.parametrize("cls", [HostTier, CompressedHostTier])
def test_ambiguous_namespaces_do_not_share_entries(cls: Any) -> None:
    """`model="a|b", layout="c"` and `model="a", layout="b|c"` were one namespace in the
    first entry format; now an entry of one is a miss in the other."""
    a = cls(100_000, Namespace("a|b", "c", "float16", 16), secret=SECRET)
    b = cls(100_000, Namespace("a", "b|c", "float16", 16), secret=SECRET)
    a.put(key(1), kv_like(BLOCK, 8))
    b.put(key(1), bytes(BLOCK))
    _stored(b, key(1))[:] = _stored(a, key(1))
    assert b.get(key(1)) is None
    assert b.stats().corrupt == 1


def test_well_framed_garbage_is_a_miss() -> None:
    """Entries with a valid MAC whose payload does not decode (a writer's bug, or a
    codec this reader lacks): misses too."""
    t = CompressedHostTier(100_000, NS, secret=SECRET)
    ns, d = NS.ident(), key(1).digest
    lz4_zeros = C.Lz4Codec().encode(bytes(BLOCK)).payload
    cases = [
        encode_entry(ns, 0, d, C.LZ4, 1, BLOCK, random_bytes(100, 1), secret=SECRET),  # not lz4
        encode_entry(
            ns, 0, d, C.SHUFFLE_LZ4, 2, BLOCK + 1, lz4_zeros, secret=SECRET
        ),  # decodes to the wrong length
        encode_entry(ns, 0, d, C.LZ4, 1, 10**12, b"\x00" * 16, secret=SECRET),  # absurd length
        encode_entry(ns, 0, d, 99, 1, BLOCK, bytes(10), secret=SECRET),  # unknown codec
        encode_entry(ns, 0, d, C.RAW, 1, BLOCK, bytes(BLOCK - 1), secret=SECRET),  # wrong size
        encode_entry(ns, 0, d, C.SHUFFLE_LZ4, 0, BLOCK, lz4_zeros, secret=SECRET),  # item size 0
    ]
    for blob in cases:
        t.put(key(1), bytes(BLOCK))
        _stored(t, key(1))[:] = blob
        assert t.get(key(1)) is None
    assert t.stats().corrupt == len(cases)
    assert t.stats().entries == 0


# ---- codecs --------------------------------------------------------------------------------

CODECS = {
    "raw": lambda: C.RawCodec(),
    "lz4": lambda: C.Lz4Codec(),
    "lz4 fast": lambda: C.Lz4Codec(acceleration=8),
    "shuffle1": lambda: C.ShuffleLz4Codec(1),
    "shuffle2": lambda: C.ShuffleLz4Codec(2),
    "shuffle4": lambda: C.ShuffleLz4Codec(4),
    "shuffle3": lambda: C.ShuffleLz4Codec(3),
}


def _structured(n: int, kind: str) -> bytes:
    rng = np.random.default_rng(n)
    if kind == "random":
        return random_bytes(n, n)
    if kind == "zeros":
        return bytes(n)
    if kind == "fp16":
        return kv_like(n, n, np.float16)
    if kind == "fp32":
        return kv_like(n, n, np.float32)
    if kind == "ramp":
        return np.arange(n, dtype=np.uint32).astype(np.uint8).tobytes()
    if kind == "small ints":  # few distinct values: compresses, more so shuffled
        return rng.integers(0, 4, n // 2 + 1, dtype=np.uint16).tobytes()[:n]
    raise ValueError(kind)


@pytest.mark.parametrize("name", list(CODECS))
@pytest.mark.parametrize("kind", ["random", "zeros", "fp16", "fp32", "ramp", "small ints"])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 63, 64, 1001, 4096, 65537, 262_147])
def test_codec_round_trip(name: str, kind: str, n: int) -> None:
    codec = CODECS[name]()
    data = _structured(n, kind)
    enc = codec.encode(data)
    assert enc.codec_id in (C.RAW, codec.codec_id)
    assert enc.item_size == codec.item_size
    if enc.codec_id != C.RAW:
        assert C.pays(n, len(enc.payload))
    assert C.decode(enc.codec_id, enc.item_size, enc.payload, n) == data
    if enc.codec_id == codec.codec_id:
        assert codec.decode(enc.payload, n, enc.item_size) == data
    if kind == "random" or n < 16:
        assert enc.codec_id == C.RAW  # incompressible: stored raw
    if kind == "zeros" and n >= 4096 and name != "raw":
        assert enc.codec_id == codec.codec_id and len(enc.payload) < n // 64


@pytest.mark.parametrize("item", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 1001])
@pytest.mark.parametrize("offset", [0, 1])
def test_shuffle_is_a_permutation(item: int, n: int, offset: int) -> None:
    data = random_bytes(n, 7)
    s = C.shuffle(memoryview(b"x" * offset + data)[offset:], item)  # unaligned too
    assert sorted(s.tobytes()) == sorted(data)
    assert C.unshuffle(s.tobytes(), item) == data
    assert C.unshuffle(memoryview(b"x" * offset + s.tobytes())[offset:], item) == data
    body = n - n % item
    if item > 1 and body:
        # byte k of every element, then the next k; the tail stays at the end
        a = np.frombuffer(data, np.uint8)
        want = np.concatenate([a[k:body:item] for k in range(item)] + [a[body:]])
        assert np.array_equal(s, want)


def test_shuffle_helps_on_few_exponents() -> None:
    """Values with two distinct high bytes and random low bytes (the case the shuffle is
    for): plain lz4 finds nothing to match, shuffled it compresses the high bytes (not to
    their 1 bit of entropy each: lz4 has no entropy coder)."""
    rng = np.random.default_rng(0)
    hi = rng.integers(0x3C, 0x3E, 1 << 15, dtype=np.uint16) << 8
    data = (hi | rng.integers(0, 256, 1 << 15, dtype=np.uint16)).tobytes()
    assert C.Lz4Codec().encode(data).codec_id == C.RAW
    shuffled = C.ShuffleLz4Codec(2).encode(data)
    assert shuffled.codec_id == C.SHUFFLE_LZ4
    assert len(shuffled.payload) < 0.8 * len(data)


def test_raw_fallback_threshold() -> None:
    assert C.pays(6400, 6300) and not C.pays(6400, 6301)  # saves 100 = 1/64, 99 < 1/64
    assert not C.pays(0, 0) and not C.pays(100, 100) and not C.pays(100, 120)
    n = 1 << 16
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, n, dtype=np.uint8)
    few = noise.copy()
    few[: n // 200] = 0  # 0.5% zeros: saves less than 1/64
    many = noise.copy()
    many[: n // 16] = 0  # 6% zeros: saves more
    codec = C.Lz4Codec()
    assert codec.encode(few.tobytes()).codec_id == C.RAW
    enc = codec.encode(many.tobytes())
    assert enc.codec_id == C.LZ4 and len(enc.payload) < n - n // 64
    t = CompressedHostTier(10 * n, NS, codec)
    t.put(key(0), few.tobytes())
    t.put(key(1), many.tobytes())
    assert t.stats().extra["raw_fallbacks"] == 1
    assert _stored(t, key(0))[21] == C.RAW and _stored(t, key(1))[21] == C.LZ4
    assert t.get(key(0)) == few.tobytes() and t.get(key(1)) == many.tobytes()


def test_decode_errors() -> None:
    lz = C.Lz4Codec().encode(bytes(4096)).payload
    with pytest.raises(EntryError, match="unknown codec"):
        C.decode(77, 1, b"", 0)
    with pytest.raises(EntryError):
        C.decode(C.LZ4, 1, random_bytes(64, 0), 4096)  # not lz4
    with pytest.raises(EntryError):
        C.decode(C.LZ4, 1, bytes(lz)[:-3], 4096)  # truncated
    with pytest.raises(EntryError):
        C.decode(C.LZ4, 1, lz, 4095)  # the output does not fit the header's length
    with pytest.raises(EntryError, match="not 4097"):
        C.decode(C.LZ4, 1, lz, 4097)  # decodes to fewer bytes than the header says
    with pytest.raises(EntryError, match="cannot hold"):
        C.decode(C.LZ4, 1, lz, 10**15)
    with pytest.raises(EntryError):
        C.decode(C.LZ4, 1, b"", 0)
    with pytest.raises(EntryError):
        C.decode(C.RAW, 1, b"abc", 4)
    with pytest.raises(EntryError):
        C.decode(C.SHUFFLE_LZ4, 0, lz, 4096)
    assert C.decode(C.SHUFFLE_LZ4, 4096, lz, 4096) == bytes(4096)  # one element: no-op


def test_a_new_codec_registers() -> None:
    """The documented way to add a codec (zstd, say) works for a toy one."""

    class Reverse(C.Codec):
        codec_id = 200
        name = "reverse"

        def _compress(self, data: Any) -> bytes:
            return bytes(data)[::-1][: len(data) // 2]  # "compresses" zeros

        def _decompress(self, payload: Any, raw_len: int, item_size: int) -> bytes:
            return bytes(raw_len)

    with pytest.raises(EntryError, match="unknown codec"):
        C.decode(200, 1, b"", 8)
    C.register(200, Reverse)
    try:
        enc = Reverse().encode(bytes(64))
        assert enc.codec_id == 200
        assert C.decode(200, 1, enc.payload, 64) == bytes(64)
        t = CompressedHostTier(10_000, NS, Reverse())
        assert t.put(key(0), bytes(64)) and t.get(key(0)) == bytes(64)
    finally:
        C._DECODERS.pop(200)
        C._INSTANCES.pop(200, None)


def test_codec_by_name() -> None:
    assert isinstance(C.codec_by_name("raw"), C.RawCodec)
    assert type(C.codec_by_name("lz4")) is C.Lz4Codec
    assert C.codec_by_name("shuffle-lz4", 4).item_size == 4
    with pytest.raises(ValueError):
        C.codec_by_name("zstd")


# ---- threads ---------------------------------------------------------------------------------


def _content(i: int) -> bytes:
    """Block i: fp16-like (compresses a little with the shuffle), a length that depends on
    i so that evictions are uneven."""
    return kv_like(2000 + 37 * (i % 50), i)


def test_many_threads(make: Any) -> None:
    """8 threads put, get, count and discard 200 keys under a budget of about a third of
    them; every hit is exactly its block; afterwards every surviving entry reads back
    exactly and the accounting adds up."""
    budget = 70 * (2000 + HEADER_BYTES)
    t = make(budget)
    contents = {i: _content(i) for i in range(200)}
    errors: list[str] = []
    barrier = threading.Barrier(8)

    def worker(w: int) -> None:
        rng = np.random.default_rng(w)
        barrier.wait()
        for _ in range(600):
            i = int(rng.integers(0, 200))
            op = rng.random()
            if op < 0.45:
                t.put(key(i), contents[i])
            elif op < 0.9:
                got = t.get(key(i))
                if got is not None and got != contents[i]:
                    errors.append(f"key {i}: wrong bytes")
            elif op < 0.95:
                t.count_present([key(i), key(i + 1)])
            else:
                t.discard(key(i))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    st = t.stats()
    assert st.corrupt == 0 and st.errors == 0 and st.dropped_puts == 0
    assert st.hits + st.misses == st.gets > 0
    assert st.evictions > 0 and st.hits > 0
    present = [i for i in range(200) if t.count_present([key(i)])]
    assert len(present) == st.entries > 0
    assert st.stored_bytes == sum(t._entries[key(i)][1] for i in present) <= budget
    assert all(len(_stored(t, key(i))) == t._entries[key(i)][1] for i in present)
    for i in present:
        assert t.get(key(i)) == contents[i]
    removed = t.drain_removed()
    assert not set(removed) - {key(i) for i in range(200)}


# ---- import cost -------------------------------------------------------------------------------


def test_import_needs_neither_torch_nor_lz4() -> None:
    code = (
        "import sys, pagedkv, pagedkv.tiers, pagedkv.tiers.host, pagedkv.tiers.codec\n"
        "t = pagedkv.tiers.HostTier(1000, pagedkv.tiers.Namespace('m', 'l', 'bf16', 16))\n"
        "assert t.put((0, b'd'), b'abc') and t.get((0, b'd')) == b'abc'\n"
        "print(sorted(m for m in ('torch', 'lz4') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_header_layout_assumed_above() -> None:
    """The damage offsets above follow tiers/entry.py's header."""
    blob = encode_entry(NS.ident(), 5, b"\xab" * 32, 2, 0x0102, 7, b"payload", secret=SECRET)
    assert blob[:4] == b"PKV2" and blob[4:20] == NS.ident()
    assert (blob[20], blob[21], blob[22:24], blob[24]) == (5, 2, b"\x02\x01", 32)
    assert blob[25:57] == b"\xab" * 32
    assert struct.unpack_from("<QQ", blob, 57) == (7, 7)
    assert HEADER_BYTES == 89 and blob[HEADER_BYTES:] == b"payload"
