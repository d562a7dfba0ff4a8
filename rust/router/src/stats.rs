//! Counters and the index's memory by its own accounting.

use crate::index::Applied;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Tallies, each read on its own (Relaxed everywhere: no other memory is published by them).
/// Writers add once per applying call, so they are not a per-block contention point.
#[derive(Default)]
pub(crate) struct Counters {
    pub memberships: AtomicI64,
    pub stored: AtomicU64,
    pub removed: AtomicU64,
    pub duplicates: AtomicU64,
    pub unknown_removals: AtomicU64,
    pub orphans: AtomicU64,
    pub cleared: AtomicU64,
    pub unknown_events: AtomicU64,
    pub rejected_payloads: AtomicU64,
    pub snapshots: AtomicU64,
}

/// The index at one moment (each field read on its own: not one atomic snapshot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Engines known.
    pub engines: usize,
    /// Holders (engine x medium x group), those of snapshots being received included.
    pub holders: usize,
    /// (block, holder) pairs lookups count: the sum of live holders' blocks.
    pub memberships: u64,
    /// (block, word of 64 holders) entries in the block map.
    pub entries: usize,
    /// Blocks stored, removed, over the index's life.
    pub stored: u64,
    pub removed: u64,
    /// `BlockStored` of blocks already held; `BlockRemoved` of blocks not held.
    pub duplicates: u64,
    pub unknown_removals: u64,
    /// `BlockStored` events whose parent the holder did not hold (docs/router.md).
    pub orphans: u64,
    /// `AllBlocksCleared` events applied.
    pub cleared: u64,
    /// Events of an unknown type, skipped.
    pub unknown_events: u64,
    /// Payloads refused whole (garbage, wrong hash form, too many holders or media).
    pub rejected_payloads: u64,
    /// Snapshots committed.
    pub snapshots: u64,
    /// Memory: the block map, the holders' block sets, and the rest (slots, engines).
    pub map_bytes: usize,
    pub set_bytes: usize,
    pub other_bytes: usize,
}

impl Stats {
    pub fn bytes(&self) -> usize {
        self.map_bytes + self.set_bytes + self.other_bytes
    }
}

impl Counters {
    pub fn add(&self, a: &Applied) {
        let r = Ordering::Relaxed;
        self.stored.fetch_add(a.stored, r);
        self.removed.fetch_add(a.removed, r);
        self.duplicates.fetch_add(a.duplicates, r);
        self.unknown_removals.fetch_add(a.unknown_removals, r);
        self.orphans.fetch_add(a.orphans, r);
        self.cleared.fetch_add(a.cleared, r);
    }

    pub fn stats(
        &self,
        engines: usize,
        holders: usize,
        entries: usize,
        map_bytes: usize,
        set_bytes: usize,
        other_bytes: usize,
    ) -> Stats {
        let r = Ordering::Relaxed;
        Stats {
            engines,
            holders,
            memberships: self.memberships.load(r).max(0) as u64,
            entries,
            stored: self.stored.load(r),
            removed: self.removed.load(r),
            duplicates: self.duplicates.load(r),
            unknown_removals: self.unknown_removals.load(r),
            orphans: self.orphans.load(r),
            cleared: self.cleared.load(r),
            unknown_events: self.unknown_events.load(r),
            rejected_payloads: self.rejected_payloads.load(r),
            snapshots: self.snapshots.load(r),
            map_bytes,
            set_bytes,
            other_bytes,
        }
    }
}
