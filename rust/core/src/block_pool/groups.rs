//! KV-cache groups in the pool: each block's group and each group's tallies.

use super::BlockPool;
use crate::alloc::try_boxed;
use crate::block_state::Released;
use crate::error::{Error, Result};
use crate::sync::{AtomicU64, AtomicU8, AtomicUsize, Ordering, Padded};

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
pub(super) fn up(a: &AtomicUsize) {
    a.fetch_add(1, Ordering::Relaxed);
}
pub(super) fn up64(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}
pub(super) fn down(a: &AtomicUsize) {
    a.fetch_sub(1, Ordering::Relaxed);
}

impl BlockPool {
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
    pub(super) fn tally_of(&self, block: u32) -> Option<&GroupTally> {
        if self.tallies.is_empty() {
            return None;
        }
        self.tally(self.group_of(block))
    }

    /// With one group and its tally kept, `k` more OWNED blocks of group 0 (with several
    /// groups the taker counts them in `set_group`, once it has named the group).
    pub(super) fn count_taken(&self, k: usize) {
        if self.group.is_empty() {
            if let Some(t) = self.tallies.first() {
                // Relaxed: a tally (see `GroupTally`).
                t.used.fetch_add(k, Ordering::Relaxed);
            }
        }
    }

    /// Count a release in its block's group tally: one OWNED block fewer, one CACHED more if
    /// it became CACHED.
    pub(super) fn count_released(&self, block: u32, released: Option<Released>) {
        if let (Some(t), Some(Released::ToFree | Released::ToCached { .. })) =
            (self.tally_of(block), released)
        {
            down(&t.used);
            if matches!(released, Some(Released::ToCached { .. })) {
                up(&t.cached);
            }
        }
    }
}
