//! The pool's eviction order: the lock-free LRU queue (the default), or a policy in locked
//! mode (`eviction`).
//!
//! Locked mode's rule: every transition of a block into or out of CACHED happens while the
//! caller holds `Locked`'s mutex, and the policy is told of it before the mutex is released.
//! The transitions and who makes them (`block_pool`): a release to CACHED (`release_table`,
//! `unpin`), a revival by a prefix hit (`pin`), an eviction (`evict_into`), a withdrawal
//! (`withdraw`) and a reset. A hit on a block that is already OWNED changes no CACHED state
//! and stays lock-free; so does every release that leaves the block OWNED or FREE. So the
//! policy's set is exactly the CACHED blocks whenever the mutex is free, and an eviction under
//! the mutex always claims its victim. Lock order: this mutex, then a digest stripe, then the
//! event log (as the LRU queue's).

use crate::clock::Clock;
use crate::error::{Error, Result};
use crate::eviction::{new_policy, EvictionKind, Policy};
use crate::lru_queue::LruQueue;
use crate::sync::{lock, Mutex, MutexGuard, Padded};
use std::sync::Arc;

pub enum EvictionOrder {
    /// Least recently released first, hits lock-free (`lru_queue`).
    Lru(LruQueue),
    /// Any other policy; the mutex guards the policy and orders every CACHED transition
    /// (module docs).
    Locked(Locked),
}

/// Builds a tenant's own instance (`tenants`), called before the policy's lock is taken.
type Instances = Box<dyn Fn() -> Result<Box<dyn Policy>> + Send + Sync>;

pub struct Locked {
    policy: Padded<Mutex<Box<dyn Policy>>>,
    /// With tenants: a new tenant instance (`set_quota`'s spare).
    instances: Option<Instances>,
    /// Fixed by the kind: whether the policy reads `miss` (S3-FIFO's and ARC's ghosts) and
    /// `set_retention` (priority). The calls that only feed those take no lock otherwise.
    misses: bool,
    retention: bool,
}

impl Locked {
    fn of(kind: EvictionKind, policy: Box<dyn Policy>) -> Self {
        Self {
            policy: Padded(Mutex::new(policy)),
            instances: None,
            misses: matches!(kind, EvictionKind::S3Fifo | EvictionKind::Arc),
            retention: kind == EvictionKind::Priority,
        }
    }
}

impl EvictionOrder {
    pub fn new(kind: EvictionKind, num_blocks: usize, clock: &Arc<Clock>) -> Result<Self> {
        Ok(match new_policy(kind, num_blocks, clock)? {
            None => Self::Lru(LruQueue::new(num_blocks)?),
            Some(policy) => Self::Locked(Locked::of(kind, policy)),
        })
    }

    /// Tenants (`tenants::quotas`): the policy per tenant group, in locked mode (LRU too).
    pub fn with_tenants(kind: EvictionKind, num_blocks: usize, clock: &Arc<Clock>) -> Result<Self> {
        use crate::tenants::quotas::Quotas;
        let quotas = Quotas::new(kind, num_blocks, clock)?;
        let mut locked = Locked::of(kind, Box::new(quotas));
        let clock = clock.clone();
        locked.instances = Some(Box::new(move || {
            Quotas::new_instance(kind, num_blocks, &clock)
        }));
        Ok(Self::Locked(locked))
    }

    /// A pool running `policy` in locked mode (tests of the locked paths with a plain order).
    #[cfg(test)]
    pub fn locked(policy: Box<dyn Policy>) -> Self {
        Self::Locked(Locked::of(EvictionKind::Lru, policy))
    }

