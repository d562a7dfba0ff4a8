//! Loom models of the atomic protocols: every interleaving of two or three threads (within a
//! preemption bound where noted), under the C11 memory model. Run:
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p pagedkv-core --release
//! --lib loom_models`. The list, by protocol, is in docs/concurrency.md; each pool-level model
//! ends with the full pool audit (`BlockPool::audit`), so "the loser sees a consistent state"
//! is checked, not assumed. Where a model exists for one rare interleaving, it also records
//! which outcomes it saw and fails unless that interleaving was explored.

use crate::block_pool::{BlockPool, Hit};
use crate::block_state::{BlockState, Pin, Released};
use crate::events::KvEvent;
use crate::free_stack::FreeStack;
use crate::gate::Gate;
use crate::hashing::{BlockHasher, Digest, HashAlgo};
use crate::prefix_index::PrefixIndex;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

fn digest(token: u32) -> Digest {
    let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
    h.hash_block(&h.root(), &[token], &[0])
}

/// A pool of `n` blocks whose block 0 is OWNED by `holders` tables and, with `digest`,
/// registered (hashed) under it.
fn pool_with_owned_block(n: u32, holders: u32, digest: Option<Digest>) -> Arc<BlockPool> {
    let pool = Arc::new(BlockPool::new(n, false, false).unwrap());
    assert!(pool.reserve(1));
    let b = pool.take();
    assert_eq!(b, 0);
    (1..holders).for_each(|_| pool.state(b).share().unwrap());
    if let Some(d) = digest {
        assert!(pool.register(b, d, None, || unreachable!()));
    }
    pool
}

/// A pool of `n` blocks, all OWNED by one table each (taken in order `0..n`), with events
/// when `events`.
fn pool_all_owned(n: u32, events: bool) -> Arc<BlockPool> {
    let pool = Arc::new(BlockPool::new(n, events, false).unwrap());
    assert!(pool.reserve(n as usize));
    for b in 0..n {
        assert_eq!(pool.take(), b);
    }
    pool
}

fn stored(d: Digest) -> KvEvent {
    KvEvent::BlockStored {
        block_hash: d,
        parent_block_hash: None,
        token_ids: vec![],
        lora_id: None,
        medium: crate::events::Medium::Gpu,
        group: 0,
    }
}

/// A prefix hit by a caller that reserved nothing. A unit that `pin` reserved for a revival
/// that then did not happen (the block went stale meanwhile) comes back in `spare`; the
/// caller returns it, as `take_prompt_blocks` does, and the audit checks `available`.
fn pin(pool: &BlockPool, d: &Digest) -> Hit {
    let mut spare = 0;
    let hit = pool.pin(d, None, &mut spare).unwrap();
    assert!(spare <= 1, "at most the one unit reserved here");
    pool.unreserve(spare);
    hit
}

/// Explore `f` with loom. `bound`: the preemption bound (None: every interleaving), for the
/// models whose full space would take too long. The branch limit is raised because some
/// models build their start state (dozens of releases) inside the model, where loom counts
/// every atomic step as a branch even with one thread running.
fn model(bound: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    if bound.is_some() {
        b.preemption_bound = bound;
    }
    b.max_branches = 20_000;
    b.check(f);
}

/// Outcomes a model saw across its interleavings (std atomics: outside the model).
#[derive(Clone, Default)]
struct Seen(std::sync::Arc<std::sync::atomic::AtomicU32>);

impl Seen {
    fn saw(&self, outcome: u32) {
        self.0
            .fetch_or(1 << outcome, std::sync::atomic::Ordering::Relaxed);
    }
    fn assert_saw(&self, outcomes: &[u32]) {
        let seen = self.0.load(std::sync::atomic::Ordering::Relaxed);
        for &o in outcomes {
            assert!(seen & (1 << o) != 0, "outcome {o} never explored");
        }
    }
}

// The free stack.

