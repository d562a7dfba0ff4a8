//! Calls over a whole scheduler step: one lock per sequence, one reservation for the batch.
//!
//! Every batch call locks all of its sequences before it looks at any of them, so it acts on
//! one consistent state and is one step against every other call (docs/concurrency.md).
//! Errors come in the documented order: argument errors (lengths, duplicate ids) before
//! any state is read, then per sequence in batch order: unknown, swapped, state-dependent
//! values.

use crate::alloc::{try_filled, try_with_capacity};
use crate::error::{invalid, Error, Result};
use crate::lookahead::Lookahead;
use crate::manager::check_append;
use crate::manager::{cdiv, BlockManager};
use crate::seq_map::SeqCell;
use crate::sequence::Sequence;
use crate::sync::{lock, may_wait, prefetch, try_lock, MutexGuard};

/// FlashInfer's paged-KV page table `(kv_indptr, kv_indices, kv_last_page_len)` of
/// sequences given as `(scheduled tokens, block table)`, each with at least one token.
pub(crate) fn flashinfer_rows<'a>(
    rows: impl Iterator<Item = (usize, &'a [u32])> + Clone,
    bs: usize,
) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
    let pages: usize = rows.clone().map(|(n, _)| cdiv(n, bs)).sum();
    if pages > i32::MAX as usize {
        return Err(invalid(format!(
            "the batch spans {pages} pages, more than an int32 kv_indptr can index"
        )));
    }
    let count = rows.clone().count();
    let mut indptr = try_with_capacity(count + 1, "kv_indptr")?;
    let mut indices = try_with_capacity(pages, "kv_indices")?;
    let mut last = try_with_capacity(count, "kv_last_page_len")?;
    indptr.push(0i32);
    for (n, table) in rows {
        let p = cdiv(n, bs);
        indices.extend(table[..p].iter().map(|&b| b as i32));
        indptr.push(indices.len() as i32);
        last.push((n - (p - 1) * bs) as i32);
    }
    Ok((indptr, indices, last))
}

/// Error unless every id is distinct.
pub(crate) fn check_distinct(ids: &[u64]) -> Result<()> {
    let mut sorted = try_with_capacity(ids.len(), "a copy of seq_ids")?;
    sorted.extend_from_slice(ids);
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(invalid(format!("duplicate sequence id {} in batch", w[0]))),
        None => Ok(()),
    }
}

/// The batch's distinct sequences, locked: `guards[at[i]]` is position `i`'s (`None` where
/// its id has no cell). Repeated ids share one guard.
pub(crate) struct Locked<'a> {
    pub(crate) guards: Vec<Option<MutexGuard<'a, Sequence>>>,
    /// The cell each guard locks.
    pub(crate) cells: Vec<Option<&'a SeqCell>>,
    pub(crate) at: Vec<usize>,
}

/// Lock each distinct cell once, first in batch order without blocking (the common case:
/// distinct ids, none busy). Otherwise: `distinct` batches get their duplicate-id check (an
/// argument error, so before any state is read), then the distinct cells are locked in id
/// order, the one global order every multi-sequence locker follows, so two batches cannot
/// deadlock. In non-blocking mode a busy cell is `WouldBlock`.
pub(crate) fn lock_all<'a>(
    ids: &[u64],
    cells: &[Option<&'a SeqCell>],
    distinct: bool,
) -> Result<Locked<'a>> {
    let mut guards = try_with_capacity(ids.len(), "the batch's locks")?;
    cells.iter().flatten().for_each(|c| prefetch(*c));
    for cell in cells {
        match cell.and_then(|c| try_lock(&c.seq)) {
            Some(g) => guards.push(Some(g)),
            None => break,
        }
    }
    if guards.len() == ids.len() {
        // Every cell locked, so no id repeats (a second lock of one cell would have failed).
        return Ok(Locked {
            guards,
            cells: cells.to_vec(),
            at: (0..ids.len()).collect(),
        });
    }
    drop(guards);
    if distinct {
        check_distinct(ids)?;
    }
    let mut order: Vec<usize> = try_with_capacity(ids.len(), "the batch's lock order")?;
    order.extend(0..ids.len());
    order.sort_by_key(|&i| ids[i]);
    // The first position of each distinct id, in id order, and each position's owner.
    let mut firsts: Vec<usize> = Vec::new();
    let mut at = vec![0; ids.len()];
    for &i in &order {
        match firsts.last() {
            Some(&f) if ids[f] == ids[i] => at[i] = firsts.len() - 1,
            _ => {
                at[i] = firsts.len();
                firsts.push(i);
            }
        }
    }
    let mut guards = Vec::with_capacity(firsts.len());
    for &f in &firsts {
        match cells[f] {
            None => guards.push(None),
            Some(c) => match try_lock(&c.seq) {
                Some(g) => guards.push(Some(g)),
                None => break,
            },
        }
    }
    if guards.len() < firsts.len() {
        drop(guards);
        if !may_wait() {
            return Err(Error::WouldBlock);
        }
        guards = firsts
            .iter()
            .map(|&f| cells[f].map(|c| lock(&c.seq)))
            .collect();
    }
    let cells = firsts.iter().map(|&f| cells[f]).collect();
    Ok(Locked { guards, cells, at })
}

