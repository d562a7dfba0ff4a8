//! A persistent running batch: the sequences a scheduler decodes step after step, resolved
//! to their cells once, so that a step looks nothing up and returns the new tokens' slots.
//!
//! A member is a reference to the cell its id had when it was added, not the sequence
//! itself: every other call on the id works as before (under the cell's lock), and a member
//! freed elsewhere is a dead cell that the next step reports (`UnknownSequence`) until it is
//! removed. Lock order: the batch's own mutex, then the members' cells (`lock_all`), then
//! the prefix locks.

use crate::alloc::try_with_capacity;
use crate::batch::{check_distinct, lock_all};
use crate::error::{invalid, Error, Result};
use crate::id_hasher::BuildIdHasher;
use crate::manager::BlockManager;
use crate::seq_map::{lock_cell, SeqCell};
use crate::sync::{lock, may_wait, try_lock, Mutex, MutexGuard};
use std::collections::HashSet;
use std::sync::Arc;

/// The slots of one step's new tokens (batch order; with groups, group by group: group
/// `g`'s slots at `g * len .. (g + 1) * len`) and its copy-on-write pairs.
pub type StepOut = (Vec<i64>, Vec<(u32, u32)>);

pub struct RunningBatch {
    /// The manager whose cells these are (`BlockManager::instance`), checked on every call
    /// so that a batch never reaches into another manager's sequences.
    owner: u64,
    members: Mutex<Members>,
}

/// `cells[i]` is the cell `ids[i]` had when it was added; `set` holds exactly the ids, which
/// are distinct.
#[derive(Default)]
struct Members {
    ids: Vec<u64>,
    cells: Vec<Arc<SeqCell>>,
    set: IdSet,
}

type IdSet = HashSet<u64, BuildIdHasher>;

impl RunningBatch {
    fn lock(&self) -> Result<MutexGuard<'_, Members>> {
        match try_lock(&self.members) {
            Some(g) => Ok(g),
            None if may_wait() => Ok(lock(&self.members)),
            None => Err(Error::WouldBlock),
        }
    }

    /// The members' ids in batch order (the order `step`'s tokens and slots follow).
    pub fn ids(&self) -> Result<Vec<u64>> {
        Ok(self.lock()?.ids.clone())
    }

    pub fn len(&self) -> Result<usize> {
        Ok(self.lock()?.ids.len())
    }

    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
}

impl BlockManager {
    /// A new, empty running batch over this manager's sequences.
    pub fn running_batch(&self) -> RunningBatch {
        RunningBatch {
            owner: self.instance,
            members: Mutex::new(Members::default()),
        }
    }

    fn check_owner(&self, batch: &RunningBatch) -> Result<()> {
        if batch.owner != self.instance {
            return Err(invalid("the running batch belongs to another manager"));
        }
        Ok(())
    }

    /// Add live, resident sequences to the end of the batch, all or nothing. Errors: a
    /// repeated id, then per id in order: already a member, unknown, swapped out.
    pub fn batch_add(&self, batch: &RunningBatch, ids: &[u64]) -> Result<()> {
        self.check_owner(batch)?;
        check_distinct(ids)?;
        let mut members = batch.lock()?;
        let mut cells = try_with_capacity(ids.len(), "the batch's new members")?;
        for &id in ids {
            if members.set.contains(&id) {
                return Err(invalid(format!(
                    "sequence {id} is already in the running batch"
                )));
            }
            let cell = self.seqs.get(id).ok_or(Error::UnknownSequence(id))?;
            {
                let seq = lock_cell(&cell)?;
                if !cell.is_live() {
                    return Err(Error::UnknownSequence(id));
                }
                if seq.is_swapped() {
                    return Err(Error::Swapped(id));
                }
            }
            cells.push(cell);
        }
        crate::alloc::try_grow(&mut members.ids, ids.len(), "the batch's ids")?;
        crate::alloc::try_grow(&mut members.cells, ids.len(), "the batch's cells")?;
        members
            .set
            .try_reserve(ids.len())
            .map_err(|_| Error::OutOfMemory("the batch's id set".into()))?;
        members.ids.extend_from_slice(ids);
        members.cells.extend(cells);
        members.set.extend(ids.iter().copied());
        Ok(())
    }

    /// Remove members (freed or not), all or nothing; the others keep their order.
    pub fn batch_remove(&self, batch: &RunningBatch, ids: &[u64]) -> Result<()> {
        self.check_owner(batch)?;
        check_distinct(ids)?;
        let mut members = batch.lock()?;
        if let Some(id) = ids.iter().find(|id| !members.set.contains(id)) {
            return Err(invalid(format!(
                "sequence {id} is not in the running batch"
            )));
        }
        let Members {
            ids: mids,
            cells,
            set,
        } = &mut *members;
        ids.iter().for_each(|id| {
            set.remove(id);
        });
        // `retain` visits elements once, in order: the cells follow their ids.
        let mut keep = mids.iter().map(|id| set.contains(id));
        cells.retain(|_| keep.next().unwrap_or(true));
        mids.retain(|id| set.contains(id));
        Ok(())
    }

    /// One decode step: `tokens[i]` appended to member `i`, all or nothing, as
    /// `append_batch(ids, tokens)` would. Returns the new tokens' slots and the
    /// copy-on-write pairs, or `None` when the blocks do not fit (nothing changed).
    pub fn batch_step(&self, batch: &RunningBatch, tokens: &[u32]) -> Result<Option<StepOut>> {
        self.check_owner(batch)?;
        self.guarded(true, || {
            let _gate = self.enter()?;
            let members = batch.lock()?;
            if tokens.len() != members.ids.len() {
                return Err(invalid(format!(
                    "token_ids has {} entries but the running batch has {} sequences",
                    tokens.len(),
                    members.ids.len()
                )));
            }
            let mut cells = try_with_capacity(tokens.len(), "the batch's cells")?;
            cells.extend(members.cells.iter().map(|c| Some(&**c)));
            // Members are distinct, so no duplicate check.
            let mut locked = lock_all(&members.ids, &cells, false)?;
            if !self.plain() {
                return self.step_members_grouped(&members.ids, tokens, &mut locked);
            }
            let mut slots = try_with_capacity(tokens.len(), "the slot mapping")?;
            let out =
                self.append_one_each(&members.ids, tokens, &mut locked, Some(&mut slots), None)?;
            Ok(out.map(|pairs| (slots, pairs)))
        })
    }
}

impl BlockManager {
    /// A running batch's step with groups: the members' checks in batch order, then one
    /// grouped step of all of them, with every group's slots.
    fn step_members_grouped(
        &self,
        ids: &[u64],
        tokens: &[u32],
        locked: &mut crate::batch::Locked<'_>,
    ) -> Result<Option<StepOut>> {
        for (i, &id) in ids.iter().enumerate() {
            let k = locked.at[i];
            let seq = locked.guards[k].as_deref();
            if let Some(e) = crate::batch::state_error(id, locked.cells[k], seq, true) {
                return Err(e);
            }
            if let Some(seq) = seq {
                crate::manager::check_append(id, seq.tokens.len(), seq.scheduled, 1)?;
            }
        }
        let mut seqs = Self::live_mut(ids, locked, true)?;
        let mut refs: Vec<&mut crate::sequence::Sequence> =
            seqs.iter_mut().map(|(_, s)| &mut **s).collect();
        let mut rows = vec![Vec::with_capacity(ids.len()); self.num_groups()];
        let out = self.step_batch_grouped(&mut refs, tokens, 0, Some(&mut rows))?;
        Ok(out.map(|pairs| (rows.concat(), pairs)))
    }
}
