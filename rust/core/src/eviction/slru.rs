//! Segmented LRU, exactly as the reference `eviction/slru.py`: new blocks enter the
//! probationary segment; a block revived by a hit enters the protected one when released,
//! which holds at most 80% of the pool (its LRU block is demoted to probation's MRU end);
//! the victim is probation's LRU block, else protected's.

use super::base::{Keys, Rules, Tracked};
use super::block_table::{BlockTable, Tables};
use super::seq_queue::SeqQueue;
use crate::error::Result;
use crate::hashing::Digest;

/// The SLRU policy.
pub(crate) type Slru = Tracked<SlruRules>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Segment {
    Probation,
    Protected,
}

pub(crate) struct SlruRules {
    probation: SeqQueue,
    protected: SeqQueue,
    /// At most this many blocks in `protected`.
    cap: usize,
    /// Each cached or revived block's segment and position there.
    pos: BlockTable<(Segment, u64)>,
}

/// `max(1, int(c * 0.8))`: `c * 8 / 10` is `int(c * 0.8)` for every `c` below 2^50
/// (`tests::protected_cap_matches_python`).
fn protected_cap(c: usize) -> usize {
    ((c as u128 * 8 / 10) as usize).max(1)
}

impl Slru {
    pub(crate) fn new(num_blocks: usize) -> Result<Self> {
        Self::with_cache_size(Tables::Dense(num_blocks), num_blocks)
    }

    /// A table for `num_blocks` block ids and a cache size `c` (the tests use ids past `c`,
    /// as the reference's do).
    pub(crate) fn with_cache_size(tables: Tables, c: usize) -> Result<Self> {
        let rules = SlruRules {
            probation: SeqQueue::default(),
            protected: SeqQueue::default(),
            cap: protected_cap(c),
            pos: BlockTable::new(
                tables,
                (Segment::Probation, 0),
                "the SLRU policy's block table",
            )?,
        };
        Self::with_rules(tables, rules)
    }
}

impl SlruRules {
    fn segment(&mut self, s: Segment) -> &mut SeqQueue {
        match s {
            Segment::Probation => &mut self.probation,
            Segment::Protected => &mut self.protected,
        }
    }

    fn push(&mut self, block: u32, s: Segment) {
        let seq = self.segment(s).push(block);
        self.pos[block as usize] = (s, seq);
    }

    /// (probation, protected), each LRU first.
    #[cfg(all(test, not(loom)))]
    fn segments(&self) -> (Vec<u32>, Vec<u32>) {
        (self.probation.blocks(), self.protected.blocks())
    }
}

impl Rules for SlruRules {
    fn insert(&mut self, block: u32, _key: &Digest, revived: bool) {
        if !revived {
            self.push(block, Segment::Probation);
            return;
        }
        self.push(block, Segment::Protected);
        while self.protected.len() > self.cap {
            let Some(demoted) = self.protected.pop() else {
                break;
            };
            self.push(demoted, Segment::Probation);
        }
    }

    fn hit(&mut self, block: u32) {
        self.forget(block); // `pos` stays, for `unhit`
    }

    fn unhit(&mut self, block: u32) {
        let (s, seq) = self.pos[block as usize];
        self.segment(s).put_back(seq, block);
    }

    fn forget(&mut self, block: u32) {
        let (s, seq) = self.pos[block as usize];
        self.segment(s).remove(seq, block);
    }

    fn pick(&mut self, _keys: &Keys) -> Option<u32> {
        self.probation.pop().or_else(|| self.protected.pop())
    }

    fn peek(&mut self) -> Option<u32> {
        self.probation.first().or_else(|| self.protected.first())
    }

    fn drop_block(&mut self, block: u32) {
        self.pos.drop_block(block);
    }

    fn table_bytes(&self) -> usize {
        self.pos.bytes()
    }

    fn clear(&mut self) {
        self.pos.reset(|_| {});
        self.probation.clear();
        self.protected.clear();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::eviction::test_util::{drain, entry};
    use crate::eviction::Policy;

    #[test]
    fn hand_worked() {
        let mut p = Slru::with_cache_size(Tables::Dense(6), 4).unwrap(); // protected holds int(4 * 0.8) = 3
        for b in 0..5 {
            p.cached(entry(b, &format!("k{b}"))); // probation: 0 1 2 3 4
        }
        for b in 1..5 {
            p.hit(b); // each hit once: protected on release
            p.cached(entry(b, &format!("k{b}")));
        }
        // Protected took 1 2 3, then 4 pushed its LRU 1 back to probation's MRU end.
        assert_eq!(p.rules.segments(), (vec![0, 1], vec![2, 3, 4]));
        p.cached(entry(5, "k5"));
        assert_eq!(drain(&mut p), vec![0, 1, 5, 2, 3, 4]);
    }

    #[test]
    fn restore_undoes_a_hit() {
        let mut p = Slru::new(4).unwrap();
        for b in 0..3 {
            p.cached(entry(b, &format!("k{b}")));
        }
        p.hit(1);
        p.cached(entry(1, "k1")); // protected
        p.hit(0);
        p.hit(1);
        p.restore(entry(1, "k1"));
        p.restore(entry(0, "k0"));
        assert_eq!(p.rules.segments(), (vec![0, 2], vec![1]));
        // Restored, 0 is not a revival any more: cached again it is new (probation).
        assert_eq!(p.victim().unwrap().block, 0);
        p.cached(entry(0, "k0"));
        assert_eq!(p.rules.segments(), (vec![2, 0], vec![1]));
    }

    #[test]
    fn protected_cap_matches_python() {
        // Python: `max(1, int(c * 0.8))` with IEEE doubles.
        let check = |c: usize| {
            let want = ((c as f64 * 0.8) as usize).max(1);
            assert_eq!(protected_cap(c), want, "c = {c}");
        };
        (0..1_000_000).for_each(check);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            check((x >> 31) as usize); // below 2^33
        }
        for c in [
            (1usize << 31) - 1,
            1 << 31,
            (1 << 32) - 1,
            1 << 32,
            (1 << 40) + 3,
        ] {
            check(c);
        }
    }
}
