"""The simulator's own record of scheduled blocks, behind `--check`: no hit on unscheduled KV.

The block manager registers a full block in its prefix index once the scheduler has scheduled
its tokens (`docs/semantics.md`, "registration follows scheduling"), and retracts it again when
a request is aborted before the step that would have computed it ran (`free(...,
num_computed_tokens=c)`). `ScheduleRecord` follows the same story without asking the manager:
it keys every full block by its content (cache salt, LoRA id and every token up to the block's
end, chained at block granularity with BLAKE2b, nothing shared with the manager's hashing) and
remembers which of those contents the simulator has scheduled, in a step that ran or in the
step now being scheduled (KV is written before attention reads it, so a block scheduled in step
`t` may be hit from step `t` on). An abort retracts the contents first scheduled in its step,
unless another live sequence holds the same content (a fork, or a request that hit it).

After every `allocate` the scheduler calls `allocate` here, which raises
`UnscheduledHitError` when the hit the manager returned covers a block whose content the
record does not hold: the manager served KV that nobody computed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


class UnscheduledHitError(RuntimeError):
    """The manager returned a prefix hit on a block whose tokens were never scheduled."""


def _root(cache_salt: str | bytes | None, lora_id: int | None) -> bytes:
    salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
    tag = b"none" if salt is None else b"salt:" + salt
    return hashlib.blake2b(b"pagedkv-sim-record|" + tag + f"|lora:{lora_id}".encode()).digest()


def _chain(parent: bytes, block: npt.NDArray[np.uint32]) -> bytes:
    return hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()


@dataclass(slots=True)
class _SeqRecord:
    root: bytes
    keys: list[bytes] = field(default_factory=list)  # contents of its full scheduled blocks
    partial: list[int] = field(default_factory=list)  # scheduled tokens past the last full block
    prompt: npt.NDArray[np.uint32] = field(default_factory=lambda: np.zeros(0, np.uint32))
    next_prompt: int = 0  # the prompt tokens from here on are not scheduled yet

    def copy(self) -> _SeqRecord:
        return _SeqRecord(
            self.root, list(self.keys), list(self.partial), self.prompt, self.next_prompt
        )


class ScheduleRecord:
    """Which block contents the simulator scheduled; see the module docstring."""

    __slots__ = ("block_size", "holders", "marked", "pending", "scheduling", "seqs")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.marked: set[bytes] = set()  # scheduled in a step that ran, or in this step
        self.pending: set[bytes] = set()  # first scheduled in the step being scheduled now
        self.holders: dict[bytes, int] = {}  # live sequences whose scheduled blocks include it
        self.seqs: dict[int, _SeqRecord] = {}
        self.scheduling = False

    # ---------------------------------------------------------------- steps

    def begin_step(self) -> None:
        """The scheduler starts scheduling a step: what it schedules now is not computed yet."""
        self.scheduling = True

    def step_ran(self) -> None:
        """The step ran: every content scheduled in it now has its KV."""
        self.pending.clear()
        self.scheduling = False

    # ---------------------------------------------------------------- sequences

    def _hold(self, key: bytes) -> None:
        self.holders[key] = self.holders.get(key, 0) + 1
        if key not in self.marked:
            self.marked.add(key)
            if self.scheduling:
                self.pending.add(key)

    def _feed(self, rec: _SeqRecord, tokens: npt.NDArray[np.uint32]) -> None:
        """Newly scheduled tokens of a sequence: mark the blocks they fill."""
        bs = self.block_size
        if rec.partial:
            take = min(bs - len(rec.partial), len(tokens))
            rec.partial.extend(tokens[:take].tolist())
            tokens = tokens[take:]
            if len(rec.partial) < bs:
                return
            self._push(rec, np.asarray(rec.partial, dtype=np.uint32))
            rec.partial = []
        full = len(tokens) // bs * bs
        for start in range(0, full, bs):
            self._push(rec, tokens[start : start + bs])
        rec.partial = tokens[full:].tolist()

    def _push(self, rec: _SeqRecord, block: npt.NDArray[np.uint32]) -> None:
        key = _chain(rec.keys[-1] if rec.keys else rec.root, block)
        rec.keys.append(key)
        self._hold(key)

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
        """`allocate` returned `hit_tokens` and scheduled `scheduled` tokens of `token_ids`.

        Raises `UnscheduledHitError` if a hit block's content was never scheduled.
        """
        bs = self.block_size
        rec = _SeqRecord(_root(cache_salt, lora_id), prompt=token_ids, next_prompt=scheduled)
        if hit_tokens % bs or not 0 <= hit_tokens < len(token_ids) or scheduled <= hit_tokens:
            raise UnscheduledHitError(
                f"allocate(seq {seq_id}) returned {hit_tokens} hit tokens for a prompt of "
                f"{len(token_ids)} tokens with {scheduled} scheduled (block size {bs})"
            )
        for i in range(hit_tokens // bs):
            key = _chain(rec.keys[-1] if rec.keys else rec.root, token_ids[i * bs : (i + 1) * bs])
            if key not in self.marked:
                raise UnscheduledHitError(
                    f"allocate(seq {seq_id}) served {hit_tokens} tokens from the prefix cache, "
                    f"but block {i} (tokens {i * bs}..{(i + 1) * bs - 1}, cache_salt="
                    f"{cache_salt!r}, lora_id={lora_id}) holds tokens the simulator has not "
                    "scheduled (or scheduled only in a step that an abort cancelled): the "
                    "manager served KV that nobody computed"
                )
            rec.keys.append(key)
        for key in rec.keys:
            self._hold(key)
        self._feed(rec, token_ids[hit_tokens:scheduled])
        self.seqs[seq_id] = rec

    def extend(self, seq_id: int, num_new_tokens: int) -> None:
        rec = self.seqs[seq_id]
        start = rec.next_prompt
        rec.next_prompt += num_new_tokens
        self._feed(rec, rec.prompt[start : rec.next_prompt])

    def append(self, seq_id: int, token_ids: npt.NDArray[np.uint32]) -> None:
        self._feed(self.seqs[seq_id], token_ids)

    def decode(self, seq_ids: list[int], token_ids: npt.NDArray[np.uint32]) -> None:
        for i, seq_id in enumerate(seq_ids):
            self.append(seq_id, token_ids[i : i + 1])

    def fork(self, parent_id: int, child_id: int) -> None:
        rec = self.seqs[parent_id].copy()
        for key in rec.keys:
            self._hold(key)
        self.seqs[child_id] = rec

    def swap_out(self, seq_id: int) -> None:
        """Swapping moves KV, it computes none: the record is unchanged."""

    def swap_in(self, seq_id: int) -> None:
        """As `swap_out`."""

    def free(self, seq_id: int) -> None:
        """The sequence left (finished, preempted, pruned or aborted).

        A content first scheduled in the step being scheduled, that no live sequence holds any
        more, was never computed: it is forgotten (the manager retracts its block).
        """
        rec = self.seqs.pop(seq_id)
        for key in rec.keys:
            left = self.holders[key] - 1
            if left:
                self.holders[key] = left
                continue
            del self.holders[key]
            if key in self.pending:
                self.pending.discard(key)
                self.marked.discard(key)


__all__ = ["ScheduleRecord", "UnscheduledHitError"]
