"""The request router in front of a simulated cluster's nodes (`sim.cluster`).

Three policies (`--routing`):

- ``round-robin``: request i goes to node i mod N, whatever the nodes hold or do;
- ``least-loaded``: to the node with the fewest tokens waiting, running or swapped out
  (prompt plus generated so far, of every sequence not yet ended), then the fewest requests
  not yet ended, then the lowest index;
- ``prefix``: to the node whose GPU cache holds the longest prefix of the prompt (what the
  node's manager would serve from its prefix cache now: `lookup`), as KV-aware routers do
  (they score each worker by the prompt's blocks it has cached); ties go to the least
  loaded node, as above. With `balance` (`--prefix-balance F`), a node whose load exceeds F times
  the mean load (plus the request's own prompt) is not a candidate, so that one shared
  prefix cannot pile every request onto one node; 0 (the default) turns the guard off.

A router sees nodes through `NodeView`: their load and their cached prefix of a prompt; or,
with `prefix_hits` (the cluster's router index, `sim.cluster_index`), every node's cached
prefix of a prompt from one lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

ROUTINGS = ("round-robin", "least-loaded", "prefix")


class NodeView(Protocol):
    """What a router may ask of a node."""

    def load(self) -> tuple[int, int]:
        """`(tokens, requests)` the node has not finished."""
        ...

    def cached_prefix(self, tokens: npt.NDArray[np.uint32], cache_salt: str | None) -> int:
        """Prompt tokens the node's GPU cache would serve now."""
        ...


@dataclass
class RouterStats:
    """What the router decided: requests per node, and for `prefix` how many went to a node
    that held part of their prompt (and how many tokens of it), and how many the balance
    guard sent elsewhere.

    A routing success (`prefix_won`) is a request sent to a node that holds more of its
    prompt than the node holding the least of it: the choice bought `prefix_won_tokens`
    tokens (the chosen node's prefix minus the least any node held) that another choice
    would not have. A prefix every node holds (a shared system prompt, once each node has
    seen it) is served wherever the request goes: such a request counts in `prefix_routed`
    and `prefix_everywhere`, not as a success. With one node there is no choice to win."""

    routed: list[int]
    prefix_routed: int = 0
    prefix_tokens: int = 0
    balanced: int = 0
    prefix_won: int = 0
    prefix_won_tokens: int = 0
    prefix_everywhere: int = 0


@dataclass
class Router:
    """Picks a node for each request (module docstring)."""

    policy: str
    nodes: int
    balance: float = 0.0
    # (prompt, cache salt) -> each node's cached prefix in tokens; None: ask each node.
    prefix_hits: Callable[[npt.NDArray[np.uint32], str | None], list[int]] | None = None
    stats: RouterStats = field(init=False)
    _next: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.policy not in ROUTINGS:
            raise ValueError(
                f"unknown routing {self.policy!r}: accepted values are {', '.join(ROUTINGS)}"
            )
        if self.nodes < 1:
            raise ValueError(f"a cluster needs at least one node, got {self.nodes}")
        if self.balance < 0 or (self.balance and self.policy != "prefix"):
            raise ValueError("the balance guard is a number >= 0, for prefix routing only")
        self.stats = RouterStats([0] * self.nodes)

    def route(
        self,
        nodes: Sequence[NodeView],
        tokens: npt.NDArray[np.uint32],
        cache_salt: str | None = None,
    ) -> int:
        """The index of the node for a request with prompt `tokens` (and `cache_salt`)."""
        if len(nodes) != self.nodes:
            raise ValueError(f"the router has {self.nodes} nodes, got {len(nodes)}")
        if self.policy == "round-robin":
            i = self._next
            self._next = (i + 1) % self.nodes
        else:
            loads = [n.load() for n in nodes]
            if self.policy == "least-loaded":
                i = min(range(self.nodes), key=lambda j: (*loads[j], j))
            else:
                i = self._by_prefix(nodes, loads, tokens, cache_salt)
        self.stats.routed[i] += 1
        return i

    def _by_prefix(
        self,
        nodes: Sequence[NodeView],
        loads: list[tuple[int, int]],
        tokens: npt.NDArray[np.uint32],
        cache_salt: str | None,
    ) -> int:
        if self.prefix_hits is not None:
            hits = self.prefix_hits(tokens, cache_salt)
        else:
            hits = [n.cached_prefix(tokens, cache_salt) for n in nodes]
        candidates = list(range(self.nodes))
        if self.balance:
            mean = sum(t for t, _ in loads) / self.nodes
            cap = self.balance * mean + len(tokens)
            fit = [j for j in candidates if loads[j][0] <= cap]
            candidates = fit or [min(candidates, key=lambda j: (*loads[j], j))]
        i = min(candidates, key=lambda j: (-hits[j], *loads[j], j))
        if self.balance and max(hits) > hits[i]:
            self.stats.balanced += 1
        if hits[i]:
            self.stats.prefix_routed += 1
            self.stats.prefix_tokens += hits[i]
            least = min(hits)
            if hits[i] > least:
                self.stats.prefix_won += 1
                self.stats.prefix_won_tokens += hits[i] - least
            else:
                self.stats.prefix_everywhere += 1
        return i


__all__ = ["ROUTINGS", "NodeView", "Router", "RouterStats"]
