//! The operations on every layout but one full-attention group (KV-cache groups of hybrid
//! models): the same sequences, locks, pool and prefix locks as the single-group paths, with
//! one table per group and each group's kind (`policy`) deciding which entries it still
//! needs and which prefix it can serve. One full-attention group keeps its own fast paths
//! (`manager`, `decode`, `batch`); everything here is also correct for it.
//!
//! Exactness of a refused step: a step first releases the entries its groups no longer need
//! (vLLM's `remove_skipped_blocks`), and those blocks count towards what it may take. They
//! are counted (`rc == 1`) under the chain's prefix lock and the sequence locks, where no
//! hit and no fork can add a holder, so the count is a lower bound of what the releases
//! give; the step reserves the rest before it changes anything, and keeps the released
//! blocks' units for itself (`BlockPool::release_table_held`), so no racing taker can take
//! them in between. A refused step changes nothing.
//!
//! Files: `mod.rs` (shared helpers: releases, registration, takes), `hit` (the hybrid hit and
//! a new prompt's tables), `per_group` (each group's own hit), `step` (append, extend, batch steps, `release_skipped`),
//! `truncate`, `swap`, `lifecycle` (fork, free).

use crate::counters;
use crate::error::{Error, Result};
use crate::events::{KvEvent, Medium};
use crate::hashing::Digest;
use crate::manager::BlockManager;
use crate::sequence::Sequence;

/// Block 0: with a non-full group, the null block; a table entry a group does not need
/// holds it.
pub const NULL: u32 = 0;

/// A null entry of a swapped table (CPU block ids start at 0).
pub const SWAPPED_NULL: u32 = u32::MAX;

/// One sequence's part of a step: `new` tokens appended first (none for `extend`) and
/// `keys` added (a caller-keyed sequence's, checked), then scheduled up to `m` tokens with
/// slots writable up to `to` (`m` plus the lookahead).
pub(crate) struct StepReq<'a> {
    pub new: &'a [u32],
    pub keys: Option<&'a crate::keys::CallerKeys>,
    pub m: usize,
    pub to: usize,
    /// Release the entries the groups no longer need first (`false`: the caller releases
    /// them with `release_skipped`).
    pub release: bool,
}

mod hit;
mod lifecycle;
mod per_group;
mod step;
mod swap;
mod truncate;

impl BlockManager {
    pub(crate) fn num_groups(&self) -> usize {
        self.kinds.len()
    }

    /// Whether `b` is the null block (only a manager with a non-full group has one).
    pub(crate) fn is_null(&self, b: u32) -> bool {
        self.null && b == NULL
    }

    /// `digests` as group `g` keys them in the pool.
    pub(crate) fn keyed(g: usize, digests: &[Digest]) -> Vec<Digest> {
        digests.iter().map(|d| d.keyed(g as u8)).collect()
    }

    /// Release group `g`'s entries `from .. to` of `seq`'s table (none null), tail first.
    /// `held`: keep the units of the blocks this frees for the caller (see the module docs).
    pub(crate) fn release_entries(
        &self,
        seq: &Sequence,
        g: usize,
        range: std::ops::Range<usize>,
        held: bool,
    ) -> Result<usize> {
        let blocks = &seq.table(g)[range.clone()];
        let lo = range.start.min(seq.digests.len());
        let hi = range.end.min(seq.digests.len()).max(lo);
        let digests = Self::keyed(g, &seq.digests[lo..hi]);
        if held {
            self.gpu.release_table_held(blocks, &digests)
        } else {
            self.gpu.release_table(blocks, &digests).map(|()| 0)
        }
    }

    /// Release every group's entries of a table that leaves (tail first, group by group).
    pub(crate) fn release_all_groups(&self, seq: &Sequence) -> Result<()> {
        for g in 0..seq.num_groups() {
            let lo = seq.nulls(g);
            self.release_entries(seq, g, lo..seq.table(g).len(), false)?;
        }
        Ok(())
    }

    /// The event that stores group `g`'s full block `i` of `seq` on `medium`.
    pub(crate) fn stored_event_of(
        &self,
        seq: &Sequence,
        g: usize,
        i: usize,
        medium: Medium,
    ) -> KvEvent {
        let bs = self.block_size();
        KvEvent::BlockStored {
            block_hash: seq.digests[i],
            parent_block_hash: i.checked_sub(1).map(|p| seq.digests[p]),
            token_ids: seq.tokens[i * bs..(i + 1) * bs].into(),
            lora_id: seq.lora_id,
            medium,
            group: g as u8,
        }
    }

    /// Register every group's non-null entries at positions `range` (group order, then
    /// position order); counts the new ones, and returns that count.
    pub(crate) fn register_groups(&self, seq: &Sequence, range: std::ops::Range<usize>) -> usize {
        let mut new = 0;
        for g in 0..seq.num_groups() {
            for i in range.clone() {
                let b = seq.table(g)[i];
                if self.is_null(b) || self.shared_keyed(seq, b) || !self.caches(seq, g, i) {
                    continue;
                }
                let event = || self.stored_event_of(seq, g, i, Medium::Gpu);
                let key = seq.digests[i].keyed(g as u8);
                self.gpu.set_tenant(b, seq.tenant());
                if self.gpu.register(b, key, seq.tag(i), event) {
                    new += 1;
                    if let Some(t) = self.gpu.tally(g as u8) {
                        counters::add(&t.registered, 1);
                    }
                }
            }
        }
        if new > 0 {
            counters::add(&self.counters.registered_blocks, new);
        }
        new
    }

    /// Whether group `g` caches block `i` of `seq` (every full block but a sliding window's
    /// that no later hit reads, under sparse retention: `policy::reach`).
    pub(crate) fn caches(&self, seq: &Sequence, g: usize, i: usize) -> bool {
        let interval = self.config.prefix_cache_retention_interval;
        interval.is_none()
            || crate::policy::caches_block(
                self.kinds[g],
                i,
                self.block_size(),
                interval,
                seq.reachable(),
            )
    }

    /// Whether sequences keep their reachable positions: sparse retention with a window.
    pub(crate) fn sparse_windows(&self) -> bool {
        self.config.prefix_cache_retention_interval.is_some()
            && self
                .kinds
                .iter()
                .any(|k| matches!(k, crate::policy::GroupKind::SlidingWindow { .. }))
    }

    /// Take a block for group `g` with a unit the caller holds in `spare`.
    pub(crate) fn take_for(&self, g: usize, spare: &mut usize) -> Result<u32> {
        *spare = spare
            .checked_sub(1)
            .ok_or_else(|| Error::Broken("a block beyond its reservation".into()))?;
        let b = self.gpu.take();
        self.gpu.set_group(b, g as u8);
        Ok(b)
    }

    /// Install a grouped prompt's tables into a new sequence.
    pub(crate) fn install_tables(&self, seq: &mut Sequence, tables: Vec<Vec<u32>>) {
        let mut tables = tables.into_iter();
        if let Some(first) = tables.next() {
            first.into_iter().for_each(|b| seq.push_block(b));
        }
        seq.set_more(tables.collect(), Vec::new());
        seq.null_block = self.null;
    }

    /// Every non-null entry of every table of `seq`.
    pub(crate) fn held_entries<'s>(&'s self, seq: &'s Sequence) -> impl Iterator<Item = u32> + 's {
        (0..seq.num_groups())
            .flat_map(move |g| seq.table(g).iter().copied())
            .filter(move |&b| !self.is_null(b))
    }
}
