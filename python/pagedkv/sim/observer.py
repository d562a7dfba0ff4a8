"""What the scheduler tells an observer: the story of every sequence's blocks, as scheduled.

Two observers exist: `record.ScheduleRecord` (behind `--check`: no prefix hit on tokens that
were never scheduled) and `mrc.MRCRecorder` (behind `--mrc`: the miss-ratio curve). Both hear
the same calls at the same moments, so neither needs to ask the manager anything.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt


class ScheduleObserver(Protocol):
    """The scheduler's calls, made right after the manager call they follow succeeded."""

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
        """`allocate` gave `seq_id` `token_ids`; the first `scheduled` are scheduled, the
        first `hit_tokens` of those served from the prefix cache."""

    def extend(self, seq_id: int, num_new_tokens: int) -> None:
        """The next `num_new_tokens` prompt tokens were scheduled."""

    def append(self, seq_id: int, token_ids: npt.NDArray[np.uint32]) -> None:
        """Tokens were appended (decoded, or accepted drafts) and scheduled."""

    def decode(self, seq_ids: list[int], token_ids: npt.NDArray[np.uint32]) -> None:
        """One decode step: `token_ids[i]` was appended to `seq_ids[i]`, for each `i`."""

    def fork(self, parent_id: int, child_id: int) -> None:
        """`child_id` now shares every block of `parent_id`."""

    def swap_out(self, seq_id: int) -> None:
        """The sequence's GPU blocks were released (copied to CPU blocks)."""

    def swap_in(self, seq_id: int) -> None:
        """The sequence is back on new GPU blocks."""

    def free(self, seq_id: int) -> None:
        """The sequence left (finished, preempted, pruned, rejected or aborted)."""


__all__ = ["ScheduleObserver"]
