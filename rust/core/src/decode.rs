//! The decode step's path: one token to each sequence of a batch whose locks the caller
//! holds, touching each sequence once to check it and once to change it.
//!
//! It gives exactly what the general append (`append_reserved`) gives for one token and no
//! lookahead, with the same checks in the same order, but skips what a one-token append can
//! prove unnecessary: a token's block is the table's last one or the next, so at most one
//! refcount is read; a new block is taken only at a block boundary; digests are extended
//! and blocks registered only when the token fills a block.

use crate::batch::{state_error, Locked};
use crate::error::{Error, Result};
use crate::keys::CallerKeys;
use crate::manager::{check_append, BlockManager};
use crate::sync::{prefetch, prefetch_ptr};

/// Why a sequence's token needs a block: past its table, or a shared table entry to copy.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Need {
    None,
    Write,
}

fn broken(what: &str) -> Error {
    Error::Broken(format!("decode step: {what}"))
}

impl BlockManager {
    /// Bring in what the step reads of every locked sequence before it reads any of it: the
    /// token's table entry and token slot, then the state of the block that entry names.
    /// Two passes, so that each pass's misses are all in flight at once.
    fn prefetch_tails(&self, locked: &Locked<'_>) {
        let bs = self.block_size();
        let seqs = || locked.guards.iter().filter_map(|g| g.as_deref());
        for seq in seqs() {
            let n = seq.tokens.len();
            prefetch_ptr(seq.blocks.as_ptr().wrapping_add(n / bs));
            prefetch_ptr(seq.tokens.as_ptr().wrapping_add(n));
        }
        for seq in seqs() {
            if let Some(&block) = seq.blocks.get(seq.tokens.len() / bs) {
                prefetch(self.gpu.state(block));
            }
        }
    }

    /// Append `tokens[i]` to the sequence of `ids[i]` (distinct ids, all locked in `locked`),
    /// all or nothing; `keys[i]`, when given, continues the keys of a caller-keyed sequence
    /// (the key of the block its token fills). Pushes each new token's slot to `slots` when
    /// given. Returns the copy-on-write pairs, or `None` when the blocks do not fit (nothing
    /// changed).
    pub(crate) fn append_one_each(
        &self,
        ids: &[u64],
        tokens: &[u32],
        locked: &mut Locked<'_>,
        mut slots: Option<&mut Vec<i64>>,
        keys: Option<&[Option<CallerKeys>]>,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        let bs = self.block_size();
        let mut needs = crate::alloc::try_with_capacity(ids.len(), "the batch's block needs")?;
        self.prefetch_tails(locked);
        let mut need = 0usize;
        let mut locks = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let k = locked.at[i];
            let cell = locked.cells[k];
            let guard = &mut locked.guards[k];
            if let Some(e) = state_error(id, cell, guard.as_deref(), true) {
                return Err(e);
            }
            let seq = guard
                .as_deref_mut()
                .ok_or_else(|| broken("a live id without a guard"))?;
            let n = seq.tokens.len();
            check_append(id, n, seq.scheduled, 1)?;
            let key = keys.and_then(|k| k[i].as_ref());
            if let Some(k) = key {
                // Checked (and its room reserved) before anything changes.
                self.check_more_keys(id, seq, k, n + 1)?;
            }
            self.reserve_tokens(seq, 1)?;
            // Block `b` is not registered (it is not full of scheduled tokens), so its refcount
            // can only fall while we hold the lock: one read now decides (`must_copy`: a
            // hashed one is copied too, a defence against a broken state).
            let b = n / bs;
            let needs_block = match seq.blocks.get(b) {
                None => true,
                Some(&block) => self.must_copy(block),
            };
            needs.push(if needs_block { Need::Write } else { Need::None });
            need += usize::from(needs_block);
            if (n + 1) % bs == 0 || key.is_some() {
                locks.extend(self.schedule_prefix_key(seq, n + 1, &tokens[i..=i], key));
            }
        }
        let _prefix = self.lock_prefixes(locks)?;
        if !self.gpu.reserve(need) {
            return Ok(None);
        }
        let mut spare = need;
        let mut pairs = Vec::new();
        let mut new_blocks = 0u64;
        for ((i, &t), need) in tokens.iter().enumerate().zip(needs) {
            let seq = locked.guards[locked.at[i]]
                .as_deref_mut()
                .ok_or_else(|| broken("a checked id without a guard"))?;
            let n = seq.tokens.len();
            if need == Need::Write {
                let had = seq.blocks.len();
                self.write_reserved(seq, n, n + 1, &mut spare, &mut pairs)?;
                new_blocks += (seq.blocks.len() - had) as u64;
            }
            // The room was reserved above: this push cannot reallocate.
            seq.tokens.push(t);
            let key = keys.and_then(|k| k[i].as_ref());
            if (n + 1) % bs == 0 || key.is_some() {
                self.extend_digests(seq);
                self.schedule_keyed(seq, n + 1, key);
            } else {
                seq.scheduled = n + 1;
            }
            if let Some(out) = slots.as_deref_mut() {
                out.push(seq.slot(n, bs));
            }
        }
        // Each sequence gained one scheduled token and its new blocks' slots.
        self.account((0, 0), (new_blocks * bs as u64, ids.len() as u64));
        self.gpu.unreserve(spare);
        Ok(Some(pairs))
    }
}
