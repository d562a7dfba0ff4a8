"""The manager's bounded event queue and its snapshot (docs/events.md, "Bounded queues"): the
capacity at and past its limit, a refused drain that changes nothing, a snapshot that is the
fold of every event and restarts the queue, bad capacities, and threads that overflow the
queue while a consumer follows it by drains and snapshots and ends with the cached set."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from pagedkv import BlockManager, hash_blocks
from pagedkv.errors import InvalidArgumentError, KVEventsOverflowError
from pagedkv.events import (
    DEFAULT_EVENT_CAPACITY,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from pagedkv.tiers.event_queue import EventQueue
from pagedkv_reference import ReferenceBlockManager

B = 4
Key = tuple[str | None, int, bytes]


def fold(state: dict[Key, BlockStored], events: list[KVEvent]) -> None:
    """Apply events as a router does (one block per manager event)."""
    for e in events:
        if isinstance(e, BlockStored):
            assert len(e.block_hashes) == 1
            state[(e.medium, e.group_idx, e.block_hashes[0])] = e
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                state.pop((e.medium, e.group_idx, h), None)
        else:
            assert isinstance(e, AllBlocksCleared)
            state.clear()


def gpu_cached(m: BlockManager, prompts: list[list[int]]) -> set[bytes]:
    """The digests of `prompts`' blocks that the idle manager holds cached."""
    out: set[bytes] = set()
    for p in prompts:
        out |= set(hash_blocks(p, B)[: m.lookup(p) // B])
    return out


def test_capacity_at_and_one_past_its_limit() -> None:
    m = BlockManager(64, B, enable_kv_events=True)
    m.set_kv_event_capacity(3)
    m.allocate(1, list(range(3 * B)))  # 3 BlockStored: exactly full
    s = m.kv_event_queue_stats()
    assert (s.queued, s.capacity, s.dropped, s.overflows, s.blocks) == (3, 3, 0, 0, 3)
    assert len(m.drain_events()) == 3
    m.allocate(2, list(range(100, 100 + 4 * B)))  # 4: one past
    s = m.kv_event_queue_stats()
    assert (s.queued, s.dropped, s.overflows, s.blocks) == (0, 4, 1, 7)
    with pytest.raises(KVEventsOverflowError, match="capacity of 3 events and 4 events"):
        m.drain_events()
    assert m.kv_event_queue_stats() == s, "a refused drain changes nothing"
    m.free(1)  # cached: no event (the blocks stay registered)
    snap = m.kv_event_snapshot()
    assert [e.block_hashes[0] for e in snap] == hash_blocks(list(range(3 * B)), B) + hash_blocks(
        list(range(100, 100 + 4 * B)), B
    )
    assert snap[0].parent_block_hash is None and snap[3].parent_block_hash is None
    assert snap[1].parent_block_hash == snap[0].block_hashes[0]
    assert snap[1].token_ids == list(range(B, 2 * B)) and snap[1].block_size == B
    assert m.drain_events() == [], "the snapshot restarts the queue"
    m.free(2)
    assert m.reset_prefix_cache()
    assert m.drain_events() == [AllBlocksCleared()]
    assert m.kv_event_snapshot() == []
    s = m.kv_event_queue_stats()
    assert (s.dropped, s.overflows, s.blocks) == (4, 1, 0), "tallies stay"


def test_the_default_bound_at_and_one_past_its_limit() -> None:
    """Issue 32, item 13: without `set_kv_event_capacity` the queue holds
    `DEFAULT_EVENT_CAPACITY` events (the publisher's bound); the next one overflows as any
    bounded queue does (counted, drains refused until a snapshot). Before, the default was
    unbounded and events nobody drained grew without end. The reference agrees."""
    n = DEFAULT_EVENT_CAPACITY
    for m in (
        BlockManager(n + 8, 1, enable_kv_events=True),
        ReferenceBlockManager(n + 8, 1, enable_kv_events=True),
    ):
        m.allocate(1, list(range(n)))  # n full blocks of one token: exactly full
        s = m.kv_event_queue_stats()
        assert (s.queued, s.capacity, s.dropped, s.overflows) == (n, n, 0, 0), type(m)
        m.allocate(2, [n + 5])  # one more BlockStored: one past
        s = m.kv_event_queue_stats()
        assert (s.queued, s.dropped, s.overflows, s.blocks) == (0, n + 1, 1, n + 1), type(m)
        with pytest.raises(KVEventsOverflowError):
            m.drain_events()
        m.free(1)
        m.free(2)
        assert m.reset_prefix_cache()
        assert m.kv_event_snapshot() == []  # the cleared set; the queue restarts
        assert m.drain_events() == []
        assert m.kv_event_queue_stats().capacity == n


def test_bad_capacities_and_disabled_events_raise_and_change_nothing() -> None:
    m = BlockManager(16, B, enable_kv_events=True)
    for bad in (0, -1, 2**64, 1.5, "8", True):
        with pytest.raises(InvalidArgumentError, match="capacity"):
            m.set_kv_event_capacity(bad)  # type: ignore[arg-type]
    assert m.kv_event_queue_stats().capacity == DEFAULT_EVENT_CAPACITY
    m.set_kv_event_capacity(5)
    m.set_kv_event_capacity(None)
    assert m.kv_event_queue_stats().capacity is None
    off = BlockManager(16, B)
    for call in (off.kv_event_snapshot, off.kv_event_queue_stats):
        with pytest.raises(InvalidArgumentError, match="enable_kv_events=True"):
            call()
    with pytest.raises(InvalidArgumentError, match="enable_kv_events=True"):
        off.set_kv_event_capacity(4)
    assert off.drain_events() == []


def test_snapshot_equals_the_fold_of_every_event_on_a_random_workload() -> None:
    """One manager with swaps (CPU copies), evictions, withdrawals and resets: the snapshot
    at any point is the fold of all events so far, and lists parents first."""
    rng = random.Random(5)
    m = BlockManager(48, B, num_cpu_blocks=24, enable_kv_events=True)
    state: dict[Key, BlockStored] = {}
    live: list[int] = []
    for r in range(600):
        p = [rng.randrange(6) * 1000 + i for i in range(rng.randrange(B, 5 * B))]
        if m.allocate(r, p) is not None:
            live.append(r)
        for s in list(live):
            op = rng.random()
            if op < 0.1 and m.swap_out(s) is not None and m.swap_in(s) is None:
                live.remove(s)
                m.free(s)
            elif op < 0.15:
                m.evict_blocks(m.block_table(s)[:1])
            elif op < 0.5:
                live.remove(s)
                m.free(s)
        if r % 101 == 100 and not live:
            m.reset_prefix_cache()
        fold(state, m.drain_events())
        if r % 37 == 0:
            snap = m.kv_event_snapshot()
            assert {(e.medium, e.group_idx, e.block_hashes[0]): e for e in snap} == state
            listed: set[Key] = set()
            for e in snap:
                k = (e.medium, e.group_idx, e.parent_block_hash)
                assert e.parent_block_hash is None or k not in state or k in listed
                listed.add((e.medium, e.group_idx, e.block_hashes[0]))
    for s in live:
        m.free(s)
    fold(state, m.drain_events())
    assert len([k for k in state if k[0] == "GPU"]) == m.num_cached_blocks
    assert m.kv_event_queue_stats().blocks == len(state)


def test_threads_overflow_the_queue_and_a_consumer_still_ends_with_the_cache() -> None:
    """Four threads allocate, append and free over shared prefixes on a queue of 8 events;
    a consumer drains, and on an overflow starts again from a snapshot. Its set ends equal to
    the idle manager's cached blocks, and overflows did happen."""
    m = BlockManager(128, B, enable_kv_events=True)
    m.set_kv_event_capacity(8)
    prefixes = [list(range(1000 * p, 1000 * p + 6 * B)) for p in range(8)]
    prompts: list[list[int]] = []
    stop = threading.Event()
    state: dict[Key, BlockStored] = {}
    resyncs = 0

    def follow() -> None:
        """One drain, or after an overflow a fresh start from the snapshot."""
        nonlocal resyncs
        try:
            fold(state, m.drain_events())
        except KVEventsOverflowError:
            resyncs += 1
            state.clear()
            fold(state, list(m.kv_event_snapshot()))

    def consumer() -> None:
        while not stop.is_set():
            follow()

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        for r in range(400):
            sid = tid * 10_000 + r
            p = rng.choice(prefixes)[: rng.randrange(B, 6 * B)] + [rng.randrange(10**6)] * B
            prompts.append(p)
            if m.allocate(sid, p) is not None:
                if rng.random() < 0.5:
                    m.append(sid, [rng.randrange(10**6) for _ in range(B)])
                m.free(sid)

    c = threading.Thread(target=consumer, daemon=True)
    c.start()
    ws = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    c.join()
    follow()
    m.check_invariants()
    s = m.kv_event_queue_stats()
    assert s.overflows > 0 and s.dropped > 0 and resyncs == s.overflows
    assert len(state) == m.num_cached_blocks == s.blocks
    assert {k[2] for k in state} >= gpu_cached(m, prompts[-50:])


def test_the_tier_queue_keeps_the_same_contract() -> None:
    """`EventQueue` (a TieredCache's tier events): capacity, overflow, refused drain,
    snapshot parents first and restart, tallies."""
    q = EventQueue()
    q.set_capacity(2)

    def st(h: bytes, parent: bytes | None = None, medium: str = "CPU") -> BlockStored:
        return BlockStored([h], parent, [], B, None, medium, 0)

    q.push(st(b"a"))
    q.push(st(b"b", b"a"))
    assert q.stats().queued == 2 and q.stats().overflows == 0
    assert len(q.drain()) == 2
    q.push(BlockRemoved([b"a"], "CPU", 0))
    q.push(st(b"a"))  # re-stored after its child: the snapshot still lists it first
    q.push(st(b"c", None, "DISK"))  # one past
    s = q.stats()
    assert (s.queued, s.dropped, s.overflows, s.blocks) == (0, 3, 1, 3)
    with pytest.raises(KVEventsOverflowError, match="capacity of 2 events and 3 events"):
        q.drain()
    assert q.stats() == s
    assert [e.block_hashes[0] for e in q.snapshot()] == [b"a", b"b", b"c"]
    assert q.drain() == []
    q.push(AllBlocksCleared())
    assert q.drain() == [AllBlocksCleared()] and q.snapshot() == []
    for bad in (0, -2, 1.0, True):
        with pytest.raises(InvalidArgumentError, match="capacity"):
            q.set_capacity(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a KV event"):
        q.push("x")  # type: ignore[arg-type]


def test_events_that_fail_to_convert_force_a_resync() -> None:
    """A drain or snapshot whose conversion to Python fails (here: the event class raises)
    tells the log the events were lost: the next drain raises KVEventsOverflowError, and a
    snapshot starts the consumer again. A fresh interpreter: the binding caches the class."""
    script = """
import pagedkv.events as ev
from pagedkv import BlockManager
from pagedkv.errors import KVEventsOverflowError
class Broken:
    def __init__(self, **kw):
        raise RuntimeError("conversion failed")
ev.BlockStored = Broken
m = BlockManager(16, 4, enable_kv_events=True)
m.allocate(1, list(range(8)))
try:
    m.drain_events()
except RuntimeError as e:
    assert "conversion failed" in str(e)
try:
    m.drain_events()
    raise SystemExit("the lost events were not noticed")
except KVEventsOverflowError:
    pass
s = m.kv_event_queue_stats()
assert (s.dropped, s.overflows, s.blocks) == (2, 1, 2), s
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tier_queue_is_bounded_by_default_too() -> None:
    """A `TieredCache`'s event queue (tiers/event_queue.py) holds `DEFAULT_EVENT_CAPACITY`
    undrained events by default, as the manager's does; one more overflows (counted, drains
    refused until a snapshot, which describes every block still stored). Before, it was
    unbounded."""
    from pagedkv.events import BlockStored
    from pagedkv.tiers.event_queue import EventQueue

    n = DEFAULT_EVENT_CAPACITY
    q = EventQueue()
    for h in range(n):
        q.push(BlockStored([h.to_bytes(8, "little")], None, [h], 1, None, "CPU", 0))
    s = q.stats()
    assert (s.queued, s.capacity, s.dropped, s.overflows) == (n, n, 0, 0)
    q.push(BlockStored([b"one past"], None, [0], 1, None, "CPU", 0))
    s = q.stats()
    assert (s.queued, s.dropped, s.overflows, s.blocks) == (0, n + 1, 1, n + 1)
    with pytest.raises(KVEventsOverflowError):
        q.drain()
    assert len(q.snapshot()) == n + 1
    assert q.drain() == []
