//! The operations on every layout but one full-attention group (KV-cache groups of hybrid
//! models): the same sequences, locks, pool and prefix locks as the single-group paths, with
//! one table per group and each group's kind (`policy`) deciding which entries it still
//! needs and which prefix it can serve. One full-attention group keeps its own fast paths
//! (`manager`, `decode`, `batch`); everything here is also correct for it.
//!
//! Exactness of a refused step: a step first releases the entries its groups no longer need
//! (vLLM's `remove_skipped_blocks`), and those blocks count towards what it may take. They
//! are counted (`rc == 1`) under the chain's prefix lock and the sequence locks, where no
//! hit and no fork can add a holder, so the count is a lower bound of what the releases
//! give; the step reserves the rest before it changes anything, and keeps the released
//! blocks' units for itself (`BlockPool::release_table_held`), so no racing taker can take
//! them in between. A refused step changes nothing.

use crate::block_pool::{refcount_overflow, Hit};
use crate::counters;
use crate::error::{invalid, Error, Result};
use crate::events::{KvEvent, Medium};
use crate::hashing::{Digest, Tag};
use crate::manager::{cdiv, prefix_lock_of, BlockManager};
use crate::policy::{hybrid_hit, GroupKind};
use crate::sequence::Sequence;
use std::collections::HashMap;

/// Block 0: with a non-full group, the null block; a table entry a group does not need
/// holds it.
pub const NULL: u32 = 0;

/// A null entry of a swapped table (CPU block ids start at 0).
pub const SWAPPED_NULL: u32 = u32::MAX;

/// One sequence's part of a step: `new` tokens appended first (none for `extend`), then
/// scheduled up to `m` tokens with slots writable up to `to` (`m` plus the lookahead).
pub(crate) struct StepReq<'a> {
    pub new: &'a [u32],
    pub m: usize,
    pub to: usize,
}

impl BlockManager {
    pub(crate) fn num_groups(&self) -> usize {
        self.kinds.len()
    }

    /// Whether `b` is the null block (only a manager with a non-full group has one).
    pub(crate) fn is_null(&self, b: u32) -> bool {
        self.null && b == NULL
    }

    /// `digests` as group `g` keys them in the pool.
    fn keyed(g: usize, digests: &[Digest]) -> Vec<Digest> {
        digests.iter().map(|d| d.keyed(g as u8)).collect()
    }

    /// Release group `g`'s entries `from .. to` of `seq`'s table (none null), tail first.
    /// `held`: keep the units of the blocks this frees for the caller (see the module docs).
    fn release_entries(
        &self,
        seq: &Sequence,
        g: usize,
        range: std::ops::Range<usize>,
        held: bool,
    ) -> Result<usize> {
        let blocks = &seq.table(g)[range.clone()];
        let lo = range.start.min(seq.digests.len());
        let hi = range.end.min(seq.digests.len()).max(lo);
        let digests = Self::keyed(g, &seq.digests[lo..hi]);
        if held {
            self.gpu.release_table_held(blocks, &digests)
        } else {
            self.gpu.release_table(blocks, &digests).map(|()| 0)
        }
    }

    /// Release every group's entries of a table that leaves (tail first, group by group).
    pub(crate) fn release_all_groups(&self, seq: &Sequence) -> Result<()> {
        for g in 0..seq.num_groups() {
            let lo = seq.nulls(g);
            self.release_entries(seq, g, lo..seq.table(g).len(), false)?;
        }
        Ok(())
    }

    /// The event that stores group `g`'s full block `i` of `seq` on `medium`.
    pub(crate) fn stored_event_of(
        &self,
        seq: &Sequence,
        g: usize,
        i: usize,
        medium: Medium,
    ) -> KvEvent {
        let bs = self.block_size();
        KvEvent::BlockStored {
            block_hash: seq.digests[i],
            parent_block_hash: i.checked_sub(1).map(|p| seq.digests[p]),
            token_ids: seq.tokens[i * bs..(i + 1) * bs].to_vec(),
            lora_id: seq.lora_id,
            medium,
            group: g as u8,
        }
    }

