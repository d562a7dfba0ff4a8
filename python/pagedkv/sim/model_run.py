"""`simulate --model NAME`: one workload, the model's KV-cache groups against all-full attention.

Both runs get the same pool bytes. The budget is the all-full run's: `--num-blocks` (or
`--cache-tokens // --block-size`) blocks of `--block-size` tokens, each block weighing every
layer's K and V (`models.full_layout`). The model's run gets as many of its own (heavier, or
for state models larger) blocks as fit in those bytes (`models.model_layout`; the null block
of a manager with groups comes out of them, as in vLLM). A model whose layout is one full
group (Llama-3-8B) is its own all-full equivalent: the workload is replayed once, and that run
stands for both.

Figures per group, from `stats().groups` sampled once per executed step when the scheduler
samples its own figures (a manager without groups is one full group of its totals):

- `blocks_at_peak`: the group's blocks held by sequences at the step where the pool's held
  blocks (all groups) peak; `peak_gib` those blocks' bytes, so the groups add up to the peak;
- `bytes_per_token`: KV per live token, `sum over steps (held blocks x bytes per block)
  / sum over steps (tokens the running sequences hold)` (a token-weighted mean; blocks shared
  by forks or prefix hits count once, so sharing lowers it; cached blocks are not held);
- `held_tokens`: the token positions the run's held blocks cover, `sum over steps` of the
  most blocks any group holds x block size (the full-attention group's, which holds every
  position); `bytes_per_held_token` = held bytes / held tokens, what the layout itself costs
  per token once sharing is set aside (all-full: exactly the model's bytes per token). Their
  ratio between the runs is the memory saving at equal memory (`saving.py`);
- `hit_blocks`, `evictions`, `registered_blocks`: the group's counters at the end. The hit
  rate is the reconciled one (tokens every group could serve), the same for every group;
  the workload's own (recomputed prompts left out) is the headline. With groups other than
  full attention, `hit_limits` says which group cut the hits (`cut_tokens` per group).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.factory import make_manager
from pagedkv.sim.hit_limits import HitLimitProbe
from pagedkv.sim.models import GIB, Layout, ModelShape, describe_kind, full_layout, model_layout
from pagedkv.sim.progress import ProgressBar
from pagedkv.sim.report import figures
from pagedkv.sim.requests import Workload
from pagedkv.sim.saving import equal_hits, saving_figures, search_equal_hits
from pagedkv.sim.scheduler import ManagerLike, SimResult, run_workload
from pagedkv.sim.why import MissWhy, misses_doc
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
    held_tokens = sum(max(row, default=0) for row in used) * layout.block_size
    held_bytes = sum(totals) * bpb
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
        "held_tokens": held_tokens,
        "bytes_per_held_token": held_bytes / held_tokens if held_tokens else 0.0,
        "hit_rate": result.hit_rate,
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "prompt_tokens": result.prompt_tokens,
        "workload_hit_rate": result.workload_hit_rate,
        "workload_hit_tokens": result.prefix_hit_tokens - result.recomputed_hit_tokens,
        "workload_prompt_tokens": result.workload_prompt_tokens,
        "recomputed_tokens": result.recomputed_tokens,
        "recomputed_hit_tokens": result.recomputed_hit_tokens,
        "groups": groups,
    }


class Replay:
    """One run of the workload on a layout and a pool size: the options every run of a
    `--model` comparison shares (the equal-hits search makes more of them)."""

    def __init__(
        self,
        model: ModelShape,
        workload: Workload,
        config: BlockManagerConfig,
        schedule: dict[str, Any],
        *,
        reference: bool = False,
        check: bool = False,
        make: Callable[..., ManagerLike] = make_manager,
        progress: Callable[[str], ProgressBar | None] = lambda label: None,
        why: bool = False,
    ) -> None:
        self.why = why
        self.model = model
        self.workload = workload
        self.config = config
        self.schedule = schedule
        self.reference = reference
        self.check = check
        self.make = make
        self.progress = progress
        self.count = 0  # replays made

    def __call__(
        self, layout: Layout, num_blocks: int, label: str, *, probe: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The run's `report.figures` and its part of the `model` section (pool, per-group
        figures and, with `probe` on a hybrid layout, `hit_limits`)."""
        self.count += 1
        # `why` (the cause of each miss) and the hit-limit probe both read the manager's
        # events: `why` replaces the probe.
        probe = probe and not self.why and any(g.kind != "full" for g in layout.groups)
        run_config = dataclasses.replace(
            self.config,
            num_blocks=num_blocks,
            block_size=layout.block_size,
            enable_kv_events=self.config.enable_kv_events or probe or self.why,
        )
        manager = self.make(run_config, reference=self.reference, groups=layout.manager_groups)
        prober = HitLimitProbe(manager, layout.groups) if probe else None
        why = MissWhy(self.workload.ms_per_step) if self.why else None
        driven: Any = prober if prober is not None else manager
        sampler = GroupSampler(manager)
        bar = self.progress(f"{self.model.name} {label}")
        result = run_workload(
            driven if why is None else why.watch(manager),
            self.workload,
            **self.schedule,
            check=self.check,
            observe=sampler,
            progress=bar,
            watch=why,
            before_step=None if why is None else why.before_step,
        )
        if bar is not None:
            bar.close()
        if self.check:
            manager.check_invariants()
        f = figures(
            result,
            run_config,
            manager="reference" if self.reference else "rust",
            workload=self.workload.describe(),
            ms_per_step=self.workload.ms_per_step,
        )
        f["label"] = label
        if why is not None:
            f["misses"] = misses_doc(why)
        part = {
            "num_blocks": num_blocks,
            "pool_gib": layout.gib(num_blocks),
            **group_figures(layout, sampler.used, result),
        }
        if prober is not None:
            part["hit_limits"] = prober.figures()
        return f, part


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
    search: bool = False,
    why: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Run `workload` with the model's groups and as all-full attention on the same bytes.

    `config` is the all-full run's pool (its `num_blocks` set the budget); `schedule` the
    scheduler's options. Returns the `model` section (model, budget, per-group figures of each
    run, the `saving`) and the two runs' `report.figures`, each with its `label`. A model
    whose layout is one full group replays once (`replays` says how many replays were
    made); `search` looks for the memory at which each layout reaches the all-full run's hit
    rate (`saving.search_equal_hits`), for the memory saved at equal hits. `why` adds each
    run's causes of misses (`sim.why`, its `misses`) in place of the hit-limit probe.
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
    replay = Replay(
        model,
        workload,
        config,
        schedule,
        reference=reference,
        check=check,
        make=make,
        progress=progress,
        why=why,
    )
    # One full group is the all-full layout itself: the same pool, the same manager.
    same = layouts["model"] == full and sizes["model"] == sizes["all_full"]
    section["one_run"] = same
    runs: list[dict[str, Any]] = []
    for label in RUNS:
        if same and runs:
            f = dict(runs[0], label=label)
            section[label] = dict(section[RUNS[0]])
        else:
            f, section[label] = replay(layouts[label], sizes[label], label, probe=True)
        runs.append(f)
    section["saving"] = saving_figures(section, layouts["model"])
    if search and not same:
        target = runs[1]["workload_hit_rate"]
        section["saving"]["equal_hits"] = equal_hits(
            search_equal_hits(
                replay, layouts["model"], sizes["model"], runs[0]["workload_hit_rate"], target
            ),
            search_equal_hits(replay, full, sizes["all_full"], target, target),
            target,
        )
    section["replays"] = replay.count
    return section, runs


__all__ = ["RUNS", "GroupSampler", "Replay", "compare", "group_figures", "group_stats"]
