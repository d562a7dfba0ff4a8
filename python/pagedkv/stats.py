"""A snapshot of the manager's counters, and its printout."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

from pagedkv.groups import has_null_block


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One KV-cache group's share of the pool (managers built with `groups=`)."""

    kind: str
    used_blocks: int
    cached_blocks: int
    usage: float
    hit_blocks: int
    evictions: int
    registered_blocks: int


@dataclass(frozen=True, slots=True)
class Stats:
    """Block counts, prefix-cache hits (in tokens), evictions, copies, swaps, fragmentation."""

    num_blocks: int
    block_size: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    num_cpu_blocks: int
    free_cpu_blocks: int
    num_sequences: int
    prefix_queries: int
    prefix_hits: int
    evictions: int
    cow_copies: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    reserved_slots: int
    used_slots: int
    recent_prefix_queries: int
    recent_prefix_hits: int
    registered_blocks: int
    unregistered_blocks: int
    truncated_blocks: int
    groups: tuple[GroupStats, ...] = ()

    @property
    def usage(self) -> float:
        """Fraction of usable GPU blocks held by sequences (cached blocks are not in use);
        with a group that is not full attention, block 0 is the null block and not usable."""
        usable = self.num_blocks - has_null_block(self.groups)
        return self.used_blocks / usable if usable > 0 else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def recent_hit_rate(self) -> float:
        """`hit_rate` over the last 1,000 allocations (vLLM's window)."""
        if not self.recent_prefix_queries:
            return 0.0
        return self.recent_prefix_hits / self.recent_prefix_queries

    @property
    def fragmentation(self) -> float:
        """Unused slots in the blocks that sequences hold, over all those slots."""
        if not self.reserved_slots:
            return 0.0
        return 1.0 - self.used_slots / self.reserved_slots

    def as_dict(self) -> dict[str, object]:
        """Every counter and derived ratio, by name (`groups` as a list of dicts)."""
        out: dict[str, object] = asdict(self)
        out["groups"] = [asdict(g) for g in self.groups]
        out.update(
            usage=self.usage,
            hit_rate=self.hit_rate,
            recent_hit_rate=self.recent_hit_rate,
            fragmentation=self.fragmentation,
        )
        return out

    def __str__(self) -> str:
        b = self.block_size
        return "\n".join(
            [
                f"GPU blocks  {self.num_blocks} x {b} tokens: {self.used_blocks} used, "
                f"{self.cached_blocks} cached, {self.free_blocks} free "
                f"(usage {self.usage:.1%})",
                f"CPU blocks  {self.num_cpu_blocks}: {self.free_cpu_blocks} free",
                f"sequences   {self.num_sequences}",
                f"prefix hits {self.prefix_hits} of {self.prefix_queries} tokens "
                f"(hit rate {self.hit_rate:.1%}; last 1000 requests {self.recent_hit_rate:.1%})",
                f"registered  {self.registered_blocks} blocks; {self.unregistered_blocks} "
                f"withdrawn on abort, {self.truncated_blocks} truncated",
                f"evictions   {self.evictions}; copy-on-write copies {self.cow_copies}",
                f"swapped     {self.swapped_out_blocks} blocks out, {self.swapped_in_blocks} in",
                f"slots       {self.used_slots} of {self.reserved_slots} used "
                f"(fragmentation {self.fragmentation:.1%})",
            ]
        )


class TenantStats(NamedTuple):
    """One tenant's share of the cache (`BlockManager(tenants=True).tenant_stats()`): the
    requests of one cache salt (None: without one). A snapshot, exact when no call runs.

    A named tuple (immutable, like the other stats): a call returns one per tenant, 200,000
    of them at 200,000 salts, and a tuple is built about six times faster than a frozen
    dataclass, which held the GIL for most of `tenant_stats()` there (issue 32)."""

    cache_salt: bytes | None
    held_blocks: int  # distinct GPU blocks its live sequences hold
    cached_blocks: int  # its CACHED blocks (pinned ones included)
    prefix_queries: int  # prompt tokens of its successful allocations
    prefix_hits: int  # of those, tokens found cached
    max_cached: int | None  # its quota's cap (None: none)
    reserved: int  # its quota's reserve

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache over prompt tokens looked up."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


__all__ = ["GroupStats", "Stats", "TenantStats"]
