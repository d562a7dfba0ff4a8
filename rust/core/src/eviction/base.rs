//! What every policy shares, as the reference's base class (`eviction/base.py`) does: the
//! evictable set's records and the revival memory. A policy proper (`Rules`) only orders
//! blocks; `Tracked` turns it into a `Policy`.

use super::Policy;
use crate::alloc::try_filled;
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
    fn pick(&mut self, keys: &Keys) -> Option<u32>;

    /// Forget everything, adaptive state and ghosts included.
    fn clear(&mut self);
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
    slots: Vec<Slot>,
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
}

impl<R: Rules> Tracked<R> {
    pub(super) fn with_rules(num_blocks: usize, rules: R) -> Result<Self> {
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
                slots: try_filled(num_blocks, out, "the eviction policy's block table")?,
                len: 0,
            },
            rules,
        })
    }

    fn slot(&mut self, block: u32) -> &mut Slot {
        &mut self.keys.slots[block as usize]
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
        self.take(block, State::Revived);
        self.rules.hit(block);
    }

    fn restore(&mut self, e: Entry) {
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
        self.take(block, State::Out);
        self.rules.forget(block);
    }

    fn miss(&mut self, digest: &Digest) {
        self.rules.miss(digest);
    }

    fn victim(&mut self) -> Option<Entry> {
        let b = self.rules.pick(&self.keys)?;
        Some(self.take(b, State::Out))
    }

    fn len(&self) -> usize {
        self.keys.len
    }

    fn entries(&self) -> Vec<Entry> {
        let slots = self.keys.slots.iter();
        slots
            .filter(|s| s.state == State::In)
            .map(|s| s.entry)
            .collect()
    }

    fn clear(&mut self) -> Vec<Entry> {
        let out = self.entries();
        for s in &mut self.keys.slots {
            s.state = State::Out;
        }
        self.keys.len = 0;
        self.rules.clear();
        out
    }
}
