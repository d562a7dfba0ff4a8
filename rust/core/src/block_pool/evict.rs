//! Taking blocks: the free stack first, else evicting CACHED blocks (the LRU queue or a
//! locked policy), and what the policy hears about misses and retentions.

use super::groups::{down, up64};
use super::{stripe_of, BlockPool};
use crate::duties;
use crate::events::{KvEvent, Medium};
use crate::eviction::Retention;
use crate::eviction_order::{out_of_step, EvictionOrder};
use crate::hashing::Digest;
use crate::lru_queue::Entry;
use crate::sync::{backoff, lock, Ordering};

impl BlockPool {
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

    /// Claim the CACHED block of record `e` (setting its rc to `rc`), remove its index entry
    /// and queue `BlockRemoved` when `removed_event`, all under the digest's stripe.
    pub(super) fn claim_record(&self, e: &Entry, rc: u32, removed_event: bool) -> bool {
        if !self.claim_record_uncounted(e, rc, removed_event) {
            return false;
        }
        // After the stripe: the count may take the registry's lock (its tenant's last block).
        self.count_cached(e.block, false);
        true
    }

    /// `claim_record` whose caller counts the block's tenant itself (`drop_trimmed`).
    pub(super) fn claim_record_uncounted(&self, e: &Entry, rc: u32, removed_event: bool) -> bool {
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
    pub(super) fn evict_into(&self, n: usize, out: &mut Vec<u32>) -> usize {
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

    /// Locked mode's eviction: the policy's victims, each claimed under its lock (where every
    /// CACHED transition happens, so the claim cannot fail unless the pool is broken).
    pub(super) fn evict_locked(&self, n: usize) -> Vec<Entry> {
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
}
