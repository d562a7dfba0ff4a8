"""The sizing part of `simulate`: its options, and the steps after the configured runs.

`--mrc` records a miss-ratio curve in every run (`mrc.MRCRecorder`), prints the curve of each
block size (from its run with the most blocks: the least disturbed by pressure) and ends the
summary with the smallest cache that reaches a target hit rate without preemption, checked by
full runs (`sizing.recommend`). `--model NAME` (a one-group preset) or `--kv-bytes-per-token
N` turn block counts into GiB (`kv_bytes`). The options form their own argument group, so
that other groups can come and go beside it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TextIO

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.mrc import MRCRecorder
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.requests import Workload
from pagedkv.sim.sizing import Recommendation, Trial, recommend
from pagedkv.sim.sizing_report import mrc_table, recommendation_json, recommendation_lines
from pagedkv.sim.units import byte_size

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
        "checked by full runs",
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
    return bool(args.mrc or args.mrc_sample is not None or args.target_hit_rate is not None)


def recorder(args: argparse.Namespace, workload: Workload, block_size: int) -> MRCRecorder:
    """A recorder for one run: exact unless the workload is large (or --mrc-sample says)."""
    if args.mrc_sample is not None:
        return MRCRecorder(block_size, args.mrc_sample)
    touches = 2 * (workload.prompt_tokens + workload.max_new_tokens) // block_size
    rate = 1.0 if touches <= EXACT_TOUCHES else 1 / -(-touches // EXACT_TOUCHES)
    return MRCRecorder(block_size, rate)


def _trial(f: dict[str, Any], target: float) -> Trial:
    return Trial(
        f["num_blocks"], f["workload_hit_rate"], f["preemptions"], f["rejected_requests"], target
    )


def size_cache(
    args: argparse.Namespace,
    curves: list[tuple[BlockManagerConfig, MissRatioCurve]],
    run: Callable[[BlockManagerConfig, str], dict[str, Any]],
    kv: KVBytes | None,
    out: TextIO,
) -> dict[str, Any]:
    """Print each block size's curve and the recommendation; return the JSON `sizing` part.

    `curves`: each run's configuration and curve. `run(config, label)`: a full run's figures.
    """
    best: dict[int, tuple[BlockManagerConfig, MissRatioCurve]] = {}
    for config, curve in curves:
        have = best.get(config.block_size)
        if have is None or config.num_blocks > have[0].num_blocks:
            best[config.block_size] = (config, curve)
    for _, curve in best.values():
        print(file=out)
        print(mrc_table(curve, kv), file=out)
    recs: list[Recommendation] = []
    for config, curve in best.values():
        if args.target_hit_rate is not None:
            target, note = args.target_hit_rate, ""
        else:
            target = DEFAULT_TARGET_FRACTION * curve.unbounded_hit_rate
            note = (
                f" ({DEFAULT_TARGET_FRACTION:.0%} of the unbounded {curve.unbounded_hit_rate:.2%})"
            )

        def attempt(n: int, config: BlockManagerConfig = config, target: float = target) -> Trial:
            sized = BlockManagerConfig(
                num_blocks=n,
                block_size=config.block_size,
                num_cpu_blocks=config.num_cpu_blocks,
                hash_algo=config.hash_algo,
                watermark=config.watermark,
            )
            return _trial(run(sized, f"sizing B={config.block_size} blocks={n}"), target)

        recs.append(recommend(curve, target, attempt, target_note=note))
    print(file=out)
    print(recommendation_lines(recs, kv), file=out)
    return {
        "target_hit_rate": args.target_hit_rate,
        "default_target_fraction": DEFAULT_TARGET_FRACTION,
        "recommendations": [recommendation_json(r, kv) for r in recs],
    }


__all__ = ["EXACT_TOUCHES", "add_sizing_arguments", "recorder", "size_cache", "wants_mrc"]
