//! The live sequences: a lock-free map from id to a cell holding the sequence under its own
//! mutex, and the protocol that makes creating and freeing an id linearizable.
//!
//! A call that creates an id (allocate, fork) first publishes a *pending* cell, already
//! locked by it, so that no other call can create the same id meanwhile; it fills the
//! sequence under that lock and either marks the cell live (success) or removes it from the
//! map before unlocking (the call returned `None` or failed: the id never existed). A call
//! that frees an id marks the cell dead and removes it, under the lock. So an id's existence
//! changes only under its cell's lock, and `live` tells lock-free readers (`contains`, `len`)
//! exactly that.

use crate::error::{Error, Result};
use crate::id_hasher::BuildIdHasher;
use crate::sequence::Sequence;
use crate::sync::{
    lock, may_wait, try_lock, AtomicBool, AtomicUsize, Mutex, MutexGuard, Ordering, Padded,
};
use std::sync::Arc;

pub struct SeqCell {
    /// True exactly while the sequence exists: set under `seq`'s lock when its creating
    /// call succeeds, cleared under the lock when it is freed; never set again after.
    live: AtomicBool,
    pub seq: Mutex<Sequence>,
}

impl SeqCell {
    /// Whether the sequence exists. Acquire: pairs with the Release store that made it live,
    /// so a caller that sees it live and then locks it finds it filled.
    pub fn is_live(&self) -> bool {
        self.live.load(Ordering::Acquire)
    }
}

/// Lock a cell, or fail with `WouldBlock` in non-blocking mode when it is busy.
pub fn lock_cell(cell: &SeqCell) -> Result<MutexGuard<'_, Sequence>> {
    match try_lock(&cell.seq) {
        Some(g) => Ok(g),
        None if may_wait() => Ok(lock(&cell.seq)),
        None => Err(Error::WouldBlock),
    }
}

/// What `SeqMap::try_create` did.
pub enum Attempt<T, F> {
    /// Created (`Ok(Some)`), refused by `fill` (`Ok(None)`, error), or already live.
    Done(Result<Option<T>>),
    /// A pending or dying cell holds the id: wait for it (`wait_settled`) with no lock held,
    /// then try again with the `fill` given back.
    Busy(Arc<SeqCell>, F),
}

/// Wait until the owner of a pending or dying cell has settled it (`WouldBlock` in
/// non-blocking mode while it is busy).
pub fn wait_settled(cell: &SeqCell) -> Result<()> {
    lock_cell(cell).map(drop)
}

pub struct SeqMap {
    /// Cells of live and pending ids (see the module docs).
    map: papaya::HashMap<u64, Arc<SeqCell>, BuildIdHasher>,
    /// Number of live cells; changed together with `live`, under the cell's lock.
    live: Padded<AtomicUsize>,
}

impl SeqMap {
    pub fn new() -> Self {
        Self {
            map: papaya::HashMap::builder().hasher(BuildIdHasher).build(),
            live: Padded(AtomicUsize::new(0)),
        }
    }

    /// The cell of `id`, live or pending (the caller locks it and checks `is_live`).
    pub fn get(&self, id: u64) -> Option<Arc<SeqCell>> {
        self.map.pin().get(&id).cloned()
    }

    /// Run `f` on the cells of `ids` (live or pending, `None` where an id has none),
    /// borrowed from one pin of the map: no reference counts touched on the batch path.
    pub fn with_cells<T>(&self, ids: &[u64], f: impl FnOnce(&[Option<&SeqCell>]) -> T) -> T {
        let map = self.map.pin();
        let cells: Vec<Option<&SeqCell>> = ids.iter().map(|id| map.get(id).map(|c| &**c)).collect();
        f(&cells)
    }

    pub fn contains(&self, id: u64) -> bool {
        self.map.pin().get(&id).is_some_and(|c| c.is_live())
    }

    /// Live sequences (Relaxed: a count read on its own).
    pub fn len(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Every cell, live or pending, in id order (audits).
    pub fn cells(&self) -> Vec<(u64, Arc<SeqCell>)> {
        let mut out: Vec<_> = self
            .map
            .pin()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        out.sort_unstable_by_key(|(id, _)| *id);
        out
    }

    /// Create `id`: run `fill` on a new, pending sequence; keep it if `fill` returns
    /// `Ok(Some(_))`, otherwise the id never existed. `DuplicateSequence` if `id` is live
    /// (waiting for a pending creator or freer to finish first). The caller must hold no
    /// sequence lock (it may wait for `id`'s); one that does uses `try_create`.
    pub fn create<T, F>(&self, id: u64, mut fill: F) -> Result<Option<T>>
    where
        F: FnOnce(&mut Sequence) -> Result<Option<T>>,
    {
        loop {
            match self.try_create(id, fill) {
                Attempt::Done(out) => return out,
                Attempt::Busy(other, f) => {
                    fill = f;
                    wait_settled(&other)?;
                }
            }
        }
    }

    /// One attempt at `create` that never waits: `Busy` (with `fill` unused) when a pending
    /// or dying cell holds `id`. The caller then lets go of every lock it holds, waits for
    /// that cell with `wait_settled`, and tries again: so a caller holding another
    /// sequence's lock (`fork`) never waits for `id` while holding it.
    pub fn try_create<T, F>(&self, id: u64, fill: F) -> Attempt<T, F>
    where
        F: FnOnce(&mut Sequence) -> Result<Option<T>>,
    {
        let cell = Arc::new(SeqCell {
            live: AtomicBool::new(false),
            seq: Mutex::new(Sequence::empty()),
        });
        // Locked before it is published, so no other call ever waits on it unfilled.
        let mut seq = lock(&cell.seq);
        let other = match self.map.pin().try_insert(id, cell.clone()) {
            Ok(_) => {
                let out = fill(&mut seq);
                if matches!(out, Ok(Some(_))) {
                    self.live.fetch_add(1, Ordering::Relaxed);
                    // Release: see `is_live`.
                    cell.live.store(true, Ordering::Release);
                } else {
                    self.map.pin().remove(&id);
                }
                return Attempt::Done(out);
            }
            Err(occupied) => occupied.current.clone(),
        };
        drop(seq);
        if other.is_live() {
            return Attempt::Done(Err(Error::DuplicateSequence(id)));
        }
        // Pending or being freed: its owner settles it under the lock.
        Attempt::Busy(other, fill)
    }

    /// Forget a live sequence whose cell the caller has locked.
    pub fn remove_locked(&self, id: u64, cell: &SeqCell) {
        // Relaxed: `live` is read by `is_live` (Acquire) only to learn existence; the
        // caller's lock orders the sequence's data.
        cell.live.store(false, Ordering::Relaxed);
        self.live.fetch_sub(1, Ordering::Relaxed);
        self.map.pin().remove(&id);
    }
}

impl Default for SeqMap {
    fn default() -> Self {
        Self::new()
    }
}
