"""`record_evictions=True` and `evicted=`: each block-taking call reports the cached blocks IT
evicted, to its own caller (docs/semantics.md, "Evictions of a call"), for both
implementations, with and without KV-cache groups. There is no global log to drain."""

from __future__ import annotations

import functools
import random
from typing import Any

import pytest

from pagedkv import BlockManager, BlockRemoved, InvalidArgumentError, KVCacheGroup
from pagedkv.errors import InvalidArgumentTypeError, UnknownSequenceError
from pagedkv_reference import ReferenceBlockManager

GROUPS = [KVCacheGroup("full"), KVCacheGroup("sliding_window", window=8)]
IMPLS = {
    "rust": BlockManager,
    "reference": ReferenceBlockManager,
    "rust-groups": functools.partial(BlockManager, groups=GROUPS),
    "reference-groups": functools.partial(ReferenceBlockManager, groups=GROUPS),
}


def _sizes(impl: str) -> tuple[int, int]:
    """Pool blocks, and a second prompt length that needs every block once the first
    prompt's blocks are cached."""
    return (15, 28) if impl.endswith("groups") else (8, 32)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_each_eviction_is_reported_to_the_call_that_made_it(impl: str) -> None:
    num_blocks, second = _sizes(impl)
    m = IMPLS[impl](num_blocks, 4, record_evictions=True, enable_kv_events=True)
    assert m.record_evictions
    first: list[Any] = []
    m.allocate(0, list(range(9)), evicted=first)  # full blocks cached at free
    assert first == [], "a pool with free blocks evicts nothing"
    cached = {g: m.block_table(0, group=g)[:2] for g in range(len(m.stats().groups) or 1)}
    digests = m.block_hashes(0)
    m.free(0)
    m.drain_events()
    log: list[Any] = []
    taken = m.allocate(1, list(range(100, 100 + second)), evicted=log)
    assert taken == 0
    removed = [e for e in m.drain_events() if isinstance(e, BlockRemoved)]
    assert [(g, d) for _, g, d in log] == [(e.group_idx, e.block_hashes[0]) for e in removed]
    assert {(g, b) for b, g, _ in log} == {(g, b) for g, t in cached.items() for b in t}
    assert all(isinstance(d, bytes) and d in digests for _, _, d in log)
    # (With groups the new owner may be another group: the pool's blocks are shared.)
    held = {b for g in cached for b in m.block_table(1, group=g)}
    assert {b for b, _, _ in log} <= held, "each evicted block belongs to the caller"
    assert m.stats().evictions == len(log)


@pytest.mark.parametrize("impl", list(IMPLS))
def test_a_call_that_does_not_fit_or_fails_evicts_nothing(impl: str) -> None:
    num_blocks, _ = _sizes(impl)
    m = IMPLS[impl](num_blocks, 4, record_evictions=True)
    m.allocate(0, list(range(9)))
    m.free(0)
    before = m.num_cached_blocks
    too_big: list[Any] = [("kept",)]
    assert m.allocate(1, list(range(100, 101 + 4 * num_blocks)), evicted=too_big) is None
    assert too_big == [("kept",)], "None: nothing appended (the list is only appended to)"
    failed: list[Any] = []
    with pytest.raises(UnknownSequenceError):
        m.extend(7, 1, evicted=failed)
    assert failed == [] and m.num_cached_blocks == before
    m.check_invariants()


