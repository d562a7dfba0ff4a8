//! KV-cache events for external indexers (vLLM's `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`), queued until the caller drains them, and the set of blocks they
//! describe, so that a consumer that fell behind can start again from a snapshot.

use std::sync::Arc;

use crate::error::{Error, Result};
pub use crate::event_set::EventSnapshot;
use crate::event_set::{BlockKey, EventSet};
use crate::hashing::Digest;
use crate::sync::{lock, Mutex};

/// Where a block's KV lives (vLLM's `medium` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    Gpu,
    Cpu,
}

impl Medium {
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpu => "GPU",
            Self::Cpu => "CPU",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    BlockStored {
        block_hash: Digest,
        parent_block_hash: Option<Digest>,
        /// Shared with the described set (one allocation per stored block).
        token_ids: Arc<[u32]>,
        lora_id: Option<u64>,
        medium: Medium,
        /// The KV-cache group (0 without groups): indexers key on `(group, block_hash)`.
        group: u8,
    },
    BlockRemoved {
        block_hash: Digest,
        medium: Medium,
        group: u8,
    },
    AllBlocksCleared,
}

/// The event queue's bound unless the caller sets another (`set_kv_event_capacity`): the
/// publisher's default (`queue_events`, 2**18), so that events nobody drains cost at most
/// about 50 MB; past it a push overflows as any bounded queue does.
pub const DEFAULT_EVENT_CAPACITY: usize = 1 << 18;

/// What `EventLog::stats` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventQueueStats {
    /// Events waiting to be drained.
    pub queued: usize,
    /// The most events the queue holds (`None`: unbounded).
    pub capacity: Option<usize>,
    /// Events never delivered: those queued when the queue overflowed, and every one since,
    /// until the next snapshot.
    pub dropped: u64,
    /// Times the queue overflowed.
    pub overflows: u64,
    /// Blocks the events so far describe (what a snapshot lists).
    pub blocks: usize,
}

/// Everything behind the log's one lock. Each field's invariant holds whenever the lock is
/// free.
struct Log {
    /// The events not yet drained, in the order they took effect. Empty while `overflowed`.
    queue: Vec<KvEvent>,
    /// The most events `queue` holds (`DEFAULT_EVENT_CAPACITY` unless set); `usize::MAX`
    /// for unbounded.
    capacity: usize,
    /// A push found the queue full since the last snapshot: events were lost, so `drain`
    /// refuses until a snapshot starts the consumer again.
    overflowed: bool,
    dropped: u64,
    overflows: u64,
    /// The fold of every event pushed so far, applied as an indexer applies them (stored:
    /// insert; removed: remove; cleared: empty). So a snapshot plus the events queued after
    /// it describe exactly what the whole stream would. Kept in the order blocks were
    /// stored, in chunks a snapshot takes without copying (`event_set`).
    described: EventSet,
    #[cfg(feature = "lock-timing")]
    holds: LockHolds,
}

/// The longest holds of the log's lock since the last reset (feature `lock-timing`, for the
/// `snapshot_costs` example): what a registration or eviction could wait for.
#[cfg(feature = "lock-timing")]
#[derive(Debug, Default, Clone)]
pub struct LockHolds {
    pub pushes: u64,
    /// The pushes that held it over 100 us, and the longest.
    pub pushes_over_100us: u64,
    pub push_max: std::time::Duration,
    /// Of the pushes, those that copied a chunk or segment a snapshot held, those of them
    /// that held it over 100 us, and their longest.
    pub copying: u64,
    pub copying_over_100us: u64,
    pub copying_max: std::time::Duration,
    /// Every snapshot's hold.
    pub snapshots: Vec<std::time::Duration>,
}

/// The queue; `None` inside the pool when events are disabled, so the hot path pays nothing.
pub struct EventLog {
    /// One lock for the queue and the described set, so that a snapshot is taken between two
    /// events: callers push each index change's event under that change's stripe (the pool
    /// documents the order), and the event order is the order of this lock.
    log: Mutex<Log>,
}

impl EventLog {
    pub fn new() -> Self {
        Self {
            log: Mutex::new(Log {
                queue: Vec::new(),
                capacity: DEFAULT_EVENT_CAPACITY,
                overflowed: false,
                dropped: 0,
                overflows: 0,
                described: EventSet::default(),
                #[cfg(feature = "lock-timing")]
                holds: LockHolds::default(),
            }),
        }
    }

