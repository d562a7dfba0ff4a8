"""The optimal bound beside the curve: at a few cache sizes, the hit rate of LRU (the curve),
FIFO and Belady's offline optimum under the prefix constraint (a block kept only with its
parent; among blocks with no cached child, the one looked up again furthest ahead evicted),
over the same stream of lookups and touches (`policy_replay` in pagedkv-sim).

The optimum reads the future: no policy reaches it, none passes it on that stream. "LRU's
share" is LRU's hit rate over the optimum's: how much of what any policy could hit at that
size LRU gets.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.mrc_curve import MissRatioCurve

BOUND_ROWS = 6  # sizes of the bound's table
POLICIES = ("lru", "fifo", "optimal")


class HitsSource(Protocol):
    """A stream that replays one size at a time (`BlockReplay`, `MrcStream`)."""

    def hits(self, capacities: Any, policy: str, first_lookup: int) -> list[int]: ...


def bound_sizes(curve: MissRatioCurve, extra: tuple[int, ...] = ()) -> list[int]:
    """`BOUND_ROWS` sizes spread on a log scale from where the curve reaches a tenth of its top
    to where it goes flat, and `extra` (the target's size)."""
    top = curve.largest_useful_size
    if top < 1:
        return sorted({1, *extra})
    first = max(1, curve.smallest_size(0.1 * curve.unbounded_hit_rate) or 1)
    sizes = {int(n) for n in np.unique(np.round(np.geomspace(first, top, BOUND_ROWS)))}
    return sorted(sizes | {n for n in extra if n >= 1})


def bound_rates(
    curve: MissRatioCurve, source: HitsSource, sizes: list[int], first_lookup: int = 0
) -> dict[str, list[float]]:
    """Per policy, the hit rate at each of `sizes`, in `curve`'s terms (its prompt tokens).
    LRU's is read off the curve: LRU replayed on the curve's own stream hits exactly that
    (`tests/sim/test_sim_mrc_blocks.py` and the Rust tests check it), one replay fewer."""
    out: dict[str, list[float]] = {"lru": [curve.hit_rate(n) for n in sizes]}
    for policy in POLICIES[1:]:
        blocks = source.hits(sizes, policy, first_lookup)
        tokens = curve.prompt_tokens
        out[policy] = [b * curve.block_size / tokens if tokens else 0.0 for b in blocks]
    return out


def bound_table(
    curve: MissRatioCurve, sizes: list[int], rates: dict[str, list[float]], kv: KVBytes | None
) -> str:
    bs = curve.block_size
    head = (
        f"optimal bound, block size {bs}: Belady's offline optimum under the prefix constraint "
        "beside LRU and FIFO, over the curve's own stream"
    )
    cols = ["blocks", "tokens", *(["GiB"] if kv else []), "LRU", "FIFO", "optimal", "LRU's share"]
    table = [cols]
    for i, n in enumerate(sizes):
        lru, fifo, opt = (rates[p][i] for p in POLICIES)
        row = [str(n), str(n * bs)]
        if kv:
            row.append(f"{kv.gib(n, bs):.2f}")
        share = f"{lru / opt:.0%}" if opt > 0 else "-"
        row += [f"{lru:.2%}", f"{fifo:.2%}", f"{opt:.2%}", share]
        table.append(row)
    widths = [max(len(r[i]) for r in table) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([head, *("  " + line for line in lines)])


def bound_json(sizes: list[int], rates: dict[str, list[float]]) -> list[dict[str, Any]]:
    return [
        {"num_blocks": n, **{f"{p}_hit_rate": rates[p][i] for p in POLICIES}}
        for i, n in enumerate(sizes)
    ]


__all__ = ["BOUND_ROWS", "bound_json", "bound_rates", "bound_sizes", "bound_table"]
