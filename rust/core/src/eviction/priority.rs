//! Priority retention with TensorRT-LLM's meaning, exactly as the reference
//! `eviction/priority.py` without its pin level (the pool keeps pinned blocks out of every
//! policy): every evictable block of a lower priority goes before any of a higher one;
//! within a priority, least recently released first. A block's duration starts at its
//! release; when it runs out (inclusive: at `now >= deadline`) the block is at
//! `DEFAULT_PRIORITY` for good and counts as released at its deadline, ahead of the blocks
//! released after it or at that very instant. So the order is a function of the times
//! alone: expiries are applied lazily, at `victim`, without changing it.
//!
//! One ordered map per priority level, keyed by (time, kind, release sequence): a block
//! waits at its own level keyed by its release time (kind 1) and, if it has a deadline, in
//! `pending` too; `victim` first moves every block whose deadline has come to the default
//! level, keyed by its deadline (kind 0, before the releases at the same instant).
//! Every call is O(log n) (`victim` also moves each block whose deadline passed, once).

use super::base::{Keys, Rules, Tracked};
use super::block_table::{BlockTable, Tables};
use super::{Carried, CrossRank, Policy, Retention, DEFAULT_PRIORITY, MAX_PRIORITY};
use crate::clock::Clock;
use crate::error::Result;
use crate::hashing::Digest;
use crate::lru_queue::Entry;
use std::collections::BTreeMap;
use std::sync::Arc;

const DEFAULT: Retention = Retention {
    priority: DEFAULT_PRIORITY,
    duration: None,
};

const LEVELS: usize = MAX_PRIORITY as usize + 1;

/// (time, kind, release sequence): the order within one level, least first. Kind 0: an
/// expired block at its deadline; kind 1: a block at its release time.
type Key = (u64, u8, u64);

/// `t` as a `u64` in the same order (the usual sign flip; -0.0 counts as 0.0, as Python's
/// comparisons do). `t` is never NaN: clock times and deadlines from valid durations.
fn time_key(t: f64) -> u64 {
    let bits = (t + 0.0).to_bits();
    if bits >> 63 == 0 {
        bits | 1 << 63
    } else {
        !bits
    }
}

/// An evictable block's rank (the reference's `_Entry`).
#[derive(Clone, Copy)]
struct Rank {
    priority: u8,
    /// When it returns to the default priority.
    deadline: Option<f64>,
    released: f64,
    seq: u64,
}

#[derive(Clone, Copy)]
struct Slot {
    /// What the block's next release (or a change while cached) gives it.
    retention: Retention,
    /// `retention` before the latest hit, for `unhit`.
    before_hit: Retention,
    /// Its rank while cached; after a hit, the rank `unhit` puts back.
    rank: Rank,
    in_set: bool,
    /// Moved to the default level at its deadline (else at its own level, and in
    /// `pending` if it has a deadline).
    expired: bool,
}

pub(crate) struct PriorityRules {
    clock: Arc<Clock>,
    /// Release counter, the tie-break at one instant. Never goes back, not even at `clear`.
    seq: u64,
    levels: Vec<BTreeMap<Key, u32>>,
    /// Bit `p`: `levels[p]` is not empty.
    nonempty: u128,
    /// (deadline, seq) of the cached blocks not yet moved to the default level.
    pending: BTreeMap<(u64, u64), u32>,
    slots: BlockTable<Slot>,
    /// The time of the latest `peek`, while no other call came since: it moved the blocks
    /// expired then and named the first; `pick` takes that block without moving the blocks
    /// expired meanwhile (the clock runs on), so that it returns what the peek did, and
    /// `cross_rank` ranks at that time.
    peeked_at: Option<f64>,
}

/// The priority policy: `Tracked` rules plus the retention a held or cached block is given.
pub(crate) struct PriorityPolicy {
    inner: Tracked<PriorityRules>,
}

