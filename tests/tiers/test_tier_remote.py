"""The remote tier on real servers: Redis and Valkey started by the tests, and a three-node
Redis Cluster (tests/support/redis_fixtures.py). No mock stands in for a server here.

Fault tests kill (SIGKILL), stall (SIGSTOP) and restart servers mid-run and bound the wall
time of every call that meets the fault.
"""

from __future__ import annotations

import hashlib
import random
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedkv.tiers import Namespace, TierKey, decode_entry, encode_entry
from pagedkv.tiers.codec import LZ4, RAW, SHUFFLE_LZ4, Lz4Codec, ShuffleLz4Codec
from pagedkv.tiers.entry import Entry, key_ident
from pagedkv.tiers.remote import RemoteTier
from redis_fixtures import (
    Cluster,
    ServerProcess,
    free_port,
    running_cluster,
    running_server,
    server_binary,
)

NS = Namespace("test-model", "L2xKV2xH4xD64", "float16", 16, "tenant-a")
_HEAD = struct.Struct("<4s16sBBHB32sQQ")  # an entry's header before its MAC (entry.py)
# The trust domain's MAC secret, given to every node (docs/tiers.md, "Who must be trusted").
SECRET = b"remote-test-secret-0123456789abcdef"

# Fault-test settings, and the slack allowed on top of them for a loaded 2-core machine.
TIMEOUT = 0.3
RETRY_AFTER = 0.5
SLACK = 0.3


def tkey(i: int, group: int = 0) -> TierKey:
    return TierKey(group, hashlib.blake2b(f"block {i}".encode(), digest_size=32).digest())


def block(i: int, size: int = 4096) -> bytes:
    return random.Random(i).randbytes(size)


def fault_tier(url: str, cluster: bool = False) -> RemoteTier:
    return RemoteTier(
        url,
        NS,
        secret=SECRET,
        timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        retry_after=RETRY_AFTER,
        cluster=cluster,
    )


