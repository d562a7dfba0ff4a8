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
