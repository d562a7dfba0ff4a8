"""A miss-ratio curve: the prefix-cache hit rate of every LRU cache size (`mrc.MRCRecorder`
computes it from a replay).

One number per block of the workload's prompts that ever hits: the smallest cache size at
which it does. Sorted, they answer every question by a binary search: the hit rate at a size,
the smallest size for a hit rate, the size past which the curve is flat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

_NEVER = np.inf


@dataclass(frozen=True, slots=True)
class MissRatioCurve:
    """The hit rate of every LRU cache size, over a replay's prompt lookups."""

    block_size: int
    sample_rate: float  # 1.0: exact
    thresholds: npt.NDArray[np.float64]  # sorted: per block that ever hits, the size it hits at
    prompt_tokens: int  # the lookups' prompt tokens (the denominator)
    lookups: int
    touches: int  # touches recorded (sampled ones only when sampling)
    distinct_blocks: int  # distinct blocks touched (scaled when sampling)
    # "scheduled": recorded from a full replay through the scheduler and the manager
    # (`mrc_fast`); "cache": a pure cache replay of the trace's ids, block by block, in file
    # order (`mrc_blocks`): no scheduler, nothing pinned or preempted.
    replay: str = "scheduled"

    @property
    def exact(self) -> bool:
        return self.sample_rate >= 1.0

    @property
    def tokens_per_hit(self) -> float:
        """Prompt tokens one recorded hit stands for."""
        return self.block_size / self.sample_rate

    def hit_rate(self, num_blocks: float) -> float:
        """The prefix-cache hit rate of an LRU cache of `num_blocks` blocks."""
        if not self.prompt_tokens:
            return 0.0
        n = int(np.searchsorted(self.thresholds, num_blocks, side="right"))
        return min(1.0, n * self.tokens_per_hit / self.prompt_tokens)

    @property
    def unbounded_hit_rate(self) -> float:
        return self.hit_rate(_NEVER)

    @property
    def largest_useful_size(self) -> int:
        """The size past which the curve is flat: every hit it will ever have is in."""
        return int(np.ceil(self.thresholds[-1])) if len(self.thresholds) else 0

    def smallest_size(self, target: float) -> int | None:
        """The fewest blocks whose hit rate reaches `target`; None if no size does."""
        if target <= 0:
            return 0
        need = int(np.ceil(target * self.prompt_tokens / self.tokens_per_hit - 1e-9))
        if need > len(self.thresholds):
            return None
        return int(np.ceil(self.thresholds[need - 1]))

    def points(self, count: int = 96) -> list[list[float]]:
        """`[num_blocks, hit_rate]` at about `count` sizes spread evenly on a log scale, from
        one block to the size past which the curve is flat (that size included)."""
        top = self.largest_useful_size
        if top < 1:
            return [[1, self.hit_rate(1)]]
        sizes = np.unique(np.round(np.geomspace(1, top, count)).astype(np.int64))
        return [[int(s), self.hit_rate(float(s))] for s in sizes]

    def method(self) -> str:
        """How the curve was computed, in words (for the output)."""
        if self.replay == "cache":
            return (
                f"a pure cache replay of the trace's ids in file order, block by block (no "
                f"scheduler: nothing pinned, chunked or preempted); exact LRU stack distances "
                f"over {self.touches} block touches"
            )
        if self.exact:
            return f"exact LRU stack distances over {self.touches} block touches"
        return (
            f"SHARDS sampling of 1 block key in {1 / self.sample_rate:.0f} "
            f"({self.touches} sampled touches): an estimate"
        )


__all__ = ["MissRatioCurve"]
