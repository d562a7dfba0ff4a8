"""Dump the router benchmark's stream (tests/support/router_stream.py) for the Rust replay
example, which times the index without Python (docs/router.md, "Figures"):

    python benches/router_dump.py OUT [--engines 64] [--memberships 1000000]
    cargo run --release -p pagedkv-router --example replay -- OUT [threads]
"""

from __future__ import annotations

import argparse
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from mooncake_trace import trace_path
from router_stream import generate, read_trace, vllm_payload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--memberships", type=int, default=1_000_000)
    p.add_argument("--lookups", type=int, default=5000)
    a = p.parse_args()
    trace = read_trace(trace_path(a.out.parent))
    s = generate(trace, engines=a.engines, memberships=a.memberships, lookups=a.lookups)
    with a.out.open("wb") as f:
        for b in s.batches:
            pl = vllm_payload(b)
            f.write(struct.pack("<BQI", 1, b.engine, len(pl)) + pl)
        for q in s.lookups:
            f.write(struct.pack(f"<BI{len(q)}Q", 2, len(q), *q))
    print(f"{len(s.batches)} batches, {s.block_ops} block ops, {len(s.lookups)} lookups -> {a.out}")


if __name__ == "__main__":
    main()
