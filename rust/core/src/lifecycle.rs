//! How sequences and cached blocks leave or multiply: `fork`, `free` (with the withdrawal
//! of uncomputed blocks) and `reset_prefix_cache`.

use crate::block_pool::refcount_overflow;
use crate::counters;
use crate::error::{invalid, Error, Result};
use crate::manager::{chain_lock, BlockManager};
use crate::seq_map::{lock_cell, wait_settled, Attempt};
use crate::sequence::Sequence;

impl BlockManager {
    /// Share every block of `parent` with a new sequence `child`.
    ///
    /// Holds the parent's lock while it creates the child, but never waits for the child's
    /// cell meanwhile: a pending or dying child cell (another call creating or freeing the
    /// id) makes it let go of the parent, wait for that cell, and start again. Waiting with
    /// the parent held would close a cycle with a batch call that holds the child's cell and
    /// waits for the parent's (docs/concurrency.md, "Lock order").
    pub fn fork(&self, parent: u64, child: u64) -> Result<()> {
        loop {
            let busy = self.with_seq(parent, true, |seq| {
                if seq.is_swapped() {
                    return Err(Error::Swapped(parent));
                }
                let attempt = self.seqs.try_create(child, |copy| {
                    if !self.plain() {
                        self.share_all(seq)?;
                        *copy = seq.clone();
                        self.retain_tenant(copy.tenant());
                        self.account((0, 0), copy.footprint(self.block_size()));
                        return Ok(Some(()));
                    }
                    for (i, &b) in seq.blocks.iter().enumerate() {
                        if self.gpu.state(b).share().is_err() {
                            // Undo the shares taken so far: the parent still holds each of
                            // those blocks, so these releases only lower the count back.
                            self.release_blocks(&seq.blocks[..i], &seq.digests)?;
                            return Err(refcount_overflow(b));
                        }
                    }
                    *copy = seq.clone();
                    self.retain_tenant(copy.tenant());
                    self.account((0, 0), copy.footprint(self.block_size()));
                    Ok(Some(()))
                });
                match attempt {
                    Attempt::Done(out) => out.map(|_| None),
                    Attempt::Busy(cell, _) => Ok(Some(cell)),
                }
            })?;
            match busy {
                None => return Ok(()),
                // Nothing held now: not the parent, not the gate.
                Some(cell) => wait_settled(&cell)?,
            }
        }
    }

    /// Forget a sequence, releasing its blocks tail first.
    pub fn free(&self, id: u64) -> Result<()> {
        self.free_computed(id, None)
    }

    /// `free` of a sequence of which only the first `num_computed_tokens` have KV (`None`:
    /// every scheduled token): the blocks past them that it registered leave the prefix
    /// cache (other holders keep them as ordinary blocks) instead of staying cached.
    pub fn free_computed(&self, id: u64, num_computed_tokens: Option<usize>) -> Result<()> {
        self.guarded(true, || {
            let _gate = self.enter()?;
            let cell = self.seqs.get(id).ok_or(Error::UnknownSequence(id))?;
            let mut seq = lock_cell(&cell)?;
            if !cell.is_live() {
                return Err(Error::UnknownSequence(id));
            }
            if let Some(c) = num_computed_tokens {
                let n = seq.tokens.len();
                if c > n {
                    return Err(invalid(format!(
                        "num_computed_tokens {c} for sequence {id} must be in 0..={n}"
                    )));
                }
                if !seq.is_swapped() {
                    // Under the prefix lock, so a hit or lookup of the same prefix sees the
                    // chain before or after the whole withdrawal, never half of it.
                    let keys = chain_lock(&seq.digests);
                    let _prefix = self.lock_prefixes(keys)?;
                    self.retract_uncomputed(&seq, c);
                }
            }
            self.drop_sequence(id, &cell, &mut seq)
        })
    }

    /// Withdraw from the cache, tail first, the blocks of `seq` past its first `c` tokens
    /// that it registered (not hits): their KV was never written, whoever else holds them
    /// (a fork, or a request that hit them in the same step, read nothing valid either).
    pub(crate) fn retract_uncomputed(&self, seq: &Sequence, c: usize) {
        if !self.plain() {
            return self.retract_grouped(seq, c);
        }
        let from = (c / self.block_size()).max(seq.hit_blocks);
        for i in (from..self.registrable(seq)).rev() {
            if self.gpu.retract(seq.blocks[i], &seq.digests[i], false) {
                counters::add(&self.counters.unregistered_blocks, 1);
            }
        }
    }

    /// Free a live sequence whose cell the caller has locked.
    pub(crate) fn drop_sequence(
        &self,
        id: u64,
        cell: &crate::seq_map::SeqCell,
        seq: &mut Sequence,
    ) -> Result<()> {
        let out = self.drop_sequence_blocks(id, cell, seq);
        // After its blocks: those it cached count for its tenant before its ref goes (the
        // tenant leaves the registry if that was its last thing).
        self.release_tenant(seq.tenant());
        seq.set_tenant(crate::tenants::UNSALTED);
        out
    }

    fn drop_sequence_blocks(
        &self,
        id: u64,
        cell: &crate::seq_map::SeqCell,
        seq: &mut Sequence,
    ) -> Result<()> {
        self.account(seq.footprint(self.block_size()), (0, 0));
        self.seqs.remove_locked(id, cell);
        if !self.plain() {
            if seq.is_swapped() {
                self.cpu_copies_removed(seq);
                self.cpu.give_back(&Self::cpu_held(seq));
                seq.cpu_blocks = None;
                seq.set_more(Vec::new(), Vec::new());
                return Ok(());
            }
            self.release_all_groups(seq)?;
            seq.clear_blocks();
            seq.set_more(Vec::new(), Vec::new());
            return Ok(());
        }
        if let Some(cpu) = seq.cpu_blocks.take() {
            self.cpu.give_back(&cpu);
            self.cpu_copies_removed(seq);
        }
        self.retain(seq, 0, seq.blocks.len());
        let blocks = seq.clear_blocks();
        self.release_blocks(&blocks, &seq.digests)
    }

    /// Drop every cached block and restart the hit-rate counters (as vLLM does); refuses
    /// (false) while any sequence holds GPU blocks. Waits for calls in flight to finish and
    /// holds new ones back meanwhile, so it is one step against every other call.
    pub fn reset_prefix_cache(&self) -> Result<bool> {
        self.guarded(true, || {
            Ok(self.gate.exclusive(|| {
                let cleared = self.gpu.reset(self.hasher.root().as_bytes().len());
                if cleared {
                    counters::reset(&self.counters.prefix_queries);
                    counters::reset(&self.counters.prefix_hits);
                    self.recent.clear();
                }
                cleared
            }))
        })
    }
}
