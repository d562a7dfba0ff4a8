//! S3-FIFO (Yang et al., SOSP'23), exactly as the reference `eviction/s3fifo.py`, whose
//! module docs give the rules and every adaptation to a block manager: a small FIFO S that
//! filters blocks used once, a main FIFO M, a ghost FIFO G of digests evicted from S, and a
//! readmission list of ghost digests requested (`miss`) before their block is cached.

use super::base::{Keys, Rules, Tracked};
use super::block_table::{BlockTable, Tables};
use super::seq_queue::{KeyFifo, SeqQueue};
use crate::error::Result;
use crate::hashing::Digest;

/// The paper's two-bit frequency counter.
const MAX_FREQ: u8 = 3;
/// The frequency a block at S's oldest end needs to move to M (the paper's `freq > 1`).
const MOVE_TO_MAIN: u8 = 2;

/// The S3-FIFO policy.
pub(crate) type S3Fifo = Tracked<S3FifoRules>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Home {
    Small,
    Main,
}

/// A cached or revived block's state (the reference's `_home` and `_freq`, and the
/// position in its queue).
#[derive(Clone, Copy)]
struct Meta {
    home: Home,
    freq: u8,
    seq: u64,
    /// The frequency before the latest hit, for `unhit`.
    freq_before_hit: u8,
}

pub(crate) struct S3FifoRules {
    small: SeqQueue,
    main: SeqQueue,
    ghost: KeyFifo,
    readmit: KeyFifo,
    ghost_cap: usize,
    readmit_cap: usize,
    meta: BlockTable<Meta>,
    /// The queue whose oldest block is the next victim, as the latest `peek` left it; None
    /// once any other call came (`pick` then decides afresh).
    decided: Option<Home>,
}

/// `c - int(c * 0.1)`: M's share of the cache, the ghost's capacity. `c / 10` is
/// `int(c * 0.1)` for every `c` below 2^52 (`tests::float_thresholds_match_python`).
fn ghost_cap(c: usize) -> usize {
    c - c / 10
}

/// Python's `len(S) >= 0.1 * total` in integers, exact for totals below 2^52 (see
/// `tests::float_thresholds_match_python`).
fn small_is_big(small: usize, total: usize) -> bool {
    10 * small as u128 >= total as u128
}

impl S3Fifo {
    pub(crate) fn new(num_blocks: usize) -> Result<Self> {
        Self::with_tables(num_blocks, Tables::Dense(num_blocks))
    }

    /// Ghost and readmission bounds from the pool's `num_blocks`, tables as `tables` says.
    pub(crate) fn with_tables(num_blocks: usize, tables: Tables) -> Result<Self> {
        let meta = Meta {
            home: Home::Small,
            freq: 0,
            seq: 0,
            freq_before_hit: 0,
        };
        let rules = S3FifoRules {
            small: SeqQueue::default(),
            main: SeqQueue::default(),
            ghost: KeyFifo::default(),
            readmit: KeyFifo::default(),
            ghost_cap: ghost_cap(num_blocks),
            readmit_cap: num_blocks,
            meta: BlockTable::new(tables, meta, "the S3-FIFO policy's block table")?,
            decided: None,
        };
        Self::with_rules(tables, rules)
    }
}

impl S3FifoRules {
    fn queue(&mut self, home: Home) -> &mut SeqQueue {
        match home {
            Home::Small => &mut self.small,
            Home::Main => &mut self.main,
        }
    }

    fn push(&mut self, block: u32, home: Home) {
        let seq = self.queue(home).push(block);
        let m = &mut self.meta[block as usize];
        m.home = home;
        m.seq = seq;
    }

    /// Decide which queue the victim comes from and make the moves that come first, so
    /// that the victim is that queue's oldest block (the reference's `_settle`); None when
    /// the set is empty. Decided once: a `peek`'s moves change the sizes the choice
    /// between S and M looks at, so the `pick` after it keeps the peek's choice.
    fn settle(&mut self) -> Option<Home> {
        if let Some(home) = self.decided {
            return Some(home);
        }
        let total = self.small.len() + self.main.len();
        if total == 0 {
            return None;
        }
        let from_small = !self.small.is_empty()
            && (small_is_big(self.small.len(), total) || self.main.is_empty());
        let home = if from_small && self.settle_small() {
            Home::Small
        } else {
            // M is not empty here: S emptied into it, or S was small.
            self.settle_main();
            Home::Main
        };
        self.decided = Some(home);
        Some(home)
    }

