//! Moving a sequence between the GPU pool and the CPU swap space.

use crate::counters;
use crate::error::{Error, Result};
use crate::manager::{chain_lock, BlockManager};
use crate::stats::AllocStatus;

impl BlockManager {
    /// Move a sequence's KV to CPU blocks. Returns the `(gpu, cpu)` pairs to copy before any
    /// later device work, or `None` when the CPU space is too small (nothing changed).
    pub fn swap_out(&self, id: u64) -> Result<Option<Vec<(u32, u32)>>> {
        self.with_seq(id, true, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            if !self.plain() {
                return self.swap_out_grouped(seq);
            }
            let Some(cpu) = self.cpu.take(seq.blocks.len()) else {
                return Ok(None);
            };
            let pairs: Vec<_> = seq
                .blocks
                .iter()
                .copied()
                .zip(cpu.iter().copied())
                .collect();
            self.retain(seq, 0, seq.blocks.len());
            let gpu = seq.clear_blocks();
            // Hashed blocks stay CACHED on the GPU: a later prompt may hit them (swap-in
            // copies every block back instead; see `swap_in`).
            self.release_blocks(&gpu, &seq.digests)?;
            counters::add(&self.counters.swapped_out_blocks, cpu.len());
            seq.cpu_blocks = Some(cpu);
            self.cpu_copies_stored(seq);
            Ok(Some(pairs))
        })
    }

    /// Bring a swapped-out sequence back into fresh GPU blocks, one per CPU block, and
    /// copy every one: copies of its full blocks that are still cached on the GPU are not
    /// reused (a duplicate's digest stays registered to the cached copy, and the fresh block
    /// stays unhashed). Returns the `(cpu, gpu)` pairs to copy, or `None` when the GPU blocks
    /// do not fit (nothing changed).
    pub fn swap_in(&self, id: u64) -> Result<Option<Vec<(u32, u32)>>> {
        self.with_seq(id, true, |seq| {
            let Some(cpu) = seq.cpu_blocks.as_ref() else {
                return Err(Error::NotSwapped(id));
            };
            let keys = chain_lock(&seq.digests);
            let _prefix = self.lock_prefixes(keys)?;
            if !self.plain() {
                return self.swap_in_grouped(seq);
            }
            if !self.gpu.reserve(cpu.len()) {
                return Ok(None);
            }
            let cpu = seq.cpu_blocks.take().unwrap_or_default();
            let mut gpu = Vec::with_capacity(cpu.len());
            self.gpu.take_into(cpu.len(), &mut gpu);
            gpu.iter().for_each(|&g| seq.push_block(g));
            let pairs: Vec<_> = cpu.iter().copied().zip(gpu).collect();
            self.cpu.give_back(&cpu);
            self.cpu_copies_removed(seq);
            self.register_range(seq, 0..self.registrable(seq));
            counters::add(&self.counters.swapped_in_blocks, cpu.len());
            Ok(Some(pairs))
        })
    }

    pub fn can_swap_in(&self, id: u64) -> Result<AllocStatus> {
        let need = self.with_seq(id, false, |seq| {
            if !seq.is_swapped() {
                return Err(Error::NotSwapped(id));
            }
            Ok(Self::cpu_held(seq).len())
        })?;
        Ok(self.admission(need))
    }
}
