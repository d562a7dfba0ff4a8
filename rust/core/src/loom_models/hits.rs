//! Prefix hits against eviction and re-registration: pin, then compare the digest
//! (`block_pool/prefix.rs`, `prefix_index.rs`).

use super::{digest, model, owned_block, pin, pool_all_owned, pool_with_owned_block, Seen};
use crate::block_pool::Hit;
use crate::hashing::Digest;
use loom::thread;

/// A prefix hit racing an eviction of the same cached block: either the hit pins it (and the
/// allocator finds nothing to evict, so its reservation fails) or the eviction wins and the
/// hit misses; never both. Lock-free LRU and locked mode (where the audit also requires the
/// policy to hold exactly the CACHED blocks).
#[test]
fn hit_and_eviction_never_share_a_block() {
    for locked in [false, true] {
        loom::model(move || hit_and_eviction(locked));
    }
}

fn hit_and_eviction(locked: bool) {
    {
        let d = digest(1);
        let pool = owned_block(locked, 1, 1, Some(d));
        pool.release(0, Some(&d)).unwrap();
        let hitter = {
            let pool = pool.clone();
            thread::spawn(move || pin(&pool, &d))
        };
        let evicted = pool.reserve(1).then(|| pool.take());
        let hit = hitter.join().unwrap();
        match (hit, evicted) {
            (
                Hit::Pinned {
                    block: 0,
                    revived: true,
                },
                None,
            )
            | (Hit::Miss | Hit::NoRoom, Some(0)) => {}
            other => panic!("block handed out twice or lost: {other:?}"),
        }
        pool.audit(&[1]).unwrap();
    }
}

/// Swap-out racing a hit: the swapping sequence drops its reference to a hashed block (which
/// becomes CACHED) while a prompt hits the same digest. The hit either shares the owned block,
/// revives the cached one, or finds no unit yet (NoRoom); the pool is consistent each way.
#[test]
fn swap_out_release_racing_a_hit() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 1, Some(d));
        let swapper = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, Some(&d)).unwrap())
        };
        let hit = pin(&pool, &d);
        swapper.join().unwrap();
        match hit {
            Hit::Pinned { block: 0, .. } => pool.audit(&[1]).unwrap(),
            Hit::NoRoom => pool.audit(&[0]).unwrap(),
            other => panic!("the block is hashed throughout: {other:?}"),
        };
    });
}

/// The last holder releases its hashed block while a prompt hits it, with a unit to spare.
/// The hit shares the OWNED block or revives the CACHED one; in locked mode the revival and
/// the policy's `hit` are one step under the lock the release's `cached` also takes, so the
/// policy never keeps a record of the held block. Both outcomes are explored, both ways.
#[test]
fn hit_racing_the_last_release() {
    const SHARED: u32 = 0;
    const REVIVED: u32 = 1;
    for locked in [false, true] {
        let seen = Seen::default();
        let s = seen.clone();
        model(None, move || {
            let d = digest(1);
            let pool = owned_block(locked, 2, 1, Some(d));
            let releaser = {
                let pool = pool.clone();
                thread::spawn(move || pool.release(0, Some(&d)).unwrap())
            };
            let hit = pin(&pool, &d);
            releaser.join().unwrap();
            match hit {
                Hit::Pinned { block: 0, revived } => s.saw(if revived { REVIVED } else { SHARED }),
                other => panic!("a unit was free and the block hashed throughout: {other:?}"),
            }
            // Whoever went last, the hitter holds the block now.
            pool.audit(&[1, 0]).unwrap();
        });
        seen.assert_saw(&[SHARED, REVIVED]);
    }
}

/// Swap-in racing a hit: swap-in evicts the only (cached) block and registers it again under
/// the same digest, while a prompt hits that digest. Exactly one of them gets the cached
/// block; a hit after the re-registration shares the swapped-in block (same content).
#[test]
fn swap_in_reregistration_racing_a_hit() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 1, Some(d));
        pool.release(0, Some(&d)).unwrap();
        let swap_in = {
            let pool = pool.clone();
            thread::spawn(move || {
                if !pool.reserve(1) {
                    return false;
                }
                let b = pool.take();
                assert!(pool.register(b, d, None, || unreachable!()));
                true
            })
        };
        let hit = pin(&pool, &d);
        let swapped_in = swap_in.join().unwrap();
        let pinned = matches!(hit, Hit::Pinned { block: 0, .. });
        match (hit, swapped_in) {
            (Hit::Pinned { block: 0, .. }, _) | (Hit::Miss | Hit::NoRoom, true) => {}
            other => panic!("block handed out twice or lost: {other:?}"),
        }
        let holders = u32::from(swapped_in) + u32::from(pinned);
        assert!(holders >= 1);
        pool.audit(&[holders]).unwrap();
    });
}

