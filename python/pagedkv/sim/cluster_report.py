"""A cluster run's figures (the JSON document) and its table (docs/cluster.md).

Hit rates are the workload's: prefix-hit tokens of the workload's own admissions over their
prompt tokens, recomputations after a preemption left out (they are shown on rows of their
own). Of those hits, "from the tier" were read from the store below the GPUs, and "put by
another node" is the part of those that another node had put there: what sharing the tier
bought. The total column adds every node's tokens up and divides the sums. Load balance is
the busiest node's share over the mean (1.00: even). "manager s (wall)" is the wall time
spent inside the node's manager calls (`time.perf_counter`), not CPU time. The router line
counts as routed by prefix only a request whose node held more of its prompt than another
node did (`sim.router.RouterStats`): a prefix every node holds is no routing success.
"""

from __future__ import annotations

from typing import Any

from pagedkv.sim.cluster import ClusterRun
from pagedkv.sim.scheduler import SimResult

_SUMMED = (
    "requests",
    "prompt_tokens",
    "finished_requests",
    "rejected_requests",
    "workload_prompt_tokens",
    "workload_hit_tokens",
    "gpu_hit_tokens",
    "tier_tokens",
    "tier_tokens_own",
    "tier_tokens_cross",
    "recomputed_tokens",
    "recomputed_hit_tokens",
    "recomputed_tier_tokens",
    "preemptions",
    "evictions",
    "blocks_demoted",
    "blocks_promoted",
    "failed_loads",
    "dropped_puts",
    "steps",
    "manager_seconds",
    "wall_seconds",
)


