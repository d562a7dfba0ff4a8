"""How `--mrc` prints and saves: the curve as a table, the recommendation, their JSON."""

from __future__ import annotations

from typing import Any

import numpy as np

from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.sizing import Recommendation

TABLE_ROWS = 14  # sizes shown; the JSON has the whole curve
START_FRACTION = 0.01  # the table starts where the curve reaches this share of its top


def _sizes(curve: MissRatioCurve) -> list[int]:
    """Powers of two from where the curve reaches 1% of its top to where it goes flat (that
    size last), thinned to about TABLE_ROWS."""
    top = curve.largest_useful_size
    if top < 1:
        return [1]
    first = max(1, curve.smallest_size(START_FRACTION * curve.unbounded_hit_rate) or 1)
    lo, hi = int(np.floor(np.log2(first))), int(np.floor(np.log2(top)))
    powers = list(range(lo, hi + 1))
    stride = -(-len(powers) // (TABLE_ROWS - 1))
    sizes = [1 << p for p in powers[::stride]]
    return [s for s in sizes if s < top] + [top]


def mrc_table(curve: MissRatioCurve, kv: KVBytes | None) -> str:
    """The curve at a few sizes: blocks (tokens, GiB) against hit rate."""
    bs = curve.block_size
    head = f"miss-ratio curve, block size {bs} ({curve.method()}; {curve.lookups} prompts)"
    cols = ["blocks", "tokens", *(["GiB"] if kv else []), "hit rate"]
    rows = [cols]
    for n in _sizes(curve):
        row = [str(n), str(n * bs)]
        if kv:
            row.append(f"{kv.gib(n, bs):.2f}")
        row.append(f"{curve.hit_rate(n):.2%}")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines[-1] += "  (flat from here: every hit the workload has)"
    return "\n".join([head, *("  " + line for line in lines)])


def _size(n: int, bs: int, kv: KVBytes | None) -> str:
    gib = f" = {kv.gib(n, bs):.2f} GiB" if kv else ""
    return f"{n} blocks ({n * bs} tokens{gib})"


def recommendation_lines(recs: list[Recommendation], kv: KVBytes | None) -> str:
    """The summary's last lines: per block size, the smallest size that passed."""
    lines = ["sizing      the smallest cache that reaches the target hit rate, no preemption"]
    for r in recs:
        bs = r.block_size
        head = f"  block {bs:<4}target {r.target:.2%}{r.target_note}: "
        if r.estimate is None:
            lines.append(head + "no cache size reaches it (the curve is flat below it)")
            continue
        tried = ", ".join(
            f"{t.num_blocks} {'ok' if t.passed else '(' + t.why() + ')'}" for t in r.trials
        )
        best = r.passed
        if best is None:
            lines.append(head + f"none of the sizes tried passed; curve estimate {r.estimate}")
        else:
            lines.append(
                head + f"{_size(best.num_blocks, bs, kv)}, hit rate {best.hit_rate:.2%} "
                f"(curve estimate {r.estimate})"
            )
        lines.append(f"              runs: {tried}")
    return "\n".join(lines)


def curve_json(curve: MissRatioCurve) -> dict[str, Any]:
    """`mrc` (`[num_blocks, hit_rate]` pairs) and how it was computed (`mrc_info`)."""
    return {
        "mrc": curve.points(),
        "mrc_info": {
            "method": "exact" if curve.exact else "shards",
            "sample_rate": curve.sample_rate,
            "block_size": curve.block_size,
            "unbounded_hit_rate": curve.unbounded_hit_rate,
            "flat_from_blocks": curve.largest_useful_size,
            "distinct_blocks": curve.distinct_blocks,
            "prompt_lookups": curve.lookups,
            "prompt_tokens": curve.prompt_tokens,
            "touches": curve.touches,
        },
    }


def recommendation_json(r: Recommendation, kv: KVBytes | None) -> dict[str, Any]:
    bs = r.block_size
    best = r.passed
    return {
        "block_size": bs,
        "target_hit_rate": r.target,
        "curve_estimate_blocks": r.estimate,
        "num_blocks": r.num_blocks,
        "gib": kv.gib(r.num_blocks, bs) if kv and r.num_blocks is not None else None,
        "hit_rate": best.hit_rate if best else None,
        "runs": [
            {
                "num_blocks": t.num_blocks,
                "hit_rate": t.hit_rate,
                "preemptions": t.preemptions,
                "rejected_requests": t.rejected,
                "passed": t.passed,
            }
            for t in r.trials
        ],
    }


__all__ = ["curve_json", "mrc_table", "recommendation_json", "recommendation_lines"]