#[test]
fn free_stack_pop_push_never_loses_or_duplicates() {
    loom::model(|| {
        let s = Arc::new(FreeStack::full(2).unwrap());
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
fn free_stack_chain_push_races_pops_without_loss() {
    // One thread pops two ids and gives both back with one chain push while another pops
    // and pushes one: no id is lost or duplicated, and the chain stays linked.
    loom::model(|| {
        let s = Arc::new(FreeStack::full(3).unwrap());
        let chain = {
            let s = s.clone();
            thread::spawn(move || {
                let held: Vec<u32> = [s.pop(), s.pop()].into_iter().flatten().collect();
                s.push_all(&held);
            })
        };
        if let Some(b) = s.pop() {
            s.push(b);
        }
        chain.join().unwrap();
        let mut ids = s.snapshot(8);
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2]);
        assert_eq!(s.len(), 3);
    });
}

#[test]
fn free_stack_concurrent_pops_get_distinct_ids() {
    loom::model(|| {
        let s = Arc::new(FreeStack::full(2).unwrap());
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

// The block state word.

#[test]
fn pin_and_eviction_claim_exclude_each_other() {
    loom::model(|| {
        let st = Arc::new(BlockState::new_free());
        st.take();
        st.set_hashed();
        let Some(Released::ToCached { generation }) = st.release() else {
            panic!("a hashed block's last release caches it")
        };
        let pinner = {
            let st = st.clone();
            thread::spawn(move || st.pin(true))
        };
        let claimed = st.claim_cached(generation, 1);
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

// Admission, release and eviction.

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

/// A prefix hit racing an eviction of the same cached block: either the hit pins it (and the
/// allocator finds nothing to evict, so its reservation fails) or the eviction wins and the
/// hit misses; never both.
#[test]
fn hit_and_eviction_never_share_a_block() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 1, Some(d));
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
            thread::spawn(move || pool.release(0, None).unwrap())
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
            thread::spawn(move || pool.release(0, None).unwrap())
        };
        pool.release(0, None).unwrap();
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
            thread::spawn(move || pool.release(0, Some(&d)).unwrap())
        };
        pool.release(0, Some(&d)).unwrap();
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

// Prefix hits: pin, then compare the digest.

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
            thread::spawn(move || pool.release(0, Some(&d)).unwrap())
        };
        let hit = pin(&pool, &d);
        swapper.join().unwrap();
        match hit {
            Hit::Pinned { block: 0, .. } => pool.audit(&[1]).unwrap(),
            Hit::NoRoom => pool.audit(&[0]).unwrap(),
            other => panic!("the block is hashed throughout: {other:?}"),
        };
    });
}

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

/// Swap-in racing a hit: swap-in evicts the only (cached) block and registers it again under
/// the same digest, while a prompt hits that digest. Exactly one of them gets the cached
/// block; a hit after the re-registration shares the swapped-in block (same content).
#[test]
fn swap_in_reregistration_racing_a_hit() {
    loom::model(|| {
        let d = digest(1);
        let pool = pool_with_owned_block(1, 1, Some(d));
        pool.release(0, Some(&d)).unwrap();
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
        let hit = pin(&pool, &d);
        let swapped_in = swap_in.join().unwrap();
        let pinned = matches!(hit, Hit::Pinned { block: 0, .. });
        match (hit, swapped_in) {
            (Hit::Pinned { block: 0, .. }, _) | (Hit::Miss | Hit::NoRoom, true) => {}
            other => panic!("block handed out twice or lost: {other:?}"),
        }
        let holders = u32::from(swapped_in) + u32::from(pinned);
        assert!(holders >= 1);
        pool.audit(&[holders]).unwrap();
    });
}

/// A hit reads the index slot of `d1`, then the block is evicted and registered again under
/// `d2` (and released, so it is CACHED and hashed: the state word alone would let the pin
/// succeed). The pin must miss: pinning succeeds, the digest comparison fails, and the hit
/// gives the block back with `unpin`, leaving one live record.
#[test]
fn a_hit_on_a_block_reregistered_under_another_digest_misses() {
    const PINNED: u32 = 0;
    const NO_ROOM: u32 = 1;
    const MISSED: u32 = 2;
    const MISSED_AFTER_PINNING: u32 = 3;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(2), move || {
        let (d1, d2) = (digest(1), digest(2));
        let pool = pool_with_owned_block(1, 1, Some(d1));
        pool.release(0, Some(&d1)).unwrap();
        let reuser = {
            let pool = pool.clone();
            thread::spawn(move || {
                if !pool.reserve(1) {
                    return false;
                }
                assert_eq!(pool.take(), 0);
                assert!(pool.register(0, d2, None, || unreachable!()));
                pool.release(0, Some(&d2)).unwrap();
                true
            })
        };
        let hit = pin(&pool, &d1);
        let reused = reuser.join().unwrap();
        match hit {
            Hit::Pinned {
                block: 0,
                revived: true,
            } => {
                assert!(!reused, "the hit held the only unit");
                assert!(pool.index_holds(0, &d1));
                pool.audit(&[1]).unwrap();
                s.saw(PINNED);
                return;
            }
            Hit::NoRoom => s.saw(NO_ROOM),
            Hit::Miss => {
                // The reuser's release queued one record; a hit that pinned the block and
                // gave it back restored a second one (the first is then stale).
                let records = pool.lru_snapshot().len();
                s.saw(if records == 2 {
                    MISSED_AFTER_PINNING
                } else {
                    MISSED
                });
            }
            other => panic!("a hit on a reused block: {other:?}"),
        }
        assert!(reused);
        assert_eq!(pool.peek(&d1), None);
        assert!(pool.peek(&d2).is_some_and(|p| p.cached));
        pool.audit(&[0]).unwrap();
    });
    seen.assert_saw(&[PINNED, NO_ROOM, MISSED, MISSED_AFTER_PINNING]);
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

