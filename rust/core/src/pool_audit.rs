//! The pool half of `check_invariants`: block states, free stack, LRU queue, prefix index
//! and counters against the references that the callers' tables hold. Exact only when no
//! other call is in flight. The loom models call it on their tiny pools too.

use crate::block_pool::BlockPool;
use crate::error::ensure_invariant as ensure;
use crate::error::Result;

impl BlockPool {
    /// Audit the pool given `refs[b]`, the number of tables holding block `b`. Returns which
    /// blocks the index holds.
    pub fn audit(&self, refs: &[u32]) -> Result<Vec<bool>> {
        let n = self.num_blocks();
        ensure!(refs.len() == n, "{} references for {n} blocks", refs.len());
        // Block states against the references.
        let (mut free, mut cached, mut pinned) = (0, 0, 0);
        for (b, &r) in refs.iter().enumerate() {
            let w = self.state(b as u32).load();
            ensure!(
                w.rc() == r,
                "block {b} has rc {} but {r} tables hold it",
                w.rc()
            );
            free += usize::from(w.is_free());
            cached += usize::from(w.is_cached());
            pinned += usize::from(w.is_cached() && w.pinned());
            ensure!(!w.is_free() || !w.pinned(), "FREE block {b} is pinned");
        }

        // The free stack holds exactly the FREE blocks.
        let stack = self.free_snapshot();
        ensure!(
            stack.len() == free,
            "free stack has {} ids, {free} blocks are FREE",
            stack.len()
        );
        let mut seen = vec![false; n];
        for &b in &stack {
            ensure!(!seen[b as usize], "block {b} is on the free stack twice");
            seen[b as usize] = true;
            ensure!(
                self.state(b).load().is_free(),
                "block {b} on the free stack is not FREE"
            );
        }

        // The LRU queue has one live record per CACHED block; a policy in locked mode holds
        // exactly the CACHED blocks (no stale record at all).
        let mut live = vec![false; n];
        let locked = self.locked_order();
        for e in self.lru_snapshot() {
            ensure!(
                !locked || self.lru_entry_is_live(&e),
                "the eviction policy holds block {}, which is not CACHED with that generation",
                e.block
            );
            if self.lru_entry_is_live(&e) {
                ensure!(
                    !live[e.block as usize],
                    "block {} is queued live twice",
                    e.block
                );
                live[e.block as usize] = true;
            }
        }
        // Pinned CACHED blocks are outside the order.
        let live_count = live.iter().filter(|&&l| l).count();
        ensure!(
            live_count == cached - pinned,
            "{live_count} live LRU records for {cached} CACHED blocks, {pinned} pinned"
        );
        for (b, &l) in live.iter().enumerate() {
            ensure!(
                !l || !self.state(b as u32).load().pinned(),
                "pinned block {b} is in the eviction order"
            );
        }

        // The index holds exactly the hashed blocks, once each, in the right bucket, under
        // the digests their holders expect.
        let index = self.index_snapshot();
        let mut indexed = vec![false; n];
        for &(b, in_place) in &index {
            ensure!((b as usize) < n, "index entry names block {b} out of range");
            ensure!(
                self.state(b).load().hashed(),
                "index entry names unhashed block {b}"
            );
            ensure!(
                in_place,
                "index entry for block {b} has the wrong bucket or tag"
            );
            ensure!(!indexed[b as usize], "block {b} is in the index twice");
            indexed[b as usize] = true;
        }
        // One digest is registered once (contents cached twice would waste a block and send
        // two `BlockStored` events).
        let mut digests = std::collections::HashSet::new();
        for &(b, _) in &index {
            let d = self.index_digest_words(b);
            ensure!(
                digests.insert(d),
                "block {b}'s digest is in the index twice"
            );
        }
        let hashed = (0..n as u32)
            .filter(|&b| self.state(b).load().hashed())
            .count();
        ensure!(
            hashed == index.len(),
            "{hashed} hashed blocks but {} index entries",
            index.len()
        );
        // Live LRU records carry the digest their block is indexed under.
        for e in self.lru_snapshot() {
            if self.lru_entry_is_live(&e) {
                ensure!(
                    self.index_holds(e.block, &e.digest),
                    "LRU record of block {} has a wrong digest",
                    e.block
                );
            }
        }

        // Counters.
        ensure!(
            self.num_free() == free,
            "free count {} but {free} FREE blocks",
            self.num_free()
        );
        ensure!(
            self.num_cached() == cached,
            "cached count {} but {cached} CACHED",
            self.num_cached()
        );
        ensure!(
            self.num_pinned_cached() == pinned,
            "pinned count {} but {pinned} pinned CACHED",
            self.num_pinned_cached()
        );
        ensure!(
            self.num_available() == free + cached - pinned,
            "available {} but FREE + CACHED - pinned = {}",
            self.num_available(),
            free + cached - pinned
        );
        Ok(indexed)
    }
}
