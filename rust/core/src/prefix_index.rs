//! Digest -> `(block, epoch)` of the block that holds that content: a fixed-size, lock-free
//! hash table (reads, inserts and removals are each a few atomic loads and one CAS).
//!
//! The index never holds more entries than there are blocks, so its size is fixed at build
//! time: `4 * num_blocks` slots (rounded up to a power of two) in buckets of 8 slots, one
//! cache line each. A digest may live in either of two buckets, chosen by two independent
//! words of the digest, and goes into the emptier one (two-choice hashing). Lookups read at most two cache lines and never
//! probe further, so a removal just empties its slot: no tombstones, no rehashing. At quarter
//! load an insert finds both buckets full with negligible probability; if it ever does, the
//! block simply stays unhashed (a missed hit later, never a wrong one).
//!
//! A slot holds `(epoch << 32) | (block + 1)`, 0 when empty, and beside it a 64-bit tag of
//! its digest, so a lookup compares full digests only for a matching tag. The key itself
//! lives beside the block (`digests[block]`), written before the slot is published. A value
//! read here is only a candidate: `BlockPool::pin` checks the epoch with a CAS and then the
//! digest again.

use crate::hashing::Digest;
use crate::sync::{AtomicU64, Ordering};

const BUCKET: usize = 8;

/// A 64-bit tag of a digest, independent of the bits that choose the buckets.
fn tag_of(w: &[u64; 4]) -> u64 {
    w[0].rotate_left(32) ^ w[1] ^ w[2] ^ w[3]
}
const EMPTY: u64 = 0;
/// A slot claimed by an inserter that is writing its tag; readers treat it as empty.
const CLAIMED: u64 = u64::MAX;

fn pack(block: u32, epoch: u32) -> u64 {
    (u64::from(epoch) << 32) | (u64::from(block) + 1)
}

fn unpack(v: u64) -> (u32, u32) {
    ((v as u32).wrapping_sub(1), (v >> 32) as u32)
}

pub struct PrefixIndex {
    /// `buckets * BUCKET` slots. Invariant at quiescence: exactly the hashed blocks appear,
    /// each once, with their current epoch, in one of the two buckets of `digests[block]`.
    slots: Box<[AtomicU64]>,
    /// `tags[i]` is the tag of the digest last inserted into slot `i`; written before the
    /// slot's Release CAS, never cleared (an emptied slot's stale tag is never consulted).
    tags: Box<[AtomicU64]>,
    /// `buckets - 1` (a power of two minus one).
    mask: usize,
    /// The digest each block was last registered under, as four words. Written by the
    /// block's owner while the block is unhashed (no valid slot names it), then published by
    /// the Release CAS on the slot; stable while the block stays hashed with that epoch.
    digests: Box<[[AtomicU64; 4]]>,
}

impl PrefixIndex {
    pub fn new(num_blocks: usize) -> Self {
        let buckets = (4 * num_blocks).div_ceil(BUCKET).next_power_of_two().max(2);
        Self {
            slots: (0..buckets * BUCKET)
                .map(|_| AtomicU64::new(EMPTY))
                .collect(),
            tags: (0..buckets * BUCKET).map(|_| AtomicU64::new(0)).collect(),
            mask: buckets - 1,
            digests: (0..num_blocks)
                .map(|_| std::array::from_fn(|_| AtomicU64::new(0)))
                .collect(),
        }
    }

    /// The two buckets (as first slot indices) of a digest given as words.
    fn buckets_of(&self, w: &[u64; 4]) -> [usize; 2] {
        let first = w[0] as usize & self.mask;
        let mut second = w[1] as usize & self.mask;
        if second == first {
            second = (first + 1) & self.mask;
        }
        [first * BUCKET, second * BUCKET]
    }

    fn buckets(&self, digest: &Digest) -> [usize; 2] {
        self.buckets_of(&digest.words())
    }

    /// Whether `block`'s stored digest is `digest`. Relaxed loads: ordered after the slot's
    /// Acquire load (or the pin's Acquire CAS) that named the block.
    pub fn holds(&self, block: u32, digest: &Digest) -> bool {
        let stored = &self.digests[block as usize];
        digest
            .words()
            .iter()
            .zip(stored)
            .all(|(w, s)| s.load(Ordering::Relaxed) == *w)
    }

    fn find(&self, digest: &Digest) -> Option<(usize, u64)> {
        let tag = tag_of(&digest.words());
        for start in self.buckets(digest) {
            for i in start..start + BUCKET {
                // Acquire: pairs with the inserting CAS, so that insert's tag and digest words
                // (or later ones) are seen. A later tag makes a racing lookup miss: harmless.
                let v = self.slots[i].load(Ordering::Acquire);
                if v != EMPTY
                    && v != CLAIMED
                    && self.tags[i].load(Ordering::Relaxed) == tag
                    && self.holds(unpack(v).0, digest)
                {
                    return Some((i, v));
                }
            }
        }
        None
    }

    /// A candidate `(block, epoch)` cached under `digest`.
    pub fn get(&self, digest: &Digest) -> Option<(u32, u32)> {
        self.find(digest).map(|(_, v)| unpack(v))
    }

