"""`simulate --eviction lru,s3fifo,...`: the options and the flow (`sim.policies`).

The workload of the command line (built-in or `--trace`) runs once per policy with the one
configuration the cache options give, and one table follows (`sim.policies_report`), with a
row per policy and tenant when requests carry cache salts. A line per run goes to stderr
(unless `--no-progress`). Ctrl-C (or SIGTERM) stops the runs and prints, and saves with
`--json`, the policies that finished, as `--mrc` does with its runs.
"""

from __future__ import annotations

import argparse
import signal
from collections.abc import Callable
from typing import Any, TextIO

from pagedkv.config import EVICTIONS, BlockManagerConfig, Eviction
from pagedkv.sim.cluster_cli import wants_cluster
from pagedkv.sim.kv_bytes import kv_bytes
from pagedkv.sim.progress import RunLines, clock
from pagedkv.sim.requests import Workload
from pagedkv.sim.runner import INTERRUPTED, clock_now, progress_lines, stop_on_sigterm
from pagedkv.sim.sizing_cli import wants_mrc
from pagedkv.sim.tier_cli import wants_tiers


def _policies(text: str) -> list[Eviction]:
    from pagedkv.sim.policies import parse_policies  # when --eviction is given only

    try:
        return parse_policies(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _repeats(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return n


def add_policy_arguments(sim: argparse.ArgumentParser) -> None:
    """The `eviction policies` argument group of `simulate`."""
    g = sim.add_argument_group("eviction policies (docs/eviction.md)")
    g.add_argument(
        "--eviction",
        type=_policies,
        default=None,
        metavar="POLICIES",
        help="run the workload once per eviction policy, a comma list of "
        f"{', '.join(EVICTIONS)} (lru: least recently released first, vLLM's order and the "
        "default), with one value each for the cache options, and print one table: hit "
        "rate, the workload's own hit rate (recomputes left out), evictions, preemptions "
        "and manager time (CPU time of the run's calls replayed); per tenant too when "
        "requests carry cache salts",
    )
    g.add_argument(
        "--eviction-repeats",
        type=_repeats,
        default=3,
        metavar="N",
        help="--eviction: manager times are the CPU time of a run's calls replayed N times, "
        "the least kept (noise only adds; default 3)",
    )


def wants_policies(args: argparse.Namespace) -> bool:
    return args.eviction is not None


def _refuse_others(args: argparse.Namespace) -> None:
    """--eviction runs on its own: the other multi-run modes and what needs a model."""
    others = [
        ("--mrc", wants_mrc(args)),
        ("tiers (--host-tier-bytes, --remote)", wants_tiers(args)),
        ("--ablate", args.ablate),
        ("--ablate-claims", args.ablate_claims is not None),
        ("cluster options (--nodes, --routing, ...)", wants_cluster(args)),
        ("--model", args.model is not None),
        ("--plot", args.plot is not None),
        ("--reference", args.reference),
    ]
    given = [name for name, on in others if on]
    if given:
        raise ValueError(
            f"--eviction compares policies on its own (the Rust manager, one configuration): "
            f"drop {', '.join(given)}"
        )


class _Progress:
    """Each policy's run as the sizing runs show theirs (`RunLines`): started, its requests
    during the replay, ended (then its manager calls are replayed for the time)."""

    def __init__(self, lines: RunLines | None) -> None:
        self.lines = lines
        self.current: str | None = None

    def start(self, policy: str) -> None:
        self.end()
        self.current = policy
        if self.lines is not None:
            self.lines.start(policy)

    def step(self, policy: str, done: int, total: int) -> None:
        if self.lines is not None:
            self.lines.update(policy, done, total)

    def end(self, text: str = "done") -> None:
        if self.lines is not None and self.current is not None:
            self.lines.end(self.current, text)
        self.current = None

    def close(self) -> None:
        if self.lines is not None:
            self.lines.close()


def simulate_policies(
    args: argparse.Namespace,
    out: TextIO,
    err: TextIO,
    workload: Callable[[argparse.Namespace, TextIO], Workload],
    schedule: Callable[[argparse.Namespace], dict[str, Any]],
    configs: Callable[[argparse.Namespace], list[BlockManagerConfig]],
) -> int:
    """`--eviction` (the command's workload, scheduler and cache options come through the
    callables of `sim.runner`); returns the exit status (`INTERRUPTED` after Ctrl-C)."""
    # the policies' runs and report are imported here only: the options alone are defined
    # for every `simulate` command
    from pagedkv.sim.policies import run_policies
    from pagedkv.sim.policies_report import has_tenants, policy_table, tenant_table
    from pagedkv.sim.report import json_doc, write_doc

    wall0, cpu0 = clock_now()
    _refuse_others(args)
    cs = configs(args)
    if len(cs) != 1:
        raise ValueError(
            "--eviction compares policies on one configuration: give one value each for "
            "--block-size, --num-blocks or --cache-tokens, and --hash-algo"
        )
    config = cs[0]
    sched = schedule(args)
    w = workload(args, err)
    kv = kv_bytes(None, args.kv_bytes_per_token)
    policies: list[Eviction] = args.eviction
    print("pagedkv simulate: eviction policies, BlockManager (Rust core)", file=out)
    print(f"workload    {w.describe()}", file=out)
    print(
        f"cache       {config.num_blocks} blocks x {config.block_size} tokens = "
        f"{config.num_blocks * config.block_size} tokens, {config.num_cpu_blocks} CPU blocks, "
        f"hash {config.hash_algo}; the same for every policy",
        file=out,
    )
    print(
        f"timing      manager time: CPU time of each run's calls replayed, best of "
        f"{args.eviction_repeats}",
        file=out,
    )
    runs: list[dict[str, Any]] = []
    status = "complete"
    previous = stop_on_sigterm()
    shown = _Progress(progress_lines(args, err, "[eviction]"))
    try:
        run_policies(
            w,
            config,
            policies,
            sched,
            kv=kv,
            check=args.check,
            repeats=args.eviction_repeats,
            progress=shown.start,
            steps=shown.step,
            done=runs,
        )
        shown.end()
    except KeyboardInterrupt:
        status = "interrupted"
        shown.end("interrupted")
    finally:
        shown.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(file=out)
    if status == "interrupted":
        ran = ", ".join(f["eviction"] for f in runs) or "none"
        print(
            f"interrupted (Ctrl-C): the runs were stopped; the policies that finished "
            f"follow ({ran} of {', '.join(policies)})",
            file=out,
        )
    if runs:
        print(policy_table(runs), file=out)
        if has_tenants(runs):
            print(file=out)
            print("per tenant (cache salt)", file=out)
            print(tenant_table(runs), file=out)
    if args.check and runs:
        print(file=out)
        print(
            "invariants  OK (checked after every step; no prefix hit on unscheduled tokens)",
            file=out,
        )
    if args.json:
        extra = {
            "eviction": {
                "policies": policies,
                "finished": [f["eviction"] for f in runs],
                "status": status,
                "repeats": args.eviction_repeats,
            }
        }
        write_doc(args.json, json_doc(runs, extra=extra, sweep=True))
        note = " (what was known)" if status == "interrupted" else ""
        print(f"json        {args.json}{note}", file=out)
    wall, cpu = clock_now()
    print(file=out)
    print(
        f"time        wall {wall - wall0:.1f} s ({clock(wall - wall0)}), CPU {cpu - cpu0:.1f} s "
        f"({clock(cpu - cpu0)}), the workload's reading included",
        file=out,
    )
    out.flush()
    return INTERRUPTED if status == "interrupted" else 0


__all__ = ["add_policy_arguments", "simulate_policies", "wants_policies"]
