"""`simulate --mrc-only` on a trace of hash ids: the curves from a pure cache replay at block
granularity (`mrc_blocks`), in milliseconds instead of a scheduled replay of every token.

Used when `--mrc-replay` is `cache`, or `auto` (the default) with `--mrc-only` on a trace whose
ids fit the block size (`mrc_blocks.unfit_reason`) and nothing asks for a scheduled replay's
runs (`--plot`, `--check`, `--mrc-sample`, `--reference`: `auto` then takes the scheduled
replay, and `cache` refuses them). The output says what the curve is: a pure
cache replay in file order, not pagedkv's scheduled replay (running sequences pin their blocks,
prompts are chunked, requests overlap and may be preempted), and the answer is the curve's
estimate only. The full answer (without `--mrc-only`) records its curves from scheduled
replays and checks its sizes by full runs, and states how far the pure cache replay's curve is
from them (`sizing_fidelity`). Beside each curve: Belady's offline optimum under the prefix
constraint, with LRU and FIFO, at a few sizes (`bound_report`).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, TextIO

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.bound_report import bound_json, bound_rates, bound_sizes, bound_table
from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.mrc_blocks import block_curve, block_replay, first_counted, unfit_reason
from pagedkv.sim.progress import clock
from pagedkv.sim.report import write_doc
from pagedkv.sim.requests import Workload
from pagedkv.sim.sizing import Search
from pagedkv.sim.sizing_cli import target_for
from pagedkv.sim.sizing_report import (
    curve_json,
    mrc_table,
    recommendation_json,
    recommendation_lines,
    table_sizes,
)


def replay_kind(args: argparse.Namespace, configs: list[BlockManagerConfig], w: Workload) -> str:
    """`cache` or `scheduled`: which replay gives the curves; raises ValueError when
    `--mrc-replay cache` cannot be honoured (naming why)."""
    sizes = sorted({c.block_size for c in configs})
    unfit = [f"B={bs}: {why}" for bs in sizes if (why := unfit_reason(w, bs)) is not None]
    # What only a scheduled replay has: its runs' plot, per-step checks, a sampled curve,
    # the pure-Python manager.
    needs_runs = [
        name
        for name, on in (
            ("--plot", args.plot is not None),
            ("--check", args.check),
            ("--mrc-sample", args.mrc_sample is not None),
            ("--reference", args.reference),
        )
        if on
    ]
    choice = args.mrc_replay
    if choice == "cache":
        if unfit:
            raise ValueError(f"--mrc-replay cache needs a trace of hash ids: {'; '.join(unfit)}")
        if not args.mrc_only:
            raise ValueError(
                "--mrc-replay cache gives curves only: add --mrc-only (the full answer checks "
                "its sizes with scheduled replays)"
            )
        if needs_runs:
            raise ValueError(
                f"--mrc-replay cache runs no scheduled replay: drop {', '.join(needs_runs)}"
            )
        return "cache"
    if choice == "auto" and args.mrc_only and not unfit and not needs_runs:
        return "cache"
    if args.mrc_warmup:
        raise ValueError("--mrc-warmup applies to the pure cache replay only (--mrc-replay cache)")
    return "scheduled"


def size_from_ids(
    args: argparse.Namespace,
    configs: list[BlockManagerConfig],
    workload: Workload,
    kv: KVBytes | None,
    out: TextIO,
    started: tuple[float, float],
) -> int:
    """The curves, the bound and the curve's estimates, printed and saved; returns 0."""
    from pagedkv.sim.runner import cpu_seconds

    first = first_counted(workload, args.mrc_warmup)
    counted = len(workload.requests) - first
    window = (
        f"the last {counted} of {len(workload.requests)} requests" if first else "every request"
    )
    print(
        f"curve       the pure cache replay (--mrc-replay cache), hit rates over {window}; "
        "the full answer (without --mrc-only) replays through the scheduler and checks its "
        "sizes by full runs",
        file=out,
    )
    recs = []
    curves: list[dict[str, Any]] = []
    for bs in sorted({c.block_size for c in configs}):
        replay = block_replay(workload, bs)
        curve = block_curve(workload, bs, warmup=args.mrc_warmup, replay=replay)
        target, note = target_for(args, curve)
        search = Search(curve, target, target_note=note)
        rec = search.result(checked=False, complete=True)
        recs.append(rec)
        print(file=out)
        print(mrc_table(curve, kv, rows=args.mrc_points, targets=(target,)), file=out)
        sizes = bound_sizes(curve, (rec.estimate,) if rec.estimate else ())
        rates = bound_rates(curve, replay, sizes, first)
        print(file=out)
        print(bound_table(curve, sizes, rates, kv), file=out)
        doc = curve_json(curve, table_sizes(curve, args.mrc_points, (target,)))
        doc["mrc_info"].update({"replay": "cache", "first_counted_request": first})
        curves.append({"block_size": bs, **doc, "bound": bound_json(sizes, rates)})
    print(file=out)
    print(recommendation_lines(recs, kv), file=out)
    wall0, cpu0 = started
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    if args.json:
        sizing = {
            "status": "complete",
            "checked": False,
            "replay": "cache",
            "recommendations": [recommendation_json(r, kv) for r in recs],
            "curves": curves,
            "wall_s": wall,
            "cpu_s": cpu,
        }
        write_doc(args.json, {"workload": workload.describe(), "sizing": sizing})
        print(f"json        {args.json}", file=out)
    print(
        f"time        wall {wall:.2f} s ({clock(wall)}), CPU {cpu:.2f} s: user + sys of this "
        "process, the trace's reading included",
        file=out,
    )
    out.flush()
    return 0


__all__ = ["replay_kind", "size_from_ids"]
