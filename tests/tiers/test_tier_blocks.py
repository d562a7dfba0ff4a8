"""Batched block copies between a pool and the host (`pagedkv.tiers.blocks`), and the
demotion budget of `TieredCache` (docs/tiers.md, "Demotion").

On the CPU pool the copies are checked against the pool's own per-block views; on a GPU
(tests marked `gpu`) the ordering is checked too: a copy-out issued before a kernel that
overwrites the block still reads the old KV, because the compute stream waits for the
copy's event.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv import BlockManager, InvalidArgumentError, KVCacheGroup  # noqa: E402
from pagedkv.device.pool import KVCachePool  # noqa: E402
from pagedkv.tiers import HostTier, Namespace  # noqa: E402
from pagedkv.tiers.blocks import block_nbytes, copy_in, copy_out  # noqa: E402
from pagedkv.tiers.cache import TieredCache  # noqa: E402

LAYERS, HEADS, DIM, BS = 3, 2, 8, 4


def _cuda() -> bool:
    from devices import cuda_ok as _cuda_ok

    return bool(_cuda_ok())


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not _cuda():
        pytest.skip("no CUDA device")
    return str(request.param)


def _pool(device: str, blocks: int = 10, **kw: Any) -> KVCachePool:
    pool = KVCachePool(LAYERS, blocks, BS, HEADS, DIM, dtype="bfloat16", device=device, **kw)
    pool.buffer.normal_()
    return pool


def _block_bytes(pool: KVCachePool, b: int) -> bytes:
    view = pool.buffer[:, :, b].contiguous().view(torch.uint8).cpu().numpy()
    return bytes(view.tobytes())


def test_copy_out_gathers_each_block_in_order(device: str) -> None:
    pool = _pool(device)
    blocks = [7, 2, 9, 0]
    copy = copy_out(pool, blocks)
    copy.wait()
    assert len(copy) == 4 and copy.nbytes == 4 * block_nbytes(pool)
    for i, b in enumerate(blocks):
        assert bytes(copy.block(i)) == _block_bytes(pool, b)


def test_copy_in_writes_each_block_and_nothing_else(device: str) -> None:
    pool = _pool(device)
    before = pool.buffer.clone()
    src = copy_out(pool, [1, 2])
    src.wait()
    copy_in(pool, [5, 8], [src.block(0), bytes(src.block(1))])
    assert torch.equal(pool.buffer[:, :, 5], before[:, :, 1])
    assert torch.equal(pool.buffer[:, :, 8], before[:, :, 2])
    untouched = [b for b in range(pool.num_blocks) if b not in (5, 8)]
    assert torch.equal(pool.buffer[:, :, untouched], before[:, :, untouched])


def test_bad_batches_raise_and_change_nothing() -> None:
    pool = _pool("cpu")
    before = pool.buffer.clone()
    one = bytes(copy_out(pool, [1]).block(0))
    with pytest.raises(InvalidArgumentError, match="block ids"):
        copy_out(pool, [3, 10])
    with pytest.raises(InvalidArgumentError, match="block ids"):
        copy_in(pool, [-1], [one])
    with pytest.raises(InvalidArgumentError, match="2 byte strings"):
        copy_in(pool, [3], [one, one])
    with pytest.raises(InvalidArgumentError, match="once"):
        copy_in(pool, [3, 3], [one, one])
    with pytest.raises(InvalidArgumentError, match="bytes"):
        copy_in(pool, [3, 4], [one, one[:-2]])
    assert torch.equal(pool.buffer, before)
    hybrid = [  # layers 0 and 2 full, layer 1 a window
        KVCacheGroup("full", num_layers=2),
        KVCacheGroup("sliding_window", window=2 * BS, num_layers=1),
    ]
    grouped = KVCachePool(
        LAYERS,
        6,
        BS,
        HEADS,
        DIM,
        dtype="bfloat16",
        device="cpu",
        groups=hybrid,
        layer_groups=[0, 1, 0],
    )
    with pytest.raises(InvalidArgumentError, match="null block"):
        copy_out(grouped, [0, 1])
    with pytest.raises(InvalidArgumentError, match="null block"):
        copy_in(grouped, [0], [bytes(block_nbytes(grouped))])


def test_block_0_of_a_pool_of_full_attention_groups_is_a_block() -> None:
    """With `groups=[full]` or `[full, full]` the manager has no null block and hands out
    block 0, so block 0 moves like any other (it raised as the null block before)."""
    for groups in (
        [KVCacheGroup("full", num_layers=LAYERS)],
        [KVCacheGroup("full", num_layers=2), KVCacheGroup("full", num_layers=1)],
    ):
        pool = KVCachePool(
            LAYERS,
            6,
            BS,
            HEADS,
            DIM,
            dtype="bfloat16",
            device="cpu",
            groups=groups,
            layer_groups=[i % len(groups) for i in range(LAYERS)],
        )
        assert not pool.null_block
        pool.buffer.normal_()
        data = bytes(copy_out(pool, [0]).block(0))
        copy_in(pool, [0], [bytes(copy_out(pool, [3]).block(0))])
        assert torch.equal(pool.buffer[:, :, 0], pool.buffer[:, :, 3])
        copy_in(pool, [0], [data])
        assert bytes(copy_out(pool, [0]).block(0)) == data


def test_the_copy_is_a_snapshot_taken_before_later_writes(device: str) -> None:
    """The next step's writes into a reused block must not reach the demoted bytes: on a
    GPU the write is issued on the compute stream right after the copy, before any wait."""
    pool = _pool(device, blocks=64)
    want = [_block_bytes(pool, b) for b in range(1, 64)]
    copy = copy_out(pool, list(range(1, 64)))
    pool.buffer[:, :, 1:64].fill_(3.0)  # the next step overwrites every block
    copy.wait()
    assert [bytes(copy.block(i)) for i in range(63)] == want


def _tiered(max_pending_bytes: int) -> tuple[BlockManager, KVCachePool, HostTier, TieredCache]:
    m = BlockManager(4, BS, record_evictions=True)
    pool = _pool("cpu", blocks=4)
    store = HostTier(1 << 20, Namespace("m", "l", "bfloat16", BS))
    return m, pool, store, TieredCache(m, pool, [store], max_pending_bytes=max_pending_bytes)


def _evict_two(m: BlockManager, tc: TieredCache) -> None:
    """Fill the 4 blocks with two cached prompts, then evict both with a third (through the
    tiers, which demote what that allocation evicted before it returns)."""
    for sid in (0, 1):
        assert m.allocate(sid, list(range(100 * sid, 100 * sid + 2 * BS))) == 0
        m.free(sid)
    alloc = tc.allocate(2, list(range(500, 500 + 4 * BS)))
    assert alloc is not None and alloc.hit_tokens == 0


def test_demotions_past_the_budget_are_dropped_whole() -> None:
    m, _p, store, tc = _tiered(max_pending_bytes=0)
    _evict_two(m, tc)
    tc.flush()
    s = tc.stats()
    assert s.dropped_demotions == 4 and s.blocks_demoted == 0
    assert store.stats().puts == 0
    m.check_invariants()
    tc.close()


def test_demotions_within_the_budget_reach_the_tier() -> None:
    m, pool, store, tc = _tiered(max_pending_bytes=4 * block_nbytes(_pool("cpu", blocks=1)))
    _evict_two(m, tc)
    tc.flush()
    s = tc.stats()
    assert s.dropped_demotions == 0 and s.blocks_demoted == 4
    assert store.stats().entries == 4
    with pytest.raises(InvalidArgumentError):
        TieredCache(m, pool, [store], max_pending_bytes=-1)
    tc.close()


def test_the_pending_bytes_return_to_zero() -> None:
    m, _p, _store, tc = _tiered(max_pending_bytes=1 << 20)
    _evict_two(m, tc)
    tc.flush()
    assert tc.stats().pending_bytes == 0  # the budget is free again
    assert np.isfinite(tc.stats().seconds_demote_copy)
    tc.close()
