//! Read-only answers about prompts: `lookup` (the hit `allocate` would take) and
//! `can_allocate` (OK / LATER / NEVER with the watermark).

use crate::error::{invalid, Result};
use crate::hashing::encode_extras;
use crate::keys::{check_key_count, PromptKeys};
use crate::manager::{
    cdiv, check_new_tokens, check_tokens, prefix_lock_of, BlockManager, MAX_TOKENS,
};
use crate::stats::AllocStatus;

/// A prompt whose blocks a read-only look hashes: its tokens with their encoded extra keys,
/// or the caller's keys.
pub(crate) enum Prompt<'a> {
    Tokens(&'a [u32], &'a [u8]),
    Keys(&'a crate::keys::CallerKeys),
}

/// `can_allocate`'s prompt: its token ids, or only its length.
#[derive(Debug, Clone, Copy)]
pub enum PromptLen<'a> {
    Tokens(&'a [u32]),
    Count(u64),
}

impl BlockManager {
    /// Check `num_new_tokens` against a prompt of `n` tokens (`None`: all of them).
    pub(crate) fn check_new_tokens_of(&self, k: Option<u64>, n: usize) -> Result<usize> {
        check_new_tokens(k.map(|k| usize::try_from(k).unwrap_or(usize::MAX)), n)
    }

    /// The hits `allocate` would pin now for a prompt (at most `cap` blocks, stopping at the
    /// first miss), as read-only looks: nothing changes. The looks run under the prompt's
    /// prefix lock, so they see every allocation's registrations and every abort's
    /// withdrawals of this prefix whole (the chain is hashed first, outside).
    pub(crate) fn cached_prefix(
        &self,
        prompt: Prompt<'_>,
        cap: usize,
    ) -> Result<Vec<crate::block_pool::Peek>> {
        let bs = self.block_size();
        let mut out = Vec::new();
        if cap == 0 {
            return Ok(out);
        }
        // Token blocks' tags are computed only as far as the hits go.
        let (digests, blocks, key_tags) = match prompt {
            Prompt::Tokens(tokens, extras) => {
                let blocks: Vec<&[u32]> = tokens.chunks_exact(bs).take(cap).collect();
                let mut digests =
                    crate::alloc::try_with_capacity(blocks.len(), "the prompt's digests")?;
                let mut parent = self.hasher.root();
                for block in &blocks {
                    parent = self.hasher.hash_block(&parent, block, extras);
                    digests.push(parent);
                }
                (digests, Some((blocks, extras)), &[][..])
            }
            Prompt::Keys(keys) => {
                let cap = cap.min(keys.digests.len());
                (keys.digests[..cap].to_vec(), None, &keys.tags[..])
            }
        };
        let Some(first) = digests.first() else {
            return Ok(out);
        };
        // Inside the gate: a reset is all before or all after.
        let _gate = self.enter()?;
        let _prefix = self.lock_prefixes(vec![prefix_lock_of(first)])?;
        let mut tag = self.tagger.as_ref().map(|t| t.root());
        for (i, d) in digests.iter().enumerate() {
            let Some(p) = self.gpu.peek(d) else { break };
            if let (Some(t), Some(prev)) = (&self.tagger, tag) {
                let next = match &blocks {
                    Some((blocks, extras)) => t.tag_block(prev, blocks[i], extras),
                    None => key_tags[i],
                };
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
        let q = PromptKeys {
            cache_salt,
            lora_id,
            ..PromptKeys::default()
        };
        self.lookup_with(tokens, &q)
    }

    /// `lookup` with the caller's keys and a cap on the hit (`PromptKeys`).
    pub fn lookup_with(&self, tokens: &[u32], q: &PromptKeys<'_>) -> Result<usize> {
        self.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            Ok(self.prompt_hit(tokens.len(), Some(tokens), q, None)?.0 * self.block_size())
        })
    }

