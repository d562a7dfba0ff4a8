"""Demotion is the duty of the call that evicts (docs/tiers.md, "Demotion"): every
`TieredCache` call that takes blocks copies out the cached blocks IT evicted before it
returns, so no later step, no other thread and no forgotten call can store one block's KV
under another block's digest.

The KV written for each position is a function of the whole token prefix up to it (and of
the group), so a block's bytes say exactly which prefix they belong to: a tier entry or a
loaded block holding another sequence's KV fails the byte comparison.

Test (a) is the bug the old global eviction log had: a prompt's cached blocks evicted by
`extend` of another sequence, that sequence's step writing its KV into them, and only THEN
the blocks copied out (the old `demote()` ran at some later point, such as the next
`load`), under the prompt's old digests with a valid checksum.
`test_the_old_deferred_demotion_fails_the_same_check` replays that order (a `TieredCache`
whose duties are deferred to the next `allocate`) and shows the byte checks of (a) catch
it.

The pool is the numpy `HostKVPool` (the tiers need no torch, so neither do these tests).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager, KVCacheGroup, hash_blocks
from pagedkv.tiers import Namespace, TierKey
from pagedkv.tiers.blocks import block_nbytes
from pagedkv.tiers.cache import Evicted, TierAllocation, TieredCache
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.host_pool import HostKVPool, swap_host_blocks

LAYERS, HEADS, DIM, BS = 2, 2, 8, 4
NS = Namespace("duties-model", f"{LAYERS}x{HEADS}x{DIM}", "float16", BS)


def _kv(prefix: list[int], rows: int, group: int = 0) -> np.ndarray:
    """[rows, 2, HEADS, DIM] float16 K and V of the last token of `prefix` in `group`."""
    key = np.asarray([group, *prefix], dtype=np.int64).tobytes()
    seed = hashlib.blake2b(key, digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(seed, "little"))
    return rng.standard_normal((rows, 2, HEADS, DIM)).astype(np.float16)


def _block_bytes(tokens: list[int], i: int, rows: int, group: int = 0) -> bytes:
    """The bytes block `i` of `tokens` must hold (the layout `copy_out` gathers)."""
    kv = [_kv(tokens[: i * BS + o + 1], rows, group) for o in range(BS)]
    return np.stack(kv, axis=2).tobytes()


def _groups(m: Any) -> int:
    return int(m.num_groups)


def _pool(blocks: int, *, layers: int = LAYERS, groups: Any = None) -> HostKVPool:
    return HostKVPool(layers, blocks, BS, HEADS, DIM, "float16", groups=groups)


def _write(m: Any, pool: HostKVPool, sid: int, tokens: list[int], start: int, end: int) -> None:
    """The step: compute (write) the KV of positions `start .. end` of `sid`, every group."""
    rows = pool.buffer.shape[0]
    for g in range(_groups(m)):
        table = m.block_table(sid, group=g)
        for p in range(start, end):
            b = table[p // BS]
            if not (pool.null_block and b == 0):
                pool.buffer[:, :, b, p % BS] = _kv(tokens[: p + 1], rows, g)


def _check(m: Any, pool: HostKVPool, sid: int, tokens: list[int], upto: int) -> None:
    """Positions below `upto` hold their own prefix's KV in every group's (non-null) block
    that the group still needs at `upto` (a window's blocks before it are not read)."""
    rows = pool.buffer.shape[0]
    kinds = m.groups or [KVCacheGroup("full")]
    for g in range(_groups(m)):
        table = m.block_table(sid, group=g)
        for p in range(kinds[g].skipped_tokens(upto) // BS * BS, upto):
            b = table[p // BS]
            if pool.null_block and b == 0:
                continue
            got = pool.buffer[:, :, b, p % BS]
            want = _kv(tokens[: p + 1], rows, g)
            np.testing.assert_array_equal(got, want, err_msg=f"seq {sid} group {g} pos {p}")


def _check_store(store: HostTier, tokens: list[int], rows: int, groups: int = 1) -> int:
    """Every entry the tier holds under a block digest of `tokens` holds that block's KV;
    returns how many it holds."""
    held = 0
    for g in range(groups):
        for i, d in enumerate(hash_blocks(tokens, BS)):
            data = store.get(TierKey(g, d))
            if data is not None:
                assert bytes(data) == _block_bytes(tokens, i, rows, g), f"group {g} block {i}"
                held += 1
    return held


class _DeferredDemotion(TieredCache):
    """The old order: a call's evictions are copied out only at the next demotion point
    (here the start of the next `allocate`), after the steps in between wrote the blocks:
    what the global log drained by a later `demote()` did."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owed: Evicted = []

    def _demote(self, evicted: Evicted) -> int:
        self._owed.extend(evicted)
        return 0

    def allocate(self, *args: Any, **kwargs: Any) -> TierAllocation | None:
        owed, self._owed = self._owed, []
        TieredCache._demote(self, owed)
        self.flush()
        return super().allocate(*args, **kwargs)


def _scenario(cls: type[TieredCache]) -> None:
    """(a): prompt P cached; `extend` of sequence Q evicts P's blocks and Q's step writes its
    KV into them; P allocated again loads from the tier: it must get P's KV."""
    m = BlockManager(8, BS, record_evictions=True)
    pool = _pool(8)
    store = HostTier(1 << 20, NS)
    tc = cls(m, pool, [store])
    prompt = [7, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]  # 4 full blocks and 1
    other = list(range(100, 128))  # 7 blocks
    a = tc.allocate(0, prompt)
    assert a is not None and tc.load(a) == 0
    _write(m, pool, 0, prompt, 0, len(prompt))
    m.free(0)  # 4 blocks cached, the partial one free: 4 free, 4 cached
    b = tc.allocate(1, other, num_new_tokens=16)  # the 4 free blocks: evicts nothing
    assert b is not None and tc.load(b) == 0
    assert m.num_cached_blocks == 4
    _write(m, pool, 1, other, 0, 16)
    assert tc.extend(1, 12) == []  # 3 more blocks: P's 3 oldest cached blocks, evicted
    assert m.num_cached_blocks == 1
    _write(m, pool, 1, other, 16, 28)  # the step overwrites them with Q's KV
    _check(m, pool, 1, other, 28)
    m.free(1)
    # The copy-out happened inside `extend`; the stores below run on worker threads: wait
    # for them, or the tier may not hold P's blocks yet (a miss, not this test's question).
    tc.flush()
    c = tc.allocate(2, prompt)  # P's first block still on the GPU, the rest in the tier
    assert c is not None and c.gpu_hit_tokens == 4 and c.tier_hit_tokens == (12,)
    cached = tc.load(c)
    assert cached == 16
    _check(m, pool, 2, prompt, cached)
    tc.flush()
    assert _check_store(store, prompt, LAYERS) >= 3
    _write(m, pool, 2, prompt, cached, len(prompt))
    m.check_invariants()
    tc.close()


def test_extend_evicting_a_cached_prompt_keeps_its_own_kv() -> None:
    _scenario(TieredCache)


def test_the_old_deferred_demotion_fails_the_same_check() -> None:
    """Teeth for (a): with the old order the blocks are copied out after Q's step wrote
    them, and the byte checks above see Q's KV under P's digests."""
    with pytest.raises(AssertionError, match="seq 2 group 0 pos 4"):
        _scenario(_DeferredDemotion)


def test_eight_threads_share_a_pool_and_load_only_their_own_kv() -> None:
    """(b): 8 threads allocate (through the tiers), load, check, write, extend and free
    their own prompts over one small pool, evicting each other's cached blocks all the
    time; every loaded block and every tier entry must hold the KV of its own prefix."""
    blocks = 64  # 8 threads hold at most 6 blocks each: every wait for room ends
    m = BlockManager(blocks, BS, record_evictions=True)
    pool = _pool(blocks)
    store = HostTier(400 * block_nbytes(pool), NS)
    tc = TieredCache(m, pool, [store], workers=2)
    errors: list[BaseException] = []
    loaded = [0] * 8
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        rng = np.random.default_rng(t)
        # Each thread's prompts: a few prefixes of its own (a GPU hit is never on a block
        # another thread is still computing), evicted by the other threads' allocations.
        prefixes = [[1000 * t + 50 * k + j for j in range(4 * (k + 2))] for k in range(3)]
        start.wait()
        try:
            for n in range(40):
                sid = 10_000 * t + n
                tail = [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 6)))]
                prompt = prefixes[n % 3] + tail
                first = min(len(prompt), 8)
                alloc = None
                while alloc is None:  # the pool is full of other threads' sequences
                    alloc = tc.allocate(sid, prompt, num_new_tokens=first)
                cached = tc.load(alloc)
                loaded[t] += cached - alloc.gpu_hit_tokens
                _check(m, pool, sid, prompt, cached)
                done = m.num_scheduled_tokens(sid)
                _write(m, pool, sid, prompt, cached, done)
                while done < len(prompt):  # chunked prefill: extend evicts too
                    k = min(4, len(prompt) - done)
                    if tc.extend(sid, k) is None:
                        continue
                    _write(m, pool, sid, prompt, done, done + k)
                    done += k
                _check(m, pool, sid, prompt, len(prompt))
                m.free(sid)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    tc.flush()
    for t in range(8):
        for k in range(3):
            _check_store(store, [1000 * t + 50 * k + j for j in range(4 * (k + 2))], LAYERS)
    s = tc.stats()
    assert s.blocks_demoted > 100 and sum(loaded) > 0 and s.blocks_promoted > 0
    assert m.stats().evictions == s.blocks_demoted + s.dropped_demotions
    m.check_invariants()
    tc.close()


