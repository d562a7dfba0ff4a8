//! The GPU block pool: block states, the free stack, the LRU queue of cached blocks, the
//! prefix index and the admission counter, with the transitions of the lifecycle contract.
//!
//! Admission: `available` counts FREE + CACHED blocks that no caller has been promised.
//! A caller reserves units first (one CAS loop, all or nothing) and only then takes blocks,
//! so a batch never gets half its blocks and rolls back. A block is counted in `available`
//! only after it is findable (pushed on the free stack or queued in the LRU), so a caller
//! holding a unit always finds a block, possibly after a racing taker moved on.

use crate::alloc::try_boxed;
use crate::block_state::{BlockState, Pin, Released, RC_MAX};
use crate::clock::Clock;
use crate::duties;
use crate::error::{Error, Result};
use crate::events::{EventLog, KvEvent, Medium};
use crate::eviction::{EvictionKind, Retention};
use crate::eviction_order::{out_of_step, EvictionOrder};
use crate::free_stack::FreeStack;
use crate::hashing::{Digest, Tag};
use crate::lru_queue::{Entry, LruQueue};
use crate::prefix_index::PrefixIndex;
use crate::sync::{
    backoff, lock, prefetch, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Mutex, Ordering, Padded,
};
use crate::tenants::Quota;
use std::sync::Arc;

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

/// One group's share of the pool. Relaxed everywhere: tallies, each exact at quiescence.
#[derive(Default)]
pub struct GroupTally {
    /// OWNED blocks of the group.
    pub used: AtomicUsize,
    /// CACHED blocks of the group.
    pub cached: AtomicUsize,
    /// Table entries served by prefix hits.
    pub hit_blocks: AtomicU64,
    /// CACHED blocks of the group evicted.
    pub evictions: AtomicU64,
    /// Blocks registered in the prefix cache.
    pub registered: AtomicU64,
}

