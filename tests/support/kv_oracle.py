"""The KV-content oracle: a CPU pool whose bytes say whose KV they are.

Bookkeeping that looks consistent can still hand out a block whose KV belongs to another
prefix. This oracle watches a manager (the Rust one or the reference) call by call and plays
the engine's part on a shadow pool, one value per slot:

- every token the manager schedules has its KV "computed" into its slot in each group's
  table: the value is a function of the group, the sequence's extra keys (salt, LoRA, the
  caller's key family), its tokens up to that position and the position;
- the copy pairs a call returns (copy-on-write, truncate, swap out and in) are carried out
  before that call's tokens are written, as an engine must;
- tokens a sequence scheduled but never computed (`free(num_computed_tokens=...)`) are
  poisoned in the blocks nobody else holds, so a block registered over them and served
  later fails the check;
- after every call, every computed position of every resident sequence, in every group
  (null entries aside), must hold exactly its own KV: a hit on the wrong block, a write into
  a block another sequence shares or the cache still offers, a missing or wrong copy pair,
  a swap that moves the wrong block, all show up as a slot holding someone else's KV;
- every block a call reports as evicted (`evicted=`, the copy-out to the tiers) must still
  hold the KV of the digest it is reported under, at the moment of the call;
- given the groups' kinds (`groups=`), every group must hold (not the null block) each entry
  it reads at the sequence's scheduled position (a state group its last state, a window its
  window): a hit whose groups diverged (a deeper full-attention hit taken for a state group
  that lacks its state there) shows up as a needed entry left null. Tokens loaded past the
  hit (`allocate(loaded_tokens=)`, a connector's load) hold their own KV like computed ones:
  the load writes them.

It never looks at the manager's private state: only return values, `num_scheduled_tokens`,
`block_table(group=)`, `block_hashes` and `is_swapped`. `checked` counts the positions and
evictions verified, so that a test can show the oracle looked at something.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

POISON = ("poison",)
"""What an uncomputed slot holds: never anyone's KV."""

# The calls whose return value is copy pairs inside the GPU pool, applied before writes.
_COPY_CALLS = frozenset({"extend", "append", "truncate", "append_batch"})


def salt_key(salt: Any) -> bytes | None:
    """A cache salt as the managers read it: str as UTF-8 bytes."""
    if isinstance(salt, str):
        return salt.encode("utf-8")
    return None if salt is None else bytes(salt)


@dataclass
class _Seq:
    """What the oracle knows of one sequence: its content and how far its KV is written."""

    extras: Hashable
    tokens: list[int]
    written: int = 0
    # Leading tokens whose KV is computed whatever a retraction says: the prefix hit (others
    # computed it) and everything written before a fork, on both sides (the other side may
    # have registered it). `free(num_computed_tokens=...)` never makes them uncomputed.
    inherited: int = 0
    # chain[p]: the identity of the prefix tokens[: p + 1] under `extras` (built lazily).
    chain: list[int] = field(default_factory=list)

    def identity(self, p: int) -> int:
        while len(self.chain) <= p:
            i = len(self.chain)
            prev = self.chain[-1] if self.chain else hash(("extras", self.extras))
            self.chain.append(hash((prev, self.tokens[i])))
        return self.chain[p]

    def set_tokens(self, tokens: list[int]) -> None:
        keep = 0
        for a, b in zip(self.tokens, tokens, strict=False):
            if a != b:
                break
            keep += 1
        self.tokens = tokens
        del self.chain[keep:]


@dataclass(frozen=True)
class Pending:
    """A sequence's state before a call that may destroy it (`before`)."""

    sid: int
    scheduled: int
    tables: list[list[int]]
    inherited: int = 0


@dataclass
class Call:
    """One call as the oracle needs it: what was asked, what came back, what it evicted,
    the identity of a new sequence's extra keys (None: from its salt and LoRA id) and its
    `before` state."""

    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    value: Any
    exc: BaseException | None = None
    evicted: list[tuple[int, int, bytes]] = field(default_factory=list)
    extras: Hashable | None = None
    pending: Pending | None = None


class KVContentError(AssertionError):
    """A slot holds KV other than its sequence's own, or an eviction reports the wrong KV."""


