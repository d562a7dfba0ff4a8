//! The block state word (`block_state.rs`): the last release hands a block on exactly once, and
//! a hit's pin and an eviction's claim exclude each other.

use crate::block_state::{BlockState, Pin, Released};
use loom::sync::Arc;
use loom::thread;

#[test]
fn pin_and_eviction_claim_exclude_each_other() {
    loom::model(|| {
        let st = Arc::new(BlockState::new_free());
        st.take();
        st.set_hashed();
        let Some(Released::ToCached { generation, .. }) = st.release() else {
            panic!("a hashed block's last release caches it")
        };
        let pinner = {
            let st = st.clone();
            thread::spawn(move || st.pin(true))
        };
        let claimed = st.claim_cached(generation, 1);
        let pinned = pinner.join().unwrap();
        match pinned {
            Pin::Pinned { revived, .. } => {
                assert!(revived && !claimed);
                assert_eq!(st.load().rc(), 1);
                assert!(st.load().hashed());
            }
            Pin::Stale => {
                assert!(claimed);
                assert_eq!(st.load().rc(), 1);
                assert!(!st.load().hashed());
            }
            Pin::NeedsUnit | Pin::Full => panic!("the pinner held a unit, rc is 0: {pinned:?}"),
        }
    });
}

#[test]
fn concurrent_releases_hand_the_block_on_exactly_once() {
    loom::model(|| {
        let st = Arc::new(BlockState::new_free());
        st.take();
        st.share().unwrap();
        let other = {
            let st = st.clone();
            thread::spawn(move || st.release())
        };
        let mine = st.release();
        let theirs = other.join().unwrap();
        let last = [mine, theirs]
            .iter()
            .filter(|r| **r == Some(Released::ToFree))
            .count();
        assert_eq!(last, 1);
        assert!(st.load().is_free());
    });
}