impl PriorityPolicy {
    pub(crate) fn new(num_blocks: usize, clock: &Arc<Clock>) -> Result<Self> {
        Self::with_tables(Tables::Dense(num_blocks), clock)
    }

    pub(crate) fn with_tables(tables: Tables, clock: &Arc<Clock>) -> Result<Self> {
        let slot = Slot {
            retention: DEFAULT,
            before_hit: DEFAULT,
            rank: Rank {
                priority: DEFAULT_PRIORITY,
                deadline: None,
                released: 0.0,
                seq: 0,
            },
            in_set: false,
            expired: false,
        };
        let rules = PriorityRules {
            clock: Arc::clone(clock),
            seq: 0,
            levels: (0..LEVELS).map(|_| BTreeMap::new()).collect(),
            nonempty: 0,
            pending: BTreeMap::new(),
            slots: BlockTable::new(tables, slot, "the priority policy's block table")?,
            peeked_at: None,
        };
        Ok(Self {
            inner: Tracked::with_rules(tables, rules)?,
        })
    }
}

/// A valid retention: the manager checks it; out of range here is a bug, clamped in release
/// builds so that it cannot break the order.
fn checked(r: Retention) -> Retention {
    debug_assert!(
        r.priority <= MAX_PRIORITY && r.duration.is_none_or(|d| d >= 0.0),
        "bad retention {r:?}"
    );
    Retention {
        priority: r.priority.min(MAX_PRIORITY),
        duration: r.duration.filter(|d| *d >= 0.0),
    }
}

/// When a block released (or changed) at `now` returns to the default priority: never for
/// one at the default already (TensorRT-LLM queues no expiry for those).
fn deadline(r: Retention, now: f64) -> Option<f64> {
    match r.duration {
        Some(d) if r.priority != DEFAULT_PRIORITY => Some(now + d),
        _ => None,
    }
}

impl PriorityRules {
    fn level_insert(&mut self, level: u8, key: Key, block: u32) {
        let was = self.levels[level as usize].insert(key, block);
        debug_assert!(was.is_none(), "block {block}: position {key:?} is taken");
        self.nonempty |= 1 << level;
    }

    fn level_remove(&mut self, level: u8, key: Key, block: u32) {
        let l = &mut self.levels[level as usize];
        let was = l.remove(&key);
        debug_assert_eq!(was, Some(block), "block {block} is not at {key:?}");
        if l.is_empty() {
            self.nonempty &= !(1 << level);
        }
    }

    /// Put `block` in the structures by its rank, not expired (the next `victim` moves it if
    /// its deadline has come).
    fn place(&mut self, block: u32) {
        let s = &mut self.slots[block as usize];
        debug_assert!(!s.in_set, "block {block} is placed already");
        s.in_set = true;
        s.expired = false;
        let r = s.rank;
        self.level_insert(r.priority, (time_key(r.released), 1, r.seq), block);
        if let Some(d) = r.deadline {
            self.pending.insert((time_key(d), r.seq), block);
        }
    }

    /// Take `block` out of the structures; its rank stays in its slot.
    fn unplace(&mut self, block: u32) {
        let s = &mut self.slots[block as usize];
        assert!(s.in_set, "block {block} is not in the priority order");
        s.in_set = false;
        let (r, expired) = (s.rank, s.expired);
        match r.deadline {
            Some(d) if expired => {
                self.level_remove(DEFAULT_PRIORITY, (time_key(d), 0, r.seq), block)
            }
            _ => {
                self.level_remove(r.priority, (time_key(r.released), 1, r.seq), block);
                if let Some(d) = r.deadline {
                    let was = self.pending.remove(&(time_key(d), r.seq));
                    debug_assert_eq!(was, Some(block));
                }
            }
        }
    }

