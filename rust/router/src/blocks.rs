//! The block map: for each block and each word of 64 holder slots, the bitmap of the holders
//! that hold it; sharded by block hash, each shard a hash table under its own read-write lock.
//!
//! Why locks and not a lock-free map: papaya (the core's map) boxes every entry and, resizing
//! incrementally, cost 2.2 us per insert of a fresh key here (1.2 M random keys on this
//! machine; 0.4 us blocking, 0.18 us presized), more than the whole budget of an event.
//! A shard's read lock is one uncontended atomic increment and decrement on a line of its
//! own, taken for one probe at a time (no scan, sort or allocation under it); 256 shards
//! keep two threads apart unless they probe blocks of the same shard at the same moment.
//!
//! Word 0's tables are `table::Table`s, whose slot for a key is known before the probe: a
//! walk prefetches the slots of the blocks a few positions ahead (`prefetch`), through a
//! copy of each table's address kept in atomics (read without the lock: a stale address only
//! makes a useless prefetch, which never faults), and the line of the shard's lock with them.
//! The copies are packed together (`Hint`, 16 bytes a shard, 4 KiB in all), apart from the
//! shards' 128-byte cells: a lookup from Python finds the caches cleared of the index by the
//! interpreter's own work between calls, and 64 lines of hints come back sooner than 256.

use crate::key::{BlockKey, BuildKeyHasher, EntryKey};
use crate::pool::Pool;
use crate::slots::word_bit;
use crate::table::{Table, LINE};
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard, TryLockError};

/// Shards (a power of two).
const SHARDS: usize = 256;

/// One shard's tables. Word 0 (holder slots 0 to 63: every holder while there are at most
/// 64) is keyed by the block alone, the other words by (block, word), so that the common
/// case pays no key bytes for the word.
pub(crate) struct Tables<K: BlockKey> {
    first: Table<K>,
    more: HashMap<EntryKey<K>, u64, BuildKeyHasher>,
}

/// Alone on its cache lines, so that threads on different shards never share one.
#[repr(align(128))]
struct Shard<K: BlockKey> {
    /// Invariant, between writers: bit b of word w of block k is set exactly when holder slot
    /// 64w+b holds k (and then k is in the holder's log), and an entry exists exactly when its
    /// bits are not all clear. Writers change an entry's bits, and add or remove it, under the
    /// write lock (so "clear the last bit, then remove" and "find, then set a bit" never
    /// interleave); lookups read one entry at a time under the read lock.
    tables: RwLock<Tables<K>>,
}

/// A shard's `first` table's slots' address and mask, for prefetching only (never
/// dereferenced). Written (Relaxed) under the shard's write lock when the table grows; read
/// (Relaxed) without the lock.
#[derive(Default)]
struct Hint {
    base: AtomicUsize,
    mask: AtomicUsize,
}

pub(crate) struct BlockMap<K: BlockKey> {
    shards: Box<[Shard<K>]>,
    hints: Box<[Hint]>,
    hasher: BuildKeyHasher,
    /// Huge-page memory for the word-0 tables once they are large (`pool.rs`).
    pool: Arc<Pool>,
}

impl<K: BlockKey> BlockMap<K> {
    pub fn new(hasher: BuildKeyHasher) -> Self {
        let pool = Arc::new(Pool::default());
        Self {
            shards: (0..SHARDS)
                .map(|_| Shard {
                    tables: RwLock::new(Tables {
                        first: Table::new(Arc::clone(&pool)),
                        more: HashMap::with_hasher(hasher),
                    }),
                })
                .collect(),
            hints: (0..SHARDS).map(|_| Hint::default()).collect(),
            hasher,
            pool,
        }
    }

    /// A block's hash (the shard is bits 32 to 39 of it; the tables use the low bits for the
    /// slot, so a shard's keys still spread).
    #[inline]
    pub fn hash(&self, key: &K) -> u64 {
        self.hasher.hash_one(key)
    }

