//! Retraction (`free` with `num_computed_tokens`, `truncate`, an abort's withdrawal) racing a
//! hit or a registration of the same digest.

use super::{digest, model, pin, pool_all_owned, pool_with_owned_block, Seen};
use crate::block_pool::Hit;
use loom::thread;

/// A retraction (`free` with fewer computed tokens than scheduled) racing a hit on the same
/// block: the sole holder withdraws its block from the cache while another prompt pins it.
/// Either the hit wins (the block then has two holders, the retraction refuses and the block
/// stays hashed) or the retraction wins (the hit misses: the block is unhashed and out of
/// the index, and the holder's release frees it). Never both, never a hit on a withdrawn
/// block; the audit checks the index and counters whole. Both outcomes must be explored.
#[test]
fn retraction_racing_a_hit() {
    const HIT_WON: u32 = 0;
    const RETRACTION_WON: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(None, move || {
        let d = digest(1);
        let pool = pool_with_owned_block(2, 1, Some(d));
        let retractor = {
            let pool = pool.clone();
            thread::spawn(move || {
                let withdrawn = pool.retract(0, &d, true);
                pool.release(0, Some(&d)).unwrap();
                withdrawn
            })
        };
        let hit = pin(&pool, &d);
        let withdrawn = retractor.join().unwrap();
        match (hit, withdrawn) {
            (Hit::Pinned { block: 0, .. }, false) => {
                assert!(pool.state(0).load().hashed());
                pool.audit(&[1, 0]).unwrap();
                s.saw(HIT_WON);
            }
            (Hit::Miss, true) => {
                assert!(
                    pool.peek(&d).is_none(),
                    "a withdrawn block stays out of the index"
                );
                pool.audit(&[0, 0]).unwrap();
                s.saw(RETRACTION_WON);
            }
            // The hit came after the release cached the block: not a race with retraction.
            (Hit::Pinned { block: 0, .. }, true) => panic!("hit on a withdrawn block"),
            other => panic!("unexpected outcome {other:?}"),
        }
    });
    seen.assert_saw(&[HIT_WON, RETRACTION_WON]);
}

/// An abort's withdrawal (any number of holders) racing a hit: the hit either pinned first
/// (it keeps its reference; the block is withdrawn all the same and is freed, not cached,
/// when both have released it) or misses. Never a hit after the withdrawal.
#[test]
fn withdrawal_of_a_held_block_racing_a_hit() {
    const PINNED_FIRST: u32 = 0;
    const MISSED: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(None, move || {
        let d = digest(1);
        let pool = pool_with_owned_block(2, 1, Some(d));
        let retractor = {
            let pool = pool.clone();
            thread::spawn(move || {
                let withdrawn = pool.retract(0, &d, false);
                pool.release(0, Some(&d)).unwrap();
                withdrawn
            })
        };
        let hit = pin(&pool, &d);
        assert!(retractor.join().unwrap(), "the block was hashed and held");
        assert!(pool.peek(&d).is_none(), "withdrawn: out of the index");
        match hit {
            Hit::Pinned { block: 0, .. } => {
                assert!(!pool.state(0).load().hashed());
                pool.audit(&[1, 0]).unwrap();
                pool.release(0, None).unwrap();
                assert!(pool.state(0).load().is_free(), "freed, not cached");
                s.saw(PINNED_FIRST);
            }
            Hit::Miss => s.saw(MISSED),
            other => panic!("unexpected outcome {other:?}"),
        }
        pool.audit(&[0, 0]).unwrap();
    });
    seen.assert_saw(&[PINNED_FIRST, MISSED]);
}

/// A retraction racing a registration of the same digest by another block (another prompt
/// scheduling the same content): the stripe orders them, so the digest ends registered to
/// the other block exactly when its registration came after the withdrawal.
#[test]
fn retraction_racing_a_registration_of_the_same_digest() {
    model(None, || {
        let d = digest(1);
        let pool = pool_all_owned(2, false);
        assert!(pool.register(0, d, None, || unreachable!()));
        let registrar = {
            let pool = pool.clone();
            thread::spawn(move || pool.register(1, d, None, || unreachable!()))
        };
        let withdrawn = pool.retract(0, &d, false);
        let registered = registrar.join().unwrap();
        assert!(withdrawn, "block 0 has one holder");
        let holder = pool.peek(&d).map(|p| p.block);
        assert_eq!(holder, registered.then_some(1));
        assert!(!pool.state(0).load().hashed());
        pool.audit(&[1, 1]).unwrap();
    });
}