/// The first state error of position `i`: unknown, then (when `resident`) swapped out.
pub(crate) fn state_error(
    id: u64,
    cell: Option<&SeqCell>,
    seq: Option<&Sequence>,
    resident: bool,
) -> Option<Error> {
    match (cell, seq) {
        (Some(c), Some(seq)) if c.is_live() => {
            // Built only when returned: `then_some` would build and drop an `Error` (its
            // drop glue) for every healthy sequence of every step.
            if resident && seq.is_swapped() {
                Some(Error::Swapped(id))
            } else {
                None
            }
        }
        _ => Some(Error::UnknownSequence(id)),
    }
}

impl BlockManager {
    /// The locked, live sequences of a batch of distinct ids in batch order, with their
    /// cells, or the first state error.
    pub(crate) fn live_mut<'a, 'c>(
        ids: &[u64],
        locked: &'a mut Locked<'c>,
        resident: bool,
    ) -> Result<Vec<(&'c SeqCell, &'a mut Sequence)>> {
        let Locked { guards, cells, at } = locked;
        for (i, &id) in ids.iter().enumerate() {
            let k = at[i];
            if let Some(e) = state_error(id, cells[k], guards[k].as_deref(), resident) {
                return Err(e);
            }
        }
        // Distinct ids: `at` is a permutation, so each guard is lent once; every position
        // passed `state_error`, so each has a cell and a guard.
        let mut by_slot: Vec<Option<(&'c SeqCell, &'a mut Sequence)>> = guards
            .iter_mut()
            .zip(cells.iter())
            .map(|(g, c)| Some(((*c)?, g.as_deref_mut()?)))
            .collect();
        Ok(at.iter().filter_map(|&k| by_slot[k].take()).collect())
    }

    /// One token to each sequence, all or nothing. Returns the copy-on-write pairs, or
    /// `None` when the batch's blocks do not fit (nothing changed).
    pub fn append_batch(&self, ids: &[u64], tokens: &[u32]) -> Result<Option<Vec<(u32, u32)>>> {
        self.append_batch_lookahead(ids, tokens, 0)
    }

    /// `append_batch` that also makes `lookahead` slots past each new token writable.
    pub fn append_batch_lookahead(
        &self,
        ids: &[u64],
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        if ids.len() != tokens.len() {
            return Err(invalid(format!(
                "seq_ids has {} entries but token_ids has {}",
                ids.len(),
                tokens.len()
            )));
        }
        self.guarded(true, || {
            let _gate = self.enter()?;
            self.seqs.with_cells(ids, |cells| {
                self.append_locked(ids, tokens, lookahead, cells)
            })
        })
    }