    #[inline]
    fn shard_index(hash: u64) -> usize {
        (hash >> 32) as usize & (SHARDS - 1)
    }

    #[inline]
    fn shard_of(&self, hash: u64) -> &Shard<K> {
        &self.shards[Self::shard_index(hash)]
    }

    fn write(&self, hash: u64) -> RwLockWriteGuard<'_, Tables<K>> {
        self.shard_of(hash)
            .tables
            .write()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn read_shard(s: &Shard<K>) -> RwLockReadGuard<'_, Tables<K>> {
        s.tables.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Ask the CPU for the slot a probe of the block of hash `hash` (in word 0) starts at,
    /// and for the line after it: a probe that runs past its first line (a quarter or more of
    /// them, with 4 slots a line) would otherwise wait a whole memory latency for the second.
    /// Side by side at 10 M memberships (`examples/replay.rs`, eight rounds alternately):
    /// p99 2.45 to 3.75 us with the second line, 2.49 to 5.39 without (medians 2.84 and
    /// 3.85); starting probes at a line's first slot instead was slower (the runs cluster).
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        let i = Self::shard_index(hash);
        // The lock's line: the probe's read lock writes it.
        prefetch_line((&self.shards[i].tables as *const RwLock<Tables<K>>).cast());
        let h = &self.hints[i];
        let base = h.base.load(Ordering::Relaxed);
        if base != 0 {
            let mask = h.mask.load(Ordering::Relaxed);
            let at = base.wrapping_add((hash as usize & mask) * Table::<K>::slot_size());
            prefetch_line(at as *const u8);
            prefetch_line((at | (LINE - 1)).wrapping_add(1) as *const u8);
        }
    }

    /// Holder `slot` holds `key`; false if it did already (nothing changed).
    pub fn set(&self, key: K, slot: u32) -> bool {
        let (w, b) = word_bit(slot);
        let hash = self.hash(&key);
        let mut t = self.write(hash);
        if w == 0 {
            let cap = t.first.capacity();
            let new = t.first.set(key, hash, b, &self.hasher);
            if t.first.capacity() != cap {
                // Under the write lock; Relaxed: a hint, read without the lock.
                let h = &self.hints[Self::shard_index(hash)];
                h.base
                    .store(t.first.slot_addr(0) as usize, Ordering::Relaxed);
                h.mask.store(t.first.capacity() - 1, Ordering::Relaxed);
            }
            new
        } else {
            let bits = t
                .more
                .entry(EntryKey {
                    key,
                    word: w as u32,
                })
                .or_insert(0);
            let new = *bits & b == 0;
            *bits |= b;
            new
        }
    }

    /// Holder `slot` holds every key of `keys` (a snapshot's part: many at once); returns the
    /// keys it did not hold before. The keys go shard by shard, each shard's lock taken once
    /// and its table grown once, the next keys' slots prefetched: memory speed, where `set`
    /// key by key pays a lock, a cold probe and the tables' doublings for each. (Splitting
    /// the shards between threads was slower on the 2-core benchmark machine under other
    /// jobs, and is not done.)
    pub fn set_many(&self, keys: &[K], slot: u32) -> Vec<K> {
        let (sorted, starts) = self.by_shard(keys);
        self.set_shards(&sorted, &starts, 0..SHARDS, slot)
    }

    /// `keys` with their hashes, ordered by shard (a counting sort; the hash computed twice,
    /// cheaper than a second array), and where each shard's run starts.
    fn by_shard(&self, keys: &[K]) -> (Vec<(u64, K)>, Vec<usize>) {
        let mut starts = vec![0usize; SHARDS + 1];
        for k in keys {
            starts[Self::shard_index(self.hash(k)) + 1] += 1;
        }
        for i in 0..SHARDS {
            starts[i + 1] += starts[i];
        }
        let mut at = starts.clone();
        let mut sorted = vec![(0u64, K::default()); keys.len()];
        for k in keys {
            let h = self.hash(k);
            let s = Self::shard_index(h);
            sorted[at[s]] = (h, *k);
            at[s] += 1;
        }
        (sorted, starts)
    }

    /// Holder `slot` no longer holds any of `keys` (a dropped holder's log: many at once),
    /// shard by shard as `set_many` goes; keys it did not hold are passed over.
    pub fn unset_many(&self, keys: &[K], slot: u32) {
        const AHEAD: usize = 8;
        let (w, b) = word_bit(slot);
        let (sorted, starts) = self.by_shard(keys);
        for s in 0..SHARDS {
            let run = &sorted[starts[s]..starts[s + 1]];
            if run.is_empty() {
                continue;
            }
            let mut t = self.shards[s]
                .tables
                .write()
                .unwrap_or_else(|e| e.into_inner());
            if w == 0 && t.first.worth_warming(run.len()) {
                t.first.warm();
            }
            for (i, &(h, key)) in run.iter().enumerate() {
                if w == 0 {
                    if let Some(&(next, _)) = run.get(i + AHEAD) {
                        prefetch_line(t.first.slot_addr(next));
                    }
                    t.first.unset(&key, h, b, &self.hasher);
                } else {
                    let k = EntryKey {
                        key,
                        word: w as u32,
                    };
                    if let Some(bits) = t.more.get_mut(&k) {
                        *bits &= !b;
                        if *bits == 0 {
                            t.more.remove(&k);
                        }
                    }
                }
            }
        }
    }

    /// `set_many`'s work on shards `range` of `sorted` (keys by shard, shard s's from
    /// `starts[s]`).
    fn set_shards(
        &self,
        sorted: &[(u64, K)],
        starts: &[usize],
        range: std::ops::Range<usize>,
        slot: u32,
    ) -> Vec<K> {
        const AHEAD: usize = 8;
        let (w, b) = word_bit(slot);
        let mut new = Vec::with_capacity(starts[range.end] - starts[range.start]);
        for s in range {
            let run = &sorted[starts[s]..starts[s + 1]];
            if run.is_empty() {
                continue;
            }
            let mut t = self.shards[s]
                .tables
                .write()
                .unwrap_or_else(|e| e.into_inner());
            if w == 0 {
                let cap = t.first.capacity();
                t.first.reserve(run.len(), &self.hasher);
                if t.first.capacity() != cap {
                    // Under the write lock; Relaxed: a hint, read without the lock.
                    let h = &self.hints[s];
                    h.base
                        .store(t.first.slot_addr(0) as usize, Ordering::Relaxed);
                    h.mask.store(t.first.capacity() - 1, Ordering::Relaxed);
                }
                if t.first.worth_warming(run.len()) {
                    t.first.warm();
                }
                for (i, &(h, k)) in run.iter().enumerate() {
                    if let Some(&(next, _)) = run.get(i + AHEAD) {
                        prefetch_line(t.first.slot_addr(next));
                    }
                    if t.first.set(k, h, b, &self.hasher) {
                        new.push(k);
                    }
                }
            } else {
                t.more.reserve(run.len());
                for &(_, key) in run {
                    let bits = t
                        .more
                        .entry(EntryKey {
                            key,
                            word: w as u32,
                        })
                        .or_insert(0);
                    if *bits & b == 0 {
                        *bits |= b;
                        new.push(key);
                    }
                }
            }
        }
        new
    }

    /// Holder `slot` no longer holds `key`; false if it did not (nothing changed).
    pub fn unset(&self, key: K, slot: u32) -> bool {
        let (w, b) = word_bit(slot);
        let hash = self.hash(&key);
        let mut t = self.write(hash);
        if w == 0 {
            t.first.unset(&key, hash, b, &self.hasher)
        } else {
            let k = EntryKey {
                key,
                word: w as u32,
            };
            let Some(bits) = t.more.get_mut(&k) else {
                return false;
            };
            let held = *bits & b != 0;
            *bits &= !b;
            if *bits == 0 {
                t.more.remove(&k);
            }
            held
        }
    }

    /// Whether holder `slot` holds `key`.
    pub fn holds(&self, key: K, slot: u32) -> bool {
        let (w, b) = word_bit(slot);
        self.bits(key, self.hash(&key), w) & b != 0
    }

    /// The holders of `key` (of hash `hash`) in word `w`.
    #[inline]
    pub fn bits(&self, key: K, hash: u64, w: usize) -> u64 {
        Self::bits_in(&Self::read_shard(self.shard_of(hash)), key, hash, w)
    }

    /// `bits`, or None when the shard's lock is not free for reading at once (a writer holds
    /// it or waits for it): for a caller that must not wait, a lookup holding the GIL.
    #[inline]
    pub fn try_bits(&self, key: K, hash: u64, w: usize) -> Option<u64> {
        let t = match self.shard_of(hash).tables.try_read() {
            Ok(t) => t,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        Some(Self::bits_in(&t, key, hash, w))
    }

    /// Test helper: `key`'s shard.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn shard_of_key(&self, key: &K) -> usize {
        Self::shard_index(self.hash(key))
    }

    /// Test helper: the write lock of `key`'s shard, as a writer holds it.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn lock_shard_of(&self, key: &K) -> RwLockWriteGuard<'_, Tables<K>> {
        self.write(self.hash(key))
    }

    #[inline]
    fn bits_in(t: &Tables<K>, key: K, hash: u64, w: usize) -> u64 {
        if w == 0 {
            t.first.get(&key, hash)
        } else {
            t.more
                .get(&EntryKey {
                    key,
                    word: w as u32,
                })
                .copied()
                .unwrap_or(0)
        }
    }

    /// Every entry and its bits (quiescent checks only: a full walk).
    pub fn all(&self) -> Vec<(K, u32, u64)> {
        let mut out = Vec::new();
        for s in self.shards.iter() {
            let t = Self::read_shard(s);
            out.extend(t.first.iter().map(|(k, b)| (k, 0, b)));
            out.extend(t.more.iter().map(|(k, &b)| (k.key, k.word, b)));
        }
        out
    }

    /// Entries: (block, word) pairs with at least one holder (locks each shard in turn).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let t = Self::read_shard(s);
                t.first.len() + t.more.len()
            })
            .sum()
    }

    /// The tables' memory by their own accounting (their capacities; see `table_bytes`; the
    /// pool's tables as the 2 MiB chunks they take, used or not).
    pub fn bytes(&self) -> usize {
        let two = std::mem::size_of::<(EntryKey<K>, u64)>();
        let shards: usize = self
            .shards
            .iter()
            .map(|s| {
                let t = Self::read_shard(s);
                let first = if t.first.pooled() {
                    0
                } else {
                    t.first.capacity() * Table::<K>::slot_size()
                };
                std::mem::size_of::<Shard<K>>()
                    + std::mem::size_of::<Hint>()
                    + first
                    + table_bytes(t.more.capacity(), two)
            })
            .sum();
        shards + self.pool.mapped()
    }
}

/// Ask the CPU to bring the line holding `at` in, without waiting for it.
#[inline]
fn prefetch_line(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint: it never faults, whatever the address, and neither
        // reads into the program nor writes; SSE is part of the x86_64 baseline.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.cast::<i8>()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

/// What a hashbrown table (std's `HashMap`) of `capacity` entries of `size` bytes takes:
/// buckets are the power of two above capacity x 8/7 (a table is at most 7/8 full), each
/// the entry and a control byte, plus one group (16) of control bytes.
pub(crate) fn table_bytes(capacity: usize, size: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 8 {
        (capacity + 1).next_power_of_two()
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (size + 1) + 16
}

/// What a `malloc` of `n` bytes takes (glibc: the size plus an 8-byte header, rounded up to
/// 16, at least 32).
pub(crate) fn malloc_size(n: usize) -> usize {
    (n + 8).div_ceil(16).max(2) * 16
}
