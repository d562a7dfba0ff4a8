"""`simulate --ablate` and `simulate --ablate-claims`: the options and the two flows.

`--ablate` runs the workload of the command line (built-in or `--trace`) with the first
value of each cache option as the full system, then with each mechanism off in turn
(`sim.ablate`), and prints one table (`sim.ablate_report`). `--ablate-claims` runs each
published claim on a workload of its kind, at `--requests` requests, and prints whether it
held (`sim.ablate_claims`). A line per run goes to stderr (unless `--no-progress`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.option_names import BLOCK_SIZES, CLAIM_NAMES
from pagedkv.sim.requests import Workload
from pagedkv.sim.sizing_cli import wants_mrc
from pagedkv.sim.units import parse_bytes

# The ablation's runs (the scheduler, the tiers, the claims' workloads) are imported by
# `simulate_ablate` only: the options alone are defined for every `simulate` command.


def _ints(minimum: int) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            items = [int(t) for t in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of whole numbers, got {text!r}"
            ) from None
        if any(i < minimum for i in items):
            raise argparse.ArgumentTypeError(f"expected numbers >= {minimum}, got {text!r}")
        return items

    parse.__name__ = "list of whole numbers"
    return parse


def _names(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    bad = [t for t in items if t not in CLAIM_NAMES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown claim {bad[0]!r}; accepted: {', '.join(CLAIM_NAMES)}"
        )
    return items


def _bytes_or_zero(text: str) -> int:
    if text.strip() == "0":
        return 0
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_ablate_arguments(sim: argparse.ArgumentParser) -> None:
    a = sim.add_argument_group("ablations (docs/ablations.md)")
    a.add_argument(
        "--ablate",
        action="store_true",
        help="run the workload as configured (the full system), then with each mechanism off "
        "in turn: prefix caching, fork sharing (forks copy), delayed reclaim (released blocks "
        "reclaimed after --reclaim-window steps), swap (recompute), cold-block compression "
        "(a host tier raw against lz4), and each of --ablate-block-sizes at equal cache "
        "tokens; one table of memory, hit rate, preemptions and manager time",
    )
    a.add_argument(
        "--ablate-claims",
        nargs="?",
        const=",".join(CLAIM_NAMES),
        type=_names,
        default=None,
        metavar="NAMES",
        help="check published claims, each on a workload of its kind at --requests requests, "
        f"and say whether each held; a comma list of {', '.join(CLAIM_NAMES)} (default all)",
    )
    a.add_argument(
        "--reclaim-window",
        type=_ints(0),
        default=[0],
        metavar="STEPS",
        help="--ablate: the delayed-reclaim rows reclaim a released block this many steps "
        "later (comma list; default 0: at once)",
    )
    a.add_argument(
        "--ablate-block-sizes",
        type=_ints(1),
        default=list(BLOCK_SIZES),
        metavar="SIZES",
        help="--ablate: block sizes of the sweep at equal cache tokens (default "
        f"{','.join(map(str, BLOCK_SIZES))})",
    )
    a.add_argument(
        "--ablate-tier-bytes",
        type=_bytes_or_zero,
        default=None,
        metavar="N",
        help="--ablate: the host tier of the compression rows, in bytes of the model's KV "
        "(64GiB, 512MiB; default: a quarter of the GPU pool's; 0: leave the rows out, said "
        "so in the table)",
    )
    a.add_argument(
        "--claim-rounds",
        type=int,
        default=3,
        metavar="N",
        help="--ablate-claims: run each timed claim (hot blocks, lz4, block size) N times; "
        "its verdict stands only when every round agrees and clears the rule by 20%% of its "
        "threshold either way, else it is INCONCLUSIVE (default 3)",
    )
    a.add_argument(
        "--ablate-repeats",
        type=int,
        default=3,
        metavar="N",
        help="manager times are the CPU time of a run's calls replayed N times, the least "
        "kept (noise only adds); the lz4 claim's tiered runs run N times, the least wall "
        "time kept; the table's tier rows run once (default 3)",
    )


def wants_ablate(args: argparse.Namespace) -> bool:
    return bool(args.ablate or args.ablate_claims is not None)


def _progress(args: argparse.Namespace, err: TextIO) -> Callable[[str], None]:
    def say(label: str) -> None:
        if not args.no_progress:
            print(f"ablate: {time.strftime('%H:%M:%S')} {label}", file=err, flush=True)

    return say


def _tiers(args: argparse.Namespace, config: BlockManagerConfig) -> tuple[Any, str | None]:
    """The host tier of the compression rows, or why they are left out."""
    from pagedkv.sim.ablate_claims import tiers_unavailable
    from pagedkv.sim.kv_bytes import from_model, kv_bytes
    from pagedkv.sim.tier_run import DEFAULT_MODEL, TierOptions

    if args.ablate_tier_bytes == 0:
        return None, "left out (--ablate-tier-bytes 0)"
    why = tiers_unavailable()
    if why is not None:
        return None, why
    kv = kv_bytes(args.model, args.kv_bytes_per_token) or from_model(DEFAULT_MODEL)
    host = args.ablate_tier_bytes
    if host is None:
        host = config.num_blocks * kv.per_block(config.block_size) // 4
    return TierOptions(kv=kv, host_bytes=host, data="real"), None


def simulate_ablate(
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
    workload: Callable[[argparse.Namespace, TextIO], Workload],
    schedule: Callable[[argparse.Namespace], dict[str, Any]],
    configs: Callable[[argparse.Namespace], list[BlockManagerConfig]],
) -> int:
    """`--ablate` and/or `--ablate-claims` (the command's workload, scheduler and cache
    options come through the callables of `sim.cli`)."""
    from pagedkv.sim.ablate import run_ablation, variants
    from pagedkv.sim.ablate_claims import MARGIN, ClaimRunner, check_claims, claims_table
    from pagedkv.sim.ablate_report import ablation_table
    from pagedkv.sim.kv_bytes import kv_bytes

    if wants_mrc(args) or args.host_tier_bytes is not None or args.remote is not None:
        raise ValueError("--ablate and --ablate-claims run on their own: drop --mrc and tiers")
    if args.ablate_repeats < 1:
        raise ValueError(f"--ablate-repeats must be >= 1, got {args.ablate_repeats}")
    if args.claim_rounds < 1:
        raise ValueError(f"--claim-rounds must be >= 1, got {args.claim_rounds}")
    if args.reference:
        raise ValueError("--ablate runs the Rust manager (evict_blocks, block_tables)")
    say = _progress(args, err)
    sched = schedule(args)
    doc: dict[str, Any] = {}
    cs = configs(args)
    if args.ablate and len(cs) != 1:
        raise ValueError(
            "--ablate compares against one configuration: give one value each for "
            "--block-size, --num-blocks or --cache-tokens, and --hash-algo (the block "
            "sizes of the sweep come from --ablate-block-sizes)"
        )
    print("pagedkv simulate: ablations, BlockManager (Rust core)", file=out)
    if args.ablate:
        config = cs[0]
        w = workload(args, err)
        kv = kv_bytes(args.model, args.kv_bytes_per_token)
        tiers, skipped = _tiers(args, config)
        vs = variants(
            config,
            windows=args.reclaim_window,
            tiers=tiers,
            tiers_skipped=skipped,
            block_sizes=args.ablate_block_sizes,
        )
        print(f"workload    {w.describe()}", file=out)
        print(
            f"full system {config.num_blocks} blocks x {config.block_size} tokens, "
            f"{config.num_cpu_blocks} CPU blocks; prefix caching on, forks share, released "
            "blocks kept until their space is needed",
            file=out,
        )
        if tiers is not None:
            print(f"tiers       {tiers.describe(config.block_size)}", file=out)
        runs = run_ablation(
            w,
            vs,
            sched,
            kv=kv,
            check=args.check,
            progress=lambda label: say(label),
            repeats=args.ablate_repeats,
        )
        print(file=out)
        print(ablation_table(runs), file=out)
        doc["ablation"] = [{k: v for k, v in f.items() if k != "steps"} for f in runs]
    if args.ablate_claims is not None:
        runner = ClaimRunner(
            requests=args.requests,
            seed=args.seed,
            schedule=sched,
            repeats=args.ablate_repeats,
            progress=lambda label: say(label),
        )
        results = check_claims(runner, args.ablate_claims, rounds=args.claim_rounds)
        print(file=out)
        print(
            f"claims      at {args.requests} requests per workload, seed {args.seed}; timed "
            f"claims in {args.claim_rounds} rounds, a {MARGIN:.0%} margin on their thresholds",
            file=out,
        )
        print(claims_table(results), file=out)
        doc["claims"] = [c.as_dict() for c in results]
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"json        {args.json}", file=out)
    return 0


__all__ = ["add_ablate_arguments", "simulate_ablate", "wants_ablate"]
