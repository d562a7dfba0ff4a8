//! Tests of `policy_replay`: hand-checked streams, LRU against the curve, and the optimum
//! against every policy and against an exhaustive search on small streams.

use super::*;
use crate::block_replay::{block_stream, TraceIds};
use crate::stack::thresholds;
use crate::stream::with_parents;
use std::collections::HashMap;

/// A stream of prompts given as key chains: each looked up whole, then touched tail first.
fn prompts(chains: &[&[u64]]) -> Stream {
    let mut s = Stream::default();
    for c in chains {
        s.push(with_parents(c, 0..c.len()), true);
        s.push(with_parents(c, 0..c.len()).rev(), false);
    }
    s
}

#[test]
fn one_block_alternating_the_optimum_keeps_what_comes_back_first() {
    // a b a b a with room for one block: LRU misses all; the optimum keeps a throughout.
    let s = prompts(&[&[1], &[2], &[1], &[2], &[1]]);
    assert_eq!(hits(&s, &[1], Policy::Lru, 0)[0], 0);
    assert_eq!(hits(&s, &[1], Policy::Fifo, 0)[0], 0);
    assert_eq!(hits(&s, &[1], Policy::Optimal, 0)[0], 2);
    assert_eq!(hits(&s, &[2], Policy::Optimal, 0)[0], 3); // both fit: every repeat hits
}

#[test]
fn shared_head_two_tails_the_optimum_keeps_the_next_tail() {
    // [r x] [r y] [r x] [r y] with room for two: LRU keeps r and the last tail (3 hits: r
    // three times); the optimum keeps r and x, leaving y out (r three times and x once).
    let s = prompts(&[&[10, 11], &[10, 12], &[10, 11], &[10, 12]]);
    assert_eq!(hits(&s, &[2], Policy::Lru, 0)[0], 3);
    assert_eq!(hits(&s, &[2], Policy::Optimal, 0)[0], 4);
    // Counting from the third lookup only: r and x, then r.
    assert_eq!(hits(&s, &[2], Policy::Optimal, 2)[0], 3);
    assert_eq!(hits(&s, &[2], Policy::Lru, 2)[0], 2);
}

#[test]
fn a_block_is_kept_only_with_its_parent() {
    // A child touched on its own (its parent never cached) is not let in, and a lookup counts
    // only the prefix: the optimum cannot hit the child.
    let mut s = Stream::default();
    s.push([(21u64, 20u64)], false); // child 21 of 20, 20 never touched
    s.push(with_parents(&[20, 21], 0..2), true);
    assert_eq!(hits(&s, &[4], Policy::Optimal, 0)[0], 0);
    assert_eq!(hits(&s, &[4], Policy::Lru, 0)[0], 0); // prefix hits only: 20 misses first
}

/// A tiny pseudo-random generator (no dependency).
struct Rnd(u64);

impl Rnd {
    fn below(&mut self, m: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % m
    }
}

/// Random prompts as paths in a small tree of ids (2 roots, branching 2, depth 1 to 3),
/// replayed purely at block granularity (ids of 2 tokens, blocks of 2).
fn random_trace(rnd: &mut Rnd, requests: usize) -> Stream {
    let mut ids = Vec::new();
    let mut offsets = vec![0];
    let mut lengths = Vec::new();
    for _ in 0..requests {
        let depth = 1 + rnd.below(3) as usize;
        let mut node = 0u64;
        for _ in 0..depth {
            node = node * 2 + 1 + rnd.below(2);
            ids.push(node);
        }
        // The whole prompt (its last block not looked up: a token is left to compute), or
        // one token more (a partial id: every full block looked up).
        lengths.push(2 * depth + usize::from(rnd.below(2) == 0));
        ids.push(999); // the partial id (one token at most: never a full block)
        offsets.push(ids.len());
    }
    let roots = vec![3; requests];
    let trace = TraceIds {
        ids: &ids,
        offsets: &offsets,
        lengths: &lengths,
        roots: &roots,
        id_tokens: 2,
    };
    block_stream(&trace, 2).expect("valid")
}

