//! A snapshot of the manager's counts, for `stats()`.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    pub num_blocks: usize,
    pub block_size: usize,
    pub free_blocks: usize,
    /// `num_blocks - free_blocks - cached_blocks`, clamped at 0: derived from the other two
    /// reads, so exact only when no call is in flight (docs/concurrency.md).
    pub used_blocks: usize,
    pub cached_blocks: usize,
    pub num_cpu_blocks: usize,
    pub free_cpu_blocks: usize,
    pub num_sequences: usize,
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub evictions: u64,
    pub cow_copies: u64,
    pub swapped_out_blocks: u64,
    pub swapped_in_blocks: u64,
    /// Slots in the blocks that resident sequences hold (`len(blocks) * block_size`, summed).
    pub reserved_slots: u64,
    /// Scheduled tokens of resident sequences.
    pub used_slots: u64,
    /// `prefix_queries` and `prefix_hits` over the last `RECENT_REQUESTS` allocations.
    pub recent_prefix_queries: u64,
    pub recent_prefix_hits: u64,
    pub registered_blocks: u64,
    pub unregistered_blocks: u64,
    pub truncated_blocks: u64,
}

/// One group's share of the pool, for `stats()` (managers built with `groups=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupStats {
    pub kind: &'static str,
    pub used_blocks: usize,
    pub cached_blocks: usize,
    pub hit_blocks: u64,
    pub evictions: u64,
    pub registered_blocks: u64,
}

/// OK: fits now above the watermark; LATER: fits once blocks are freed; NEVER: too big.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocStatus {
    Ok,
    Later,
    Never,
}
