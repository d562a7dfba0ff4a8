//! `GroupManager`: a block manager whose sequences hold one table per KV-cache group over
//! one shared pool (docs/semantics.md, "KV-cache groups"). Every call runs under one mutex,
//! so each is trivially linearizable; the single-group manager keeps its lock-free paths.

use super::hit::hybrid_hit;
use super::kind::GroupKind;
use super::pool::{GroupPool, Key, NULL};
use super::table::GroupSeq;
use crate::alloc::try_grow;
use crate::broken::BrokenGuard;
use crate::config::Config;
use crate::counters::RecentHits;
use crate::error::{invalid, Error, Result};
use crate::events::{KvEvent, Medium};
use crate::hashing::{encode_extras, BlockHasher, Digest, Tag};
use crate::hit_tag::HitTagger;
use crate::manager::{
    cdiv, check_append, check_extend, check_new_tokens, check_tokens, MAX_TOKENS,
};
use crate::sync::{lock, Mutex};
use std::collections::HashMap;
use std::sync::Arc;

/// The most groups one manager takes (a block's group and an event's index fit a byte).
pub const MAX_GROUPS: usize = 64;

/// Counters that only grow (until `reset_prefix_cache` restarts the hit counters).
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tallies {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub cow_copies: u64,
    pub swapped_out: u64,
    pub swapped_in: u64,
    pub registered: u64,
    pub unregistered: u64,
    pub truncated: u64,
}

pub(crate) struct State {
    pub pool: GroupPool,
    /// Free CPU blocks, popped from the end (`0, 1, 2, ...` first).
    pub cpu_free: Vec<u32>,
    pub seqs: HashMap<u64, GroupSeq>,
    pub t: Tallies,
    pub recent: RecentHits,
}

pub struct GroupManager {
    pub(crate) config: Config,
    pub(crate) kinds: Vec<GroupKind>,
    hasher: BlockHasher,
    tagger: Option<HitTagger>,
    pub(crate) state: Mutex<State>,
    /// Set when a call failed mid-change (a panic or `Error::Broken`): later changes are
    /// refused (docs/concurrency.md, the broken-manager guard).
    pub(crate) broken: BrokenGuard,
}

/// What one scheduling step of one sequence does, planned before anything changes.
pub(crate) struct StepPlan {
    /// `(group, position)` of the entries skipped at the step's first position.
    pub skipped: Vec<(usize, usize)>,
    /// Blocks the step takes: copies of shared entries plus new entries.
    pub need: usize,
}

