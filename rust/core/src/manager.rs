//! The block manager: sequences and their tables over the GPU pool and the CPU swap space.
//!
//! Locking: each sequence has its own mutex, held for the whole of an operation on it (batch
//! calls hold all of theirs). Nothing else is locked across an operation: block states, the
//! free stacks and the admission counters are atomics, the sequence map and the prefix index
//! are lock-free maps. The only other lock is the LRU queue's, held for one push or pop.

use crate::block_pool::{BlockPool, Hit};
use crate::config::Config;
use crate::counters::{self, Counters};
use crate::cpu_pool::CpuPool;
use crate::error::{invalid, Error, Result};
use crate::events::KvEvent;
use crate::hashing::{encode_extras, BlockHasher, Digest};
use crate::hit_tag::HitTagger;
use crate::id_hasher::BuildIdHasher;
use crate::sequence::Sequence;
use crate::stats::{AllocStatus, Stats};
use crate::sync::{lock, Mutex, MutexGuard};
use std::sync::Arc;

pub(crate) type SeqMap = papaya::HashMap<u64, Arc<Mutex<Sequence>>, BuildIdHasher>;

pub struct BlockManager {
    pub(crate) config: Config,
    pub(crate) hasher: BlockHasher,
    /// Present when the digest is not collision resistant: every hit is then confirmed by a
    /// secret tag of the whole prefix (`hit_tag`, docs/security.md).
    pub(crate) tagger: Option<HitTagger>,
    pub(crate) gpu: BlockPool,
    pub(crate) cpu: CpuPool,
    /// Live sequences. A sequence leaves the map before its blocks are released, and is
    /// marked dead under its lock, so a caller that fetched it earlier sees it gone.
    pub(crate) seqs: SeqMap,
    pub(crate) counters: Counters,
}

