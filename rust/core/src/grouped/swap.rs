//! Moving a sequence with groups between the GPU pool and the CPU swap space: every
//! group's non-null entries, group by group in table order; nulls stay nulls.

use crate::counters;
use crate::error::Result;
use crate::manager::BlockManager;
use crate::sequence::Sequence;

use super::{NULL, SWAPPED_NULL};

impl BlockManager {
    /// `swap_out` with groups: pairs for every non-null entry, group by group in table
    /// order; nulls stay nulls.
    pub(crate) fn swap_out_grouped(&self, seq: &mut Sequence) -> Result<Option<Vec<(u32, u32)>>> {
        let count = self.held_entries(seq).count();
        let Some(cpu) = self.cpu.take(count) else {
            return Ok(None);
        };
        let mut next = cpu.iter().copied();
        let mut pairs = Vec::with_capacity(count);
        let mut rows = Vec::with_capacity(seq.num_groups());
        for g in 0..seq.num_groups() {
            let row: Vec<u32> = seq
                .table(g)
                .iter()
                .map(|&b| {
                    if self.is_null(b) {
                        SWAPPED_NULL
                    } else {
                        let c = next.next().unwrap_or(SWAPPED_NULL);
                        pairs.push((b, c));
                        c
                    }
                })
                .collect();
            rows.push(row);
        }
        // Hashed blocks stay CACHED on the GPU (a later prompt may hit them).
        self.release_all_groups(seq)?;
        seq.clear_blocks();
        let mut rows = rows.into_iter();
        seq.cpu_blocks = rows.next();
        seq.set_more(Vec::new(), rows.collect());
        counters::add(&self.counters.swapped_out_blocks, count);
        self.cpu_copies_stored(seq);
        Ok(Some(pairs))
    }

    /// The CPU table of group `g` of a swapped sequence.
    pub(crate) fn cpu_table(seq: &Sequence, g: usize) -> &[u32] {
        if g == 0 {
            seq.cpu_blocks.as_deref().unwrap_or_default()
        } else {
            &seq.cpu_more()[g - 1]
        }
    }

    /// Every CPU block a swapped sequence holds, group by group in table order.
    pub(crate) fn cpu_held(seq: &Sequence) -> Vec<u32> {
        (0..1 + seq.cpu_more().len())
            .flat_map(|g| Self::cpu_table(seq, g).iter().copied())
            .filter(|&c| c != SWAPPED_NULL)
            .collect()
    }

    /// `swap_in` with groups: one GPU block per CPU block, group by group in table order.
    pub(crate) fn swap_in_grouped(&self, seq: &mut Sequence) -> Result<Option<Vec<(u32, u32)>>> {
        let held = Self::cpu_held(seq);
        if !self.gpu.reserve(held.len()) {
            return Ok(None);
        }
        let mut spare = held.len();
        let mut pairs = Vec::with_capacity(held.len());
        let mut tables = Vec::with_capacity(1 + seq.cpu_more().len());
        for g in 0..1 + seq.cpu_more().len() {
            let mut table = Vec::with_capacity(Self::cpu_table(seq, g).len());
            for &c in Self::cpu_table(seq, g) {
                if c == SWAPPED_NULL {
                    table.push(NULL);
                } else {
                    let b = self.take_for(g, &mut spare)?;
                    pairs.push((c, b));
                    table.push(b);
                }
            }
            tables.push(table);
        }
        self.cpu.give_back(&held);
        self.cpu_copies_removed(seq);
        seq.cpu_blocks = None;
        self.install_tables(seq, tables);
        self.register_groups(seq, 0..self.registrable(seq));
        counters::add(&self.counters.swapped_in_blocks, held.len());
        self.gpu.unreserve(spare);
        Ok(Some(pairs))
    }

    /// `(group, position)` of each full scheduled block a swapped sequence keeps a CPU copy
    /// of.
    pub(crate) fn for_each_cpu_copy(&self, seq: &Sequence, mut f: impl FnMut(usize, usize)) {
        if !seq.is_swapped() {
            return;
        }
        let reg = self.registrable(seq);
        for g in 0..1 + seq.cpu_more().len() {
            for (i, &c) in Self::cpu_table(seq, g).iter().enumerate().take(reg) {
                if c != SWAPPED_NULL {
                    f(g, i);
                }
            }
        }
    }
}
