"""Two plain figures of the installed pagedkv, for comparing builds side by side.

- decode step: `append_batch` of one token to 256 sequences of 500 tokens (best of 30 rounds
  of 16 steps);
- churn cycle: allocate a 200-token prompt (cached after the first cycle), fork it, append
  one token, free both (mean over 20,000 cycles).

Run it alternately under two environments, e.g. an old and a new build:
`for r in 1 2 3 4 5; do old/bin/python benches/step_costs.py old; new/bin/python
benches/step_costs.py new; done | sort`.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import pagedkv


def decode_step(rounds: int = 30) -> float:
    m = pagedkv.BlockManager(65536, 16)
    ids = np.arange(256, dtype=np.int64)
    for s in range(256):
        m.allocate(s, list(range(s * 1000, s * 1000 + 500)))
    toks = np.ones(256, dtype=np.int64)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(16):
            m.append_batch(ids, toks)
        best = min(best, (time.perf_counter() - t) / 16)
    return best


def churn_cycle(n: int = 20_000) -> float:
    m = pagedkv.BlockManager(4096, 16)
    prompt = list(range(200))
    t = time.perf_counter()
    for i in range(n):
        m.allocate(i, prompt)
        m.fork(i, 10**9 + i)
        m.append(i, [1])
        m.free(i)
        m.free(10**9 + i)
    return (time.perf_counter() - t) / n


if __name__ == "__main__":
    label = sys.argv[1] if len(sys.argv) > 1 else "pagedkv"
    print(
        f"{label} decode_step_us={decode_step() * 1e6:.1f} churn_cycle_us={churn_cycle() * 1e6:.2f}"
    )
