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

Promotion: `allocate` continues the prefix match below the GPU by the manager's own hybrid
hit rule (`tiers.promotion`): a hit of `L` blocks needs every block of a full-attention
group but only a window's (a chunk's) last blocks before `L`; the GPU hit's blocks count as
held, the others must be held by some tier (the first that holds a block serves it). The
manager schedules the blocks past its GPU hit with the rest of the prompt; the returned plan
says which tier entry goes into which new GPU block. Entries the hit does not need (a
window's blocks before it) are withdrawn from the prefix cache at once, and a `truncate`
back into them is refused (`tiers.stale`). `load` runs the plan before the step reads the
blocks and returns how many prompt tokens the engine need not compute: the longest hit the
same rule finds over the GPU hit and the blocks loaded (a vanished or damaged entry ends the
loads; the step computes the rest, whose KV then lands in the blocks the manager
registered).

Errors: the cache takes the manager's hash settings (others are refused when it is built);
anything that fails in `allocate` after the manager's call succeeded, or in `load`, frees
the sequence with `num_computed_tokens=` its GPU hit before the exception propagates, so no
block it registered stays cached uncomputed; a call that raises keeps its own exception when
the copy-out of what it evicted raises too (the copy-out's is added as a note).

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
from pagedkv.groups import KVCacheGroup, has_null_block
from pagedkv.tiers.base import TierKey, TierStats, TierStore
from pagedkv.tiers.blocks import BlockCopy, block_nbytes, copy_in, copy_out
from pagedkv.tiers.cache_checks import check_pool_groups, note, tokens_arg
from pagedkv.tiers.event_queue import EventQueue
from pagedkv.tiers.promotion import PLAIN, Match, find_held, first_needed, hybrid_hit, shares
from pagedkv.tiers.stale import StaleEntries

T = TypeVar("T")
Evicted = list[tuple[int, int, bytes]]
Pairs = list[tuple[int, int]] | None


@dataclass(frozen=True, slots=True)
class TierAllocation:
    """What `TieredCache.allocate` did: the GPU hit, each tier's share of the hit (tokens,
    in tier order) and the load plan `(tier index, key, GPU block)` of the entries the hit
    needs past the GPU hit (every group's by the hybrid rule: a window's last blocks only),
    in table order (position by position, then group by group); `positions[j]` is the block
    position of `plan[j]`."""

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
        hash_algo: str | None = None,
        hash_seed: int | None = None,
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
        if not manager.enable_prefix_caching:
            raise InvalidArgumentError(
                "a TieredCache needs a manager with prefix caching (it caches no block to demote)"
            )
        # Keys below the GPU are the manager's own digests: other hash settings would
        # register blocks under one digest and look them up under another.
        for name, mine, given in (
            ("hash_algo", manager.hash_algo, hash_algo),
            ("hash_seed", manager.hash_seed, hash_seed),
        ):
            if given is not None and given != mine:
                raise InvalidArgumentError(
                    f"the TieredCache's {name}={given!r} is not the manager's {name}={mine!r} "
                    f"(leave it out: the manager's is used)"
                )
        self._kinds: tuple[KVCacheGroup, ...] = manager.groups or PLAIN
        self._groups: int = manager.num_groups
        #: Block 0 is the null block when the manager has one (the one rule of
        #: `pagedkv.groups.has_null_block`); the pool must agree.
        self._null_block = has_null_block(manager.groups)
        if pool is not None:
            if manager.block_size != pool.block_size or manager.num_blocks != pool.num_blocks:
                raise InvalidArgumentError("the pool's blocks must be the manager's")
            check_pool_groups(manager.groups, pool, self._null_block)
        if max_pending_bytes < 0:
            raise InvalidArgumentError("max_pending_bytes must be >= 0")
        w: object = workers
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise InvalidArgumentError("workers must be an int >= 0 (0: store in the caller)")
        self.manager = manager
        self.pool = pool
        self.stores = list(stores)
        self._hash_algo: str = manager.hash_algo
        self._hash_seed: int = manager.hash_seed
        self._block_bytes = block_nbytes(pool) if pool is not None else 0
        self._keep_events = events
        self._lock = threading.Lock()
        self._events = EventQueue()
        self._stats = TieredStats(tier_hit_tokens=[0] * len(self.stores))
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._pending: set[Future[None]] = set()
        self._stale = StaleEntries()
        self._executor = (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedkv-tier")
            if workers
            else None
        )

    # ---- the block-taking calls, each with its own demotion duty -----------------------

    def _with_duty(self, call: Callable[[Evicted], T]) -> T:
        """Run `call(evicted)` (a manager call given `evicted=`) and copy out the blocks it
        evicted before returning, whether it returned or raised. When both the call and the
        copy-out raise, the call's exception is raised, the copy-out's noted on it."""
        evicted: Evicted = []
        try:
            out = call(evicted)
        except BaseException as exc:
            self._demote_noting(evicted, exc)
            raise
        self._demote(evicted)
        return out

    def _demote_noting(self, evicted: Evicted, exc: BaseException) -> None:
        """`_demote` after a call that raised `exc`: a failure of the copy-out is added to
        `exc` as a note (its traceback included), never raised in its place."""
        try:
            self._demote(evicted)
        except BaseException as failed:
            note(exc, f"and the copy-out of the {len(evicted)} block(s) it evicted raised", failed)

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
        evicted. A truncate after which a window or chunk would need entries a tier hit
        skipped (they hold no KV: `tiers.stale`) is refused, changing nothing."""
        self._stale.check_truncate(seq_id, num_tokens, self._kinds, self.manager.block_size)
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
        self._stale.fork(parent_id, child_id)

    def free(self, seq_id: int, *, num_computed_tokens: int | None = None) -> None:
        """`BlockManager.free` (takes no block: no duty)."""
        self.manager.free(seq_id, num_computed_tokens=num_computed_tokens)
        self._stale.drop(seq_id)

    def free_batch(self, seq_ids: Any) -> None:
        """`BlockManager.free_batch` (takes no block: no duty)."""
        self.manager.free_batch(seq_ids)
        if len(self._stale):
            for sid in list(seq_ids):
                self._stale.drop(int(sid))

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

    def _match(self, token_ids: Any, cache_salt: Any, lora_id: Any) -> Match:
        """The GPU hit (blocks), the prompt's digests (hashed once), the cap (at least one
        token computed, as on the GPU) and the tier that holds each block past the GPU hit
        (`promotion.find_held`)."""
        bs: int = self.manager.block_size
        gpu = self.manager.lookup(token_ids, cache_salt=cache_salt, lora_id=lora_id) // bs
        digests = self._digests(token_ids, cache_salt, lora_id)
        cap = min((len(token_ids) - 1) // bs, len(digests))
        held = find_held(self.stores, self._kinds, digests, gpu, cap, bs)
        return Match(self._kinds, bs, gpu, digests, cap, held)

    def lookup(
        self, token_ids: Any, *, cache_salt: str | bytes | None = None, lora_id: int | None = None
    ) -> tuple[int, tuple[int, ...]]:
        """`(gpu hit tokens, tokens each tier would add)`; changes nothing."""
        bs: int = self.manager.block_size
        match = self._match(token_ids, cache_salt, lora_id)
        end = match.hit(match.gpu, match.cap)
        shares = match.shares(len(self.stores), match.gpu, end, match.needed(match.gpu, end))
        return match.gpu * bs, tuple(shares)

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
        """`BlockManager.allocate` that also counts the blocks the tiers hold as cached, by
        the manager's hybrid hit rule: they are scheduled with the prompt and loaded by
        `load`. The cached blocks it evicted are copied out before it returns. None if the
        blocks do not fit (nothing changed). If anything fails after the manager's call
        succeeded, the sequence is freed with `num_computed_tokens=` its GPU hit (nothing
        it registered stays cached) before the exception propagates."""
        bs: int = self.manager.block_size
        n = len(token_ids)
        k = n if num_new_tokens is None else tokens_arg(num_new_tokens, n)
        match = self._match(token_ids, cache_salt, lora_id)
        end = match.hit(match.gpu, match.cap)
        new = min((end - match.gpu) * bs + k, n - match.gpu * bs)
        evicted: Evicted = []
        try:
            hit = self.manager.allocate(
                seq_id,
                token_ids,
                num_new_tokens=new,
                cache_salt=cache_salt,
                lora_id=lora_id,
                lookahead=lookahead,
                evicted=evicted,
            )
        except BaseException as exc:
            self._demote_noting(evicted, exc)
            raise
        if hit is None:
            return None  # a refused call evicts nothing
        try:
            self._demote(evicted)
            return self._plan(seq_id, hit, match)
        except BaseException as exc:
            self._undo(seq_id, hit, exc)
            raise

    def _plan(self, seq_id: int, hit: int, match: Match) -> TierAllocation:
        """The load plan of a sequence the manager just allocated with GPU hit `hit`."""
        bs: int = self.manager.block_size
        if self.manager.block_hashes(seq_id)[: len(match.digests)] != match.digests:
            raise InvalidArgumentError(
                "the manager's digests of this prompt are not the TieredCache's"
            )
        h = hit // bs
        # Another thread may have cached more (or fewer) blocks since the look-up: the hit
        # is found again from where this GPU hit ends, within what the call scheduled.
        cap = min(match.cap, self.manager.num_scheduled_tokens(seq_id) // bs)
        end = match.hit(h, cap)
        tables = [self.manager.block_table(seq_id, group=x) for x in range(self._groups)]
        needed = match.needed(h, end)
        plan: list[tuple[int, TierKey, int]] = []
        positions: list[int] = []
        for i, x, t in needed:
            if t < 0 or (self._null_block and tables[x][i] == 0):  # the rule guarantees both
                raise RuntimeError(f"pagedkv.tiers: no entry to load for group {x} block {i}")
            plan.append((t, TierKey(x, match.digests[i]), tables[x][i]))
            positions.append(i)
        # The entries of `h .. end` no group needs for this hit (a window's blocks before
        # it): the manager registered them as scheduled, yet neither a load nor the step
        # writes them, so they leave the cache now (the step does not read them).
        stale = [
            tables[x][i]
            for x, kind in enumerate(self._kinds)
            for i in range(h, min(first_needed(kind, end, bs), end))
            if not (self._null_block and tables[x][i] == 0)
        ]
        if stale:
            self.manager.evict_blocks(stale)
        self._stale.set(
            seq_id,
            tuple((h, max(h, min(first_needed(k, end, bs), end))) for k in self._kinds),
            self.manager,
        )
        shares = match.shares(len(self.stores), h, end, needed)
        return TierAllocation(seq_id, hit, tuple(shares), tuple(plan), tuple(positions))

    def _undo(self, seq_id: int, computed: int, exc: BaseException) -> None:
        """After `exc`, past the manager's call: free the sequence with `num_computed_tokens`
        = the tokens really computed (its GPU hit), withdrawing every block it registered
        past them, so no block stays cached that nothing computed or loaded."""
        self._stale.drop(seq_id)
        try:
            self.manager.free(seq_id, num_computed_tokens=computed)
        except BaseException as failed:
            note(exc, f"and freeing sequence {seq_id} after it raised", failed)

    def load(self, alloc: TierAllocation) -> int:
        """Copy the plan's tier entries into their GPU blocks, in order, stopping at the
        first entry that cannot be read; returns the prompt tokens the engine need not
        compute: the longest hit the manager's hybrid rule finds over the GPU hit and the
        blocks loaded (the step computes the rest, whose KV then lands in the blocks the
        manager registered). The blocks it writes were demoted by the call that took them
        (`allocate`), so this has no duty. If it raises, the sequence is freed with
        `num_computed_tokens=` its GPU hit before the exception propagates."""
        try:
            return self._load(alloc)
        except BaseException as exc:
            self._undo(alloc.seq_id, alloc.gpu_hit_tokens, exc)
            raise

    def _load(self, alloc: TierAllocation) -> int:
        bs: int = self.manager.block_size
        t0 = time.perf_counter()
        if len(alloc.positions) != len(alloc.plan):
            raise InvalidArgumentError("a TierAllocation's plan and positions differ in length")
        h = alloc.gpu_hit_tokens // bs
        end = alloc.hit_tokens // bs
        got: dict[tuple[int, int], tuple[int, bytes, int]] = {}
        stop = end
        for (t, key, block), i in zip(alloc.plan, alloc.positions, strict=True):
            data = self.stores[t].get(key)
            if data is None or len(data) != self._block_bytes:
                with self._lock:
                    self._stats.failed_loads += 1
                stop = i
                break
            got[(key.group, i)] = (block, data, t)
        served = end
        if stop < end:  # the hit the blocks read still give (a window needs its last ones)
            served = hybrid_hit(self._kinds, bs, stop, lambda g, i: (g, i) in got, known=h)
        if served < end:  # the step computes the blocks from `served` on
            self._stale.clip(alloc.seq_id, served)
        write = [(i, v) for (_, i), v in got.items() if i < served]
        if self.pool is not None:
            copy_in(self.pool, [b for _, (b, _, _) in write], [d for _, (_, d, _) in write])
        needed = [(i, k.group, t) for (t, k, _), i in zip(alloc.plan, alloc.positions, strict=True)]
        per_tier = shares(bs, len(self.stores), h, served, needed)
        with self._lock:
            for t, tokens in enumerate(per_tier):
                self._stats.tier_hit_tokens[t] += tokens
            self._stats.blocks_promoted += len(write)
            self._stats.bytes_promoted += len(write) * self._block_bytes
            self._stats.seconds_load += time.perf_counter() - t0
        return served * bs

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
