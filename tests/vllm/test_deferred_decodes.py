"""The adapter's deferred decode steps (`pagedkv.vllm.deferred`): a running request's
one-token step planned at the step's start is answered at once and applied in a batch.

What must hold: the schedule is vLLM's step for step (the steps are really deferred, not
skipped: the tests count them), no call of the adapter sees a sequence without a step it
already answered, a call that is not the planned step takes the general path, and threads
driving one manager at once leave every sequence where its requests are.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from pagedkv.vllm import KVCacheManager
from pagedkv.vllm.deferred import INDEPENDENT, OWN_FIRST, SETTLES_ITSELF, settles
from vllm_objects import full_spec, make_manager, make_request
from vllm_scheduler import build_scheduler, step
from vllm_schedules import Arrival, Program, first_difference, run


def _program(seed: int, *, num_drafts: int = 0, caching: bool = True) -> Program:
    """Full attention only (the layout the steps are planned for): shared prefixes, a pool
    small enough to preempt, chunked prefill."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(50_000) for _ in range(rng.randrange(16, 80))) for _ in "ab"]
    arrivals = []
    for i in range(rng.randrange(4, 10)):
        tail = tuple(rng.randrange(50_000) for _ in range(rng.randrange(1, 60)))
        arrivals.append(
            Arrival(rng.randrange(20), f"r{i}", rng.choice(prefixes) + tail, rng.randrange(8, 60))
        )
    config: dict[str, Any] = {
        "num_blocks": rng.randrange(20, 48),
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 1024,
        "specs": [full_spec()],
        "enable_prefix_caching": caching,
    }
    if num_drafts:
        config["num_speculative_tokens"] = num_drafts
    return Program(arrivals, steps=70, config=config, num_drafts=num_drafts, seed=seed)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("caching", [True, False])
def test_deferred_steps_schedule_as_vllm(seed: int, caching: bool) -> None:
    program = _program(seed, caching=caching)
    built: list[Any] = []
    ours = run("pagedkv", program, built=built)
    theirs = run("vllm", program)
    assert first_difference(theirs, ours) is None, first_difference(theirs, ours)
    manager = built[0].kv_cache_manager
    deferred = manager._deferred
    assert deferred.applied > 0, "no step was deferred: the test no longer tests them"
    assert deferred.skipped == 0
    # Every sequence left holds exactly its request's computed tokens.
    for rid, req in built[0].requests.items():
        if rid in manager._seqs:
            assert manager.core.num_tokens(manager._seqs[rid].sid) == req.num_computed_tokens


@pytest.mark.parametrize("seed", range(4))
def test_drafted_steps_take_the_general_path_and_schedule_as_vllm(seed: int) -> None:
    """With speculative decoding every running step asks for draft slots: none is the
    planned one-token step, and the schedule is still vLLM's."""
    program = _program(seed, num_drafts=2)
    built: list[Any] = []
    ours = run("pagedkv", program, built=built)
    assert first_difference(run("vllm", program), ours) is None
    assert built[0].kv_cache_manager._deferred.skipped == 0


def _decoding(n: int = 2) -> tuple[Any, KVCacheManager, list[Any]]:
    scheduler = build_scheduler("pagedkv", num_blocks=64, max_num_seqs=8)
    reqs = [make_request(f"q{i}", list(range(100 * i, 100 * i + 20))) for i in range(n)]
    for r in reqs:
        scheduler.add_request(r)
    for _ in range(3):
        step(scheduler)
    manager = scheduler.kv_cache_manager
    assert isinstance(manager, KVCacheManager)
    return scheduler, manager, reqs


def _take(manager: KVCacheManager, request: Any) -> None:
    """The scheduler's call of a decode step, after the step's start planned it."""
    assert manager.allocate_slots(request, 1) is manager.empty_kv_cache_blocks
    assert manager._deferred.queued >= 1


def test_a_taken_step_is_in_the_sequence_before_any_other_call_reads_it() -> None:
    _, manager, (req, other) = _decoding()
    sid = manager._seqs[req.request_id].sid
    manager.new_step_starts()
    assert manager._deferred.primed == 2
    have = req.num_computed_tokens
    # The steps before it are still answered and not applied: a run applies its steps
    # when it ends (its block fills) or when a call settles.
    assert manager._core_mgr.num_tokens(sid) < have
    _take(manager, req)
    # The core underneath does not have the token yet; every way in applies it first.
    assert manager._core_mgr.num_tokens(sid) < have + 1
    behind = sum(
        r.num_computed_tokens - manager._core_mgr.num_tokens(manager._seqs[r.request_id].sid)
        for r in (req, other)
    )
    assert manager._deferred.unapplied == behind + 1
    assert manager.core.num_tokens(sid) == have + 1
    assert manager._deferred.unapplied == 0
    assert manager._deferred.queued == 0
    # Settling forgot the other plan; the next step's start makes it again.
    assert manager._deferred.primed == 0
    manager.new_step_starts()
    _take(manager, other)
    ids = manager.get_block_ids(other.request_id)
    assert manager._deferred.queued == 0 and ids[0]
    assert manager._seqs[other.request_id].have == other.num_computed_tokens + 1


