"""The event queue against the reference (`pagedkv_reference.event_log`), op by op: random
workloads with shared prefixes, appends, swaps, withdrawals and resets on small bounded
queues, so that overflows, refused drains and snapshots are frequent; after every op the
queue's tallies, the drain's outcome (events, or both overflowed) or the snapshot agree."""

from __future__ import annotations

import random
from typing import Any

import pytest

import pagedkv
from pagedkv_reference import ReferenceBlockManager
from test_model_based import normalize, run

B = 2


def _same(ref: Any, rust: Any, method: str, *args: Any, log: list[str]) -> Any:
    log.append(f"{method}{args!r}")
    want, got = run(ref, method, *args), run(rust, method, *args)
    assert got.key() == want.key(), f"{method}: rust {got.describe()}, ref {want.describe()}\n" + (
        "\n".join(log[-30:])
    )
    return want


@pytest.mark.parametrize("seed", range(12))
def test_bounded_queue_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    kw: dict[str, Any] = {"num_cpu_blocks": 8, "enable_kv_events": True}
    ref = ReferenceBlockManager(24, B, **kw)
    rust = pagedkv.BlockManager(24, B, **kw)
    log: list[str] = []
    live: list[int] = []
    overflows = 0
    for step in range(400):
        op = rng.random()
        sid = step
        if op < 0.3:
            p = [rng.randrange(4) * 100 + i for i in range(rng.randrange(1, 5 * B))]
            if _same(ref, rust, "allocate", sid, p, log=log).value is not None:
                live.append(sid)
        elif op < 0.4 and live:
            s = rng.choice(live)
            _same(ref, rust, "append", s, [rng.randrange(50) for _ in range(B)], log=log)
        elif op < 0.5 and live:
            s = rng.choice(live)
            if _same(ref, rust, "swap_out", s, log=log).value is not None:
                _same(ref, rust, "swap_in", s, log=log)
        elif op < 0.55 and live:
            s = rng.choice(live)
            if not rust.is_swapped(s):
                _same(ref, rust, "evict_blocks", rust.block_table(s)[:1], log=log)
        elif op < 0.75 and live:
            s = live.pop(rng.randrange(len(live)))
            if not rust.is_swapped(s):
                _same(ref, rust, "free", s, log=log)
            else:
                live.append(s)
        elif op < 0.8:
            _same(ref, rust, "reset_prefix_cache", log=log)
        elif op < 0.85:
            _same(ref, rust, "set_kv_event_capacity", rng.choice([None, 1, 2, 3, 5, 0]), log=log)
        elif op < 0.9:
            _same(ref, rust, "kv_event_snapshot", log=log)
        else:
            _same(ref, rust, "drain_events", log=log)
        stats = _same(ref, rust, "kv_event_queue_stats", log=log)
        overflows = max(overflows, stats.value[4][1])
    assert normalize(ref.kv_event_snapshot()) == normalize(rust.kv_event_snapshot())
    assert overflows > 0, "the workload overflowed the queue"
