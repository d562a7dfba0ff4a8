"""`RouterIndex.follow`: live streams of pagedkv publishers on loopback, fed by managers under
threaded workloads. The index ends with each engine's block set (the publisher's, which is
the manager's own snapshot) from the start, after lost messages (replayed, or past the
replay buffer: snapshots), after the router restarts, and after an engine's publisher
restarts; lookups answer from it while it follows."""

from __future__ import annotations

import random
import threading

import pytest
import zmq

from pagedkv import hash_blocks
from pagedkv.kv_events import hash_int
from pagedkv.router import RouterIndex
from router_streams import (
    B,
    audit,
    caught_up,
    follow,
    index_keys,
    manager,
    publisher,
    run_workload,
)


def test_two_engines_followed_while_lookups_run() -> None:
    engines = {e: manager() for e in ("e0", "e1")}
    pubs = {e: publisher(m) for e, m in engines.items()}
    ix = RouterIndex(block_size=B)
    followers = {e: follow(ix, e, p) for e, p in pubs.items()}
    stop = threading.Event()
    answers: list[int] = []

    def lookups() -> None:
        toks = list(range(1000, 1000 + 6 * B))
        while not stop.is_set():
            for m in ix.match(token_ids=toks):
                assert m.engine_id in engines and 0 <= m.blocks <= 6
                answers.append(m.blocks)

    t = threading.Thread(target=lookups)
    t.start()
    runs = [
        threading.Thread(target=run_workload, args=(m,), kwargs={"seed": i})
        for i, m in enumerate(engines.values())
    ]
    for r in runs:
        r.start()
    for r in runs:
        r.join()
    stop.set()
    t.join()
    for e, m in engines.items():
        caught_up(followers[e], pubs[e])
        audit(ix, e, pubs[e], m)
        assert followers[e].snapshots == 1 and followers[e].batches > 10
    assert answers  # the lookups ran, and saw hits, while the streams applied
    # A request's hit per engine is what that engine's manager would serve.
    for e, m in engines.items():
        for p in [
            pre[: 5 * B] for pre in (list(range(1000 * i, 1000 * i + 6 * B)) for i in range(6))
        ]:
            hit = m.lookup([*p, 7])
            got = {r.engine_id: r.blocks for r in ix.match(token_ids=p)}
            assert got.get(e, 0) == hit // B
    ix.close()
    for p in pubs.values():
        p.close()


@pytest.mark.parametrize("buffer_steps", [10_000, 2])
def test_lost_messages_replayed_or_snapshotted(buffer_steps: int) -> None:
    lossy = random.Random(7)
    m = manager()
    pub = publisher(m, buffer_steps=buffer_steps, send_filter=lambda seq: lossy.random() > 0.2)
    ix = RouterIndex(block_size=B)
    f = follow(ix, "e", pub)
    run_workload(m)
    caught_up(f, pub)
    audit(ix, "e", pub, m)
    assert pub.dropped > 0 and f.gaps > 0 and f.replays > 0
    if buffer_steps == 2:
        assert f.snapshots > 1  # some gaps were past the buffer
    else:
        assert f.snapshots == 1  # the first sync only: replay covered every gap
    ix.close()
    pub.close()


def test_router_restarted_mid_run() -> None:
    m = manager()
    pub = publisher(m)
    first = RouterIndex(block_size=B)
    follow(first, "e", pub)
    run_workload(m, rounds=50)
    first.close()  # the router process goes: its index with it
    run_workload(m, rounds=50, seed=1)
    ix = RouterIndex(block_size=B)
    f = follow(ix, "e", pub)
    run_workload(m, rounds=50, seed=2)
    caught_up(f, pub)
    audit(ix, "e", pub, m)
    assert f.snapshots == 1
    ix.close()
    pub.close()


def test_engine_publisher_restarted() -> None:
    """The engine's publisher restarts on its ports (a new epoch, numbers from 0 again)
    while the manager changes: the follower takes a snapshot and ends right."""
    m = manager()
    pub = publisher(m)
    ix = RouterIndex(block_size=B)
    f = follow(ix, "e", pub)
    run_workload(m, rounds=50)
    caught_up(f, pub)
    old_epoch, endpoints = pub.epoch, (pub.endpoint, pub.replay_endpoint)
    pub.close()
    run_workload(m, rounds=30, seed=1)  # changes while no publisher runs
    pub = publisher(m, endpoints=endpoints)
    assert pub.epoch != old_epoch
    run_workload(m, rounds=50, seed=2)
    caught_up(f, pub)
    audit(ix, "e", pub, m)
    assert f.snapshots >= 2
    ix.close()
    pub.close()


def test_unfollow_and_remove() -> None:
    m = manager()
    pub = publisher(m)
    ix = RouterIndex(block_size=B)
    f = follow(ix, "e", pub)
    m.allocate(1, list(range(3 * B)))
    caught_up(f, pub)
    assert ix.scores([hash_int(d) for d in hash_blocks(list(range(3 * B)), B)]) == {"e": 3}
    ix.unfollow("e")
    assert index_keys(ix, "e")  # its blocks stay until removed
    ix.unfollow("e", remove=True)
    assert ix.engines() == [] and ix.followers == {}
    with pytest.raises(zmq.ZMQError):
        ix.follow("x", "not an endpoint")
    pub.close()
