//! The LRU queue (`lru_queue.rs`): compaction and `unpin` racing revivals and evictions.

use super::{digest, model, pin, pool_all_owned, Seen};
use crate::block_pool::Hit;
use loom::thread;

/// LRU compaction (the queue past `2 * num_blocks + 64` records drops the stale ones) racing
/// a revival and a release: compaction keeps exactly the live records, so afterwards every
/// CACHED block has one live record and both are found by evictions.
#[test]
fn lru_compaction_racing_a_revival() {
    // Records left: 3 when the compaction kept block 1's record and the revival then made
    // it stale; 2 when the revival came first.
    const KEPT_A_RECORD_THEN_REVIVED: u32 = 3;
    const REVIVED_FIRST: u32 = 2;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(2), move || {
        let (d0, d1) = (digest(1), digest(2));
        let pool = pool_all_owned(2, false);
        assert!(pool.register(0, d0, None, || unreachable!()));
        assert!(pool.register(1, d1, None, || unreachable!()));
        pool.release(1, Some(&d1)).unwrap();
        pool.release(0, Some(&d0)).unwrap();
        // Revive and release block 0 until the queue is at its bound (68 records, 67 of
        // them block 0's), then revive it once more and keep it.
        let bound = 2 * 2 + 64;
        for _ in 0..bound - 2 {
            assert!(matches!(pin(&pool, &d0), Hit::Pinned { block: 0, .. }));
            pool.release(0, Some(&d0)).unwrap();
        }
        assert!(matches!(pin(&pool, &d0), Hit::Pinned { block: 0, .. }));
        assert_eq!(pool.lru_snapshot().len(), bound);
        let reviver = {
            let pool = pool.clone();
            thread::spawn(move || {
                let hit = pin(&pool, &d1);
                assert!(matches!(hit, Hit::Pinned { block: 1, .. }));
                pool.release(1, Some(&d1)).unwrap();
            })
        };
        // This push (or the reviver's) crosses the bound and compacts.
        pool.release(0, Some(&d0)).unwrap();
        reviver.join().unwrap();
        let len = pool.lru_snapshot().len() as u32;
        assert!(len == 2 || len == 3, "{len} records after compaction");
        s.saw(len);
        pool.audit(&[0, 0]).unwrap();
        assert!(pool.reserve(2));
        let mut got = Vec::new();
        pool.take_into(2, &mut got);
        got.sort_unstable();
        assert_eq!(got, [0, 1]);
        pool.audit(&[1, 1]).unwrap();
    });
    seen.assert_saw(&[KEPT_A_RECORD_THEN_REVIVED, REVIVED_FIRST]);
}

/// `unpin` (a failed call giving back a block it revived) racing an eviction: the block ends
/// either reused or back in the LRU at its old position with one live record.
#[test]
fn unpin_racing_an_eviction() {
    const TOOK_THE_UNPINNED: u32 = 0;
    const TOOK_THE_OTHER: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        let (d0, d1) = (digest(1), digest(2));
        let pool = pool_all_owned(2, false);
        assert!(pool.register(0, d0, None, || unreachable!()));
        assert!(pool.register(1, d1, None, || unreachable!()));
        // Block 0 is released first, so it is the older one.
        pool.release(0, Some(&d0)).unwrap();
        pool.release(1, Some(&d1)).unwrap();
        assert_eq!(
            pin(&pool, &d0),
            Hit::Pinned {
                block: 0,
                revived: true
            }
        );
        let unpinner = {
            let pool = pool.clone();
            thread::spawn(move || pool.unpin(0, &d0).unwrap())
        };
        assert!(pool.reserve(1), "block 1 is CACHED throughout");
        let got = pool.take();
        unpinner.join().unwrap();
        let mut refs = [0, 0];
        refs[got as usize] = 1;
        pool.audit(&refs).unwrap();
        // The block not taken is CACHED with one live record, and the next eviction finds it.
        s.saw(if got == 0 {
            TOOK_THE_UNPINNED
        } else {
            TOOK_THE_OTHER
        });
        assert!(pool.reserve(1));
        assert_eq!(pool.take(), 1 - got);
        pool.audit(&[1, 1]).unwrap();
    });
    // Restored at its old position, block 0 is evicted first once it is back.
    seen.assert_saw(&[TOOK_THE_UNPINNED, TOOK_THE_OTHER]);
}
