//! The ordered collections the policies are built of: a queue of blocks and a FIFO of
//! digests (ghosts), both keyed by a sequence number that only grows.
//!
//! The reference uses `OrderedDict`s. A sequence number per insertion gives the same order,
//! removal from anywhere in O(log n), and one thing an `OrderedDict` cannot do: put a block
//! back exactly where it was (`SeqQueue::put_back`), which `Policy::restore` needs.

use crate::hashing::Digest;
use crate::id_hasher::BuildIdHasher;
use std::collections::{BTreeMap, HashMap};

/// Blocks, oldest first.
#[derive(Default)]
pub(super) struct SeqQueue {
    map: BTreeMap<u64, u32>,
    /// Never goes back, not even at `clear`: a number is never reused.
    next: u64,
}

impl SeqQueue {
    /// Append `block` at the newest end; returns its position.
    pub(super) fn push(&mut self, block: u32) -> u64 {
        let seq = self.next;
        self.next += 1;
        self.map.insert(seq, block);
        seq
    }

    /// Take the oldest block out.
    pub(super) fn pop(&mut self) -> Option<u32> {
        self.map.pop_first().map(|(_, b)| b)
    }

    /// The oldest block, left in.
    pub(super) fn first(&self) -> Option<u32> {
        self.map.first_key_value().map(|(_, &b)| b)
    }

    /// Take the block at `seq` out.
    pub(super) fn remove(&mut self, seq: u64, block: u32) {
        let was = self.map.remove(&seq);
        debug_assert_eq!(was, Some(block), "block {block} is not at {seq}");
    }

    /// Put `block` back at the position `seq` it was taken from.
    pub(super) fn put_back(&mut self, seq: u64, block: u32) {
        debug_assert!(seq < self.next);
        let was = self.map.insert(seq, block);
        debug_assert!(was.is_none(), "position {seq} is taken");
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.map.clear();
    }

    /// The blocks, oldest first.
    #[cfg(all(test, not(loom)))]
    pub(super) fn blocks(&self) -> Vec<u32> {
        self.map.values().copied().collect()
    }
}

/// Digests, oldest first, each at most once: an `OrderedDict[bytes, None]`. Adding a digest
/// that is already there leaves it where it is, as `d[key] = None` does.
#[derive(Default)]
pub(super) struct KeyFifo {
    order: BTreeMap<u64, Digest>,
    seq_of: HashMap<Digest, u64, BuildIdHasher>,
    next: u64,
}

impl KeyFifo {
    pub(super) fn contains(&self, key: &Digest) -> bool {
        self.seq_of.contains_key(key)
    }

    /// Add `key` at the newest end unless it is already in.
    pub(super) fn add(&mut self, key: Digest) {
        if self.seq_of.contains_key(&key) {
            return;
        }
        let seq = self.next;
        self.next += 1;
        self.order.insert(seq, key);
        self.seq_of.insert(key, seq);
    }

    /// Take `key` out; whether it was in.
    pub(super) fn remove(&mut self, key: &Digest) -> bool {
        match self.seq_of.remove(key) {
            Some(seq) => {
                self.order.remove(&seq);
                true
            }
            None => false,
        }
    }

    /// Drop the oldest keys until at most `cap` are left.
    pub(super) fn trim(&mut self, cap: usize) {
        while self.order.len() > cap {
            self.pop();
        }
    }

    /// Drop the oldest key.
    pub(super) fn pop(&mut self) {
        if let Some((_, key)) = self.order.pop_first() {
            self.seq_of.remove(&key);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    pub(super) fn clear(&mut self) {
        self.order.clear();
        self.seq_of.clear();
    }

    /// The keys, oldest first.
    #[cfg(all(test, not(loom)))]
    pub(super) fn keys(&self) -> Vec<Digest> {
        self.order.values().copied().collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::eviction::test_util::k;

    #[test]
    fn put_back_restores_the_position_among_later_pushes() {
        let mut q = SeqQueue::default();
        let s: Vec<u64> = (0..4).map(|b| q.push(b)).collect();
        q.remove(s[1], 1);
        q.push(7);
        assert_eq!(q.pop(), Some(0));
        q.put_back(s[1], 1);
        assert_eq!(q.blocks(), vec![1, 2, 3, 7]);
        assert_eq!(q.len(), 4);
    }

    #[test]
    fn key_fifo_is_an_ordered_dict() {
        let mut f = KeyFifo::default();
        for n in ["a", "b", "c"] {
            f.add(k(n));
        }
        f.add(k("a")); // already in: stays oldest
        assert_eq!(f.keys(), vec![k("a"), k("b"), k("c")]);
        assert!(f.remove(&k("b")) && !f.remove(&k("b")));
        f.add(k("b"));
        f.trim(2);
        assert_eq!(f.keys(), vec![k("c"), k("b")]);
        assert!(!f.contains(&k("a")) && f.contains(&k("c")));
        f.clear();
        assert!(f.is_empty() && f.keys().is_empty() && !f.contains(&k("c")));
    }
}
