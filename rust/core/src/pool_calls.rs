//! Pool-level calls (vLLM's `KVCacheManager` asks them of its block pool): `evict_blocks`
//! (bad KV out of the prefix cache), and the read-only `allocation_cost` and `lookup_blocks`
//! (what `allocate` would take and pin now).
//!
//! The hit of a prompt is found from its chain (digests, and tags for verified hits) by
//! `chain_cost` and `chain_blocks`; the token form hashes the prompt first, the keyed form reduces the caller's keys (`query_chain`).
//! A caller-keyed form (`block_hashes=`) reduces the caller's keys to the chain instead and
//! calls the same two.

use crate::block_pool::{Peek, Withdrawal};
use crate::counters;
use crate::error::{invalid, Error, Result};
use crate::grouped::NULL;
use crate::hashing::{encode_extras, Digest, Tag};
use crate::keys::{check_key_count, PromptKeys};
use crate::manager::{cdiv, chain_lock, check_tokens, BlockManager};
use crate::policy::{hybrid_hit, Resume};
use std::collections::HashMap;

/// What `allocate` would take now: `(hit_tokens, new_blocks, revived_blocks)`.
pub type Cost = (usize, usize, usize);

impl BlockManager {
    /// Take these GPU blocks out of the prefix cache (their KV is bad, say a failed load):
    /// a CACHED one becomes FREE (on top of the free stack), an OWNED one stays with its
    /// holders unhashed (FREE, not CACHED, after its last release). Blocks not in the cache
    /// are ignored. Every id is checked first: out of range, or the null block, is an error
    /// naming it, and nothing changes. Returns how many blocks left the cache (each counts
    /// in `unregistered_blocks` and emits `BlockRemoved`). Each block is withdrawn in one
    /// step, in the given order; the call as a whole is not one step.
    pub fn evict_blocks(&self, blocks: &[u32]) -> Result<usize> {
        self.guarded(true, || {
            let n = self.gpu.num_blocks();
            for &b in blocks {
                if b as usize >= n {
                    return Err(invalid(format!(
                        "block_ids: block {b} out of range [0, {n})"
                    )));
                }
                if self.is_null(b) {
                    return Err(invalid(format!(
                        "block_ids: block {b} is the null block, never in the prefix cache"
                    )));
                }
            }
            // Inside the gate: a reset is all before or all after.
            let _gate = self.enter()?;
            let len = self.hasher.root().as_bytes().len();
            let removed = blocks
                .iter()
                .filter(|&&b| self.gpu.withdraw(b, len) != Withdrawal::NotCached)
                .count();
            counters::add(&self.counters.unregistered_blocks, removed);
            Ok(removed)
        })
    }

    /// The hit of a chain of at most `cap` blocks for a sequence resuming at `resume`, as
    /// read-only looks under the chain's prefix lock (so a registration or withdrawal of
    /// this prefix is seen whole): `h` and what each group's first `h` table entries would
    /// be, with the look at each held one. `None` entries are the null blocks a group no
    /// longer needs at `h`.
    fn chain_hit(
        &self,
        digests: &[Digest],
        tags: &[Tag],
        cap: usize,
        resume: Resume,
    ) -> Result<(usize, Vec<Vec<Option<Peek>>>)> {
        let bs = self.block_size();
        let cap = cap.min(digests.len());
        // Inside the gate: a reset is all before or all after.
        let _gate = self.enter()?;
        let _prefix = self.lock_prefixes(chain_lock(digests))?;
        // Each (group, block) is looked at once; the hit is decided from those looks only,
        // so the blocks reported are the ones that made it.
        let mut seen: HashMap<(usize, usize), Peek> = HashMap::new();
        let h = hybrid_hit(&self.kinds, bs, cap, resume, |g, i| {
            let key = digests[i].keyed(g as u8);
            match self.gpu.peek(&key) {
                Some(p) if self.gpu.index_tag_is(p.block, tags.get(i).copied()) => {
                    seen.insert((g, i), p);
                    true
                }
                _ => false,
            }
        });
        let tables = (0..self.num_groups())
            .map(|g| {
                let lo = self.first_needed_of_hit(g, h, resume);
                let held = (lo..h).map(|i| {
                    seen.get(&(g, i)).copied().map(Some).ok_or_else(|| {
                        Error::Broken(format!("hit block {i} of group {g} was never looked at"))
                    })
                });
                std::iter::repeat_n(Ok(None), lo).chain(held).collect()
            })
            .collect::<Result<_>>()?;
        Ok((h, tables))
    }

