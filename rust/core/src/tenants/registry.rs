//! Tenant ids: one per distinct cache salt seen (id `UNSALTED` for none), given out in
//! order of first use and never reused, with each tenant's prefix counters.

use super::{Quota, UNSALTED};
use crate::sync::{lock, AtomicU64, Mutex, Ordering};
use std::collections::HashMap;
use std::sync::Arc;

/// One tenant's counters. Relaxed: tallies, each read on its own.
#[derive(Default)]
pub struct TenantCounters {
    /// Prompt tokens looked up (successful allocations).
    pub prefix_queries: AtomicU64,
    /// Of those, tokens found cached.
    pub prefix_hits: AtomicU64,
}

pub struct Tenant {
    /// None for `UNSALTED`.
    pub salt: Option<Arc<[u8]>>,
    pub counters: TenantCounters,
}

#[derive(Default)]
struct Inner {
    /// Salt -> id, for every salted tenant seen.
    ids: HashMap<Arc<[u8]>, u32>,
    /// By id: `tenants[UNSALTED]` always exists.
    tenants: Vec<Arc<Tenant>>,
    /// Quotas set so far, by id (what `tenant_stats` reports; the policy enforces them).
    quotas: HashMap<u32, Quota>,
}

/// Under one short lock, taken once per allocation of a manager with tenants.
pub struct Registry {
    inner: Mutex<Inner>,
}

impl Default for Registry {
    fn default() -> Self {
        let unsalted = Arc::new(Tenant {
            salt: None,
            counters: TenantCounters::default(),
        });
        Self {
            inner: Mutex::new(Inner {
                tenants: vec![unsalted],
                ..Inner::default()
            }),
        }
    }
}

impl Registry {
    /// The id of `salt`'s tenant, made on first use.
    pub fn id(&self, salt: Option<&[u8]>) -> u32 {
        let Some(salt) = salt else {
            return UNSALTED;
        };
        let mut inner = lock(&self.inner);
        if let Some(&id) = inner.ids.get(salt) {
            return id;
        }
        let id = inner.tenants.len() as u32;
        let salt: Arc<[u8]> = salt.into();
        inner.tenants.push(Arc::new(Tenant {
            salt: Some(salt.clone()),
            counters: TenantCounters::default(),
        }));
        inner.ids.insert(salt, id);
        id
    }

    /// The id of `salt`'s tenant, if it has one (nothing made).
    pub fn find(&self, salt: Option<&[u8]>) -> Option<u32> {
        match salt {
            None => Some(UNSALTED),
            Some(s) => lock(&self.inner).ids.get(s).copied(),
        }
    }

    pub fn tenant(&self, id: u32) -> Arc<Tenant> {
        lock(&self.inner).tenants[id as usize].clone()
    }

    /// Count a successful allocation of `queries` prompt tokens, `hits` of them cached.
    pub fn record(&self, id: u32, queries: usize, hits: usize) {
        let t = self.tenant(id);
        // Relaxed: tallies.
        t.counters
            .prefix_queries
            .fetch_add(queries as u64, Ordering::Relaxed);
        t.counters
            .prefix_hits
            .fetch_add(hits as u64, Ordering::Relaxed);
    }

    /// `Quota::default()` (no cap, no reserve) means no quota.
    pub fn set_quota(&self, id: u32, quota: Quota) {
        let mut inner = lock(&self.inner);
        if quota == Quota::default() {
            inner.quotas.remove(&id);
        } else {
            inner.quotas.insert(id, quota);
        }
    }

    pub fn quota(&self, id: u32) -> Quota {
        lock(&self.inner)
            .quotas
            .get(&id)
            .copied()
            .unwrap_or_default()
    }

    /// Every tenant, by id.
    pub fn all(&self) -> Vec<Arc<Tenant>> {
        lock(&self.inner).tenants.clone()
    }
}
