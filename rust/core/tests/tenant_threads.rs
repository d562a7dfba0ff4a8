//! Tenant quotas under threads, without a GIL between the calls: workers allocate and free
//! prompts of many tenants on a small pool (calls fail after their hits and give the hit
//! blocks back), while another thread gives tenants their first quotas and changes caps.
//! A first quota, or another release of the same tenant, may come between a call's hits
//! and its restore (they take the policy lock separately). Afterwards the audit passes,
//! every cap holds, and the tenants' counts add up.
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, EvictionKind, Quota};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

const BLOCK: usize = 4;
const THREADS: u64 = 8;

/// Tenants `epoch - 3 ..= epoch` are the ones allocating: the quota thread moves `epoch` on
/// after each first quota, so every tenant gets its first one while it has cached and held
/// blocks.
fn salt(k: usize) -> Vec<u8> {
    format!("tenant-{k}").into_bytes()
}

fn worker(m: &BlockManager, thread: u64, ops: usize, epoch: &AtomicUsize) {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ ((thread + 1) * 0x9e37_79b9));
    let mut live: Vec<u64> = Vec::new();
    let mut next_id = thread << 32;
    for _ in 0..ops {
        if live.len() < 2 && rng.below(10) < 7 {
            let k = epoch
                .load(Ordering::Relaxed)
                .saturating_sub(rng.below(4) as usize);
            // Two system prompts per tenant, and a tail long enough that calls often fail.
            let system = 100 * rng.below(2) as u32;
            let mut prompt: Vec<u32> = (0..6 * BLOCK as u32).map(|t| t + system).collect();
            prompt.extend((0..1 + rng.below(6 * BLOCK as u64)).map(|_| rng.below(4) as u32));
            next_id += 1;
            if m.allocate(next_id, &prompt, Some(&salt(k)), None, 0)
                .unwrap()
                .is_some()
            {
                live.push(next_id);
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
fn first_quotas_and_cap_changes_race_hits_and_restores() {
    for kind in EvictionKind::ALL {
        let config = Config {
            eviction: kind,
            tenants: true,
            ..Config::new(40, BLOCK)
        };
        let m = Arc::new(BlockManager::new(config).unwrap());
        let epoch = Arc::new(AtomicUsize::new(3));
        let stop = Arc::new(AtomicBool::new(false));
        let quotas = {
            let (m, epoch, stop) = (m.clone(), epoch.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(7);
                let mut firsts = 0;
                while !stop.load(Ordering::Relaxed) {
                    let k = epoch.load(Ordering::Relaxed);
                    let cap = [None, Some(2), Some(4)][rng.below(3) as usize];
                    let quota = Quota {
                        max_cached: cap,
                        reserved: 0,
                    };
                    m.set_tenant_quota(Some(&salt(k - 3)), quota).unwrap();
                    firsts += 1;
                    // The caps of the tenants that have one, lowered and raised.
                    let lower = Quota {
                        max_cached: Some(rng.below(4) as usize),
                        reserved: 0,
                    };
                    m.set_tenant_quota(
                        Some(&salt(k.saturating_sub(3 + rng.below(3) as usize))),
                        lower,
                    )
                    .unwrap();
                    epoch.fetch_add(1, Ordering::Relaxed);
                    std::thread::yield_now();
                }
                firsts
            })
        };
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (m, epoch) = (m.clone(), epoch.clone());
                std::thread::spawn(move || worker(&m, t, 3000, &epoch))
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let firsts = quotas.join().unwrap();
        assert!(firsts > 10, "{kind:?}: only {firsts} first quotas");
        m.check_invariants().unwrap();
        let stats = m.stats();
        assert!(stats.prefix_hits > 0 && stats.evictions > 0, "{kind:?}");
        let tenants = m.tenant_stats().unwrap();
        for t in &tenants {
            if let Some(cap) = t.quota.max_cached {
                assert!(
                    t.cached_blocks <= cap,
                    "{kind:?}: {:?} over its cap",
                    t.salt
                );
            }
            assert_eq!(t.held_blocks, 0, "{kind:?}");
        }
        let cached: usize = tenants.iter().map(|t| t.cached_blocks).sum();
        assert_eq!(cached, stats.cached_blocks, "{kind:?}");
    }
}
