//! ARC (Megiddo and Modha, FAST'03), exactly as the reference `eviction/arc.py`, whose
//! module docs map the paper's cases to the manager's calls: T1 and T2 hold the evictable
//! blocks seen once and at least twice, B1 and B2 the digests evicted from them, and the
//! integer target `p` of T1 adapts on ghost hits (at `miss`, else at `cached`).

use super::base::{Keys, Rules, Tracked};
use super::block_table::{BlockTable, Tables};
use super::seq_queue::{KeyFifo, SeqQueue};
use crate::error::Result;
use crate::hashing::Digest;

/// The ARC policy.
pub(crate) type ArcPolicy = Tracked<ArcRules>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum List {
    T1,
    T2,
}

pub(crate) struct ArcRules {
    /// The cache size `c`: the pool's block count.
    c: usize,
    /// The target size of T1, in `0..=c`.
    p: usize,
    t1: SeqQueue,
    t2: SeqQueue,
    b1: KeyFifo,
    b2: KeyFifo,
    /// Ghost digests requested (`miss`) whose block is not cached yet, at most `c`.
    readmit: KeyFifo,
    /// Each cached or revived block's list and position there.
    pos: BlockTable<(List, u64)>,
}

impl ArcPolicy {
    pub(crate) fn new(num_blocks: usize) -> Result<Self> {
        Self::with_cache_size(Tables::Dense(num_blocks), num_blocks)
    }

    /// A table for `num_blocks` block ids and a cache size `c` (the tests use ids past `c`,
    /// as the reference's do).
    pub(crate) fn with_cache_size(tables: Tables, c: usize) -> Result<Self> {
        let rules = ArcRules {
            c,
            p: 0,
            t1: SeqQueue::default(),
            t2: SeqQueue::default(),
            b1: KeyFifo::default(),
            b2: KeyFifo::default(),
            readmit: KeyFifo::default(),
            pos: BlockTable::new(tables, (List::T1, 0), "the ARC policy's block table")?,
        };
        Self::with_rules(tables, rules)
    }
}

impl ArcRules {
    fn list(&mut self, list: List) -> &mut SeqQueue {
        match list {
            List::T1 => &mut self.t1,
            List::T2 => &mut self.t2,
        }
    }

    /// Cases II and III: adapt `p` and take the digest out of its ghost list; whether it was
    /// in one.
    fn ghost_hit(&mut self, key: &Digest) -> bool {
        let (b1, b2) = (self.b1.len(), self.b2.len());
        if self.b1.remove(key) {
            self.p = self.c.min(self.p + (b2 / b1).max(1));
        } else if self.b2.remove(key) {
            self.p = self.p.saturating_sub((b1 / b2).max(1));
        } else {
            return false;
        }
        true
    }

    /// The list REPLACE evicts from; ties (|T1| = p) go to T2.
    fn replace_from(&self) -> List {
        if !self.t1.is_empty() && (self.t1.len() > self.p || self.t2.is_empty()) {
            List::T1
        } else {
            List::T2
        }
    }

    /// The directory bounds: |T1| + |B1| <= c, |T1| + |T2| + |B1| + |B2| <= 2c.
    fn bound(&mut self) {
        let c = self.c;
        while self.t1.len() + self.b1.len() > c && !self.b1.is_empty() {
            self.b1.pop();
        }
        while self.t1.len() + self.t2.len() + self.b1.len() + self.b2.len() > 2 * c {
            if !self.b2.is_empty() {
                self.b2.pop();
            } else if !self.b1.is_empty() {
                self.b1.pop();
            } else {
                unreachable!("more than 2c evictable blocks");
            }
        }
    }

    /// (T1, T2, B1, B2), each LRU first.
    #[cfg(all(test, not(loom)))]
    fn lists(&self) -> (Vec<u32>, Vec<u32>, Vec<Digest>, Vec<Digest>) {
        (
            self.t1.blocks(),
            self.t2.blocks(),
            self.b1.keys(),
            self.b2.keys(),
        )
    }
}

impl Rules for ArcRules {
    fn insert(&mut self, block: u32, key: &Digest, revived: bool) {
        let readmit = self.readmit.remove(key);
        // Short-circuit as the reference does: a revival or a readmission is no ghost hit.
        let list = if revived || readmit || self.ghost_hit(key) {
            List::T2 // cases I, II, III
        } else {
            List::T1 // case IV
        };
        let seq = self.list(list).push(block);
        self.pos[block as usize] = (list, seq);
        self.bound();
    }

    fn hit(&mut self, block: u32) {
        self.forget(block); // `pos` stays, for `unhit`
    }

    fn unhit(&mut self, block: u32) {
        let (list, seq) = self.pos[block as usize];
        self.list(list).put_back(seq, block);
    }

    fn forget(&mut self, block: u32) {
        let (list, seq) = self.pos[block as usize];
        self.list(list).remove(seq, block);
    }

    fn miss(&mut self, key: &Digest) {
        if self.ghost_hit(key) {
            self.readmit.add(*key);
            self.readmit.trim(self.c);
        }
    }

