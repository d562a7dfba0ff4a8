//! Each group's own longest hit, looked up independently (vLLM's
//! `find_longest_cache_hit_per_group`). Under eviction the groups' hits diverge: a
//! full-attention tail evicted while a deeper state survives, or the reverse. A caller whose
//! KV connector restores what a lagging group lacks (the state at the loaded boundary) can
//! take the deeper full-attention hit with `loaded_tokens`; others take the hybrid hit.

use std::collections::HashMap;

use crate::error::{invalid, Error, Result};
use crate::keys::PromptKeys;
use crate::manager::{chain_lock, check_tokens, BlockManager};
use crate::policy::hybrid_hit;

use super::NULL;

impl BlockManager {
    /// Per group, the hit it could serve alone (at most the hybrid hit's cap), resuming
    /// right after it, and its table entries for that hit (the null block where it needs
    /// none): `[(hit_tokens, blocks), ...]`, one per group (one for a single full-attention
    /// group). `q.loaded_tokens` must be 0: a group alone whose needs arrive with a load
    /// would serve any length. Read-only looks under the chain's prefix lock; touches
    /// nothing.
    pub fn lookup_blocks_per_group(
        &self,
        tokens: &[u32],
        q: &PromptKeys<'_>,
    ) -> Result<Vec<(usize, Vec<u32>)>> {
        self.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            if q.loaded_tokens != 0 {
                return Err(invalid(
                    "loaded_tokens: each group's own hit is where it resumes right after it",
                ));
            }
            let (digests, tags) = self.query_chain(tokens, q)?;
            let bs = self.block_size();
            let cap = self.hit_cap(n, q.max_hit_tokens).min(digests.len());
            let resume = q.resume(n);
            // Inside the gate: a reset is all before or all after.
            let _gate = self.enter()?;
            let _prefix = self.lock_prefixes(chain_lock(&digests))?;
            (0..self.num_groups())
                .map(|g| {
                    let kind = self.kinds[g];
                    // The blocks reported are the ones the looks saw (each looked at once).
                    let mut seen: HashMap<usize, u32> = HashMap::new();
                    let h = hybrid_hit(&[kind], bs, cap, resume, |_, i| {
                        match self.gpu.peek(&digests[i].keyed(g as u8)) {
                            Some(p) if self.gpu.index_tag_is(p.block, tags.get(i).copied()) => {
                                seen.insert(i, p.block);
                                true
                            }
                            _ => false,
                        }
                    });
                    let lo = resume.first_needed(kind, h, bs);
                    let mut table = vec![NULL; lo];
                    for i in lo..h {
                        table.push(*seen.get(&i).ok_or_else(|| {
                            Error::Broken(format!("hit block {i} of group {g} was never looked at"))
                        })?);
                    }
                    Ok((h * bs, table))
                })
                .collect()
        })
    }
}
