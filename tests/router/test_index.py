"""`pagedkv.router.RouterIndex` call by call: payloads as pagedkv's and vLLM's encoders write
them (both hash forms, every medium and group, the map and array forms), lookups by hashes
and by token ids, ranking, removal, stats, and bad input that raises or is counted and never
corrupts the index."""

from __future__ import annotations

import sys

import msgspec
import pytest

from pagedkv import hash_blocks
from pagedkv.errors import InvalidArgumentError, InvalidArgumentTypeError, KVEventPayloadError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.kv_events import WireEncoder, WireOptions, hash_int
from pagedkv.router import EngineMatch, RouterIndex

B = 4


def _stored(
    tokens: list[int],
    parent: bytes | None = None,
    medium: str | None = "GPU",
    group: int = 0,
    salt: str | None = None,
) -> BlockStored:
    digests = hash_blocks(tokens, B, cache_salt=salt)
    return BlockStored(digests, parent, tokens, B, None, medium, group)


def _payload(events: list[KVEvent], **options: object) -> bytes:
    return WireEncoder(WireOptions(**options)).batch(events)  # type: ignore[arg-type]


def test_import_pagedkv_imports_no_router_and_the_router_no_zmq() -> None:
    import subprocess

    code = (
        "import sys, pagedkv; assert 'pagedkv.router' not in sys.modules; "
        "import pagedkv.router; assert 'zmq' not in sys.modules and 'msgspec' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("hash_form", ["int", "bytes"])
@pytest.mark.parametrize("event_form", ["map", "array"])
def test_leading_blocks_per_engine_medium_and_group(hash_form: str, event_form: str) -> None:
    ix = RouterIndex(block_size=B, hash_form=hash_form)
    toks = list(range(5 * B))
    opts = {"hash_form": hash_form, "event_form": event_form}
    ix.apply("a", _payload([_stored(toks)], **opts))
    ix.apply("b", _payload([_stored(toks[: 2 * B]), _stored(toks[: 4 * B], medium="CPU")], **opts))
    if event_form == "map":  # the array form carries no group
        ix.apply(7, _payload([_stored(toks[:B], group=1)], **opts))
    got = sorted(ix.holders(token_ids=toks + [99] * B), key=str)
    want = [("a", "GPU", 0, 5), ("b", "CPU", 0, 4), ("b", "GPU", 0, 2)]
    if event_form == "map":
        want.insert(0, (7, "GPU", 1, 1))
    assert got == sorted(want, key=str)
    # By hashes, in the index's form: what match(token_ids=) hashes to.
    hashes = ix.block_hashes(toks)
    digests = hash_blocks(toks, B)
    assert hashes == ([hash_int(d) for d in digests] if hash_form == "int" else digests)
    assert sorted(ix.holders(hashes), key=str) == got
    assert ix.match(hashes) == [
        EngineMatch("a", 5, {"GPU": 5}, None),
        EngineMatch("b", 2, {"GPU": 2, "CPU": 4}, None),
    ]
    assert ix.match(hashes, medium="CPU")[0] == EngineMatch("b", 4, {"GPU": 2, "CPU": 4}, None)
    assert ix.scores(hashes) == {"a": 5, "b": 2}
    s = ix.stats()
    grouped = event_form == "map"
    assert (s.engines, s.memberships) == (2 + grouped, 5 + 2 + 4 + grouped)
    ix.check_invariants()


def test_token_ids_are_hashed_with_the_index_settings() -> None:
    ix = RouterIndex(block_size=B, hash_algo="xxh3_128", hash_seed=5, hash_form="bytes")
    toks = list(range(3 * B))
    digests = hash_blocks(toks, B, cache_salt="t", lora_id=3, hash_algo="xxh3_128", seed=5)
    ev = BlockStored(digests, None, toks, B, 3, "GPU", 0)
    ix.apply("a", _payload([ev], hash_form="bytes"))
    assert ix.scores(digests) == {"a": 3}
    assert ix.match(token_ids=toks, cache_salt="t", lora_id=3)[0].blocks == 3
    # Another salt, LoRA or seed: other digests, no hit.
    assert ix.match(token_ids=toks, cache_salt="u", lora_id=3) == []
    assert ix.match(token_ids=toks) == []
    with pytest.raises(KVEventPayloadError, match="16-byte digests"):
        ix.apply("a", _payload([_stored(toks)], hash_form="bytes"))  # SHA-256: 32 bytes


def test_ranking_with_loads() -> None:
    ix = RouterIndex(block_size=B)
    toks = list(range(4 * B))
    ix.apply("a", _payload([_stored(toks)]))
    ix.apply("b", _payload([_stored(toks[: 3 * B])]))
    ix.apply("c", _payload([_stored(toks[: 3 * B])]))
    ranked = ix.match(token_ids=toks, loads={"a": 9.0, "b": 2.0, "c": 1.0, "idle": 0.0})
    assert [(r.engine_id, r.blocks) for r in ranked] == [("a", 4), ("c", 3), ("b", 3), ("idle", 0)]
    # With a weight, load can outweigh a block of hit.
    ranked = ix.match(token_ids=toks, loads={"a": 9.0, "b": 2.0, "c": 1.0}, load_weight=0.5)
    assert [r.engine_id for r in ranked] == ["c", "b", "a"]
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        ix.match(block_hashes=[1], token_ids=toks)
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        ix.match()


def test_removal_and_clear_go_at_once() -> None:
    ix = RouterIndex(block_size=B)
    toks = list(range(3 * B))
    ix.apply("a", _payload([_stored(toks), _stored(toks, medium="CPU")]))
    ix.apply("b", _payload([_stored(toks)]))
    ix.apply("a", _payload([AllBlocksCleared()]))
    assert ix.scores(ix.block_hashes(toks)) == {"b": 3}
    assert ix.remove_engine("b") and not ix.remove_engine("b")
    assert ix.holders(token_ids=toks) == []
    assert ix.engines() == ["a"]
    assert ix.stats().memberships == 0
    ix.check_invariants()


def test_bad_input_raises_or_is_counted_and_never_corrupts() -> None:
    ix = RouterIndex(block_size=B)
    toks = list(range(3 * B))
    digests = hash_blocks(toks, B)
    ix.apply("a", _payload([_stored(toks[: 2 * B])]))
    before = ix.blocks("a")
    # Garbage, a truncated payload, bytes hashes in an int index: refused whole.
    good = _payload([BlockStored(digests[2:], digests[1], toks[2 * B :], B, None)])
    as_bytes = _payload([_stored(toks)], hash_form="bytes")
    for bad in (b"", b"\xc1", b"not msgpack", good[:-3], as_bytes):
        with pytest.raises(KVEventPayloadError):
            ix.apply("a", bad)
    assert ix.stats().rejected_payloads == 5
    assert ix.blocks("a") == before
    # An unknown event type is skipped and counted; the rest of its batch applies.
    enc = msgspec.msgpack.Encoder()
    mystery = msgspec.msgpack.decode(good)
    mystery[1].append({"type": "BlockMoved", "block_hashes": [1]})
    r = ix.apply("a", enc.encode(mystery))
    assert (r.stored, r.unknown_events) == (1, 1)
    # A removal of an unknown block, and a parent that never came: counted.
    r = ix.apply("a", _payload([BlockRemoved([b"\x00" * 32], "GPU")]))
    assert (r.removed, r.unknown_removals) == (0, 1)
    r = ix.apply("a", _payload([_stored(list(range(100, 100 + B)), parent=b"\x07" * 32)]))
    assert (r.stored, r.orphans) == (1, 1)
    s = ix.stats()
    assert (s.unknown_events, s.unknown_removals, s.orphans) == (1, 1, 1)
    assert ix.scores(ix.block_hashes(toks)) == {"a": 3}
    ix.check_invariants()
    # Bad arguments.
    with pytest.raises(InvalidArgumentTypeError):
        ix.apply(1.5, good)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ix.apply(-1, good)
    with pytest.raises(TypeError):
        ix.apply("a", "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        ix.match([-1])
    with pytest.raises(InvalidArgumentError):
        RouterIndex(hash_form="hex")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        RouterIndex(block_size=0)
    bix = RouterIndex(block_size=B, hash_form="bytes")
    with pytest.raises(InvalidArgumentError, match="32-byte digests"):
        bix.match([b"short"])


def test_too_many_holders_is_refused_whole() -> None:
    ix = RouterIndex(block_size=B, max_holders=2)
    toks = list(range(B))
    ix.apply("a", _payload([_stored(toks)]))
    with pytest.raises(InvalidArgumentError, match="at most 2 holders"):
        ix.apply("b", _payload([_stored(toks), _stored(toks, medium="CPU")]))
    # Nothing of the call stays, not even the engine it named.
    assert ix.engines() == ["a"] and ix.stats().memberships == 1
    ix.check_invariants()


def test_payloads_of_vllms_own_encoder() -> None:
    from vllm.distributed import kv_events as v

    enc = msgspec.msgpack.Encoder()
    ix = RouterIndex(block_size=B)
    stored = v.BlockStored(
        block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(2 * B)),
        block_size=B, lora_id=None, medium="GPU", lora_name=None, group_idx=1,
        kv_cache_spec_kind="full_attention", extra_keys=[None, None],
    )  # fmt: skip
    cpu = v.BlockStored([12], 11, list(range(B)), B, None, "CPU", None)
    batch = v.KVEventBatch(ts=1.0, events=[stored, cpu, v.BlockRemoved([11], "GPU", 1)])
    r = ix.apply("w", enc.encode(batch))
    assert (r.stored, r.removed, r.orphans) == (3, 1, 1)
    assert ix.holder_sizes("w") == [("CPU", 0, 1), ("GPU", 1, 1)]
    ix.apply("w", enc.encode(v.KVEventBatch(ts=2.0, events=[v.AllBlocksCleared()])))
    assert ix.stats().memberships == 0
