"""The figures of a run: one dict (the JSON file), a summary table, a sweep table.

Usage, cached blocks, queue lengths and fragmentation are sampled once per executed step after
the decode (the fullest moment of a step); means are over executed steps. The manager time is
the time spent inside the scheduler's manager calls (observations for the report excluded).
Blocks *held* are referenced by sequences; *cached* blocks are held by none and still serve
prefix hits (evicted when a free block is needed); the rest are free. With bytes per token
known (`add_memory`), block counts also print as GiB.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.kv_bytes import KVBytes

if TYPE_CHECKING:  # the writers here (`--mrc-only` uses them) need no scheduler
    from pagedkv.sim.scheduler import SimResult


def figures(
    result: SimResult,
    config: BlockManagerConfig,
    *,
    manager: str,
    workload: str,
    ms_per_step: float | None = None,
) -> dict[str, Any]:
    """Every figure of one run, by name, with the per-step series under `steps`.

    `ms_per_step`: a trace's arrival milliseconds per step (the clock in seconds), else None.
    """
    st = result.final_stats
    assert st is not None
    s = result.series
    step_ns = np.asarray(s.manager_ns, dtype=np.float64)
    steps = result.steps
    used = np.asarray(s.usage, dtype=np.float64) * config.num_blocks
    return {
        "manager": manager,
        "loop": result.loop,  # the scheduling loop that replayed it (docs/scheduling-loop.md)
        "workload": workload,
        "num_blocks": config.num_blocks,
        "block_size": config.block_size,
        "cache_tokens": config.num_blocks * config.block_size,
        "num_cpu_blocks": config.num_cpu_blocks,
        "hash_algo": config.hash_algo,
        "requests": result.requests,
        "finished_requests": result.finished_requests,
        "rejected_requests": result.rejected_requests,
        "finished_sequences": result.finished_sequences,
        "rejected_sequences": result.rejected_sequences,
        "forks": result.forks,
        "pruned_beams": result.pruned_sequences,
        "chunked_prefill": result.max_num_batched_tokens is not None,
        "max_num_batched_tokens": result.max_num_batched_tokens,
        "long_prefill_token_threshold": result.long_prefill_token_threshold,
        "prefill_chunks": result.prefill_chunks,
        "extend_calls": result.extend_calls,
        "chunked_prompts": result.chunked_prompts,
        "scheduled_tokens": result.scheduled_tokens,
        "mean_scheduled_tokens": result.scheduled_tokens / steps if steps else 0.0,
        "aborted_requests": result.aborted_requests,
        "aborted_sequences": result.aborted_sequences,
        "abort_rate": result.abort_rate,
        "spec_tokens": result.spec_tokens,
        "spec_acceptance": result.spec_acceptance,
        "draft_tokens": result.draft_tokens,
        "accepted_drafts": result.accepted_drafts,
        "acceptance_rate": result.acceptance_rate,
        "decode_steps": result.decode_steps,
        "tokens_per_step": result.tokens_per_step,
        "truncate_calls": result.truncate_calls,
        "prompt_tokens": result.prompt_tokens,
        "prefix_hit_tokens": result.prefix_hit_tokens,
        "prefix_hit_rate": result.hit_rate,
        "workload_prompt_tokens": result.workload_prompt_tokens,
        "workload_hit_rate": result.workload_hit_rate,
        "recomputed_tokens": result.recomputed_tokens,
        "recomputed_hit_tokens": result.recomputed_hit_tokens,
        "recomputed_hit_rate": (
            result.recomputed_hit_tokens / result.recomputed_tokens
            if result.recomputed_tokens
            else None
        ),
        "recent_prefix_queries": st.recent_prefix_queries,
        "recent_prefix_hits": st.recent_prefix_hits,
        "recent_hit_rate": st.recent_hit_rate,
        "registered_blocks": st.registered_blocks,
        "unregistered_blocks": st.unregistered_blocks,
        "truncated_blocks": st.truncated_blocks,
        "computed_prompt_tokens": result.prompt_tokens - result.prefix_hit_tokens,
        "generated_tokens": result.output_tokens,
        "appended_tokens": result.decode_tokens,
        "num_steps": steps,
        "clock_steps": result.clock_steps,
        "ms_per_step": ms_per_step,
        "peak_usage": max(s.usage, default=0.0),
        "mean_usage": float(np.mean(s.usage)) if steps else 0.0,
        "peak_used_blocks": round(float(used.max())) if steps else 0,
        "mean_used_blocks": float(used.mean()) if steps else 0.0,
        "peak_cached_blocks": max(s.cached_blocks, default=0),
        "mean_cached_blocks": float(np.mean(s.cached_blocks)) if steps else 0.0,
        "peak_running": max(s.running, default=0),
        "evictions": st.evictions,
        "preemptions": result.preemptions,
        "preempted_swap": result.preempted_swap,
        "preempted_recompute": result.preempted_recompute,
        "swap_ins": result.swap_ins,
        "swapped_out_blocks": st.swapped_out_blocks,
        "swapped_in_blocks": st.swapped_in_blocks,
        "cow_copies": st.cow_copies,
        "fragmentation": float(np.mean(s.fragmentation)) if steps else 0.0,
        "manager_calls": result.manager_calls,
        "manager_seconds": result.manager_ns / 1e9,
        "manager_step_mean_seconds": float(step_ns.mean()) / 1e9 if steps else 0.0,
        "manager_step_p99_seconds": float(np.percentile(step_ns, 99)) / 1e9 if steps else 0.0,
        "manager_ns_per_token": result.ns_per_token,
        "wall_seconds": result.wall_s,
        "wall_step_mean_seconds": result.wall_s / steps if steps else 0.0,
        "steps": s.as_dict(),
    }


def add_memory(f: dict[str, Any], kv: KVBytes | None) -> None:
    """Add the GiB figures of a run (None where the bytes per token are unknown)."""
    bs = f["block_size"]

    def gib(blocks: float) -> float | None:
        return kv.gib(blocks, bs) if kv else None

    f["kv_bytes_per_token"] = kv.bytes_per_token if kv else None
    f["bytes_per_block"] = kv.per_block(bs) if kv else None
    f["pool_gib"] = gib(f["num_blocks"])
    for key in ("peak_used", "mean_used", "peak_cached", "mean_cached"):
        f[f"{key}_gib"] = gib(f[f"{key}_blocks"])


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def _blocks(f: dict[str, Any], key: str) -> str:
    """`N blocks (= X GiB, P% of the pool)` for `peak_used`, `mean_cached`, ..."""
    n = f[f"{key}_blocks"]
    gib = f.get(f"{key}_gib")
    size = f" = {gib:.2f} GiB" if gib is not None else ""
    return f"{n:.0f} blocks{size} ({n / f['num_blocks']:.1%})"


def _clock(f: dict[str, Any]) -> str:
    ms = f.get("ms_per_step")
    secs = f" = {f['clock_steps'] * ms / 1000:.1f} s of trace time" if ms else ""
    return f"clock {f['clock_steps']} steps{secs}, idle stretches between arrivals included"


def _workload_hits(f: dict[str, Any]) -> str:
    """The headline: hits over the workload's own prompt tokens (recomputes left out)."""
    hits = f["prefix_hit_tokens"] - f["recomputed_hit_tokens"]
    return (
        f"{f['workload_hit_rate']:.2%} of the workload's prompt tokens ({hits} of "
        f"{f['workload_prompt_tokens']}); the manager's recent (last 1000 allocations) "
        f"{f['recent_hit_rate']:.2%}, recomputes included"
    )


