//! The GPU block pool: block states, the free stack, the LRU queue of cached blocks, the
//! prefix index and the admission counter, with the transitions of the lifecycle contract.
//!
//! Admission: `available` counts FREE + CACHED blocks that no caller has been promised.
//! A caller reserves units first (one CAS loop, all or nothing) and only then takes blocks,
//! so a batch never gets half its blocks and rolls back. A block is counted in `available`
//! only after it is findable (pushed on the free stack or queued in the LRU), so a caller
//! holding a unit always finds a block, possibly after a racing taker moved on.
//!
//! By concern: this file holds the struct, admission and the read-only views; `evict`
//! takes blocks (free stack, then eviction), `release` gives them back, `prefix` changes
//! the prefix cache (hits, registration, withdrawal), `reset` clears it, `groups` and
//! `tenants` keep each block's group and tenant with their tallies and quotas.

use crate::alloc::try_boxed;
use crate::block_state::{BlockState, RC_MAX};
use crate::error::{Error, Result};
use crate::events::{EventLog, KvEvent};
use crate::eviction_order::EvictionOrder;
use crate::free_stack::FreeStack;
use crate::hashing::{Digest, Tag};
use crate::lru_queue::{Entry, LruQueue};
use crate::prefix_index::PrefixIndex;
use crate::sync::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Mutex, Ordering, Padded};
use crate::tenants::registry::Registry;
use std::sync::Arc;

mod evict;
mod groups;
mod prefix;
mod release;
mod reset;
mod tenants;

pub use groups::GroupTally;

/// Number of digest stripes (a power of two).
pub(crate) const STRIPES: usize = 256;

/// What a read-only look at a digest's block saw (a snapshot; `pin` decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peek {
    pub block: u32,
    /// CACHED and not pinned: a hit must revive it with one unit of `available` (a pinned
    /// CACHED block is revived without one: its unit was never counted).
    pub cached: bool,
    /// It already has `RC_MAX` holders.
    pub full: bool,
}

/// What `withdraw` did to a block (`evict_blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Withdrawal {
    /// It was not in the prefix cache.
    NotCached,
    /// It was CACHED: it is FREE now, on top of the free stack.
    Freed,
    /// It was OWNED: its holders keep it, unhashed (FREE after its last release).
    Unhashed,
}

/// What a prefix hit got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hit {
    /// Referenced; `revived` when it was CACHED (so a failed caller gives it back with
    /// `unpin`).
    Pinned { block: u32, revived: bool },
    /// The digest is not cached (any more).
    Miss,
    /// It is cached but no unit of `available` was left to revive it.
    NoRoom,
    /// It is cached, but already has `RC_MAX` holders.
    Full(u32),
}

pub struct BlockPool {
    /// One word per block; see `block_state` for the states.
    states: Box<[BlockState]>,
    /// Exactly the FREE blocks (at quiescence).
    free: FreeStack,
    /// The eviction order of the CACHED blocks: the LRU queue (one live record per CACHED
    /// block, oldest release first) or a policy in locked mode (`eviction_order`).
    order: EvictionOrder,
    /// FREE + CACHED blocks not promised to any caller; see the module docs. Increments are
    /// Release and successful reservations Acquire (see `reserve`); reads for `can_allocate`
    /// and statistics are Relaxed snapshots.
    available: Padded<AtomicUsize>,
    /// Number of CACHED blocks; raised before the LRU record is queued and lowered after a
    /// claim or revival, so it never underflows; exact at quiescence. Relaxed everywhere: a
    /// tally for statistics and `reset`'s idle check, never used to order memory.
    cached: Padded<AtomicUsize>,
    index: PrefixIndex,
    /// `stripes[d]` serialises every change of the index entries whose digest falls in
    /// stripe `d` together with its event: register (check, insert, `BlockStored`) and
    /// claim (state, removal, `BlockRemoved`). So a digest is registered at most once, and
    /// per digest the events are queued in the order the index changed. Lock order: the LRU
    /// lock, then a stripe, then the event log.
    stripes: Box<[Padded<Mutex<()>>]>,
    events: Option<EventLog>,
    /// Report each eviction to the evicting call's capture (`duties`; tiers copy the block
    /// out before its new owner writes it).
    record_evictions: bool,
    /// Cached blocks evicted so far (a tally: Relaxed everywhere).
    evictions: Padded<AtomicU64>,
    /// With tenants: the tenant of each block's registering sequence, written by that holder
    /// right before it registers the block and read under the policy lock by the release that
    /// caches it (the state word's Release/AcqRel chain orders it). Relaxed. Empty without.
    tenant: Box<[AtomicU32]>,
    /// With tenants: the registry, whose per-tenant `cached` counts every CACHED transition
    /// here changes (`count_cached`), so that a tenant with nothing left leaves it.
    registry: Option<Arc<Registry>>,
    /// CACHED blocks that are pinned (never evicted; not in the eviction order, their units
    /// not in `available`). Raised after the release that cached them, lowered after the
    /// revival or withdrawal that took them out: exact at quiescence. Relaxed everywhere: a
    /// tally for statistics and the audit.
    pinned: Padded<AtomicUsize>,
    /// With several KV-cache groups: the group whose tables hold each OWNED or CACHED block
    /// (its index key is `digest.keyed(group)`). Written by the taker right after `take`,
    /// before the block is shared, registered or released; read by its holders and, for a
    /// CACHED block, by whoever claims it under its stripe. Relaxed: those hand-overs
    /// (the sequence locks, the state word's Release/Acquire) order it. Empty with one
    /// group, where every block is group 0.
    group: Box<[AtomicU8]>,
    /// One tally per group with several groups (empty otherwise): what `stats()` reports.
    tallies: Box<[Padded<GroupTally>]>,
    /// Block 0 is the null block: taken when the pool is built and never released (the
    /// table entry of a position a group no longer needs). Only with non-full groups.
    null: bool,
}

