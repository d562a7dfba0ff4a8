//! The prefix index (`prefix_index.rs`): slots, and the stripes that allow one registration per
//! digest and queue events in index order.

use super::{digest, model, pool_all_owned, replay_one_digest, stored, Seen};
use crate::prefix_index::PrefixIndex;
use loom::sync::Arc;
use loom::thread;

/// Two inserters racing for slots of one small index while a reader looks one digest up:
/// the reader finds nothing or the right block, and afterwards both entries are findable.
#[test]
fn index_inserts_race_without_losing_entries() {
    loom::model(|| {
        let idx = Arc::new(PrefixIndex::new(2, false).unwrap());
        let (d0, d1) = (digest(1), digest(2));
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

/// Two owners register the same content on two blocks at once: exactly one is registered
/// and exactly one `BlockStored` is queued; the other block stays unhashed.
#[test]
fn two_registrations_of_one_digest_store_it_once() {
    model(None, || {
        let d = digest(1);
        let pool = pool_all_owned(2, true);
        let other = {
            let pool = pool.clone();
            thread::spawn(move || pool.register(0, d, None, || stored(d)))
        };
        let mine = pool.register(1, d, None, || stored(d));
        let theirs = other.join().unwrap();
        assert!(mine != theirs, "exactly one registration wins");
        let winner = if mine { 1 } else { 0 };
        assert_eq!(pool.drain_events().unwrap(), vec![stored(d)]);
        assert!(pool.index_holds(winner, &d));
        assert!(!pool.state(1 - winner).load().hashed());
        pool.audit(&[1, 1]).unwrap();
        pool.release(winner, Some(&d)).unwrap();
        pool.release(1 - winner, None).unwrap();
        assert_eq!((pool.num_cached(), pool.num_free()), (1, 1));
        pool.audit(&[0, 0]).unwrap();
    });
}

/// An eviction of the block cached under `d` racing a registration of `d` on another block:
/// the events of `d` come out in the order the index changed, so replaying them from the
/// start state gives the final index state (without the stripe, `BlockStored` could be queued
/// before the `BlockRemoved` of the entry it replaced).
#[test]
fn eviction_and_registration_of_one_digest_queue_events_in_index_order() {
    const REGISTERED: u32 = 0;
    const REFUSED: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        let d = digest(1);
        let pool = pool_all_owned(2, true);
        assert!(pool.register(0, d, None, || stored(d)));
        pool.release(0, Some(&d)).unwrap();
        assert_eq!(pool.drain_events().unwrap(), vec![stored(d)]);
        let registrar = {
            let pool = pool.clone();
            thread::spawn(move || pool.register(1, d, None, || stored(d)))
        };
        assert!(pool.reserve(1));
        assert_eq!(pool.take(), 0, "the free stack is empty: evicts block 0");
        let registered = registrar.join().unwrap();
        // Replay from "d is cached" (each event must change the state it names).
        let present = replay_one_digest(pool.drain_events().unwrap(), d, true);
        assert_eq!(present, pool.peek(&d).is_some());
        assert_eq!(present, registered);
        s.saw(if registered { REGISTERED } else { REFUSED });
        pool.audit(&[1, 1]).unwrap();
    });
    seen.assert_saw(&[REGISTERED, REFUSED]);
}
