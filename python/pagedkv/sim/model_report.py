"""How `simulate --model` prints: the two runs side by side, the saving, why the hit rates
differ, and one row per group (the figures come from `model_run` and `saving`)."""

from __future__ import annotations

from typing import Any

from pagedkv.sim.saving import BISECT_FRACTION

# What a group other than full attention needs for a prefix hit ending at some position.
_NEEDS = {
    "sliding_window": "the blocks of its window (the last {n} tokens before the hit's end), "
    "and it drops blocks that leave the window while a sequence runs, so they are evicted "
    "first",
    "chunked_local": "the blocks of the hit's last {n}-token chunk, and it drops earlier "
    "chunks' blocks while a sequence runs, so they are evicted first",
    "state": "the state block at the hit's end, and it keeps only a sequence's latest block",
}


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def _hits(s: dict[str, Any]) -> str:
    return (
        f"{s['workload_hit_rate']:.2%} ({s['workload_hit_tokens']} of "
        f"{s['workload_prompt_tokens']} workload prompt tokens)"
    )


def _recomputed(s: dict[str, Any]) -> str:
    n = s["recomputed_tokens"]
    if not n:
        return "none"
    return f"{s['recomputed_hit_tokens'] / n:.2%} of {n} ({s['recomputed_hit_tokens']} hit)"


