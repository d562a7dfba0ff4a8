//! Tenants in the pool: each block's tenant, quotas and the blocks a cap trims.

use super::groups::{down, up64};
use super::BlockPool;
use crate::alloc::try_boxed;
use crate::clock::Clock;
use crate::error::Result;
use crate::eviction::{EvictionKind, Policy};
use crate::eviction_order::{out_of_step, EvictionOrder};
use crate::lru_queue::Entry;
use crate::sync::{AtomicU32, Ordering};
use crate::tenants::registry::Registry;
use crate::tenants::Quota;
use std::sync::Arc;

impl BlockPool {
    /// The same pool, evicting by `kind` (LRU is how `new` builds it); `clock` is the
    /// manager's.
    pub fn with_eviction(
        mut self,
        kind: EvictionKind,
        tenants: Option<Arc<Registry>>,
        clock: &Arc<Clock>,
    ) -> Result<Self> {
        let n = self.num_blocks();
        if let Some(registry) = tenants {
            self.tenant = try_boxed(n, |_| AtomicU32::new(0), "the block tenants")?;
            self.order = EvictionOrder::with_tenants(kind, n, clock)?;
            self.registry = Some(registry);
        } else if kind != EvictionKind::Lru {
            self.order = EvictionOrder::new(kind, n, clock)?;
        }
        Ok(self)
    }

    /// Record the tenant of the sequence about to register `block` (see the field).
    pub fn set_tenant(&self, block: u32, tenant: u32) {
        if let Some(t) = self.tenant.get(block as usize) {
            t.store(tenant, Ordering::Relaxed);
        }
    }

    pub(super) fn tenant_of(&self, block: u32) -> u32 {
        self.tenant
            .get(block as usize)
            .map_or(0, |t| t.load(Ordering::Relaxed))
    }

    /// `block`, of a tenant, entered (`up`) or left CACHED: its tenant's count follows
    /// (`Registry::cached`). Called right at the transition, under the policy's lock where
    /// the transition takes it.
    pub(super) fn count_cached(&self, block: u32, up: bool) {
        if let Some(r) = &self.registry {
            r.cached(self.tenant_of(block), up);
        }
    }

    /// CACHED blocks by tenant id, counted from the block states (the audit checks the
    /// registry's counts against it; exact at quiescence). A scan of the pool: audits only.
    pub fn cached_by_tenant_scan(&self) -> std::collections::HashMap<u32, usize> {
        let mut out = std::collections::HashMap::new();
        if self.registry.is_none() {
            return out;
        }
        for b in 0..self.num_blocks() as u32 {
            if self.state(b).load().is_cached() {
                *out.entry(self.tenant_of(b)).or_default() += 1;
            }
        }
        out
    }

    /// Set `tenant`'s quota in the policy (`Quota::default()`: none); blocks a lower cap
    /// evicts go FREE at once. A tenant's first quota gets its own policy instance, built
    /// here before the policy's lock; a dissolved group's instance is freed after it.
    pub fn set_quota(&self, tenant: u32, quota: Quota) -> Result<()> {
        let mut spare = if quota == Quota::default() {
            None
        } else {
            self.order.new_instance()?
        };
        let Some(mut policy) = self.order.guard() else {
            return Ok(());
        };
        let mut trimmed = Vec::new();
        policy.set_quota(tenant, quota, &mut spare, &mut trimmed)?;
        let mut deltas = TenantDeltas::default();
        let freed = self.drop_trimmed(&trimmed, &mut deltas);
        self.apply_counts(&deltas);
        let freed = freed?;
        drop(policy);
        drop(spare);
        self.free.push_all(&freed);
        Ok(())
    }

    /// The heap bytes of `tenant`'s own policy instance's tables, if it has one.
    pub fn tenant_policy_bytes(&self, tenant: u32) -> Option<usize> {
        self.order.guard()?.tenant_policy_bytes(tenant)
    }

    /// Claim the blocks a quota trimmed (under the policy lock): each goes FREE with its
    /// index entry and a `BlockRemoved`, counted as an eviction and in `deltas` (applied by
    /// the caller, under the same lock). Returns them for the free stack; their units stay
    /// in `available` (CACHED and FREE both count). A trim is not a device duty: the block
    /// goes FREE at once, so nobody may copy it out (a copy could race its next owner's
    /// writes); its KV is dropped.
    pub(super) fn drop_trimmed(
        &self,
        trimmed: &[Entry],
        deltas: &mut TenantDeltas,
    ) -> Result<Vec<u32>> {
        let mut freed = Vec::with_capacity(trimmed.len());
        for e in trimmed {
            // Its tenant before it goes FREE (a next owner rewrites it only after the push).
            let tenant = self.tenant_of(e.block);
            if !self.claim_record_uncounted(e, 0, true) {
                return Err(out_of_step("trimmed", e.block));
            }
            deltas.add(tenant, -1);
            // Relaxed: tallies (see the fields).
            self.cached.fetch_sub(1, Ordering::Relaxed);
            self.evictions.fetch_add(1, Ordering::Relaxed);
            if let Some(t) = self.tally_of(e.block) {
                down(&t.cached);
                up64(&t.evictions);
            }
            freed.push(e.block);
        }
        Ok(freed)
    }

