"""Engines with publishers on loopback, a threaded workload, and what the index must hold
(helpers of tests/router)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from pagedkv import BlockManager
from pagedkv.kv_events import Publisher
from pagedkv.router import RouterIndex
from pagedkv.router.follow import Follower

B = 4
LOOP = "tcp://127.0.0.1:0"
PREFIXES = [list(range(1000 * p, 1000 * p + 6 * B)) for p in range(6)]


def _worker(m: BlockManager, tid: int, rounds: int, seed: int) -> None:
    """Random prompts over shared prefixes: hits, appends, swaps (CPU blocks), evictions,
    frees, and now and then a reset of the prefix cache (AllBlocksCleared)."""
    rng = random.Random(seed * 100 + tid)
    live: dict[int, list[int]] = {}
    for r in range(rounds):
        sid = seed * 10_000_000 + tid * 1_000_000 + r
        prompt = rng.choice(PREFIXES)[: rng.randrange(B, 6 * B)] + [
            rng.randrange(10**6) for _ in range(rng.randrange(0, 3 * B))
        ]
        if m.allocate(sid, prompt) is not None:
            live[sid] = prompt
        for s in list(live):
            op = rng.random()
            if op < 0.3:
                extra = [rng.randrange(10**6) for _ in range(rng.randrange(1, B + 1))]
                if m.append(s, extra) is not None:
                    live[s] = live[s] + extra
            elif op < 0.35 and m.swap_out(s) is not None:
                if m.swap_in(s) is None:
                    live.pop(s)
                    m.free(s)
            elif op < 0.38:
                table = m.block_table(s)
                if table:
                    m.evict_blocks(table[:1])
            elif op < 0.6:
                live.pop(s)
                m.free(s)
        if tid == 0 and r % 97 == 96:
            m.reset_prefix_cache()
        time.sleep(0.001)  # steps apart, so that the publisher sends many batches
    for s in live:
        m.free(s)


def run_workload(m: BlockManager, *, threads: int = 3, rounds: int = 100, seed: int = 0) -> None:
    ts = [threading.Thread(target=_worker, args=(m, t, rounds, seed)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def manager() -> BlockManager:
    return BlockManager(96, B, num_cpu_blocks=32, enable_kv_events=True)


def publisher(
    m: BlockManager,
    *,
    endpoints: tuple[str, str | None] = (LOOP, LOOP),
    buffer_steps: int = 10_000,
    send_filter: Callable[[int], bool] | None = None,
) -> Publisher:
    """A publisher (on the given ports, once ZMQ's I/O thread has let go of them)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return Publisher(
                m, endpoint=endpoints[0], replay_endpoint=endpoints[1], interval=0.0005,
                heartbeat=0.2, buffer_steps=buffer_steps, send_filter=send_filter,
            )  # fmt: skip
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def follow(ix: RouterIndex, engine: Any, pub: Publisher) -> Follower:
    f = ix.follow(engine, pub.endpoint, pub.replay_endpoint, epoch_check=0.2)
    time.sleep(0.2)  # the SUB socket's subscription reaches the publisher
    return f


def caught_up(f: Follower, pub: Publisher, timeout: float = 20.0) -> None:
    """Wait until the follower has applied every batch the publisher sent, in the
    publisher's epoch: a restarted publisher numbers from 0 again, and its sequence number
    can equal the one the follower reached before the restart."""
    pub.flush()
    deadline = time.monotonic() + timeout
    while f.next_seq != pub.next_seq or f.epoch != pub.epoch:
        assert time.monotonic() < deadline, (f.next_seq, pub.next_seq, f.epoch, pub.epoch)
        time.sleep(0.02)


def index_keys(ix: RouterIndex, engine: Any) -> set[tuple[str | None, int, Any]]:
    """What the index holds for `engine`, keyed as a `BlockSet` is."""
    return {
        (medium, group, h)
        for medium, group, _ in ix.holder_sizes(engine)
        for h in ix.blocks(engine, medium, group)
    }


def audit(ix: RouterIndex, engine: Any, pub: Publisher, m: BlockManager) -> None:
    """The index holds exactly the publisher's block set, which is the idle manager's
    snapshot of what its events describe."""
    want = pub.state.key_set()
    assert index_keys(ix, engine) == want
    from pagedkv.kv_events import hash_int

    described = {
        (e.medium, e.group_idx, hash_int(d)) for e in m.kv_event_snapshot() for d in e.block_hashes
    }
    assert want == described
    assert len(want) >= m.num_cached_blocks > 0
    ix.check_invariants()