GROUPS = [
    KVCacheGroup("full", num_layers=1),
    KVCacheGroup("sliding_window", window=8, num_layers=1),
]


def test_tiers_with_kv_cache_groups_round_trip_every_group() -> None:
    """(c): a hybrid manager's evicted blocks go below keyed by their group, and a prompt
    allocated again loads each group's blocks with that group's KV."""
    blocks = 24
    m = BlockManager(blocks, BS, record_evictions=True, groups=GROUPS)
    pool = _pool(blocks, layers=2, groups=GROUPS)
    rows = pool.buffer.shape[0]
    store = HostTier(1 << 20, NS)
    tc = TieredCache(m, pool, [store])
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]  # 4 full blocks and 2
    a = tc.allocate(0, prompt)
    assert a is not None and tc.load(a) == 0
    _write(m, pool, 0, prompt, 0, len(prompt))
    m.free(0)
    for i in range(1, 5):  # other prompts evict every cached block of `prompt`
        other = [1000 * i + t for t in range(20)]
        b = tc.allocate(i, other)
        assert b is not None
        _write(m, pool, i, other, tc.load(b), len(other))
        m.free(i)
    tc.flush()
    assert m.lookup(prompt) == 0
    assert _check_store(store, prompt, rows, groups=2) == 8, "4 blocks in each of 2 groups"
    c = tc.allocate(9, prompt)
    assert c is not None and c.tier_hit_tokens == (16,)
    assert {key.group for _, key, _ in c.plan} == {0, 1}
    cached = tc.load(c)
    assert cached == 16
    _check(m, pool, 9, prompt, cached)
    _write(m, pool, 9, prompt, cached, len(prompt))
    m.check_invariants()
    tc.close()


