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
another salt" is judged by a salt-free BLAKE2b chain over the stored blocks' tokens.
"""

from __future__ import annotations

import hashlib
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
_ROOT = hashlib.blake2b(b"pagedkv-sim-why|salt-free").digest()[:16]


def _content(parent: bytes, block: npt.NDArray[np.uint32]) -> bytes:
    """The salt-free key of a block: its tokens, chained to its parent's key."""
    return hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest()


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
        self._present: dict[bytes, int] = {}  # digest -> full groups caching it now
        self._content: dict[bytes, bytes] = {}  # digest ever stored -> salt-free key
        self._contents: set[bytes] = set()  # salt-free keys ever stored
        self._removed: dict[bytes, int] = {}  # digest -> clock of its last eviction

    # ---------------------------------------------------------------- the manager

    def watch(self, manager: Any) -> Any:
        """Wrap `manager` (built with `enable_kv_events=True`) for `run_workload`."""
        manager.set_kv_event_capacity(None)  # drained every step: never overflows
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
        present, removed = self._present, self._removed
        for e in self._m.drain_events():
            if isinstance(e, BlockStored):
                if e.group_idx not in self._full:
                    continue
                self._stored(e)
                for d in e.block_hashes:
                    present[d] = present.get(d, 0) + 1
            elif isinstance(e, BlockRemoved):
                if e.group_idx not in self._full:
                    continue
                for d in e.block_hashes:
                    left = present.get(d, 0) - 1
                    if left > 0:
                        present[d] = left
                    else:
                        present.pop(d, None)
                    removed[d] = self.clock
            elif isinstance(e, AllBlocksCleared):
                for d in present:
                    removed[d] = self.clock
                present.clear()

    def _stored(self, e: BlockStored) -> None:
        parent = e.parent_block_hash
        key = _ROOT if parent is None else self._content.get(parent, _ROOT)
        bs = e.block_size
        tokens = np.asarray(e.token_ids, dtype=np.uint32)
        for i, d in enumerate(e.block_hashes):
            key = _content(key, tokens[i * bs : (i + 1) * bs])
            self._content[d] = key
            self._contents.add(key)

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
        if end >= cap:
            causes["last_block"] += n - end
            return
        causes["last_block"] += n - cap
        digests = hash_blocks(
            token_ids[:cap],
            bs,
            cache_salt=cache_salt,
            lora_id=lora_id,
            hash_algo=self.hash_algo,
            seed=self.hash_seed,
        )
        broke = "preemption" if end > hit_tokens else None
        self._blocks(t, token_ids, digests, end // bs, broke)

    def _blocks(
        self,
        t: TenantMisses,
        token_ids: npt.NDArray[np.uint32],
        digests: list[bytes],
        first: int,
        broke: str | None,
    ) -> None:
        """Blocks `first..len(digests)` missed; `broke`: the cause of the miss before them."""
        bs, need, causes = self.block_size, len(self._full), t.causes
        present, content, removed = self._present, self._content, self._removed
        key, done = _ROOT, 0  # the salt-free chain, computed up to block `done` when needed
        for i in range(first, len(digests)):
            d = digests[i]
            if present.get(d, 0) >= need:
                # Cached, yet missed: the hit ended before it. Behind an earlier miss the
                # tokens are lost to that miss's cause; as the first miss, a hybrid group's
                # window cut the hit (with one group this cannot happen: "unexplained").
                cause = broke or ("window" if self.hybrid else "unexplained")
            elif d in content:
                cause = "evicted"
                age = self.clock - removed.get(d, self.clock)
                t.evicted_blocks += 1
                t.evicted_age_steps += age
                t.evicted_max_age_steps = max(t.evicted_max_age_steps, age)
            else:
                while done <= i:
                    key = _content(key, token_ids[done * bs : (done + 1) * bs])
                    done += 1
                cause = "other_salt" if key in self._contents else "never_stored"
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
