//! Tenants that come and go under threads, without a GIL between the calls (issue 32, item
//! 10): a tenant with nothing left leaves the registry and its id goes to the next new salt,
//! so ids are reused all the time here. Workers allocate (with hits), fork and free prompts
//! of a few salts on a small pool (evictions take other tenants' last blocks), while another
//! thread sets and removes quotas and reads `tenant_stats`. A reused id named by a block or
//! a sequence of another salt would show in the audit (the registry's per-tenant CACHED
//! counts against the pool's blocks, every live sequence's and CACHED block's tenant present)
//! or as a panic on an id that no longer exists.
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, EvictionKind, Quota};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

const BLOCK: usize = 4;
const THREADS: u64 = 6;
const SALTS: u64 = 10;

fn salt(k: u64) -> Vec<u8> {
    format!("churn-{k}").into_bytes()
}

/// At least `ops` steps, and on until the admin thread is done (`stop`).
fn worker(m: &BlockManager, thread: u64, ops: usize, stop: &AtomicBool) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((thread + 1) * 0x2545_f491));
    let mut live: Vec<u64> = Vec::new();
    let mut next = thread << 40;
    let mut step = 0;
    while step < ops || !stop.load(Ordering::Relaxed) {
        step += 1;
        let r = rng.below(10);
        if live.len() < 3 && r < 6 {
            let k = rng.below(SALTS);
            // A prefix per salt (hits), and a tail of its own.
            let mut prompt: Vec<u32> = (0..3 * BLOCK as u32).map(|t| t + 1000 * k as u32).collect();
            prompt.extend((0..1 + rng.below(3 * BLOCK as u64)).map(|_| rng.below(50) as u32));
            next += 1;
            if m.allocate(next, &prompt, Some(&salt(k)), None, 0)
                .unwrap()
                .is_some()
            {
                live.push(next);
            }
        } else if r < 7 && !live.is_empty() && live.len() < 4 {
            let parent = live[rng.below(live.len() as u64) as usize];
            next += 1;
            if m.fork(parent, next).is_ok() {
                live.push(next);
            }
        } else if !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            m.free(live.swap_remove(i)).unwrap();
        }
    }
    for id in live {
        m.free(id).unwrap();
    }
}

#[test]
fn tenant_ids_reused_under_threads_never_name_another_salt() {
    for kind in [
        EvictionKind::Lru,
        EvictionKind::Priority,
        EvictionKind::S3Fifo,
    ] {
        let config = Config {
            eviction: kind,
            tenants: true,
            ..Config::new(48, BLOCK)
        };
        let m = Arc::new(BlockManager::new(config).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let admin = {
            let (m, stop) = (m.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(11);
                let mut reads = 0;
                while reads < 300 {
                    let k = rng.below(SALTS + 3);
                    let quota = match rng.below(3) {
                        0 => Quota::default(),
                        n => Quota {
                            max_cached: Some(2 * n as usize),
                            reserved: rng.below(2) as usize,
                        },
                    };
                    m.set_tenant_quota(Some(&salt(k)), quota).unwrap();
                    let stats = m.tenant_stats().unwrap();
                    let salts: HashSet<_> = stats.iter().map(|t| t.salt.clone()).collect();
                    assert_eq!(salts.len(), stats.len(), "{kind:?}: a salt listed twice");
                    assert_eq!(stats[0].salt, None, "{kind:?}: unsalted first");
                    reads += 1;
                    std::thread::yield_now();
                }
                // No quota left: only tenants with blocks stay.
                for k in 0..SALTS + 3 {
                    m.set_tenant_quota(Some(&salt(k)), Quota::default())
                        .unwrap();
                }
                stop.store(true, Ordering::Relaxed);
                reads
            })
        };
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (m, stop) = (m.clone(), stop.clone());
                std::thread::spawn(move || worker(&m, t, 2000, &stop))
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        let reads = admin.join().unwrap();
        assert_eq!(reads, 300, "{kind:?}");
        m.check_invariants().unwrap();
        let stats = m.stats();
        assert!(stats.prefix_hits > 0 && stats.evictions > 0, "{kind:?}");
        let tenants = m.tenant_stats().unwrap();
        assert_eq!(
            m.tenant_registry_size().unwrap().0,
            tenants.len(),
            "{kind:?}"
        );
        for t in &tenants[1..] {
            assert!(t.cached_blocks > 0, "{kind:?}: {:?} has nothing", t.salt);
            assert_eq!(t.held_blocks, 0, "{kind:?}");
        }
        let cached: usize = tenants.iter().map(|t| t.cached_blocks).sum();
        assert_eq!(cached, stats.cached_blocks, "{kind:?}");
        assert!(m.reset_prefix_cache().unwrap());
        assert_eq!(m.tenant_stats().unwrap().len(), 1, "{kind:?}");
    }
}