    /// `allocation_cost` of a chain for a prompt of `n` tokens, `k` of them scheduled past
    /// the hit, with `lookahead` slots.
    pub(crate) fn chain_cost(
        &self,
        digests: &[Digest],
        tags: &[Tag],
        (n, k): (usize, usize),
        q: &PromptKeys<'_>,
        lookahead: usize,
    ) -> Result<Cost> {
        let bs = self.block_size();
        let cap = self.hit_cap(n, q.max_hit_tokens);
        let (h, tables) = self.chain_hit(digests, tags, cap, q.resume(n))?;
        let total = cdiv((h * bs + k).min(n).saturating_add(lookahead), bs);
        let new = (total - h).saturating_mul(self.num_groups());
        let revived = tables
            .iter()
            .flatten()
            .flatten()
            .filter(|p| p.cached)
            .count();
        Ok((h * bs, new, revived))
    }

    /// `lookup_blocks` of a chain for a prompt of `n` tokens.
    pub(crate) fn chain_blocks(
        &self,
        digests: &[Digest],
        tags: &[Tag],
        n: usize,
        q: &PromptKeys<'_>,
    ) -> Result<(usize, Vec<Vec<u32>>)> {
        let cap = self.hit_cap(n, q.max_hit_tokens);
        let (h, tables) = self.chain_hit(digests, tags, cap, q.resume(n))?;
        let blocks = tables
            .into_iter()
            .map(|t| t.into_iter().map(|p| p.map_or(NULL, |p| p.block)).collect())
            .collect();
        Ok((h * self.block_size(), blocks))
    }

    /// What `allocate(tokens, num_new_tokens=, cache_salt=, lora_id=, block_hashes=,
    /// max_hit_tokens=, lookahead=)` would take now: `(hit_tokens, new_blocks, revived_blocks)`: the hit in
    /// tokens, the blocks it would take from the free pool (FREE or evicted), and the hit's
    /// blocks that are CACHED (each revival also uses up one block of `available`), summed
    /// over the groups. Whether they fit is `can_allocate`'s question. Touches nothing.
    pub fn allocation_cost(
        &self,
        tokens: &[u32],
        num_new_tokens: Option<u64>,
        q: &PromptKeys<'_>,
        lookahead: usize,
    ) -> Result<Cost> {
        self.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            let k = self.check_new_tokens_of(num_new_tokens, n)?;
            q.check_loaded(n, k)?;
            let (digests, tags) = self.query_chain(tokens, q)?;
            self.chain_cost(&digests, &tags, (n, k), q, lookahead)
        })
    }

    /// The chain a query looks up: the caller's keys reduced (`block_hashes`, at most one
    /// per full block), or the prompt's tokens hashed with its extra keys.
    pub(crate) fn query_chain(
        &self,
        tokens: &[u32],
        q: &PromptKeys<'_>,
    ) -> Result<(Vec<Digest>, Vec<Tag>)> {
        q.check()?;
        match q.block_hashes {
            Some(keys) => {
                let keys = self.reduce_keys(keys)?;
                check_key_count(keys.given, tokens.len(), self.block_size())?;
                Ok((keys.digests, keys.tags))
            }
            None => Ok(self.prompt_chain(tokens, &encode_extras(q.cache_salt, q.lora_id))),
        }
    }

    /// `allocation_cost` of a prompt given by its length (no hit credited): the blocks its
    /// first `num_new_tokens` (default all) and `lookahead` slots need, in every group.
    /// Saturates at `usize::MAX` (a count no pool has).
    pub fn allocation_cost_count(
        &self,
        num_tokens: u64,
        num_new_tokens: Option<u64>,
        lookahead: usize,
    ) -> Result<Cost> {
        if num_tokens == 0 {
            return Err(invalid("num_tokens must be at least 1"));
        }
        let k = match num_new_tokens {
            None => num_tokens,
            Some(k) if (1..=num_tokens).contains(&k) => k,
            Some(k) => {
                return Err(invalid(format!(
                    "num_new_tokens {k} must be in 1..={num_tokens} (the prompt's length)"
                )))
            }
        };
        let slots = u128::from(k) + lookahead as u128;
        let blocks = slots.div_ceil(self.block_size() as u128) * self.num_groups() as u128;
        Ok((0, usize::try_from(blocks).unwrap_or(usize::MAX), 0))
    }

    /// The hit `allocate(tokens, cache_salt=, lora_id=, block_hashes=, max_hit_tokens=)`
    /// would pin now:
    /// its tokens, and each group's first table entries (the null block where the group no
    /// longer needs one; one table without `groups=`). Touches nothing.
    pub fn lookup_blocks(
        &self,
        tokens: &[u32],
        q: &PromptKeys<'_>,
    ) -> Result<(usize, Vec<Vec<u32>>)> {
        self.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            q.check_loaded(tokens.len(), tokens.len())?;
            let (digests, tags) = self.query_chain(tokens, q)?;
            self.chain_blocks(&digests, &tags, tokens.len(), q)
        })
    }
}
