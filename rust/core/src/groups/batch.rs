//! Batch calls of the hybrid manager: one decode step for many sequences, frees, and the
//! per-group tables, slot mappings and FlashInfer page tables the kernels read.

use super::manager::{GroupManager, State};
use super::table::GroupSeq;
use crate::alloc::{try_filled, try_grow, try_with_capacity};
use crate::batch::flashinfer_rows;
use crate::error::{invalid, Error, Result};
use crate::manager::{cdiv, check_append};
use std::collections::{HashMap, HashSet};

fn distinct(ids: &[u64]) -> Result<()> {
    let mut seen = HashSet::with_capacity(ids.len());
    for &id in ids {
        if !seen.insert(id) {
            return Err(invalid(format!(
                "seq_ids holds sequence {id} more than once"
            )));
        }
    }
    Ok(())
}

impl GroupManager {
    /// One token to each sequence, all or nothing: every sequence's skipped entries are
    /// released first (batch order), then each is written in batch order, then registered.
    pub fn append_batch_lookahead(
        &self,
        ids: &[u64],
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        self.broken.guarded(true, || {
            if ids.len() != tokens.len() {
                return Err(invalid(format!(
                    "seq_ids has {} entries but token_ids has {}",
                    ids.len(),
                    tokens.len()
                )));
            }
            distinct(ids)?;
            let mut guard = self.lock()?;
            let st = &mut *guard;
            for &id in ids {
                let seq = st.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
                if seq.cpu.is_some() {
                    return Err(Error::Swapped(id));
                }
                check_append(id, seq.tokens.len(), seq.scheduled, 1)?;
            }
            let mut need = 0usize;
            let mut drops: HashMap<u32, u32> = HashMap::new();
            let mut plans = Vec::with_capacity(ids.len());
            for &id in ids {
                let seq = &st.seqs[&id];
                let p = seq.scheduled;
                let plan = self.plan_step(&st.pool, seq, p, (p + 1).saturating_add(lookahead));
                for &(g, i) in &plan.skipped {
                    *drops.entry(seq.tables[g][i]).or_insert(0) += 1;
                }
                need = need.saturating_add(plan.need);
                plans.push(plan);
            }
            if need > st.pool.available() + Self::freed_by(&st.pool, &drops) {
                return Ok(None);
            }
            // Take the sequences out so each can be changed beside the pool; they go back below
            // whatever happens.
            let mut seqs: Vec<(u64, GroupSeq)> = ids
                .iter()
                .filter_map(|id| st.seqs.remove_entry(id))
                .collect();
            let out = self.append_taken(st, &mut seqs, &plans, tokens, lookahead);
            st.seqs.extend(seqs);
            out.map(Some)
        })
    }

