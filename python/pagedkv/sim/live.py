"""Sizing from a live engine (`simulate --record ENDPOINT`): a hit-rate curve from KV events.

An engine publishing KV events on vLLM's wire (vLLM's own publisher, or pagedkv's
`kv_events.Publisher`) says which blocks it stored (computed and registered) and which it
evicted, never which it hit. `LiveTrace` turns the stream into the block accesses it implies,
as AWS's kvtrace does with the same events:

- every stored block is an access; a block stored again after it left the cache is one a
  larger cache would have served;
- a `BlockStored` whose parent is not the last block of the stream's previous event for
  that chain (an "open end": a sequence continuing its own prefill or decode) began a new
  request that hit the parent's chain: the parent and its ancestors (as far as the stream
  showed them) are accesses too, hits in the engine.

The accesses run through an LRU stack (`sim.stack`, Mattson's algorithm): a block is served
by a cache of `C` blocks when its stack distance is at most `C`, and, as a prefix cache
keeps a block only with its parent, only when every block before it in its chain is too
(the running maximum of the distances along each event's chain). That gives the hit rate of
every size at once, in blocks of the engine's block size.

Limits, stated in the output (measured per workload in
`benches/results/issue35-record.md`): a request whose prompt was all cached and that stored no
block (a short answer) leaves no event, so its hits are not seen; a request that extends the
last block another request stored (a chat's next turn) looks like that request continuing
(its hits are missed); a fork (parallel samples, beams) decoding into a block of its own
looks like a new request hitting the whole prompt (hits counted that the engine shared by
forking); blocks cached before the recording are known from
a snapshot (pagedkv's publisher, with its replay socket), else only as the parent of a block
stored after it starts, without their ancestors (a chain of one block: a lower bound; and a
sequence already running when the recording starts looks like such a hit once); only the
GPU medium and the first group count.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv.sim.stack import StackDistances

_FAR = np.iinfo(np.int64).max  # a distance no cache reaches: a block never seen before


def _kind(e: Any) -> str:
    """Stored, Removed or Cleared, for the decoded wire structs of either form."""
    return type(e).__name__.lstrip("_").replace("Array", "")


def _counts(e: Any) -> bool:
    """The event is about the GPU cache of the first group (the one a prefix hit starts in)."""
    return e.medium in (None, "GPU") and not (getattr(e, "group_idx", None) or 0)


@dataclass(slots=True)
class LiveTrace:
    """The accesses a stream of decoded KV events implies (module docstring)."""

    block_size: int | None = None
    batches: int = 0
    stored_blocks: int = 0
    restored_blocks: int = 0  # stored again after they were evicted
    hit_blocks: int = 0  # inferred: a new request's chain
    removed_blocks: int = 0
    resident: set[Any] = field(default_factory=set)
    peak_resident: int = 0
    parent: dict[Any, Any] = field(default_factory=dict)
    open_ends: set[Any] = field(default_factory=set)
    removed: set[Any] = field(default_factory=set)  # evicted and not stored since
    ids: dict[Any, int] = field(default_factory=dict)
    # Per stored event, its chain's block ids and whether they count as accesses (a
    # snapshot's blocks are touched, resident before the recording, and do not count).
    stream: list[tuple[npt.NDArray[np.int64], bool]] = field(default_factory=list)

    def _id(self, h: Any) -> int:
        i = self.ids.get(h)
        if i is None:
            i = self.ids[h] = len(self.ids)
        return i

    def seed(self, blocks: dict[Any, Any], order: list[Any]) -> None:
        """The cache as a snapshot shows it (a `BlockSet`'s blocks, parents first): the
        resident blocks from now on, touched but not counted as accesses."""
        resident = []
        for key in order:
            if key[0] not in (None, "GPU") or key[1]:
                continue
            h = key[2]
            self.parent[h] = blocks[key].parent
            resident.append(h)
        self.removed |= self.resident - set(resident)
        self.resident = set(resident)
        self.open_ends.clear()
        self.stream.append((np.fromiter(map(self._id, resident), dtype=np.int64), False))
        self.peak_resident = max(self.peak_resident, len(self.resident))

    def apply(self, events: list[Any]) -> None:
        """One batch of decoded wire events, in order."""
        self.batches += 1
        for e in events:
            kind = _kind(e)
            if kind == "Stored":
                if _counts(e):
                    self._stored(e)
            elif kind == "Removed":
                if _counts(e):
                    for h in e.block_hashes:
                        if h in self.resident:
                            self.resident.discard(h)
                            self.removed.add(h)
                            self.removed_blocks += 1
                        self.open_ends.discard(h)
            else:  # AllBlocksCleared
                self.removed |= self.resident
                self.removed_blocks += len(self.resident)
                self.resident.clear()
                self.open_ends.clear()

    def _stored(self, e: Any) -> None:
        self.block_size = self.block_size or e.block_size
        parent, hashes = e.parent_block_hash, list(e.block_hashes)
        chain: list[Any] = []
        if parent is not None and parent in self.open_ends:
            self.open_ends.discard(parent)  # the same sequence goes on
        elif parent is not None:
            if parent not in self.resident and parent not in self.removed:
                # Cached before the recording, and no snapshot showed it: known from now
                # on, without its ancestors (its chain counts one block: a lower bound).
                self.parent.setdefault(parent, None)
                self.resident.add(parent)
            # A new request hit the chain ending at `parent`: walk it back to its root.
            h: Any = parent
            seen = set()
            while h is not None and h in self.resident and h not in seen:
                seen.add(h)
                chain.append(h)
                h = self.parent.get(h)
            chain.reverse()
            self.hit_blocks += len(chain)
        p = parent
        for h in hashes:
            self.parent[h] = p
            p = h
            if h in self.removed:
                self.removed.discard(h)
                self.restored_blocks += 1
            self.resident.add(h)
        self.stored_blocks += len(hashes)
        if hashes:
            self.open_ends.add(hashes[-1])
        self.peak_resident = max(self.peak_resident, len(self.resident))
        ids = np.fromiter((self._id(h) for h in chain + hashes), dtype=np.int64)
        self.stream.append((ids, True))

    @property
    def accesses(self) -> int:
        return self.hit_blocks + self.stored_blocks

    def distances(self) -> npt.NDArray[np.int64]:
        """Per access, the smallest LRU cache (in blocks) that serves it with its whole
        chain before it; `_FAR` for a block seen for the first time."""
        touches = sum(len(ids) for ids, _ in self.stream)
        stack = StackDistances(max(len(self.ids), 1), max(touches, 1))
        out = []
        for ids, counted in self.stream:
            if counted:
                d = stack.lookup(ids)
                d[d == 0] = _FAR
                out.append(np.maximum.accumulate(d))
            stack.touch(ids)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class LiveCurve:
    """Hit rates (of block accesses) at sizes in blocks."""

    accesses: int
    sorted_distances: npt.NDArray[np.int64]  # the finite ones, ascending

    @classmethod
    def of(cls, trace: LiveTrace) -> LiveCurve:
        d = trace.distances()
        return cls(len(d), np.sort(d[d != _FAR]))

    def hit_rate(self, blocks: int) -> float:
        if not self.accesses:
            return 0.0
        return int(np.searchsorted(self.sorted_distances, blocks, side="right")) / self.accesses

    @property
    def unbounded(self) -> float:
        """The hit rate of a cache that never evicts."""
        return len(self.sorted_distances) / self.accesses if self.accesses else 0.0

    def smallest(self, rate: float) -> int | None:
        """The fewest blocks that reach hit rate `rate`; None if no size does."""
        need = int(np.ceil(rate * self.accesses - 1e-9))
        if need > len(self.sorted_distances):
            return None
        return 0 if need <= 0 else int(self.sorted_distances[need - 1])


def record(
    endpoint: str,
    seconds: float,
    *,
    replay_endpoint: str | None = None,
    topic: str = "",
    until: Callable[[LiveTrace], bool] | None = None,
    trace: LiveTrace | None = None,
) -> tuple[LiveTrace, dict[str, int]]:
    """Follow `endpoint` for `seconds` (or until `until(trace)` is true, or Ctrl-C) and
    return what it implied (into `trace` when given, which another thread may watch), with
    the subscriber's counts (gaps, lost batches, snapshots, restarts), whether Ctrl-C ended
    it (`interrupted`) and the milliseconds it followed (`elapsed_ms`)."""
    from pagedkv.kv_events.subscriber import Subscriber  # pyzmq, msgspec

    if not seconds > 0:
        raise ValueError(f"--record-seconds must be > 0, got {seconds}")
    trace = LiveTrace() if trace is None else trace

    class _Recording(Subscriber):
        """The reference subscriber (gaps replayed, snapshots at start), telling `trace`."""

        def _snapshot_commit(self) -> None:
            super()._snapshot_commit()  # cached before we came: resident, no accesses
            assert trace is not None
            trace.seed(self.blocks.blocks, list(self.blocks.ordered()))

        def _clear(self) -> None:
            super()._clear()  # a restarted engine: its cache starts empty
            assert trace is not None
            trace.seed({}, [])

    live = trace
    sub = _Recording(
        endpoint, replay_endpoint, topic=topic, on_batch=lambda _seq, ev: live.apply(ev)
    )
    started = time.monotonic()
    interrupted = False
    try:
        deadline = started + seconds
        while time.monotonic() < deadline and not (until is not None and until(trace)):
            sub.poll(0.05)
    except KeyboardInterrupt:  # Ctrl-C ends the recording early: size what it saw
        interrupted = True
    finally:
        sub.close()
    counts = {"gaps": sub.gaps, "lost": sub.lost, "snapshots": sub.snapshots}
    elapsed_ms = int(1000 * (time.monotonic() - started))
    return trace, {
        **counts,
        "restarts": sub.restarts,
        "interrupted": int(interrupted),
        "elapsed_ms": elapsed_ms,
    }


__all__ = ["LiveCurve", "LiveTrace", "record"]