    /// Move every block whose deadline is at or before `now` to the default level, at its
    /// deadline.
    fn expire(&mut self, now: f64) {
        while let Some((&(_, seq), &block)) = self.pending.first_key_value() {
            let r = self.slots[block as usize].rank;
            let d = r.deadline.expect("a pending block has a deadline");
            if d > now {
                break;
            }
            self.pending.pop_first();
            self.level_remove(r.priority, (time_key(r.released), 1, seq), block);
            self.level_insert(DEFAULT_PRIORITY, (time_key(d), 0, seq), block);
            self.slots[block as usize].expired = true;
        }
    }

    /// Give `block` `r`: from its next release, or at once if it is cached (keeping its
    /// release time; the duration counts from now).
    fn set_retention(&mut self, block: u32, r: Retention) {
        self.peeked_at = None;
        let r = checked(r);
        self.slots[block as usize].retention = r;
        if self.slots[block as usize].in_set {
            let now = self.clock.now();
            self.unplace(block);
            let rank = &mut self.slots[block as usize].rank;
            rank.priority = r.priority;
            rank.deadline = deadline(r, now);
            self.place(block);
        }
    }

    /// The first block of the lowest level, left in.
    fn first(&self) -> Option<u32> {
        let level = self.nonempty.trailing_zeros() as usize;
        let (_, &block) = self.levels.get(level)?.first_key_value()?;
        Some(block)
    }

    /// `Policy::cross_rank`: the reference's `rank(now)[:3]`, at the latest peek's time
    /// while no call came since (the time its choice was made), else now on the clock.
    fn cross_rank(&self, block: u32) -> CrossRank {
        let s = &self.slots[block as usize];
        debug_assert!(s.in_set, "block {block} is not in the priority order");
        let now = self.peeked_at.unwrap_or_else(|| self.clock.now());
        match s.rank.deadline {
            Some(d) if d <= now => (DEFAULT_PRIORITY, d, 0),
            _ => (s.rank.priority, s.rank.released, 1),
        }
    }

    /// The cached blocks in eviction order now (moves expired blocks, which changes no
    /// order).
    #[cfg(all(test, not(loom)))]
    fn order(&mut self) -> Vec<u32> {
        self.expire(self.clock.now());
        self.levels
            .iter()
            .flat_map(|l| l.values().copied())
            .collect()
    }

    /// The block's effective priority now (its retention's if it is not cached).
    #[cfg(all(test, not(loom)))]
    fn priority_of(&self, block: u32) -> u8 {
        let s = &self.slots[block as usize];
        if !s.in_set {
            return s.retention.priority;
        }
        match s.rank.deadline {
            Some(d) if d <= self.clock.now() => DEFAULT_PRIORITY,
            _ => s.rank.priority,
        }
    }
}

impl Rules for PriorityRules {
    fn insert(&mut self, block: u32, _key: &Digest, _revived: bool) {
        self.peeked_at = None;
        let now = self.clock.now();
        let s = &mut self.slots[block as usize];
        s.rank = Rank {
            priority: s.retention.priority,
            deadline: deadline(s.retention, now),
            released: now,
            seq: self.seq,
        };
        self.seq += 1;
        self.place(block);
    }

    fn hit(&mut self, block: u32) {
        self.peeked_at = None;
        let now = self.clock.now();
        self.unplace(block);
        let s = &mut self.slots[block as usize];
        s.before_hit = s.retention;
        // Ran out while cached: at the default for good. Else the retention stays, with a
        // fresh full duration at the next release.
        if s.rank.deadline.is_some_and(|d| d <= now) {
            s.retention = DEFAULT;
        }
    }

    fn unhit(&mut self, block: u32) {
        self.peeked_at = None;
        // The rank and retention from before the hit: a retention the failed call gave the
        // block meanwhile is undone with it.
        let s = &mut self.slots[block as usize];
        s.retention = s.before_hit;
        self.place(block);
    }

    fn forget(&mut self, block: u32) {
        self.peeked_at = None;
        self.unplace(block);
        self.slots[block as usize].retention = DEFAULT;
    }

    fn miss(&mut self, _key: &Digest) {
        self.peeked_at = None;
    }

