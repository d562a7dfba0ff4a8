"""Why each prompt-token miss happened, per tenant (`simulate --why`).

Every token an `allocate` did not serve from the prefix cache gets exactly one cause, so the
causes of a tenant sum to its prompt tokens minus its hit tokens:

- `preemption`: the sequence is being recomputed after a preemption and held these tokens
  before it (its own blocks, lost when it was freed);
- `last_block`: the tokens past the last block a hit may cover (the partial last block, or
  the last full block when the prompt fills it: one token is always computed);
- `evicted`: the block was stored under this digest before and has been evicted since (by
  the manager's eviction policy; how long before, in steps and trace seconds, is kept);
- `other_salt`: never stored under this digest, but the same tokens were stored under
  another cache salt (another tenant) or LoRA id;
- `never_stored`: the tokens were never stored under any salt;
- `window`: the block is cached, but the hit stopped before it because a hybrid group
  (sliding window, chunked local) lacks blocks it needs;
- `unexplained`: the block is cached and nothing above explains the miss (never expected;
  reported rather than hidden).

A block that is itself still cached but lies behind an earlier missed block of the same
prompt is lost to that earlier miss: it gets the earlier block's cause (an eviction of one
block costs the rest of the chain).

What the manager stored and evicted comes from its KV events (`enable_kv_events=True`),
drained before every `allocate` and after every step, so the causes are judged on the cache
as it was when the hit was computed; `MissWhy.watch(manager)` wraps the manager to do that
(and to note how many tokens a preempted sequence held). The digests of the missed blocks
are the manager's own (`hash_blocks`), with its hash and seed; "the same tokens under
another salt" is judged by the salt-free digests of the blocks every allocation asked for
(they are hit or stored as it is scheduled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from pagedkv import hash_blocks
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored

CAUSES = (
    "never_stored",
    "evicted",
    "other_salt",
    "window",
    "last_block",
    "preemption",
    "unexplained",
)
_SEVERAL = -1  # `_asked`: more than one tenant asked for these tokens


def tenant_name(salt: str | bytes | None) -> str:
    """A tenant's name in the output: its cache salt, or "(none)"."""
    if salt is None:
        return "(none)"
    return salt if isinstance(salt, str) else salt.decode(errors="backslashreplace")


@dataclass(slots=True)
class TenantMisses:
    """One tenant's prompt tokens, hits and misses by cause."""

    prompt_tokens: int = 0
    hit_tokens: int = 0
    causes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    evicted_blocks: int = 0  # blocks missed because they were evicted
    evicted_age_steps: int = 0  # summed over those: steps since their eviction
    evicted_max_age_steps: int = 0

    @property
    def misses(self) -> int:
        return self.prompt_tokens - self.hit_tokens

    def as_dict(self, ms_per_step: float | None, policy: str) -> dict[str, Any]:
        mean = self.evicted_age_steps / self.evicted_blocks if self.evicted_blocks else 0.0
        sec = (lambda steps: steps * ms_per_step / 1000) if ms_per_step else (lambda _: None)
        return {
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "miss_tokens": self.misses,
            "causes": dict(self.causes),
            "evicted": {
                "policy": policy,
                "blocks": self.evicted_blocks,
                "mean_age_steps": mean,
                "max_age_steps": self.evicted_max_age_steps,
                "mean_age_s": sec(mean),
                "max_age_s": sec(self.evicted_max_age_steps),
            },
        }


class _Watched:
    """The manager, seen through `MissWhy`: events drained before each `allocate`, and the
    tokens a sequence held noted before each single `free` (a preemption frees that way)."""

    def __init__(self, manager: Any, why: MissWhy) -> None:
        self._m = manager
        self._why = why

    def allocate(self, seq_id: int, token_ids: Any, **kw: Any) -> int | None:
        self._why.drain()
        out: int | None = self._m.allocate(seq_id, token_ids, **kw)
        return out

    def free(self, seq_id: int, *, num_computed_tokens: int | None = None) -> None:
        m = self._m
        held = (
            m.num_scheduled_tokens(seq_id) if num_computed_tokens is None else num_computed_tokens
        )
        self._why.held[seq_id] = held
        m.free(seq_id, num_computed_tokens=num_computed_tokens)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._m, name)