/// A hit reads the index slot of `d1`, then the block is evicted and registered again under
/// `d2` (and released, so it is CACHED and hashed: the state word alone would let the pin
/// succeed). The pin must miss: pinning succeeds, the digest comparison fails, and the hit
/// gives the block back with `unpin`, leaving one live record.
#[test]
fn a_hit_on_a_block_reregistered_under_another_digest_misses() {
    const PINNED: u32 = 0;
    const NO_ROOM: u32 = 1;
    const MISSED: u32 = 2;
    const MISSED_AFTER_PINNING: u32 = 3;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(2), move || {
        let (d1, d2) = (digest(1), digest(2));
        let pool = pool_with_owned_block(1, 1, Some(d1));
        pool.release(0, Some(&d1)).unwrap();
        let reuser = {
            let pool = pool.clone();
            thread::spawn(move || {
                if !pool.reserve(1) {
                    return false;
                }
                assert_eq!(pool.take(), 0);
                assert!(pool.register(0, d2, None, || unreachable!()));
                pool.release(0, Some(&d2)).unwrap();
                true
            })
        };
        let hit = pin(&pool, &d1);
        let reused = reuser.join().unwrap();
        match hit {
            Hit::Pinned {
                block: 0,
                revived: true,
            } => {
                assert!(!reused, "the hit held the only unit");
                assert!(pool.index_holds(0, &d1));
                pool.audit(&[1]).unwrap();
                s.saw(PINNED);
                return;
            }
            Hit::NoRoom => s.saw(NO_ROOM),
            Hit::Miss => {
                // The reuser's release queued one record; a hit that pinned the block and
                // gave it back restored a second one (the first is then stale).
                let records = pool.lru_snapshot().len();
                s.saw(if records == 2 {
                    MISSED_AFTER_PINNING
                } else {
                    MISSED
                });
            }
            other => panic!("a hit on a reused block: {other:?}"),
        }
        assert!(reused);
        assert_eq!(pool.peek(&d1), None);
        assert!(pool.peek(&d2).is_some_and(|p| p.cached));
        pool.audit(&[0]).unwrap();
    });
    seen.assert_saw(&[PINNED, NO_ROOM, MISSED, MISSED_AFTER_PINNING]);
}

/// The buckets of the index of a 17-block pool: 4 slots a block, 8 a bucket, 68 slots.
const BUCKETS_OF_17: u64 = 9;

/// The smallest digest word that `PrefixIndex::buckets_of` maps to `bucket` of
/// `BUCKETS_OF_17` (it takes the high bits of `word * buckets`), plus `i`, which keeps it there.
fn word_in(bucket: u64, i: u64) -> u64 {
    (u128::from(bucket) << 64).div_ceil(u128::from(BUCKETS_OF_17)) as u64 + i
}

/// A digest whose two buckets in a 17-block pool's index are `first` and `second`, distinct
/// from the others in word 2 (and so in its tag).
fn colliding(i: u64, first: u64, second: u64) -> Digest {
    Digest::from_words([word_in(first, i), word_in(second, i), i, i], 32)
}

/// A registration whose insert fails (both buckets full) racing a hit on a stale index slot
/// of the same block: the block is marked hashed for a moment with a digest no slot names,
/// then unmarked. The hit either revives the block before the eviction or misses (stale
/// word, or pinned in the window and refused by the digest comparison); it never keeps it.
#[test]
fn a_failed_registration_racing_a_hit_on_the_same_block() {
    const PINNED: u32 = 0;
    const NOT_PINNED: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(2), move || {
        // 17 blocks: 9 buckets of 8 slots; blocks 0..16 fill buckets 0 and 1.
        let pool = pool_all_owned(17, false);
        for b in 0..16 {
            let filler = colliding(u64::from(b) + 1, 0, 1);
            assert!(pool.register(b, filler, None, || unreachable!()));
        }
        let (old, full) = (colliding(100, 2, 3), colliding(200, 0, 1));
        assert!(pool.register(16, old, None, || unreachable!()));
        pool.release(16, Some(&old)).unwrap();
        let allocator = {
            let pool = pool.clone();
            thread::spawn(move || {
                if !pool.reserve(1) {
                    return false;
                }
                assert_eq!(pool.take(), 16);
                assert!(!pool.register(16, full, None, || unreachable!()));
                pool.release(16, None).unwrap();
                true
            })
        };
        let hit = pin(&pool, &old);
        let allocated = allocator.join().unwrap();
        let mut refs = [1; 17];
        refs[16] = 0;
        match hit {
            Hit::Pinned {
                block: 16,
                revived: true,
            } => {
                assert!(!allocated, "the hit held the only unit");
                refs[16] = 1;
                s.saw(PINNED);
            }
            Hit::Miss | Hit::NoRoom => {
                assert!(allocated);
                assert_eq!(pool.peek(&old), None);
                s.saw(NOT_PINNED);
            }
            other => panic!("a hit kept a block it must not: {other:?}"),
        }
        assert_eq!(pool.peek(&full), None, "the failed insert left no entry");
        pool.audit(&refs).unwrap();
    });
    seen.assert_saw(&[PINNED, NOT_PINNED]);
}