pub(crate) fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl BlockManager {
    pub fn new(config: Config) -> Result<Self> {
        config.validate()?;
        Ok(Self {
            hasher: BlockHasher::new(config.hash_algo, config.hash_seed),
            tagger: config
                .hash_algo
                .needs_verified_hits()
                .then(HitTagger::random),
            gpu: BlockPool::new(
                config.num_blocks,
                config.enable_kv_events,
                config.hash_algo.needs_verified_hits(),
            ),
            cpu: CpuPool::new(config.num_cpu_blocks),
            seqs: papaya::HashMap::builder().hasher(BuildIdHasher).build(),
            counters: Counters::default(),
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

    /// Run `f` on a live sequence under its lock.
    pub(crate) fn with_seq<T>(
        &self,
        id: u64,
        f: impl FnOnce(&mut Sequence) -> Result<T>,
    ) -> Result<T> {
        let map = self.seqs.pin();
        let cell = map.get(&id).ok_or(Error::UnknownSequence(id))?;
        let mut seq = lock(cell);
        if !seq.alive {
            return Err(Error::UnknownSequence(id));
        }
        f(&mut seq)
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
        tokens: Vec<u32>,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        lookahead: usize,
    ) -> Result<Option<usize>> {
        if tokens.is_empty() {
            return Err(invalid("token_ids must not be empty"));
        }
        if self.seqs.pin().contains_key(&id) {
            return Err(Error::DuplicateSequence(id));
        }
        let bs = self.block_size();
        let n = tokens.len();
        let total = cdiv(n + lookahead, bs);
        let extras: Arc<[u8]> = encode_extras(cache_salt, lora_id).into();
        let digests = if self.caching() {
            self.hasher.hash_chain(&tokens, bs, &extras)
        } else {
            Vec::new()
        };
        let tags = match &self.tagger {
            Some(t) if self.caching() => t.tag_chain(&tokens, bs, &extras),
            _ => Vec::new(),
        };
        let max_hits = if self.caching() { (n - 1) / bs } else { 0 };

        // Admission from a read-only look at the index: hits on CACHED blocks cost a unit.
        let (mut peek_hits, mut revivals) = (0, 0);
        for d in digests.iter().take(max_hits) {
            match self.gpu.peek(d) {
                Some(cached) => {
                    peek_hits += 1;
                    revivals += usize::from(cached);
                }
                None => break,
            }
        }
        let need = total - peek_hits + revivals;
        if !self.gpu.reserve(need) {
            return Ok(None);
        }
        let mut spare = need;
        let mut seq = Sequence::new(tokens, extras, lora_id);
        for (i, d) in digests[..peek_hits].iter().enumerate() {
            match self.gpu.pin(d, tags.get(i).copied(), &mut spare) {
                Hit::Pinned(b) => seq.push_block(b),
                Hit::Miss | Hit::NoRoom => break,
            }
        }
        let hits = seq.blocks.len();
        // Races may have changed the hits since the peek: settle the difference.
        let new = total - hits;
        if spare < new && !self.gpu.reserve(new - spare) {
            self.release_blocks(&seq.blocks, &digests);
            self.gpu.unreserve(spare);
            return Ok(None);
        }
        self.gpu.unreserve(spare.saturating_sub(new));
        let mut fresh = Vec::with_capacity(new);
        self.gpu.take_into(new, &mut fresh);
        fresh.into_iter().for_each(|b| seq.push_block(b));
        seq.digests = digests;
        seq.tags = tags;
        self.gpu
            .warm_index(&seq.digests[hits..], &seq.blocks[hits..]);
        for i in hits..seq.digests.len() {
            self.register(&seq, i);
        }
        self.insert_new(id, seq)?;
        if self.caching() {
            counters::add(&self.counters.prefix_queries, n);
            counters::add(&self.counters.prefix_hits, hits * bs);
        }
        Ok(Some(hits * bs))
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
    pub(crate) fn release_blocks(&self, blocks: &[u32], digests: &[Digest]) {
        self.gpu.release_table(blocks, digests);
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

    /// Append `tokens` to a sequence whose `append_need` units the caller reserved in
    /// `spare`; copy-on-write pairs go to `pairs`. Unused units stay in `spare`.
    pub(crate) fn append_reserved(
        &self,
        seq: &mut Sequence,
        tokens: &[u32],
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) {
        let bs = self.block_size();
        let n = seq.tokens.len();
        let end = cdiv(n + tokens.len(), bs);
        for i in n / bs..end.min(seq.blocks.len()) {
            let src = seq.blocks[i];
            // Another holder may have dropped its reference since `append_need` (refcounts of
            // a locked sequence's blocks only fall): then the block is ours to write.
            if self.gpu.state(src).load().rc() > 1 {
                let dst = self.gpu.take();
                *spare -= 1;
                pairs.push((src, dst));
                seq.replace_block(i, dst);
                self.gpu.release(src, seq.digests.get(i));
                counters::add(&self.counters.cow_copies, 1);
            }
        }
        while seq.blocks.len() < end {
            seq.push_block(self.gpu.take());
            *spare -= 1;
        }
        seq.tokens.extend_from_slice(tokens);
        if self.caching() {
            self.hash_new_full_blocks(seq);
        }
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
        self.with_seq(id, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            let need = self.append_need(seq, tokens.len());
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pairs = Vec::new();
            self.append_reserved(seq, tokens, &mut spare, &mut pairs);
            self.gpu.unreserve(spare);
            Ok(Some(pairs))
        })
    }

    /// Share every block of `parent` with a new sequence `child`.
    pub fn fork(&self, parent: u64, child: u64) -> Result<()> {
        let copy = self.with_seq(parent, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(parent));
            }
            if self.seqs.pin().contains_key(&child) {
                return Err(Error::DuplicateSequence(child));
            }
            seq.blocks.iter().for_each(|&b| self.gpu.state(b).share());
            Ok(seq.clone())
        })?;
        self.insert_new(child, copy)
    }

    /// Publish a new sequence whose blocks are already held; if the id was taken meanwhile
    /// (a racing allocate or fork), release them again.
    fn insert_new(&self, id: u64, seq: Sequence) -> Result<()> {
        let map = self.seqs.pin();
        match map.try_insert(id, Arc::new(Mutex::new(seq))) {
            Ok(_) => Ok(()),
            Err(occupied) => {
                let seq = lock(&occupied.not_inserted);
                self.release_blocks(&seq.blocks, &seq.digests);
                Err(Error::DuplicateSequence(id))
            }
        }
    }

    /// Forget a sequence, releasing its blocks tail first.
    pub fn free(&self, id: u64) -> Result<()> {
        let cell = self
            .seqs
            .pin()
            .remove(&id)
            .cloned()
            .ok_or(Error::UnknownSequence(id))?;
        let mut seq = lock(&cell);
        self.drop_sequence(&mut seq);
        Ok(())
    }

    fn drop_sequence(&self, seq: &mut MutexGuard<'_, Sequence>) {
        seq.alive = false;
        if let Some(cpu) = seq.cpu_blocks.take() {
            self.cpu.give_back(&cpu);
        }
        let blocks = seq.clear_blocks();
        self.release_blocks(&blocks, &seq.digests);
    }

    pub fn can_allocate(&self, num_tokens: usize) -> Result<AllocStatus> {
        if num_tokens == 0 {
            return Err(invalid("num_tokens must be at least 1"));
        }
        Ok(self.admission(cdiv(num_tokens, self.block_size())))
    }

    pub(crate) fn admission(&self, need: usize) -> AllocStatus {
        let wm = self.config.watermark_blocks();
        if need + wm > self.gpu.num_blocks() {
            AllocStatus::Never
        } else if self.gpu.num_available() >= need + wm {
            AllocStatus::Ok
        } else {
            AllocStatus::Later
        }
    }

    // Per-sequence queries.

    pub fn block_table(&self, id: u64) -> Result<Vec<u32>> {
        self.with_seq(id, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            Ok(seq.blocks.clone())
        })
    }

    pub fn num_tokens(&self, id: u64) -> Result<usize> {
        self.with_seq(id, |seq| Ok(seq.tokens.len()))
    }

    pub fn table_digest(&self, id: u64) -> Result<u64> {
        self.with_seq(id, |seq| Ok(seq.table_digest))
    }

    pub fn block_hashes(&self, id: u64) -> Result<Vec<Digest>> {
        self.with_seq(id, |seq| Ok(seq.digests.clone()))
    }

    pub fn is_swapped(&self, id: u64) -> Result<bool> {
        self.with_seq(id, |seq| Ok(seq.is_swapped()))
    }

    pub fn contains(&self, id: u64) -> bool {
        self.seqs.pin().contains_key(&id)
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

    pub fn stats(&self) -> Stats {
        let (mut reserved, mut used) = (0u64, 0u64);
        let map = self.seqs.pin();
        for (_, cell) in map.iter() {
            let seq = lock(cell);
            if seq.alive && !seq.is_swapped() {
                reserved += (seq.blocks.len() * self.block_size()) as u64;
                used += seq.tokens.len() as u64;
            }
        }
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
            num_sequences: map.len(),
            prefix_queries: counters::get(&c.prefix_queries),
            prefix_hits: counters::get(&c.prefix_hits),
            evictions: self.gpu.evictions(),
            cow_copies: counters::get(&c.cow_copies),
            swapped_out_blocks: counters::get(&c.swapped_out_blocks),
            swapped_in_blocks: counters::get(&c.swapped_in_blocks),
            reserved_slots: reserved,
            used_slots: used,
        }
    }

    /// Drop every cached block; refuses (false) while any sequence holds GPU blocks.
    pub fn reset_prefix_cache(&self) -> bool {
        self.gpu.reset()
    }

    pub fn drain_events(&self) -> Vec<KvEvent> {
        self.gpu.drain_events()
    }
}
