"""The `--why` table: per tenant, the share of its missed prompt tokens each cause took."""

from __future__ import annotations

from typing import Any

from pagedkv.sim.why import CAUSES

_HEAD = {
    "never_stored": "never",
    "evicted": "evicted",
    "other_salt": "salt",
    "window": "window",
    "last_block": "last",
    "preemption": "preempt",
    "unexplained": "other",
}


def misses_table(doc: dict[str, Any]) -> str:
    """Rows of tenants: prompt tokens, hit rate, misses, then each cause's share of them."""
    tenants = doc["tenants"]
    shown = [
        c for c in CAUSES if c != "unexplained" or any(t["causes"][c] for t in tenants.values())
    ]
    width = max([6, *(len(n) for n in tenants)])
    lines = [
        "why misses  each tenant's missed prompt tokens by cause: never stored; evicted; "
        "salt = stored under",
        "            another salt; window = cut by a hybrid group's window; last = the partial "
        "last block",
        "            (or the one token always computed); preempt = lost to preemption",
        f"  {'tenant':<{width}} {'prompt':>10} {'hit rate':>8} {'misses':>10}  "
        + " ".join(f"{_HEAD[c]:>7}" for c in shown),
    ]
    for name, t in tenants.items():
        miss = t["miss_tokens"]
        rate = t["hit_tokens"] / t["prompt_tokens"] if t["prompt_tokens"] else 0.0
        shares = " ".join(
            f"{100 * t['causes'][c] / miss:>6.1f}%" if miss else f"{'-':>7}" for c in shown
        )
        lines.append(
            f"  {name:<{width}} {t['prompt_tokens']:>10} {100 * rate:>7.1f}% {miss:>10}  {shares}"
        )
    for name, t in tenants.items():
        e = t["evicted"]
        if not e["blocks"]:
            continue
        secs = (
            f" ({e['mean_age_s']:.2f} s of trace time; at most {e['max_age_s']:.2f} s)"
            if e["mean_age_s"] is not None
            else f" (at most {e['max_age_steps']} steps)"
        )
        lines.append(
            f"  evicted {name}: {e['blocks']} blocks by {e['policy']}, evicted a mean "
            f"{e['mean_age_steps']:.0f} steps before they were missed{secs}"
        )
    return "\n".join(lines)


__all__ = ["misses_table"]
