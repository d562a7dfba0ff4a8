"""The reference subscriber follows vLLM 0.33's own `ZmqEventPublisher`: its stream, and its
replay socket for a gap (it serves no snapshots or epochs, so the subscriber starts from the
first batch it sees)."""

from __future__ import annotations

import socket
import time

import zmq
from vllm.distributed import kv_events as v

from pagedkv.kv_events import Subscriber


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stored(h: int, parent: int | None) -> v.BlockStored:
    return v.BlockStored(
        block_hashes=[h], parent_block_hash=parent, token_ids=[h] * 4, block_size=4,
        lora_id=None, medium="GPU", lora_name=None, group_idx=0,
    )  # fmt: skip


def test_follows_vllms_publisher_and_its_replay() -> None:
    pub_port, replay_port = _free_port(), _free_port()
    pub = v.ZmqEventPublisher(
        0, endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv"
    )
    sub = Subscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", topic="kv")
    try:
        time.sleep(0.3)
        pub.publish(v.KVEventBatch(ts=time.time(), events=[_stored(1, None)]))
        deadline = time.monotonic() + 10
        while sub.next_seq != 1:
            assert time.monotonic() < deadline
            sub.poll(0.05)
        assert not sub.snapshots_supported and len(sub.blocks) == 1
        # Batches 1 and 2 are lost to the subscriber (it stops reading); 3 shows the gap.
        sub._sub.setsockopt(zmq.UNSUBSCRIBE, b"kv")
        time.sleep(0.2)
        pub.publish(v.KVEventBatch(ts=time.time(), events=[_stored(2, 1)]))
        pub.publish(v.KVEventBatch(ts=time.time(), events=[v.BlockRemoved([1], "GPU", 0)]))
        time.sleep(0.3)
        sub._sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        time.sleep(0.3)
        pub.publish(v.KVEventBatch(ts=time.time(), events=[_stored(3, 2)]))
        while sub.next_seq != 4:
            assert time.monotonic() < deadline
            sub.poll(0.05)
        assert sub.gaps == 1 and sub.replays == 1 and sub.lost == 0
        assert {k[2] for k in sub.blocks.key_set()} == {2, 3}
    finally:
        sub.close()
        pub.shutdown()


def test_a_restarted_vllm_publisher_is_followed_from_its_first_batch() -> None:
    """vLLM's publisher has no epoch: a new one on the same ports numbers from 0 again. The
    subscriber tells it by its numbers (at or below the last one received) and follows it
    from an empty set (a restarted engine's cache is empty); it ignored it before."""
    pub_port, replay_port = _free_port(), _free_port()
    endpoints = {"endpoint": f"tcp://*:{pub_port}", "replay_endpoint": f"tcp://*:{replay_port}"}
    pub = v.ZmqEventPublisher(0, topic="kv", **endpoints)
    sub = Subscriber(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", topic="kv")
    deadline = time.monotonic() + 20

    def until(seq: int) -> None:
        while sub.next_seq != seq:
            assert time.monotonic() < deadline, sub.next_seq
            sub.poll(0.05)

    try:
        time.sleep(0.3)
        for h in (1, 2, 3):
            pub.publish(v.KVEventBatch(ts=time.time(), events=[_stored(h, h - 1 or None)]))
        until(3)
        pub.shutdown()
        time.sleep(0.5)  # rebound at once, in one process, the old port confuses ZMQ
        while True:  # the ports are free once ZMQ's I/O thread has let go of them
            try:
                pub = v.ZmqEventPublisher(0, topic="kv", **endpoints)
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        # The subscriber reconnects meanwhile: the batches it misses come from the new
        # publisher's replay buffer.
        for h in range(7, 12):
            pub.publish(
                v.KVEventBatch(ts=time.time(), events=[_stored(h, h - 1 if h > 7 else None)])
            )
            sub.poll(0.1)
        until(5)
        assert {k[2] for k in sub.blocks.key_set()} == set(range(7, 12))
        assert sub.restarts == 1
    finally:
        sub.close()
        pub.shutdown()