    /// Count, for its tenant, `block` that just became CACHED in the policy (in `deltas`).
    pub(super) fn count_cached_later(&self, deltas: &mut TenantDeltas, block: u32) {
        if self.registry.is_some() {
            deltas.add(self.tenant_of(block), 1);
        }
    }

    /// Apply one locked step's count changes, one per tenant (`TenantDeltas`).
    pub(super) fn apply_counts(&self, deltas: &TenantDeltas) {
        if let Some(r) = &self.registry {
            deltas.for_each(|tenant, d| r.cached_by(tenant, d));
        }
    }

    /// Whether the pool keeps each block's tenant (`tenants=True`).
    pub(super) fn has_tenants(&self) -> bool {
        !self.tenant.is_empty()
    }

    /// Queue the records of blocks that became CACHED in their tenants' policies (under the
    /// policy's lock); returns the blocks the tenants' caps trimmed, FREE now.
    pub(super) fn cache_by_tenants(
        &self,
        policy: &mut Box<dyn Policy>,
        cached: &[Entry],
    ) -> Result<Vec<u32>> {
        let mut trimmed = Vec::new();
        let mut deltas = TenantDeltas::default();
        for &e in cached {
            let tenant = self.tenant_of(e.block);
            deltas.add(tenant, 1);
            policy.cached_by(e, tenant, &mut trimmed);
        }
        // The blocks cached and those trimmed are counted in one step per tenant: a reader
        // of the counts (`tenant_stats`, without the lock) never sees a tenant over its cap.
        let freed = self.drop_trimmed(&trimmed, &mut deltas);
        self.apply_counts(&deltas);
        freed
    }
}

/// How many CACHED blocks each tenant gained or lost in one step under the policy's lock,
/// netted, so that each tenant's count changes once (`Registry::cached_by`). A step's
/// blocks are almost always one tenant's (a sequence's blocks are its own tenant's, and a cap
/// trims its own group), so the first few tenants live inline: nothing allocates under the
/// lock then.
#[derive(Default)]
pub(super) struct TenantDeltas {
    /// The first `len` entries are (tenant, change), each tenant once.
    inline: [(u32, isize); 4],
    len: usize,
    /// Tenants past the inline ones, each once and in none of `inline`.
    more: Vec<(u32, isize)>,
}

impl TenantDeltas {
    pub(super) fn add(&mut self, tenant: u32, change: isize) {
        if let Some(slot) = self.inline[..self.len].iter_mut().find(|s| s.0 == tenant) {
            slot.1 += change;
        } else if self.len < self.inline.len() {
            self.inline[self.len] = (tenant, change);
            self.len += 1;
        } else if let Some(slot) = self.more.iter_mut().find(|s| s.0 == tenant) {
            slot.1 += change;
        } else {
            self.more.push((tenant, change));
        }
    }

    fn for_each(&self, mut f: impl FnMut(u32, isize)) {
        self.inline[..self.len]
            .iter()
            .chain(&self.more)
            .filter(|s| s.1 != 0)
            .for_each(|&(t, d)| f(t, d));
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::TenantDeltas;

    fn collected(d: &TenantDeltas) -> Vec<(u32, isize)> {
        let mut out = Vec::new();
        d.for_each(|t, c| out.push((t, c)));
        out.sort_unstable();
        out
    }

    #[test]
    fn nets_each_tenant_once_at_and_past_the_inline_entries() {
        let mut d = TenantDeltas::default();
        // Four tenants fill the inline entries exactly; the fifth and sixth spill over.
        for t in 0..6u32 {
            d.add(t, 1);
        }
        assert_eq!(d.len, 4);
        assert_eq!(d.more.len(), 2);
        // Changes to inline and spilled tenants net in place, never as a second entry.
        d.add(1, -1);
        d.add(5, 2);
        d.add(5, -1);
        d.add(3, -3);
        assert_eq!(d.len, 4);
        assert_eq!(d.more.len(), 2);
        // Tenant 1 netted to zero: no change to apply.
        assert_eq!(collected(&d), vec![(0, 1), (2, 1), (3, -2), (4, 1), (5, 2)]);
    }

    #[test]
    fn an_empty_step_applies_nothing() {
        assert!(collected(&TenantDeltas::default()).is_empty());
    }
}
