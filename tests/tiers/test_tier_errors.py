"""`TieredCache` when something fails (issue 32, items 3 and 12).

- A tier whose hash settings differ from the manager's is refused when the cache is built,
  naming both; left out, they are the manager's.
- An error after the manager's call succeeded (a copy-out or a store that raises, in
  `allocate` or in `load`) frees the sequence with `num_computed_tokens=` its GPU hit, so no
  block it registered stays cached though nothing computed or loaded it: the same prompt then
  hits only what was really computed.
- A call that raises keeps its own exception when the copy-out of what it evicted raises
  too; the copy-out's is noted on it.

Runs on the numpy host pool: none of it needs torch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager, InvalidArgumentError, KVCacheGroup, hash_blocks
from pagedkv.errors import UnknownSequenceError
from pagedkv.tiers import Namespace
from pagedkv.tiers.cache import TieredCache
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.host_pool import HostKVPool

BS, BLOCKS = 4, 12
NS = Namespace("errors", "1x1x4", "float32", BS)


class Broken(RuntimeError):
    """The injected failure."""


def _cache(**kw: Any) -> tuple[Any, HostKVPool, HostTier, TieredCache]:
    m = BlockManager(BLOCKS, BS, record_evictions=True, **kw)
    pool = HostKVPool(1, BLOCKS, BS, 1, 4, "float32")
    store = HostTier(1 << 20, NS)
    return m, pool, store, TieredCache(m, pool, [store], workers=0)


def _fill(pool: HostKVPool, m: Any, sid: int, tokens: list[int]) -> None:
    """The step: each position's KV is its prefix's length and last token."""
    for p, b in enumerate(m.block_table(sid)):
        for o in range(BS):
            if p * BS + o < len(tokens):
                pool.buffer[0, :, b, o] = [p * BS + o, tokens[p * BS + o], 0, 0]


def _demote_prompt(m: Any, tc: TieredCache, pool: HostKVPool, prompt: list[int]) -> None:
    """Compute `prompt` once, then let other prompts push its blocks below the GPU."""
    a = tc.allocate(0, prompt)
    assert a is not None
    _fill(pool, m, 0, prompt)
    tc.free(0)
    for i in range(1, 4):
        other = [1000 * i + t for t in range(4 * BS)]
        b = tc.allocate(i, other)
        assert b is not None
        tc.free(i)
    assert m.lookup(prompt) == 0 and tc.lookup(prompt) == (0, (12,))


# ---- item 3: hash settings -----------------------------------------------------------------


def test_other_hash_settings_are_refused_when_built() -> None:
    m = BlockManager(BLOCKS, BS, record_evictions=True)
    pool = HostKVPool(1, BLOCKS, BS, 1, 4, "float32")
    store = HostTier(1 << 20, NS)
    with pytest.raises(InvalidArgumentError, match=r"hash_seed=1 is not the manager's hash_seed=0"):
        TieredCache(m, pool, [store], hash_seed=1)
    with pytest.raises(
        InvalidArgumentError, match=r"hash_algo='xxh3_128' is not the manager's hash_algo='sha256'"
    ):
        TieredCache(m, pool, [store], hash_algo="xxh3_128")
    TieredCache(m, pool, [store], hash_algo="sha256", hash_seed=0).close()  # the same: fine
    assert len(m) == 0 and store.stats().puts == 0


def test_the_managers_hash_settings_are_the_tiers() -> None:
    """Left out, the settings are the manager's: a manager with xxh3_128 and a seed round
    trips through the tiers (the cache used sha256 and seed 0, and every allocate raised)."""
    m, pool, _, tc = _cache(hash_algo="xxh3_128", hash_seed=7)
    prompt = list(range(1, 15))  # 3 full blocks and 2 tokens
    _demote_prompt(m, tc, pool, prompt)
    c = tc.allocate(9, prompt)
    assert c is not None and c.tier_hit_tokens == (12,)
    assert tc.load(c) == 12
    assert {k.digest for _, k, _ in c.plan} == set(
        hash_blocks(prompt, BS, hash_algo="xxh3_128", seed=7)[:3]
    )
    tc.close()


# ---- item 3: errors after the manager's call -------------------------------------------------


@pytest.mark.parametrize("where", ["load", "copy-out"])
def test_an_error_after_the_managers_call_leaves_nothing_uncomputed_cached(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, pool, store, tc = _cache()
    prompt = list(range(1, 15))
    _demote_prompt(m, tc, pool, prompt)
    unregistered = m.stats().unregistered_blocks
    if where == "load":

        def get(key: Any) -> bytes | None:
            raise Broken("a store that raises")

        monkeypatch.setattr(store, "get", get)
        c = tc.allocate(9, prompt)
        assert c is not None and 9 in m
        with pytest.raises(Broken):
            tc.load(c)
    else:
        # The copy-out of what the call evicted (run after every successful call) raises.
        monkeypatch.setattr(tc, "_demote", lambda evicted: (_ for _ in ()).throw(Broken("copy")))
        with pytest.raises(Broken):
            tc.allocate(9, prompt)
    assert 9 not in m, "the sequence is freed"
    # Its 3 tier blocks were registered at allocation and neither loaded nor computed: they
    # left the cache, so nothing serves them (a plain allocation hits nothing).
    assert m.stats().unregistered_blocks >= unregistered + 3
    assert m.lookup(prompt) == 0
    assert m.allocate(10, prompt) == 0
    m.check_invariants()


def test_a_load_that_raises_keeps_the_gpu_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU hit was computed before: it stays cached; only the tier's block, registered
    at allocation, leaves the cache."""
    m, pool, store, tc = _cache()
    prompt = list(range(1, 19))  # 4 full blocks and 2 tokens: 5 blocks
    a = tc.allocate(0, prompt)
    assert a is not None
    _fill(pool, m, 0, prompt)
    tc.free(0)  # 4 cached, 8 free; block 3 was released first: the first evicted
    b = tc.allocate(1, [500 + t for t in range(9 * BS)])  # 9 blocks: evicts exactly 1
    assert b is not None
    tc.free(1)
    assert tc.lookup(prompt) == (12, (4,))
    c = tc.allocate(2, prompt)
    assert c is not None and (c.gpu_hit_tokens, c.tier_hit_tokens) == (12, (4,))
    monkeypatch.setattr(store, "get", lambda key: (_ for _ in ()).throw(Broken("get")))
    with pytest.raises(Broken):
        tc.load(c)
    assert 2 not in m
    assert m.lookup(prompt) == 12, "the GPU hit stays, the unloaded block left"
    m.check_invariants()


