"""Delayed reclaim with a time window, for the ablations (`sim.ablate`).

The manager keeps a released block's KV findable for prefix hits (CACHED) until a free block
is needed and the least recently released one is evicted: reclaim is delayed without limit.
The original vLLM design bounded it with a window (`cache_window`): a block freed more than
`W` steps ago is reclaimed whether or not its space is needed. `WindowReclaim` imposes such a
window from outside the manager, once per executed step (`run_workload(after_step=...)`):

- the blocks held now are the block tables of the resident sequences; a block held at the
  previous step's end and not now was released in this step. What happens within one step is
  not seen: a block released and hit again stays held, and a block taken and released in the
  same step (a sequence admitted and preempted, or admitted and finished, in one step) is
  never seen held, so it stays cached until its space is needed (the "at once" row of the
  default workload keeps a mean of 6 such blocks of 4,096);
- a block released at step `t` and not held since is handed to `evict_blocks` at the end of
  step `t + W` (`W = 0`: at the end of the step that released it, "reclaim at once"). Blocks
  never registered in the prefix cache are ignored by `evict_blocks`.

`evict_blocks` is a manager call like the scheduler's (`sim.ablate_timing` replays and times
it with them); reading the block tables is the simulator's bookkeeping (a manager with a
window would know its release times) and is not.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class WindowReclaim:
    """`after_step` for `run_workload`: reclaims CACHED blocks released `window` steps ago."""

    def __init__(self, manager: Any, window: int) -> None:
        if window < 0:
            raise ValueError(f"the reclaim window must be >= 0 steps, got {window}")
        self.m = manager
        self.window = window
        n = manager.num_blocks
        self.held = np.zeros(n, dtype=bool)
        self.released_at = np.full(n, -1, dtype=np.int64)  # -1: held, reclaimed or never used
        self.reclaimed = 0  # blocks evict_blocks took out of the prefix cache

    def __call__(self, clock: int, seq_ids: list[int]) -> None:
        n = len(self.held)
        held = np.zeros(n, dtype=bool)
        if seq_ids:
            tables = self.m.block_tables(np.asarray(seq_ids, dtype=np.int64))
            ids = tables[tables >= 0]
            held[ids] = True
        released = self.held & ~held
        self.released_at[released] = clock
        self.released_at[held] = -1
        self.held = held
        due = np.flatnonzero((self.released_at >= 0) & (self.released_at <= clock - self.window))
        if len(due):
            self.reclaimed += int(self.m.evict_blocks(due.astype(np.uint32).tolist()))
            self.released_at[due] = -1


__all__ = ["WindowReclaim"]
