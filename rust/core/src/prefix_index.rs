//! Digest -> block that holds that content: a fixed-size, lock-free hash table (lookups,
//! inserts and removals are a few atomic loads and one CAS or store).
//!
//! The index never holds more entries than there are blocks, so its size is fixed at build
//! time: `4 * num_blocks` slots (rounded up to whole buckets) in buckets of 8 slots, one
//! cache line each. A digest may live in either of two buckets, chosen by two independent
//! words of the digest, and goes into the emptier one (two-choice hashing). Lookups read at
//! most two buckets and never probe further, so a removal just empties its slot: no
//! tombstones, no rehashing. At quarter load an insert finds both buckets full with negligible
//! probability; if it ever does, the block simply stays unhashed (a missed hit, never a wrong
//! one).
//!
//! A slot holds `(tag << 32) | (block + 1)`, 0 when empty, where `tag` is 32 bits of the
//! digest that do not choose the bucket; full digests are compared only on a tag match. The
//! key itself lives beside the block (`digests[block]`). A value read here is only a
//! candidate: `BlockPool::pin` pins the block (which must be hashed) and then compares the
//! block's digest with the key, which is exact because a hashed, pinned block's digest is
//! stable. That check is what makes a reused block safe: a block evicted and registered again
//! under other content fails it.

use crate::alloc::try_boxed;
use crate::error::Result;
use crate::hashing::{Digest, Tag};
use crate::sync::{AtomicU32, AtomicU64, Ordering};

const BUCKET: usize = 8;
const EMPTY: u64 = 0;

/// 32 bits of the digest that neither bucket choice fixes, for every digest length: bits
/// 32..64 of word 0 (free in the second bucket, chosen by word 1) XOR bits 8..40 of word 1
/// (free in the first, chosen by the high bits of word 0, up to 2^24 buckets) XOR words 2
/// and 3 (zero in a 16-byte digest). Word 0's high half alone would repeat the first bucket's
/// choice: entries of one first bucket would share most of their tag bits. Disjoint from the
/// stripe's and the prefix lock's bits (low bits of words 0 and 1).
fn tag_of(w: &[u64; 4]) -> u32 {
    ((w[0] >> 32) ^ (w[1] >> 8) ^ w[2] ^ w[3]) as u32
}

fn pack(tag: u32, block: u32) -> u64 {
    (u64::from(tag) << 32) | (u64::from(block) + 1)
}

fn block_of(v: u64) -> u32 {
    (v as u32).wrapping_sub(1)
}

/// `BUCKET` slots, aligned so that a bucket is exactly one cache line: a lookup reads one line
/// per bucket, never two.
#[repr(align(64))]
struct Bucket([AtomicU64; BUCKET]);

/// A block's digest as four words, aligned so that they share one cache line.
#[repr(align(32))]
struct Words([AtomicU64; 4]);

pub struct PrefixIndex {
    /// `buckets.len() * BUCKET` slots, slot `i` in `buckets[i / BUCKET]`. Invariant at
    /// quiescence: exactly the hashed blocks appear, each once, in one of the two buckets of
    /// `digests[block]`, with that digest's tag.
    buckets: Box<[Bucket]>,
    /// `buckets.len()`, at least 2: any count, not only powers of two, so the table is
    /// `4 * num_blocks` slots and not up to twice that (`reduce` maps a word onto it).
    count: u64,
    /// The digest each block was last registered under, as four words. Written by the
    /// block's owner before the block is marked hashed (whose Release store publishes them
    /// to pinners) and before its slot is published (whose Release store publishes them to
    /// lookups); stable while the block stays hashed.
    digests: Box<[Words]>,
    /// The secret tag (`hit_tag`) each block was last registered with, as two words; empty
    /// when hits need no verification (SHA-256). Written, published and stable exactly like
    /// `digests`.
    tags: Box<[[AtomicU64; 2]]>,
    /// `slot_of[block]`: the slot index `insert_new` put the block in, so that `remove` goes
    /// straight to it. Written by the inserter before the block can be released (Relaxed:
    /// the release/claim of the block orders it for the evictor); a stale value only sends
    /// `remove` to its scan.
    slot_of: Box<[AtomicU32]>,
}

fn tag_words(tag: Tag) -> [u64; 2] {
    [tag as u64, (tag >> 64) as u64]
}

