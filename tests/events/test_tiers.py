"""A `TieredCache` as the source: its manager's GPU events and its tier's own (medium "CPU")
reach the subscriber, whose set then holds the idle manager's cached blocks and the tier's
entries."""

from __future__ import annotations

import random
import time
from typing import Any, NamedTuple

from pagedkv import BlockManager
from pagedkv.kv_events import Publisher, Subscriber, hash_int
from pagedkv.kv_events.blockset import Key
from pagedkv.tiers.cache import TieredCache
from pagedkv.tiers.digests import DigestTier
from test_subscriber import LOOP, PREFIXES, B, _follow


class TierRun(NamedTuple):
    m: BlockManager
    tc: TieredCache
    pub: Publisher
    sub: Subscriber
    cpu: set[Key]  # the subscriber's tier entries

    def close(self) -> None:
        self.sub.close()
        self.pub.close()
        self.tc.close()


def run_tier_workload(**publisher_kw: Any) -> TierRun:
    """300 prompts through a TieredCache over a 24-block digest tier, published and followed:
    the subscriber's set is the publisher's, its `CPU` entries are the tier's keys and the
    rest the idle manager's cached blocks."""
    m = BlockManager(40, B, enable_kv_events=True, record_evictions=True)
    tier = DigestTier(24)
    tc = TieredCache(m, None, [tier], workers=0)
    pub = Publisher(tc, endpoint=LOOP, replay_endpoint=LOOP, heartbeat=0.2, **publisher_kw)
    assert pub.replay_endpoint is not None
    sub = Subscriber(pub.endpoint, pub.replay_endpoint, epoch_check=0.2)
    time.sleep(0.2)
    rng = random.Random(3)
    for r in range(300):
        prompt = rng.choice(PREFIXES)[: rng.randrange(B, 6 * B)] + [rng.randrange(10**6)] * B
        alloc = tc.allocate(r, prompt)
        if alloc is not None:
            tc.load(alloc)
            tc.free(r)
        if r % 10 == 0:
            sub.poll(0.01)
    tc.flush()
    _follow(sub, pub)
    assert sub.blocks.blocks == pub.state.blocks
    keys = sub.blocks.key_set()
    cpu = {k for k in keys if k[0] == "CPU"}
    assert cpu == {("CPU", k.group, hash_int(k.digest)) for k in tier._keys} and cpu
    assert len(keys - cpu) == m.num_cached_blocks
    return TierRun(m, tc, pub, sub, cpu)


def test_tier_media_follow_the_tier() -> None:
    run = run_tier_workload()
    # The tier's own events carry no tokens: the publisher gave them the GPU block's.
    for k in run.cpu:
        assert len(run.sub.blocks.blocks[k].token_ids) == B, k
    run.close()
