//! The manager's KV event calls: drain, snapshot, the queue's bound and its tallies. The
//! events themselves are queued by the pool, under each index change's stripe.

use crate::error::{invalid, Result};
use crate::events::{EventLog, EventQueueStats, EventSnapshot, KvEvent};
use crate::manager::BlockManager;

impl BlockManager {
    /// The KV events since the last drain (or snapshot), in order; none when events are
    /// disabled. Refused, changing nothing, once the bounded queue overflowed: take
    /// `kv_event_snapshot` then.
    pub fn drain_events(&self) -> Result<Vec<KvEvent>> {
        self.gpu.drain_events()
    }

    /// Every block the events so far describe, as `BlockStored` events (parents first),
    /// taken between two events: the queue restarts empty, so the drains that follow give
    /// exactly the changes after it (docs/events.md, "Resynchronising"). Its events are made
    /// as it is iterated; registrations and evictions never wait for it beyond a copy of
    /// the set's chunk list (`event_set`).
    pub fn kv_event_snapshot(&self) -> Result<EventSnapshot> {
        Ok(self.event_log()?.snapshot())
    }

    /// Bound the event queue at `capacity` events (`None`: unbounded; the default bound is
    /// `DEFAULT_EVENT_CAPACITY`, the publisher's). A push
    /// that finds it full drops the queue and every event until the next snapshot.
    pub fn set_kv_event_capacity(&self, capacity: Option<usize>) -> Result<()> {
        self.event_log()?.set_capacity(capacity)
    }

    /// `n` events taken by `drain_events` or `kv_event_snapshot` never reached the consumer
    /// (converting them failed): drains refuse until the next snapshot, as after an overflow.
    pub fn kv_events_lost(&self, n: usize) {
        if let Some(log) = self.gpu.event_log() {
            log.lost(n);
        }
    }

    /// The longest holds of the event log's lock since the last call (feature
    /// `lock-timing`: the `snapshot_costs` example).
    #[cfg(feature = "lock-timing")]
    pub fn take_kv_event_lock_holds(&self) -> Result<crate::events::LockHolds> {
        Ok(self.event_log()?.take_lock_holds())
    }

    pub fn kv_event_queue_stats(&self) -> Result<EventQueueStats> {
        Ok(self.event_log()?.stats())
    }

    fn event_log(&self) -> Result<&EventLog> {
        self.gpu.event_log().ok_or_else(|| {
            invalid("KV events are disabled: build the manager with enable_kv_events=True")
        })
    }
}
