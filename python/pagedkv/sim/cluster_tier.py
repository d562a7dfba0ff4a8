"""A node's GPU cache over the tier its cluster shares (`sim.cluster`), counting blocks.

`TieredNode` is the node's block manager as its scheduler sees it: the same calls, with a
tier store below the GPU. It follows `pagedkv.tiers.TieredCache`'s rules, without a KV pool:

- demotion: every call that takes GPU blocks is given `evicted=` and puts each cached block
  it evicted into the store, under its chain digest (`TierKey(group, digest)`), before it
  returns, also when it raises;
- promotion: `allocate` continues the prompt's GPU prefix hit with the store's leading run
  of the blocks after it (at least one prompt token is always computed, as on the GPU),
  reads those entries, then allocates the GPU hit plus the blocks read plus the chunk; the
  blocks read count as prefix-hit tokens, exactly as `TieredCache.load` counts them. The
  entries are read before the allocation, so the blocks it demotes cannot push them out
  of a small store first; an entry that cannot be read ends the run there (those blocks
  are computed);
- `can_allocate` with the prompt's tokens counts the blocks the store would give too.

What moves is not KV but the two-byte index of the node that put the entry (the payload of
a real `HostTier` or `RemoteTier` entry, framed and MACed like any other): a hit knows
which node computed the block, across processes and servers too. A store's byte budget is
therefore given in blocks (`entry_bytes` per block). The tokens served from the store are
counted per origin, apart for the workload's own admissions and for recomputations after
a preemption (a sequence allocated before, or a fork's child, allocated again).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from pagedkv.alloc_status import AllocStatus
from pagedkv.tiers.base import TierKey, TierStore
from pagedkv.tiers.entry import HEADER_BYTES

T = TypeVar("T")
Evicted = list[tuple[int, int, bytes]]
ORIGIN_BYTES = 2  # the payload: the putting node's index, little-endian
MAX_NODES = 1 << (8 * ORIGIN_BYTES)


def entry_bytes() -> int:
    """What one stored entry weighs in a host store's budget (header plus payload)."""
    return HEADER_BYTES + ORIGIN_BYTES


