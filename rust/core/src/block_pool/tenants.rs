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
        let freed = self.drop_trimmed(&trimmed)?;
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
    /// index entry and a `BlockRemoved`, counted as an eviction. Returns them for the free
    /// stack; their units stay in `available` (CACHED and FREE both count). A trim is not
    /// a device duty: the block goes FREE at once, so nobody may copy it out (a copy could
    /// race its next owner's writes); its KV is dropped.
    pub(super) fn drop_trimmed(&self, trimmed: &[Entry]) -> Result<Vec<u32>> {
        let mut freed = Vec::with_capacity(trimmed.len());
        for e in trimmed {
            if !self.claim_record(e, 0, true) {
                return Err(out_of_step("trimmed", e.block));
            }
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
        for &e in cached {
            policy.cached_by(e, self.tenant_of(e.block), &mut trimmed);
        }
        self.drop_trimmed(&trimmed)
    }
}
