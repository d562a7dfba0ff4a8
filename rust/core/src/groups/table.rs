//! One sequence of a hybrid manager: shared tokens and digests, one table per group.

use crate::hashing::{Digest, Tag};
use std::sync::Arc;

/// Every field is consistent whenever the manager's mutex is free.
#[derive(Debug, Clone)]
pub struct GroupSeq {
    /// Every known token (the whole prompt, then appended ones).
    pub tokens: Vec<u32>,
    /// Tokens scheduled for compute (`scheduled <= tokens.len()`).
    pub scheduled: usize,
    /// Leading table positions served by the prefix cache at `allocate`.
    pub hit_blocks: usize,
    /// Chain digests of the full blocks (`tokens.len() / B`) with caching on, else empty.
    pub digests: Vec<Digest>,
    /// Secret tags of the same blocks under a weak hash, else empty.
    pub tags: Vec<Tag>,
    pub extras: Arc<[u8]>,
    pub lora_id: Option<u64>,
    /// One table per group, all of one length (`>= ceil(scheduled / B)`); each starts with
    /// a run of `NULL` entries (positions that group no longer needs) and holds OWNED blocks
    /// after it. Empty while swapped out.
    pub tables: Vec<Vec<u32>>,
    /// While swapped out: the CPU block of each table entry (`SWAPPED_NULL` for a null one),
    /// tables of the same shape.
    pub cpu: Option<Vec<Vec<u32>>>,
}

/// A null entry of a swapped table (CPU block ids start at 0).
pub const SWAPPED_NULL: u32 = u32::MAX;

impl GroupSeq {
    pub fn len(&self) -> usize {
        self.tables.first().map_or(0, Vec::len)
    }

    /// Table positions full of scheduled tokens that have a digest (the registrable ones).
    pub fn registrable(&self, block_size: usize) -> usize {
        (self.scheduled / block_size).min(self.digests.len())
    }

    /// Leading null entries of group `g`'s table.
    pub fn nulls(&self, g: usize) -> usize {
        self.tables[g]
            .iter()
            .take_while(|&&b| b == super::NULL)
            .count()
    }

    pub fn tag(&self, i: usize) -> Option<Tag> {
        self.tags.get(i).copied()
    }
}
