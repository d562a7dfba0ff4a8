"""`Layout`: vLLM's KV-cache groups as pagedkv groups, and how block ids line up.

Each vLLM group becomes one pagedkv group of the same kind, one to one and in order: full
attention, sliding window, chunked local attention, Mamba state. pagedkv's groups share one
block size, so a layout whose groups differ in block size (vLLM pads Mamba's state blocks
larger) is refused. A cross-attention group is not a pagedkv group: its blocks follow the
encoder's tokens, not the sequence's, and are never prefix-cached, so the adapter gives each
request a second pagedkv sequence of its encoder tokens in the same pool, with no keys (never
hit, never registered). That needs the other groups to be one full-attention group (a
companion sequence holds a table in every pagedkv group).
"""

from __future__ import annotations

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from pagedkv.groups import KVCacheGroup, has_null_block


def group_of(spec: KVCacheSpec) -> KVCacheGroup:
    """The pagedkv group of one vLLM KV-cache spec (not cross-attention: see `Layout`)."""
    if isinstance(spec, SlidingWindowSpec):
        return KVCacheGroup("sliding_window", window=spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return KVCacheGroup("chunked_local", chunk=spec.attention_chunk_size)
    if isinstance(spec, MambaSpec):
        return KVCacheGroup("state")
    if isinstance(spec, FullAttentionSpec) and spec.sliding_window is not None:
        return KVCacheGroup("sliding_window", window=spec.sliding_window)
    if isinstance(spec, FullAttentionSpec) and spec.attention_chunk_size is not None:
        return KVCacheGroup("chunked_local", chunk=spec.attention_chunk_size)
    if isinstance(spec, FullAttentionSpec):
        return KVCacheGroup("full")
    raise NotImplementedError(f"pagedkv.vllm: KV-cache spec {type(spec).__name__} is not supported")


class Layout:
    """The pagedkv side of a `KVCacheConfig`."""

    def __init__(self, config: KVCacheConfig, hash_block_size: int) -> None:
        specs = [g.kv_cache_spec for g in config.kv_cache_groups]
        if not specs:
            raise ValueError("pagedkv.vllm: the KV-cache config has no groups")
        sizes = {s.block_size for s in specs}
        if len(sizes) != 1:
            raise NotImplementedError(
                f"pagedkv.vllm: KV-cache groups with different block sizes {sorted(sizes)} "
                "are not supported (pagedkv's groups share one block size)"
            )
        self.specs = specs
        self.block_size: int = int(sizes.pop())
        if self.block_size % hash_block_size:
            raise ValueError(
                f"block size {self.block_size} is not a multiple of the hash block size "
                f"{hash_block_size}"
            )
        self.hash_block_size = hash_block_size
        self.hash_ratio = self.block_size // hash_block_size
        # vLLM group -> pagedkv group, None for cross-attention (a companion sequence).
        self.core_index: list[int | None] = []
        self.groups: list[KVCacheGroup] = []
        for s in specs:
            if isinstance(s, CrossAttentionSpec):
                self.core_index.append(None)
            else:
                self.core_index.append(len(self.groups))
                self.groups.append(group_of(s))
        self.num_groups = len(specs)
        self.num_core_groups = len(self.groups)
        self.has_cross = self.num_core_groups < self.num_groups
        if not self.groups:
            raise NotImplementedError("pagedkv.vllm: a layout of cross-attention only")
        plain = len(self.groups) == 1 and self.groups[0].kind == "full"
        if self.has_cross and not plain:
            raise NotImplementedError(
                "pagedkv.vllm: cross-attention is supported beside one full-attention group only"
            )
        # pagedkv has a null block (block 0) exactly when some group is not full attention
        # (the one rule: groups.has_null_block); vLLM always reserves block 0. Without
        # pagedkv's, its ids are vLLM's minus one.
        self.offset = 0 if has_null_block(self.groups) else 1
        self.num_vllm_blocks: int = int(config.num_blocks)
        self.core_num_blocks = config.num_blocks - self.offset
        self.core_groups = None if plain else self.groups

    def admission_caps(self, max_in_flight_tokens: int, max_model_len: int) -> list[int | None]:
        """Per pagedkv group, the most blocks vLLM's full-sequence admission charges one
        request (None: no cap). A sliding window or chunked local group gives its blocks
        back as a prefill moves on, so vLLM caps its reservation at what one request can
        hold at once, as its spec computes it (the same bound sizes the pool at start-up)."""
        caps: list[int | None] = []
        for s in self.specs:
            if isinstance(s, CrossAttentionSpec):
                continue
            if isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
                cap = s.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
                caps.append(int(cap))
            else:
                caps.append(None)
        return caps


__all__ = ["Layout", "group_of"]