impl PrefixIndex {
    /// An index for `num_blocks` blocks; `tagged`: every entry also keeps a `Tag`.
    pub fn new(num_blocks: usize, tagged: bool) -> Result<Self> {
        let buckets = (4 * num_blocks).div_ceil(BUCKET).max(2);
        let words = |_| Words(std::array::from_fn(|_| AtomicU64::new(0)));
        let bucket = |_| Bucket(std::array::from_fn(|_| AtomicU64::new(EMPTY)));
        Ok(Self {
            buckets: try_boxed(buckets, bucket, "the prefix index")?,
            count: buckets as u64,
            digests: try_boxed(num_blocks, words, "the block digests")?,
            tags: try_boxed(
                if tagged { num_blocks } else { 0 },
                |_| std::array::from_fn(|_| AtomicU64::new(0)),
                "the hit tags",
            )?,
            slot_of: try_boxed(num_blocks, |_| AtomicU32::new(0), "the index slots")?,
        })
    }

    /// Whether `block`'s stored tag is `tag` (always true for an untagged index). Relaxed, as
    /// in `holds_words`: exact while the caller holds the block pinned and hashed.
    pub fn tag_is(&self, block: u32, tag: Option<Tag>) -> bool {
        match (tag, self.tags.get(block as usize)) {
            (Some(t), Some(stored)) => stored
                .iter()
                .zip(tag_words(t))
                .all(|(s, w)| s.load(Ordering::Relaxed) == w),
            (None, None) => true,
            _ => false,
        }
    }

    fn slot(&self, i: usize) -> &AtomicU64 {
        &self.buckets[i / BUCKET].0[i % BUCKET]
    }

    fn num_slots(&self) -> usize {
        self.buckets.len() * BUCKET
    }

    /// The digest words stored for `block`.
    fn words_of(&self, block: u32) -> &[AtomicU64; 4] {
        &self.digests[block as usize].0
    }

    /// A uniform digest word onto `0..count` with a multiply and a shift (Lemire's
    /// reduction): as uniform as a mask for any count, and cheaper than a division.
    fn reduce(&self, word: u64) -> usize {
        ((u128::from(word) * u128::from(self.count)) >> 64) as usize
    }

    /// The two buckets (as first slot indices) of a digest given as words.
    fn buckets_of(&self, w: &[u64; 4]) -> [usize; 2] {
        let first = self.reduce(w[0]);
        let mut second = self.reduce(w[1]);
        if second == first {
            second = (first + 1) % self.count as usize;
        }
        [first * BUCKET, second * BUCKET]
    }

    /// Whether `block`'s stored digest is `words`. Relaxed loads: ordered after the slot's
    /// Acquire load (or the pin's Acquire CAS) that named the block; a racing rewrite can only
    /// make a candidate fail, and `pin` re-checks once the block is held.
    fn holds_words(&self, block: u32, words: &[u64; 4]) -> bool {
        let stored = self.words_of(block);
        words
            .iter()
            .zip(stored)
            .all(|(w, s)| s.load(Ordering::Relaxed) == *w)
    }

    pub fn holds(&self, block: u32, digest: &Digest) -> bool {
        self.holds_words(block, &digest.words())
    }

    /// The slot index and block of a candidate entry for `words`.
    fn find(&self, words: &[u64; 4]) -> Option<(usize, u32)> {
        let tag = tag_of(words);
        for start in self.buckets_of(words) {
            for (j, slot) in self.buckets[start / BUCKET].0.iter().enumerate() {
                // Acquire: pairs with the inserting Release store, so the block's digest words
                // written before it are seen.
                let v = slot.load(Ordering::Acquire);
                if v != EMPTY && (v >> 32) as u32 == tag && self.holds_words(block_of(v), words) {
                    return Some((start + j, block_of(v)));
                }
            }
        }
        None
    }

    /// A candidate block cached under `digest`.
    pub fn get(&self, digest: &Digest) -> Option<u32> {
        self.find(&digest.words()).map(|(_, b)| b)
    }

    /// Store the digest (and tag) of an OWNED, unhashed block about to be registered.
    /// Relaxed: published by the Release that marks the block hashed and by the slot's.
    pub fn write_digest(&self, block: u32, digest: &Digest, tag: Option<Tag>) {
        for (s, w) in self.words_of(block).iter().zip(digest.words()) {
            s.store(w, Ordering::Relaxed);
        }
        if let (Some(t), Some(stored)) = (tag, self.tags.get(block as usize)) {
            for (s, w) in stored.iter().zip(tag_words(t)) {
                s.store(w, Ordering::Relaxed);
            }
        }
    }

    /// Whether some block is registered under `digest` (a candidate, as for `get`).
    pub fn contains(&self, digest: &Digest) -> bool {
        self.find(&digest.words()).is_some()
    }

