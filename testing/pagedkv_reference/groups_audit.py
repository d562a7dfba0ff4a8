"""`check_invariants` of the grouped reference manager (docs/semantics.md, "KV-cache
groups"): the single-table audit, per group, plus the null block and the group rules.

Each check raises `InvariantError` naming the first violation it finds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from pagedkv.errors import InvariantError
from pagedkv_reference.groups import CPU_NULL, NULL, _GSeq, _gseq, leading_nulls
from pagedkv_reference.manager import RECENT_WINDOW

if TYPE_CHECKING:
    from pagedkv_reference.groups import GroupedReferenceBlockManager as Manager


def _fail(msg: str) -> NoReturn:
    raise InvariantError(msg)


def _check_counts(m: Manager, sid: int, s: _GSeq) -> None:
    bs = m._block_size
    if not 1 <= s.scheduled <= s.num_tokens:
        _fail(f"sequence {sid}: {s.scheduled} scheduled of {s.num_tokens} tokens")
    if not 0 <= s.hits * bs <= s.scheduled:
        _fail(f"sequence {sid}: {s.hits} hit blocks, {s.scheduled} scheduled tokens")
    m._check_digests(sid, s)


def _check_shape(m: Manager, sid: int, s: _GSeq, tables: list[list[int]], null: int) -> None:
    """One table per group, all of one length covering the scheduled tokens; the nulls a
    leading run of entries the group skips at `s`."""
    bs = m._block_size
    if len(tables) != len(m._groups):
        _fail(f"sequence {sid} has {len(tables)} tables for {len(m._groups)} groups")
    if len({len(t) for t in tables}) != 1:
        _fail(f"sequence {sid} has tables of different lengths")
    if len(tables[0]) * bs < s.scheduled:
        _fail(f"sequence {sid} has {len(tables[0])} entries for {s.scheduled} tokens")
    for g, (group, t) in enumerate(zip(m._groups, tables, strict=True)):
        nulls = leading_nulls(t, null)
        if null in t[nulls:]:
            _fail(f"sequence {sid} group {g}: a null entry after a held one")
        if nulls * bs > group.skipped_tokens(s.scheduled):
            _fail(
                f"sequence {sid} group {g}: {nulls} null entries, but it needs token "
                f"{group.skipped_tokens(s.scheduled)} on"
            )


def _check_resident(m: Manager, sid: int, s: _GSeq, rc: list[int]) -> None:
    bs = m._block_size
    if s.cpu_tables or s.cpu_blocks or s.blocks:
        _fail(f"resident sequence {sid} holds CPU blocks or a single table")
    _check_shape(m, sid, s, s.tables, m._null)
    for g, t in enumerate(s.tables):
        for i, b in enumerate(t):
            if b == m._null:
                continue
            if not int(m._has_null) <= b < m._num_blocks:
                _fail(f"sequence {sid} holds block id {b} out of range")
            if m._owner[b] != g:
                _fail(f"sequence {sid} group {g} holds block {b} of group {m._owner[b]}")
            rc[b] += 1
            d = m._hashed[b]
            if d is None:
                continue
            # Registration follows scheduling: a hashed block is full of scheduled tokens
            # and keyed (a held sequence may hold one a fork registered past its hold).
            if i >= min(s.scheduled // bs, len(s.digests)):
                _fail(
                    f"sequence {sid} group {g} block {b} at index {i} is hashed but not "
                    f"full of scheduled tokens ({s.scheduled})"
                )
            if d != s.digests[i]:
                _fail(f"sequence {sid} group {g} block {b} hashed under another digest")


def _check_swapped(m: Manager, sid: int, s: _GSeq) -> None:
    if s.blocks or s.cpu_blocks or any(s.tables):
        _fail(f"swapped sequence {sid} holds GPU blocks")
    _check_shape(m, sid, s, s.cpu_tables, CPU_NULL)


def _check_sequences(m: Manager) -> list[int]:
    """Audit each sequence; the references its tables hold, per block."""
    rc = [0] * m._num_blocks
    for sid, seq in m._seqs.items():
        s = _gseq(seq)
        _check_counts(m, sid, s)
        if s.swapped:
            _check_swapped(m, sid, s)
        else:
            _check_resident(m, sid, s, rc)
    return rc


def _check_pool(m: Manager, rc: list[int]) -> None:
    n = m._num_blocks
    cached = m._policy.entries()
    cached += [(b, m._policy_key(b)) for b in m._pinned_cached()]
    if m._has_null and (
        m._rc[NULL] or m._hashed[NULL] is not None or NULL in m._free or NULL in m._policy
    ):
        _fail("the null block is held, hashed, free or cached")
    for b in range(int(m._has_null), n):
        if rc[b] != m._rc[b]:
            _fail(f"block {b}: refcount {m._rc[b]}, tables hold {rc[b]}")
    free_set = set(m._free)
    if len(free_set) != len(m._free):
        _fail("free stack holds a block twice")
    for b in m._free:
        if not int(m._has_null) <= b < n or m._rc[b] or m._hashed[b] is not None:
            _fail(f"free block {b} is out of range, held or hashed")
    for b, key in cached:
        if m._rc[b] or b in free_set or m._hashed[b] is None:
            _fail(f"cached block {b} is held, free or not hashed")
        if not 0 <= m._owner[b] < len(m._groups):
            _fail(f"cached block {b} belongs to no group")
        if key != m._policy_key(b):
            _fail(f"cached block {b} is known to the eviction policy by another key")
    owned = sum(1 for r in m._rc if r > 0)
    usable = n - m._has_null
    if owned + len(m._free) + len(cached) != usable:
        _fail(f"owned {owned} + free {len(m._free)} + cached {len(cached)} != {usable} blocks")


def _check_index(m: Manager) -> None:
    for key, b in m._index.items():
        if m._owner[b] != key[0] or m._hashed[b] != key[1:]:
            _fail(f"prefix index maps a (group, digest) to block {b}, not hashed under it")
    num_hashed = sum(1 for d in m._hashed if d is not None)
    if num_hashed != len(m._index):
        _fail(f"{num_hashed} blocks are hashed but the index holds {len(m._index)}")
    if not m._caching and m._index:
        _fail("prefix index not empty with prefix caching disabled")


def _check_cpu_and_counters(m: Manager) -> None:
    cpu = list(m._cpu_free)
    for s in m._seqs.values():
        cpu.extend(m._cpu_held(_gseq(s)))
    if sorted(cpu) != list(range(m._num_cpu_blocks)):
        _fail("CPU blocks: free stack and swapped sequences do not partition the CPU space")
    if not m._events_on and m._log.queue:
        _fail("events queued with events disabled")
    st = m.stats()
    if len(m._recent) > RECENT_WINDOW or not (
        st.recent_prefix_hits <= st.recent_prefix_queries <= m._prefix_queries
        and st.recent_prefix_hits <= m._prefix_hits
    ):
        _fail("the recent hit-rate window does not fit the totals")
    if (
        sum(g.used_blocks for g in st.groups) != st.used_blocks
        or sum(g.cached_blocks for g in st.groups) != st.cached_blocks
        or sum(g.evictions for g in st.groups) != st.evictions
        or sum(g.registered_blocks for g in st.groups) != st.registered_blocks
    ):
        _fail("the group figures do not add up to the pool's")


def audit(m: Manager) -> None:
    """Every check, in order: sequences, pool, index, CPU space and counters."""
    rc = _check_sequences(m)
    _check_pool(m, rc)
    _check_index(m)
    _check_cpu_and_counters(m)


__all__ = ["audit"]
