"""The sizing part of `simulate`: its options, the curve's recorder and the target.

`--mrc` records a miss-ratio curve in every run (`mrc_fast.FastMRCRecorder`; with the default
pool, one replay records every block size's: `sizing_jobs`), prints the curve of each block size
(from its run with the most blocks: the least disturbed by pressure) and ends the summary with
the smallest cache that reaches a target hit rate without preemption, checked by full runs
(`sizing.Search`: one run above the curve's estimate, or two-sided with `--bracket`), all of
it in parallel processes (`sizing_jobs`); `--mrc-only` stops at the curve's estimate, and on
a trace of hash ids takes its curve from a pure cache replay at block granularity instead of
a scheduled replay (`--mrc-replay`, `--mrc-warmup`: `sizing_blocks`).
`--model NAME` (a one-group preset) or `--kv-bytes-per-token N` turn block counts into GiB
(`kv_bytes`). The options form their own argument group, so that other groups can come and go
beside it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.requests import Workload
from pagedkv.sim.sizing_report import MIN_ROWS, TABLE_ROWS
from pagedkv.sim.units import byte_size

if TYPE_CHECKING:  # a scheduled replay's recorder: `--mrc-only` on ids needs none
    from pagedkv.sim.mrc_fast import FastMRCRecorder

# Past this many block touches the curve is sampled down to it (SHARDS). Measured: about 70
# bytes of memory per touch while recording and computing (7.7 M touches took 0.5 GB more
# than the replay alone), so the limit keeps the curve near 1.2 GB.
EXACT_TOUCHES = 1 << 24
DEFAULT_TARGET_FRACTION = 0.95  # of the unbounded hit rate


def _rate(text: str) -> float:
    """`0.6` or `60%`, in (0, 1]."""
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a rate in (0, 1] such as 0.6 or 60%: {text}")
    return value


def _points(text: str) -> int:
    n = int(text)
    if n < MIN_ROWS:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_ROWS} rows, got {text}")
    return n


def _warmup(text: str) -> float:
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1) such as 0.5 or 50%: {text}")
    return value


def _jobs(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 1, got {text}")
    return n


def add_sizing_arguments(sim: argparse.ArgumentParser) -> None:
    """The `sizing` argument group of `simulate`."""
    g = sim.add_argument_group("sizing (how much KV cache a workload needs)")
    g.add_argument(
        "--mrc",
        action="store_true",
        help="miss-ratio curve: from each run, the prefix-cache hit rate of every cache size "
        "(LRU over block contents, from exact stack distances; sampled for large workloads), "
        "printed per block size, saved as 'mrc' in --json and drawn by --plot; then the "
        "smallest cache reaching the target hit rate without preemption, per block size, "
        "checked by full runs (in parallel processes: --jobs). Without --num-blocks or "
        "--cache-tokens one replay, the smallest block size's, records every block size's "
        "curve and the other block sizes get no run of their own",
    )
    g.add_argument(
        "--mrc-only",
        "--no-check",
        action="store_true",
        dest="mrc_only",
        help="the quickest answer: the curves and, per block size, the curve's estimate of the "
        "size for the target (marked as an estimate), without the check runs; implies --mrc",
    )
    g.add_argument(
        "--mrc-replay",
        choices=("auto", "cache", "scheduled"),
        default="auto",
        help="what the curve replays. scheduled: the workload through the scheduler and the "
        "manager (running sequences pin their blocks, chunked prefill, preemption); cache: a "
        "pure cache replay of a trace's hash ids block by block in file order, no tokens and "
        "no scheduler (what other sizing tools compute; milliseconds; with --mrc-only, and "
        "only where the block size and the trace's tokens per id divide one another); auto "
        "(default): cache for --mrc-only on such a trace, scheduled otherwise. Beside a cache "
        "curve: LRU, FIFO and Belady's offline optimum under the prefix constraint at a few "
        "sizes",
    )
    g.add_argument(
        "--mrc-warmup",
        type=_warmup,
        default=0.0,
        metavar="SHARE",
        help="the pure cache replay: replay the first SHARE of the requests (0.5 or 50%%) "
        "without counting their hits, as kvcache-simulator counts the last half only "
        "(default 0: every request counts)",
    )
    g.add_argument(
        "--bracket",
        action="store_true",
        help="the two-sided search: check the curve's estimate itself too, and search until a "
        "size that fails lies within 5%% below the answer (default: one check run per block "
        "size, 5%% above the curve's estimate, and further up only if that fails); implies "
        "--mrc",
    )
    g.add_argument(
        "--mrc-points",
        type=_points,
        default=TABLE_ROWS,
        metavar="N",
        help=f"rows of each printed curve (default {TABLE_ROWS}): equal steps of hit rate, so "
        "they crowd at the knee, plus rows 1.25x apart around the target; --json holds these "
        "and 96 more sizes",
    )
    g.add_argument(
        "--jobs",
        type=_jobs,
        default=None,
        metavar="N",
        help="processes for the sizing runs: the block sizes' curve runs and the check runs "
        "run side by side (default: one per CPU core; 1 runs them all in this process). The "
        "answer is the same for any N",
    )
    g.add_argument(
        "--mrc-sample",
        type=_rate,
        metavar="RATE",
        help="SHARDS sampling rate of the curve in (0, 1]; 1 is exact (default: exact up to "
        f"{EXACT_TOUCHES:,} block touches, sampled down to that many beyond); implies --mrc",
    )
    g.add_argument(
        "--target-hit-rate",
        type=_rate,
        metavar="RATE",
        help="the hit rate to size for, e.g. 0.6 or 60%% (default: 95%% of the unbounded "
        "hit rate of each block size); implies --mrc",
    )
    g.add_argument(
        "--kv-bytes-per-token",
        type=byte_size,
        metavar="N",
        help="KV-cache bytes per token, every layer's K and V (Llama-3-8B in bf16: 32 layers "
        "x 2 x 8 heads x 128 x 2 bytes = 131072 = 128KiB; byte sizes take KiB, MiB, GiB "
        "(1024^n) or kB, MB, GB (1000^n); a bare K, M or G is refused as ambiguous): block "
        "counts also print as GiB; --model NAME gives it for a one-group preset",
    )


def wants_mrc(args: argparse.Namespace) -> bool:
    return bool(
        args.mrc
        or args.mrc_only
        or args.bracket
        or args.mrc_sample is not None
        or args.target_hit_rate is not None
        or args.mrc_replay != "auto"
        or args.mrc_warmup > 0
    )


def recorder(args: argparse.Namespace, workload: Workload, block_size: int) -> FastMRCRecorder:
    """A recorder for one run: exact unless the workload is large (or --mrc-sample says)."""
    from pagedkv.sim.mrc_fast import FastMRCRecorder

    if args.mrc_sample is not None:
        return FastMRCRecorder(block_size, args.mrc_sample)
    touches = 2 * (workload.prompt_tokens + workload.max_new_tokens) // block_size
    rate = 1.0 if touches <= EXACT_TOUCHES else 1 / -(-touches // EXACT_TOUCHES)
    return FastMRCRecorder(block_size, rate)


def target_for(args: argparse.Namespace, curve: MissRatioCurve) -> tuple[float, str]:
    """The hit rate to size for, and how it was chosen (for the output)."""
    if args.target_hit_rate is not None:
        return args.target_hit_rate, ""
    peak = curve.unbounded_hit_rate
    return (
        DEFAULT_TARGET_FRACTION * peak,
        f" ({DEFAULT_TARGET_FRACTION:.0%} of the unbounded {peak:.2%})",
    )


__all__ = [
    "DEFAULT_TARGET_FRACTION",
    "EXACT_TOUCHES",
    "add_sizing_arguments",
    "recorder",
    "target_for",
    "wants_mrc",
]
