"""`BlockSet`: the cached blocks a stream of wire events describes, as a router keeps them.

Keyed by `(medium, group_idx, hash)`; each block remembers its parent, token ids, block size
and LoRA id, so the set can be written back out as `BlockStored` events, parents before
children (a snapshot). The publisher keeps one (its snapshots) and so does the subscriber;
both apply the same events the same way, so after the same sequence numbers they are equal.
`AllBlocksCleared` empties the set, as routers do.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import msgspec

from pagedkv.events import parents_first
from pagedkv.kv_events import wire

Key = tuple[str | None, int, Any]


class Block(NamedTuple):
    parent: Any
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None


class BlockSet:
    def __init__(self) -> None:
        self.blocks: dict[Key, Block] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def key_set(self) -> set[Key]:
        return set(self.blocks)

    def apply(self, events: Iterable[msgspec.Struct]) -> None:
        blocks = self.blocks
        for e in events:
            if isinstance(e, (wire._Stored, wire._StoredArray)):
                group = getattr(e, "group_idx", None) or 0
                parent, bs, tokens = e.parent_block_hash, e.block_size, e.token_ids
                for i, h in enumerate(e.block_hashes):
                    toks = tuple(tokens[i * bs : (i + 1) * bs])
                    blocks[(e.medium, group, h)] = Block(parent, toks, bs, e.lora_id)
                    parent = h
            elif isinstance(e, (wire._Removed, wire._RemovedArray)):
                group = getattr(e, "group_idx", None) or 0
                for h in e.block_hashes:
                    blocks.pop((e.medium, group, h), None)
            elif isinstance(e, (wire._Cleared, wire._ClearedArray)):
                blocks.clear()
            else:
                raise TypeError(f"not a wire KV event: {e!r}")

    def ordered(self) -> Iterator[Key]:
        """Every key, each block after its parent when the parent is in the set."""
        blocks = self.blocks

        def parent(k: Key) -> Key | None:
            p = blocks[k].parent
            return None if p is None else (k[0], k[1], p)

        return parents_first(blocks, parent)

    def snapshot_events(self, encoder: wire.WireEncoder) -> list[msgspec.Struct]:
        """The set as one `BlockStored` per block, parents first, in the encoder's form."""
        o = encoder.options
        out: list[msgspec.Struct] = []
        for medium, group, h in self.ordered():
            b = self.blocks[(medium, group, h)]
            toks = list(b.token_ids)
            if o.event_form == "array":
                out.append(
                    wire._StoredArray([h], b.parent, toks, b.block_size, b.lora_id, medium, None)
                )
            else:
                out.append(
                    wire._Stored(
                        [h], b.parent, toks, b.block_size, b.lora_id, medium, None,
                        group_idx=group,
                        kv_cache_spec_kind=wire._at(o.spec_kinds, group),
                        kv_cache_spec_sliding_window=wire._at(o.sliding_windows, group),
                        locality=o.locality,
                    )
                )  # fmt: skip
        return out


__all__ = ["Block", "BlockSet", "Key"]
