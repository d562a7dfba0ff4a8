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

    /// Undo the latest `hit` of `block` exactly.
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

#[derive(Clone, Copy)]
struct Slot {
    /// The record while the block is in the set (`_keys`).
    entry: Option<Entry>,
    /// The digest the latest hit took out, until the block is cached again (`_revived`).
    revived: Option<Digest>,
}

/// The evictable set's records, by block.
pub(crate) struct Keys {
    slots: Vec<Slot>,
    len: usize,
}

impl Keys {
    /// The digest of the evictable `block`.
    pub(super) fn key(&self, block: u32) -> Digest {
        match self.slots[block as usize].entry {
            Some(e) => e.digest,
            None => unreachable!("block {block} is not in the evictable set"),
        }
    }
}

/// A `Policy` made of `Rules` and the base class's bookkeeping.
pub(crate) struct Tracked<R> {
    keys: Keys,
    pub(super) rules: R,
}

impl<R: Rules> Tracked<R> {
    pub(super) fn with_rules(num_blocks: usize, rules: R) -> Result<Self> {
        let empty = Slot {
            entry: None,
            revived: None,
        };
        Ok(Self {
            keys: Keys {
                slots: try_filled(num_blocks, empty, "the eviction policy's block table")?,
                len: 0,
            },
            rules,
        })
    }

    fn slot(&mut self, block: u32) -> &mut Slot {
        &mut self.keys.slots[block as usize]
    }

    /// Take `block`'s record out of the set.
    fn take(&mut self, block: u32) -> Entry {
        let e = self.slot(block).entry.take();
        let Some(e) = e else {
            unreachable!("block {block} is not in the evictable set")
        };
        self.keys.len -= 1;
        e
    }
}

impl<R: Rules> Policy for Tracked<R> {
    fn cached(&mut self, e: Entry) {
        let s = self.slot(e.block);
        debug_assert!(s.entry.is_none(), "block {} is already cached", e.block);
        let revived = s.revived.take() == Some(e.digest);
        s.entry = Some(e);
        self.keys.len += 1;
        self.rules.insert(e.block, &e.digest, revived);
    }

    fn hit(&mut self, block: u32) {
        let e = self.take(block);
        self.slot(block).revived = Some(e.digest);
        self.rules.hit(block);
    }

    fn restore(&mut self, e: Entry) {
        let s = self.slot(e.block);
        debug_assert!(s.entry.is_none(), "block {} is in the set", e.block);
        debug_assert_eq!(s.revived, Some(e.digest), "block {} was not hit", e.block);
        // Before the hit the block was in the set, so no revival was pending (`cached`
        // takes it).
        s.revived = None;
        s.entry = Some(e);
        self.keys.len += 1;
        self.rules.unhit(e.block);
    }

    fn removed(&mut self, block: u32) {
        self.take(block);
        self.rules.forget(block);
    }

    fn miss(&mut self, digest: &Digest) {
        self.rules.miss(digest);
    }

    fn victim(&mut self) -> Option<Entry> {
        let b = self.rules.pick(&self.keys)?;
        Some(self.take(b))
    }

    fn len(&self) -> usize {
        self.keys.len
    }

    fn entries(&self) -> Vec<Entry> {
        self.keys.slots.iter().filter_map(|s| s.entry).collect()
    }

    fn clear(&mut self) -> Vec<Entry> {
        let out = self.entries();
        for s in &mut self.keys.slots {
            s.entry = None;
            s.revived = None;
        }
        self.keys.len = 0;
        self.rules.clear();
        out
    }
}
