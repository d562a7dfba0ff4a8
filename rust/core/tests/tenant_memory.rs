//! A tenant's quota costs what the tenant holds, not the pool (issue 32, item 9): at 1 Mi
//! blocks each tenant given a quota got a policy instance with tables for every block (64 to
//! 72 MiB), never freed. Measured two ways: the bytes the process allocates (a counting
//! allocator: everything `set_tenant_quota` keeps) and the instance's own table bytes.
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, EvictionKind, Quota};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// Bytes allocated and not yet freed, by the whole test binary.
static LIVE: AtomicIsize = AtomicIsize::new(0);

struct Counting;

// SAFETY: every call forwards to the system allocator with the caller's layout; the
// counter is only a tally beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // Relaxed: a tally read by the single-threaded test between calls.
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: the caller's layout, as `GlobalAlloc::alloc` requires.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: `ptr` came from `alloc` above with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

const BLOCKS: u32 = 1 << 20;
const B: usize = 16;

#[test]
fn a_quota_costs_what_its_tenant_holds_and_goes_with_it() {
    for kind in [
        EvictionKind::Priority,
        EvictionKind::Lru,
        EvictionKind::S3Fifo,
    ] {
        let mut c = Config::new(BLOCKS, B);
        c.eviction = kind;
        c.tenants = true;
        let m = BlockManager::new(c).unwrap();
        let cap = Quota {
            max_cached: Some(1000),
            reserved: 0,
        };
        // A prompt of the tenant, cached, so the registry knows it before the measure.
        let prompt: Vec<u32> = (0..64 * B as u32 + 1).collect();
        m.allocate(1, &prompt, Some(b"a"), None, 0)
            .unwrap()
            .unwrap();
        m.free(1).unwrap();
        let before = live();
        m.set_tenant_quota(Some(b"a"), cap).unwrap();
        let quota = live() - before;
        // 64 blocks moved into the instance: a few hundred bytes each at most.
        assert!(
            quota < 64 * 1024,
            "{kind:?}: a first quota kept {quota} bytes"
        );
        let tables = m.tenant_policy_bytes(Some(b"a")).unwrap().unwrap();
        assert!(tables < 64 * 512, "{kind:?}: tables of {tables} bytes");
        // More blocks of the tenant: the tables grow with them.
        for i in 0..8u32 {
            let p: Vec<u32> = (0..64 * B as u32 + 1)
                .map(|t| t + 100_000 * (i + 1))
                .collect();
            m.allocate(2, &p, Some(b"a"), None, 0).unwrap().unwrap();
            m.free(2).unwrap();
        }
        let grown = m.tenant_policy_bytes(Some(b"a")).unwrap().unwrap();
        assert!(
            grown > tables && grown < 9 * 64 * 512,
            "{kind:?}: {tables} -> {grown}"
        );
        // No quota: the instance goes, and so do its bytes (the blocks stay cached).
        let held = live();
        m.set_tenant_quota(Some(b"a"), Quota::default()).unwrap();
        assert_eq!(m.tenant_policy_bytes(Some(b"a")).unwrap(), None);
        assert!(live() < held, "{kind:?}: nothing freed with the quota");
        m.check_invariants().unwrap();
    }
}

/// Issue 32, item 10: every salt ever seen stayed in the registry (about 175 bytes each).
/// Now a tenant with no sequence, no CACHED block and no quota leaves, so many short-lived
/// salts leave a registry the size of the ones still present.
#[test]
fn the_registry_shrinks_back_after_many_short_lived_salts() {
    let mut c = Config::new(256, 4);
    c.tenants = true;
    let m = BlockManager::new(c).unwrap();
    let (n0, bytes0) = m.tenant_registry_size().unwrap();
    assert_eq!(n0, 1, "the unsalted tenant");
    let mut peak = 0;
    for i in 0..100_000u32 {
        let salt = format!("salt-{i}").into_bytes();
        let prompt: Vec<u32> = (0..9).map(|t| t + 10 * i).collect();
        m.allocate(u64::from(i), &prompt, Some(&salt), None, 0)
            .unwrap()
            .unwrap();
        m.free(u64::from(i)).unwrap();
        peak = peak.max(m.tenant_registry_size().unwrap().0);
    }
    // 256 blocks hold the cached blocks of at most 128 salts (two full blocks each).
    let (n, bytes) = m.tenant_registry_size().unwrap();
    assert!(
        peak <= 129 && n <= 129,
        "{n} tenants present, {peak} at most"
    );
    assert!(bytes < bytes0 + 64 * 1024, "{bytes} bytes (from {bytes0})");
    assert!(m.reset_prefix_cache().unwrap());
    assert_eq!(
        m.tenant_registry_size().unwrap().0,
        1,
        "nothing cached: only unsalted"
    );
    assert_eq!(m.tenant_stats().unwrap().len(), 1);
    m.check_invariants().unwrap();
}
