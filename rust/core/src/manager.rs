//! The block manager: sequences and their tables over the GPU pool and the CPU swap space.
//! This file holds the struct, its construction and the locking helpers every operation
//! uses; the operations live in their own files (`allocate`, `schedule`, `truncate`,
//! `lifecycle`, `swap`, `admission`, `queries`, `batch`, `decode`, `running`, `grouped`).
//!
//! Locking: each sequence has its own mutex, held for the whole of an operation on it (batch
//! calls hold all of theirs). Every call that changes block ownership is inside the reset
//! gate (shared; `reset_prefix_cache` enters it exclusive). Nothing else is locked across an
//! operation: block states, the free stacks and the admission counters are atomics, the
//! sequence map and the prefix index are lock-free maps. The other locks are short: the LRU
//! queue's (one push or pop) and a digest stripe's (one registration or eviction).

use crate::block_pool::BlockPool;
use crate::broken::BrokenGuard;
use crate::clock::Clock;
use crate::config::Config;
use crate::counters::{Counters, RecentHits};
use crate::cpu_pool::CpuPool;
use crate::error::{invalid, Error, Result};
use crate::gate::{Gate, Shared};
use crate::hashing::{BlockHasher, Digest};
use crate::hit_tag::HitTagger;
use crate::policy::{GroupKind, MAX_GROUPS};
use crate::seq_map::{lock_cell, SeqMap};
use crate::sequence::Sequence;
use crate::sync::{lock, may_wait, try_lock, AtomicU64, Mutex, MutexGuard, Ordering, Padded};
use crate::tenants::registry::Registry;
use std::sync::Arc;

/// The most tokens one sequence may hold (positions fit an `i32`, as attention kernels and
/// FlashInfer's tables expect).
pub const MAX_TOKENS: usize = i32::MAX as usize;

pub struct BlockManager {
    pub(crate) config: Config,
    pub(crate) hasher: BlockHasher,
    /// Present when the digest is not collision resistant: every hit is then confirmed by a
    /// secret tag of the whole prefix (`hit_tag`, docs/security.md).
    pub(crate) tagger: Option<HitTagger>,
    pub(crate) gpu: BlockPool,
    pub(crate) cpu: CpuPool,
    /// Live sequences (see `seq_map` for how an id comes and goes).
    pub(crate) seqs: SeqMap,
    pub(crate) counters: Padded<Counters>,
    /// Prefix queries and hits of the last allocations (`stats()`'s recent hit rate).
    pub(crate) recent: RecentHits,
    /// What retention durations count against (`set_time` makes it manual).
    pub(crate) clock: Arc<Clock>,
    /// Tenant ids and counters, with `tenants` (None without).
    pub(crate) tenants: Option<Arc<Registry>>,
    /// Shared by every call that changes block ownership, exclusive for reset.
    pub(crate) gate: Gate,
    /// `stats()`'s reserved and used slots of resident sequences, changed under the lock of
    /// the sequence whose footprint changed (Relaxed: tallies read on their own).
    pub(crate) reserved_slots: Padded<AtomicU64>,
    pub(crate) used_slots: Padded<AtomicU64>,
    /// `prefix_locks[k]` serialises every call that looks up or registers blocks of prompts
    /// whose first block's digest maps to `k` (`prefix_lock_of`): an allocation holds it from
    /// its first hit to its last registration, an append or swap-in while it registers. Chain
    /// digests depend on the first block, so calls under different locks never touch the
    /// same digests, and two calls on one prefix see each other's registrations whole: the
    /// later of two identical prompts hits what the earlier registered. Taken after the
    /// sequence locks and before the LRU and stripe locks; holders wait for nothing else.
    prefix_locks: Box<[Padded<Mutex<()>>]>,
    /// Set when an internal invariant failed mid-operation (see `broken`).
    broken: BrokenGuard,
    /// Distinct for every manager of the process: what a `RunningBatch` checks it was made by.
    pub(crate) instance: u64,
    /// The kind of each KV-cache group: one `Full` without `groups=`.
    pub(crate) kinds: Box<[GroupKind]>,
    /// Whether `groups=` was given: `stats()` then reports each group's figures.
    pub(crate) grouped: bool,
    /// Block 0 is the null block: some group is not full attention (docs/semantics.md).
    pub(crate) null: bool,
    /// The swap space's copies per key, for its events (`cpu_copies`).
    pub(crate) cpu_copies: crate::cpu_copies::CpuCopies,
}

/// The next manager's `instance` (Relaxed: only uniqueness matters).
static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Number of prefix locks (see the field).
pub(crate) const PREFIX_LOCKS: usize = 64;

