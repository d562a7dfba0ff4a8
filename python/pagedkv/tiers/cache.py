"""`TieredCache`: a `BlockManager` and its `KVCachePool` with tiers below the GPU
(docs/tiers.md).

Demotion: the GPU evictions the manager logged (`record_evictions=True`) since the last call
are copied out of the pool in one batch (`blocks.copy_out`: on a GPU pool, on a stream of
its own, which the compute stream then waits for, so the next step's writes into a reused
block land after the copy read it), then stored in every tier by a background thread, so
an allocation never waits for a codec or the network. The copies in flight hold at most
`max_pending_bytes`; a batch that would exceed it is dropped (counted), never half-stored.
Each tier keeps what its own budget and LRU allow (tiers are inclusive, as LMCache's local
and remote backends are).

Promotion: `allocate` continues the prefix match below the GPU. Block `i` past the GPU hit
comes from the first tier that holds blocks up to `i` (each tier answers with the length of
its leading run), and the manager schedules those blocks with the rest of the prompt; the
returned plan says which tier entry goes into which new GPU block. `load` runs it before the
step reads them and returns how many prompt tokens the engine need not compute: the GPU hit
plus the loaded blocks up to the first that could not be read (a vanished or damaged entry
is recomputed by the step, whose KV then lands in the block the manager registered).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.events import BlockRemoved, BlockStored, KVEvent
from pagedkv.tiers.base import TierKey, TierStats, TierStore
from pagedkv.tiers.blocks import BlockCopy, block_nbytes, copy_in, copy_out


@dataclass(frozen=True, slots=True)
class TierAllocation:
    """What `TieredCache.allocate` did: the GPU hit, each tier's share of the hit (tokens,
    in tier order) and the load plan `(tier index, key, GPU block)`, in table order."""

    seq_id: int
    gpu_hit_tokens: int
    tier_hit_tokens: tuple[int, ...]
    plan: tuple[tuple[int, TierKey, int], ...]

    @property
    def hit_tokens(self) -> int:
        return self.gpu_hit_tokens + sum(self.tier_hit_tokens)


@dataclass
class TieredStats:
    """Tokens served from each tier, blocks and bytes moved, and each store's own stats."""

    tier_hit_tokens: list[int]
    blocks_demoted: int = 0
    bytes_demoted: int = 0
    blocks_promoted: int = 0
    bytes_promoted: int = 0
    failed_loads: int = 0
    dropped_demotions: int = 0  # blocks not copied out: the copies in flight were too many
    pending_bytes: int = 0  # copied out, not yet stored below
    seconds_demote_copy: float = 0.0
    seconds_load: float = 0.0
    stores: list[TierStats] = field(default_factory=list)


