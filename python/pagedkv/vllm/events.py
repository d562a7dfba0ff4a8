"""`EventTranslator`: pagedkv's KV events as vLLM's, carrying vLLM's block hashes.

pagedkv keys a caller's block by a digest of vLLM's block hash; its events carry that digest.
Routers and indexers expect vLLM's hash, so the translator remembers which hash each digest
came from. The memory is bounded (four entries per block of the pool, oldest first out): a
digest whose hash was forgotten is published as the digest itself, which can only happen to
a block registered long after its key was handed over.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from pagedkv import events as pk

if TYPE_CHECKING:
    from pagedkv.vllm.manager import KVCacheManager


class EventTranslator:
    def __init__(self, manager: KVCacheManager, enabled: bool) -> None:
        self._manager = manager
        self.enabled = enabled
        # Held from a call that hands keys over to the core until `note_keys` has noted
        # them, and while `take` translates: events are never taken between a block's
        # registration and its key's noting (they would carry pagedkv's digest, not vLLM's
        # hash). Taken before any lock of the core, never inside one.
        self.lock = threading.Lock()
        self._hash_of: OrderedDict[bytes, bytes] = OrderedDict()
        self._cap = 4 * max(manager.layout.num_vllm_blocks, 1)
        self._meta = [
            (get_kv_cache_spec_kind(s).value, get_kv_cache_spec_sliding_window(s))
            for s in manager.layout.specs
        ]

    def note_keys(self, sid: int, keys: list[bytes] | None, start: int) -> None:
        """Remember the hashes handed over as keys `start..` of sequence `sid` (the caller
        holds `lock` from the call that handed them over)."""
        if not self.enabled or not keys:
            return
        # The step that handed the keys over is applied (the caller's own); no settling.
        digests = self._manager._core_mgr.block_hashes(sid, start, start + len(keys))
        table = self._hash_of
        for d, k in zip(digests, keys, strict=False):
            table[d] = k
            table.move_to_end(d)
        while len(table) > self._cap:
            table.popitem(last=False)

    def _hash(self, digest: bytes) -> bytes:
        return self._hash_of.get(digest, digest)

    def _hashes(self, digests: list[bytes]) -> list[object]:
        return [maybe_convert_block_hash(self._hash(d)) for d in digests]

    def take(self) -> list[KVCacheEvent]:
        if not self.enabled:
            return []
        with self.lock:
            return self._take()

    def _take(self) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        # Deferred steps emit no events (none that registers a key is planned while events
        # are on): no settling.
        for e in self._manager._core_mgr.drain_events():
            if isinstance(e, pk.BlockStored):
                kind, window = self._meta[e.group_idx]
                out.append(
                    BlockStored(
                        block_hashes=[
                            maybe_convert_block_hash(self._hash(h)) for h in e.block_hashes
                        ],
                        parent_block_hash=None
                        if e.parent_block_hash is None
                        else maybe_convert_block_hash(self._hash(e.parent_block_hash)),
                        token_ids=list(e.token_ids),
                        block_size=e.block_size,
                        lora_id=e.lora_id,
                        medium=e.medium,
                        lora_name=None,
                        group_idx=e.group_idx,
                        kv_cache_spec_kind=kind,
                        kv_cache_spec_sliding_window=window,
                    )
                )
            elif isinstance(e, pk.BlockRemoved):
                out.append(
                    BlockRemoved(
                        block_hashes=[
                            maybe_convert_block_hash(self._hash(h)) for h in e.block_hashes
                        ],
                        medium=e.medium,
                        group_idx=e.group_idx,
                    )
                )
            else:
                out.append(AllBlocksCleared())
        return out


__all__ = ["EventTranslator"]
