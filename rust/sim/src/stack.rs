//! Exact LRU stack distances over a stream of lookups and touches (Mattson's stack algorithm;
//! `python/pagedkv/sim/stack.py` is the numpy version), and the curve's thresholds.
//!
//! Times count touches. A key's last touch leaves a mark at its time (`Marks`); its
//! stack distance (1 = the most recent) is the number of marks at or after that time. A
//! lookup's blocks are answered against one snapshot (nothing is touched between them).
//!
//! A prompt hits the longest prefix of blocks that are all cached, so block `i` of a lookup
//! hits in an LRU cache of `C` blocks exactly when `C` is at least the largest distance among
//! blocks `0..=i`: that running maximum is the block's *threshold*, and the sorted thresholds
//! give the hit count of every size at once. A block never touched before (and every block
//! after it) misses at every size and has none.

/// One piece of the stream: it ends at `end` in the keys, and is a lookup or a touch.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    pub end: usize,
    pub lookup: bool,
}

/// What `thresholds` finds.
#[derive(Clone, Debug, Default)]
pub struct Thresholds {
    /// Every looked-up block's threshold (scaled by `1 / rate`), ascending.
    pub values: Vec<f64>,
    /// Keys touched (a key touched twice counts twice).
    pub touches: u64,
    /// Distinct keys touched.
    pub distinct: u64,
}

/// Marks by time: a bit per time, and a Fenwick tree of counts per `WORDS`-word superblock.
/// Counting the marks before a time reads one short run of words (in cache: the bitmap is an
/// eighth of a byte per touch) plus a Fenwick tree small enough to stay in L1; a Fenwick tree
/// over every time would miss the cache at most of its levels.
struct Marks {
    bits: Vec<u64>,
    supers: Vec<i64>, // Fenwick tree over superblocks, 1-based
}

const WORDS: usize = 32; // words per superblock: 2,048 times

impl Marks {
    fn new(times: usize) -> Self {
        let words = times.div_ceil(64).max(1);
        Self {
            bits: vec![0; words],
            supers: vec![0; words.div_ceil(WORDS) + 1],
        }
    }

    fn change(&mut self, time: usize, delta: i64) {
        let mut i = time / 64 / WORDS + 1;
        while i < self.supers.len() {
            self.supers[i] += delta;
            i += i & i.wrapping_neg();
        }
    }

    fn set(&mut self, time: usize) {
        self.bits[time / 64] |= 1 << (time % 64);
        self.change(time, 1);
    }

    fn clear(&mut self, time: usize) {
        self.bits[time / 64] &= !(1 << (time % 64));
        self.change(time, -1);
    }

    /// Marks at times `0..time`.
    fn before(&self, time: usize) -> i64 {
        let word = time / 64;
        let sup = word / WORDS;
        let mut sum = 0i64;
        let mut i = sup;
        while i > 0 {
            sum += self.supers[i];
            i &= i - 1;
        }
        for w in &self.bits[sup * WORDS..word] {
            sum += i64::from(w.count_ones());
        }
        let partial = self.bits[word] & ((1u64 << (time % 64)) - 1);
        sum + i64::from(partial.count_ones())
    }
}

/// Each key as a number `0..distinct` (equal keys, equal numbers), and `distinct`. Sorting
/// the (key, position) pairs reads and writes memory in order; a hash map from key to last
/// touch would miss the cache on nearly every access once it outgrows it (a full-trace
/// stream holds millions of distinct keys), several times slower.
pub(crate) fn dense_ids(keys: &[u64]) -> (Vec<u32>, usize) {
    let mut pairs: Vec<(u64, u32)> = keys.iter().copied().zip(0u32..).collect();
    pairs.sort_unstable();
    let mut ids = vec![0u32; keys.len()];
    let mut next = 0u32;
    let mut prev = None;
    for (key, pos) in pairs {
        if prev != Some(key) {
            if prev.is_some() {
                next += 1;
            }
            prev = Some(key);
        }
        ids[pos as usize] = next;
    }
    let distinct = if keys.is_empty() {
        0
    } else {
        next as usize + 1
    };
    (ids, distinct)
}

