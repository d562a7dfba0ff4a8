"""One scheduler observer that passes every call on to several (`simulate --mrc`: one
`MRCRecorder` per block size in one replay, so that a single replay gives every block size's
curve)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from pagedkv.sim.observer import ScheduleObserver


class FanOut:
    """A `ScheduleObserver` that tells each of `observers`, in order, every call it hears.

    The arrays it passes on are the scheduler's own, the same for every observer: an observer
    must read them, not change them (`MRCRecorder` only reads)."""

    def __init__(self, observers: Sequence[ScheduleObserver]) -> None:
        self.observers = tuple(observers)

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
        for o in self.observers:
            o.allocate(
                seq_id, token_ids, hit_tokens, scheduled, cache_salt=cache_salt, lora_id=lora_id
            )

    def extend(self, seq_id: int, num_new_tokens: int) -> None:
        for o in self.observers:
            o.extend(seq_id, num_new_tokens)

    def append(self, seq_id: int, token_ids: npt.NDArray[np.uint32]) -> None:
        for o in self.observers:
            o.append(seq_id, token_ids)

    def decode(self, seq_ids: list[int], token_ids: npt.NDArray[np.uint32]) -> None:
        for o in self.observers:
            o.decode(seq_ids, token_ids)

    def fork(self, parent_id: int, child_id: int) -> None:
        for o in self.observers:
            o.fork(parent_id, child_id)

    def swap_out(self, seq_id: int) -> None:
        for o in self.observers:
            o.swap_out(seq_id)

    def swap_in(self, seq_id: int) -> None:
        for o in self.observers:
            o.swap_in(seq_id)

    def free(self, seq_id: int) -> None:
        for o in self.observers:
            o.free(seq_id)


__all__ = ["FanOut"]
