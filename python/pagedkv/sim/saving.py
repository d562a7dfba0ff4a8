"""What a hybrid model's KV-cache groups save against all-full attention (`simulate --model`).

Two figures, each said with how it was obtained:

- at equal memory (always): both runs get the same bytes, and on a busy workload both fill
  them, so the saving shows as tokens, not bytes. `bytes_per_held_token` (held bytes / the
  token positions the held blocks cover, over every step, `model_run.group_figures`) is what
  each layout pays per token once sharing is set aside; the all-full one over the model's is
  how many times the tokens the model's layout holds in the same memory.
- at equal hits (`--equal-hits`): more runs of each layout at other pool sizes, doubling
  or halving from the budget and then bisecting to 1/32 of it, find the smallest pool tried
  whose workload hit rate reaches the all-full run's at the budget; the saving is what
  all-full attention needs less what the model's layout needs (negative: the model's layout
  needs more memory for the same hits). Both are searched: where the workload does not fill
  the budget, all-full attention needs less than the budget too.

And why the hit rates differ (`hit_limits`): what the full-attention groups alone had cached,
and how much each other group cut from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedkv.sim.models import Layout

BISECT_FRACTION = 32  # the equal-hits search stops when its bracket is budget / 32 wide
MAX_DOUBLINGS = 4  # at most 16x the budget (or 1/16 of it)
FULL_SHARE = 0.99


def saving_figures(section: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """The saving at equal memory and the hit-rate split, from the two runs' sections."""
    m, a = section["model"], section["all_full"]
    per_m, per_a = m["bytes_per_held_token"], a["bytes_per_held_token"]
    out: dict[str, Any] = {
        "budget_gib": section["budget_gib"],
        "bytes_per_held_token": {"model": per_m, "all_full": per_a},
        "bytes_per_live_token": {"model": m["bytes_per_token"], "all_full": a["bytes_per_token"]},
        "tokens_ratio_at_equal_memory": per_a / per_m if per_m else None,
        # full: 99% of the pool held at the peak (a pool of groups keeps a null block, and
        # takes one block per group for each new block of tokens)
        "pools_full": {
            "model": m["peak_blocks"] >= FULL_SHARE * m["num_blocks"],
            "all_full": a["peak_blocks"] >= FULL_SHARE * a["num_blocks"],
        },
        "workload_hit_rate": {"model": m["workload_hit_rate"], "all_full": a["workload_hit_rate"]},
        "equal_hits": None,
    }
    limits = m.get("hit_limits")
    if limits is not None and limits["prompt_tokens"]:
        p = limits["prompt_tokens"]
        cuts = limits["cut_tokens"]
        worst = max(range(len(cuts)), key=cuts.__getitem__)
        spec = m["groups"][worst]["spec"]
        out["hit_split"] = {
            "full_groups_hit_rate": limits["full_hit_tokens"] / p,
            "hit_rate": limits["hit_tokens"] / p,
            "cut_rate": [c / p for c in cuts],
            "most_cut_group": worst if cuts[worst] else None,
            "most_cut_kind": spec if cuts[worst] else None,
            # the groups of that kind (several groups of one kind cut about alike)
            "most_cut_groups": [g["group"] for g in m["groups"] if g["spec"] == spec]
            if cuts[worst]
            else [],
            "disagreements": limits["disagreements"],
        }
    return out


def search_equal_hits(
    replay: Callable[..., tuple[dict[str, Any], dict[str, Any]]],
    layout: Layout,
    num_blocks: int,
    known: float,
    target: float,
) -> dict[str, Any]:
    """The smallest pool of `layout` tried whose workload hit rate reaches `target`, starting
    from `num_blocks` (the budget's pool, whose hit rate is `known`). `replay(layout, n,
    label)` runs one size."""
    tried: dict[int, float] = {num_blocks: known}

    def rate(n: int) -> float:
        if n not in tried:
            f, _ = replay(layout, n, f"equal hits {n} blocks of {layout.bytes_per_block} bytes")
            tried[n] = f["workload_hit_rate"]
        return tried[n]

    step = max(1, num_blocks // BISECT_FRACTION)
    if rate(num_blocks) >= target:
        hi, lo = num_blocks, num_blocks
        for _ in range(MAX_DOUBLINGS):
            lo = max(2, lo // 2)
            if rate(lo) < target or lo == 2:
                break
            hi = lo
    else:
        lo, hi = num_blocks, num_blocks
        for _ in range(MAX_DOUBLINGS):
            hi *= 2
            if rate(hi) >= target:
                break
            lo = hi
    reached = rate(hi) >= target
    if reached:
        while hi - lo > step:
            mid = (lo + hi) // 2
            if rate(mid) >= target:
                hi = mid
            else:
                lo = mid
    found = layout.gib(hi)
    return {
        "target_hit_rate": target,
        "reached": reached,
        "num_blocks": hi if reached else None,
        "gib": found if reached else None,
        "hit_rate": tried[hi] if reached else None,
        "largest_tried_gib": layout.gib(max(tried)),
        "runs": [[n, tried[n]] for n in sorted(tried)],
        "more_runs": len(tried) - 1,
        "step_blocks": step,
    }


def equal_hits(model: dict[str, Any], all_full: dict[str, Any], target: float) -> dict[str, Any]:
    """The two searches (`search_equal_hits`) and the memory saved, when both reached it."""
    both = model["reached"] and all_full["reached"]
    return {
        "target_hit_rate": target,
        "model": model,
        "all_full": all_full,
        "saved_gib": all_full["gib"] - model["gib"] if both else None,
        "more_runs": model["more_runs"] + all_full["more_runs"],
    }


__all__ = ["BISECT_FRACTION", "equal_hits", "saving_figures", "search_equal_hits"]
