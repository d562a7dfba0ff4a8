"""pagedkv's vLLM manager against vLLM's own, call by call, on the same requests.

Both managers get the calls vLLM's scheduler makes (prefix lookup, allocation with the hit,
prompt chunks, decode steps with drafts, frees) for the same `Request` objects, and must
agree on every hit, every refusal and the free-block count after every call.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from vllm_objects import (
    KVCacheManager,
    VllmKVCacheManager,
    make_manager,
    make_request,
)

BS = 16


class Pair:
    """The two managers side by side; every call is made on both and compared."""

    def __init__(self, num_blocks: int, **kwargs: Any) -> None:
        self.theirs = make_manager(VllmKVCacheManager, num_blocks, **kwargs)
        self.ours = make_manager(KVCacheManager, num_blocks, **kwargs)
        self.calls = 0

    def check_free(self) -> None:
        assert (
            self.ours.block_pool.get_num_free_blocks()
            == self.theirs.block_pool.get_num_free_blocks()
        ), f"free blocks differ after call {self.calls}"
        assert self.ours.usage == pytest.approx(self.theirs.usage)

    def admit(self, req: Any, chunk: int | None = None) -> bool:
        self.calls += 1
        b1, h1, _ = self.theirs.get_computed_blocks(req)
        b2, h2, _ = self.ours.get_computed_blocks(req)
        assert h2 == h1, f"hit of {req.request_id}: pagedkv {h2}, vLLM {h1}"
        assert len(b2.get_block_ids()[0]) == len(b1.get_block_ids()[0])
        new = req.num_tokens - h1 if chunk is None else min(chunk, req.num_tokens - h1)
        o1 = self.theirs.allocate_slots(req, new, h1, b1)
        o2 = self.ours.allocate_slots(req, new, h2, b2)
        assert (o1 is None) == (o2 is None), f"admission of {req.request_id} differs"
        if o1 is not None:
            assert len(o2.get_block_ids()[0]) == len(o1.get_block_ids()[0])
            req.num_computed_tokens = h1 + new
            req.status = RequestStatus.RUNNING
        self.check_free()
        return o1 is not None

    def step(self, req: Any, new: int, lookahead: int = 0) -> bool:
        self.calls += 1
        o1 = self.theirs.allocate_slots(req, new, num_lookahead_tokens=lookahead)
        o2 = self.ours.allocate_slots(req, new, num_lookahead_tokens=lookahead)
        assert (o1 is None) == (o2 is None), f"step of {req.request_id} differs"
        if o1 is not None:
            assert len(o2.get_block_ids()[0]) == len(o1.get_block_ids()[0])
            req.num_computed_tokens += new
        self.check_free()
        return o1 is not None

    def free(self, req: Any) -> None:
        self.calls += 1
        self.theirs.free(req)
        self.ours.free(req)
        self.check_free()
        assert self.ours.get_block_ids(req.request_id) == ([],)


def test_prompt_decode_free_without_pressure() -> None:
    pair = Pair(256)
    shared = list(range(1000, 1000 + 3 * BS))
    reqs = [make_request(f"r{i}", shared + [i] * (BS + i)) for i in range(4)]
    for r in reqs:
        assert pair.admit(r)
    for _ in range(20):
        for r in reqs:
            r.append_output_token_ids(7)
            assert pair.step(r, 1)
    for r in reqs:
        pair.free(r)
    again = make_request("again", shared + [0] * BS)
    assert pair.admit(again)


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_agrees(seed: int) -> None:
    """Shared system prompts, chunked prefill, decode with drafts, frees, eviction."""
    rng = random.Random(seed)
    pair = Pair(rng.choice([24, 48, 96]))
    prompts = [[rng.randrange(50_000) for _ in range(rng.randrange(BS, 5 * BS))] for _ in range(3)]
    running: list[Any] = []
    prefilling: dict[str, int] = {}
    for n in range(120):
        action = rng.random()
        if action < 0.35 or not running:
            tail = [rng.randrange(50_000) for _ in range(rng.randrange(1, 3 * BS))]
            req = make_request(f"q{n}", rng.choice(prompts) + tail)
            chunk = rng.choice([None, BS, 2 * BS + 3])
            if pair.admit(req, chunk):
                running.append(req)
                if req.num_computed_tokens < req.num_tokens:
                    prefilling[req.request_id] = 1
        elif action < 0.85:
            req = rng.choice(running)
            if req.request_id in prefilling:
                left = req.num_tokens - req.num_computed_tokens
                if pair.step(req, min(left, BS + 5)) and left <= BS + 5:
                    del prefilling[req.request_id]
            else:
                req.append_output_token_ids(rng.randrange(50_000))
                pair.step(req, 1, lookahead=rng.choice([0, 0, 2]))
        else:
            req = running.pop(rng.randrange(len(running)))
            prefilling.pop(req.request_id, None)
            pair.free(req)
    for req in running:
        pair.free(req)


def test_cross_attention_blocks_follow_the_encoder() -> None:
    """An encoder-decoder layout: the cross-attention group's blocks are the encoder's
    tokens, allocated once, never cached, freed with the request, as vLLM's."""
    import torch
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    from vllm_objects import full_spec

    cross = CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    # vLLM's cross-attention manager requires prefix caching off, as encoder-decoder models
    # run in vLLM.
    pair = Pair(64, specs=[full_spec(), cross], enable_caching=False)
    req = make_request("enc", list(range(3 * BS + 1)))
    o1 = pair.theirs.allocate_slots(req, req.num_tokens, num_encoder_tokens=5 * BS - 3)
    o2 = pair.ours.allocate_slots(req, req.num_tokens, num_encoder_tokens=5 * BS - 3)
    assert [len(g) for g in o2.get_block_ids()] == [len(g) for g in o1.get_block_ids()] == [4, 5]
    pair.check_free()
    req.num_computed_tokens = req.num_tokens
    req.append_output_token_ids(1)
    o1 = pair.theirs.allocate_slots(req, 1)
    o2 = pair.ours.allocate_slots(req, 1)
    assert [len(g) for g in o2.get_block_ids()] == [len(g) for g in o1.get_block_ids()]
    assert [len(g) for g in pair.ours.get_block_ids("enc")] == [4, 5]
    pair.check_free()
    pair.theirs.free(req)
    pair.ours.free(req)
    pair.check_free()
    assert pair.ours.block_pool.get_num_free_blocks() == 63


