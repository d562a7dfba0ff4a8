//! `evict_blocks` (`BlockPool::withdraw`): a withdrawal racing the last release, a hit that
//! revives the block and gives it back (a failed allocation), or an allocation that must
//! evict the block.

use super::{digest, model, owned_block, Seen};
use crate::block_pool::{BlockPool, Hit, Withdrawal};
use loom::thread;

/// The digest length of `digest` (XXH3-128).
const LEN: usize = 16;

/// The holder releases its hashed block and then hits it again (revives it) and gives it back
/// unused, as a failed allocation does, while `evict_blocks` withdraws it. Whenever the
/// withdrawal lands (before the release, between release and hit, while the hit holds it,
/// after it is given back) the block ends FREE and out of the index, counted once in
/// `available`, and a later hit misses. The four outcomes must all be explored, with the
/// lock-free LRU and in locked mode (the policy's `removed` when CACHED, its `restore` after
/// the failed hit).
#[test]
fn withdrawal_racing_a_release_and_a_failed_hit() {
    for locked in [false, true] {
        withdrawal_racing_a_release_and_a_failed_hit_in(locked);
    }
}

fn withdrawal_racing_a_release_and_a_failed_hit_in(locked: bool) {
    const BEFORE_RELEASE: u32 = 0;
    const WHILE_CACHED: u32 = 1;
    const WHILE_PINNED: u32 = 2;
    const AFTER_UNPIN: u32 = 3;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        let d = digest(1);
        let pool = owned_block(locked, 2, 1, Some(d));
        let holder = {
            let pool = pool.clone();
            thread::spawn(move || {
                pool.release(0, Some(&d)).unwrap();
                let mut spare = 0;
                let hit = pool.pin(&d, None, &mut spare).unwrap();
                pool.unreserve(spare);
                if let Hit::Pinned { block, revived } = hit {
                    assert!(revived, "nobody else held it");
                    pool.unpin(block, &d).unwrap();
                }
                hit
            })
        };
        let w = pool.withdraw(0, LEN);
        let hit = holder.join().unwrap();
        pool.audit(&[0, 0]).unwrap();
        assert!(pool.state(0).load().is_free(), "FREE whoever went last");
        assert_eq!((pool.num_free(), pool.num_available()), (2, 2));
        assert!(pool.peek(&d).is_none());
        match (w, hit) {
            (Withdrawal::Unhashed, Hit::Miss) => s.saw(BEFORE_RELEASE),
            (Withdrawal::Freed, Hit::Miss) => s.saw(WHILE_CACHED),
            (Withdrawal::Unhashed, Hit::Pinned { .. }) => s.saw(WHILE_PINNED),
            (Withdrawal::Freed, Hit::Pinned { .. }) => s.saw(AFTER_UNPIN),
            other => panic!("unexpected outcome {other:?}"),
        }
    });
    seen.assert_saw(&[BEFORE_RELEASE, WHILE_CACHED, WHILE_PINNED, AFTER_UNPIN]);
}

/// A withdrawal of the only (CACHED) block racing an allocation that holds a unit and must
/// evict it: the allocation always gets the block (from the LRU, or from the free stack once
/// the withdrawal pushed it), exactly one of the two removes it from the index (one
/// `BlockRemoved`), and the counters balance.
#[test]
fn withdrawal_racing_an_evicting_allocation() {
    const ALLOCATION_FIRST: u32 = 0;
    const WITHDRAWAL_FIRST: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        let d = digest(1);
        let pool = loom::sync::Arc::new(BlockPool::new(1, true, false).unwrap());
        assert!(pool.reserve(1));
        assert_eq!(pool.take(), 0);
        assert!(pool.register(0, d, None, || super::stored(d)));
        pool.release(0, Some(&d)).unwrap();
        pool.drain_events().unwrap();
        let withdrawer = {
            let pool = pool.clone();
            thread::spawn(move || pool.withdraw(0, LEN))
        };
        assert!(pool.reserve(1), "the cached block is available");
        assert_eq!(pool.take(), 0);
        let w = withdrawer.join().unwrap();
        pool.audit(&[1]).unwrap();
        assert_eq!(pool.drain_events().unwrap().len(), 1, "one BlockRemoved");
        assert!(pool.peek(&d).is_none());
        match w {
            Withdrawal::NotCached => s.saw(ALLOCATION_FIRST),
            Withdrawal::Freed => s.saw(WITHDRAWAL_FIRST),
            Withdrawal::Unhashed => panic!("the allocation's block is unhashed when it holds it"),
        }
    });
    seen.assert_saw(&[ALLOCATION_FIRST, WITHDRAWAL_FIRST]);
}