def _rate(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def _node(
    res: SimResult, tier: dict[str, Any] | None, requests: int, prompt: int
) -> dict[str, Any]:
    st = res.final_stats
    assert st is not None
    hits = res.prefix_hit_tokens - res.recomputed_hit_tokens
    t = tier or {}
    tier_tokens = t.get("tier_tokens", 0)
    f: dict[str, Any] = {
        "requests": requests,
        "prompt_tokens": prompt,
        "finished_requests": res.finished_requests,
        "rejected_requests": res.rejected_requests,
        "workload_prompt_tokens": res.workload_prompt_tokens,
        "workload_hit_tokens": hits,
        "gpu_hit_tokens": hits - tier_tokens,
        "tier_tokens": tier_tokens,
        "tier_tokens_own": t.get("tier_tokens_own", 0),
        "tier_tokens_cross": t.get("tier_tokens_cross", 0),
        "recomputed_tokens": res.recomputed_tokens,
        "recomputed_hit_tokens": res.recomputed_hit_tokens,
        "recomputed_tier_tokens": t.get("recomputed_tier_tokens", 0),
        "preemptions": res.preemptions,
        "evictions": st.evictions,
        "blocks_demoted": t.get("blocks_demoted", 0),
        "blocks_promoted": t.get("blocks_promoted", 0),
        "failed_loads": t.get("failed_loads", 0),
        "dropped_puts": t.get("dropped_puts", 0),
        "steps": res.steps,
        "manager_seconds": res.manager_ns / 1e9,
        "wall_seconds": res.wall_s,
    }
    if tier is not None:
        f["tier_tokens_by_origin"] = tier["tier_tokens_by_origin"]
    _rates(f)
    return f


def _rates(f: dict[str, Any]) -> None:
    w = f["workload_prompt_tokens"]
    f["workload_hit_rate"] = _rate(f["workload_hit_tokens"], w)
    f["gpu_hit_rate"] = _rate(f["gpu_hit_tokens"], w)
    f["tier_hit_rate"] = _rate(f["tier_tokens"], w)
    f["cross_node_hit_rate"] = _rate(f["tier_tokens_cross"], w)


def _balance(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def cluster_figures(run: ClusterRun) -> dict[str, Any]:
    """Every figure of a cluster run: options, per node, the total, balance, router, stores."""
    o, c = run.options, run.config
    nodes = [
        _node(res, tier, req, prompt)
        for res, tier, req, prompt in zip(
            run.results, run.tiers, run.routed_requests, run.routed_prompt_tokens, strict=True
        )
    ]
    total: dict[str, Any] = {k: sum(n[k] for n in nodes) for k in _SUMMED}
    _rates(total)
    r = run.router
    return {
        "cluster": {
            "nodes": o.nodes,
            "routing": o.routing,
            "prefix_balance": o.prefix_balance,
            "tier": o.tier,
            "tier_blocks": o.tier_blocks,
            "remote": o.remote,
            "num_blocks": c.num_blocks,
            "block_size": c.block_size,
            "num_cpu_blocks": c.num_cpu_blocks,
            "hash_algo": c.hash_algo,
            "clock_steps": run.clock_steps,
        },
        "nodes": nodes,
        "total": total,
        "balance": {
            "requests_max_over_mean": _balance(run.routed_requests),
            "prompt_tokens_max_over_mean": _balance(run.routed_prompt_tokens),
        },
        "router": {
            "routed": r.routed,
            "prefix_routed": r.prefix_routed,
            "prefix_tokens": r.prefix_tokens,
            "balanced": r.balanced,
            "prefix_won": r.prefix_won,
            "prefix_won_tokens": r.prefix_won_tokens,
            "prefix_everywhere": r.prefix_everywhere,
        },
        "stores": run.stores,
        **({} if run.index is None else {"index": run.index}),
    }


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def cluster_table(doc: dict[str, Any]) -> str:
    """One column per node and the total; balance, router and store lines below."""
    cols = [*doc["nodes"], doc["total"]]
    head = [f"node {i}" for i in range(len(doc["nodes"]))] + ["total"]
    rows: list[tuple[str, list[str]]] = [
        ("requests routed", [str(f["requests"]) for f in cols]),
        ("prompt tokens routed", [str(f["prompt_tokens"]) for f in cols]),
        ("workload hit rate", [_pct(f["workload_hit_rate"]) for f in cols]),
        ("  from the GPU", [_pct(f["gpu_hit_rate"]) for f in cols]),
        ("  from the tier", [_pct(f["tier_hit_rate"]) for f in cols]),
        ("    put by another node", [_pct(f["cross_node_hit_rate"]) for f in cols]),
        ("tier tokens (workload)", [str(f["tier_tokens"]) for f in cols]),
        ("  put by another node", [str(f["tier_tokens_cross"]) for f in cols]),
        ("recomputed prompt tokens", [str(f["recomputed_tokens"]) for f in cols]),
        ("  their hits", [str(f["recomputed_hit_tokens"]) for f in cols]),
        ("preemptions", [str(f["preemptions"]) for f in cols]),
        ("GPU evictions", [str(f["evictions"]) for f in cols]),
        ("blocks demoted", [str(f["blocks_demoted"]) for f in cols]),
        ("blocks promoted", [str(f["blocks_promoted"]) for f in cols]),
        ("steps", [str(f["steps"]) for f in cols]),
        ("manager s (wall)", [f"{f['manager_seconds']:.2f}" for f in cols]),
    ]
    w0 = max(len(name) for name, _ in rows)
    widths = [max(len(h), *(len(v[i]) for _, v in rows)) for i, h in enumerate(head)]
    lines = ["  ".join([" " * w0, *(h.rjust(w) for h, w in zip(head, widths, strict=True))])]
    for name, values in rows:
        cells = (v.rjust(w) for v, w in zip(values, widths, strict=True))
        lines.append("  ".join([name.ljust(w0), *cells]))
    b, r = doc["balance"], doc["router"]
    lines.append(
        f"balance     busiest node over the mean: requests {b['requests_max_over_mean']:.2f}, "
        f"prompt tokens {b['prompt_tokens_max_over_mean']:.2f}"
    )
    if doc["cluster"]["routing"] == "prefix":
        total = sum(r["routed"]) or 1
        lines.append(
            f"router      {r['prefix_won']} of {sum(r['routed'])} requests "
            f"({_pct(r['prefix_won'] / total)}) went to a node holding more of their prompt "
            f"than another node held ({r['prefix_won_tokens']} tokens beyond the least any "
            f"node held); {r['prefix_everywhere']} found the same prefix on every node (a "
            f"shared system prompt: no routing gain); {r['balanced']} sent elsewhere by the "
            "balance guard"
        )
        ix = doc.get("index")
        lines.append(
            "            by each node's own lookup (a hybrid model, or msgspec missing)"
            if ix is None
            else f"            by the router index of the nodes' KV events (pagedkv.router): "
            f"{ix['events']} events, {ix['memberships']} blocks held at the end"
        )
    for s in doc["stores"]:
        lines.append(
            f"store       {s['name']} ({s['medium']}): {s['puts']} puts, {s['dropped_puts']} "
            f"dropped, {s['evictions']} evicted, {s['entries']} held at the end; {s['gets']} "
            f"gets, {s['hits']} hits, {s['corrupt']} corrupt, {s['errors']} errors"
        )
        lines.extend(store_notes(s))
    return "\n".join(lines)


def store_notes(s: dict[str, Any]) -> list[str]:
    """What a store's dropped puts and errors mean, and where a remote run's keys are."""
    pad = " " * 12
    out = []
    if s["medium"] == "REMOTE":
        if s["dropped_puts"] or s["errors"]:
            out.append(
                f"{pad}dropped puts are blocks the server did not store: it did not reply "
                f"within --remote-timeout ({s['timeout_s']:g} s), refused or reset the "
                "connection, or was being left alone for a second after such a failure; "
                "errors count every failed call (puts, gets, presence checks). A dropped put "
                "is a later miss, never a wrong hit; on a loaded server raise --remote-timeout"
            )
        if s.get("deleted_keys") is not None:
            out.append(f"{pad}--remote-cleanup deleted this run's {s['deleted_keys']} keys")
        else:
            out.append(
                f"{pad}this run's keys stay on the server ({s['key_prefix']}*), each expiring "
                f"{s['ttl_s']:g} s after it was put; --remote-cleanup deletes them at the end"
            )
    elif s["dropped_puts"]:
        out.append(f"{pad}dropped puts are entries larger than the store's whole budget")
    return out


__all__ = ["cluster_figures", "cluster_table", "store_notes"]
