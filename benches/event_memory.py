"""Host memory of KV events per cached block, from the resident set (RSS).

Three managers of N + 64 blocks of 16 tokens, each in a fresh subprocess, allocate and free
N / 64 prompts of 64 new blocks (so N blocks end CACHED): `off` (events disabled), `bounded`
(events enabled, queue bounded at 1 event: it overflows at once, so only the described set
grows) and `unbounded` (every event queued too). Per block = RSS growth over the workload / N;
the described set's cost is `bounded - off`, a queued event's `unbounded - bounded`.
Run: `python benches/event_memory.py [--blocks N]`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

MODES = ("off", "bounded", "unbounded")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _child(mode: str, n: int) -> None:
    import numpy as np

    from pagedkv import BlockManager

    m = BlockManager(n + 64, 16, enable_kv_events=mode != "off")
    if mode == "bounded":
        m.set_kv_event_capacity(1)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 2**31, size=64 * 16).tolist() for _ in range(n // 64)]
    before = _rss()
    for i, p in enumerate(prompts):
        m.allocate(i, p)
        m.free(i)
    assert m.num_cached_blocks == n // 64 * 64
    print((_rss() - before) / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=262_144)
    ap.add_argument("--child", choices=MODES)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.blocks)
        return
    per = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, "--child", mode, "--blocks", str(a.blocks)]
        per[mode] = float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    print(f"{a.blocks} cached blocks of 16 tokens; bytes per block of RSS growth:")
    for mode in MODES:
        print(f"  {mode:9} {per[mode]:7.1f}")
    print(f"  described set per cached block: {per['bounded'] - per['off']:.1f}")
    print(f"  queued event:                   {per['unbounded'] - per['bounded']:.1f}")


if __name__ == "__main__":
    main()
