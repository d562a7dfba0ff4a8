//! Eviction policies other than the default LRU: S3-FIFO, ARC, LFU with dynamic aging, SLRU,
//! priority retention.
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

mod arc;
mod base;
pub(crate) mod block_table;
mod lfu;
// The locked LRU: per-tenant instances (`tenants`) and the policies' own tests (the pool
// runs LRU lock-free otherwise).
mod lru;
#[cfg(all(test, not(loom)))]
mod peek_tests;
mod priority;
mod s3fifo;
mod seq_queue;
mod slru;
#[cfg(all(test, not(loom)))]
mod test_util;
#[cfg(all(test, not(loom)))]
mod tests;

pub(crate) use arc::ArcPolicy;
pub(crate) use lfu::LfuAging;
pub(crate) use lru::Lru;
pub(crate) use priority::PriorityPolicy;
pub(crate) use s3fifo::S3Fifo;
pub(crate) use slru::Slru;

use crate::clock::Clock;
use crate::error::Result;
use crate::hashing::Digest;
use crate::lru_queue::Entry;
use crate::tenants::Quota;
use std::sync::Arc;

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
    /// Retention priorities and durations (TensorRT-LLM's meaning).
    Priority,
}

impl EvictionKind {
    /// Every kind, in the order `names` lists them.
    pub const ALL: [EvictionKind; 6] = [
        Self::Lru,
        Self::S3Fifo,
        Self::Arc,
        Self::Lfu,
        Self::Slru,
        Self::Priority,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::S3Fifo => "s3fifo",
            Self::Arc => "arc",
            Self::Lfu => "lfu",
            Self::Slru => "slru",
            Self::Priority => "priority",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// The default retention priority (TensorRT-LLM's `kDefaultRetentionPriority`).
pub const DEFAULT_PRIORITY: u8 = 35;
/// The highest retention priority (TensorRT-LLM's `kMaxRetentionPriority`).
pub const MAX_PRIORITY: u8 = 100;

/// The retention of one block, with TensorRT-LLM's meaning: every evictable block of lower
/// priority goes before any of higher priority; after `duration` seconds from its release a
/// block returns to `DEFAULT_PRIORITY` (None: it keeps its priority while cached).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retention {
    /// 0..=`MAX_PRIORITY`.
    pub priority: u8,
    /// Seconds, finite and >= 0, or None.
    pub duration: Option<f64>,
}

impl Retention {
    /// What a block has unless a sequence gave it retention.
    pub const DEFAULT: Retention = Retention {
        priority: DEFAULT_PRIORITY,
        duration: None,
    };
}

/// What a block takes along when it moves from one policy instance to another (tenant
/// quotas: a tenant's blocks move to its own instance at its first quota): the retention
/// its next release gives it and, for a block in the set, its rank (priority, deadline,
/// release time), so that it keeps its place in the priority order. Only the priority
/// policy carries anything; the others' history (queue places, frequencies) stays behind.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Carried {
    pub retention: Retention,
    /// (priority, deadline, release time) of a block that was in the set.
    pub rank: Option<(u8, Option<f64>, f64)>,
}

impl Carried {
    /// What every policy but priority carries.
    pub const NOTHING: Carried = Carried {
        retention: Retention::DEFAULT,
        rank: None,
    };
}

/// How a candidate victim orders against other policy instances' candidates (tenant quotas:
/// each tenant's policy names its `peek`, the least by (cross rank, release order) goes):
/// (level, time, kind), the reference's `cross_rank` (`priority.py`'s `rank(now)[:3]`). The
/// priority policy gives (priority, release time, 1), or (`DEFAULT_PRIORITY`, deadline, 0)
/// once the block's duration has run out (kind 0: ahead of the blocks released at that very
/// instant); every other policy gives `NO_CROSS_RANK`, so release order alone decides.
pub type CrossRank = (u8, f64, u8);

