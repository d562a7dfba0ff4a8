//! Engines and their holders: what one engine holds, per medium and group, and the lock that
//! orders its events.

use crate::key::BlockKey;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

/// An engine's id as the caller names it: a number (Dynamo's worker ids) or a name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EngineKey {
    Int(u64),
    Name(Arc<str>),
}

impl fmt::Display for EngineKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineKey::Int(i) => write!(f, "{i}"),
            EngineKey::Name(n) => write!(f, "{n}"),
        }
    }
}

impl From<u64> for EngineKey {
    fn from(v: u64) -> Self {
        EngineKey::Int(v)
    }
}

impl From<&str> for EngineKey {
    fn from(v: &str) -> Self {
        EngineKey::Name(v.into())
    }
}

/// A holder's id inside its engine: `medium << 16 | group`.
pub(crate) type HolderId = u32;

pub(crate) fn holder_id(medium: u16, group: u16) -> HolderId {
    (u32::from(medium) << 16) | u32::from(group)
}

/// One engine's blocks in one medium and group.
///
/// Whether it holds a block is its bit in the block map (`blocks.rs`), the one place a
/// lookup reads. The holder keeps only what it needs to drop its blocks without a scan:
/// a log of the blocks it stored, appended in order (no random access, 8 bytes an integer
/// hash). A removed block stays in the log until the log is compacted; clearing unsets the
/// log's blocks, and unsetting a bit already clear changes nothing.
pub(crate) struct Holder<K> {
    /// Its slot (`slots.rs`): the bit it sets in the blocks it holds.
    pub slot: u32,
    /// Invariant: every block whose bit of `slot` is set is in `log` (at least once).
    pub log: Vec<K>,
    /// Blocks whose bit of `slot` is set.
    pub count: usize,
}

impl<K: BlockKey> Holder<K> {
    pub fn new(slot: u32) -> Self {
        Self {
            slot,
            log: Vec::new(),
            count: 0,
        }
    }

    /// Whether the log has grown past twice what it must hold (plus `slack`), so that
    /// compacting it (`RouterIndex::compact`) costs a constant per logged store.
    pub fn log_is_long(&self, slack: usize) -> bool {
        self.log.len() > 2 * self.count + slack
    }
}

pub(crate) type Holders<K> = HashMap<HolderId, Holder<K>>;

pub(crate) struct EngineState<K> {
    /// Removed (`remove_engine`): a call that found this cell before the removal finds the
    /// engine again (a new cell) rather than writing into a dropped one.
    pub dead: bool,
    /// The holders lookups count (their slots are live).
    pub live: Holders<K>,
    /// A snapshot being received (`begin_snapshot`): holders whose slots are not live until
    /// `commit_snapshot` swaps them for `live`.
    pub staged: Option<Holders<K>>,
}

/// An engine. Its lock orders its events (one stream applies in sequence) and guards its
/// holders; lookups never take it.
pub(crate) struct EngineCell<K> {
    /// The number its holders' slots carry in their meta (never reused).
    pub handle: u32,
    pub state: Mutex<EngineState<K>>,
}
