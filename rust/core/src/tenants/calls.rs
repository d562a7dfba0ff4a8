//! The manager's tenant calls: quotas and per-tenant statistics (`tenants=True`), and the
//! refs a call or a sequence holds on its tenant (`registry`).

use super::registry::Registry;
use super::{Quota, UNSALTED};
use crate::error::{invalid, Result};
use crate::manager::BlockManager;
use crate::seq_map::lock_cell;
use std::cell::Cell;
use std::collections::HashMap;
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
    /// Prompt tokens of its successful allocations, and of those the ones found cached
    /// (since the tenant last entered the registry).
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub quota: Quota,
}

/// A ref on a tenant for a call that may create a sequence of it: taken before the call's
/// first hit, so the tenant cannot leave (and its id go to another salt) meanwhile; given
/// back when dropped unless the sequence keeps it (`keep`).
pub(crate) struct TenantHold<'a> {
    registry: Option<&'a Registry>,
    id: u32,
    kept: Cell<bool>,
}

impl TenantHold<'_> {
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// The sequence now holds the ref (`drop_sequence` gives it back).
    pub(crate) fn keep(&self) {
        self.kept.set(true);
    }
}

impl Drop for TenantHold<'_> {
    fn drop(&mut self) {
        if let (Some(r), false) = (self.registry, self.kept.get()) {
            r.release(self.id);
        }
    }
}

impl BlockManager {
    /// The tenant registry, or an error naming the missing option.
    fn registry(&self) -> Result<&Registry> {
        self.tenants
            .as_deref()
            .ok_or_else(|| invalid("tenant quotas and statistics need tenants=True"))
    }

    /// Set the quota of `salt`'s tenant (None: requests without a salt; `Quota::default()`:
    /// no quota). A cap below the tenant's CACHED blocks evicts its own blocks at once (its
    /// policy's victims). Holds a ref on the tenant for the call, so a refused call leaves
    /// no entry for a salt that had none, and a quota removed from a tenant with nothing
    /// else lets it leave.
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
            let hold = self.hold_tenant(salt);
            // The policy first: if it refuses, the quota the registry reports stays the old
            // one, as the policy's does.
            self.gpu.set_quota(hold.id(), quota)?;
            registry.set_quota(hold.id(), quota);
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

    /// Tenants in the registry (the unsalted one included) and its heap bytes: tests and
    /// benchmarks check it shrinks back when salts stop being used.
    pub fn tenant_registry_size(&self) -> Result<(usize, usize)> {
        let registry = self.registry()?;
        Ok((registry.len(), registry.bytes()))
    }

    /// Every tenant present (with a live sequence, a CACHED block or a quota), unsalted
    /// first, then in the order they (last) entered the registry.
    ///
    /// Never stalls other calls for long: the registry is copied a chunk at a time, the
    /// counters are read without a lock, each live sequence is locked only while its blocks
    /// are copied, and the counting and sorting happen with no lock held. A snapshot, exact
    /// when no call is in flight.
    pub fn tenant_stats(&self) -> Result<Vec<TenantStats>> {
        let registry = self.registry()?;
        let mut rows = registry.rows();
        // (tenant, block) of every live sequence's held blocks, then distinct per tenant.
        let mut held: Vec<(u32, u32)> = Vec::new();
        for (_, cell) in self.seqs.cells() {
            let Ok(seq) = lock_cell(&cell) else { continue };
            if !cell.is_live() {
                continue;
            }
            let t = seq.tenant();
            held.extend(self.held_entries(&seq).map(|b| (t, b)));
        }
        held.sort_unstable();
        held.dedup();
        let mut held_by: HashMap<u32, usize> = HashMap::new();
        for (t, _) in held {
            *held_by.entry(t).or_default() += 1;
        }
        rows.sort_unstable_by_key(|r| r.order);
        Ok(rows
            .into_iter()
            .map(|r| {
                let c = registry.counts(r.id);
                TenantStats {
                    salt: r.salt,
                    held_blocks: held_by.get(&r.id).copied().unwrap_or(0),
                    cached_blocks: c.cached,
                    prefix_queries: c.prefix_queries,
                    prefix_hits: c.prefix_hits,
                    quota: r.quota,
                }
            })
            .collect())
    }

    /// `check_invariants`' part: the registry's counts against the pool's blocks, and every
    /// tenant named by a CACHED block or a live sequence (`seq_tenants`) present.
    pub(crate) fn audit_tenants(&self, seq_tenants: impl Iterator<Item = u32>) -> Result<()> {
        use crate::error::ensure_invariant as ensure;
        let Some(registry) = self.tenants.as_deref() else {
            return Ok(());
        };
        let rows = registry.rows();
        let present: HashMap<u32, ()> = rows.iter().map(|r| (r.id, ())).collect();
        let mut scan = self.gpu.cached_by_tenant_scan();
        for r in &rows {
            let pool = scan.remove(&r.id).unwrap_or(0);
            let counted = registry.counts(r.id).cached;
            ensure!(
                counted == pool,
                "tenant {} counts {counted} CACHED blocks, the pool has {pool}",
                r.id
            );
        }
        ensure!(
            scan.is_empty(),
            "CACHED blocks of tenants not in the registry: {scan:?}"
        );
        for t in seq_tenants {
            ensure!(
                present.contains_key(&t),
                "a live sequence's tenant {t} is not in the registry"
            );
        }
        Ok(())
    }

    /// A ref on `salt`'s tenant for a call that may create a sequence of it (the unsalted
    /// tenant, or none without tenants: nothing held).
    pub(crate) fn hold_tenant(&self, salt: Option<&[u8]>) -> TenantHold<'_> {
        let registry = self.tenants.as_deref().filter(|_| salt.is_some());
        TenantHold {
            registry,
            id: registry.map_or(UNSALTED, |r| r.acquire(salt)),
            kept: Cell::new(false),
        }
    }

    /// One more ref on a live sequence's tenant, for a fork's child.
    pub(crate) fn retain_tenant(&self, tenant: u32) {
        if let Some(r) = &self.tenants {
            r.retain(tenant);
        }
    }

    /// A freed sequence gives its tenant's ref back (after its blocks were released).
    pub(crate) fn release_tenant(&self, tenant: u32) {
        if let Some(r) = &self.tenants {
            r.release(tenant);
        }
    }

    /// Count a successful allocation for its tenant.
    pub(crate) fn record_tenant_hits(&self, tenant: u32, queries: usize, hits: usize) {
        if let Some(r) = &self.tenants {
            r.record(tenant, queries, hits);
        }
    }
}