def test_a_step_that_fills_a_block_hands_its_key_over_as_vllms_step_does() -> None:
    """The step whose token fills a block is deferred too, and once applied the block is
    cached under its key: a request with that prefix hits it right after the step, as in
    vLLM."""
    hits = {}
    for which in ("vllm", "pagedkv"):
        scheduler = build_scheduler(which, num_blocks=64, max_num_seqs=8)
        req = make_request("a", list(range(1000, 1020)), max_tokens=60)
        scheduler.add_request(req)
        while req.num_computed_tokens % 16 != 15 or req.num_computed_tokens < 31:
            step(scheduler)
        manager = scheduler.kv_cache_manager
        if which == "pagedkv":
            manager.new_step_starts()  # the steps before it applied
        applied = manager._deferred.applied if which == "pagedkv" else 0
        step(scheduler)  # the step whose token (position 31) fills block 1
        if which == "pagedkv":
            manager.new_step_starts()  # applies what is still queued
            assert manager._deferred.applied == applied + 1
            assert manager._deferred.skipped == 0
        probe = make_request("b", req.all_token_ids[:36])
        hits[which] = manager.get_computed_blocks(probe)[1]
    assert hits["pagedkv"] == hits["vllm"] == 32


def test_with_kv_events_a_step_that_fills_a_block_is_not_deferred() -> None:
    """The key's BlockStored event is written by the step's own call: with events on, only
    the steps that fill no block are planned."""
    manager: KVCacheManager = make_manager(KVCacheManager, 64, enable_kv_cache_events=True)
    req = make_request("a", list(range(1000, 1030)))
    assert manager.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    planned = []
    while req.num_computed_tokens < 48:
        req.append_output_token_ids(7)
        manager.new_step_starts()
        planned.append((req.num_computed_tokens, req.request_id in manager._planned))
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
    # Positions 31 and 47 fill blocks 1 and 2; position 32 needs block 2.
    assert [p for p, ok in planned if not ok] == [31, 32, 47], planned
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    # The prompt's first block, then the two blocks the decode filled.
    assert sum(len(e.block_hashes) for e in stored) == 3


def test_a_call_that_is_not_the_planned_step_applies_the_queue_then_takes_the_general_path() -> (
    None
):
    _, manager, (req, other) = _decoding()
    manager.new_step_starts()
    _take(manager, req)
    before = manager._deferred.applied
    # The taken step and the earlier steps of both runs, answered and not applied.
    waiting = manager._deferred.unapplied

    def behind(r: Any) -> int:
        return int(
            r.num_computed_tokens - manager._core_mgr.num_tokens(manager._seqs[r.request_id].sid)
        )

    own = behind(other)
    assert own >= 1 and waiting == own + behind(req) + 1
    # Two new tokens, or lookahead slots, are not the planned step: its own steps are
    # applied first (and the queue taken in); the other run's wait (they touch nothing
    # this call reads) until a call settles.
    out = manager.allocate_slots(other, 1, num_lookahead_tokens=3)
    assert out is not None
    assert manager._deferred.applied == before + own
    assert manager._deferred.queued == 0
    assert manager._deferred.unapplied == waiting - own
    manager.core.check_invariants()  # settles
    assert manager._deferred.unapplied == 0
    # The plan of `other` is gone: its next call, even a one-token one, is general.
    assert manager._deferred.primed == 0


def test_a_freed_request_with_a_taken_step_is_freed_whole() -> None:
    _, manager, (req, _other) = _decoding()
    free_before = manager.block_pool.get_num_free_blocks()
    manager.new_step_starts()
    _take(manager, req)
    held = len(manager.get_block_ids(req.request_id)[0])
    manager.free(req)
    assert manager.block_pool.get_num_free_blocks() == free_before + held
    assert manager._deferred.skipped == 0
    manager.core.check_invariants()


