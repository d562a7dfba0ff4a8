"""`simulate --model NAME`: one workload, the model's KV-cache groups against all-full attention.

Both runs get the same pool bytes. The budget is the all-full run's: `--num-blocks` (or
`--cache-tokens // --block-size`) blocks of `--block-size` tokens, each block weighing every
layer's K and V (`models.full_layout`). The model's run gets as many of its own (heavier, or
for state models larger) blocks as fit in those bytes (`models.model_layout`; the null block
of a manager with groups comes out of them, as in vLLM). A model whose layout is one full
group (Llama-3-8B) runs the plain manager both times, and the two runs agree.

Figures per group, from `stats().groups` sampled once per executed step when the scheduler
samples its own figures (a manager without groups is one full group of its totals):

- `blocks_at_peak`: the group's blocks held by sequences at the step where the pool's held
  blocks (all groups) peak; `peak_gib` those blocks' bytes, so the groups add up to the peak;
- `bytes_per_token`: KV memory per live token, `sum over steps (held blocks x bytes per block)
  / sum over steps (tokens the running sequences hold)` (a token-weighted mean; blocks shared
  by forks or prefix hits count once, so sharing lowers it; cached blocks are not held);
- `hit_blocks`, `evictions`, `registered_blocks`: the group's counters at the end. The hit
  rate is the reconciled one (tokens every group could serve), the same for every group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.factory import make_manager
from pagedkv.sim.models import GIB, Layout, ModelShape, describe_kind, full_layout, model_layout
from pagedkv.sim.progress import ProgressBar
from pagedkv.sim.report import figures
from pagedkv.sim.requests import Workload
from pagedkv.sim.scheduler import ManagerLike, SimResult, run_workload
from pagedkv.stats import GroupStats, Stats

RUNS = ("model", "all_full")


def group_stats(st: Stats) -> tuple[GroupStats, ...]:
    """`st.groups`, or for a manager without groups one full group holding its totals."""
    if st.groups:
        return st.groups
    hit_blocks = st.prefix_hits // st.block_size  # hits are whole blocks
    return (
        GroupStats(
            "full",
            st.used_blocks,
            st.cached_blocks,
            st.usage,
            hit_blocks,
            st.evictions,
            st.registered_blocks,
        ),
    )


class GroupSampler:
    """The `observe` hook of `run_workload`: each group's held blocks, once per step."""

    __slots__ = ("manager", "used")

    def __init__(self, manager: ManagerLike) -> None:
        self.manager = manager
        self.used: list[tuple[int, ...]] = []

    def __call__(self) -> None:
        self.used.append(tuple(g.used_blocks for g in group_stats(self.manager.stats())))


def group_figures(layout: Layout, used: list[tuple[int, ...]], result: SimResult) -> dict[str, Any]:
    """The per-group figures of one run (see the module docstring) and their totals."""
    assert result.final_stats is not None
    final = group_stats(result.final_stats)
    if len(final) != len(layout.groups):
        raise RuntimeError(
            f"the manager reports {len(final)} groups, the layout has {len(layout.groups)}"
        )
    bpb = layout.bytes_per_block
    totals = [sum(row) for row in used]
    peak = max(range(len(totals)), key=totals.__getitem__, default=None)
    live = sum(result.series.live_tokens)
    groups = []
    for g, (spec, ids, st) in enumerate(zip(layout.groups, layout.layer_ids, final, strict=True)):
        at_peak = used[peak][g] if peak is not None else 0
        held = sum(row[g] for row in used)
        groups.append(
            {
                "group": g,
                "kind": st.kind,
                "spec": describe_kind(spec),
                "layers": spec.num_layers,
                "layer_ids": list(ids),
                "blocks_at_peak": at_peak,
                "max_blocks": max((row[g] for row in used), default=0),
                "peak_gib": at_peak * bpb / GIB,
                "bytes_per_token": held * bpb / live if live else 0.0,
                "hit_blocks": st.hit_blocks,
                "evictions": st.evictions,
                "registered_blocks": st.registered_blocks,
            }
        )
    peak_blocks = totals[peak] if peak is not None else 0
    return {
        "block_size": layout.block_size,
        "group_size": layout.group_size,
        "padding_layers": layout.padding_layers,
        "page_bytes": layout.page_bytes,
        "bytes_per_block": bpb,
        "peak_step": result.series.step[peak] if peak is not None else None,
        "peak_blocks": peak_blocks,
        "peak_gib": peak_blocks * bpb / GIB,
        "bytes_per_token": sum(g["bytes_per_token"] for g in groups),
        "hit_rate": result.hit_rate,
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "prompt_tokens": result.prompt_tokens,
        "groups": groups,
    }


