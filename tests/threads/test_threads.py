"""Stress tests: many Python threads hammering one shared `BlockManager`.

Each thread owns its sequences (its own id range) and keeps a model of what each of them must
look like: tokens, scheduled tokens, hit blocks, salt, block table, swapped or not. All threads
share a few system prompts, so their sequences share cached blocks through the prefix index,
and the pool is small, so allocations run out (None) and are handled by freeing. The workers
use every mutating call: chunked allocation and `extend`, `append`/`append_batch` with
lookahead, `truncate`, `free` with `num_computed_tokens`, fork, swaps, and the read calls
(`lookup`, hit-aware `can_allocate`, `slot_mapping` and `flashinfer_page_table` with a
lookahead for all or one per sequence). Every call's answer is checked against the thread's
model as it happens; at quiescent points the main thread checks the manager's own audit,
block conservation, every surviving sequence against its thread's model and, where events
are on, the prefix index as an event mirror sees it.
"""

from __future__ import annotations

import random
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from pagedkv import (
    AllocStatus,
    BlockManager,
    BlockRemoved,
    BlockStored,
    DuplicateSequenceError,
    InvalidArgumentError,
    KVEvent,
    SequenceNotSwappedError,
    SequenceSwappedError,
    UnknownSequenceError,
    hash_blocks,
)

B = 16
VOCAB = 50_000
NUM_THREADS = 8


pytestmark = pytest.mark.usefixtures("fast_thread_switches")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Expect:
    """What one sequence must look like, as its owning thread knows it."""

    tokens: list[int]
    salt: str | None
    table: list[int]  # the GPU table (empty while swapped)
    swapped: bool = False
    cpu_blocks: int = 0
    sched: int = -1  # `num_scheduled_tokens` (-1: every token, filled in by __post_init__)
    hits: int = 0  # `h`: the leading blocks that came from the prefix cache
    # Leading blocks this sequence holds that are certainly hashed: hit blocks it pinned,
    # never dropped since (swap-out releases them, truncate can cut them off).
    pinned: int = 0

    def __post_init__(self) -> None:
        if self.sched < 0:
            self.sched = len(self.tokens)

    @property
    def complete(self) -> bool:
        """Every known token is scheduled (`append` is allowed)."""
        return self.sched == len(self.tokens)


def _run_threads(n: int, target: Callable[[int], None]) -> None:
    """Run `target(i)` on n threads started together; re-raise the first failure."""
    barrier = threading.Barrier(n)
    errors: list[str] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a worker thread hung"
    assert not errors, "\n".join(errors)


DEFAULT_WEIGHTS = {
    "allocate": 14,
    "extend": 6,
    "append": 14,
    "append_batch": 16,
    "truncate": 5,
    "fork": 5,
    "free": 8,
    "free_batch": 3,
    "swap_out": 5,
    "swap_in": 6,
    "queries": 6,
    "lookup": 4,
    "stats": 3,
}


