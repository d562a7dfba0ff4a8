//! Lookups from many threads while events apply, engines churn and slots are reused.

use pagedkv_router::{Config, EngineKey, Event, RouterIndex};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

fn stored(hashes: &[u64], parent: Option<u64>) -> Event<'static, u64> {
    Event::Stored {
        hashes: hashes.to_vec(),
        parent,
        medium: Some("GPU"),
        group: 0,
    }
}

/// Engines that hold the chain's first 300 blocks and engines that hold its first 3 are
/// removed and added again and again, so their slots pass from one kind to the other (the
/// free list hands the last slot freed out first). One engine holds the whole chain, so that
/// lookups walk all of it, long after the churning engines dropped out. A lookup must never
/// answer more than 3 blocks for a short engine: that would be a long engine's bits read
/// under a short engine's name (what the generation check of `lookup.rs` prevents; the race
/// is forced step by step in `lookup::tests::a_slot_reused_mid_lookup_is_read_again`, this
/// test runs it free).
#[test]
fn reused_slots_never_mix_two_holders() {
    let ix = Arc::new(RouterIndex::<u64>::new(Config {
        max_holders: 64,
        ..Config::default()
    }));
    let chain: Vec<u64> = (100..3100).collect();
    ix.apply(&EngineKey::Int(u64::MAX), &[stored(&chain, None)])
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let lookups = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::new();
    for _ in 0..2 {
        let (ix, chain, stop, lookups) = (ix.clone(), chain.clone(), stop.clone(), lookups.clone());
        readers.push(thread::spawn(move || {
            let mut out = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                for h in ix.match_prefix(&chain) {
                    let EngineKey::Int(e) = h.engine else {
                        unreachable!()
                    };
                    let most = match e {
                        u64::MAX => 3000,
                        e if e % 2 == 0 => 300,
                        _ => 3,
                    };
                    assert!(h.blocks <= most, "engine {e} answered {} blocks", h.blocks);
                }
                ix.match_raw(&chain, &mut out);
                lookups.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let mut writers = Vec::new();
    for t in 0..1u64 {
        let (ix, chain) = (ix.clone(), chain.clone());
        writers.push(thread::spawn(move || {
            for round in 0..1000u64 {
                let e = EngineKey::Int(t * 1_000_000 + round);
                let long = round % 2 == 0;
                let n = if long { 300 } else { 3 };
                ix.apply(&e, &[stored(&chain[..n], None)]).unwrap();
                if round % 3 == 0 {
                    ix.apply(&e, &[Event::Cleared, stored(&chain[..n], None)])
                        .unwrap();
                }
                assert!(ix.remove_engine(&e));
            }
        }));
    }
    for w in writers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    assert!(lookups.load(Ordering::Relaxed) > 0);
    assert_eq!(ix.stats().memberships, 3000);
    ix.check_invariants().unwrap();
}

/// Writers share blocks across engines (common prefixes) and apply stores, removals and
/// clears while readers look up; at the end the index equals each writer's own model.
#[test]
fn concurrent_writers_end_where_their_models_do() {
    let ix = Arc::new(RouterIndex::<u64>::default());
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (ix, stop) = (ix.clone(), stop.clone());
        thread::spawn(move || {
            let keys: Vec<u64> = (0..16).collect();
            while !stop.load(Ordering::Relaxed) {
                for h in ix.match_prefix(&keys) {
                    assert!(h.blocks as usize <= keys.len());
                }
            }
        })
    };
    let writers: Vec<_> = (0..3u64)
        .map(|t| {
            let ix = ix.clone();
            thread::spawn(move || {
                let mut rng = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                let mut next = || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let mut model = std::collections::HashSet::new();
                let e = EngineKey::Int(t);
                for _ in 0..20_000 {
                    let h = next() % 16;
                    match next() % 10 {
                        0..=5 => {
                            ix.apply(&e, &[stored(&[h], None)]).unwrap();
                            model.insert(h);
                        }
                        6..=8 => {
                            ix.apply(
                                &e,
                                &[Event::Removed {
                                    hashes: vec![h],
                                    medium: Some("GPU"),
                                    group: 0,
                                }],
                            )
                            .unwrap();
                            model.remove(&h);
                        }
                        _ => {
                            if next() % 20 == 0 {
                                ix.apply(&e, &[Event::Cleared]).unwrap();
                                model.clear();
                            }
                        }
                    }
                }
                (e, model)
            })
        })
        .collect();
    let models: Vec<_> = writers.into_iter().map(|w| w.join().unwrap()).collect();
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    for (e, model) in models {
        let mut got = ix.blocks_of(&e, Some("GPU"), 0);
        got.sort_unstable();
        let mut want: Vec<u64> = model.into_iter().collect();
        want.sort_unstable();
        assert_eq!(got, want);
        for k in 0..16u64 {
            let held = ix.match_prefix(&[k]).iter().any(|h| h.engine == e);
            assert_eq!(held, want.contains(&k));
        }
    }
    ix.check_invariants().unwrap();
}
