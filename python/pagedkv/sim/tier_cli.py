"""`simulate --host-tier-bytes N [--compress CODEC] [--remote URL]`: the workload run twice
on the same GPU cache, without tiers and with them, side by side (`sim.tier_run` says what
the tiered run moves and how the budgets are counted).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TextIO

from pagedkv.config import BlockManagerConfig
from pagedkv.sim.kv_bytes import KVBytes, from_model, kv_bytes
from pagedkv.sim.models import GIB
from pagedkv.sim.option_names import DEFAULT_MODEL, TIER_DATA
from pagedkv.sim.units import parse_bytes

if TYPE_CHECKING:  # the tiers' runs: imported by a tiered run only
    from pagedkv.sim.tier_run import TierOptions

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
    t.add_argument(
        "--tier-data",
        choices=TIER_DATA,
        default=None,
        help="count: the tiers keep the digests of the blocks they hold and move no bytes "
        "(the hits of raw host tiers of these sizes, fast); real: a data pool's KV is "
        "written, demoted, compressed and loaded, and its throughput reported. Default: "
        "real with --compress, --remote or --check (they need bytes), else count",
    )


def wants_tiers(args: argparse.Namespace) -> bool:
    tiers = bool(args.host_tier_bytes is not None or args.remote is not None)
    if not tiers and getattr(args, "tier_data", None) is not None:
        raise ValueError("--tier-data needs --host-tier-bytes or --remote")
    return tiers


def tier_options(args: argparse.Namespace) -> TierOptions:
    """The tiers of the command line, checked (ValueError names the problem)."""
    from pagedkv.sim.tier_run import TierOptions

    if args.remote_cluster and args.remote is None:
        raise ValueError("--remote-cluster needs --remote")
    if args.compress is not None and not wants_tiers(args):
        raise ValueError("--compress needs --host-tier-bytes or --remote")
    kv: KVBytes | None = kv_bytes(args.model, args.kv_bytes_per_token)
    needs_bytes = args.compress is not None or args.remote is not None or args.check
    data = args.tier_data or ("real" if needs_bytes else "count")
    if data == "count" and args.check:
        raise ValueError("--check reads the KV back: it needs --tier-data real")
    return TierOptions(
        kv=kv if kv is not None else from_model(DEFAULT_MODEL),
        host_bytes=args.host_tier_bytes,
        compress=args.compress,
        remote=args.remote,
        remote_cluster=args.remote_cluster,
        data=data,
    )


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _change(before: float, after: float) -> str:
    return f"{100 * (after - before) / before:+.2f}%" if before else "-"


def workload_hits(f: dict[str, Any]) -> tuple[int, int]:
    """`(the workload's prompt tokens served from a cache, of them from the tiers)`: hits of
    first allocations only, a prompt recomputed after preemption hitting its own blocks
    left out."""
    hits = int(f["prefix_hit_tokens"] - f["recomputed_hit_tokens"])
    return hits, int(f.get("workload_tier_hit_tokens", 0))


def _rate(x: float | None, unit: str, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f} {unit}"


def comparison_table(base: dict[str, Any], tiered: dict[str, Any]) -> str:
    """Both runs side by side, led by the workload's own hit rate (module docstring of
    docs/tiers.md, "In the simulator"): where its hits came from, the prompt tokens not
    computed, what preemption recomputed, then what the tiers moved and how fast."""
    wp = tiered["workload_prompt_tokens"] or 1
    gib = float(GIB)
    b_hits, _ = workload_hits(base)
    t_hits, t_below = workload_hits(tiered)
    b_saved, t_saved = base["prefix_hit_tokens"], tiered["prefix_hit_tokens"]
    rows: list[tuple[str, str, str, str]] = [
        ("workload prompt tokens", str(base["workload_prompt_tokens"]), str(wp), ""),
        (
            "workload hit rate",
            _pct(base["workload_hit_rate"]),
            _pct(tiered["workload_hit_rate"]),
            _change(base["workload_hit_rate"], tiered["workload_hit_rate"]),
        ),
        ("  from the GPU", _pct(b_hits / wp), _pct((t_hits - t_below) / wp), ""),
        ("  from the tiers", "-", _pct(t_below / wp), ""),
        ("workload tokens not computed", str(b_hits), str(t_hits), _change(b_hits, t_hits)),
        (
            "recomputed after preemption",
            str(base["recomputed_tokens"]),
            str(tiered["recomputed_tokens"]),
            _change(base["recomputed_tokens"], tiered["recomputed_tokens"]),
        ),
        (
            "  of them hits",
            str(base["recomputed_hit_tokens"]),
            str(tiered["recomputed_hit_tokens"]),
            "",
        ),
        (
            "prompt tokens computed",
            str(base["computed_prompt_tokens"]),
            str(tiered["computed_prompt_tokens"]),
            _change(base["computed_prompt_tokens"], tiered["computed_prompt_tokens"]),
        ),
        ("prompt tokens not computed", str(b_saved), str(t_saved), _change(b_saved, t_saved)),
        (
            "hit rate, recomputed incl.",
            _pct(base["prefix_hit_rate"]),
            _pct(tiered["prefix_hit_rate"]),
            "",
        ),
    ]
    prompt = tiered["prompt_tokens"] or 1
    rows += [
        (f"  from {t['medium']}", "-", _pct(t["hit_tokens"] / prompt), "") for t in tiered["tiers"]
    ]
    demoted = tiered["blocks_demoted"]
    added = tiered["wall_seconds"] - base["wall_seconds"]
    rows += [
        ("GPU evictions", str(base["evictions"]), str(tiered["evictions"]), ""),
        ("preemptions", str(base["preemptions"]), str(tiered["preemptions"]), ""),
        ("blocks demoted", "-", str(demoted), ""),
        ("blocks promoted", "-", str(tiered["blocks_promoted"]), ""),
        ("GiB demoted (model KV)", "-", f"{tiered['bytes_demoted'] / gib:.2f}", ""),
        ("GiB promoted (model KV)", "-", f"{tiered['bytes_promoted'] / gib:.2f}", ""),
        ("compression ratio", "-", f"{tiered['compression_ratio']:.3f}", ""),
        ("failed loads", "-", str(tiered["failed_loads"]), ""),
        ("dropped demotions", "-", str(tiered["dropped_demotions"]), ""),
        ("manager s", f"{base['manager_seconds']:.2f}", f"{tiered['manager_seconds']:.2f}", ""),
        ("wall s", f"{base['wall_seconds']:.2f}", f"{tiered['wall_seconds']:.2f}", ""),
        (
            "wall added per demoted block",
            "-",
            f"{1e6 * added / demoted:.1f} us" if demoted else "-",
            "",
        ),
    ]
    if tiered.get("tier_data") == "real":
        rows += [
            ("demoted GB/s (data pool)", "-", _rate(tiered["demote_gbps"], "GB/s"), ""),
            ("promoted GB/s (data pool)", "-", _rate(tiered["promote_gbps"], "GB/s"), ""),
            ("compressed GB/s (codec)", "-", _rate(tiered["compress_gbps"], "GB/s"), ""),
            ("decompressed GB/s (codec)", "-", _rate(tiered["decompress_gbps"], "GB/s"), ""),
            (
                "load added per promoted block",
                "-",
                _rate(tiered["load_us_per_block"], "us", 1),
                "",
            ),
        ]
    for t in tiered["tiers"]:
        rows.append(
            (
                f"{t['name']} puts / dropped / evicted",
                "-",
                f"{t['puts']} / {t['dropped_puts']} / {t['evictions']}",
                "",
            )
        )
        rows.append(
            (
                f"{t['name']} gets / hits / corrupt",
                "-",
                f"{t['gets']} / {t['hits']} / {t['corrupt']}",
                "",
            )
        )
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len("no tiers"), *(len(r[1]) for r in rows))
    w2 = max(len("tiers"), *(len(r[2]) for r in rows))
    lines = [f"{'':<{w0}}  {'no tiers':>{w1}}  {'tiers':>{w2}}  change"]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c:>{w2}}  {d}".rstrip() for a, b, c, d in rows]
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
    keys = (
        "tier_hit_tokens",
        "compression_ratio",
        "bytes_demoted",
        "bytes_promoted",
        "tier_data",
        "workload_tier_hit_tokens",
        "demote_gbps",
        "promote_gbps",
        "compress_gbps",
        "decompress_gbps",
        "load_us_per_block",
    )
    b_hits, _ = workload_hits(base)
    t_hits, _ = workload_hits(tiered)
    demoted = tiered["blocks_demoted"]
    added = tiered["wall_seconds"] - base["wall_seconds"]
    return {
        "wall_added_us_per_demoted_block": 1e6 * added / demoted if demoted else None,
        **{k: tiered[k] for k in keys},
        "workload_hit_rate_without_tiers": base["workload_hit_rate"],
        "workload_hit_rate_with_tiers": tiered["workload_hit_rate"],
        "workload_tokens_not_computed_without_tiers": b_hits,
        "workload_tokens_not_computed_with_tiers": t_hits,
        "prompt_tokens_computed_without_tiers": base["computed_prompt_tokens"],
        "prompt_tokens_computed_with_tiers": tiered["computed_prompt_tokens"],
        "hit_rate_without_tiers": base["prefix_hit_rate"],
        "hit_rate_with_tiers": tiered["prefix_hit_rate"],
        "runs": [base, tiered],
    }


__all__ = [
    "add_tier_arguments",
    "comparison_table",
    "simulate_tiers",
    "tier_options",
    "workload_hits",
]