@pytest.fixture(params=["redis", "valkey"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerProcess]:
    with running_server(server_binary(request.param), tmp_path / "server") as s:
        yield s


@pytest.fixture(params=["redis", "valkey"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    with running_cluster(server_binary(request.param), tmp_path / "cluster") as c:
        yield c


def timed(fn, *args: object, limit: float = 10.0) -> tuple[object, float]:
    """`fn(*args)` and its wall time, run in a thread so that a hang fails the test (after
    `limit` seconds) instead of stalling the run."""
    box: list[object] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            box.append(fn(*args))
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=run, daemon=True)
    t0 = time.monotonic()
    th.start()
    th.join(limit)
    dt = time.monotonic() - t0
    assert not th.is_alive(), f"{fn.__name__} still blocked after {limit} s"
    if errors:
        raise errors[0]
    return box[0], dt


# --- round trips ---------------------------------------------------------------------------


def test_round_trip_and_key_layout(server):
    tier = RemoteTier(server.url, NS, secret=SECRET)
    assert tier.medium == "REMOTE"
    sizes = [0, 1, 4096, 100_000, 1 << 20]
    keys = [tkey(i, group=i % 2) for i in range(len(sizes))]
    for i, (k, n) in enumerate(zip(keys, sizes, strict=True)):
        assert tier.put(k, block(i, n))
    for i, (k, n) in enumerate(zip(keys, sizes, strict=True)):
        assert tier.get(k) == block(i, n)
    assert tier.get(tkey(99)) is None
    # The group is part of the key: the same digest in the other group is another block.
    assert tier.get(TierKey(1, keys[0].digest)) is None

    raw = server.client()
    for k in keys:
        name = f"pagedkv:{key_ident(NS, SECRET).hex()}:{k.group}:{k.digest.hex()}"
        assert tier.key_name(k) == name
        assert NS.ident().hex() not in name  # the key's namespace part is keyed by the secret
        assert "{" not in name  # no hash tag (docs/tiers.md, "Remote tier")
        entry = decode_entry(raw.get(name), NS.ident(), k.group, k.digest, secret=SECRET)
        assert entry.codec == 0
    assert raw.dbsize() == len(keys)
    assert raw.ttl(tier.key_name(keys[0])) == -1  # no TTL unless asked

    st = tier.stats()
    assert (st.puts, st.dropped_puts, st.gets, st.hits, st.misses) == (5, 0, 7, 5, 2)
    assert st.raw_bytes_in == st.raw_bytes_out == sum(sizes)
    assert (st.errors, st.corrupt) == (0, 0)
    assert st.compression_ratio < 1.0  # framing only: stored bytes exceed raw bytes
    tier.close()  # closes the connections; later calls reconnect
    assert tier.get(keys[2]) == block(2, sizes[2])


@pytest.mark.parametrize("kind", ["redis", "valkey"])
def test_unix_socket(kind, tmp_path):
    sock = tmp_path / "s.sock"
    with running_server(server_binary(kind), tmp_path / "srv", ["--unixsocket", str(sock)]):
        tier = RemoteTier(f"unix://{sock}", NS, secret=SECRET)
        keys = [tkey(i) for i in range(4)]
        assert all(tier.put(k, block(i, 70_000)) for i, k in enumerate(keys))
        assert [tier.get(k) for k in keys] == [block(i, 70_000) for i in range(4)]
        assert tier.count_present(keys) == 4
    assert tier.get(keys[0]) is None  # the server is gone: a miss
    assert tier.stats().errors == 1


def test_count_present_prefix_and_batches(server):
    tier = RemoteTier(server.url, NS, secret=SECRET, pipeline_batch=4)
    keys = [tkey(i) for i in range(12)]
    for i, k in enumerate(keys):
        if i != 6:
            assert tier.put(k, block(i, 64))
    raw = server.client()

    def exists_calls() -> int:
        return int(raw.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))

    before = exists_calls()
    assert tier.count_present(keys) == 6
    # Batches of 4: [0..3] all present, [4..7] stops at 6, [8..11] is never sent.
    assert exists_calls() - before == 8
    assert tier.count_present(keys[:6]) == 6
    assert tier.count_present(keys[7:]) == 5
    assert tier.count_present([]) == 0
    assert tier.count_present([tkey(6), *keys[:6]]) == 0
    assert tier.count_present([TierKey(1, keys[0].digest)]) == 0

    one_batch = RemoteTier(
        server.url, NS, secret=SECRET
    )  # default batch: one round trip for all 12
    before = exists_calls()
    assert one_batch.count_present(keys) == 6
    assert exists_calls() - before == 12
    # Key by key, holes included (a window group's blocks need not be a leading run): every
    # key asked, in batches, none skipped after the hole.
    before = exists_calls()
    assert tier.present_each(keys) == [i != 6 for i in range(12)]
    assert exists_calls() - before == 12
    assert tier.present_each([]) == []
    assert tier.present_each([TierKey(1, keys[0].digest), keys[0]]) == [False, True]


def test_discard_and_drain_removed(server):
    tier = RemoteTier(server.url, NS, secret=SECRET)
    a, b = tkey(1), tkey(2)
    assert tier.put(a, block(1))
    assert tier.put(b, block(2))
    tier.discard(a)
    tier.discard(tkey(3))  # absent: a no-op, not reported
    assert tier.get(a) is None
    assert tier.get(b) == block(2)
    assert tier.count_present([a, b]) == 0
    assert tier.drain_removed() == [a]
    assert tier.drain_removed() == []
    assert server.client().exists(tier.key_name(a)) == 0


def test_foreign_damaged_and_misplaced_values_are_misses(server):
    tier = RemoteTier(server.url, NS, secret=SECRET)
    raw = server.client()
    good = [tkey(i) for i in range(8)]
    for i, k in enumerate(good):
        assert tier.put(k, block(i))
    entries = {k: raw.get(tier.key_name(k)) for k in good}

    other_ns = Namespace("other-model", NS.layout, NS.dtype, NS.block_size, NS.tenant)
    k0, k1, k2, k3, k4, k5, k6, k7 = good
    # A value of another namespace under our key (same group and digest).
    raw.set(
        tier.key_name(k0),
        encode_entry(other_ns.ident(), k0.group, k0.digest, 0, 1, 4096, block(0), secret=SECRET),
    )
    # Truncated by one byte, and cut inside the header.
    raw.set(tier.key_name(k1), entries[k1][:-1])
    raw.set(tier.key_name(k2), entries[k2][:40])
    # One flipped bit in the payload; one in the header's raw length.
    flipped = bytearray(entries[k3])
    flipped[len(flipped) // 2] ^= 0x01
    raw.set(tier.key_name(k3), bytes(flipped))
    flipped = bytearray(entries[k4])
    flipped[60] ^= 0x01
    raw.set(tier.key_name(k4), bytes(flipped))
    # Another block's whole, valid entry stored under this key.
    raw.set(tier.key_name(k5), entries[k7])
    # Not an entry at all; and not even a string (WRONGTYPE on GET).
    raw.set(tier.key_name(k6), b"hello")
    raw.delete(tier.key_name(k7))
    raw.rpush(tier.key_name(k7), b"x")

    for k in good:
        assert tier.get(k) is None, k
    st = tier.stats()
    assert st.corrupt == 8
    assert st.hits == 0
    assert st.errors == 0
    # The misplaced entry is intact under its own key.
    raw.set(tier.key_name(k7), entries[k7])
    assert tier.get(k7) == block(7)


def _old_entry(k: TierKey, data: bytes) -> bytes:
    """A value of the first entry format (PKV1, the namespace's old text id, a valid
    unkeyed blake2b-64 checksum): what a writer without the secret can always make."""
    text = f"{NS.model}|{NS.layout}|{NS.dtype}|{NS.block_size}|{NS.tenant}"
    ns_id = hashlib.blake2b(text.encode(), digest_size=16).digest()
    head = _HEAD.pack(b"PKV1", ns_id, k.group, 0, 1, 32, k.digest, len(data), len(data))
    return head + hashlib.blake2b(head + data, digest_size=8).digest() + data


def _forged_entry(k: TierKey, data: bytes) -> bytes:
    """A value of the current format for `k` in NS, every header field right, with the
    unkeyed checksums a writer without the secret could compute in place of the MAC."""
    head = _HEAD.pack(b"PKV2", NS.ident(), k.group, 0, 1, 32, k.digest, len(data), len(data))
    return head + hashlib.blake2b(head + data, digest_size=16).digest() + data


def test_forged_and_old_format_values_are_misses(server):
    """Values written straight into the server by someone without the secret: a forged
    entry with a valid unkeyed checksum, and an entry of the old format (PKV1) with its
    valid checksum. Both are misses, counted as corrupt; the real entry still hits."""
    tier = RemoteTier(server.url, NS, secret=SECRET)
    raw = server.client()
    k1, k2, k3 = tkey(1), tkey(2), tkey(3)
    raw.set(tier.key_name(k1), _forged_entry(k1, block(1)))
    raw.set(tier.key_name(k2), _old_entry(k2, block(2)))
    # A real entry, then its payload swapped for other KV and "re-checksummed" unkeyed.
    assert tier.put(k3, block(3))
    raw.set(tier.key_name(k3), _forged_entry(k3, block(4)))
    assert tier.count_present([k1, k2, k3]) == 3  # present, but never served:
    assert [tier.get(k) for k in (k1, k2, k3)] == [None, None, None]
    st = tier.stats()
    assert (st.corrupt, st.hits, st.misses) == (3, 0, 3)
    assert tier.put(k3, block(3)) and tier.get(k3) == block(3)


def test_secrets_across_nodes(server):
    """Nodes given one secret hit each other's blocks; a node with another secret neither
    sees theirs (its presence checks say absent, as its gets do) nor they its own, and its
    puts go under other keys, so they cannot overwrite the others' entries."""
    a = RemoteTier(server.url, NS, secret=SECRET)
    b = RemoteTier(server.url, NS, secret=bytearray(SECRET))
    c = RemoteTier(server.url, NS, secret=b"a-different-secret-0123456789")
    k1, k2 = tkey(1), tkey(2)
    assert a.put(k1, block(1))
    assert b.count_present([k1]) == 1 and b.get(k1) == block(1)
    assert c.count_present([k1]) == 0 and c.present_each([k1]) == [False]
    assert c.get(k1) is None
    assert c.put(k2, block(2))
    assert a.count_present([k2]) == 0 and b.present_each([k1, k2]) == [True, False]
    assert a.get(k2) is None and b.get(k2) is None
    assert c.get(k2) == block(2)
    assert c.put(k1, block(9))  # its own key: the others' entry stays
    assert a.get(k1) == block(1) and c.get(k1) == block(9)
    assert (a.stats().corrupt, b.stats().corrupt, c.stats().corrupt) == (0, 0, 0)
    assert (a.stats().hits, b.stats().hits, c.stats().hits) == (1, 1, 2)
    assert server.client().dbsize() == 3


def test_presence_checks_what_a_get_would_accept(server):
    """Item 13 of issue 32: the presence check counted an entry made under another secret
    as present (EXISTS of the shared key), and the load then missed. Every present answer
    for another secret's entries is now an absent one, with the gets agreeing, key by key
    and as a leading run; an entry of our own secret stays present."""
    mine = RemoteTier(server.url, NS, secret=SECRET)
    theirs = RemoteTier(server.url, NS, secret=b"a-different-secret-0123456789")
    keys = [tkey(i) for i in range(6)]
    for i, k in enumerate(keys):
        assert theirs.put(k, block(i))
    assert mine.put(keys[3], block(3))
    assert mine.count_present(keys) == 0
    assert mine.present_each(keys) == [k == keys[3] for k in keys]
    assert [mine.get(k) is not None for k in keys] == mine.present_each(keys)
    assert theirs.count_present(keys) == len(keys)


def test_secret_is_required_and_checked(server):
    with pytest.raises(TypeError, match="secret"):
        RemoteTier(server.url, NS)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RemoteTier(server.url, NS, secret=b"0123456789")
    with pytest.raises(TypeError, match="bytes"):
        RemoteTier(server.url, NS, secret="a text secret, long enough")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        RemoteTier(server.url, NS, secret=None)  # type: ignore[arg-type]


def test_ambiguous_namespaces_do_not_hit_each_other(server):
    """`model="a|b", layout="c"` and `model="a", layout="b|c"` shared one namespace id in
    the first format: now their keys differ, and a value copied across is a miss."""
    ta = RemoteTier(server.url, Namespace("a|b", "c", "float16", 16), secret=SECRET)
    tb = RemoteTier(server.url, Namespace("a", "b|c", "float16", 16), secret=SECRET)
    k = tkey(1)
    assert ta.key_name(k) != tb.key_name(k)
    assert ta.put(k, block(1))
    assert tb.count_present([k]) == 0 and tb.get(k) is None
    raw = server.client()
    raw.set(tb.key_name(k), raw.get(ta.key_name(k)))
    assert tb.get(k) is None and tb.stats().corrupt == 1
    assert ta.get(k) == block(1)


def test_secret_never_reaches_the_server(server):
    """After puts (raw, compressed, `put_entry`), gets, look-ups and discards, no key and
    no value on the server holds the secret, raw or in hex."""
    raw = server.client()
    plain = RemoteTier(server.url, NS, secret=SECRET)
    packed = RemoteTier(server.url, NS, secret=SECRET, codec=ShuffleLz4Codec(2))
    keys = [tkey(i) for i in range(40)]
    for i, k in enumerate(keys):
        tier = plain if i % 2 else packed
        assert tier.put(k, bf16_like(i, 4096) if i % 3 else block(i, 1 + 97 * i))
        assert tier.get(k) is not None
    entry = plain.get_entry(keys[0])
    assert entry is not None and plain.put_entry(tkey(100), entry)
    assert plain.count_present(keys) == len(keys)
    plain.discard(keys[1])
    forms = (SECRET, SECRET.hex().encode(), SECRET.hex().upper().encode())
    names = list(raw.scan_iter(count=1000))
    assert len(names) == len(keys)  # 40 - 1 discarded + 1 by put_entry
    for name in names:
        value = raw.get(name)
        assert value is not None
        assert not any(f in name or f in value for f in forms), name


def bf16_like(i: int, n: int = 64 * 1024) -> bytes:
    """Bytes shaped like bf16 KV: random low bytes, high bytes from a few values (sign and
    exponent), so the byte shuffle + lz4 compresses them and plain lz4 barely does."""
    rng = random.Random(i)
    lo = rng.randbytes(n // 2)
    hi = bytes(rng.choice((0x3E, 0x3F, 0xBE, 0xBF)) for _ in range(n // 2))
    return bytes(b for pair in zip(lo, hi, strict=True) for b in pair)


def test_codec_round_trip_and_foreign_codecs(server):
    raw = server.client()
    shuffled = RemoteTier(server.url, NS, secret=SECRET, codec=ShuffleLz4Codec(2))
    plain = RemoteTier(
        server.url, NS, secret=SECRET
    )  # no codec: reads any known codec all the same
    k1, k2, k3, k4, k5 = (tkey(i) for i in range(1, 6))

    assert shuffled.put(k1, bf16_like(1))
    e1 = decode_entry(raw.get(shuffled.key_name(k1)), NS.ident(), 0, k1.digest, secret=SECRET)
    assert (e1.codec, e1.item_size, e1.raw_len) == (SHUFFLE_LZ4, 2, 64 * 1024)
    assert len(e1.payload) < 0.85 * 64 * 1024
    assert shuffled.get(k1) == bf16_like(1)
    assert plain.get(k1) == bf16_like(1)
    st = shuffled.stats()
    assert st.compression_ratio > 1.15
    # Random bytes do not compress: stored raw (codec 0), counted as a fallback.
    assert shuffled.put(k2, block(2, 65536))
    e2 = decode_entry(raw.get(shuffled.key_name(k2)), NS.ident(), 0, k2.digest, secret=SECRET)
    assert e2.codec == RAW
    assert shuffled.get(k2) == block(2, 65536)
    assert shuffled.stats().extra["raw_fallbacks"] == 1

    # put_entry frames a caller's encoded block for the key, payload as it is (here lz4,
    # made outside the tier), with the tier's own secret.
    enc = Lz4Codec().encode(bytes(65536))
    assert enc.codec_id == LZ4
    e3 = Entry(enc.codec_id, 1, 65536, memoryview(enc.payload))
    assert plain.put_entry(k3, e3)
    assert raw.get(plain.key_name(k3)) == encode_entry(
        NS.ident(), 0, k3.digest, LZ4, 1, 65536, enc.payload, secret=SECRET
    )
    got = plain.get_entry(k3)
    assert got is not None
    assert (got.codec, got.raw_len) == (LZ4, 65536)
    assert plain.get(k3) == bytes(65536)

    # An unknown codec, and an lz4 payload that is garbage under a valid checksum: misses.
    assert plain.put_entry(k4, Entry(7, 1, 100, memoryview(b"x" * 50)))
    assert plain.put_entry(k5, Entry(LZ4, 1, 65536, memoryview(b"\xff" * 64)))
    before = plain.stats().corrupt
    assert plain.get(k4) is None
    assert plain.get(k5) is None
    assert plain.stats().corrupt == before + 2

    class Broken(Lz4Codec):
        def _compress(self, data):
            raise RuntimeError("broken codec")

    broken = RemoteTier(server.url, NS, secret=SECRET, codec=Broken())
    assert broken.put(tkey(9), bf16_like(9)) is False  # dropped, nothing stored
    assert raw.exists(broken.key_name(tkey(9))) == 0
    assert (broken.stats().dropped_puts, broken.stats().errors) == (1, 1)
    with pytest.raises(TypeError):
        RemoteTier(server.url, NS, secret=SECRET, codec="lz4")  # type: ignore[arg-type]


def test_ttl(server):
    tier = RemoteTier(server.url, NS, secret=SECRET, ttl=0.3)
    k = tkey(1)
    assert tier.put(k, block(1))
    pttl = server.client().pttl(tier.key_name(k))
    assert 0 < pttl <= 300
    assert tier.get(k) == block(1)
    time.sleep(0.45)
    assert tier.get(k) is None


# --- faults ----------------------------------------------------------------------------------


def test_server_killed_then_restarted(server):
    tier = fault_tier(server.url)
    keys = [tkey(i) for i in range(8)]
    for i, k in enumerate(keys):
        assert tier.put(k, block(i))
    assert tier.count_present(keys) == 8

    server.kill()
    got, dt = timed(tier.get, keys[0])
    assert got is None
    assert dt < TIMEOUT + SLACK
    assert tier.stats().errors == 1
    assert tier.stats().extra["servers_down"] == 1

    # The server rests for retry_after: every call misses at once, nothing is tried.
    t0 = time.monotonic()
    for i, k in enumerate(keys):
        assert tier.get(k) is None
        assert tier.put(k, block(i)) is False
        assert tier.count_present(keys) == 0
        tier.discard(k)
    assert time.monotonic() - t0 < SLACK
    st = tier.stats()
    assert st.errors == 1
    assert st.extra["skipped"] == 32
    assert st.dropped_puts == 8

    # Past retry_after one call probes again: still down, one more error, still bounded.
    time.sleep(RETRY_AFTER + 0.05)
    got, dt = timed(tier.put, keys[0], block(0))
    assert got is False
    assert dt < TIMEOUT + SLACK
    assert tier.stats().errors == 2

    server.restart()
    deadline = time.monotonic() + RETRY_AFTER + 2.0
    while not tier.put(keys[0], block(0)):
        assert time.monotonic() < deadline, "the tier did not recover"
        time.sleep(0.02)
    # The data went with the server (no persistence); what is stored again reads back.
    assert tier.count_present(keys) == 1
    for i, k in enumerate(keys[1:], 1):
        assert tier.put(k, block(i))
    assert all(tier.get(k) == block(i) for i, k in enumerate(keys))
    assert tier.stats().extra["servers_down"] == 0


def test_server_killed_and_restarted_under_concurrent_load(server):
    tier = fault_tier(server.url)
    stop = threading.Event()
    restarted_at: list[float] = []
    slowest = [0.0] * 4
    wrong: list[tuple[int, int]] = []
    stored_after_restart = [0] * 4

    def work(t: int) -> None:
        i = 0
        while not stop.is_set():
            k, data = tkey(t * 100_000 + i), block(t * 100_000 + i, 8192)
            calls: list[tuple[Callable[..., object], tuple[object, ...]]] = [
                (tier.put, (k, data)),
                (tier.get, (k,)),
                (tier.count_present, ([k, tkey(t * 100_000 + i - 1)],)),
            ]
            for call, args in calls:
                t0 = time.monotonic()
                out = call(*args)
                slowest[t] = max(slowest[t], time.monotonic() - t0)
                if isinstance(out, bytes) and out != data:
                    wrong.append((t, i))
                if out is True and restarted_at and t0 > restarted_at[0]:
                    stored_after_restart[t] += 1
            i += 1

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    try:
        time.sleep(0.5)
        server.kill()
        time.sleep(1.0)
        server.restart()
        restarted_at.append(time.monotonic())
        time.sleep(RETRY_AFTER + 1.0)
    finally:
        stop.set()
        for th in threads:
            th.join(10)
    assert not any(th.is_alive() for th in threads)  # no call hung, none raised
    assert not wrong
    assert max(slowest) < TIMEOUT + SLACK, slowest
    assert all(n > 0 for n in stored_after_restart), stored_after_restart  # recovered
    st = tier.stats()
    assert st.errors >= 1
    assert st.dropped_puts >= 1
    assert st.corrupt == 0


def test_stalled_server_is_a_bounded_miss(server):
    tier = fault_tier(server.url)
    keys = [tkey(i) for i in range(4)]
    for i, k in enumerate(keys):
        assert tier.put(k, block(i))
    server.pause()
    try:
        got, dt = timed(tier.get, keys[0])
        assert got is None
        assert TIMEOUT * 0.8 <= dt < TIMEOUT + SLACK  # it waited for the reply, then gave up
        t0 = time.monotonic()
        for i, k in enumerate(keys):
            assert tier.get(k) is None
            assert tier.put(k, block(i)) is False
            assert tier.count_present(keys) == 0
        assert time.monotonic() - t0 < SLACK  # resting: no call waits
        time.sleep(RETRY_AFTER + 0.05)
        got, dt = timed(tier.count_present, keys)
        assert got == 0
        assert dt < TIMEOUT + SLACK
        got, dt = timed(tier.put, tkey(9), block(9, 1 << 20))
        assert got is False
        assert dt < SLACK  # resting again after the probe
    finally:
        server.resume()
    deadline = time.monotonic() + RETRY_AFTER + 2.0
    while tier.get(keys[1]) is None:
        assert time.monotonic() < deadline, "the tier did not recover"
        time.sleep(0.02)
    # No late reply of a timed-out request is taken for another one's.
    assert [tier.get(k) for k in keys] == [block(i) for i in range(4)]
    assert tier.count_present(keys) == 4
    st = tier.stats()
    assert st.corrupt == 0
    assert st.errors == 2


def test_unreachable_from_the_start():
    url = f"redis://127.0.0.1:{free_port()}/0"
    for tier in (fault_tier(url), fault_tier(url, cluster=True)):
        t0 = time.monotonic()
        assert tier.get(tkey(1)) is None
        assert tier.put(tkey(1), block(1)) is False
        assert tier.count_present([tkey(1), tkey(2)]) == 0
        tier.discard(tkey(1))
        assert tier.drain_removed() == []
        assert time.monotonic() - t0 < 2 * TIMEOUT + SLACK
        assert tier.stats().errors >= 1
        tier.close()


# --- threads ---------------------------------------------------------------------------------


def test_threads_put_get_concurrently(server):
    tier = RemoteTier(server.url, NS, secret=SECRET, timeout=10.0)
    n_threads, per, shared = 8, 40, 10

    def shared_block(j: int) -> bytes:
        return block(100_000 + j, 3000)

    def work(t: int) -> None:
        rng = random.Random(t)
        own = [tkey(t * per + j) for j in range(per)]
        for j, k in enumerate(own):
            data = block(t * per + j, rng.randint(1, 64 * 1024))
            assert tier.put(k, data)
            assert tier.get(k) == data
            s = tkey(10_000 + j % shared)
            assert tier.put(s, shared_block(j % shared))  # same key, same bytes from all threads
            assert tier.get(s) == shared_block(j % shared)
            assert tier.count_present(own[: j + 1]) == j + 1

    with ThreadPoolExecutor(n_threads) as pool:
        for f in [pool.submit(work, t) for t in range(n_threads)]:
            f.result()

    st = tier.stats()
    assert st.puts == st.gets == st.hits == n_threads * per * 2
    assert (st.dropped_puts, st.errors, st.corrupt, st.misses) == (0, 0, 0, 0)
    assert st.extra["lookups"] == n_threads * per
    # Every stored block reads back exactly, through a fresh tier and a raw client.
    fresh = RemoteTier(server.url, NS, secret=SECRET)
    raw = server.client()
    for t in range(n_threads):
        rng = random.Random(t)
        for j in range(per):
            k = tkey(t * per + j)
            data = block(t * per + j, rng.randint(1, 64 * 1024))
            assert fresh.get(k) == data
            entry = decode_entry(raw.get(fresh.key_name(k)), NS.ident(), 0, k.digest, secret=SECRET)
            assert bytes(entry.payload) == data
    assert all(fresh.get(tkey(10_000 + j)) == shared_block(j) for j in range(shared))
    assert raw.dbsize() == n_threads * per + shared


# --- cluster ---------------------------------------------------------------------------------


def test_cluster_round_trip_spreads_keys(cluster):
    tier = RemoteTier(cluster.url, NS, secret=SECRET, cluster=True, timeout=2.0, pipeline_batch=50)
    keys = [tkey(i) for i in range(300)]
    for i, k in enumerate(keys):
        assert tier.put(k, block(i, 1024))
    sizes = [node.client().dbsize() for node in cluster.nodes]
    assert sum(sizes) == 300
    assert min(sizes) > 0, sizes  # no hash tag: blocks spread over the nodes
    for k in keys[:30]:
        owner = cluster.nodes[cluster.owner(tier.key_name(k))]
        assert owner.client().exists(tier.key_name(k)) == 1
    assert all(tier.get(k) == block(i, 1024) for i, k in enumerate(keys))

    def exists_calls() -> int:
        stats = [n.client().info("commandstats") for n in cluster.nodes]
        return sum(int(s.get("cmdstat_exists", {}).get("calls", 0)) for s in stats)

    assert (
        tier.present_each([*keys[:5], tkey(999), *keys[5:10]]) == [True] * 5 + [False] + [True] * 5
    )
    before = exists_calls()
    assert tier.count_present(keys) == 300
    assert tier.count_present([*keys[:120], tkey(999), *keys[120:]]) == 120
    # Batches of 50: the second lookup ends with its third batch (keys 100..149, the
    # absent one at 120), the rest is never sent. Inside that batch each node's pipeline
    # goes in turn (ordered by its first key); once the absent key's node has answered,
    # the nodes after it are asked only for the keys before the absent one.
    third = [*keys[:120], tkey(999), *keys[120:]][100:150]
    owners = [cluster.owner(tier.key_name(k)) for k in third]
    sent, limit = 0, len(third)
    for node in dict.fromkeys(owners):
        mine = [i for i, o in enumerate(owners) if o == node and i < limit]
        sent += len(mine)
        if 20 in mine:
            limit = 20
    assert 21 <= sent <= 50
    assert exists_calls() - before == 300 + 100 + sent
    tier.discard(keys[0])
    assert tier.get(keys[0]) is None
    assert tier.drain_removed() == [keys[0]]
    tier.close()  # closes the connections; later calls reconnect
    assert tier.get(keys[1]) == block(1, 1024)
    st = tier.stats()
    assert (st.errors, st.corrupt, st.dropped_puts) == (0, 0, 0)


def test_cluster_node_killed_only_its_keys_miss(cluster):
    tier = fault_tier(cluster.url, cluster=True)
    keys = [tkey(i) for i in range(200)]
    for i, k in enumerate(keys):
        assert tier.put(k, block(i, 512))
    owners = [cluster.owner(tier.key_name(k)) for k in keys]
    dead = 0  # the node the URL names: the tier must find the others by itself
    assert owners.count(dead) > 0

    cluster.nodes[dead].kill()

    def check(tag: str) -> None:
        slowest = 0.0
        for i, k in enumerate(keys):
            want = None if owners[i] == dead else block(i, 512)
            got, dt = timed(tier.get, k)
            assert got == want, (tag, i, owners[i])
            slowest = max(slowest, dt)
        got, dt = timed(tier.count_present, keys)
        assert got == owners.index(dead)
        slowest = max(slowest, dt)
        got, dt = timed(tier.present_each, keys)
        assert got == [o != dead for o in owners]  # the other nodes' keys still answer
        slowest = max(slowest, dt)
        alive = [k for k, o in zip(keys, owners, strict=True) if o != dead]
        assert tier.count_present(alive) == len(alive)
        for i, k in enumerate(keys[:20]):
            got, dt = timed(tier.put, k, block(i, 512))
            assert got is (owners[i] != dead)
            slowest = max(slowest, dt)
        # The slot map is read again in the background: no call waits for it.
        assert slowest < TIMEOUT + SLACK, (tag, slowest)

    check("just killed")
    time.sleep(2.5)  # past cluster-node-timeout: the others mark the node failed
    check("marked failed")
    assert tier.stats().extra["servers_down"] == 1

    cluster.nodes[dead].restart()
    cluster.wait_ok()
    victim = owners.index(dead)
    deadline = time.monotonic() + RETRY_AFTER + 5.0
    while not tier.put(keys[victim], block(victim, 512)):
        assert time.monotonic() < deadline, "the tier did not recover"
        time.sleep(0.05)
    assert tier.get(keys[victim]) == block(victim, 512)
    assert tier.stats().extra["servers_down"] == 0


def test_cluster_tier_built_while_its_seed_is_down(cluster):
    seed = cluster.nodes[0]
    seed.kill()
    tier, dt = timed(fault_tier, seed.url, True)
    assert dt < TIMEOUT + SLACK  # the constructor tried once, refused, and did not raise
    assert tier.get(tkey(1)) is None
    assert tier.put(tkey(1), block(1)) is False
    assert tier.count_present([tkey(1)]) == 0
    seed.restart()
    cluster.wait_ok()
    deadline = time.monotonic() + RETRY_AFTER + 5.0
    while not tier.put(tkey(1), block(1)):  # the slot map is read again by itself
        assert time.monotonic() < deadline, "the tier never found the cluster"
        time.sleep(0.05)
    assert tier.get(tkey(1)) == block(1)
    assert all(tier.put(tkey(i), block(i)) for i in range(2, 50))
    assert tier.count_present([tkey(i) for i in range(1, 50)]) == 49


# --- with the tier manager: two serving nodes share one server ---------------------------


def _node(url: str, secret: bytes = SECRET) -> tuple[Any, Any, Any]:
    """One serving node: a manager, a CPU pool and a `TieredCache` over the remote tier."""
    from pagedkv import BlockManager
    from pagedkv.device.pool import KVCachePool
    from pagedkv.tiers.cache import TieredCache

    m = BlockManager(E2E_BLOCKS, E2E_BS, record_evictions=True)
    pool = KVCachePool(2, E2E_BLOCKS, E2E_BS, 2, 8, dtype="float16", device="cpu")
    tier = RemoteTier(
        url, E2E_NS, secret=secret, timeout=TIMEOUT, connect_timeout=TIMEOUT, retry_after=0.2
    )
    return m, pool, TieredCache(m, pool, [tier])


E2E_BS, E2E_BLOCKS = 4, 16
E2E_NS = Namespace("e2e-model", "2x2x8", "float16", E2E_BS)


def _kv(prefix: list[int]) -> np.ndarray:
    """K and V of the last token of `prefix`, a function of the whole prefix."""
    seed = hashlib.blake2b(np.asarray(prefix, dtype=np.int64).tobytes(), digest_size=8)
    rng = np.random.default_rng(int.from_bytes(seed.digest(), "little"))
    return rng.standard_normal((2, 2, 2, 8)).astype(np.float16)


def _admit(node: tuple[Any, Any, Any], sid: int, tokens: list[int]) -> int:
    """Allocate (demoting what it evicted), load, check what was loaded, compute the rest;
    the tokens loaded."""
    torch = pytest.importorskip("torch")
    m, pool, tc = node
    alloc = tc.allocate(sid, tokens)
    assert alloc is not None
    cached = tc.load(alloc)
    table = m.block_table(sid)
    for p in range(len(tokens)):
        b, o = table[p // E2E_BS], p % E2E_BS
        if p < cached:
            got = pool.buffer[:, :, b, o].numpy()
            np.testing.assert_array_equal(got, _kv(tokens[: p + 1]), err_msg=f"position {p}")
        else:
            pool.buffer[:, :, b, o] = torch.from_numpy(_kv(tokens[: p + 1]))
    return cached


def _evict_all(node: tuple[Any, Any, Any], first_sid: int) -> None:
    m, _, tc = node
    for i in range(5):
        _admit(node, first_sid + i, [1000 * (first_sid + i) + t for t in range(20)])
        m.free(first_sid + i)
    tc.flush()


def test_two_nodes_share_blocks_through_the_server(server):
    pytest.importorskip("torch")
    a, b = _node(server.url), _node(server.url)
    prompt = list(range(1, 23))  # 5 full blocks and 2 tokens
    assert _admit(a, 0, prompt) == 0
    a[0].free(0)
    _evict_all(a, 1)  # node A's cached prompt blocks go to the server
    stored = [e for e in a[2].drain_events() if type(e).__name__ == "BlockStored"]
    assert stored and {e.medium for e in stored} == {"REMOTE"}
    # Node B never saw the prompt: its 5 full blocks come from the server, exact.
    assert b[2].lookup(prompt) == (0, (20,))
    assert _admit(b, 0, prompt) == 20
    s = b[2].stats()
    assert (s.tier_hit_tokens, s.blocks_promoted, s.failed_loads) == ([20], 5, 0)
    # Node C was given another secret: none of A's blocks is present for it (its keys are
    # other keys), so it plans no load that would fail, and computes the prompt.
    c = _node(server.url, secret=b"another-trust-domain-secret!")
    assert c[2].lookup(prompt) == (0, (0,))
    assert _admit(c, 0, prompt) == 0
    s = c[2].stats()
    assert (s.tier_hit_tokens, s.blocks_promoted, s.failed_loads) == ([0], 0, 0)
    assert s.stores[0].corrupt == 0 and s.stores[0].gets == 0
    for node in (a, b, c):
        node[2].close()


def test_tier_manager_with_the_server_down(server):
    pytest.importorskip("torch")
    a = _node(server.url)
    prompt = list(range(1, 23))
    _admit(a, 0, prompt)
    a[0].free(0)
    server.kill()
    t0 = time.monotonic()
    _evict_all(a, 1)  # demotions are dropped, nothing raises
    assert a[2].lookup(prompt) == (0, (0,))
    assert _admit(a, 9, prompt) == 0  # computed again
    assert time.monotonic() - t0 < 5 * (TIMEOUT + SLACK)
    st = a[2].stats().stores[0]
    assert st.dropped_puts >= 5
    assert st.errors >= 1
    a[2].close()