    fn pick(&mut self, keys: &Keys) -> Option<u32> {
        let b = if self.replace_from() == List::T1 {
            let b = self.t1.pop()?;
            self.b1.add(keys.key(b));
            b
        } else {
            let b = self.t2.pop()?;
            self.b2.add(keys.key(b));
            b
        };
        self.bound();
        Some(b)
    }

    fn peek(&mut self) -> Option<u32> {
        match self.replace_from() {
            List::T1 => self.t1.first(),
            List::T2 => self.t2.first(),
        }
    }

    fn drop_block(&mut self, block: u32) {
        self.pos.drop_block(block);
    }

    fn table_bytes(&self) -> usize {
        self.pos.bytes()
    }

    fn clear(&mut self) {
        self.pos.reset(|_| {});
        self.p = 0;
        self.t1.clear();
        self.t2.clear();
        self.b1.clear();
        self.b2.clear();
        self.readmit.clear();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::eviction::test_util::{drain, entry, k};
    use crate::eviction::Policy;

    #[test]
    fn hand_worked() {
        let mut p = ArcPolicy::with_cache_size(Tables::Dense(5), 4).unwrap();
        for (b, name) in ["a", "b", "c"].iter().enumerate() {
            p.cached(entry(b as u32, name)); // case IV: T1 = 0 1 2
        }
        // |T1| = 3 > p = 0: T1's LRU 0 goes, its key to B1.
        assert_eq!(p.victim().unwrap().block, 0);
        assert_eq!(p.rules.lists(), (vec![1, 2], vec![], vec![k("a")], vec![]));
        p.hit(1); // case I: block 1 goes to T2 when released
        p.cached(entry(1, "b"));
        assert_eq!(p.rules.lists(), (vec![2], vec![1], vec![k("a")], vec![]));
        // Key a again (case II): p = min(4, 0 + max(0 // 1, 1)) = 1; block 3 to T2.
        p.cached(entry(3, "a"));
        assert_eq!(p.rules.p, 1);
        assert_eq!(p.rules.lists(), (vec![2], vec![1, 3], vec![], vec![]));
        // |T1| = 1 is not > p = 1: T2's LRU 1 goes, its key to B2.
        assert_eq!(p.victim().unwrap().block, 1);
        // Key b again (case III): p = max(0, 1 - max(0 // 1, 1)) = 0; block 4 to T2.
        p.cached(entry(4, "b"));
        assert_eq!(p.rules.p, 0);
        assert_eq!(p.rules.lists(), (vec![2], vec![3, 4], vec![], vec![]));
        assert_eq!(drain(&mut p), vec![2, 3, 4]);
        let want = (vec![], vec![], vec![k("c")], vec![k("a"), k("b")]);
        assert_eq!(p.rules.lists(), want);
    }

    #[test]
    fn directory_stays_within_2c() {
        let c = 3;
        let mut p = ArcPolicy::new(c).unwrap();
        for i in 0..20u32 {
            let b = i % c as u32;
            p.cached(entry(b, &format!("s{i}"))); // a pure scan: every key new
            assert_eq!(p.victim().unwrap().block, b);
            let (t1, t2, b1, b2) = p.rules.lists();
            assert!(t1.len() + b1.len() <= c);
            assert!(t1.len() + t2.len() + b1.len() + b2.len() <= 2 * c);
        }
        assert_eq!(p.rules.lists().2, vec![k("s17"), k("s18"), k("s19")]);
    }

    #[test]
    fn miss_adapts_p_at_the_request() {
        let mut p = ArcPolicy::new(2).unwrap();
        p.cached(entry(0, "a"));
        assert_eq!(p.victim().unwrap().block, 0); // B1 = a
        p.miss(&k("a")); // case II at the request: p = 1, a leaves B1 at once
        assert_eq!(p.rules.p, 1);
        assert!(p.rules.lists().2.is_empty());
        p.cached(entry(0, "a")); // its block joins T2
        assert_eq!(p.rules.lists().0, vec![]);
        assert_eq!(p.rules.lists().1, vec![0]);
    }

    #[test]
    fn restore_undoes_a_hit_and_clear_forgets_p() {
        let mut p = ArcPolicy::new(4).unwrap();
        for (b, name) in ["a", "b", "c"].iter().enumerate() {
            p.cached(entry(b as u32, name));
        }
        p.victim().unwrap(); // B1 = a
        p.cached(entry(0, "a")); // case II: p = 1, T2 = 0
        p.hit(1); // from T1: would go to T2
        p.hit(0);
        p.restore(entry(0, "a"));
        p.restore(entry(1, "b"));
        assert_eq!(p.rules.lists(), (vec![1, 2], vec![0], vec![], vec![]));
        assert_eq!(p.len(), 3);
        p.hit(1); // a revival pending across the reset
        let mut gone: Vec<u32> = p.clear().iter().map(|e| e.block).collect();
        gone.sort_unstable();
        assert_eq!(gone, vec![0, 2]);
        assert_eq!(p.rules.p, 0);
        assert_eq!(p.len(), 0);
        // Cleared, the revival is forgotten: block 1 under b is new (T1).
        p.cached(entry(1, "b"));
        assert_eq!(p.rules.lists(), (vec![1], vec![], vec![], vec![]));
    }
}