    /// The policy's lock, in locked mode.
    pub fn guard(&self) -> Option<MutexGuard<'_, Box<dyn Policy>>> {
        match self {
            Self::Lru(_) => None,
            Self::Locked(l) => Some(lock(&l.policy)),
        }
    }

    /// A new tenant instance for `set_quota` (tenants), built without any lock.
    pub fn new_instance(&self) -> Result<Option<Box<dyn Policy>>> {
        match self {
            Self::Locked(Locked {
                instances: Some(f), ..
            }) => f().map(Some),
            _ => Ok(None),
        }
    }

    /// The lock, if the policy reads misses.
    pub fn guard_for_misses(&self) -> Option<MutexGuard<'_, Box<dyn Policy>>> {
        match self {
            Self::Locked(l) if l.misses => Some(lock(&l.policy)),
            _ => None,
        }
    }

    /// Whether the policy keeps retention (priority): only then must a block that goes FREE
    /// be told (`Retention::DEFAULT`), and only then does `set_retentions` take the lock.
    pub fn keeps_retention(&self) -> bool {
        matches!(self, Self::Locked(l) if l.retention)
    }

    pub fn is_locked(&self) -> bool {
        matches!(self, Self::Locked(_))
    }
}

/// A policy broke locked mode's rule (a bug): what the pool reports.
pub fn out_of_step(what: &str, block: u32) -> Error {
    Error::Broken(format!(
        "eviction policy out of step with the block states: {what} block {block}"
    ))
}

/// The plainest policy, for the tests and loom models of locked mode itself: least recently
/// cached first, with exact `restore`.
#[cfg(test)]
pub mod plain {
    use super::Policy;
    use crate::eviction::{CrossRank, NO_CROSS_RANK};
    use crate::hashing::Digest;
    use crate::lru_queue::Entry;
    use std::collections::{BTreeMap, HashMap};

    #[derive(Default)]
    pub struct PlainLru {
        /// Release order -> record; one per CACHED block.
        queue: BTreeMap<u64, Entry>,
        /// Block -> its key in `queue`, while in the set; after a hit, the key it had.
        at: HashMap<u32, u64>,
        next: u64,
    }

