//! `RouterIndex`: which engine holds which blocks, per medium and group; events in, prefix
//! matches out (`lookup.rs`), from any number of threads.
//!
//! Locks, and why each exists:
//! - `engines` (a mutex): finds or creates an engine's cell, once per applying call; never
//!   taken by lookups.
//! - each engine's `state` mutex: orders that engine's events and guards its holders;
//!   taken by the calls that change the engine, never by lookups. Different engines apply
//!   in parallel.
//! - the block map's shard locks (`blocks.rs`): a writer takes one shard's write lock per
//!   block it changes; a lookup takes one shard's read lock per block it probes. Nothing is
//!   scanned, sorted or allocated under them but a table's own growth.
//! - the slot allocator's mutex (`slots.rs`): when holders come and go.
//! - `replaced` (`replaced.rs`, a mutex and a condvar): the queue of holders snapshots
//!   replaced and the count of drops of them in flight, taken only to push, take or wait
//!   (nothing is locked under it); a writer short of slots waits on it, under its engine's
//!   lock, for a drop in flight (drops take no engine lock). `dropping`: held while
//!   `drop_replaced` drops them and by `check_invariants`, always before any engine's lock.
//!
//! Lookups take nothing else: the slots' words are atomics and the `names` map is papaya's
//! (lock-free reads).

use crate::blocks::{malloc_size, table_bytes, BlockMap};
use crate::compact;
use crate::engine::{holder_id, EngineCell, EngineKey, EngineState, Holder, HolderId, Holders};
use crate::error::RouterError;
use crate::event::Event;
use crate::key::{BlockKey, BuildKeyHasher};
use crate::media::Media;
use crate::replaced::{Replaced, Taken};
use crate::slots::{pack_meta, Slots};
use crate::stats::{Counters, Stats};
use crate::wire;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// How an index is built.
#[derive(Debug, Clone, Copy)]
pub struct Config {
    /// The most holders (engine x medium x group) at once. Lookups read one 64-bit word of
    /// every 64 slots ever used; a few words of memory per 64 holders are reserved up front.
    pub max_holders: usize,
    /// How far a holder's log may run past twice its blocks before it is compacted
    /// (`engine.rs`): more slack, fewer compactions of small holders.
    pub log_slack: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            max_holders: 4096,
            log_slack: 1024,
        }
    }
}

/// What one call applied (tallies over its events).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Blocks that became held.
    pub stored: u64,
    /// Blocks that stopped being held.
    pub removed: u64,
    /// `BlockStored` of blocks already held (nothing changed).
    pub duplicates: u64,
    /// `BlockRemoved` of blocks not held (nothing changed).
    pub unknown_removals: u64,
    /// `BlockStored` events whose parent the holder did not hold (the blocks are recorded).
    pub orphans: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Events of an unknown type, skipped.
    pub unknown_events: u64,
}

/// A `BlockStored` of at least this many blocks (a compact snapshot part's) is set shard by
/// shard (`BlockMap::set_many`) rather than block by block.
const BULK: usize = 1024;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Live,
    Staged,
}

pub struct RouterIndex<K: BlockKey> {
    pub(crate) blocks: BlockMap<K>,
    pub(crate) slots: Slots,
    pub(crate) media: Media,
    /// Engines by key (module docs).
    engines: Mutex<HashMap<EngineKey, Arc<EngineCell<K>>>>,
    /// Engine handle -> key, for lookups to name what they found. An entry exists while its
    /// engine does (inserted under `engines` with the cell, removed with it).
    pub(crate) names: papaya::HashMap<u32, EngineKey>,
    next_handle: AtomicU32,
    pub(crate) counters: Counters,
    log_slack: usize,
    /// Holders a snapshot replaced (`commit_snapshot_deferred`): retired (lookups no longer
    /// count them), their bits still set, their slots not yet free; `drop_replaced` clears them.
    replaced: Replaced<Holders<K>>,
    /// Held by `drop_replaced` for the whole of its work, so that whoever takes it sees every
    /// replaced holder either still queued or wholly dropped (`check_invariants`).
    dropping: Mutex<()>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<K: BlockKey> Default for RouterIndex<K> {
    fn default() -> Self {
        Self::new(Config::default())
    }
}

impl<K: BlockKey> RouterIndex<K> {
    pub fn new(config: Config) -> Self {
        let hasher = BuildKeyHasher::random();
        Self {
            blocks: BlockMap::new(hasher),
            slots: Slots::new(config.max_holders.max(1)),
            media: Media::new(),
            engines: Mutex::new(HashMap::new()),
            names: papaya::HashMap::new(),
            next_handle: AtomicU32::new(0),
            counters: Counters::default(),
            log_slack: config.log_slack,
            replaced: Replaced::new(),
            dropping: Mutex::new(()),
        }
    }