def test_block_objects_are_kept_and_carry_their_hash() -> None:
    """`.blocks` gives one vLLM block object per id across calls, with vLLM's block hash
    (key and group) while the block is in the prefix cache."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    ours = make_manager(KVCacheManager, 32)
    req = make_request("a", list(range(2 * BS + 3)))
    blocks, hit, _ = ours.get_computed_blocks(req)
    assert hit == 0
    ours.allocate_slots(req, req.num_tokens, 0, blocks)
    first = ours.get_blocks("a").blocks[0]
    again = ours.get_blocks("a").blocks[0]
    assert [b is c for b, c in zip(first, again, strict=True)] == [True] * 3
    assert first[0].block_hash == make_block_hash_with_group_id(req.block_hashes[0], 0)
    assert first[1].block_hash == make_block_hash_with_group_id(req.block_hashes[1], 0)
    assert first[2].block_hash is None  # not full
    probe = make_request("b", list(range(2 * BS + 3)))
    hit_blocks, hit, _ = ours.get_computed_blocks(probe)
    assert hit == 2 * BS
    assert hit_blocks.blocks[0][0] is first[0]
    assert ours.get_blocks("a").get_unhashed_block_ids() == [first[2].block_id]


def _stored(events: list[Any]) -> list[tuple[Any, ...]]:
    from vllm.distributed.kv_events import BlockStored

    return [
        (tuple(e.block_hashes), e.parent_block_hash, tuple(e.token_ids), e.block_size)
        for e in events
        if isinstance(e, BlockStored)
    ]


def test_events_carry_vllms_block_hashes() -> None:
    """KV events name blocks by vLLM's own hashes (routers recompute nothing else)."""
    pair = Pair(64, enable_kv_cache_events=True)
    shared = list(range(2 * BS))
    a = make_request("a", [*shared, *range(500, 500 + BS + 3)])
    b = make_request("b", [*shared, *range(900, 900 + BS + 3)])
    for r in (a, b):
        assert pair.admit(r)
    ours = _stored(pair.ours.take_events())
    theirs = _stored(pair.theirs.take_events())
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    assert {h for e in ours for h in e[0]} == {h for e in theirs for h in e[0]}
    hashes = {maybe_convert_block_hash(h) for h in (*a.block_hashes, *b.block_hashes)}
    assert {h for e in ours for h in e[0]} == hashes


