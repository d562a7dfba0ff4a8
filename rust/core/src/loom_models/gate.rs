//! The reset gate (`gate.rs`): readers never inside with the writer, and a reset racing a hit
//! and an allocation.

use super::{digest, model, pin, pool_with_owned_block, Seen};
use crate::block_pool::Hit;
use crate::gate::Gate;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// A writer and two readers (one waiting, one not, on different slots): a reader is never
/// inside while the writer is, and each side sees the other's writes (loom's `UnsafeCell`
/// fails the model on any access not ordered by happens-before).
#[test]
fn the_gate_excludes_readers_from_the_writer() {
    const BACKED_OUT: u32 = 0;
    const ENTERED: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        const WRITER: usize = 1 << 16;
        let gate = Arc::new(Gate::new());
        let inside = Arc::new(AtomicUsize::new(0));
        let data = Arc::new(loom::cell::UnsafeCell::new(0u32));
        let reader = |inside: &AtomicUsize, data: &loom::cell::UnsafeCell<u32>| {
            // Relaxed: the counter only detects overlap (every RMW reads the latest value);
            // the gate must provide the ordering, which the cell checks.
            let v = inside.fetch_add(1, Ordering::Relaxed);
            assert!(v < WRITER, "a reader inside with the writer");
            data.with(|p| unsafe { *p });
            inside.fetch_sub(1, Ordering::Relaxed);
        };
        let waiting = {
            let (gate, inside, data) = (gate.clone(), inside.clone(), data.clone());
            thread::spawn(move || {
                let _g = gate.try_shared(true).expect("a waiting reader enters");
                reader(&inside, &data);
            })
        };
        let writer = {
            let (gate, inside, data) = (gate.clone(), inside.clone(), data.clone());
            thread::spawn(move || {
                gate.exclusive(|| {
                    assert_eq!(inside.fetch_add(WRITER, Ordering::Relaxed), 0);
                    data.with_mut(|p| unsafe { *p += 1 });
                    inside.fetch_sub(WRITER, Ordering::Relaxed);
                })
            })
        };
        match gate.try_shared(false) {
            Some(_g) => {
                reader(&inside, &data);
                s.saw(ENTERED);
            }
            None => s.saw(BACKED_OUT),
        }
        writer.join().unwrap();
        waiting.join().unwrap();
        assert_eq!(data.with(|p| unsafe { *p }), 1);
        assert_eq!(inside.load(Ordering::Relaxed), 0);
    });
    seen.assert_saw(&[BACKED_OUT, ENTERED]);
}

/// `reset_prefix_cache` (the gate exclusive around `BlockPool::reset`) racing a prefix hit
/// and an allocation, each inside the gate shared as the manager runs them, in the binding's
/// non-blocking mode (a call that meets the writer backs out: `Error::WouldBlock`); the hit
/// keeps its block afterwards, as a sequence would. Reset is one step: it clears the cache
/// only if it ran before the hit, which then misses; a hit that pins makes it refuse.
#[test]
fn reset_racing_a_hit_and_an_allocation() {
    const CLEARED_THEN_MISSED: u32 = 0;
    const PINNED_SO_REFUSED: u32 = 1;
    const WOULD_BLOCK: u32 = 2;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(2), move || {
        let d = digest(1);
        let pool = pool_with_owned_block(2, 1, Some(d));
        pool.release(0, Some(&d)).unwrap();
        let gate = Arc::new(Gate::new());
        // Spawned first: thread 1 uses slot 1, the main thread slot 0 (`gate::slot_index`).
        let hitter = {
            let (pool, gate) = (pool.clone(), gate.clone());
            thread::spawn(move || gate.try_shared(false).map(|_g| pin(&pool, &d)))
        };
        let resetter = {
            let (pool, gate) = (pool.clone(), gate.clone());
            thread::spawn(move || gate.exclusive(|| pool.reset(16)))
        };
        let got = gate.try_shared(false).map(|_g| {
            assert!(
                pool.reserve(1),
                "one block is FREE, the other FREE or CACHED"
            );
            pool.take()
        });
        let hit = hitter.join().unwrap();
        let cleared = resetter.join().unwrap();
        let mut refs = [0, 0];
        if let Some(b) = got {
            refs[b as usize] += 1;
        }
        match hit {
            Some(Hit::Pinned {
                block: 0,
                revived: true,
            }) => {
                assert!(!cleared, "reset cleared a block a sequence holds");
                refs[0] += 1;
                s.saw(PINNED_SO_REFUSED);
            }
            Some(Hit::Miss) => {
                assert!(cleared, "only reset removes the entry here");
                s.saw(CLEARED_THEN_MISSED);
            }
            None => s.saw(WOULD_BLOCK),
            other => panic!("a unit was available throughout: {other:?}"),
        }
        if got.is_none() {
            s.saw(WOULD_BLOCK);
        }
        assert_eq!(pool.peek(&d).is_none(), cleared);
        pool.audit(&refs).unwrap();
    });
    seen.assert_saw(&[CLEARED_THEN_MISSED, PINNED_SO_REFUSED, WOULD_BLOCK]);
}
