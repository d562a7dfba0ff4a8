"""`evict_blocks` racing allocations, hits, appends, forks and frees on a few hot blocks.

Worker threads allocate prompts that share a few system prompts (so most of their blocks are
hits on the same hot blocks), append, fork and free; an evictor thread keeps looking the
system prompts up (`lookup_blocks`, `allocation_cost`) and withdrawing exactly those hot
blocks, held or cached, plus random ids. Each answer is checked as it happens; at the end the
audit must pass, every event must be accounted for (each `BlockRemoved` is an eviction for
room or a withdrawal, each `BlockStored` a registration), and withdrawing every block must
empty the cache. Plain and with KV-cache groups.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest

from pagedkv import BlockManager, KVCacheGroup
from pagedkv.events import BlockRemoved, BlockStored

B = 4
SYSTEM = [list(range(100 * k, 100 * k + 3 * B)) for k in range(3)]
LAYOUTS: dict[str, list[KVCacheGroup] | None] = {
    "plain": None,
    "groups": [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=8)],
}


pytestmark = pytest.mark.usefixtures("fast_thread_switches")


def _worker(m: BlockManager, thread: int, ops: int, errors: list[BaseException]) -> None:
    rng = random.Random(thread)
    live: dict[int, int] = {}  # id -> tokens it holds
    next_id = thread << 32
    try:
        for _ in range(ops):
            op = rng.randrange(6)
            if op <= 2 or not live:
                prompt = rng.choice(SYSTEM) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
                hit = m.allocate(next_id, prompt)
                if hit is not None:
                    assert hit % B == 0 and hit <= len(prompt) - 1
                    live[next_id] = len(prompt)
                next_id += 1
            elif op == 3:
                sid = rng.choice(list(live))
                if m.append(sid, [rng.randrange(50)]) is not None:
                    live[sid] += 1
                assert m.num_tokens(sid) == live[sid]
            elif op == 4 and len(live) < 8:
                sid = rng.choice(list(live))
                m.fork(sid, next_id)
                live[next_id] = live[sid]
                next_id += 1
            else:
                sid = rng.choice(list(live))
                m.free(sid)
                del live[sid]
        for sid in live:
            m.free(sid)
    except BaseException as e:
        errors.append(e)


def _evictor(
    m: BlockManager, stop: threading.Event, removed: list[int], errors: list[BaseException]
) -> None:
    rng = random.Random(99)
    try:
        while not stop.is_set():
            prompt = [*rng.choice(SYSTEM), 7]
            hit, tables = m.lookup_blocks(prompt)
            assert len(tables) == m.num_groups and all(len(t) * B == hit for t in tables)
            cost = m.allocation_cost(prompt)
            assert cost[0] % B == 0 and cost[1] >= 1 and cost[2] >= 0
            ids = [b for t in tables for b in t if b != 0 or m.num_groups == 1]
            if rng.random() < 0.3:
                ids.append(rng.randrange(1, m.num_blocks))
            n = m.evict_blocks(ids)
            assert 0 <= n <= len(ids)
            removed.append(n)
    except BaseException as e:
        errors.append(e)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_evict_blocks_racing_hits_allocations_and_frees(layout: str) -> None:
    groups = LAYOUTS[layout]
    m = BlockManager(48, B, enable_kv_events=True, watermark=0.0, groups=groups)
    errors: list[BaseException] = []
    removed: list[int] = []
    events: list[Any] = []
    stop = threading.Event()
    workers = [threading.Thread(target=_worker, args=(m, t, 400, errors)) for t in range(1, 4)]
    evictor = threading.Thread(target=_evictor, args=(m, stop, removed, errors))
    evictor.start()
    for w in workers:
        w.start()
    while any(w.is_alive() for w in workers):
        events.extend(m.drain_events())  # the log stays short; order is per digest
        workers[0].join(timeout=0.01)
    for w in workers:
        w.join()
    stop.set()
    evictor.join()
    assert not errors, errors
    assert sum(removed) > 0, "the evictor withdrew something"
    m.check_invariants()
    st = m.stats()
    assert len(m) == 0 and st.used_blocks == 0
    assert st.unregistered_blocks == sum(removed)
    assert st.free_blocks + st.cached_blocks == m.num_blocks - (groups is not None)
    # Withdraw every block: the cache empties, each cached block is counted once.
    cached = st.cached_blocks
    assert m.evict_blocks(range(1, m.num_blocks)) + m.evict_blocks([0] if not groups else []) == (
        cached
    )
    m.check_invariants()
    assert m.num_cached_blocks == 0 and m.num_free_blocks == st.free_blocks + cached
    assert m.lookup_blocks(SYSTEM[0] + [1]) == (0, [[] for _ in range(m.num_groups)])
    events.extend(m.drain_events())
    stored = sum(1 for e in events if isinstance(e, BlockStored))
    gone = sum(1 for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU")
    st = m.stats()
    assert stored == st.registered_blocks
    assert gone == st.evictions + st.unregistered_blocks == stored
