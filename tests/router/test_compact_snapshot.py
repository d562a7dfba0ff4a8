"""Compact snapshots (`pagedkv-snapshot-compact`): a follower asks for them, a publisher of
integer hashes writes them from its `HeldBlocks` in Rust, and the index applies them in bulk,
ending with the publisher's block set; a publisher of digests answers with the usual
payloads; a publisher that leaves the request unanswered (older than it) is asked the usual
way from then on."""

from __future__ import annotations

import random

from pagedkv import _core
from pagedkv.kv_events import Publisher, WireOptions
from pagedkv.kv_events.publisher import SNAPSHOT_COMPACT
from pagedkv.router import RouterIndex
from router_streams import (
    LOOP,
    B,
    audit,
    caught_up,
    follow,
    index_keys,
    manager,
    publisher,
    run_workload,
)


def test_snapshots_past_the_buffer_are_compact_and_end_right() -> None:
    lossy = random.Random(3)
    m = manager()
    pub = publisher(m, buffer_steps=2, send_filter=lambda seq: lossy.random() > 0.2)
    ix = RouterIndex(block_size=B)
    f = follow(ix, "e", pub)
    run_workload(m)
    caught_up(f, pub)
    audit(ix, "e", pub, m)
    assert f.snapshots > 1 and pub.compact_snapshots == pub.snapshots == f.snapshots
    ix.close()
    pub.close()


def test_held_blocks_write_the_publishers_set() -> None:
    m = manager()
    pub = publisher(m)
    run_workload(m, rounds=40)
    pub.flush()
    ix = RouterIndex(block_size=B)
    ix.begin_snapshot("e")
    for part in pub._held.parts(per_part=7):  # type: ignore[union-attr]
        ix.apply_staged("e", part)
    ix.commit_snapshot("e")
    assert index_keys(ix, "e") == pub.state.key_set()
    pub.close()
    held = _core.HeldBlocks()
    assert len(held) == 0 and held.parts() == []


def test_a_digest_publisher_answers_with_payloads() -> None:
    m = manager()
    pub = Publisher(
        m, endpoint=LOOP, replay_endpoint=LOOP, interval=0.0005, heartbeat=0.2,
        wire_options=WireOptions(hash_form="bytes"),
    )  # fmt: skip
    ix = RouterIndex(block_size=B, hash_form="bytes")
    f = follow(ix, "e", pub)
    run_workload(m, rounds=30)
    caught_up(f, pub)
    assert index_keys(ix, "e") == pub.state.key_set()
    assert f.snapshots == 1 and pub.compact_snapshots == 0
    ix.close()
    pub.close()


class _OldPublisher(Publisher):
    """A publisher from before compact snapshots: it leaves that request unanswered."""

    def _answer(self, client: bytes, req: bytes) -> None:
        if req != SNAPSHOT_COMPACT:
            super()._answer(client, req)


def test_an_unanswered_compact_request_falls_back_to_the_usual_one() -> None:
    m = manager()
    pub = _OldPublisher(m, endpoint=LOOP, replay_endpoint=LOOP, interval=0.0005, heartbeat=0.2)
    ix = RouterIndex(block_size=B)
    f = ix.follow("e", pub.endpoint, pub.replay_endpoint, timeout=0.5, epoch_check=0.2)
    run_workload(m, rounds=30)
    caught_up(f, pub)
    audit(ix, "e", pub, m)
    assert f.failures >= 1 and f.snapshots >= 1 and pub.compact_snapshots == 0
    ix.close()
    pub.close()
