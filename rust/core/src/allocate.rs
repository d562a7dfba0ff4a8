//! `allocate` and its forms: a new sequence's prompt blocks, its prefix hit first (for
//! KV-cache groups the hybrid hit of `grouped`).

use crate::block_pool::{refcount_overflow, Hit};
use crate::counters;
use crate::error::Result;
use crate::hashing::{encode_extras, Digest, Tag};
use crate::keys::{check_key_count, PromptKeys};
use crate::manager::{cdiv, chain_lock, check_new_tokens, check_tokens, BlockManager};
use crate::retention::RetentionSpec;
use crate::sequence::Sequence;
use std::sync::Arc;

/// `allocate`'s options (`allocate_with`).
#[derive(Debug, Clone, Copy)]
pub struct AllocateOpts<'a> {
    /// Extra keys or the caller's keys, and the cap on the hit.
    pub keys: PromptKeys<'a>,
    /// Prompt tokens to schedule past the hit (`None`: all of them).
    pub num_new_tokens: Option<usize>,
    /// Writable slots past the scheduled tokens.
    pub lookahead: usize,
    /// `false`: held registration; the blocks scheduled past the hit are registered only by
    /// `register` (KV arriving from elsewhere).
    pub register: bool,
    /// Retention of the sequence's blocks (`retention`; the priority policy only).
    pub retention: Option<&'a RetentionSpec>,
    /// Token positions (at most the prompt's length) a later hit can resume at: under
    /// sparse retention (`Config::prefix_cache_retention_interval`) the window groups cache
    /// the blocks a hit there reads (`policy::reach`). `None`: the prompt less one token.
    pub reachable: Option<&'a [usize]>,
}