class TieredCache:
    """Tiers below the GPU for one manager and its pool. Thread-safe."""

    def __init__(
        self,
        manager: Any,
        pool: Any,
        stores: Sequence[TierStore],
        *,
        hash_algo: str = "sha256",
        hash_seed: int = 0,
        workers: int = 2,
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        if not stores:
            raise InvalidArgumentError("a TieredCache needs at least one tier store")
        if manager.stats().groups:
            raise InvalidArgumentError(
                "tiers with KV-cache groups are not supported yet (docs/tiers.md)"
            )
        if manager.block_size != pool.block_size or manager.num_blocks != pool.num_blocks:
            raise InvalidArgumentError("the pool's blocks must be the manager's")
        self.manager = manager
        self.pool = pool
        self.stores = list(stores)
        self._hash_algo = hash_algo
        self._hash_seed = hash_seed
        self._block_bytes = block_nbytes(pool)
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []
        self._stats = TieredStats(tier_hit_tokens=[0] * len(self.stores))
        if max_pending_bytes < 0:
            raise InvalidArgumentError("max_pending_bytes must be >= 0")
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._pending: set[Future[None]] = set()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedkv-tier")

    # ---- demotion ----------------------------------------------------------------------

    def demote(self) -> int:
        """Copy out every block the manager evicted since the last call and store it below
        (in the background). Call it after the scheduling calls of a step and before the
        step's device work (`load` calls it too). Returns the number of blocks copied out."""
        evicted = self.manager.drain_evictions()
        if not evicted:
            return 0
        nbytes = len(evicted) * self._block_bytes
        with self._lock:
            if self._pending_bytes + nbytes > self._max_pending:
                self._stats.dropped_demotions += len(evicted)
                return 0
            self._pending_bytes += nbytes
        t0 = time.perf_counter()
        copy = copy_out(self.pool, [b for b, _, _ in evicted])
        keys = [TierKey(g, d) for _, g, d in evicted]
        with self._lock:
            self._stats.blocks_demoted += len(keys)
            self._stats.bytes_demoted += nbytes
            self._stats.seconds_demote_copy += time.perf_counter() - t0
            fut = self._executor.submit(self._store_below, keys, copy)
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return len(keys)

    def _forget(self, fut: Future[None]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _store_below(self, keys: list[TierKey], copy: BlockCopy) -> None:
        try:
            copy.wait()
            for i, key in enumerate(keys):
                data = copy.block(i)
                for store in self.stores:
                    if store.put(key, data):
                        self._event(
                            BlockStored(
                                [key.digest],
                                None,
                                [],
                                self.pool.block_size,
                                None,
                                store.medium,
                                key.group,
                            )
                        )
                    self._removed(store)
        finally:
            with self._lock:
                self._pending_bytes -= copy.nbytes

    def _removed(self, store: TierStore) -> None:
        for key in store.drain_removed():
            self._event(BlockRemoved([key.digest], store.medium, key.group))

    def _event(self, e: KVEvent) -> None:
        with self._lock:
            self._events.append(e)

    def flush(self) -> None:
        """Wait until every background store has finished (tests, shutdown)."""
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            for fut in pending:
                fut.result()

    # ---- promotion ---------------------------------------------------------------------

    def _digests(self, token_ids: Any, cache_salt: Any, lora_id: Any) -> list[bytes]:
        from pagedkv import hash_blocks

        return hash_blocks(
            token_ids,
            self.manager.block_size,
            cache_salt=cache_salt,
            lora_id=lora_id,
            hash_algo=self._hash_algo,  # type: ignore[arg-type]
            seed=self._hash_seed,
        )

    def _below(self, keys: list[TierKey]) -> list[int]:
        """The store of each leading key that some tier holds (stops at the first none does)."""
        runs = [store.count_present(keys) for store in self.stores]
        return [next(t for t, n in enumerate(runs) if n > i) for i in range(max(runs, default=0))]

    def _match(
        self, token_ids: Any, cache_salt: Any, lora_id: Any
    ) -> tuple[int, list[bytes], list[int]]:
        """The GPU hit (blocks), the prompt's digests (hashed once) and the tier of each block
        past the GPU hit that the tiers hold."""
        bs: int = self.manager.block_size
        gpu = self.manager.lookup(token_ids, cache_salt=cache_salt, lora_id=lora_id) // bs
        digests = self._digests(token_ids, cache_salt, lora_id)
        cap = (len(token_ids) - 1) // bs  # at least one token computed, as on the GPU
        return gpu, digests, self._below([TierKey(0, d) for d in digests[gpu:cap]])

    def lookup(
        self, token_ids: Any, *, cache_salt: str | bytes | None = None, lora_id: int | None = None
    ) -> tuple[int, tuple[int, ...]]:
        """`(gpu hit tokens, tokens each tier would add)`; changes nothing."""
        bs: int = self.manager.block_size
        gpu, _, sources = self._match(token_ids, cache_salt, lora_id)
        return gpu * bs, tuple(sources.count(t) * bs for t in range(len(self.stores)))

    def allocate(
        self,
        seq_id: int,
        token_ids: Any,
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        lookahead: int = 0,
    ) -> TierAllocation | None:
        """`BlockManager.allocate` that also counts the blocks the tiers hold as cached:
        they are scheduled with the prompt and loaded by `load`. None if the blocks do not
        fit (nothing changed)."""
        bs: int = self.manager.block_size
        n = len(token_ids)
        g, digests, sources = self._match(token_ids, cache_salt, lora_id)
        k = n if num_new_tokens is None else num_new_tokens
        new = min(len(sources) * bs + k, n - g * bs)
        hit = self.manager.allocate(
            seq_id,
            token_ids,
            num_new_tokens=new,
            cache_salt=cache_salt,
            lora_id=lora_id,
            lookahead=lookahead,
        )
        if hit is None:
            return None
        if self.manager.block_hashes(seq_id)[: len(digests)] != digests:
            # A configuration error: undo the allocation before saying so.
            self.manager.free(seq_id)
            raise InvalidArgumentError(
                "the TieredCache's hash_algo/hash_seed are not the manager's"
            )
        h = hit // bs
        table = self.manager.block_table(seq_id)
        # Another thread may have cached more (or fewer) blocks since the lookup: load only
        # the tier blocks from where this GPU hit ends (none if it ends before them).
        plan = tuple(
            (sources[i - g], TierKey(0, digests[i]), table[i])
            for i in range(max(h, g), g + len(sources))
            if h >= g
        )
        shares = tuple(sum(1 for t, _, _ in plan if t == s) * bs for s in range(len(self.stores)))
        return TierAllocation(seq_id, hit, shares, plan)

    def load(self, alloc: TierAllocation) -> int:
        """Copy the plan's tier entries into their GPU blocks, in order, stopping at the first
        that cannot be read. Returns the prompt tokens the engine need not compute."""
        bs: int = self.manager.block_size
        # The plan's blocks may be ones just evicted: their KV goes out before this writes.
        self.demote()
        t0 = time.perf_counter()
        blocks: list[int] = []
        found: list[bytes] = []
        per_tier = [0] * len(self.stores)
        for t, key, block in alloc.plan:
            data = self.stores[t].get(key)
            if data is None or len(data) != self._block_bytes:
                with self._lock:
                    self._stats.failed_loads += 1
                break
            blocks.append(block)
            found.append(data)
            per_tier[t] += bs
        copy_in(self.pool, blocks, found)
        loaded = len(blocks)
        with self._lock:
            for t, n in enumerate(per_tier):
                self._stats.tier_hit_tokens[t] += n
            self._stats.blocks_promoted += loaded
            self._stats.bytes_promoted += loaded * self._block_bytes
            self._stats.seconds_load += time.perf_counter() - t0
        return alloc.gpu_hit_tokens + loaded * bs

    # ---- events, stats, shutdown -------------------------------------------------------

    def drain_events(self) -> list[KVEvent]:
        """Tier events (`BlockStored`/`BlockRemoved` with each tier's medium), in order."""
        for store in self.stores:
            self._removed(store)
        with self._lock:
            out, self._events = self._events, []
        return out

    def stats(self) -> TieredStats:
        with self._lock:
            s = self._stats
            return TieredStats(
                tier_hit_tokens=list(s.tier_hit_tokens),
                blocks_demoted=s.blocks_demoted,
                bytes_demoted=s.bytes_demoted,
                blocks_promoted=s.blocks_promoted,
                bytes_promoted=s.bytes_promoted,
                failed_loads=s.failed_loads,
                dropped_demotions=s.dropped_demotions,
                pending_bytes=self._pending_bytes,
                seconds_demote_copy=s.seconds_demote_copy,
                seconds_load=s.seconds_load,
                stores=[store.stats() for store in self.stores],
            )

    def close(self) -> None:
        self.flush()
        self._executor.shutdown(wait=True)


__all__ = ["TierAllocation", "TieredCache", "TieredStats"]
