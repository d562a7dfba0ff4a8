//! Locked LRU (`eviction/lru.py`): least recently released first, the default order, run as
//! a locked policy. The pool runs its default LRU lock-free (`lru_queue`); this one is for
//! the tests, which compare the locked machinery against that default.

use super::base::{Keys, Rules, Tracked};
use super::block_table::{BlockTable, Tables};
use super::seq_queue::SeqQueue;
use crate::error::Result;
use crate::hashing::Digest;

/// The locked LRU policy.
pub(crate) type Lru = Tracked<LruRules>;

pub(crate) struct LruRules {
    queue: SeqQueue,
    /// Each cached or revived block's position in `queue`.
    seq: BlockTable<u64>,
}

impl Lru {
    pub(crate) fn new(num_blocks: usize) -> Result<Self> {
        Self::with_tables(Tables::Dense(num_blocks))
    }

    pub(crate) fn with_tables(tables: Tables) -> Result<Self> {
        let rules = LruRules {
            queue: SeqQueue::default(),
            seq: BlockTable::new(tables, 0, "the LRU policy's positions")?,
        };
        Self::with_rules(tables, rules)
    }
}

impl Rules for LruRules {
    fn insert(&mut self, block: u32, _key: &Digest, _revived: bool) {
        self.seq[block as usize] = self.queue.push(block);
    }

    fn hit(&mut self, block: u32) {
        self.forget(block);
    }

    fn unhit(&mut self, block: u32) {
        self.queue.put_back(self.seq[block as usize], block);
    }

    fn forget(&mut self, block: u32) {
        self.queue.remove(self.seq[block as usize], block);
    }

    fn pick(&mut self, _keys: &Keys) -> Option<u32> {
        self.queue.pop()
    }

    fn peek(&mut self) -> Option<u32> {
        self.queue.first()
    }

    fn drop_block(&mut self, block: u32) {
        self.seq.drop_block(block);
    }

    fn table_bytes(&self) -> usize {
        self.seq.bytes()
    }

    fn clear(&mut self) {
        self.seq.reset(|_| {});
        self.queue.clear();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::eviction::test_util::{drain, entry};
    use crate::eviction::Policy;

    #[test]
    fn hand_worked() {
        let mut p = Lru::new(4).unwrap();
        for b in 0..3 {
            p.cached(entry(b, &format!("k{b}")));
        }
        p.hit(1); // 1 leaves; queue 0 2
        p.cached(entry(1, "k1")); // back at the newest end: 0 2 1
        p.cached(entry(3, "k3")); // 0 2 1 3
        p.removed(2); // withdrawn, not evicted: 0 1 3
        assert_eq!(p.rules.queue.blocks(), vec![0, 1, 3]);
        assert_eq!(drain(&mut p), vec![0, 1, 3]);
        assert!(p.victim().is_none());
    }

    #[test]
    fn restore_puts_the_block_back_in_place() {
        let mut p = Lru::new(4).unwrap();
        for b in 0..4 {
            p.cached(entry(b, &format!("k{b}")));
        }
        p.hit(1);
        p.hit(2);
        p.restore(entry(1, "k1"));
        p.restore(entry(2, "k2"));
        assert_eq!(drain(&mut p), vec![0, 1, 2, 3]);
    }
}