impl Default for AllocateOpts<'_> {
    fn default() -> Self {
        Self {
            keys: PromptKeys::default(),
            num_new_tokens: None,
            lookahead: 0,
            register: true,
            retention: None,
            reachable: None,
        }
    }
}

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
        let opts = AllocateOpts {
            keys: PromptKeys {
                cache_salt,
                lora_id,
                ..PromptKeys::default()
            },
            num_new_tokens,
            lookahead,
            register: true,
            retention: None,
            reachable: None,
        };
        self.allocate_with(id, tokens, &opts)
    }

    /// `allocate_from` with every option: the caller's keys (`block_hashes`), a cap on the
    /// hit (`max_hit_tokens`) and held registration (`register: false`).
    pub fn allocate_with(
        &self,
        id: u64,
        tokens: &mut Vec<u32>,
        opts: &AllocateOpts<'_>,
    ) -> Result<Option<usize>> {
        self.guarded(true, || {
            check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            let k = check_new_tokens(opts.num_new_tokens, n)?;
            let q = &opts.keys;
            q.check()?;
            q.check_loaded(n, k)?;
            self.check_retention_allowed(opts.retention)?;
            if let Some(&p) = opts.reachable.and_then(|r| r.iter().find(|&&p| p > n)) {
                return Err(crate::error::invalid(format!(
                    "reachable position {p} is past the prompt's {n} tokens"
                )));
            }
            let reachable: Option<Arc<[usize]>> = self.sparse_windows().then(|| {
                opts.reachable
                    .map_or_else(|| vec![n - 1].into(), Into::into)
            });
            let lookahead = opts.lookahead;
            let bs = self.block_size();
            // Scheduled tokens for `h` hit blocks, and the blocks they and the lookahead need.
            // Lookahead has no bound but the pool: a reach beyond it simply does not fit.
            let scheduled = |h: usize| (h * bs + k).min(n);
            let total = |h: usize| cdiv(scheduled(h).saturating_add(lookahead), bs);
            let extras: Arc<[u8]> = encode_extras(q.cache_salt, q.lora_id).into();
            let (digests, tags) = match q.block_hashes {
                Some(keys) => {
                    let keys = self.reduce_keys(keys)?;
                    check_key_count(keys.given, n, bs)?;
                    (keys.digests, keys.tags)
                }
                None => self.prompt_chain(tokens, &extras),
            };
            let _gate = self.enter()?;
            self.seqs.create(id, |seq| {
                // One full-attention group holds `total(h) >= total(0)` blocks: beyond the
                // pool nothing fits. Other groups hold only what they need past the hit
                // (`take_grouped_prompt` checks that), which may be less than the prompt.
                if self.plain() && total(0) > self.gpu.num_usable() {
                    return Ok(None);
                }
                // Before the first hit: its tenant stays while the call runs (`registry`).
                let tenant = self.hold_tenant(q.cache_salt);
                let max_hits = self.hit_cap(n, q.max_hit_tokens);
                let keys = chain_lock(&digests);
                let _prefix = self.lock_prefixes(keys)?;
                let new_seq = |tokens: &mut Vec<u32>, hits: usize| {
                    let mut s = Sequence::new(std::mem::take(tokens), extras.clone(), q.lora_id);
                    s.keyed = q.block_hashes.is_some();
                    let prompt = s.tokens.len();
                    s.set_retention(opts.retention.map(|r| Arc::new((r.clone(), prompt))));
                    s.set_tenant(tenant.id());
                    s.set_reachable(reachable.clone());
                    if !opts.register {
                        // Blocks fit a u32 (tokens fit an i32): the cast is exact.
                        s.hold = hits as u32;
                    }
                    s
                };
                if !self.plain() {
                    let Some((tables, hits)) =
                        self.take_grouped_prompt(&total, max_hits, q.resume(n), &digests, &tags)?
                    else {
                        return Ok(None);
                    };
                    *seq = new_seq(tokens, hits);
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
                        self.record_tenant_hits(seq.tenant(), n, hits * bs);
                    }
                    self.account((0, 0), seq.footprint(bs));
                    tenant.keep();
                    return Ok(Some(hits * bs));
                }
                let Some((blocks, hits)) =
                    self.take_prompt_blocks(&total, max_hits, &digests, &tags)?
                else {
                    return Ok(None);
                };
                *seq = new_seq(tokens, hits);
                blocks.into_iter().for_each(|b| seq.push_block(b));
                seq.digests = digests;
                seq.tags = tags;
                seq.hit_blocks = hits;
                seq.scheduled = scheduled(hits);
                let full = self.registrable(seq);
                self.gpu
                    .warm_index(&seq.digests[hits..full], &seq.blocks[hits..full]);
                self.register_range(seq, hits..full);
                if self.caching() {
                    counters::add(&self.counters.prefix_queries, n);
                    counters::add(&self.counters.prefix_hits, hits * bs);
                    self.recent.record(n, hits * bs);
                    self.record_tenant_hits(seq.tenant(), n, hits * bs);
                }
                self.account((0, 0), seq.footprint(bs));
                tenant.keep();
                Ok(Some(hits * bs))
            })
        })
    }

    /// The digests and tags of a prompt's full blocks hashed from its tokens (none with
    /// prefix caching off).
    pub(crate) fn prompt_chain(&self, tokens: &[u32], extras: &[u8]) -> (Vec<Digest>, Vec<Tag>) {
        if !self.caching() {
            return (Vec::new(), Vec::new());
        }
        let bs = self.block_size();
        let tags = match &self.tagger {
            Some(t) => t.tag_chain(tokens, bs, extras),
            None => Vec::new(),
        };
        (self.hasher.hash_chain(tokens, bs, extras), tags)
    }

    /// The most blocks a prompt of `n` tokens may hit: one token is always computed, and
    /// `max_hit_tokens` caps it further; none with prefix caching off.
    pub(crate) fn hit_cap(&self, n: usize, max_hit_tokens: Option<usize>) -> usize {
        if !self.caching() {
            return 0;
        }
        let bs = self.block_size();
        ((n - 1) / bs).min(max_hit_tokens.map_or(usize::MAX, |t| t / bs))
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
        tags: &[Tag],
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
        // The request is admitted: its digests past the hit are misses (reported before the
        // evictions that make room for them, as the ghost policies look them up).
        self.gpu.missed(&digests[hits..]);
        self.gpu.take_into(new, &mut blocks);
        if let (true, Some(t)) = (hits > 0, self.gpu.tally(0)) {
            counters::add(&t.hit_blocks, hits);
        }
        Ok(Some((blocks, hits)))
    }
}
