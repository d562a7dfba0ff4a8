//! LFU with dynamic aging (LFU-DA), exactly as the reference `eviction/lfu.py`: a block's
//! frequency F starts at 1 and grows by 1 per hit; released, its key is K = L + F; the
//! victim is the least K (ties: least recently released) and the cache age L becomes its K.

use super::base::{Keys, Rules, Tracked};
use super::block_table::{BlockTable, Tables};
use crate::error::Result;
use crate::hashing::Digest;
use std::collections::BTreeMap;

/// The LFU-DA policy.
pub(crate) type LfuAging = Tracked<LfuRules>;

/// (K, release sequence): the eviction order, least first.
type Rank = (u64, u64);

#[derive(Clone, Copy, Default)]
struct Meta {
    /// F, while the block is cached or revived.
    freq: u64,
    /// Its rank while cached; after a hit, the rank `unhit` puts back.
    rank: Rank,
}

pub(crate) struct LfuRules {
    /// The cache age L: the key of the last victim.
    age: u64,
    /// Release counter, the LRU tie-break. Never goes back, not even at `clear`.
    seq: u64,
    ranks: BTreeMap<Rank, u32>,
    meta: BlockTable<Meta>,
}

impl LfuAging {
    pub(crate) fn new(num_blocks: usize) -> Result<Self> {
        Self::with_tables(Tables::Dense(num_blocks))
    }

    pub(crate) fn with_tables(tables: Tables) -> Result<Self> {
        let rules = LfuRules {
            age: 0,
            seq: 0,
            ranks: BTreeMap::new(),
            meta: BlockTable::new(tables, Meta::default(), "the LFU policy's block table")?,
        };
        Self::with_rules(tables, rules)
    }
}

impl Rules for LfuRules {
    fn insert(&mut self, block: u32, _key: &Digest, revived: bool) {
        let m = &mut self.meta[block as usize];
        if !revived {
            m.freq = 1;
        }
        m.rank = (self.age + m.freq, self.seq);
        self.seq += 1;
        self.ranks.insert(m.rank, block);
    }

    fn hit(&mut self, block: u32) {
        self.forget(block);
        self.meta[block as usize].freq += 1;
    }

    fn unhit(&mut self, block: u32) {
        let m = &mut self.meta[block as usize];
        m.freq -= 1;
        let was = self.ranks.insert(m.rank, block);
        debug_assert!(was.is_none());
    }

    fn forget(&mut self, block: u32) {
        let was = self.ranks.remove(&self.meta[block as usize].rank);
        debug_assert_eq!(was, Some(block));
    }

    fn pick(&mut self, _keys: &Keys) -> Option<u32> {
        let ((k, _), b) = self.ranks.pop_first()?;
        self.age = k;
        Some(b)
    }

    fn peek(&mut self) -> Option<u32> {
        self.ranks.first_key_value().map(|(_, &b)| b)
    }

    fn drop_block(&mut self, block: u32) {
        self.meta.drop_block(block);
    }

    fn table_bytes(&self) -> usize {
        self.meta.bytes()
    }

    fn clear(&mut self) {
        self.meta.reset(|_| {});
        self.age = 0;
        self.ranks.clear();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::eviction::test_util::entry;
    use crate::eviction::Policy;

    fn rank(p: &LfuAging, block: u32) -> Rank {
        let m = p.rules.meta[block as usize];
        assert_eq!(p.rules.ranks.get(&m.rank), Some(&block));
        m.rank
    }

    #[test]
    fn hand_worked() {
        let mut p = LfuAging::new(8).unwrap();
        p.cached(entry(0, "hot")); // F = 1, K = L + F = 1
        for _ in 0..3 {
            p.hit(0); // three hits: F = 4; released again: K = 0 + 4 = 4
            p.cached(entry(0, "hot"));
        }
        assert_eq!(rank(&p, 0), (4, 3));
        assert_eq!(p.rules.ranks.len(), 1);
        // Each newcomer enters with K = L + 1, the least: it goes and L becomes its K.
        for i in 1..4 {
            p.cached(entry(i, &format!("x{i}")));
            assert_eq!(rank(&p, i).0, u64::from(i));
            assert_eq!(p.victim().unwrap().block, i);
            assert_eq!(p.rules.age, u64::from(i));
        }
        // The fourth newcomer gets K = 3 + 1 = 4, equal to block 0's: the older release
        // goes.
        p.cached(entry(4, "x4"));
        assert_eq!(p.victim().unwrap().block, 0);
        assert_eq!(p.rules.age, 4);
        assert_eq!(p.victim().unwrap().block, 4);
    }

    #[test]
    fn restore_undoes_a_hit_and_clear_forgets_the_age() {
        let mut p = LfuAging::new(4).unwrap();
        p.cached(entry(0, "a"));
        p.cached(entry(1, "b"));
        p.hit(0);
        p.restore(entry(0, "a"));
        assert_eq!((rank(&p, 0), rank(&p, 1)), ((1, 0), (1, 1)));
        assert_eq!(p.rules.meta[0].freq, 1);
        assert_eq!(p.victim().unwrap().block, 0);
        assert_eq!(p.rules.age, 1);
        p.clear();
        assert_eq!(p.rules.age, 0);
        p.cached(entry(2, "c"));
        assert_eq!(rank(&p, 2).0, 1);
    }

    #[test]
    fn a_revival_under_another_digest_starts_over() {
        let mut p = LfuAging::new(2).unwrap();
        p.cached(entry(0, "a"));
        p.hit(0);
        p.cached(entry(0, "b")); // other content: F = 1, not 2
        assert_eq!(rank(&p, 0).0, 1);
    }
}
