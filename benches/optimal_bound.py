"""Issue 35: every eviction policy beside Belady's offline optimum under the prefix constraint.

For each workload (the built-in ones at `simulate`'s defaults: 500 requests, 4,096 blocks of
16; and the shared Mooncake trace, 65,536 blocks of 16, when present), one
`simulate --eviction lru,s3fifo,arc,lfu,slru` (`sim.policies.run_policies`: one scheduled run
per policy, the bound over LRU's recorded stream, `sim.policies_bound`), then one markdown
row: each policy's workload hit rate with the share of LRU's gap to the bound it closes, the
bound and LRU over the bound's own stream. And for the trace, the pure cache replay's curve
with LRU, FIFO and the optimum at a few sizes (`sim.mrc_blocks`, block size 512).

Run: `python benches/optimal_bound.py [--trace T] [--out FILE.md] [--skip-trace]`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from pagedkv.config import BlockManagerConfig, Eviction
from pagedkv.sim.bound_report import bound_rates, bound_sizes
from pagedkv.sim.mrc_blocks import block_curve, block_replay
from pagedkv.sim.policies import run_policies
from pagedkv.sim.policies_bound import gap_closed
from pagedkv.sim.trace import read_trace
from pagedkv.sim.workloads import WORKLOADS, build_workload

POLICIES: list[Eviction] = ["lru", "s3fifo", "arc", "lfu", "slru"]
SCHEDULE: dict[str, Any] = {"max_num_batched_tokens": 2048}
TRACE = Path("/work/shared/traces/mooncake_synthetic_trace.jsonl")


def row(name: str, blocks: int, runs: list[dict[str, Any]]) -> str:
    by = {f["eviction"]: f for f in runs}
    bound = by["lru"]["bound"]
    lru = by["lru"]["workload_hit_rate"]
    cells = []
    for p in POLICIES:
        h = by[p]["workload_hit_rate"]
        share = gap_closed(h, lru, bound)
        cells.append(f"{h:.2%}" + (f" ({share:.0%})" if share is not None and p != "lru" else ""))
    return (
        f"| {name} | {blocks} | {' | '.join(cells)} | {bound['optimal_hit_rate']:.2%} | "
        f"{bound['stream_lru_hit_rate']:.2%} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines = [
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; workload hit rates of one "
        "scheduled run per policy, in brackets the share of LRU's gap to the bound it closes; "
        "the bound and LRU over the LRU run's recorded stream (a pure cache: nothing pinned)",
        "",
        "| workload | blocks of 16 | " + " | ".join(POLICIES) + " | optimal (bound) | LRU on "
        "the bound's stream |",
        "|---" * (len(POLICIES) + 4) + "|",
    ]
    for name in WORKLOADS:
        w = build_workload(name, 500)
        config = BlockManagerConfig(num_blocks=4096, num_cpu_blocks=512)
        lines.append(row(name, 4096, run_policies(w, config, POLICIES, SCHEDULE, repeats=1)))
        print(lines[-1], flush=True)
    if not args.skip_trace and args.trace.exists():
        w = read_trace(args.trace, limit=None, ms_per_step=20.0, trace_format="auto")
        config = BlockManagerConfig(num_blocks=65536, num_cpu_blocks=512)
        runs = run_policies(w, config, POLICIES, SCHEDULE, repeats=1)
        lines.append(row(args.trace.name, 65536, runs))
        print(lines[-1], flush=True)
        rep = block_replay(w, 512)
        curve = block_curve(w, 512, replay=rep)
        sizes = bound_sizes(curve)
        rates = bound_rates(curve, rep, sizes)
        lines += [
            "",
            f"{args.trace.name}, pure cache replay at block granularity (512 tokens), every "
            "request counted:",
            "",
            "| blocks of 512 | LRU | FIFO | optimal | LRU's share of the optimum |",
            "|---|---|---|---|---|",
        ]
        for i, n in enumerate(sizes):
            lru, fifo, opt = (rates[p][i] for p in ("lru", "fifo", "optimal"))
            lines.append(f"| {n} | {lru:.2%} | {fifo:.2%} | {opt:.2%} | {lru / opt:.0%} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
