"""`simulate --record ENDPOINT [--record-seconds S]`: size a live engine's cache from its KV
events (`sim.live`), and print the curve and the answer."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from pagedkv.sim.live import LiveCurve, LiveTrace

TARGET = 0.95  # of the hit rate a cache that never evicts would reach


def add_live_arguments(sim: argparse.ArgumentParser) -> None:
    g = sim.add_argument_group("sizing from a live engine")
    g.add_argument(
        "--record",
        metavar="ENDPOINT",
        help="follow an engine's KV events (vLLM's wire format over ZMQ: vLLM's publisher or "
        "pagedkv's, e.g. tcp://host:5557) for --record-seconds and size its cache from what "
        "they show: the hit rate of every cache size, from the blocks it stored and the hits "
        "their parents imply",
    )
    g.add_argument(
        "--record-seconds",
        type=float,
        default=60.0,
        help="how long --record follows the stream (default 60)",
    )
    g.add_argument(
        "--record-replay",
        metavar="ENDPOINT",
        help="--record: the publisher's replay socket (fills gaps; pagedkv's also sends a "
        "snapshot of the blocks cached before the recording)",
    )
    g.add_argument("--record-topic", default="", help="--record: the topic (default all)")


def live_doc(trace: LiveTrace, curve: LiveCurve, counts: dict[str, int]) -> dict[str, Any]:
    """What the table prints, as `--json` writes it."""
    r = trace.peak_resident
    sizes = sorted({s for s in (r // 4, r // 2, r, 2 * r, 4 * r, 8 * r) if s > 0})
    best = curve.unbounded
    need = curve.smallest(TARGET * best) if best > 0 else None
    seen = trace.accesses
    return {
        "block_size": trace.block_size,
        "batches": trace.batches,
        "stored_blocks": trace.stored_blocks,
        "restored_blocks": trace.restored_blocks,
        "hit_blocks": trace.hit_blocks,
        "removed_blocks": trace.removed_blocks,
        "peak_resident_blocks": r,
        "engine_hit_rate": trace.hit_blocks / seen if seen else 0.0,
        "curve": [{"blocks": s, "hit_rate": curve.hit_rate(s)} for s in sizes],
        "unbounded_hit_rate": best,
        "target": TARGET,
        "blocks_for_target": need,
        "stream": counts,
    }


def live_table(endpoint: str, doc: dict[str, Any]) -> str:
    bs = doc["block_size"]

    def tokens(blocks: int) -> str:
        return f"{blocks * bs} tokens" if bs else "? tokens"

    s = doc["stream"]
    took = f"{s['elapsed_ms'] / 1000:.1f} s" + (" (stopped by Ctrl-C)" if s["interrupted"] else "")
    lines = [
        f"record      {endpoint} for {took}: {doc['batches']} batches; "
        f"{doc['stored_blocks']} blocks stored ({doc['restored_blocks']} again after they "
        f"were evicted), {doc['hit_blocks']} hit (inferred), {doc['removed_blocks']} "
        f"evicted; block size {bs}; gaps {s['gaps']} ({s['lost']} lost), snapshots "
        f"{s['snapshots']}, restarts {s['restarts']}",
    ]
    if not doc["stored_blocks"]:
        lines.append("answer      no block was stored: nothing to size (is the engine busy?)")
        return "\n".join(lines)
    r = doc["peak_resident_blocks"]
    lines += [
        f"engine      block hit rate {100 * doc['engine_hit_rate']:.1f}% (hits / (hits + "
        f"stored)); at most {r} blocks cached at once ({tokens(r)}): its cache holds at least "
        "that",
        "  cache blocks  tokens            hit rate (of block accesses; LRU, a block kept "
        "only with its parent)",
    ]
    for p in doc["curve"]:
        mark = "  <- the most the engine held" if p["blocks"] == r else ""
        lines.append(
            f"  {p['blocks']:>12}  {tokens(p['blocks']):<16}  {100 * p['hit_rate']:>6.1f}%{mark}"
        )
    lines.append(f"  {'unbounded':>12}  {'':<16}  {100 * doc['unbounded_hit_rate']:>6.1f}%")
    need = doc["blocks_for_target"]
    if need is not None:
        lines.append(
            f"answer      {need} blocks ({tokens(need)}) reach {100 * doc['target']:.0f}% of "
            f"the unbounded hit rate ({100 * doc['target'] * doc['unbounded_hit_rate']:.1f}%)"
        )
    lines.append(
        "limits      hits are inferred from the parents of stored blocks: a request that "
        "stored nothing\n            (all cached, a short answer) is not seen; a chat's next "
        "turn reads as its last turn\n            going on (hits missed), a forked sample "
        "or beam as a new request (hits\n            counted); a chain cached before the "
        "recording counts one block unless a\n            snapshot showed it (--record-replay "
        "to pagedkv's publisher)"
    )
    return "\n".join(lines)


def simulate_live(args: argparse.Namespace, out: TextIO) -> int:
    """`simulate --record`: follow, then print (and with --json write) the sizing."""
    # imported by `--record` only: the options alone are defined for every `simulate` command
    from pagedkv.sim.live import LiveCurve, record
    from pagedkv.sim.report import write_doc

    if args.trace is not None or args.workload is not None or args.why:
        raise ValueError(
            "--record sizes from a live engine's events: not with --trace, --workload or --why"
        )
    trace, counts = record(
        args.record,
        args.record_seconds,
        replay_endpoint=args.record_replay,
        topic=args.record_topic,
    )
    doc = live_doc(trace, LiveCurve.of(trace), counts)
    print(live_table(args.record, doc), file=out)
    if args.json:
        write_doc(args.json, {"record": args.record, **doc})
        print(f"json        {args.json}", file=out)
    return 0


__all__ = ["add_live_arguments", "live_doc", "live_table", "simulate_live"]