// Registration, stripes and events.

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
        assert_eq!(pool.drain_events(), vec![stored(d)]);
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
        assert_eq!(pool.drain_events(), vec![stored(d)]);
        let registrar = {
            let pool = pool.clone();
            thread::spawn(move || pool.register(1, d, None, || stored(d)))
        };
        assert!(pool.reserve(1));
        assert_eq!(pool.take(), 0, "the free stack is empty: evicts block 0");
        let registered = registrar.join().unwrap();
        // Replay from "d is cached" (each event must change the state it names).
        let mut present = true;
        for e in pool.drain_events() {
            match e {
                KvEvent::BlockStored { block_hash, .. } => {
                    assert_eq!(block_hash, d);
                    assert!(!present, "stored while already cached");
                    present = true;
                }
                KvEvent::BlockRemoved { block_hash, .. } => {
                    assert_eq!(block_hash, d);
                    assert!(present, "removed while not cached");
                    present = false;
                }
                KvEvent::AllBlocksCleared => panic!("no reset here"),
            }
        }
        assert_eq!(present, pool.peek(&d).is_some());
        assert_eq!(present, registered);
        s.saw(if registered { REGISTERED } else { REFUSED });
        pool.audit(&[1, 1]).unwrap();
    });
    seen.assert_saw(&[REGISTERED, REFUSED]);
}

/// The buckets of the index of a 17-block pool: 4 slots a block, 8 a bucket, 68 slots.
const BUCKETS_OF_17: u64 = 9;

/// The smallest digest word that `PrefixIndex::buckets_of` maps to `bucket` of
/// `BUCKETS_OF_17` (it takes the high bits of `word * buckets`), plus `i`, which keeps it there.
fn word_in(bucket: u64, i: u64) -> u64 {
    (u128::from(bucket) << 64).div_ceil(u128::from(BUCKETS_OF_17)) as u64 + i
}

/// A digest whose two buckets in a 17-block pool's index are `first` and `second`, distinct
/// from the others in word 2 (and so in its tag).
fn colliding(i: u64, first: u64, second: u64) -> Digest {
    Digest::from_words([word_in(first, i), word_in(second, i), i, i], 32)
}

/// A registration whose insert fails (both buckets full) racing a hit on a stale index slot
/// of the same block: the block is marked hashed for a moment with a digest no slot names,
/// then unmarked. The hit either revives the block before the eviction or misses (stale
/// word, or pinned in the window and refused by the digest comparison); it never keeps it.
#[test]
fn a_failed_registration_racing_a_hit_on_the_same_block() {
    const PINNED: u32 = 0;
    const NOT_PINNED: u32 = 1;
    let seen = Seen::default();
    let s = seen.clone();
    model(Some(2), move || {
        // 17 blocks: 9 buckets of 8 slots; blocks 0..16 fill buckets 0 and 1.
        let pool = pool_all_owned(17, false);
        for b in 0..16 {
            let filler = colliding(u64::from(b) + 1, 0, 1);
            assert!(pool.register(b, filler, None, || unreachable!()));
        }
        let (old, full) = (colliding(100, 2, 3), colliding(200, 0, 1));
        assert!(pool.register(16, old, None, || unreachable!()));
        pool.release(16, Some(&old)).unwrap();
        let allocator = {
            let pool = pool.clone();
            thread::spawn(move || {
                if !pool.reserve(1) {
                    return false;
                }
                assert_eq!(pool.take(), 16);
                assert!(!pool.register(16, full, None, || unreachable!()));
                pool.release(16, None).unwrap();
                true
            })
        };
        let hit = pin(&pool, &old);
        let allocated = allocator.join().unwrap();
        let mut refs = [1; 17];
        refs[16] = 0;
        match hit {
            Hit::Pinned {
                block: 16,
                revived: true,
            } => {
                assert!(!allocated, "the hit held the only unit");
                refs[16] = 1;
                s.saw(PINNED);
            }
            Hit::Miss | Hit::NoRoom => {
                assert!(allocated);
                assert_eq!(pool.peek(&old), None);
                s.saw(NOT_PINNED);
            }
            other => panic!("a hit kept a block it must not: {other:?}"),
        }
        assert_eq!(pool.peek(&full), None, "the failed insert left no entry");
        pool.audit(&refs).unwrap();
    });
    seen.assert_saw(&[PINNED, NOT_PINNED]);
}

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

// The reset gate.

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
            thread::spawn(move || gate.exclusive(|| pool.reset()))
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
