//! The block manager: sequences and their tables over the GPU pool and the CPU swap space.
//!
//! Locking: each sequence has its own mutex, held for the whole of an operation on it (batch
//! calls hold all of theirs). Every call that changes block ownership is inside the reset
//! gate (shared; `reset_prefix_cache` enters it exclusive). Nothing else is locked across an
//! operation: block states, the free stacks and the admission counters are atomics, the
//! sequence map and the prefix index are lock-free maps. The other locks are short: the LRU
//! queue's (one push or pop) and a digest stripe's (one registration or eviction).

use crate::block_pool::{refcount_overflow, BlockPool, Hit};
use crate::broken::BrokenGuard;
use crate::config::Config;
use crate::counters::{self, Counters, RecentHits};
use crate::cpu_pool::CpuPool;
use crate::error::{invalid, Error, Result};
use crate::events::{KvEvent, Medium};
use crate::gate::{Gate, Shared};
use crate::grouped::StepReq;
use crate::hashing::{encode_extras, BlockHasher, Digest};
use crate::hit_tag::HitTagger;
use crate::policy::{GroupKind, MAX_GROUPS};
use crate::seq_map::{lock_cell, wait_settled, Attempt, SeqMap};
use crate::sequence::Sequence;
use crate::stats::{AllocStatus, GroupStats, Stats};
use crate::sync::{lock, may_wait, try_lock, AtomicU64, Mutex, MutexGuard, Ordering, Padded};
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
    /// Shared by every call that changes block ownership, exclusive for reset.
    pub(crate) gate: Gate,
    /// `stats()`'s reserved and used slots of resident sequences, changed under the lock of
    /// the sequence whose footprint changed (Relaxed: tallies read on their own).
    reserved_slots: Padded<AtomicU64>,
    used_slots: Padded<AtomicU64>,
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
        let null = kinds.iter().any(|k| *k != GroupKind::Full);
        if null && config.num_blocks < 2 {
            return Err(invalid(
                "num_blocks must be at least 2 with a group that is not full attention \
                 (block 0 is the null block)",
            ));
        }
        let tagged = config.hash_algo.needs_verified_hits();
        Ok(Self {
            hasher: BlockHasher::new(config.hash_algo, config.hash_seed),
            tagger: tagged.then(HitTagger::random),
            gpu: {
                let pool = BlockPool::new(config.num_blocks, config.enable_kv_events, tagged)?;
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

    fn caching(&self) -> bool {
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

    /// Create a sequence for a prompt, reusing cached prefix blocks. Returns the number of
    /// prompt tokens already cached, or `None` (nothing changed) when the blocks do not fit.
    pub fn allocate(
        &self,
        id: u64,
        tokens: &[u32],
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        lookahead: usize,
    ) -> Result<Option<usize>> {
        self.allocate_owned(id, tokens.to_vec(), cache_salt, lora_id, lookahead)
    }

    /// `allocate` that schedules only the hit plus `num_new_tokens` prompt tokens (chunked
    /// prefill; `extend` schedules the rest).
    pub fn allocate_chunk(
        &self,
        id: u64,
        tokens: &[u32],
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        num_new_tokens: usize,
        lookahead: usize,
    ) -> Result<Option<usize>> {
        let mut tokens = tokens.to_vec();
        let new = Some(num_new_tokens);
        self.allocate_from(id, &mut tokens, cache_salt, lora_id, new, lookahead)
    }

    /// `allocate` taking the tokens by value: the binding's conversion is then the only copy
    /// of a long prompt.
    pub fn allocate_owned(
        &self,
        id: u64,
        mut tokens: Vec<u32>,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        lookahead: usize,
    ) -> Result<Option<usize>> {
        self.allocate_from(id, &mut tokens, cache_salt, lora_id, None, lookahead)
    }

    /// `allocate` that moves the tokens out of `tokens` only when it succeeds, so that a
    /// caller can retry with them after `WouldBlock` (or any error). `num_new_tokens`:
    /// prompt tokens to schedule past the hit (`None`: all of them).
    pub fn allocate_from(
        &self,
        id: u64,
        tokens: &mut Vec<u32>,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        num_new_tokens: Option<usize>,
        lookahead: usize,
    ) -> Result<Option<usize>> {
        self.guarded(true, || {
            check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            let k = check_new_tokens(num_new_tokens, n)?;
            let bs = self.block_size();
            // Scheduled tokens for `h` hit blocks, and the blocks they and the lookahead need.
            // Lookahead has no bound but the pool: a reach beyond it simply does not fit.
            let scheduled = |h: usize| (h * bs + k).min(n);
            let total = |h: usize| cdiv(scheduled(h).saturating_add(lookahead), bs);
            let extras: Arc<[u8]> = encode_extras(cache_salt, lora_id).into();
            let digests = if self.caching() {
                self.hasher.hash_chain(tokens, bs, &extras)
            } else {
                Vec::new()
            };
            let tags = match &self.tagger {
                Some(t) if self.caching() => t.tag_chain(tokens, bs, &extras),
                _ => Vec::new(),
            };
            let _gate = self.enter()?;
            self.seqs.create(id, |seq| {
                // Fewest blocks (no hit): beyond the pool nothing fits.
                if total(0) > self.gpu.num_usable() {
                    return Ok(None);
                }
                let max_hits = if self.caching() { (n - 1) / bs } else { 0 };
                let keys = chain_lock(&digests);
                let _prefix = self.lock_prefixes(keys)?;
                if !self.plain() {
                    let Some((tables, hits)) =
                        self.take_grouped_prompt(&total, max_hits, &digests, &tags)?
                    else {
                        return Ok(None);
                    };
                    *seq = Sequence::new(std::mem::take(tokens), extras, lora_id);
                    self.install_tables(seq, tables);
                    seq.digests = digests;
                    seq.tags = tags;
                    seq.hit_blocks = hits;
                    seq.scheduled = scheduled(hits);
                    self.register_groups(seq, hits..self.registrable(seq));
                    if self.caching() {
                        counters::add(&self.counters.prefix_queries, n);
                        counters::add(&self.counters.prefix_hits, hits * bs);
                        self.recent.record(n, hits * bs);
                    }
                    self.account((0, 0), seq.footprint(bs));
                    return Ok(Some(hits * bs));
                }
                let Some((blocks, hits)) =
                    self.take_prompt_blocks(&total, max_hits, &digests, &tags)?
                else {
                    return Ok(None);
                };
                *seq = Sequence::new(std::mem::take(tokens), extras, lora_id);
                blocks.into_iter().for_each(|b| seq.push_block(b));
                seq.digests = digests;
                seq.tags = tags;
                seq.hit_blocks = hits;
                seq.scheduled = scheduled(hits);
                let full = self.registrable(seq);
                self.gpu
                    .warm_index(&seq.digests[hits..full], &seq.blocks[hits..full]);
                self.register(seq, hits..full);
                if self.caching() {
                    counters::add(&self.counters.prefix_queries, n);
                    counters::add(&self.counters.prefix_hits, hits * bs);
                    self.recent.record(n, hits * bs);
                }
                self.account((0, 0), seq.footprint(bs));
                Ok(Some(hits * bs))
            })
        })
    }

    /// The `total(h)` blocks of a new prompt with `h` hits: its cached prefix (at most
    /// `max_hits` blocks, pinned) then fresh ones. `total` never falls as `h` grows and
    /// exceeds `h`. Returns the blocks with the number of hits, or `None` when they do not
    /// fit; then, and on an error, every block pinned here is given back as it was.
    fn take_prompt_blocks(
        &self,
        total: &dyn Fn(usize) -> usize,
        max_hits: usize,
        digests: &[Digest],
        tags: &[crate::hashing::Tag],
    ) -> Result<Option<(Vec<u32>, usize)>> {
        let most = total(max_hits.min(digests.len()));
        let mut blocks = crate::alloc::try_with_capacity(most, "a block table")?;
        // Admission from a read-only look at the index: hits on CACHED blocks cost a unit.
        let (mut peek_hits, mut revivals) = (0, 0);
        for d in digests.iter().take(max_hits) {
            match self.gpu.peek(d) {
                // A hit that would exceed the refcount limit is an error whether or not the
                // rest fits (`pin` checks again: this look is only a snapshot).
                Some(p) if p.full => return Err(refcount_overflow(p.block)),
                Some(p) => {
                    peek_hits += 1;
                    revivals += usize::from(p.cached);
                }
                None => break,
            }
        }
        // total(h) > h, so this cannot underflow.
        let need = total(peek_hits) - peek_hits + revivals;
        if !self.gpu.reserve(need) {
            return Ok(None);
        }
        let mut spare = need;
        let mut revived = Vec::new();
        let mut failure = None;
        for (i, d) in digests[..peek_hits].iter().enumerate() {
            match self.gpu.pin(d, tags.get(i).copied(), &mut spare) {
                Ok(Hit::Pinned { block, revived: r }) => {
                    blocks.push(block);
                    revived.push(r);
                }
                Ok(Hit::Miss | Hit::NoRoom) => break,
                Ok(Hit::Full(b)) => {
                    failure = Some(refcount_overflow(b));
                    break;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let hits = blocks.len();
        // Races may have changed the hits since the peek: settle the difference.
        let new = total(hits) - hits;
        // A failure is checked first, so that no units are reserved for a call that fails.
        if failure.is_some() || (spare < new && !self.gpu.reserve(new - spare)) {
            for (i, (&b, &r)) in blocks.iter().zip(&revived).enumerate().rev() {
                if r {
                    self.gpu.unpin(b, &digests[i])?;
                } else {
                    self.gpu.release(b, Some(&digests[i]))?;
                }
            }
            self.gpu.unreserve(spare);
            return failure.map_or(Ok(None), Err);
        }
        self.gpu.unreserve(spare.saturating_sub(new));
        self.gpu.take_into(new, &mut blocks);
        if let (true, Some(t)) = (hits > 0, self.gpu.tally(0)) {
            counters::add(&t.hit_blocks, hits);
        }
        Ok(Some((blocks, hits)))
    }

    /// The number of leading blocks of `seq` that are full of scheduled tokens: those that
    /// are (or were offered to be) registered.
    pub(crate) fn registrable(&self, seq: &Sequence) -> usize {
        (seq.scheduled / self.block_size()).min(seq.digests.len())
    }

    /// The event that stores full block `i` of `seq` on `medium`.
    pub(crate) fn stored_event(&self, seq: &Sequence, i: usize, medium: Medium) -> KvEvent {
        let bs = self.block_size();
        KvEvent::BlockStored {
            block_hash: seq.digests[i],
            parent_block_hash: i.checked_sub(1).map(|p| seq.digests[p]),
            token_ids: seq.tokens[i * bs..(i + 1) * bs].to_vec(),
            lora_id: seq.lora_id,
            medium,
            group: 0,
        }
    }

    /// Register the full blocks `range` of `seq` under their digests (`seq.digests[i]`), and
    /// count those that were new with one update of the shared counter.
    pub(crate) fn register(&self, seq: &Sequence, range: std::ops::Range<usize>) {
        let mut new = 0;
        for i in range {
            let event = || self.stored_event(seq, i, Medium::Gpu);
            new += usize::from(
                self.gpu
                    .register(seq.blocks[i], seq.digests[i], seq.tag(i), event),
            );
        }
        if new > 0 {
            counters::add(&self.counters.registered_blocks, new);
            if let Some(t) = self.gpu.tally(0) {
                counters::add(&t.registered, new);
            }
        }
    }

    /// Release a table's blocks, tail first.
    pub(crate) fn release_blocks(&self, blocks: &[u32], digests: &[Digest]) -> Result<()> {
        self.gpu.release_table(blocks, digests)
    }

    /// Blocks that writing positions `from .. to` of `seq` needs: copy-on-write copies of
    /// the shared table entries it covers plus new blocks past the table.
    pub(crate) fn write_need(&self, seq: &Sequence, from: usize, to: usize) -> usize {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        let shared = (from / bs..end.min(seq.blocks.len()))
            .filter(|&i| self.gpu.state(seq.blocks[i]).load().rc() > 1)
            .count();
        shared + end.saturating_sub(seq.blocks.len())
    }

    /// Blocks that appending `k` tokens and reserving `lookahead` slots past them needs.
    pub(crate) fn append_need(&self, seq: &Sequence, k: usize, lookahead: usize) -> usize {
        let n = seq.tokens.len();
        self.write_need(seq, n, (n + k).saturating_add(lookahead))
    }

    /// Room for `k` more tokens in `seq`, reserved before an append changes anything, so that
    /// running out of memory is an error that changed nothing.
    pub(crate) fn reserve_tokens(&self, seq: &mut Sequence, k: usize) -> Result<()> {
        crate::alloc::try_grow(&mut seq.tokens, k, "a sequence's tokens")
    }

    /// Make positions `from .. to` of `seq` writable with the `write_need` units the caller
    /// reserved in `spare`: copy the shared table entries (pairs to `pairs`), add blocks.
    /// Unused units stay in `spare`.
    pub(crate) fn write_reserved(
        &self,
        seq: &mut Sequence,
        from: usize,
        to: usize,
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        for i in from / bs..end.min(seq.blocks.len()) {
            let src = seq.blocks[i];
            // Another holder may have dropped its reference since `write_need` (refcounts of
            // a locked sequence's blocks only fall): then the block is ours to write.
            if self.gpu.state(src).load().rc() > 1 {
                *spare = spare
                    .checked_sub(1)
                    .ok_or_else(|| Error::Broken("copy-on-write beyond its reservation".into()))?;
                let dst = self.gpu.take();
                pairs.push((src, dst));
                seq.replace_block(i, dst);
                self.gpu.release(src, seq.digests.get(i))?;
                counters::add(&self.counters.cow_copies, 1);
            }
        }
        while seq.blocks.len() < end {
            *spare = spare
                .checked_sub(1)
                .ok_or_else(|| Error::Broken("a write beyond its reservation".into()))?;
            seq.push_block(self.gpu.take());
        }
        Ok(())
    }

    /// Append `tokens` (and make `lookahead` slots past them writable) to a sequence whose
    /// `append_need` units the caller reserved in `spare`, and whose token room
    /// `reserve_tokens` reserved; copy-on-write pairs go to `pairs`. Unused units stay in
    /// `spare`.
    pub(crate) fn append_reserved(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        lookahead: usize,
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let n = seq.tokens.len();
        let m = n + tokens.len();
        self.write_reserved(seq, n, m.saturating_add(lookahead), spare, pairs)?;
        // The caller reserved the room (`reserve_tokens`): this cannot fail half way.
        seq.tokens.extend_from_slice(tokens);
        self.extend_digests(seq);
        self.schedule_to(seq, m);
        Ok(())
    }

    /// Compute the digests (and tags) of blocks that became full of known tokens.
    pub(crate) fn extend_digests(&self, seq: &mut Sequence) {
        if !self.caching() {
            return;
        }
        let bs = self.block_size();
        for i in seq.digests.len()..seq.tokens.len() / bs {
            let parent = i
                .checked_sub(1)
                .map_or_else(|| self.hasher.root(), |p| seq.digests[p]);
            let d = self
                .hasher
                .hash_block(&parent, &seq.tokens[i * bs..(i + 1) * bs], &seq.extras);
            seq.digests.push(d);
            if let Some(t) = &self.tagger {
                let parent = i.checked_sub(1).map_or_else(|| t.root(), |p| seq.tags[p]);
                let tag = t.tag_block(parent, &seq.tokens[i * bs..(i + 1) * bs], &seq.extras);
                seq.tags.push(tag);
            }
        }
    }

    /// Mark the first `upto` tokens scheduled and register the blocks that became full of
    /// scheduled tokens.
    pub(crate) fn schedule_to(&self, seq: &mut Sequence, upto: usize) {
        let before = self.registrable(seq);
        seq.scheduled = upto;
        self.register(seq, before..self.registrable(seq));
    }

    /// The prefix lock that scheduling `seq` up to `upto` tokens, `new` of them appended now,
    /// needs: `Some` when caching is on and a block becomes full of scheduled tokens (and is
    /// then registered). Computed before any change, so that waiting for it can still back
    /// out.
    pub(crate) fn schedule_prefix_key(
        &self,
        seq: &Sequence,
        upto: usize,
        new: &[u32],
    ) -> Option<usize> {
        let bs = self.block_size();
        if !self.caching() || upto / bs <= seq.scheduled / bs {
            return None;
        }
        if let Some(first) = seq.digests.first() {
            return Some(prefix_lock_of(first));
        }
        let have = seq.tokens.len().min(bs);
        let mut block = seq.tokens[..have].to_vec();
        block.extend_from_slice(&new[..bs - have]);
        let first = self
            .hasher
            .hash_block(&self.hasher.root(), &block, &seq.extras);
        Some(prefix_lock_of(&first))
    }

    /// Add generated tokens. Returns the copy-on-write pairs, or `None` when the blocks do
    /// not fit (nothing changed).
    pub fn append(&self, id: u64, tokens: &[u32]) -> Result<Option<Vec<(u32, u32)>>> {
        self.append_lookahead(id, tokens, 0)
    }

    /// `append` that also makes `lookahead` slots past the new tokens writable (draft tokens
    /// of speculative decoding).
    pub fn append_lookahead(
        &self,
        id: u64,
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        if tokens.is_empty() {
            return Err(invalid("token_ids must not be empty"));
        }
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            check_append(id, seq.tokens.len(), seq.scheduled, tokens.len())?;
            let upto = seq.tokens.len() + tokens.len();
            if !self.plain() {
                let req = StepReq {
                    new: tokens,
                    m: upto,
                    to: upto.saturating_add(lookahead),
                };
                return self.step_grouped(&mut [seq], &[req], None);
            }
            self.reserve_tokens(seq, tokens.len())?;
            let keys = self
                .schedule_prefix_key(seq, upto, tokens)
                .into_iter()
                .collect();
            let _prefix = self.lock_prefixes(keys)?;
            let need = self.append_need(seq, tokens.len(), lookahead);
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pairs = Vec::new();
            self.append_reserved(seq, tokens, lookahead, &mut spare, &mut pairs)?;
            self.gpu.unreserve(spare);
            Ok(Some(pairs))
        })
    }

    /// Schedule the next `k` tokens of the known prompt (chunked prefill), making `lookahead`
    /// slots past them writable. Returns the copy-on-write pairs, or `None` when the blocks
    /// do not fit (nothing changed).
    pub fn extend(&self, id: u64, k: usize, lookahead: usize) -> Result<Option<Vec<(u32, u32)>>> {
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            check_extend(id, seq.tokens.len(), seq.scheduled, k)?;
            let from = seq.scheduled;
            let upto = from + k;
            if !self.plain() {
                let req = StepReq {
                    new: &[],
                    m: upto,
                    to: upto.saturating_add(lookahead),
                };
                return self.step_grouped(&mut [seq], &[req], None);
            }
            let keys = self
                .schedule_prefix_key(seq, upto, &[])
                .into_iter()
                .collect();
            let _prefix = self.lock_prefixes(keys)?;
            let to = upto.saturating_add(lookahead);
            let need = self.write_need(seq, from, to);
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pairs = Vec::new();
            self.write_reserved(seq, from, to, &mut spare, &mut pairs)?;
            self.schedule_to(seq, upto);
            self.gpu.unreserve(spare);
            Ok(Some(pairs))
        })
    }

    /// Drop every token past `m` and the table entries past them (their blocks are released
    /// tail first; hashed ones stay cached). A hashed block left partial is withdrawn from
    /// the cache when this sequence holds it alone, else copied (it must not be written).
    /// Returns the copy-on-write pairs, or `None` when a needed copy does not fit (nothing
    /// changed).
    pub fn truncate(&self, id: u64, m: usize) -> Result<Option<Vec<(u32, u32)>>> {
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            let n = seq.tokens.len();
            if m == 0 || m > n {
                return Err(invalid(format!(
                    "num_tokens {m} for sequence {id} must be in 1..={n}"
                )));
            }
            if !self.plain() {
                return self.truncate_grouped(id, seq, m);
            }
            let bs = self.block_size();
            let last = m / bs;
            let partial = (m % bs != 0)
                .then(|| seq.blocks.get(last).copied())
                .flatten()
                .filter(|&b| self.gpu.state(b).load().hashed());
            // A hashed partial block was full: its digest is `digests[last]`. Withdrawing it
            // is the only change before the copy's reservation, and only a refusal leads on.
            let copy = match partial {
                Some(b) if !self.gpu.retract(b, &seq.digests[last], true) => {
                    if !self.gpu.reserve(1) {
                        return Ok(None);
                    }
                    Some(b)
                }
                _ => None,
            };
            let keep = cdiv(m, bs).min(seq.blocks.len());
            let dropped = seq.truncate_blocks(keep);
            self.release_blocks(&dropped, seq.digests.get(keep..).unwrap_or_default())?;
            counters::add(&self.counters.truncated_blocks, dropped.len());
            let mut pairs = Vec::new();
            if let Some(src) = copy {
                let dst = self.gpu.take();
                pairs.push((src, dst));
                seq.replace_block(last, dst);
                self.gpu.release(src, Some(&seq.digests[last]))?;
                counters::add(&self.counters.cow_copies, 1);
            }
            seq.tokens.truncate(m);
            seq.digests.truncate(seq.digests.len().min(last));
            seq.tags.truncate(seq.tags.len().min(last));
            seq.scheduled = seq.scheduled.min(m);
            seq.hit_blocks = seq.hit_blocks.min(last);
            Ok(Some(pairs))
        })
    }

    /// Share every block of `parent` with a new sequence `child`.
    ///
    /// Holds the parent's lock while it creates the child, but never waits for the child's
    /// cell meanwhile: a pending or dying child cell (another call creating or freeing the
    /// id) makes it let go of the parent, wait for that cell, and start again. Waiting with
    /// the parent held would close a cycle with a batch call that holds the child's cell and
    /// waits for the parent's (docs/concurrency.md, "Lock order").
    pub fn fork(&self, parent: u64, child: u64) -> Result<()> {
        loop {
            let busy = self.with_seq(parent, true, |seq| {
                if seq.is_swapped() {
                    return Err(Error::Swapped(parent));
                }
                let attempt = self.seqs.try_create(child, |copy| {
                    if !self.plain() {
                        self.share_all(seq)?;
                        *copy = seq.clone();
                        self.account((0, 0), copy.footprint(self.block_size()));
                        return Ok(Some(()));
                    }
                    for (i, &b) in seq.blocks.iter().enumerate() {
                        if self.gpu.state(b).share().is_err() {
                            // Undo the shares taken so far: the parent still holds each of
                            // those blocks, so these releases only lower the count back.
                            self.release_blocks(&seq.blocks[..i], &seq.digests)?;
                            return Err(refcount_overflow(b));
                        }
                    }
                    *copy = seq.clone();
                    self.account((0, 0), copy.footprint(self.block_size()));
                    Ok(Some(()))
                });
                match attempt {
                    Attempt::Done(out) => out.map(|_| None),
                    Attempt::Busy(cell, _) => Ok(Some(cell)),
                }
            })?;
            match busy {
                None => return Ok(()),
                // Nothing held now: not the parent, not the gate.
                Some(cell) => wait_settled(&cell)?,
            }
        }
    }

    /// Forget a sequence, releasing its blocks tail first.
    pub fn free(&self, id: u64) -> Result<()> {
        self.free_computed(id, None)
    }

    /// `free` of a sequence of which only the first `num_computed_tokens` have KV (`None`:
    /// every scheduled token): the blocks past them that it registered leave the prefix
    /// cache (other holders keep them as ordinary blocks) instead of staying cached.
    pub fn free_computed(&self, id: u64, num_computed_tokens: Option<usize>) -> Result<()> {
        self.guarded(true, || {
            let _gate = self.enter()?;
            let cell = self.seqs.get(id).ok_or(Error::UnknownSequence(id))?;
            let mut seq = lock_cell(&cell)?;
            if !cell.is_live() {
                return Err(Error::UnknownSequence(id));
            }
            if let Some(c) = num_computed_tokens {
                let n = seq.tokens.len();
                if c > n {
                    return Err(invalid(format!(
                        "num_computed_tokens {c} for sequence {id} must be in 0..={n}"
                    )));
                }
                if !seq.is_swapped() {
                    // Under the prefix lock, so a hit or lookup of the same prefix sees the
                    // chain before or after the whole withdrawal, never half of it.
                    let keys = chain_lock(&seq.digests);
                    let _prefix = self.lock_prefixes(keys)?;
                    self.retract_uncomputed(&seq, c);
                }
            }
            self.drop_sequence(id, &cell, &mut seq)
        })
    }

    /// Withdraw from the cache, tail first, the blocks of `seq` past its first `c` tokens
    /// that it registered (not hits): their KV was never written, whoever else holds them
    /// (a fork, or a request that hit them in the same step, read nothing valid either).
    fn retract_uncomputed(&self, seq: &Sequence, c: usize) {
        if !self.plain() {
            return self.retract_grouped(seq, c);
        }
        let from = (c / self.block_size()).max(seq.hit_blocks);
        for i in (from..self.registrable(seq)).rev() {
            if self.gpu.retract(seq.blocks[i], &seq.digests[i], false) {
                counters::add(&self.counters.unregistered_blocks, 1);
            }
        }
    }

    /// Free a live sequence whose cell the caller has locked.
    pub(crate) fn drop_sequence(
        &self,
        id: u64,
        cell: &crate::seq_map::SeqCell,
        seq: &mut Sequence,
    ) -> Result<()> {
        self.account(seq.footprint(self.block_size()), (0, 0));
        self.seqs.remove_locked(id, cell);
        if !self.plain() {
            if seq.is_swapped() {
                self.cpu_copies_removed(seq);
                self.cpu.give_back(&Self::cpu_held(seq));
                seq.cpu_blocks = None;
                seq.cpu_more.clear();
                return Ok(());
            }
            self.release_all_groups(seq)?;
            seq.clear_blocks();
            seq.more.clear();
            return Ok(());
        }
        if let Some(cpu) = seq.cpu_blocks.take() {
            self.cpu.give_back(&cpu);
            self.cpu_copies_removed(seq);
        }
        let blocks = seq.clear_blocks();
        self.release_blocks(&blocks, &seq.digests)
    }

    /// Check `num_new_tokens` against a prompt of `n` tokens (`None`: all of them).
    pub(crate) fn check_new_tokens_of(&self, k: Option<u64>, n: usize) -> Result<usize> {
        check_new_tokens(k.map(|k| usize::try_from(k).unwrap_or(usize::MAX)), n)
    }

    /// The hits `allocate` would pin now for `tokens`, as read-only looks (at most
    /// `(n - 1) / block_size`, stopping at the first miss): nothing changes. The looks run
    /// under the prompt's prefix lock, so they see every allocation's registrations and
    /// every abort's withdrawals of this prefix whole (the chain is hashed first, outside).
    fn cached_prefix(&self, tokens: &[u32], extras: &[u8]) -> Result<Vec<crate::block_pool::Peek>> {
        let bs = self.block_size();
        let mut out = Vec::new();
        if !self.caching() || tokens.len() <= bs {
            return Ok(out);
        }
        let blocks: Vec<&[u32]> = tokens
            .chunks_exact(bs)
            .take((tokens.len() - 1) / bs)
            .collect();
        let mut digests = crate::alloc::try_with_capacity(blocks.len(), "the prompt's digests")?;
        let mut parent = self.hasher.root();
        for block in &blocks {
            parent = self.hasher.hash_block(&parent, block, extras);
            digests.push(parent);
        }
        // Inside the gate: a reset is all before or all after.
        let _gate = self.enter()?;
        let _prefix = self.lock_prefixes(vec![prefix_lock_of(&digests[0])])?;
        let mut tag = self.tagger.as_ref().map(|t| t.root());
        for (d, block) in digests.iter().zip(&blocks) {
            let Some(p) = self.gpu.peek(d) else { break };
            if let (Some(t), Some(prev)) = (&self.tagger, tag) {
                let next = t.tag_block(prev, block, extras);
                if !self.gpu.index_tag_is(p.block, Some(next)) {
                    break;
                }
                tag = Some(next);
            }
            out.push(p);
        }
        Ok(out)
    }

    /// The number of prompt tokens `allocate` would serve from the prefix cache right now.
    /// Touches nothing: no LRU order, no statistics, no events.
    pub fn lookup(
        &self,
        tokens: &[u32],
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<usize> {
        self.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            let extras = encode_extras(cache_salt, lora_id);
            if !self.plain() {
                let (h, _) = self.grouped_prefix(tokens, &extras, None)?;
                return Ok(h * self.block_size());
            }
            Ok(self.cached_prefix(tokens, &extras)?.len() * self.block_size())
        })
    }

    /// `can_allocate` of a prompt, crediting its cached prefix: a hit on an active block
    /// needs no new block (one on a CACHED block still takes one from `available`).
    pub fn can_allocate_prompt(
        &self,
        tokens: &[u32],
        num_new_tokens: Option<u64>,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<AllocStatus> {
        self.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            let k = self.check_new_tokens_of(num_new_tokens, n)?;
            let extras = encode_extras(cache_salt, lora_id);
            if !self.plain() {
                let (_, status) = self.grouped_prefix(tokens, &extras, Some(k))?;
                return Ok(status.unwrap_or(AllocStatus::Never));
            }
            let peeks = self.cached_prefix(tokens, &extras)?;
            let bs = self.block_size();
            let h = peeks.len();
            let total = cdiv((h * bs + k).min(n), bs);
            let need = total - h + peeks.iter().filter(|p| p.cached).count();
            Ok(self.admission_of(total, need))
        })
    }

    /// Whether `num_tokens` could be allocated now (OK), later (LATER) or never (NEVER).
    /// Any count is valid: one beyond the pool (or beyond `MAX_TOKENS`) is NEVER.
    pub fn can_allocate(&self, num_tokens: u64) -> Result<AllocStatus> {
        self.can_allocate_count(num_tokens, None)
    }

    /// `can_allocate` of a prompt of `num_tokens` of which `num_new_tokens` are scheduled
    /// now (`None`: all), crediting no hit.
    pub fn can_allocate_count(
        &self,
        num_tokens: u64,
        num_new_tokens: Option<u64>,
    ) -> Result<AllocStatus> {
        if num_tokens == 0 {
            return Err(invalid("num_tokens must be at least 1"));
        }
        let n = match usize::try_from(num_tokens) {
            Ok(n) if n <= MAX_TOKENS => n,
            _ => {
                if let Some(k) = num_new_tokens {
                    if k == 0 || k > num_tokens {
                        return Err(invalid(format!(
                            "num_new_tokens {k} must be in 1..={num_tokens}"
                        )));
                    }
                }
                return Ok(AllocStatus::Never);
            }
        };
        let k = self.check_new_tokens_of(num_new_tokens, n)?;
        let need = cdiv(k, self.block_size()).saturating_mul(self.kinds.len());
        Ok(self.admission_of(need, need))
    }

    pub(crate) fn admission(&self, need: usize) -> AllocStatus {
        self.admission_of(need, need)
    }

    /// NEVER when `total` blocks exceed the pool less the watermark; else OK when `need`
    /// more blocks fit above it; else LATER.
    pub(crate) fn admission_of(&self, total: usize, need: usize) -> AllocStatus {
        let wm = self.config.watermark_blocks();
        if total.saturating_add(wm) > self.gpu.num_usable() {
            AllocStatus::Never
        } else if self.gpu.num_available() >= need + wm {
            AllocStatus::Ok
        } else {
            AllocStatus::Later
        }
    }

    // Per-sequence queries.

    pub fn block_table(&self, id: u64) -> Result<Vec<u32>> {
        self.block_table_of(id, 0)
    }

    /// Group `group`'s block table of a sequence.
    pub fn block_table_of(&self, id: u64, group: usize) -> Result<Vec<u32>> {
        self.check_group(group)?;
        self.with_seq(id, false, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            Ok(seq.table(group).to_vec())
        })
    }

    pub fn num_tokens(&self, id: u64) -> Result<usize> {
        self.with_seq(id, false, |seq| Ok(seq.tokens.len()))
    }

    pub fn num_scheduled_tokens(&self, id: u64) -> Result<usize> {
        self.with_seq(id, false, |seq| Ok(seq.scheduled))
    }

    pub fn table_digest(&self, id: u64) -> Result<u64> {
        self.with_seq(id, false, |seq| Ok(seq.all_tables_digest()))
    }

    pub fn block_hashes(&self, id: u64) -> Result<Vec<Digest>> {
        self.with_seq(id, false, |seq| Ok(seq.digests.clone()))
    }

    pub fn is_swapped(&self, id: u64) -> Result<bool> {
        self.with_seq(id, false, |seq| Ok(seq.is_swapped()))
    }

    pub fn contains(&self, id: u64) -> bool {
        self.seqs.contains(id)
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.gpu.num_free()
    }

    pub fn num_cached_blocks(&self) -> usize {
        self.gpu.num_cached()
    }

    pub fn num_available_blocks(&self) -> usize {
        self.gpu.num_available()
    }

    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }

    /// Counts and tallies, each read on its own without locks (exact together only when no
    /// call is in flight; see docs/concurrency.md).
    pub fn stats(&self) -> Stats {
        let free = self.gpu.num_free();
        let cached = self.gpu.num_cached();
        let c = &self.counters;
        let recent = self.recent.sums();
        Stats {
            num_blocks: self.gpu.num_blocks(),
            block_size: self.block_size(),
            free_blocks: free,
            used_blocks: self.gpu.num_usable().saturating_sub(free + cached),
            cached_blocks: cached,
            num_cpu_blocks: self.cpu.num_blocks(),
            free_cpu_blocks: self.cpu.num_free(),
            num_sequences: self.seqs.len(),
            prefix_queries: counters::get(&c.prefix_queries),
            prefix_hits: counters::get(&c.prefix_hits),
            evictions: self.gpu.evictions(),
            cow_copies: counters::get(&c.cow_copies),
            swapped_out_blocks: counters::get(&c.swapped_out_blocks),
            swapped_in_blocks: counters::get(&c.swapped_in_blocks),
            // Relaxed: tallies (see the fields).
            reserved_slots: self.reserved_slots.load(Ordering::Relaxed),
            used_slots: self.used_slots.load(Ordering::Relaxed),
            recent_prefix_queries: recent.0,
            recent_prefix_hits: recent.1,
            registered_blocks: counters::get(&c.registered_blocks),
            unregistered_blocks: counters::get(&c.unregistered_blocks),
            truncated_blocks: counters::get(&c.truncated_blocks),
        }
    }

    /// Each group's figures (`groups=` given; empty otherwise). Tallies read on their own.
    pub fn group_stats(&self) -> Vec<GroupStats> {
        if !self.grouped {
            return Vec::new();
        }
        self.kinds
            .iter()
            .enumerate()
            .map(|(g, k)| {
                let t = self.gpu.tally(g as u8);
                let load = |f: fn(&crate::block_pool::GroupTally) -> u64| t.map_or(0, f);
                GroupStats {
                    kind: k.name(),
                    used_blocks: load(|t| t.used.load(Ordering::Relaxed) as u64) as usize,
                    cached_blocks: load(|t| t.cached.load(Ordering::Relaxed) as u64) as usize,
                    hit_blocks: load(|t| counters::get(&t.hit_blocks)),
                    evictions: load(|t| counters::get(&t.evictions)),
                    registered_blocks: load(|t| counters::get(&t.registered)),
                }
            })
            .collect()
    }

    /// Drop every cached block and restart the hit-rate counters (as vLLM does); refuses
    /// (false) while any sequence holds GPU blocks. Waits for calls in flight to finish and
    /// holds new ones back meanwhile, so it is one step against every other call.
    pub fn reset_prefix_cache(&self) -> Result<bool> {
        self.guarded(true, || {
            Ok(self.gate.exclusive(|| {
                let cleared = self.gpu.reset();
                if cleared {
                    counters::reset(&self.counters.prefix_queries);
                    counters::reset(&self.counters.prefix_hits);
                    self.recent.clear();
                }
                cleared
            }))
        })
    }

    pub fn drain_events(&self) -> Vec<KvEvent> {
        self.gpu.drain_events()
    }
}