class _Worker:
    """One thread's random walk over the API, checking every answer against its model."""

    def __init__(
        self,
        m: BlockManager,
        tid: int,
        seed: int,
        shared: list[list[int]],
        *,
        max_seqs: int = 14,
        batch: tuple[int, int] = (1, 8),
        long_prompts: float = 0.0,
        prefill: int = 0,
        weights: dict[str, int] | None = None,
    ) -> None:
        self.m = m
        self.max_seqs = max_seqs
        self.batch = batch
        self.long_prompts = long_prompts
        self.prefill = prefill
        self.weights = {**DEFAULT_WEIGHTS, **(weights or {})}
        self.tid = tid
        self.rng = random.Random(seed * 1000 + tid)
        self.shared = shared
        self.next_id = tid * 1_000_000
        self.mine: dict[int, _Expect] = {}
        self.ooms = 0

    # -- helpers ---------------------------------------------------------------------------
    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _resident(self, complete: bool = False) -> list[int]:
        """Resident sequences (only those whose prompt is fully scheduled if `complete`)."""
        return [s for s, e in self.mine.items() if not e.swapped and (e.complete or not complete)]

    def _pick(self, resident: bool | None = None, complete: bool = False) -> int | None:
        if resident is None:
            ids = list(self.mine)
        elif resident:
            ids = self._resident(complete)
        else:
            ids = [s for s, e in self.mine.items() if e.swapped]
        return self.rng.choice(ids) if ids else None

    def _tokens(self, k: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(k)]

    def _lookahead(self) -> int:
        return self.rng.choice([0, 0, 0, 1, 3, B + 2])

    def _computed(self, sid: int) -> int | None:
        """`num_computed_tokens` for a free: mostly the default, else any legal count."""
        n = len(self.mine[sid].tokens)
        return self.rng.choice([None, None, 0, self.rng.randint(0, n)])

    def _oom(self) -> None:
        """An allocation did not fit: preempt (free) one of our own sequences."""
        self.ooms += 1
        victim = self._pick()
        if victim is not None:
            self.m.free(victim, num_computed_tokens=self._computed(victim))
            del self.mine[victim]

    def verify(self, sid: int) -> None:
        e = self.mine[sid]
        m = self.m
        assert m.num_tokens(sid) == len(e.tokens)
        assert m.num_scheduled_tokens(sid) == e.sched
        assert 1 <= e.sched <= len(e.tokens)
        assert m.is_swapped(sid) == e.swapped
        assert m.block_hashes(sid) == hash_blocks(e.tokens, B, cache_salt=e.salt)
        if not e.swapped:
            assert m.block_table(sid) == e.table
            assert len(e.table) * B >= e.sched

    def _check_writes(
        self, sid: int, old: list[int], first_written: int, length: int, pairs: set[tuple[int, int]]
    ) -> int:
        """Check a sequence's new table after a write from table index `first_written` on
        that leaves it `length` entries long; return its copy count."""
        new = self.m.block_table(sid)
        assert len(new) == length
        copies = 0
        for i, (a, b) in enumerate(zip(old, new, strict=False)):
            if a != b:
                assert i >= first_written, "an already written block changed"
                assert (a, b) in pairs, "a block changed without a copy-on-write pair"
                copies += 1
        self.mine[sid].table = new
        return copies

    # -- operations ------------------------------------------------------------------------
    def op_allocate(self) -> None:
        sid = self._new_id()
        # Long prompts (>= 4096 tokens) make allocate release the GIL, so that the Rust core
        # really runs concurrently with the other threads.
        extra = 4200 if self.rng.random() < self.long_prompts else self.rng.randint(1, 3 * B)
        tokens = self.rng.choice(self.shared) + self._tokens(extra)
        n = len(tokens)
        salt = self.rng.choice([None, None, None, "tenant-a"])
        # Chunked prefill a third of the time: the hit plus a chunk, the rest by `extend`.
        chunk = self.rng.randint(1, n) if self.rng.random() < 0.35 else None
        la = self._lookahead() if self.rng.random() < 0.2 else 0
        hit = self.m.allocate(sid, tokens, cache_salt=salt, num_new_tokens=chunk, lookahead=la)
        if hit is None:
            assert sid not in self.m
            self._oom()
            return
        assert hit % B == 0
        assert 0 <= hit <= (n - 1) // B * B
        s = n if chunk is None else min(hit + chunk, n)
        table = self.m.block_table(sid)
        assert len(table) == _cdiv(s + la, B)
        h = hit // B
        self.mine[sid] = _Expect(tokens, salt, table, sched=s, hits=h, pinned=h)
        self.verify(sid)

    def op_extend(self) -> None:
        """Schedule the next chunk of a partly scheduled prompt, often to its end."""
        partial = [s for s, e in self.mine.items() if not e.swapped and not e.complete]
        if not partial:
            return
        sid = self.rng.choice(partial)
        e = self.mine[sid]
        to_the_end = self.rng.random() < 0.5
        while not e.complete:
            left = len(e.tokens) - e.sched
            k = left if to_the_end and self.rng.random() < 0.5 else self.rng.randint(1, left)
            la = self._lookahead() if self.rng.random() < 0.2 else 0
            old = list(e.table)
            pairs = self.m.extend(sid, k, lookahead=la)
            if pairs is None:
                assert self.m.block_table(sid) == old
                assert self.m.num_scheduled_tokens(sid) == e.sched
                self._oom()
                return
            length = max(len(old), _cdiv(e.sched + k + la, B))
            copies = self._check_writes(sid, old, e.sched // B, length, set(pairs))
            assert copies == len(pairs)
            e.sched += k
            self.verify(sid)
            if not to_the_end:
                return

    def op_append(self) -> None:
        if self.rng.random() < 0.1:  # a partly scheduled prompt refuses appends, unchanged
            partial = [s for s, e in self.mine.items() if not e.swapped and not e.complete]
            if partial:
                sid = self.rng.choice(partial)
                with pytest.raises(InvalidArgumentError):
                    self.m.append(sid, [1, 2])
                self.verify(sid)
                return
        sid = self._pick(resident=True, complete=True)
        if sid is None:
            return
        e = self.mine[sid]
        k = self.rng.randint(1, 2 * B)
        la = self._lookahead()
        new_tokens = self._tokens(k)
        old, n_old = list(e.table), len(e.tokens)
        pairs = self.m.append(sid, new_tokens, lookahead=la)
        if pairs is None:
            assert self.m.block_table(sid) == old
            self._oom()
            return
        e.tokens += new_tokens
        e.sched = len(e.tokens)
        length = max(len(old), _cdiv(n_old + k + la, B))
        copies = self._check_writes(sid, old, n_old // B, length, set(pairs))
        assert copies == len(pairs)
        self.verify(sid)

    def op_append_batch(self) -> None:
        resident = self._resident(complete=True)
        if not resident:
            return
        ids = self.rng.sample(resident, min(len(resident), self.rng.randint(*self.batch)))
        toks = self._tokens(len(ids))
        la = self._lookahead() if self.rng.random() < 0.3 else 0
        olds = {s: (list(self.mine[s].table), len(self.mine[s].tokens)) for s in ids}
        out = self.m.append_batch(np.asarray(ids, dtype=np.int64), np.asarray(toks), lookahead=la)
        if out is None:
            for s in ids:
                assert self.m.block_table(s) == olds[s][0]
            self._oom()
            return
        assert out.dtype == np.int32
        assert out.shape == (out.shape[0], 2)
        pairs = {(int(a), int(b)) for a, b in out}
        copies = 0
        for s, t in zip(ids, toks, strict=True):
            e = self.mine[s]
            e.tokens.append(t)
            e.sched = len(e.tokens)
            old, n_old = olds[s]
            length = max(len(old), _cdiv(n_old + 1 + la, B))
            copies += self._check_writes(s, old, n_old // B, length, pairs)
        assert copies == len(out)

    def op_truncate(self) -> None:
        """Roll back to a random point: into the prompt, onto a block boundary, into a full
        (possibly hashed and shared) block, or to the current end (gives back lookahead)."""
        sid = self._pick(resident=True)
        if sid is None:
            return
        e = self.mine[sid]
        n = len(e.tokens)
        choices = [self.rng.randint(1, n), n]
        if n > B:
            full = self.rng.randint(1, n // B)
            choices += [full * B, (full - 1) * B + self.rng.randint(1, B - 1)]
        m_ = self.rng.choice(choices)
        old = list(e.table)
        pairs = self.m.truncate(sid, m_)
        if pairs is None:  # only a copy of a shared hashed block can run out
            assert m_ % B != 0
            assert self.m.block_table(sid) == old
            assert self.m.num_tokens(sid) == n
            self._oom()
            return
        new = self.m.block_table(sid)
        keep = min(len(old), _cdiv(m_, B))
        assert len(new) == keep
        i = m_ // B
        changed = [j for j in range(keep) if new[j] != old[j]]
        if changed:
            assert changed == [i] and m_ % B != 0, (changed, m_)
            assert pairs == [(old[i], new[i])]
        else:
            assert pairs == []
        e.table = new
        del e.tokens[m_:]
        e.sched = min(e.sched, m_)
        e.hits = min(e.hits, i)
        e.pinned = min(e.pinned, i)
        self.verify(sid)

    def op_fork(self) -> None:
        parent = self._pick(resident=True)
        if parent is None:
            return
        child = self._new_id()
        self.m.fork(parent, child)
        p = self.mine[parent]
        self.mine[child] = _Expect(
            list(p.tokens), p.salt, list(p.table), sched=p.sched, hits=p.hits, pinned=p.pinned
        )
        self.verify(child)
        self.verify(parent)

    def op_free(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        self.m.free(sid, num_computed_tokens=self._computed(sid))
        del self.mine[sid]
        assert sid not in self.m

    def op_free_batch(self) -> None:
        ids = list(self.mine)
        if not ids:
            return
        chosen = self.rng.sample(ids, min(len(ids), self.rng.randint(1, 4)))
        self.m.free_batch(np.asarray(chosen, dtype=np.uint64))
        for s in chosen:
            del self.mine[s]
            assert s not in self.m

    def op_swap_out(self) -> None:
        sid = self._pick(resident=True)
        if sid is None:
            return
        e = self.mine[sid]
        pairs = self.m.swap_out(sid)
        if pairs is None:  # swap space full
            assert not self.m.is_swapped(sid)
            return
        assert [g for g, _ in pairs] == e.table
        assert len({c for _, c in pairs}) == len(pairs)
        e.swapped, e.cpu_blocks, e.table, e.pinned = True, len(pairs), [], 0
        self.verify(sid)

    def op_swap_in(self) -> None:
        sid = self._pick(resident=False)
        if sid is None:
            return
        e = self.mine[sid]
        pairs = self.m.swap_in(sid)
        if pairs is None:
            assert self.m.is_swapped(sid)
            self._oom()
            return
        assert len(pairs) == e.cpu_blocks
        e.swapped, e.cpu_blocks, e.table = False, 0, [g for _, g in pairs]
        self.verify(sid)

    def op_queries(self) -> None:
        resident = self._resident()
        if not resident:
            return
        ids = self.rng.sample(resident, min(len(resident), 6))
        arr = np.asarray(ids, dtype=np.int64)
        tables = self.m.block_tables(arr, pad=-7)
        width = max(len(self.mine[s].table) for s in ids)
        assert tables.shape == (len(ids), width)
        for row, s in zip(tables.tolist(), ids, strict=True):
            t = self.mine[s].table
            assert row == t + [-7] * (width - len(t))
        # The last scheduled token of each plus draft slots: as many as all have room for,
        # or (half the time) each its own number within its own room, as a list or array.
        rooms = [len(self.mine[s].table) * B - self.mine[s].sched for s in ids]
        las: list[int]
        if self.rng.random() < 0.5:
            la = self.rng.randint(0, min(min(rooms), 2 * B))
            las, arg = [la] * len(ids), la
        else:
            las = [self.rng.randint(0, min(r, 2 * B)) for r in rooms]
            arg = las if self.rng.random() < 0.5 else np.asarray(las, dtype=np.int32)
        slots = self.m.slot_mapping(arr, 1, lookahead=arg).tolist()
        assert len(slots) == len(ids) + sum(las)
        at = 0
        for s, la in zip(ids, las, strict=True):
            e = self.mine[s]
            for p in range(e.sched - 1, e.sched + la):
                assert slots[at] == e.table[p // B] * B + p % B
                at += 1
        indptr, indices, last = self.m.flashinfer_page_table(arr, lookahead=arg)
        assert indptr[-1] == len(indices)
        for j, (s, la) in enumerate(zip(ids, las, strict=True)):
            e = self.mine[s]
            pages = _cdiv(e.sched + la, B)
            assert indices[indptr[j] : indptr[j + 1]].tolist() == e.table[:pages]
            assert last[j] == e.sched + la - (pages - 1) * B

    def op_lookup(self) -> None:
        """`lookup` and hit-aware `can_allocate` on token ids. What others hold changes all
        the time, so only bounds are certain: the cap, and the blocks this thread pins."""
        m = self.m
        prompt = self.rng.choice(self.shared) + self._tokens(self.rng.randint(1, B))
        n = len(prompt)
        hits = m.lookup_many([prompt, prompt[: B + 1]])
        for got, length in zip(hits, (n, B + 1), strict=True):
            assert got % B == 0 and 0 <= got <= (length - 1) // B * B
        status = m.can_allocate(prompt, num_new_tokens=self.rng.randint(1, n))
        assert status in (AllocStatus.OK, AllocStatus.LATER)
        too_long = m.num_blocks * B + 1
        assert m.can_allocate(too_long) == AllocStatus.NEVER
        sid = self._pick(resident=True)
        if sid is None:
            return
        e = self.mine[sid]
        n = len(e.tokens)
        got = m.lookup(e.tokens, cache_salt=e.salt)
        cap = (n - 1) // B
        assert got % B == 0 and got <= cap * B
        # No lower bound from its own hits: a racing abort (free with num_computed_tokens)
        # withdraws the never-computed blocks it registered even while others hold them.
        assert m.can_allocate(e.tokens, cache_salt=e.salt) != AllocStatus.NEVER or (
            m.num_blocks - _cdiv(n, B) < int(0.01 * m.num_blocks)
        )

    def op_stats(self) -> None:
        st = self.m.stats()
        assert st.num_blocks == self.m.num_blocks
        # Under racing calls each tally is a value it had (docs/concurrency.md); the exact
        # sum is checked at quiescence (_check_final_state). But the blocks this thread's own
        # resident sequences hold are OWNED throughout this call (no other thread frees
        # them), so neither tally can ever have counted them.
        n = st.num_blocks
        mine = {b for s in self._resident() for b in self.mine[s].table}
        assert st.free_blocks <= n - len(mine) and st.cached_blocks <= n - len(mine), (st, mine)
        assert 0 <= st.recent_prefix_hits <= st.recent_prefix_queries <= st.prefix_queries
        assert min(st.registered_blocks, st.unregistered_blocks, st.truncated_blocks) >= 0
        for s in list(self.mine)[:3]:
            self.verify(s)

    def flood(self) -> None:
        """Oversubscribe the pool on purpose: allocate fresh, unshared prompts until one
        does not fit, then one-block prompts until one does not fit. Nothing is freed while
        flooding, so `available` only falls; a one-block prompt (no hit possible) fails only
        when `available` is 0, that is once every FREE and every CACHED block was taken."""
        for size in (3 * B, 1):
            while True:
                sid = self._new_id()
                tokens = self._tokens(self.rng.randint(1, size))
                hit = self.m.allocate(sid, tokens)
                if hit is None:
                    assert sid not in self.m
                    self.ooms += 1
                    break
                assert hit == 0
                self.mine[sid] = _Expect(tokens, None, self.m.block_table(sid))
                self.verify(sid)

    def run(self, num_ops: int) -> None:
        names = list(self.weights)
        fns: list[Callable[[], None]] = [getattr(self, f"op_{n}") for n in names]
        weights = [self.weights[n] for n in names]
        for _ in range(self.prefill):
            self.op_allocate()
        for _ in range(num_ops):
            if len(self.mine) > self.max_seqs:
                self.op_free()
            self.rng.choices(fns, weights)[0]()


def _shared_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n * B + rng.randrange(B))] for n in (1, 3, 6)]


class _Mirror:
    """The prefix index and the CPU copies as an external indexer sees them: drained events
    applied in order (only at quiescent points, so that no event is applied out of order)."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()  # digests findable on the GPU
        # digests some swapped sequence holds on the CPU: the CPU events are per key, the
        # first copy stores it and the last one to go removes it (docs/semantics.md)
        self.cpu: set[bytes] = set()

    def apply(self, events: list[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                (d,) = ev.block_hashes
                if ev.medium == "CPU":
                    assert d not in self.cpu, "a CPU key stored twice"
                    self.cpu.add(d)
                else:
                    assert d not in self.held, "a digest registered twice"
                    self.held.add(d)
            elif isinstance(ev, BlockRemoved):
                (d,) = ev.block_hashes
                if ev.medium == "CPU":
                    assert d in self.cpu, "a CPU key removed that was never stored"
                    self.cpu.discard(d)
                else:
                    assert d in self.held, "a digest removed that was not registered"
                    self.held.discard(d)
            else:
                self.held.clear()


def _longest_held_prefix(digests: list[bytes], held: set[bytes], cap: int) -> int:
    h = 0
    while h < min(cap, len(digests)) and digests[h] in held:
        h += 1
    return h


def _check_final_state(
    m: BlockManager, workers: list[_Worker], mirror: _Mirror | None = None
) -> None:
    m.check_invariants()
    st = m.stats()
    assert st.free_blocks + st.used_blocks + st.cached_blocks == m.num_blocks, st
    assert st.free_blocks == m.num_free_blocks
    assert st.cached_blocks == m.num_cached_blocks
    assert m.num_available_blocks == st.free_blocks + st.cached_blocks
    everything = {s: e for w in workers for s, e in w.mine.items()}
    assert len(m) == len(everything) == st.num_sequences
    owners: dict[int, tuple[object, tuple[int, ...]]] = {}
    for sid, e in everything.items():
        assert sid in m
        assert m.num_tokens(sid) == len(e.tokens)
        s = m.num_scheduled_tokens(sid)
        assert s == e.sched and 1 <= s <= len(e.tokens)
        assert m.is_swapped(sid) == e.swapped
        assert m.block_hashes(sid) == hash_blocks(e.tokens, B, cache_salt=e.salt)
        if e.swapped:
            continue
        assert m.block_table(sid) == e.table
        assert len(e.table) * B >= s, "a scheduled token without a block"
        assert e.hits * B <= s
        # A block held by several tables must hold the same content in all of them: the same
        # tokens before it (under the same salt: the chain digest of the block before it
        # stands for all of that) and, in it, tokens of which one holder's are a prefix of
        # the other's (prefix sharing or fork; a holder that truncated into an unhashed
        # shared block keeps sharing it until it writes there, which copies it first).
        digests = hash_blocks(e.tokens, B, cache_salt=e.salt)
        for i, b in enumerate(e.table):
            # (Past the tokens, a lookahead block holds nothing yet: only its index counts.)
            where = (i, e.salt, digests[i - 1] if 0 < i * B < len(e.tokens) else None)
            mine = tuple(e.tokens[i * B : (i + 1) * B])
            prev = owners.setdefault(b, (where, mine))
            assert prev[0] == where, f"block {b} is shared by different prefixes"
            short, long_ = sorted((prev[1], mine), key=len)
            assert long_[: len(short)] == short, f"block {b} has two contents"
            owners[b] = (where, long_)
    assert st.used_blocks == len(owners), "used blocks are not exactly those in tables"
    cpu_used = sum(e.cpu_blocks for e in everything.values())
    assert m.num_free_cpu_blocks == st.num_cpu_blocks - cpu_used
    assert st.used_slots == sum(e.sched for e in everything.values() if not e.swapped)
    assert st.reserved_slots == B * sum(len(e.table) for e in everything.values())
    if mirror is not None:
        _check_index(m, everything, mirror)


def _check_index(m: BlockManager, everything: dict[int, _Expect], mirror: _Mirror) -> None:
    """The prefix index, seen through the events, against the sequences (at quiescence).

    - `lookup` of every live prompt finds exactly the longest prefix the mirror holds;
    - one block per registered digest: the CACHED ones plus the OWNED hashed ones, and an
      OWNED hashed block sits only within its holders' scheduled full blocks, so at most
      |held & digests of scheduled full blocks| of the registered digests can be OWNED;
    - the pinned hit blocks are OWNED and hashed (at least that many OWNED hashed);
    - the CPU copies are exactly the scheduled full blocks of the swapped sequences."""
    mirror.apply(m.drain_events())
    held = mirror.held
    scheduled_full: set[bytes] = set()
    pinned_blocks: set[int] = set()
    cpu: Counter[bytes] = Counter()
    for sid, e in everything.items():
        digests = m.block_hashes(sid)
        n = len(e.tokens)
        got = m.lookup(e.tokens, cache_salt=e.salt)
        assert got == _longest_held_prefix(digests, held, (n - 1) // B) * B, (sid, got)
        if e.swapped:
            cpu.update(digests[: e.sched // B])
            continue
        scheduled_full.update(digests[: e.sched // B])
        # (A pinned hit may have been withdrawn by a racing abort of its registrar.)
        pinned_blocks.update(e.table[: e.pinned])
    owned_hashed = len(held) - m.num_cached_blocks
    assert owned_hashed <= len(held & scheduled_full), (
        f"{owned_hashed} owned hashed blocks; {len(pinned_blocks)} pinned hits, "
        f"{len(held & scheduled_full)} registered digests of scheduled full blocks"
    )
    assert mirror.cpu == set(cpu), "CPU keys differ from the swapped sequences' scheduled blocks"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_many_threads_one_manager(seed: int) -> None:
    m = BlockManager(320, B, num_cpu_blocks=96)
    shared = _shared_prompts(seed)
    workers = [_Worker(m, t, seed, shared) for t in range(NUM_THREADS)]
    _run_threads(NUM_THREADS, lambda i: workers[i].run(1200))
    _check_final_state(m, workers)
    # The pool was small enough to run out, and prefixes were shared across threads.
    assert sum(w.ooms for w in workers) > 0
    assert m.stats().prefix_hits > 0
    # Tear everything down concurrently: nothing may be lost.

    def teardown(i: int) -> None:
        if workers[i].mine:
            m.free_batch(np.asarray(list(workers[i].mine), dtype=np.int64))

    _run_threads(NUM_THREADS, teardown)
    for w in workers:
        w.mine.clear()
    _check_final_state(m, workers)
    st = m.stats()
    assert st.used_blocks == 0
    assert st.free_cpu_blocks == st.num_cpu_blocks
    assert m.reset_prefix_cache()
    assert m.num_free_blocks == m.num_blocks


def test_many_threads_with_the_gil_released() -> None:
    """Big batches (>= 64 ids) and long prompts: the calls run in Rust without the GIL."""
    m = BlockManager(2600, B, num_cpu_blocks=400)
    shared = _shared_prompts(7)
    # Mostly batch decode over 64+ of each thread's sequences, few frees.
    weights = {"allocate": 20, "append": 4, "append_batch": 30, "free": 3, "swap_out": 2}
    workers = [
        _Worker(
            m,
            t,
            7,
            shared,
            max_seqs=100,
            batch=(64, 100),
            long_prompts=0.03,
            prefill=70,
            weights=weights,
        )
        for t in range(NUM_THREADS)
    ]
    _run_threads(NUM_THREADS, lambda i: workers[i].run(500))
    _check_final_state(m, workers)
    assert sum(w.ooms for w in workers) > 0


ISSUE9_WEIGHTS = {"allocate": 16, "extend": 10, "truncate": 10, "lookup": 8, "free": 10}


def test_threads_with_an_event_audited_index_and_an_aborting_teardown() -> None:
    """8 threads use every call (weighted towards chunked prefill, extend, truncate and
    retraction) with events on; after each round the independent audit also checks the
    prefix index through an event mirror. Then every thread aborts its sequences at once:
    `free(sid, num_computed_tokens=0)`. What that may and must withdraw is determined by the
    state before it (docs/semantics.md, `free`):

    - nothing is registered by a free, and a CACHED block is never withdrawn;
    - a withdrawn digest belonged to a block at a non-hit scheduled full index
      (`h <= i < s // B`) of some holder, and each counts once in `unregistered_blocks`;
    - a block that every holder got as a prefix hit stays findable (their hits cover it);
    - an OWNED hashed block survives only if its last holder had it as a hit, so at most
      |registered digests at hit indices| of them survive;
    - afterwards `lookup` of every aborted prompt finds exactly what the mirror holds.
    """
    threads, rounds, ops = NUM_THREADS, 5, 500
    m = BlockManager(320, B, num_cpu_blocks=96, enable_kv_events=True)
    mirror = _Mirror()
    shared = _shared_prompts(21)
    workers = [
        _Worker(m, t, 21, shared, max_seqs=12, weights=ISSUE9_WEIGHTS) for t in range(threads)
    ]
    for _ in range(rounds):
        _run_threads(threads, lambda i: workers[i].run(ops))
        _check_final_state(m, workers, mirror)
    st = m.stats()
    assert st.truncated_blocks > 0 and st.unregistered_blocks > 0, st
    assert st.cow_copies > 0 and st.evictions > 0 and st.prefix_hits > 0, st

    # The state before the abort (quiescent, mirror in sync).
    everything = {s: e for w in workers for s, e in w.mine.items()}
    held_before = set(mirror.held)
    cached_before = m.num_cached_blocks
    unregistered_before = st.unregistered_blocks
    non_hit: set[bytes] = set()
    at_hit: set[bytes] = set()
    holders: dict[int, list[bool]] = {}  # block -> per holder: is it a pinned hit there?
    block_digest: dict[int, bytes] = {}
    prompts = []
    for sid, e in everything.items():
        digests = m.block_hashes(sid)
        prompts.append((e.tokens, e.salt))
        if e.swapped:
            continue
        at_hit.update(digests[: e.hits])
        non_hit.update(digests[e.hits : e.sched // B])
        for i, b in enumerate(e.table[: len(digests)]):
            holders.setdefault(b, []).append(i < e.pinned)
            block_digest[b] = digests[i]
    must_stay = {block_digest[b] for b, hit in holders.items() if all(hit)}
    assert must_stay <= held_before

    def abort(i: int) -> None:
        for sid in list(workers[i].mine):
            m.free(sid, num_computed_tokens=0)
            del workers[i].mine[sid]

    _run_threads(threads, abort)
    _check_final_state(m, workers, mirror)
    st = m.stats()
    held = mirror.held
    withdrawn = held_before - held
    assert held <= held_before, "a free registered something"
    assert st.used_blocks == 0 and st.free_cpu_blocks == st.num_cpu_blocks, st
    assert not mirror.cpu
    assert m.num_cached_blocks == len(held)
    assert st.unregistered_blocks - unregistered_before == len(withdrawn)
    assert withdrawn <= non_hit, "withdrew a block that was no holder's registration"
    assert must_stay <= held, "withdrew a block that every holder got as a hit"
    assert len(held) - cached_before <= len(at_hit & held_before)
    print(f"abort: {len(withdrawn)} withdrawn, {len(must_stay)} must stay, {len(held)} held")
    for tokens, salt in prompts:
        digests = hash_blocks(tokens, B, cache_salt=salt)
        want = _longest_held_prefix(digests, held, (len(tokens) - 1) // B) * B
        assert m.lookup(tokens, cache_salt=salt) == want
    assert m.reset_prefix_cache()
    mirror.apply(m.drain_events())
    assert not mirror.held and m.num_free_blocks == m.num_blocks


def test_aborted_chunked_prefill_racing_full_allocations_and_lookups() -> None:
    """One thread keeps allocating a prompt P with a chunk (sometimes extending it) and
    aborting it (`free(num_computed_tokens=0)`); threads F allocate P's first K blocks fully
    (plus their own tail) and free normally; threads L `lookup` P, `lookup_many` and
    `can_allocate` it. F's prompts leave P after K blocks, so P's blocks past K are only
    ever scheduled by the aborting thread, which holds them alone when it aborts: each must
    be withdrawn, never served later.

    Checked as it happens: the aborting thread's own hits never pass K blocks (its earlier
    registrations there are gone); a lookup never hits more blocks than some call has
    scheduled (each allocation publishes an upper bound of what it schedules before it
    starts). At the end: lookup(P) <= K blocks, the event mirror equals the index (a
    digest withdrawn twice or left behind would show), invariants hold, and withdrawals
    happened (`unregistered_blocks` > 0)."""
    k_blocks, extra = 4, 6 * B + 5
    rng = random.Random(31)
    p = [rng.randrange(VOCAB) for _ in range(k_blocks * B + extra)]
    n = len(p)
    m = BlockManager(600, B, enable_kv_events=True)
    bound = [k_blocks]  # most blocks of P any call has scheduled (an upper bound)
    iters, fulls, lookups = 2000, 2, 2
    past_k = [0]  # lookups that saw the aborting thread's live registrations past K
    errors: list[str] = []

    def aborter() -> None:
        r = random.Random(1)
        for j in range(iters):
            sid = 1 + j
            chunk = n if j == 0 else r.randint(1, n)
            bound[0] = max(bound[0], (k_blocks * B + chunk) // B)  # h <= K (asserted below)
            hit = m.allocate(sid, p, num_new_tokens=chunk)
            assert hit is not None, "the pool is large enough"
            if hit > k_blocks * B:
                errors.append(f"iteration {j}: hit {hit // B} blocks, withdrawn ones among them")
            s = min(hit + chunk, n)
            if s < n and r.random() < 0.5:
                more = r.randint(1, n - s)
                bound[0] = max(bound[0], (s + more) // B)
                assert m.extend(sid, more) is not None
            m.free(sid, num_computed_tokens=0)

    def full(t: int) -> None:
        r = random.Random(100 + t)
        for j in range(iters):
            sid = 10_000 * (t + 1) + j
            tokens = p[: k_blocks * B] + [r.randrange(VOCAB) for _ in range(r.randint(1, 2 * B))]
            hit = m.allocate(sid, tokens)
            assert hit is not None and hit <= k_blocks * B
            m.free(sid)

    def looker() -> None:
        for _ in range(iters):
            got = m.lookup(p)
            seen = bound[0]  # read after the lookup: covers every call that started before
            if got // B > seen:
                errors.append(f"lookup hit {got // B} blocks; no call scheduled more than {seen}")
            past_k[0] += got > k_blocks * B
            a, b = m.lookup_many([p, p[: 2 * B + 1]])
            assert a % B == 0 and b <= 2 * B
            assert m.can_allocate(p, num_new_tokens=B) == AllocStatus.OK

    targets: list[Callable[[], None]] = [aborter]
    targets += [lambda t=t: full(t) for t in range(fulls)]
    targets += [looker] * lookups
    _run_threads(len(targets), lambda i: targets[i]())
    assert not errors, errors[:5]
    m.check_invariants()
    st = m.stats()
    print(f"abort race: {past_k[0]} lookups saw live registrations past K, {st}")
    assert len(m) == 0 and st.used_blocks == 0
    assert st.unregistered_blocks > 0, st
    mirror = _Mirror()
    mirror.apply(m.drain_events())
    assert m.num_cached_blocks == len(mirror.held)
    digests = hash_blocks(p, B)
    assert not set(digests[k_blocks:]) & mirror.held, "a withdrawn block of P is still cached"
    want = _longest_held_prefix(digests, mirror.held, (n - 1) // B)
    assert m.lookup(p) == want * B <= k_blocks * B


def test_threads_racing_for_the_last_blocks() -> None:
    """Concurrent allocations never hand out more blocks than exist."""
    num_blocks = 200
    m = BlockManager(num_blocks, B, enable_prefix_caching=False)
    wins = [0] * NUM_THREADS

    def grab(t: int) -> None:
        for j in range(60):
            if m.allocate(t * 1000 + j, [t, j]) is not None:  # one block each
                wins[t] += 1

    _run_threads(NUM_THREADS, grab)
    assert sum(wins) == num_blocks
    assert m.num_free_blocks == 0
    m.check_invariants()


@pytest.mark.parametrize("op", ["allocate", "fork", "free"])
def test_two_threads_racing_on_one_id(op: str) -> None:
    """Two threads, one id: exactly one call wins, the other gets the documented error."""
    m = BlockManager(4096, B)
    m.allocate(0, list(range(40)))
    rounds = 150
    barrier = threading.Barrier(2)
    outcomes: list[list[str]] = [[], []]

    def call(sid: int) -> Any:
        if op == "allocate":
            return m.allocate(sid, list(range(100, 140)))
        if op == "fork":
            return m.fork(0, sid)
        return m.free(sid)

    def racer(t: int) -> None:
        for r in range(1, rounds + 1):
            barrier.wait()
            try:
                call(r)
                outcomes[t].append("ok")
            except DuplicateSequenceError:
                outcomes[t].append("duplicate")
            except UnknownSequenceError:
                outcomes[t].append("unknown")
            barrier.wait()
            if t == 0:  # set up the next round while the other thread waits
                if op == "free":
                    m.allocate(r + 1, [1, 2, 3])
                else:
                    m.free(r)
            barrier.wait()

    if op == "free":
        m.allocate(1, [1, 2, 3])
    _run_threads(2, racer)
    loser = {"allocate": "duplicate", "fork": "duplicate", "free": "unknown"}[op]
    for r in range(rounds):
        assert sorted([outcomes[0][r], outcomes[1][r]]) == sorted(["ok", loser]), r
    if op == "free":
        m.free(rounds + 1)
    assert len(m) == 1
    m.check_invariants()


# ------------------------------------------------------------------ 16 threads, audited rounds


def test_sixteen_threads_in_audited_rounds() -> None:
    """16 threads, 6 rounds of 250 random operations each; between rounds (all threads at a
    barrier) the manager's own audit and the independent audit from Python both run. Then a
    last round in which every thread oversubscribes the pool."""
    threads, rounds, ops = 16, 6, 250
    m = BlockManager(480, B, num_cpu_blocks=128)
    shared = _shared_prompts(11)
    workers = [_Worker(m, t, 11, shared, max_seqs=10) for t in range(threads)]
    audits = 0
    for _ in range(rounds):
        _run_threads(threads, lambda i: workers[i].run(ops))
        _check_final_state(m, workers)
        audits += 1
    # Whether the random rounds run out of blocks depends on thread timing (they did not,
    # about 1 run in 7 on 2 cores: the threads that happened to run held few blocks), so
    # the pool running out, and evicting, is made certain by a last, deliberate round: one
    # cached block at least (a fresh prompt, allocated and freed here), then all 16 threads
    # allocate fresh prompts at once, without freeing, until the pool is exhausted. Every
    # thread ends on an allocation that did not fit, racing the others for the last blocks,
    # and the cached block must have been evicted on the way.
    fresh = 900_000_000
    while m.allocate(fresh, list(range(B + 1))) is None:  # make room: free a random sequence
        w = next(w for w in workers if w.mine)
        sid = next(iter(w.mine))
        m.free(sid)
        del w.mine[sid]
    m.free(fresh)
    assert m.num_cached_blocks > 0
    evictions = m.stats().evictions
    ooms = sum(w.ooms for w in workers)
    _run_threads(threads, lambda i: workers[i].flood())
    _check_final_state(m, workers)
    audits += 1
    st = m.stats()
    assert audits == rounds + 1
    assert sum(w.ooms for w in workers) >= ooms + threads, "the pool must run out"
    assert m.num_available_blocks == 0
    assert st.evictions > evictions, st
    assert st.prefix_hits > 0 and st.cow_copies > 0, st
    assert st.swapped_out_blocks > 0 and st.swapped_in_blocks > 0, st


# ------------------------------------------------------------------ many threads, same sequences


def test_threads_on_the_same_sequences_get_results_or_clear_errors() -> None:
    """8 threads hammer the same 6 sequence ids with every operation. Each call returns a
    correct result or raises a documented error (unknown, duplicate, swapped); afterwards
    every surviving table is intact: its digests are those of its tokens, which are the
    prompt followed by appended 7s (every thread appends the same token), so a torn or lost
    append would show."""
    m = BlockManager(200, B, num_cpu_blocks=64)
    prompt = list(range(1000, 1000 + 2 * B + 3))
    ids = list(range(6))
    documented = (
        UnknownSequenceError,
        DuplicateSequenceError,
        SequenceSwappedError,
        SequenceNotSwappedError,
    )
    counts = [0, 0]  # results, documented errors

    def hammer(t: int) -> None:
        rng = random.Random(t)
        ok = errors = 0
        for _ in range(600):
            sid = rng.choice(ids)
            op = rng.randrange(8)
            try:
                if op == 0:
                    m.allocate(sid, prompt)
                elif op == 1:
                    m.append(sid, [7] * rng.randint(1, 5))
                elif op == 2:
                    m.append_batch([sid, (sid + 1) % 6], [7, 7])
                elif op == 3:
                    m.fork(sid, rng.choice(ids))
                elif op == 4:
                    m.free(sid)
                elif op == 5:
                    m.swap_out(sid)
                elif op == 6:
                    m.swap_in(sid)
                else:
                    m.block_tables([sid]), m.slot_mapping([sid], 1)
                ok += 1
            except documented:
                errors += 1
        counts[0] += ok
        counts[1] += errors

    _run_threads(8, hammer)
    m.check_invariants()
    assert counts[0] > 500 and counts[1] > 500, counts
    for sid in ids:
        if sid not in m:
            continue
        n = m.num_tokens(sid)
        tokens = prompt + [7] * (n - len(prompt))
        assert m.block_hashes(sid) == hash_blocks(tokens, B), f"sequence {sid} is torn"
        if not m.is_swapped(sid):
            assert len(m.block_table(sid)) >= _cdiv(n, B)
    m.free_batch([s for s in ids if s in m])
    m.check_invariants()
    assert m.stats().used_blocks == 0


# ------------------------------------------------------------------ the GIL is released


@pytest.mark.parametrize(
    "call",
    [
        "append_batch",
        "free_batch",
        "allocate_long",
        "block_tables",
        "slot_mapping",
        "flashinfer_page_table",
        "single_call_waiting_on_a_batch",
    ],
)
def test_a_python_thread_runs_during_a_long_batch_call(call: str) -> None:
    """While one thread is inside a long batch call, a thread spinning in Python keeps
    running: the call released the GIL. With the GIL held, the spinner could not take a
    single step in the middle of the call. The last case: single-sequence calls that wait
    for a sequence lock held by a long batch call wait without the GIL."""
    import time

    n = 200_000
    m = BlockManager(4 * n + 400_000, B, enable_prefix_caching=call == "allocate_long")
    ids = np.arange(n, dtype=np.int64)
    if call != "allocate_long":
        for s in range(n):
            # Full blocks, so each append needs a new one; four of them, so the tables are
            # wide enough for the read calls to take a few milliseconds.
            m.allocate(s, [s & 0xFFFF, 1, 2, 3] * 16)
    long_prompt = np.arange(B * 300_000, dtype=np.uint32)

    def single_calls_during_a_batch() -> None:
        done = threading.Event()

        def batch() -> None:
            assert m.append_batch(ids, np.ones(n, dtype=np.int64)) is not None
            done.set()

        t = threading.Thread(target=batch)
        t.start()
        calls = 0
        while not done.is_set():
            m.num_tokens(n - 1 - calls % 1000)
            calls += 1
        t.join()

    def work() -> None:
        if call == "append_batch":
            assert m.append_batch(ids, np.ones(n, dtype=np.int64)) is not None
        elif call == "free_batch":
            m.free_batch(ids)
        elif call == "block_tables":
            assert m.block_tables(ids).shape == (n, 4)
        elif call == "slot_mapping":
            assert len(m.slot_mapping(ids, np.full(n, 16))) == 16 * n
        elif call == "flashinfer_page_table":
            assert len(m.flashinfer_page_table(ids)[1]) == 4 * n
        elif call == "single_call_waiting_on_a_batch":
            single_calls_during_a_batch()
        else:
            assert m.allocate(10**9, long_prompt) == 0

    stamps: list[float] = []
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            stamps.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        while len(stamps) < 1000:
            time.sleep(0.001)
        t0 = time.perf_counter()
        work()
        t1 = time.perf_counter()
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(old)
    d = t1 - t0
    middle = [s for s in stamps if t0 + 0.25 * d <= s <= t0 + 0.75 * d]
    assert d > 0.005, f"the call took only {d * 1e3:.1f} ms: too short to show anything"
    assert len(middle) > 10, f"the spinner made {len(middle)} steps in a {d * 1e3:.0f} ms call"
    m.check_invariants()
