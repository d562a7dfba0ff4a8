"""Ablations: the workload run with one mechanism of the manager off at a time (`--ablate`).

Each `Variant` is the full system (the configuration given: prefix caching on, forks share
their parent's blocks, released blocks kept for prefix hits until their space is needed,
preemption by swapping when CPU blocks exist) with one thing changed:

- prefix caching off (`enable_prefix_caching=False`): no prefix hits;
- fork sharing off: a fork copies, allocating blocks of its own for its parent's tokens
  (`run_workload(fork_copies=True)`);
- delayed reclaim off: a block released `W` steps ago is reclaimed (`sim.ablate_reclaim`;
  `W = 0`: at once), where the full system keeps it until its space is needed;
- swap off: preemption frees and recomputes (`num_cpu_blocks=0`); or, when the given
  configuration has no CPU blocks, swap on (`ABLATE_CPU_BLOCKS`);
- compression of cold blocks: a host tier below the GPU holding the evicted blocks, raw and
  then lz4-compressed, at the same bytes (`sim.tier_run`);
- block size: each size of `BLOCK_SIZES` at the same cache tokens (equal memory).

Every run reports (`measure`): memory held by sequences (peak and mean blocks, GiB when the
bytes per token are known), blocks kept cached, the pool in use (held + cached, mean share),
tokens per held slot (tokens the running sequences hold over the slots of the blocks they
hold: above 1 when blocks are shared), the workload's own hit rate (prefix hits over the
workload's prompt tokens, prompts recomputed after a preemption left out), preemptions, and
the manager time (a window's `evict_blocks` calls included) with the mean time of one
`allocate` call, both in CPU time of the run's calls replayed (`sim.ablate_timing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.ablate_reclaim import WindowReclaim
from pagedkv.sim.ablate_timing import CallLog, replay_cpu
from pagedkv.sim.factory import make_manager
from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.option_names import BLOCK_SIZES
from pagedkv.sim.report import add_memory, figures
from pagedkv.sim.requests import Workload
from pagedkv.sim.scheduler import ManagerLike, run_workload
from pagedkv.sim.tier_run import TierDriver, TierOptions

ABLATE_CPU_BLOCKS = 512  # the swap row when the configuration has none


@dataclass(frozen=True, slots=True)
class Variant:
    """One run of an ablation: a configuration and the switches that differ from the full
    system's."""

    name: str  # the row's label
    section: str  # the mechanism it belongs to
    config: BlockManagerConfig
    fork_copies: bool = False
    window: int | None = None  # reclaim window in steps; None: kept until the space is needed
    tiers: TierOptions | None = None
    skipped: str | None = None  # why it was not run (the row says so)


def measure(f: dict[str, Any]) -> dict[str, Any]:
    """The ablation's figures of one run (`figures` of `sim.report` as input)."""
    s = f["steps"]
    nb, bs = f["num_blocks"], f["block_size"]
    usage = np.asarray(s["usage"], dtype=np.float64)
    cached = np.asarray(s["cached_blocks"], dtype=np.float64)
    live = np.asarray(s["live_tokens"], dtype=np.float64)
    held_slots = usage * nb * bs
    busy = held_slots > 0
    return {
        "pool_in_use": float(np.mean(usage + cached / nb)) if len(usage) else 0.0,
        "tokens_per_slot": float(np.mean(live[busy] / held_slots[busy])) if busy.any() else 0.0,
        "mean_used_tokens": float(np.mean(usage)) * nb * bs if len(usage) else 0.0,
        "peak_used_tokens": float(np.max(usage)) * nb * bs if len(usage) else 0.0,
    }