class MissWhy:
    """A `ScheduleObserver` that attributes every prompt-token miss (module docstring)."""

    def __init__(self, ms_per_step: float | None = None) -> None:
        self.ms_per_step = ms_per_step
        self.tenants: dict[str, TenantMisses] = {}
        self.held: dict[int, int] = {}  # freed sequence -> tokens it held (computed)
        self._m: Any = None
        self.policy = "lru"
        self.clock = 0
        self._full: frozenset[int] = frozenset({0})  # groups whose blocks make a hit
        # Cached now: with one full group a set; with several, digest -> full groups caching
        # it. A digest ever stored is cached now or was evicted (`_removed`).
        self._present_set: set[bytes] = set()
        self._present: dict[bytes, int] = {}
        # The salt-free digest of every full prompt block allocated -> the tenant (salt and
        # LoRA id) that asked for it, or _SEVERAL: its blocks were stored under that salt.
        self._asked: dict[bytes, int] = {}
        self._tenant_ids: dict[tuple[str | bytes | None, int | None], int] = {}
        self._removed: dict[bytes, int] = {}  # digest -> clock of its last eviction

    # ---------------------------------------------------------------- the manager

    def watch(self, manager: Any) -> Any:
        """Wrap `manager` (built with `enable_kv_events=True`) for `run_workload`. Raises
        ValueError for a manager without events, or one that is not pagedkv's Rust
        `BlockManager` (the digests must be its own)."""
        if not hasattr(manager, "hash_algo") or not hasattr(manager, "drain_events"):
            raise ValueError(
                f"--why needs pagedkv's BlockManager (the Rust core), not {type(manager).__name__}"
            )
        manager.set_kv_event_capacity(None)  # drained every step: never overflows; raises
        # InvalidArgumentError (a ValueError) when the manager's events are off
        self._m = manager
        self.policy = str(getattr(manager, "eviction", "lru"))
        self.block_size = manager.block_size
        self.hash_algo = manager.hash_algo
        self.hash_seed = manager.hash_seed
        groups = manager.groups
        self.hybrid = groups is not None and any(g.kind != "full" for g in groups)
        if groups is not None:
            full = frozenset(i for i, g in enumerate(groups) if g.kind == "full")
            self._full = full or frozenset(range(len(groups)))
        return _Watched(manager, self)

    def before_step(self, clock: int) -> None:
        """A step starts at `clock`: what the last step stored and evicted is applied first."""
        self.drain()
        self.clock = clock

    def drain(self) -> None:
        """Apply the manager's events since the last drain, stamped with the current clock."""
        events = self._m.drain_events()
        if len(self._full) == 1:
            self._drain_one(events)
        else:
            self._drain_many(events)

    def _drain_one(self, events: list[Any]) -> None:
        """One full group (the common case): set operations per event, no loop per block."""
        (group,) = self._full
        present, removed, clock = self._present_set, self._removed, self.clock
        for e in events:
            kind = type(e)
            if kind is BlockStored:
                if e.group_idx == group:
                    present.update(e.block_hashes)
            elif kind is BlockRemoved:
                if e.group_idx == group:
                    present.difference_update(e.block_hashes)
                    removed.update(dict.fromkeys(e.block_hashes, clock))
            elif kind is AllBlocksCleared:
                removed.update(dict.fromkeys(present, clock))
                present.clear()

    def _drain_many(self, events: list[Any]) -> None:
        """Several full groups: a block is cached when every one of them caches it."""
        present, removed, full = self._present, self._removed, self._full
        for e in events:
            kind = type(e)
            if kind is BlockStored:
                if e.group_idx in full:
                    for d in e.block_hashes:
                        present[d] = present.get(d, 0) + 1
            elif kind is BlockRemoved:
                if e.group_idx in full:
                    for d in e.block_hashes:
                        left = present.get(d, 0) - 1
                        if left > 0:
                            present[d] = left
                        else:
                            present.pop(d, None)
                        removed[d] = self.clock
            elif kind is AllBlocksCleared:
                removed.update(dict.fromkeys(present, self.clock))
                present.clear()

    # ---------------------------------------------------------------- the observer

    def allocate(
        self,
        seq_id: int,
        token_ids: npt.NDArray[np.uint32],
        hit_tokens: int,
        scheduled: int,
        *,
        cache_salt: str | bytes | None = None,
        lora_id: int | None = None,
    ) -> None:
        name = tenant_name(cache_salt)
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = TenantMisses()
        n = len(token_ids)
        t.prompt_tokens += n
        t.hit_tokens += hit_tokens
        causes = t.causes
        bs = self.block_size
        held = self.held.pop(seq_id, 0)
        end = hit_tokens
        if held > hit_tokens:  # a recompute: what it held before, in whole blocks
            end = min(-(-held // bs) * bs, n)
            causes["preemption"] += end - hit_tokens
        cap = (n - 1) // bs * bs  # a hit never covers more
        causes["last_block"] += n - max(end, cap)
        tenant = self._tenant_ids.setdefault((cache_salt, lora_id), len(self._tenant_ids))
        salted = cache_salt is not None or lora_id is not None
        algo, seed = self.hash_algo, self.hash_seed
        plain = hash_blocks(token_ids[:cap], bs, hash_algo=algo, seed=seed)
        if end < cap:
            digests = (
                hash_blocks(
                    token_ids[:cap],
                    bs,
                    cache_salt=cache_salt,
                    lora_id=lora_id,
                    hash_algo=algo,
                    seed=seed,
                )
                if salted
                else plain
            )
            broke = "preemption" if end > hit_tokens else None
            self._blocks(t, tenant, digests, plain, end // bs, broke)
        asked = self._asked
        for c in plain:
            was = asked.setdefault(c, tenant)
            if was != tenant and was != _SEVERAL:
                asked[c] = _SEVERAL

    def _blocks(
        self,
        t: TenantMisses,
        tenant: int,
        digests: list[bytes],
        plain: list[bytes],
        first: int,
        broke: str | None,
    ) -> None:
        """Blocks `first..len(digests)` missed (`plain`: their salt-free digests); `broke`:
        the cause of the miss before them."""
        bs, need, causes = self.block_size, len(self._full), t.causes
        present, pset, removed, asked = self._present, self._present_set, self._removed, self._asked
        one = need == 1
        for i in range(first, len(digests)):
            d = digests[i]
            if d in pset if one else present.get(d, 0) >= need:
                # Cached, yet missed: the hit ended before it. Behind an earlier miss the
                # tokens are lost to that miss's cause; as the first miss, a hybrid group's
                # window cut the hit (with one group this cannot happen: "unexplained").
                cause = broke or ("window" if self.hybrid else "unexplained")
            elif d in removed:
                cause = "evicted"
                age = self.clock - removed[d]
                t.evicted_blocks += 1
                t.evicted_age_steps += age
                t.evicted_max_age_steps = max(t.evicted_max_age_steps, age)
            else:
                who = asked.get(plain[i])
                cause = "never_stored" if who is None or who == tenant else "other_salt"
            causes[cause] += bs
            broke = cause

    def extend(self, seq_id: int, num_new_tokens: int) -> None:
        pass

    def append(self, seq_id: int, token_ids: npt.NDArray[np.uint32]) -> None:
        pass

    def decode(self, seq_ids: list[int], token_ids: npt.NDArray[np.uint32]) -> None:
        pass

    def fork(self, parent_id: int, child_id: int) -> None:
        pass

    def swap_out(self, seq_id: int) -> None:
        pass

    def swap_in(self, seq_id: int) -> None:
        pass

    def free(self, seq_id: int) -> None:
        pass


def misses_doc(why: MissWhy) -> dict[str, Any]:
    """The `--json` section: per tenant, its prompt tokens, hits and misses by cause."""
    return {
        "causes": list(CAUSES),
        "tenants": {
            name: t.as_dict(why.ms_per_step, why.policy) for name, t in sorted(why.tenants.items())
        },
    }


__all__ = ["CAUSES", "MissWhy", "TenantMisses", "misses_doc", "tenant_name"]
