"""The publisher on a bounded queue (docs/events.md, "Bounded queues"): when the threaded
workload overflows it, the publisher resynchronises on the wire (AllBlocksCleared, then the
source's snapshot), so both the reference subscriber and a plain router that only applies
batches in order end with the manager's cached set; a publisher started on a warm manager
announces its cache; a TieredCache's tier queue overflows and resyncs the same way."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq

from pagedkv import BlockManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.events import DEFAULT_EVENT_CAPACITY
from pagedkv.kv_events import BlockSet, Publisher, wire
from test_subscriber import LOOP, B, Loop, _follow, _subscriber, audit, run_workload
from test_tiers import run_tier_workload


class Router:
    """A router without pagedkv's snapshots: it applies every batch in order, as vLLM's
    consumers do, and records any gap in the sequence numbers."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.blocks = BlockSet()
        self.last = -1
        self.gaps = 0
        self.decode = wire.decoder().decode
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        time.sleep(0.3)  # the subscription reaches the PUB socket
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(20):
                _, seq_b, payload = self.sock.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if self.last >= 0 and seq != self.last + 1:
                    self.gaps += 1
                self.last = seq
                self.blocks.apply(self.decode(payload).events)

    def wait_for(self, seq: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.last < seq:
            assert time.monotonic() < deadline, (self.last, seq)
            time.sleep(0.01)
        self.stop.set()
        self.thread.join()
        self.sock.close()


def _bounded(queue_events: int, **kw: Any) -> tuple[BlockManager, Publisher]:
    m = BlockManager(96, B, num_cpu_blocks=32, enable_kv_events=True)
    # Slow drains (every 20 ms) against a queue of a few events: the workload overflows it.
    pub = Publisher(
        m, endpoint=LOOP, replay_endpoint=LOOP, interval=0.02, heartbeat=0.2,
        queue_events=queue_events, **kw,
    )  # fmt: skip
    return m, pub


def test_overflows_resync_and_the_subscriber_follows() -> None:
    m, pub = _bounded(8)
    loop = Loop(_subscriber(pub))
    prompts = run_workload(m)
    sub = loop.join()
    _follow(sub, pub)
    audit(sub, pub, m, prompts)
    q = m.kv_event_queue_stats()
    assert q.overflows > 0 and q.dropped > 0 and pub.resyncs > 0
    sub.close()
    pub.close()


def test_a_router_without_snapshots_follows_through_resyncs() -> None:
    m, pub = _bounded(8, buffer_steps=4)
    pub.flush()
    router = Router(pub.endpoint)
    prompts = run_workload(m)
    pub.flush()
    router.wait_for(pub.next_seq - 1)
    assert router.gaps == 0, "the PUB socket dropped nothing on loopback"
    assert pub.resyncs > 0
    assert router.blocks.blocks == pub.state.blocks
    keys = router.blocks.key_set()
    assert len(keys) == m.num_cached_blocks > 0 and {k[0] for k in keys} == {"GPU"}
    assert len(prompts) > 100
    pub.close()


def test_a_publisher_started_on_a_warm_manager_announces_its_cache() -> None:
    m = BlockManager(96, B, num_cpu_blocks=32, enable_kv_events=True)
    prompts = run_workload(m, rounds=40)
    m.drain_events()  # a consumer before the publisher took these: the snapshot still has them
    assert m.num_cached_blocks > 0
    pub = Publisher(m, endpoint=LOOP, replay_endpoint=LOOP, heartbeat=0.2)
    sub = _subscriber(pub)
    _follow(sub, pub)
    audit(sub, pub, m, prompts)
    assert pub.resyncs == 0, "the start's announcement is not counted as a resync"
    sub.close()
    pub.close()


def test_bad_queue_bounds_and_failed_starts_change_nothing() -> None:
    m = BlockManager(8, B, enable_kv_events=True)
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(InvalidArgumentError, match="capacity"):
            Publisher(m, endpoint=LOOP, queue_events=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="enable_kv_events=True"):
        Publisher(BlockManager(8, B), endpoint=LOOP)
    with pytest.raises(zmq.ZMQError):
        Publisher(m, endpoint="bogus://x", queue_events=5)
    assert m.kv_event_queue_stats().capacity == DEFAULT_EVENT_CAPACITY, "a failed start leaves it"
    with Publisher(m, endpoint=LOOP, queue_events=5):
        assert m.kv_event_queue_stats().capacity == 5


def test_tier_queue_overflows_resync_with_tokens() -> None:
    run = run_tier_workload(interval=0.05, queue_events=4)
    assert run.tc.kv_event_queue_stats().overflows > 0 and run.pub.resyncs > 0
    # A tier block gets its GPU block's tokens when the publisher saw that block stored;
    # one stored and evicted within a lost window goes out without (docs/events.md).
    lengths = [len(run.sub.blocks.blocks[k].token_ids) for k in run.cpu]
    assert set(lengths) <= {0, B} and B in lengths, lengths
    run.close()
