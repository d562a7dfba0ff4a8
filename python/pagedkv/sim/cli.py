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
size for a target hit rate. Output options are checked before any run (`sim.outputs`). The
workload, scheduler and cache options, and one replay with them, are `sim.runner`'s (shared
with the other commands).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from pagedkv.config import HASH_ALGOS
from pagedkv.sim.ablate_cli import add_ablate_arguments, simulate_ablate, wants_ablate
from pagedkv.sim.cluster_cli import add_cluster_arguments, simulate_cluster, wants_cluster
from pagedkv.sim.kv_bytes import kv_bytes
from pagedkv.sim.live_cli import add_live_arguments, simulate_live
from pagedkv.sim.models import GIB, MODELS, full_layout, get_model, model_layout
from pagedkv.sim.noisy import add_noisy_arguments, simulate_noisy
from pagedkv.sim.option_names import LOOPS
from pagedkv.sim.outputs import check_outputs
from pagedkv.sim.policies_cli import add_policy_arguments, simulate_policies, wants_policies
from pagedkv.sim.requests import TRACE_BLOCK_TOKENS
from pagedkv.sim.runner import (
    DEFAULT_NUM_BLOCKS,
    DEFAULT_TRACE_NUM_BLOCKS,
    Runner,
    clock_now,
    comma_list,
    hash_algo,
    manager_configs,
    progress_bars,
    read_workload,
    schedule_options,
)
from pagedkv.sim.sizing_cli import add_sizing_arguments, wants_mrc
from pagedkv.sim.tier_cli import add_tier_arguments, simulate_tiers, wants_tiers
from pagedkv.sim.trace import FORMAT_FIELDS, TRACE_FORMATS
from pagedkv.sim.units import count
from pagedkv.sim.workloads import WORKLOADS


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
        type=comma_list(count),
        default=None,
        help=f"GPU blocks (default {DEFAULT_NUM_BLOCKS}; {DEFAULT_TRACE_NUM_BLOCKS} for a trace). "
        "Counts take k, M, G (1000^n: 64k = 64000) or Ki, Mi, Gi (1024^n: 64Ki = 65536)",
    )
    c.add_argument(
        "--cache-tokens",
        type=comma_list(count),
        default=None,
        help="GPU cache size in tokens instead of --num-blocks: num_blocks = tokens // block "
        "size (compares block sizes at equal memory)",
    )
    c.add_argument(
        "--block-size", type=comma_list(count), default=[16], help="tokens per block (16)"
    )
    c.add_argument(
        "--hash-algo",
        type=comma_list(hash_algo),
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
        "--loop",
        choices=LOOPS,
        default="auto",
        help="the scheduling loop: auto (the Rust loop when every option is in its scope, "
        "else the Python one; docs/scheduling-loop.md), python (the reference), rust (an "
        "error naming the option out of its scope); both make the same manager calls",
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


def _simulate_model(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from pagedkv.sim.factory import make_manager
    from pagedkv.sim.model_report import comparison_table
    from pagedkv.sim.model_run import compare
    from pagedkv.sim.report import write_json
    from pagedkv.sim.why_report import misses_table

    configs = manager_configs(args)
    if len(configs) != 1:
        raise ValueError(
            "--model compares one configuration: give one value each for --block-size, "
            "--num-blocks or --cache-tokens, and --hash-algo"
        )
    model = get_model(args.model)
    layout = model_layout(model, configs[0].block_size)  # a bad block size fails here, early
    schedule = schedule_options(args)
    workload = read_workload(args, err)
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
        progress=progress_bars(args, err),
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
        return simulate_policies(args, out, err, read_workload, schedule_options, manager_configs)
    if wants_ablate(args):
        return simulate_ablate(args, out, err, read_workload, schedule_options, manager_configs)
    if wants_cluster(args):
        return simulate_cluster(args, out, err, read_workload, schedule_options, manager_configs)
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
    configs = manager_configs(args)
    run = Runner(args, read_workload(args, err), kv, progress_bars(args, err))
    title = "ReferenceBlockManager (pure Python)" if args.reference else "BlockManager (Rust core)"
    print(f"pagedkv simulate: {title}", file=out)
    print(f"workload    {run.workload.describe()}", file=out)
    if kv is not None:
        print(f"memory      {kv.describe(sorted({c.block_size for c in configs}))}", file=out)
    if tiers:
        from pagedkv.sim.report import write_json

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
        # the pure cache replay (`--mrc-only` on a trace of ids) without the parallel runs'
        # machinery of `sizing_jobs` (multiprocessing and the scheduler: imports only)
        from pagedkv.sim.sizing_blocks import replay_kind, size_from_ids

        if replay_kind(args, configs, run.workload) == "cache":
            return size_from_ids(args, configs, run.workload, kv, out, started)
        from pagedkv.sim.sizing_jobs import Sizing

        return Sizing(args, configs, run.workload, kv, out, err, started).run()
    from pagedkv.sim.report import summary_table, sweep_table, write_json
    from pagedkv.sim.why_report import misses_table

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
