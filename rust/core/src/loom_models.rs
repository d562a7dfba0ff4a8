//! Loom models of the atomic protocols: every interleaving of two or three threads, under
//! the C11 memory model. Run: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test
//! -p pagedkv-core --release --lib loom_models`. The list, by protocol, is in
//! docs/concurrency.md; each pool-level model ends with the full pool audit
//! (`BlockPool::audit`), so "the loser sees a consistent state" is checked, not assumed.

use crate::block_pool::{BlockPool, Hit};
use crate::block_state::{BlockState, Pin, Released};
use crate::free_stack::FreeStack;
use crate::hashing::{BlockHasher, Digest, HashAlgo};
use crate::prefix_index::PrefixIndex;
use loom::sync::Arc;
use loom::thread;

fn digest(token: u32) -> Digest {
    let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
    h.hash_block(&h.root(), &[token], &[0])
}

/// A pool of `n` blocks whose block 0 is OWNED by `holders` tables and, with `digest`,
/// registered (hashed) under it.
fn pool_with_owned_block(n: u32, holders: u32, digest: Option<Digest>) -> Arc<BlockPool> {
    let pool = Arc::new(BlockPool::new(n, false, false));
    assert!(pool.reserve(1));
    let b = pool.take();
    assert_eq!(b, 0);
    (1..holders).for_each(|_| pool.state(b).share());
    if let Some(d) = digest {
        assert!(pool.register(b, d, None, || unreachable!()));
    }
    pool
}

#[test]
fn free_stack_pop_push_never_loses_or_duplicates() {
    loom::model(|| {
        let s = Arc::new(FreeStack::full(2));
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let s = s.clone();
                thread::spawn(move || {
                    if let Some(b) = s.pop() {
                        s.push(b);
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        let mut ids = s.snapshot(4);
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1]);
    });
}

#[test]
fn free_stack_concurrent_pops_get_distinct_ids() {
    loom::model(|| {
        let s = Arc::new(FreeStack::full(2));
        let a = {
            let s = s.clone();
            thread::spawn(move || s.pop())
        };
        let b = s.pop();
        let a = a.join().unwrap();
        assert_ne!(a, b);
        assert!(a.is_some() && b.is_some());
        assert_eq!(s.pop(), None);
    });
}

#[test]
fn pin_and_eviction_claim_exclude_each_other() {
    loom::model(|| {
        let st = Arc::new(BlockState::new_free());
        st.take();
        st.set_hashed();
        let Released::ToCached { epoch, stamp } = st.release() else {
            panic!()
        };
        let pinner = {
            let st = st.clone();
            thread::spawn(move || st.pin(true))
        };
        let claimed = st.claim_cached(epoch, stamp, 1);
        let pinned = pinner.join().unwrap();
        match pinned {
            Pin::Pinned { revived } => {
                assert!(revived && !claimed);
                assert_eq!(st.load().rc(), 1);
                assert!(st.load().hashed());
            }
            Pin::Stale => {
                assert!(claimed);
                assert_eq!(st.load().rc(), 1);
                assert!(!st.load().hashed());
            }
            Pin::NeedsUnit => panic!("the pinner held a unit"),
        }
    });
}

#[test]
fn concurrent_releases_hand_the_block_on_exactly_once() {
    loom::model(|| {
        let st = Arc::new(BlockState::new_free());
        st.take();
        st.share();
        let other = {
            let st = st.clone();
            thread::spawn(move || st.release())
        };
        let mine = st.release();
        let theirs = other.join().unwrap();
        let last = [mine, theirs]
            .iter()
            .filter(|r| **r == Released::ToFree)
            .count();
        assert_eq!(last, 1);
        assert!(st.load().is_free());
    });
}

/// A release to the cache racing an allocation that must evict: the allocator, holding a
/// unit, always finds the block, and the counters balance.
#[test]
fn allocation_finds_the_block_a_racing_release_caches() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(1, false, false));
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        let digest = h.hash_block(&h.root(), &[1], &[0]);
        assert!(pool.reserve(1));
        let b = pool.take();
        assert!(pool.register(b, digest, None, || unreachable!()));
        let releaser = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(b, Some(&digest)))
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
        assert_eq!(got, Some(b));
        assert_eq!(pool.num_available(), 0);
        assert_eq!(pool.num_cached(), 0);
        assert!(!pool.state(b).load().hashed());
    });
}

