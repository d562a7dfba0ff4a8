"""`simulate --nodes N [--routing R] [--cluster-tier T] [--shared-tier-bytes SIZE | --remote
URL]`: the workload on N serving nodes behind a router, over a tier they share
(`sim.cluster`; docs/cluster.md).

The in-process tier's size is given in bytes of the model's KV, as `--host-tier-bytes` is
(`--model` with one full-attention group, or `--kv-bytes-per-token`; llama-3-8b's 128 KiB
per token when neither is given): it holds `bytes // (bytes per block)` blocks.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.option_names import REMOTE_TTL, TIER_MODES
from pagedkv.sim.requests import Workload
from pagedkv.sim.router import ROUTINGS
from pagedkv.sim.runner import progress_lines
from pagedkv.sim.sizing_cli import wants_mrc
from pagedkv.sim.units import parse_bytes

if TYPE_CHECKING:
    from pagedkv.sim.cluster import ClusterOptions

DEFAULT_SHARED_TIER_BYTES = 256 << 30
_OPTIONS = (
    "routing",
    "cluster_tier",
    "shared_tier_bytes",
    "prefix_balance",
    "remote_timeout",
    "remote_cleanup",
)


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_cluster_arguments(sim: argparse.ArgumentParser) -> None:
    g = sim.add_argument_group("cluster: several nodes over one tier (docs/cluster.md)")
    g.add_argument(
        "--nodes",
        type=int,
        default=None,
        metavar="N",
        help="run N serving nodes, each with its own GPU cache (the cache options) and "
        "scheduler, behind a request router, over a tier below the GPUs that they share; "
        "reports per node and in total the workload's hit rate, what came from the tier and "
        "from which node, and the load balance",
    )
    g.add_argument(
        "--routing",
        choices=ROUTINGS,
        default=None,
        help="round-robin (default); least-loaded: fewest tokens of unfinished sequences, "
        "then fewest requests; prefix: the node whose GPU cache holds the longest prefix of "
        "the prompt, ties to the least loaded",
    )
    g.add_argument(
        "--cluster-tier",
        choices=TIER_MODES,
        default=None,
        help="shared (default): one tier for all nodes (in this process, or --remote URL: a "
        "Redis-protocol server, every node in one namespace); per-node: a tier each, the "
        "same bytes in all; off: none",
    )
    g.add_argument(
        "--shared-tier-bytes",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="the in-process tier's size in bytes of the model's KV, all nodes together "
        "(256GiB by default)",
    )
    g.add_argument(
        "--prefix-balance",
        type=float,
        default=None,
        metavar="F",
        help="--routing prefix: a node whose load exceeds F x the mean load plus the prompt "
        "is passed over (default 0: no guard)",
    )
    g.add_argument(
        "--remote-timeout",
        type=float,
        default=None,
        metavar="S",
        help="--nodes with --remote: seconds each reply of the server may take; a put that "
        "waits longer is dropped and counted as an error (default 0.5)",
    )
    g.add_argument(
        "--remote-cleanup",
        action="store_const",
        const=True,
        default=None,
        help="--nodes with --remote: delete the run's keys from the server when it ends "
        f"(without it they stay, expiring after {REMOTE_TTL:g} s)",
    )


def wants_cluster(args: argparse.Namespace) -> bool:
    return args.nodes is not None or any(getattr(args, k) is not None for k in _OPTIONS)


def _options(args: argparse.Namespace, config: BlockManagerConfig) -> tuple[ClusterOptions, str]:
    """The cluster of the command line, checked; and how its tier is sized, in words."""
    from pagedkv.sim.cluster import ClusterOptions
    from pagedkv.sim.kv_bytes import from_model, kv_bytes
    from pagedkv.sim.tier_run import DEFAULT_MODEL

    if args.nodes is None:
        given = [f"--{k.replace('_', '-')}" for k in _OPTIONS if getattr(args, k) is not None]
        raise ValueError(f"{', '.join(given)} needs --nodes")
    refused = {
        "--mrc": wants_mrc(args),  # or an option that implies it
        "--host-tier-bytes (the nodes' tier is --shared-tier-bytes)": args.host_tier_bytes
        is not None,
        "--compress (the cluster counts blocks, it moves no KV)": args.compress is not None,
        "--remote-cluster": args.remote_cluster,
        "--reference": args.reference,
        "--plot": args.plot is not None,
    }
    for name, given in refused.items():
        if given:
            raise ValueError(f"--nodes does not take {name}")
    if args.remote is None and (args.remote_timeout is not None or args.remote_cleanup):
        raise ValueError("--remote-timeout and --remote-cleanup need --remote")
    tier = args.cluster_tier or "shared"
    in_process = tier != "off" and args.remote is None
    if args.shared_tier_bytes is not None and not in_process:
        raise ValueError(
            "--shared-tier-bytes sizes the in-process tier: not with --cluster-tier off or --remote"
        )
    blocks = None
    sizing = ""
    # Read (and checked: a hybrid model's groups are refused) even when nothing is sized.
    kv = kv_bytes(args.model, args.kv_bytes_per_token) or from_model(DEFAULT_MODEL)
    if in_process:
        size = args.shared_tier_bytes or DEFAULT_SHARED_TIER_BYTES
        blocks = size // kv.per_block(config.block_size)
        sizing = (
            f"{size / (1 << 30):g} GiB of KV = {blocks} blocks of {config.block_size} tokens "
            f"({kv.bytes_per_token} bytes per token, {kv.source})"
        )
        if tier == "per-node":
            sizing += f", {blocks // args.nodes} per node"
    options = ClusterOptions(
        nodes=args.nodes,
        routing=args.routing or "round-robin",
        tier=tier,
        tier_blocks=blocks,
        remote=args.remote,
        prefix_balance=args.prefix_balance or 0.0,
        remote_timeout=0.5 if args.remote_timeout is None else args.remote_timeout,
        remote_cleanup=bool(args.remote_cleanup),
    )
    return options, sizing


def simulate_cluster(
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO | None,
    workload: Callable[[argparse.Namespace, TextIO], Workload],
    schedule: Callable[[argparse.Namespace], dict[str, Any]],
    configs: Callable[[argparse.Namespace], list[BlockManagerConfig]],
) -> int:
    """Run `simulate --nodes N` (`workload`, `schedule`, `configs`: the command's own
    readings of its options); returns the exit status."""
    # the cluster's runs (the scheduler, the tiers) are imported here only: the options
    # alone are defined for every `simulate` command
    from pagedkv.sim.cluster import run_cluster
    from pagedkv.sim.cluster_report import cluster_figures, cluster_table

    err = sys.stderr if err is None else err
    cs = configs(args)
    if len(cs) != 1:
        raise ValueError(
            "--nodes runs one configuration: give one value each for --block-size, "
            "--num-blocks or --cache-tokens, and --hash-algo"
        )
    config = cs[0]
    options, sizing = _options(args, config)
    sched = schedule(args)
    w = workload(args, err)
    print(
        f"pagedkv simulate: a cluster of {options.nodes} nodes (BlockManager, Rust core)", file=out
    )
    print(f"workload    {w.describe()}", file=out)
    print(f"cluster     {options.describe()}", file=out)
    print(
        f"each node   GPU blocks {config.num_blocks} x {config.block_size} tokens; CPU blocks "
        f"{config.num_cpu_blocks}; hash {config.hash_algo}",
        file=out,
    )
    if sizing:
        print(f"tier size   {sizing}", file=out)
    lines = progress_lines(args, err, "[cluster]")
    label = f"{options.nodes} nodes"
    step = None
    if lines is not None:
        lines.start(label)
        step = functools.partial(lines.update, label)
    try:
        run = run_cluster(w, config, options, sched, check=args.check, progress=step)
    finally:
        if lines is not None:
            lines.close()  # ends a redrawn line, also when the run raised
    if lines is not None:
        lines.end(label, f"done, {sum(run.routed_requests)} requests routed")
        lines.close()
    doc = cluster_figures(run)
    doc["workload"] = w.describe()
    print(file=out)
    print(cluster_table(doc), file=out)
    if args.check:
        print("invariants  OK (every node, checked after each of its steps)", file=out)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        print(f"json        {args.json}", file=out)
    return 0


__all__ = ["add_cluster_arguments", "simulate_cluster", "wants_cluster"]
