"""`KVCacheManager`: vLLM's KV-cache manager interface over one pagedkv `BlockManager`
(vLLM 0.32 to 0.34; what differs between them is in `compat`).

vLLM's scheduler keeps a request's progress (`num_computed_tokens`) and asks the manager for
slots; pagedkv keeps a sequence's known and scheduled tokens. Each call maps one onto the
other (docs/vllm.md has the table):

- a request's prefix hit and its blocks are keyed by vLLM's own `request.block_hashes`
  (caller keys: multimodal inputs, LoRA names, salts and the hash block size are in them),
  so hits and events agree with vLLM's;
- `allocate_slots` of a new request is one `allocate` that takes exactly the hit the
  scheduler decided on (`max_hit_tokens`); of a running request one `extend` (prompt
  chunk) or `append` (new known tokens; draft, lookahead and placeholder slots as
  `lookahead`, with no token when none is known yet);
- `delay_cache_blocks` holds registration until `cache_blocks`; `evict_blocks` evicts by id.

Block ids are vLLM's: vLLM reserves block 0 as its null block, so a plain pagedkv manager
(no null block) serves ids shifted by one; with a group that is not full attention pagedkv's
block 0 is the null block too and ids are the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    KVCacheBlockCopy,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from pagedkv import _core
from pagedkv.vllm.blocks import PagedKVCacheBlocks, ids_of
from pagedkv.vllm.compat import RELEASE
from pagedkv.vllm.deferred import settled_first
from pagedkv.vllm.divergent import computed_blocks_for_connector
from pagedkv.vllm.events import EventTranslator
from pagedkv.vllm.layout import Layout
from pagedkv.vllm.views import BlockPoolView, coordinator_view
from pagedkv.vllm.window_retention import core_interval, junction, reachable


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# What pagedkv holds for one request (its sequence, known and scheduled tokens, keys handed
# over, table entries given out, held registration), kept in Rust so that a decode step is
# one call (`EngineRecord.decode`).
_Seq = _core.EngineRecord


@settled_first
class KVCacheManager:
    """vLLM's `KVCacheManager`, same constructor, backed by `pagedkv._core.BlockManager`.

    Every public method and property settles the deferred decode steps first (`deferred`).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any | None = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
    ) -> None:
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise NotImplementedError(
                "pagedkv.vllm: decode/prefill context parallelism (dcp/pcp world size > 1) "
                "is not supported"
            )
        assert watermark >= 0.0, "watermark must be non-negative"
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.kv_cache_config = kv_cache_config
        self.layout = layout = Layout(kv_cache_config, hash_block_size)
        if layout.has_cross and enable_caching:
            # vLLM turns prefix caching off for encoder-decoder models (its cross-attention
            # manager has no hits to look up). Served here, a request's cross-attention
            # blocks, taken first, could evict the hit the scheduler had counted.
            raise NotImplementedError(
                "pagedkv.vllm: prefix caching with a cross-attention group (an "
                "encoder-decoder model) is not supported, as in vLLM: disable prefix caching"
            )
        self.num_kv_cache_groups = layout.num_groups
        # One vLLM group that is pagedkv's group 0 (most models): `_per_group` wraps it
        # without walking the layout (a generator and a tuple cost a microsecond on the
        # decode path's cold caches).
        self._one_group = layout.core_index == [0]
        self.block_size = layout.block_size
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        # Per pagedkv group, the cap on a request's full-sequence admission charge.
        self.admission_caps = layout.admission_caps(
            max_model_len if max_in_flight_tokens is None else max_in_flight_tokens,
            max_model_len,
        )
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        # vLLM's sparse retention of window blocks (`window_retention`); None: dense.
        self.retention_interval = core_interval(kv_cache_config, scheduler_block_size, use_eagle)
        self._core_mgr = _core.BlockManager(
            layout.core_num_blocks,
            layout.block_size,
            enable_prefix_caching=enable_caching,
            watermark=0.0,
            enable_kv_events=enable_kv_cache_events,
            groups=layout.core_groups,
            prefix_cache_retention_interval=self.retention_interval,
        )
        # vLLM id = pagedkv id + offset (1 when pagedkv has no null block of its own).
        self.offset = layout.offset
        # Whether some group releases entries a request no longer needs (not full attention).
        self._releases = any(g.kind != "full" for g in layout.groups)
        # A window's release counts the tokens pagedkv holds: where vLLM's scheduler never
        # hands over the tokens a step computed in draft or placeholder slots (0.32: compat
        # `caches_after_output`), each step takes them in first (`_take_in_processed`).
        self._takes_in_processed = self._releases and not RELEASE.caches_after_output
        # request id -> what pagedkv holds for it (`_Seq`); never rebound (`_deferred` holds it)
        self._seqs: dict[str, _Seq] = {}
        # One-token decode steps answered at once and applied in a batch (`deferred`): planned
        # at each step's start where no watermark applies to a running request's step and no
        # group releases entries (the core plans only single full-attention groups).
        self._deferred = _core.DeferredDecodes(self._seqs)
        self._planned: dict[str, int] = self._deferred.planned
        self._taken: list[str] = self._deferred.taken
        self._primes = self.watermark_blocks == 0 and not self._releases
        # Sequence ids: `next` of a count is one step under the GIL, so two threads admitting
        # requests at once never take the same id (a refused admission leaves a gap).
        self._ids = itertools.count()
        self._pending_copies: list[KVCacheBlockCopy] = []
        # vLLM block objects, one per block id, built only when something reads `.blocks`
        # (vLLM's tests compare them by identity across calls).
        self._block_objs: dict[int, KVCacheBlock] = {}
        self.events = EventTranslator(self, enable_kv_cache_events)
        self.block_pool = BlockPoolView(self)
        self._block_objs[0] = self.block_pool.null_block  # vLLM's one null block object
        self.coordinator = coordinator_view(self)
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(layout.num_groups)))

    @property
    def core(self) -> _core.BlockManager:
        """The pagedkv manager underneath (the deferred steps applied first)."""
        return self._core_mgr

    # -- statistics ---------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and RELEASE.lookup_enabled(request)

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        assert self.prefix_cache_stats is not None
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    # -- keys -----------------------------------------------------------------------------
    def _keys(self, request: Request, start: int, stop: int) -> list[bytes]:
        """vLLM's keys of blocks `start..stop` (at the block size; the hash of a block is the
        one at its last hash-block boundary, as vLLM's `BlockHashListWithBlockSize`)."""
        hashes = request.block_hashes
        r = self.layout.hash_ratio
        if r == 1:
            return list(hashes[start:stop])
        return [hashes[(i + 1) * r - 1] for i in range(start, stop)]

    def _num_keys(self, request: Request) -> int:
        return int(len(request.block_hashes) // self.layout.hash_ratio)

    # -- lookups ----------------------------------------------------------------------------
    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        max_hit = RELEASE.max_hit_length(request, max_cache_hit_length)
        hit, ids, keys = self._longest_hit(request, max_hit)
        meet = junction(self, request, max_hit, hit)
        if not hit:
            return self.empty_kv_cache_blocks, 0, meet
        off = self.offset
        per_group = self._per_group([[b + off for b in g] for g in ids], [])
        blocks = PagedKVCacheBlocks(per_group, lambda: self._views(per_group, keys, 0))
        return blocks, hit, meet

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        # A Mamba hybrid's hit may run deeper than a lagging group's (`divergent`).
        return computed_blocks_for_connector(self, request, max_cache_hit_length)

    def get_num_cached_tokens(self, request: Request) -> int:
        """vLLM 0.34's probe (its cache-aware ordering of waiting requests): the request's
        tokens in the prefix cache, read-only, capped at all but its last token as vLLM's
        probe is (not by the request's hit limit, which `get_computed_blocks` applies)."""
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        return self._longest_hit(request, request.num_tokens - 1)[0]

    def _longest_hit(
        self, request: Request, max_hit: int
    ) -> tuple[int, list[list[int]], list[bytes]]:
        """The longest hit of at most `max_hit` tokens, read-only: its tokens, pagedkv's
        block ids per group and its blocks' keys."""
        n = request.num_tokens
        keys = self._keys(request, 0, min(self._num_keys(request), n // self.block_size))
        hit, ids = self._core_mgr.lookup_blocks(
            range(n), block_hashes=keys, max_hit_tokens=max(max_hit, 0)
        )
        if self.use_eagle and hit:
            # EAGLE drafts from the last block's hidden states: recompute that block.
            hit -= self.block_size
            ids = [g[:-1] for g in ids]
        return hit, ids, keys[: hit // self.block_size]

    # -- allocation -------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        # The decode step planned at the step's start (`deferred`): queued, no new block.
        # Kept to this small frame: CPython sets up and clears every local of a call's
        # frame, and the general path's many locals made each planned call half as dear
        # again (about 110 ns of 310 at 1,024 running requests).
        rid = request.request_id
        if (
            self._planned.pop(rid, None) == request.num_computed_tokens
            and num_new_tokens == 1
            and not (
                num_lookahead_tokens
                or num_new_computed_tokens
                or num_external_computed_tokens
                or reserved_blocks
                or delay_cache_blocks
                or full_sequence_must_fit
            )
        ):
            self._taken.append(rid)
            return self.empty_kv_cache_blocks
        return self._allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )

    def _allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """`allocate_slots` past a planned step: a decode step in one call of the request's
        record, else the general path."""
        rec = self._seqs.get(request.request_id)
        if (
            rec is not None
            and not (
                num_new_computed_tokens
                or num_external_computed_tokens
                or reserved_blocks
                or delay_cache_blocks
                or full_sequence_must_fit
            )
            and (not self.watermark_blocks or request.status == RequestStatus.RUNNING)
        ):
            if self._takes_in_processed:
                computed = min(request.num_computed_tokens, self.max_model_len)
                processed = max(0, computed - request.num_in_flight_tokens)
                self._take_in_processed(request, rec, processed)
            # A decode step (the record decides: False when it is not one), in one call;
            # the deferred steps applied first where this step could tell (the record says).
            # The events' lock: a key it hands over is noted before its event can be taken.
            if self.events.enabled:
                with self.events.lock:
                    out = rec.decode(request, num_new_tokens, num_lookahead_tokens, self._deferred)
                    if out is not False:
                        return out if out.__class__ is not tuple else self._decoded(rec, *out)
            else:
                # No events: no key to note, no lock to take.
                out = rec.decode(request, num_new_tokens, num_lookahead_tokens, self._deferred)
                if out is not False:
                    return out if out.__class__ is not tuple else self._decoded(rec, *out)
        # The steps answered before this call that register a block (in call order), and
        # this request's own, applied first; the other runs touch nothing this call reads.
        self._deferred.apply_for(rec)
        if (
            num_new_tokens == 0
            and num_external_computed_tokens == 0
            and (num_new_computed_tokens == 0)
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(local + num_external_computed_tokens, self.max_model_len)
        target = total_computed + num_new_tokens
        need = min(target + num_lookahead_tokens, self.max_model_len)
        # pagedkv schedules known tokens only: the rest of `need` are lookahead slots (drafts,
        # async placeholders, EAGLE's lookahead).
        upto = min(target, request.num_tokens)
        watermark = 0
        if has_scheduled_reqs and request.status in (
            RequestStatus.WAITING,
            RequestStatus.PREEMPTED,
        ):
            watermark = self.watermark_blocks
        floor = reserved_blocks + watermark
        if rec is None:
            return self._allocate_new(
                request,
                (local, max(min(total_computed, upto) - local, 0)),
                upto,
                need,
                delay_cache_blocks,
                watermark if full_sequence_must_fit else None,
                floor,
                num_encoder_tokens if self.layout.has_cross else 0,
            )
        had = rec.table_len
        if full_sequence_must_fit:
            whole = _cdiv(min(request.num_tokens, self.max_model_len), self.block_size)
            cost = sum(
                max((whole if cap is None else min(whole, cap)) - had, 0)
                for cap in self.admission_caps
            )
            if cost + watermark > self.block_pool.get_num_free_blocks():
                return None
        self._release(request, rec, total_computed)
        grow = max(_cdiv(need, self.block_size) - had, 0) * self.layout.num_core_groups
        if grow and floor and grow + floor > self.block_pool.get_num_free_blocks():
            return None
        slots = self._advance(request, rec, upto, need)
        if slots is None:
            return None
        if rec.held and not delay_cache_blocks:
            self._core_mgr.register(rec.sid)
            rec.held = False
        return self._grown(rec, slots)

    def _decoded(
        self,
        rec: _Seq,
        first: int | None,
        ids: list[list[int]] | None,
        pairs: list[tuple[int, int]],
        keys_from: int | None,
    ) -> KVCacheBlocks:
        """The rest of a decode step that `EngineRecord.decode` hands back (vLLM ids): its
        copy-on-write pairs, the keys it handed over (for events), the entries it added."""
        for src, dst in pairs:
            self._pending_copies.append(KVCacheBlockCopy(src, dst))
        if keys_from is not None and self.events.enabled:
            self.events.note_keys(rec.sid, self._keys(rec.request, keys_from, rec.nkeys), keys_from)
        if first is None or ids is None:
            return self.empty_kv_cache_blocks
        per_group = self._per_group(ids, [])
        return PagedKVCacheBlocks(per_group, lambda: self._request_views(rec, per_group, first))

    def _release(self, request: Request, rec: _Seq, computed: int) -> None:
        """Release what the request's window and chunk groups no longer need, where and when
        vLLM's `allocate_slots` frees it: first, even if the call is then refused, at its
        processed tokens (computed less those of steps still in flight). pagedkv's steps
        leave it to this (`release=False`): a step would release at its scheduled tokens,
        which run ahead of those with drafts accepted late or steps in flight."""
        if self._releases:
            processed = max(0, computed - request.num_in_flight_tokens)
            if not RELEASE.caches_after_output:
                self._take_in_processed(request, rec, processed)
            self.core.release_skipped(rec.sid, processed)

    def _take_in_processed(self, request: Request, rec: _Seq, processed: int) -> None:
        """Append the processed tokens pagedkv has not been told of (computed in draft or
        placeholder slots), as `cache_blocks` does after each step where vLLM calls it
        there (compat: `caches_after_output`): `release_skipped` counts only the tokens
        pagedkv holds, so without this it frees a window's blocks a step late. No keys:
        the blocks are registered where vLLM registers them, later in `allocate_slots`."""
        n = min(processed, request.num_tokens)
        if n <= rec.have or rec.scheduled != rec.have:
            return
        pairs = self.core.append(rec.sid, request.all_token_ids[rec.have : n], release=False)
        if pairs is None:
            return  # no room for a copy-on-write: the step's own append takes them in
        self._note_copies(pairs)
        rec.have = rec.scheduled = n

    def _grown(self, rec: _Seq, slots: int) -> KVCacheBlocks:
        """The blocks a call added to the request's tables to give it `slots` slots."""
        had = rec.table_len
        length = -(-slots // self.block_size)
        if length <= had:
            return self.empty_kv_cache_blocks
        rec.table_len = length
        return self._result(rec, had, length, cross=False)

    def _allocate_new(
        self,
        request: Request,
        hit_and_loaded: tuple[int, int],
        upto: int,
        need: int,
        delay: bool,
        whole_floor: int | None,
        floor: int,
        num_encoder_tokens: int,
    ) -> KVCacheBlocks | None:
        """A request pagedkv does not hold yet: one `allocate` taking exactly the `hit`
        tokens the scheduler took from `get_computed_blocks` (it may have capped them), the
        `loaded` tokens past it (the connector's) among those scheduled: groups that skip
        leading tokens hold only the hit blocks they read past them, which lets a
        full-attention hit deeper than a Mamba group's be taken (`divergent`).

        Admission as vLLM's: with `full_sequence_must_fit` (`whole_floor` is then the
        watermark) the whole prompt must fit above the watermark, each sliding window or
        chunked local group charged at most its cap; then this step's blocks must fit
        above `floor` (the watermark and `reserved_blocks`). The cross-attention blocks
        count in both."""
        core = self._core_mgr
        bs = self.block_size
        rid = request.request_id
        n = request.num_tokens
        hit, loaded = hit_and_loaded
        nkeys = min(self._num_keys(request), n // bs) if self.enable_caching else 0
        # Caller-keyed from the start, even with no full block yet (keys arrive later).
        keys = self._keys(request, 0, nkeys) if self.enable_caching else None
        encoder = _cdiv(num_encoder_tokens, bs)
        if whole_floor is not None:
            whole = min(n, self.max_model_len)
            cost = self._admission_cost(keys, n, (hit, loaded), whole, self.admission_caps)
            if cost + encoder + whole_floor > self.block_pool.get_num_free_blocks():
                return None
        if floor:
            cost = self._admission_cost(keys, n, (hit, loaded), need, None)
            if cost + encoder + floor > self.block_pool.get_num_free_blocks():
                return None
        cross = None
        if num_encoder_tokens:
            # The cross-attention blocks: a companion sequence of the encoder's tokens with
            # no keys (never hit nor registered), taken first so that giving them back on a
            # refusal below leaves nothing behind.
            cross = next(self._ids)
            if core.allocate(cross, range(num_encoder_tokens), block_hashes=[]) is None:
                return None
        sid = next(self._ids)
        with self.events.lock:  # the keys noted before their events can be taken
            got = core.allocate(
                sid,
                request.all_token_ids[:n],
                num_new_tokens=upto - hit,
                block_hashes=keys,
                max_hit_tokens=hit,
                lookahead=need - upto,
                register=not delay,
                loaded_tokens=loaded,
                reachable_tokens=reachable(self, request),
            )
            if got is not None:
                self.events.note_keys(sid, keys, 0)
        if got is None:
            if cross is not None:
                core.free(cross)
            return None
        if got != hit:
            # Give everything back, the blocks registered past the hit withdrawn (their KV
            # was never computed), then say why.
            core.free(sid, num_computed_tokens=got)
            if cross is not None:
                core.free(cross)
            raise RuntimeError(
                f"request {rid}: the cache served {got} prefix tokens where the scheduler "
                f"counted {hit} (a hit evicted between get_computed_blocks and allocate_slots)"
            )
        length = _cdiv(need, bs)
        rec = _Seq(
            self._core_mgr,
            request,
            sid,
            n,
            upto,
            nkeys,
            length,
            delay,
            unchanged=self.empty_kv_cache_blocks,
            offset=self.offset,
            max_len=self.max_model_len,
            hash_ratio=self.layout.hash_ratio,
        )
        rec.cross = cross
        self._seqs[rid] = rec
        return self._result(rec, hit // bs, length, cross=True)

    def _admission_cost(
        self,
        keys: list[bytes] | None,
        n: int,
        hit_and_loaded: tuple[int, int],
        slots: int,
        caps: list[int | None] | None,
    ) -> int:
        """The blocks a new request of `n` tokens with a `hit` takes for `slots` slots: per
        group its fresh blocks (at most `caps[g]` less the hit, with caps), plus the hit's
        blocks that are cached but unreferenced (vLLM counts both against its free
        blocks); `loaded` tokens past the hit as `allocate`'s."""
        bs = self.block_size
        hit, loaded = hit_and_loaded
        new = max(min(slots, n) - hit, 1)
        got, fresh, revived = self._core_mgr.allocation_cost(
            range(n),
            num_new_tokens=new,
            block_hashes=keys,
            max_hit_tokens=hit,
            lookahead=max(slots - n, 0),
            loaded_tokens=min(loaded, new),
        )
        if caps is None:
            return int(fresh + revived)
        h = got // bs
        total = _cdiv(slots, bs)
        fresh = sum(max((total if cap is None else min(total, cap)) - h, 0) for cap in caps)
        return int(fresh + revived)

    def _advance(self, request: Request, rec: _Seq, upto: int, need: int) -> int | None:
        """Bring a held sequence to `upto` scheduled tokens and `need` slots with one call:
        `extend` (the prompt's next chunk; slots past the known tokens as lookahead) or
        `append` (new known tokens, or slots with no known token). Returns the slots now
        writable, or None when they do not fit (nothing changed)."""
        if upto <= rec.scheduled:
            # Nothing new to schedule: a request the scheduler rolled back (a failed load)
            # recomputes into the blocks it holds, which stay as vLLM listed them.
            return rec.table_len * self.block_size
        if rec.scheduled < rec.have:
            end = min(upto, rec.have)
            pairs = self._core_mgr.extend(
                rec.sid, end - rec.scheduled, lookahead=max(need - end, 0), release=False
            )
            if pairs is None:
                return None
            self._note_copies(pairs)
            # Known tokens past the prompt, if any, are appended by the next step's call.
            rec.scheduled = end
            return max(need, end)
        return self._append(request, rec, upto, need)

    def _append(self, request: Request, rec: _Seq, upto: int, need: int) -> int | None:
        have = rec.have
        new = request.all_token_ids[have:upto] if upto > have else []
        end = max(upto, have)
        lookahead = max(need - end, 0)
        keys = None
        if self.enable_caching:
            room = min(self._num_keys(request), end // self.block_size)
            if room > rec.nkeys:
                keys = self._keys(request, rec.nkeys, room)
        if not new and not lookahead and keys is None:
            return end
        with self.events.lock:  # the keys noted before their events can be taken
            pairs = self._core_mgr.append(
                rec.sid, new, lookahead=lookahead, block_hashes=keys, release=False
            )
            if pairs is not None and keys is not None:
                self.events.note_keys(rec.sid, keys, rec.nkeys)
        if pairs is None:
            return None
        self._note_copies(pairs)
        rec.have = rec.scheduled = end
        if keys is not None:
            rec.nkeys += len(keys)
        return end + lookahead

    def _note_copies(self, pairs: Any) -> None:
        off = self.offset
        for src, dst in pairs:
            self._pending_copies.append(KVCacheBlockCopy(int(src) + off, int(dst) + off))

    def _per_group(self, core: list[list[int]], cross: list[int]) -> tuple[list[int], ...]:
        """vLLM's per-group lists from pagedkv's groups and the cross-attention blocks."""
        if self._one_group:
            return (core[0],)
        return tuple(cross if c is None else core[c] for c in self.layout.core_index)

    def _result(self, rec: _Seq, start: int, stop: int, *, cross: bool) -> PagedKVCacheBlocks:
        """Entries `start..stop` of the request's tables (vLLM ids), and its cross-attention
        blocks when `cross`."""
        off = self.offset
        core = self._core_mgr
        tables = [
            [b + off for b in core.block_table(rec.sid, start, stop, group=g)]
            for g in range(self.layout.num_core_groups)
        ]
        crossed = []
        if cross and rec.cross is not None:
            crossed = [b + off for b in core.block_table(rec.cross)]
        per_group = self._per_group(tables, crossed)
        return PagedKVCacheBlocks(per_group, lambda: self._request_views(rec, per_group, start))

    def _request_views(
        self, rec: _Seq, ids: tuple[list[int], ...], start: int
    ) -> tuple[list[KVCacheBlock], ...]:
        cached = self.num_cached_blocks(rec.request.request_id)
        keys = self._keys(rec.request, start, max(cached, start)) if cached > start else []
        return self._views(ids, keys, start)

    def _views(
        self, ids: tuple[list[int], ...], keys: list[bytes], start: int
    ) -> tuple[list[KVCacheBlock], ...]:
        """vLLM block objects for `ids` (one object per block id, kept), each carrying its
        key with the group (vLLM's `block_hash`) where it is in the prefix cache: position
        `start + i` of a group's list has key `keys[i]`."""
        out = []
        for g, group in enumerate(ids):
            views = []
            for i, b in enumerate(group):
                obj = self._block_objs.get(b)
                if obj is None:
                    obj = KVCacheBlock(block_id=b, is_null=b == 0)
                    self._block_objs[b] = obj
                key = keys[i] if i < len(keys) and self.layout.core_index[g] is not None else None
                obj.reset_hash()
                if key is not None and b != 0:
                    obj.set_block_hash(make_block_hash_with_group_id(key, g))
                views.append(obj)
            out.append(views)
        return tuple(out)

    # -- registration -------------------------------------------------------------------------
    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks full of its first `num_computed_tokens` tokens.

        Tokens computed in draft or placeholder slots (accepted drafts, async outputs) that
        pagedkv has not been told of yet are appended first: their KV is in those slots.
        Without prefix caching that is all (the next step's releases count from them).
        """
        with self.events.lock:  # the keys noted before their events can be taken
            self._cache_blocks(request, num_computed_tokens)

    def _cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        rec = self._seqs.get(request.request_id)
        if rec is None:
            return
        bs = self.block_size
        n = min(num_computed_tokens, request.num_tokens)
        end = max(n, rec.have) if rec.scheduled == rec.have else rec.have
        keys = None
        room = rec.nkeys
        if self.enable_caching:
            room = min(self._num_keys(request), end // bs)
            keys = self._keys(request, rec.nkeys, room) if room > rec.nkeys else None
        core = self.core
        appended = n > rec.have and rec.scheduled == rec.have
        if appended:
            # Nothing is released here: vLLM frees a window's blocks in `allocate_slots` only.
            pairs = core.append(
                rec.sid, request.all_token_ids[rec.have : n], block_hashes=keys, release=False
            )
            if pairs is None:
                return  # no room for a copy-on-write: nothing is registered now
            self._note_copies(pairs)
            rec.have = rec.scheduled = n
        if not self.enable_caching:
            return
        if keys is not None and not appended:
            core.register(rec.sid, num_tokens=min(n, rec.scheduled), block_hashes=keys)
        if keys is not None:
            self.events.note_keys(rec.sid, keys, rec.nkeys)
            rec.nkeys = room
        if rec.held:
            if n >= rec.scheduled:
                # Everything scheduled is computed: later steps register as usual.
                core.register(rec.sid)
                rec.held = False
            else:
                core.register(rec.sid, num_tokens=n)

    def evict_blocks(self, block_ids: set[int]) -> None:
        off = self.offset
        # vLLM's null block (0) is never cached; with offset 1 it is not a pagedkv block.
        ids = [b - off for b in block_ids if b > 0]
        if ids:
            self.core.evict_blocks(ids)

    # -- freeing ----------------------------------------------------------------------------
    def free(self, request: Request) -> None:
        rec = self._seqs.get(request.request_id)
        if rec is not None:
            # Its answered steps applied and its run ended; the other runs go on.
            self._deferred.release(rec)
        rec = self._seqs.pop(request.request_id, None)
        # A plan another thread made between the release and the pop goes too.
        self._planned.pop(request.request_id, None)
        if rec is not None:
            self._core_mgr.free(rec.sid)
            if rec.cross is not None:
                self._core_mgr.free(rec.cross)

    def pop_blocks_for_free(self, request: Request) -> list[Any]:
        """The request's blocks, each tagged with its sequence, which stays alive until they
        come back through `block_pool.free_blocks` (vLLM's deferred frees)."""
        rec = self._seqs.get(request.request_id)
        if rec is not None:
            self._deferred.release(rec)  # as in `free`
        rec = self._seqs.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        if rec is None:
            return []
        ids = self._result(rec, 0, rec.table_len, cross=True).ids
        blocks = [KVCacheBlock(block_id=b) for group in ids for b in group]
        for b in blocks:
            b.pagedkv_seq = rec.sid
        if rec.cross is not None and blocks:
            blocks[-1].pagedkv_cross = rec.cross
        return blocks

    def free_popped(self, blocks: Iterable[Any]) -> None:
        """Free the sequences whose blocks `pop_blocks_for_free` handed out."""
        seen: set[int] = set()
        for b in blocks:
            for attr in ("pagedkv_seq", "pagedkv_cross"):
                sid = getattr(b, attr, None)
                if sid is not None and sid not in seen:
                    seen.add(sid)
                    self.core.free(sid)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        rec = self._seqs.get(request_id)
        if rec is not None and self._releases:
            if not RELEASE.caches_after_output:
                self._take_in_processed(rec.request, rec, processed_computed_tokens)
            self.core.release_skipped(rec.sid, processed_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        if not self.core.reset_prefix_cache():
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    # -- queries ----------------------------------------------------------------------------
    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def take_events(self) -> list[KVCacheEvent]:
        return self.events.take()

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        rec = self._seqs.get(request_id)
        if rec is None:
            return self.empty_kv_cache_blocks
        return self._result(rec, 0, rec.table_len, cross=True)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        rec = self._seqs.get(request_id)
        if rec is None:
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self._result(rec, 0, rec.table_len, cross=True).ids

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        n = _cdiv(num_computed_tokens, self.block_size)
        return tuple(ids[:n] for ids in self.get_block_ids(request_id))

    def num_cached_blocks(self, request_id: str) -> int:
        """The request's blocks in the prefix cache: full of scheduled tokens, keyed, not
        held (vLLM's `num_cached_block`)."""
        rec = self._seqs.get(request_id)
        if rec is None or not self.enable_caching or rec.held:
            return 0
        return min(rec.scheduled // self.block_size, rec.nkeys)

    def estimate_cached_tokens(self, request: Request) -> int:
        return self.num_cached_blocks(request.request_id) * self.block_size

    def request_ids(self) -> list[str]:
        return list(self._seqs)

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        assert num_computed_tokens % self.block_size == 0
        n = num_computed_tokens // self.block_size
        ids = ids_of(blocks)
        if not any(ids):
            return self.empty_kv_cache_blocks
        return PagedKVCacheBlocks(tuple(list(g[:n]) for g in ids))

    def take_new_block_ids(self) -> list[int]:
        # No group here needs its new blocks zeroed (attention groups only).
        return []

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        return None

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[Any]]:
        copies, self._pending_copies = self._pending_copies, []
        # pagedkv's copy-on-write has already released the sources: nothing is retained.
        return copies, []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return {}

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        return []

    def new_step_starts(self) -> None:
        if self._primes:
            # A step that fills a block is planned too unless its key's event must be
            # published by the step's own call.
            self._deferred.prime(not self.events.enabled)
        else:
            self._deferred.settle()

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks


__all__ = ["KVCacheManager"]
