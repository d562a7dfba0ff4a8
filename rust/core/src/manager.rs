//! The block manager: sequences and their tables over the GPU pool and the CPU swap space.
//!
//! Locking: each sequence has its own mutex, held for the whole of an operation on it (batch
//! calls hold all of theirs). Every call that changes block ownership is inside the reset
//! gate (shared; `reset_prefix_cache` enters it exclusive). Nothing else is locked across an
//! operation: block states, the free stacks and the admission counters are atomics, the
//! sequence map and the prefix index are lock-free maps. The other locks are short: the LRU
//! queue's (one push or pop) and a digest stripe's (one registration or eviction).

use crate::block_pool::{refcount_overflow, BlockPool, Hit};
use crate::config::Config;
use crate::counters::{self, Counters};
use crate::cpu_pool::CpuPool;
use crate::error::{invalid, Error, Result};
use crate::events::KvEvent;
use crate::gate::{Gate, Shared};
use crate::hashing::{encode_extras, BlockHasher, Digest};
use crate::hit_tag::HitTagger;
use crate::seq_map::{lock_cell, SeqMap};
use crate::sequence::Sequence;
use crate::stats::{AllocStatus, Stats};
use crate::sync::{lock, may_wait, try_lock, AtomicBool, AtomicU64, Mutex, MutexGuard, Ordering};
use std::panic::{catch_unwind, AssertUnwindSafe};
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
    pub(crate) counters: Counters,
    /// Shared by every call that changes block ownership, exclusive for reset.
    pub(crate) gate: Gate,
    /// `stats()`'s reserved and used slots of resident sequences, changed under the lock of
    /// the sequence whose footprint changed (Relaxed: tallies read on their own).
    reserved_slots: AtomicU64,
    used_slots: AtomicU64,
    /// `prefix_locks[k]` serialises every call that looks up or registers blocks of prompts
    /// whose first block's digest maps to `k` (`prefix_lock_of`): an allocation holds it from
    /// its first hit to its last registration, an append or swap-in while it registers. Chain
    /// digests depend on the first block, so calls under different locks never touch the
    /// same digests, and two calls on one prefix see each other's registrations whole: the
    /// later of two identical prompts hits what the earlier registered. Taken after the
    /// sequence locks and before the LRU and stripe locks; holders wait for nothing else.
    prefix_locks: Box<[Mutex<()>]>,
    /// Set when an internal invariant failed mid-operation; never cleared. Relaxed: a flag
    /// checked on its own; the message is under its own lock.
    broken: AtomicBool,
    broken_reason: Mutex<String>,
}

/// Number of prefix locks (see the field).
const PREFIX_LOCKS: usize = 64;

pub(crate) fn prefix_lock_of(first: &Digest) -> usize {
    first.words()[2] as usize % PREFIX_LOCKS
}