# ---- item 12: the duty wrapper ---------------------------------------------------------------


def test_the_calls_own_exception_wins_with_the_copy_out_noted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call that raises, whose copy-out raises too: the call's exception propagates (it was
    masked by the copy-out's), and the copy-out's is in its notes, traceback included."""
    m, _, _, tc = _cache()

    def broken(evicted: Any) -> int:
        raise Broken("the copy-out failed")

    monkeypatch.setattr(tc, "_demote", broken)
    with pytest.raises(UnknownSequenceError) as info:
        tc.extend(12345, 1)  # not a sequence of the manager: the call itself raises
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "copy-out" in notes and "Broken: the copy-out failed" in notes
    assert "Traceback" in notes
    # A call that succeeds and whose copy-out raises: the copy-out's error is the error
    # (the call's effect stands: docs/tiers.md).
    assert m.allocate(7, [9, 9, 9]) == 0
    with pytest.raises(Broken):
        tc.append(7, [4])
    assert m.num_tokens(7) == 4


def test_allocate_keeps_its_own_exception_too(monkeypatch: pytest.MonkeyPatch) -> None:
    m, _, _, tc = _cache()
    monkeypatch.setattr(tc, "_demote", lambda evicted: (_ for _ in ()).throw(Broken("copy")))
    with pytest.raises(InvalidArgumentError) as info:
        tc.allocate(1, [1, 2, 3], lookahead=-1)
    assert "Broken: copy" in "\n".join(getattr(info.value, "__notes__", []))
    assert len(m) == 0


def test_hybrid_manager_error_paths_free_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with a window group: the error frees the sequence, its window entries too."""
    groups = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=8)]
    m = BlockManager(BLOCKS, BS, record_evictions=True, groups=groups)
    pool = HostKVPool(2, BLOCKS, BS, 1, 4, "float32", groups=groups)
    store = HostTier(1 << 20, NS)
    tc = TieredCache(m, pool, [store], workers=0)
    prompt = list(range(1, 15))
    a = tc.allocate(0, prompt)
    assert a is not None
    tc.free(0)
    for i in range(1, 5):
        b = tc.allocate(i, [1000 * i + t for t in range(9)])
        assert b is not None
        tc.free(i)
    c = tc.allocate(9, prompt)
    assert c is not None and c.hit_tokens > 0
    monkeypatch.setattr(store, "get", lambda key: (_ for _ in ()).throw(Broken("get")))
    with pytest.raises(Broken):
        tc.load(c)
    assert 9 not in m and m.lookup(prompt) == 0
    m.check_invariants()
    assert np.all(pool.buffer[:, :, 0] == 0)
