"""Tenant quotas as a plain wrapper around any policy, as the Rust core's `tenants/quotas.rs`.

A tenant is a cache salt (`bytes`; None for requests without one: one more tenant). Each
tenant may have a `Quota`: a `cap` on its CACHED blocks and a `reserved` share of CACHED
blocks that other tenants' pressure does not take.

Tenants without a quota share ONE instance of the inner policy (the shared group); a tenant
gets its own instance (its own group) when its first quota is set, and its CACHED blocks
then move from the shared instance to its own, in release order, with what their policy
carries (`EvictionPolicy.carry_out`): the priority policy's retention, level, deadline and
release time, so the priority order is kept; other policies' frequencies and queue places
stay behind (a moved block is placed as new). A block revived by a hit that had not come
back when its tenant got its own group stays a member of the shared group (whose policy
knows its history) and moves when it comes back: revived there at its release, then moved
as a cached block. (Before, every tenant had its own instance from its first block: a scan
by one tenant without a quota could not flood another's history. The core keeps the
instances few, so this module follows it.)

`Quota()` (no cap, no reserve) is no quota: setting it dissolves the tenant's group. Its
CACHED blocks move back to the shared group in release order with what they carry (as at a
first quota, the other way); its held blocks become members of the shared group with the
retention they had, their revival history dropped with the instance (they come back as new
blocks). The core frees the instance then (issue 32: it kept one per tenant ever given a
quota).
The rules, exactly:

1. Cap. A group with a cap never has more than `cap` CACHED blocks after a call returns:
   when a release (`on_cached`) or a lowered cap (`set_quota`) puts it over, its own
   policy's victims are evicted at once, until it is within the cap, and returned for the
   manager to free. So a tenant over its cap evicts its own blocks first. Pinned blocks are
   the exception: the manager keeps them out of every policy, so they count for no cap.
2. Reserve. `victim` chooses among the groups with more CACHED blocks than their reserve
   (the shared group's is 0); only when none has an evictable block, among all. So a victim
   never takes a tenant below its reserve while another group has blocks above its own.
3. Order across groups. Among the groups allowed by rule 2, each one's policy names its
   next victim (`peek`); the one evicted is the least by (the policy's `cross_rank`,
   release order across every group). `cross_rank` is empty for LRU, S3-FIFO, ARC, LFU
   and SLRU (so: least recently released among the candidates) and (level, time, kind) for
   the priority policy. With no quotas this is exactly the inner policy.

A peek is not always free of effects: S3-FIFO's makes, for real, the moves its victim
would make first, so a group peeked but not chosen keeps those moves (the Rust core peeks
the same way: the two agree call for call).

Retention (`set_retention`, the priority policy) set on a member (CACHED, or held since a
hit) goes to its group's policy: at once if CACHED, else kept there for its next release, as
a lone policy keeps it; so the reset a block gets when it goes FREE leaves nothing stale
there. If the block is then cached into another group (new content, another tenant), its
retention comes along. Retention set on a block no group knows waits here and is given to
the policy of the group the block is cached into at its next release.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pagedkv_reference.eviction.base import EvictionPolicy, check_block, check_int

__all__ = ["Quota", "Tenant", "TenantQuotas"]

Tenant = bytes | None

_SHARED = 0  # the shared group's index


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


@dataclass
class _Group:
    policy: EvictionPolicy
    quota: Quota


@dataclass
class _Member:
    """A block a group knows: in its set, or taken out by a hit (kept so that its revival
    goes back to the group whose policy knows its history)."""

    group: int
    tenant: Tenant
    key: bytes
    seq: int  # release order across every group (rule 3's tie-break)
    in_set: bool


class TenantQuotas:
    """Per-tenant caps and reserves: a shared instance of one policy for the tenants
    without a quota, and one instance per tenant with one."""

    def __init__(
        self,
        make_policy: Callable[[], EvictionPolicy],
        quotas: Mapping[Tenant, Quota] | None = None,
    ) -> None:
        self._make = make_policy
        # A dissolved group's slot stays None (indices are the members' `group`).
        self._groups: list[_Group | None] = [_Group(self._new_policy(), Quota())]
        self._own: dict[Tenant, int] = {}  # tenant -> its own group
        self._members: dict[int, _Member] = {}
        self._pending: dict[int, tuple[int, float | None]] = {}  # retention of held blocks
        self._seq = 0
        for t, q in (quotas or {}).items():
            assert self.set_quota(t, q, 0.0) == []

    def _new_policy(self) -> EvictionPolicy:
        p = self._make()
        if len(p):
            raise ValueError("make_policy must return an empty policy")
        return p

    def quota(self, tenant: Tenant) -> Quota:
        g = self._own.get(tenant)
        return Quota() if g is None else self._group(g).quota

    def cached(self, tenant: Tenant) -> int:
        """The tenant's CACHED blocks (in the policies)."""
        return sum(1 for m in self._members.values() if m.in_set and m.tenant == tenant)

    def tenant_of(self, block: int) -> Tenant:
        return self._members[self._member(block)].tenant

    def __len__(self) -> int:
        return sum(len(g.policy) for g in self._live())

    def __contains__(self, block: object) -> bool:
        m = self._members.get(block)  # type: ignore[call-overload]
        return m is not None and m.in_set

    def policy(self, tenant: Tenant) -> EvictionPolicy:
        """The policy of the tenant's group (the shared one while it has no quota)."""
        return self._group(self._group_of(_check_tenant(tenant))).policy

    def entries(self) -> list[tuple[int, bytes]]:
        return [e for g in self._live() for e in g.policy.entries()]

    def _group_of(self, tenant: Tenant) -> int:
        return self._own.get(tenant, _SHARED)

    def set_quota(self, tenant: Tenant, quota: Quota, now: float) -> list[int]:
        """Change a tenant's quota (giving it its own group on the first); returns the
        blocks evicted at once to meet a lower cap."""
        t = _check_tenant(tenant)
        if not isinstance(quota, Quota):
            raise TypeError(f"quota must be a Quota, got {type(quota).__name__}")
        for grp in self._live():
            grp.policy.check_now(now)
        if quota == Quota():
            self._dissolve(t, now)
            return []
        g = self._own_group(t, now)
        self._group(g).quota = quota
        return self._trim(g, now)

    def _live(self) -> list[_Group]:
        return [g for g in self._groups if g is not None]

    def _group(self, g: int) -> _Group:
        grp = self._groups[g]
        assert grp is not None, f"group {g} was dissolved"
        return grp

    def _dissolve(self, tenant: Tenant, now: float) -> None:
        g = self._own.pop(tenant, None)
        if g is None:
            return
        old = self._group(g).policy
        mine = sorted((m.seq, b) for b, m in self._members.items() if m.group == g)
        for _, b in mine:
            m = self._members[b]
            if m.in_set:
                self._move_home(b, now)
            else:
                # Held: a member of the shared group now, with its retention; its history
                # goes with the instance (it comes back as a new block).
                carried = old.carry_out(b, False)
                shared = self._group(_SHARED).policy
                if carried is not None and carried[0] != (35, None):  # type: ignore[index]
                    prio, dur = carried[0]  # type: ignore[index]
                    shared.set_retention(b, prio, dur)  # type: ignore[attr-defined]
                m.group = _SHARED
        assert not len(old), "every cached block moved"
        self._groups[g] = None

    def _own_group(self, tenant: Tenant, now: float) -> int:
        g = self._own.get(tenant)
        if g is not None:
            return g
        g = len(self._groups)
        self._groups.append(_Group(self._new_policy(), Quota()))
        self._own[tenant] = g
        # Its CACHED blocks move in release order; its held ones stay members of the shared
        # group (whose policy knows their history) until they come back.
        moving = sorted(
            (m.seq, b)
            for b, m in self._members.items()
            if m.tenant == tenant and m.group == _SHARED and m.in_set
        )
        for _, b in moving:
            self._move_home(b, now)
        return g

    def _move_home(self, block: int, now: float) -> None:
        """Move the member `block`, in the set, to its tenant's group with what its policy
        carries (priority: retention and rank); its release order across groups stays."""
        m = self._members[block]
        home = self._group_of(m.tenant)
        if m.group == home:
            return
        carried = self._group(m.group).policy.carry_out(block, True)
        self._group(home).policy.carry_in(block, now, m.key, carried)
        m.group = home

    def set_retention(
        self, block: int, priority: int, duration_s: float | None, now: float
    ) -> None:
        """Give `block` a retention (the priority policy): at once if it is CACHED, else
        from its next release. A member's (cached, or held since a hit) is its group's
        policy's to keep, as a lone policy keeps it; another block's waits here."""
        b = check_block(block)
        m = self._members.get(b)
        if m is not None:
            p = self._group(m.group).policy
            p.set_retention(b, priority, duration_s, now=now)  # type: ignore[attr-defined]
        elif (priority, duration_s) == (35, None):
            self._pending.pop(b, None)
        else:
            self._pending[b] = (priority, duration_s)

    def on_cached(self, block: int, now: float, key: bytes, tenant: Tenant = None) -> list[int]:
        """`block` of `tenant` became CACHED; returns the blocks of its group evicted at once
        to keep its cap (rule 1), which the manager must free."""
        t = _check_tenant(tenant)
        b = check_block(block)
        if b in self:
            raise ValueError(f"block {b} is already cached")
        home = self._group_of(t)
        m = self._members.get(b)
        # Both policies this may tick (a block held since before its tenant's first quota
        # comes back to its old group, then moves home) check the time first.
        for g in {home} if m is None or m.in_set else {home, m.group}:
            self._group(g).policy.check_now(now)
        r = self._pending.pop(b, None)
        if m is not None and not m.in_set and m.key == key:
            # A revival goes back to the group it left (whose policy knows its history),
            # and moves on from there if its tenant got its own group meanwhile.
            assert r is None, "a member's retention is its group's"
            self._group(m.group).policy.on_cached(b, now, key)
            self._members[b] = _Member(m.group, t, key, self._seq, True)
            self._seq += 1
            self._move_home(b, now)
            return self._trim(home, now)
        p = self._group(home).policy
        if m is not None and not m.in_set and m.group != home:
            # New content in a block held since its last release: the retention its holder
            # gave it waits in its old group's policy, and comes along.
            assert r is None, "a member's retention is its group's"
            carried = self._group(m.group).policy.carry_out(b, False)
            if carried is not None:
                carried = (carried[0], None)  # type: ignore[index]
            p.carry_in(b, now, key, carried)
        else:
            if r is not None:
                p.set_retention(b, r[0], r[1])  # type: ignore[attr-defined]
            p.on_cached(b, now, key)
        self._members[b] = _Member(home, t, key, self._seq, True)
        self._seq += 1
        return self._trim(home, now)

    def on_hit(self, block: int, now: float) -> None:
        m = self._members[self._member(block)]
        self._group(m.group).policy.on_hit(block, now)
        m.in_set = False

    def on_removed(self, block: int) -> None:
        b = self._member(block)
        m = self._members.pop(b)
        self._group(m.group).policy.on_removed(b)

    def on_miss(self, key: bytes, now: float) -> None:
        for g in self._live():
            g.policy.on_miss(key, now)

    def victim(self, now: float) -> int | None:
        """The next block to evict under rules 2 and 3, or None."""
        for g in self._live():
            g.policy.check_now(now)  # a clock that goes back raises before any peek
        best: tuple[tuple[bool, tuple[float, ...], int], int] | None = None
        for i, maybe in enumerate(self._groups):
            if maybe is None or not len(maybe.policy):
                continue
            b = maybe.policy.peek(now)
            if b is None:
                continue
            below = len(maybe.policy) <= maybe.quota.reserved
            rank = (below, maybe.policy.cross_rank(b, now), self._members[b].seq)
            if best is None or rank < best[0]:
                best = (rank, i)
        if best is None:
            return None
        for i, other in enumerate(self._groups):
            if other is not None and i != best[1] and len(other.policy):
                other.policy.passed_over()  # its peek binds no later call
        b = self._group(best[1]).policy.victim(now)
        assert b is not None
        del self._members[b]
        return b

    def clear(self) -> None:
        """Forget every block (a reset): fresh instances, the groups and quotas kept."""
        self._members.clear()
        self._pending.clear()
        for g in self._live():
            g.policy = self._new_policy()

    def _trim(self, g: int, now: float) -> list[int]:
        cap = self._group(g).quota.cap
        p = self._group(g).policy
        out: list[int] = []
        while cap is not None and len(p) > cap:
            b = p.victim(now)
            if b is None:
                break
            del self._members[b]
            out.append(b)
        return out

    def _member(self, block: object) -> int:
        b = check_block(block)
        if b not in self:
            raise ValueError(f"block {b} is not cached (not in the evictable set)")
        return b
