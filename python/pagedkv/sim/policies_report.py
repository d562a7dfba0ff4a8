"""The eviction-policy table (`sim.policies`): one row per policy, then one per policy and
tenant when requests carry cache salts.

Columns: the hit rate of every allocation (recomputes included), the workload's own hit rate
(recomputes left out: the headline), the share of LRU's gap to the optimal bound the policy
closes (`policies_bound`; the bound is the last row, Belady's offline optimum under the prefix
constraint over one run's stream, and a line under the table says what it is), evictions,
preemptions (swapped / recomputed), the manager time (CPU time of the run's calls replayed)
and the mean `allocate` call, and the manager time against LRU's when LRU ran too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.sim.policies_bound import gap_closed

COLUMNS = (
    "policy",
    "hit rate",
    "workload hit rate",
    "gap closed",
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


def _bound(runs: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    return next((f["bound"] for f in runs if f.get("bound")), None)


def _closed(f: dict[str, Any], lru: dict[str, Any] | None, bound: dict[str, Any] | None) -> str:
    if lru is None or bound is None:
        return "-"
    share = gap_closed(f["workload_hit_rate"], lru["workload_hit_rate"], bound)
    return "-" if share is None else f"{share:.0%}"


def _row(
    f: dict[str, Any], lru: dict[str, Any] | None, bound: dict[str, Any] | None = None
) -> list[str]:
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
        _closed(f, lru, bound),
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
    """The policies' table, the bound's row last, and what the bound is (see the module
    docstring)."""
    lru = next((f for f in runs if f["eviction"] == "lru"), None)
    bound = _bound(runs)
    rows = [_row(f, lru, bound) for f in runs]
    if bound is None:
        return _table(COLUMNS, rows)
    opt, model_lru = bound["optimal_hit_rate"], bound["stream_lru_hit_rate"]
    closed = "100%" if opt - model_lru > 1e-12 else "-"
    rows.append(["optimal (bound)", "-", f"{opt:.2%}", closed, *["-"] * (len(COLUMNS) - 4)])
    note = (
        f"optimal     Belady's offline optimum under the prefix constraint at "
        f"{bound['num_blocks']} blocks: {opt:.2%} over the {bound['source_policy']} run's "
        f"lookups and touches as a pure cache (nothing pinned, that run's schedule), where LRU "
        f"hits {model_lru:.2%}\n"
        f"gap closed  a policy's gain over lru in these runs / the optimum's gain over LRU on "
        f"that stream ({(opt - model_lru) * 100:+.2f} points)"
    )
    return _table(COLUMNS, rows) + "\n" + note


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
