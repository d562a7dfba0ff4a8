//! What every policy shares, as the reference's base class (`eviction/base.py`) does: the
//! evictable set's records and the revival memory. A policy proper (`Rules`) only orders
//! blocks; `Tracked` turns it into a `Policy`.

use super::block_table::{BlockTable, Tables};
use super::{Carried, CrossRank, Policy, NO_CROSS_RANK};
use crate::error::Result;
use crate::hashing::Digest;
use crate::lru_queue::Entry;

/// One policy's ordering rules, called by `Tracked` with the base class's bookkeeping done.
pub(crate) trait Rules: Send {
    /// Place a block that just became evictable; `revived`: a hit took it out and it comes
    /// back with the same digest (the reference's `_insert`).
    fn insert(&mut self, block: u32, key: &Digest, revived: bool);

    /// A hit took the block out (`_hit`); remember what it changed, for `unhit`.
    fn hit(&mut self, block: u32);

    /// Undo the latest `hit` of `block` exactly: its queue, position and counters. The
    /// whole policy is then as if the hit never happened when nothing but hits, restores,
    /// removals and misses came between; a victim between them could have been this block,
    /// and for ARC and SLRU a block cached between them was placed with this one out of
    /// the lists (the directory bound, the protected cap), so those leave a trace.
    fn unhit(&mut self, block: u32);

    /// Take a block out of every structure, no history kept (`_forget`).
    fn forget(&mut self, block: u32);

    /// A request missed `key` (`_miss`): only the policies with ghosts care.
    fn miss(&mut self, _key: &Digest) {}

    /// Choose and remove the victim (`_pick`); `keys` gives the digest of an evictable block.
    /// Right after `peek`, the block it named.
    fn pick(&mut self, keys: &Keys) -> Option<u32>;

    /// The block `pick` would choose now, left in (`_peek`): `Policy::peek`.
    fn peek(&mut self) -> Option<u32>;

    /// Forget everything, adaptive state and ghosts included.
    fn clear(&mut self);

    /// What `block` carries to another instance (`Policy::carry_out`), read before it
    /// leaves: nothing but for the priority policy.
    fn carried(&self, block: u32, in_set: bool) -> Carried {
        let _ = (block, in_set);
        Carried::NOTHING
    }

    /// A held block leaves for another instance: drop what was kept for its next release.
    fn forget_held(&mut self, block: u32) {
        let _ = block;
    }

    /// `block` left this instance (evicted, removed, moved): its sparse tables' entries go
    /// (`BlockTable::drop_block`).
    fn drop_block(&mut self, block: u32);

    /// Heap bytes of the per-block tables (`Policy::table_bytes`).
    fn table_bytes(&self) -> usize;

    /// Place a block moved here with what it carried; by default as a new block.
    fn insert_carried(&mut self, block: u32, key: &Digest, carried: Carried) {
        let _ = carried;
        self.insert(block, key, false);
    }
}

/// Where a block stands with the policy.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Out,
    /// In the evictable set (the reference's `_keys`).
    In,
    /// Taken out by a hit, not cached since (the reference's `_revived`): its record holds
    /// the digest the hit took out.
    Revived,
}

#[derive(Clone, Copy)]
struct Slot {
    /// The latest record; meaningful when `state` is not `Out`.
    entry: Entry,
    state: State,
}

/// The evictable set's records, by block.
pub(crate) struct Keys {
    slots: BlockTable<Slot>,
    len: usize,
}

impl Keys {
    /// The digest of the evictable `block`.
    pub(super) fn key(&self, block: u32) -> Digest {
        let s = &self.slots[block as usize];
        debug_assert_eq!(
            s.state,
            State::In,
            "block {block} is not in the evictable set"
        );
        s.entry.digest
    }
}

/// A `Policy` made of `Rules` and the base class's bookkeeping.
pub(crate) struct Tracked<R> {
    keys: Keys,
    pub(super) rules: R,
    /// The latest `peek`'s block while no other call came since: the next `victim` must
    /// return it (checked in debug builds).
    peeked: Option<u32>,
}

impl<R: Rules> Tracked<R> {
    pub(super) fn with_rules(tables: Tables, rules: R) -> Result<Self> {
        let out = Slot {
            entry: Entry {
                block: 0,
                generation: 0,
                digest: Digest::from_words([0; 4], 0),
            },
            state: State::Out,
        };
        Ok(Self {
            keys: Keys {
                slots: BlockTable::new(tables, out, "the eviction policy's block table")?,
                len: 0,
            },
            rules,
            peeked: None,
        })
    }

