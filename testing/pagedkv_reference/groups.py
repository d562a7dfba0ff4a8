"""KV-cache groups (hybrid models) in the pure-Python reference model.

`ReferenceBlockManager(..., groups=[KVCacheGroup(...), ...])` builds a
`GroupedReferenceBlockManager`: every sequence holds one block table per group, all drawn
from one pool, and block 0 is the null block that stands in for the entries a group no
longer needs (docs/semantics.md, "KV-cache groups"). The base class keeps argument checks,
digests and the single-table manager; this subclass overrides the steps that touch tables.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt

from pagedkv.alloc_status import AllocStatus
from pagedkv.errors import (
    InvalidArgumentError,
    RefcountOverflowError,
    SequenceNotSwappedError,
)
from pagedkv.events import BlockRemoved
from pagedkv.stats import GroupStats, Stats
from pagedkv_reference.hybrid_hit import first_needed, hybrid_hit
from pagedkv_reference.manager import MAX_REFCOUNT, ReferenceBlockManager, _cdiv, _Seq
from pagedkv_reference.window_retention import caches

NULL = 0
"""The null block: the GPU table entry of a block its group no longer needs."""
CPU_NULL = -1
"""A null entry in a swapped-out table (CPU block 0 is an ordinary CPU block)."""

Pairs = list[tuple[int, int]]


def _key(group: int, digest: bytes) -> bytes:
    """Prefix-index key `(group, digest)`: one token block is cached once per group."""
    return bytes((group,)) + digest


def leading_nulls(table: list[int], null: int = NULL) -> int:
    """How many entries at the start of a table are null (the nulls are a leading run)."""
    n = 0
    while n < len(table) and table[n] == null:
        n += 1
    return n


class _GSeq(_Seq):
    """A sequence of a grouped manager: one GPU table per group (`blocks` stays empty)."""

    __slots__ = ("cpu_tables", "tables")

    def __init__(self, salt: bytes | None, lora_id: int | None, num_groups: int) -> None:
        super().__init__(salt, lora_id)
        self.tables: list[list[int]] = [[] for _ in range(num_groups)]
        # While swapped out: one table per group of CPU block ids, CPU_NULL for null entries.
        self.cpu_tables: list[list[int]] = []

    def copy(self) -> _GSeq:
        c = _GSeq(self.salt, self.lora_id, len(self.tables))
        c.tables = [list(t) for t in self.tables]
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


def _gseq(seq: _Seq) -> _GSeq:
    assert isinstance(seq, _GSeq), "a grouped manager holds grouped sequences only"
    return seq


class GroupedReferenceBlockManager(ReferenceBlockManager):
    """The reference manager with KV-cache groups; built by `ReferenceBlockManager(...,
    groups=...)`."""

    def __init__(self, num_blocks: int, block_size: int = 16, **kwargs: Any) -> None:
        super().__init__(num_blocks, block_size, **kwargs)
        if not self._groups:
            raise InvalidArgumentError("a grouped manager needs groups=[KVCacheGroup(...)]")
        n = self._num_blocks
        # Block 0 is the null block only when some group is not full attention; without one,
        # `_null` names no block, so no table entry is ever taken for null.
        self._has_null = any(grp.kind != "full" for grp in self._groups)
        self._null = NULL if self._has_null else -2
        # Pops 0 (or 1 after the null block), 1, 2, ...
        self._free = list(range(n - 1, -1 + self._has_null, -1))
        # The group whose table took each block; meaningful while it is OWNED or CACHED.
        self._owner = [-1] * n
        g = len(self._groups)
        self._group_hits = [0] * g
        self._group_evictions = [0] * g
        self._group_registered = [0] * g

    # ------------------------------------------------------------ pool, per group

    def _take(self) -> NoReturn:
        raise AssertionError("a grouped manager takes every block for a group (_take_in)")

    def _take_in(self, g: int) -> int:
        """One new block for group `g`: pop the free stack, else evict the oldest CACHED
        block (an eviction of the group that cached it)."""
        if self._free:
            b = self._free.pop()
        else:
            b = self._evict()
            self._group_evictions[self._owner[b]] += 1
            self._log_eviction(b, self._owner[b])
            self._unindex(b)
            self._evictions += 1
        self._rc[b] = 1
        self._owner[b] = g
        return b

    def _count_trim(self, b: int) -> None:
        self._group_evictions[self._owner[b]] += 1

    def _policy_key(self, b: int) -> bytes:
        """The policy knows a block by its prefix-index key, `(group, digest)`: equal
        content cached by two groups is two keys (as the core's group-keyed digests)."""
        d = self._hashed[b]
        assert d is not None
        return _key(self._owner[b], d)

    def _unindex(self, b: int) -> None:
        """Take block `b` out of the prefix index, under its group's key."""
        d = self._hashed[b]
        assert d is not None
        g = self._owner[b]
        del self._index[_key(g, d)]
        self._hashed[b] = None
        if self._events_on:
            self._log.push(BlockRemoved(block_hashes=[d], medium="GPU", group_idx=g))

    def _release_table(self, table: list[int]) -> None:
        """One group's table, tail first, as the core pool releases a table (the null
        block holds no reference)."""
        self._release_all([b for b in table if b != self._null])

    def _register(self, seq: _Seq, lo: int, hi: int) -> None:
        """Entries `lo .. hi - 1` became full of scheduled tokens: register each group's
        (group order, index order) under `(group, digest)` unless that key is taken."""
        if not self._caching:
            return
        for g, table in enumerate(_gseq(seq).tables):
            for i in range(lo, hi):
                b = table[i]
                key = _key(g, seq.digests[i])
                if b == self._null or key in self._index:
                    continue  # a released entry, or another block holds this content
                group = self._groups[g]
                if not caches(group, self._block_size, self._retention_interval, seq.reachable, i):
                    continue  # a window block no later hit reads (sparse retention)
                if seq.keyed and self._rc[b] > 1:
                    continue  # shared with forks, which may key it otherwise
                self._index[key] = b
                self._hashed[b] = seq.digests[i]
                self._block_tenant[b] = seq.tenant
                self._registered_blocks += 1
                self._group_registered[g] += 1
                if self._events_on:
                    stored = self._stored(seq, i, "GPU")
                    self._log.push(dataclasses.replace(stored, group_idx=g))

    def _held(self, seq: _Seq) -> list[int]:
        """The non-null GPU blocks, group by group in table order."""
        return [b for t in _gseq(seq).tables for b in t if b != self._null]

    def _new_seq(self, salt: bytes | None, lora: int | None) -> _Seq:
        return _GSeq(salt, lora, len(self._groups))

    def _table(self, seq: _Seq, group: int) -> list[int]:
        return _gseq(seq).tables[group]

    # ------------------------------------------------------------ the hybrid hit

    def _hit(self, seq: _Seq) -> int:
        """`h`: the hit in blocks of a digested prompt (0 without prefix caching)."""
        if not self._caching:
            return 0
        cap = self._hit_cap(seq)  # at least one token to compute, at most the keys
        return hybrid_hit(
            self._groups,
            self._block_size,
            cap,
            lambda g, i: _key(g, seq.digests[i]) in self._index,
            (seq.loaded, seq.num_tokens),
        )

    def _hit_tables(self, seq: _Seq, h: int) -> list[list[int]]:
        """Each group's first `h` entries for a hit of `h` blocks: null where the group
        skips them at `h * B`, the cached block otherwise."""
        out = []
        for g, group in enumerate(self._groups):
            a = first_needed(group, h, self._block_size, seq.loaded, seq.num_tokens)
            out.append([self._null] * a + [self._index[_key(g, d)] for d in seq.digests[a:h]])
        return out

    def _is_null(self, b: int) -> bool:
        return self._has_null and b == NULL

    def _hit_blocks(
        self,
        toks: list[int],
        salt: bytes | None,
        lora: int | None,
        max_hit: int | None,
        keys: list[bytes] | None = None,
        loaded: int = 0,
    ) -> tuple[int, list[list[int]]]:
        probe = self._prompt(toks, salt, lora, keys, max_hit)
        probe.loaded = loaded
        h = self._hit(probe)
        return h, self._hit_tables(probe, h)

    def _per_group(
        self, toks: list[int], max_hit: int | None, keys: list[bytes] | None
    ) -> list[tuple[int, list[int]]]:
        """Each group's own hit, resuming right after it, and its first table entries."""
        probe = self._prompt(toks, None, None, keys, max_hit)
        bs = self._block_size
        cap = self._hit_cap(probe) if self._caching else 0
        out = []
        for g, group in enumerate(self._groups):

            def cached(_: int, i: int, g: int = g) -> bool:
                return _key(g, probe.digests[i]) in self._index

            h = hybrid_hit([group], bs, cap, cached)
            a = first_needed(group, h, bs)
            table = [self._null] * a + [self._index[_key(g, d)] for d in probe.digests[a:h]]
            out.append((h * bs, table))
        return out

    # ------------------------------------------------------------ skipped entries, writes

    def _skipped(self, seq: _GSeq, p: int | None = None) -> list[tuple[int, int]]:
        """(group, index) of the non-null entries skipped at position `p` (default the
        scheduled tokens), in release order: group by group, tail first."""
        out: list[tuple[int, int]] = []
        at = seq.scheduled if p is None else p
        for g, (group, table) in enumerate(zip(self._groups, seq.tables, strict=True)):
            end = group.skipped_tokens(at) // self._block_size
            out.extend((g, i) for i in range(end - 1, -1, -1) if table[i] != self._null)
        return out

    def _freed(self, blocks: list[int]) -> int:
        """How many of these blocks lose their last reference when each listed reference
        is dropped (a block two batch members share counts once, when both drop it) and free
        a unit: a pinned hashed block stays CACHED outside `available`."""
        return sum(
            1
            for b, refs in Counter(blocks).items()
            if self._rc[b] == refs and not (b in self._pins and self._hashed[b] is not None)
        )

    def _drop(self, seq: _GSeq, skipped: list[tuple[int, int]]) -> None:
        """Replace the skipped entries by the null block and release them, in order
        (hashed ones become CACHED: their tokens were scheduled)."""
        for g in dict.fromkeys(g for g, _ in skipped):
            run = sorted(i for h, i in skipped if h == g)
            self._release_all([seq.tables[g][i] for i in run])  # one group's run, tail first
            for i in run:
                seq.tables[g][i] = self._null

    def _write_plan(self, seq: _GSeq, end: int, la: int) -> tuple[list[list[int]], int]:
        """Writing positions `s .. end - 1` plus `la` slots: per group the table indices that
        need copy-on-write, and the new entries past the (common) table length."""
        bs = self._block_size
        last = _cdiv(end + la, bs)
        first = seq.scheduled // bs
        width = len(seq.tables[0])
        cows = [
            [i for i in range(first, min(last, width)) if self._must_copy(t[i])] for t in seq.tables
        ]
        return cows, max(0, last - width)

    def _need(self, plan: tuple[list[list[int]], int]) -> int:
        cows, new = plan
        return sum(len(c) for c in cows) + new * len(self._groups)

    def _copy_in(self, table: list[int], g: int, i: int) -> tuple[int, int]:
        """Copy-on-write of entry `i` of group `g`'s table (`_copy`)."""
        src = table[i]
        dst = self._take_in(g)
        table[i] = dst
        self._release_all([src])
        self._cow_copies += 1
        return src, dst

    def _write_tables(self, seq: _GSeq, end: int, la: int) -> Pairs:
        """Per group in order: copy the shared write entries, then take the new ones. The
        plan is made now: an earlier write of the same batch may have unshared a block."""
        cows, new = self._write_plan(seq, end, la)
        pairs: Pairs = []
        for g, table in enumerate(seq.tables):
            pairs.extend(self._copy_in(table, g, i) for i in cows[g])
            table.extend(self._take_in(g) for _ in range(new))
        return pairs

    def _fits(self, need: int, skipped: list[int]) -> bool:
        """The fit test of a scheduling call: the blocks it would free count as available."""
        return need <= self._available() + self._freed(skipped)

    def _blocks_at(self, seq: _GSeq, entries: list[tuple[int, int]]) -> list[int]:
        return [seq.tables[g][i] for g, i in entries]

    # ------------------------------------------------------------ operations

    def _admit(self, sid: int, seq: _Seq, k: int, la: int) -> int | None:
        gs = _gseq(seq)
        bs = self._block_size
        ng = len(self._groups)
        h = self._hit(gs)
        prefix = self._hit_tables(gs, h)
        pinned = [b for t in prefix for b in t if b != self._null]  # group order, table order
        s = min(h * bs + k, gs.num_tokens)
        total = _cdiv(s + la, bs)
        for b in pinned:  # errors before the capacity answer
            if self._rc[b] >= MAX_REFCOUNT:
                raise RefcountOverflowError(f"block {b} already has {MAX_REFCOUNT} holders")
        need = ng * (total - h) + sum(1 for b in pinned if self._costs_unit(b))
        held = ng * total - (ng * h - len(pinned))  # every entry but the nulls
        if need > self._available() or held > self._num_blocks - self._has_null:
            return None
        gs.tenant = self._tenant_of(gs.salt)
        for b in pinned:
            if self._rc[b] == 0:
                self._revive(b)  # CACHED -> OWNED
            self._rc[b] += 1
        if ng == 1 and not self._has_null:
            # One full-attention group: the core runs its plain path, which reports the
            # prompt's missed keys to the ghost policies as the plain manager does.
            self._missed([_key(0, d) for d in gs.digests[h:]])
        for g, t in enumerate(prefix):
            self._group_hits[g] += sum(1 for b in t if b != self._null)
        gs.tables = prefix
        for g, table in enumerate(gs.tables):
            table.extend(self._take_in(g) for _ in range(total - h))
        gs.hits = h
        if gs.hold is not None:
            gs.hold = h
        gs.scheduled = h * bs
        self._schedule(gs, s)
        self._admitted(sid, gs, h)
        return h * bs

    def _step(self, seq: _GSeq, end: int, la: int, release: bool = True) -> Pairs | None:
        """The block work of `extend`/`append` up to position `end`: if it fits (counting
        the blocks it frees), release the skipped entries (with `release`), then write;
        else None."""
        skipped = self._skipped(seq) if release else []
        need = self._need(self._write_plan(seq, end, la))
        if not self._fits(need, self._blocks_at(seq, skipped)):
            return None  # a refused call releases nothing either
        self._drop(seq, skipped)
        return self._write_tables(seq, end, la)

    def _extend_to(self, seq: _Seq, m: int, la: int, release: bool = True) -> Pairs | None:
        gs = _gseq(seq)
        pairs = self._step(gs, m, la, release)
        if pairs is not None:
            self._schedule(gs, m)
        return pairs

    def _release_skipped(self, seq: _Seq, num_tokens: int) -> int:
        gs = _gseq(seq)
        skipped = self._skipped(gs, min(num_tokens, gs.scheduled))
        self._drop(gs, skipped)
        return len(skipped)

    def _append_tokens(
        self,
        seq: _Seq,
        toks: list[int],
        la: int,
        keys: list[bytes] | None = None,
        release: bool = True,
    ) -> Pairs | None:
        gs = _gseq(seq)
        pairs = self._step(gs, gs.num_tokens + len(toks), la, release)
        if pairs is not None:
            self._add_tokens(gs, toks)
            self._schedule(gs, gs.num_tokens, keys)
        return pairs

    def _add_tokens(self, seq: _GSeq, toks: list[int]) -> None:
        seq.tokens.extend(toks)
        if self._caching:
            self._extend_digests(seq)

    def _append_each(
        self, seqs: list[_Seq], toks: list[int], la: int
    ) -> npt.NDArray[np.int32] | None:
        """Release every sequence's skipped entries (batch order), then write and register
        each sequence in turn (its `BlockStored` after its own evictions, before the next
        sequence's, as vLLM's per-request events and the one-group path). `need` is counted
        on the state before the call."""
        gss = [_gseq(s) for s in seqs]
        skipped = [self._skipped(s) for s in gss]
        need = sum(self._need(self._write_plan(s, s.num_tokens + 1, la)) for s in gss)
        dropped = [b for s, sk in zip(gss, skipped, strict=True) for b in self._blocks_at(s, sk)]
        if not self._fits(need, dropped):
            return None
        for s, sk in zip(gss, skipped, strict=True):
            self._drop(s, sk)
        pairs: Pairs = []
        for s, t in zip(gss, toks, strict=True):
            pairs.extend(self._write_tables(s, s.num_tokens + 1, la))
            self._add_tokens(s, [t])
            self._schedule(s, s.num_tokens)
        return np.array(pairs, dtype=np.int32).reshape(len(pairs), 2)

    def _check_truncate(self, seq: _GSeq, m: int) -> None:
        """A roll-back to `m` needs every entry a group keeps at `m`: refuse one the window
        (or chunk, or state) already released, and a state between block boundaries."""
        bs = self._block_size
        for g, (group, table) in enumerate(zip(self._groups, seq.tables, strict=True)):
            nulls = leading_nulls(table, self._null)
            if nulls * bs > group.skipped_tokens(m):
                raise InvalidArgumentError(
                    f"truncate to {m} tokens: group {g} ({group.kind}) already released "
                    f"its blocks before token {nulls * bs}"
                )
            if group.kind == "state" and m < seq.scheduled and m % bs:
                raise InvalidArgumentError(
                    f"truncate to {m} tokens: group {g} is a state group, which has a state "
                    f"only at block boundaries (multiples of {bs}) below {seq.scheduled}"
                )

    def _truncate_to(self, seq: _Seq, m: int) -> Pairs | None:
        gs = _gseq(seq)
        self._check_truncate(gs, m)
        bs = self._block_size
        i = m // bs
        # Each group's block left partial that was full must end this table's alone and
        # unhashed (see the plain `_truncate_to`): hashed and held alone it leaves the index,
        # shared (hashed or not) it is copied (after the releases). Decide every group before
        # changing any.
        alone: list[int] = []
        shared: list[int] = []
        if m % bs and gs.num_tokens >= (i + 1) * bs:  # cuts a block that was full
            for g, table in enumerate(gs.tables):
                if i >= len(table) or table[i] == self._null:
                    continue
                if self._rc[table[i]] > 1:
                    shared.append(g)
                elif self._hashed[table[i]] is not None:
                    alone.append(g)
        if len(shared) > self._available():
            return None
        for g in alone:
            self._unindex(gs.tables[g][i])
        keep = _cdiv(m, bs)
        for table in gs.tables:
            dropped = table[keep:]
            del table[keep:]
            self._release_table(dropped)  # hashed ones become CACHED: their KV was computed
            self._truncated_blocks += sum(1 for b in dropped if b != self._null)
        pairs = [self._copy_in(gs.tables[g], g, i) for g in shared]
        del gs.tokens[m:]
        del gs.digests[i:]
        del gs.keys[i:]
        if gs.hold is not None:
            gs.hold = min(gs.hold, i)
        gs.scheduled = min(gs.scheduled, m)
        gs.hits = min(gs.hits, i)
        return pairs

    def _free_one(self, sid: int, computed: int | None = None) -> None:
        seq = _gseq(self._seqs.pop(sid))
        if seq.swapped:
            self._cpu_free.extend(reversed(self._cpu_held(seq)))
            self._cpu_removed(seq)
            return
        bs = self._block_size
        c = seq.scheduled if computed is None else computed
        lo = max(seq.hits, c // bs)
        # Registered (by this sequence or the one it was forked from) but never computed:
        # withdrawn, group by group, tail first; entries already released are not held.
        for table in seq.tables:
            for i in range(self._registrable(seq) - 1, lo - 1, -1):
                d = self._hashed[table[i]]  # None for the null block, and without caching
                if d is not None and d == seq.digests[i]:
                    self._unindex(table[i])
                    self._unregistered_blocks += 1
        for table in seq.tables:
            self._release_table(table)

    def _cpu_held(self, seq: _GSeq) -> list[int]:
        return [c for t in seq.cpu_tables for c in t if c != CPU_NULL]

    def _cpu_removed(self, seq: _Seq) -> None:
        """The CPU copies `swap_out` stored are gone: one event per group and entry."""
        if not (self._events_on and self._caching):
            return
        for g, table in enumerate(_gseq(seq).cpu_tables):
            for i in range(self._registrable(seq)):
                if table[i] != CPU_NULL:
                    self._cpu_copy_gone(g, seq.digests[i])

    def swap_out(self, seq_id: int) -> Pairs | None:
        """Move a resident sequence's non-null blocks to CPU blocks (group by group, table
        order); nulls stay nulls. Return the (gpu, cpu) pairs, or None."""
        _, seq = self._resident(seq_id)
        gs = _gseq(seq)
        held = self._held(gs)
        if len(held) > len(self._cpu_free):
            return None
        cpu = [self._cpu_free.pop() for _ in held]
        it = iter(cpu)
        gs.cpu_tables = [[CPU_NULL if b == self._null else next(it) for b in t] for t in gs.tables]
        for table in gs.tables:
            self._release_table(table)
        gs.tables = [[] for _ in self._groups]
        gs.swapped = True
        self._swapped_out_blocks += len(held)
        if self._events_on and self._caching:
            for g, table in enumerate(gs.cpu_tables):
                for i in range(self._registrable(gs)):
                    if table[i] != CPU_NULL:
                        stored = self._stored(gs, i, "CPU")
                        event = dataclasses.replace(stored, group_idx=g)
                        self._cpu_copy_stored(g, gs.digests[i], event)
        return list(zip(held, cpu, strict=True))

    def _swap_in(self, seq_id: int) -> Pairs | None:
        """One GPU block per CPU block, in swap-out order; return the (cpu, gpu) pairs, or
        None."""
        sid, seq = self._get(seq_id)
        if not seq.swapped:
            raise SequenceNotSwappedError(f"sequence {sid} is not swapped out")
        gs = _gseq(seq)
        owned = [(g, c) for g, t in enumerate(gs.cpu_tables) for c in t if c != CPU_NULL]
        if len(owned) > self._available():
            return None
        gpu = [self._take_in(g) for g, _ in owned]
        self._cpu_free.extend(reversed([c for _, c in owned]))
        self._cpu_removed(gs)
        it = iter(gpu)
        gs.tables = [[self._null if c == CPU_NULL else next(it) for c in t] for t in gs.cpu_tables]
        gs.cpu_tables = []
        gs.swapped = False
        self._register(gs, 0, self._registrable(gs))
        self._swapped_in_blocks += len(owned)
        return [(c, b) for (_, c), b in zip(owned, gpu, strict=True)]

    # ------------------------------------------------------------ lookups, fit answers

    def _hit_tokens(
        self,
        toks: list[int],
        salt: bytes | None,
        lora: int | None,
        keys: list[bytes] | None = None,
        cap: int | None = None,
        loaded: int = 0,
    ) -> int:
        probe = self._prompt(toks, salt, lora, keys, cap)
        probe.loaded = loaded
        return self._hit(probe) * self._block_size

    def _status(self, total: int, need: int) -> AllocStatus:
        wm = self._watermark_blocks
        if self._num_blocks - self._has_null - total < wm:  # the null block is never usable
            return AllocStatus.NEVER
        if self._available() - need >= wm:
            return AllocStatus.OK
        return AllocStatus.LATER

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
        bs = self._block_size
        ng = len(self._groups)
        if toks is None and keys is None:  # a count: no hit credited, every entry new
            total = ng * _cdiv(k, bs)
            return self._status(total, total)
        probe = self._prompt(n if toks is None else toks, salt, lora, keys, cap)
        probe.loaded = loaded
        h = self._hit(probe)
        pinned = [b for t in self._hit_tables(probe, h) for b in t if b != self._null]
        width = _cdiv(min(h * bs + k, n), bs)
        total = ng * width - (ng * h - len(pinned))
        need = ng * (width - h) + sum(1 for b in pinned if self._costs_unit(b))
        return self._status(total, need)

    def can_swap_in(self, seq_id: int) -> AllocStatus:
        sid, seq = self._get(seq_id)
        if not seq.swapped:
            raise SequenceNotSwappedError(f"sequence {sid} is not swapped out")
        n = len(self._cpu_held(_gseq(seq)))
        return self._status(n, n)

    # ------------------------------------------------------------ queries

    def table_digest(self, seq_id: int) -> int:
        """A 64-bit digest of every group's GPU table (equal lengths, so one array)."""
        tables = _gseq(self._get(seq_id)[1]).tables
        raw = np.array(tables, dtype=np.int64).tobytes()
        return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")

    def stats(self) -> Stats:
        """As without groups, over the `num_blocks - 1` usable blocks, plus `groups`.
        Slots count per group: the non-null entries reserve, the scheduled tokens in them
        use."""
        st = super().stats()
        bs = self._block_size
        usable = self._num_blocks - self._has_null
        resident = [_gseq(s) for s in self._seqs.values() if not s.swapped]
        reserved = used = 0
        for s in resident:
            for t in s.tables:
                nulls = leading_nulls(t, self._null)
                reserved += (len(t) - nulls) * bs
                used += s.scheduled - nulls * bs
        return dataclasses.replace(
            st,
            used_blocks=usable - st.free_blocks - st.cached_blocks,
            reserved_slots=reserved,
            used_slots=used,
            groups=tuple(self._group_stats(g) for g in range(len(self._groups))),
        )

    def _group_stats(self, g: int) -> GroupStats:
        used = sum(1 for b, rc in enumerate(self._rc) if rc > 0 and self._owner[b] == g)
        usable = self._num_blocks - self._has_null
        return GroupStats(
            kind=self._groups[g].kind,
            used_blocks=used,
            cached_blocks=sum(
                1 for b in self._cached_blocks() + self._pinned_cached() if self._owner[b] == g
            ),
            usage=used / usable if usable > 0 else 0.0,
            hit_blocks=self._group_hits[g],
            evictions=self._group_evictions[g],
            registered_blocks=self._group_registered[g],
        )

    def check_invariants(self) -> None:
        """Audit the lifecycle contract with groups; raise InvariantError on the first
        violation."""
        from pagedkv_reference.groups_audit import audit

        audit(self)


__all__ = ["CPU_NULL", "NULL", "GroupedReferenceBlockManager", "leading_nulls"]
