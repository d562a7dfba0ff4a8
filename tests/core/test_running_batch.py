"""`RunningBatch`: a decode batch kept across steps.

Its `step` must be exactly `append_batch` of the members plus `slot_mapping` of the new tokens:
a random model-based run drives a Rust batch, the reference model's batch, and a twin Rust
manager driven by `append_batch`/`slot_mapping`, and compares everything observable after
every operation. Bad input and stale members raise and change nothing; threads racing steps
against frees and forks leave every step whole or undone.
"""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import pagedkv
from audited import audited
from pagedkv import (
    InvalidArgumentError,
    KVCacheGroup,
    SequenceSwappedError,
    UnknownSequenceError,
)
from pagedkv_reference import ReferenceBlockManager

Manager = Any


@pytest.fixture(params=["reference", "rust"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Manager]]:
    impl = pagedkv.BlockManager if request.param == "rust" else ReferenceBlockManager
    yield from audited(impl, block_size=4)


def observe(m: Manager, ids: list[int]) -> dict[str, Any]:
    """Everything observable about `ids` and the pool."""
    seqs = {}
    for s in ids:
        if s in m:
            seqs[s] = (
                m.num_tokens(s),
                m.is_swapped(s),
                None if m.is_swapped(s) else m.block_table(s),
            )
    st = m.stats()
    return {
        "seqs": seqs,
        "free": m.num_free_blocks,
        "cached": m.num_cached_blocks,
        "stats": (st.used_slots, st.reserved_slots, st.num_sequences),
    }


def test_step_appends_and_returns_the_new_slots(make: Callable[..., Manager]) -> None:
    m = make(32)
    m.allocate(1, list(range(6)))
    m.allocate(2, list(range(100, 104)))
    b = m.running_batch([1, 2])
    assert b.seq_ids == [1, 2] and len(b) == 2
    out = b.step([7, 8])
    assert out is not None
    slots, pairs = out
    assert slots.dtype == np.int64 and pairs.dtype == np.int32 and pairs.shape == (0, 2)
    assert slots.tolist() == m.slot_mapping([1, 2], 1).tolist()
    assert (m.num_tokens(1), m.num_tokens(2)) == (7, 5)
    # Sequence 2 filled its only block, so its token opened a new one.
    assert len(m.block_table(2)) == 2 and slots[1] == m.block_table(2)[1] * 4


def test_a_forked_member_copies_its_shared_last_block(make: Callable[..., Manager]) -> None:
    m = make(32)
    m.allocate(1, list(range(6)))
    m.fork(1, 2)
    b = m.running_batch([1])
    out = b.step([9])
    assert out is not None
    slots, pairs = out
    ((src, dst),) = pairs.tolist()
    assert src == m.block_table(2)[1] and dst == m.block_table(1)[1] != src
    assert slots.tolist() == [dst * 4 + 2]


def test_bad_input_and_stale_members_raise_and_change_nothing(
    make: Callable[..., Manager],
) -> None:
    m = make(32, num_cpu_blocks=8)
    for s in range(4):
        m.allocate(s, list(range(10 * s, 10 * s + 5)))
    m.swap_out(3)
    b = m.running_batch([0, 1])
    before = observe(m, [0, 1, 2, 3])
    cases: list[tuple[Callable[[], Any], type[Exception], str]] = [
        (lambda: b.add([2, 2]), InvalidArgumentError, "duplicate sequence id 2"),
        (lambda: b.add([2, 1]), InvalidArgumentError, "already in the running batch"),
        (lambda: b.add([2, 9]), UnknownSequenceError, "9"),
        (lambda: b.add([2, 3]), SequenceSwappedError, "3"),
        (lambda: b.remove([0, 2]), InvalidArgumentError, "not in the running batch"),
        (lambda: b.remove([0, 0]), InvalidArgumentError, "duplicate sequence id 0"),
        (lambda: b.step([1]), InvalidArgumentError, "token_ids has 1 entries"),
        (lambda: b.step([1, -1]), InvalidArgumentError, "token_ids"),
        (lambda: b.step([1, 1 << 32]), InvalidArgumentError, "token_ids"),
        (lambda: m.running_batch([0, 0]), InvalidArgumentError, "duplicate sequence id 0"),
    ]
    for call, err, text in cases:
        with pytest.raises(err, match=text):
            call()
        assert b.seq_ids == [0, 1]
        assert observe(m, [0, 1, 2, 3]) == before
    # A member swapped out or freed elsewhere fails the step, which changes nothing.
    m.swap_out(1)
    with pytest.raises(SequenceSwappedError, match="1"):
        b.step([5, 6])
    m.swap_in(1)
    m.free(1)
    m.allocate(1, [1, 2, 3])  # the id again, but not the member
    snap = observe(m, [0, 1])
    with pytest.raises(UnknownSequenceError, match="1"):
        b.step([5, 6])
    assert observe(m, [0, 1]) == snap
    b.remove([1])
    assert b.step([5]) is not None and m.num_tokens(0) == 6 and m.num_tokens(1) == 3


