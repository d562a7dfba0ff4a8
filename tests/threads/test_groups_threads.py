"""Stress tests of a manager with KV-cache groups: many Python threads on one manager.

Each thread owns its sequences and knows what each must hold (tokens, scheduled tokens,
swapped or not); all threads share a few system prompts, so hits cross threads, and the pool
is small, so calls run out (None) and windows release blocks as sequences grow. Every answer
is checked as it happens; at the end the manager's audit, block conservation and every
surviving sequence are checked. A grouped manager runs each call under one lock, so these
tests check that the binding and the core keep that promise under real Python threads.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass

import pytest

from pagedkv import (
    BlockManager,
    InvalidArgumentError,
    KVCacheGroup,
    SequenceSwappedError,
    UnknownSequenceError,
)

B = 4
GROUPS = [
    KVCacheGroup("full"),
    KVCacheGroup("sliding_window", window=8),
    KVCacheGroup("chunked_local", chunk=8),
    KVCacheGroup("state"),
]
SYSTEM = [list(range(100 * k, 100 * k + 4 * (k + 1))) for k in range(3)]


pytestmark = pytest.mark.usefixtures("fast_thread_switches")


@dataclass
class _Seq:
    tokens: list[int]
    sched: int
    swapped: bool = False


def _check_seq(m: BlockManager, sid: int, want: _Seq) -> None:
    assert m.num_tokens(sid) == len(want.tokens)
    assert m.num_scheduled_tokens(sid) == want.sched
    assert m.is_swapped(sid) == want.swapped
    if want.swapped:
        return
    tables = [m.block_table(sid, group=g) for g in range(len(GROUPS))]
    assert len({len(t) for t in tables}) == 1, "every group's table has one length"
    assert all(b != 0 for b in tables[0]), "full attention never skips a block"
    assert len(tables[0]) * B >= want.sched
    for t in tables[1:]:
        nulls = next((i for i, b in enumerate(t) if b != 0), len(t))
        assert all(b != 0 for b in t[nulls:]), f"nulls must lead: {t}"
    if want.sched:
        slots = [int(m.slot_mapping([sid], 1, group=g)[0]) for g in range(len(GROUPS))]
        p = want.sched - 1
        for g, s in enumerate(slots):
            assert s == tables[g][p // B] * B + p % B, "the newest token's slot is live"


def _worker(m: BlockManager, thread: int, ops: int, errors: list[BaseException]) -> None:
    rng = random.Random(thread)
    live: dict[int, _Seq] = {}
    next_id = thread << 32
    try:
        for _ in range(ops):
            op = rng.randrange(12)
            sid = rng.choice(list(live)) if live else None
            if sid is None or op < 3:
                tail = [rng.randrange(50) for _ in range(rng.randrange(1, 10))]
                prompt = rng.choice(SYSTEM) + tail
                k = rng.randrange(1, len(prompt) + 1)
                next_id += 1
                hit = m.allocate(next_id, prompt, num_new_tokens=k)
                if hit is not None:
                    assert hit % B == 0 and hit < len(prompt)
                    live[next_id] = _Seq(prompt, min(hit + k, len(prompt)))
                continue
            s = live[sid]
            if op == 3 and not s.swapped and s.sched < len(s.tokens):
                if m.extend(sid, 1) is not None:
                    s.sched += 1
            elif op in (4, 5) and not s.swapped and s.sched == len(s.tokens):
                t = rng.randrange(50)
                if m.append(sid, [t], lookahead=rng.randrange(2)) is not None:
                    s.tokens.append(t)
                    s.sched += 1
            elif op == 6:
                ready = [i for i, q in live.items() if not q.swapped and q.sched == len(q.tokens)]
                toks = [rng.randrange(50) for _ in ready]
                if ready and m.append_batch(ready, toks) is not None:
                    for i, t in zip(ready, toks, strict=True):
                        live[i].tokens.append(t)
                        live[i].sched += 1
            elif op == 7 and not s.swapped:
                n = len(s.tokens)
                try:
                    if m.truncate(sid, n) is not None:
                        pass
                except InvalidArgumentError:
                    pytest.fail("truncate to the current length is always allowed")
            elif op == 8:
                next_id += 1
                if s.swapped:
                    with pytest.raises(SequenceSwappedError):
                        m.fork(sid, next_id)
                else:
                    m.fork(sid, next_id)
                    live[next_id] = _Seq(list(s.tokens), s.sched)
            elif op == 9:
                if s.swapped:
                    if m.swap_in(sid) is not None:
                        s.swapped = False
                elif m.swap_out(sid) is not None:
                    s.swapped = True
            elif op == 10:
                got = m.lookup(s.tokens)
                assert got % B == 0 and got < len(s.tokens)
                m.can_allocate(s.tokens)
            else:
                m.free(sid, num_computed_tokens=rng.randrange(s.sched + 1))
                del live[sid]
                with pytest.raises(UnknownSequenceError):
                    m.num_tokens(sid)
            if sid in live:
                _check_seq(m, sid, live[sid])
        for sid, s in live.items():
            _check_seq(m, sid, s)
        m.free_batch(list(live))
    except BaseException as e:  # reported by the main thread
        errors.append(e)


@pytest.mark.parametrize("events", [False, True])
def test_threads_on_one_grouped_manager(events: bool) -> None:
    m = BlockManager(
        160, B, num_cpu_blocks=64, groups=GROUPS, enable_kv_events=events, watermark=0.0
    )
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_worker, args=(m, t, 1500, errors)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    m.check_invariants()
    s = m.stats()
    assert len(m) == 0 and s.used_blocks == 0
    assert s.free_blocks + s.cached_blocks == 159, "every block but the null one is back"
    assert s.free_cpu_blocks == 64
    assert s.prefix_hits > 0 and s.evictions > 0 and s.cow_copies > 0
    assert all(g.registered_blocks > 0 and g.hit_blocks > 0 for g in s.groups)
    assert m.reset_prefix_cache()
    assert m.num_free_blocks == 159


def test_a_raced_free_and_append_leave_one_consistent_outcome() -> None:
    """Either the append ran before the free, or it raised and changed nothing."""
    for rnd in range(200):
        m = BlockManager(32, B, groups=GROUPS[:2])
        m.allocate(0, list(range(7)))
        outcome: dict[str, object] = {}

        def append(m: BlockManager = m, outcome: dict[str, object] = outcome) -> None:
            try:
                outcome["append"] = m.append(0, [1])
            except UnknownSequenceError:
                outcome["append"] = "unknown"

        a = threading.Thread(target=append)
        f = threading.Thread(target=m.free, args=(0,))
        pair = [a, f] if rnd % 2 else [f, a]
        for t in pair:
            t.start()
        for t in pair:
            t.join()
        assert 0 not in m
        assert outcome["append"] == "unknown" or outcome["append"] == []
        m.check_invariants()
        s = m.stats()
        assert s.used_blocks == 0 and s.free_blocks + s.cached_blocks == 31