    /// Register `block` under `digest` unless a block already holds that content. Two racing
    /// inserts of one digest may both succeed; lookups then find either, which is harmless.
    pub fn insert_new(&self, digest: Digest, block: u32, epoch: u32) -> bool {
        if self.find(&digest).is_some() {
            return false;
        }
        // Relaxed: published by the Release store of the slot below.
        for (s, w) in self.digests[block as usize].iter().zip(digest.words()) {
            s.store(w, Ordering::Relaxed);
        }
        let value = pack(block, epoch);
        let tag = tag_of(&digest.words());
        // The emptier bucket first (two-choice hashing keeps the fullest bucket small).
        let mut buckets = self.buckets(&digest);
        // Relaxed: a heuristic count; the CAS below decides.
        let empties = |start: usize| {
            self.slots[start..start + BUCKET]
                .iter()
                .filter(|s| s.load(Ordering::Relaxed) == EMPTY)
                .count()
        };
        if empties(buckets[1]) > empties(buckets[0]) {
            buckets.swap(0, 1);
        }
        for start in buckets {
            for i in start..start + BUCKET {
                // Claim the slot first, so no other inserter can overwrite the tag between
                // our tag store and the publishing store. Relaxed: the claim publishes nothing.
                if self.slots[i]
                    .compare_exchange(EMPTY, CLAIMED, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    // Relaxed: published by the Release store of the value.
                    self.tags[i].store(tag, Ordering::Relaxed);
                    self.slots[i].store(value, Ordering::Release);
                    return true;
                }
            }
        }
        false
    }

    /// Remove the entry only if it still names this block incarnation.
    pub fn remove_exact(&self, digest: &Digest, block: u32, epoch: u32) -> bool {
        let want = pack(block, epoch);
        // Relaxed CAS: emptying a slot publishes nothing; a reader that still sees the old
        // value is stopped by the epoch check when it pins.
        for start in self.buckets(digest) {
            for slot in &self.slots[start..start + BUCKET] {
                if slot
                    .compare_exchange(want, EMPTY, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    return true;
                }
            }
        }
        false
    }

    /// The digest stored for `block` (exact while the caller holds it pinned and hashed).
    pub fn stored(&self, block: u32, len: usize) -> Digest {
        let words =
            std::array::from_fn(|w| self.digests[block as usize][w].load(Ordering::Relaxed));
        Digest::from_words(words, len)
    }

    /// Every entry as `(block, epoch, in one of its digest's two buckets)` (audits).
    pub fn snapshot(&self) -> Vec<(u32, u32, bool)> {
        let mut out = Vec::new();
        for (i, slot) in self.slots.iter().enumerate() {
            // Acquire pairs with the inserting store, as in `find`.
            let v = slot.load(Ordering::Acquire);
            if v != EMPTY && v != CLAIMED {
                let (b, e) = unpack(v);
                let words: [u64; 4] =
                    std::array::from_fn(|w| self.digests[b as usize][w].load(Ordering::Relaxed));
                let start = i - i % BUCKET;
                out.push((b, e, self.buckets_of(&words).contains(&start)));
            }
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, HashAlgo};

    fn digests(n: u32) -> Vec<Digest> {
        let h = BlockHasher::new(HashAlgo::Sha256, 0);
        (0..n)
            .map(|i| h.hash_block(&h.root(), &[i], &[0]))
            .collect()
    }

    #[test]
    fn holds_one_entry_per_block_at_full_load() {
        let n = 20_000;
        let idx = PrefixIndex::new(n as usize);
        let ds = digests(n);
        for (b, d) in ds.iter().enumerate() {
            assert!(idx.insert_new(*d, b as u32, 7), "insert {b} found no slot");
        }
        for (b, d) in ds.iter().enumerate() {
            assert_eq!(idx.get(d), Some((b as u32, 7)));
            assert!(!idx.insert_new(*d, 0, 0), "a digest is registered once");
        }
        let snap = idx.snapshot();
        assert_eq!(snap.len(), n as usize);
        assert!(snap.iter().all(|&(_, e, in_place)| e == 7 && in_place));
    }

    #[test]
    fn remove_exact_checks_the_incarnation() {
        let idx = PrefixIndex::new(4);
        let ds = digests(2);
        assert!(idx.insert_new(ds[0], 1, 3));
        assert!(!idx.remove_exact(&ds[0], 1, 4), "another epoch");
        assert!(!idx.remove_exact(&ds[0], 2, 3), "another block");
        assert!(idx.remove_exact(&ds[0], 1, 3));
        assert_eq!(idx.get(&ds[0]), None);
        // The block is reused for other content: the old digest no longer finds it.
        assert!(idx.insert_new(ds[1], 1, 4));
        assert_eq!(idx.get(&ds[0]), None);
        assert_eq!(idx.get(&ds[1]), Some((1, 4)));
        assert!(idx.holds(1, &ds[1]) && !idx.holds(1, &ds[0]));
        assert_eq!(idx.stored(1, 32), ds[1]);
    }
}
