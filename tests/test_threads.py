"""Stress tests: many Python threads hammering one shared `BlockManager`.

Each thread owns its sequences (its own id range) and keeps a model of what each of them must
look like: tokens, salt, block table, swapped or not. All threads share a few system prompts,
so their sequences share cached blocks through the prefix index, and the pool is small, so
allocations run out (None) and are handled by freeing. Every call's answer is checked against
the thread's model as it happens; at the end the main thread checks the manager's own audit,
block conservation, and every surviving sequence against its thread's model.
"""

from __future__ import annotations

import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from pagedkv import (
    BlockManager,
    DuplicateSequenceError,
    SequenceNotSwappedError,
    SequenceSwappedError,
    UnknownSequenceError,
    hash_blocks,
)

B = 16
VOCAB = 50_000
NUM_THREADS = 8


@pytest.fixture(autouse=True)
def _fast_thread_switches() -> Iterator[None]:
    """Switch threads far more often than the default 5 ms, to interleave more."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


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
    "append": 14,
    "append_batch": 16,
    "fork": 5,
    "free": 8,
    "free_batch": 3,
    "swap_out": 5,
    "swap_in": 6,
    "queries": 6,
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

    def _resident(self) -> list[int]:
        return [s for s, e in self.mine.items() if not e.swapped]

    def _pick(self, resident: bool | None = None) -> int | None:
        if resident is None:
            ids = list(self.mine)
        elif resident:
            ids = self._resident()
        else:
            ids = [s for s, e in self.mine.items() if e.swapped]
        return self.rng.choice(ids) if ids else None

    def _tokens(self, k: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(k)]

    def _oom(self) -> None:
        """An allocation did not fit: preempt (free) one of our own sequences."""
        self.ooms += 1
        victim = self._pick()
        if victim is not None:
            self.m.free(victim)
            del self.mine[victim]

    def verify(self, sid: int) -> None:
        e = self.mine[sid]
        m = self.m
        assert m.num_tokens(sid) == len(e.tokens)
        assert m.is_swapped(sid) == e.swapped
        assert m.block_hashes(sid) == hash_blocks(e.tokens, B, cache_salt=e.salt)
        if not e.swapped:
            assert m.block_table(sid) == e.table

    def _check_writes(
        self, sid: int, old: list[int], n_old: int, k: int, pairs: set[tuple[int, int]]
    ) -> int:
        """Check a sequence's new table after appending k tokens; return its copy count."""
        new = self.m.block_table(sid)
        n_new = n_old + k
        assert len(new) == max(len(old), _cdiv(n_new, B))
        first_written = n_old // B
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
        salt = self.rng.choice([None, None, None, "tenant-a"])
        hit = self.m.allocate(sid, tokens, cache_salt=salt)
        if hit is None:
            assert sid not in self.m
            self._oom()
            return
        assert hit % B == 0
        assert 0 <= hit <= len(tokens) - 1
        table = self.m.block_table(sid)
        assert len(table) == _cdiv(len(tokens), B)
        self.mine[sid] = _Expect(tokens, salt, table)
        self.verify(sid)

    def op_append(self) -> None:
        sid = self._pick(resident=True)
        if sid is None:
            return
        e = self.mine[sid]
        k = self.rng.randint(1, 2 * B)
        new_tokens = self._tokens(k)
        old, n_old = list(e.table), len(e.tokens)
        pairs = self.m.append(sid, new_tokens)
        if pairs is None:
            assert self.m.block_table(sid) == old
            self._oom()
            return
        e.tokens += new_tokens
        copies = self._check_writes(sid, old, n_old, k, set(pairs))
        assert copies == len(pairs)
        self.verify(sid)

    def op_append_batch(self) -> None:
        resident = self._resident()
        if not resident:
            return
        ids = self.rng.sample(resident, min(len(resident), self.rng.randint(*self.batch)))
        toks = self._tokens(len(ids))
        olds = {s: (list(self.mine[s].table), len(self.mine[s].tokens)) for s in ids}
        out = self.m.append_batch(np.asarray(ids, dtype=np.int64), np.asarray(toks))
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
            self.mine[s].tokens.append(t)
            copies += self._check_writes(s, *olds[s], 1, pairs)
        assert copies == len(out)

    def op_fork(self) -> None:
        parent = self._pick(resident=True)
        if parent is None:
            return
        child = self._new_id()
        self.m.fork(parent, child)
        p = self.mine[parent]
        self.mine[child] = _Expect(list(p.tokens), p.salt, list(p.table))
        self.verify(child)
        self.verify(parent)

    def op_free(self) -> None:
        sid = self._pick()
        if sid is None:
            return
        self.m.free(sid)
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
        e.swapped, e.cpu_blocks, e.table = True, len(pairs), []
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
        slots = self.m.slot_mapping(arr, 1).tolist()
        for slot, s in zip(slots, ids, strict=True):
            e = self.mine[s]
            p = len(e.tokens) - 1
            assert slot == e.table[p // B] * B + p % B
        indptr, indices, last = self.m.flashinfer_page_table(arr)
        assert indptr[-1] == len(indices)
        for j, s in enumerate(ids):
            e = self.mine[s]
            pages = _cdiv(len(e.tokens), B)
            assert indices[indptr[j] : indptr[j + 1]].tolist() == e.table[:pages]
            assert last[j] == len(e.tokens) - (pages - 1) * B

    def op_stats(self) -> None:
        st = self.m.stats()
        assert st.num_blocks == self.m.num_blocks
        assert min(st.free_blocks, st.used_blocks, st.cached_blocks) >= 0
        for s in list(self.mine)[:3]:
            self.verify(s)

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


def _check_final_state(m: BlockManager, workers: list[_Worker]) -> None:
    m.check_invariants()
    st = m.stats()
    assert st.free_blocks + st.used_blocks + st.cached_blocks == m.num_blocks, st
    assert st.free_blocks == m.num_free_blocks
    assert st.cached_blocks == m.num_cached_blocks
    assert m.num_available_blocks == st.free_blocks + st.cached_blocks
    everything = {s: e for w in workers for s, e in w.mine.items()}
    assert len(m) == len(everything) == st.num_sequences
    owners: dict[int, object] = {}
    for sid, e in everything.items():
        assert sid in m
        assert m.num_tokens(sid) == len(e.tokens)
        assert m.is_swapped(sid) == e.swapped
        assert m.block_hashes(sid) == hash_blocks(e.tokens, B, cache_salt=e.salt)
        if e.swapped:
            continue
        assert m.block_table(sid) == e.table
        # A block held by several tables must hold the same content in all of them: the same
        # tokens up to its end, under the same salt (prefix sharing or fork, nothing else).
        # A full block's chain digest stands for its whole prefix.
        digests = hash_blocks(e.tokens, B, cache_salt=e.salt)
        for i, b in enumerate(e.table):
            content: object = (
                digests[i]
                if i < len(digests)
                else (e.salt, digests[-1] if digests else None, tuple(e.tokens[i * B :]))
            )
            assert owners.setdefault(b, content) == content, f"block {b} has two contents"
    assert st.used_blocks == len(owners), "used blocks are not exactly those in tables"
    cpu_used = sum(e.cpu_blocks for e in everything.values())
    assert m.num_free_cpu_blocks == st.num_cpu_blocks - cpu_used
    assert st.used_slots == sum(len(e.tokens) for e in everything.values() if not e.swapped)


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
    barrier) the manager's own audit and the independent audit from Python both run."""
    threads, rounds, ops = 16, 6, 250
    m = BlockManager(480, B, num_cpu_blocks=128)
    shared = _shared_prompts(11)
    workers = [_Worker(m, t, 11, shared, max_seqs=10) for t in range(threads)]
    audits = 0
    for _ in range(rounds):
        _run_threads(threads, lambda i: workers[i].run(ops))
        _check_final_state(m, workers)
        audits += 1
    st = m.stats()
    assert audits == rounds
    assert sum(w.ooms for w in workers) > 0, "the pool must run out"
    assert st.prefix_hits > 0 and st.evictions > 0 and st.cow_copies > 0, st
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
