//! Prefix matches: for a request's block hashes, how many leading blocks each holder holds.
//!
//! For each word of 64 holders, the live mask is the set of holders still matching; each
//! block's bits narrow it; a holder that drops out at block i holds exactly i leading blocks.
//! The walk stops when no holder of the word is left. It takes no lock but one shard's read
//! lock per probe (`blocks.rs`); each word is read under its generation (`slots.rs`) and
//! read again if a holder of it was retired meanwhile, so no answer mixes the bits of two
//! holders that shared a slot one after the other.
//!
//! A lookup that runs while an engine applies a batch may see part of that batch (each bit it
//! reads is one the engine held at some moment during the lookup).

use crate::engine::EngineKey;
use crate::index::RouterIndex;
use crate::key::BlockKey;
use crate::word_read::{read_word, Blocks};

/// How many blocks ahead of the probe a walk prefetches: enough misses in flight to cover a
/// memory latency at the probe's pace.
const AHEAD: usize = 16;

/// One holder's answer, with the engine as its handle (`RouterIndex::with_engine_key` names it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct RawHit {
    pub engine: u32,
    pub medium: u16,
    pub group: u16,
    /// Leading blocks of the request the holder holds (at least 1).
    pub blocks: u32,
}

/// One holder's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub engine: EngineKey,
    /// The medium's id (`RouterIndex::medium_name`).
    pub medium: u16,
    pub group: u16,
    pub blocks: u32,
}

/// A request's keys walked through the block map for one word: the hashes of the next AHEAD
/// blocks kept in a ring, their slots prefetched (word 0).
struct KeyWalk<'a, K: BlockKey> {
    index: &'a RouterIndex<K>,
    keys: &'a [K],
    ahead: [u64; AHEAD],
    /// Whether a probe waits for a shard's lock; if not, a lock not free at once sets
    /// `blocked` and ends the walk (its answer then is not used).
    wait: bool,
    blocked: bool,
}

impl<K: BlockKey> Blocks for KeyWalk<'_, K> {
    #[inline]
    fn len(&self) -> usize {
        self.keys.len()
    }

    #[inline]
    fn start(&mut self, w: usize) {
        for (j, k) in self.keys.iter().take(AHEAD).enumerate() {
            self.ahead[j] = self.index.blocks.hash(k);
            if w == 0 {
                self.index.blocks.prefetch(self.ahead[j]);
            }
        }
    }

    #[inline]
    fn bits(&mut self, w: usize, i: usize) -> u64 {
        #[cfg(all(test, not(loom)))]
        tests::hook(w, Some(i));
        let blocks = &self.index.blocks;
        let hash = self.ahead[i % AHEAD];
        if let Some(next) = self.keys.get(i + AHEAD) {
            let h = blocks.hash(next);
            self.ahead[i % AHEAD] = h;
            if w == 0 {
                blocks.prefetch(h);
            }
        }
        if self.wait {
            return blocks.bits(self.keys[i], hash, w);
        }
        blocks.try_bits(self.keys[i], hash, w).unwrap_or_else(|| {
            self.blocked = true;
            0 // no holder left: the walk ends here
        })
    }
}

impl<K: BlockKey> RouterIndex<K> {
    /// Every holder that holds at least the first of `keys`, with the number of leading
    /// `keys` it holds; in no particular order. `out` is cleared first (reuse it across calls
    /// to save the allocation).
    pub fn match_raw(&self, keys: &[K], out: &mut Vec<RawHit>) {
        let done = self.walk(keys, out, true);
        debug_assert!(done);
    }

    /// `match_raw` without waiting for a lock: false, with `out` meaningless, if a probe
    /// found its shard's lock taken by a writer (a table growing, a snapshot's part being
    /// applied); the caller then runs `match_raw` where waiting is harmless (the binding
    /// holds the GIL for short lookups and must not wait with it).
    pub fn try_match_raw(&self, keys: &[K], out: &mut Vec<RawHit>) -> bool {
        self.walk(keys, out, false)
    }

    fn walk(&self, keys: &[K], out: &mut Vec<RawHit>, wait: bool) -> bool {
        out.clear();
        if keys.is_empty() {
            return true;
        }
        let mut words_hit = 0;
        let mut walk = KeyWalk {
            index: self,
            keys,
            ahead: [0; AHEAD],
            wait,
            blocked: false,
        };
        for w in 0..self.slots.words() {
            words_hit += usize::from(read_word(&self.slots, w, &mut walk, out));
            if walk.blocked {
                return false;
            }
        }
        if words_hit > 1 {
            // A snapshot committed during the lookup can show an engine's old holder in one
            // word and its new one in another: keep the larger answer of each.
            out.sort_unstable_by(|a, b| {
                (a.engine, a.medium, a.group, b.blocks)
                    .cmp(&(b.engine, b.medium, b.group, a.blocks))
            });
            out.dedup_by(|b, a| (a.engine, a.medium, a.group) == (b.engine, b.medium, b.group));
        }
        true
    }

    /// `match_raw` with each engine named; holders of engines removed meanwhile are left out.
    pub fn match_prefix(&self, keys: &[K]) -> Vec<Hit> {
        let mut raw = Vec::new();
        self.match_raw(keys, &mut raw);
        let names = self.names.pin();
        raw.iter()
            .filter_map(|h| {
                names.get(&h.engine).map(|e| Hit {
                    engine: e.clone(),
                    medium: h.medium,
                    group: h.group,
                    blocks: h.blocks,
                })
            })
            .collect()
    }

    /// Run `f` on each hit of `raw` with its engine's key, skipping engines removed meanwhile
    /// (the names map pinned once for all: no clone, no lock).
    pub fn name_hits(&self, raw: &[RawHit], mut f: impl FnMut(&RawHit, &EngineKey)) {
        let names = self.names.pin();
        for h in raw {
            if let Some(e) = names.get(&h.engine) {
                f(h, e);
            }
        }
    }