impl GroupManager {
    pub fn new(config: Config, kinds: Vec<GroupKind>) -> Result<Self> {
        config.validate()?;
        if kinds.is_empty() || kinds.len() > MAX_GROUPS {
            return Err(invalid(format!(
                "groups must hold 1..={MAX_GROUPS} groups, got {}",
                kinds.len()
            )));
        }
        if config.num_blocks < 2 {
            return Err(invalid(
                "num_blocks must be at least 2 with groups (block 0 is the null block)",
            ));
        }
        let pool = GroupPool::new(
            config.num_blocks,
            kinds.len(),
            config.enable_kv_events,
            config.record_evictions,
            config.hash_algo.needs_verified_hits(),
            config.hash_algo.digest_len(),
        )?;
        let mut cpu_free =
            crate::alloc::try_with_capacity(config.num_cpu_blocks as usize, "the CPU free list")?;
        cpu_free.extend((0..config.num_cpu_blocks).rev());
        let tagger = config
            .hash_algo
            .needs_verified_hits()
            .then(HitTagger::random);
        Ok(Self {
            hasher: BlockHasher::new(config.hash_algo, config.hash_seed),
            tagger,
            kinds,
            state: Mutex::new(State {
                pool,
                cpu_free,
                seqs: HashMap::new(),
                t: Tallies::default(),
                recent: RecentHits::default(),
            }),
            broken: BrokenGuard::default(),
            config,
        })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }
    /// Whether a call failed mid-change (see `broken`).
    pub fn is_broken(&self) -> bool {
        self.broken.is_broken()
    }
    pub fn num_groups(&self) -> usize {
        self.kinds.len()
    }
    pub fn kinds(&self) -> &[GroupKind] {
        &self.kinds
    }
    fn caching(&self) -> bool {
        self.config.enable_prefix_caching
    }
    /// The manager's state. In non-blocking mode (the binding holding the GIL) a lock
    /// held elsewhere is `Error::WouldBlock` before anything changed.
    pub(crate) fn lock(&self) -> Result<crate::sync::MutexGuard<'_, State>> {
        if crate::sync::may_wait() {
            return Ok(lock(&self.state));
        }
        crate::sync::try_lock(&self.state).ok_or(Error::WouldBlock)
    }

    /// An `InvalidArgumentError` unless `group` names one of the groups.
    pub fn check_group(&self, group: usize) -> Result<()> {
        if group >= self.kinds.len() {
            return Err(invalid(format!(
                "group {group} out of range: the manager has {} groups",
                self.kinds.len()
            )));
        }
        Ok(())
    }

    fn chain(&self, tokens: &[u32], extras: &[u8]) -> (Vec<Digest>, Vec<Tag>) {
        if !self.caching() {
            return (Vec::new(), Vec::new());
        }
        let bs = self.block_size();
        let digests = self.hasher.hash_chain(tokens, bs, extras);
        let tags = match &self.tagger {
            Some(t) => t.tag_chain(tokens, bs, extras),
            None => Vec::new(),
        };
        (digests, tags)
    }

    /// The hybrid hit of a chain, in blocks, capped at `cap`. Reads only.
    fn hit_of(&self, pool: &GroupPool, digests: &[Digest], tags: &[Tag], cap: usize) -> usize {
        if !self.caching() {
            return 0;
        }
        let cap = cap.min(digests.len());
        hybrid_hit(&self.kinds, self.block_size(), cap, |g, i| {
            pool.find(g as u8, &digests[i], tags.get(i).copied())
                .is_some()
        })
    }

    /// The cached block of each group at each hit position it needs (group-major).
    fn hit_blocks(
        &self,
        pool: &GroupPool,
        digests: &[Digest],
        tags: &[Tag],
        h: usize,
    ) -> Vec<Vec<u32>> {
        let bs = self.block_size();
        self.kinds
            .iter()
            .enumerate()
            .map(|(g, kind)| {
                (0..h)
                    .map(|i| {
                        if i < kind.first_needed(h * bs, bs).min(h) {
                            NULL
                        } else {
                            pool.find(g as u8, &digests[i], tags.get(i).copied())
                                .unwrap_or(NULL)
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Create a sequence for a prompt; returns the hit in tokens or `None` (nothing
    /// changed) when its blocks do not fit.
    pub fn allocate_from(
        &self,
        id: u64,
        tokens: &mut Vec<u32>,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
        num_new_tokens: Option<usize>,
        lookahead: usize,
    ) -> Result<Option<usize>> {
        self.broken.guarded(true, || {
            check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            let k = check_new_tokens(num_new_tokens, n)?;
            let bs = self.block_size();
            let extras: Arc<[u8]> = encode_extras(cache_salt, lora_id).into();
            let (digests, tags) = self.chain(tokens, &extras);
            let mut guard = self.lock()?;
            let st = &mut *guard;
            if st.seqs.contains_key(&id) {
                return Err(Error::DuplicateSequence(id));
            }
            st.seqs
                .try_reserve(1)
                .map_err(|_| Error::OutOfMemory("cannot grow the sequence map".into()))?;
            let h = self.hit_of(&st.pool, &digests, &tags, (n - 1) / bs);
            let hits = self.hit_blocks(&st.pool, &digests, &tags, h);
            for &b in hits.iter().flatten().filter(|&&b| b != NULL) {
                st.pool.check_share(b)?;
            }
            let s = (h * bs + k).min(n);
            let total = cdiv(s.saturating_add(lookahead), bs);
            let g_count = self.kinds.len();
            let cached_hits = hits
                .iter()
                .flatten()
                .filter(|&&b| b != NULL && st.pool.rc(b) == 0)
                .count();
            let new = (total - h).saturating_mul(g_count);
            if new.saturating_add(cached_hits) > st.pool.available() {
                return Ok(None);
            }
            // Every allocation before the first change: a MemoryError changes nothing.
            let mut tables = hits;
            for table in &mut tables {
                try_grow(table, total - h, "a block table")?;
            }
            for (g, table) in tables.iter_mut().enumerate() {
                for (i, b) in table.iter_mut().enumerate().filter(|(_, b)| **b != NULL) {
                    *b = st
                        .pool
                        .share_hit(g as u8, &digests[i], tags.get(i).copied())?;
                }
            }
            for (g, table) in tables.iter_mut().enumerate() {
                for _ in h..total {
                    table.push(st.pool.take(g as u8)?);
                }
            }
            let mut seq = GroupSeq {
                tokens: std::mem::take(tokens),
                scheduled: s,
                hit_blocks: h,
                digests,
                tags,
                extras,
                lora_id,
                tables,
                cpu: None,
            };
            self.register_range(st, &mut seq, h)?;
            if self.caching() {
                st.t.prefix_queries += n as u64;
                st.t.prefix_hits += (h * bs) as u64;
                st.recent.record(n, h * bs);
            }
            st.seqs.insert(id, seq);
            Ok(Some(h * bs))
        })
    }

    /// Register every group's blocks at positions `from .. registrable` (group order, then
    /// position order) that are not hashed yet.
    pub(crate) fn register_range(
        &self,
        st: &mut State,
        seq: &mut GroupSeq,
        from: usize,
    ) -> Result<()> {
        let upto = seq.registrable(self.block_size());
        for g in 0..self.kinds.len() {
            for i in from..upto {
                let b = seq.tables[g][i];
                if b == NULL || st.pool.is_hashed(b) {
                    continue;
                }
                let key = Key {
                    group: g as u8,
                    digest: seq.digests[i],
                    tag: seq.tag(i),
                };
                let stored = || self.stored_event(seq, g, i, Medium::Gpu);
                if st.pool.register(b, key, stored) {
                    st.t.registered += 1;
                }
            }
        }
        Ok(())
    }

    pub(crate) fn stored_event(
        &self,
        seq: &GroupSeq,
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

    /// The plan of scheduling positions `p .. to` (`to` includes the lookahead): the
    /// entries skipped at `p` and the blocks the writes take.
    pub(crate) fn plan_step(
        &self,
        pool: &GroupPool,
        seq: &GroupSeq,
        p: usize,
        to: usize,
    ) -> StepPlan {
        let bs = self.block_size();
        let len = seq.len();
        let end = cdiv(to, bs);
        let mut skipped = Vec::new();
        let mut need = 0usize;
        for (g, kind) in self.kinds.iter().enumerate() {
            let first = kind.first_needed(p, bs).min(len);
            for i in (0..first).rev() {
                if seq.tables[g][i] != NULL {
                    skipped.push((g, i));
                }
            }
            for i in p / bs..end.min(len) {
                if pool.rc(seq.tables[g][i]) > 1 {
                    need += 1;
                }
            }
            need = need.saturating_add(end.saturating_sub(len));
        }
        StepPlan { skipped, need }
    }

    /// Blocks whose last reference the planned releases drop: what they give back.
    pub(crate) fn freed_by(pool: &GroupPool, drops: &HashMap<u32, u32>) -> usize {
        drops.iter().filter(|(&b, &k)| pool.rc(b) == k).count()
    }

    /// Release the planned skipped entries (null them; tail first within each group).
    pub(crate) fn release_skipped(
        st: &mut State,
        seq: &mut GroupSeq,
        skipped: &[(usize, usize)],
    ) -> Result<()> {
        for &(g, i) in skipped {
            let b = std::mem::replace(&mut seq.tables[g][i], NULL);
            st.pool.release(b)?;
        }
        Ok(())
    }

    /// Make positions `p .. to` writable: per group, copy the shared entries (pairs to
    /// `pairs`), then add the new entries.
    pub(crate) fn write_step(
        &self,
        st: &mut State,
        seq: &mut GroupSeq,
        p: usize,
        to: usize,
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        let bs = self.block_size();
        let len = seq.len();
        let end = cdiv(to, bs);
        for g in 0..self.kinds.len() {
            for i in p / bs..end.min(len) {
                let src = seq.tables[g][i];
                if st.pool.rc(src) > 1 {
                    let dst = st.pool.take(g as u8)?;
                    st.pool.release(src)?;
                    seq.tables[g][i] = dst;
                    pairs.push((src, dst));
                    st.t.cow_copies += 1;
                }
            }
            if end > len {
                try_grow(&mut seq.tables[g], end - len, "a block table")?;
                for _ in len..end {
                    let b = st.pool.take(g as u8)?;
                    seq.tables[g].push(b);
                }
            }
        }
        Ok(())
    }

    /// The plan of scheduling positions `p .. to` if it fits, with room reserved for every
    /// table entry and index entry it adds; `None` (nothing changed) if it does not fit.
    fn plan_fitting(
        &self,
        st: &mut State,
        seq: &mut GroupSeq,
        to: usize,
    ) -> Result<Option<StepPlan>> {
        let bs = self.block_size();
        let p = seq.scheduled;
        let plan = self.plan_step(&st.pool, seq, p, to);
        let mut drops = HashMap::new();
        for &(g, i) in &plan.skipped {
            *drops.entry(seq.tables[g][i]).or_insert(0) += 1;
        }
        if plan.need > st.pool.available() + Self::freed_by(&st.pool, &drops) {
            return Ok(None);
        }
        let end = cdiv(to, bs);
        for table in &mut seq.tables {
            let more = end.saturating_sub(table.len());
            try_grow(table, more, "a block table")?;
        }
        Ok(Some(plan))
    }

    /// Carry out a fitting plan: release the skipped entries, write `p .. to`, schedule up
    /// to `m` and register the blocks that became full.
    fn apply_step(
        &self,
        st: &mut State,
        seq: &mut GroupSeq,
        plan: &StepPlan,
        m: usize,
        to: usize,
    ) -> Result<Vec<(u32, u32)>> {
        let p = seq.scheduled;
        Self::release_skipped(st, seq, &plan.skipped)?;
        let mut pairs = Vec::new();
        self.write_step(st, seq, p, to, &mut pairs)?;
        let from = seq.registrable(self.block_size());
        seq.scheduled = m;
        self.register_range(st, seq, from)?;
        Ok(pairs)
    }

    fn resident(seqs: &mut HashMap<u64, GroupSeq>, id: u64) -> Result<&mut GroupSeq> {
        let seq = seqs.get_mut(&id).ok_or(Error::UnknownSequence(id))?;
        if seq.cpu.is_some() {
            return Err(Error::Swapped(id));
        }
        Ok(seq)
    }

    /// Run `f` on the sequence taken out of the map (so `f` may borrow the rest of the
    /// state) and put it back, whatever `f` returns.
    pub(crate) fn with_resident<T>(
        &self,
        id: u64,
        f: impl FnOnce(&mut State, &mut GroupSeq) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.lock()?;
        let st = &mut *guard;
        Self::resident(&mut st.seqs, id)?;
        let mut seq = st.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
        let out = f(st, &mut seq);
        st.seqs.insert(id, seq);
        out
    }

    pub fn extend(&self, id: u64, k: usize, lookahead: usize) -> Result<Option<Vec<(u32, u32)>>> {
        self.broken.guarded(true, || {
            self.with_resident(id, |st, seq| {
                check_extend(id, seq.tokens.len(), seq.scheduled, k)?;
                let m = seq.scheduled + k;
                let to = m.saturating_add(lookahead);
                let Some(plan) = self.plan_fitting(st, seq, to)? else {
                    return Ok(None);
                };
                self.apply_step(st, seq, &plan, m, to).map(Some)
            })
        })
    }

    /// Add `tokens` to the sequence and the digests of the blocks they fill. Reserves
    /// first, so running out of memory changes nothing.
    pub(crate) fn add_tokens(&self, seq: &mut GroupSeq, tokens: &[u32]) -> Result<()> {
        let bs = self.block_size();
        let full = (seq.tokens.len() + tokens.len()) / bs;
        let more = full.saturating_sub(seq.digests.len());
        try_grow(&mut seq.tokens, tokens.len(), "a sequence's tokens")?;
        if self.caching() {
            try_grow(&mut seq.digests, more, "a sequence's digests")?;
            if self.tagger.is_some() {
                try_grow(&mut seq.tags, more, "a sequence's tags")?;
            }
        }
        seq.tokens.extend_from_slice(tokens);
        if !self.caching() {
            return Ok(());
        }
        for i in seq.digests.len()..full {
            let block = &seq.tokens[i * bs..(i + 1) * bs];
            let parent = i
                .checked_sub(1)
                .map_or_else(|| self.hasher.root(), |p| seq.digests[p]);
            seq.digests
                .push(self.hasher.hash_block(&parent, block, &seq.extras));
            if let Some(t) = &self.tagger {
                let parent = i.checked_sub(1).map_or_else(|| t.root(), |p| seq.tags[p]);
                seq.tags.push(t.tag_block(parent, block, &seq.extras));
            }
        }
        Ok(())
    }

    pub fn append_lookahead(
        &self,
        id: u64,
        tokens: &[u32],
        lookahead: usize,
    ) -> Result<Option<Vec<(u32, u32)>>> {
        self.broken.guarded(true, || {
            check_tokens(tokens, "token_ids")?;
            self.with_resident(id, |st, seq| {
                check_append(id, seq.tokens.len(), seq.scheduled, tokens.len())?;
                let m = seq.tokens.len() + tokens.len();
                let to = m.saturating_add(lookahead);
                let Some(plan) = self.plan_fitting(st, seq, to)? else {
                    return Ok(None);
                };
                self.add_tokens(seq, tokens)?;
                self.apply_step(st, seq, &plan, m, to).map(Some)
            })
        })
    }

    /// Drop the tokens past `m`; see docs/semantics.md for the checks groups add.
    pub fn truncate(&self, id: u64, m: usize) -> Result<Option<Vec<(u32, u32)>>> {
        self.broken.guarded(true, || {
            let bs = self.block_size();
            self.with_resident(id, |st, seq| {
                let n = seq.tokens.len();
                if m == 0 || m > n {
                    return Err(invalid(format!(
                        "num_tokens {m} for sequence {id} must be in 1..={n}"
                    )));
                }
                for (g, kind) in self.kinds.iter().enumerate() {
                    let nulls = seq.nulls(g);
                    if nulls * bs > kind.skipped_tokens(m) {
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
                // The hashed block each group would leave partial at position `i`.
                let partial: Vec<Option<u32>> = (0..self.kinds.len())
                    .map(|g| {
                        let b = *seq.tables[g].get(i)?;
                        (m % bs != 0 && st.pool.is_hashed(b)).then_some(b)
                    })
                    .collect();
                let copies = partial
                    .iter()
                    .filter(|b| b.is_some_and(|b| st.pool.rc(b) > 1))
                    .count();
                if copies > st.pool.available() {
                    return Ok(None);
                }
                // One order for every layout (and the reference model's): withdraw the
                // partial blocks held alone, then release every group's dropped entries
                // (tail first, group by group), then copy the shared partial blocks in
                // group order, so the copies may reuse blocks the releases freed.
                for &b in partial.iter().flatten() {
                    if st.pool.rc(b) == 1 {
                        st.pool.unhash(b);
                    }
                }
                for table in &mut seq.tables {
                    while table.len() > keep {
                        let b = table.pop().unwrap_or(NULL);
                        if b != NULL {
                            st.pool.release(b)?;
                            st.t.truncated += 1;
                        }
                    }
                }
                let mut pairs = Vec::new();
                for (g, &hashed) in partial.iter().enumerate() {
                    if let Some(src) = hashed.filter(|&b| st.pool.rc(b) > 1) {
                        let dst = st.pool.take(g as u8)?;
                        st.pool.release(src)?;
                        seq.tables[g][i] = dst;
                        pairs.push((src, dst));
                        st.t.cow_copies += 1;
                    }
                }
                seq.tokens.truncate(m);
                seq.digests.truncate(m / bs);
                seq.tags.truncate(m / bs);
                seq.scheduled = seq.scheduled.min(m);
                seq.hit_blocks = seq.hit_blocks.min(m / bs);
                Ok(Some(pairs))
            })
        })
    }

    pub fn fork(&self, parent: u64, child: u64) -> Result<()> {
        self.broken.guarded(true, || {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            Self::resident(&mut st.seqs, parent)?;
            if st.seqs.contains_key(&child) {
                return Err(Error::DuplicateSequence(child));
            }
            let copy = st.seqs[&parent].clone();
            for &b in copy.tables.iter().flatten().filter(|&&b| b != NULL) {
                st.pool.check_share(b)?;
            }
            st.seqs
                .try_reserve(1)
                .map_err(|_| Error::OutOfMemory("cannot grow the sequence map".into()))?;
            for &b in copy.tables.iter().flatten().filter(|&&b| b != NULL) {
                st.pool.share(b)?;
            }
            st.seqs.insert(child, copy);
            Ok(())
        })
    }

    /// Release a sequence's blocks (withdrawing the uncomputed ones it registered, as
    /// without groups) and forget it.
    pub fn free_computed(&self, id: u64, num_computed_tokens: Option<usize>) -> Result<()> {
        self.broken.guarded(true, || {
            let mut guard = self.lock()?;
            let st = &mut *guard;
            let seq = st.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
            if let Some(c) = num_computed_tokens {
                let n = seq.tokens.len();
                if c > n {
                    return Err(invalid(format!(
                        "num_computed_tokens {c} for sequence {id} must be in 0..={n}"
                    )));
                }
            }
            let seq = st.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
            self.drop_seq(st, &seq, num_computed_tokens)
        })
    }

    pub(crate) fn drop_seq(
        &self,
        st: &mut State,
        seq: &GroupSeq,
        computed: Option<usize>,
    ) -> Result<()> {
        if let Some(cpu) = &seq.cpu {
            self.cpu_copies_removed(st, seq);
            let blocks: Vec<u32> = cpu
                .iter()
                .flatten()
                .copied()
                .filter(|&c| c != super::table::SWAPPED_NULL)
                .collect();
            st.cpu_free.extend(blocks.iter().rev());
            return Ok(());
        }
        let bs = self.block_size();
        let reg = seq.registrable(bs);
        for g in 0..self.kinds.len() {
            if let Some(c) = computed {
                for i in (seq.hit_blocks.max(c / bs)..reg).rev() {
                    let b = seq.tables[g][i];
                    if st.pool.is_hashed(b) {
                        st.pool.unhash(b);
                        st.t.unregistered += 1;
                    }
                }
            }
            for &b in seq.tables[g].iter().rev().filter(|&&b| b != NULL) {
                st.pool.release(b)?;
            }
        }
        Ok(())
    }

    pub fn lookup(
        &self,
        tokens: &[u32],
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<usize> {
        self.broken.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            let extras = encode_extras(cache_salt, lora_id);
            let (digests, tags) = self.chain(tokens, &extras);
            let st = self.lock()?;
            let bs = self.block_size();
            Ok(self.hit_of(&st.pool, &digests, &tags, (tokens.len() - 1) / bs) * bs)
        })
    }

    /// Admission of `total` held blocks of which `need` come from the available ones.
    fn admission(&self, pool: &GroupPool, total: usize, need: usize) -> crate::AllocStatus {
        use crate::AllocStatus;
        let wm = self.config.watermark_blocks();
        if total.saturating_add(wm) > pool.num_blocks() - 1 {
            AllocStatus::Never
        } else if pool.available() >= need.saturating_add(wm) {
            AllocStatus::Ok
        } else {
            AllocStatus::Later
        }
    }

    /// `can_allocate` of a prompt given by its length (no hit credited).
    pub fn can_allocate_count(
        &self,
        num_tokens: u64,
        num_new_tokens: Option<u64>,
    ) -> Result<crate::AllocStatus> {
        self.broken.guarded(false, || {
            if num_tokens == 0 {
                return Err(invalid("num_tokens must be at least 1"));
            }
            if let Some(k) = num_new_tokens {
                if k == 0 || k > num_tokens {
                    return Err(invalid(format!(
                        "num_new_tokens {k} must be in 1..={num_tokens}"
                    )));
                }
            }
            let k = num_new_tokens.unwrap_or(num_tokens);
            let st = self.lock()?;
            let Ok(k) = usize::try_from(k) else {
                return Ok(crate::AllocStatus::Never);
            };
            if num_tokens > MAX_TOKENS as u64 {
                return Ok(crate::AllocStatus::Never);
            }
            let total = cdiv(k, self.block_size()).saturating_mul(self.kinds.len());
            Ok(self.admission(&st.pool, total, total))
        })
    }

    /// `can_allocate` of a prompt given by its tokens: the hybrid hit is credited.
    pub fn can_allocate_prompt(
        &self,
        tokens: &[u32],
        num_new_tokens: Option<u64>,
        cache_salt: Option<&[u8]>,
        lora_id: Option<u64>,
    ) -> Result<crate::AllocStatus> {
        self.broken.guarded(false, || {
            check_tokens(tokens, "token_ids")?;
            let n = tokens.len();
            let k = num_new_tokens.map(|k| usize::try_from(k).unwrap_or(usize::MAX));
            let k = check_new_tokens(k, n)?;
            let bs = self.block_size();
            let extras = encode_extras(cache_salt, lora_id);
            let (digests, tags) = self.chain(tokens, &extras);
            let st = self.lock()?;
            let h = self.hit_of(&st.pool, &digests, &tags, (n - 1) / bs);
            let hits = self.hit_blocks(&st.pool, &digests, &tags, h);
            let len = cdiv((h * bs + k).min(n), bs);
            let held: usize = hits
                .iter()
                .map(|t| t.iter().filter(|&&b| b != NULL).count())
                .sum();
            let g = self.kinds.len();
            let total = (len - h) * g + held;
            let cached = hits
                .iter()
                .flatten()
                .filter(|&&b| b != NULL && st.pool.rc(b) == 0)
                .count();
            Ok(self.admission(&st.pool, total, (len - h) * g + cached))
        })
    }

    pub fn can_swap_in(&self, id: u64) -> Result<crate::AllocStatus> {
        self.broken.guarded(false, || {
            let st = self.lock()?;
            let seq = st.seqs.get(&id).ok_or(Error::UnknownSequence(id))?;
            let cpu = seq.cpu.as_ref().ok_or(Error::NotSwapped(id))?;
            let need = cpu
                .iter()
                .flatten()
                .filter(|&&c| c != super::table::SWAPPED_NULL)
                .count();
            Ok(self.admission(&st.pool, need, need))
        })
    }

    pub fn reset_prefix_cache(&self) -> Result<bool> {
        self.broken.guarded(true, || {
            let mut st = self.lock()?;
            if st.pool.tallies().iter().any(|t| t.used > 0) {
                return Ok(false);
            }
            st.pool.clear_cached()?;
            st.t.prefix_queries = 0;
            st.t.prefix_hits = 0;
            st.recent.clear();
            Ok(true)
        })
    }

    pub fn drain_events(&self) -> Result<Vec<KvEvent>> {
        self.broken
            .guarded(false, || Ok(self.lock()?.pool.drain_events()))
    }
}
