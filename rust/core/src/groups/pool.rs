//! One pool of equal pages shared by every group of a hybrid manager: the block lifecycle
//! (FREE, OWNED, CACHED), the prefix index keyed by `(group, digest)`, the LRU order of
//! cached blocks and the events. Single-threaded: the manager holds it under its mutex.

use crate::alloc::{try_filled, try_with_capacity};
use crate::block_state::RC_MAX;
use crate::error::{Error, Result};
use crate::events::{KvEvent, Medium};
use crate::hashing::{Digest, Tag};
use std::collections::HashMap;

/// Block 0: never allocated; a table entry a group does not need holds it.
pub const NULL: u32 = 0;

/// What a hashed block is registered under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    pub group: u8,
    pub digest: Digest,
    /// The secret tag a hit must match (weak hashes only; `None` otherwise).
    pub tag: Option<Tag>,
}

/// Per-group tallies for `stats()`.
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupTally {
    pub used: usize,
    pub cached: usize,
    pub hit_blocks: u64,
    pub evictions: u64,
    pub registered: u64,
}

pub struct GroupPool {
    /// Holders of each block: `>= 1` exactly while OWNED, 0 while FREE or CACHED (and for
    /// the null block, which is never any of them).
    rc: Vec<u32>,
    /// The group whose table took the block; meaningful while OWNED or CACHED.
    group: Vec<u8>,
    /// `Some` exactly while the block is hashed: `index[(group, digest)] == block`.
    key: Vec<Option<Key>>,
    /// FREE blocks; popped from the end, so `1, 2, 3, ...` first.
    free: Vec<u32>,
    /// CACHED blocks in release order, an intrusive list through `prev`/`next` with the
    /// null block as its sentinel: `next[NULL]` is the oldest, `prev[NULL]` the newest.
    prev: Vec<u32>,
    next: Vec<u32>,
    num_cached: usize,
    index: HashMap<(u8, Digest), u32>,
    events: Option<Vec<KvEvent>>,
    /// Report each eviction to the evicting call's capture (`duties`, `record_evictions`).
    record_evictions: bool,
    pub tally: Vec<GroupTally>,
}

impl GroupPool {
    pub fn new(num_blocks: u32, num_groups: usize, events: bool, evictions: bool) -> Result<Self> {
        let n = num_blocks as usize;
        let mut free = try_with_capacity(n, "the free block list")?;
        free.extend((1..num_blocks).rev());
        Ok(Self {
            rc: try_filled(n, 0, "block refcounts")?,
            group: try_filled(n, 0, "block groups")?,
            key: try_filled(n, None, "block keys")?,
            free,
            prev: try_filled(n, NULL, "the LRU list")?,
            next: try_filled(n, NULL, "the LRU list")?,
            num_cached: 0,
            index: HashMap::new(),
            events: events.then(Vec::new),
            record_evictions: evictions,
            tally: vec![GroupTally::default(); num_groups],
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.rc.len()
    }
    pub fn num_free(&self) -> usize {
        self.free.len()
    }
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }
    pub fn available(&self) -> usize {
        self.free.len() + self.num_cached
    }
    pub fn rc(&self, block: u32) -> u32 {
        self.rc[block as usize]
    }
    pub fn key(&self, block: u32) -> Option<&Key> {
        self.key[block as usize].as_ref()
    }

    /// The block registered under `(group, digest)` whose tag matches, if any. Reads only.
    pub fn find(&self, group: u8, digest: &Digest, tag: Option<Tag>) -> Option<u32> {
        let b = *self.index.get(&(group, *digest))?;
        (self.key[b as usize].map(|k| k.tag) == Some(tag)).then_some(b)
    }

    /// Whether one more holder fits (checked before any change, so a refusal changes nothing).
    pub fn check_share(&self, block: u32) -> Result<()> {
        if self.rc[block as usize] >= RC_MAX {
            return Err(Error::RefcountOverflow {
                block,
                limit: RC_MAX,
            });
        }
        Ok(())
    }

    fn unlink(&mut self, b: u32) {
        let (p, n) = (self.prev[b as usize], self.next[b as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.num_cached -= 1;
    }

    fn push_newest(&mut self, b: u32) {
        let last = self.prev[NULL as usize];
        self.prev[b as usize] = last;
        self.next[b as usize] = NULL;
        self.next[last as usize] = b;
        self.prev[NULL as usize] = b;
        self.num_cached += 1;
    }

    /// Add a holder (a hit or a fork); a CACHED block becomes OWNED again.
    pub fn share(&mut self, b: u32) {
        if self.rc[b as usize] == 0 {
            self.unlink(b);
            let g = self.group[b as usize] as usize;
            self.tally[g].cached -= 1;
            self.tally[g].used += 1;
        }
        self.rc[b as usize] += 1;
    }

    /// A new block for `group`: the free list first, else the oldest CACHED block, evicted.
    /// The caller checked `available()`; an empty pool here is a bug, reported as one.
    pub fn take(&mut self, group: u8) -> Result<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.next[NULL as usize];
                if b == NULL {
                    return Err(Error::Broken("took a block from an empty pool".into()));
                }
                self.unlink(b);
                let g = self.group[b as usize] as usize;
                self.tally[g].cached -= 1;
                self.tally[g].evictions += 1;
                if let (true, Some(k)) = (self.record_evictions, self.key[b as usize]) {
                    crate::duties::record_eviction(b, k.group, k.digest);
                }
                self.unhash(b);
                b
            }
        };
        self.rc[b as usize] = 1;
        self.group[b as usize] = group;
        self.tally[group as usize].used += 1;
        Ok(b)
    }

