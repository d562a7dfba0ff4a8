//! A snapshot committed with its replaced blocks left to drop later
//! (`commit_snapshot_deferred`, then `drop_replaced`): lookups see only the new blocks at
//! once, the index stays consistent while the old ones wait, and their slots come back.

mod common;

use common::{blocks, stored};
use pagedkv_router::{Config, EngineKey, RouterIndex};

fn snapshot(ix: &RouterIndex<u64>, e: &EngineKey, keys: &[u64]) -> usize {
    ix.begin_snapshot(e);
    ix.apply_staged(e, &[stored(keys)]).unwrap();
    ix.commit_snapshot_deferred(e).unwrap()
}

#[test]
fn replaced_blocks_stop_counting_at_commit_and_go_when_dropped() {
    let ix = RouterIndex::<u64>::default();
    let a = EngineKey::from("a");
    let b = EngineKey::from("b");
    ix.apply(&a, &[stored(&[1, 2, 3, 4])]).unwrap();
    ix.apply(&b, &[stored(&[1, 2])]).unwrap();
    // The snapshot keeps 1 and 2, drops 3 and 4, adds 9.
    assert_eq!(snapshot(&ix, &a, &[1, 2, 9]), 4);
    let want = vec![(a.clone(), 2), (b.clone(), 2)];
    assert_eq!(blocks(&ix, &[1, 2, 3, 4]), want);
    assert_eq!(blocks(&ix, &[9]), vec![(a.clone(), 1)]);
    assert_eq!(ix.stats().memberships, 5);
    // The old holder's bits are still set, its slot still taken: consistent all the same.
    let entries = ix.stats().entries;
    ix.check_invariants().unwrap();
    assert_eq!(ix.drop_replaced(), 1);
    assert_eq!(ix.drop_replaced(), 0);
    assert!(ix.stats().entries < entries, "the old entries went");
    assert_eq!(blocks(&ix, &[1, 2, 3, 4]), want);
    let mut held = ix.blocks_of(&a, Some("GPU"), 0);
    held.sort_unstable();
    assert_eq!(held, vec![1, 2, 9]);
    ix.check_invariants().unwrap();
    // A snapshot with nothing to replace queues nothing.
    assert_eq!(snapshot(&ix, &EngineKey::from("c"), &[7]), 0);
    assert_eq!(ix.drop_replaced(), 0);
    ix.check_invariants().unwrap();
}

/// With every slot taken, some by replaced holders not yet dropped, a new holder gets one
/// of theirs: the writer drops them first rather than refusing.
#[test]
fn slots_of_replaced_holders_are_freed_when_needed() {
    let ix = RouterIndex::<u64>::new(Config {
        max_holders: 2,
        ..Config::default()
    });
    let a = EngineKey::from("a");
    ix.apply(&a, &[stored(&[1, 2])]).unwrap();
    snapshot(&ix, &a, &[3]); // two slots taken: the new holder and the replaced one
    ix.apply(&EngineKey::from("b"), &[stored(&[5])]).unwrap();
    assert_eq!(ix.drop_replaced(), 0, "the writer dropped them already");
    assert_eq!(blocks(&ix, &[3]), vec![(a.clone(), 1)]);
    assert_eq!(blocks(&ix, &[1]), vec![]);
    ix.check_invariants().unwrap();
}

/// Lookups from other threads while replaced holders are dropped: each answer is the new
/// state's, never the old blocks', and never a mix.
#[test]
fn lookups_during_the_drop_see_only_the_new_blocks() {
    let ix = std::sync::Arc::new(RouterIndex::<u64>::default());
    let a = EngineKey::from("a");
    let old: Vec<u64> = (0..200_000).collect();
    let new: Vec<u64> = (0..100).chain(1_000_000..1_000_100).collect();
    ix.apply(&a, &[stored(&old)]).unwrap();
    snapshot(&ix, &a, &new);
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let looker = s.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) || n < 100 {
                assert_eq!(blocks(&ix, &old[..150]), vec![(a.clone(), 100)]);
                assert_eq!(blocks(&ix, &new), vec![(a.clone(), 200)]);
                n += 1;
            }
        });
        assert_eq!(ix.drop_replaced(), 1);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        looker.join().unwrap();
    });
    ix.check_invariants().unwrap();
    assert_eq!(ix.stats().memberships, 200);
}

/// Snapshots of one engine committed over and over with the drop left to another thread,
/// while a third applies another engine's events and a fourth looks up, with slots scarce
/// (replaced slots are reused as soon as they are free): every answer is one the engines
/// held, and at the end the index is each engine's last state.
#[test]
fn deferred_drops_race_with_writers_and_lookups() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let ix = RouterIndex::<u64>::new(Config {
        max_holders: 4,
        ..Config::default()
    });
    let a = EngineKey::from("a");
    let b = EngineKey::from("b");
    // Engine a's snapshot k holds 1000k .. 1000k + 50: a lookup of any one of them answers
    // 0 or 50 for a, never a mix of two snapshots.
    let snap = |k: u64| -> Vec<u64> { (1000 * k..1000 * k + 50).collect() };
    ix.apply(&a, &[stored(&snap(0))]).unwrap();
    let done = AtomicBool::new(false);
    // Set when the snapshotting writer ends, panicking or not: the other loops end too, and
    // the scope reports the panic instead of spinning for ever.
    struct Done<'a>(&'a AtomicBool);
    impl Drop for Done<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Release);
        }
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            let _done = Done(&done);
            for k in 1..200 {
                snapshot(&ix, &a, &snap(k));
            }
        });
        s.spawn(|| {
            while !done.load(Ordering::Acquire) {
                ix.drop_replaced();
            }
        });
        s.spawn(|| {
            for i in 0..2000u64 {
                ix.apply(&b, &[stored(&[5_000_000 + i])]).unwrap();
            }
        });
        s.spawn(|| {
            while !done.load(Ordering::Acquire) {
                for k in [0, 50, 199] {
                    for (e, n) in blocks(&ix, &snap(k)) {
                        assert_eq!((e, n), (a.clone(), 50), "snapshot {k}");
                    }
                }
            }
        });
    });
    ix.drop_replaced();
    ix.check_invariants().unwrap();
    assert_eq!(blocks(&ix, &snap(199)), vec![(a.clone(), 50)]);
    assert_eq!(blocks(&ix, &snap(198)), vec![]);
    assert_eq!(ix.stats().memberships, 50 + 2000);
}