    /// A change the rules see that `Tracked` does not (the priority policy's retention):
    /// the latest peek no longer holds.
    pub(super) fn unpeek(&mut self) {
        self.peeked = None;
    }

    fn slot(&mut self, block: u32) -> &mut Slot {
        &mut self.keys.slots[block as usize]
    }

    /// `block` is out of this instance for good (no revival memory): its entries go.
    fn drop_block(&mut self, block: u32) {
        self.keys.slots.drop_block(block);
        self.rules.drop_block(block);
    }

    /// Take `block`'s record out of the set, leaving it in `to`.
    fn take(&mut self, block: u32, to: State) -> Entry {
        let s = self.slot(block);
        assert_eq!(
            s.state,
            State::In,
            "block {block} is not in the evictable set"
        );
        s.state = to;
        let e = s.entry;
        self.keys.len -= 1;
        e
    }
}

impl<R: Rules> Policy for Tracked<R> {
    fn cached(&mut self, e: Entry) {
        self.peeked = None;
        let s = self.slot(e.block);
        debug_assert_ne!(s.state, State::In, "block {} is already cached", e.block);
        let revived = s.state == State::Revived && s.entry.digest == e.digest;
        *s = Slot {
            entry: e,
            state: State::In,
        };
        self.keys.len += 1;
        self.rules.insert(e.block, &e.digest, revived);
    }

    fn hit(&mut self, block: u32) {
        self.peeked = None;
        self.take(block, State::Revived);
        self.rules.hit(block);
    }

    fn restore(&mut self, e: Entry) {
        self.peeked = None;
        let s = self.slot(e.block);
        debug_assert_eq!(s.state, State::Revived, "block {} was not hit", e.block);
        debug_assert_eq!(s.entry.digest, e.digest, "block {} changed digest", e.block);
        // Before the hit the block was in the set, with no revival pending.
        *s = Slot {
            entry: e,
            state: State::In,
        };
        self.keys.len += 1;
        self.rules.unhit(e.block);
    }

    fn removed(&mut self, block: u32) {
        self.peeked = None;
        self.take(block, State::Out);
        self.rules.forget(block);
        self.drop_block(block);
    }

    fn carry_out(&mut self, block: u32, in_set: bool) -> Carried {
        let carried = self.rules.carried(block, in_set);
        if in_set {
            self.removed(block);
        } else {
            self.peeked = None;
            let s = self.slot(block);
            debug_assert_ne!(s.state, State::In, "block {block} is in the set");
            // Its revival, if any, happens in the other instance now.
            s.state = State::Out;
            self.rules.forget_held(block);
            self.drop_block(block);
        }
        carried
    }

    fn carry_in(&mut self, e: Entry, carried: Carried) {
        self.peeked = None;
        let s = self.slot(e.block);
        debug_assert_ne!(s.state, State::In, "block {} is already cached", e.block);
        *s = Slot {
            entry: e,
            state: State::In,
        };
        self.keys.len += 1;
        self.rules.insert_carried(e.block, &e.digest, carried);
    }

    fn miss(&mut self, digest: &Digest) {
        self.peeked = None;
        self.rules.miss(digest);
    }

    fn victim(&mut self) -> Option<Entry> {
        let peeked = self.peeked.take();
        let b = self.rules.pick(&self.keys);
        debug_assert!(
            peeked.is_none() || b == peeked,
            "victim {b:?} is not the peeked block {peeked:?}"
        );
        let e = self.take(b?, State::Out);
        self.drop_block(e.block);
        Some(e)
    }

    fn peek(&mut self) -> Option<Entry> {
        let b = self.rules.peek();
        debug_assert!(
            self.peeked.is_none() || b == self.peeked,
            "peek {b:?} after peek {:?}",
            self.peeked
        );
        self.peeked = b;
        let s = &self.keys.slots[b? as usize];
        debug_assert_eq!(s.state, State::In, "peeked block {b:?} is not in the set");
        Some(s.entry)
    }

    fn cross_rank(&self, _block: u32) -> CrossRank {
        NO_CROSS_RANK
    }

    fn len(&self) -> usize {
        self.keys.len
    }

    fn table_bytes(&self) -> usize {
        self.keys.slots.bytes() + self.rules.table_bytes()
    }

    fn entries(&self) -> Vec<Entry> {
        let slots = self.keys.slots.slots();
        slots
            .filter(|s| s.state == State::In)
            .map(|s| s.entry)
            .collect()
    }

    fn clear(&mut self) -> Vec<Entry> {
        self.peeked = None;
        let out = self.entries();
        self.keys.slots.reset(|s| s.state = State::Out);
        self.keys.len = 0;
        self.rules.clear();
        out
    }
}