    /// Touch both buckets of each digest, and the digest line of each block that will be
    /// registered under it, with plain loads, so that a following loop of `contains` /
    /// `write_digest` / `insert` finds them in cache. The misses of this pass overlap each
    /// other; in that loop each would stall the pipeline at the next atomic read-modify-write.
    pub fn warm(&self, digests: &[Digest], blocks: &[u32]) {
        let mut sink = 0u64;
        for (d, &b) in digests.iter().zip(blocks) {
            for start in self.buckets_of(&d.words()) {
                // Relaxed: a prefetch; the value is not used.
                sink ^= self.slot(start).load(Ordering::Relaxed);
            }
            sink ^= self.words_of(b)[0].load(Ordering::Relaxed);
        }
        std::hint::black_box(sink);
    }

    /// Register `block` (whose digest `write_digest` stored) unless a block already holds
    /// that content. Two racing inserts of one digest may both succeed; lookups then find
    /// either, which is harmless.
    #[cfg(test)]
    pub fn insert_new(&self, digest: &Digest, block: u32) -> bool {
        !self.contains(digest) && self.insert(digest, block)
    }

    /// Register `block` under `digest` for a caller that has just checked `contains`; false
    /// only if both buckets are full.
    pub fn insert(&self, digest: &Digest, block: u32) -> bool {
        let words = digest.words();
        let value = pack(tag_of(&words), block);
        let mut buckets = self.buckets_of(&words);
        // Relaxed: a heuristic count to pick the emptier bucket; the CAS decides.
        let empties = |start: usize| {
            self.buckets[start / BUCKET]
                .0
                .iter()
                .filter(|s| s.load(Ordering::Relaxed) == EMPTY)
                .count()
        };
        if empties(buckets[1]) > empties(buckets[0]) {
            buckets.swap(0, 1);
        }
        for start in buckets {
            for (j, slot) in self.buckets[start / BUCKET].0.iter().enumerate() {
                // Release: publishes the digest words stored before (see `find`). The plain
                // load first keeps the CAS (which takes the line exclusive) to empty slots.
                if slot.load(Ordering::Relaxed) == EMPTY
                    && slot
                        .compare_exchange(EMPTY, value, Ordering::Release, Ordering::Relaxed)
                        .is_ok()
                {
                    self.slot_of[block as usize].store((start + j) as u32, Ordering::Relaxed);
                    return true;
                }
            }
        }
        false
    }

