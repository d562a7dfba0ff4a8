"""The ablation table: one row per variant, against the full system (`sim.ablate`).

Columns: memory held by sequences (peak and mean blocks, and GiB when the bytes per token are
known), the mean of blocks kept cached, the pool in use (held + cached), tokens per held slot,
the workload's hit rate, preemptions (swapped / recomputed), fragmentation, manager seconds
(a reclaim window's `evict_blocks` included; each cell marked with its time measure, `cpu` or
`wall`, since the tier rows cannot be replayed call by call, and a legend under the table says
what each mark measured), the mean `allocate` call, and the change of the
mean memory held against the full system (in tokens, so that block sizes compare). A variant
that was not run says why in place of its figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLUMNS = (
    "variant",
    "peak held",
    "mean held",
    "mean cached",
    "in use",
    "tok/slot",
    "hit rate",
    "preempt s/r",
    "frag",
    "mgr s",
    "alloc us",
    "held vs full",
)
GIB_COLUMNS = ("peak GiB", "mean GiB")


def _mark(f: dict[str, Any]) -> str:
    """The time measure of a row's manager seconds: `cpu` (its calls replayed) or `wall`."""
    return "wall" if f.get("timing", "").startswith("wall") else "cpu"


def _legend(runs: Sequence[dict[str, Any]]) -> list[str]:
    """One line per time measure the rows use: what `cpu` and `wall` measured."""
    seen: dict[str, str] = {}
    for f in runs:
        if "skipped" not in f and "timing" in f:
            seen.setdefault(_mark(f), f["timing"])
    return [f"mgr s {mark:<4}  {seen[mark]}" for mark in ("cpu", "wall") if mark in seen]


def _row(f: dict[str, Any], full: dict[str, Any] | None, gib: bool) -> list[str]:
    if "skipped" in f:
        return [f["variant"], f"not run: {f['skipped']}"]
    alloc = f.get("allocate_mean_seconds")
    if full is not None and full.get("mean_used_tokens"):
        delta = f"{f['mean_used_tokens'] / full['mean_used_tokens'] - 1:+.1%}"
    else:
        delta = "-"
    cells = [
        f["variant"],
        f"{f['peak_used_blocks']}",
        f"{f['mean_used_blocks']:.0f}",
        f"{f['mean_cached_blocks']:.0f}",
        f"{f['pool_in_use']:.1%}",
        f"{f['tokens_per_slot']:.2f}",
        f"{f['workload_hit_rate']:.2%}",
        f"{f['preempted_swap']}/{f['preempted_recompute']}",
        f"{f['fragmentation']:.2%}",
        f"{f['ablation_manager_seconds']:.3f} {_mark(f)}",
        f"{alloc * 1e6:.1f}" if alloc is not None else "-",
        delta,
    ]
    if gib:
        peak, mean = f.get("peak_used_gib"), f.get("mean_used_gib")
        cells[3:3] = [f"{peak:.2f}" if peak is not None else "-", f"{mean:.2f}" if mean else "-"]
    return cells


def ablation_table(runs: Sequence[dict[str, Any]]) -> str:
    """The table (see the module docstring), then a line per compression comparison."""
    full = next((f for f in runs if f.get("section") == "full" and "skipped" not in f), None)
    gib = full is not None and full.get("pool_gib") is not None
    header = list(COLUMNS)
    if gib:
        header[3:3] = list(GIB_COLUMNS)
    rows = [header] + [_row(f, full, gib) for f in runs]
    widths = [max(len(r[i]) for r in rows if len(r) == len(header)) for i in range(len(header))]
    lines = []
    for r in rows:
        if len(r) != len(header):  # a skipped variant: its reason after its name
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]}")
            continue
        first = r[0].ljust(widths[0])
        lines.append(
            "  ".join([first, *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))])
        )
    lines.insert(1, "  ".join("-" * w for w in widths))
    legend = _legend(runs)
    if legend:
        lines += ["", *legend]
    note = compression_note(runs)
    if note:
        lines += ["", note]
    return "\n".join(lines)


def compression_effect(runs: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """lz4 against raw at the same host-tier bytes: `capacity` (how many more blocks the lz4
    tier holds than the raw one, as a fraction: the ratio of their compression ratios, each
    counting the entries' headers as stored bytes), `latency` (more manager time, the
    tiers' work included, as a fraction), `hit_points` (workload hit rate, points); None
    without both runs."""
    tiered = {f.get("compress") or "raw": f for f in runs if f.get("section") == "compression"}
    raw, lz4 = tiered.get("raw"), tiered.get("lz4")
    if raw is None or lz4 is None or "skipped" in raw or "skipped" in lz4:
        return None
    return {
        "capacity": lz4["compression_ratio"] / raw["compression_ratio"] - 1.0,
        "latency": lz4["ablation_manager_seconds"] / raw["ablation_manager_seconds"] - 1.0,
        "hit_points": 100 * (lz4["workload_hit_rate"] - raw["workload_hit_rate"]),
        "promoted_raw": raw["blocks_promoted"],
        "promoted_lz4": lz4["blocks_promoted"],
    }


def compression_note(runs: Sequence[dict[str, Any]]) -> str:
    e = compression_effect(runs)
    if e is None:
        return ""
    return (
        f"compression   lz4 at the raw tier's bytes: {e['capacity']:+.1%} capacity (blocks held at "
        f"equal bytes), {e['latency']:+.1%} manager time (tier work included), "
        f"{e['hit_points']:+.2f} points of workload hit rate; blocks promoted "
        f"{e['promoted_raw']:.0f} raw, {e['promoted_lz4']:.0f} lz4"
    )


__all__ = ["ablation_table", "compression_effect", "compression_note"]
