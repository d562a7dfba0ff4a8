"""The simulator's shared runner: what every `simulate` command takes from the common options.

The workload (`read_workload`: a trace or a built-in one), the scheduler's options
(`schedule_options`), the manager configurations of the sweep (`manager_configs`), one full
replay per call with them (`Runner`), the progress bars, the time line's clock (`clock_now`),
the exit status after Ctrl-C (`INTERRUPTED`) and SIGTERM stopping like Ctrl-C
(`stop_on_sigterm`). The command modules (`cli`, `sizing_jobs`, `policies_cli`, `ablate_cli`,
`cluster_cli`, ...) import from here and never from each other's private names, so the import
graph of `sim/` has no cycle (tests/sim/test_sim_house.py checks both).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import resource
import signal
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from pagedkv.config import HASH_ALGOS, BlockManagerConfig
from pagedkv.sim.kv_bytes import KVBytes
from pagedkv.sim.progress import ProgressBar, RunLines
from pagedkv.sim.requests import Workload
from pagedkv.sim.trace import TraceWarning, read_trace

if TYPE_CHECKING:
    from pagedkv.sim.observer import ScheduleObserver
    from pagedkv.sim.tier_run import TierOptions

# The manager, the scheduler, the tiers, the miss causes, the report and the built-in
# workloads are imported where a run or a built-in workload needs them: `simulate
# --mrc-only` on a trace (the pure cache replay) uses none of them, and its CPU time is
# mostly the interpreter's start-up and imports (benches/results/issue35-sizing-speed.md).

INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (128 + SIGINT)

DEFAULT_NUM_BLOCKS = 4096  # built-in workloads: 64 K tokens of 16, constant eviction
DEFAULT_TRACE_NUM_BLOCKS = 65536  # traces: 1 M tokens of 16 (Mooncake prompts reach 190 K)
# vLLM v1's max_num_batched_tokens for its OpenAI server (vllm/engine/arg_utils.py,
# get_batch_defaults): 2048 on GPUs under 70 GiB and on the A100, 8192 on H100-class GPUs.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def comma_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """A comma list of `kind` (which raises ValueError saying what it accepts)."""

    def parse(text: str) -> list[Any]:
        items = [t.strip() for t in text.split(",")]
        if not items or any(not t for t in items):
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list, got {text!r} (an empty item)"
            )
        out = []
        for t in items:
            try:
                out.append(kind(t))
            except (ValueError, argparse.ArgumentTypeError) as e:
                if len(items) == 1:
                    raise argparse.ArgumentTypeError(str(e)) from None
                raise argparse.ArgumentTypeError(f"bad item {t!r} in {text!r}: {e}") from None
        return out

    parse.__name__ = f"{kind.__name__} list"
    return parse


def hash_algo(text: str) -> str:
    if text not in HASH_ALGOS:
        raise ValueError(f"invalid choice {text!r} (choose from {', '.join(HASH_ALGOS)})")
    return text


def read_workload(args: argparse.Namespace, err: TextIO) -> Workload:
    if args.trace is not None:
        if args.workload is not None:
            raise ValueError("give either --trace or --workload, not both")
        if args.limit is not None and args.limit < 1:
            raise ValueError(f"--limit must be >= 1, got {args.limit}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", TraceWarning)
            workload = read_trace(
                args.trace,
                limit=args.limit,
                ms_per_step=args.ms_per_step,
                trace_format=args.trace_format,
            )
        for w in caught:
            print(f"warning: {w.message}", file=err)
        return workload
    if args.limit is not None:
        raise ValueError("--limit applies to --trace only (use --requests)")
    if args.trace_format != "auto":
        raise ValueError("--trace-format applies to --trace only")
    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    from pagedkv.sim.workloads import build_workload

    return build_workload(
        args.workload or "mixed",
        args.requests,
        seed=args.seed,
        arrival_rate=args.arrival_rate,
        doc_tokens=args.doc_tokens,
    )


def schedule_options(args: argparse.Namespace) -> dict[str, Any]:
    """The scheduler's options for `run_workload`."""
    if args.max_batch_tokens is not None and args.max_num_batched_tokens is not None:
        raise ValueError(
            "give either --max-num-batched-tokens (chunked prefill) or --max-batch-tokens "
            "(whole prompts), not both"
        )
    if args.max_batch_tokens is not None:
        if args.long_prefill_token_threshold:
            raise ValueError("--long-prefill-token-threshold needs chunked prefill")
        chunked: dict[str, Any] = {
            "max_batch_tokens": args.max_batch_tokens,
            "max_num_batched_tokens": None,
        }
    else:
        budget = args.max_num_batched_tokens
        chunked = {
            "max_num_batched_tokens": DEFAULT_MAX_NUM_BATCHED_TOKENS if budget is None else budget
        }
    return {
        "max_batch": args.max_batch,
        **chunked,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "spec_tokens": args.spec_tokens,
        "spec_acceptance": args.spec_acceptance,
        "abort_rate": args.abort_rate,
    }


