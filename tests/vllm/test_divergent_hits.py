"""Per-group hits of a Mamba hybrid, pagedkv's vLLM manager against vLLM's own.

A full-attention group and a Mamba group ("align" mode) are seeded one block per step, then
blocks of one group are evicted so that the groups' own hits diverge (vLLM's
`find_longest_cache_hit_per_group`). A KV connector that restores Mamba states
(`supports_divergent_local_hybrid_hits`) takes the deeper full-attention hit through
`get_computed_blocks_for_connector` and loads the tokens past it; both managers must report
the same hits and hold the same table shapes (nulls where vLLM holds its null block) and the
same free blocks.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_objects import (
    KVCacheManager,
    VllmKVCacheManager,
    full_spec,
    make_manager,
    make_request,
)

BS = 16


def mamba_spec() -> MambaSpec:
    return MambaSpec(
        block_size=BS, shapes=((1, 1),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )


def build(cls: type[Any]) -> Any:
    return make_manager(cls, 100, [full_spec(BS), mamba_spec()], enable_caching=True)


def seed(m: Any, blocks: int) -> tuple[list[int], list[int]]:
    """Prefill `blocks` blocks one per step (each boundary's state is cached); free it.
    Returns the full-attention blocks and the state block of each step."""
    fill = make_request("fill", list(range(blocks * BS)), block_size=BS, max_tokens=1)
    computed, hit, _ = m.get_computed_blocks(fill)
    assert hit == 0
    states = []
    for i in range(blocks):
        m.allocate_slots(fill, BS, new_computed_blocks=computed if i == 0 else None)
        fill.num_computed_tokens += BS
        m.cache_blocks(fill, fill.num_computed_tokens)
        fa, st = m.get_block_ids(fill.request_id)
        states.append(st[i])
    m.free(fill)
    # A new scheduler step: vLLM's Mamba group defers hits on states cached this step.
    m.new_step_starts()
    return fa, states


def replay(blocks: int) -> Any:
    return make_request("replay", list(range(blocks * BS)), block_size=BS, max_tokens=1)


@pytest.mark.parametrize(
    ("evict", "replay_blocks", "hits"),
    [
        # Every state but block 0's evicted: full attention runs deeper.
        (lambda fa, st: {st[1], st[2], st[3]}, 6, (4 * BS, BS)),
        # The full-attention tail evicted, a deep state kept: the state runs deeper.
        (lambda fa, st: {fa[2], fa[3], st[1], st[2]}, 5, (2 * BS, 4 * BS)),
        # Nothing evicted: the groups agree.
        (lambda fa, st: set(), 5, (4 * BS, 4 * BS)),
    ],
    ids=["full-deeper", "state-deeper", "agreed"],
)
def test_per_group_hits_and_the_connector_hit_agree_with_vllm(
    evict: Any, replay_blocks: int, hits: tuple[int, int]
) -> None:
    out = []
    for cls in (VllmKVCacheManager, KVCacheManager):
        m = build(cls)
        assert isinstance(m.coordinator, HybridKVCacheCoordinator)
        fa, st = seed(m, 4)
        m.block_pool.evict_blocks(evict(fa, st))
        req = replay(replay_blocks)
        blocks, per_group = m.coordinator.find_longest_cache_hit_per_group(
            req.block_hashes, req.num_tokens - 1
        )
        assert per_group == hits, cls.__name__
        # Each group's blocks: nulls below what it needs, then its hit's blocks.
        shapes = [[b.is_null for b in g] for g in blocks]
        # The shared-prefix boundary (vLLM's junction pin for sparse Mamba retention) is
        # always 0 in pagedkv (docs/vllm.md): not compared.
        _, local, _, diverged = m.get_computed_blocks_for_connector(req)
        hybrid = m.get_computed_blocks(req)[1]
        out.append((shapes, local, diverged, hybrid))
    assert out[1] == out[0]


@pytest.mark.parametrize("loaded", [BS, 5])
def test_a_loaded_connector_hit_holds_what_vllm_holds(loaded: int) -> None:
    """The deeper full-attention hit with `loaded` tokens from the connector: the Mamba
    group holds nulls below the loaded boundary and fresh blocks from there, as vLLM's."""
    seen = []
    for cls in (VllmKVCacheManager, KVCacheManager):
        m = build(cls)
        fa, st = seed(m, 4)
        m.block_pool.evict_blocks({st[1], st[2], st[3]})
        req = replay(6)
        blocks, local, _, diverged = m.get_computed_blocks_for_connector(req)
        assert (local, diverged) == (4 * BS, True)
        new = req.num_tokens - local - loaded
        got = m.allocate_slots(
            req,
            new,
            num_new_computed_tokens=local,
            new_computed_blocks=blocks,
            num_external_computed_tokens=loaded,
        )
        assert got is not None, cls.__name__
        ids = m.get_block_ids(req.request_id)
        assert ids[0][:4] == fa
        seen.append(
            (
                [b == 0 for b in ids[0]],
                [b == 0 for b in ids[1]],
                m.block_pool.get_num_free_blocks(),
            )
        )
    assert seen[1] == seen[0]
    assert seen[0][1][:4] == [True] * 4


def test_without_a_load_the_connector_falls_back_to_the_hybrid_hit() -> None:
    """What vLLM's scheduler does when the connector loads nothing: `get_computed_blocks`,
    the boundary both groups serve. The deeper hit without a load is refused loudly (its
    resume boundary has no state), never served."""
    m = build(KVCacheManager)
    fa, st = seed(m, 4)
    m.block_pool.evict_blocks({st[1], st[2], st[3]})
    req = replay(6)
    deeper, local, _, _ = m.get_computed_blocks_for_connector(req)
    assert local == 4 * BS
    free = m.block_pool.get_num_free_blocks()
    with pytest.raises(RuntimeError, match="served 16 prefix tokens where the scheduler"):
        m.allocate_slots(req, req.num_tokens - local, local, deeper)
    assert m.block_pool.get_num_free_blocks() == free
    assert m.get_block_ids(req.request_id) == ([], [])
    blocks, hit, _ = m.get_computed_blocks(req)
    assert hit == BS
    assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
    fa_ids, st_ids = m.get_block_ids(req.request_id)
    assert fa_ids[0] == fa[0]
    assert st_ids[0] == st[0]  # block 0's state, the one the resume reads
