"""Tenant quotas as a plain wrapper around any policy.

A tenant is a cache salt (`bytes`; None for requests without one: one more tenant). Each
tenant may have a `Quota`: a `cap` on its CACHED blocks and a `reserved` share of CACHED
blocks that other tenants' pressure does not take. Each tenant's blocks are ranked by their
own instance of the inner policy (so one tenant's scan cannot flood another's history). The
rules, exactly:

1. Cap. A tenant never has more than `cap` CACHED blocks after a call returns: when a
   release (`on_cached`) or a lowered cap (`set_quota`) puts it over, its own policy's
   victims are evicted at once, until it is within the cap, and returned for the manager to
   free. So a tenant over its cap evicts its own blocks first, before anyone else's. Pinned
   blocks are the one exception: they are never victims, so a tenant whose CACHED blocks
   are all pinned stays over its cap until it unpins.
2. Reserve. `victim` chooses among the tenants with more CACHED blocks than their reserved
   share that have a block their policy may evict; only when there is none does it choose
   among every tenant. So a victim never takes a tenant below its reserve while another
   tenant has evictable blocks above its own.
3. Order across tenants. Among the tenants allowed by rule 2, each one's policy names its
   next victim; the one evicted is the least by (the policy's `cross_rank`, release order).
   `cross_rank` is empty for LRU, S3-FIFO, ARC and LFU (so: least recently released among
   the candidates) and (level, time, kind) for the priority policy (so a lower priority goes
   first across tenants too). With no quotas and LRU this is exactly global LRU.

The candidates are the tenants' `peek`s; then the chosen tenant's policy evicts for real,
which returns its peeked block. A peek is not always free of effects: S3-FIFO's makes, for
real, the moves its victim would make first (S's reused oldest blocks to M, M's oldest
reinserted with an access spent), so a tenant peeked but not chosen keeps those moves and
its later victims may differ from what they would have been without the peek. That is
intended, and the Rust core's tenant quotas peek the same way: the two agree call for
call. (Earlier this module peeked on `copy.deepcopy` copies, which left no trace; the
other policies' peeks leave none either.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedkv_reference.eviction.base import EvictionPolicy, check_block, check_int

__all__ = ["Quota", "Tenant", "TenantQuotas"]

Tenant = bytes | None


@dataclass(frozen=True)
class Quota:
    cap: int | None = None  # most CACHED blocks; None: no cap
    reserved: int = 0  # CACHED blocks other tenants' evictions leave alone

    def __post_init__(self) -> None:
        if self.cap is not None:
            check_int(self.cap, "quota cap")
        check_int(self.reserved, "quota reserved")
        if self.cap is not None and self.reserved > self.cap:
            raise ValueError(f"quota reserved {self.reserved} is above its cap {self.cap}")


def _check_tenant(tenant: object) -> Tenant:
    if tenant is not None and not isinstance(tenant, bytes):
        raise TypeError(f"tenant must be bytes or None, got {type(tenant).__name__}")
    return tenant


class TenantQuotas:
    """Per-tenant caps and reserves over per-tenant instances of one policy."""

    def __init__(
        self,
        make_policy: Callable[[], EvictionPolicy],
        quotas: Mapping[Tenant, Quota] | None = None,
    ) -> None:
        self._make = make_policy
        self._quotas: dict[Tenant, Quota] = {}
        for t, q in (quotas or {}).items():
            self._quotas[_check_tenant(t)] = q
        self._policies: dict[Tenant, EvictionPolicy] = {}
        self._tenant: dict[int, Tenant] = {}  # evictable block -> its tenant
        self._released: dict[int, int] = {}  # evictable block -> release order
        self._seq = 0

    def quota(self, tenant: Tenant) -> Quota:
        return self._quotas.get(tenant, Quota())

    def cached(self, tenant: Tenant) -> int:
        """The tenant's CACHED blocks."""
        p = self._policies.get(tenant)
        return 0 if p is None else len(p)

    def tenant_of(self, block: int) -> Tenant:
        return self._tenant[block]

    def __len__(self) -> int:
        return len(self._tenant)

    def __contains__(self, block: object) -> bool:
        return block in self._tenant

    def policy(self, tenant: Tenant) -> EvictionPolicy:
        """The tenant's own policy (made on first use), e.g. to set retention on it."""
        return self._policy(_check_tenant(tenant))

    def _policy(self, tenant: Tenant) -> EvictionPolicy:
        p = self._policies.get(tenant)
        if p is None:
            p = self._policies[tenant] = self._make()
            if len(p):
                raise ValueError("make_policy must return an empty policy")
        return p

    def set_quota(self, tenant: Tenant, quota: Quota, now: float) -> list[int]:
        """Change a tenant's quota; returns the blocks evicted at once to meet a lower cap."""
        t = _check_tenant(tenant)
        if not isinstance(quota, Quota):
            raise TypeError(f"quota must be a Quota, got {type(quota).__name__}")
        self._quotas[t] = quota
        return self._trim(t, now)

    def on_cached(self, block: int, now: float, key: bytes, tenant: Tenant = None) -> list[int]:
        """`block` of `tenant` became CACHED; returns the tenant's blocks evicted at once to
        keep its cap (rule 1), which the manager must free."""
        t = _check_tenant(tenant)
        b = check_block(block)
        if b in self._tenant:
            raise ValueError(f"block {b} is already cached")
        self._policy(t).on_cached(b, now, key)  # checks the rest before changing anything
        self._tenant[b] = t
        self._released[b] = self._seq
        self._seq += 1
        return self._trim(t, now)

    def on_hit(self, block: int, now: float) -> None:
        b = self._member(block)
        self._policies[self._tenant[b]].on_hit(b, now)
        self._drop(b)

    def on_removed(self, block: int) -> None:
        b = self._member(block)
        self._policies[self._tenant[b]].on_removed(b)
        self._drop(b)

    def victim(self, now: float) -> int | None:
        """The next block to evict under rules 2 and 3, or None."""
        cands: list[tuple[tuple[float, ...], int, Tenant, int, bool]] = []
        for p in self._policies.values():
            p.check_now(now)  # a clock that goes back raises before any peek changes anything
        for t, p in self._policies.items():
            b = p.peek(now)
            if b is not None:
                above = len(p) > self.quota(t).reserved
                cands.append((p.cross_rank(b, now), self._released[b], t, b, above))
        if not cands:
            return None
        allowed = [c for c in cands if c[4]] or cands
        _, _, t, b, _ = min(allowed, key=lambda c: (c[0], c[1]))
        got = self._policies[t].victim(now)
        assert got == b, f"policy of tenant {t!r} chose {got}, its peek {b}"
        self._drop(b)
        return b

    def _trim(self, tenant: Tenant, now: float) -> list[int]:
        cap = self.quota(tenant).cap
        p = self._policies.get(tenant)
        out: list[int] = []
        while p is not None and cap is not None and len(p) > cap:
            b = p.victim(now)
            if b is None:  # only pinned blocks left: pins win over the cap
                break
            self._drop(b)
            out.append(b)
        return out

    def _member(self, block: object) -> int:
        b = check_block(block)
        if b not in self._tenant:
            raise ValueError(f"block {b} is not cached (not in the evictable set)")
        return b

    def _drop(self, block: int) -> None:
        del self._tenant[block]
        del self._released[block]
