"""Soak: many operations concentrated on few hot blocks, Rust against the reference model.

- `test_soak_against_reference`: one thread drives `pagedkv.BlockManager` and
  `ReferenceBlockManager` side by side with a seeded RNG: release/revive cycles of the same
  hot prompts (thousands per block, past any small stamp or counter width), deep fork trees
  with copy-on-write appends, repeated `reset_prefix_cache`, and "floods" (an allocation that
  evicts a chosen number of cached blocks) followed by probes of every hot prompt, so the
  eviction order (least recently released first) shows in which prefixes still hit. Every
  result, the statistics and the events are compared after every operation;
  `check_invariants` runs on both every `AUDIT_EVERY` operations.
- `test_threaded_hot_block_soak`: threads hammer the same hot prompts (short and long, so
  some calls run without the GIL), each also stepping a `RunningBatch` of its resident
  sequences; audited at the end.

CI mode takes about a minute on 2 cores. `PAGEDKV_SOAK_SCALE` multiplies the sizes; the
`manual` versions (`pytest -m manual tests/threads/test_soak.py`) run 60 times longer: see
docs/soak.md.
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from pagedkv import BlockManager
from pagedkv_reference import ReferenceBlockManager

SCALE = float(os.environ.get("PAGEDKV_SOAK_SCALE", "1"))
SLOW = 60  # the slow versions run this many times longer (about an hour at scale 1)
B = 16
NUM_BLOCKS = 4096  # large enough that stale LRU records of hot blocks are not compacted away
AUDIT_EVERY = 2000
HOT_BLOCKS = [1, 2, 4, 1, 3, 4]  # full blocks of each hot prompt (+ 1 token)
HOT = len(HOT_BLOCKS)
BURST = 2300  # consecutive release/revive cycles of one hot prompt (past an 11-bit stamp)


def _hot_prompts() -> list[list[int]]:
    """Distinct first tokens: the hot prompts share no block."""
    rng = random.Random(99)
    return [
        [1000 + i] + [rng.randrange(50_000) for _ in range(n * B)] for i, n in enumerate(HOT_BLOCKS)
    ]


class _SideBySide:
    """Both managers, one call at a time; every result must be equal."""

    def __init__(self, **kw: Any) -> None:
        kw = {"hash_algo": "xxh3_128", "enable_kv_events": True, "watermark": 0.0, **kw}
        self.rust = BlockManager(NUM_BLOCKS, B, **kw)
        self.ref = ReferenceBlockManager(NUM_BLOCKS, B, **kw)
        self.ops = 0
        self.audits = 0
        self.log: list[str] = []

    def call(self, method: str, *args: Any, **kw: Any) -> Any:
        self.ops += 1
        self.log.append(f"{method}{args!r}")
        del self.log[:-20]
        got = getattr(self.rust, method)(*args, **kw)
        want = getattr(self.ref, method)(*args, **kw)
        if isinstance(want, np.ndarray):
            got, want = got.tolist(), want.tolist()
        assert got == want, self._where(f"{method}: rust {got!r}, reference {want!r}")
        return want

    def _where(self, msg: str) -> str:
        return f"{msg} at operation {self.ops}; last calls: " + "; ".join(self.log)

    def compare_state(self) -> None:
        r, f = self.rust, self.ref
        got, want = r.stats().as_dict(), f.stats().as_dict()
        assert got == want, self._where(f"stats: rust {got}, reference {want}")
        assert r.drain_events() == f.drain_events(), self._where("events differ")

    def audit(self) -> None:
        self.audits += 1
        try:
            self.rust.check_invariants()
        except AssertionError as e:
            raise AssertionError(self._where(f"rust check_invariants: {e}")) from None
        self.ref.check_invariants()


def _soak(cycles: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    hot = _hot_prompts()
    m = _SideBySide()
    next_id = 0
    releases = [0] * HOT  # cycles that released each hot prompt's blocks
    floods = resets = forks = bursts = 0

    def new_id() -> int:
        nonlocal next_id
        next_id += 1
        return next_id

    def probe_all() -> None:
        """Allocate every hot prompt (hits show which survived), then free them all."""
        ids = []
        for i in rng.sample(range(HOT), HOT):
            sid = new_id()
            m.call("allocate", sid, hot[i])
            ids.append(sid)
        for sid in ids:
            m.call("free", sid)

    def flood() -> None:
        """A block-hungry sequence with no full block (nothing of it is cached later) that
        evicts a random number of the oldest cached blocks; then every hot prompt is probed:
        which of them still hit shows the eviction order."""
        nonlocal floods
        want = m.ref.num_free_blocks + rng.randrange(m.ref.num_cached_blocks + 1)
        sid = new_id()
        m.call("allocate", sid, [7], lookahead=max(1, want * B - 1))
        m.call("free", sid)
        probe_all()
        floods += 1

    for c in range(cycles):
        if c % 1500 == 750:
            # A burst: the same single-block prompt released and revived BURST times in a row
            # (few records queued, so stale ones are not compacted away), then an audit and
            # a flood that must evict in least-recently-released order.
            i = rng.choice([k for k, n in enumerate(HOT_BLOCKS) if n == 1])
            for _ in range(BURST):
                sid = new_id()
                m.call("allocate", sid, hot[i])
                m.call("free", sid)
            releases[i] += BURST
            bursts += 1
            m.compare_state()
            flood()
            m.compare_state()
            m.audit()
        i = min(int(rng.expovariate(1.5)), HOT - 1)  # prompt 0 hottest
        root = new_id()
        m.call("allocate", root, hot[i] + [rng.randrange(50_000) for _ in range(rng.randrange(3))])
        live = [root]
        kind = rng.random()
        if kind < 0.25:  # a deep fork tree, copy-on-write appends into the shared tail block
            for _ in range(rng.randrange(2, 12)):
                child = new_id()
                m.call("fork", rng.choice(live[-3:]), child)
                live.append(child)
                forks += 1
            for sid in rng.sample(live, min(len(live), 4)):
                if m.ref.num_tokens(sid) % B < B - 2:  # never fills a block: nothing new cached
                    m.call("append", sid, [rng.randrange(50_000)])
        rng.shuffle(live)
        for sid in live:
            m.call("free", sid)
        releases[i] += 1
        if rng.random() < 0.002:
            m.call("reset_prefix_cache")
            resets += 1
        if rng.random() < 0.01:
            flood()
        m.compare_state()
        if (c + 1) % AUDIT_EVERY == 0:
            m.audit()
    m.audit()
    return {
        "operations": m.ops,
        "cycles": cycles,
        "hottest_prompt_cycles": max(releases),
        "forks": forks,
        "bursts": bursts,
        "floods": floods,
        "resets": resets,
        "audits": m.audits,
    }


def _report(name: str, figures: dict[str, int], seconds: float) -> None:
    shown = ", ".join(f"{k}={v}" for k, v in figures.items())
    print(f"\n[soak] {name}: {shown}, {seconds:.1f} s", file=sys.stderr)


@pytest.mark.parametrize("seed", [1, 2])
def test_soak_against_reference(seed: int) -> None:
    t0 = time.perf_counter()
    figures = _soak(int(6000 * SCALE), seed)
    _report(f"side by side, seed {seed}", figures, time.perf_counter() - t0)
    # The hottest prompt's blocks went through thousands of release/revive cycles.
    assert figures["hottest_prompt_cycles"] > 2100 * min(SCALE, 1.0)
    assert figures["floods"] > 0 and figures["audits"] > 1


@pytest.mark.slow
@pytest.mark.manual
def test_soak_against_reference_long() -> None:
    t0 = time.perf_counter()
    figures = _soak(int(6000 * SCALE * SLOW), 3)
    _report("side by side, long", figures, time.perf_counter() - t0)
    assert figures["audits"] > 1


# ------------------------------------------------------------------ threads on hot blocks


@pytest.fixture
def _fast_switches() -> Iterator[None]:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def _threaded(ops_per_thread: int, threads: int = 6) -> dict[str, int]:
    m = BlockManager(1024, B, hash_algo="xxh3_128", num_cpu_blocks=64)
    hot = _hot_prompts()
    long_hot = [np.asarray(h + list(range(4096)), dtype=np.uint32) for h in hot[:2]]
    barrier = threading.Barrier(threads)
    errors: list[str] = []
    done = [0] * threads

    def worker(t: int) -> None:
        rng = random.Random(t)
        base = (t + 1) * 10_000_000
        mine: list[int] = []
        # Each thread also decodes its resident sequences through a RunningBatch; `inb` mirrors
        # its membership (a swapped or freed sequence leaves it first).
        batch = m.running_batch()
        inb: set[int] = set()

        def join(sid: int) -> None:
            batch.add([sid])
            inb.add(sid)

        def leave(ids: list[int]) -> None:
            gone = [s for s in ids if s in inb]
            if gone:
                batch.remove(gone)
                inb.difference_update(gone)

        try:
            barrier.wait()
            for j in range(ops_per_thread):
                r = rng.random()
                if r < 0.45 or not mine:
                    sid = base + j
                    p: Any = rng.choice(long_hot) if rng.random() < 0.05 else rng.choice(hot)
                    if m.allocate(sid, p) is not None:
                        mine.append(sid)
                        join(sid)
                elif r < 0.6:
                    parent = rng.choice(mine)
                    if not m.is_swapped(parent):
                        m.fork(parent, base + j)
                        mine.append(base + j)
                        join(base + j)
                elif r < 0.65:
                    sid = rng.choice(mine)
                    if not m.is_swapped(sid):
                        m.append(sid, [rng.randrange(50_000)])
                elif r < 0.7:
                    ids = batch.seq_ids
                    out = batch.step(np.full(len(ids), rng.randrange(50_000), dtype=np.uint32))
                    if out is not None:
                        assert len(out[0]) == len(ids) and sorted(ids) == sorted(inb)
                elif r < 0.75:
                    sid = rng.choice(mine)
                    if not m.is_swapped(sid):
                        leave([sid])
                        m.swap_out(sid)
                        if not m.is_swapped(sid):  # no CPU room: still resident
                            join(sid)
                    elif m.swap_in(sid) is not None:  # None when the GPU is full
                        join(sid)
                else:
                    sid = mine.pop(rng.randrange(len(mine)))
                    leave([sid])
                    m.free(sid)
                if len(mine) > 12:
                    leave(mine[:6])
                    m.free_batch(mine[:6])
                    del mine[:6]
                done[t] += 1
            leave(mine)
            m.free_batch(mine)
            assert len(batch) == 0
        except BaseException:
            errors.append(traceback.format_exc())

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join(timeout=3600)
        assert not th.is_alive(), "a soak thread hung"
    assert not errors, errors[0]
    m.check_invariants()
    st = m.stats()
    assert len(m) == 0 and st.used_blocks == 0, st
    assert st.free_blocks + st.cached_blocks == m.num_blocks, st
    assert st.free_cpu_blocks == st.num_cpu_blocks, st
    assert st.prefix_hits > 0, st
    assert m.reset_prefix_cache()
    assert m.num_free_blocks == m.num_blocks
    m.check_invariants()
    return {"operations": sum(done), "threads": threads, "prefix_hits": st.prefix_hits}


@pytest.mark.usefixtures("_fast_switches")
def test_threaded_hot_block_soak() -> None:
    t0 = time.perf_counter()
    figures = _threaded(int(100_000 * SCALE))
    _report("threads", figures, time.perf_counter() - t0)


@pytest.mark.slow
@pytest.mark.manual
@pytest.mark.usefixtures("_fast_switches")
def test_threaded_hot_block_soak_long() -> None:
    t0 = time.perf_counter()
    figures = _threaded(int(100_000 * SCALE * SLOW))
    _report("threads, long", figures, time.perf_counter() - t0)


# ------------------------------------------------------------------ the refcount limit


@pytest.mark.slow
@pytest.mark.manual
def test_refcount_limit_full_size() -> None:
    """A block has at most 2**20 - 1 holders: one more by `fork` or by a prefix hit raises
    RefcountOverflowError and changes nothing. Needs 2**20 - 1 sequences (about 3 s and
    600 MB), hence `manual`; rust/core/tests/limits.rs checks the same limit in CI."""
    from pagedkv.errors import RefcountOverflowError

    limit = (1 << 20) - 1
    m = BlockManager(64, 4, enable_kv_events=True)
    prompt = list(range(9))
    assert m.allocate(0, prompt) == 0
    for child in range(1, limit):
        m.fork(0, child)
    m.check_invariants()
    before, table, events = m.stats(), m.block_table(0), m.drain_events()
    assert len(m) == limit and events
    with pytest.raises(RefcountOverflowError):
        m.fork(0, limit)
    with pytest.raises(RefcountOverflowError):
        m.allocate(limit + 1, prompt[:5])  # a prefix hit on block table[0]
    assert limit not in m and limit + 1 not in m
    assert m.stats() == before and m.block_table(0) == table and m.drain_events() == []
    m.check_invariants()
    m.free(1)
    assert m.allocate(limit + 1, prompt[:5]) == 4
    m.check_invariants()
