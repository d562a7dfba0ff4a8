//! The eviction order of CACHED blocks: least recently released first.
//!
//! A queue of release records under one short lock (push at release, pop at eviction). A prefix
//! hit does not touch the queue: reviving a block leaves its record behind, and the record is
//! recognised as stale when popped because the block's `(epoch, stamp)` no longer matches
//! (see `block_state`). This keeps hits lock-free while the order stays exact.

use crate::hashing::Digest;
use crate::sync::{lock, Mutex};
use std::collections::VecDeque;

/// One release of a hashed block to the CACHED state.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub block: u32,
    pub epoch: u32,
    pub stamp: u32,
    /// The index key, so the evictor can remove the entry without a reverse map.
    pub digest: Digest,
}

pub struct LruQueue {
    /// Oldest release at the front. Holds exactly one live record per CACHED block plus any
    /// number of stale records; `push_all` drops them past its bound.
    queue: Mutex<VecDeque<Entry>>,
}

impl LruQueue {
    pub fn new() -> Self {
        Self {
            queue: Mutex::new(VecDeque::new()),
        }
    }

    /// Queue a release; when stale records pile up (hot blocks revived and released over and
    /// over without eviction), drop those that `is_live` rejects.
    /// Several releases are queued in order under one lock (a sequence's table, tail first).
    pub fn push_all(&self, entries: &[Entry], bound: usize, is_live: impl Fn(&Entry) -> bool) {
        let mut q = lock(&self.queue);
        q.extend(entries.iter().copied());
        if q.len() > bound {
            q.retain(is_live);
        }
    }

    /// Pop records oldest first until `claim` has accepted `n` of them (or none are left);
    /// returns the accepted ones. Rejected records are stale and dropped.
    pub fn pop_claimed(&self, n: usize, claim: impl Fn(&Entry) -> bool) -> Vec<Entry> {
        let mut q = lock(&self.queue);
        let mut out = Vec::with_capacity(n.min(q.len()));
        while out.len() < n {
            match q.pop_front() {
                Some(e) if claim(&e) => out.push(e),
                Some(_) => {}
                None => break,
            }
        }
        out
    }

    /// Take every record, oldest first (reset).
    pub fn drain(&self) -> Vec<Entry> {
        lock(&self.queue).drain(..).collect()
    }

    /// The records, oldest first (audits).
    pub fn snapshot(&self) -> Vec<Entry> {
        lock(&self.queue).iter().copied().collect()
    }
}

impl Default for LruQueue {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, HashAlgo};

    fn entry(block: u32, stamp: u32) -> Entry {
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        Entry {
            block,
            epoch: 0,
            stamp,
            digest: h.root(),
        }
    }

    #[test]
    fn oldest_first_and_compaction_keeps_only_live_records() {
        let q = LruQueue::new();
        q.push_all(&[entry(1, 0), entry(2, 0)], 100, |_| true);
        assert_eq!(q.pop_claimed(1, |_| true)[0].block, 1);
        // Past the bound, stale records (here: odd stamps) are dropped, order kept.
        for stamp in 0..6 {
            q.push_all(&[entry(3 + stamp, stamp)], 4, |e| e.stamp % 2 == 0);
        }
        let left: Vec<u32> = q.snapshot().iter().map(|e| e.block).collect();
        assert_eq!(left, vec![2, 3, 5, 7]);
        assert_eq!(q.drain().len(), 4);
        assert!(q.pop_claimed(1, |_| true).is_empty());
    }
}
