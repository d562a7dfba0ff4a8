//! The grouped manager's view of the one atomic block pool (`block_pool::BlockPool`, the
//! pool the single-group manager uses): a block is indexed under `digest.keyed(group)`, its
//! group and the per-group tallies live in the pool, and block 0 is the null block. The
//! grouped manager calls it under its mutex, so every read here is exact.

use crate::block_pool::{BlockPool, GroupTally, Hit};
use crate::block_state::RC_MAX;
use crate::error::{Error, Result};
use crate::events::KvEvent;
use crate::hashing::{Digest, Tag};
use crate::sync::Ordering;

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

/// One group's tallies, read from the pool for `stats()` and the audit.
#[derive(Debug, Clone, Copy, Default)]
pub struct TallySnapshot {
    pub used: usize,
    pub cached: usize,
    pub hit_blocks: u64,
    pub evictions: u64,
    pub registered: u64,
}

pub struct GroupPool {
    pub(crate) pool: BlockPool,
    num_groups: usize,
    /// Bytes of a digest (the hash algorithm's), to read a block's key back.
    digest_len: usize,
}

impl GroupPool {
    pub fn new(
        num_blocks: u32,
        num_groups: usize,
        events: bool,
        evictions: bool,
        tagged: bool,
        digest_len: usize,
    ) -> Result<Self> {
        let pool = BlockPool::new(num_blocks, events, tagged)?;
        let pool = if evictions {
            pool.with_eviction_log()
        } else {
            pool
        };
        // Two tallies at least, so that a one-group hybrid manager keeps its group's too.
        let pool = pool.with_groups(num_groups.max(2), true)?;
        Ok(Self {
            pool,
            num_groups,
            digest_len,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }
    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }
    pub fn num_cached(&self) -> usize {
        self.pool.num_cached()
    }
    pub fn available(&self) -> usize {
        self.pool.num_available()
    }
    /// Holders of a block (0 for the null block, which has none).
    pub fn rc(&self, block: u32) -> u32 {
        if block == NULL {
            return 0;
        }
        self.pool.state(block).load().rc()
    }
    pub fn is_hashed(&self, block: u32) -> bool {
        block != NULL && self.pool.state(block).load().hashed()
    }

    /// The group and digest a hashed block is registered under.
    pub fn key(&self, block: u32) -> Option<(u8, Digest)> {
        if !self.is_hashed(block) {
            return None;
        }
        let g = self.pool.group_of(block);
        Some((g, self.pool.index_key(block, self.digest_len).keyed(g)))
    }

    /// The block registered under `(group, digest)` whose tag matches, if any. Reads only.
    pub fn find(&self, group: u8, digest: &Digest, tag: Option<Tag>) -> Option<u32> {
        let key = digest.keyed(group);
        let p = self.pool.peek(&key)?;
        (self.pool.index_holds(p.block, &key) && self.pool.index_tag_is(p.block, tag))
            .then_some(p.block)
    }

    /// Whether one more holder fits (checked before any change, so a refusal changes nothing).
    pub fn check_share(&self, block: u32) -> Result<()> {
        if self.rc(block) >= RC_MAX {
            return Err(Error::RefcountOverflow {
                block,
                limit: RC_MAX,
            });
        }
        Ok(())
    }

    /// A prefix hit: one more holder of the block cached under `(group, digest)` (a CACHED
    /// one is revived).
    pub fn share_hit(&self, group: u8, digest: &Digest, tag: Option<Tag>) -> Result<u32> {
        let mut spare = 0;
        match self.pool.pin(&digest.keyed(group), tag, &mut spare)? {
            Hit::Pinned { block, revived } => {
                if let Some(t) = self.pool.tally(group) {
                    t.hit_blocks.fetch_add(1, Ordering::Relaxed);
                }
                let _ = revived;
                Ok(block)
            }
            other => Err(Error::Broken(format!(
                "a hit found under the manager's lock was {other:?}"
            ))),
        }
    }

    /// One more holder of an OWNED block (a fork).
    pub fn share(&self, block: u32) -> Result<()> {
        self.pool
            .state(block)
            .share()
            .map_err(|_| crate::block_pool::refcount_overflow(block))
    }

    /// A new block for `group`: a free one first, else the oldest CACHED block, evicted.
    /// The caller checked `available()`; an empty pool here is a bug, reported as one.
    pub fn take(&self, group: u8) -> Result<u32> {
        if !self.pool.reserve(1) {
            return Err(Error::Broken("took a block from an empty pool".into()));
        }
        let b = self.pool.take();
        self.pool.set_group(b, group);
        Ok(b)
    }

    /// Drop one holder; at zero a hashed block is CACHED (newest), an unhashed one FREE.
    pub fn release(&self, block: u32) -> Result<()> {
        let key = self
            .is_hashed(block)
            .then(|| self.pool.index_key(block, self.digest_len));
        self.pool.release(block, key.as_ref())
    }

    /// Register an OWNED block unless its key is taken; emits `BlockStored`.
    pub fn register(&self, block: u32, key: Key, stored: impl FnOnce() -> KvEvent) -> bool {
        let new = self
            .pool
            .register(block, key.digest.keyed(key.group), key.tag, stored);
        if let (true, Some(t)) = (new, self.pool.tally(key.group)) {
            t.registered.fetch_add(1, Ordering::Relaxed);
        }
        new
    }

    /// Take a held block out of the index (it stays where it is, unhashed); emits
    /// `BlockRemoved`.
    pub fn unhash(&self, block: u32) {
        if let Some((g, d)) = self.key(block) {
            self.pool.retract(block, &d.keyed(g), false);
        }
    }

    pub fn push_event(&self, event: impl FnOnce() -> KvEvent) {
        self.pool.push_event(event);
    }

    pub fn drain_events(&self) -> Vec<KvEvent> {
        self.pool.drain_events()
    }

    /// `reset_prefix_cache`'s move of every CACHED block to the free stack, oldest first.
    /// The caller checked that no block is OWNED.
    pub fn clear_cached(&self) -> Result<()> {
        if self.pool.reset() {
            Ok(())
        } else {
            Err(Error::Broken("reset found owned blocks".into()))
        }
    }

    pub fn group_of(&self, block: u32) -> u8 {
        self.pool.group_of(block)
    }

    /// Group `g`'s tallies.
    pub fn tally(&self, g: usize) -> TallySnapshot {
        let t: Option<&GroupTally> = self.pool.tally(g as u8);
        t.map_or_else(TallySnapshot::default, |t| TallySnapshot {
            used: t.used.load(Ordering::Relaxed),
            cached: t.cached.load(Ordering::Relaxed),
            hit_blocks: t.hit_blocks.load(Ordering::Relaxed),
            evictions: t.evictions.load(Ordering::Relaxed),
            registered: t.registered.load(Ordering::Relaxed),
        })
    }

    /// Every group's tallies.
    pub fn tallies(&self) -> Vec<TallySnapshot> {
        (0..self.num_groups).map(|g| self.tally(g)).collect()
    }
}