pub(crate) fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl BlockManager {
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        let tagged = config.hash_algo.needs_verified_hits();
        Ok(Self {
            hasher: BlockHasher::new(config.hash_algo, config.hash_seed),
            tagger: tagged.then(HitTagger::random),
            gpu: BlockPool::new(config.num_blocks, config.enable_kv_events, tagged)?,
            cpu: CpuPool::new(config.num_cpu_blocks)?,
            seqs: SeqMap::new(),
            counters: Counters::default(),
            gate: Gate::new(),
            reserved_slots: AtomicU64::new(0),
            used_slots: AtomicU64::new(0),
            prefix_locks: crate::alloc::try_boxed(PREFIX_LOCKS, |_| Mutex::new(()), "locks")?,
            broken: AtomicBool::new(false),
            broken_reason: Mutex::new(String::new()),
            config,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    fn caching(&self) -> bool {
        self.config.enable_prefix_caching
    }

    /// Run one public call: a panic or a `Broken` error marks the manager broken (its state
    /// may be half changed) and comes back as `Error::Broken`; a broken manager refuses
    /// every later call that changes state (`mutating`), before doing anything.
    pub(crate) fn guarded<T>(&self, mutating: bool, f: impl FnOnce() -> Result<T>) -> Result<T> {
        if mutating && self.broken.load(Ordering::Relaxed) {
            return Err(Error::Broken(lock(&self.broken_reason).clone()));
        }
        let out = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(out) => out,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".to_owned());
                Err(Error::Broken(format!("internal error: {what}")))
            }
        };
        if let Err(Error::Broken(reason)) = &out {
            let mut slot = lock(&self.broken_reason);
            if slot.is_empty() {
                slot.clone_from(reason);
            }
            self.broken.store(true, Ordering::Relaxed);
        }
        out
    }

    /// Whether an internal invariant failed (see `guarded`).
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Relaxed)
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

    /// The prefix lock an append of `new` tokens to `seq` needs: `Some` when caching is on
    /// and the append fills a block (which it then registers). Computed before any change,
    /// so that waiting for it can still back out.
    pub(crate) fn append_prefix_key(&self, seq: &Sequence, new: &[u32]) -> Option<usize> {
        let bs = self.block_size();
        if !self.caching() || (seq.tokens.len() + new.len()) / bs <= seq.digests.len() {
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

    /// Argument checks shared by the calls that take tokens.
    pub(crate) fn check_tokens(&self, tokens: &[u32], what: &str) -> Result<()> {
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
        self.allocate_from(id, &mut tokens, cache_salt, lora_id, lookahead)
    }

    /// `allocate` that moves the tokens out of `tokens` only when it succeeds, so that a
    /// caller can retry with them after `WouldBlock` (or any error).
    pub fn allocate_from(
        &self,
        id: u64,
        tokens: &mut Vec<u32>,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        lookahead: usize,
    ) -> Result<Option<usize>> {
        self.guarded(true, || {
            self.check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            // Lookahead has no bound but the pool: a reach beyond it simply does not fit.
            let reach = n.saturating_add(lookahead);
            let bs = self.block_size();
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
            let total = cdiv(reach, bs);
            let _gate = self.enter()?;
            self.seqs.create(id, |seq| {
                if total > self.gpu.num_blocks() {
                    return Ok(None);
                }
                let max_hits = if self.caching() { (n - 1) / bs } else { 0 };
                let keys = digests.first().map(prefix_lock_of).into_iter().collect();
                let _prefix = self.lock_prefixes(keys)?;
                let Some((blocks, hits)) =
                    self.take_prompt_blocks(total, max_hits, &digests, &tags)?
                else {
                    return Ok(None);
                };
                *seq = Sequence::new(std::mem::take(tokens), extras, lora_id);
                blocks.into_iter().for_each(|b| seq.push_block(b));
                seq.digests = digests;
                seq.tags = tags;
                self.gpu
                    .warm_index(&seq.digests[hits..], &seq.blocks[hits..]);
                for i in hits..seq.digests.len() {
                    self.register(seq, i);
                }
                if self.caching() {
                    counters::add(&self.counters.prefix_queries, n);
                    counters::add(&self.counters.prefix_hits, hits * bs);
                }
                self.account((0, 0), seq.footprint(bs));
                Ok(Some(hits * bs))
            })
        })
    }

    /// The `total` blocks of a new prompt: its cached prefix (at most `max_hits` blocks,
    /// pinned) then fresh ones. Returns them with the number of hits, or `None` when they do
    /// not fit; then, and on an error, every block pinned here is given back as it was.
    fn take_prompt_blocks(
        &self,
        total: usize,
        max_hits: usize,
        digests: &[Digest],
        tags: &[crate::hashing::Tag],
    ) -> Result<Option<(Vec<u32>, usize)>> {
        let mut blocks = crate::alloc::try_with_capacity(total, "a block table")?;
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
        // peek_hits <= max_hits < total, so this cannot underflow.
        let need = total - peek_hits + revivals;
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
        let new = total - hits;
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
        Ok(Some((blocks, hits)))
    }

    /// Register the full block `i` of `seq` under `seq.digests[i]`.
    pub(crate) fn register(&self, seq: &Sequence, i: usize) {
        let digest = seq.digests[i];
        let bs = self.block_size();
        self.gpu
            .register(seq.blocks[i], digest, seq.tag(i), || KvEvent::BlockStored {
                block_hash: digest,
                parent_block_hash: i.checked_sub(1).map(|p| seq.digests[p]),
                token_ids: seq.tokens[i * bs..(i + 1) * bs].to_vec(),
                lora_id: seq.lora_id,
            });
    }

    /// Release a table's blocks, tail first.
    pub(crate) fn release_blocks(&self, blocks: &[u32], digests: &[Digest]) -> Result<()> {
        self.gpu.release_table(blocks, digests)
    }

    /// Blocks that appending `k` tokens needs: copy-on-write copies plus new blocks.
    pub(crate) fn append_need(&self, seq: &Sequence, k: usize) -> usize {
        let bs = self.block_size();
        let n = seq.tokens.len();
        let end = cdiv(n + k, bs);
        let shared = (n / bs..end.min(seq.blocks.len()))
            .filter(|&i| self.gpu.state(seq.blocks[i]).load().rc() > 1)
            .count();
        shared + end.saturating_sub(seq.blocks.len())
    }

    /// Argument check of an append of `k` tokens to `seq` (`id`): the sequence stays within
    /// `MAX_TOKENS`.
    pub(crate) fn check_append_len(&self, id: u64, seq: &Sequence, k: usize) -> Result<()> {
        match seq.tokens.len().checked_add(k) {
            Some(total) if total <= MAX_TOKENS => Ok(()),
            _ => Err(invalid(format!(
                "appending {k} tokens to sequence {id} ({} tokens) exceeds the {MAX_TOKENS} a \
                 sequence may hold",
                seq.tokens.len()
            ))),
        }
    }

    /// Room for `k` more tokens in `seq`, reserved before an append changes anything, so that
    /// running out of memory is an error that changed nothing.
    pub(crate) fn reserve_tokens(&self, seq: &mut Sequence, k: usize) -> Result<()> {
        crate::alloc::try_grow(&mut seq.tokens, k, "a sequence's tokens")
    }

    /// Append `tokens` to a sequence whose `append_need` units the caller reserved in
    /// `spare`, and whose token room `reserve_tokens` reserved; copy-on-write pairs go to `pairs`. Unused units stay in `spare`.
    pub(crate) fn append_reserved(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let bs = self.block_size();
        let n = seq.tokens.len();
        let end = cdiv(n + tokens.len(), bs);
        for i in n / bs..end.min(seq.blocks.len()) {
            let src = seq.blocks[i];
            // Another holder may have dropped its reference since `append_need` (refcounts of
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
                .ok_or_else(|| Error::Broken("append beyond its reservation".into()))?;
            seq.push_block(self.gpu.take());
        }
        // The caller reserved the room (`reserve_tokens`): this cannot fail half way.
        seq.tokens.extend_from_slice(tokens);
        if self.caching() {
            self.hash_new_full_blocks(seq);
        }
        Ok(())
    }

    /// Compute the digests of blocks that became full and register them.
    pub(crate) fn hash_new_full_blocks(&self, seq: &mut Sequence) {
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
            self.register(seq, i);
        }
    }

    /// Add generated tokens. Returns the copy-on-write pairs, or `None` when the blocks do
    /// not fit (nothing changed).
    pub fn append(&self, id: u64, tokens: &[u32]) -> Result<Option<Vec<(u32, u32)>>> {
        if tokens.is_empty() {
            return Err(invalid("token_ids must not be empty"));
        }
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            self.check_append_len(id, seq, tokens.len())?;
            self.reserve_tokens(seq, tokens.len())?;
            let keys = self.append_prefix_key(seq, tokens).into_iter().collect();
            let _prefix = self.lock_prefixes(keys)?;
            let need = self.append_need(seq, tokens.len());
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pairs = Vec::new();
            self.append_reserved(seq, tokens, &mut spare, &mut pairs)?;
            self.gpu.unreserve(spare);
            Ok(Some(pairs))
        })
    }

    /// Share every block of `parent` with a new sequence `child`.
    pub fn fork(&self, parent: u64, child: u64) -> Result<()> {
        self.with_seq(parent, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(parent));
            }
            self.seqs
                .create(child, |copy| {
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
                })
                .map(|_| ())
        })
    }

    /// Forget a sequence, releasing its blocks tail first.
    pub fn free(&self, id: u64) -> Result<()> {
        self.guarded(true, || {
            let _gate = self.enter()?;
            let cell = self.seqs.get(id).ok_or(Error::UnknownSequence(id))?;
            let mut seq = lock_cell(&cell)?;
            if !cell.is_live() {
                return Err(Error::UnknownSequence(id));
            }
            self.drop_sequence(id, &cell, &mut seq)
        })
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
        if let Some(cpu) = seq.cpu_blocks.take() {
            self.cpu.give_back(&cpu);
        }
        let blocks = seq.clear_blocks();
        self.release_blocks(&blocks, &seq.digests)
    }

    /// Whether `num_tokens` could be allocated now (OK), later (LATER) or never (NEVER).
    /// Any count is valid: one beyond the pool (or beyond `MAX_TOKENS`) is NEVER.
    pub fn can_allocate(&self, num_tokens: u64) -> Result<AllocStatus> {
        if num_tokens == 0 {
            return Err(invalid("num_tokens must be at least 1"));
        }
        Ok(match usize::try_from(num_tokens) {
            Ok(n) if n <= MAX_TOKENS => self.admission(cdiv(n, self.block_size())),
            _ => AllocStatus::Never,
        })
    }

    pub(crate) fn admission(&self, need: usize) -> AllocStatus {
        let wm = self.config.watermark_blocks();
        if need.saturating_add(wm) > self.gpu.num_blocks() {
            AllocStatus::Never
        } else if self.gpu.num_available() >= need + wm {
            AllocStatus::Ok
        } else {
            AllocStatus::Later
        }
    }

    // Per-sequence queries.

    pub fn block_table(&self, id: u64) -> Result<Vec<u32>> {
        self.with_seq(id, false, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            Ok(seq.blocks.clone())
        })
    }

    pub fn num_tokens(&self, id: u64) -> Result<usize> {
        self.with_seq(id, false, |seq| Ok(seq.tokens.len()))
    }

    pub fn table_digest(&self, id: u64) -> Result<u64> {
        self.with_seq(id, false, |seq| Ok(seq.table_digest))
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
        Stats {
            num_blocks: self.gpu.num_blocks(),
            block_size: self.block_size(),
            free_blocks: free,
            used_blocks: self.gpu.num_blocks().saturating_sub(free + cached),
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
        }
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
                }
                cleared
            }))
        })
    }

    pub fn drain_events(&self) -> Vec<KvEvent> {
        self.gpu.drain_events()
    }
}
