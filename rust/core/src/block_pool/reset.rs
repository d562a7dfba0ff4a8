//! `reset_prefix_cache`'s pool step: every CACHED block goes FREE.

use super::groups::down;
use super::BlockPool;
use crate::events::KvEvent;
use crate::eviction_order::EvictionOrder;
use crate::lru_queue::Entry;
use crate::sync::Ordering;

impl BlockPool {
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
}
