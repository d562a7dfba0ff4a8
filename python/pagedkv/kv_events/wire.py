"""pagedkv's KV events in vLLM 0.33.0's wire format (`vllm/distributed/kv_events.py`).

A payload is a msgpack `KVEventBatch`, the array `[timestamp, [events], data_parallel_rank]`.
Each event is, by default, a map tagged with its class name (`{"type": "BlockStored", ...}`)
holding the fields vLLM always writes and those optional ones that are set, in vLLM's field
order (vLLM encodes with `omit_defaults=True`). `event_form="array"` writes the older
positional form some consumers decode (llm-d's adapter): `["BlockStored", block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]`, `["BlockRemoved",
block_hashes, medium]`, `["AllBlocksCleared"]`.

Hashes are integers by default, the low 64 bits of the digest read big-endian (what vLLM
sends with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, and what Dynamo needs); `hash_form="bytes"`
sends the digest bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

HashForm = Literal["int", "bytes"]
EventForm = Literal["map", "array"]
_LOW64 = (1 << 64) - 1


def hash_int(digest: bytes) -> int:
    """A digest as vLLM's integer block hash: its low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & _LOW64


@dataclass(frozen=True)
class WireOptions:
    """How events are written. `spec_kinds`/`sliding_windows`: per group, vLLM's
    `kv_cache_spec_kind` (e.g. "full_attention") and window, sent on `BlockStored`;
    `locality`: "LOCAL"/"REMOTE" or None (omitted)."""

    hash_form: HashForm = "int"
    event_form: EventForm = "map"
    data_parallel_rank: int = 0
    spec_kinds: Sequence[str | None] = ()
    sliding_windows: Sequence[int | None] = ()
    locality: str | None = None

    def __post_init__(self) -> None:
        if self.hash_form not in ("int", "bytes"):
            raise ValueError(f"hash_form must be 'int' or 'bytes', not {self.hash_form!r}")
        if self.event_form not in ("map", "array"):
            raise ValueError(f"event_form must be 'map' or 'array', not {self.event_form!r}")


def _at(seq: Sequence[Any], i: int) -> Any:
    return seq[i] if 0 <= i < len(seq) else None


# vLLM's event classes, field for field and in its order (the map form), so that msgspec
# writes the same bytes vLLM does: tagged by class name, optional fields left out when None.
_Hash = int | bytes


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


# The older positional form: the tag first, then the fields by position.
class _ArrayEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
    pass


class _StoredArray(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _RemovedArray(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[_Hash]
    medium: str | None


class _ClearedArray(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int


class WireEncoder:
    """Encodes lists of pagedkv events as vLLM payloads (one encoder per thread)."""

    def __init__(self, options: WireOptions | None = None) -> None:
        self.options = options or WireOptions()
        self._enc = msgspec.msgpack.Encoder()
        self._h = hash_int if self.options.hash_form == "int" else bytes

    def event(self, e: KVEvent) -> msgspec.Struct:
        """One event as the struct msgspec writes."""
        o, h = self.options, self._h
        array = o.event_form == "array"
        if isinstance(e, BlockStored):
            hashes = [h(d) for d in e.block_hashes]
            parent = None if e.parent_block_hash is None else h(e.parent_block_hash)
            tokens = list(e.token_ids)
            if array:
                return _StoredArray(hashes, parent, tokens, e.block_size, e.lora_id, e.medium, None)
            return _Stored(
                hashes,
                parent,
                tokens,
                e.block_size,
                e.lora_id,
                e.medium,
                None,
                group_idx=e.group_idx,
                kv_cache_spec_kind=_at(o.spec_kinds, e.group_idx),
                kv_cache_spec_sliding_window=_at(o.sliding_windows, e.group_idx),
                locality=o.locality,
            )
        if isinstance(e, BlockRemoved):
            hashes = [h(d) for d in e.block_hashes]
            if array:
                return _RemovedArray(hashes, e.medium)
            return _Removed(hashes, e.medium, group_idx=e.group_idx, locality=o.locality)
        if isinstance(e, AllBlocksCleared):
            return _ClearedArray() if array else _Cleared()
        raise TypeError(f"not a pagedkv KV event: {e!r}")

    def structs(self, events: Iterable[KVEvent]) -> list[msgspec.Struct]:
        return [self.event(e) for e in events]

    def payload(self, structs: list[msgspec.Struct], ts: float | None = None) -> bytes:
        """Events already made structs, as a `KVEventBatch` payload."""
        stamp = time.time() if ts is None else ts
        return self._enc.encode(_Batch(stamp, structs, self.options.data_parallel_rank))

    def batch(self, events: Iterable[KVEvent], ts: float | None = None) -> bytes:
        """A `KVEventBatch` payload: `[ts, [events], data_parallel_rank]`."""
        return self.payload(self.structs(events), ts)


def decoder(event_form: EventForm = "map") -> msgspec.msgpack.Decoder[Any]:
    """Decodes payloads into `(ts, events, data_parallel_rank)` of this module's structs."""
    if event_form == "array":
        return msgspec.msgpack.Decoder(_ArrayBatch)
    return msgspec.msgpack.Decoder(_MapBatch)


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_StoredArray | _RemovedArray | _ClearedArray]
    data_parallel_rank: int | None = None


__all__ = ["EventForm", "HashForm", "WireEncoder", "WireOptions", "decoder", "hash_int"]
