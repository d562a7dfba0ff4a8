//! Loom models of the atomic protocols: every interleaving of two or three threads, under
//! the C11 memory model. Run: `RUSTFLAGS="--cfg loom" cargo test -p pagedkv-core --release
//! --lib loom_models`.

use crate::block_pool::{BlockPool, Hit};
use crate::block_state::{BlockState, Pin, Released};
use crate::free_stack::FreeStack;
use crate::hashing::{BlockHasher, HashAlgo};
use crate::prefix_index::PrefixIndex;
use loom::sync::Arc;
use loom::thread;

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
        let pool = Arc::new(BlockPool::new(1, false));
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        let digest = h.hash_block(&h.root(), &[1], &[0]);
        assert!(pool.reserve(1));
        let b = pool.take();
        assert!(pool.register(b, digest, || unreachable!()));
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
        let pool = Arc::new(BlockPool::new(1, false));
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        let digest = h.hash_block(&h.root(), &[1], &[0]);
        assert!(pool.reserve(1));
        let b = pool.take();
        assert!(pool.register(b, digest, || unreachable!()));
        pool.release(b, Some(&digest));
        let hitter = {
            let pool = pool.clone();
            thread::spawn(move || {
                let mut spare = 0;
                pool.pin(&digest, &mut spare)
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
        let idx = Arc::new(PrefixIndex::new(2));
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        let d0 = h.hash_block(&h.root(), &[1], &[0]);
        let d1 = h.hash_block(&h.root(), &[2], &[0]);
        let other = {
            let idx = idx.clone();
            thread::spawn(move || {
                idx.write_digest(1, &d1);
                assert!(idx.insert_new(&d1, 1))
            })
        };
        let reader = {
            let idx = idx.clone();
            thread::spawn(move || idx.get(&d0))
        };
        idx.write_digest(0, &d0);
        assert!(idx.insert_new(&d0, 0));
        other.join().unwrap();
        let seen = reader.join().unwrap();
        assert!(seen.is_none() || seen == Some(0));
        assert_eq!(idx.get(&d0), Some(0));
        assert_eq!(idx.get(&d1), Some(1));
    });
}