    /// Remove `block`'s entry (it is leaving the hashed state).
    pub fn remove(&self, digest: &Digest, block: u32) -> bool {
        let words = digest.words();
        let want = pack(tag_of(&words), block);
        // Relaxed CASes: emptying a slot publishes nothing; a reader that still sees the old
        // value is stopped by `pin` (the block is unhashed, or holds other content).
        let take = |i: usize| {
            let slot = self.slot(i);
            slot.load(Ordering::Relaxed) == want
                && slot
                    .compare_exchange(want, EMPTY, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
        };
        let hint = self.slot_of[block as usize].load(Ordering::Relaxed) as usize;
        if hint < self.num_slots() && take(hint) {
            return true;
        }
        self.buckets_of(&words)
            .into_iter()
            .any(|start| (start..start + BUCKET).any(take))
    }

    /// The digest stored for `block` (exact while the caller holds it pinned and hashed).
    pub fn stored(&self, block: u32, len: usize) -> Digest {
        // Relaxed: the caller's pin (an Acquire CAS) already ordered the digest's stores.
        let words = std::array::from_fn(|w| self.words_of(block)[w].load(Ordering::Relaxed));
        Digest::from_words(words, len)
    }

    /// Every entry as `(block, in the right bucket with the right tag)` (audits).
    pub fn snapshot(&self) -> Vec<(u32, bool)> {
        let mut out = Vec::new();
        let slots = self.buckets.iter().flat_map(|b| b.0.iter());
        for (i, slot) in slots.enumerate() {
            // Acquire pairs with the inserting store, as in `find`.
            let v = slot.load(Ordering::Acquire);
            if v != EMPTY {
                let b = block_of(v);
                let words: [u64; 4] =
                    std::array::from_fn(|w| self.words_of(b)[w].load(Ordering::Relaxed));
                let start = i - i % BUCKET;
                let in_place =
                    self.buckets_of(&words).contains(&start) && (v >> 32) as u32 == tag_of(&words);
                out.push((b, in_place));
            }
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    use crate::hashing::sample_digests as digests;

    fn insert(idx: &PrefixIndex, d: &Digest, b: u32) -> bool {
        idx.write_digest(b, d, None);
        idx.insert_new(d, b)
    }

    #[test]
    fn tags_of_one_bucket_are_independent_of_its_choice_for_every_digest_length() {
        use crate::hashing::{BlockHasher, HashAlgo};
        let idx = PrefixIndex::new(4096, false).unwrap(); // 2,048 buckets
        for algo in [HashAlgo::Xxh3_128, HashAlgo::Sha256] {
            let h = BlockHasher::new(algo, 0);
            let mut by_bucket = std::collections::HashMap::<usize, Vec<u32>>::new();
            for p in 0..20_000u32 {
                let w = h.hash_block(&h.root(), &[p], &[]).words();
                for (k, bucket) in idx.buckets_of(&w).into_iter().enumerate() {
                    by_bucket
                        .entry(2 * bucket + k)
                        .or_default()
                        .push(tag_of(&w));
                }
            }
            // Pairs of digests that share a bucket (as first or as second choice) whose tags
            // agree in their top 8 bits: about 1 in 256 when independent, all of them if the
            // tag repeats the bucket choice.
            let (mut pairs, mut same) = (0u64, 0u64);
            for tags in by_bucket.values() {
                for (i, a) in tags.iter().enumerate() {
                    for b in &tags[i + 1..] {
                        pairs += 1;
                        same += u64::from(a >> 24 == b >> 24);
                    }
                }
            }
            assert!(
                pairs > 50_000 && same * 64 < pairs,
                "{algo:?}: {same} of {pairs}"
            );
        }
    }

    #[test]
    fn holds_one_entry_per_block_at_full_load() {
        let n = 20_000;
        let idx = PrefixIndex::new(n as usize, false).unwrap();
        let ds = digests(n);
        for (b, d) in ds.iter().enumerate() {
            assert!(insert(&idx, d, b as u32), "insert {b} found no slot");
        }
        for (b, d) in ds.iter().enumerate() {
            assert_eq!(idx.get(d), Some(b as u32));
            assert!(!idx.insert_new(d, 0), "a digest is registered once");
        }
        let snap = idx.snapshot();
        assert_eq!(snap.len(), n as usize);
        assert!(snap.iter().all(|&(_, in_place)| in_place));
    }

    #[test]
    fn a_bucket_is_one_cache_line_and_a_digest_shares_one() {
        assert_eq!(std::mem::size_of::<Bucket>(), 64);
        assert_eq!(std::mem::align_of::<Bucket>(), 64);
        assert_eq!(std::mem::align_of::<Words>(), 32);
        let idx = PrefixIndex::new(100, false).unwrap();
        assert_eq!(idx.buckets.as_ptr() as usize % 64, 0);
        assert_eq!(idx.num_slots(), 400, "4 slots a block, in whole buckets");
        assert_eq!(PrefixIndex::new(101, false).unwrap().num_slots(), 408);
    }

    #[test]
    fn buckets_spread_evenly_over_a_count_that_is_no_power_of_two() {
        // 3 buckets: a mask would never choose one of them; the reduction must use all
        // three about equally, and the two choices of a digest must differ.
        let idx = PrefixIndex::new(5, false).unwrap();
        assert_eq!(idx.buckets.len(), 3);
        let mut hits = [0u32; 3];
        for d in digests(3000) {
            let [a, b] = idx.buckets_of(&d.words());
            assert_ne!(a, b);
            hits[a / BUCKET] += 1;
        }
        assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
    }

    #[test]
    fn a_reused_block_no_longer_matches_its_old_digest() {
        let idx = PrefixIndex::new(4, false).unwrap();
        let ds = digests(2);
        assert!(insert(&idx, &ds[0], 1));
        assert!(!idx.remove(&ds[0], 2), "another block");
        assert!(idx.remove(&ds[0], 1));
        assert_eq!(idx.get(&ds[0]), None);
        assert!(insert(&idx, &ds[1], 1));
        assert_eq!(idx.get(&ds[0]), None);
        assert_eq!(idx.get(&ds[1]), Some(1));
        assert!(idx.holds(1, &ds[1]) && !idx.holds(1, &ds[0]));
        assert_eq!(idx.stored(1, 32), ds[1]);
    }

    #[test]
    fn a_tagged_entry_confirms_only_its_own_tag() {
        let idx = PrefixIndex::new(4, true).unwrap();
        let d = digests(1)[0];
        idx.write_digest(2, &d, Some(7 << 64 | 9));
        assert!(idx.insert_new(&d, 2));
        assert!(idx.tag_is(2, Some(7 << 64 | 9)));
        assert!(!idx.tag_is(2, Some(9)), "same digest, another prefix");
        assert!(!idx.tag_is(2, None), "a tagged index needs a tag");
        assert!(PrefixIndex::new(4, false).unwrap().tag_is(2, None));
    }
}
