//! Read-only answers of the hybrid manager: per-sequence queries, counts and stats.

use super::manager::GroupManager;
use crate::error::{Error, Result};
use crate::hashing::Digest;
use crate::sequence::mix;
use crate::stats::Stats;

/// One group's share of the pool, for `stats()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupStats {
    pub kind: &'static str,
    pub used_blocks: usize,
    pub cached_blocks: usize,
    pub hit_blocks: u64,
    pub evictions: u64,
    pub registered_blocks: u64,
}

impl GroupManager {
    fn with_seq<T>(&self, id: u64, f: impl FnOnce(&super::table::GroupSeq) -> T) -> Result<T> {
        let st = self.lock()?;
        st.seqs.get(&id).map(f).ok_or(Error::UnknownSequence(id))
    }

    pub fn block_table(&self, id: u64, group: usize) -> Result<Vec<u32>> {
        self.broken.guarded(false, || {
            self.check_group(group)?;
            self.with_seq(id, |seq| {
                if seq.cpu.is_some() {
                    return Err(Error::Swapped(id));
                }
                Ok(seq.tables[group].clone())
            })?
        })
    }
    pub fn num_tokens(&self, id: u64) -> Result<usize> {
        self.broken
            .guarded(false, || self.with_seq(id, |s| s.tokens.len()))
    }
    pub fn num_scheduled_tokens(&self, id: u64) -> Result<usize> {
        self.broken
            .guarded(false, || self.with_seq(id, |s| s.scheduled))
    }
    /// Every group's table, mixed: group 0's term is the single-group manager's digest.
    pub fn table_digest(&self, id: u64) -> Result<u64> {
        self.broken.guarded(false, || {
            self.with_seq(id, |s| {
                s.tables.iter().enumerate().fold(0u64, |acc, (g, t)| {
                    let d = t
                        .iter()
                        .enumerate()
                        .fold(0u64, |a, (i, &b)| a.wrapping_add(mix(i, b)));
                    acc.wrapping_add(d.wrapping_mul(2 * g as u64 + 1))
                })
            })
        })
    }
    pub fn block_hashes(&self, id: u64) -> Result<Vec<Digest>> {
        self.broken
            .guarded(false, || self.with_seq(id, |s| s.digests.clone()))
    }
    pub fn is_swapped(&self, id: u64) -> Result<bool> {
        self.broken
            .guarded(false, || self.with_seq(id, |s| s.cpu.is_some()))
    }
    pub fn contains(&self, id: u64) -> Result<bool> {
        self.broken
            .guarded(false, || Ok(self.lock()?.seqs.contains_key(&id)))
    }
    pub fn num_sequences(&self) -> Result<usize> {
        self.broken.guarded(false, || Ok(self.lock()?.seqs.len()))
    }
    pub fn num_free_blocks(&self) -> Result<usize> {
        self.broken
            .guarded(false, || Ok(self.lock()?.pool.num_free()))
    }
    pub fn num_cached_blocks(&self) -> Result<usize> {
        self.broken
            .guarded(false, || Ok(self.lock()?.pool.num_cached()))
    }
    pub fn num_available_blocks(&self) -> Result<usize> {
        self.broken
            .guarded(false, || Ok(self.lock()?.pool.available()))
    }
    pub fn num_free_cpu_blocks(&self) -> Result<usize> {
        self.broken
            .guarded(false, || Ok(self.lock()?.cpu_free.len()))
    }

    pub fn stats(&self) -> Result<(Stats, Vec<GroupStats>)> {
        self.broken.guarded(false, || {
            let st = self.lock()?;
            let bs = self.block_size();
            let (mut reserved, mut used) = (0u64, 0u64);
            // Per group: the non-null entries reserve slots, the scheduled tokens in them
            // use them (a window's released entries are neither).
            for seq in st.seqs.values().filter(|s| s.cpu.is_none()) {
                for g in 0..seq.tables.len() {
                    let nulls = seq.nulls(g);
                    reserved += ((seq.len() - nulls) * bs) as u64;
                    used += (seq.scheduled - nulls * bs) as u64;
                }
            }
            let (rq, rh) = st.recent.sums();
            let groups: Vec<GroupStats> = self
                .kinds
                .iter()
                .zip(st.pool.tallies())
                .map(|(k, t)| GroupStats {
                    kind: k.name(),
                    used_blocks: t.used,
                    cached_blocks: t.cached,
                    hit_blocks: t.hit_blocks,
                    evictions: t.evictions,
                    registered_blocks: t.registered,
                })
                .collect();
            let stats = Stats {
                num_blocks: st.pool.num_blocks(),
                block_size: bs,
                free_blocks: st.pool.num_free(),
                used_blocks: groups.iter().map(|g| g.used_blocks).sum(),
                cached_blocks: st.pool.num_cached(),
                num_cpu_blocks: self.config.num_cpu_blocks as usize,
                free_cpu_blocks: st.cpu_free.len(),
                num_sequences: st.seqs.len(),
                prefix_queries: st.t.prefix_queries,
                prefix_hits: st.t.prefix_hits,
                evictions: groups.iter().map(|g| g.evictions).sum(),
                cow_copies: st.t.cow_copies,
                swapped_out_blocks: st.t.swapped_out,
                swapped_in_blocks: st.t.swapped_in,
                reserved_slots: reserved,
                used_slots: used,
                recent_prefix_queries: rq,
                recent_prefix_hits: rh,
                registered_blocks: st.t.registered,
                unregistered_blocks: st.t.unregistered,
                truncated_blocks: st.t.truncated,
            };
            Ok((stats, groups))
        })
    }
}