/// The best prefix hits any policy can reach: every choice at every touch (keep, let the
/// block in while there is room, or let it in in place of any cached block), no constraint.
fn exhaustive(s: &Stream, capacity: usize, first_lookup: usize) -> u64 {
    let mut index: HashMap<u64, u32> = HashMap::new();
    for &k in &s.keys {
        let next = index.len() as u32;
        index.entry(k).or_insert(next);
    }
    assert!(index.len() <= 20, "too many keys for an exhaustive search");
    let bit = |k: u64| 1u32 << index[&k];
    let mut states: HashMap<u32, u64> = HashMap::from([(0, 0)]);
    let mut start = 0;
    let mut lookup = 0;
    for piece in &s.pieces {
        let keys = &s.keys[start..piece.end];
        start = piece.end;
        if piece.lookup {
            let counted = lookup >= first_lookup;
            lookup += 1;
            for (mask, best) in states.iter_mut() {
                let run = keys.iter().take_while(|&&k| mask & bit(k) != 0).count();
                *best += if counted { run as u64 } else { 0 };
            }
            continue;
        }
        for &k in keys {
            let mut next: HashMap<u32, u64> = HashMap::new();
            let mut keep = |m: u32, h: u64| {
                let e = next.entry(m).or_insert(0);
                *e = (*e).max(h);
            };
            for (&mask, &h) in &states {
                keep(mask, h);
                if mask & bit(k) != 0 {
                    continue;
                }
                if (mask.count_ones() as usize) < capacity {
                    keep(mask | bit(k), h);
                } else {
                    let mut rest = mask;
                    while rest != 0 {
                        let y = rest & rest.wrapping_neg();
                        rest &= rest - 1;
                        keep((mask & !y) | bit(k), h);
                    }
                }
            }
            states = next;
        }
    }
    states.values().copied().max().unwrap_or(0)
}

#[test]
fn the_optimum_equals_an_exhaustive_search_on_small_traces() {
    let mut rnd = Rnd(11);
    for round in 0..60 {
        let s = random_trace(&mut rnd, 4 + round % 5);
        for capacity in 1..=4 {
            let first = round % 3;
            assert_eq!(
                hits(&s, &[capacity], Policy::Optimal, first)[0],
                exhaustive(&s, capacity, first),
                "round {round}, capacity {capacity}"
            );
        }
    }
}

/// The curve's hit count at `capacity`: thresholds at or below it.
fn curve_hits(s: &Stream, capacity: usize, first_lookup: usize) -> u64 {
    let t = thresholds(&s.keys, &s.pieces, 1.0, first_lookup);
    t.values.iter().filter(|&&v| v <= capacity as f64).count() as u64
}

#[test]
fn lru_equals_the_curve_and_the_optimum_bounds_every_policy() {
    let mut rnd = Rnd(5);
    for round in 0..40 {
        let s = random_trace(&mut rnd, 30 + round);
        for capacity in 1..=16 {
            let first = round % 4;
            let lru = hits(&s, &[capacity], Policy::Lru, first)[0];
            let fifo = hits(&s, &[capacity], Policy::Fifo, first)[0];
            let opt = hits(&s, &[capacity], Policy::Optimal, first)[0];
            assert_eq!(
                lru,
                curve_hits(&s, capacity, first),
                "round {round}, C {capacity}"
            );
            assert!(opt >= lru && opt >= fifo, "round {round}, C {capacity}");
        }
    }
}

/// A scheduled replay's kind of stream: prompts looked up on admission, touched in chunks
/// head first while they run side by side, released tail first later.
fn interleaved(rnd: &mut Rnd, requests: usize) -> Stream {
    let mut s = Stream::default();
    let mut running: Vec<Vec<u64>> = Vec::new();
    for _ in 0..requests {
        let depth = 1 + rnd.below(4) as usize;
        let mut chain = Vec::new();
        let mut node = 0u64;
        for _ in 0..depth {
            node = node * 2 + 1 + rnd.below(2);
            chain.push(node);
        }
        s.push(with_parents(&chain, 0..chain.len()), true);
        let cut = rnd.below(depth as u64 + 1) as usize;
        s.push(with_parents(&chain, 0..cut), false);
        s.push(with_parents(&chain, cut..chain.len()), false);
        running.push(chain);
        if running.len() > 2 || rnd.below(2) == 0 {
            let done = running.remove(rnd.below(running.len() as u64) as usize);
            s.push(with_parents(&done, 0..done.len()).rev(), false);
        }
    }
    s
}

#[test]
fn on_interleaved_streams_the_optimum_still_bounds_lru_and_fifo() {
    let mut rnd = Rnd(23);
    for round in 0..40 {
        let s = interleaved(&mut rnd, 20 + round);
        for capacity in 1..=12 {
            let lru = hits(&s, &[capacity], Policy::Lru, 0)[0];
            let fifo = hits(&s, &[capacity], Policy::Fifo, 0)[0];
            let opt = hits(&s, &[capacity], Policy::Optimal, 0)[0];
            assert_eq!(lru, curve_hits(&s, capacity, 0));
            assert!(opt >= lru && opt >= fifo, "round {round}, C {capacity}");
        }
    }
}
