"""The publisher on real ZMQ sockets (tcp loopback): vLLM's three frames, its replay protocol,
heartbeats, epochs and snapshots."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as v

from pagedkv import BlockManager, hash_blocks
from pagedkv.kv_events import Publisher, WireOptions, hash_int
from pagedkv.kv_events.publisher import END_SEQ, EPOCH, SNAPSHOT

B = 4
LOOP = "tcp://127.0.0.1:0"
DECODE = msgspec.msgpack.Decoder(type=v.KVEventBatch).decode


def _sub(endpoint: str, topic: bytes = b"") -> zmq.Socket[Any]:
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    s.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the PUB socket (ZMQ's slow joiner)
    return s


def _dealer(endpoint: str) -> zmq.Socket[Any]:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


def _recv(s: zmq.Socket[Any]) -> list[bytes]:
    assert s.poll(5000), "nothing arrived"
    return s.recv_multipart()


def _seq(b: bytes) -> int:
    return int.from_bytes(b, "big", signed=True)


@pytest.fixture
def manager() -> BlockManager:
    return BlockManager(64, B, enable_kv_events=True)


def test_three_frames_topic_seq_payload(manager: BlockManager) -> None:
    with Publisher(manager, endpoint=LOOP, pod="p1", model="m/x", heartbeat=60) as pub:
        pub.flush()  # batch 0, the start's resync (nothing cached: just AllBlocksCleared)
        sub = _sub(pub.endpoint, b"kv@p1@m/x")
        toks = list(range(2 * B))
        manager.allocate(1, toks)
        pub.flush()
        manager.free(1)
        manager.reset_prefix_cache()
        pub.flush()
        frames = _recv(sub)
        assert len(frames) == 3 and frames[0] == b"kv@p1@m/x" and len(frames[1]) == 8
        assert _seq(frames[1]) == 1
        batch = DECODE(frames[2])
        assert [e.block_hashes[0] for e in batch.events] == [
            hash_int(d) for d in hash_blocks(toks, B)
        ]
        frames = _recv(sub)
        assert _seq(frames[1]) == 2
        assert isinstance(DECODE(frames[2]).events[-1], v.AllBlocksCleared)
        sub.close()


def test_replay_follows_vllm_protocol(manager: BlockManager) -> None:
    with Publisher(
        manager, endpoint=LOOP, replay_endpoint=LOOP, buffer_steps=3, heartbeat=60
    ) as pub:
        assert pub.replay_endpoint is not None
        pub.flush()  # batch 0: the start's resync
        for i in range(5):
            manager.allocate(i, list(range(100 * i, 100 * i + B)))
            pub.flush()
        assert pub.next_seq == 6
        d = _dealer(pub.replay_endpoint)
        d.send_multipart((b"", (4).to_bytes(8, "big")))
        got = [_recv(d) for _ in range(3)]
        assert [_seq(f[2]) for f in got] == [4, 5, -1]
        assert got[0][0] == b"" and got[0][1] == pub.topic
        assert DECODE(got[1][3]).events[0].token_ids == list(range(400, 400 + B))
        assert got[2] == [b"", b"", END_SEQ, b""]
        # The buffer holds the last 3 batches: asking from 0 gets 3, 4, 5.
        d.send_multipart((b"", (0).to_bytes(8, "big")))
        assert [_seq(_recv(d)[2]) for _ in range(4)] == [3, 4, 5, -1]
        d.close()


def test_heartbeat_when_idle(manager: BlockManager) -> None:
    with Publisher(manager, endpoint=LOOP, heartbeat=0.05) as pub:
        sub = _sub(pub.endpoint)
        a, b = _recv(sub), _recv(sub)
        assert _seq(b[1]) == _seq(a[1]) + 1
        assert DECODE(b[2]).events == []
        assert pub.heartbeats >= 2
        sub.close()


def test_epoch_and_snapshot_parents_first(manager: BlockManager) -> None:
    with Publisher(manager, endpoint=LOOP, replay_endpoint=LOOP, heartbeat=60) as pub:
        assert pub.replay_endpoint is not None
        toks = list(range(5 * B))
        manager.allocate(1, toks)
        manager.allocate(2, toks[: 2 * B] + list(range(900, 900 + 3 * B)))
        manager.free(2)
        pub.flush()
        d = _dealer(pub.replay_endpoint)
        d.send_multipart((b"", EPOCH))
        tag, epoch, nxt = _recv(d)[1:]
        assert tag == EPOCH and _seq(epoch) == pub.epoch and _seq(nxt) == pub.next_seq
        d.send_multipart((b"", SNAPSHOT))
        head = _recv(d)[1:]
        assert head[0] == SNAPSHOT and _seq(head[1]) == pub.epoch and _seq(head[2]) == pub.next_seq
        seen: set[int] = set()
        count = 0
        while True:
            _, topic, seq, payload = _recv(d)
            if _seq(seq) == -1:
                break
            assert topic == pub.topic and _seq(seq) == pub.next_seq
            for e in DECODE(payload).events:
                assert e.parent_block_hash is None or e.parent_block_hash in seen
                seen.add(e.block_hashes[0])
                count += 1
        assert count == len(pub.state) == 8  # 5 + 3 new blocks of sequence 2
        assert {h for _, _, h in pub.state.key_set()} == seen
        d.close()
    other = Publisher(BlockManager(8, B, enable_kv_events=True), endpoint=LOOP)
    assert other.epoch != pub.epoch
    other.close()


def test_array_form_on_the_wire(manager: BlockManager) -> None:
    opts = WireOptions(event_form="array", hash_form="bytes")
    with Publisher(manager, endpoint=LOOP, wire_options=opts, heartbeat=60) as pub:
        pub.flush()  # the start's resync goes before the subscription
        sub = _sub(pub.endpoint)
        manager.allocate(1, list(range(B)))
        pub.flush()
        _, events, _ = msgspec.msgpack.decode(_recv(sub)[2])
        d = hash_blocks(list(range(B)), B)[0]
        assert events == [["BlockStored", [d], None, list(range(B)), B, None, "GPU", None]]
        sub.close()


def test_bad_arguments() -> None:
    m = BlockManager(8, B, enable_kv_events=True)
    with pytest.raises(ValueError, match="buffer_steps"):
        Publisher(m, endpoint=LOOP, buffer_steps=0)
    with pytest.raises(TypeError, match="drain_events"):
        Publisher(object(), endpoint=LOOP)
    with pytest.raises(zmq.ZMQError):
        Publisher(m, endpoint="bogus://x")


def test_snapshot_larger_than_the_replay_buffer_arrives_whole() -> None:
    """A snapshot of many chunks with a 1-batch buffer (the replay socket drops nothing)."""
    from pagedkv.kv_events import Subscriber

    m = BlockManager(4096, B, enable_kv_events=True)
    with Publisher(m, endpoint=LOOP, replay_endpoint=LOOP, buffer_steps=1, heartbeat=60) as pub:
        assert pub.replay_endpoint is not None
        for i in range(30):
            m.allocate(i, list(range(1000 * i, 1000 * i + 100 * B)))  # 3,000 blocks
        pub.flush()
        sub = Subscriber(pub.endpoint, pub.replay_endpoint)
        sub.snapshot()
        assert len(sub.blocks) == len(pub.state) == 3000
        assert sub.blocks.blocks == pub.state.blocks and sub.next_seq == pub.next_seq
        sub.close()
