//! Calls over a whole scheduler step: one lock per sequence, one reservation for the batch.

use crate::error::{invalid, Error, Result};
use crate::manager::{cdiv, BlockManager};
use crate::sequence::Sequence;
use crate::sync::{lock, try_lock, Mutex, MutexGuard};
use std::sync::Arc;

/// Error unless every id is distinct.
fn check_distinct(ids: &[u64]) -> Result<()> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    match sorted.windows(2).find(|w| w[0] == w[1]) {
        Some(w) => Err(invalid(format!("duplicate sequence id {} in batch", w[0]))),
        None => Ok(()),
    }
}

/// Lock every cell, returning the guards in the cells' order. Locks are taken without
/// blocking first; if one is busy, all are dropped and retaken in id order, the one global
/// order every multi-sequence locker follows, so two batches cannot deadlock.
fn lock_all<'a>(
    ids: &[u64],
    cells: &[&'a Mutex<Sequence>],
) -> Result<Vec<MutexGuard<'a, Sequence>>> {
    let mut guards = Vec::with_capacity(cells.len());
    for cell in cells {
        match try_lock(cell) {
            Some(g) => guards.push(g),
            None => break,
        }
    }
    if guards.len() == cells.len() {
        return Ok(guards);
    }
    drop(guards);
    check_distinct(ids)?;
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_unstable_by_key(|&i| ids[i]);
    let mut slots: Vec<Option<MutexGuard<'a, Sequence>>> = (0..ids.len()).map(|_| None).collect();
    for i in order {
        slots[i] = Some(lock(cells[i]));
    }
    Ok(slots.into_iter().flatten().collect())
}

impl BlockManager {
    /// One token to each sequence, all or nothing. Returns the copy-on-write pairs, or
    /// `None` when the batch's blocks do not fit (nothing changed).
    pub fn append_batch(&self, ids: &[u64], tokens: &[u32]) -> Result<Option<Vec<(u32, u32)>>> {
        if ids.len() != tokens.len() {
            return Err(invalid(format!(
                "seq_ids has {} entries but token_ids has {}",
                ids.len(),
                tokens.len()
            )));
        }
        let map = self.seqs.pin();
        let cells = ids
            .iter()
            .map(|id| map.get(id).map(|c| &**c).ok_or(Error::UnknownSequence(*id)))
            .collect::<Result<Vec<&Mutex<Sequence>>>>()?;
        let mut guards = lock_all(ids, &cells)?;
        let mut need = 0;
        for (seq, &id) in guards.iter().zip(ids) {
            if !seq.alive {
                return Err(Error::UnknownSequence(id));
            }
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            need += self.append_need(seq, 1);
        }
        if !self.gpu.reserve(need) {
            return Ok(None);
        }
        let mut spare = need;
        let mut pairs = Vec::new();
        for (seq, t) in guards.iter_mut().zip(tokens) {
            self.append_reserved(seq, std::slice::from_ref(t), &mut spare, &mut pairs);
        }
        self.gpu.unreserve(spare);
        Ok(Some(pairs))
    }

    /// Free every sequence, in order. Validated first: distinct, known ids. A sequence that
    /// a racing call frees in between is skipped (the outcome is the same).
    pub fn free_batch(&self, ids: &[u64]) -> Result<()> {
        check_distinct(ids)?;
        {
            let map = self.seqs.pin();
            if let Some(id) = ids.iter().find(|id| !map.contains_key(*id)) {
                return Err(Error::UnknownSequence(*id));
            }
        }
        for &id in ids {
            match self.free(id) {
                Ok(()) | Err(Error::UnknownSequence(_)) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Read each resident sequence under its lock, in order.
    fn read_each<T>(
        &self,
        ids: &[u64],
        mut f: impl FnMut(u64, &Sequence) -> Result<T>,
    ) -> Result<Vec<T>> {
        let map = self.seqs.pin();
        ids.iter()
            .map(|&id| {
                let cell: &Arc<Mutex<Sequence>> = map.get(&id).ok_or(Error::UnknownSequence(id))?;
                let seq = lock(cell);
                if !seq.alive {
                    return Err(Error::UnknownSequence(id));
                }
                if seq.is_swapped() {
                    return Err(Error::Swapped(id));
                }
                f(id, &seq)
            })
            .collect()
    }

    /// Row-major `(ids.len(), width)` int32 block tables padded with `pad`, and `width`.
    pub fn block_tables(&self, ids: &[u64], pad: i32) -> Result<(Vec<i32>, usize)> {
        let mut flat = Vec::new();
        let lens = self.read_each(ids, |_, seq| {
            flat.extend(seq.blocks.iter().map(|&b| b as i32));
            Ok(seq.blocks.len())
        })?;
        let width = lens.iter().copied().max().unwrap_or(0);
        let mut out = vec![pad; ids.len() * width];
        let mut src = 0;
        for (row, len) in lens.into_iter().enumerate() {
            out[row * width..row * width + len].copy_from_slice(&flat[src..src + len]);
            src += len;
        }
        Ok((out, width))
    }

    /// The slots of each sequence's last `counts[i]` tokens, concatenated.
    pub fn slot_mapping(&self, ids: &[u64], counts: &[usize]) -> Result<Vec<i64>> {
        if ids.len() != counts.len() {
            return Err(invalid(format!(
                "seq_ids has {} entries but num_new_tokens has {}",
                ids.len(),
                counts.len()
            )));
        }
        let bs = self.block_size();
        // Counts are not validated yet: an absurd one must not size the allocation (nor
        // overflow the sum), so the hint is saturated and capped.
        let hint = counts.iter().fold(0usize, |a, &c| a.saturating_add(c));
        let mut out = Vec::with_capacity(hint.min(1 << 16));
        let mut k = 0;
        self.read_each(ids, |id, seq| {
            let n = seq.tokens.len();
            let c = counts[k];
            k += 1;
            if c == 0 || c > n {
                return Err(invalid(format!(
                    "num_new_tokens {c} for sequence {id} must be in 1..={n}"
                )));
            }
            out.extend((n - c..n).map(|p| seq.slot(p, bs)));
            Ok(())
        })?;
        Ok(out)
    }

    /// FlashInfer's paged-KV page table: `(kv_indptr, kv_indices, kv_last_page_len)`.
    pub fn flashinfer_page_table(&self, ids: &[u64]) -> Result<(Vec<i32>, Vec<i32>, Vec<i32>)> {
        let bs = self.block_size();
        let mut indptr = Vec::with_capacity(ids.len() + 1);
        indptr.push(0i32);
        let mut indices = Vec::new();
        let mut last = Vec::with_capacity(ids.len());
        self.read_each(ids, |_, seq| {
            let n = seq.tokens.len();
            let pages = cdiv(n, bs);
            indices.extend(seq.blocks[..pages].iter().map(|&b| b as i32));
            indptr.push(indices.len() as i32);
            last.push((n - (pages - 1) * bs) as i32);
            Ok(())
        })?;
        Ok((indptr, indices, last))
    }
}
