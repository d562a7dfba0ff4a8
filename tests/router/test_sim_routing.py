"""`simulate --nodes N --routing prefix` routes with the router index, fed by each node's KV
events in vLLM's wire format (`pagedkv.sim.cluster_index`). The nodes' own `lookup` was
exact, so the index must decide the same: every figure and every request's node equal
between the two, on shared prefixes, with cache salts, a tier below the GPUs, swaps and
evictions."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from pagedkv.config import BlockManagerConfig
from pagedkv.groups import KVCacheGroup
from pagedkv.sim import cluster as cluster_mod
from pagedkv.sim.cluster import ClusterOptions, run_cluster
from pagedkv.sim.cluster_report import cluster_figures
from pagedkv.sim.requests import Request, Workload
from pagedkv.sim.workloads import build_workload

SCHEDULE: dict[str, Any] = {"max_batch": 64, "max_num_batched_tokens": 2048}


def _both(w: Workload, cfg: BlockManagerConfig, options: ClusterOptions) -> tuple[Any, Any]:
    by_index = run_cluster(w, cfg, options, SCHEDULE)
    mp = pytest.MonkeyPatch()
    mp.setattr(cluster_mod, "index_routing_available", lambda config: False)
    try:
        by_lookup = run_cluster(w, cfg, options, SCHEDULE)
    finally:
        mp.undo()
    return by_index, by_lookup


def _req(rid: int, prompt: np.ndarray, *, at: int) -> Request:
    return Request(
        request_id=rid,
        prompt_len=len(prompt),
        max_new_tokens=2,
        arrival_step=at,
        kind="test",
        prompt_tokens=prompt,
    )


def _untimed(doc: Any) -> Any:
    """The figures less the clocks (`manager_seconds`, `wall_seconds`), which differ."""
    if isinstance(doc, dict):
        return {k: _untimed(v) for k, v in doc.items() if not k.endswith("_seconds")}
    if isinstance(doc, list):
        return [_untimed(v) for v in doc]
    return doc


def _salted(w: Workload) -> Workload:
    """The same requests, half of them under one of two tenants' cache salts."""
    reqs = []
    for r in w.requests:
        salt = None if r.request_id % 2 else f"tenant-{r.request_id % 4}"
        reqs.append(dataclasses.replace(r, cache_salt=salt))
    return Workload(tuple(reqs), w.seed, name=w.name)


def _repeated() -> Workload:
    """Three 256-token prompts (whole blocks), four times each, after one another: a prompt
    fully cached is served all but its last block (the cap)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 30_000, 256, dtype=np.uint32) for _ in range(3)]
    reqs = tuple(_req(i, prompts[i % 3], at=4 * i) for i in range(12))
    return Workload(reqs, 0, name="repeated")


@pytest.mark.parametrize(
    ("workload", "tier", "nodes"),
    [("mixed", "off", 3), ("mixed", "shared", 4), ("salted", "off", 3), ("repeated", "off", 2)],
)
def test_the_index_routes_as_the_nodes_lookups(workload: str, tier: str, nodes: int) -> None:
    w = build_workload("mixed", 120, seed=5, arrival_rate=3.0, doc_tokens=2048)
    if workload == "salted":
        w = _salted(w)
    if workload == "repeated":
        w = _repeated()
    cfg = BlockManagerConfig(num_blocks=160, block_size=16, num_cpu_blocks=16)
    options = ClusterOptions(nodes, "prefix", tier, None if tier == "off" else 400)
    by_index, by_lookup = _both(w, cfg, options)
    assert by_lookup.index is None and by_index.index is not None
    assert by_index.routed_ids == by_lookup.routed_ids
    a, b = _untimed(cluster_figures(by_index)), _untimed(cluster_figures(by_lookup))
    assert a.pop("index") == by_index.index and "index" not in b
    assert a == b
    assert a["router"]["prefix_routed"] > 0
    assert by_index.index["memberships"] > 0
    if workload == "repeated":  # 9 requests hit 15 of their 16 blocks
        assert a["router"]["prefix_tokens"] == 9 * 15 * 16
        return
    # Evictions and swaps went through the index too (removals, the CPU medium).
    assert a["total"]["evictions"] > 0 and a["total"]["preemptions"] > 0
    assert by_index.index["events"] > 1000


def test_hybrid_models_route_by_the_nodes_lookups() -> None:
    """A sliding window serves hits by a rule of its own: such runs keep the nodes' lookup."""
    groups = (KVCacheGroup("full"), KVCacheGroup("sliding_window", window=64))
    cfg = BlockManagerConfig(num_blocks=256, block_size=16, groups=groups)
    prompt = np.arange(200, dtype=np.uint32)
    reqs = tuple(_req(i, prompt, at=3 * i) for i in range(4))
    run = run_cluster(
        Workload(reqs, 0, name="hybrid"), cfg, ClusterOptions(2, "prefix", "off"), SCHEDULE
    )
    assert run.index is None
    assert run.router.prefix_routed == 3
