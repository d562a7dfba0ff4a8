"""`--routing prefix` through the router index (`pagedkv.router`), as a KV-aware router in
front of real engines sees the nodes: each node's KV events, encoded in vLLM's wire format,
applied to one `RouterIndex` after every step (the node's engine id is its index); for a
request, one lookup gives every node's cached prefix of the prompt.

A node's index set is its manager's registered GPU blocks (every event it recorded), which
is what its `lookup` serves from; the hit is capped as `lookup` caps it (at least one token
computed: `(len - 1) // block_size` blocks), so routing decides as it did with each node's
own `lookup`. Not for hybrid models (`--model` with KV-cache groups): a sliding window or a
recurrent state serves a hit by rules of its own, which a set of blocks per group does not
encode; those runs route by the nodes' own `lookup`, as they did before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.config import BlockManagerConfig
from pagedkv.router import RouterIndex


def index_routing_available(config: BlockManagerConfig) -> bool:
    """Whether the run can route by the index: one KV-cache group, and msgspec (the events
    extra) to write vLLM's wire format."""
    if config.groups is not None and len(config.groups) > 1:
        return False
    try:
        import msgspec  # noqa: F401
    except ImportError:
        return False
    return True


class ClusterIndex:
    """The nodes' KV events in one router index."""

    def __init__(self, config: BlockManagerConfig, nodes: int) -> None:
        from pagedkv.kv_events.wire import WireEncoder  # msgspec: the events extra

        self.index = RouterIndex(
            block_size=config.block_size,
            hash_algo=config.hash_algo,
            hash_seed=config.hash_seed,
            max_holders=max(64, 2 * nodes),  # GPU and CPU (swap) per node
        )
        self.block_size = config.block_size
        self.nodes = nodes
        self._encoder = WireEncoder()
        self.payloads = 0
        self.events = 0

    def feed(self, node: int, manager: Any) -> None:
        """Apply what `manager` (node `node`'s) recorded since the last call."""
        events = manager.drain_events()
        if events:
            self.index.apply(node, self._encoder.batch(events))
            self.payloads += 1
            self.events += len(events)

    def figures(self) -> dict[str, Any]:
        s = self.index.stats()
        return {
            "payloads": self.payloads,
            "events": self.events,
            "memberships": s.memberships,
            "orphans": s.orphans,
            "duplicates": s.duplicates,
            "unknown_removals": s.unknown_removals,
            "bytes": s.bytes,
        }

    def hits(self, tokens: npt.NDArray[np.uint32], cache_salt: str | None) -> list[int]:
        """Each node's cached prefix of the prompt, in tokens, capped as `lookup` caps it."""
        out = [0] * self.nodes
        n = len(tokens)
        if n < 2:
            return out
        cap = (n - 1) // self.block_size
        full = tokens[: cap * self.block_size]  # the blocks a hit may serve, no more hashed
        for e, medium, group, blocks in self.index.match_tokens(full, cache_salt=cache_salt):
            if medium == "GPU" and group == 0:
                out[int(e)] = blocks * self.block_size
        return out


__all__ = ["ClusterIndex", "index_routing_available"]
