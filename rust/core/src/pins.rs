//! `pin` and `unpin`: blocks that are never evicted (a system prompt every request shares,
//! a document a session will come back to).
//!
//! A pin is a bit of the block's state word (`block_state`), set or cleared by a holder: the
//! sequence named holds the block, so the bit never changes while the block is CACHED. A
//! pinned block stays in the prefix cache after its last holder lets go, outside the
//! eviction order, and its unit stays out of `available`: admission never counts on it, so a
//! call that would need it returns None, and no eviction can take it. A hit revives it
//! without a unit. It leaves the cache only by `unpin` (through any sequence that holds it,
//! e.g. one that hit it), by `evict_blocks` (its KV is bad) or by `reset_prefix_cache`.
//! A pin does not outlive the block's content: a pinned block that becomes FREE (never
//! registered, or withdrawn) loses it.

use crate::error::{Error, Result};
use crate::manager::BlockManager;

impl BlockManager {
    /// Pin every GPU block sequence `id` holds now (every group's table, the null block
    /// aside); blocks it gets later are not pinned. Returns how many it holds.
    pub fn pin(&self, id: u64) -> Result<usize> {
        self.set_pins(id, true)
    }

    /// Unpin every GPU block sequence `id` holds now, whoever pinned it. Returns how many.
    pub fn unpin(&self, id: u64) -> Result<usize> {
        self.set_pins(id, false)
    }

    fn set_pins(&self, id: u64, on: bool) -> Result<usize> {
        // Mutating: inside the gate, so a reset is wholly before or after.
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            let mut n = 0;
            for b in self.held_entries(seq) {
                if !self.gpu.set_pinned(b, on) {
                    return Err(Error::Broken(format!(
                        "sequence {id} holds block {b}, which has no holder"
                    )));
                }
                n += 1;
            }
            Ok(n)
        })
    }

    /// CACHED blocks that are pinned (a snapshot; exact at quiescence).
    pub fn num_pinned_cached(&self) -> usize {
        self.gpu.num_pinned_cached()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::{BlockManager, Config, Error, GroupKind};

    fn manager(n: u32) -> BlockManager {
        BlockManager::new(Config::new(n, 2)).unwrap()
    }

    #[test]
    fn a_pinned_prompt_survives_pressure_and_is_hit_without_a_unit() {
        let m = manager(4);
        let prompt = [1, 2, 3, 4, 5];
        m.allocate(1, &prompt, None, None, 0).unwrap().unwrap();
        assert_eq!(m.pin(1).unwrap(), 3);
        m.free(1).unwrap();
        // Two full blocks cached and pinned; the partial one is FREE (and lost its pin).
        assert_eq!(m.num_pinned_cached(), 2);
        // Only 2 blocks can be had: 3 do not fit, nothing is evicted.
        assert!(m
            .allocate(2, &[9, 9, 9, 9, 9], None, None, 0)
            .unwrap()
            .is_none());
        assert!(m.allocate(2, &[9, 9, 9], None, None, 0).unwrap().is_some());
        m.free(2).unwrap();
        // The pinned prefix still hits; unpinned through the sequence that hit it, it is
        // evictable again.
        assert_eq!(m.allocate(3, &prompt, None, None, 0).unwrap(), Some(4));
        assert_eq!(m.unpin(3).unwrap(), 3);
        m.free(3).unwrap();
        assert_eq!(m.num_pinned_cached(), 0);
        assert!(m.allocate(4, &[7; 8], None, None, 0).unwrap().is_some());
        m.check_invariants().unwrap();
    }

    #[test]
    fn a_step_that_releases_pinned_blocks_counts_no_unit_for_them() {
        // The sliding window's blocks that fall out of the window are pinned and hashed:
        // released, they stay CACHED outside `available`, so the step must reserve their
        // replacements (found by the reference model: "a block beyond its reservation").
        let kinds = vec![GroupKind::Full, GroupKind::SlidingWindow { window: 4 }];
        let m = BlockManager::with_groups(Config::new(24, 2), kinds).unwrap();
        m.allocate(1, &[2, 2, 0, 1], None, None, 0)
            .unwrap()
            .unwrap();
        assert_eq!(m.pin(1).unwrap(), 4);
        m.free(1).unwrap();
        let prompt = [2, 2, 0, 1, 1, 2, 2, 1, 0];
        assert_eq!(m.allocate(1, &prompt, None, None, 0).unwrap(), Some(4));
        assert_eq!(m.append(1, &[1, 1, 2]).unwrap(), Some(vec![]));
        m.check_invariants().unwrap();
    }

    #[test]
    fn pins_of_unknown_sequences_are_refused() {
        let m = manager(4);
        assert_eq!(m.pin(5), Err(Error::UnknownSequence(5)));
        assert_eq!(m.unpin(5), Err(Error::UnknownSequence(5)));
    }

    #[test]
    fn reset_and_evict_blocks_drop_pinned_blocks() {
        let m = manager(4);
        m.allocate(1, &[1, 2, 3, 4, 5], None, None, 0)
            .unwrap()
            .unwrap();
        let table = m.block_table(1).unwrap();
        m.pin(1).unwrap();
        m.free(1).unwrap();
        assert_eq!(m.evict_blocks(&table[..1]).unwrap(), 1);
        assert_eq!(m.num_pinned_cached(), 1);
        m.check_invariants().unwrap();
        assert!(m.reset_prefix_cache().unwrap());
        assert_eq!(m.num_pinned_cached(), 0);
        assert!(m.allocate(2, &[8; 8], None, None, 0).unwrap().is_some());
        m.check_invariants().unwrap();
    }
}
