//! Construction options, validated once.

use crate::error::{invalid, Result};
use crate::eviction::EvictionKind;
use crate::hashing::HashAlgo;

#[derive(Debug, Clone)]
pub struct Config {
    pub num_blocks: u32,
    pub block_size: usize,
    pub num_cpu_blocks: u32,
    pub enable_prefix_caching: bool,
    pub hash_algo: HashAlgo,
    pub hash_seed: u64,
    /// Fraction of `num_blocks` that `can_allocate` keeps back for running sequences.
    pub watermark: f64,
    pub enable_kv_events: bool,
    /// Report evicted cached blocks to the evicting call's `duties::capture`, for tiers
    /// below the GPU.
    pub record_evictions: bool,
    /// Which CACHED block goes first when blocks run out (`eviction`); LRU by default.
    pub eviction: EvictionKind,
    /// Group requests by cache salt: per-tenant statistics and quotas (`tenants`). The
    /// policy then runs per tenant, in locked mode even for LRU.
    pub tenants: bool,
    /// vLLM's `prefix_cache_retention_interval` for sliding-window groups (`policy::reach`):
    /// `None` caches every full block (dense), `Some(0)` only the blocks a hit at a
    /// sequence's reachable positions reads, `Some(r)` those and the tail of every `r`-token
    /// segment. Checked against the groups when the manager is built.
    pub prefix_cache_retention_interval: Option<usize>,
}

/// Block ids must fit in a `u32` with one value spare, and in an `i32` for the int32 tables.
pub const MAX_BLOCKS: u64 = i32::MAX as u64;

impl Config {
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        Self {
            num_blocks,
            block_size,
            num_cpu_blocks: 0,
            enable_prefix_caching: true,
            hash_algo: HashAlgo::Sha256,
            hash_seed: 0,
            watermark: 0.01,
            enable_kv_events: false,
            record_evictions: false,
            eviction: EvictionKind::Lru,
            tenants: false,
            prefix_cache_retention_interval: None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.num_blocks == 0 || u64::from(self.num_blocks) > MAX_BLOCKS {
            return Err(invalid(format!(
                "num_blocks must be in 1..={MAX_BLOCKS}, got {}",
                self.num_blocks
            )));
        }
        if self.block_size == 0 || self.block_size > 1 << 16 {
            return Err(invalid(format!(
                "block_size must be in 1..=65536, got {}",
                self.block_size
            )));
        }
        if u64::from(self.num_cpu_blocks) > MAX_BLOCKS {
            return Err(invalid(format!(
                "num_cpu_blocks must be at most {MAX_BLOCKS}, got {}",
                self.num_cpu_blocks
            )));
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return Err(invalid(format!(
                "watermark must be in [0, 1), got {}",
                self.watermark
            )));
        }
        Ok(())
    }

    pub fn watermark_blocks(&self) -> usize {
        (self.watermark * f64::from(self.num_blocks)) as usize
    }
}
