//! Many threads on one hybrid manager (KV-cache groups): shared prefixes, window releases,
//! eviction, forks, truncations and batch steps; afterwards every block is accounted for,
//! every sequence holds the tokens its thread gave it, and a soak of a million operations
//! on a handful of hot blocks keeps every invariant.
#![cfg(not(loom))]

use pagedkv_core::{BlockManager, Config, GroupKind, NULL};
use std::sync::Arc;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

fn kinds() -> Vec<GroupKind> {
    vec![
        GroupKind::Full,
        GroupKind::SlidingWindow { window: 8 },
        GroupKind::ChunkedLocal { chunk: 8 },
        GroupKind::State,
    ]
}

/// Random calls on the thread's own sequences; returns them with the tokens they hold.
fn worker(m: &BlockManager, thread: u64, ops: usize) -> Vec<(u64, Vec<u32>)> {
    let mut rng = Rng(0x9e37_79b9 + thread);
    let mut live: Vec<(u64, Vec<u32>)> = Vec::new();
    let mut next_id = thread << 32;
    for _ in 0..ops {
        let pick = (!live.is_empty()).then(|| rng.below(live.len() as u64) as usize);
        match (rng.below(10), pick) {
            (0..=2, _) | (_, None) => {
                let mut prompt: Vec<u32> = (0..4 * (1 + rng.below(4) as u32)).collect();
                prompt.extend((0..1 + rng.below(9)).map(|_| rng.below(40) as u32));
                next_id += 1;
                let mut t = prompt.clone();
                if m.allocate_from(next_id, &mut t, None, None, None, 0)
                    .unwrap()
                    .is_some()
                {
                    live.push((next_id, prompt));
                }
            }
            (3..=5, Some(_)) => {
                let ids: Vec<u64> = live.iter().map(|s| s.0).collect();
                let toks: Vec<u32> = ids.iter().map(|_| rng.below(40) as u32).collect();
                if m.append_batch_lookahead(&ids, &toks, 0).unwrap().is_some() {
                    live.iter_mut().zip(&toks).for_each(|(s, &t)| s.1.push(t));
                }
            }
            (6, Some(i)) => {
                next_id += 1;
                m.fork(live[i].0, next_id).unwrap();
                let tokens = live[i].1.clone();
                live.push((next_id, tokens));
            }
            (7, Some(i)) => {
                // Drop only tokens the window still covers (a state rolls back to boundaries).
                let n = live[i].1.len();
                let m_to = n.saturating_sub(rng.below(2) as usize).max(1);
                if m.truncate(live[i].0, m_to).is_ok_and(|r| r.is_some()) {
                    live[i].1.truncate(m_to);
                }
            }
            (_, Some(i)) => {
                let (id, _) = live.swap_remove(i);
                m.free_computed(id, None).unwrap();
            }
        }
    }
    live
}

#[test]
fn threads_on_one_hybrid_manager_lose_nothing() {
    let mut c = Config::new(96, 4);
    c.enable_kv_events = true;
    let m = Arc::new(BlockManager::with_groups(c, kinds()).unwrap());
    let handles: Vec<_> = (0..8)
        .map(|t| {
            let m = Arc::clone(&m);
            std::thread::spawn(move || worker(&m, t, 1500))
        })
        .collect();
    let survivors: Vec<(u64, Vec<u32>)> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    m.check_invariants().unwrap();
    for (id, tokens) in &survivors {
        assert_eq!(m.num_tokens(*id).unwrap(), tokens.len(), "sequence {id}");
        let t = m.block_table_of(*id, 0).unwrap();
        assert!(
            t.iter().all(|&b| b != NULL),
            "full attention holds every block"
        );
    }
    let (s, g) = (m.stats(), m.group_stats());
    assert!(s.prefix_hits > 0 && g.iter().all(|g| g.registered_blocks > 0));
    let ids: Vec<u64> = survivors.iter().map(|s| s.0).collect();
    m.free_batch(&ids).unwrap();
    assert!(m.reset_prefix_cache().unwrap());
    assert_eq!(m.num_free_blocks(), 95);
    m.check_invariants().unwrap();
}

/// A million operations on 12 usable blocks: every call refused or done, never corrupt.
#[test]
fn soak_on_few_hot_blocks() {
    let m = BlockManager::with_groups(Config::new(13, 2), kinds()).unwrap();
    let mut rng = Rng(0x1234_5678);
    let mut live: Vec<u64> = Vec::new();
    let mut next_id = 0u64;
    let mut done = 0usize;
    for step in 0..1_000_000u64 {
        let pick = (!live.is_empty()).then(|| live[rng.below(live.len() as u64) as usize]);
        let ok = match (rng.below(8), pick) {
            (0 | 1, _) | (_, None) => {
                next_id += 1;
                // Two hot prefixes: most prompts hit blocks another sequence cached.
                let base = 100 * rng.below(2) as u32;
                let mut t: Vec<u32> = (base..base + 1 + rng.below(7) as u32).collect();
                let r = m
                    .allocate_from(next_id, &mut t, None, None, None, 0)
                    .unwrap();
                if r.is_some() {
                    live.push(next_id);
                }
                r.is_some()
            }
            (2..=4, Some(id)) => {
                let n = m.num_tokens(id).unwrap();
                if n > 10 {
                    m.truncate(id, n - 1).is_ok_and(|r| r.is_some())
                } else {
                    let t = 100 * rng.below(2) as u32 + n as u32;
                    m.append_lookahead(id, &[t], 0).unwrap().is_some()
                }
            }
            (5, Some(id)) if live.len() < 6 => {
                next_id += 1;
                let r = m.fork(id, next_id).is_ok();
                if r {
                    live.push(next_id);
                }
                r
            }
            (_, Some(id)) => {
                live.retain(|&x| x != id);
                // Sometimes the last step never ran: its blocks are withdrawn.
                let c = m.num_scheduled_tokens(id).unwrap();
                let computed = c.saturating_sub(rng.below(4) as usize / 3);
                m.free_computed(id, Some(computed)).is_ok()
            }
        };
        done += usize::from(ok);
        if step % 4096 == 0 {
            m.check_invariants()
                .unwrap_or_else(|e| panic!("step {step}: {e}"));
        }
    }
    let (s, g) = (m.stats(), m.group_stats());
    assert!(done > 500_000, "only {done} calls succeeded");
    assert!(
        s.prefix_hits > 50_000 && s.unregistered_blocks > 1000,
        "{s:?}"
    );
    assert!(g.iter().all(|g| g.evictions > 1000), "{g:?}");
    m.free_batch(&live).unwrap();
    m.check_invariants().unwrap();
}