    fn append_locked(
        &self,
        ids: &[u64],
        tokens: &[u32],
        lookahead: usize,
        cells: &[Option<&SeqCell>],
    ) -> Result<Option<Vec<(u32, u32)>>> {
        {
            let mut locked = lock_all(ids, cells, true)?;
            if lookahead == 0 && self.plain() {
                return self.append_one_each(ids, tokens, &mut locked, None, None);
            }
            // Sequence by sequence in batch order: its state, then its append checks.
            for (i, &id) in ids.iter().enumerate() {
                let k = locked.at[i];
                let seq = locked.guards[k].as_deref();
                if let Some(e) = state_error(id, locked.cells[k], seq, true) {
                    return Err(e);
                }
                if let Some(seq) = seq {
                    check_append(id, seq.tokens.len(), seq.scheduled, 1)?;
                }
            }
            let mut seqs = Self::live_mut(ids, &mut locked, true)?;
            if !self.plain() {
                let mut refs: Vec<&mut Sequence> = seqs.iter_mut().map(|(_, s)| &mut **s).collect();
                return self.step_batch_grouped(&mut refs, tokens, lookahead, None);
            }
            let mut need: usize = 0;
            let mut keys = Vec::new();
            for (((_, seq), &id), t) in seqs.iter_mut().zip(ids).zip(tokens) {
                check_append(id, seq.tokens.len(), seq.scheduled, 1)?;
                self.reserve_tokens(seq, 1)?;
                let upto = seq.tokens.len() + 1;
                keys.extend(self.schedule_prefix_key(seq, upto, std::slice::from_ref(t), None));
                // Each term is at most the pool (or the reach past it): saturate the sum.
                need = need.saturating_add(self.append_need(seq, 1, lookahead));
            }
            let _prefix = self.lock_prefixes(keys)?;
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pairs = Vec::new();
            let bs = self.block_size();
            // One tally update for the batch: the sums of the footprints before and after.
            let (mut before, mut after) = ((0, 0), (0, 0));
            for ((_, seq), t) in seqs.iter_mut().zip(tokens) {
                let b = seq.footprint(bs);
                let t = std::slice::from_ref(t);
                self.append_reserved(seq, t, None, lookahead, &mut spare, &mut pairs)?;
                let a = seq.footprint(bs);
                before = (before.0 + b.0, before.1 + b.1);
                after = (after.0 + a.0, after.1 + a.1);
            }
            self.account(before, after);
            self.gpu.unreserve(spare);
            Ok(Some(pairs))
        }
    }

    /// Free every sequence, all or nothing: distinct, live ids, checked under their locks.
    pub fn free_batch(&self, ids: &[u64]) -> Result<()> {
        self.guarded(true, || {
            let _gate = self.enter()?;
            self.seqs.with_cells(ids, |cells| {
                let mut locked = lock_all(ids, cells, true)?;
                let seqs = Self::live_mut(ids, &mut locked, false)?;
                for ((cell, seq), &id) in seqs.into_iter().zip(ids) {
                    self.drop_sequence(id, cell, seq)?;
                }
                Ok(())
            })
        })
    }

    /// Run `f` on the batch's resident sequences (repeats allowed), all locked at once, in
    /// batch order.
    /// `check(i, seq)` runs on each sequence right after its state checks, so a batch's
    /// errors come sequence by sequence.
    fn read_all<T>(
        &self,
        ids: &[u64],
        check: impl Fn(usize, &Sequence) -> Result<()>,
        f: impl FnOnce(&[&Sequence]) -> Result<T>,
    ) -> Result<T> {
        self.guarded(false, || {
            self.seqs.with_cells(ids, |cells| {
                let locked = lock_all(ids, cells, false)?;
                let mut seqs = try_with_capacity(ids.len(), "the batch's sequences")?;
                for (i, &id) in ids.iter().enumerate() {
                    let k = locked.at[i];
                    let seq = locked.guards[k].as_deref();
                    if let Some(e) = state_error(id, locked.cells[k], seq, true) {
                        return Err(e);
                    }
                    if let Some(seq) = seq {
                        check(i, seq)?;
                        seqs.push(seq);
                    }
                }
                f(&seqs)
            })
        })
    }

    /// Row-major `(ids.len(), width)` int32 block tables padded with `pad`, and `width`.
    pub fn block_tables(&self, ids: &[u64], pad: i32) -> Result<(Vec<i32>, usize)> {
        self.block_tables_of(ids, pad, 0)
    }

    /// `block_tables` of group `group`'s tables.
    pub fn block_tables_of(
        &self,
        ids: &[u64],
        pad: i32,
        group: usize,
    ) -> Result<(Vec<i32>, usize)> {
        self.check_group(group)?;
        self.read_all(
            ids,
            |_, _| Ok(()),
            |seqs| {
                let width = seqs.iter().map(|s| s.blocks.len()).max().unwrap_or(0);
                let size = ids
                    .len()
                    .checked_mul(width)
                    .ok_or_else(|| Error::OutOfMemory("block tables too large".into()))?;
                let mut out = try_filled(size, pad, "the block tables")?;
                for (row, seq) in seqs.iter().enumerate() {
                    for (o, &b) in out[row * width..].iter_mut().zip(seq.table(group)) {
                        *o = b as i32;
                    }
                }
                Ok((out, width))
            },
        )
    }