def run_variant(
    workload: Workload,
    variant: Variant,
    schedule: dict[str, Any],
    *,
    kv: KVBytes | None = None,
    check: bool = False,
    progress: Callable[[int, int], None] | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Run `workload` as `variant` says; every figure of the run plus the ablation's. The
    manager time (`ablation_manager_seconds`) is the CPU time of the run's calls replayed,
    best of `repeats` (`sim.ablate_timing`); a tiered run's (its tiers' work is not plain
    manager calls) is the wall time inside its calls, one run."""
    config = variant.config
    if variant.tiers is not None:
        config = replace(config, record_evictions=True)
    manager = make_manager(config)
    log = CallLog(manager) if variant.tiers is None else None
    target = cast(ManagerLike, log) if log is not None else manager
    reclaim = WindowReclaim(target, variant.window) if variant.window is not None else None
    driver = None
    if variant.tiers is not None:
        driver = TierDriver(
            manager,
            variant.tiers,
            num_cpu_blocks=config.num_cpu_blocks,
            hash_algo=config.hash_algo,
            check=check,
        )
    try:
        result = run_workload(
            target,
            workload,
            **schedule,
            check=check,
            progress=progress,
            tiers=driver,
            fork_copies=variant.fork_copies,
            after_step=reclaim,
        )
    finally:
        tier_figures = driver.close() if driver is not None else None
    f = figures(result, config, manager="rust", workload=workload.describe())
    add_memory(f, kv)
    f.update(measure(f))
    f.update(tier_figures or {})
    f["variant"] = variant.name
    f["section"] = variant.section
    f["fork_copies"] = variant.fork_copies
    f["copied_forks"] = result.copied_forks
    f["copied_fork_tokens"] = result.copied_fork_tokens
    f["reclaim_window"] = variant.window
    f["reclaimed_blocks"] = reclaim.reclaimed if reclaim is not None else 0
    f["compress"] = variant.tiers.compress if variant.tiers is not None else None
    if log is not None:
        t = replay_cpu(config, log.calls, repeats)
        f["timing"] = f"CPU time of the calls replayed, best of {max(1, repeats)}"
        f["ablation_manager_seconds"] = t.seconds
        f["allocate_calls"] = t.allocate_calls
        f["allocate_mean_seconds"] = t.allocate_mean_seconds
    else:
        f["timing"] = "wall time inside the run's calls, tier work included, one run"
        f["ablation_manager_seconds"] = f["manager_seconds"]
        f["allocate_calls"] = None
        f["allocate_mean_seconds"] = None
    return f


def variants(
    config: BlockManagerConfig,
    *,
    windows: Sequence[int] = (0,),
    tiers: TierOptions | None = None,
    tiers_skipped: str | None = None,
    block_sizes: Sequence[int] = BLOCK_SIZES,
) -> list[Variant]:
    """The full system and each mechanism off in turn (see the module docstring)."""
    full = Variant("full system", "full", config)
    out = [
        full,
        Variant(
            "prefix caching off", "prefix caching", replace(config, enable_prefix_caching=False)
        ),
        Variant("fork sharing off (copy)", "fork sharing", config, fork_copies=True),
    ]
    for w in windows:
        label = "at once" if w == 0 else f"after {w} steps"
        out.append(Variant(f"delayed reclaim off ({label})", "delayed reclaim", config, window=w))
    if config.num_cpu_blocks > 0:
        out.append(Variant("swap off (recompute)", "swap", replace(config, num_cpu_blocks=0)))
    else:
        swap = replace(config, num_cpu_blocks=ABLATE_CPU_BLOCKS)
        out.append(Variant(f"swap on ({ABLATE_CPU_BLOCKS} CPU blocks)", "swap", swap))
    if tiers is not None or tiers_skipped is not None:
        raw = replace(tiers, compress=None) if tiers is not None else None
        lz4 = replace(tiers, compress="lz4") if tiers is not None else None
        out.append(
            Variant("host tier, raw", "compression", config, tiers=raw, skipped=tiers_skipped)
        )
        out.append(
            Variant("host tier, lz4", "compression", config, tiers=lz4, skipped=tiers_skipped)
        )
    tokens = config.num_blocks * config.block_size
    for bs in block_sizes:
        if tokens // bs < 1:
            continue
        sized = replace(config, block_size=bs, num_blocks=tokens // bs)
        out.append(Variant(f"block size {bs}", "block size", sized))
    return out


def run_ablation(
    workload: Workload,
    vs: Sequence[Variant],
    schedule: dict[str, Any],
    *,
    kv: KVBytes | None = None,
    check: bool = False,
    progress: Callable[[str], Callable[[int, int], None] | None] | None = None,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Run every variant (a skipped one gives `{"variant", "section", "skipped"}`); a block
    size equal to the full system's reuses its run. `repeats`: replays timed per run
    (`run_variant`)."""
    runs: list[dict[str, Any]] = []
    full: dict[str, Any] | None = None
    for v in vs:
        if v.skipped is not None:
            runs.append({"variant": v.name, "section": v.section, "skipped": v.skipped})
            continue
        if full is not None and v.section == "block size" and v.config == full_config(vs):
            f = dict(full, variant=v.name, section=v.section)
        else:
            bar = progress(v.name) if progress is not None else None
            f = run_variant(
                workload, v, schedule, kv=kv, check=check, progress=bar, repeats=repeats
            )
            close = getattr(bar, "close", None)
            if close is not None:
                close()
        if v.section == "full":
            full = f
        runs.append(f)
    return runs


def full_config(vs: Sequence[Variant]) -> BlockManagerConfig:
    return next(v.config for v in vs if v.section == "full")


__all__ = [
    "ABLATE_CPU_BLOCKS",
    "BLOCK_SIZES",
    "Variant",
    "measure",
    "run_ablation",
    "run_variant",
    "variants",
]
