//! The block map: for each block and each word of holders, the bitmap of holders that hold
//! it. Lookups read it without locks (papaya); writers of one key serialize on a stripe lock.

use crate::key::{BlockKey, BuildKeyHasher, EntryKey};
use crate::slots::word_bit;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Stripes of writer locks (a power of two). Two writers meet on a stripe only when they
/// change blocks whose hashes share their top bits, and then only for one bit flip.
const STRIPES: usize = 1024;

pub(crate) struct BlockMap<K: BlockKey> {
    /// (block, word) -> bits of the holders among slots 64 x word .. 64 x word + 63 that hold
    /// the block. Invariant, between writers: bit b of (k, w) is set exactly when holder slot
    /// 64w+b holds k (`Holder::blocks` contains it), and an entry exists exactly when its bits
    /// are not all clear. Bits change (AcqRel) and entries come and go only under the key's
    /// stripe lock; lookups read the bits (Acquire) with no lock.
    entries: papaya::HashMap<EntryKey<K>, AtomicU64, BuildKeyHasher>,
    /// Writers of one key serialize here, so that "clear the last bit, then remove the entry"
    /// and "find the entry, then set a bit in it" never interleave: a bit set in an entry
    /// that is being removed would be lost. Lookups never take them.
    stripes: Box<[Mutex<()>]>,
    hasher: BuildKeyHasher,
}

pub(crate) type Guard<'a> = papaya::LocalGuard<'a>;

impl<K: BlockKey> BlockMap<K> {
    pub fn new(hasher: BuildKeyHasher) -> Self {
        Self {
            entries: papaya::HashMap::builder().hasher(hasher).build(),
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            hasher,
        }
    }

    /// A guard for a batch of reads or changes (papaya's epoch: entries removed meanwhile are
    /// freed only after it drops).
    pub fn guard(&self) -> Guard<'_> {
        self.entries.guard()
    }

    fn stripe(&self, k: &EntryKey<K>) -> std::sync::MutexGuard<'_, ()> {
        let i = (self.hasher.hash_one(k) >> 32) as usize & (STRIPES - 1);
        self.stripes[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Holder `slot` holds `key` (the caller's `Holder::blocks` gained it).
    pub fn set(&self, key: K, slot: u32, guard: &Guard<'_>) {
        let (w, b) = word_bit(slot);
        let k = EntryKey {
            key,
            word: w as u32,
        };
        let _s = self.stripe(&k);
        let bits = self
            .entries
            .get_or_insert_with(k, || AtomicU64::new(0), guard);
        // Release: a lookup that reads the bit (Acquire) sees the slot's meta and generation
        // as they were when the bit was set.
        bits.fetch_or(b, Ordering::AcqRel);
    }

    /// Holder `slot` no longer holds `key` (the caller's `Holder::blocks` lost it).
    pub fn unset(&self, key: K, slot: u32, guard: &Guard<'_>) {
        let (w, b) = word_bit(slot);
        let k = EntryKey {
            key,
            word: w as u32,
        };
        let _s = self.stripe(&k);
        if let Some(bits) = self.entries.get(&k, guard) {
            if bits.fetch_and(!b, Ordering::AcqRel) & !b == 0 {
                self.entries.remove(&k, guard);
            }
        }
    }

    /// The holders of `key` in word `w`, read with no lock.
    #[inline]
    pub fn bits(&self, key: K, w: usize, guard: &Guard<'_>) -> u64 {
        let k = EntryKey {
            key,
            word: w as u32,
        };
        self.entries
            .get(&k, guard)
            .map_or(0, |b| b.load(Ordering::Acquire))
    }

    /// Every entry and its bits (quiescent checks only: a full walk).
    pub fn all(&self) -> Vec<(K, u32, u64)> {
        let pinned = self.entries.pin();
        pinned
            .iter()
            .map(|(k, b)| (k.key, k.word, b.load(Ordering::Acquire)))
            .collect()
    }

    /// Entries: (block, word) pairs with at least one holder.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// The map's memory by its own accounting: one allocation per entry (papaya boxes each:
    /// the key and the bits, rounded up as the allocator does) and the table, a pointer and
    /// a control byte a slot. papaya does not report its table's size; it doubles a table
    /// that is half full when probes get long, so the table is taken as the power of two
    /// at or above twice the entries (`benches/test_bench_router.py` checks the total
    /// against the process's resident memory).
    pub fn bytes(&self) -> usize {
        let n = self.len();
        let entry = std::mem::size_of::<(EntryKey<K>, AtomicU64)>();
        let table = (2 * n).next_power_of_two() * (std::mem::size_of::<usize>() + 1);
        n * malloc_size(entry) + table
    }
}

/// What a `malloc` of `n` bytes takes (glibc: the size plus an 8-byte header, rounded up to
/// 16, at least 32).
pub(crate) fn malloc_size(n: usize) -> usize {
    (n + 8).div_ceil(16).max(2) * 16
}