    pub fn push(&self, event: KvEvent) {
        let mut log = lock(&self.log);
        #[cfg(feature = "lock-timing")]
        let (start, copies) = (
            std::time::Instant::now(),
            crate::event_set::COPIES.load(std::sync::atomic::Ordering::Relaxed),
        );
        let garbage = Self::push_locked(&mut log, event);
        #[cfg(feature = "lock-timing")]
        {
            let held = start.elapsed();
            let h = &mut log.holds;
            h.pushes += 1;
            h.pushes_over_100us += u64::from(held.as_micros() > 100);
            h.push_max = h.push_max.max(held);
            if crate::event_set::COPIES.load(std::sync::atomic::Ordering::Relaxed) != copies {
                h.copying += 1;
                h.copying_over_100us += u64::from(held.as_micros() > 100);
                h.copying_max = h.copying_max.max(held);
            }
        }
        drop(log);
        // What the push let go of (a dropped queue, a cleared set) is freed after the lock.
        drop(garbage);
    }

    /// Apply `event` (under the lock); returns what it let go of, to free after the lock.
    fn push_locked(log: &mut Log, event: KvEvent) -> (Vec<KvEvent>, Option<EventSet>) {
        let mut cleared = None;
        match &event {
            KvEvent::BlockStored {
                block_hash,
                parent_block_hash,
                token_ids,
                lora_id,
                medium,
                group,
            } => {
                let key = BlockKey {
                    medium: *medium,
                    group: *group,
                    digest: *block_hash,
                };
                log.described
                    .store(key, *parent_block_hash, token_ids, *lora_id);
            }
            KvEvent::BlockRemoved {
                block_hash,
                medium,
                group,
            } => {
                log.described.remove(&BlockKey {
                    medium: *medium,
                    group: *group,
                    digest: *block_hash,
                });
            }
            KvEvent::AllBlocksCleared => cleared = Some(log.described.clear()),
        }
        let mut dropped = Vec::new();
        if log.overflowed {
            log.dropped = log.dropped.saturating_add(1);
        } else if log.queue.len() >= log.capacity {
            // Full: what is queued no longer leads to the described set without the events
            // that do not fit, so it is dropped too (its memory with it).
            let lost = log.queue.len() as u64 + 1;
            dropped = std::mem::take(&mut log.queue);
            log.overflowed = true;
            log.overflows = log.overflows.saturating_add(1);
            log.dropped = log.dropped.saturating_add(lost);
        } else {
            log.queue.push(event);
        }
        (dropped, cleared)
    }

    /// The queued events, in order; refused (changing nothing) once the queue overflowed,
    /// until `snapshot`.
    pub fn drain(&self) -> Result<Vec<KvEvent>> {
        let mut log = lock(&self.log);
        if log.overflowed {
            return Err(Error::EventsOverflowed {
                capacity: log.capacity,
                dropped: log.dropped,
            });
        }
        Ok(std::mem::take(&mut log.queue))
    }

    /// The described set as one `BlockStored` per block (parents before children; otherwise
    /// oldest first: `event_set`), at a point between two events: the queue is emptied and
    /// the overflow forgotten, so the next `drain` returns exactly the events after the
    /// snapshot. Under the lock only the set's chunk list is cloned; the order is worked out
    /// after it, so no registration or eviction waits for a pass over the set.
    pub fn snapshot(&self) -> EventSnapshot {
        let frozen = {
            let mut log = lock(&self.log);
            #[cfg(feature = "lock-timing")]
            let start = std::time::Instant::now();
            let queued = std::mem::take(&mut log.queue);
            log.overflowed = false;
            let frozen = log.described.freeze();
            #[cfg(feature = "lock-timing")]
            {
                let held = start.elapsed();
                log.holds.snapshots.push(held);
            }
            (frozen, queued)
        };
        // The events the snapshot replaces are freed after the lock.
        drop(frozen.1);
        frozen.0.order()
    }

    /// The longest lock holds since the last call (feature `lock-timing`).
    #[cfg(feature = "lock-timing")]
    pub fn take_lock_holds(&self) -> LockHolds {
        std::mem::take(&mut lock(&self.log).holds)
    }

    /// `n` drained events never reached the consumer (the caller failed to hand them on):
    /// the log counts them and refuses drains until a snapshot, as after an overflow.
    pub fn lost(&self, n: usize) {
        let mut log = lock(&self.log);
        let queued = std::mem::take(&mut log.queue);
        log.overflowed = true;
        log.overflows = log.overflows.saturating_add(1);
        log.dropped = log.dropped.saturating_add(n as u64);
        drop(log);
        drop(queued);
    }