    /// S's oldest block moves to M while reused; whether one used less is left (the
    /// victim), false if every block of S moved.
    fn settle_small(&mut self) -> bool {
        while let Some(b) = self.small.first() {
            if self.meta[b as usize].freq < MOVE_TO_MAIN {
                return true;
            }
            self.small.pop();
            self.meta[b as usize].freq = 0; // the paper clears the bits on the move
            self.push(b, Home::Main);
        }
        false
    }

    /// M's oldest block is reinserted with one access spent while it has any.
    fn settle_main(&mut self) {
        while let Some(b) = self.main.first() {
            let m = &mut self.meta[b as usize];
            if m.freq == 0 {
                return;
            }
            m.freq -= 1;
            self.main.pop();
            self.push(b, Home::Main);
        }
    }

    /// (S, M, G), each oldest first.
    #[cfg(all(test, not(loom)))]
    fn queues(&self) -> (Vec<u32>, Vec<u32>, Vec<Digest>) {
        (self.small.blocks(), self.main.blocks(), self.ghost.keys())
    }
}

impl Rules for S3FifoRules {
    fn insert(&mut self, block: u32, key: &Digest, revived: bool) {
        self.decided = None;
        let home = if revived {
            self.meta[block as usize].home // the queue it left, newest end; freq kept
        } else {
            let seen = self.ghost.contains(key) || self.readmit.contains(key);
            self.ghost.remove(key);
            self.readmit.remove(key);
            self.meta[block as usize].freq = 0;
            if seen {
                Home::Main
            } else {
                Home::Small
            }
        };
        self.push(block, home);
    }

    fn hit(&mut self, block: u32) {
        self.decided = None;
        let m = self.meta[block as usize];
        self.queue(m.home).remove(m.seq, block);
        let m = &mut self.meta[block as usize];
        m.freq_before_hit = m.freq;
        m.freq = (m.freq + 1).min(MAX_FREQ);
    }

    fn unhit(&mut self, block: u32) {
        self.decided = None;
        let m = &mut self.meta[block as usize];
        m.freq = m.freq_before_hit;
        let m = *m;
        self.queue(m.home).put_back(m.seq, block);
    }

    fn forget(&mut self, block: u32) {
        self.decided = None;
        let m = self.meta[block as usize];
        self.queue(m.home).remove(m.seq, block);
    }

    fn miss(&mut self, key: &Digest) {
        self.decided = None;
        if self.ghost.remove(key) {
            self.readmit.add(*key);
            self.readmit.trim(self.readmit_cap);
        }
    }

    fn pick(&mut self, keys: &Keys) -> Option<u32> {
        let home = self.settle()?;
        self.decided = None;
        let b = self.queue(home).pop();
        debug_assert!(b.is_some(), "settled on an empty queue");
        if let (Home::Small, Some(b)) = (home, b) {
            // Evicted from S: its digest to G. (From M: no ghost.)
            self.ghost.add(keys.key(b));
            self.ghost.trim(self.ghost_cap);
        }
        b
    }

    fn peek(&mut self) -> Option<u32> {
        let home = self.settle()?;
        self.queue(home).first()
    }

    fn drop_block(&mut self, block: u32) {
        self.meta.drop_block(block);
    }

    fn table_bytes(&self) -> usize {
        self.meta.bytes()
    }

    fn clear(&mut self) {
        self.meta.reset(|_| {});
        self.decided = None;
        self.small.clear();
        self.main.clear();
        self.ghost.clear();
        self.readmit.clear();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::eviction::test_util::{drain, entry, k};
    use crate::eviction::Policy;

    fn victims(p: &mut S3Fifo, n: usize) -> Vec<u32> {
        (0..n).map(|_| p.victim().unwrap().block).collect()
    }

    #[test]
    fn hand_worked() {
        let mut p = S3Fifo::new(10).unwrap(); // G holds up to 9 keys
        for (b, name) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            p.cached(entry(b as u32, name)); // new keys: all to S, freq 0
        }
        assert_eq!(p.rules.queues(), (vec![0, 1, 2, 3, 4], vec![], vec![]));
        // M is empty, so S: its oldest, 0, has freq 0 < 2: evicted, its key to G.
        assert_eq!(p.victim().unwrap().block, 0);
        assert_eq!(p.rules.queues(), (vec![1, 2, 3, 4], vec![], vec![k("a")]));
        // Block 1 is hit twice (freq 2), each time re-entering S at the newest end.
        for _ in 0..2 {
            p.hit(1);
            p.cached(entry(1, "b"));
        }
        assert_eq!(p.rules.queues(), (vec![2, 3, 4, 1], vec![], vec![k("a")]));
        // Key a comes back in block 5: it is in G, so the block goes to M and leaves G.
        p.cached(entry(5, "a"));
        assert_eq!(p.rules.queues(), (vec![2, 3, 4, 1], vec![5], vec![]));
        // |S| = 4 >= 10% of 5: S's 2, 3 and 4 (freq 0) go, each key to G.
        assert_eq!(victims(&mut p, 3), vec![2, 3, 4]);
        assert_eq!(
            p.rules.queues(),
            (vec![1], vec![5], vec![k("c"), k("d"), k("e")])
        );
        // Block 5 is hit once: freq 1; it re-enters M at the newest end.
        p.hit(5);
        p.cached(entry(5, "a"));
        // S's 1 (freq 2) moves to M with freq 0 (M = 5 1); M's 5 (freq 1) is reinserted
        // with 0 (M = 1 5); 1 (freq 0) is evicted. Then 5.
        assert_eq!(victims(&mut p, 2), vec![1, 5]);
        assert!(p.victim().is_none());
        assert_eq!(p.rules.queues().2, vec![k("c"), k("d"), k("e")]); // M leaves no ghost
    }