/// A prefix hit racing an eviction of the same cached block: either the hit pins it (and the
/// allocator finds nothing to evict, so its reservation fails) or the eviction wins and the
/// hit misses; never both.
#[test]
fn hit_and_eviction_never_share_a_block() {
    loom::model(|| {
        let pool = Arc::new(BlockPool::new(1, false, false));
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        let digest = h.hash_block(&h.root(), &[1], &[0]);
        assert!(pool.reserve(1));
        let b = pool.take();
        assert!(pool.register(b, digest, None, || unreachable!()));
        pool.release(b, Some(&digest));
        let hitter = {
            let pool = pool.clone();
            thread::spawn(move || {
                let mut spare = 0;
                pool.pin(&digest, None, &mut spare)
            })
        };
        let evicted = pool.reserve(1).then(|| pool.take());
        let hit = hitter.join().unwrap();
        match (hit, evicted) {
            (Hit::Pinned(x), None) => assert_eq!(x, b),
            (Hit::Miss | Hit::NoRoom, Some(x)) => assert_eq!(x, b),
            other => panic!("block handed out twice or lost: {other:?}"),
        }
        assert_eq!(pool.state(b).load().rc(), 1);
    });
}

/// Two inserters racing for slots of one small index while a reader looks one digest up:
/// the reader finds nothing or the right block, and afterwards both entries are findable.
#[test]
fn index_inserts_race_without_losing_entries() {
    loom::model(|| {
        let idx = Arc::new(PrefixIndex::new(2, false));
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        let d0 = h.hash_block(&h.root(), &[1], &[0]);
        let d1 = h.hash_block(&h.root(), &[2], &[0]);
        let other = {
            let idx = idx.clone();
            thread::spawn(move || {
                idx.write_digest(1, &d1, None);
                assert!(idx.insert_new(&d1, 1))
            })
        };
        let reader = {
            let idx = idx.clone();
            thread::spawn(move || idx.get(&d0))
        };
        idx.write_digest(0, &d0, None);
        assert!(idx.insert_new(&d0, 0));
        other.join().unwrap();
        let seen = reader.join().unwrap();
        assert!(seen.is_none() || seen == Some(0));
        assert_eq!(idx.get(&d0), Some(0));
        assert_eq!(idx.get(&d1), Some(1));
    });
}

/// Allocate vs free on the free stack's head: one thread releases an unhashed block (push)
/// while another allocates (pop). The allocator gets one of the two blocks, the other is on
/// the free stack, and the counts balance.
#[test]
fn allocation_and_free_race_on_the_free_stack_head() {
    loom::model(|| {
        let pool = pool_with_owned_block(2, 1, None);
        let freer = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, None))
        };
        assert!(pool.reserve(1), "block 1 is free from the start");
        let got = pool.take();
        freer.join().unwrap();
        let mut refs = vec![0; 2];
        refs[got as usize] = 1;
        pool.audit(&refs).unwrap();
        assert_eq!((pool.num_free(), pool.num_available()), (1, 1));
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
            thread::spawn(move || pool.release(0, None))
        };
        pool.release(0, None);
        other.join().unwrap();
        pool.audit(&[0]).unwrap();
        assert_eq!((pool.num_free(), pool.num_available()), (1, 1));
    });
}

/// The same for a hashed block: exactly one owner queues it in the LRU as CACHED.
#[test]
fn two_owners_dropping_a_hashed_block_cache_it_once() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 2, Some(d));
        let other = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, Some(&d)))
        };
        pool.release(0, Some(&d));
        other.join().unwrap();
        pool.audit(&[0]).unwrap();
        assert_eq!(pool.lru_snapshot().len(), 1, "one record, not two");
        assert_eq!((pool.num_cached(), pool.num_available()), (1, 1));
    });
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
            thread::spawn(move || pool.state(0).share())
        };
        let free = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, Some(&d)))
        };
        assert!(!pool.reserve(1), "a block with holders is never available");
        fork.join().unwrap();
        free.join().unwrap();
        pool.audit(&[2]).unwrap();
    });
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
            thread::spawn(move || pool.release(0, Some(&d)))
        };
        let mut spare = 0;
        let hit = pool.pin(&d, None, &mut spare);
        swapper.join().unwrap();
        assert_eq!(spare, 0, "no unit leaked into the caller's spare");
        match hit {
            Hit::Pinned(0) => pool.audit(&[1]).unwrap(),
            Hit::NoRoom => pool.audit(&[0]).unwrap(),
            other => panic!("the block is hashed throughout: {other:?}"),
        };
    });
}

/// Swap-in racing a hit: swap-in evicts the only (cached) block and registers it again under
/// the same digest, while a prompt hits that digest. Exactly one of them gets the cached
/// block; a hit after the re-registration shares the swapped-in block (same content).
#[test]
fn swap_in_reregistration_racing_a_hit() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 1, Some(d));
        pool.release(0, Some(&d));
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
        let mut spare = 0;
        let hit = pool.pin(&d, None, &mut spare);
        let swapped_in = swap_in.join().unwrap();
        let holders = u32::from(swapped_in) + u32::from(matches!(hit, Hit::Pinned(_)));
        match (hit, swapped_in) {
            (Hit::Pinned(0), _) | (Hit::Miss | Hit::NoRoom, true) => {}
            other => panic!("block handed out twice or lost: {other:?}"),
        }
        assert!(holders >= 1);
        pool.audit(&[holders]).unwrap();
    });
}
