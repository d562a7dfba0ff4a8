//! `allocate` and its forms: a new sequence's prompt blocks, its prefix hit first (for
//! KV-cache groups the hybrid hit of `grouped`).

use crate::block_pool::{refcount_overflow, Hit};
use crate::counters;
use crate::error::Result;
use crate::hashing::{encode_extras, Digest};
use crate::manager::{cdiv, chain_lock, check_new_tokens, check_tokens, BlockManager};
use crate::sequence::Sequence;
use std::sync::Arc;

impl BlockManager {
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
    pub(crate) fn take_prompt_blocks(
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
}