    #[test]
    fn one_hit_does_not_move_to_main() {
        let mut p = S3Fifo::new(10).unwrap();
        p.cached(entry(0, "a"));
        p.cached(entry(1, "b"));
        p.hit(0); // freq 1, back at S's newest end: S = 1 0
        p.cached(entry(0, "a"));
        assert_eq!(drain(&mut p), vec![1, 0]);
        assert_eq!(p.rules.queues(), (vec![], vec![], vec![k("b"), k("a")]));
    }

    #[test]
    fn main_before_small_when_small_is_small() {
        let mut p = S3Fifo::new(100).unwrap();
        let name = |b: u32| format!("m{b}");
        for b in 0..10 {
            p.cached(entry(b, &name(b)));
        }
        for _ in 0..10 {
            p.victim().unwrap(); // all ten from S into G (freq 0)
        }
        for b in 0..10 {
            p.cached(entry(b, &name(b))); // ghost hits: M
        }
        p.cached(entry(10, "new"));
        let (s, m, _) = p.rules.queues();
        assert_eq!((s, m), (vec![10], (0..10).collect()));
        // |S| = 1 < 10% of 11: the victim is M's oldest, not the newcomer in S.
        assert_eq!(p.victim().unwrap().block, 0);
    }

    #[test]
    fn miss_keeps_a_ghost_hit_across_evictions() {
        let mut p = S3Fifo::new(3).unwrap(); // G holds 3 keys
        for (b, name) in ["a", "b", "c"].iter().enumerate() {
            p.cached(entry(b as u32, name));
        }
        assert_eq!(victims(&mut p, 3), vec![0, 1, 2]); // G = a b c
        p.miss(&k("a")); // a ghost hit, remembered
        for (b, name) in ["x", "y", "z"].iter().enumerate() {
            p.cached(entry(b as u32, name)); // G = x y z after their evictions
        }
        assert_eq!(victims(&mut p, 3), vec![0, 1, 2]);
        assert!(!p.rules.queues().2.contains(&k("a")));
        p.cached(entry(0, "a")); // requested: into M
        p.cached(entry(1, "b")); // never reported and out of G: into S
        assert_eq!(p.rules.queues().0, vec![1]);
        assert_eq!(p.rules.queues().1, vec![0]);
    }

    #[test]
    fn readmission_list_keeps_the_latest_c_keys() {
        let mut p = S3Fifo::new(2).unwrap(); // G holds 2 keys, readmission 2
        for round in 0..2 {
            for b in 0..2u32 {
                p.cached(entry(b, &format!("r{round}-{b}")));
            }
            assert_eq!(drain(&mut p), vec![0, 1]);
            for b in 0..2u32 {
                p.miss(&k(&format!("r{round}-{b}")));
            }
        }
        // Four keys were requested from G; the two oldest left the readmission list.
        p.cached(entry(0, "r0-0"));
        p.cached(entry(1, "r1-1"));
        assert_eq!(p.rules.queues().0, vec![0]);
        assert_eq!(p.rules.queues().1, vec![1]);
    }

