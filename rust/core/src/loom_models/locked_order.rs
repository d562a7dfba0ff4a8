//! An eviction policy in locked mode (`eviction_order`): every transition into or out of
//! CACHED happens under the policy's lock, so the policy's set is exactly the CACHED blocks.
//! The audit checks that (a locked policy may hold no record of a block that is not CACHED
//! with that generation, and must hold one per CACHED block) after each race: a hit against
//! the last release, against an eviction, and a withdrawal against a release and a failed
//! hit (the restore path). The lock-free LRU's versions of these races are in `hits` and
//! `withdraw`.

use super::{digest, locked_pool_with_owned_block, model, pin, Seen};
use crate::block_pool::{Hit, Withdrawal};
use loom::thread;

/// The digest length of `digest` (XXH3-128).
const LEN: usize = 16;

/// The last holder releases its hashed block while a prompt hits it. The hit shares the
/// OWNED block (no policy call), revives the CACHED one (the policy's `hit`, under the lock
/// the release's `cached` also took), or finds no unit; the policy agrees each way.
#[test]
fn hit_racing_the_last_release() {
    const SHARED: u32 = 0;
    const REVIVED: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(None, move || {
        let d = digest(1);
        let pool = locked_pool_with_owned_block(2, 1, Some(d));
        let releaser = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, Some(&d)).unwrap())
        };
        let hit = pin(&pool, &d);
        releaser.join().unwrap();
        match hit {
            Hit::Pinned {
                block: 0,
                revived: false,
            } => s.saw(SHARED),
            Hit::Pinned {
                block: 0,
                revived: true,
            } => s.saw(REVIVED),
            other => panic!("a unit was free and the block hashed throughout: {other:?}"),
        }
        // Whoever went last, the hitter holds the block now.
        pool.audit(&[1, 0]).unwrap();
        assert_eq!(pool.lru_snapshot().len(), 0, "OWNED: not in the policy");
    });
    seen.assert_saw(&[SHARED, REVIVED]);
}

/// A hit racing an eviction of the only (CACHED) block: exactly one of them gets it.
#[test]
fn hit_racing_an_eviction() {
    model(None, || {
        let d = digest(1);
        let pool = locked_pool_with_owned_block(1, 1, Some(d));
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
        assert_eq!(pool.lru_snapshot().len(), 0);
    });
}

/// The holder releases its block, hits it again and gives it back unused (a failed call:
/// the policy's `restore`), while `evict_blocks` withdraws it (the policy's `removed` when
/// it was CACHED). Every landing point ends with the block FREE and out of the policy.
#[test]
fn withdrawal_racing_a_release_and_a_failed_hit() {
    const BEFORE_RELEASE: u32 = 0;
    const WHILE_CACHED: u32 = 1;
    const WHILE_PINNED: u32 = 2;
    const AFTER_RESTORE: u32 = 3;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(3), move || {
        let d = digest(1);
        let pool = locked_pool_with_owned_block(2, 1, Some(d));
        let holder = {
            let pool = pool.clone();
            thread::spawn(move || {
                pool.release(0, Some(&d)).unwrap();
                let mut spare = 0;
                let hit = pool.pin(&d, None, &mut spare).unwrap();
                pool.unreserve(spare);
                if let Hit::Pinned { block, revived } = hit {
                    assert!(revived, "nobody else held it");
                    pool.unpin(block, &d).unwrap();
                }
                hit
            })
        };
        let w = pool.withdraw(0, LEN);
        let hit = holder.join().unwrap();
        pool.audit(&[0, 0]).unwrap();
        assert!(pool.state(0).load().is_free(), "FREE whoever went last");
        assert_eq!(
            pool.lru_snapshot().len(),
            0,
            "nothing CACHED, nothing in the policy"
        );
        assert_eq!((pool.num_free(), pool.num_available()), (2, 2));
        match (w, hit) {
            (Withdrawal::Unhashed, Hit::Miss) => s.saw(BEFORE_RELEASE),
            (Withdrawal::Freed, Hit::Miss) => s.saw(WHILE_CACHED),
            (Withdrawal::Unhashed, Hit::Pinned { .. }) => s.saw(WHILE_PINNED),
            (Withdrawal::Freed, Hit::Pinned { .. }) => s.saw(AFTER_RESTORE),
            other => panic!("unexpected outcome {other:?}"),
        }
    });
    seen.assert_saw(&[BEFORE_RELEASE, WHILE_CACHED, WHILE_PINNED, AFTER_RESTORE]);
}

/// Two holders release the same hashed block at once: one release makes it CACHED, and the
/// policy gets exactly one record of it, which an eviction then claims.
#[test]
fn two_last_releases_queue_one_record() {
    model(None, || {
        let d = digest(1);
        let pool = locked_pool_with_owned_block(1, 2, Some(d));
        let other = {
            let pool = pool.clone();
            thread::spawn(move || pool.release(0, Some(&d)).unwrap())
        };
        pool.release(0, Some(&d)).unwrap();
        other.join().unwrap();
        pool.audit(&[0]).unwrap();
        assert_eq!(pool.lru_snapshot().len(), 1);
        assert!(pool.reserve(1));
        assert_eq!(pool.take(), 0);
        assert_eq!(pool.evictions(), 1);
        pool.audit(&[1]).unwrap();
    });
}
