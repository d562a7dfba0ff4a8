"""Issue 35: the replay's scheduling loop in Python and in Rust, side by side on one trace.

Runs, in turn, `--rounds` times each (the loops alternate within every round):

- `full`: `python -m pagedkv simulate --trace T --mrc --no-progress --json F` (the full sizing
  answer with its check runs: the curve run through the scheduler, then the check runs);
- `curve`: `python -m pagedkv simulate --trace T --mrc-only --mrc-replay scheduled
  --no-progress --json F` (the answer without check runs, its curve from a replay through the
  scheduler);

each with `--loop python` (the reference) and `--loop rust` (docs/scheduling-loop.md). Each
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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        trace = args.trace or trace_path(tmp)
        load = os.getloadavg()[0]
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for loop in LOOPS:
                for name, cmd in commands(trace, loop, tmp).items():
                    runs.setdefault((name, loop), []).append(measure(cmd))
        same = {
            name: untimed(json.loads((tmp / f"{name}-python.json").read_text()))
            == untimed(json.loads((tmp / f"{name}-rust.json").read_text()))
            for name in ("full", "curve")
        }
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"{stamp}, trace {trace.name}, {args.rounds} rounds in turn; load average before: "
        f"{load:.2f}",
        "",
        "| command | loop | CPU s median (range) | rust / python | wall s median | same answer |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("full", "curve"):
        med = {loop: statistics.median(r["cpu_s"] for r in runs[(name, loop)]) for loop in LOOPS}
        for loop in LOOPS:
            cpu = [r["cpu_s"] for r in runs[(name, loop)]]
            wall = statistics.median(r["wall_s"] for r in runs[(name, loop)])
            ratio = f"{med['rust'] / med['python']:.2f}x" if loop == "rust" else ""
            lines.append(
                f"| {name} | {loop} | {med[loop]:.2f} ({min(cpu):.2f}-{max(cpu):.2f}) | "
                f"{ratio} | {wall:.2f} | {'yes' if same[name] else 'NO'} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
