"""Runs of deferred decode steps (`pagedkv.vllm.deferred`): a request's planned one-token
steps are answered at once and appended to its sequence only when the run ends (its block
fills), when a call about the request needs them, or when a call settles.

What must hold: the tokens that reach each sequence are the request's own, at their
positions (the KV events carry them: every stored block's tokens are its request's); a
call about one request applies that request's steps and the ones that register a block,
and lets the other runs go on; nothing changes a record that holds steps not applied.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from pagedkv import _core
from pagedkv.vllm import KVCacheManager
from vllm_objects import make_manager, make_request


def _behind(manager: KVCacheManager, req: Any) -> int:
    """Steps the request's sequence lags its computed tokens (read without settling)."""
    sid = manager._seqs[req.request_id].sid
    return int(req.num_computed_tokens - manager._core_mgr.num_tokens(sid))


def _admit(manager: KVCacheManager, rid: str, rng: random.Random) -> Any:
    req = make_request(rid, [rng.randrange(1000) for _ in range(rng.randrange(1, 40))])
    assert manager.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(rng.randrange(1000))
    return req


@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_every_stored_block_carries_its_requests_tokens(seed: int, keyed: bool) -> None:
    """Decode steps with a new token each (so a token at the wrong position shows), runs
    lagging by up to a block, calls about one request in between (its block ids, its cached
    blocks, a lookup) and requests freed and admitted: every block the KV events store holds
    its own request's tokens, and every sequence ends where its request is. `keyed`: the
    steps that fill a block are deferred too (planned as when no events are published)."""
    rng = random.Random(seed)
    manager: KVCacheManager = make_manager(KVCacheManager, 256, enable_kv_cache_events=True)
    live = {f"r{i}": _admit(manager, f"r{i}", rng) for i in range(6)}
    every = list(live.values())
    lagged = 0
    for k in range(240):
        manager._deferred.prime(keyed)
        for rid in list(live):
            req = live[rid]
            if rng.random() < 0.01:
                manager.free(req)
                live[rid] = req = _admit(manager, f"{rid}-{k}", rng)
                every.append(req)
                continue
            assert manager.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
            req.append_output_token_ids(rng.randrange(1000))
        other = rng.choice(list(live.values()))
        lagged = max(lagged, manager._deferred.unapplied)
        match k % 4:
            case 0:
                manager.get_block_ids(other.request_id)
            case 1:
                manager.num_cached_blocks(other.request_id)
            case 2:
                manager.get_computed_blocks(make_request("probe", other.all_token_ids[:20]))
    assert lagged >= 6, "the runs never lagged: the test no longer tests them"
    core = manager.core  # settles
    for req in live.values():
        assert core.num_tokens(manager._seqs[req.request_id].sid) == req.num_computed_tokens
    core.check_invariants()
    expected = {}
    for req in every:
        for i, h in enumerate(req.block_hashes):
            expected[maybe_convert_block_hash(h)] = req.all_token_ids[16 * i : 16 * (i + 1)]
    blocks = {tuple(tokens) for tokens in expected.values()}
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) > 60
    for e in stored:
        for i, h in enumerate(e.block_hashes):
            tokens = list(e.token_ids[16 * i : 16 * (i + 1)])
            if keyed:
                # A deferred step's key is handed over without its event's translation (the
                # adapter defers those steps only while it publishes no events): the tokens
                # must still be one of the requests' blocks (random tokens: no two alike).
                assert tuple(tokens) in blocks
            else:
                assert tokens == list(expected[h])
    assert manager._deferred.skipped == 0


def _two_decoding() -> tuple[KVCacheManager, Any, Any]:
    manager: KVCacheManager = make_manager(KVCacheManager, 64)
    rng = random.Random(0)
    a, b = _admit(manager, "a", rng), _admit(manager, "b", rng)
    return manager, a, b


def _decode(manager: KVCacheManager, *reqs: Any) -> None:
    manager.new_step_starts()
    for req in reqs:
        assert manager.allocate_slots(req, 1) is manager.empty_kv_cache_blocks
        req.num_computed_tokens += 1
        req.append_output_token_ids(5)


