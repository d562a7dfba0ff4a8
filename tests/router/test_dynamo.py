"""pagedkv's index and Dynamo's (`ai-dynamo-runtime`'s `RadixTree`) on the same event stream
(the Mooncake trace replayed as engines' events, tests/support/router_stream.py): every
lookup answers the same leading blocks per engine, also after engines are cleared and
removed. Dynamo's index is a peer installed from the package index (the `test` extra);
where it is not installed this file is skipped."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mooncake_trace import trace_path
from pagedkv.router import RouterIndex
from router_stream import cleared_payload, dynamo_events, generate, read_trace, vllm_payload

dynamo = pytest.importorskip("dynamo._core", reason="ai-dynamo-runtime is not installed")


def _dynamo_scores(tree: object, hashes: list[int]) -> dict[int, int]:
    # OverlapScores.scores: (worker id, data-parallel rank) -> matched blocks.
    return {w: n for (w, _rank), n in tree.find_matches(hashes).scores.items()}  # type: ignore[attr-defined]


def _same_answers(ix: RouterIndex, tree: object, queries: list[list[int]]) -> int:
    hits = 0
    for q in queries:
        ours = ix.scores(q)
        assert ours == _dynamo_scores(tree, q), q[:3]
        hits += bool(ours)
    return hits


def test_same_answers_as_dynamos_radix_tree(tmp_path: Path) -> None:
    stream = generate(
        read_trace(trace_path(tmp_path)), engines=8, memberships=40_000, lookups=400, seed=3
    )
    ix, tree = RouterIndex(), dynamo.RadixTree()
    rng = random.Random(0)
    queries = stream.lookups + [q[: rng.randrange(1, len(q) + 1)] for q in stream.lookups]
    queries += [[rng.getrandbits(64), *q] for q in stream.lookups[:50]]  # a miss first
    n = 0
    half = len(stream.batches) // 2
    for i, b in enumerate(stream.batches):
        ix.apply(b.engine, vllm_payload(b))
        for ev in dynamo_events(b, n):
            tree.apply_event(b.engine, ev)
            n += 1
        if i == half:  # midway, before most of the queries' blocks came
            _same_answers(ix, tree, queries)
    assert _same_answers(ix, tree, queries) > len(queries) // 4
    s = ix.stats()
    assert s.memberships == stream.memberships
    assert (s.orphans, s.unknown_removals, s.duplicates) == (0, 0, 0)
    # An engine cleared, another removed: both indexes drop them.
    cleared = json.dumps({"event_id": n, "data": "cleared"}).encode()
    tree.apply_event(1, cleared)
    ix.apply(1, cleared_payload())
    tree.remove_worker(2)
    assert ix.remove_engine(2)
    assert _same_answers(ix, tree, queries) > 0
    ix.check_invariants()