def test_hash_block_size_smaller_than_the_block_size() -> None:
    """vLLM hashes every 16 tokens and allocates 32-token blocks (a hybrid model's groups
    may; vLLM's own single-group manager refuses it): a block's key is the hash at its last
    16-token boundary, so hits follow vLLM's hashes at the block size."""
    from vllm_objects import full_spec

    ours = make_manager(KVCacheManager, 32, [full_spec(2 * BS)], hash_block_size=BS)
    prompt = list(range(5 * BS + 1))
    first = make_request("first", prompt, block_size=BS)
    blocks, hit, _ = ours.get_computed_blocks(first)
    assert hit == 0
    assert ours.allocate_slots(first, first.num_tokens, 0, blocks) is not None
    ours.free(first)
    second = make_request("second", [*prompt[: 4 * BS], 7, 7, 7], block_size=BS)
    assert ours.get_computed_blocks(second)[1] == 4 * BS  # two 32-token blocks
    third = make_request("third", [*prompt[: 3 * BS], 7, *prompt[3 * BS + 1 :]], block_size=BS)
    assert ours.get_computed_blocks(third)[1] == 2 * BS  # the second block differs


def test_block_ids_match_vllms_without_pressure() -> None:
    pair = Pair(64)
    reqs = [make_request(f"r{i}", list(range(i * 100, i * 100 + 2 * BS + 5))) for i in range(3)]
    for r in reqs:
        assert pair.admit(r)
        assert pair.ours.get_block_ids(r.request_id) == pair.theirs.get_block_ids(r.request_id)


def test_a_rolled_back_request_keeps_its_blocks() -> None:
    """After a failed load vLLM lowers `num_computed_tokens` and recomputes into the blocks
    the request holds: the tables must not change under it."""
    pair = Pair(64)
    req = make_request("r", list(range(3 * BS + 2)))
    assert pair.admit(req)
    before = pair.ours.get_block_ids("r")
    assert before == pair.theirs.get_block_ids("r")
    req.num_computed_tokens = BS  # the load of the rest failed
    assert pair.step(req, BS)
    assert pair.ours.get_block_ids("r") == before == pair.theirs.get_block_ids("r")


def _window_pair(num_blocks: int, prompt: int) -> tuple[Pair, Any]:
    """A full and a 32-token sliding-window group; a running request with `prompt` tokens
    computed (its blocks in both groups)."""
    from vllm_objects import full_spec, window_spec

    pair = Pair(num_blocks, specs=[full_spec(), window_spec(32)])
    req = make_request("r", list(range(prompt)))
    assert pair.admit(req)
    return pair, req


def _fill(pair: Pair, blocks_per_group: int) -> None:
    """A request of fresh tokens holding `blocks_per_group` blocks in each group."""
    assert pair.admit(make_request("fill", list(range(1000, 1000 + blocks_per_group * BS))))


