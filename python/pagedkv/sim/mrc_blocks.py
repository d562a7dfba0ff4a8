"""A trace's curve without replaying its tokens: a pure cache replay at block granularity.

A trace given as hash ids (Mooncake's, one id per 512-token block naming it with its prefix;
Bailian's 16-token ids once chained) already says which blocks prompts share. Its curve needs
no scheduler and no tokens: `pagedkv._core.BlockReplay` (pagedkv-sim's `block_replay`) keys
each prompt's full blocks straight from its ids (in blocks of `block_size` tokens, when one of
`block_size` and the trace's tokens per id divides the other), looks them up in file order
(all but a last block that would leave no token to compute) and touches them tail first, then
runs the exact LRU stack distances over that stream: milliseconds for a trace of 61 M prompt
tokens at 512 tokens a block.

What it is, said where it is printed: a pure cache replay (what the other sizing tools
compute), not the scheduled replay of `mrc_fast` (running sequences pin their blocks,
prompts are chunked, requests overlap and may be preempted). The same stream also gives, per
cache size, FIFO's hits and Belady's offline optimum under the prefix constraint
(`BlockReplay.hits`; `policy_replay` in Rust).

`warmup`: the share of the requests (the first ones, in file order) whose lookups are replayed
but not counted, as kvcache-simulator counts the last half only.
"""

from __future__ import annotations

import numpy as np

from pagedkv._core import BlockReplay
from pagedkv.sim.block_keys import root
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.requests import Workload


def unfit_reason(workload: Workload, block_size: int) -> str | None:
    """Why `workload` has no block-granularity replay at `block_size` (None: it has one)."""
    if not workload.requests:
        return "the workload has no requests"
    if any(r.hash_ids is None for r in workload.requests):
        return "its requests carry tokens, not hash ids"
    per_id = {r.hash_block_tokens for r in workload.requests}
    if len(per_id) > 1:
        return f"its requests mix {sorted(per_id)} tokens per id"
    t = per_id.pop()
    if t % block_size and block_size % t:
        return f"block size {block_size} and {t} tokens per id: neither divides the other"
    return None


def first_counted(workload: Workload, warmup: float) -> int:
    """The first request whose lookup counts, with the first `warmup` share left out."""
    if not 0.0 <= warmup < 1.0:
        raise ValueError(f"warmup must be in [0, 1), got {warmup}")
    return int(len(workload.requests) * warmup)


def block_replay(workload: Workload, block_size: int) -> BlockReplay:
    """The pure cache replay of `workload` (a trace of hash ids) in blocks of `block_size`."""
    why = unfit_reason(workload, block_size)
    if why is not None:
        raise ValueError(f"no block-granularity replay at block size {block_size}: {why}")
    reqs = workload.requests
    ids = [r.hash_ids for r in reqs]
    offsets = np.zeros(len(reqs) + 1, dtype=np.uint64)
    np.cumsum([len(a) for a in ids if a is not None], out=offsets[1:])
    flat = np.concatenate([a for a in ids if a is not None]).astype(np.uint64)
    lengths = np.fromiter((r.prompt_len for r in reqs), dtype=np.uint64, count=len(reqs))
    roots_of: dict[str | None, int] = {}
    for r in reqs:
        if r.cache_salt not in roots_of:
            roots_of[r.cache_salt] = root(r.cache_salt, None)
    roots = np.fromiter((roots_of[r.cache_salt] for r in reqs), dtype=np.uint64, count=len(reqs))
    return BlockReplay(flat, offsets, lengths, roots, reqs[0].hash_block_tokens, block_size)


def block_curve(
    workload: Workload, block_size: int, *, warmup: float = 0.0, replay: BlockReplay | None = None
) -> MissRatioCurve:
    """The LRU curve of the pure cache replay (exact), over the requests past `warmup`."""
    first = first_counted(workload, warmup)
    replay = replay or block_replay(workload, block_size)
    thresholds, touches, distinct = replay.curve(first)
    counted = workload.requests[first:]
    return MissRatioCurve(
        block_size=block_size,
        sample_rate=1.0,
        thresholds=thresholds,
        prompt_tokens=sum(r.prompt_len for r in counted),
        lookups=len(counted),
        touches=int(touches),
        distinct_blocks=int(distinct),
        replay="cache",
    )


def policy_hit_rates(
    curve: MissRatioCurve,
    replay: BlockReplay,
    sizes: list[int],
    policy: str,
    *,
    first_lookup: int = 0,
) -> list[float]:
    """`policy`'s hit rate (`lru`, `fifo`, `optimal`) at each of `sizes`, in `curve`'s terms
    (prompt tokens of the counted lookups)."""
    blocks = replay.hits(sizes, policy, first_lookup)
    if not curve.prompt_tokens:
        return [0.0 for _ in sizes]
    return [b * curve.block_size / curve.prompt_tokens for b in blocks]


__all__ = ["block_curve", "block_replay", "first_counted", "policy_hit_rates", "unfit_reason"]