    fn append_taken(
        &self,
        st: &mut State,
        seqs: &mut [(u64, GroupSeq)],
        plans: &[super::manager::StepPlan],
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Vec<(u32, u32)>> {
        // Room first, so that running out of memory fails before anything changed.
        let bs = self.block_size();
        for (_, seq) in seqs.iter_mut() {
            let end = cdiv((seq.scheduled + 1).saturating_add(lookahead), bs);
            try_grow(&mut seq.tokens, 1, "a sequence's tokens")?;
            try_grow(&mut seq.digests, 1, "a sequence's digests")?;
            try_grow(&mut seq.tags, 1, "a sequence's tags")?;
            for table in &mut seq.tables {
                let more = end.saturating_sub(table.len());
                try_grow(table, more, "a block table")?;
            }
        }
        for ((_, seq), plan) in seqs.iter_mut().zip(plans) {
            Self::release_skipped(st, seq, &plan.skipped)?;
        }
        let mut pairs = Vec::new();
        for ((_, seq), &t) in seqs.iter_mut().zip(tokens) {
            let p = seq.scheduled;
            self.add_tokens(seq, &[t])?;
            self.write_step(st, seq, p, (p + 1).saturating_add(lookahead), &mut pairs)?;
        }
        for (_, seq) in seqs.iter_mut() {
            let from = seq.registrable(self.block_size());
            seq.scheduled = seq.tokens.len();
            self.register_range(st, seq, from)?;
        }
        Ok(pairs)
    }

    /// Free every sequence in order, all or nothing.
    pub fn free_batch(&self, ids: &[u64]) -> Result<()> {
        self.broken.guarded(true, || {
            distinct(ids)?;
            let mut guard = self.lock()?;
            let st = &mut *guard;
            if let Some(&id) = ids.iter().find(|id| !st.seqs.contains_key(id)) {
                return Err(Error::UnknownSequence(id));
            }
            for id in ids {
                if let Some(seq) = st.seqs.remove(id) {
                    self.drop_seq(st, &seq, None)?;
                }
            }
            Ok(())
        })
    }

    /// The resident sequences of a read-only batch (repeats allowed), in batch order, each
    /// checked by `check` right after its state checks.
    fn read_all<T>(
        &self,
        ids: &[u64],
        group: usize,
        check: impl Fn(usize, &GroupSeq) -> Result<()>,
        f: impl FnOnce(&[&GroupSeq]) -> Result<T>,
    ) -> Result<T> {
        self.check_group(group)?;
        let st = self.lock()?;
        let mut seqs = try_with_capacity(ids.len(), "the batch's sequences")?;
        for (i, &id) in ids.iter().enumerate() {
            let seq = st.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
            if seq.cpu.is_some() {
                return Err(Error::Swapped(id));
            }
            check(i, seq)?;
            seqs.push(seq);
        }
        f(&seqs)
    }

    /// Row-major `(ids.len(), width)` int32 tables of `group`, padded with `pad`.
    pub fn block_tables(&self, ids: &[u64], pad: i32, group: usize) -> Result<(Vec<i32>, usize)> {
        self.broken.guarded(false, || {
            self.read_all(
                ids,
                group,
                |_, _| Ok(()),
                |seqs| {
                    let width = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
                    let size = ids
                        .len()
                        .checked_mul(width)
                        .ok_or_else(|| Error::OutOfMemory("block tables too large".into()))?;
                    let mut out = try_filled(size, pad, "the block tables")?;
                    for (row, seq) in seqs.iter().enumerate() {
                        for (o, &b) in out[row * width..].iter_mut().zip(&seq.tables[group]) {
                            *o = b as i32;
                        }
                    }
                    Ok((out, width))
                },
            )
        })
    }

    /// Slots of each sequence's last `counts[i]` scheduled tokens, then of `lookahead`
    /// positions past them, in `group`'s table.
    pub fn slot_mapping(
        &self,
        ids: &[u64],
        counts: &[usize],
        lookahead: usize,
        group: usize,
    ) -> Result<Vec<i64>> {
        self.broken.guarded(false, || {
            if ids.len() != counts.len() {
                return Err(invalid(format!(
                    "seq_ids has {} entries but num_new_tokens has {}",
                    ids.len(),
                    counts.len()
                )));
            }
            let bs = self.block_size();
            let check = |i: usize, seq: &GroupSeq| {
                let (s, c) = (seq.scheduled, counts[i]);
                if c == 0 || c > s {
                    return Err(invalid(format!(
                        "num_new_tokens {c} for sequence {} must be in 1..={s}",
                        ids[i]
                    )));
                }
                let room = seq.len() * bs - s;
                if lookahead > room {
                    return Err(invalid(format!(
                        "lookahead {lookahead} for sequence {}: its blocks hold only {room} slots \
                     past its scheduled tokens",
                        ids[i]
                    )));
                }
                Ok(())
            };
            self.read_all(ids, group, check, |seqs| {
                let total = counts.iter().sum::<usize>() + lookahead * ids.len();
                let mut out = try_with_capacity(total, "the slot mapping")?;
                for (seq, &c) in seqs.iter().zip(counts) {
                    let s = seq.scheduled;
                    let table = &seq.tables[group];
                    out.extend(
                        (s - c..s + lookahead)
                            .map(|p| i64::from(table[p / bs]) * bs as i64 + (p % bs) as i64),
                    );
                }
                Ok(out)
            })
        })
    }

    /// FlashInfer's `(kv_indptr, kv_indices, kv_last_page_len)` over `group`'s tables
    /// (null pages included as block 0: the kernel's window masks them).
    pub fn flashinfer_page_table(
        &self,
        ids: &[u64],
        group: usize,
    ) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        self.broken.guarded(false, || {
            let bs = self.block_size();
            self.read_all(
                ids,
                group,
                |_, _| Ok(()),
                |seqs| {
                    flashinfer_rows(seqs.iter().map(|s| (s.scheduled, &s.tables[group][..])), bs)
                },
            )
        })
    }
}