/// A digest's stripe: the low bits of word 0, which every digest length has (a 16-byte
/// XXH3 digest is zero past word 1). The prefix index reads the high bits of words 0 and 1
/// (bucket choice), and bits 32..64 of word 0, 8..40 of word 1 and words 2 and 3 (slot
/// tag); the prefix lock reads the low bits of word 1 (`manager::prefix_lock_of`). So a
/// stripe is independent of those choices.
pub(crate) fn stripe_of(digest: &Digest) -> usize {
    digest.words()[0] as usize & (STRIPES - 1)
}
impl BlockPool {
    /// `tagged`: hits are confirmed with a secret tag (see `hit_tag`). Fails with
    /// `OutOfMemory` (nothing allocated is kept) when the pool's tables do not fit.
    pub fn new(num_blocks: u32, events: bool, tagged: bool) -> Result<Self> {
        let n = num_blocks as usize;
        Ok(Self {
            states: try_boxed(n, |_| BlockState::new_free(), "the block states")?,
            free: FreeStack::full(num_blocks)?,
            order: EvictionOrder::Lru(LruQueue::new(n)?),
            available: Padded(AtomicUsize::new(n)),
            cached: Padded(AtomicUsize::new(0)),
            index: PrefixIndex::new(n, tagged)?,
            stripes: try_boxed(STRIPES, |_| Padded(Mutex::new(())), "the digest stripes")?,
            events: events.then(EventLog::new),
            record_evictions: false,
            evictions: Padded(AtomicU64::new(0)),
            pinned: Padded(AtomicUsize::new(0)),
            tenant: Box::new([]),
            registry: None,
            group: Box::new([]),
            tallies: Box::new([]),
            null: false,
        })
    }

    /// The same pool, running `order` (tests of locked mode with a plain policy).
    #[cfg(test)]
    pub fn with_order(mut self, order: EvictionOrder) -> Self {
        self.order = order;
        self
    }

    /// The same pool, reporting its evictions (see `record_evictions`).
    pub fn with_eviction_log(mut self) -> Self {
        self.record_evictions = true;
        self
    }

    pub fn num_blocks(&self) -> usize {
        self.states.len()
    }

    pub fn state(&self, block: u32) -> &BlockState {
        &self.states[block as usize]
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_cached(&self) -> usize {
        self.cached.load(Ordering::Relaxed)
    }

    /// Blocks an allocation could take now (FREE + CACHED, minus promises in flight).
    pub fn num_available(&self) -> usize {
        self.available.load(Ordering::Relaxed)
    }

    /// Promise `k` blocks to the caller, all or none.
    pub fn reserve(&self, k: usize) -> bool {
        if k == 0 {
            return true;
        }
        // Acquire on success: pairs with the Release increment of whoever made the unit
        // available, so the block it pushed or queued before counting it is visible to our
        // `take`. (The free-stack pop and the LRU claim give the acquire edges on the blocks.)
        self.available
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |a| a.checked_sub(k))
            .is_ok()
    }

    /// Return unused promises.
    pub fn unreserve(&self, k: usize) {
        if k > 0 {
            // Release: the units name blocks that were findable when we reserved them.
            self.available.fetch_add(k, Ordering::Release);
        }
    }

    pub(super) fn is_live(&self, e: &Entry) -> bool {
        let w = self.state(e.block).load();
        w.is_cached() && w.generation() == e.generation
    }

    /// Queue an event that is not an index change (the CPU copies of swap).
    pub fn push_event(&self, event: impl FnOnce() -> KvEvent) {
        if let Some(log) = &self.events {
            log.push(event());
        }
    }

    /// Bring the index buckets of digests about to be registered into cache (see
    /// `PrefixIndex::warm`).
    pub fn warm_index(&self, digests: &[Digest], blocks: &[u32]) {
        self.index.warm(digests, blocks);
    }

    /// The queued events (none when events are disabled); refused after an overflow.
    pub fn drain_events(&self) -> Result<Vec<KvEvent>> {
        self.events.as_ref().map_or(Ok(Vec::new()), EventLog::drain)
    }

    /// The event log, when events are enabled.
    pub fn event_log(&self) -> Option<&EventLog> {
        self.events.as_ref()
    }

    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// CACHED blocks that are pinned (a snapshot; exact at quiescence).
    pub fn num_pinned_cached(&self) -> usize {
        self.pinned.load(Ordering::Relaxed)
    }

