//! Read-only answers about prompts: `lookup` (the hit `allocate` would take) and
//! `can_allocate` (OK / LATER / NEVER with the watermark).

use crate::error::{invalid, Result};
use crate::hashing::encode_extras;
use crate::manager::{
    cdiv, check_new_tokens, check_tokens, prefix_lock_of, BlockManager, MAX_TOKENS,
};
use crate::stats::AllocStatus;

impl BlockManager {
    /// Check `num_new_tokens` against a prompt of `n` tokens (`None`: all of them).
    pub(crate) fn check_new_tokens_of(&self, k: Option<u64>, n: usize) -> Result<usize> {
        check_new_tokens(k.map(|k| usize::try_from(k).unwrap_or(usize::MAX)), n)
    }

    /// The hits `allocate` would pin now for `tokens`, as read-only looks (at most
    /// `(n - 1) / block_size`, stopping at the first miss): nothing changes. The looks run
    /// under the prompt's prefix lock, so they see every allocation's registrations and
    /// every abort's withdrawals of this prefix whole (the chain is hashed first, outside).
    pub(crate) fn cached_prefix(
        &self,
        tokens: &[u32],
        extras: &[u8],
    ) -> Result<Vec<crate::block_pool::Peek>> {
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
}