    /// The engine's cell, created if it has none and `create`; and whether this call made it.
    fn cell(&self, engine: &EngineKey, create: bool) -> Option<(Arc<EngineCell<K>>, bool)> {
        let mut engines = lock(&self.engines);
        if let Some(c) = engines.get(engine) {
            return Some((Arc::clone(c), false));
        }
        if !create {
            return None;
        }
        // Relaxed: the counter only hands out distinct numbers (under `engines` anyway).
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        let cell = Arc::new(EngineCell {
            handle,
            state: Mutex::new(EngineState {
                dead: false,
                live: HashMap::new(),
                staged: None,
            }),
        });
        self.names.pin().insert(handle, engine.clone());
        engines.insert(engine.clone(), Arc::clone(&cell));
        Some((cell, true))
    }

    /// Run `f` on the engine's state, locked, with its handle; never on a removed engine's
    /// (a cell found just before its engine's removal is dead by the time it is locked: the
    /// engine is looked up again). An unknown engine is created if `create`, else `f` does
    /// not run (None). An engine this call created and `f` refused (`Err`) with nothing held
    /// is forgotten again: a refused call leaves no engine behind.
    fn with_engine<R, E>(
        &self,
        engine: &EngineKey,
        create: bool,
        f: impl FnOnce(u32, &mut EngineState<K>) -> Result<R, E>,
    ) -> Option<Result<R, E>> {
        loop {
            let (cell, created) = self.cell(engine, create)?;
            let mut st = lock(&cell.state);
            if st.dead {
                continue;
            }
            let r = f(cell.handle, &mut st);
            let empty = st.live.is_empty() && st.staged.is_none();
            drop(st);
            if r.is_err() && created && empty {
                let mut engines = lock(&self.engines);
                if engines.get(engine).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                    let mut st = lock(&cell.state);
                    if st.live.is_empty() && st.staged.is_none() {
                        st.dead = true;
                        engines.remove(engine);
                        self.names.pin().remove(&cell.handle);
                    }
                }
            }
            return Some(r);
        }
    }

    /// Decode one vLLM payload and apply it to `engine`'s blocks. A payload that does not
    /// decode is refused whole (and counted in `rejected_payloads`).
    pub fn apply_payload(
        &self,
        engine: &EngineKey,
        payload: &[u8],
    ) -> Result<Applied, RouterError> {
        self.payload_to(engine, payload, Target::Live)
    }