def compare(
    model: ModelShape,
    workload: Workload,
    config: BlockManagerConfig,
    schedule: dict[str, Any],
    *,
    reference: bool = False,
    check: bool = False,
    make: Callable[..., ManagerLike] = make_manager,
    progress: Callable[[str], ProgressBar | None] = lambda label: None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run `workload` with the model's groups and as all-full attention on the same bytes.

    `config` is the all-full run's pool (its `num_blocks` set the budget); `schedule` the
    scheduler's options. Returns the `model` section (model, budget, per-group figures of each
    run) and the two runs' `report.figures`, each with its `label`.
    """
    full = full_layout(model, config.block_size)
    layouts = {"model": model_layout(model, config.block_size), "all_full": full}
    budget = config.num_blocks * full.bytes_per_block
    section: dict[str, Any] = {
        "name": model.name,
        "source": model.source,
        "layers": model.num_layers,
        "layer_kinds": {describe_kind(k): n for k, n in model.layer_counts().items()},
        "kv_heads": model.kv_heads,
        "head_dim": model.head_dim,
        "dtype_bytes": model.dtype_bytes,
        "state_bytes": model.state_bytes,
        "full_kv_bytes_per_token": model.full_kv_bytes_per_token,
        "budget_bytes": budget,
        "budget_gib": budget / GIB,
    }
    sizes = {label: layouts[label].num_blocks(budget) for label in RUNS}
    for label, n in sizes.items():
        if n < 2:
            raise ValueError(
                f"{budget} bytes hold {n} blocks of {model.name}'s {label} layout "
                f"({layouts[label].bytes_per_block} bytes each): raise --num-blocks or "
                "--cache-tokens"
            )
    runs = []
    name = "reference" if reference else "rust"
    for label in RUNS:
        layout, num_blocks = layouts[label], sizes[label]
        run_config = dataclasses.replace(
            config, num_blocks=num_blocks, block_size=layout.block_size
        )
        manager = make(run_config, reference=reference, groups=layout.manager_groups)
        sampler = GroupSampler(manager)
        bar = progress(f"{model.name} {label}")
        result = run_workload(
            manager, workload, **schedule, check=check, observe=sampler, progress=bar
        )
        if bar is not None:
            bar.close()
        if check:
            manager.check_invariants()
        f = figures(
            result,
            run_config,
            manager=name,
            workload=workload.describe(),
            ms_per_step=workload.ms_per_step,
        )
        f["label"] = label
        runs.append(f)
        section[label] = {
            "num_blocks": num_blocks,
            "pool_gib": layout.gib(num_blocks),
            **group_figures(layout, sampler.used, result),
        }
    return section, runs


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


_GROUP_COLUMNS = (
    "run",
    "group",
    "kind",
    "layers",
    "blocks@peak",
    "peak GiB",
    "KiB/token",
    "hit blocks",
    "evictions",
)


def _group_row(label: str, g: dict[str, Any]) -> list[str]:
    return [
        label,
        str(g["group"]),
        g["spec"],
        str(g["layers"]),
        str(g["blocks_at_peak"]),
        f"{g['peak_gib']:.3f}",
        f"{g['bytes_per_token'] / 1024:.1f}",
        str(g["hit_blocks"]),
        str(g["evictions"]),
    ]


def comparison_table(section: dict[str, Any], runs: list[dict[str, Any]]) -> str:
    """The two runs side by side, then one row per group."""
    m, a = section["model"], section["all_full"]
    fm, fa = runs

    def pool(s: dict[str, Any]) -> str:
        return f"{s['num_blocks']} blocks x {s['block_size']} tokens = {s['pool_gib']:.2f} GiB"

    def hits(s: dict[str, Any]) -> str:
        return f"{s['hit_rate']:.2%} ({s['prefix_hit_tokens']} of {s['prompt_tokens']})"

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
        ("hit rate", hits(m), hits(a)),
        (
            "peak",
            f"{m['peak_blocks']} blocks, {m['peak_gib']:.3f} GiB",
            f"{a['peak_blocks']} blocks, {a['peak_gib']:.3f} GiB",
        ),
        ("KV per token", _kib(m["bytes_per_token"]), _kib(a["bytes_per_token"])),
        ("requests", requests(fm), requests(fa)),
        ("preemptions", str(fm["preemptions"]), str(fa["preemptions"])),
        ("evictions", str(fm["evictions"]), str(fa["evictions"])),
        ("steps", str(fm["num_steps"]), str(fa["num_steps"])),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"{r[0]:<{w0}}  {r[1]:<{w1}}  {r[2]}".rstrip() for r in rows]

    table = [list(_GROUP_COLUMNS)]
    table += [
        _group_row(label, g) for label, s in (("model", m), ("all-full", a)) for g in s["groups"]
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
    return "\n".join([*lines, "", *out])


__all__ = ["RUNS", "GroupSampler", "compare", "comparison_table", "group_figures", "group_stats"]