def test_each_call_gets_exactly_its_own_evictions_under_concurrency() -> None:
    """(d): 8 threads evict each other's cached blocks at once (prompts long enough that
    the core runs without the GIL); each call's `evicted` list names only blocks its own
    new sequence holds, with digests of cached prompts, and every eviction is reported to
    exactly one call."""
    bs, blocks = 16, 1200
    m = BlockManager(blocks, bs, record_evictions=True)
    prompts = {
        (t, k): [t * 1_000_000 + k * 10_000 + j for j in range(4100)]
        for t in range(8)
        for k in range(4)
    }
    digests = {d for p in prompts.values() for d in hash_blocks(p, bs)}
    reported = [0] * 8
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(t: int) -> None:
        start.wait()
        try:
            for n in range(24):
                sid = 1000 * t + n
                ev: list[tuple[int, int, bytes]] = []
                if m.allocate(sid, prompts[(t, n % 4)], evicted=ev) is None:
                    assert ev == [], "a call that does not fit evicts nothing"
                    continue
                table = set(m.block_table(sid))
                assert {b for b, _, _ in ev} <= table, "another call's eviction"
                assert all(g == 0 and d in digests for _, g, d in ev)
                assert len({b for b, _, _ in ev}) == len(ev)
                reported[t] += len(ev)
                m.free(sid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    assert sum(reported) == m.stats().evictions > 1000
    m.check_invariants()


@pytest.mark.parametrize("op", ["append", "append_batch", "step", "truncate", "swap_in"])
def test_every_block_taking_call_demotes_its_own_evictions(op: str) -> None:
    """Each `TieredCache` call that takes a block copies out the cached block it evicted
    before returning: the tier then holds the evicted prompt's own KV, whatever Q's step
    writes next."""
    m = BlockManager(8, BS, record_evictions=True, num_cpu_blocks=8)
    pool = _pool(8)
    swap = pool.swap_pool(8)
    store = HostTier(1 << 20, NS)
    tc = TieredCache(m, pool, [store])
    prompt = list(range(1, 18))  # 4 full blocks and 1
    other = list(range(100, 116))  # exactly the 4 free blocks once `prompt` is cached
    a = tc.allocate(0, prompt)
    assert a is not None
    _write(m, pool, 0, prompt, 0, len(prompt))
    m.free(0)
    b = tc.allocate(1, other)
    assert b is not None and m.num_free_blocks == 0 and m.num_cached_blocks == 4
    _write(m, pool, 1, other, 0, len(other))
    tc.fork(1, 2)  # shares: evicts nothing
    assert tc.stats().blocks_demoted == 0
    if op == "append":
        tc.append(1, [7])
    elif op == "append_batch":
        tc.append_batch([1, 2], [7, 8])
    elif op == "step":
        tc.step(m.running_batch([1]), [7])
    elif op == "truncate":
        m.free(1)  # the child alone holds the blocks, all of them registered
        tc.fork(2, 3)
        assert tc.truncate(3, 14) is not None  # block 3, shared and hashed, copied
    else:
        m.free(2)
        pairs = tc.swap_out(1)
        assert pairs is not None
        swap_host_blocks(pool, swap, np.asarray(pairs, dtype=np.int64))
        back = tc.swap_in(1)  # 4 GPU blocks: the free ones first, then evictions
        assert back is not None
        swap_host_blocks(swap, pool, np.asarray(back, dtype=np.int64))
    s = tc.stats()
    assert s.blocks_demoted == m.stats().evictions > 0, op
    pool.buffer.fill(0)  # the step overwrites every block now: the copies are already out
    tc.flush()
    assert _check_store(store, prompt, LAYERS) == s.blocks_demoted
    tc.close()


def test_these_checks_run_without_torch() -> None:
    """The tiers need no torch, so these tests must not either (they skipped without it):
    two of them, run in a process where `import torch` fails."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import test_tier_duties as t\n"
        "t.test_extend_evicting_a_cached_prompt_keeps_its_own_kv()\n"
        "t.test_tiers_with_kv_cache_groups_round_trip_every_group()\n"
        "assert 'torch' not in {m.split('.')[0] for m in sys.modules if sys.modules[m]}\n"
    )
    here = str(Path(__file__).parent)
    env_path = [here, *sys.path]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": ":".join(p for p in env_path if p), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
