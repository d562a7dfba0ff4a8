"""Tiers without torch and without bytes (docs/tiers.md, "In the simulator"):

- `DigestTier` keeps keys only, with a raw `HostTier`'s LRU rules: on random operations it
  answers every put, get and look-up as a `HostTier` of the same number of blocks does, and
  evicts the same keys;
- `HostKVPool` (numpy) moves a block's bytes out and back as `tiers.blocks` does for a torch
  CPU pool, with the same bytes (bfloat16 rounded as torch rounds it);
- a `TieredCache` without a pool (count-only) hits, demotes and promotes exactly as one with
  a pool and raw host tiers of the same size.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager, InvalidArgumentError
from pagedkv.tiers import HostTier, Namespace, TierKey
from pagedkv.tiers.blocks import block_nbytes, copy_in, copy_out, read_block, write_block
from pagedkv.tiers.cache import TieredCache
from pagedkv.tiers.digests import DigestTier
from pagedkv.tiers.entry import HEADER_BYTES
from pagedkv.tiers.host_pool import HostKVPool, swap_host_blocks, to_bfloat16_bits

BS = 4


def _key(i: int) -> TierKey:
    return TierKey(i % 2, i.to_bytes(4, "little") * 8)


def test_a_digest_tier_answers_as_a_raw_host_tier_of_as_many_blocks() -> None:
    rng = random.Random(7)
    block = 64
    ns = Namespace("m", "l", "float16", BS)
    for cap in (0, 1, 3, 17):
        host = HostTier(cap * (block + HEADER_BYTES), ns)
        digests = DigestTier(cap, block_bytes=block)
        data = bytes(block)
        for _ in range(3000):
            op = rng.randrange(4)
            keys = [_key(rng.randrange(40)) for _ in range(rng.randrange(1, 6))]
            if op == 0:
                assert digests.put(keys[0]) == host.put(keys[0], data)
            elif op == 1:
                got = host.get(keys[0])
                assert (digests.get(keys[0]) is None) == (got is None)
            elif op == 2:
                assert digests.count_present(keys) == host.count_present(keys)
            else:
                digests.discard(keys[0])
                host.discard(keys[0])
            assert digests.drain_removed() == host.drain_removed()
        a, b = digests.stats(), host.stats()
        for field in ("entries", "puts", "dropped_puts", "evictions", "gets", "hits", "misses"):
            assert getattr(a, field) == getattr(b, field), (cap, field)


def test_put_many_is_puts_in_order() -> None:
    one, many = DigestTier(5), DigestTier(5)
    keys = [_key(i % 8) for i in range(30)]
    for k in keys:
        one.put(k)
    assert many.put_many(keys) == 30
    assert one.drain_removed() == many.drain_removed()
    assert [one.count_present([k]) for k in keys] == [many.count_present([k]) for k in keys]
    assert DigestTier(0).put_many(keys) == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        DigestTier(-1)


def _filled_pool(blocks: int = 6) -> HostKVPool:
    pool = HostKVPool(2, blocks, BS, 2, 8, "bfloat16")
    rng = np.random.default_rng(0)
    for layer in range(2):
        k = rng.standard_normal((blocks * BS, 2, 8), dtype=np.float32)
        v = rng.standard_normal((blocks * BS, 2, 8), dtype=np.float32)
        pool.write(layer, k, v, np.arange(blocks * BS))
    return pool


def test_host_pool_blocks_out_and_back() -> None:
    pool = _filled_pool()
    assert block_nbytes(pool) == 2 * 2 * BS * 2 * 8 * 2
    copy = copy_out(pool, [3, 1])
    assert len(copy) == 2 and copy.nbytes == 2 * block_nbytes(pool)
    three, one = bytes(copy.block(0)), bytes(copy.block(1))
    assert three == read_block(pool, 3) and one == read_block(pool, 1)
    copy_in(pool, [0, 5], [three, one])
    assert read_block(pool, 0) == three and read_block(pool, 5) == one
    write_block(pool, 2, one)
    assert read_block(pool, 2) == one
    pool.copy_blocks(np.array([[2, 4]]))
    assert read_block(pool, 4) == one
    swap = pool.swap_pool(2)
    swap_host_blocks(pool, swap, np.array([[3, 1]]))
    assert read_block(swap, 1) == three
    with pytest.raises(InvalidArgumentError, match="block ids"):
        copy_out(pool, [6])
    with pytest.raises(InvalidArgumentError, match="bytes"):
        copy_in(pool, [0], [b"x"])
    with pytest.raises(InvalidArgumentError, match="dtype"):
        HostKVPool(1, 1, 1, 1, 1, "int4")


def test_host_pool_bytes_are_a_torch_cpu_pools() -> None:
    torch = pytest.importorskip("torch")
    from pagedkv.device.pool import KVCachePool

    rng = np.random.default_rng(1)
    k = (rng.standard_normal((24, 2, 8)) * 3).astype(np.float32)
    v = (rng.standard_normal((24, 2, 8)) * 3).astype(np.float32)
    slots = np.arange(24)
    mine = HostKVPool(1, 6, BS, 2, 8, "bfloat16")
    mine.write(0, k, v, slots)
    ref = KVCachePool(1, 6, BS, 2, 8, "bfloat16", "cpu")
    dt = torch.bfloat16
    ref.write(0, torch.from_numpy(k).to(dt), torch.from_numpy(v).to(dt), slots)
    for b in range(6):
        assert read_block(mine, b) == read_block(ref, b)
    bits = to_bfloat16_bits(k)
    torch_bits = torch.from_numpy(k).to(dt).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, torch_bits)


def _replay(pool: Any, stores: list[Any], seed: int) -> tuple[list[int], Any]:
    """Random prompts over a few shared prefixes on a 24-block manager through a
    TieredCache: the hit of each allocation and the final stats."""
    rng = random.Random(seed)
    m = BlockManager(24, BS, record_evictions=True)
    tc = TieredCache(m, pool, stores, workers=0, events=False)
    prefixes = [[rng.randrange(1000) for _ in range(BS * 6)] for _ in range(5)]
    hits = []
    live: list[int] = []
    for sid in range(200):
        tokens = np.asarray([*rng.choice(prefixes)[: BS * rng.randrange(1, 7)], sid], np.uint32)
        alloc = tc.allocate(sid, tokens)
        assert alloc is not None
        hits.append(tc.load(alloc))
        live.append(sid)
        if len(live) > 2 or rng.random() < 0.5:  # at most 3 live: 21 blocks of 24
            tc.free(live.pop(0))
    tc.close()
    return hits, tc.stats()


def test_a_count_only_tiered_cache_hits_as_one_with_bytes() -> None:
    ns = Namespace("m", "1x2x8", "bfloat16", BS)
    pool = HostKVPool(1, 24, BS, 2, 8)
    for cap in (4, 16):
        real = HostTier(cap * (block_nbytes(pool) + HEADER_BYTES), ns)
        hits_real, s_real = _replay(pool, [real], cap)
        hits_count, s_count = _replay(None, [DigestTier(cap)], cap)
        assert hits_real == hits_count
        assert s_real.tier_hit_tokens == s_count.tier_hit_tokens
        assert s_real.tier_hit_tokens[0] > 0
        assert (s_real.blocks_demoted, s_real.blocks_promoted) == (
            s_count.blocks_demoted,
            s_count.blocks_promoted,
        )
        assert s_count.bytes_demoted == 0 and s_real.bytes_demoted > 0


def test_workers_must_be_a_count() -> None:
    m = BlockManager(8, BS, record_evictions=True)
    with pytest.raises(InvalidArgumentError, match="workers"):
        TieredCache(m, None, [DigestTier(2)], workers=-1)