    /// Run `f` on the key of engine handle `engine`, if it is still known (no clone, no lock).
    pub fn with_engine_key<R>(&self, engine: u32, f: impl FnOnce(&EngineKey) -> R) -> Option<R> {
        self.names.pin().get(&engine).map(f)
    }
}

#[cfg(all(test, not(loom)))]
pub(crate) mod tests {
    use super::*;
    use crate::event::Event;
    use std::cell::RefCell;
    use std::sync::Arc;

    type Hook = Box<dyn FnMut(usize, Option<usize>)>;

    thread_local! {
        static HOOK: RefCell<Option<Hook>> = RefCell::new(None);
    }

    /// Runs the test's hook, if any, before the lookup reads word `w` (`None`) or key `i` of
    /// it.
    pub(crate) fn hook(w: usize, i: Option<usize>) {
        let hook = HOOK.with(|h| h.borrow_mut().take());
        if let Some(mut f) = hook {
            f(w, i);
            HOOK.with(|h| *h.borrow_mut() = Some(f));
        }
    }

    fn stored(hashes: &[u64]) -> Event<'static, u64> {
        Event::Stored {
            hashes: hashes.to_vec(),
            parent: None,
            medium: Some("GPU"),
            group: 0,
        }
    }

    /// A lookup is half-way through the chain when the engine it is reading is removed and its
    /// slot goes to another engine that holds only 3 blocks: the lookup reads the word again
    /// and answers 3 for the new engine, not the old engine's depth under the new one's name.
    #[test]
    fn a_slot_reused_mid_lookup_is_read_again() {
        let ix = Arc::new(RouterIndex::<u64>::default());
        let chain: Vec<u64> = (0..20).collect();
        ix.apply(&EngineKey::Int(0), &[stored(&chain)]).unwrap();
        ix.apply(&EngineKey::Int(1), &[stored(&chain[..10])])
            .unwrap();
        let ix2 = Arc::clone(&ix);
        HOOK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |_, i| {
                if i == Some(5) && ix2.remove_engine(&EngineKey::Int(1)) {
                    ix2.apply(&EngineKey::Int(2), &[stored(&chain[..3])])
                        .unwrap();
                }
            }))
        });
        let mut hits = ix.match_prefix(&(0..20).collect::<Vec<u64>>());
        HOOK.with(|h| h.borrow_mut().take());
        hits.sort_by_key(|h| h.engine.clone());
        let got: Vec<_> = hits.iter().map(|h| (h.engine.clone(), h.blocks)).collect();
        assert_eq!(got, vec![(EngineKey::Int(0), 20), (EngineKey::Int(2), 3)]);
    }

    /// A lookup that must not wait gives up while a writer holds a shard it probes, and
    /// answers once the lock is free; one that may wait answers after the writer is done.
    #[test]
    fn a_lookup_that_must_not_wait_gives_up_on_a_taken_shard() {
        let ix = Arc::new(RouterIndex::<u64>::default());
        let chain: Vec<u64> = (0..40).collect();
        ix.apply(&EngineKey::Int(0), &[stored(&chain)]).unwrap();
        let mut out = Vec::new();
        {
            let _writer = ix.blocks.lock_shard_of(&chain[25]);
            assert!(!ix.try_match_raw(&chain, &mut out));
            // A request that ends before the taken shard's block never reaches it.
            let other: Vec<u64> = chain[..25]
                .iter()
                .copied()
                .take_while(|k| ix.blocks.shard_of_key(k) != ix.blocks.shard_of_key(&chain[25]))
                .collect();
            assert!(ix.try_match_raw(&other, &mut out));
            assert_eq!(out.first().map_or(0, |h| h.blocks as usize), other.len());
        }
        assert!(ix.try_match_raw(&chain, &mut out));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].blocks, 40);
        let waiting = {
            let writer = ix.blocks.lock_shard_of(&chain[25]);
            let ix2 = Arc::clone(&ix);
            let chain2 = chain.clone();
            let t = std::thread::spawn(move || {
                let mut out = Vec::new();
                ix2.match_raw(&chain2, &mut out);
                out
            });
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(writer);
            t.join().unwrap()
        };
        assert_eq!(waiting.len(), 1);
        assert_eq!(waiting[0].blocks, 40);
    }

    /// A snapshot committed between two words of a lookup: the engine's old holder was read
    /// in word 0, its new one in word 1; the lookup answers once for it, the larger count.
    #[test]
    fn a_snapshot_committed_between_words_answers_once() {
        let ix = Arc::new(RouterIndex::<u64>::default());
        let chain: Vec<u64> = (0..20).collect();
        let x = EngineKey::from("x");
        ix.apply(&x, &[stored(&chain[..10])]).unwrap();
        for e in 0..63 {
            ix.apply(&EngineKey::Int(e), &[stored(&[99])]).unwrap();
        }
        ix.begin_snapshot(&x);
        ix.apply_staged(&x, &[stored(&chain[..6])]).unwrap();
        let ix2 = Arc::clone(&ix);
        let mut done = false;
        HOOK.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |w, i| {
                if w == 1 && i.is_none() && !done {
                    ix2.commit_snapshot(&EngineKey::from("x")).unwrap();
                    done = true;
                }
            }))
        });
        let hits = ix.match_prefix(&chain);
        HOOK.with(|h| h.borrow_mut().take());
        let got: Vec<_> = hits.iter().map(|h| (h.engine.clone(), h.blocks)).collect();
        assert_eq!(got, vec![(x.clone(), 10)]);
        assert_eq!(ix.match_prefix(&chain)[0].blocks, 6);
    }
}
