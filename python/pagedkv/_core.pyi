"""Typed stubs of the Rust extension module `pagedkv._core` (checked by `mypy.stubtest`)."""

from array import array
from collections.abc import Sequence
from typing import Any, Literal, Self, TypeAlias, final

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

from pagedkv.alloc_status import AllocStatus
from pagedkv.events import BlockStored, KVEvent, KVEventQueueStats
from pagedkv.groups import KVCacheGroup
from pagedkv.stats import Stats

# The accepted inputs (docs/inputs.md): exact lists and tuples of ints, ranges, 1-D integer
# arrays; a scalar int is an int or a numpy integer scalar (never a bool).
_Int: TypeAlias = int | np.integer[Any]
_IntArray: TypeAlias = npt.NDArray[np.integer[Any]]
_Ints: TypeAlias = list[int] | list[_Int] | tuple[_Int, ...] | range | _IntArray
_TokenIds: TypeAlias = _Ints
_SeqIds: TypeAlias = _Ints
_Salt: TypeAlias = str | bytes | None
_HashAlgo: TypeAlias = Literal["sha256", "xxh3_128"]
_Eviction: TypeAlias = Literal["lru", "s3fifo", "arc", "lfu", "slru", "priority"]
# `allocate(retention=...)`: (start_token, end_token or None, priority, duration_s or None).
_RetentionRange: TypeAlias = tuple[_Int, _Int | None, _Int, float | None]
# `evicted=`: the list a block-taking call appends its evictions to, (block, group, digest).
_Evicted: TypeAlias = list[tuple[int, int, bytes]]
# `block_hashes=`: the caller's keys of full blocks (exact lists and tuples of 1..=128 bytes).
_Keys: TypeAlias = list[bytes] | tuple[bytes, ...]

__all__ = [
    "BlockManager",
    "BlockReplay",
    "DeferredDecodes",
    "EngineRecord",
    "HeldBlocks",
    "MrcStream",
    "RouterIndex",
    "RunningBatch",
    "__version__",
    "hash_blocks",
    "schedule_replay",
    "trace_tokens",
]

__version__: str

def hash_blocks(
    token_ids: _TokenIds,
    block_size: int,
    *,
    cache_salt: _Salt = None,
    lora_id: _Int | None = None,
    hash_algo: _HashAlgo = "sha256",
    seed: int = 0,
) -> list[bytes]:
    """Chain digests of the full blocks of `token_ids` (see docs/hashing.md)."""

