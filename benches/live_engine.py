"""A stand-in live engine for `simulate --record`: the simulator's replay of a built-in
workload through a `BlockManager` with KV events on, published on vLLM's wire by pagedkv's
`Publisher`, slowed to `--step-ms` per scheduler step so that a recording can follow it.

It prints the manager's own block hit rate at the end (prefix-hit blocks over those plus the
blocks registered, stored), the figure a recording's inferred rate is compared with.

Run, then record it from another shell:

    python benches/live_engine.py --port 5557 --replay-port 5558 --wait 2
    python -m pagedkv simulate --record tcp://127.0.0.1:5557 \\
        --record-replay tcp://127.0.0.1:5558 --record-seconds 20
"""

from __future__ import annotations

import argparse
import time

from pagedkv import BlockManager
from pagedkv.kv_events import Publisher
from pagedkv.sim import build_workload, run_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=5557)
    p.add_argument("--replay-port", type=int, default=5558)
    p.add_argument("--workload", default="mixed")
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--wait", type=float, default=2.0, help="seconds before the replay starts")
    a = p.parse_args()
    m = BlockManager(a.num_blocks, 16, enable_kv_events=True)
    wl = build_workload(a.workload, a.requests, seed=0)
    with Publisher(
        m,
        endpoint=f"tcp://127.0.0.1:{a.port}",
        replay_endpoint=f"tcp://127.0.0.1:{a.replay_port}",
        topic="",
        heartbeat=0.2,
    ) as pub:
        time.sleep(a.wait)
        t0 = time.monotonic()
        res = run_workload(
            m,
            wl,
            max_num_batched_tokens=2048,
            after_step=lambda _c, _ids: time.sleep(a.step_ms / 1000),
        )
        pub.flush()
        st = m.stats()
        hit_blocks = res.prefix_hit_tokens // 16
        print(
            f"replayed {wl.describe()} in {time.monotonic() - t0:.1f} s: {res.steps} steps; "
            f"token hit rate {res.hit_rate:.1%}; {hit_blocks} hit blocks, "
            f"{st.registered_blocks} registered: block hit rate "
            f"{hit_blocks / (hit_blocks + st.registered_blocks):.1%}; {st.evictions} evictions"
        )


if __name__ == "__main__":
    main()