def manager_configs(args: argparse.Namespace) -> list[BlockManagerConfig]:
    if args.num_blocks is not None and args.cache_tokens is not None:
        raise ValueError("give either --num-blocks or --cache-tokens, not both")
    out = []
    for bs, algo in itertools.product(args.block_size, args.hash_algo):
        if args.cache_tokens is not None:
            for t in args.cache_tokens:
                if bs > 0 and t < bs:
                    raise ValueError(
                        f"--cache-tokens {t} is smaller than one block of {bs} tokens "
                        f"(--block-size): give at least {bs}"
                    )
            sizes = [t // bs if bs > 0 else t for t in args.cache_tokens]
        elif args.num_blocks is not None:
            sizes = args.num_blocks
        else:
            sizes = [DEFAULT_TRACE_NUM_BLOCKS if args.trace else DEFAULT_NUM_BLOCKS]
        out += [
            BlockManagerConfig(
                num_blocks=nb,
                block_size=bs,
                num_cpu_blocks=args.num_cpu_blocks,
                hash_algo=algo,
                watermark=args.watermark,
            )
            for nb in sizes
        ]
    return sorted(out, key=lambda c: (c.block_size, c.num_blocks, c.hash_algo))


def progress_bars(args: argparse.Namespace, err: TextIO) -> Callable[[str], ProgressBar | None]:
    """A progress bar per run, on a terminal unless --no-progress."""
    show = not args.no_progress and err.isatty()
    return lambda label: ProgressBar(label, stream=err) if show else None


class Runner:
    """One full run of the workload per call, with the command's options (the configured runs
    and the sizing runs alike)."""

    def __init__(
        self,
        args: argparse.Namespace,
        workload: Workload,
        kv: KVBytes | None,
        make_bar: Callable[[str], ProgressBar | None],
    ) -> None:
        self.args = args
        self.workload = workload
        self.kv = kv
        self.schedule = schedule_options(args)
        self.make_bar = make_bar

    def __call__(
        self,
        config: BlockManagerConfig,
        label: str,
        watch: ScheduleObserver | None = None,
        tiers: TierOptions | None = None,
    ) -> dict[str, Any]:
        from pagedkv.sim.factory import make_manager
        from pagedkv.sim.report import add_memory, figures
        from pagedkv.sim.scheduler import run_workload
        from pagedkv.sim.tier_run import TierDriver
        from pagedkv.sim.why import MissWhy, misses_doc

        args = self.args
        why = None
        if getattr(args, "why", False) and watch is None and tiers is None:
            why = MissWhy(self.workload.ms_per_step)
            config = dataclasses.replace(config, enable_kv_events=True)
        manager = make_manager(config, reference=args.reference)
        driver = None
        if tiers is not None:
            driver = TierDriver(
                manager,
                tiers,
                num_cpu_blocks=config.num_cpu_blocks,
                hash_algo=config.hash_algo,
                check=args.check,
            )
        bar = self.make_bar(label)
        try:
            result = run_workload(
                manager if why is None else why.watch(manager),
                self.workload,
                **self.schedule,
                check=args.check,
                progress=bar,
                watch=watch if why is None else why,
                tiers=driver,
                before_step=None if why is None else why.before_step,
                loop=getattr(args, "loop", "auto"),
            )
        finally:
            tier_figures = driver.close() if driver is not None else None
        if bar is not None:
            bar.close()
        if args.check:
            manager.check_invariants()
        f = figures(
            result,
            config,
            manager="reference" if args.reference else "rust",
            workload=self.workload.describe(),
            ms_per_step=self.workload.ms_per_step,
        )
        add_memory(f, self.kv)
        if why is not None:
            f["misses"] = misses_doc(why)
        if tier_figures is not None:
            f.update(tier_figures)
            below = sum(tier_figures["tier_hit_tokens"].values())
            gpu = f["prefix_hit_tokens"] - below
            f["gpu_hit_tokens"] = gpu
            f["gpu_hit_rate"] = gpu / f["prompt_tokens"] if f["prompt_tokens"] else 0.0
        return f


def progress_lines(args: argparse.Namespace, err: TextIO, prefix: str) -> RunLines | None:
    """Progress of a command's runs as the sizing runs show it (`RunLines`): on a terminal a
    line redrawn, elsewhere (a log, a pipe) a line when each run starts and ends and one a
    minute between; None with --no-progress."""
    if args.no_progress:
        return None
    return RunLines(err, tty=err.isatty(), prefix=prefix)


def cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # those ended and waited for
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def clock_now() -> tuple[float, float]:
    """(wall, CPU) seconds now: where the time line starts counting."""
    return time.perf_counter(), cpu_seconds()


def stop_on_sigterm() -> Any:
    """SIGTERM stops like Ctrl-C does (main thread only); returns the previous handler."""

    def stop(signum: int, frame: Any) -> None:
        del signum, frame
        raise KeyboardInterrupt

    try:
        return signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        return None


__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DEFAULT_NUM_BLOCKS",
    "DEFAULT_TRACE_NUM_BLOCKS",
    "INTERRUPTED",
    "Runner",
    "clock_now",
    "comma_list",
    "hash_algo",
    "manager_configs",
    "progress_bars",
    "progress_lines",
    "read_workload",
    "schedule_options",
    "stop_on_sigterm",
]