/// The cross rank of every policy but priority (the reference's empty tuple).
pub const NO_CROSS_RANK: CrossRank = (DEFAULT_PRIORITY, 0.0, 1);

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

    /// The next block to evict, removed from the set; None when the set is empty. Right
    /// after a `peek`, exactly the entry it returned.
    fn victim(&mut self) -> Option<Entry>;

    /// The entry the next `victim` returns if no other call comes in between, left in the
    /// set; None when the set is empty. Tenant quotas need each tenant's next victim to
    /// choose among them (the reference's `quotas.py`, rule 3). It may do for real the
    /// bookkeeping `victim` does before it chooses, so that the candidate then sits where
    /// `victim` takes it: S3-FIFO moves S's reused oldest blocks to M and reinserts M's
    /// oldest with one access spent, as the reference's `peek` does (so a peek that is not
    /// followed by this policy's `victim` still changes its later order, on both sides);
    /// for the other policies the order is as if the peek never happened. A second peek
    /// returns the same entry and changes nothing.
    fn peek(&mut self) -> Option<Entry>;

    /// The latest `peek` was passed over: tenant quotas peeked this instance and evicted
    /// another's block, and the next call here may come at any later time. The priority
    /// policy forgets the peek's time (its next peek expires and ranks at the clock's time
    /// then, so a deadline that passed meanwhile counts); the others keep what their peek did
    /// (S3-FIFO's moves and choice depend on its own state alone, which nothing changed).
    fn passed_over(&mut self) {}

    /// What orders the member `block` (normally this policy's `peek`) against another
    /// instance's candidate before their release order: `CrossRank`, least first. The
    /// priority policy ranks at its latest peek's time while no call came since (the time
    /// its choice was made), else at the clock's now.
    fn cross_rank(&self, block: u32) -> CrossRank;

    /// Blocks in the set.
    fn len(&self) -> usize;

    /// Heap bytes of the per-block tables (tests and benchmarks: a tenant's own instance
    /// must grow with what the tenant holds, not with the pool).
    fn table_bytes(&self) -> usize {
        0
    }

    /// The set's records, in no particular order (audits).
    fn entries(&self) -> Vec<Entry>;

    /// Forget everything, ghosts and adaptive state included (reset of the prefix cache);
    /// returns the records that were in the set.
    fn clear(&mut self) -> Vec<Entry>;

    /// The retention of `block` from its next release on (it is held, by the caller); the
    /// priority policy keeps it per block, the others have none (the manager refuses
    /// retention unless the policy is `priority`, so they never see this call).
    fn set_retention(&mut self, block: u32, retention: Retention) {
        let _ = (block, retention);
    }

    /// Take `block` out of this instance to move it to another (`carry_in` there): in the
    /// set (`in_set`) it leaves as by `removed`; held (a hit took it out) its revival memory
    /// and retention here are dropped. Returns what it carries along.
    fn carry_out(&mut self, block: u32, in_set: bool) -> Carried {
        if in_set {
            self.removed(block);
        }
        Carried::NOTHING
    }

    /// `cached` of a block moved here from another instance, with what it carried
    /// (`carry_out`); the others place it as a new block.
    fn carry_in(&mut self, e: Entry, carried: Carried) {
        let _ = carried;
        self.cached(e);
    }

    /// `restore` (`tenants`); a policy that enforces caps appends the blocks it evicts at
    /// once to keep them to `trimmed`: a failed call's restore can put a tenant over its
    /// cap when its other blocks were released meanwhile.
    fn restore_by(&mut self, e: Entry, trimmed: &mut Vec<Entry>) {
        let _ = trimmed;
        self.restore(e);
    }

    /// `cached` of a block of `tenant` (`tenants`); a policy that enforces caps appends the
    /// blocks it evicts at once to keep them (the tenant's own victims) to `trimmed`.
    fn cached_by(&mut self, e: Entry, tenant: u32, trimmed: &mut Vec<Entry>) {
        let _ = (tenant, trimmed);
        self.cached(e);
    }

    /// Set `tenant`'s quota (`tenants`; `Quota::default()`: none); a lower cap evicts at
    /// once into `trimmed`. `spare`: a new instance for the tenant's own group, built by the
    /// caller before it took the lock, taken if the tenant gets its first quota; a dissolved
    /// group's instance comes back in it, for the caller to free after the lock. Fails with
    /// `OutOfMemory` (nothing changed) when no instance was handed in and one does not fit.
    fn set_quota(
        &mut self,
        tenant: u32,
        quota: Quota,
        spare: &mut Option<Box<dyn Policy>>,
        trimmed: &mut Vec<Entry>,
    ) -> Result<()> {
        let _ = (tenant, quota, spare, trimmed);
        Ok(())
    }

    /// The heap bytes of `tenant`'s own instance's per-block tables (`table_bytes`), if it
    /// has one (tests and benchmarks).
    fn tenant_policy_bytes(&self, tenant: u32) -> Option<usize> {
        let _ = tenant;
        None
    }
}

/// A new policy of `kind` run in locked mode, LRU included (the per-tenant instances of
/// `tenants::quotas`).
pub fn new_locked_policy(
    kind: EvictionKind,
    num_blocks: usize,
    clock: &Arc<Clock>,
) -> Result<Box<dyn Policy>> {
    match new_policy(kind, num_blocks, clock)? {
        Some(p) => Ok(p),
        None => Ok(Box::new(Lru::new(num_blocks)?)),
    }
}

/// A tenant's own instance of `kind` (`tenants::quotas`): its per-block tables are sparse
/// (`block_table`), so it costs what the tenant holds; the bounds that size the policy's
/// history (ARC's `c`, S3-FIFO's ghosts, SLRU's protected cap) still come from the pool's
/// `num_blocks`, as in the reference.
pub fn new_tenant_policy(
    kind: EvictionKind,
    num_blocks: usize,
    clock: &Arc<Clock>,
) -> Result<Box<dyn Policy>> {
    let t = block_table::Tables::Sparse;
    Ok(match kind {
        EvictionKind::Lru => Box::new(Lru::with_tables(t)?),
        EvictionKind::S3Fifo => Box::new(S3Fifo::with_tables(num_blocks, t)?),
        EvictionKind::Arc => Box::new(ArcPolicy::with_cache_size(t, num_blocks)?),
        EvictionKind::Lfu => Box::new(LfuAging::with_tables(t)?),
        EvictionKind::Slru => Box::new(Slru::with_cache_size(t, num_blocks)?),
        EvictionKind::Priority => Box::new(PriorityPolicy::with_tables(t, clock)?),
    })
}

/// A new policy of `kind` for a pool of `num_blocks` blocks; None for `Lru`, which the pool
/// runs lock-free. `clock`: the manager's (retention durations count against it). Fails with
/// `OutOfMemory` when its per-block tables do not fit.
pub fn new_policy(
    kind: EvictionKind,
    num_blocks: usize,
    clock: &Arc<Clock>,
) -> Result<Option<Box<dyn Policy>>> {
    Ok(match kind {
        EvictionKind::Lru => None,
        EvictionKind::S3Fifo => Some(Box::new(S3Fifo::new(num_blocks)?)),
        EvictionKind::Arc => Some(Box::new(ArcPolicy::new(num_blocks)?)),
        EvictionKind::Lfu => Some(Box::new(LfuAging::new(num_blocks)?)),
        EvictionKind::Slru => Some(Box::new(Slru::new(num_blocks)?)),
        EvictionKind::Priority => Some(Box::new(PriorityPolicy::new(num_blocks, clock)?)),
    })
}
