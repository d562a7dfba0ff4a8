//! pagedkv-core: a paged KV-cache block manager with no Python dependency.
//!
//! The parts, one file each.
//!
//! - Blocks: `block_state` (one atomic word per block: refcount, hashed, generation),
//!   `free_stack` (lock-free LIFO of free ids), `lru_queue` (eviction order of cached blocks),
//!   `prefix_index` (digest -> block, lock-free reads), `block_pool` (the lifecycle
//!   transitions, admission, per-group tallies), `cpu_pool` (swap space).
//! - Content: `hashing` (chained digests, group keys), `hit_tag` (secret tags that confirm
//!   hits under a weak hash).
//! - Sequences: `sequence` (a sequence's tables, one per group), `seq_map` (live ids and how
//!   they come and go), `gate` (reset excludes every ownership change).
//! - The manager, split by operation: `manager` (the struct, construction, locking helpers),
//!   `allocate`, `schedule` (append, extend), `keys` (caller keys, held registration),
//!   `truncate`, `lifecycle` (fork, free, reset), `swap`, `admission` (lookup, can_allocate),
//!   `queries`, `batch` (with `lookahead`: the draft slots per sequence of a step's queries),
//!   `decode` (the one-token step), `running` (persistent running batches), `audit`,
//!   `engine_record` (an engine adapter's per-request counters and its decode step).
//! - KV-cache groups: `policy` (what each kind of group keeps; the hybrid hit), `grouped`
//!   (the operations on every layout but one full-attention group).
//! - Pool-level calls: `pool_calls` (`evict_blocks`, `allocation_cost`, `lookup_blocks`).
//! - Device duties: `duties` (the evictions a call must copy out, returned to it).
//! - `events`, `stats`, `counters`, `config`, `error`, `alloc` (fallible allocation).
//!
//! Lifecycle of a GPU block (docs/semantics.md): FREE -> OWNED(rc >= 1) -> FREE (unhashed) or
//! CACHED (hashed, rc 0) -> OWNED (prefix hit) or evicted -> OWNED by a new holder.
//! FREE + OWNED + CACHED = num_blocks at every quiescent moment (`check_invariants`).

mod admission;
mod alloc;
mod allocate;
mod audit;
mod batch;
mod block_pool;
mod block_state;
mod broken;
mod clock;
mod config;
mod counters;
mod cpu_copies;
mod cpu_pool;
mod decode;
mod decode_in_place;
pub mod duties;
#[cfg(all(test, not(loom)))]
mod duties_tests;
mod engine_record;
mod error;
mod event_calls;
mod event_set;
mod events;
mod eviction;
mod eviction_order;
mod free_stack;
mod gate;
mod grouped;
#[cfg(all(test, not(loom)))]
mod guard_tests;
mod hashing;
mod hit_tag;
mod id_hasher;
mod keys;
mod lifecycle;
#[cfg(all(test, not(loom)))]
mod lock_choice_tests;
mod lookahead;
#[cfg(all(test, loom))]
mod loom_models;
mod lru_queue;
mod manager;
#[cfg(all(test, not(loom)))]
mod partial_block_tests;
mod pins;
mod policy;
mod pool_audit;
mod pool_calls;
#[cfg(all(test, not(loom)))]
mod pool_calls_tests;
mod prefix_index;
mod queries;
mod retention;
mod running;
mod schedule;
mod seq_map;
mod sequence;
mod stats;
mod swap;
mod sync;
mod tenants;
mod truncate;

pub use admission::PromptLen;
pub use allocate::AllocateOpts;
pub use block_state::RC_MAX;
pub use config::{Config, MAX_BLOCKS};
pub use engine_record::{DecodeCall, DecodeOut, DecodePlan, EngineRecord, SeqHandle};
pub use error::{Error, Result};
pub use events::{EventQueueStats, EventSnapshot, KvEvent, Medium, DEFAULT_EVENT_CAPACITY};
pub use eviction::{EvictionKind, Retention, DEFAULT_PRIORITY, MAX_PRIORITY};
pub use grouped::NULL;
pub use hashing::{encode_extras, BlockHasher, Digest, HashAlgo, Tag, MAX_KEY_LEN};
pub use keys::PromptKeys;
pub use lookahead::Lookahead;
pub use manager::{BlockManager, MAX_TOKENS};
pub use policy::{GroupKind, MAX_GROUPS};
pub use retention::{RetentionRange, RetentionSpec};
pub use running::{RunningBatch, StepOut};
pub use stats::{AllocStatus, GroupStats, Stats};
#[cfg(not(loom))]
pub use sync::nonblocking;
pub use tenants::{Quota, TenantStats, UNSALTED};