@pytest.mark.parametrize("impl", list(IMPLS))
def test_every_block_taking_call_reports(impl: str) -> None:
    """extend, append, append_batch, truncate (a copy), swap_in, fork, RunningBatch.step:
    over a workload that evicts all the time, every eviction is reported by exactly one
    call, and each reported block is held by that call's sequence right after it."""
    rng = random.Random(impl)
    num_blocks = 12 if impl.endswith("groups") else 10
    m = IMPLS[impl](num_blocks, 2, record_evictions=True, num_cpu_blocks=8)
    groups = len(m.stats().groups) or 1
    reported = 0
    calls_reporting: set[str] = set()
    live: list[int] = []
    for sid in range(300):
        ev: list[Any] = []
        prompt = [rng.randrange(2) for _ in range(rng.randint(3, 7))]
        op = rng.choice(["allocate", "append", "append_batch", "extend", "swap", "truncate"])
        target: list[int] = []
        if op == "allocate" or not live:
            got = m.allocate(sid, prompt, num_new_tokens=rng.randint(1, 3), evicted=ev)
            if got is not None:
                live.append(sid)
                target = [sid]
            op = "allocate"
        else:
            s = rng.choice(live)
            target = [s]
            if m.is_swapped(s):  # a swap-in that did not fit: again
                op = "swap"
                m.swap_in(s, evicted=ev)
            elif op == "extend" and m.num_scheduled_tokens(s) < m.num_tokens(s):
                m.extend(s, 1, evicted=ev)
            elif op == "swap":
                if m.swap_out(s) is not None:
                    m.swap_in(s, evicted=ev)
            elif op == "truncate" and m.num_scheduled_tokens(s) == m.num_tokens(s):
                child = 1000 + sid
                m.fork(s, child, evicted=ev)
                assert ev == [], "fork shares blocks: it evicts nothing"
                m.truncate(child, max(1, m.num_tokens(child) - 1), evicted=ev)
                target = [child]
                live.append(child)
            elif m.num_scheduled_tokens(s) == m.num_tokens(s) and not m.is_swapped(s):
                ids = [x for x in live if m.num_scheduled_tokens(x) == m.num_tokens(x)]
                ids = [x for x in ids if not m.is_swapped(x)][:3]
                if op == "append_batch" and len(ids) > 1:
                    if impl.endswith("groups"):
                        m.append_batch(ids, [1] * len(ids), evicted=ev)
                    else:
                        m.running_batch(ids).step([1] * len(ids), evicted=ev)
                    target = ids
                else:
                    m.append(s, [rng.randrange(2)], evicted=ev)
        held = {
            b
            for x in target
            if x in m and not m.is_swapped(x)
            for g in range(groups)
            for b in m.block_table(x, group=g)
        }
        assert {b for b, _, _ in ev} <= held, f"{op}: evicted blocks go to its caller"
        reported += len(ev)
        if ev:
            calls_reporting.add(op)
        while len(live) > 3:
            m.free(live.pop(0))
        m.check_invariants()
    assert m.stats().evictions == reported, "every eviction was reported exactly once"
    assert reported > 30 and len(calls_reporting) >= 3, calls_reporting


@pytest.mark.parametrize("impl", list(IMPLS))
def test_no_reports_unless_asked(impl: str) -> None:
    num_blocks, second = _sizes(impl)
    m = IMPLS[impl](num_blocks, 4)
    assert not m.record_evictions
    m.allocate(0, list(range(9)))
    m.free(0)
    with pytest.raises(InvalidArgumentError, match="record_evictions"):
        m.allocate(1, list(range(100, 100 + second)), evicted=[])
    assert 1 not in m, "the refused call changed nothing"
    assert m.allocate(1, list(range(100, 100 + second))) == 0
    assert m.stats().evictions > 0
    r = IMPLS[impl](num_blocks, 4, record_evictions=True)
    with pytest.raises(InvalidArgumentTypeError, match="evicted"):
        r.allocate(1, [1, 2], evicted=())  # type: ignore[arg-type]
    assert 1 not in r
    # Checked first, in both implementations, whatever else is wrong (docs/inputs.md).
    with pytest.raises(InvalidArgumentTypeError, match="evicted"):
        r.extend(-1, 0, evicted=())  # type: ignore[arg-type]


@pytest.mark.parametrize("groups", [False, True])
def test_rust_and_reference_report_the_same_evictions(groups: bool) -> None:
    rng = random.Random(7)
    kw: dict[str, Any] = {"record_evictions": True}
    if groups:
        kw["groups"] = GROUPS
    rust, ref = BlockManager(24, 4, **kw), ReferenceBlockManager(24, 4, **kw)
    live: list[int] = []
    for i in range(400):
        prompt = [rng.randrange(3) for _ in range(rng.randint(1, 20))]
        got_ev: list[Any] = []
        want_ev: list[Any] = []
        got = rust.allocate(i, prompt, evicted=got_ev)
        assert got == ref.allocate(i, prompt, evicted=want_ev)
        assert got_ev == want_ev
        if got is not None:
            live.append(i)
        while len(live) > 2:
            sid = live.pop(0)
            rust.free(sid)
            ref.free(sid)
    assert rust.stats().evictions > 50