/// Replay the stream (`keys` cut into `pieces`) through exact stack distances. Lookups before
/// the `first_lookup`-th (counting from 0) are replayed but give no thresholds: a warm-up.
pub fn thresholds(keys: &[u64], pieces: &[Piece], rate: f64, first_lookup: usize) -> Thresholds {
    assert!(
        keys.len() < u32::MAX as usize,
        "a stream of at most 2**32 - 1 keys"
    );
    let mut start = 0;
    let touches: usize = pieces
        .iter()
        .map(|p| {
            let len = p.end - start;
            start = p.end;
            if p.lookup {
                0
            } else {
                len
            }
        })
        .sum();
    let (ids, num_ids) = dense_ids(keys);
    let mut marks = Marks::new(touches);
    const NEVER: u32 = u32::MAX; // not touched yet
    let mut last = vec![NEVER; num_ids];
    let mut distinct: i64 = 0;
    let mut time: usize = 0;
    let mut values = Vec::new();
    let mut start = 0;
    let mut lookup = 0usize;
    for piece in pieces {
        let part = &ids[start..piece.end];
        start = piece.end;
        if piece.lookup {
            lookup += 1;
            if lookup <= first_lookup {
                continue; // a warm-up lookup: it touches nothing, so it can be skipped
            }
            let mut reach = 0i64;
            for &id in part {
                let t = last[id as usize];
                if t == NEVER {
                    break; // never touched: a miss at every size, and so is the rest
                }
                let distance = distinct - marks.before(t as usize);
                reach = reach.max(distance);
                values.push(reach as f64 / rate);
            }
        } else {
            for &id in part {
                let old = std::mem::replace(&mut last[id as usize], time as u32);
                if old == NEVER {
                    distinct += 1;
                } else {
                    marks.clear(old as usize);
                }
                marks.set(time);
                time += 1;
            }
        }
    }
    values.sort_unstable_by(f64::total_cmp);
    Thresholds {
        values,
        touches: touches as u64,
        distinct: distinct as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(events: &[(bool, &[u64])]) -> (Vec<u64>, Vec<Piece>) {
        let mut keys = Vec::new();
        let mut pieces = Vec::new();
        for &(lookup, part) in events {
            keys.extend_from_slice(part);
            pieces.push(Piece {
                end: keys.len(),
                lookup,
            });
        }
        (keys, pieces)
    }

    /// The definition, slowly: the distance is 1 + the distinct keys touched since.
    fn naive(events: &[(bool, &[u64])]) -> Vec<f64> {
        let mut history: Vec<u64> = Vec::new();
        let mut out = Vec::new();
        for &(lookup, part) in events {
            if !lookup {
                history.extend_from_slice(part);
                continue;
            }
            let mut reach = 0usize;
            for key in part {
                let Some(p) = history.iter().rposition(|k| k == key) else {
                    break;
                };
                let mut seen: Vec<u64> = history[p..].to_vec();
                seen.sort_unstable();
                seen.dedup();
                reach = reach.max(seen.len());
                out.push(reach as f64);
            }
        }
        out.sort_unstable_by(f64::total_cmp);
        out
    }

    #[test]
    fn distances_match_the_definition() {
        let events: &[(bool, &[u64])] = &[
            (false, &[1, 2, 3, 2]),
            (true, &[1, 2, 3]),
            (false, &[4, 4, 1]),
            (true, &[3, 9, 1]),
            (true, &[1, 4, 2, 3]),
            (false, &[3, 2, 1]),
            (true, &[1, 2, 3, 4]),
        ];
        let (keys, pieces) = stream(events);
        let got = thresholds(&keys, &pieces, 1.0, 0);
        assert_eq!(got.values, naive(events));
        assert_eq!(got.touches, 10);
        assert_eq!(got.distinct, 4);
    }

    #[test]
    fn pseudo_random_streams_match_the_definition() {
        let mut x = 7u64;
        let mut rnd = move |m: u64| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 33) % m
        };
        for _ in 0..20 {
            let mut owned: Vec<(bool, Vec<u64>)> = Vec::new();
            for _ in 0..40 {
                let len = rnd(6) as usize;
                let part = (0..len).map(|_| rnd(12)).collect();
                owned.push((rnd(3) == 0, part));
            }
            let events: Vec<(bool, &[u64])> =
                owned.iter().map(|(l, p)| (*l, p.as_slice())).collect();
            let (keys, pieces) = stream(&events);
            assert_eq!(thresholds(&keys, &pieces, 1.0, 0).values, naive(&events));
        }
    }

    #[test]
    fn sampled_distances_are_scaled() {
        let events: &[(bool, &[u64])] = &[(false, &[1, 2]), (true, &[1])];
        let (keys, pieces) = stream(events);
        assert_eq!(thresholds(&keys, &pieces, 0.25, 0).values, vec![8.0]);
    }
}
