//! Pins (`BlockState::set_pinned`, `BlockPool::set_pinned`): a pinned block is kept out of
//! the eviction order and its unit out of `available` while CACHED. The pin bit lives in the
//! state word, set only by a holder, so the CAS that makes the block CACHED and every CAS
//! that revives it see the same bit. These models check that the bit a holder set reaches
//! the release that caches the block, whoever releases last, and that a hit revives a
//! pinned block without a unit while the pool's counts stay exact.

use super::{digest, model, owned_block, pin, Seen};
use crate::block_pool::Hit;
use crate::block_state::{BlockState, Released};
use loom::sync::Arc;
use loom::thread;

/// Two holders; one pins and releases, the other releases: the last release (either one)
/// makes the block CACHED and pinned.
#[test]
fn the_last_release_sees_a_pin_set_by_the_other_holder() {
    loom::model(|| {
        let st = Arc::new(BlockState::new_free());
        st.take();
        st.share().unwrap();
        st.set_hashed();
        let pinner = {
            let st = st.clone();
            thread::spawn(move || {
                assert!(st.set_pinned(true));
                st.release()
            })
        };
        let mine = st.release();
        let theirs = pinner.join().unwrap();
        let cached: Vec<_> = [mine, theirs]
            .into_iter()
            .filter(|r| matches!(r, Some(Released::ToCached { .. })))
            .collect();
        assert_eq!(cached.len(), 1, "one release caches it");
        assert!(
            matches!(cached[0], Some(Released::ToCached { pinned: true, .. })),
            "the pin was lost: {cached:?}"
        );
    });
}

/// The pool-level race: the holder pins its block and releases it while a prompt that
/// reserved nothing hits it. The hit shares the OWNED block, or revives the pinned CACHED one
/// without a unit; `available` never counts the pinned block, and the audit holds. Both
/// outcomes are explored, in the lock-free and in locked mode.
#[test]
fn a_hit_without_a_unit_revives_a_pinned_block() {
    for locked in [false, true] {
        let seen = Seen::default();
        let s = seen.clone();
        model(None, move || {
            let d = digest(1);
            let pool = owned_block(locked, 2, 1, Some(d));
            assert!(pool.set_pinned(0, true));
            let releaser = {
                let pool = pool.clone();
                thread::spawn(move || pool.release(0, Some(&d)).unwrap())
            };
            let hit = pin(&pool, &d);
            releaser.join().unwrap();
            match hit {
                Hit::Pinned { block: 0, revived } => s.saw(u32::from(revived)),
                other => panic!("a pinned block needs no unit: {other:?}"),
            }
            pool.audit(&[1, 0]).unwrap();
            // One FREE block is available; the pinned block is held.
            assert_eq!(pool.num_available(), 1);
            assert_eq!(pool.num_pinned_cached(), 0);
            // Released again it is CACHED, pinned, and nothing can evict it.
            pool.release(0, Some(&d)).unwrap();
            pool.audit(&[0, 0]).unwrap();
            assert_eq!((pool.num_available(), pool.num_pinned_cached()), (1, 1));
            assert!(pool.reserve(1));
            assert_eq!(pool.take(), 1, "the free block, never the pinned one");
            assert!(!pool.reserve(1), "the pinned block is not available");
        });
        seen.assert_saw(&[0, 1]);
    }
}