    /// A prompt of `n` tokens (`tokens`, or only its length with the caller's keys): its hit
    /// in blocks and, with `k` scheduled prompt tokens, its admission. Checks the keys.
    fn prompt_hit(
        &self,
        n: usize,
        tokens: Option<&[u32]>,
        q: &PromptKeys<'_>,
        k: Option<usize>,
    ) -> Result<(usize, Option<AllocStatus>)> {
        q.check()?;
        q.check_loaded(n, k.unwrap_or(n))?;
        let keys = match q.block_hashes {
            Some(keys) => {
                let keys = self.reduce_keys(keys)?;
                check_key_count(keys.given, n, self.block_size())?;
                Some(keys)
            }
            None => None,
        };
        let cap = self.hit_cap(n, q.max_hit_tokens);
        let extras = encode_extras(q.cache_salt, q.lora_id);
        if !self.plain() {
            let (digests, tags) = match (&keys, tokens) {
                (Some(keys), _) => (keys.digests.clone(), keys.tags.clone()),
                (None, Some(tokens)) => self.prompt_chain(tokens, &extras),
                (None, None) => (Vec::new(), Vec::new()),
            };
            return self.grouped_prefix(n, &digests, &tags, (cap, q.resume(n)), k);
        }
        let peeks = match (&keys, tokens) {
            (Some(keys), _) => self.cached_prefix(Prompt::Keys(keys), cap)?,
            (None, Some(tokens)) => self.cached_prefix(Prompt::Tokens(tokens, &extras), cap)?,
            (None, None) => Vec::new(),
        };
        let h = peeks.len();
        let Some(k) = k else { return Ok((h, None)) };
        let bs = self.block_size();
        let total = cdiv((h * bs + k).min(n), bs);
        let need = total - h + peeks.iter().filter(|p| p.cached).count();
        Ok((h, Some(self.admission_of(total, need))))
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
        let q = PromptKeys {
            cache_salt,
            lora_id,
            ..PromptKeys::default()
        };
        self.can_allocate_with(PromptLen::Tokens(tokens), num_new_tokens, &q)
    }

    /// `can_allocate` of a prompt given by its tokens or its length, with the caller's keys
    /// and a cap on the hit (`PromptKeys`): a length credits a hit only through keys.
    pub fn can_allocate_with(
        &self,
        prompt: PromptLen<'_>,
        num_new_tokens: Option<u64>,
        q: &PromptKeys<'_>,
    ) -> Result<AllocStatus> {
        self.guarded(false, || {
            let (n, tokens) = match prompt {
                PromptLen::Tokens(tokens) => {
                    check_tokens(tokens, "token_ids")?;
                    (tokens.len(), Some(tokens))
                }
                PromptLen::Count(count) => {
                    if count == 0 {
                        return Err(invalid("num_tokens must be at least 1"));
                    }
                    match usize::try_from(count) {
                        Ok(n) if n <= MAX_TOKENS => (n, None),
                        // Beyond any sequence: checked like `can_allocate_count`, then NEVER.
                        _ => {
                            q.check()?;
                            if let Some(keys) = q.block_hashes {
                                crate::keys::check_key_lengths(keys)?;
                            }
                            let status = self.can_allocate_count(count, num_new_tokens)?;
                            let k = num_new_tokens.unwrap_or(count).min(count);
                            let l = q.loaded_tokens;
                            if l as u64 > k {
                                return Err(invalid(format!(
                                    "loaded_tokens {l} exceeds the {k} tokens scheduled past \
                                     the hit (loaded tokens are among them)"
                                )));
                            }
                            return Ok(status);
                        }
                    }
                }
            };
            let k = self.check_new_tokens_of(num_new_tokens, n)?;
            if tokens.is_none() && q.block_hashes.is_none() {
                q.check()?;
                // A length has no hit, but its loaded tokens are checked as a prompt's are.
                q.check_loaded(n, k)?;
                let need = cdiv(k, self.block_size()).saturating_mul(self.kinds.len());
                return Ok(self.admission_of(need, need));
            }
            let (_, status) = self.prompt_hit(n, tokens, q, Some(k))?;
            Ok(status.unwrap_or(AllocStatus::Never))
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
