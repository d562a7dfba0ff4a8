"""`--eviction`'s optimal bound: Belady's offline optimum under the prefix constraint (a block
kept only with its parent; among cached blocks with no cached child, the one looked up again
furthest ahead evicted), at the runs' cache size, over the stream of lookups and touches that
one run recorded (`mrc_fast.FastMRCRecorder`; the LRU run when LRU is among the policies).

It is the pure cache model of that run's schedule: the blocks running sequences hold are not
pinned and the schedule is the recorded run's, so the bound is what any eviction order could
hit on that stream, not a figure a manager run could reproduce exactly. Beside it the output
gives LRU over the same stream (the curve's model), so that the model's distance from the
manager's own LRU run shows; and per policy, the share of LRU's gap to the bound it closes:
the policy's gain over LRU in the manager's runs (workload hit rates) over the optimum's gain
over LRU on the stream, `(policy - LRU) / (optimum - stream LRU)`: each difference taken
within one model, so that the model's own distance from the manager (pinned blocks, its
preemptions) does not count as a gap any policy could close. 0: LRU's hit rate; 1: the gain
the optimum has.
"""

from __future__ import annotations

from typing import Any

from pagedkv.sim.mrc_fast import FastMRCRecorder


def stream_bound(recorder: FastMRCRecorder, num_blocks: int, source: str) -> dict[str, Any]:
    """The optimum's and LRU's hit rates at `num_blocks` over `recorder`'s stream (exact)."""
    if recorder.sample_rate < 1.0:
        raise ValueError("the optimal bound needs an exact stream (no sampling)")
    opt, lru = (recorder.hits([num_blocks], p)[0] for p in ("optimal", "lru"))
    tokens = recorder.prompt_tokens
    per = recorder.block_size / tokens if tokens else 0.0
    return {
        "source_policy": source,
        "num_blocks": num_blocks,
        "optimal_hit_rate": opt * per,
        "stream_lru_hit_rate": lru * per,
        "prompt_tokens": tokens,
        "model": "pure cache replay of the source run's lookups and touches (nothing pinned)",
    }


def gap_closed(hit: float, lru: float, bound: dict[str, Any]) -> float | None:
    """The share of LRU's gap to the optimum that a policy with workload hit rate `hit`
    closes, LRU's run having `lru` (see the module docstring); None without a gap."""
    gap = bound["optimal_hit_rate"] - bound["stream_lru_hit_rate"]
    return (hit - lru) / gap if gap > 1e-12 else None


__all__ = ["gap_closed", "stream_bound"]
