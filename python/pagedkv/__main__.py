"""Command-line tool: `pagedkv simulate [options]` (see `pagedkv.sim`), `pagedkv events`
(`pagedkv.kv_events`), `pagedkv router` (`pagedkv.router`); also `python -m pagedkv`."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import pagedkv._cli_env  # noqa: F401  (first: before anything imports numpy)
from pagedkv import __version__
from pagedkv.sim.cli import add_arguments, simulate
from pagedkv.sim.glossary import GLOSSARY


def _prog() -> str:
    """`pagedkv` when run as the installed script, `python -m pagedkv` when run as a module."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m pagedkv" if name in ("", "__main__.py", "-c") else "pagedkv"


def _build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or _prog(), description="pagedkv: paged KV-cache block manager tools"
    )
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser(
        "simulate",
        help="replay a serving workload (built-in or a real trace) through the block manager",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Replay a workload through the block manager with a small continuous-batching\n"
            "scheduler that schedules like vLLM v1 (a per-step token budget: decodes first,\n"
            "then chunked prefill, then admission under hit-aware can_allocate; optional\n"
            "speculative decoding and random aborts; preemption by swap or recompute) and\n"
            "show how the KV cache behaves: prefix hit rate, registrations, usage, evictions,\n"
            "preemptions, swaps, copy-on-write, fragmentation and the time spent inside the\n"
            "manager. Built-in workloads are seeded; --trace replays a real trace (Mooncake,\n"
            "Bailian; Azure and BurstGPT for load only).\n"
            "Comma lists for --block-size, --num-blocks/--cache-tokens and --hash-algo sweep\n"
            "every combination. --mrc answers the sizing question: the hit rate of every\n"
            "cache size, and the smallest cache reaching a target hit rate without\n"
            "preemption (in GiB with --kv-bytes-per-token or a one-group --model). --model\n"
            "NAME alone compares a model's KV-cache groups (sliding window, chunked local,\n"
            "recurrent state) with all-full attention on the same memory. --ablate turns\n"
            "each mechanism off in turn; --nodes N runs a cluster behind a router over a\n"
            "shared tier. Ctrl-C stops a run cleanly (exit status 130)."
        ),
        epilog=GLOSSARY,
    )
    add_arguments(sim)
    ev = sub.add_parser(
        "events",
        help="follow a KV-event publisher (vLLM's wire format) and print its events",
        description="Follow a KV-event stream (pagedkv.kv_events.Publisher, or vLLM's own) "
        "and print one event a line, prefixed by its batch's sequence number "
        "(docs/events.md). Needs pyzmq and msgspec.",
    )
    _events_arguments(ev)
    rt = sub.add_parser(
        "router",
        help="follow engines' KV-event streams into a router index; print blocks and lookups",
        description="Follow engines' KV-event streams (pagedkv.kv_events.Publisher, or vLLM's "
        "own) into one router index (pagedkv.router, docs/router.md) and print, every "
        "--interval seconds, each engine's blocks per medium and its stream's counters, and "
        "the ranked engines for each request of --lookup. Needs pyzmq and msgspec.",
    )
    _router_arguments(rt)
    return parser


def _events_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--connect", required=True, help="the publisher's PUB endpoint")
    p.add_argument("--replay", help="its replay endpoint: gaps are replayed, a start snapshots")
    p.add_argument("--topic", default="", help="topic prefix to follow (default: every topic)")
    p.add_argument("--form", choices=["map", "array"], default="map", help="the events' form")
    p.add_argument("--count", type=int, default=0, help="stop after this many batches (0: never)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds")


def _router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--connect", action="append", required=True, help="an engine's PUB endpoint (repeat)"
    )
    p.add_argument(
        "--replay", action="append", help="the replay endpoint of the Nth --connect (repeat)"
    )
    p.add_argument("--engine", action="append", help="the Nth engine's id (default: endpoint)")
    p.add_argument("--topic", default="", help="topic prefix to follow (default: every topic)")
    p.add_argument("--block-size", type=int, default=16, help="the engines' block size")
    p.add_argument("--hash-algo", choices=["sha256", "xxh3_128"], default="sha256")
    p.add_argument("--hash-seed", type=int, default=0)
    p.add_argument(
        "--hash-form", choices=["int", "bytes"], default="int", help="the events' block hashes"
    )
    p.add_argument(
        "--lookup",
        type=Path,
        help='JSON lines of requests, {"token_ids": [...]} or {"block_hashes": [...]}',
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between reports")
    p.add_argument("--count", type=int, default=0, help="stop after this many reports (0: never)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m pagedkv` and of the `pagedkv` script."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "simulate":
            try:
                return simulate(args, sys.stdout)
            except (ValueError, OSError, RuntimeError, ImportError) as exc:
                if isinstance(exc, BrokenPipeError):
                    raise
                # bad sizes (InvalidArgumentError is a ValueError), a bad or missing trace
                # file, an output that cannot be written, matplotlib missing for --plot, an
                # optional package missing (lz4 or redis for the tiers)
                print(f"error: {exc}", file=sys.stderr)
                return 2
        if args.command == "events":
            from pagedkv.kv_events.cli import FollowError, follow  # pyzmq, msgspec if asked

            try:
                return follow(args, sys.stdout, sys.stderr)
            except FollowError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        if args.command == "router":
            from pagedkv.router.cli import RouterCliError, run  # pyzmq, msgspec if asked

            try:
                return run(args, sys.stdout, sys.stderr)
            except (RouterCliError, ValueError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
        raise AssertionError(f"unknown command {args.command!r}")  # argparse prevents this
    except KeyboardInterrupt:
        # Ctrl-C outside the sizing runs (which print and save what they know themselves):
        # stop without a traceback, with the status a shell gives a process ended by SIGINT.
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Point stdout at /dev/null so that
        # the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