def test_a_step_that_does_not_fit_returns_none_and_changes_nothing(
    make: Callable[..., Manager],
) -> None:
    m = make(5, enable_prefix_caching=False)
    m.allocate(0, list(range(8)))  # two full blocks
    m.allocate(1, list(range(8)))
    b = m.running_batch([0, 1])
    m.allocate(2, list(range(3)))  # the last free block
    before = observe(m, [0, 1, 2])
    assert b.step([1, 2]) is None
    assert observe(m, [0, 1, 2]) == before
    m.free(2)
    assert b.step([1, 2]) is None  # two new blocks, one free
    b.remove([1])
    assert b.step([1]) is not None


def test_an_unscheduled_prompt_is_refused(make: Callable[..., Manager]) -> None:
    m = make(16)
    m.allocate(0, list(range(10)), num_new_tokens=4)
    b = m.running_batch([0])
    with pytest.raises(InvalidArgumentError, match="not yet scheduled"):
        b.step([1])
    assert m.num_tokens(0) == 10


HYBRID = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=8), KVCacheGroup("state")]


@pytest.mark.parametrize("seed", range(3))
def test_grouped_step_is_append_batch_plus_every_groups_slots(make, seed: int) -> None:
    """With groups a step is `append_batch` plus each group's `slot_mapping` of the new
    tokens, one row per group: a batch and a twin manager driven by the plain calls stay
    equal through window releases, evictions, copy-on-write of forks and refusals."""
    rng = random.Random(seed)
    m = make(40, groups=HYBRID)
    twin = make(40, groups=HYBRID)
    ids = []
    for sid in range(4):
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        if m.allocate(sid, prompt) is not None:
            assert twin.allocate(sid, prompt) is not None
            ids.append(sid)
    m.fork(ids[0], 9)
    twin.fork(ids[0], 9)
    ids.append(9)
    batch = m.running_batch(ids)
    refused = 0
    for _ in range(40):
        toks = [rng.randrange(3) for _ in ids]
        out = batch.step(toks)
        pairs = twin.append_batch(ids, toks)
        if out is None:
            assert pairs is None
            refused += 1
            victim = ids.pop()
            batch.remove([victim])
            m.free(victim)
            twin.free(victim)
            continue
        slots, cow = out
        assert pairs is not None and cow.tolist() == pairs.tolist()
        assert slots.shape == (len(HYBRID), len(ids))
        for g in range(len(HYBRID)):
            assert slots[g].tolist() == twin.slot_mapping(ids, 1, group=g).tolist()
            for sid in ids:
                assert m.block_table(sid, group=g) == twin.block_table(sid, group=g)
        assert m.stats() == twin.stats()
    assert m.stats().cow_copies > 0
    assert refused > 0 or m.stats().evictions > 0


def test_a_single_full_group_steps_with_a_row_per_group(make) -> None:
    m = make(16, groups=[KVCacheGroup("full")])
    m.allocate(0, [1, 2, 3])
    slots, _ = m.running_batch([0]).step([4])
    assert slots.shape == (1, 1) and slots.tolist() == [[m.block_table(0)[0] * 4 + 3]]


def test_an_empty_batch_steps_to_nothing(make: Callable[..., Manager]) -> None:
    m = make(8)
    out = m.running_batch().step([])
    assert out is not None
    assert out[0].tolist() == [] and out[1].shape == (0, 2)


@pytest.mark.parametrize("seed", range(6))
def test_model_based_against_the_reference_and_append_batch(seed: int) -> None:
    assert {"ok", "err"} <= model_run(seed)


