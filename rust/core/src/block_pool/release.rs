//! Releasing blocks: the last reference makes a block FREE or CACHED (queued in the
//! eviction order), and a failed call's hits are given back (`unpin`).

use super::groups::{down, up};
use super::tenants::TenantDeltas;
use super::BlockPool;
use crate::block_state::Released;
use crate::error::{Error, Result};
use crate::eviction::{Policy, Retention};
use crate::eviction_order::EvictionOrder;
use crate::hashing::Digest;
use crate::lru_queue::Entry;
use crate::sync::{prefetch, MutexGuard, Ordering};

/// What a table's release did to its blocks (`release_states`).
struct ReleasedTable {
    /// Records of the blocks that became CACHED (not pinned), tail first.
    cached: Vec<Entry>,
    /// Blocks that became FREE, tail first.
    freed: Vec<u32>,
    /// Blocks that became CACHED and pinned.
    pinned: usize,
    /// The caller's table disagreed with the block states.
    broken: Option<String>,
}

type PolicyGuard<'a> = MutexGuard<'a, Box<dyn Policy>>;

impl BlockPool {
    /// Drop one reference; `digest` is the block's chain digest if the holder has one (it
    /// must when the block is hashed).
    pub fn release(&self, block: u32, digest: Option<&Digest>) -> Result<()> {
        match digest {
            Some(d) => self.release_table(&[block], std::slice::from_ref(d)),
            None => self.release_table(&[block], &[]),
        }
    }

    /// Drop one reference to each of a table's blocks, last entry first (so chain tails are
    /// queued before their heads, and the freed tail is on top of the free stack: both are
    /// reused first, as in vLLM); `digests[i]` is entry `i`'s chain digest where it has one.
    /// The records of blocks that become CACHED are queued under one lock. An error means
    /// the caller's table disagreed with the block states (a bug): the manager breaks.
    pub fn release_table(&self, blocks: &[u32], digests: &[Digest]) -> Result<()> {
        self.release_table_inner(blocks, digests, false).map(drop)
    }

    /// `release_table` that keeps, for the caller, the units of the blocks that become FREE
    /// or CACHED instead of counting them in `available`: the caller holds them as if it had
    /// reserved them (a step that frees blocks and takes others; see `grouped`). Returns
    /// their number.
    pub fn release_table_held(&self, blocks: &[u32], digests: &[Digest]) -> Result<usize> {
        self.release_table_inner(blocks, digests, true)
    }

    fn release_table_inner(&self, blocks: &[u32], digests: &[Digest], held: bool) -> Result<usize> {
        // Locked mode: a hashed block may become CACHED here, so the policy's lock is held
        // from before the first release until the policy knows (`eviction_order`). Without
        // digests no block can become CACHED (a hashed one would be a broken table).
        let mut policy = if digests.is_empty() {
            None
        } else {
            self.order.guard()
        };
        let mut out = self.release_states(blocks, digests);
        // One update of each shared word per call, not per block.
        if !out.freed.is_empty() {
            self.forget_retentions(&mut policy, &out.freed);
            self.push_freed(&mut out.freed, held);
        }
        if out.pinned > 0 {
            // Relaxed: tallies (see the fields).
            self.cached.fetch_add(out.pinned, Ordering::Relaxed);
            self.pinned.fetch_add(out.pinned, Ordering::Relaxed);
        }
        if !out.cached.is_empty() {
            // Relaxed: a tally, raised before the records can be claimed.
            self.cached.fetch_add(out.cached.len(), Ordering::Relaxed);
            let trims = self.queue_cached(policy.as_deref_mut(), &out.cached);
            drop(policy);
            match trims {
                // Already counted in `available` (as CACHED): only their place changes.
                Ok(trims) => self.free.push_all(&trims),
                Err(msg) => out.broken = Some(msg),
            }
            if !held {
                // Release: a reserver that takes these units sees the queued records.
                self.available
                    .fetch_add(out.cached.len(), Ordering::Release);
            }
            // Held units need no edge here: their holder pushed or queued the blocks itself,
            // and whatever block it then takes comes with the pop's or claim's Acquire.
        }
        let units = out.freed.len() + out.cached.len();
        out.broken.map_or(Ok(units), |msg| Err(Error::Broken(msg)))
    }

    /// Drop one reference to each block, last entry first, counting each group's share;
    /// sorts the blocks by what became of them. Touches no shared word but the states and
    /// the group tallies.
    fn release_states(&self, blocks: &[u32], digests: &[Digest]) -> ReleasedTable {
        let mut out = ReleasedTable {
            cached: Vec::with_capacity(blocks.len()),
            freed: Vec::with_capacity(blocks.len()),
            pinned: 0,
            broken: None,
        };
        // Every state's line in flight before the first release's locked instruction.
        blocks.iter().for_each(|&b| prefetch(self.state(b)));
        for (i, &block) in blocks.iter().enumerate().rev() {
            let released = self.state(block).release();
            self.count_released(block, released);
            // A pinned block is counted now (no cap trims it); the others with the trims
            // their caching brings (`cache_by_tenants`), in one step.
            if matches!(released, Some(Released::ToCached { pinned: true, .. })) {
                self.count_cached(block, true);
            }
            match released {
                Some(Released::StillOwned) => {}
                Some(Released::ToFree) => out.freed.push(block),
                // Pinned: CACHED, findable, but outside the eviction order and `available`.
                Some(Released::ToCached { pinned: true, .. }) => out.pinned += 1,
                Some(Released::ToCached { generation, .. }) => match digests.get(i) {
                    Some(&digest) => out.cached.push(Entry {
                        block,
                        generation,
                        digest,
                    }),
                    None => {
                        out.broken = Some(format!("hashed block {block} released without digest"))
                    }
                },
                None => out.broken = Some(format!("released block {block}, which has no holder")),
            }
        }
        out
    }

