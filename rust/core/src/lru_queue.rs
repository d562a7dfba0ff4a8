//! The eviction order of CACHED blocks: least recently released first.
//!
//! A queue of release records under one short lock (push at release, pop at eviction). A prefix
//! hit does not touch the queue: reviving a block leaves its record behind, and the record is
//! recognised as stale because the block's generation no longer matches (see `block_state`,
//! which also shows why the generation cannot wrap while a stale record is queued). This keeps
//! hits lock-free while the order stays exact.
//!
//! Every record carries the release's position in one global order (`seq`). A caller that
//! revived a block and then gives it back unused (a failed allocation) puts the block back at
//! the position of its last release (`restore`), so the failed call leaves the order as it was.

use crate::alloc::try_filled;
use crate::error::Result;
use crate::hashing::Digest;
use crate::sync::{lock, prefetch, Mutex, Padded};
use std::collections::VecDeque;

/// One release of a hashed block to the CACHED state.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    pub block: u32,
    /// The block's generation when it became CACHED (`block_state`).
    pub generation: u64,
    /// The index key, so the evictor can remove the entry without a reverse map.
    pub digest: Digest,
}

/// A queued record: the entry and its position in the release order.
#[derive(Debug, Clone, Copy)]
struct Record {
    entry: Entry,
    seq: u64,
}

struct Inner {
    /// Ascending `seq`, oldest release at the front. Holds exactly one live record per
    /// CACHED block plus stale ones; `push_all` drops the stale ones past its bound.
    queue: VecDeque<Record>,
    /// The `seq` the next release gets; only grows (2^64 releases cannot happen).
    next_seq: u64,
    /// `last_seq[b]`: the `seq` of block `b`'s latest queued release.
    last_seq: Vec<u64>,
}

pub struct LruQueue {
    /// Taken by every release of a hashed block and every eviction, from any thread.
    inner: Padded<Mutex<Inner>>,
}

impl LruQueue {
    pub fn new(num_blocks: usize) -> Result<Self> {
        Ok(Self {
            inner: Padded(Mutex::new(Inner {
                queue: VecDeque::new(),
                next_seq: 0,
                last_seq: try_filled(num_blocks, 0, "the LRU queue")?,
            })),
        })
    }

    /// Queue releases in order under one lock (a sequence's table, tail first); when stale
    /// records pile up (hot blocks revived and released over and over without eviction),
    /// drop those that `is_live` rejects.
    pub fn push_all(&self, entries: &[Entry], bound: usize, is_live: impl Fn(&Entry) -> bool) {
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        // The blocks' `last_seq` entries are scattered: have all their lines on the way first.
        for e in entries {
            if let Some(at) = inner.last_seq.get(e.block as usize) {
                prefetch(at);
            }
        }
        inner.queue.reserve(entries.len());
        for &entry in entries {
            let seq = inner.next_seq;
            inner.next_seq += 1;
            inner.last_seq[entry.block as usize] = seq;
            inner.queue.push_back(Record { entry, seq });
        }
        if inner.queue.len() > bound {
            inner.queue.retain(|r| is_live(&r.entry));
        }
    }

    /// Queue a block that a failed call revived and gave back unused, at the position of its
    /// latest release, so that the failed call leaves the eviction order unchanged.
    /// Compacts like `push_all`, so restores count towards the same bound.
    pub fn restore(&self, entry: Entry, bound: usize, is_live: impl Fn(&Entry) -> bool) {
        let mut inner = lock(&self.inner);
        let seq = inner.last_seq[entry.block as usize];
        let at = inner.queue.partition_point(|r| r.seq <= seq);
        inner.queue.insert(at, Record { entry, seq });
        if inner.queue.len() > bound {
            inner.queue.retain(|r| is_live(&r.entry));
        }
    }

    /// Pop records oldest first until `claim` has accepted `n` of them (or none are left);
    /// returns the accepted ones. Rejected records are stale and dropped.
    pub fn pop_claimed(&self, n: usize, mut claim: impl FnMut(&Entry) -> bool) -> Vec<Entry> {
        let mut inner = lock(&self.inner);
        let mut out = Vec::with_capacity(n.min(inner.queue.len()));
        while out.len() < n {
            match inner.queue.pop_front() {
                Some(r) if claim(&r.entry) => out.push(r.entry),
                Some(_) => {}
                None => break,
            }
        }
        out
    }

    /// Take every record, oldest first (reset).
    pub fn drain(&self) -> Vec<Entry> {
        lock(&self.inner).queue.drain(..).map(|r| r.entry).collect()
    }

    /// The records, oldest first (audits).
    pub fn snapshot(&self) -> Vec<Entry> {
        lock(&self.inner).queue.iter().map(|r| r.entry).collect()
    }

    /// Number of queued records, live or stale (tests of the compaction bound).
    #[cfg(all(test, not(loom)))]
    pub fn len(&self) -> usize {
        lock(&self.inner).queue.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, HashAlgo};

    fn entry(block: u32, generation: u64) -> Entry {
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        Entry {
            block,
            generation,
            digest: h.root(),
        }
    }

    fn blocks(q: &LruQueue) -> Vec<u32> {
        q.snapshot().iter().map(|e| e.block).collect()
    }

    #[test]
    fn oldest_first_and_compaction_keeps_only_live_records() {
        let q = LruQueue::new(16).unwrap();
        q.push_all(&[entry(1, 0), entry(2, 0)], 100, |_| true);
        assert_eq!(q.pop_claimed(1, |_| true)[0].block, 1);
        // Past the bound, stale records (here: odd generations) are dropped, order kept.
        for g in 0..6 {
            q.push_all(&[entry(3 + g as u32, g)], 4, |e| e.generation % 2 == 0);
        }
        assert_eq!(blocks(&q), vec![2, 3, 5, 7]);
        assert_eq!(q.drain().len(), 4);
        assert!(q.pop_claimed(1, |_| true).is_empty());
    }

    #[test]
    fn restore_puts_a_block_back_where_its_last_release_was() {
        let q = LruQueue::new(8).unwrap();
        q.push_all(&[entry(1, 0), entry(2, 0), entry(3, 0)], 100, |_| true);
        // Block 2 is revived (its record goes stale and is dropped by a pop), then handed
        // back unused: it returns between 1 and 3.
        let popped = q.pop_claimed(1, |e| e.block == 1);
        assert_eq!(popped[0].block, 1);
        q.push_all(&[entry(4, 0)], 100, |_| true);
        q.restore(entry(2, 1), 100, |_| true);
        assert_eq!(blocks(&q), vec![2, 2, 3, 4]);
        q.restore(entry(1, 1), 100, |_| true);
        assert_eq!(blocks(&q), vec![1, 2, 2, 3, 4]);
    }

    #[test]
    fn stale_records_of_one_hot_block_stay_bounded() {
        // Millions of releases of one block never grow the queue past bound + 1, which is
        // what bounds the generations a stale record can see (block_state's module docs).
        let q = LruQueue::new(4).unwrap();
        let bound = 2 * 4 + 64;
        for g in 0..1_000_000u64 {
            q.push_all(&[entry(0, g)], bound, |e| e.generation == g);
            assert!(q.len() <= bound + 1);
        }
        assert_eq!(q.snapshot().last().map(|e| e.generation), Some(999_999));
    }
}
