//! Tenants: requests grouped by cache salt (one more tenant for requests without one), with
//! optional quotas over their CACHED blocks and statistics per tenant (`tenants=True`).
//!
//! - `registry`: salt -> tenant id, and each tenant's counters (prefix queries and hits).
//! - `quotas`: the eviction policy wrapper that enforces caps and reserves across tenants.
//! - `calls`: the manager's calls (`set_tenant_quota`, `tenant_stats`).
//!
//! A block's tenant is the tenant of the sequence that registered it: a prefix hit needs the
//! same salt, so every holder of a hashed block is of that tenant.

mod calls;
pub mod quotas;
pub mod registry;

pub use calls::TenantStats;

/// The tenant of requests without a cache salt.
pub const UNSALTED: u32 = 0;

/// A tenant's quota over its CACHED blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Quota {
    /// At most this many CACHED blocks after every call (pinned ones excepted); None: no cap.
    pub max_cached: Option<usize>,
    /// CACHED blocks other tenants' evictions leave alone while any other tenant has an
    /// evictable block above its own reserve.
    pub reserved: usize,
}