    /// Bound the queue at `capacity` events (`None`: unbounded). A queue already longer
    /// overflows at its next push.
    pub fn set_capacity(&self, capacity: Option<usize>) -> Result<()> {
        if capacity == Some(0) {
            return Err(Error::InvalidArgument(
                "the KV event queue's capacity must be at least 1 (or None: unbounded)".into(),
            ));
        }
        lock(&self.log).capacity = capacity.unwrap_or(usize::MAX);
        Ok(())
    }

    pub fn stats(&self) -> EventQueueStats {
        let log = lock(&self.log);
        EventQueueStats {
            queued: log.queue.len(),
            capacity: (log.capacity != usize::MAX).then_some(log.capacity),
            dropped: log.dropped,
            overflows: log.overflows,
            blocks: log.described.len(),
        }
    }
}

impl Default for EventLog {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::hashing::{BlockHasher, HashAlgo};

    fn d(token: u32) -> Digest {
        let h = BlockHasher::new(HashAlgo::Xxh3_128, 0);
        h.hash_block(&h.root(), &[token], &[0])
    }

    fn stored(block: Digest, parent: Option<Digest>, medium: Medium) -> KvEvent {
        KvEvent::BlockStored {
            block_hash: block,
            parent_block_hash: parent,
            token_ids: vec![7, 8].into(),
            lora_id: None,
            medium,
            group: 0,
        }
    }

    fn removed(block: Digest) -> KvEvent {
        KvEvent::BlockRemoved {
            block_hash: block,
            medium: Medium::Gpu,
            group: 0,
        }
    }

