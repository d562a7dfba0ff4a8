"""`TieredCache`: a `BlockManager` and its `KVCachePool` with tiers below the GPU
(docs/tiers.md).

Demotion is a duty of the call that evicts: every call here that takes GPU blocks passes
`evicted=` to the manager (`record_evictions=True`), which returns exactly the cached blocks
THAT call evicted, and copies them out of the pool before it returns, also when the call
raises (`blocks.copy_out`: on a GPU pool, on a stream of its own that the compute stream
then waits for, so the next step's writes into a reused block land after the copy read it;
on a CPU pool at once). No later call, and no other thread, can write an evicted block
before its KV is out, so a block's KV is never stored under another block's digest. The
copies are then stored in every tier by a background thread, so an allocation never waits
for a codec or the network. The copies in flight hold at most
`max_pending_bytes`; a batch that would exceed it is dropped (counted), never half-stored.
Each tier keeps what its own budget and LRU allow (tiers are inclusive, as LMCache's local
and remote backends are).

Promotion: `allocate` continues the prefix match below the GPU. Block `i` past the GPU hit
comes from the first tier that holds blocks up to `i` (each tier answers with the length of
its leading run; with KV-cache groups, every group's entry of block `i` must be held), and
the manager schedules those blocks with the rest of the prompt; the returned plan says which
tier entry goes into which new GPU block. `load` runs it before the
step reads them and returns how many prompt tokens the engine need not compute: the GPU hit
plus the loaded blocks up to the first that could not be read (a vanished or damaged entry
is recomputed by the step, whose KV then lands in the block the manager registered).

Without a pool (`pool=None`: count-only, as the simulator's default tier run) no byte
moves: a block is 0 bytes, demotion puts each evicted key into the stores and a load only
asks them for it (`tiers.digests.DigestTier` holds keys and no bytes). With `workers=0`
demotion stores in the calling thread before the call returns (deterministic: the
simulator's runs repeat exactly), and `events=False` keeps no `BlockStored`/`BlockRemoved`
events (nobody drains them in a replay of millions of blocks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedkv.errors import InvalidArgumentError
from pagedkv.events import BlockRemoved, BlockStored, KVEvent, KVEventQueueStats
from pagedkv.tiers.base import TierKey, TierStats, TierStore
from pagedkv.tiers.blocks import BlockCopy, block_nbytes, copy_in, copy_out
from pagedkv.tiers.event_queue import EventQueue

T = TypeVar("T")
Evicted = list[tuple[int, int, bytes]]
Pairs = list[tuple[int, int]] | None


@dataclass(frozen=True, slots=True)
class TierAllocation:
    """What `TieredCache.allocate` did: the GPU hit, each tier's share of the hit (tokens,
    in tier order) and the load plan `(tier index, key, GPU block)`, in table order
    (position by position, then group by group); `positions[j]` is the block position of
    `plan[j]`."""

    seq_id: int
    gpu_hit_tokens: int
    tier_hit_tokens: tuple[int, ...]
    plan: tuple[tuple[int, TierKey, int], ...]
    positions: tuple[int, ...] = ()

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
    """Tiers below the GPU for one manager and its pool. Thread-safe.

    Call the manager's block-taking calls through this object (`allocate`, `extend`,
    `append`, `append_batch`, `step`, `truncate`, `swap_in`, `fork`): each copies out the
    cached blocks it evicted before it returns. `free`, `free_batch` and `swap_out` take no
    GPU blocks and are passed through for convenience."""

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
        events: bool = True,
    ) -> None:
        if not stores:
            raise InvalidArgumentError("a TieredCache needs at least one tier store")
        if not manager.record_evictions:
            raise InvalidArgumentError(
                "a TieredCache needs a manager built with record_evictions=True"
            )
        self._groups: int = manager.num_groups
        #: A manager with groups numbers its null block 0 (its pool does too).
        self._null_block = bool(manager.stats().groups)
        if pool is not None:
            if manager.block_size != pool.block_size or manager.num_blocks != pool.num_blocks:
                raise InvalidArgumentError("the pool's blocks must be the manager's")
            if self._null_block != bool(pool.null_block):
                raise InvalidArgumentError(
                    "a manager with KV-cache groups needs a pool with groups, and only it does"
                )
        if max_pending_bytes < 0:
            raise InvalidArgumentError("max_pending_bytes must be >= 0")
        w: object = workers
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise InvalidArgumentError("workers must be an int >= 0 (0: store in the caller)")
        self.manager = manager
        self.pool = pool
        self.stores = list(stores)
        self._hash_algo = hash_algo
        self._hash_seed = hash_seed
        self._block_bytes = block_nbytes(pool) if pool is not None else 0
        self._keep_events = events
        self._lock = threading.Lock()
        self._events = EventQueue()
        self._stats = TieredStats(tier_hit_tokens=[0] * len(self.stores))
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._pending: set[Future[None]] = set()
        self._executor = (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedkv-tier")
            if workers
            else None
        )

    # ---- the block-taking calls, each with its own demotion duty -----------------------

    def _with_duty(self, call: Callable[[Evicted], T]) -> T:
        """Run `call(evicted)` (a manager call given `evicted=`) and copy out the blocks it
        evicted before returning, whether it returned or raised."""
        evicted: Evicted = []
        try:
            return call(evicted)
        finally:
            self._demote(evicted)

    def extend(self, seq_id: int, num_new_tokens: int, *, lookahead: int = 0) -> Pairs:
        """`BlockManager.extend`, demoting what it evicted."""
        out: Pairs = self._with_duty(
            lambda ev: self.manager.extend(seq_id, num_new_tokens, lookahead=lookahead, evicted=ev)
        )
        return out

    def append(self, seq_id: int, token_ids: Any, *, lookahead: int = 0) -> Pairs:
        """`BlockManager.append`, demoting what it evicted."""
        out: Pairs = self._with_duty(
            lambda ev: self.manager.append(seq_id, token_ids, lookahead=lookahead, evicted=ev)
        )
        return out

    def append_batch(self, seq_ids: Any, token_ids: Any, *, lookahead: int = 0) -> Any:
        """`BlockManager.append_batch`, demoting what it evicted."""
        return self._with_duty(
            lambda ev: self.manager.append_batch(
                seq_ids, token_ids, lookahead=lookahead, evicted=ev
            )
        )

    def step(self, batch: Any, token_ids: Any) -> Any:
        """`RunningBatch.step` of a batch of this manager, demoting what it evicted."""
        return self._with_duty(lambda ev: batch.step(token_ids, evicted=ev))

    def truncate(self, seq_id: int, num_tokens: int) -> Pairs:
        """`BlockManager.truncate` (its copy-on-write copy may evict), demoting what it
        evicted."""
        out: Pairs = self._with_duty(
            lambda ev: self.manager.truncate(seq_id, num_tokens, evicted=ev)
        )
        return out

    def swap_in(self, seq_id: int) -> Pairs:
        """`BlockManager.swap_in`, demoting what it evicted."""
        out: Pairs = self._with_duty(lambda ev: self.manager.swap_in(seq_id, evicted=ev))
        return out

    def fork(self, parent_id: int, child_id: int) -> None:
        """`BlockManager.fork` (it shares blocks and evicts none; kept here so that every
        call that may take blocks has its duty checked)."""
        self._with_duty(lambda ev: self.manager.fork(parent_id, child_id, evicted=ev))

    def free(self, seq_id: int, *, num_computed_tokens: int | None = None) -> None:
        """`BlockManager.free` (takes no block: no duty)."""
        self.manager.free(seq_id, num_computed_tokens=num_computed_tokens)

    def free_batch(self, seq_ids: Any) -> None:
        """`BlockManager.free_batch` (takes no block: no duty)."""
        self.manager.free_batch(seq_ids)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """`BlockManager.swap_out` (takes CPU blocks only: no duty)."""
        result: list[tuple[int, int]] | None = self.manager.swap_out(seq_id)
        return result

    # ---- demotion ----------------------------------------------------------------------

    def _demote(self, evicted: Evicted) -> int:
        """Copy out the blocks one call evicted (its caller owns them and has not written
        them yet) and store them below, in the background (or at once with `workers=0`).
        Returns the blocks copied out."""
        if not evicted:
            return 0
        # tuple.__new__ builds the same TierKey without NamedTuple's Python-level __new__
        # (a third of the cost per block in a count-only replay).
        make = tuple.__new__
        keys = [make(TierKey, (g, d)) for _, g, d in evicted]
        if self.pool is None:  # count-only: no bytes to copy
            with self._lock:
                self._stats.blocks_demoted += len(keys)
            self._store_keys(keys)
            return len(keys)
        nbytes = len(evicted) * self._block_bytes
        sync = self._executor is None
        with self._lock:
            if not sync and self._pending_bytes + nbytes > self._max_pending:
                self._stats.dropped_demotions += len(evicted)
                return 0
            self._pending_bytes += nbytes
        t0 = time.perf_counter()
        try:
            copy = copy_out(self.pool, [b for b, _, _ in evicted])
        except BaseException:
            with self._lock:
                self._pending_bytes -= nbytes
            raise
        with self._lock:
            self._stats.blocks_demoted += len(keys)
            self._stats.bytes_demoted += nbytes
            self._stats.seconds_demote_copy += time.perf_counter() - t0
            if sync:
                fut = None
            else:
                assert self._executor is not None
                fut = self._executor.submit(self._store_below, keys, copy)
                self._pending.add(fut)
        if fut is None:
            self._store_below(keys, copy)
        else:
            fut.add_done_callback(self._forget)
        return len(keys)

    def _store_keys(self, keys: list[TierKey]) -> None:
        """Count-only demotion: each key into every store (in a batch where the store takes
        one, as `DigestTier.put_many` does)."""
        for store in self.stores:
            many = getattr(store, "put_many", None)
            if many is not None and not self._keep_events:
                many(keys)
            else:
                for key in keys:
                    if store.put(key, b"") and self._keep_events:
                        self._stored_event(store, key)
            self._removed(store)

    def _forget(self, fut: Future[None]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def _store_below(self, keys: list[TierKey], copy: BlockCopy) -> None:
        try:
            copy.wait()
            for i, key in enumerate(keys):
                data = copy.block(i)
                for store in self.stores:
                    if store.put(key, data) and self._keep_events:
                        self._stored_event(store, key)
                    self._removed(store)
        finally:
            with self._lock:
                self._pending_bytes -= copy.nbytes

    def _stored_event(self, store: TierStore, key: TierKey) -> None:
        bs: int = self.manager.block_size
        self._event(BlockStored([key.digest], None, [], bs, None, store.medium, key.group))

    def _removed(self, store: TierStore) -> None:
        removed = store.drain_removed()
        if self._keep_events:
            for key in removed:
                self._event(BlockRemoved([key.digest], store.medium, key.group))

    def _event(self, e: KVEvent) -> None:
        self._events.push(e)

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

    def _below(self, digests: list[bytes]) -> list[int]:
        """The store of each leading block that the tiers hold in every group (stops at the
        first block some group's entry of is held by no tier); a block's store is the first
        tier that holds its group-0 entry."""
        held = len(digests)
        first: list[int] = []
        make = tuple.__new__  # TierKey at C speed: a key per block of every prompt
        for g in range(self._groups):
            keys = [make(TierKey, (g, d)) for d in digests[:held]]
            runs = [store.count_present(keys) for store in self.stores]
            held = min(held, max(runs, default=0))
            if g == 0:
                # Block i's store is the first whose run is longer than i: the stores' runs
                # as a running maximum hand out consecutive ranges of blocks.
                reach = 0
                for t, n in enumerate(runs):
                    if n > reach:
                        first += [t] * (n - reach)
                        reach = n
        return first[:held]

    def _match(
        self, token_ids: Any, cache_salt: Any, lora_id: Any
    ) -> tuple[int, list[bytes], list[int]]:
        """The GPU hit (blocks), the prompt's digests (hashed once) and the tier of each block
        past the GPU hit that the tiers hold."""
        bs: int = self.manager.block_size
        gpu = self.manager.lookup(token_ids, cache_salt=cache_salt, lora_id=lora_id) // bs
        digests = self._digests(token_ids, cache_salt, lora_id)
        cap = (len(token_ids) - 1) // bs  # at least one token computed, as on the GPU
        return gpu, digests, self._below(digests[gpu:cap])

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
        they are scheduled with the prompt and loaded by `load`. The cached blocks it
        evicted are copied out before it returns. None if the blocks do not fit (nothing
        changed)."""
        bs: int = self.manager.block_size
        n = len(token_ids)
        g, digests, sources = self._match(token_ids, cache_salt, lora_id)
        k = n if num_new_tokens is None else num_new_tokens
        new = min(len(sources) * bs + k, n - g * bs)
        hit = self._with_duty(
            lambda ev: self.manager.allocate(
                seq_id,
                token_ids,
                num_new_tokens=new,
                cache_salt=cache_salt,
                lora_id=lora_id,
                lookahead=lookahead,
                evicted=ev,
            )
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
        tables = [self.manager.block_table(seq_id, group=x) for x in range(self._groups)]
        # Another thread may have cached more (or fewer) blocks since the lookup: load only
        # the tier blocks from where this GPU hit ends (none if it ends before them). A
        # group's null entry (a block it no longer needs) loads nothing.
        plan: list[tuple[int, TierKey, int]] = []
        positions: list[int] = []
        shares = [0] * len(self.stores)
        for i in range(max(h, g), g + len(sources)) if h >= g else ():
            shares[sources[i - g]] += bs
            for x, table in enumerate(tables):
                if not (self._null_block and table[i] == 0):
                    plan.append((sources[i - g], TierKey(x, digests[i]), table[i]))
                    positions.append(i)
        return TierAllocation(seq_id, hit, tuple(shares), tuple(plan), tuple(positions))

    def load(self, alloc: TierAllocation) -> int:
        """Copy the plan's tier entries into their GPU blocks, in order, stopping at the
        first block position with an entry that cannot be read (that block is computed by
        the step). Returns the prompt tokens the engine need not compute. The blocks it
        writes were demoted by the call that took them (`allocate`), so this has no duty."""
        bs: int = self.manager.block_size
        t0 = time.perf_counter()
        blocks: list[int] = []
        found: list[bytes] = []
        tiers: list[int] = []
        positions = alloc.positions or tuple(
            alloc.gpu_hit_tokens // bs + j for j in range(len(alloc.plan))
        )
        stop = None
        for (t, key, block), i in zip(alloc.plan, positions, strict=True):
            data = self.stores[t].get(key)
            if data is None or len(data) != self._block_bytes:
                with self._lock:
                    self._stats.failed_loads += 1
                stop = i
                break
            blocks.append(block)
            found.append(data)
            tiers.append(t)
        if stop is not None:
            # Entries of the failed position already read are not written: it is computed.
            keep = sum(1 for i in positions[: len(blocks)] if i < stop)
            del blocks[keep:], found[keep:], tiers[keep:]
        if self.pool is not None:
            copy_in(self.pool, blocks, found)
        # Positions come in order, each with its groups' entries: count each once, for the
        # tier of its first entry.
        per_tier = [0] * len(self.stores)
        done, last = 0, -1
        for i, t in zip(positions[: len(blocks)], tiers, strict=True):
            if i != last:
                per_tier[t] += bs
                done, last = done + 1, i
        with self._lock:
            for t, tokens in enumerate(per_tier):
                self._stats.tier_hit_tokens[t] += tokens
            self._stats.blocks_promoted += len(blocks)
            self._stats.bytes_promoted += len(blocks) * self._block_bytes
            self._stats.seconds_load += time.perf_counter() - t0
        return alloc.gpu_hit_tokens + done * bs

    # ---- events, stats, shutdown -------------------------------------------------------

    def drain_events(self) -> list[KVEvent]:
        """Tier events (`BlockStored`/`BlockRemoved` with each tier's medium), in order."""
        for store in self.stores:
            self._removed(store)
        return self._events.drain()

    def kv_event_snapshot(self) -> list[BlockStored]:
        """Every tier block the tier events so far describe, one `BlockStored` each, taken
        between two events: the queue restarts empty (as `BlockManager.kv_event_snapshot`;
        the manager's own blocks are in its snapshot)."""
        for store in self.stores:
            self._removed(store)
        return self._events.snapshot()

    def set_kv_event_capacity(self, capacity: int | None) -> None:
        """Bound the tier event queue (None: unbounded, the default); past it,
        `drain_events()` raises `KVEventsOverflowError` until `kv_event_snapshot()`."""
        self._events.set_capacity(capacity)

    def kv_event_queue_stats(self) -> KVEventQueueStats:
        return self._events.stats()

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
        if self._executor is not None:
            self._executor.shutdown(wait=True)


__all__ = ["TierAllocation", "TieredCache", "TieredStats"]