// Relaxed: tallies (see `GroupTally`).
fn up(a: &AtomicUsize) {
    a.fetch_add(1, Ordering::Relaxed);
}
fn up64(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}
fn down(a: &AtomicUsize) {
    a.fetch_sub(1, Ordering::Relaxed);
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
            group: Box::new([]),
            tallies: Box::new([]),
            null: false,
        })
    }

    /// The same pool for `num_groups` KV-cache groups (group bytes with more than one,
    /// per-group tallies when `tallies`), with block 0 taken as the null block when `null`.
    pub fn with_groups(mut self, num_groups: usize, null: bool, tallies: bool) -> Result<Self> {
        if num_groups > 1 {
            let n = self.num_blocks();
            self.group = try_boxed(n, |_| AtomicU8::new(0), "the block groups")?;
        }
        if null {
            // A fresh pool pops block 0 first (`FreeStack::full`); nothing else runs yet.
            if !self.reserve(1) || self.take() != 0 {
                return Err(Error::Broken("the null block was not block 0".into()));
            }
            self.null = true;
        }
        // After the null block, which no group's tally counts.
        if tallies {
            self.tallies = try_boxed(num_groups, |_| Padded::default(), "the group tallies")?;
        }
        Ok(self)
    }

    /// Blocks that can ever be handed out (all but the null block).
    pub fn num_usable(&self) -> usize {
        self.num_blocks() - usize::from(self.null)
    }

    /// The group of an OWNED or CACHED block (see the field).
    pub fn group_of(&self, block: u32) -> u8 {
        self.group
            .get(block as usize)
            .map_or(0, |g| g.load(Ordering::Relaxed))
    }

    /// The tally of group `g`, if the pool keeps them (several groups).
    pub fn tally(&self, g: u8) -> Option<&GroupTally> {
        self.tallies.get(g as usize).map(|t| &t.0)
    }

    /// Record that the caller's group `g` took `block` (right after `take`).
    pub fn set_group(&self, block: u32, g: u8) {
        if let Some(slot) = self.group.get(block as usize) {
            slot.store(g, Ordering::Relaxed);
            if let Some(t) = self.tally(g) {
                up(&t.used);
            }
        }
    }

    /// The tally of `block`'s group.
    fn tally_of(&self, block: u32) -> Option<&GroupTally> {
        if self.tallies.is_empty() {
            return None;
        }
        self.tally(self.group_of(block))
    }

    /// The same pool, evicting by `kind` (LRU is how `new` builds it); `clock` is the
    /// manager's.
    pub fn with_eviction(
        mut self,
        kind: EvictionKind,
        tenants: bool,
        clock: &Arc<Clock>,
    ) -> Result<Self> {
        let n = self.num_blocks();
        if tenants {
            self.tenant = try_boxed(n, |_| AtomicU32::new(0), "the block tenants")?;
            self.order = EvictionOrder::with_tenants(kind, n, clock)?;
        } else if kind != EvictionKind::Lru {
            self.order = EvictionOrder::new(kind, n, clock)?;
        }
        Ok(self)
    }

    /// Record the tenant of the sequence about to register `block` (see the field).
    pub fn set_tenant(&self, block: u32, tenant: u32) {
        if let Some(t) = self.tenant.get(block as usize) {
            t.store(tenant, Ordering::Relaxed);
        }
    }

    fn tenant_of(&self, block: u32) -> u32 {
        self.tenant
            .get(block as usize)
            .map_or(0, |t| t.load(Ordering::Relaxed))
    }

    /// CACHED blocks by tenant id (`0..n`), from the block states under the policy lock, so
    /// no unpinned block enters or leaves CACHED meanwhile (exact but for pinned blocks'
    /// revivals, which take no lock).
    pub fn cached_by_tenant(&self, n: usize) -> Vec<usize> {
        let _policy = self.order.guard();
        let mut out = vec![0; n];
        for b in 0..self.num_blocks() as u32 {
            if self.state(b).load().is_cached() {
                if let Some(c) = out.get_mut(self.tenant_of(b) as usize) {
                    *c += 1;
                }
            }
        }
        out
    }

    /// Set `tenant`'s quota in the policy; blocks a lower cap evicts go FREE at once.
    pub fn set_quota(&self, tenant: u32, quota: Quota) -> Result<()> {
        let Some(mut policy) = self.order.guard() else {
            return Ok(());
        };
        let mut trimmed = Vec::new();
        policy.set_quota(tenant, quota, &mut trimmed)?;
        let freed = self.drop_trimmed(&trimmed)?;
        drop(policy);
        self.free.push_all(&freed);
        Ok(())
    }

    /// Claim the blocks a quota trimmed (under the policy lock): each goes FREE with its
    /// index entry and a `BlockRemoved`, counted as an eviction. Returns them for the free
    /// stack; their units stay in `available` (CACHED and FREE both count). A trim is not
    /// a device duty: the block goes FREE at once, so nobody may copy it out (a copy could
    /// race its next owner's writes); its KV is dropped.
    fn drop_trimmed(&self, trimmed: &[Entry]) -> Result<Vec<u32>> {
        let mut freed = Vec::with_capacity(trimmed.len());
        for e in trimmed {
            if !self.claim_record(e, 0, true) {
                return Err(out_of_step("trimmed", e.block));
            }
            // Relaxed: tallies (see the fields).
            self.cached.fetch_sub(1, Ordering::Relaxed);
            self.evictions.fetch_add(1, Ordering::Relaxed);
            if let Some(t) = self.tally_of(e.block) {
                down(&t.cached);
                up64(&t.evictions);
            }
            freed.push(e.block);
        }
        Ok(freed)
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

    /// Take one block for a caller that holds a unit: the free stack first, else evict the
    /// least recently released cached block. The block comes back OWNED(1) and unhashed.
    pub fn take(&self) -> u32 {
        if let Some(b) = self.free.pop() {
            // The common case, without the batch path's vector.
            self.state(b).take();
            self.count_taken(1);
            return b;
        }
        let mut one = Vec::with_capacity(1);
        self.take_into(1, &mut one);
        one[0]
    }

    /// Take `k` blocks (the caller holds `k` units) into `out`, in the order `take` would
    /// give them; evictions for the batch are popped from the LRU under one lock.
    pub fn take_into(&self, k: usize, out: &mut Vec<u32>) {
        let goal = out.len() + k;
        let mut spins = 0;
        while out.len() < goal {
            if let Some(b) = self.free.pop() {
                self.state(b).take();
                out.push(b);
                continue;
            }
            if self.evict_into(goal - out.len(), out) == 0 {
                // Units are held, so blocks are on their way: a releaser has counted one but
                // a racing taker got the one we saw, or a reset is moving it to the free
                // stack.
                backoff(&mut spins);
            }
        }
        self.count_taken(k);
    }

    /// With one group and its tally kept, `k` more OWNED blocks of group 0 (with several
    /// groups the taker counts them in `set_group`, once it has named the group).
    fn count_taken(&self, k: usize) {
        if self.group.is_empty() {
            if let Some(t) = self.tallies.first() {
                // Relaxed: a tally (see `GroupTally`).
                t.used.fetch_add(k, Ordering::Relaxed);
            }
        }
    }

    /// Claim the CACHED block of record `e` (setting its rc to `rc`), remove its index entry
    /// and queue `BlockRemoved` when `removed_event`, all under the digest's stripe.
    fn claim_record(&self, e: &Entry, rc: u32, removed_event: bool) -> bool {
        let _stripe = lock(&self.stripes[stripe_of(&e.digest)]);
        if !self.state(e.block).claim_cached(e.generation, rc) {
            return false;
        }
        self.index.remove(&e.digest, e.block);
        if let (true, Some(log)) = (removed_event, &self.events) {
            let group = self.group_of(e.block);
            log.push(KvEvent::BlockRemoved {
                block_hash: e.digest.keyed(group),
                medium: Medium::Gpu,
                group,
            });
        }
        true
    }

    /// Evict up to `n` cached blocks, oldest first, into `out`; returns how many.
    fn evict_into(&self, n: usize, out: &mut Vec<u32>) -> usize {
        let claimed = match &self.order {
            EvictionOrder::Lru(lru) => lru.pop_claimed(n, |e| self.claim_record(e, 1, true)),
            EvictionOrder::Locked(_) => self.evict_locked(n),
        };
        if self.record_evictions {
            claimed.iter().for_each(|e| {
                // The evicted block's group until its taker sets its own (after this).
                let g = self.group_of(e.block);
                duties::record_eviction(e.block, g, e.digest.keyed(g));
            });
        }
        for e in &claimed {
            // Relaxed: tallies (see the fields).
            self.cached.fetch_sub(1, Ordering::Relaxed);
            self.evictions.fetch_add(1, Ordering::Relaxed);
            if let Some(t) = self.tally_of(e.block) {
                down(&t.cached);
                up64(&t.evictions);
            }
            out.push(e.block);
        }
        claimed.len()
    }

    /// Give held blocks their retention from their next release (the priority policy; a
    /// no-op for the others and for the lock-free LRU).
    pub fn set_retentions(&self, blocks: &[(u32, Retention)]) {
        if blocks.is_empty() {
            return;
        }
        if !self.order.keeps_retention() {
            return;
        }
        if let Some(mut policy) = self.order.guard() {
            blocks.iter().for_each(|&(b, r)| policy.set_retention(b, r));
        }
    }

    /// Tell the policy that a request needs these digests and the cache lacks them (S3-FIFO's
    /// and ARC's ghost lookups at the request, before evicting for it). Lock-free LRU: nothing.
    pub fn missed(&self, digests: &[Digest]) {
        if digests.is_empty() {
            return;
        }
        if let Some(mut policy) = self.order.guard_for_misses() {
            digests.iter().for_each(|d| policy.miss(d));
        }
    }

    /// Locked mode's eviction: the policy's victims, each claimed under its lock (where every
    /// CACHED transition happens, so the claim cannot fail unless the pool is broken).
    fn evict_locked(&self, n: usize) -> Vec<Entry> {
        let Some(mut policy) = self.order.guard() else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(n.min(policy.len()));
        while out.len() < n {
            let Some(e) = policy.victim() else { break };
            if self.claim_record(&e, 1, true) {
                out.push(e);
            } else {
                // Not CACHED with that generation: the rule was broken somewhere. The block
                // is lost to eviction, which the audit reports; nothing else is harmed.
                debug_assert!(false, "{}", out_of_step("evicted", e.block));
            }
        }
        out
    }

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
        let mut cached: Vec<Entry> = Vec::with_capacity(blocks.len());
        let mut freed: Vec<u32> = Vec::with_capacity(blocks.len());
        let mut pinned = 0;
        // Blocks a tenant's cap evicted at once (FREE now; `drop_trimmed`).
        let mut trims = Vec::new();
        let mut broken = None;
        // Locked mode: a hashed block may become CACHED here, so the policy's lock is held
        // from before the first release until the policy knows (`eviction_order`). Without
        // digests no block can become CACHED (a hashed one would be a broken table).
        let mut policy = if digests.is_empty() {
            None
        } else {
            self.order.guard()
        };
        // Every state's line in flight before the first release's locked instruction.
        blocks.iter().for_each(|&b| prefetch(self.state(b)));
        for (i, &block) in blocks.iter().enumerate().rev() {
            let released = self.state(block).release();
            if let (Some(t), Some(Released::ToFree | Released::ToCached { .. })) =
                (self.tally_of(block), released)
            {
                down(&t.used);
                if matches!(released, Some(Released::ToCached { .. })) {
                    up(&t.cached);
                }
            }
            match released {
                Some(Released::StillOwned) => {}
                Some(Released::ToFree) => freed.push(block),
                // Pinned: CACHED, findable, but outside the eviction order and `available`.
                Some(Released::ToCached { pinned: true, .. }) => pinned += 1,
                Some(Released::ToCached { generation, .. }) => match digests.get(i) {
                    Some(&digest) => cached.push(Entry {
                        block,
                        generation,
                        digest,
                    }),
                    None => broken = Some(format!("hashed block {block} released without digest")),
                },
                None => broken = Some(format!("released block {block}, which has no holder")),
            }
        }
        // One update of each shared word per call, not per block. `freed` is tail first;
        // pushed head first, the tail ends on top and is reused first, as vLLM reuses a
        // request's unhashed blocks (it prepends them, tail first, to its free queue). The
        // cached records keep the tail-first order: tails are evicted first.
        // A FREE block's content is gone: so is any retention a holder gave it. Released
        // without digests, it may still carry one (an earlier holder's, e.g. a fork's parent
        // that had retention for it before this holder truncated its digest away): the lock
        // is taken for that too, by the priority policy only.
        if self.order.keeps_retention() && !freed.is_empty() {
            if policy.is_none() {
                policy = self.order.guard();
            }
            if let Some(policy) = policy.as_mut() {
                freed
                    .iter()
                    .for_each(|&b| policy.set_retention(b, Retention::DEFAULT));
            }
        }
        if !freed.is_empty() {
            freed.reverse();
            self.free.push_all(&freed);
            if !held {
                // Release: a reserver that takes these units sees the push (see `reserve`).
                self.available.fetch_add(freed.len(), Ordering::Release);
            }
        }
        if pinned > 0 {
            // Relaxed: tallies (see the fields).
            self.cached.fetch_add(pinned, Ordering::Relaxed);
            self.pinned.fetch_add(pinned, Ordering::Relaxed);
        }
        if !cached.is_empty() {
            // Relaxed: a tally, raised before the records can be claimed.
            self.cached.fetch_add(cached.len(), Ordering::Relaxed);
            match (&self.order, policy.as_mut()) {
                (_, Some(policy)) if !self.tenant.is_empty() => {
                    let mut trimmed = Vec::new();
                    for &e in &cached {
                        policy.cached_by(e, self.tenant_of(e.block), &mut trimmed);
                    }
                    match self.drop_trimmed(&trimmed) {
                        Ok(blocks) => trims = blocks,
                        Err(e) => broken = Some(e.to_string()),
                    }
                }
                (_, Some(policy)) => cached.iter().for_each(|&e| policy.cached(e)),
                (EvictionOrder::Lru(lru), None) => {
                    let bound = 2 * self.states.len() + 64;
                    lru.push_all(&cached, bound, |e| self.is_live(e));
                }
                (EvictionOrder::Locked(_), None) => {
                    broken = Some("hashed blocks cached without the policy lock".into());
                }
            }
            drop(policy);
            // Already counted in `available` (as CACHED): only their place changes.
            self.free.push_all(&trims);
            if !held {
                // Release: a reserver that takes these units sees the queued records.
                self.available.fetch_add(cached.len(), Ordering::Release);
            }
            // Held units need no edge here: their holder pushed or queued the blocks itself,
            // and whatever block it then takes comes with the pop's or claim's Acquire.
        }
        let units = freed.len() + cached.len();
        broken.map_or(Ok(units), |msg| Err(Error::Broken(msg)))
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
                match (&self.order, policy.as_mut()) {
                    // Only quotas trim; every other policy's `restore_by` is its `restore`.
                    (_, Some(policy)) => {
                        let mut trimmed = Vec::new();
                        policy.restore_by(entry, &mut trimmed);
                        trims = self.drop_trimmed(&trimmed);
                    }
                    (EvictionOrder::Lru(lru), None) => {
                        let bound = 2 * self.states.len() + 64;
                        lru.restore(entry, bound, |e| self.is_live(e));
                    }
                    (EvictionOrder::Locked(_), None) => unreachable!("guard() is Some when locked"),
                }
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

    fn is_live(&self, e: &Entry) -> bool {
        let w = self.state(e.block).load();
        w.is_cached() && w.generation() == e.generation
    }

    /// Without changing anything: is `digest` cached, and is its block CACHED (rc 0)?
    pub fn peek(&self, digest: &Digest) -> Option<Peek> {
        let b = self.index.get(digest)?;
        let w = self.state(b).load();
        w.hashed().then_some(Peek {
            block: b,
            cached: w.rc() == 0 && !w.pinned(),
            full: w.rc() == RC_MAX,
        })
    }

    /// Take a reference to the block cached under `digest` (and `tag`, for a tagged pool).
    /// Reviving a CACHED block costs one unit: from `spare` if the caller reserved some, else
    /// reserved here.
    pub fn pin(&self, digest: &Digest, tag: Option<Tag>, spare: &mut usize) -> Result<Hit> {
        let Some(b) = self.index.get(digest) else {
            return Ok(Hit::Miss);
        };
        let state = self.state(b);
        let mut have_unit = false;
        // Locked mode: taken before any attempt that may revive (one with a unit), so the
        // revival and the policy's `hit` are one step under its lock (`eviction_order`).
        // Without a unit `state.pin` never revives, so the first attempt needs no lock.
        let mut policy = None;
        loop {
            if have_unit && policy.is_none() {
                policy = self.order.guard();
            }
            match state.pin(have_unit) {
                Pin::Pinned { revived, unit } => {
                    // A pinned block is outside the policy (see `release_table`).
                    if let (true, Some(policy)) = (unit, policy.as_mut()) {
                        policy.hit(b);
                    }
                    drop(policy.take());
                    if revived {
                        self.cached.fetch_sub(1, Ordering::Relaxed);
                        if !unit {
                            // Relaxed: a tally (see the field).
                            self.pinned.fetch_sub(1, Ordering::Relaxed);
                        }
                        if let Some(t) = self.tally_of(b) {
                            down(&t.cached);
                            up(&t.used);
                        }
                    }
                    if have_unit && !unit {
                        *spare += 1;
                    }
                    // The lookup compared the digest racily; pinned and hashed, the block's
                    // digest is stable now, so this check is exact. It fails when the block
                    // was evicted and registered again under other content since the lookup,
                    // or (tagged pool) when another prefix collided on the public digest.
                    if !self.index.holds(b, digest) || !self.index.tag_is(b, tag) {
                        let own = self.index.stored(b, digest.as_bytes().len());
                        if revived {
                            self.unpin(b, &own)?;
                            // The unit goes back to `available`; the caller's stays spare.
                        } else {
                            self.release(b, Some(&own))?;
                        }
                        return Ok(Hit::Miss);
                    }
                    return Ok(Hit::Pinned { block: b, revived });
                }
                Pin::Stale => {
                    if have_unit {
                        *spare += 1;
                    }
                    return Ok(Hit::Miss);
                }
                Pin::Full => {
                    if have_unit {
                        *spare += 1;
                    }
                    return Ok(Hit::Full(b));
                }
                Pin::NeedsUnit if *spare > 0 => {
                    *spare -= 1;
                    have_unit = true;
                }
                Pin::NeedsUnit if self.reserve(1) => have_unit = true,
                Pin::NeedsUnit => return Ok(Hit::NoRoom),
            }
        }
    }

    /// Make an OWNED, full, unhashed block findable under `digest`, unless another block
    /// already holds that content (then it stays unhashed and is freed, not cached, when
    /// released). Atomic per digest (its stripe), so one digest is registered once.
    pub fn register(
        &self,
        block: u32,
        digest: Digest,
        tag: Option<Tag>,
        event: impl FnOnce() -> KvEvent,
    ) -> bool {
        let _stripe = lock(&self.stripes[stripe_of(&digest)]);
        // Under the stripe every entry of this digest names a hashed block: claims remove
        // the entry under the same stripe.
        if self.index.contains(&digest) {
            return false;
        }
        let state = self.state(block);
        self.index.write_digest(block, &digest, tag);
        state.set_hashed();
        if self.index.insert(&digest, block) {
            if let Some(log) = &self.events {
                log.push(event());
            }
            true
        } else {
            state.clear_hashed();
            false
        }
    }

    /// Withdraw `block` (hashed under `digest`, held by the caller) from the prefix cache:
    /// it stays OWNED by its holders but unhashed, its index entry goes and `BlockRemoved`
    /// is queued. `sole`: only if the caller is its only holder (else it stays cached).
    /// Under the digest's stripe, so it is ordered with every registration and claim of the
    /// digest. Returns whether it was withdrawn.
    pub fn retract(&self, block: u32, digest: &Digest, sole: bool) -> bool {
        let _stripe = lock(&self.stripes[stripe_of(digest)]);
        if !self.index.holds(block, digest) {
            return false;
        }
        let state = self.state(block);
        let withdrawn = if sole {
            state.unhash_if_sole()
        } else {
            state.unhash_held()
        };
        if !withdrawn {
            return false;
        }
        self.index.remove(digest, block);
        if let Some(log) = &self.events {
            let group = self.group_of(block);
            log.push(KvEvent::BlockRemoved {
                block_hash: digest.keyed(group),
                medium: Medium::Gpu,
                group,
            });
        }
        true
    }

    /// Take `block` out of the prefix cache whoever holds it (`evict_blocks`: its KV is
    /// bad). `len`: the manager's digest length. No new atomic step: the key's stripe, then
    /// the transitions an eviction (`claim_record`, to rc 0 as `reset` does) or a retraction
    /// (`retract`) makes, so each block's withdrawal is one step against every hit, pin,
    /// release, registration, eviction and retraction of it.
    pub fn withdraw(&self, block: u32, len: usize) -> Withdrawal {
        let state = self.state(block);
        loop {
            // A snapshot: unhashed at this read, the block is not in the cache; hashed, it
            // is checked again under its key's stripe.
            if !state.load().hashed() {
                return Withdrawal::NotCached;
            }
            // The key it is registered under: stable while it stays hashed. If it was
            // withdrawn and registered anew meanwhile, this read may give another key (or a
            // torn one), which the look under the stripe rejects.
            let key = self.index.stored(block, len);
            // Locked mode: the claim below may take a CACHED block out (`eviction_order`);
            // the policy's lock comes before the stripe, as for an eviction.
            let mut policy = self.order.guard();
            let stripe = lock(&self.stripes[stripe_of(&key)]);
            // Under the key's stripe every registration, claim and retraction of `key` is
            // wholly before or after this point, so an entry of `key` naming the block means
            // it is registered under `key`, and only this thread can unregister it now. (The
            // slot's Acquire load in `find` sees the digest words stored before it.)
            if self.index.get(&key) != Some(block) {
                // Withdrawn since the first read (the next one sees it unhashed), or
                // registered under another key: look again.
                drop(stripe);
                drop(policy);
                continue;
            }
            let mut was_pinned = false;
            let outcome = loop {
                let w = state.load();
                if w.rc() == 0 {
                    // CACHED: claimed as an eviction claims it, to rc 0 (FREE). Its LRU
                    // record goes stale with the generation; evictors skip it.
                    if state.claim_cached(w.generation(), 0) {
                        // The pin bit is constant while CACHED: this is the claimed word's.
                        was_pinned = w.pinned();
                        break Withdrawal::Freed;
                    }
                } else if state.unhash_held() {
                    // OWNED: as a retraction; a hit that pinned first keeps its reference.
                    break Withdrawal::Unhashed;
                }
                // A hit revived it, or its last holder released it, since the load: the CAS
                // failed, nothing changed; look at the new word.
            };
            self.index.remove(&key, block);
            let group = self.group_of(block);
            if let Some(log) = &self.events {
                log.push(KvEvent::BlockRemoved {
                    block_hash: key.keyed(group),
                    medium: Medium::Gpu,
                    group,
                });
            }
            drop(stripe);
            if let (Withdrawal::Freed, Some(policy)) = (outcome, policy.as_mut()) {
                if was_pinned {
                    // Outside the order, but a holder may have given it a retention: it
                    // goes with the content, as for any block that becomes FREE.
                    policy.set_retention(block, Retention::DEFAULT);
                } else {
                    policy.removed(block);
                }
            }
            drop(policy);
            if outcome == Withdrawal::Freed {
                // Relaxed: tallies (see the fields), moved before the block can be taken
                // (its taker names its own group). `available` already counts it: CACHED
                // before, FREE now. A taker holding a unit meanwhile finds it once pushed.
                self.cached.fetch_sub(1, Ordering::Relaxed);
                if let Some(t) = self.tally_of(block) {
                    down(&t.cached);
                }
                self.free.push(block);
                if was_pinned {
                    // A pinned CACHED block had no unit counted: it has one now, FREE.
                    // Relaxed: a tally. Release: the push is seen by its reserver.
                    self.pinned.fetch_sub(1, Ordering::Relaxed);
                    self.available.fetch_add(1, Ordering::Release);
                }
            }
            return outcome;
        }
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

    /// Move every CACHED block to the free stack and forget its digest. Refuses (false)
    /// while any block is OWNED. The caller excludes every other call that changes ownership
    /// (the manager's gate), so the check and the clearing are one step, and nobody else
    /// pushes or pops the free stack meanwhile.
    ///
    /// The formerly cached blocks go *under* the blocks already free, oldest release first:
    /// vLLM's reset only drops the hashes, so those blocks keep their places at the far end
    /// of its free queue, behind every free one, and are reused last, oldest first.
    ///
    /// Pinned CACHED blocks are freed too (a reset drops every hash, pins with them), after
    /// the others, by block id; `len` is the manager's digest length (their index keys).
    pub fn reset(&self, len: usize) -> bool {
        if self.num_free() + self.num_cached() != self.num_usable() {
            return false;
        }
        let records = match &self.order {
            EvictionOrder::Lru(lru) => lru.drain(),
            // The policy's eviction order (its victims, next first), then a fresh policy:
            // a reset forgets ghosts and adaptive state too.
            EvictionOrder::Locked(_) => {
                let mut policy = self.order.guard();
                let policy = policy.as_mut().expect("locked");
                let mut order = Vec::with_capacity(policy.len());
                while let Some(e) = policy.victim() {
                    order.push(e);
                }
                policy.clear();
                order
            }
        };
        let mut formerly = Vec::with_capacity(records.len());
        for e in records {
            // rc stays 0: CACHED -> FREE. Units stay counted in `available`.
            if self.claim_record(&e, 0, false) {
                self.cached.fetch_sub(1, Ordering::Relaxed);
                if let Some(t) = self.tally_of(e.block) {
                    down(&t.cached);
                }
                formerly.push(e.block);
            }
        }
        if self.pinned.load(Ordering::Relaxed) > 0 {
            for b in 0..self.num_blocks() as u32 {
                let w = self.state(b).load();
                if !(w.is_cached() && w.pinned()) {
                    continue;
                }
                let e = Entry {
                    block: b,
                    generation: w.generation(),
                    digest: self.index.stored(b, len),
                };
                if self.claim_record(&e, 0, false) {
                    // Relaxed: tallies. Its unit was not counted while pinned: it is now.
                    self.cached.fetch_sub(1, Ordering::Relaxed);
                    self.pinned.fetch_sub(1, Ordering::Relaxed);
                    if let Some(t) = self.tally_of(b) {
                        down(&t.cached);
                    }
                    self.available.fetch_add(1, Ordering::Release);
                    formerly.push(b);
                }
            }
        }
        if !formerly.is_empty() {
            // Rebuild the stack: the free blocks, top first, then `formerly`, oldest first.
            let mut free = Vec::with_capacity(self.num_free());
            while let Some(b) = self.free.pop() {
                free.push(b);
            }
            formerly.reverse();
            self.free.push_all(&formerly);
            free.reverse();
            self.free.push_all(&free);
        }
        self.push_event(|| KvEvent::AllBlocksCleared);
        true
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
