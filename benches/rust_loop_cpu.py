"""Issue 35: the replay's scheduling loop in Python and in Rust, side by side on one trace.

Runs, in turn, `--rounds` times each (the loops alternate within every round):

- `full`: `python -m pagedkv simulate --trace T --mrc --no-progress --json F` (the full sizing
  answer with its check runs: the curve run through the scheduler, then the check runs);
- `curve`: `python -m pagedkv simulate --trace T --mrc-only --mrc-replay scheduled
  --no-progress --json F` (the answer without check runs, its curve from a replay through the
  scheduler);

each with `--loop python` (the reference) and `--loop rust` (docs/scheduling-loop.md); and
`replay`: the sizing curve run's replay alone, in this process (`run_workload` on the trace at
65,536 blocks of 16 with a `FastMRCRecorder` watching, the budget 2048), timed by
`time.process_time` around the call (the trace read once before). Each
process is timed by `os.wait4` (user + system CPU seconds of it and its waited-for children:
the sizing runs' worker processes) as `sizing_vs_kvsim.measure` does. Printed: medians and
ranges per command, the ratio of the medians (Rust over Python) per command, and whether
both loops gave the same answer (their `--json` documents equal once the times and the
`loop` figure are left out).

Run: `python benches/rust_loop_cpu.py [--trace T] [--rounds 3] [--out FILE.md]` (the trace:
`--trace`, else the shared Mooncake trace beside the checkout or `PAGEDKV_MOONCAKE_TRACE`,
else a synthetic one of its format, as `sizing_vs_kvsim.py` picks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "support")]

from mooncake_trace import trace_path  # noqa: E402
from sizing_vs_kvsim import measure  # noqa: E402

LOOPS = ("python", "rust")
# Figures that are times (or say which loop ran): they differ between runs of either loop.
TIMED = ("_s", "_ns", "ns_per", "wall", "cpu", "loop", "per_step_us", "manager_share")


def commands(trace: Path, loop: str, tmp: Path) -> dict[str, list[str]]:
    py = [sys.executable, "-m", "pagedkv", "simulate", "--trace", str(trace), "--loop", loop]
    return {
        "full": [*py, "--mrc", "--no-progress", "--json", str(tmp / f"full-{loop}.json")],
        "curve": [
            *(*py, "--mrc-only", "--mrc-replay", "scheduled", "--no-progress"),
            *("--json", str(tmp / f"curve-{loop}.json")),
        ],
    }


def replay_cpu(trace: Path, rounds: int) -> dict[str, list[float]]:
    """CPU seconds of the curve run's replay on each loop, in turn, `rounds` times."""
    from pagedkv import BlockManagerConfig
    from pagedkv.sim import read_trace, run_workload
    from pagedkv.sim.factory import make_manager
    from pagedkv.sim.mrc_fast import FastMRCRecorder

    workload = read_trace(trace)
    config = BlockManagerConfig(num_blocks=65536, block_size=16)
    out: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    hits: dict[str, set[int]] = {loop: set() for loop in LOOPS}
    for _ in range(rounds):
        for loop in LOOPS:
            manager = make_manager(config)
            watch = FastMRCRecorder(16)
            t0 = time.process_time()
            res = run_workload(
                manager, workload, max_num_batched_tokens=2048, watch=watch, loop=loop
            )
            out[loop].append(time.process_time() - t0)
            assert res.loop == loop
            hits[loop].add(res.prefix_hit_tokens)
    assert hits["python"] == hits["rust"] and len(hits["rust"]) == 1, hits
    return out


def untimed(doc: Any) -> Any:
    """`doc` without the figures that are times."""
    if isinstance(doc, dict):
        return {k: untimed(v) for k, v in doc.items() if not any(t in k for t in TIMED)}
    if isinstance(doc, list):
        return [untimed(v) for v in doc]
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="append the table to this file")
    ap.add_argument("--no-commands", action="store_true", help="the in-process replay only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trace = args.trace or trace_path(tmp)
        load = os.getloadavg()[0]
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        names = [] if args.no_commands else ["full", "curve"]
        for _ in range(args.rounds if names else 0):
            for loop in LOOPS:
                for name, cmd in commands(trace, loop, tmp).items():
                    runs.setdefault((name, loop), []).append(measure(cmd))
        same = {
            name: untimed(json.loads((tmp / f"{name}-python.json").read_text()))
            == untimed(json.loads((tmp / f"{name}-rust.json").read_text()))
            for name in names
        }
        for loop, cpu in replay_cpu(trace, args.rounds).items():
            runs[("replay", loop)] = [{"cpu_s": c} for c in cpu]
        same["replay"] = True  # replay_cpu asserts the same hits
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"{stamp}, trace {trace.name}, {args.rounds} rounds in turn; load average before: "
        f"{load:.2f}",
        "",
        "| command | loop | CPU s median (range) | rust / python | wall s median | same answer |",
        "|---|---|---|---|---|---|",
    ]
    for name in [*names, "replay"]:
        med = {loop: statistics.median(r["cpu_s"] for r in runs[(name, loop)]) for loop in LOOPS}
        for loop in LOOPS:
            cpu = [r["cpu_s"] for r in runs[(name, loop)]]
            walls = [r["wall_s"] for r in runs[(name, loop)] if "wall_s" in r]
            wall = f"{statistics.median(walls):.2f}" if walls else "-"
            ratio = f"{med['rust'] / med['python']:.2f}x" if loop == "rust" else ""
            lines.append(
                f"| {name} | {loop} | {med[loop]:.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | "
                f"{ratio} | {wall} | {'yes' if same[name] else 'NO'} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