    impl Policy for PlainLru {
        fn cached(&mut self, e: Entry) {
            let seq = self.next;
            self.next += 1;
            assert!(self.queue.insert(seq, e).is_none());
            self.at.insert(e.block, seq);
        }
        fn hit(&mut self, block: u32) {
            let seq = self.at[&block];
            assert!(
                self.queue.remove(&seq).is_some(),
                "hit on block {block} outside the set"
            );
        }
        fn restore(&mut self, e: Entry) {
            let seq = self.at[&e.block];
            assert!(self.queue.insert(seq, e).is_none());
        }
        fn removed(&mut self, block: u32) {
            let seq = self.at.remove(&block).expect("removed block in the set");
            assert!(self.queue.remove(&seq).is_some());
        }
        fn miss(&mut self, _: &Digest) {}
        fn victim(&mut self) -> Option<Entry> {
            let (_, e) = self.queue.pop_first()?;
            self.at.remove(&e.block);
            Some(e)
        }
        fn peek(&mut self) -> Option<Entry> {
            self.queue.first_key_value().map(|(_, &e)| e)
        }
        fn cross_rank(&self, _: u32) -> CrossRank {
            NO_CROSS_RANK
        }
        fn len(&self) -> usize {
            self.queue.len()
        }
        fn entries(&self) -> Vec<Entry> {
            self.queue.values().copied().collect()
        }
        fn clear(&mut self) -> Vec<Entry> {
            self.at.clear();
            std::mem::take(&mut self.queue).into_values().collect()
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::plain::PlainLru;
    use super::EvictionOrder;
    use crate::block_pool::{BlockPool, Hit};
    use crate::hashing::sample_digests;

    /// The same calls on the lock-free LRU and on the plainest locked policy evict in the
    /// same order, hits, failed hits (restore), withdrawals and reset included.
    #[test]
    fn locked_mode_follows_the_calls_as_the_lock_free_queue_does() {
        let run = |locked: bool| {
            let mut pool = BlockPool::new(6, false, false).unwrap();
            if locked {
                pool = pool.with_order(EvictionOrder::locked(Box::<PlainLru>::default()));
            }
            let ds = sample_digests(6);
            assert!(pool.reserve(6));
            let blocks: Vec<u32> = (0..6).map(|_| pool.take()).collect();
            for (b, d) in blocks.iter().zip(&ds) {
                assert!(pool.register(*b, *d, None, || unreachable!()));
            }
            pool.release_table(&blocks, &ds).unwrap();
            let mut spare = 0;
            // A hit on block 3 (revived, then released again: newest), a failed hit on
            // block 1 (revived, then given back: back where it was), a withdrawal of block 4.
            assert!(matches!(
                pool.pin(&ds[3], None, &mut spare),
                Ok(Hit::Pinned { .. })
            ));
            pool.release(blocks[3], Some(&ds[3])).unwrap();
            assert!(matches!(
                pool.pin(&ds[1], None, &mut spare),
                Ok(Hit::Pinned { .. })
            ));
            pool.unpin(blocks[1], &ds[1]).unwrap();
            pool.unreserve(spare);
            pool.withdraw(blocks[4], ds[4].as_bytes().len());
            pool.audit(&[0; 6]).unwrap();
            // Take them all: the withdrawn block comes from the free stack first, then the
            // evictions in order.
            assert!(pool.reserve(6));
            let order: Vec<u32> = (0..6).map(|_| pool.take()).collect();
            pool.audit(&[1; 6]).unwrap();
            order
        };
        let lock_free = run(false);
        assert_eq!(lock_free, vec![4, 5, 2, 1, 0, 3]);
        assert_eq!(run(true), lock_free);
    }

    #[test]
    fn reset_in_locked_mode_frees_in_the_policys_order() {
        let pool = BlockPool::new(3, false, false)
            .unwrap()
            .with_order(EvictionOrder::locked(Box::<PlainLru>::default()));
        let ds = sample_digests(3);
        assert!(pool.reserve(3));
        let blocks: Vec<u32> = (0..3).map(|_| pool.take()).collect();
        for (b, d) in blocks.iter().zip(&ds) {
            assert!(pool.register(*b, *d, None, || unreachable!()));
        }
        pool.release_table(&blocks, &ds).unwrap();
        assert!(pool.reset(ds[0].as_bytes().len()));
        assert_eq!(pool.lru_snapshot().len(), 0);
        pool.audit(&[0; 3]).unwrap();
        // Released tail first: 2, 1, 0 are the policy's order, reused in that order.
        assert!(pool.reserve(3));
        assert_eq!(
            (0..3).map(|_| pool.take()).collect::<Vec<_>>(),
            vec![2, 1, 0]
        );
    }

    /// A call's hits and a failed call's restore take the policy lock separately, so a
    /// tenant's first quota may come between them. Before, the quota dropped the held block
    /// from the shared group and the restore panicked on the missing record; now the block
    /// comes back, moves to its tenant's group, and the cap holds at once.
    #[test]
    fn a_restore_after_its_tenants_first_quota_keeps_the_cap() {
        use crate::clock::Clock;
        use crate::eviction::EvictionKind;
        use crate::tenants::Quota;
        use std::sync::Arc;
        let clock = Arc::new(Clock::default());
        // Tenant 7 (the seventh salt), held by its ref for the whole test.
        let registry = Arc::new(crate::tenants::registry::Registry::default());
        let mut t = 0;
        for i in 1..=7u8 {
            t = registry.acquire(Some(&[i]));
        }
        assert_eq!(t, 7);
        let pool = BlockPool::new(4, false, false)
            .unwrap()
            .with_eviction(EvictionKind::Lru, Some(registry), &clock)
            .unwrap();
        let ds = sample_digests(3);
        assert!(pool.reserve(3));
        let blocks: Vec<u32> = (0..3).map(|_| pool.take()).collect();
        for (b, d) in blocks.iter().zip(&ds) {
            pool.set_tenant(*b, 7);
            assert!(pool.register(*b, *d, None, || unreachable!()));
        }
        pool.release_table(&blocks, &ds).unwrap();
        let mut spare = 0;
        assert!(matches!(
            pool.pin(&ds[0], None, &mut spare),
            Ok(Hit::Pinned { .. })
        ));
        let cap = Quota {
            max_cached: Some(2),
            reserved: 0,
        };
        pool.set_quota(7, cap).unwrap();
        assert_eq!(pool.num_cached(), 2, "the two cached blocks fit the cap");
        pool.unpin(blocks[0], &ds[0]).unwrap();
        pool.unreserve(spare);
        // Three cached for a cap of two: the oldest of the tenant's group went FREE.
        assert_eq!(pool.num_cached(), 2);
        assert_eq!(pool.num_free(), 2);
        pool.audit(&[0; 4]).unwrap();
    }
}