    /// Register every group's non-null entries at positions `range` (group order, then
    /// position order); counts the new ones.
    pub(crate) fn register_groups(&self, seq: &Sequence, range: std::ops::Range<usize>) {
        let mut new = 0;
        for g in 0..seq.num_groups() {
            for i in range.clone() {
                let b = seq.table(g)[i];
                if self.is_null(b) {
                    continue;
                }
                let event = || self.stored_event_of(seq, g, i, Medium::Gpu);
                let key = seq.digests[i].keyed(g as u8);
                if self.gpu.register(b, key, seq.tag(i), event) {
                    new += 1;
                    if let Some(t) = self.gpu.tally(g as u8) {
                        counters::add(&t.registered, 1);
                    }
                }
            }
        }
        if new > 0 {
            counters::add(&self.counters.registered_blocks, new);
        }
    }

    /// Take a block for group `g` with a unit the caller holds in `spare`.
    fn take_for(&self, g: usize, spare: &mut usize) -> Result<u32> {
        *spare = spare
            .checked_sub(1)
            .ok_or_else(|| Error::Broken("a block beyond its reservation".into()))?;
        let b = self.gpu.take();
        self.gpu.set_group(b, g as u8);
        Ok(b)
    }

    /// Whether group `g` has block `i` of the chain cached (a read-only look).
    fn present(&self, g: usize, digests: &[Digest], tags: &[Tag], i: usize) -> bool {
        let key = digests[i].keyed(g as u8);
        self.gpu
            .peek(&key)
            .is_some_and(|p| self.gpu.index_tag_is(p.block, tags.get(i).copied()))
    }

    /// The hybrid hit of a chain in blocks (at most `cap`), from read-only looks; `absent`
    /// entries count as missing (pins that lost a race).
    pub(crate) fn hybrid_hit_of(
        &self,
        digests: &[Digest],
        tags: &[Tag],
        cap: usize,
        absent: &[(usize, usize)],
    ) -> usize {
        if !self.config.enable_prefix_caching {
            return 0;
        }
        let cap = cap.min(digests.len());
        hybrid_hit(&self.kinds, self.block_size(), cap, |g, i| {
            !absent.contains(&(g, i)) && self.present(g, digests, tags, i)
        })
    }

    /// First entry group `g` needs when a sequence's next position is `p`.
    fn first_needed(&self, g: usize, p: usize) -> usize {
        self.kinds[g].first_needed(p, self.block_size())
    }

