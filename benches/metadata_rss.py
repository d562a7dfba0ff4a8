"""Metadata bytes per block of the Rust `BlockManager`, from the process's resident set (RSS).

Issue 13's target: at most 64 bytes per block, all tables included, measured at 10 million
blocks. Each state is measured in a fresh subprocess, so that nothing else lives in its heap:

- `constructed`: `BlockManager(N, 16)` built, no sequence yet (what construction touches);
- `cached`: every block filled and then released, so all N are CACHED (digest, prefix-index
  entry, LRU record); sequences of 1,024 blocks are allocated and freed one after another;
- `held`: every block held by live sequences of 1,024 blocks (so this also counts each
  sequence's token history, 64 bytes a block at 16 u32 tokens, and its block table).

Bytes per block = (RSS after - RSS before construction) / N, the baseline being the
interpreter with numpy and pagedkv imported. RSS counts touched pages only: memory reserved
but never written does not show. Run: `python benches/metadata_rss.py [--blocks N]`.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

STATES = ("constructed", "cached", "held")
CHUNK = 1024  # blocks per sequence
B = 16


def _rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(state: str, n: int) -> dict[str, float]:
    """Measure one state in this process (run by `measure` in a fresh interpreter)."""
    import numpy as np

    import pagedkv

    assert n * B < 2**32, "token ids are the block contents: they must fit in u32"
    gc.collect()
    base = _rss_kib()
    t = time.perf_counter()
    m = pagedkv.BlockManager(n, B)
    built = _rss_kib()
    for k, start in enumerate(range(0, n, CHUNK) if state != "constructed" else ()):
        blocks = min(CHUNK, n - start)
        m.allocate(k, np.arange(start * B, (start + blocks) * B, dtype=np.uint32))
        if state == "cached":
            m.free(k)
    gc.collect()
    after = _rss_kib()
    if state == "cached":
        assert m.num_cached_blocks == n
    if state == "held":
        assert m.num_free_blocks == 0 and m.num_cached_blocks == 0
    return {
        "blocks": n,
        "baseline_mib": base / 1024,
        "construct_bytes_per_block": (built - base) * 1024 / n,
        "bytes_per_block": (after - base) * 1024 / n,
        "peak_bytes_per_block": (_rss_kib("VmHWM") - base) * 1024 / n,
        "seconds": time.perf_counter() - t,
    }


def measure(state: str, n: int) -> dict[str, float]:
    """Run `child(state, n)` in a fresh interpreter and return its figures."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", state, "--blocks", str(n)],
        check=True,
        capture_output=True,
        text=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="RSS bytes per block of BlockManager")
    p.add_argument("--blocks", type=int, default=10_000_000)
    p.add_argument("--states", default=",".join(STATES), help="comma list of " + ", ".join(STATES))
    p.add_argument("--child", choices=STATES, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.blocks)))
        return 0
    print(f"BlockManager({a.blocks}, {B}), SHA-256; RSS per block over the imports' baseline")
    print(f"{'state':<12} {'bytes/block':>12} {'at build':>9} {'peak':>8} {'baseline':>9} {'s':>6}")
    for state in a.states.split(","):
        r = measure(state, a.blocks)
        print(
            f"{state:<12} {r['bytes_per_block']:12.1f} {r['construct_bytes_per_block']:9.1f}"
            f" {r['peak_bytes_per_block']:8.1f} {r['baseline_mib']:8.1f}M {r['seconds']:6.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
