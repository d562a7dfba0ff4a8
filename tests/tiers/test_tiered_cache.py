"""`TieredCache` end to end on the CPU pool: evicted blocks are demoted to a tier, a later
prompt with the same prefix loads them back, and every block then holds exactly the KV that
its token prefix gives (docs/tiers.md).

The "model" writes, for each token position, K and V that depend on the whole token prefix
up to it, so a block loaded from a tier is right only if it is the very block computed for
that prefix. Real stores (`HostTier`, `CompressedHostTier`) hold the bytes.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv import BlockManager, BlockStored, InvalidArgumentError, KVCacheGroup  # noqa: E402
from pagedkv.device.pool import KVCachePool  # noqa: E402
from pagedkv.tiers import Namespace, TierKey  # noqa: E402
from pagedkv.tiers.blocks import block_nbytes, read_block, write_block  # noqa: E402
from pagedkv.tiers.cache import TieredCache  # noqa: E402
from pagedkv.tiers.host import CompressedHostTier, HostTier  # noqa: E402

LAYERS, KV_HEADS, DIM, BS, BLOCKS = 2, 2, 8, 4, 16
NS = Namespace("test-model", f"{LAYERS}x{KV_HEADS}x{DIM}", "float16", BS)


def _kv(prefix: list[int]) -> np.ndarray:
    """[LAYERS, 2, KV_HEADS, DIM] float16 K and V of the last token of `prefix`."""
    seed = hashlib.blake2b(np.asarray(prefix, dtype=np.int64).tobytes(), digest_size=8)
    rng = np.random.default_rng(int.from_bytes(seed.digest(), "little"))
    return rng.standard_normal((LAYERS, 2, KV_HEADS, DIM)).astype(np.float16)


def _setup(stores: list[Any]) -> tuple[BlockManager, KVCachePool, TieredCache]:
    m = BlockManager(BLOCKS, BS, record_evictions=True)
    pool = KVCachePool(LAYERS, BLOCKS, BS, KV_HEADS, DIM, dtype="float16", device="cpu")
    return m, pool, TieredCache(m, pool, stores)


def _write(m: BlockManager, pool: KVCachePool, sid: int, tokens: list[int], start: int) -> None:
    """Compute (write) the KV of positions `start ..` of sequence `sid`."""
    table = m.block_table(sid)
    for p in range(start, len(tokens)):
        kv = torch.from_numpy(_kv(tokens[: p + 1]))
        b, o = table[p // BS], p % BS
        pool.buffer[:, :, b, o] = kv


def _check(m: BlockManager, pool: KVCachePool, sid: int, tokens: list[int], upto: int) -> None:
    """Every position below `upto` holds its prefix's KV."""
    table = m.block_table(sid)
    for p in range(upto):
        got = pool.buffer[:, :, table[p // BS], p % BS].numpy()
        np.testing.assert_array_equal(got, _kv(tokens[: p + 1]), err_msg=f"position {p}")


def _run(tc: TieredCache, m: BlockManager, pool: KVCachePool, sid: int, tokens: list[int]) -> int:
    """Admit a prompt the engine's way: allocate (which demoted what it evicted), load,
    compute the rest."""
    alloc = tc.allocate(sid, tokens)
    assert alloc is not None
    cached = tc.load(alloc)
    assert cached <= alloc.hit_tokens
    _check(m, pool, sid, tokens, cached)
    _write(m, pool, sid, tokens, cached)
    return cached


@pytest.mark.parametrize("tier", ["host", "compressed"])
def test_an_evicted_prefix_comes_back_from_the_tier(tier: str) -> None:
    store = HostTier(1 << 20, NS) if tier == "host" else CompressedHostTier(1 << 20, NS)
    m, pool, tc = _setup([store])
    prompt = list(range(1, 23))  # 5 full blocks and 2 tokens
    assert _run(tc, m, pool, 0, prompt) == 0
    m.free(0)
    # Fill the pool with other prompts: the cached blocks of `prompt` are evicted.
    for i in range(1, 6):
        other = [1000 * i + t for t in range(20)]
        _run(tc, m, pool, i, other)
        m.free(i)
    tc.flush()
    assert m.lookup(prompt) == 0, "the GPU no longer has it"
    gpu, below = tc.lookup(prompt)
    assert (gpu, below) == (0, (20,))
    cached = _run(tc, m, pool, 9, prompt)
    assert cached == 20, "5 blocks loaded from the tier"
    s = tc.stats()
    assert s.tier_hit_tokens == [20] and s.blocks_promoted == 5 and s.failed_loads == 0
    assert s.blocks_demoted >= 5 and s.bytes_promoted == 5 * block_nbytes(pool)
    stored = [e for e in tc.drain_events() if isinstance(e, BlockStored)]
    assert stored and {e.medium for e in stored} == {store.medium}
    tc.close()


def test_a_damaged_entry_stops_the_load_and_is_recomputed() -> None:
    store = HostTier(1 << 20, NS)
    m, pool, tc = _setup([store])
    prompt = list(range(1, 23))
    _run(tc, m, pool, 0, prompt)
    digests = m.block_hashes(0)
    m.free(0)
    for i in range(1, 6):
        _run(tc, m, pool, i, [1000 * i + t for t in range(20)])
        m.free(i)
    tc.flush()
    store.discard(TierKey(0, digests[2]))  # block 2 vanished from the tier
    alloc = tc.allocate(9, prompt)
    assert alloc is not None and alloc.tier_hit_tokens == (8,), "only blocks 0 and 1 remain"
    assert tc.load(alloc) == 8
    _write(m, pool, 9, prompt, 8)
    _check(m, pool, 9, prompt, len(prompt))
    tc.close()


def test_random_workload_serves_only_right_kv() -> None:
    """Many prompts over a few shared prefixes on a small pool: GPU hits, tier hits and
    recomputation mix, and every admitted sequence holds exactly its prefixes' KV."""
    rng = random.Random(5)
    m, pool, tc = _setup([HostTier(40 * block_nbytes_for_test(), NS)])
    prefixes = [[100 * k + t for t in range(4 * (k + 2))] for k in range(4)]
    live: list[int] = []
    hits = below = 0
    for sid in range(300):
        prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
        alloc = tc.allocate(sid, prompt)
        if alloc is None:
            m.free(live.pop(0))
            continue
        cached = tc.load(alloc)
        hits += alloc.gpu_hit_tokens
        below += cached - alloc.gpu_hit_tokens
        _check(m, pool, sid, prompt, cached)
        _write(m, pool, sid, prompt, cached)
        live.append(sid)
        while len(live) > 2:
            m.free(live.pop(0))
    assert hits > 0 and below > 0, "both GPU and tier hits happened"
    m.check_invariants()
    tc.close()


def block_nbytes_for_test() -> int:
    return 2 * LAYERS * BS * KV_HEADS * DIM * 2


def test_block_bytes_round_trip_and_sizes() -> None:
    pool = KVCachePool(LAYERS, 4, BS, KV_HEADS, DIM, dtype="bfloat16", device="cpu")
    pool.buffer.normal_()
    data = read_block(pool, 2)
    assert len(data) == block_nbytes(pool) == block_nbytes_for_test()
    write_block(pool, 1, data)
    assert torch.equal(pool.buffer[:, :, 1], pool.buffer[:, :, 2])
    with pytest.raises(InvalidArgumentError):
        write_block(pool, 1, data[:-1])


def test_refuses_what_it_cannot_serve() -> None:
    pool = KVCachePool(LAYERS, BLOCKS, BS, KV_HEADS, DIM, dtype="float16", device="cpu")
    store = HostTier(1 << 20, NS)
    with pytest.raises(InvalidArgumentError, match="at least one"):
        TieredCache(BlockManager(BLOCKS, BS, record_evictions=True), pool, [])
    with pytest.raises(InvalidArgumentError, match="record_evictions"):
        TieredCache(BlockManager(BLOCKS, BS), pool, [store])
    hybrid = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=2 * BS)]
    with pytest.raises(InvalidArgumentError, match="has no null block but the manager has one"):
        grouped = BlockManager(BLOCKS, BS, groups=hybrid, record_evictions=True)
        TieredCache(grouped, pool, [store])
    with pytest.raises(InvalidArgumentError, match="blocks"):
        TieredCache(BlockManager(BLOCKS + 1, BS, record_evictions=True), pool, [store])
    with pytest.raises(InvalidArgumentError, match="prefix caching"):
        m = BlockManager(BLOCKS, BS, record_evictions=True, enable_prefix_caching=False)
        TieredCache(m, pool, [store])
    # One full group is the manager without groups: the same blocks, no null block.
    one = BlockManager(BLOCKS, BS, groups=[KVCacheGroup("full")], record_evictions=True)
    TieredCache(one, pool, [store]).close()
