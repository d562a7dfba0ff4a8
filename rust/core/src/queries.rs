//! Read-only answers about sequences and the pool: tables, counts and `stats()`.

use crate::counters;
use crate::error::{Error, Result};
use crate::hashing::Digest;
use crate::manager::BlockManager;
use crate::stats::{GroupStats, Stats};
use crate::sync::Ordering;

impl BlockManager {
    pub fn block_table(&self, id: u64) -> Result<Vec<u32>> {
        self.block_table_of(id, 0)
    }

    /// Group `group`'s block table of a sequence.
    pub fn block_table_of(&self, id: u64, group: usize) -> Result<Vec<u32>> {
        self.check_group(group)?;
        self.with_seq(id, false, |seq| {
            if seq.is_swapped() {
                return Err(Error::Swapped(id));
            }
            Ok(seq.table(group).to_vec())
        })
    }

    pub fn num_tokens(&self, id: u64) -> Result<usize> {
        self.with_seq(id, false, |seq| Ok(seq.tokens.len()))
    }

    pub fn num_scheduled_tokens(&self, id: u64) -> Result<usize> {
        self.with_seq(id, false, |seq| Ok(seq.scheduled))
    }

    pub fn table_digest(&self, id: u64) -> Result<u64> {
        self.with_seq(id, false, |seq| Ok(seq.all_tables_digest()))
    }

    pub fn block_hashes(&self, id: u64) -> Result<Vec<Digest>> {
        self.with_seq(id, false, |seq| Ok(seq.digests.clone()))
    }

    pub fn is_swapped(&self, id: u64) -> Result<bool> {
        self.with_seq(id, false, |seq| Ok(seq.is_swapped()))
    }

    pub fn contains(&self, id: u64) -> bool {
        self.seqs.contains(id)
    }

    pub fn num_sequences(&self) -> usize {
        self.seqs.len()
    }

    pub fn num_free_blocks(&self) -> usize {
        self.gpu.num_free()
    }

    pub fn num_cached_blocks(&self) -> usize {
        self.gpu.num_cached()
    }

    pub fn num_available_blocks(&self) -> usize {
        self.gpu.num_available()
    }

    pub fn num_free_cpu_blocks(&self) -> usize {
        self.cpu.num_free()
    }

    /// Counts and tallies, each read on its own without locks (exact together only when no
    /// call is in flight; see docs/concurrency.md).
    pub fn stats(&self) -> Stats {
        let free = self.gpu.num_free();
        let cached = self.gpu.num_cached();
        let c = &self.counters;
        let recent = self.recent.sums();
        Stats {
            num_blocks: self.gpu.num_blocks(),
            block_size: self.block_size(),
            free_blocks: free,
            used_blocks: self.gpu.num_usable().saturating_sub(free + cached),
            cached_blocks: cached,
            num_cpu_blocks: self.cpu.num_blocks(),
            free_cpu_blocks: self.cpu.num_free(),
            num_sequences: self.seqs.len(),
            prefix_queries: counters::get(&c.prefix_queries),
            prefix_hits: counters::get(&c.prefix_hits),
            evictions: self.gpu.evictions(),
            cow_copies: counters::get(&c.cow_copies),
            swapped_out_blocks: counters::get(&c.swapped_out_blocks),
            swapped_in_blocks: counters::get(&c.swapped_in_blocks),
            // Relaxed: tallies (see the fields).
            reserved_slots: self.reserved_slots.load(Ordering::Relaxed),
            used_slots: self.used_slots.load(Ordering::Relaxed),
            recent_prefix_queries: recent.0,
            recent_prefix_hits: recent.1,
            registered_blocks: counters::get(&c.registered_blocks),
            unregistered_blocks: counters::get(&c.unregistered_blocks),
            truncated_blocks: counters::get(&c.truncated_blocks),
        }
    }

    /// Each group's figures (`groups=` given; empty otherwise). Tallies read on their own.
    pub fn group_stats(&self) -> Vec<GroupStats> {
        if !self.grouped {
            return Vec::new();
        }
        self.kinds
            .iter()
            .enumerate()
            .map(|(g, k)| {
                let t = self.gpu.tally(g as u8);
                let load = |f: fn(&crate::block_pool::GroupTally) -> u64| t.map_or(0, f);
                GroupStats {
                    kind: k.name(),
                    used_blocks: load(|t| t.used.load(Ordering::Relaxed) as u64) as usize,
                    cached_blocks: load(|t| t.cached.load(Ordering::Relaxed) as u64) as usize,
                    hit_blocks: load(|t| counters::get(&t.hit_blocks)),
                    evictions: load(|t| counters::get(&t.evictions)),
                    registered_blocks: load(|t| counters::get(&t.registered)),
                }
            })
            .collect()
    }
}
