//! Eviction policies other than the default LRU: S3-FIFO, ARC, LFU with dynamic aging, SLRU.
//!
//! The default order (least recently released first, `lru_queue`) keeps its lock-free hits:
//! a hit leaves a stale record behind. The policies here need to know of every hit (to count
//! it, or to move the block between queues), so the pool runs them in *locked mode*: every
//! transition into or out of CACHED (a release to CACHED, a revival by a hit, an eviction, a
//! withdrawal, a reset, the restore of a failed call) happens under the one policy lock
//! (`order::EvictionOrder`), and the policy is told of it under the same lock. So a policy's
//! evictable set is exactly the CACHED blocks whenever the lock is free, and a policy is a
//! plain single-threaded structure: no stale records, no generations to check.
//!
//! Each policy follows the plain reference in `testing/pagedkv_reference/eviction/` (its
//! module docs give the algorithm, the paper, and every adaptation to a block manager); the
//! model-based tests compare the Rust manager with the reference manager under each policy.

// The pool does not run these policies yet (the lead wires them in); until then most of
// the module is unused outside its tests.
#![allow(dead_code)]

mod arc;
mod base;
mod lfu;
mod lru;
mod s3fifo;
mod seq_queue;
mod slru;
#[cfg(all(test, not(loom)))]
mod test_util;
#[cfg(all(test, not(loom)))]
mod tests;

pub(crate) use arc::ArcPolicy;
pub(crate) use lfu::LfuAging;
#[cfg(all(test, not(loom)))]
pub(crate) use lru::Lru;
pub(crate) use s3fifo::S3Fifo;
pub(crate) use slru::Slru;

use crate::error::Result;
use crate::hashing::Digest;
use crate::lru_queue::Entry;

/// The eviction policy of a manager's GPU pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EvictionKind {
    /// Least recently released first, with lock-free hits (vLLM's order; the default).
    #[default]
    Lru,
    /// S3-FIFO (Yang et al., SOSP'23).
    S3Fifo,
    /// ARC (Megiddo and Modha, FAST'03).
    Arc,
    /// LFU with dynamic aging (LFU-DA).
    Lfu,
    /// Segmented LRU (probationary and protected segments).
    Slru,
}

impl EvictionKind {
    /// Every kind, in the order `names` lists them.
    pub const ALL: [EvictionKind; 5] = [Self::Lru, Self::S3Fifo, Self::Arc, Self::Lfu, Self::Slru];

    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::S3Fifo => "s3fifo",
            Self::Arc => "arc",
            Self::Lfu => "lfu",
            Self::Slru => "slru",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// A policy over the evictable (CACHED) blocks, called under the pool's policy lock only.
///
/// Contract (the pool keeps it; a policy may `debug_assert!` it): `cached` is called only for
/// a block not in the set; `hit` and `removed` only for a block in the set; `restore` only
/// for a block whose latest change was a `hit`, with nothing between them that touched the
/// block. `victim` removes what it returns.
pub trait Policy: Send {
    /// `e.block` became CACHED under `e.digest`. If a hit took the block out of the set and
    /// `e.digest` is the digest it had then, this is the same content coming back (a
    /// revival): the policy keeps its history (queue, frequency), as the reference does.
    fn cached(&mut self, e: Entry);

    /// A prefix hit revived the CACHED `block`: it leaves the set; the hit counts as an
    /// access for the policies that count them.
    fn hit(&mut self, block: u32);

    /// Undo the latest `hit` of `e.block` exactly: a failed call gives back a block it
    /// revived and did not use, so everything (position, frequency, revival memory) is as
    /// it was before that hit. `e` is the block's new record (its generation moved on).
    fn restore(&mut self, e: Entry);

    /// `block` leaves the set for another reason than eviction (withdrawal of bad KV,
    /// reset): no ghost, no history kept.
    fn removed(&mut self, block: u32);

    /// A request needs `digest` and the cache does not hold it (S3-FIFO's and ARC's ghost
    /// lookups; a no-op for the others).
    fn miss(&mut self, digest: &Digest);

    /// The next block to evict, removed from the set; None when the set is empty.
    fn victim(&mut self) -> Option<Entry>;

    /// Blocks in the set.
    fn len(&self) -> usize;

    /// The set's records, in no particular order (audits).
    fn entries(&self) -> Vec<Entry>;

    /// Forget everything, ghosts and adaptive state included (reset of the prefix cache);
    /// returns the records that were in the set.
    fn clear(&mut self) -> Vec<Entry>;
}

/// A new policy of `kind` for a pool of `num_blocks` blocks; None for `Lru`, which the pool
/// runs lock-free. Fails with `OutOfMemory` when its per-block tables do not fit.
pub fn new_policy(kind: EvictionKind, num_blocks: usize) -> Result<Option<Box<dyn Policy>>> {
    Ok(match kind {
        EvictionKind::Lru => None,
        EvictionKind::S3Fifo => Some(Box::new(S3Fifo::new(num_blocks)?)),
        EvictionKind::Arc => Some(Box::new(ArcPolicy::new(num_blocks)?)),
        EvictionKind::Lfu => Some(Box::new(LfuAging::new(num_blocks)?)),
        EvictionKind::Slru => Some(Box::new(Slru::new(num_blocks)?)),
    })
}
