"""The eviction-policy table (`sim.policies`): one row per policy, then one per policy and
tenant when requests carry cache salts.

Columns: the hit rate of every allocation (recomputes included), the workload's own hit rate
(recomputes left out: the headline), evictions, preemptions (swapped / recomputed), the
manager time (CPU time of the run's calls replayed) and the mean `allocate` call, and the
manager time against LRU's when LRU ran too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLUMNS = (
    "policy",
    "hit rate",
    "workload hit rate",
    "evictions",
    "preempt s/r",
    "mgr s",
    "alloc us",
    "mgr vs lru",
)
TENANT_COLUMNS = (
    "policy",
    "tenant",
    "prompt tokens",
    "hit tokens",
    "hit rate",
    "workload hit rate",
)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> str:
    """The first `left` columns (the names) left-aligned, the figures right-aligned, a rule
    under the header."""
    table = [list(header), *map(list, rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _row(f: dict[str, Any], lru: dict[str, Any] | None) -> list[str]:
    alloc = f.get("allocate_mean_seconds")
    mgr = f["policy_manager_seconds"]
    if lru is not None and lru["policy_manager_seconds"] > 0:
        vs = f"{mgr / lru['policy_manager_seconds']:.2f}x"
    else:
        vs = "-"
    return [
        f["eviction"],
        f"{f['prefix_hit_rate']:.2%}",
        f"{f['workload_hit_rate']:.2%}",
        f"{f['evictions']}",
        f"{f['preempted_swap']}/{f['preempted_recompute']}",
        f"{mgr:.3f}",
        f"{alloc * 1e6:.1f}" if alloc is not None else "-",
        vs,
    ]


def tenant_label(tenant: str | None) -> str:
    return "(no salt)" if tenant is None else tenant


def has_tenants(runs: Sequence[dict[str, Any]]) -> bool:
    """Whether any request carried a salt (else the tenant table would repeat the totals)."""
    return any(t["tenant"] is not None for f in runs for t in f["tenants"])


def policy_table(runs: Sequence[dict[str, Any]]) -> str:
    """The policies' table (see the module docstring)."""
    lru = next((f for f in runs if f["eviction"] == "lru"), None)
    return _table(COLUMNS, [_row(f, lru) for f in runs])


def tenant_table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per policy and cache salt: prompt tokens allocated (recomputes included),
    their hits, the hit rate and the workload's own hit rate of that salt's requests."""
    rows = [
        [
            f["eviction"],
            tenant_label(t["tenant"]),
            f"{t['prompt_tokens']}",
            f"{t['prefix_hit_tokens']}",
            f"{t['prefix_hit_rate']:.2%}",
            f"{t['workload_hit_rate']:.2%}",
        ]
        for f in runs
        for t in f["tenants"]
    ]
    return _table(TENANT_COLUMNS, rows, left=2)


__all__ = ["COLUMNS", "TENANT_COLUMNS", "has_tenants", "policy_table", "tenant_table"]
