//! Admission and release (`block_pool/`): a block goes back to the pool exactly once, and an
//! allocation holding a unit always finds a block.

use super::{digest, owned_block, pool_with_owned_block};
use loom::thread;

/// A release to the cache racing an allocation that must evict: the allocator, holding a
/// unit, always finds the block, and the counters balance.
#[test]
fn allocation_finds_the_block_a_racing_release_caches() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 1, Some(d));
        let releaser = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, Some(&d)).unwrap())
        };
        // Spins (yielding) until the release has made the block available.
        let mut got = None;
        while got.is_none() {
            if pool.reserve(1) {
                got = Some(pool.take());
            } else {
                thread::yield_now();
            }
        }
        releaser.join().unwrap();
        assert_eq!(got, Some(0));
        pool.audit(&[1]).unwrap();
        assert_eq!(pool.num_available(), 0);
        assert!(!pool.state(0).load().hashed());
    });
}

/// The last reference dropped by two owners at once: exactly one of them frees the block
/// (pushes it on the free stack and counts it available).
#[test]
fn two_owners_dropping_the_last_references_free_once() {
    loom::model(|| {
        let pool = pool_with_owned_block(1, 2, None);
        let other = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, None).unwrap())
        };
        pool.release(0, None).unwrap();
        other.join().unwrap();
        pool.audit(&[0]).unwrap();
        assert_eq!((pool.num_free(), pool.num_available()), (1, 1));
    });
}

/// The same for a hashed block: exactly one owner queues it as CACHED (in the LRU, or in a
/// locked-mode policy), and an eviction then claims it.
#[test]
fn two_owners_dropping_a_hashed_block_cache_it_once() {
    for locked in [false, true] {
        loom::model(move || {
            let d = digest(1);
            let pool = owned_block(locked, 1, 2, Some(d));
            let other = {
                let pool = pool.clone();
                thread::spawn(move || pool.release(0, Some(&d)).unwrap())
            };
            pool.release(0, Some(&d)).unwrap();
            other.join().unwrap();
            pool.audit(&[0]).unwrap();
            assert_eq!(pool.lru_snapshot().len(), 1, "one record, not two");
            assert_eq!((pool.num_cached(), pool.num_available()), (1, 1));
            assert!(pool.reserve(1));
            assert_eq!(pool.take(), 0);
            assert_eq!(pool.evictions(), 1);
            pool.audit(&[1]).unwrap();
        });
    }
}

/// Fork racing free: one sequence forks (shares the block) while another holder frees it.
/// The block is never seen unreferenced, so an allocation racing both cannot take it.
#[test]
fn fork_racing_free_never_exposes_the_shared_block() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 2, Some(d));
        let fork = {
            let pool = pool.clone();
            thread::spawn(move || pool.state(0).share().unwrap())
        };
        let free = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, Some(&d)).unwrap())
        };
        assert!(!pool.reserve(1), "a block with holders is never available");
        fork.join().unwrap();
        free.join().unwrap();
        pool.audit(&[2]).unwrap();
    });
}

/// A step's held release (`release_table_held`, `grouped/step.rs`) racing another caller's
/// reservation: the released block's unit stays with the step, so the racer never reserves
/// it, and the step's take finds the block, FREE or (hashed) CACHED and evicted.
#[test]
fn a_held_release_keeps_its_unit_from_a_racing_reserver() {
    for hashed in [false, true] {
        loom::model(move || {
            let d = digest(1);
            let key = hashed.then_some(d);
            let pool = pool_with_owned_block(1, 1, key);
            let racer = {
                let pool = pool.clone();
                thread::spawn(move || pool.reserve(1))
            };
            let kept = pool.release_table_held(&[0], key.as_slice()).unwrap();
            assert_eq!(kept, 1, "the step keeps the unit of the block it freed");
            let b = pool.take();
            assert!(!racer.join().unwrap(), "the racer reserved a held unit");
            assert_eq!(b, 0);
            pool.audit(&[1]).unwrap();
            assert_eq!(pool.num_available(), 0);
            assert!(!pool.state(0).load().hashed());
        });
    }
}
