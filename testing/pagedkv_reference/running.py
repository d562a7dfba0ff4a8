"""The reference model of `RunningBatch`: a list of (id, sequence) members over a
`ReferenceBlockManager`, whose `step` is `append_batch` plus `slot_mapping` of the new tokens.

A member is the sequence object its id had when it was added (as the Rust batch holds the id's
cell), so a member freed elsewhere is unknown to `step` even if its id was allocated again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from pagedkv.errors import InvalidArgumentError, UnknownSequenceError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from pagedkv_reference.manager import ReferenceBlockManager, _Seq


class ReferenceRunningBatch:
    """`pagedkv.RunningBatch` in pure Python (see the module docstring)."""

    def __init__(self, manager: ReferenceBlockManager) -> None:
        self._m = manager
        self._members: list[tuple[int, _Seq]] = []

    def add(self, seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> None:
        """Add live, resident sequences to the end of the batch (all or nothing)."""
        from pagedkv_reference.manager import _distinct, _seq_ids

        ids = _seq_ids(seq_ids)
        _distinct(ids)
        present = {sid for sid, _ in self._members}
        new = []
        for sid in ids:
            if sid in present:
                raise InvalidArgumentError(f"sequence {sid} is already in the running batch")
            new.append((sid, self._m._resident(sid)[1]))
        self._members.extend(new)

    def remove(self, seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> None:
        """Remove members, freed or not (all or nothing); the rest keep their order."""
        from pagedkv_reference.manager import _distinct, _seq_ids

        ids = _seq_ids(seq_ids)
        _distinct(ids)
        present = {sid for sid, _ in self._members}
        for sid in ids:
            if sid not in present:
                raise InvalidArgumentError(f"sequence {sid} is not in the running batch")
        gone = set(ids)
        self._members = [(sid, s) for sid, s in self._members if sid not in gone]

    def step(
        self,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        evicted: list[tuple[int, int, bytes]] | None = None,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None:
        """One token to each member: `(slot_mapping, cow_pairs)`, or None if it does not fit;
        with `groups=` the slot mapping has one row per group. `evicted` gets the step's
        evictions (as `append_batch`'s)."""
        from pagedkv_reference.manager import _U32, _int_list

        with self._m._duties(evicted) as out:
            toks = _int_list(token_ids, "token_ids", 0, _U32)
            return out(self._step(toks))

    def _step(self, toks: list[int]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None:
        if len(toks) != len(self._members):
            raise InvalidArgumentError(
                f"token_ids has {len(toks)} entries but the running batch has "
                f"{len(self._members)} sequences"
            )
        for sid, s in self._members:
            if self._m._seqs.get(sid) is not s:
                raise UnknownSequenceError(f"unknown sequence id {sid}")
            self._m._appendable(sid)
        ids = [sid for sid, _ in self._members]
        pairs = self._m.append_batch(ids, toks)
        if pairs is None:
            return None
        if not self._m._groups:
            slots = self._m.slot_mapping(ids, 1) if ids else np.zeros(0, dtype=np.int64)
            return slots, pairs
        # With `groups=`: one row of slots per group.
        rows = [
            self._m.slot_mapping(ids, 1, group=g) if ids else np.zeros(0, dtype=np.int64)
            for g in range(len(self._m._groups))
        ]
        return np.stack(rows).astype(np.int64), pairs

    @property
    def seq_ids(self) -> list[int]:
        """The members' ids in batch order."""
        return [sid for sid, _ in self._members]

    def __len__(self) -> int:
        return len(self._members)