def model_run(seed: int) -> set[str]:
    """Random admissions, steps, forks, swaps, frees, removals and stale members on three
    managers: the Rust batch, the reference batch, and Rust `append_batch` + `slot_mapping`
    of the same ids. All three must agree on every result, error and observation."""
    rng = random.Random(seed)
    kw: dict[str, Any] = {"num_cpu_blocks": 16}
    rust = pagedkv.BlockManager(20, 4, **kw)
    ref = ReferenceBlockManager(20, 4, **kw)
    twin = pagedkv.BlockManager(20, 4, **kw)
    batches = [rust.running_batch(), ref.running_batch()]
    members: list[int] = []  # the twin's idea of the batch
    stale: set[int] = set()  # members freed elsewhere (the batch still names them)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 13))] for _ in range(3)]
    next_id = 0

    def both(call: Callable[[Any], Any]) -> Any:
        """`call` on every manager's side: the same result or the same error type."""
        outs: list[Any] = []
        for side in (0, 1, 2):
            try:
                outs.append(("ok", call(side)))
            except pagedkv.PagedKVError as e:
                outs.append(("err", type(e)))
        assert outs[0][0] == outs[1][0] == outs[2][0], outs
        if outs[0][0] == "err":
            assert outs[0][1] == outs[1][1] == outs[2][1], outs
        return outs

    mgrs = [rust, ref, twin]

    def on_managers(name: str, *args: Any) -> Any:
        return both(lambda i: getattr(mgrs[i], name)(*args))

    def on_batches(name: str, ids: list[int]) -> Any:
        """A batch call on both batches; the twin has no batch (nothing to do)."""
        return both(lambda i: getattr(batches[i], name)(ids) if i < 2 else None)

    def twin_step(toks: list[int]) -> Any:
        for s in members:  # the per-member state errors, in batch order
            if s in stale:
                raise UnknownSequenceError(str(s))
            if twin.is_swapped(s):
                raise SequenceSwappedError(str(s))
        pairs = twin.append_batch(members, toks)
        if pairs is None:
            return None
        slots = twin.slot_mapping(members, 1).tolist() if members else []
        return slots, pairs.tolist()

    def batch_step(i: int, toks: list[int]) -> Any:
        if i == 2:
            return twin_step(toks)
        out = batches[i].step(toks)
        return None if out is None else (out[0].tolist(), out[1].tolist())

    seen: set[str] = set()
    for _ in range(300):
        op = rng.random()
        live = [s for s in range(next_id) if s in rust]
        if op < 0.2:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(6))]
            sid = next_id
            next_id += 1
            if on_managers("allocate", sid, prompt)[0][1] is not None:
                on_batches("add", [sid])
                members.append(sid)
        elif op < 0.6:
            toks = [rng.randrange(50) for _ in members]
            outs = both(lambda i, toks=toks: batch_step(i, toks))
            assert outs[0] == outs[1] == outs[2]
            kind, res = outs[0]
            if kind == "err":
                seen.add("err")
            else:
                seen.add("none" if res is None else "cow" if res[1] else "ok")
        elif op < 0.7 and live:
            on_managers("fork", rng.choice(live), next_id)
            next_id += 1
        elif op < 0.75 and live:
            s = rng.choice(live)
            on_managers("swap_in" if rust.is_swapped(s) else "swap_out", s)
        elif op < 0.85 and members:
            s = rng.choice(members)
            on_batches("remove", [s])
            members.remove(s)
            stale.discard(s)
            if s in rust and rng.random() < 0.8:
                on_managers("free", s)
        elif live:
            s = rng.choice(live)
            on_managers("free", s)
            if s in members:
                stale.add(s)
        assert batches[0].seq_ids == batches[1].seq_ids == members
        ids = list(range(next_id))
        assert observe(rust, ids) == observe(ref, ids) == observe(twin, ids)
    for m in mgrs:
        m.check_invariants()
    return seen


def test_the_model_based_runs_reach_copies_and_full_pools() -> None:
    seen: set[str] = set()
    for seed in range(6):
        seen |= model_run(seed)
    assert seen == {"ok", "cow", "err", "none"}, seen


def test_steps_racing_frees_and_forks_are_whole_or_undone() -> None:
    """Threads: one steps a batch while others free members, fork them and free the forks.
    Frees land only while a step runs (the stepper observes under `quiet`, which the freer
    takes), so each observation brackets one step: it appended to every member still live or,
    having raised, to none."""
    m = pagedkv.BlockManager(1 << 15, 16)  # room for every step the bound allows
    n = 64
    rng = np.random.default_rng(3)
    for s in range(n):
        m.allocate(s, rng.integers(0, 1000, 40 + s).tolist())
    b = m.running_batch(range(n))
    quiet = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    outcomes = {"ok": 0, "raised": 0}

    def stepper() -> None:
        try:
            # Until enough steps lost a race to a free (each a check that a failed step
            # appended nothing), within a bound.
            for _ in range(4_000):
                if outcomes["raised"] >= 5 and outcomes["ok"] >= 100:
                    break
                with quiet:
                    ids = b.seq_ids
                    before = {s: m.num_tokens(s) for s in ids if s in m}
                try:
                    out = b.step(np.full(len(ids), 5, dtype=np.uint32))
                except UnknownSequenceError as e:
                    outcomes["raised"] += 1
                    with quiet:
                        after = {s: m.num_tokens(s) for s in before if s in m}
                        assert after == {s: before[s] for s in after}, "a failed step appended"
                        b.remove([s for s in ids if s not in m])
                    assert str(e).startswith("unknown sequence id")
                    continue
                assert out is not None
                outcomes["ok"] += 1
                with quiet:
                    live = [s for s in ids if s in m]
                    assert all(m.num_tokens(s) == before[s] + 1 for s in live)
                    pos = {s: i for i, s in enumerate(ids)}
                    slots = m.slot_mapping(live, 1).tolist()
                    assert slots == [int(out[0][pos[s]]) for s in live]
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            stop.set()

    def freer() -> None:
        r = random.Random(1)
        while not stop.is_set():
            s = r.randrange(n)
            with quiet:
                if s in m and r.random() < 0.5:
                    m.free(s)
            stop.wait(0.001)

    def forker() -> None:
        r = random.Random(2)
        child = 10_000
        while not stop.is_set():
            try:
                m.fork(r.randrange(n), child)
            except UnknownSequenceError:
                continue
            m.free(child)
            child += 1

    threads = [threading.Thread(target=f) for f in (stepper, freer, forker)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # small steps keep the GIL: let the freer in between them
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert outcomes["raised"] >= 5 and outcomes["ok"] >= 100, outcomes
    m.check_invariants()