    fn hashes(events: &[KvEvent]) -> Vec<(Digest, Medium)> {
        events
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored {
                    block_hash, medium, ..
                } => (*block_hash, *medium),
                other => panic!("a snapshot lists BlockStored only, got {other:?}"),
            })
            .collect()
    }

    #[test]
    fn the_snapshot_is_the_fold_of_the_events_parents_first() {
        let log = EventLog::new();
        // The child is stored, then its parent is evicted and stored again (later stamp).
        log.push(stored(d(1), None, Medium::Gpu));
        log.push(stored(d(2), Some(d(1)), Medium::Gpu));
        log.push(removed(d(1)));
        log.push(stored(d(1), None, Medium::Gpu));
        log.push(stored(d(3), None, Medium::Cpu));
        log.push(stored(d(4), None, Medium::Gpu));
        log.push(removed(d(4)));
        let snap = log.snapshot().to_vec();
        assert_eq!(
            hashes(&snap),
            vec![
                (d(1), Medium::Gpu),
                (d(2), Medium::Gpu),
                (d(3), Medium::Cpu)
            ]
        );
        assert_eq!(
            snap[1],
            stored(d(2), Some(d(1)), Medium::Gpu),
            "tokens and parent kept"
        );
        assert_eq!(log.drain(), Ok(vec![]), "the snapshot empties the queue");
        log.push(KvEvent::AllBlocksCleared);
        assert!(log.snapshot().is_empty(), "cleared: nothing described");
    }

    #[test]
    fn a_block_whose_parent_is_stored_after_it_comes_right_after_the_parent() {
        // Issue 32, item 11: the order is worked out after the lock, from the log; a child
        // stored before its parent waits for it (before, its chain was listed at its place,
        // by a walk up the whole set under the lock).
        let log = EventLog::new();
        log.push(stored(d(3), Some(d(2)), Medium::Gpu)); // C, its parent P absent
        log.push(stored(d(9), None, Medium::Gpu)); // X
        log.push(stored(d(4), Some(d(3)), Medium::Gpu)); // C's child, after X
        log.push(stored(d(2), None, Medium::Gpu)); // P
        assert_eq!(
            hashes(&log.snapshot().to_vec()),
            [9, 2, 3, 4].map(|t| (d(t), Medium::Gpu))
        );
    }

    #[test]
    fn a_parent_cycle_from_colliding_digests_ends() {
        let log = EventLog::new();
        log.push(stored(d(1), Some(d(2)), Medium::Gpu));
        log.push(stored(d(2), Some(d(1)), Medium::Gpu));
        let mut got = hashes(&log.snapshot().to_vec());
        got.sort_by_key(|(h, _)| h.as_bytes().to_vec());
        let mut want = vec![(d(1), Medium::Gpu), (d(2), Medium::Gpu)];
        want.sort_by_key(|(h, _)| h.as_bytes().to_vec());
        assert_eq!(got, want, "each block once");
    }

    #[test]
    fn a_full_queue_overflows_one_past_its_capacity() {
        let log = EventLog::new();
        log.set_capacity(Some(2)).unwrap();
        log.push(stored(d(1), None, Medium::Gpu));
        log.push(stored(d(2), None, Medium::Gpu));
        let at = log.stats();
        assert_eq!(
            (at.queued, at.dropped, at.overflows),
            (2, 0, 0),
            "at capacity: kept"
        );
        assert_eq!(at.capacity, Some(2));
        assert_eq!(log.drain().unwrap().len(), 2);
        log.push(stored(d(3), None, Medium::Gpu));
        log.push(removed(d(1)));
        log.push(stored(d(4), None, Medium::Gpu)); // one past: overflows
        log.push(removed(d(2)));
        let past = log.stats();
        assert_eq!((past.queued, past.dropped, past.overflows), (0, 4, 1));
        assert_eq!(past.blocks, 2, "the described set follows every event");
        let refused = log.drain();
        assert_eq!(
            refused,
            Err(Error::EventsOverflowed {
                capacity: 2,
                dropped: 4
            })
        );
        assert_eq!(log.stats(), past, "a refused drain changes nothing");
        assert_eq!(
            hashes(&log.snapshot().to_vec()),
            vec![(d(3), Medium::Gpu), (d(4), Medium::Gpu)]
        );
        log.push(removed(d(3)));
        assert_eq!(
            log.drain(),
            Ok(vec![removed(d(3))]),
            "drains again after it"
        );
        let after = log.stats();
        assert_eq!((after.dropped, after.overflows), (4, 1), "tallies stay");
    }

    #[test]
    fn capacity_zero_is_refused_and_none_unbounds() {
        let log = EventLog::new();
        assert!(matches!(
            log.set_capacity(Some(0)),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(
            log.stats().capacity,
            Some(DEFAULT_EVENT_CAPACITY),
            "refused: unchanged (the default bound)"
        );
        log.set_capacity(Some(1)).unwrap();
        log.push(stored(d(1), None, Medium::Gpu));
        log.set_capacity(None).unwrap();
        (2..100).for_each(|t| log.push(stored(d(t), None, Medium::Gpu)));
        assert_eq!(log.drain().unwrap().len(), 99);
    }

    #[test]
    fn lowering_the_capacity_below_the_queue_overflows_at_the_next_push() {
        let log = EventLog::new();
        (0..5).for_each(|t| log.push(stored(d(t), None, Medium::Gpu)));
        log.set_capacity(Some(3)).unwrap();
        assert_eq!(log.stats().queued, 5, "nothing dropped until a push");
        log.push(stored(d(9), None, Medium::Gpu));
        let s = log.stats();
        assert_eq!((s.queued, s.dropped, s.overflows, s.blocks), (0, 6, 1, 6));
        assert!(log.drain().is_err());
    }

    #[test]
    fn events_a_caller_failed_to_hand_on_force_a_snapshot() {
        let log = EventLog::new();
        log.push(stored(d(1), None, Medium::Gpu));
        let drained = log.drain().unwrap();
        log.lost(drained.len());
        let s = log.stats();
        assert_eq!((s.dropped, s.overflows, s.blocks), (1, 1, 1));
        assert!(
            log.drain().is_err(),
            "the consumer must start again from a snapshot"
        );
        assert_eq!(hashes(&log.snapshot().to_vec()), vec![(d(1), Medium::Gpu)]);
        assert_eq!(log.drain(), Ok(vec![]));
    }

    #[test]
    fn the_overflow_tally_saturates() {
        let log = EventLog::new();
        log.set_capacity(Some(1)).unwrap();
        lock(&log.log).overflows = u64::MAX - 1;
        for round in 0..3 {
            log.push(stored(d(2 * round), None, Medium::Gpu));
            log.push(stored(d(2 * round + 1), None, Medium::Gpu)); // overflows
            log.snapshot();
        }
        assert_eq!(log.stats().overflows, u64::MAX);
    }

    #[test]
    fn the_dropped_tally_saturates() {
        let log = EventLog::new();
        log.set_capacity(Some(1)).unwrap();
        lock(&log.log).dropped = u64::MAX - 1;
        log.push(stored(d(1), None, Medium::Gpu));
        log.push(stored(d(2), None, Medium::Gpu)); // overflows: 2 lost
        log.push(stored(d(3), None, Medium::Gpu));
        assert_eq!(log.stats().dropped, u64::MAX);
    }
}