    /// The blocks of a new prompt with a hybrid hit: per group, nulls below what it needs,
    /// the pinned hits, then `total(h)` new entries. Returns the tables and `h`, or `None`
    /// when they do not fit; then, and on an error, nothing is held.
    pub(crate) fn take_grouped_prompt(
        &self,
        total: &dyn Fn(usize) -> usize,
        cap: usize,
        digests: &[Digest],
        tags: &[Tag],
    ) -> Result<Option<(Vec<Vec<u32>>, usize)>> {
        let bs = self.block_size();
        let groups = self.num_groups();
        let mut absent: Vec<(usize, usize)> = Vec::new();
        loop {
            let h = self.hybrid_hit_of(digests, tags, cap, &absent);
            let t = total(h);
            // Every group holds `t` entries less its nulls: beyond the pool nothing fits.
            let held: usize = (0..groups)
                .map(|g| t - self.first_needed(g, h * bs).min(h))
                .sum();
            if held > self.gpu.num_usable() {
                return Ok(None);
            }
            let mut wanted = Vec::new();
            let mut revivals = 0;
            for g in 0..groups {
                let lo = self.first_needed(g, h * bs).min(h);
                for (i, d) in digests.iter().enumerate().take(h).skip(lo) {
                    match self.gpu.peek(&d.keyed(g as u8)) {
                        Some(p) if p.full => return Err(refcount_overflow(p.block)),
                        Some(p) => revivals += usize::from(p.cached),
                        None => {}
                    }
                    wanted.push((g, i));
                }
            }
            let new = groups * (t - h);
            let need = new + revivals;
            if !self.gpu.reserve(need) {
                return Ok(None);
            }
            let mut spare = need;
            let mut pinned: Vec<(usize, usize, u32, bool)> = Vec::with_capacity(wanted.len());
            let mut failure = None;
            let mut lost = None;
            for &(g, i) in &wanted {
                let key = digests[i].keyed(g as u8);
                match self.gpu.pin(&key, tags.get(i).copied(), &mut spare) {
                    Ok(Hit::Pinned { block, revived }) => pinned.push((g, i, block, revived)),
                    Ok(Hit::Miss | Hit::NoRoom) => {
                        lost = Some((g, i));
                        break;
                    }
                    Ok(Hit::Full(b)) => {
                        failure = Some(refcount_overflow(b));
                        break;
                    }
                    Err(e) => {
                        failure = Some(e);
                        break;
                    }
                }
            }
            // Races may have revived what the looks saw owned: settle the units.
            let short = new.saturating_sub(spare);
            if failure.is_some() || lost.is_some() || (short > 0 && !self.gpu.reserve(short)) {
                for &(g, i, b, revived) in pinned.iter().rev() {
                    let key = digests[i].keyed(g as u8);
                    if revived {
                        self.gpu.unpin(b, &key)?;
                    } else {
                        self.gpu.release(b, Some(&key))?;
                    }
                }
                self.gpu.unreserve(spare);
                if let Some(e) = failure {
                    return Err(e);
                }
                match lost {
                    // Try again without the entry that lost its race.
                    Some(entry) => {
                        absent.push(entry);
                        continue;
                    }
                    None => return Ok(None),
                }
            }
            spare += short;
            let mut tables: Vec<Vec<u32>> = (0..groups)
                .map(|g| {
                    crate::alloc::try_with_capacity(t, "a block table").map(|mut v: Vec<u32>| {
                        v.resize(self.first_needed(g, h * bs).min(h), NULL);
                        v
                    })
                })
                .collect::<Result<_>>()?;
            for &(g, _, b, _) in &pinned {
                tables[g].push(b);
                if let Some(tally) = self.gpu.tally(g as u8) {
                    counters::add(&tally.hit_blocks, 1);
                }
            }
            for (g, table) in tables.iter_mut().enumerate() {
                for _ in h..t {
                    table.push(self.take_for(g, &mut spare)?);
                }
            }
            self.gpu.unreserve(spare);
            return Ok(Some((tables, h)));
        }
    }

    /// Install a grouped prompt's tables into a new sequence.
    pub(crate) fn install_tables(&self, seq: &mut Sequence, tables: Vec<Vec<u32>>) {
        let mut tables = tables.into_iter();
        if let Some(first) = tables.next() {
            first.into_iter().for_each(|b| seq.push_block(b));
        }
        seq.more = tables.collect();
        seq.null_block = self.null;
    }

    /// Entries each sequence's groups no longer need at its next position, `(g, i)` group
    /// by group, tail first.
    fn skipped(&self, seq: &Sequence) -> Vec<(usize, usize)> {
        let p = seq.scheduled;
        let mut out = Vec::new();
        for g in 0..seq.num_groups() {
            let lo = seq.nulls(g);
            let hi = self.first_needed(g, p).min(seq.table(g).len());
            out.extend((lo..hi).rev().map(|i| (g, i)));
        }
        out
    }

    /// Blocks writing positions `p .. to` of `seq` takes in every group: copies of shared
    /// entries plus new entries.
    fn grouped_write_need(&self, seq: &Sequence, p: usize, to: usize) -> usize {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        let len = seq.blocks.len();
        let mut need = 0usize;
        for g in 0..seq.num_groups() {
            need += (p / bs..end.min(len))
                .filter(|&i| self.gpu.state(seq.table(g)[i]).load().rc() > 1)
                .count();
            need = need.saturating_add(end.saturating_sub(len));
        }
        need
    }

