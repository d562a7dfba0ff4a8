"""Command-line tool: `python -m pagedkv simulate [options]` (see `pagedkv.sim`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedkv.sim.cli import add_arguments, simulate


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv", description="pagedkv: paged KV-cache block manager tools"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser(
        "simulate",
        help="replay a serving workload (built-in or a real trace) through the block manager",
        description=(
            "Replay a workload through the block manager with a small continuous-batching "
            "scheduler that schedules like vLLM v1 (a per-step token budget: decodes first, "
            "then chunked prefill, then admission under hit-aware can_allocate; optional "
            "speculative decoding and random aborts; preemption by swap or recompute) and "
            "show how the KV cache behaves: prefix hit rate, registrations, usage, "
            "evictions, preemptions, swaps, copy-on-write, fragmentation and the time spent "
            "inside the manager. Built-in workloads are "
            "seeded; --trace replays a Mooncake-format trace. Comma lists for --block-size, "
            "--num-blocks/--cache-tokens and --hash-algo sweep every combination. --model "
            "NAME compares a model's KV-cache groups (sliding window, chunked local, "
            "recurrent state) with all-full attention on the same memory."
        ),
    )
    add_arguments(sim)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m pagedkv` and of the `pagedkv` script."""
    args = _build_parser().parse_args(argv)
    if args.command == "simulate":
        try:
            return simulate(args, sys.stdout)
        except (ValueError, OSError, RuntimeError) as exc:
            # bad sizes (InvalidArgumentError is a ValueError), a bad or missing trace file,
            # matplotlib missing for --plot
            print(f"error: {exc}", file=sys.stderr)
            return 2
    raise AssertionError(f"unknown command {args.command!r}")  # argparse prevents this


if __name__ == "__main__":
    sys.exit(main())
