"""`MRCRecorder`'s stream kept in Rust: the same curve, several times faster.

`FastMRCRecorder` hears the scheduler's calls (`observer.ScheduleObserver`) and hands them to
`pagedkv._core.MrcStream` (pagedkv-sim's `mrc_stream`), which keys blocks with the same
arithmetic as `block_keys`, records the same lookups and touches as `mrc.MRCRecorder`, and
replays them through exact stack distances (a Fenwick tree) in `curve()`. The Python recorder
stays the reference: tests/sim/test_sim_mrc_fast.py checks that both give identical curves,
sampled or not. The simulator's sizing runs use this one.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pagedkv._core import MrcStream
from pagedkv.sim.block_keys import root
from pagedkv.sim.mrc import SAMPLE_BITS
from pagedkv.sim.mrc_curve import MissRatioCurve


class FastMRCRecorder:
    """Scheduler observer with `mrc.MRCRecorder`'s interface; `curve()` computes the curve."""

    __slots__ = ("_roots", "_stream", "block_size", "sample_rate")

    def __init__(self, block_size: int, sample_rate: float = 1.0) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.block_size = block_size
        self.sample_rate = sample_rate
        # The threshold exactly as the Python recorder rounds it.
        threshold = round(sample_rate * (1 << SAMPLE_BITS))
        self._stream = MrcStream(block_size, max(1, threshold))
        self._roots: dict[tuple[str | bytes | None, int | None], int] = {}

    @property
    def prompt_tokens(self) -> int:
        return int(self._stream.prompt_tokens)

    @property
    def lookups(self) -> int:
        return int(self._stream.lookups)

    def allocate(
        self,
        seq_id: int,
        token_ids: npt.NDArray[np.uint32],
        hit_tokens: int,
        scheduled: int,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> None:
        del hit_tokens  # the curve decides hits itself, for every size
        start = self._roots.get((cache_salt, lora_id))
        if start is None:
            start = self._roots[(cache_salt, lora_id)] = root(cache_salt, lora_id)
        self._stream.allocate(seq_id, token_ids, scheduled, start)

    def extend(self, seq_id: int, num_new_tokens: int) -> None:
        self._stream.extend(seq_id, num_new_tokens)

    def append(self, seq_id: int, token_ids: npt.NDArray[np.uint32] | list[int]) -> None:
        self._stream.append(seq_id, token_ids)

    def decode(self, seq_ids: list[int], token_ids: npt.NDArray[np.uint32]) -> None:
        self._stream.decode(seq_ids, token_ids)

    def fork(self, parent_id: int, child_id: int) -> None:
        self._stream.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        self._stream.free(seq_id)

    def swap_out(self, seq_id: int) -> None:
        self._stream.swap_out(seq_id)

    def swap_in(self, seq_id: int) -> None:
        self._stream.swap_in(seq_id)

    def hits(self, capacities: list[int], policy: str, first_lookup: int = 0) -> list[int]:
        """Hit blocks of the recorded stream in a cache of each of `capacities` blocks under
        `policy`: `lru` (the curve's model), `fifo`, or `optimal` (Belady's offline optimum
        under the prefix constraint; exact streams only)."""
        if policy == "optimal" and self.sample_rate < 1.0:
            raise ValueError("the optimal bound needs an exact stream (sample_rate 1)")
        return self._stream.hits(capacities, policy, first_lookup)

    def curve(self) -> MissRatioCurve:
        """Replay the recorded stream through exact stack distances."""
        rate = self.sample_rate
        thresholds, touches, distinct = self._stream.curve(rate)
        return MissRatioCurve(
            block_size=self.block_size,
            sample_rate=rate,
            thresholds=thresholds,
            prompt_tokens=self.prompt_tokens,
            lookups=self.lookups,
            touches=int(touches),
            distinct_blocks=round(distinct / rate),
        )


__all__ = ["FastMRCRecorder"]
