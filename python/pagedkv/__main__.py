"""Command-line tool: `python -m pagedkv simulate [options]`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

from pagedkv.config import HASH_ALGOS, BlockManagerConfig
from pagedkv.simulate import ManagerLike, generate_workload, run_workload


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv", description="pagedkv: paged KV-cache block manager tools"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser(
        "simulate",
        help="replay a synthetic shared-prefix serving workload and print the manager's stats",
        description=(
            "Replay a deterministic synthetic workload (requests sharing a few system prompts, "
            "continuous batching, preemption, parallel sampling, constant eviction) through a "
            "block manager; print its stats, the wall time and the time per token."
        ),
    )
    sim.add_argument("--num-blocks", type=int, default=1024, help="GPU blocks (default 1024)")
    sim.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    sim.add_argument(
        "--num-cpu-blocks",
        type=int,
        default=256,
        help="CPU swap blocks; 0 preempts by freeing and recomputing (default 256)",
    )
    sim.add_argument("--requests", type=int, default=300, help="requests (default 300)")
    sim.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    sim.add_argument("--max-batch", type=int, default=256, help="running sequences at most")
    sim.add_argument("--hash-algo", choices=HASH_ALGOS, default="sha256")
    sim.add_argument(
        "--reference",
        action="store_true",
        help="run the pure-Python ReferenceBlockManager instead (to compare)",
    )
    sim.add_argument("--check", action="store_true", help="call check_invariants() at the end")
    return parser


def simulate(args: argparse.Namespace, out: TextIO) -> int:
    """Run the `simulate` command; returns the exit status."""
    config = BlockManagerConfig(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        num_cpu_blocks=args.num_cpu_blocks,
        hash_algo=args.hash_algo,
    )
    from pagedkv.manager import BlockManager

    manager: ManagerLike
    if args.reference:
        from pagedkv.reference import ReferenceBlockManager

        manager = ReferenceBlockManager(
            config.num_blocks, config.block_size, **config.constructor_kwargs()
        )
        name = "ReferenceBlockManager (pure Python)"
    else:
        manager = BlockManager.from_config(config)
        name = "BlockManager (Rust core)"

    workload = generate_workload(args.requests, seed=args.seed)
    print(f"pagedkv simulate: {name}", file=out)
    print(f"workload    {workload.describe()}", file=out)
    result = run_workload(manager, workload, max_batch=args.max_batch)
    if isinstance(manager, BlockManager):
        manager.print_memory_stats(out)
    else:
        print(manager.stats(), file=out)
    print(result.summary(), file=out)
    if args.check:
        manager.check_invariants()
        print("invariants  OK", file=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m pagedkv` and of the `pagedkv` script."""
    args = _build_parser().parse_args(argv)
    if args.command == "simulate":
        try:
            return simulate(args, sys.stdout)
        except ValueError as exc:  # bad sizes: InvalidArgumentError is a ValueError
            print(f"error: {exc}", file=sys.stderr)
            return 2
    raise AssertionError(f"unknown command {args.command!r}")  # argparse prevents this


if __name__ == "__main__":
    sys.exit(main())
