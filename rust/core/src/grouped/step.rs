//! A scheduling step on every layout: release what each group no longer needs, write the
//! new positions in every group, register what became full (see the module docs in
//! `mod.rs` for why a refused step changes nothing).

use crate::counters;
use crate::error::Result;
use crate::manager::{cdiv, prefix_lock_of, BlockManager};
use crate::sequence::Sequence;
use std::collections::HashMap;

use super::{StepReq, NULL};

impl BlockManager {
    /// Entries each sequence's groups no longer need at its next position, `(g, i)` group
    /// by group, tail first.
    pub(crate) fn skipped(&self, seq: &Sequence) -> Vec<(usize, usize)> {
        self.skipped_at(seq, seq.scheduled)
    }

    /// The non-null entries the groups of `seq` no longer need when its next position is
    /// `p`, `(g, i)` group by group, tail first.
    fn skipped_at(&self, seq: &Sequence, p: usize) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for g in 0..seq.num_groups() {
            let lo = seq.nulls(g);
            let hi = self.first_needed(g, p).min(seq.table(g).len());
            out.extend((lo..hi).rev().map(|i| (g, i)));
        }
        out
    }

    /// Blocks writing positions `p .. to` of `seq` takes in every group: copies of shared
    /// entries plus new entries.
    pub(crate) fn grouped_write_need(&self, seq: &Sequence, p: usize, to: usize) -> usize {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        let len = seq.blocks.len();
        let mut need = 0usize;
        for g in 0..seq.num_groups() {
            need += (p / bs..end.min(len))
                .filter(|&i| self.must_copy(seq.table(g)[i]))
                .count();
            need = need.saturating_add(end.saturating_sub(len));
        }
        need
    }

    /// Make positions `p .. to` writable in every group with units from `spare`: per group,
    /// copy the shared entries (pairs to `pairs`), then add entries.
    pub(crate) fn grouped_write(
        &self,
        seq: &mut Sequence,
        p: usize,
        to: usize,
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        let len = seq.blocks.len();
        for g in 0..seq.num_groups() {
            for i in p / bs..end.min(len) {
                let src = seq.table(g)[i];
                // Refcounts of a locked sequence's unregistered blocks only fall: a block
                // another holder let go of since the count is ours to write. A hashed one
                // is copied whoever holds it (`must_copy`).
                if self.must_copy(src) {
                    let dst = self.take_for(g, spare)?;
                    pairs.push((src, dst));
                    seq.set_entry(g, i, dst);
                    let key = seq.digests.get(i).map(|d| d.keyed(g as u8));
                    self.release_copied(src, key.as_ref())?;
                    counters::add(&self.counters.cow_copies, 1);
                }
            }
            for _ in len..end {
                let b = self.take_for(g, spare)?;
                seq.push_entry(g, b);
            }
        }
        Ok(())
    }

    /// One step of each locked sequence (batch order), all or nothing: every sequence's
    /// skipped entries are released first (so that their blocks count for every write), then
    /// each is written and registered in turn, so that a sequence's `BlockStored` events
    /// follow its own evictions and come before the next one's, as vLLM's events come per
    /// request and as the one-group paths emit them.
    /// Returns the copy-on-write pairs, or `None` when the blocks do not fit (nothing
    /// changed). Pushes each sequence's new slots per group to `slots` when given.
    pub(crate) fn step_grouped(
        &self,
        seqs: &mut [&mut Sequence],
        reqs: &[StepReq<'_>],
        slots: Option<&mut Vec<Vec<i64>>>,
        account: bool,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        let bs = self.block_size();
        let mut keys = Vec::new();
        let mut skipped = Vec::with_capacity(seqs.len());
        for (seq, req) in seqs.iter_mut().zip(reqs) {
            // Room first, so that running out of memory fails before anything changed.
            self.reserve_tokens(seq, req.new.len())?;
            let more = cdiv(req.to, bs).saturating_sub(seq.blocks.len());
            // Every group takes a block per new entry: more than the pool never fits, a
            // refusal (out of blocks), not tables reserved for it (a lookahead of 2**40).
            if more.saturating_mul(seq.num_groups()) > self.gpu.num_usable() {
                return Ok(None);
            }
            seq.reserve_entries(more)?;
            let s = if req.release {
                self.skipped(seq)
            } else {
                Vec::new()
            };
            if !s.is_empty() && self.config.enable_prefix_caching {
                if let Some(first) = seq.digests.first() {
                    keys.push(prefix_lock_of(first));
                }
            }
            keys.extend(self.schedule_prefix_key(seq, req.m, req.new, req.keys));
            skipped.push(s);
        }
        let _prefix = self.lock_prefixes(keys)?;
        // References the releases drop per block (a block shared by two sequences of the
        // batch is dropped twice) and the blocks they free.
        let mut drops: HashMap<u32, u32> = HashMap::new();
        let mut need = 0usize;
        for ((seq, req), s) in seqs.iter().zip(reqs).zip(&skipped) {
            for &(g, i) in s {
                *drops.entry(seq.table(g)[i]).or_insert(0) += 1;
            }
            let p = seq.scheduled;
            need = need.saturating_add(self.grouped_write_need(seq, p, req.to));
        }
        // A pinned hashed block stays CACHED outside `available`: it frees no unit.
        let freed = drops
            .iter()
            .filter(|(&b, &k)| {
                let w = self.gpu.state(b).load();
                w.rc() == k && !(w.pinned() && w.hashed())
            })
            .count();
        let reserved = need.saturating_sub(freed);
        if !self.gpu.reserve(reserved) {
            return Ok(None);
        }
        let mut spare = reserved;
        // The `stats()` tallies' change (`account`), from what the step does rather than from
        // every table's footprint: each released entry stops reserving and using `bs` slots,
        // each new position adds `bs` reserved slots per group, each scheduled token one used
        // slot per group.
        let (mut gone, mut grown) = (0u64, (0u64, 0u64));
        for (seq, s) in seqs.iter_mut().zip(&skipped) {
            spare += self.release_planned(seq, s, true)?;
            gone += (s.len() * bs) as u64;
        }
        let mut pairs = Vec::new();
        for (seq, req) in seqs.iter_mut().zip(reqs) {
            let p = seq.scheduled;
            let (len, g) = (seq.blocks.len(), seq.num_groups() as u64);
            self.grouped_write(seq, p, req.to, &mut spare, &mut pairs)?;
            grown.0 += g * ((seq.blocks.len() - len) * bs) as u64;
            grown.1 += g * (req.m - p) as u64;
            // The caller reserved the room (`reserve_tokens`): this cannot fail half way.
            seq.tokens.extend_from_slice(req.new);
            self.extend_digests(seq);
            let before = self.registrable(seq);
            Self::add_keys(seq, req.keys);
            seq.scheduled = req.m;
            self.register_groups(seq, before..self.registrable(seq));
        }
        if let Some(out) = slots {
            for (g, row) in out.iter_mut().enumerate() {
                for (seq, req) in seqs.iter().zip(reqs) {
                    let n = req.m - 1;
                    row.push(i64::from(seq.table(g)[n / bs]) * bs as i64 + (n % bs) as i64);
                }
            }
        }
        self.gpu.unreserve(spare);
        if account {
            self.account((gone, gone), grown);
        }
        Ok(Some(pairs))
    }

    /// Release the planned skipped entries of one sequence (null them; group by group, tail
    /// first), keeping the units of the blocks that leave when `held`. Returns those units.
    pub(crate) fn release_planned(
        &self,
        seq: &mut Sequence,
        skipped: &[(usize, usize)],
        held: bool,
    ) -> Result<usize> {
        let mut kept = 0;
        let mut k = 0;
        while k < skipped.len() {
            // One group's run: positions hi-1 down to lo, contiguous.
            let g = skipped[k].0;
            let run = skipped[k..].iter().take_while(|(h, _)| *h == g).count();
            let hi = skipped[k].1 + 1;
            let lo = skipped[k + run - 1].1;
            kept += self.release_entries(seq, g, lo..hi, held)?;
            for i in lo..hi {
                seq.set_entry(g, i, NULL);
            }
            k += run;
        }
        Ok(kept)
    }

    /// Release the entries each group of sequence `id` no longer needs when its next
    /// position is `num_tokens` (at most its scheduled tokens), group by group, tail first:
    /// what a step releases first (vLLM's `remove_skipped_blocks`), for a caller that
    /// releases on its own schedule (steps with `release: false`). Never refused; nothing
    /// to do without a group that skips. Returns the entries released.
    pub fn release_skipped(&self, id: u64, num_tokens: usize) -> Result<usize> {
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(crate::error::Error::Swapped(id));
            }
            let s = self.skipped_at(seq, num_tokens.min(seq.scheduled));
            if s.is_empty() {
                return Ok(0);
            }
            // Under the chain's prefix lock, as a step's releases (mod.rs).
            let keys = match seq.digests.first() {
                Some(first) if self.config.enable_prefix_caching => vec![prefix_lock_of(first)],
                _ => Vec::new(),
            };
            let _prefix = self.lock_prefixes(keys)?;
            self.release_planned(seq, &s, false)?;
            Ok(s.len())
        })
    }

    /// One token to each locked sequence (batch order) with `lookahead` slots past it, for
    /// `append_batch` and a running batch's step, keeping the `stats()` tallies.
    pub(crate) fn step_batch_grouped(
        &self,
        seqs: &mut [&mut Sequence],
        tokens: &[u32],
        lookahead: usize,
        slots: Option<&mut Vec<Vec<i64>>>,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        let reqs: Vec<StepReq<'_>> = seqs
            .iter()
            .zip(tokens)
            .map(|(seq, t)| {
                let m = seq.tokens.len() + 1;
                StepReq {
                    new: std::slice::from_ref(t),
                    keys: None,
                    m,
                    to: m.saturating_add(lookahead),
                    release: true,
                }
            })
            .collect();
        self.step_grouped(seqs, &reqs, slots, true)
    }
}
