"""What the cluster's router line counts as a routing success: a request sent to a node that
holds more of its prompt than another node does. A prefix every node holds (a shared system
prompt) is served wherever the request goes, so it is no success."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.sim.cluster_report import cluster_table
from pagedkv.sim.router import Router


class _Node:
    """A node that holds the first `held` tokens of every prompt, with a given load."""

    def __init__(self, held: int, tokens: int = 0) -> None:
        self.held = held
        self.tokens = tokens

    def load(self) -> tuple[int, int]:
        return self.tokens, 0

    def cached_prefix(self, tokens: npt.NDArray[np.uint32], cache_salt: str | None) -> int:
        del cache_salt
        return min(self.held, len(tokens))


PROMPT = np.arange(300, dtype=np.uint32)


def test_a_prefix_on_every_node_is_no_routing_success() -> None:
    router = Router("prefix", 3)
    router.route([_Node(128), _Node(128), _Node(128)], PROMPT)  # the system prompt everywhere
    s = router.stats
    assert (s.prefix_routed, s.prefix_tokens) == (1, 128)  # it went to a node holding some
    assert (s.prefix_won, s.prefix_won_tokens, s.prefix_everywhere) == (0, 0, 1)


def test_a_node_holding_more_than_another_is_a_success_by_the_difference() -> None:
    router = Router("prefix", 3)
    assert router.route([_Node(128), _Node(256), _Node(160)], PROMPT) == 1
    s = router.stats
    assert (s.prefix_won, s.prefix_won_tokens, s.prefix_everywhere) == (1, 128, 0)
    # Nobody holds any of it: neither a success nor a shared prefix.
    router.route([_Node(0), _Node(0), _Node(0)], PROMPT)
    assert (s.prefix_routed, s.prefix_won, s.prefix_everywhere) == (1, 1, 0)


def test_one_node_has_no_choice_to_win() -> None:
    router = Router("prefix", 1)
    router.route([_Node(200)], PROMPT)
    assert router.stats.prefix_won == 0 and router.stats.prefix_everywhere == 1


def test_the_router_line_and_the_manager_time_say_what_they_count() -> None:
    counts = (
        "requests",
        "prompt_tokens",
        "tier_tokens",
        "tier_tokens_cross",
        "recomputed_tokens",
        "recomputed_hit_tokens",
        "preemptions",
        "evictions",
        "blocks_demoted",
        "blocks_promoted",
        "steps",
    )
    rates = ("workload_hit_rate", "gpu_hit_rate", "tier_hit_rate", "cross_node_hit_rate")
    node: dict[str, float] = {**dict.fromkeys(counts, 0), **dict.fromkeys(rates, 0.5)}
    doc: dict[str, Any] = {
        "nodes": [dict(node, manager_seconds=1.25)],
        "total": dict(node, manager_seconds=1.25),
        "balance": {"requests_max_over_mean": 1.0, "prompt_tokens_max_over_mean": 1.0},
        "router": {
            "routed": [10],
            "prefix_routed": 9,
            "prefix_tokens": 1000,
            "balanced": 0,
            "prefix_won": 2,
            "prefix_won_tokens": 64,
            "prefix_everywhere": 7,
        },
        "cluster": {"routing": "prefix"},
        "index": None,
        "stores": [],
    }
    text = cluster_table(doc)
    assert "manager s (wall)" in text
    assert "router      2 of 10 requests (20.00%) went to a node holding more" in text
    assert "(64 tokens beyond the least any node held); 7 found the same prefix" in text