def _side_by_side(section: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    m, a = section["model"], section["all_full"]
    fm, fa = runs

    def pool(s: dict[str, Any]) -> str:
        return f"{s['num_blocks']} blocks x {s['block_size']} tokens = {s['pool_gib']:.2f} GiB"

    def groups(s: dict[str, Any]) -> str:
        return f"{len(s['groups'])} x {s['group_size']} layers"

    def requests(f: dict[str, Any]) -> str:
        done = f["finished_requests"] - f["rejected_requests"] - f["aborted_requests"]
        return f"{done} finished, {f['rejected_requests']} rejected"

    rows = [
        ("", "model groups", "all-full"),
        ("pool", pool(m), pool(a)),
        ("groups", groups(m), groups(a)),
        ("bytes/block", str(m["bytes_per_block"]), str(a["bytes_per_block"])),
        ("hit rate", _hits(m), _hits(a)),
        ("recomputed", _recomputed(m), _recomputed(a)),
        (
            "peak",
            f"{m['peak_blocks']} blocks, {m['peak_gib']:.3f} GiB",
            f"{a['peak_blocks']} blocks, {a['peak_gib']:.3f} GiB",
        ),
        ("KV per live token", _kib(m["bytes_per_token"]), _kib(a["bytes_per_token"])),
        ("KV per held token", _kib(m["bytes_per_held_token"]), _kib(a["bytes_per_held_token"])),
        ("requests", requests(fm), requests(fa)),
        ("preemptions", str(fm["preemptions"]), str(fa["preemptions"])),
        ("evictions", str(fm["evictions"]), str(fa["evictions"])),
        ("steps", str(fm["num_steps"]), str(fa["num_steps"])),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return [f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}".rstrip() for r in rows]


def saving_lines(section: dict[str, Any]) -> list[str]:
    """`memory saved` (at equal memory, and at equal hits when searched) and `hit limit`."""
    if section.get("one_run"):
        return [
            "memory saved  none: the model's layout is one full-attention group, the all-full "
            "layout itself (the workload was replayed once, for both columns)"
        ]
    sv = section["saving"]
    per = sv["bytes_per_held_token"]
    ratio = sv["tokens_ratio_at_equal_memory"]
    full = sv["pools_full"]
    if full["model"] and full["all_full"]:
        how = "both pools full at their peaks"
    else:
        how = (
            "the pools not both full at their peaks, so this is what each layout costs per "
            "token, not tokens the runs had to hold"
        )
    more = f"{ratio:.2f}x the tokens" if ratio is not None else "no tokens"
    lines = [
        f"memory saved  at equal memory ({sv['budget_gib']:.2f} GiB, {how}): the model's "
        f"groups hold {more} of all-full attention ({_kib(per['model'])} of KV per held "
        f"token against {_kib(per['all_full'])}, over every step)"
    ]
    target = sv["workload_hit_rate"]["all_full"]
    eq = sv["equal_hits"]
    if eq is None:
        lines.append(
            f"              at equal hits: not searched (--equal-hits runs both layouts at "
            f"other pool sizes for the memory each needs to reach the all-full run's "
            f"{target:.2%})"
        )
    else:
        lines.append(_equal_hits_line(eq))
    lines += _limit_lines(section)
    return lines


def _equal_hits_line(eq: dict[str, Any]) -> str:
    def needs(r: dict[str, Any]) -> str:
        if r["reached"]:
            return f"{r['gib']:.2f} GiB ({r['hit_rate']:.2%})"
        return f"more than {r['largest_tried_gib']:.2f} GiB (not reached)"

    m, a = eq["model"], eq["all_full"]
    saved = eq["saved_gib"]
    if saved is None:
        verdict = "no saving to state"
    elif saved >= 0:
        verdict = f"{saved:.2f} GiB saved"
    else:
        verdict = f"{-saved:.2f} GiB more"
    return (
        f"              at equal hits (the all-full run's {eq['target_hit_rate']:.2%}): the "
        f"model's groups need {needs(m)}, all-full attention {needs(a)}: {verdict} (the "
        f"smallest pools reaching it in {eq['more_runs']} more runs, each pool doubled or "
        f"halved from the budget, then bisected to 1/{BISECT_FRACTION} of it)"
    )


def _limit_lines(section: dict[str, Any]) -> list[str]:
    split = section["saving"].get("hit_split")
    if split is None:
        return []
    rates = section["saving"]["workload_hit_rate"]
    head = (
        f"hit limit     the model's full-attention groups alone had "
        f"{split['full_groups_hit_rate']:.2%} of the workload's prompt tokens cached (the "
        f"all-full run, with its own pool, concurrency and evictions: "
        f"{rates['all_full']:.2%}); "
    )
    g = split["most_cut_group"]
    if g is None:
        return [head + "no other group cut a hit"]
    group = section["model"]["groups"][g]
    spec = group["spec"]
    kind = group["kind"]
    size = spec[spec.index("(") + 1 : -1] if "(" in spec else ""
    needs = _NEEDS.get(kind, "its own blocks").format(n=size)
    same = split["most_cut_groups"]
    which = f"group {g}" if len(same) == 1 else f"groups {', '.join(map(str, same))}"
    lines = [
        head + f"the other groups cut that to {split['hit_rate']:.2%}: a hit needs, in every "
        f"{kind} group, {needs}. The {spec} {which} cut the most: "
        f"{100 * split['cut_rate'][g]:.2f} points{' each' if len(same) > 1 else ''} on "
        f"{'their' if len(same) > 1 else 'its'} own (the cut hits column)"
    ]
    if split["disagreements"]:
        lines.append(
            f"              (the probe's copy of the cache disagreed with the manager on "
            f"{split['disagreements']} allocations: these figures are approximate)"
        )
    return lines


_GROUP_COLUMNS = (
    "run",
    "group",
    "kind",
    "layers",
    "blocks@peak",
    "peak GiB",
    "KiB/token",
    "hit blocks",
    "cut hits",
    "evictions",
)


def _group_rows(label: str, s: dict[str, Any]) -> list[list[str]]:
    limits = s.get("hit_limits")
    rows = []
    for g in s["groups"]:
        if limits is not None and limits["prompt_tokens"]:
            cut = f"{limits['cut_tokens'][g['group']] / limits['prompt_tokens']:.2%}"
        else:
            cut = "-"
        rows.append(
            [
                label,
                str(g["group"]),
                g["spec"],
                str(g["layers"]),
                str(g["blocks_at_peak"]),
                f"{g['peak_gib']:.3f}",
                f"{g['bytes_per_token'] / 1024:.1f}",
                str(g["hit_blocks"]),
                cut,
                str(g["evictions"]),
            ]
        )
    return rows


def comparison_table(section: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The two runs side by side, the saving and the hit limit, then one row per group."""
    table = [list(_GROUP_COLUMNS)]
    table += [
        row
        for label, key in (("model", "model"), ("all-full", "all_full"))
        for row in _group_rows(label, section[key])
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(_GROUP_COLUMNS))]
    left = {0, 2}  # text columns
    out = [
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([*_side_by_side(section, runs), "", *saving_lines(section), "", *out])


__all__ = ["comparison_table", "saving_lines"]