/// A first block's prefix lock: the low bits of word 1, which every digest length has (a
/// 16-byte XXH3 digest is zero past word 1), independent of the prefix index's bucket and
/// tag bits and of the digest stripes (see `block_pool::stripe_of`).
pub(crate) fn prefix_lock_of(first: &Digest) -> usize {
    first.words()[1] as usize % PREFIX_LOCKS
}

/// The prefix lock of a chain with these digests (none for a chain without a full block).
pub(crate) fn chain_lock(digests: &[Digest]) -> Vec<usize> {
    digests.first().map(prefix_lock_of).into_iter().collect()
}

/// `num_new_tokens` of a prompt of `n` tokens: `1..=n`, `None` meaning all of them.
pub(crate) fn check_new_tokens(k: Option<usize>, n: usize) -> Result<usize> {
    match k {
        None => Ok(n),
        Some(k) if (1..=n).contains(&k) => Ok(k),
        Some(k) => Err(invalid(format!(
            "num_new_tokens {k} must be in 1..={n} (the prompt's length)"
        ))),
    }
}

/// A prompt or appended tokens: not empty, and at most `MAX_TOKENS`.
pub(crate) fn check_tokens(tokens: &[u32], what: &str) -> Result<()> {
    if tokens.is_empty() {
        return Err(invalid(format!("{what} must not be empty")));
    }
    if tokens.len() > MAX_TOKENS {
        return Err(invalid(format!(
            "{what} has {} tokens, more than the {MAX_TOKENS} a sequence may hold",
            tokens.len()
        )));
    }
    Ok(())
}

/// Appending `k` tokens to sequence `id` of `n` tokens, `scheduled` of them scheduled: its
/// prompt must be fully scheduled and the result within `MAX_TOKENS`.
/// `extend(id, k)` of a sequence of `n` tokens, `scheduled` of them scheduled: `k` must be
/// in `1..=` the prompt tokens left.
pub(crate) fn check_extend(id: u64, n: usize, scheduled: usize, k: usize) -> Result<()> {
    let left = n - scheduled;
    if left == 0 {
        return Err(invalid(format!(
            "sequence {id} has no prompt tokens left to schedule (append adds tokens)"
        )));
    }
    if k == 0 || k > left {
        return Err(invalid(format!(
            "num_new_tokens {k} for sequence {id} must be in 1..={left} (its prompt tokens \
             not yet scheduled)"
        )));
    }
    Ok(())
}

pub(crate) fn check_append(id: u64, n: usize, scheduled: usize, k: usize) -> Result<()> {
    if scheduled < n {
        return Err(invalid(format!(
            "sequence {id} has {} prompt tokens not yet scheduled: extend it before appending",
            n - scheduled
        )));
    }
    match n.checked_add(k) {
        Some(total) if total <= MAX_TOKENS => Ok(()),
        _ => Err(invalid(format!(
            "appending {k} tokens to sequence {id} ({n} tokens) exceeds the {MAX_TOKENS} a \
             sequence may hold"
        ))),
    }
}

