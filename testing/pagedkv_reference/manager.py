"""A pure-Python reference model of the block manager.

`ReferenceBlockManager` implements `docs/semantics.md` with plain lists, dicts, a list used as
the free stack and an eviction policy of `pagedkv_reference.eviction` over the CACHED blocks
(`eviction=`; LRU by default, least recently released first). It is the oracle of the model-based
test (which drives it and the Rust `pagedkv.BlockManager` side by side) and the pure-Python
baseline of the benchmarks. It is not thread-safe: clarity comes first, then speed.

It models the core's pins (a pinned CACHED block stays outside the policy and `available`;
a hit revives it without a unit), retention (`allocate(retention=...)`, priority eviction,
on the manager's clock: `set_time`) and tenants (`tenants=True`: the policy wrapped in
`eviction.quotas.TenantQuotas`, per-tenant statistics).

Digests follow `docs/hashing.md`; `hash_blocks` computes them without a manager.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

import numpy as np
import numpy.typing as npt

from pagedkv.alloc_status import AllocStatus
from pagedkv.config import EVICTIONS
from pagedkv.errors import (
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvariantError,
    RefcountOverflowError,
    SequenceNotSwappedError,
    SequenceSwappedError,
    UnknownSequenceError,
)
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventQueueStats
from pagedkv.groups import KVCacheGroup, check_groups
from pagedkv.stats import Stats, TenantStats
from pagedkv_reference.duties import Outcome, deliver
from pagedkv_reference.event_log import EventLog
from pagedkv_reference.eviction import EvictionPolicy, Priority, Quota, TenantQuotas, make_policy
from pagedkv_reference.retention import RetentionSpec, int_arg, retention_arg, rust_f64
from pagedkv_reference.window_retention import check_interval

# `evicted=`: the list a block-taking call appends its (block, group, digest) evictions to.
Evicted = list[tuple[int, int, bytes]]

if TYPE_CHECKING:
    from pagedkv_reference.running import ReferenceRunningBatch

__all__ = ["MAX_BLOCK_SIZE", "MAX_LEN", "MAX_REFCOUNT", "ReferenceBlockManager", "hash_blocks"]

_U32 = 1 << 32
_U64 = 1 << 64
_I32_MIN = -(1 << 31)
_I32_MAX = (1 << 31) - 1
_I64_MAX = (1 << 63) - 1

MAX_LEN = _I32_MAX
"""Most entries a sequence argument may have, and most tokens a sequence may hold."""
MAX_BLOCK_SIZE = 1 << 16
MAX_REFCOUNT = (1 << 20) - 1
"""Most holders (sequences) one block may have; more raise RefcountOverflowError."""
RECENT_WINDOW = 1000
"""Allocations counted by the recent hit rate (vLLM's window)."""

HashFn = Callable[[bytes], bytes]


# --------------------------------------------------------------------------------------------
# Argument validation (docs/inputs.md: the accepted inputs and the error order)
# --------------------------------------------------------------------------------------------


def _int_value(x: object) -> int | None:
    """The value of a scalar int (a Python int, not a bool, or a numpy integer scalar), else
    None. Read through the base types, as the binding does: a subclass's `__int__` or
    `__index__` is never called."""
    if isinstance(x, int):
        return None if isinstance(x, bool) else int.__index__(x)
    if isinstance(x, np.timedelta64):  # numpy files it under np.integer; not an int here
        return None
    if isinstance(x, np.integer):
        return int(np.asarray(x).item())
    return None


def _check_int(x: object, what: str, lo: int, hi: int) -> int:
    """A scalar int in `[lo, hi)`: InvalidArgumentTypeError if not an int, else
    InvalidArgumentError if out of range."""
    v = _int_value(x)
    if v is None:
        raise InvalidArgumentTypeError(f"{what} must be an int, got {type(x).__name__}")
    if not lo <= v < hi:
        raise InvalidArgumentError(f"{what} {v} out of range [{lo}, {hi})")
    return v


def _seq_id(x: object, what: str = "seq_id") -> int:
    return _check_int(x, what, 0, _U64)


def _too_long(what: str, n: object) -> InvalidArgumentError:
    return InvalidArgumentError(f"{what} has {n} entries, more than the maximum {MAX_LEN}")


def _int_list(values: object, what: str, lo: int, hi: int) -> list[int]:
    """The ints in `[lo, hi)` of a list, tuple, range (exact types) or 1-D integer ndarray
    (any byte order; a subclass other than a masked array is read as a plain array)."""
    if isinstance(values, np.ndarray):
        if isinstance(values, np.ma.MaskedArray):
            raise InvalidArgumentTypeError(f"{what} must not be a masked array")
        arr = np.asarray(values)  # the plain-array view: no subclass method runs below
        if arr.ndim != 1:
            raise InvalidArgumentTypeError(f"{what} must be 1-D, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise InvalidArgumentTypeError(f"{what} must have an integer dtype, got {arr.dtype}")
        if arr.shape[0] > MAX_LEN:
            raise _too_long(what, arr.shape[0])
        out: list[int] = arr.tolist()
        if out and (min(out) < lo or max(out) >= hi):
            bad = next(v for v in out if not lo <= v < hi)
            raise InvalidArgumentError(f"{what}: value {bad} out of range [{lo}, {hi})")
        return out
    if type(values) in (list, tuple, range):
        assert isinstance(values, (list, tuple, range))
        try:
            n = len(values)
        except OverflowError:  # a range longer than 2**63 - 1
            raise _too_long(what, "more than 2**63") from None
        if n > MAX_LEN:
            raise _too_long(what, n)
        out = []
        for v in values:  # each element: type, then range, in order
            iv = _int_value(v)
            if iv is None:
                raise InvalidArgumentTypeError(f"{what} must contain ints, got {type(v).__name__}")
            if not lo <= iv < hi:
                raise InvalidArgumentError(f"{what}: value {iv} out of range [{lo}, {hi})")
            out.append(iv)
        return out
    raise InvalidArgumentTypeError(
        f"{what} must be a list, tuple, range or 1-D integer numpy array, "
        f"got {type(values).__name__}"
    )


def _tokens(token_ids: object) -> list[int]:
    out = _int_list(token_ids, "token_ids", 0, _U32)
    if not out:
        raise InvalidArgumentError("token_ids is empty")
    return out


def _seq_ids(seq_ids: object) -> list[int]:
    return _int_list(seq_ids, "seq_ids", 0, _U64)


def _counts(num_new_tokens: object, n: int) -> list[int]:
    """`num_new_tokens`: one int for all `n` sequences, or one int per sequence; each in
    `[1, 2**63)` (whether it fits its sequence is a state check)."""
    if _int_value(num_new_tokens) is not None:
        return [_check_int(num_new_tokens, "num_new_tokens", 1, _I64_MAX + 1)] * n
    return _int_list(num_new_tokens, "num_new_tokens", 1, _I64_MAX + 1)


def _lookaheads(lookahead: object, n: int) -> list[int]:
    """`lookahead` of the batch queries: one int for all `n` sequences, or one int per
    sequence; each in `[0, 2**63)` (whether the length matches is a cross-argument check,
    whether it fits its sequence a state check)."""
    if _int_value(lookahead) is not None:
        return [_check_int(lookahead, "lookahead", 0, _I64_MAX + 1)] * n
    return _int_list(lookahead, "lookahead", 0, _I64_MAX + 1)


def _same_len(lookaheads: list[int], ids: list[int]) -> None:
    if len(lookaheads) != len(ids):
        raise InvalidArgumentError(
            f"seq_ids has {len(ids)} entries but lookahead has {len(lookaheads)}"
        )


def _opt_count(num_new_tokens: object) -> int | None:
    """`num_new_tokens` of `allocate` and `can_allocate`: None (the whole prompt) or an int
    in `[1, 2**63)`; whether it fits the prompt is a cross-argument check (`_fits_prompt`)."""
    if num_new_tokens is None:
        return None
    return _check_int(num_new_tokens, "num_new_tokens", 1, _I64_MAX + 1)


def _fits_prompt(k: int | None, n: int) -> int:
    """`num_new_tokens` (default: all) of a prompt of `n` tokens: at most `n`."""
    if k is None:
        return n
    if k > n:
        raise InvalidArgumentError(f"num_new_tokens {k} out of range [1, {n}]")
    return k


MAX_KEY_LEN = 128
"""The longest caller key (`block_hashes=`), in bytes."""


def _keys(block_hashes: object) -> list[bytes] | None:
    """`block_hashes`: None, or an exact list or tuple of `bytes`, each 1..=MAX_KEY_LEN long."""
    if block_hashes is None:
        return None
    if type(block_hashes) not in (list, tuple):
        raise InvalidArgumentTypeError(
            "block_hashes must be a list or tuple of bytes, or None, got "
            f"{type(block_hashes).__name__}"
        )
    assert isinstance(block_hashes, list | tuple)
    out: list[bytes] = []
    for i, k in enumerate(block_hashes):
        if not isinstance(k, bytes):
            raise InvalidArgumentTypeError(
                f"block_hashes[{i}] must be bytes, got {type(k).__name__}"
            )
        if not 1 <= len(k) <= MAX_KEY_LEN:
            raise InvalidArgumentError(
                f"block_hashes[{i}] has {len(k)} bytes: a key has 1..={MAX_KEY_LEN}"
            )
        out.append(bytes(k))
    return out


def _loaded(loaded_tokens: object, n: int, k: int) -> int:
    """`loaded_tokens`: an int in `[0, 2**63)`, at most the `k` tokens (of `n`) scheduled
    past the hit."""
    loaded = _check_int(loaded_tokens, "loaded_tokens", 0, _I64_MAX + 1)
    if loaded > min(k, n):
        raise InvalidArgumentError(
            f"loaded_tokens {loaded} exceeds the {min(k, n)} tokens scheduled past the hit "
            "(loaded tokens are among them)"
        )
    return loaded


def _max_hit(max_hit_tokens: object) -> int | None:
    """`max_hit_tokens`: None (no cap but the prompt's) or an int in `[0, 2**63)`."""
    if max_hit_tokens is None:
        return None
    return _check_int(max_hit_tokens, "max_hit_tokens", 0, _I64_MAX + 1)


def _no_extras_with_keys(keys: list[bytes] | None, salt: bytes | None, lora: int | None) -> None:
    if keys is not None and (salt is not None or lora is not None):
        raise InvalidArgumentError(
            "cache_salt and lora_id cannot be given with block_hashes (the caller's keys carry "
            "the extra keys)"
        )


def _key_count(total: int, n: int, bs: int) -> None:
    """At most one key per full block of `n` tokens."""
    if total > n // bs:
        raise InvalidArgumentError(
            f"{total} block_hashes for {n} tokens: at most one per full block ({n // bs})"
        )


def _check_bool(x: object, what: str) -> bool:
    if not isinstance(x, bool):
        raise InvalidArgumentTypeError(f"{what} must be a bool, got {type(x).__name__}")
    return x


def _float(x: object, what: str) -> float:
    """A float argument (docs/inputs.md): a `float` (subclasses such as `np.float64`
    included) or an `int` (not a `bool`; one outside `[-2**63, 2**64)` reads as infinite, as
    the binding reads it)."""
    if isinstance(x, float):
        return float.__float__(x)
    if isinstance(x, int) and not isinstance(x, bool):
        v = int.__index__(x)
        return float(v) if -(2**63) <= v < 2**64 else math.copysign(math.inf, v)
    raise InvalidArgumentTypeError(f"{what} must be a float, got {type(x).__name__}")


def _watermark(w: object) -> float:
    """A float or int (not a bool), finite, in `[0, 1)`."""
    v = _float(w, "watermark")
    if not 0.0 <= v < 1.0:
        raise InvalidArgumentError(f"watermark {w} out of range [0, 1)")
    return v


def _distinct(ids: list[int]) -> None:
    seen: set[int] = set()
    for s in ids:
        if s in seen:
            raise InvalidArgumentError(f"duplicate sequence id {s} in batch")
        seen.add(s)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# Hashing (docs/hashing.md, encoding version 1)
# --------------------------------------------------------------------------------------------


def _hash_fn(hash_algo: object) -> HashFn:
    if not isinstance(hash_algo, str):
        raise InvalidArgumentTypeError(f"hash_algo must be a str, got {type(hash_algo).__name__}")
    if hash_algo == "sha256":
        return lambda m: hashlib.sha256(m).digest()
    if hash_algo == "xxh3_128":
        import xxhash  # lazily: only needed for this algorithm

        return lambda m: xxhash.xxh3_128(m).digest()
    raise InvalidArgumentError(f"unknown hash_algo {hash_algo!r} (use 'sha256' or 'xxh3_128')")


def _salt_bytes(cache_salt: object) -> bytes | None:
    if cache_salt is None:
        return None
    if isinstance(cache_salt, str):
        try:
            return cache_salt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidArgumentError(f"cache_salt is not valid UTF-8: {e}") from None
    if isinstance(cache_salt, bytes):
        return cache_salt
    raise InvalidArgumentTypeError(
        f"cache_salt must be str or bytes, got {type(cache_salt).__name__}"
    )


def _lora(lora_id: object) -> int | None:
    return None if lora_id is None else _check_int(lora_id, "lora_id", 0, _U64)


def _extras(salt: bytes | None, lora_id: int | None) -> bytes:
    """The tail of every block message: flags, then the optional salt and LoRA id."""
    flags = (1 if salt is not None else 0) | (2 if lora_id is not None else 0)
    out = bytes([flags])
    if salt is not None:
        if len(salt) >= _U32:
            raise InvalidArgumentError("cache_salt longer than 2**32 - 1 bytes")
        out += struct.pack("<I", len(salt)) + salt
    if lora_id is not None:
        out += struct.pack("<Q", lora_id)
    return out


def _root(h: HashFn, seed: int) -> bytes:
    return h(b"PKV1root" + struct.pack("<Q", seed))


def _key_digest(h: HashFn, key: bytes) -> bytes:
    """The digest of a caller's block key: its own domain (`PKVk`), never a chain digest."""
    return h(b"PKVk" + key)


def _block_digest(h: HashFn, parent: bytes, tokens: Sequence[int], extras: bytes) -> bytes:
    msg = b"PKV1" + parent + struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens) + extras
    return h(msg)


def hash_blocks(
    token_ids: object,
    block_size: int,
    *,
    cache_salt: str | bytes | None = None,
    lora_id: int | None = None,
    hash_algo: str = "sha256",
    seed: int = 0,
) -> list[bytes]:
    """The chained digests of the full blocks of `token_ids` (pure-Python `pagedkv.hash_blocks`)."""
    # Arguments in signature order (docs/inputs.md). Empty token ids: no full block, [].
    toks = _int_list(token_ids, "token_ids", 0, _U32)
    b = _check_int(block_size, "block_size", 1, MAX_BLOCK_SIZE + 1)
    salt = _salt_bytes(cache_salt)
    lora = _lora(lora_id)
    h = _hash_fn(hash_algo)
    parent = _root(h, _check_int(seed, "seed", 0, _U64))
    extras = _extras(salt, lora)
    out = []
    for i in range(len(toks) // b):
        parent = _block_digest(h, parent, toks[i * b : (i + 1) * b], extras)
        out.append(parent)
    return out


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


class _Seq:
    """Per-sequence state (docs/semantics.md, "Per-sequence state")."""

    __slots__ = (
        "blocks",
        "cpu_blocks",
        "digests",
        "extras",
        "hits",
        "hold",
        "keyed",
        "keys",
        "loaded",
        "lora_id",
        "max_hit",
        "reachable",
        "retention",
        "salt",
        "scheduled",
        "swapped",
        "tenant",
        "tokens",
    )

    def __init__(self, salt: bytes | None, lora_id: int | None) -> None:
        self.blocks: list[int] = []  # GPU table
        self.tokens: list[int] = []  # every known token (the events need full blocks' tokens)
        self.digests: list[bytes] = []  # chain digests of full blocks (prefix caching only)
        self.scheduled = 0  # `s`: tokens scheduled for compute; only their full blocks register
        self.hits = 0  # `h`: leading blocks served from the prefix cache
        # caller-keyed (`block_hashes=`): digests come from `keys`, never from the tokens
        self.keyed = False
        self.keys: list[bytes] = []  # the caller's keys (a caller-keyed sequence's)
        self.hold: int | None = None  # held registration: only blocks below `hold` register
        self.max_hit: int | None = None  # `max_hit_tokens` of the allocation in progress
        self.loaded = 0  # `loaded_tokens` of the allocation in progress
        self.salt = salt
        self.lora_id = lora_id
        self.extras = _extras(salt, lora_id)
        self.swapped = False
        self.cpu_blocks: list[int] = []
        # `allocate(retention=...)`: its spec and the prompt's length (priority eviction)
        self.retention: tuple[RetentionSpec, int] | None = None
        self.tenant = 0  # its tenant id (`tenants=True`; 0: unsalted, or no tenants)
        # `allocate(reachable_tokens=)`: where a later hit can resume (sparse window retention)
        self.reachable: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def copy(self) -> _Seq:
        c = _Seq(self.salt, self.lora_id)
        c.blocks = list(self.blocks)
        c.tokens = list(self.tokens)
        c.digests = list(self.digests)
        c.scheduled = self.scheduled
        c.hits = self.hits
        c.keyed = self.keyed
        c.keys = list(self.keys)
        c.hold = self.hold
        c.retention = self.retention
        c.tenant = self.tenant
        c.reachable = self.reachable
        return c


class ReferenceBlockManager:
    """Paged KV-cache block manager, pure Python; see docs/semantics.md.

    With `groups=[KVCacheGroup(...), ...]` the constructor builds the hybrid-model manager of
    `pagedkv_reference.groups` (a subclass: one block table per group, block 0 the null block).
    """

    def __new__(cls, *args: Any, groups: object = None, **kwargs: Any) -> ReferenceBlockManager:
        if groups is not None and cls is ReferenceBlockManager:
            from pagedkv_reference.groups import GroupedReferenceBlockManager

            return super().__new__(GroupedReferenceBlockManager)
        return super().__new__(cls)

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: int = 0,
        watermark: float = 0.01,
        enable_kv_events: bool = False,
        record_evictions: bool = False,
        eviction: str = "lru",
        tenants: bool = False,
        groups: Iterable[KVCacheGroup] | None = None,
        prefix_cache_retention_interval: int | None = None,
    ) -> None:
        # Arguments in signature order (docs/inputs.md).
        self._num_blocks = _check_int(num_blocks, "num_blocks", 1, _I32_MAX + 1)
        self._block_size = _check_int(block_size, "block_size", 1, MAX_BLOCK_SIZE + 1)
        self._num_cpu_blocks = _check_int(num_cpu_blocks, "num_cpu_blocks", 0, _I32_MAX + 1)
        self._caching = _check_bool(enable_prefix_caching, "enable_prefix_caching")
        self._hash = _hash_fn(hash_algo)
        self._root = _root(self._hash, _check_int(hash_seed, "hash_seed", 0, _U64))
        self._watermark_blocks = int(_watermark(watermark) * self._num_blocks)
        self._events_on = _check_bool(enable_kv_events, "enable_kv_events")
        self._record_evictions = _check_bool(record_evictions, "record_evictions")
        if eviction not in EVICTIONS:
            raise InvalidArgumentError(
                f"eviction must be one of {', '.join(EVICTIONS)}, got {eviction!r}"
            )
        self._eviction = eviction
        self._tenants = _check_bool(tenants, "tenants")
        # (block, group, digest) of the evictions of the call in progress that asked for
        # them (`evicted=`; docs/tiers.md), else None
        self._duty: Evicted | None = None
        self._groups = () if groups is None else check_groups(groups, self._block_size)
        self._retention_interval = check_interval(
            self._groups or (KVCacheGroup("full"),),
            self._block_size,
            prefix_cache_retention_interval,
        )

        n = self._num_blocks
        self._free: list[int] = list(range(n - 1, -1, -1))  # LIFO: pops 0, 1, 2, ...
        self._rc: list[int] = [0] * n
        self._hashed: list[bytes | None] = [None] * n  # digest a block is registered under
        self._index: dict[bytes, int] = {}  # prefix index: digest -> block
        # The CACHED blocks, under the policy that picks the victims (docs/eviction.md).
        self._policy: EvictionPolicy | TenantQuotas = (
            TenantQuotas(lambda: make_policy(eviction, n))
            if self._tenants
            else make_policy(eviction, n)
        )
        # Pin bits (`pin`): on held or CACHED blocks; a pinned CACHED block is outside the
        # policy and `available`. Cleared when the block goes FREE.
        self._pins: set[int] = set()
        # Blocks a tenant's cap evicted during the release in progress (`_cache`).
        self._trimmed: list[int] = []
        # The clock: monotonic from construction until `set_time` makes it manual.
        self._t0 = time.monotonic()
        self._manual: float | None = None
        self._seen = 0.0  # the latest monotonic time `now` gave
        # (group, digest) -> swapped-out sequences holding a CPU copy of it (with events)
        self._cpu_copies: Counter[tuple[int, bytes]] = Counter()
        # Tenants (`tenants=True`): salt per id (0: unsalted), ids by salt, prefix counts,
        # when each (last) entered the registry, quotas, and the tenant of the sequence that
        # registered each block. A salted tenant is present while it has a live sequence, a
        # CACHED block or a quota; one that had none of them left the registry (the core
        # removes it then), so its next use starts it afresh: new counts, a new place.
        self._tenant_salts: list[bytes | None] = [None]
        self._tenant_ids: dict[bytes, int] = {}
        self._tenant_counts: list[list[int]] = [[0, 0]]
        self._tenant_order: list[int] = [0]
        self._tenant_quotas: dict[int, tuple[int | None, int]] = {}
        self._block_tenant: list[int] = [0] * n
        self._cpu_free: list[int] = list(range(self._num_cpu_blocks - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}
        self._log = EventLog()

        self._prefix_queries = 0
        self._prefix_hits = 0
        self._evictions = 0
        self._cow_copies = 0
        self._swapped_out_blocks = 0
        self._swapped_in_blocks = 0
        self._registered_blocks = 0
        self._unregistered_blocks = 0
        self._truncated_blocks = 0
        # (queried, hit) tokens of the last RECENT_WINDOW allocations (vLLM's recent hit rate)
        self._recent: deque[tuple[int, int]] = deque(maxlen=RECENT_WINDOW)

    # ---------------------------------------------------------------- block lifecycle helpers

    def _available(self) -> int:
        return len(self._free) + len(self._policy)

    @property
    def _NOW(self) -> float:  # the policies' clock, read at each call
        return self.now()

    def now(self) -> float:
        """The manager's clock, in seconds (monotonic until `set_time`, never less than a
        time it gave before)."""
        if self._manual is None:
            self._seen = max(self._seen, time.monotonic() - self._t0)
            return self._seen
        return self._manual

    def set_time(self, t: float) -> None:
        """Make the clock manual at `t` seconds (retention durations); never back: not
        before the last time set, nor, on the switch, before the last time `now` gave."""
        t = _float(t, "t")
        if not math.isfinite(t) or t < 0:
            raise InvalidArgumentError(f"time must be a finite number >= 0, got {rust_f64(t)}")
        if self._manual is not None and t < self._manual:
            raise InvalidArgumentError(
                f"time must not go back: {rust_f64(t)} is before {rust_f64(self._manual)}, "
                "the manual time set last"
            )
        if self._manual is None and t < self._seen:
            raise InvalidArgumentError(
                f"time must not go back: {rust_f64(t)} is before {rust_f64(self._seen)}, the "
                "monotonic time the clock already gave"
            )
        self._manual = t + 0.0

    def _pinned_cached(self) -> list[int]:
        """The CACHED blocks that are pinned, by id."""
        return sorted(b for b in self._pins if self._rc[b] == 0)

    def num_pinned_cached(self) -> int:
        return len(self._pinned_cached())

    def _costs_unit(self, b: int) -> bool:
        """Whether a hit on block `b` revives a CACHED block with a unit (a pinned one
        takes none)."""
        return self._rc[b] == 0 and b not in self._pins

    def _gone_free(self, b: int) -> None:
        """Block `b` went FREE: its pin and its retention go with its content."""
        self._pins.discard(b)
        self._set_retention(b, (35, None))

    def _set_retention(self, b: int, r: tuple[int, float | None]) -> None:
        """Give a block that is not CACHED its retention from its next release."""
        if self._eviction != "priority":
            return
        if isinstance(self._policy, TenantQuotas):
            self._policy.set_retention(b, r[0], r[1], self._NOW)
        else:
            assert isinstance(self._policy, Priority) and b not in self._policy
            self._policy.set_retention(b, r[0], r[1])

    def _retain(self, seq: _Seq, lo: int, count: int) -> None:
        """Before `seq` lets go of its blocks `lo .. lo + count`: give each that has a
        digest the retention of its range (the core's `retain`)."""
        if seq.retention is None:
            return
        spec, prompt = seq.retention
        bs = self._block_size
        for i in range(lo, min(lo + count, len(seq.blocks), len(seq.digests))):
            r = spec.of_block(i * bs, prompt)
            if r is not None:
                self._set_retention(seq.blocks[i], r)

    def _policy_key(self, b: int) -> bytes:
        """The key the policy knows hashed block `b` by: its digest in the prefix index."""
        d = self._hashed[b]
        assert d is not None
        return d

    def _cache(self, b: int) -> None:
        """Hashed block `b` became CACHED (its last holder let go): the policy's newest,
        unless pinned (then outside the policy). A tenant's cap may trim blocks at once:
        `_trimmed`, freed by the release."""
        if b in self._pins:
            return
        if isinstance(self._policy, TenantQuotas):
            salt = self._tenant_salts[self._block_tenant[b]]
            got = self._policy.on_cached(b, self._NOW, self._policy_key(b), salt)
            self._trimmed.extend(got)
        else:
            self._policy.on_cached(b, self._NOW, self._policy_key(b))

    def _drop_trimmed(self) -> None:
        """The blocks a cap trimmed go FREE at once (on top of the free stack), each with
        its `BlockRemoved`, counted as evictions (not reported through `evicted=`)."""
        trimmed, self._trimmed = self._trimmed, []
        for b in trimmed:
            self._unindex(b)
            self._evictions += 1
            self._count_trim(b)
            self._free.append(b)

    def _count_trim(self, b: int) -> None:
        """A grouped manager counts the trim for the block's group."""

    def _revive(self, b: int) -> None:
        """A prefix hit takes the CACHED block `b` (CACHED -> OWNED); a pinned one is not
        in the policy."""
        if b not in self._pins:
            self._policy.on_hit(b, self._NOW)

    def _missed(self, digests: list[bytes]) -> None:
        """An admitted prompt needs these digests past its hit (the ghost policies look them
        up before the evictions made for them)."""
        for d in digests:
            self._policy.on_miss(d, self._NOW)

    def _evict(self) -> int:
        """The policy's next victim (the caller evicts it); there is one: `available`
        counted it."""
        b = self._policy.victim(self._NOW)
        assert b is not None, "no CACHED block to evict"
        return b

    def _cached_blocks(self) -> list[int]:
        """The CACHED blocks, in no particular order."""
        return [b for b, _ in self._policy.entries()]

    def _unindex(self, b: int) -> None:
        """Take block `b` out of the prefix index (it stays where it is)."""
        d = self._hashed[b]
        assert d is not None
        del self._index[d]
        self._hashed[b] = None
        if self._events_on:
            self._log.push(BlockRemoved(block_hashes=[d], medium="GPU"))

    def _take(self) -> int:
        """One new block: pop the free stack, else evict the oldest CACHED block."""
        if self._free:
            b = self._free.pop()
        else:
            b = self._evict()
            self._log_eviction(b, 0)
            self._unindex(b)
            self._evictions += 1
        self._rc[b] = 1
        return b

    def _log_eviction(self, b: int, group: int) -> None:
        """Report an eviction (before the block leaves the index) to the call in progress,
        if it asked for its evictions."""
        digest = self._hashed[b]
        if self._duty is not None and digest is not None:
            self._duty.append((b, group, digest))

    @contextmanager
    def _duties(self, evicted: Evicted | None) -> Iterator[Outcome]:
        """Run a block-taking call's body, appending the evictions it made to `evicted`
        (when given) before it returns or raises. The body passes its result through the
        yielded `Outcome`. Each eviction is appended with `list.append` itself (no method of
        a list subclass runs), and one that fails does not stop the rest: those not
        appended are raised in an `EvictionsNotDeliveredError` with the call's outcome."""
        out = Outcome()
        if evicted is None:
            yield out
            return
        if not isinstance(evicted, list):
            raise InvalidArgumentTypeError("evicted must be a list or None")
        if not self._record_evictions:
            raise InvalidArgumentError("evicted= needs a manager built with record_evictions=True")
        outer, self._duty = self._duty, []
        try:
            yield out
        except BaseException as e:
            out.error = e
            raise
        finally:
            mine, self._duty = self._duty, outer
            if outer is not None:
                outer.extend(mine)
            deliver(evicted, mine, out)

    @property
    def num_groups(self) -> int:
        """KV-cache groups (1 without `groups=`)."""
        return max(1, len(self._groups))

    @property
    def eviction(self) -> str:
        return self._eviction

    @property
    def record_evictions(self) -> bool:
        """Whether calls report the cached blocks they evict (`evicted=`)."""
        return self._record_evictions

    # ---------------------------------------------------------------- pins and tenants

    def pin(self, seq_id: int) -> int:
        """Pin every GPU block the sequence holds now (never evicted; kept in the prefix
        cache outside the policy and `available` once released); returns how many."""
        return self._set_pins(seq_id, True)

    def unpin(self, seq_id: int) -> int:
        """Unpin every GPU block the sequence holds now, whoever pinned it."""
        return self._set_pins(seq_id, False)

    def _set_pins(self, seq_id: object, on: bool) -> int:
        _, seq = self._resident(seq_id)
        held = self._held(seq)
        for b in held:
            (self._pins.add if on else self._pins.discard)(b)
        return len(held)

    @property
    def tenants(self) -> bool:
        return self._tenants

    def _tenants_on(self) -> None:
        if not self._tenants:
            raise InvalidArgumentError("tenant quotas and statistics need tenants=True")

    def set_tenant_quota(
        self, cache_salt: str | bytes | None, *, max_cached: int | None = None, reserved: int = 0
    ) -> None:
        """Cap and reserve of one tenant's CACHED blocks (needs `tenants=True`); a cap below
        its CACHED blocks evicts its own at once. The defaults (no cap, no reserve) remove the
        tenant's quota."""
        salt = _salt_bytes(cache_salt)
        cap = None if max_cached is None else int_arg(max_cached, "max_cached", 0, _I32_MAX)
        res = int_arg(reserved, "reserved", 0, _I32_MAX)
        self._tenants_on()
        if cap is not None and res > cap:
            raise InvalidArgumentError(f"reserved {res} is above max_cached {cap}")
        t = self._tenant_of(salt)
        if (cap, res) == (None, 0):
            self._tenant_quotas.pop(t, None)  # no quota: its own policy instance goes
        else:
            self._tenant_quotas[t] = (cap, res)
        assert isinstance(self._policy, TenantQuotas)
        self._trimmed = self._policy.set_quota(salt, Quota(cap, res), self._NOW)
        self._drop_trimmed()

    def tenant_stats(self) -> list[TenantStats]:
        """Per tenant, unsalted first then in order of first use."""
        self._tenants_on()
        out = []
        present = sorted(
            (self._tenant_order[t], t)
            for t in range(len(self._tenant_salts))
            if self._tenant_present(t)
        )
        for _, t in present:
            salt = self._tenant_salts[t]
            held = {
                b
                for s in self._seqs.values()
                if s.tenant == t and not s.swapped
                for b in self._held(s)
            }
            cached = sum(
                1
                for b in range(self._num_blocks)
                if self._rc[b] == 0 and self._hashed[b] is not None and self._block_tenant[b] == t
            )
            cap, res = self._tenant_quotas.get(t, (None, 0))
            q, h = self._tenant_counts[t]
            out.append(TenantStats(salt, len(held), cached, q, h, cap, res))
        return out

    def _release_all(self, blocks: list[int]) -> None:
        """Release a table's blocks tail first: hashed tails are queued (and evicted) first,
        and the unhashed ones go on the free stack so that the tail ends on top and is
        reused first (vLLM puts them, tail first, at the head of its free queue)."""
        freed: list[int] = []
        for b in reversed(blocks):  # tail first
            self._rc[b] -= 1
            if self._rc[b] == 0:
                if self._hashed[b] is not None:
                    self._cache(b)
                else:
                    freed.append(b)
                    self._gone_free(b)
        self._free.extend(reversed(freed))
        self._drop_trimmed()

    def _stored(self, seq: _Seq, i: int, medium: str) -> BlockStored:
        bs = self._block_size
        return BlockStored(
            block_hashes=[seq.digests[i]],
            parent_block_hash=seq.digests[i - 1] if i > 0 else None,
            token_ids=seq.tokens[i * bs : (i + 1) * bs],
            block_size=bs,
            lora_id=seq.lora_id,
            medium=medium,
        )

    def _register(self, seq: _Seq, lo: int, hi: int) -> None:
        """Table indices `lo .. hi - 1` of `seq` became full of scheduled tokens: register
        each under its digest, in order, unless another block already holds that digest."""
        if not self._caching:
            return
        for i in range(lo, hi):
            d = seq.digests[i]
            if d in self._index:
                continue  # another block holds this content: this one stays unhashed
            b = seq.blocks[i]
            if seq.keyed and self._rc[b] > 1:
                continue  # shared with forks, which may key it otherwise: stays unhashed
            self._index[d] = b
            self._hashed[b] = d
            self._block_tenant[b] = seq.tenant
            self._registered_blocks += 1
            if self._events_on:
                self._log.push(self._stored(seq, i, "GPU"))

    def _registrable(self, seq: _Seq) -> int:
        """Leading blocks full of scheduled tokens, digested and below the hold: those that
        are (or were offered to be) registered."""
        r = min(seq.scheduled // self._block_size, len(seq.digests))
        return r if seq.hold is None else min(r, seq.hold)

    def _add_keys(self, seq: _Seq, keys: list[bytes]) -> None:
        """Continue a caller-keyed sequence's keys (digests only with prefix caching)."""
        if self._caching:  # without prefix caching keys are checked, then dropped
            seq.keys.extend(keys)
            seq.digests.extend(_key_digest(self._hash, k) for k in keys)

    def _check_more_keys(self, sid: int, seq: _Seq, keys: list[bytes], n: int) -> None:
        if not seq.keyed:
            raise InvalidArgumentError(
                f"sequence {sid} hashes its own tokens: block_hashes only continue the keys "
                "of a sequence allocated with block_hashes"
            )
        _key_count(len(seq.digests) + len(keys), n, self._block_size)

    def _extend_digests(self, seq: _Seq) -> None:
        """Compute the digests of the blocks that are full but not yet digested (a
        caller-keyed sequence has only its keys' digests)."""
        if seq.keyed:
            return
        bs = self._block_size
        parent = seq.digests[-1] if seq.digests else self._root
        for i in range(len(seq.digests), seq.num_tokens // bs):
            parent = _block_digest(
                self._hash, parent, seq.tokens[i * bs : (i + 1) * bs], seq.extras
            )
            seq.digests.append(parent)

    def _hit_cap(self, seq: _Seq) -> int:
        """The most blocks a prompt may hit: one token is always computed, and
        `max_hit_tokens` caps it further."""
        cap = (seq.num_tokens - 1) // self._block_size
        if seq.max_hit is not None:
            cap = min(cap, seq.max_hit // self._block_size)
        return min(cap, len(seq.digests))

    def _hits(self, seq: _Seq) -> list[int]:
        """The cached blocks of the longest indexed prefix of `seq`'s digests, leaving at
        least one token to compute (`h <= (n - 1) // B`), at most `_hit_cap`."""
        hits: list[int] = []
        for d in seq.digests[: self._hit_cap(seq)]:
            b = self._index.get(d)
            if b is None:
                break
            hits.append(b)
        return hits

    def _prompt(
        self,
        toks: list[int] | int,
        salt: bytes | None,
        lora: int | None,
        keys: list[bytes] | None = None,
        cap: int | None = None,
    ) -> _Seq:
        """A digested prompt for a read-only look: its tokens (or, with keys, its length)."""
        seq = self._new_seq(salt, lora)
        if isinstance(toks, int):
            # Only the length counts: enough of it that every key could hit.
            toks = [0] * min(toks, (len(keys or []) + 1) * self._block_size)
        seq.tokens = toks
        seq.max_hit = cap
        if keys is not None:
            seq.keyed = True
            self._add_keys(seq, keys)
        elif self._caching:
            self._extend_digests(seq)
        return seq

    def _probe(
        self,
        toks: list[int] | int,
        salt: bytes | None,
        lora: int | None,
        keys: list[bytes] | None = None,
        cap: int | None = None,
    ) -> list[int]:
        """The hit blocks `allocate` would pin for this prompt now; changes nothing."""
        if not self._caching:
            return []
        return self._hits(self._prompt(toks, salt, lora, keys, cap))

    def _get(self, seq_id: object) -> tuple[int, _Seq]:
        sid = _seq_id(seq_id)
        seq = self._seqs.get(sid)
        if seq is None:
            raise UnknownSequenceError(f"unknown sequence id {sid}")
        return sid, seq

    def _resident(self, seq_id: object) -> tuple[int, _Seq]:
        sid, seq = self._get(seq_id)
        if seq.swapped:
            raise SequenceSwappedError(f"sequence {sid} is swapped out")
        return sid, seq

    def _appendable(self, seq_id: object) -> _Seq:
        """A resident sequence whose prompt is fully scheduled (append's state checks)."""
        sid, seq = self._resident(seq_id)
        if seq.scheduled < seq.num_tokens:
            raise InvalidArgumentError(
                f"sequence {sid} has {seq.num_tokens - seq.scheduled} prompt tokens not yet "
                "scheduled: extend it first"
            )
        return seq

    def _write_need(self, seq: _Seq, end: int, lookahead: int) -> tuple[list[int], int]:
        """Writing positions `scheduled .. end - 1` plus `lookahead` slots: the table indices
        that need copy-on-write (shared blocks; no block there is hashed), and the number of
        new blocks past the table."""
        bs = self._block_size
        last = _cdiv(end + lookahead, bs)  # one past the last written table index
        first = seq.scheduled // bs
        written = range(first, min(last, len(seq.blocks)))
        cow = [i for i in written if self._must_copy(seq.blocks[i])]
        return cow, max(0, last - len(seq.blocks))

    def _must_copy(self, b: int) -> bool:
        """A write into block `b` copies it first: shared, or hashed. A written block is
        never hashed while the invariants hold (`truncate` leaves its partial block
        exclusive and unhashed); copying a hashed one anyway is the core's defence."""
        return self._rc[b] > 1 or self._hashed[b] is not None

    def _copy(self, seq: _Seq, i: int) -> tuple[int, int]:
        """Copy-on-write of table entry `i`: a new block replaces it (a hashed source this
        table held alone becomes CACHED)."""
        src = seq.blocks[i]
        dst = self._take()
        seq.blocks[i] = dst
        self._release_all([src])
        self._cow_copies += 1
        return src, dst

    def _write(self, seq: _Seq, cow: list[int], new: int) -> list[tuple[int, int]]:
        pairs = [self._copy(seq, i) for i in cow]
        for _ in range(new):
            seq.blocks.append(self._take())
        return pairs

    def _schedule(self, seq: _Seq, end: int, keys: list[bytes] | None = None) -> None:
        """Tokens up to `end` are scheduled (and a caller-keyed sequence's further `keys`
        added): register the blocks that became registrable."""
        lo = self._registrable(seq)
        if keys:
            self._add_keys(seq, keys)
        seq.scheduled = end
        self._register(seq, lo, self._registrable(seq))

    # ---------------------------------------------------------------- operations

    def allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        lookahead: int = 0,
        evicted: Evicted | None = None,
        block_hashes: list[bytes] | tuple[bytes, ...] | None = None,
        max_hit_tokens: int | None = None,
        register: bool = True,
        retention: Sequence[tuple[int, int | None, int, float | None]] | None = None,
        decode_retention: tuple[int, float | None] | None = None,
        loaded_tokens: int = 0,
        reachable_tokens: Sequence[int] | None = None,
    ) -> int | None:
        """Give a new sequence the blocks of its cache hit plus `num_new_tokens` prompt
        tokens (all by default); return the cached prompt tokens. `evicted`: see `_duties`.
        `block_hashes`: the caller's keys (the sequence is keyed by them, not its tokens);
        `max_hit_tokens` caps the hit; `register=False` holds registration;
        `loaded_tokens`: of the tokens scheduled past the hit, those a load brings (groups
        then need only the hit blocks they read past them)."""
        with self._duties(evicted) as out:
            return out(
                self._allocate(
                    seq_id,
                    token_ids,
                    num_new_tokens,
                    cache_salt,
                    lora_id,
                    lookahead,
                    block_hashes,
                    max_hit_tokens,
                    register,
                    retention,
                    decode_retention,
                    loaded_tokens,
                    reachable_tokens,
                )
            )

    def _allocate(
        self,
        seq_id: int,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        num_new_tokens: int | None,
        cache_salt: str | bytes | None,
        lora_id: int | None,
        lookahead: int,
        block_hashes: object = None,
        max_hit_tokens: object = None,
        register: object = True,
        retention: object = None,
        decode_retention: object = None,
        loaded_tokens: object = 0,
        reachable_tokens: object = None,
    ) -> int | None:
        sid = _seq_id(seq_id)
        toks = _tokens(token_ids)
        k = _opt_count(num_new_tokens)
        salt = _salt_bytes(cache_salt)
        lora = _lora(lora_id)
        la = _check_int(lookahead, "lookahead", 0, _I64_MAX + 1)
        keys = _keys(block_hashes)
        cap = _max_hit(max_hit_tokens)
        reg = _check_bool(register, "register")
        spec = retention_arg(retention, decode_retention)
        reach = None
        if reachable_tokens is not None:
            assert isinstance(reachable_tokens, (list, tuple))
            reach = [_check_int(p, "reachable_tokens", 0, _I32_MAX + 1) for p in reachable_tokens]
        n = len(toks)
        k = _fits_prompt(k, n)
        _no_extras_with_keys(keys, salt, lora)
        loaded = _loaded(loaded_tokens, n, k)
        self._check_retention_allowed(spec)
        past = [p for p in reach or () if p > n]
        if past:
            raise InvalidArgumentError(
                f"reachable position {past[0]} is past the prompt's {n} tokens"
            )
        if keys is not None:
            _key_count(len(keys), n, self._block_size)
        if sid in self._seqs:
            raise DuplicateSequenceError(f"sequence id {sid} already exists")
        seq = self._prompt(toks, salt, lora, keys, cap)
        seq.loaded = loaded
        seq.reachable = [n - 1] if reach is None else reach
        if spec is not None:
            seq.retention = (spec, n)
        if not reg:
            seq.hold = 0  # `_admit` raises it to the hit: only the hit's blocks are cached
        return self._admit(sid, seq, k, la)

    def _new_seq(self, salt: bytes | None, lora: int | None) -> _Seq:
        return _Seq(salt, lora)

    def _check_retention_allowed(self, spec: RetentionSpec | None) -> None:
        if spec is None:
            return
        if self._groups:
            raise InvalidArgumentError("retention with KV-cache groups (groups=) is not supported")
        if self._eviction != "priority":
            raise InvalidArgumentError(
                f"retention needs eviction='priority', this manager evicts by \"{self._eviction}\""
            )

    def _tenant_of(self, salt: bytes | None) -> int:
        """The tenant id of `salt`, made on first use (0 without tenants)."""
        if not self._tenants or salt is None:
            return 0
        t = self._tenant_ids.get(salt)
        if t is None:
            t = self._tenant_ids[salt] = len(self._tenant_salts)
            self._tenant_salts.append(salt)
            self._tenant_counts.append([0, 0])
            self._tenant_order.append(0)
        elif self._tenant_present(t):
            return t
        # New, or back after it left: counted and placed afresh.
        self._tenant_counts[t] = [0, 0]
        self._tenant_order[t] = self._next_tenant_order = self._next_tenant_order + 1
        return t

    _next_tenant_order = 0

    def _tenant_present(self, t: int) -> bool:
        """Whether tenant `t` is in the registry: unsalted, or with a quota, a live sequence
        or a CACHED block."""
        return (
            t == 0
            or t in self._tenant_quotas
            or any(s.tenant == t for s in self._seqs.values())
            or any(
                self._rc[b] == 0 and self._hashed[b] is not None and self._block_tenant[b] == t
                for b in range(self._num_blocks)
            )
        )

    def _admit(self, sid: int, seq: _Seq, k: int, la: int) -> int | None:
        """`allocate` once its checks passed: pin the hits, take the new blocks, register."""
        bs = self._block_size
        n = seq.num_tokens
        hits = self._hits(seq) if self._caching else []
        h = len(hits)
        s = min(h * bs + k, n)
        total = _cdiv(s + la, bs)
        # Errors before the capacity answer: a hit block already at the holder limit.
        for b in hits:
            if self._rc[b] >= MAX_REFCOUNT:
                raise RefcountOverflowError(f"block {b} already has {MAX_REFCOUNT} holders")
        need = (total - h) + sum(1 for b in hits if self._costs_unit(b))
        if need > self._available():
            return None
        seq.tenant = self._tenant_of(seq.salt)
        for b in hits:
            if self._rc[b] == 0:
                self._revive(b)  # CACHED -> OWNED
            self._rc[b] += 1
        self._missed(seq.digests[h:])
        seq.blocks = hits + [self._take() for _ in range(total - h)]
        seq.hits = h
        if seq.hold is not None:
            seq.hold = h
        seq.scheduled = h * bs
        self._schedule(seq, s)
        self._admitted(sid, seq, h)
        return h * bs

    def _admitted(self, sid: int, seq: _Seq, h: int) -> None:
        """Count the prompt's lookup and its hit of `h` blocks; keep the sequence."""
        if self._caching:
            self._prefix_queries += seq.num_tokens
            self._prefix_hits += h * self._block_size
            self._recent.append((seq.num_tokens, h * self._block_size))
            self._tenant_counts[seq.tenant][0] += seq.num_tokens
            self._tenant_counts[seq.tenant][1] += h * self._block_size
        self._seqs[sid] = seq

    def extend(
        self,
        seq_id: int,
        num_new_tokens: int,
        *,
        lookahead: int = 0,
        evicted: Evicted | None = None,
        release: bool = True,
    ) -> list[tuple[int, int]] | None:
        """Schedule the next `num_new_tokens` prompt tokens (chunked prefill); return the
        copy-on-write pairs, or None. `release=False`: the entries the groups no longer need
        stay (`release_skipped` releases them)."""
        with self._duties(evicted) as out:
            return out(self._extend(seq_id, num_new_tokens, lookahead, release))

    def _extend(
        self, seq_id: int, num_new_tokens: int, lookahead: int, release: object = True
    ) -> list[tuple[int, int]] | None:
        sid = _seq_id(seq_id)
        k = _check_int(num_new_tokens, "num_new_tokens", 1, _I64_MAX + 1)
        la = _check_int(lookahead, "lookahead", 0, _I64_MAX + 1)
        rel = _check_bool(release, "release")
        _, seq = self._resident(sid)
        left = seq.num_tokens - seq.scheduled
        if k > left:
            raise InvalidArgumentError(
                f"num_new_tokens {k} out of range [1, {left}] for sequence {sid} "
                f"({left} prompt tokens left to schedule)"
            )
        return self._extend_to(seq, seq.scheduled + k, la, rel)

    def release_skipped(self, seq_id: int, num_tokens: int) -> int:
        """Release the entries each group no longer needs when the sequence's next position
        is `num_tokens` (at most its scheduled tokens), group by group, tail first (what a
        step releases first); returns how many. Without groups there are none."""
        sid = _seq_id(seq_id)
        n = _check_int(num_tokens, "num_tokens", 0, _I64_MAX + 1)
        _, seq = self._resident(sid)
        return self._release_skipped(seq, n)

    def _release_skipped(self, seq: _Seq, num_tokens: int) -> int:
        return 0

    def _extend_to(
        self, seq: _Seq, m: int, la: int, release: bool = True
    ) -> list[tuple[int, int]] | None:
        """`extend` once its checks passed: schedule the prompt up to `m` (`release` matters
        only with groups)."""
        cow, new = self._write_need(seq, m, la)
        if len(cow) + new > self._available():
            return None
        pairs = self._write(seq, cow, new)
        self._schedule(seq, m)
        return pairs

    def append(
        self,
        seq_id: int,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        lookahead: int = 0,
        evicted: Evicted | None = None,
        block_hashes: list[bytes] | tuple[bytes, ...] | None = None,
        release: bool = True,
    ) -> list[tuple[int, int]] | None:
        """Add tokens to a resident, fully scheduled sequence, plus `lookahead` draft slots
        past them; return the copy-on-write pairs, or None. Tokens may be empty with
        lookahead (slots only) or keys (keys only); `block_hashes` continue a caller-keyed
        sequence's keys. `release`: as `extend`'s."""
        with self._duties(evicted) as out:
            return out(self._append(seq_id, token_ids, lookahead, block_hashes, release))

    def _append(
        self,
        seq_id: int,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        lookahead: int,
        block_hashes: object = None,
        release: object = True,
    ) -> list[tuple[int, int]] | None:
        sid = _seq_id(seq_id)
        toks = _int_list(token_ids, "token_ids", 0, _U32)  # argument checks before state checks
        la = _check_int(lookahead, "lookahead", 0, _I64_MAX + 1)
        keys = _keys(block_hashes)
        rel = _check_bool(release, "release")
        if not toks and la == 0 and keys is None:
            raise InvalidArgumentError(
                "token_ids must not be empty (unless lookahead > 0 or block_hashes are given)"
            )
        seq = self._appendable(sid)
        if seq.num_tokens + len(toks) > MAX_LEN:
            raise InvalidArgumentError(f"sequence {sid} would hold more than {MAX_LEN} tokens")
        if keys is not None:
            self._check_more_keys(sid, seq, keys, seq.num_tokens + len(toks))
        return self._append_tokens(seq, toks, la, keys or [], rel)

    def _append_tokens(
        self,
        seq: _Seq,
        toks: list[int],
        la: int,
        keys: list[bytes] | None = None,
        release: bool = True,
    ) -> list[tuple[int, int]] | None:
        """`append` once its checks passed (`release` matters only with groups)."""
        cow, new = self._write_need(seq, seq.num_tokens + len(toks), la)
        if len(cow) + new > self._available():
            return None
        return self._do_append(seq, toks, cow, new, keys)

    def _do_append(
        self,
        seq: _Seq,
        toks: list[int],
        cow: list[int],
        new: int,
        keys: list[bytes] | None = None,
    ) -> list[tuple[int, int]]:
        pairs = self._write(seq, cow, new)
        seq.tokens.extend(toks)
        if self._caching:
            self._extend_digests(seq)
        self._schedule(seq, seq.num_tokens, keys)
        return pairs

    def register(
        self,
        seq_id: int,
        *,
        num_tokens: int | None = None,
        block_hashes: list[bytes] | tuple[bytes, ...] | None = None,
    ) -> int:
        """Register the blocks full of scheduled tokens and keyed, below `num_tokens` (default
        all), after adding `block_hashes`; lift the hold up to there (None: lift it). Returns
        the blocks newly registered."""
        sid = _seq_id(seq_id)
        t = None if num_tokens is None else _check_int(num_tokens, "num_tokens", 0, _I64_MAX + 1)
        keys = _keys(block_hashes)
        _, seq = self._resident(sid)
        if t is not None and t > seq.scheduled:
            raise InvalidArgumentError(
                f"num_tokens {t} for sequence {sid} must be in 0..={seq.scheduled}"
            )
        if keys is not None:
            self._check_more_keys(sid, seq, keys, seq.num_tokens)
        before = self._registered_blocks
        lo = self._registrable(seq)
        if keys:
            self._add_keys(seq, keys)
        if t is None:
            seq.hold = None
        elif seq.hold is not None:
            seq.hold = max(seq.hold, t // self._block_size)
        self._register(seq, lo, self._registrable(seq))
        return self._registered_blocks - before

    def num_block_hashes(self, seq_id: int) -> int:
        """The keys (digests) the sequence has."""
        return len(self._get(seq_id)[1].digests)

    def truncate(
        self, seq_id: int, num_tokens: int, *, evicted: Evicted | None = None
    ) -> list[tuple[int, int]] | None:
        """Drop every token past `num_tokens` and the blocks past them (rejected drafts);
        return the copy-on-write pairs (a shared block left partial), or None."""
        with self._duties(evicted) as out:
            return out(self._truncate(seq_id, num_tokens))

    def _truncate(self, seq_id: int, num_tokens: int) -> list[tuple[int, int]] | None:
        sid = _seq_id(seq_id)
        m = _check_int(num_tokens, "num_tokens", 1, _I64_MAX + 1)
        _, seq = self._resident(sid)
        if m > seq.num_tokens:
            raise InvalidArgumentError(
                f"num_tokens {m} out of range [1, {seq.num_tokens}] for sequence {sid}"
            )
        return self._truncate_to(seq, m)

    def _truncate_to(self, seq: _Seq, m: int) -> list[tuple[int, int]] | None:
        """`truncate` once its checks passed."""
        bs = self._block_size
        i = m // bs
        # A block left partial that was full is written next: it must end this sequence's
        # alone and unhashed, or another holder full there could register it and the write
        # would land in a cached block. Hashed and held alone, it leaves the index; shared
        # (hashed or not), it is copied (after the releases below). A roll-back inside a block
        # that was already partial changes nothing there: every holder holds its same tokens.
        copy = False
        if m % bs and i < len(seq.blocks) and seq.num_tokens >= (i + 1) * bs:
            b = seq.blocks[i]
            if self._rc[b] > 1:
                if self._available() == 0:
                    return None
                copy = True
            elif self._hashed[b] is not None:
                self._unindex(b)
        keep = _cdiv(m, bs)
        self._retain(seq, keep, len(seq.blocks) - keep)
        dropped = seq.blocks[keep:]
        del seq.blocks[keep:]
        self._release_all(dropped)  # hashed ones become CACHED: their KV was computed
        self._truncated_blocks += len(dropped)
        pairs = [self._copy(seq, i)] if copy else []
        del seq.tokens[m:]
        del seq.digests[i:]
        del seq.keys[i:]
        if seq.hold is not None:
            seq.hold = min(seq.hold, i)
        seq.scheduled = min(seq.scheduled, m)
        seq.hits = min(seq.hits, i)
        return pairs

    def fork(self, parent_id: int, child_id: int, *, evicted: Evicted | None = None) -> None:
        """The child shares every block of the parent (evicts nothing)."""
        with self._duties(evicted):
            self._fork(parent_id, child_id)

    def _fork(self, parent_id: int, child_id: int) -> None:
        pid = _seq_id(parent_id, "parent_id")
        cid = _seq_id(child_id, "child_id")  # both arguments before any state check
        _, parent = self._resident(pid)
        if cid in self._seqs:
            raise DuplicateSequenceError(f"sequence id {cid} already exists")
        for b in self._held(parent):
            if self._rc[b] >= MAX_REFCOUNT:
                raise RefcountOverflowError(f"block {b} already has {MAX_REFCOUNT} holders")
        child = parent.copy()
        for b in self._held(child):
            self._rc[b] += 1
        self._seqs[cid] = child

    def _held(self, seq: _Seq) -> list[int]:
        """The GPU blocks a resident sequence holds a reference to."""
        return seq.blocks

    def free(self, seq_id: int, *, num_computed_tokens: int | None = None) -> None:
        """Release a sequence's blocks, tail first, and forget it. The blocks it registered
        past its `num_computed_tokens` are withdrawn from the prefix index first."""
        sid = _seq_id(seq_id)
        c = (
            None
            if num_computed_tokens is None
            else _check_int(num_computed_tokens, "num_computed_tokens", 0, _I64_MAX + 1)
        )
        _, seq = self._get(sid)
        if c is not None and c > seq.num_tokens:
            raise InvalidArgumentError(
                f"num_computed_tokens {c} out of range [0, {seq.num_tokens}] for sequence {sid}"
            )
        self._free_one(sid, c)

    def _free_one(self, sid: int, computed: int | None = None) -> None:
        seq = self._seqs.pop(sid)
        if seq.swapped:
            self._cpu_free.extend(reversed(seq.cpu_blocks))
            self._cpu_removed(seq)
            return
        bs = self._block_size
        c = seq.scheduled if computed is None else computed
        # Registered (by this sequence or the one it was forked from) but never computed:
        # no holder has valid KV in it, so it must never be served as a hit again. Other
        # holders keep it as an ordinary unhashed block.
        for i in range(self._registrable(seq) - 1, max(seq.hits, c // bs) - 1, -1):  # tail first
            b = seq.blocks[i]
            if self._hashed[b] is not None and self._hashed[b] == seq.digests[i]:
                self._unindex(b)
                self._unregistered_blocks += 1
        self._retain(seq, 0, len(seq.blocks))
        self._release_all(seq.blocks)

    def _cpu_removed(self, seq: _Seq) -> None:
        """The CPU copies of the blocks `swap_out` stored are gone."""
        if self._events_on and self._caching:
            for d in seq.digests[: self._registrable(seq)]:
                self._cpu_copy_gone(0, d)

    def _cpu_copy_stored(self, group: int, digest: bytes, event: BlockStored) -> None:
        """One more CPU copy of `digest` in `group`: `event` (its `BlockStored(CPU)`) only
        for the first, so that the events describe per key whether some copy is there."""
        key = (group, digest)
        self._cpu_copies[key] += 1
        if self._cpu_copies[key] == 1:
            self._log.push(event)

    def _cpu_copy_gone(self, group: int, digest: bytes) -> None:
        """One CPU copy of `digest` in `group` is gone: `BlockRemoved(CPU)` with the last."""
        key = (group, digest)
        self._cpu_copies[key] -= 1
        if self._cpu_copies[key] == 0:
            del self._cpu_copies[key]
            self._log.push(BlockRemoved(block_hashes=[digest], medium="CPU", group_idx=group))

    def swap_out(self, seq_id: int) -> list[tuple[int, int]] | None:
        """Move a resident sequence to CPU blocks; return the (gpu, cpu) pairs, or None."""
        _, seq = self._resident(seq_id)
        if len(seq.blocks) > len(self._cpu_free):
            return None
        pairs = [(g, self._cpu_free.pop()) for g in seq.blocks]
        self._retain(seq, 0, len(seq.blocks))
        self._release_all(seq.blocks)
        seq.cpu_blocks = [c for _, c in pairs]
        seq.blocks = []
        seq.swapped = True
        self._swapped_out_blocks += len(pairs)
        if self._events_on and self._caching:
            for i in range(self._registrable(seq)):
                self._cpu_copy_stored(0, seq.digests[i], self._stored(seq, i, "CPU"))
        return pairs

    def swap_in(
        self, seq_id: int, *, evicted: Evicted | None = None
    ) -> list[tuple[int, int]] | None:
        """Move a swapped sequence back to GPU blocks; return the (cpu, gpu) pairs, or None."""
        with self._duties(evicted) as out:
            return out(self._swap_in(seq_id))

    def _swap_in(self, seq_id: int) -> list[tuple[int, int]] | None:
        sid, seq = self._get(seq_id)
        if not seq.swapped:
            raise SequenceNotSwappedError(f"sequence {sid} is not swapped out")
        # Every swapped block gets a fresh GPU block: cached copies of its content are not
        # reused, and its full scheduled blocks are registered afresh (or stay unhashed).
        need = len(seq.cpu_blocks)
        if need > self._available():
            return None
        pairs = [(c, self._take()) for c in seq.cpu_blocks]
        self._cpu_free.extend(reversed(seq.cpu_blocks))
        self._cpu_removed(seq)
        seq.blocks = [g for _, g in pairs]
        seq.cpu_blocks = []
        seq.swapped = False
        self._register(seq, 0, self._registrable(seq))
        self._swapped_in_blocks += need
        return pairs

    def lookup(
        self,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        block_hashes: list[bytes] | tuple[bytes, ...] | None = None,
        max_hit_tokens: int | None = None,
        loaded_tokens: int = 0,
    ) -> int:
        """The prompt tokens `allocate` would serve from the cache now; touches nothing."""
        toks = _tokens(token_ids)
        salt = _salt_bytes(cache_salt)
        lora = _lora(lora_id)
        keys = _keys(block_hashes)
        cap = _max_hit(max_hit_tokens)
        _no_extras_with_keys(keys, salt, lora)
        loaded = _loaded(loaded_tokens, len(toks), len(toks))
        if keys is not None:
            _key_count(len(keys), len(toks), self._block_size)
        return self._hit_tokens(toks, salt, lora, keys, cap, loaded)

    def _hit_tokens(
        self,
        toks: list[int],
        salt: bytes | None,
        lora: int | None,
        keys: list[bytes] | None = None,
        cap: int | None = None,
        loaded: int = 0,
    ) -> int:
        return len(self._probe(toks, salt, lora, keys, cap)) * self._block_size

    def lookup_many(
        self,
        prompts: Iterable[Sequence[int] | npt.NDArray[np.integer[Any]]],
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> list[int]:
        """`lookup` of each prompt, in order (as `pagedkv.BlockManager.lookup_many`)."""
        return [self.lookup(p, cache_salt=cache_salt, lora_id=lora_id) for p in prompts]

    # ---------------------------------------------------------------- pool-level calls

    def _is_null(self, b: int) -> bool:
        """Whether `b` is the null block (only with a group that is not full attention)."""
        return False

    def evict_blocks(self, block_ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> int:
        """Take these GPU blocks out of the prefix cache (their KV is bad): a CACHED one
        becomes FREE (on top of the free stack), a held one stays with its holders,
        unhashed. Blocks not in the cache are ignored. Returns how many left the cache."""
        ids = _int_list(block_ids, "block_ids", 0, _I32_MAX + 1)
        for b in ids:  # every id checked, in order, before anything changes
            if b >= self._num_blocks:
                raise InvalidArgumentError(
                    f"block_ids: block {b} out of range [0, {self._num_blocks})"
                )
            if self._is_null(b):
                raise InvalidArgumentError(f"block_ids: block {b} is the null block")
        removed = 0
        for b in ids:
            if self._hashed[b] is None:
                continue
            self._unindex(b)
            if self._rc[b] == 0:  # CACHED -> FREE
                if b in self._pins:
                    self._gone_free(b)  # outside the policy
                else:
                    self._policy.on_removed(b)
                self._free.append(b)
            removed += 1
        self._unregistered_blocks += removed
        return removed

    def _hit_blocks(
        self,
        toks: list[int],
        salt: bytes | None,
        lora: int | None,
        max_hit: int | None,
        keys: list[bytes] | None = None,
        loaded: int = 0,
    ) -> tuple[int, list[list[int]]]:
        """`h` and each group's first `h` table entries `allocate` would install now (one
        full-attention group reads every block: `loaded` changes nothing)."""
        hits = self._probe(toks, salt, lora, keys, max_hit)
        return len(hits), [hits]

    def _query_keys(
        self, n: int, salt: bytes | None, lora: int | None, block_hashes: object
    ) -> list[bytes] | None:
        """The caller's keys of a pool-level query, checked as `lookup` checks them."""
        keys = _keys(block_hashes)
        _no_extras_with_keys(keys, salt, lora)
        if keys is not None:
            _key_count(len(keys), n, self._block_size)
        return keys

    def allocation_cost(
        self,
        num_tokens_or_token_ids: int | Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        block_hashes: Sequence[bytes] | None = None,
        max_hit_tokens: int | None = None,
        lookahead: int = 0,
        loaded_tokens: int = 0,
    ) -> tuple[int, int, int]:
        """`(hit_tokens, new_blocks, revived_blocks)`: what `allocate` would take now (the
        hit, the blocks from the free pool, the hit's CACHED blocks), over every group."""
        arg = num_tokens_or_token_ids
        count = _int_value(arg)
        toks: list[int] | None = None
        if count is None:
            toks = _tokens(arg)
            n = len(toks)
        elif count < 1:
            raise InvalidArgumentError(f"num_tokens {count} must be at least 1")
        else:
            n = min(count, _I64_MAX)  # as the binding reads a count
        k = _opt_count(num_new_tokens)
        salt = _salt_bytes(cache_salt)
        lora = _lora(lora_id)
        keys = _keys(block_hashes)
        max_hit = _max_hit(max_hit_tokens)
        la = _check_int(lookahead, "lookahead", 0, _I64_MAX + 1)
        if toks is None and keys is not None:
            raise InvalidArgumentError(
                "block_hashes= needs the prompt's token ids (a length has no hit)"
            )
        k = _fits_prompt(k, n)
        loaded = _loaded(loaded_tokens, n, k)
        bs = self._block_size
        if toks is None:  # a length: no hit
            return 0, min(self.num_groups * _cdiv(k + la, bs), _U64 - 1), 0
        keys = self._query_keys(n, salt, lora, keys)
        h, tables = self._hit_blocks(toks, salt, lora, max_hit, keys, loaded)
        total = _cdiv(min(h * bs + k, n) + la, bs)
        held = [b for t in tables for b in t if not self._is_null(b)]
        new = min(self.num_groups * (total - h), _U64 - 1)
        return h * bs, new, sum(1 for b in held if self._costs_unit(b))

    def lookup_blocks(
        self,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        block_hashes: Sequence[bytes] | None = None,
        max_hit_tokens: int | None = None,
        loaded_tokens: int = 0,
    ) -> tuple[int, list[list[int]]]:
        """`(hit_tokens, blocks)`: the hit `allocate` would pin now, `blocks[g]` group `g`'s
        first table entries (the null block where it needs none); touches nothing."""
        toks = _tokens(token_ids)
        salt = _salt_bytes(cache_salt)
        lora = _lora(lora_id)
        keys = _keys(block_hashes)
        max_hit = _max_hit(max_hit_tokens)
        keys = self._query_keys(len(toks), salt, lora, keys)
        loaded = _loaded(loaded_tokens, len(toks), len(toks))
        h, tables = self._hit_blocks(toks, salt, lora, max_hit, keys, loaded)
        return h * self._block_size, tables

    def lookup_blocks_per_group(
        self,
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        block_hashes: Sequence[bytes] | None = None,
        max_hit_tokens: int | None = None,
    ) -> list[tuple[int, list[int]]]:
        """Each group's own hit (one full-attention group here: the hit) with its first
        table entries; touches nothing."""
        toks = _tokens(token_ids)
        keys = _keys(block_hashes)
        max_hit = _max_hit(max_hit_tokens)
        keys = self._query_keys(len(toks), None, None, keys)
        return self._per_group(toks, max_hit, keys)

    def _per_group(
        self, toks: list[int], max_hit: int | None, keys: list[bytes] | None
    ) -> list[tuple[int, list[int]]]:
        h, tables = self._hit_blocks(toks, None, None, max_hit, keys)
        return [(h * self._block_size, tables[0])]

    def _status(self, total: int, need: int) -> AllocStatus:
        wm = self._watermark_blocks
        if self._num_blocks - total < wm:
            return AllocStatus.NEVER
        if self._available() - need >= wm:
            return AllocStatus.OK
        return AllocStatus.LATER

    def can_allocate(
        self,
        num_tokens_or_token_ids: int | Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        num_new_tokens: int | None = None,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
        block_hashes: list[bytes] | tuple[bytes, ...] | None = None,
        max_hit_tokens: int | None = None,
        loaded_tokens: int = 0,
    ) -> AllocStatus:
        """Would this prompt (a token count, or its token ids: then its cache hit counts;
        with `block_hashes` a count's hit counts too) fit now (OK), later (LATER) or never
        (NEVER)?"""
        arg = num_tokens_or_token_ids
        count = _int_value(arg)
        toks: list[int] | None = None
        if count is None:
            toks = _tokens(arg)
            n = len(toks)
        elif count < 1:
            raise InvalidArgumentError(f"num_tokens {count} must be at least 1")
        else:
            n = count  # any size: NEVER when too big
        k = _opt_count(num_new_tokens)
        salt = _salt_bytes(cache_salt)
        lora = _lora(lora_id)
        keys = _keys(block_hashes)
        cap = _max_hit(max_hit_tokens)
        k = _fits_prompt(k, n)
        _no_extras_with_keys(keys, salt, lora)
        loaded = _loaded(loaded_tokens, n, k)
        if keys is not None:
            _key_count(len(keys), n, self._block_size)
        return self._alloc_status(toks, n, k, salt, lora, keys, cap, loaded)

    def _alloc_status(
        self,
        toks: list[int] | None,
        n: int,
        k: int,
        salt: bytes | None,
        lora: int | None,
        keys: list[bytes] | None = None,
        cap: int | None = None,
        loaded: int = 0,
    ) -> AllocStatus:
        """`can_allocate` once its checks passed (`toks` None: a count, no hit credited
        unless keys are given)."""
        bs = self._block_size
        if toks is None and keys is None:
            total = _cdiv(k, bs)
            return self._status(total, total)
        hits = self._probe(n if toks is None else toks, salt, lora, keys, cap)
        h = len(hits)
        total = _cdiv(min(h * bs + k, n), bs)
        return self._status(total, total - h + sum(1 for b in hits if self._costs_unit(b)))

    def can_swap_in(self, seq_id: int) -> AllocStatus:
        """Would the swapped sequence fit now, later or never?"""
        sid, seq = self._get(seq_id)
        if not seq.swapped:
            raise SequenceNotSwappedError(f"sequence {sid} is not swapped out")
        return self._status(len(seq.cpu_blocks), len(seq.cpu_blocks))

    # ---------------------------------------------------------------- batch calls

    def append_batch(
        self,
        seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        lookahead: int = 0,
        evicted: Evicted | None = None,
    ) -> npt.NDArray[np.int32] | None:
        """One token per sequence; the copy-on-write pairs as an int32 (k, 2) array, or None."""
        with self._duties(evicted) as out:
            return out(self._append_batch(seq_ids, token_ids, lookahead))

    def _append_batch(
        self,
        seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        token_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        lookahead: int,
    ) -> npt.NDArray[np.int32] | None:
        ids = _seq_ids(seq_ids)
        toks = _int_list(token_ids, "token_ids", 0, _U32)
        la = _check_int(lookahead, "lookahead", 0, _I64_MAX + 1)
        if len(ids) != len(toks):
            raise InvalidArgumentError(
                f"seq_ids and token_ids lengths differ ({len(ids)} != {len(toks)})"
            )
        _distinct(ids)
        seqs = [self._appendable(s) for s in ids]  # per sequence, in batch order
        return self._append_each(seqs, toks, la)

    def _append_each(
        self, seqs: list[_Seq], toks: list[int], la: int
    ) -> npt.NDArray[np.int32] | None:
        """`append_batch` once its checks passed."""
        need = 0
        for seq in seqs:
            cow, new = self._write_need(seq, seq.num_tokens + 1, la)
            need += len(cow) + new
        if need > self._available():
            return None
        pairs: list[tuple[int, int]] = []
        for seq, t in zip(seqs, toks, strict=True):
            # An earlier append may have unshared a block: count again.
            cow, new = self._write_need(seq, seq.num_tokens + 1, la)
            pairs.extend(self._do_append(seq, [t], cow, new))
        return np.array(pairs, dtype=np.int32).reshape(len(pairs), 2)

    def free_batch(self, seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> None:
        """Free each sequence, in the given order."""
        ids = _seq_ids(seq_ids)
        _distinct(ids)
        for s in ids:
            self._get(s)
        for s in ids:
            self._free_one(s)

    def running_batch(
        self, seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]] | None = None
    ) -> ReferenceRunningBatch:
        """A `RunningBatch` over this manager's sequences, holding `seq_ids` (default none)."""
        from pagedkv_reference.running import ReferenceRunningBatch

        batch = ReferenceRunningBatch(self)
        if seq_ids is not None:
            batch.add(seq_ids)
        return batch

    def _group_arg(self, group: object) -> int:
        """A group index in `[0, len(groups))` (only `0` without groups)."""
        return _check_int(group, "group", 0, max(1, len(self._groups)))

    def _table(self, seq: _Seq, group: int) -> list[int]:
        """The GPU table of a resident sequence in that group."""
        return seq.blocks

    def block_tables(
        self,
        seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        pad: int = -1,
        *,
        group: int = 0,
    ) -> npt.NDArray[np.int32]:
        """The GPU tables (of `group`) as an int32 (batch, max blocks) array, padded with
        `pad`."""
        ids = _seq_ids(seq_ids)
        p = _check_int(pad, "pad", _I32_MIN, _I32_MAX + 1)
        g = self._group_arg(group)
        tables = [self._table(self._resident(s)[1], g) for s in ids]
        width = max((len(t) for t in tables), default=0)
        out = np.full((len(tables), width), p, dtype=np.int32)
        for r, t in enumerate(tables):
            out[r, : len(t)] = t
        return out

    def slot_mapping(
        self,
        seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        num_new_tokens: int | Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        lookahead: int | Sequence[int] | npt.NDArray[np.integer[Any]] = 0,
        group: int = 0,
    ) -> npt.NDArray[np.int64]:
        """The int64 slots (in `group`'s table) of each sequence's last `num_new_tokens`
        scheduled tokens, then of its `lookahead` draft positions past them (one int for
        all, or one per sequence), concatenated."""
        ids = _seq_ids(seq_ids)
        counts = _counts(num_new_tokens, len(ids))
        las = _lookaheads(lookahead, len(ids))
        g = self._group_arg(group)
        if len(counts) != len(ids):
            raise InvalidArgumentError(
                f"num_new_tokens has {len(counts)} entries for {len(ids)} sequences"
            )
        _same_len(las, ids)
        bs = self._block_size
        seqs = []
        for sid, k, la in zip(ids, counts, las, strict=True):  # per sequence: known, resident, fits
            _, s = self._resident(sid)
            if k > s.scheduled:
                raise InvalidArgumentError(
                    f"num_new_tokens {k} out of range [1, {s.scheduled}] for sequence {sid}"
                )
            self._check_room(sid, s, la, g)
            seqs.append(s)
        slots: list[int] = []
        for s, k, la in zip(seqs, counts, las, strict=True):
            t = self._table(s, g)
            slots.extend(t[p // bs] * bs + p % bs for p in range(s.scheduled - k, s.scheduled + la))
        return np.array(slots, dtype=np.int64)

    def _check_room(self, sid: int, s: _Seq, la: int, g: int) -> None:
        """`la` draft slots past the scheduled tokens must be in the table already (reserved
        by a scheduling call's `lookahead`): a query takes no blocks."""
        room = len(self._table(s, g)) * self._block_size - s.scheduled
        if la > room:
            raise InvalidArgumentError(
                f"lookahead {la}: sequence {sid} has room for "
                f"{room} slots past its scheduled tokens"
            )

    def flashinfer_page_table(
        self,
        seq_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
        *,
        lookahead: int | Sequence[int] | npt.NDArray[np.integer[Any]] = 0,
        group: int = 0,
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """(kv_indptr, kv_indices, kv_last_page_len) of the scheduled tokens plus
        `lookahead` draft slots (one int for all, or one per sequence) of each sequence (in
        `group`'s table), int32, in FlashInfer's paged layout."""
        ids = _seq_ids(seq_ids)
        las = _lookaheads(lookahead, len(ids))
        g = self._group_arg(group)
        _same_len(las, ids)
        seqs = []
        for sid, la in zip(ids, las, strict=True):
            s = self._resident(sid)[1]
            self._check_room(sid, s, la, g)
            seqs.append(s)
        bs = self._block_size
        indptr = [0]
        indices: list[int] = []
        last: list[int] = []
        for s, la in zip(seqs, las, strict=True):
            n = s.scheduled + la
            pages = _cdiv(n, bs)
            indices.extend(self._table(s, g)[:pages])
            indptr.append(len(indices))
            last.append(n - (pages - 1) * bs)
        return (
            np.array(indptr, dtype=np.int32),
            np.array(indices, dtype=np.int32),
            np.array(last, dtype=np.int32),
        )

    # ---------------------------------------------------------------- queries

    def block_table(
        self, seq_id: int, start: int | None = None, stop: int | None = None, *, group: int = 0
    ) -> list[int]:
        """The GPU block ids of a resident sequence (its table in `group`; entries
        `start..stop`, clamped as a slice is)."""
        sid = _seq_id(seq_id)
        lo = 0 if start is None else _check_int(start, "start", 0, 2**63)
        hi = None if stop is None else _check_int(stop, "stop", 0, 2**63)
        g = self._group_arg(group)
        return list(self._table(self._resident(sid)[1], g))[lo:hi]

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id)[1].num_tokens

    def num_scheduled_tokens(self, seq_id: int) -> int:
        """The tokens scheduled for compute so far (`s`)."""
        return self._get(seq_id)[1].scheduled

    def table_digest(self, seq_id: int) -> int:
        """A 64-bit digest of the GPU table (position-aware): equal tables, equal digests.

        A swapped-out sequence has an empty GPU table."""
        blocks = self._get(seq_id)[1].blocks
        raw = np.array(blocks, dtype=np.int64).tobytes()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")

    def block_hashes(
        self, seq_id: int, start: int | None = None, stop: int | None = None
    ) -> list[bytes]:
        """The chain digests of the sequence's full blocks (`start..stop` of them, clamped
        as a slice is)."""
        lo = 0 if start is None else _check_int(start, "start", 0, 2**63)
        hi = None if stop is None else _check_int(stop, "stop", 0, 2**63)
        return list(self._get(seq_id)[1].digests)[lo:hi]

    def is_swapped(self, seq_id: int) -> bool:
        return self._get(seq_id)[1].swapped

    def __contains__(self, seq_id: object) -> bool:
        v = _int_value(seq_id)  # anything but a scalar int (a bool too) is not an id
        return v is not None and v in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._policy) + self.num_pinned_cached()

    @property
    def num_available_blocks(self) -> int:
        return self._available()

    @property
    def num_free_cpu_blocks(self) -> int:
        return len(self._cpu_free)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    def stats(self) -> Stats:
        resident = [s for s in self._seqs.values() if not s.swapped]
        free = len(self._free)
        cached = self.num_cached_blocks
        return Stats(
            num_blocks=self._num_blocks,
            block_size=self._block_size,
            free_blocks=free,
            used_blocks=self._num_blocks - free - cached,
            cached_blocks=cached,
            num_cpu_blocks=self._num_cpu_blocks,
            free_cpu_blocks=len(self._cpu_free),
            num_sequences=len(self._seqs),
            prefix_queries=self._prefix_queries,
            prefix_hits=self._prefix_hits,
            evictions=self._evictions,
            cow_copies=self._cow_copies,
            swapped_out_blocks=self._swapped_out_blocks,
            swapped_in_blocks=self._swapped_in_blocks,
            reserved_slots=sum(len(s.blocks) for s in resident) * self._block_size,
            used_slots=sum(s.scheduled for s in resident),
            recent_prefix_queries=sum(q for q, _ in self._recent),
            recent_prefix_hits=sum(h for _, h in self._recent),
            registered_blocks=self._registered_blocks,
            unregistered_blocks=self._unregistered_blocks,
            truncated_blocks=self._truncated_blocks,
        )

    def print_memory_stats(self, file: TextIO | None = None) -> None:
        """Print a human-readable summary of `stats()` (to stdout by default)."""
        print(self.stats(), file=sys.stdout if file is None else file)

    def reset_prefix_cache(self) -> bool:
        """Drop every CACHED block, unless some block is OWNED (then return False)."""
        if any(rc > 0 for rc in self._rc):
            return False
        self._clear_cached()
        self._index.clear()
        self._prefix_queries = 0  # a fresh cache starts a fresh hit rate (as vLLM's does)
        self._prefix_hits = 0
        self._recent.clear()
        if self._events_on:
            self._log.push(AllBlocksCleared())
        return True

    def _clear_cached(self) -> None:
        """Reset's move of the CACHED blocks to the free stack: under the free blocks, in
        the policy's eviction order (vLLM only drops their hashes, so they stay behind every
        free block in its free queue and are reused last, oldest first), then a fresh policy:
        a reset forgets ghosts and adaptive state too (as the Rust core's)."""
        order: list[int] = []
        while (b := self._policy.victim(self._NOW)) is not None:
            order.append(b)
        # Pinned CACHED blocks go too (a reset drops every hash, pins with them), after the
        # others, by block id.
        order += self._pinned_cached()
        self._pins.clear()
        for b in order:
            self._hashed[b] = None
        self._free[:0] = reversed(order)  # the next victim ends just under the free blocks
        if isinstance(self._policy, TenantQuotas):
            self._policy.clear()  # the tenants' groups and quotas stay
        else:
            self._policy = make_policy(self._eviction, self._num_blocks)

    def drain_events(self) -> list[KVEvent]:
        return self._log.drain()

    def kv_event_snapshot(self) -> list[BlockStored]:
        return self._log_on().snapshot()

    def set_kv_event_capacity(self, capacity: int | None) -> None:
        self._log_on().set_capacity(capacity)

    def kv_event_queue_stats(self) -> KVEventQueueStats:
        return self._log_on().stats()

    def _log_on(self) -> EventLog:
        if not self._events_on:
            raise InvalidArgumentError(
                "KV events are disabled: build the manager with enable_kv_events=True"
            )
        return self._log

    # ---------------------------------------------------------------- audit

    def _check_digests(self, sid: int, s: _Seq) -> None:
        """A sequence's digests: its tokens' chain, or a caller-keyed one's keys' digests
        (none without prefix caching)."""
        bs = self._block_size
        want = (len(s.keys) if s.keyed else s.num_tokens // bs) if self._caching else 0
        if len(s.digests) != want:
            raise InvariantError(f"sequence {sid} has {len(s.digests)} digests, expected {want}")
        if s.keyed and len(s.keys) > s.num_tokens // bs:
            raise InvariantError(f"sequence {sid} has {len(s.keys)} keys for {s.num_tokens} tokens")
        if self._caching and s.keyed:
            if s.digests != [_key_digest(self._hash, k) for k in s.keys]:
                raise InvariantError(f"sequence {sid} digests do not match its keys")
        elif self._caching:
            expect = _Seq(s.salt, s.lora_id)
            expect.tokens = s.tokens
            self._extend_digests(expect)
            if expect.digests != s.digests:
                raise InvariantError(f"sequence {sid} digests do not match its tokens")

    def check_invariants(self) -> None:
        """Audit the lifecycle contract; raise InvariantError naming the first violation."""

        def fail(msg: str) -> NoReturn:
            raise InvariantError(msg)

        n = self._num_blocks
        bs = self._block_size
        rc = [0] * n
        for sid, s in self._seqs.items():
            if not 1 <= s.scheduled <= s.num_tokens:
                fail(f"sequence {sid}: {s.scheduled} scheduled of {s.num_tokens} tokens")
            if not 0 <= s.hits * bs <= s.scheduled:
                fail(f"sequence {sid}: {s.hits} hit blocks, {s.scheduled} scheduled tokens")
            if s.swapped:
                if s.blocks:
                    fail(f"swapped sequence {sid} holds GPU blocks {s.blocks}")
                if len(s.cpu_blocks) < _cdiv(s.scheduled, bs):
                    fail(f"swapped sequence {sid} has too few CPU blocks")
            else:
                if s.cpu_blocks:
                    fail(f"resident sequence {sid} holds CPU blocks {s.cpu_blocks}")
                if len(s.blocks) * bs < s.scheduled:
                    fail(f"sequence {sid} has {len(s.blocks)} blocks for {s.scheduled} tokens")
                for b in s.blocks:
                    if not 0 <= b < n:
                        fail(f"sequence {sid} holds block id {b} out of range")
                    rc[b] += 1
            self._check_digests(sid, s)
            # Registration follows scheduling: every holder of a hashed block has it among its
            # full scheduled blocks, under that block's digest (so no write reaches it).
            for i, b in enumerate(s.blocks):
                d = self._hashed[b]
                if d is None:
                    continue
                # (A held sequence may hold a block a fork registered past its own hold.)
                if i >= min(s.scheduled // bs, len(s.digests)):
                    fail(
                        f"sequence {sid} block {b} at index {i} is hashed but not full of "
                        f"scheduled tokens ({s.scheduled}) or not keyed"
                    )
                if d != s.digests[i]:
                    fail(f"sequence {sid} block {b} hashed under another digest")
        for b in range(n):
            if rc[b] != self._rc[b]:
                fail(f"block {b}: refcount {self._rc[b]}, tables hold {rc[b]}")

        free_set = set(self._free)
        if len(free_set) != len(self._free):
            fail("free stack holds a block twice")
        for b in self._free:
            if not 0 <= b < n:
                fail(f"free stack holds block id {b} out of range")
            if self._rc[b] != 0:
                fail(f"free block {b} has refcount {self._rc[b]}")
            if self._hashed[b] is not None:
                fail(f"free block {b} is hashed")
        cached = self._policy.entries() + [(b, self._hashed[b]) for b in self._pinned_cached()]
        for b in self._pins:
            if self._rc[b] == 0 and self._hashed[b] is None:
                fail(f"free block {b} is pinned")
        for b, key in cached:
            if self._rc[b] != 0:
                fail(f"cached block {b} has refcount {self._rc[b]}")
            if b in free_set:
                fail(f"block {b} is both free and cached")
            if self._hashed[b] is None:
                fail(f"cached block {b} is not hashed")
            if key != self._hashed[b]:
                fail(f"cached block {b} is known to the eviction policy by another digest")
        cached_set = {b for b, _ in cached}
        for d, b in self._index.items():
            if self._hashed[b] != d:
                fail(f"prefix index maps a digest to block {b}, which is not hashed under it")
        num_hashed = sum(1 for d in self._hashed if d is not None)
        if num_hashed != len(self._index):
            fail(f"{num_hashed} blocks are hashed but the index holds {len(self._index)}")
        if not self._caching and self._index:
            fail("prefix index not empty with prefix caching disabled")
        owned = sum(1 for r in self._rc if r > 0)
        if owned + len(self._free) + len(cached) != n:
            fail(f"owned {owned} + free {len(self._free)} + cached {len(cached)} != {n} blocks")
        for b in range(n):
            if self._rc[b] == 0 and b not in free_set and b not in cached_set:
                fail(f"block {b} has refcount 0 but is neither free nor cached")

        cpu = list(self._cpu_free)
        for s in self._seqs.values():
            cpu.extend(s.cpu_blocks)
        if sorted(cpu) != list(range(self._num_cpu_blocks)):
            fail("CPU blocks: free stack and swapped sequences do not partition the CPU space")
        if not self._events_on and self._log.queue:
            fail("events queued with events disabled")
        st = self.stats()
        if len(self._recent) > RECENT_WINDOW or not (
            st.recent_prefix_hits <= st.recent_prefix_queries <= self._prefix_queries
            and st.recent_prefix_hits <= self._prefix_hits
        ):
            fail("the recent hit-rate window does not fit the totals")
