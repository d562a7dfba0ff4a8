"""Which blocks below the GPU a prompt can be served from: the manager's own hybrid hit
rule (docs/semantics.md, "The hybrid prefix hit") over the blocks the GPU hit holds and the
blocks the tiers hold (docs/tiers.md, "Promotion").

A hit of `L` blocks needs, in group `g`, blocks `first_needed(g, L) .. L - 1`: every block of
a full-attention group, only the window's last blocks of a sliding-window group, the
current chunk's blocks of a chunked-local group (none at a chunk boundary), block `L - 1` of
a state group. The blocks of the GPU hit are held by the GPU; the others must be held by
some tier. `hybrid_hit` finds the largest `L` every group can serve as the manager finds it
(its Rust `hybrid_hit`; the tests check it against the reference model's).

`find_held` asks the stores which blocks they hold: a full group's leading run with
`count_present` (one round trip per store, as a prefix match), another group's blocks one
by one (`present_each` where a store has it, one pipelined round trip on Redis), first only
the blocks a hit of the full groups' length needs (the common case), then the rest when one
of those is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.groups import KVCacheGroup
from pagedkv.tiers.base import TierKey, TierStore

#: A manager without `groups=`: one full-attention group.
PLAIN = (KVCacheGroup("full"),)


def first_needed(group: KVCacheGroup, length: int, block_size: int) -> int:
    """The first block a hit of `length` blocks needs in `group` (the ones before it are
    skipped at position `length * block_size`)."""
    return min(length, group.skipped_tokens(length * block_size) // block_size)


def hybrid_hit(
    groups: Sequence[KVCacheGroup],
    block_size: int,
    cap: int,
    present: Callable[[int, int], bool],
    known: int = 0,
) -> int:
    """The largest `L <= cap` (blocks) every group can serve, where `present(g, i)` says
    whether block `i` of group `g` is held (asked only from block `known` on: the blocks
    before it are held in every group, a GPU hit's). Full groups need their leading run;
    each other group then lowers `L` to the largest length it serves, in turn, until none
    lowers it."""
    length = cap
    known = min(known, cap)
    for g, group in enumerate(groups):
        if group.kind == "full":
            length = next((i for i in range(known, length) if not present(g, i)), length)
    # runs[g][i]: how many consecutive held blocks end at block i (the other groups').
    runs: list[list[int] | None] = []
    for g, group in enumerate(groups):
        if group.kind == "full":
            runs.append(None)
            continue
        run = list(range(1, min(known, length) + 1))
        for i in range(len(run), length):
            run.append((run[-1] if run else 0) + 1 if present(g, i) else 0)
        runs.append(run)
    while True:
        before = length
        for group, run_g in zip(groups, runs, strict=True):
            if run_g is None:
                continue
            while length > 0:
                need = length - first_needed(group, length, block_size)
                if need == 0 or run_g[length - 1] >= need:
                    break
                length -= 1
        if length == before:
            return length


def present_each(store: TierStore, keys: Sequence[TierKey]) -> list[bool]:
    """Whether `store` holds each key (`store.present_each` where it has one, else a
    `count_present` of each key)."""
    each = getattr(store, "present_each", None)
    if each is not None:
        out: list[bool] = each(keys)
        return out
    return [store.count_present([k]) == 1 for k in keys]


def _first_tier(stores: Sequence[TierStore], keys: list[TierKey]) -> list[int]:
    """For each key, the first store that holds it, or -1."""
    out = [-1] * len(keys)
    for t, store in enumerate(stores):
        ask = [j for j, x in enumerate(out) if x < 0]
        if not ask:
            break
        for j, held in zip(ask, present_each(store, [keys[j] for j in ask]), strict=True):
            if held:
                out[j] = t
    return out


def _leading(stores: Sequence[TierStore], keys: list[TierKey]) -> list[int]:
    """The first store of each key of the longest run some store holds from the first key:
    the stores' runs as a running maximum hand out consecutive ranges of keys."""
    out: list[int] = []
    for t, store in enumerate(stores):
        n = store.count_present(keys)
        if n > len(out):
            out += [t] * (n - len(out))
    return out


def find_held(
    stores: Sequence[TierStore],
    groups: Sequence[KVCacheGroup],
    digests: Sequence[bytes],
    lo: int,
    cap: int,
    block_size: int,
) -> list[list[int]]:
    """`held[g][i - lo]`: the first store holding block `i` of group `g`, for `lo <= i <
    cap` (the blocks past the GPU hit `lo`), or -1 where no store holds it or it cannot
    matter (past a full group's run)."""
    make = tuple.__new__  # TierKey at C speed: a key per block of every prompt
    held = [[-1] * max(cap - lo, 0) for _ in groups]
    end = cap
    for g, group in enumerate(groups):
        if group.kind == "full" and end > lo:
            run = _leading(stores, [make(TierKey, (g, d)) for d in digests[lo:end]])
            held[g][: len(run)] = run
            end = lo + len(run)
    for g, group in enumerate(groups):
        if group.kind == "full" or end <= lo:
            continue
        # The blocks a hit of `end` needs, then, if one is missing, the rest (a shorter hit
        # needs earlier ones).
        a = max(lo, first_needed(group, end, block_size))
        for span in (range(a, end), range(lo, a)):
            src = _first_tier(stores, [make(TierKey, (g, digests[i])) for i in span])
            for i, t in zip(span, src, strict=True):
                held[g][i - lo] = t
            if all(t >= 0 for t in src):
                break
    return held


def shares(
    block_size: int, num_stores: int, h: int, end: int, needed: Sequence[tuple[int, int, int]]
) -> list[int]:
    """Tokens of blocks `h .. end` per store: a position counts for the store of its first
    entry in `needed` (`(position, group, store)`); one no group needs an entry of (a chunk
    boundary's) for the first store."""
    out = [0] * num_stores
    last, counted = -1, 0
    for i, _, t in needed:
        if i != last and h <= i < end:
            out[t] += block_size
            last, counted = i, counted + 1
    out[0] += (end - h - counted) * block_size if end > h else 0
    return out


@dataclass(frozen=True, slots=True)
class Match:
    """A prompt's look-up: the groups and block size, the GPU hit (blocks), the digests, the
    cap of a hit (blocks) and `held[g][i - gpu]`, the store that holds block `i` of group `g`
    (-1: none; `find_held`)."""

    kinds: Sequence[KVCacheGroup]
    block_size: int
    gpu: int
    digests: list[bytes]
    cap: int
    held: list[list[int]]

    def hit(self, h: int, cap: int) -> int:
        """The longest hit (blocks, `<= cap`) the hybrid rule finds over the blocks of a GPU
        hit of `h` and the blocks the stores hold past the look-up's GPU hit."""
        lo, held = self.gpu, self.held
        if all(k.kind == "full" for k in self.kinds):  # the leading runs, at C speed
            if h < lo or h >= cap:
                return min(h, cap)
            ends = []
            for row in held:
                try:
                    ends.append(lo + row.index(-1, h - lo, cap - lo))
                except ValueError:
                    ends.append(cap)
            return min(ends)

        def present(g: int, i: int) -> bool:
            return i < h or (lo <= i < lo + len(held[g]) and held[g][i - lo] >= 0)

        return hybrid_hit(self.kinds, self.block_size, cap, present, known=h)

    def needed(self, h: int, end: int) -> list[tuple[int, int, int]]:
        """`(position, group, store)` of each block a hit of `end` needs past a GPU hit of
        `h`, in table order (position by position, then group by group)."""
        firsts = [first_needed(k, end, self.block_size) for k in self.kinds]
        lo, held = self.gpu, self.held
        return [
            (i, x, held[x][i - lo]) for i in range(h, end) for x, a in enumerate(firsts) if i >= a
        ]

    def shares(
        self, num_stores: int, h: int, end: int, needed: Sequence[tuple[int, int, int]]
    ) -> list[int]:
        return shares(self.block_size, num_stores, h, end, needed)


__all__ = [
    "PLAIN",
    "Match",
    "find_held",
    "first_needed",
    "hybrid_hit",
    "present_each",
    "shares",
]
