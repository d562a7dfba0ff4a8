"""`simulate --host-tier-bytes N [--compress CODEC] [--remote URL]`: the workload run twice
on the same GPU cache, without tiers and with them, side by side (`sim.tier_run` says what
the tiered run moves and how the budgets are counted).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TextIO

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.kv_bytes import KVBytes, from_model, kv_bytes
from pagedkv.sim.models import GIB
from pagedkv.sim.tier_run import DEFAULT_MODEL, TierOptions, parse_bytes

CODECS = ("lz4", "shuffle+lz4", "raw")


def _byte_size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_tier_arguments(sim: argparse.ArgumentParser) -> None:
    t = sim.add_argument_group("tiers below the GPU (docs/tiers.md)")
    t.add_argument(
        "--host-tier-bytes",
        type=_byte_size,
        default=None,
        metavar="N",
        help="a host-memory tier of N bytes of the model's KV (64GiB, 512GB, ...): evicted "
        "blocks are demoted to it and prefix hits continue in it; the run is compared with "
        "the same run without tiers",
    )
    t.add_argument(
        "--compress",
        choices=CODECS,
        default=None,
        help="compress the tiers' blocks with this codec (shuffle+lz4: byte shuffle, then "
        "lz4; it pays on 2-byte KV): the host tier then holds as many more blocks as the KV "
        "compresses",
    )
    t.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="a remote tier on a Redis-protocol server (redis://HOST:PORT), below the host "
        "tier; entries live an hour, in a namespace of their own per run",
    )
    t.add_argument(
        "--remote-cluster",
        action="store_true",
        help="--remote names one node of a Redis Cluster (the others are discovered)",
    )


def wants_tiers(args: argparse.Namespace) -> bool:
    return bool(args.host_tier_bytes is not None or args.remote is not None)


def tier_options(args: argparse.Namespace) -> TierOptions:
    """The tiers of the command line, checked (ValueError names the problem)."""
    if args.remote_cluster and args.remote is None:
        raise ValueError("--remote-cluster needs --remote")
    if args.compress is not None and not wants_tiers(args):
        raise ValueError("--compress needs --host-tier-bytes or --remote")
    kv: KVBytes | None = kv_bytes(args.model, args.kv_bytes_per_token)
    return TierOptions(
        kv=kv if kv is not None else from_model(DEFAULT_MODEL),
        host_bytes=args.host_tier_bytes,
        compress=args.compress,
        remote=args.remote,
        remote_cluster=args.remote_cluster,
    )


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def comparison_table(base: dict[str, Any], tiered: dict[str, Any]) -> str:
    """Both runs side by side: hits by where they came from, what the tiers moved."""
    prompt = tiered["prompt_tokens"] or 1
    gib = float(GIB)
    tiers = tiered["tiers"]
    tier_hits = tiered["tier_hit_tokens"]
    below = sum(tier_hits.values())
    rows: list[tuple[str, str, str]] = [
        ("prefix hit rate", _pct(base["prefix_hit_rate"]), _pct(tiered["prefix_hit_rate"])),
        ("  from the GPU", _pct(base["prefix_hit_rate"]), _pct(tiered["gpu_hit_rate"])),
    ]
    rows += [(f"  from {t['medium']}", "-", _pct(t["hit_tokens"] / prompt)) for t in tiers]
    rows += [
        ("workload hit rate", _pct(base["workload_hit_rate"]), _pct(tiered["workload_hit_rate"])),
        (
            "prompt tokens computed",
            str(base["computed_prompt_tokens"]),
            str(tiered["computed_prompt_tokens"]),
        ),
        ("tokens from the tiers", "-", str(below)),
        ("GPU evictions", str(base["evictions"]), str(tiered["evictions"])),
        ("preemptions", str(base["preemptions"]), str(tiered["preemptions"])),
        ("blocks demoted", "-", str(tiered["blocks_demoted"])),
        ("blocks promoted", "-", str(tiered["blocks_promoted"])),
        ("GiB demoted (model KV)", "-", f"{tiered['bytes_demoted'] / gib:.2f}"),
        ("GiB promoted (model KV)", "-", f"{tiered['bytes_promoted'] / gib:.2f}"),
        ("compression ratio", "-", f"{tiered['compression_ratio']:.3f}"),
        ("failed loads", "-", str(tiered["failed_loads"])),
        ("dropped demotions", "-", str(tiered["dropped_demotions"])),
        ("manager s", f"{base['manager_seconds']:.2f}", f"{tiered['manager_seconds']:.2f}"),
        ("wall s", f"{base['wall_seconds']:.2f}", f"{tiered['wall_seconds']:.2f}"),
    ]
    for t in tiered["tiers"]:
        rows.append(
            (
                f"{t['name']} puts / dropped / evicted",
                "-",
                f"{t['puts']} / {t['dropped_puts']} / {t['evictions']}",
            )
        )
        rows.append(
            (
                f"{t['name']} gets / hits / corrupt",
                "-",
                f"{t['gets']} / {t['hits']} / {t['corrupt']}",
            )
        )
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("no tiers"), *(len(r[1]) for r in rows))
    w2 = max(len("tiers"), *(len(r[2]) for r in rows))
    lines = [f"{'':<{w0}}  {'no tiers':>{w1}}  {'tiers':>{w2}}"]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}" for a, b, c in rows]
    return "\n".join(lines)


def simulate_tiers(
    args: argparse.Namespace,
    configs: list[BlockManagerConfig],
    run: Callable[..., dict[str, Any]],
    out: TextIO,
) -> dict[str, Any]:
    """Run the configuration without and with tiers; print both; return the JSON document's
    tier section (its keys at the top level of the document)."""
    if len(configs) != 1:
        raise ValueError(
            "tiers compare one configuration: give one value each for --block-size, "
            "--num-blocks or --cache-tokens, and --hash-algo"
        )
    options = tier_options(args)
    config = configs[0]
    print(f"tiers       {options.describe(config.block_size)}", file=out)
    base = run(config, "no tiers")
    tiered = run(replace(config, record_evictions=True), "tiers", tiers=options)
    print(file=out)
    print(comparison_table(base, tiered), file=out)
    if args.check:
        print(
            f"check       every prefix hit and every finished sequence read back from the "
            f"pool: {tiered['checked_tokens']} tokens, all equal to the KV their tokens give",
            file=out,
        )
    keys = ("tier_hit_tokens", "compression_ratio", "bytes_demoted", "bytes_promoted")
    return {
        **{k: tiered[k] for k in keys},
        "hit_rate_without_tiers": base["prefix_hit_rate"],
        "hit_rate_with_tiers": tiered["prefix_hit_rate"],
        "runs": [base, tiered],
    }


__all__ = ["add_tier_arguments", "comparison_table", "simulate_tiers", "tier_options"]