    fn pick(&mut self, _keys: &Keys) -> Option<u32> {
        if self.peeked_at.take().is_none() {
            self.expire(self.clock.now());
        }
        let block = self.first()?;
        self.forget(block);
        Some(block)
    }

    fn peek(&mut self) -> Option<u32> {
        if self.peeked_at.is_none() {
            let now = self.clock.now();
            self.expire(now);
            self.peeked_at = Some(now);
        }
        self.first()
    }

    fn carried(&self, block: u32, in_set: bool) -> Carried {
        let s = &self.slots[block as usize];
        debug_assert_eq!(
            s.in_set, in_set,
            "block {block}: in the set is {}",
            s.in_set
        );
        Carried {
            retention: s.retention,
            rank: in_set.then_some((s.rank.priority, s.rank.deadline, s.rank.released)),
        }
    }

    fn drop_block(&mut self, block: u32) {
        self.slots.drop_block(block);
    }

    fn table_bytes(&self) -> usize {
        self.slots.bytes()
    }

    fn forget_held(&mut self, block: u32) {
        self.peeked_at = None;
        let s = &mut self.slots[block as usize];
        s.retention = DEFAULT;
        s.before_hit = DEFAULT;
    }

    /// A moved block keeps its level, deadline and release time (its place in the order is
    /// a function of those times: `expire` moves it at its deadline, as any other), behind
    /// the blocks already here released at the same instant.
    fn insert_carried(&mut self, block: u32, key: &Digest, carried: Carried) {
        self.peeked_at = None;
        self.slots[block as usize].retention = checked(carried.retention);
        let Some((priority, deadline, released)) = carried.rank else {
            self.insert(block, key, false);
            return;
        };
        self.slots[block as usize].rank = Rank {
            priority: priority.min(MAX_PRIORITY),
            deadline,
            released,
            seq: self.seq,
        };
        self.seq += 1;
        self.place(block);
    }

    fn clear(&mut self) {
        self.peeked_at = None;
        self.levels.iter_mut().for_each(BTreeMap::clear);
        self.nonempty = 0;
        self.pending.clear();
        self.slots.reset(|s| {
            s.retention = DEFAULT;
            s.in_set = false;
        });
    }
}

impl Policy for PriorityPolicy {
    fn cached(&mut self, e: Entry) {
        self.inner.cached(e);
    }

    fn hit(&mut self, block: u32) {
        self.inner.hit(block);
    }

    fn restore(&mut self, e: Entry) {
        self.inner.restore(e);
    }

    fn removed(&mut self, block: u32) {
        self.inner.removed(block);
    }

    fn miss(&mut self, digest: &Digest) {
        self.inner.miss(digest);
    }

    fn victim(&mut self) -> Option<Entry> {
        self.inner.victim()
    }

    fn peek(&mut self) -> Option<Entry> {
        self.inner.peek()
    }

    fn cross_rank(&self, block: u32) -> CrossRank {
        self.inner.rules.cross_rank(block)
    }

    fn passed_over(&mut self) {
        // The peek's block and time bound only a victim right after it.
        self.inner.unpeek();
        self.inner.rules.peeked_at = None;
    }

    fn len(&self) -> usize {
        self.inner.len()
    }

    fn table_bytes(&self) -> usize {
        self.inner.table_bytes()
    }

    fn entries(&self) -> Vec<Entry> {
        self.inner.entries()
    }

    fn clear(&mut self) -> Vec<Entry> {
        self.inner.clear()
    }

    fn carry_out(&mut self, block: u32, in_set: bool) -> Carried {
        self.inner.carry_out(block, in_set)
    }

    fn carry_in(&mut self, e: Entry, carried: Carried) {
        self.inner.carry_in(e, carried);
    }

    fn set_retention(&mut self, block: u32, retention: Retention) {
        self.inner.unpeek();
        self.inner.rules.set_retention(block, retention);
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
