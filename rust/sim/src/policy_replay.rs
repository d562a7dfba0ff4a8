//! One cache size at a time: a stream (`stream::Stream`) replayed through a cache of
//! `capacity` blocks under LRU, FIFO or Belady's offline optimum, counting prefix hits.
//!
//! The model is the curve's (`stack`): a lookup answers a prompt's blocks against the cache as
//! it is (the longest run of cached blocks from the first is a hit, and nothing moves), a touch
//! puts blocks in. LRU here is the curve's LRU (a touch makes a block the most recent; lookups
//! change nothing), so its hits at a size equal the curve's; FIFO evicts in the order blocks
//! came in (a touch of a cached block changes nothing). Neither keeps a prefix constraint.
//!
//! `Optimal` is Belady's rule under the prefix constraint: a block comes in only when its
//! parent is cached, and the block evicted is, among cached blocks with no cached child, the
//! one whose next lookup is furthest; a block whose next lookup is further than every
//! candidate's is not let in. It reads the future, so it is a bound, not a policy. A parent is
//! looked up whenever its child is (a prompt is a prefix), and earlier in the stream, so the
//! furthest next lookup among all cached blocks is always that of a block with no cached child:
//! the constraint costs the rule nothing, and on a stream where each prompt's lookup is followed
//! by the touch of its blocks the rule is Belady's (furthest next use, with bypass) and the
//! optimum of any policy (`tests` check it against an exhaustive search on small streams).

use crate::stack::dense_ids;
use crate::stream::{Stream, NO_PARENT};
use std::collections::{BinaryHeap, VecDeque};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Lru,
    Fifo,
    Optimal,
}

impl Policy {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "lru" => Some(Self::Lru),
            "fifo" => Some(Self::Fifo),
            "optimal" => Some(Self::Optimal),
            _ => None,
        }
    }
}

const NONE: u32 = u32::MAX;
const NEVER: u64 = u64::MAX; // no lookup to come

/// The stream with dense ids (`0..n`), each id's parent id (`NONE`: none, or not in the
/// stream), and where each piece starts.
struct Dense {
    ids: Vec<u32>,
    parent: Vec<u32>,
    n: usize,
}

fn dense(stream: &Stream) -> Dense {
    let (ids, n) = dense_ids(&stream.keys);
    // A parent's id: the id of an occurrence of the parent's key (a sorted search).
    let mut sorted: Vec<(u64, u32)> = stream
        .keys
        .iter()
        .copied()
        .zip(ids.iter().copied())
        .collect();
    sorted.sort_unstable();
    sorted.dedup_by_key(|p| p.0);
    let mut parent = vec![NONE; n];
    for (i, &p) in stream.parents.iter().enumerate() {
        if p == NO_PARENT {
            continue;
        }
        if let Ok(at) = sorted.binary_search_by_key(&p, |e| e.0) {
            parent[ids[i] as usize] = sorted[at].1;
        }
    }
    Dense { ids, parent, n }
}

/// Hit blocks of the lookups from the `first_lookup`-th on (counting from 0), in a cache of
/// each of `capacities` blocks under `policy` (the stream is read once for all sizes).
pub fn hits(
    stream: &Stream,
    capacities: &[usize],
    policy: Policy,
    first_lookup: usize,
) -> Vec<u64> {
    let d = dense(stream);
    let next = (policy == Policy::Optimal).then(|| next_lookups(stream, &d.ids));
    capacities
        .iter()
        .map(|&c| match policy {
            Policy::Lru => replay(stream, &d, first_lookup, Lru::new(d.n, c)),
            Policy::Fifo => replay(stream, &d, first_lookup, Fifo::new(d.n, c)),
            Policy::Optimal => {
                let next = next.as_deref().expect("computed for the optimum");
                replay(stream, &d, first_lookup, Belady::new(&d, next, c))
            }
        })
        .collect()
}

/// What a replay asks of a cache.
trait Cache {
    /// Put each chain released tail first in head first instead (the order within a touch
    /// matters to LRU and FIFO, which keep the stream's; the optimum needs parents first).
    const PARENTS_FIRST: bool = false;
    fn present(&self, id: u32) -> bool;
    /// A lookup at stream position `pos` found `id` cached.
    fn looked_up(&mut self, _id: u32, _pos: usize) {}
    /// A touch at stream position `pos`.
    fn touch(&mut self, id: u32, pos: usize);
}

fn replay<C: Cache>(stream: &Stream, d: &Dense, first_lookup: usize, mut cache: C) -> u64 {
    let mut start = 0;
    let mut lookup = 0usize;
    let mut hit = 0u64;
    for piece in &stream.pieces {
        let range = start..piece.end;
        start = piece.end;
        if piece.lookup {
            let counted = lookup >= first_lookup;
            lookup += 1;
            let mut prefix = true;
            for pos in range {
                let id = d.ids[pos];
                if cache.present(id) {
                    hit += u64::from(prefix && counted);
                    cache.looked_up(id, pos);
                } else {
                    prefix = false;
                }
            }
        } else if C::PARENTS_FIRST
            && range.len() >= 2
            && d.parent[d.ids[range.start] as usize] == d.ids[range.start + 1]
        {
            for pos in range.rev() {
                cache.touch(d.ids[pos], pos);
            }
        } else {
            for pos in range {
                cache.touch(d.ids[pos], pos);
            }
        }
    }
    hit
}