class KVOracle:
    """The shadow pool of one manager (see the module docstring).

    `null_block`: whether block 0 is the manager's null block (then 0 in a table is a null
    entry and holds no KV). `groups`: the groups' `KVCacheGroup`s, to check that each holds
    the entries it reads (without them, null entries are only skipped)."""

    def __init__(
        self,
        block_size: int,
        num_groups: int = 1,
        *,
        null_block: bool = False,
        groups: Sequence[Any] | None = None,
    ) -> None:
        self.bs = block_size
        self.groups = num_groups
        self.null_block = null_block
        self.kinds = list(groups) if groups is not None else None
        if self.kinds is not None and len(self.kinds) != num_groups:
            raise ValueError(f"groups: {len(self.kinds)} kinds for {num_groups} groups")
        self.gpu: dict[tuple[int, int], Any] = {}
        self.cpu: dict[tuple[int, int], Any] = {}
        self.seqs: dict[int, _Seq] = {}
        # digest -> (the identities of its block's positions in group 0, its end position)
        self.digests: dict[bytes, tuple[tuple[int, ...], int]] = {}
        self.checked = 0
        self.evictions_checked = 0
        self._pending: Pending | None = None
        self._copies: list[tuple[dict[Any, Any], int, dict[Any, Any], int]] = []

    # ------------------------------------------------------------------ the call protocol

    def before(
        self, m: Any, method: str, args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Pending | None:
        """Remember what a call may destroy: the tables of a sequence freed with fewer
        computed tokens than it scheduled. Returns it (for `Call`), and keeps it for
        `after`. Threads calling `before` at once each get their own call's state from the
        return value (`self._pending` is only for the one-thread `before`/`after` pairing)."""
        pending = None
        if method == "free" and kwargs.get("num_computed_tokens") is not None:
            sid = int(args[0])
            if sid in m and not m.is_swapped(sid):
                tables = [list(m.block_table(sid, group=g)) for g in range(self.groups)]
                inherited = self.seqs[sid].inherited if sid in self.seqs else 0
                pending = Pending(sid, m.num_scheduled_tokens(sid), tables, inherited)
        self._pending = pending
        return pending

    def after(
        self,
        m: Any,
        method: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
        value: Any,
        exc: BaseException | None,
        *,
        evicted: Iterable[tuple[int, int, bytes]] = (),
        extras: Hashable | None = None,
    ) -> None:
        """Play the engine's part for a call that returned `value` (or raised `exc`), then
        check every resident sequence. `extras` overrides the identity of a new sequence's
        extra keys (a caller-keyed sequence's key family)."""
        call = Call(method, tuple(args), kwargs, value, exc, list(evicted), extras, self._pending)
        self._pending = None
        self.apply_round(m, [call])

    def apply_round(self, m: Any, calls: Sequence[Call]) -> None:
        """Play the engine's part for calls made concurrently (one per sequence at most,
        so their order does not matter), then check every resident sequence: first each
        call's evictions are checked (they were copied out before any of the calls'
        writes), then the copy pairs are carried out and uncomputed slots poisoned, then
        every newly scheduled token is written."""
        for c in calls:
            self.check_evicted(c.evicted)
        for c in calls:
            if c.exc is None:
                self._mirror(m, c)
        self._copy_all()
        # Once every call's sequences are known: a block another call of the round took
        # since is written by its new holder, not poisoned.
        for c in calls:
            if c.exc is None and c.method == "free" and c.pending is not None:
                self._poison(m, int(c.kwargs["num_computed_tokens"]), c.pending)
        self.sync(m)

    def check_evicted(self, evicted: Iterable[tuple[int, int, bytes]]) -> None:
        """Each evicted block must hold the KV of the digest it is reported under (only
        digests the oracle saw a sequence hold can be checked; group 0's)."""
        for block, group, digest in evicted:
            known = self.digests.get(bytes(digest))
            if known is None or group != 0:
                continue
            ident, end = known
            for off in range(self.bs):
                want = (0, ident[off])
                got = self.gpu.get((block, off))
                if got != want:
                    raise KVContentError(
                        f"evicted block {block} (digest {bytes(digest).hex()[:12]}, tokens up "
                        f"to {end}) holds {got!r} at offset {off}, not its digest's KV"
                    )
            self.evictions_checked += 1

    # ------------------------------------------------------------------ content

    def _mirror(self, m: Any, c: Call) -> None:
        method, args, kwargs, value, extras = c.method, c.args, c.kwargs, c.value, c.extras
        if method == "allocate":
            if value is None:
                return
            sid = int(args[0])
            if extras is None and kwargs.get("block_hashes") is not None:
                extras = ("k",)  # one family of caller keys, unless the caller says which
            elif extras is None:
                extras = ("s", salt_key(kwargs.get("cache_salt")), kwargs.get("lora_id"))
            self.seqs[sid] = _Seq(extras, _ints(args[1]), written=int(value), inherited=int(value))
        elif method in ("append", "append_batch"):
            if value is None:
                return
            if method == "append":
                pairs = [(int(args[0]), _ints(args[1]))]
            else:
                pairs = [(s, [t]) for s, t in zip(_ints(args[0]), _ints(args[1]), strict=True)]
            for sid, toks in pairs:
                seq = self.seqs[sid]
                seq.set_tokens(seq.tokens + toks)
        elif method == "truncate":
            if value is None:
                return
            seq = self.seqs[int(args[0])]
            n = int(args[1])
            seq.set_tokens(seq.tokens[:n])
            seq.written = min(seq.written, n)
            seq.inherited = min(seq.inherited, n)
        elif method == "fork":
            parent = self.seqs[int(args[0])]
            # A fork shares KV that was computed: neither side may retract it later (the
            # other may have registered it).
            parent.inherited = max(parent.inherited, parent.written)
            self.seqs[int(args[1])] = _Seq(
                parent.extras,
                list(parent.tokens),
                parent.written,
                parent.written,
                list(parent.chain),
            )
        elif method == "free":
            self.seqs.pop(int(args[0]), None)
        elif method == "free_batch":
            for sid in _ints(args[0]):
                self.seqs.pop(sid, None)
        elif method == "swap_out" and value is not None:
            for gpu, cpu in value:
                self._copy(self.gpu, gpu, self.cpu, cpu)
        elif method == "swap_in" and value is not None:
            for cpu, gpu in value:
                self._copy(self.cpu, cpu, self.gpu, gpu)
        if method in _COPY_CALLS and value is not None:
            for src, dst in np.asarray(value, dtype=np.int64).reshape(-1, 2).tolist():
                self._copy(self.gpu, src, self.gpu, dst)

    def step(self, m: Any, seq_ids: Sequence[int], tokens: Sequence[int], value: Any) -> None:
        """`RunningBatch.step`: one token per member, then its copy pairs."""
        if value is not None:
            for sid, tok in zip(seq_ids, tokens, strict=True):
                seq = self.seqs[sid]
                seq.set_tokens([*seq.tokens, int(tok)])
            for src, dst in np.asarray(value[1], dtype=np.int64).reshape(-1, 2).tolist():
                self._copy(self.gpu, src, self.gpu, dst)
            self._copy_all()
        self.sync(m)

    def _copy(self, src_pool: dict[Any, Any], src: int, dst_pool: dict[Any, Any], dst: int) -> None:
        """Queue a block copy; `_copy_all` carries out the queue."""
        self._copies.append((src_pool, src, dst_pool, dst))

    def _copy_all(self) -> None:
        """Carry out the queued copies as one batch: every copy reads the state from before
        any of them (the calls of a round ran in an unknown order, and one may have freed
        the block another's copy then wrote: the copy that read it came first)."""
        read = [[sp.get((src, off)) for off in range(self.bs)] for sp, src, _, _ in self._copies]
        for (_, _, dp, dst), values in zip(self._copies, read, strict=True):
            for off, v in enumerate(values):
                if v is None:
                    dp.pop((dst, off), None)
                else:
                    dp[(dst, off)] = v
        self._copies.clear()

    def _poison(self, m: Any, computed: int, pending: Pending) -> None:
        """Slots of positions `computed..scheduled` were never computed (those it inherited
        were, by whoever registered them or by the parent it was forked from): poison those
        in blocks no live sequence holds now."""
        held = {b for sid in self.seqs if sid in m for b in self._all_blocks(m, sid)}
        for g, table in enumerate(pending.tables):
            for p in range(max(computed, pending.inherited), pending.scheduled):
                b = table[p // self.bs] if p // self.bs < len(table) else None
                if b is None or b in held or (self.null_block and b == 0):
                    continue
                self.gpu[(b, p % self.bs)] = (g, POISON)

    def _all_blocks(self, m: Any, sid: int) -> list[int]:
        if m.is_swapped(sid):
            return []
        return [b for g in range(self.groups) for b in m.block_table(sid, group=g)]

    # ------------------------------------------------------------------ write and check

    def sync(self, m: Any) -> None:
        """Write the KV of every newly scheduled token, then check every resident sequence."""
        for sid in [s for s in self.seqs if s not in m]:
            del self.seqs[sid]  # freed by a call the oracle did not see (free_batch paths)
        resident = [s for s in self.seqs if not m.is_swapped(s)]
        tables = {s: [m.block_table(s, group=g) for g in range(self.groups)] for s in resident}
        for sid in resident:
            seq = self.seqs[sid]
            sched = m.num_scheduled_tokens(sid)
            if sched < seq.written:
                seq.written = sched
            for g, table in enumerate(tables[sid]):
                for p in range(seq.written, sched):
                    b = table[p // self.bs]
                    if not (self.null_block and b == 0):
                        self.gpu[(b, p % self.bs)] = (g, seq.identity(p))
            seq.written = sched
        for sid in resident:
            self._check(m, sid, tables[sid], tables)

    def _check(
        self, m: Any, sid: int, tables: list[list[int]], everyone: dict[int, list[list[int]]]
    ) -> None:
        seq = self.seqs[sid]
        if self.kinds is not None and self.null_block:
            self._check_needed(sid, seq.written, tables)
        for g, table in enumerate(tables):
            for p in range(seq.written):
                b = table[p // self.bs]
                if self.null_block and b == 0:
                    continue
                want = (g, seq.identity(p))
                got = self.gpu.get((b, p % self.bs))
                if got != want:
                    raise KVContentError(
                        f"sequence {sid}, group {g}, position {p}: block {b} offset "
                        f"{p % self.bs} holds {self._describe(got)} instead of its own KV "
                        f"(tokens {seq.tokens[: p + 1]}, extras {seq.extras!r}); block {b} "
                        f"is held by {_holders(everyone, b)}"
                    )
                self.checked += 1
        hashes = list(m.block_hashes(sid)) if hasattr(m, "block_hashes") else []
        for i, d in enumerate(hashes[: seq.written // self.bs]):
            end = (i + 1) * self.bs
            ident = tuple(seq.identity(p) for p in range(i * self.bs, end))
            self.digests[bytes(d)] = (ident, end)

    def _check_needed(self, sid: int, written: int, tables: list[list[int]]) -> None:
        """Each group holds the entries it reads when the next token is at `written`."""
        assert self.kinds is not None
        for g, (kind, table) in enumerate(zip(self.kinds, tables, strict=True)):
            first = skipped_tokens(kind, written) // self.bs
            for i in range(first, -(-written // self.bs)):
                if table[i] == 0:
                    raise KVContentError(
                        f"sequence {sid}, group {g} ({kind.kind}): entry {i} is the null "
                        f"block, but the group reads it at position {written} (tokens "
                        f"{i * self.bs}..{(i + 1) * self.bs}): its KV or state is missing"
                    )

    def _describe(self, got: Any) -> str:
        if got is None:
            return "nothing (never written)"
        if got[1] == POISON:
            return f"group {got[0]}'s uncomputed (poisoned) slot"
        owners = [
            f"seq {s} pos {p}"
            for s, q in self.seqs.items()
            for p in range(len(q.tokens))
            if (got[0], q.identity(p)) == got
        ]
        return f"group {got[0]}'s KV of {owners or 'a prefix no live sequence has'}"


def skipped_tokens(group: Any, position: int) -> int:
    """Leading tokens a group no longer reads when the next token is at `position`
    (docs/semantics.md, "What each kind keeps"), written out independently of the
    managers."""
    kind = group.kind
    if kind == "full":
        return 0
    if kind == "sliding_window":
        return max(0, position - (group.window - 1))
    if kind == "chunked_local":
        return position // group.chunk * group.chunk
    if kind == "state":
        return max(0, position - 1)
    raise ValueError(f"unknown group kind {kind!r}")


def _holders(tables: dict[int, list[list[int]]], block: int) -> list[str]:
    """Who holds `block`: 'seq s group g index i' for each table entry of it."""
    return [
        f"seq {s} group {g} index {i}"
        for s, per_group in tables.items()
        for g, table in enumerate(per_group)
        for i, b in enumerate(table)
        if b == block
    ]


def _ints(x: Any) -> list[int]:
    """Token or sequence ids in any accepted form (list, tuple, range, 1-D array)."""
    return [int(t) for t in x]