    /// Apply events to `engine`'s blocks, in order.
    pub fn apply(
        &self,
        engine: &EngineKey,
        events: &[Event<'_, K>],
    ) -> Result<Applied, RouterError> {
        self.apply_to(engine, events, Target::Live)
    }

    fn payload_to(
        &self,
        engine: &EngineKey,
        payload: &[u8],
        target: Target,
    ) -> Result<Applied, RouterError> {
        // A compact snapshot part (pagedkv's, `compact.rs`) or a vLLM payload.
        let decoded = if compact::is_compact(payload) {
            compact::decode::<K>(payload)
        } else {
            wire::decode::<K>(payload)
        };
        let batch = match decoded {
            Ok(b) => b,
            Err(e) => {
                self.counters
                    .rejected_payloads
                    .fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let mut applied = self.apply_to(engine, &batch.events, target)?;
        applied.unknown_events = batch.unknown as u64;
        self.counters
            .unknown_events
            .fetch_add(applied.unknown_events, Ordering::Relaxed);
        Ok(applied)
    }

    fn apply_to(
        &self,
        engine: &EngineKey,
        events: &[Event<'_, K>],
        target: Target,
    ) -> Result<Applied, RouterError> {
        // Media first: the only step that can fail for a payload that decoded, besides slots.
        let mut ids: Vec<HolderId> = Vec::with_capacity(events.len());
        let mut last: Option<(Option<&str>, u16)> = None;
        for e in events {
            let (medium, group) = match e {
                Event::Stored { medium, group, .. } | Event::Removed { medium, group, .. } => {
                    (*medium, *group)
                }
                Event::Cleared => {
                    ids.push(0);
                    continue;
                }
            };
            let m = match last {
                Some((name, id)) if name == medium => id,
                _ => {
                    let id = self.media.intern(medium).inspect_err(|_| {
                        self.counters
                            .rejected_payloads
                            .fetch_add(1, Ordering::Relaxed);
                    })?;
                    last = Some((medium, id));
                    id
                }
            };
            ids.push(holder_id(m, group));
        }
        let no_snapshot =
            || RouterError::Snapshot(format!("no snapshot begun for engine {engine}"));
        let (a, cleared_members) = self
            .with_engine(
                engine,
                target == Target::Live,
                |handle, st| -> Result<(Applied, u64), RouterError> {
                    let holders = match target {
                        Target::Live => &mut st.live,
                        Target::Staged => st.staged.as_mut().ok_or_else(no_snapshot)?,
                    };
                    // Every holder the events store into, before any change: a refusal changes nothing.
                    let mut fresh: Vec<HolderId> = Vec::new();
                    for (e, &id) in events.iter().zip(&ids) {
                        if matches!(e, Event::Stored { .. })
                            && !holders.contains_key(&id)
                            && !fresh.contains(&id)
                        {
                            fresh.push(id);
                        }
                    }
                    let mut slots = Vec::with_capacity(fresh.len());
                    for &id in &fresh {
                        let meta = pack_meta(handle, (id >> 16) as u16, id as u16);
                        // Slots still held by replaced holders are freed first if none is left.
                        let got = self.alloc_slot(meta);
                        match got {
                            Ok(s) => slots.push(s),
                            Err(err) => {
                                for s in slots {
                                    self.slots.free(s);
                                }
                                self.counters
                                    .rejected_payloads
                                    .fetch_add(1, Ordering::Relaxed);
                                return Err(err);
                            }
                        }
                    }
                    for (&id, &slot) in fresh.iter().zip(&slots) {
                        if target == Target::Live {
                            self.slots.set_live(slot);
                        }
                        holders.insert(id, Holder::new(slot));
                    }
                    let live = target == Target::Live;
                    let mut a = Applied::default();
                    let mut cleared_members = 0u64;
                    // The last block stored, and by which holder: a snapshot sends one block an
                    // event, each the child of the one before, whose parent needs no probe.
                    let mut tail: Option<(HolderId, K)> = None;
                    for (e, id) in events.iter().zip(&ids) {
                        match e {
                            Event::Stored { hashes, parent, .. } => {
                                let h = holders.get_mut(id).expect("allocated above");
                                if let Some(p) = parent {
                                    let known =
                                        tail == Some((*id, *p)) || self.blocks.holds(*p, h.slot);
                                    if !known {
                                        a.orphans += 1;
                                    }
                                }
                                if hashes.len() >= BULK {
                                    // A snapshot's part: shard by shard (`set_many`).
                                    let new = self.blocks.set_many(hashes, h.slot);
                                    h.log.extend_from_slice(&new);
                                    h.count += new.len();
                                    let stored = new.len() as u64;
                                    a.stored += stored;
                                    a.duplicates += hashes.len() as u64 - stored;
                                    tail = hashes.last().map(|k| (*id, *k));
                                    continue;
                                }
                                let prefetch = h.slot < 64; // word 0's tables
                                for (i, k) in hashes.iter().enumerate() {
                                    if prefetch {
                                        if let Some(next) = hashes.get(i + 4) {
                                            self.blocks.prefetch(self.blocks.hash(next));
                                        }
                                    }
                                    if self.blocks.set(*k, h.slot) {
                                        h.log.push(*k);
                                        h.count += 1;
                                        a.stored += 1;
                                    } else {
                                        a.duplicates += 1;
                                    }
                                }
                                tail = hashes.last().map(|k| (*id, *k));
                            }
                            Event::Removed { hashes, .. } => match holders.get_mut(id) {
                                None => a.unknown_removals += hashes.len() as u64,
                                Some(h) => {
                                    for k in hashes {
                                        if self.blocks.unset(*k, h.slot) {
                                            h.count -= 1;
                                            a.removed += 1;
                                        } else {
                                            a.unknown_removals += 1;
                                        }
                                    }
                                    if h.log_is_long(self.log_slack) {
                                        self.compact(h);
                                    }
                                }
                            },
                            Event::Cleared => {
                                for h in holders.values_mut() {
                                    cleared_members += h.count as u64;
                                    self.reset(h, live);
                                }
                                a.cleared += 1;
                            }
                        }
                    }
                    Ok((a, cleared_members))
                },
            )
            .unwrap_or_else(|| Err(no_snapshot()))?;
        if target == Target::Live {
            let c = &self.counters;
            c.memberships.fetch_add(
                a.stored as i64 - a.removed as i64 - cleared_members as i64,
                Ordering::Relaxed,
            );
        }
        self.counters.add(&a);
        Ok(a)
    }

    /// Empty a holder in place. A live one leaves `live` first, so lookups stop counting it at
    /// once and those in flight read its word again; it is live again, empty, at the end.
    fn reset(&self, h: &mut Holder<K>, live: bool) {
        if live {
            self.slots.retire(h.slot);
        }
        // A block removed earlier is already clear: unsetting it changes nothing.
        self.unset_log(&std::mem::take(&mut h.log), h.slot);
        h.count = 0;
        if live {
            self.slots.set_live(h.slot);
        }
    }

    /// Drop holders and give their slots back (live ones leave `live` first).
    fn discard(&self, holders: Holders<K>, live: bool) {
        for (_, h) in holders {
            if live {
                self.slots.retire(h.slot);
            }
            self.unset_log(&h.log, h.slot);
            self.slots.free(h.slot);
        }
    }

    /// Clear `slot`'s bit of every block of `log`: shard by shard for a long log.
    fn unset_log(&self, log: &[K], slot: u32) {
        if log.len() >= BULK {
            self.blocks.unset_many(log, slot);
        } else {
            for k in log {
                self.blocks.unset(*k, slot);
            }
        }
    }

    /// Keep in a holder's log only the blocks it holds, once each (under the engine's lock,
    /// which lookups never take; one read probe per logged block, then a sort of the log).
    fn compact(&self, h: &mut Holder<K>) {
        let slot = h.slot;
        h.log.retain(|k| self.blocks.holds(*k, slot));
        h.log.sort_unstable_by_key(|k| k.fold());
        h.log.dedup();
        debug_assert_eq!(h.log.len(), h.count);
        if h.log.capacity() > 4 * h.log.len() + 1024 {
            h.log.shrink_to(2 * h.log.len());
        }
    }

    /// Start receiving a snapshot of `engine` (what pagedkv's publisher sends on request):
    /// staged payloads go to holders lookups do not see until `commit_snapshot` swaps them
    /// for the engine's current ones. A snapshot already begun is dropped.
    pub fn begin_snapshot(&self, engine: &EngineKey) {
        let old = self
            .with_engine(engine, true, |_, st| {
                Ok::<_, RouterError>(st.staged.replace(HashMap::new()))
            })
            .and_then(Result::ok)
            .flatten();
        if let Some(old) = old {
            self.discard(old, false);
        }
    }

    /// Apply one payload of the snapshot begun for `engine`.
    pub fn apply_staged_payload(
        &self,
        engine: &EngineKey,
        payload: &[u8],
    ) -> Result<Applied, RouterError> {
        self.payload_to(engine, payload, Target::Staged)
    }

    /// Apply events to the snapshot begun for `engine`.
    pub fn apply_staged(
        &self,
        engine: &EngineKey,
        events: &[Event<'_, K>],
    ) -> Result<Applied, RouterError> {
        self.apply_to(engine, events, Target::Staged)
    }

    /// The snapshot becomes the engine's blocks; what it held before goes. Lookups see the
    /// old holders until the new ones go live, then the new ones (a lookup never adds the two:
    /// see `lookup.rs`). `commit_snapshot_deferred`, then the old blocks dropped here.
    pub fn commit_snapshot(&self, engine: &EngineKey) -> Result<(), RouterError> {
        self.commit_snapshot_deferred(engine)?;
        self.drop_replaced();
        Ok(())
    }

    /// The snapshot becomes the engine's blocks, as `commit_snapshot`, but the blocks it
    /// replaced are only retired: lookups stop counting them at once (their slots leave
    /// `live`), and their bits stay set, their slots taken, until `drop_replaced` clears them
    /// (on another thread, say: a commit need not wait for a million old blocks to go).
    /// Returns the memberships replaced (0: nothing queued).
    pub fn commit_snapshot_deferred(&self, engine: &EngineKey) -> Result<usize, RouterError> {
        let no_snapshot =
            || RouterError::Snapshot(format!("no snapshot begun for engine {engine}"));
        let (lost, gained) = self
            .with_engine(engine, false, |_, st| {
                let staged = st.staged.take().ok_or_else(no_snapshot)?;
                let old = std::mem::replace(&mut st.live, staged);
                self.slots.replace_live(
                    old.values().map(|h| h.slot),
                    st.live.values().map(|h| h.slot),
                );
                let gained: usize = st.live.values().map(|h| h.count).sum();
                let lost: usize = old.values().map(|h| h.count).sum();
                // Queued before the engine's lock goes: a writer short of slots never finds
                // these taken but neither queued nor being dropped.
                if !old.is_empty() {
                    self.replaced.push(old);
                }
                Ok::<_, RouterError>((lost, gained))
            })
            .unwrap_or_else(|| Err(no_snapshot()))?;
        self.counters
            .memberships
            .fetch_add(gained as i64 - lost as i64, Ordering::Relaxed);
        self.counters.snapshots.fetch_add(1, Ordering::Relaxed);
        Ok(lost)
    }

    /// Clear the bits of the holders snapshots replaced and free their slots (those queued
    /// when it starts; waits for another call of it in flight). Returns how many it dropped.
    pub fn drop_replaced(&self) -> usize {
        let _dropping = lock(&self.dropping);
        self.drop_queued()
    }

    /// A slot for a new holder. With none left, the slots of replaced holders are freed
    /// first: those queued, dropped here, or those another thread is dropping, waited for
    /// (under the caller's engine lock: a drop takes no engine lock, so this cannot deadlock).
    fn alloc_slot(&self, meta: u64) -> Result<u32, RouterError> {
        self.replaced.alloc_with(
            || self.slots.alloc(meta),
            |taken| {
                self.drop_taken(taken);
            },
        )
    }

    /// `drop_replaced`'s work, without its lock: for a writer that needs the slots back and
    /// may hold an engine's lock (`dropping` is taken before engines' locks, never after).
    fn drop_queued(&self) -> usize {
        self.drop_taken(self.replaced.take())
    }

    /// Drop the replaced sets taken; the drop stays in flight (a writer short of slots waits
    /// for it) until they are all gone.
    fn drop_taken(&self, taken: Taken<'_, Holders<K>>) -> usize {
        let mut taken = taken;
        let mut n = 0;
        for old in std::mem::take(&mut taken.sets) {
            n += old.len();
            // Retired at commit already; `discard` retires them again (harmless: one more
            // generation) and clears their bits.
            self.discard(old, true);
        }
        n
    }

    /// Drop the snapshot begun for `engine`, if any.
    pub fn abort_snapshot(&self, engine: &EngineKey) {
        let cell = match lock(&self.engines).get(engine) {
            Some(c) => Arc::clone(c),
            None => return,
        };
        let staged = lock(&cell.state).staged.take();
        if let Some(s) = staged {
            self.discard(s, false);
        }
    }

    /// Drop every block of `engine` (lookups stop counting it at once) and forget it.
    /// Returns whether it was known.
    pub fn remove_engine(&self, engine: &EngineKey) -> bool {
        let Some(cell) = lock(&self.engines).remove(engine) else {
            return false;
        };
        let mut st = lock(&cell.state);
        st.dead = true;
        let live = std::mem::take(&mut st.live);
        let staged = st.staged.take();
        drop(st);
        let members: usize = live.values().map(|h| h.count).sum();
        self.discard(live, true);
        if let Some(s) = staged {
            self.discard(s, false);
        }
        self.names.pin().remove(&cell.handle);
        self.counters
            .memberships
            .fetch_sub(members as i64, Ordering::Relaxed);
        true
    }

    /// The engines known, in no particular order.
    pub fn engines(&self) -> Vec<EngineKey> {
        lock(&self.engines).keys().cloned().collect()
    }

    /// Blocks `engine` holds, per (medium, group).
    pub fn holder_sizes(&self, engine: &EngineKey) -> Vec<(Option<String>, u16, usize)> {
        let Some(cell) = lock(&self.engines).get(engine).cloned() else {
            return Vec::new();
        };
        let st = lock(&cell.state);
        let mut out: Vec<_> = st
            .live
            .iter()
            .map(|(&id, h)| {
                let m = self
                    .media
                    .name((id >> 16) as u16)
                    .flatten()
                    .map(str::to_owned);
                (m, id as u16, h.count)
            })
            .collect();
        out.sort();
        out
    }

    /// The blocks `engine` holds in one medium and group (for checks and tests).
    pub fn blocks_of(&self, engine: &EngineKey, medium: Option<&str>, group: u16) -> Vec<K> {
        let Some(m) = self.media.find(medium) else {
            return Vec::new();
        };
        let Some(cell) = lock(&self.engines).get(engine).cloned() else {
            return Vec::new();
        };
        let st = lock(&cell.state);
        st.live
            .get(&holder_id(m, group))
            .map(|h| {
                let mut held: Vec<K> = h
                    .log
                    .iter()
                    .copied()
                    .filter(|k| self.blocks.holds(*k, h.slot))
                    .collect();
                held.sort_unstable_by_key(|k| k.fold());
                held.dedup();
                held
            })
            .unwrap_or_default()
    }

    /// The medium id lookups report for a name (None: no event named it yet).
    pub fn medium_id(&self, name: Option<&str>) -> Option<u16> {
        self.media.find(name)
    }

    /// The name of a medium id lookups reported.
    pub fn medium_name(&self, id: u16) -> Option<Option<&str>> {
        self.media.name(id)
    }

    /// Counters and memory (locks each engine briefly, one at a time: not for hot paths).
    pub fn stats(&self) -> Stats {
        let cells: Vec<_> = lock(&self.engines).values().cloned().collect();
        let mut set_bytes = 0usize;
        let mut holders = 0usize;
        let mut maps = 0usize;
        for c in &cells {
            let st = lock(&c.state);
            for hs in std::iter::once(&st.live).chain(st.staged.as_ref()) {
                holders += hs.len();
                maps += table_bytes(hs.capacity(), std::mem::size_of::<(HolderId, Holder<K>)>());
                for h in hs.values() {
                    set_bytes += h.log.capacity() * std::mem::size_of::<K>();
                }
            }
        }
        // Replaced holders not yet dropped: their logs are still memory.
        self.replaced.with_queued(|queued| {
            for h in queued.iter().flat_map(|hs| hs.values()) {
                set_bytes += h.log.capacity() * std::mem::size_of::<K>();
            }
        });
        let engines = cells.len();
        let engine_bytes =
            engines * (malloc_size(std::mem::size_of::<EngineCell<K>>() + 16) + 64) + maps;
        self.counters.stats(
            engines,
            holders,
            self.blocks.len(),
            self.blocks.bytes(),
            set_bytes,
            self.slots.bytes() + engine_bytes,
        )
    }
}

impl<K: BlockKey> RouterIndex<K> {
    /// Check the invariants between the holders, the block map and the slots (a full walk:
    /// call it when no event is being applied). Returns what is wrong, if anything.
    pub fn check_invariants(&self) -> Result<(), String> {
        use crate::slots::word_bit;
        use std::collections::HashSet;
        // No drop of replaced holders in flight while checking (they are queued or gone):
        // `dropping` keeps `drop_replaced` out, `with_settled` waits for writers' drops.
        let _dropping = lock(&self.dropping);
        let cells: Vec<_> = lock(&self.engines).values().cloned().collect();
        // slot -> (blocks logged, blocks counted)
        let mut logs: HashMap<u32, (HashSet<K>, usize)> = HashMap::new();
        // Replaced holders: not live, not counted in memberships, their blocks still theirs.
        self.replaced.with_settled(|queued| {
            for h in queued.iter().flat_map(|hs| hs.values()) {
                let (w, b) = word_bit(h.slot);
                if self.slots.live(w) & b != 0 {
                    return Err(format!("replaced slot {} is still live", h.slot));
                }
                let logged = h.log.iter().copied().collect();
                if logs.insert(h.slot, (logged, h.count)).is_some() {
                    return Err(format!("slot {} has two holders", h.slot));
                }
            }
            Ok(())
        })?;
        let mut live_want = vec![0u64; self.slots.words()];
        let mut members = 0i64;
        for c in &cells {
            let st = lock(&c.state);
            if st.dead {
                return Err("a removed engine is still listed".into());
            }
            for (hs, live) in
                std::iter::once((&st.live, true)).chain(st.staged.as_ref().map(|s| (s, false)))
            {
                for (&id, h) in hs {
                    let (w, b) = word_bit(h.slot);
                    let meta = pack_meta(c.handle, (id >> 16) as u16, id as u16);
                    if self.slots.meta(h.slot) != meta {
                        return Err(format!("slot {} carries the wrong holder", h.slot));
                    }
                    if live {
                        live_want[w] |= b;
                        members += h.count as i64;
                    }
                    let logged = h.log.iter().copied().collect();
                    if logs.insert(h.slot, (logged, h.count)).is_some() {
                        return Err(format!("slot {} has two holders", h.slot));
                    }
                }
            }
        }
        for (w, &bits) in live_want.iter().enumerate() {
            if self.slots.live(w) != bits {
                return Err(format!(
                    "word {w}: live {:#x}, holders {:#x}",
                    self.slots.live(w),
                    bits
                ));
            }
        }
        if logs.len() != self.slots.in_use() {
            return Err(format!(
                "{} holders but {} slots in use",
                logs.len(),
                self.slots.in_use()
            ));
        }
        let mut held: HashMap<u32, usize> = HashMap::new();
        for (k, w, bits) in self.blocks.all() {
            if bits == 0 {
                return Err(format!("entry {k:?}/{w} has no holder"));
            }
            let mut rest = bits;
            while rest != 0 {
                let slot = w * 64 + rest.trailing_zeros();
                rest &= rest - 1;
                match logs.get(&slot) {
                    None => return Err(format!("entry {k:?}: bit of unused slot {slot}")),
                    Some((logged, _)) if !logged.contains(&k) => {
                        return Err(format!("slot {slot} holds {k:?} without logging it"))
                    }
                    Some(_) => *held.entry(slot).or_default() += 1,
                }
            }
        }
        for (slot, (_, count)) in &logs {
            if held.get(slot).copied().unwrap_or(0) != *count {
                return Err(format!(
                    "slot {slot} counts {count} blocks, holds {}",
                    held.get(slot).copied().unwrap_or(0)
                ));
            }
        }
        if self.counters.memberships.load(Ordering::Relaxed) != members {
            return Err(format!(
                "memberships counted {}, held {members}",
                self.counters.memberships.load(Ordering::Relaxed)
            ));
        }
        Ok(())
    }
}
