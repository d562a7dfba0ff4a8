//! The manager's tenant calls: quotas and per-tenant statistics (`tenants=True`).

use super::{Quota, UNSALTED};
use crate::error::{invalid, Result};
use crate::manager::BlockManager;
use crate::seq_map::lock_cell;
use crate::sync::Ordering;
use std::collections::HashSet;
use std::sync::Arc;

/// One tenant's share of the cache, a snapshot (exact when no call is in flight).
#[derive(Debug, Clone, PartialEq)]
pub struct TenantStats {
    /// The cache salt; None for requests without one.
    pub salt: Option<Arc<[u8]>>,
    /// Distinct GPU blocks its live sequences hold.
    pub held_blocks: usize,
    /// Its CACHED blocks (pinned ones included).
    pub cached_blocks: usize,
    /// Prompt tokens of its successful allocations, and of those the ones found cached.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub quota: Quota,
}

impl BlockManager {
    /// The tenant registry, or an error naming the missing option.
    fn registry(&self) -> Result<&super::registry::Registry> {
        self.tenants
            .as_ref()
            .ok_or_else(|| invalid("tenant quotas and statistics need tenants=True"))
    }

    /// Set the quota of `salt`'s tenant (None: requests without a salt). A cap below the
    /// tenant's CACHED blocks evicts its own blocks at once (its policy's victims).
    pub fn set_tenant_quota(&self, salt: Option<&[u8]>, quota: Quota) -> Result<()> {
        let registry = self.registry()?;
        if let Some(cap) = quota.max_cached {
            if quota.reserved > cap {
                return Err(invalid(format!(
                    "reserved {} is above max_cached {cap}",
                    quota.reserved
                )));
            }
        }
        self.guarded(true, || {
            let _gate = self.enter()?;
            let id = registry.id(salt);
            // The policy first: if the tenant's own policy does not fit (`OutOfMemory`), the
            // quota it reports stays the old one, as the policy's does.
            self.gpu.set_quota(id, quota)?;
            registry.set_quota(id, quota);
            Ok(())
        })
    }

    /// The heap bytes of the per-block tables of `salt`'s tenant's own policy instance, if
    /// it has one (a quota): tests and benchmarks check it grows with what the tenant holds,
    /// not with the pool.
    pub fn tenant_policy_bytes(&self, salt: Option<&[u8]>) -> Result<Option<usize>> {
        let registry = self.registry()?;
        let Some(id) = registry.find(salt) else {
            return Ok(None);
        };
        Ok(self.gpu.tenant_policy_bytes(id))
    }

    /// Every tenant seen so far, unsalted first, then in order of first use.
    pub fn tenant_stats(&self) -> Result<Vec<TenantStats>> {
        let registry = self.registry()?;
        let tenants = registry.all();
        let mut held: Vec<HashSet<u32>> = vec![HashSet::new(); tenants.len()];
        for (_, cell) in self.seqs.cells() {
            let Ok(seq) = lock_cell(&cell) else { continue };
            if !cell.is_live() {
                continue;
            }
            if let Some(set) = held.get_mut(seq.tenant() as usize) {
                set.extend(self.held_entries(&seq));
            }
        }
        let cached = self.gpu.cached_by_tenant(tenants.len());
        Ok(tenants
            .iter()
            .enumerate()
            .map(|(id, t)| TenantStats {
                salt: t.salt.clone(),
                held_blocks: held[id].len(),
                cached_blocks: cached[id],
                // Relaxed: tallies.
                prefix_queries: t.counters.prefix_queries.load(Ordering::Relaxed),
                prefix_hits: t.counters.prefix_hits.load(Ordering::Relaxed),
                quota: registry.quota(id as u32),
            })
            .collect())
    }

    /// The tenant id of a new sequence with `salt` (UNSALTED without tenants).
    pub(crate) fn tenant_of(&self, salt: Option<&[u8]>) -> u32 {
        self.tenants.as_ref().map_or(UNSALTED, |r| r.id(salt))
    }

    /// Count a successful allocation for its tenant.
    pub(crate) fn record_tenant_hits(&self, tenant: u32, queries: usize, hits: usize) {
        if let Some(r) = &self.tenants {
            r.record(tenant, queries, hits);
        }
    }
}