    /// Pin (`on`) or unpin the OWNED `block` for a holder: a pinned block is never evicted
    /// (`block_state`). False if the block has no holder (a caller bug).
    pub fn set_pinned(&self, block: u32, on: bool) -> bool {
        self.state(block).set_pinned(on)
    }

    // Read-only views for the audit.
    pub fn free_snapshot(&self) -> Vec<u32> {
        self.free.snapshot(self.states.len() + 1)
    }

    /// The eviction order's records: the LRU queue's, oldest first, live or stale; a
    /// policy's set, in no order.
    pub fn lru_snapshot(&self) -> Vec<Entry> {
        match &self.order {
            EvictionOrder::Lru(lru) => lru.snapshot(),
            EvictionOrder::Locked(_) => self.order.guard().map_or(Vec::new(), |p| p.entries()),
        }
    }

    /// Whether the policy runs in locked mode (`eviction_order`).
    pub fn locked_order(&self) -> bool {
        self.order.is_locked()
    }

    pub fn index_snapshot(&self) -> Vec<(u32, bool)> {
        self.index.snapshot()
    }

    pub fn index_holds(&self, block: u32, digest: &Digest) -> bool {
        self.index.holds(block, digest)
    }

    pub fn index_tag_is(&self, block: u32, tag: Option<Tag>) -> bool {
        self.index.tag_is(block, tag)
    }

    pub fn index_digest_words(&self, block: u32) -> [u64; 4] {
        self.index.stored(block, 32).words()
    }

    pub fn lru_entry_is_live(&self, e: &Entry) -> bool {
        self.is_live(e)
    }
}

/// Refcount limit for callers that map `Hit::Full` to an error.
pub fn refcount_overflow(block: u32) -> Error {
    Error::RefcountOverflow {
        block,
        limit: RC_MAX,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::events::Medium;

    use crate::hashing::sample_digests as digests;

    #[test]
    fn admission_is_all_or_nothing() {
        let pool = BlockPool::new(3, false, false).unwrap();
        assert!(!pool.reserve(4));
        assert_eq!(pool.num_available(), 3);
        assert!(pool.reserve(3));
        assert!(!pool.reserve(1));
        pool.unreserve(1);
        assert!(pool.reserve(1));
    }

    #[test]
    fn cached_blocks_are_hit_revived_and_evicted_oldest_first() {
        let pool = BlockPool::new(3, true, false).unwrap();
        let ds = digests(2);
        assert!(pool.reserve(3));
        let (a, b, c) = (pool.take(), pool.take(), pool.take());
        assert!(pool.register(a, ds[0], None, || KvEvent::AllBlocksCleared));
        assert!(pool.register(b, ds[1], None, || KvEvent::AllBlocksCleared));
        assert!(
            !pool.register(c, ds[0], None, || unreachable!()),
            "content already cached"
        );
        pool.release(c, None).unwrap();
        assert_eq!(
            pool.num_free(),
            1,
            "a duplicate stays unhashed and is freed"
        );
        assert!(pool.reserve(1));
        assert_eq!(pool.take(), c);
        pool.release(a, Some(&ds[0])).unwrap();
        pool.release(b, Some(&ds[1])).unwrap();
        assert_eq!((pool.num_cached(), pool.num_available()), (2, 2));
        assert!(pool.peek(&ds[0]).is_some_and(|p| p.cached && !p.full));
        // A hit on a cached block needs a unit: none spare and none left means NoRoom.
        assert!(pool.reserve(2));
        let mut spare = 0;
        assert_eq!(pool.pin(&ds[0], None, &mut spare), Ok(Hit::NoRoom));
        pool.unreserve(2);
        assert_eq!(
            pool.pin(&ds[0], None, &mut spare),
            Ok(Hit::Pinned {
                block: a,
                revived: true
            })
        );
        assert_eq!(pool.num_available(), 1);
        // Released again, `a` is now newer than `b`: `b` is evicted first.
        pool.release(a, Some(&ds[0])).unwrap();
        assert!(pool.reserve(1));
        assert_eq!(pool.take(), b);
        assert_eq!(pool.evictions(), 1);
        assert!(pool.peek(&ds[1]).is_none(), "evicted digests no longer hit");
        assert_eq!(pool.pin(&ds[1], None, &mut spare), Ok(Hit::Miss));
        let events = pool.drain_events().unwrap();
        assert_eq!(
            events.last(),
            Some(&KvEvent::BlockRemoved {
                block_hash: ds[1],
                medium: Medium::Gpu,
                group: 0,
            })
        );
        // Reset refuses while `b` and `c` are owned, then clears the rest.
        assert!(!pool.reset(ds[0].as_bytes().len()));
        pool.release(b, None).unwrap();
        pool.release(c, None).unwrap();
        assert!(pool.reset(ds[0].as_bytes().len()));
        assert_eq!((pool.num_free(), pool.num_cached()), (3, 0));
        assert!(pool.peek(&ds[0]).is_none());
    }
}
