//! `truncate` with groups.

use crate::counters;
use crate::error::{invalid, Result};
use crate::manager::{cdiv, BlockManager};
use crate::policy::GroupKind;
use crate::sequence::Sequence;

impl BlockManager {
    /// `truncate` with groups (docs/semantics.md): checks, then withdraw the hashed partial
    /// blocks held alone, release every group's dropped entries, copy the shared partial
    /// blocks (hashed or not) in group order.
    pub(crate) fn truncate_grouped(
        &self,
        id: u64,
        seq: &mut Sequence,
        m: usize,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        let bs = self.block_size();
        for (g, kind) in self.kinds.iter().enumerate() {
            if seq.nulls(g) * bs > kind.skipped_tokens(m) {
                return Err(invalid(format!(
                    "cannot truncate sequence {id} to {m} tokens: group {g} ({}) already \
                     released the blocks position {m} needs",
                    kind.name()
                )));
            }
            if *kind == GroupKind::State && m < seq.scheduled && m % bs != 0 {
                return Err(invalid(format!(
                    "cannot truncate sequence {id} to {m} tokens: group {g} keeps a state \
                     only at block boundaries (multiples of {bs}) below its {} scheduled \
                     tokens",
                    seq.scheduled
                )));
            }
        }
        let i = m / bs;
        let keep = cdiv(m, bs);
        // Each group's entry left partial that was full: it must end exclusively this
        // table's and unhashed (see `truncate`).
        let cut = crate::truncate::cuts_a_full_block(seq.tokens.len(), m, bs);
        let partial: Vec<Option<u32>> = (0..seq.num_groups())
            .map(|g| {
                let b = *seq.table(g).get(i)?;
                (cut && !self.is_null(b)).then_some(b)
            })
            .collect();
        // Under the chain's prefix lock no hit adds a holder: `rc > 1` only falls.
        let keys = if partial.iter().any(Option::is_some) {
            crate::manager::chain_lock(&seq.digests)
        } else {
            Vec::new()
        };
        let _prefix = self.lock_prefixes(keys)?;
        let copies = partial
            .iter()
            .flatten()
            .filter(|&&b| self.gpu.state(b).load().rc() > 1)
            .count();
        if !self.gpu.reserve(copies) {
            return Ok(None);
        }
        let mut spare = copies;
        let mut copy = vec![false; partial.len()];
        for (g, b) in partial.iter().enumerate() {
            if let Some(b) = *b {
                // Hashed and held by this table alone: withdrawn (this table holds it, so
                // nobody hashes it again meanwhile). Otherwise copied if another table holds
                // it (counted in `copies`), or if still hashed (a broken state: the copy
                // then takes a unit beyond the reservation, or fails as broken).
                let withdrawn = self.gpu.state(b).load().hashed()
                    && seq
                        .digests
                        .get(i)
                        .is_some_and(|d| self.gpu.retract(b, &d.keyed(g as u8), true));
                copy[g] = !withdrawn && self.must_copy(b);
            }
        }
        let more = copy.iter().filter(|&&c| c).count().saturating_sub(copies);
        if more > 0 {
            if !self.gpu.reserve(more) {
                self.gpu.unreserve(spare);
                return Err(crate::error::Error::Broken(format!(
                    "sequence {id}: a hashed partial block is held alone but not registered \
                     under its digest"
                )));
            }
            spare += more;
        }
        for g in 0..seq.num_groups() {
            let dropped = seq.truncate_table(g, keep);
            let lo = keep.min(seq.digests.len());
            let hi = (keep + dropped.len()).min(seq.digests.len()).max(lo);
            let digests = Self::keyed(g, &seq.digests[lo..hi]);
            let real: Vec<u32> = dropped
                .iter()
                .copied()
                .filter(|&b| !self.is_null(b))
                .collect();
            // Dropped entries past the table's nulls are never null (nulls lead).
            let skip = dropped.len() - real.len();
            self.gpu
                .release_table(&real, digests.get(skip..).unwrap_or_default())?;
            counters::add(&self.counters.truncated_blocks, real.len());
        }
        let mut pairs = Vec::new();
        for (g, b) in partial.iter().enumerate() {
            if let (Some(src), true) = (*b, copy[g]) {
                let dst = self.take_for(g, &mut spare)?;
                pairs.push((src, dst));
                seq.set_entry(g, i, dst);
                let key = seq.digests.get(i).map(|d| d.keyed(g as u8));
                self.release_copied(src, key.as_ref())?;
                counters::add(&self.counters.cow_copies, 1);
            }
        }
        self.gpu.unreserve(spare);
        seq.tokens.truncate(m);
        seq.digests.truncate(seq.digests.len().min(i));
        seq.tags.truncate(seq.tags.len().min(i));
        seq.scheduled = seq.scheduled.min(m);
        seq.hit_blocks = seq.hit_blocks.min(i);
        seq.clamp_hold(i);
        Ok(Some(pairs))
    }
}
