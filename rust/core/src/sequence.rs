//! One sequence's state: its block table, tokens and chain digests.

use crate::hashing::{Digest, Tag};
use crate::retention::RetentionSpec;
use std::sync::Arc;

/// Held under the sequence's own mutex; every field is consistent whenever the lock is free.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// GPU block ids, logical order. Empty while swapped out. `len * block_size >= scheduled`.
    pub blocks: Vec<u32>,
    /// Every known token of the sequence (the whole prompt, then generated ones).
    pub tokens: Vec<u32>,
    /// Tokens scheduled for compute (their KV is written by the step that runs them):
    /// `scheduled <= tokens.len()`. Only blocks full of scheduled tokens are registered.
    pub scheduled: usize,
    /// The leading blocks that came from the prefix cache (`hit_blocks * block_size <=
    /// scheduled`): a retraction (`free` with fewer computed tokens) never touches them.
    pub hit_blocks: usize,
    /// Chain digests of the full blocks when prefix caching is on; empty otherwise. A
    /// self-hashed sequence has `tokens.len() / block_size` of them, hashed from its tokens; a
    /// caller-keyed one (`keyed`) has one per key the caller gave, at most that many. A
    /// hashed block in `blocks[i]` is registered under `digests[i]`; only `i <
    /// registrable()` (full of scheduled tokens, digested, below the hold) is ever registered
    /// by this sequence.
    pub digests: Vec<Digest>,
    /// Secret tags of the same blocks (`hit_tag`), one per digest, when the manager verifies
    /// hits; empty otherwise. A hashed block in `blocks[i]` is registered with `tags[i]`.
    pub tags: Vec<Tag>,
    /// Encoded extra keys (salt, LoRA id), shared by forks.
    pub extras: Arc<[u8]>,
    pub lora_id: Option<u64>,
    /// `Some` while swapped out: the CPU blocks holding group 0's KV, logical order
    /// (`SWAPPED_NULL` where the table held the null block).
    pub cpu_blocks: Option<Vec<u32>>,
    /// Groups `1..`'s tables (KV-cache groups), boxed so that a sequence of one group stays
    /// as small as before (the decode step's misses are per sequence). `None` with one group.
    others: Option<Box<Others>>,
    /// Whether block 0 is the manager's null block (then a table's leading zeros are null
    /// entries, not a block).
    pub null_block: bool,
    /// Caller-keyed (`block_hashes=`): `digests` come only from the caller's keys, never from
    /// the tokens; fixed at creation and kept by forks.
    pub keyed: bool,
    /// Held registration (`register=False`): only the leading `hold` blocks may be
    /// registered; `NO_HOLD` when not held. Only rises (`register`), except that `truncate`
    /// lowers it to the full blocks it keeps, so every block this sequence registered stays
    /// below it.
    pub hold: u32,
    /// Sum over `i` of `mix(i, blocks[i])`: equal tables give equal digests, and replacing
    /// one entry updates it in O(1).
    pub table_digest: u64,
}

/// The tables of a sequence's groups `1..`.
#[derive(Debug, Clone, Default)]
struct Others {
    /// Each as long as `blocks`, starting with a run of null entries (block 0, positions that
    /// group no longer needs). Empty while swapped out.
    tables: Vec<Vec<u32>>,
    /// While swapped out: the CPU blocks of groups `1..`, shaped as `tables` was.
    cpu: Vec<Vec<u32>>,
    /// `allocate(retention=...)` with the prompt's length (where decode retention starts),
    /// shared by forks. Here, not in `Sequence`, so that a sequence without it stays small.
    retention: Option<Arc<(RetentionSpec, usize)>>,
    /// Its tenant (`tenants`): the id of its cache salt; `UNSALTED` otherwise.
    tenant: u32,
    /// Token positions a later hit can resume at, whose window tails its window groups cache
    /// under sparse retention (`policy::reach`); shared by forks. Empty when dense.
    reachable: Option<Arc<[usize]>>,
}

impl Others {
    fn is_empty(&self) -> bool {
        self.tables.is_empty()
            && self.cpu.is_empty()
            && self.retention.is_none()
            && self.tenant == 0
            && self.reachable.is_none()
    }
}

/// `Sequence::hold` of a sequence that is not held.
pub const NO_HOLD: u32 = u32::MAX;

