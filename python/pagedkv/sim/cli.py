"""The `simulate` command: options, the sweep over manager settings, the output.

`python -m pagedkv simulate` replays a built-in workload (or `--trace FILE`) through the block
manager for each combination of `--block-size`, `--num-blocks` (or `--cache-tokens`) and
`--hash-algo` (comma lists), and prints a summary table (one run) or a sweep table. The
scheduler does chunked prefill under a per-step token budget (`--max-num-batched-tokens`), with
optional speculative decoding (`--spec-tokens`) and random aborts (`--abort-rate`);
`--max-batch-tokens` brings back the original whole-prompt scheduler. `--model NAME` runs the
workload twice on the same pool bytes (once for a one-group model), with the model's KV-cache
groups and as all-full attention, and shows the figures per group side by side, the memory
saved and which group limited the hits (`sim.model_run`, `sim.model_report`). Sizes and
counts follow `sim.units`. `--mrc` sizes the cache instead (`sim.sizing_cli`;
`sim.sizing_jobs` runs it in parallel processes): the hit rate of every size, and the smallest
size for a target hit rate. Output options are checked before any run (`sim.outputs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import warnings
from collections.abc import Callable
from typing import Any, TextIO

from pagedkv.config import HASH_ALGOS, BlockManagerConfig
from pagedkv.sim.ablate_cli import add_ablate_arguments, simulate_ablate, wants_ablate
from pagedkv.sim.cluster_cli import add_cluster_arguments, simulate_cluster, wants_cluster
from pagedkv.sim.factory import make_manager
from pagedkv.sim.kv_bytes import KVBytes, kv_bytes
from pagedkv.sim.live_cli import add_live_arguments, simulate_live
from pagedkv.sim.model_report import comparison_table
from pagedkv.sim.model_run import compare
from pagedkv.sim.models import GIB, MODELS, full_layout, get_model, model_layout
from pagedkv.sim.noisy import add_noisy_arguments, simulate_noisy
from pagedkv.sim.observer import ScheduleObserver
from pagedkv.sim.outputs import check_outputs
from pagedkv.sim.policies_cli import add_policy_arguments, simulate_policies, wants_policies
from pagedkv.sim.progress import ProgressBar
from pagedkv.sim.report import add_memory, figures, summary_table, sweep_table, write_json
from pagedkv.sim.requests import TRACE_BLOCK_TOKENS, Workload
from pagedkv.sim.scheduler import run_workload
from pagedkv.sim.sizing_cli import add_sizing_arguments, wants_mrc
from pagedkv.sim.sizing_jobs import clock_now, size
from pagedkv.sim.tier_cli import add_tier_arguments, simulate_tiers, wants_tiers
from pagedkv.sim.tier_run import TierDriver, TierOptions
from pagedkv.sim.trace import FORMAT_FIELDS, TRACE_FORMATS, TraceWarning, read_trace
from pagedkv.sim.units import count
from pagedkv.sim.why import MissWhy, misses_doc
from pagedkv.sim.why_report import misses_table
from pagedkv.sim.workloads import WORKLOADS, build_workload

DEFAULT_NUM_BLOCKS = 4096  # built-in workloads: 64 K tokens of 16, constant eviction
DEFAULT_TRACE_NUM_BLOCKS = 65536  # traces: 1 M tokens of 16 (Mooncake prompts reach 190 K)
# vLLM v1's max_num_batched_tokens for its OpenAI server (vllm/engine/arg_utils.py,
# get_batch_defaults): 2048 on GPUs under 70 GiB and on the A100, 8192 on H100-class GPUs.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def _list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
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


def _hash_algo(text: str) -> str:
    if text not in HASH_ALGOS:
        raise ValueError(f"invalid choice {text!r} (choose from {', '.join(HASH_ALGOS)})")
    return text


def add_arguments(sim: argparse.ArgumentParser) -> None:
    """The `simulate` subcommand's options."""
    w = sim.add_argument_group("workload")
    w.add_argument(
        "--workload",
        choices=WORKLOADS,
        default=None,
        help="built-in workload (default mixed: shared system prompts, multi-turn chats, "
        "parallel sampling, beam search, long documents)",
    )
    w.add_argument("--requests", type=count, default=500, help="built-in: requests (default 500)")
    w.add_argument("--seed", type=int, default=0, help="built-in: workload seed (default 0)")
    w.add_argument(
        "--arrival-rate",
        type=float,
        default=2.0,
        help="built-in: mean arrivals per step, Poisson; 0 = all at once (default 2)",
    )
    w.add_argument(
        "--doc-tokens",
        type=count,
        default=8192,
        help="built-in: tokens of the longest document (default 8192)",
    )
    w.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a real trace instead of a built-in workload, its format detected from "
        f"the first line or named by --trace-format; one hash id per {TRACE_BLOCK_TOKENS} "
        "prompt tokens for Mooncake, per 16 for Bailian (the last block possibly partial), "
        "equal ids meaning equal tokens (docs/traces.md)",
    )
    w.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default="auto",
        help="trace: the format of --trace (default auto: detected). mooncake: "
        f"{FORMAT_FIELDS['mooncake']}, ids naming prefixes (Mooncake's conversation, "
        "tool-agent and synthetic "
        f"traces); bailian: {FORMAT_FIELDS['bailian']}, ids chained into prefixes, a follow-up "
        "arriving at its timestamp or after its parent finished, whichever is later; azure: "
        f"{FORMAT_FIELDS['azure']}; burstgpt: {FORMAT_FIELDS['burstgpt']}. Azure and BurstGPT "
        "traces have no content ids: they size for load and concurrency only, not hit "
        "rates, so auto refuses them and naming the format replays every prompt as unique",
    )
    w.add_argument(
        "--limit", type=count, default=None, help="trace: replay the first N requests (N >= 1)"
    )
    w.add_argument(
        "--ms-per-step",
        type=float,
        default=20.0,
        help="trace: milliseconds of arrival time per scheduler step (default 20)",
    )

    c = sim.add_argument_group("cache (comma lists sweep every combination)")
    c.add_argument(
        "--num-blocks",
        type=_list(count),
        default=None,
        help=f"GPU blocks (default {DEFAULT_NUM_BLOCKS}; {DEFAULT_TRACE_NUM_BLOCKS} for a trace). "
        "Counts take k, M, G (1000^n: 64k = 64000) or Ki, Mi, Gi (1024^n: 64Ki = 65536)",
    )
    c.add_argument(
        "--cache-tokens",
        type=_list(count),
        default=None,
        help="GPU cache size in tokens instead of --num-blocks: num_blocks = tokens // block "
        "size (compares block sizes at equal memory)",
    )
    c.add_argument("--block-size", type=_list(count), default=[16], help="tokens per block (16)")
    c.add_argument(
        "--hash-algo",
        type=_list(_hash_algo),
        default=["sha256"],
        help=f"block hash: {', '.join(HASH_ALGOS)} (default sha256)",
    )
    c.add_argument(
        "--num-cpu-blocks",
        type=count,
        default=512,
        help="CPU swap blocks; 0 preempts by freeing and recomputing (default 512)",
    )
    c.add_argument("--watermark", type=float, default=0.01, help="can_allocate watermark (0.01)")

    m = sim.add_argument_group("model (KV-cache groups)")
    m.add_argument(
        "--model",
        choices=tuple(MODELS),
        default=None,
        metavar="NAME",
        help="run the workload with this model's KV-cache groups (as vLLM forms them) and "
        "again as all-full attention on the same pool bytes (the all-full run's --num-blocks "
        "or --cache-tokens at --block-size; a one-group model is replayed once), and show "
        "per group the blocks and GiB at the peak, KV per live token (held KV bytes / "
        "tokens of the running sequences, summed over steps: sharing lowers it), KV per "
        "held token (held KV bytes / token positions the held blocks cover: the layout's "
        "own cost), hit blocks, the hits each group cut and the workload's hit rate; then "
        "the memory saved (tokens held at equal memory; with --equal-hits, memory at equal "
        "hits) and which group limited the hits. One value each for the cache options. "
        f"Models: {', '.join(MODELS)}",
    )
    m.add_argument(
        "--equal-hits",
        action="store_true",
        help="with a hybrid --model: also run the model's groups and all-full attention at "
        "other pool sizes (doubling or halving, then bisecting) to find the memory each needs "
        "to reach the all-full run's hit rate, and print the memory saved at equal hits",
    )
    m.add_argument(
        "--list-models",
        action="store_true",
        help="list the built-in models (layers, groups, bytes per block) and exit",
    )

    s = sim.add_argument_group("scheduler")
    s.add_argument("--max-batch", type=count, default=256, help="running sequences at most (256)")
    s.add_argument(
        "--max-num-batched-tokens",
        type=count,
        default=None,
        help="tokens computed per step, decodes (plus drafts) first, then prompt chunks: "
        "chunked prefill (default 2048, vLLM v1's default for its OpenAI server on GPUs "
        "under 70 GiB and on the A100; 8192 on H100-class GPUs)",
    )
    s.add_argument(
        "--long-prefill-token-threshold",
        type=count,
        default=0,
        help="chunked prefill: prompt tokens of one request per step at most, so that "
        "several prompts prefill side by side (default 0: no cap)",
    )
    s.add_argument(
        "--max-batch-tokens",
        type=count,
        default=None,
        help="schedule whole prompts instead (the original scheduler, no chunked prefill): "
        "prompt tokens computed per step, prefix hits free, decodes not counted",
    )
    s.add_argument(
        "--spec-tokens",
        type=count,
        default=0,
        help="speculative decoding: draft tokens per decoding sequence and step, their slots "
        "reserved with lookahead (default 0: none)",
    )
    s.add_argument(
        "--spec-acceptance",
        type=float,
        default=0.7,
        help="probability that each draft is accepted, up to the first rejection (0.7)",
    )
    s.add_argument(
        "--abort-rate",
        type=float,
        default=0.0,
        help="per step, probability that each running request is aborted after scheduling, "
        "before the step ran (default 0)",
    )

    add_sizing_arguments(sim)
    add_tier_arguments(sim)
    add_ablate_arguments(sim)
    add_cluster_arguments(sim)
    add_policy_arguments(sim)
    add_noisy_arguments(sim)
    add_live_arguments(sim)

    o = sim.add_argument_group("output")
    o.add_argument(
        "--json", metavar="FILE", help="write every figure and the per-step series (and 'mrc')"
    )
    o.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw the per-step series, and with --mrc the curve (matplotlib; .png, .pdf, "
        ".svg, ... pick the format)",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument(
        "--reference",
        action="store_true",
        help="run the pure-Python ReferenceBlockManager instead (to compare)",
    )
    o.add_argument(
        "--why",
        action="store_true",
        help="say why each prompt-token miss happened, per tenant (never stored, evicted and "
        "how long before, stored under another salt, cut by a hybrid group's window, the "
        "partial last block, lost to preemption), in the summary and --json ('misses'); "
        "not with --mrc or tiers; with --model it replaces the hit-limit probe (costs "
        "replay time: benches/results/issue35-why.md)",
    )
    o.add_argument(
        "--check",
        action="store_true",
        help="check_invariants() after every step, and check that no prefix hit covers a "
        "block whose tokens the simulator did not schedule (slow; for debugging)",
    )


def _workload(args: argparse.Namespace, err: TextIO) -> Workload:
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
    return build_workload(
        args.workload or "mixed",
        args.requests,
        seed=args.seed,
        arrival_rate=args.arrival_rate,
        doc_tokens=args.doc_tokens,
    )


def _schedule(args: argparse.Namespace) -> dict[str, Any]:
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


def _configs(args: argparse.Namespace) -> list[BlockManagerConfig]:
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


def list_models(out: TextIO) -> None:
    """`--list-models`: each preset, its groups and what a block weighs at 16 tokens."""
    for name, model in MODELS.items():
        layout = model_layout(model)
        print(model.describe(), file=out)
        print(f"  groups    {layout.describe()}", file=out)
        print(
            f"  all-full  {model.full_kv_bytes_per_token} bytes per token; "
            f"{full_layout(model).bytes_per_block} bytes per block of 16",
            file=out,
        )
        print(f"  source    {model.source}", file=out)
        if name != list(MODELS)[-1]:
            print(file=out)


def _bar(args: argparse.Namespace, err: TextIO) -> Callable[[str], ProgressBar | None]:
    """A progress bar per run, on a terminal unless --no-progress."""
    show = not args.no_progress and err.isatty()
    return lambda label: ProgressBar(label, stream=err) if show else None


def _simulate_model(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    configs = _configs(args)
    if len(configs) != 1:
        raise ValueError(
            "--model compares one configuration: give one value each for --block-size, "
            "--num-blocks or --cache-tokens, and --hash-algo"
        )
    model = get_model(args.model)
    layout = model_layout(model, configs[0].block_size)  # a bad block size fails here, early
    schedule = _schedule(args)
    workload = _workload(args, err)
    title = "ReferenceBlockManager (pure Python)" if args.reference else "BlockManager (Rust core)"
    print(f"pagedkv simulate: {title}", file=out)
    print(f"workload    {workload.describe()}", file=out)
    print(f"model       {model.describe()}", file=out)
    print(f"groups      {layout.describe()}", file=out)
    config = configs[0]
    budget = config.num_blocks * full_layout(model, config.block_size).bytes_per_block
    print(
        f"budget      {budget / GIB:.3f} GiB: the all-full run's {config.num_blocks} blocks x "
        f"{config.block_size} tokens x {model.full_kv_bytes_per_token} bytes per token",
        file=out,
    )
    section, runs = compare(
        model,
        workload,
        config,
        schedule,
        reference=args.reference,
        check=args.check,
        make=make_manager,
        progress=_bar(args, err),
        search=args.equal_hits,
        why=args.why,
    )
    print(file=out)
    print(comparison_table(section, runs), file=out)
    for f in runs if args.why else ():
        print(f"\n{f['label']} run", file=out)
        print(misses_table(f["misses"]), file=out)
    if args.check:
        print("invariants  OK (both runs, checked after every step)", file=out)
    if args.json:
        write_json(args.json, runs, extra={"model": section})
        print(f"json        {args.json}", file=out)
    if args.plot:
        from pagedkv.sim.plot import plot_runs

        plot_runs(args.plot, runs)
        print(f"plot        {args.plot}", file=out)
    return 0


class _Runner:
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
        self.schedule = _schedule(args)
        self.make_bar = make_bar

    def __call__(
        self,
        config: BlockManagerConfig,
        label: str,
        watch: ScheduleObserver | None = None,
        tiers: TierOptions | None = None,
    ) -> dict[str, Any]:
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


def simulate(args: argparse.Namespace, out: TextIO, err: TextIO | None = None) -> int:
    """Run the `simulate` command; returns the exit status."""
    err = sys.stderr if err is None else err
    started = clock_now()
    check_outputs(args.json, args.plot)
    if args.list_models:
        list_models(out)
        return 0
    if args.noisy_neighbour:
        return simulate_noisy(args, out)
    if args.record is not None:
        return simulate_live(args, out)
    if wants_policies(args):
        return simulate_policies(args, out, err, _workload, _schedule, _configs)
    if wants_ablate(args):
        return simulate_ablate(args, out, err, _workload, _schedule, _configs)
    if wants_cluster(args):
        return simulate_cluster(args, out, err, _workload, _schedule, _configs)
    mrc = wants_mrc(args)
    tiers = wants_tiers(args)
    if args.why and (mrc or tiers):
        raise ValueError("--why explains the misses of a replay: not with --mrc or tiers")
    if tiers and mrc:
        raise ValueError("give either tiers (--host-tier-bytes, --remote) or --mrc, not both")
    if args.equal_hits and (args.model is None or mrc or tiers):
        raise ValueError("--equal-hits needs --model (without --mrc or tiers)")
    if args.model is not None and not mrc and not tiers:
        if args.kv_bytes_per_token is not None:
            raise ValueError("give either --model or --kv-bytes-per-token, not both")
        return _simulate_model(args, out, err)
    if args.compress is not None and not tiers:
        raise ValueError("--compress needs --host-tier-bytes or --remote")
    if args.remote_cluster and args.remote is None:
        raise ValueError("--remote-cluster needs --remote")
    kv = kv_bytes(args.model, args.kv_bytes_per_token)
    configs = _configs(args)
    run = _Runner(args, _workload(args, err), kv, _bar(args, err))
    title = "ReferenceBlockManager (pure Python)" if args.reference else "BlockManager (Rust core)"
    print(f"pagedkv simulate: {title}", file=out)
    print(f"workload    {run.workload.describe()}", file=out)
    if kv is not None:
        print(f"memory      {kv.describe(sorted({c.block_size for c in configs}))}", file=out)
    if tiers:
        doc = simulate_tiers(args, configs, run, out)
        if args.json:
            write_json(args.json, doc["runs"], extra=doc)
            print(f"json        {args.json}", file=out)
        if args.plot:
            from pagedkv.sim.plot import plot_runs

            plot_runs(args.plot, doc["runs"])
            print(f"plot        {args.plot}", file=out)
        return 0
    if mrc:
        return size(args, configs, run.workload, kv, out, err, started=started)
    runs = [
        run(config, f"B={config.block_size} blocks={config.num_blocks} {config.hash_algo}")
        for config in configs
    ]
    print(file=out)
    print(summary_table(runs[0]) if len(runs) == 1 else sweep_table(runs), file=out)
    for f in runs if args.why else ():
        print(file=out)
        if len(runs) > 1:
            print(f"B={f['block_size']} blocks={f['num_blocks']} {f['hash_algo']}", file=out)
        print(misses_table(f["misses"]), file=out)
    if args.check:
        print(
            "invariants  OK (checked after every step; no prefix hit on unscheduled tokens)",
            file=out,
        )
    if args.json:
        write_json(args.json, runs)
        print(f"json        {args.json}", file=out)
    if args.plot:
        from pagedkv.sim.plot import plot_runs

        plot_runs(args.plot, runs)
        print(f"plot        {args.plot}", file=out)
    return 0


__all__ = ["add_arguments", "simulate"]
