"""Payloads are what vLLM 0.33.0 encodes: vLLM's own decoder reads every field back, and the
bytes equal those of vLLM's encoder on the same events."""

from __future__ import annotations

import msgspec
import pytest
from vllm.distributed import kv_events as v

from pagedkv import BlockManager, hash_blocks
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.kv_events import WireEncoder, WireOptions, hash_int

B = 4
D1 = bytes(range(32))
D2 = bytes(range(100, 132))
EVENTS = [
    BlockStored([D1], None, [1, 2, 3, 4], B, None, "GPU", 0),
    BlockStored([D2], D1, [5, 6, 7, 8], B, 7, "CPU", 1),
    BlockRemoved([D1], "GPU", 0),
    AllBlocksCleared(),
]


def test_hash_int_is_low_64_bits_big_endian() -> None:
    assert hash_int(D1) == int.from_bytes(D1[-8:], "big")
    assert hash_int(b"\x01") == 1


def test_vllm_decodes_every_field_and_bytes_match() -> None:
    opts = WireOptions(spec_kinds=["full_attention", "sliding_window"], sliding_windows=[None, 64])
    payload = WireEncoder(opts).batch(EVENTS, ts=12.5)
    got = msgspec.msgpack.Decoder(type=v.KVEventBatch).decode(payload)
    assert got.ts == 12.5 and got.data_parallel_rank == 0
    s0, s1, r, c = got.events
    assert isinstance(s0, v.BlockStored) and isinstance(s1, v.BlockStored)
    assert s0.block_hashes == [hash_int(D1)] and s0.parent_block_hash is None
    assert s0.token_ids == [1, 2, 3, 4] and s0.block_size == B and s0.lora_id is None
    assert s0.medium == "GPU" and s0.group_idx == 0 and s0.kv_cache_spec_kind == "full_attention"
    assert s0.kv_cache_spec_sliding_window is None and s0.lora_name is None
    assert s1.parent_block_hash == hash_int(D1) and s1.lora_id == 7 and s1.medium == "CPU"
    assert s1.group_idx == 1 and s1.kv_cache_spec_sliding_window == 64
    assert isinstance(r, v.BlockRemoved) and r.block_hashes == [hash_int(D1)]
    assert r.medium == "GPU" and r.group_idx == 0
    assert isinstance(c, v.AllBlocksCleared)
    # vLLM's encoder, given the same events, writes the same bytes.
    theirs = v.KVEventBatch(ts=12.5, events=got.events, data_parallel_rank=0)
    assert msgspec.msgpack.Encoder().encode(theirs) == payload


def test_bytes_hashes_and_locality() -> None:
    payload = WireEncoder(WireOptions(hash_form="bytes", locality="LOCAL")).batch(EVENTS[:3])
    got = msgspec.msgpack.Decoder(type=v.KVEventBatch).decode(payload)
    assert got.events[0].block_hashes == [D1] and got.events[1].parent_block_hash == D1
    assert got.events[0].locality == "LOCAL" and got.events[2].locality == "LOCAL"


def test_array_form_decodes_positionally() -> None:
    """llm-d's adapter: each event an array, its name first, fields by position."""
    payload = WireEncoder(WireOptions(event_form="array", data_parallel_rank=3)).batch(EVENTS)
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 3
    assert events[0] == ["BlockStored", [hash_int(D1)], None, [1, 2, 3, 4], B, None, "GPU", None]
    assert events[1][:3] == ["BlockStored", [hash_int(D2)], hash_int(D1)]
    assert events[2] == ["BlockRemoved", [hash_int(D1)], "GPU"]
    assert events[3] == ["AllBlocksCleared"]


def test_manager_events_round_trip() -> None:
    """A real manager's events: full blocks, token ids, parents chained as the digests."""
    m = BlockManager(16, B, enable_kv_events=True)
    toks = list(range(3 * B + 1))
    assert m.allocate(1, toks) == 0
    payload = WireEncoder().batch(m.drain_events())
    got = msgspec.msgpack.Decoder(type=v.KVEventBatch).decode(payload)
    digests = hash_blocks(toks, B)
    stored = [e for e in got.events if isinstance(e, v.BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == [hash_int(d) for d in digests]
    assert [e.parent_block_hash for e in stored] == [None] + [hash_int(d) for d in digests[:-1]]
    assert all(len(e.token_ids) == B * len(e.block_hashes) for e in stored)
    assert [t for e in stored for t in e.token_ids] == toks[: 3 * B]


def test_bad_options_and_events_raise() -> None:
    with pytest.raises(ValueError, match="hash_form"):
        WireOptions(hash_form="hex")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="event_form"):
        WireOptions(event_form="tuple")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a pagedkv KV event"):
        WireEncoder().batch(["x"])  # type: ignore[list-item]


def test_import_pagedkv_needs_neither_zmq_nor_msgspec() -> None:
    import subprocess
    import sys

    code = "import sys, pagedkv; print('zmq' in sys.modules, 'msgspec' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