/// A position-aware 64-bit mix of one table entry (splitmix64's finaliser).
pub fn mix(position: usize, block: u32) -> u64 {
    let mut z = ((position as u64) << 32 | u64::from(block)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Sequence {
    pub fn new(tokens: Vec<u32>, extras: Arc<[u8]>, lora_id: Option<u64>) -> Self {
        Self {
            blocks: Vec::new(),
            tokens,
            scheduled: 0,
            hit_blocks: 0,
            digests: Vec::new(),
            tags: Vec::new(),
            extras,
            lora_id,
            cpu_blocks: None,
            others: None,
            null_block: false,
            keyed: false,
            hold: NO_HOLD,
            table_digest: 0,
        }
    }

    /// The blocks the hold lets register (`usize::MAX` when not held).
    pub fn hold_limit(&self) -> usize {
        if self.hold == NO_HOLD {
            usize::MAX
        } else {
            self.hold as usize
        }
    }

    /// Lower the hold (if any) to `blocks` (`truncate`).
    pub fn clamp_hold(&mut self, blocks: usize) {
        if self.hold != NO_HOLD {
            self.hold = self.hold.min(u32::try_from(blocks).unwrap_or(u32::MAX - 1));
        }
    }

    /// Groups `1..`'s tables (empty with one group, and while swapped out).
    pub fn more(&self) -> &[Vec<u32>] {
        self.others.as_ref().map_or(&[], |o| &o.tables)
    }

    /// While swapped out, groups `1..`'s CPU tables.
    pub fn cpu_more(&self) -> &[Vec<u32>] {
        self.others.as_ref().map_or(&[], |o| &o.cpu)
    }

    /// Set groups `1..`'s tables and CPU tables.
    pub fn set_more(&mut self, tables: Vec<Vec<u32>>, cpu: Vec<Vec<u32>>) {
        let o = self.others_mut();
        (o.tables, o.cpu) = (tables, cpu);
        if o.is_empty() {
            self.others = None;
        }
    }

    /// Its tenant (`UNSALTED` without tenants).
    pub fn tenant(&self) -> u32 {
        self.others.as_ref().map_or(0, |o| o.tenant)
    }

    pub fn set_tenant(&mut self, tenant: u32) {
        if tenant != 0 || self.others.is_some() {
            self.others_mut().tenant = tenant;
        }
    }

    /// Its retention and prompt length (`allocate(retention=...)`).
    pub fn retention(&self) -> Option<&(RetentionSpec, usize)> {
        self.others.as_ref().and_then(|o| o.retention.as_deref())
    }

    pub fn set_retention(&mut self, retention: Option<Arc<(RetentionSpec, usize)>>) {
        if retention.is_some() || self.others.is_some() {
            self.others_mut().retention = retention;
        }
    }

    /// The positions a later hit can resume at (`allocate`'s `reachable`; empty when the
    /// manager caches window groups densely).
    pub fn reachable(&self) -> &[usize] {
        self.others
            .as_ref()
            .and_then(|o| o.reachable.as_deref())
            .unwrap_or(&[])
    }

    pub fn set_reachable(&mut self, reachable: Option<Arc<[usize]>>) {
        if reachable.is_some() || self.others.is_some() {
            self.others_mut().reachable = reachable;
        }
    }

    fn others_mut(&mut self) -> &mut Others {
        self.others.get_or_insert_with(Box::default)
    }

    /// Leading null entries of group `g`'s table.
    pub fn nulls(&self, g: usize) -> usize {
        if !self.null_block {
            return 0;
        }
        // The nulls are a leading run and no other entry is 0 (the null block is never
        // handed out): a binary search finds the run's end.
        self.table(g).partition_point(|&b| b == 0)
    }

    /// The number of groups whose tables this sequence holds.
    pub fn num_groups(&self) -> usize {
        1 + self.more().len()
    }

    /// Group `g`'s table (group 0's is `blocks`).
    pub fn table(&self, g: usize) -> &[u32] {
        if g == 0 {
            &self.blocks
        } else {
            &self.more()[g - 1]
        }
    }

    /// Append an entry to group `g`'s table.
    pub fn push_entry(&mut self, g: usize, block: u32) {
        if g == 0 {
            self.push_block(block);
        } else {
            self.others_mut().tables[g - 1].push(block);
        }
    }

    /// Replace entry `i` of group `g`'s table.
    pub fn set_entry(&mut self, g: usize, i: usize, block: u32) {
        if g == 0 {
            self.replace_block(i, block);
        } else {
            self.others_mut().tables[g - 1][i] = block;
        }
    }

    /// Drop group `g`'s entries from `len` on (the caller's to release).
    pub fn truncate_table(&mut self, g: usize, len: usize) -> Vec<u32> {
        if g == 0 {
            self.truncate_blocks(len)
        } else {
            let t = &mut self.others_mut().tables[g - 1];
            t.split_off(len.min(t.len()))
        }
    }

    /// Room for `k` more entries in every table, so that a step cannot fail half way.
    pub fn reserve_entries(&mut self, k: usize) -> crate::error::Result<()> {
        crate::alloc::try_grow(&mut self.blocks, k, "a block table")?;
        for t in self.others.iter_mut().flat_map(|o| o.tables.iter_mut()) {
            crate::alloc::try_grow(t, k, "a block table")?;
        }
        Ok(())
    }

    /// Every group's table digest mixed: group 0's term is the single-group digest.
    pub fn all_tables_digest(&self) -> u64 {
        self.more()
            .iter()
            .enumerate()
            .fold(self.table_digest, |acc, (k, t)| {
                let d = t
                    .iter()
                    .enumerate()
                    .fold(0u64, |a, (i, &b)| a.wrapping_add(mix(i, b)));
                acc.wrapping_add(d.wrapping_mul(2 * (k as u64 + 1) + 1))
            })
    }

    /// The placeholder a pending cell holds until its creating call fills it.
    pub fn empty() -> Self {
        Self::new(Vec::new(), Arc::from(Vec::new()), None)
    }

    /// `(reserved slots, used slots)` this sequence adds to `stats()`: its GPU blocks'
    /// capacity and its scheduled tokens while resident, nothing while swapped out.
    pub fn footprint(&self, block_size: usize) -> (u64, u64) {
        if self.is_swapped() {
            return (0, 0);
        }
        if !self.null_block {
            let g = self.num_groups() as u64;
            return (
                g * (self.blocks.len() * block_size) as u64,
                g * self.scheduled as u64,
            );
        }
        // Per group: the non-null entries reserve slots, the scheduled tokens in them use
        // them (a window's released entries are neither).
        (0..self.num_groups()).fold((0, 0), |(r, u), g| {
            let nulls = self.nulls(g);
            (
                r + ((self.blocks.len() - nulls) * block_size) as u64,
                u + (self.scheduled - nulls * block_size) as u64,
            )
        })
    }

    /// The tag of full block `i`, if the manager verifies hits.
    pub fn tag(&self, i: usize) -> Option<Tag> {
        self.tags.get(i).copied()
    }

    pub fn is_swapped(&self) -> bool {
        self.cpu_blocks.is_some()
    }

    pub fn push_block(&mut self, block: u32) {
        self.table_digest = self
            .table_digest
            .wrapping_add(mix(self.blocks.len(), block));
        self.blocks.push(block);
    }

    pub fn replace_block(&mut self, i: usize, block: u32) {
        self.table_digest = self
            .table_digest
            .wrapping_sub(mix(i, self.blocks[i]))
            .wrapping_add(mix(i, block));
        self.blocks[i] = block;
    }

    /// Drop the table entries from `len` on (they are the caller's to release).
    pub fn truncate_blocks(&mut self, len: usize) -> Vec<u32> {
        for i in len..self.blocks.len() {
            self.table_digest = self.table_digest.wrapping_sub(mix(i, self.blocks[i]));
        }
        self.blocks.split_off(len.min(self.blocks.len()))
    }

    pub fn clear_blocks(&mut self) -> Vec<u32> {
        self.table_digest = 0;
        std::mem::take(&mut self.blocks)
    }

    /// The slot of token position `p`.
    pub fn slot(&self, p: usize, block_size: usize) -> i64 {
        self.blocks[p / block_size] as i64 * block_size as i64 + (p % block_size) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sequence_fits_three_cache_lines_whatever_its_groups() {
        // The decode step touches every member's sequence: groups `1..` are boxed so that a
        // single-group sequence pays nothing for them.
        assert!(
            std::mem::size_of::<Sequence>() <= 192,
            "{}",
            std::mem::size_of::<Sequence>()
        );
    }

    #[test]
    fn table_digest_tracks_pushes_and_replacements() {
        let mut a = Sequence::new(vec![], Arc::from(vec![0u8]), None);
        let mut b = a.clone();
        a.push_block(3);
        a.push_block(4);
        b.push_block(3);
        b.push_block(9);
        assert_ne!(a.table_digest, b.table_digest);
        b.replace_block(1, 4);
        assert_eq!(a.table_digest, b.table_digest);
        let mut swapped = Sequence::new(vec![], Arc::from(vec![0u8]), None);
        swapped.push_block(4);
        swapped.push_block(3);
        assert_ne!(a.table_digest, swapped.table_digest, "position matters");
        assert_eq!(a.slot(17, 16), 4 * 16 + 1);
    }
}