class TieredNode:
    """The manager of node `node` with `store` below its GPU (module docstring). Every
    other attribute is the manager's."""

    DUTIES = frozenset({"extend", "append", "append_batch", "truncate", "swap_in", "fork"})

    def __init__(self, manager: Any, store: TierStore, *, node: int, hash_algo: str) -> None:
        if not 0 <= node < MAX_NODES:
            raise ValueError(f"node index must be in [0, {MAX_NODES}), got {node}")
        if not manager.record_evictions:
            raise ValueError("a TieredNode needs a manager built with record_evictions=True")
        if manager.num_groups != 1:
            raise ValueError("a cluster's nodes run managers without KV-cache groups")
        self.m = manager
        self.store = store
        self.node = node
        self.hash_algo = hash_algo
        self._payload = node.to_bytes(ORIGIN_BYTES, "little")
        self._admitted: set[int] = set()  # sequences allocated or forked: again = recompute
        self._memo: tuple[Any, Any, list[TierKey]] | None = None  # (tokens, salt, keys)
        # Tokens served from the store, by the node that put them (workload admissions).
        self.tier_tokens_by_origin: dict[int, int] = {}
        self.recomputed_tier_tokens = 0
        self.blocks_demoted = 0
        self.dropped_puts = 0
        self.blocks_promoted = 0
        self.failed_loads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.m, name)

    # ---- demotion ------------------------------------------------------------------------

    def _with_duty(self, call: Callable[[Evicted], T]) -> T:
        evicted: Evicted = []
        try:
            return call(evicted)
        finally:
            self._demote(evicted)

    def _demote(self, evicted: Evicted) -> None:
        put, payload = self.store.put, self._payload
        for _, group, digest in evicted:
            if not put(TierKey(group, digest), payload):
                self.dropped_puts += 1
        self.blocks_demoted += len(evicted)

    def extend(self, seq_id: int, num_new_tokens: int, *, lookahead: int = 0) -> Any:
        return self._with_duty(
            lambda ev: self.m.extend(seq_id, num_new_tokens, lookahead=lookahead, evicted=ev)
        )

    def append(self, seq_id: int, token_ids: Any, *, lookahead: int = 0) -> Any:
        return self._with_duty(
            lambda ev: self.m.append(seq_id, token_ids, lookahead=lookahead, evicted=ev)
        )

    def append_batch(self, seq_ids: Any, token_ids: Any, *, lookahead: int = 0) -> Any:
        return self._with_duty(
            lambda ev: self.m.append_batch(seq_ids, token_ids, lookahead=lookahead, evicted=ev)
        )

    def truncate(self, seq_id: int, num_tokens: int) -> Any:
        return self._with_duty(lambda ev: self.m.truncate(seq_id, num_tokens, evicted=ev))

    def swap_in(self, seq_id: int) -> Any:
        return self._with_duty(lambda ev: self.m.swap_in(seq_id, evicted=ev))

    def fork(self, parent_id: int, child_id: int) -> None:
        self._admitted.add(child_id)  # its first allocation would be a recomputation
        self._with_duty(lambda ev: self.m.fork(parent_id, child_id, evicted=ev))

    # ---- promotion -----------------------------------------------------------------------

    def _keys(self, tokens: npt.NDArray[np.uint32], salt: Any) -> list[TierKey]:
        """The store keys of the prompt's full blocks. The scheduler asks `can_allocate` and
        `allocate` with the same prompt, and `can_allocate` again each step a prompt waits
        (a trace prompt is rebuilt each time): they are hashed once per prompt."""
        memo = self._memo
        if (
            memo is not None
            and memo[1] == salt
            and (memo[0] is tokens or np.array_equal(memo[0], tokens))
        ):
            return memo[2]
        from pagedkv import hash_blocks

        digests = hash_blocks(
            tokens,
            self.m.block_size,
            cache_salt=salt,
            hash_algo=self.hash_algo,  # type: ignore[arg-type]
        )
        keys = [TierKey(0, d) for d in digests]
        self._memo = (tokens, salt, keys)
        return keys

    def _match(self, tokens: npt.NDArray[np.uint32], salt: Any) -> tuple[int, list[TierKey]]:
        """The GPU hit (blocks) and the keys of the blocks after it that the store holds."""
        bs = self.m.block_size
        keys = self._keys(tokens, salt)
        gpu = self.m.lookup(tokens, cache_salt=salt) // bs
        cap = (len(tokens) - 1) // bs  # at least one token computed, as on the GPU
        if gpu >= cap:
            return gpu, []
        run = self.store.count_present(keys[gpu:cap])
        return gpu, keys[gpu : gpu + run]

    def can_allocate(
        self,
        num_tokens: Any,
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
    ) -> AllocStatus:
        """`can_allocate`; given the prompt's tokens and a chunk, the blocks the store would
        give need GPU blocks too."""
        if isinstance(num_tokens, int) or num_new_tokens is None:
            status: AllocStatus = self.m.can_allocate(
                num_tokens, num_new_tokens=num_new_tokens, cache_salt=cache_salt
            )
            return status
        bs = self.m.block_size
        gpu, run = self._match(num_tokens, cache_salt)
        new = min(len(run) * bs + num_new_tokens, len(num_tokens) - gpu * bs)
        status = self.m.can_allocate(num_tokens, num_new_tokens=new, cache_salt=cache_salt)
        return status

    def allocate(
        self,
        seq_id: int,
        token_ids: npt.NDArray[np.uint32],
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
    ) -> int | None:
        """`allocate` with the store's blocks read and counted as hit (module docstring):
        the prefix-hit tokens, or None (nothing allocated; the entries read stay read)."""
        bs = self.m.block_size
        n = len(token_ids)
        gpu, run = self._match(token_ids, cache_salt)
        origins: list[int] = []
        for key in run:
            data = self.store.get(key)
            if data is None or len(data) != ORIGIN_BYTES:
                self.failed_loads += 1
                break
            origins.append(int.from_bytes(data, "little"))
        k = n if num_new_tokens is None else num_new_tokens
        new = min(len(origins) * bs + k, n - gpu * bs)
        hit = self._with_duty(
            lambda ev: self.m.allocate(
                seq_id, token_ids, num_new_tokens=new, cache_salt=cache_salt, evicted=ev
            )
        )
        if hit is None:
            return None
        if hit != gpu * bs:
            # One thread drives this manager: its hit cannot change between lookup and
            # allocate. If it did, the blocks read would not be the ones scheduled.
            self.m.free(seq_id)
            raise RuntimeError(f"the GPU hit changed under the node: {gpu * bs} then {hit}")
        self.blocks_promoted += len(origins)
        if seq_id in self._admitted:
            self.recomputed_tier_tokens += len(origins) * bs
        else:
            self._admitted.add(seq_id)
            by = self.tier_tokens_by_origin
            for o in origins:
                by[o] = by.get(o, 0) + bs
        total: int = hit + len(origins) * bs
        return total

    # ---- figures -------------------------------------------------------------------------

    def figures(self) -> dict[str, Any]:
        """What the node took from and gave to the store."""
        by = self.tier_tokens_by_origin
        own = by.get(self.node, 0)
        return {
            "tier_tokens": sum(by.values()),
            "tier_tokens_own": own,
            "tier_tokens_cross": sum(by.values()) - own,
            "tier_tokens_by_origin": {str(k): v for k, v in sorted(by.items())},
            "recomputed_tier_tokens": self.recomputed_tier_tokens,
            "blocks_demoted": self.blocks_demoted,
            "dropped_puts": self.dropped_puts,
            "blocks_promoted": self.blocks_promoted,
            "failed_loads": self.failed_loads,
        }


__all__ = ["MAX_NODES", "ORIGIN_BYTES", "TieredNode", "entry_bytes"]