    /// Drop one holder; at zero a hashed block is CACHED (newest), an unhashed one FREE.
    pub fn release(&mut self, b: u32) {
        let rc = &mut self.rc[b as usize];
        *rc -= 1;
        if *rc > 0 {
            return;
        }
        let g = self.group[b as usize] as usize;
        self.tally[g].used -= 1;
        if self.key[b as usize].is_some() {
            self.push_newest(b);
            self.tally[g].cached += 1;
        } else {
            self.free.push(b);
        }
    }

    /// Room for `n` more index entries, so that registrations after a call's first change
    /// cannot fail for memory (the call reserves before it changes anything).
    pub fn reserve_index(&mut self, n: usize) -> Result<()> {
        self.index
            .try_reserve(n)
            .map_err(|_| Error::OutOfMemory("cannot grow the prefix index".into()))
    }

    /// Register an OWNED block unless its key is taken; emits `BlockStored`.
    pub fn register(&mut self, b: u32, key: Key, stored: impl FnOnce() -> KvEvent) -> Result<bool> {
        self.reserve_index(1)?;
        let slot = self.index.entry((key.group, key.digest));
        if let std::collections::hash_map::Entry::Vacant(v) = slot {
            v.insert(b);
            self.key[b as usize] = Some(key);
            self.tally[key.group as usize].registered += 1;
            if let Some(log) = &mut self.events {
                log.push(stored());
            }
            return Ok(true);
        }
        Ok(false)
    }

    /// Take the block out of the index (it stays where it is, unhashed); emits `BlockRemoved`.
    pub fn unhash(&mut self, b: u32) {
        if let Some(k) = self.key[b as usize].take() {
            self.index.remove(&(k.group, k.digest));
            self.push_event(|| KvEvent::BlockRemoved {
                block_hash: k.digest,
                medium: Medium::Gpu,
                group: k.group,
            });
        }
    }

    pub fn push_event(&mut self, event: impl FnOnce() -> KvEvent) {
        if let Some(log) = &mut self.events {
            log.push(event());
        }
    }

    pub fn drain_events(&mut self) -> Vec<KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// `reset_prefix_cache`'s move of every CACHED block to the free list, oldest first.
    pub fn clear_cached(&mut self) {
        while self.next[NULL as usize] != NULL {
            let b = self.next[NULL as usize];
            self.unlink(b);
            let g = self.group[b as usize] as usize;
            self.tally[g].cached -= 1;
            self.key[b as usize] = None;
            self.free.push(b);
        }
        self.index.clear();
        self.push_event(|| KvEvent::AllBlocksCleared);
    }

    /// The CACHED blocks, oldest first (audits).
    pub fn cached_in_order(&self) -> Vec<u32> {
        let mut out = Vec::new();
        let mut b = self.next[NULL as usize];
        while b != NULL && out.len() <= self.rc.len() {
            out.push(b);
            b = self.next[b as usize];
        }
        out
    }
    pub fn free_list(&self) -> &[u32] {
        &self.free
    }
    pub fn index_len(&self) -> usize {
        self.index.len()
    }
    pub fn group_of(&self, b: u32) -> u8 {
        self.group[b as usize]
    }
}