    /// The slots of each sequence's last `counts[i]` scheduled tokens, concatenated.
    pub fn slot_mapping(&self, ids: &[u64], counts: &[usize]) -> Result<Vec<i64>> {
        self.slot_mapping_lookahead(ids, counts, 0)
    }

    /// `slot_mapping` plus the same number of draft slots past every sequence's tokens.
    pub fn slot_mapping_lookahead(
        &self,
        ids: &[u64],
        counts: &[usize],
        lookahead: usize,
    ) -> Result<Vec<i64>> {
        self.slot_mapping_of(ids, counts, lookahead, 0)
    }

    /// `slot_mapping` in group `group`'s tables, with `lookahead` draft slots past each
    /// sequence's scheduled tokens: one count for all (`usize`) or one per sequence
    /// (`&[usize]`; 0 for a prefill beside decodes with drafts).
    pub fn slot_mapping_of<'a>(
        &self,
        ids: &[u64],
        counts: &[usize],
        lookahead: impl Into<Lookahead<'a>>,
        group: usize,
    ) -> Result<Vec<i64>> {
        let lookahead = lookahead.into();
        self.check_group(group)?;
        if ids.len() != counts.len() {
            return Err(invalid(format!(
                "seq_ids has {} entries but num_new_tokens has {}",
                ids.len(),
                counts.len()
            )));
        }
        lookahead.check_len(ids.len())?;
        let bs = self.block_size();
        let check = |i: usize, seq: &Sequence| {
            let (s, c) = (seq.scheduled, counts[i]);
            if c == 0 || c > s {
                return Err(invalid(format!(
                    "num_new_tokens {c} for sequence {} must be in 1..={s}",
                    ids[i]
                )));
            }
            check_room(ids[i], seq, lookahead.at(i), bs, group)
        };
        self.read_all(ids, check, |seqs| {
            // Each count and lookahead fits in blocks we hold, so the sum fits memory.
            let total: usize = (0..ids.len()).map(|i| counts[i] + lookahead.at(i)).sum();
            let mut out = try_with_capacity(total, "the slot mapping")?;
            for (i, (seq, &c)) in seqs.iter().zip(counts).enumerate() {
                let s = seq.scheduled;
                let table = seq.table(group);
                out.extend(
                    (s - c..s + lookahead.at(i))
                        .map(|p| i64::from(table[p / bs]) * bs as i64 + (p % bs) as i64),
                );
            }
            Ok(out)
        })
    }

    /// FlashInfer's paged-KV page table: `(kv_indptr, kv_indices, kv_last_page_len)`.
    pub fn flashinfer_page_table(&self, ids: &[u64]) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        self.flashinfer_page_table_of(ids, 0, 0)
    }

    /// `flashinfer_page_table` of group `group`'s tables (null pages included as block 0:
    /// the kernel's window masks them), over each sequence's scheduled tokens plus its
    /// `lookahead` draft slots (the verification step of speculative decoding attends over
    /// them): one count for all or one per sequence, as in `slot_mapping_of`.
    pub fn flashinfer_page_table_of<'a>(
        &self,
        ids: &[u64],
        lookahead: impl Into<Lookahead<'a>>,
        group: usize,
    ) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let lookahead = lookahead.into();
        self.check_group(group)?;
        lookahead.check_len(ids.len())?;
        let bs = self.block_size();
        self.read_all(
            ids,
            |i, seq| check_room(ids[i], seq, lookahead.at(i), bs, group),
            |seqs| {
                let rows = seqs.iter().enumerate();
                flashinfer_rows(
                    rows.map(|(i, s)| (s.scheduled + lookahead.at(i), s.table(group))),
                    bs,
                )
            },
        )
    }
}

/// Error unless `seq`'s table in `group` holds `lookahead` slots past its scheduled tokens
/// (reserved by a scheduling call's own `lookahead`; a query never takes blocks).
fn check_room(id: u64, seq: &Sequence, lookahead: usize, bs: usize, group: usize) -> Result<()> {
    if lookahead == 0 {
        return Ok(()); // the common case: a step without drafts
    }
    let room = seq.table(group).len() * bs - seq.scheduled;
    if lookahead > room {
        return Err(invalid(format!(
            "lookahead {lookahead} for sequence {id}: its blocks hold only {room} slots \
             past its scheduled tokens"
        )));
    }
    Ok(())
}
