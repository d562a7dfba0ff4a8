//! Monotonic counters for `stats()`. Relaxed: each is a tally read on its own, never used
//! to order other memory.

use crate::sync::{AtomicU64, Ordering};

#[derive(Default)]
pub struct Counters {
    /// Prompt tokens looked up in the prefix cache (successful allocations only).
    pub prefix_queries: AtomicU64,
    /// Of those, tokens whose KV was found cached.
    pub prefix_hits: AtomicU64,
    pub cow_copies: AtomicU64,
    pub swapped_out_blocks: AtomicU64,
    pub swapped_in_blocks: AtomicU64,
    /// Blocks registered in the prefix index.
    pub registered_blocks: AtomicU64,
    /// Registered blocks withdrawn by `free` with fewer computed tokens than scheduled.
    pub unregistered_blocks: AtomicU64,
    /// Blocks released by `truncate`.
    pub truncated_blocks: AtomicU64,
}

pub fn add(counter: &AtomicU64, n: usize) {
    counter.fetch_add(n as u64, Ordering::Relaxed);
}

pub fn get(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

pub fn reset(counter: &AtomicU64) {
    counter.store(0, Ordering::Relaxed);
}

/// How many recent allocations `RecentHits` sums (vLLM's `max_recent_requests`).
pub const RECENT_REQUESTS: usize = 1000;

/// `(queries, hits)` of the last `RECENT_REQUESTS` allocations with prefix caching on: a
/// ring of per-request pairs and their running sums, under one short lock (one push per
/// allocation, one read per `stats()`).
pub struct RecentHits {
    inner: crate::sync::Mutex<Ring>,
}

#[derive(Default)]
struct Ring {
    /// At most `RECENT_REQUESTS` pairs; `next` is the oldest once full.
    pairs: Vec<(u64, u64)>,
    next: usize,
    /// Sums of `pairs` (each at most `RECENT_REQUESTS * i32::MAX`: no overflow).
    queries: u64,
    hits: u64,
}

impl Default for RecentHits {
    fn default() -> Self {
        Self {
            inner: crate::sync::Mutex::new(Ring::default()),
        }
    }
}

impl RecentHits {
    pub fn record(&self, queries: usize, hits: usize) {
        let pair = (queries as u64, hits as u64);
        let mut r = crate::sync::lock(&self.inner);
        if r.pairs.len() < RECENT_REQUESTS {
            // Grows to its bound once; an allocation failure here is a tally lost, not an
            // abort (the pair is then simply not counted).
            if r.pairs.try_reserve(1).is_err() {
                return;
            }
            r.pairs.push(pair);
        } else {
            let at = r.next;
            let old = std::mem::replace(&mut r.pairs[at], pair);
            r.queries -= old.0;
            r.hits -= old.1;
            r.next = (at + 1) % RECENT_REQUESTS;
        }
        r.queries += pair.0;
        r.hits += pair.1;
    }

    pub fn sums(&self) -> (u64, u64) {
        let r = crate::sync::lock(&self.inner);
        (r.queries, r.hits)
    }

    pub fn clear(&self) {
        *crate::sync::lock(&self.inner) = Ring::default();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_window_keeps_the_last_requests_only() {
        let w = RecentHits::default();
        for i in 0..RECENT_REQUESTS {
            w.record(10, i % 2 * 10);
        }
        assert_eq!(w.sums(), (10_000, 5_000));
        // Past its bound every new request pushes out the oldest, repeatedly around the ring.
        for _ in 0..3 * RECENT_REQUESTS + 7 {
            w.record(4, 4);
        }
        assert_eq!(w.sums(), (4_000, 4_000));
        w.record(6, 0);
        assert_eq!(w.sums(), (4_002, 3_996));
        w.clear();
        assert_eq!(w.sums(), (0, 0));
    }
}
