"""When a sizing check run can no longer pass, so that it stops there instead of at the end.

A check run passes when the workload's hit rate reaches the target, nothing was preempted and
no request was rejected (`sizing.Trial`). The first preemption or rejection settles it. The
hit rate settles once the hits so far plus the most the prompts not yet admitted could still
hit fall short of `target x prompt tokens`.

The most a prompt could hit: always its tokens below the cap the manager applies (one token
at least is computed). For a trace replayed without aborts, a tighter bound holds: requests
are admitted first come, first served in arrival order (until a preemption or rejection,
which end the check first), so when a prompt is admitted the cache can only hold blocks of
the prompts that arrived before it. Its hit is at most its longest prefix of full blocks that
one of those prompts also had: the hit of a cache that never evicts and registers every
prompt as it arrives (`trace_hit_bounds`, computed per hash id, not per block). It rests on
one premise: trace prompts never contain the tokens a sequence generated (trace tokens are
31-bit pseudo-tokens, generated ones below the 32,000-token vocabulary), so no prompt hits a
block that holds generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pagedkv.sim.requests import Workload
from pagedkv.sim.scheduler import SimResult


def trace_hit_bounds(workload: Workload, block_size: int) -> npt.NDArray[np.int64] | None:
    """Per request in arrival order: the most prompt tokens it can hit (see the module
    docstring); None unless every request is a trace request arriving at a fixed step."""
    reqs = workload.requests
    if not reqs or any(r.hash_ids is None or r.after is not None for r in reqs):
        return None
    order = sorted(reqs, key=lambda r: (r.arrival_step, r.request_id))
    bs = block_size
    trie: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
    most: dict[int, int] = {}  # node -> most full blocks of a prompt through it so far
    out = np.zeros(len(order), dtype=np.int64)
    for i, r in enumerate(order):
        assert r.hash_ids is not None
        n = r.prompt_len
        full, cap = n // bs, (n - 1) // bs
        per_id = r.hash_block_tokens  # Mooncake's 512 tokens per id, Bailian's 16
        node, hit, open_ = 0, 0, True
        nodes: list[int] = []
        for d, h in enumerate(r.hash_ids.tolist()):
            node = trie.setdefault((node, h), len(trie) + 1)
            nodes.append(node)
            if not open_:
                continue
            # Blocks whose last token lies in hash id d: those from lo up to hi (exclusive).
            lo = d * per_id // bs
            hi = min((d + 1) * per_id // bs, cap)
            if lo >= hi:
                open_ = lo < cap
                continue
            seen = most.get(node, 0)
            if seen >= hi:
                hit = hi
            else:
                hit, open_ = max(lo, seen), False
        for node in nodes:
            if most.get(node, 0) < full:
                most[node] = full
        out[i] = hit * bs
    return out


@dataclass(slots=True)
class StopRule:
    """`until` for a check run: True as soon as the run cannot pass any more."""

    target_hits: float  # target x the workload's prompt tokens
    prompt_tokens: int  # the workload's
    # With a bound per request: admitted prompt tokens so far -> the most the rest can hit.
    rest: dict[int, int] | None
    reason: str = ""

    @classmethod
    def build(cls, workload: Workload, block_size: int, target: float, aborts: bool) -> StopRule:
        total = workload.prompt_tokens
        bounds = None if aborts else trace_hit_bounds(workload, block_size)
        rest = None
        if bounds is not None:
            order = sorted(workload.requests, key=lambda r: (r.arrival_step, r.request_id))
            admitted = np.concatenate(([0], np.cumsum([r.prompt_len for r in order])))
            left = np.concatenate((np.cumsum(bounds[::-1])[::-1], [0]))
            rest = dict(zip(admitted.tolist(), left.tolist(), strict=True))
        # The tolerance `Trial.passed` allows.
        return cls((target - 1e-12) * total, total, rest)

    def stop_limits(self) -> tuple[float, int, dict[int, int] | None]:
        """The rule as data, `(target_hits, prompt_tokens, rest)`: the Rust scheduling loop
        (`sim.rust_loop`) evaluates the same test after every step."""
        return self.target_hits, self.prompt_tokens, self.rest

    def __call__(self, res: SimResult) -> bool:
        if res.preemptions:
            self.reason = f"{res.preemptions} preemption{'s' * (res.preemptions != 1)}"
            return True
        if res.rejected_requests:
            self.reason = (
                f"{res.rejected_requests} request{'s' * (res.rejected_requests != 1)} rejected"
            )
            return True
        admitted = res.workload_prompt_tokens
        hits = res.prefix_hit_tokens - res.recomputed_hit_tokens
        if self.rest is not None:
            most = hits + self.rest.get(admitted, self.prompt_tokens - admitted)
        else:
            most = hits + self.prompt_tokens - admitted
        if most < self.target_hits:
            self.reason = f"hit rate at most {most / self.prompt_tokens:.3%}, below the target"
            return True
        return False


__all__ = ["StopRule", "trace_hit_bounds"]