    /// A FREE block's content is gone: so is any retention a holder gave it. Released
    /// without digests, it may still carry one (an earlier holder's, e.g. a fork's parent
    /// that had retention for it before this holder truncated its digest away): the lock
    /// is taken for that too, by the priority policy only.
    fn forget_retentions<'a>(&'a self, policy: &mut Option<PolicyGuard<'a>>, freed: &[u32]) {
        if !self.order.keeps_retention() {
            return;
        }
        if policy.is_none() {
            *policy = self.order.guard();
        }
        if let Some(policy) = policy.as_mut() {
            freed
                .iter()
                .for_each(|&b| policy.set_retention(b, Retention::DEFAULT));
        }
    }

    /// Push the blocks a release freed (tail first) on the free stack: pushed head first,
    /// the tail ends on top and is reused first, as vLLM reuses a request's unhashed blocks
    /// (it prepends them, tail first, to its free queue). Counted in `available` unless the
    /// caller keeps the units (`held`).
    fn push_freed(&self, freed: &mut [u32], held: bool) {
        freed.reverse();
        self.free.push_all(freed);
        freed.reverse();
        if !held {
            // Release: a reserver that takes these units sees the push (see `reserve`).
            self.available.fetch_add(freed.len(), Ordering::Release);
        }
    }

    /// Queue the records of blocks that became CACHED (tail first: tails are evicted first)
    /// in the eviction order, under the policy's lock in locked mode. Returns the blocks a
    /// tenant's cap evicted at once (FREE now; `drop_trimmed`), for the free stack; an
    /// error says how the pool broke.
    fn queue_cached(
        &self,
        policy: Option<&mut Box<dyn Policy>>,
        cached: &[Entry],
    ) -> std::result::Result<Vec<u32>, String> {
        match (&self.order, policy) {
            (_, Some(policy)) if self.has_tenants() => self
                .cache_by_tenants(policy, cached)
                .map_err(|e| e.to_string()),
            (_, Some(policy)) => {
                cached.iter().for_each(|&e| policy.cached(e));
                Ok(Vec::new())
            }
            (EvictionOrder::Lru(lru), None) => {
                let bound = 2 * self.states.len() + 64;
                lru.push_all(cached, bound, |e| self.is_live(e));
                Ok(Vec::new())
            }
            (EvictionOrder::Locked(_), None) => {
                Err("hashed blocks cached without the policy lock".into())
            }
        }
    }

    /// Give back a block this caller pinned through a hit and did not use (a failed call):
    /// if that makes it CACHED again, it goes back to the LRU position of its last release,
    /// so the failed call leaves the eviction order as it found it; if `evict_blocks`
    /// withdrew it meanwhile, it becomes FREE.
    pub fn unpin(&self, block: u32, digest: &Digest) -> Result<()> {
        // Locked mode: the release may make the block CACHED (`eviction_order`).
        let mut policy = self.order.guard();
        match self.state(block).release() {
            Some(Released::ToCached { pinned: true, .. }) => {
                self.count_cached(block, true);
                // Its revival took no unit, and the pinned block stays out of the order.
                // Relaxed: tallies (see the fields).
                self.cached.fetch_add(1, Ordering::Relaxed);
                self.pinned.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = self.tally_of(block) {
                    down(&t.used);
                    up(&t.cached);
                }
                Ok(())
            }
            Some(Released::ToCached { generation, .. }) => {
                // Relaxed: a tally (see the field).
                self.cached.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = self.tally_of(block) {
                    down(&t.used);
                    up(&t.cached);
                }
                let entry = Entry {
                    block,
                    generation,
                    digest: *digest,
                };
                // Blocks a tenant's cap evicted at once: other releases of its tenant may
                // have come between the hit and this restore (`drop_trimmed`).
                let mut trims = Ok(Vec::new());
                // Counted with its trims, in one step (`cache_by_tenants`).
                let mut deltas = TenantDeltas::default();
                self.count_cached_later(&mut deltas, block);
                match (&self.order, policy.as_mut()) {
                    // Only quotas trim; every other policy's `restore_by` is its `restore`.
                    (_, Some(policy)) => {
                        let mut trimmed = Vec::new();
                        policy.restore_by(entry, &mut trimmed);
                        trims = self.drop_trimmed(&trimmed, &mut deltas);
                    }
                    (EvictionOrder::Lru(lru), None) => {
                        let bound = 2 * self.states.len() + 64;
                        lru.restore(entry, bound, |e| self.is_live(e));
                    }
                    (EvictionOrder::Locked(_), None) => unreachable!("guard() is Some when locked"),
                }
                self.apply_counts(&deltas);
                drop(policy);
                // Already counted in `available` (as CACHED): only their place changes.
                self.free.push_all(&trims?);
                // Release: as in `release_table`.
                self.available.fetch_add(1, Ordering::Release);
                Ok(())
            }
            Some(Released::StillOwned) => Ok(()),
            Some(Released::ToFree) => {
                // `evict_blocks` withdrew it while the caller held it: FREE, as after any
                // release of an unhashed block, and its unit goes back to `available`.
                if let Some(policy) = policy.as_mut() {
                    policy.set_retention(block, Retention::DEFAULT);
                }
                drop(policy);
                if let Some(t) = self.tally_of(block) {
                    down(&t.used);
                }
                self.free.push(block);
                // Release: as in `release_table`.
                self.available.fetch_add(1, Ordering::Release);
                Ok(())
            }
            None => Err(Error::Broken(format!(
                "unpinned block {block}, which had no holder"
            ))),
        }
    }
}