def test_accepted_drafts_release_window_blocks_at_the_next_step_as_vllm() -> None:
    """Issue 32, item 6: vLLM frees a window's blocks in `allocate_slots` only, from the
    tokens computed then. Telling pagedkv of accepted drafts (`cache_blocks`) must not free
    the block the window left behind them one step early (it did: one block more free
    after the update than under vLLM)."""
    pair, req = _window_pair(13, 46)
    req.append_output_token_ids(1)
    assert pair.step(req, 1 + 3)  # the sampled token and 3 drafts: slots up to 50
    req.append_output_token_ids([5, 6, 7, 8])  # the drafts accepted, and a bonus token
    pair.theirs.cache_blocks(req, req.num_computed_tokens)
    pair.ours.cache_blocks(req, req.num_computed_tokens)
    pair.check_free()  # position 47 passed the window's first block: still held
    _fill(pair, 2)
    assert pair.ours.block_pool.get_num_free_blocks() == 0
    assert not pair.step(req, 1 + 15)  # needs a block per group; frees the window's first
    assert pair.ours.block_pool.get_num_free_blocks() == 1


def test_a_refused_step_still_releases_what_the_window_left_as_vllm() -> None:
    """Issue 32, item 6: vLLM frees the blocks a window left behind before it finds that
    the step does not fit, and keeps them free when it refuses; under the adapter pagedkv
    does the same (its own `allocate` and steps still change nothing when refused)."""
    pair, req = _window_pair(13, 47)
    _fill(pair, 3)  # 6 + 6 held: none free
    assert pair.ours.block_pool.get_num_free_blocks() == 0
    req.append_output_token_ids(1)
    assert not pair.step(req, 1 + 15)  # slots up to 63: one more block per group
    assert pair.ours.block_pool.get_num_free_blocks() == 1  # position 47: block 0 left
    assert pair.ours.get_block_ids("r")[1][0] == 0  # vLLM's null block in its place


def test_prefix_caching_with_cross_attention_is_refused_as_in_vllm() -> None:
    """Issue 32, item 12: vLLM turns prefix caching off for encoder-decoder models (its
    cross-attention manager cannot look up a hit: a lookup raises). pagedkv refuses the
    layout with caching on when it is built; before, it served it, and a request's
    cross-attention blocks, taken before its prompt, could evict the hit the scheduler had
    counted (the allocation then raised)."""
    import torch
    from vllm.v1.kv_cache_interface import CrossAttentionSpec

    from vllm_objects import full_spec

    cross = CrossAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    theirs = make_manager(VllmKVCacheManager, 64, [full_spec(), cross], enable_caching=True)
    with pytest.raises(NotImplementedError):
        theirs.get_computed_blocks(make_request("a", list(range(2 * BS + 1))))
    with pytest.raises(NotImplementedError, match="prefix caching with a cross-attention"):
        make_manager(KVCacheManager, 64, [full_spec(), cross], enable_caching=True)
    assert make_manager(KVCacheManager, 64, [full_spec(), cross], enable_caching=False)


def test_a_block_computed_twice_is_cached_once_a_documented_difference() -> None:
    """Issue 32, item 7, kept as a deliberate difference (docs/vllm.md): a prompt of one
    block never hits itself (the last token is always computed), so a second request with
    it computes a second copy of the block. vLLM caches both copies under the key; pagedkv's
    index holds one block per key and leaves the copy unhashed. Once the first copy is
    evicted, vLLM still hits the prompt (through the copy, held by the running request) and
    pagedkv does not. Free blocks stay the same."""

    def run(cls: type[Any]) -> tuple[int, int, int]:
        m = make_manager(cls, 8)
        prompt = list(range(BS))

        def admit(rid: str, tokens: list[int]) -> tuple[Any, int]:
            req = make_request(rid, tokens)
            blocks, hit, _ = m.get_computed_blocks(req)
            assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
            req.num_computed_tokens = req.num_tokens
            req.status = RequestStatus.RUNNING
            return req, hit

        first, _ = admit("first", prompt)
        m.free(first)  # its block stays cached
        _, again = admit("again", prompt)  # hit capped at 15 tokens: the block recomputed
        admit("filler", list(range(1000, 1000 + 6 * BS)))  # the free blocks, then the first copy
        probe = make_request("probe", [*prompt, 1, 2, 3])
        return again, m.get_computed_blocks(probe)[1], m.block_pool.get_num_free_blocks()

    assert run(VllmKVCacheManager) == (0, BS, 0)
    assert run(KVCacheManager) == (0, 0, 0)
