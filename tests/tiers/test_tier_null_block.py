"""One null-block rule (issue 32, item 2): with `groups=[full]` or `[full, full]` the manager
has no null block and hands out block 0; the pool (`KVCachePool`, `HostKVPool`) and the tiers
built with those groups treat block 0 as a block too. Before, the pool took block 0 for the
null block: its writes were dropped, and `TieredCache.allocate`, demoting an evicted block 0,
raised after the manager's call had succeeded (the sequence stayed allocated, the KV was not
demoted)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager, KVCacheGroup, hash_blocks
from pagedkv.tiers import Namespace, TierKey
from pagedkv.tiers.cache import TieredCache
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.host_pool import HostKVPool

BS, HEADS, DIM, BLOCKS = 4, 2, 8, 8
NS = Namespace("null-block", f"x{HEADS}x{DIM}", "float32", BS)
FULL = KVCacheGroup("full")
LAYOUTS = {"full": [FULL], "full+full": [FULL, FULL]}


def _kv(prefix: list[int], group: int) -> np.ndarray:
    """[2, HEADS, DIM] K and V of the last token of `prefix` in `group`."""
    seed = hashlib.blake2b(bytes([group]) + np.asarray(prefix, np.int64).tobytes(), digest_size=8)
    rng = np.random.default_rng(int.from_bytes(seed.digest(), "little"))
    return rng.standard_normal((2, HEADS, DIM)).astype(np.float32)


def test_the_rule() -> None:
    """Exactly when some group is not full attention, as the manager (and vLLM) has it."""
    from pagedkv.groups import has_null_block

    assert (
        not has_null_block(None) and not has_null_block([FULL]) and not has_null_block([FULL] * 3)
    )
    for other in (
        KVCacheGroup("sliding_window", window=8),
        KVCacheGroup("chunked_local", chunk=8),
        KVCacheGroup("state"),
    ):
        assert has_null_block([FULL, other]) and has_null_block([other])
        m = BlockManager(4, BS, groups=[FULL, other])
        assert has_null_block(m.groups) and m.groups == (FULL, other)
        m.allocate(0, list(range(3)))
        assert 0 not in m.block_table(0), "the manager keeps block 0 back"
    for groups in LAYOUTS.values():
        m = BlockManager(4, BS, groups=groups)
        m.allocate(0, list(range(3)))
        assert m.block_table(0) == [0] and not has_null_block(m.groups)
        assert not HostKVPool(len(groups), 4, BS, 1, 4, "float32", groups=groups).null_block


def _pools(groups: list[KVCacheGroup], kind: str) -> Any:
    if kind == "numpy":
        return HostKVPool(len(groups), BLOCKS, BS, HEADS, DIM, "float32", groups=groups)
    pytest.importorskip("torch")
    from pagedkv.device.pool import KVCachePool

    return KVCachePool(
        len(groups),
        BLOCKS,
        BS,
        HEADS,
        DIM,
        dtype="float32",
        device="cpu",
        groups=groups,
        layer_groups=list(range(len(groups))),
    )


def _write(m: Any, pool: Any, sid: int, tokens: list[int], start: int) -> None:
    """The step: K/V of positions `start ..` of `sid` into layer g (group g's table)."""
    for g in range(m.num_groups):
        table = m.block_table(sid, group=g)
        for p in range(start, len(tokens)):
            b, o = table[p // BS], p % BS
            kv = _kv(tokens[: p + 1], g)
            if isinstance(pool.buffer, np.ndarray):
                pool.buffer[g, :, b, o] = kv
            else:
                import torch

                pool.write(
                    g, *(torch.from_numpy(kv[i : i + 1]) for i in (0, 1)), [b * BS + o], group=g
                )


def _read(pool: Any, g: int, b: int, o: int) -> np.ndarray:
    if isinstance(pool.buffer, np.ndarray):
        out: np.ndarray = pool.buffer[g, :, b, o]
        return out
    return np.stack([pool.key(g)[b, o].numpy(), pool.value(g)[b, o].numpy()])


@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_block_0_is_written_demoted_and_promoted(layout: str, kind: str) -> None:
    groups = LAYOUTS[layout]
    m = BlockManager(BLOCKS, BS, record_evictions=True, groups=groups)
    pool = _pools(groups, kind)
    store = HostTier(1 << 20, NS)
    tc = TieredCache(m, pool, [store], workers=0)
    prompt = [5, 3, 8, 1, 9, 2, 7, 4, 6]  # 2 full blocks and 1 token
    a = tc.allocate(0, prompt)
    assert a is not None and tc.load(a) == 0
    assert 0 in m.block_table(0), "block 0 is handed out"
    _write(m, pool, 0, prompt, 0)
    for g in range(len(groups)):  # written, not dropped: every position reads back
        for p, b in enumerate(m.block_table(0, group=g)[: len(prompt) // BS]):
            for o in range(BS):
                np.testing.assert_array_equal(
                    _read(pool, g, b, o), _kv(prompt[: p * BS + o + 1], g)
                )
    m.free(0)
    evicted_zero = False
    for i in range(1, 6):  # unrelated prompts evict every cached block of `prompt`
        other = [100 * i + t for t in range(9)]
        before = tc.stats().blocks_demoted
        b = tc.allocate(i, other)  # raised here when it evicted block 0
        assert b is not None and i in m
        evicted_zero |= 0 in m.block_table(i) and tc.stats().blocks_demoted > before
        _write(m, pool, i, other, tc.load(b))
        m.free(i)
    assert evicted_zero, "the scenario must evict block 0"
    assert m.lookup(prompt) == 0
    digests = hash_blocks(prompt, BS)
    for g in range(len(groups)):  # the tier holds block 0's KV (the prompt's first block)
        data = store.get(TierKey(g, digests[0]))
        assert data is not None
        want = np.stack([_kv(prompt[: o + 1], g) for o in range(BS)], axis=1)  # [2, BS, ...]
        rows = pool.buffer.shape[0]
        got = np.frombuffer(data, dtype=np.float32).reshape(rows, 2, BS, HEADS, DIM)
        if kind == "numpy":  # every layer's row: group g's row holds its KV
            np.testing.assert_array_equal(got[g], want)
        else:  # rows are shared: group g's KV is in row 0 of its block
            np.testing.assert_array_equal(got[0], want)
    c = tc.allocate(9, prompt)
    assert c is not None and c.tier_hit_tokens == (8,)
    assert tc.load(c) == 8
    for g in range(len(groups)):
        table = m.block_table(9, group=g)
        for p in range(8):
            got_kv = _read(pool, g, table[p // BS], p % BS)
            np.testing.assert_array_equal(got_kv, _kv(prompt[: p + 1], g), err_msg=f"{g} {p}")
    m.check_invariants()
    tc.close()