    /// Make positions `p .. to` writable in every group with units from `spare`: per group,
    /// copy the shared entries (pairs to `pairs`), then add entries.
    fn grouped_write(
        &self,
        seq: &mut Sequence,
        p: usize,
        to: usize,
        spare: &mut usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let bs = self.block_size();
        let end = cdiv(to, bs);
        let len = seq.blocks.len();
        for g in 0..seq.num_groups() {
            for i in p / bs..end.min(len) {
                let src = seq.table(g)[i];
                // Refcounts of a locked sequence's unregistered blocks only fall: a block
                // another holder let go of since the count is ours to write.
                if self.gpu.state(src).load().rc() > 1 {
                    let dst = self.take_for(g, spare)?;
                    pairs.push((src, dst));
                    seq.set_entry(g, i, dst);
                    let key = seq.digests.get(i).map(|d| d.keyed(g as u8));
                    self.gpu.release(src, key.as_ref())?;
                    counters::add(&self.counters.cow_copies, 1);
                }
            }
            for _ in len..end {
                let b = self.take_for(g, spare)?;
                seq.push_entry(g, b);
            }
        }
        Ok(())
    }

    /// One step of each locked sequence (batch order), all or nothing: every sequence's
    /// skipped entries are released first, then each is written, then each registered.
    /// Returns the copy-on-write pairs, or `None` when the blocks do not fit (nothing
    /// changed). Pushes each sequence's new slots per group to `slots` when given.
    pub(crate) fn step_grouped(
        &self,
        seqs: &mut [&mut Sequence],
        reqs: &[StepReq<'_>],
        slots: Option<&mut Vec<Vec<i64>>>,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        let bs = self.block_size();
        let mut keys = Vec::new();
        let mut skipped = Vec::with_capacity(seqs.len());
        for (seq, req) in seqs.iter_mut().zip(reqs) {
            // Room first, so that running out of memory fails before anything changed.
            self.reserve_tokens(seq, req.new.len())?;
            let more = cdiv(req.to, bs).saturating_sub(seq.blocks.len());
            seq.reserve_entries(more)?;
            let s = self.skipped(seq);
            if !s.is_empty() && self.config.enable_prefix_caching {
                if let Some(first) = seq.digests.first() {
                    keys.push(prefix_lock_of(first));
                }
            }
            keys.extend(self.schedule_prefix_key(seq, req.m, req.new));
            skipped.push(s);
        }
        let _prefix = self.lock_prefixes(keys)?;
        // References the releases drop per block (a block shared by two sequences of the
        // batch is dropped twice) and the blocks they free.
        let mut drops: HashMap<u32, u32> = HashMap::new();
        let mut need = 0usize;
        for ((seq, req), s) in seqs.iter().zip(reqs).zip(&skipped) {
            for &(g, i) in s {
                *drops.entry(seq.table(g)[i]).or_insert(0) += 1;
            }
            let p = seq.scheduled;
            need = need.saturating_add(self.grouped_write_need(seq, p, req.to));
        }
        let freed = drops
            .iter()
            .filter(|(&b, &k)| self.gpu.state(b).load().rc() == k)
            .count();
        let reserved = need.saturating_sub(freed);
        if !self.gpu.reserve(reserved) {
            return Ok(None);
        }
        let mut spare = reserved;
        for (seq, s) in seqs.iter_mut().zip(&skipped) {
            spare += self.release_skipped(seq, s)?;
        }
        let mut pairs = Vec::new();
        for (seq, req) in seqs.iter_mut().zip(reqs) {
            let p = seq.scheduled;
            self.grouped_write(seq, p, req.to, &mut spare, &mut pairs)?;
            // The caller reserved the room (`reserve_tokens`): this cannot fail half way.
            seq.tokens.extend_from_slice(req.new);
            self.extend_digests(seq);
        }
        for (seq, req) in seqs.iter_mut().zip(reqs) {
            let before = self.registrable(seq);
            seq.scheduled = req.m;
            self.register_groups(seq, before..self.registrable(seq));
        }
        if let Some(out) = slots {
            for (g, row) in out.iter_mut().enumerate() {
                for (seq, req) in seqs.iter().zip(reqs) {
                    let n = req.m - 1;
                    row.push(i64::from(seq.table(g)[n / bs]) * bs as i64 + (n % bs) as i64);
                }
            }
        }
        self.gpu.unreserve(spare);
        Ok(Some(pairs))
    }

    /// Release the planned skipped entries of one sequence (null them; group by group, tail
    /// first), keeping the units of the blocks that leave. Returns those units.
    fn release_skipped(&self, seq: &mut Sequence, skipped: &[(usize, usize)]) -> Result<usize> {
        let mut kept = 0;
        let mut k = 0;
        while k < skipped.len() {
            // One group's run: positions hi-1 down to lo, contiguous.
            let g = skipped[k].0;
            let run = skipped[k..].iter().take_while(|(h, _)| *h == g).count();
            let hi = skipped[k].1 + 1;
            let lo = skipped[k + run - 1].1;
            kept += self.release_entries(seq, g, lo..hi, true)?;
            for i in lo..hi {
                seq.set_entry(g, i, NULL);
            }
            k += run;
        }
        Ok(kept)
    }

    /// `truncate` with groups (docs/semantics.md): checks, then withdraw the hashed partial
    /// blocks held alone, release every group's dropped entries, copy the shared partial
    /// blocks in group order.
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
        let partial: Vec<Option<u32>> = (0..seq.num_groups())
            .map(|g| {
                let b = *seq.table(g).get(i)?;
                (m % bs != 0 && !self.is_null(b) && self.gpu.state(b).load().hashed()).then_some(b)
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
        let mut shared = vec![false; partial.len()];
        for (g, b) in partial.iter().enumerate() {
            if let Some(b) = *b {
                let key = seq.digests[i].keyed(g as u8);
                shared[g] = !self.gpu.retract(b, &key, true);
            }
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
            if let (Some(src), true) = (*b, shared[g]) {
                let dst = self.take_for(g, &mut spare)?;
                pairs.push((src, dst));
                seq.set_entry(g, i, dst);
                self.gpu
                    .release(src, Some(&seq.digests[i].keyed(g as u8)))?;
                counters::add(&self.counters.cow_copies, 1);
            }
        }
        self.gpu.unreserve(spare);
        seq.tokens.truncate(m);
        seq.digests.truncate(seq.digests.len().min(i));
        seq.tags.truncate(seq.tags.len().min(i));
        seq.scheduled = seq.scheduled.min(m);
        seq.hit_blocks = seq.hit_blocks.min(i);
        Ok(Some(pairs))
    }

    /// Withdraw from the cache, group by group and tail first, the entries past the first `c`
    /// tokens that `seq` registered (not hits).
    pub(crate) fn retract_grouped(&self, seq: &Sequence, c: usize) {
        let from = (c / self.block_size()).max(seq.hit_blocks);
        for g in 0..seq.num_groups() {
            for i in (from..self.registrable(seq)).rev() {
                let b = seq.table(g)[i];
                if !self.is_null(b) && self.gpu.retract(b, &seq.digests[i].keyed(g as u8), false) {
                    counters::add(&self.counters.unregistered_blocks, 1);
                }
            }
        }
    }

    /// Every non-null entry of every table of `seq`.
    pub(crate) fn held_entries<'s>(&'s self, seq: &'s Sequence) -> impl Iterator<Item = u32> + 's {
        (0..seq.num_groups())
            .flat_map(move |g| seq.table(g).iter().copied())
            .filter(move |&b| !self.is_null(b))
    }

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
        seq.more.clear();
        let mut rows = rows.into_iter();
        seq.cpu_blocks = rows.next();
        seq.cpu_more = rows.collect();
        counters::add(&self.counters.swapped_out_blocks, count);
        self.for_each_cpu_copy(seq, |g, i| {
            self.gpu
                .push_event(|| self.stored_event_of(seq, g, i, Medium::Cpu));
        });
        Ok(Some(pairs))
    }

    /// The CPU table of group `g` of a swapped sequence.
    fn cpu_table(seq: &Sequence, g: usize) -> &[u32] {
        if g == 0 {
            seq.cpu_blocks.as_deref().unwrap_or_default()
        } else {
            &seq.cpu_more[g - 1]
        }
    }

    /// Every CPU block a swapped sequence holds, group by group in table order.
    pub(crate) fn cpu_held(seq: &Sequence) -> Vec<u32> {
        (0..1 + seq.cpu_more.len())
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
        let mut tables = Vec::with_capacity(1 + seq.cpu_more.len());
        for g in 0..1 + seq.cpu_more.len() {
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
        seq.cpu_more.clear();
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
        for g in 0..1 + seq.cpu_more.len() {
            for (i, &c) in Self::cpu_table(seq, g).iter().enumerate().take(reg) {
                if c != SWAPPED_NULL {
                    f(g, i);
                }
            }
        }
    }

    /// `fork` with groups: one more holder of every non-null entry of every table; on a
    /// refcount overflow the shares taken so far are given back.
    pub(crate) fn share_all(&self, seq: &Sequence) -> Result<()> {
        let held: Vec<u32> = self.held_entries(seq).collect();
        for (k, &b) in held.iter().enumerate() {
            if self.gpu.state(b).share().is_err() {
                for &back in held[..k].iter().rev() {
                    // The parent still holds each: this only lowers the count back.
                    self.gpu.release(back, None)?;
                }
                return Err(refcount_overflow(b));
            }
        }
        Ok(())
    }
}

impl BlockManager {
    /// The hybrid hit of a prompt in blocks, under its prefix lock (read-only looks), and
    /// with `k` scheduled prompt tokens its admission (`can_allocate`).
    pub(crate) fn grouped_prefix(
        &self,
        tokens: &[u32],
        extras: &[u8],
        k: Option<usize>,
    ) -> Result<(usize, Option<crate::stats::AllocStatus>)> {
        let bs = self.block_size();
        let n = tokens.len();
        let (digests, tags) = if self.config.enable_prefix_caching {
            let d = self.hasher.hash_chain(tokens, bs, extras);
            let t = match &self.tagger {
                Some(t) => t.tag_chain(tokens, bs, extras),
                None => Vec::new(),
            };
            (d, t)
        } else {
            (Vec::new(), Vec::new())
        };
        // Inside the gate: a reset is all before or all after.
        let _gate = self.enter()?;
        let _prefix = self.lock_prefixes(crate::manager::chain_lock(&digests))?;
        let h = self.hybrid_hit_of(&digests, &tags, (n - 1) / bs, &[]);
        let Some(k) = k else { return Ok((h, None)) };
        let groups = self.num_groups();
        let len = cdiv((h * bs + k).min(n), bs);
        let (mut held, mut cached) = (0, 0);
        for g in 0..groups {
            let lo = self.first_needed(g, h * bs).min(h);
            for d in digests.iter().take(h).skip(lo) {
                held += 1;
                let p = self.gpu.peek(&d.keyed(g as u8));
                cached += usize::from(p.is_some_and(|p| p.cached));
            }
        }
        let new = (len - h) * groups;
        Ok((h, Some(self.admission_of(new + held, new + cached))))
    }
}

impl BlockManager {
    /// One token to each locked sequence (batch order) with `lookahead` slots past it, for
    /// `append_batch` and a running batch's step, keeping the `stats()` tallies.
    pub(crate) fn step_batch_grouped(
        &self,
        seqs: &mut [&mut Sequence],
        tokens: &[u32],
        lookahead: usize,
        slots: Option<&mut Vec<Vec<i64>>>,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        let bs = self.block_size();
        let reqs: Vec<StepReq<'_>> = seqs
            .iter()
            .zip(tokens)
            .map(|(seq, t)| {
                let m = seq.tokens.len() + 1;
                StepReq {
                    new: std::slice::from_ref(t),
                    m,
                    to: m.saturating_add(lookahead),
                }
            })
            .collect();
        let before = seqs.iter().fold((0, 0), |acc, s| {
            let f = s.footprint(bs);
            (acc.0 + f.0, acc.1 + f.1)
        });
        let out = self.step_grouped(seqs, &reqs, slots)?;
        if out.is_some() {
            let after = seqs.iter().fold((0, 0), |acc, s| {
                let f = s.footprint(bs);
                (acc.0 + f.0, acc.1 + f.1)
            });
            self.account(before, after);
        }
        Ok(out)
    }
}