@disjoint_base
class BlockManager:
    """Paged KV-cache block manager (Rust core). Safe to call from many threads."""

    def __new__(
        cls,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        hash_algo: _HashAlgo = "sha256",
        hash_seed: int = 0,
        watermark: float = 0.01,
        enable_kv_events: bool = False,
        record_evictions: bool = False,
        eviction: _Eviction = "lru",
        tenants: bool = False,
        groups: Sequence[KVCacheGroup] | None = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> Self: ...

    # -- per-sequence operations ------------------------------------------------------------
    def allocate(
        self,
        seq_id: _Int,
        token_ids: _TokenIds,
        *,
        num_new_tokens: _Int | None = None,
        cache_salt: _Salt = None,
        lora_id: _Int | None = None,
        lookahead: _Int = 0,
        evicted: _Evicted | None = None,
        block_hashes: _Keys | None = None,
        max_hit_tokens: _Int | None = None,
        register: bool = True,
        retention: Sequence[_RetentionRange] | None = None,
        decode_retention: tuple[_Int, float | None] | None = None,
        loaded_tokens: _Int = 0,
        reachable_tokens: Sequence[_Int] | None = None,
    ) -> int | None:
        """Give a new sequence its blocks for the hit plus `num_new_tokens` prompt tokens
        (default all); returns the prefix-hit tokens, or None if full. `evicted` (with
        `record_evictions=True`) gets the (block, group, digest) of each cached block this
        call evicted, appended before it returns or raises. `block_hashes`: the caller's
        keys of the full blocks (the sequence is keyed by them, not its tokens);
        `max_hit_tokens` caps the hit; `register=False` holds registration until
        `register`; `loaded_tokens`: of the tokens scheduled past the hit, how many have KV
        loaded from outside (a group that skips leading tokens then needs only the hit
        blocks it reads past them); `reachable_tokens` (with a sparse
        `prefix_cache_retention_interval`): the positions a later hit can resume at, whose
        window tails the window groups cache (default: the prompt less one token)."""
    def extend(
        self,
        seq_id: _Int,
        num_new_tokens: _Int,
        *,
        lookahead: _Int = 0,
        evicted: _Evicted | None = None,
        release: bool = True,
    ) -> list[tuple[int, int]] | None:
        """Schedule the next prompt chunk; returns copy-on-write pairs, or None if full.
        `release=False` leaves the entries the groups no longer need (`release_skipped`)."""
    def append(
        self,
        seq_id: _Int,
        token_ids: _TokenIds,
        *,
        lookahead: _Int = 0,
        evicted: _Evicted | None = None,
        block_hashes: _Keys | None = None,
        release: bool = True,
    ) -> list[tuple[int, int]] | None:
        """Append tokens (and reserve `lookahead` draft slots past them; tokens may be empty
        with lookahead or keys); returns the copy-on-write (src, dst) pairs, or None if full.
        `block_hashes` continues a caller-keyed sequence's keys; `release` as `extend`'s."""
    def release_skipped(self, seq_id: _Int, num_tokens: _Int) -> int:
        """Release the entries each group no longer needs at position `num_tokens` (at most
        the scheduled tokens), tail first; never refused. Returns how many."""
    def register(
        self, seq_id: _Int, *, num_tokens: _Int | None = None, block_hashes: _Keys | None = None
    ) -> int:
        """Register the full, keyed, scheduled blocks below `num_tokens` (default all) after
        adding `block_hashes`, lifting the hold up to there; returns the blocks newly
        registered."""
    def truncate(
        self, seq_id: _Int, num_tokens: _Int, *, evicted: _Evicted | None = None
    ) -> list[tuple[int, int]] | None:
        """Drop the tokens past `num_tokens`; returns copy pairs, or None if a copy is full."""
    def fork(self, parent_id: _Int, child_id: _Int, *, evicted: _Evicted | None = None) -> None:
        """Make `child_id` share every block of `parent_id` (evicts nothing)."""
    def free(self, seq_id: _Int, *, num_computed_tokens: _Int | None = None) -> None:
        """Release the sequence's blocks, tail first, and forget it; blocks past
        `num_computed_tokens` that it registered and holds alone leave the cache."""
    def pin(self, seq_id: _Int) -> int:
        """Pin every GPU block the sequence holds now: never evicted (docs/eviction.md)."""
    def unpin(self, seq_id: _Int) -> int:
        """Unpin every GPU block the sequence holds now; returns how many."""
    def num_pinned_cached(self) -> int: ...
    def set_time(self, t: float) -> None:
        """Make the clock manual at `t` seconds (retention durations); never back."""
    def now(self) -> float: ...
    def lookup(
        self,
        token_ids: _TokenIds,
        *,
        cache_salt: _Salt = None,
        lora_id: _Int | None = None,
        block_hashes: _Keys | None = None,
        max_hit_tokens: _Int | None = None,
        loaded_tokens: _Int = 0,
    ) -> int:
        """Prompt tokens `allocate` would serve from the cache now; changes nothing."""
    def swap_out(self, seq_id: _Int) -> list[tuple[int, int]] | None:
        """Move to CPU blocks; returns (gpu, cpu) pairs, or None if swap space is full."""
    def swap_in(
        self, seq_id: _Int, *, evicted: _Evicted | None = None
    ) -> list[tuple[int, int]] | None:
        """Move back to GPU blocks; returns (cpu, gpu) pairs, or None if the GPU is full."""
    def can_allocate(
        self,
        num_tokens: _Int | _TokenIds,
        *,
        num_new_tokens: _Int | None = None,
        cache_salt: _Salt = None,
        lora_id: _Int | None = None,
        block_hashes: _Keys | None = None,
        max_hit_tokens: _Int | None = None,
        loaded_tokens: _Int = 0,
    ) -> AllocStatus:
        """OK / LATER / NEVER for a prompt (a length, or its token ids: then its cached
        prefix counts), keeping the watermark."""
    def can_swap_in(self, seq_id: _Int) -> AllocStatus:
        """OK / LATER / NEVER for swapping the sequence back in."""

    # -- pool-level calls -------------------------------------------------------------------
    def evict_blocks(self, block_ids: _Ints) -> int:
        """Take these GPU blocks out of the prefix cache (bad KV); returns how many left it.
        Ids out of range or the null block raise, changing nothing."""
    def allocation_cost(
        self,
        num_tokens_or_token_ids: _Int | _TokenIds,
        *,
        num_new_tokens: _Int | None = None,
        cache_salt: _Salt = None,
        lora_id: _Int | None = None,
        block_hashes: Sequence[bytes] | None = None,
        max_hit_tokens: _Int | None = None,
        lookahead: _Int = 0,
        loaded_tokens: _Int = 0,
    ) -> tuple[int, int, int]:
        """(hit_tokens, new_blocks, revived_blocks) `allocate` would take now; changes
        nothing."""
    def lookup_blocks(
        self,
        token_ids: _TokenIds,
        *,
        cache_salt: _Salt = None,
        lora_id: _Int | None = None,
        block_hashes: Sequence[bytes] | None = None,
        max_hit_tokens: _Int | None = None,
        loaded_tokens: _Int = 0,
    ) -> tuple[int, list[list[int]]]:
        """(hit_tokens, blocks per group) `allocate` would pin now; changes nothing."""
    def lookup_blocks_per_group(
        self,
        token_ids: _TokenIds,
        *,
        block_hashes: Sequence[bytes] | None = None,
        max_hit_tokens: _Int | None = None,
    ) -> list[tuple[int, list[int]]]:
        """Each group's own hit, looked up independently: [(hit_tokens, blocks), ...];
        changes nothing."""

    # -- batch operations -------------------------------------------------------------------
    def append_batch(
        self,
        seq_ids: _SeqIds,
        token_ids: _TokenIds,
        *,
        lookahead: _Int = 0,
        evicted: _Evicted | None = None,
    ) -> npt.NDArray[np.int32] | None:
        """One token per sequence; returns the (k, 2) int32 copy pairs, or None if full."""
    def free_batch(self, seq_ids: _SeqIds) -> None:
        """Free each sequence in the given order."""
    def running_batch(self, seq_ids: _SeqIds | None = None) -> RunningBatch:
        """A new `RunningBatch` over this manager's sequences, holding `seq_ids`."""
    def block_tables(
        self, seq_ids: _SeqIds, pad: _Int = ..., *, group: _Int = 0
    ) -> npt.NDArray[np.int32]:
        """(batch, max table length) int32 block tables of `group`, padded with `pad`
        (default -1)."""
    def slot_mapping(
        self,
        seq_ids: _SeqIds,
        num_new_tokens: _Int | _Ints,
        *,
        lookahead: _Int | _Ints = 0,
        group: _Int = 0,
    ) -> npt.NDArray[np.int64]:
        """int64 slots of each sequence's last `num_new_tokens` scheduled tokens (then of its
        `lookahead` draft positions: one int for all, or one per sequence), concatenated."""
    def flashinfer_page_table(
        self, seq_ids: _SeqIds, *, lookahead: _Int | _Ints = 0, group: _Int = 0
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """(kv_indptr, kv_indices, kv_last_page_len), int32, for FlashInfer's paged wrappers:
        each sequence's scheduled tokens plus its `lookahead` draft slots (one int for all,
        or one per sequence)."""

    # -- queries ----------------------------------------------------------------------------
    def block_table(
        self, seq_id: _Int, start: _Int | None = None, stop: _Int | None = None, *, group: _Int = 0
    ) -> list[int]: ...
    def num_tokens(self, seq_id: _Int) -> int: ...
    def num_scheduled_tokens(self, seq_id: _Int) -> int: ...
    def table_digest(self, seq_id: _Int) -> int: ...
    def block_hashes(
        self, seq_id: _Int, start: _Int | None = None, stop: _Int | None = None
    ) -> list[bytes]: ...
    def num_block_hashes(self, seq_id: _Int) -> int: ...
    def is_swapped(self, seq_id: _Int) -> bool: ...
    def __contains__(self, seq_id: object, /) -> bool: ...
    def __len__(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_available_blocks(self) -> int: ...
    @property
    def num_free_cpu_blocks(self) -> int: ...
    @property
    def num_cpu_blocks(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_groups(self) -> int: ...
    @property
    def record_evictions(self) -> bool:
        """Whether calls report the cached blocks they evict (`evicted=`)."""
    @property
    def tenants(self) -> bool:
        """Whether the manager groups requests by cache salt (`tenants=`)."""
    def set_tenant_quota(
        self, cache_salt: _Salt, *, max_cached: _Int | None = None, reserved: _Int = 0
    ) -> None:
        """Cap and reserve of one tenant's CACHED blocks (needs `tenants=True`); the
        defaults (no cap, no reserve) remove the tenant's quota."""
    def _tenant_stats(
        self,
    ) -> list[tuple[bytes | None, int, int, int, int, int | None, int]]: ...
    @property
    def eviction(self) -> _Eviction:
        """The eviction policy the manager was built with (`eviction=`)."""
    @property
    def hash_algo(self) -> str:
        """The chain hash the manager was built with (`hash_algo=`)."""
    @property
    def hash_seed(self) -> int:
        """The seed of the chain hash (`hash_seed=`)."""
    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are registered in the prefix cache."""
    @property
    def groups(self) -> tuple[KVCacheGroup, ...] | None:
        """The `groups=` as `KVCacheGroup`s of their kinds and sizes, or None."""

    # -- cache, statistics, events, audit ---------------------------------------------------
    def stats(self) -> Stats: ...
    def reset_prefix_cache(self) -> bool: ...
    def drain_events(self) -> list[KVEvent]:
        """The events since the last drain or snapshot; raises `KVEventsOverflowError`
        (changing nothing) once a bounded queue overflowed."""
    def kv_event_snapshot(self) -> list[BlockStored]:
        """Every block the events so far describe (parents first), taken between two events;
        the queue restarts empty."""
    def set_kv_event_capacity(self, capacity: int | None) -> None: ...
    def kv_event_queue_stats(self) -> KVEventQueueStats: ...
    def check_invariants(self) -> None: ...

@final
class RunningBatch:
    """A scheduler's decode batch kept across steps (`BlockManager.running_batch`)."""

    def add(self, seq_ids: _SeqIds) -> None:
        """Add live, resident sequences to the end of the batch (all or nothing)."""
    def remove(self, seq_ids: _SeqIds) -> None:
        """Remove members, freed or not (all or nothing); the rest keep their order."""
    def step(
        self, token_ids: _TokenIds, *, evicted: _Evicted | None = None
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]] | None:
        """One token per member: `(slot_mapping, cow_pairs)`, or None if it does not fit;
        with `groups=` the slot mapping has one row per group."""
    @property
    def seq_ids(self) -> list[int]:
        """The members' ids in batch order."""
    def __len__(self) -> int: ...

@final
class EngineRecord:
    """An engine adapter's record of one request (`pagedkv.vllm`): its sequence, known and
    scheduled tokens, keys handed over, table entries given out, held registration; and
    `decode`, the per-step call, which reads the engine's request object itself."""

    def __new__(
        cls,
        manager: BlockManager,
        request: Any,
        seq_id: int,
        have: int,
        scheduled: int,
        nkeys: int,
        table_len: int,
        held: bool,
        *,
        unchanged: Any,
        offset: int,
        max_len: int,
        hash_ratio: int,
    ) -> EngineRecord: ...
    def decode(
        self,
        request: Any,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        deferred: DeferredDecodes | None = None,
    ) -> Any:
        """A decode step's `allocate_slots`: False (not a decode step for this record), None
        (does not fit), `unchanged`, or `(first_entry, ids, pairs, keys_from)`. `deferred`
        is applied first when one of its steps may be this record's or this step may hand
        over a key."""
    @property
    def request(self) -> Any: ...
    @property
    def sid(self) -> int: ...
    @property
    def cross(self) -> int | None: ...
    @cross.setter
    def cross(self, value: int | None) -> None: ...
    @property
    def have(self) -> int: ...
    @have.setter
    def have(self, value: int) -> None: ...
    @property
    def scheduled(self) -> int: ...
    @scheduled.setter
    def scheduled(self, value: int) -> None: ...
    @property
    def nkeys(self) -> int: ...
    @nkeys.setter
    def nkeys(self, value: int) -> None: ...
    @property
    def table_len(self) -> int: ...
    @table_len.setter
    def table_len(self, value: int) -> None: ...
    @property
    def held(self) -> bool: ...
    @held.setter
    def held(self, value: bool) -> None: ...

@final
class DeferredDecodes:
    """An engine adapter's one-token decode steps answered at once and applied later, in
    runs to the end of a block (`pagedkv.vllm.deferred`), over the adapter's dict of
    records (request id -> `EngineRecord`)."""

    def __new__(cls, records: dict[str, EngineRecord], *, epoch: int = 0) -> DeferredDecodes:
        """`epoch`: where the count of settles starts (tests of its wrap past 2**64 - 1)."""
    @property
    def planned(self) -> dict[str, int]:
        """request id -> the computed tokens its planned step expects (the adapter pops it)."""
    @property
    def taken(self) -> list[str]:
        """The request ids whose planned step was answered and not taken in yet."""
    def apply(self) -> None:
        """Apply every answered step (the plans stay)."""
    def apply_for(self, record: EngineRecord | None = None) -> None:
        """Apply the answered steps that hand over a key (in call order) and `record`'s own;
        the other runs go on."""
    def release(self, record: EngineRecord) -> None:
        """`apply_for(record)`, then end its run (before its request is freed)."""
    def settle(self) -> None:
        """Forget every plan and end every run, then apply every answered step."""
    def prime(self, keyed: bool = True) -> int:
        """At a step's start: take the answered steps in (applying those that hand over a
        key), plan each taken run's next step, apply the runs that ended and plan a run for
        every record without one; returns how many steps are planned. `keyed`: steps that
        fill their block and hand over its key too (False while the adapter publishes KV
        events)."""
    @property
    def queued(self) -> int: ...
    @property
    def primed(self) -> int: ...
    @property
    def unapplied(self) -> int:
        """Steps answered and not applied yet."""
    @property
    def applied(self) -> int: ...
    @property
    def skipped(self) -> int: ...

@final
class MrcStream:
    """The miss-ratio curve recorder's stream of lookups and touches, kept in Rust
    (`pagedkv.sim.mrc_fast`); `sample_threshold` in `[1, 2**24]` keeps the keys whose top
    24 bits fall below it."""

    def __new__(cls, block_size: int, sample_threshold: int) -> MrcStream: ...
    @property
    def block_size(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def lookups(self) -> int: ...
    def __len__(self) -> int: ...
    def allocate(self, seq_id: int, token_ids: _TokenIds, scheduled: int, root: int) -> None:
        """A sequence was allocated `token_ids` (chain root `root`: salt and LoRA id), the
        first `scheduled` scheduled."""
    def extend(self, seq_id: int, num_new_tokens: int) -> None: ...
    def append(self, seq_id: int, token_ids: _TokenIds) -> None: ...
    def decode(self, seq_ids: _SeqIds, token_ids: _TokenIds) -> None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def swap_out(self, seq_id: int) -> None: ...
    def swap_in(self, seq_id: int) -> None: ...
    def curve(self, sample_rate: float) -> tuple[npt.NDArray[np.float64], int, int]:
        """`(thresholds, touches, distinct)`, the thresholds ascending."""
    def hits(self, capacities: _Ints, policy: str, first_lookup: int) -> list[int]:
        """Hit blocks at each of `capacities` under `policy` (`lru`, `fifo`, `optimal`:
        Belady's bound under the prefix constraint), over the lookups from the
        `first_lookup`-th on; exact streams only."""

@final
class BlockReplay:
    """A pure cache replay of a trace's hash ids at block granularity (`pagedkv.sim.mrc_blocks`):
    request `r` holds `ids[offsets[r]:offsets[r + 1]]`, `lengths[r]` prompt tokens and chain
    root `roots[r]`; `id_tokens` tokens per id, blocks of `block_size` tokens (one of the two
    divides the other)."""

    def __new__(
        cls,
        ids: _Ints,
        offsets: _Ints,
        lengths: _Ints,
        roots: _Ints,
        id_tokens: int,
        block_size: int,
    ) -> BlockReplay: ...
    @property
    def lookups(self) -> int: ...
    def curve(self, first_lookup: int) -> tuple[npt.NDArray[np.float64], int, int]:
        """`(thresholds, touches, distinct)` of the lookups from the `first_lookup`-th on."""
    def hits(self, capacities: _Ints, policy: str, first_lookup: int) -> list[int]:
        """Hit blocks at each of `capacities` under `policy` (`lru`, `fifo`, `optimal`)."""

# A router index's engine ids, block hashes (ints in [0, 2**64), or digest bytes) and one
# holder's answer: (engine_id, medium, group, leading blocks held).
_EngineId: TypeAlias = int | str
# A lookup's hashes: ints (also any buffer of 8-byte unsigned ints, or bytes of whole 8-byte
# hashes in native order), or digests.
_BlockHashes: TypeAlias = (
    _Ints | bytes | bytearray | memoryview | array[int] | list[bytes] | tuple[bytes, ...]
)
_Holder: TypeAlias = tuple[int | str, str | None, int, int]
_Applied: TypeAlias = tuple[int, int, int, int, int, int, int]

@final
class HeldBlocks:
    """The blocks one engine's KV event stream holds (integer hashes), for compact snapshots."""

    def __new__(cls) -> Self: ...
    def apply(self, payload: bytes) -> None: ...
    def parts(self, per_part: int = 262144) -> list[bytes]: ...
    def __len__(self) -> int: ...

@disjoint_base
class RouterIndex:
    """An exact index of which engine holds which KV blocks (docs/router.md)."""

    def __new__(
        cls,
        *,
        block_size: int = 16,
        hash_algo: _HashAlgo = "sha256",
        hash_seed: int = 0,
        hash_form: Literal["int", "bytes"] = "int",
        max_holders: int = 4096,
    ) -> Self: ...
    @property
    def block_size(self) -> int: ...
    @property
    def hash_algo(self) -> str: ...
    @property
    def hash_form(self) -> str: ...
    def apply(self, engine_id: _EngineId, payload: bytes) -> _Applied:
        """Apply one vLLM `KVEventBatch` payload to `engine_id`; (stored, removed,
        duplicates, unknown_removals, orphans, cleared, unknown_events)."""
    def begin_snapshot(self, engine_id: _EngineId) -> None: ...
    def apply_staged(self, engine_id: _EngineId, payload: bytes) -> _Applied: ...
    def commit_snapshot(self, engine_id: _EngineId) -> None:
        """The snapshot becomes the engine's blocks; the blocks it replaced stop counting at
        once and are dropped on a thread of their own."""
    def drop_replaced(self) -> int:
        """Drop the replaced blocks still queued (waiting for a drop under way); returns how
        many holders this call dropped."""
    def abort_snapshot(self, engine_id: _EngineId) -> None: ...
    def remove_engine(self, engine_id: _EngineId) -> bool: ...
    def match_hashes(self, block_hashes: _BlockHashes) -> list[_Holder]:
        """Every holder of at least the first block, with its leading blocks held."""
    def scores(
        self, block_hashes: _BlockHashes, *, medium: str | None = "GPU", group: int = 0
    ) -> dict[_EngineId, int]:
        """Leading blocks held per engine in `medium` and `group` (Dynamo's `scores` shape)."""
    def match_tokens(
        self, token_ids: _TokenIds, *, cache_salt: _Salt = None, lora_id: _Int | None = None
    ) -> list[_Holder]: ...
    def block_hashes(
        self, token_ids: _TokenIds, *, cache_salt: _Salt = None, lora_id: _Int | None = None
    ) -> list[int] | list[bytes]: ...
    def engines(self) -> list[_EngineId]: ...
    def holder_sizes(self, engine_id: _EngineId) -> list[tuple[str | None, int, int]]: ...
    def blocks(
        self, engine_id: _EngineId, medium: str | None = "GPU", group: int = 0
    ) -> set[int] | set[bytes]: ...
    def stats(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...

def schedule_replay(
    manager: BlockManager,
    requests: Sequence[tuple[Any, ...]],
    *,
    max_batch: int,
    max_num_batched_tokens: int,
    long_prefill_token_threshold: int,
    skip_sure_checks: bool,
    record: bool,
    watches: Sequence[MrcStream],
    progress: Any | None,
    stop: tuple[float, int, dict[int, int] | None] | None,
) -> dict[str, Any]:
    """Replay `requests` through `manager` with chunked prefill (pagedkv-sim's scheduling
    loop, for `pagedkv.sim.rust_loop`). Each request is `(request_id, prompt_tokens or None,
    hash_ids or None, hash_block_tokens, prompt_len, max_new_tokens, num_samples, cache_salt,
    root, arrival_step, after, delay)`. Returns `{"counters", "series", "log"}`; `log` (with
    `record`): every manager call as `(name, args, kwargs, answer)`, else None."""

def trace_tokens(hash_ids: _Ints, length: int, block_tokens: int) -> npt.NDArray[np.uint32]:
    """The first `length` pseudo-tokens of a trace prompt given as hash ids, `block_tokens`
    per id (`pagedkv.sim.requests.hash_id_tokens`)."""
