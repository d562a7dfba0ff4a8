"""Memory of a router index, measured alone in this process (benches/test_bench_router.py
runs it once per index, so that neither measures the other's freed memory):

    python benches/router_memory.py --impl pagedkv|dynamo --engines 64 --memberships 1000000

Builds the stream and its encoded events first, then the index; prints one JSON line: the
resident memory the index added (RSS after, less RSS before, with Python's collector run),
its memberships, and for pagedkv the index's own accounting (`stats().bytes`).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from mooncake_trace import trace_path
from router_stream import dynamo_stream, generate, read_trace, vllm_payload


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--impl", choices=["pagedkv", "dynamo"], required=True)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--memberships", type=int, default=1_000_000)
    p.add_argument("--trace", type=Path, help="a Mooncake trace (default: the shared one)")
    a = p.parse_args()
    trace = a.trace or trace_path(Path("/tmp"))
    s = generate(read_trace(trace), engines=a.engines, memberships=a.memberships)
    own = None
    if a.impl == "pagedkv":
        from pagedkv.router import RouterIndex

        payloads = [(b.engine, vllm_payload(b)) for b in s.batches]
        del s.batches[:]
        gc.collect()
        before = rss()
        ix = RouterIndex()
        for e, pl in payloads:
            ix.apply(e, pl)
        gc.collect()
        after = rss()
        own = ix.stats().bytes
        members = ix.stats().memberships
    else:
        from dynamo._core import RadixTree

        events = list(dynamo_stream(s))
        members = s.memberships
        del s.batches[:]
        gc.collect()
        before = rss()
        tree = RadixTree()
        for e, ev in events:
            tree.apply_event(e, ev)
        tree.find_matches([1])  # after every event queued before it
        gc.collect()
        after = rss()
    print(json.dumps({"impl": a.impl, "rss": after - before, "memberships": members, "own": own}))


if __name__ == "__main__":
    main()