def test_a_run_is_applied_when_its_block_ends() -> None:
    manager: KVCacheManager = make_manager(KVCacheManager, 64)
    req = make_request("a", list(range(1000, 1017)))  # one full block and one token
    assert manager.allocate_slots(req, req.num_tokens) is not None
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(5)
    sid = manager._seqs["a"].sid
    seen = []
    while req.num_computed_tokens < 40:
        manager.new_step_starts()
        seen.append((req.num_computed_tokens, manager._core_mgr.num_tokens(sid)))
        assert manager.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token_ids(5)
    # Positions 17 to 30 are one run (31 fills the block and hands over its key: a step of
    # its own): the sequence stays at 17 while the run goes, and catches up when it ends.
    at = dict(seen)
    assert all(at[p] == 17 for p in range(17, 31)), seen
    assert at[31] == 31 and at[32] == 32, seen
    assert manager.core.num_tokens(sid) == req.num_computed_tokens


def test_a_call_about_one_request_lets_the_other_runs_go_on() -> None:
    manager, a, b = _two_decoding()
    _decode(manager, a, b)
    _decode(manager, a, b)
    assert _behind(manager, a) == _behind(manager, b) == 2
    manager.get_block_ids("a")
    assert _behind(manager, a) == 0 and _behind(manager, b) == 2
    # The other's plan stays too: its next step is still answered at once.
    manager.new_step_starts()
    assert "b" in manager._planned
    manager.num_cached_blocks("b")
    assert _behind(manager, b) == 0
    # Freeing one applies and ends only its own run.
    _decode(manager, a, b)
    manager.free(a)
    assert _behind(manager, b) == 1
    # Any other call settles everything and forgets every plan.
    manager.usage  # noqa: B018 (a property read settles)
    assert _behind(manager, b) == 0 and manager._deferred.primed == 0
    manager.core.check_invariants()


def test_a_record_with_steps_not_applied_refuses_to_change() -> None:
    """Dropping answered steps would leave the sequence behind its request: a change of the
    record while it holds some is an error that changes nothing (the adapter applies them
    before it changes a record)."""
    manager, a, _b = _two_decoding()
    _decode(manager, a)
    manager._deferred.apply_for()  # the taken step into its run (as every call does)
    rec = manager._seqs["a"]
    have = rec.have
    with pytest.raises(RuntimeError, match="answered decode steps not applied"):
        rec.have = have + 5
    assert rec.have == have
    assert manager.core.num_tokens(rec.sid) == a.num_computed_tokens


@pytest.mark.parametrize("start", [0, 2**64 - 1])
def test_a_step_taken_across_a_settle_is_applied_and_its_run_not_planned_on(start: int) -> None:
    """The fast path's pop and append are two operations: a settle between them (another
    thread's call) moves the epoch on, and the late step is then counted into a run of the
    epoch before. It is applied, and that run is not planned on (the settling call may have
    changed what it proved). At the epoch's limit too: 2**64 - 1 wraps to 0."""
    manager, a, b = _two_decoding()
    deferred = _core.DeferredDecodes(manager._seqs, epoch=start)
    manager._deferred, manager._planned, manager._taken = (
        deferred,
        deferred.planned,
        deferred.taken,
    )
    _decode(manager, a, b)
    manager.new_step_starts()
    assert manager._planned.pop("a") == a.num_computed_tokens  # the fast path's first half
    manager.usage  # noqa: B018 (a settle: the epoch moves on, wrapping at the limit)
    assert not manager._planned
    manager._taken.append("a")  # its second half, late
    a.num_computed_tokens += 1
    a.append_output_token_ids(5)
    planned = deferred.prime()
    assert deferred.skipped == 0
    sid = manager._seqs["a"].sid
    # Applied at once (its run ended), then planned afresh from where it is.
    assert manager._core_mgr.num_tokens(sid) == a.num_computed_tokens
    assert manager._planned["a"] == a.num_computed_tokens and planned == 2
    # Runs of the new epoch go on as usual.
    _decode(manager, a, b)
    manager.new_step_starts()
    assert manager._planned["a"] == a.num_computed_tokens
    assert _behind(manager, a) == 1
    manager.core.check_invariants()
    for req in (a, b):
        assert manager.core.num_tokens(manager._seqs[req.request_id].sid) == req.num_computed_tokens