/// Per stream position, the position of the next lookup of its key after it (`NEVER`: none).
fn next_lookups(stream: &Stream, ids: &[u32]) -> Vec<u64> {
    let mut next = vec![NEVER; ids.len()];
    let mut upcoming = vec![NEVER; ids.iter().map(|&i| i as usize + 1).max().unwrap_or(0)];
    let mut end = ids.len();
    for (k, piece) in stream.pieces.iter().enumerate().rev() {
        let start = if k == 0 { 0 } else { stream.pieces[k - 1].end };
        debug_assert_eq!(piece.end, end);
        for pos in (start..end).rev() {
            let id = ids[pos] as usize;
            next[pos] = upcoming[id];
            if piece.lookup {
                upcoming[id] = pos as u64;
            }
        }
        end = start;
    }
    next
}

/// LRU as a doubly linked list over ids, the most recent at the head.
struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    present: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
    capacity: usize,
}

impl Lru {
    fn new(n: usize, capacity: usize) -> Self {
        Self {
            prev: vec![NONE; n],
            next: vec![NONE; n],
            present: vec![false; n],
            head: NONE,
            tail: NONE,
            len: 0,
            capacity,
        }
    }

    fn unlink(&mut self, id: u32) {
        let (p, n) = (self.prev[id as usize], self.next[id as usize]);
        if p == NONE {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NONE {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
    }

    fn push_front(&mut self, id: u32) {
        self.prev[id as usize] = NONE;
        self.next[id as usize] = self.head;
        if self.head != NONE {
            self.prev[self.head as usize] = id;
        }
        self.head = id;
        if self.tail == NONE {
            self.tail = id;
        }
    }
}

impl Cache for Lru {
    fn present(&self, id: u32) -> bool {
        self.present[id as usize]
    }

    fn touch(&mut self, id: u32, _pos: usize) {
        if self.capacity == 0 {
            return;
        }
        if self.present[id as usize] {
            self.unlink(id);
        } else {
            if self.len == self.capacity {
                let victim = self.tail;
                self.unlink(victim);
                self.present[victim as usize] = false;
                self.len -= 1;
            }
            self.present[id as usize] = true;
            self.len += 1;
        }
        self.push_front(id);
    }
}

/// FIFO: evicts in the order blocks came in.
struct Fifo {
    present: Vec<bool>,
    queue: VecDeque<u32>,
    capacity: usize,
}

impl Fifo {
    fn new(n: usize, capacity: usize) -> Self {
        Self {
            present: vec![false; n],
            queue: VecDeque::new(),
            capacity,
        }
    }
}

impl Cache for Fifo {
    fn present(&self, id: u32) -> bool {
        self.present[id as usize]
    }

    fn touch(&mut self, id: u32, _pos: usize) {
        if self.capacity == 0 || self.present[id as usize] {
            return;
        }
        if self.queue.len() == self.capacity {
            let victim = self.queue.pop_front().expect("full");
            self.present[victim as usize] = false;
        }
        self.present[id as usize] = true;
        self.queue.push_back(id);
    }
}

/// Belady's rule under the prefix constraint (the module docstring).
struct Belady<'a> {
    parent: &'a [u32],
    next: &'a [u64],
    present: Vec<bool>,
    children: Vec<u32>,             // cached children
    next_use: Vec<u64>,             // a cached block's next lookup
    leaves: BinaryHeap<(u64, u32)>, // (next lookup, id); stale entries are skipped
    len: usize,
    capacity: usize,
}

impl<'a> Belady<'a> {
    fn new(d: &'a Dense, next: &'a [u64], capacity: usize) -> Self {
        Self {
            parent: &d.parent,
            next,
            present: vec![false; d.n],
            children: vec![0; d.n],
            next_use: vec![NEVER; d.n],
            leaves: BinaryHeap::new(),
            len: 0,
            capacity,
        }
    }

    fn is_leaf(&self, id: u32) -> bool {
        self.present[id as usize] && self.children[id as usize] == 0
    }

    /// The cached leaf with the furthest next lookup (stale heap entries dropped).
    fn furthest(&mut self) -> Option<(u64, u32)> {
        while let Some(&(at, id)) = self.leaves.peek() {
            if self.is_leaf(id) && self.next_use[id as usize] == at {
                return Some((at, id));
            }
            self.leaves.pop();
        }
        None
    }

    fn evict(&mut self, id: u32) {
        self.present[id as usize] = false;
        self.len -= 1;
        let p = self.parent[id as usize];
        if p != NONE {
            self.children[p as usize] -= 1;
            if self.is_leaf(p) {
                self.leaves.push((self.next_use[p as usize], p));
            }
        }
    }
}

impl Cache for Belady<'_> {
    const PARENTS_FIRST: bool = true;

    fn present(&self, id: u32) -> bool {
        self.present[id as usize]
    }

    fn looked_up(&mut self, id: u32, pos: usize) {
        let at = self.next[pos];
        self.next_use[id as usize] = at;
        if self.is_leaf(id) {
            self.leaves.push((at, id));
        }
    }

    fn touch(&mut self, id: u32, pos: usize) {
        if self.present[id as usize] {
            return; // its next lookup is already known (none since it came in)
        }
        let p = self.parent[id as usize];
        if p != NONE && !self.present[p as usize] {
            return; // kept only with its parent
        }
        let at = self.next[pos];
        if self.len >= self.capacity {
            match self.furthest() {
                Some((far, victim)) if far > at && victim != p => self.evict(victim),
                _ => return, // nothing cached is needed later than this block: left out
            }
        }
        self.present[id as usize] = true;
        self.len += 1;
        self.next_use[id as usize] = at;
        if p != NONE {
            self.children[p as usize] += 1;
        }
        self.leaves.push((at, id));
    }
}

#[cfg(test)]
#[path = "policy_replay_tests.rs"]
mod tests;