def _recompute_hits(f: dict[str, Any]) -> str:
    """Recomputed prompts' own hits: they hit the blocks they had before the preemption."""
    n = f["recomputed_tokens"]
    if not n:
        return "none (no prompt allocated again after a preemption)"
    hits = f["recomputed_hit_tokens"]
    return (
        f"{hits / n:.2%} of {n} prompt tokens allocated again after preemption ({hits} hit); "
        f"every allocation together {f['prefix_hit_rate']:.2%} ({f['prefix_hit_tokens']} of "
        f"{f['prompt_tokens']})"
    )


def summary_table(f: dict[str, Any]) -> str:
    """The human-readable summary of one run."""
    tokens = f["workload_prompt_tokens"] + f["generated_tokens"]
    if f["chunked_prefill"]:
        cap = f["long_prefill_token_threshold"]
        schedule = (
            f"chunked prefill, {f['max_num_batched_tokens']} tokens per step"
            + (f" ({cap} per prompt)" if cap else "")
            + f"; {f['prefill_chunks']} prefill chunks ({f['extend_calls']} extend calls), "
            f"{f['chunked_prompts']} prompts over several steps; "
            f"mean {f['mean_scheduled_tokens']:.0f} tokens scheduled per step"
        )
    else:
        schedule = "whole prompts (--max-batch-tokens), no chunked prefill"
    pool_gib = f.get("pool_gib")
    rows = [
        (
            "GPU blocks",
            f"{f['num_blocks']} x {f['block_size']} tokens = {f['cache_tokens']} tokens"
            + (f" = {pool_gib:.2f} GiB" if pool_gib is not None else "")
            + f"; CPU blocks {f['num_cpu_blocks']}; hash {f['hash_algo']}",
        ),
        (
            "requests",
            f"{f['requests']}: "
            f"{f['finished_requests'] - f['rejected_requests'] - f['aborted_requests']} "
            f"finished, {f['rejected_requests']} rejected (never fit), "
            f"{f['aborted_requests']} aborted; sequences "
            f"{f['finished_sequences']} finished, {f['forks']} forks, "
            f"{f['pruned_beams']} beams pruned",
        ),
        (
            "tokens",
            f"{f['workload_prompt_tokens']} prompt + {f['generated_tokens']} generated "
            f"(finished sequences' outputs) = {tokens}; decode steps appended "
            f"{f['appended_tokens']} (pruned beams included, forks' shared tokens once)",
        ),
        (
            "allocated",
            f"{f['prompt_tokens']} prompt tokens: {f['workload_prompt_tokens']} of the "
            f"workload + {f['recomputed_tokens']} recomputed after preemption; "
            f"{f['prefix_hit_tokens']} from the prefix cache, {f['computed_prompt_tokens']} "
            "computed",
        ),
        ("steps", f"{f['num_steps']} executed; {_clock(f)}"),
        ("scheduling", schedule),
        ("prefix hits", _workload_hits(f)),
        ("recomputed", _recompute_hits(f)),
        (
            "registration",
            f"{f['registered_blocks']} blocks registered, {f['unregistered_blocks']} retracted "
            f"(scheduled, never computed), {f['truncated_blocks']} released by truncate",
        ),
        (
            "held",
            f"by sequences: peak {_blocks(f, 'peak_used')}, mean {_blocks(f, 'mean_used')}",
        ),
        (
            "cached",
            f"evictable: peak {_blocks(f, 'peak_cached')}, mean {_blocks(f, 'mean_cached')}; "
            f"running sequences peak {f['peak_running']}",
        ),
        ("evictions", f"{f['evictions']} blocks"),
        (
            "preemptions",
            f"{f['preemptions']}: {f['preempted_swap']} swapped out, "
            f"{f['preempted_recompute']} recomputed; {f['swap_ins']} swapped in",
        ),
        (
            "swaps",
            f"{f['swapped_out_blocks']} blocks out, {f['swapped_in_blocks']} blocks in",
        ),
        ("copy-on-write", f"{f['cow_copies']} block copies"),
    ]
    if f["spec_tokens"]:
        rows.append(
            (
                "speculation",
                f"{f['spec_tokens']} drafts, p = {f['spec_acceptance']:g}: "
                f"{f['accepted_drafts']} of {f['draft_tokens']} accepted = "
                f"{f['acceptance_rate']:.1%}; {f['tokens_per_step']:.2f} tokens per decoding "
                f"sequence and step; {f['truncate_calls']} truncate calls",
            )
        )
    if f["abort_rate"]:
        rows.append(
            (
                "aborts",
                f"{f['aborted_requests']} requests ({f['aborted_sequences']} sequences) at "
                f"rate {f['abort_rate']:g} per step; {f['unregistered_blocks']} blocks "
                "retracted",
            )
        )
    rows += [
        ("fragmentation", f"{f['fragmentation']:.2%} of held slots unused (mean over steps)"),
        (
            "manager time",
            f"{f['manager_seconds']:.3f} s in {f['manager_calls']} calls; per step mean "
            f"{_us(f['manager_step_mean_seconds'])}, p99 {_us(f['manager_step_p99_seconds'])}; "
            f"{f['manager_ns_per_token']:.1f} ns/token",
        ),
        (
            "wall time",
            f"{f['wall_seconds']:.3f} s; per step {_us(f['wall_step_mean_seconds'])} "
            f"(manager {f['manager_seconds'] / max(f['wall_seconds'], 1e-12):.1%})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


_SWEEP_COLUMNS: tuple[tuple[str, str, str], ...] = (
    # header, key, format
    ("block", "block_size", "d"),
    ("blocks", "num_blocks", "d"),
    ("hash", "hash_algo", "s"),
    ("hit rate", "workload_hit_rate", ".2%"),
    ("recomp hit", "recomputed_hit_rate", "rate"),
    ("peak use", "peak_usage", ".1%"),
    ("peak held", "peak_used_blocks", "d"),
    ("mean use", "mean_usage", ".1%"),
    ("frag", "fragmentation", ".2%"),
    ("evictions", "evictions", "d"),
    ("preempt", "preemptions", "d"),
    ("cow", "cow_copies", "d"),
    ("steps", "num_steps", "d"),
    ("mgr us/step", "manager_step_mean_seconds", "us"),
    ("p99 us", "manager_step_p99_seconds", "us"),
    ("ns/token", "manager_ns_per_token", ".1f"),
    ("wall s", "wall_seconds", ".2f"),
)


_GIB_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("GiB", "pool_gib", ".2f"),
    ("peak GiB", "peak_used_gib", ".2f"),
)


def sweep_table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per run of a sweep, the columns that differ between options side by side
    (with the pool's and the peak's GiB when the bytes per token are known)."""

    def cell(f: dict[str, Any], key: str, fmt: str) -> str:
        if fmt == "us":
            return f"{f[key] * 1e6:.1f}"
        if fmt == "rate":  # None where nothing was recomputed
            return "-" if f[key] is None else format(f[key], ".2%")
        return format(f[key], fmt)

    columns = _SWEEP_COLUMNS
    if runs and runs[0].get("pool_gib") is not None:
        columns = (*columns[:3], *_GIB_COLUMNS, *columns[3:])
    table = [[h for h, _, _ in columns]]
    table += [[cell(f, k, fmt) for _, k, fmt in columns] for f in runs]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_doc(path: str | Path, doc: dict[str, Any]) -> None:
    """Write `doc` as JSON atomically (a temporary file, then a rename): a run killed while
    writing leaves the previous version whole (`--mrc` writes the file after every stage)."""
    text = json.dumps(doc, indent=1) + "\n"
    target = Path(path)
    if target.exists() and not target.is_file():
        # A device, a pipe or the like (`--json /dev/null`, `--json /dev/stdout`): written
        # in place. A rename would replace it with a regular file, and as root that breaks
        # /dev/null for every process on the machine.
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        return
    target = target.resolve()  # a symlink: replace the file it names, not the link
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def json_doc(
    runs: Sequence[dict[str, Any]],
    *,
    extra: dict[str, Any] | None = None,
    sweep: bool | None = None,
) -> dict[str, Any]:
    """One run: its figures at the top level; a sweep (`sweep`, default: more than one run):
    `{"runs": [...]}`; `extra` adds sections."""
    one = len(runs) == 1 if sweep is None else not sweep
    doc: dict[str, Any] = dict(runs[0]) if one and runs else {"runs": list(runs)}
    doc.update(extra or {})
    return doc


def write_json(
    path: str | Path, runs: Sequence[dict[str, Any]], *, extra: dict[str, Any] | None = None
) -> None:
    """One run: its figures at the top level; a sweep: `{"runs": [...]}`; `extra` adds
    sections (`--model`: `{"model": ..., "runs": [model run, all-full run]}`)."""
    write_doc(path, json_doc(runs, extra=extra))


__all__ = [
    "add_memory",
    "figures",
    "json_doc",
    "summary_table",
    "sweep_table",
    "write_doc",
    "write_json",
]
