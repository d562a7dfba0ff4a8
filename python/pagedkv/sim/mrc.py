"""`simulate --mrc`: the prefix-cache hit rate for every cache size, from one replay.

`MRCRecorder` watches the scheduler (the same hook points as `record.ScheduleRecord`) and
writes down, in order, two kinds of events over block content keys (`block_keys`):

- a *lookup* when a request's prompt is first admitted: its full blocks, up to the cap the
  manager applies (at least one token computed), looked up together;
- a *touch* when blocks are used: registered as their tokens are scheduled (prompt chunks,
  decoded tokens, accepted drafts, swap-in), pinned by a hit, and released when a sequence is
  freed or swapped out (tail first, so the head ends most recent, as the manager's
  least-recently-released order has it).

`curve()` then replays the events through `stack.StackDistances`: a block of a lookup is in
an LRU cache of `C` blocks exactly when its stack distance is at most `C`, and a prompt hits
the longest prefix of blocks that are all there, so block `i` of a prompt hits at every size
at least the largest distance among blocks `0..i`. Sorting those thresholds gives the hit rate
of every size at once.

What this models, and what it leaves out: an LRU cache of `C` blocks over everything the
replay touched, in the order it touched it. The manager differs in that blocks held by
running sequences are pinned (never evicted, however old), and a smaller pool would also have
scheduled differently (queued, preempted). With short outputs and a pool well above the
running set the two agree closely (tests/sim/test_sim_mrc.py measures how closely); the curve is
an estimate between the sizes a full simulation checks. Recomputed prompts (after
preemption) are touched but not looked up: the curve is over the workload's own prompts.
Aborted requests' retracted blocks count as cached.

Sampling (SHARDS, Waldspurger et al., FAST 2015): with `sample_rate = R < 1` only keys whose
hash falls below `R` are recorded; distances among them are scaled by `1 / R` and each sampled
hit stands for `1 / R` blocks. Memory and time shrink by `R`; the curve becomes an estimate
(a prefix's largest distance is taken over its sampled blocks only).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pagedkv.sim.block_keys import U64, chain, contents, root, step
from pagedkv.sim.mrc_curve import MissRatioCurve
from pagedkv.sim.stack import StackDistances

SAMPLE_BITS = 24
_NEVER = np.inf  # the distance of a block never touched before: a miss at every size
_EMPTY: U64 = np.zeros(0, dtype=np.uint64)  # a decode step's place in the stream, until keyed


@dataclass(slots=True)
class _Seq:
    """What the recorder knows of a live sequence."""

    keys: list[U64]  # keys of its full blocks, in chunks, token order
    prompt_blocks: int  # full blocks of the tokens it was allocated with
    prompt_len: int
    scheduled: int  # tokens scheduled so far
    state: int  # chain state after the last full block
    partial: list[int] = field(default_factory=list)  # tokens past the last full block
    tail: list[int] = field(default_factory=list)  # the allocated tokens' partial last block
    swapped: bool = False

    def copy(self) -> _Seq:
        return _Seq(
            list(self.keys),
            self.prompt_blocks,
            self.prompt_len,
            self.scheduled,
            self.state,
            list(self.partial),
            list(self.tail),
            self.swapped,
        )


def _dense_ids(keys: U64) -> tuple[npt.NDArray[np.int64], int]:
    """Each key as a number `0 .. distinct - 1` (equal keys, equal numbers), and `distinct`.

    Which number a key gets does not matter (the stack distances depend only on which keys
    are equal), so this groups equal keys the fast way: it sorts *values* (numpy sorts
    integers several times faster than it argsorts them), each the key's high bits with its
    position in the low bits. Equal keys end up side by side, ordered by position; so do
    different keys sharing the high bits, possibly interleaved: those few runs are sorted
    again by the whole key."""
    n = len(keys)
    if not n:
        return np.zeros(0, dtype=np.int64), 0
    bits = np.uint64(max(1, (n - 1).bit_length()))
    low = np.uint64((1 << int(bits)) - 1)
    packed = (keys >> bits) << bits
    packed |= np.arange(n, dtype=np.uint64)
    packed.sort()
    order = (packed & low).astype(np.int64)
    ordered = keys[order]
    differs = ordered[1:] != ordered[:-1]
    high = packed >> bits
    same_high = high[1:] == high[:-1]
    clash = same_high & differs  # different keys within one run of equal high bits
    if clash.any():
        run = np.concatenate(([0], np.cumsum(~same_high)))
        redo = np.flatnonzero(np.isin(run, run[1:][clash]))
        again = np.lexsort((ordered[redo], run[redo]))
        order[redo] = order[redo][again]
        ordered = keys[order]
        differs = ordered[1:] != ordered[:-1]
    rank = np.concatenate(([0], np.cumsum(differs)))
    ids = np.empty(n, dtype=np.int64)
    ids[order] = rank
    return ids, int(rank[-1]) + 1


class MRCRecorder:
    """Scheduler observer that records lookups and touches; `curve()` computes the curve."""

    __slots__ = (
        "_admitted",
        "_kinds",
        "_pending",
        "_pending_seqs",
        "_pieces",
        "_seqs",
        "_threshold",
        "block_size",
        "lookups",
        "prompt_tokens",
        "sample_rate",
    )

    def __init__(self, block_size: int, sample_rate: float = 1.0) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.block_size = block_size
        self.sample_rate = sample_rate
        self._threshold = np.uint64(round(sample_rate * (1 << SAMPLE_BITS)))
        self._pieces: list[U64] = []
        self._kinds: list[bool] = []  # True: a lookup
        self._seqs: dict[int, _Seq] = {}
        # Blocks filled by decode steps, keyed later in one batch (`_flush`): per step, its
        # piece's index in `_pieces` (a placeholder until then), the owners and their tokens.
        self._pending: list[tuple[int, list[_Seq], list[list[int]]]] = []
        self._pending_seqs: set[int] = set()  # ids of the sequences with a block pending
        self._admitted: set[int] = set()  # sequences allocated or forked: re-allocation recomputes
        self.prompt_tokens = 0
        self.lookups = 0

    # ---------------------------------------------------------------- the stream

    def _sampled(self, keys: U64) -> U64:
        if self.sample_rate >= 1.0:
            return keys
        return keys[(keys >> np.uint64(64 - SAMPLE_BITS)) < self._threshold]

    def _touch(self, keys: U64) -> None:
        keys = self._sampled(keys)
        if len(keys):
            self._pieces.append(keys)
            self._kinds.append(False)

    def _lookup(self, keys: U64, tokens: int) -> None:
        self.prompt_tokens += tokens
        self.lookups += 1
        self._pieces.append(self._sampled(keys))
        self._kinds.append(True)

    # ---------------------------------------------------------------- scheduler hooks

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
        """A sequence was allocated `token_ids`, `scheduled` of them scheduled."""
        del hit_tokens  # the curve decides hits itself, for every size
        bs = self.block_size
        n = len(token_ids)
        keys, state = chain(root(cache_salt, lora_id), contents(token_ids, bs))
        nb = len(keys)
        seq = _Seq([keys], nb, n, 0, state, tail=token_ids[nb * bs :].tolist())
        if seq_id not in self._admitted:
            self._admitted.add(seq_id)
            self._lookup(keys[: (n - 1) // bs], n)
        self._seqs[seq_id] = seq
        self._schedule(seq, scheduled)

    def _schedule(self, seq: _Seq, upto: int) -> None:
        """Prompt tokens up to `upto` are scheduled: their full blocks are registered."""
        bs = self.block_size
        first, last = seq.scheduled // bs, min(upto // bs, seq.prompt_blocks)
        seq.scheduled = upto
        if last > first:
            self._touch(seq.keys[0][first:last])
        if upto >= seq.prompt_len:
            seq.partial = seq.tail

    def extend(self, seq_id: int, num_new_tokens: int) -> None:
        seq = self._seqs[seq_id]
        self._schedule(seq, seq.scheduled + num_new_tokens)

    def append(self, seq_id: int, token_ids: npt.NDArray[np.uint32] | list[int]) -> None:
        """Tokens appended (decoded, or accepted drafts): blocks they fill are registered."""
        if seq_id in self._pending_seqs:
            self._flush()  # its chain state
        seq = self._seqs[seq_id]
        seq.partial.extend(np.asarray(token_ids).tolist())
        bs = self.block_size
        if len(seq.partial) < bs:
            return
        full = len(seq.partial) // bs * bs
        block = np.asarray(seq.partial[:full], dtype=np.uint32)
        keys, seq.state = chain(seq.state, contents(block, bs))
        seq.partial = seq.partial[full:]
        seq.keys.append(keys)
        self._touch(keys)

    def decode(self, seq_ids: list[int], token_ids: npt.NDArray[np.uint32]) -> None:
        """One token per sequence. The blocks filled in this step are keyed later, with those
        of other steps, in one numpy pass (`_flush`); the step's place in the stream is kept."""
        bs = self.block_size
        seqs, pending_seqs = self._seqs, self._pending_seqs
        full: list[list[int]] = []
        owners: list[_Seq] = []
        filled: list[int] = []
        for seq_id, tok in zip(seq_ids, token_ids.tolist(), strict=True):
            seq = seqs[seq_id]
            seq.partial.append(tok)
            if len(seq.partial) == bs:
                if seq_id in pending_seqs:  # its chain state waits on its pending block
                    self._flush()
                full.append(seq.partial)
                owners.append(seq)
                filled.append(seq_id)
                seq.partial = []
        if not full:
            return
        self._pending.append((len(self._pieces), owners, full))
        pending_seqs.update(filled)
        self._pieces.append(_EMPTY)
        self._kinds.append(False)

    def _flush(self) -> None:
        """Key the pending decode blocks (each owner has one at most: its chain state is
        known) and put them in their places in the stream."""
        pending = self._pending
        if not pending:
            return
        owners = [seq for _, seqs, _ in pending for seq in seqs]
        rows = [row for _, _, rows in pending for row in rows]
        c = contents(np.asarray(rows, dtype=np.uint32).ravel(), self.block_size)
        states = np.asarray([seq.state for seq in owners], dtype=np.uint64)
        keys, raw = step(states, c)
        for seq, key, state in zip(owners, keys, raw.tolist(), strict=True):
            seq.keys.append(key[None])
            seq.state = state
        start = 0
        for index, seqs, _ in pending:
            self._pieces[index] = self._sampled(keys[start : start + len(seqs)])
            start += len(seqs)
        pending.clear()
        self._pending_seqs.clear()  # cleared, not replaced: `decode` holds it

    def fork(self, parent_id: int, child_id: int) -> None:
        if parent_id in self._pending_seqs:
            self._flush()  # its keys and chain state, copied
        self._seqs[child_id] = self._seqs[parent_id].copy()
        self._admitted.add(child_id)

    def _registered(self, seq: _Seq) -> U64:
        keys = np.concatenate(seq.keys) if len(seq.keys) > 1 else seq.keys[0]
        if seq.scheduled < seq.prompt_len:
            return keys[: seq.scheduled // self.block_size]
        return keys

    def _release(self, seq: _Seq) -> None:
        # Released tail first: the head ends the most recent (touched last).
        self._touch(self._registered(seq)[::-1])

    def free(self, seq_id: int) -> None:
        if seq_id in self._pending_seqs:
            self._flush()  # its keys
        seq = self._seqs.pop(seq_id)
        if not seq.swapped:  # a swapped sequence released its GPU blocks at swap-out
            self._release(seq)

    def swap_out(self, seq_id: int) -> None:
        if seq_id in self._pending_seqs:
            self._flush()
        seq = self._seqs[seq_id]
        self._release(seq)
        seq.swapped = True

    def swap_in(self, seq_id: int) -> None:
        if seq_id in self._pending_seqs:
            self._flush()
        seq = self._seqs[seq_id]
        self._touch(self._registered(seq))
        seq.swapped = False

    # ---------------------------------------------------------------- the curve

    def curve(self) -> MissRatioCurve:
        """Replay the recorded events through exact stack distances."""
        self._flush()
        pieces, kinds = self._pieces, self._kinds
        rate = self.sample_rate
        everything = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint64)
        ids, num_keys = _dense_ids(everything)
        touches = sum(len(p) for p, k in zip(pieces, kinds, strict=True) if not k)
        stack = StackDistances(num_keys, touches)
        bounds = np.cumsum([0, *(len(p) for p in pieces)])
        thresholds: list[npt.NDArray[np.float64]] = []
        pending: list[npt.NDArray[np.int64]] = []
        for i, lookup in enumerate(kinds):
            piece = ids[bounds[i] : bounds[i + 1]]
            if not lookup:
                pending.append(piece)
                continue
            if pending:
                stack.touch(np.concatenate(pending))
                pending = []
            d = stack.lookup(piece).astype(np.float64)
            d[d == 0] = _NEVER  # never touched: a miss at every size
            reach = np.maximum.accumulate(d)
            thresholds.append(reach[np.isfinite(reach)] / rate)
        if pending:
            stack.touch(np.concatenate(pending))
        all_thresholds = np.sort(np.concatenate(thresholds)) if thresholds else np.zeros(0)
        return MissRatioCurve(
            block_size=self.block_size,
            sample_rate=rate,
            thresholds=all_thresholds,
            prompt_tokens=self.prompt_tokens,
            lookups=self.lookups,
            touches=touches,
            distinct_blocks=round(stack.distinct / rate),
        )


__all__ = ["MRCRecorder", "MissRatioCurve"]