pub(crate) fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl BlockManager {
    /// A manager of one full-attention group (no `groups=`).
    pub fn new(config: Config) -> Result<Self> {
        Self::build(config, None)
    }

    /// A manager whose sequences hold one table per KV-cache group of these kinds.
    pub fn with_groups(config: Config, kinds: Vec<GroupKind>) -> Result<Self> {
        Self::build(config, Some(kinds))
    }

    fn build(config: Config, kinds: Option<Vec<GroupKind>>) -> Result<Self> {
        config.validate()?;
        let grouped = kinds.is_some();
        let kinds = kinds.unwrap_or_else(|| vec![GroupKind::Full]);
        if kinds.is_empty() || kinds.len() > MAX_GROUPS {
            return Err(invalid(format!(
                "groups must hold 1..={MAX_GROUPS} groups, got {}",
                kinds.len()
            )));
        }
        crate::policy::check_interval(
            &kinds,
            config.block_size,
            config.prefix_cache_retention_interval,
        )?;
        let null = kinds.iter().any(|k| *k != GroupKind::Full);
        if null && config.num_blocks < 2 {
            return Err(invalid(
                "num_blocks must be at least 2 with a group that is not full attention \
                 (block 0 is the null block)",
            ));
        }
        let tagged = config.hash_algo.needs_verified_hits();
        let clock = Arc::new(Clock::default());
        let tenants = config.tenants.then(|| Arc::new(Registry::default()));
        Ok(Self {
            hasher: BlockHasher::new(config.hash_algo, config.hash_seed),
            tagger: tagged.then(HitTagger::random),
            gpu: {
                let pool = BlockPool::new(config.num_blocks, config.enable_kv_events, tagged)?
                    .with_eviction(config.eviction, tenants.clone(), &clock)?;
                let pool = if config.record_evictions {
                    pool.with_eviction_log()
                } else {
                    pool
                };
                pool.with_groups(kinds.len(), null, grouped)?
            },
            cpu: CpuPool::new(config.num_cpu_blocks)?,
            seqs: SeqMap::new(),
            counters: Padded::default(),
            recent: RecentHits::default(),
            clock,
            tenants,
            gate: Gate::new(),
            reserved_slots: Padded(AtomicU64::new(0)),
            used_slots: Padded(AtomicU64::new(0)),
            prefix_locks: crate::alloc::try_boxed(
                PREFIX_LOCKS,
                |_| Padded(Mutex::new(())),
                "locks",
            )?,
            broken: BrokenGuard::default(),
            instance: INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            kinds: kinds.into_boxed_slice(),
            grouped,
            null,
            cpu_copies: Default::default(),
            config,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// One full-attention group: the single-group fast paths apply.
    pub(crate) fn plain(&self) -> bool {
        self.kinds.len() == 1 && !self.null
    }

    /// The kinds of the KV-cache groups (one `Full` without `groups=`).
    pub fn kinds(&self) -> &[GroupKind] {
        &self.kinds
    }

    /// Whether `groups=` was given.
    pub fn is_grouped(&self) -> bool {
        self.grouped
    }

    /// An `InvalidArgumentError` unless `group` names one of the groups.
    pub fn check_group(&self, group: usize) -> Result<()> {
        if group >= self.kinds.len() {
            let n = self.kinds.len();
            return Err(invalid(format!(
                "group {group} out of range: the manager has {n} group{}",
                if n == 1 { "" } else { "s" }
            )));
        }
        Ok(())
    }

    pub(crate) fn caching(&self) -> bool {
        self.config.enable_prefix_caching
    }

    /// Run one public call: a panic or a `Broken` error marks the manager broken (its state
    /// may be half changed) and comes back as `Error::Broken`; a broken manager refuses
    /// every later call that changes state (`mutating`), before doing anything.
    pub(crate) fn guarded<T>(&self, mutating: bool, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.broken.guarded(mutating, f)
    }

    /// Whether an internal invariant failed (see `guarded`).
    pub fn is_broken(&self) -> bool {
        self.broken.is_broken()
    }

    /// Enter the reset gate shared (see `gate`), or `WouldBlock` in non-blocking mode while a
    /// reset runs.
    pub(crate) fn enter(&self) -> Result<Shared<'_>> {
        self.gate.try_shared(may_wait()).ok_or(Error::WouldBlock)
    }

    /// Lock the prefix locks `keys` (any order, repeats allowed) in index order, without
    /// waiting first; in non-blocking mode a busy one is `WouldBlock` (nothing held).
    pub(crate) fn lock_prefixes(&self, mut keys: Vec<usize>) -> Result<Vec<MutexGuard<'_, ()>>> {
        keys.sort_unstable();
        keys.dedup();
        let mut held = Vec::with_capacity(keys.len());
        for &k in &keys {
            match try_lock(&self.prefix_locks[k]) {
                Some(g) => held.push(g),
                None => break,
            }
        }
        if held.len() == keys.len() {
            return Ok(held);
        }
        drop(held);
        if !may_wait() {
            return Err(Error::WouldBlock);
        }
        Ok(keys.iter().map(|&k| lock(&self.prefix_locks[k])).collect())
    }

    /// Move the stats tallies from one footprint of a sequence to another.
    pub(crate) fn account(&self, before: (u64, u64), after: (u64, u64)) {
        // Relaxed: tallies (see the fields); wrapping adds of the difference, whose sum over
        // a sequence's life is exact.
        self.reserved_slots
            .fetch_add(after.0.wrapping_sub(before.0), Ordering::Relaxed);
        self.used_slots
            .fetch_add(after.1.wrapping_sub(before.1), Ordering::Relaxed);
    }

    /// Run `f` on a live sequence under its lock; `mutating` calls are inside the gate and
    /// keep `stats()` tallies current.
    pub(crate) fn with_seq<T>(
        &self,
        id: u64,
        mutating: bool,
        f: impl FnOnce(&mut Sequence) -> Result<T>,
    ) -> Result<T> {
        self.guarded(mutating, || {
            let _gate = if mutating { Some(self.enter()?) } else { None };
            let cell = self.seqs.get(id).ok_or(Error::UnknownSequence(id))?;
            let mut seq = lock_cell(&cell)?;
            if !cell.is_live() {
                return Err(Error::UnknownSequence(id));
            }
            if !mutating {
                return f(&mut seq);
            }
            let before = seq.footprint(self.block_size());
            let out = f(&mut seq);
            self.account(before, seq.footprint(self.block_size()));
            out
        })
    }
}
