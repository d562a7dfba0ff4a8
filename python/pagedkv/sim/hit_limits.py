"""Which KV-cache group limited a hybrid model's prefix hits (`simulate --model`).

A hybrid manager serves the longest prefix that every group can serve (vLLM's coordinator):
a full-attention group needs every block of the prefix, a sliding-window group only the
blocks of its last `window` tokens, a chunked-local group those of the current chunk, a
state group the block at the boundary. Each group keeps its own blocks and loses them on its
own: a window group releases the blocks that leave its window while the sequence runs, so
they are evicted first, and a prompt whose prefix the full-attention group still holds may
find a hole in a window group's window; the hit then stops where that group can serve.

`HitLimitProbe` wraps the model run's manager (built with `enable_kv_events`) and, before
each `allocate`, brings a copy of what every group has cached up to date from the
manager's KV events (stored and removed digests, by group). After the call it takes the
prompt's digests (`block_hashes`) and works out, on that copy, the longest prefix the
full-attention groups had cached (`full_hits`) and, for every other group on its own, the
longest it could serve within that (`cut` is the difference, per group); the hit the
groups serve together is computed with the manager's rule and must equal the manager's
answer (`disagreements` counts the allocations where it did not, which would mean the copy
is wrong: the figures then say so). Only the workload's prompts count (a sequence allocated
again after a preemption, or a fork's child allocated after one, is left out, as in the
headline hit rate).

Draining the events and the look-ups run inside the timed `allocate`, so the model run's
manager time includes them (`seconds` says how much). They are not free: building the event
objects (each stored block's token ids included) and the look-ups about triple the model
run's CPU time on the default workload (about 1.2 s to about 4 s for gemma-3-27b); the
all-full run and the equal-hits runs are not probed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.groups import KVCacheGroup


def serves(group: KVCacheGroup, run_end: list[int], length: int, block_size: int) -> bool:
    """Whether a group whose consecutive present blocks ending at block `i` number
    `run_end[i]` can serve a prefix of `length` blocks."""
    first = min(group.skipped_tokens(length * block_size) // block_size, length)
    need = length - first
    return need == 0 or run_end[length - 1] >= need


def longest_served(group: KVCacheGroup, run_end: list[int], cap: int, block_size: int) -> int:
    """The longest prefix up to `cap` blocks the group serves (0 always is)."""
    return next((n for n in range(cap, 0, -1) if serves(group, run_end, n, block_size)), 0)


def runs_of(present: Sequence[bool]) -> list[int]:
    """`run_end[i]`: how many consecutive present blocks end at block `i`."""
    out: list[int] = []
    for i, p in enumerate(present):
        out.append((out[i - 1] if i else 0) + 1 if p else 0)
    return out


class HitLimitProbe:
    """The model run's manager, with every `allocate` looked into (see the module docstring);
    every other attribute is the manager's."""

    def __init__(self, manager: Any, groups: Sequence[KVCacheGroup]) -> None:
        self.manager = manager
        self.groups = tuple(groups)
        self.block_size: int = manager.block_size
        # per group, digest -> blocks registered under it (a digest can be stored twice)
        self.cached: list[dict[bytes, int]] = [{} for _ in self.groups]
        self.seen: set[int] = set()
        self.prompt_tokens = 0  # the workload's prompt tokens allocated (recomputes left out)
        self.hit_tokens = 0  # their hits, as the manager gave them
        self.full_hit_tokens = 0  # what the full-attention groups alone had cached
        self.cut_tokens = [0] * len(self.groups)  # per group: full hits it could not serve
        self.disagreements = 0
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.manager, name)

    def _catch_up(self) -> None:
        cached = self.cached
        for e in self.manager.drain_events():
            kind = type(e)
            if kind is BlockStored:
                c = cached[e.group_idx]
                for d in e.block_hashes:
                    c[d] = c.get(d, 0) + 1
            elif kind is BlockRemoved:
                c = cached[e.group_idx]
                for d in e.block_hashes:
                    n = c.pop(d, 0)
                    if n > 1:
                        c[d] = n - 1
            elif kind is AllBlocksCleared:
                for c in cached:
                    c.clear()

    def fork(self, parent_id: int, child_id: int, **kwargs: Any) -> None:
        # A fork's blocks are its parent's: a later allocate of the child is a recompute.
        self.manager.fork(parent_id, child_id, **kwargs)
        self.seen.add(child_id)

    def allocate(self, seq_id: int, token_ids: Any, **kwargs: Any) -> int | None:
        t0 = time.perf_counter()
        self._catch_up()
        t1 = time.perf_counter()
        out: int | None = self.manager.allocate(seq_id, token_ids, **kwargs)
        t2 = time.perf_counter()
        if out is not None and seq_id not in self.seen:
            self.seen.add(seq_id)
            self._look(seq_id, len(token_ids), out, kwargs.get("max_hit_tokens"))
        self.seconds += (t1 - t0) + (time.perf_counter() - t2)
        return out

    def _look(self, seq_id: int, n: int, hit: int, max_hit_tokens: int | None) -> None:
        bs = self.block_size
        digests = self.manager.block_hashes(seq_id)
        cap = min((n - 1) // bs, len(digests))
        if max_hit_tokens is not None:
            cap = min(cap, max_hit_tokens // bs)
        runs = [runs_of([d in c for d in digests[:cap]]) for c in self.cached]
        full = cap
        for g, group in enumerate(self.groups):
            if group.kind == "full":
                full = min(full, runs[g].index(0) if 0 in runs[g] else cap)
        own = [
            full if group.kind == "full" else longest_served(group, runs[g], full, bs)
            for g, group in enumerate(self.groups)
        ]
        # The groups together (the manager's fixed point): lower until every group serves.
        together = min(own)
        while together and not all(
            serves(group, runs[g], together, bs) for g, group in enumerate(self.groups)
        ):
            together -= 1
        if together * bs != hit:
            self.disagreements += 1
        self.prompt_tokens += n
        self.hit_tokens += hit
        self.full_hit_tokens += full * bs
        for g, blocks in enumerate(own):
            self.cut_tokens[g] += (full - blocks) * bs

    def figures(self) -> dict[str, Any]:
        """The probe's totals for the `--model` section (token counts, per group)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "full_hit_tokens": self.full_hit_tokens,
            "cut_tokens": list(self.cut_tokens),
            "disagreements": self.disagreements,
            "seconds": self.seconds,
        }


__all__ = ["HitLimitProbe", "longest_served", "runs_of", "serves"]
