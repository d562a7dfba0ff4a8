"""vLLM 0.33's own CPU offloading with pagedkv's tier below it, driven on the CPU as the
OffloadingConnector's scheduler side drives it: `TieringOffloadingSpec` builds the real
`TieringOffloadingManager`, whose `SecondaryTierFactory` loads `PagedKVTier` by
``module_path``; a `Node` plays the GPU worker by writing chunks into the primary tier's
rows itself. Every manager call a `Node` makes is timed (`Node.slowest`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

T = TypeVar("T")
TIER = {"type": "PagedKVTier", "module_path": "pagedkv.vllm"}
#: Bytes of one chunk's row in the primary tier (one worker, one block per chunk).
ROW = 4096


def offload_config(extra: dict[str, Any], *, row_bytes: int = ROW, groups: int = 1) -> Any:
    """vLLM's normalised offloading config of a one-worker engine."""
    return OffloadingConfig(
        groups=tuple(
            OffloadingGroupConfig(tokens_per_block=16, layer_names=(f"layer{g}",), group_id=g)
            for g in range(groups)
        ),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=True,
        extra_config=extra,
        engine_id=f"pagedkv-test-{uuid.uuid4().hex}",
        model=OffloadingModelConfig(name="pagedkv/test-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def key(i: int, group: int = 0) -> OffloadKey:
    """A 32-byte block hash of `i` (as vLLM's sha256 hashes are) in `group`."""
    return make_offload_key(i.to_bytes(4, "big") * 8, group)


def block(seed: int, row_bytes: int = ROW) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, row_bytes, dtype=np.uint8).tobytes()


class Node:
    """One engine's scheduler side: the spec, its manager, the PagedKVTier, one request."""

    def __init__(
        self,
        tier_options: dict[str, Any],
        *,
        chunks: int = 32,
        row_bytes: int = ROW,
        groups: int = 1,
    ) -> None:
        extra = {
            "cpu_bytes_to_use": chunks * row_bytes,
            "secondary_tiers": [{**TIER, **tier_options}],
        }
        self.spec = TieringOffloadingSpec(offload_config(extra, row_bytes=row_bytes, groups=groups))
        self.m = self.spec.get_manager()
        self.tier = self.m.secondary_tiers[0]
        self.rows: np.ndarray = np.asarray(self.m.primary_tier.get_kv_memoryview()).view(np.uint8)
        self.slowest = 0.0  # the longest manager call so far, in seconds
        self.ctx = ReqContext(f"req-{uuid.uuid4().hex[:8]}")
        self.call(self.m.on_new_request, self.ctx)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.slowest = max(self.slowest, time.perf_counter() - t0)

    def step(self) -> None:
        self.call(self.m.on_schedule_end, ScheduleEndContext((), ()))

    def store(self, blocks: dict[OffloadKey, bytes]) -> list[OffloadKey]:
        """Offload `blocks` as the connector does (prepare, the worker's copy into the
        primary rows, complete: which cascades to the tier); the keys the primary took."""
        keys = list(blocks)
        out = self.call(self.m.prepare_store, keys, self.ctx)
        assert out is not None, "the primary tier is full"
        for k, cid in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
            self.rows[cid] = np.frombuffer(blocks[k], dtype=np.uint8)
        if out.keys_to_store:
            self.call(self.m.complete_store, out.keys_to_store, self.ctx)
        return list(out.keys_to_store)

    def settle(self, timeout: float = 20.0, poll: float = 0.002) -> None:
        """Step until no transfer is in flight (sleeping `poll` seconds between steps)."""
        deadline = time.monotonic() + timeout
        while self.call(self.m.has_pending_work):
            assert time.monotonic() < deadline, "transfers still in flight"
            self.step()
            time.sleep(poll)
        self.step()

    def resolve(
        self, keys: Sequence[OffloadKey], timeout: float = 20.0, poll: float = 0.002
    ) -> list[LookupResult]:
        """Look `keys` up step after step until each is HIT or MISS (a tier hit is promoted
        into the primary tier on the way)."""
        deadline = time.monotonic() + timeout
        while True:
            res = [self.call(self.m.lookup, k, self.ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                return res
            assert time.monotonic() < deadline, f"lookups never settled: {res}"
            self.step()
            time.sleep(poll)

    def fetch(self, keys: Sequence[OffloadKey]) -> list[bytes]:
        """The bytes of `keys` (all HIT in the primary tier) as a GPU load would read them."""
        spec = self.call(self.m.prepare_load, list(keys), self.ctx)
        out = [self.rows[cid].tobytes() for cid in spec.block_ids]
        self.call(self.m.complete_load, list(keys), self.ctx)
        return out

    def load(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, bytes | None]:
        """Each key's bytes through the primary tier (promoted from the tier if needed),
        None for a MISS."""
        res = self.resolve(keys)
        hits = [k for k, r in zip(keys, res, strict=True) if r is LookupResult.HIT]
        got = dict(zip(hits, self.fetch(hits), strict=True)) if hits else {}
        return {k: got.get(k) for k in keys}

    def forget_primary(self) -> None:
        """Empty vLLM's CPU tier (reset_cache drains the tiers first), so what follows is
        served by the secondary tier."""
        self.call(self.m.reset_cache)
        # vLLM 0.33 and 0.34 hold promotions after a reset until `on_reset_flushed`; 0.32 has
        # no such hold (nor the method).
        flushed = getattr(self.m, "on_reset_flushed", None)
        if flushed is not None:
            self.call(flushed)

    def close(self) -> None:
        self.rows = np.empty((0, 0), dtype=np.uint8)  # let go of the shared mapping
        self.m.on_request_finished(self.ctx)
        self.m.shutdown()


__all__ = ["ROW", "TIER", "Node", "block", "key", "offload_config"]