    #[test]
    fn restore_undoes_a_hit() {
        // Two identical policies; the second sees a hit of 1 and its restore, which must
        // leave no trace: freq, queue and position.
        let mut a = S3Fifo::new(10).unwrap();
        let mut b = S3Fifo::new(10).unwrap();
        for p in [&mut a, &mut b] {
            for x in 0..4 {
                p.cached(entry(x, &format!("k{x}")));
            }
            p.hit(1);
            p.cached(entry(1, "k1")); // freq 1, S = 0 2 3 1
            p.cached(entry(4, "k4")); // S = 0 2 3 1 4
        }
        b.hit(1); // freq 2: would move to M
        b.hit(2);
        b.restore(entry(1, "k1"));
        b.restore(entry(2, "k2"));
        assert_eq!(a.rules.queues(), b.rules.queues());
        assert_eq!(b.rules.meta[1].freq, 1);
        // With freq 2 left over, 1 would move to M and outlive 4.
        assert_eq!(drain(&mut a), vec![0, 2, 3, 1, 4]);
        assert_eq!(drain(&mut b), vec![0, 2, 3, 1, 4]);
        // The restore forgot the revival: cached again under k1, block 1 is new (S).
        b.cached(entry(1, "k1"));
        assert_eq!(b.rules.meta[1].freq, 0);
    }

    #[test]
    fn float_thresholds_match_python() {
        // Python: `len(S) >= 0.1 * total` and `int(c * 0.1)` with IEEE doubles. The
        // threshold is monotone in len(S), so checking around ceil(total / 10) suffices.
        let check = |n: usize| {
            assert_eq!(ghost_cap(n), n - (n as f64 * 0.1) as usize, "c = {n}");
            let t = n.div_ceil(10);
            for s in t.saturating_sub(1)..=t + 1 {
                assert_eq!(small_is_big(s, n), s as f64 >= 0.1 * n as f64, "{s} of {n}");
            }
        };
        (0..200_000).for_each(check);
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for _ in 0..200_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            check((x >> 31) as usize); // below 2^33
        }
        for n in [
            (1usize << 31) - 1,
            1 << 31,
            (1 << 32) - 1,
            1 << 32,
            (1 << 40) + 7,
        ] {
            check(n);
        }
    }

    /// An S3-FIFO policy with M = 18 blocks (ghost hits), then S = [20 (key a, hit twice:
    /// freq 2), 21 (key b, freq 0)].
    fn s3fifo_case() -> S3Fifo {
        let mut p = S3Fifo::new(40).unwrap();
        let name = |i: u32| format!("m{i}");
        for i in 0..18 {
            p.cached(entry(i, &name(i)));
        }
        for _ in 0..18 {
            p.victim().unwrap();
        }
        for i in 0..18 {
            p.cached(entry(i, &name(i))); // in G: to M
        }
        p.cached(entry(20, "a"));
        for _ in 0..2 {
            p.hit(20);
            p.cached(entry(20, "a"));
        }
        p.cached(entry(21, "b"));
        let (s, m, _) = p.rules.queues();
        assert_eq!((s, m), (vec![20, 21], (0..18).collect()));
        p
    }

    #[test]
    fn s3fifo_peek_makes_the_moves_and_keeps_its_choice_of_queue() {
        // |S| = 2 is 10% of 20: the victim comes from S, where 20 moves to M first. With
        // |S| = 1 the choice would now be M; the victim after the peek is still 21, from S.
        let mut p = s3fifo_case();
        assert_eq!(p.peek().map(|e| e.block), Some(21));
        let (s, m, _) = p.rules.queues();
        assert_eq!((s, m.len(), m.last()), (vec![21], 19, Some(&20))); // moved, for real
        assert_eq!(p.peek().map(|e| e.block), Some(21));
        assert_eq!(p.victim().map(|e| e.block), Some(21));
        assert_eq!(p.rules.queues().2.last(), Some(&k("b"))); // evicted from S: key to G
                                                              // S is empty now: M's oldest.
        assert_eq!(p.peek().map(|e| e.block), Some(0));
    }

    #[test]
    fn s3fifo_peek_then_another_call_keeps_the_moves_not_the_choice() {
        // Without a peek: S = [20, 21, 30] of 21 is big, 20 moves to M and 21 goes.
        let mut p = s3fifo_case();
        p.cached(entry(30, "e"));
        assert_eq!(p.victim().map(|e| e.block), Some(21));
        // With a peek first: its move of 20 to M stays; after the cache of 30, S = [21, 30]
        // of 21 is under 10%, so the victim is decided afresh and comes from M.
        let mut p = s3fifo_case();
        assert_eq!(p.peek().map(|e| e.block), Some(21));
        p.cached(entry(30, "e"));
        assert_eq!(p.peek().map(|e| e.block), Some(0));
        assert_eq!(p.victim().map(|e| e.block), Some(0));
        assert_eq!(p.rules.queues().0, vec![21, 30]);
    }
}