def test_every_public_method_and_property_settles_first() -> None:
    """A method added later is wrapped too (the class decorator); this names the ones left
    out, so that leaving one out is a decision."""
    assert set(vars(KVCacheManager)) >= INDEPENDENT, INDEPENDENT - set(vars(KVCacheManager))
    assert set(vars(KVCacheManager)) >= SETTLES_ITSELF | OWN_FIRST
    for name, attr in vars(KVCacheManager).items():
        if name.startswith("_") or not (callable(attr) or isinstance(attr, property)):
            continue
        wanted: bool | str = name not in INDEPENDENT and name not in SETTLES_ITSELF
        if name in OWN_FIRST:
            wanted = "own"
        assert settles(KVCacheManager, name) == wanted, name


@pytest.mark.parametrize("events", [True, False])
def test_threads_driving_one_manager_leave_every_sequence_where_its_request_is(
    events: bool,
) -> None:
    """Threads each decode their own requests (planned steps, general ones when a block
    fills, frees and re-admissions) on one manager, while another thread keeps starting
    steps (planning), reading and draining the KV events. Then every live sequence knows
    exactly its request's computed tokens, every block stored carries its request's tokens
    (the deferred steps appended the right ones) and the manager's invariants hold. Without
    events the steps that fill a block are deferred too: then each live request's own
    prefix hits exactly its own blocks (each key was handed over with its block)."""
    manager: KVCacheManager = make_manager(KVCacheManager, 512, enable_kv_cache_events=events)
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()  # one request is driven by one thread; this guards the dicts
    live: dict[str, Any] = {}
    every: list[Any] = []
    seen: list[Any] = []

    def admit(rid: str, rng: random.Random) -> Any:
        req = make_request(rid, [rng.randrange(1000) for _ in range(rng.randrange(1, 40))])
        with lock:
            every.append(req)
        assert manager.allocate_slots(req, req.num_tokens) is not None
        req.num_computed_tokens = req.num_tokens
        req.append_output_token_ids(rng.randrange(1000))
        return req

    def driver(t: int) -> None:
        rng = random.Random(t)
        try:
            mine = [admit(f"t{t}-{i}", rng) for i in range(4)]
            with lock:
                live.update({r.request_id: r for r in mine})
            for k in range(400):
                if k % 5 == 0:  # a step's start, from this thread (plans every thread's)
                    manager.new_step_starts()
                req = mine[k % len(mine)]
                if rng.random() < 0.02:
                    with lock:
                        del live[req.request_id]
                    manager.free(req)
                    req = mine[k % len(mine)] = admit(f"t{t}-{k}", rng)
                    with lock:
                        live[req.request_id] = req
                    continue
                assert manager.allocate_slots(req, 1) is not None
                req.num_computed_tokens += 1
                req.append_output_token_ids(rng.randrange(1000))
        except BaseException as e:
            errors.append(e)

    def stepper() -> None:
        try:
            k = 0
            while not stop.is_set():
                manager.new_step_starts()
                time.sleep(0.0005)  # the drivers take planned steps meanwhile
                k += 1
                if k % 8 == 0:  # a read settles: applies the queue, forgets the plans
                    manager.get_num_common_prefix_blocks("nobody")
                seen.extend(manager.take_events())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=driver, args=(t,)) for t in range(4)]
    side = threading.Thread(target=stepper)
    side.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    side.join()
    assert not errors, errors
    core = manager.core
    for rid, req in live.items():
        assert core.num_tokens(manager._seqs[rid].sid) == req.num_computed_tokens, rid
    core.check_invariants()
    assert manager._deferred.applied > 0
    if not events:
        for rid, req in live.items():
            n = req.num_computed_tokens
            probe = make_request(f"probe-{rid}", req.all_token_ids[:n])
            blocks, hit = manager.get_computed_blocks(probe)[:2]
            assert hit == (n - 1) // 16 * 16, rid
            own = manager.get_block_ids(rid)[0]
            assert list(blocks.get_block_ids()[0]) == list(own[: hit // 16]), rid
        return
    seen.extend(manager.take_events())
    # Every stored block's tokens are its request's (keyed by vLLM's block hash).
    expected = {}
    for req in every:
        for i, h in enumerate(req.block_hashes):
            expected[maybe_convert_block_hash(h)] = req.all_token_ids[16 * i : 16 * (i + 1)]
    stored = [e for e in seen if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) > 50
    for e in stored:
        for i, h in enumerate(e.block_hashes):
            assert list(e.token_ids[16 * i : 16 * (i + 1)]) == list(expected[h])
