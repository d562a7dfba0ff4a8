//! KV-cache events for external indexers (vLLM's `BlockStored`, `BlockRemoved`,
//! `AllBlocksCleared`), queued until the caller drains them.

use crate::hashing::Digest;
use crate::sync::{lock, Mutex};

/// Where a block's KV lives (vLLM's `medium` field).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
        token_ids: Vec<u32>,
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

/// The queue; `None` inside the pool when events are disabled, so the hot path pays nothing.
pub struct EventLog {
    /// In the order the events took effect: a block's `BlockStored` is queued after its index
    /// entry exists and before any release of the block, hence before its `BlockRemoved`.
    queue: Mutex<Vec<KvEvent>>,
}

impl EventLog {
    pub fn new() -> Self {
        Self {
            queue: Mutex::new(Vec::new()),
        }
    }

    pub fn push(&self, event: KvEvent) {
        lock(&self.queue).push(event);
    }

    pub fn drain(&self) -> Vec<KvEvent> {
        std::mem::take(&mut *lock(&self.queue))
    }
}

impl Default for EventLog {
    fn default() -> Self {
        Self::new()
    }
}
